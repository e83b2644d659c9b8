"""Counters of restarted actors are re-based, never reset (recovery.RestartCounters)."""

from clawray.recovery import ENGINE_COUNTERS, RestartCounters


def test_engine_tokens_continue_across_two_restarts_and_other_fields_pass_through():
    c = RestartCounters()
    seen = [
        c.rebase("rollout-0", {"name": "rollout-0", "tokens": t, "errors": e, "version": v}, ENGINE_COUNTERS)
        for t, e, v in [(100, 1, 3), (250, 1, 4), (30, 0, 0), (40, 2, 4), (5, 0, 0)]
    ]
    assert [s["tokens"] for s in seen] == [100, 250, 280, 290, 295]  # restarts after 250 and after 40
    assert [s["errors"] for s in seen] == [1, 1, 1, 3, 3]
    assert [s["version"] for s in seen] == [3, 4, 0, 4, 0]  # not a counter: as reported
    # per actor: another engine's counts are its own
    assert c.rebase("rollout-1", {"tokens": 7}, ENGINE_COUNTERS)["tokens"] == 7


def test_judge_counters_all_keys():
    c = RestartCounters()
    c.rebase("judge-0", {"turns": 10, "votes": 30}, ("turns", "votes"))
    assert c.rebase("judge-0", {"turns": 2, "votes": 6}, ("turns", "votes")) == {"turns": 12, "votes": 36}
