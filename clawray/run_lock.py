"""The run folder's owner: one clawray run per run folder, enforced with an exclusive lock.

Owns: ``RUN_DIR/.clawray.lock``, its owner record and the refusal (:class:`RunFolderInUse`). Must
not: wait for the lock (a taken folder is refused at once) or touch anything else in the run folder.

A second run started in the folder of a live run used to delete that run's journal, prune its
checkpoints and lose acknowledged samples. The driver now takes ``RUN_DIR/.clawray.lock`` with
``flock(LOCK_EX | LOCK_NB)`` before it touches anything in the folder and holds it until it shuts
down; the kernel releases it when the process dies (``kill -9`` included), so a stale file never
blocks a resume. The file names the owner (pid, host, start time) for the refusal message. flock
is advisory and per host: a run folder on a network filesystem shared by two hosts is not covered.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time

from clawray.file_modes import FILE_MODE

LOCK_FILE = ".clawray.lock"


class RunFolderInUse(RuntimeError):
    """Another live clawray run owns this run folder; the message names it and what to do."""


class RunFolderLock:
    """The exclusive owner lock of one run folder.

    Args:
        run_dir: the run folder (must exist).
    """

    def __init__(self, run_dir: str):
        self.path = os.path.join(run_dir, LOCK_FILE)
        self._fd: int | None = None

    def acquire(self) -> None:
        """Take the lock and write the owner record.

        Raises:
            RunFolderInUse: another process holds it (its pid, host and start time are named).
        """
        if self._fd is not None:
            return
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, FILE_MODE)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = _read_owner(fd)
            os.close(fd)
            since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(owner.get("started", 0)))
            raise RunFolderInUse(
                f"run folder {os.path.dirname(self.path)} is in use by another clawray run "
                f"(pid {owner.get('pid', '?')} on {owner.get('host', '?')}, since {since}): "
                "stop that run first, or give this one its own run_dir=..."
            ) from None
        os.ftruncate(fd, 0)
        record = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time()}
        os.pwrite(fd, json.dumps(record).encode(), 0)
        self._fd = fd

    def release(self) -> None:
        """Give the folder up (idempotent). The file stays; only the lock matters."""
        if self._fd is None:
            return
        try:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
        finally:
            os.close(self._fd)
            self._fd = None

    @property
    def held(self) -> bool:
        """Whether this object holds the lock."""
        return self._fd is not None


def _read_owner(fd: int) -> dict:
    try:
        data = json.loads(os.pread(fd, 4096, 0) or b"{}")
    except ValueError:
        return {}
    return data if isinstance(data, dict) else {}
