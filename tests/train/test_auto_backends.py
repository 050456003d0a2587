"""`auto` for the elementwise kernels and the sliding attention is measured on the model's own
blocks at the run's micro-batch, after the GEMMs, once per host and shape; a setting given by
the config, a GPU, compiled blocks and a sequence inside the window are never measured."""

import pytest
import torch

import relaytrain.train.auto_backends as auto_backends
from relaytrain.config.sections import ModelSection
from relaytrain.model import backend_choice, cpu_kernels
from relaytrain.model.backend_choice import MARGIN
from relaytrain.model.config import PRESETS
from relaytrain.train.auto_backends import choose_backends

needs_kernels = pytest.mark.skipif(cpu_kernels.unavailable() is not None,
                                   reason="no fused CPU kernels here")
CPU = torch.device("cpu")
TINY = PRESETS["tiny"].with_vocab(300)  # a sliding (window 16) and a full layer


@pytest.fixture
def blocks(monkeypatch):
    """Each block round timed by a stub: `blocks.seconds[backend]` for the kernels or attention
    it runs (the one a contest varies), the rounds it was asked for in `blocks.calls`."""
    def fake_round(stage, shape, matmul, kernels, attention):
        blocks.calls.append((len(stage.layers), stage.last, shape, matmul, kernels, attention))
        varied = kernels if stage.last else attention
        return lambda: blocks.seconds[varied]

    blocks = type("Blocks", (), {"calls": [], "seconds": {"torch": 1.0, "fused": 0.5,
                                                          "sdpa": 1.0, "chunks": 0.5}})()
    monkeypatch.setattr(auto_backends, "_timed_round", fake_round)
    monkeypatch.setattr(backend_choice, "loaded", lambda: False)  # the suite loads the cores
    return blocks


def choose(tmp_path, *, seq_len=32, key="cpu A", **section):
    return choose_backends(ModelSection(matmul="aten", **section), TINY, CPU, 2, 4, seq_len,
                           key=key, cache=tmp_path / "backends.json")


@needs_kernels
def test_kernels_then_attention_are_measured_once_on_the_models_blocks(tmp_path, blocks):
    chosen = choose(tmp_path)
    assert {k: (c.backend, c.source) for k, c in chosen.items()} == {
        "matmul": ("aten", "setting"), "kernels": ("fused", "measured"),
        "attention": ("chunks", "measured")}
    assert chosen["kernels"].times == {"torch": 1.0, "fused": 0.5}
    # kernels: both layers and the head; attention: the sliding layer alone, with the kernels
    # just chosen; at the run's micro-batch, through the GEMMs chosen before
    assert {c[:4] for c in blocks.calls} == {(2, True, (4, 32), "aten"),
                                             (1, False, (4, 32), "aten")}
    assert {c[4] for c in blocks.calls if not c[1]} == {"fused"}
    calls = len(blocks.calls)
    blocks.seconds.update(torch=0.1, sdpa=0.1)  # would now choose the references
    again = choose(tmp_path)
    assert [(c.backend, c.source) for c in again.values()][1:] == [("fused", "cached"),
                                                                    ("chunks", "cached")]
    assert len(blocks.calls) == calls


@needs_kernels
def test_a_changed_host_or_shape_is_measured_again_and_the_references_keep_close_calls(
        tmp_path, blocks):
    choose(tmp_path)
    blocks.seconds.update(fused=(MARGIN + 1) / 2, chunks=2.0)  # faster within the margin; slower
    for changed in ({"key": "cpu B"}, {"seq_len": 48}):
        chosen = choose(tmp_path, **changed)
        assert (chosen["kernels"].backend, chosen["attention"].backend) == ("torch", "sdpa")
        assert chosen["kernels"].source == "measured"


def test_what_is_given_or_cannot_differ_is_never_measured(tmp_path, blocks):
    given = choose(tmp_path, kernels="torch", attention="sdpa")
    assert [(c.backend, c.source) for c in given.values()][1:] == [("torch", "setting"),
                                                                    ("sdpa", "setting")]
    inside = choose(tmp_path, kernels="torch", seq_len=16)  # every query sees its whole past
    assert inside["attention"].backend == "sdpa" and inside["attention"].times is None
    compiled = choose(tmp_path, compile="blocks")
    assert compiled["attention"].backend == "sdpa" and compiled["kernels"].times is None
    gpu = choose_backends(ModelSection(), TINY, torch.device("cuda"), 2, 4, 32, key="k",
                          cache=tmp_path / "backends.json")
    assert [(c.backend, c.source) for c in gpu.values()] == [
        ("aten", "device"), ("torch", "device"), ("flex", "device")]
    assert blocks.calls == [] and not (tmp_path / "backends.json").exists()


def test_without_the_fused_kernels_auto_says_so_and_runs_torchs_ops(tmp_path, blocks,
                                                                    monkeypatch):
    monkeypatch.setattr(cpu_kernels, "unavailable", lambda: "CalledProcessError: no c++")
    with pytest.warns(UserWarning, match="running torch's ops"):
        kernels = choose(tmp_path)["kernels"]
    assert (kernels.backend, kernels.times) == ("torch", None)
    with pytest.raises(ValueError, match="kernels='fused', but the fused CPU kernels cannot"):
        choose(tmp_path, kernels="fused")


@needs_kernels
def test_a_real_measurement_times_both_candidates_of_each(tmp_path):
    chosen = choose(tmp_path)
    assert chosen["kernels"].times.keys() == {"torch", "fused"}
    assert chosen["attention"].times.keys() == {"sdpa", "chunks"}
    assert min([*chosen["kernels"].times.values(), *chosen["attention"].times.values()]) > 0


def test_weight_prediction_on_a_device_whose_auto_compiles_the_blocks_is_a_config_error(
        monkeypatch):
    """`model.compile: auto` compiles on CUDA, and compiled blocks do not form the prediction:
    refused by the controller before anything runs (one line: exit 2), not in the workers."""
    from relaytrain.config import load_config
    from relaytrain.errors import ConfigError

    cfg = load_config("configs/tiny.yaml", ["parallel.pp=2", "parallel.schedule=paci",
                                            "parallel.paci.predict=true", "runtime.engine=ray"])
    monkeypatch.setattr(auto_backends, "pick_device", lambda _: torch.device("cuda"))
    with pytest.raises(ConfigError, match="^config key 'parallel.paci.predict': got true with "
                                          "model.compile=auto, which compiles the blocks on "
                                          "cuda"):
        auto_backends.settle_backends(cfg, cfg.model_config())
