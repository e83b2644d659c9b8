"""Discounted credit, the behaviour monitor and the matrix through the whole loop on the tiny model
(conf/credit.yaml on the simulated user's multi-turn sessions, hf engine, 2 updates)."""

import json
import math
from collections import defaultdict

import pytest

from clawray.algos.credit import discounted_returns
from clawray.driver import Driver
from conftest import tiny_run_config

pytestmark = pytest.mark.slow


def test_discounted_credit_and_behaviour_monitor_in_the_loop(ray_cluster, tiny_model, tmp_path):
    cfg = tiny_run_config(
        tiny_model,
        tmp_path / "run",
        presets=["conf/credit.yaml"],
        overrides=[
            "trainer.num_steps=2",
            "learner.num_workers=1",  # FSDP across ranks is the learner and chaos tests' (a setup costs 7 s less)
            "trainer.batch_timeout_s=300",
            "env.concurrency=2",
            "env.max_tokens=12",
            "env.max_turns=3",
            "env.name=arith",
            "wandb.mode=disabled",
            "monitor.every_steps=1",
            "monitor.k=2",
            "monitor.num_prompts=2",
            "monitor.max_tokens=8",
            "learner.behaviour_floor=5.0",
        ],
    )
    d = Driver(cfg)
    try:
        d.setup()
        d.run()
        stats = d.summary(0.0)["sessions"]
    finally:
        d.shutdown()
    rows = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    train = [r for r in rows if "inv/entropy" in r]
    assert len(train) == 2
    for r in train:
        assert "credit/turns_waiting" in r and 0 <= r["inv/behaviour_distinct"] <= 1
        assert 0 <= r["inv/behaviour_entropy"] <= math.log(2) + 1e-9 and 0 <= r["inv/self_similarity"] <= 1
    # the behaviour floor (5 nats, above ln 2) raised the entropy-bonus coefficient
    assert train[-1]["inv/behaviour_coef"] > 0 and train[-1]["inv/entropy_coef"] >= train[-1]["inv/behaviour_coef"]
    acks = [json.loads(line) for line in open(tmp_path / "run" / "journal" / "samples.jsonl")]
    samples = [a["sample"] for a in acks if a.get("op") == "ack"]
    assert samples and all("turn_reward" in s["info"] for s in samples)
    if not stats.get("credit/forced_flushes"):  # every session released whole at its close: exact returns
        by_session = defaultdict(list)
        for s in samples:
            by_session[s["session_id"]].append(s)
        for group in by_session.values():
            group.sort(key=lambda s: s["turn_index"])
            if any(g["info"].get("held_vote") is not None for g in group) or len(group) < 2:
                continue
            rewards = [g["info"]["turn_reward"] for g in group]
            got = [g["reward"] for g in group]
            # the simulated user's outcome (+-1) was added to the last judged turn
            outcome = got[-1] - rewards[-1]  # a difference of floats: -1.0000000000000002 is -1
            assert min(abs(outcome - 1.0), abs(outcome + 1.0)) < 1e-9, outcome
            assert got == pytest.approx(discounted_returns(rewards[:-1] + [rewards[-1] + outcome], 0.9))
