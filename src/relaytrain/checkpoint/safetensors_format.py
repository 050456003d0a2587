"""The safetensors format, the only way a checkpoint stores tensors: a part is streamed out in
it, and a header read back is checked as the format requires before any tensor is trusted
(nothing from storage is ever unpickled).
"""

from __future__ import annotations

import json
import struct
from typing import Any, BinaryIO

import torch

from relaytrain.checkpoint.streaming import CHUNK, BackgroundHash
from relaytrain.errors import CheckpointError

MAX_HEADER = 100 << 20  # safetensors' own limit on the JSON header
# torch dtype -> safetensors dtype name (the format's spec; safetensors.torch._TYPES inverted)
DTYPES: dict[torch.dtype, str] = {
    torch.bool: "BOOL", torch.uint8: "U8", torch.int8: "I8", torch.int16: "I16",
    torch.uint16: "U16", torch.int32: "I32", torch.uint32: "U32", torch.int64: "I64",
    torch.uint64: "U64", torch.float16: "F16", torch.bfloat16: "BF16", torch.float32: "F32",
    torch.float64: "F64", torch.complex64: "C64", torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}
_DTYPE_OF = {name: dtype for dtype, name in DTYPES.items()}


def write_safetensors(f: BinaryIO, tensors: dict[str, torch.Tensor], block_size: int,
                      hashing: list[BackgroundHash]) -> int:
    """Stream `tensors` to `f` in the safetensors format; returns the bytes written. The
    hashing of those bytes (streaming.BackgroundHash, appended to `hashing`) may still run: the
    caller reads its digest, or closes it on an error, and keeps the tensors unchanged until
    then.

    Streaming instead of `safetensors.torch.save` avoids holding the whole file in memory next
    to the tensors, and hashes the exact bytes written in the same pass.
    """
    # Widest dtypes first: with the 8-aligned header every tensor starts aligned.
    order = sorted(tensors, key=lambda k: (-tensors[k].element_size(), k))
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for k in order:
        t = tensors[k]
        if not isinstance(t, torch.Tensor) or t.dtype not in DTYPES or k == "__metadata__":
            what = t.dtype if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"cannot checkpoint {k!r}: {what} (expected a tensor of "
                             f"{sorted(str(d) for d in DTYPES)})")
        n = t.numel() * t.element_size()
        header[k] = {"dtype": DTYPES[t.dtype], "shape": list(t.shape),
                     "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    head = struct.pack("<Q", len(raw)) + raw
    # beside the writes, on other cores; the tensors stay as they are until written
    h = BackgroundHash(head, block_size=block_size, stable=True)
    hashing.append(h)
    f.write(head)
    for k in order:
        data = raw_bytes(tensors[k])
        for i in range(0, len(data), CHUNK):
            chunk = data[i:i + CHUNK]
            h.update(chunk)
            f.write(chunk)
    return len(head) + offset


def raw_bytes(t: torch.Tensor) -> memoryview:
    """The tensor's bytes in C order, copying only if it is off-CPU or not contiguous."""
    t = t.detach().to("cpu").contiguous()
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def parse_header(raw: bytes, data_len: int, shown: str) -> list[tuple[str, torch.dtype, list]]:
    """(name, dtype, shape) of each tensor in file order, after checking the header as the
    safetensors format requires: known dtypes, offsets that match the shapes and tile the data
    region exactly."""
    def bad(why: str) -> CheckpointError:
        return CheckpointError(f"{shown}: not a valid safetensors file ({why})")

    try:
        header = json.loads(bytes(raw))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise bad(f"header is not JSON: {e}") from None
    if not isinstance(header, dict):
        raise bad("header is not a JSON object")
    entries = []
    for key, e in header.items():
        if key == "__metadata__":
            continue
        if not (isinstance(e, dict) and e.get("dtype") in _DTYPE_OF
                and isinstance(e.get("shape"), list)
                and all(isinstance(d, int) and d >= 0 for d in e["shape"])
                and isinstance(e.get("data_offsets"), list) and len(e["data_offsets"]) == 2
                and all(isinstance(o, int) for o in e["data_offsets"])):
            raise bad(f"entry {key!r} is not {{dtype, shape, data_offsets}}")
        entries.append((e["data_offsets"], key, _DTYPE_OF[e["dtype"]], e["shape"]))
    entries.sort(key=lambda x: x[0])
    end = 0
    for (start, stop), key, dtype, shape in entries:
        size = dtype.itemsize
        for d in shape:
            size *= d
        if start != end or stop - start != size:
            raise bad(f"entry {key!r}: data_offsets {[start, stop]} do not follow the "
                      f"previous tensor or do not fit its shape")
        end = stop
    if end != data_len:
        raise bad(f"the tensors cover {end} of {data_len} data bytes")
    return [(key, dtype, shape) for _, key, dtype, shape in entries]
