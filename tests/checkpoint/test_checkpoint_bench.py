"""The checkpoint benchmark: model-shaped state, and ratios against raw I/O of the same bytes
on the disk and on an object store it is pointed at."""

from __future__ import annotations

import math

import pytest

from relaytrain.bench.checkpoint import (
    REMOTE_READS,
    bench_checkpoint_local,
    bench_checkpoint_remote,
    format_report,
    param_shapes,
)
from relaytrain.checkpoint.store import CheckpointStore
from relaytrain.cli import main
from relaytrain.errors import UserError
from relaytrain.model.accounting import param_count
from relaytrain.model.config import PRESETS
from relaytrain.storage import filesystem


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_state_has_the_parameter_count_of_the_preset(preset):
    cfg = PRESETS[preset]
    if cfg.vocab_size is None:
        cfg = cfg.with_vocab(50257)
    shapes = param_shapes(cfg)
    assert sum(math.prod(s) for s in shapes.values()) == param_count(cfg)
    assert {"embed.weight", "norm.weight", "lm_head.weight",
            "layers.0.attn.q_norm.weight", "layers.0.mlp.down_proj.weight"} <= shapes.keys()


def test_quick_bench_reports_bandwidth_next_to_the_raw_disk(tmp_path):
    local = bench_checkpoint_local(["tiny"], 1, directory=str(tmp_path))
    r = local["tiny"]
    assert r["bytes"] > 3 * 4 * r["params"] - 1
    for key in ("save_GBps", "restore_GBps", "raw_write_GBps", "raw_read_GBps",
                "raw_read_new_GBps", "save_vs_raw", "restore_vs_raw", "restore_vs_raw_new",
                "restore_in_place_GBps", "restore_in_place_vs_raw"):
        assert r[key] > 0, key
    report = format_report({"repeats": 1, "local": local, "remote": {}})
    assert "x raw write" in report and "x a raw read into new memory" in report
    assert "restore in place (a resume)" in report and "target >= 0.8x" in report
    assert list(tmp_path.iterdir()) == []  # cleans up after itself


@pytest.mark.timeout(120)
def test_an_object_store_is_measured_against_raw_put_and_get_then_emptied(object_server,
                                                                          capsys, monkeypatch):
    url = object_server.url("bench")
    restores = []
    read = CheckpointStore.read
    monkeypatch.setattr(CheckpointStore, "read", lambda self, step, **kw: restores.append(
        step) or read(self, step, **kw))
    r = bench_checkpoint_remote(url, "tiny", 1)
    assert restores == [1] * 2 * REMOTE_READS  # new tensors and in place, REMOTE_READS times
    for key in ("save_GBps", "restore_GBps", "raw_put_GBps", "raw_get_GBps", "raw_get_new_GBps",
                "save_vs_raw", "restore_vs_raw", "restore_vs_raw_new", "restore_in_place_vs_raw"):
        assert r[key] > 0, key
    assert "repetition 1/1" in capsys.readouterr().err  # progress on stderr
    text = format_report({"repeats": 1, "local": {}, "remote": {f"{url} tiny": r}})
    assert f"{url} tiny" in text and "x raw get" in text and "raw get into new memory" in text
    fs, path = filesystem(url)
    assert not fs.exists(path) or fs.ls(path) == []


def _ratios(save: float, in_place: float, new: float, new_vs_reused: float) -> dict:
    """A local result whose times give these ratios (the raw I/O all at 1 GB/s)."""
    return {"bytes": 10**9, "params": 1, "save_s": 1 / save, "save_GBps": save,
            "raw_write_GBps": 1.0, "save_vs_raw": save, "restore_in_place_s": 1 / in_place,
            "restore_in_place_GBps": in_place, "restore_in_place_vs_raw": in_place,
            "raw_read_GBps": 1.0, "restore_s": 1 / new, "restore_GBps": new,
            "restore_vs_raw_new": new, "raw_read_new_GBps": 1.0,
            "restore_vs_raw": new_vs_reused, "snapshot_s": 0.0, "snapshot_first_s": 0.0}


@pytest.mark.parametrize(("ratios", "verdict"), [
    ((1.2, 0.95, 0.85, 0.5), "met"),  # new tensors are held to the raw read into new memory
    ((0.79, 0.95, 0.85, 0.9), "NOT met by save"),
    ((1.0, 0.7, 0.6, 0.5), "NOT met by restore in place, restore into new tensors"),
])
def test_each_operation_is_held_to_the_raw_io_it_is_set_beside(ratios, verdict):
    report = format_report({"repeats": 1, "local": {"small": _ratios(*ratios)}, "remote": {}})
    assert report.splitlines()[-1].endswith(f"restore into new tensors: {verdict}")


def test_url_is_an_option_of_the_checkpoint_bench_only(capsys):
    assert main(["bench", "loader", "--url", "s3://b/x"]) == 2
    assert "--url is an option of bench checkpoint only" in capsys.readouterr().err


def test_unknown_preset_is_a_one_line_user_error():
    with pytest.raises(UserError, match="unknown model preset 'huge'"):
        bench_checkpoint_local(["huge"])

