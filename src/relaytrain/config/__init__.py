"""Typed run configuration: YAML files plus dotted `key=value` overrides.

Every section is a dataclass; loading walks the annotations, so an unknown key, a value of the
wrong type or an impossible combination is rejected with one line naming the key, what was
given and what is accepted.

The package: `sections.py` the typed sections, `checks.py` the combinations refused; here
loading (YAML, overrides, a checkpoint's stored config) and which keys may change on resume.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import yaml

from relaytrain.config.checks import validate
from relaytrain.config.sections import InitSection, RunConfig, build_section, model_fields
from relaytrain.errors import ConfigError


def parse_override(text: str) -> tuple[list[str], Any]:
    """`a.b=value` -> (["a", "b"], value) with the value parsed as YAML (so 3, 1e-3, [1,2])."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} is not of the form key=value "
                          "(e.g. train.max_steps=20)")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key:
        raise ConfigError(f"override {text!r} has an empty key")
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError:
        value = raw
    return key.split("."), value


def _apply_override(tree: dict[str, Any], path: list[str], value: Any) -> None:
    # model.<architecture field> goes to model.overrides so presets stay whole.
    if path[0] == "model" and len(path) == 2 and path[1] in model_fields():
        path = ["model", "overrides", path[1]]
    node = tree
    for part in path[:-1]:
        nxt = node.get(part)
        if nxt is None:
            nxt = node[part] = {}
        if not isinstance(nxt, dict):
            raise ConfigError(f"config key '{'.'.join(path)}': '{part}' is not a section")
        node = nxt
    node[path[-1]] = value


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = (),
                base: dict[str, Any] | None = None) -> RunConfig:
    """A validated RunConfig from a YAML file (or `base`) and `key=value` overrides."""
    tree: dict[str, Any] = {}
    if base is not None:
        tree = _deep_copy(base)
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {str(p)!r} does not exist (give a YAML file, e.g. "
                              "configs/demo.yaml)")
        try:
            loaded = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f" at line {mark.line + 1}" if mark else ""
            raise ConfigError(f"config file {str(p)!r} is not valid YAML{where}") from None
        if not isinstance(loaded, dict):
            raise ConfigError(f"config file {str(p)!r} must hold a mapping of keys, "
                              f"got {type(loaded).__name__}")
        for key, value in flatten(loaded).items():
            _apply_override(tree, key.split("."), value)
    for text in overrides:
        key, value = parse_override(text)
        _apply_override(tree, key, value)
    cfg = build_section(RunConfig, tree, "")
    validate(cfg)
    return cfg


def config_from_dict(d: dict[str, Any]) -> RunConfig:
    """The inverse of RunConfig.to_dict (used for configs stored in checkpoints)."""
    cfg = build_section(RunConfig, _deep_copy(d), "")
    validate(cfg)
    return cfg


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """A config tree as its dotted keys: `{"a": {"b": 1}}` -> `{"a.b": 1}`. `model.overrides`
    (a mapping of architecture fields) is one value; an empty section has no keys."""
    out: dict[str, Any] = {}
    for k, v in tree.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and key != "model.overrides":
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


# Keys that may change when a run is resumed (a prefix ends with '.'); anything else must
# match the checkpoint.
RESUMABLE_CHANGES = ("train.max_steps", "train.device", "train.log_every", "train.spike_factor",
                     "parallel.", "runtime.", "elastic.", "faults.", "log.", "checkpoint.",
                     "eval.", "data.prefetch", "data.path", "run_dir", "model.attention",
                     "model.checkpointing", "model.compile", "model.matmul",
                     "model.kernels", "init.")


def check_resume_compatible(saved: dict[str, Any], cfg: RunConfig) -> None:
    """A resumed run must keep what defines its curve: model, data order, optimizer, seed."""
    old, new = (_settled(flatten(c)) for c in (saved, keep_settled(saved, cfg).to_dict()))
    # `seed` first: under a default data.seed, changing it changes data.seed too
    for key in sorted(set(old) | set(new), key=lambda k: (k != "seed", k)):
        if key.startswith(RESUMABLE_CHANGES) or key in RESUMABLE_CHANGES:
            continue
        if old.get(key) != new.get(key):
            may = ", ".join(k + "*" if k.endswith(".") else k for k in RESUMABLE_CHANGES)
            raise ConfigError(
                f"config key '{key}': the run directory's checkpoints were trained with "
                f"{old.get(key)!r}, got {new.get(key)!r}; only {may} may change on resume "
                "(or use a new run_dir)")


def _settled(flat: dict[str, Any]) -> dict[str, Any]:
    """`data.seed` as the seed it stands for: absent (a run from before the key) or null is
    `seed`, so either resumes as the same data order; an absent `optim.schedule` is the
    cosine every run had before the key."""
    if flat.get("data.seed") is None:
        flat["data.seed"] = flat.get("seed")
    flat.setdefault("optim.schedule", "cosine")
    flat.setdefault("data.instances", "concatenated")  # runs from before the packing keys
    flat.setdefault("data.source_group_size", 1)
    return flat


def keep_settled(saved: dict[str, Any], cfg: RunConfig) -> RunConfig:
    """`cfg` resuming the run whose stored config is `saved`, with what that run settled at its
    start where `cfg` leaves it unset: `model.softmax_rows`, and the data seed a continued run
    took from its source (`init.trainer_state`)."""
    rows = softmax_rows_of(saved)
    if rows is not None and "softmax_rows" not in cfg.model.overrides:
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(
            cfg.model, overrides={**cfg.model.overrides, "softmax_rows": rows}))
    carried = ((saved.get("init") or {}).get("origin") or {}).get("trainer")
    seed = (saved.get("data") or {}).get("seed")
    if carried and cfg.data.seed is None and seed is not None:
        cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, seed=seed))
    return cfg


def softmax_rows_of(saved: dict[str, Any]) -> str | None:
    """The `model.softmax_rows` a config stored in a checkpoint settled (None: a run from
    before the key, which computed its loss over the tokenizer's rows unless its
    `model.tokenizer_vocab` said otherwise)."""
    return ((saved.get("model") or {}).get("overrides") or {}).get("softmax_rows")


def init_section(saved: dict[str, Any]) -> InitSection:
    """The `init` section of a config stored in a checkpoint (the defaults if it has none):
    a resumed run keeps recording where it started from."""
    return build_section(InitSection, saved.get("init") or {}, "init.")


def _deep_copy(d: Any) -> Any:
    if isinstance(d, dict):
        return {k: _deep_copy(v) for k, v in d.items()}
    if isinstance(d, list):
        return [_deep_copy(v) for v in d]
    return d
