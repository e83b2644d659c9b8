"""Learner -> rollout weight transport: flat, versioned buckets over a collective group of its own.

The sender (learner rank 0) and every receiver (RolloutEngine) form a process group that is separate
from the learners' FSDP group (gloo on CPU, NCCL on GPU). Both sides agree on a *plan* before the
first sync: the ordered list of :class:`~clawray.engines.base.WeightSpec` the engine loads. Each sync
broadcasts a header ``[version, n_tensors, n_buckets]`` and then the tensors packed into flat
buckets of at most ``bucket_bytes`` (one dtype per bucket), so the number of collective calls is the
number of buckets, not the number of tensors.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Iterator

import torch
import torch.distributed as dist

from clawray.engines.base import WeightSpec


class WeightSyncError(RuntimeError):
    """A sync failed: metadata mismatch, version mismatch or a collective timeout."""


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


class CollectiveTransport:
    """One end of the weight-broadcast group (rank 0 sends, ranks 1..W-1 receive).

    Args:
        rank: this process's rank in the sync group (0 = learner rank 0).
        world_size: 1 + number of rollout engines.
        host, port: the TCPStore rendezvous address (rank 0 hosts it).
        plan: the ordered weight specs every sync carries.
        bucket_bytes: maximum bytes per flat bucket.
        timeout_s: rendezvous and per-collective timeout in seconds; a missing peer raises instead
            of hanging forever.
        backend: ``"gloo"`` (CPU tensors) or ``"nccl"`` (CUDA tensors).
    """

    def __init__(self, rank: int, world_size: int, host: str, port: int, plan: list[WeightSpec],
                 bucket_bytes: int, timeout_s: float = 120.0, backend: str = "gloo"):
        self.rank, self.world_size = rank, world_size
        self.plan = list(plan)
        self.buckets = plan_buckets(self.plan, bucket_bytes)
        self.device = torch.device("cuda" if backend == "nccl" else "cpu")
        timeout = timedelta(seconds=timeout_s)
        store = dist.TCPStore(host, port, world_size, is_master=(rank == 0), timeout=timeout)
        if backend == "gloo":
            self.pg = dist.ProcessGroupGloo(store, rank, world_size, timeout)
        elif backend == "nccl":  # pragma: no cover - GPU only
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            self.pg = dist.ProcessGroupNCCL(store, rank, world_size, opts)
        else:
            raise ValueError(f"unknown sync backend {backend!r}")

    def _bcast(self, t: torch.Tensor) -> None:
        self.pg.broadcast(t, 0).wait()

    def send(self, state: dict[str, torch.Tensor], version: int) -> dict[str, float]:
        """Broadcast the planned tensors of ``state`` stamped with ``version`` (rank 0 only).

        Returns:
            ``{"bytes": total bytes sent, "seconds": wall time}``.
        """
        assert self.rank == 0, "only rank 0 sends"
        t0 = time.perf_counter()
        self._bcast(torch.tensor([version, len(self.plan), len(self.buckets)], dtype=torch.int64, device=self.device))
        nbytes = 0
        for bucket in self.buckets:
            flat = torch.cat([state[s.name].detach().reshape(-1).to(bucket.dtype) for s in bucket.specs])
            flat = flat.to(self.device)
            self._bcast(flat)
            nbytes += flat.numel() * flat.element_size()
        return {"bytes": float(nbytes), "seconds": time.perf_counter() - t0}

    def receive(self, expected_version: int) -> Iterator[tuple[str, torch.Tensor]]:
        """Receive one sync; yields ``(name, tensor)`` in plan order as buckets arrive.

        The header is checked before any weight is yielded.

        Raises:
            WeightSyncError: the header's version or sizes differ from what this receiver expects.
        """
        header = torch.zeros(3, dtype=torch.int64, device=self.device)
        self._bcast(header)
        version, n_tensors, n_buckets = header.tolist()
        if (version, n_tensors, n_buckets) != (expected_version, len(self.plan), len(self.buckets)):
            raise WeightSyncError(
                f"sync header (version={version}, tensors={n_tensors}, buckets={n_buckets}) != expected "
                f"(version={expected_version}, tensors={len(self.plan)}, buckets={len(self.buckets)})")
        return self._receive_buckets()

    def _receive_buckets(self) -> Iterator[tuple[str, torch.Tensor]]:
        for bucket in self.buckets:
            flat = torch.empty(bucket.numel, dtype=bucket.dtype, device=self.device)
            self._bcast(flat)
            offset = 0
            for spec in bucket.specs:
                n = _numel(spec.shape)
                yield spec.name, flat[offset : offset + n].view(spec.shape)
                offset += n

    def close(self) -> None:
        """Drop the process group."""
        self.pg = None
