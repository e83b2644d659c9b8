"""The weight plan: the ordered :class:`~clawray.engines.base.WeightSpec` list both ends of a sync agree
on, its flat buckets, and its metadata on the wire.

Owns: the plan's order, its buckets, its digest and wire form, :func:`plan_diff` and
:class:`WeightSyncError`. Must not: call Ray or a process group (pure torch) or move a weight.

The plan is cut into flat *buckets* of at most ``bucket_bytes`` (one dtype per bucket; a larger tensor
gets a bucket of its own), so a sync costs one transfer per bucket, not one per tensor. On the wire a
plan is a 64-bit digest of its ordered ``(name, shape, dtype)`` rows (in every sync header) and, where
a receiver lacks it, compact JSON (:func:`encode_plan`); :func:`plan_diff` names the differences when
two digests disagree.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

import torch

from clawray.engines.base import WeightSpec


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
        return sum(numel(s.shape) for s in self.specs)


def numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def plan_bytes(plan: list[WeightSpec]) -> int:
    """Bytes of one copy of every planned tensor (in the plan's dtypes)."""
    return sum(numel(s.shape) * _dtype(s.dtype).itemsize for s in plan)


def plan_buckets(plan: list[WeightSpec], bucket_bytes: int) -> list[Bucket]:
    """Split ``plan`` into buckets of at most ``bucket_bytes`` bytes (a larger tensor gets its own)."""
    buckets: list[Bucket] = []
    current: list[WeightSpec] = []
    size = 0
    for spec in plan:
        dtype = _dtype(spec.dtype)
        nbytes = numel(spec.shape) * dtype.itemsize
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
    bad = [
        f"{s.name}: {tuple(state[s.name].shape)} != {s.shape}"
        for s in plan
        if tuple(state[s.name].shape) != tuple(s.shape)
    ]
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
    return json.dumps(
        {"plan": _plan_rows(plan), "buckets": [[b.numel, str(b.dtype)] for b in buckets]}, separators=(",", ":")
    ).encode()


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
    shapes = [
        f"{n}: {tuple(snd[n].shape)} != {tuple(exp[n].shape)}"
        for n in exp
        if n in snd and tuple(snd[n].shape) != tuple(exp[n].shape)
    ]
    if shapes:
        out.append(f"shape (sender != engine): {shapes[:limit]}")
    dtypes = [
        f"{n}: {_dtype(snd[n].dtype)} != {_dtype(exp[n].dtype)}"
        for n in exp
        if n in snd and _dtype(snd[n].dtype) != _dtype(exp[n].dtype)
    ]
    if dtypes:
        out.append(f"dtype (sender != engine): {dtypes[:limit]}")
    if not out and [s.name for s in expected] != [s.name for s in got]:
        out.append("same weights in a different order")
    return out
