"""Chat messages in: validation and normalisation of OpenAI messages, the conversation key that
matches a history against the replies clawray served (exactly, for splicing; by conversation, for
attribution and pairing), the render key of everything else that shapes
a prompt, and the end-of-turn token ids.

Owns: what a valid message is (else :class:`RequestError`), the conversation, attribution and render
keys, strict JSON, the end-of-turn ids and the special-token strings cut from text clawray places in a
prompt. Must not: build prompt text (the tokenizer's own chat template renders every prompt), parse the
model's reply (:mod:`clawray.serve.reply`) or import Ray.

End of turn: :func:`end_of_turn_ids` is the one definition of the ids that end a reply (the
tokenizer's eos, every ``eos_token_id`` of the model folder's generation config, and a request's own
stop ids). The server's uses of them (the engine's stop list, ``finish_reason``, the ids the client
sees) are :class:`clawray.serve.call.Call`'s; the next prompt's splice is :mod:`clawray.serve.splice`'s.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from typing import Any, Callable, Iterable

from clawray.client_rules import is_ephemeral, reply_as_kept, strip_envelope, strip_ephemeral

ROLES = ("system", "developer", "user", "assistant", "tool")


class RequestError(ValueError):
    """A client request is invalid; becomes an HTTP 400 with an OpenAI-style error body.

    Attributes:
        param: the offending request field (e.g. ``"messages[2].role"``), or None.
        code: a short machine-readable code.
    """

    def __init__(self, message: str, param: str | None = None, code: str = "invalid_request"):
        super().__init__(message)
        self.param, self.code = param, code


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e999: Python reads inf, which json.dumps writes as Infinity
        raise ValueError(f"the number {text[:40]} overflows a double")
    return value


_SURROGATE = re.compile("[\ud800-\udfff]")


def without_surrogates(text: str) -> str:
    """``text`` with each lone UTF-16 surrogate (``\\ud800``-``\\udfff``; a decoded pair is one code
    point) replaced by U+FFFD, as a UTF-8 decoder replaces invalid bytes: text a server sent as JSON
    escapes that a tokenizer or a UTF-8 file can then hold."""
    return _SURROGATE.sub("\ufffd", text)


class LoneSurrogateError(ValueError):
    """Decoded JSON holds a lone UTF-16 surrogate (an unpaired ``\\ud800``-``\\udfff`` escape): valid
    JSON syntax, yet no UTF-8 text (a reply body, a tokenizer, a record) can hold it."""


#: The deepest nesting of a JSON value clawray accepts (a request body, a tool call's arguments).
MAX_JSON_DEPTH = 100


def _deeper_than(value: Any, limit: int) -> bool:
    """Whether ``value`` (decoded JSON) nests lists and objects more than ``limit`` levels deep; an
    iterative walk, so any depth is measured without recursion."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (list, dict)):
            if depth > limit:
                return True
            stack.extend((v, depth + 1) for v in (item.values() if isinstance(item, dict) else item))
    return False


class StrictJSONDecoder(json.JSONDecoder):
    """A JSON decoder that accepts only what JSON encoders everywhere can write back: it refuses
    ``NaN`` / ``Infinity`` tokens and numbers that overflow to infinity (``1e999``), which
    ``json.dumps`` would write as the non-standard ``Infinity``, and strings holding a lone surrogate
    (:class:`LoneSurrogateError`), which cannot be encoded as UTF-8, and values nested deeper than
    :data:`MAX_JSON_DEPTH` (what a value passes here, the recursive code after it, attribution keys
    and records, must handle: 600 levels passed and raised RecursionError there, a 500).
    ``decode`` and ``raw_decode`` raise ``ValueError`` for each (``RecursionError`` for nesting
    deeper than the C decoder itself takes)."""

    def __init__(self) -> None:
        super().__init__(parse_constant=_reject_constant, parse_float=_finite_float)

    def raw_decode(self, s: str, idx: int = 0) -> tuple[Any, int]:
        obj, end = super().raw_decode(s, idx)
        if s.count("[", idx, end) + s.count("{", idx, end) > MAX_JSON_DEPTH and _deeper_than(obj, MAX_JSON_DEPTH):
            raise ValueError(f"JSON nested deeper than {MAX_JSON_DEPTH} levels")
        # only an escape, or a str made without UTF-8 decoding, can hold one (searched in place: no copy)
        if s.find("\\u", idx, end) >= 0 or _SURROGATE.search(s, idx, end):
            try:
                json.dumps(obj, ensure_ascii=False).encode("utf-8")
            except UnicodeEncodeError:
                raise LoneSurrogateError("JSON holds a lone surrogate escape (invalid Unicode)") from None
        return obj, end


#: The shared :class:`StrictJSONDecoder`: every JSON a client or the policy sends goes through it.
STRICT_JSON = StrictJSONDecoder()


def loads_strict(text: str | bytes) -> Any:
    """``json.loads`` that accepts only UTF-8 standard JSON.

    Raises:
        ValueError: invalid JSON, ``NaN``/``Infinity`` or a number that overflows to it, an integer
            beyond Python's digit limit, bytes that are not UTF-8 (JSON in UTF-16/32 is refused), or
            a lone surrogate escape (:class:`LoneSurrogateError`).
        RecursionError: nesting too deep.
    """
    if isinstance(text, bytes):
        text = text.decode("utf-8")
    return STRICT_JSON.decode(text)


def _text(content: Any, where: str) -> str | None:
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if isinstance(part, str):
                parts.append(part)
            elif isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
                parts.append(part["text"])
            else:
                raise RequestError(f"{where}.content[{j}]: only text parts are supported", f"{where}.content")
        return "\n".join(parts)  # as vLLM's chat renderer joins text parts
    raise RequestError(f"{where}.content must be a string, a list of text parts or null", f"{where}.content")


def normalize_messages(messages: Any) -> list[dict[str, Any]]:
    """Validate OpenAI chat messages and return them in the form the chat template renders.

    ``developer`` becomes ``system``; list content becomes its text parts joined by newlines (as
    vLLM renders them: OpenClaw sends a compaction summary and its Runtime line as two parts); assistant
    ``tool_calls[].function.arguments`` given as a JSON string become the decoded object (so both
    forms render to the same prompt); an assistant's ``reasoning`` (or ``reasoning_content``) becomes
    ``reasoning_content``.

    Raises:
        RequestError: not a non-empty list, an unknown role, bad content or bad tool-call arguments;
            ``param`` names the offending message index.
    """
    if not isinstance(messages, list) or not messages:
        raise RequestError("'messages' must be a non-empty list", "messages")
    out = []
    for i, msg in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(msg, dict):
            raise RequestError(f"{where} must be an object", where)
        role = msg.get("role")
        if role not in ROLES:
            raise RequestError(f"{where}.role {role!r} is not one of {list(ROLES)}", f"{where}.role")
        norm: dict[str, Any] = {
            "role": "system" if role == "developer" else role,
            "content": _text(msg.get("content"), where),
        }
        if role == "assistant" and msg.get("tool_calls"):
            norm["tool_calls"] = _normalize_tool_calls(msg["tool_calls"], where)
        if role == "assistant":
            reasoning = msg.get("reasoning_content", msg.get("reasoning"))
            if reasoning is not None:
                if not isinstance(reasoning, str):
                    raise RequestError(f"{where}.reasoning_content must be a string", f"{where}.reasoning_content")
                norm["reasoning_content"] = reasoning
        if role == "tool" and msg.get("tool_call_id") is not None:
            if not isinstance(msg["tool_call_id"], str):
                raise RequestError(f"{where}.tool_call_id must be a string", f"{where}.tool_call_id")
            norm["tool_call_id"] = msg["tool_call_id"]
        if msg.get("name") is not None and not isinstance(msg["name"], str):
            raise RequestError(f"{where}.name must be a string", f"{where}.name")
        if role != "assistant" and norm["content"] is None:
            raise RequestError(f"{where}.content is required for role {role!r}", f"{where}.content")
        out.append(norm)
    return out


def _normalize_tool_calls(calls: Any, where: str) -> list[dict[str, Any]]:
    if not isinstance(calls, list):
        raise RequestError(f"{where}.tool_calls must be a list", f"{where}.tool_calls")
    out = []
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise RequestError(f"{where}.tool_calls[{j}].function.name is required", f"{where}.tool_calls")
        args = fn.get("arguments", {})
        if isinstance(args, str):
            try:
                args = loads_strict(args) if args.strip() else {}
            except (ValueError, RecursionError):
                raise RequestError(
                    f"{where}.tool_calls[{j}].function.arguments is not valid JSON", f"{where}.tool_calls"
                ) from None
        if not isinstance(args, dict):
            raise RequestError(
                f"{where}.tool_calls[{j}].function.arguments must be a JSON object", f"{where}.tool_calls"
            )
        out.append({"id": call.get("id"), "type": "function", "function": {"name": fn["name"], "arguments": args}})
    return out


def js_value(value: Any) -> Any:
    """A decoded JSON value as a JavaScript client holds it (``JSON.parse``): every number is one
    IEEE double, so ``30.0`` is ``30``, ``1e3`` is ``1000``, ``-0.0`` is ``0`` and an integer past 2**53
    is rounded; an integer past the double range is ``null`` (JS: ``Infinity``, written ``null``).
    A client such as OpenClaw echoes a tool call's arguments as ``JSON.stringify(JSON.parse(...))``."""
    if isinstance(value, dict):
        return {k: js_value(v) for k, v in value.items()}
    if isinstance(value, list):
        return [js_value(v) for v in value]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return value
    try:
        number = float(value)
    except OverflowError:
        return None
    if not math.isfinite(number):
        return None
    return int(number) if number.is_integer() else number


def canonical_message(m: dict[str, Any]) -> bytes:
    """One message as it counts for conversation keys (see :func:`conversation_key`): an assistant
    message by its stripped content and its tool calls' names and decoded arguments (numbers as a
    JavaScript client echoes them, :func:`js_value`)."""
    if m["role"] == "assistant":
        calls = [
            (
                c["function"]["name"],
                js_value(
                    c["function"]["arguments"]
                    if isinstance(c["function"]["arguments"], dict)
                    else json.loads(c["function"]["arguments"])
                ),
            )
            for c in m.get("tool_calls") or []
        ]
        canon = ["assistant", (m.get("content") or "").strip(), calls]
    else:
        canon = [m["role"], m.get("content"), m.get("tool_call_id")]
    return json.dumps(canon, sort_keys=True, ensure_ascii=False).encode() + b"\n"


def attribution_canonical(m: dict[str, Any]) -> bytes:
    """One message as it counts for attribution keys (see :func:`attribution_keys`); ``b""``: not at all."""
    role = m["role"]
    if role == "system" or is_ephemeral(m):
        return b""
    if role == "assistant":  # OpenClaw's copy of a reply: without directives, reasoning blocks and envelope
        return canonical_message({**m, "content": strip_envelope(reply_as_kept(m.get("content")))})
    content = strip_ephemeral(m.get("content")) if role == "user" else m.get("content")
    return json.dumps([role, content], ensure_ascii=False).encode() + b"\n"


def _running_keys(messages: list[dict[str, Any]], canonical: Callable[[dict[str, Any]], bytes]) -> list[str]:
    """The SHA-256 of every prefix of ``messages`` (each message as ``canonical`` renders it), in one
    pass: linear in the conversation's size, not quadratic."""
    digest, keys = hashlib.sha256(), []
    for m in messages:
        digest.update(canonical(m))
        keys.append(digest.copy().hexdigest())
    return keys


def _digest(messages: list[dict[str, Any]], canonical: Callable[[dict[str, Any]], bytes]) -> str:
    """The SHA-256 of ``messages``, each as ``canonical`` renders it."""
    digest = hashlib.sha256()
    for m in messages:
        digest.update(canonical(m))
    return digest.hexdigest()


def attribution_keys(messages: list[dict[str, Any]]) -> list[str]:
    """``keys[k]`` = :func:`attribution_key` of ``messages[:k + 1]``, for every k, in one pass."""
    return _running_keys(messages, attribution_canonical)


def attribution_key(messages: list[dict[str, Any]]) -> str:
    """A digest of the *conversation* in ``messages``: which session a history continues, and which
    of its replies. More lenient than :func:`conversation_key`, by what agent clients really do
    between two requests of one conversation (seen on OpenClaw, :mod:`clawray.client_rules`):

    * system messages do not count: agents rebuild their system prompt per request (OpenClaw's holds
      the workspace files and the date), and the conversation is what follows it;
    * ephemeral context (a user message that is only a client's internal block, or such a block inside
      a user message) does not count: the client drops it from the next request's history;
    * tool results count by content and order, not by ``tool_call_id``: clients rewrite call ids
      (OpenClaw strips ``_``), and assistant tool calls already count without their ids;
    * a reply counts without a leading envelope header (``[Thu 2026-12-03 17:07 UTC] ``), reply
      directives and reasoning blocks, its whitespace runs as one space: OpenClaw strips them from its
      copy of the reply (:func:`clawray.client_rules.strip_envelope`, :func:`~clawray.client_rules.reply_as_kept`).

    Prompt ids are spliced only on the exact :func:`conversation_key`: a history that matches here but
    not there is attributed and paired, then rendered afresh.
    """
    return _digest(messages, attribution_canonical)


def conversation_keys(messages: list[dict[str, Any]]) -> list[str]:
    """``keys[k]`` = :func:`conversation_key` of ``messages[:k + 1]``, for every k, in one pass
    (a running SHA-256: linear in the conversation's size, not quadratic)."""
    return _running_keys(messages, canonical_message)


def conversation_key(messages: list[dict[str, Any]]) -> str:
    """A digest of normalised ``messages`` that identifies a conversation prefix.

    Assistant messages count by what they say (content without surrounding whitespace, tool-call
    names and decoded arguments), not by how a client echoes them (call ids, argument encoding,
    reasoning kept or dropped), so the served reply and the client's copy of it give the same key.
    """
    return _digest(messages, canonical_message)


def render_key(tools: list[dict[str, Any]] | None) -> str:
    """A digest of everything besides the messages that the chat template renders into a prompt:
    the tool list exactly as it is passed to the template (order and key order included; ``None``
    when ``tool_choice`` is ``"none"`` or there are no tools). A turn's prompt can be spliced onto
    the previous turn's ids only when both have the same render key (see :mod:`clawray.serve.splice`).
    """
    return hashlib.sha256(json.dumps(tools, ensure_ascii=False).encode()).hexdigest()


def _eos_list(value: Any) -> list[int]:
    if value is None:
        return []
    values = [value] if isinstance(value, int) else list(value)
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
        raise ValueError(f"eos_token_id {value!r} is not a token id or a list of token ids")
    return values


def end_of_turn_ids(model_path: str, tokenizer: Any, extra: Iterable[int] = ()) -> list[int]:
    """The token ids that end a reply: the tokenizer's eos (first: the chat template's own end tag),
    then every ``eos_token_id`` of the folder's ``generation_config.json`` (or of ``config.json``
    when there is none: what transformers and vLLM both stop on), then ``extra`` (a request's stop
    ids); duplicates removed, order kept.

    Args:
        model_path: the policy's HF folder.
        tokenizer: its transformers tokenizer.
        extra: more stop ids (e.g. a request's ``stop_token_ids``).

    Raises:
        ValueError: an ``eos_token_id`` in the folder is not an id or list of ids.
    """
    ids = _eos_list(tokenizer.eos_token_id)
    for name in ("generation_config.json", "config.json"):
        path = os.path.join(model_path, name)
        if os.path.exists(path):
            with open(path, encoding="utf-8") as f:
                ids += _eos_list(json.load(f).get("eos_token_id"))
            break
    return list(dict.fromkeys([*ids, *extra]))


class SpecialTokenStripper:
    """Removes a tokenizer's special-token strings (``<|im_start|>``, ``<|im_end|>``, ...) from text
    that clawray itself places inside a prompt it renders (a hint in the teacher prompt; the turn and
    next state in an engine judge's prompt), so that text cannot forge chat turns once the rendered
    prompt is tokenised. A client's own messages are not stripped: they are its prompt.

    Args:
        tokenizer: a transformers tokenizer.
    """

    def __init__(self, tokenizer: Any):
        added = [t.content for t in tokenizer.added_tokens_decoder.values() if t.special]
        self.special = sorted(set(tokenizer.all_special_tokens) | set(added), key=len, reverse=True)

    def __call__(self, text: str) -> str:
        """``text`` with every special-token string removed (repeatedly: removing one may join the
        halves of another)."""
        while any(t in text for t in self.special):
            for t in self.special:
                text = text.replace(t, "")
        return text
