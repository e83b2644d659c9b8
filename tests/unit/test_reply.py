"""The reply parser and the incremental detokeniser: streamed deltas merge to the whole-text parse."""

from __future__ import annotations

import itertools
import json
import random

import pytest

from clawray.serve.reply import IncrementalDetokenizer, ReplyParser, parse_reply_text, parse_tool_block


def _ids():
    counter = itertools.count()
    return lambda: f"call_{next(counter)}"


def _stream(text: str, cuts: list[int], in_reasoning: bool = False):
    """Feed ``text`` split at ``cuts``; returns (merged deltas, parser result)."""
    parser = ReplyParser(in_reasoning, make_id=_ids())
    events = []
    bounds = [0, *sorted(cuts), len(text)]
    for a, b in zip(bounds, bounds[1:]):
        events += parser.feed(text[a:b])
    events += parser.finish()
    merged = {"content": "", "reasoning": "", "tool_calls": []}
    for kind, value in events:
        if kind == "tool_call":
            merged["tool_calls"].append(value)
        else:
            merged[kind] += value
    return merged, parser.result


REPLIES = [
    "Answer: 4",
    "  \n  ",
    "<think>\nadd 2 and 2\n</think>\n\nThe sum is 4.",
    "<think>unterminated reasoning",
    'Let me compute.\n<tool_call>\n{"name": "calc", "arguments": {"expr": "2+2"}}\n</tool_call>\n',
    '<tool_call>{"name": "a", "arguments": "{\\"x\\": 1}"}</tool_call><tool_call>{"name": "b", "arguments": {}}</tool_call>',
    '<tool_call>{"name": "a", "arguments": {}}\n{"name": "b", "arguments": {"y": [1, 2]}}</tool_call>',
    "Before <tool_call>{not json}</tool_call> after",
    'text <tool_call>{"name": "a", "arguments": {}}',
    "a <tool b <think> c </think> d",
    "héllo wörld ✓ 漢字",
]


@pytest.mark.parametrize("text", REPLIES)
def test_every_chunking_gives_the_whole_text_parse(text):
    whole_merged, whole = _stream(text, [])
    rng = random.Random(0)
    for trial in range(40):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 8)))) if len(text) > 1 else []
        merged, result = _stream(text, cuts)
        assert result == whole, (trial, cuts)
        assert merged == whole_merged
        assert merged["content"] == (whole.content or "")
        assert merged["reasoning"] == (whole.reasoning_content or "")
    for i in range(len(text) + 1):  # every single cut point too
        assert _stream(text, [i] if 0 < i < len(text) else [])[1] == whole


def test_parse_cases_exact():
    r = parse_reply_text("<think>\nadd 2 and 2\n</think>\n\nThe sum is 4.")
    assert (r.reasoning_content, r.content, r.tool_calls, r.tool_parse_error) == (
        "\nadd 2 and 2\n",
        "The sum is 4.",
        [],
        False,
    )
    r = parse_reply_text("<think>unterminated")
    assert (r.reasoning_content, r.content) == ("unterminated", None)
    r = parse_reply_text("a <tool b <think> c </think> d")  # a think block that is not at the start is content
    assert (r.reasoning_content, r.content) == (None, "a <tool b <think> c </think> d")
    r = parse_reply_text("the sum is 4</think>  Done.", in_reasoning=True)  # the prompt opened the block
    assert (r.reasoning_content, r.content) == ("the sum is 4", "Done.")


def test_tool_calls_double_encoded_and_two_objects_in_one_block():
    text = (
        '<tool_call>{"name": "a", "arguments": "{\\"x\\": 1}"}</tool_call>\n'
        '<tool_call>{"name": "b", "arguments": {"y": 2}}\n{"name": "c", "parameters": "\\"{\\\\\\"z\\\\\\": 3}\\""}</tool_call>'
    )
    _, r = _stream(text, [])
    assert [(c["id"], c["function"]["name"], json.loads(c["function"]["arguments"])) for c in r.tool_calls] == [
        ("call_0", "a", {"x": 1}),
        ("call_1", "b", {"y": 2}),
        ("call_2", "c", {"z": 3}),
    ]
    assert r.content is None and not r.tool_parse_error
    assert [c["name"] for c in parse_tool_block('[{"name": "p"}, {"name": "q", "arguments": {}}]')] == ["p", "q"]


@pytest.mark.parametrize(
    "text",
    [
        "Before <tool_call>{not json}</tool_call> after",
        'x <tool_call>{"name": "a"}',
        '<tool_call>{"arguments": {}}</tool_call>',
        '<tool_call>["calculator"]</tool_call>',
        '<tool_call>{"name": "a", "arguments": {"x": NaN}}</tool_call>',
        '<tool_call>{"name": 3}</tool_call>',
        '<tool_call>{"name": "a", "arguments": [1]}</tool_call>',
    ],
)
def test_bad_tool_block_is_raw_content_and_flagged(text):
    r = parse_reply_text(text)
    assert r.tool_calls == [] and r.tool_parse_error and r.content == text.strip()


class _ByteTokenizer:
    """Each token is one UTF-8 byte: multi-byte characters span several tokens."""

    @staticmethod
    def decode(ids):
        return bytes(ids).decode("utf-8", errors="replace")


def test_detokenizer_emits_only_whole_characters():
    text = "héllo ✓ 漢字!"
    ids = list(text.encode("utf-8"))
    det = IncrementalDetokenizer(_ByteTokenizer.decode)
    deltas = [det.add([i]) for i in ids]
    deltas.append(det.finish())
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)
    # "✓" is 3 bytes: its first two tokens give nothing, the third gives the whole character
    k = text.encode("utf-8").index("✓".encode("utf-8"))
    assert deltas[k : k + 3] == ["", "", "✓"]


def test_detokenizer_matches_the_real_tokenizer(tiny_model):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    text = 'What is 2+2? héllo ✓ 漢字 <tool_call>{"a": 1}</tool_call>'
    ids = tok.encode(text, add_special_tokens=False)
    det = IncrementalDetokenizer(lambda x: tok.decode(x, skip_special_tokens=False))
    out = "".join(det.add([i]) for i in ids) + det.finish()
    assert out == tok.decode(ids, skip_special_tokens=False) == text


def test_without_offered_tools_a_tool_block_is_content():
    """As vLLM: tool calls are parsed only when the request offers tools (and tool_choice is not
    "none"); otherwise the block is text, in every chunking."""
    text = '<think>\nplan\n</think>\n\nLet me compute.\n<tool_call>\n{"name": "calc", "arguments": {}}\n</tool_call>\n'
    whole = parse_reply_text(text, tools=False)
    assert (whole.reasoning_content, whole.tool_calls, whole.tool_parse_error) == ("\nplan\n", [], False)
    assert whole.content == 'Let me compute.\n<tool_call>\n{"name": "calc", "arguments": {}}\n</tool_call>'
    for cut in range(len(text) + 1):
        parser = ReplyParser(tools=False)
        events = parser.feed(text[:cut]) + parser.feed(text[cut:]) + parser.finish()
        assert "".join(v for k, v in events if k == "content") == whole.content
        assert parser.result == whole
