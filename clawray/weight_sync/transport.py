"""The transport interface: one sender (learner rank 0), one receiver per rollout engine.

Owns: the interface, the header's layout (:data:`HEADER_LEN` ``int64`` words, a magic first) and its
check before any weight is yielded, bucket packing and :class:`TransportSpec`. Must not: call Ray or
import an implementation (:mod:`clawray.weight_sync.factory` knows them).

A :class:`WeightTransport` has one sender (``rank == 0``) and one receiver per RolloutEngine (ranks
``1..W-1``). Both sides hold the same plan (:mod:`clawray.weight_sync.plan`) before the first sync.
Every sync starts with a :class:`SyncHeader`: the policy version, the plan's size and the plan's
digest; the sender's plan itself (a few KB of JSON) follows the header of a group's first sync (every
mailbox sync). A receiver compares them with its own plan *before* it yields any weight and raises
:class:`~clawray.weight_sync.plan.WeightSyncError` naming the first differences; it still drains the
sync's buckets so that the group stays in step.

:class:`TransportSpec` is what every member of one group is built from (the driver builds it once per
group, :func:`clawray.weight_sync.factory.make_transport` turns it plus a rank into one end). The
implementations live one per file: ``collective.py``, ``object_store.py``, ``ipc.py``.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any, Iterator

import torch

from clawray.engines.base import WeightSpec
from clawray.weight_sync.plan import (
    Bucket,
    WeightSyncError,
    numel,
    decode_plan,
    encode_plan,
    plan_buckets,
    plan_diff,
    plan_digest,
)

TRANSPORTS = ("collective", "object_store", "ipc")
_MAGIC = 0x5C1A_0001  # first header word: a sender speaking another header layout fails loudly
HEADER_LEN = 7  # magic, version, n_tensors, n_buckets, digest, meta_nbytes, status
OK, ABORT, WITHDRAWN = 0, 1, 2  # header status; WITHDRAWN: the ipc sender gave up waiting for acks


@dataclass
class TransportSpec:
    """Everything the members of one sync group share; each member adds only its rank (and name).

    Args:
        kind: ``"collective"``, ``"object_store"`` or ``"ipc"`` (same host only).
        world_size: 1 + number of receivers (rollout engines).
        plan: the ordered weight specs every sync carries; ``dtype`` is the dtype on the wire.
        bucket_bytes: maximum bytes per flat bucket.
        timeout_s: seconds any single wait of the transport may take before it raises.
        host, port: collective only: the TCPStore rendezvous address rank 0 bound on its own node
            and published (:meth:`WeightSyncController.connect` sets both; a rebuild uses a new port).
            The 127.0.0.1 default is for one-process tests and benches on a single machine.
        backend: collective only: ``"gloo"`` (CPU tensors) or ``"nccl"`` (CUDA tensors).
        mailbox: object_store and ipc only: the ``WeightMailboxActor`` handle the group posts to.

    Raises:
        ValueError: unknown ``kind``.
    """

    kind: str
    world_size: int
    plan: list[WeightSpec]
    bucket_bytes: int = 64 << 20
    timeout_s: float = 120.0
    host: str = "127.0.0.1"
    port: int = 0
    backend: str = "gloo"
    mailbox: Any = None

    def __post_init__(self):
        if self.kind not in TRANSPORTS:
            raise ValueError(f"unknown sync transport {self.kind!r}; expected one of {list(TRANSPORTS)}")


@dataclass
class SyncHeader:
    """What precedes the buckets of one sync (``digest``: :func:`plan_digest` of the sender's plan;
    ``meta_nbytes``: bytes of :func:`encode_plan` that follow the header, 0 when the receivers
    already have it; ``status``: 0 ok, 1 the sender aborted)."""

    version: int
    n_tensors: int
    n_buckets: int
    digest: int
    meta_nbytes: int
    status: int = OK

    def to_tensor(self) -> torch.Tensor:
        """``int64[7]`` for a collective."""
        return torch.tensor(
            [_MAGIC, self.version, self.n_tensors, self.n_buckets, self.digest, self.meta_nbytes, self.status],
            dtype=torch.int64,
        )

    @classmethod
    def from_tensor(cls, t: torch.Tensor) -> "SyncHeader":
        """Parse an ``int64[7]`` header.

        Raises:
            WeightSyncError: the magic word is wrong (a sender of another layout).
        """
        magic, *rest = t.tolist()
        if magic != _MAGIC:
            raise WeightSyncError(f"sync header has magic {magic:#x}, expected {_MAGIC:#x} (another sender layout?)")
        return cls(*rest)


# ---------------------------------------------------------------------- transports
class WeightTransport(abc.ABC):
    """One end of a weight transport: rank 0 sends, ranks ``1..world_size-1`` receive.

    Args:
        rank: this process's rank (0 = learner rank 0).
        plan: the ordered weight specs every sync carries; ``dtype`` is the dtype on the wire.
        bucket_bytes: maximum bytes per flat bucket.
        timeout_s: seconds any single wait of the transport may take before it raises.
    """

    kind = ""

    def __init__(self, rank: int, plan: list[WeightSpec], bucket_bytes: int, timeout_s: float):
        self.rank = rank
        self.plan = list(plan)
        self.buckets = plan_buckets(self.plan, bucket_bytes)
        self.timeout_s = timeout_s
        self.digest = plan_digest(self.plan)
        self.meta = encode_plan(self.plan, self.buckets)

    @abc.abstractmethod
    def send(self, state: dict[str, torch.Tensor], version: int) -> dict[str, float]:
        """Send the planned tensors of ``state`` (full, unsharded; cast to the plan's dtypes) stamped
        with ``version``. Rank 0 only.

        Returns:
            ``{"bytes": payload bytes sent once, "seconds": wall seconds}``.

        Raises:
            WeightSyncError: ``state`` does not fit the plan (receivers are told to abort), or the
                transport failed or timed out.
        """

    @abc.abstractmethod
    def receive(self, expected_version: int) -> Iterator[tuple[str, torch.Tensor]]:
        """Receive one sync. The header (version, names, shapes, dtypes) is checked before this
        returns; the iterator then yields ``(name, tensor)`` in plan order as buckets arrive and
        must be consumed to the end. Tensors are views of flat buckets that the collective transport
        reuses: copy them (load them) before the next sync.

        Raises:
            WeightSyncError: version or metadata mismatch (naming the differences), the sender
                aborted, or the transport failed or timed out.
        """

    @abc.abstractmethod
    def close(self) -> None:
        """Release the group or mailbox; the transport cannot be used afterwards."""

    def done(self, ok: bool = True) -> None:  # noqa: B027 - an optional hook, a no-op by default
        """Receiver: the tensors of the last :meth:`receive` are loaded (``ok``) or given up on; the
        transport may reuse their memory from now on. A no-op except for :class:`IpcTransport`, whose
        tensors are the sender's buffers (it acks the sender here).

        Raises:
            WeightSyncError: (ipc) the sender withdrew the sync before this ack: what was loaded
                may be incomplete.
        """

    # shared by both transports
    def header(self, version: int, status: int = OK) -> SyncHeader:
        return SyncHeader(version, len(self.plan), len(self.buckets), self.digest, len(self.meta), status)

    def _check_header(self, header: SyncHeader, meta: bytes, expected_version: int) -> list[tuple[int, torch.dtype]]:
        """The sender's bucket layout; raises :class:`Abort` (carrying it) when the sync must not be loaded."""
        _, layout = decode_plan(meta)
        if header.status == ABORT:
            raise Abort(
                layout,
                f"the sender aborted the sync to v{header.version} (its state does not fit "
                "the plan; see the learner's error)",
            )
        problems = []
        if header.digest != self.digest:
            sender_plan, _ = decode_plan(meta)
            problems += plan_diff(self.plan, sender_plan) or ["plan digests differ"]
        if header.version != expected_version:
            problems.append(f"version {header.version} != expected {expected_version}")
        if problems:
            raise Abort(
                layout,
                f"sync header rejected before loading: {'; '.join(problems)} "
                f"(tensors {header.n_tensors} vs {len(self.plan)}, "
                f"buckets {header.n_buckets} vs {len(self.buckets)})",
            )
        return layout

    def _pack(
        self, bucket: Bucket, state: dict[str, torch.Tensor], device: torch.device, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """One flat tensor of ``bucket.numel`` elements, packed into ``out`` (a uint8 buffer) when it holds
        the bucket's bytes, else into a new tensor; no copy when the bucket is one tensor already of the
        plan's dtype on ``device``."""
        parts = [state[s.name].detach().reshape(-1) for s in bucket.specs]
        if len(parts) == 1 and parts[0].dtype == bucket.dtype and parts[0].device == device:
            return parts[0].contiguous()
        if out is not None and out.numel() >= bucket.numel * bucket.dtype.itemsize:
            flat = out[: bucket.numel * bucket.dtype.itemsize].view(bucket.dtype)
        else:
            flat = torch.empty(bucket.numel, dtype=bucket.dtype, device=device)
        offset = 0
        for p in parts:
            flat[offset : offset + p.numel()].copy_(p)
            offset += p.numel()
        return flat

    def _views(self, bucket: Bucket, flat: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        offset = 0
        for spec in bucket.specs:
            n = numel(spec.shape)
            yield spec.name, flat[offset : offset + n].view(spec.shape)
            offset += n


class Abort(WeightSyncError):
    """A rejected header; carries the sender's bucket layout so the receiver can drain the sync."""

    def __init__(self, layout: list[tuple[int, torch.dtype]], message: str):
        super().__init__(message)
        self.layout = layout
