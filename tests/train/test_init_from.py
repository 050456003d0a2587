"""`init.from` without a process group: a source of each kind (a relaytrain checkpoint, an HF
directory, a checkpoint written by OLMo-core's own checkpointer) is found, verified and checked
against the run's model; a state built at step 0 (the start, and a recovery before the first
checkpoint) holds the source's weights, and its moments only when asked; every bad source is one
ConfigError naming the key."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil

import pytest
import torch

from relaytrain.checkpoint.keys import (
    MODEL_PREFIX,
    OPTIM_PREFIX,
    model_tensors,
    tensor_param,
)
from relaytrain.checkpoint.store import CheckpointStore
from relaytrain.config import load_config
from relaytrain.config.sections import InitSection, RunConfig
from relaytrain.data.position import Stream
from relaytrain.errors import CheckpointError, ConfigError
from relaytrain.model.hf import read_hf, write_hf
from relaytrain.train.init_from import continue_at, read_origin, resolve
from tests.train.test_state import VOCAB, WHOLE, assert_same, config, state_of, trained

pytestmark = pytest.mark.timeout(60)


def source(tmp_path, steps: int = 2) -> tuple[str, dict[str, torch.Tensor]]:
    """A committed checkpoint (root) of a state trained `steps` steps, and its tensors."""
    cfg = config(tmp_path / "source")
    state = trained(cfg, steps)
    tensors = {k: t.clone() for k, t in state.state_tensors().items()}
    store = CheckpointStore(str(tmp_path / "source" / "checkpoints"))
    store.commit(steps, {"stage0": store.write_part(steps, "stage0", tensors)},
                 {"model": state.model_cfg.to_dict(), "config": cfg.to_dict(),
                  "data": {"batch_index": steps, "n_instances": 10_000, "seq_len": cfg.seq_len}})
    return store.url, tensors


def started_from(cfg: RunConfig, url: str, optimizer: bool = False,
                 trainer_state: bool = False) -> RunConfig:
    """`cfg` as the controller settles it for `init.from=url`."""
    init = InitSection(from_=url, optimizer=optimizer, trainer_state=trainer_state)
    origin = resolve(init, cfg.model_config(VOCAB))
    if trainer_state:  # the run's stream: its own data, as the controller places it
        origin = continue_at(origin, Stream("relay", 10_000, cfg.train.global_batch,
                                            cfg.seq_len))
    return dataclasses.replace(cfg, init=dataclasses.replace(init, origin=origin))


def held(state) -> dict[str, torch.Tensor]:
    return {k: t.clone() for k, t in state.state_tensors().items()}


def test_a_continued_run_starts_at_the_sources_step_holding_its_state(tmp_path):
    """With the trainer state the run's start is the source's step: a state built there (the
    start, a recovery before the run's first checkpoint) holds the source's weights and
    moments; the step after it is the run's own checkpoint's to restore."""
    url, src = source(tmp_path)
    cfg = started_from(config(tmp_path / "run"), url, optimizer=True, trainer_state=True)
    assert cfg.init.origin["took"] == ["weights", "moments", "trainer_state"]
    assert (cfg.start_step, cfg.batch_offset) == (2, 0)
    state = state_of(cfg)
    for _ in range(2):
        state.build(2, None, WHOLE)
        assert_same(held(state), src)
    with pytest.raises(CheckpointError, match="step_00000003"):  # none of its own yet
        state.build(3, None, WHOLE)


def test_step_0_holds_the_sources_weights_and_fresh_moments_at_start_and_recovery(tmp_path):
    url, src = source(tmp_path)
    cfg = started_from(config(tmp_path / "run"), url)
    origin = cfg.init.origin
    assert (origin["kind"], origin["step"], origin["took"]) == ("relaytrain", 2, ["weights"])
    assert origin["location"].endswith("step_00000002") and origin["digest"].startswith("xxh3")
    state = state_of(cfg)
    for _ in range(2):  # the start, then a recovery before the run's first checkpoint
        state.build(0, None, WHOLE)
        got = held(state)
        assert_same(got, {k: t for k, t in src.items() if k.startswith(MODEL_PREFIX)})
    seeded = state_of(config(tmp_path / "seeded"))
    seeded.build(0, None, WHOLE)
    assert not torch.equal(held(seeded)["model.embed.weight"], src["model.embed.weight"])


def test_init_optimizer_takes_adamws_moments_and_step_counts(tmp_path):
    url, src = source(tmp_path)
    cfg = started_from(config(tmp_path / "run"), url, optimizer=True)
    assert cfg.init.origin["took"] == ["weights", "moments"]
    state = state_of(cfg)
    state.build(0, None, WHOLE)
    assert_same(held(state), src)
    assert any(k.startswith(OPTIM_PREFIX) and k.endswith(".step") for k in src)


def test_a_pipeline_stage_reads_its_own_tensors_and_a_shard_its_own_rows(tmp_path):
    url, src = source(tmp_path)
    cfg = started_from(config(tmp_path / "run"), url, optimizer=True)
    stage = state_of(cfg)
    stage.build(0, None, (1, 2, 1))
    names = {n for n, _ in stage.model.named_parameters()}
    assert "embed.weight" not in names and "lm_head.weight" in names
    assert_same(model_tensors(held(stage)), {n: src["model." + n] for n in names})
    rows = {"model.embed.weight": (3, 7), "optim.embed.weight.exp_avg": (0, 2)}
    got = read_origin(cfg.init.origin, {"embed.weight"}, rows)
    assert torch.equal(got["model.embed.weight"], src["model.embed.weight"][3:7])
    assert torch.equal(got["optim.embed.weight.exp_avg"], src["optim.embed.weight.exp_avg"][:2])


@pytest.mark.parametrize("rope", ["rope_parameters", "rope_scaling"])
def test_an_hf_directory_of_either_config_format_gives_its_weights(tmp_path, rope):
    _, src = source(tmp_path)
    cfg = config(tmp_path / "run")
    hf = tmp_path / "hf"
    write_hf(cfg.model_config(VOCAB), model_tensors(src), hf)
    if rope == "rope_scaling":  # transformers < 5: one top-level rope_theta (+ rope_scaling)
        d = json.loads((hf / "config.json").read_text())
        theta = d.pop("rope_parameters")["full_attention"]["rope_theta"]
        (hf / "config.json").write_text(json.dumps({**d, "rope_theta": theta,
                                                    "rope_scaling": None}))
    cfg = started_from(cfg, str(hf), optimizer=True)  # an HF directory has no moments
    assert (cfg.init.origin["kind"], cfg.init.origin["took"]) == ("hf", ["weights"])
    state = state_of(cfg)
    state.build(0, None, WHOLE)
    assert_same(model_tensors(held(state)), read_hf(hf)[1])


def bad(tmp_path, url: str, *overrides: str) -> str:
    cfg = load_config("configs/tiny.yaml", [f"run_dir={tmp_path / 'run'}", *overrides])
    with pytest.raises(ConfigError) as e:
        resolve(InitSection(from_=url), cfg.model_config(VOCAB))
    message = str(e.value)
    assert message.startswith("config key 'init.from': ") and "\n" not in message, message
    return message


def test_each_bad_source_is_one_line_naming_the_key(tmp_path):
    url, src = source(tmp_path)
    model = CheckpointStore(url).read_manifest(2)["model"]
    assert "does not exist" in bad(tmp_path, str(tmp_path / "missing"))
    (tmp_path / "empty").mkdir()
    assert "no committed checkpoint" in bad(tmp_path, str(tmp_path / "empty"))
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "readme.txt").write_text("not a checkpoint")
    assert "not a loadable relaytrain checkpoint" in bad(tmp_path, str(tmp_path / "notes"))
    broken = tmp_path / "broken"
    shutil.copytree(url, broken)
    part = broken / "step_00000002" / "stage0.safetensors"
    data = bytearray(part.read_bytes())
    data[-1] ^= 1
    part.write_bytes(bytes(data))
    assert "does not match the manifest" in bad(tmp_path, str(broken))
    assert "holds another model (n_layers=2" in bad(tmp_path, url, "model.n_layers=3")
    partial = CheckpointStore(str(tmp_path / "partial"))
    kept = {k: t for k, t in src.items() if "lm_head" not in k}
    partial.commit(2, {"stage0": partial.write_part(2, "stage0", kept)}, {"model": model})
    assert "lacks the weights of 1 parameter(s) of the model, e.g. 'lm_head.weight'" in bad(
        tmp_path, partial.url)


# ---- OLMo-core checkpoints: OLMo-core's own model, AdamW and checkpointer --------------------
@pytest.fixture(scope="module")
def olmo_core(tmp_path_factory):
    """The reference module (tests/checkpoint/olmo_core_reference.py) and its checkpoint."""
    pytest.importorskip("olmo_core.nn.transformer")
    from tests.checkpoint import olmo_core_reference as ref

    return ref, ref.save_olmo_core(tmp_path_factory.mktemp("olmo_core"))


def olmo_core_run(tmp_path, ref, *overrides: str) -> RunConfig:
    """A run of the reference's model (OLMo-core's olmo3_1M, its padded vocabulary)."""
    return load_config("configs/tiny.yaml", [
        f"run_dir={tmp_path / 'run'}", "data.seq_len=8", "model.attention=sdpa",
        "model.matmul=aten", "model.kernels=torch", "model.compile=none", *ref.RUN_MODEL,
        f"model.vocab_size={ref.VOCAB}", *overrides])


def test_an_olmo_core_checkpoint_gives_its_weights_moments_and_step_count_to_the_bit(
        tmp_path, olmo_core, monkeypatch):
    ref, saved = olmo_core
    reads = ref.counting_chunk_reads(monkeypatch)
    cfg = started_from(olmo_core_run(tmp_path, ref), str(saved.step_dir), optimizer=True)
    assert len(reads) == 1  # resolving reads the metadata and one step count, no weights
    metadata = (saved.step_dir / "model_and_optim" / ".metadata").read_bytes()
    assert cfg.init.origin == {
        "from": str(saved.step_dir), "kind": "olmo-core", "location": str(saved.step_dir),
        "step": ref.STEPS, "digest": "sha256:" + hashlib.sha256(metadata).hexdigest(),
        "took": ["weights", "moments"], "softmax_rows": "padded"}
    state = state_of(cfg)
    for _ in range(2):  # the start, then a recovery before the run's first checkpoint
        state.build(0, None, WHOLE)
        ref.assert_equal_to_olmo_core(held(state), saved, optimizer=True)
    weights = started_from(olmo_core_run(tmp_path, ref), str(saved.step_dir))
    assert (weights.init.origin["step"], weights.init.origin["took"]) == (ref.STEPS, ["weights"])
    state = state_of(weights)
    state.build(0, None, WHOLE)
    ref.assert_equal_to_olmo_core(held(state), saved, optimizer=False)


def test_an_olmo_core_stage_and_shard_read_only_their_own_tensors(tmp_path, olmo_core,
                                                                   monkeypatch):
    ref, saved = olmo_core
    cfg = started_from(olmo_core_run(tmp_path, ref), str(saved.step_dir), optimizer=True)
    whole = state_of(cfg)
    whole.build(0, None, WHOLE)
    src = held(whole)
    reads = ref.counting_chunk_reads(monkeypatch)
    stage = state_of(cfg)
    stage.build(0, None, (1, 2, 1))
    names = {n for n, _ in stage.model.named_parameters()}
    assert "embed.weight" not in names and "lm_head.weight" in names
    assert len(reads) == 1 + 4 * len(names)  # a step count, then its tensors' chunks alone
    assert_same(held(stage), {k: t for k, t in src.items() if tensor_param(k) in names})
    rows = {"model.embed.weight": (3, 7), "optim.embed.weight.exp_avg": (0, 2)}
    got = read_origin(cfg.init.origin, {"embed.weight"}, rows)
    assert torch.equal(got["model.embed.weight"], src["model.embed.weight"][3:7])
    assert torch.equal(got["optim.embed.weight.exp_avg"], src["optim.embed.weight.exp_avg"][:2])
    assert torch.equal(got["optim.embed.weight.step"], src["optim.embed.weight.step"])


def olmo_core_bad(tmp_path, ref, url: str, *overrides: str) -> str:
    with pytest.raises(ConfigError) as e:
        resolve(InitSection(from_=url, optimizer=True),
                olmo_core_run(tmp_path, ref, *overrides).model_config(VOCAB))
    message = str(e.value)
    assert message.startswith("config key 'init.from': ") and "\n" not in message, message
    return message


def test_each_bad_olmo_core_source_is_one_line_naming_the_key(tmp_path, olmo_core):
    ref, saved = olmo_core
    url = str(saved.step_dir)
    dcp = tmp_path / "corrupt" / "model_and_optim"
    dcp.mkdir(parents=True)
    (dcp / ".metadata").write_bytes(b"\x80\x04")
    assert "is not a loadable olmo-core checkpoint (" in olmo_core_bad(
        tmp_path, ref, str(dcp.parent))
    assert "holds another model (n_layers=4, mlp_hidden=256; the run's model has n_layers=3, " \
        "mlp_hidden=64)" in olmo_core_bad(tmp_path, ref, url, "model.n_layers=3",
                                          "model.mlp_hidden=64")
    # the head split: from config.json where there is one, else the projections' shapes
    assert "holds another model (n_kv_heads=2; the run's model has n_kv_heads=4)" in \
        olmo_core_bad(tmp_path, ref, url, "model.n_kv_heads=4")
    bare = tmp_path / "bare"
    shutil.copytree(saved.step_dir / "model_and_optim", bare)
    assert "holds another model (layers.0.attn.k_norm.weight of shape [8]; the run's model " \
        "has [16], of 12 parameter(s) that differ)" in olmo_core_bad(
            tmp_path, ref, str(bare), "model.n_kv_heads=4")
    # OLMo-core's vocab_size is its padded embedding rows: another tokenizer's
    said = olmo_core_bad(tmp_path, ref, url, "model.vocab_size=null")
    assert f"holds another model (vocab_size=256; the run's model has vocab_size=128; " \
        "vocab_size counts embedding rows, the tokenizer's vocabulary padded: the source was " \
        f"trained with another tokenizer than the run's data ({VOCAB} tokens))" in said


def test_an_olmo_core_source_changed_since_the_run_started_is_refused(tmp_path, olmo_core):
    ref, saved = olmo_core
    src = tmp_path / "step2"
    shutil.copytree(saved.step_dir, src)
    cfg = started_from(olmo_core_run(tmp_path, ref), str(src), optimizer=True)
    metadata = src / "model_and_optim" / ".metadata"
    metadata.write_bytes(metadata.read_bytes() + b"\0")  # still a readable pickle, another one
    with pytest.raises(CheckpointError, match=r"changed since the run started from it \(digest "
                                              r"sha256:"):
        state_of(cfg).build(0, None, WHOLE)
