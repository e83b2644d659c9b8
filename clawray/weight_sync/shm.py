"""Named shared-memory buffers for the ipc transport on CPU: created by the sender, mapped by the
receivers, removed when the sender's process is gone, however it ended.

Owns: the files' names (``clawray-ipc-<pid namespace>-<creator pid>-<token>-<index>`` in ``/dev/shm``), their mode
(0600, created exclusively), their handles and their removal. Must not: know buckets, plans or syncs
(:class:`~clawray.weight_sync.ipc.IpcTransport` does).

Why not torch's ``file_system`` sharing: its files are removed by a ``torch_shm_manager`` daemon once
every client process has exited, and Ray's raylet kills the child processes of the workers it stops
(that daemon included), so every ``ray.kill`` or ``ray.shutdown`` of a sender left its packed copy of
the weights in ``/dev/shm``, i.e. in RAM until reboot: 545 MB per SmolLM2-135M run, ~2 GB for
Qwen2.5-0.5B (7.6 GB had piled up on the development machine). Here the creator's pid is in the
name, so any later process can tell a dead creator's files (:func:`sweep`): every new sender sweeps
before it allocates, and so does the driver when a run's actors are stopped; a learner being shut
down and a process that exits normally remove their own (:func:`remove_own`).
"""

from __future__ import annotations

import atexit
import mmap
import os
import re
import secrets
from dataclasses import dataclass

import torch

PREFIX = "clawray-ipc-"
_NAME = re.compile(rf"^{re.escape(PREFIX)}(\d+)-(\d+)-[0-9a-f]+-\d+$")
_OWN: set[str] = set()  # the files this process created and has not removed


def _pid_namespace() -> int:
    """This process's pid namespace (its inode; 0 where unknown): a pid means a process only there,
    and containers that share one /dev/shm may each have their own."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def shm_dir() -> str:
    """Where the buffers live: ``/dev/shm`` (RAM-backed) where it exists, else the temp directory."""
    import tempfile

    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def _map(fd: int, nbytes: int, dtype: torch.dtype) -> torch.Tensor:
    """A flat tensor over ``nbytes`` of the open file ``fd``, shared with every other mapping of it."""
    buf = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    return torch.frombuffer(buf, dtype=dtype)  # keeps ``buf`` (the mapping) alive as long as the tensor


def create(numel: int, dtype: torch.dtype, directory: str | None = None) -> tuple[torch.Tensor, "ShmHandle"]:
    """A new zero-filled shared buffer of ``numel`` elements and its handle.

    The file is created exclusively (``O_EXCL``, mode 0600) under a name that holds this process's
    pid, and is removed when this process exits normally (or by a later :func:`sweep` when it does
    not).

    Raises:
        OSError: the file system refused (no room: ``/dev/shm`` is often 64 MiB in containers).
    """
    directory = directory or shm_dir()
    nbytes = numel * dtype.itemsize
    path = os.path.join(directory, f"{PREFIX}{_pid_namespace()}-{os.getpid()}-{secrets.token_hex(6)}-{len(_OWN)}")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        _OWN.add(path)
        os.ftruncate(fd, nbytes)
        flat = _map(fd, nbytes, dtype) if nbytes else torch.empty(0, dtype=dtype)
    except BaseException:
        remove(path)
        raise
    finally:
        os.close(fd)
    return flat, ShmHandle(path, numel, str(dtype).removeprefix("torch."))


def open_handle(path: str, numel: int, dtype: str) -> torch.Tensor:
    """Map an existing buffer (the receiver side of a :class:`ShmHandle`); never creates a file.

    Raises:
        FileNotFoundError: the sender removed it (withdrawn, or its process ended).
        ValueError: the file does not hold ``numel`` elements of ``dtype``.
    """
    torch_dtype = getattr(torch, dtype)
    nbytes = numel * torch_dtype.itemsize
    fd = os.open(path, os.O_RDWR)
    try:
        size = os.fstat(fd).st_size
        if size != nbytes:
            raise ValueError(f"{path} holds {size} bytes where {numel} x {dtype} is {nbytes}")
        return _map(fd, nbytes, torch_dtype) if nbytes else torch.empty(0, dtype=torch_dtype)
    finally:
        os.close(fd)


@dataclass(frozen=True)
class ShmHandle:
    """What a receiver needs to map a buffer; unpickles to the mapped flat tensor (:func:`open_handle`),
    as torch's tensor reductions do, so a handle is posted as ``pickle.dumps(handle)``."""

    path: str
    numel: int
    dtype: str  # a torch dtype's name, e.g. "float32"

    def __reduce__(self):
        return open_handle, (self.path, self.numel, self.dtype)


def remove(path: str) -> None:
    """Remove a buffer this process created (mappings stay valid until they are dropped)."""
    _OWN.discard(path)
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def sweep(directory: str | None = None) -> list[str]:
    """Remove every ipc buffer file whose creating process is gone; returns the removed paths.

    A file of a live process (this one included), of another pid namespace or of another user is
    never touched; a file that disappears meanwhile is skipped. Costs one ``listdir`` and one
    signal-0 probe per file.
    """
    directory = directory or shm_dir()
    namespace = _pid_namespace()
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    removed = []
    for name in names:
        m = _NAME.match(name)
        if m is None or int(m.group(1)) != namespace or _alive(int(m.group(2))):
            continue
        path = os.path.join(directory, name)
        try:
            os.unlink(path)
            removed.append(path)
        except OSError:
            pass
    return removed


@atexit.register
def remove_own() -> int:
    """Remove every buffer this process created (live mappings stay valid); returns how many."""
    own = list(_OWN)
    for path in own:
        remove(path)
    return len(own)
