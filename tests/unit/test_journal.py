"""The durable journals (clawray.journal): acknowledgement only once written, replay of every
unconsumed sample exactly once (voiding steps a checkpoint does not cover), torn last lines,
compaction that keeps the counters, and a SessionTracker that continues a session across a restart
(same numbering, the pending turn still judged, an unfinished judgement restarted)."""

import asyncio
import os

import pytest

from clawray.actors import session as session_mod
from clawray.actors.session import SessionTracker
from clawray.journal import SampleJournal, SampleState, prepare_journals, read_records
from clawray.types import Sample
from test_session import FakeJudge, FakeQueue, turn


def _sample(i, version=0, sid=None):
    return Sample(
        tokens=[5, 6, 7, 100 + i],
        prompt_len=3,
        loss_mask=[1],
        rollout_logprobs=[-0.1 * i - 0.05],
        reward=1.0,
        policy_version=version,
        session_id=sid or f"s{i}",
        turn_index=1,
    )


def test_replay_voids_steps_after_the_checkpoint_and_keeps_counters(tmp_path):
    paths = prepare_journals(str(tmp_path), None)
    j = SampleJournal(paths["samples"], fsync=True)
    seqs = [j.ack(_sample(i, version=i // 2), i // 2) for i in range(6)]
    assert seqs == [1, 2, 3, 4, 5, 6]
    assert j.is_duplicate(_sample(0)) and not j.is_duplicate(_sample(0, sid="other"))
    j.consume([1, 2], step=1, trained=True)
    j.forget(1)  # the checkpoint after step 1 is committed
    j.consume([3, 4], step=2, trained=True)  # step 2 was trained, but the run died before its checkpoint
    j.drop("stale", [5])
    j.drop("too_long", n=1)
    j.file.close()
    # a torn last line (the process died mid-write) was never acknowledged: ignored
    with open(paths["samples"], "a") as f:
        f.write('{"op":"ack","seq":7,"vers')
    assert len(read_records(paths["samples"])) == 11

    prepare_journals(str(tmp_path), resume_step=1)  # resume from the checkpoint of step 1
    j2 = SampleJournal(paths["samples"])
    replay = [(seq, s.session_id, v) for seq, s, v in j2.replay()]
    assert replay == [(3, "s2", 1), (4, "s3", 1), (6, "s5", 2)]  # step 2 voided; s4 dropped for good
    assert j2.replay()[0][1].rollout_logprobs == [-0.1 * 2 - 0.05]  # the sample itself, exactly
    st = j2.state
    assert (st.put, st.taken, st.dropped, st.next_seq) == (6, 2, {"stale": 1, "too_long": 1}, 7)
    assert j2.is_duplicate(_sample(0))  # trained before the checkpoint: still refused
    # a second resume from the same checkpoint replays the same samples, not more (compaction is stable)
    j2.file.close()
    prepare_journals(str(tmp_path), resume_step=1)
    again = SampleJournal(paths["samples"])
    assert [seq for seq, _, _ in again.replay()] == [3, 4, 6]
    assert (again.state.put, again.state.taken) == (6, 2)


def test_compaction_keeps_voidable_consumes_and_counters(tmp_path):
    path = prepare_journals(str(tmp_path), None)["samples"]
    j = SampleJournal(path, compact_bytes=1)  # compacts at every forget
    for i in range(4):
        j.ack(_sample(i), 0)
    j.consume([1], step=1, trained=True)
    j.forget(1)
    j.consume([2], step=2, trained=False)  # consumed after the last checkpoint: must stay voidable
    j.forget(1)
    ops = [r["op"] for r in read_records(path)]
    assert ops == ["base", "ack", "consume", "ack", "ack"]  # seq 1 gone, seq 2 kept with its mark
    state = SampleState.from_records(read_records(path), void_after_step=1)
    assert list(state.live) == [2, 3, 4] and (state.put, state.taken) == (4, 1)
    assert ("s0", 1) in state.keys


def test_fresh_run_starts_empty_journals(tmp_path):
    paths = prepare_journals(str(tmp_path), None)
    SampleJournal(paths["samples"]).ack(_sample(1), 0)
    prepare_journals(str(tmp_path), None)
    assert (
        read_records(paths["samples"]) == [] and oct(os.stat(os.path.dirname(paths["samples"])).st_mode)[-3:] == "700"
    )


@pytest.fixture
def no_object_store(monkeypatch):
    monkeypatch.setattr(session_mod.ray, "put", lambda x: x)


def test_session_continues_across_a_tracker_restart(tmp_path, no_object_store):
    """Tracker 1 records turns 1 and 2 of session s (turn 1 judged), and turn 2's judgement of
    session t is started but never finishes (the process dies). Tracker 2, from the journal, numbers
    s's next turn 3, judges s's pending turn 2 with that turn's next state, and re-runs t's judgement."""
    path = prepare_journals(str(tmp_path), None)["sessions"]
    h = [{"role": "user", "content": "q"}]
    h2 = h + [{"role": "assistant", "content": "r1"}, {"role": "user", "content": "good"}]
    h3 = h2 + [{"role": "assistant", "content": "r2"}, {"role": "user", "content": "bad"}]
    judge, queue = FakeJudge({"good": 1, "bad": -1}), FakeQueue()
    hang = asyncio.Event()

    async def first():
        tracker = SessionTracker([judge], queue, journal={"path": path})
        assert await tracker.record_turn(turn("s", h, "r1")) == 1
        assert await tracker.record_turn(turn("s", h2, "r2")) == 2
        await tracker.drain()
        # session t: its judgement starts and hangs (the tracker dies before it ends)
        real = judge.judge.fn

        async def slow(turn_, ns):
            await hang.wait()
            return await real(turn_, ns)

        judge.judge.fn = slow
        await tracker.record_turn(turn("t", h, "r1"))
        await tracker.record_turn(turn("t", h2, "r2"))
        await asyncio.sleep(0.01)
        judge.judge.fn = real
        return tracker

    asyncio.run(first())
    assert [(s.session_id, s.turn_index) for s, _ in queue.items] == [("s", 1)]
    queue2 = FakeQueue()

    async def second():
        tracker = SessionTracker([judge], queue2, journal={"path": path})
        assert await tracker.record_turn(turn("s", h3, "r3"), done=True) == 3  # numbering continues
        await tracker.drain()
        return await tracker.stats()

    stats = asyncio.run(second())
    got = sorted((s.session_id, s.turn_index, s.reward) for s, _ in queue2.items)
    # s's pending turn 2 judged with "bad" (-1); t's unfinished judgement of turn 1 re-run ("good": +1)
    assert got == [("s", 2, -1.0), ("t", 1, 1.0)]
    assert stats["journal/replayed_judgements"] == 1 and stats["journal/restored_sessions"] == 2


def test_tracker_counters_continue_across_a_restart_and_a_compaction(tmp_path, no_object_store):
    """Tracker 1 records 3 turns of s (turns 1, 2 judged into samples) and closes it (turn 3 has no
    next state); it dies. Tracker 2 from the journal reports the same counters, not zero, and goes
    on counting from them; a compacted journal (a third load) keeps them too."""
    path = prepare_journals(str(tmp_path), None)["sessions"]
    h = [{"role": "user", "content": "q"}]
    h2 = h + [{"role": "assistant", "content": "r1"}, {"role": "user", "content": "good"}]
    h3 = h2 + [{"role": "assistant", "content": "r2"}, {"role": "user", "content": "good"}]
    judge, queue = FakeJudge({"good": 1}), FakeQueue()

    async def first():
        tracker = SessionTracker([judge], queue, journal={"path": path})
        await tracker.record_turn(turn("s", h, "r1"))
        await tracker.record_turn(turn("s", h2, "r2"))
        await tracker.record_turn(turn("s", h3, "r3"), done=True)
        await tracker.drain()
        return await tracker.stats()

    before = asyncio.run(first())
    assert (before["turns"], before["samples"], before["sessions_closed"], before["dropped/no_next_state"]) == (
        3,
        2,
        1,
        1,
    )

    async def second(new_turn):
        tracker = SessionTracker([judge], FakeQueue(), journal={"path": path})
        if new_turn:
            await tracker.record_turn(turn("u", h, "r1"))
        return await tracker.stats()

    after = asyncio.run(second(True))
    for key in ("samples", "sessions_closed", "dropped/no_next_state"):
        assert after[key] == before[key], key
    assert after["turns"] == 4  # 3 before the restart + 1 after
    assert asyncio.run(second(False))["turns"] == 4  # loading compacted the journal: the counters stay


def test_a_pending_turn_survives_a_compaction_while_an_earlier_judgement_is_unfinished(tmp_path, no_object_store):
    """Session t: turn 1's judgement hangs, turn 2 is pending, and a close compacts the journal. The
    compacted file put the unfinished ``judge`` line after t's ``session`` line, so its replay emptied
    t's pending turns: after the restart turn 2 was never judged nor counted."""
    path = prepare_journals(str(tmp_path), None)["sessions"]
    h = [{"role": "user", "content": "q"}]
    h2 = h + [{"role": "assistant", "content": "r1"}, {"role": "user", "content": "good"}]
    h3 = h2 + [{"role": "assistant", "content": "r2"}, {"role": "user", "content": "bad"}]
    judge, hang = FakeJudge({"good": 1, "bad": -1}), asyncio.Event()
    real = judge.judge.fn

    async def slow(turn_, ns):
        await hang.wait()
        return await real(turn_, ns)

    async def first():
        judge.judge.fn = slow
        tracker = SessionTracker([judge], FakeQueue(), journal={"path": path, "compact_bytes": 1})
        await tracker.record_turn(turn("t", h, "r1"))
        await tracker.record_turn(turn("t", h2, "r2"))  # turn 1's judgement hangs; turn 2 pending
        await tracker.record_turn(turn("x", h, "r1"), done=True)  # a close compacts the journal
        await asyncio.sleep(0.01)

    asyncio.run(first())  # the tracker dies
    judge.judge.fn = real
    ops = [r["op"] for r in read_records(path)]
    assert ops.index("judge") < ops.index("session")
    queue = FakeQueue()

    async def second():
        tracker = SessionTracker([judge], queue, journal={"path": path})
        pending = [t.turn_index for t in tracker.book.get("t").pending]
        await tracker.record_turn(turn("t", h3, "r3"), done=True)
        await tracker.drain()
        return pending

    assert asyncio.run(second()) == [2]
    assert sorted((s.turn_index, s.reward) for s, _ in queue.items) == [(1, 1.0), (2, -1.0)]
