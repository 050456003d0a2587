"""The controller: one process that drives the workers through the step loop.

It owns the run directory (config, metrics, ledger), the checkpoint catalogue (it commits a
checkpoint once every writer reported its part), held-out evaluation and the alarms, and it
decides what happens on a failure. Workers only compute.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import yaml

from relaytrain.checkpoint.store import CheckpointStore
from relaytrain.config import RunConfig, load_config
from relaytrain.data.dataset import TokenDataset
from relaytrain.data.order import heldout_ids
from relaytrain.errors import ConfigError, UserError
from relaytrain.model.accounting import flops_per_token
from relaytrain.runtime.engines.base import Engine
from relaytrain.runtime.ledger import Ledger
from relaytrain.runtime.worker import Placement, pick_device
from relaytrain.train.metrics import (
    MemorisationAlarm,
    MetricsLog,
    SpikeDetector,
    TensorBoard,
    peak_flops,
    warn,
)
from relaytrain.train.optim import lr_at

# Keys that may change when a run is resumed; anything else must match the checkpoint.
RESUMABLE_CHANGES = ("train.max_steps", "train.device", "train.log_every", "train.spike_factor",
                     "parallel.", "runtime.", "elastic.", "faults.", "log.", "checkpoint.",
                     "eval.", "data.prefetch", "data.path", "run_dir")


class TrainingStopped(Exception):
    """The run stopped on purpose (divergence, memorisation alarm with stop_on_alarm)."""


@dataclass
class PendingCheckpoint:
    step: int
    parts: dict[str, dict] = field(default_factory=dict)
    expected: set[str] = field(default_factory=set)
    failed: bool = False


def make_engine(cfg: RunConfig) -> Engine:
    if cfg.runtime.engine == "ray":
        from relaytrain.runtime.engines.ray import RayEngine

        return RayEngine(cfg)
    from relaytrain.runtime.engines.inline import InlineEngine

    return InlineEngine()


def _flat(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict) and k != "overrides":
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def check_resume_compatible(saved: dict[str, Any], cfg: RunConfig) -> None:
    """A resumed run must keep what defines its curve: model, data order, optimizer, seed."""
    old, new = _flat(saved), _flat(cfg.to_dict())
    for key in sorted(set(old) | set(new)):
        if key.startswith(RESUMABLE_CHANGES) or key in RESUMABLE_CHANGES:
            continue
        if old.get(key) != new.get(key):
            raise ConfigError(
                f"config key '{key}': the run directory's checkpoints were trained with "
                f"{old.get(key)!r}, got {new.get(key)!r}; only train.max_steps, parallel.*, "
                "runtime.*, eval.*, checkpoint.*, elastic.*, faults.* and log.* may change on "
                "resume (or use a new run_dir)")


class Controller:
    def __init__(self, cfg: RunConfig, quiet: bool = False):
        if not cfg.run_dir:
            raise ConfigError("config key 'run_dir' is empty; give a directory for the run's "
                              "metrics, ledger and checkpoints (e.g. run_dir=runs/demo)")
        if not cfg.data.path:
            raise ConfigError("config key 'data.path' is empty; give a directory written by "
                              "`relaytrain data prepare`")
        self.cfg = cfg
        self.quiet = quiet
        self.dataset = TokenDataset.open(cfg.data.path)
        self.model_cfg = cfg.model_config(self.dataset.vocab_size)
        n_train = self.dataset.split("train").num_instances(cfg.seq_len)
        if n_train < cfg.train.global_batch:
            raise UserError(f"data.path {cfg.data.path!r} has {n_train} training instances of "
                            f"data.seq_len={cfg.seq_len}; train.global_batch="
                            f"{cfg.train.global_batch} needs at least that many")
        self.n_train = n_train
        n_held = self.dataset.split("heldout").num_instances(cfg.seq_len)
        self.eval_ids = [int(i) for i in heldout_ids(n_held, cfg.eval.instances)] \
            if cfg.eval.every > 0 else []
        self.store = CheckpointStore(cfg.checkpoint.url or
                                     os.path.join(cfg.run_dir, "checkpoints"),
                                     keep_last=cfg.checkpoint.keep_last)
        self.engine: Engine | None = None
        self.ranks = list(range(cfg.world_size))
        self.pending: list[PendingCheckpoint] = []
        self.last_committed = 0
        self.spikes = SpikeDetector(cfg.train.spike_factor)
        self.alarm = MemorisationAlarm(cfg.eval.memo_gap, cfg.eval.memo_patience)
        self.recent_losses: list[float] = []
        self.tokens_per_step = cfg.train.global_batch * cfg.seq_len

    # ---- run directory ---------------------------------------------------------------------
    def _prepare_run_dir(self) -> int:
        """Create or reopen the run directory; the step to resume from (0: a fresh run)."""
        os.makedirs(self.cfg.run_dir, exist_ok=True)
        start = 0
        got = self.store.load_latest_good()
        if got is not None:
            manifest, _ = got
            if manifest.get("config"):
                check_resume_compatible(manifest["config"], self.cfg)
            fp = manifest.get("data", {}).get("fingerprint")
            if fp and fp != self.dataset.fingerprint:
                raise UserError(f"data.path {self.cfg.data.path!r} is not the data this run was "
                                f"trained on (fingerprint {self.dataset.fingerprint[:12]} != "
                                f"{fp[:12]}); point data.path at the original prepared data")
            start = int(manifest["step"])
            if start >= self.cfg.train.max_steps:
                raise UserError(f"run_dir {self.cfg.run_dir!r} already reached step {start}; "
                                f"raise train.max_steps above {start} to continue")
        self.last_committed = start
        with open(os.path.join(self.cfg.run_dir, "config.yaml"), "w") as f:
            yaml.safe_dump(self.cfg.to_dict(), f, sort_keys=False)
        return start

    def _ledger_last_step(self, path: str) -> int:
        last = 0
        if os.path.exists(path):
            with open(path, encoding="utf-8") as f:
                for line in f:
                    try:
                        rec = json.loads(line)
                    except json.JSONDecodeError:
                        continue
                    if rec.get("kind") == "step":
                        last = max(last, rec["step"])
                    elif rec.get("kind") == "rollback":
                        last = rec["to_step"]
        return last

    # ---- layout ----------------------------------------------------------------------------
    def placements(self) -> dict[int, Placement]:
        dp, pp = self.cfg.parallel.dp, self.cfg.parallel.pp
        return {r: Placement(rank=r, world=dp * pp, dp_rank=r % dp, dp=dp, stage=r // dp, pp=pp)
                for r in self.ranks}

    def writer_parts(self) -> dict[int, str]:
        """Rank -> checkpoint part: DP rank 0 of every stage writes its stage's tensors."""
        return {r: f"stage{p.stage}" for r, p in self.placements().items() if p.dp_rank == 0}

    # ---- the loop --------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        cfg = self.cfg
        start = self._prepare_run_dir()
        metrics = MetricsLog(os.path.join(cfg.run_dir, "metrics.jsonl"))
        tb = TensorBoard(os.path.join(cfg.run_dir, "tensorboard")) if cfg.log.tensorboard \
            else None
        ledger_path = os.path.join(cfg.run_dir, "ledger.jsonl")
        ledger_last = self._ledger_last_step(ledger_path)
        ledger = Ledger(ledger_path)
        ledger.rollback(list(range(start + 1, ledger_last + 1)), start)
        ledger.header(seed=cfg.seed, global_batch=cfg.train.global_batch,
                      micro_batch=cfg.train.micro_batch, seq_len=cfg.seq_len,
                      n_instances=self.n_train, fingerprint=self.dataset.fingerprint,
                      data_path=os.path.abspath(cfg.data.path), dp=cfg.parallel.dp,
                      start_step=start)
        if start > 0:
            metrics.write("restart", step=start)
        self.engine = make_engine(cfg)
        summary: dict[str, Any] = {}
        bar = None
        try:
            t_setup = time.perf_counter()
            self.engine.start(self.ranks, (cfg.to_dict(), self.dataset.vocab_size))
            self._form_generation(0, start)
            setup_s = time.perf_counter() - t_setup
            device = pick_device(cfg.train.device)
            peak, peak_src = peak_flops(device, cfg.runtime.threads_per_worker)
            peak *= cfg.world_size
            fpt = flops_per_token(self.model_cfg, cfg.seq_len)
            if cfg.log.progress and not self.quiet:
                from tqdm import tqdm

                bar = tqdm(total=cfg.train.max_steps, initial=start, unit="step",
                           dynamic_ncols=True, file=sys.stderr, desc="train")
            last = {"loss": math.nan}
            heldout = math.nan
            for step in range(start + 1, cfg.train.max_steps + 1):
                t0 = time.perf_counter()
                results = self.engine.call_all(self.ranks, "run_step", step,
                                               timeout=cfg.runtime.call_timeout)
                t1 = time.perf_counter()
                rec = self._combine(step, results)
                ledger.step(step, self._parts(results))
                if not rec["finite"]:
                    metrics.write("nan", step=step, message=f"non-finite loss/gradient at step "
                                  f"{step}: loss={rec['loss']} grad_norm={rec['grad_norm']}")
                    raise TrainingStopped(
                        f"training diverged at step {step} (loss {rec['loss']}, grad norm "
                        f"{rec['grad_norm']}); the update was skipped and the last good "
                        f"checkpoint (step {self.last_committed}) is intact")
                self._absorb_writes(results)
                t_ckpt = 0.0
                due = (cfg.checkpoint.every and step % cfg.checkpoint.every == 0) \
                    or step == cfg.train.max_steps
                if due:
                    t_ckpt = self._save(step)
                elapsed = time.perf_counter() - t0
                tps = self.tokens_per_step / elapsed
                rec.pop("finite")
                last = metrics.write(
                    "step", step=step, **rec, tokens=step * self.tokens_per_step,
                    tokens_per_s=tps, mfu=(tps * fpt / peak) if peak else 0.0,
                    time_data=max(r["time_data"] for r in results.values()),
                    time_compute=t1 - t0, time_checkpoint=t_ckpt)
                if tb:
                    tb.write(last)
                spike = self.spikes.check(rec["loss"])
                if spike:
                    metrics.write("spike", step=step, message=spike)
                    warn(f"step {step}: {spike}")
                self.recent_losses.append(rec["loss"])
                if self.eval_ids and (step % cfg.eval.every == 0 or
                                      step == cfg.train.max_steps):
                    heldout = self._evaluate(step, metrics, tb)
                if bar is not None:
                    bar.set_postfix(loss=f"{rec['loss']:.3f}", heldout=f"{heldout:.3f}",
                                    tok_s=f"{tps:,.0f}", refresh=False)
                    bar.update(1)
            self._finish_writes()
            summary = {"run_dir": cfg.run_dir, "steps": cfg.train.max_steps,
                       "resumed_from": start, "final_loss": last.get("loss"),
                       "final_heldout_loss": heldout, "checkpoint_step": self.last_committed,
                       "setup_s": setup_s, "peak_flops": peak, "peak_source": peak_src,
                       "metrics": os.path.join(cfg.run_dir, "metrics.jsonl"),
                       "checkpoints": self.store.url}
            return summary
        finally:
            if bar is not None:
                bar.close()
            metrics.close()
            ledger.close()
            if tb:
                tb.close()
            self.engine.shutdown()

    def _form_generation(self, generation: int, restore_step: int) -> None:
        assert self.engine is not None
        timeout = self.cfg.runtime.setup_timeout
        store = None
        host, port = self.engine.store_host(), None
        if len(self.ranks) > 1:
            import torch.distributed as dist

            store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False)
            port = store.port
        self._store = store  # keep the TCPStore alive as long as the generation
        self.engine.call({r: ("setup", (generation, p, host, port, timeout))
                          for r, p in self.placements().items()}, timeout)
        self.engine.call_all(self.ranks, "build", restore_step, timeout=timeout)

    def _combine(self, step: int, results: dict[int, dict]) -> dict[str, Any]:
        """Step loss from every micro-batch's loss, summed in micro-batch order so the number
        does not depend on how micro-batches were split over ranks."""
        losses: dict[int, tuple[float, float, float]] = {}
        for r in results.values():
            losses.update({int(k): v for k, v in r["losses"].items()})
        m = self.cfg.micro_batches
        order = [losses[j] for j in range(m)]
        total = math.fsum(v[0] for v in order) / m
        ce = math.fsum(v[1] for v in order) / m
        z = math.fsum(v[2] for v in order) / m
        first = results[self.ranks[0]]
        return {"loss": total, "ce_loss": ce, "z_loss": z, "grad_norm": first["grad_norm"],
                "lr": lr_at(step, self.cfg.optim, self.cfg.train.max_steps),
                "finite": all(r["finite"] for r in results.values())}

    def _parts(self, results: dict[int, dict]) -> list[list[int]]:
        parts: dict[int, list[int]] = {}
        for r, p in self.placements().items():
            if p.stage == 0:
                parts[p.dp_rank] = results[r]["ids"]
        return [parts[i] for i in range(self.cfg.parallel.dp)]

    # ---- checkpoints -----------------------------------------------------------------------
    def _save(self, step: int) -> float:
        assert self.engine is not None
        writers = self.writer_parts()
        t0 = time.perf_counter()
        self.engine.call({r: ("save", (step, part)) for r, part in writers.items()},
                         self.cfg.runtime.call_timeout)
        self.pending.append(PendingCheckpoint(step, expected=set(writers.values())))
        if not self.cfg.checkpoint.async_write:
            self._finish_writes()
        return time.perf_counter() - t0

    def _absorb_writes(self, results: dict[int, dict]) -> None:
        for r in results.values():
            for w in r.get("written", []):
                self._record_write(w)
        self._commit_ready()

    def _record_write(self, w: dict[str, Any]) -> None:
        for p in self.pending:
            if p.step == w["step"]:
                if "error" in w:
                    p.failed = True
                    warn(f"checkpoint step {p.step}: writing part {w['part']} failed "
                         f"({w['error']}); it will not be committed")
                else:
                    p.parts[w["part"]] = w["info"]

    def _commit_ready(self) -> None:
        keep = []
        for p in self.pending:
            if p.failed:
                continue
            if set(p.parts) == p.expected:
                self.store.commit(p.step, p.parts, self._manifest_meta(p.step))
                self.last_committed = p.step
            else:
                keep.append(p)
        self.pending = keep

    def _finish_writes(self) -> None:
        assert self.engine is not None
        writers = list(self.writer_parts())
        done = self.engine.call_all(writers, "flush_writes", timeout=self.cfg.runtime.call_timeout)
        for ws in done.values():
            for w in ws:
                self._record_write(w)
        self._commit_ready()

    def _manifest_meta(self, step: int) -> dict[str, Any]:
        return {"model": self.model_cfg.to_dict(), "config": self.cfg.to_dict(),
                "data": {"batch_index": step, "fingerprint": self.dataset.fingerprint,
                         "n_instances": self.n_train, "seq_len": self.cfg.seq_len},
                # Nothing draws from global RNG state: init, data order and evaluation derive
                # from (seed, purpose, step), so the seed is the whole RNG state.
                "rng": {"seed": self.cfg.seed},
                "topology": {"dp": self.cfg.parallel.dp, "pp": self.cfg.parallel.pp}}

    # ---- evaluation ------------------------------------------------------------------------
    def _evaluate(self, step: int, metrics: MetricsLog, tb: TensorBoard | None) -> float:
        assert self.engine is not None
        results = self.engine.call_all(self.ranks, "evaluate", self.eval_ids,
                                       timeout=self.cfg.runtime.call_timeout)
        losses: dict[int, float] = {}
        for r in results.values():
            losses.update({int(k): v for k, v in r.items()})
        heldout = math.fsum(losses[i] for i in self.eval_ids) / len(self.eval_ids)
        recent = self.recent_losses[-max(1, self.cfg.eval.every):]
        train_loss = math.fsum(recent) / len(recent)
        rec = metrics.write("eval", step=step, tokens=step * self.tokens_per_step,
                            heldout_loss=heldout, heldout_ppl=math.exp(min(heldout, 50.0)),
                            train_loss=train_loss)
        if tb:
            tb.write(rec)
        message = self.alarm.update(train_loss, heldout)
        if message:
            metrics.write("alarm", step=step, message=message)
            warn(message)
            if self.cfg.eval.stop_on_alarm:
                raise TrainingStopped(f"stopped at step {step}: {message}")
        return heldout


def cli_train(args: Any) -> int:
    cfg = load_config(args.config, args.overrides)
    try:
        summary = Controller(cfg, quiet=args.json).run()
    except TrainingStopped as e:
        print(f"relaytrain: {e}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(summary))
    else:
        print(f"done: {summary['steps']} steps, final loss {summary['final_loss']:.4f}, "
              f"held-out loss {summary['final_heldout_loss']:.4f}")
        print(f"  metrics:     {summary['metrics']}")
        print(f"  checkpoints: {summary['checkpoints']} (step {summary['checkpoint_step']})")
        print(f"  plot:        relaytrain plot {cfg.run_dir}")
    return 0
