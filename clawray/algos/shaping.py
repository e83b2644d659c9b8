"""Dense reward shaping: small pure functions of one served turn, named in ``trainer.shaping``.

Owns: the terms (:data:`TERMS`) and each one's signed contribution (:func:`shaping_terms`). Must not:
import Ray, call a judge, or add them to a reward (:meth:`~clawray.algos.credit_ledger.CreditLedger.shape`
does that).

Each term maps a :class:`~clawray.types.Turn` to a value in [0, 1] (1 = the fault is present); the
run's config gives each a weight, and a judged turn's reward becomes
``r_t + sum_i (-weight_i * term_i(turn))`` (a penalty; a negative weight turns a term into a bonus)
before credit assignment (:mod:`clawray.algos.credit`). Each applied term is kept on the sample
(``info["shaping"][name]``, the signed contribution) and logged per step as
``reward/shaping/<name>`` (its batch mean). Terms only read the turn (its response message, its
``truncated``/``tool_parse_error`` flags, its request history).

Which turns are shaped is :meth:`~clawray.algos.credit_ledger.CreditLedger.shape`'s rule (those with a
reward, not pure OPD samples; a penalised 0-scored turn trains on the penalty).

Terms:
  * ``tool_parse_error``: the reply held a ``<tool_call>`` block that was not a valid tool call (hermes JSON or Qwen3-Coder XML).
  * ``truncated``: the reply was cut by ``max_tokens`` (or the context end).
  * ``repeated_tool_call``: the reply repeats a tool call (same function name and arguments) that an
    earlier assistant message of the same request history already made.
"""

from __future__ import annotations

import json
from typing import Any, Callable

from clawray.chat import js_value
from clawray.types import Turn

ShapingFn = Callable[[Turn], float]


def tool_parse_error(turn: Turn) -> float:
    """1.0 when the reply's tool call failed to parse, else 0.0."""
    return float(bool(turn.tool_parse_error))


def truncated(turn: Turn) -> float:
    """1.0 when the reply was cut by ``max_tokens`` (not ended by a stop token), else 0.0."""
    return float(bool(turn.truncated))


def _calls(message: dict[str, Any]) -> list[tuple[str, str]]:
    """``(name, canonical arguments JSON)`` of each tool call of an assistant message."""
    out = []
    for call in message.get("tool_calls") or []:
        fn = call.get("function") or {}
        args = fn.get("arguments", "")
        try:  # the same arguments in another key order, spacing or number form (30.0 echoed as 30) are the same call
            args = json.dumps(js_value(json.loads(args) if isinstance(args, str) else args), sort_keys=True)
        except (ValueError, TypeError, RecursionError):
            pass
        out.append((str(fn.get("name", "")), str(args)))
    return out


def repeated_tool_call(turn: Turn) -> float:
    """1.0 when one of the reply's tool calls (name and arguments, key order ignored) was already
    made by an earlier assistant message of the request's history, else 0.0."""
    seen = {c for m in turn.messages if m.get("role") == "assistant" for c in _calls(m)}
    return float(any(c in seen for c in _calls(turn.response_message)))


TERMS: dict[str, ShapingFn] = {
    "tool_parse_error": tool_parse_error,
    "truncated": truncated,
    "repeated_tool_call": repeated_tool_call,
}


def check_terms(weights: dict[str, float]) -> None:
    """Raise ``ValueError`` naming an unknown term (the valid ones are :data:`TERMS`)."""
    unknown = sorted(set(weights) - set(TERMS))
    if unknown:
        raise ValueError(f"unknown shaping term(s) {unknown}; expected some of {sorted(TERMS)}")


def shaping_terms(turn: Turn, weights: dict[str, float]) -> dict[str, float]:
    """The signed contribution ``-weight * term(turn)`` of every configured term (0.0 included).

    Raises:
        ValueError: an unknown term name.
    """
    check_terms(weights)
    return {name: 0.0 - float(w) * TERMS[name](turn) for name, w in weights.items()}
