"""Event-driven simulation of per-stage action lists: makespan, bubble, throughput, deadlocks.

It executes the lists under the executor's rules — each stage runs its list in order, a receive
blocks until the neighbour's send has arrived, sends are buffered — with given per-stage costs.
The executor posts each receive ahead (`Transport`, train/pipeline_stage.py), so a transfer
travels on the link while both stages compute: an action's input is there at the producer's end
plus the transfer time, and no stage is charged for the transfer itself.
That proves a schedule deadlock-free and gives its time per step, which the benchmark multiplies
by the measured number of steps to a target loss. Lists with V model chunks per stage
(interleaved-1f1b) follow the virtual stages' links, and an F, B or W of one chunk costs 1/V of
the stage's (a chunk is 1/V of its layers). With ``synchronised_updates`` (the flush schedules,
which clip by the global norm: an all-gather over the pipeline at every U) the k-th U of every
stage starts only once all stages have reached it; a stage that gets there first idles.
"""

from __future__ import annotations

from dataclasses import dataclass

from relaytrain.parallel.pipeline.schedules import Action, Schedule, split


@dataclass(frozen=True)
class Costs:
    """Per-stage durations of F, the whole backward and U, and the time a micro-batch's
    activations or gradients take to reach a neighbour. ``weight`` is the weight-gradient part of
    the backward: a split list's W costs that and its B the rest (``None``: 0, a B of the whole
    backward and a free W). ``recompute`` (paci's memory mode) is an extra forward paid at every
    B of that stage; ``None`` means none."""

    forward: tuple[float, ...]
    backward: tuple[float, ...]
    update: tuple[float, ...]
    transfer: float = 0.0
    recompute: tuple[float, ...] | None = None
    weight: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        lengths = {len(self.forward), len(self.backward), len(self.update)}
        for extra in (self.recompute, self.weight):
            if extra is not None:
                lengths.add(len(extra))
        if len(lengths) != 1:
            raise ValueError(f"costs: per-stage tuples differ in length ({sorted(lengths)})")
        values = [
            *self.forward,
            *self.backward,
            *self.update,
            *(self.recompute or ()),
            self.transfer,
        ]
        if min(values) < 0:
            raise ValueError("costs: durations must be >= 0")
        if self.weight is not None and not all(
            0 <= w <= b for w, b in zip(self.weight, self.backward, strict=True)
        ):
            raise ValueError("costs: the weight-gradient part must be in 0..backward")

    @classmethod
    def uniform(
        cls,
        n_stages: int,
        forward: float = 1.0,
        backward: float = 2.0,
        update: float = 0.0,
        transfer: float = 0.0,
        recompute: float = 0.0,
        weight: float = 0.0,
    ) -> Costs:
        """The same costs at every stage (a balanced cut); backward defaults to twice forward."""
        return cls(
            (forward,) * n_stages,
            (backward,) * n_stages,
            (update,) * n_stages,
            transfer,
            (recompute,) * n_stages if recompute else None,
            (weight,) * n_stages if weight else None,
        )

    def duration(self, stage: int, action: Action, is_split: bool = False,
                 chunks: int = 1) -> float:
        """Seconds `action` takes at `stage`, in a split list (B and W apart) or not, the stage
        cut into `chunks` equal model chunks."""
        w = self.weight[stage] if self.weight else 0.0
        if action.kind == "F":
            return self.forward[stage] / chunks
        if action.kind == "B":
            recompute = self.recompute[stage] if self.recompute else 0.0
            return (self.backward[stage] - (w if is_split else 0.0) + recompute) / chunks
        if action.kind == "W":
            return w / chunks
        return self.update[stage]


@dataclass(frozen=True)
class Span:
    """When one action ran."""

    stage: int
    action: Action
    start: float
    end: float


@dataclass(frozen=True)
class SimResult:
    """Outcome of one simulation; the bubble is the idle share of stage time up to the makespan."""

    makespan: float
    busy: tuple[float, ...]
    n_micro: int
    timeline: tuple[Span, ...] = ()

    @property
    def utilisation(self) -> float:
        return sum(self.busy) / (len(self.busy) * self.makespan) if self.makespan else 1.0

    @property
    def bubble_fraction(self) -> float:
        return 1.0 - self.utilisation


class DeadlockError(RuntimeError):
    """The lists cannot complete under blocking receives; the message says who waits on what."""


_Key = tuple[int, int, str, int]  # (stage, chunk, kind, mb) of a finished F, B or W; or
# (stage, 0, "U", k): the stage reached its k-th U (synchronised updates)


def _dependencies(stage: int, action: Action, n_stages: int, chunks: int = 1
                  ) -> list[tuple[_Key, bool]]:
    """What an action waits for, and whether that crosses a link (pays the transfer): the
    neighbouring virtual stage (virtual stage c*S + i is chunk c of stage i)."""
    v = action.chunk * n_stages + stage
    if action.kind == "F":
        return [(((v - 1) % n_stages, (v - 1) // n_stages, "F", action.mb), True)] if v else []
    if action.kind == "B":
        deps = [((stage, action.chunk, "F", action.mb), False)]
        if v < n_stages * chunks - 1:
            deps.append((((v + 1) % n_stages, (v + 1) // n_stages, "B", action.mb), True))
        return deps
    if action.kind == "W":
        return [((stage, action.chunk, "B", action.mb), False)]
    return []


def simulate(actions: Schedule, cost: Costs, *, timeline: bool = False,
             synchronised_updates: bool = False) -> SimResult:
    """List-schedule the actions: each starts when its stage is free and its inputs have arrived
    (producer end + transfer), a U with `synchronised_updates` when every stage has reached its
    U of that number. Raises DeadlockError when some stage can never proceed."""
    n_stages = len(actions)
    if len(cost.forward) != n_stages:
        raise ValueError(f"costs are for {len(cost.forward)} stages, schedule has {n_stages}")
    finished: dict[_Key, float] = {}
    waiting: dict[_Key, list[int]] = {}  # dependency -> the stages blocked on it
    position = [0] * n_stages
    free = [0.0] * n_stages
    busy = [0.0] * n_stages
    spans: list[Span] = []
    ready = list(range(n_stages))
    is_split = [split(acts) for acts in actions]
    chunks = 1 + max((a.chunk for acts in actions for a in acts), default=0)

    def needs(i: int, action: Action) -> list[tuple[_Key, bool]]:
        if synchronised_updates and action.kind == "U":
            return [((j, 0, "U", action.k), False) for j in range(n_stages)]
        return _dependencies(i, action, n_stages, chunks)

    while ready:
        i = ready.pop()
        while position[i] < len(actions[i]):
            action = actions[i][position[i]]
            deps = needs(i, action)
            if synchronised_updates and action.kind == "U":
                arrived = (i, 0, "U", action.k)
                if arrived not in finished:
                    finished[arrived] = free[i]
                    ready.extend(waiting.pop(arrived, ()))
            missing = next((key for key, _ in deps if key not in finished), None)
            if missing is not None:
                waiting.setdefault(missing, []).append(i)
                break
            start = max(
                [free[i]] + [finished[key] + (cost.transfer if link else 0.0) for key, link in deps]
            )
            end = start + cost.duration(i, action, is_split[i], chunks)
            free[i] = end
            busy[i] += end - start
            position[i] += 1
            if timeline:
                spans.append(Span(i, action, start, end))
            if action.kind != "U":
                key = (i, action.chunk, action.kind, action.mb)
                finished[key] = end
                ready.extend(waiting.pop(key, ()))
    blocked = [i for i in range(n_stages) if position[i] < len(actions[i])]
    if blocked:
        detail = "; ".join(
            f"stage {i} at action #{position[i]} ({actions[i][position[i]]}) waits for "
            + ", ".join(
                f"{kind}{mb}{f'.c{c}' if c else ''} of stage {s}"
                for (s, c, kind, mb), _ in needs(i, actions[i][position[i]])
                if (s, c, kind, mb) not in finished
            )
            for i in blocked
        )
        raise DeadlockError(f"schedule deadlocks: {detail}")
    n_micro = len({a.mb for acts in actions for a in acts if a.kind == "F"})
    spans.sort(key=lambda s: (s.start, s.stage))
    return SimResult(max(free, default=0.0), tuple(busy), n_micro, tuple(spans))
