"""The recovery benchmark's fault plan (every fault once, evenly spaced, hangs spread among the
kills), its settings (the run's defaults unless given) and its goodput (against the same run
without faults). The benchmark itself is a long Ray run: `relaytrain bench recovery`."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from relaytrain.bench.recovery import (
    FAULT_SPACING,
    bench_recovery,
    fault_plan,
    format_report,
    goodput,
    settings,
)
from relaytrain.cli import main
from relaytrain.config.sections import RunConfig
from relaytrain.errors import UserError


@pytest.mark.parametrize("kills,hangs", [(8, 4), (3, 1), (0, 2), (2, 0), (1, 5)])
def test_the_plan_holds_each_fault_once_evenly_spaced(kills, hangs):
    plan = fault_plan(kills, hangs)
    kinds = [k for _, k in plan]
    assert (kinds.count("kill"), kinds.count("hang")) == (kills, hangs)
    assert [s for s, _ in plan] == [10 + FAULT_SPACING * i for i in range(kills + hangs)]


def test_hangs_are_spread_among_the_kills():
    kinds = [k for _, k in fault_plan(8, 4)]
    slots = [i for i, k in enumerate(kinds) if k == "hang"]
    assert slots == [1, 4, 7, 10]
    assert [k for _, k in fault_plan(3, 1)] == ["kill", "kill", "hang", "kill"]


def test_nothing_to_recover_from_is_a_clear_error():
    with pytest.raises(UserError, match="at least one kill or hang"):
        bench_recovery(kills=0, hangs=0)


def test_the_settings_are_the_runs_defaults_unless_given():
    defaults = settings([])
    assert defaults["runtime.collective_timeout"] == RunConfig().runtime.collective_timeout
    assert defaults["elastic.spares"] == RunConfig().elastic.spares
    assert settings(["elastic.spares=1"])["elastic.spares"] == 1


def test_settings_are_for_the_recovery_bench_only(capsys):
    assert main(["bench", "loader", "elastic.spares=1"]) == 2
    assert "bench loader takes no key=value settings" in capsys.readouterr().err
    assert main(["bench", "recovery", "elastic.nonsense=1"]) == 2


def _recovery(total_s, detect_s, first_step_s, lost):
    return {"total_s": total_s, "lost_steps": lost,
            "phases": {"detect": detect_s, "first_step": first_step_s}}


def test_goodput_is_the_fault_free_runs_wall_over_the_faulty_runs_and_nothing_is_hidden():
    # 200 steps: 20 s productive without faults, 21 s with them; start-up 20 s and 21 s
    clean = SimpleNamespace(wall_s=42.0, setup_s=20.0, goodput=20.0 / 42.0, recoveries=[])
    faulty = SimpleNamespace(wall_s=46.0, setup_s=21.0, goodput=21.0 / 46.0,
                             recoveries=[_recovery(0.3, 0.05, 0.1, 1), _recovery(2.6, 2.5, 0.1, 1),
                                         _recovery(0.4, None, 0.1, 1)])
    g = goodput(faulty, clean, resize_s=0.5)
    assert g["goodput"] == pytest.approx(42 / 46)  # not the faulty run's own share, 46%
    assert g["productive_share"] == pytest.approx(21 / 46)
    assert g["productive_share_after_start_up"] == pytest.approx(21 / 25)
    assert (g["extra_s"], g["start_up_extra_s"], g["training_extra_s"]) == \
        pytest.approx((4.0, 1.0, 1.0))
    assert (g["recoveries_s"], g["detect_s"], g["lost_steps"]) == pytest.approx((3.0, 2.55, 3))
    assert g["rest_s"] == pytest.approx(4.0 - 1.0 - 1.0 - 3.0 - 0.5)  # the parts add up
    report = format_report({"kills": 2, "hangs": 1, "overrides": [], "settings": {},
                            "recoveries": 3, "steps": 200, "goodput": g,
                            **{c: None for c in ("died", "hung", "died, sharded", "shrunk")}})
    assert "goodput of the faulty run (kills and hangs): 91.3% = the same 200 steps without " \
           "faults 42.0s / with them 46.0s" in report
    assert "45.7% of its wall, 84.0% after its start-up (21.0s" in report
    assert "training +1.0s (3 steps lost" in report and "growing back 0.5s" in report
