"""Specification of the schedule simulator: timing rules, textbook bubbles, deadlock detection."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from itertools import product

import pytest

from relaytrain.parallel.pipeline.schedules import SCHEDULES, Action, build_schedule
from relaytrain.parallel.pipeline.simulate import Costs, DeadlockError, simulate

U = Action("U", k=1)


@dataclass(frozen=True)
class SteadyState:
    """Time per global batch once the pipeline is full, and the stage utilisation then."""

    time_per_batch: float
    utilisation: float

    @property
    def bubble_fraction(self) -> float:
        return 1.0 - self.utilisation


def simulate_steady(name: str, n_stages: int, micro_per_batch: int, cost: Costs, *,
                    a: int = 1, **options: bool) -> SteadyState:
    """Steady-state time per global batch: the makespan growth from n to 2n batches divided by
    n, so the fill and drain of an asynchronous pipeline (paid once per span) cancel, while a
    flush schedule pays its bubble in every batch; n covers the warm-up (2S micro-batches)."""
    n = max(2, math.ceil(2 * n_stages / micro_per_batch))
    short, long = (simulate(build_schedule(name, n_stages, micro_per_batch, batches, a=a,
                                           **options), cost)
                   for batches in (n, 2 * n))
    time_per_batch = (long.makespan - short.makespan) / n
    work_per_batch = (sum(long.busy) - sum(short.busy)) / n
    utilisation = work_per_batch / (n_stages * time_per_batch) if time_per_batch else 1.0
    return SteadyState(time_per_batch, utilisation)


def F(mb: int) -> Action:
    return Action("F", mb)


def B(mb: int) -> Action:
    return Action("B", mb)


def test_an_action_starts_when_its_stage_is_free_and_its_input_has_arrived():
    # two stages, one micro-batch: F0 | transfer | F1, B1 | transfer | B0, then both update
    cost = Costs((1.0, 2.0), (3.0, 4.0), (0.5, 0.25), transfer=0.1)
    result = simulate([[F(0), B(0), U], [F(0), B(0), U]], cost, timeline=True)
    spans = [(s.stage, str(s.action), s.start, s.end) for s in result.timeline]
    assert [x[:2] for x in spans] == [
        (0, "F0"),
        (1, "F0"),
        (1, "B0"),
        (1, "U1"),
        (0, "B0"),
        (0, "U1"),
    ]
    assert [t for x in spans for t in x[2:]] == pytest.approx(
        [0.0, 1.0, 1.1, 3.1, 3.1, 7.1, 7.1, 7.35, 7.2, 10.2, 10.2, 10.7]
    )
    assert result.makespan == pytest.approx(10.7)
    assert result.busy == pytest.approx((4.5, 6.25))
    assert result.bubble_fraction == pytest.approx(1 - 10.75 / 21.4)


def test_synchronised_updates_wait_for_every_stage_to_reach_them():
    # the same lists as a flush schedule runs them (a global-norm all-gather at U): stage 1
    # reaches U1 at 7.1 but starts it with stage 0, at 10.2
    cost = Costs((1.0, 2.0), (3.0, 4.0), (0.5, 0.25), transfer=0.1)
    result = simulate([[F(0), B(0), U], [F(0), B(0), U]], cost, timeline=True,
                      synchronised_updates=True)
    updates = {s.stage: (s.start, s.end) for s in result.timeline if s.action.kind == "U"}
    assert updates == {0: pytest.approx((10.2, 10.7)), 1: pytest.approx((10.2, 10.45))}
    assert result.busy == pytest.approx((4.5, 6.25))  # the wait is idle time
    assert result.utilisation == pytest.approx(10.75 / 21.4)


def test_recompute_is_paid_at_every_backward():
    plain = simulate(build_schedule("paci", 1, 4, 1), Costs.uniform(1, update=0.5))
    mem = simulate(build_schedule("paci", 1, 4, 1), Costs.uniform(1, update=0.5, recompute=1.0))
    assert plain.makespan == pytest.approx(4 * 3 + 4 * 0.5)
    assert mem.makespan == pytest.approx(plain.makespan + 4 * 1.0)


@pytest.mark.parametrize("name", SCHEDULES)
def test_timeline_obeys_stage_order_and_point_to_point_dependencies(name):
    """... between virtual stages: chunk c of stage i is virtual stage cS + i (one chunk but for
    interleaved-1f1b, whose micro-batches come in groups of S)."""
    rng = random.Random(0)
    for S, M, N in product(range(1, 6), (1, 3, 5), (1, 2)):
        V, opts = (2, {"virtual": 2}) if name == "interleaved-1f1b" else (1, {})
        M = M * S if V > 1 else M
        cost = Costs(
            *(tuple(rng.uniform(0.5, 2) for _ in range(S)) for _ in range(3)),
            transfer=rng.uniform(0, 0.5),
            weight=tuple(rng.uniform(0, 0.5) for _ in range(S)),
        )
        actions = build_schedule(name, S, M, N, **opts)
        result = simulate(actions, cost, timeline=True)
        assert len(result.timeline) == sum(map(len, actions))
        end = {(s.stage, s.action.chunk, s.action.kind, s.action.mb): s.end
               for s in result.timeline}
        for stage in range(S):
            spans = [s for s in result.timeline if s.stage == stage]
            assert [s.action for s in spans] == actions[stage]  # in list order, never overlapping
            assert all(x.end <= y.start + 1e-12 for x, y in zip(spans, spans[1:], strict=False))
            for s in spans:
                kind, mb, v = s.action.kind, s.action.mb, s.action.chunk * S + stage
                if kind == "F" and v > 0:
                    before = end[((v - 1) % S, (v - 1) // S, "F", mb)]
                    assert s.start >= before + cost.transfer - 1e-12
                if kind == "B" and v < S * V - 1:
                    after = end[((v + 1) % S, (v + 1) // S, "B", mb)]
                    assert s.start >= after + cost.transfer - 1e-12
                if kind == "W":
                    assert s.start >= end[(stage, 0, "B", mb)] - 1e-12
        assert result.makespan == pytest.approx(max(s.end for s in result.timeline))


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_flush_bubble_matches_the_textbook_s_minus_1_over_m_plus_s_minus_1(name):
    for S, M in product(range(1, 9), range(1, 17)):
        textbook = (S - 1) / (M + S - 1)
        one_batch = simulate(build_schedule(name, S, M, 1), Costs.uniform(S))
        assert one_batch.bubble_fraction == pytest.approx(textbook)
        steady = simulate_steady(name, S, M, Costs.uniform(S))
        assert steady.bubble_fraction == pytest.approx(textbook)
        assert steady.time_per_batch == pytest.approx((M + S - 1) * 3.0)


def test_paci_keeps_the_pipeline_full_across_global_batches():
    span = simulate(build_schedule("paci", 8, 8, 16), Costs.uniform(8))
    assert span.utilisation >= 0.9
    for S, a in product((2, 4, 8), (1, 2, 4, 8)):  # a divides M: every batch has M/a updates
        steady = simulate_steady("paci", S, 8, Costs.uniform(S, update=0.25), a=a)
        assert steady.utilisation == pytest.approx(1.0)
        assert steady.time_per_batch == pytest.approx(8 * (3.0 + 0.25 / a))


def test_paci_split_hides_the_transfers_that_paci_exposes_on_its_round_trips():
    """Stage 0's S micro-batches in flight each go to the last stage and back through
    2 (S - 1) transfers t: with the whole backward on that trip they add 2 t (S-1) / S per
    micro-batch; with W after the input gradient is sent, W (>= 2 t) covers them."""
    S, M, t = 8, 8, 0.1
    cost = Costs.uniform(S, transfer=t, weight=0.8)  # F 1, B 2 of which W 0.8
    whole = simulate_steady("paci", S, M, cost, a=M)
    split = simulate_steady("paci", S, M, cost, a=M, split=True)
    assert whole.time_per_batch == pytest.approx(M * (3.0 + 2 * t * (S - 1) / S))
    assert split.time_per_batch == pytest.approx(M * 3.0)
    assert split.utilisation == pytest.approx(1.0)


def test_async_schedules_beat_1f1b_per_global_batch_in_steady_state():
    for S in (2, 4, 8):
        cost = Costs.uniform(S, update=0.1, transfer=0.05)
        flush = simulate_steady("1f1b", S, S, cost).time_per_batch
        for name in ("paci", "pipedream"):
            assert simulate_steady(name, S, S, cost).time_per_batch < flush


def test_a_schedule_that_cannot_complete_raises_deadlock_naming_who_waits_on_what():
    # stage 0 waits for B0 before sending F1; stage 1 wants F1 before it will run B0
    bad = [[F(0), B(0), F(1), B(1), U], [F(0), F(1), B(0), B(1), U]]
    with pytest.raises(DeadlockError) as err:
        simulate(bad, Costs.uniform(2))
    assert "stage 0 at action #1 (B0) waits for B0 of stage 1" in str(err.value)
    assert "stage 1 at action #1 (F1) waits for F1 of stage 0" in str(err.value)


def test_a_backward_listed_before_its_forward_deadlocks():
    with pytest.raises(DeadlockError, match="waits for F0 of stage 0"):
        simulate([[B(0), F(0), U]], Costs.uniform(1))


def test_a_split_list_pays_the_weight_part_at_w_and_the_rest_at_b():
    cost = Costs((1.0,), (3.0,), (0.5,), weight=(1.25,))
    whole = simulate(build_schedule("1f1b", 1, 2, 1), cost, timeline=True)
    split = simulate(build_schedule("zb-h1", 1, 2, 1), cost, timeline=True)
    assert [s.end - s.start for s in whole.timeline] == [1.0, 3.0, 1.0, 3.0, 0.5]
    assert [(str(s.action), s.end - s.start) for s in split.timeline] == [
        ("F0", 1.0), ("B0", 1.75), ("W0", 1.25), ("F1", 1.0), ("B1", 1.75), ("W1", 1.25),
        ("U1", 0.5)]
    assert split.makespan == whole.makespan


def test_costs_must_match_the_schedule_and_be_non_negative():
    with pytest.raises(ValueError, match="differ in length"):
        Costs((1.0,), (1.0, 1.0), (0.0,))
    with pytest.raises(ValueError, match=">= 0"):
        Costs.uniform(2, transfer=-1.0)
    with pytest.raises(ValueError, match="weight-gradient part must be in 0..backward"):
        Costs.uniform(2, backward=1.0, weight=1.5)
    with pytest.raises(ValueError, match="costs are for 3 stages, schedule has 2"):
        simulate(build_schedule("1f1b", 2, 2, 1), Costs.uniform(3))
