"""Sharded tensors and whole ones, without importing FSDP2.

A sharded run (`parallel.fsdp`, see parallel/fsdp.py) holds each parameter, its gradient and its
AdamW moments as DTensors: dim-0 chunk `rank` of the whole tensor (torch.chunk's split: the last
chunks may be smaller or empty). Snapshots and checkpoints hold whole tensors; these functions
convert between the two, and tell which shard counts keep exact mode's bits.

Nothing here imports torch.distributed.tensor: importing it (with FSDP2) costs a worker 1.2 s of
its start-up, which every unsharded run and every replacement would pay. A tensor can only be a
DTensor once parallel/fsdp.py has been imported (it imports DTensor), so `is_sharded` looks for
the class only then.

Why chunks must be whole vectors: torch's fused AdamW on the CPU updates a tensor's values in
vectors, and the last values that do not fill a vector one at a time, where the result can
differ in the last bit (measured: a 4,096-value tensor split 1366/1366/1364 changed 10 values
of `exp_avg_sq`, at each chunk's tail). A chunk of whole vectors puts every value on the path it
takes in the whole tensor.
"""

from __future__ import annotations

import math
import sys

import torch

from relaytrain.model.config import Olmo3Config
from relaytrain.model.olmo3 import Olmo3

# float32 values per vector in torch's widest CPU kernels (AVX-512); whole 16-value vectors are
# whole vectors of every narrower width too.
VECTOR_VALUES = 16


def parameter_shapes(cfg: Olmo3Config) -> dict[str, tuple[int, ...]]:
    """The whole model's parameter shapes (built on the meta device: no memory). A vocabulary
    not known yet (it comes with the data) is taken as one vector: it only sets the row counts
    of the embedding and the head, rows of d_model values."""
    if not cfg.vocab_size:
        cfg = cfg.with_vocab(VECTOR_VALUES)
    with torch.device("meta"):
        model = Olmo3(cfg)
    return {name: tuple(p.shape) for name, p in model.named_parameters()}


def misaligned(shapes: dict[str, tuple[int, ...]], shards: int) -> tuple[str, int] | None:
    """The first parameter whose dim-0 chunks over `shards` ranks (torch.chunk: all but the
    last have ceil(rows / shards) rows) are not whole vectors, and its chunk's value count;
    None if every chunk but the last of every tensor is (exact mode's bits then do not depend
    on the sharding)."""
    for name, shape in shapes.items():
        rows = shape[0] if shape else 1
        per_row = math.prod(shape[1:])
        chunk = -(-rows // shards)
        if chunk < rows and (chunk * per_row) % VECTOR_VALUES:
            return name, chunk * per_row
    return None


def is_sharded(t: torch.Tensor) -> bool:
    """True for a DTensor (a sharded parameter, gradient or moment)."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(t, module.DTensor)


def whole_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a DTensor (a collective over its mesh); a plain tensor as is."""
    return t.full_tensor() if is_sharded(t) else t


def chunk_rows(rows: int, shards: int, rank: int) -> tuple[int, int]:
    """Rows [start, stop) of dim-0 chunk `rank` of `shards` (torch.chunk's split, which FSDP2
    uses: chunks of ceil(rows / shards) rows; the last may be smaller, later ones empty)."""
    size = -(-rows // shards)
    return min(rank * size, rows), min((rank + 1) * size, rows)


def local_chunk(values: torch.Tensor, like: torch.Tensor, local: bool = False) -> torch.Tensor:
    """This rank's part, for a tensor laid out as `like` (a DTensor sharded as FSDP2 shards, or
    a plain tensor), of `values`: the whole tensor, or with `local` already this rank's rows of
    it (`own_rows`: a ranged checkpoint read)."""
    rows = own_rows(like)
    part = values if local or rows is None else values[rows[0]:rows[1]]
    if part.shape != local_tensor(like).shape:
        raise ValueError(f"a tensor of shape {tuple(values.shape)} is not "
                         f"{'' if local else 'the whole of '}this rank's part "
                         f"{tuple(local_tensor(like).shape)}")
    return part


def shard_pieces(tensors: dict[str, torch.Tensor], first: bool
                 ) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, list[int]]]]:
    """What one shard writes of a sharded state: its own rows of each sharded tensor, and the
    record the checkpoint store keeps of them (key -> whole shape, rows); tensors that are not
    sharded (AdamW's step counts: the same on every shard) only if it is the `first`. An empty
    chunk (more shards than rows) is a piece of no rows: it still says the type and row shape."""
    out: dict[str, torch.Tensor] = {}
    where: dict[str, dict[str, list[int]]] = {}
    for key, t in tensors.items():
        rows = own_rows(t)
        if rows is None:
            if first:
                out[key] = t
            continue
        out[key] = t.to_local()
        where[key] = {"shape": list(t.shape), "rows": list(rows)}
    return out, where


def as_like(values: torch.Tensor, like: torch.Tensor, local: bool = False,
            copy: bool = True) -> torch.Tensor:
    """A tensor holding `values` (the whole tensor, or with `local` this rank's rows of it:
    `own_rows`) laid out as `like` (sharded if `like` is); with `copy=False`, `values`' own
    memory where it is exactly this rank's part (tensors a checkpoint read made for it; a view
    into more is copied, so that it does not keep the rest alive)."""
    part = local_chunk(values, like, local)
    whole = part.untyped_storage().nbytes() == part.numel() * part.element_size()
    out = part.to(device=like.device, dtype=like.dtype, copy=copy or not whole)
    if not is_sharded(like):
        return out
    return type(like).from_local(out, like.device_mesh, like.placements, shape=like.shape,
                              stride=like.stride())


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of `t` (sharded or not), as a plain tensor sharing its storage."""
    return t.to_local() if is_sharded(t) else t


def assign_(dest: torch.Tensor, values: torch.Tensor, local: bool = False) -> None:
    """Set `dest` (sharded or not) in place to `values` (as for `as_like`)."""
    local_tensor(dest).copy_(local_chunk(values, dest, local).to(dest.dtype))


def own_rows(t: torch.Tensor) -> tuple[int, int] | None:
    """The rows of the whole tensor this rank holds of a sharded `t`; None if `t` is whole."""
    if not is_sharded(t):
        return None
    mesh = t.device_mesh
    return chunk_rows(t.shape[0], mesh.size(), mesh.get_local_rank())
