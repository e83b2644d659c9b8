"""The algorithms: what turns one judged turn into a training sample (Binary RL, OPD, Combine).

Owns: each algorithm's verdict rules, what it needs from the run, and the registry (:func:`register`).
Must not: import Ray or the config, name an actor method, or keep the sessions, the pairing with next
states, the at-least-one rule, the records or the emission into the queue (the
:class:`~clawray.actors.session.SessionTracker`'s).

An :class:`Algorithm` takes a main-line turn and its next state (the messages that followed it)
and returns a :class:`Verdict`: a :class:`~clawray.types.Sample` to train on, a 0-score turn to hold
for the at-least-one rule, or a drop reason. The judge and the teacher reach it as async callables
(:class:`WorkerCalls`), so it is tested with plain fakes.

What each algorithm needs from the run is declared on its class (``needs_teacher``, ``judge_calls``,
``with_reward``, the learner loss term its samples train, :meth:`Algorithm.term`, and
:meth:`Algorithm.loss_weights`), so the run builds teachers only for the algorithms that use them
(:func:`clawray.actors.teacher.build_teachers`) and asks the teacher for what the term needs.
A new variant is one subclass registered with :func:`register` (see ``docs/architecture.md``).

Invariants:
  * every turn gets exactly one verdict: a sample, held, or one ``drop`` reason (counted by the
    tracker as ``dropped/<reason>``);
  * never zeros in place of teacher log-probs: a failed or silent teacher drops the turn, or (Combine
    with a score) keeps the reward term alone.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, ClassVar, Protocol

from clawray.types import Sample, Turn

JudgeFn = Callable[[Turn, list], Awaitable[Any]]
"""``judge(turn, next_state) -> JudgeResult`` (``score`` in {1, -1, 0}, ``votes``, ``raw``)."""
HintFn = Callable[[Turn, list, str, int], Awaitable[Any]]
"""``hint(turn, next_state, accept, min_hint_chars) -> HintResult`` (``hint``: str or None)."""
TeacherFn = Callable[[Turn, str], Awaitable[list]]
"""``teacher_logprobs(turn, hint) -> [R]`` teacher log-probs of the turn's response ids."""
TeacherTopkFn = Callable[[Turn, str, int], Awaitable[tuple]]
"""``teacher_topk(turn, hint, k) -> ([R, k] log-probs, [R, k] ids)``."""


class OPDSection(Protocol):
    """What an algorithm with a teacher reads of the ``opd`` config section
    (:class:`~clawray.config.OPDConfig`, whose fields hold the defaults; this module imports no config)."""

    accept: str  # "any" or "majority" of the hint votes
    min_hint_chars: int  # shorter hints are not accepted
    max_hints: int  # accepted hints the teacher scores per turn (> 1: their mixture, mix_teachers)
    loss: str  # "advantage" or "topk": the term of algorithms whose term depends on it (Algorithm.term)
    topk: int  # k of top-k distillation, asked of the teacher only when the term is topk_kl
    teacher_timeout_s: float  # seconds to wait for the teacher


@dataclass
class WorkerCalls:
    """The judge and teacher calls an algorithm may make for one turn (async callables; the tracker
    binds them to its JudgeWorker / TeacherWorker actors, tests to plain fakes)."""

    judge: JudgeFn | None = None
    hint: HintFn | None = None
    teacher_logprobs: TeacherFn | None = None
    teacher_topk: TeacherTopkFn | None = None


@dataclass
class Verdict:
    """What an algorithm made of one turn.

    Attributes:
        sample: the sample to emit, or None.
        held: the mean of the valid votes of a 0-scored turn held for the at-least-one rule, or None.
        drop: the reason the turn is not trained (counted as ``dropped/<drop>``), or None.
        result: the judge's result, for the judgment record (None when the judge failed).
        note: the record's ``dropped`` text when it differs from ``drop`` (``"held"``, the error).
        extra: more fields of the judgment record (``hint``, ``teacher_error``).
    """

    sample: Sample | None = None
    held: float | None = None
    drop: str | None = None
    result: Any = None
    note: str | None = None
    extra: dict = field(default_factory=dict)

    @property
    def record_note(self) -> str | None:
        """The judgment record's ``dropped`` field."""
        return self.note if self.note is not None else self.drop


class Algorithm:
    """Base class: turns a turn and its next state into a :class:`Verdict`.

    Class attributes:
        name: the ``trainer.algo`` value and each sample's ``kind``.
        needs_teacher: the run must build at least one teacher (``opd.teacher``).
        judge_calls: which judge calls it makes (``"judge"``: PRM score votes; ``"hint"``: hint votes).
        with_reward: its samples carry a reward (pure OPD's do not).
        loss_term: the learner term its samples train (:meth:`term`): ``"ppo"``, the PPO clip loss on
            the token advantage (:func:`clawray.algos.losses.ppo_clip_loss`), or ``"topk_kl"``, the top-k
            reverse KL to the teacher (:func:`clawray.algos.losses.topk_reverse_kl`) as the teacher
            term, beside the PPO loss of the reward term (Combine's; 0 for pure OPD).
    """

    name: ClassVar[str] = ""
    needs_teacher: ClassVar[bool] = False
    judge_calls: ClassVar[tuple[str, ...]] = ("judge",)
    with_reward: ClassVar[bool] = True
    loss_term: ClassVar[str] = "ppo"

    @classmethod
    def term(cls, loss: str = "advantage") -> str:
        """The learner loss term of this algorithm's samples under ``opd.loss`` = ``loss``:
        :attr:`loss_term` unless a subclass lets ``opd.loss`` choose."""
        return cls.loss_term

    async def verdict(self, turn: Turn, next_state: list[dict], calls: WorkerCalls, counts: Counter) -> Verdict:
        """The verdict for ``turn``; adds its counters (``judged``, ``score/*``, ...) to ``counts``.

        Never raises for a failing judge or teacher: that is a drop reason.
        """
        raise NotImplementedError

    def promote(self, turn: Turn, mean_vote: float) -> Sample:
        """The sample of a held turn promoted by the at-least-one rule (reward = its mean vote)."""
        return Sample.from_turn(turn, reward=mean_vote, kind="rl")

    @classmethod
    def loss_weights(cls, w_rl: float, w_opd: float) -> tuple[float, float]:
        """``(w_rl, w_opd)`` of the learner's advantage mix ``w_rl * a + w_opd * (teacher - rollout)``
        given the configured ``opd.w_rl`` / ``opd.w_opd``."""
        return 1.0, w_opd


def mix_teachers(logprobs: list[list[float]]) -> list[float]:
    """The per-token log-probs of the uniform mixture of K hinted teachers.

    ``log((1/K) * sum_k exp(l_k[t]))`` for each response token t: every accepted hint is taken as an
    equally likely account of what the user wanted, and the teacher is their average distribution
    (ensemble distillation averages the teachers' probabilities: Hinton, Vinyals & Dean 2015,
    "Distilling the Knowledge in a Neural Network", §2). A mixture is itself a distribution, and
    never below the geometric mean of the K (Jensen), so one hint that the sampled token fits keeps
    its log-prob within ``log K`` of that hint's: OPD's advantage ``teacher - rollout`` is not pushed
    down by a hint that is silent about the token. K = 1 returns the one teacher's log-probs.

    Args:
        logprobs: K lists of R teacher log-probs (nats), one per hint, same response tokens.

    Raises:
        ValueError: no teacher, or lists of different lengths.
    """
    import math

    if not logprobs or len({len(lp) for lp in logprobs}) != 1:
        raise ValueError(
            f"mix_teachers needs K >= 1 teachers of one length, got lengths {[len(lp) for lp in logprobs]}"
        )
    if len(logprobs) == 1:
        return list(logprobs[0])
    log_k = math.log(len(logprobs))
    out = []
    for column in zip(*logprobs):
        top = max(column)
        out.append(top + math.log(sum(math.exp(v - top) for v in column)) - log_k)
    return out


REGISTRY: dict[str, type[Algorithm]] = {}


def register(cls: type[Algorithm]) -> type[Algorithm]:
    """Class decorator: make ``cls`` available as ``trainer.algo = cls.name``."""
    REGISTRY[cls.name] = cls
    return cls


def make_algorithm(name: str, opd: OPDSection | None = None) -> Algorithm:
    """The algorithm registered as ``name`` (``trainer.algo``), built with its options.

    Args:
        name: ``"rl"``, ``"opd"``, ``"combine"`` or another registered name.
        opd: the ``opd`` config section (:class:`OPDSection`); ignored by algorithms without a teacher.

    Raises:
        ValueError: no algorithm has that name, or one that needs a teacher got no ``opd`` section.
    """
    if name not in REGISTRY:
        raise ValueError(f"unknown algorithm {name!r}; expected one of {sorted(REGISTRY)}")
    cls = REGISTRY[name]
    if not cls.needs_teacher:
        return cls()
    if opd is None:
        raise ValueError(f"algorithm {name!r} needs a teacher: pass its opd config section")
    return cls(opd)


def algorithm_class(name: str) -> type[Algorithm]:
    """The registered class (what a run must build for it), without building it.

    Raises:
        ValueError: no algorithm has that name.
    """
    if name not in REGISTRY:
        raise ValueError(f"unknown algorithm {name!r}; expected one of {sorted(REGISTRY)}")
    return REGISTRY[name]


@register
class BinaryRL(Algorithm):
    """Binary RL (OpenClaw-RL, arXiv 2603.10165 §3, with clawray's fixes).

    score +1/-1 -> a sample with that reward; score 0 -> held for the at-least-one rule with the mean
    of its valid votes; every vote invalid -> ``unscored``; a failing judge -> ``judge_error``.
    """

    name = "rl"

    async def verdict(self, turn: Turn, next_state: list[dict], calls: WorkerCalls, counts: Counter) -> Verdict:
        try:
            result = await calls.judge(turn, next_state)
        except Exception as e:  # a dead judge loses the turn, not the tracker
            return Verdict(drop="judge_error", note=f"judge error: {e!r}")
        counts["judged"] += 1
        counts[f"score/{result.score}"] += 1
        valid = [v for v in result.votes if v is not None]
        if not valid:
            return Verdict(drop="unscored", result=result)
        score = self.reward_score(result.score, valid)
        if score == 0:  # held for the at-least-one rule until the session closes
            return Verdict(held=sum(valid) / len(valid), result=result, note="held")
        return Verdict(sample=Sample.from_turn(turn, reward=float(score), kind="rl"), result=result)

    def reward_score(self, score: int, valid: list[int]) -> int:
        """The score a sample is trained with, from the judge's majority ``score`` and its ``valid``
        votes; 0 holds the turn for the at-least-one rule. Binary RL: the majority itself."""
        return score


@register
class UnanimousRL(BinaryRL):
    """Binary RL on unanimous judgments only, for a noisy PRM judge (``judge.m`` >= 3 votes).

    A +1/-1 majority that some valid vote disputes (votes ``1, 1, -1`` or ``1, 1, 0``) is not trained
    at full strength: it is held like a 0 score, so the at-least-one rule may still promote it with
    the mean of its votes (``1/3``, ``2/3``). Invalid votes do not count: ``1, None, 1`` trains +1.
    Fewer labels, fewer wrong ones (precision over recall). The samples are Binary RL's (``kind="rl"``).
    """

    name = "rl_unanimous"

    def reward_score(self, score: int, valid: list[int]) -> int:
        return score if all(v == score for v in valid) else 0


@register
class OPD(Algorithm):
    """On-policy distillation from hindsight hints (OpenClaw-RL §4).

    The hint judge extracts a hint from the next state; the teacher scores the turn's own response
    ids under the hinted prompt: its log-probs (term ``ppo``: ``A_t = teacher - rollout``), or its
    top-k (term ``topk_kl``, with ``opd.loss: topk``). With ``opd.max_hints`` K > 1 it scores under
    each of up to K accepted hints and the teacher is their per-token mixture (:func:`mix_teachers`;
    a hint whose call fails is left out). No accepted hint -> ``no_hint``; every teacher call failed
    or gave no answer within ``teacher_timeout_s`` (each counted in ``teacher_errors``) ->
    ``teacher_error``. The samples carry no reward.

    Args:
        opd: the ``opd`` config section (:class:`OPDSection`); ``topk`` is asked of the teacher only
            when :meth:`term` is ``topk_kl`` (else ``self.topk`` is 0: token log-probs).
    """

    name = "opd"
    needs_teacher = True
    judge_calls = ("hint",)
    with_reward = False

    @classmethod
    def term(cls, loss: str = "advantage") -> str:
        """``topk_kl`` under ``opd.loss: topk``, else :attr:`loss_term`."""
        return "topk_kl" if loss == "topk" else cls.loss_term

    def __init__(self, opd: OPDSection):
        self.accept, self.min_hint_chars, self.teacher_timeout_s = opd.accept, opd.min_hint_chars, opd.teacher_timeout_s
        self.topk = opd.topk if self.term(opd.loss) == "topk_kl" else 0
        self.max_hints = 1 if self.topk else getattr(opd, "max_hints", 1)  # no top-k mixture (the config refuses it)

    async def verdict(self, turn: Turn, next_state: list[dict], calls: WorkerCalls, counts: Counter) -> Verdict:
        """Dispatch (OpenClaw-RL §4-5, with the hint and eval votes run concurrently):

        | hint accepted | score ±1 | sample                                     |
        |---------------|----------|--------------------------------------------|
        | yes           | yes      | teacher log-probs and the reward            |
        | yes           | no       | teacher log-probs, no reward (``None``)     |
        | no            | yes      | reward only; no OPD term (no teacher)       |
        | no            | no       | none (``dropped/no_signal``)                |

        A hint without a score has no reward term: reward None (advantage 0 under every estimator, never
        rejected as a zero-variance group), marked ``info["unscored"]`` so the credit ledger may still
        give it shaping and its session's return. OPD uses only the first column: no accepted hint ->
        ``dropped/no_hint``. When the teacher fails
        or gives no answer, a Combine turn with a score keeps its reward term alone; any other turn is
        dropped (``dropped/teacher_error``).
        """
        combine = self.with_reward
        try:
            asked = [calls.hint(turn, next_state, self.accept, self.min_hint_chars)]
            if combine:
                asked.append(calls.judge(turn, next_state))
            results = await asyncio.gather(*asked)
        except Exception as e:  # a dead judge loses the turn, not the tracker
            return Verdict(drop="judge_error", note=f"judge error: {e!r}")
        hint = results[0].hint
        score = results[1].score if combine else 0
        counts["judged"] += 1
        counts["hints_accepted"] += int(hint is not None)
        case = ("hint" if hint else "nohint") + ("+score" if score else "")
        counts[f"dispatch/{case}"] += 1
        if hint is None and (not combine or score == 0):
            return Verdict(drop="no_signal" if combine else "no_hint", result=results[-1], extra={"hint": None})
        teacher, topk, failure, used = None, None, {}, []
        if hint is not None:
            hints = (getattr(results[0], "hints", None) or [hint])[: self.max_hints]
            answers = await asyncio.gather(*(self._ask_teacher(turn, h, calls) for h in hints), return_exceptions=True)
            errors = [a for a in answers if isinstance(a, BaseException)]
            if errors:
                counts["teacher_errors"] += len(errors)  # one per failed teacher call
            used = [h for h, a in zip(hints, answers) if not isinstance(a, BaseException)]
            answers = [a for a in answers if not isinstance(a, BaseException)]
            if not answers:  # never zeros in place of teacher log-probs
                if not (combine and score):  # nothing left to train on: the turn is dropped
                    return Verdict(
                        drop="teacher_error",
                        note=f"teacher error: {errors[0]!r}",
                        result=results[-1],
                        extra={"hint": hint},
                    )
                failure = {"teacher_error": repr(errors[0])}  # Combine with a score: the reward term alone
            elif self.topk > 0:
                topk = answers[0]
            else:
                teacher = mix_teachers([list(a) for a in answers])
            if len(used) > 1:
                counts["hint_mixtures"] += 1  # turns whose teacher is a mixture of several hints
        info = {"hint": used[0] if used else None} | ({"hints": used} if len(used) > 1 else {})
        if combine and not score:
            info["unscored"] = True  # a Combine turn the PRM did not score (see the table)
        sample = Sample.from_turn(turn, reward=float(score) if combine and score else None, kind=self.name, **info)
        sample.teacher_logprobs = teacher
        if topk is not None:
            sample.teacher_topk_logprobs, sample.teacher_topk_ids = topk
        extra = {"hint": hint} | ({"hints": used} if len(used) > 1 else {})
        return Verdict(sample=sample, result=results[-1], extra={**extra, **failure})

    async def _ask_teacher(self, turn: Turn, hint: str, calls: WorkerCalls) -> Any:
        """The teacher's answer within ``teacher_timeout_s``.

        Raises:
            TimeoutError: no answer in time; whatever the teacher raised.
        """
        call = calls.teacher_topk(turn, hint, self.topk) if self.topk > 0 else calls.teacher_logprobs(turn, hint)
        try:
            return await asyncio.wait_for(call, self.teacher_timeout_s)
        except asyncio.TimeoutError:
            raise TimeoutError(f"the teacher gave no answer in {self.teacher_timeout_s:g} s") from None


@register
class Combine(OPD):
    """Binary RL + OPD in one update (OpenClaw-RL §5): hint and PRM votes run concurrently; the
    advantage is ``w_rl * r + w_opd * (teacher - rollout)`` (no OPD term without an accepted hint)."""

    name = "combine"
    judge_calls = ("hint", "judge")
    with_reward = True

    @classmethod
    def loss_weights(cls, w_rl: float, w_opd: float) -> tuple[float, float]:
        return w_rl, w_opd


@register
class OPDTopK(OPD):
    """OPD whose samples always train the top-k reverse KL to the hinted teacher (SDFT/SDPO-style
    distillation, :func:`clawray.algos.losses.topk_reverse_kl`) with ``opd.topk`` ids per token,
    whatever ``opd.loss`` says: ``trainer.algo=opd_topk`` is ``trainer.algo=opd opd.loss=topk``."""

    name = "opd_topk"
    loss_term = "topk_kl"

    @classmethod
    def term(cls, loss: str = "advantage") -> str:
        return cls.loss_term
