"""What agent clients put on the wire besides the conversation, and how clawray reads it.

Owns: the markers each client writes (OpenClaw's internal-context blocks, ``sessionId=`` line,
memory-flush and summariser prompts) and what each means. Must not: act on them (:mod:`clawray.chat`,
:mod:`clawray.serve.protocol`, :mod:`clawray.serve.app` and the session book do) or import Ray or
another clawray module: these are pure functions of messages.

A client such as OpenClaw sends no session header and no turn type: its requests carry them in the
text, by conventions of its own. These rules were read off captured requests of the real OpenClaw
(npm ``openclaw`` 2026.9.6; the corpus is ``tests/data/openclaw/``, the rules are tested on it in
``tests/unit/test_client_rules.py``) and are documented in ``docs/openclaw.md``. Each rule keys on
a marker that only that client writes, so a request without the markers is untouched:

* **Ephemeral context** (:func:`strip_ephemeral`, :func:`is_ephemeral`): every OpenClaw request ends
  with a user message holding a ``<<<BEGIN_OPENCLAW_INTERNAL_CONTEXT>>>`` ... ``<<<END_...>>>`` block
  (active exec sessions, subagents) that the next request's history no longer has. It shaped the
  prompt the policy saw (so it stays in the turn's prompt ids), but it is not conversation: it does
  not count for attribution and is not part of a next state.
* **Session hint** (:func:`session_hint`): the first user message of an OpenClaw session carries a
  ``Runtime: agent=... | sessionId=ID | ...`` line, kept in every later request and re-attached to the
  summary after a compaction.
* **Envelope** (:func:`strip_envelope`): OpenClaw stamps what its user types with a leading
  ``[Thu 2026-12-03 17:07 UTC] `` (a timestamp or channel header in brackets). When a reply starts
  with such a header (a small model echoing the user's message), OpenClaw strips it from the reply's
  copy in the next request's history; attribution compares replies without it.
* **Reply markup** (:func:`reply_as_kept`, :func:`is_silent_reply`): OpenClaw's copy of a reply in
  its transcript drops its reply directives (``[[reply_to_current]]``, ``[[reply_to:ID]]``,
  ``[[audio_as_voice]]``: its system prompt asks for the first) and its reasoning blocks
  (``<thinking>...</thinking>`` and the other names it knows), and tidies the whitespace they leave;
  a reply that is only ``NO_REPLY`` (its "nothing to say" token) is left out of the transcript, and a
  user message saying so follows. Attribution compares replies in that form.
* **Side requests** (:func:`side_kind`): the pre-compaction *memory flush* (its own session id
  ``internal-...`` and a "Pre-compaction memory flush." prompt), the *compaction summaries* (the
  summariser's system prompt, no tools) and the *heartbeat polls* (the heartbeat prompt as the last
  user message, in the main session). They are served but never trained: they are OpenClaw's
  housekeeping, not the agent's work for its user, and they would otherwise pose as new sessions.
"""

from __future__ import annotations

import re
from typing import Any

#: OpenClaw's per-request internal-context block (ephemeral: absent from the next request's history).
INTERNAL_CONTEXT = ("<<<BEGIN_OPENCLAW_INTERNAL_CONTEXT>>>", "<<<END_OPENCLAW_INTERNAL_CONTEXT>>>")
#: ``Runtime: agent=main | session=agent:main:explicit:ID | sessionId=ID | host=...`` (OpenClaw); the
#: ``sessionId=`` is looked for on the rest of the line (see :func:`session_hint`).
_RUNTIME = re.compile(r"\bRuntime: agent=")
_SESSION_ID = re.compile(r"\bsessionId=([^\s|]{1,128})")
#: The system prompt of OpenClaw's compaction summariser (history summary and split-turn prefix).
SUMMARISER_PROMPT = "You are a context summarization assistant"
#: The user prompt of OpenClaw's pre-compaction memory flush, and its session ids.
MEMORY_FLUSH_PROMPT = "Pre-compaction memory flush."
INTERNAL_SESSION_PREFIX = "internal-"

#: The openings of OpenClaw's heartbeat poll prompt (2026.9.6's default, and the older "HEARTBEAT.md"
#: one): a periodic check-in the client sends into the main session, whose "nothing to do" answer it
#: then prunes from the transcript.
HEARTBEAT_PROMPTS = ("Follow the heartbeat monitor scratch context when provided.", "Read HEARTBEAT.md if it exists")

SIDE_KINDS = ("memory_flush", "compaction_summary", "heartbeat")

#: OpenClaw's message envelope (src/shared/chat-envelope.ts, 2026.9.6): a leading ``[header]`` whose
#: header holds a timestamp (``2026-12-03T17:07Z`` or ``2026-12-03 17:07``) or starts with a channel
_ENVELOPE = re.compile(r"\[([^\]]+)\]\s*")
_ENVELOPE_TIME = re.compile(r"\d{4}-\d{2}-\d{2}T\d{2}:\d{2}Z\b|\d{4}-\d{2}-\d{2} \d{2}:\d{2}\b")
_ENVELOPE_CHANNELS = (
    "WebChat", "WhatsApp", "Telegram", "Signal", "Slack", "Discord", "Google Chat", "iMessage", "Teams", "Matrix",
    "Zalo", "Zalo Personal",
)  # fmt: skip


#: OpenClaw's reply directives (src/utils/directive-tags.ts, ``AUDIO_TAG_RE`` and ``REPLY_TAG_RE``; a
#: reply id is at most ``MAX_REPLY_DIRECTIVE_ID_LENGTH`` = 256 characters, which also bounds the match)
_DIRECTIVE = re.compile(
    r"\[\[[ \t]*(?:audio_as_voice|reply_to_current|reply_to[ \t]*:[^\]\n]{1,256})[ \t]*\]\]", re.IGNORECASE
)
#: The reasoning tags whose blocks OpenClaw cuts from a reply (packages/markdown-core,
#: reasoning-tag-parser.ts, ``REASONING_TAG_NAMES``).
REASONING_TAGS = (
    "think", "thinking", "thought", "reasoning", "internal", "antthinking", "antml:think", "antml:thinking",
    "antml:thought", "antml:reasoning", "mm:think", "mm:thinking", "mm:thought", "mm:reasoning",
)  # fmt: skip
_REASONING_OPEN = re.compile(
    r"<(%s)(?:\s[^<>]*)?>" % "|".join(sorted(map(re.escape, REASONING_TAGS), key=len, reverse=True)), re.IGNORECASE
)
_REASONING_CLOSE = {name: re.compile(r"</%s\s*>" % re.escape(name), re.IGNORECASE) for name in REASONING_TAGS}
#: OpenClaw's silent-reply token (src/auto-reply/tokens.ts, ``isSilentReplyText``: the token alone,
#: repeated, or within edge punctuation), matched on the stripped text.
_SILENT = re.compile(r"[^\w\s]*NO_REPLY(?:\s+NO_REPLY)*[^\w\s]*", re.IGNORECASE)


def _cut_reasoning(text: str) -> str:
    """``text`` with every closed reasoning block replaced by a space, in one pass (linear in the text
    for each tag name: a name found unclosed once is never searched for again; a lazy ``.*?`` to the
    closing tag scanned to the end once per opening tag, quadratic on a reply of many unclosed ones)."""
    out, pos, unclosed = [], 0, set()
    for m in _REASONING_OPEN.finditer(text):
        name = m.group(1).lower()
        if m.start() < pos or name in unclosed:  # inside a block already cut, or never closed
            continue
        close = _REASONING_CLOSE[name].search(text, m.end())
        if close is None:
            unclosed.add(name)
            continue
        out += [text[pos : m.start()], " "]
        pos = close.end()
    return "".join([*out, text[pos:]]) if out else text


def reply_as_kept(text: str | None) -> str:
    """A reply's text in the form attribution compares it with the client's copy: reply directives
    and reasoning blocks cut, every run of whitespace one space, the ends trimmed. OpenClaw keeps
    ``"[[reply_to_current]] Glad to help."`` as ``"Glad to help."`` and ``"Sure. <thinking>x</thinking>
    The answer."`` as ``"Sure.  The answer."``; both sides compare equal in this form. (OpenClaw leaves
    directives inside code spans alone; cutting them there too only makes two replies that differ
    by a directive in code compare equal.)"""
    if not text:
        return ""
    if "[[" in text:
        text = _DIRECTIVE.sub(" ", text)
    if "<" in text:
        text = _cut_reasoning(text)
    return " ".join(text.split())


def is_silent_reply(text: str | None) -> bool:
    """A reply that is OpenClaw's "nothing to say" token ``NO_REPLY`` alone (``"NO_REPLY."`` too)."""
    if not text or "NO_REPLY" not in text.upper():
        return False
    return _SILENT.fullmatch(text.strip()) is not None


def strip_ephemeral(text: str | None) -> str | None:
    """``text`` without its client-internal context blocks (an unterminated block is kept) and, when
    one was cut, without the whitespace at its ends (``"Write the file.\n\n<block>"`` is ``"Write the
    file."``, as the client's next request has it)."""
    if not text or INTERNAL_CONTEXT[0] not in text:
        return text
    begin, end = INTERNAL_CONTEXT
    kept, pos = [], 0
    while (start := text.find(begin, pos)) >= 0:  # one pass: linear in the text, whatever it holds
        stop = text.find(end, start + len(begin))
        if stop < 0:  # no end after this begin, so none after a later one either
            break
        kept.append(text[pos:start])
        pos = stop + len(end)
    if pos == 0:
        return text
    kept.append(text[pos:])
    return "".join(kept).strip()


def strip_envelope(text: str | None) -> str | None:
    """``text`` without a leading OpenClaw envelope header (``[Thu 2026-12-03 17:07 UTC] ``); text
    whose leading brackets hold no timestamp or channel header is returned as it is."""
    match = _ENVELOPE.match(text) if text else None
    if match is None:
        return text
    header = match.group(1)
    if _ENVELOPE_TIME.search(header) or any(header.startswith(f"{c} ") for c in _ENVELOPE_CHANNELS):
        return text[match.end() :]
    return text


def is_ephemeral(message: dict[str, Any]) -> bool:
    """A user message that holds nothing but internal context blocks (and whitespace)."""
    text = message.get("content")
    if message.get("role") != "user" or not text or INTERNAL_CONTEXT[0] not in text:
        return False
    return not strip_ephemeral(text).strip()


def conversation_view(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``messages`` as conversation: ephemeral messages dropped, internal blocks cut from user text.
    What a judge is shown as a next state."""
    out = []
    for m in messages:
        if is_ephemeral(m):
            continue
        if m.get("role") == "user" and m.get("content") and INTERNAL_CONTEXT[0] in m["content"]:
            m = {**m, "content": strip_ephemeral(m["content"])}
        out.append(m)
    return out


def is_heartbeat_poll(message: dict[str, Any]) -> bool:
    """A user message that is OpenClaw's heartbeat poll (one of :data:`HEARTBEAT_PROMPTS`, after an
    envelope header)."""
    if message.get("role") != "user" or not isinstance(message.get("content"), str):
        return False
    return (strip_envelope(message["content"].lstrip()) or "").lstrip().startswith(HEARTBEAT_PROMPTS)


def before_heartbeat(next_state: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A turn's next state up to the first heartbeat poll in it: a poll whose exchange OpenClaw kept
    (the heartbeat had something to report) is the client's housekeeping, and what follows it (the
    heartbeat's reply, the user's reaction to that reply) is no verdict on the turn before it."""
    cut = next((i for i, m in enumerate(next_state) if is_heartbeat_poll(m)), None)
    return next_state if cut is None else next_state[:cut]


def session_hint(messages: list[dict[str, Any]]) -> str | None:
    """The client's own session id written in the conversation (OpenClaw's ``Runtime: ...
    sessionId=ID`` line in the first user message), or None. Linear in the message's length: each
    line is read once, from its first ``Runtime: agent=``."""
    first = next((m for m in messages if m.get("role") == "user"), None)
    if first is None or not first.get("content"):
        return None
    text, pos = first["content"], 0
    while (runtime := _RUNTIME.search(text, pos)) is not None:
        line_end = text.find("\n", runtime.end())
        line_end = len(text) if line_end < 0 else line_end
        found = _SESSION_ID.search(text, runtime.end(), line_end)
        if found is not None:
            return found.group(1)
        pos = line_end + 1  # a later "Runtime: agent=" on this line sees no more of it
    return None


def side_kind(messages: list[dict[str, Any]], tools: list | None) -> str | None:
    """The kind of client housekeeping a request is (one of :data:`SIDE_KINDS`), or None for a
    main-line request.

    * ``compaction_summary``: no tools and a system prompt that starts with :data:`SUMMARISER_PROMPT`;
    * ``memory_flush``: the last user message starts with :data:`MEMORY_FLUSH_PROMPT`, or the session
      hint names one of OpenClaw's internal sessions (``internal-...``);
    * ``heartbeat``: the last user message starts (after an envelope header) with one of
      :data:`HEARTBEAT_PROMPTS`. A heartbeat configured with a prompt of its own is not recognised
      (it is served as a main-line turn unless the client says ``X-Turn-Type: side``).
    """
    first = messages[0]
    if not tools and first["role"] == "system" and (first.get("content") or "").lstrip().startswith(SUMMARISER_PROMPT):
        return "compaction_summary"
    last_user = next((m for m in reversed(messages) if m["role"] == "user" and not is_ephemeral(m)), None)
    last_text = (last_user.get("content") or "").lstrip() if last_user is not None else ""
    if last_text.startswith(MEMORY_FLUSH_PROMPT):
        return "memory_flush"
    if last_user is not None and is_heartbeat_poll(last_user):
        return "heartbeat"
    hint = session_hint(messages)
    if hint is not None and hint.startswith(INTERNAL_SESSION_PREFIX):
        return "memory_flush"
    return None
