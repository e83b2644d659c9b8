"""Chat messages in and out: validation/normalisation of OpenAI messages, and parsing of the
model's reply text into OpenAI ``content`` + ``tool_calls`` (hermes/Qwen ``<tool_call>`` JSON blocks).

The prompt itself is always rendered by the tokenizer's own chat template; nothing here builds
prompt text.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

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
        return "".join(parts)
    raise RequestError(f"{where}.content must be a string, a list of text parts or null", f"{where}.content")


def normalize_messages(messages: Any) -> list[dict[str, Any]]:
    """Validate OpenAI chat messages and return them in the form the chat template renders.

    ``developer`` becomes ``system``; list content becomes its concatenated text parts; assistant
    ``tool_calls[].function.arguments`` given as a JSON string become the decoded object.

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
        norm: dict[str, Any] = {"role": "system" if role == "developer" else role,
                                "content": _text(msg.get("content"), where)}
        if role == "assistant" and msg.get("tool_calls"):
            norm["tool_calls"] = _normalize_tool_calls(msg["tool_calls"], where)
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
                args = json.loads(args) if args.strip() else {}
            except (json.JSONDecodeError, RecursionError):
                raise RequestError(f"{where}.tool_calls[{j}].function.arguments is not valid JSON",
                                   f"{where}.tool_calls") from None
        if not isinstance(args, dict):
            raise RequestError(f"{where}.tool_calls[{j}].function.arguments must be a JSON object",
                               f"{where}.tool_calls")
        out.append({"id": call.get("id"), "type": "function",
                    "function": {"name": fn["name"], "arguments": args}})
    return out


_TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def parse_reply(text: str) -> tuple[str | None, list[dict[str, Any]], bool]:
    """Split a model reply into OpenAI ``content`` and ``tool_calls``.

    Every ``<tool_call>{"name": ..., "arguments": ...}</tool_call>`` block whose body is a JSON
    object with a string ``name`` becomes one tool call (``arguments`` re-encoded as a JSON string);
    the text outside the blocks is the content (None when empty).

    Returns:
        ``(content, tool_calls, parse_error)``; ``parse_error`` is True when a block was not valid
        JSON, in which case the whole text is returned as content and ``tool_calls`` is empty.
    """
    blocks = list(_TOOL_CALL.finditer(text))
    if not blocks:
        return (text if text.strip() else None), [], False
    calls = []
    for m in blocks:
        try:
            obj = json.loads(m.group(1))
        except (json.JSONDecodeError, RecursionError):
            return text, [], True
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return text, [], True
        args = obj.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except (json.JSONDecodeError, RecursionError):
                return text, [], True
        if not isinstance(args, dict):
            return text, [], True
        calls.append({"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                      "function": {"name": obj["name"], "arguments": json.dumps(args, ensure_ascii=False)}})
    content = _TOOL_CALL.sub("", text).strip()
    return (content or None), calls, False
