"""How a training state's tensors are keyed in a checkpoint: `model.<param>` for the weights and
`optim.<param>.<state>` for the optimizer's state, by global parameter name, so a pipeline stage's
part holds its own layers' keys and any layout can read any other's."""

from __future__ import annotations

import re
from typing import TypeVar

MODEL_PREFIX = "model."
OPTIM_PREFIX = "optim."

T = TypeVar("T")


def model_key(param: str) -> str:
    return MODEL_PREFIX + param


def optim_key(param: str, state: str) -> str:
    return f"{OPTIM_PREFIX}{param}.{state}"


def tensor_param(key: str) -> str:
    """The parameter a checkpoint tensor belongs to."""
    if key.startswith(MODEL_PREFIX):
        return key[len(MODEL_PREFIX):]
    return key[len(OPTIM_PREFIX):].rsplit(".", 1)[0]


def model_tensors(tensors: dict[str, T]) -> dict[str, T]:
    """The weights among a checkpoint's tensors, by parameter name."""
    return {k[len(MODEL_PREFIX):]: v for k, v in tensors.items() if k.startswith(MODEL_PREFIX)}


def rename_parameter(name: str, names: dict[str, str], layer_names: dict[str, str], src: str,
                     dst: str, what: str) -> str:
    """A parameter's name in another implementation's scheme: whole-model names through
    `names`, a layer's (`<src><i>.<rest>`) as `<dst><i>.` and `layer_names[rest]`; ValueError
    naming `what` for any other name (HF's and OLMo-core's Olmo 3 both map this way)."""
    if name in names:
        return names[name]
    m = re.fullmatch(rf"{re.escape(src)}(\d+)\.(.+)", name)
    if m and m[2] in layer_names:
        return f"{dst}{m[1]}.{layer_names[m[2]]}"
    raise ValueError(f"not an {what} parameter name: {name!r}")
