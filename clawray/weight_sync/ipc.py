"""The ipc transport, same host only: rank 0 packs the buckets into buffers on its own device and posts
*handles* to them (CUDA IPC on GPU, shared-memory files on CPU) through the mailbox; receivers map the
buffers (no copy), load from them and ack. The colocated path for one GPU, where two processes cannot
form an NCCL group. See :class:`IpcTransport` for the handles and their pitfalls.

Owns: the handles, the sender's buffers (taken over by the next sender of the same plan in the
process), the acks and the withdrawal of a sync not acked in time. Must not: be built across hosts
(:func:`clawray.placement.resolve_transport` refuses it) or copy the weights: receivers read the
sender's buffers.
"""

from __future__ import annotations

import pickle
import time
from typing import Iterator

import ray
import torch

from clawray.engines.base import WeightSpec
from clawray.weight_sync.mailbox import check_state_or_abort, abort_reason
from clawray.weight_sync import shm
from clawray.weight_sync.plan import WeightSyncError, numel
from clawray.weight_sync.transport import ABORT, WITHDRAWN, SyncHeader, WeightTransport, Abort


# Buffers of closed ipc senders, by (plan digest, device): the next sender of the same plan in this
# process takes them over instead of allocating (and sharing) one more copy of the weights.
_IPC_BUFFERS: dict[tuple[int, str], tuple[list[torch.Tensor], list[bytes]]] = {}


def release_buffers() -> int:
    """Drop the buffers kept for the next sender and remove this process's shared-memory files
    (:func:`clawray.weight_sync.shm.remove_own`); returns how many files. For a sender about to be
    stopped: a killed process cannot remove them itself."""
    _IPC_BUFFERS.clear()
    return shm.remove_own()


class IpcTransport(WeightTransport):
    """Same-host zero-copy transport: rank 0 shares its packed buckets by handle, receivers map them.

    The sender packs every bucket into a flat buffer on ``device`` (one buffer per bucket, kept and
    reused for the transport's lifetime: the sender holds one extra packed copy of the plan, in GPU
    memory on CUDA, in ``/dev/shm`` on CPU), pickles one handle per bucket per receiver (below)
    and posts them with the usual header and plan to a :class:`WeightMailbox`. A receiver checks the
    header and plan first (nothing is opened when they do not match), maps the buffers, yields views
    of them, and acks in :meth:`done` after loading. The sender's :meth:`send` returns when every
    receiver acked; after ``timeout_s`` without all acks it withdraws the sync (late receivers then
    fail instead of reading buffers the next sync rewrites) and raises naming the missing receivers.

    Handles by device:

    * CUDA: a CUDA IPC memory handle plus torch's IPC reference counter, so a freed buffer is not
      reused while a receiver still maps it (``reduce_tensor``: every handle adds one cross-process
      reference that the receiver's rebuild consumes, so handles are never shared between receivers). Every member must be on this host and see the sender's
      device (same GPU, e.g. fractional ``num_gpus`` on one device, or P2P-capable devices).
      Ray's own pickler copies a tensor's storage by value, so the handle is made with
      ``ForkingPickler`` (torch's registered reductions), not ``ray.put`` of the tensor.
    * CPU: a named shared-memory file of clawray's own (:mod:`clawray.weight_sync.shm`: removed when
      the sender's process is gone, however it ended). Neither of torch's CPU strategies works here:
      ``file_descriptor`` passes the fd through ``multiprocessing``'s resource sharer, which
      authenticates with the process's ``authkey`` (Ray workers are not forked from one another:
      ``AuthenticationError: digest sent was rejected``); ``file_system``'s files outlive a sender
      that Ray stops (the module's docstring).

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

    def __init__(
        self,
        rank: int,
        world_size: int,
        plan: list[WeightSpec],
        bucket_bytes: int,
        timeout_s: float,
        mailbox,
        device: str | torch.device = "cpu",
        name: str = "",
    ):
        super().__init__(rank, plan, bucket_bytes, timeout_s)
        self.world_size = world_size
        self.mailbox = mailbox
        self.device = torch.device(device)
        self.name = name or f"rank {rank}"
        self.seq = 0
        self._bufs: list[torch.Tensor] = []  # sender: one shared flat buffer per bucket
        self._shm: list[bytes] = []  # sender on CPU: each buffer's pickled ShmHandle
        self._held: list[torch.Tensor] = []  # receiver: the mapped buffers of the last receive
        self._pending: int | None = None  # receiver: seq of a received sync not yet acked
        if rank != 0:
            try:
                ray.get(mailbox.join.remote(rank, self.name), timeout=timeout_s)
            except (ray.exceptions.GetTimeoutError, ray.exceptions.RayError) as e:
                raise WeightSyncError(
                    f"{self.name}: could not register with the weight mailbox: {abort_reason(e)}"
                ) from None

    # ------------------------------------------------------------------ sender
    def _buffers(self) -> list[torch.Tensor]:
        if not self._bufs:
            self._bufs, self._shm = _IPC_BUFFERS.pop((self.digest, str(self.device)), ([], []))
        if not self._bufs and self.device.type == "cpu":  # allocated in shared memory once
            shm.sweep()  # first free what senders that Ray stopped left behind
            made = [shm.create(b.numel, b.dtype) for b in self.buckets]
            self._bufs = [buf for buf, _ in made]
            self._shm = [pickle.dumps(handle) for _, handle in made]
        elif not self._bufs:
            self._bufs = [torch.empty(b.numel, dtype=b.dtype, device=self.device) for b in self.buckets]
        return self._bufs

    def _handles(self, bufs: list[torch.Tensor]) -> list[bytes]:
        """One receiver's handles to ``bufs`` (CUDA: fresh IPC references, one per receiver)."""
        if self._shm:
            return self._shm
        from multiprocessing.reduction import ForkingPickler

        import torch.multiprocessing  # noqa: F401 - registers torch's tensor/storage reductions

        return [bytes(ForkingPickler.dumps(buf)) for buf in bufs]

    def send(self, state: dict[str, torch.Tensor], version: int) -> dict[str, float]:
        """See :meth:`WeightTransport.send`. Returns once every receiver acked (loaded or rejected).

        Raises:
            WeightSyncError: ``state`` does not fit the plan (receivers are told to abort), or some
                receivers did not ack within ``timeout_s`` seconds (named, e.g. ``rollout-1 (rank 2)``;
                the sync is withdrawn).
        """
        assert self.rank == 0, "only rank 0 sends"
        t0 = time.perf_counter()
        self.seq += 1
        check_state_or_abort(self, state, version)
        nbytes = 0
        bufs = self._buffers()
        for bucket, buf in zip(self.buckets, bufs):
            offset = 0
            for spec in bucket.specs:
                n = numel(spec.shape)
                buf[offset : offset + n].copy_(state[spec.name].detach().reshape(-1))
                offset += n
            nbytes += buf.numel() * buf.element_size()
        if self.device.type == "cuda":  # pragma: no cover - GPU only
            torch.cuda.current_stream(self.device).synchronize()  # packed before any receiver reads
        ranks = list(range(1, self.world_size))
        handles = [self._handles(bufs) for _ in ranks]
        ray.get(
            self.mailbox.post.remote(self.seq, vars(self.header(version)), self.meta, handles), timeout=self.timeout_s
        )
        acks = ray.get(self.mailbox.wait_acks.remote(self.seq, ranks, self.timeout_s), timeout=self.timeout_s + 30)
        missing = [r for r in ranks if r not in acks]
        if missing:
            names = ray.get(self.mailbox.names.remote(), timeout=30)
            who = ", ".join(f"{names[r]} (rank {r})" if r in names else f"rank {r}" for r in missing)
            raise WeightSyncError(
                f"sync #{self.seq} to v{version}: no ack from {who} within {self.timeout_s:g}s; the sync is withdrawn"
            )
        return {"bytes": float(nbytes), "seconds": time.perf_counter() - t0}

    # ------------------------------------------------------------------ receiver
    def _ack(self, seq: int, ok: bool, note: str = "") -> bool:
        try:
            return ray.get(self.mailbox.ack.remote(seq, self.rank, ok, note), timeout=self.timeout_s)
        except (ray.exceptions.GetTimeoutError, ray.exceptions.RayError) as e:
            raise WeightSyncError(f"ack of sync #{seq} failed: {abort_reason(e)}") from None

    def receive(self, expected_version: int) -> Iterator[tuple[str, torch.Tensor]]:
        """See :meth:`WeightTransport.receive`. The yielded tensors are the sender's buffers (read
        only, valid until :meth:`done`); call :meth:`done` once they are loaded."""
        import importlib

        importlib.import_module("torch.multiprocessing.reductions")  # the handles' rebuild functions

        if self._pending is not None:  # the previous sync was never acked: release it first
            self.done(ok=False)
        self.seq += 1
        seq = self.seq
        try:
            header, meta, handles = ray.get(self.mailbox.fetch.remote(seq, self.timeout_s), timeout=self.timeout_s + 5)
        except (ray.exceptions.GetTimeoutError, ray.exceptions.RayTaskError, TimeoutError) as e:
            raise WeightSyncError(f"no sync #{seq} posted within {self.timeout_s:g}s: {e!r}") from None
        if header.get("status") == WITHDRAWN:
            raise WeightSyncError(
                f"the sender withdrew sync #{seq} to v{header['version']} (it stopped waiting "
                "for acks) before this receiver fetched it"
            )
        try:
            self._check_header(SyncHeader(**header), meta, expected_version)
        except Abort as e:
            if header.get("status") != ABORT:
                self._ack(seq, False, "rejected")
            raise WeightSyncError(str(e)) from None
        try:
            flats = [pickle.loads(h) for h in handles[self.rank - 1]]
            for bucket, flat in zip(self.buckets, flats, strict=True):
                if flat.numel() != bucket.numel or flat.dtype != bucket.dtype:
                    raise ValueError(
                        f"a bucket of {flat.numel()} x {flat.dtype} where the plan has {bucket.numel} x {bucket.dtype}"
                    )
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
            raise WeightSyncError(
                f"the sender withdrew sync #{seq} (it stopped waiting for acks) before this "
                "receiver acked; the loaded weights may be incomplete"
            )

    def close(self) -> None:
        """Forget the mailbox; a sender hands its buffers to the next sender of the same plan here."""
        if self._bufs:
            _IPC_BUFFERS[(self.digest, str(self.device))] = (self._bufs, self._shm)
        self._bufs, self._shm, self._held, self._pending, self.mailbox = [], [], [], None, None
