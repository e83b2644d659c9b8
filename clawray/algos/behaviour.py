"""Behaviour-level diversity: token entropy is not behaviour diversity (pure functions, no Ray).

Owns: the behaviour signature and the diversity measures below. Must not: sample the probe replies or
feed the behaviour controller (:mod:`clawray.monitor` does).

A policy can keep a high per-token entropy while every reply follows one strategy (the support of
its *behaviour* distribution collapses while the token distribution still looks wide). Of the K replies
to each of P fixed probe prompts (sampled at temperature 1), the measures, per prompt, then averaged
over the prompts:

* ``inv/behaviour_distinct`` = (number of distinct behaviour signatures) / K, in [1/K, 1];
* ``inv/behaviour_entropy`` = Shannon entropy (nats) of the signatures' empirical distribution,
  in [0, ln K];
* ``inv/self_similarity`` = mean over the K(K-1)/2 pairs of replies of the Jaccard overlap
  ``|A ∩ B| / |A ∪ B|`` of their word n-gram sets (two empty replies: 1), in [0, 1].

A behaviour signature (:func:`signature`) is, for a reply with tool calls, the sorted tool names each
with its sorted argument keys (``tool:calc(a,b)``: which tool and how it is called, not the values);
for a text reply, its first sentence (after a leading list marker such as "1." or "-"; a sentence
ends at ".", "!" or "?" before a space or the end, or at a line break, so "3.5" does not end
one) normalised: lower case, digit runs replaced by ``0``, anything
but letters, digits and spaces removed, spaces collapsed (so "The answer is 7." and "the answer is
12" are one behaviour, "Let me think: 3 + 4 = 7" another).
"""

from __future__ import annotations

import json
import math
import re
from collections import Counter
from typing import Any, Sequence

_SENTENCE_END = re.compile(r"[.!?](?=\s|$)|\n")
_LIST_MARKER = re.compile(r"^(?:\d+[.)]|[-*\u2022])\s+")
_DIGITS = re.compile(r"\d+")
_NON_WORD = re.compile(r"[^a-z0-9 ]+")


def signature(message: dict[str, Any]) -> str:
    """The behaviour signature of one assistant message (see the module docstring)."""
    calls = message.get("tool_calls") or []
    if calls:
        parts = []
        for call in calls:
            fn = call.get("function") or {}
            args = fn.get("arguments", "")
            try:  # no arguments at all ("") is the call without arguments, as "{}"
                parsed = (json.loads(args) if args.strip() else {}) if isinstance(args, str) else args
            except (ValueError, RecursionError):
                parsed = None
            keys = ",".join(sorted(parsed)) if isinstance(parsed, dict) else "?"
            parts.append(f"{fn.get('name', '')}({keys})")
        return "tool:" + "+".join(sorted(parts))
    text = (message.get("content") or "").strip().lower()
    first = _SENTENCE_END.split(_LIST_MARKER.sub("", text), maxsplit=1)[0]
    first = _NON_WORD.sub(" ", _DIGITS.sub("0", first))
    return "text:" + " ".join(first.split())


def entropy(items: Sequence[str]) -> float:
    """Shannon entropy (nats) of the empirical distribution of ``items``; 0 for none."""
    if not items:
        return 0.0
    n = len(items)
    return -sum(c / n * math.log(c / n) for c in Counter(items).values()) + 0.0


def ngrams(text: str, n: int) -> set[tuple[str, ...]]:
    """The set of word n-grams of ``text`` (lower case, split on whitespace); a text shorter than
    ``n`` words gives its one (shorter) tuple of words, an empty text the empty set."""
    words = (text or "").lower().split()
    if len(words) < n:
        return {tuple(words)} if words else set()
    return {tuple(words[i : i + n]) for i in range(len(words) - n + 1)}


def jaccard(a: set, b: set) -> float:
    """``|a ∩ b| / |a ∪ b|``; 1.0 for two empty sets."""
    union = a | b
    return len(a & b) / len(union) if union else 1.0


def self_similarity(texts: Sequence[str], n: int = 2) -> float:
    """Mean pairwise Jaccard overlap of the texts' word n-gram sets; NaN with fewer than two texts."""
    grams = [ngrams(t, n) for t in texts]
    pairs = [(i, j) for i in range(len(grams)) for j in range(i + 1, len(grams))]
    if not pairs:
        return math.nan
    return sum(jaccard(grams[i], grams[j]) for i, j in pairs) / len(pairs)


def _text(message: dict[str, Any]) -> str:
    """The reply's text for n-gram overlap: its content, then its tool calls (name and arguments)."""
    calls = " ".join(
        f"{(c.get('function') or {}).get('name', '')} {(c.get('function') or {}).get('arguments', '')}"
        for c in message.get("tool_calls") or []
    )
    return f"{message.get('content') or ''} {calls}".strip()


def behaviour_stats(replies: Sequence[Sequence[dict[str, Any]]], n: int = 2) -> dict[str, float]:
    """The monitor's three figures over P probe prompts.

    Args:
        replies: ``[P][K]`` assistant messages (``content``, ``tool_calls``), K replies per prompt.
        n: the n of the word n-grams.

    Returns:
        ``{"inv/behaviour_distinct", "inv/behaviour_entropy", "inv/self_similarity"}``, each the mean
        over the prompts.

    Raises:
        ValueError: no prompt, or a prompt with fewer than 2 replies.
    """
    if not replies or any(len(r) < 2 for r in replies):
        raise ValueError("behaviour_stats needs at least one prompt and at least 2 replies per prompt")
    distinct, ent, sim = [], [], []
    for group in replies:
        sigs = [signature(m) for m in group]
        distinct.append(len(set(sigs)) / len(sigs))
        ent.append(entropy(sigs))
        sim.append(self_similarity([_text(m) for m in group], n))
    p = len(replies)
    return {
        "inv/behaviour_distinct": sum(distinct) / p,
        "inv/behaviour_entropy": sum(ent) / p,
        "inv/self_similarity": sum(sim) / p,
    }
