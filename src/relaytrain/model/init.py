"""Weight initialisation that does not depend on device, world size or pipeline layout.

Each parameter is drawn on the CPU in fp32 from its own generator, seeded from (run seed,
"init", global parameter name), then copied into place. A stage therefore gets exactly the
weights the same names have in the full model, on any device, in any order of construction.
"""

from __future__ import annotations

import hashlib

import torch
from torch import nn


def derive_seed(seed: int, tag: str, name: str) -> int:
    """A stable 63-bit seed for (seed, purpose, name); sha256, never Python's salted hash()."""
    digest = hashlib.sha256(f"{seed}/{tag}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


@torch.no_grad()
def init_weights(model: nn.Module, seed: int, std: float | None = None) -> None:
    """Matrices ~ N(0, std) truncated at ±3 std; norm weights (the 1-D parameters) = 1.

    `std` defaults to the model's `cfg.init_std`. Parameters on the meta device are skipped.
    """
    std = model.cfg.init_std if std is None else std
    for name, p in model.named_parameters():
        if p.is_meta:
            continue
        if p.ndim == 1:
            p.fill_(1.0)
            continue
        g = torch.Generator(device="cpu").manual_seed(derive_seed(seed, "init", name))
        w = torch.empty(p.shape, dtype=torch.float32, device="cpu")
        nn.init.trunc_normal_(w, mean=0.0, std=std, a=-3 * std, b=3 * std, generator=g)
        p.copy_(w)
