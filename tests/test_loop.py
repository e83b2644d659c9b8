"""The whole online-RL loop on the tiny model: Serve endpoint, simulated users, judge, queue,
FSDP2 learners and weight sync, driven by the real Driver."""

import json

import httpx
import pytest
import ray

from clawray.config import load_config
from clawray.driver import Driver
from clawray.ray_env import free_port

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def driver(ray_cluster, tiny_model, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("run")
    cfg = load_config(["conf/rl.yaml", "conf/cpu.yaml"], [
        f"model.path={tiny_model}", "rollout.backend=hf", "rollout.num_cpus=0.25",
        "rollout.torch_threads=1", "judge.backend=feedback", "trainer.batch_size=2", "trainer.num_steps=2",
        "trainer.batch_timeout_s=180", "env.concurrency=2", "env.max_tokens=16", "env.max_turns=2",
        "learner.lr=1e-3", f"run_dir={run_dir}", f"serve.port={free_port()}", "wandb.mode=offline"])
    d = Driver(cfg)
    d.setup()
    yield d
    d.shutdown()


def chat(d, body, headers=None, raw=None):
    url = d.base_url + "/chat/completions"
    if raw is not None:
        return httpx.post(url, content=raw, headers={"Content-Type": "application/json", **(headers or {})}, timeout=60)
    return httpx.post(url, json=body, headers=headers or {}, timeout=60)


def test_openai_client_models_and_a_main_turn(driver):
    from openai import OpenAI

    client = OpenAI(base_url=driver.base_url, api_key="x", max_retries=0)
    assert [m.id for m in client.models.list().data] == ["clawray-policy"]
    before = ray.get(driver.tracker.stats.remote()).get("turns", 0)
    r = client.chat.completions.create(model="clawray-policy", messages=[{"role": "user", "content": "1+1?"}],
                                       max_tokens=5, extra_headers={"X-Session-Id": "probe"})
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.model_extra["policy_version"] == 0 and r.model_extra["turn_index"] == 1
    assert r.usage.completion_tokens >= 1
    side = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "title?"}], max_tokens=3,
                                          extra_headers={"X-Session-Id": "probe", "X-Turn-Type": "side"})
    assert side.model_extra["turn_index"] is None
    assert ray.get(driver.tracker.stats.remote())["turns"] == before + 1  # the side turn is not recorded


@pytest.mark.parametrize("body, raw, param", [
    ({"model": "m"}, None, "messages"),
    ({"model": "m", "messages": []}, None, "messages"),
    ({"model": "m", "messages": [{"role": "wizard", "content": "hi"}]}, None, "messages[0].role"),
    (None, b"{not json", None),
    (None, b"[1, 2]", None),
    ({"messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}, None, "temperature"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, None, "max_tokens"),
    ({"messages": [{"role": "user", "content": "hi"}], "n": 2}, None, "n"),
    ({"messages": [{"role": "user", "content": "hi"}], "tools": "calculator"}, None, "tools"),
    ({"messages": [{"role": "user", "content": "x " * 3000}]}, None, "messages"),
])
def test_bad_input_is_400_with_openai_error_and_records_nothing(driver, body, raw, param):
    before = ray.get(driver.tracker.stats.remote()).get("turns", 0)
    r = chat(driver, body, {"X-Session-Id": "bad"}, raw)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
    assert err["param"] == param and err["message"]
    assert ray.get(driver.tracker.stats.remote()).get("turns", 0) == before
    ok = chat(driver, {"messages": [{"role": "user", "content": "still there?"}], "max_tokens": 2})
    assert ok.status_code == 200  # the server keeps serving


def test_loop_trains_syncs_and_serves_the_new_version(driver):
    summary = driver.run()
    assert summary["policy_version"] == 2 and summary["steps"] == 2
    assert summary["engine_versions"] == [2]
    assert summary["queue"]["taken"] == 4
    assert summary["sessions"]["samples"] >= 4 and summary["sim_user"]["requests"] > 0
    lines = [json.loads(line) for line in open(f"{driver.run_dir}/metrics.jsonl")]
    assert [m["policy_version"] for m in lines] == [1, 2]
    for m in lines:
        assert m["samples"] == 2 and m["reward_mean"] in (-1.0, -0.5, 0.0, 0.5, 1.0)
        assert 1 <= m["staleness_max"] <= 2 and m["timing/weight_sync_s"] > 0 and m["sync/bytes"] > 0
    # the first update trains on samples made by v0 with v0 weights: on-policy, ratio 1
    assert lines[0]["staleness_max"] == 1 and lines[0]["logprob_abs_diff"] < 1e-4
    r = chat(driver, {"messages": [{"role": "user", "content": "after the update"}], "max_tokens": 2})
    assert r.json()["policy_version"] == 2 and r.headers["x-policy-version"] == "2"
    health = httpx.get(driver.base_url.removesuffix("/v1") + "/health", timeout=30).json()
    assert health["policy_versions"] == [2]
