"""`init.from`: a new run's state at step 0 read from another run's checkpoint, not the seed.

A source is one of SOURCES, told apart by what its directory holds (the first that claims it):
an OLMo-core checkpoint (torch distributed checkpoint: a `.metadata` file), an HF Olmo 3
directory (`config.json` and `*.safetensors`), or a relaytrain checkpoint (a step directory, a
checkpoints root or a run directory: its newest step that verifies). The controller resolves the
source once, before it writes anything (`resolve`: found, verified, a model of the run's
dimensions), and records the result, the *origin*, in the settled config (`init.origin`): the
exact directory read, its step, a digest of its manifest or metadata and what was taken. Every
worker reads its share of the state from that directory (`read_origin`: its stage's tensors
and, sharded, only its rows), at the run's start and again at a recovery before the run's first
checkpoint, so a run is reproducible given the origin's digest (docs/DETERMINISM.md).
"""

from __future__ import annotations

import json
import posixpath
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import fsspec
import torch
from fsspec.implementations.local import LocalFileSystem

from relaytrain import storage
from relaytrain.checkpoint.keys import (
    MODEL_PREFIX,
    OPTIM_PREFIX,
    model_key,
    model_tensors,
    tensor_param,
)
from relaytrain.checkpoint.olmo_core import (
    read_olmo_core,
    read_olmo_core_metadata,
    read_olmo_core_trainer_state,
)
from relaytrain.checkpoint.pieces import Rows
from relaytrain.checkpoint.reading import Into, KeyFilter, load_dir, stored_keys
from relaytrain.checkpoint.store import locate_checkpoint
from relaytrain.checkpoint.streaming import DIGEST, digest_hex, hash_stream
from relaytrain.config.sections import InitSection
from relaytrain.data.position import Stream, batch_at, position_of
from relaytrain.errors import CheckpointError, ConfigError, UserError, warn
from relaytrain.model.config import Olmo3Config
from relaytrain.model.olmo3 import Olmo3

# The dimensions that fix the weights' shapes: a source must have the run's. Others (RoPE,
# sliding window, sequence length) may change between stages, as Olmo 3's long-context one does.
SHAPE_FIELDS = ("d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "mlp_hidden",
                "vocab_size")
WEIGHTS, MOMENTS, TRAINER = "weights", "moments", "trainer_state"


@dataclass(frozen=True)
class Found:
    """What resolving a source found: the origin's fields, and the model dimensions it holds."""

    location: str  # the exact directory workers read
    step: int | None
    digest: str
    moments: bool  # the source holds AdamW's moments and step counts
    dims: dict[str, Any]  # of SHAPE_FIELDS, those it says (the others are not compared)
    params: set[str]  # the parameters it holds weights of
    softmax_rows: str  # the rows the source's loss normalised over (Olmo3Config.softmax_rows)
    shapes: dict[str, tuple[int, ...]] | None = None  # their shapes, where `dims` says not all
    # its trainer state, where it has one: {"step", "epoch" (0-based), "tokens" (consumed of
    # that epoch), "data_seed", "digest" (of the file holding it, where not the manifest)}
    trainer: dict[str, Any] | None = None


@dataclass(frozen=True)
class SourceKind:
    name: str
    holds: Callable[[fsspec.AbstractFileSystem, str], bool]  # does this directory hold one?
    # found and verified (`init` says whether its moments and trainer state are wanted), else
    # an error
    resolve: Callable[[str, InitSection], Found]
    # this worker's tensors (`model.*`, `optim.*`) of the origin: those `keys` selects, of the
    # sharded ones the `rows` asked; read `into` the live tensors where they fit
    read: Callable[[dict[str, Any], KeyFilter, Rows, Into | None], dict[str, torch.Tensor]]


def _location(fs: fsspec.AbstractFileSystem, path: str) -> str:
    return path if isinstance(fs, LocalFileSystem) else fs.unstrip_protocol(path)


def _manifest_digest(manifest: dict) -> str:
    """A relaytrain checkpoint's digest: its manifest's, which names every file's digest."""
    return f"{DIGEST}:{digest_hex(DIGEST, json.dumps(manifest, sort_keys=True).encode())}"


# ---- relaytrain checkpoints ------------------------------------------------------------------
def _relay_holds(fs: fsspec.AbstractFileSystem, path: str) -> bool:
    return True  # the last kind: whatever it is not, `locate_checkpoint` says


def _relay_resolve(url: str, init: InitSection) -> Found:
    fs, d, manifest = locate_checkpoint(url)
    if not isinstance(manifest.get("model"), dict):
        raise CheckpointError(f"{url}: its manifest records no model config")
    keys = stored_keys(fs, d, manifest)
    return Found(_location(fs, d), int(manifest["step"]), _manifest_digest(manifest),
                 any(k.startswith(OPTIM_PREFIX) for k in keys), manifest["model"],
                 set(model_tensors(dict.fromkeys(keys))),
                 manifest["model"].get("softmax_rows", "tokenizer"),
                 trainer=_relay_trainer(manifest))


def _relay_trainer(manifest: dict[str, Any]) -> dict[str, Any] | None:
    """A relaytrain checkpoint's trainer state: its step, and its data position (the global
    batch its next step would train on) as an epoch and the tokens consumed of it."""
    data, cfg = manifest.get("data") or {}, manifest.get("config") or {}
    train = cfg.get("train") or {}
    if not {"batch_index", "n_instances", "seq_len"} <= set(data) or "global_batch" not in train:
        return None  # a manifest from before the data position was recorded
    stream = Stream((cfg.get("data") or {}).get("order", "relay"), data["n_instances"],
                    train["global_batch"], data["seq_len"])
    epoch, tokens = position_of(stream, int(data["batch_index"]))
    return {"step": int(manifest["step"]), "epoch": epoch, "tokens": tokens,
            "data_seed": (manifest.get("rng") or {}).get("data_seed")}


def _relay_read(origin: dict[str, Any], keys: KeyFilter, rows: Rows, into: Into | None
                ) -> dict[str, torch.Tensor]:
    fs, d = storage.filesystem(origin["location"])
    manifest, tensors = load_dir(fs, d, keys, origin["step"], rows, into)
    if _manifest_digest(manifest) != origin["digest"]:
        raise CheckpointError(f"init.from {origin['location']} changed since the run started "
                              f"from it (digest {origin['digest']}); restore that checkpoint")
    return tensors


# ---- Hugging Face Olmo 3 ---------------------------------------------------------------------
def _hf_holds(fs: fsspec.AbstractFileSystem, path: str) -> bool:
    return fs.exists(f"{path}/config.json") and bool(fs.glob(f"{path}/*.safetensors"))


def _hf_resolve(url: str, init: InitSection) -> Found:
    from relaytrain.model.hf import read_hf

    fs, path = storage.filesystem(url)
    path = path.rstrip("/")
    if storage.scheme(url) != "file":
        raise CheckpointError("an HF directory is read from a local path; download it first")
    cfg, shapes = read_hf(Path(path), meta=True)  # config, every tensor's name and shape
    # config.json and every weights file, hashed in name order (read once, never kept)
    parts = [b"config.json:" + fs.cat_file(f"{path}/config.json")]
    for f in sorted(fs.glob(f"{path}/*.safetensors")):
        with fs.open(f, "rb") as src:
            size, digest = hash_stream(src)
        parts.append(f"{posixpath.basename(f)}:{size}:{digest}".encode())
    return Found(path, None, f"{DIGEST}:{digest_hex(DIGEST, *parts)}", False, cfg.to_dict(),
                 set(shapes), "tokenizer")  # HF's logits: its config's (unpadded) vocabulary


def _hf_read(origin: dict[str, Any], keys: KeyFilter, rows: Rows, into: Into | None
             ) -> dict[str, torch.Tensor]:
    from relaytrain.model.hf import read_hf

    weights = read_hf(Path(origin["location"]))[1]
    return _share({model_key(n): t for n, t in weights.items()}, keys, rows)


def _share(tensors: dict[str, torch.Tensor], keys: KeyFilter, rows: Rows
           ) -> dict[str, torch.Tensor]:
    """A worker's share of whole tensors a source gave (by our keys): those `keys` selects,
    of each the `rows` asked."""
    out = {}
    for key, t in tensors.items():
        if keys(key):  # (a scalar, AdamW's step count, is never asked rows)
            out[key] = t[slice(*rows[key])] if key in rows else t
    return out


# ---- OLMo-core (torch distributed checkpoints) -----------------------------------------------
def _olmo_core_holds(fs: fsspec.AbstractFileSystem, path: str) -> bool:
    return fs.exists(f"{path}/.metadata") or fs.exists(f"{path}/model_and_optim/.metadata")


def _olmo_core_resolve(url: str, init: InitSection) -> Found:
    fs, path = storage.filesystem(url)
    meta = read_olmo_core_metadata(url, init.optimizer)  # .metadata (and one step count) only
    weights = {tensor_param(k): s for k, s in meta.shapes.items() if k.startswith(MODEL_PREFIX)}
    state = read_olmo_core_trainer_state(url) if init.trainer_state else None
    trainer = None if state is None else {
        "step": state.global_step, "epoch": state.epoch - 1, "tokens": state.tokens,
        "data_seed": state.seed, "digest": state.digest}
    # OLMo-core's logits span every embedding row (its `lm_head.w_out`), the padded ones too
    return Found(_location(fs, path.rstrip("/")), meta.step, meta.digest, meta.moments,
                 meta.model, set(weights), "padded", weights, trainer)


def _olmo_core_read(origin: dict[str, Any], keys: KeyFilter, rows: Rows, into: Into | None
                    ) -> dict[str, torch.Tensor]:
    c = read_olmo_core(origin["location"], MOMENTS in origin["took"], keys)  # its chunks only
    if c.digest != origin["digest"]:
        raise CheckpointError(f"init.from {origin['location']} changed since the run started "
                              f"from it (digest {origin['digest']}); restore that checkpoint")
    return _share(c.tensors, keys, rows)


SOURCES = (SourceKind("olmo-core", _olmo_core_holds, _olmo_core_resolve, _olmo_core_read),
           SourceKind("hf", _hf_holds, _hf_resolve, _hf_read),
           SourceKind("relaytrain", _relay_holds, _relay_resolve, _relay_read))
KINDS = {k.name: k for k in SOURCES}


def _kind_of(url: str) -> SourceKind:
    """The kind of source `url` names; ConfigError if there is nothing there."""
    fs, path = storage.filesystem(url)
    path = path.rstrip("/")
    if not fs.exists(path):
        raise ConfigError(f"config key 'init.from': {storage.redact(url)} does not exist; "
                          "expected a relaytrain checkpoint (run, checkpoints or step "
                          "directory), an HF Olmo 3 directory or an OLMo-core checkpoint")
    return next(k for k in SOURCES if k.holds(fs, path))


def resolve(init: InitSection, model_cfg: Olmo3Config) -> dict[str, Any]:
    """The origin of `init.from`: found, verified and of the run's model dimensions, else one
    ConfigError naming the key and what was found."""
    url = init.from_
    assert url is not None
    kind = _kind_of(url)
    try:
        found = kind.resolve(url, init)
    except ConfigError:
        raise
    except Exception as e:  # whatever the source holds instead: one line, naming the key
        what = str(e) if isinstance(e, UserError) else f"{type(e).__name__}: {e}"
        raise ConfigError(f"config key 'init.from': {storage.redact(url)} is not a loadable "
                          f"{kind.name} checkpoint ({' '.join(what.split())})") from None
    _check_model(url, found, model_cfg)
    took = [WEIGHTS]
    if init.trainer_state and (found.trainer is None or not found.moments):
        lacks = "trainer state (step count, data position)" if found.trainer is None else \
            "optimizer state"
        raise ConfigError(f"config key 'init.trainer_state': {storage.redact(url)} "
                          f"({kind.name}) holds no {lacks} to continue; expected a relaytrain "
                          "checkpoint or an OLMo-core step directory with its train/rank0.pt "
                          "and optimizer state, or init.trainer_state: false")
    if init.optimizer and found.moments:
        took.append(MOMENTS)
    elif init.optimizer:
        warn(f"init.optimizer: {storage.redact(url)} ({kind.name}) holds no optimizer state; "
             "taking its weights only")
    origin = {"from": url, "kind": kind.name, "location": found.location, "step": found.step,
              "digest": found.digest, "took": took, "softmax_rows": found.softmax_rows}
    if init.trainer_state:
        took.append(TRAINER)
        origin["trainer"] = found.trainer
    return origin


def continue_at(origin: dict[str, Any], stream: Stream) -> dict[str, Any]:
    """`origin` with the global batch (`trainer.batch`) the run's first step trains on: the
    carried data position in the run's own stream (data/position.py); one ConfigError where it
    is not the start of one of the run's global batches."""
    t = origin["trainer"]
    try:
        batch = batch_at(stream, t["epoch"], t["tokens"])
    except UserError as e:
        raise ConfigError(f"config key 'init.trainer_state': the data position of "
                          f"{storage.redact(origin['from'])} (step {t['step']}) does not "
                          f"continue in the run's data: {e}") from None
    return {**origin, "trainer": {**t, "batch": batch}}


def _check_model(url: str, found: Found, model_cfg: Olmo3Config) -> None:
    """ConfigError unless the source holds every parameter of the run's model, of its shape."""
    want = model_cfg.to_dict()
    differ = [f for f in SHAPE_FIELDS if found.dims.get(f, want[f]) != want[f]]
    if differ:
        got = ", ".join(f"{f}={found.dims[f]}" for f in differ)
        run = ", ".join(f"{f}={want[f]}" for f in differ)
        vocab = "" if "vocab_size" not in differ else (
            "; vocab_size counts embedding rows, the tokenizer's vocabulary padded: the source "
            "was trained with another tokenizer than the run's data" +
            (f" ({model_cfg.tokenizer_vocab} tokens)" if model_cfg.tokenizer_vocab else ""))
        raise ConfigError(f"config key 'init.from': {storage.redact(url)} holds another "
                          f"model ({got}; the run's model has {run}{vocab})")
    with torch.device("meta"):
        shapes = {n: tuple(p.shape) for n, p in Olmo3(model_cfg).named_parameters()}
    missing = sorted(set(shapes) - found.params)
    if missing:
        raise ConfigError(f"config key 'init.from': {storage.redact(url)} lacks the weights "
                          f"of {len(missing)} parameter(s) of the model, e.g. {missing[0]!r}")
    other = sorted(n for n in shapes if found.shapes and found.shapes[n] != shapes[n])
    if other:
        n = other[0]
        raise ConfigError(f"config key 'init.from': {storage.redact(url)} holds another model "
                          f"({n} of shape {list(found.shapes[n])}; the run's model has "
                          f"{list(shapes[n])}, of {len(other)} parameter(s) that differ)")


def read_origin(origin: dict[str, Any], params: set[str], rows: Rows,
                into: Into | None = None) -> dict[str, torch.Tensor]:
    """A worker's share of the origin's state: the tensors of `params` (its stage's), of the
    sharded ones only `rows`; weights, and AdamW's state where the origin took its moments."""
    moments = MOMENTS in origin["took"]

    def wanted(key: str) -> bool:
        return (key.startswith(MODEL_PREFIX) or moments) and tensor_param(key) in params

    return KINDS[origin["kind"]].read(origin, wanted, rows, into)
