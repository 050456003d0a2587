"""Fused CPU kernels for the model's elementwise work: RMSNorm, SwiGLU and RoPE, forward and
backward, and the LM head's softmax; and for the sliding layers' attention (`model.kernels`).

Why: on the CPU, a training step's time outside its GEMMs and attention goes to elementwise
ops, each a separate pass over memory: an RMSNorm took about ten passes forward and backward,
the SwiGLU five tensors' worth of silu, mul and silu_backward, the head's softmax gradient
four passes over each chunk of logits (log_softmax, exp_, mul_). Compiled blocks fuse them, but
compiling costs every worker process seconds at start (docs/MEASURED.md), replacements
included. These kernels (`cpu_kernels.cpp`) read their inputs and write their outputs once,
and are compiled once per host (where torch keeps extensions it builds: `build_dir`), keyed by
the source, the CPU's vector ISA and the torch version, and loaded from there in a millisecond
by every later process. A sliding layer through torch's flash kernels (`model.sliding_chunks`)
scores chunks of 32 queries against every key any of them reaches and copies and adds each
chunk's results; `window_attention` scores each query against its own window's keys, takes
grouped kv heads as they are, and returns its output in the layout the output projection
reads: a sliding layer's forward and backward in 0.6x the time (docs/MEASURED.md).

Numerics: SwiGLU and RoPE round exactly as torch's ops they replace (the same vectorised exp,
the same products and sums in the same order; `tests/model/test_cpu_kernels.py` checks them
bit for bit). RMSNorm sums each row's squares in a different order than torch's `mean`, and
the softmax is `exp(x - logsumexp)` rather than the exponential of torch's log-softmax, and
the window attention sums in its own order, so their results differ from HF's in the last
bits (float rounding; `relaytrain parity hf` bounds the difference). No result depends on the
thread count, so runs stay bit-reproducible and exact mode's invariances hold.

`model.kernels`: `torch` runs torch's ops as HF does (the path whose CPU logits are bit-identical
with HF's under `model.matmul: aten`), `fused` these kernels (an error where they cannot be
built), `auto` the fused kernels on the CPU where they build, torch's ops elsewhere and in
compiled blocks (which fuse the same ops themselves). A kernel applies to fp32 CPU tensors
outside autocast; anything else takes torch's ops call by call.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import os
import shutil
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

KERNEL_SETTINGS = ("auto", "torch", "fused")
SOURCE = Path(__file__).with_name("cpu_kernels.cpp")
# The vector ISA torch's own CPU kernels were dispatched to, as compiler flags: the kernels use
# ATen's Vectorized<float> at the same width (and so its exp).
ISA_FLAGS = {
    "AVX512": ["-mavx512f", "-mavx512dq", "-mavx512vl", "-mavx512bw", "-mfma",
               "-DCPU_CAPABILITY=AVX512", "-DCPU_CAPABILITY_AVX512"],
    "AVX2": ["-mavx2", "-mfma", "-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2"],
}
# No contraction of a * b + c into one rounding the source did not write (at::vec::fmadd):
# torch's ops round each product and sum on its own, and so must the kernels replacing them.
# OpenMP: at::parallel_for is compiled into the kernels, and runs serially without it (torch's
# CPU builds use OpenMP; the runtime loaded is torch's own, whose thread count torch sets).
CFLAGS = ["-O3", "-ffp-contract=off", "-fopenmp"]
LDFLAGS = ["-fopenmp"]


def _isa() -> str:
    try:
        return torch.backends.cpu.get_cpu_capability()
    except AttributeError:  # an older torch: the portable build
        return "DEFAULT"


def build_dir() -> Path:
    """Where this host's build lives: torch's directory for extensions built on first use
    (`TORCH_EXTENSIONS_DIR`, else `torch_extensions` in the user's cache directory), one
    subdirectory per source, ISA, torch and Python version."""
    flags = CFLAGS + LDFLAGS + ISA_FLAGS.get(_isa(), [])
    tag = hashlib.sha256("\0".join([SOURCE.read_text(), torch.__version__, sys.version,
                                    *flags]).encode()).hexdigest()[:16]
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"),
        "torch_extensions")
    return Path(root) / f"relaytrain_cpu_{_isa().lower()}_{tag}"


def _find_ninja() -> None:
    """torch builds extensions with `ninja` from PATH; the `ninja` package (a dependency)
    installs it beside the interpreter, which is not on PATH unless the environment is
    activated."""
    if shutil.which("ninja") is None:
        import ninja

        os.environ["PATH"] = os.pathsep.join([ninja.BIN_DIR, os.environ.get("PATH", "")])


@functools.cache
def unavailable() -> str | None:
    """None once this host's build of the kernels is loaded in this process, else why they
    cannot be. The build is compiled first when there is none (about 20 s on 2 cores);
    processes starting together wait for one build (an OS file lock, which a builder that dies
    releases)."""
    directory = build_dir()
    library = directory / f"{directory.name}.so"
    built = directory / "built"  # written once a build is complete
    try:
        if not built.exists():
            from torch.utils import cpp_extension

            directory.mkdir(parents=True, exist_ok=True)
            with open(directory / "build.lock", "w") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                if not built.exists():
                    (directory / "lock").unlink(missing_ok=True)  # torch's, left by a dead build
                    print(f"relaytrain: compiling the fused CPU kernels into {directory} (once "
                          "per host, ~20 s)", file=sys.stderr, flush=True)
                    _find_ninja()
                    cpp_extension.load(directory.name, [str(SOURCE)], extra_cflags=CFLAGS
                                       + ISA_FLAGS.get(_isa(), []), extra_ldflags=LDFLAGS,
                                       build_directory=str(directory), is_python_module=False)
                    built.touch()
                    return None
        torch.ops.load_library(str(library))
        return None
    except Exception as e:  # noqa: BLE001 - no compiler, no ninja, a failed build: say which
        lines = [line for line in str(e).strip().splitlines() if line.strip()]
        return f"{type(e).__name__}: {lines[-1] if lines else e!r}"


def resolve(setting: str, device: torch.device) -> bool:
    """Whether `model.kernels: setting` runs the fused kernels on `device`."""
    if setting not in KERNEL_SETTINGS:
        raise ValueError(f"kernels={setting!r}: expected one of {KERNEL_SETTINGS}")
    if setting == "torch" or device.type != "cpu":
        if setting == "fused" and device.type != "cpu":
            raise ValueError(f"kernels='fused' runs on the CPU only, not on {device.type}; "
                             "use 'auto' or 'torch'")
        return False
    why = unavailable()
    if why is not None and setting == "fused":
        raise ValueError(f"kernels='fused', but the fused CPU kernels cannot be built here "
                         f"({why}); use 'auto' or 'torch'")
    if why is not None:
        warnings.warn(f"model.kernels=auto: the fused CPU kernels cannot be built here ({why}); "
                      "running torch's ops", stacklevel=2)
    return why is None


def cpu_fp32(*tensors: Tensor) -> bool:
    """Whether the CPU's fp32 fast paths take these tensors (these kernels, the chunked
    sliding attention, oneDNN's GEMMs): fp32 on the CPU, outside autocast."""
    return not torch.is_autocast_enabled("cpu") and all(
        t.device.type == "cpu" and t.dtype == torch.float32 for t in tensors)


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        rows = x.contiguous().view(-1, x.shape[-1])
        y, r = torch.ops.relaytrain_cpu.rms_norm_fwd(rows, weight.contiguous(), eps)
        ctx.save_for_backward(rows, r, weight)
        return y.view(x.shape)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        rows, r, weight = ctx.saved_tensors
        dx, dw = torch.ops.relaytrain_cpu.rms_norm_bwd(
            grad.contiguous().view(rows.shape), rows, r, weight.contiguous())
        return dx.view(grad.shape), dw, None


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, gate: Tensor, up: Tensor) -> Tensor:
        gate, up = gate.contiguous(), up.contiguous()
        ctx.save_for_backward(gate, up)
        return torch.ops.relaytrain_cpu.swiglu_fwd(gate, up)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor]:
        gate, up = ctx.saved_tensors
        return tuple(torch.ops.relaytrain_cpu.swiglu_bwd(grad.contiguous(), gate, up))


class _Rope(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        cos, sin = cos.contiguous(), sin.contiguous()
        ctx.save_for_backward(cos, sin)
        return torch.ops.relaytrain_cpu.rope(_dense_rows(x), cos, sin, False)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        cos, sin = ctx.saved_tensors
        return torch.ops.relaytrain_cpu.rope(_dense_rows(grad), cos, sin, True), None, None


class _WindowAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, window: int, scale: float) -> Tensor:
        q, k, v = _dense_rows(q), _dense_rows(k), _dense_rows(v)
        out, lse = torch.ops.relaytrain_cpu.window_attention_fwd(q, k, v, window, scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.window, ctx.scale = window, scale
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = torch.ops.relaytrain_cpu.window_attention_bwd(
            _dense_rows(grad), q, k, v, out, lse, ctx.window, ctx.scale)
        return dq, dk, dv, None, None


def _dense_rows(x: Tensor) -> Tensor:
    """x itself when its last dimension is dense (the kernel takes any other strides), else a
    contiguous copy."""
    return x if x.stride(-1) == 1 else x.contiguous()


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """`weight * x * rsqrt(mean(x^2) + eps)` over the last dimension (fp32 CPU tensors)."""
    return _RMSNorm.apply(x, weight, eps)


def swiglu(gate: Tensor, up: Tensor) -> Tensor:
    """`silu(gate) * up` (fp32 CPU tensors of one shape)."""
    return _SwiGLU.apply(gate, up)


def logsumexp_rows(logits: Tensor) -> Tensor:
    """Each row's `log(sum(exp(logits)))` [rows] (contiguous fp32 CPU logits [rows, V])."""
    return torch.ops.relaytrain_cpu.logsumexp_rows(logits)


def softmax_scale_(logits: Tensor, lse: Tensor, scale: Tensor) -> Tensor:
    """`logits` overwritten with `exp(logits - lse) * scale` row by row, and returned: the
    softmax scaled per row, in one pass (contiguous fp32 CPU tensors [rows, V], [rows])."""
    torch.ops.relaytrain_cpu.softmax_scale_(logits, lse.contiguous(), scale.contiguous())
    return logits


WINDOW_HEAD_DIMS = 64  # window_attention takes head dims that are multiples of this


def window_attention(q: Tensor, k: Tensor, v: Tensor, window: int, scale: float) -> Tensor:
    """Attention of q [B, H, T, hd] over k, v [B, Hkv, T, hd] (fp32 CPU tensors; each kv head
    serves H / Hkv query heads, hd a multiple of `WINDOW_HEAD_DIMS`) restricted to
    q - window < k <= q, scores scaled by `scale`: every query scored against the keys in its
    window alone. The output [B, H, T, hd] has the memory of [B, T, H, hd], the layout the
    output projection takes without a copy."""
    return _WindowAttention.apply(q, k, v, window, scale)


def rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate-half RoPE of x [B, H, T, hd] by the [T, hd] tables (fp32 CPU tensors); the
    result has x's layout."""
    return _Rope.apply(x, cos, sin)
