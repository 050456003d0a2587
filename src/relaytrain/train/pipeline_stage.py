"""Executing one stage's action list (schedules.py) with torch.distributed point-to-point ops.

One executor serves every schedule: gpipe, 1f1b, zb-h1, pipedream and paci differ only in their
lists, so the numbers are a pure function of the lists and bit-reproducible whatever the timing.
Sends are
asynchronous (`isend`, waited at the span end: the buffered sends the schedules assume); each
receive is posted one ahead (`irecv`, see `Transport`) so that the transfer overlaps the compute
before it, and the time a stage blocks waiting for one is its bubble.

**Weights in flight (stock PyTorch).** An optimizer step between a micro-batch's F and B updates a
weight that autograd saved at F (e.g. W for the input gradient of x Wᵀ) in place; through the
parameter itself, or through ``p.detach()`` (which shares the parameter's version counter), the
backward then raises "modified by an inplace operation". So every F runs the stage through
``torch.func.functional_call`` on *aliases* ``p.data.requires_grad_()``: leaves that share the
parameter's storage but have a version counter of their own. Updates bump only the parameter's
counter, the check passes, and B reads whatever the storage holds then. Gradients land on the
aliases and are added to ``p.grad`` in list order (as AccumulateGrad would: the first one is taken
as is, later ones added), the same code path for every schedule.

What B then computes depends on the schedule:

- flush schedules: no update between F and B, so the exact gradient.
- zb-h1 and paci with ``split`` (a *split* list, schedules.py): F runs under
  `model.matmul.deferring`, so each linear layer records its input and where its output's
  gradient arrives (the graph is the whole backward's); B (`matmul.deferred_backward`) computes
  the input gradient, the graph forming none of the linear weights' products
  (only the small weight gradients: embedding, norms, the fused LM head's, which its loss forms
  whole anyway), sends it and frees the graph, keeping per linear layer only its input and the
  gradient that reached its output; W forms each weight gradient as gradᵀ @ input
  (`DeferredGrad.weight_grad`, the product autograd would run) and folds them into ``p.grad``
  (and exact mode's integer accumulator) in micro-batch order, as a whole backward would: the
  same bits. A micro-batch awaiting W thus holds less than one awaiting B (the paper's
  accounting), so zb-h1's peak activation memory stays near 1f1b's (bench pipeline; the last
  stage defers one W fewer for it, `schedules.zb_w_delay`).
  Checkpointed blocks and compiled modules are not deferred (their weight gradients come at B).
  A sharded stage runs the whole backward at B (FSDP2's reduce-scatter hooks fire at the end of
  a backward) and W is empty there: correct, with 1f1b's timing.
- paci, ``mode=perf`` (one weight copy): the backward of the F-time graph in which every *saved
  activation* has its F-time value (computed from the input with the weights theta_F in effect at
  F) and every *weight read by the backward* has its B-time value theta_B (the live weights, after
  at most ``staleness_bound`` more updates of this stage). For y = x Wᵀ: dL/dW = gᵀ x_F (weights do
  not enter), dL/dx = g W_B. Weight gradients of a layer thus use F-time activations and the
  incoming gradient, while the gradient sent upstream (and to the stage's earlier layers) passes
  through theta_B. With no update in between this is the exact gradient.
  tests/train/test_pipeline_stage.py checks it against the closed form for the SwiGLU MLP.
- paci, ``mode=mem`` (recompute): F runs without a graph and keeps only the stage input; B reruns
  the forward with the live weights right before the backward, so B is the exact gradient of
  f(x_F; theta_B) at the input F received, against the gradient coming back for the output F sent
  (computed with theta_F). The last stage keeps its graph: its F and B are adjacent (in-flight
  limit 1), so recomputing would only double its work.
- paci with ``predict`` (SpecTrain-style weight prediction, perf mode): a micro-batch that will
  cross t updates of this stage before its B (known from the list, `schedules.staleness`) runs
  its F on the weights predicted t updates ahead, theta_F + t delta, delta the stage's last
  update (theta after minus theta before it; zero at a span's start, so a span stays a pure
  function of the state it starts from and a resumed run the same bits). No predicted copy is
  held: each op forms its weight's prediction just before it runs and the graph saves the live
  alias in its place (`model.prediction`), so B is perf mode's backward of an F-time graph
  whose activations come from the predicted weights: dL/dW = gᵀ x_F, dL/dx = g W_B (the
  prediction's last t updates have all happened by B: none is left to predict). One weight
  version; the largest prediction of one op (an embedding's: its rows) is counted as F's
  transient in ``peak_memory``; delta itself (one parameter-sized buffer, like an optimizer
  moment) is not.
- pipedream (weight stashing): F and B must see the same version. F always uses the live weights;
  before an update the live parameters are moved to fresh storage (``p.data = p.data.clone()``)
  if an in-flight micro-batch still uses them, so its graph keeps the old storage (the stashed
  version, freed with the graph after its B) and the update applies to the copy.

**Sharded stages** (`parallel.fsdp` > 1, flush schedules only): FSDP2's hooks gather a stage's
weights and reduce-scatter its gradients (exact mode: as integers, parallel/fsdp.py), so F calls
the module itself and B runs ``autograd.backward``, the input gradient read from ``x.grad``; no
aliases are needed, since nothing updates the weights between a micro-batch's F and its B. The
global norm takes each whole tensor's norm (gathered over the stage's shard group). Under
interleaved-1f1b each block is a unit of one chunk, reduce-scattered once per micro-batch by
that chunk's B; the root unit (embedding, final norm, head) runs in every chunk's F, but only
the chunk that reads the tokens (embedding) or computes the loss (head) gives it gradients, so
it too reduces once per micro-batch, as each unit's integer accumulator counts on.

**Context parallelism** (`parallel.cp` > 1, flush schedules only: config/checks.py): a stage's
DP rank is cp ranks, each holding its part of every micro-batch's sequences (the zig-zag split,
parallel/context.py). The first stage embeds its part of the tokens; activations and their
gradients travel between the ranks of the same cp rank of neighbouring stages, each sending its
part only (a message is [micro_batch, seq_len / cp, d_model]); each stage's cp group exchanges
keys and values in its attention layers as an unpipelined cp group does, all its ranks running
the same list in step; the last stage scores its part of the labels, its loss weighted by its
share of the scored tokens (`label_share`) and the micro-batch's losses the cp-weighted means
(`sequence_mean`), as `train.step` does. The DP group's reduction covers the stage's dp x cp
ranks (parallel/groups.py), so exact mode's integer sums take every part of every micro-batch:
the same bits as the unpipelined run at the same cp.

**Packed instances** (`data.instances: packed`, any schedule): every stage forms each
micro-batch's inputs, labels and document lengths from its own copy of the batch
(`data.packing.model_inputs`, as `train.step` does; the loader is a pure function of the seed),
so every stage's attention and RoPE positions stay within documents (`model.document_masking`;
with cp, its part carrying its rows' document ids) and the last stage ignores the padding's
labels, with nothing about documents sent down the pipe. A message's length is the inputs'
(packed instances' are seq_len - 1 tokens, seq_len whole under cp).

**Loss scale, learning rate, clipping.** Every update averages its *update group* (the B's since
the previous update, `schedules.update_groups`) over all DP replicas: micro-batch losses are
scaled by 1 / (group size x dp). For the flush schedules a group is a global batch, so this is
train_step's 1 / micro-batches. The update of a group uses ``lr_at`` of the step whose global batch
holds the group's last micro-batch (micro-batch m of a span starting at step s belongs to step
s + m // M). Flush schedules (gpipe, 1f1b, zb-h1 and paci with ``flush``) clip by the global norm,
computed bit for bit as the unpipelined model's ``clip_grad_norm_``: the per-tensor norms of one
DP replica's stages are all-gathered over that replica's pipeline group at every update (a
barrier that cannot deadlock: an update's group is the same at every stage and its dependencies
all precede that update at every stage). The asynchronous
schedules clip each stage by its own norm, with no pipeline-wide synchronisation, and report the
stage's norm.

**Measurements** (per span, `train.step.PipelineStats`): ``bubble`` = time blocked in receives
and in the global-norm all-reduce / span time; ``staleness`` = this stage's own updates between
each micro-batch's F and B (counted here, and an error if above `schedules.staleness_bound`);
``peak_memory`` = peak bytes held for in-flight micro-batches: the distinct storages autograd
saved for backward (counted with saved-tensor hooks, weights excluded), the stage outputs kept
for B, the inputs kept for recompute and the recompute graph of the B running, a split list's
linear-layer inputs and output gradients kept for W (after its B, only those), the largest
weight prediction of the F running (``predict``), plus the extra weight copies (pipedream's
stashes); ``weight_versions`` = peak number of distinct weight
storages referenced (live + stashed).
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.func import functional_call

from relaytrain.config.sections import RunConfig
from relaytrain.data.loader import Batch
from relaytrain.data.packing import model_inputs
from relaytrain.model.matmul import DeferredGrad, Linear, deferred_backward, deferring
from relaytrain.model.memory import SavedBytes
from relaytrain.model.olmo3 import Olmo3
from relaytrain.model.prediction import Prediction
from relaytrain.parallel.context import ContextGroup, label_share, sequence_mean
from relaytrain.parallel.pipeline.schedules import (
    Action,
    asynchronous,
    build_schedule,
    split,
    staleness,
    staleness_bound,
    update_groups,
)
from relaytrain.parallel.reduce import GradReducer
from relaytrain.parallel.shards import local_tensor, whole_tensor
from relaytrain.train.evaluate import eval_chunks, instance_losses
from relaytrain.train.optim import AdamW, set_lr
from relaytrain.train.skip_step import SkipCheck, SkipHistory, SkipRule, global_ce
from relaytrain.train.step import PipelineStats, StepOutcome, autocast_for

ACTIVATION_DTYPE = torch.float32  # residual stream between stages (fp32 under bf16 autocast too)


@dataclass(frozen=True)
class StageSpec:
    """What one stage runs: its place, the schedule and its options, the loss and clip settings,
    and the static shape of the activations it exchanges."""

    schedule: str
    stage: int
    n_stages: int
    micro_per_batch: int  # M: micro-batches of one global batch on one DP rank
    dp: int  # data-parallel ranks (replicas x fsdp)
    micro_batch: int
    seq_len: int
    d_model: int
    z_loss: float
    clip: float
    a: int = 1
    in_flight: int | None = None
    flush: bool = False
    recompute: bool = False
    predict: bool = False  # paci's weight prediction (see the module docstring)
    split: bool = False  # paci's W right after each B (schedules.build_schedule)
    skip: SkipRule | None = None  # optim.skip_spikes (flush schedules only: config.py)
    virtual: int = 1  # model chunks on this rank (interleaved-1f1b's V)
    document_masking: bool = False  # model.document_masking: attention within documents

    @classmethod
    def from_config(cls, cfg: RunConfig, stage: int, d_model: int, dp: int) -> StageSpec:
        """`parallel.paci.{a, in_flight}` set the update cadence and in-flight cap of both
        asynchronous schedules; `flush` and `mode` are paci's only. `dp`: the generation's
        DP size (a pipeline that dropped a replica runs more micro-batches on each rank)."""
        p = cfg.parallel
        is_async = asynchronous(p.schedule)
        return cls(schedule=p.schedule, stage=stage, n_stages=p.pp,
                   micro_per_batch=cfg.micro_batches // dp, dp=dp,
                   micro_batch=cfg.train.micro_batch, seq_len=cfg.seq_len, d_model=d_model,
                   z_loss=cfg.train.z_loss, clip=cfg.train.clip,
                   a=p.paci.a if is_async else 1,
                   in_flight=p.paci.in_flight if is_async else None,
                   flush=p.paci.flush and p.schedule == "paci",
                   recompute=p.paci.mode == "mem" and p.schedule == "paci",
                   predict=p.paci.predict and p.schedule == "paci",
                   split=p.paci.split and p.schedule == "paci",
                   skip=SkipRule.from_config(cfg),
                   virtual=p.virtual_stages if p.schedule == "interleaved-1f1b" else 1,
                   document_masking=cfg.document_masking)

    @property
    def first(self) -> bool:
        return self.stage == 0

    @property
    def last(self) -> bool:
        return self.stage == self.n_stages - 1

    @property
    def global_clip(self) -> bool:
        return not asynchronous(self.schedule) or self.flush

    def schedule_actions(self, n_batches: int) -> list[list[Action]]:
        options: dict[str, Any] = {}
        if asynchronous(self.schedule):
            options = {"a": self.a, "in_flight": self.in_flight}
        if self.schedule == "paci":
            options |= {"flush": self.flush, "split": self.split}
        if self.schedule == "interleaved-1f1b":
            options["virtual"] = self.virtual
        return build_schedule(self.schedule, self.n_stages, self.micro_per_batch, n_batches,
                              **options)

    def bound(self) -> int:
        if not asynchronous(self.schedule):
            return 0
        return staleness_bound(self.schedule, self.stage, self.n_stages, self.a, self.in_flight)


class Transport:
    """Messages with the neighbouring stages. Sends are asynchronous and complete by `drain`.
    gloo moves a message only once its receive is posted (a rendezvous: a blocking receive made
    when the data is needed pays the whole transfer, even if the sender finished long before;
    docs/MEASURED.md), so `expect` takes a span's receives in order and keeps the
    next one from each neighbour posted: it arrives during the compute before it is needed.
    `waited` accumulates the seconds spent blocked. Tags keep the two directions and the
    micro-batches apart."""

    def __init__(self, device: torch.device):
        self.device = device
        self.waited = 0.0
        self._pending: list[tuple[dist.Work, Tensor]] = []
        self._expected: dict[int, deque[tuple[int, tuple[int, ...]]]] = {}
        self._posted: dict[tuple[int, int], tuple[dist.Work, Tensor]] = {}

    def expect(self, receives: Iterable[tuple[int, int]], shape: Sequence[int]) -> None:
        """The receives (source, tag) of `shape` that `recv` will be asked for, in order; the
        first from each source is posted now."""
        for src, tag in receives:
            self._expected.setdefault(src, deque()).append((tag, tuple(shape)))
        for src in list(self._expected):
            self._post_next(src)

    def _post_next(self, src: int) -> None:
        queue = self._expected.get(src)
        if queue:
            tag, shape = queue.popleft()
            buf = torch.empty(shape, dtype=ACTIVATION_DTYPE, device=self.device)
            self._posted[(src, tag)] = (dist.irecv(buf, src, tag=tag), buf)

    def send(self, tensor: Tensor, dst: int, tag: int) -> None:
        tensor = tensor.detach().contiguous()
        self._pending = [(w, t) for w, t in self._pending if not w.is_completed()]
        self._pending.append((dist.isend(tensor, dst, tag=tag), tensor))

    def recv(self, shape: Sequence[int], src: int, tag: int) -> Tensor:
        """The message: waited for if it was expected (then the next one from `src` is posted),
        else received now."""
        t0 = time.perf_counter()
        posted = self._posted.pop((src, tag), None)
        if posted is None:
            buf = torch.empty(tuple(shape), dtype=ACTIVATION_DTYPE, device=self.device)
            dist.recv(buf, src, tag=tag)
        else:
            work, buf = posted
            work.wait()
            self._post_next(src)
        self.waited += time.perf_counter() - t0
        return buf

    def drain(self) -> None:
        for work, _ in self._pending:
            work.wait()
        self._pending.clear()


def _tag(mb: int, gradient: bool, chunk: int = 0, chunks: int = 1) -> int:
    """The tag of `mb`'s activation or gradient across the link above chunk `chunk` (of
    `chunks` per rank) of the sending or receiving rank, whichever holds the lower side: unique
    per pair of ranks and direction."""
    return 2 * (mb * chunks + chunk) + int(gradient)


@dataclass(frozen=True)
class _Place:
    """Where one of this rank's model chunks sits in the pipeline: virtual stage chunk x S +
    stage (one chunk, the whole module, except under interleaved-1f1b)."""

    chunk: int
    first: bool  # reads the tokens (virtual stage 0)
    last: bool  # computes the loss (the last virtual stage)
    src: int | None  # rank its F's input comes from and its B's input gradient goes to
    dst: int | None  # rank its F's output goes to and its B's output gradient comes from
    below: int  # the chunk the link from `src` is tagged with (see `_tag`)
    layers: range | None  # the chunk's global layers; None: all the module's (one chunk)
    names: tuple[str, ...]  # its parameters, in the module's order


def _places(module: Any, spec: StageSpec, prev: int | None, next: int | None,
            wrap: int | None) -> list[_Place]:
    """This rank's chunks: for V > 1, the contiguous runs of the layers its module holds
    (stages.rank_chunks: never adjacent, since the ranks between hold the runs between);
    `wrap` is the rank across the pipeline's ends (the last stage's for the first and the
    first's for the last), which links chunk c of the last stage to chunk c + 1 of the first."""
    S, V, i = spec.n_stages, spec.virtual, spec.stage
    names = [n for n, _ in module.named_parameters()]
    if V == 1:
        return [_Place(0, spec.first, spec.last, prev, next, 0, None, tuple(names))]
    held = sorted(int(k) for k in module.layers)
    runs = [range(a, b + 1) for a, b in zip(
        [h for j, h in enumerate(held) if j == 0 or held[j - 1] != h - 1],
        [h for j, h in enumerate(held) if j == len(held) - 1 or held[j + 1] != h + 1],
        strict=True)]
    if len(runs) != V:
        raise ValueError(f"stage {i}: its layers {held} form {len(runs)} chunks, expected {V}")
    out = []
    for c, layers in enumerate(runs):
        first, last = c * S + i == 0, c * S + i == S * V - 1
        owned = tuple(n for n in names if (n.split(".")[1] in map(str, layers)
                                           if n.startswith("layers.") else
                                           first if n.startswith("embed.") else last))
        out.append(_Place(c, first, last, prev if i > 0 else (wrap if c > 0 else None),
                          next if i < S - 1 else (wrap if c < V - 1 else None),
                          c if i > 0 else c - 1, layers, owned))
    return out


def model_order(keys: Sequence[int]) -> list[int]:
    """The indices that put per-tensor values gathered in stage order back into the whole
    model's order, given each tensor's `global_order` (stable: a stage's own order is kept
    among equal keys). The identity unless a rank holds several chunks (interleaved-1f1b),
    where summing norms in stage order changes the global norm's last bits for some gradients
    (tests/train/test_pipeline_stage.py)."""
    return sorted(range(len(keys)), key=keys.__getitem__)


def global_order(name: str) -> int:
    """Where parameter `name` sorts in the whole model's order: embedding, layers by index,
    then the final norm and head (their order among themselves is the module's)."""
    if name.startswith("layers."):
        return int(name.split(".")[1])
    return -1 if name.startswith("embed.") else 1 << 30


def _held_bytes(deferred: Iterable[DeferredGrad]) -> int:
    """Bytes of the distinct storages a micro-batch awaiting W holds."""
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for d in deferred for t in d.held()}.values())


@dataclass
class _InFlight:
    """A micro-batch between its F and its B at this stage."""

    x: Tensor  # stage input: tokens on the first stage, received activations otherwise
    out: Tensor | None  # output (or scaled loss on the last stage); None when recomputing
    leaves: dict[str, Tensor] | None  # the weight aliases the graph uses
    updates_at_f: int
    nbytes: int
    weights: int | None  # data pointer of the weight storage the graph holds
    # split lists: what each linear layer's weight gradient needs, by parameter name (for W)
    deferred: dict[str, DeferredGrad] = field(default_factory=dict)
    doc_lens: Tensor | None = None  # document lengths of a recomputed forward (paci mem)


@dataclass
class _Update:
    step: int
    norm: float
    finite: bool
    skipped: bool = False


@dataclass
class _SpanStats:
    """A span's measurements: time per kind of action (waits excluded), and the peak bytes held
    and weight versions referenced, sampled after every action."""

    weight_bytes: int
    times: dict[str, float] = field(default_factory=lambda: dict.fromkeys("FBWU", 0.0))
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys("FBWU", 0))
    peak_bytes: int = 0
    peak_versions: int = 1

    def record(self, kind: str, seconds: float, inflight: dict[int, _InFlight],
               live_weights: int, transient: int) -> None:
        self.times[kind] += seconds
        self.counts[kind] += 1
        versions = {h.weights for h in inflight.values() if h.weights is not None}
        versions.add(live_weights)
        self.peak_versions = max(self.peak_versions, len(versions))
        held = sum(h.nbytes for h in inflight.values()) + transient
        self.peak_bytes = max(self.peak_bytes, held + (len(versions) - 1) * self.weight_bytes)

    def summary(self) -> dict[str, Any]:
        mean = {k: self.times[k] / self.counts[k] if self.counts[k] else 0.0 for k in "FBWU"}
        return {"peak_memory": self.peak_bytes, "weight_versions": self.peak_versions,
                "forward_s": mean["F"], "backward_s": mean["B"], "update_s": mean["U"],
                "weight_s": mean["W"]}


class StageRunner:
    """One pipeline stage: runs spans of global batches by its action list."""

    def __init__(self, module: Olmo3, optimizer: AdamW, reducer: GradReducer | Any,
                 spec: StageSpec, transport: Transport, prev: int | None, next: int | None,
                 pipe_group: dist.ProcessGroup | None, lr_of: Callable[[int], float],
                 device: torch.device, sharded: bool = False, wrap: int | None = None,
                 context: ContextGroup | None = None):
        self.module, self.optimizer, self.reducer, self.spec = module, optimizer, reducer, spec
        self.context = context  # parallel.cp: this rank's part of every sequence
        # a message between stages: this rank's part of a micro-batch's activations (its
        # length is the batches' inputs', set again by each span: `_message_shape`)
        self.shape = self._message_shape(spec.seq_len)
        self.transport, self.pipe_group = transport, pipe_group
        self.lr_of, self.device = lr_of, device
        if sharded and not spec.global_clip:
            raise ValueError(f"schedule {spec.schedule}: a sharded stage runs flush schedules "
                             "only")
        if spec.predict and getattr(module, "compiled", False):  # model.compile auto on CUDA
            raise ValueError("config key 'parallel.paci.predict': compiled blocks do not form "
                             "the prediction; expected model.compile=none")
        per_batch = spec.global_clip and (spec.schedule != "paci" or spec.a >= spec.micro_per_batch)
        if spec.skip is not None and not per_batch:
            raise ValueError(f"schedule {spec.schedule}: optim.skip_spikes needs every stage "
                             "to update once per global batch (a flush schedule)")
        self.sharded = sharded  # see "Sharded stages" above
        self.params = dict(module.named_parameters())
        self.places = _places(module, spec, prev, next, wrap)
        self._linear_weights = {m: f"{n}.weight" for n, m in module.named_modules()
                                if isinstance(m, Linear)}  # whose gradients a W forms
        self.weight_bytes = sum(p.numel() * p.element_size() for p in self.params.values())
        self.last_norm = 0.0  # grad norm of the latest update, carried across spans
        self._norm_sizes: list[int] | None = None  # per stage: gradient tensors + 1 flag
        self._norm_order: list[int] | None = None  # gathered norms -> whole-model order
        self._delta: dict[str, Tensor] | None = None  # `spec.predict`: the last update

    # ---- training ----------------------------------------------------------------------------
    def run_span(self, first_step: int, batches: list[Batch],
                 history: SkipHistory | None = None) -> list[StepOutcome]:
        """Train global batches `batches` (steps first_step, first_step + 1, ...) by this stage's
        list for a span of that many batches; one result per step. The pipeline is empty at the
        start and drained at the end (a consistent cut). `history`: the steps before as
        optim.skip_spikes compares them."""
        spec, M = self.spec, self.spec.micro_per_batch
        check = None if spec.skip is None else SkipCheck(spec.skip, history or SkipHistory())
        if any(len(b.micro_batches) != M for b in batches):
            raise ValueError(f"expected {M} micro-batches per batch on this DP rank")
        every = spec.schedule_actions(len(batches))
        actions = every[spec.stage]
        is_split = split(actions)
        groups = update_groups(every)[spec.stage]
        divisor = {m: len(g) * spec.dp for g in groups for m in g}
        bound = spec.bound()
        ahead = {m: t for (i, m), t in staleness(every).items() if i == spec.stage}
        self._delta = None  # a span starts with no update to predict from
        inflight: dict[tuple[int, int], _InFlight] = {}  # by (chunk, micro-batch)
        losses: dict[int, tuple[float, float, float]] = {}
        stale: dict[int, int] = {}
        updates: list[_Update] = []
        stats = _SpanStats(self.weight_bytes)
        self.transport.waited = 0.0
        self.module.train()
        self.reducer.start()
        t_span = time.perf_counter()
        self.shape = self._message_shape(self._micro(0, batches)[0].shape[1])
        self.transport.expect(self._receives(actions), self.shape)
        for act in actions:
            t0, w0 = time.perf_counter(), self.transport.waited
            transient = 0
            key, place = (act.chunk, act.mb), self.places[act.chunk]
            if act.kind == "F":
                if act.version not in (None, len(updates)):
                    raise RuntimeError(f"{act}: version {act.version}, live is {len(updates)}")
                inflight[key], transient = self._forward(act.mb, place, batches, divisor,
                                                         losses, len(updates), is_split,
                                                         ahead[act.mb])
            elif act.kind == "B":
                held = inflight[key] if is_split else inflight.pop(key)
                stale[act.mb] = len(updates) - held.updates_at_f
                if stale[act.mb] > bound:
                    raise RuntimeError(f"stage {spec.stage}: micro-batch {act.mb} crossed "
                                       f"{stale[act.mb]} updates, above the bound {bound}")
                transient = self._backward(act.mb, place, held, is_split)
            elif act.kind == "W":
                transient = self._backward_weight(inflight.pop(key))
            else:
                group = groups[act.k - 1]  # a global batch under optim.skip_spikes
                own = {batches[m // M].micro_batches[m % M][0]: losses[m]
                       for m in group if m in losses}
                updates.append(self._update(first_step + group[-1] // M, inflight, check, own))
            busy = time.perf_counter() - t0 - (self.transport.waited - w0)
            stats.record(act.kind, busy, inflight, self._live_weights(), transient)
        self.transport.drain()
        self._delta = None  # (also reset at the start: a failed span's)
        span_s = time.perf_counter() - t_span
        carried = self.last_norm
        if updates:
            self.last_norm = updates[-1].norm
        shared = {"bubble": self.transport.waited / span_s if span_s > 0 else 0.0,
                  "wait_s": self.transport.waited, "span_s": span_s,
                  "staleness_bound": bound, "updates": len(updates), **stats.summary()}
        return [self._step_result(first_step, b, batch, losses, stale, updates, carried, shared)
                for b, batch in enumerate(batches)]

    def _step_result(self, first_step: int, b: int, batch: Batch,
                     losses: dict[int, tuple[float, float, float]], stale: dict[int, int],
                     updates: list[_Update], carried: float, shared: dict[str, Any]
                     ) -> StepOutcome:
        """Step first_step + b: its micro-batches' losses (last stage only, keyed by global
        micro-batch index) and staleness, and the norm of the latest update done by its end
        (`carried`, the previous span's last, if none yet)."""
        M, step = self.spec.micro_per_batch, first_step + b
        mbs = range(b * M, (b + 1) * M)
        own = {batch.micro_batches[m - b * M][0]: losses[m] for m in mbs if m in losses}
        mine = [u for u in updates if u.step == step]
        done = [u for u in updates if u.step <= step]
        norm = done[-1].norm if done else carried
        finite = all(u.finite for u in mine) and all(
            math.isfinite(v) for values in own.values() for v in values)
        return StepOutcome(losses=own, grad_norm=norm, finite=finite,
                           skipped=any(u.skipped for u in mine),
                           pipeline=PipelineStats(**shared, staleness=[stale[m] for m in mbs]))

    def _receives(self, actions: list[Action]) -> Iterator[tuple[int, int]]:
        """(source, tag) of every receive of the list, in list order: activations for F on all
        virtual stages but the first, output gradients for B on all but the last."""
        V = self.spec.virtual
        for act in actions:
            place = self.places[act.chunk]
            if act.kind == "F" and place.src is not None:
                yield place.src, _tag(act.mb, False, place.below, V)
            elif act.kind == "B" and place.dst is not None:
                yield place.dst, _tag(act.mb, True, place.chunk, V)

    def _live_weights(self) -> int:
        return 0 if self.sharded else next(iter(self.params.values())).data_ptr()

    def _meter(self, swap: Callable[[Tensor], Tensor] | None = None) -> SavedBytes:
        """Weights are skipped: they are held anyway and counted as versions (a sharded
        stage's gathered weights are counted: they are held for the micro-batch's B). `swap`:
        a weight prediction's (the graph saves the live weights for it)."""
        return SavedBytes((local_tensor(p) for p in self.params.values()), swap)

    def _aliases(self) -> dict[str, Tensor] | None:
        if self.sharded:
            return None
        return {n: p.data.requires_grad_() for n, p in self.params.items()}

    def _prediction(self, ahead: int) -> Prediction | None:
        """`spec.predict`'s weights `ahead` updates on, theta + ahead x delta, formed op by op
        in the forward (None where there is nothing to predict: none ahead, or no update yet
        in this span)."""
        if not self.spec.predict or ahead == 0 or self._delta is None:
            return None
        return Prediction({self.params[n].untyped_storage().data_ptr(): d
                           for n, d in self._delta.items()}, ahead)

    def _kwargs(self, place: _Place, doc_lens: Tensor | None,
                labels: Tensor | None = None) -> dict[str, Any]:
        """The module's keyword arguments for chunk `place`: its layers, the cp group, the
        micro-batch's document lengths (attention within documents), the last stage's labels."""
        kwargs: dict[str, Any] = {} if labels is None else {"labels": labels,
                                                            "z_loss": self.spec.z_loss}
        if place.layers is not None:
            kwargs["chunk"] = place.layers
        if self.context is not None:
            kwargs["context"] = self.context
        if doc_lens is not None:
            kwargs["doc_lens"] = doc_lens
        return kwargs

    def _run(self, x: Tensor, leaves: dict[str, Tensor] | None, meter: SavedBytes,
             place: _Place, doc_lens: Tensor | None, labels: Tensor | None = None) -> Any:
        """The chunk's output, or on the last virtual stage given `labels` its (total, ce, z)
        loss; through the weight aliases `leaves`, or (sharded) the module itself."""
        kwargs = self._kwargs(place, doc_lens, labels)
        with meter.counting(), autocast_for(self.device):
            if leaves is None:
                return self.module(x, **kwargs)
            return functional_call(self.module, leaves, (x,), kwargs, strict=True)

    def _micro(self, mb: int, batches: list[Batch]) -> tuple[Tensor, Tensor, Tensor | None]:
        """(inputs, labels, document lengths or None) of the span's micro-batch `mb`, whole
        sequences, as `train.step` forms them: packed instances' padding is no label and with
        `document_masking` every stage's attention and positions stay within documents. Every
        stage reads them from the same batch (the loader is a pure function of the seed), so
        no document structure travels down the pipe."""
        b, j = divmod(mb, self.spec.micro_per_batch)
        index, tokens = batches[b].micro_batches[j]
        inputs, labels, doc_lens = model_inputs(tokens.to(self.device),
                                                batches[b].documents.get(index),
                                                whole=self.context is not None)
        return inputs, labels, doc_lens if self.spec.document_masking else None

    def _message_shape(self, tokens: int) -> tuple[int, int, int]:
        """A message between stages of micro-batches of `tokens` inputs a row (packed
        instances' are seq_len - 1, or seq_len whole for a cp split): this rank's part."""
        degree = 1 if self.context is None else self.context.split.degree
        return self.spec.micro_batch, tokens // degree, self.spec.d_model

    def _input(self, mb: int, place: _Place, inputs: Tensor) -> Tensor:
        if place.first:
            return self._local(inputs)
        return self.transport.recv(self.shape, place.src,
                                   _tag(mb, False, place.below, self.spec.virtual))

    def _local(self, x: Tensor) -> Tensor:
        """This rank's part of whole sequences `x` [B, T] (all of them without cp)."""
        return x if self.context is None else self.context.split.local(x)

    def _forward(self, mb: int, place: _Place, batches: list[Batch], divisor: dict[int, int],
                 losses: dict[int, tuple[float, float, float]], updates: int,
                 is_split: bool = False, ahead: int = 0) -> tuple[_InFlight, int]:
        """F of `mb` at chunk `place` (on weights predicted `ahead` updates on with
        `spec.predict`); the micro-batch held until its B, and the bytes of the largest
        weight prediction formed (the transient of one op)."""
        spec = self.spec
        inputs, labels, doc_lens = self._micro(mb, batches)
        x = self._input(mb, place, inputs)
        out_tag = _tag(mb, False, place.chunk, spec.virtual)
        if spec.recompute and not place.last:
            with torch.no_grad(), autocast_for(self.device):
                out = self.module(x, **self._kwargs(place, doc_lens))
            self.transport.send(out, place.dst, out_tag)
            return _InFlight(x, None, None, updates, x.untyped_storage().nbytes(), None,
                             doc_lens=doc_lens), 0
        if not place.first:
            x.requires_grad_()
        leaves = self._aliases()
        prediction = self._prediction(ahead)
        share = 1.0
        if not place.last:
            labels = None
        elif self.context is not None:  # its loss weighs its share of the scored tokens
            share = label_share(labels, self.context)
            labels = self._local(labels)
        defer = is_split and leaves is not None and not getattr(self.module, "compiled", False)
        swap = None if prediction is None else prediction.swap
        with deferring([] if defer else None) as records, \
                nullcontext() if prediction is None else prediction.applied():
            out = self._run(x, leaves, meter := self._meter(swap), place, doc_lens, labels)
        deferred = {self._linear_weights[d.layer]: d for d in records or ()}
        if len(deferred) != len(records or ()):
            raise RuntimeError("a linear layer ran twice in one forward: its deferred weight "
                               "gradient would be split")
        if place.last:
            total, ce, z = out
            losses[mb] = sequence_mean([float(v.detach()) for v in out], share, self.context,
                                       self.device)
            out = total * share / divisor[mb]
        else:
            self.transport.send(out, place.dst, out_tag)
        meter.add(out)
        for d in deferred.values():  # held for W, not saved by the graph (weights detached)
            meter.add(d.x)
        weights = self._live_weights() if leaves is None else \
            next(iter(leaves.values())).data_ptr()
        transient = 0 if prediction is None else prediction.largest
        return _InFlight(x, out, leaves, updates, meter.nbytes, weights, deferred), transient

    def _backward(self, mb: int, place: _Place, held: _InFlight, is_split: bool = False) -> int:
        """Backward of `mb` at chunk `place`: input gradient upstream, weight gradients into
        .grad (in a split list, only the input gradient: `_backward_weight` does the rest).
        Returns the bytes `mb` holds while its B runs (with a recompute graph, if any)."""
        spec = self.spec
        grad_out = None
        if not place.last:
            grad_out = self.transport.recv(self.shape, place.dst,
                                           _tag(mb, True, place.chunk, spec.virtual))
        up = _tag(mb, True, place.below, spec.virtual)
        extra = 0
        out, leaves, x = held.out, held.leaves, held.x
        if out is None:  # recompute with the live weights, right before the backward
            leaves = self._aliases()
            if not place.first:
                x.requires_grad_()
            out = self._run(x, leaves, meter := self._meter(), place, held.doc_lens)
            extra = meter.nbytes
        if leaves is None:  # sharded: FSDP2's hooks take the weight gradients
            torch.autograd.backward(out, grad_out)
            if not place.first:
                self.transport.send(x.grad, place.src, up)
        else:  # a split list's deferred linear weights are W's
            names = [n for n in place.names if n not in held.deferred]
            inputs = ([] if place.first else [x]) + [leaves[n] for n in names]
            grads = deferred_backward(out, inputs, grad_out, held.deferred.values())
            if not place.first:
                self.transport.send(grads[0], place.src, up)
                grads = grads[1:]
            self._fold(grads, names)
            if is_split:  # the graph is gone: from here until W, only what W reads (still in
                graph = held.nbytes  # `inflight`, so B's own peak is counted as the rest)
                held.out, held.nbytes = None, _held_bytes(held.deferred.values())
                self.reducer.after_backward()
                return max(graph - held.nbytes, 0) + extra
        self.reducer.after_backward()
        return held.nbytes + extra

    def _backward_weight(self, held: _InFlight) -> int:
        """W of a split list: the deferred weight gradients (each gradᵀ @ input), into .grad in
        list order (nothing on a sharded stage, whose B ran the whole backward). Returns the
        bytes held."""
        if not held.deferred:
            return held.nbytes
        names = list(held.deferred)
        self._fold([held.deferred[n].weight_grad() for n in names], names)
        self.reducer.after_backward()
        return held.nbytes

    def _fold(self, grads: Sequence[Tensor | None], names: Sequence[str] | None = None) -> None:
        """Add one micro-batch's weight gradients (of parameters `names`, by default all) to
        .grad as AccumulateGrad would (the first taken as is, later ones added)."""
        names = list(self.params) if names is None else names
        with torch.no_grad():
            for name, g in zip(names, grads, strict=True):
                p = self.params[name]
                if g is None:
                    raise RuntimeError(f"no gradient reached {name}")
                if p.grad is None:
                    p.grad = g
                else:
                    p.grad.add_(g)

    def _update(self, step: int, inflight: dict[int, _InFlight], check: SkipCheck | None = None,
                own: dict[int, tuple[float, float, float]] | None = None) -> _Update:
        """Reduce over DP, clip, step, clear: the update of one group, at `lr_at(step)`. With
        `check` (optim.skip_spikes, flush schedules: the group is step `step`'s global batch),
        every stage and DP rank decides alike from the global CE loss, the losses `own` (global
        micro-batch index -> losses; the last stage's) gathered over the replica's pipeline and
        then the DP group, and the pre-clip global norm: a skip leaves weights and AdamW's state
        as they were on every stage, as train_step does."""
        spec = self.spec
        set_lr(self.optimizer, self.lr_of(step))
        ok = self.reducer.finish()
        params = list(self.params.values())
        grads = [p.grad for p in params if p.grad is not None]
        ce = 0.0
        if spec.global_clip:
            t0 = time.perf_counter()
            order = [global_order(n) for n, p in self.params.items() if p.grad is not None]
            norm, ok = self._global_norm(grads, order, ok)
            if check is not None:  # every rank joins, whatever its own losses hold
                pipe = dist.group.WORLD if self.pipe_group is None else self.pipe_group  # dp 1
                if self.context is not None and self.context.split.rank:
                    own = {}  # its cp group's first rank fills the slots (they hold the same)
                ce = global_ce(own or {}, spec.micro_per_batch * spec.dp,
                               self.reducer.group, self.device, pipe)
            self.transport.waited += time.perf_counter() - t0
        else:
            norm = torch.nn.utils.get_total_norm(grads, foreach=True)
        if spec.clip > 0:
            torch.nn.utils.clip_grads_with_norm_(params, spec.clip, norm, foreach=True)
        value = float(norm)
        finite = ok and math.isfinite(value)
        skipped = finite and check is not None and check(ce, value)
        if spec.predict:  # delta: this update (zero if skipped), theta after minus before
            with torch.no_grad():
                self._delta = {n: p.detach().clone() if self._delta is None
                               else self._delta[n].copy_(p) for n, p in self.params.items()}
        if finite and not skipped:
            live = self._live_weights()
            if spec.schedule == "pipedream" and any(h.weights == live for h in inflight.values()):
                with torch.no_grad():  # stash: in-flight graphs keep the old storage
                    for p in params:
                        p.data = p.data.clone()
            self.optimizer.step()
        if self._delta is not None:
            with torch.no_grad():
                for n, p in self.params.items():
                    torch.sub(p, self._delta[n], out=self._delta[n])
        self.optimizer.zero_grad()
        self.reducer.start()
        return _Update(step, value, finite, skipped)

    def _global_norm(self, grads: list[Tensor], order: list[int], ok: bool
                     ) -> tuple[Tensor, bool]:
        """The norm of the whole model's gradient, bit for bit `get_total_norm` of the
        unpipelined model: every stage's per-tensor norms (and finite flag) are gathered in stage
        order, put in global parameter order (`order`: each tensor's `global_order`; stage
        order already is, unless a rank holds several chunks) and reduced alike on every
        stage."""
        if self.sharded:  # each whole tensor's norm, as on one worker
            norms = [torch._foreach_norm([whole_tensor(g)], 2.0)[0] for g in grads]
        else:
            norms = torch._foreach_norm(grads, 2.0)
        local = torch.stack([*norms, torch.tensor(0.0 if ok else 1.0, device=self.device)])
        if self._norm_sizes is None:  # static per layout: gathered once
            size = torch.tensor([local.numel()], device=self.device)
            sizes = [torch.zeros_like(size) for _ in range(self.spec.n_stages)]
            dist.all_gather(sizes, size, group=self.pipe_group)
            self._norm_sizes = [int(x) for x in sizes]
            keys = torch.full((max(self._norm_sizes),), -2, dtype=torch.int64,
                              device=self.device)
            keys[: len(order)] = torch.tensor(order, dtype=torch.int64)
            every = [torch.empty_like(keys) for _ in self._norm_sizes]
            dist.all_gather(every, keys, group=self.pipe_group)
            flat = [int(k) for x, n in zip(every, self._norm_sizes, strict=True)
                    for k in x[: n - 1]]
            self._norm_order = model_order(flat)
        width = max(self._norm_sizes)
        padded = torch.zeros(width, device=self.device)
        padded[: local.numel()] = local
        parts = [torch.empty_like(padded) for _ in self._norm_sizes]
        dist.all_gather(parts, padded, group=self.pipe_group)
        norms = [x[: n - 1] for x, n in zip(parts, self._norm_sizes, strict=True)]
        flags = torch.stack([x[n - 1] for x, n in zip(parts, self._norm_sizes, strict=True)])
        total = torch.linalg.vector_norm(torch.cat(norms)[self._norm_order], 2.0)
        return total, bool((flags == 0).all())

    # ---- evaluation --------------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self, split: Any, ids: list[int], part: int, parts: int) -> dict[int, float]:
        """Per-instance held-out loss of chunk share `part` of `parts` through the pipeline:
        stage 0 reads the tokens, the last stage (which reads the labels) returns the losses,
        the others return {}."""
        spec = self.spec
        out: dict[int, float] = {}
        # the inputs a row: an indexed split's instances are seq_len tokens, a prepared one's
        # seq_len + 1 (no tokens read: the stages between read none)
        width = split.instances([], spec.seq_len).shape[1] - 1
        self.module.eval()
        for c, chunk in enumerate(eval_chunks(ids, spec.micro_batch, part, parts)):
            tokens = None
            if spec.first or spec.last:
                tokens = torch.from_numpy(split.instances(chunk, spec.seq_len)).to(self.device)
            for place in self.places:  # a rank's model chunks, in pipeline order
                if place.first:
                    x = tokens[:, :-1]
                else:
                    x = self.transport.recv((len(chunk), width, spec.d_model), place.src,
                                            _tag(c, False, place.below, spec.virtual))
                with autocast_for(self.device):
                    y = self.module(x) if place.layers is None else \
                        self.module(x, chunk=place.layers)
                if place.last:
                    out.update(instance_losses(y, tokens, chunk))
                else:
                    self.transport.send(y, place.dst, _tag(c, False, place.chunk, spec.virtual))
        self.transport.drain()
        self.module.train()
        return out
