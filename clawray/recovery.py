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


# Ray fault-tolerance options per actor kind (see the README's reliability section):
# judges, teachers, the frozen judge/teacher engines and the queue are restarted by Ray and their
# calls retried (their calls are idempotent: a frozen model scores the same; the queue's puts are
# deduplicated by its journal and a restarted queue replays the journal); the session tracker is
# restarted (it rebuilds its sessions from its journal) but a call in flight is not retried (a
# retried record_turns would number a turn twice): the request gets a 503. Rollout engines and
# learners are not restarted in place: their weights would be stale (see ``check_actors``).
RESTART_RETRY = {"max_restarts": -1, "max_task_retries": -1}
RESTART = {"max_restarts": -1, "max_task_retries": 0}


def check_actors(driver: Any, timeout_s: float = 10.0) -> None:
    """Ping every actor of the run; raise :class:`ActorLost` for one that is dead for good.

    An actor that Ray is restarting (``ActorUnavailableError``) or that is merely slow is not an
    error. Called by the driver while it waits for a batch, so a dead rollout engine (no more
    samples) ends the run with one line instead of a silent stall.
    """
    roles = actor_roles(driver)
    handles = {a._actor_id.hex(): a for a in _all_actors(driver)}
    refs = {handles[aid].__ray_ready__.remote(): aid for aid in roles if aid in handles}
    ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=timeout_s)
    for ref in ready:
        try:
            ray.get(ref)
        except ray.exceptions.ActorUnavailableError:
            continue
        except ray.exceptions.RayActorError:
            # a call in flight when a restartable actor died fails too (no task retries): ask again
            if not _alive_after_restart(handles[refs[ref]], timeout_s):
                role, kind = roles[refs[ref]]
                raise ActorLost(role, kind, "killed or crashed") from None


def _alive_after_restart(actor: Any, timeout_s: float) -> bool:
    """True when ``actor`` answers a new call within ``timeout_s`` (Ray restarted it), False when
    Ray reports it dead for good; a restart still under way after ``timeout_s`` counts as alive."""
    import time

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            ray.get(actor.__ray_ready__.remote(), timeout=timeout_s)
            return True
        except ray.exceptions.ActorUnavailableError:
            time.sleep(0.5)
        except ray.exceptions.GetTimeoutError:
            return True
        except ray.exceptions.RayActorError:
            return False
    return True


def _all_actors(driver: Any) -> list:
    learners = getattr(driver, "learners", None)
    out = list(getattr(driver, "engines", [])) + list(getattr(learners, "workers", []) if learners else [])
    out += list(getattr(driver, "judges", [])) + list(getattr(driver, "teachers", []))
    out += [getattr(driver, k, None) for k in ("judge_engine", "teacher_engine", "tracker", "queue")]
    return [a for a in out if a is not None]


def wait_batch(driver: Any, batch_size: int, next_version: int, timeout_s: float | None, max_batch_size: int,
               poll_s: float = 5.0) -> dict | None:
    """:meth:`TrajectoryQueue.get_batch`, in slices of ``poll_s`` seconds with :func:`check_actors`
    between them. Returns the batch, or None after ``timeout_s`` (None = no limit).

    Raises:
        ActorLost: an actor died for good while waiting.
    """
    import time

    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
        remaining = None if deadline is None else deadline - time.monotonic()
        if remaining is not None and remaining <= 0:
            return None
        window = poll_s if remaining is None else min(poll_s, remaining)
        batch = ray.get(driver.queue.get_batch.remote(batch_size, next_version, window, max_batch_size))
        if batch is not None:
            return batch
        check_actors(driver)


async def probe(ref: Any, timeout_s: float = 5.0) -> Any:
    """Await an actor call for ``/health``: its value, or None when the actor is dead, restarting or
    silent for ``timeout_s`` seconds (no error and no actor id escapes)."""
    import asyncio

    try:
        return await asyncio.wait_for(ref, timeout_s)
    except (asyncio.TimeoutError, ray.exceptions.RayError):
        return None


RESTARTABLE_KINDS = ("judge", "teacher", "queue", "tracker")


def step_or_recover(driver: Any) -> None:
    """Run ``driver.step()``; when a restartable actor (see :data:`RESTARTABLE_KINDS`) died during
    it and Ray has restarted it, print one line and return (the loop goes on: the driver's only
    non-retried calls, to the session tracker, come after the step's training and journal marks).

    Raises:
        ActorLost: an actor died for good, or one that is not restartable died.
    """
    try:
        driver.step()
    except ray.exceptions.RayActorError as e:
        lost = actor_lost(driver, e)
        handles = {a._actor_id.hex(): a for a in _all_actors(driver)}
        actor = handles.get(getattr(e, "actor_id", None) or "")
        if lost is None or lost.kind not in RESTARTABLE_KINDS or actor is None or not _alive_after_restart(actor, 30.0):
            raise
        print(f"[clawray] the {lost.role} actor died and was restarted; training goes on", flush=True)
