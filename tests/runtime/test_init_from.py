"""`init.from` end to end: a new run on other data starts from an fsdp 2 checkpoint (on two Ray
workers, and again in a recovery before its first checkpoint) or from an HF export, records
where it started in its config.yaml, manifest and ledger, passes the audit, which names the
origin, and resumes its own checkpoints (init.from ignored, one warning). A bad source stops
`relaytrain train` with one line and exit 2, writing nothing."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from relaytrain.checkpoint.keys import model_key, model_tensors, optim_key
from relaytrain.checkpoint.olmo_core import (
    DCP_DIR,
    MOMENTS,
    olmo_core_to_ours_name,
    read_olmo_core,
)
from relaytrain.checkpoint.store import CheckpointStore
from relaytrain.cli import main
from relaytrain.data.audit import audit
from relaytrain.data.dataset import TokenDataset
from relaytrain.data.mix_index import index_mix
from relaytrain.data.order import Order
from relaytrain.data.token_arrays import MixFile
from relaytrain.model.config import pad_vocab
from relaytrain.model.hf import convert, read_hf
from tests.runtime.conftest import (
    DP,
    final_state,
    make_corpus,
    records,
    run_layout,
    same_tensors,
    step_records,
)

pytestmark = pytest.mark.timeout(240)
# lr 0: the run's one step moves nothing (AdamW's update and decay both scale with it), so its
# checkpoint holds the state step 0 started from
AT_STEP_0 = ("optim.lr=0", "eval.every=0")


@pytest.fixture(scope="module")
def other_data(tmp_path_factory) -> str:
    """Another corpus (other text, the same tokenizer size): a new run's own data."""
    return make_corpus(tmp_path_factory.mktemp("other"), seed=1)


@pytest.fixture(scope="module")
def source_run(tmp_path_factory, corpus_data) -> Path:
    """A two-step run on one worker: the checkpoint the HF export and bad inputs start from."""
    run = tmp_path_factory.mktemp("source") / "run"
    run_layout(run, corpus_data, 1, *DP, "train.max_steps=2", "eval.every=0")
    return run


def assert_origin_recorded(run: Path, kind: str, step: int | None,
                           took: tuple[str, ...] = ("weights",)) -> dict:
    """config.yaml, the newest manifest and every ledger header record the same origin; the
    audit passes and names it."""
    origin = yaml.safe_load((run / "config.yaml").read_text())["init"]["origin"]
    assert (origin["kind"], origin["step"], origin["took"]) == (kind, step, list(took))
    store = CheckpointStore(str(run / "checkpoints"))
    assert store.read_manifest(store.latest_step())["init"] == origin
    ledger = [json.loads(x) for x in (run / "ledger.jsonl").read_text().splitlines()]
    assert [h["init"] for h in ledger if h["kind"] == "header"] == [origin] * len(
        [h for h in ledger if h["kind"] == "header"])
    report = audit(run)
    assert report.ok and report.origin == origin, report.to_json()
    detail = next(c.detail for c in report.checks if c.name == "config")
    assert f"step 0 from init.from {kind} {origin['from']}" in detail, detail
    return origin


def resume_resumes_itself(run: Path, data: str, capsys, *args: str) -> None:
    capsys.readouterr()
    formed = [r["step"] for r in records(run, "generation")]
    run_layout(run, data, *args, "train.max_steps=2")
    assert capsys.readouterr().err.count("config key 'init.from' is ignored") == 1
    assert [r["step"] for r in records(run, "restart")] == [1]
    assert [r["step"] for r in records(run, "generation")] == [*formed, 1]


# Its resume takes the same path as the HF export's below (init.from ignored, the origin kept).
def test_a_dp2_run_on_other_data_starts_from_an_fsdp2_checkpoint_again_in_a_recovery(
        tmp_path, corpus_data, other_data, ray_cluster):
    src = tmp_path / "fsdp2"
    run_layout(src, corpus_data, 1, *DP, "train.max_steps=2", "eval.every=0", fsdp=2)
    files = CheckpointStore(str(src / "checkpoints")).read_manifest(2)["files"]
    assert sorted(files) == [f"stage0-shard{k}.safetensors" for k in range(2)]
    run = tmp_path / "dp2"
    start = (2, *DP, f"init.from={src}", *AT_STEP_0)
    # A worker killed in step 1, with no snapshot in memory: the recovery restores step 0 from
    # the source again (the seed's weights would not be the source's below).
    run_layout(run, other_data, *start, "train.max_steps=1", "faults.kill_at=[1]",
               "elastic.snapshot_every=0", "elastic.min_workers=2")  # replaced, not shrunk
    [rec] = records(run, "recovery")
    assert (rec["source"], rec["restored_step"]) == ("checkpoint", 0), rec
    assert same_tensors(model_tensors(final_state(run)), model_tensors(final_state(src)))
    origin = assert_origin_recorded(run, "relaytrain", 2)
    assert origin["location"] == str(src / "checkpoints" / "step_00000002")


def test_a_run_starts_from_an_hf_export_and_resumes_itself(tmp_path, source_run, other_data,
                                                          capsys):
    hf = tmp_path / "hf"
    convert("relay-to-hf", str(source_run), hf)
    run = tmp_path / "from-hf"
    start = (1, *DP, f"init.from={hf}", *AT_STEP_0)
    run_layout(run, other_data, *start, "train.max_steps=1")
    assert same_tensors(model_tensors(final_state(run)), read_hf(hf)[1])
    origin = assert_origin_recorded(run, "hf", None)
    resume_resumes_itself(run, other_data, capsys, *start)
    assert assert_origin_recorded(run, "hf", None) == origin


@pytest.fixture(scope="module")
def olmo_core(tmp_path_factory, other_data):
    """The reference module (tests/checkpoint/olmo_core_reference.py) and a checkpoint of its
    model written by OLMo-core's own checkpointer, trained on ids of the other corpus's
    tokenizer, its vocabulary padded as OLMo-core pads it."""
    pytest.importorskip("olmo_core.nn.transformer")
    from tests.checkpoint import olmo_core_reference as ref

    tokens = TokenDataset.open(other_data).vocab_size
    return ref, ref.save_olmo_core(tmp_path_factory.mktemp("olmo_core"), pad_vocab(tokens),
                                   tokens)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_run_takes_an_olmo_core_checkpoints_adamw_state_and_steps_as_olmo_core_does(
        tmp_path, other_data, olmo_core):
    """Started from OLMo-core's checkpoint with its optimizer state, the run's first step (its
    own data: the ids the ledger names) gives the loss, weights and moments OLMo-core's own
    model and optimizer give from the same checkpoint and batch (fp32 CPU)."""
    from olmo_core.distributed.checkpoint import load_model_and_optim_state

    ref, saved = olmo_core
    rows = pad_vocab(TokenDataset.open(other_data).vocab_size)
    run = tmp_path / "from-olmo-core"
    # OLMo-core's logits span every embedding row, the padded ones too: started from its
    # checkpoint, the run's softmax takes them all (model.softmax_rows unset: the origin's),
    # though its model has the data's tokenizer's rows (model.tokenizer_vocab) padded to `rows`
    run_layout(run, other_data, 1, "train.global_batch=2", "train.micro_batch=2",
               f"data.seq_len={ref.SEQ}", "train.max_steps=1", "train.z_loss=0", "train.clip=0",
               f"optim.lr={ref.LR}", "optim.warmup=0", "optim.final_lr_frac=1",
               "eval.every=0", "checkpoint.every=1", *ref.RUN_MODEL, "model.attention=sdpa",
               "model.matmul=aten", "model.kernels=torch", "model.compile=none",
               f"init.from={saved.step_dir}", "init.optimizer=true")
    origin = assert_origin_recorded(run, "olmo-core", ref.STEPS, ("weights", "moments"))
    assert origin["digest"].startswith("sha256:") and origin["softmax_rows"] == "padded"
    settled = yaml.safe_load((run / "config.yaml").read_text())["model"]["overrides"]
    manifest = CheckpointStore(str(run / "checkpoints")).read_manifest(1)
    assert settled["softmax_rows"] == manifest["model"]["softmax_rows"] == "padded"
    assert manifest["model"]["tokenizer_vocab"] < manifest["model"]["vocab_size"] == rows
    [step] = records(run, "step")
    assert step["lr"] == ref.LR
    ledger = [json.loads(x) for x in (run / "ledger.jsonl").read_text().splitlines()]
    [ids] = next(r["parts"] for r in ledger if r["kind"] == "step" and r["step"] == 1)
    batch = torch.from_numpy(TokenDataset.open(other_data).split("train").instances(
        ids, ref.SEQ))

    _, model, optim = ref.olmo_core_model(vocab=rows)
    load_model_and_optim_state(str(saved.step_dir / DCP_DIR), model, optim)
    want_loss = ref.olmo_core_step(model, optim, batch).item()
    assert abs(step["loss"] - want_loss) <= 1e-6 * abs(want_loss), (step["loss"], want_loss)
    ours = final_state(run)
    for name, p in model.named_parameters():
        mine = olmo_core_to_ours_name(name)
        for key, want in ((model_key(mine), p.detach()),
                          *((optim_key(mine, m), optim.state[p][m]) for m in MOMENTS)):
            assert (ours[key] - want).abs().max() <= 1e-6 * want.abs().max(), key
        assert ours[optim_key(mine, "step")].item() == ref.STEPS + 1


# exact mode on fixed backends: a continued run and a resumed one must agree to the bit
CONTINUE = ("determinism=exact", "eval.every=0", "checkpoint.every=2", "model.matmul=aten",
            "model.kernels=torch", "model.attention=sdpa", "model.compile=none")


def ledger_records(run: Path, kind: str) -> list[dict]:
    lines = (run / "ledger.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


def test_a_run_continuing_a_relaytrain_checkpoints_trainer_state_is_its_resume_to_the_bit(
        tmp_path, corpus_data, capsys):
    """Run A trains 2 steps; run B starts from A's checkpoint with its trainer state and
    trains to step 4: its steps 3 and 4 are A's own resume's, bit for bit (loss, gradient
    norm, learning rate, the ids trained on, the weights and moments after). B's ledger starts
    at step 3, its audit passes naming what was carried, and B resumes itself."""
    a, b = tmp_path / "a", tmp_path / "b"
    run_layout(a, corpus_data, 1, *CONTINUE, "train.max_steps=2")
    source = a / "checkpoints" / "step_00000002"
    cont = (f"init.from={source}", "init.optimizer=true", "init.trainer_state=true")
    run_layout(b, corpus_data, 1, *CONTINUE, "train.max_steps=4", *cont)
    run_layout(a, corpus_data, 1, *CONTINUE, "train.max_steps=4")  # A resumed
    mine, theirs = step_records(b), step_records(a)
    assert sorted(mine) == [3, 4] and records(b, "restart") == []
    for k in (3, 4):
        assert {f: mine[k][f] for f in ("loss", "grad_norm", "lr")} == \
            {f: theirs[k][f] for f in ("loss", "grad_norm", "lr")}, k
    assert [r["parts"] for r in ledger_records(b, "step")] == \
        [r["parts"] for r in ledger_records(a, "step") if r["step"] > 2]
    assert same_tensors(final_state(b), final_state(a))
    origin = yaml.safe_load((b / "config.yaml").read_text())["init"]["origin"]
    assert origin["took"] == ["weights", "moments", "trainer_state"]
    data_seed = yaml.safe_load((b / "config.yaml").read_text())["data"]["seed"]
    assert origin["trainer"] == {"step": 2, "epoch": 0, "tokens": 2 * 8 * 32, "batch": 2,
                                 "data_seed": 0} and data_seed == 0
    assert CheckpointStore(str(b / "checkpoints")).read_manifest(4)["data"]["batch_index"] == 4
    report = audit(b)
    assert report.ok and report.steps == 2, report.to_json()
    assert report.origin == origin and [c.detail for c in report.checks if c.name in (
        "config", "no_gaps")] == [
        f"1 headers agree on seed, data seed 0, global batch, seq_len and data; step 2 from "
        f"init.from relaytrain {source} step 2 (weights+moments+trainer_state, "
        f"{origin['digest']}; its trainer state: step 2, epoch 0 512 tokens in, global batch 2)",
        "steps 3..4 all present"]
    capsys.readouterr()
    run_layout(b, corpus_data, 1, *CONTINUE, "train.max_steps=5", *cont)
    assert capsys.readouterr().err.count("config key 'init.from' is ignored") == 1
    assert [r["step"] for r in records(b, "restart")] == [4] and sorted(step_records(b)) == \
        [3, 4, 5]
    assert audit(b).ok


def test_a_continued_run_of_another_batch_on_other_data_starts_at_the_sources_position(
        tmp_path, corpus_data, other_data, ray_cluster):
    """The data position is the source's epoch and tokens consumed of it: A's 2 steps of 8
    instances of 32 tokens are 512 tokens of epoch 0, so B (dp 2), of 4-instance batches on
    other data, starts that epoch of its own order 16 instances in, at its global batch 4
    (step 3); a worker killed in step 3 with no snapshot in memory restores step 2, the run's
    start, from the source again."""
    a, b = tmp_path / "a", tmp_path / "b"
    run_layout(a, corpus_data, 1, *CONTINUE, "train.max_steps=2")
    run_layout(b, other_data, 2, *CONTINUE, "train.max_steps=4", "train.global_batch=4",
               f"init.from={a}", "init.optimizer=true", "init.trainer_state=true",
               "faults.kill_at=[3]", "elastic.snapshot_every=0",
               "elastic.min_workers=2")  # replaced, not shrunk: it ends on its 2 workers
    [rec] = records(b, "recovery")
    assert (rec["source"], rec["restored_step"]) == ("checkpoint", 2), rec
    steps = {r["step"]: r for r in ledger_records(b, "step")}  # the last record of each
    n = TokenDataset.open(other_data).split("train").num_instances(32)
    want = [Order(0, n).global_batch(4, k)[1].tolist() for k in (4, 5)]
    assert [(k, r["batch"], r["parts"]) for k, r in sorted(steps.items())] == [
        (3, 4, [want[0][:2], want[0][2:]]), (4, 5, [want[1][:2], want[1][2:]])]
    assert yaml.safe_load((b / "config.yaml").read_text())["init"]["origin"]["trainer"][
        "batch"] == 4
    assert audit(b).ok


@pytest.fixture(scope="module")
def olmo_core_trained(tmp_path_factory):
    """OLMo-core's own Trainer, 5 steps on its own data loader over a token file, a checkpoint
    of each step with its trainer state (in a process of its own: the trainer is left to set
    up its process as it does); and the token file indexed as relaytrain's data."""
    pytest.importorskip("olmo_core.train")
    from tests.checkpoint import olmo_core_reference as ref

    root = tmp_path_factory.mktemp("olmo_core_trainer")
    tokens = root / "part-0.npy"
    ref.write_token_file(tokens)
    subprocess.run([sys.executable, "-m", "tests.checkpoint.olmo_core_reference", str(tokens),
                    str(root / "save"), "5"], check=True, timeout=180, capture_output=True)
    data = root / "indexed"
    index_mix({"train": [MixFile("tiny", str(tokens))]}, data, vocab_size=ref.VOCAB,
              eos_id=ref.EOS_ID, pad_id=ref.PAD_ID, dtype="uint32")
    return ref, root, str(data)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_run_continuing_olmo_cores_trainer_state_takes_the_steps_olmo_core_took(
        tmp_path, olmo_core_trained):
    """From OLMo-core's step 3 with its trainer state (train/rank0.pt, read without
    unpickling anything but plain values), the run starts at step 3 on the batches OLMo-core's
    own data loader gives after that state, on the schedule at step 4, and its weights and
    moments after steps 4 and 5 are those OLMo-core's Trainer saved at its steps 4 and 5."""
    ref, root, data = olmo_core_trained
    run = tmp_path / "continued"
    given = ("data.order=olmo-core", f"data.seq_len={ref.SEQ}",
             f"train.global_batch={ref.TRAIN_BATCH}", f"train.micro_batch={ref.TRAIN_BATCH}",
             "train.z_loss=0", "train.clip=0", f"optim.lr={ref.LR}",
             f"optim.warmup={ref.TRAIN_WARMUP}", "optim.final_lr_frac=0.1", "eval.every=0",
             "checkpoint.every=1", *ref.RUN_MODEL, "model.attention=sdpa", "model.matmul=aten",
             "model.kernels=torch", "model.compile=none", f"init.from={root / 'save' / 'step3'}",
             "init.optimizer=true", "init.trainer_state=true")
    run_layout(run, data, 1, *given, "train.max_steps=5")
    settled = yaml.safe_load((run / "config.yaml").read_text())
    trainer = settled["init"]["origin"]["trainer"]
    assert {k: trainer[k] for k in ("step", "epoch", "tokens", "batch", "data_seed")} == {
        "step": 3, "epoch": 0, "tokens": 3 * ref.TRAIN_BATCH * ref.SEQ, "batch": 3,
        "data_seed": ref.DATA_SEED} and trainer["digest"].startswith("sha256:")
    assert settled["data"]["seed"] == ref.DATA_SEED  # unset: the source's
    # OLMo-core's loader, its state loaded from the checkpoint (OLMo-core's own torch.load)
    loader = ref.olmo_core_loader(root / "part-0.npy", tmp_path / "work")
    state = torch.load(root / "save" / "step3" / "train" / "rank0.pt", weights_only=False)
    loader.load_state_dict(state["data_loader"])
    loader.reshuffle(epoch=state["data_loader"]["epoch"], in_memory=True)
    theirs = [b["index"].tolist() for b, _ in zip(loader, range(3), strict=False)]
    assert [r["parts"][0] for r in ledger_records(run, "step")] == theirs[:2]
    assert sorted(step_records(run)) == [4, 5]
    for step in (4, 5):
        ours = CheckpointStore(str(run / "checkpoints")).read(step)[1]
        want = read_olmo_core(str(root / "save" / f"step{step}"), optimizer=True).tensors
        assert ours.keys() == want.keys()
        for key, t in want.items():
            # the weights to 1e-6 of their largest (measured 6.4e-8); the moments, running
            # sums of gradients (and their squares) computed in another order in fp32, to 4e-6
            # (measured 1.0e-6 and 1.6e-6, on the small QK-norm gradients); the step counts
            bar = 4e-6 if key.endswith(MOMENTS) else 1e-6
            assert (ours[key] - t).abs().max() <= bar * t.abs().max(), (step, key)
    assert audit(run).ok
    # resumed as given (data.seed unset): it keeps the data seed it took, and its softmax rows
    run_layout(run, data, 1, *given, "train.max_steps=6")
    assert [r["step"] for r in records(run, "restart")] == [5] and audit(run).ok
    assert [r["parts"][0] for r in ledger_records(run, "step")] == theirs


def test_each_bad_source_exits_2_with_one_line_and_writes_nothing(tmp_path, source_run,
                                                                   other_data, olmo_core, capsys):
    ref, saved = olmo_core
    broken = tmp_path / "broken"
    shutil.copytree(source_run / "checkpoints", broken)
    part = next((broken / "step_00000002").glob("*.safetensors"))
    part.write_bytes(part.read_bytes()[:-1] + bytes([part.read_bytes()[-1] ^ 1]))
    (tmp_path / "empty").mkdir()
    (tmp_path / "dcp" / "model_and_optim").mkdir(parents=True)
    (tmp_path / "dcp" / "model_and_optim" / ".metadata").write_bytes(b"\x80\x04")
    other_vocab = ref.save_olmo_core(tmp_path / "olmo-core")
    cases = {"missing": ((), "does not exist"),
             "empty": ((), "no committed checkpoint"),
             "broken": ((), "does not match the manifest"),
             str(source_run): (("model.n_layers=3",), "holds another model (n_layers=2"),
             "dcp": ((), "is not a loadable olmo-core checkpoint ("),
             str(saved.step_dir): ((), "holds another model (d_model=12, n_layers=4"),
             # OLMo-core's vocab_size: the rows of another tokenizer, padded
             str(other_vocab.step_dir): (ref.RUN_MODEL, "holds another model (vocab_size=256; "
                                         "the run's model has vocab_size=384; vocab_size counts "
                                         "embedding rows, the tokenizer's vocabulary padded: "
                                         "the source was trained with another tokenizer")}
    for i, (source, (extra, said)) in enumerate(cases.items()):
        run = tmp_path / f"run{i}"
        capsys.readouterr()
        assert main(["train", "configs/tiny.yaml", f"run_dir={run}", f"data.path={other_data}",
                     "log.progress=false", f"init.from={tmp_path / source}", *extra]) == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(
            "relaytrain: error: config key 'init.from': ") and said in lines[0], lines
        assert not run.exists()


def test_each_bad_trainer_state_exits_2_with_one_line_and_writes_nothing(
        tmp_path, source_run, other_data, capsys):
    """A trainer state asked of a source without one, without the optimizer state it goes
    with, past train.max_steps, or at a position that is not the start of one of the run's
    global batches: one line naming the key, exit 2, nothing written."""
    hf = tmp_path / "hf"
    convert("relay-to-hf", str(source_run), hf)
    carry = ("init.optimizer=true", "init.trainer_state=true")
    cases = [  # (init.from, overrides, what the line says)
        (hf, carry, "'init.trainer_state': " + f"{hf} (hf) holds no trainer state"),
        (source_run, ("init.trainer_state=true",), "'init.trainer_state': got true with "
         "init.optimizer false"),
        (None, carry, "'init.trainer_state': got true with no init.from"),
        (source_run, (*carry, "train.max_steps=2"), "'train.max_steps': got 2, but "
         "init.trainer_state continues from step 2"),
        # 2 steps of 12 instances: 24 instances in, 4 into a global batch of 5
        (source_run, (*carry, "train.global_batch=5", "train.micro_batch=1"),
         "'init.trainer_state': the data position of " + f"{source_run} (step 2) does not "
         "continue in the run's data: 768 tokens into epoch 0: 4 instances into one of the "
         "run's global batches of 5, not at its start"),
    ]
    for i, (source, extra, said) in enumerate(cases):
        run = tmp_path / f"run{i}"
        capsys.readouterr()
        given = [] if source is None else [f"init.from={source}"]
        assert main(["train", "configs/tiny.yaml", f"run_dir={run}", f"data.path={other_data}",
                     "log.progress=false", *given, *extra]) == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("relaytrain: error: config key ") and \
            said in lines[0], (said, lines)
        assert not run.exists()
