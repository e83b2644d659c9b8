"""The credit ledger: judged turns waiting for their session's return (no Ray; the SessionTracker's).

Owns: every session's waiting turns, when they are released (the close, or the staleness budget), the
shaping of a judged turn's reward and ``dropped/zero_return``. Must not: compute returns
(:mod:`clawray.algos.credit`), or emit a sample, apply the at-least-one rule or write the journal itself
(the tracker's callables do).

:mod:`clawray.algos.credit` says what each judged turn's return *is* (pure functions); this module
keeps the state that decides *when* it is computed, for ``trainer.credit`` ``discounted`` and
``outcome``: a judged turn that carries a reward does not go to the queue at once but *waits* in its
session's :class:`SessionCredit` (``credit/turns_waiting``) until the session closes
(``X-Session-Done`` or ``session.idle_timeout_s``); then every waiting turn gets its return
(:func:`~clawray.algos.credit.segment_credit`) and is emitted. The staleness budget releases a
session's waiting turns early as a segment (:func:`~clawray.algos.credit.must_flush`,
``credit/forced_flushes``): the ledger learns the engines' policy version from the turns the tracker
records. Dense shaping terms (:mod:`clawray.algos.shaping`) are added to a judged turn's reward
before it waits (:meth:`CreditLedger.shape`).

Invariants:
  * a released turn is emitted once, dropped (``dropped/zero_return``), or handed back to the
    at-least-one rule (a 0-scored turn whose return is exactly 0): never two of these;
  * ``n_waiting`` equals the number of samples in every live :class:`SessionCredit` (restored ones
    are counted with :meth:`CreditLedger.restored`);
  * every change that must survive a restart is journaled through the ``journal`` callable
    (``outcome``, ``released``) before the call that made it returns; the waiting sample itself is
    journaled by the tracker with its ``judged`` record.

The emission and the at-least-one rule stay with the tracker: :meth:`CreditLedger.release` takes
``emit`` (an async callable putting one sample in the queue) and ``hold`` (giving a zero-return turn
back to the at-least-one rule) from it.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

from clawray.algos.credit import CREDIT_MODES, must_flush, segment_credit
from clawray.algos.shaping import check_terms, shaping_terms
from clawray.types import Sample, Turn

Emit = Callable[[Sample], Awaitable[None]]
Hold = Callable[[Sample, float], None]


@dataclass
class SessionCredit:
    """One session's credit state.

    Attributes:
        waiting: judged samples awaiting their return (credit != ``turn``), in judgement order; each
            keeps its held mean vote (0-scored turns) in ``info["held_vote"]`` while it waits.
        outcome: the session's outcome (``X-Session-Outcome``, the last one given, or the outcome
            judge's score), or None.
        transcript: what the outcome judge reads (the last request's history plus its reply); kept
            only when :attr:`CreditLedger.judges_outcomes`.
    """

    waiting: list[Sample] = field(default_factory=list)
    outcome: float | None = None
    transcript: list = field(default_factory=list)


def _no_journal(op: str, **fields: Any) -> None:
    return None


class CreditLedger:
    """Waiting turns, shaping and the flush-on-staleness rule of one run's sessions.

    Args:
        mode: ``trainer.credit``: ``"turn"`` (emit at once), ``"discounted"`` or ``"outcome"``.
        gamma: ``trainer.gamma``, the discount in [0, 1].
        outcome_turn_weight: ``trainer.outcome_turn_weight`` (``outcome`` mode's weight of ``r_t``).
        max_staleness: ``queue.max_staleness`` in policy versions (the flush budget).
        outcome_judge: ``trainer.outcome_judge``: a session closed with waiting turns and no explicit
            outcome is scored once as a whole by a judge (the tracker asks; see
            :attr:`judges_outcomes`).
        shaping: ``{term: weight}`` of the dense shaping terms (``trainer.shaping``; weight 0 = off).
        counts: the tracker's counters (``credit/*``, ``dropped/zero_return`` are added to them).
        journal: ``journal(op, **fields)`` appends one session-journal record (default: none).

    Raises:
        ValueError: an unknown credit mode or shaping term.
    """

    def __init__(
        self,
        mode: str = "turn",
        gamma: float = 0.9,
        outcome_turn_weight: float = 0.0,
        max_staleness: int = 2,
        outcome_judge: bool = False,
        shaping: dict | None = None,
        counts: Counter | None = None,
        journal: Callable[..., None] = _no_journal,
    ):
        if mode not in CREDIT_MODES:
            raise ValueError(f"unknown credit mode {mode!r}; expected one of {list(CREDIT_MODES)}")
        self.mode, self.gamma, self.turn_weight, self.max_staleness = mode, gamma, outcome_turn_weight, max_staleness
        self.outcome_judge = bool(outcome_judge)
        self.shaping = {k: float(w) for k, w in (shaping or {}).items() if w}
        check_terms(self.shaping)
        self.counts = Counter() if counts is None else counts
        self.journal = journal
        self.served_version = -1  # the newest policy version seen on a recorded turn (the engines')
        self.learner_version: int | None = None  # the learners' version, when the driver told it (learned)
        self.n_waiting = 0

    @property
    def defers(self) -> bool:
        """Whether rewarded turns wait for their session's return (``mode`` is not ``turn``)."""
        return self.mode != "turn"

    @property
    def judges_outcomes(self) -> bool:
        """Whether closed sessions without an explicit outcome are scored by the outcome judge."""
        return self.outcome_judge and self.defers

    def needs_judge(self, sc: SessionCredit) -> bool:
        """Whether this session, now closing, is to be scored by the outcome judge: turns wait, no
        explicit outcome was given and a transcript was kept."""
        return self.judges_outcomes and bool(sc.waiting) and sc.outcome is None and bool(sc.transcript)

    def shape(
        self, turn: Turn, sample: Sample | None, held: float | None, promote: Callable[[Turn, float], Sample]
    ) -> tuple[Sample | None, float | None]:
        """Add the shaping terms to a judged turn's reward: ``(sample, held mean vote)``.

        A held (0-scored) turn becomes a sample (``promote(turn, 0.0)``) with the terms' sum as its
        reward when that sum is not 0, or, when turns wait (:attr:`defers`), always, to wait for its
        return with reward 0; its held vote then stays beside it (else the vote is spent). An unscored
        sample (``info["unscored"]``: Combine's hint without a score) takes reward 0 plus the terms on
        the same rule, keeping its teacher log-probs, and else stays without a reward.

        Args:
            sample: the algorithm's sample, or None; its ``reward`` None = no reward (pure OPD, or unscored).
            held: the mean vote of a 0-scored turn held for the at-least-one rule, or None.
            promote: the algorithm's ``promote`` (a turn and a reward -> a sample).
        """
        rewarded = sample is not None and sample.reward is not None
        unscored = sample is not None and not rewarded and bool(sample.info.get("unscored"))
        if not rewarded and held is None and not unscored:
            return sample, held
        terms = shaping_terms(turn, self.shaping) if self.shaping else {}
        total = sum(terms.values())
        if not rewarded:
            if total == 0.0 and not self.defers:
                return (sample if unscored else None), held
            sample = sample if unscored else promote(turn, 0.0)  # an unscored sample keeps its teacher
            sample.reward = 0.0
        sample.reward = float(sample.reward) + total
        if terms:
            sample.info["shaping"] = terms
        return sample, (held if self.defers else None)

    def wait(self, sc: SessionCredit, sample: Sample | None, held: float | None) -> bool:
        """Keep a judged sample waiting in its session when turns wait and it carries a reward;
        returns whether it waits (else the tracker emits or holds it)."""
        if not self.defers or sample is None or sample.reward is None:
            return False
        sample.info["held_vote"] = held  # a zero return falls back to the at-least-one rule
        sc.waiting.append(sample)
        self.n_waiting += 1
        return True

    def restored(self, sc: SessionCredit) -> None:
        """Count the waiting samples of a session rebuilt from the journal."""
        self.n_waiting += len(sc.waiting)

    def set_outcome(self, sc: SessionCredit, sid: str, outcome: float, last: int | None = None) -> None:
        """Store session ``sid``'s outcome, explicit or judged (journaled as ``outcome``; ``last``, the
        session's last turn index, tells the journal which session of a reused id it is)."""
        sc.outcome = float(outcome)
        self.journal("outcome", sid=sid, value=sc.outcome, last=last)

    def served(self, version: int) -> bool:
        """Note that the engines served policy ``version``; True when it is newer than any seen so far
        (then every session's waiting turns may have to go: :meth:`maybe_flush`)."""
        if version <= self.served_version:
            return False
        self.served_version = version
        return True

    def learned(self, version: int) -> bool:
        """Note the learners' policy version (the next update produces ``version + 1``); True when it
        changed (then every session's waiting turns may have to go: :meth:`maybe_flush`). It sets the
        flush deadline from then on: the engines' version lags it while syncs fail, and stays above
        it after a rollback (the promotion gate's rejection)."""
        changed, self.learner_version = version != self.learner_version, int(version)
        return changed

    def session_closed(self, requests: int) -> None:
        """Count a closed session and its main-line requests (``credit/mean_session_turns``)."""
        self.counts["credit/sessions"] += 1
        self.counts["credit/session_turns"] += requests

    async def maybe_flush(self, sc: SessionCredit, sid: str, emit: Emit, hold: Hold) -> None:
        """Release a session's waiting turns before its end when the staleness budget forces it
        (:func:`~clawray.algos.credit.must_flush` on the oldest waiting turn's policy version and the
        learners' version, :meth:`learned`; the engines' newest until the driver has told it)."""
        current = self.served_version if self.learner_version is None else self.learner_version
        if sc.waiting and must_flush(min(w.policy_version for w in sc.waiting), current, self.max_staleness):
            self.counts["credit/forced_flushes"] += 1
            await self.release(sc, sid, False, emit, hold)

    async def release(self, sc: SessionCredit, sid: str, closed: bool, emit: Emit, hold: Hold) -> None:
        """Give the waiting turns their returns (:func:`~clawray.algos.credit.segment_credit`, the
        session's outcome only when ``closed``) and emit them in turn order; a zero return hands a held
        turn back to the at-least-one rule (``hold``), any other turn without a teacher term is dropped
        (``dropped/zero_return``). Journals ``released`` (the turn indexes and the handed-back turns).

        Each released sample keeps its own (shaped) reward in ``info["turn_reward"]`` and, in
        ``outcome`` mode at the close, the session's score in ``info["outcome"]``.
        """
        entries = sorted(sc.waiting, key=lambda w: w.turn_index)
        sc.waiting = []
        self.n_waiting -= len(entries)
        outcome = sc.outcome if closed else None
        rewards = [float(w.reward) for w in entries]
        returns = segment_credit(self.mode, rewards, self.gamma, outcome, self.turn_weight, closed)
        scored = closed and self.mode == "outcome"  # the session's score: its outcome, else the last reward
        session_score = (rewards[-1] if outcome is None else outcome) if scored else None
        if scored:
            self.counts["credit/outcome_sum"] += session_score
            self.counts["credit/outcome_sessions"] += 1
        held_back = []
        for sample, g in zip(entries, returns):
            sample.info["turn_reward"], sample.reward = sample.reward, g
            if scored:
                sample.info["outcome"] = session_score
            vote = sample.info.pop("held_vote", None)
            if g != 0.0 or sample.teacher_logprobs is not None or sample.teacher_topk_ids is not None:
                await emit(sample)
            elif vote is not None:
                hold(sample, vote)
                held_back.append([dict(sample.__dict__), vote])
            else:
                self.counts["dropped/zero_return"] += 1
        self.journal("released", sid=sid, turn_indexes=[w.turn_index for w in entries], held=held_back)

    def stats(self) -> dict[str, float]:
        """``credit/turns_waiting`` (now), ``credit/mean_session_turns`` (main-line requests per closed
        session) and ``credit/outcome_mean`` (``outcome`` mode's session scores), the last two only
        once they have a value."""
        c = self.counts
        out: dict[str, float] = {"credit/turns_waiting": self.n_waiting}
        if c["credit/sessions"]:
            out["credit/mean_session_turns"] = c["credit/session_turns"] / c["credit/sessions"]
        if c["credit/outcome_sessions"]:
            out["credit/outcome_mean"] = c["credit/outcome_sum"] / c["credit/outcome_sessions"]
        return out
