"""Context parallelism (`parallel.cp`): one sequence split over the ranks of a cp group, and
attention across the split, in one fixed order of key blocks whoever holds them.

**The split** is the zig-zag of OLMo-core's `RingAttentionZigZagLoadBalancer.batch_shard`: the
sequence is cut into 2N equal chunks and rank r holds chunks r and 2N-1-r, an early and a late
one, so every rank holds the same share of the causal triangle. (OLMo-core's `llama3` balancer,
what `TransformerContextParallelConfig.llama3` picks, gives rank r one contiguous 1/N slice and
all-gathers K/V: balanced only under intra-document masking; without it rank N-1 computes 2N-1
times rank 0's attention.)

**Attention** runs in blocks of `block` tokens, the same at every degree. Query block i attends
to the key blocks `needed[i]` the causal mask, the sliding window and the document boundaries
leave visible, concatenated in global order: one masked softmax per query block over the same
keys in the same order, whatever the degree, so each query row's output and dQ are formed by
the same operations on the same operands at cp 1, 2 or 4. A key block's dK and dV are sums of
contributions from the query blocks that see it, which sit on several ranks: in exact mode they
are summed as integers (the fixed-point limbs of `parallel.reduce`), whose sum has no order, and
rounded to float once by the block's owner; in fast mode in float, in rank order.

**Exchange**: a rank fetches from their owners the key/value blocks its query blocks need
(point-to-point), and of each block only the span of keys some query of the rank sees (its
`spans`): the rest of the block travels as nothing and is zeros here, where every query's mask
hides it anyway, so each query block still scores the same whole key blocks in the same order.
The backward returns those spans' gradient contributions the same way. Full layers fetch every
earlier key (what llama3's all-gather moves, less the keys no query of the rank reaches),
sliding layers only the window's: the `window - 1` keys before each chunk's start. At cp 8 and
65,536 tokens a rank holds 8,192 tokens (two chunks of 4,096) and fetches the 4,095 keys before
each chunk, 8,190 keys where gathering everything fetches 57,344 (1/7 of the bytes; one
neighbour's 4,095 under a contiguous split). Document masks (per-row document lengths) shrink
both: a key no query of its document can see is neither fetched nor computed. What the
exchanges move is counted as they move it (`metering`).

**Why not torch's context-parallel API** (`torch.distributed.tensor.experimental
.context_parallel`, torch 2.13): its SDPA ring attention takes `is_causal` only (an attention
bias or mask raises NotImplementedError), so neither sliding windows nor document masks; masks
need its FlexAttention path, which has no CPU backward. And a ring merges each query's partial
softmaxes in ring order, relative to the rank, so the merge order changes with the degree and
exact mode could not be bit-identical across degrees. Hence torch's point-to-point collectives,
which run on gloo (CPU) and NCCL alike.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from relaytrain.model.documents import document_ids
from relaytrain.model.olmo3 import repeat_kv
from relaytrain.parallel.reduce import from_limbs, to_limbs

MAX_BLOCK = 128  # tokens per attention block at long sequences
_LIMB_LIMIT = float(2**32)  # clamp bound for a non-finite contribution (its step is skipped)


def attention_block(seq_len: int) -> int:
    """Tokens per attention block for sequences of `seq_len`: a function of the length alone
    (so the same at every degree), a power of two, at most MAX_BLOCK and at most a sixteenth
    of the sequence (so degrees up to 8 can split into whole blocks)."""
    return 1 << max(0, min(MAX_BLOCK, seq_len // 16).bit_length() - 1)


def split_problem(seq_len: int, degree: int) -> str | None:
    """Why `seq_len` tokens cannot be split over `degree` ranks (None if they can): the 2N
    chunks must be equal and hold whole attention blocks."""
    block = attention_block(seq_len)
    if seq_len % (2 * degree * block):
        return (f"{seq_len} tokens do not split over cp {degree}: the sequence needs a multiple "
                f"of 2 x cp x {block} (the attention block at this length) = "
                f"{2 * degree * block} tokens")
    return None


@dataclass(frozen=True)
class ContextSplit:
    """Which tokens of a `seq_len` sequence rank `rank` of `degree` holds (zig-zag)."""

    seq_len: int
    degree: int = 1
    rank: int = 0

    def __post_init__(self) -> None:
        problem = split_problem(self.seq_len, self.degree)
        if problem:
            raise ValueError(problem)

    @property
    def block(self) -> int:
        return attention_block(self.seq_len)

    @property
    def chunk(self) -> int:
        return self.seq_len // (2 * self.degree)

    def chunks(self, rank: int | None = None) -> tuple[int, int]:
        r = self.rank if rank is None else rank
        return r, 2 * self.degree - 1 - r

    def blocks(self, rank: int | None = None) -> list[int]:
        """Global indices of the blocks rank `rank` holds, in its local order."""
        per = self.chunk // self.block
        return [c * per + b for c in self.chunks(rank) for b in range(per)]

    def owner(self, block: int) -> int:
        c = block * self.block // self.chunk
        return min(c, 2 * self.degree - 1 - c)

    def positions(self, rank: int | None = None) -> Tensor:
        """Global positions of the rank's tokens, in its local order."""
        return torch.cat([torch.arange(c * self.chunk, (c + 1) * self.chunk)
                          for c in self.chunks(rank)])

    def local(self, x: Tensor, dim: int = 1) -> Tensor:
        """This rank's part of a whole-sequence tensor (sequence along `dim`)."""
        return torch.cat([x.narrow(dim, c * self.chunk, self.chunk) for c in self.chunks()],
                         dim).contiguous()


def doc_ids(doc_lengths: list[list[int]], seq_len: int) -> Tensor:
    """[B, seq_len] document index of every position, from each row's document lengths."""
    rows = []
    for lengths in doc_lengths:
        if sum(lengths) != seq_len or min(lengths) < 1:
            raise ValueError(f"document lengths {lengths} do not tile {seq_len} tokens")
        rows.append(torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths)))
    return torch.stack(rows)


@dataclass(frozen=True)
class AttentionPlan:
    """What one rank computes and exchanges for one kind of layer (full or a window) in one
    forward: the key blocks each of its query blocks sees, those it fetches from each peer and
    those it sends to each."""

    split: ContextSplit
    window: int | None
    docs: Tensor | None  # [B, T] document ids, None: one document
    needed: list[list[int]]  # per local query block, global key blocks in order
    fetch: dict[int, list[int]]  # peer -> its blocks this rank needs
    send: dict[int, list[int]]  # peer -> this rank's blocks the peer needs
    # (receiving rank, block) -> [lo, hi): the keys of the block (offsets in it) that some
    # query of the receiving rank sees, for every block in `fetch` and `send`
    spans: dict[tuple[int, int], tuple[int, int]] = field(default_factory=dict)

    @property
    def fetched_tokens(self) -> int:
        """Key tokens of the blocks this rank fetches from (the blocks its attention scores):
        what a block-granular exchange would move; the wire carries `wire_tokens`."""
        return self.split.block * sum(len(b) for b in self.fetch.values())

    @property
    def wire_tokens(self) -> int:
        """Key tokens this rank receives per exchange: the seen spans of the blocks it fetches
        (K and V each; the backward returns as many gradient values)."""
        return sum(hi - lo for blocks in self.fetch.values()
                   for lo, hi in self.spans_for(self.split.rank, blocks))

    def spans_for(self, rank: int, blocks: list[int]) -> list[tuple[int, int]]:
        """The spans of `blocks` that `rank` receives, in the blocks' order."""
        return [self.spans[rank, j] for j in blocks]

    @functools.cached_property
    def held(self) -> list[int]:
        """The key blocks this rank holds while a layer runs, in global order: its own and
        those it fetches (`_fetch`)."""
        return sorted({*self.split.blocks(), *(j for b in self.fetch.values() for j in b)})

    @functools.cached_property
    def held_at(self) -> dict[int, int]:
        """Global key block -> its place among the `held` ones."""
        return {j: n for n, j in enumerate(self.held)}

    def keys_of(self, index: int) -> slice:
        """Where the keys of local query block `index` lie among the held ones: one slice, as
        the blocks a query block sees are consecutive (causal, window and documents each
        bound them from below) and all held."""
        needed, blk = self.needed[index], self.split.block
        return slice(self.held_at[needed[0]] * blk, (self.held_at[needed[-1]] + 1) * blk)

    def mask(self, index: int, device: torch.device) -> Tensor:
        """[B or 1, 1, block, keys] True where query sees key, for local query block `index`."""
        blk, i = self.split.block, self.split.blocks()[index]
        q = i * blk + torch.arange(blk, device=device)
        k = torch.cat([j * blk + torch.arange(blk, device=device) for j in self.needed[index]])
        seen = k[None, :] <= q[:, None]
        if self.window is not None:
            seen &= k[None, :] > q[:, None] - self.window
        if self.docs is None:
            return seen[None, None]
        docs = self._docs_on(device)
        return (seen[None] & (docs[:, q, None] == docs[:, None, k]))[:, None]

    @functools.cached_property
    def _device_docs(self) -> dict[torch.device, Tensor]:
        return {}

    def _docs_on(self, device: torch.device) -> Tensor:
        """The document ids on `device`, copied there once per plan (not per query block)."""
        assert self.docs is not None
        if device not in self._device_docs:
            self._device_docs[device] = self.docs.to(device)
        return self._device_docs[device]


def plan_attention(split: ContextSplit, window: int | None = None,
                   docs: Tensor | None = None) -> AttentionPlan:
    """The plan of rank `split.rank`: a pure function of the layout, the window and the
    documents, which every rank computes alike for every rank."""
    visible = _visible_blocks(split.seq_len, split.block, window, docs)
    needs = [sorted({j for i in split.blocks(r) for j in visible[i]})
             for r in range(split.degree)]
    me, mine = split.rank, set(split.blocks())
    fetch = {r: [j for j in needs[me] if split.owner(j) == r]
             for r in range(split.degree) if r != me}
    send = {r: [j for j in needs[r] if j in mine] for r in range(split.degree) if r != me}
    ranks = sorted({me, *(r for r, b in send.items() if b)})  # this rank's receivers
    lo, hi = _spans(_seen_keys(split, ranks, window, docs))
    spans = {(r, j): (lo[n][j], hi[n][j]) for n, r in enumerate(ranks) for j in needs[r]
             if split.owner(j) != r}
    return AttentionPlan(split, window, docs, [visible[i] for i in split.blocks()],
                         {r: b for r, b in fetch.items() if b},
                         {r: b for r, b in send.items() if b}, spans)


def _seen_keys(split: ContextSplit, ranks: list[int], window: int | None,
               docs: Tensor | None) -> Tensor:
    """[ranks, blocks, block] whether some query of each of `ranks` sees each key. A rank's first
    query at or after a key is the one that sees it if any does (a later query is further off,
    past the window sooner, and in the same document or a later one): the key itself where the
    rank holds its chunk, else the start of the rank's next chunk (zig-zag: chunks r and
    2N-1-r), else none."""
    chunk, keys = split.chunk, torch.arange(split.seq_len)
    c = keys // chunk
    early = torch.tensor(ranks)[:, None]
    late = 2 * split.degree - 1 - early
    first = torch.where(c < early, early * chunk, torch.where(c < late, late * chunk, keys))
    first = torch.where((c == early) | (c == late), keys, first)
    seen = c <= late
    if window is not None:
        seen &= first - keys < window
    if docs is not None:
        seen &= (docs[:, first] == docs[:, None, keys]).any(0)
    return seen.view(len(ranks), -1, split.block)


def _spans(seen: Tensor) -> tuple[list[list[int]], list[list[int]]]:
    """Per rank and block, [lo, hi) around its seen keys (a fetched block has some: the
    block-level visibility holds for its last key and a query's first)."""
    blk = seen.shape[-1]
    lo = seen.int().argmax(-1)
    hi = blk - seen.flip(-1).int().argmax(-1)
    return lo.tolist(), hi.tolist()


def _visible_blocks(seq_len: int, block: int, window: int | None, docs: Tensor | None
                    ) -> list[list[int]]:
    """Per query block, the key blocks some query of it sees (causal, window, documents)."""
    n = seq_len // block
    i = torch.arange(n)[:, None]
    j = torch.arange(n)[None, :]
    seen = j <= i
    if window is not None:  # the block's last key past its first query's window start
        seen &= (j + 1) * block - 1 > i * block - window
    if docs is not None:  # the key block's last document reaches the query block's first
        first, last = docs[:, ::block], docs[:, block - 1::block]
        seen &= (last[:, None, :] >= first[:, :, None]).any(0)
    return [torch.nonzero(row).flatten().tolist() for row in seen]


@dataclass(frozen=True)
class ContextGroup:
    """A rank's place in its cp group: the split, the group (None at degree 1), whether dK/dV
    are summed exactly, and the current sequences' documents ([B, T] ids, `doc_ids`; None: no
    document mask). What the model takes as its `context` (`model.olmo3.SequenceShard`)."""

    split: ContextSplit
    group: dist.ProcessGroup | None = None
    exact: bool = False
    docs: Tensor | None = None

    def within(self, doc_lens: Tensor) -> ContextGroup:
        """The same place for sequences of these documents (OLMo-core's `doc_lens` [B, D],
        zero-padded, each row summing to the sequence): attention stays within documents and
        positions count from each document's start, as the unsplit model's
        (`model.documents`)."""
        docs = document_ids(doc_lens.cpu(), self.split.seq_len).long()
        return dataclasses.replace(self, docs=docs)

    def positions(self) -> Tensor:
        """Positions of this rank's tokens in its local order: in the sequence ([T/N]), or
        within their documents ([B, T/N]) when there are documents."""
        if self.docs is None:
            return self.split.positions()
        starts = torch.searchsorted(self.docs, self.docs)  # each document's first token
        within = torch.arange(self.split.seq_len)[None, :] - starts
        return within[:, self.split.positions()]

    def attend(self, q: Tensor, k: Tensor, v: Tensor, window: int | None, scale: float
               ) -> Tensor:
        return context_attention(q, k, v, self.plan(window), self, scale)

    @functools.cached_property
    def _plans(self) -> dict[int | None, AttentionPlan]:
        return {}

    def plan(self, window: int | None) -> AttentionPlan:
        """The plan for this window and the group's documents, cached by window (one forward
        of a document-masked sequence computes it once per layer kind, not per layer)."""
        if window not in self._plans:
            self._plans[window] = plan_attention(self.split, window, self.docs)
        return self._plans[window]


def label_share(labels: Tensor, context: ContextGroup, ignore_index: int = -100) -> float:
    """This rank's share of the tokens the whole sequences `labels` [B, T] score (labels not
    `ignore_index`): its loss, a mean over its own, weighs that much in the sequences' mean.
    1/N where every token is scored; packed instances' padding (at their ends) is not."""
    scored = labels != ignore_index
    total = int(scored.sum())
    return int(context.split.local(scored).sum()) / total if total else 0.0


def sequence_mean(values: list[float], share: float, context: ContextGroup | None,
                  device: torch.device | None = None) -> tuple[float, ...]:
    """Means over whole sequences from each cp rank's means over its part of their scored
    tokens, weighted by its `share` of them (`label_share`): gathered, summed exactly in rank
    order (`math.fsum`), the same numbers on every rank (a collective over the cp group)."""
    if context is None or context.group is None:
        return tuple(values)
    mine = torch.tensor([v * share for v in values], dtype=torch.float64, device=device)
    every = [torch.empty_like(mine) for _ in range(context.split.degree)]
    dist.all_gather(every, mine, group=context.group)
    return tuple(math.fsum(float(t[i]) for t in every) for i in range(len(values)))


def context_attention(q: Tensor, k: Tensor, v: Tensor, plan: AttentionPlan,
                      comm: ContextGroup, scale: float) -> Tensor:
    """Attention of this rank's queries [B, H, T/N, hd] over the keys `plan` makes visible,
    with k, v [B, Hkv, T/N, hd] this rank's own (local order, as `ContextSplit.local`)."""
    return _ContextAttention.apply(q, k, v, plan, comm, scale)


class _ContextAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, plan: AttentionPlan,
                comm: ContextGroup, scale: float) -> Tensor:
        keys = _fetch(k, v, plan, comm.group)
        n_rep = q.shape[1] // k.shape[1]
        out = torch.empty_like(q)
        for index, rows in enumerate(_rows(plan)):
            kb, vb = _keys(keys, plan.keys_of(index), n_rep)
            p = _probs(q[:, :, rows].float().contiguous(), kb, plan.mask(index, q.device), scale)
            out[:, :, rows] = p @ vb  # cast back to q's dtype
        ctx.save_for_backward(q, k, v)
        ctx.plan, ctx.comm, ctx.scale = plan, comm, scale
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        q, k, v = ctx.saved_tensors
        plan, comm, scale = ctx.plan, ctx.comm, ctx.scale
        keys = _fetch(k, v, plan, comm.group)  # fetched again: nothing of T x hd kept
        n_rep = q.shape[1] // k.shape[1]
        dq = torch.empty_like(q)
        sums = _KeySums(comm.exact, keys, plan.split.block)
        for index, rows in enumerate(_rows(plan)):
            at = plan.keys_of(index)
            kb, vb = _keys(keys, at, n_rep)
            qi, gi = q[:, :, rows].float().contiguous(), grad[:, :, rows].float().contiguous()
            p = _probs(qi, kb, plan.mask(index, q.device), scale)
            sums.add(at, 1, _fold_heads(p.transpose(-1, -2) @ gi, n_rep))
            ds = _softmax_grad(gi @ vb.transpose(-1, -2), p)
            del p  # at most two [B, H, block, keys] tensors at once, freed as soon as used
            dq[:, :, rows] = (ds @ kb).mul_(scale)
            sums.add(at, 0, _fold_heads((ds.transpose(-1, -2) @ qi).mul_(scale), n_rep))
            del ds
        dkv = _return_sums(sums, plan, comm.group, torch.stack([k, v]))
        return dq, dkv[0], dkv[1], None, None, None


def _rows(plan: AttentionPlan) -> list[slice]:
    blk = plan.split.block
    return [slice(n * blk, (n + 1) * blk) for n in range(len(plan.split.blocks()))]


def _probs(q: Tensor, kb: Tensor, mask: Tensor, scale: float) -> Tensor:
    s = (q @ kb.transpose(-1, -2)).mul_(scale)
    return torch.softmax(s.masked_fill_(~mask, float("-inf")), -1)


def _softmax_grad(dp: Tensor, p: Tensor) -> Tensor:
    """The scores' gradient p * (dp - sum(dp * p)) from the probabilities' `dp`, written over
    `dp` (the row sums as a batched matmul): no third tensor of the scores' size."""
    return dp.sub_((dp.unsqueeze(-2) @ p.unsqueeze(-1)).squeeze(-1)).mul_(p)


def _keys(keys: Tensor, at: slice, n_rep: int) -> tuple[Tensor, Tensor]:
    """A query block's key blocks (a slice of the held keys, global order), expanded to the
    query heads, in fp32 (the scores, softmax and sums are fp32 whatever the inputs, as flash
    kernels'): views, no copy, of fp32 keys without grouped heads."""
    kv = keys[..., at, :].float()
    return repeat_kv(kv[0], n_rep), repeat_kv(kv[1], n_rep)


def _fold_heads(x: Tensor, n_rep: int) -> Tensor:
    """[B, Hkv * n_rep, T, hd] -> [B, Hkv, T, hd]: each kv head's gradient over its queries."""
    if n_rep == 1:
        return x
    b, h, t, d = x.shape
    return x.view(b, h // n_rep, n_rep, t, d).sum(2)


def _spans_of(held: Tensor, plan: AttentionPlan, rank: int, blocks: list[int]) -> Tensor:
    """Blocks `blocks`' spans received by `rank`, cut from this rank's held keys (or their
    sums) and concatenated along the sequence: what one message carries."""
    blk = plan.split.block
    return torch.cat([held[..., plan.held_at[j] * blk + lo:plan.held_at[j] * blk + hi, :]
                      for j, (lo, hi) in zip(blocks, plan.spans_for(rank, blocks),
                                             strict=True)], dim=-2)


def _pieces(buf: Tensor, plan: AttentionPlan, rank: int, blocks: list[int]
            ) -> Iterator[tuple[slice, Tensor]]:
    """Where in the held keys each span of a message for `rank` goes, and its values."""
    at, blk = 0, plan.split.block
    for j, (lo, hi) in zip(blocks, plan.spans_for(rank, blocks), strict=True):
        start = plan.held_at[j] * blk
        yield slice(start + lo, start + hi), buf[..., at:at + hi - lo, :]
        at += hi - lo


def _tokens(spans: list[tuple[int, int]]) -> int:
    return sum(hi - lo for lo, hi in spans)


def _fetch(k: Tensor, v: Tensor, plan: AttentionPlan, group: dist.ProcessGroup | None
           ) -> Tensor:
    """The keys this rank's queries see, K and V stacked [2, B, Hkv, held blocks x block, hd]
    in global block order (`AttentionPlan.held`): its own blocks and the seen spans of those it
    fetches, the rest of a fetched block zeros (masked for every query of this rank)."""
    blk, me = plan.split.block, plan.split.rank
    kv = torch.stack([k, v])
    keys = kv.new_zeros(_block_shape(kv, len(plan.held) * blk))
    for n, j in enumerate(plan.split.blocks()):
        keys[..., plan.held_at[j] * blk:(plan.held_at[j] + 1) * blk, :] = \
            kv[..., n * blk:(n + 1) * blk, :]
    del kv
    sends = {peer: _spans_of(keys, plan, peer, blocks) for peer, blocks in plan.send.items()}
    recvs = {peer: keys.new_empty(_block_shape(keys, _tokens(plan.spans_for(me, blocks))))
             for peer, blocks in plan.fetch.items()}
    _exchange(sends, recvs, group, plan.window)
    for peer, blocks in plan.fetch.items():
        for at, piece in _pieces(recvs[peer], plan, me, blocks):
            keys[..., at, :] = piece
    return keys


@dataclass
class WireBytes:
    """Bytes this process's cp exchanges handed to the transport, per layer kind (the
    window; None: full layers), each counted once as sent and once as received."""

    sent: dict[int | None, int] = field(default_factory=dict)
    received: dict[int | None, int] = field(default_factory=dict)


_METERS: list[WireBytes] = []


@contextlib.contextmanager
def metering() -> Iterator[WireBytes]:
    """Counts the bytes of every cp exchange of this process while open: the tensors given to
    gloo's or NCCL's send and receive, as they are given (not derived from the plan)."""
    meter = WireBytes()
    _METERS.append(meter)
    try:
        yield meter
    finally:
        _METERS.remove(meter)


def _exchange(sends: dict[int, Tensor], recvs: dict[int, Tensor],
              group: dist.ProcessGroup | None, window: int | None) -> None:
    """Send and receive, peers named by their rank in `group`, all at once."""
    if not sends and not recvs:
        return
    sends = {p: t.contiguous() for p, t in sends.items()}
    works = [dist.isend(t, group=group, group_dst=p) for p, t in sends.items()]
    works += [dist.irecv(t, group=group, group_src=p) for p, t in recvs.items()]
    for w in works:
        w.wait()
    for meter in _METERS:
        for tally, msgs in ((meter.sent, sends), (meter.received, recvs)):
            tally[window] = tally.get(window, 0) + sum(t.nbytes for t in msgs.values())


class _KeySums:
    """The dK/dV contributions to each held key, summed [2, B, Hkv, held tokens, hd]: as int64
    limbs (exact: hi and lo stacked in front, each block's converted on its own so the float64
    temporaries stay a block's) or in float, in local query-block order."""

    def __init__(self, exact: bool, keys: Tensor, blk: int) -> None:
        self.exact, self.blk = exact, blk
        self.sums = (torch.zeros((2, *keys.shape), dtype=torch.int64, device=keys.device)
                     if exact else torch.zeros_like(keys, dtype=torch.float32))

    def add(self, at: slice, which: int, g: Tensor) -> None:
        """Adds `g` [B, Hkv, keys, hd] to the dK (`which` 0) or dV (1) sums of keys `at`."""
        sums = self.sums[:, which] if self.exact else self.sums[which]
        for lo in range(0, g.shape[-2], self.blk):
            piece, dst = g[..., lo:lo + self.blk, :], at.start + lo
            if self.exact:
                hi, low = to_limbs(piece, _LIMB_LIMIT, clamp=True)
                piece = torch.stack([hi.view(piece.shape), low.view(piece.shape)])
            sums[..., dst:dst + self.blk, :] += piece


def _return_sums(sums: _KeySums, plan: AttentionPlan, group: dist.ProcessGroup | None,
                 like: Tensor) -> Tensor:
    """This rank's blocks' dK/dV [2, B, Hkv, T/N, hd]: its own contributions plus those its
    peers computed for the spans they fetched (received back along the fetch's routes), added
    in rank order."""
    me, blk, held = plan.split.rank, plan.split.block, sums.sums
    sends = {peer: _spans_of(held, plan, me, blocks) for peer, blocks in plan.fetch.items()}
    recvs = {peer: held.new_empty((*held.shape[:-2], _tokens(plan.spans_for(peer, blocks)),
                                   held.shape[-1]))
             for peer, blocks in plan.send.items()}
    _exchange(sends, recvs, group, plan.window)
    for peer in sorted(plan.send):
        for at, piece in _pieces(recvs[peer], plan, peer, plan.send[peer]):
            held[..., at, :] += piece
    out = [held[..., plan.held_at[j] * blk:(plan.held_at[j] + 1) * blk, :]
           for j in plan.split.blocks()]
    total = torch.cat(out, dim=-2)
    return (from_limbs(total[0], total[1]) if sums.exact else total).to(like.dtype)


def _block_shape(like: Tensor, blk: int) -> torch.Size:
    return torch.Size((*like.shape[:-2], blk, like.shape[-1]))
