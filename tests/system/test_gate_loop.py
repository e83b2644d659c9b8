"""The promotion gate in the whole loop (issue #26) on the tiny model: a candidate that holds is
promoted and served; a rejected one never reaches a user (the engines keep the promoted version, every
recorded token comes from a promoted version), the learners return to the promoted weights bit for bit
with the learning rate backed off, deploy.max_rejections in a row stop the run, and a resume keeps
the promoted version's probe scores and the best one (no new baseline)."""

from __future__ import annotations

import dataclasses
import json
import math
import time

import httpx
import pytest
import ray

from clawray.config import DeployConfig, section
from clawray.driver import Driver
from clawray.gate import GateStopped
from conftest import tiny_run_config

pytestmark = pytest.mark.slow


def rank0_state(d: Driver) -> dict:
    return ray.get([w.state_dict.remote() for w in d.actors.learners.workers])[0]


OVERRIDES = [
    "trainer.num_steps=-1",
    "trainer.batch_timeout_s=180",
    "env.concurrency=2",
    "env.max_tokens=16",
    "env.max_turns=2",
    "env.name=arith",
    "learner.lr=1e-3",
    "wandb.mode=disabled",
    "deploy.gate=true",
    "deploy.margin=1.0",  # no drop rejects: the first candidate is promoted
    "deploy.probe_prompts=3",
    "deploy.probe_n=2",
    "deploy.max_rejections=2",
    "deploy.entropy_ratio_min=0",  # a tiny model's entropy may halve in one step at lr 1e-3
    "deploy.on_reject=quarantine",
]


def test_the_gate_promotes_rejects_rolls_back_and_stops(ray_cluster, tiny_model, tmp_path):
    cfg = tiny_run_config(tiny_model, tmp_path / "run", overrides=OVERRIDES)
    d = Driver(cfg)
    d.setup()
    try:
        d.gate.start(d.actors, d.version, d.model_path)
        assert d.gate.promoted == 0 and len(d.gate.promoted_scores) == 6
        d.users.start(d.base_url)
        m1 = d.step()
        assert m1["deploy/promoted"] == 1.0 and m1["deploy/serving_version"] == 1.0 and d.version == 1
        assert d.actors.weight_sync.engine_versions() == {"rollout-0": 1}
        assert m1["deploy/users_held_s"] >= m1["sync/pause_s"] > 0
        # the invariant guards, measured by the learners on the candidate's own probe replies
        assert m1["deploy/entropy"] > 0 and 0 <= m1["deploy/mismatch_kl"] < 1e-3
        models = httpx.get(d.base_url + "/models").json()["data"][0]
        assert models["policy_version"] == 1 and models["policy_versions"] == [1]
        promoted = rank0_state(d)
        engine, prompt, reply = d.actors.engines[0], [1, 2, 3, 4], [5, 6, 7]
        logprobs = ray.get(engine.logprobs.remote(prompt, reply))
        # from now on every candidate falls below the floor: rejected, rolled back
        d.gate.cfg = section(DeployConfig, {**cfg.deploy, "floor": 1.0})
        m2 = d.step()
        assert m2["deploy/rejected"] == 1.0 and m2["deploy/rejections"] == 1.0 and d.version == 1
        assert m2["deploy/probe_s"] > 0 and m2["policy_version"] == 1
        assert d.actors.weight_sync.engine_versions() == {"rollout-0": 1}
        assert m2["deploy/dropped_samples"] == m2["samples"] >= 2
        after = rank0_state(d)
        assert after.keys() == promoted.keys() and all(torch_equal(after[k], promoted[k]) for k in promoted)
        assert ray.get(engine.logprobs.remote(prompt, reply)) == logprobs  # the engine serves v1's exact weights
        with pytest.raises(GateStopped, match=r"rejected 2 candidates in a row .* still served v1"):
            d.step()
        m3 = d.history[-1]
        assert m3["lr"] == pytest.approx(0.5 * m2["lr"]) and m3["deploy/rejections"] == 2.0
        dropped = m3["deploy/dropped_samples"]
        assert dropped == m2["samples"] + m3["samples"]
        assert d.version == 1 and d.actors.weight_sync.engine_versions() == {"rollout-0": 1}
        assert httpx.get(d.base_url + "/models").json()["data"][0]["policy_version"] == 1
    finally:
        d.close()  # the exit checkpoint holds v1, the promoted version
    rows = [json.loads(line) for line in open(tmp_path / "run" / "versions.jsonl")]
    assert [(r["version"], r["decision"]) for r in rows] == [
        (0, "baseline"),
        (1, "promoted"),
        (2, "rejected"),
        (2, "rejected"),
    ]
    assert all(r["items"] == 6 for r in rows) and "below the floor 1.000" in rows[2]["reason"]
    assert all(r["tokens"] > 0 and math.isfinite(r["entropy"]) for r in rows)
    # deploy.on_reject=quarantine: every sample trained into a rejected candidate is listed, with its origin
    quarantined = [json.loads(line) for line in open(tmp_path / "run" / "quarantine.jsonl")]
    assert len(quarantined) == dropped and {q["version"] for q in quarantined} == {2}
    assert all(q["decision"] == "rejected" and q["session_id"] and q["reward"] in (-1.0, 0.0, 1.0) for q in quarantined)
    turns = [json.loads(line) for line in open(tmp_path / "run" / "records" / "turns.jsonl")]
    served = {v for t in turns for v in (t.get("token_versions") or [t["policy_version"]])}
    assert turns and served <= {0, 1}  # no user token ever came from a rejected candidate

    # a resume serves the checkpoint's v1 with the scores it was promoted with: no new baseline probe
    resumed = Driver(tiny_run_config(tiny_model, tmp_path / "run", overrides=[*OVERRIDES, "resume=true"]))
    resumed.setup()
    try:
        resumed.gate.start(resumed.actors, resumed.version, resumed.model_path, resumed=True)
        gate = resumed.gate
        assert resumed.version == 1 and gate.promoted == 1 and gate.promoted_scores == rows[1]["scores"]
        assert gate.best in (0, 1) and gate.best_scores == max(rows[0]["scores"], rows[1]["scores"], key=sum)
    finally:
        resumed.shutdown()
    rows = [json.loads(line) for line in open(tmp_path / "run" / "versions.jsonl")]
    assert [(r["version"], r["decision"]) for r in rows[4:]] == [(1, "resumed")]


def torch_equal(a, b) -> bool:
    import torch

    return torch.equal(a, b)


def test_a_canary_serves_only_its_sessions_and_a_harmful_one_never_reaches_the_rest(
    ray_cluster, tiny_model, tmp_path, monkeypatch
):
    """Two engines, deploy.canary_fraction=0.5. v1 passes its probe on rollout-1 alone, serves the canary
    sessions there, then every engine loads it. v2 passes its probe and its canary is found harmful
    (the verdict is forced: a tiny model's live rewards are noise): only canary sessions were ever served
    v2, rollout-1 loads v1 back. Every turn says whether a canary served it, and a canary turn is always
    a canary session's (crc32 rule, clawray.serve.routing.in_canary)."""
    import clawray.canary
    from clawray.serve.routing import in_canary

    overrides = [
        *OVERRIDES,
        "rollout.num_engines=2",
        "env.concurrency=4",
        "deploy.canary_fraction=0.5",
        "deploy.canary_turns=2",
        "deploy.canary_timeout_s=45",
    ]
    cfg = tiny_run_config(tiny_model, tmp_path / "run", overrides=overrides)
    d = Driver(cfg)
    d.setup()
    try:
        d.gate.start(d.actors, d.version, d.model_path)
        d.users.start(d.base_url)
        m1 = d.step()
        assert m1["deploy/promoted"] == 1.0 and d.version == 1 and m1["deploy/canary_s"] > 0
        assert d.actors.weight_sync.engine_versions() == {"rollout-0": 1, "rollout-1": 1}
        real = clawray.canary.canary_verdict
        monkeypatch.setattr(
            clawray.canary,
            "canary_verdict",
            lambda *a, **k: dataclasses.replace(real(*a, **k), harm=True, reason="worse (forced)"),
        )
        m2 = d.step()
        assert m2["deploy/rejected"] == 1.0 and d.version == 1 and m2["deploy/canary_harm"] == 1.0
        assert d.actors.weight_sync.engine_versions() == {"rollout-0": 1, "rollout-1": 1}
    finally:
        d.close()
    rows = [json.loads(line) for line in open(tmp_path / "run" / "versions.jsonl")]
    assert [(r["version"], r["decision"]) for r in rows] == [(0, "baseline"), (1, "promoted"), (2, "rejected")]
    assert rows[1]["canary"]["harm"] in (False, None) and rows[2]["reason"].startswith("rejected by its canary")
    turns = [json.loads(line) for line in open(tmp_path / "run" / "records" / "turns.jsonl")]
    canary = [t for t in turns if t["canary"]]
    assert canary and all(in_canary(t["session_id"], 0.5) for t in canary)  # within its fraction
    assert {t["policy_version"] for t in canary} <= {0, 1, 2}
    v2 = [t for t in turns if 2 in (t.get("token_versions") or [t["policy_version"]])]
    assert all(t["canary"] for t in v2)  # the rejected v2 reached canary sessions only
    # a canary session's turns while its canary ran stayed there: none of its v1/v2 candidate-time
    # turns went to the other engine (a non-canary turn of a canary session is the promoted version's)
    assert all(t["policy_version"] != 2 for t in turns if not t["canary"])


def test_a_probe_generation_that_never_answers_times_out_and_is_cancelled(ray_cluster):
    """The gate's probe waited on its generations without a limit: a probe that never answered held
    the users' requests for ever. Past ``timeout_s`` the generations are cancelled and the probe fails
    (the gate withdraws the candidate)."""
    from clawray.gate import probe_generate

    @ray.remote(num_cpus=0)
    class Stuck:
        def __init__(self):
            self.cancelled = 0

        async def generate(self, request, wait_s, probe):
            import asyncio

            try:
                if request == "quick":
                    return {"probe": probe}
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                self.cancelled += 1
                raise

        def count(self):
            return self.cancelled

    engine = Stuck.remote()
    assert probe_generate([engine], ["quick"], timeout_s=30) == [{"probe": True}]
    with pytest.raises(ray.exceptions.GetTimeoutError):
        probe_generate([engine], ["quick", "stuck"], timeout_s=1.0)
    deadline = time.monotonic() + 10
    while ray.get(engine.count.remote()) == 0 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert ray.get(engine.count.remote()) == 1
    ray.kill(engine)
