"""Parsing and validation of ``POST /v1/chat/completions`` requests.

Everything the client sends is checked here, before any engine work: a bad value raises
:class:`~clawray.chat.RequestError` naming the field (HTTP 400). Parameters clawray does not implement
yet (stop strings, penalties, logprobs, forced tool choice) are rejected with code ``unsupported``
rather than silently ignored.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, Mapping

from clawray.chat import RequestError, loads_strict, normalize_messages

MAX_SESSION_ID_CHARS = 256
GREEDY_BELOW = 1e-5  # temperatures below this are greedy decoding (vLLM's sampling epsilon)
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"", "0", "false", "no", "off"}


@dataclass
class ChatRequest:
    """A validated chat request.

    Attributes:
        messages: normalised messages (see :func:`clawray.chat.normalize_messages`).
        tools: tool definitions to render, or None (also None when ``tool_choice`` is ``"none"``).
        model: the requested model name (echoed), or None.
        max_tokens: response token cap (before clipping to the context window).
        temperature, top_p, seed: sampling parameters.
        session_id: the session, or None when the client sent none.
        turn_type: ``"main"`` or ``"side"``.
        done: the client closes the session with this request.
        n: choices to sample (each recorded as its own turn).
        stream: answer as server-sent events; ``include_usage`` adds the usage chunk.
    """

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    model: str | None
    max_tokens: int
    temperature: float
    top_p: float
    seed: int | None
    session_id: str | None
    turn_type: str
    done: bool
    n: int = 1
    stream: bool = False
    include_usage: bool = False


def decode_body(raw: bytes) -> dict[str, Any]:
    """JSON-decode a request body into an object.

    Raises:
        RequestError: not UTF-8 standard JSON (``NaN``/``Infinity`` and integers over Python's
            digit limit included), not an object, nested too deeply, or holding lone surrogates
            (which no tokenizer can encode).
    """
    try:
        body = loads_strict(raw)
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, NaN, a 5000-digit integer
        raise RequestError(f"request body is not valid JSON ({str(e)[:120]})", None, "invalid_json") from None
    except RecursionError:
        raise RequestError("request body is nested too deeply", None, "invalid_json") from None
    if not isinstance(body, dict):
        raise RequestError("request body must be a JSON object", None, "invalid_json")
    try:
        json.dumps(body, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise RequestError("request body contains invalid Unicode (a lone surrogate)", None, "invalid_unicode") from None
    except (RecursionError, ValueError):
        raise RequestError("request body is nested too deeply", None, "invalid_json") from None
    return body


def _number(body: Mapping, key: str, default: Any, lo: float, hi: float, integer: bool = False) -> Any:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (integer and not isinstance(value, int)):
        raise RequestError(f"'{key}' must be {'an integer' if integer else 'a number'}", key)
    if isinstance(value, float) and not math.isfinite(value) or not lo <= value <= hi:
        raise RequestError(f"'{key}'={value} is outside [{lo}, {hi}]", key)
    return value


def _optional_str(body: Mapping, key: str) -> str | None:
    value = body.get(key)
    if value is not None and not isinstance(value, str):
        raise RequestError(f"'{key}' must be a string", key)
    return value


def _tools(body: Mapping) -> list[dict[str, Any]] | None:
    tools = body.get("tools")
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise RequestError("'tools' must be a list", "tools")
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise RequestError(f"tools[{i}].function.name is required", f"tools[{i}]")
        if tool.get("type", "function") != "function":
            raise RequestError(f"tools[{i}].type must be 'function'", f"tools[{i}].type")
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
            raise RequestError(f"tools[{i}].function.parameters must be a JSON schema object", f"tools[{i}]")
    return tools or None


def _unsupported(body: Mapping) -> None:
    checks = {
        "stop": lambda v: v in ([], ""),
        "logprobs": lambda v: v is False,
        "top_logprobs": lambda v: v == 0,
        "presence_penalty": lambda v: v == 0,
        "frequency_penalty": lambda v: v == 0,
        "logit_bias": lambda v: v == {},
        "response_format": lambda v: isinstance(v, dict) and v.get("type") == "text",
    }
    for key, ok in checks.items():
        if body.get(key) is not None and not ok(body[key]):
            raise RequestError(f"'{key}' is not supported yet; omit it", key, "unsupported")


def _tool_choice(body: Mapping, tools: list | None) -> list | None:
    choice = body.get("tool_choice")
    if choice is None or choice == "auto":
        return tools
    if choice == "none":
        return None
    if choice == "required" or isinstance(choice, dict):
        raise RequestError("tool_choice 'required' or a named function is not supported yet; use 'auto' or "
                           "'none'", "tool_choice", "unsupported")
    raise RequestError("tool_choice must be 'auto', 'none', 'required' or {'type': 'function', ...}", "tool_choice")


def _header_text(headers: Mapping[str, str], name: str, param: str) -> str | None:
    """A header's value as UTF-8 text (HTTP servers hand header bytes over as latin-1).

    Raises:
        RequestError: the bytes are not UTF-8.
    """
    value = headers.get(name)
    if value is None:
        return None
    try:
        return value.encode("latin-1").decode("utf-8")
    except (UnicodeEncodeError, UnicodeDecodeError):
        raise RequestError(f"header {name} is not UTF-8 text", param) from None


def _flag(value: Any, key: str) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower() if isinstance(value, (str, int)) else None
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise RequestError(f"{key} must be true or false, got {value!r}", key)


def _stream(body: Mapping) -> tuple[bool, bool]:
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise RequestError("'stream' must be true or false", "stream")
    options = body.get("stream_options")
    if options is None:
        return bool(stream), False
    if not isinstance(options, dict):
        raise RequestError("'stream_options' must be an object", "stream_options")
    if not stream:
        raise RequestError("'stream_options' is only allowed with stream=true", "stream_options")
    include = options.get("include_usage", False)
    if not isinstance(include, bool):
        raise RequestError("'stream_options.include_usage' must be true or false", "stream_options.include_usage")
    return True, include


def parse_chat_request(body: Mapping[str, Any], headers: Mapping[str, str], default_max_tokens: int,
                       default_temperature: float, max_n: int = 1) -> ChatRequest:
    """Validate a decoded body and the session headers.

    Session fields come from the headers ``X-Session-Id``, ``X-Turn-Type``, ``X-Session-Done``, or
    the body keys ``session_id``, ``turn_type``, ``session_done``; the header wins. Without either,
    the OpenAI ``user`` field is the session id.

    Raises:
        RequestError: any invalid or unsupported field (``param`` names it).
    """
    messages = normalize_messages(body.get("messages"))
    tools = _tool_choice(body, _tools(body))
    _unsupported(body)
    model = _optional_str(body, "model")
    _optional_str(body, "user")
    max_tokens = _number(body, "max_completion_tokens", None, 1, 1 << 20, integer=True)
    max_tokens = _number(body, "max_tokens", max_tokens or default_max_tokens, 1, 1 << 20, integer=True)
    temperature = float(_number(body, "temperature", default_temperature, 0.0, 2.0))
    if temperature < GREEDY_BELOW:  # as vLLM: a temperature this small is greedy decoding (1/T overflows)
        temperature = 0.0
    top_p = float(_number(body, "top_p", 1.0, 1e-6, 1.0))
    seed = _number(body, "seed", None, -(1 << 63), (1 << 63) - 1 - max_n, integer=True)
    stream, include_usage = _stream(body)
    n = _number(body, "n", 1, 1, max_n, integer=True)

    session_id = _header_text(headers, "x-session-id", "session_id")
    if session_id is None:
        session_id = _optional_str(body, "session_id")
    if session_id is None:  # plain OpenAI clients: the `user` field names the end user / conversation
        session_id = _optional_str(body, "user")
    if session_id is not None and not 0 < len(session_id) <= MAX_SESSION_ID_CHARS:
        raise RequestError(f"session id must be 1..{MAX_SESSION_ID_CHARS} characters", "session_id")
    turn_type = headers.get("x-turn-type")
    if turn_type is None:
        turn_type = body.get("turn_type", "main")
    if not isinstance(turn_type, str) or turn_type.lower() not in ("main", "side"):
        raise RequestError(f"turn type {turn_type!r} is not 'main' or 'side'", "turn_type")
    done_raw = headers.get("x-session-done")
    done = _flag(done_raw if done_raw is not None else body.get("session_done", False), "session_done")
    return ChatRequest(messages=messages, tools=tools, model=model, max_tokens=max_tokens, temperature=temperature,
                       top_p=top_p, seed=seed, session_id=session_id, turn_type=turn_type.lower(), done=done,
                       n=n, stream=stream, include_usage=include_usage)
