"""The weight mailbox: the Ray actor through which the object-store and ipc transports post each sync.

Owns: the posts (the newest two of a generation), the receivers' names and acks, the sender-side check
and abort of both mailbox transports and :func:`abort_reason`. Must not: pack, send or load a weight
(the transports do) or know a process group.

The sender posts the header, the plan bytes and the bucket refs (ipc: per-receiver handle lists) under
a sequence number 1, 2, ...; receivers fetch by number, and the ipc receivers register their names and
ack each sync here.
"""

from __future__ import annotations

from typing import Any

import ray
import torch

from clawray.weight_sync.plan import WeightSyncError, check_plan
from clawray.weight_sync.transport import ABORT, WITHDRAWN


class WeightMailbox:
    """Where :class:`ObjectStoreTransport` and :class:`IpcTransport` post each sync: the header, the
    plan bytes and the bucket refs (ipc: per-receiver handle lists). The ipc receivers also register
    their names here and ack each sync.

    Posts are numbered 1, 2, ... per transport generation; a group rebuild calls :meth:`reset`.
    """

    def __init__(self):
        import asyncio

        self._posts: dict[int, tuple[dict, bytes, list]] = {}
        self._acks: dict[int, dict[int, tuple[bool, str]]] = {}  # seq -> {rank: (ok, note)}
        self._names: dict[int, str] = {}  # rank -> receiver name
        self._cond = asyncio.Condition()

    async def reset(self) -> None:
        """Forget every post, ack and name (a new transport generation starts at 1)."""
        async with self._cond:
            self._posts.clear()
            self._acks.clear()
            self._names.clear()

    async def post(self, seq: int, header: dict, meta: bytes, refs: list) -> None:
        """Publish sync number ``seq`` (keeps only the newest two)."""
        async with self._cond:
            self._posts[seq] = (header, meta, refs)
            for old in [k for k in self._posts if k < seq - 1]:
                del self._posts[old]
            for old in [k for k in self._acks if k < seq - 1]:
                del self._acks[old]
            self._cond.notify_all()

    async def join(self, rank: int, name: str) -> None:
        """Register receiver ``rank``'s name (used in the sender's timeout errors)."""
        self._names[rank] = name

    async def names(self) -> dict[int, str]:
        """``{rank: name}`` of the registered receivers."""
        return dict(self._names)

    async def ack(self, seq: int, rank: int, ok: bool, note: str = "") -> bool:
        """Receiver ``rank`` is done with sync ``seq`` (``ok``: loaded). Returns False when the
        sender had already withdrawn that sync (its buffers may have been reused)."""
        async with self._cond:
            post = self._posts.get(seq)
            if post is None or post[0].get("status") == WITHDRAWN:
                return False
            self._acks.setdefault(seq, {})[rank] = (bool(ok), note)
            self._cond.notify_all()
            return True

    async def wait_acks(self, seq: int, ranks: list[int], timeout_s: float) -> dict[int, tuple[bool, str]]:
        """Wait up to ``timeout_s`` seconds for every rank in ``ranks`` to ack sync ``seq``, then
        withdraw the sync if some did not (their later acks return False, their fetches see status
        withdrawn). Returns the acks received, ``{rank: (ok, note)}``; never raises on a timeout."""
        import asyncio

        async with self._cond:

            def complete() -> bool:
                return all(r in self._acks.get(seq, {}) for r in ranks)

            try:
                await asyncio.wait_for(self._cond.wait_for(complete), timeout_s)
            except (asyncio.TimeoutError, TimeoutError):
                pass
            acks = dict(self._acks.get(seq, {}))
            if not complete() and seq in self._posts:
                header, meta, _ = self._posts[seq]
                self._posts[seq] = ({**header, "status": WITHDRAWN}, meta, [])
                self._cond.notify_all()
            return acks

    async def fetch(self, seq: int, timeout_s: float) -> tuple[dict, bytes, list]:
        """Wait up to ``timeout_s`` seconds for sync number ``seq``.

        Raises:
            TimeoutError: nothing was posted for ``seq`` in time.
        """
        import asyncio

        async with self._cond:
            await asyncio.wait_for(self._cond.wait_for(lambda: seq in self._posts), timeout_s)
            return self._posts[seq]


# The Ray actor class (an async actor: fetch waits without blocking posts).
WeightMailboxActor = ray.remote(WeightMailbox)


def check_state_or_abort(transport: Any, state: dict[str, torch.Tensor], version: int) -> None:
    """Sender side of a mailbox transport (``object_store``, ``ipc``): check ``state`` against the plan;
    on a mismatch post an abort header for this sync (receivers fail fast instead of waiting out
    the timeout), then raise.

    Raises:
        WeightSyncError: the state lacks a planned weight or has another shape.
    """
    try:
        check_plan(transport.plan, state)
    except WeightSyncError:
        ray.get(
            transport.mailbox.post.remote(transport.seq, vars(transport.header(version, ABORT)), transport.meta, []),
            timeout=transport.timeout_s,
        )
        raise


def abort_reason(e: BaseException) -> str:
    """A one-line cause of a failed Ray call (the remote exception, not Ray's traceback wrapper)."""
    if isinstance(e, ray.exceptions.GetTimeoutError):
        return "timed out"
    if isinstance(e, ray.exceptions.OutOfMemoryError):
        return "actor killed by Ray's memory monitor, out of host memory"
    if isinstance(e, ray.exceptions.RayActorError):
        return "actor died or is unreachable"
    cause = getattr(e, "cause", None) or e
    return f"{type(cause).__name__}: {str(cause).strip().splitlines()[-1] if str(cause).strip() else ''}"
