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

Long-horizon credit (``credit``, see :mod:`clawray.algos.credit`): with ``mode`` ``discounted`` or
``outcome`` a judged turn that carries a reward does not go to the queue at once: it *waits* in its
session (``credit/turns_waiting``) until the session closes (``X-Session-Done`` or the idle timeout),
then every waiting turn gets its return and is emitted; a return of exactly 0 makes a turn neutral
(the at-least-one rule may still promote it with its mean vote; a sample with a teacher term is
emitted anyway). The staleness budget flushes a session's waiting turns early
(:func:`~clawray.algos.credit.must_flush`, ``credit/forced_flushes``): the tracker learns the
engines' version from the turns it records. Waiting turns, the session's outcome and the flushes are
journaled (``judged`` with ``waiting``, ``outcome``, ``released``), so they survive a restart. Dense
shaping terms (:mod:`clawray.algos.shaping`) are added to a judged turn's reward before it waits.

The outcome judge (``credit["outcome_judge"]``, ``trainer.outcome_judge``): when a session closes
(explicitly or idle) with waiting turns and no explicit outcome, one judge worker scores the whole
session once (:meth:`clawray.actors.judge.JudgeWorker.judge_session`, over the last request's
history plus its reply) and that score is the session's outcome. An explicit outcome wins (the judge
is not asked); no waiting turn left (all flushed by the staleness budget) asks nothing. An answer
without a valid vote, or a failed call, leaves the session without an outcome (``outcome`` mode then
falls back to the last judged turn's score), counted as ``credit/outcome_unscored`` or
``credit/outcome_judge_errors``; a scored one counts ``credit/outcome_judged``. The transcript is
journaled with the close, and the judged outcome as an ``outcome`` record, so a restart between the
close and the release asks the judge (again) or reuses its answer.
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
from clawray.algos.credit import CREDIT_MODES, must_flush, segment_credit
from clawray.algos.rejection import opening
from clawray.algos.shaping import check_terms, shaping_terms
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
    waiting: list = field(default_factory=list)  # credit != turn: judged samples awaiting their return
    outcome: float | None = None  # the session's explicit outcome (X-Session-Outcome), last one given
    requests: int = 0  # main-line requests recorded in this session (n choices count once)
    opening: str = ""  # conversation_key of the session's opening (trainer.group_by session_prefix)
    transcript: list = field(default_factory=list)  # outcome judge: the last request's history + its reply


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
        credit: ``{"mode", "gamma", "outcome_turn_weight", "max_staleness", "outcome_judge"}``
            (``trainer.credit``, ``trainer.gamma``, ``trainer.outcome_turn_weight``,
            ``queue.max_staleness``, ``trainer.outcome_judge``); None = ``turn``.
        shaping: ``{term: weight}`` of the dense shaping terms (``trainer.shaping``; weight 0 = off).

    Raises:
        ValueError: an unknown credit mode or shaping term, or an algorithm without its teachers.
    """

    def __init__(
        self,
        judges: list,
        queue: Any,
        at_least_one: bool = True,
        records_dir: str | None = None,
        algo: str = "rl",
        teachers: list | None = None,
        opd: dict | None = None,
        idle_timeout_s: float = 0.0,
        truncated: str = "keep",
        records_max_bytes: int = 64 << 20,
        records_keep: int = 5,
        journal: dict | None = None,
        credit: dict | None = None,
        shaping: dict | None = None,
    ):
        self.judges, self.queue = judges, queue
        credit = {
            "mode": "turn",
            "gamma": 1.0,
            "outcome_turn_weight": 0.0,
            "max_staleness": 2,
            "outcome_judge": False,
            **(credit or {}),
        }
        if credit["mode"] not in CREDIT_MODES:
            raise ValueError(f"unknown credit mode {credit['mode']!r}; expected one of {list(CREDIT_MODES)}")
        self.credit = credit
        self.shaping = {k: float(w) for k, w in (shaping or {}).items() if w}
        check_terms(self.shaping)
        self.served_version = -1  # the newest policy version seen on a recorded turn (the engines')
        self.n_waiting = 0
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
            self.served_records = JsonlRecords(
                os.path.join(records_dir, "turns.jsonl"), records_max_bytes, records_keep
            )
            self.judged_records = JsonlRecords(
                os.path.join(records_dir, "judgments.jsonl"), records_max_bytes, records_keep
            )
        self.journal, self._replay = None, []  # [journal hook] clawray.journal.SessionJournal
        if journal:
            from clawray.journal import SessionJournal, restore_tracker

            self.journal = SessionJournal(max_closed=MAX_CLOSED_REMEMBERED, **journal)
            self._replay = restore_tracker(self, _Session)
            from clawray.recovery import was_restarted

            if was_restarted():  # [recovery hook] Ray restarted this actor (its counters continue from the journal)
                self.counts["restarts"] += 1

    def _journal(self, op: str, **fields: Any) -> None:
        """[journal hook] Append one session-state change (no-op without a journal)."""
        if self.journal is not None:  # with the counters as they are now: a restart re-bases them on it
            self.journal.log(op, **fields, counts=dict(self.counts))

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
                prev = {
                    "prompt_ids": t.prompt_ids,
                    "response_ids": t.response_ids,
                    "ended": not t.truncated,
                    "n_messages": len(t.messages),
                }
                break
        return {"session_id": session_id, "prev": prev, "context_changed": changed}

    async def record_turn(self, turn: Turn, done: bool = False, outcome: float | None = None) -> int:
        """Record one served main-line turn (see :meth:`record_turns`); returns its 1-based index."""
        return (await self.record_turns([turn], done, outcome))[0]

    async def record_turns(self, turns: list[Turn], done: bool = False, outcome: float | None = None) -> list[int]:
        """Record the served main-line turns of one request (its n choices, same session and prompt).

        The session's previous turns are resolved with this request's history: the one it continues
        gets its next state and is judged; the others are counted (``unchosen``, or ``branch`` when
        the history continues none of them).

        Args:
            turns: the new turns (their ``turn_index`` is assigned here, unique in the session).
            done: the client closed the session with this request.
            outcome: the session's outcome score from this request (``X-Session-Outcome``), or None;
                the last one given counts (``trainer.credit`` ``outcome``/``discounted``).

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
        s.requests += 1
        if not s.opening:
            s.opening = conversation_key(opening(turns[0].messages))
        if outcome is not None:
            self._set_outcome(s, outcome)
        if self._judges_outcomes():
            s.transcript = [*turns[0].messages, turns[0].response_message]
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
        version = max(t.policy_version for t in turns)
        if version > self.served_version:  # the engines moved on: waiting turns may have to go now
            self.served_version = version
            for other in list(self.sessions.values()):
                await self._maybe_flush(other)
        return [t.turn_index for t in turns]

    def _set_outcome(self, s: _Session, outcome: float) -> None:
        """Store the session's outcome (explicit or judged; journaled)."""
        s.outcome = float(outcome)
        self._journal("outcome", sid=s.sid, value=s.outcome)  # [journal hook]

    def _judges_outcomes(self) -> bool:
        """Whether closed sessions without an explicit outcome are scored by the outcome judge."""
        return bool(self.credit["outcome_judge"]) and self.credit["mode"] != "turn"

    async def _judge_outcome(self, s: _Session) -> None:
        """Ask one judge worker for the whole session's score and make it the session's outcome; an
        answer without a valid vote or a failed call leaves the outcome unset (counted)."""
        judge = self.judges[self._rr % len(self.judges)]
        self._rr += 1
        try:
            result = await judge.judge_session.remote(s.transcript, s.sid)
        except Exception as e:  # a dead or failing judge worker: no outcome, never a dead tracker
            self.counts["credit/outcome_judge_errors"] += 1
            self.counts[f"credit/outcome_judge_errors/{type(e).__name__}"] += 1
            return
        valid = result.counts.get("valid", sum(v is not None for v in result.votes))
        if self.judged_records is not None:
            self.judged_records.append(
                {
                    "session_id": s.sid,
                    "turn": None,
                    "kind": "session_outcome",
                    "score": result.score if valid else None,
                    "votes": result.votes,
                    "raw_votes": result.raw,
                }
            )
        if not valid:
            self.counts["credit/outcome_unscored"] += 1
            return
        self.counts["credit/outcome_judged"] += 1
        self._set_outcome(s, float(result.score))

    async def close_session(self, session_id: str, outcome: float | None = None) -> None:
        """Close a session; its last turn has no next state and is not trained (counted). Once its
        judge tasks finish, the waiting turns get their returns (``trainer.credit``) and the
        at-least-one rule runs (in the background: the caller does not wait).

        Args:
            outcome: the session's outcome score, when the closing request carried one.
        """
        s = self.sessions.get(session_id)
        if s is not None and outcome is not None:
            self._set_outcome(s, outcome)
        s = self.sessions.pop(session_id, None)
        if s is None:
            return
        self.counts["credit/sessions"] += 1
        self.counts["credit/session_turns"] += s.requests
        self.closed_turns[session_id] = s.turns
        if len(self.closed_turns) > MAX_CLOSED_REMEMBERED:
            self.closed_turns.popitem(last=False)
        self.counts["sessions_closed"] += 1
        self.counts["dropped/no_next_state"] += len(s.pending)
        self._unindex(s)
        judge_it = self._judges_outcomes() and s.outcome is None and bool(s.transcript)
        self._journal("close", sid=session_id, transcript=s.transcript if judge_it else None)  # [journal hook]
        self._track(asyncio.ensure_future(self._finalize(s)))

    async def close_idle(self, now: float | None = None) -> int:
        """Close every session idle for longer than ``idle_timeout_s``; returns how many."""
        now = time.monotonic() if now is None else now
        idle = [sid for sid, s in self.sessions.items() if now - s.last_seen > self.idle_timeout_s]
        self.counts["sessions_idle_closed"] += len(idle)  # before the closes journal the counters
        for sid in idle:
            await self.close_session(sid)
        return len(idle)

    async def _sweep_idle(self) -> None:
        while True:
            await asyncio.sleep(min(max(self.idle_timeout_s / 4, 0.05), 30.0))
            await self.close_idle()

    async def _finalize(self, s: _Session) -> None:
        if s.tasks:
            await asyncio.gather(*s.tasks, return_exceptions=True)
        released = bool(s.waiting)
        if released and s.outcome is None and s.transcript and self._judges_outcomes():
            await self._judge_outcome(s)
        if released:
            await self._release(s, closed=True)
        if not s.held:
            if released:
                self._journal("finalized", sid=s.sid)  # [journal hook]
            return
        if self.at_least_one and not s.effective:
            best = max(range(len(s.held)), key=lambda i: abs(s.held[i][1]))  # first of equals
            item, mean_vote = s.held.pop(best)
            self.counts["at_least_one_promoted"] += 1
            if isinstance(item, Sample):  # a zero-return turn (credit != turn): its mean vote is its reward
                item.reward = mean_vote
                await self._emit(s, item)
            else:
                await self._emit(s, self.algorithm.promote(item, mean_vote))
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
        s.tasks.append(self._track(asyncio.ensure_future(self._journaled_judge(s, turn, next_state, judge))))

    async def _journaled_judge(self, s: _Session, turn: Turn, next_state: list[dict], judge: Any) -> None:
        """Judge, then journal the outcome (held for at-least-one, waiting for its return, or done;
        [journal hook], a no-op without a journal), then flush the session's waiting turns when the
        staleness budget says so."""
        await self._judge_and_emit(s, turn, next_state, judge)
        if self.journal is not None:
            from dataclasses import asdict

            from clawray.journal import turn_to_dict

            held = s.held[-1][1] if s.held and s.held[-1][0] is turn else None
            waiting = next((w for w in s.waiting if w.turn_index == turn.turn_index), None)
            self._journal(
                "judged",
                sid=turn.session_id,
                turn_index=turn.turn_index,
                effective=s.effective,
                held=held,
                turn=turn_to_dict(turn) if held is not None else None,
                waiting=asdict(waiting) if waiting is not None else None,
            )
        await self._maybe_flush(s)

    async def _judge_and_emit(self, s: _Session, turn: Turn, next_state: list[dict], judge: Any) -> None:
        """Have the algorithm judge ``turn`` (:meth:`clawray.algos.algorithm.Algorithm.score`), then
        count, record, shape its reward, and emit, hold or keep it waiting for its return."""
        verdict = await self.algorithm.score(turn, next_state, self._scorers(judge), self.counts)
        if verdict.drop is not None:
            self.counts[f"dropped/{verdict.drop}"] += 1
        self._record(turn, next_state, verdict.result, verdict.record_note, **verdict.extra)
        sample, held = self._shape(turn, verdict.sample, verdict.held)
        if self.credit["mode"] != "turn" and sample is not None and sample.reward is not None:
            sample.info["held_vote"] = held  # a zero return falls back to the at-least-one rule
            s.waiting.append(sample)
            self.n_waiting += 1
        elif held is not None:  # held for the at-least-one rule until the session closes
            s.held.append((turn, held))
        elif sample is not None:
            await self._emit(s, sample)

    def _shape(self, turn: Turn, sample: Sample | None, held: float | None) -> tuple[Sample | None, float | None]:
        """Add the shaping terms to a judged turn's reward: ``(sample, held mean vote)``. A held
        (0-scored) turn becomes a sample with the terms' sum as its reward when that sum is not 0, or
        (credit != turn) always, to wait for its return with reward 0."""
        rewarded = sample is not None and sample.reward is not None
        if not rewarded and held is None:
            return sample, held
        terms = shaping_terms(turn, self.shaping) if self.shaping else {}
        total = sum(terms.values())
        if not rewarded:
            if total == 0.0 and self.credit["mode"] == "turn":
                return None, held
            sample = self.algorithm.promote(turn, 0.0)
        sample.reward = float(sample.reward) + total
        if terms:
            sample.info["shaping"] = terms
        return sample, (held if self.credit["mode"] != "turn" else None)

    async def _maybe_flush(self, s: _Session) -> None:
        """Emit a session's waiting turns before its end when the staleness budget forces it."""
        if s.waiting and must_flush(
            min(w.policy_version for w in s.waiting), self.served_version, self.credit["max_staleness"]
        ):
            self.counts["credit/forced_flushes"] += 1
            await self._release(s, closed=False)

    async def _release(self, s: _Session, closed: bool) -> None:
        """Give the waiting turns their returns (:func:`~clawray.algos.credit.segment_credit`) and emit
        them; a zero return makes a held turn neutral again (back to the at-least-one rule), any other
        turn without a teacher term is dropped (``dropped/zero_return``)."""
        entries = sorted(s.waiting, key=lambda w: w.turn_index)
        s.waiting = []
        self.n_waiting -= len(entries)
        c = self.credit
        outcome = s.outcome if closed else None
        rewards = [float(w.reward) for w in entries]
        credit = segment_credit(c["mode"], rewards, c["gamma"], outcome, c["outcome_turn_weight"], closed)
        if closed and c["mode"] == "outcome":
            self.counts["credit/outcome_sum"] += rewards[-1] if outcome is None else outcome
            self.counts["credit/outcome_sessions"] += 1
        held_back = []
        for sample, g in zip(entries, credit):
            sample.info["turn_reward"], sample.reward = sample.reward, g
            if closed and c["mode"] == "outcome":
                sample.info["outcome"] = rewards[-1] if outcome is None else outcome
            held = sample.info.pop("held_vote", None)
            if g != 0.0 or sample.teacher_logprobs is not None or sample.teacher_topk_ids is not None:
                await self._emit(s, sample)
            elif held is not None:
                s.held.append((sample, held))
                held_back.append([dict(sample.__dict__), held])
            else:
                self.counts["dropped/zero_return"] += 1
        self._journal("released", sid=s.sid, turn_indexes=[w.turn_index for w in entries], held=held_back)

    def _scorers(self, judge: Any) -> Scorers:
        """The judge actor's calls and the teachers' (round-robin, picked when the teacher is asked)."""
        return Scorers(
            judge=getattr(getattr(judge, "judge", None), "remote", None),
            hint=getattr(getattr(judge, "hint", None), "remote", None),
            teacher_logprobs=lambda turn, hint: self._teacher().teacher_logprobs.remote(turn, hint),
            teacher_topk=lambda turn, hint, k: self._teacher().teacher_topk.remote(turn, hint, k),
        )

    def _teacher(self) -> Any:
        return self.teachers[self._rr % len(self.teachers)]

    async def _emit(self, s: _Session, sample: Sample) -> None:
        s.effective = True
        if s.opening:  # its group under trainer.group_by=session_prefix
            sample.info.setdefault("opening", s.opening)
        await self.queue.put.remote([ray.put(sample)], SampleMeta.of(sample))
        self.counts["samples"] += 1

    def _record(self, turn: Turn, next_state: list, result: Any, dropped: str | None, **extra: Any) -> None:
        if self.judged_records is None:
            return
        row = {
            **extra,
            "session_id": turn.session_id,
            "turn": turn.turn_index,
            "policy_version": turn.policy_version,
            "response": turn.response_message,
            "next_state": next_state,
            "score": getattr(result, "score", None),
            "votes": getattr(result, "votes", None),
            "raw_votes": getattr(result, "raw", None),
            "dropped": dropped,
        }
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
        out = {
            **self.counts,
            "open_sessions": len(self.sessions),
            "judging": len(self.tasks),
            "credit/turns_waiting": self.n_waiting,
        }
        if self.counts["credit/sessions"]:
            out["credit/mean_session_turns"] = self.counts["credit/session_turns"] / self.counts["credit/sessions"]
        if self.counts["credit/outcome_sessions"]:
            out["credit/outcome_mean"] = self.counts["credit/outcome_sum"] / self.counts["credit/outcome_sessions"]
        return out


SessionTrackerActor = ray.remote(SessionTracker)
