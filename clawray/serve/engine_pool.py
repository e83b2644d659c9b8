"""The rollout engines as one replica sees them: which engine a request goes to, and fail-over.

Engine choice (:func:`clawray.serve.routing.choose_engine`): a session sticks to its engine (prefix-cache
locality) unless that engine is down, paused while others serve, or carries more than ``engine_slack``
requests more than the least loaded engine; a new session takes the least loaded engine. The pool
polls the engines' states and queue depths every ``engine_poll_s`` seconds.

Engine failures (:mod:`clawray.recovery`): an engine that is dead, restarting or restarted but not yet
re-synced (:class:`~clawray.actors.rollout.EngineRestartedError`) is marked down and the request goes to
the next engine the chooser picks; a watcher clears the mark once the engine serves again. Only when no
engine is up does :class:`NoEngineUp` reach the caller (a 503 with ``Retry-After``).

Canary (:func:`clawray.serve.routing.arm_states`): the pool reads each engine's arm and canary fraction
from the same polls; a session in the fraction of a live canary engine is sent there, the rest never
are. An engine that refuses a request for its arm (:class:`~clawray.actors.rollout.EngineArmError`:
the arm changed since the last poll) is asked again at once and the request chosen anew.

Owns: routing state (homes, polled states, loads and arms, down marks). Must not: build prompts or record.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter, OrderedDict
from typing import Any, Awaitable, Callable

import ray

from clawray.actors.rollout import EngineArmError, EngineRestartedError
from clawray.ray_env import actor_death_errors
from clawray.serve.routing import DOWN, UP, arm_states, choose_engine, engine_state, in_canary

logger = logging.getLogger("ray.serve")
MAX_HOMES = 100_000  # sessions whose engine is remembered; the least recently used is forgotten beyond this

# an engine call failing with one of these means the engine (not the request) is unavailable: it died
# (also when Ray's memory monitor killed it: OutOfMemoryError) or was restarted and awaits its re-sync
ENGINE_DOWN = (*actor_death_errors(), EngineRestartedError)


class NoEngineUp(RuntimeError):
    """Every rollout engine is down, restarting or awaiting its re-sync."""


class EnginePool:
    """The engines of one replica, with their routing state.

    Args:
        engines: the RolloutEngine actor handles.
        engine_slack: ``serve.engine_slack`` (requests a session's engine may carry above the least loaded).
        retry_after_s: a down engine is asked again every ``retry_after_s`` / 2 seconds.
        counts: the replica's counters (``engine_failovers`` is counted here).
        poll_s: seconds between two polls of the engines' states and queue depths.

    Attributes:
        homes: ``{session id: engine index}`` (LRU, at most :data:`MAX_HOMES`).
    """

    def __init__(self, engines: list, engine_slack: int, retry_after_s: float, counts: Counter, poll_s: float = 1.0):
        self.engines, self.engine_slack, self.retry_after_s = engines, engine_slack, retry_after_s
        self.counts, self.poll_s = counts, poll_s
        n = len(engines)
        self._states = [UP] * n  # per engine, from the last poll (routing.engine_state)
        self._loads = [0] * n  # per engine, its queue depth at the last poll (all replicas' requests)
        self._sent = [0] * n  # per engine, generations this replica started since the last poll
        self._arms: list[str | None] = [None] * n  # per engine, its arm at the last poll (RolloutEngine.set_arm)
        self._fraction = 0.0  # the canary fraction of the live canary engine (0: none)
        self._down: dict[int, asyncio.Task] = {}  # engine index -> watcher that clears the mark
        self.homes: OrderedDict[str, int] = OrderedDict()
        self._poller: asyncio.Task | None = None

    def choices(self) -> list[int]:
        """Per engine, the sessions whose engine it is now."""
        return [sum(1 for e in self.homes.values() if e == i) for i in range(len(self.engines))]

    async def run(self, session_id: str | None, n: int, attempt: Callable[[Any, bool], Awaitable[Any]]) -> Any:
        """``await attempt(engine, canary)`` on the session's engine (``n``: the generations it starts;
        ``canary``: the session is canary traffic, :func:`~clawray.serve.routing.in_canary`); when that
        engine is down (dead, restarting or awaiting its re-sync) mark it and try the next live one;
        when it refused the request for its arm, poll its arm and choose again.

        Raises:
            NoEngineUp: no engine is up.
        """
        tries = 0
        while tries < 2 * len(self.engines):
            tries += 1
            canary = in_canary(session_id, self._fraction)
            index = self._choose(session_id, n, canary)
            try:
                return await attempt(self.engines[index], canary)
            except ENGINE_DOWN:
                self.counts["engine_failovers"] += 1
                self._mark_down(index)
            except EngineArmError:
                self.counts["engine_arm_refusals"] += 1
                await self._poll_one(index)
        raise NoEngineUp("no rollout engine is up")

    def _choose(self, session_id: str | None, n: int, canary: bool = False) -> int:
        """The request's engine index (:func:`~clawray.serve.routing.choose_engine`): the polled states
        with the engines marked down here as down and those of another arm as down
        (:func:`~clawray.serve.routing.arm_states`; ``canary``: canary traffic), the polled queue depths
        plus the generations this replica started since the poll; remembered as the session's engine.

        Raises:
            NoEngineUp: every engine is down.
        """
        if self._poller is None or self._poller.done():
            self._poller = asyncio.ensure_future(self._poll())
        n_engines, key = len(self.engines), session_id
        states = [DOWN if i in self._down else self._states[i] for i in range(n_engines)]
        states, fell_back = arm_states(states, self._arms, canary)
        self.counts["canary_fallbacks"] += int(fell_back)
        loads = [self._loads[i] + self._sent[i] for i in range(n_engines)]
        try:
            index = choose_engine(key, states, loads, self.homes.get(key) if key else None, self.engine_slack)
        except ValueError:
            raise NoEngineUp("no rollout engine is up") from None
        if key:
            self.homes[key] = index
            self.homes.move_to_end(key)
            if len(self.homes) > MAX_HOMES:
                self.homes.popitem(last=False)
        self._sent[index] += n
        return index

    async def _poll(self) -> None:
        """Every ``poll_s`` seconds: each engine's state and queue depth from its ``stats()``. A dead or
        restarting engine (a Ray actor error) is down; one that does not answer within 5 s (a busy
        host) keeps its previous state and load."""

        while True:
            before = list(self._sent)  # generations started while the poll runs stay counted
            await asyncio.gather(*(self._poll_one(i) for i in range(len(self.engines))))
            self._sent = [now - then for now, then in zip(self._sent, before)]
            await asyncio.sleep(self.poll_s)

    async def _poll_one(self, i: int) -> None:
        """Engine ``i``'s state, queue depth and arm from its ``stats()``; the canary fraction is that
        of the canary engine, if any (0 when none)."""
        try:
            st = await asyncio.wait_for(self.engines[i].stats.remote(), 5.0)
        except asyncio.TimeoutError:
            return
        except ray.exceptions.RayError:
            st = None
        self._states[i], self._loads[i] = engine_state(st), (st or {}).get("in_flight", 0)
        if st is not None:
            self._arms[i] = st.get("arm")
            if st.get("arm") == "canary":
                self._fraction = float(st.get("canary_fraction") or 0.0)
            elif "canary" not in self._arms:
                self._fraction = 0.0

    def _mark_down(self, index: int) -> None:
        """Skip engine ``index`` until it serves again: a watcher polls its stats every
        ``retry_after_s`` / 2 seconds and clears the mark once it answers without ``awaiting_sync``
        (Ray restarted it and the driver re-synced the current policy)."""
        if index not in self._down:
            logger.warning("rollout-%d is down or awaiting its re-sync: routing its sessions to the next engine", index)
            self._down[index] = asyncio.ensure_future(self._watch(index))

    async def _watch(self, index: int) -> None:
        from clawray.recovery import probe

        try:
            while True:
                await asyncio.sleep(max(0.2, self.retry_after_s / 2))
                st = await probe(self.engines[index].stats.remote(), 5.0)
                if st is not None and not st.get("awaiting_sync"):
                    return
        finally:
            self._down.pop(index, None)
