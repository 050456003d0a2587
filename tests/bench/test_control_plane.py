"""The control-plane benchmark's figures come from a run of the real controller on simulated
workers (and its report shows them); the whole benchmark is `relaytrain bench control-plane`."""

from __future__ import annotations

import pytest

from relaytrain.bench.control_plane import _run, format_report
from tests.runtime.conftest import make_corpus


@pytest.mark.timeout(180)
def test_one_size_is_measured_from_a_run_with_a_kill_that_audits(tmp_path):
    data = make_corpus(tmp_path)
    ahead = _run(str(tmp_path), data, 8, steps=20, ahead=True, fail=True)
    lockstep = _run(str(tmp_path), data, 8, steps=20, ahead=False, fail=False)
    assert ahead["controller_ms_per_step"] > 0 and ahead["controller_cpu_ms_per_step"] > 0
    assert ahead["ledger_bytes_per_step"] > 0
    assert ahead["recovery_decision_s"] > 0 and ahead["recovery_reform_s"] > 0
    assert ahead["recovery_controller_cpu_s"] > 0
    assert (ahead["lost_steps"], ahead["discarded_ahead"]) == (1, 1)
    assert ahead["idle_ms_median"] == 0.0 < lockstep["idle_ms_median"]
    report = format_report({"steps": 20, "step_s": 0.25,
                            "sizes": {8: {"ahead": ahead, "lockstep": lockstep}},
                            "ray": {"actors": 32, "ms_per_step_8": 1.5, "ms_per_step_32": 4.0}})
    assert report.splitlines()[2].split()[0] == "8"
    assert "32 actors 4.00 ms" in report
