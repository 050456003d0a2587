"""Run metrics: the JSONL log, the progress bar, MFU's peak, loss-spike and memorisation alarms."""

from __future__ import annotations

import functools
import json
import math
import time
from collections import deque
from typing import Any, TextIO

import torch

from relaytrain.model.matmul import mm_t, onednn_available

# Dense bf16 peak of known accelerators (FLOP/s), by a substring of the device name.
GPU_PEAKS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10G": 125e12}


class MetricsLog:
    """Appends one JSON object per line to RUN_DIR/metrics.jsonl, flushed every record so a
    killed run loses at most the line being written (readers skip a truncated last line)."""

    def __init__(self, path: str):
        self.path = path
        self._f: TextIO = open(path, "a", encoding="utf-8")  # noqa: SIM115 (closed in close())

    def write(self, kind: str, **fields: Any) -> dict[str, Any]:
        record = {"kind": kind, **fields, "wall": time.time()}
        self._f.write(json.dumps(record, allow_nan=True) + "\n")
        self._f.flush()
        return record

    def close(self) -> None:
        self._f.close()


class TensorBoard:
    """Optional mirror of step and eval scalars (needs the `tensorboard` package)."""

    def __init__(self, log_dir: str):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir)

    def write(self, record: dict[str, Any]) -> None:
        step = record.get("step", 0)
        for key, value in record.items():
            if key in ("kind", "step", "wall"):
                continue
            values = value if isinstance(value, dict) else {"": value}  # e.g. eval's sets
            for sub, v in values.items():
                if isinstance(v, int | float):
                    name = f"{record['kind']}/{key}" + (f"/{sub}" if sub else "")
                    self.writer.add_scalar(name, v, step)

    def close(self) -> None:
        self.writer.close()


def peak_flops(device: torch.device, threads: int) -> tuple[float, str]:
    """The device's peak FLOP/s for MFU and where the number comes from.

    GPUs: the vendor's dense bf16 figure. CPUs publish no usable figure, so the peak is measured:
    a large fp32 matmul with the worker's thread count through torch's GEMM and through oneDNN
    (`model.matmul`), the better of the two: the best a well-tuned kernel reaches here.
    """
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, value in GPU_PEAKS.items():
            if key in name:
                return value, f"{name} dense bf16 spec"
        return 0.0, f"unknown GPU {name}"
    prev = torch.get_num_threads()
    torch.set_num_threads(threads)
    n = 512
    a, b = torch.randn(n, n), torch.randn(n, n)
    backends = ["aten"] + (["onednn"] if onednn_available() else [])
    rates = {}
    try:
        for backend in backends:
            mm_t(a, b, backend)
            reps, t0 = 0, time.perf_counter()
            while time.perf_counter() - t0 < 0.2:
                mm_t(a, b, backend)
                reps += 1
            rates[backend] = 2 * n**3 * reps / (time.perf_counter() - t0)
    finally:
        torch.set_num_threads(prev)
    best = max(rates, key=rates.__getitem__)
    return rates[best], f"measured fp32 matmul ({best}), {threads} thread(s)"


@functools.cache
def run_peak_flops(device: torch.device, threads: int) -> tuple[float, str]:
    """`peak_flops` as a run's MFU divides by it: measured once per process, device and thread
    count (0.4 s on a CPU), so the runs one process starts (`bench gpu`'s, a test session's)
    share one denominator instead of each timing the GEMMs again."""
    return peak_flops(device, threads)


class SpikeDetector:
    """Flags a loss far above its recent mean (and any non-finite loss)."""

    def __init__(self, factor: float, window: int = 20):
        self.factor = factor
        self.recent: deque[float] = deque(maxlen=window)

    def check(self, loss: float) -> str | None:
        if not math.isfinite(loss):
            return f"loss is {loss}"
        msg = None
        if len(self.recent) >= 5:
            mean = sum(self.recent) / len(self.recent)
            if loss > self.factor * mean:
                msg = f"loss spike: {loss:.4f} is {loss / mean:.1f}x the recent mean {mean:.4f}"
        self.recent.append(loss)
        return msg


class MemorisationAlarm:
    """Fires when held-out loss pulls away from training loss.

    Two signals, either suffices: the gap (held-out minus training) exceeds `gap`, or held-out
    loss rose while training loss fell over `patience` consecutive evaluations. A loader bug that
    repeats data (the MaxText Olmo 3 lesson) shows as exactly this.
    """

    def __init__(self, gap: float, patience: int):
        self.gap = gap
        self.patience = patience
        self.history: list[tuple[float, float]] = []

    def update(self, train_loss: float, heldout_loss: float) -> str | None:
        self.history.append((train_loss, heldout_loss))
        diff = heldout_loss - train_loss
        if diff > self.gap:
            return (f"MEMORISATION ALARM: held-out loss {heldout_loss:.4f} exceeds training "
                    f"loss {train_loss:.4f} by {diff:.4f} nats (> eval.memo_gap={self.gap})")
        k = self.patience
        if len(self.history) > k:
            recent = self.history[-(k + 1):]
            train_falls = all(b[0] < a[0] for a, b in zip(recent, recent[1:], strict=False))
            held_rises = all(b[1] > a[1] for a, b in zip(recent, recent[1:], strict=False))
            if train_falls and held_rises:
                return (f"MEMORISATION ALARM: held-out loss rose while training loss fell over "
                        f"{k} evaluations ({recent[0][1]:.4f} -> {heldout_loss:.4f} held-out)")
        return None


def proc_bytes(path: str, field: str) -> int | None:
    """A kB field of a Linux /proc file (`VmHWM` of /proc/self/status, `MemAvailable` of
    /proc/meminfo) in bytes; None where it cannot be read."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None
