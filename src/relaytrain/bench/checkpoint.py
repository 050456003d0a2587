"""`relaytrain bench checkpoint`: checkpoint save/restore bandwidth against raw I/O of the
same bytes, on the local disk and on object stores at the URLs given (`--url`).

The state has the shapes of a `model.config.PRESETS` entry (fp32 parameters plus Adam's two
moments and step counts; random values, no model is built). On the disk the baseline writes and
reads the same bytes with plain file I/O and fsync, in the same directory and run, so the ratios
show what the checkpoint format, hashing and verification cost on this machine's disk. Pages are
evicted from the cache (posix_fadvise) before every read, so reads hit the disk where the OS
allows it. The raw write is a plain program's: write everything, then fsync (a checkpoint
starts the writeback as it writes, `checkpoint.streaming.EarlyWriteback`, so it can beat it).
Reads compare like with like, one restore for each way a program holds the state it
loads. A restore in place (into tensors the process already holds, as a worker restores its
parameters and optimizer state when a run resumes: `CheckpointStore.read(into=...)`) is set
beside the raw read into one reused buffer (the disk's bandwidth); a restore into new tensors
(as `relaytrain eval` or `convert` load a checkpoint into a fresh process) beside the raw read
of the whole file into new memory, which pays the same page faults. The report says whether
each of save, restore in place and restore into new tensors reaches `TARGET` of its baseline,
and prints the new tensors' ratio to the reused-buffer read too: on a virtual machine that
ratio is mostly the cost of faulting new memory in, which no reader avoids (docs/MEASURED.md:
checkpoint save / restore). On an object store the baseline
puts and gets one object per checkpoint part through the same fsspec client (endpoints and
credentials from the environment, as for training runs), and restores are measured both ways
too; the emulators take 10-30 s to write the state and under 3 s to read it, so each repetition
reads back `REMOTE_READS` times, raw and checkpoint reads taking turns. The benchmark
measures stores it is pointed at and starts none: `scripts/bench_object_storage.py` starts the
test suite's local S3 and GCS servers and runs it against them.

Repetitions alternate baseline and checkpoint (neither inherits the other's wake); figures are
medians. Default: the `small` preset's state (350 MB with a 50k vocabulary), 7 repetitions
(the host's disk and CPU swing from run to run): about 30 s on the disk of a 2-core host;
`--quick`: 1 repetition. Other states are opt-in (`--only small,olmo3-190m`: the 190M-class
state is 2.3 GB, 1-2 minutes per repetition there), as are object stores, 3 repetitions each (on
the local emulators, which run on the same 2 cores, 30-45 s per repetition of `small`).
"""

from __future__ import annotations

import math
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from relaytrain.bench import progress
from relaytrain.checkpoint.keys import model_key, optim_key
from relaytrain.checkpoint.store import CheckpointStore
from relaytrain.checkpoint.writer import snapshot_to_host
from relaytrain.errors import UserError
from relaytrain.model.config import PRESETS, Olmo3Config
from relaytrain.storage import filesystem, redact
from relaytrain.train.metrics import proc_bytes

DEFAULT_TOKENIZER_VOCAB = 50257  # presets that take the vocabulary from the data: GPT-2's size
_CHUNK = 16 << 20


def param_shapes(cfg: Olmo3Config) -> dict[str, tuple[int, ...]]:
    """Global parameter name -> shape (docs/CONTRACTS.md "Global parameter names")."""
    if cfg.vocab_size is None:
        cfg = cfg.with_vocab(DEFAULT_TOKENIZER_VOCAB)
    v, d, h = cfg.vocab_size, cfg.d_model, cfg.mlp_hidden
    q, kv = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    shapes: dict[str, tuple[int, ...]] = {"embed.weight": (v, d)}
    for i in range(cfg.n_layers):
        p = f"layers.{i}."
        shapes.update({
            p + "attn.q_proj.weight": (q, d), p + "attn.k_proj.weight": (kv, d),
            p + "attn.v_proj.weight": (kv, d), p + "attn.o_proj.weight": (d, q),
            p + "attn.q_norm.weight": (q,), p + "attn.k_norm.weight": (kv,),
            p + "attn_norm.weight": (d,),
            p + "mlp.gate_proj.weight": (h, d), p + "mlp.up_proj.weight": (h, d),
            p + "mlp.down_proj.weight": (d, h), p + "mlp_norm.weight": (d,),
        })
    shapes.update({"norm.weight": (d,), "lm_head.weight": (v, d)})
    return shapes


def training_state(cfg: Olmo3Config, seed: int = 0) -> dict[str, dict[str, torch.Tensor]]:
    """{"model": ..., "optim": ...} tensors keyed as a checkpoint stores them (AdamW state)."""
    g = torch.Generator().manual_seed(seed)
    model, optim = {}, {}
    for name, shape in param_shapes(cfg).items():
        model[model_key(name)] = torch.randn(shape, generator=g)
        optim[optim_key(name, "exp_avg")] = torch.randn(shape, generator=g)
        optim[optim_key(name, "exp_avg_sq")] = torch.rand(shape, generator=g)
        optim[optim_key(name, "step")] = torch.tensor(1000.0)
    return {"model": model, "optim": optim}


PRESETS_DEFAULT, REPEATS = ("small",), 7
REMOTE_REPEATS = 3  # an object store's repetition takes 30-45 s on the local emulators
REMOTE_READS = 2  # reads of each kind per object-store repetition (its writes take far longer)
TARGET = 0.8  # the least ratio of each operation to the raw I/O it is set beside


def bench_checkpoint(quick: bool = False, urls: Sequence[str] = (),
                     presets: Sequence[str] | None = None) -> dict[str, Any]:
    """`relaytrain bench checkpoint`: the local disk, then each object store in `urls`, for
    each preset's state (see the module docstring for what is measured and the defaults)."""
    repeats, remote = (1, 1) if quick else (REPEATS, REMOTE_REPEATS)
    presets = tuple(presets or PRESETS_DEFAULT)
    _check_presets(presets)
    progress.start("checkpoint", f"states of {', '.join(presets)} on the local disk, {repeats} "
                   "repetition(s) each" + (f", and on {', '.join(redact(u) for u in urls)}, "
                                           f"{remote} each" if urls else
                                           " (--url URL adds an object store)"))
    return {"bench": "checkpoint", "repeats": repeats, "remote_repeats": remote, "target": TARGET,
            "local": bench_checkpoint_local(presets, repeats),
            "remote": {f"{redact(url)} {name}": bench_checkpoint_remote(url, name, remote)
                       for url in urls for name in presets}}


def bench_checkpoint_local(sizes: Sequence[str] = ("small",), repeats: int = REPEATS,
                           directory: str | None = None) -> dict[str, Any]:
    """Save/restore time and bandwidth per preset, next to the raw disk's, as ratios (medians
    over `repeats`). `directory` is where the files go (default: the system temp dir); it
    should be the disk checkpoints will live on."""
    _check_presets(sizes)
    return {name: _bench_preset(name, repeats, directory) for name in sizes}


def targets(r: dict[str, Any]) -> dict[str, float]:
    """Each checkpoint operation's ratio to the raw I/O it is measured against (a local
    preset's result or an object store's: see the module docstring)."""
    return {"save": r["save_vs_raw"], "restore in place": r["restore_in_place_vs_raw"],
            "restore into new tensors": r["restore_vs_raw_new"]}


def format_report(result: dict[str, Any]) -> str:
    """Two lines per preset on the disk and per object store: the figures, and which reach
    `TARGET` of their raw I/O."""
    remote = (f" ({result['remote_repeats']} on object stores, each reading back "
              f"{REMOTE_READS} times)"
              if result["remote"] and "remote_repeats" in result else "")
    lines = [f"checkpoint save/restore against raw I/O of the same bytes, median of "
             f"{result['repeats']} repetition(s){remote}:"]
    for name, r in result["local"].items():
        lines.append(
            f"{name}: {r['bytes'] / 1e6:.0f} MB state ({r['params'] / 1e6:.1f}M params + Adam) | "
            f"save {r['save_s']:.2f}s {r['save_GBps']:.2f} GB/s = {r['save_vs_raw']:.2f}x raw "
            f"write+fsync {r['raw_write_GBps']:.2f} GB/s | restore in place (a resume) "
            f"{r['restore_in_place_s']:.2f}s {r['restore_in_place_GBps']:.2f} GB/s = "
            f"{r['restore_in_place_vs_raw']:.2f}x raw read {r['raw_read_GBps']:.2f} GB/s | "
            f"restore into new tensors (eval, convert) {r['restore_s']:.2f}s "
            f"{r['restore_GBps']:.2f} GB/s = {r['restore_vs_raw_new']:.2f}x a raw read into new "
            f"memory {r['raw_read_new_GBps']:.2f} GB/s ({r['restore_vs_raw']:.2f}x the raw read "
            f"into a reused buffer) | blocking host snapshot {r['snapshot_s']:.2f}s "
            f"({r['snapshot_first_s']:.2f}s allocating)")
        lines.append(_verdict(r))
    for where, r in result["remote"].items():
        lines.append(
            f"{where}: {r['bytes'] / 1e6:.0f} MB | save {r['save_s']:.2f}s "
            f"{r['save_GBps']:.3f} GB/s = {r['save_vs_raw']:.2f}x raw put "
            f"{r['raw_put_GBps']:.3f} GB/s | restore in place {r['restore_in_place_s']:.2f}s = "
            f"{r['restore_in_place_vs_raw']:.2f}x raw get {r['raw_get_GBps']:.3f} GB/s | "
            f"restore into new tensors {r['restore_s']:.2f}s {r['restore_GBps']:.3f} GB/s = "
            f"{r['restore_vs_raw_new']:.2f}x a raw get into new memory "
            f"{r['raw_get_new_GBps']:.3f} GB/s ({r['restore_vs_raw']:.2f}x the raw get that "
            f"drops its chunks)")
        lines.append(_verdict(r))
    return "\n".join(lines)


def _verdict(r: dict[str, Any]) -> str:
    missed = [k for k, v in targets(r).items() if v < TARGET]
    return (f"  target >= {TARGET:.1f}x of its raw I/O for save, restore in place and restore "
            f"into new tensors: " + (f"NOT met by {', '.join(missed)}" if missed else "met"))


def _check_presets(sizes: Sequence[str]) -> None:
    unknown = [s for s in sizes if s not in PRESETS]
    if unknown:
        raise UserError(f"bench checkpoint: unknown model preset {unknown[0]!r}; expected one "
                        f"of {sorted(PRESETS)}")


def bench_checkpoint_remote(url: str, name: str = "small", repeats: int = REMOTE_REPEATS,
                            ) -> dict[str, Any]:
    """Save/restore of preset `name`'s state under `url` against raw put/get of one object
    per checkpoint part (emulators' cost per object is not linear in its size) through the
    same client; everything written under `url/relaytrain-bench-<preset>` is removed."""
    _check_presets([name])
    state = training_state(PRESETS[name])
    nbytes = sum(t.numel() * t.element_size() for part in state.values() for t in part.values())
    root = f"{url.rstrip('/')}/relaytrain-bench-{name}"
    store = CheckpointStore(f"{root}/checkpoints", keep_last=1)
    fs, raw = filesystem(f"{root}/raw")
    objects = {f"{raw}/{part}.bin": list(tensors.values()) for part, tensors in state.items()}
    live = {k: torch.zeros_like(t) for part in state.values() for k, t in part.items()}
    times: dict[str, list[float]] = {"raw_put": [], "raw_get": [], "raw_get_new": [],
                                     "save": [], "restore": [], "restore_in_place": []}
    try:
        for step in range(1, repeats + 1):
            progress.report(f"{redact(url)} {name}", step, repeats)
            for key, seconds in _remote_round(fs, objects, store, step, state, live):
                times[key].append(seconds)
    finally:
        fs.rm(filesystem(root)[1], recursive=True)
    s = {k: statistics.median(v) for k, v in times.items()}
    gbps = {k: nbytes / v / 1e9 for k, v in s.items()}
    return {"preset": name, "bytes": nbytes, "repeats": repeats,
            "save_s": s["save"], "restore_s": s["restore"],
            "save_GBps": gbps["save"], "restore_GBps": gbps["restore"],
            "raw_put_GBps": gbps["raw_put"], "raw_get_GBps": gbps["raw_get"],
            "save_vs_raw": gbps["save"] / gbps["raw_put"],
            "restore_vs_raw": gbps["restore"] / gbps["raw_get"],
            "raw_get_new_GBps": gbps["raw_get_new"],
            "restore_vs_raw_new": gbps["restore"] / gbps["raw_get_new"],
            "restore_in_place_s": s["restore_in_place"],
            "restore_in_place_GBps": gbps["restore_in_place"],
            "restore_in_place_vs_raw": gbps["restore_in_place"] / gbps["raw_get"]}


def _remote_round(fs: Any, objects: dict[str, list[torch.Tensor]], store: CheckpointStore,
                  step: int, state: dict[str, dict[str, torch.Tensor]],
                  live: dict[str, torch.Tensor]) -> list[tuple[str, float]]:
    """One repetition on an object store: the raw objects and checkpoint `step` written (which
    first alternates between repetitions), then each read back `REMOTE_READS` times, raw and
    checkpoint reads taking turns, so that reads are compared across seconds, not across the
    emulators' long writes; the raw objects are removed after (the checkpoints by the store's
    retention)."""
    writes = [lambda: [("raw_put", _timed(_raw_put, fs, objects))],
              lambda: [("save", _timed(_save, store, step, state))]]
    reads = [lambda: [("raw_get", _timed(_raw_get, fs, objects)),
                      ("raw_get_new", _timed(_raw_get, fs, objects, True))],
             lambda: list(_restores(store, step, state, live, lambda: None).items())]
    out = []
    for turn, runs in enumerate([writes] + [reads] * REMOTE_READS):
        for run in runs[::-1] if (step + turn) % 2 else runs:
            out += run()
    fs.rm(list(objects))
    return out


def _raw_put(fs: Any, objects: dict[str, list[torch.Tensor]]) -> None:
    for path, tensors in objects.items():
        with fs.open(path, "wb") as f:
            for t in tensors:
                data = memoryview(t.reshape(-1).view(torch.uint8).numpy())
                for i in range(0, len(data), _CHUNK):
                    f.write(data[i:i + _CHUNK])


def _raw_get(fs: Any, objects: dict[str, list[torch.Tensor]], new_memory: bool = False) -> None:
    """GET bandwidth through the client: chunk by chunk, each dropped once read; or
    (`new_memory`) each object into a buffer of its own, as a plain load of the bytes pays the
    new pages' faults (as a restore into new tensors does)."""
    for path, tensors in objects.items():
        expected = sum(t.numel() * t.element_size() for t in tensors)
        got = 0
        with fs.open(path, "rb") as f:
            if new_memory:
                whole = memoryview(torch.empty(expected, dtype=torch.uint8).numpy())
                while got < expected and (n := f.readinto(whole[got:got + _CHUNK])):
                    got += n
                got += len(f.read(1))  # nothing more: a longer object reads as too long
            else:
                while chunk := f.read(_CHUNK):
                    got += len(chunk)
        if got != expected:
            raise RuntimeError(f"bench checkpoint: read {got} bytes back from {path}, wrote "
                               f"{expected}")


def _bench_preset(name: str, repeats: int, directory: str | None) -> dict[str, Any]:
    cfg = PRESETS[name]
    shapes = param_shapes(cfg)
    params = sum(math.prod(s) for s in shapes.values())
    nbytes = params * 4 * 3 + len(shapes) * 4
    _check_resources(name, nbytes, directory or tempfile.gettempdir())
    progress.report(f"local disk {name}: generating the state, timing the host snapshot")
    state = training_state(cfg)
    tensors = [t for part in state.values() for t in part.values()]
    flat = state["model"] | state["optim"]
    snapshot_first_s = _timed(snapshot_to_host, flat)
    snap = snapshot_to_host(flat)
    snapshot_s = _timed(snapshot_to_host, flat, snap)  # steady state: buffers reused
    del snap
    live = {k: torch.zeros_like(t) for k, t in flat.items()}  # a worker's state, faulted in
    times: dict[str, list[float]] = {"raw_write": [], "raw_read": [], "raw_read_new": [],
                                     "save": [], "restore": [], "restore_in_place": []}
    with tempfile.TemporaryDirectory(prefix="relaytrain-bench-", dir=directory) as tmp:
        raw = os.path.join(tmp, "raw.bin")
        store = CheckpointStore(os.path.join(tmp, "ckpt"))
        for step in range(1, repeats + 1):
            progress.report(f"local disk {name}", step, repeats)
            rounds = [lambda: _raw_round(raw, tensors, nbytes),
                      lambda step=step: _checkpoint_round(store, step, state, live)]
            if step % 2 == 0:  # alternate the order so neither side inherits the other's wake
                rounds.reverse()
            for run in rounds:
                for key, seconds in run().items():
                    times[key].append(seconds)
    s = {k: statistics.median(v) for k, v in times.items()}
    gbps = {k: nbytes / v / 1e9 for k, v in s.items()}
    return {"preset": name, "params": params, "bytes": nbytes, "tensors": len(tensors),
            "save_s": s["save"], "restore_s": s["restore"], "snapshot_s": snapshot_s,
            "snapshot_first_s": snapshot_first_s,
            "save_GBps": gbps["save"], "restore_GBps": gbps["restore"],
            "raw_write_GBps": gbps["raw_write"], "raw_read_GBps": gbps["raw_read"],
            "save_vs_raw": gbps["save"] / gbps["raw_write"],
            "restore_vs_raw": gbps["restore"] / gbps["raw_read"],
            "raw_read_new_GBps": gbps["raw_read_new"],
            "restore_vs_raw_new": gbps["restore"] / gbps["raw_read_new"],
            "restore_in_place_s": s["restore_in_place"],
            "restore_in_place_GBps": gbps["restore_in_place"],
            "restore_in_place_vs_raw": gbps["restore_in_place"] / gbps["raw_read"],
            "cache_evicted": hasattr(os, "posix_fadvise")}


def _raw_round(path: str, tensors: list[torch.Tensor], nbytes: int) -> dict[str, float]:
    write_s = _timed(_raw_write, path, tensors)
    _evict(path)
    read_s = _timed(_raw_read, path, nbytes)
    _evict(path)
    read_new_s = _timed(_raw_read, path, nbytes, True)
    os.remove(path)
    return {"raw_write": write_s, "raw_read": read_s, "raw_read_new": read_new_s}


def _checkpoint_round(store: CheckpointStore, step: int,
                      state: dict[str, dict[str, torch.Tensor]],
                      live: dict[str, torch.Tensor]) -> dict[str, float]:
    """Save (parts and commit) and restore (verified) one checkpoint, into new tensors and in
    place into `live`; deleting it is untimed, as for the raw file."""
    t0 = time.perf_counter()
    url = _save(store, step, state)
    save_s = time.perf_counter() - t0
    out = {"save": save_s, **_restores(store, step, state, live, lambda: [
        _evict(os.path.join(url, file)) for file in os.listdir(url)])}
    shutil.rmtree(url)
    return out


def _save(store: CheckpointStore, step: int, state: dict[str, dict[str, torch.Tensor]]
          ) -> str:
    """Checkpoint `step` of `state` written and committed, as a run saves; its URL."""
    return store.commit(step, {p: store.write_part(step, p, t) for p, t in state.items()},
                        {"bench": True})


def _restores(store: CheckpointStore, step: int, state: dict[str, dict[str, torch.Tensor]],
              live: dict[str, torch.Tensor], before: Callable[[], object]) -> dict[str, float]:
    """Seconds to restore `step` (verified) into new tensors and in place into `live`, each
    after `before()` (dropping the files' cached pages)."""
    out = {}
    for key, into in (("restore", None), ("restore_in_place", live)):
        before()
        t0 = time.perf_counter()
        _, restored = store.read(step, into=into)
        out[key] = time.perf_counter() - t0
        _check_equal(restored, state)
        if into is not None and any(restored[k] is not t for k, t in into.items()):
            raise RuntimeError("bench checkpoint: a restore in place allocated new tensors")
        del restored
    return out


def _raw_write(path: str, tensors: list[torch.Tensor]) -> None:
    with open(path, "wb") as f:
        for t in tensors:
            data = memoryview(t.reshape(-1).view(torch.uint8).numpy())
            for i in range(0, len(data), _CHUNK):
                f.write(data[i:i + _CHUNK])
        f.flush()
        os.fsync(f.fileno())


def _raw_read(path: str, nbytes: int, new_memory: bool = False) -> None:
    """Disk read bandwidth: into one reused buffer, so page faults on fresh memory (which a
    restore does pay, for its tensors) are not counted against the disk; or (`new_memory`) the
    whole file into a buffer of its own, as a plain load of the bytes pays them."""
    whole = torch.empty(nbytes, dtype=torch.uint8) if new_memory else None
    buf = memoryview(bytearray(_CHUNK)) if whole is None else memoryview(whole.numpy())
    total = 0
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf[total:total + _CHUNK] if whole is not None else buf):
            total += n
    if total != nbytes:
        raise RuntimeError(f"bench checkpoint: {path} holds {total} bytes, wrote {nbytes}")


def _evict(path: str) -> None:
    """Drop a file's (clean, fsynced) pages from the page cache so the next read hits disk."""
    if hasattr(os, "posix_fadvise"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _timed(fn: Callable[..., object], *args: Any) -> float:
    t0 = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t0


def _check_equal(restored: dict[str, torch.Tensor],
                 state: dict[str, dict[str, torch.Tensor]]) -> None:
    expected = state["model"] | state["optim"]
    if restored.keys() != expected.keys() or not all(
            torch.equal(restored[k], t) for k, t in expected.items()):
        raise RuntimeError("bench checkpoint: the restored state differs from the saved one")


def _check_resources(name: str, nbytes: int, directory: str) -> None:
    """Fail early, in one line, when the state cannot fit: RAM holds it five times (state,
    two snapshots, restored copy, the state restored in place) and the disk once plus the
    baseline file."""
    free_disk = shutil.disk_usage(directory).free
    if free_disk < 2.2 * nbytes:
        raise UserError(f"bench checkpoint: preset {name!r} needs {2.2 * nbytes / 1e9:.1f} GB "
                        f"free in {directory}, found {free_disk / 1e9:.1f} GB")
    free_ram = _available_ram()
    if free_ram is not None and free_ram < 5.2 * nbytes:
        raise UserError(f"bench checkpoint: preset {name!r} needs {5.2 * nbytes / 1e9:.1f} GB "
                        f"of available memory, found {free_ram / 1e9:.1f} GB")


def _available_ram() -> int | None:
    return proc_bytes("/proc/meminfo", "MemAvailable")
