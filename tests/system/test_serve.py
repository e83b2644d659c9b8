"""OpenAI compatibility of the PolicyServer, driven by the official ``openai`` client (sync, async,
streaming, tools, errors), on the tiny model's real engine and on a scripted engine where exact
outputs are needed. Also: sessions without drift (token splicing under a thinking template), session
inference, arrival order, n > 1, truncation, the weight-sync 503 and the records."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import stat
import time

import httpx
import openai
import pytest
import ray

from conftest import MASKED_SESSIONS, scripted_engine_class, shared_serve

pytestmark = pytest.mark.slow

# A Qwen3-style thinking template: an assistant's reasoning is rendered only after the last user
# message, so a fresh render of the history drops earlier think blocks; tool-call JSON is re-serialised.
THINKING_TEMPLATE = (
    "{%- set ns = namespace(last_user=-1) -%}"
    "{%- for m in messages -%}{%- if m.role == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}{%- endfor -%}"
    "{%- if tools -%}{{- '<|im_start|>system\\n<tools>' -}}{%- for t in tools -%}{{- t.function.name -}}{%- endfor -%}"
    "{{- '</tools><|im_end|>\\n' -}}{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'assistant' -%}{{- '<|im_start|>assistant\\n' -}}"
    "{%- if m.reasoning_content and loop.index0 > ns.last_user -%}{{- '<think>\\n' + m.reasoning_content + '\\n</think>\\n\\n' -}}{%- endif -%}"
    "{{- m.content or '' -}}"
    "{%- for c in m.tool_calls or [] -%}{{- '<tool_call>\\n' -}}"
    "{{- {'name': c.function.name, 'arguments': c.function.arguments} | tojson -}}{{- '\\n</tool_call>' -}}{%- endfor -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- elif m.role == 'tool' -%}{{- '<|im_start|>user\\n<tool_response>\\n' + m.content + '\\n</tool_response><|im_end|>\\n' -}}"
    "{%- else -%}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)
TOOLS = [{"type": "function", "function": {"name": "calculator", "parameters": {"type": "object"}}}]
WEATHER = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]


@pytest.fixture(scope="module")
def served(ray_cluster, tiny_model, tmp_path_factory):
    """Two PolicyServer apps on one Serve instance: ``/real`` (the tiny model on an hf RolloutEngine)
    and ``/scripted`` (a scripted engine, the thinking template), each with its own SessionTracker."""
    from ray import serve
    from transformers import AutoTokenizer

    from clawray.actors.judge import JudgeWorkerActor
    from clawray.actors.queue import TrajectoryQueueActor
    from clawray.actors.rollout import RolloutEngineActor
    from clawray.actors.session import SessionTrackerActor
    from clawray.config import ServeConfig
    from clawray.serve.app import PolicyServer

    tmp = tmp_path_factory.mktemp("serve")
    thinking_model = str(tmp / "tiny-thinking")
    shutil.copytree(tiny_model, thinking_model)
    tok = AutoTokenizer.from_pretrained(thinking_model)
    tok.chat_template = THINKING_TEMPLATE
    tok.save_pretrained(thinking_model)
    # as Qwen2.5/Qwen3: the generation config lists two end ids, <|im_end|> (the tokenizer's eos) and <|endoftext|>
    gen_path = os.path.join(thinking_model, "generation_config.json")
    with open(gen_path) as f:
        gen = json.load(f)
    gen["eos_token_id"] = [tok.eos_token_id, tok.convert_tokens_to_ids("<|endoftext|>")]
    with open(gen_path, "w") as f:
        json.dump(gen, f)

    real_engine = RolloutEngineActor.options(num_cpus=0.25).remote(tiny_model, {"backend": "hf", "torch_threads": 1})
    scripted = ray.remote(scripted_engine_class()).options(num_cpus=0).remote()
    judge = JudgeWorkerActor.options(num_cpus=0).remote({"backend": "feedback", "m": 1})
    trackers = {}
    for name in ("real", "scripted"):
        queue = TrajectoryQueueActor.options(num_cpus=0).remote(2)
        trackers[name] = SessionTrackerActor.options(num_cpus=0).remote(
            [judge], queue, MASKED_SESSIONS, records_dir=str(tmp / name / "records")
        )
    ray.get(real_engine.ready.remote())
    cfg = ServeConfig(
        model_name="tiny",
        default_max_tokens=100,
        default_temperature=1.0,
        generate_timeout_s=60,
        max_body_mb=1.0,
        api_key="",
        sync_wait_timeout_s=1.0,
        retry_after_s=2,
        max_n=4,
    )
    max_model_len = 256
    root = shared_serve()
    opts = {"ray_actor_options": {"num_cpus": 0}}
    serve.run(
        PolicyServer.options(**opts).bind(tiny_model, [real_engine], trackers["real"], cfg, max_model_len),
        name="real",
        route_prefix="/real",
    )
    serve.run(
        PolicyServer.options(**opts).bind(thinking_model, [scripted], trackers["scripted"], cfg, max_model_len),
        name="scripted",
        route_prefix="/scripted",
    )
    yield {
        "root": root,
        "real": f"{root}/real/v1",
        "scripted": f"{root}/scripted/v1",
        "engine": real_engine,
        "scripted_engine": scripted,
        "trackers": trackers,
        "tok": tok,
        "records": tmp,
    }
    serve.delete("real")
    serve.delete("scripted")
    ray.kill(real_engine)


def _client(base):
    return openai.OpenAI(base_url=base, api_key="x", max_retries=0)


def _ids(tok, text, stop=True):
    return tok.encode(text, add_special_tokens=False) + ([tok.eos_token_id] if stop else [])


# ---------------------------------------------------------------------------------------------- streaming
def test_stream_merges_to_the_plain_answer_for_a_fixed_seed(served):
    client = _client(served["real"])
    messages = [{"role": "user", "content": "What is 2+3?"}]
    plain = client.chat.completions.create(
        model="tiny", messages=messages, seed=11, max_tokens=24, extra_headers={"X-Session-Id": "plain-11"}
    )
    chunks = list(
        client.chat.completions.create(
            model="tiny",
            messages=messages,
            seed=11,
            max_tokens=24,
            stream=True,
            stream_options={"include_usage": True},
            extra_headers={"X-Session-Id": "stream-11"},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == (plain.choices[0].message.content or "")
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == [plain.choices[0].finish_reason]
    usage = chunks[-1]
    assert usage.choices == [] and usage.usage.completion_tokens == plain.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])
    turn = ray.get(served["trackers"]["real"].pending_turn.remote("stream-11"))
    assert usage.usage.completion_tokens == len(turn.response_ids)
    assert usage.usage.prompt_tokens == len(turn.prompt_ids)
    # the raw event stream ends with [DONE]
    with httpx.stream(
        "POST",
        served["real"] + "/chat/completions",
        timeout=60,
        json={"messages": messages, "stream": True, "max_tokens": 4, "seed": 1},
    ) as r:
        lines = [line for line in r.iter_lines() if line]
    assert r.headers["content-type"].startswith("text/event-stream") and lines[-1] == "data: [DONE]"


def test_stream_emits_whole_characters_reasoning_and_tool_call_deltas(served):
    tok, engine = served["tok"], served["scripted_engine"]
    reply = (
        "<think>\n漢字 ✓ plan\n</think>\n\nCalling the tool: é.\n<tool_call>\n"
        '{"name": "calculator", "arguments": "{\\"expression\\": \\"3*4\\"}"}\n</tool_call>'
    )
    ray.get(engine.script.remote([(_ids(tok, reply), "stop"), (_ids(tok, reply), "stop")]))
    client = _client(served["scripted"])
    messages = [{"role": "user", "content": "3*4?"}]
    plain = client.chat.completions.create(
        model="m", messages=messages, tools=TOOLS, extra_headers={"X-Session-Id": "utf-plain"}
    )
    chunks = list(
        client.chat.completions.create(
            model="m", messages=messages, tools=TOOLS, stream=True, extra_headers={"X-Session-Id": "utf-stream"}
        )
    )
    texts = [c.choices[0].delta.content for c in chunks if c.choices[0].delta.content]
    reasoning = [c.choices[0].delta.model_extra.get("reasoning_content") for c in chunks]
    reasoning = [r for r in reasoning if r]
    assert len(texts) > 3 and len(reasoning) > 3  # token by token
    assert all("\ufffd" not in t for t in texts + reasoning)
    assert "".join(texts) == plain.choices[0].message.content == "Calling the tool: é."
    assert "".join(reasoning) == plain.choices[0].message.model_extra["reasoning_content"] == "\n漢字 ✓ plan\n"
    calls = [tc for c in chunks for tc in c.choices[0].delta.tool_calls or []]
    assert [(tc.index, tc.function.name, json.loads(tc.function.arguments)) for tc in calls] == [
        (0, "calculator", {"expression": "3*4"})
    ]
    (plain_call,) = plain.choices[0].message.tool_calls
    assert json.loads(plain_call.function.arguments) == {"expression": "3*4"}  # double-encoded -> one JSON string
    assert chunks[-1].choices[0].finish_reason == plain.choices[0].finish_reason == "tool_calls"
    turn = ray.get(served["trackers"]["scripted"].pending_turn.remote("utf-stream"))
    assert turn.response_ids == _ids(tok, reply)  # think tokens kept in the recorded response


# ---------------------------------------------------------------------------------------------- tool calls
def test_scripted_tool_blocks_two_objects_bad_json_and_truncation(served):
    tok, engine, tracker = served["tok"], served["scripted_engine"], served["trackers"]["scripted"]
    two = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "1+1"}}\n{"name": "calculator", "arguments": {"expression": "2+2"}}\n</tool_call>'
    bad = 'Result: <tool_call>\n{"name": "calculator", "arguments": {oops}}\n</tool_call>'
    long_reply = _ids(tok, "one two three four five six seven eight nine ten", stop=False)
    ray.get(engine.script.remote([(_ids(tok, two), "stop"), (_ids(tok, bad), "stop"), (long_reply, "stop")]))
    client = _client(served["scripted"])
    r = client.chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": "sums"}],
        tools=TOOLS,
        extra_headers={"X-Session-Id": "two-calls"},
    )
    assert r.choices[0].finish_reason == "tool_calls"
    assert [json.loads(c.function.arguments) for c in r.choices[0].message.tool_calls] == [
        {"expression": "1+1"},
        {"expression": "2+2"},
    ]
    r = client.chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": "bad"}],
        tools=TOOLS,
        extra_headers={"X-Session-Id": "bad-call"},
    )
    assert r.choices[0].finish_reason == "stop" and r.choices[0].message.tool_calls is None
    assert r.choices[0].message.content == bad
    assert ray.get(tracker.pending_turn.remote("bad-call")).tool_parse_error
    r = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "count"}], max_tokens=4, extra_headers={"X-Session-Id": "cut"}
    )
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 4
    cut = ray.get(tracker.pending_turn.remote("cut"))
    assert cut.truncated and cut.response_ids == long_reply[:4]
    # the next request resolves the truncated turn: masked (not judged), counted
    before = ray.get(tracker.stats.remote()).get("dropped/truncated", 0)
    client.chat.completions.create(
        model="m",
        messages=[
            {"role": "user", "content": "count"},
            {"role": "assistant", "content": r.choices[0].message.content},
            {"role": "user", "content": "go on"},
        ],
        max_tokens=2,
        extra_headers={"X-Session-Id": "cut"},
    )
    assert ray.get(tracker.stats.remote())["dropped/truncated"] == before + 1


def test_no_tool_calls_unless_tools_are_offered(served):
    """As vLLM: without tools, or with tool_choice "none", a <tool_call> block is content (plain and
    streamed), never a tool call; with tools it is a call."""
    tok, engine = served["tok"], served["scripted_engine"]
    reply = 'Sure.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "1+1"}}\n</tool_call>'
    ray.get(engine.script.remote([(_ids(tok, reply), "stop")] * 3))
    client = _client(served["scripted"])
    msgs = [{"role": "user", "content": "1+1?"}]
    bare = client.chat.completions.create(model="m", messages=msgs, extra_headers={"X-Turn-Type": "side"})
    chunks = list(
        client.chat.completions.create(
            model="m",
            messages=msgs,
            tools=TOOLS,
            tool_choice="none",
            stream=True,
            extra_headers={"X-Turn-Type": "side"},
        )
    )
    offered = client.chat.completions.create(
        model="m", messages=msgs, tools=TOOLS, extra_headers={"X-Turn-Type": "side"}
    )
    assert bare.choices[0].message.content == reply and bare.choices[0].message.tool_calls is None
    assert bare.choices[0].finish_reason == "stop"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == reply
    assert not any(c.choices[0].delta.tool_calls for c in chunks)
    assert [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason] == ["stop"]
    assert offered.choices[0].finish_reason == "tool_calls" and offered.choices[0].message.content == "Sure."


def test_history_tool_arguments_as_string_or_object_render_the_same(served):
    engine = served["scripted_engine"]
    ray.get(engine.script.remote([([5], "length"), ([5], "length")]))
    client = _client(served["scripted"])
    call = {"id": "c1", "type": "function", "function": {"name": "calculator", "arguments": '{"expression": "1+1"}'}}
    history = [
        {"role": "user", "content": "1+1?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "2"},
    ]
    as_object = [
        history[0],
        {**history[1], "tool_calls": [{**call, "function": {**call["function"], "arguments": {"expression": "1+1"}}}]},
        history[2],
    ]
    n0 = len(ray.get(engine.seen.remote()))
    for msgs in (history, as_object):  # side turns: rendered fresh, never spliced
        client.chat.completions.create(model="m", messages=msgs, tools=TOOLS, extra_headers={"X-Turn-Type": "side"})
    a, b = ray.get(engine.seen.remote())[n0:]
    assert a.prompt_ids == b.prompt_ids
    bad = [history[0], {**history[1], "tool_calls": [{**call, "function": {**call["function"], "arguments": "{nope"}}]}]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="m", messages=bad)
    assert e.value.body["param"] == "messages[1].tool_calls"


# ---------------------------------------------------------------------------------------------- no drift
def test_spliced_prompts_keep_earlier_responses_exactly_under_a_thinking_template(served):
    """Three turns of a tool session with think blocks and compact tool-call JSON: a fresh render
    would drop the think block and re-serialise the JSON, but each recorded prompt holds the earlier
    turns' prompt + response ids exactly."""
    tok, engine, tracker = served["tok"], served["scripted_engine"], served["trackers"]["scripted"]
    replies = [
        '<think>\nneed the tool\n</think>\n\n<tool_call>\n{"name":"calculator","arguments":{"expression":"6*7"}}\n</tool_call>',
        "<think>\ngot 42\n</think>\n\nIt is 42.",
        '<think>\nagain\n</think>\n\n<tool_call>\n{"name":"calculator","arguments":{"expression":"42+1"}}\n</tool_call>',
    ]
    ray.get(engine.script.remote([(_ids(tok, r), "stop") for r in replies]))
    client = _client(served["scripted"])
    messages = [{"role": "user", "content": "6*7?"}]
    turns = []
    for k, follow in enumerate(
        [{"role": "tool", "tool_call_id": "x", "content": "42"}, {"role": "user", "content": "and plus one?"}, None]
    ):
        r = client.chat.completions.create(
            model="m", messages=messages, tools=TOOLS, extra_headers={"X-Session-Id": "drift"}, stream=(k == 1)
        )
        if k == 1:  # a streamed turn: rebuild the message from the deltas, as a client does
            chunks = list(r)
            msg = {
                "role": "assistant",
                "content": "".join(c.choices[0].delta.content or "" for c in chunks),
                "reasoning_content": "".join(
                    c.choices[0].delta.model_extra.get("reasoning_content") or "" for c in chunks
                ),
            }
        else:
            msg = r.choices[0].message.model_dump(exclude_none=True)
        turns.append(ray.get(tracker.pending_turn.remote("drift")))
        if follow is not None:
            messages = messages + [msg, follow]
    for prev, nxt in zip(turns, turns[1:]):
        head = prev.prompt_ids + prev.response_ids
        assert nxt.spliced and nxt.prompt_ids[: len(head)] == head
    fresh = tok.encode(
        tok.apply_chat_template(turns[2].messages, tools=TOOLS, add_generation_prompt=True, tokenize=False),
        add_special_tokens=False,
    )
    assert fresh != turns[2].prompt_ids  # the template would have drifted: think dropped, JSON re-serialised
    assert fresh[-3:] == turns[2].prompt_ids[-3:]  # ... while the new suffix is the template's own rendering


# ---------------------------------------------------------------------------------------------- end of turn
def test_every_end_id_ends_the_turn_hidden_kept_and_spliced_as_the_template_renders(served):
    """The scripted model's generation config lists <|im_end|> (2) and <|endoftext|> (0). A reply that
    ends on <|endoftext|> shows no end text (plain and streamed), keeps the sampled id in its record,
    finishes with "stop", and the next prompt is exactly the one after an <|im_end|> stop: the reply's
    body followed by the template's own end tag."""
    tok, engine, tracker = served["tok"], served["scripted_engine"], served["trackers"]["scripted"]
    im_end, eot = tok.eos_token_id, tok.convert_tokens_to_ids("<|endoftext|>")
    body = tok.encode("Hi there", add_special_tokens=False)
    ray.get(
        engine.script.remote(
            [
                (body + [eot], "stop"),
                (body + [eot], "stop"),
                (body + [im_end], "stop"),
                ([5], "length"),
                ([5], "length"),
                ([5], "length"),
            ]
        )
    )
    client = _client(served["scripted"])
    first = [{"role": "user", "content": "hello"}]
    n0 = len(ray.get(engine.seen.remote()))
    plain = client.chat.completions.create(model="m", messages=first, extra_headers={"X-Session-Id": "eot-plain"})
    chunks = list(
        client.chat.completions.create(
            model="m", messages=first, stream=True, extra_headers={"X-Session-Id": "eot-stream"}
        )
    )
    normal = client.chat.completions.create(model="m", messages=first, extra_headers={"X-Session-Id": "eot-normal"})
    assert ray.get(engine.seen.remote())[n0].stop_token_ids == [im_end, eot]  # the engine stops on both
    assert plain.choices[0].message.content == "Hi there" == normal.choices[0].message.content
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "Hi there"
    assert (
        plain.choices[0].finish_reason
        == "stop"
        == [c for c in chunks if c.choices[0].finish_reason][0].choices[0].finish_reason
    )
    assert plain.usage.completion_tokens == len(body) + 1
    for sid, last in (("eot-plain", eot), ("eot-stream", eot), ("eot-normal", im_end)):
        turn = ray.get(tracker.pending_turn.remote(sid))
        assert turn.response_ids == body + [last] and not turn.truncated and turn.finish_reason == "stop"
    follow = first + [{"role": "assistant", "content": "Hi there"}, {"role": "user", "content": "more"}]
    prompt1 = tok.encode("<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
    expected = (
        prompt1
        + body
        + [im_end]
        + tok.encode("\n<|im_start|>user\nmore<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
    )
    for sid in ("eot-plain", "eot-stream", "eot-normal"):
        client.chat.completions.create(model="m", messages=follow, extra_headers={"X-Session-Id": sid})
        turn = ray.get(tracker.pending_turn.remote(sid))
        assert turn.spliced and turn.prompt_ids == expected, sid
        fresh = tok.encode(
            tok.apply_chat_template(follow, add_generation_prompt=True, tokenize=False), add_special_tokens=False
        )
        assert turn.prompt_ids == fresh  # what the chat template renders for that history


def test_request_stop_token_ids_end_the_turn_too(served):
    tok, engine, tracker = served["tok"], served["scripted_engine"], served["trackers"]["scripted"]
    body, extra = tok.encode("Hi there", add_special_tokens=False), tok.convert_tokens_to_ids("<|im_start|>")
    ray.get(engine.script.remote([(body + [extra], "stop"), ([5], "length")]))
    client = _client(served["scripted"])
    n0 = len(ray.get(engine.seen.remote()))
    r = client.chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": "hey"}],
        extra_body={"stop_token_ids": [extra]},
        extra_headers={"X-Session-Id": "req-stop"},
    )
    assert r.choices[0].message.content == "Hi there" and r.choices[0].finish_reason == "stop"
    assert ray.get(engine.seen.remote())[n0].stop_token_ids == [tok.eos_token_id, 0, extra]
    assert ray.get(tracker.pending_turn.remote("req-stop")).response_ids == body + [extra]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hey"}], extra_body={"stop_token_ids": [len(tok)]}
        )
    assert e.value.body["param"] == "stop_token_ids"


# ---------------------------------------------------------------------------------------------- prompt reuse
def test_prompt_reuse_keys_on_tools_tool_choice_and_system_message(served):
    """One session changes its tools, then sets tool_choice "none", then changes its system message:
    each such turn is rendered afresh with what the client sent (never spliced onto a prompt with
    other tools), a turn that changes nothing is spliced, and every turn still gets its next state."""
    tok, engine, tracker = served["tok"], served["scripted_engine"], served["trackers"]["scripted"]
    replies = [f"answer {k}" for k in range(6)]
    ray.get(engine.script.remote([(_ids(tok, r), "stop") for r in replies]))
    client = _client(served["scripted"])
    before = ray.get(tracker.stats.remote())
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "q0"}]
    plan = [
        (dict(tools=TOOLS), False),
        (dict(tools=WEATHER), False),
        (dict(tools=WEATHER), True),
        (dict(tools=WEATHER, tool_choice="none"), False),
        (dict(tools=WEATHER, tool_choice="none"), True),
        (dict(), False),
    ]
    turns = []
    for k, (kw, spliced) in enumerate(plan):
        if k == 5:  # a new system message: the history differs from the start
            messages = [{"role": "system", "content": "be verbose"}, *messages[1:]]
        r = client.chat.completions.create(model="m", messages=messages, extra_headers={"X-Session-Id": "reuse"}, **kw)
        turn = ray.get(tracker.pending_turn.remote("reuse"))
        tools = None if kw.get("tool_choice") == "none" else kw.get("tools")
        fresh = tok.encode(
            tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False),
            add_special_tokens=False,
        )
        assert turn.spliced == spliced, k
        if spliced:
            head = turns[-1].prompt_ids + turns[-1].response_ids
            assert turn.prompt_ids[: len(head)] == head, k
        assert turn.prompt_ids == fresh, k  # (short plain replies: the splice equals the fresh render too)
        text = tok.decode(turn.prompt_ids)
        assert ("calculator" in text, "get_weather" in text) == (k == 0, 1 <= k <= 2), k
        turns.append(turn)
        messages = messages + [
            r.choices[0].message.model_dump(exclude_none=True),
            {"role": "user", "content": f"q{k + 1}"},
        ]
    ray.get(tracker.drain.remote(30))
    after = ray.get(tracker.stats.remote())
    # every turn was paired with its next state (judged): a new system message is no branch (agents
    # rebuild theirs per request, OpenClaw's holds its workspace files), only a fresh render
    assert after.get("judged", 0) - before.get("judged", 0) == 5
    assert after.get("dropped/branch", 0) - before.get("dropped/branch", 0) == 0
    counts = httpx.get(served["root"] + "/scripted/health", timeout=30).json()["counts"]
    assert counts["splice_context_changed"] >= 2


# ---------------------------------------------------------------------------------------------- sessions
def test_sessions_are_inferred_for_clients_without_ids(served):
    client, tracker = _client(served["real"]), served["trackers"]["real"]
    messages = [{"role": "user", "content": "no header here"}]
    first = client.chat.completions.create(model="tiny", messages=messages, max_tokens=4, seed=3)
    sid = first.model_extra["session_id"]
    assert sid.startswith("auto-") and first.model_extra["turn_index"] == 1
    messages += [first.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "again"}]
    second = client.chat.completions.create(model="tiny", messages=messages, max_tokens=4, seed=4)
    assert second.model_extra["session_id"] == sid and second.model_extra["turn_index"] == 2
    assert ray.get(tracker.pending_turn.remote(sid)).spliced
    stray = client.chat.completions.create(
        model="tiny",
        max_tokens=2,
        messages=[
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "never served"},
            {"role": "user", "content": "?"},
        ],
    )
    assert stray.model_extra["session_id"] is None and stray.model_extra["turn_index"] is None
    counts = httpx.get(served["root"] + "/real/health", timeout=30).json()["counts"]
    assert counts["sessions_inferred"] >= 1 and counts["unattributable"] >= 1
    assert counts["sessions_started_without_id"] >= 2


def test_two_conversations_of_one_openai_user_each_go_on_in_their_own_session(served):
    """The OpenAI ``user`` field names the end user, not the conversation: two chats of one user,
    alternating, were one session, each request took the other chat's turn for a branch and no turn was
    paired. Now each chat is its own session among that user's (``auto-user:5:alice/...``); another user
    with the same history never lands in alice's (through Serve's proxy and its routing middleware)."""
    client = _client(served["real"])
    chats = {"a": [{"role": "user", "content": "chat A"}], "b": [{"role": "user", "content": "chat B"}]}
    seen: dict[str, list] = {"a": [], "b": []}
    for _ in range(3):
        for name, history in chats.items():
            r = client.chat.completions.create(model="tiny", messages=history, max_tokens=3, seed=1, user="alice")
            seen[name].append((r.model_extra["session_id"], r.model_extra["turn_index"]))
            history += [r.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "next"}]
    for name in chats:
        sids = {sid for sid, _ in seen[name]}
        assert len(sids) == 1 and sids.pop().startswith("auto-user:5:alice/"), seen
        assert [index for _, index in seen[name]] == [1, 2, 3], seen  # each turn continued its chat
    assert seen["a"][0][0] != seen["b"][0][0]
    other = client.chat.completions.create(
        model="tiny", messages=chats["a"][:3], max_tokens=3, seed=1, user="bob"
    )  # alice's history, bob's request: not alice's session
    assert other.model_extra["session_id"] is None and other.model_extra["turn_index"] is None


OPENCLAW_BLOCK = "<<<BEGIN_OPENCLAW_INTERNAL_CONTEXT>>>\nnone\n<<<END_OPENCLAW_INTERNAL_CONTEXT>>>"
OPENCLAW_TOOLS = [
    {"type": "function", "function": {"name": name, "parameters": {"type": "object"}}} for name in ("read", "write")
]


def test_an_openclaw_conversation_is_attributed_paired_and_its_housekeeping_served_as_side(served):
    """OpenClaw's wire layout (tests/data/openclaw/ has the real captures): no session header, the
    session id in a Runtime line, an internal-context block at the end of every request that the next
    one drops, tool-call ids rewritten (``_`` stripped), a memory flush and a compaction summary. Every
    main-line request lands in one session, every turn but the last is paired (the tool call with its
    result), the housekeeping is served and not recorded, and /health's traffic says so."""
    tok, engine, tracker = served["tok"], served["scripted_engine"], served["trackers"]["scripted"]
    call = '<tool_call>\n{"name": "read", "arguments": {"path": "homework.txt"}}\n</tool_call>'
    replies = [call, "7 + 8 = 15.", "NO_REPLY", "## Decisions\n- none", "Noted."]
    ray.get(engine.script.remote([(_ids(tok, r), "stop") for r in replies]))
    client = _client(served["scripted"])
    before = ray.get(tracker.stats.remote())
    health = httpx.get(served["root"] + "/scripted/health", timeout=30).json()["traffic"]
    runtime = "\n\nRuntime: agent=main | sessionId=oc-7"  # (the real line is longer: tiny max_model_len)
    system = {"role": "system", "content": "OpenClaw."}
    history = [system, {"role": "user", "content": f"Solve homework.txt{runtime}"}]

    def ask(new, **kw):
        block = {"role": "user", "content": [{"type": "text", "text": OPENCLAW_BLOCK}]}
        return client.chat.completions.create(
            model="m", messages=[*history, *new, block], tools=OPENCLAW_TOOLS, stream=False, **kw
        )

    r = ask([])
    assert r.choices[0].finish_reason == "tool_calls" and r.model_extra["session_id"] == "auto-oc-7"
    issued = r.choices[0].message.tool_calls[0].id
    echoed = issued.replace("_", "")  # as OpenClaw echoes it
    assert echoed != issued
    history += [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": echoed, "type": "function", "function": {"name": "read", "arguments": '{"path":"homework.txt"}'}}
            ],
        },
        {"role": "tool", "content": "What is 7 + 8?\n", "tool_call_id": echoed},
    ]
    r = ask([])
    assert (r.model_extra["session_id"], r.model_extra["turn_index"]) == ("auto-oc-7", 2)
    history += [{"role": "assistant", "content": r.choices[0].message.content}]
    flush_runtime = runtime.replace("sessionId=oc-7", "sessionId=internal-1a2b")
    flush = client.chat.completions.create(
        model="m",
        tools=OPENCLAW_TOOLS,
        messages=[
            system,
            {"role": "user", "content": f"Solve homework.txt{flush_runtime}"},
            *history[2:],
            {"role": "user", "content": "Pre-compaction memory flush. Store memories."},
        ],
    )
    summary = client.chat.completions.create(
        model="m",
        messages=[
            {"role": "system", "content": "You are a context summarization assistant."},
            {"role": "user", "content": "<conversation>...</conversation>"},
        ],
    )
    assert flush.model_extra["turn_index"] is None and summary.model_extra["turn_index"] is None
    r = ask([{"role": "user", "content": "Thanks!"}])
    assert (r.model_extra["session_id"], r.model_extra["turn_index"]) == ("auto-oc-7", 3)
    ray.get(tracker.drain.remote(30))
    after = ray.get(tracker.stats.remote())
    assert after["paired"] - before.get("paired", 0) == 2 and after["judged"] - before.get("judged", 0) == 2
    records = (served["records"] / "scripted" / "records" / "judgments.jsonl").read_text().splitlines()
    judged = {j["turn"]: j for j in map(json.loads, records) if j["session_id"] == "auto-oc-7"}
    assert judged[1]["next_state"] == [{"role": "tool", "content": "What is 7 + 8?\n", "tool_call_id": echoed}]
    assert judged[2]["next_state"] == [{"role": "user", "content": "Thanks!"}]
    traffic = httpx.get(served["root"] + "/scripted/health", timeout=30).json()["traffic"]
    assert traffic["main"] - health["main"] == 3 and traffic["side"] - health["side"] == 2
    assert traffic["side/memory_flush"] - health.get("side/memory_flush", 0) == 1
    assert traffic["side/compaction_summary"] - health.get("side/compaction_summary", 0) == 1
    assert traffic["unattributable"] == health["unattributable"]


def test_concurrent_requests_of_one_session_run_in_arrival_order(served):
    tok, engine, tracker = served["tok"], served["scripted_engine"], served["trackers"]["scripted"]
    ray.get(engine.script.remote([(_ids(tok, f"reply {i}"), "stop") for i in range(3)], delay_s=0.3))
    client = openai.AsyncOpenAI(base_url=served["scripted"], api_key="x", max_retries=0)
    n0 = len(ray.get(engine.seen.remote()))

    async def burst():
        async def one(i):
            await asyncio.sleep(0.05 * i)
            return await client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": f"q{i}"}], extra_headers={"X-Session-Id": "burst"}
            )

        return await asyncio.gather(*(one(i) for i in range(3)))

    t0 = time.perf_counter()
    results = asyncio.run(burst())
    assert time.perf_counter() - t0 >= 0.9  # one at a time
    assert [r.model_extra["turn_index"] for r in results] == [1, 2, 3]
    assert [r.choices[0].message.content for r in results] == ["reply 0", "reply 1", "reply 2"]
    seen = ray.get(engine.seen.remote())[n0:]
    assert [tok.decode(s.prompt_ids).split("q")[-1][0] for s in seen] == ["0", "1", "2"]
    stats = ray.get(tracker.stats.remote())
    assert stats["dropped/branch"] >= 2  # q1 and q2 do not continue the earlier replies


def test_n_choices_are_recorded_as_n_turns_and_one_is_continued(served):
    client, tracker = _client(served["real"]), served["trackers"]["real"]
    r = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "pick"}],
        n=3,
        seed=5,
        max_tokens=6,
        extra_headers={"X-Session-Id": "multi"},
    )
    assert [c.index for c in r.choices] == [0, 1, 2] and r.model_extra["turn_indexes"] == [1, 2, 3]
    turns = [ray.get(tracker.pending_turn.remote("multi", i)) for i in range(3)]
    assert len({tuple(t.prompt_ids) for t in turns}) == 1
    assert r.usage.completion_tokens == sum(len(t.response_ids) for t in turns)
    before = ray.get(tracker.stats.remote())
    chosen = r.choices[1].message.model_dump(exclude_none=True)
    client.chat.completions.create(
        model="tiny",
        max_tokens=2,
        extra_headers={"X-Session-Id": "multi"},
        messages=[{"role": "user", "content": "pick"}, chosen, {"role": "user", "content": "thanks"}],
    )
    after = ray.get(tracker.stats.remote())
    assert after.get("dropped/unchosen", 0) == before.get("dropped/unchosen", 0) + 2
    assert after.get("judged", 0) + after.get("dropped/truncated", 0) > before.get("judged", 0) + before.get(
        "dropped/truncated", 0
    )
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], n=5)
    assert e.value.body["param"] == "n"
    # streamed n = 2: the interleaved deltas of each choice merge to that choice's plain answer
    msgs = [{"role": "user", "content": "two ways"}]
    plain = client.chat.completions.create(
        model="tiny", messages=msgs, n=2, seed=21, max_tokens=12, extra_headers={"X-Session-Id": "multi-plain"}
    )
    chunks = list(
        client.chat.completions.create(
            model="tiny",
            messages=msgs,
            n=2,
            seed=21,
            max_tokens=12,
            stream=True,
            stream_options={"include_usage": True},
            extra_headers={"X-Session-Id": "multi-stream"},
        )
    )
    for i in range(2):
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices and c.choices[0].index == i)
        assert text == (plain.choices[i].message.content or "")
        (finish,) = [c for c in chunks if c.choices and c.choices[0].index == i and c.choices[0].finish_reason]
        assert finish.choices[0].finish_reason == plain.choices[i].finish_reason
        assert finish.model_extra["turn_index"] == i + 1
    assert chunks[-1].usage.completion_tokens == plain.usage.completion_tokens


# ---------------------------------------------------------------------------------------------- errors, limits
def test_async_client_errors_and_limits(served):
    async def run():
        client = openai.AsyncOpenAI(base_url=served["real"], api_key="x", max_retries=0)
        ok = await client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=3,
            extra_headers={"X-Session-Id": "limits"},
        )
        assert ok.model_extra["turn_index"] == 1
        with pytest.raises(openai.BadRequestError) as e:
            await client.chat.completions.create(
                model="tiny",
                messages=[{"role": "user", "content": "x " * 400}],
                extra_headers={"X-Session-Id": "limits"},
            )
        assert e.value.status_code == 400 and e.value.body["code"] == "context_length_exceeded"
        assert "max_model_len is 256" in e.value.body["message"] and "prompt is" in e.value.body["message"]
        big_tool = {"type": "function", "function": {"name": "f", "description": "x " * 20000, "parameters": {}}}
        with pytest.raises(openai.BadRequestError) as e:  # tools count, before anything is tokenised
            await client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "hi"}], tools=[big_tool]
            )
        assert e.value.body["param"] == "tools" and "(40" in e.value.body["message"], e.value.body
        assert "of them tools), more than max_model_len 256" in e.value.body["message"]
        reasoned = [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "ok", "reasoning_content": "x " * 20000},
            {"role": "user", "content": "go on"},
        ]
        with pytest.raises(openai.BadRequestError) as e:  # every rendered field counts, reasoning too
            await client.chat.completions.create(model="tiny", messages=reasoned)
        assert e.value.body["param"] == "messages" and "(0 of them tools)" in e.value.body["message"], e.value.body
        with pytest.raises(openai.BadRequestError):
            await client.chat.completions.create(model="tiny", messages=[{"role": "wizard", "content": "x"}])
        with pytest.raises(openai.BadRequestError) as e:
            await client.chat.completions.create(
                model="tiny",
                messages=[{"role": "user", "content": "x"}],
                stream=False,
                stream_options={"include_usage": True},
            )
        assert e.value.body["param"] == "stream_options"
        again = await client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=3,
            extra_headers={"X-Session-Id": "limits"},
        )
        return again

    again = asyncio.run(run())
    assert again.model_extra["turn_index"] == 2  # the rejected request recorded nothing


def test_sync_pause_gives_503_with_retry_after_then_serves(served):
    engine = served["engine"]
    ray.get(engine.pause.remote())
    try:
        health = httpx.get(served["root"] + "/real/health", timeout=30).json()
        assert health["engines"][0]["state"] == "syncing"
        t0 = time.perf_counter()
        r = httpx.post(
            served["real"] + "/chat/completions",
            timeout=30,
            json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        )
        assert r.status_code == 503 and r.headers["retry-after"] == "2"
        assert r.json()["error"]["code"] == "engine_syncing" and time.perf_counter() - t0 >= 1.0
    finally:
        ray.get(engine.resume.remote())
    r = httpx.post(
        served["real"] + "/chat/completions",
        timeout=30,
        json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
    )
    assert r.status_code == 200
    health = httpx.get(served["root"] + "/real/health", timeout=30).json()
    assert health["engines"][0] == {
        **health["engines"][0],
        "name": "rollout-0",
        "policy_version": 0,
        "state": "serving",
    }
    assert health["open_sessions"] >= 1


def test_records_are_appended_0600_with_turns_and_judgments(served):
    records = served["records"] / "real" / "records"
    turns = [json.loads(line) for line in open(records / "turns.jsonl")]
    assert turns and {
        "session_id",
        "turn_index",
        "prompt_ids",
        "response_ids",
        "rollout_logprobs",
        "policy_version",
        "truncated",
        "spliced",
    } <= set(turns[0])
    assert all(len(t["response_ids"]) == len(t["rollout_logprobs"]) for t in turns)
    assert stat.S_IMODE(os.stat(records / "turns.jsonl").st_mode) == 0o600
    ray.get(served["trackers"]["real"].drain.remote(30))
    judged = [json.loads(line) for line in open(records / "judgments.jsonl")]
    assert judged and stat.S_IMODE(os.stat(records / "judgments.jsonl").st_mode) == 0o600


QWEN3_WEATHER = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}},
        },
    }
]


def test_qwen3_coder_tool_call_and_special_tokens_plain_and_streamed(served):
    """Issue #24.4/#24.5 through the endpoint: a Qwen3-Coder XML call is a tool call (typed by the
    schema: ``days`` 2, not "2"), never penalised as a parse error; ``<|im_start|>`` and
    ``<|endoftext|>`` sampled inside a reply never reach the client as text, plain or streamed, and
    the recorded response keeps every sampled id."""
    tok, engine, tracker = served["tok"], served["scripted_engine"], served["trackers"]["scripted"]
    xml = (
        "<|im_start|>On it.<|endoftext|>\n<tool_call>\n<function=get_weather>\n<parameter=city>\n"
        "Paris\n</parameter>\n<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>"
    )
    ids = _ids(tok, xml)
    assert (
        ids.count(tok.convert_tokens_to_ids("<|im_start|>"))
        == ids.count(tok.convert_tokens_to_ids("<|endoftext|>"))
        == 1
    )
    ray.get(engine.script.remote([(ids, "stop"), (ids, "stop")]))
    client = _client(served["scripted"])
    msgs = [{"role": "user", "content": "weather?"}]
    plain = client.chat.completions.create(
        model="m", messages=msgs, tools=QWEN3_WEATHER, extra_headers={"X-Session-Id": "xml-plain"}
    )
    chunks = list(
        client.chat.completions.create(
            model="m", messages=msgs, tools=QWEN3_WEATHER, stream=True, extra_headers={"X-Session-Id": "xml-stream"}
        )
    )
    (call,) = plain.choices[0].message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Paris", "days": 2})
    assert plain.choices[0].message.content == "On it." and plain.choices[0].finish_reason == "tool_calls"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "On it."
    streamed = [tc for c in chunks for tc in c.choices[0].delta.tool_calls or []]
    assert [(tc.function.name, json.loads(tc.function.arguments)) for tc in streamed] == [
        ("get_weather", {"city": "Paris", "days": 2})
    ]
    for sid in ("xml-plain", "xml-stream"):
        turn = ray.get(tracker.pending_turn.remote(sid))
        assert turn.response_ids == ids and not turn.tool_parse_error


def test_a_request_the_engine_refuses_is_a_client_error_not_a_500(served):
    """``Backend.add`` refusing a request (vLLM: no room left within ``max_model_len``) reaches the
    client as HTTP 400 ``request_refused`` with the reason (before: 500 ``engine_error``); a stream
    refused after its headers were sent says so in-band. The next request is served."""
    url, engine = f"{served['scripted']}/chat/completions", served["scripted_engine"]
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    reason = "the engine refused this request: the prompt is 255 tokens; max_model_len is 256"
    refused = {"error": {"message": reason, "type": "invalid_request_error", "param": None, "code": "request_refused"}}
    ray.get(engine.script.remote([([], "refuse"), ([], "refuse"), ([], "refuse-late"), ([7, 8], "length")]))
    plain = httpx.post(url, json=body, timeout=30)
    assert (plain.status_code, plain.json()) == (400, refused)
    streamed = httpx.post(url, json={**body, "stream": True}, timeout=30)
    assert (streamed.status_code, streamed.json()) == (400, refused)
    late = httpx.post(url, json={**body, "stream": True}, timeout=30)
    events = [line[6:] for line in late.text.splitlines() if line.startswith("data: ")]
    assert late.status_code == 200 and json.loads(events[-2]) == refused and events[-1] == "[DONE]"
    assert httpx.post(url, json=body, timeout=30).status_code == 200


def test_health_says_what_the_disk_refuses(served):
    """Issue #27.2: with the disk full, /health said "ok" while every request failed. The tracker's
    refused writes now make /health 503 ``degraded`` with ``failing`` naming them."""
    tracker, url = served["trackers"]["scripted"], served["root"] + "/scripted/health"
    before = httpx.get(url, timeout=30)
    assert "failing" not in before.json()
    ray.get(
        tracker.__ray_call__.remote(lambda t: setattr(t, "storage_error", "sessions journal: No space left on device"))
    )
    try:
        full = httpx.get(url, timeout=30)
    finally:
        ray.get(tracker.__ray_call__.remote(lambda t: setattr(t, "storage_error", None)))
    assert full.status_code == 503 and full.json()["status"] == "degraded"
    assert full.json()["failing"] == ["sessions journal: No space left on device"]
    assert httpx.get(url, timeout=30).status_code == before.status_code


def test_health_names_a_judge_whose_model_fails(served):
    """Issue #24.6: a judge endpoint that timed out on every call left /health "ok" while no sample
    reached the learner. A live judge whose last calls failed is now ``failing`` with the reason, and
    /health is 503 ``degraded``; with the judge gone from the list it is as before."""
    import socket

    from ray import serve

    from clawray.actors.judge import JudgeWorkerActor
    from clawray.types import Turn

    turn = Turn(
        "s",
        1,
        [{"role": "user", "content": "1+2?"}],
        {"role": "assistant", "content": "3"},
        [1, 2],
        [3],
        [-0.1],
        0,
        "stop",
    )
    url = served["root"] + "/scripted/health"
    before = httpx.get(url, timeout=30)
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)  # accepts nothing: every call waits for the judge's timeout
    judge = JudgeWorkerActor.options(num_cpus=0).remote(
        {
            "backend": "openai",
            "m": 1,
            "base_url": f"http://127.0.0.1:{silent.getsockname()[1]}/v1",
            "api_key": "x",
            "model": "judge",
            "timeout_s": 0.2,
            "retries": 0,
        }
    )
    handle = serve.get_app_handle("scripted")
    try:
        votes = ray.get([judge.judge.remote(turn, [{"role": "user", "content": "ok?"}]) for _ in range(3)])
        assert [v.votes for v in votes] == [[None]] * 3
        handle.set_actors.remote("judges", [judge]).result()
        r = httpx.get(url, timeout=30)
        assert r.status_code == 503 and r.json()["status"] == "degraded"
        assert r.json()["judges"] == [
            {
                "name": "judge-0",
                "state": "failing",
                "reason": "3 of the last 3 calls in 120 s failed (last: TimeoutError after 0.2 s)",
            }
        ]
    finally:
        handle.set_actors.remote("judges", []).result()
        ray.kill(judge)
        silent.close()
    assert httpx.get(url, timeout=30).status_code == before.status_code
