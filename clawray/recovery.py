"""Actor failures: name the dead actor in one line, never a raw traceback or a silent stall.

Design: every actor the Driver owns has a role name (``rollout-0``, ``learner rank 1``, ``judge-0``,
``teacher-0``, ``session tracker``, ``trajectory queue``...). When a Ray call fails because an actor
died (:class:`ray.exceptions.RayActorError`, including ``ActorDiedError`` and
``ActorUnavailableError``), :func:`actor_lost` turns it into :class:`ActorLost`, whose message names the
role (never the actor id, pid or Ray namespace) and says what survives: the samples and the session
state are in the journal (:mod:`clawray.journal`), so ``resume=true`` continues from the last
checkpoint with nothing acknowledged lost.
"""

from __future__ import annotations

from typing import Any

import ray


class ActorLost(RuntimeError):
    """An actor of the run died; the message is one line naming its role.

    Attributes:
        role: the actor's role name, e.g. ``"learner rank 1"``.
        kind: ``"learner"``, ``"engine"``, ``"judge"``, ``"teacher"``, ``"tracker"``, ``"queue"`` or
            ``"actor"`` (unknown).
    """

    def __init__(self, role: str, kind: str, detail: str = ""):
        self.role, self.kind = role, kind
        super().__init__(f"the {role} actor died{f' ({detail})' if detail else ''}; the samples and sessions "
                         "are in the journal: restart with resume=true to continue from the last checkpoint")


def actor_roles(driver: Any) -> dict[str, tuple[str, str]]:
    """``{actor id (hex): (role, kind)}`` for every actor the driver holds."""
    roles: dict[str, tuple[str, str]] = {}

    def add(actor: Any, role: str, kind: str) -> None:
        if actor is not None:
            roles.setdefault(actor._actor_id.hex(), (role, kind))

    for i, e in enumerate(getattr(driver, "engines", [])):
        add(e, f"rollout-{i}", "engine")
    learners = getattr(driver, "learners", None)
    for i, w in enumerate(getattr(learners, "workers", []) if learners is not None else []):
        add(w, f"learner rank {i}", "learner")
    for i, j in enumerate(getattr(driver, "judges", [])):
        add(j, f"judge-{i}", "judge")
    for i, t in enumerate(getattr(driver, "teachers", [])):
        add(t, f"teacher-{i}", "teacher")
    add(getattr(driver, "judge_engine", None), "judge-engine", "engine")
    add(getattr(driver, "teacher_engine", None), "teacher-engine", "engine")
    add(getattr(driver, "tracker", None), "session tracker", "tracker")
    add(getattr(driver, "queue", None), "trajectory queue", "queue")
    return roles


def actor_lost(driver: Any, exc: BaseException) -> ActorLost | None:
    """The :class:`ActorLost` that ``exc`` stands for, or None when it is not an actor's death.

    Looks through ``exc``'s cause/context chain and Ray task errors wrapping a death (a learner rank
    whose peer died fails its collective: the dead peer is named first when it is known).
    """
    seen = exc
    while seen is not None:
        if isinstance(seen, ray.exceptions.RayActorError):
            roles = actor_roles(driver)
            actor_id = getattr(seen, "actor_id", None)
            role, kind = roles.get(actor_id, ("", "actor")) if actor_id else ("", "actor")
            if not role:
                role = _first_dead(roles) or "unknown"
                kind = next((k for r, k in roles.values() if r == role), "actor")
            return ActorLost(role, kind, "killed or crashed")
        seen = seen.__cause__ or seen.__context__
    return None


def _first_dead(roles: dict[str, tuple[str, str]]) -> str | None:
    """The role of the first actor that Ray reports DEAD, or None."""
    try:
        from ray.util.state import list_actors

        dead = {a.actor_id for a in list_actors(filters=[("state", "=", "DEAD")], limit=10_000, raise_on_missing_output=False)}
    except Exception:  # noqa: BLE001 - the state API is optional (no dashboard): name nothing
        return None
    return next((role for aid, (role, _) in roles.items() if aid in dead), None)
