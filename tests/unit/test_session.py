import asyncio

import pytest

from clawray.actors import session as session_mod
from clawray.actors.judge import JudgeResult
from clawray.actors.session import SessionTracker
from clawray.types import SampleMeta
from conftest import make_turn as turn


class _Remote:
    def __init__(self, fn):
        self.fn = fn

    def remote(self, *args):
        return self.fn(*args)


class FakeJudge:
    """Scores by a table keyed on the next state's text; None = all votes invalid."""

    def __init__(self, table):
        async def judge(turn, next_state):
            self.seen.append((turn.turn_index, next_state))
            score = table[next_state[-1]["content"]]
            if score is None:
                return JudgeResult(0, [None, None], counts={"valid": 0, "invalid": 2, "tie": 0})
            if score == 0:  # a 0 majority whose votes lean positive
                return JudgeResult(0, [0, 0, 1], counts={"valid": 3, "invalid": 0, "tie": 0})
            return JudgeResult(score, [score], raw=[f"\\boxed{{{score}}}"], counts={"valid": 1, "invalid": 0, "tie": 0})

        self.seen = []
        self.judge = _Remote(judge)


class FakeQueue:
    def __init__(self):
        async def put(refs, meta):
            assert meta == SampleMeta.of(refs[0])  # the metadata the driver reads matches the payload
            self.items.append((refs[0], meta.policy_version))

        self.items = []
        self.put = _Remote(put)


@pytest.fixture(autouse=True)
def no_object_store(monkeypatch):
    monkeypatch.setattr(session_mod.ray, "put", lambda x: x)


def test_pairs_next_state_and_emits_samples_in_order():
    judge, queue = FakeJudge({"good": 1, "bad": -1, "meh": 0, "???": None}), FakeQueue()
    tracker = SessionTracker([judge], queue)

    async def scenario():
        h = [{"role": "user", "content": "q"}]
        assert await tracker.record_turn(turn("s", h, "r1", version=0)) == 1
        h2 = h + [
            {"role": "assistant", "content": "r1"},
            {"role": "tool", "content": "t1"},
            {"role": "user", "content": "bad"},
        ]
        assert await tracker.record_turn(turn("s", h2, "r2", version=1)) == 2
        h3 = h2 + [{"role": "assistant", "content": "r2"}, {"role": "user", "content": "good"}]
        assert await tracker.record_turn(turn("s", h3, "r3", version=1), done=True) == 3
        await tracker.drain()
        return await tracker.stats()

    stats = asyncio.run(scenario())
    # turn 1's next state is everything after its reply: the tool result and the user message together
    assert judge.seen[0] == (1, [{"role": "tool", "content": "t1"}, {"role": "user", "content": "bad"}])
    assert judge.seen[1] == (2, [{"role": "user", "content": "good"}])
    rewards = [(s.turn_index, s.reward, s.policy_version) for s, _ in queue.items]
    assert rewards == [(1, -1.0, 0), (2, 1.0, 1)]
    first = queue.items[0][0]
    assert first.tokens == [1, 2, 3, 7, 8] and first.prompt_len == 3 and first.loss_mask == [1, 1]
    assert first.rollout_logprobs == [-0.5, -0.25]
    assert stats["samples"] == 2 and stats["dropped/no_next_state"] == 1 and stats["open_sessions"] == 0


def conversation(session, feedbacks):
    """Turns r1, r2, ...: turn k+1's history holds every earlier reply, each followed by its feedback."""
    h = [{"role": "user", "content": "q"}]
    turns = [turn(session, h, "r1")]
    for k, fb in enumerate(feedbacks, start=1):
        h = h + [{"role": "assistant", "content": f"r{k}"}, {"role": "user", "content": fb}]
        turns.append(turn(session, h, f"r{k + 1}"))
    return turns


def test_zero_scores_at_least_one_unscored_and_branch():
    judge, queue = FakeJudge({"meh": 0, "meh2": 0, "???": None}), FakeQueue()
    tracker = SessionTracker([judge], queue, at_least_one=True)

    async def scenario():
        turns = conversation("a", ["meh", "meh2", "???"])
        for t in turns:
            await tracker.record_turn(t)
        # the client edited the history: the reply we served is not there -> branch, not mis-paired
        h5 = turns[-1].messages + [
            {"role": "assistant", "content": "something else"},
            {"role": "user", "content": "meh"},
        ]
        await tracker.record_turn(turn("a", h5, "r5"))
        await tracker.drain()
        held = len(queue.items)
        await tracker.close_session("a")
        await tracker.drain()
        return held, await tracker.stats()

    held, stats = asyncio.run(scenario())
    assert held == 0  # 0-scored turns wait for the session's end
    # at close: the best-signed 0-scored turn (mean vote 1/3; the first of two equals) is promoted
    # with its mean vote as reward; the other 0 is dropped; all-invalid is unscored
    assert [(s.turn_index, s.reward) for s, _ in queue.items] == [(1, pytest.approx(1 / 3))]
    assert stats["at_least_one_promoted"] == 1
    assert stats["dropped/zero_score"] == 1
    assert stats["dropped/unscored"] == 1
    assert stats["dropped/branch"] == 1
    assert stats["dropped/no_next_state"] == 1 and stats["open_sessions"] == 0


def test_session_with_a_scored_turn_promotes_nothing():
    judge, queue = FakeJudge({"meh": 0, "good": 1}), FakeQueue()
    tracker = SessionTracker([judge], queue, at_least_one=True)

    async def scenario():
        *first, last = conversation("b", ["meh", "good"])
        for t in first:
            await tracker.record_turn(t)
        await tracker.record_turn(last, done=True)
        await tracker.drain()
        await tracker.drain()
        return await tracker.stats()

    stats = asyncio.run(scenario())
    assert [(s.turn_index, s.reward) for s, _ in queue.items] == [(2, 1.0)]
    assert stats["dropped/zero_score"] == 1 and "at_least_one_promoted" not in stats


def test_idle_sessions_close_and_free_memory():
    import time

    judge, queue = FakeJudge({"good": 1}), FakeQueue()
    tracker = SessionTracker([judge], queue, {"session": {"idle_timeout_s": 10.0}})

    async def scenario():
        h = [{"role": "user", "content": "q"}]
        await tracker.record_turn(turn("idle", h, "r1"))
        await tracker.record_turn(turn("busy", h, "r1"))
        tracker.book.sessions["busy"].last_seen = time.monotonic() + 8  # seen recently
        closed = await tracker.close_idle(now=time.monotonic() + 11)
        await tracker.drain()
        return closed, await tracker.stats()

    closed, stats = asyncio.run(scenario())
    assert closed == 1 and stats["sessions_idle_closed"] == 1 and stats["open_sessions"] == 1
    assert stats["dropped/no_next_state"] == 1 and "idle" not in tracker.book.sessions


def test_a_closed_session_id_used_again_continues_its_turn_indexes():
    judge, queue = FakeJudge({"good": 1}), FakeQueue()
    tracker = SessionTracker([judge], queue)

    async def scenario():
        h = [{"role": "user", "content": "q"}]
        assert await tracker.record_turn(turn("re", h, "r1")) == 1
        assert (
            await tracker.record_turn(
                turn("re", h + [{"role": "assistant", "content": "r1"}, {"role": "user", "content": "good"}], "r2"),
                done=True,
            )
            == 2
        )
        assert await tracker.record_turn(turn("re", h, "again")) == 3  # not 1 again
        await tracker.drain()
        return await tracker.stats()

    stats = asyncio.run(scenario())
    assert stats["sessions_closed"] == 1 and stats["open_sessions"] == 1 and stats["turns"] == 3


def test_judges_take_turns_round_robin_a_dead_one_loses_only_its_turn_and_votes_are_recorded(tmp_path):
    import json

    class DeadJudge:
        def __init__(self):
            async def judge(turn, next_state):
                self.seen.append(turn.turn_index)
                raise RuntimeError("judge actor died")

            self.seen = []
            self.judge = _Remote(judge)

    live = FakeJudge({"good": 1, "bad": -1, "fine": 1, "nope": -1})
    dead, queue = DeadJudge(), FakeQueue()
    tracker = SessionTracker([live, dead], queue, records_dir=str(tmp_path))

    async def scenario():
        for t in conversation("s", ["good", "bad", "fine", "nope"]):
            await tracker.record_turn(t)
        await tracker.drain()
        return await tracker.stats()

    stats = asyncio.run(scenario())
    assert [i for i, _ in live.seen] == [1, 3] and dead.seen == [2, 4]  # J = 2 judges alternate
    assert [(s.turn_index, s.reward) for s, _ in queue.items] == [(1, 1.0), (3, 1.0)]
    assert stats["dropped/judge_error"] == 2 and stats["judged"] == 2 and stats["samples"] == 2
    rows = {r["turn"]: r for r in map(json.loads, open(tmp_path / "judgments.jsonl"))}
    assert (rows[1]["score"], rows[1]["votes"], rows[1]["raw_votes"]) == (1, [1], ["\\boxed{1}"])
    assert rows[2]["dropped"].startswith("judge error: RuntimeError('judge actor died')")
    assert rows[2]["votes"] is None and rows[2]["next_state"] == [{"role": "user", "content": "bad"}]
