"""How a training process executes on its device: which device, the model's kernels, activation
checkpointing and compilation (`model.attention`, `model.checkpointing`, `model.compile`,
`model.matmul`, `model.kernels`), and the GPU switches `determinism: exact` needs.

None of it changes parameter names, checkpoints or the math: a checkpoint written under one
setting (or device) resumes under any other.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
from collections.abc import Iterator

import torch

from relaytrain.config.sections import ModelSection
from relaytrain.model.olmo3 import Olmo3

# cuBLAS picks reduction orders per workspace; a fixed workspace makes its matmuls repeatable.
CUBLAS_WORKSPACE = ":4096:8"
# glibc's mallopt parameters and the values `retain_freed_memory` sets: every block up to
# glibc's largest mmap threshold on 64-bit hosts (32 MiB) from the heap, trimmed past 1 GiB free.
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
MMAP_THRESHOLD, TRIM_THRESHOLD = 32 * 2**20, 2**30
GLIBC_DEFAULT_THRESHOLD = 128 * 2**10  # both thresholds' defaults (mallopt(3))
_retained = False  # whether `retain_freed_memory` holds for this process


def pick_device(kind: str) -> torch.device:
    """`train.device`: `cuda` (this process's current GPU), `cpu`, or `auto` (CUDA if any)."""
    if kind == "cuda" or (kind == "auto" and torch.cuda.is_available()):
        return torch.device("cuda", torch.cuda.current_device() if torch.cuda.is_available()
                            else 0)
    return torch.device("cpu")


def compiles(setting: str, device: torch.device) -> bool:
    """Whether blocks are compiled: `auto` compiles on CUDA (fused norms, RoPE and SwiGLU
    elementwise work; compiled FlexAttention) and not on the CPU, where compiling costs every
    worker process seconds at start and the fused CPU kernels (`model.kernels`) do most of
    what it would."""
    return setting == "blocks" or (setting == "auto" and device.type == "cuda")


def prepare_model(model: Olmo3, section: ModelSection, device: torch.device) -> Olmo3:
    """`model` on `device`, configured and (per `section.compile`) with compiled blocks."""
    model = model.to(device)
    model.configure(section.attention, section.checkpointing, section.matmul, section.kernels)
    if compiles(section.compile, device):
        model.compile_blocks()
    return model


def set_determinism(device: torch.device, exact: bool) -> None:
    """On CUDA, `exact` turns on `torch.use_deterministic_algorithms` (ops with only a
    non-deterministic kernel then raise instead of silently varying), a fixed cuBLAS workspace
    and, where this torch has it, Inductor's deterministic mode (no on-device autotuning, whose
    timing-dependent picks could change reduction orders between processes). `fast` turns them
    off. The CPU kernels used here are deterministic already, so the CPU is left alone."""
    if device.type != "cuda":
        return
    if exact:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
    torch.use_deterministic_algorithms(exact)
    import torch._inductor.config as inductor_config

    if hasattr(inductor_config, "deterministic"):  # not in every torch >= 2.8
        inductor_config.deterministic = exact


def retain_freed_memory() -> bool:
    """Keep freed host memory in the process instead of handing it back to the OS (glibc).

    torch's CPU tensors come straight from malloc (there is no caching allocator on the CPU),
    and glibc returns the top of its heap to the OS once more than its trim threshold is free
    and maps blocks above a moving threshold afresh. A training step frees and re-allocates
    the same buffers every step, so each step page-faulted them in again, a sizeable share of
    a `small` step's time (docs/MEASURED.md; `bench train-throughput` reports faulted/step).
    With fixed thresholds the process keeps its steady-state peak, which it reaches every
    step anyway. Process-wide; a no-op returning False where the C library is not glibc.
    """
    global _retained
    _retained = _set_thresholds(MMAP_THRESHOLD, TRIM_THRESHOLD)
    return _retained


@contextlib.contextmanager
def freed_memory_retained() -> Iterator[None]:
    """Work timed as a worker runs it (`retain_freed_memory`), in a process that may not: one
    that did not retain freed memory before gets glibc's default thresholds (128 KiB) back
    after, and what the work left free handed back to the OS."""
    global _retained
    before = _retained
    retain_freed_memory()
    try:
        yield
    finally:
        if not before and _retained:
            _retained = not _set_thresholds(GLIBC_DEFAULT_THRESHOLD, GLIBC_DEFAULT_THRESHOLD)
            ctypes.CDLL(None).malloc_trim(0)


def _set_thresholds(mmap_threshold: int, trim_threshold: int) -> bool:
    """glibc's mmap and trim thresholds set (fixed); False where the C library is not glibc."""
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # noqa: B018 (glibc only: musl and macOS lack it)
    except (OSError, AttributeError):
        return False
    return bool(libc.mallopt(M_MMAP_THRESHOLD, mmap_threshold)
                and libc.mallopt(M_TRIM_THRESHOLD, trim_threshold))
