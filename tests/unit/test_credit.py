"""Long-horizon credit (clawray.algos.credit), dense shaping (clawray.algos.shaping), the credit ledger
(clawray.algos.credit_ledger, on its own) and their place in the SessionTracker: hand-computed
returns, a session closed by the idle timeout, the staleness budget's early flush, the outcome
header, and waiting turns surviving a tracker restart."""

import asyncio
import time

import pytest

from clawray.actors import session as session_mod
from clawray.actors.session import SessionTracker
from clawray.algos.credit import assign_credit, discounted_returns, must_flush, outcome_credit, segment_credit
from clawray.algos.credit_ledger import CreditLedger, SessionCredit
from clawray.algos.shaping import repeated_tool_call, shaping_terms
from clawray.types import Sample, Turn
from test_session import FakeJudge, FakeQueue, turn


@pytest.fixture(autouse=True)
def no_object_store(monkeypatch):
    monkeypatch.setattr(session_mod.ray, "put", lambda x: x)


# ------------------------------------------------------------------------------------------ pure credit
def test_discounted_returns_hand_computed():
    assert discounted_returns([0, 0, 1], 0.9) == pytest.approx([0.81, 0.9, 1.0])
    # G_3 = -1; G_2 = 0.5 + 0.5 * -1 = 0; G_1 = 1 + 0.5 * 0 = 1
    assert discounted_returns([1, 0.5, -1], 0.5) == pytest.approx([1.0, 0.0, -1.0])
    assert discounted_returns([1, 1], 0.0) == [1.0, 1.0]  # gamma 0 = the turn's own reward
    assert discounted_returns([], 0.9) == []
    with pytest.raises(ValueError, match="gamma"):
        discounted_returns([1], 1.5)
    with pytest.raises(ValueError, match="not finite"):
        discounted_returns([float("nan")], 0.9)


def test_outcome_spread_and_mix():
    assert outcome_credit(3, 1.0, 0.9) == pytest.approx([0.81, 0.9, 1.0])
    # explicit O = -1 added to the turns' own rewards [1, 0, 0] with weight 1
    assert assign_credit("outcome", [1, 0, 0], 0.9, -1.0, 1.0) == pytest.approx([1 - 0.81, -0.9, -1.0])
    # no explicit outcome: the last judged turn's own score is the session's score (weight 0: the spread alone)
    assert assign_credit("outcome", [-1, 0, 1], 0.5) == pytest.approx([0.25, 0.5, 1.0])
    # discounted with an explicit outcome: a terminal reward on the last turn
    assert assign_credit("discounted", [0, 0, 0], 0.9, 1.0) == pytest.approx([0.81, 0.9, 1.0])
    assert assign_credit("turn", [0, -1], 0.9, 5.0) == [0.0, -1.0]
    with pytest.raises(ValueError, match="credit mode"):
        assign_credit("montecarlo", [1], 0.9)


def test_a_flushed_segment_is_truncated_and_has_no_outcome():
    assert segment_credit("discounted", [0, 1], 0.9, 5.0, 0.0, closed=False) == pytest.approx([0.9, 1.0])
    assert segment_credit("outcome", [1, -1], 0.9, 5.0, 0.5, closed=False) == pytest.approx([0.5, -0.5])
    assert segment_credit("outcome", [1, -1], 0.9, 2.0, 0.5, closed=True) == pytest.approx([0.5 + 1.8, -0.5 + 2.0])


def test_must_flush_at_the_last_update_that_may_train_the_turn():
    # max_staleness 2: a v0 turn is trainable by the update producing v2 at the latest; the engines
    # serving v1 means the next update produces v2 -> flush now, not while they serve v0
    assert not must_flush(0, 0, 2) and must_flush(0, 1, 2)
    assert must_flush(0, 0, 1)  # strictly on-policy: nothing may wait
    assert not must_flush(3, 5, 4) and must_flush(3, 6, 4)
    with pytest.raises(ValueError):
        must_flush(0, 0, 0)


# ------------------------------------------------------------------------------------------ pure shaping
def _tool_turn(history_calls, reply_calls, **flags):
    def msg(calls):
        return {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": f"c{i}", "type": "function", "function": {"name": n, "arguments": a}}
                for i, (n, a) in enumerate(calls)
            ],
        }

    history = [{"role": "user", "content": "q"}] + [msg([c]) for c in history_calls]
    return Turn("s", 1, history, msg(reply_calls), [1], [2], [-0.1], 0, "tool_calls", **flags)


def test_shaping_terms_hand_computed():
    same = _tool_turn([("calc", '{"a": 1, "b": 2}')], [("calc", '{"b":2,"a":1}')])  # key order and spaces ignored
    other = _tool_turn([("calc", '{"a": 1}')], [("calc", '{"a": 2}')])
    assert repeated_tool_call(same) == 1.0 and repeated_tool_call(other) == 0.0
    # the history holds a JavaScript client's echo of the same call: 30.0 comes back as 30
    echoed = _tool_turn(
        [("exec", '{"cmd":"ls","timeoutSeconds":30}')], [("exec", '{"cmd": "ls", "timeoutSeconds": 30.0}')]
    )
    assert repeated_tool_call(echoed) == 1.0
    cut = _tool_turn([], [("calc", "{")], truncated=True, tool_parse_error=True)
    weights = {"tool_parse_error": 0.5, "truncated": 0.25, "repeated_tool_call": 1.0}
    assert shaping_terms(cut, weights) == {"tool_parse_error": -0.5, "truncated": -0.25, "repeated_tool_call": 0.0}
    with pytest.raises(ValueError, match="unknown shaping term"):
        shaping_terms(cut, {"verbosity": 1.0})


# ------------------------------------------------------------------------------------------ the ledger
def _ledger(mode, **kw):
    journal = []
    led = CreditLedger(mode, journal=lambda op, **f: journal.append((op, f)), **kw)
    return led, journal


def _judged(index, reward, version=0, vote=None, led=None, sc=None):
    """A judged turn's sample put in ``sc`` through ``led.wait`` (reward None: a pure OPD sample)."""
    t = turn("s", [{"role": "user", "content": "q"}], f"r{index}", version)
    t.turn_index = index
    sample = Sample.from_turn(t, reward=reward, kind="rl")
    return led.wait(sc, sample, vote), sample


def _release(led, sc, closed):
    emitted, held = [], []

    async def emit(sample):
        emitted.append((sample.turn_index, sample.reward))

    asyncio.run(led.release(sc, "s", closed, emit, lambda sample, vote: held.append((sample.turn_index, vote))))
    return emitted, held


def test_ledger_shape_adds_the_terms_and_keeps_the_vote_only_while_turns_wait():
    promote = lambda t, r: Sample.from_turn(t, reward=r, kind="rl")  # noqa: E731
    t = turn("s", [{"role": "user", "content": "q"}], "r")
    t.truncated = True
    plain, _ = _ledger("turn")
    assert plain.shape(t, None, 1 / 3, promote) == (None, 1 / 3)  # no terms: still held, no sample
    penal, _ = _ledger("turn", shaping={"truncated": 0.5, "tool_parse_error": 0.0})
    sample, held = penal.shape(t, None, 1 / 3, promote)  # a 0 score plus the penalty trains on -0.5
    assert (sample.reward, sample.info["shaping"], held) == (-0.5, {"truncated": -0.5}, None)
    sample, held = penal.shape(t, promote(t, 1.0), None, promote)
    assert (sample.reward, held) == (0.5, None)
    waits, _ = _ledger("discounted")
    sample, held = waits.shape(t, None, 1 / 3, promote)  # waits with reward 0, its vote beside it
    assert (sample.reward, held) == (0.0, 1 / 3)
    opd = Sample.from_turn(t, reward=None, kind="opd")
    assert waits.shape(t, opd, None, promote) == (opd, None)  # no reward: nothing to shape
    with pytest.raises(ValueError, match="credit mode"):
        CreditLedger("montecarlo")
    with pytest.raises(ValueError, match="unknown shaping term"):
        CreditLedger("turn", shaping={"verbosity": 1.0})


def test_ledger_release_at_the_close_hand_computed():
    led, journal = _ledger("discounted", gamma=0.5)
    sc = SessionCredit()
    assert _judged(3, 0.0, vote=0.5, led=led, sc=sc)[0]  # waits, out of order: released in turn order
    assert _judged(1, -1.0, led=led, sc=sc)[0]
    assert _judged(2, 0.0, led=led, sc=sc)[0]  # a 0 reward without a held vote
    waits, opd = _judged(4, None, led=led, sc=sc)
    assert not waits and opd.reward is None  # no reward: emitted at once by the tracker, never waits
    assert led.stats() == {"credit/turns_waiting": 3}
    emitted, held = _release(led, sc, closed=True)
    # rewards [-1, 0, 0] by turn, gamma 0.5: G = [-1, 0, 0]; turn 2 (no vote) is dropped, turn 3
    # (vote 0.5) goes back to the at-least-one rule
    assert emitted == [(1, -1.0)] and held == [(3, 0.5)]
    assert led.counts["dropped/zero_return"] == 1 and led.n_waiting == 0 and sc.waiting == []
    assert journal[-1][0] == "released" and journal[-1][1]["turn_indexes"] == [1, 2, 3]
    assert [(h["turn_index"], v) for h, v in journal[-1][1]["held"]] == [(3, 0.5)]


def test_ledger_flushes_a_segment_on_staleness_without_the_outcome():
    led, journal = _ledger("outcome", gamma=0.9, outcome_turn_weight=0.5, max_staleness=2)
    sc = SessionCredit()
    led.set_outcome(sc, "s", 2, 4)
    assert sc.outcome == 2.0 and journal == [("outcome", {"sid": "s", "value": 2.0, "last": 4})]
    _judged(1, 1.0, version=0, led=led, sc=sc)
    _judged(2, -1.0, version=0, led=led, sc=sc)
    emitted = []

    async def emit(sample):
        emitted.append((sample.turn_index, sample.reward, sample.info["turn_reward"]))

    assert led.served(0) and not led.served(0)
    asyncio.run(led.maybe_flush(sc, "s", emit, None))  # engines serve v0: v0 turns may still wait
    assert emitted == [] and led.n_waiting == 2
    assert led.served(1)
    asyncio.run(led.maybe_flush(sc, "s", emit, None))  # v1 served: the next update is the last chance
    # a segment has no outcome yet: R_t = 0.5 * r_t
    assert emitted == [(1, 0.5, 1.0), (2, -0.5, -1.0)] and led.counts["credit/forced_flushes"] == 1
    _judged(3, 1.0, version=1, led=led, sc=sc)
    assert _release(led, sc, closed=True)[0] == [(3, pytest.approx(0.5 + 2.0))]  # the outcome at the close
    led.session_closed(3)
    assert led.stats() == {"credit/turns_waiting": 0, "credit/mean_session_turns": 3.0, "credit/outcome_mean": 2.0}


# ------------------------------------------------------------------------------------------ the tracker
def session(sid, feedbacks, version=0):
    h = [{"role": "user", "content": "q"}]
    turns = [turn(sid, h, "r1", version)]
    for k, fb in enumerate(feedbacks, start=1):
        h = h + [{"role": "assistant", "content": f"r{k}"}, {"role": "user", "content": fb}]
        turns.append(turn(sid, h, f"r{k + 1}", version))
    return turns


def credit(mode, gamma=0.9, max_staleness=4, w=0.0, outcome_judge=False, **session):
    """The tracker's config: ``trainer.credit`` and its options, ``queue.max_staleness``, ``session.*``."""
    trainer = {"credit": mode, "gamma": gamma, "outcome_turn_weight": w, "outcome_judge": outcome_judge}
    return {"trainer": trainer, "queue": {"max_staleness": max_staleness}, "session": session}


def test_discounted_turns_wait_for_the_close_then_train_on_their_returns():
    judge, queue = FakeJudge({"meh": 0, "good": 1}), FakeQueue()
    tracker = SessionTracker([judge], queue, credit("discounted"))

    async def scenario():
        *turns, last = session("s", ["meh", "meh", "good"])
        for t in turns:
            await tracker.record_turn(t)
        await tracker.drain()
        waiting = await tracker.stats()
        await tracker.record_turn(last, done=True)
        await tracker.drain()
        await tracker.drain()
        return waiting, await tracker.stats()

    waiting, stats = asyncio.run(scenario())
    assert waiting["credit/turns_waiting"] == 2 and waiting.get("samples", 0) == 0
    assert [(s.turn_index, s.reward) for s, _ in queue.items] == [
        (1, pytest.approx(0.81)),
        (2, pytest.approx(0.9)),
        (3, 1.0),
    ]
    assert [s.info["turn_reward"] for s, _ in queue.items] == [0.0, 0.0, 1.0]
    assert stats["credit/turns_waiting"] == 0 and stats["credit/mean_session_turns"] == 4
    assert "dropped/zero_score" not in stats and "at_least_one_promoted" not in stats


def test_a_session_closed_by_the_idle_timeout_releases_its_returns():
    judge, queue = FakeJudge({"good": 1, "bad": -1}), FakeQueue()
    tracker = SessionTracker([judge], queue, credit("discounted", gamma=0.5, idle_timeout_s=10.0))

    async def scenario():
        for t in session("idle", ["bad", "good"]):  # 3 turns; the third has no next state
            await tracker.record_turn(t)
        await tracker.drain()
        before = len(queue.items)
        closed = await tracker.close_idle(now=time.monotonic() + 11)
        await tracker.drain()
        return before, closed, await tracker.stats()

    before, closed, stats = asyncio.run(scenario())
    assert before == 0 and closed == 1
    # rewards [-1, +1], gamma 0.5: G_1 = -1 + 0.5 = -0.5, G_2 = 1
    assert [(s.turn_index, s.reward) for s, _ in queue.items] == [(1, -0.5), (2, 1.0)]
    assert stats["sessions_idle_closed"] == 1 and stats["dropped/no_next_state"] == 1


def test_the_staleness_budget_flushes_waiting_turns_before_the_session_ends():
    judge, queue = FakeJudge({"meh": 0, "good": 1}), FakeQueue()
    tracker = SessionTracker([judge], queue, credit("discounted", max_staleness=2))

    async def scenario():
        t1, t2, t3 = session("long", ["meh", "good"], version=0)
        await tracker.record_turn(t1)
        await tracker.record_turn(t2)  # t1 judged "meh": waits (reward 0)
        await tracker.drain()
        assert (await tracker.stats())["credit/turns_waiting"] == 1
        # another session's turn shows the engines now serve v1: t1 (v0) must go with the next update
        await tracker.record_turn(turn("other", [{"role": "user", "content": "x"}], "y", version=1))
        flushed = [(s.turn_index, s.reward) for s, _ in queue.items]
        t3.policy_version = 1
        await tracker.record_turn(t3, done=True)  # t2 judged "good" at v0: flushed at once (v1 served)
        await tracker.drain()
        await tracker.drain()
        return flushed, await tracker.stats()

    flushed, stats = asyncio.run(scenario())
    # the first segment [t1] ends before the +1 arrived: its truncated return is 0 -> neutral, held
    # for the at-least-one rule, which a later trained turn makes unnecessary
    assert flushed == []
    assert [(s.turn_index, s.reward) for s, _ in queue.items] == [(2, 1.0)]
    assert stats["credit/forced_flushes"] == 2 and stats["dropped/zero_score"] == 1
    assert stats["credit/turns_waiting"] == 0


def test_the_flush_deadline_follows_the_learners_version_not_the_engines():
    """max_staleness 2. (a) The syncs fail: the engines still serve v3 while the learners reach v4,
    so the update producing v5 is the last to accept a v3 turn. Nothing was flushed (the engines'
    v3 said there was time) and the queue dropped the turn as stale. (b) The gate rejected canary v2:
    the learners are back at v1, so the v1 turn has two updates left, yet the canary's replies (v2)
    flushed it at once, without its session's outcome."""
    led, _ = _ledger("outcome", gamma=1.0, outcome_turn_weight=1.0, max_staleness=2)
    sc = SessionCredit()
    _judged(1, 1.0, version=3, led=led, sc=sc)
    emitted = []

    async def emit(sample):
        emitted.append((sample.turn_index, sample.policy_version))

    assert led.served(3) and led.learned(3)
    asyncio.run(led.maybe_flush(sc, "s", emit, None))
    assert emitted == []  # the learners at v3: the updates producing v4 and v5 may take it
    assert led.learned(4) and not led.learned(4)
    asyncio.run(led.maybe_flush(sc, "s", emit, None))
    assert emitted == [(1, 3)] and led.counts["credit/forced_flushes"] == 1

    led, _ = _ledger("outcome", gamma=1.0, outcome_turn_weight=1.0, max_staleness=2)
    sc = SessionCredit()
    _judged(1, 1.0, version=1, led=led, sc=sc)
    emitted.clear()
    assert led.served(2) and led.learned(2) and led.learned(1)  # canary v2 served, then rejected
    asyncio.run(led.maybe_flush(sc, "s", emit, None))
    assert emitted == [] and led.n_waiting == 1


def test_an_interrupted_reply_shows_the_staleness_budget_the_version_of_its_newest_token():
    """A reply a weight sync interrupted carries tokens of v0 and v1 (its ``policy_version`` is the
    oldest, 0): the engines serve v1, so a turn of v0 waiting under max_staleness 2 must be flushed
    now. The budget read the oldest version and flushed nothing until a reply made wholly by v1."""
    judge, queue = FakeJudge({"good": 1}), FakeQueue()
    tracker = SessionTracker([judge], queue, credit("discounted", max_staleness=2))

    async def scenario():
        t1, t2 = session("long", ["good"], version=0)
        await tracker.record_turn(t1)
        await tracker.record_turn(t2)  # t1 judged +1 at v0: waits for the close
        await tracker.drain()
        waiting = (await tracker.stats())["credit/turns_waiting"]
        other = turn("other", [{"role": "user", "content": "x"}], "y", version=0)
        other.token_versions = [0, 1]  # interrupted by the sync to v1, resumed on it
        await tracker.record_turn(other)
        await tracker.drain()
        return waiting, await tracker.stats()

    waiting, stats = asyncio.run(scenario())
    assert waiting == 1 and stats["credit/forced_flushes"] == 1 and stats["credit/turns_waiting"] == 0
    assert [(s.turn_index, s.reward) for s, _ in queue.items] == [(1, 1.0)]


def test_outcome_header_spreads_over_the_session():
    judge, queue = FakeJudge({"meh": 0, "good": 1, "bad": -1}), FakeQueue()
    tracker = SessionTracker([judge], queue, credit("outcome", gamma=0.9, w=1.0))

    async def scenario():
        *turns, last = session("o", ["good", "meh", "bad"])
        for t in turns:
            await tracker.record_turn(t)
        await tracker.record_turn(last, done=True, outcome=1.0)
        await tracker.drain()
        await tracker.drain()
        return await tracker.stats()

    stats = asyncio.run(scenario())
    # R_t = 1 * r_t + 0.9^(3 - t) * 1 with r = [1, 0, -1]: [1.81, 0.9, 0.0]; the 0 return of turn 3 (a
    # scored turn) is dropped as zero_return
    assert [(s.turn_index, s.reward) for s, _ in queue.items] == [(1, pytest.approx(1.81)), (2, pytest.approx(0.9))]
    assert [s.info["outcome"] for s, _ in queue.items] == [1.0, 1.0]
    assert stats["dropped/zero_return"] == 1 and stats["credit/outcome_mean"] == 1.0


def test_shaping_penalises_a_truncated_reply_in_turn_mode():
    judge, queue = FakeJudge({"meh": 0, "good": 1}), FakeQueue()
    tracker = SessionTracker([judge], queue, {"trainer": {"shaping": {"truncated": 0.5, "tool_parse_error": 0.0}}})

    async def scenario():
        t1, t2, t3 = session("sh", ["good", "meh"])
        t1.truncated = t2.truncated = True
        for t in (t1, t2, t3):
            await tracker.record_turn(t)
        await tracker.drain()
        return await tracker.stats()

    asyncio.run(scenario())
    # t1: +1 - 0.5; t2: a 0 score plus the penalty trains on -0.5 (no longer neutral)
    assert [(s.turn_index, s.reward, s.info["shaping"]) for s, _ in queue.items] == [
        (1, 0.5, {"truncated": -0.5}),
        (2, -0.5, {"truncated": -0.5}),
    ]


def test_waiting_turns_survive_a_tracker_restart(tmp_path):
    from clawray.journal import prepare_journals

    path = prepare_journals(str(tmp_path), None)["sessions"]
    judge = FakeJudge({"meh": 0, "good": 1})
    t1, t2, t3, t4 = session("j", ["meh", "good", "good"])

    async def first():
        tracker = SessionTracker([judge], FakeQueue(), credit("discounted"), journal={"path": path})
        for t in (t1, t2, t3):
            await tracker.record_turn(t)
        await tracker.drain()
        return (await tracker.stats())["credit/turns_waiting"]

    async def second(queue):
        tracker = SessionTracker([judge], queue, credit("discounted"), journal={"path": path})
        restored = (await tracker.stats())["credit/turns_waiting"]
        await tracker.record_turn(t4, done=True)
        await tracker.drain()
        await tracker.drain()
        return restored

    assert asyncio.run(first()) == 2  # the process dies with t1, t2 waiting
    queue = FakeQueue()
    assert asyncio.run(second(queue)) == 2
    # rewards [0, 1, 1], gamma 0.9: [0.9 + 0.81, 1.9, 1]
    assert [(s.turn_index, s.reward) for s, _ in queue.items] == [
        (1, pytest.approx(1.71)),
        (2, pytest.approx(1.9)),
        (3, 1.0),
    ]


# ------------------------------------------------------------------------------------------ the outcome judge
from clawray.actors.judge import (  # noqa: E402
    JudgeWorker,
    build_session_messages,
    render_session,
    session_feedback_score,
)
from test_session import _Remote  # noqa: E402

RIGHT, WRONG = "Correct, thanks!", "That's wrong, try again."


def session_judge(answers):
    """A real JudgeWorker (openai backend, m = len(answers)) whose calls answer ``answers`` in order
    (an Exception instance raises); the turn judge is the FakeJudge's table."""
    worker = JudgeWorker({"backend": "openai", "base_url": "http://127.0.0.1:9/v1", "model": "j", "m": len(answers)})
    calls = iter(answers)

    async def ask_once(messages, seed_key):
        worker.prompts.append(messages)
        a = next(calls)
        if isinstance(a, Exception):
            raise a
        return a

    worker.prompts, worker._ask_once = [], ask_once
    fake = FakeJudge({RIGHT: 1, WRONG: -1, "meh": 0})
    fake.judge_session = _Remote(worker.judge_session)
    fake.worker = worker
    return fake


def run_session(tracker, sid, feedbacks, close="done", outcome=None, version=0):
    """Record a session whose user answered ``feedbacks`` to the first replies, close it (``done`` on
    the last request, or ``idle``), wait for the judges; returns the tracker's stats."""

    async def scenario():
        turns = session(sid, feedbacks, version)
        for t in turns[:-1]:
            await tracker.record_turn(t)
        await tracker.record_turn(turns[-1], done=close == "done", outcome=outcome)
        if close == "idle":
            await tracker.drain()
            assert await tracker.close_idle(now=time.monotonic() + 11) == 1
        for _ in range(3):
            await tracker.drain()
        return await tracker.stats()

    return asyncio.run(scenario())


def test_the_outcome_judge_scores_the_whole_session_once_and_spreads_it():
    judge, queue = session_judge(["So it worked. \\boxed{1}", "no verdict here", "\\boxed{1}"]), FakeQueue()
    tracker = SessionTracker([judge], queue, credit("outcome", gamma=0.9, outcome_judge=True))
    stats = run_session(tracker, "oj", [RIGHT, "meh", WRONG])
    # turn scores r = [1, 0, -1] (the fallback O would be -1); the judge's votes [1, invalid, 1] -> O = 1,
    # spread gamma^(3-t): [0.81, 0.9, 1.0] (outcome_turn_weight 0)
    assert [(s.turn_index, s.reward) for s, _ in queue.items] == [
        (1, pytest.approx(0.81)),
        (2, pytest.approx(0.9)),
        (3, 1.0),
    ]
    assert [s.info["outcome"] for s, _ in queue.items] == [1.0, 1.0, 1.0]
    assert len(judge.worker.prompts) == 3  # m = 3 votes, one judgement
    assert judge.worker.stats["sessions"] == 1 and judge.worker.stats["session_invalid_votes"] == 1
    transcript = judge.worker.prompts[0][1]["content"]
    # the whole session: the task, every reply and feedback, the closing reply
    assert transcript.startswith("## Conversation\n[user] q\n[assistant] r1\n[user] " + RIGHT)
    assert f"[user] {WRONG}\n[assistant] r4\n" in transcript
    assert stats["credit/outcome_judged"] == 1 and stats["credit/outcome_mean"] == 1.0


def test_malformed_or_failed_outcome_judge_falls_back_to_the_last_turn_score():
    bad = session_judge(["\\boxed{2}", "\\boxed{1} and then \\boxed{yes}"])  # both invalid votes
    q1 = FakeQueue()
    t1 = SessionTracker([bad], q1, credit("outcome", gamma=0.5, outcome_judge=True))
    stats = run_session(t1, "bad", [WRONG, RIGHT])
    # no valid vote: no outcome; O = the last judged turn's score r_2 = 1, spread [0.5, 1]
    assert [(s.turn_index, s.reward) for s, _ in q1.items] == [(1, 0.5), (2, 1.0)]
    assert stats["credit/outcome_unscored"] == 1 and "credit/outcome_judged" not in stats
    assert bad.worker.stats["session_invalid_votes"] == 2
    dead = session_judge([RuntimeError("judge down")])
    dead.worker.cfg.retries = 0
    q2 = FakeQueue()
    t2 = SessionTracker([dead], q2, credit("outcome", gamma=0.5, outcome_judge=True))
    run_session(t2, "dead", [WRONG, RIGHT])
    assert [(s.turn_index, s.reward) for s, _ in q2.items] == [(1, 0.5), (2, 1.0)]
    assert dead.worker.stats["failed_calls"] == 1 and dead.worker.stats["session_invalid_votes"] == 1

    class Broken:  # the judge actor itself fails: counted, the tracker lives on
        judge = FakeJudge({RIGHT: 1, WRONG: -1}).judge

        class judge_session:
            @staticmethod
            async def remote(*args):
                raise RuntimeError("actor died")

    q3 = FakeQueue()
    t3 = SessionTracker([Broken()], q3, credit("outcome", gamma=0.5, outcome_judge=True))
    stats = run_session(t3, "broken", [WRONG, RIGHT])
    assert [(s.turn_index, s.reward) for s, _ in q3.items] == [(1, 0.5), (2, 1.0)]
    assert stats["credit/outcome_judge_errors"] == 1


def test_an_explicit_outcome_wins_and_an_idle_close_is_judged():
    judge, queue = session_judge(["\\boxed{-1}"]), FakeQueue()
    tracker = SessionTracker([judge], queue, credit("outcome", gamma=0.9, outcome_judge=True))
    run_session(tracker, "explicit", [RIGHT, RIGHT], outcome=1.0)
    assert judge.worker.prompts == []  # X-Session-Outcome given: the judge is not asked
    assert [s.reward for s, _ in queue.items] == [pytest.approx(0.9), 1.0]
    # the feedback backend on an idle-closed session: its last user message is the user's verdict
    fb = FakeJudge({RIGHT: 1, WRONG: -1})
    fb.judge_session = _Remote(JudgeWorker({"backend": "feedback"}).judge_session)
    q2 = FakeQueue()
    t2 = SessionTracker([fb], q2, credit("discounted", gamma=0.5, outcome_judge=True, idle_timeout_s=10.0))
    stats = run_session(t2, "idle", [RIGHT, WRONG], close="idle")
    # r = [1, -1]; the judged outcome -1 (the last user message: WRONG) is a terminal reward on turn 2:
    # G_2 = -1 - 1 = -2, G_1 = 1 + 0.5 * -2 = 0 (a zero return of a scored turn: dropped)
    assert [(s.turn_index, s.reward) for s, _ in q2.items] == [(2, -2.0)]
    assert stats["sessions_idle_closed"] == 1 and stats["credit/outcome_judged"] == 1
    assert stats["dropped/zero_return"] == 1


def test_the_outcome_judge_only_credits_the_segment_still_waiting_at_the_close():
    judge, queue = session_judge(["\\boxed{-1}"]), FakeQueue()
    tracker = SessionTracker([judge], queue, credit("outcome", gamma=0.9, max_staleness=2, w=1.0, outcome_judge=True))

    async def scenario():
        t1, t2, t3 = session("st", [RIGHT, RIGHT], version=0)
        await tracker.record_turn(t1)
        await tracker.record_turn(t2)
        await tracker.drain()  # t1 judged +1: waits
        await tracker.record_turn(turn("other", [{"role": "user", "content": "x"}], "y", version=1))
        flushed = [(s.turn_index, s.reward) for s, _ in queue.items]  # v1 served: t1 flushed, no outcome
        t3.policy_version = 1
        await tracker.record_turn(t3, done=True)
        for _ in range(3):
            await tracker.drain()
        return flushed

    flushed = asyncio.run(scenario())
    # t1's segment: w * r_1 = 1 (no outcome); t2 (judged +1 at v0, flushed at once as v1 is served);
    # nothing waits at the close -> the judge is never asked
    assert flushed == [(1, 1.0)]
    assert [(s.turn_index, s.reward) for s, _ in queue.items] == [(1, 1.0), (2, 1.0)]
    assert judge.worker.prompts == []


def test_the_judged_outcome_survives_a_tracker_restart_between_close_and_release(tmp_path):
    from clawray.journal import prepare_journals

    path = prepare_journals(str(tmp_path), None)["sessions"]
    cfg = credit("outcome", gamma=0.9, outcome_judge=True)

    async def first():
        hang = FakeJudge({RIGHT: 1, WRONG: -1})
        hang.judge_session = _Remote(lambda *a: asyncio.sleep(3600))  # dies before the judge answers
        tracker = SessionTracker([hang], FakeQueue(), cfg, journal={"path": path})
        turns = session("r", [WRONG, WRONG])
        for t in turns[:-1]:
            await tracker.record_turn(t)
        await tracker.record_turn(turns[-1], done=True)
        await tracker.drain(timeout_s=0.5)
        return (await tracker.stats())["credit/turns_waiting"]

    assert asyncio.run(first()) == 2
    judge, queue = session_judge(["\\boxed{1}"]), FakeQueue()

    async def second():
        tracker = SessionTracker([judge], queue, cfg, journal={"path": path})
        for _ in range(3):
            await tracker.drain()

    asyncio.run(second())
    assert "[user] q\n[assistant] r1\n[user] " + WRONG in judge.worker.prompts[0][1]["content"]
    assert [(s.turn_index, s.reward) for s, _ in queue.items] == [(1, pytest.approx(0.9)), (2, 1.0)]


def test_session_transcript_rendering_and_feedback_score():
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "task"}]
    msgs += [{"role": "assistant", "content": "a" * 50}, {"role": "user", "content": "b" * 50}] * 4
    full = render_session(msgs)
    assert full.count("\n") == 9 and full.startswith("[system] s\n[user] task\n[assistant] ")
    short = render_session(msgs, max_chars=150)
    # the opening (2 lines, 22 chars), then the last lines that fit in the 128 left: two of 60 + 1
    assert short.split("\n") == ["[system] s", "[user] task", "[... 6 messages omitted ...]"] + [
        "[assistant] " + "a" * 50,
        "[user] " + "b" * 50,
    ]
    assert build_session_messages(msgs)[1]["content"].endswith("\\boxed{1}, \\boxed{-1} or \\boxed{0}.")
    assert session_feedback_score([*msgs[:2], {"role": "user", "content": RIGHT}, {"role": "assistant"}]) == 1
    assert session_feedback_score([{"role": "user", "content": "Let's stop here."}]) is None
    assert session_feedback_score([{"role": "tool", "content": "Traceback: boom"}]) == -1
    assert session_feedback_score([{"role": "assistant", "content": "hi"}]) is None


def test_ledger_defaults_are_the_schema_defaults():
    """The ledger's keyword defaults equal their config fields' (algos/ cannot import the schema)."""
    import inspect

    from clawray.config import QueueConfig, TrainerConfig

    params = inspect.signature(CreditLedger).parameters
    trainer = TrainerConfig()
    assert params["mode"].default == trainer.credit
    assert params["gamma"].default == trainer.gamma == 0.9
    assert params["outcome_turn_weight"].default == trainer.outcome_turn_weight
    assert params["outcome_judge"].default == trainer.outcome_judge
    assert params["max_staleness"].default == QueueConfig().max_staleness


def test_an_unscored_combine_sample_keeps_its_teacher_and_takes_credit_only_from_shaping_or_its_return():
    """Combine's hint without a score was emitted with reward 0.0: GRPO and the baseline then trained its
    reward term on ``0 - mean`` (an absent verdict read as a neutral reward) and dynamic sampling
    rejected it as a zero-variance group, losing its teacher term. It has reward None now, and the
    ledger gives it a reward only from shaping or its session's return, never replacing the sample."""
    from clawray.algos.advantages import batch_advantages
    from clawray.algos.invariants import DegenerateBatchGuard
    from clawray.algos.rejection import zero_variance

    import math

    promote = lambda t, r: Sample.from_turn(t, reward=r, kind="rl")  # noqa: E731
    t = turn("s", [{"role": "user", "content": "q"}], "r")
    t.truncated = True

    def unscored():
        s = Sample.from_turn(t, reward=None, kind="combine", hint="h", unscored=True)
        s.teacher_logprobs = [-0.5] * s.response_len
        return s

    plain, _ = _ledger("turn")
    s = unscored()
    assert plain.shape(t, s, None, promote) == (s, None) and s.reward is None
    penal, _ = _ledger("turn", shaping={"truncated": 0.5})
    s = unscored()
    got, held = penal.shape(t, s, None, promote)  # the same sample, teacher kept, reward = the penalty
    assert (got is s, got.reward, got.teacher_logprobs, held) == (True, -0.5, [-0.5] * s.response_len, None)
    waits, _ = _ledger("discounted")
    s = unscored()
    got, _ = waits.shape(t, s, None, promote)  # waits for its return with reward 0, like a held turn
    assert (got is s, got.reward) == (True, 0.0)
    # without a reward: advantage 0 under every estimator, the others' untouched, never rejected
    rewards = [1.0, None, -1.0, 1.0]
    for estimator in ("binary", "baseline", "grpo"):
        out = batch_advantages(rewards, DegenerateBatchGuard(), estimator, group_keys=[0, 0, 0, 0])
        assert out.advantages[1] == 0.0 and out.rewarded == [0, 2, 3], estimator
    grpo = batch_advantages(rewards, DegenerateBatchGuard(), "grpo", group_keys=[0, 0, 0, 0]).advantages
    mean, std = 1 / 3, math.sqrt(8 / 9)  # the three scored rewards alone
    assert grpo == pytest.approx([(1 - mean) / std, 0.0, (-1 - mean) / std, (1 - mean) / std], rel=1e-6)
    assert zero_variance(["a", "b"], [1.0, None]) == [0]


def test_the_tracker_flushes_waiting_turns_when_the_driver_tells_it_the_learners_version():
    judge, queue = FakeJudge({"good": 1}), FakeQueue()
    tracker = SessionTracker([judge], queue, credit("discounted", max_staleness=2))

    async def scenario():
        t1, t2 = session("long", ["good"], version=0)
        await tracker.record_turn(t1)
        await tracker.record_turn(t2)  # t1 judged +1 at v0: waits for the close
        await tracker.drain()
        await tracker.learned(0)
        before = [(s.turn_index, s.reward) for s, _ in queue.items]
        await tracker.learned(1)  # the update producing v2 is the last to take a v0 turn
        return before, await tracker.stats()

    before, stats = asyncio.run(scenario())
    assert before == [] and stats["credit/forced_flushes"] == 1 and stats["credit/turns_waiting"] == 0
    assert [(s.turn_index, s.reward) for s, _ in queue.items] == [(1, 1.0)]


def test_outcome_credit_that_could_never_wait_for_its_outcome_is_refused_at_load():
    """With queue.max_staleness=1 every judged turn is flushed before its session's outcome, with the
    return outcome_turn_weight x r_t: 0 at the default weight, so every turn was dropped as
    dropped/zero_return and the outcome thrown away."""
    from clawray.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=r"queue.max_staleness >= 2"):
        load_config([], ["trainer.credit=outcome", "queue.max_staleness=1"])
    assert load_config([], ["trainer.credit=outcome", "queue.max_staleness=2"]).queue.max_staleness == 2
    weighted = ["trainer.credit=outcome", "queue.max_staleness=1", "trainer.outcome_turn_weight=0.5"]
    assert load_config([], weighted).trainer.outcome_turn_weight == 0.5  # a flushed turn trains on 0.5 r_t
    assert load_config([], ["trainer.credit=discounted", "queue.max_staleness=1"]).trainer.credit == "discounted"


def test_an_outcome_sent_on_a_side_request_counts_for_the_open_session():
    """``X-Session-Outcome`` on a side request (a title, a summary: no turn recorded) was dropped unless
    the request also closed the session; the outcome may come on any request, the last one counts."""
    judge, queue = session_judge(["\\boxed{-1}"]), FakeQueue()
    tracker = SessionTracker([judge], queue, credit("outcome", gamma=0.9, outcome_judge=True))

    async def scenario():
        turns = session("side", [RIGHT, RIGHT])
        for t in turns[:-1]:
            await tracker.record_turn(t)
        await tracker.set_outcome("side", 1.0)  # the server's path for a side request with an outcome
        await tracker.set_outcome("no-such-session", 1.0)  # nothing open: nothing happens
        await tracker.record_turn(turns[-1], done=True)
        for _ in range(3):
            await tracker.drain()

    asyncio.run(scenario())
    assert judge.worker.prompts == []  # the outcome was given: the judge is not asked
    assert [s.reward for s, _ in queue.items] == [pytest.approx(0.9), 1.0]
