"""Impossible combinations of a run config's values, refused with one line each (`validate`,
called on every config loaded): values each of the right type can still contradict each other.
"""

from __future__ import annotations

from collections.abc import Callable

from relaytrain.config.sections import EVAL_SET_NAME, ParallelSection, RunConfig, model_fields
from relaytrain.data.eval_sets import OWN_EVAL_SET
from relaytrain.errors import ConfigError
from relaytrain.model.config import PRESETS, Olmo3Config
from relaytrain.model.stages import check_layout
from relaytrain.parallel.context import split_problem
from relaytrain.parallel.pipeline.schedules import FLUSH_SCHEDULES, asynchronous
from relaytrain.storage import redact, scheme


def validate(cfg: RunConfig) -> None:
    """Reject impossible combinations, one clear line each."""

    def need(cond: bool, msg: str) -> None:
        if not cond:
            raise ConfigError(msg)

    need(cfg.model.preset in PRESETS, f"config key 'model.preset': got {cfg.model.preset!r}, "
         f"expected one of {', '.join(sorted(PRESETS))}")
    unknown = set(cfg.model.overrides) - model_fields()
    need(not unknown, f"unknown config key 'model.{sorted(unknown)[0] if unknown else ''}'; "
         f"architecture keys: {', '.join(sorted(model_fields()))}")
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
    _validate_packing(cfg, need)
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
    _validate_context(cfg, need)
    need(cfg.micro_batches % cfg.data_parallel == 0,
         f"config key 'parallel.dp': got dp {p.dp} x fsdp {p.fsdp}, but the "
         f"{cfg.micro_batches} micro-batches of a global batch (train.global_batch / "
         "train.micro_batch) must split evenly over the dp x fsdp data-parallel ranks")
    check_layout(m.n_layers, p.pp, p.stage_layers)
    _validate_virtual_stages(cfg, m.n_layers, need)
    _validate_paci(cfg, need)
    need(cfg.world_size == 1 or cfg.runtime.engine == "ray",
         f"config key 'runtime.engine': got 'inline', but parallel.dp x fsdp x cp x pp = "
         f"{cfg.world_size} workers need runtime.engine=ray")
    need(cfg.runtime.address is None or cfg.runtime.engine == "ray",
         "config key 'runtime.address' is set, which needs runtime.engine=ray")
    need(cfg.runtime.threads_per_worker >= 1, "config key 'runtime.threads_per_worker': "
         f"got {cfg.runtime.threads_per_worker}, expected >= 1")
    need(cfg.elastic.min_workers >= 1, "config key 'elastic.min_workers': got "
         f"{cfg.elastic.min_workers}, expected >= 1")
    need(cfg.eval.instances >= 1, f"config key 'eval.instances': got {cfg.eval.instances}, "
         "expected >= 1")
    # one section each
    for part in (_validate_optim, _validate_eval_sets, _validate_faults, _validate_init,
                 _validate_checkpoint, _validate_timeouts):
        part(cfg, need)


def _validate_timeouts(cfg: RunConfig, need: Callable[[bool, str], None]) -> None:
    for key in ("call_timeout", "collective_timeout", "setup_timeout"):
        seconds = getattr(cfg.runtime, key)
        need(seconds > 0, f"config key 'runtime.{key}': got {seconds}, expected seconds > 0")
    need(cfg.elastic.replace_timeout >= 0, "config key 'elastic.replace_timeout': got "
         f"{cfg.elastic.replace_timeout}, expected seconds >= 0 (0: no wait for a replacement)")


def _validate_paci(cfg: RunConfig, need: Callable[[bool, str], None]) -> None:
    p = cfg.parallel
    need(p.paci.a >= 1, f"config key 'parallel.paci.a': got {p.paci.a}, expected >= 1")
    need(not p.paci.predict or (p.schedule == "paci" and p.paci.mode == "perf"
                                and not p.paci.flush),
         "config key 'parallel.paci.predict': got true with schedule "
         f"'{p.schedule}', parallel.paci.mode={p.paci.mode} and parallel.paci.flush="
         f"{str(p.paci.flush).lower()}; it takes schedule 'paci', mode perf, flush false "
         "(the only setting whose forwards run on weights an update behind)")
    need(not p.paci.predict or (cfg.model.checkpointing == "none"
                                and cfg.model.compile != "blocks"),
         "config key 'parallel.paci.predict': got true with model.checkpointing="
         f"{cfg.model.checkpointing} and model.compile={cfg.model.compile}; it takes "
         "checkpointing none and compile none (or auto on the CPU: a recompute or a "
         "compiled block would not form the prediction)")
    need(not p.paci.split or (p.schedule == "paci" and p.paci.mode == "perf"),
         "config key 'parallel.paci.split': got true with schedule "
         f"'{p.schedule}' and parallel.paci.mode={p.paci.mode}; it takes schedule 'paci' and "
         "mode perf (mem recomputes the whole backward at B: nothing to split)")


def _validate_packing(cfg: RunConfig, need: Callable[[bool, str], None]) -> None:
    d = cfg.data
    need(d.source_group_size >= 1, "config key 'data.source_group_size': got "
         f"{d.source_group_size}, expected >= 1")
    if d.instances != "packed":
        need(d.source_group_size == 1 and d.source_permutation_seed is None,
             "config keys 'data.source_group_size' and 'data.source_permutation_seed' group "
             "and shuffle the files packed instances are packed from; expected "
             "data.instances=packed")
        need(not cfg.model.document_masking, "config key 'model.document_masking': got true, "
             "but concatenated instances keep no document lengths; expected data.instances="
             "packed")
        return
    seq = cfg.seq_len
    need(seq >= 2 and not seq & (seq - 1), f"config key 'data.seq_len': got {seq}, but packed "
         "instances need a power of two (OLMo-core's packer)")


def _validate_virtual_stages(cfg: RunConfig, n_layers: int,
                             need: Callable[[bool, str], None]) -> None:
    """parallel.virtual_stages > 1 is interleaved-1f1b's alone, on a pipeline whose pp x V
    virtual stages each get a layer; the schedule sends micro-batches round in groups of pp."""
    p, V = cfg.parallel, cfg.parallel.virtual_stages
    interleaved = p.schedule == "interleaved-1f1b" and p.pp > 1
    need(V >= 1, f"config key 'parallel.virtual_stages': got {V}, expected >= 1")
    need(V == 1 or interleaved, f"config key 'parallel.virtual_stages': got {V} with "
         f"parallel.schedule={p.schedule} and parallel.pp={p.pp}; expected 1, or "
         "parallel.schedule=interleaved-1f1b with parallel.pp >= 2")
    if not interleaved:
        return
    per_rank = cfg.micro_batches // cfg.data_parallel
    need(per_rank % p.pp == 0, f"config key 'parallel.schedule': got interleaved-1f1b with "
         f"{per_rank} micro-batches per data-parallel rank, expected a multiple of "
         f"parallel.pp={p.pp} (train.global_batch / train.micro_batch / (dp x fsdp))")
    need(p.pp * V <= n_layers, f"config key 'parallel.virtual_stages': got {V}"
         f", but parallel.pp x virtual_stages = {p.pp * V} virtual stages need as many layers "
         f"(model n_layers={n_layers})")
    need(p.stage_layers is None, "config key 'parallel.stage_layers': set with "
         "interleaved-1f1b, whose virtual stages are balanced by cost; expected it unset")


def _validate_context(cfg: RunConfig, need: Callable[[bool, str], None]) -> None:
    p = cfg.parallel
    need(p.cp >= 1, f"config key 'parallel.cp': got {p.cp}, expected >= 1")
    if p.cp == 1:
        return
    need(p.pp == 1 or not asynchronous(p.schedule), f"config key 'parallel.cp': got {p.cp} "
         f"with parallel.pp={p.pp} and the asynchronous schedule '{p.schedule}', whose stages "
         "run micro-batches out of step; context parallelism needs a flush schedule "
         f"({', '.join(FLUSH_SCHEDULES)}) or parallel.cp=1")
    problem = split_problem(cfg.seq_len, p.cp)
    need(problem is None, f"config key 'data.seq_len': {problem}")


def _validate_seeds(cfg: RunConfig, need: Callable[[bool, str], None]) -> None:
    need(cfg.seed >= 0, f"config key 'seed': got {cfg.seed}, expected an integer >= 0")
    need(cfg.data_seed >= 0, f"config key 'data.seed': got {cfg.data.seed}, expected an "
         "integer >= 0 (or null: the run's seed)")
    i = cfg.init
    # a continued run takes AdamW's state with the step count (its bias correction is the
    # source's), as OLMo-core's trainer-state loads do
    need(not i.trainer_state or (i.from_ is not None and i.optimizer), "config key "
         "'init.trainer_state': got true with " + ("no init.from" if i.from_ is None else
                                                   "init.optimizer false") +
         "; a run continues another's step count, schedule and data position only from its "
         "checkpoint with its optimizer state: expected init.from set and init.optimizer true")


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
    need(o.t_max is None or o.t_max >= 1, f"config key 'optim.t_max': got {o.t_max}, "
         "expected >= 1 (or null: train.max_steps)")


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
    if p.shards == 1:
        return
    import torch
    from torch.distributed.fsdp import FSDPModule

    from relaytrain.parallel.shards import VECTOR_VALUES, misaligned, parameter_shapes

    # the key that shards: fsdp, or at fsdp 1 shard_over_cp (over the cp workers alone)
    key, got, off = (("fsdp", p.fsdp, "fsdp 1") if p.fsdp > 1
                     else ("shard_over_cp", "true", "shard_over_cp false"))
    # exact mode's integer reduce-scatter plugs into FSDP2's custom-comm hook (torch 2.9)
    need(hasattr(FSDPModule, "set_custom_reduce_scatter"), f"config key 'parallel.{key}': got "
         f"{got} with determinism=exact, which needs torch >= 2.9 (FSDP2's custom "
         f"reduce-scatter); this is torch {torch.__version__}: use determinism=fast or {off}")
    shapes = parameter_shapes(m)  # imports torch: only for a sharded exact run
    bad = misaligned(shapes, p.shards)  # cp ranks shard too (parallel/groups.py)
    good = ([k for k in range(1, max(8, p.fsdp) + 1) if not misaligned(shapes, k * p.cp)]
            if p.fsdp > 1 else "false")
    over = f" (over fsdp x parallel.cp={p.cp} = {p.shards} shards)" if p.cp > 1 else ""
    need(bad is None, f"config key 'parallel.{key}': got {got} with determinism=exact, but "
         f"parameter {bad and bad[0]!r} would be cut{over} into chunks of {bad and bad[1]} values, "
         f"not whole vectors of {VECTOR_VALUES} (the CPU optimizer's), so the bits would "
         f"depend on the layout; expected {'one of ' if p.fsdp > 1 else ''}{good} "
         "(or determinism=fast)")


def _validate_init(cfg: RunConfig, need: Callable[[bool, str], None]) -> None:
    """What the keys say; whether the source is there and fits is the controller's
    (train/init_from.py `resolve`, before it writes anything)."""
    init = cfg.init
    need(init.from_ != "", "config key 'init.from' is empty; give a checkpoint's path or URL, "
         "or leave it out")
    need(not init.optimizer or init.from_ is not None, "config key 'init.optimizer': got true "
         "without init.from; name the checkpoint whose optimizer state to load")


def _validate_checkpoint(cfg: RunConfig, need: Callable[[bool, str], None]) -> None:
    need(cfg.checkpoint.keep_last >= 1, "config key 'checkpoint.keep_last': got "
         f"{cfg.checkpoint.keep_last}, expected >= 1")
    unsaved, every = cfg.max_unsaved_steps, cfg.checkpoint.every
    need(unsaved == 0 or unsaved >= every, "config key 'checkpoint.max_unsaved_steps': got "
         f"{unsaved}, expected 0 (never stop), null (4 x checkpoint.every) or at least "
         f"checkpoint.every ({every})")
    need(cfg.checkpoint.preempt_grace > 0, "config key 'checkpoint.preempt_grace': got "
         f"{cfg.checkpoint.preempt_grace}, expected seconds > 0")


def _validate_faults(cfg: RunConfig, need: Callable[[bool, str], None]) -> None:
    f = cfg.faults
    for key in ("kill_at", "hang_at", "slow_at", "fail_checkpoint_at", "raise_at",
                "storage_outage_at", "disk_full_at"):
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
    for key, instead in (("storage_outage_at", "make an object store unavailable from "
                          "outside (stop or pause its server)"),
                         ("disk_full_at", "use a local checkpoint root")):
        need(not getattr(f, key) or scheme(url) == "file", f"config key 'faults.{key}' works "
             "on a local checkpoint root (a path or file://), but checkpoint.url is "
             f"{redact(url)!r}; {instead}")
