"""An actor killed by Ray's memory monitor is a lost actor, named in one line, like any other death
(it was a raw ``ray.exceptions.OutOfMemoryError`` traceback from the driver's actor check)."""

from __future__ import annotations

import pytest
import ray

from clawray import recovery
from clawray.ray_env import actor_death_errors, death_reason

OOM = ray.exceptions.OutOfMemoryError("Task was killed due to the node running low on memory.")


class _Actor:
    class _Id:
        def hex(self):
            return "a1"

    _actor_id = _Id()

    class _Ready:
        def remote(self):
            return "ref"

    __ray_ready__ = _Ready()


class _Actors:
    """A run's actors (:class:`clawray.run_actors.RunActors`' roles and handles): one engine, ``a1``."""

    def __init__(self, roles):
        self._roles = roles

    def roles(self):
        return self._roles

    def all(self):
        return [_Actor()] if self._roles else []


def _raise(exc):
    def get(*args, **kwargs):
        raise exc

    return get


def test_oom_is_an_actor_death_with_its_own_reason():
    assert isinstance(OOM, actor_death_errors())
    assert death_reason(OOM) == "killed by Ray's memory monitor, out of host memory"
    wrapped = RuntimeError("step failed")
    wrapped.__cause__ = OOM
    assert death_reason(wrapped) == "killed by Ray's memory monitor, out of host memory"
    assert death_reason(ValueError("x")) == "killed or crashed"


def test_check_actors_names_an_engine_the_memory_monitor_killed(monkeypatch):
    """The ping of a dead engine fails with OutOfMemoryError and so does the retry: one ActorLost line."""
    monkeypatch.setattr(recovery.ray, "wait", lambda refs, **kw: (refs, []))
    monkeypatch.setattr(recovery.ray, "get", _raise(OOM))
    with pytest.raises(recovery.ActorLost) as lost:
        recovery.check_actors(_Actors({"a1": ("rollout-0", "engine")}), timeout_s=1.0)
    assert (lost.value.role, lost.value.kind) == ("rollout-0", "engine")
    assert "rollout-0" in str(lost.value) and "memory monitor" in str(lost.value)
    assert "\n" not in str(lost.value)


def test_check_actors_lets_an_engine_ray_restarted_after_oom_go_on(monkeypatch):
    """The ping in flight failed with OutOfMemoryError, but the restarted engine answers: no error."""
    answers = iter([OOM, None])

    def get(*args, **kwargs):
        a = next(answers)
        if a is not None:
            raise a

    monkeypatch.setattr(recovery.ray, "wait", lambda refs, **kw: (refs, []))
    monkeypatch.setattr(recovery.ray, "get", get)
    recovery.check_actors(_Actors({"a1": ("rollout-0", "engine")}), timeout_s=1.0)


def test_actor_lost_reads_an_oom_in_the_cause_chain(monkeypatch):
    monkeypatch.setattr(recovery, "_first_dead", lambda roles: "judge-0")
    wrapped = RuntimeError("judge call failed")
    wrapped.__cause__ = OOM
    lost = recovery.actor_lost(_Actors({"a1": ("judge-0", "judge")}), wrapped)
    assert (lost.role, lost.kind) == ("judge-0", "judge")
    assert str(lost).startswith("the judge-0 actor died (killed by Ray's memory monitor, out of host memory);")
    assert recovery.actor_lost(_Actors({}), ValueError("not a death")) is None
