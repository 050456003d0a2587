"""The recovery benchmark's fault plan (every fault once, evenly spaced, hangs spread among the
kills) and its settings (the run's defaults unless given). The benchmark itself is a long Ray
run: `relaytrain bench recovery`."""

from __future__ import annotations

import pytest

from relaytrain.bench.recovery import FAULT_SPACING, bench_recovery, fault_plan, settings
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
