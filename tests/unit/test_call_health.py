"""A slow or failing judge/teacher model is named, with the reason (issue #24.6): CallHealth's rules on a
fake clock, and a JudgeWorker whose model is scripted (answers held by the test, failures, timeouts)."""

import asyncio

from clawray.actors.call_health import CallHealth
from clawray.actors.judge import JudgeWorker
from clawray.types import Turn


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def test_slow_when_the_oldest_work_outlasts_its_bound_and_ok_once_it_drains():
    clock = Clock()
    h = CallHealth("judgements", slow_after_s=10, clock=clock)
    assert h.report() == {"state": "ok", "reason": None, "waiting": 0, "oldest_s": 0.0, "calls": 0, "failed": 0}
    first = h.work()
    first.__enter__()
    clock.t += 4
    with h.work():
        clock.t += 6.5  # the first has waited 10.5 s, the second 6.5 s
        assert h.report() == {
            "state": "slow",
            "reason": "2 judgements waiting, the oldest for 10 s (slow after 10 s)",
            "waiting": 2,
            "oldest_s": 10.5,
            "calls": 0,
            "failed": 0,
        }
        first.__exit__(None, None, None)
        assert h.report()["state"] == "ok" and h.report()["oldest_s"] == 6.5  # the second is within its bound
    assert h.report()["waiting"] == 0


def test_failing_after_three_failed_calls_in_a_row_and_ok_after_one_answer_or_when_they_age_out():
    clock = Clock()
    h = CallHealth("judgements", slow_after_s=10, window_s=60, clock=clock)
    h.call_ended()
    h.call_ended("TimeoutError after 5 s")
    h.call_ended("TimeoutError after 5 s")
    assert h.report()["state"] == "ok"  # two failures in a row are not yet failing
    h.call_ended("APIConnectionError")
    assert h.report() == {
        "state": "failing",
        "reason": "3 of the last 4 calls in 60 s failed (last: APIConnectionError)",
        "waiting": 0,
        "oldest_s": 0.0,
        "calls": 4,
        "failed": 3,
    }
    h.call_ended()  # the model answers again
    assert h.report()["state"] == "ok"
    for _ in range(3):
        h.call_ended("TimeoutError after 5 s")
    assert h.report()["state"] == "failing"
    clock.t += 61  # no call since: the failures leave the window
    assert h.report() == {"state": "ok", "reason": None, "waiting": 0, "oldest_s": 0.0, "calls": 0, "failed": 0}


def test_failing_is_said_before_slow():
    clock = Clock()
    h = CallHealth("teacher scores", slow_after_s=1, clock=clock)
    with h.work():
        clock.t += 5
        for _ in range(3):
            h.call_ended("RuntimeError")
        assert h.report()["state"] == "failing"


def _turn(i):
    return Turn(
        session_id="s",
        turn_index=i,
        messages=[{"role": "user", "content": "1+2?"}],
        response_message={"role": "assistant", "content": "3"},
        prompt_ids=[1, 2],
        response_ids=[3],
        rollout_logprobs=[-0.1],
        policy_version=0,
        finish_reason="stop",
    )


def test_judge_worker_health_follows_its_models_answers():
    """A judge (openai backend, nothing listening: the client is never used) whose model is scripted:
    three judgements held by the test are ``slow`` past 2 x timeout_s; released, the judge is ok;
    three failed calls make it ``failing``; a call past timeout_s is a failure named as a timeout."""

    async def main():
        clock = Clock()
        judge = JudgeWorker(
            {
                "backend": "openai",
                "m": 1,
                "base_url": "http://127.0.0.1:9/v1",
                "model": "judge",
                "api_key": "x",
                "timeout_s": 3.0,
                "retries": 0,
            }
        )
        judge.calls.clock = clock
        release, mode = asyncio.Event(), {"raise": False, "hang": False}

        async def model(messages, seed_key):
            if mode["hang"]:
                await asyncio.sleep(3600)
            if mode["raise"]:
                raise RuntimeError("bad gateway")
            await release.wait()
            return "\\boxed{1}"

        judge._ask_once = model
        held = [asyncio.ensure_future(judge.judge(_turn(i), [{"role": "user", "content": "thanks"}])) for i in range(3)]
        await asyncio.sleep(0.01)
        clock.t += 5.0
        assert (await judge.health())["state"] == "ok"  # 5 s < 2 x 3 s
        clock.t += 2.0
        assert await judge.health() == {
            "state": "slow",
            "reason": "3 judgements waiting, the oldest for 7 s (slow after 6 s)",
            "waiting": 3,
            "oldest_s": 7.0,
            "calls": 0,
            "failed": 0,
        }
        release.set()
        assert [r.score for r in await asyncio.gather(*held)] == [1, 1, 1]
        assert (await judge.health())["state"] == "ok" and (await judge.health())["calls"] == 3

        mode["raise"] = True
        results = [await judge.judge(_turn(i), [{"role": "user", "content": "ok"}]) for i in range(3)]
        assert [r.votes for r in results] == [[None]] * 3  # invalid votes, never an exception
        report = await judge.health()
        assert report["state"] == "failing"
        assert report["reason"] == "3 of the last 6 calls in 120 s failed (last: RuntimeError)"

        mode["hang"] = True
        judge.cfg.timeout_s = 0.05
        await judge.judge(_turn(9), [{"role": "user", "content": "ok"}])
        assert (await judge.health())["reason"].endswith("(last: TimeoutError after 0.05 s)")
        assert judge.stats["failed_calls"] == 4

    asyncio.run(main())
