import threading

import pytest
import torch

from clawray.engines.base import WeightSpec
from clawray.ray_env import free_port
from clawray.weight_sync import CollectiveTransport, WeightSyncError, check_plan, plan_buckets


def specs():
    return [WeightSpec("a", (4, 4), "torch.float32"), WeightSpec("b", (8,), "torch.float32"),
            WeightSpec("c", (2, 2), "torch.bfloat16"), WeightSpec("d", (64,), "torch.float32")]


def test_plan_buckets_split_by_size_and_dtype():
    buckets = plan_buckets(specs(), bucket_bytes=100)
    # a=64B, b=32B -> 96B together; c changes dtype; d=256B alone (larger than a bucket)
    assert [[s.name for s in b.specs] for b in buckets] == [["a", "b"], ["c"], ["d"]]
    assert [b.numel for b in buckets] == [24, 4, 64]


def test_check_plan_names_missing_and_shape_mismatch():
    state = {"a": torch.zeros(4, 4), "b": torch.zeros(8), "c": torch.zeros(2, 2)}
    with pytest.raises(WeightSyncError, match="lacks 1 planned weights"):
        check_plan(specs(), state)
    state["d"] = torch.zeros(63)
    with pytest.raises(WeightSyncError, match="d: \\(63,\\) != \\(64,\\)"):
        check_plan(specs(), state)


def test_gloo_broadcast_roundtrip_and_version_check():
    plan = specs()
    port = free_port()
    state = {s.name: torch.randn(s.shape).to(getattr(torch, s.dtype[6:])) for s in plan}
    received, errors = {}, []

    def receiver():
        t = CollectiveTransport(1, 2, "127.0.0.1", port, plan, bucket_bytes=100, timeout_s=20)
        received.update(dict(t.receive(expected_version=7)))
        try:
            dict(t.receive(expected_version=9))  # the sender stamps 8
        except WeightSyncError as e:
            errors.append(str(e))

    th = threading.Thread(target=receiver)
    th.start()
    sender = CollectiveTransport(0, 2, "127.0.0.1", port, plan, bucket_bytes=100, timeout_s=20)
    stats = sender.send(state, version=7)
    # the second sync: only the header is consumed by the failing receiver
    sender._bcast(torch.tensor([8, len(plan), len(sender.buckets)], dtype=torch.int64))
    th.join(timeout=30)
    assert stats["bytes"] == (16 + 8 + 64) * 4 + 4 * 2
    assert set(received) == {"a", "b", "c", "d"}
    for name, tensor in state.items():
        assert torch.equal(received[name], tensor) and received[name].dtype == tensor.dtype
    assert errors and "version=8" in errors[0] and "version=9" in errors[0]
