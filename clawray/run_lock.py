"""The run folder's owner: one clawray run per run folder, enforced with an exclusive lock.

Owns: ``RUN_DIR/.clawray.lock`` and the checkpoint folder's lock beside that folder, their owner
records and the refusal (:class:`RunFolderInUse`). Must not: wait for a lock (a taken folder is
refused at once) or touch anything else in the folders.

A second run started in the folder of a live run used to delete that run's journal, prune its
checkpoints and lose acknowledged samples. The driver now takes ``RUN_DIR/.clawray.lock`` with
``flock(LOCK_EX | LOCK_NB)`` before it touches anything in the folder and holds it until it shuts
down; the kernel releases it when the process dies (``kill -9`` included), so a stale file never
blocks a resume. The file names the owner (pid, host, start time) for the refusal message. flock
is advisory and per host: a run folder on a network filesystem shared by two hosts is not covered.

The checkpoint folder (``checkpoint.dir``, which may lie outside the run folder or be another run's)
is locked the same way (:func:`checkpoint_folder_lock`): two runs of different run folders sharing one
used to set aside or prune each other's checkpoints.
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
    """The exclusive owner lock of one run folder (or of another folder a run owns).

    Args:
        run_dir: the folder (a missing one's parents are created at :meth:`acquire`).
        path: the lock file; default ``run_dir/.clawray.lock``.
        what: the folder's name in the refusal (``run folder``).
        key: the config key the refusal tells the user to change (``run_dir``).
    """

    def __init__(self, run_dir: str, *, path: str = "", what: str = "run folder", key: str = "run_dir"):
        self.folder = run_dir
        self.path = path or os.path.join(run_dir, LOCK_FILE)
        self.what, self.key = what, key
        self._fd: int | None = None

    def acquire(self) -> None:
        """Take the lock and write the owner record.

        Raises:
            RunFolderInUse: another process holds it (its pid, host and start time are named).
        """
        if self._fd is not None:
            return
        os.makedirs(os.path.dirname(self.path), mode=0o700, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, FILE_MODE)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = _read_owner(fd)
            os.close(fd)
            since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(owner.get("started", 0)))
            raise RunFolderInUse(
                f"{self.what} {self.folder} is in use by another clawray run "
                f"(pid {owner.get('pid', '?')} on {owner.get('host', '?')}, since {since}): "
                f"stop that run first, or give this one its own {self.key}=..."
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


def checkpoint_folder_lock(checkpoint_dir: str) -> RunFolderLock:
    """The lock of checkpoint folder ``checkpoint_dir``: ``.NAME.clawray.lock`` beside it, not in it,
    since a fresh run renames an earlier run's checkpoint folder aside (``set_aside``), which would
    carry a lock inside it away."""
    folder = os.path.abspath(checkpoint_dir)
    path = os.path.join(os.path.dirname(folder), f".{os.path.basename(folder)}{LOCK_FILE}")
    return RunFolderLock(folder, path=path, what="checkpoint folder", key="checkpoint.dir")
