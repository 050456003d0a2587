"""A pool of processes, started once, that host the production `Worker` over real gloo process
groups: each training job is a new process-group generation on the same processes (as after an
elastic re-form), so comparing many pipeline configurations costs no start-up per run.

The controller and Ray are not involved (the Ray tests cover that path); the worker is driven the
way the controller drives it: setup, build, run_steps per span, then its state is read back.
"""

from __future__ import annotations

import os
import sys
import traceback
from dataclasses import asdict
from typing import Any

import torch
import torch.multiprocessing as mp

from relaytrain.config.sections import RunConfig
from relaytrain.data.dataset import TokenDataset
from relaytrain.runtime import rendezvous

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))
JOB_TIMEOUT = 90.0


def _job(rank: int, job: dict[str, Any]) -> dict[str, Any] | None:
    from relaytrain.checkpoint.keys import model_tensors
    from relaytrain.data.eval_sets import OWN_EVAL_SET
    from relaytrain.parallel.groups import placements
    from relaytrain.parallel.shards import whole_tensor
    from relaytrain.runtime.worker import Worker

    cfg = job["config"]
    p = cfg.parallel
    if rank >= cfg.world_size:
        return None
    place = placements(range(cfg.world_size), cfg.data_parallel, p.pp, p.fsdp, p.cp,
                       p.shard_over_cp)[rank]
    worker = Worker(cfg, job["vocab"])
    try:
        worker.setup(job["generation"], place, job["store"], 30.0)
        worker.build(0)
        steps, first = [], 1
        for count in job["spans"]:
            steps += worker.run_steps(first, count)
            first += count
        heldout = worker.evaluate({OWN_EVAL_SET: job["heldout"]})[OWN_EVAL_SET] \
            if job["heldout"] else {}
        weights = {k: whole_tensor(v).numpy().copy()  # sharded: gathered (collectively)
                   for k, v in model_tensors(worker.state.state_tensors()).items()}
    finally:
        worker.close()
    records = [{k: v for k, v in asdict(s).items() if k != "written"} for s in steps]
    return {"rank": rank, "stage": place.stage, "dp_rank": place.dp_rank,
            "cp_rank": place.cp_rank, "steps": records, "weights": weights, "heldout": heldout}


def _serve(rank: int, conn: Any) -> None:
    torch.set_num_threads(1)
    while (job := conn.recv()) is not None:
        try:
            conn.send(("ok", _job(rank, job)))
        except Exception:
            conn.send(("error", traceback.format_exc()))


class WorkerPool:
    """`n` worker processes; `train(cfg, spans)` runs one job on the first dp x fsdp x cp x
    pp of them."""

    def __init__(self, n: int):
        self.n = n
        self.generation = 0

    def __enter__(self) -> WorkerPool:
        self.store = rendezvous.serve("127.0.0.1")
        ctx = mp.get_context("spawn")
        sys.path.insert(0, ROOT)  # the children import this module by name
        try:
            self.conns, self.procs = [], []
            for rank in range(self.n):
                parent, child = ctx.Pipe()
                proc = ctx.Process(target=_serve, args=(rank, child), daemon=True)
                proc.start()
                self.conns.append(parent)
                self.procs.append(proc)
        finally:
            sys.path.remove(ROOT)
        return self

    def __exit__(self, *exc: Any) -> None:
        for conn in self.conns:
            conn.send(None)
        for proc in self.procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
        self.store.close()

    def train(self, cfg: RunConfig, spans: tuple[int, ...], heldout: tuple[int, ...] = ()
              ) -> list[dict[str, Any]]:
        """One result per rank: per-step results of `run_steps`, the held-out losses of
        instances `heldout` of the run's own held-out split after them (those this rank
        computes) and the final weights."""
        if cfg.world_size > self.n:
            raise ValueError(f"{cfg.world_size} ranks, pool of {self.n}")
        job = {"config": cfg, "vocab": TokenDataset.open(cfg.data.path).vocab_size,
               "generation": self.generation, "store": self.store.access, "spans": spans,
               "heldout": list(heldout)}
        self.generation += 1
        for conn in self.conns:
            conn.send(job)
        out, errors = [], []
        for rank, conn in enumerate(self.conns):
            if not conn.poll(JOB_TIMEOUT):
                raise TimeoutError(f"pool rank {rank} gave no answer in {JOB_TIMEOUT}s")
            status, result = conn.recv()
            if status == "error":
                errors.append(f"rank {rank}:\n{result}")
            elif result is not None:
                result["weights"] = {k: torch.from_numpy(v) for k, v in result["weights"].items()}
                out.append(result)
        if errors:
            raise RuntimeError("\n".join(errors))
        return out

