"""Typed run configuration: YAML files plus dotted `key=value` overrides.

Every section is a dataclass; loading walks the annotations, so an unknown key, a value of the
wrong type or an impossible combination is rejected with one line naming the key, what was
given and what is accepted.

One file past ~550 lines on purpose: the sections, their loading and their checks are one
contract (the keys a user may write, and which may change on resume); each check reads the
sections' fields by name, so apart they would be two halves of one list.
"""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from relaytrain.checkpoint.store import run_checkpoint_url
from relaytrain.data.eval_sets import OWN_EVAL_SET
from relaytrain.errors import ConfigError
from relaytrain.model.config import PRESETS, Olmo3Config
from relaytrain.model.stages import check_layout
from relaytrain.parallel.pipeline.schedules import FLUSH_SCHEDULES, ScheduleName, asynchronous
from relaytrain.storage import redact, scheme


@dataclass
class ModelSection:
    preset: str = "tiny"
    # Any Olmo3Config field may be overridden, e.g. model.n_layers=3.
    overrides: dict[str, Any] = field(default_factory=dict)
    # How the model executes (never its math or names; `Olmo3.configure`, `train.execution`):
    # sliding layers' kernel: flex (FlexAttention block mask) on CUDA under auto, chunks on CPU
    attention: Literal["auto", "sdpa", "chunks", "flex"] = "auto"
    checkpointing: Literal["none", "selective", "full"] = "none"  # activation recompute
    compile: Literal["auto", "blocks", "none"] = "auto"  # auto: blocks on CUDA, none on CPU
    # GEMMs of the linear layers and LM head: auto = the faster measured on this CPU, else aten
    matmul: Literal["auto", "aten", "onednn"] = "auto"
    # RMSNorm, SwiGLU, RoPE, softmax: auto = fused CPU kernels where built (model.cpu_kernels)
    kernels: Literal["auto", "torch", "fused"] = "auto"


@dataclass
class DataSection:
    path: str | None = None  # a directory written by `relaytrain data prepare` or `data index`
    seq_len: int | None = None  # None: the model preset's max_seq_len
    prefetch: int = 2  # global batches read ahead by the loader thread
    # relay: relaytrain's order (order.py); olmo-core: OLMo-core's order and DP slicing on an
    # indexed OLMo-core mix (olmo_order.py), instances of seq_len tokens cut per file
    order: Literal["relay", "olmo-core"] = "relay"
    # The data order's seed, apart from `seed` (initialisation), so a run can take another
    # run's order (AI2's 34521, say) with its own weights; None: `seed`.
    seed: int | None = None


@dataclass
class TrainSection:
    max_steps: int = 100
    global_batch: int = 8  # sequences per optimizer step
    micro_batch: int = 2  # sequences per forward/backward
    z_loss: float = 1e-5
    clip: float = 1.0  # global gradient-norm clip; 0 disables
    device: Literal["auto", "cpu", "cuda"] = "auto"
    spike_factor: float = 3.0  # a loss this many times the running mean is reported
    log_every: int = 1


@dataclass
class OptimSection:
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.1
    decay_embeddings: bool = False
    warmup: int = 10  # steps of linear warm-up
    final_lr_frac: float = 0.1  # cosine decays to lr * final_lr_frac at max_steps
    # OLMo-core's SkipStepAdamW (train/skip_step.py): skip a step whose loss or gradient norm
    # is over skip_sigma standard deviations above the mean of the last skip_window steps'
    skip_spikes: bool = False
    skip_window: int = 128
    skip_sigma: float = 6.0


EVAL_SET_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]*")


@dataclass
class EvalSection:
    every: int = 50  # 0 disables held-out evaluation
    instances: int = 32  # fixed held-out instances evaluated each time
    memo_gap: float = 0.5  # alarm when held-out loss exceeds training loss by this (nats)
    memo_patience: int = 3  # alarm when held-out rises while training falls this many evals
    stop_on_alarm: bool = False
    # name -> data directory whose held-out split is evaluated too (data/eval_sets.py)
    sets: dict[str, str] = field(default_factory=dict)


@dataclass
class CheckpointSection:
    every: int = 50  # 0 disables periodic checkpoints (a final one is still written)
    url: str | None = None  # any fsspec URL; None: RUN_DIR/checkpoints
    keep_last: int = 3
    async_write: bool = True
    # When every checkpoint of the run directory fails verification the run stops (exit 2)
    # rather than silently spend its compute again; true trains again from step 0.
    start_over: bool = False


@dataclass
class PaciSection:
    a: int = 1  # local backward passes per stage update
    in_flight: int | None = None  # None: S - i at stage i
    mode: Literal["perf", "mem"] = "perf"
    flush: bool = False  # flush at every global batch (reproduces 1f1b; for tests)


@dataclass
class ParallelSection:
    dp: int = 1  # replicas
    # Workers each replica's parameters, gradients and optimizer state are sharded over
    # (FSDP2, ZeRO-3; parallel/fsdp.py). 1: every worker holds the whole model.
    fsdp: int = 1
    # dtype FSDP2 gathers parameters in and computes with (sharded state and gradient
    # reductions stay fp32); auto: bf16 on CUDA in fast mode (Olmo 3's recipe), else fp32
    fsdp_param_dtype: Literal["auto", "bf16", "fp32"] = "auto"
    pp: int = 1
    schedule: ScheduleName = "1f1b"
    stage_layers: list[int] | None = None  # layers per stage; None: balanced by cost
    # Steps per dispatch for asynchronous schedules. The pipeline drains at each end (a consistent
    # cut), which costs about (S-1)/(span x micro-batches) of the time, and a failure loses the
    # span in flight: 32 keeps the drain under 3% at S = 8 with 8 micro-batches per step.
    span: int = 32
    paci: PaciSection = field(default_factory=PaciSection)


@dataclass
class RuntimeSection:
    engine: Literal["inline", "ray"] = "inline"
    address: str | None = None  # Ray cluster address; None: a private local cluster
    threads_per_worker: int = 1  # torch threads in each worker (same count => same kernels)
    cpus_per_worker: float = 1.0  # Ray CPU share reserved per worker
    call_timeout: float = 120.0  # seconds any remote call (per step) may take: hang detection
    # Process-group timeout inside the workers: the last resort for a hang nothing else sees.
    # No survivor of a known failure waits for it: the controller aborts its collectives at
    # once (runtime/abort.py), so keep it long enough for a slow step or a long all-gather.
    collective_timeout: float = 30.0
    setup_timeout: float = 120.0


@dataclass
class ElasticSection:
    replace_timeout: float = 30.0
    min_workers: int = 1
    max_recoveries: int = 10
    recovery_window: float = 3600.0  # seconds over which max_recoveries counts
    snapshot_every: int = 1  # steps between in-memory snapshots (workers with a DP peer)
    spares: int = 0  # warm standby workers (Ray): a replacement is then a promotion, not a start
    # An idle worker process started ahead (Ray, CPU runs, no spares), holding no CPU or GPU:
    # a replacement becomes it instead of waiting seconds for Python and torch to start.
    standby: bool = True


@dataclass
class FaultsSection:
    kill_at: list[int] = field(default_factory=list)  # steps at which a worker is SIGKILLed
    kill_rank: int | None = None  # None: a random rank (from the seed)
    hang_at: list[int] = field(default_factory=list)  # steps at which a worker is SIGSTOPped
    hang_rank: int | None = None
    slow_at: list[int] = field(default_factory=list)
    slow_seconds: float = 1.0
    fail_checkpoint_at: list[int] = field(default_factory=list)
    raise_at: list[int] = field(default_factory=list)  # steps at which a worker raises
    raise_rank: int | None = None
    # steps at which the (local) checkpoint storage becomes unavailable, for this long
    storage_outage_at: list[int] = field(default_factory=list)
    storage_outage_seconds: float = 2.0
    random_kills: int = 0  # that many kills at random steps (from the seed)
    random_hangs: int = 0
    hold_capacity_s: float = 0.0  # after a failure, keep its slot occupied this long


@dataclass
class LogSection:
    progress: bool = True
    tensorboard: bool = False


@dataclass
class InitSection:
    # A new run's weights (and with `optimizer` AdamW's moments and step count) from another
    # run: a relaytrain checkpoint (step, root or run directory), an HF Olmo 3 directory or an
    # OLMo-core checkpoint (train/init_from.py). Ignored when the run resumes its own checkpoint.
    from_: str | None = field(default=None, metadata={"key": "from"})
    optimizer: bool = False
    # Recorded by the controller, never given: what was loaded (source, kind, location, step,
    # digest, what was taken); a value given is replaced.
    origin: dict[str, Any] | None = None


@dataclass
class RunConfig:
    run_dir: str = ""
    seed: int = 0
    determinism: Literal["exact", "fast"] = "fast"
    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=DataSection)
    train: TrainSection = field(default_factory=TrainSection)
    optim: OptimSection = field(default_factory=OptimSection)
    eval: EvalSection = field(default_factory=EvalSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    parallel: ParallelSection = field(default_factory=ParallelSection)
    runtime: RuntimeSection = field(default_factory=RuntimeSection)
    elastic: ElasticSection = field(default_factory=ElasticSection)
    faults: FaultsSection = field(default_factory=FaultsSection)
    log: LogSection = field(default_factory=LogSection)
    init: InitSection = field(default_factory=InitSection)

    # ---- derived values -------------------------------------------------------------------
    def model_config(self, tokenizer_vocab: int | None = None) -> Olmo3Config:
        """The architecture: preset, then overrides, then the data's vocabulary if needed."""
        hints = typing.get_type_hints(Olmo3Config)  # a command line's 1e-06 is a string
        overrides = {k: _coerce(f"model.{k}", v, hints[k]) if k in hints else v
                     for k, v in self.model.overrides.items()}
        if "n_layers" in overrides and "layer_types" not in overrides:
            overrides["layer_types"] = ()  # the Olmo 3 pattern for the new depth
        cfg = dataclasses.replace(PRESETS[self.model.preset], **overrides)
        if tokenizer_vocab is not None and cfg.vocab_size is None:
            cfg = cfg.with_vocab(tokenizer_vocab)
        return cfg

    @property
    def seq_len(self) -> int:
        return self.data.seq_len or self.model_config().max_seq_len

    @property
    def data_seed(self) -> int:
        """The seed of the training data order (`data.seed`, else `seed`)."""
        return self.seed if self.data.seed is None else self.data.seed

    @property
    def checkpoint_url(self) -> str:
        return run_checkpoint_url(self.run_dir, self.checkpoint.url)

    @property
    def world_size(self) -> int:
        return self.data_parallel * self.parallel.pp

    @property
    def data_parallel(self) -> int:
        """Ranks that each train on their own part of a global batch: replicas x shards."""
        return self.parallel.dp * self.parallel.fsdp

    @property
    def micro_batches(self) -> int:
        return self.train.global_batch // self.train.micro_batch

    def to_dict(self) -> dict[str, Any]:
        return _to_plain(self)


def _key(f: dataclasses.Field) -> str:
    """A field's config key: its name, or (a Python keyword such as `from`) its metadata's."""
    return f.metadata.get("key", f.name)


def _to_plain(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj):
        return {_key(f): _to_plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, tuple | list):
        return [_to_plain(v) for v in obj]
    if isinstance(obj, dict):
        return {k: _to_plain(v) for k, v in obj.items()}
    return obj


# ---- type checking of values ---------------------------------------------------------------


def _describe(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(a) for a in typing.get_args(tp))
    if origin in (list, tuple):
        args = typing.get_args(tp)
        return f"a list of {_describe(args[0])}" if args else "a list"
    if origin is dict:
        return "a mapping"
    if tp is type(None):
        return "null"
    return getattr(tp, "__name__", str(tp))


def _coerce(key: str, value: Any, tp: Any) -> Any:
    """`value` as type `tp`, or a ConfigError naming `key`."""
    origin = typing.get_origin(tp)
    bad = ConfigError(f"config key '{key}': got {value!r}, expected {_describe(tp)}")
    if origin is Literal:
        if value not in typing.get_args(tp):
            raise bad
        return value
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None:
            if type(None) in args:
                return None
            raise bad
        for a in args:
            if a is type(None):
                continue
            try:
                return _coerce(key, value, a)
            except ConfigError:
                continue
        raise bad
    if origin in (list, tuple):
        if not isinstance(value, list | tuple):
            raise bad
        args = typing.get_args(tp)
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(value) != len(args):
                raise bad
            return tuple(_coerce(key, v, a) for v, a in zip(value, args, strict=True))
        return [_coerce(key, v, args[0]) for v in value] if args else list(value)
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            raise bad
        return dict(value)
    if tp is bool:
        if not isinstance(value, bool):
            raise bad
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise bad
        return value
    if tp is float:
        if isinstance(value, str):  # YAML 1.1 reads 1e-3 (no dot) as a string
            try:
                return float(value)
            except ValueError:
                raise bad from None
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise bad
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise bad
        return value
    if tp is Any:
        return value
    raise bad


def _build(cls: type, data: dict[str, Any], prefix: str) -> Any:
    if not isinstance(data, dict):
        raise ConfigError(f"config key '{prefix.rstrip('.') or '<root>'}': got {data!r}, "
                          "expected a mapping")
    hints = typing.get_type_hints(cls)
    fields = {_key(f): f.name for f in dataclasses.fields(cls)}
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        if key not in fields:
            raise ConfigError(f"unknown config key '{prefix}{key}'; accepted keys here: "
                              f"{', '.join(sorted(fields))}")
        name = fields[key]
        tp = hints[name]
        if dataclasses.is_dataclass(tp):
            kwargs[name] = _build(tp, value if value is not None else {}, f"{prefix}{key}.")
        else:
            kwargs[name] = _coerce(f"{prefix}{key}", value, tp)
    return cls(**kwargs)


# ---- loading --------------------------------------------------------------------------------


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


def _model_fields() -> set[str]:
    return {f.name for f in dataclasses.fields(Olmo3Config)}


def _apply_override(tree: dict[str, Any], path: list[str], value: Any) -> None:
    # model.<architecture field> goes to model.overrides so presets stay whole.
    if path[0] == "model" and len(path) == 2 and path[1] in _model_fields():
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
    cfg = _build(RunConfig, tree, "")
    validate(cfg)
    return cfg


def config_from_dict(d: dict[str, Any]) -> RunConfig:
    """The inverse of RunConfig.to_dict (used for configs stored in checkpoints)."""
    cfg = _build(RunConfig, _deep_copy(d), "")
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
    old, new = (_settled(flatten(c)) for c in (saved, cfg.to_dict()))
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
    `seed`, so either resumes as the same data order."""
    if flat.get("data.seed") is None:
        flat["data.seed"] = flat.get("seed")
    return flat


def init_section(saved: dict[str, Any]) -> InitSection:
    """The `init` section of a config stored in a checkpoint (the defaults if it has none):
    a resumed run keeps recording where it started from."""
    return _build(InitSection, saved.get("init") or {}, "init.")


def _deep_copy(d: Any) -> Any:
    if isinstance(d, dict):
        return {k: _deep_copy(v) for k, v in d.items()}
    if isinstance(d, list):
        return [_deep_copy(v) for v in d]
    return d


def validate(cfg: RunConfig) -> None:
    """Reject impossible combinations, one clear line each."""

    def need(cond: bool, msg: str) -> None:
        if not cond:
            raise ConfigError(msg)

    need(cfg.model.preset in PRESETS, f"config key 'model.preset': got {cfg.model.preset!r}, "
         f"expected one of {', '.join(sorted(PRESETS))}")
    unknown = set(cfg.model.overrides) - _model_fields()
    need(not unknown, f"unknown config key 'model.{sorted(unknown)[0] if unknown else ''}'; "
         f"architecture keys: {', '.join(sorted(_model_fields()))}")
    try:
        m = cfg.model_config()
    except TypeError as e:
        raise ConfigError(f"config key 'model.overrides': {e}") from None
    need(m.n_heads % m.n_kv_heads == 0, f"config key 'model.n_kv_heads': {m.n_kv_heads} must "
         f"divide model.n_heads={m.n_heads}")
    need(len(m.layer_types) == m.n_layers and set(m.layer_types) <= {"sliding_attention",
         "full_attention"}, "config key 'model.layer_types': expected n_layers entries of "
         "'sliding_attention' | 'full_attention'")
    need(cfg.model.attention != "flex" or cfg.train.device != "cpu",
         "config key 'model.attention': got 'flex' with train.device=cpu, but FlexAttention "
         "has no CPU backward; expected auto, sdpa or chunks on the CPU (flex needs CUDA)")
    for key, cpu_only, other in (("matmul", "onednn", "aten"), ("kernels", "fused", "torch")):
        need(getattr(cfg.model, key) != cpu_only or cfg.train.device != "cuda",
             f"config key 'model.{key}': got '{cpu_only}' with train.device=cuda, but that is a "
             f"CPU path; expected auto or {other} on a GPU")
    if cfg.model.matmul == "onednn":
        from relaytrain.model.matmul import onednn_available  # imports torch: only when asked

        need(onednn_available(), "config key 'model.matmul': got 'onednn', but this torch "
             "build has no oneDNN (mkldnn) kernels; expected auto or aten")
    _validate_seeds(cfg, need)
    t = cfg.train
    need(t.max_steps >= 1, f"config key 'train.max_steps': got {t.max_steps}, expected >= 1")
    need(t.micro_batch >= 1, f"config key 'train.micro_batch': got {t.micro_batch}, "
         "expected >= 1")
    need(t.global_batch >= t.micro_batch and t.global_batch % t.micro_batch == 0,
         f"config key 'train.global_batch': got {t.global_batch}, expected a multiple of "
         f"train.micro_batch={t.micro_batch}")
    seq = cfg.seq_len
    need(seq >= 2, f"config key 'data.seq_len': got {seq}, expected >= 2")
    need(seq <= m.max_seq_len or m.rope_scaling is not None,
         f"config key 'data.seq_len': got {seq}, expected <= model max_seq_len={m.max_seq_len}")
    p = cfg.parallel
    need(p.dp >= 1, f"config key 'parallel.dp': got {p.dp}, expected >= 1")
    need(p.pp >= 1, f"config key 'parallel.pp': got {p.pp}, expected >= 1")
    need(p.fsdp >= 1, f"config key 'parallel.fsdp': got {p.fsdp}, expected >= 1")
    need(p.fsdp == 1 or p.pp == 1 or not asynchronous(p.schedule), f"config key "
         f"'parallel.fsdp': got {p.fsdp} with parallel.pp={p.pp} and the asynchronous "
         f"schedule '{p.schedule}'; sharded stages run the flush schedules "
         f"({', '.join(FLUSH_SCHEDULES)}), or use parallel.fsdp=1")
    if cfg.determinism == "exact":
        _validate_exact_sharding(p, m, need)
    need(cfg.micro_batches % cfg.data_parallel == 0,
         f"config key 'parallel.dp': got dp {p.dp} x fsdp {p.fsdp}, but the "
         f"{cfg.micro_batches} micro-batches of a global batch (train.global_batch / "
         "train.micro_batch) must split evenly over the dp x fsdp data-parallel ranks")
    check_layout(m.n_layers, p.pp, p.stage_layers)
    need(p.paci.a >= 1, f"config key 'parallel.paci.a': got {p.paci.a}, expected >= 1")
    need(cfg.world_size == 1 or cfg.runtime.engine == "ray",
         f"config key 'runtime.engine': got 'inline', but parallel.dp x fsdp x pp = "
         f"{cfg.world_size} workers need runtime.engine=ray")
    need(cfg.runtime.address is None or cfg.runtime.engine == "ray",
         "config key 'runtime.address' is set, which needs runtime.engine=ray")
    need(cfg.runtime.threads_per_worker >= 1, "config key 'runtime.threads_per_worker': "
         f"got {cfg.runtime.threads_per_worker}, expected >= 1")
    need(cfg.checkpoint.keep_last >= 1, "config key 'checkpoint.keep_last': got "
         f"{cfg.checkpoint.keep_last}, expected >= 1")
    need(cfg.elastic.min_workers >= 1, "config key 'elastic.min_workers': got "
         f"{cfg.elastic.min_workers}, expected >= 1")
    need(cfg.eval.instances >= 1, f"config key 'eval.instances': got {cfg.eval.instances}, "
         "expected >= 1")
    # one section each
    for part in (_validate_optim, _validate_eval_sets, _validate_faults, _validate_init):
        part(cfg, need)


def _validate_seeds(cfg: RunConfig, need: Callable[[bool, str], None]) -> None:
    need(cfg.seed >= 0, f"config key 'seed': got {cfg.seed}, expected an integer >= 0")
    need(cfg.data_seed >= 0, f"config key 'data.seed': got {cfg.data.seed}, expected an "
         "integer >= 0 (or null: the run's seed)")


def _validate_optim(cfg: RunConfig, need: Callable[[bool, str], None]) -> None:
    o = cfg.optim
    need(o.warmup >= 0, f"config key 'optim.warmup': got {o.warmup}, expected >= 0")
    need(0 <= o.final_lr_frac <= 1, "config key 'optim.final_lr_frac': got "
         f"{o.final_lr_frac}, expected between 0 and 1")
    need(o.skip_window >= 6, f"config key 'optim.skip_window': got {o.skip_window}, expected "
         ">= 6 (the rule starts at window // 2 steps and needs two earlier ones for a standard "
         "deviation)")
    need(o.skip_sigma > 0, f"config key 'optim.skip_sigma': got {o.skip_sigma}, expected > 0")
    p = cfg.parallel
    # one update per global batch on every stage, after the global norm's pipeline barrier
    per_batch = p.paci.flush and p.paci.a >= cfg.micro_batches // cfg.data_parallel
    need(not o.skip_spikes or p.pp == 1 or not asynchronous(p.schedule)
         or (p.schedule == "paci" and per_batch), "config key 'optim.skip_spikes': got true "
         f"with parallel.pp={p.pp} and schedule '{p.schedule}' (parallel.paci.flush="
         f"{str(p.paci.flush).lower()}, parallel.paci.a={p.paci.a}), whose stages do not "
         "update once per global batch together; expected a flush schedule "
         f"({', '.join(FLUSH_SCHEDULES)}, or paci with parallel.paci.flush=true and "
         "parallel.paci.a >= the micro-batches per DP rank), parallel.pp=1 or "
         "optim.skip_spikes=false")


def _validate_eval_sets(cfg: RunConfig, need: Callable[[bool, str], None]) -> None:
    for name, path in cfg.eval.sets.items():
        need(isinstance(name, str) and EVAL_SET_NAME.fullmatch(name) is not None
             and name != OWN_EVAL_SET, f"config key 'eval.sets': set name {name!r} must be "
             f"letters, digits, '_' or '-' (and not '{OWN_EVAL_SET}', the run's own "
             "held-out split)")
        need(isinstance(path, str) and bool(path), f"config key 'eval.sets.{name}': got "
             f"{path!r}, expected the path of a data directory (from `data prepare` or "
             "`data index`)")


def _validate_exact_sharding(p: ParallelSection, m: Olmo3Config,
                             need: Callable[[bool, str], None]) -> None:
    """Exact mode's bits hold only with fp32 gathers (the unsharded run's weights) and for
    shardings whose chunks are whole CPU vectors."""
    need(p.fsdp_param_dtype != "bf16", "config key 'parallel.fsdp_param_dtype': got 'bf16' "
         "with determinism=exact, whose bits are the unsharded run's (fp32 weights under "
         "autocast); expected auto or fp32 (or determinism=fast)")
    if p.fsdp == 1:
        return
    import torch
    from torch.distributed.fsdp import FSDPModule

    from relaytrain.parallel.shards import VECTOR_VALUES, misaligned, parameter_shapes

    fsdp = p.fsdp
    # exact mode's integer reduce-scatter plugs into FSDP2's custom-comm hook (torch 2.9)
    need(hasattr(FSDPModule, "set_custom_reduce_scatter"), "config key 'parallel.fsdp': got "
         f"{fsdp} with determinism=exact, which needs torch >= 2.9 (FSDP2's custom "
         f"reduce-scatter); this is torch {torch.__version__}: use determinism=fast or fsdp 1")
    shapes = parameter_shapes(m)  # imports torch: only for a sharded exact run
    bad = misaligned(shapes, fsdp)
    good = [k for k in range(1, max(8, fsdp) + 1) if not misaligned(shapes, k)]
    need(bad is None, f"config key 'parallel.fsdp': got {fsdp} with determinism=exact, but "
         f"parameter {bad and bad[0]!r} would be cut into chunks of {bad and bad[1]} values, "
         f"not whole vectors of {VECTOR_VALUES} (the CPU optimizer's), so the bits would "
         f"depend on the layout; expected one of {good} (or determinism=fast)")


def _validate_init(cfg: RunConfig, need: Callable[[bool, str], None]) -> None:
    """What the keys say; whether the source is there and fits is the controller's
    (train/init_from.py `resolve`, before it writes anything)."""
    init = cfg.init
    need(init.from_ != "", "config key 'init.from' is empty; give a checkpoint's path or URL, "
         "or leave it out")
    need(not init.optimizer or init.from_ is not None, "config key 'init.optimizer': got true "
         "without init.from; name the checkpoint whose optimizer state to load")


def _validate_faults(cfg: RunConfig, need: Callable[[bool, str], None]) -> None:
    f = cfg.faults
    for key in ("kill_at", "hang_at", "slow_at", "fail_checkpoint_at", "raise_at",
                "storage_outage_at"):
        steps = getattr(f, key)
        need(all(s >= 1 for s in steps), f"config key 'faults.{key}': got {steps}, expected "
             "optimizer steps >= 1")
    for key in ("kill_rank", "hang_rank", "raise_rank"):
        rank = getattr(f, key)
        need(rank is None or 0 <= rank < cfg.world_size, f"config key 'faults.{key}': got "
             f"{rank}, expected null (a random rank) or 0 .. {cfg.world_size - 1}")
    need(not f.raise_at or cfg.runtime.engine == "ray", "config key 'faults.raise_at' needs "
         "runtime.engine=ray: the inline engine cannot replace its only worker")
    need(f.storage_outage_seconds > 0, "config key 'faults.storage_outage_seconds': got "
         f"{f.storage_outage_seconds}, expected > 0")
    url = cfg.checkpoint_url
    need(not f.storage_outage_at or scheme(url) == "file", "config key "
         "'faults.storage_outage_at' works on a local checkpoint root (a path or file://), but "
         f"checkpoint.url is {redact(url)!r}; make an object store unavailable from outside "
         "(stop or pause its server)")
