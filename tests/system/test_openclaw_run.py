"""Issue #30.4: the main job learns from traffic the real OpenClaw agent sends (``env.client=openclaw``).

The simulated user of ``brief`` drives its own OpenClaw agent (lean config, homework scenario: the
task in ``homework.txt``); clawray attributes OpenClaw's header-less requests to sessions from the
conversation, pairs each reply with the user's verdict, judges it and trains on it. The tiny model
answers in noise, so every verdict is a correction (-1); what is under test is that the whole path,
OpenClaw's real requests included, reaches a train step. One session of one graded turn plus the
verdict: two agent turns (~15 s each of Node start-up on 2 cores)."""

from __future__ import annotations

import json
import re

import httpx
import pytest

from clawray.driver import Driver
from clawray.envs.openclaw_user import HOMEWORK_MESSAGE
from conftest import openclaw_root_or_skip, tiny_run_config

pytestmark = pytest.mark.slow

# OpenClaw stamps what the user types with the time: "[Thu 2026-12-03 16:28 UTC] That's wrong: ..."
VERDICT = re.compile(
    r"\[\w{3} \d{4}-\d\d-\d\d \d\d:\d\d \w+\] (Correct, thanks|The number is right|I can't find the answer|That's wrong)"
)


def test_the_job_trains_on_what_a_real_openclaw_agent_sends(ray_cluster, tiny_model, tmp_path):
    root = openclaw_root_or_skip()
    cfg = tiny_run_config(
        tiny_model,
        tmp_path / "run",
        overrides=[
            "env.client=openclaw",
            f"env.openclaw_root={root}",
            "env.name=brief",
            "env.concurrency=1",
            "env.max_turns=1",
            "env.max_tokens=16",
            "env.request_timeout_s=120",
            "rollout.max_model_len=16384",  # OpenClaw's lean prompt is ~5.4k tiny-tokenizer tokens
            "trainer.batch_size=1",
            "trainer.num_steps=1",
            "trainer.batch_timeout_s=300",
            "wandb.mode=disabled",
        ],
    )
    d = Driver(cfg)
    try:
        d.setup()
        summary = d.run()
        traffic = httpx.get(d.base_url.removesuffix("/v1") + "/health", timeout=30).json()["traffic"]
    finally:
        d.shutdown()
    users = summary["sim_user"]
    assert summary["steps"] == 1 and summary["samples_trained"] >= 1
    assert users["agent_turns"] >= 2 and users.get("errors", 0) == 0 and users["sessions"] >= 1
    # every request OpenClaw sent is a main-line turn of an attributed session: none side, none lost
    assert traffic["requests"] == traffic["main"] >= users["requests"] >= 2
    assert traffic["side"] == traffic["unattributable"] == 0
    assert traffic["paired"] >= 1 and traffic["judged"] >= 1 and traffic["samples"] >= 1
    records = tmp_path / "run" / "records"
    turns = [json.loads(line) for line in (records / "turns.jsonl").read_text().splitlines()]
    first = turns[0]
    assert re.fullmatch(r"auto-sim-[0-9a-f]{12}", first["session_id"]) and first["turn_index"] == 1
    # OpenClaw's own request: its system prompt, the user's message in its envelope
    assert first["messages"][0]["role"] == "system" and len(first["messages"][0]["content"]) > 1000
    assert HOMEWORK_MESSAGE in json.dumps(first["messages"][-1])
    judged = [json.loads(line) for line in (records / "judgments.jsonl").read_text().splitlines()]
    verdict = judged[0]["next_state"][-1]
    assert judged[0]["session_id"] == first["session_id"] and judged[0]["turn"] == 1
    # the next state is the user's verdict, without OpenClaw's internal-context block
    assert verdict["role"] == "user" and "OPENCLAW_INTERNAL_CONTEXT" not in verdict["content"]
    assert VERDICT.match(verdict["content"]), verdict["content"]
    assert judged[0]["score"] in (-1.0, 1.0)
