"""The whole online-RL loop on the tiny model: Serve endpoint, simulated users, judge, queue,
FSDP2 learners and weight sync, driven by the real Driver."""

import json
import os

import httpx
import pytest
import ray

from clawray.closing import eval_change_lines
from clawray.driver import Driver
from clawray.envs import make_env
from conftest import tiny_run_config

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def driver(ray_cluster, tiny_model, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("run")
    cfg = tiny_run_config(
        tiny_model,
        run_dir,
        overrides=[
            "trainer.num_steps=2",
            "trainer.batch_timeout_s=180",
            "env.concurrency=2",
            "env.max_tokens=16",
            "env.max_turns=2",
            "learner.lr=1e-3",
            "wandb.mode=offline",
            "env.name=arith",  # cpu.yaml: brief
            # evaluation before, after step 1 and at the end, on 2 held-out prompts x 2 samples
            "eval.enabled=true",
            "eval.num_prompts=2",
            "eval.n=2",
            "eval.every_steps=1",
        ],
    )
    from clawray.weight_sync import shm

    def ipc_files():
        return {n for n in os.listdir(shm.shm_dir()) if n.startswith(shm.PREFIX)}

    before = ipc_files()
    d = Driver(cfg)
    d.setup()
    yield d
    d.shutdown()
    # learner rank 0 removed its ipc buffers (/dev/shm files) before it was killed: nothing of this
    # run is left in RAM (torch's file_system buffers were, one copy of the weights per run)
    assert ipc_files() - before == set()


def chat(d, body, headers=None, raw=None):
    url = d.base_url + "/chat/completions"
    if raw is not None:
        return httpx.post(url, content=raw, headers={"Content-Type": "application/json", **(headers or {})}, timeout=60)
    return httpx.post(url, json=body, headers=headers or {}, timeout=60)


def test_openai_client_models_and_a_main_turn(driver):
    from openai import OpenAI

    client = OpenAI(base_url=driver.base_url, api_key="x", max_retries=0)
    assert [m.id for m in client.models.list().data] == ["clawray-policy"]
    before = ray.get(driver.actors.tracker.stats.remote()).get("turns", 0)
    r = client.chat.completions.create(
        model="clawray-policy",
        messages=[{"role": "user", "content": "1+1?"}],
        max_tokens=5,
        extra_headers={"X-Session-Id": "probe"},
    )
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.model_extra["policy_version"] == 0 and r.model_extra["turn_index"] == 1
    assert r.usage.completion_tokens >= 1
    side = client.chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": "title?"}],
        max_tokens=3,
        extra_headers={"X-Session-Id": "probe", "X-Turn-Type": "side"},
    )
    assert side.model_extra["turn_index"] is None
    assert ray.get(driver.actors.tracker.stats.remote())["turns"] == before + 1  # the side turn is not recorded


@pytest.mark.parametrize(
    "body, raw, param",
    [
        ({"model": "m"}, None, "messages"),
        ({"model": "m", "messages": []}, None, "messages"),
        ({"model": "m", "messages": [{"role": "wizard", "content": "hi"}]}, None, "messages[0].role"),
        (None, b"{not json", None),
        (None, b"[1, 2]", None),
        ({"messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}, None, "temperature"),
        ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, None, "max_tokens"),
        ({"messages": [{"role": "user", "content": "hi"}], "n": 9}, None, "n"),
        ({"messages": [{"role": "user", "content": "hi"}], "tools": "calculator"}, None, "tools"),
        ({"messages": [{"role": "user", "content": "x " * 3000}]}, None, "messages"),
        ({"messages": [{"role": "user", "content": "hi"}], "model": 5}, None, "model"),
        (None, json.dumps({"messages": [{"role": "user", "content": "\ud800"}]}).encode(), None),
    ],
)
def test_bad_input_is_400_with_openai_error_and_records_nothing(driver, body, raw, param):
    before = ray.get(driver.actors.tracker.stats.remote()).get("turns", 0)
    r = chat(driver, body, {"X-Session-Id": "bad"}, raw)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
    assert err["param"] == param and err["message"]
    assert ray.get(driver.actors.tracker.stats.remote()).get("turns", 0) == before
    ok = chat(driver, {"messages": [{"role": "user", "content": "still there?"}], "max_tokens": 2})
    assert ok.status_code == 200  # the server keeps serving


def test_unknown_routes_and_oversized_bodies_get_openai_errors(driver):
    root = driver.base_url.removesuffix("/v1")
    for method, path, status in [
        ("GET", "/v1/chat/completions", 405),
        ("POST", "/v1/models", 405),
        ("GET", "/v1/nope", 404),
    ]:
        r = httpx.request(method, root + path, timeout=30)
        assert r.status_code == status and r.json()["error"]["message"].startswith(f"{method} {path}")
    big = b'{"messages": [{"role": "user", "content": "' + b"x" * (9 << 20) + b'"}]}'
    r = chat(driver, None, raw=big)
    assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"
    assert chat(driver, {"messages": [{"role": "user", "content": "ok"}], "max_tokens": 2}).status_code == 200


def test_loop_trains_syncs_and_serves_the_new_version(driver):
    summary = driver.run()
    assert summary["policy_version"] == 2 and summary["steps"] == 2
    assert summary["engine_versions"] == [2]
    assert summary["sessions"]["samples"] >= 4 and summary["sim_user"]["requests"] > 0
    rows = [json.loads(line) for line in open(f"{driver.run_dir}/metrics.jsonl")]
    lines = [m for m in rows if "eval/solved" not in m]
    assert [m["policy_version"] for m in lines] == [1, 2]
    # batches take every fresh queued sample: at least trainer.batch_size (2), at most max_batch_size
    assert summary["queue"]["taken"] == lines[-1]["samples_taken"] >= 4
    assert summary["samples_trained"] == lines[-1]["samples_trained"] == sum(m["samples"] for m in lines)
    for m in lines:
        assert 2 <= m["samples"] <= 64 and -1.0 <= m["reward_mean"] <= 1.0
        decided = m["samples_taken"] + m.get("inv/dropped_samples/stale", 0)
        assert m["inv/effective_sample_rate"] == m["samples_trained"] / decided
        assert 1 <= m["inv/staleness_max"] <= 2 and m["timing/weight_sync_s"] > 0 and m["sync/bytes"] > 0
        assert 0 < m["sync/pause_s"] <= m["timing/weight_sync_s"] and m["sync/interrupted_requests"] >= 0
        for key in (
            "inv/entropy",
            "inv/entropy_p10",
            "inv/clip_frac",
            "inv/ratio_max",
            "inv/adv_std",
            "inv/effective_token_rate",
            "inv/nonzero_reward_frac",
            "inv/degenerate_batches",
        ):
            assert key in m
    # the first update trains on samples made by v0 with v0 weights: on-policy, same numerics (hf fp32)
    assert lines[0]["inv/staleness_max"] == 1 and lines[0]["inv/logprob_mismatch_kl"] < 1e-9
    # from the second update on, the mismatch comes (also) from the probe engine 0 sampled after the
    # previous sync (clawray.mismatch_probe): measured at every version, whatever the staleness
    assert lines[0]["inv/mismatch_probe_tokens"] == 0 and 1 <= lines[1]["inv/mismatch_probe_tokens"] <= 16
    assert lines[1]["inv/logprob_mismatch_kl"] < 1e-9 and lines[1]["inv/mismatch_probes_dropped"] == 0
    r = chat(
        driver,
        {"messages": [{"role": "user", "content": "after the update"}], "max_tokens": 2},
        {"X-Request-Id": "trace-42"},
    )
    assert r.json()["policy_version"] == 2 and r.headers["x-policy-version"] == "2"
    assert r.headers["x-request-id"] == "trace-42"
    import glob

    assert glob.glob(f"{driver.run_dir}/wandb/offline-run-*/run-*.wandb")  # wandb logged offline
    health = httpx.get(driver.base_url.removesuffix("/v1") + "/health", timeout=30).json()
    assert health["policy_versions"] == [2]
    # evaluation through rollout engine 0: before (v0), after step 1 (v1), at the end (v2)
    evals = [m for m in rows if "eval/solved" in m]
    assert [(m["step"], m["policy_version"]) for m in evals] == [(0, 0), (1, 1), (2, 2)]
    for m in evals:
        for k in ("solved", "correct", "no_markdown", "has_answer"):
            assert 0 <= m[f"eval/{k}_lo"] <= m[f"eval/{k}"] <= m[f"eval/{k}_hi"] <= 1
    assert [(r["when"], r["policy_versions"], r["samples"]) for r in driver.eval_results] == [
        ("before", [0], 4),
        ("step", [1], 4),
        ("after", [2], 4),
    ]
    assert [e["when"] for e in json.load(open(f"{driver.run_dir}/eval.json"))] == ["before", "step", "after"]
    held = {t.question for t in make_env("arith", 1).prompts("eval")}
    assert all(r["question"] in held for r in driver.eval_results[0]["replies"])
    change = eval_change_lines(driver.eval_results)
    assert change[0] == "eval on arith eval (4 samples each): step 0 (v0) -> step 2 (v2)"
    assert change[1].startswith("  solved: ") and "->" in change[1] and len(change) == 5


def test_the_printed_eval_command_reproduces_the_jobs_last_evaluation(driver, tmp_path):
    """Issue #24.1: the closing ``evaluate it:`` command, pasted, gives the job's own final figures
    (same prompts, samples, seeds, token cap, engine and precision: the policy card's), here exactly:
    the hf engine samples each request alone with its own seed in float32."""
    import shlex

    from clawray.checkpoint import read_policy_card
    from clawray.cli import main
    from clawray.closing import closing_lines

    path = driver.checkpoints.save()
    card = read_policy_card(os.path.join(path, "model"))
    assert card["policy_version"] == 2 and card["engine"] == {"backend": "hf", "dtype": "float32"}
    line = next(x for x in closing_lines(driver.cfg, driver.checkpoints.last) if x.startswith("evaluate it: "))
    argv = shlex.split(line.removeprefix("evaluate it: "))
    assert argv[1:3] == ["eval", os.path.join(path, "model")] and "--dtype" in argv
    out = str(tmp_path / "eval.json")
    assert main(argv[1:] + ["--out", out]) == 0
    mine, job = json.load(open(out)), driver.eval_results[-1]
    assert (job["when"], job["policy_versions"]) == ("after", [2]) and mine["samples"] == job["samples"] == 4
    assert mine["metrics"] == job["metrics"]


def test_tool_calls_out_and_exact_recorded_tokens(driver, tiny_model):
    """The PolicyServer records exactly the engine's prompt/response ids and log-probs, and returns
    the reply's <tool_call> block as OpenAI tool_calls."""

    # defined here so Ray pickles it by value (the tests folder is not importable in workers)
    class ScriptedEngine:
        """Stands in for a RolloutEngine: replies with fixed token ids, so the server's recording and
        tool-call parsing can be checked against exact values."""

        def __init__(self, reply_ids, logprobs):
            self.reply_ids, self.logprobs, self.requests = reply_ids, logprobs, []

        async def generate(self, request, wait_s=None):
            self.requests.append(request)
            return {
                "response_ids": self.reply_ids,
                "logprobs": self.logprobs,
                "finish_reason": "stop",
                "policy_version": 7,
                "engine": "scripted",
            }

        async def get_version(self):
            return 7

        async def seen(self):
            return self.requests

    from openai import OpenAI
    from ray import serve
    from transformers import AutoTokenizer

    from clawray.actors.queue import TrajectoryQueueActor
    from clawray.actors.session import SessionTrackerActor
    from clawray.config import ServeConfig
    from clawray.serve.app import PolicyServer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    reply = 'Let me use the tool.<tool_call>\n{"name": "calculator", "arguments": {"expression": "3*4"}}\n</tool_call>'
    reply_ids = tok.encode(reply, add_special_tokens=False) + [tok.eos_token_id]
    logprobs = [-0.01 * (i + 1) for i in range(len(reply_ids))]
    engine = ray.remote(ScriptedEngine).options(num_cpus=0).remote(reply_ids, logprobs)
    tracker = SessionTrackerActor.options(num_cpus=0).remote([], TrajectoryQueueActor.options(num_cpus=0).remote(2))
    cfg = ServeConfig(
        model_name="scripted",
        default_max_tokens=32,
        default_temperature=1.0,
        generate_timeout_s=30,
        max_body_mb=1.0,
        api_key="sekret",
    )
    max_model_len = 512
    serve.run(
        PolicyServer.options(ray_actor_options={"num_cpus": 0}).bind(tiny_model, [engine], tracker, cfg, max_model_len),
        name="scripted",
        route_prefix="/scripted",
    )
    try:
        import openai

        base = driver.base_url.removesuffix("/v1") + "/scripted/v1"
        with pytest.raises(openai.AuthenticationError):  # serve.api_key set: a wrong key is a 401
            OpenAI(base_url=base, api_key="wrong", max_retries=0).chat.completions.create(
                model="scripted", messages=[{"role": "user", "content": "hi"}]
            )
        client = OpenAI(base_url=base, api_key="sekret", max_retries=0)
        tools = [{"type": "function", "function": {"name": "calculator", "parameters": {"type": "object"}}}]
        messages = [{"role": "user", "content": "What is 3*4?"}]
        r = client.chat.completions.create(
            model="scripted", messages=messages, tools=tools, extra_headers={"X-Session-Id": "tool-session"}
        )
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls"
        assert choice.message.content == "Let me use the tool."
        (call,) = choice.message.tool_calls
        assert call.type == "function" and call.function.name == "calculator"
        assert json.loads(call.function.arguments) == {"expression": "3*4"}
        assert r.usage.completion_tokens == len(reply_ids)

        expected_prompt = tok.encode(
            tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False),
            add_special_tokens=False,
        )
        (request,) = ray.get(engine.seen.remote())
        assert request.prompt_ids == expected_prompt and request.stop_token_ids == [tok.eos_token_id]
        turn = ray.get(tracker.pending_turn.remote("tool-session"))
        assert turn.prompt_ids == expected_prompt
        assert turn.response_ids == reply_ids  # exactly the engine's ids, eos included, never re-tokenised
        assert turn.rollout_logprobs == logprobs and turn.policy_version == 7 and turn.turn_index == 1
        assert turn.response_message["tool_calls"][0]["function"]["name"] == "calculator"
    finally:
        serve.delete("scripted")


def test_requests_during_a_weight_sync_wait_instead_of_failing(driver):
    import threading

    engines = driver.actors.engines
    ray.get([e.pause.remote() for e in engines])
    result = {}
    t = threading.Thread(
        target=lambda: result.update(r=chat(driver, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}))
    )
    t.start()
    t.join(timeout=2.0)
    assert t.is_alive() and not result  # held while paused
    ray.get([e.resume.remote() for e in engines])
    t.join(timeout=60)
    assert result["r"].status_code == 200


def test_engine_and_openai_judges_call_real_models(driver):
    """The ``engine`` judge prompts a RolloutEngine m times and the ``openai`` judge calls an
    OpenAI-compatible endpoint (here clawray's own). The tiny model's random replies hold no
    ``\\boxed{}`` score, so every vote is a counted invalid vote and the turn scores 0."""
    import asyncio

    from clawray.actors.judge import JudgeWorker
    from clawray.types import Turn

    turn = Turn(
        session_id="j",
        turn_index=1,
        messages=[{"role": "user", "content": "2+2?"}],
        response_message={"role": "assistant", "content": "Answer: 4"},
        prompt_ids=[1],
        response_ids=[2],
        rollout_logprobs=[-0.1],
        policy_version=0,
        finish_reason="stop",
    )
    base = {"m": 3, "temperature": 0.6, "max_tokens": 8, "timeout_s": 60.0, "api_key": "x"}
    engine_judge = JudgeWorker(
        {**base, "backend": "engine"}, engine=driver.actors.engines[0], tokenizer_path=driver.model_path
    )
    openai_judge = JudgeWorker({**base, "backend": "openai", "base_url": driver.base_url, "model": "clawray-policy"})
    for judge in (engine_judge, openai_judge):
        result = asyncio.run(judge.judge(turn, [{"role": "user", "content": "thanks!"}]))
        assert result.votes == [None, None, None] and result.score == 0
        assert result.counts == {"valid": 0, "invalid": 3, "tie": 0}
        assert len(result.raw) == 3 and not any(r.startswith("<judge call failed") for r in result.raw)
        assert judge.stats["votes"] == 3 and judge.stats.get("failed_votes", 0) == 0
