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
   ``returncode``, ``return_code``) is non-zero, or an HTTP status (``status_code``, ``statusCode``,
   ``status``, ``http_status``) is 400 or more. Otherwise success: a
   structured result that reports no failure is a clean success, whatever words its values hold.
2. **Exit code in text** ("exit code 1", "exited with code 0", "Exit status: 2"): non-zero is a
   failure, zero a success.
3. **Text**: after removing negated or zero-count mentions ("no errors", "0 failed", "errors: 0",
   "error: null", "without error"; the value must end its field: "Error: 0 is not a valid port"
   stays), a program's failure output is a failure: a line that starts
   with a failure label ("error: ...", "ValueError: ...", "fatal:", "[ERROR]", "FAILED ...", "npm
   ERR!", "npm error ...", "error TS2322:", "fatal error:", "Build failed", "Failed to ..."), a non-zero failure count ("2 failed", "1 error"), a
   traceback, "command not found", "no such file or directory", "permission denied", "segmentation
   fault", "command timed out", dash's "sh: 1: x: not found", a shell's "Killed", apt's "E: ...",
   "TIMEOUT", an HTTP 4xx/5xx status line or "Error 404:" label; or an error message opening the result
   (``_OPENING_ERROR``: OpenClaw sends a failed tool's error text alone, "File not found: x", "Tool x
   not found", "Could not find ..."). Any other tool result is a success: a text that only mentions
   failures (a file a ``read`` tool returns, "Find the error in this sum") reports none.

User messages (``role: user``), read with typographic and dropped apostrophes restored ("doesnt",
"that’s"): pasted failure output (rule 3) is a complaint. Else, sentence by
sentence with conditions and checks removed ("tell me if it works", "check the log for errors"), a
complaint (thumbs down, wrong, incorrect, mistake, "not (quite) right", "not what I asked", "doesn't
work", "try again", "no markdown", an error, exception or traceback) is negative, except a negated or
mended fault ("nothing wrong", "not a mistake", "you fixed the error", "it no longer throws an
exception", "that was wrong, but now it's correct"), a fault word that names a topic ("error messages", "error handling", "a question about errors"), and fault
words inside a fresh request ("Add error handling", "Write a function that raises an error", "List
common mistakes") or a question ("How do I handle errors?", "What errors can it raise?"); a request
or question that points at a fault that is there ("Catch the exception", "write it again without the mistake", "What does this error mean?") and
a fault the user reports seeing ("I get a KeyError", "it throws an exception", "there is still an
error") complain. Else praise (thumbs up, correct, right, thanks, great, perfect, excellent,
"well done", "it works") is positive; else no signal. Praise is read as an evaluation only: in a
statement (not a question), outside conditions and checks, at the start of a clause ("Thanks!",
"Correct, ...", "..., perfect.") or as a predicate ("that's right", "it works"). "Say thanks in one
word", "the correct answer", "turn right", "no thanks" are not praise.

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
_HTTP_STATUS_KEYS = ("status_code", "statuscode", "status", "http_status", "httpstatus")  # lower case
# an error message that opens a tool result (OpenClaw sends a failed tool's error as the tool message's
# whole text, with no flag: "File not found: x", "Tool x not found", "Could not find the exact text in
# x", "Unknown tool name: x", "Operation aborted", "Write verification failed for x", "Read requires a
# file path, but x is a directory", "Found 2 occurrences of the text in x. The text must be unique",
# "Working directory does not exist: x"); read at the start only: a file's text that holds such a
# sentence later is no failure
_OPENING_ERROR = re.compile(
    r"\A\s*(?:(?:[\w.\-]+[ \t]+){0,2}not found\b|(?:could not|cannot|can't|unable to|failed to)\s"
    r"|(?:unknown|invalid|unsupported|unrecognized|missing)[\w \t\-]{0,40}:"
    r"|operation (?:aborted|cancell?ed)\b|tool execution was blocked\b|timeout:\s*\d"
    r"|\w+(?:[ \t]+\w+)?[ \t]+requires[^\n.]{1,120},[ \t]+but\b"
    r"|found \d+ occurrences\b[^\n]{0,200}?\bmust be unique\b"
    r"|[^\n]{0,160}?\b(?:does not exist|doesn't exist)(?::|\.?[ \t]*(?:\n|\Z))"
    r"|[^\n]{0,80}?\b(?:verification failed|is not allowed|not permitted|access denied)\b)",
    re.IGNORECASE,
)

_EXIT_TEXT = re.compile(
    r"\b(?:exit(?:ed)?(?: with)?|return(?:ed)?(?: with)?)[\s_]*(?:code|status)\s*[:=]?\s*(-?\d+)", re.IGNORECASE
)
_FAILURE_WORD = r"(?:errors?|exceptions?|traceback|failed|failures?|fatal|panic(?:ked)?)"
# a failure word that says there was none: "no errors", "0 failed", "errors: 0", "error: null", "without error"
_NEGATED_FAILURE = re.compile(
    rf"\b(?:no|zero|0|without|never|none)\s+(?:\w+\s+)?{_FAILURE_WORD}\b"
    # the value must end its field ("errors: 0, warnings: 2", "error=null warn=1"): "Error: 0 is not a
    # valid port" and "error: null pointer dereference" are failures
    rf"|\b{_FAILURE_WORD}\W{{0,3}}\s*[:=]\s*\W?(?:0|none|null|nil|false)\b\W?"
    r"(?=[ \t]*(?:\n|\Z|[,;})\]|]|\.(?:\s|\Z)|[\w.\-]+[ \t]*[:=]))"
    rf"|\"?{_FAILURE_WORD}\"?\s*:\s*(?:\[\]|\{{\}}|\"\")",
    re.IGNORECASE,
)
# what a program prints when it fails, as opposed to a text that mentions failures (a file a `read`
# tool returns, a search hit): a line that starts with a failure label ("error: ...", "ValueError: ...",
# "npm ERR!", "error[E0308]:", "[ERROR]", "FAILED tests/...", "E   AssertionError", "Build failed"), a
# non-zero failure count ("2 failed", "1 error generated"), a traceback or a system message
_FAILURE_OUTPUT = re.compile(
    r"^[ \t]*(?:E[ \t]+)?(?:[\w.\-/\[\]]+(?:\(\d+,\d+\))?:[ \t]*){0,3}(?:\(\d+\)[ \t]*)?(?:fatal[ \t]+)?"
    r"(?:\[(?:errors?|fatal)\]|(?:errors?(?:[ \t]+[A-Z]*\d+)?|fatal|panic|exception|traceback)[ \t]*(?::|!|\[|\(|$)"
    r"|\w*(?:error|exception)[ \t]*:|(?:\w+[ \t]+)?failed\b)"
    r"|\b[1-9]\d*[ \t]+(?:\w+[ \t]+)?(?:failed|failures?|errors?)\b|\b(?:failures|errors|failed)[ \t]*[:=][ \t]*[1-9]"
    r"|traceback \(most recent call last\)|\bexception in thread\b|\bpanicked at\b|\*\*\*(?!\*)[^\n*]*\berror [1-9]\d*"
    r"|\bnpm ERR!|^[ \t]*npm error\b|^[ \t]*curl: \(\d+\)|command not found|no such file or directory|permission denied|segmentation fault|core dumped"
    r"|^[ \t]*(?:/[\w/.\-]+/)?(?:ba|da|z|k)?sh: (?:line )?\d+: [^\n]+: not found[ \t]*$"  # dash: "sh: 1: foo: not found"
    r"|\b(?:command|request|operation|connection) timed out\b"
    r"|^[ \t]*HTTP/\d(?:\.\d)?[ \t]+[45]\d\d\b",  # an HTTP response's status line: 4xx, 5xx
    re.IGNORECASE | re.MULTILINE,
)
# log levels and test summaries; a shell's "Killed" (the OOM killer), apt's "E: ..." lines
_FAILURE_LEVEL = re.compile(
    r"^[ \t]*(?:--- )?(?:FAILED|FAIL|ERROR|FATAL|TIMEOUT)\b|^[ \t]*Killed[ \t]*$"
    r"|^[ \t]*[\w/.\-]+: line \d+:[ \t]+\d+[ \t]+Killed\b|^E: [A-Z]",
    re.MULTILINE,
)


def _failure_output(text: str) -> bool:
    """Whether a text holds a program's failure output (``_FAILURE_OUTPUT``), negations removed."""
    text = _NEGATED_FAILURE.sub(" ", text)
    return bool(_FAILURE_OUTPUT.search(text) or _FAILURE_LEVEL.search(text))


# user text is read by sentence; conditions and checks ("tell me if it works", "make sure it is correct",
# "check the log for errors") hold no evaluation and are removed before reading
_SENTENCE = re.compile(r"[^.!?\n]+[.!?]*")
_CONDITION = re.compile(r"\b(?:if|whether|unless|until|once|make sure|ensure|check|verify)\b[^.!?\n,;]*", re.IGNORECASE)
_NEGATED_COMPLAINT = re.compile(
    r"\b(?:nothing|not|no|never|isn't|wasn't|aren't|weren't)\s+(?:\w+\s+)?"
    r"(?:wrong|incorrect|a mistake|mistakes?|errors?|exceptions?|bugs?|tracebacks?|broken|problems?|too (?:long|verbose|wordy))\b"
    # a fault that no longer shows: "it no longer throws an exception", "I don't get any errors now"
    r"|\b(?:no longer|doesn't|does not|didn't|did not|don't|do not|won't|never)\s+(?:\w+\s+)?"
    r"(?:throw|raise|give|show|return|print|get|hit|see)s?\s+(?:\w+\s+){0,2}?"
    r"(?:errors?|exceptions?|mistakes?|bugs?|tracebacks?)\b"
    # a fault that is gone is no complaint: "you fixed the error", "the bug is gone"
    r"|\b(?:fixed|solved|resolved|got rid of)\s+(?:\w+\s+)?(?:errors?|mistakes?|problems?|bugs?|exceptions?)\b"
    r"|\b(?:errors?|mistakes?|problems?|bugs?|exceptions?)\s+(?:(?:is|are|was|were|has been|have been|seems?)\s+)?"
    r"(?:gone|fixed|resolved|solved)\b"
    # the user's own mistake, conceded: "You're right, I was wrong", "my bad"
    r"|\bI (?:was|am|'m) (?:wrong|mistaken|incorrect)\b|\bmy (?:bad|mistake)\b",
    re.IGNORECASE,
)
# a past fault the reply mended: what the user said was wrong before a "(but) now it's right" is
# history, not an evaluation of this reply ("That was wrong, but now it's correct", "It was broken
# before. Now it works!"); only a "now" that judges the reply ends it ("..., now fix it" stays)
_PAST = re.compile(r"\b(?:was|were|had been|used to be|before|earlier|previously)\b", re.IGNORECASE)
_NOW_JUDGED = re.compile(
    r"\b(?:now|this time)\W{1,3}(?:it|that|this|you|everything|the \w+)(?:'s|'re|\s+is|\s+are|\s+works?|\s+looks?"
    r"|\s+seems?|\s+got it|\s+did it)\b|\b(?:it )?works now\b",
    re.IGNORECASE,
)
_LEAD = re.compile(r"^\W*(?:(?:but|and)\W+)?$", re.IGNORECASE)


def _without_mended_past(text: str) -> str:
    """``text`` without the past faults a later "now it's ..." says the reply mended (``_NOW_JUDGED``
    after ``_PAST`` in the same sentence, or opening the sentence after one). Linear in the text."""
    sentences, mended = _SENTENCE.findall(text), False
    for i, sentence in enumerate(sentences):
        now = _NOW_JUDGED.search(sentence)
        if now is None:
            continue
        before = sentence[: now.start()]
        if _PAST.search(before):
            sentences[i], mended = sentence[now.start() :], True
        elif i and _LEAD.match(before) and _PAST.search(sentences[i - 1]):
            sentences[i - 1], mended = " ", True
    return "\n".join(sentences) if mended else text  # one sentence per line: the same sentences


_COMPLAINT = re.compile(
    r"👎|\bthumbs?[ -]?down\b|\bwrong\b|\bincorrect\b|\bmistakes?\b|\bbroken\b"
    r"|\b(?:not|isn't|wasn't|hardly)\s+(?:\w+\s+)?(?:correct|right|good|great|helpful|perfect)\b|\bthat's not it\b"
    r"|(?:\bnot|n't)\s+what I (?:asked|wanted|meant|said)\b|\b(?:doesn't|does not|didn't|did not|still doesn't) work\b"
    r"|\b(?:doesn't|does not|don't|do not)\s+(?:look|seem|sound|feel|think|believe)\s+(?:[\w']+\s+){0,2}?(?:right|correct)\b"
    r"|\b(?:not|isn't|aren't|wasn't|weren't)\s+(?:\w+\s+)?working\b|\b(?:it|this|that|still)\s+(?:fail|crash)(?:s|es|ed)\b"
    r"|\b(?:doesn't|does not|didn't|did not|won't|still doesn't)\s+(?:compile|build|run|pass)\b"
    r"|\bno markdown\b|\btoo (?:long|verbose|wordy|slow)\b|\bplease (?:don't|do not|redo|retry|try again)\b|\btry again\b"
    r"|\b(?:errors?|exceptions?)\b|\btraceback\b"
    # a correction after a concession: "Thanks, but the total should be 12"
    r"|\bbut(?:\W+\w+){0,8}?\W+should (?:be|have been|say|read|return)\b"
    # the same correction in a sentence of its own ("The total should be 12 though.") and an omission
    # pointed out ("Right, but you forgot the units.")
    r"|\bshould (?:be|have been|say|read|return)\b(?:\W+\w+){0,8}?\W+though\b"
    r"|\byou (?:forgot|missed|left out|omitted)\b",
    re.IGNORECASE,
)
# a complaint is an evaluation of the reply too: words of a fault inside a fresh request ("Add error
# handling", "Write a function that raises an error", "List common mistakes"), a condition or a check
# ("Check the log for errors", "tell me if anything is wrong") are no signal, unless the request
# points at a fault that is there ("Catch the exception", "write it again without the mistake")
_CLAUSE = re.compile(r"[^,;:\]]+")
_REQUEST = re.compile(
    r"^\W*(?:(?:please|pls|now|also|then|and|next|so|ok(?:ay)?|can you|could you|would you|will you|let's|let us"
    r"|i want you to|i'd like you to|go ahead and)\W+)*"
    r"(?:add|write|create|implement|build|make|generate|design|define|handle|catch|raise|throw|return|print|log"
    r"|include|draft|compose|translate|refactor|document|test|simulate|emit|list)\b",
    re.IGNORECASE,
)
_REDO = re.compile(r"\b(?:it|this|that|them|everything)\s+again\b|\binstead\b|\bthis time\b", re.IGNORECASE)
_FAULT_NOUN = r"(?:errors?|exceptions?|mistakes?|bugs?|traceback)"
_COMPOUND_FAULT = re.compile(
    r"\b(?:errors?|exceptions?)[ -](?:handl\w*|messages?|codes?|check\w*|cases?|paths?|types?|class(?:es)?"
    r"|counts?|rates?|pages?|logs?|bars?|states?|values?|responses?|reporting|recovery|safety)\b",
    re.IGNORECASE,
)
# faults as what a text is about ("a question about errors", "reading about common mistakes") are a
# topic too; one that is there ("about this error", "about an error") is not
_ABOUT_FAULTS = re.compile(
    r"\b(?:about|regarding|concerning|on the subject of)\s+"
    r"(?!(?:the|this|that|your|my|our|these|those|same|an?)\b)(?:\w+\s+){0,2}?"
    r"(?:errors|exceptions|mistakes|bugs|tracebacks|failures)\b",
    re.IGNORECASE,
)
_POINTED_FAULT = re.compile(rf"\b(?:the|this|that|your|same|these|those)\s+(?:\w+\s+)?{_FAULT_NOUN}\b", re.IGNORECASE)
# a fault the user reports seeing ("I get a KeyError", "it throws an exception", "there was an error
# message") complains in a statement or a question (in a request it is what to build: "a function
# that raises an error")
_REPORTED_FAULT = re.compile(
    r"\b(?:i|we|it|this|that|you)\s+(?:still\s+|keep\s+|am\s+|are\s+|now\s+)?"
    r"(?:throws?|threw|throwing|raises?|raised|raising|gives?|gave|giving|shows?|showed|returns?|returned"
    r"|prints?|printed)\s+(?:\w+\s+){0,2}?"
    rf"(?:{_FAULT_NOUN}|\w+error|\w+exception)\b"
    rf"|\bthere(?:'s| is| was| are| were)(?: still)?\s+(?:\w+\s+){{0,2}}?{_FAULT_NOUN}",
    re.IGNORECASE,
)
# seeing one is reported whatever it is called ("I get an error message"); a program's output is read
# with the topics removed ("it prints the error message" reports none)
_SEEN_FAULT = re.compile(
    r"\b(?:i|we|you)\s+(?:still\s+|keep\s+|am\s+|are\s+|now\s+)?"
    r"(?:get|gets|got|getting|see|sees|saw|seeing|hit|hits|have|had)\s+(?:\w+\s+){0,2}?"
    rf"(?:{_FAULT_NOUN}|\w+error|\w+exception)\b",
    re.IGNORECASE,
)
# a question about faults is a fresh request too ("How do I handle errors?", "What is the difference
# between an error and an exception?"), unless it points at one ("What does this error mean?")
_QUESTION = re.compile(
    r"^\W*(?:(?:so|and|now|also|then|ok(?:ay)?|but|and now)\W+)*"
    r"(?:how|what|why|which|when|where|who|whose|is there|are there|can|could|should|would|do|does|is|are)\b",
    re.IGNORECASE,
)
_FAULT_WORDS = re.compile(rf"\b{_FAULT_NOUN}\b", re.IGNORECASE)
# asking whether there were any ("Any errors?", "Were there any errors?", "Did you get any errors?")
_ASKS_ANY = re.compile(
    r"^\W*(?:(?:did|do|does|have|has|had|were|was|are|is)\s+(?:you|there|it|we|they)\s+(?:\w+\s+){0,2}?)?any\b",
    re.IGNORECASE,
)


def _complains(text: str) -> bool:
    """Whether a user's text complains about the reply (the rules above ``_CLAUSE``); a pasted
    failure output (``ValueError: ...``, a traceback) is a complaint wherever it stands."""
    text = _NEGATED_COMPLAINT.sub(" ", text)
    if _failure_output(text):
        return True
    text = _without_mended_past(text)
    for sentence in _SENTENCE.findall(text):
        question = sentence.rstrip().endswith("?")
        for clause in _CLAUSE.findall(_CONDITION.sub(" ", sentence)):
            clause = _ABOUT_FAULTS.sub(" ", clause)  # "a question about errors": a topic
            topic = _COMPOUND_FAULT.sub(" ", clause)  # "error messages", "error handling": a topic
            if question and _ASKS_ANY.search(clause) and not _POINTED_FAULT.search(topic):
                continue  # "Were there any errors?": a question, no evaluation
            if _REQUEST.search(clause) and not _REDO.search(clause):
                if _POINTED_FAULT.search(topic):  # not "a function that raises an error"
                    return True
            elif _SEEN_FAULT.search(clause) or _REPORTED_FAULT.search(topic):
                return True
            elif question and _QUESTION.search(clause):
                if _POINTED_FAULT.search(topic) or _COMPLAINT.search(_FAULT_WORDS.sub(" ", topic)):
                    return True  # "Why is this wrong?"
            elif _COMPLAINT.search(topic):
                return True
    return False


_NOT_PRAISE = re.compile(r"\bno,? thanks?\b|\bno,? thank you\b", re.IGNORECASE)
# praise is an evaluation of the reply, not a word in a request: it is read in statements only (a
# sentence ending in "?" is a question), outside conditions and checks ("tell me if it works", "make
# sure it is correct"), and only where it evaluates: at the start of a clause ("Thanks!", "Correct,
# ...", "..., perfect.") or as a predicate ("that's right", "it works"); "say thanks", "the correct
# answer", "turn right" are no signal
_PRAISE_WORD = r"(?:correct|right|thanks?|thank you|great|perfect|well done|excellent)\b"
_PRAISE = re.compile(
    r"👍|\bthumbs?[ -]?up\b"
    r"|\b(?:'s|'re|is|are|was|looks?|seems?|sounds?)\s+(?:\w+\s+)?(?:correct|right|great|perfect)\b"
    r"|\b(?:it|that|this) (?:works?|worked)\b|\bworks now\b",
    re.IGNORECASE,
)
# a clause opening with praise, matched at each clause's start (split by ``_CLAUSE_START``): one
# anchored match per clause keeps the reading linear in the text (a search from every separator
# would rescan a run of them: ``","*40000`` took 130 s)
_CLAUSE_START = re.compile(r"[,;:\]]|\s[-–—]")
# "Correct answer is 12, you said 14": a correct/right that names what the reply should have said is a
# correction, not praise
_CORRECTION = r"(?!(?:(?<=correct)|(?<=right))\s+(?:answer|one|value|result|number|total|sum|solution|output|way|code|command|version|file|path)\b)"
_PRAISE_OPENING = re.compile(
    rf"\W*(?:(?:ok(?:ay)?|yes|yeah|yep|oh|wow|good|nice|very|all|so|and)\W+)*{_PRAISE_WORD}{_CORRECTION}",
    re.IGNORECASE,
)


def _praises(text: str) -> bool:
    """Whether a user's text praises the reply (the rules above ``_PRAISE_WORD``)."""
    for sentence in _SENTENCE.findall(_NOT_PRAISE.sub(" ", text)):
        if sentence.rstrip().endswith("?"):
            continue
        statement = _CONDITION.sub(" ", sentence).strip()
        if _PRAISE.search(statement) or any(_PRAISE_OPENING.match(c) for c in _CLAUSE_START.split(statement)):
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


def _flag(value: Any) -> bool | None:
    """A JSON boolean, also as a string ("true"/"false", as many tools write them); else None."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    return None


def _code(value: Any) -> int | None:
    """A JSON integer, also written as an integral float (``2.0``) or a string ("1", "500"); else None."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str) and re.fullmatch(r"\s*-?\d{1,9}\s*", value):
        return int(value)
    return None


def _structured_sign(obj: dict) -> int:
    lowered = {str(k).lower(): v for k, v in obj.items()}
    if any(_truthy(lowered.get(k)) for k in _ERROR_KEYS if k in lowered):
        return -1
    if _flag(lowered.get("iserror")) is True or False in (_flag(lowered.get("ok")), _flag(lowered.get("success"))):
        return -1
    for key in ("status", "state"):
        if isinstance(lowered.get(key), str) and lowered[key].strip().lower() in _FAILURE_STATUS:
            return -1
    if any((_code(lowered.get(key.lower())) or 0) != 0 for key in _EXIT_KEYS):
        return -1
    if any((_code(lowered.get(key)) or 0) >= 400 for key in _HTTP_STATUS_KEYS):  # an HTTP 4xx/5xx
        return -1
    return 1


def tool_result_sign(content: Any) -> int:
    """+1 (success) or -1 (failure) of one tool result, by the module's rules 1-3.

    Args:
        content: the tool message's ``content`` (a string, content parts, or None).
    """
    text = message_text(content).strip()
    if text.startswith(("{", "[")):
        try:
            obj = json.loads(text)
        except (ValueError, RecursionError):  # RecursionError: nested too deep for the decoder, not structured
            obj = None
        if isinstance(obj, dict):
            return _structured_sign(obj)
        if isinstance(obj, list) and obj and all(isinstance(o, dict) for o in obj):  # a batch of results
            return min(_structured_sign(o) for o in obj)
    codes = [int(c) for c in _EXIT_TEXT.findall(text)]
    if codes:
        return -1 if codes[-1] != 0 else 1
    return -1 if _failure_output(text) or _OPENING_ERROR.match(text) else 1


# a contraction typed without its apostrophe ("doesnt", "wasnt", "dont"), read as the grammar writes it
_BARE_CONTRACTION = re.compile(
    r"\b(does|did|is|was|are|were|do|has|have|had|could|would|should|ca|wo)nt\b", re.IGNORECASE
)


def _apostrophes(text: str) -> str:
    """``text`` with typographic apostrophes as ``'`` and bare contractions given theirs."""
    return _BARE_CONTRACTION.sub(r"\1n't", text.replace("\u2019", "'").replace("\u02bc", "'"))


def user_text_sign(content: Any) -> int | None:
    """-1 (a complaint), +1 (praise) or None (no signal) of one user message (module docstring)."""
    text = _apostrophes(message_text(content))
    if _complains(text):
        return -1
    return 1 if _praises(_NEGATED_COMPLAINT.sub(" ", text)) else None


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
