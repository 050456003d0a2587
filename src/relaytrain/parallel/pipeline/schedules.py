"""Pipeline schedules as pure per-stage action lists, and their analysis.

A schedule is a deterministic function of its arguments: one list of actions per stage, which one
executor runs in order with blocking point-to-point receives. Even the asynchronous schedules
therefore give the same numbers bit for bit whatever the timing; only the list order matters.

Contract with the executor (S stages, M = ``micro_per_batch``, one *span* of ``n_batches`` global
batches; the pipeline is empty at the start and at the end of every span):

- Micro-batches are numbered ``0 .. n_batches*M - 1`` in data order; micro-batch ``m`` is
  micro-batch ``m % M`` of global batch ``m // M`` of the span.
- ``F(m)``: forward of ``m``. Stage 0 reads the input, other stages receive the activations from
  stage i-1; every stage but the last sends its output to stage i+1 (buffered send).
- ``B(m)``: backward of ``m``. The last stage computes the loss, other stages receive the output
  gradient from stage i+1; every stage but the first sends its input gradient to stage i-1. The
  parameter gradient is accumulated into the stage's gradient buffer in list order.
- ``W(m)`` (zb-h1, and paci with ``split``): the weight gradient of ``m``. A list with W's is
  *split*: its ``B(m)`` computes only the input gradient (sent upstream at once) and keeps what
  ``W(m)`` needs, and ``W(m)``, not ``B(m)``, accumulates the parameter gradient. Otherwise B
  does both.
- ``U(k)``: this stage's optimizer step with the gradient accumulated since its previous ``U``
  (its *update group*, see :func:`update_groups`), then the buffer is cleared. ``k`` counts the
  updates of this stage in the span from 1. Every ``B`` of a list is followed by some ``U``.
- ``chunk`` (``interleaved-1f1b`` only, else 0): the rank holds V model chunks, the model is cut
  into S*V *virtual stages* and rank i holds virtual stages i, i+S, ..., i+(V-1)S; an action runs
  chunk ``chunk`` (virtual stage ``chunk*S + i``). Its F receives from virtual stage s-1 (rank
  S-1's previous chunk for the first rank) and sends to s+1; B the reverse. Only virtual stage 0
  reads the input and only virtual stage S*V-1 computes the loss.
- ``version`` (``pipedream`` only, else ``None``): ``F(m)`` and ``B(m)`` run with this stage's
  weights as they were after ``version`` updates in the span (0: the weights at span start), so
  the executor stashes that version at ``F(m)`` and may drop it after ``B(m)``. ``None``: use the
  live weights, whatever updates happened in between (paci's bounded inconsistency).

Every schedule accumulates the gradients of a stage in ascending micro-batch order (FIFO), so the
k-th update of every stage covers the same micro-batches, and gpipe, 1f1b and zb-h1 sum
per-micro-batch gradients in the same order (bit-identical gradients).
"""

from __future__ import annotations

import math
import typing
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

# `parallel.schedule`
ScheduleName = Literal["gpipe", "1f1b", "zb-h1", "interleaved-1f1b", "pipedream", "paci"]
SCHEDULES: tuple[str, ...] = typing.get_args(ScheduleName)
# Flush schedules drain the pipeline at every global batch: no update with a micro-batch in
# flight, so exact gradients. The others are asynchronous and run in spans of steps.
FLUSH_SCHEDULES = ("gpipe", "1f1b", "zb-h1", "interleaved-1f1b")


def asynchronous(name: str) -> bool:
    """Whether schedule `name` updates weights while micro-batches are in flight."""
    return name not in FLUSH_SCHEDULES


# Keyword options each schedule takes; any other option left at a non-default value is an error,
# so that a setting never silently does nothing.
_OPTIONS = {
    "gpipe": frozenset(),
    "1f1b": frozenset(),
    "zb-h1": frozenset(),
    "interleaved-1f1b": frozenset({"virtual"}),
    "pipedream": frozenset({"a", "in_flight"}),
    "paci": frozenset({"a", "in_flight", "flush", "split"}),
}


@dataclass(frozen=True, slots=True)
class Action:
    """One step of a stage's list: ``F``/``B``/``W`` of micro-batch ``mb`` (through model chunk
    ``chunk``), or update ``U`` number ``k``.

    ``mb`` is -1 for ``U``; ``k`` is 0 for the others; ``version`` is the stashed weight version
    for weight-stashing schedules and ``None`` otherwise (see the module docstring).
    """

    kind: Literal["F", "B", "W", "U"]
    mb: int = -1
    k: int = 0
    version: int | None = None
    chunk: int = 0

    def __str__(self) -> str:
        if self.kind == "U":
            return f"U{self.k}"
        return (f"{self.kind}{self.mb}" + (f".c{self.chunk}" if self.chunk else "")
                + ("" if self.version is None else f"@v{self.version}"))


Schedule = list[list[Action]]


def in_flight_limit(stage: int, n_stages: int, in_flight: int | None = None) -> int:
    """Most micro-batches stage ``stage`` holds between their F and B.

    S - i by default: that is what keeps every stage busy under uniform costs; ``in_flight`` caps
    it (a memory limit) and never raises it, since more would only add staleness and memory.
    """
    return n_stages - stage if in_flight is None else min(in_flight, n_stages - stage)


def build_schedule(
    name: str,
    n_stages: int,
    micro_per_batch: int,
    n_batches: int,
    *,
    a: int = 1,
    in_flight: int | None = None,
    flush: bool = False,
    virtual: int = 1,
    split: bool = False,
) -> Schedule:
    """Per-stage action lists of schedule ``name`` over one span of ``n_batches`` global batches.

    - ``gpipe``: per global batch, all F then all B (ascending order, like 1f1b, so gradients
      accumulate in the same order), then one U; flush.
    - ``1f1b``: per global batch, S-i-1 warm-up forwards at stage i, then one forward one
      backward, cool-down backwards, then one U; flush.
    - ``zb-h1`` (ZB-H1, arXiv 2401.10241): 1f1b's order of F and B with the backward split into
      B (input gradient) and W (weight gradient); stage i runs the W of its j-th B right after
      its (j+d)-th B, d = `zb_w_delay(i, S)` (the rest before the U), so the later stages, whose
      B's the earlier ones wait for, push their W's into the cool-down, where 1f1b idles. A
      stage holds at most S-i micro-batches awaiting B and d awaiting W: 1f1b's peak (S, at
      stage 0); flush.
    - ``interleaved-1f1b`` (Narayanan et al. 2021; Megatron's and torch's
      ``ScheduleInterleaved1F1B``): ``virtual`` = V chunks per rank, see `_interleaved`; M must be
      a multiple of S (micro-batches go round the ranks in groups of S); flush.
    - ``pipedream``: asynchronous 1F1B over the whole span (no flush), a U after every ``a``
      local backwards, weight stashing (``version``); at most ``in_flight`` micro-batches held.
    - ``paci``: the same order without stashing: a micro-batch crosses at most
      ceil((S-i-1)/a) updates at stage i with a single weight copy. ``flush=True`` schedules each
      global batch on its own and never lets an update group span two batches (the last group of a
      batch may be short), so ``a = micro_per_batch`` reproduces ``1f1b`` exactly. ``split``
      runs each B's W right after it: the input gradient goes upstream before the weight
      gradient is formed, which takes W off the round trip a micro-batch makes from stage i to
      the last stage and back. That trip holds the S - i micro-batches stage i may have in
      flight, so with W on it every hop's transfer shows as bubble (2 t (S-1)/S per micro-batch
      at stage 0, and through it at every stage); with W off it the transfers hide behind
      the W's as long as W >= 2 t. Same micro-batches held (W follows B at once), same bits.

    A trailing partial update group at the end of the span gets its own U, so that no gradient is
    left unapplied when the span ends. All lists are deadlock-free under blocking receives
    because the in-flight limit never grows with the stage index.
    """
    sizes = {
        "n_stages": n_stages,
        "micro_per_batch": micro_per_batch,
        "n_batches": n_batches,
        "a": a,
        "in_flight": 1 if in_flight is None else in_flight,
        "virtual": virtual,
    }
    _check_arguments(name, sizes, {"a": a != 1, "in_flight": in_flight is not None,
                                   "flush": flush, "virtual": virtual != 1, "split": split})
    M, S = micro_per_batch, n_stages
    batches = [range(b * M, (b + 1) * M) for b in range(n_batches)]
    span = [range(n_batches * M)]
    if name == "gpipe":
        return [_stage_actions(batches, M, M, stash=False) for _ in range(S)]
    if name == "interleaved-1f1b":
        if M % S:
            raise ValueError(f"interleaved-1f1b: micro_per_batch {M} must be a multiple of "
                             f"n_stages {S}")
        return [_interleaved(batches, i, S, virtual) for i in range(S)]
    if name in ("1f1b", "zb-h1"):
        return [
            _stage_actions(batches, S - i, M, stash=False,
                           w_delay=zb_w_delay(i, S) if name == "zb-h1" else None)
            for i in range(S)
        ]
    segments = batches if flush else span
    return [
        _stage_actions(segments, in_flight_limit(i, S, in_flight), a, stash=name == "pipedream",
                       w_delay=0 if split else None)
        for i in range(S)
    ]


def _check_arguments(name: str, sizes: dict[str, int], given: dict[str, bool]) -> None:
    """`build_schedule`'s arguments: a known schedule, sizes >= 1, only the options it takes."""
    if name not in _OPTIONS:
        raise ValueError(f"schedule {name!r}: expected one of {', '.join(SCHEDULES)}")
    for what, value in sizes.items():
        if value < 1:
            raise ValueError(f"{what}: got {value}, expected >= 1")
    unknown = sorted(opt for opt, is_set in given.items() if is_set and opt not in _OPTIONS[name])
    if unknown:
        raise ValueError(
            f"schedule {name!r} takes no option {unknown}; "
            f"it takes {sorted(_OPTIONS[name]) or 'none'}"
        )


def zb_w_delay(stage: int, n_stages: int) -> int:
    """How many B's zb-h1's stage `stage` runs before the W of an earlier one: its index (the
    paper's ZB-H1), except that the last stage defers as many as the stage before it (S - 2).
    The last stage's micro-batch awaiting B also holds the LM head and loss (the head's
    precomputed weight gradient, vocab x d_model: the largest activation), so S - 1 W's
    there would take its peak above the first stage's S micro-batches, which bound every
    other stage's (bench pipeline: 1.27x 1f1b's at S = 4 with S - 1, 1.06x with S - 2). The
    W it no longer defers costs one W of the makespan, T_W: (S-1)(F+B-W) + W of bubble."""
    return max(0, min(stage, n_stages - 2))


def _one_f_one_b(mbs: Sequence[int], limit: int) -> list[tuple[str, int]]:
    """F/B order of one segment holding at most ``limit`` micro-batches between F and B."""
    n = len(mbs)
    warm = min(limit, n) - 1
    order = [("F", m) for m in mbs[:warm]]
    for j in range(n - warm):
        order += [("F", mbs[warm + j]), ("B", mbs[j])]
    return order + [("B", m) for m in mbs[n - warm :]]


def _interleaved(segments: Sequence[Sequence[int]], rank: int, S: int, V: int) -> list[Action]:
    """Rank ``rank``'s interleaved-1F1B list, per segment (global batch) of M micro-batches.

    The segment's k-th forward is chunk (k mod SV) div S of micro-batch (k div SV) S + k mod S:
    each chunk takes S micro-batches in turn. The k-th backward is that micro-batch's at chunk
    V-1 minus that. Warm-up: 2(S-rank-1) + (V-1)S forwards (all, if fewer), then one forward one
    backward, then the cool-down backwards, then one U. Every chunk thus sees its micro-batches
    in ascending order for F and for B (FIFO accumulation, like 1f1b), and the rank's B's run in
    the reverse order of the chunks' F's, which is what the dependencies across ranks need."""
    out: list[Action] = []
    for u, segment in enumerate(segments, start=1):
        n = len(segment) * V
        warm = min(2 * (S - rank - 1) + (V - 1) * S, n)
        out += [_virtual(segment, k, S, V, False) for k in range(warm)]
        for k in range(n - warm):
            out += [_virtual(segment, warm + k, S, V, False), _virtual(segment, k, S, V, True)]
        out += [_virtual(segment, k, S, V, True) for k in range(n - warm, n)]
        out.append(Action("U", k=u))
    return out


def _virtual(segment: Sequence[int], k: int, S: int, V: int, backward: bool) -> Action:
    """The k-th forward (or backward) of a segment in interleaved order (see `_interleaved`)."""
    chunk = k % (S * V) // S
    mb = segment[k // (S * V) * S + k % S]
    return Action("B" if backward else "F", mb, chunk=V - 1 - chunk if backward else chunk)


def _with_weight_passes(order: list[tuple[str, int]], delay: int) -> list[tuple[str, int]]:
    """A segment's F/B order with the W of its j-th B placed right after its (j+delay)-th B,
    the W's left over at the segment's end (ascending, so gradients accumulate FIFO)."""
    out: list[tuple[str, int]] = []
    backwards: list[int] = []
    for kind, m in order:
        out.append((kind, m))
        if kind == "B":
            backwards.append(m)
            if len(backwards) > delay:
                out.append(("W", backwards[len(backwards) - 1 - delay]))
    return out + [("W", m) for m in backwards[max(0, len(backwards) - delay) :]]


def _stage_actions(
    segments: Sequence[Sequence[int]],
    limit: int,
    a: int,
    *,
    stash: bool,
    w_delay: int | None = None,
) -> list[Action]:
    """One stage's list: 1F1B order per segment (split by ``_with_weight_passes`` given
    ``w_delay``), a U after every ``a`` accumulated gradients and at the end of each segment (so
    no update group spans two segments)."""
    out: list[Action] = []
    updates = pending = 0
    version: dict[int, int | None] = {}
    accumulate = "B" if w_delay is None else "W"
    for segment in segments:
        order = _one_f_one_b(segment, limit)
        if w_delay is not None:
            order = _with_weight_passes(order, w_delay)
        for kind, m in order:
            if kind == "F":
                version[m] = updates if stash else None
                out.append(Action("F", m, version=version[m]))
                continue
            out.append(Action(kind, m, version=version[m]))  # type: ignore[arg-type]
            if kind != accumulate:
                continue
            del version[m]
            pending += 1
            if pending == a:
                updates, pending = updates + 1, 0
                out.append(Action("U", k=updates))
        if pending:
            updates, pending = updates + 1, 0
            out.append(Action("U", k=updates))
    return out


# --------------------------------------------------------------------------------------------
# Analysis: pure functions of the action lists (what the executor will actually execute).


def split(acts: Sequence[Action]) -> bool:
    """Whether a stage's list splits its backward into B and W (see the module docstring)."""
    return any(act.kind == "W" for act in acts)


def validate(actions: Schedule) -> None:
    """Raise ValueError unless the lists are well formed for the executor.

    Every stage handles the same micro-batches, each with exactly one F, later one B and, in a
    split list, after that one W, at every chunk (virtual stage) it holds; U's are numbered 1,
    2, ... and no gradient is left after the last U; a stashed version is one the stage already
    has and is the same for F, B and W. A micro-batch's F at chunk c follows its F at chunk c-1
    and its B at chunk c follows its B at chunk c+1 (the order the virtual stages in between
    impose). Each chunk's gradients accumulate (its B's, or W's in a split list) in ascending
    micro-batch order: the order every schedule sums in, hence the same bits for all flush
    schedules in fast mode. (Deadlock-freedom across stages is checked by simulation, the
    memory bound by `in_flight_peaks`.)
    """
    expected: set[int] | None = None
    for i, acts in enumerate(actions):
        where = f"stage {i}"
        # (chunk, micro-batch) -> (version, the action it waits for next)
        open_: dict[tuple[int, int], tuple[int | None, str]] = {}
        done: set[tuple[int, int]] = set()
        backed: set[tuple[int, int]] = set()
        accumulated: dict[int, int] = {}  # chunk -> the latest micro-batch it accumulated
        chunks = 1 + max((act.chunk for act in acts), default=0)
        updates = pending = 0
        last = "W" if split(acts) else "B"
        for n, act in enumerate(acts):
            at = f"{where} action #{n} ({act})"
            if act.kind == "U":
                if act.mb != -1 or act.k != updates + 1:
                    raise ValueError(f"{at}: expected U{updates + 1} with mb -1")
                updates, pending = updates + 1, 0
                continue
            if act.kind not in ("F", "B", "W") or act.mb < 0 or act.k != 0 or act.chunk < 0:
                raise ValueError(f"{at}: expected F, B or W of a micro-batch >= 0 with k 0")
            key = (act.chunk, act.mb)
            if act.version is not None and not 0 <= act.version <= updates:
                raise ValueError(f"{at}: version must be in 0..{updates}, the versions so far")
            if act.kind == "F":
                if key in open_ or key in done:
                    raise ValueError(f"{at}: second forward of micro-batch {act.mb}")
                if act.chunk and (act.chunk - 1, act.mb) not in open_.keys() | done:
                    raise ValueError(f"{at}: before the micro-batch's forward at chunk "
                                     f"{act.chunk - 1}")
                open_[key] = (act.version, "B")
                continue
            if key not in open_:
                raise ValueError(f"{at}: {'backward' if act.kind == 'B' else 'weight pass'} "
                                 "without a pending forward")
            if act.kind == "B" and act.chunk < chunks - 1 and (act.chunk + 1, act.mb) not in backed:
                raise ValueError(f"{at}: before the micro-batch's backward at chunk "
                                 f"{act.chunk + 1}")
            version, waits_for = open_[key]
            if waits_for != act.kind:
                raise ValueError(f"{at}: expected {waits_for}{act.mb} first")
            if version != act.version:
                raise ValueError(f"{at}: version differs from its forward's")
            if act.kind == "B":
                backed.add(key)
            if act.kind == last:
                if accumulated.get(act.chunk, -1) > act.mb:
                    raise ValueError(f"{at}: accumulates after micro-batch "
                                     f"{accumulated[act.chunk]} (ascending order expected)")
                accumulated[act.chunk] = act.mb
                del open_[key]
                done.add(key)
                pending += 1
            else:
                open_[key] = (version, "W")
        if open_ or pending:
            raise ValueError(
                f"{where}: micro-batches {sorted({m for _, m in open_})} never finish their "
                f"backward or "
                f"{pending} gradients never applied"
            )
        if expected is None:
            expected = done
        elif done != expected:
            raise ValueError(
                f"{where}: micro-batches differ from stage 0's ({sorted(done ^ expected)})"
            )


def in_flight_peaks(actions: Schedule) -> list[int]:
    """Per stage, the peak number of micro-batches held between their F and the end of their
    backward (B, or W in a split list): the activation memory in units of one micro-batch's
    (with chunks, of one micro-batch's at one chunk: 1/V of the stage's)."""
    peaks = []
    for acts in actions:
        last = "W" if split(acts) else "B"
        held = peak = 0
        for act in acts:
            held += 1 if act.kind == "F" else -1 if act.kind == last else 0
            peak = max(peak, held)
        peaks.append(peak)
    return peaks


def staleness(actions: Schedule) -> dict[tuple[int, int], int]:
    """(stage, mb) -> updates of that stage between F(mb) and B(mb).

    For schedules without stashing this is the weight inconsistency the micro-batch saw; with
    stashing (pipedream) F and B use the same weights and it is the delay of its gradient.
    """
    out: dict[tuple[int, int], int] = {}
    for i, acts in enumerate(actions):
        updates = 0
        at_forward: dict[int, int] = {}
        for act in acts:
            if act.kind == "U":
                updates += 1
            elif act.kind == "F":
                at_forward[act.mb] = updates
            elif act.kind == "B":
                out[(i, act.mb)] = updates - at_forward[act.mb]
    return out


def staleness_bound(
    name: str, stage: int, n_stages: int, a: int = 1, in_flight: int | None = None
) -> int:
    """Most updates a micro-batch can cross at ``stage``: 0 for the flush schedules, and
    ceil((L-1)/a) with L the in-flight limit (S-i by default) for paci and pipedream — PACI's
    bound. For pipedream this is gradient delay only: stashing keeps F and B consistent."""
    if name not in _OPTIONS:
        raise ValueError(f"schedule {name!r}: expected one of {', '.join(SCHEDULES)}")
    if not asynchronous(name):
        return 0
    return math.ceil((in_flight_limit(stage, n_stages, in_flight) - 1) / a)


def weight_versions(actions: Schedule) -> list[int]:
    """Per stage, the peak number of weight copies held at once: the live weights plus every
    version still stashed for an in-flight micro-batch (1 when nothing is stashed)."""
    peaks = []
    for acts in actions:
        live = 0
        stashed: dict[int, int] = {}
        peak = 1
        for act in acts:
            if act.kind == "U":
                live += 1
            elif act.version is None:
                continue
            elif act.kind == "F":
                stashed[act.mb] = act.version
            elif act.kind == ("W" if split(acts) else "B"):
                del stashed[act.mb]
            peak = max(peak, len(set(stashed.values()) | {live}))
        peaks.append(peak)
    return peaks


def update_groups(actions: Schedule) -> list[list[tuple[int, ...]]]:
    """Per stage, the micro-batches of each update in accumulation order (FIFO property: the
    k-th group is the same at every stage, so all stages step on the same data); with chunks,
    in chunk 0's order (every chunk accumulates the same micro-batches)."""
    out = []
    for acts in actions:
        groups: list[tuple[int, ...]] = []
        current: list[int] = []
        accumulate = "W" if split(acts) else "B"
        for act in acts:
            if act.kind == accumulate and act.chunk == 0:
                current.append(act.mb)
            elif act.kind == "U":
                groups.append(tuple(current))
                current = []
        out.append(groups)
    return out
