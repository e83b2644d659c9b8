import pytest

from clawray.chat import (
    RequestError,
    conversation_key,
    conversation_keys,
    end_of_turn_ids,
    normalize_messages,
    render_key,
)


def test_normalize_developer_list_content_and_tool_call_arguments():
    msgs = normalize_messages(
        [
            {"role": "developer", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "calc", "arguments": '{"x": 1}'}}],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "1"},
        ]
    )
    assert msgs[0] == {"role": "system", "content": "be brief"}
    assert msgs[1] == {"role": "user", "content": "a\nb"}  # text parts joined by newlines, as vLLM renders them
    assert msgs[2]["tool_calls"][0]["function"] == {"name": "calc", "arguments": {"x": 1}}
    assert msgs[3] == {"role": "tool", "content": "1", "tool_call_id": "c1"}


@pytest.mark.parametrize(
    "messages, param",
    [
        (None, "messages"),
        ([], "messages"),
        ("hello", "messages"),
        ([{"role": "wizard", "content": "x"}], "messages[0].role"),
        ([{"role": "user", "content": "x"}, {"content": "no role"}], "messages[1].role"),
        ([{"role": "user", "content": 5}], "messages[0].content"),
        ([{"role": "user"}], "messages[0].content"),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], "messages[0].content"),
        (
            [{"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f", "arguments": "{bad"}}]}],
            "messages[0].tool_calls",
        ),
        (["not an object"], "messages[0]"),
    ],
)
def test_normalize_rejects_with_param(messages, param):
    with pytest.raises(RequestError) as e:
        normalize_messages(messages)
    assert e.value.param == param


def test_reasoning_and_argument_forms_normalise_alike():
    as_string = normalize_messages(
        [
            {"role": "user", "content": "q"},
            {
                "role": "assistant",
                "content": "a",
                "reasoning": "think",
                "tool_calls": [{"id": "1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}],
            },
        ]
    )
    as_object = normalize_messages(
        [
            {"role": "user", "content": "q"},
            {
                "role": "assistant",
                "content": "a",
                "reasoning_content": "think",
                "tool_calls": [{"id": "1", "type": "function", "function": {"name": "f", "arguments": {"x": 1}}}],
            },
        ]
    )
    assert as_string == as_object
    assert as_string[1]["reasoning_content"] == "think" and as_string[1]["tool_calls"][0]["function"]["arguments"] == {
        "x": 1
    }


def test_conversation_key_ignores_echo_form_but_not_content():
    served = [
        {"role": "user", "content": "q"},
        {
            "role": "assistant",
            "content": "a ",
            "reasoning_content": "r",
            "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}],
        },
    ]
    echoed = normalize_messages(
        [
            {"role": "user", "content": "q"},
            {
                "role": "assistant",
                "content": "a",
                "tool_calls": [{"id": "other", "type": "function", "function": {"name": "f", "arguments": {"x": 1}}}],
            },
        ]
    )
    assert conversation_key(served) == conversation_key(echoed)
    changed = [dict(echoed[0]), {**echoed[1], "tool_calls": [{"function": {"name": "f", "arguments": {"x": 2}}}]}]
    assert conversation_key(changed) != conversation_key(served)
    assert conversation_key([{"role": "user", "content": "q2"}, echoed[1]]) != conversation_key(served)


def test_conversation_keys_are_the_prefix_keys():
    msgs = normalize_messages(
        [
            {"role": "system", "content": "s"},
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": "a"},
            {"role": "tool", "content": "t", "tool_call_id": "1"},
        ]
    )
    assert conversation_keys(msgs) == [conversation_key(msgs[: k + 1]) for k in range(len(msgs))]


class _Tok:
    eos_token_id = 2


def test_end_of_turn_ids_join_tokenizer_generation_config_and_request_ids(tmp_path):
    import json

    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 7}))
    assert end_of_turn_ids(str(tmp_path), _Tok()) == [2, 7]  # no generation config: config.json's
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))  # Qwen-style list
    assert end_of_turn_ids(str(tmp_path), _Tok()) == [2, 0]  # the generation config wins over config.json
    assert end_of_turn_ids(str(tmp_path), _Tok(), [9, 0]) == [2, 0, 9]
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": ["x"]}))
    with pytest.raises(ValueError, match="eos_token_id"):
        end_of_turn_ids(str(tmp_path), _Tok())


def test_render_key_tells_tool_lists_apart():
    calc = [{"type": "function", "function": {"name": "calculator"}}]
    weather = [{"type": "function", "function": {"name": "get_weather"}}]
    assert render_key(calc) == render_key([dict(calc[0])]) != render_key(weather)
    assert render_key(None) != render_key(calc)


def test_a_tool_call_echoed_by_a_javascript_client_keeps_its_key():
    """OpenClaw echoes a served tool call's arguments as ``JSON.stringify(JSON.parse(args))``: numbers
    come back as JavaScript writes doubles. ``{"timeoutSeconds": 30.0}`` came back as ``30``, the keys
    differed, and the turn was dropped as a branch (without a session id, so was the conversation)."""
    from clawray.chat import attribution_keys, js_value

    def call(arguments):
        return [
            {"role": "user", "content": "q"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [{"function": {"name": "exec", "arguments": arguments}}],
            },
        ]

    # served (Python's json.dumps) -> echoed (node: JSON.stringify(JSON.parse(served)))
    pairs = [
        ('{"timeoutSeconds": 30.0}', '{"timeoutSeconds":30}'),
        ('{"n": 1e3, "z": -0.0}', '{"n":1000,"z":0}'),
        ('{"big": 12345678901234567891}', '{"big":12345678901234567000}'),
        ('{"x": [1.5, true, null, "30.0"]}', '{"x":[1.5,true,null,"30.0"]}'),
    ]
    for served, echoed in pairs:
        assert conversation_key(call(served)) == conversation_key(call(echoed)), served
        assert attribution_keys(call(served))[-1] == attribution_keys(call(echoed))[-1], served
    # what differs still differs: a value, a string that holds a number, a boolean that is 1
    assert conversation_key(call('{"t": 30}')) != conversation_key(call('{"t": 31}'))
    assert conversation_key(call('{"t": 30}')) != conversation_key(call('{"t": "30"}'))
    assert conversation_key(call('{"t": true}')) != conversation_key(call('{"t": 1}'))
    assert js_value({"a": [2.0, 2.5, True, 10**400]}) == {"a": [2, 2.5, True, None]}
