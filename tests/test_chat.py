import json

import pytest

from clawray.chat import RequestError, normalize_messages, parse_reply


def test_normalize_developer_list_content_and_tool_call_arguments():
    msgs = normalize_messages([
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "calc", "arguments": '{"x": 1}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "1"},
    ])
    assert msgs[0] == {"role": "system", "content": "be brief"}
    assert msgs[1] == {"role": "user", "content": "ab"}
    assert msgs[2]["tool_calls"][0]["function"] == {"name": "calc", "arguments": {"x": 1}}
    assert msgs[3] == {"role": "tool", "content": "1", "tool_call_id": "c1"}


@pytest.mark.parametrize("messages, param", [
    (None, "messages"),
    ([], "messages"),
    ("hello", "messages"),
    ([{"role": "wizard", "content": "x"}], "messages[0].role"),
    ([{"role": "user", "content": "x"}, {"content": "no role"}], "messages[1].role"),
    ([{"role": "user", "content": 5}], "messages[0].content"),
    ([{"role": "user"}], "messages[0].content"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], "messages[0].content"),
    ([{"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f", "arguments": "{bad"}}]}],
     "messages[0].tool_calls"),
    (["not an object"], "messages[0]"),
])
def test_normalize_rejects_with_param(messages, param):
    with pytest.raises(RequestError) as e:
        normalize_messages(messages)
    assert e.value.param == param


def test_parse_reply_plain_text():
    assert parse_reply("Answer: 4") == ("Answer: 4", [], False)
    assert parse_reply("  ") == (None, [], False)


def test_parse_reply_tool_calls_object_and_string_arguments():
    text = ('Let me compute.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "2*3"}}\n</tool_call>'
            '<tool_call>{"name": "calculator", "arguments": "{\\"expression\\": \\"1+1\\"}"}</tool_call>')
    content, calls, err = parse_reply(text)
    assert (content, err) == ("Let me compute.", False)
    assert [c["function"]["name"] for c in calls] == ["calculator", "calculator"]
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [{"expression": "2*3"}, {"expression": "1+1"}]
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in calls)


@pytest.mark.parametrize("text", [
    "<tool_call>{not json}</tool_call>",
    '<tool_call>{"arguments": {}}</tool_call>',
    '<tool_call>["calculator"]</tool_call>',
])
def test_parse_reply_bad_block_is_content_with_flag(text):
    assert parse_reply(text) == (text, [], True)
