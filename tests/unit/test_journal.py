"""The durable journals (clawray.journal): acknowledgement only once written, replay of every
unconsumed sample exactly once (voiding steps a checkpoint does not cover), torn last lines,
compaction that keeps the counters, and a SessionTracker that continues a session across a restart
(same numbering, the pending turn still judged, an unfinished judgement restarted)."""

import asyncio
import os

import pytest

from clawray.actors import session as session_mod
from clawray.actors.session import SessionTracker
from clawray.journal import SampleJournal, SampleState, SessionJournal, prepare_journals, read_records
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


def test_a_restarted_queue_appends_after_a_torn_last_line_without_losing_the_next_ack(tmp_path):
    """Ray restarts the queue actor after it died mid-append: the torn line is cut before the next
    acknowledgement, which the next restart replays (it was glued onto the torn bytes and lost with
    them, and one more ack made the file damaged: the next restart and resume=true failed)."""
    paths = prepare_journals(str(tmp_path), None)
    j = SampleJournal(paths["samples"])
    j.ack(_sample(1), 0)
    j.file.close()
    with open(paths["samples"], "a") as f:  # the actor died while appending the ack of s2
        f.write('{"op":"ack","seq":2,"version":0,"sam')
    restarted = SampleJournal(paths["samples"])
    assert [s.session_id for _, s, _ in restarted.replay()] == ["s1"]
    assert restarted.ack(_sample(3), 0) == 2
    restarted.ack(_sample(4), 0)
    restarted.file.close()
    assert [(seq, s.session_id) for seq, s, _ in SampleJournal(paths["samples"]).replay()] == [
        (1, "s1"),
        (2, "s3"),
        (3, "s4"),
    ]
    assert len(read_records(paths["samples"])) == 3
    prepare_journals(str(tmp_path), resume_step=0)  # resume=true reads it whole


def test_samples_discarded_with_a_rolled_back_candidate_are_never_replayed(tmp_path):
    """The gate rejected v2 and dropped the samples trained into it, but the journal held them only
    as consumed by step 2: a learner rebuild or resume from the checkpoint of step 1 revived them and
    trained them into the lineage the gate had refused them. Discarded, they stay gone, through a
    compaction and a restart too."""
    paths = prepare_journals(str(tmp_path), None)
    j = SampleJournal(paths["samples"], compact_bytes=1)  # every forget compacts
    for i in range(4):
        j.ack(_sample(i), 0)
    j.consume([1, 2], step=1, trained=True)
    j.consume([3, 4], step=2, trained=True)  # v2: rejected by the gate
    j.discard([3, 4])
    j.rewind(1)  # the learners were rebuilt from the checkpoint of step 1
    assert [seq for seq, _, _ in j.replay()] == []
    j.file.close()
    prepare_journals(str(tmp_path), resume_step=0)  # a resume from before both steps: 1 and 2 only
    again = SampleJournal(paths["samples"], compact_bytes=1)
    assert [seq for seq, _, _ in again.replay()] == [1, 2] and (again.state.put, again.state.taken) == (4, 2)
    again.forget(0)  # compacted: the discard holds in the rewritten file
    again.file.close()
    assert [seq for seq, _, _ in SampleJournal(paths["samples"]).replay()] == [1, 2]


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
    assert stats["credit/session_turns"] == 3  # s's requests before the restart count (was 1)

    async def third():  # from the compacted journal: t's two requests are still known at its close
        tracker = SessionTracker([judge], FakeQueue(), journal={"path": path})
        await tracker.close_session("t")
        return await tracker.stats()

    assert asyncio.run(third())["credit/session_turns"] == 3 + 2  # the counter goes on from 3


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


def _hanging(judge):
    """Make ``judge`` wait for the returned event before each answer; returns (event, restore)."""
    hang, real = asyncio.Event(), judge.judge.fn

    async def slow(turn_, ns):
        await hang.wait()
        return await real(turn_, ns)

    judge.judge.fn = slow
    return hang, lambda: setattr(judge.judge, "fn", real)


H = [{"role": "user", "content": "q"}]
H_ZERO = H + [{"role": "assistant", "content": "r1"}, {"role": "user", "content": "meh"}]


def test_a_closed_session_whose_id_is_used_again_is_finalised_alone_after_a_restart(tmp_path, no_object_store):
    """Session s closes while its turn 1 is being judged (a 0 score: held for the at-least-one rule),
    and a new conversation reuses the id (turn 3) before the judgement ends; the tracker dies. The
    journal's ``turns`` line of the new session replaced the closed one, so the restarted tracker
    judged turn 1 on the *open* session: it was never promoted (its session never finalised) and sat
    held in the new conversation, where a trained turn would have dropped it."""
    path = prepare_journals(str(tmp_path), None)["sessions"]
    judge = FakeJudge({"meh": 0, "good": 1})

    async def first():
        hang, restore = _hanging(judge)
        tracker = SessionTracker([judge], FakeQueue(), journal={"path": path})
        await tracker.record_turn(turn("s", H, "r1"))
        await tracker.record_turn(turn("s", H_ZERO, "r2"), done=True)  # turn 1 judged (hangs); s closed
        assert await tracker.record_turn(turn("s", H, "again")) == 3  # the id used again
        await asyncio.sleep(0.01)
        restore()

    asyncio.run(first())  # the tracker dies
    state = SessionJournal(path).state  # loading compacts the file: the tracker below replays that form
    assert [(sid, r.base, r.turns, r.closed) for sid, r in [*state.superseded, *state.sessions.items()]] == [
        ("s", 0, 2, True),
        ("s", 2, 3, False),
    ]
    queue = FakeQueue()

    async def second():
        tracker = SessionTracker([judge], queue, journal={"path": path})
        await tracker.drain()
        reused = tracker.book.get("s")
        return [t.turn_index for t in reused.pending], reused.held

    pending, held = asyncio.run(second())
    assert pending == [3] and held == []
    # turn 1 (votes [0, 0, 1]) promoted by its own closed session with its mean vote
    assert [(s.session_id, s.turn_index, s.reward) for s, _ in queue.items] == [("s", 1, pytest.approx(1 / 3))]


def test_a_finalisation_after_the_id_is_used_again_leaves_its_turn_out_of_the_new_session(tmp_path, no_object_store):
    """As above, but the judgement ends (turn 1 held, then promoted when s finalises) after the id was
    used again, before the tracker dies. The ``judged`` line went to the new session's record and the
    ``finalized`` line was ignored (that record is open): after a restart the new session held turn 1
    and closing it promoted turn 1 a second time."""
    path = prepare_journals(str(tmp_path), None)["sessions"]
    judge, queue = FakeJudge({"meh": 0, "good": 1}), FakeQueue()

    async def first():
        hang, restore = _hanging(judge)
        tracker = SessionTracker([judge], queue, journal={"path": path})
        await tracker.record_turn(turn("s", H, "r1"))
        await tracker.record_turn(turn("s", H_ZERO, "r2"), done=True)
        await tracker.record_turn(turn("s", H, "again"))  # turn 3, the id used again
        hang.set()
        await tracker.drain()
        restore()

    asyncio.run(first())
    assert [(s.turn_index, s.reward) for s, _ in queue.items] == [(1, pytest.approx(1 / 3))]
    queue2 = FakeQueue()

    async def second():
        tracker = SessionTracker([judge], queue2, journal={"path": path})
        held = list(tracker.book.get("s").held)
        await tracker.close_session("s")
        await tracker.drain()
        return held, await tracker.stats()

    held, stats = asyncio.run(second())
    assert held == [] and queue2.items == []
    assert stats["at_least_one_promoted"] == 1 and stats["samples"] == 1  # the first tracker's, once


def test_a_replayed_judgement_keeps_its_sessions_opening(tmp_path, no_object_store):
    """``trainer.group_by: session_prefix`` groups samples by their session's opening. A judgement the
    restart replays emitted its sample with no opening (the restored session had none)."""
    from clawray.algos.rejection import opening
    from clawray.chat import conversation_key

    path = prepare_journals(str(tmp_path), None)["sessions"]
    judge = FakeJudge({"good": 1})
    h = [{"role": "system", "content": "be brief"}, *H]
    h2 = h + [{"role": "assistant", "content": "r1"}, {"role": "user", "content": "good"}]

    async def first():
        hang, restore = _hanging(judge)
        tracker = SessionTracker([judge], FakeQueue(), journal={"path": path})
        await tracker.record_turn(turn("o", h, "r1"))
        await tracker.record_turn(turn("o", h2, "r2"))  # turn 1's judgement hangs; the tracker dies
        await asyncio.sleep(0.01)
        restore()

    asyncio.run(first())
    queue = FakeQueue()

    async def second():
        tracker = SessionTracker([judge], queue, journal={"path": path})
        await tracker.drain()

    asyncio.run(second())
    [(sample, _)] = queue.items
    assert sample.turn_index == 1 and sample.info["opening"] == conversation_key(opening(h))


def test_a_batch_taken_before_the_queue_restarted_counts_as_taken_when_consumed(tmp_path, no_object_store):
    """The queue actor dies while the learners train a batch it handed out; Ray restarts it and it
    queues every live journaled sample again. The batch's ``consumed`` removes its samples from the
    queue, and they count as taken (``taken`` is what ``inv/effective_sample_rate`` divides by): the
    restarted queue reported ``taken`` 0 after 2 were trained."""
    from clawray.actors.queue import TrajectoryQueue
    from clawray.types import SampleMeta

    path = prepare_journals(str(tmp_path), None)["samples"]

    async def ref(sample):  # what awaiting an ObjectRef gives
        return sample

    async def scenario():
        q = TrajectoryQueue(2, journal={"path": path})
        for i in range(4):
            await q.put([ref(_sample(i))], SampleMeta.of(_sample(i)))
        batch = await q.get_batch(2, next_version=1)
        q.journal.file.close()  # the queue actor dies; the learners go on with the batch
        q2 = TrajectoryQueue(2, journal={"path": path})
        before = await q2.stats()
        await q2.consumed(batch["seqs"], step=1)
        return batch["seqs"], before, await q2.stats()

    seqs, before, after = asyncio.run(scenario())
    assert seqs == [1, 2]
    assert (before["size"], before["put"], before["taken"], before["replayed"]) == (4, 4, 0, 4)
    assert (after["size"], after["put"], after["taken"]) == (2, 4, 2)


def test_a_resume_from_an_older_checkpoint_never_trains_the_discarded_versions_samples(tmp_path, no_object_store):
    """Version numbers are reused after a rollback: a run checkpointed at v1 went on to v3 and died;
    the resume serves v1 again and its next update produces v2. The journal still holds samples
    stamped v1, v2, v3, v3; the update producing v2 saw staleness [1, 0, -1, -1] and trained all of
    them as fresher than on-policy. Their distance to the trained policy through v1 is [1, 2, 3, 3]:
    under max_staleness 1 only the v1 sample is trained, the others are dropped (``rolled_back``),
    journaled, never replayed again; under max_staleness 3 all four are trained, farthest first."""
    from clawray.actors.queue import TrajectoryQueue
    from clawray.types import SampleMeta

    path = prepare_journals(str(tmp_path), None)["samples"]

    async def ref(sample):
        return sample

    async def scenario():
        q = TrajectoryQueue(1, journal={"path": path})
        for i, v in enumerate([1, 2, 3, 3]):
            await q.put([ref(_sample(i, version=v))], SampleMeta.of(_sample(i, version=v)))
        q.journal.file.close()  # the run dies; the checkpoint of v1 (step 1) is resumed
        prepare_journals(str(tmp_path), resume_step=1)
        q2 = TrajectoryQueue(1, journal={"path": path})
        batch = await q2.get_batch(1, next_version=2, max_batch_size=8)
        q2.journal.file.close()
        q3 = TrajectoryQueue(1, journal={"path": path})
        return batch, await q2.stats(), await q3.stats()

    batch, stats, again = asyncio.run(scenario())
    assert (batch["versions"], batch["staleness"], batch["seqs"]) == ([1], [1], [1])
    assert (stats["size"], stats["taken"], stats["dropped"]) == (0, 1, {"rolled_back": 3})
    assert (again["size"], again["replayed"], again["dropped"]) == (1, 1, {"rolled_back": 3})

    async def within_the_cap():
        q = TrajectoryQueue(3)
        for i, v in enumerate([1, 2, 3, 3]):
            await q.put([f"s{i}"], SampleMeta.of(_sample(i, version=v)))
        first = await q.get_batch(1, next_version=2, max_batch_size=8)
        return first, await q.stats()

    batch, stats = asyncio.run(within_the_cap())
    assert (batch["refs"], batch["staleness"], stats["dropped"]) == (["s2", "s3", "s1", "s0"], [3, 3, 2, 1], {})


def test_a_batch_taken_by_a_step_a_restarted_actors_death_aborted_is_trained_by_the_next(
    tmp_path, no_object_store, monkeypatch
):
    """The serial loop took a batch, then the session tracker died while the users were held; Ray
    restarted it and the loop went on. The next step took a new batch in place of the aborted one,
    whose samples left the queue untrained (until a resume). Now they are queued again, first."""
    import types

    from clawray import driver as driver_mod
    from clawray.actors.queue import TrajectoryQueue
    from clawray.recovery import ActorLost, Recovery
    from clawray.types import SampleMeta

    path = prepare_journals(str(tmp_path), None)["samples"]
    q = TrajectoryQueue(2, journal={"path": path})

    async def ref(sample):
        return sample

    async def fill():
        for i in range(4):
            await q.put([ref(_sample(i))], SampleMeta.of(_sample(i)))

    asyncio.run(fill())

    class Remote:  # q's methods as an actor handle's: .remote(...) gives what ray.get resolves
        def __getattr__(self, name):
            return types.SimpleNamespace(remote=lambda *a: asyncio.run(getattr(q, name)(*a)))

    d = driver_mod.Driver.__new__(driver_mod.Driver)
    d.state = types.SimpleNamespace(version=0, steps_done=0, in_flight=None, learner_restarts=0)
    d.actors = types.SimpleNamespace(queue=Remote())
    from clawray.resume import Checkpoints

    d.checkpoints = Checkpoints.__new__(Checkpoints)  # the loop's own state and queue; marks at once
    d.checkpoints.state, d.checkpoints.actors, d.checkpoints.mark = d.state, d.actors, lambda call, what: call()
    d.cfg = types.SimpleNamespace(learner=types.SimpleNamespace(max_restarts=0))
    died = ActorLost("session tracker", "tracker")

    def step():  # take_batch, then the tracker's death in users.hold
        batch = asyncio.run(q.get_batch(2, next_version=1))
        d.state.in_flight = {"next_version": 1, "metas": batch["meta"], "seqs": batch["seqs"]}
        raise died

    monkeypatch.setattr(d, "step", step)
    monkeypatch.setattr(driver_mod, "recovery_for", lambda actors, exc, may: Recovery("go_on", died))
    d._step_or_recover()
    stats = asyncio.run(q.stats())
    assert (stats["size"], stats["taken"]) == (4, 0)  # re-based on the journal: nothing consumed yet
    nxt = asyncio.run(q.get_batch(2, next_version=1, max_batch_size=4))
    assert d.state.in_flight is None and nxt["seqs"] == [1, 2, 3, 4]


def test_a_duplicate_put_is_refused_before_its_length_is_counted(tmp_path, no_object_store):
    """An acknowledged sample put again (a tracker that restarted before it journaled the put) into a
    queue restarted with a smaller token budget: the replay drops it as ``too_long`` once; the
    duplicate put counted it a second time."""
    from clawray.actors.queue import TrajectoryQueue
    from clawray.types import SampleMeta

    path = prepare_journals(str(tmp_path), None)["samples"]

    async def ref(sample):
        return sample

    async def scenario():
        q = TrajectoryQueue(2, journal={"path": path})
        await q.put([ref(_sample(0))], SampleMeta.of(_sample(0)))
        q.journal.file.close()
        q2 = TrajectoryQueue(2, max_tokens=3, journal={"path": path})  # the sample has 4 tokens
        assert await q2.put([ref(_sample(0))], SampleMeta.of(_sample(0))) == 0
        return await q2.stats()

    stats = asyncio.run(scenario())
    assert (stats["size"], stats["put"], stats["dropped"]) == (0, 1, {"too_long": 1})


def test_a_restarted_queue_keeps_the_re_stamp_of_a_discarded_versions_sample(tmp_path, no_object_store):
    """max_staleness 2, resumed at v1: s1 was stamped v2 by the discarded versions. The update producing
    the new v2 re-stamps it 0 (distance 2) and takes s0; the queue actor restarts. Its replay had s1 at
    v2 again, and the update producing v3 trained it at staleness 1; it is 3 updates away: dropped."""
    from clawray.actors.queue import TrajectoryQueue
    from clawray.types import SampleMeta

    path = prepare_journals(str(tmp_path), None)["samples"]

    async def ref(sample):
        return sample

    async def scenario():
        q = TrajectoryQueue(2, journal={"path": path})
        for i, v in enumerate([0, 2]):
            await q.put([ref(_sample(i, version=v))], SampleMeta.of(_sample(i, version=v)))
        first = await q.get_batch(1, next_version=2)
        await q.consumed(first["seqs"], step=1)
        q.journal.file.close()  # Ray restarts the queue actor
        q2 = TrajectoryQueue(2, journal={"path": path})
        second = await q2.get_batch(1, next_version=3, timeout_s=0.05)
        return first, second, await q2.stats()

    first, second, stats = asyncio.run(scenario())
    assert (first["seqs"], first["staleness"], second) == ([1], [2], None)
    # a discarded version's sample: rolled_back, as before the restart (the replay had lost its fork: stale)
    assert (stats["size"], stats["dropped"]) == (0, {"rolled_back": 1})


@pytest.mark.parametrize("restart", [False, True])
def test_a_second_rollback_below_the_first_fork_measures_the_distance_from_the_older_ancestor(
    tmp_path, no_object_store, restart
):
    """max_staleness 3. A sample made by v5 on a branch from v3: the gate rolled back to v3 (the update
    producing v4 re-stamps it 1, distance 2 + 1 = 3), then a resume from the checkpoint of v1 (the
    update producing v2). Its distance through v1 is (5 - 1) + 1 = 5, past the cap: dropped as
    rolled_back. The mirror of its re-stamp (1) around v1 was never taken (1 is not above 1): trained
    at staleness 1. With a journal, a queue restarted between the two forks keeps the first one."""
    from clawray.actors.queue import TrajectoryQueue
    from clawray.types import SampleMeta

    path = prepare_journals(str(tmp_path), None)["samples"]

    async def ref(sample):
        return sample

    async def scenario():
        q = TrajectoryQueue(3, journal={"path": path})
        await q.put([ref(_sample(0, version=5))], SampleMeta.of(_sample(0, version=5)))
        q._drop_stale(4)  # the update producing v4 after the rollback to v3
        held = [m.policy_version for _, m, _ in q._items]
        if restart:
            q.journal.file.close()  # Ray restarts the queue actor
            q = TrajectoryQueue(3, journal={"path": path})
        batch = await q.get_batch(1, next_version=2, timeout_s=0.05)
        return held, batch, await q.stats()

    held, batch, stats = asyncio.run(scenario())
    assert (held, batch) == ([1], None)
    assert (stats["size"], stats["dropped"]) == (0, {"rolled_back": 1})

    async def within_the_cap():  # max_staleness 5: trained at its distance, 5
        q = TrajectoryQueue(5)
        await q.put(["s0"], SampleMeta.of(_sample(0, version=5)))
        q._drop_stale(4)
        return await q.get_batch(1, next_version=2)

    assert asyncio.run(within_the_cap())["staleness"] == [5]


def test_asking_whether_the_tracker_was_restarted_never_starts_ray():
    """A tracker built outside Ray (a unit, ``clawray eval``) asked Ray's runtime context, which
    started a local Ray instance (seconds, a dashboard, a /dev/shm store) to answer False."""
    import subprocess
    import sys

    code = "import ray; from clawray.recovery import was_restarted; print(was_restarted(), ray.is_initialized())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["False", "False"], out.stderr[-2000:]


def test_an_idle_closed_conversation_is_still_inferred_into_its_session_after_a_restart(tmp_path, no_object_store):
    """An idle close remembers its pending turns' keys so that a user back later goes on in the same
    session; a tracker restarted in between forgot them (the request was unattributable, never
    recorded). The journal keeps them, through a compaction too, and forgets them once reopened."""
    from clawray.chat import attribution_keys

    path = prepare_journals(str(tmp_path), None)["sessions"]
    h = [{"role": "user", "content": "q"}]
    later = h + [{"role": "assistant", "content": "r1"}, {"role": "user", "content": "more"}]
    keys = {k: key for k, key in enumerate(attribution_keys(later)) if later[k]["role"] == "assistant"}

    async def first():
        tracker = SessionTracker([FakeJudge({"more": 1})], FakeQueue(), journal={"path": path})
        await tracker.record_turn(turn("auto-1", h, "r1"))
        await tracker.close_session("auto-1", idle=True)
        await tracker.drain()

    async def found():
        tracker = SessionTracker([FakeJudge({"more": 1})], FakeQueue(), journal={"path": path})
        return tracker, tracker.book.find(None, keys, None, auto_only=True)["session_id"]

    asyncio.run(first())
    assert asyncio.run(found())[1] == "auto-1"  # replayed from the appended records
    assert asyncio.run(found())[1] == "auto-1"  # and from the compacted journal

    async def reopen():
        tracker, sid = await found()
        assert await tracker.record_turn(turn(sid, later, "r2")) == 2  # the numbering goes on
        await tracker.drain()

    asyncio.run(reopen())
    tracker, _ = asyncio.run(found())
    assert tracker.book.closed_index == {} and tracker.book.get("auto-1").turns == 2
