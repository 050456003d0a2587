"""The worker interface: the controller's calls are checked against it before any worker is
reached, and the real worker implements every method of it as declared."""

from __future__ import annotations

import inspect
from types import SimpleNamespace

import pytest

from relaytrain.runtime.engines.base import Invocation, WorkerAPI, invocation
from relaytrain.runtime.worker import Worker


def test_the_worker_implements_the_interface_with_the_same_parameters():
    for name, declared in vars(WorkerAPI).items():
        if name.startswith("_") or not callable(declared):
            continue
        actual = getattr(Worker, name, None)
        assert actual is not None, f"Worker lacks {name}"
        # Ray adds a tracing parameter to an actor class's methods once it wraps one.
        params = [p for p in inspect.signature(actual).parameters if p != "_ray_trace_ctx"]
        assert params == list(inspect.signature(declared).parameters), name


def test_a_call_is_recorded_as_one_method_with_its_arguments():
    assert invocation(lambda w: w.run_steps(3, 2)) == Invocation("run_steps", (3, 2), {})
    assert invocation(lambda w: w.build(5, given=None)) == \
        Invocation("build", (5,), {"given": None})


def test_a_misspelt_method_fails_in_the_controller():
    with pytest.raises(AttributeError, match="'run_step' is not a method of the worker"):
        invocation(lambda w: w.run_step(1, 1))


def test_wrong_arguments_fail_in_the_controller():
    with pytest.raises(TypeError):
        invocation(lambda w: w.run_steps(1))
    with pytest.raises(TypeError):
        invocation(lambda w: w.save(1, "stage0", "a1", "extra"))


def test_a_wrong_call_fails_after_a_right_call_of_the_same_method():
    """Each call shape is bound once: a shape that bound says nothing of another."""
    invocation(lambda w: w.run_steps(1, 1))
    invocation(lambda w: w.build(5, given=None))
    with pytest.raises(TypeError):
        invocation(lambda w: w.run_steps(1, 1, None, 4))
    with pytest.raises(TypeError):
        invocation(lambda w: w.build(5, tensors=None))
    with pytest.raises(TypeError):  # a shape that failed is not remembered as bound
        invocation(lambda w: w.build(5, tensors=None))


def test_a_call_given_to_several_workers_is_checked_once(monkeypatch):
    from relaytrain.runtime.engines import base

    checked = []
    monkeypatch.setattr(base, "invocation", lambda c: checked.append(c) or Invocation(
        "ping", (), {}))
    echo = SimpleNamespace(run=lambda invocations, timeout: invocations)  # what it was given
    one, other = (lambda w: w.ping()), (lambda w: w.ping())
    got = base.Engine.call(echo, {0: one, 1: one, 2: other, 3: one}, 1.0)
    assert checked == [one, other] and got[0] is got[1] is got[3]


def test_a_call_must_be_one_method_call():
    with pytest.raises(TypeError, match="one method call"):
        invocation(lambda w: 42)
