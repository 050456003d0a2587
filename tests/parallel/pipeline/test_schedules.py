"""Specification of the pipeline schedules, checked exhaustively over small sizes.

Sizes: S stages in 1..6, M micro-batches per global batch in 1..8, 1..3 global batches per span,
local accumulation a in 1..4 for the asynchronous schedules, V in 1..3 model chunks per stage for
interleaved-1f1b (M a multiple of S).
"""

from __future__ import annotations

import math
import re
from itertools import product

import pytest

from relaytrain.config import load_config
from relaytrain.errors import ConfigError
from relaytrain.parallel.pipeline.schedules import (
    SCHEDULES,
    Action,
    Schedule,
    asynchronous,
    build_schedule,
    in_flight_limit,
    in_flight_peaks,
    split,
    staleness,
    staleness_bound,
    update_groups,
    validate,
    weight_versions,
    zb_w_delay,
)
from relaytrain.parallel.pipeline.simulate import Costs, simulate


def max_in_flight(actions: Schedule) -> list[int]:
    """Per stage, the peak number of micro-batches between F and B (activation memory)."""
    peaks = []
    for acts in actions:
        held = peak = 0
        for act in acts:
            held += {"F": 1, "B": -1}.get(act.kind, 0)  # W, U: no change
            peak = max(peak, held)
        peaks.append(peak)
    return peaks


FLUSH = ("gpipe", "1f1b", "zb-h1", "interleaved-1f1b")


SIZES = list(product(range(1, 7), range(1, 9), range(1, 4)))  # (S, M, n_batches)
A = range(1, 5)


def cases(name: str):
    """Every (S, M, n_batches, options) the exhaustive checks cover for schedule ``name``."""
    for S, M, N in SIZES:
        if name == "interleaved-1f1b":
            if M % S == 0:
                for V in range(1, 4):
                    yield S, M, N, {"virtual": V}
        elif name in FLUSH:
            yield S, M, N, {}
        elif name == "pipedream":
            for a in A:
                yield S, M, N, {"a": a}
        else:
            for a, flush in product(A, (False, True)):
                yield S, M, N, {"a": a, "flush": flush}
                yield S, M, N, {"a": a, "flush": flush, "split": True}
            if S > 2:
                yield S, M, N, {"in_flight": 2}


def batch(b: int, M: int) -> tuple[int, ...]:
    return tuple(range(b * M, (b + 1) * M))


@pytest.mark.parametrize("name", SCHEDULES)
def test_every_micro_batch_gets_one_forward_then_one_backward_at_every_stage(name):
    """... at every virtual stage: each of a stage's model chunks (one but for interleaved)."""
    for S, M, N, opts in cases(name):
        actions = build_schedule(name, S, M, N, **opts)
        assert len(actions) == S
        validate(actions)
        for acts in actions:
            is_split = name == "zb-h1" or opts.get("split", False)
            assert split(acts) == is_split
            assert {x.chunk for x in acts if x.kind != "U"} == set(range(opts.get("virtual", 1)))
            for chunk in range(opts.get("virtual", 1)):
                forwards = [x.mb for x in acts if x.kind == "F" and x.chunk == chunk]
                backwards = [x.mb for x in acts if x.kind == "B" and x.chunk == chunk]
                weights = [x.mb for x in acts if x.kind == "W" and x.chunk == chunk]
                assert sorted(forwards) == sorted(backwards) == list(range(M * N))
                assert weights == (backwards if is_split else [])
                # data order: forwards and backwards both ascend, so gradients accumulate FIFO
                assert forwards == sorted(forwards) and backwards == sorted(backwards)


@pytest.mark.parametrize("name", SCHEDULES)
def test_executes_without_deadlock_under_blocking_receives(name):
    for S, M, N, opts in cases(name):
        simulate(build_schedule(name, S, M, N, **opts), Costs.uniform(S))


@pytest.mark.parametrize("name", SCHEDULES)
def test_schedules_are_pure_functions_of_their_arguments(name):
    opts = {"virtual": 2} if name == "interleaved-1f1b" else {}
    assert build_schedule(name, 4, 8, 3, **opts) == build_schedule(name, 4, 8, 3, **opts)


@pytest.mark.parametrize("name", FLUSH)
def test_flush_schedules_update_once_per_global_batch_with_zero_staleness(name):
    for S, M, N, opts in cases(name):
        actions = build_schedule(name, S, M, N, **opts)
        assert set(staleness(actions).values()) == {0}
        assert update_groups(actions) == [[batch(b, M) for b in range(N)]] * S
        # F, B (and W) of each at each chunk, one U
        per_batch = (3 if name == "zb-h1" else 2) * M * opts.get("virtual", 1) + 1
        for acts in actions:  # flush: nothing of batch b+1 starts before batch b's update
            kinds = [x.kind for x in acts]
            assert [i for i, k in enumerate(kinds) if k == "U"] == [
                (b + 1) * per_batch - 1 for b in range(N)
            ]


def test_gpipe_runs_all_forwards_before_backwards_and_holds_the_whole_batch():
    for S, M, N, _ in cases("gpipe"):
        actions = build_schedule("gpipe", S, M, N)
        assert max_in_flight(actions) == [M] * S
        for acts in actions:
            one_batch = "".join(x.kind for x in acts[: 2 * M + 1])
            assert one_batch == "F" * M + "B" * M + "U"


def test_1f1b_warms_up_s_minus_i_minus_1_forwards_and_holds_min_s_minus_i_m():
    for S, M, N, _ in cases("1f1b"):
        actions = build_schedule("1f1b", S, M, N)
        assert max_in_flight(actions) == [min(S - i, M) for i in range(S)]
        for i, acts in enumerate(actions):
            warm = min(S - i - 1, M)
            assert [x.kind for x in acts[: warm + 1]] == ["F"] * warm + ["F" if warm < M else "B"]


def test_zb_h1_is_1f1b_with_the_w_of_stage_i_run_i_backwards_later_but_the_last_stages():
    """The last stage defers as many as the stage before it (its micro-batches hold the LM
    head's gradient: the memory the deferral would add is spent there already)."""
    assert [zb_w_delay(i, 4) for i in range(4)] == [0, 1, 2, 2]
    assert [zb_w_delay(i, 2) for i in range(2)] == [0, 0] and zb_w_delay(0, 1) == 0
    for S, M, N, _ in cases("zb-h1"):
        zb, f1b = build_schedule("zb-h1", S, M, N), build_schedule("1f1b", S, M, N)
        for i, (acts, ref) in enumerate(zip(zb, f1b, strict=True)):
            assert [x for x in acts if x.kind != "W"] == ref  # 1f1b's F, B and U order
            for b in range(N):
                seen = []  # micro-batches of batch b backwarded so far
                for x in acts:
                    if x.mb in batch(b, M) and x.kind == "B":
                        seen.append(x.mb)
                    elif x.mb in batch(b, M) and x.kind == "W" and len(seen) < M:
                        assert x.mb == seen[-1 - zb_w_delay(i, S)]
                assert len(seen) == M


def test_zb_h1_holds_1f1bs_peak_activation_memory():
    """Stage i holds S - i micro-batches awaiting B and up to i awaiting W: never more than 1f1b
    holds at stage 0, min(S, M)."""
    for S, M, N, _ in cases("zb-h1"):
        peaks = in_flight_peaks(build_schedule("zb-h1", S, M, N))
        assert max(peaks) == max(in_flight_peaks(build_schedule("1f1b", S, M, N))) == min(S, M)
        assert in_flight_peaks(build_schedule("1f1b", S, M, N)) == max_in_flight(
            build_schedule("1f1b", S, M, N))


def test_zb_h1_bubble_is_the_papers_s_minus_1_times_f_plus_b_minus_w_plus_one_w():
    """With T_F = T_B = T_W (the paper's accounting) 1f1b idles (S-1)(F+B+W) per stage and
    ZB-H1 (S-1)(F+B-W), a third of it; the last stage's one W fewer deferred adds one W."""
    for S, M in product(range(2, 7), range(1, 9)):
        if M < S:
            continue
        cost = Costs.uniform(S, forward=1.0, backward=2.0, weight=1.0)
        f1b = simulate(build_schedule("1f1b", S, M, 1), cost)
        zb = simulate(build_schedule("zb-h1", S, M, 1), cost)
        assert f1b.makespan == 3 * M + 3 * (S - 1)
        assert zb.makespan == 3 * M + (S - 1) + 1
        assert zb.utilisation > f1b.utilisation


@pytest.mark.parametrize("name", ["pipedream", "paci"])
def test_async_schedules_respect_the_in_flight_limit(name):
    for S, M, N, opts in cases(name):
        actions = build_schedule(name, S, M, N, **opts)
        limits = [in_flight_limit(i, S, opts.get("in_flight")) for i in range(S)]
        cap = M if opts.get("flush") else M * N
        assert max_in_flight(actions) == [min(limit, cap) for limit in limits]


def test_paci_lets_the_next_global_batch_in_without_a_flush():
    for S, M in product(range(2, 7), range(1, 9)):
        stage0 = build_schedule("paci", S, M, 2)[0]
        position = {(x.kind, x.mb): n for n, x in enumerate(stage0)}
        assert position[("F", M)] < position[("B", M - 1)]


def test_paci_staleness_never_exceeds_its_bound_and_reaches_it_on_long_spans():
    for S, M, N, opts in cases("paci"):
        a, cap = opts.get("a", 1), opts.get("in_flight")
        seen = staleness(build_schedule("paci", S, M, N, **opts))
        for i in range(S):
            worst = max(seen[(i, m)] for m in range(M * N))
            bound = staleness_bound("paci", i, S, a, cap)
            assert worst <= bound
            if not opts.get("flush") and M * N >= in_flight_limit(i, S, cap) + a - 1:
                assert worst == bound, (S, M, N, opts, i)


def test_paci_bound_is_papers_ceil_s_minus_i_minus_1_over_a():
    for S, a in product(range(1, 9), A):
        assert [staleness_bound("paci", i, S, a) for i in range(S)] == [
            math.ceil((S - i - 1) / a) for i in range(S)
        ]
        assert [staleness_bound(n, i, S) for n in FLUSH for i in range(S)] == [0] * (4 * S)


def test_paci_updates_every_a_backwards_with_the_same_micro_batches_at_every_stage():
    for S, M, N, opts in cases("paci"):
        a = opts.get("a", 1)
        groups = update_groups(build_schedule("paci", S, M, N, **opts))
        assert all(g == groups[0] for g in groups)
        if opts.get("flush"):
            expected = [batch(b, M)[j : j + a] for b in range(N) for j in range(0, M, a)]
        else:
            expected = [tuple(range(j, min(j + a, M * N))) for j in range(0, M * N, a)]
        assert groups[0] == expected


def test_paci_split_is_paci_with_each_w_right_after_its_b_holding_the_same():
    """The W follows its B at once: the same order, update groups, staleness and peak of
    micro-batches held as the whole backward's list."""
    for S, M, N, opts in cases("paci"):
        if not opts.get("split"):
            continue
        whole = build_schedule("paci", S, M, N, **{**opts, "split": False})
        got = build_schedule("paci", S, M, N, **opts)
        for w, g in zip(whole, got, strict=True):
            with_w = [y for x in w for y in ([x, Action("W", x.mb)] if x.kind == "B" else [x])]
            assert g == with_w
        assert update_groups(got) == update_groups(whole)
        assert staleness(got) == staleness(whole)
        assert in_flight_peaks(got) == in_flight_peaks(whole)


def test_paci_with_flush_and_a_equal_m_is_exactly_1f1b():
    for S, M, N, _ in cases("1f1b"):
        assert build_schedule("paci", S, M, N, a=M, flush=True) == build_schedule("1f1b", S, M, N)


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "zb-h1", "interleaved-1f1b", "paci"])
def test_schedules_without_stashing_hold_one_weight_version(name):
    for S, M, N, opts in cases(name):
        actions = build_schedule(name, S, M, N, **opts)
        assert weight_versions(actions) == [1] * S
        assert all(x.version is None for acts in actions for x in acts)


def test_pipedream_stashes_the_version_its_forward_used_for_its_backward():
    for S, M, N, opts in cases("pipedream"):
        actions = build_schedule("pipedream", S, M, N, **opts)
        validate(actions)  # includes: B uses its F's version, never a future one
        for acts in actions:
            updates = 0
            for x in acts:
                updates += x.kind == "U"
                if x.kind == "F":
                    assert x.version == updates  # the latest weights at forward time


def test_pipedream_holds_s_minus_i_versions_per_stage_with_one_update_per_micro_batch():
    for S, M, N, opts in cases("pipedream"):
        a = opts["a"]
        actions = build_schedule("pipedream", S, M, N, **opts)
        versions = weight_versions(actions)
        crossed = staleness(actions)
        for i in range(S):
            bound = staleness_bound("pipedream", i, S, a)
            assert max(crossed[(i, m)] for m in range(M * N)) <= bound
            assert versions[i] <= 1 + bound
            if M * N >= 2 * (S - i) + a - 1:  # past the warm-up, whose forwards share version 0
                assert versions[i] == 1 + bound
                if a == 1:
                    assert versions[i] == S - i


def test_interleaved_sends_each_chunk_s_micro_batches_in_turn_after_its_warm_up():
    """Megatron's order: forwards go chunk by chunk in groups of S micro-batches; backwards
    likewise from the last chunk; stage i warms up with 2(S-i-1) + (V-1)S forwards."""
    acts = build_schedule("interleaved-1f1b", 2, 4, 1, virtual=2)
    assert " ".join(map(str, acts[0])) == (
        "F0 F1 F0.c1 F1.c1 F2 B0.c1 F3 B1.c1 F2.c1 B0 F3.c1 B1 B2.c1 B3.c1 B2 B3 U1")
    assert " ".join(map(str, acts[1])) == (
        "F0 F1 F0.c1 B0.c1 F1.c1 B1.c1 F2 B0 F3 B1 F2.c1 B2.c1 F3.c1 B3.c1 B2 B3 U1")


def test_interleaved_bubble_is_the_papers_s_minus_1_over_v_m_plus_s_minus_1():
    """Narayanan et al. 2021: V chunks cut 1f1b's bubble (S-1)/(M+S-1) to (S-1)/(VM+S-1) (F and
    B of a chunk cost 1/V of the stage's), and chunk-micro-batches held at most
    2(S-i-1) + (V-1)S + 1 at stage i (each 1/V of a whole micro-batch)."""
    for S, V in product(range(2, 7), range(1, 5)):
        for M in range(S, 4 * S + 1, S):
            actions = build_schedule("interleaved-1f1b", S, M, 1, virtual=V)
            res = simulate(actions, Costs.uniform(S))
            assert math.isclose(res.bubble_fraction, (S - 1) / (V * M + S - 1))
            assert in_flight_peaks(actions) == [min(2 * (S - i - 1) + (V - 1) * S + 1, M * V)
                                                for i in range(S)]
            if V > 1:
                f1b = simulate(build_schedule("1f1b", S, M, 1), Costs.uniform(S))
                assert res.makespan < f1b.makespan


def test_update_numbers_count_from_one_at_every_stage():
    actions = build_schedule("paci", 3, 4, 2, a=3)
    assert [[x.k for x in acts if x.kind == "U"] for acts in actions] == [[1, 2, 3]] * 3
    assert all(x.mb == -1 for acts in actions for x in acts if x.kind == "U")


def test_action_prints_compactly():
    assert [str(x) for x in (Action("F", 3), Action("B", 3, version=2), Action("U", k=1),
                             Action("F", 3, chunk=1))] == ["F3", "B3@v2", "U1", "F3.c1"]


@pytest.mark.parametrize(
    ("name", "sizes", "kwargs", "message"),
    [
        ("zigzag", (2, 2, 1), {},
         "expected one of gpipe, 1f1b, zb-h1, interleaved-1f1b, pipedream, paci"),
        ("1f1b", (2, 2, 1), {"virtual": 2}, "takes no option ['virtual']"),
        ("interleaved-1f1b", (2, 2, 1), {"virtual": 0}, "virtual: got 0"),
        ("interleaved-1f1b", (2, 3, 1), {"virtual": 2},
         "micro_per_batch 3 must be a multiple of n_stages 2"),
        ("zb-h1", (2, 2, 1), {"a": 2}, "takes no option ['a']"),
        ("1f1b", (2, 2, 1), {"a": 2}, "takes no option ['a']"),
        ("gpipe", (2, 2, 1), {"in_flight": 2}, "takes no option ['in_flight']"),
        ("pipedream", (2, 2, 1), {"flush": True}, "takes no option ['flush']"),
        ("paci", (2, 2, 1), {"a": 0}, "a: got 0"),
        ("paci", (2, 2, 1), {"in_flight": 0}, "in_flight: got 0"),
        ("paci", (2, 0, 1), {}, "micro_per_batch: got 0"),
    ],
)
def test_bad_arguments_are_rejected_with_what_would_be_accepted(name, sizes, kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        build_schedule(name, *sizes, **kwargs)


@pytest.mark.parametrize(
    ("actions", "message"),
    [
        ([[Action("B", 0), Action("U", k=1)]], "backward without a pending forward"),
        ([[Action("W", 0), Action("U", k=1)]], "weight pass without a pending forward"),
        ([[Action("F", 0), Action("W", 0), Action("B", 0)]], "expected B0 first"),
        ([[Action("F", 0), Action("B", 0), Action("W", 0), Action("W", 0)]], "without a pending"),
        ([[Action("F", 0), Action("B", 0), Action("W", 0)]], "1 gradients never applied"),
        ([[Action("F", 0), Action("F", 1), Action("B", 0), Action("W", 0), Action("B", 1),
           Action("U", k=1)]], r"micro-batches \[1\] never finish their backward"),
        ([[Action("F", 0), Action("F", 0)]], "second forward"),
        ([[Action("F", 0), Action("F", 1), Action("B", 0), Action("B", 1), Action("W", 1),
           Action("W", 0), Action("U", k=1)]], "accumulates after micro-batch 1"),
        ([[Action("F", 0), Action("B", 0)]], "1 gradients never applied"),
        ([[Action("F", 0), Action("B", 0), Action("U", k=2)]], "expected U1"),
        ([[Action("F", 0, version=1)]], r"version must be in 0\.\.0"),
        ([[Action("F", 0, version=0), Action("B", 0), Action("U", k=1)]], "version differs"),
        ([[Action("F", 0, chunk=1), Action("F", 0), Action("B", 0), Action("B", 0, chunk=1),
           Action("U", k=1)]], "before the micro-batch's forward at chunk 0"),
        ([[Action("F", 0), Action("F", 0, chunk=1), Action("B", 0), Action("B", 0, chunk=1),
           Action("U", k=1)]], "before the micro-batch's backward at chunk 1"),
        (
            [
                [Action("F", 0), Action("B", 0), Action("U", k=1)],
                [Action("F", 1), Action("B", 1), Action("U", k=1)],
            ],
            "differ",
        ),
    ],
)
def test_validate_rejects_malformed_lists(actions, message):
    with pytest.raises(ValueError, match=message):
        validate(actions)


def test_which_schedules_flush_is_declared_once():
    """`asynchronous` is what the controller (spans), the executor (clipping, options) and the
    config read; the flush schedules are exactly those whose staleness bound is 0."""
    assert [n for n in SCHEDULES if asynchronous(n)] == ["pipedream", "paci"]
    for name in SCHEDULES:
        assert (staleness_bound(name, 0, 4) == 0) == (not asynchronous(name))
    assert load_config(None, ["parallel.schedule=paci"]).parallel.schedule == "paci"
    with pytest.raises(ConfigError,
                       match=re.escape("'gpipe' | '1f1b' | 'zb-h1' | 'interleaved-1f1b' | "
                                         "'pipedream' | 'paci'")):
        load_config(None, ["parallel.schedule=zb"])
