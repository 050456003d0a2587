"""An OLMo-core checkpoint (torch distributed checkpoint, DCP) read as relaytrain tensors, for
`init.from`: the weights, and AdamW's moments and step count with `optimizer`, keyed as our
checkpoints are (`model.<name>`, `optim.<name>.<state>`, checkpoint/keys.py).

Nothing in it is unpickled freely. DCP's `.metadata` is a pickle; it is read through
`_MetadataUnpickler`, whose `find_class` admits only the classes a DCP metadata file holds
(torch.distributed.checkpoint.metadata's dataclasses, the writer's `_StorageInfo`, `torch.Size`,
torch's dtypes, and torch's layout and memory-format decoders) and refuses anything else before
it is imported. OLMo-core's `_StorageInfo` (olmo_core.distributed.checkpoint.filesystem) is read
as a local record of the same fields, so OLMo-core need not be installed; what it builds is then
checked (chunk locations must be plain file names of the directory). Each tensor chunk in
the `.distcp` files is a `torch.save` of that chunk at the byte range the metadata names (both
torch's FileSystemWriter and OLMo-core's RemoteFileSystemWriter write it so); it is read with
`torch.load(weights_only=True)`, torch's restricted unpickler that rebuilds tensors only, once
the read is known to hold exactly the range (a server ignoring `Range` sends the whole file).
Ranges written through a DCP stream transform (compression) are refused.

The trainer state OLMo-core's Trainer saves beside it (`train/rank0.pt`: the step count, the
data loader's position, RNG and callback states; `load_trainer_state=True` takes it) is a
`torch.save` zip archive whose pickle holds numpy and torch objects (the RNG states) besides
plain values. `read_olmo_core_trainer_state` reads it through `_InertUnpickler`: only plain
containers (`collections.OrderedDict`, sets) and `_codecs.encode` (how protocol 2 writes
bytes) are built as themselves; every other class or function the pickle names is never
imported nor called, but stands as an inert placeholder (`_Inert`), as does every tensor
storage: the reader uses only the plain integers (`global_step`, the data loader's `epoch`,
`tokens_processed`, `batches_processed`, `seed`) and checks them.

Works on a local directory and any fsspec URL (relaytrain.storage): OLMo-core's `stepN/`
directory (the DCP in its `model_and_optim/`) or the DCP directory itself. `init.from` checks a
source by its metadata alone (`read_olmo_core_metadata`), before a run writes anything, and each
worker then reads only the chunks of its own tensors (`read_olmo_core(..., keys)`).
"""

from __future__ import annotations

import hashlib
import io
import json
import pickle
import posixpath
import re
import zipfile
from collections import OrderedDict
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import fsspec
import torch

from relaytrain import storage
from relaytrain.checkpoint.keys import MODEL_PREFIX, model_key, optim_key, rename_parameter
from relaytrain.errors import CheckpointError

DCP_DIR = "model_and_optim"  # where OLMo-core's trainer writes the DCP inside a step directory
TRAIN_STATE = "train/rank0.pt"  # where its trainer writes rank 0's trainer state beside it
MOMENTS = ("exp_avg", "exp_avg_sq")  # AdamW's state beside `step` (train/optim.py's names)
READ_THREADS = 8

_GLOBAL_NAMES = {  # OLMo-core's Transformer -> ours (model/olmo3.py)
    "embeddings.weight": "embed.weight",
    "lm_head.norm.weight": "norm.weight",
    "lm_head.w_out.weight": "lm_head.weight",
}
_BLOCK_NAMES = {  # after "blocks.{i}." -> after "layers.{i}."
    **{f"attention.{oc}.weight": f"attn.{ours}.weight" for oc, ours in (
        ("w_q", "q_proj"), ("w_k", "k_proj"), ("w_v", "v_proj"), ("w_out", "o_proj"),
        ("q_norm", "q_norm"), ("k_norm", "k_norm"))},
    "attention_norm.weight": "attn_norm.weight",
    # SwiGLU: w2(silu(w1 x) * w3 x)
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "feed_forward_norm.weight": "mlp_norm.weight",
}


def olmo_core_to_ours_name(name: str) -> str:
    """`blocks.3.feed_forward.w1.weight` -> `layers.3.mlp.gate_proj.weight`."""
    return rename_parameter(name, _GLOBAL_NAMES, _BLOCK_NAMES, "blocks.", "layers.",
                            "OLMo-core Olmo 3")


def olmo_core_names(n_layers: int) -> list[str]:
    """Every parameter name of an OLMo-core Olmo 3 transformer of `n_layers` blocks."""
    return [*_GLOBAL_NAMES, *(f"blocks.{i}.{n}" for i in range(n_layers) for n in _BLOCK_NAMES)]


@dataclass(frozen=True)
class OlmoCoreCheckpoint:
    """What `read_olmo_core` took: `tensors` keyed as our checkpoints; `step` the optimizer's
    step count (None without optimizer state); `model` the dimensions found, as Olmo3Config
    fields; `digest` sha256 of the `.metadata` file; `what` a one-line description."""

    tensors: dict[str, torch.Tensor]
    step: int | None
    model: dict[str, Any]
    digest: str
    what: str


# ---------------------------------------------------------------------------------------------
# The metadata pickle, through an allow-list


@dataclass
class _StorageInfo:
    """Where a chunk lies: a file of the DCP and a byte range in it (the writers' record)."""

    relative_path: str = ""
    offset: int = 0
    length: int = 0
    transform_descriptors: Any = None


_DCP_METADATA = "torch.distributed.checkpoint.metadata"
_ALLOWED = {
    (_DCP_METADATA, n) for n in ("Metadata", "MetadataIndex", "TensorStorageMetadata",
                                 "BytesStorageMetadata", "ChunkStorageMetadata",
                                 "TensorProperties", "StorageMeta", "_MEM_FORMAT_ENCODING")
} | {("torch", "Size"), ("torch.serialization", "_get_layout")}
_STORAGE_INFO = {("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
                 ("olmo_core.distributed.checkpoint.filesystem", "_StorageInfo")}


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles a DCP `.metadata` file, admitting only the classes such a file holds."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _STORAGE_INFO:
            return _StorageInfo
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        raise CheckpointError(f"refusing to unpickle {module}.{name}: not a class a torch "
                              "distributed checkpoint's metadata holds (allowed: "
                              f"{_DCP_METADATA} classes, _StorageInfo, torch.Size, torch dtypes)")


def read_metadata(data: bytes, where: str) -> Any:
    """The DCP `Metadata` pickled in `data` (the `.metadata` file at `where`), its entries
    checked to be what a reader relies on."""
    try:
        md = _MetadataUnpickler(io.BytesIO(data)).load()
    except CheckpointError as e:
        raise CheckpointError(f"{where}: {e}") from None
    except Exception as e:  # a truncated or corrupt pickle raises anything
        raise CheckpointError(f"{where} is not a readable torch distributed checkpoint "
                              f"metadata file ({type(e).__name__}: {e})") from None
    problem = _metadata_problem(md)
    if problem:
        raise CheckpointError(f"{where} is not a torch distributed checkpoint's metadata: "
                              f"{problem}")
    return md


def _metadata_problem(md: Any) -> str | None:
    """What is wrong with an unpickled `.metadata`, or None: a `Metadata` whose storage entries
    are chunk locations (a plain file name of the directory, a byte range) and whose tensors
    have their `TensorStorageMetadata`."""
    from torch.distributed.checkpoint.metadata import (
        Metadata,
        MetadataIndex,
        TensorStorageMetadata,
    )

    if not isinstance(md, Metadata) or not isinstance(md.storage_data, dict) or \
            not isinstance(md.state_dict_metadata, dict):
        return f"it holds a {type(md).__name__}, not a Metadata with its storage_data"
    for index, info in md.storage_data.items():
        if not isinstance(index, MetadataIndex) or not isinstance(info, _StorageInfo) or \
                not isinstance(info.relative_path, str) or \
                not re.fullmatch(r"[\w-][\w.-]*", info.relative_path) or \
                not all(isinstance(n, int) and n >= 0 for n in (info.offset, info.length)):
            return f"storage entry {index!r}: {info!r} is not a file of the directory and a range"
        if index.offset is not None and not isinstance(
                md.state_dict_metadata.get(index.fqn), TensorStorageMetadata):
            return f"tensor {index.fqn!r} has a chunk but no TensorStorageMetadata"
    return None


# ---------------------------------------------------------------------------------------------
# Reading


@dataclass(frozen=True)
class OlmoCoreMetadata:
    """What an OLMo-core checkpoint holds, from its `.metadata` alone (and one step count):
    `shapes` of each tensor under our keys (`optim.*` only where it holds AdamW's moments,
    then `moments`), the `model` dimensions, `step` (AdamW's step count, None without
    moments) and `digest` (sha256 of `.metadata`)."""

    shapes: dict[str, tuple[int, ...]]
    model: dict[str, Any]
    step: int | None
    moments: bool
    digest: str
    n_layers: int


@dataclass(frozen=True)
class _Opened:
    """A checkpoint's metadata and where to read its chunks: what both readers share."""

    fs: fsspec.AbstractFileSystem
    dcp: str
    md: Any
    chunks: dict[str, list[tuple[tuple[int, ...], _StorageInfo]]]
    fqns: dict[str, str]  # our key -> its fqn, of every tensor `meta.shapes` names
    meta: OlmoCoreMetadata
    where: str


def read_olmo_core_metadata(url: str, optimizer: bool = False) -> OlmoCoreMetadata:
    """What the OLMo-core checkpoint at `url` holds, reading no weights: for `init.from` to
    check a source before a run writes anything. With `optimizer`, AdamW's state must be whole
    where it has any."""
    return _open(url, optimizer).meta


def read_olmo_core(url: str, optimizer: bool,
                   keys: Callable[[str], bool] | None = None) -> OlmoCoreCheckpoint:
    """The weights of the OLMo-core checkpoint at `url`, and with `optimizer` AdamW's moments
    and step count (what OLMo-core's `load_optim_state=True` takes), under our names; only the
    tensors `keys` selects (by our key) where given: their chunks alone are read."""
    o = _open(url, optimizer)
    if optimizer and not o.meta.moments:
        raise CheckpointError(f"OLMo-core checkpoint {o.where!r} holds no optimizer state: use "
                              "init.optimizer: false")
    wanted = {k: f for k, f in o.fqns.items()
              if (optimizer or k.startswith(MODEL_PREFIX)) and (keys is None or keys(k))}
    tensors = _read_tensors(o.fs, o.dcp, o.md, wanted, o.chunks, o.where)
    for key, t in tensors.items():
        if key.endswith((".exp_avg", ".exp_avg_sq", ".step")):
            tensors[key] = t.float()  # our AdamW's state dtype (moments kept lower are exact up)
    step = o.meta.step if optimizer else None
    what = (f"OLMo-core weights of {o.meta.n_layers} blocks" +
            (f" and AdamW moments at step {step}" if optimizer else ""))
    return OlmoCoreCheckpoint(tensors, step, o.meta.model, o.meta.digest, what)


def _open(url: str, optimizer: bool) -> _Opened:
    """The checkpoint's metadata read and checked: an Olmo 3's whole weights (and, with
    `optimizer`, AdamW's whole state where it has any), its dimensions and step count."""
    fs, root = storage.filesystem(url)
    where = storage.redact(url)  # what messages show of it
    dcp = _find_dcp(fs, root, where)
    meta_path = posixpath.join(dcp, ".metadata")
    try:
        data = fs.cat_file(meta_path)
    except OSError as e:
        raise CheckpointError(f"cannot read {storage.redact(meta_path)!r}: {e}") from None
    md = read_metadata(data, storage.redact(meta_path))
    chunks = _chunks_by_fqn(md)
    n_layers = _n_layers(chunks, where)
    names = olmo_core_names(n_layers)
    fqns = {model_key(olmo_core_to_ours_name(n)): f"model.{n}" for n in names}
    states = {optim_key(olmo_core_to_ours_name(n), s): f"optim.state.{n}.{s}"
              for n in names for s in (*MOMENTS, "step")}
    held = [f for f in states.values() if f in chunks]
    moments = len(held) == len(states)
    missing = [f for f in fqns.values() if f not in chunks]
    if optimizer and held and not moments:
        missing += [f for f in states.values() if f not in chunks]
    if missing:
        raise CheckpointError(f"OLMo-core checkpoint {where!r} lacks {len(missing)} tensor(s) of "
                              f"an Olmo 3 of {n_layers} blocks, e.g. {missing[0]!r}")
    if moments:
        fqns.update(states)
    shapes = {k: tuple(md.state_dict_metadata[f].size) for k, f in fqns.items()}
    step = None
    if moments:  # one parameter's step count (a scalar: one small ranged read)
        key = optim_key(olmo_core_to_ours_name(names[0]), "step")
        step = int(_read_tensors(fs, dcp, md, {key: fqns[key]}, chunks, where)[key].item())
    meta = OlmoCoreMetadata(shapes, _dimensions(shapes, n_layers, fs, root, dcp, where), step,
                            moments, "sha256:" + hashlib.sha256(data).hexdigest(), n_layers)
    return _Opened(fs, dcp, md, chunks, fqns, meta, where)


def _find_dcp(fs: fsspec.AbstractFileSystem, root: str, where: str) -> str:
    """The DCP directory: `root` or its `model_and_optim/`, whichever holds `.metadata`."""
    for d in (root, posixpath.join(root, DCP_DIR)):
        if fs.exists(posixpath.join(d, ".metadata")):
            return d
    if not fs.exists(root):
        raise CheckpointError(f"OLMo-core checkpoint {where!r} does not exist")
    try:
        found = sorted(posixpath.basename(p.rstrip("/")) for p in fs.ls(root, detail=False))
    except (OSError, NotADirectoryError):
        found = []
    shown = ", ".join(found[:6]) + (", ..." if len(found) > 6 else "") if found else "nothing"
    raise CheckpointError(f"{where!r} is not an OLMo-core checkpoint: no .metadata in it nor in "
                          f"its {DCP_DIR}/ (found: {shown}); expected a torch distributed "
                          f"checkpoint directory (OLMo-core's stepN/ or stepN/{DCP_DIR}/)")


def _chunks_by_fqn(md: Any) -> dict[str, list[tuple[tuple[int, ...], _StorageInfo]]]:
    """Each saved tensor's chunks: (offsets into the whole tensor, where the chunk lies)."""
    out: dict[str, list[tuple[tuple[int, ...], _StorageInfo]]] = {}
    for index, info in md.storage_data.items():
        if index.offset is not None:  # tensors only (bytes entries: param groups, extra state)
            out.setdefault(index.fqn, []).append((tuple(index.offset), info))
    return out


def _n_layers(chunks: dict[str, Any], where: str) -> int:
    """The number of blocks of the model the checkpoint holds; refuses what is not Olmo 3."""
    names = [k[len("model."):] for k in chunks if k.startswith("model.")]
    if not names:
        raise CheckpointError(f"OLMo-core checkpoint {where!r} holds no model weights (model.*)")
    for n in names:
        try:
            olmo_core_to_ours_name(n)
        except ValueError:
            raise CheckpointError(f"OLMo-core checkpoint {where!r} holds {n!r}, not a parameter of "
                                  "an Olmo 3 transformer (embeddings, blocks.N.attention.w_q/"
                                  "w_k/w_v/w_out/q_norm/k_norm, attention_norm, feed_forward."
                                  "w1/w2/w3, feed_forward_norm, lm_head.norm/w_out)") from None
    blocks = [int(n.split(".")[1]) for n in names if n.startswith("blocks.")]
    if not blocks:
        raise CheckpointError(f"OLMo-core checkpoint {where!r} holds no transformer blocks "
                              "(model.blocks.N.*)")
    return 1 + max(blocks)


def _read_tensors(fs: fsspec.AbstractFileSystem, dcp: str, md: Any,
                  wanted: dict[str, str], chunks: dict[str, list[tuple[tuple[int, ...], Any]]],
                  where: str) -> dict[str, torch.Tensor]:
    """Our key -> the whole tensor (`wanted`: our key -> its fqn), its chunks read in parallel
    and each copied into place as it arrives (a whole one taken as it is)."""
    jobs = [(key, offsets, info) for key, fqn in wanted.items() for offsets, info in chunks[fqn]]
    out: dict[str, torch.Tensor] = {}
    filled: dict[str, int] = {}
    with ThreadPoolExecutor(READ_THREADS) as pool:
        loaded = pool.map(lambda job: _read_chunk(fs, dcp, job[2], where), jobs)
        for (key, offsets, _), chunk in zip(jobs, loaded, strict=True):
            _place(out, key, offsets, chunk, md.state_dict_metadata[wanted[key]], wanted[key],
                   where)
            filled[key] = filled.get(key, 0) + chunk.numel()
    for key, whole in out.items():
        if filled[key] != whole.numel():
            raise CheckpointError(f"OLMo-core checkpoint {where!r}: the chunks of {wanted[key]} "
                                  f"hold {filled[key]} of its {whole.numel()} elements")
    return out


def _place(out: dict[str, torch.Tensor], key: str, offsets: tuple[int, ...],
           chunk: torch.Tensor, meta: Any, fqn: str, where: str) -> None:
    """`chunk` at `offsets` of the whole tensor `out[key]` (the chunk itself when whole),
    checked against the tensor's metadata (`TensorStorageMetadata`)."""
    if chunk.dtype != meta.properties.dtype or len(offsets) != chunk.dim() or any(
            o + n > s for o, n, s in zip(offsets, chunk.shape, meta.size, strict=True)):
        raise CheckpointError(f"OLMo-core checkpoint {where!r}: a chunk of {fqn} ({chunk.dtype}, "
                              f"{list(chunk.shape)} at {list(offsets)}) does not fit its "
                              f"metadata ({meta.properties.dtype}, {list(meta.size)})")
    if chunk.shape == meta.size:
        out[key] = chunk
        return
    if key not in out:
        out[key] = torch.empty(meta.size, dtype=chunk.dtype)
    out[key][tuple(slice(o, o + n) for o, n in zip(offsets, chunk.shape, strict=True))] = chunk


def _read_chunk(fs: fsspec.AbstractFileSystem, dcp: str, info: _StorageInfo, where: str,
                ) -> torch.Tensor:
    """One chunk: `torch.load(weights_only=True)` of its byte range."""
    path = posixpath.join(dcp, info.relative_path)
    if info.transform_descriptors:
        raise CheckpointError(f"OLMo-core checkpoint {where!r}: {info.relative_path} was written "
                              f"through DCP stream transforms {list(info.transform_descriptors)}"
                              "; only plain torch.save chunks are read")
    try:
        data = fs.cat_file(path, start=info.offset, end=info.offset + info.length)
        if len(data) != info.length:  # a server that ignores ranges sends the whole file
            raise OSError(f"asked for {info.length} bytes, got {len(data)}")
        t = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as e:
        raise CheckpointError(f"OLMo-core checkpoint {where!r}: cannot read the tensor at bytes "
                              f"{info.offset}..{info.offset + info.length} of "
                              f"{info.relative_path} ({type(e).__name__}: {e})") from None
    if not isinstance(t, torch.Tensor):
        raise CheckpointError(f"OLMo-core checkpoint {where!r}: bytes {info.offset}.. of "
                              f"{info.relative_path} hold a {type(t).__name__}, not a tensor")
    return t


def _dimensions(shapes: dict[str, tuple[int, ...]], n_layers: int,
                fs: fsspec.AbstractFileSystem, root: str, dcp: str, where: str
                ) -> dict[str, Any]:
    """Olmo3Config fields the weights' shapes show; the head split from OLMo-core's
    config.json."""
    vocab_size, d_model = shapes[model_key("embed.weight")]
    out: dict[str, Any] = {"d_model": d_model, "vocab_size": vocab_size, "n_layers": n_layers}
    block = "layers.0."
    q = shapes[model_key(block + "attn.q_proj.weight")][0]
    kv = shapes[model_key(block + "attn.k_proj.weight")][0]
    if shapes[model_key(block + "attn.q_norm.weight")][0] != q:
        raise CheckpointError(f"OLMo-core checkpoint {where!r} has a per-head QK norm "
                              "(use_head_qk_norm); Olmo 3 normalises the whole projection")
    out["mlp_hidden"] = shapes[model_key(block + "mlp.gate_proj.weight")][0]
    heads = _config_heads(fs, [root, posixpath.dirname(dcp)], d_model)
    if heads is not None:
        n_heads, n_kv_heads, head_dim = heads
        if (n_heads * head_dim, n_kv_heads * head_dim) != (q, kv):
            raise CheckpointError(f"OLMo-core checkpoint {where!r}: its config.json's {n_heads} "
                                  f"heads ({n_kv_heads} kv) of {head_dim} do not match the "
                                  f"projections' widths {q} and {kv}")
        out.update(n_heads=n_heads, n_kv_heads=n_kv_heads, head_dim=head_dim)
    return out


def _config_heads(fs: fsspec.AbstractFileSystem, dirs: Iterable[str], d_model: int,
                  ) -> tuple[int, int, int] | None:
    """(n_heads, n_kv_heads, head_dim) from the `config.json` OLMo-core's ConfigSaverCallback
    writes beside a checkpoint (`model.block.sequence_mixer` or, older, `.attention`); None
    where there is none."""
    for d in dict.fromkeys(dirs):
        path = posixpath.join(d, "config.json")
        if not fs.exists(path):
            continue
        try:
            block = json.loads(fs.cat_file(path))["model"]["block"]
            att = block.get("sequence_mixer") or block["attention"]
            n_heads = int(att["n_heads"])
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointError(f"{storage.redact(path)!r} lacks the model's attention "
                                  f"settings (model.block.sequence_mixer.n_heads): {e}") from None
        n_kv = int(att.get("n_kv_heads") or n_heads)
        return n_heads, n_kv, int(att.get("head_dim") or d_model // n_heads)
    return None


# ---------------------------------------------------------------------------------------------
# The trainer state (`train/rank0.pt`), through inert placeholders


class _Inert:
    """What an object of a class the trainer state's reader does not admit stands as: it takes
    whatever its pickle gives it and runs nothing."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args = args

    def __setstate__(self, state: Any) -> None:
        self.state = state

    def __setitem__(self, key: Any, value: Any) -> None:
        pass

    def append(self, value: Any) -> None:
        pass

    def extend(self, values: Any) -> None:
        pass


_PLAIN = {("collections", "OrderedDict"): OrderedDict, ("builtins", "set"): set,
          ("builtins", "frozenset"): frozenset}


class _InertUnpickler(pickle.Unpickler):
    """Unpickles a `torch.save`d trainer state: plain values as themselves, anything else
    (numpy arrays, tensors and their storages, RNG states) as `_Inert`, never imported."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("_codecs", "encode"):
            return lambda text, encoding="latin1": str(text).encode(encoding)
        return _PLAIN.get((module, name), _Inert)

    def persistent_load(self, pid: Any) -> Any:
        return _Inert(pid)


@dataclass(frozen=True)
class OlmoCoreTrainerState:
    """The part of OLMo-core's trainer state a continued run takes: the trainer's
    `global_step`, its data loader's `epoch` (1-based) and the `tokens_processed` /
    `batches_processed` of that epoch, the data order's `seed`; `digest` sha256 of the file."""

    global_step: int
    epoch: int
    tokens: int
    batches: int
    seed: int
    digest: str


def read_olmo_core_trainer_state(url: str) -> OlmoCoreTrainerState | None:
    """The trainer state beside the OLMo-core checkpoint at `url` (its step directory, or the
    DCP directory in it), None where there is none (a checkpoint of weights alone); refused
    where the file is not a trainer state OLMo-core writes."""
    fs, root = storage.filesystem(url)
    root = root.rstrip("/")
    step_dir = posixpath.dirname(root) if posixpath.basename(root) == DCP_DIR else root
    path = posixpath.join(step_dir, TRAIN_STATE)
    if not fs.exists(path):
        return None
    where = storage.redact(path)
    data = fs.cat_file(path)
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as z:
            pkl = next(n for n in z.namelist() if n.endswith("/data.pkl") or n == "data.pkl")
            state = _InertUnpickler(io.BytesIO(z.read(pkl))).load()
    except Exception as e:  # not a zip, no pickle in it, a truncated pickle: anything
        raise CheckpointError(f"{where} is not a trainer state torch.save wrote "
                              f"({type(e).__name__}: {e})") from None
    loader = state.get("data_loader") if isinstance(state, dict) else None
    if not isinstance(loader, dict):
        raise CheckpointError(f"{where} holds no OLMo-core trainer state (a dict with its "
                              "data_loader's)")
    values = {"global_step": state.get("global_step"), "epoch": loader.get("epoch") or 1,
              **{k: loader.get(k) for k in ("tokens_processed", "batches_processed", "seed")}}
    bad = [k for k, v in values.items()
           if not isinstance(v, int) or isinstance(v, bool) or v < (k == "epoch")]
    if bad:
        raise CheckpointError(f"{where}: the trainer state's {bad[0]} is "
                              f"{values[bad[0]]!r}, not an integer >= {int(bad[0] == 'epoch')}")
    return OlmoCoreTrainerState(values["global_step"], values["epoch"],
                                values["tokens_processed"], values["batches_processed"],
                                values["seed"], "sha256:" + hashlib.sha256(data).hexdigest())
