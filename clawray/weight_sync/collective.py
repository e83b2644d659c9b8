"""The collective transport: the weights are broadcast from rank 0 over a process group of their own.

Owns: the sync group's process group and its rendezvous (a TCPStore rank 0 hosts), the overlapped
bucket broadcast and the ``broken`` state after a failed collective. Must not: use the default or the
learners' FSDP group, or know another transport (:mod:`clawray.weight_sync.factory` does).

The group (gloo on CPU, NCCL on GPU) is separate from the learners' FSDP group and is built from a
TCPStore rendezvous that rank 0 hosts. Buckets are broadcast from rank 0, with the packing of the
next bucket overlapped with the broadcast of the current one. A failed or timed-out collective
leaves the group ``broken``: every member closes it and the driver builds a new one (new port).
"""

from __future__ import annotations

import time
from collections import deque
from datetime import timedelta
from typing import Iterator

import torch
import torch.distributed as dist

from clawray.engines.base import WeightSpec
from clawray.ray_env import tcp_store, use_node_gloo
from clawray.weight_sync.plan import WeightSyncError, check_plan
from clawray.weight_sync.transport import ABORT, HEADER_LEN, OK, SyncHeader, WeightTransport, Abort


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

    def __init__(
        self,
        rank: int,
        world_size: int,
        host: str,
        port: int,
        plan: list[WeightSpec],
        bucket_bytes: int,
        timeout_s: float = 120.0,
        backend: str = "gloo",
        max_inflight: int = 2,
    ):
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

    def _packed(self, bucket, state: dict[str, torch.Tensor]) -> bool:
        """Whether :meth:`_pack` copies this bucket (several tensors, or one cast or moved), so the ring
        of pack buffers must hold it: a lone weight cast to a bf16 engine's dtype is packed too."""
        if len(bucket.specs) > 1:
            return True
        tensor = state[bucket.specs[0].name]
        return tensor.dtype != bucket.dtype or tensor.device != self.device

    def _bcast(self, t: torch.Tensor) -> None:
        self._wait(self._start(t))

    def send(self, state: dict[str, torch.Tensor], version: int) -> dict[str, float]:
        assert self.rank == 0, "only rank 0 sends"
        t0 = time.perf_counter()
        try:
            check_plan(self.plan, state)
            status = OK
        except WeightSyncError:
            status = ABORT  # receivers are told, and fail fast instead of waiting for buckets
        header = self.header(version, status)
        if self._meta_sent:
            header.meta_nbytes = 0
        self._bcast(header.to_tensor().to(self.device))
        if header.meta_nbytes:
            self._bcast(torch.frombuffer(bytearray(self.meta), dtype=torch.uint8).to(self.device))
            self._meta_sent = True
        if status == ABORT:
            check_plan(self.plan, state)  # raises the reason
        if not self._pack_bufs:
            most = max((b.numel * b.dtype.itemsize for b in self.buckets if self._packed(b, state)), default=0)
            self._pack_bufs = (
                [torch.zeros(most, dtype=torch.uint8, device=self.device) for _ in range(self.max_inflight)]
                if most
                else []
            )
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
        header_t = torch.zeros(HEADER_LEN, dtype=torch.int64, device=self.device)
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
        except Abort as e:
            if header.status != ABORT:  # drain the sender's buckets so the group stays in step
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
