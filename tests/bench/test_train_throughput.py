"""`relaytrain bench train-throughput` runs end to end (quick, tiny preset): every training step
produces tokens/s, MFU and a ratio, on the same weights and data. No timing thresholds here."""

import json
import math

import pytest

from relaytrain.model.matmul import onednn_available

pytest.importorskip("transformers")

from relaytrain.bench.train_throughput import (  # noqa: E402
    PAGE,
    _minor_faults,
    bench_train_throughput,
    format_report,
)


@pytest.mark.timeout(240)
def test_quick_tiny_run_reports_both_steps_and_their_ratio(capsys):
    r = bench_train_throughput(device="cpu", quick=True, preset="tiny")
    err = capsys.readouterr().err  # progress: the plan, then each round
    assert "start: preset tiny, 2 rounds" in err and "timed rounds (repetition 2/2)" in err
    for name in ("ours", "hf"):
        v = r[name]
        assert v["tokens_per_s"] > 0 and v["step_s"] > 0 and v["cpu_s_per_step"] > 0
        assert 0 < v["mfu"] and v["saved_activation_bytes"] > 0
        assert v["faulted_bytes_per_step"] >= 0 and v["faulted_bytes_per_step"] % PAGE == 0
    assert r["ratio"] > 0 and r["ratio_of_medians"] > 0 and len(r["ratio_rounds"]) == 2
    assert "hf_compiled" not in r  # the compiled baseline is a CUDA variant
    assert "ours_compiled" not in r  # ours compiled on the CPU: full runs only (compile time)
    s = r["settings"]
    assert s["tokens_per_step"] == s["seq_len"] * s["micro_batch"] == 64 * 8
    assert s["threads"] == 2 and s["optimizer"]["impl"] == "fused"
    # the sliding layers run as `model.attention: auto` measured them faster (tiny's head dim,
    # 16, is no multiple of the window kernel's: chunks there go through torch's kernels)
    attention = s["choices"]["attention"]
    assert attention["source"].startswith(("measured", "cached")) and attention["times"].keys() == {
        "sdpa", "chunks"}
    assert s["ours_sliding_attention"] == {"chunks": "chunks", "sdpa": "sdpa mask"}[
        attention["backend"]]
    # Same weights, same batch, same math: the first step's cross-entropy agrees.
    assert math.isclose(r["ours"]["first_loss"], r["hf"]["first_loss"], rel_tol=1e-5)
    text = format_report(r)
    assert "relaytrain" in text and "HF transformers" in text and "ours / HF" in text
    # auto's choices are reported with both timings, and the step with the other GEMMs beside.
    choice = s["choices"]["matmul"]
    assert s["ours_matmul"] == choice["backend"]
    for c in s["choices"].values():
        assert f"auto: model.{c['setting']}={c['backend']} ({c['source']}" in text
    if onednn_available():
        assert choice["times"]["aten"] > 0 and choice["times"]["onednn"] > 0
        other = "aten" if choice["backend"] == "onednn" else "onednn"
        assert r[f"ours_{other}"]["tokens_per_s"] > 0 and r[f"ratio_{other}"] > 0
        assert math.isclose(r[f"ours_{other}"]["first_loss"], r["hf"]["first_loss"],
                            rel_tol=1e-5)
        assert f"relaytrain ({other})" in text and f"model.matmul={other}" in text
    json.dumps(r)  # what `--json` prints


def test_unknown_preset_and_device_are_user_errors():
    from relaytrain.errors import UserError

    with pytest.raises(UserError, match="preset"):
        bench_train_throughput(preset="huge")
    with pytest.raises(UserError, match="device"):
        bench_train_throughput(device="tpu")


def test_the_fault_counter_sees_fresh_memory_being_touched():
    """What the `faulted/step` column counts: every first touch of a fresh page."""
    import mmap

    pages = 2048
    with mmap.mmap(-1, pages * PAGE) as m:
        if hasattr(mmap, "MADV_NOHUGEPAGE"):  # a huge page would take 512 first touches at once
            m.madvise(mmap.MADV_NOHUGEPAGE)
        before = _minor_faults()
        for i in range(pages):
            m[i * PAGE] = 1
        assert _minor_faults() - before >= pages
