"""Learner -> rollout weight transport: flat, versioned buckets behind one small interface.

A :class:`WeightTransport` has one sender (learner rank 0, ``rank == 0``) and one receiver per
RolloutEngine (ranks ``1..W-1``). Both sides agree on a *plan* before the first sync: the ordered list
of :class:`~clawray.engines.base.WeightSpec` the engines load. The plan is cut into flat *buckets* of
at most ``bucket_bytes`` (one dtype per bucket), so a sync costs one transfer per bucket, not one
per tensor. Implementations:

* :class:`CollectiveTransport`: a process group of its own (gloo on CPU, NCCL on GPU), separate from
  the learners' FSDP group; buckets are broadcast from rank 0, with the packing of the next bucket
  overlapped with the broadcast of the current one.
* :class:`ObjectStoreTransport`: the naive baseline; rank 0 ``ray.put``\\ s the buckets and posts their
  refs to a :class:`WeightMailbox` actor, receivers ``ray.get`` them.
* :class:`IpcTransport`: same host only; rank 0 packs the buckets into buffers on its own device and
  posts *handles* to them (CUDA IPC on GPU, shared-memory files on CPU) through the mailbox;
  receivers map the buffers (no copy), load from them and ack. The colocated path for one GPU,
  where two processes cannot form an NCCL group.

Every sync starts with a header: the policy version, the plan's size and a 64-bit digest of the
ordered ``(name, shape, dtype)`` plan; the sender's plan itself (a few KB of JSON) follows the
header of a group's first sync (every object-store sync). A receiver compares them with its own plan
*before* it yields any weight and raises :class:`WeightSyncError` naming the first differences; it
still drains the sync's buckets so that the group stays in step.

:class:`WeightSyncController` is the driver's side: it builds the group, pauses the engines, runs one
sync under ``timeout_s``, always resumes the engines, names the engines that failed and rebuilds the
group (new rendezvous port) before the next sync when one failed.
"""

from __future__ import annotations

import abc
import hashlib
import json
import time
from collections import deque
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Iterator

import ray
import torch
import torch.distributed as dist

from clawray.engines.base import WeightSpec
from clawray.ray_env import tcp_store, use_node_gloo

TRANSPORTS = ("collective", "object_store", "ipc")
_MAGIC = 0x5C1A_0001  # first header word: a sender speaking another header layout fails loudly
_HEADER_LEN = 7  # magic, version, n_tensors, n_buckets, digest, meta_nbytes, status
_OK, _ABORT, _WITHDRAWN = 0, 1, 2  # header status; _WITHDRAWN: the ipc sender gave up waiting for acks


class WeightSyncError(RuntimeError):
    """A sync failed: metadata mismatch, version mismatch, a load error or a transport timeout."""


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name.replace("torch.", ""))


@dataclass
class Bucket:
    """A run of consecutive plan entries that travel as one flat tensor of one dtype."""

    specs: list[WeightSpec]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        """Elements in the flat bucket."""
        return sum(_numel(s.shape) for s in self.specs)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def plan_buckets(plan: list[WeightSpec], bucket_bytes: int) -> list[Bucket]:
    """Split ``plan`` into buckets of at most ``bucket_bytes`` bytes (a larger tensor gets its own)."""
    buckets: list[Bucket] = []
    current: list[WeightSpec] = []
    size = 0
    for spec in plan:
        dtype = _dtype(spec.dtype)
        nbytes = _numel(spec.shape) * dtype.itemsize
        if current and (_dtype(current[0].dtype) != dtype or size + nbytes > bucket_bytes):
            buckets.append(Bucket(current, _dtype(current[0].dtype)))
            current, size = [], 0
        current.append(spec)
        size += nbytes
    if current:
        buckets.append(Bucket(current, _dtype(current[0].dtype)))
    return buckets


def check_plan(plan: list[WeightSpec], state: dict[str, torch.Tensor]) -> None:
    """Check that ``state`` has every planned name with the planned shape.

    Raises:
        WeightSyncError: naming the missing names or the first shape mismatches.
    """
    missing = [s.name for s in plan if s.name not in state]
    if missing:
        raise WeightSyncError(f"learner state dict lacks {len(missing)} planned weights, e.g. {missing[:3]}")
    bad = [f"{s.name}: {tuple(state[s.name].shape)} != {s.shape}" for s in plan
           if tuple(state[s.name].shape) != tuple(s.shape)]
    if bad:
        raise WeightSyncError(f"shape mismatch between learner and engine: {bad[:3]}")


# ---------------------------------------------------------------------- plan metadata
def _plan_rows(plan: list[WeightSpec]) -> list[list]:
    return [[s.name, [int(d) for d in s.shape], str(_dtype(s.dtype))] for s in plan]


def plan_digest(plan: list[WeightSpec]) -> int:
    """A signed 64-bit digest (sha256 prefix) of the ordered ``(name, shape, dtype)`` rows of ``plan``."""
    blob = json.dumps(_plan_rows(plan), separators=(",", ":")).encode()
    return int.from_bytes(hashlib.sha256(blob).digest()[:8], "big", signed=True)


def encode_plan(plan: list[WeightSpec], buckets: list[Bucket]) -> bytes:
    """The sender's plan and bucket layout as compact JSON bytes (sent with every sync header)."""
    return json.dumps({"plan": _plan_rows(plan), "buckets": [[b.numel, str(b.dtype)] for b in buckets]},
                      separators=(",", ":")).encode()


def decode_plan(blob: bytes) -> tuple[list[WeightSpec], list[tuple[int, torch.dtype]]]:
    """Inverse of :func:`encode_plan`: ``(plan, [(numel, dtype) per bucket])``."""
    meta = json.loads(blob.decode())
    plan = [WeightSpec(n, tuple(s), d) for n, s, d in meta["plan"]]
    return plan, [(int(n), _dtype(d)) for n, d in meta["buckets"]]


def plan_diff(expected: list[WeightSpec], got: list[WeightSpec], limit: int = 3) -> list[str]:
    """Human-readable differences between two plans (at most ``limit`` of each kind):
    names only one side has, and shape or dtype differences of common names, plus order."""
    exp = {s.name: s for s in expected}
    snd = {s.name: s for s in got}
    out = []
    only_snd = [n for n in snd if n not in exp]
    only_exp = [n for n in exp if n not in snd]
    if only_snd:
        out.append(f"sender has {len(only_snd)} weight(s) this engine does not load, e.g. {only_snd[:limit]}")
    if only_exp:
        out.append(f"sender lacks {len(only_exp)} weight(s) this engine loads, e.g. {only_exp[:limit]}")
    shapes = [f"{n}: {tuple(snd[n].shape)} != {tuple(exp[n].shape)}" for n in exp
              if n in snd and tuple(snd[n].shape) != tuple(exp[n].shape)]
    if shapes:
        out.append(f"shape (sender != engine): {shapes[:limit]}")
    dtypes = [f"{n}: {_dtype(snd[n].dtype)} != {_dtype(exp[n].dtype)}" for n in exp
              if n in snd and _dtype(snd[n].dtype) != _dtype(exp[n].dtype)]
    if dtypes:
        out.append(f"dtype (sender != engine): {dtypes[:limit]}")
    if not out and [s.name for s in expected] != [s.name for s in got]:
        out.append("same weights in a different order")
    return out


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
    status: int = _OK

    def to_tensor(self) -> torch.Tensor:
        """``int64[7]`` for a collective."""
        return torch.tensor([_MAGIC, self.version, self.n_tensors, self.n_buckets, self.digest, self.meta_nbytes,
                             self.status], dtype=torch.int64)

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
    def _header(self, version: int, status: int = _OK) -> SyncHeader:
        return SyncHeader(version, len(self.plan), len(self.buckets), self.digest, len(self.meta), status)

    def _check_header(self, header: SyncHeader, meta: bytes, expected_version: int) -> list[tuple[int, torch.dtype]]:
        """The sender's bucket layout; raises :class:`_Abort` (carrying it) when the sync must not be loaded."""
        _, layout = decode_plan(meta)
        if header.status == _ABORT:
            raise _Abort(layout, f"the sender aborted the sync to v{header.version} (its state does not fit "
                                 "the plan; see the learner's error)")
        problems = []
        if header.digest != self.digest:
            sender_plan, _ = decode_plan(meta)
            problems += plan_diff(self.plan, sender_plan) or ["plan digests differ"]
        if header.version != expected_version:
            problems.append(f"version {header.version} != expected {expected_version}")
        if problems:
            raise _Abort(layout, f"sync header rejected before loading: {'; '.join(problems)} "
                                 f"(tensors {header.n_tensors} vs {len(self.plan)}, "
                                 f"buckets {header.n_buckets} vs {len(self.buckets)})")
        return layout

    def _pack(self, bucket: Bucket, state: dict[str, torch.Tensor], device: torch.device,
              out: torch.Tensor | None = None) -> torch.Tensor:
        """One flat tensor of ``bucket.numel`` elements, packed into ``out`` (a uint8 buffer of at least
        the bucket's bytes) when given; no copy when the bucket is one contiguous tensor."""
        parts = [state[s.name].detach().reshape(-1) for s in bucket.specs]
        if len(parts) == 1 and parts[0].dtype == bucket.dtype and parts[0].device == device:
            return parts[0].contiguous()
        if out is not None:
            flat = out[: bucket.numel * bucket.dtype.itemsize].view(bucket.dtype)
        else:
            flat = torch.empty(bucket.numel, dtype=bucket.dtype, device=device)
        offset = 0
        for p in parts:
            flat[offset: offset + p.numel()].copy_(p)
            offset += p.numel()
        return flat

    def _views(self, bucket: Bucket, flat: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        offset = 0
        for spec in bucket.specs:
            n = _numel(spec.shape)
            yield spec.name, flat[offset: offset + n].view(spec.shape)
            offset += n


class _Abort(WeightSyncError):
    """A rejected header; carries the sender's bucket layout so the receiver can drain the sync."""

    def __init__(self, layout: list[tuple[int, torch.dtype]], message: str):
        super().__init__(message)
        self.layout = layout


class CollectiveTransport(WeightTransport):
    """Weight broadcast over a stand-alone process group (never the default/FSDP group).

    Args:
        rank: this process's rank in the sync group (0 = learner rank 0).
        world_size: 1 + number of rollout engines.
        host, port: the TCPStore rendezvous address (rank 0 hosts it); use a new port to rebuild.
        plan, bucket_bytes: see :class:`WeightTransport`.
        timeout_s: rendezvous and per-collective timeout in seconds; a missing peer raises instead
            of hanging. After a failed or timed-out collective the group is unusable (``broken``):
            close it and build a new one on every member.
        backend: ``"gloo"`` (CPU tensors) or ``"nccl"`` (CUDA tensors).
        max_inflight: buckets broadcast concurrently (packing bucket i+1 overlaps sending bucket i).

    Raises:
        ValueError: unknown backend. ``RuntimeError``/``DistStoreError``: rendezvous timed out.
    """

    kind = "collective"

    def __init__(self, rank: int, world_size: int, host: str, port: int, plan: list[WeightSpec],
                 bucket_bytes: int, timeout_s: float = 120.0, backend: str = "gloo", max_inflight: int = 2):
        super().__init__(rank, plan, bucket_bytes, timeout_s)
        self.world_size = world_size
        self.max_inflight = max(1, max_inflight)
        self.device = torch.device("cuda" if backend == "nccl" else "cpu")
        self.broken = False
        self._meta_sent = False  # the sender's plan travels with the group's first sync only
        self._sender_meta: bytes | None = None  # what a receiver got from that first sync
        self._pack_bufs: list[torch.Tensor] = []  # sender: ring of max_inflight reusable pack buffers
        self._recv_bufs: list[torch.Tensor] = []  # receiver: one reusable flat buffer per bucket
        timeout = timedelta(seconds=timeout_s)
        use_node_gloo(host)  # gloo pairs on loopback for a loopback rendezvous, else on this node's interface
        self._store = tcp_store(host, port, world_size, rank == 0, timeout)  # listens on `host` only
        if backend == "gloo":
            self.pg = dist.ProcessGroupGloo(self._store, rank, world_size, timeout)
        elif backend == "nccl":  # pragma: no cover - GPU only
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            self.pg = dist.ProcessGroupNCCL(self._store, rank, world_size, opts)
        else:
            raise ValueError(f"unknown sync backend {backend!r}")

    def _start(self, t: torch.Tensor):
        if self.pg is None:
            raise WeightSyncError("the sync group is closed")
        if self.broken:
            raise WeightSyncError("the sync group is broken by an earlier failure; rebuild it")
        try:
            return self.pg.broadcast(t, 0)
        except RuntimeError as e:
            self.broken = True
            raise WeightSyncError(f"broadcast failed: {e}") from e

    def _wait(self, work) -> None:
        try:
            work.wait()
        except RuntimeError as e:  # gloo timeout / peer gone: the group is unusable now
            self.broken = True
            raise WeightSyncError(f"broadcast failed or timed out (timeout {self.timeout_s:g}s): {e}") from e

    def _bcast(self, t: torch.Tensor) -> None:
        self._wait(self._start(t))

    def send(self, state: dict[str, torch.Tensor], version: int) -> dict[str, float]:
        assert self.rank == 0, "only rank 0 sends"
        t0 = time.perf_counter()
        try:
            check_plan(self.plan, state)
            status = _OK
        except WeightSyncError:
            status = _ABORT  # receivers are told, and fail fast instead of waiting for buckets
        header = self._header(version, status)
        if self._meta_sent:
            header.meta_nbytes = 0
        self._bcast(header.to_tensor().to(self.device))
        if header.meta_nbytes:
            self._bcast(torch.frombuffer(bytearray(self.meta), dtype=torch.uint8).to(self.device))
            self._meta_sent = True
        if status == _ABORT:
            check_plan(self.plan, state)  # raises the reason
        if not self._pack_bufs:
            most = max((b.numel * b.dtype.itemsize for b in self.buckets if len(b.specs) > 1), default=0)
            self._pack_bufs = [torch.zeros(most, dtype=torch.uint8, device=self.device)
                               for _ in range(self.max_inflight)] if most else []
        nbytes = 0
        pending: deque = deque()
        for i, bucket in enumerate(self.buckets):
            out = self._pack_bufs[i % len(self._pack_bufs)] if self._pack_bufs else None
            flat = self._pack(bucket, state, self.device, out)
            nbytes += flat.numel() * flat.element_size()
            pending.append((self._start(flat), flat))  # keep ``flat`` alive until its broadcast is done
            while len(pending) >= self.max_inflight:
                self._wait(pending.popleft()[0])
        while pending:
            self._wait(pending.popleft()[0])
        return {"bytes": float(nbytes), "seconds": time.perf_counter() - t0}

    def receive(self, expected_version: int) -> Iterator[tuple[str, torch.Tensor]]:
        header_t = torch.zeros(_HEADER_LEN, dtype=torch.int64, device=self.device)
        self._bcast(header_t)
        header = SyncHeader.from_tensor(header_t.cpu())
        if header.meta_nbytes:
            meta_t = torch.empty(header.meta_nbytes, dtype=torch.uint8, device=self.device)
            self._bcast(meta_t)
            self._sender_meta = bytes(meta_t.cpu().numpy().tobytes())
        if self._sender_meta is None:
            self.broken = True
            raise WeightSyncError("the sender's plan never arrived (this receiver missed the group's first sync)")
        try:
            self._check_header(header, self._sender_meta, expected_version)
        except _Abort as e:
            if header.status != _ABORT:  # drain the sender's buckets so the group stays in step
                for numel, dtype in e.layout:
                    self._bcast(torch.empty(numel, dtype=dtype, device=self.device))
            raise WeightSyncError(str(e)) from None
        return self._receive_buckets()

    def _receive_buckets(self) -> Iterator[tuple[str, torch.Tensor]]:
        if not self._recv_bufs:
            self._recv_bufs = [torch.empty(b.numel, dtype=b.dtype, device=self.device) for b in self.buckets]

        def post(i: int):
            flat = self._recv_bufs[i]
            return flat, self._start(flat)

        nxt = post(0) if self.buckets else None
        for i, bucket in enumerate(self.buckets):
            flat, work = nxt
            self._wait(work)
            nxt = post(i + 1) if i + 1 < len(self.buckets) else None  # receive ahead while loading
            yield from self._views(bucket, flat)

    def close(self) -> None:
        """Drop the process group and the rendezvous store."""
        self.pg = None
        self._store = None


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
            if post is None or post[0].get("status") == _WITHDRAWN:
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
                self._posts[seq] = ({**header, "status": _WITHDRAWN}, meta, [])
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


class ObjectStoreTransport(WeightTransport):
    """The naive baseline: rank 0 ``ray.put``\\ s the flat buckets, receivers ``ray.get`` them.

    Args:
        rank: 0 sends, any other rank receives.
        plan, bucket_bytes, timeout_s: see :class:`WeightTransport`.
        mailbox: a ``WeightMailboxActor`` handle shared by the sender and every receiver.
    """

    kind = "object_store"

    def __init__(self, rank: int, plan: list[WeightSpec], bucket_bytes: int, timeout_s: float, mailbox):
        super().__init__(rank, plan, bucket_bytes, timeout_s)
        self.mailbox = mailbox
        self._seq = 0
        self._live: list = []  # the sender keeps its last sync's objects alive

    def send(self, state: dict[str, torch.Tensor], version: int) -> dict[str, float]:
        assert self.rank == 0, "only rank 0 sends"
        t0 = time.perf_counter()
        self._seq += 1
        _check_state_or_abort(self, state, version)
        cpu = torch.device("cpu")
        refs, nbytes = [], 0
        for bucket in self.buckets:
            flat = self._pack(bucket, state, cpu)
            nbytes += flat.numel() * flat.element_size()
            refs.append(ray.put(flat))
        ray.get(self.mailbox.post.remote(self._seq, vars(self._header(version)), self.meta, refs),
                timeout=self.timeout_s)
        self._live = refs
        return {"bytes": float(nbytes), "seconds": time.perf_counter() - t0}

    def receive(self, expected_version: int) -> Iterator[tuple[str, torch.Tensor]]:
        self._seq += 1
        try:
            header, meta, refs = ray.get(self.mailbox.fetch.remote(self._seq, self.timeout_s),
                                         timeout=self.timeout_s + 5)
        except (ray.exceptions.GetTimeoutError, ray.exceptions.RayTaskError, TimeoutError) as e:
            raise WeightSyncError(f"no sync #{self._seq} posted within {self.timeout_s:g}s: {e!r}") from None
        try:
            self._check_header(SyncHeader(**header), meta, expected_version)
        except _Abort as e:
            raise WeightSyncError(str(e)) from None
        return self._receive_buckets(refs)

    def _receive_buckets(self, refs: list) -> Iterator[tuple[str, torch.Tensor]]:
        for bucket, ref in zip(self.buckets, refs):
            try:
                flat = ray.get(ref, timeout=self.timeout_s)
            except ray.exceptions.GetTimeoutError as e:
                raise WeightSyncError(f"bucket fetch timed out after {self.timeout_s:g}s") from e
            yield from self._views(bucket, flat)

    def close(self) -> None:
        """Forget the mailbox and the last sync's objects."""
        self.mailbox, self._live = None, []


# Buffers of closed ipc senders, by (plan digest, device): the next sender of the same plan in this
# process takes them over instead of allocating (and sharing) one more copy of the weights.
_IPC_BUFFERS: dict[tuple[int, str], list[torch.Tensor]] = {}


class IpcTransport(WeightTransport):
    """Same-host zero-copy transport: rank 0 shares its packed buckets by handle, receivers map them.

    The sender packs every bucket into a flat buffer on ``device`` (one buffer per bucket, kept and
    reused for the transport's lifetime: the sender holds one extra packed copy of the plan, in GPU
    memory on CUDA, in ``/dev/shm`` on CPU), pickles one handle per bucket *per receiver* with
    torch's multiprocessing reductions (``reduce_tensor``; every handle adds one cross-process
    reference that the receiver's rebuild consumes, so handles are never shared between receivers)
    and posts them with the usual header and plan to a :class:`WeightMailbox`. A receiver checks the
    header and plan first (nothing is opened when they do not match), maps the buffers, yields views
    of them, and acks in :meth:`done` after loading. The sender's :meth:`send` returns when every
    receiver acked; after ``timeout_s`` without all acks it withdraws the sync (late receivers then
    fail instead of reading buffers the next sync rewrites) and raises naming the missing receivers.

    Handles by device:

    * CUDA: a CUDA IPC memory handle plus torch's IPC reference counter, so a freed buffer is not
      reused while a receiver still maps it. Every member must be on this host and see the sender's
      device (same GPU, e.g. fractional ``num_gpus`` on one device, or P2P-capable devices).
    * CPU: a named shared-memory file (torch's ``file_system`` sharing strategy, set process-wide
      in the sender). The default ``file_descriptor`` strategy does not work between Ray actors: it
      passes the fd through ``multiprocessing``'s resource sharer, which authenticates with the
      process's ``authkey``; Ray workers are not forked from one another, so each has its own key
      and the receiver fails with ``AuthenticationError: digest sent was rejected``. Also,
      Ray's own pickler copies a tensor's storage by value, so the handle must be made with
      ``ForkingPickler`` (torch's registered reductions), not ``ray.put`` of the tensor.

    Args:
        rank: 0 sends, any other rank receives.
        world_size: 1 + number of receivers (the sender waits for ranks ``1..world_size-1``).
        plan, bucket_bytes, timeout_s: see :class:`WeightTransport`; ``timeout_s`` bounds the
            sender's wait for acks and a receiver's wait for a post.
        mailbox: a ``WeightMailboxActor`` handle shared by the sender and every receiver.
        device: sender only: where the buckets are packed (the learner's device).
        name: receiver only: its name in the sender's errors (e.g. ``"rollout-1"``).

    Raises:
        WeightSyncError: (receiver) registering with the mailbox timed out.
    """

    kind = "ipc"

    def __init__(self, rank: int, world_size: int, plan: list[WeightSpec], bucket_bytes: int, timeout_s: float,
                 mailbox, device: str | torch.device = "cpu", name: str = ""):
        super().__init__(rank, plan, bucket_bytes, timeout_s)
        self.world_size = world_size
        self.mailbox = mailbox
        self.device = torch.device(device)
        self.name = name or f"rank {rank}"
        self._seq = 0
        self._bufs: list[torch.Tensor] = []  # sender: one shared flat buffer per bucket
        self._held: list[torch.Tensor] = []  # receiver: the mapped buffers of the last receive
        self._pending: int | None = None  # receiver: seq of a received sync not yet acked
        if rank == 0:
            if self.device.type == "cpu":
                import torch.multiprocessing as mp

                mp.set_sharing_strategy("file_system")  # see the class docstring
        else:
            try:
                ray.get(mailbox.join.remote(rank, self.name), timeout=timeout_s)
            except (ray.exceptions.GetTimeoutError, ray.exceptions.RayError) as e:
                raise WeightSyncError(f"{self.name}: could not register with the weight mailbox: {_reason(e)}") from None

    # ------------------------------------------------------------------ sender
    def _buffers(self) -> list[torch.Tensor]:
        if not self._bufs:
            self._bufs = _IPC_BUFFERS.pop((self.digest, str(self.device)), [])
        if not self._bufs:
            self._bufs = [torch.empty(b.numel, dtype=b.dtype, device=self.device) for b in self.buckets]
            if self.device.type == "cpu":
                for b in self._bufs:
                    b.share_memory_()  # allocated in shared memory once; sharing later copies nothing
        return self._bufs

    def send(self, state: dict[str, torch.Tensor], version: int) -> dict[str, float]:
        """See :meth:`WeightTransport.send`. Returns once every receiver acked (loaded or rejected).

        Raises:
            WeightSyncError: ``state`` does not fit the plan (receivers are told to abort), or some
                receivers did not ack within ``timeout_s`` seconds (named, e.g. ``rollout-1 (rank 2)``;
                the sync is withdrawn).
        """
        from multiprocessing.reduction import ForkingPickler

        import torch.multiprocessing  # noqa: F401 - registers torch's tensor/storage reductions

        assert self.rank == 0, "only rank 0 sends"
        t0 = time.perf_counter()
        self._seq += 1
        _check_state_or_abort(self, state, version)
        nbytes = 0
        bufs = self._buffers()
        for bucket, buf in zip(self.buckets, bufs):
            offset = 0
            for spec in bucket.specs:
                n = _numel(spec.shape)
                buf[offset: offset + n].copy_(state[spec.name].detach().reshape(-1))
                offset += n
            nbytes += buf.numel() * buf.element_size()
        if self.device.type == "cuda":  # pragma: no cover - GPU only
            torch.cuda.current_stream(self.device).synchronize()  # packed before any receiver reads
        ranks = list(range(1, self.world_size))
        handles = [[bytes(ForkingPickler.dumps(buf)) for buf in bufs] for _ in ranks]
        ray.get(self.mailbox.post.remote(self._seq, vars(self._header(version)), self.meta, handles),
                timeout=self.timeout_s)
        acks = ray.get(self.mailbox.wait_acks.remote(self._seq, ranks, self.timeout_s), timeout=self.timeout_s + 30)
        missing = [r for r in ranks if r not in acks]
        if missing:
            names = ray.get(self.mailbox.names.remote(), timeout=30)
            who = ", ".join(f"{names[r]} (rank {r})" if r in names else f"rank {r}" for r in missing)
            raise WeightSyncError(f"sync #{self._seq} to v{version}: no ack from {who} within "
                                  f"{self.timeout_s:g}s; the sync is withdrawn")
        return {"bytes": float(nbytes), "seconds": time.perf_counter() - t0}

    # ------------------------------------------------------------------ receiver
    def _ack(self, seq: int, ok: bool, note: str = "") -> bool:
        try:
            return ray.get(self.mailbox.ack.remote(seq, self.rank, ok, note), timeout=self.timeout_s)
        except (ray.exceptions.GetTimeoutError, ray.exceptions.RayError) as e:
            raise WeightSyncError(f"ack of sync #{seq} failed: {_reason(e)}") from None

    def receive(self, expected_version: int) -> Iterator[tuple[str, torch.Tensor]]:
        """See :meth:`WeightTransport.receive`. The yielded tensors are the sender's buffers (read
        only, valid until :meth:`done`); call :meth:`done` once they are loaded."""
        import importlib
        import pickle

        importlib.import_module("torch.multiprocessing.reductions")  # the handles' rebuild functions

        if self._pending is not None:  # the previous sync was never acked: release it first
            self.done(ok=False)
        self._seq += 1
        seq = self._seq
        try:
            header, meta, handles = ray.get(self.mailbox.fetch.remote(seq, self.timeout_s),
                                            timeout=self.timeout_s + 5)
        except (ray.exceptions.GetTimeoutError, ray.exceptions.RayTaskError, TimeoutError) as e:
            raise WeightSyncError(f"no sync #{seq} posted within {self.timeout_s:g}s: {e!r}") from None
        if header.get("status") == _WITHDRAWN:
            raise WeightSyncError(f"the sender withdrew sync #{seq} to v{header['version']} (it stopped waiting "
                                  "for acks) before this receiver fetched it")
        try:
            self._check_header(SyncHeader(**header), meta, expected_version)
        except _Abort as e:
            if header.get("status") != _ABORT:
                self._ack(seq, False, "rejected")
            raise WeightSyncError(str(e)) from None
        try:
            flats = [pickle.loads(h) for h in handles[self.rank - 1]]
            for bucket, flat in zip(self.buckets, flats, strict=True):
                if flat.numel() != bucket.numel or flat.dtype != bucket.dtype:
                    raise ValueError(f"a bucket of {flat.numel()} x {flat.dtype} where the plan has "
                                     f"{bucket.numel} x {bucket.dtype}")
        except Exception as e:  # noqa: BLE001 - a withdrawn/freed buffer, another device, a bad layout
            self._ack(seq, False, "open failed")
            raise WeightSyncError(f"could not map the shared buckets of sync #{seq}: {e!r}") from None
        self._held, self._pending = flats, seq
        return (item for bucket, flat in zip(self.buckets, flats) for item in self._views(bucket, flat))

    def done(self, ok: bool = True) -> None:  # noqa: B027 - an optional hook, a no-op by default
        """Ack the last received sync (see :meth:`WeightTransport.done`) and unmap its buffers."""
        if self._pending is None:
            return
        seq, self._pending = self._pending, None
        if any(t.is_cuda for t in self._held):  # pragma: no cover - GPU only
            torch.cuda.synchronize()  # the engine's copies out of the buffers have finished
        self._held = []
        if not self._ack(seq, ok) and ok:
            raise WeightSyncError(f"the sender withdrew sync #{seq} (it stopped waiting for acks) before this "
                                  "receiver acked; the loaded weights may be incomplete")

    def close(self) -> None:
        """Forget the mailbox; a sender hands its buffers to the next sender of the same plan here."""
        if self._bufs:
            _IPC_BUFFERS[(self.digest, str(self.device))] = self._bufs
        self._bufs, self._held, self._pending, self.mailbox = [], [], None, None


def _check_state_or_abort(transport: Any, state: dict[str, torch.Tensor], version: int) -> None:
    """Sender side of a mailbox transport (``object_store``, ``ipc``): check ``state`` against the plan;
    on a mismatch post an abort header for this sync (receivers fail fast instead of waiting out
    the timeout), then raise.

    Raises:
        WeightSyncError: the state lacks a planned weight or has another shape.
    """
    try:
        check_plan(transport.plan, state)
    except WeightSyncError:
        ray.get(transport.mailbox.post.remote(transport._seq, vars(transport._header(version, _ABORT)), transport.meta,
                                              []), timeout=transport.timeout_s)
        raise


def make_transport(transport: str, rank: int, world_size: int, plan: list[WeightSpec], bucket_bytes: int,
                   timeout_s: float, *, host: str = "", port: int = 0, backend: str = "gloo",
                   mailbox=None, name: str = "") -> WeightTransport:
    """Build one end of a ``transport`` (``"collective"``, ``"object_store"`` or ``"ipc"``).

    ``host``/``port``/``backend`` are used by the collective transport (the rendezvous rank 0 published:
    its node's address and a port bound there), ``mailbox`` (a
    ``WeightMailboxActor``) by the object store and ipc, ``name`` (the receiver's name) by ipc. The
    ipc sender packs on this process's accelerator when it has one (CUDA, like the learner), else
    on CPU. Blocks until every collective member joined.

    Raises:
        ValueError: unknown ``transport``; a collective without ``host`` and ``port``.
    """
    if transport == "collective":
        if not host or not port:
            raise ValueError("the collective transport needs the rendezvous host and port that rank 0 published")
        return CollectiveTransport(rank, world_size, host, port, plan, bucket_bytes, timeout_s, backend)
    if transport == "object_store":
        if mailbox is None:
            raise ValueError("the object_store transport needs a WeightMailboxActor handle")
        return ObjectStoreTransport(rank, plan, bucket_bytes, timeout_s, mailbox)
    if transport == "ipc":
        if mailbox is None:
            raise ValueError("the ipc transport needs a WeightMailboxActor handle")
        device = "cuda" if torch.cuda.is_available() else "cpu"
        return IpcTransport(rank, world_size, plan, bucket_bytes, timeout_s, mailbox, device=device, name=name)
    raise ValueError(f"unknown sync transport {transport!r}; expected one of {list(TRANSPORTS)}")


# The Ray actor class (an async actor: fetch waits without blocking posts).
WeightMailboxActor = ray.remote(WeightMailbox)


# ---------------------------------------------------------------------- driver side
def _reason(e: BaseException) -> str:
    """A one-line cause of a failed Ray call (the remote exception, not Ray's traceback wrapper)."""
    if isinstance(e, ray.exceptions.GetTimeoutError):
        return "timed out"
    if isinstance(e, ray.exceptions.RayActorError):
        return "actor died or is unreachable"
    cause = getattr(e, "cause", None) or e
    return f"{type(cause).__name__}: {str(cause).strip().splitlines()[-1] if str(cause).strip() else ''}"


def _collect(named: dict[str, Any], timeout_s: float) -> tuple[dict[str, Any], dict[str, str]]:
    """Wait up to ``timeout_s`` seconds for every ref; ``(results by name, one-line errors by name)``."""
    refs = list(named.values())
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s) if refs else ([], [])
    ready_set = set(ready)
    results, errors = {}, {}
    for name, ref in named.items():
        if ref not in ready_set:
            errors[name] = f"timed out after {timeout_s:g}s"
            continue
        try:
            results[name] = ray.get(ref)
        except Exception as e:  # noqa: BLE001 - every member failure is reported by name
            errors[name] = _reason(e)
    return results, errors


def _group_error(message: str, errors: dict[str, str]) -> WeightSyncError:
    err = WeightSyncError(message)
    err.errors = errors  # {member name: cause}
    return err


class WeightSyncController:
    """The driver's side of weight sync: builds the transport on every member, runs each sync
    under a deadline, never leaves an engine paused, names the members that failed and rebuilds
    the group before the next sync after any failure.

    Args:
        senders: learner actor handles, rank 0 first. Each has ``ready()``,
            ``init_weight_sender(world_size, host, port, plan, bucket_bytes, timeout_s, backend,
            transport, mailbox, check)`` and ``sync_weights(version)`` returning ``{"bytes",
            "gather_s", "send_s"}`` on rank 0 (every rank is called: the full state dict is gathered
            collectively); rank 0 also has ``sync_rendezvous(host)`` (binds the collective's rendezvous
            on its node, returns ``(host, port)``).
        engines: RolloutEngine actor handles (receivers ``1..len(engines)``).
        names: the engines' names (``"rollout-0"``, ...), used in errors and metric keys.
        plan: the ordered weight specs (from an engine's ``weight_specs``).
        transport: ``"collective"``, ``"object_store"``, ``"ipc"`` (same host only: refused at
            :meth:`connect` when an engine runs on another host) or ``"auto"`` (``ipc`` when every
            engine shares learner rank 0's host, else ``collective``; decided at each connect,
            ``transport`` then holds the choice: :func:`clawray.placement.resolve_transport`).
        bucket_bytes: maximum bytes per flat bucket.
        timeout_s: deadline in seconds of one sync (and of every collective inside it); the group
            rebuild waits up to twice that.
        backend: collective backend, ``"gloo"`` or ``"nccl"``.
        host: address the collective group's rendezvous binds on learner rank 0's node; "" (default)
            = that node's Ray address. Rank 0 binds it and picks the port there (``rendezvous``
            holds the published ``(host, port)`` after :meth:`connect`).
    """

    def __init__(self, senders: list, engines: list, names: list[str], plan: list[WeightSpec], *,
                 transport: str = "collective", bucket_bytes: int = 64 << 20, timeout_s: float = 120.0,
                 backend: str = "gloo", host: str = ""):
        if transport not in (*TRANSPORTS, "auto"):
            raise ValueError(f"unknown sync transport {transport!r}; expected one of {list(TRANSPORTS)}")
        self.senders, self.engines, self.names = list(senders), list(engines), list(names)
        self.plan = list(plan)
        self.transport, self.bucket_bytes, self.timeout_s = transport, bucket_bytes, timeout_s
        self.backend, self.host = backend, host
        self.requested = transport  # [placement] "auto" is resolved into self.transport at each connect
        self.rendezvous: tuple[str, int] | None = None
        self.connected = False  # the group is built and in step
        self.behind = False  # the last sync failed: some engine may lag the learner's version
        self.failures = 0  # failed syncs so far
        self.rebuilds = 0  # group rebuilds after a failure
        self.last_error: str | None = None
        self._mailbox = None

    def _member_names(self) -> list[str]:
        return [f"learner-{i}" for i in range(len(self.senders))] + self.names

    def connect(self, check_plan: bool = True) -> float:
        """(Re)build the transport on the sender and every receiver (a new rendezvous port, or a new
        mailbox), after waiting for each member to finish the jobs it still runs.

        Args:
            check_plan: the sender also checks the plan against the learner's state dict (gathers it).

        Returns:
            seconds taken.

        Raises:
            WeightSyncError: naming every member that was not ready or failed to join, with the cause.
        """
        t0 = time.perf_counter()
        self.connected = False
        members = list(zip(self._member_names(), self.senders + self.engines))
        # a member still busy with a failed sync's job cannot join a new rendezvous: wait for it first
        _, errors = _collect({n: m.ready.remote() for n, m in members}, self.timeout_s)
        if errors:
            raise _group_error(self._describe("rebuilding the sync group", errors, "not ready"), errors)
        self._place()  # [placement] transport for where the members run; rank 0 binds the rendezvous
        if self.transport in ("object_store", "ipc"):  # one mailbox for the controller's lifetime, emptied here
            if self._mailbox is None:
                self._mailbox = WeightMailboxActor.options(num_cpus=0).remote()
            _, errors = _collect({"mailbox": self._mailbox.reset.remote()}, 2 * self.timeout_s + 30)
            if errors:
                raise _group_error(self._describe("starting the weight mailbox", errors), errors)
        world = 1 + len(self.engines)
        host, port = self.rendezvous or ("", 0)
        named = {n: s.init_weight_sender.remote(
                    world_size=world, host=host, port=port, plan=self.plan, bucket_bytes=self.bucket_bytes,
                    timeout_s=self.timeout_s, backend=self.backend, transport=self.transport,
                    mailbox=self._mailbox, check=check_plan)
                 for n, s in zip(self._member_names(), self.senders)}
        named.update({n: e.init_weight_receiver.remote(
                          i + 1, world, host, port, self.plan, self.bucket_bytes, self.timeout_s, self.backend,
                          self.transport, self._mailbox)
                      for i, (n, e) in enumerate(zip(self.names, self.engines))})
        _, errors = _collect(named, 2 * self.timeout_s)
        if errors:
            raise _group_error(self._describe("building the sync group", errors), errors)
        self.connected = True
        return time.perf_counter() - t0

    def _place(self) -> None:
        """[placement] Resolve ``auto`` (or refuse a forced ``ipc`` across hosts) from the members' node
        addresses, then, for a collective, have learner rank 0 bind the rendezvous on its own node
        and publish ``(host, port)`` (``self.rendezvous``).

        Raises:
            WeightSyncError: a forced ``ipc`` with an engine on another host, or rank 0 could not bind.
        """
        from clawray.placement import actor_locations, resolve_transport

        self.rendezvous = None
        if self.requested in ("auto", "ipc"):
            try:
                where = actor_locations(dict(zip(["learner-0", *self.names], [self.senders[0], *self.engines])),
                                        self.timeout_s)
                sender = where.pop("learner-0")
                self.transport = resolve_transport(self.requested, sender, where)
            except ValueError as e:
                raise _group_error(str(e), {"sync group": str(e)}) from None
            except ray.exceptions.RayError as e:
                raise _group_error(f"locating the sync group's members failed: {_reason(e)}",
                                   {"sync group": _reason(e)}) from None
        if self.transport == "collective":
            results, errors = _collect({"learner-0": self.senders[0].sync_rendezvous.remote(self.host)}, self.timeout_s)
            if errors:
                raise _group_error(self._describe("binding the sync rendezvous", errors), errors)
            self.rendezvous = tuple(results["learner-0"])

    def _describe(self, what: str, errors: dict[str, str], prefix: str = "") -> str:
        engines_first = [n for n in self.names if n in errors] + [n for n in errors if n not in self.names]
        parts = [f"{n} ({prefix + ': ' if prefix else ''}{errors[n]})" for n in engines_first]
        return f"{what} failed on {', '.join(parts)}"

    def sync(self, version: int) -> dict[str, Any]:
        """Pause the engines, send the learner's weights stamped ``version``, load them, resume.

        Never raises for a member's failure and never leaves an engine paused: the result says what
        happened, and the next call rebuilds the group first and sends its (newer) weights to every
        engine, so lagging engines catch up.

        Returns:
            ``ok`` (bool), ``version``, ``seconds`` (pause -> resume, wall), ``bytes`` (payload sent
            once), ``gather_s``, ``send_s``, ``receive_s`` and ``load_s`` (``{engine: seconds}``),
            ``failed`` (names of the members that failed, engines first), ``error`` (one line naming
            them and the cause, or None), ``rebuild_s`` (seconds spent rebuilding the group first, 0
            when it was in step) and ``versions`` (``{engine: policy version or None}`` afterwards).
        """
        t0 = time.perf_counter()
        out: dict[str, Any] = {"ok": False, "version": version, "seconds": 0.0, "bytes": 0.0, "gather_s": 0.0,
                               "send_s": 0.0, "receive_s": {}, "load_s": {}, "failed": [], "error": None,
                               "rebuild_s": 0.0}
        errors: dict[str, str] = {}
        if not self.connected:
            try:
                out["rebuild_s"] = self.connect(check_plan=False)
                self.rebuilds += 1
            except WeightSyncError as e:
                return self._finish(out, t0, getattr(e, "errors", None) or {"sync group": str(e)}, str(e))
        t_sync = time.perf_counter()
        _, pause_errors = _collect({n: e.pause.remote() for n, e in zip(self.names, self.engines)}, 30.0)
        try:
            named = {n: s.sync_weights.remote(version) for n, s in zip(self._member_names(), self.senders)}
            named.update({n: e.receive_weights.remote(version) for n, e in zip(self.names, self.engines)})
            results, errors = _collect(named, self.timeout_s)
        finally:
            _, resume_errors = _collect({n: e.resume.remote() for n, e in zip(self.names, self.engines)}, 30.0)
        for n, err in list(pause_errors.items()) + list(resume_errors.items()):
            errors.setdefault(n, err)
        sent = results.get("learner-0", {})
        out.update(bytes=float(sent.get("bytes", 0.0)), gather_s=float(sent.get("gather_s", 0.0)),
                   send_s=float(sent.get("send_s", 0.0)))
        for n in self.names:
            if n in results:
                out["receive_s"][n] = results[n]["receive_s"]
                out["load_s"][n] = results[n]["load_s"]
        out["seconds"] = time.perf_counter() - t_sync
        error = self._describe(f"weight sync to v{version}", errors) if errors else None
        return self._finish(out, t0, errors, error)

    def _finish(self, out: dict, t0: float, errors: dict[str, str], error: str | None) -> dict[str, Any]:
        out["ok"] = not errors
        out["failed"] = [n for n in self.names if n in errors] + [n for n in errors if n not in self.names]
        out["error"] = error
        if errors:
            self.connected = False  # a failed collective leaves the group unusable: rebuild before the next sync
            self.behind = True
            self.failures += 1
            self.last_error = error
        else:
            self.behind = False
        out["versions"] = self.engine_versions()
        if out["seconds"] == 0.0:
            out["seconds"] = time.perf_counter() - t0
        return out

    def engine_versions(self, timeout_s: float = 10.0) -> dict[str, int | None]:
        """``{engine name: its policy version}``; None for an engine that did not answer in ``timeout_s``."""
        results, _ = _collect({n: e.get_version.remote() for n, e in zip(self.names, self.engines)}, timeout_s)
        return {n: results.get(n) for n in self.names}

    @staticmethod
    def metrics(result: dict[str, Any], failures: int = 0) -> dict[str, float]:
        """Step metrics of one :meth:`sync` result: ``timing/weight_sync_s``, ``sync/bytes``,
        ``sync/gbytes_per_s`` (payload bytes / 1e9 / the sender's send seconds), ``sync/gather_s``,
        ``sync/send_s``, ``sync/rebuild_s``, ``sync/ok`` (1/0), ``sync/failures`` (cumulative),
        ``sync/load_s_max``, ``sync/load_s/<engine>``, ``sync/receive_s/<engine>`` and
        ``engine_version/<engine>`` (-1 when the engine did not answer)."""
        m = {
            "timing/weight_sync_s": result["seconds"],
            "sync/bytes": result["bytes"],
            "sync/gbytes_per_s": result["bytes"] / 1e9 / result["send_s"] if result["send_s"] > 0 else 0.0,
            "sync/gather_s": result["gather_s"],
            "sync/send_s": result["send_s"],
            "sync/rebuild_s": result["rebuild_s"],
            "sync/ok": 1.0 if result["ok"] else 0.0,
            "sync/failures": float(failures),
            "sync/load_s_max": max(result["load_s"].values(), default=0.0),
        }
        m.update({f"sync/load_s/{n}": s for n, s in result["load_s"].items()})
        m.update({f"sync/receive_s/{n}": s for n, s in result["receive_s"].items()})
        m.update({f"engine_version/{n}": (-1 if v is None else v) for n, v in result.get("versions", {}).items()})
        return m

    def close(self) -> None:
        """Drop the mailbox actor (the members' transports go with their actors)."""
        if self._mailbox is not None:
            ray.kill(self._mailbox)
            self._mailbox = None
