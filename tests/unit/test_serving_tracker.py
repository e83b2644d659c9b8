"""The plain-serving tracker (clawray.serving.ServingTracker): it reads its typed config sections, and
``session.idle_timeout_s = 0`` means never (it used to close every session at its next request)."""

from __future__ import annotations

import asyncio
import time

from conftest import make_turn

from clawray.serving import ServingTracker

Q = [{"role": "user", "content": "q"}]


def _two_sessions(tracker: ServingTracker, later_s: float) -> dict:
    async def go():
        await tracker.record_turns([make_turn("a", Q, "r")])
        tracker.book.sessions["a"].last_seen = time.monotonic() - later_s  # "a" has been quiet this long
        await tracker.record_turns([make_turn("b", Q, "r")])
        return await tracker.stats()

    return asyncio.run(go())


def test_idle_timeout_zero_never_closes_and_a_positive_one_does(tmp_path):
    never = _two_sessions(ServingTracker({"session": {"idle_timeout_s": 0.0}}), later_s=3600.0)
    assert (never["sessions_idle_closed"], never["open_sessions"], never["turns"]) == (0, 2, 2)
    tracker = ServingTracker({"session": {"idle_timeout_s": 60.0}, "records": {"keep_files": 2}}, str(tmp_path))
    closed = _two_sessions(tracker, later_s=61.0)
    assert (closed["sessions_idle_closed"], closed["open_sessions"], closed["turns"]) == (1, 1, 2)
    assert tracker.records.served.keep_files == 2 and (tmp_path / "turns.jsonl").read_text().count("\n") == 2
    default = ServingTracker()  # the schema's default: 900 s
    assert default.idle_timeout_s == 900.0 and default.records.served is None


def test_a_conversation_back_after_the_idle_timeout_is_found_among_the_closed_sessions():
    """``clawray serve`` closed an idle session without remembering its keys (``SessionTracker`` did):
    a conversation without a session id that went quiet past ``idle_timeout_s`` matched nothing when
    it came back, and every later request of it was unattributable (never recorded)."""
    from clawray.chat import attribution_keys

    tracker = ServingTracker({"session": {"idle_timeout_s": 60.0}})
    first = [{"role": "user", "content": "conversation A"}]

    async def go():
        await tracker.record_turns([make_turn("auto-a", first, "reply A")])
        tracker.book.sessions["auto-a"].last_seen = time.monotonic() - 61.0
        await tracker.record_turns([make_turn("auto-b", Q, "r")])  # closes auto-a for silence

    asyncio.run(go())
    assert "auto-a" not in tracker.book.sessions and tracker.counts["sessions_idle_closed"] == 1
    back = [*first, {"role": "assistant", "content": "reply A"}, {"role": "user", "content": "and then?"}]
    found = tracker.book.find(None, {1: attribution_keys(back)[1]}, None, True)
    assert found["session_id"] == "auto-a"
