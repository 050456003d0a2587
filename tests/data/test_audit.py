"""`relaytrain data audit` proves exactly-once consumption of a correct run, and catches each
class of data bug injected on purpose: replay after a resume, identical data on all ranks, a
world-size-dependent order, a gap, and train/held-out contamination."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from relaytrain.cli import main
from relaytrain.data.audit import audit
from relaytrain.data.dataset import TokenDataset, TokenSplit
from relaytrain.data.ledger import LedgerWriter, header_record, rollback_record, step_record
from relaytrain.data.loader import Batch, Loader
from relaytrain.data.mix_index import index_mix
from relaytrain.data.order import Order
from relaytrain.data.prepare import prepare
from relaytrain.data.token_arrays import MixFile
from relaytrain.runtime import worker
from relaytrain.runtime.controller import Controller
from tests.runtime.conftest import tiny_config

from .conftest import EOS, write_corpus, write_tokens

SEED, B, M, SEQ = 11, 8, 2, 1024  # the test corpus gives 27 instances: ~3.4 steps per epoch
DATA_SEED = 34521  # a data order of another run's (AI2's), apart from the seed


class WorldSeededLoader(Loader):
    """The bug: the world size is mixed into the permutation seed."""

    def __init__(self, split: TokenSplit, seq_len: int, seed: int, global_batch: int,
                 micro_batch: int, dp_rank: int, dp_world: int) -> None:
        super().__init__(split, seq_len, seed, global_batch, micro_batch, dp_rank, dp_world)
        order = Order(seed * 1000 + dp_world, self.n_instances)
        self._global_batch = lambda k: order.global_batch(global_batch, k)


class Run:
    """Writes a run's ledger the way the controller does: the ids are what real loaders
    returned to each rank, optionally corrupted by `mutate(step, parts)`."""

    def __init__(self, run_dir: Path, data: Path, loader: type[Loader] = Loader,
                 order: str = "relay", seq: int = SEQ, data_seed: int = SEED,
                 trainer: dict | None = None) -> None:
        self.dir, self.data, self.loader_cls = run_dir, data, loader
        self.order, self.seq, self.data_seed = order, seq, data_seed
        # a continued run's carried trainer state (init.trainer_state): its start step, and
        # the global batch its first step trains on
        self.init = None if trainer is None else {"kind": "relaytrain", "from": "source",
                                                  "trainer": trainer}
        self.offset = 0 if trainer is None else trainer["batch"] - trainer["step"]
        self.dataset = TokenDataset.open(data)
        self.split = self.dataset.split("train")
        self.ledger = LedgerWriter(run_dir)
        self.loaders: list[Loader] = []

    def header(self, dp: int) -> dict:
        return header_record(seed=SEED, data_seed=self.data_seed, global_batch=B, micro_batch=M,
                             seq_len=self.seq, n_instances=self.split.num_instances(self.seq),
                             fingerprint=self.dataset.fingerprint, data_path=str(self.data),
                             dp=dp, order=self.order, init=self.init)

    def start(self, dp: int) -> Run:
        """A start, resume, recovery or resize: fresh loaders and a header."""
        extra = {"order": self.order} if self.order != "relay" else {}
        self.loaders = [self.loader_cls(self.split, self.seq, self.data_seed, B, M, r, dp,
                                        **extra)
                        for r in range(dp)]
        self.ledger.write(self.header(dp))
        return self

    def steps(self, first: int, last: int,
              mutate: Callable[[int, list[np.ndarray]], list[np.ndarray]] | None = None) -> Run:
        for k in range(first, last + 1):
            parts = [ld.get(k - 1 + self.offset).ids for ld in self.loaders]
            self.ledger.write(step_record(k, mutate(k, parts) if mutate else parts,
                                          k - 1 + self.offset))
        return self

    def rollback(self, steps: list[int], to_step: int) -> Run:
        self.ledger.write(rollback_record(steps, to_step))
        return self

    def audit(self, capsys: pytest.CaptureFixture[str]) -> tuple[int, dict]:
        self.ledger.close()
        for ld in self.loaders:
            ld.close()
        capsys.readouterr()
        code = main(["data", "audit", str(self.dir), "--json"])
        out = capsys.readouterr()
        self.stderr = out.err
        return code, json.loads(out.out.strip().splitlines()[-1])


def failed(report: dict) -> set[str]:
    return {name for name, r in report["results"].items() if not r["ok"]}


def test_a_correct_run_with_recovery_and_resizes_passes(prepared, tmp_path, capsys):
    run = Run(tmp_path, prepared).start(2).steps(1, 5)
    run.rollback([4, 5], to_step=3).start(2).steps(4, 7)  # recovery: steps 4, 5 redone
    run.start(4).steps(8, 12).start(2).steps(13, 14)  # grow to 4 ranks, shrink back to 2
    code, report = run.audit(capsys)
    assert code == 0 and report["ok"] and report["first_failure"] is None
    assert report["checks"] == {"passed": 9, "failed": 0}
    assert (report["steps"], report["instances"]) == (14, 14 * B)
    assert (report["epochs"], report["complete_epochs"]) == (5, 4)  # 112 uses of 27 instances
    assert (report["rollbacks"], report["resumes"], report["resizes"]) == (1, 3, 2)


def test_a_continued_run_passes_from_its_start_its_sources_part_of_the_epoch_counted(
        prepared, tmp_path, capsys):
    """A run continuing another's trainer state at step 5, its first step on global batch 6
    (instances 48.. of the stream: 21 into epoch 1, which the source consumed): its steps
    6..10 hold batches 6..10, every epoch it completes is complete with the source's part."""
    run = Run(tmp_path, prepared, trainer={"step": 5, "batch": 6}).start(2).steps(6, 8)
    run.start(1).steps(9, 10)  # a resume, resized
    code, report = run.audit(capsys)
    assert code == 0 and report["ok"], report["results"]
    assert report["results"]["no_gaps"]["detail"] == "steps 6..10 all present"
    assert "every step k holds pure global batch k-1 + 1 across 1 resumes" in \
        report["results"]["continuity"]["detail"]
    assert "; step 5 from init.from relaytrain source" in report["results"]["config"]["detail"]
    # epochs 1 (the source's 21 instances and 6 of step 6's) and 2 complete, 3 begun
    assert (report["steps"], report["epochs"], report["complete_epochs"]) == (5, 4, 2)


def test_a_continued_run_reusing_what_its_source_consumed_is_caught(prepared, tmp_path,
                                                                   capsys):
    used = Order(SEED, 27).global_batch(B, 5)[1]  # of epoch 1, the source's last batch

    def reuse(k: int, parts: list[np.ndarray]) -> list[np.ndarray]:
        parts[0] = parts[0].copy()  # step 6: positions 48..55, rank 0's 48..51 of epoch 1
        parts[0][0] = used[-1]
        return parts

    run = Run(tmp_path, prepared, trainer={"step": 5, "batch": 6}).start(2).steps(6, 6, reuse)
    code, report = run.audit(capsys)
    assert code == 1 and "exactly_once" in failed(report)
    assert f"instance {used[-1]} used twice in epoch 1 (the source's steps and 6)" in \
        report["results"]["exactly_once"]["detail"]


def test_replay_after_resume_is_caught(prepared, tmp_path, capsys):
    """The resumed loader restarts from an old cursor while the step counter goes on."""
    run = Run(tmp_path, prepared).start(2).steps(1, 6).start(2)
    for k in range(7, 11):
        run.ledger.write(step_record(k, [ld.get(k - 4).ids for ld in run.loaders]))
    code, report = run.audit(capsys)
    assert code == 1 and {"continuity", "exactly_once"} <= failed(report)
    first = report["first_failure"]
    assert (first["check"], first["step"]) == ("continuity", 7)
    assert "holds global batch 3 (that of step 4) instead of 6: a replay" in first["message"]
    assert "after the resume at step 6" in first["message"]
    assert run.stderr.startswith("relaytrain: audit failed: continuity: step 7: ")


class ReplayingLoader(Loader):
    """The bug, in a real loader: it restarts two batches back while the step counter goes on."""

    def get(self, batch_index: int) -> Batch:
        return super().get(batch_index - 2)


def audit_json(run_dir: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, dict]:
    capsys.readouterr()
    code = main(["data", "audit", str(run_dir), "--json"])
    return code, json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_a_real_run_whose_loader_replays_after_its_resume_fails_the_audit(
        tmp_path, corpus_data, capsys, monkeypatch):
    """Trained on the in-process engine, so the worker's loader can be swapped for the resume."""
    run, common = tmp_path / "run", ("eval.every=0", "checkpoint.every=2")
    Controller(tiny_config(run, corpus_data, *common, "train.max_steps=4")).run()
    monkeypatch.setattr(worker, "Loader", ReplayingLoader)
    Controller(tiny_config(run, corpus_data, *common, "train.max_steps=6")).run()
    code, report = audit_json(run, capsys)
    assert code == 1 and {"continuity", "exactly_once"} <= failed(report)
    first = report["first_failure"]
    assert (first["check"], first["step"]) == ("continuity", 5)
    assert "holds global batch 2 (that of step 3) instead of 4: a replay" in first["message"]
    assert "after the resume at step 4" in first["message"]


@pytest.fixture
def ray_with_same_shard_loaders():
    """A private Ray cluster whose worker processes load DP rank 0's instances on every rank
    (the bug: the shard is taken as rank 0's; each rank still fills its own micro-batch slots),
    patched at process start: a monkeypatch here cannot reach an actor's process."""

    def same_shard_on_every_rank() -> None:  # nested: Ray ships it by value
        from relaytrain.data.loader import Loader
        from relaytrain.runtime import worker

        class SameShardLoader(Loader):
            def __init__(self, split, seq_len, seed, global_batch, micro_batch, dp_rank,
                         dp_world, **kwargs):
                super().__init__(split, seq_len, seed, global_batch, micro_batch, dp_rank,
                                 dp_world, **kwargs)
                rank0 = Loader(split, seq_len, seed, global_batch, micro_batch, 0, dp_world,
                               **{**kwargs, "prefetch": 0})
                self._rows, self.positions = rank0._rows, rank0.positions
                rank0.close()

        worker.Loader = SameShardLoader

    import ray

    if ray.is_initialized():  # the session's shared cluster (tests/runtime/conftest.py)
        ray.shutdown()
    from relaytrain.runtime.engines.ray import _import_ray

    _import_ray(private_cluster=True)  # the token, as the process's Ray will read it
    ray.init(address="local", num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1",
             configure_logging=False, log_to_driver=False,
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"},
                          "worker_process_setup_hook": same_shard_on_every_rank})
    yield
    ray.shutdown()


# A private Ray cluster of its own (about a minute here); the same defect on the ledger:
# test_identical_data_on_all_ranks_is_caught
@pytest.mark.soak
@pytest.mark.timeout(240)
def test_a_real_dp_run_whose_ranks_all_load_the_same_shard_fails_the_audit(
        tmp_path, corpus_data, capsys, ray_with_same_shard_loaders):
    run = tmp_path / "run"
    Controller(tiny_config(run, corpus_data, "runtime.engine=ray", "parallel.dp=2",
                           "train.max_steps=2", "eval.every=0", "checkpoint.every=0")).run()
    code, report = audit_json(run, capsys)
    assert code == 1 and {"shards_disjoint", "shards_complete"} <= failed(report)
    first = report["first_failure"]
    assert (first["check"], first["step"]) == ("shards_disjoint", 1)
    assert "is on rank 0 and rank 1" in first["message"]


def test_identical_data_on_all_ranks_is_caught(prepared, tmp_path, capsys):
    run = Run(tmp_path, prepared).start(2).steps(1, 3, mutate=lambda k, p: [p[0], p[0]])
    code, report = run.audit(capsys)
    assert code == 1 and {"shards_disjoint", "shards_complete"} <= failed(report)
    first = report["first_failure"]
    assert (first["check"], first["step"]) == ("shards_disjoint", 1)
    assert "is on rank 0 and rank 1" in first["message"]


def test_a_world_size_dependent_order_is_caught_across_a_resize(prepared, tmp_path, capsys):
    run = Run(tmp_path, prepared, WorldSeededLoader).start(2).steps(1, 5).start(4).steps(6, 10)
    code, report = run.audit(capsys)
    assert code == 1 and {"continuity", "exactly_once"} <= failed(report)
    # Even without the pure order to compare with, mixing two orders repeats ids in an epoch.
    assert "used twice in epoch" in report["results"]["exactly_once"]["detail"]


def test_a_missing_step_is_caught(prepared, tmp_path, capsys):
    run = Run(tmp_path, prepared).start(1).steps(1, 3)
    run.loaders[0].get(3)  # step 4 runs but is never recorded
    run.steps(5, 6)
    code, report = run.audit(capsys)
    assert code == 1 and {"no_gaps", "exactly_once"} <= failed(report)
    assert (report["first_failure"]["check"], report["first_failure"]["step"]) == ("no_gaps", 4)


def test_the_last_record_of_a_step_wins_only_after_a_rollback(prepared, tmp_path, capsys):
    def wrong(k, parts):
        return [p[::-1] for p in parts[::-1]]

    run = Run(tmp_path, prepared).start(2).steps(1, 3).steps(4, 4, mutate=wrong)
    run.rollback([4], to_step=3).start(2).steps(4, 6)
    assert run.audit(capsys)[0] == 0
    run = Run(tmp_path / "no-rollback", prepared).start(2).steps(1, 3).steps(4, 4, mutate=wrong)
    run.start(2).steps(4, 6)
    code, report = run.audit(capsys)
    assert code == 1 and "recorded twice with no rollback" in report["first_failure"]["message"]


def contaminate(prepared: Path, out: Path, copies: int) -> Path:
    """A data dir whose held-out split also holds `copies` training documents, as a split bug
    would make it (the index fingerprint stands for the contaminated data)."""
    shutil.copytree(prepared, out)
    index = json.loads((out / "index.json").read_text())
    ds = TokenDataset.open(out)
    train, held = ds.split("train"), ds.split("heldout")
    spans, digests = train.doc_spans()[:copies], train.doc_digests()[:copies]
    tokens = [held.tokens] + [train.tokens[o:o + n] for o, n in spans]
    (out / "heldout.bin").write_bytes(np.concatenate(tokens).astype(np.uint16).tobytes())
    new_spans = np.concatenate([held.doc_spans(), np.stack(
        [held.num_tokens + np.cumsum(spans[:, 1]) - spans[:, 1], spans[:, 1]], axis=1)])
    np.save(out / "heldout.docs.npy", new_spans)
    np.save(out / "heldout.sha256.npy", np.concatenate([held.doc_digests(), digests]))
    index["splits"]["heldout"].update(tokens=int(new_spans[:, 1].sum()),
                                      documents=len(new_spans))
    (out / "index.json").write_text(json.dumps(index))
    return out


def test_a_training_document_in_the_heldout_split_is_caught(prepared, tmp_path, capsys):
    data = contaminate(prepared, tmp_path / "data", copies=12)
    code, report = Run(tmp_path / "run", data).start(2).steps(1, 4).audit(capsys)
    assert code == 1 and failed(report) == {"heldout_documents", "heldout_ngrams"}
    assert report["first_failure"]["check"] == "heldout_documents"
    assert "12 held-out documents are also training documents" in \
        report["first_failure"]["message"]


def test_near_copies_across_the_split_are_caught_by_ngrams(tmp_path, capsys):
    """Distinct documents (so dedup and the hash check pass) that share their text."""
    src = tmp_path / "src"
    for i, path in enumerate(write_corpus(src, n_docs=12, seed=3)):
        for j in range(3):
            (src / f"copy{j}_{i}.txt").write_text(path.read_text() + f"\nedit {j}\n")
    prepare([str(src)], tmp_path / "data", "bpe:300", heldout_frac=0.3)
    code, report = Run(tmp_path / "run", tmp_path / "data").start(1).steps(1, 2).audit(capsys)
    assert code == 1 and failed(report) == {"heldout_ngrams"}
    assert report["ngram"]["overlap"] > 0.5 and report["ngram"]["train_coverage"] == 1.0


def test_a_restart_with_another_seed_is_caught(prepared, tmp_path, capsys):
    run = Run(tmp_path, prepared).start(1).steps(1, 2)
    run.ledger.write({**run.header(1), "seed": SEED + 1})
    code, report = run.steps(3, 4).audit(capsys)
    assert code == 1 and failed(report) == {"config"}
    assert "changed seed from 11 to 12" in report["first_failure"]["message"]


def test_a_run_on_its_own_data_seed_passes_and_a_restart_with_another_is_caught(
        prepared, tmp_path, capsys):
    """The audit replays the order of the header's data_seed (not the seed) and holds every
    restart to it; the seed alone stays the same."""
    code, report = Run(tmp_path / "ok", prepared, data_seed=DATA_SEED).start(2).steps(
        1, 4).start(1).steps(5, 7).audit(capsys)
    assert code == 0 and report["ok"], report["results"]
    assert f"data seed {DATA_SEED}" in report["results"]["config"]["detail"]
    run = Run(tmp_path / "bad", prepared, data_seed=DATA_SEED).start(1).steps(1, 2)
    run.ledger.write({**run.header(1), "data_seed": SEED})
    code, report = run.steps(3, 4).audit(capsys)
    assert code == 1 and failed(report) == {"config"}
    assert f"changed data_seed from {DATA_SEED} to {SEED}" in report["first_failure"]["message"]


def test_a_ledger_from_before_data_seed_is_audited_with_the_seeds_order(prepared, tmp_path,
                                                                        capsys):
    run = Run(tmp_path, prepared).start(2).steps(1, 3)
    run.ledger.close()
    ledger = tmp_path / "ledger.jsonl"
    old = [{k: v for k, v in json.loads(line).items() if k != "data_seed"}
           for line in ledger.read_text().splitlines()]
    ledger.write_text("".join(json.dumps(r) + "\n" for r in old))
    report = audit(tmp_path)
    assert report.ok, [c.detail for c in report.checks if not c.ok]


def test_a_real_run_with_a_data_seed_apart_from_its_seed_passes_the_audit(
        tmp_path, corpus_data, capsys):
    """The worker's loader, the reporter's ledger header and the audit agree on data.seed."""
    run = tmp_path / "run"
    Controller(tiny_config(run, corpus_data, "eval.every=0", "train.max_steps=3",
                           f"data.seed={DATA_SEED}")).run()
    header = json.loads((run / "ledger.jsonl").read_text().splitlines()[0])
    assert (header["seed"], header["data_seed"]) == (0, DATA_SEED)
    code, report = audit_json(run, capsys)
    assert code == 0 and report["ok"], report["results"]


def test_auditing_against_other_data_is_caught(prepared, corpus, tmp_path, capsys):
    prepare([str(corpus)], tmp_path / "other", "bpe:300", heldout_frac=0.3)
    Run(tmp_path / "run", prepared).start(1).steps(1, 2).ledger.close()
    report = audit(tmp_path / "run", data_path=str(tmp_path / "other"))
    assert "data" in {c.name for c in report.checks if not c.ok}


def test_bad_input_exits_2_and_a_torn_last_line_is_ignored(prepared, tmp_path, capsys):
    assert main(["data", "audit", str(tmp_path / "none")]) == 2
    assert "no ledger" in capsys.readouterr().err
    run = Run(tmp_path, prepared).start(1).steps(1, 2)
    run.ledger.close()
    ledger = tmp_path / "ledger.jsonl"
    good = ledger.read_text()
    ledger.write_text(good + '{"kind": "step", "st')  # a crash mid-write
    report = audit(tmp_path)
    assert report.ok and report.torn_tail and report.steps == 2
    ledger.write_text('{"kind": "header"\n' + good)
    assert main(["data", "audit", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "corrupt ledger line" in err[0]


# ---- data.order olmo-core ------------------------------------------------------------------------

OLMO_SEQ = 16


@pytest.fixture()
def olmo_mix(tmp_path: Path) -> Path:
    """Three OLMo-core token files (18 + 10 + 13 instances of 16 tokens), indexed."""
    files = []
    for i, n in enumerate([300, 170, 220]):
        write_tokens(tmp_path / "mix" / f"part-{i}.npy", n, seed=i)
        files.append(MixFile("mix", str(tmp_path / "mix" / f"part-{i}.npy")))
    index_mix({"train": files}, tmp_path / "index", vocab_size=100_278, eos_id=EOS)
    return tmp_path / "index"


def test_an_olmo_core_order_run_resized_over_epochs_passes(olmo_mix, tmp_path, capsys):
    run = Run(tmp_path / "run", olmo_mix, order="olmo-core", seq=OLMO_SEQ)
    run.start(2).steps(1, 4).start(4).steps(5, 9).start(1).steps(10, 12)
    code, report = run.audit(capsys)
    assert code == 0 and report["ok"], report["results"]
    # 41 instances make 5 batches of 8 per epoch (the last instance is dropped): 12 steps touch
    # epochs 0, 1 and 2, the first two complete
    assert (report["epochs"], report["complete_epochs"]) == (3, 2)
    assert "not applicable" in report["results"]["heldout_documents"]["detail"]


def test_an_olmo_core_order_run_on_its_own_data_seed_passes(olmo_mix, tmp_path, capsys):
    run = Run(tmp_path / "run", olmo_mix, order="olmo-core", seq=OLMO_SEQ, data_seed=DATA_SEED)
    run.start(2).steps(1, 3).start(1).steps(4, 7)
    ids = [ld.get(0).ids.tolist() for ld in run.loaders]
    code, report = run.audit(capsys)
    assert code == 0 and report["ok"], report["results"]
    with Loader(run.split, OLMO_SEQ, SEED, B, M, 0, 1, order="olmo-core") as seeds:
        assert seeds.get(0).ids.tolist() != ids[0]  # another order than the seed's


def test_relays_contiguous_rank_slicing_of_an_olmo_core_batch_is_caught(olmo_mix, tmp_path,
                                                                        capsys):
    def contiguous(k: int, parts: list[np.ndarray]) -> list[np.ndarray]:
        whole = np.empty(B, dtype=np.int64)
        for r, p in enumerate(parts):
            whole[r::len(parts)] = p
        return list(whole.reshape(len(parts), -1))

    run = Run(tmp_path / "run", olmo_mix, order="olmo-core", seq=OLMO_SEQ)
    run.start(2).steps(1, 3, mutate=contiguous)
    code, report = run.audit(capsys)
    assert code == 1 and failed(report) == {"continuity"}
    assert "in the wrong order (rank parts misplaced)" in report["first_failure"]["message"]
