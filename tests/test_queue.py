import asyncio

import pytest

from clawray.actors.queue import TrajectoryQueue


def run(coro):
    return asyncio.run(coro)


def test_staleness_cap_one_trains_at_next_version_and_drops_after():
    async def scenario():
        q = TrajectoryQueue(max_staleness=1)
        await q.put(["made-at-v3"], 3)
        # the update producing v4 may take it (staleness 1)
        batch = await q.get_batch(1, next_version=4, timeout_s=0.1)
        assert batch["refs"] == ["made-at-v3"] and batch["staleness"] == [1]
        await q.put(["also-v3"], 3)
        # the update producing v5 would see staleness 2 > 1: dropped and counted
        assert await q.get_batch(1, next_version=5, timeout_s=0.05) is None
        return await q.stats()

    assert run(scenario()) == {"size": 0, "put": 2, "taken": 1, "dropped": {"stale": 1}}


def test_batch_is_fifo_and_waits_for_enough_samples():
    async def scenario():
        q = TrajectoryQueue(max_staleness=2)
        for i in range(3):
            await q.put([f"s{i}"], 0)
        waiter = asyncio.ensure_future(q.get_batch(4, next_version=1, timeout_s=5))
        await asyncio.sleep(0.05)
        assert not waiter.done()
        await q.put(["s3"], 0)
        batch = await waiter
        return batch, await q.stats()

    batch, stats = run(scenario())
    assert batch == {"refs": ["s0", "s1", "s2", "s3"], "versions": [0, 0, 0, 0], "staleness": [1, 1, 1, 1]}
    assert stats == {"size": 0, "put": 4, "taken": 4, "dropped": {}}


def test_timeout_keeps_samples():
    async def scenario():
        q = TrajectoryQueue(max_staleness=2)
        await q.put(["a"], 0)
        assert await q.get_batch(2, next_version=1, timeout_s=0.05) is None
        return await q.stats()

    assert run(scenario())["size"] == 1


def test_invalid_cap():
    with pytest.raises(ValueError):
        TrajectoryQueue(max_staleness=0)
