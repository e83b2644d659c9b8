"""Parsing and validation of ``POST /v1/chat/completions`` requests.

Owns: which body fields and values are accepted (:data:`BODY_KEYS`; the rest ``unsupported``), their
aliases and limits, and how a request names its session, turn type, end and outcome. Must not: touch a
tokenizer, an engine or session state, or import Ray: a body and its headers become a
:class:`ChatRequest` or a :class:`~clawray.chat.RequestError`.

Everything the client sends is checked here, before any engine work: a bad value raises
:class:`~clawray.chat.RequestError` naming the field (HTTP 400). No field is silently ignored: a
field that is not in :data:`BODY_KEYS` (a misspelling, an OpenAI field clawray does not implement
such as ``reasoning_effort`` or ``audio``, the deprecated ``functions`` / ``function_call``), and an
implemented-later field with a value that would change the output (stop strings, penalties,
logprobs, forced tool choice, ``parallel_tool_calls: false``, a JSON response format, a vLLM
sampling extra other than its neutral value) is rejected with code ``unsupported``.

Aliases follow OpenAI and vLLM: ``max_completion_tokens`` wins over the deprecated ``max_tokens``
when both are sent; the session id is the ``X-Session-Id`` header, else the body ``session_id``,
else the OpenAI ``user`` field. ``metadata``, ``store``, ``service_tier``, ``prompt_cache_key`` and
``safety_identifier`` are type-checked and do not change the reply (clawray records every turn and
routes a session to one engine anyway).
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass, field
from typing import Any, Mapping

from clawray.chat import LoneSurrogateError, RequestError, loads_strict, normalize_messages
from clawray.client_rules import side_kind

MAX_SESSION_ID_CHARS = 256
MAX_STOP_TOKEN_IDS = 64
#: Every body key clawray reads; any other key is refused (``unsupported``), never ignored.
BODY_KEYS = frozenset(
    {
        # OpenAI chat completions
        "messages",
        "model",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
        "max_completion_tokens",
        "max_tokens",
        "temperature",
        "top_p",
        "seed",
        "n",
        "stream",
        "stream_options",
        "stop",
        "logprobs",
        "top_logprobs",
        "presence_penalty",
        "frequency_penalty",
        "logit_bias",
        "response_format",
        "user",
        "metadata",
        "store",
        "service_tier",
        "prompt_cache_key",
        "safety_identifier",
        "modalities",
        # vLLM extensions
        "stop_token_ids",
        "top_k",
        "min_p",
        "repetition_penalty",
        # clawray's session protocol
        "session_id",
        "turn_type",
        "session_done",
        "session_outcome",
    }
)
MAX_OUTCOME = 1e6  # |session outcome| bound: a score, not an arbitrary float
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
        user: the OpenAI ``user`` field (:func:`user_session`) when no session id was sent: the end user,
            whose conversations the server tells apart by their histories, each its own session.
        turn_type: ``"main"`` or ``"side"``: the client's ``X-Turn-Type`` / ``turn_type``, else
            ``"side"`` for a client's housekeeping request (:func:`clawray.client_rules.side_kind`).
        side_kind: which housekeeping (``"memory_flush"``, ``"compaction_summary"``, ``"heartbeat"``) when the client
            rules made the request a side turn, else None.
        done: the client closes the session with this request.
        outcome: the session's outcome score (``X-Session-Outcome`` / ``session_outcome``; long-horizon
            credit, :mod:`clawray.algos.credit`), or None.
        n: choices to sample (each recorded as its own turn).
        stream: answer as server-sent events; ``include_usage`` adds the usage chunk.
        stop_token_ids: the request's own end-of-turn ids (vLLM's extension), added to the model's
            (see :func:`clawray.chat.end_of_turn_ids`); the server checks them against the vocabulary.
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
    outcome: float | None = None
    stream: bool = False
    include_usage: bool = False
    stop_token_ids: list[int] = field(default_factory=list)
    side_kind: str | None = None
    user: str | None = None


def decode_body(raw: bytes) -> dict[str, Any]:
    """JSON-decode a request body into an object.

    Raises:
        RequestError: not UTF-8 standard JSON (``NaN``/``Infinity`` and integers over Python's
            digit limit included), not an object, nested too deeply, or holding lone surrogates
            (which no tokenizer can encode).
    """
    try:
        body = loads_strict(raw)
    except LoneSurrogateError:
        raise RequestError(
            "request body contains invalid Unicode (a lone surrogate)", None, "invalid_unicode"
        ) from None
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, NaN, 1e999, a 5000-digit integer
        raise RequestError(f"request body is not valid JSON ({str(e)[:120]})", None, "invalid_json") from None
    except RecursionError:
        raise RequestError("request body is nested too deeply", None, "invalid_json") from None
    if not isinstance(body, dict):
        raise RequestError("request body must be a JSON object", None, "invalid_json")
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


# set by the routing middleware beside the ``x-session-id`` it copies from a body's ``user`` field
# (clawray.serve.routing): Serve routes the end user's requests to one replica; the server reads the copy
# as that user, not as a session id
USER_ROUTED_HEADER = "x-clawray-routed-user"


def user_session(user: str | None) -> str | None:
    """An OpenAI ``user`` field as an id: itself, ``user-<sha256 prefix>`` when longer than
    :data:`MAX_SESSION_ID_CHARS` (any string is a valid ``user``), None when empty or absent."""
    if not user:
        return None
    if len(user) <= MAX_SESSION_ID_CHARS:
        return user
    return "user-" + hashlib.sha256(user.encode("utf-8", "surrogatepass")).hexdigest()[:32]


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
        if fn.get("parameters") is not None:
            _parameters(fn["parameters"], f"tools[{i}].function.parameters")
    return tools or None


def _parameters(params: Any, where: str) -> None:
    """A tool's ``parameters``: a JSON schema object whose ``required`` (when given) lists names and
    whose ``properties`` (when given) map names to schemas (objects, or booleans) whose ``type`` (when
    given) is a type name or a list of them, as the reply parser reads them (OpenAI refuses such a
    schema with a 400 too)."""
    if not isinstance(params, dict):
        raise RequestError(f"{where} must be a JSON schema object", where)
    required = params.get("required")
    if required is not None and not (isinstance(required, list) and all(isinstance(r, str) for r in required)):
        raise RequestError(f"{where}.required must be a list of parameter names", f"{where}.required")
    props = params.get("properties")
    if props is None:
        return
    if not isinstance(props, dict):
        raise RequestError(f"{where}.properties must be an object of parameter schemas", f"{where}.properties")
    for name, schema in props.items():
        at = f"{where}.properties.{name}"
        if isinstance(schema, bool):
            continue
        if not isinstance(schema, dict):
            raise RequestError(f"{at} must be a JSON schema object", at)
        kind = schema.get("type")
        names = kind if isinstance(kind, list) else [kind]
        if kind is not None and not (names and all(isinstance(k, str) for k in names)):
            raise RequestError(f"{at}.type must be a type name or a list of them", f"{at}.type")


#: Implemented-later fields: accepted only with the value that leaves the reply as clawray makes it.
_NEUTRAL = {
    "stop": lambda v: v in ([], ""),
    "logprobs": lambda v: v is False,
    "top_logprobs": lambda v: v == 0 and not isinstance(v, bool),
    "presence_penalty": lambda v: v == 0 and not isinstance(v, bool),
    "frequency_penalty": lambda v: v == 0 and not isinstance(v, bool),
    "logit_bias": lambda v: v == {},
    "response_format": lambda v: v == {"type": "text"},
    "parallel_tool_calls": lambda v: v is True,
    "modalities": lambda v: v == ["text"],
    "top_k": lambda v: v in (0, -1) and not isinstance(v, bool),
    "min_p": lambda v: v == 0 and not isinstance(v, bool),
    "repetition_penalty": lambda v: v == 1 and not isinstance(v, bool),
}
_DEPRECATED = {"functions": "tools", "function_call": "tool_choice"}


def _unsupported(body: Mapping) -> None:
    for key in body:
        if key in _DEPRECATED:
            raise RequestError(
                f"'{key}' (deprecated by OpenAI) is not supported; use '{_DEPRECATED[key]}'", key, "unsupported"
            )
        if key not in BODY_KEYS:
            raise RequestError(f"unknown or unsupported parameter '{key}'", key, "unsupported")
    for key, ok in _NEUTRAL.items():
        if body.get(key) is not None and not ok(body[key]):
            raise RequestError(
                f"'{key}'={json.dumps(body[key])[:80]} is not supported yet; omit it", key, "unsupported"
            )
    for key in ("metadata",):
        if body.get(key) is not None and not isinstance(body[key], dict):
            raise RequestError(f"'{key}' must be an object", key)
    if body.get("store") is not None and not isinstance(body["store"], bool):
        raise RequestError("'store' must be true or false", "store")
    for key in ("service_tier", "prompt_cache_key", "safety_identifier"):
        _optional_str(body, key)


def _stop_token_ids(body: Mapping) -> list[int]:
    ids = body.get("stop_token_ids")
    if ids is None:
        return []
    if (
        not isinstance(ids, list)
        or len(ids) > MAX_STOP_TOKEN_IDS
        or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids)
    ):
        raise RequestError(
            f"'stop_token_ids' must be a list of at most {MAX_STOP_TOKEN_IDS} token ids (integers >= 0)",
            "stop_token_ids",
        )
    return ids


def _tool_choice(body: Mapping, tools: list | None) -> list | None:
    choice = body.get("tool_choice")
    if choice is not None and tools is None and body.get("tools") is None:  # as OpenAI and vLLM
        raise RequestError("tool_choice is only allowed when tools are given", "tool_choice")
    if choice is None or choice == "auto":
        return tools
    if choice == "none":
        return None
    if choice == "required" or isinstance(choice, dict):
        raise RequestError(
            "tool_choice 'required' or a named function is not supported yet; use 'auto' or 'none'",
            "tool_choice",
            "unsupported",
        )
    raise RequestError("tool_choice must be 'auto', 'none', 'required' or {'type': 'function', ...}", "tool_choice")


def header_text(headers: Mapping[str, str], name: str, param: str) -> str | None:
    """A header's value as UTF-8 text (HTTP servers hand header bytes over as latin-1), or None.

    The name is matched as Ray Serve's proxy matches its session header (case-insensitive, ``_`` as
    ``-``: ``X_Session_Id`` is ``x-session-id``), over every header the request sent (a Starlette
    ``Headers`` lists repeats in ``items()``), so the proxy's routing and the server read one value.

    Raises:
        RequestError: the header is sent twice with different values, or its bytes are not UTF-8.
    """
    values = {value for key, value in headers.items() if key.lower().replace("_", "-") == name}
    if not values:
        return None
    if len(values) > 1:
        raise RequestError(f"header {name} is sent {len(values)} times with different values", param)
    try:
        return values.pop().encode("latin-1").decode("utf-8")
    except (UnicodeEncodeError, UnicodeDecodeError):
        raise RequestError(f"header {name} is not UTF-8 text", param) from None


def _shown(value: Any, limit: int = 64) -> str:
    """``repr(value)`` cut to ``limit`` characters, for an error message (an int's repr past 4300
    digits raises; a megabyte header is no message)."""
    text = (
        repr(value)
        if not isinstance(value, int) or abs(value) < 10**limit
        else f"an integer of {len(str(abs(value)))}+ digits"
    )
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _flag(value: Any, key: str) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower() if isinstance(value, (str, int)) else None
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise RequestError(f"{key} must be true or false, got {_shown(value)}", key)


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
    unknown = sorted(set(options) - {"include_usage"})
    if unknown:
        raise RequestError(
            f"stream_options.{unknown[0]} is not supported", f"stream_options.{unknown[0]}", "unsupported"
        )
    include = options.get("include_usage", False)
    if not isinstance(include, bool):
        raise RequestError("'stream_options.include_usage' must be true or false", "stream_options.include_usage")
    return True, include


def parse_chat_request(
    body: Mapping[str, Any],
    headers: Mapping[str, str],
    default_max_tokens: int,
    default_temperature: float,
    max_n: int = 1,
) -> ChatRequest:
    """Validate a decoded body and the session headers.

    Session fields come from the headers ``X-Session-Id``, ``X-Turn-Type``, ``X-Session-Done``,
    ``X-Session-Outcome`` (a finite number, ``|x| <= 1e6``), or the body keys ``session_id``,
    ``turn_type``, ``session_done``, ``session_outcome``; the header wins. Without either,
    the OpenAI ``user`` field is the session id, and a client's housekeeping request (an OpenClaw
    memory flush or compaction summary, :func:`clawray.client_rules.side_kind`) is a side turn.
    ``max_completion_tokens`` wins over ``max_tokens`` (OpenAI's current field over its deprecated
    alias, as in vLLM); both are validated.

    Raises:
        RequestError: any invalid or unsupported field (``param`` names it).
    """
    messages = normalize_messages(body.get("messages"))
    tools = _tool_choice(body, _tools(body))
    _unsupported(body)
    model = _optional_str(body, "model")
    _optional_str(body, "user")
    legacy_max = _number(body, "max_tokens", None, 1, 1 << 20, integer=True)
    max_tokens = _number(body, "max_completion_tokens", None, 1, 1 << 20, integer=True)
    if max_tokens is None:
        max_tokens = legacy_max if legacy_max is not None else default_max_tokens
    temperature = float(_number(body, "temperature", default_temperature, 0.0, 2.0))
    if temperature < GREEDY_BELOW:  # as vLLM: a temperature this small is greedy decoding (1/T overflows)
        temperature = 0.0
    top_p = float(_number(body, "top_p", 1.0, 1e-6, 1.0))
    n = _number(body, "n", 1, 1, max_n, integer=True)
    seed = _number(body, "seed", None, -(1 << 63), (1 << 63) - n, integer=True)  # choice i: seed + i
    stream, include_usage = _stream(body)
    stop_token_ids = _stop_token_ids(body)

    session_id, source = header_text(headers, "x-session-id", "session_id"), "X-Session-Id"
    if header_text(headers, USER_ROUTED_HEADER, USER_ROUTED_HEADER) is not None:
        session_id = None  # the routing middleware's copy of the `user` field (read below), no session id
    if session_id is None:
        session_id, source = _optional_str(body, "session_id"), "session_id"
    if session_id is not None and not 0 < len(session_id) <= MAX_SESSION_ID_CHARS:
        raise RequestError(f"{source} must be 1..{MAX_SESSION_ID_CHARS} characters", source)
    # OpenAI's `user` names the end user, who may hold several conversations at once: not a session
    user = user_session(_optional_str(body, "user")) if session_id is None else None
    turn_type = header_text(headers, "x-turn-type", "turn_type")
    if turn_type is None:
        turn_type = body.get("turn_type")
    kind = None
    if turn_type is None:  # no turn type given: the client's own housekeeping is a side turn
        kind = side_kind(messages, tools)
        turn_type = "side" if kind else "main"
    if not isinstance(turn_type, str) or turn_type.lower() not in ("main", "side"):
        raise RequestError(f"turn type {turn_type!r} is not 'main' or 'side'", "turn_type")
    done_raw = header_text(headers, "x-session-done", "session_done")
    done = _flag(done_raw if done_raw is not None else body.get("session_done", False), "session_done")
    outcome = _outcome(header_text(headers, "x-session-outcome", "session_outcome"), body.get("session_outcome"))
    return ChatRequest(
        messages=messages,
        tools=tools,
        model=model,
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        seed=seed,
        session_id=session_id,
        turn_type=turn_type.lower(),
        done=done,
        n=n,
        stream=stream,
        include_usage=include_usage,
        stop_token_ids=stop_token_ids,
        outcome=outcome,
        side_kind=kind,
        user=user,
    )


_DECIMAL = re.compile(r"\s*[+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?\s*", re.ASCII)


def prompt_chars(messages: list[dict[str, Any]]) -> int:
    """Characters of normalised ``messages`` as JSON: every field a chat template may render (content,
    tool calls, ``reasoning_content``, names, ids), an upper bound on the text the render reads. Only
    content and tool calls were counted: a megabyte of ``reasoning_content`` passed the pre-tokenisation
    length check and was tokenised on the replica's event loop (seconds, every request stalled)."""
    return sum(len(json.dumps(m, ensure_ascii=False)) for m in messages)


def _outcome(header: str | None, body_value: Any) -> float | None:
    """The session outcome from the header (text) or the body (a JSON number), or None.

    Raises:
        RequestError: not a finite number within ``MAX_OUTCOME`` (a bool is not a number).
    """
    raw = header if header is not None else body_value
    if raw is None:
        return None
    try:
        if isinstance(raw, bool) or not isinstance(raw, (str, int, float)):
            raise ValueError
        if isinstance(raw, str) and not _DECIMAL.fullmatch(raw):  # float() also reads "1_0" as 10
            raise ValueError
        value = float(raw)
    except (ValueError, OverflowError):  # OverflowError: an integer past the double range
        value = math.inf if isinstance(raw, int) else None
    if value is None:
        raise RequestError(f"session_outcome must be a number, got {_shown(raw)}", "session_outcome")
    if not math.isfinite(value) or abs(value) > MAX_OUTCOME:
        raise RequestError(
            f"session_outcome must be finite and within +-{MAX_OUTCOME:g}, got {_shown(raw)}", "session_outcome"
        )
    return value
