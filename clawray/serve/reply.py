"""The model's reply, token by token: incremental detokenisation and the reply parser.

Owns: the reply grammar below, the incremental detokeniser and the one parser of streamed and plain
replies (the evaluation and the monitor use it too). Must not: talk to an engine or the client (the
SSE writer is :mod:`clawray.serve.sse`), turn text into ids or import Ray.

One code path serves streamed and non-streamed answers: a non-streamed reply is the same parser fed
the whole text at once, so for a fixed sample the merged stream deltas equal the non-streamed message
by construction (and ``tests/unit/test_reply.py`` checks that every chunking gives the same result).

Reply grammar (hermes / Qwen conventions)::

    reply     := [ "<think>" reasoning "</think>" ] content
    content   := text with zero or more "<tool_call>" JSON "</tool_call>" blocks

* ``reasoning_content`` is the text between the think tags, as generated. A prompt that already
  ends with ``<think>`` (thinking templates that open the block themselves) starts the parser inside
  the reasoning. An unterminated think block is all reasoning.
* ``content`` is the text outside think and tool-call blocks with surrounding whitespace stripped
  (None when empty). Streaming holds back trailing whitespace and anything that may be the start of
  a tag, so it never has to take text back.
* A tool-call block holds one JSON object ``{"name": ..., "arguments": ...}``, several objects in a
  row, or a JSON list of them (hermes: Qwen2.5, the tiny model); ``arguments`` (or ``parameters``)
  may be an object or a JSON string encoding one (double-encoded strings are decoded). Or it holds
  Qwen3-Coder / Qwen3.5 XML, one or more ``<function=NAME>`` blocks of ``<parameter=KEY>VALUE
  </parameter>`` (vLLM's ``qwen3_coder`` parser): a value is typed by the tool's JSON schema (a
  parameter whose types include ``string`` stays text, and ``null`` is None where the types also
  include ``null``; integer, number, boolean, object, array and null are decoded as JSON, and text
  that does not decode stays text); a parameter the schema does not know is decoded as JSON when it
  is valid JSON. Each call becomes an OpenAI tool call with ``arguments`` a JSON string: standard
  JSON always (:class:`~clawray.chat.StrictJSONDecoder`: a value that overflows to infinity or holds
  a lone surrogate escape makes the block invalid, or stays text in an XML parameter). Once a block opens, the rest of the reply is buffered and parsed at
  the end; if any block is not valid JSON, or is not closed, the whole non-reasoning text is the
  content and the reply is flagged ``tool_parse_error`` (never a server error).
* Tool-call blocks are parsed only when the request offered tools (``tools`` given and
  ``tool_choice`` not ``"none"``, as vLLM): otherwise a ``<tool_call>`` block is plain content, so a
  client that offered no tool never receives a tool call.
* Untagged calls (``untagged=True``, ``serve.untagged_tool_calls``): Qwen2.5-Coder-0.5B-Instruct
  writes its calls as bare JSON or one fenced ```json block and never inside ``<tool_call>`` tags,
  not even when a hint asks for the tags (0 of 8 prompts either way, ``bench/tool_format.py``). With
  the option on, a reply whose whole content (outside a think block) is one such call, or a JSON list
  of them, is a tool call when every call fits an offered tool (:func:`untagged_tool_calls`); any
  other reply is content, unflagged. Streaming holds back a reply that starts with ``{``, ``[`` or
  a code fence until it ends, since only the whole reply decides.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

from clawray.chat import STRICT_JSON

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"


def _block_end(buf: str, start: int) -> int:
    """Index of the ``</tool_call>`` that closes the block whose body starts at ``start``, or -1.

    A JSON body is measured by balanced JSON (one or more values), so a ``</tool_call>`` inside a
    string argument (a ``write_file`` whose content mentions the tag) does not end the block; a
    body that is not JSON ends at the first closing tag (and then fails to parse, as it should).
    """
    pos = start
    while pos < len(buf) and buf[pos] in " \t\r\n":
        pos += 1
    if pos < len(buf) and buf[pos] in "{[":
        try:
            while pos < len(buf) and buf[pos] in "{[":
                _, pos = STRICT_JSON.raw_decode(buf, pos)
                while pos < len(buf) and buf[pos] in " \t\r\n,":
                    pos += 1
            if buf.startswith(TOOL_CLOSE, pos):
                return pos
        except (ValueError, RecursionError):
            pass
    return buf.find(TOOL_CLOSE, start)


def _partial_tag_len(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


@dataclass
class ParsedReply:
    """A parsed reply.

    Attributes:
        content: the text outside think and tool-call blocks, stripped; None when empty.
        reasoning_content: the think block's text, or None when there is none.
        tool_calls: OpenAI tool calls (``{"id", "type": "function", "function": {"name", "arguments"}}``
            with ``arguments`` a JSON string).
        tool_parse_error: a tool-call block was not valid JSON or not closed.
    """

    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    tool_parse_error: bool = False

    def message(self) -> dict[str, Any]:
        """The OpenAI assistant message (``tool_calls`` and ``reasoning_content`` only when present;
        ``content`` null only beside tool calls, an empty reply's is ``""`` as OpenAI's and vLLM's)."""
        content = "" if self.content is None and not self.tool_calls else self.content
        msg: dict[str, Any] = {"role": "assistant", "content": content}
        if self.reasoning_content is not None:
            msg["reasoning_content"] = self.reasoning_content
        if self.tool_calls:
            msg["tool_calls"] = self.tool_calls
        return msg


_XML_FUNCTION = re.compile(r"<function=([^<>\n]*)>")  # opening tags; bodies run to the next closing tag
_XML_PARAMETER = re.compile(r"<parameter=([^<>\n]*)>")


def _tagged(opening: re.Pattern, closing: str, text: str) -> tuple[list[tuple[str, str]], str]:
    """The ``(name, body)`` of each ``<tag=name>body</tag>`` in ``text`` (each body runs to the first
    closing tag after its opening, as a lazy ``.*?`` would) and the text outside them, in one pass:
    linear in the text, where a lazy regex rescans the rest of it from every unclosed opening."""
    blocks, outside, pos = [], [], 0
    while (m := opening.search(text, pos)) is not None:
        end = text.find(closing, m.end())
        if end < 0:  # no closing tag after this opening, so none after a later one either
            break
        outside.append(text[pos : m.start()])
        blocks.append((m.group(1), text[m.end() : end]))
        pos = end + len(closing)
    outside.append(text[pos:])
    return blocks, "".join(outside)


def tool_schemas(tools: list[dict] | None) -> dict[str, dict[str, Any]]:
    """``{tool name: its JSON-schema parameters object}`` of an OpenAI ``tools`` list."""
    out: dict[str, dict[str, Any]] = {}
    for tool in tools or []:
        fn = tool.get("function") if isinstance(tool, dict) else None
        if isinstance(fn, dict) and isinstance(fn.get("name"), str):
            params = fn.get("parameters")
            out[fn["name"]] = params if isinstance(params, dict) else {}
    return out


def tool_parameter_types(tools: list[dict] | None) -> dict[str, dict[str, Any]]:
    """``{tool name: {parameter: JSON-schema type}}`` of an OpenAI ``tools`` list (a type may be a
    list of types, as JSON schema allows; a parameter without one, or with a malformed one, maps to
    None: any value fits)."""
    out: dict[str, dict[str, Any]] = {}
    for name, params in tool_schemas(tools).items():
        props = params.get("properties")
        props = props if isinstance(props, dict) else {}
        out[name] = {k: _schema_type(v) for k, v in props.items()}
    return out


def _schema_type(schema: Any) -> str | list[str] | None:
    kind = schema.get("type") if isinstance(schema, dict) else None
    if isinstance(kind, str) or (isinstance(kind, list) and kind and all(isinstance(k, str) for k in kind)):
        return kind
    return None


def _xml_value(text: str, kind: Any) -> Any:
    """A Qwen3-Coder parameter value: one leading and one trailing newline dropped (the template's
    layout), then typed by ``kind`` (the schema's type, see :func:`parse_tool_block`)."""
    value = text[1:] if text.startswith("\n") else text
    value = value[:-1] if value.endswith("\n") else value
    kinds = set(kind) if isinstance(kind, list) else {kind}
    if "string" in kinds:  # a string may be any text ("123", "{...}"); ["string", "null"] also takes null
        return None if "null" in kinds and value.strip() == "null" else value
    try:
        return STRICT_JSON.decode(value.strip())
    except (ValueError, RecursionError):
        return value


def _parse_xml_block(body: str, types: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    calls = []
    functions, rest = _tagged(_XML_FUNCTION, "</function>", body)
    for name, function_body in functions:
        name = name.strip()
        if not name:
            raise ValueError("a tool call needs a function name")
        schema = types.get(name, {})
        parameters, leftover = _tagged(_XML_PARAMETER, "</parameter>", function_body)
        args = {key.strip(): _xml_value(value, schema.get(key.strip())) for key, value in parameters}
        if leftover.strip():
            raise ValueError("text outside <parameter=...> blocks in a <function=...> block")
        calls.append({"name": name, "arguments": args})
    if not calls or rest.strip():
        raise ValueError("tool-call block is not <function=...>...</function> blocks")
    return calls


def parse_tool_block(body: str, types: dict[str, dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """The tool calls in one ``<tool_call>`` block's body: hermes JSON, or Qwen3-Coder XML when the
    body starts with ``<function=`` (see the module docstring).

    Args:
        body: the text between ``<tool_call>`` and ``</tool_call>``.
        types: :func:`tool_parameter_types` of the request's tools (types the XML values).

    Returns:
        ``[{"name": str, "arguments": dict}, ...]`` (one or more).

    Raises:
        ValueError: the body is not one or more JSON call objects with a string ``name`` and
            object (or JSON-string-encoded object) ``arguments``, nor well-formed XML function blocks.
    """
    if body.lstrip().startswith("<function="):
        return _parse_xml_block(body, types or {})
    decoder = STRICT_JSON  # NaN / Infinity would make the returned arguments invalid JSON
    items: list[Any] = []
    pos, text = 0, body.strip()
    if not text:
        raise ValueError("empty tool-call block")
    while pos < len(text):
        try:
            obj, pos = decoder.raw_decode(text, pos)
        except (ValueError, RecursionError) as e:
            raise ValueError(f"tool-call block is not JSON: {e}") from None
        items.extend(obj if isinstance(obj, list) else [obj])
        while pos < len(text) and text[pos] in " \t\r\n,":
            pos += 1
    calls = []
    for obj in items:
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
            raise ValueError("a tool call needs a string 'name'")
        args = obj.get("arguments", obj.get("parameters", {}))
        for _ in range(2):  # an object, a JSON string of it, or (double-encoded) a JSON string of that
            if not isinstance(args, str):
                break
            try:
                args = STRICT_JSON.decode(args) if args.strip() else {}
            except (ValueError, RecursionError):
                raise ValueError("tool-call arguments are not valid JSON") from None
        if not isinstance(args, dict):
            raise ValueError("tool-call arguments must be a JSON object")
        calls.append({"name": obj["name"], "arguments": args})
    return calls


_FENCE_OPEN = re.compile(r"```(?:json)?[ \t]*\n")


def _fenced(body: str) -> str | None:
    """What a ```json (or plain ```) block that is the whole of ``body`` holds, or None. Sliced, not
    matched with a lazy ``(.*?)`` before the closing fence: that was quadratic in a run of spaces."""
    opening = _FENCE_OPEN.match(body)
    if opening is None or not body.endswith("```") or len(body) < opening.end() + 3:
        return None
    return body[opening.end() : -3]


_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "object": (dict,),
    "array": (list,),
}


def _fits(value: Any, kind: Any) -> bool:
    """Whether a decoded JSON value has the JSON-schema type ``kind`` (a type name, a list of them,
    or None for any); ``True`` is no integer here, as in JSON schema."""
    kinds = kind if isinstance(kind, list) else [kind]
    if None in kinds or any(k not in _JSON_TYPES and k != "null" for k in kinds):
        return True
    if value is None:
        return "null" in kinds
    if isinstance(value, bool):
        return "boolean" in kinds
    return any(isinstance(value, _JSON_TYPES[k]) for k in kinds if k in _JSON_TYPES)


def untagged_tool_calls(text: str, schemas: dict[str, dict[str, Any]]) -> list[dict[str, Any]] | None:
    """The tool calls of a reply written without ``<tool_call>`` tags, or None when it is not one.

    A call is read only when the whole text (stripped) is one JSON value, bare or as the only thing
    in a fenced ```json (or plain ```) block, and that value is a call object or a non-empty list of
    them. A call object has exactly the keys ``name`` and ``arguments`` (or ``parameters``);
    ``name`` is an offered tool; ``arguments`` is an object holding every ``required`` parameter of
    that tool's schema, no parameter the schema does not list (when it lists any), and values of the
    schema's types. Anything else (prose around the JSON, an example object, a call to a tool that
    was not offered, arguments of the wrong shape) is content. Measured greedy, three tools offered
    (``bench/tool_format.py``): 5 of 8 tool requests become the right call for Qwen2.5-Coder-0.5B and
    8 of 8 for the 1.5B (0 of 8 with tags only); of 16 requests for ordinary JSON, 4 and 5 replies
    are a valid call of an offered tool ("the JSON for a weather report: city Paris" ->
    ``get_weather(city=Paris)``: the model chose the tool, and the tool's result is then the turn's
    next state), where a rule without the schema checks would take 6.

    Args:
        text: the reply's content (no think block).
        schemas: :func:`tool_schemas` of the request's tools.

    Returns:
        ``[{"name": str, "arguments": dict}, ...]`` or None.
    """
    body = text.strip()
    if (fence := _fenced(body)) is not None:
        body = fence.strip()
    if not body or body[0] not in "{[":
        return None
    try:
        value = STRICT_JSON.decode(body)
    except (ValueError, RecursionError):
        return None
    items = value if isinstance(value, list) else [value]
    calls = []
    for obj in items:
        if not isinstance(obj, dict) or len(obj) != 2 or "name" not in obj:
            return None
        args = obj.get("arguments", obj.get("parameters"))
        schema = schemas.get(obj["name"]) if isinstance(obj["name"], str) else None
        if schema is None or not isinstance(args, dict):
            return None
        props = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
        required = schema.get("required") if isinstance(schema.get("required"), list) else []
        if any(key not in args for key in required if isinstance(key, str)):
            return None
        if (props and any(key not in props for key in args)) or not all(
            _fits(v, _schema_type(props.get(k))) for k, v in args.items()
        ):
            return None
        calls.append({"name": obj["name"], "arguments": args})
    return calls or None


class ReplyParser:
    """Splits a reply into reasoning, content and tool calls as its text arrives.

    ``feed(text)`` returns the deltas that are now certain, ``finish()`` the rest; both return a list
    of ``(kind, value)`` with kind ``"reasoning"`` or ``"content"`` (str) or ``"tool_call"`` (an
    OpenAI tool call dict with its ``index``). ``result`` is the whole :class:`ParsedReply` after
    ``finish()``. The outcome does not depend on how the text is split into chunks.

    Args:
        in_reasoning: the prompt already opened a think block (its rendered text ends with ``<think>``).
        make_id: tool-call id factory (tests pass a deterministic one).
        tools: the request's tools (an OpenAI ``tools`` list, whose schemas type XML parameter
            values) or a bool; when falsy, ``<tool_call>`` blocks are content.
        untagged: also read a whole reply that is a call without tags (:func:`untagged_tool_calls`;
            needs ``tools`` as a list, whose schemas it checks).
    """

    def __init__(
        self,
        in_reasoning: bool = False,
        make_id: Callable[[], str] | None = None,
        tools: bool | list | None = True,
        untagged: bool = False,
    ):
        self.tools = bool(tools)
        self.types = tool_parameter_types(tools) if isinstance(tools, list) else {}
        self.schemas = tool_schemas(tools) if untagged and isinstance(tools, list) else {}
        self.state = "reasoning" if in_reasoning else "start"
        self.make_id = make_id or (lambda: f"call_{uuid.uuid4().hex[:24]}")
        self.pending = ""  # text not yet classified (a possible partial tag, or the undecided start)
        self.held_ws = ""  # content whitespace not yet emitted (dropped if nothing follows)
        self.content_started = False
        self.tool_buffer = ""
        self.result = ParsedReply(reasoning_content="" if in_reasoning else None)
        self._content: list[str] = []

    # ------------------------------------------------------------------ feeding
    def feed(self, text: str) -> list[tuple[str, Any]]:
        """Add reply text; returns the deltas it makes certain."""
        out: list[tuple[str, Any]] = []
        self.pending += text
        while self.pending:
            if self.state == "start":
                head = self.pending.lstrip()
                if THINK_OPEN.startswith(head):  # undecided (empty or a partial "<think>")
                    break
                if head.startswith(THINK_OPEN):
                    self.state, self.pending = "reasoning", head[len(THINK_OPEN) :]
                    self.result.reasoning_content = ""
                else:
                    self.state = "content"
            elif self.state == "content" and self.schemas and not self.content_started:
                head = self.pending.lstrip()
                if not head or "```".startswith(head):  # undecided: nothing yet, or a partial fence
                    break
                if head[0] in "{[" or head.startswith("```"):  # maybe a call: only the whole reply tells
                    self.state = "untagged"
                    continue
                self.schemas = {}  # plain content: parse on as without the option
            elif self.state == "untagged":
                break  # held until finish()
            elif self.state == "reasoning":
                end = self._emit_until(THINK_CLOSE, self._reasoning, out)
                if end < 0:
                    break
                self.state, self.pending = "content", self.pending[end + len(THINK_CLOSE) :]
            elif self.state == "content" and not self.tools:
                self._content_text(self.pending, out)
                self.pending = ""
            elif self.state == "content":
                start = self._emit_until(TOOL_OPEN, self._content_text, out)
                if start < 0:
                    break
                self.state, self.tool_buffer, self.pending = "tools", "", self.pending[start:]
            else:  # tools: everything is parsed at the end
                self.tool_buffer += self.pending
                self.pending = ""
        return out

    def finish(self) -> list[tuple[str, Any]]:
        """Flush: classify what is left, parse the tool-call blocks; returns the last deltas."""
        out: list[tuple[str, Any]] = []
        if self.state == "untagged" or (self.state == "content" and self.schemas and not self.content_started):
            if calls := untagged_tool_calls(self.pending, self.schemas):
                self.pending = ""
                self._emit_calls(calls, out)
                self.result.content = None
                return out
            self.state, self.schemas = "content", {}
            out += self.feed("")  # not a call: the held text is parsed as any reply's
        rest, self.pending = self.pending, ""
        if self.state == "reasoning":
            self._reasoning(rest, out)
        elif self.state in ("start", "content"):
            self._content_text(rest, out)
        else:
            self.tool_buffer += rest
            self._finish_tools(out)
        content = "".join(self._content)
        self.result.content = content or None
        return out

    def _finish_tools(self, out: list) -> None:
        buf = self.tool_buffer
        calls: list[dict[str, Any]] = []
        outside: list[str] = []
        pos, ok = 0, True
        while (opened := buf.find(TOOL_OPEN, pos)) >= 0:
            body = opened + len(TOOL_OPEN)
            end = _block_end(buf, body)
            if end < 0:  # never closed: caught below
                break
            outside.append(buf[pos:opened])
            pos = end + len(TOOL_CLOSE)
            try:
                calls += parse_tool_block(buf[body:end], self.types)
            except ValueError:
                ok = False
                break
        outside.append(buf[pos:])
        if ok and TOOL_OPEN in "".join(outside):  # a block that never closed
            ok = False
        if not ok:
            self.result.tool_parse_error = True
            self._content_text(buf, out)
            return
        self._content_text("".join(outside), out)
        self._emit_calls(calls, out)

    def _emit_calls(self, calls: list[dict[str, Any]], out: list) -> None:
        for i, call in enumerate(calls):
            tc = {
                "id": self.make_id(),
                "type": "function",
                "function": {"name": call["name"], "arguments": json.dumps(call["arguments"], ensure_ascii=False)},
            }
            self.result.tool_calls.append(tc)
            out.append(("tool_call", {"index": i, **tc}))

    # ------------------------------------------------------------------ emitters
    def _emit_until(self, tag: str, emit, out: list) -> int:
        """Emit the pending text before ``tag`` and return the tag's index in ``pending``; without the
        tag, emit all but a trailing partial tag, keep that pending, and return -1."""
        index = self.pending.find(tag)
        if index >= 0:
            emit(self.pending[:index], out)
            return index
        keep = len(self.pending) - _partial_tag_len(self.pending, tag)
        emit(self.pending[:keep], out)
        self.pending = self.pending[keep:]
        return -1

    def _reasoning(self, text: str, out: list) -> None:
        if text:
            self.result.reasoning_content += text
            out.append(("reasoning", text))

    def _content_text(self, text: str, out: list) -> None:
        """Emit content with the stripping rule: no leading whitespace, trailing whitespace held."""
        if not self.content_started:
            text = text.lstrip()
            if not text:
                return
            self.content_started = True
        body = text.rstrip()
        if not body:
            self.held_ws += text
            return
        piece = self.held_ws + body
        self.held_ws = text[len(body) :]
        self._content.append(piece)
        out.append(("content", piece))


def parse_reply_text(
    text: str, in_reasoning: bool = False, tools: bool | list | None = True, untagged: bool = False
) -> ParsedReply:
    """Parse a whole reply at once (the non-streamed path); see :class:`ReplyParser`."""
    parser = ReplyParser(in_reasoning, tools=tools, untagged=untagged)
    parser.feed(text)
    parser.finish()
    return parser.result


def tool_call_format(chat_template: str | None) -> str:
    """The tool-call format a chat template teaches its model, as this parser reads it: ``"xml"``
    (Qwen3-Coder / Qwen3.5: ``<tool_call>`` holding ``<function=...>``), ``"hermes"`` (``<tool_call>``
    holding JSON: Qwen2.5, clawray's SmolLM2 and tiny templates) or ``"none"`` (the template renders
    no tools). vLLM picks a parser per model family (``--tool-call-parser``); clawray reads these two
    and refuses any other at start-up rather than return a model's calls as text.

    Raises:
        ValueError: the template renders tools in another format (Llama 3's bare JSON, Mistral's
            ``[TOOL_CALLS]``, ...), naming what was found.
    """
    template = chat_template or ""
    if TOOL_OPEN in template:
        return "xml" if "<function=" in template else "hermes"
    if "tools" not in template:
        return "none"
    markers = [
        m for m in ("[TOOL_CALLS]", "<|python_tag|>", "<|tool_call|>", "<tool_calls>", "functools[") if m in template
    ]
    found = f" (it uses {', '.join(markers)})" if markers else ""
    raise ValueError(
        f"the model's chat template renders tools in a format clawray does not parse{found}: clawray reads "
        f"tool calls in {TOOL_OPEN}...{TOOL_CLOSE} blocks (hermes JSON or Qwen3-Coder XML); use a model "
        "or chat template of those families"
    )


class ReplyDecoder:
    """Response token ids -> the text a client sees: the tokenizer's special tokens are dropped
    (``<|endoftext|>``, ``<|im_start|>``, ...: vLLM's ``skip_special_tokens=True``), except the reply
    grammar's own tags (``<think>``, ``</think>``, ``<tool_call>``, ``</tool_call>``), which some
    tokenizers mark special and the parser needs. Stored ids are never filtered; only text is.

    Args:
        tokenizer: an HF tokenizer; its ``all_special_ids`` and the added tokens flagged ``special``
            are the hidden ids.
    """

    GRAMMAR_TAGS = (THINK_OPEN, THINK_CLOSE, TOOL_OPEN, TOOL_CLOSE)

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        special = set(getattr(tokenizer, "all_special_ids", None) or [])
        added = getattr(tokenizer, "added_tokens_decoder", None) or {}
        special.update(i for i, tok in added.items() if getattr(tok, "special", False))
        # a tag the vocabulary lacks maps to the unknown token's id (SmolLM2: <|endoftext|>, id 0):
        # only ids that really are a grammar tag are kept visible
        ids = (tokenizer.convert_tokens_to_ids(tag) for tag in self.GRAMMAR_TAGS)
        kept = {i for i in ids if i is not None and tokenizer.convert_ids_to_tokens(i) in self.GRAMMAR_TAGS}
        self.hidden: frozenset[int] = frozenset(special - kept)

    def __call__(self, ids: list[int]) -> str:
        """The visible text of ``ids`` (hidden special ids dropped, the grammar's tags kept)."""
        return self.tokenizer.decode([i for i in ids if i not in self.hidden], skip_special_tokens=False)

    def complete(self, ids: list[int]) -> str:
        """The visible text of a whole reply, without a trailing incomplete character
        (:func:`complete_text`)."""
        return complete_text(self, ids)


def complete_text(decode: Callable[[list[int]], str], ids: list[int]) -> str:
    """``decode(ids)`` without the U+FFFD of a character whose bytes the reply does not finish (a
    reply cut by ``max_tokens``, or ended, inside a multi-byte character): the tokens of that last
    incomplete character (at most 3 bytes, so at most 3 byte-level tokens) are left out. Streamed
    deltas (:meth:`IncrementalDetokenizer.finish`) and the plain answer both end this way, so they
    agree and never carry a broken character."""
    text = decode(ids)
    if not text.endswith("\ufffd"):
        return text
    for k in range(1, min(3, len(ids)) + 1):
        shorter = decode(ids[:-k])
        if not shorter.endswith("\ufffd"):
            return shorter
    return text


class IncrementalDetokenizer:
    """Turns response token ids into text deltas that end on UTF-8 character boundaries.

    A byte-level BPE token can hold part of a multi-byte character; its decoded text then ends in
    U+FFFD, and the delta is withheld until the character completes. Decoding uses a window that
    starts one step back (the offsets of Hugging Face's TGI / vLLM detokenisers) so each step
    decodes a few tokens, not the whole reply.

    Args:
        decode: ``ids -> str`` (the tokenizer's decode, special tokens kept).
    """

    def __init__(self, decode: Callable[[list[int]], str]):
        self.decode = decode
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0
        self.emitted = ""

    def add(self, ids: list[int]) -> str:
        """Append token ids; returns the newly complete text ('' while a character is incomplete)."""
        self.ids.extend(ids)
        prefix = self.decode(self.ids[self.prefix_offset : self.read_offset])
        text = self.decode(self.ids[self.prefix_offset :])
        if len(text) <= len(prefix) or text.endswith("\ufffd"):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        delta = text[len(prefix) :]
        self.emitted += delta
        return delta

    def finish(self) -> str:
        """The remaining text, so that all deltas join to :func:`complete_text` of all ids (a
        trailing incomplete character is left out)."""
        full = complete_text(self.decode, self.ids)
        if not full.startswith(self.emitted):  # cannot happen for byte-level BPE; never drop text
            return ""
        delta = full[len(self.emitted) :]
        self.emitted = full
        return delta
