"""The reply parser and the incremental detokeniser: streamed deltas merge to the whole-text parse."""

from __future__ import annotations

import itertools
import json
import random

import pytest

from clawray.serve.reply import (
    IncrementalDetokenizer,
    ReplyParser,
    parse_reply_text,
    parse_tool_block,
    tool_parameter_types,
)


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


def test_reply_decoder_hides_special_tokens_but_keeps_the_grammar_tags(tiny_model):
    """Issue #24.5: ``<|endoftext|>`` (id 0) and ``<|im_start|>`` (id 1) sampled inside a reply never
    reach the client as text (vLLM's skip_special_tokens); the tiny tokenizer marks ``<tool_call>``
    special too, and the parser still sees it, so the tool call is parsed."""
    from transformers import AutoTokenizer

    from clawray.serve.reply import ReplyDecoder

    tok = AutoTokenizer.from_pretrained(tiny_model)
    decode = ReplyDecoder(tok)
    assert decode.hidden == frozenset({0, 1, 2, 5, 6})  # endoftext, im_start, im_end, tool_response tags
    hi = tok.encode("hello", add_special_tokens=False)
    assert decode([1, *hi, 0]) == "hello"
    assert decode(hi + [2]) == "hello"
    call = tok.encode('{"name": "f", "arguments": {}}', add_special_tokens=False)
    text = decode([*hi, 0, 3, *call, 4])
    assert text == 'hello<tool_call>{"name": "f", "arguments": {}}</tool_call>'
    parsed = parse_reply_text(text)
    assert parsed.content == "hello" and parsed.tool_calls[0]["function"]["name"] == "f"
    detok = IncrementalDetokenizer(decode)
    assert detok.add([1]) == "" and detok.add(hi) == "hello" and detok.add([0]) == ""


QWEN3_CODER_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "zip": {"type": "string"},
                    "days": {"type": "integer"},
                    "units": {"type": ["string", "null"]},
                    "opts": {"type": "object"},
                },
            },
        },
    }
]


def test_qwen3_coder_xml_tool_call_is_typed_by_the_tools_schema():
    """Issue #24.4: a Qwen3-Coder / Qwen3.5 call (``<function=...>`` with ``<parameter=...>`` blocks)
    is a tool call, its values typed by the schema (a string parameter that looks like a number stays
    a string), not content with ``tool_parse_error``."""
    text = (
        "Let me check.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
        "<parameter=zip>\n75001\n</parameter>\n<parameter=days>\n3\n</parameter>\n"
        '<parameter=units>\nnull\n</parameter>\n<parameter=opts>\n{"hourly": true}\n</parameter>\n'
        "<parameter=extra>\n[1, 2]\n</parameter>\n</function>\n</tool_call>"
    )
    parsed = parse_reply_text(text, tools=QWEN3_CODER_TOOLS)
    assert not parsed.tool_parse_error and parsed.content == "Let me check."
    (call,) = parsed.tool_calls
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {
        "city": "Paris",
        "zip": "75001",
        "days": 3,
        "units": None,
        "opts": {"hourly": True},
        "extra": [1, 2],
    }
    # without schemas (tools=True) a JSON-looking value is decoded, text stays text
    (call,) = parse_reply_text(text, tools=True).tool_calls
    assert json.loads(call["function"]["arguments"])["zip"] == 75001
    # every chunking gives the same result
    for cut in range(0, len(text), 7):
        events, result = _stream(text, [cut])
        assert [json.loads(tc["function"]["arguments"])["city"] for tc in result.tool_calls] == ["Paris"]


@pytest.mark.parametrize(
    "body",
    [
        "<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n",  # function never closed
        "<function=>\n</function>",  # no name
        "<function=get_weather>\nParis\n</function>",  # text outside a parameter
        "<function=get_weather>\n</function>\nand more",  # text after the function
    ],
)
def test_malformed_qwen3_coder_blocks_are_a_tool_parse_error(body):
    parsed = parse_reply_text(f"<tool_call>\n{body}\n</tool_call>", tools=QWEN3_CODER_TOOLS)
    assert parsed.tool_parse_error and parsed.tool_calls == []
    with pytest.raises(ValueError):
        parse_tool_block(body)


def test_two_qwen3_coder_functions_in_one_block_and_hermes_still_parses():
    two = "<function=a>\n<parameter=x>\n1\n</parameter>\n</function>\n<function=b>\n</function>"
    assert parse_tool_block(two) == [{"name": "a", "arguments": {"x": 1}}, {"name": "b", "arguments": {}}]
    assert parse_tool_block('{"name": "a", "arguments": {"x": "1"}}') == [{"name": "a", "arguments": {"x": "1"}}]


def _lazy_xml_block(body: str) -> list[dict]:
    """The Qwen3-Coder block reader as lazy patterns (the one-pass reader replaced it: from every
    unclosed opening they rescan the rest of the block), the reference the one-pass reader must equal."""
    import re

    function = re.compile(r"<function=([^<>\n]*)>(.*?)</function>", re.DOTALL)
    parameter = re.compile(r"<parameter=([^<>\n]*)>(.*?)</parameter>", re.DOTALL)
    calls, rest = [], function.sub("", body)
    for m in function.finditer(body):
        if not m.group(1).strip() or parameter.sub("", m.group(2)).strip():
            raise ValueError
        args = {
            p.group(1).strip(): re.sub(r"\A\n|\n\Z", "", p.group(2), count=2) for p in parameter.finditer(m.group(2))
        }
        calls.append({"name": m.group(1).strip(), "arguments": args})
    if not calls or rest.strip():
        raise ValueError
    return calls


def test_qwen3_coder_blocks_are_read_in_one_pass_as_the_lazy_patterns_read_them():
    """Equal to :func:`_lazy_xml_block` on random blocks (string-typed values), and one pass over 4,000
    unclosed openings (the patterns took 3.2 s on 8,000, quadrupling per doubling)."""
    parts = ["<function=a>", "<function=b>", "</function>", "<parameter=x>", "<parameter=y>", "</parameter>"]
    parts += ["v", " ", "\n", "<", ">", "<function=>"]
    types = {name: {"x": "string", "y": "string"} for name in ("a", "b")}
    rng = random.Random(2)
    for _ in range(5000):
        body = "".join(rng.choice(parts) for _ in range(rng.randint(1, 12)))
        try:
            expected = _lazy_xml_block(body)
        except ValueError:
            expected = ValueError
        if expected is ValueError or body.lstrip().startswith("<function="):
            try:
                got = parse_tool_block(body, types)
            except ValueError:
                got = ValueError
            assert got == expected, body
    with pytest.raises(ValueError):
        parse_tool_block("<function=a>" + "<parameter=x>" * 4000 + "</function>", types)
    calls = parse_tool_block("<function=a>" + "<parameter=x>1</parameter>" * 4000 + "</function>", types)
    assert calls == [{"name": "a", "arguments": {"x": "1"}}]


def test_a_closing_tag_inside_a_json_string_argument_does_not_end_the_block():
    """Issue #27.7: a write_file call whose content mentions ``</tool_call>`` is one call with that
    content, not a parse error with markup leaking into content; streamed chunkings agree."""
    content = "The reply grammar closes a call with </tool_call> and opens one with <tool_call>."
    call = json.dumps({"name": "write_file", "arguments": {"path": "notes.md", "content": content}})
    text = f"Saving.\n<tool_call>\n{call}\n</tool_call>\n<tool_call>\n{json.dumps({'name': 'ls', 'arguments': {}})}\n</tool_call>"
    parsed = parse_reply_text(text)
    assert not parsed.tool_parse_error and parsed.content == "Saving."
    assert [json.loads(c["function"]["arguments"]) for c in parsed.tool_calls] == [
        {"path": "notes.md", "content": content},
        {},
    ]
    for cut in range(0, len(text), 11):
        _, result = _stream(text, [cut])
        assert json.loads(result.tool_calls[0]["function"]["arguments"])["content"] == content
    bad = 'x <tool_call>\n{"name": "f", "arguments": {oops}}\n</tool_call>'
    assert parse_reply_text(bad).tool_parse_error and parse_reply_text(bad).content == bad
    unclosed = '<tool_call>\n{"name": "f", "arguments": {"a": "</tool_call>"}}'
    assert parse_reply_text(unclosed).tool_parse_error


def test_a_reply_cut_inside_a_multibyte_character_streams_and_answers_the_same_whole_text(tiny_model):
    """Issue #27.7: "ok 漢" is ids [432, 229, 171, 129, 104] in the tiny tokenizer (" " is 229, 漢 the 3 byte tokens after it);
    cut after 171 or 129 by max_tokens, the stream and the plain answer are both "ok " (no U+FFFD), and a
    whole character still arrives whole."""
    from transformers import AutoTokenizer

    from clawray.serve.reply import ReplyDecoder

    decode = ReplyDecoder(AutoTokenizer.from_pretrained(tiny_model))
    ids = decode.tokenizer.encode("ok 漢", add_special_tokens=False)
    assert ids == [432, 229, 171, 129, 104]
    for n, text in [(3, "ok "), (4, "ok "), (5, "ok 漢"), (2, "ok "), (1, "ok")]:
        detok = IncrementalDetokenizer(decode)
        streamed = "".join(detok.add([t]) for t in ids[:n]) + detok.finish()
        assert streamed == decode.complete(ids[:n]) == text and "\ufffd" not in streamed
    assert decode.complete([136]) == ""  # half of "é" alone


def test_tool_call_format_of_chat_templates(tiny_model):
    """Issue #24.4: the parser is chosen by the chat template, and a template whose tool format is
    unknown is refused at start-up instead of returning the model's calls as text."""
    from transformers import AutoTokenizer

    from clawray.model_folders import CHAT_TEMPLATE
    from clawray.serve.reply import tool_call_format

    assert tool_call_format(AutoTokenizer.from_pretrained(tiny_model).chat_template) == "hermes"
    assert tool_call_format(CHAT_TEMPLATE) == "hermes"  # clawray's SmolLM2 template too
    qwen3 = (
        "{% for tool in tools %}{{ tool }}{% endfor %}<tool_call>\\n<function=name>\\n<parameter=x>\\n1\\n</parameter>"
    )
    assert tool_call_format(qwen3) == "xml"
    assert tool_call_format("{{ messages[0].content }}") == "none" and tool_call_format(None) == "none"
    mistral = "{% if tools %}[AVAILABLE_TOOLS]{{ tools }}{% endif %}[TOOL_CALLS]"
    with pytest.raises(ValueError, match=r"does not parse \(it uses \[TOOL_CALLS\]\)"):
        tool_call_format(mistral)
    with pytest.raises(ValueError, match="hermes JSON or Qwen3-Coder XML"):
        tool_call_format("{% if tools %}{{ tools | tojson }}{% endif %}")  # Llama 3 style bare JSON


def test_reply_decoder_hides_the_unknown_token_when_the_grammar_tags_are_not_in_the_vocabulary():
    """SmolLM2's vocabulary has no <think>/<tool_call>: converting them gives the unknown token's id,
    0, which is <|endoftext|>. That id must stay hidden (it was kept visible as a 'tag')."""
    from types import SimpleNamespace

    from clawray.serve.reply import ReplyDecoder

    vocab = {0: "<|endoftext|>", 1: "<|im_start|>", 2: "<|im_end|>", 3: "hi"}
    tok = SimpleNamespace(
        all_special_ids=[1, 2, 0],
        added_tokens_decoder={},
        convert_tokens_to_ids=lambda t: next((i for i, s in vocab.items() if s == t), 0),
        convert_ids_to_tokens=lambda i: vocab[i],
        decode=lambda ids, skip_special_tokens=False: "".join(vocab[i] for i in ids),
    )
    decode = ReplyDecoder(tok)
    assert decode.hidden == frozenset({0, 1, 2})
    assert decode([1, 3, 0, 3, 2]) == "hihi"


# ---------------------------------------------------------------- untagged tool calls (serve.untagged_tool_calls)
_STR = {"type": "string"}
_UNTAGGED_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "parameters": {"type": "object", "properties": {"path": _STR}, "required": ["path"]},
        },
    },
    {
        "type": "function",
        "function": {
            "name": "exec",
            "parameters": {
                "type": "object",
                "properties": {"command": _STR, "timeout": {"type": "integer"}},
                "required": ["command"],
            },
        },
    },
]
_READ = {"name": "read_file", "arguments": {"path": "homework.txt"}}


def _untagged(text: str, cuts: list[int], untagged: bool = True):
    parser = ReplyParser(make_id=_ids(), tools=_UNTAGGED_TOOLS, untagged=untagged)
    events = []
    bounds = [0, *sorted(cuts), len(text)]
    for a, b in zip(bounds, bounds[1:]):
        events += parser.feed(text[a:b])
    events += parser.finish()
    return events, parser.result


@pytest.mark.parametrize(
    "text, calls",
    [
        # what Qwen2.5-Coder-0.5B writes: bare JSON, a fenced json block, a plain fence, a list
        (json.dumps(_READ), [_READ]),
        ("```json\n" + json.dumps(_READ) + "\n```", [_READ]),
        ("\n```\n" + json.dumps(_READ) + "\n```\n", [_READ]),
        ("```json  \n" + json.dumps(_READ) + "  \n  ```", [_READ]),  # spaces about the fences
        ("```json\n" + json.dumps(_READ) + " " * 3000 + "x```", None),  # linear: was quadratic in the spaces
        ('<think>need the file</think>\n{"name": "read_file", "parameters": {"path": "homework.txt"}}', [_READ]),
        (
            json.dumps([_READ, {"name": "exec", "arguments": {"command": "ls", "timeout": 5}}]),
            [_READ, {"name": "exec", "arguments": {"command": "ls", "timeout": 5}}],
        ),
        # content: prose around it, a tool not offered, a missing required or unknown parameter, a wrong
        # type (an integer timeout given as 5.5, a bool as a string), a third key, an example object
        ("Here is the call: " + json.dumps(_READ), None),
        (json.dumps(_READ) + "\nDone.", None),
        ('{"name": "write_file", "arguments": {"path": "a"}}', None),
        ('{"name": "read_file", "arguments": {}}', None),
        ('{"name": "read_file", "arguments": {"path": "a", "mode": "r"}}', None),
        ('{"name": "exec", "arguments": {"command": "ls", "timeout": 5.5}}', None),
        ('{"name": "exec", "arguments": {"command": true}}', None),
        ('{"name": "read_file", "arguments": {"path": "a"}, "id": 1}', None),
        ('{"name": "read_file", "path": "a.txt"}', None),
        ('{"user": "Alice", "age": 30}', None),
        ("```python\nprint(1)\n```", None),
        ("[1, 2, 3]", None),
        ('{"name": "read_file", "arguments": {"path": "a"}', None),  # cut: not JSON
    ],
)
def test_untagged_tool_calls_read_only_a_whole_reply_that_fits_an_offered_tool(text, calls):
    """With the option on, a reply that is one call (or a list) without tags and fits the offered
    tools' schemas is a tool call; anything else is the reply's content, unflagged; every chunking
    agrees, and with the option off the same reply is always content."""
    _, whole = _untagged(text, [])
    got = [
        {"name": c["function"]["name"], "arguments": json.loads(c["function"]["arguments"])} for c in whole.tool_calls
    ]
    assert got == (calls or [])
    visible = text.split("</think>")[-1].strip()
    assert whole.content == (None if calls else visible)
    assert not whole.tool_parse_error
    rng = random.Random(1)
    for _ in range(25):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 6))))
        events, result = _untagged(text, cuts)
        assert result == whole, cuts
        streamed = "".join(v for k, v in events if k == "content")
        assert streamed == (whole.content or "")
        assert [v for k, v in events if k == "tool_call"] == [
            dict(index=i, **c) for i, c in enumerate(whole.tool_calls)
        ]
    off = parse_reply_text(text, tools=_UNTAGGED_TOOLS)
    assert off.tool_calls == [] and off.content == visible


def test_untagged_tool_calls_stream_plain_content_at_once_and_need_offered_tools():
    """A reply that cannot be a call (it starts with prose) streams as it comes; without offered
    tools (or with tool_choice none, which offers none) a bare call object is content."""
    parser = ReplyParser(make_id=_ids(), tools=_UNTAGGED_TOOLS, untagged=True)
    assert parser.feed("Sure") == [("content", "Sure")]
    assert parser.feed(', {"name": "x"}') == [("content", ', {"name": "x"}')]
    held = ReplyParser(make_id=_ids(), tools=_UNTAGGED_TOOLS, untagged=True)
    assert held.feed('{"name": "read_file", ') == []  # may be a call: held until the reply ends
    for tools in (None, True):
        result = parse_reply_text(json.dumps(_READ), tools=tools, untagged=True)
        assert result.tool_calls == [] and result.content == json.dumps(_READ)
    # tagged calls parse as before with the option on
    tagged = parse_reply_text("<tool_call>" + json.dumps(_READ) + "</tool_call>", tools=_UNTAGGED_TOOLS, untagged=True)
    assert [c["function"]["name"] for c in tagged.tool_calls] == ["read_file"]


STRICT_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "f",
            "parameters": {
                "type": "object",
                "properties": {
                    "x": {"type": "number"},
                    "a": {"type": "string"},
                    "content": {"type": ["string", "null"]},
                },
            },
        },
    }
]


@pytest.mark.parametrize(
    "block",
    [
        '{"name": "f", "arguments": {"x": 1e999}}',  # hermes: a number that overflows to inf
        '{"name": "f", "arguments": "{\\"x\\": -1e400}"}',  # the same, JSON-string-encoded
        '{"name": "f", "arguments": {"a": "\\ud83d"}}',  # half an emoji's surrogate pair
        '{"name": "f", "arguments": {"a": "\\udc00 \\ud800"}}',
    ],
)
def test_a_tool_call_no_json_encoder_can_write_back_is_a_tool_parse_error(block):
    """A policy's call with ``1e999`` reached the client as ``{"x": Infinity}`` (not JSON: Node's
    JSON.parse refuses it), and one with a lone surrogate escape could not be encoded as UTF-8 (an
    HTTP 500 after the turn was recorded, or a stream cut short). Both are now an invalid block: the
    text is the content, flagged ``tool_parse_error``; streamed the same."""
    text = f"<tool_call>\n{block}\n</tool_call>"
    parsed = parse_reply_text(text, tools=STRICT_TOOLS)
    assert parsed.tool_parse_error and parsed.tool_calls == [] and parsed.content == text
    body = json.dumps({"choices": [{"message": parsed.message()}]}, ensure_ascii=False).encode("utf-8")
    assert json.loads(body)["choices"][0]["message"]["content"] == text
    for cut in range(0, len(text), 5):
        _, result = _stream(text, [cut])
        assert result.tool_parse_error and result.tool_calls == []


def test_qwen3_coder_values_that_json_cannot_hold_stay_text_and_string_unions_stay_text():
    """An XML ``number`` value ``1e999`` was decoded to inf (arguments ``{"x": Infinity}``); a
    ``["string", "null"]`` parameter (how strict OpenAI schemas write an optional string) holding
    JSON-looking text was decoded into an object, so a write_file tool got a dict, not its text."""
    text = (
        "<tool_call>\n<function=f>\n<parameter=x>\n1e999\n</parameter>\n<parameter=a>\n\\ud83d\n</parameter>\n"
        '<parameter=content>\n{"debug": true}\n</parameter>\n</function>\n</tool_call>'
    )
    (call,) = parse_reply_text(text, tools=STRICT_TOOLS).tool_calls
    assert call["function"]["arguments"] == '{"x": "1e999", "a": "\\\\ud83d", "content": "{\\"debug\\": true}"}'
    assert json.loads(call["function"]["arguments"]) == {"x": "1e999", "a": "\\ud83d", "content": '{"debug": true}'}
    for value, expected in (("null", None), ("123", "123"), ("text", "text")):
        body = f"<function=f>\n<parameter=content>\n{value}\n</parameter>\n</function>"
        assert parse_tool_block(body, tool_parameter_types(STRICT_TOOLS)) == [
            {"name": "f", "arguments": {"content": expected}}
        ]


def test_a_malformed_tool_schema_types_no_argument_and_never_raises():
    """A request's tool schema with ``properties`` as a list, a ``type`` that is an object or
    ``required`` holding objects made the reply parser raise after the engine had generated (an HTTP
    500 for the client's bad schema). The endpoint now refuses such a schema with a 400; the parser
    itself reads a malformed part as "any value"."""
    from clawray.serve.reply import untagged_tool_calls

    bad = [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": ["x"]}}},
        {"type": "function", "function": {"name": "g", "parameters": {"properties": {"x": {"type": {"a": 1}}}}}},
        {"type": "function", "function": {"name": "h", "parameters": {"properties": {"x": {}}, "required": [{}]}}},
    ]
    assert tool_parameter_types(bad) == {"f": {}, "g": {"x": None}, "h": {"x": None}}
    body = "<function=g>\n<parameter=x>\n12\n</parameter>\n</function>"
    assert parse_tool_block(body, tool_parameter_types(bad)) == [{"name": "g", "arguments": {"x": 12}}]
    schemas = {"g": bad[1]["function"]["parameters"], "h": bad[2]["function"]["parameters"]}
    assert untagged_tool_calls('{"name": "g", "arguments": {"x": [1]}}', schemas) == [
        {"name": "g", "arguments": {"x": [1]}}
    ]
    assert untagged_tool_calls('{"name": "h", "arguments": {"x": 1}}', schemas) == [
        {"name": "h", "arguments": {"x": 1}}
    ]
    (call,) = parse_reply_text('<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>', tools=bad).tool_calls
    assert json.loads(call["function"]["arguments"]) == {"x": 1}


def test_the_message_of_an_empty_reply_has_empty_content_and_null_only_beside_tool_calls():
    """A reply that says nothing answers ``content: ""`` (OpenAI's and vLLM's, where clients read a
    string); ``null`` stays for a reply that is only tool calls; a think block alone is reasoning."""
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    assert parse_reply_text("").message() == {"role": "assistant", "content": ""}
    assert parse_reply_text("  \n").message() == {"role": "assistant", "content": ""}
    assert parse_reply_text("<think>hm</think>").message() == {
        "role": "assistant",
        "content": "",
        "reasoning_content": "hm",
    }
    call = parse_reply_text('<tool_call>{"name": "f", "arguments": {}}</tool_call>', tools=tools).message()
    assert call["content"] is None and [c["function"]["name"] for c in call["tool_calls"]] == ["f"]
    assert parse_reply_text("ok").message() == {"role": "assistant", "content": "ok"}
