"""The real OpenClaw agent (npm ``openclaw``, pinned in clawray.openclaw, installed once into
~/.cache/clawray/openclaw by ``clawray openclaw``) through a clawray PolicyServer: a multi-turn
conversation with two tool round trips (read a homework file, write the answer back; the second call
written without tags, as Qwen2.5-Coder-0.5B writes calls), sent the way
OpenClaw really sends it (no session header, an internal-context block per request, rewritten
tool-call ids, 12 tools, a 40k-character system prompt), and a compaction before its last turn (a
memory flush and a summary: OpenClaw's side requests).

The policy is a scripted engine (exact replies, tool calls included; tests/conftest.py): what is
under test is the wire, the attribution and the pairing, not a model's choices. Skipped, saying
why, only where the npm registry cannot be reached and OpenClaw is not installed yet."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import uuid

import httpx
import pytest
import ray

from clawray import openclaw
from conftest import SERVE_PORT, openclaw_root_or_skip, scripted_engine_class, shared_serve

pytestmark = pytest.mark.slow

# OpenClaw keeps sessions in its home, shared by every run on this machine: a fresh id per run, or a
# second run would continue the first one's conversation
SESSION = f"hw-{uuid.uuid4().hex[:8]}"
TURNS = [  # (what the user says, the scripted policy's replies to the requests of that turn)
    (
        "Read homework.txt and solve it.",
        ['<tool_call>\n{"name": "read", "arguments": {"path": "homework.txt"}}\n</tool_call>', "7 + 8 = 15."],
    ),
    (
        "Write the answer into answer.txt.",
        # written as Qwen2.5-Coder-0.5B writes its calls: a fenced json block without <tool_call> tags
        # (read as a call with serve.untagged_tool_calls, as conf/openclaw.yaml sets it)
        ['```json\n{"name": "write", "arguments": {"path": "answer.txt", "content": "15"}}\n```', "Done."],
    ),
    ("Thanks!", ["You're welcome."]),
]
# OpenClaw's housekeeping before the last turn, answered by prompt (their number is OpenClaw's choice:
# a split turn gets a second summary)
SUMMARY = (
    "## Goal\nSolve the homework.\n## Progress\nRead homework.txt; wrote 15 into answer.txt.\n## Next steps\nNone."
)
SIDE_RULES = [(" context summarization assistant", SUMMARY), ("Pre-compaction memory flush", "NO_REPLY")]


@pytest.fixture(scope="module")
def claw(tmp_path_factory):
    """The installed OpenClaw with a home of its own (state, sessions, config): an earlier run's state
    (it attests the workspaces it initialised, by path) never meets this one's."""
    root = openclaw_root_or_skip()
    home = tmp_path_factory.mktemp("openclaw-home")
    home.chmod(0o700)
    return dataclasses.replace(openclaw.install(root), home_dir=home)


@pytest.fixture(scope="module")
def endpoint(ray_cluster, tiny_model, tmp_path_factory):
    """A PolicyServer on the tiny model's tokenizer and template with a scripted engine, a feedback
    judge and its own SessionTracker, as the job wires them; a context of 128k tokens (the tiny
    tokenizer needs ~27k for OpenClaw's first request)."""
    from ray import serve
    from transformers import AutoTokenizer

    from clawray.actors.judge import JudgeWorkerActor
    from clawray.actors.queue import TrajectoryQueueActor
    from clawray.actors.session import SessionTrackerActor
    from clawray.config import ServeConfig
    from clawray.serve.app import PolicyServer

    tmp = tmp_path_factory.mktemp("openclaw")
    engine = ray.remote(scripted_engine_class()).options(num_cpus=0).remote()
    judge = JudgeWorkerActor.options(num_cpus=0).remote({"backend": "feedback", "m": 1})
    queue = TrajectoryQueueActor.options(num_cpus=0).remote(2)
    tracker = SessionTrackerActor.options(num_cpus=0).remote(
        [judge], queue, {"session": {"idle_timeout_s": 600.0}}, records_dir=str(tmp / "records")
    )
    cfg = ServeConfig(
        model_name="tiny", generate_timeout_s=60, api_key="", sync_wait_timeout_s=1.0, untagged_tool_calls=True
    )
    port = SERVE_PORT
    shared_serve()
    serve.run(
        PolicyServer.options(ray_actor_options={"num_cpus": 0}).bind(tiny_model, [engine], tracker, cfg, 131072),
        name="openclaw",
        route_prefix="/oc",
    )
    yield {
        "url": f"http://127.0.0.1:{port}/oc/v1",
        "engine": engine,
        "tracker": tracker,
        "tok": AutoTokenizer.from_pretrained(tiny_model),
        "records": tmp / "records",
        "tmp": tmp,
        "queue": queue,
        "model": tiny_model,
    }
    serve.delete("openclaw")


def _script(endpoint, replies):
    """The scripted engine answers main-line requests with ``replies`` in order, and OpenClaw's
    housekeeping requests by :data:`SIDE_RULES` (each reply ends with the end-of-sequence id)."""
    tok = endpoint["tok"]

    def ids(text):
        return tok.encode(text, add_special_tokens=False)

    rules = [(ids(needle), (ids(r) + [tok.eos_token_id], "stop")) for needle, r in SIDE_RULES]
    ray.get(endpoint["engine"].script.remote([(ids(r) + [tok.eos_token_id], "stop") for r in replies], rules=rules))


def test_a_real_openclaw_conversation_with_tool_calls_is_recorded_paired_and_judged(claw, endpoint):
    tracker = endpoint["tracker"]
    _script(endpoint, [reply for _, rs in TURNS for reply in rs])
    workspace = endpoint["tmp"] / "workspace"
    workspace.mkdir()
    (workspace / "homework.txt").write_text("What is 7 + 8?\n")
    served = openclaw.served_model(endpoint["url"], "x")
    assert served == {
        "id": "tiny",
        "object": "model",
        "created": 0,
        "owned_by": "clawray",
        "max_model_len": 131072,
        "policy_version": 3,  # the scripted engine's
        "policy_versions": [3],
    }
    openclaw.write_config(claw, endpoint["url"], "tiny", "x", 131072, 1024, workspace)
    for k, (message, _) in enumerate(TURNS):
        if k == len(TURNS) - 1:
            # a context window just above the prompt clawray last reported: OpenClaw flushes its memory
            # and compacts its history before the last turn, as it does when a conversation nears the window
            last = ray.get(endpoint["engine"].seen.remote())[-1]
            openclaw.write_config(claw, endpoint["url"], "tiny", "x", len(last.prompt_ids) + 2000, 1024, workspace)
        argv = claw.command(["agent", "--local", "--session-id", SESSION, "-m", message, "--json", "--timeout", "120"])
        done = subprocess.run(argv, env=claw.environment(), capture_output=True, text=True, timeout=240)
        assert done.returncode == 0, done.stderr[-2000:]
    assert (workspace / "answer.txt").read_text() == "15"  # OpenClaw ran the write tool the policy called
    ray.get(tracker.drain.remote(60))

    # every main-line request in one session, named by OpenClaw's own session id; the memory flush and
    # the summaries are side turns (recorded in no session, never trained: the next test's samples)
    traffic = httpx.get(endpoint["url"].removesuffix("/v1") + "/health", timeout=30).json()["traffic"]
    summaries = traffic.get("side/compaction_summary", 0)
    assert traffic.get("side/memory_flush") == 1 and summaries in (1, 2)
    assert {k: traffic[k] for k in ("requests", "main", "side", "unattributable")} == {
        "requests": 5 + 1 + summaries,
        "main": 5,
        "side": 1 + summaries,
        "unattributable": 0,
    }
    # every turn but the last paired with its next state and judged; the last turn before the compaction
    # with the user's next message in the compacted history
    assert (traffic["paired"], traffic["judged"], traffic["paired_after_rewrite"]) == (4, 4, 1)
    turns = [json.loads(line) for line in (endpoint["records"] / "turns.jsonl").read_text().splitlines()]
    assert [(t["session_id"], t["turn_index"]) for t in turns] == [(f"auto-{SESSION}", k) for k in range(1, 6)]
    calls = [[c["function"]["name"] for c in t["response_message"].get("tool_calls") or []] for t in turns]
    assert calls == [["read"], [], ["write"], [], []]
    judged = {j["turn"]: j for j in map(json.loads, (endpoint["records"] / "judgments.jsonl").read_text().splitlines())}
    assert sorted(judged) == [1, 2, 3, 4]
    # the tool calls' next states are OpenClaw's tool results (under its rewritten call ids)
    assert [(m["role"], m["content"]) for m in judged[1]["next_state"]] == [("tool", "What is 7 + 8?\n")]
    assert judged[1]["next_state"][0]["tool_call_id"] == turns[0]["response_message"]["tool_calls"][0]["id"].replace(
        "_", ""
    )
    assert [m["role"] for m in judged[3]["next_state"]] == ["tool"]
    assert judged[3]["next_state"][0]["content"].startswith("Successfully wrote")
    # a text reply's next state is the user's next message, without OpenClaw's internal context
    (user,) = judged[2]["next_state"]
    assert user["role"] == "user" and user["content"].endswith("Write the answer into answer.txt.")
    (user,) = judged[4]["next_state"]  # across the compaction
    assert user["role"] == "user" and user["content"].endswith("Thanks!")
    assert "OPENCLAW_INTERNAL_CONTEXT" not in json.dumps([j["next_state"] for j in judged.values()])


def test_the_conversations_samples_train_on_the_learner(claw, endpoint):
    """The conversation above sent 3 samples to the queue, the untagged tool call among them; the
    job's learner takes that one through a train step (a 27k-token OpenClaw prompt on the tiny
    model; one sample keeps the test short)."""
    from clawray.actors.learner import LearnerGroup
    from clawray.ray_env import free_port

    tok = endpoint["tok"]
    traffic = httpx.get(endpoint["url"].removesuffix("/v1") + "/health", timeout=30).json()["traffic"]
    if traffic["requests"] == 0:
        pytest.skip("the conversation test did not run")
    assert traffic["samples"] == 3
    batch = ray.get(endpoint["queue"].get_batch.remote(3, 4, 30.0))  # the scripted engine serves v3
    samples = ray.get(batch["refs"])
    by_turn = {s.turn_index: (s, ref) for s, ref in zip(samples, batch["refs"])}
    # turn 2's next state (the user's next request) says nothing of it: the feedback judge gives no score
    assert sorted(by_turn) == [1, 3, 4] and all(s.session_id == f"auto-{SESSION}" for s in samples)
    assert [by_turn[k][0].reward for k in (1, 3, 4)] == [1.0, 1.0, 1.0]
    # the untagged write call is trained as the tokens the policy sampled (the fenced block, end id)
    write, ref = by_turn[3]
    assert tok.decode(write.tokens[write.prompt_len :]) == TURNS[1][1][0] + tok.eos_token
    assert write.prompt_len > 20_000 and write.loss_mask == [1] * (len(write.tokens) - write.prompt_len)
    group = LearnerGroup(
        endpoint["model"],
        dict(num_workers=1, num_cpus=0.1, torch_threads=1, lr=1e-3, eps=0.2, eps_high=0.28, dist_timeout_s=60),
        free_port(),
    )
    try:
        m = group.train_step([ref], version=1)
    finally:
        group.shutdown()
    assert (m["num_samples"], m["num_tokens"]) == (1, len(write.loss_mask))
    assert m["inv/effective_token_rate"] == 1.0 and m["skipped"] == 0.0 and m["grad_norm"] > 0
    # advantage +1 on every token and no ratio above 1 + eps: the PPO loss is minus the mean ratio
    assert m["inv/ratio_max"] < 1.2 and m["loss"] == pytest.approx(-m["inv/ratio_mean"], rel=1e-5)


def test_with_clawrays_plugin_openclaw_names_its_session_in_a_header(claw, endpoint):
    """``write_config(session_headers=True)`` loads clawray's OpenClaw plugin: every request carries
    OpenClaw's session id as ``X-Session-Id``, so the turns are recorded under that exact id (the
    conversation's ``sessionId=`` hint would give ``auto-ID``); a compaction before the second turn
    still pairs the first turn with the user's next message, and its housekeeping stays side."""
    tracker = endpoint["tracker"]
    session = f"hdr-{uuid.uuid4().hex[:8]}"
    _script(
        endpoint, ['<tool_call>\n{"name": "read", "arguments": {"path": "homework.txt"}}\n</tool_call>', "15.", "Bye."]
    )
    workspace = endpoint["tmp"] / "workspace-hdr"
    workspace.mkdir()
    (workspace / "homework.txt").write_text("What is 7 + 8?\n")
    health = endpoint["url"].removesuffix("/v1") + "/health"
    before = httpx.get(health, timeout=30).json()["traffic"]
    for k, message in enumerate(["Read homework.txt and solve it.", "Good, thanks."]):
        window = 131072 if k == 0 else len(ray.get(endpoint["engine"].seen.remote())[-1].prompt_ids) + 2000
        openclaw.write_config(claw, endpoint["url"], "tiny", "x", window, 1024, workspace, session_headers=True)
        argv = claw.command(["agent", "--local", "--session-id", session, "-m", message, "--json", "--timeout", "120"])
        done = subprocess.run(argv, env=claw.environment(), capture_output=True, text=True, timeout=240)
        assert done.returncode == 0, done.stderr[-2000:]
    ray.get(tracker.drain.remote(60))
    after = httpx.get(health, timeout=30).json()["traffic"]
    delta = {k: after.get(k, 0) - before.get(k, 0) for k in ("requests", "main", "side", "unattributable", "paired")}
    summaries = after.get("side/compaction_summary", 0) - before.get("side/compaction_summary", 0)
    assert summaries >= 1
    assert delta == {"requests": 3 + delta["side"], "main": 3, "side": delta["side"], "unattributable": 0, "paired": 2}
    turns = [json.loads(line) for line in (endpoint["records"] / "turns.jsonl").read_text().splitlines()]
    assert [(t["session_id"], t["turn_index"]) for t in turns if session in t["session_id"]] == [
        (session, 1),
        (session, 2),
        (session, 3),
    ]
    judged = [json.loads(line) for line in (endpoint["records"] / "judgments.jsonl").read_text().splitlines()]
    (last,) = [j for j in judged if j["session_id"] == session and j["turn"] == 2]
    assert [(m["role"], m["content"].endswith("Good, thanks.")) for m in last["next_state"]] == [("user", True)]
