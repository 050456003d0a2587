"""What a resumed run may change: how the model executes, never what defines its curve; the
GEMMs, kernels and sliding attention `auto` measures are decided once per run, recorded, kept
by a run resumed on the host that chose them and may differ on another."""

import pytest
import torch
import yaml

import relaytrain.model.backend_choice as backend_choice
import relaytrain.runtime.controller as controller
import relaytrain.train.auto_backends as auto_backends
from relaytrain.cli import main
from relaytrain.errors import ConfigError
from relaytrain.model import cpu_kernels
from relaytrain.model.matmul import onednn_available
from relaytrain.runtime.controller import Controller
from tests.runtime.conftest import step_records, tiny_config

needs_onednn = pytest.mark.skipif(not onednn_available(), reason="torch built without oneDNN")


@pytest.mark.timeout(180)
def test_the_controller_resolves_the_kernels_once_and_records_them(tmp_path, corpus_data,
                                                                   monkeypatch):
    run = tmp_path / "run"
    summary = Controller(tiny_config(run, corpus_data, "train.max_steps=1")).run()
    # what `auto` measured faster here (never fused where they cannot be built), concrete
    possible = ("fused", "torch") if cpu_kernels.unavailable() is None else ("torch",)
    assert summary.kernels.backend in possible
    assert yaml.safe_load((run / "config.yaml").read_text())["model"]["kernels"] == \
        summary.kernels.backend
    monkeypatch.setattr(cpu_kernels, "unavailable", lambda: "CalledProcessError: no c++")
    with pytest.warns(UserWarning, match="running torch's ops"):
        cfg = Controller(tiny_config(tmp_path / "b", corpus_data)).cfg
    assert cfg.model.kernels == "torch"
    with pytest.raises(ConfigError, match=r"'model.kernels': kernels='fused', but the fused CPU "
                                          r"kernels cannot be built here \(CalledProcessError"):
        Controller(tiny_config(tmp_path / "c", corpus_data, "model.kernels=fused"))


def test_the_manifest_records_the_dtype_a_sharded_run_gathers_in(tmp_path, corpus_data,
                                                                  monkeypatch):
    """config.yaml keeps `parallel.fsdp_param_dtype: auto`; each checkpoint's manifest says what
    the workers resolved it to on the run's device (train/state.py: `param_dtype`)."""
    fixed = ("runtime.engine=ray", "model.matmul=aten", "model.kernels=torch",
             "model.attention=sdpa")  # no backend contests: the controller is only built

    def gathers(*overrides: str) -> tuple[str, str | None]:
        """The setting the manifest's config records, and the dtype its topology states."""
        meta = Controller(tiny_config(tmp_path / "run", corpus_data, *fixed,
                                      *overrides))._manifest_meta(0)
        return meta["config"]["parallel"]["fsdp_param_dtype"], \
            meta["topology"]["fsdp_param_dtype"]

    assert gathers() == ("auto", None)  # unsharded: nothing is gathered
    assert gathers("parallel.fsdp=2") == ("auto", "fp32")  # the CPU
    assert gathers("parallel.fsdp=2", "parallel.fsdp_param_dtype=bf16") == ("bf16", "bf16")
    monkeypatch.setattr(controller, "pick_device", lambda kind: torch.device("cuda"))
    assert gathers("parallel.fsdp=2") == ("auto", "bf16")  # Olmo 3's recipe
    assert gathers("parallel.fsdp=2", "determinism=exact") == ("auto", "fp32")
    assert gathers("parallel.fsdp=2", "parallel.fsdp_param_dtype=fp32") == ("fp32", "fp32")


@pytest.fixture
def host(monkeypatch):
    """The host `model.matmul: auto` measures on: `host.name` is its key, `host.onednn_ratio`
    what its measurement finds (oneDNN's time over aten's)."""
    def fake_measure(shapes, threads, rounds=4):
        return {"aten": 0.010, "onednn": 0.010 * host.onednn_ratio}, host.onednn_ratio

    host = type("Host", (), {"name": "cpu A", "onednn_ratio": 0.5})()
    monkeypatch.setattr(backend_choice, "host_key", lambda threads: host.name)
    monkeypatch.setattr(backend_choice, "measure", fake_measure)
    monkeypatch.setattr(backend_choice, "loaded", lambda: False)  # the suite loads the cores
    return host


@needs_onednn
@pytest.mark.timeout(180)
def test_auto_is_decided_once_by_the_controller_and_recorded_in_the_run(tmp_path, corpus_data,
                                                                        host):
    run = tmp_path / "run"
    summary = Controller(tiny_config(run, corpus_data, "train.max_steps=2")).run()
    assert summary.matmul.backend == "onednn"
    assert summary.matmul.source in ("measured", "cached")
    assert yaml.safe_load((run / "config.yaml").read_text())["model"]["matmul"] == "onednn"


@needs_onednn
@pytest.mark.timeout(240)
def test_a_run_resumed_on_its_host_keeps_its_backend_to_the_same_bits(tmp_path, corpus_data,
                                                                      host):
    """Checkpointed with oneDNN's GEMMs; by the resume the host's cached choice is gone (a
    loaded host's measurement expired) and aten now measures faster on the same host: the run
    continues with oneDNN, bit-identical to the uninterrupted run."""
    whole, split = tmp_path / "whole", tmp_path / "split"
    Controller(tiny_config(whole, corpus_data, "train.max_steps=8", "checkpoint.every=4")).run()
    Controller(tiny_config(split, corpus_data, "train.max_steps=4", "checkpoint.every=4")).run()
    backend_choice.cache_path().unlink()
    host.onednn_ratio = 2.0
    summary = Controller(tiny_config(split, corpus_data, "train.max_steps=8",
                                     "checkpoint.every=4")).run()
    assert summary.resumed_from == 4
    assert (summary.matmul.backend, summary.matmul.source) == ("onednn", "resumed")
    assert yaml.safe_load((split / "config.yaml").read_text())["model"]["matmul"] == "onednn"
    a, b = step_records(whole), step_records(split)
    assert [b[s]["loss"] for s in range(1, 9)] == [a[s]["loss"] for s in range(1, 9)]


@needs_onednn
@pytest.mark.timeout(240)
def test_a_run_resumed_where_auto_chooses_differently_continues(tmp_path, corpus_data, host):
    """Checkpointed with oneDNN's GEMMs on host A, resumed on host B where aten measures
    faster: the run continues from its checkpoint with aten, its losses those of the
    uninterrupted run to the backends' rounding."""
    whole, split = tmp_path / "whole", tmp_path / "split"
    Controller(tiny_config(whole, corpus_data, "train.max_steps=8", "checkpoint.every=4")).run()
    Controller(tiny_config(split, corpus_data, "train.max_steps=4", "checkpoint.every=4")).run()
    host.name, host.onednn_ratio = "cpu B", 2.0
    summary = Controller(tiny_config(split, corpus_data, "train.max_steps=8",
                                     "checkpoint.every=4")).run()
    assert summary.resumed_from == 4 and summary.matmul.backend == "aten"
    assert yaml.safe_load((split / "config.yaml").read_text())["model"]["matmul"] == "aten"
    a, b = step_records(whole), step_records(split)
    assert sorted(b) == list(range(1, 9))
    for step in range(1, 5):
        assert a[step]["loss"] == b[step]["loss"]
    for step in range(5, 9):
        assert b[step]["loss"] == pytest.approx(a[step]["loss"], rel=1e-4)
    assert main(["data", "audit", str(split)]) == 0


@pytest.mark.skipif(cpu_kernels.unavailable() is not None, reason="no fused CPU kernels here")
@pytest.mark.timeout(240)
def test_a_run_resumed_on_its_host_keeps_its_kernels_and_attention_to_the_same_bits(
        tmp_path, corpus_data, host, monkeypatch):
    """Checkpointed with the fused kernels and chunked sliding attention `auto` measured
    faster; by the resume the cache is gone and torch's ops and the dense mask now measure
    faster on the same host: the run continues as it began, bit-identical."""
    faster = {"fused", "chunks"}
    host.name = "cpu K"  # a host no other test has measured on

    def fake_round(stage, shape, matmul, kernels, attention):
        return lambda: 1.0 if (kernels if stage.last else attention) in faster else 2.0

    monkeypatch.setattr(auto_backends, "_timed_round", fake_round)
    whole, split = tmp_path / "whole", tmp_path / "split"
    overrides = ("train.max_steps=8", "checkpoint.every=4", "model.matmul=aten")
    Controller(tiny_config(whole, corpus_data, *overrides)).run()
    Controller(tiny_config(split, corpus_data, "train.max_steps=4", *overrides[1:])).run()
    assert yaml.safe_load((split / "config.yaml").read_text())["model"] | {
        "kernels": "fused", "attention": "chunks"} == yaml.safe_load(
        (split / "config.yaml").read_text())["model"]
    backend_choice.cache_path().unlink()
    faster = {"torch", "sdpa"}
    summary = Controller(tiny_config(split, corpus_data, *overrides)).run()
    assert summary.resumed_from == 4
    assert {k: (c.backend, c.source) for k, c in (("kernels", summary.kernels),
                                                  ("attention", summary.attention))
            } == {"kernels": ("fused", "resumed"), "attention": ("chunks", "resumed")}
    a, b = step_records(whole), step_records(split)
    assert [b[s]["loss"] for s in range(1, 9)] == [a[s]["loss"] for s in range(1, 9)]
