"""`relaytrain bench gpu`: the one GPU command's plumbing, run as its CPU dry run (tiny sizes,
seconds), its refusal without CUDA, and the 7B and 32B memory plans' arithmetic."""

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from relaytrain.bench.gpu import (  # noqa: E402
    SECTIONS,
    bench_gpu,
    format_report,
    memory_plan,
    memory_table,
)
from relaytrain.errors import UserError  # noqa: E402
from relaytrain.model.config import PRESETS  # noqa: E402
from relaytrain.model.olmo3 import Olmo3  # noqa: E402


@pytest.mark.timeout(240)
def test_the_cpu_dry_run_fills_every_section_of_the_json(tmp_path):
    r = bench_gpu("cpu", quick=True, out=str(tmp_path))
    saved = json.loads((tmp_path / "gpu.json").read_text())
    for name in SECTIONS:
        assert "error" not in saved[name], saved[name]
    assert saved["throughput"]["tokens_per_s"]["ours"] > 0
    ckpt = saved["checkpointing"]
    assert ckpt["selective"]["same_losses"] and ckpt["full"]["same_losses"]
    assert saved["olmo3_7b"]["execution"]["checkpointing"] == "full"
    # On one device a resume is bit-identical; exact mode reproduces itself.
    assert saved["portability"]["cpu_to_cpu"]["max_abs_diff_vs_uninterrupted_on_target"] == 0
    assert saved["portability"]["cpu_to_cpu"]["continuous"]
    det = saved["determinism"]
    assert det["rerun_bitwise"] and det["resume_bitwise"] and det["exact_cost"] > 0
    # the reduction's figures beside fast mode's: one device folds (exact) but reduces nothing
    assert 0 < det["exact_fold_share"] < 1 and det["fast_fold_share"] == 0
    assert det["exact_wire_bytes_per_param"] == det["fast_wire_bytes_per_param"] == 0
    assert det["exact_comm_share"] == det["fast_comm_share"] == 0
    assert "portability" in format_report(r)


def test_bad_device_sections_and_missing_cuda_are_user_errors(tmp_path):
    with pytest.raises(UserError, match="expected cuda"):
        bench_gpu("tpu", out=str(tmp_path))
    with pytest.raises(UserError, match="unknown section 'speed'"):
        bench_gpu("cpu", only=["speed"], out=str(tmp_path))
    if not torch.cuda.is_available():
        with pytest.raises(UserError, match="no CUDA device"):
            bench_gpu("cuda", out=str(tmp_path))
    assert not (tmp_path / "gpu.json").exists()  # refused before any work


def test_the_7b_memory_plan_is_16_bytes_per_parameter_plus_checkpointed_activations():
    plan = memory_plan(PRESETS["olmo3-7b"], 8192, 1)
    n = plan["params"]
    assert 7.2e9 < n < 7.4e9
    assert plan["weights_fp32"] + plan["grads_fp32"] + plan["adamw_fp32"] == 16 * n
    assert plan["checkpoints"] == 32 * 8192 * 4096 * 4  # every block's fp32 input
    assert plan["peak"] == plan["backward_peak"] < 141e9  # one H200


def test_the_7b_plan_sharded_8_ways_fits_an_80_gb_gpu_in_fast_and_exact_mode():
    whole = memory_plan(PRESETS["olmo3-7b"], 8192, 1)
    for exact in (False, True):
        plan = memory_plan(PRESETS["olmo3-7b"], 8192, 1, fsdp=8, exact=exact)
        state = plan["weights_fp32"] + plan["grads_fp32"] + plan["adamw_fp32"]
        assert state <= 1.1 * 16 * whole["params"] / 8
        assert plan["peak"] < 80e9
    assert memory_plan(PRESETS["olmo3-7b"], 8192, 1, exact=True)["peak"] > 141e9  # unsharded


def test_the_32b_plan_needs_16_gpus_fast_and_32_exact_on_80_gb():
    cfg = PRESETS["olmo3-32b"]
    fits = {(f, exact): memory_plan(cfg, 8192, 1, fsdp=f, exact=exact)["peak"] < 80e9
            for f in (8, 16, 32) for exact in (False, True)}
    assert fits == {(8, False): False, (8, True): False, (16, False): True, (16, True): False,
                    (32, False): True, (32, True): True}
    assert {f: memory_plan(cfg, 8192, 1, fsdp=f, gather="fp32")["peak"] < 80e9
            for f in (8, 16, 32)} == {8: False, 16: True, 32: True}  # the same with fp32 gathers
    plan = memory_plan(cfg, 8192, 1, fsdp=16)
    assert plan["gather_dtype"] == "bf16"
    assert plan["weights_fp32"] + plan["grads_fp32"] + plan["adamw_fp32"] == \
        16 * plan["params"] // 16
    assert plan["checkpoints"] == 64 * 8192 * 5120 * 2  # the residual stream is bf16
    assert memory_plan(cfg, 8192, 1, fsdp=16, gather="fp32")["checkpoints"] == \
        64 * 8192 * 5120 * 4


@pytest.mark.parametrize("preset", ["olmo3-7b", "olmo3-32b"])
def test_bf16_gathers_save_half_the_gathered_weights_gradients_and_checkpoints(preset):
    """Fast mode's default (bf16 gathers, fp32 reduce-scatter) against fp32 gathers: the
    gathered units and the residual stream (the block checkpoints) take 2 bytes a value
    instead of 4, a unit's gradient in flight 2 instead of 4 (its fp32 reduce-scatter input
    stays), autocast makes no bf16 copies."""
    cfg = PRESETS[preset]
    with torch.device("meta"):  # the model as built, without its memory
        model = Olmo3(cfg)
    layer = sum(p.numel() for p in model.layers["0"].parameters())  # a unit: one block
    root = sum(p.numel() for name, p in model.named_parameters()  # embedding, norm, head
               if not name.startswith("layers."))
    gathered, unit = root + 2 * layer, max(root, layer)
    checkpoints = cfg.n_layers * 8192 * cfg.d_model
    for fsdp in (8, 16, 32):
        bf16 = memory_plan(cfg, 8192, 1, fsdp=fsdp)
        fp32 = memory_plan(cfg, 8192, 1, fsdp=fsdp, gather="fp32")
        assert (bf16["gather_dtype"], fp32["gather_dtype"]) == ("bf16", "fp32")
        assert bf16["peak"] == bf16["backward_peak"] and fp32["peak"] == fp32["backward_peak"]
        assert fp32["peak"] - bf16["peak"] == 2 * (gathered + unit + checkpoints)
        assert bf16["reduce_in_flight"] == (2 + 4) * unit
        assert bf16["autocast_bf16_copies"] == 0 < fp32["autocast_bf16_copies"] == 2 * gathered
        assert memory_plan(cfg, 8192, 1, fsdp=fsdp, exact=True) == \
            memory_plan(cfg, 8192, 1, fsdp=fsdp, exact=True, gather="fp32")
    with pytest.raises(ValueError, match="exact mode gathers fp32"):
        memory_plan(cfg, 8192, 1, fsdp=8, exact=True, gather="bf16")


def test_the_docs_memory_tables_are_what_memory_table_computes():
    """docs/MEASURED.md's tables are memory_table's output, none typed by hand."""
    text = (Path(__file__).parents[2] / "docs" / "MEASURED.md").read_text()
    for preset, fsdps in (("olmo3-7b", (8,)), ("olmo3-32b", (8, 16, 32))):
        for f in fsdps:  # the rows add up to the backward's peak, as the table says
            for exact in (False, True):
                plan = memory_plan(PRESETS[preset], 8192, 1, fsdp=f, exact=exact)
                assert plan["peak"] == plan["backward_peak"]
        assert memory_table(PRESETS[preset], 8192, 1, fsdps) in text
    # stage 3, cp 8, each as its config checkpoints (7B: none, as OLMo-core's script)
    for preset, fsdps, ac in (("olmo3-7b", (8,), "none"), ("olmo3-32b", (16, 32), "full")):
        assert memory_table(PRESETS[preset], 65_536, 1, fsdps, cp=8, checkpointing=ac) in text


def test_the_plan_at_65536_tokens_over_cp_8_fits_80_gb_where_whole_sequences_cannot():
    """Olmo 3's stage 3 (65,536 tokens, cp 8): a device holds 1/8 of the block checkpoints, and
    one layer's context-parallel attention (the sequence's keys and values, one query block's
    scores, the dK/dV sums) on top; 7B fits at fsdp 8 in both modes, 32B at fsdp 16 (fast) and
    32 (exact); with whole sequences only 7B's fast mode would."""
    for name, fast, exact in (("olmo3-7b", 8, 8), ("olmo3-32b", 16, 32)):
        cfg = PRESETS[name]
        for fsdp, is_exact in ((fast, False), (exact, True)):
            whole = memory_plan(cfg, 65_536, 1, fsdp=fsdp, exact=is_exact)
            split = memory_plan(cfg, 65_536, 1, fsdp=fsdp, exact=is_exact, cp=8)
            assert split["checkpoints"] * 8 == whole["checkpoints"]
            assert 0 < split["context_attention"] < split["checkpoints"] * 4
            assert split["peak"] < 80e9, (name, fsdp, is_exact, split["peak"])
            assert (whole["peak"] < 80e9) == (name == "olmo3-7b" and not is_exact)
    assert memory_plan(PRESETS["olmo3-7b"], 8192, 1, fsdp=8)["context_attention"] == 0
