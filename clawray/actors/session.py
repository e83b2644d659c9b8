"""SessionTracker: pairs each main-line turn with its next state, has it judged, and emits samples.

The next state of turn t is every message after turn t's response in the session's next main-line
request (a user reply, or several tool results kept together). When that request's history does not
contain turn t's response at the expected place, the turn is counted as a ``branch`` and not trained
(instead of being paired with the wrong next state).

Binary RL (arXiv 2603.10165 §3, with clawray's fixes):
  * score +1/-1 -> a sample with that reward on every response token;
  * score 0 -> dropped (``zero_score``), except the at-least-one rule: when a session closes
    without any trained turn, its *best-signed* 0-scored turn (largest |mean of valid votes|, e.g.
    votes [0, 0, 1] -> 1/3) is promoted with that mean as its reward, so a leaning vote still gives
    a gradient (OpenClaw-RL promotes the first one with reward 0, a gradient no-op). A promoted turn
    whose votes average 0 trains with reward 0, which the driver's degenerate-batch baseline turns
    into a real advantage;
  * every vote invalid -> ``unscored``, dropped (unlike a neutral 0);
  * the last turn of a closed session has no next state -> ``no_next_state``, dropped. A session is
    closed by ``X-Session-Done`` or after ``idle_timeout_s`` without a request (its memory is freed);
  * a reply cut by ``max_tokens`` (``truncated``) is not judged when ``truncated="mask"``
    (``dropped/truncated``); with ``"keep"`` it is judged and trained like any other;
  * a request with ``n`` choices records n turns with the same prompt; the next request continues
    one of them (the one whose reply its history holds), the others are ``dropped/unchosen``.

What a judged turn becomes (a sample, a held 0-score turn, a drop reason) is decided by the run's
:class:`~clawray.algos.algorithm.Algorithm` (Binary RL above, OPD, Combine); the tracker keeps the
sessions, the pairing, the at-least-one rule, the records and the emission into the queue.

The tracker also answers the server's :meth:`SessionTracker.lookup`: which open session a history
continues (for clients that send no session id) and which pending turn it extends (for splicing).
Pairing a turn with its next state keys on the messages alone; splicing also needs the same render
key (tools): a request that changes its tools still gives the previous turn its next state, but its
prompt is rendered afresh.
Every served main-line turn is appended to ``records/turns.jsonl`` and every judged one to
``records/judgments.jsonl`` (see :class:`clawray.records.JsonlRecords`).

Durability (``journal``, see :mod:`clawray.journal`): with a journal path, the session state (turn
indexes, pending turns, judgements started and finished, held turns, closes) is appended to
``journal/sessions.jsonl`` before the call that changed it returns; a new tracker (a resume, or Ray
restarting this actor) rebuilds its sessions from it and restarts the unfinished judgements (their
samples are deduplicated by the queue's journal).
"""

from __future__ import annotations

import asyncio
import os
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from typing import Any

import ray

from clawray.algos.algorithm import Scorers, make_algorithm
from clawray.chat import conversation_key, conversation_keys
from clawray.chat import render_key as chat_render_key
from clawray.records import JsonlRecords
from clawray.types import Sample, SampleMeta, Turn


MAX_CLOSED_REMEMBERED = 100_000  # closed session ids whose last turn index is kept (about 100 bytes each)


@dataclass
class _Session:
    turns: int = 0
    pending: list = field(default_factory=list)  # the latest request's turns (n choices), awaiting a next state
    keys: list = field(default_factory=list)  # conversation_key(history + reply) of each pending turn
    effective: bool = False  # a turn of this session has been trained
    held: list = field(default_factory=list)  # (turn, mean vote) of 0-scored turns, for at-least-one
    tasks: list = field(default_factory=list)  # this session's judge tasks
    last_seen: float = field(default_factory=time.monotonic)
    sid: str = ""  # the session id (for the journal)


class SessionTracker:
    """Owns all session state (one actor, so turn indexes are unique per session).

    Args:
        judges: JudgeWorker actor handles (used round-robin).
        queue: TrajectoryQueue actor handle.
        at_least_one: apply the at-least-one rule.
        records_dir: when set, served turns go to ``records_dir/turns.jsonl`` and judge results to
            ``records_dir/judgments.jsonl`` (rotated at ``records_max_bytes``, ``records_keep`` kept).
        algo: ``"rl"``, ``"opd"`` or ``"combine"``; teachers and ``opd`` serve the last two.
        idle_timeout_s: close sessions idle this long (seconds); 0 = never.
        truncated: ``"keep"`` (truncated turns train like others) or ``"mask"`` (not trained, counted).
        journal: ``{"path", "fsync", "compact_bytes"}`` of the session journal, or None (not durable).
    """

    def __init__(self, judges: list, queue: Any, at_least_one: bool = True, records_dir: str | None = None,
                 algo: str = "rl", teachers: list | None = None, opd: dict | None = None,
                 idle_timeout_s: float = 0.0, truncated: str = "keep", records_max_bytes: int = 64 << 20,
                 records_keep: int = 5, journal: dict | None = None):
        self.judges, self.queue = judges, queue
        self.algorithm, self.teachers = make_algorithm(algo, opd), teachers or []
        if self.algorithm.needs_teacher and not self.teachers:
            raise ValueError(f"algo {algo!r} needs at least one TeacherWorker")
        self.at_least_one = at_least_one
        self.sessions: dict[str, _Session] = {}
        self.index: dict[str, str] = {}  # conversation_key of a pending turn's history + reply -> session id
        # last turn index of recently closed sessions, so a reused id never repeats an index
        self.closed_turns: OrderedDict[str, int] = OrderedDict()
        self.truncated = truncated
        self.counts: Counter[str] = Counter()
        self.tasks: set[asyncio.Task] = set()
        self._rr = 0
        self.idle_timeout_s = idle_timeout_s
        self._sweeper: asyncio.Task | None = None
        self.served_records = self.judged_records = None
        if records_dir:
            self.served_records = JsonlRecords(os.path.join(records_dir, "turns.jsonl"), records_max_bytes, records_keep)
            self.judged_records = JsonlRecords(os.path.join(records_dir, "judgments.jsonl"), records_max_bytes,
                                               records_keep)
        self.journal, self._replay = None, []  # [journal hook] clawray.journal.SessionJournal
        if journal:
            from clawray.journal import SessionJournal, restore_tracker

            self.journal = SessionJournal(max_closed=MAX_CLOSED_REMEMBERED, **journal)
            self._replay = restore_tracker(self, _Session)

    def _journal(self, op: str, **fields: Any) -> None:
        """[journal hook] Append one session-state change (no-op without a journal)."""
        if self.journal is not None:
            self.journal.log(op, **fields)

    def _start_replay(self) -> None:
        """[journal hook] Restart the judgements a previous tracker left unfinished (once, lazily: the
        actor's event loop runs only inside its methods)."""
        while self._replay:
            self._replay.pop(0)()

    async def lookup(self, session_id: str | None, keys: dict[int, str], render_key: str | None = None) -> dict:
        """Which session and pending turn a new request continues.

        Args:
            session_id: the request's session id, or None (then it is inferred from ``keys``).
            keys: ``{k: conversation_key(messages[:k + 1])}`` for each assistant message ``k`` of the
                request's history.
            render_key: :func:`clawray.chat.render_key` of the request (what besides the messages
                shapes its prompt: the tools). A pending turn rendered with another render key is
                still found (its session and next-state pairing do not depend on it), but is not
                offered for splicing.

        Returns:
            ``{"session_id", "prev", "context_changed"}``: the session (None when none matches); the
            pending turn whose history + reply the request extends, as ``{"prompt_ids",
            "response_ids", "ended", "n_messages"}`` (``ended``: the reply's last id is an end-of-turn
            id), or None when it extends none (first turn, branch) or when the render key differs
            (then ``context_changed`` is True).
        """
        self._start_replay()
        if session_id is None:
            session_id = next((self.index[keys[k]] for k in sorted(keys, reverse=True) if keys[k] in self.index), None)
        s = self.sessions.get(session_id) if session_id is not None else None
        prev, changed = None, False
        for t, key in zip(s.pending, s.keys) if s else ():
            if keys.get(len(t.messages)) == key:
                if render_key is not None and render_key != chat_render_key(t.tools):
                    changed = True
                    break
                prev = {"prompt_ids": t.prompt_ids, "response_ids": t.response_ids, "ended": not t.truncated,
                        "n_messages": len(t.messages)}
                break
        return {"session_id": session_id, "prev": prev, "context_changed": changed}

    async def record_turn(self, turn: Turn, done: bool = False) -> int:
        """Record one served main-line turn (see :meth:`record_turns`); returns its 1-based index."""
        return (await self.record_turns([turn], done))[0]

    async def record_turns(self, turns: list[Turn], done: bool = False) -> list[int]:
        """Record the served main-line turns of one request (its n choices, same session and prompt).

        The session's previous turns are resolved with this request's history: the one it continues
        gets its next state and is judged; the others are counted (``unchosen``, or ``branch`` when
        the history continues none of them).

        Args:
            turns: the new turns (their ``turn_index`` is assigned here, unique in the session).
            done: the client closed the session with this request.

        Returns:
            the turns' indexes.
        """
        if self.idle_timeout_s > 0 and self._sweeper is None:
            self._sweeper = asyncio.ensure_future(self._sweep_idle())
        self._start_replay()
        sid = turns[0].session_id
        s = self.sessions.get(sid)
        if s is None:  # a new session, or a closed id used again: its turn indexes continue
            s = self.sessions[sid] = _Session(turns=self.closed_turns.pop(sid, 0), sid=sid)
        s.last_seen = time.monotonic()
        if s.pending:
            self._resolve(s, turns[0].messages)
        s.pending, s.keys = [], []
        for turn in turns:
            s.turns += 1
            turn.turn_index = s.turns
            self.counts["turns"] += 1
            self.counts["turns_truncated"] += int(turn.truncated)
            self.counts["turns_tool_parse_error"] += int(turn.tool_parse_error)
            key = conversation_key([*turn.messages, turn.response_message])
            s.pending.append(turn)
            s.keys.append(key)
            self.index[key] = sid
            if self.served_records is not None:
                self.served_records.append(turn.record())
        if self.journal is not None:  # [journal hook] the indexes are durable before they are answered
            from clawray.journal import turn_to_dict

            self._journal("turns", sid=sid, turns=[turn_to_dict(t) for t in turns])
        if done:
            await self.close_session(sid)
        return [t.turn_index for t in turns]

    async def close_session(self, session_id: str) -> None:
        """Close a session; its last turn has no next state and is not trained (counted). Once its
        judge tasks finish, the at-least-one rule runs (in the background: the caller does not wait)."""
        s = self.sessions.pop(session_id, None)
        if s is None:
            return
        self.closed_turns[session_id] = s.turns
        if len(self.closed_turns) > MAX_CLOSED_REMEMBERED:
            self.closed_turns.popitem(last=False)
        self.counts["sessions_closed"] += 1
        self.counts["dropped/no_next_state"] += len(s.pending)
        self._unindex(s)
        self._journal("close", sid=session_id)  # [journal hook]
        self._track(asyncio.ensure_future(self._finalize(s)))

    async def close_idle(self, now: float | None = None) -> int:
        """Close every session idle for longer than ``idle_timeout_s``; returns how many."""
        now = time.monotonic() if now is None else now
        idle = [sid for sid, s in self.sessions.items() if now - s.last_seen > self.idle_timeout_s]
        for sid in idle:
            await self.close_session(sid)
        self.counts["sessions_idle_closed"] += len(idle)
        return len(idle)

    async def _sweep_idle(self) -> None:
        while True:
            await asyncio.sleep(min(max(self.idle_timeout_s / 4, 0.05), 30.0))
            await self.close_idle()

    async def _finalize(self, s: _Session) -> None:
        if s.tasks:
            await asyncio.gather(*s.tasks, return_exceptions=True)
        if not s.held:
            return
        if self.at_least_one and not s.effective:
            best = max(range(len(s.held)), key=lambda i: abs(s.held[i][1]))  # first of equals
            turn, mean_vote = s.held.pop(best)
            self.counts["at_least_one_promoted"] += 1
            await self._emit(s, self.algorithm.promote(turn, mean_vote))
        self.counts["dropped/zero_score"] += len(s.held)
        s.held.clear()
        self._journal("finalized", sid=s.sid)  # [journal hook]

    def _track(self, task: asyncio.Task) -> asyncio.Task:
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task

    def _unindex(self, s: _Session) -> None:
        for key in s.keys:
            self.index.pop(key, None)

    def _resolve(self, s: _Session, messages: list[dict[str, Any]]) -> None:
        """Pair the pending turn that ``messages`` continues with its next state; count the rest."""
        self._unindex(s)
        chosen = None
        prefix_keys = conversation_keys(messages)
        for turn, key in zip(s.pending, s.keys):
            n = len(turn.messages)
            if len(messages) > n + 1 and prefix_keys[n] == key:
                chosen = turn
                break
        if chosen is None:
            self.counts["dropped/branch"] += len(s.pending)
            return
        self.counts["dropped/unchosen"] += len(s.pending) - 1
        prev, next_state = chosen, messages[len(chosen.messages) + 1 :]
        if prev.truncated and self.truncated == "mask":
            self.counts["dropped/truncated"] += 1
            self._record(prev, next_state, None, "truncated")
            return
        self._launch_judge(s, prev, next_state)

    def _launch_judge(self, s: _Session, turn: Turn, next_state: list[dict]) -> None:
        judge = self.judges[self._rr % len(self.judges)]
        self._rr += 1
        if self.journal is not None:  # [journal hook] the judgement is durable before it starts
            from clawray.journal import turn_to_dict

            self._journal("judge", sid=turn.session_id, turn=turn_to_dict(turn), next_state=next_state)
            coro = self._journaled_judge(s, turn, next_state, judge)
        else:
            coro = self._judge_and_emit(s, turn, next_state, judge)
        s.tasks.append(self._track(asyncio.ensure_future(coro)))

    async def _journaled_judge(self, s: _Session, turn: Turn, next_state: list[dict], judge: Any) -> None:
        """[journal hook] Judge, then journal the outcome (held for at-least-one, or done)."""
        from clawray.journal import turn_to_dict

        await self._judge_and_emit(s, turn, next_state, judge)
        held = s.held[-1][1] if s.held and s.held[-1][0] is turn else None
        self._journal("judged", sid=turn.session_id, turn_index=turn.turn_index, effective=s.effective,
                      held=held, turn=turn_to_dict(turn) if held is not None else None)

    async def _judge_and_emit(self, s: _Session, turn: Turn, next_state: list[dict], judge: Any) -> None:
        """Have the algorithm judge ``turn`` (:meth:`clawray.algos.algorithm.Algorithm.score`), then
        count, record, and emit or hold it."""
        verdict = await self.algorithm.score(turn, next_state, self._scorers(judge), self.counts)
        if verdict.drop is not None:
            self.counts[f"dropped/{verdict.drop}"] += 1
        self._record(turn, next_state, verdict.result, verdict.record_note, **verdict.extra)
        if verdict.held is not None:  # held for the at-least-one rule until the session closes
            s.held.append((turn, verdict.held))
        elif verdict.sample is not None:
            await self._emit(s, verdict.sample)

    def _scorers(self, judge: Any) -> Scorers:
        """The judge actor's calls and the teachers' (round-robin, picked when the teacher is asked)."""
        return Scorers(judge=getattr(getattr(judge, "judge", None), "remote", None),
                       hint=getattr(getattr(judge, "hint", None), "remote", None),
                       teacher_logprobs=lambda turn, hint: self._teacher().teacher_logprobs.remote(turn, hint),
                       teacher_topk=lambda turn, hint, k: self._teacher().teacher_topk.remote(turn, hint, k))

    def _teacher(self) -> Any:
        return self.teachers[self._rr % len(self.teachers)]

    async def _emit(self, s: _Session, sample: Sample) -> None:
        s.effective = True
        await self.queue.put.remote([ray.put(sample)], SampleMeta.of(sample))
        self.counts["samples"] += 1

    def _record(self, turn: Turn, next_state: list, result: Any, dropped: str | None, **extra: Any) -> None:
        if self.judged_records is None:
            return
        row = {**extra, "session_id": turn.session_id, "turn": turn.turn_index, "policy_version": turn.policy_version,
               "response": turn.response_message, "next_state": next_state,
               "score": getattr(result, "score", None), "votes": getattr(result, "votes", None),
               "raw_votes": getattr(result, "raw", None), "dropped": dropped}
        self.judged_records.append(row)

    async def pending_turn(self, session_id: str, choice: int = 0) -> Turn | None:
        """The session's latest turn (of choice ``choice``), still waiting for its next state, or None."""
        s = self.sessions.get(session_id)
        return s.pending[choice] if s is not None and choice < len(s.pending) else None

    async def drain(self, timeout_s: float = 60.0) -> int:
        """Wait until in-flight judge tasks finish; returns how many were still running at the timeout."""
        self._start_replay()
        if self.tasks:
            await asyncio.wait(list(self.tasks), timeout=timeout_s)
        return len(self.tasks)

    async def stats(self) -> dict:
        """Counters (turns, judged, samples, score/*, dropped/*) plus open sessions and judging tasks."""
        self._start_replay()
        return {**self.counts, "open_sessions": len(self.sessions), "judging": len(self.tasks)}


SessionTrackerActor = ray.remote(SessionTracker)
