"""A slow or silent dependency never holds the loop (issues #24.6, #27.8): the counters the driver
reads for its metrics answer at once however much work waits in the component."""

from clawray.types import Turn


def _turn():
    return Turn(
        session_id="s",
        turn_index=1,
        messages=[{"role": "user", "content": "1+2?"}],
        response_message={"role": "assistant", "content": "3"},
        prompt_ids=[1, 2],
        response_ids=[3, 4],
        rollout_logprobs=[-0.1, -0.2],
        policy_version=0,
        finish_reason="stop",
    )


def test_judge_counters_answer_while_a_thousand_calls_wait_on_a_silent_endpoint(ray_cluster):
    """Issue #24.6/#27.8: with a judge endpoint that never answers, 1,100 judge calls fill the
    actor's 1,000 concurrent slots; ``get_stats`` (the driver's metrics read) used to queue behind
    them and stall the loop. It runs in the control concurrency group: it answers at once."""
    import socket
    import time

    import ray

    from clawray.actors.judge import JudgeWorkerActor

    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(1)  # accepts nothing: every connection waits for the judge's timeout
    port = silent.getsockname()[1]
    judge = JudgeWorkerActor.options(num_cpus=0).remote(
        {
            "backend": "openai",
            "m": 1,
            "base_url": f"http://127.0.0.1:{port}/v1",
            "api_key": "x",
            "model": "judge",
            "timeout_s": 120,
            "retries": 0,
        }
    )
    try:
        assert ray.get(judge.get_stats.remote(), timeout=60) == {}
        calls = [judge.judge.remote(_turn(), [{"role": "user", "content": "ok?"}]) for _ in range(1100)]
        time.sleep(2)
        assert ray.wait(calls, timeout=0)[0] == []  # all still waiting on the endpoint
        t0 = time.monotonic()
        assert ray.get(judge.get_stats.remote(), timeout=10) == {}
        assert time.monotonic() - t0 < 5
    finally:
        ray.kill(judge)
        silent.close()
