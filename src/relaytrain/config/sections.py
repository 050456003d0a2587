"""The run config's typed sections (`RunConfig` and one dataclass a section) and how a raw value
from YAML or a `key=value` override becomes a typed one: each value checked against its field's
annotation, one line naming the key, what was given and what is accepted.
"""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Literal

from relaytrain.checkpoint.store import run_checkpoint_url
from relaytrain.errors import ConfigError
from relaytrain.model.config import PRESETS, Olmo3Config
from relaytrain.parallel.groups import replica_shards
from relaytrain.parallel.pipeline.schedules import ScheduleName


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
    # Attention only within a document, RoPE positions from each document's start (OLMo-core's
    # intra-document masking); None: on for packed instances (data.instances), which it needs
    document_masking: bool | None = None
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
    # concatenated: instances cut from the token stream; packed: whole documents packed into
    # seq_len tokens as OLMo-core's NumpyPackedFSLDataset packs them (data/packing.py), files
    # shuffled by source_permutation_seed and packed source_group_size at a time
    instances: Literal["concatenated", "packed"] = "concatenated"
    source_group_size: int = 1
    source_permutation_seed: int | None = None


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
    # After the warm-up, OLMo-core's CosWithWarmup (cosine), LinearWithWarmup (linear) or
    # HalfCosWithWarmup (half-cosine: the second half of a cosine from lr, after a warm-up to
    # its midpoint; what a run extended half-way through its cosine continues on)
    schedule: Literal["cosine", "linear", "half-cosine"] = "cosine"
    final_lr_frac: float = 0.1  # the schedule ends at lr * final_lr_frac (OLMo-core's alpha_f)
    # Step the schedule reaches its floor at (OLMo-core's t_max); None: train.max_steps. A run
    # stopped early (OLMo-core's hard_stop) keeps the horizon of its planned length.
    t_max: int | None = None
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
    # Steps trained since the newest committed checkpoint past which the run stops (exit 3)
    # after one last save attempt; 0: never stop. None: 4 x `every` (0 when `every` is 0).
    max_unsaved_steps: int | None = None
    # Seconds from SIGTERM/SIGINT to the controller until its last save must be committed
    # (runtime/preemption.py): under the shortest usual notice (30 s: GCP and Azure spot,
    # Kubernetes' default grace); raise it to use a longer one (AWS spot 120 s, SLURM --signal).
    preempt_grace: float = 25.0


@dataclass
class PaciSection:
    a: int = 1  # local backward passes per stage update
    in_flight: int | None = None  # None: S - i at stage i
    mode: Literal["perf", "mem"] = "perf"
    flush: bool = False  # flush at every global batch (reproduces 1f1b; for tests)
    # forward a micro-batch that will cross t updates before its backward on the stage's
    # weights predicted t updates ahead, w + t x its last update (mode perf, no flush)
    predict: bool = False
    # each backward's weight gradient (W) right after its input gradient (B), the latter sent
    # first: hides the stage-to-stage transfers (schedules.build_schedule); the same bits
    split: bool = False


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
    # Workers each instance's sequence is split over (context parallelism, parallel/context.py;
    # world = dp x fsdp x cp x pp). 1: every worker holds whole sequences.
    cp: int = 1
    # Shard a replica's state over its cp workers at fsdp 1 too (they hold the same weights;
    # fsdp > 1 always shards over fsdp x cp): OLMo-core's hsdp with shard_degree=1 and cp > 1
    shard_over_cp: bool = False
    schedule: ScheduleName = "1f1b"
    stage_layers: list[int] | None = None  # layers per stage; None: balanced by cost
    # Model chunks per pipeline rank (interleaved-1f1b only): the model is cut into pp x V
    # virtual stages, balanced by cost; rank i holds virtual stages i, i + pp, ...
    virtual_stages: int = 1
    # Steps per dispatch for asynchronous schedules. The pipeline drains at each end (a consistent
    # cut), which costs about (S-1)/(span x micro-batches) of the time, and a failure loses the
    # span in flight: 32 keeps the drain under 3% at S = 8 with 8 micro-batches per step.
    span: int = 32
    paci: PaciSection = field(default_factory=PaciSection)

    @property
    def shards(self) -> int:
        """Workers a replica's state is sharded over (parallel/groups.py `replica_shards`)."""
        return replica_shards(self.fsdp, self.cp, self.shard_over_cp)


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
    # Dispatch the next step before this one's results are checked and recorded (except at a
    # checkpoint, evaluation or resize): workers do not wait for the controller between steps
    dispatch_ahead: bool = True


@dataclass
class ElasticSection:
    # how long after a failure the run keeps trying to grow back (replacements starting in the
    # background) while it goes on with fewer workers; where no smaller layout exists (a
    # pipeline's stage, context parallelism, elastic.min_workers), how long it waits for them.
    # Ten minutes: a cloud's replacement node, a GPU worker's CUDA and NCCL set-up and its first
    # compile take minutes, and a run that stopped trying trains short of its size to the end
    replace_timeout: float = 600.0
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
    # steps from which the (local) checkpoint storage is full: writes fail with ENOSPC until
    # files are deleted (by retention) or `checkpoint.url` + ".full" is removed
    disk_full_at: list[int] = field(default_factory=list)
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
    # Continue the source rather than start anew (OLMo-core's load_trainer_state): the run
    # starts at the source's step, its schedule there, its data where the source's stopped
    # (data/position.py); needs `optimizer`.
    trainer_state: bool = False
    # Recorded by the controller, never given: what was loaded (source, kind, location, step,
    # digest, what was taken, the trainer state carried); a value given is replaced.
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
        overrides = {k: coerce(f"model.{k}", v, hints[k]) if k in hints else v
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
    def document_masking(self) -> bool:
        """Whether attention stays within documents (`model.document_masking`, by default on
        exactly for packed instances)."""
        dm = self.model.document_masking
        return self.data.instances == "packed" if dm is None else dm

    @property
    def packing(self) -> dict[str, int | None] | None:
        """How packed instances are packed (`data.packing.train_split`); None: concatenated."""
        d = self.data
        return None if d.instances != "packed" else {"group": d.source_group_size,
                                                      "seed": d.source_permutation_seed}

    @property
    def data_seed(self) -> int:
        """The seed of the training data order (`data.seed`, else `seed`)."""
        return self.seed if self.data.seed is None else self.data.seed

    @property
    def start_step(self) -> int:
        """The step a new run starts at: 0, or the one its origin's trainer state carries."""
        return int(((self.init.origin or {}).get("trainer") or {}).get("step", 0))

    @property
    def batch_offset(self) -> int:
        """Global batch of step k, minus k - 1: 0, or where the carried data position put the
        run's first step (data/position.py) minus its start step."""
        trainer = (self.init.origin or {}).get("trainer") or {}
        return int(trainer.get("batch", 0)) - int(trainer.get("step", 0))

    @property
    def checkpoint_url(self) -> str:
        return run_checkpoint_url(self.run_dir, self.checkpoint.url)

    @property
    def max_unsaved_steps(self) -> int:
        """`checkpoint.max_unsaved_steps` resolved: 0 never stops."""
        c = self.checkpoint
        return 4 * c.every if c.max_unsaved_steps is None else c.max_unsaved_steps

    @property
    def world_size(self) -> int:
        return self.data_parallel * self.parallel.pp * self.parallel.cp

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


def coerce(key: str, value: Any, tp: Any) -> Any:
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
                return coerce(key, value, a)
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
            return tuple(coerce(key, v, a) for v, a in zip(value, args, strict=True))
        return [coerce(key, v, args[0]) for v in value] if args else list(value)
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


def build_section(cls: type, data: dict[str, Any], prefix: str) -> Any:
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
            kwargs[name] = build_section(tp, value if value is not None else {}, f"{prefix}{key}.")
        else:
            kwargs[name] = coerce(f"{prefix}{key}", value, tp)
    return cls(**kwargs)


def model_fields() -> set[str]:
    return {f.name for f in dataclasses.fields(Olmo3Config)}
