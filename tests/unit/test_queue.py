import asyncio

import pytest

from clawray.actors.queue import TrajectoryQueue
from clawray.types import SampleMeta


def run(coro):
    return asyncio.run(coro)


def put(q, name, version, num_tokens=4):
    """Enqueue the fake ref ``name`` with metadata naming it (``session_id``), so a test can check that
    each ref's metadata travels with it."""
    meta = SampleMeta(
        policy_version=version, reward=1.0, num_tokens=num_tokens, trainable_tokens=1, prompt_key="p", session_id=name
    )
    return q.put([name], meta)


def without_meta(batch):
    """The batch without its ``meta`` list, after checking that the list names the refs in order."""
    assert [m.session_id for m in batch["meta"]] == batch["refs"]
    return {k: v for k, v in batch.items() if k != "meta"}


def test_staleness_cap_one_trains_at_next_version_and_drops_after():
    async def scenario():
        q = TrajectoryQueue(max_staleness=1)
        await put(q, "made-at-v3", 3)
        # the update producing v4 may take it (staleness 1)
        batch = await q.get_batch(1, next_version=4, timeout_s=0.1)
        assert batch["refs"] == ["made-at-v3"] and batch["staleness"] == [1]
        await put(q, "also-v3", 3)
        # the update producing v5 would see staleness 2 > 1: dropped and counted
        assert await q.get_batch(1, next_version=5, timeout_s=0.05) is None
        return await q.stats()

    assert run(scenario()) == {"size": 0, "put": 2, "taken": 1, "dropped": {"stale": 1}}


def test_batch_is_fifo_and_waits_for_enough_samples():
    async def scenario():
        q = TrajectoryQueue(max_staleness=2)
        for i in range(3):
            await put(q, f"s{i}", 0)
        waiter = asyncio.ensure_future(q.get_batch(4, next_version=1, timeout_s=5))
        await asyncio.sleep(0.05)
        assert not waiter.done()
        await put(q, "s3", 0)
        batch = await waiter
        return batch, await q.stats()

    batch, stats = run(scenario())
    assert without_meta(batch) == {
        "refs": ["s0", "s1", "s2", "s3"],
        "versions": [0, 0, 0, 0],
        "staleness": [1, 1, 1, 1],
        "seqs": [0, 0, 0, 0],
    }  # no journal: no sequence numbers
    assert stats == {"size": 0, "put": 4, "taken": 4, "dropped": {}}


def test_timeout_keeps_samples():
    async def scenario():
        q = TrajectoryQueue(max_staleness=2)
        await put(q, "a", 0)
        assert await q.get_batch(2, next_version=1, timeout_s=0.05) is None
        return await q.stats()

    assert run(scenario())["size"] == 1


def test_invalid_cap():
    with pytest.raises(ValueError):
        TrajectoryQueue(max_staleness=0)


def test_batch_takes_every_fresh_sample_up_to_the_cap_oldest_version_first():
    async def scenario():
        q = TrajectoryQueue(max_staleness=2)
        for name, version in [("a", 0), ("b", 1), ("c", 2), ("d", 0), ("e", 2), ("f", 1)]:
            await put(q, name, version)
        # update producing v3: a and d (staleness 3) are stale; b, f (staleness 2) come before c, e (1)
        first = await q.get_batch(2, next_version=3, timeout_s=0.1, max_batch_size=3)
        assert without_meta(first) == {
            "refs": ["b", "f", "c"],
            "versions": [1, 1, 2],
            "staleness": [2, 2, 1],
            "seqs": [0, 0, 0],
        }
        await put(q, "g", 3)
        # update producing v4: e (v2, staleness 2) is still fresh and goes first; g follows
        second = await q.get_batch(1, next_version=4, timeout_s=0.1, max_batch_size=8)
        assert without_meta(second) == {"refs": ["e", "g"], "versions": [2, 3], "staleness": [2, 1], "seqs": [0, 0]}
        return await q.stats()

    assert run(scenario()) == {"size": 0, "put": 7, "taken": 5, "dropped": {"stale": 2}}


def test_exact_batches_by_default_and_a_cap_below_the_minimum_is_an_error():
    async def scenario():
        q = TrajectoryQueue(max_staleness=2)
        for i in range(5):
            await put(q, f"s{i}", 0)
        batch = await q.get_batch(2, next_version=1, timeout_s=0.1)
        with pytest.raises(ValueError, match="max_batch_size 1 < batch_size 2"):
            await q.get_batch(2, next_version=1, timeout_s=0.1, max_batch_size=1)
        return batch, await q.stats()

    batch, stats = run(scenario())
    assert batch["refs"] == ["s0", "s1"] and stats["size"] == 3 and stats["taken"] == 2


def test_learner_bound_stream_trains_what_exact_batches_drop():
    """A learner that takes one batch per version while 6 samples arrive per version (staleness
    cap 1): exact batches of 2 leave 4 of every 6 to go stale; batches of up to 8 train all."""

    async def stream(max_batch_size):
        q = TrajectoryQueue(max_staleness=1)
        trained = 0
        for version in range(5):  # samples made at `version`, trained by the update producing version + 1
            for i in range(6):
                await put(q, f"v{version}-{i}", version)
            batch = await q.get_batch(2, next_version=version + 1, timeout_s=0.1, max_batch_size=max_batch_size)
            trained += len(batch["refs"])
        stats = await q.stats()
        return trained, stats["dropped"].get("stale", 0), stats["size"]

    assert run(stream(0)) == (10, 16, 4)  # 2 per update; 4 per version expire (the last 4 still queued)
    assert run(stream(8)) == (30, 0, 0)
