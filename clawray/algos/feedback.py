"""The ``feedback`` judge's grammar: the sign of a next state, read from explicit signals.

Owns: the grammar (which words and structures are signals, in which order) and a next state's score.
Must not: import Ray, cast votes or take a majority (:mod:`clawray.actors.judge`).

A next state is the messages that followed a turn (the user's reply, or the tool results). Each
message is read by its source; the table of realistic next states with both signs and the traps is
in ``docs/feedback.md`` and ``tests/unit/test_feedback.py``.

Tool results (``role: tool``), first match wins:

1. **Structured** (the content, or its text parts, is one JSON object): failure when
   ``error``/``errors``/``exception`` holds a value other than null, false, 0, "" or an empty
   list/object; ``isError`` (MCP), ``ok`` or ``success`` is false; ``status``/``state`` is
   "error", "failed", "failure" or "fatal"; or an exit code (``exit_code``, ``exitCode``,
   ``returncode``, ``return_code``, ``status_code`` >= 400) is non-zero. Otherwise success: a
   structured result that reports no failure is a clean success, whatever words its values hold.
2. **Exit code in text** ("exit code 1", "exited with code 0", "Exit status: 2"): non-zero is a
   failure, zero a success.
3. **Text**: after removing negated or zero-count mentions ("no errors", "0 failed", "errors: 0",
   "error: null", "without error"), a failure word (error, exception, traceback, failed, failure,
   fatal, panic, "command not found", "no such file", "permission denied") is a failure; any
   other tool result is a success.

User messages (``role: user``): after removing negated complaints ("nothing wrong", "no errors",
"not a mistake"), a complaint (thumbs down, wrong, incorrect, mistake, "not (quite) right",
"not what I asked", "doesn't work", "try again", "no markdown", an error or traceback) is
negative; else praise (thumbs up, correct, right, thanks, great, perfect, excellent, "well done",
"it works") is positive; else no signal. Praise is read as an evaluation only: in a statement (not a
question), outside conditions and checks ("tell me if it works", "make sure it is correct"), at the
start of a clause ("Thanks!", "Correct, ...", "..., perfect.") or as a predicate ("that's right",
"it works"). "Say thanks in one word", "the correct answer", "turn right", "no thanks" are not praise.

The state's score: -1 if any message is negative; else +1 if any is positive; else None (no
signal: an invalid vote, the feedback judge cannot tell).
"""

from __future__ import annotations

import json
import re
from typing import Any

__all__ = ["message_text", "tool_result_sign", "user_text_sign", "feedback_score"]

_FAILURE_STATUS = {"error", "failed", "failure", "fatal", "errored"}
_ERROR_KEYS = ("error", "errors", "exception", "err")
_EXIT_KEYS = ("exit_code", "exitcode", "exitCode", "returncode", "return_code", "exit_status")

_EXIT_TEXT = re.compile(
    r"\b(?:exit(?:ed)?(?: with)?|return(?:ed)?(?: with)?)\s*(?:code|status)\s*[:=]?\s*(-?\d+)", re.IGNORECASE
)
_FAILURE_WORD = r"(?:errors?|exceptions?|traceback|failed|failures?|fatal|panic(?:ked)?)"
# a failure word that says there was none: "no errors", "0 failed", "errors: 0", "error: null", "without error"
_NEGATED_FAILURE = re.compile(
    rf"\b(?:no|zero|0|without|never|none)\s+(?:\w+\s+)?{_FAILURE_WORD}\b"
    rf"|\b{_FAILURE_WORD}\W{{0,3}}\s*[:=]\s*\W?(?:0|none|null|nil|false)\b\W?"
    rf"|\"?{_FAILURE_WORD}\"?\s*:\s*(?:\[\]|\{{\}}|\"\")",
    re.IGNORECASE,
)
_TOOL_FAILURE = re.compile(
    rf"(?<![/\\._-])\b{_FAILURE_WORD}\b(?![._/-]\w)|command not found|no such file|permission denied|segmentation fault",
    re.IGNORECASE,
)

_NEGATED_COMPLAINT = re.compile(
    r"\b(?:nothing|not|no|never|isn't|wasn't|aren't|weren't)\s+(?:\w+\s+)?"
    r"(?:wrong|incorrect|a mistake|mistakes?|errors?|broken|problems?)\b",
    re.IGNORECASE,
)
_COMPLAINT = re.compile(
    r"👎|\bthumbs?[ -]?down\b|\bwrong\b|\bincorrect\b|\bmistakes?\b|\bbroken\b"
    r"|\b(?:not|isn't|wasn't|hardly)\s+(?:\w+\s+)?(?:correct|right|good|great|helpful|perfect)\b|\bthat's not it\b"
    r"|\bnot what I (?:asked|wanted|meant|said)\b|\b(?:doesn't|does not|didn't|did not|still doesn't) work\b"
    r"|\bno markdown\b|\bplease (?:don't|do not|redo|retry|try again)\b|\btry again\b"
    r"|\berrors?\b|\btraceback\b",
    re.IGNORECASE,
)
_NOT_PRAISE = re.compile(r"\bno,? thanks?\b|\bno,? thank you\b", re.IGNORECASE)
# praise is an evaluation of the reply, not a word in a request: it is read in statements only (a
# sentence ending in "?" is a question), outside conditions and checks ("tell me if it works", "make
# sure it is correct"), and only where it evaluates: at the start of a clause ("Thanks!", "Correct,
# ...", "..., perfect.") or as a predicate ("that's right", "it works"); "say thanks", "the correct
# answer", "turn right" are no signal
_SENTENCE = re.compile(r"[^.!?\n]+[.!?]*")
_CONDITION = re.compile(r"\b(?:if|whether|unless|until|once|make sure|ensure|check|verify)\b[^.!?\n,;]*", re.IGNORECASE)
_PRAISE_WORD = r"(?:correct|right|thanks?|thank you|great|perfect|well done|excellent)\b"
_PRAISE = re.compile(
    r"👍|\bthumbs?[ -]?up\b"
    rf"|(?:^|[,;:\]]|\s[-–—])\W*(?:(?:ok(?:ay)?|yes|yeah|yep|oh|wow|good|nice|very|all|so|and)\W+)*{_PRAISE_WORD}"
    r"|\b(?:'s|'re|is|are|was|looks?|seems?|sounds?)\s+(?:\w+\s+)?(?:correct|right|great|perfect)\b"
    r"|\b(?:it|that|this) (?:works?|worked)\b|\bworks now\b",
    re.IGNORECASE,
)


def _praises(text: str) -> bool:
    """Whether a user's text praises the reply (the rules above ``_SENTENCE``)."""
    for sentence in _SENTENCE.findall(_NOT_PRAISE.sub(" ", text)):
        if sentence.rstrip().endswith("?"):
            continue
        if _PRAISE.search(_CONDITION.sub(" ", sentence).strip()):
            return True
    return False


def message_text(content: Any) -> str:
    """A message's text: a string as is, OpenAI content parts joined (text parts only), else ''."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(p.get("text") or "" for p in content if isinstance(p, dict) and p.get("type") == "text")
    return ""


def _truthy(value: Any) -> bool:
    """An ``error`` value that reports a failure: not null, false, 0, '', [], {} or 'none'/'null'."""
    if isinstance(value, str):
        return value.strip().lower() not in ("", "none", "null", "false", "0", "ok")
    return bool(value)


def _structured_sign(obj: dict) -> int:
    lowered = {str(k).lower(): v for k, v in obj.items()}
    if any(_truthy(lowered.get(k)) for k in _ERROR_KEYS if k in lowered):
        return -1
    if lowered.get("iserror") is True or lowered.get("ok") is False or lowered.get("success") is False:
        return -1
    for key in ("status", "state"):
        if isinstance(lowered.get(key), str) and lowered[key].strip().lower() in _FAILURE_STATUS:
            return -1
    for key in _EXIT_KEYS:
        code = lowered.get(key.lower())
        if isinstance(code, int) and not isinstance(code, bool) and code != 0:
            return -1
    code = lowered.get("status_code")
    if isinstance(code, int) and not isinstance(code, bool) and code >= 400:
        return -1
    return 1


def tool_result_sign(content: Any) -> int:
    """+1 (success) or -1 (failure) of one tool result, by the module's rules 1-3.

    Args:
        content: the tool message's ``content`` (a string, content parts, or None).
    """
    text = message_text(content).strip()
    if text.startswith("{"):
        try:
            obj = json.loads(text)
        except ValueError:
            obj = None
        if isinstance(obj, dict):
            return _structured_sign(obj)
    codes = [int(c) for c in _EXIT_TEXT.findall(text)]
    if codes:
        return -1 if codes[-1] != 0 else 1
    return -1 if _TOOL_FAILURE.search(_NEGATED_FAILURE.sub(" ", text)) else 1


def user_text_sign(content: Any) -> int | None:
    """-1 (a complaint), +1 (praise) or None (no signal) of one user message (module docstring)."""
    text = _NEGATED_COMPLAINT.sub(" ", message_text(content))
    if _COMPLAINT.search(text):
        return -1
    return 1 if _praises(text) else None


def feedback_score(next_state: list[dict[str, Any]]) -> int | None:
    """The sign of a next state: -1 if any tool result failed or any user message complains; else
    +1 if any tool result succeeded or any user message praises; else None (no signal, an invalid
    vote). Messages of other roles are not read.

    Args:
        next_state: OpenAI messages (``role``, ``content``) that followed the turn.
    """
    score = None
    for msg in next_state:
        role = msg.get("role")
        if role == "tool":
            sign: int | None = tool_result_sign(msg.get("content"))
        elif role == "user":
            sign = user_text_sign(msg.get("content"))
        else:
            continue
        if sign == -1:
            return -1
        if sign == 1:
            score = 1
    return score
