import json

import pytest

from clawray.chat import RequestError
from clawray.serve.protocol import MAX_SESSION_ID_CHARS, decode_body, parse_chat_request

MSG = [{"role": "user", "content": "hi"}]


def parse(body, headers=None):
    return parse_chat_request(body, headers or {}, default_max_tokens=64, default_temperature=1.0, max_n=8)


def test_session_outcome_from_header_or_body_header_wins():
    assert parse({"messages": MSG}).outcome is None
    assert parse({"messages": MSG, "session_outcome": -1}).outcome == -1.0
    assert parse({"messages": MSG, "session_outcome": 0.5}, {"x-session-outcome": " 1 "}).outcome == 1.0
    texts = ["-1", "+0.5", ".5", "1.", "2e-1", " -1E0 "]
    outcomes = [parse({"messages": MSG}, {"x-session-outcome": t}).outcome for t in texts]
    assert outcomes == [-1.0, 0.5, 0.5, 1.0, 0.2, -1.0]


def test_prompt_chars_counts_every_field_a_template_may_render():
    """The pre-tokenisation length check read content and tool calls only: 6.7 MB of an assistant's
    ``reasoning_content`` counted as 2 characters and was tokenised on the event loop (6.6 s)."""
    from clawray.serve.protocol import prompt_chars

    plain = [{"role": "user", "content": "hi"}]
    assert prompt_chars(plain) == len('{"role": "user", "content": "hi"}')
    long = {"role": "assistant", "content": "ok", "reasoning_content": "r" * 100_000}
    named = {"role": "tool", "content": "x", "tool_call_id": "c" * 50_000, "name": "n" * 50_000}
    assert prompt_chars([long]) > 100_000 and prompt_chars([named]) > 100_000
    assert prompt_chars([{"role": "user", "content": "日本" * 1000}]) < 2100  # a character counts once, not as \\uXXXX


def test_session_headers_are_read_as_the_proxy_routes_them_and_a_conflicting_repeat_is_refused():
    """Ray Serve's proxy routes on an ``x-session-id`` matched case-insensitively with ``_`` as ``-``;
    the server reads the same header, over every copy the request sent (Starlette lists repeats)."""
    from starlette.datastructures import Headers

    def headers(*pairs):
        return Headers(raw=[(k.encode(), v.encode()) for k, v in pairs])

    assert parse({"messages": MSG}, headers(("X_Session_Id", "s1"))).session_id == "s1"
    assert parse({"messages": MSG}, headers(("x-session-id", "s1"), ("x_session_id", "s1"))).session_id == "s1"
    req = parse(
        {"messages": MSG}, headers(("x_turn_type", "side"), ("x_session_done", "1"), ("x_session_outcome", "1"))
    )
    assert (req.turn_type, req.done, req.outcome) == ("side", True, 1.0)
    for name, param in [
        ("x-session-id", "session_id"),
        ("x-turn-type", "turn_type"),
        ("x-session-done", "session_done"),
    ]:
        with pytest.raises(RequestError) as e:
            parse({"messages": MSG}, headers((name, "main"), (name.replace("-", "_"), "side")))
        assert e.value.param == param and "different values" in str(e.value)
    with pytest.raises(RequestError) as e:  # an int past the double range: a 400 naming it, no OverflowError
        parse({"messages": MSG, "session_outcome": 10**400})
    assert str(e.value) == "session_outcome must be finite and within +-1e+06, got an integer of 401+ digits"
    assert parse({"messages": MSG, "tools": [], "tool_choice": "auto"}).tools is None  # [] is accepted, as vLLM


def test_json_nested_past_the_depth_limit_is_a_400_wherever_it_stands():
    """Tool-call arguments 600 levels deep passed validation, then the attribution keys raised
    RecursionError: a 500. Every JSON clawray decodes (a body, arguments given as a string, the
    policy's own tool calls) stops at MAX_JSON_DEPTH levels."""
    from clawray.chat import MAX_JSON_DEPTH, attribution_keys
    from clawray.serve.reply import parse_reply_text

    def deep(n):
        return "[" * n + "]" * n

    def call(args):
        return {"id": "c", "type": "function", "function": {"name": "f", "arguments": args}}

    def body(args):
        return {"messages": [MSG[0], {"role": "assistant", "content": None, "tool_calls": [call(args)]}]}

    with pytest.raises(RequestError) as e:
        parse(body('{"a": ' + deep(600) + "}"))
    assert e.value.param == "messages[1].tool_calls"
    with pytest.raises(RequestError) as e:
        decode_body(json.dumps(body(json.loads(deep(MAX_JSON_DEPTH)))).encode())
    assert e.value.code == "invalid_json" and "nested deeper than 100 levels" in str(e.value)
    ok = parse(body('{"a": ' + deep(MAX_JSON_DEPTH - 1) + "}"))  # 100 levels with the object: accepted
    assert len(attribution_keys(ok.messages)) == 2
    reply = parse_reply_text('<tool_call>\n{"name": "f", "arguments": {"a": ' + deep(200) + "}}\n</tool_call>")
    assert reply.tool_calls == [] and reply.tool_parse_error


def test_tiny_temperature_is_greedy_and_session_header_is_utf8():
    assert parse({"messages": MSG, "temperature": 1e-45}).temperature == 0.0
    assert parse({"messages": MSG, "temperature": 1e-5}).temperature == 1e-5
    raw_header = "séss🙂".encode("utf-8").decode("latin-1")  # what the HTTP server hands over
    assert parse({"messages": MSG}, {"x-session-id": raw_header}).session_id == "séss🙂"


def test_stream_and_n_fields():
    req = parse({"messages": MSG, "stream": True, "stream_options": {"include_usage": True}})
    assert (req.stream, req.include_usage, req.n) == (True, True, 1)
    req = parse({"messages": MSG, "n": 3, "stream": False})
    assert (req.stream, req.include_usage, req.n) == (False, False, 3)
    assert parse({"messages": MSG, "n": 3, "stream": True}).n == 3


def test_defaults_and_session_fields():
    r = parse({"messages": MSG, "session_id": "body-s", "turn_type": "SIDE", "session_done": "yes"})
    assert (r.max_tokens, r.temperature, r.top_p, r.seed, r.model) == (64, 1.0, 1.0, None, None)
    assert (r.session_id, r.turn_type, r.done) == ("body-s", "side", True)
    r = parse({"messages": MSG, "session_id": "body"}, {"x-session-id": "hdr", "x-session-done": "false"})
    assert (r.session_id, r.turn_type, r.done) == ("hdr", "main", False)
    assert parse({"messages": MSG, "max_completion_tokens": 9}).max_tokens == 9
    # OpenAI's `user` is the end user, whose conversations the server tells apart: no session id
    r = parse({"messages": MSG, "user": "alice"})
    assert (r.session_id, r.user) == (None, "alice")
    r = parse({"messages": MSG, "user": "u"}, {"x-session-id": "h"})
    assert (r.session_id, r.user) == ("h", None)
    # the routing middleware's copy of `user` in x-session-id (marked) is read as the user
    r = parse({"messages": MSG, "user": "alice"}, {"x-session-id": "alice", "x-clawray-routed-user": "1"})
    assert (r.session_id, r.user) == (None, "alice")


def test_current_openai_fields_win_over_their_deprecated_aliases():
    """OpenAI / vLLM semantics: max_completion_tokens over max_tokens (vLLM: ``max_completion_tokens
    or max_tokens``); X-Session-Id over body session_id over user."""
    assert parse({"messages": MSG, "max_completion_tokens": 3, "max_tokens": 40}).max_tokens == 3
    assert parse({"messages": MSG, "max_tokens": 40, "max_completion_tokens": 3}).max_tokens == 3
    assert parse({"messages": MSG, "max_tokens": 40}).max_tokens == 40
    assert parse({"messages": MSG, "max_completion_tokens": None, "max_tokens": 40}).max_tokens == 40
    assert parse({"messages": MSG, "session_id": "s", "user": "u"}).session_id == "s"
    assert parse({"messages": MSG, "session_id": "s", "user": "u"}, {"x-session-id": "h"}).session_id == "h"
    assert parse({"messages": MSG, "session_id": "s", "user": "u"}).user is None


def test_neutral_values_of_implemented_later_fields_and_metadata_fields_are_accepted():
    r = parse(
        {
            "messages": MSG,
            "stop": [],
            "logprobs": False,
            "top_logprobs": 0,
            "presence_penalty": 0,
            "frequency_penalty": 0.0,
            "logit_bias": {},
            "response_format": {"type": "text"},
            "parallel_tool_calls": True,
            "modalities": ["text"],
            "top_k": -1,
            "min_p": 0,
            "repetition_penalty": 1.0,
            "metadata": {"a": "b"},
            "store": False,
            "service_tier": "auto",
            "prompt_cache_key": "k",
            "safety_identifier": "h",
            "stop_token_ids": [7, 8],
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    )
    assert (r.stop_token_ids, r.include_usage, r.max_tokens) == ([7, 8], True, 64)
    assert parse({"messages": MSG}).stop_token_ids == []


def test_tool_choice_none_drops_tools():
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    assert parse({"messages": MSG, "tools": tools}).tools == tools
    assert parse({"messages": MSG, "tools": tools, "tool_choice": "none"}).tools is None


@pytest.mark.parametrize(
    "body, headers, param, code",
    [
        ({"messages": MSG, "session_id": 5}, {}, "session_id", "invalid_request"),
        ({"messages": MSG, "session_id": "x" * (MAX_SESSION_ID_CHARS + 1)}, {}, "session_id", "invalid_request"),
        ({"messages": MSG, "session_id": ""}, {}, "session_id", "invalid_request"),
        ({"messages": MSG, "model": 5}, {}, "model", "invalid_request"),
        ({"messages": MSG, "user": {"id": 1}}, {}, "user", "invalid_request"),
        ({"messages": MSG}, {"x-session-done": "maybe"}, "session_done", "invalid_request"),
        ({"messages": MSG, "session_done": {}}, {}, "session_done", "invalid_request"),
        ({"messages": MSG}, {"x-session-outcome": "solved"}, "session_outcome", "invalid_request"),
        ({"messages": MSG}, {"x-session-outcome": "inf"}, "session_outcome", "invalid_request"),
        ({"messages": MSG}, {"x-session-outcome": "1_0"}, "session_outcome", "invalid_request"),  # float(): 10.0
        ({"messages": MSG, "session_outcome": "-0_5"}, {}, "session_outcome", "invalid_request"),
        ({"messages": MSG, "session_outcome": True}, {}, "session_outcome", "invalid_request"),
        ({"messages": MSG, "session_outcome": 1e7}, {}, "session_outcome", "invalid_request"),
        ({"messages": MSG, "session_outcome": "nan"}, {}, "session_outcome", "invalid_request"),
        ({"messages": MSG, "session_outcome": 10**400}, {}, "session_outcome", "invalid_request"),  # past a double
        ({"messages": MSG, "tool_choice": "auto"}, {}, "tool_choice", "invalid_request"),  # no tools: as OpenAI, vLLM
        ({"messages": MSG, "tool_choice": "none"}, {}, "tool_choice", "invalid_request"),
        ({"messages": MSG}, {"x-turn-type": "garbage"}, "turn_type", "invalid_request"),
        ({"messages": MSG, "temperature": float("nan")}, {}, "temperature", "invalid_request"),
        ({"messages": MSG, "temperature": True}, {}, "temperature", "invalid_request"),
        ({"messages": MSG, "max_tokens": 1.5}, {}, "max_tokens", "invalid_request"),
        ({"messages": MSG, "top_p": 0}, {}, "top_p", "invalid_request"),
        ({"messages": MSG, "stream": "yes"}, {}, "stream", "invalid_request"),
        ({"messages": MSG, "stream_options": {"include_usage": True}}, {}, "stream_options", "invalid_request"),
        (
            {"messages": MSG, "stream": True, "stream_options": {"include_usage": 1}},
            {},
            "stream_options.include_usage",
            "invalid_request",
        ),
        ({"messages": MSG, "n": 0}, {}, "n", "invalid_request"),
        ({"messages": MSG, "n": 99}, {}, "n", "invalid_request"),
        (
            {"messages": [{"role": "assistant", "content": "a", "reasoning": 5}]},
            {},
            "messages[0].reasoning_content",
            "invalid_request",
        ),
        ({"messages": MSG, "stop": ["e"]}, {}, "stop", "unsupported"),
        ({"messages": MSG, "logprobs": True}, {}, "logprobs", "unsupported"),
        ({"messages": MSG, "presence_penalty": 0.5}, {}, "presence_penalty", "unsupported"),
        ({"messages": MSG, "tools": [], "tool_choice": "required"}, {}, "tool_choice", "unsupported"),
        ({"messages": MSG, "tools": [], "tool_choice": 5}, {}, "tool_choice", "invalid_request"),
        (
            {"messages": MSG, "tools": [{"type": "garbage", "function": {"name": "f"}}]},
            {},
            "tools[0].type",
            "invalid_request",
        ),
        (
            {"messages": MSG, "tools": [{"function": {"name": "f", "parameters": "lol"}}]},
            {},
            "tools[0].function.parameters",
            "invalid_request",
        ),
        # a schema the reply parser reads: properties an object of schemas, types names, required names
        (
            {"messages": MSG, "tools": [{"function": {"name": "f", "parameters": {"properties": ["x"]}}}]},
            {},
            "tools[0].function.parameters.properties",
            "invalid_request",
        ),
        (
            {"messages": MSG, "tools": [{"function": {"name": "f", "parameters": {"properties": {"x": "int"}}}}]},
            {},
            "tools[0].function.parameters.properties.x",
            "invalid_request",
        ),
        (
            {
                "messages": MSG,
                "tools": [{"function": {"name": "f", "parameters": {"properties": {"x": {"type": {"a": 1}}}}}}],
            },
            {},
            "tools[0].function.parameters.properties.x.type",
            "invalid_request",
        ),
        (
            {"messages": MSG, "tools": [{"function": {"name": "f", "parameters": {"required": [{"x": 1}]}}}]},
            {},
            "tools[0].function.parameters.required",
            "invalid_request",
        ),
        (
            {
                "messages": [
                    {
                        "role": "assistant",
                        "content": None,
                        "tool_calls": [{"function": {"name": "f", "arguments": "[1, 2]"}}],
                    }
                ]
            },
            {},
            "messages[0].tool_calls",
            "invalid_request",
        ),
        (
            {"messages": [{"role": "tool", "content": "1", "tool_call_id": {"a": 1}}]},
            {},
            "messages[0].tool_call_id",
            "invalid_request",
        ),
        ({"messages": [{"role": "user", "content": "hi", "name": 5}]}, {}, "messages[0].name", "invalid_request"),
        ({"messages": MSG, "turn_type": False}, {}, "turn_type", "invalid_request"),
        ({"messages": MSG, "turn_type": ""}, {}, "turn_type", "invalid_request"),
        (
            {"messages": MSG, "tools": [{"type": "function", "function": {"name": ""}}]},
            {},
            "tools[0]",
            "invalid_request",
        ),
        (
            {
                "messages": [
                    {
                        "role": "assistant",
                        "content": None,
                        "tool_calls": [{"function": {"name": "f", "arguments": '{"a": NaN}'}}],
                    }
                ]
            },
            {},
            "messages[0].tool_calls",
            "invalid_request",
        ),
        (
            {
                "messages": [
                    {
                        "role": "assistant",
                        "content": None,
                        "tool_calls": [{"function": {"name": "f", "arguments": '{"a": ' + "9" * 5000 + "}"}}],
                    }
                ]
            },
            {},
            "messages[0].tool_calls",
            "invalid_request",
        ),
        (
            {"messages": MSG},
            {"x-session-id": "\xff\xfe".encode("latin-1").decode("latin-1")},
            "session_id",
            "invalid_request",
        ),
        # both token caps are validated, whichever wins
        ({"messages": MSG, "max_completion_tokens": 3, "max_tokens": 0}, {}, "max_tokens", "invalid_request"),
        (
            {"messages": MSG, "max_completion_tokens": 0, "max_tokens": 40},
            {},
            "max_completion_tokens",
            "invalid_request",
        ),
        # deprecated aliases, unknown fields, non-neutral values of fields implemented later: never ignored
        ({"messages": MSG, "functions": [{"name": "f", "parameters": {}}]}, {}, "functions", "unsupported"),
        ({"messages": MSG, "function_call": "auto"}, {}, "function_call", "unsupported"),
        ({"messages": MSG, "max_token": 5}, {}, "max_token", "unsupported"),
        ({"messages": MSG, "reasoning_effort": "low"}, {}, "reasoning_effort", "unsupported"),
        ({"messages": MSG, "audio": {"voice": "x"}}, {}, "audio", "unsupported"),
        (
            {"messages": MSG, "chat_template_kwargs": {"enable_thinking": False}},
            {},
            "chat_template_kwargs",
            "unsupported",
        ),
        ({"messages": MSG, "parallel_tool_calls": False}, {}, "parallel_tool_calls", "unsupported"),
        ({"messages": MSG, "response_format": {"type": "json_object"}}, {}, "response_format", "unsupported"),
        ({"messages": MSG, "top_logprobs": 2}, {}, "top_logprobs", "unsupported"),
        ({"messages": MSG, "logit_bias": {"5": 10}}, {}, "logit_bias", "unsupported"),
        ({"messages": MSG, "modalities": ["text", "audio"]}, {}, "modalities", "unsupported"),
        ({"messages": MSG, "top_k": 5}, {}, "top_k", "unsupported"),
        ({"messages": MSG, "min_p": 0.1}, {}, "min_p", "unsupported"),
        ({"messages": MSG, "repetition_penalty": 1.2}, {}, "repetition_penalty", "unsupported"),
        ({"messages": MSG, "stop": "END"}, {}, "stop", "unsupported"),
        (
            {"messages": MSG, "stream": True, "stream_options": {"continuous_usage_stats": True}},
            {},
            "stream_options.continuous_usage_stats",
            "unsupported",
        ),
        ({"messages": MSG, "metadata": "x"}, {}, "metadata", "invalid_request"),
        ({"messages": MSG, "store": "yes"}, {}, "store", "invalid_request"),
        ({"messages": MSG, "prompt_cache_key": 5}, {}, "prompt_cache_key", "invalid_request"),
        ({"messages": MSG, "stop_token_ids": [1, -1]}, {}, "stop_token_ids", "invalid_request"),
        ({"messages": MSG, "stop_token_ids": [True]}, {}, "stop_token_ids", "invalid_request"),
        ({"messages": MSG, "stop_token_ids": 5}, {}, "stop_token_ids", "invalid_request"),
    ],
)
def test_rejections_name_the_field(body, headers, param, code):
    with pytest.raises(RequestError) as e:
        parse(body, headers)
    assert (e.value.param, e.value.code) == (param, code)


@pytest.mark.parametrize(
    "raw, code",
    [
        (b"{bad", "invalid_json"),
        (b"[1]", "invalid_json"),
        (b"\xff\xfe", "invalid_json"),
        (b'{"messages": ' + b"[" * 100000 + b"]" * 100000 + b"}", "invalid_json"),
        (json.dumps({"messages": [{"role": "user", "content": "\ud800"}]}).encode(), "invalid_unicode"),
        (b'{"messages": [], "foo": ' + b"1" * 4400 + b"}", "invalid_json"),  # over Python's int digit limit
        (b'{"temperature": NaN}', "invalid_json"),
        (b'{"tools": [{"function": {"name": "f", "parameters": {"x": Infinity}}}]}', "invalid_json"),
        (b'{"temperature": 1e999}', "invalid_json"),  # overflows to inf: json.dumps would write Infinity
        (b'{"messages": [{"role": "user", "content": "\\udc00 low"}]}', "invalid_unicode"),  # an escape, unpaired
        (json.dumps({"messages": [{"role": "user", "content": "hi"}]}).encode("utf-16"), "invalid_json"),
    ],
)
def test_decode_body_rejections(raw, code):
    with pytest.raises(RequestError) as e:
        decode_body(raw)
    assert e.value.code == code


def test_decode_body_accepts_unicode_and_nul():
    assert decode_body('{"a": "h\\u00e9 \\u0000 \U0001f600"}'.encode())["a"] == "hé \x00 \U0001f600"


@pytest.mark.parametrize(
    "arguments",
    ['{"a": "\\ud800"}', '{"a": "\\ud83d\\u0041"}', '{"x": 1e999}', '{"x": -1E+400}'],
)
def test_history_tool_call_arguments_that_no_encoder_writes_back_are_a_400(arguments):
    """An assistant message's ``function.arguments`` string holding a lone surrogate escape gave an
    HTTP 500 (the conversation key could not encode it), and ``1e999`` was read as inf: both are the
    client's input, refused as ``invalid_request`` on that message's tool_calls."""
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": arguments}}
    raw = json.dumps(
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [call]}]}
    ).encode()
    with pytest.raises(RequestError) as e:
        parse(decode_body(raw), {})
    assert (e.value.param, e.value.code, str(e.value)) == (
        "messages[1].tool_calls",
        "invalid_request",
        "messages[1].tool_calls[0].function.arguments is not valid JSON",
    )
    # a surrogate pair (an emoji) and a large finite number are fine
    ok = {**call, "function": {"name": "f", "arguments": '{"a": "\\ud83d\\ude00", "x": 1e308}'}}
    raw = json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": [ok]}]})
    req = parse(decode_body(raw.encode()), {})
    assert req.messages[1]["tool_calls"][0]["function"]["arguments"] == {"a": "\U0001f600", "x": 1e308}


def test_any_openai_user_field_is_accepted_and_the_seed_bound_follows_this_requests_n():
    """``user: ""`` or a ``user`` over 256 characters got a 400 naming ``session_id``, a field the
    client never sent (OpenAI takes any string); ``seed: 2**63 - 1`` with ``n = 1`` was refused
    because the bound reserved room for ``serve.max_n`` choices."""
    from clawray.serve.protocol import user_session

    assert parse({"messages": MSG, "user": ""}).user is None
    long = "u" * (MAX_SESSION_ID_CHARS + 1)
    sid = parse({"messages": MSG, "user": long}).user
    assert sid == user_session(long) and sid.startswith("user-") and len(sid) == 37
    assert user_session("u" * MAX_SESSION_ID_CHARS) == "u" * MAX_SESSION_ID_CHARS
    assert parse({"messages": MSG, "seed": (1 << 63) - 1}).seed == (1 << 63) - 1
    assert parse({"messages": MSG, "seed": (1 << 63) - 2, "n": 2}).seed == (1 << 63) - 2  # seeds s, s + 1
    with pytest.raises(RequestError) as e:
        parse({"messages": MSG, "seed": (1 << 63) - 1, "n": 2})
    assert e.value.param == "seed"
    with pytest.raises(RequestError) as e:
        parse({"messages": MSG}, {"x-session-id": "h" * (MAX_SESSION_ID_CHARS + 1)})
    assert e.value.param == "X-Session-Id"
