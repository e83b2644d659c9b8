"""The session book: open sessions, their pending turns, the pairing of a turn with its next state,
and the at-least-one choice.

Owns: the open sessions, the index of their pending turns, the pairing and lookup rules below and the
at-least-one pick (:meth:`Session.promote_best`). Must not: import Ray or asyncio, judge, journal or
emit a sample: the :class:`~clawray.actors.session.SessionTracker` actor owns one book and adds those.

Pairing. A request's turns (its n choices) stay *pending* in their session until the session's next
main-line request. That request continues the pending turn whose history + reply is a prefix of its own
history, compared as conversation (what counts is :func:`clawray.chat.attribution_key`'s); the messages
after that reply, as conversation (:func:`clawray.client_rules.conversation_view`), are the turn's next
state. When the client rewrote the history before the reply (a compaction replaced older turns by a
summary), the pending turn whose reply is the history's last assistant message is continued
(``rewritten``). A reply that says nothing (no content, no tool call) is left out of the next history
by OpenClaw's client: such a turn is continued by a history that holds its own history and then a next
state. A history that continues none of them is a branch; the other choices of a continued request are
``unchosen``.

Lookup. A request without a session id is placed in the open session one of whose pending turns its
history continues (the longest such prefix wins), through an index from attribution key to session
id; only pending turns are indexed, so the index holds one key per open choice. A pending turn is
offered for splicing only when the history matches it exactly (:func:`clawray.chat.conversation_key`):
the prompt ids of a turn whose ephemeral context is gone are not the prefix of the next prompt.
"""

from __future__ import annotations

import hashlib
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from clawray.algos.credit_ledger import SessionCredit
from clawray.algos.rejection import opening
from clawray.chat import attribution_canonical, attribution_key, attribution_keys, conversation_key
from clawray.chat import render_key as chat_render_key
from clawray.client_rules import before_heartbeat, conversation_view, is_silent_reply
from clawray.types import Turn


#: Ids of the sessions the server starts for clients that send none. Only these are ever targets of
#: session inference when session binding is on: a session with a client's own id may be bound to
#: that client, and inference would let anyone who knows its history into it.
AUTO_SESSION_PREFIX = "auto-"


def user_session_prefix(user: str | None) -> str:
    """The ids of the sessions the server starts for end user ``user`` (the OpenAI ``user`` field)
    start with this: ``auto-user:<len(user)>:<user>/``, one session per conversation of that user (the
    length keeps it unambiguous: user ``org``'s prefix is no prefix of user ``org/alice``'s); with no
    user, :data:`AUTO_SESSION_PREFIX`."""
    return AUTO_SESSION_PREFIX if user is None else f"{AUTO_SESSION_PREFIX}user:{len(user)}:{user}/"


MAX_CLOSED_REMEMBERED = 100_000  # closed session ids whose last turn index is kept (about 100 bytes each)
#: seconds a request inferred into a session claims it (its lookup to its record): another request of a
#: conversation that opens alike takes another session of the key meanwhile. A claim only breaks ties
#: between such sessions, so one left by a request that failed costs nothing but its tie-break.
CLAIM_S = 600.0


@dataclass
class Session:
    """One session's state.

    ``held`` holds ``(turn or sample, mean vote)`` of the 0-scored (or zero-return) turns kept for the
    at-least-one rule; ``tasks`` are the session's judge tasks (asyncio tasks, owned by the tracker).
    """

    turns: int = 0  # the last turn index given in this session (indexes are 1-based)
    pending: list = field(default_factory=list)  # the latest request's turns (n choices), awaiting a next state
    keys: list = field(default_factory=list)  # attribution_key(history + reply) of each pending turn
    exact: list = field(default_factory=list)  # conversation_key(history + reply) of each pending turn (splicing)
    # attribution_key(history) of each pending turn whose reply says nothing: a client leaves such a
    # reply out of its next history, which then continues the turn's history alone
    quiet: list = field(default_factory=list)
    replies: list = field(default_factory=list)  # reply_key of each pending turn's reply (a rewritten history)
    asked: list = field(default_factory=list)  # asked_key of each pending turn (a request asked again)
    effective: bool = False  # a turn of this session has been trained
    held: list = field(default_factory=list)  # (turn or sample, mean vote), for at-least-one
    tasks: list = field(default_factory=list)  # this session's judge tasks
    last_seen: float = field(default_factory=time.monotonic)  # time.monotonic() of its last request
    sid: str = ""  # the session id (for the journal)
    credit: SessionCredit = field(default_factory=SessionCredit)  # waiting turns, outcome (trainer.credit)
    requests: int = 0  # main-line requests recorded in this session (n choices count once)
    # time.monotonic() until which a request inferred into this session is in flight (find, until add):
    # a conversation that opens alike and asks meanwhile takes another session of its key
    claimed_until: float = 0.0
    opening: str = ""  # conversation_key of the session's opening (trainer.group_by session_prefix)

    def promote_best(self) -> tuple[Any, float] | None:
        """The at-least-one rule's pick: take the held item with the largest ``|mean vote|`` (the first
        of equals) out of ``held``; None when nothing is held.

        Example: held mean votes ``[0.0, -1/3, 1/3]`` -> the second item (``-1/3``).
        """
        if not self.held:
            return None
        best = max(range(len(self.held)), key=lambda i: abs(self.held[i][1]))
        return self.held.pop(best)


def says_nothing(reply: dict[str, Any]) -> bool:
    """Whether a reply holds no content (whitespace aside) and no tool call: an immediate end of turn,
    or reasoning alone; or is OpenClaw's ``NO_REPLY`` token alone. OpenClaw's client (pi-ai) leaves
    such an assistant message out of the next request's history, so the turn continues where its own
    history ends (after ``NO_REPLY``, with a user message saying the attempt produced no answer)."""
    if reply.get("tool_calls"):
        return False
    content = reply.get("content") or ""
    return not content.strip() or is_silent_reply(content)


def reply_key(reply: dict[str, Any]) -> str:
    """A digest of one reply as attribution compares it (:func:`clawray.chat.attribution_canonical`)."""
    return hashlib.sha256(attribution_canonical(reply)).hexdigest()


def asked_key(turn: Turn) -> str | None:
    """``attribution_key`` of ``turn``'s history up to its last assistant message (None without one):
    the key a request has there when it asks the turn's request again (a regenerate, an edited last
    user message), whose history holds no reply of the turn."""
    last = max((k for k, m in enumerate(turn.messages) if m["role"] == "assistant"), default=None)
    return None if last is None else attribution_key(turn.messages[: last + 1])


def quiet_keys(pending: list[Turn]) -> list[str]:
    """``attribution_key(history)`` of each turn of ``pending`` whose reply :func:`says_nothing`: the
    key its next request's history has at the turn's last message, the reply being left out."""
    return [attribution_key(t.messages) for t in pending if says_nothing(t.response_message)]


def quiet_positions(messages: list[dict[str, Any]]) -> list[int]:
    """The positions ``k`` of ``messages`` after which a reply that said nothing may have been left out
    (a user or tool message followed by a user message): the keys a request sends for them find a
    pending turn by :func:`quiet_keys`."""
    return [
        k
        for k in range(len(messages) - 1)
        if messages[k]["role"] in ("user", "tool") and messages[k + 1]["role"] == "user"
    ]


@dataclass
class Pairing:
    """What a request's history makes of its session's pending turns (:meth:`SessionBook.pair`).

    ``chosen`` is the pending turn the history continues (None: a branch, every pending turn is
    dropped), ``next_state`` the messages after its reply (as conversation), ``others`` how many
    pending turns it did not continue, ``rewritten`` whether the history before the reply was
    rewritten (found by the reply alone: a compaction).
    """

    chosen: Turn | None
    next_state: list[dict[str, Any]]
    others: int
    rewritten: bool = False


class SessionBook:
    """Open sessions by id, the index of their pending turns, and the last turn index of recently
    closed ids (so an id used again never repeats an index).

    Args:
        max_closed: closed session ids remembered (oldest forgotten first).
    """

    def __init__(self, max_closed: int = MAX_CLOSED_REMEMBERED):
        self.sessions: dict[str, Session] = {}
        # attribution key of a pending turn's history + reply -> the ids of the sessions holding one, oldest
        # first: two conversations may open alike ("Hi" -> "Hello!") and each must go on in its own session
        self.index: dict[str, list[str]] = {}
        self.closed_turns: OrderedDict[str, int] = OrderedDict()
        # attribution key of an idle-closed session's pending turn -> its id (an inferred session goes on)
        self.closed_index: OrderedDict[str, str] = OrderedDict()
        # reply_key of a pending turn's reply -> the ids of the sessions holding it: a history the client
        # rewrote (a compaction's summary in place of the turns before the reply) still ends with it
        self.reply_index: dict[str, list[str]] = {}
        # asked_key of a pending turn (its history up to its last assistant message) -> the ids of the
        # sessions holding it: a request that asks that turn again (regenerate, an edited last message)
        self.asked_index: dict[str, list[str]] = {}
        self.max_closed = max_closed

    def __len__(self) -> int:
        return len(self.sessions)

    def get(self, sid: str | None) -> Session | None:
        """The open session ``sid``, or None."""
        return self.sessions.get(sid) if sid is not None else None

    def open(self, sid: str, messages: list[dict[str, Any]]) -> Session:
        """The open session ``sid`` (created when new, its turn indexes continuing a closed one's),
        marked seen now; ``messages`` (the request's history) sets a new session's opening."""
        s = self.sessions.get(sid)
        if s is None:
            s = self.sessions[sid] = Session(turns=self.closed_turns.pop(sid, 0), sid=sid)
            if s.turns:  # reopened: its idle-closed keys are history now
                for key in [k for k, v in self.closed_index.items() if v == sid]:
                    del self.closed_index[key]
        s.last_seen = time.monotonic()
        s.requests += 1
        if not s.opening:
            s.opening = conversation_key(opening(messages))
        return s

    def find(
        self,
        session_id: str | None,
        keys: dict[int, str],
        render_key: str | None = None,
        auto_only: bool = False,
        exact: dict[int, str] | None = None,
        hint: str | None = None,
        user: str | None = None,
        last_reply: str | None = None,
    ) -> dict:
        """Which session and pending turn a new request continues (the server's lookup).

        Args:
            session_id: the request's session id, or None: then the session ``AUTO_SESSION_PREFIX +
                hint`` when the client wrote its own id in the conversation (``hint``,
                :func:`clawray.client_rules.session_hint`), else the one inferred from ``keys`` (with
                ``auto_only``, only among the sessions the server started, :data:`AUTO_SESSION_PREFIX`).
            keys: ``{k: attribution_key(messages[:k + 1])}`` for each assistant message ``k`` of the
                request's history, and for each of its :func:`quiet_positions` (they find a pending
                turn whose reply said nothing, which the client left out).
            render_key: :func:`clawray.chat.render_key` of the request (its tools). A pending turn
                rendered with another render key is still found (its session and next-state pairing
                do not depend on it) but not offered for splicing.
            exact: ``{k: conversation_key(messages[:k + 1])}`` for the same ``k``; a pending turn is
                offered for splicing only when its exact key is there at its own position (None: never).
            user: the request's end user (the OpenAI ``user`` field): the session is inferred among that
                user's sessions only (:func:`user_session_prefix`).
            last_reply: :func:`reply_key` of the history's last assistant message: when no prefix
                matches (a history its client rewrote, e.g. OpenClaw's compaction without its Runtime
                line), the one session whose pending reply it is (:meth:`pair` then takes it as
                rewritten). Before it, a request that asks a pending turn's request again (a
                regenerate, an edited last message: its history holds the turn's history up to the
                turn's last assistant message, :func:`asked_key`) goes to that turn's session, and
                when that session is not one it may join, to none: never to another by its reply.

        Returns:
            ``{"session_id", "prev", "context_changed", "how"}``: the session (None when none matches)
            and how it was found (``"given"``, ``"hint"``, ``"inferred"``, None); the
            pending turn the request extends as ``{"prompt_ids", "response_ids", "ended",
            "n_messages"}`` (``ended``: the reply was not cut by max_tokens), or None when it extends
            none exactly (first turn, branch, a dropped ephemeral block) or when the render key
            differs (then ``context_changed``).
        """
        how = "given"
        if session_id is None and hint is not None:  # the server's namespace: never bound to a client
            session_id, how = f"{AUTO_SESSION_PREFIX}{hint}", "hint"
        elif session_id is None:
            only = user_session_prefix(user) if auto_only or user is not None else ""
            session_id = (
                self._infer(keys, self.index, only)
                or self._infer(keys, self.closed_index, only)
                or self._infer(keys, self.asked_index, only)
                or (None if self._asked_elsewhere(keys) else self._by_reply(last_reply, only))
            )
            how = "inferred" if session_id is not None else None
        s = self.get(session_id)
        if s is not None and how == "inferred":
            s.claimed_until = time.monotonic() + CLAIM_S
        if s is not None:  # a request in flight keeps its session open (idle counts from requests)
            s.last_seen = time.monotonic()
        for t, key in zip(s.pending, s.exact) if s and exact else ():
            if exact.get(len(t.messages)) != key:
                continue
            if render_key is not None and render_key != chat_render_key(t.tools):
                return {"session_id": session_id, "prev": None, "context_changed": True, "how": how}
            prev = {
                "prompt_ids": t.prompt_ids,
                "response_ids": t.response_ids,
                "ended": not t.truncated,
                "n_messages": len(t.messages),
            }
            return {"session_id": session_id, "prev": prev, "context_changed": False, "how": how}
        return {"session_id": session_id, "prev": None, "context_changed": False, "how": how}

    def _infer(self, keys: dict[int, str], index: dict[str, Any], prefix: str = "") -> str | None:
        """The session of the latest assistant message of ``keys`` found in ``index`` among the ids
        that start with ``prefix``, or None. When several sessions hold it (:attr:`index`;
        ``closed_index`` holds one id a key), the oldest one without a request in flight
        (``claimed_until``), else the oldest."""
        now = time.monotonic()
        for k in sorted(keys, reverse=True):
            found = index.get(keys[k], ())
            sids = [sid for sid in ([found] if isinstance(found, str) else found) if sid.startswith(prefix)]
            if sids:
                free = [sid for sid in sids if (s := self.sessions.get(sid)) is None or s.claimed_until <= now]
                return (free or sids)[0]
        return None

    def pair(self, s: Session, messages: list[dict[str, Any]]) -> Pairing:
        """Pair ``s``'s pending turns with the history ``messages`` of its next request; they leave the
        index (the caller replaces them with :meth:`add`).

        A pending turn is continued when ``messages`` holds its history + reply as a prefix (by
        attribution key) followed by a non-empty next state; failing that (a rewritten history), when
        its reply is the last assistant message of ``messages`` and a next state follows it; failing
        that, when its reply :func:`says_nothing` and ``messages`` holds its history followed by a next
        state that does not start with a reply. The rewritten-history match skips an assistant message
        the turn's own history holds (a client's resend, an edited last message: an earlier reply
        equal to the pending one is not it). A next state ends before a heartbeat poll
        (:func:`~clawray.client_rules.before_heartbeat`).
        """
        self.unindex(s)
        prefix_keys = attribution_keys(messages)
        assistant = [k for k, m in enumerate(messages) if m["role"] == "assistant"]
        at = {prefix_keys[k]: k for k in assistant}
        for turn, key in zip(s.pending, s.keys):
            k = at.get(key)
            if k is not None and (next_state := before_heartbeat(conversation_view(messages[k + 1 :]))):
                return Pairing(turn, next_state, len(s.pending) - 1)
        if assistant and (next_state := before_heartbeat(conversation_view(messages[assistant[-1] + 1 :]))):
            last = attribution_canonical(messages[assistant[-1]])
            for turn in s.pending:
                if attribution_canonical(turn.response_message) != last:
                    continue
                if prefix_keys[assistant[-1]] in set(attribution_keys(turn.messages)):
                    continue  # a reply of the turn's own history (resent or edited request), not its reply
                return Pairing(turn, next_state, len(s.pending) - 1, rewritten=True)
        for turn in s.pending:  # a reply that says nothing, which a client leaves out of its history
            if not says_nothing(turn.response_message):
                continue
            own = attribution_key(turn.messages)
            k = max((k for k, key in enumerate(prefix_keys) if key == own), default=None)
            next_state = before_heartbeat(conversation_view(messages[k + 1 :])) if k is not None else []
            if next_state and next_state[0]["role"] != "assistant":
                return Pairing(turn, next_state, len(s.pending) - 1)
        return Pairing(None, [], len(s.pending))

    def add(self, s: Session, turns: list[Turn]) -> None:
        """Make ``turns`` (one request's choices) ``s``'s pending turns, giving each the next turn index
        (the request that claimed ``s`` has ended)."""
        s.pending, s.keys, s.exact, s.quiet, s.claimed_until = [], [], [], [], 0.0
        for turn in turns:
            s.turns += 1
            turn.turn_index = s.turns
            key = attribution_key([*turn.messages, turn.response_message])
            s.pending.append(turn)
            s.keys.append(key)
            s.exact.append(conversation_key([*turn.messages, turn.response_message]))
        self._index_pending(s)

    def close(self, sid: str, idle: bool = False) -> Session | None:
        """Remove the open session ``sid`` (None when there is none), remembering its last turn index;
        ``idle`` (closed for silence, not by its client) also remembers its pending turns' keys, so a
        request that continues them later (a user back after ``idle_timeout_s``) is inferred into the
        same id, its numbering going on, instead of matching nothing (unattributable: the rest of a
        conversation without a session id was never recorded)."""
        s = self.sessions.pop(sid, None)
        if s is None:
            return None
        self.closed_turns[sid] = s.turns
        while len(self.closed_turns) > self.max_closed:
            self.closed_turns.popitem(last=False)
        if idle:
            for key in [*s.keys, *s.quiet]:
                self.closed_index[key] = sid
            while len(self.closed_index) > self.max_closed:
                self.closed_index.popitem(last=False)
        self.unindex(s)
        return s

    def idle(self, timeout_s: float, now: float | None = None) -> list[str]:
        """Ids of the open sessions without a request for more than ``timeout_s`` seconds."""
        now = time.monotonic() if now is None else now
        return [sid for sid, s in self.sessions.items() if now - s.last_seen > timeout_s]

    def restore(self, s: Session) -> None:
        """Put a session rebuilt from the journal back as open, with its pending turns indexed."""
        s.keys = [attribution_key([*t.messages, t.response_message]) for t in s.pending]
        s.exact = [conversation_key([*t.messages, t.response_message]) for t in s.pending]
        self.sessions[s.sid] = s
        self._index_pending(s)

    def unindex(self, s: Session) -> None:
        """Drop ``s``'s pending turns from the indexes (another session's equal turns stay)."""
        for index, keys in self._indexes(s):
            for key in keys:
                sids = index.get(key)
                if sids is not None and s.sid in sids:
                    sids.remove(s.sid)
                    if not sids:
                        del index[key]

    def _indexes(self, s: Session) -> tuple[tuple[dict[str, list[str]], list[str]], ...]:
        """Each index with ``s``'s keys in it: history + reply and quiet keys (:attr:`index`), replies
        (:attr:`reply_index`), what was asked (:attr:`asked_index`)."""
        return ((self.index, [*s.keys, *s.quiet]), (self.reply_index, s.replies), (self.asked_index, s.asked))

    def _index_pending(self, s: Session) -> None:
        """Index ``s``'s pending turns (their ``keys`` are set) in every index, deriving the quiet,
        reply and asked keys from them."""
        s.quiet = list(dict.fromkeys(quiet_keys(s.pending)))
        s.replies = list(
            dict.fromkeys(reply_key(t.response_message) for t in s.pending if not says_nothing(t.response_message))
        )
        s.asked = list(dict.fromkeys(k for k in map(asked_key, s.pending) if k is not None))
        for index, keys in self._indexes(s):
            for key in keys:
                sids = index.setdefault(key, [])
                if s.sid not in sids:  # n choices with equal replies: one entry
                    sids.append(s.sid)

    def _asked_elsewhere(self, keys: dict[int, str]) -> bool:
        """Whether a pending turn of any session (another user's too) asked from a prefix of the
        request's history: the request is that conversation's, never another's by its last reply."""
        return any(key in self.asked_index for key in keys.values())

    def _by_reply(self, last_reply: str | None, prefix: str) -> str | None:
        """The one session among the ids that start with ``prefix`` whose pending reply is ``last_reply``
        (the last assistant message of a history that matches no prefix: rewritten by its client);
        None when none or several hold it (a reply such as "OK." names no conversation)."""
        sids = [sid for sid in self.reply_index.get(last_reply, ()) if sid.startswith(prefix)] if last_reply else []
        return sids[0] if len(sids) == 1 else None
