"""How `auto` is decided for the settings chosen for speed (`model.matmul`, `model.kernels`,
`model.attention`) on this host: measured, not guessed. The machinery below the choice's entry
point (`train.auto_backends.choose_backends`): the contest's alternating timed rounds, the
per-host cache, keep-on-resume; and the GEMMs' contest, here because the model resolves
`matmul: auto` itself when used outside a run (`Olmo3.configure`).

Why: which of two backends is faster depends on the processor, not on its architecture: on an
AMD EPYC with AVX-512, MKL runs AVX2 kernels and oneDNN's GEMMs were 2x faster; on an Intel
Xeon with AVX-512, MKL runs AVX-512 itself and oneDNN was the slower one. So `auto` times each
setting's two candidates on the model's own work at the worker's thread count and keeps the
faster: the GEMMs on the model's products (every distinct linear layer and the LM head, each
as the three products a training step forms: forward, input and weight gradients; here), the
elementwise kernels and the sliding attention on the model's blocks at the run's micro-batch
(`train.auto_backends`).

Each measurement is short (0.1-0.3 s for the GEMMs, 1-6 s for the blocks of the `small`
preset on a quiet 2-core host) and robust against a shared
machine: the two candidates alternate within each round (a load change hits both alike), the
decision is the median of the per-round ratios, and the challenger must win by `MARGIN`,
since the reference (`aten`, `torch`, `sdpa`) is the path bit-identical with HF. The result is
cached per host key (CPU name, family, model and stepping, thread count, torch version) and
what was timed (model dimensions, shapes) in `$XDG_CACHE_HOME/relaytrain/backends.json`
(`~/.cache/relaytrain` without XDG_CACHE_HOME), so it is measured once per host; a changed key
measures again. A measurement taken while other work loads the cores is cached for
`PROVISIONAL_S` only, then measured again (one taken at load 15-24 had frozen oneDNN in the
cache of a host where aten's products are 1.2x faster when it is quiet); until then every run
on the host reads it, since two runs of one config on one host must not differ in their bits
because the load differed when each started (on an AMD EPYC whose oneDNN products are twice
as fast when it is quiet, a loaded measurement chose aten, and a run resumed under another
measurement left the uninterrupted run's bits). A resumed run keeps what its checkpoint
records for a host of the same key (`keep_on_resume`).
"""

from __future__ import annotations

import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from relaytrain.model.config import Olmo3Config
from relaytrain.model.matmul import MATMUL_BACKENDS, mm_t, onednn_available, weight_grad

CACHE_FILE = "backends.json"
ROUNDS = 4  # timed rounds, each both candidates in alternating order, after one untimed
FLOPS_PER_ROUND = 1e9  # per backend: ~7 ms at 150 GFLOP/s (the small preset gets 2 GFLOP)
MAX_ROWS, MIN_ROWS = 1024, 128  # tokens per product: scaled down to the budget, not below
MARGIN = 0.97  # the challenger is chosen when its median time is below this fraction
PROVISIONAL_S = 3600  # how long a measurement taken on a loaded host is kept

# setting -> (reference: HF's exact path, kept unless beaten by MARGIN; challenger)
CANDIDATES: dict[str, tuple[str, str]] = {
    "matmul": ("aten", "onednn"), "kernels": ("torch", "fused"), "attention": ("sdpa", "chunks")}


@dataclass(frozen=True)
class Choice:
    """The backend a run uses for `setting` and why: `source` is `setting` (given by the
    config), a reason `auto` measured nothing (`device`, ...), `measured`, `cached`, either of
    them "on a loaded host" (kept for `PROVISIONAL_S`), or `resumed`; `times` the median
    seconds of one round per candidate, when measured."""

    setting: str
    backend: str
    source: str
    times: dict[str, float] | None = None
    key: str | None = None

    def describe(self) -> str:
        timed = "" if not self.times else ": " + ", ".join(
            f"{name} {1e3 * s:.1f} ms" for name, s in self.times.items())
        return f"model.{self.setting}={self.backend} ({self.source}{timed})"


def cpu_model() -> str:
    """The processor (Linux's /proc/cpuinfo: its name, family, model and stepping; virtual
    machines often show a generic name such as "Intel(R) Xeon(R) Processor" for different
    processors), else what Python reports."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                name, _, value = line.partition(":")
                name = name.strip()
                if name in ("model name", "cpu family", "model", "stepping"):
                    fields.setdefault(name, value.strip())
                if not line.strip() and fields:  # the first processor's block is enough
                    break
    except OSError:
        pass
    if "model name" not in fields:
        return platform.processor() or platform.machine()
    return (f"{fields['model name']} (family {fields.get('cpu family', '?')}, model "
            f"{fields.get('model', '?')}, stepping {fields.get('stepping', '?')})")


def loaded() -> bool:
    """Whether other work competes for the cores now (one-minute load above the core count):
    a measurement then says more about the load than about the backends, so it is cached for
    `PROVISIONAL_S` only."""
    try:
        return os.getloadavg()[0] > (os.cpu_count() or 1)
    except OSError:
        return False


def host_key(threads: int) -> str:
    """What a measured choice depends on besides the model: processor, threads, torch."""
    return f"{cpu_model()} | {threads} threads | torch {torch.__version__}"


def cache_path() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "relaytrain" / CACHE_FILE


def alternate(rounds: dict[str, Callable[[], float]], n: int = ROUNDS, threads: int | None = None
              ) -> tuple[dict[str, float], float]:
    """Each of two candidates' round (`rounds`, reference first; each returns its seconds) run
    `n` times after one untimed round, their order alternating, at `threads` torch threads:
    the median seconds per candidate and the median per-round ratio challenger / reference."""
    (ref, ref_round), (new, new_round) = rounds.items()
    prev = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        times: dict[str, list[float]] = {ref: [], new: []}
        for r in range(n + 1):
            order = ((ref, ref_round), (new, new_round))
            for name, one in order if r % 2 == 0 else order[::-1]:
                t = one()
                if r:  # the first round warms both up
                    times[name].append(t)
    finally:
        torch.set_num_threads(prev)
    ratio = statistics.median(b / a for a, b in zip(times[ref], times[new], strict=True))
    return {k: statistics.median(v) for k, v in times.items()}, ratio


def decide(setting: str, key: str, measure: Callable[[], tuple[dict[str, float], float]],
           cache: Path | None = None) -> Choice:
    """`auto` for `setting`: the cache's entry for `key` if valid, else `measure()` (the
    candidates' times and the challenger / reference ratio), cached (see the module
    docstring)."""
    reference, challenger = CANDIDATES[setting]
    key = f"{setting} | {key}"
    path = cache or cache_path()
    entries = _read_cache(path)
    entry = entries.get(key)
    now = time.time()
    if _valid(entry, setting, now):
        return Choice(setting, entry["backend"], entry["source"], entry.get("times"), key)
    print(f"relaytrain: model.{setting}=auto: timing {reference} against {challenger} on "
          f"this host (once; cached in {path})", file=sys.stderr, flush=True)
    times, ratio = measure()
    where = " on a loaded host" if loaded() else ""
    choice = Choice(setting, challenger if ratio < MARGIN else reference, "measured" + where,
                    times, key)
    entries[key] = {**asdict(choice), "ratio": ratio, "source": "cached" + where,
                    "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(now)),
                    **({"expires": now + PROVISIONAL_S} if where else {})}
    _write_cache(path, entries)
    return choice


def _read_cache(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _write_cache(path: Path, entries: dict[str, Any]) -> None:
    """Atomically (another process may read or write it at the same time); a cache that
    cannot be written only costs a measurement next time."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".backends-")
        with os.fdopen(fd, "w") as f:
            json.dump(entries, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except OSError:
        pass


def _valid(entry: Any, setting: str, now: float) -> bool:
    """Whether a cache entry is one this module wrote for `setting` and has not expired
    (anything else, a hand-edited or truncated entry included, is measured over)."""
    if not isinstance(entry, dict) or entry.get("backend") not in CANDIDATES[setting]:
        return False
    expires = entry.get("expires", math.inf)
    times = entry.get("times")
    return (isinstance(entry.get("source"), str) and isinstance(expires, (int, float))
            and now < expires and (times is None or isinstance(times, dict) and all(
                isinstance(v, (int, float)) for v in times.values())))


def keep_on_resume(choice: Choice, recorded: Any) -> Choice:
    """The backend a resumed run continues with: the one its checkpoint records (`recorded`,
    `{"backend", "key"}`) when `auto` chose it on a host of the same key, whatever `choice`
    (measured or cached now) says, since a run's bits must not depend on a later measurement;
    `choice` on another host or for a backend given by the config."""
    if (choice.key is not None and isinstance(recorded, dict)
            and recorded.get("key") == choice.key
            and recorded.get("backend") in CANDIDATES[choice.setting]
            and recorded["backend"] != choice.backend):
        return Choice(choice.setting, recorded["backend"], "resumed", key=choice.key)
    return choice


# ---- model.matmul: the GEMMs ---------------------------------------------------------------
def products(cfg: Olmo3Config) -> list[tuple[int, int]]:
    """(in, out) features of every distinct dense product of the model: the linear layers of
    a block and the LM head."""
    q, kv, d = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim, cfg.d_model
    shapes = [(d, q), (d, kv), (q, d), (d, cfg.mlp_hidden), (cfg.mlp_hidden, d),
              (d, cfg.vocab_size)]
    return sorted(set(shapes))


def measure(shapes: list[tuple[int, int]], threads: int, rounds: int = ROUNDS,
            ) -> tuple[dict[str, float], float]:
    """Median seconds of one round of `shapes`' training products through aten and through
    oneDNN, and the median of the per-round ratios oneDNN / aten."""
    rows = MAX_ROWS
    flops = sum(6 * rows * k * n for k, n in shapes)
    rows = max(MIN_ROWS, int(rows * min(1.0, FLOPS_PER_ROUND / flops)))
    gen = torch.Generator().manual_seed(0)
    operands = [(torch.randn(rows, k, generator=gen), torch.randn(n, k, generator=gen),
                 torch.randn(rows, n, generator=gen)) for k, n in shapes]

    def one_round(backend: str) -> Callable[[], float]:
        def run() -> float:
            t0 = time.perf_counter()
            for x, w, g in operands:
                mm_t(x, w, backend)  # forward
                mm_t(g, w.t(), backend)  # input gradient
                weight_grad(g, x, backend)
            return time.perf_counter() - t0
        return run

    return alternate({b: one_round(b) for b in CANDIDATES["matmul"]}, rounds, threads)


def choose_matmul(setting: str, cfg: Olmo3Config, device: torch.device, threads: int, *,
                  key: str | None = None, cache: Path | None = None) -> Choice:
    """The backend for `setting` (`model.matmul`) running `cfg` on `device` with `threads`
    torch threads; `auto` on a CPU is measured or read from the cache (see the module
    docstring). `key` replaces `host_key(threads)`, `cache` the cache file (tests)."""
    if setting not in MATMUL_BACKENDS:
        raise ValueError(f"matmul={setting!r}: expected one of {MATMUL_BACKENDS}")
    if setting == "onednn" and not onednn_available():
        raise ValueError("matmul='onednn', but this torch build has no oneDNN (mkldnn) "
                         "kernels; use 'aten' or 'auto'")
    if setting != "auto":
        return Choice("matmul", setting, "setting")
    if device.type != "cpu" or not onednn_available():
        return Choice("matmul", "aten", "device")
    shapes = products(cfg)
    return decide("matmul", f"{key or host_key(threads)} | products {shapes}",
                  lambda: measure(shapes, threads), cache)
