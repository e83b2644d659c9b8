"""The simulated user's OpenClaw agent (clawray.envs.openclaw_user) and the OpenClaw session of the
simulated user (env.client=openclaw), with a stand-in agent: no Node.js, no endpoint."""

from __future__ import annotations

import json
import random

import pytest

from clawray.config import ConfigError, load_config
from clawray.envs import make_env
from clawray.envs.openclaw_user import HOMEWORK_MESSAGE, AgentTurn, AgentTurnFailed, parse_agent_output
from clawray.envs.sim_user import SimUserPool

# trimmed from `openclaw agent --local --json` (OpenClaw 2026.9.6) against clawray, a reply cut at max_tokens
TRUNCATED = {
    "payloads": [
        {"text": "how then 5 ##", "mediaUrl": None},
        {
            "text": "⚠️ Reply truncated at the model's output token limit. The text above is partial — ask to continue it."
        },
    ],
    "meta": {
        "durationMs": 5709,
        "agentMeta": {
            "sessionId": "sx1",
            "assistantTurns": 1,
            "terminalReceipt": {"sessionId": "sx1", "successfulToolNames": []},
        },
        "aborted": False,
        "finalAssistantVisibleText": "how then 5 ##",
        "stopReason": "length",
    },
}


def test_the_reply_is_the_agents_visible_text_not_openclaws_notices():
    out = "[plugins] loaded\n" + json.dumps(TRUNCATED, indent=2)
    assert parse_agent_output(out) == AgentTurn("how then 5 ##", tool_calls=0, requests=1)


def test_tool_calls_and_requests_come_from_openclaws_summary_or_receipt():
    two_calls = {
        "payloads": [{"text": "15"}],
        "meta": {
            "toolSummary": {"calls": 2, "tools": ["read", "write"]},
            "agentMeta": {"assistantTurns": 3, "terminalReceipt": {"successfulToolNames": ["read"]}},
        },
    }
    assert parse_agent_output(json.dumps(two_calls)) == AgentTurn("15", tool_calls=2, requests=3)
    receipt_only = {
        "payloads": [{"text": "a"}, {"text": "b"}],
        "meta": {"agentMeta": {"terminalReceipt": {"successfulToolNames": ["read"]}}},
    }
    # no visible text field: the payloads' texts, one per line
    assert parse_agent_output(json.dumps(receipt_only)) == AgentTurn("a\nb", tool_calls=1, requests=1)


@pytest.mark.parametrize("out", ["", "Error: gateway closed", "{not json", "[1, 2]"])
def test_output_without_a_json_result_is_a_failed_turn(out):
    with pytest.raises(AgentTurnFailed, match="no JSON result"):
        parse_agent_output(out)


class FakeAgent:
    """Answers each message with the next scripted reply; keeps what it was told and its homework."""

    def __init__(self, replies):
        self.replies, self.said, self.homework = list(replies), [], None

    def write_homework(self, task):
        self.homework = task

    def say(self, session, message):
        self.said.append((session, message))
        return AgentTurn(self.replies.pop(0), tool_calls=1, requests=2, seconds=1.5)


def _pool(**cfg):
    return SimUserPool("http://127.0.0.1:9/v1", {"name": "brief", "client": "openclaw", **cfg})


def test_a_homework_session_asks_through_the_file_and_sends_the_verdict_as_the_last_next_state():
    pool = _pool(max_turns=2, seed=3)
    env = make_env("brief", 1)
    problem = env.sample(random.Random(0), "train")
    pool._agents = [FakeAgent(["I think 100", str(problem.answer), "you're welcome"])]
    assert pool.run_session(problem) is True
    agent = pool._agents[0]
    assert agent.homework == env.first_message(problem)
    wrong, _ = env.feedback(problem, "I think 100")
    right, solved = env.feedback(problem, str(problem.answer))
    assert solved and [m for _, m in agent.said] == [HOMEWORK_MESSAGE, wrong, right]
    assert len({s for s, _ in agent.said}) == 1 and agent.said[0][0].startswith("sim-")
    assert pool.get_stats() == {
        "sessions": 1,
        "agent_turns": 3,
        "requests": 6,
        "tool_calls": 3,
        "agent_seconds": 4.5,
        "solved": 1,
    }


def test_a_typed_session_that_runs_out_of_turns_is_unsolved_and_still_pairs_its_last_reply():
    pool = _pool(max_turns=1, openclaw_homework=False)
    env = make_env("brief", 1)
    problem = env.sample(random.Random(1), "train")
    pool._agents = [FakeAgent(["no idea", "ok"])]
    assert pool.run_session(problem) is False
    verdict, _ = env.feedback(problem, "no idea")
    assert [m for _, m in pool._agents[0].said] == [env.first_message(problem), verdict]
    assert pool._agents[0].homework is None and pool.get_stats()["unsolved"] == 1


def _config(*overrides):
    return load_config(["conf/rl.yaml", "conf/cpu.yaml"], ["env.client=openclaw", *overrides])


def test_openclaw_users_need_openclaws_context_and_turn_credit():
    with pytest.raises(ConfigError, match=r"rollout.max_model_len >= 4000.*got 2048"):
        _config()  # conf/cpu.yaml serves 2,048 tokens
    with pytest.raises(ConfigError, match="env.max_tokens=5000 must be below rollout.max_model_len=4096"):
        _config("rollout.max_model_len=4096", "env.max_tokens=5000")
    with pytest.raises(ConfigError, match="trainer.credit=outcome needs session outcomes"):
        _config("rollout.max_model_len=8192", "trainer.credit=outcome")
    assert _config("rollout.max_model_len=8192").env.client == "openclaw"
    # without simulated users the client is not used
    assert (
        load_config(["conf/rl.yaml", "conf/cpu.yaml"], ["env.client=openclaw", "env.enabled=false"]).env.enabled
        is False
    )
