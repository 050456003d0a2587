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
from relaytrain.checkpoint.olmo_core import read_olmo_core, read_olmo_core_metadata
from relaytrain.checkpoint.pieces import Rows
from relaytrain.checkpoint.reading import Into, KeyFilter, load_dir, stored_keys
from relaytrain.checkpoint.store import locate_checkpoint
from relaytrain.checkpoint.streaming import DIGEST, digest_hex, hash_stream
from relaytrain.config.sections import InitSection
from relaytrain.errors import CheckpointError, ConfigError, UserError, warn
from relaytrain.model.config import Olmo3Config
from relaytrain.model.olmo3 import Olmo3

# The dimensions that fix the weights' shapes: a source must have the run's. Others (RoPE,
# sliding window, sequence length) may change between stages, as Olmo 3's long-context one does.
SHAPE_FIELDS = ("d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "mlp_hidden",
                "vocab_size")
WEIGHTS, MOMENTS = "weights", "moments"


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


@dataclass(frozen=True)
class SourceKind:
    name: str
    holds: Callable[[fsspec.AbstractFileSystem, str], bool]  # does this directory hold one?
    # found and verified (`init.optimizer` says whether its moments are wanted), else an error
    resolve: Callable[[str, bool], Found]
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


def _relay_resolve(url: str, optimizer: bool) -> Found:
    fs, d, manifest = locate_checkpoint(url)
    if not isinstance(manifest.get("model"), dict):
        raise CheckpointError(f"{url}: its manifest records no model config")
    keys = stored_keys(fs, d, manifest)
    return Found(_location(fs, d), int(manifest["step"]), _manifest_digest(manifest),
                 any(k.startswith(OPTIM_PREFIX) for k in keys), manifest["model"],
                 set(model_tensors(dict.fromkeys(keys))),
                 manifest["model"].get("softmax_rows", "tokenizer"))


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


def _hf_resolve(url: str, optimizer: bool) -> Found:
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


def _olmo_core_resolve(url: str, optimizer: bool) -> Found:
    fs, path = storage.filesystem(url)
    meta = read_olmo_core_metadata(url, optimizer)  # the .metadata (and one step count) only
    weights = {tensor_param(k): s for k, s in meta.shapes.items() if k.startswith(MODEL_PREFIX)}
    # OLMo-core's logits span every embedding row (its `lm_head.w_out`), the padded ones too
    return Found(_location(fs, path.rstrip("/")), meta.step, meta.digest, meta.moments,
                 meta.model, set(weights), "padded", weights)


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
        found = kind.resolve(url, init.optimizer)
    except ConfigError:
        raise
    except Exception as e:  # whatever the source holds instead: one line, naming the key
        what = str(e) if isinstance(e, UserError) else f"{type(e).__name__}: {e}"
        raise ConfigError(f"config key 'init.from': {storage.redact(url)} is not a loadable "
                          f"{kind.name} checkpoint ({' '.join(what.split())})") from None
    _check_model(url, found, model_cfg)
    took = [WEIGHTS]
    if init.optimizer and found.moments:
        took.append(MOMENTS)
    elif init.optimizer:
        warn(f"init.optimizer: {storage.redact(url)} ({kind.name}) holds no optimizer state; "
             "taking its weights only")
    return {"from": url, "kind": kind.name, "location": found.location, "step": found.step,
            "digest": found.digest, "took": took, "softmax_rows": found.softmax_rows}


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
