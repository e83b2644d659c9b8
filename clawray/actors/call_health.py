"""How a judge or teacher worker's dependency is doing: work waiting on it and its recent calls.

Owns: a dependency's state (``ok``/``slow``/``failing``) and its reason, from the work in flight and the
outcomes of recent calls, and the thresholds (:data:`FAILING_MIN_CALLS`, the window). Must not: import Ray,
call or retry the dependency (the worker does), or decide the HTTP answer (:mod:`clawray.serve.health`).

A judge endpoint that answers in 20 s against a 5 s timeout, or thousands of judgements queued behind
a slow one, used to leave ``/health`` at "ok" while no sample reached the learner. Each worker keeps a
:class:`CallHealth`; its :meth:`CallHealth.report` (answered in the worker's ``control`` concurrency
group, never behind the work) feeds ``/health`` (state ``slow``/``failing`` with the reason: the
server answers 503 ``degraded``) and the driver's line while it waits for a batch.

Rules (window ``window_s``, default 120 s):

* ``failing``: at least :data:`FAILING_MIN_CALLS` calls ended in the window and the last
  :data:`FAILING_MIN_CALLS` of them all failed (timeout or error);
* ``slow``: the oldest unit of work still in progress (a judgement, a hint, a teacher score) has
  waited longer than ``slow_after_s`` (the worker's own bound on one unit: the retries times the
  call timeout, twice over, so some queueing is not yet slow);
* else ``ok``. Both clear by themselves: calls that succeed again, or the backlog draining.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager

#: Consecutive failed calls (within the window) that make a dependency ``failing``.
FAILING_MIN_CALLS = 3


class CallHealth:
    """In-flight work and the outcomes of recent calls of one dependency.

    Args:
        what: what a unit of work is, for the reason text (``"judgements"``, ``"teacher scores"``).
        slow_after_s: seconds a unit of work may wait before the dependency is ``slow``.
        window_s: seconds of call outcomes considered.
        clock: monotonic seconds (tests pass a fake clock).
    """

    def __init__(
        self, what: str, slow_after_s: float, window_s: float = 120.0, clock: Callable[[], float] = time.monotonic
    ):
        self.what, self.slow_after_s, self.window_s, self.clock = what, float(slow_after_s), float(window_s), clock
        self._waiting: dict[int, float] = {}  # work id -> start time
        self._ids = itertools.count()
        self._calls: deque[tuple[float, str | None]] = deque(maxlen=200)  # (end time, error or None)

    @contextmanager
    def work(self) -> Iterator[None]:
        """Marks one unit of work in progress for the duration of the ``with`` block."""
        key = next(self._ids)
        self._waiting[key] = self.clock()
        try:
            yield
        finally:
            self._waiting.pop(key, None)

    def call_ended(self, error: str | None = None) -> None:
        """One call to the dependency ended: ``error`` None when it answered, else a short text
        (``"TimeoutError"``, ``"APIConnectionError: ..."``)."""
        self._calls.append((self.clock(), error))

    def report(self) -> dict:
        """``{"state": "ok"|"slow"|"failing", "reason": str|None, "waiting": int, "oldest_s": float,
        "calls": int, "failed": int}``: calls and failed calls in the window, units of work in
        progress and the seconds the oldest has waited."""
        now = self.clock()
        recent = [err for t, err in self._calls if now - t <= self.window_s]
        failed = sum(err is not None for err in recent)
        oldest = now - min(self._waiting.values()) if self._waiting else 0.0
        out = {
            "state": "ok",
            "reason": None,
            "waiting": len(self._waiting),
            "oldest_s": round(oldest, 1),
            "calls": len(recent),
            "failed": failed,
        }
        last = recent[-FAILING_MIN_CALLS:]
        if len(last) == FAILING_MIN_CALLS and all(err is not None for err in last):
            out["state"] = "failing"
            out["reason"] = (
                f"{failed} of the last {len(recent)} calls in {self.window_s:.0f} s failed (last: {last[-1]})"
            )
        elif oldest > self.slow_after_s:
            out["state"] = "slow"
            out["reason"] = (
                f"{len(self._waiting)} {self.what} waiting, the oldest for {oldest:.0f} s "
                f"(slow after {self.slow_after_s:.0f} s)"
            )
        return out
