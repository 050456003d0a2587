"""Ray's own cost of one step's fan-out: a call to each of N light actors and its answer back.

The actors are light on purpose (this module imports nothing but the standard library, so an
actor starts without torch): what is measured is Ray's submission, transport and scheduling,
the part of a step's control plane that the simulated workers (runtime/engines/simulated.py)
do not run. The answer is a step result as a worker sends it."""

from __future__ import annotations

import os
import statistics
import time
from typing import Any


class LightActor:
    """Answers a step call at once with a step result in its wire form (runtime/wire.py
    `steps_to_wire`), made by the driver: the fields after the step number."""

    def __init__(self, rest: tuple) -> None:
        self.rest = rest

    def run_steps(self, first: int, count: int, history: Any = None) -> list[tuple]:
        return [(first, *self.rest)]


def _answer() -> tuple:
    """A one-micro-batch step result's wire form, less its step number."""
    from relaytrain.runtime.wire import StepResult, steps_to_wire

    [wire] = steps_to_wire([StepResult(step=0, losses={0: (1.0, 1.0, 0.0)}, grad_norm=1.0,
                                       finite=True, ids=[0], time_data=0.0, time_compute=0.0)])
    return wire[1:]


def ray_fan_out(actors: int, rounds: int) -> dict[str, Any]:
    """Median milliseconds for one step call to each of 8 (or all, if fewer) and of `actors`
    light actors and back, on a private Ray cluster (or the one this process already joined)."""
    from relaytrain.runtime.engines.ray import _import_ray

    _import_ray(private_cluster=True)
    import ray

    owns = not ray.is_initialized()
    if owns:
        ray.init(address="local", num_cpus=os.cpu_count() or 1, include_dashboard=False,
                 _node_ip_address="127.0.0.1", configure_logging=False, log_to_driver=False)
    try:
        cls = ray.remote(num_cpus=0)(LightActor)
        rest = _answer()
        pool = [cls.remote(rest) for _ in range(actors)]
        ray.get([a.run_steps.remote(0, 1) for a in pool], timeout=600)  # all started
        out: dict[str, Any] = {"actors": actors}
        for n in sorted({min(8, actors), actors}):
            times = []
            for k in range(rounds):
                t0 = time.perf_counter()
                ray.get([a.run_steps.remote(k + 1, 1) for a in pool[:n]])
                times.append(time.perf_counter() - t0)
            out[f"ms_per_step_{n}"] = 1e3 * statistics.median(times)
        return out
    finally:
        if owns:
            ray.shutdown()
