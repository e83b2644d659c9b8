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
    closed by ``X-Session-Done`` or after ``idle_timeout_s`` without a request (its memory is freed).
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import ray

from clawray.types import Sample, Turn


@dataclass
class _Session:
    turns: int = 0
    pending: Turn | None = None
    effective: bool = False  # a turn of this session has been trained
    held: list = field(default_factory=list)  # (turn, mean vote) of 0-scored turns, for at-least-one
    tasks: list = field(default_factory=list)  # this session's judge tasks
    last_seen: float = field(default_factory=time.monotonic)


class SessionTracker:
    """Owns all session state (one actor, so turn indexes are unique per session).

    Args:
        judges: JudgeWorker actor handles (used round-robin).
        queue: TrajectoryQueue actor handle.
        at_least_one: apply the at-least-one rule.
        records_dir: when set, every judged turn is appended to ``records_dir/turns.jsonl``.
    """

    def __init__(self, judges: list, queue: Any, at_least_one: bool = True, records_dir: str | None = None,
                 algo: str = "rl", teachers: list | None = None, opd: dict | None = None,
                 idle_timeout_s: float = 0.0):
        self.judges, self.queue = judges, queue
        self.algo, self.teachers = algo, teachers or []
        self.opd = {"accept": "any", "min_hint_chars": 10, "topk": 0, **(opd or {})}
        if algo in ("opd", "combine") and not self.teachers:
            raise ValueError(f"algo {algo!r} needs at least one TeacherWorker")
        self.at_least_one = at_least_one
        self.sessions: dict[str, _Session] = {}
        self.counts: Counter[str] = Counter()
        self.tasks: set[asyncio.Task] = set()
        self._rr = 0
        self.idle_timeout_s = idle_timeout_s
        self._sweeper: asyncio.Task | None = None
        self.records_path = None
        if records_dir:
            os.makedirs(records_dir, exist_ok=True)
            self.records_path = os.path.join(records_dir, "turns.jsonl")
            open(self.records_path, "w").close()  # a rerun in the same folder starts afresh

    async def record_turn(self, turn: Turn, done: bool = False) -> int:
        """Record a served main-line turn; resolves the session's previous turn with this request.

        Args:
            turn: the new turn (its ``turn_index`` is assigned here).
            done: the client closed the session with this request.

        Returns:
            the turn's 1-based index in its session.
        """
        if self.idle_timeout_s > 0 and self._sweeper is None:
            self._sweeper = asyncio.ensure_future(self._sweep_idle())
        s = self.sessions.setdefault(turn.session_id, _Session())
        s.last_seen = time.monotonic()
        s.turns += 1
        turn.turn_index = s.turns
        self.counts["turns"] += 1
        if s.pending is not None:
            self._resolve(s, s.pending, turn.messages)
        s.pending = turn
        if done:
            await self.close_session(turn.session_id)
        return turn.turn_index

    async def close_session(self, session_id: str) -> None:
        """Close a session; its last turn has no next state and is not trained (counted). Once its
        judge tasks finish, the at-least-one rule runs (in the background: the caller does not wait)."""
        s = self.sessions.pop(session_id, None)
        if s is None:
            return
        self.counts["sessions_closed"] += 1
        if s.pending is not None:
            self.counts["dropped/no_next_state"] += 1
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
            await self._emit(s, turn, mean_vote)
        self.counts["dropped/zero_score"] += len(s.held)
        s.held.clear()

    def _track(self, task: asyncio.Task) -> asyncio.Task:
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task

    def _resolve(self, s: _Session, prev: Turn, messages: list[dict[str, Any]]) -> None:
        n = len(prev.messages)
        if len(messages) <= n + 1 or messages[n].get("role") != "assistant" or not _same_reply(
                messages[n], prev.response_message):
            self.counts["dropped/branch"] += 1
            return
        next_state = messages[n + 1 :]
        judge = self.judges[self._rr % len(self.judges)]
        self._rr += 1
        s.tasks.append(self._track(asyncio.ensure_future(self._judge_and_emit(s, prev, next_state, judge))))

    async def _judge_and_emit(self, s: _Session, turn: Turn, next_state: list[dict], judge: Any) -> None:
        if self.algo in ("opd", "combine"):
            return await self._distill_and_emit(turn, next_state, judge)
        try:
            result = await judge.judge.remote(turn, next_state)
        except Exception as e:  # a dead judge loses the turn, not the tracker
            self.counts["dropped/judge_error"] += 1
            self._record(turn, next_state, None, f"judge error: {e!r}")
            return
        self.counts["judged"] += 1
        self.counts[f"score/{result.score}"] += 1
        valid = [v for v in result.votes if v is not None]
        if not valid:
            self._record(turn, next_state, result, "unscored")
            self.counts["dropped/unscored"] += 1
            return
        if result.score == 0:  # held for the at-least-one rule until the session closes
            self._record(turn, next_state, result, "held")
            s.held.append((turn, sum(valid) / len(valid)))
            return
        self._record(turn, next_state, result, None)
        await self._emit(s, turn, float(result.score))

    async def _distill_and_emit(self, turn: Turn, next_state: list[dict], judge: Any) -> None:
        """OPD / Combine dispatch (OpenClaw-RL §4-5, with the hint and eval votes run concurrently).

        | hint accepted | score ±1 | sample                                     |
        |---------------|----------|--------------------------------------------|
        | yes           | yes      | teacher log-probs and the reward            |
        | yes           | no       | teacher log-probs, reward 0                 |
        | no            | yes      | reward only; no OPD term (no teacher)       |
        | no            | no       | none (``dropped/no_signal``)                |

        OPD uses only the first column: no accepted hint -> ``dropped/no_hint``.
        """
        combine = self.algo == "combine"
        try:
            calls = [judge.hint.remote(turn, next_state, self.opd["accept"], self.opd["min_hint_chars"])]
            if combine:
                calls.append(judge.judge.remote(turn, next_state))
            results = await asyncio.gather(*calls)
        except Exception as e:  # a dead judge loses the turn, not the tracker
            self.counts["dropped/judge_error"] += 1
            self._record(turn, next_state, None, f"judge error: {e!r}")
            return
        hint = results[0].hint
        score = results[1].score if combine else 0
        self.counts["judged"] += 1
        self.counts["hints_accepted"] += int(hint is not None)
        case = ("hint" if hint else "nohint") + ("+score" if score else "")
        self.counts[f"dispatch/{case}"] += 1
        if hint is None and (not combine or score == 0):
            reason = "no_signal" if combine else "no_hint"
            self.counts[f"dropped/{reason}"] += 1
            self._record(turn, next_state, results[-1], reason, hint=None)
            return
        teacher, topk = None, None
        if hint is not None:
            worker = self.teachers[self._rr % len(self.teachers)]
            try:
                if self.opd["topk"] > 0:
                    topk = await worker.teacher_topk.remote(turn, hint, self.opd["topk"])
                else:
                    teacher = await worker.teacher_logprobs.remote(turn, hint)
            except Exception as e:  # no zeros in place of teacher log-probs: the turn is dropped
                self.counts["dropped/teacher_error"] += 1
                self._record(turn, next_state, results[-1], f"teacher error: {e!r}", hint=hint)
                return
        self._record(turn, next_state, results[-1], None, hint=hint)
        sample = Sample.from_turn(turn, reward=float(score) if combine else None, kind=self.algo, hint=hint)
        sample.teacher_logprobs = teacher
        if topk is not None:
            sample.teacher_topk_logprobs, sample.teacher_topk_ids = topk
        await self.queue.put.remote([ray.put(sample)], sample.policy_version)
        self.counts["samples"] += 1

    async def _emit(self, s: _Session, turn: Turn, reward: float) -> None:
        s.effective = True
        sample = Sample.from_turn(turn, reward=reward, kind="rl")
        await self.queue.put.remote([ray.put(sample)], sample.policy_version)
        self.counts["samples"] += 1

    def _record(self, turn: Turn, next_state: list, result: Any, dropped: str | None, **extra: Any) -> None:
        if self.records_path is None:
            return
        row = {**extra, "session_id": turn.session_id, "turn": turn.turn_index, "policy_version": turn.policy_version,
               "response": turn.response_message, "next_state": next_state,
               "score": getattr(result, "score", None), "votes": getattr(result, "votes", None),
               "raw_votes": getattr(result, "raw", None), "dropped": dropped}
        with open(self.records_path, "a") as f:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")

    async def pending_turn(self, session_id: str) -> Turn | None:
        """The session's latest turn, still waiting for its next state (None if none)."""
        s = self.sessions.get(session_id)
        return None if s is None else s.pending

    async def drain(self, timeout_s: float = 60.0) -> int:
        """Wait until in-flight judge tasks finish; returns how many were still running at the timeout."""
        if self.tasks:
            await asyncio.wait(list(self.tasks), timeout=timeout_s)
        return len(self.tasks)

    async def stats(self) -> dict:
        """Counters (turns, judged, samples, score/*, dropped/*) plus open sessions and judging tasks."""
        return {**self.counts, "open_sessions": len(self.sessions), "judging": len(self.tasks)}


def _same_reply(history_msg: dict[str, Any], response: dict[str, Any]) -> bool:
    """Whether the history's assistant message is the reply we served (text, or tool-call names)."""
    if (history_msg.get("content") or "").strip() != (response.get("content") or "").strip():
        return False
    names = lambda m: [c["function"]["name"] for c in m.get("tool_calls") or []]  # noqa: E731
    return names(history_msg) == names(response)


SessionTrackerActor = ray.remote(SessionTracker)
