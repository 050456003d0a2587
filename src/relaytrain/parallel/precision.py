"""The dtype FSDP2 gathers parameters in (`parallel.fsdp_param_dtype`), by name.

Apart from parallel/fsdp.py so that what does not shard can resolve it without importing FSDP2
(1.2 s, parallel/shards.py): the controller records it in each checkpoint's manifest, the
memory plan (`bench.gpu.memory_plan`) sizes the gathers by it.
"""

from __future__ import annotations


def gather_dtype(setting: str, device_type: str, exact: bool) -> str:
    """`bf16` or `fp32`. `auto`: bf16 on CUDA, as Olmo 3's recipe; fp32 on the CPU, which runs
    without autocast (its fused kernels are fp32 ones), and in exact mode, whose bits are the
    unsharded run's (config/checks.py refuses an explicit bf16 there)."""
    if setting == "auto":
        return "bf16" if device_type == "cuda" and not exact else "fp32"
    return setting
