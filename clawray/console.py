"""What a job prints: clawray's own lines on the terminal, everything else in the run's log file.

Owns: descriptors 1 and 2 of the driver process while :func:`capture` runs, which lines are
clawray's own (:func:`is_own_line`), the log file's content and the progress bars. Must not: decide
what is said (its callers print; this only routes it) or import Ray at module level (only
:func:`wait_with_progress` uses it).

Design: :func:`capture` points file descriptors 1 and 2 of the driver process at a pipe (``os.dup2``),
so every byte written there lands in one place, whatever wrote it: Python ``print`` and logging,
Ray's relay of its workers' output (``log_to_driver``), wandb, C libraries, and child processes
that inherit the descriptors. A reader thread splits the stream into lines, strips ANSI escape
codes and appends each line to the log file; a line that is clawray's own (``[clawray] ...``, or
``clawray: ...``, also when a Ray worker prefix ``(Actor pid=N)`` precedes it) is also written to
the saved terminal descriptor. Progress bars (:func:`progress`, tqdm) write straight to the
terminal, never to the file. ``verbose=True`` leaves the descriptors alone (everything on the
terminal, as without :func:`capture`).

Invariants: the log file holds no ANSI codes; after :func:`capture` exits, descriptors 1 and 2 are
the ones it found (even on an exception, so a traceback reaches the terminal); the reader thread
never blocks a writer for long (it only reads, strips and writes), and a failure inside it
switches to plain copying rather than stopping (a stopped reader would block every writer once
the pipe's buffer is full).
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import threading
from typing import Any, Iterator, TextIO

ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]|\x1b[@-Z\\-_]")
_OWN = re.compile(r"^(?:\([^)]*\)\s+)?(?:\[clawray\]|clawray:)")

_terminal: TextIO | None = None  # set while capture() is active


def strip_ansi(text: str) -> str:
    """``text`` without ANSI escape sequences (colours, cursor moves); carriage-return progress
    redraws keep only their last state."""
    text = ANSI.sub("", text)
    return text.rsplit("\r", 1)[-1] if "\r" in text.rstrip("\r") else text.replace("\r", "")


def is_own_line(line: str) -> bool:
    """True for clawray's own lines: ``[clawray] ...`` or ``clawray: ...`` (after a Ray worker
    prefix such as ``(SimUserPool pid=12)``, if any), after ANSI codes are stripped."""
    return _OWN.match(strip_ansi(line)) is not None


def terminal() -> TextIO:
    """The terminal stream: the saved descriptor while :func:`capture` is active, else
    ``sys.stderr``."""
    return _terminal if _terminal is not None else sys.stderr


class _Router(threading.Thread):
    def __init__(self, read_fd: int, log: TextIO, term: TextIO):
        super().__init__(name="clawray-console", daemon=True)
        self.read_fd, self.log, self.term = read_fd, log, term

    def run(self) -> None:
        pending = b""
        while True:
            try:
                chunk = os.read(self.read_fd, 65536)
            except OSError:
                break
            if not chunk:
                break
            pending += chunk
            *lines, pending = pending.split(b"\n")
            for raw in lines:
                self._route(raw.decode("utf-8", "replace"))
        if pending:
            self._route(pending.decode("utf-8", "replace"))

    def _route(self, line: str) -> None:
        try:
            clean = strip_ansi(line)
            self.log.write(clean + "\n")
            self.log.flush()
            if _OWN.match(clean):
                self.term.write(clean + "\n")
                self.term.flush()
        except Exception:  # noqa: BLE001 - never stop reading: a full pipe would block every writer
            pass


@contextlib.contextmanager
def capture(log_path: str, verbose: bool = False) -> Iterator[str | None]:
    """Route the process's output (see the module docstring) while the block runs.

    Args:
        log_path: the log file (appended; its folder is created).
        verbose: leave the output alone (the block sees the terminal as usual).

    Yields:
        ``log_path``, or None when ``verbose``.
    """
    global _terminal
    if verbose:
        yield None
        return
    os.makedirs(os.path.dirname(os.path.abspath(log_path)), exist_ok=True)
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    saved = {fd: os.dup(fd) for fd in (1, 2)}
    term = os.fdopen(os.dup(saved[1]), "w", buffering=1)  # clawray's lines went to stdout before: so they still do
    log = open(log_path, "a", encoding="utf-8")
    read_fd, write_fd = os.pipe()
    router = _Router(read_fd, log, term)
    router.start()
    os.dup2(write_fd, 1)
    os.dup2(write_fd, 2)
    os.close(write_fd)
    _terminal = term
    try:
        yield log_path
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        for fd, orig in saved.items():
            os.dup2(orig, fd)  # closes our pipe ends at 1 and 2: the reader sees EOF once children let go
            os.close(orig)
        _terminal = None
        router.join(timeout=2.0)  # a surviving child may still hold the pipe: do not wait for it
        if not router.is_alive():
            os.close(read_fd)
            log.close()
        with contextlib.suppress(Exception):
            term.close()


def progress(total: float | None = None, desc: str = "", unit: str = "it", **kwargs: Any):
    """A tqdm progress bar on the terminal (never in the log file); hidden when the terminal is
    not a TTY (a piped run keeps its output clean). Use as a context manager; ``update(n)``.
    """
    from tqdm import tqdm

    stream = terminal()
    disable = kwargs.pop("disable", not _isatty(stream))
    return tqdm(
        total=total,
        desc=f"[clawray] {desc}" if desc else None,
        unit=unit,
        file=stream,
        disable=disable,
        leave=kwargs.pop("leave", False),
        dynamic_ncols=True,
        **kwargs,
    )


def _isatty(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except Exception:  # noqa: BLE001
        return False


def wait_with_progress(refs: list, desc: str, unit: str = "it") -> list:
    """``ray.get(refs)`` with a progress bar counting finished refs (:func:`progress`).

    Raises:
        whatever ``ray.get`` raises for a failed ref.
    """
    import ray

    with progress(total=len(refs), desc=desc, unit=unit) as bar:
        pending = list(refs)
        while pending:
            done, pending = ray.wait(pending, num_returns=len(pending), timeout=0.5)
            bar.update(len(done))
    return ray.get(refs)
