"""The object-store transport, the naive baseline: rank 0 ``ray.put``\\ s the flat buckets and posts
their refs to the :class:`~clawray.weight_sync.mailbox.WeightMailbox`; receivers ``ray.get`` them.

Owns: the put and get of the flat buckets, and the sender's hold on the last sync's objects. Must not:
know another transport or keep an older sync's objects alive.
"""

from __future__ import annotations

import time
from typing import Iterator

import ray
import torch

from clawray.engines.base import WeightSpec
from clawray.weight_sync.mailbox import check_state_or_abort
from clawray.weight_sync.plan import WeightSyncError
from clawray.weight_sync.transport import SyncHeader, WeightTransport, Abort


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
        self.seq = 0
        self._live: list = []  # the sender keeps its last sync's objects alive

    def send(self, state: dict[str, torch.Tensor], version: int) -> dict[str, float]:
        assert self.rank == 0, "only rank 0 sends"
        t0 = time.perf_counter()
        self.seq += 1
        check_state_or_abort(self, state, version)
        cpu = torch.device("cpu")
        refs, nbytes = [], 0
        for bucket in self.buckets:
            flat = self._pack(bucket, state, cpu)
            nbytes += flat.numel() * flat.element_size()
            refs.append(ray.put(flat))
        ray.get(self.mailbox.post.remote(self.seq, vars(self.header(version)), self.meta, refs), timeout=self.timeout_s)
        self._live = refs
        return {"bytes": float(nbytes), "seconds": time.perf_counter() - t0}

    def receive(self, expected_version: int) -> Iterator[tuple[str, torch.Tensor]]:
        self.seq += 1
        try:
            header, meta, refs = ray.get(
                self.mailbox.fetch.remote(self.seq, self.timeout_s), timeout=self.timeout_s + 5
            )
        except (ray.exceptions.GetTimeoutError, ray.exceptions.RayTaskError, TimeoutError) as e:
            raise WeightSyncError(f"no sync #{self.seq} posted within {self.timeout_s:g}s: {e!r}") from None
        try:
            self._check_header(SyncHeader(**header), meta, expected_version)
        except Abort as e:
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
