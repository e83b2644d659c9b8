"""SessionTracker: pairs each main-line turn with its next state, has it judged, and emits samples.

The next state of turn t is every message after turn t's response in the session's next main-line
request (a user reply, or several tool results kept together). When that request's history does not
contain turn t's response at the expected place, the turn is counted as a ``branch`` and not trained
(instead of being paired with the wrong next state).

What a judged turn becomes (a sample, a held 0-score turn, a drop reason) is decided by the run's
:class:`~clawray.algos.algorithm.Algorithm` (Binary RL, OPD, Combine: their rules live there). The
tracker owns the rules around it:
  * the at-least-one rule: when a session closes without any trained turn, its *best-signed* held
    turn (largest |mean of valid votes|, e.g. votes [0, 0, 1] -> 1/3) is promoted with that mean as
    its reward (OpenClaw-RL promotes the first one with reward 0, a gradient no-op); a promoted turn
    whose votes average 0 trains with reward 0, which the driver's degenerate-batch baseline turns
    into a real advantage;
  * the last turn of a closed session has no next state -> ``no_next_state``, dropped. A session is
    closed by ``X-Session-Done`` or after ``idle_timeout_s`` without a request (its memory is freed);
  * a reply cut by ``max_tokens`` (``truncated``) is not judged when ``truncated="mask"``
    (``dropped/truncated``); with ``"keep"`` it is judged and trained like any other;
  * a request with ``n`` choices records n turns with the same prompt; the next request continues
    one of them (the one whose reply its history holds), the others are ``dropped/unchosen``;
  * the sessions, the pairing, the records and the emission into the queue.

The tracker also answers the server's :meth:`SessionTracker.lookup`: which open session a history
continues (for clients that send no session id) and which pending turn it extends (for splicing).
Pairing a turn with its next state keys on the messages alone; splicing also needs the same render
key (tools): a request that changes its tools still gives the previous turn its next state, but its
prompt is rendered afresh.
Every served main-line turn is appended to ``records/turns.jsonl`` and every judged one to
``records/judgments.jsonl`` (see :class:`clawray.records.TurnRecords`).

Durability (``journal``, see :mod:`clawray.journal`): with a journal path, the session state (turn
indexes, pending turns, judgements started and finished, held turns, closes) is appended to
``journal/sessions.jsonl`` before the call that changed it returns; a new tracker (a resume, or Ray
restarting this actor) rebuilds its sessions from it and restarts the unfinished judgements (their
samples are deduplicated by the queue's journal).

Long-horizon credit and shaping (``credit``, ``shaping``): delegated to a
:class:`~clawray.algos.credit_ledger.CreditLedger`. With ``mode`` ``discounted`` or ``outcome`` a
judged turn that carries a reward waits in its session's :class:`~clawray.algos.credit_ledger.SessionCredit`
until the session closes (or the staleness budget flushes it), then gets its return and is emitted;
a return of exactly 0 makes a turn neutral (the at-least-one rule may still promote it with its mean
vote; a sample with a teacher term is emitted anyway). The tracker tells the ledger the engines'
version from the turns it records. Waiting turns (``judged`` with ``waiting``), the session's outcome
and the releases are journaled, so they survive a restart.

The outcome judge (``trainer.outcome_judge``): when a session closes (explicitly or idle) with
waiting turns and no explicit outcome, one judge worker scores the whole session once
(:meth:`clawray.actors.judge.JudgeWorker.judge_session`, over the last request's history plus its
reply) and that score is the session's outcome. An explicit outcome wins (the judge is not asked); no
waiting turn left (all flushed by the staleness budget) asks nothing. An answer without a valid vote,
or a failed call, leaves the session without an outcome (``outcome`` mode then falls back to the last
judged turn's score), counted as ``credit/outcome_unscored`` or ``credit/outcome_judge_errors``; a
scored one counts ``credit/outcome_judged``. The transcript is journaled with the close, and the
judged outcome as an ``outcome`` record, so a restart between the close and the release asks the
judge (again) or reuses its answer.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import time
from collections import Counter
from typing import Any

import ray

from clawray.actors.worker_pool import WorkerPool
from clawray.algos.algorithm import make_algorithm
from clawray.algos.credit_ledger import CreditLedger
from clawray.config import ClawrayConfig, section
from clawray.journal import RestoredSessions, SessionJournal, restore_sessions
from clawray.records import TurnRecords
from clawray.recovery import was_restarted
from clawray.session_book import MAX_CLOSED_REMEMBERED, Session, SessionBook
from clawray.types import Sample, SampleMeta, Turn


#: Seconds a sample's put is retried while the queue's journal cannot be written (a full disk).
PUT_RETRY_S = 600.0


class SessionTracker:
    """Owns all session state (one actor, so turn indexes are unique per session).

    Args:
        judges: JudgeWorker actor handles (used round-robin).
        queue: TrajectoryQueue actor handle.
        cfg: the run's config (:class:`~clawray.config.ClawrayConfig`, or a mapping of the keys that
            differ from its defaults). The tracker reads ``trainer.algo`` (a registered algorithm;
            ``opd.*`` for those that need a teacher), ``trainer.credit``, ``gamma``,
            ``outcome_turn_weight``, ``outcome_judge`` and ``shaping``, ``queue.max_staleness``,
            ``session.idle_timeout_s`` and ``truncated``, ``records.max_mb`` and ``keep_files``.
        teachers: TeacherWorker actor handles, for an algorithm that needs a teacher.
        records_dir: when set, served turns go to ``records_dir/turns.jsonl`` and judge results to
            ``records_dir/judgments.jsonl`` (rotated at ``records.max_mb``, ``records.keep_files`` kept).
        journal: ``{"path", "fsync", "compact_bytes"}`` of the session journal, or None (not durable).
        at_least_one: apply the at-least-one rule.

    Raises:
        ValueError: an unknown credit mode or shaping term, or an algorithm without its teachers.
        ConfigError: a key the config schema does not have, or a value of the wrong type.
    """

    def __init__(
        self,
        judges: list,
        queue: Any,
        cfg: Any = None,
        *,
        teachers: list | None = None,
        records_dir: str | None = None,
        journal: dict | None = None,
        at_least_one: bool = True,
    ):
        cfg = section(ClawrayConfig, cfg or {})
        trainer = cfg.trainer
        self.queue = queue
        self.counts: Counter[str] = Counter()
        self.ledger = CreditLedger(
            trainer.credit,
            trainer.gamma,
            trainer.outcome_turn_weight,
            cfg.queue.max_staleness,
            trainer.outcome_judge,
            shaping=dataclasses.asdict(trainer.shaping),
            counts=self.counts,
            journal=self._journal,
        )
        self.algorithm, self.workers = make_algorithm(trainer.algo, cfg.opd), WorkerPool(judges, teachers)
        if self.algorithm.needs_teacher and not self.workers.teachers:
            raise ValueError(f"algo {trainer.algo!r} needs at least one TeacherWorker")
        self.at_least_one = at_least_one
        self.book = SessionBook(MAX_CLOSED_REMEMBERED)  # sessions, pairing, the pending-turn index
        self.truncated = cfg.session.truncated
        self.tasks: set[asyncio.Task] = set()
        self.idle_timeout_s = cfg.session.idle_timeout_s
        self._sweeper: asyncio.Task | None = None
        self.records = TurnRecords(records_dir, int(cfg.records.max_mb * 2**20), cfg.records.keep_files)
        self.storage_error: str | None = None  # the journal write the disk refuses now, if any
        self.journal, self._replay = None, []  # [journal hook] clawray.journal.SessionJournal
        if journal:
            self.journal = SessionJournal(max_closed=MAX_CLOSED_REMEMBERED, **journal)
            self._replay = self._restore(self.journal.state, restore_sessions(self.journal.state))
            if was_restarted():  # [recovery hook] Ray restarted this actor (its counters continue from the journal)
                self.counts["restarts"] += 1

    def _journal(self, op: str, **fields: Any) -> None:
        """[journal hook] Append one session-state change (no-op without a journal)."""
        if self.journal is not None:  # with the counters as they are now: a restart re-bases them on it
            self._durably(self.journal.log, op, **fields, counts=dict(self.counts))

    def _durably(self, write: Any, *args: Any, **kwargs: Any) -> None:
        """[journal hook] One journal write. A disk that refuses it (ENOSPC, ...) degrades durability,
        never the service: the request is still answered and the state kept in memory; the refusal is
        counted (``storage_errors``) and named in :meth:`stats` (``storage_failing``, hence ``/health``
        degraded) until a write succeeds again. What is lost is only what a tracker restart during
        the outage would have replayed: turns and judgements, never an acknowledged sample (the
        queue acknowledges a sample only once its own journal line is written)."""
        try:
            write(*args, **kwargs)
        except OSError as e:
            self.counts["storage_errors"] += 1
            self.storage_error = f"sessions journal: {e.strerror or type(e).__name__}"
            return
        self.storage_error = None

    def _restore(self, state: Any, restored: RestoredSessions) -> list:
        """[journal hook] Apply what the journal restored: the counters continue (never silently back
        at zero), open sessions go back into the book, credits into the ledger. Returns the callables
        that restart the unfinished judgements and the at-least-once finalisation of closed sessions
        (:meth:`_start_replay` runs them once the event loop runs)."""
        self.counts.update(state.counts)
        self.book.closed_turns.update(restored.closed_turns)
        self.book.closed_index.update(restored.closed_index)
        for credit in restored.credits:
            self.ledger.restored(credit)
        for session in restored.open:
            self.book.restore(session)
        actions: list = []
        for session, turn, next_state in restored.jobs:
            actions.append(lambda s=session, t=turn, ns=next_state: self._relaunch(s, t, ns))
        for session in restored.closed:
            actions.append(lambda s=session: self._track(asyncio.ensure_future(self._finalize(s))))
        self.counts["journal/replayed_judgements"] += len(restored.jobs)
        self.counts["journal/restored_sessions"] += len(restored.open)
        return actions

    def _relaunch(self, session: Session, turn: Turn, next_state: list) -> None:
        """[journal hook] Judge again a restored turn whose judgement had not ended."""
        judge = self.workers.next_judge()
        job = self._journaled_judge(session, turn, next_state, judge)
        session.tasks.append(self._track(asyncio.ensure_future(job)))

    def _start_replay(self) -> None:
        """[journal hook] Restart the judgements a previous tracker left unfinished (once, lazily: the
        actor's event loop runs only inside its methods)."""
        while self._replay:
            self._replay.pop(0)()

    async def lookup(
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
        """Which session and pending turn a new request continues: :meth:`clawray.session_book.SessionBook.find`."""
        self._start_replay()
        return self.book.find(session_id, keys, render_key, auto_only, exact, hint, user, last_reply)

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
        s = self.book.open(sid, turns[0].messages)  # a closed id used again: its turn indexes continue
        if self.ledger.judges_outcomes:
            s.credit.transcript = [*turns[0].messages, turns[0].response_message]
        if s.pending:
            self._resolve(s, turns[0].messages)
        self.book.add(s, turns)
        for turn in turns:
            self.counts["turns"] += 1
            self.counts["turns_truncated"] += int(turn.truncated)
            self.counts["turns_tool_parse_error"] += int(turn.tool_parse_error)
            self.records.turn(turn)
        if self.journal is not None:  # [journal hook] the indexes are durable before they are answered
            self._durably(self.journal.turns, turns, dict(self.counts), s.opening)
        if outcome is not None:  # journaled after the turns: a closed id used again names its new session
            self.ledger.set_outcome(s.credit, sid, outcome, s.turns)
        if done:
            await self.close_session(sid)
        served = max(max(t.token_versions or [t.policy_version]) for t in turns)  # a reply's NEWEST token
        if self.ledger.served(served):  # the engines moved on: flush?
            for other in list(self.book.sessions.values()):
                await self._maybe_flush(other)
        return [t.turn_index for t in turns]

    async def _judge_outcome(self, s: Session) -> None:
        """Ask one judge worker for the whole session's score and make it the session's outcome; an
        answer without a valid vote or a failed call leaves the outcome unset (counted)."""
        try:
            result = await self.workers.next_judge().judge_session.remote(s.credit.transcript, s.sid)
        except Exception as e:  # a dead or failing judge worker: no outcome, never a dead tracker
            self.counts["credit/outcome_judge_errors"] += 1
            self.counts[f"credit/outcome_judge_errors/{type(e).__name__}"] += 1
            return
        valid = result.counts.get("valid", sum(v is not None for v in result.votes))
        self.records.session_outcome(s.sid, result, valid)
        if not valid:
            self.counts["credit/outcome_unscored"] += 1
            return
        self.counts["credit/outcome_judged"] += 1
        self.ledger.set_outcome(s.credit, s.sid, float(result.score), s.turns)

    async def set_outcome(self, session_id: str, outcome: float) -> None:
        """Set the open session's outcome score (``X-Session-Outcome`` on a side request, which records
        no turn); the last one given counts. Nothing for a session that is not open."""
        s = self.book.sessions.get(session_id)
        if s is not None:
            self.ledger.set_outcome(s.credit, session_id, outcome, s.turns)

    async def close_session(self, session_id: str, outcome: float | None = None, idle: bool = False) -> None:
        """Close a session; its last turn has no next state and is not trained (counted). Once its
        judge tasks finish, the waiting turns get their returns (``trainer.credit``) and the
        at-least-one rule runs (in the background: the caller does not wait).

        Args:
            outcome: the session's outcome score, when the closing request carried one.
            idle: closed for silence (:meth:`close_idle`): a later request continuing it is inferred
                into the same id (:meth:`SessionBook.close`).
        """
        s = self.book.close(session_id, idle)
        if s is None:
            return
        if outcome is not None:
            self.ledger.set_outcome(s.credit, session_id, outcome, s.turns)
        self.ledger.session_closed(s.requests)
        self.counts["sessions_closed"] += 1
        self.counts["dropped/no_next_state"] += len(s.pending)
        judge_it = self.ledger.judges_outcomes and s.credit.outcome is None  # its judge tasks may add waiting turns
        transcript = s.credit.transcript if judge_it and s.credit.transcript else None
        idle_keys = [*s.keys, *s.quiet] if idle else []  # an idle close's conversation may go on (SessionBook.close)
        self._journal("close", sid=session_id, transcript=transcript, idle_keys=idle_keys)  # [journal hook]
        self._track(asyncio.ensure_future(self._finalize(s)))

    async def close_idle(self, now: float | None = None) -> int:
        """Close every session idle for longer than ``idle_timeout_s``; returns how many."""
        idle = self.book.idle(self.idle_timeout_s, now)
        self.counts["sessions_idle_closed"] += len(idle)  # before the closes journal the counters
        for sid in idle:
            await self.close_session(sid, idle=True)
        return len(idle)

    async def _sweep_idle(self) -> None:
        while True:
            await asyncio.sleep(min(max(self.idle_timeout_s / 4, 0.05), 30.0))
            await self.close_idle()

    async def _finalize(self, s: Session) -> None:
        if s.tasks:
            await asyncio.gather(*s.tasks, return_exceptions=True)
        released = bool(s.credit.waiting)
        if self.ledger.needs_judge(s.credit):
            await self._judge_outcome(s)
        if released:
            await self.ledger.release(s.credit, s.sid, True, *self._outlets(s))
        if not s.held:
            if released:
                self._journal("finalized", sid=s.sid, last=s.turns)  # [journal hook]
            return
        if self.at_least_one and not s.effective:
            item, mean_vote = s.promote_best()
            self.counts["at_least_one_promoted"] += 1
            if isinstance(item, Sample):  # a zero-return turn (credit != turn): its mean vote is its reward
                item.reward = mean_vote
                await self._emit(s, item)
            else:
                await self._emit(s, self.algorithm.promote(item, mean_vote))
        self.counts["dropped/zero_score"] += len(s.held)
        s.held.clear()
        self._journal("finalized", sid=s.sid, last=s.turns)  # [journal hook]

    def _track(self, task: asyncio.Task) -> asyncio.Task:
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task

    def _resolve(self, s: Session, messages: list[dict[str, Any]]) -> None:
        """Pair the pending turn that ``messages`` continues with its next state; count the rest."""
        pairing = self.book.pair(s, messages)
        if pairing.chosen is None:
            self.counts["dropped/branch"] += pairing.others
            return
        self.counts["paired"] += 1
        self.counts["paired_after_rewrite"] += int(pairing.rewritten)
        self.counts["dropped/unchosen"] += pairing.others
        if pairing.chosen.truncated and self.truncated == "mask":
            self.counts["dropped/truncated"] += 1
            self.records.judgement(pairing.chosen, pairing.next_state, None, "truncated")
            return
        self._launch_judge(s, pairing.chosen, pairing.next_state)

    def _launch_judge(self, s: Session, turn: Turn, next_state: list[dict]) -> None:
        judge = self.workers.next_judge()
        if self.journal is not None:  # [journal hook] the judgement is durable before it starts
            self._durably(self.journal.judge, turn, next_state, dict(self.counts))
        s.tasks.append(self._track(asyncio.ensure_future(self._journaled_judge(s, turn, next_state, judge))))

    async def _journaled_judge(self, s: Session, turn: Turn, next_state: list[dict], judge: Any) -> None:
        """Judge, then journal the outcome (held for at-least-one, waiting for its return, or done;
        [journal hook], a no-op without a journal), then flush the session's waiting turns when the
        staleness budget says so."""
        await self._judge_and_emit(s, turn, next_state, judge)
        if self.journal is not None:
            self._durably(self.journal.judged, s, turn, dict(self.counts))
        await self._maybe_flush(s)

    async def _judge_and_emit(self, s: Session, turn: Turn, next_state: list[dict], judge: Any) -> None:
        """Have the algorithm judge ``turn`` (:meth:`clawray.algos.algorithm.Algorithm.verdict`), then
        count, record, shape its reward, and emit, hold or keep it waiting for its return."""
        verdict = await self.algorithm.verdict(turn, next_state, self.workers.calls(judge), self.counts)
        if verdict.drop is not None:
            self.counts[f"dropped/{verdict.drop}"] += 1
        self.records.judgement(turn, next_state, verdict.result, verdict.record_note, **verdict.extra)
        sample, held = self.ledger.shape(turn, verdict.sample, verdict.held, self.algorithm.promote)
        if self.ledger.wait(s.credit, sample, held):  # it waits for its return (trainer.credit)
            return
        if held is not None:  # held for the at-least-one rule until the session closes
            s.held.append((turn, held))
        elif sample is not None:
            await self._emit(s, sample)

    async def _maybe_flush(self, s: Session) -> None:
        """Emit a session's waiting turns before its end when the staleness budget forces it."""
        await self.ledger.maybe_flush(s.credit, s.sid, *self._outlets(s))

    def _outlets(self, s: Session) -> tuple:
        """``(emit, hold)`` for the ledger's released turns: to the queue, or back to the at-least-one
        rule."""
        return functools.partial(self._emit, s), lambda sample, vote: s.held.append((sample, vote))

    async def _emit(self, s: Session, sample: Sample) -> None:
        s.effective = True
        if s.opening:  # its group under trainer.group_by=session_prefix
            sample.info.setdefault("opening", s.opening)
        ref, meta, delay = ray.put(sample), SampleMeta.of(sample), 1.0
        deadline = time.monotonic() + PUT_RETRY_S
        while True:
            try:
                await self.queue.put.remote([ref], meta)
                break
            except ray.exceptions.RayTaskError as e:  # the queue's journal refused the line (a full disk)
                if not isinstance(e.cause, OSError):
                    raise
                if time.monotonic() + delay > deadline:
                    self.counts["dropped/queue_put_failed"] += 1  # never acknowledged: not a lost sample
                    return
                self.counts["queue_put_retries"] += 1
                await asyncio.sleep(delay)
                delay = min(2 * delay, 30.0)
        self.counts["samples"] += 1

    async def learned(self, version: int) -> None:
        """The learners are at policy ``version`` after a step (lower after a rollback): the session
        turns waiting for their return that the next update is the last to accept are emitted now
        (:meth:`~clawray.algos.credit_ledger.CreditLedger.learned`), before the driver takes its batch."""
        self._start_replay()
        if self.ledger.learned(version):
            for s in list(self.book.sessions.values()):
                await self._maybe_flush(s)

    async def pending_turn(self, session_id: str, choice: int = 0) -> Turn | None:
        """The session's latest turn (of choice ``choice``), still waiting for its next state, or None."""
        s = self.book.get(session_id)
        return s.pending[choice] if s is not None and choice < len(s.pending) else None

    async def drain(self, timeout_s: float = 60.0) -> int:
        """Wait until in-flight judge tasks finish; returns how many were still running at the timeout."""
        self._start_replay()
        if self.tasks:
            await asyncio.wait(list(self.tasks), timeout=timeout_s)
        return len(self.tasks)

    async def stats(self) -> dict:
        """Counters (turns, judged, samples, score/*, dropped/*, storage_errors) plus open sessions,
        judging tasks, ``records_write_errors`` (record rows the disk refused) and ``storage_failing``
        (the files the disk refuses now: the sessions journal, records; ``[]`` when all is well)."""
        self._start_replay()
        record_errors, records_failing = self.records.failing()
        out = {
            **self.counts,
            "open_sessions": len(self.book),
            "judging": len(self.tasks),
            "records_write_errors": record_errors,
            "storage_failing": [self.storage_error] * bool(self.storage_error) + records_failing,
            **self.ledger.stats(),
        }
        return out


SessionTrackerActor = ray.remote(SessionTracker)
