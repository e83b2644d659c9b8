"""The handles of one run's actors, their role names, and their release.

Owns: which actors a run has and what each is called in a message (``rollout-0``, ``learner rank 1``,
``judge-0``...). Must not: create actors (:mod:`clawray.build` does) or decide anything about them
(:mod:`clawray.recovery` does, from these handles).
"""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass
class RunActors:
    """Every actor handle of a run; filled by :func:`clawray.build.build_actors` as each one is
    created, so that :meth:`kill` releases what exists after a failure part-way.

    Attributes:
        queue: the :class:`~clawray.actors.queue.TrajectoryQueueActor`.
        engines: the rollout engines (synced with the learners), ``rollout-<i>``.
        judge_engine: the frozen judge engine (``judge.backend: engine``), or None.
        teacher_engine: the teacher's engine (OPD/Combine), or None; may be ``judge_engine`` or
            ``engines[0]`` (a live teacher).
        judges: the judge workers, ``judge-<i>``.
        teachers: the teacher workers, ``teacher-<i>``.
        tracker: the :class:`~clawray.actors.session.SessionTrackerActor`.
        learners: the :class:`~clawray.actors.learner.LearnerGroup` (its ``workers`` are the ranks).
        weight_sync: the :class:`~clawray.weight_sync.WeightSyncController`.
    """

    queue: Any = None
    engines: list = dataclasses.field(default_factory=list)
    judge_engine: Any = None
    teacher_engine: Any = None
    judges: list = dataclasses.field(default_factory=list)
    teachers: list = dataclasses.field(default_factory=list)
    tracker: Any = None
    learners: Any = None
    weight_sync: Any = None

    @property
    def learner_workers(self) -> list:
        """The learner ranks' actor handles (``[]`` before the group exists)."""
        return list(self.learners.workers) if self.learners is not None else []

    def roles(self) -> dict[str, tuple[str, str]]:
        """``{actor id (hex): (role, kind)}`` for every actor held; kind is ``"engine"``,
        ``"learner"``, ``"judge"``, ``"teacher"``, ``"tracker"`` or ``"queue"``."""
        roles: dict[str, tuple[str, str]] = {}
        for actor, role, kind in self._named():
            roles.setdefault(actor._actor_id.hex(), (role, kind))
        return roles

    def all(self) -> list:
        """Every actor handle held, each once."""
        return list({a._actor_id.hex(): a for a, _, _ in self._named()}.values())

    def _named(self) -> list[tuple[Any, str, str]]:
        named = [(e, f"rollout-{i}", "engine") for i, e in enumerate(self.engines)]
        named += [(w, f"learner rank {i}", "learner") for i, w in enumerate(self.learner_workers)]
        named += [(j, f"judge-{i}", "judge") for i, j in enumerate(self.judges)]
        named += [(t, f"teacher-{i}", "teacher") for i, t in enumerate(self.teachers)]
        named += [
            (self.judge_engine, "judge-engine", "engine"),
            (self.teacher_engine, "teacher-engine", "engine"),
            (self.tracker, "session tracker", "tracker"),
            (self.queue, "trajectory queue", "queue"),
        ]
        return [(a, role, kind) for a, role, kind in named if a is not None]

    def health_handles(self) -> dict[str, Any]:
        """The handles whose states ``/health`` reports (:class:`~clawray.serve.app.PolicyServer`)."""
        return {"judges": self.judges, "teachers": self.teachers, "learners": self.learner_workers, "queue": self.queue}

    def kill(self) -> None:
        """Kill every actor, shut the learner group down (its placement group too) and close the
        weight-sync group; an actor already gone is skipped, the rest are still released."""
        import ray

        from clawray.weight_sync import shm

        # the learner ranks are the group's to release (with their placement group)
        others = {a._actor_id.hex(): a for a, _, kind in self._named() if kind != "learner"}
        for actor in others.values():
            try:
                ray.kill(actor)
            except Exception:  # noqa: BLE001 - already gone; the rest must still be released
                pass
        if self.learners is not None:
            self.learners.shutdown()
        if self.weight_sync is not None:
            self.weight_sync.close()
        shm.sweep()  # ipc buffers of senders that died before they could remove them
