"""Ctrl-C and SIGTERM end a job within a bounded time.

Owns: the CLI process's SIGINT/SIGTERM handling: the first signal's ``KeyboardInterrupt``, the deadline
(``trainer.shutdown_timeout_s``) and the forced exit with 130. Must not: shut anything down itself: the
driver's unwinding writes the checkpoint and stops Serve and Ray.

The first SIGINT/SIGTERM unwinds the job as Ctrl-C does (a ``KeyboardInterrupt`` in the main thread:
the driver writes its at-exit checkpoint, shuts Serve and Ray down and prints its closing lines) and
arms a deadline of ``trainer.shutdown_timeout_s`` seconds. Past the deadline, or at a second signal,
the process exits at once with 130, after one line that says so. Nothing acknowledged is lost either
way (:mod:`clawray.journal`): ``resume=true`` continues from the last checkpoint. The local Ray a job
started goes with it (Ray's reaper process stops the cluster when its driver exits).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable


class BoundedStop:
    """A SIGINT/SIGTERM handler (install with :meth:`install`).

    Args:
        timeout_s: seconds from the first signal to the forced exit.
        exit: the forced exit (``os._exit``; tests pass a recorder).
        say: writes one line to the user's terminal (:func:`clawray.console.terminal`).
    """

    def __init__(self, timeout_s: float, exit: Callable[[int], None] = os._exit, say: Callable[[str], None] = None):
        self.timeout_s = float(timeout_s)
        self.exit = exit
        self.say = say or _say
        self.first_at: float | None = None
        self._timer: threading.Timer | None = None

    def install(self) -> BoundedStop:
        """Handle SIGINT and SIGTERM in this process (main thread only); returns self."""
        signal.signal(signal.SIGINT, self)
        signal.signal(signal.SIGTERM, self)
        return self

    def __call__(self, signum: int, frame: object) -> None:
        """The first signal: arm the deadline and raise ``KeyboardInterrupt``; a later one: exit now.

        Raises:
            KeyboardInterrupt: at the first signal.
        """
        if self.first_at is None:
            self.first_at = time.monotonic()
            self._timer = threading.Timer(self.timeout_s, self.force, (f"still stopping after {self.timeout_s:g} s",))
            self._timer.daemon = True
            self._timer.start()
            self.say(
                f"[clawray] stopping: at most {self.timeout_s:g} s (trainer.shutdown_timeout_s); "
                "interrupt again to exit at once"
            )
            raise KeyboardInterrupt
        self.force(f"interrupted again after {time.monotonic() - self.first_at:.0f} s")

    def cancel(self) -> None:
        """Disarm the deadline (the job ended by itself)."""
        if self._timer is not None:
            self._timer.cancel()

    def force(self, why: str) -> None:
        """Exit at once with 130, after one line saying ``why`` and what survives."""
        self.say(
            f"clawray: {why}: exiting now, without the at-exit checkpoint; every acknowledged sample is "
            "in the journal (resume=true continues from the last checkpoint)"
        )
        self.exit(130)


def _say(line: str) -> None:
    from clawray.console import terminal

    out = terminal()
    out.write(line + "\n")
    out.flush()
