"""OPD's premise check: with the user's hint, does the teacher do what the user wanted?

Owns: the probe below, its verdict and what each ``opd.premise_check`` mode does with it
(:func:`premise_action`). Must not: train, stop the run itself (:mod:`clawray.build` raises
:class:`PremiseRefused`) or implement the sign test (:func:`clawray.promotion.sign_test_p`).

On-policy distillation pulls the policy towards the teacher reading a hindsight hint
(``A_t = teacher_logprob_t - rollout_logprob_t``, OpenClaw-RL, arXiv 2603.10165, §4; on-policy it is
a reverse KL to the hinted teacher, Agarwal et al. 2024, arXiv 2306.13649). That can only teach when
the hinted teacher is better at the user's task than the policy. A model that cannot read a hint is
not: SmolLM2-135M-Instruct, its own teacher on the CPU demo, echoes the hint ("Please redo it as
just: ...") instead of following it, and the ``opd`` preset took the demo from 22% to 3% solved
(issue #28). This module measures the premise before any training, on the job's own environment,
hint judge and teacher.

Probe, for each of the first ``num_prompts`` tasks of ``env.prompts("eval", seed)``:

1. the policy samples one reply to the opening message (rendered as the evaluation renders it,
   :class:`clawray.evaluation.Evaluator`; seeded, so the probe is repeatable);
2. a reply the simulated user accepts is skipped (no correction, no hint); otherwise the user's
   correction (``env.feedback``) goes to the job's hint judge, exactly as a live next state would;
   a turn whose hint is not accepted is skipped;
3. **follow**: the teacher samples ``follow_n`` replies after the sampled prompt with the hint
   inserted (:meth:`TeacherWorker.teacher_prompt_ids`, the very prompt OPD scores under) and
   ``follow_n`` without it (same seeds); the user's check grades each. ``d_i`` = solved share with
   the hint - without;
4. **preferred reply**: the teacher scores the environment's preferred reply
   (:meth:`Environment.preferred_reply`, its tokens + the stop token) with and without the hint;
   ``delta_i`` = the mean over its tokens of ``hinted - plain`` (nats/token). A hint that spells out
   the answer raises it even in a teacher that cannot follow the hint (SmolLM2: +0.81), so this is
   reported beside the verdict, and decides it only when the teacher cannot sample (an endpoint).

The verdict is an exact one-sided sign test on the signs of ``d_i`` (Dixon & Mood 1946, JASA 41:557;
the test of :func:`clawray.promotion.sign_test_p`): ``informative`` when the hint helps
significantly often (p < ``alpha``), ``anti-informative`` when it hurts significantly often, else
``inconclusive``; ``unmeasured`` with fewer than ``min_items`` hinted turns.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Protocol

from clawray.config import is_endpoint
from clawray.engines.base import GenerateRequest
from clawray.envs.base import Environment
from clawray.evaluation import Evaluator
from clawray.promotion import sign_test_p
from clawray.types import Turn

VERDICTS = ("informative", "anti-informative", "inconclusive", "unmeasured")


class Teacher(Protocol):
    """What the probe asks of the teacher (the job's :class:`~clawray.actors.teacher.TeacherWorker`
    and its engine, :func:`probe_actors`)."""

    def prompt_ids(self, turns: list[Turn], hints: list[str]) -> list[list[int]]:
        """The hinted teacher prompt of each turn (``""``: its prompt ids as sampled)."""

    def logprobs(self, turns: list[Turn], hints: list[str]) -> list[list[float]]:
        """Teacher log-probs of each turn's ``response_ids`` after its hinted prompt (length R each)."""

    def generate(self, requests: list[GenerateRequest]) -> list[Any] | None:
        """The teacher's replies (``GenerateOutput`` or dicts with ``response_ids``); None when it
        cannot sample (an endpoint that only scores)."""


@dataclass
class PremiseItem:
    """One probed task: the policy's reply, the accepted hint, the teacher's replies with and without
    it (``solved_hinted``/``solved_plain``: shares solved, None when the teacher cannot sample) and
    its log-probs of the preferred reply (``tokens`` long; means over its tokens, nats/token)."""

    question: str
    reply: str
    hint: str
    solved_plain: float | None
    solved_hinted: float | None
    preferred: str = ""
    tokens: int = 0
    plain: float = 0.0  # mean teacher log-prob of the preferred reply without the hint
    hinted: float = 0.0  # ... with the hint

    @property
    def follow(self) -> float | None:
        """``solved_hinted - solved_plain`` (None when not measured)."""
        return None if self.solved_hinted is None else self.solved_hinted - (self.solved_plain or 0.0)

    @property
    def delta(self) -> float | None:
        """``hinted - plain`` on the preferred reply, nats/token (None without a preferred reply)."""
        return self.hinted - self.plain if self.tokens else None


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


@dataclass
class PremiseResult:
    """The probe's outcome.

    Attributes:
        verdict: one of :data:`VERDICTS`; ``measure``: what decided it, ``"follow"`` or ``"preferred"``.
        items: the hinted turns.
        probed: tasks sampled; ``solved``: of them, accepted by the user (no hint to read);
            ``unhinted``: corrected, but the judge accepted no hint.
        p_helps / p_hurts: one-sided sign-test p-values that the hint helps / hurts (1.0 without items).
        seconds: the probe's wall time. reason: why the verdict is ``unmeasured`` ("" otherwise).
    """

    verdict: str
    items: list[PremiseItem] = field(default_factory=list)
    measure: str = "follow"
    probed: int = 0
    solved: int = 0
    unhinted: int = 0
    p_helps: float = 1.0
    p_hurts: float = 1.0
    seconds: float = 0.0
    reason: str = ""

    @property
    def solved_plain(self) -> float | None:
        """Mean share of the teacher's replies without the hint that the user accepts."""
        return _mean([i.solved_plain for i in self.items if i.solved_plain is not None])

    @property
    def solved_hinted(self) -> float | None:
        """... with the hint."""
        return _mean([i.solved_hinted for i in self.items if i.solved_hinted is not None])

    @property
    def mean_delta(self) -> float | None:
        """Mean ``delta`` on the preferred reply (nats/token)."""
        return _mean([i.delta for i in self.items if i.delta is not None])

    def signs(self) -> list[float]:
        """The per-item values the verdict's sign test reads (``follow`` or ``delta``)."""
        values = [i.follow if self.measure == "follow" else i.delta for i in self.items]
        return [v for v in values if v is not None]

    def line(self) -> str:
        """One line for the console and the run's log."""
        if self.verdict == "unmeasured":
            return f"OPD premise unmeasured: {self.reason}"
        signs = self.signs()
        helped, hurt = sum(v > 0 for v in signs), sum(v < 0 for v in signs)
        if self.measure == "follow":
            head = (
                f"with the user's hint the teacher's replies are accepted {self.solved_hinted:.0%} of the time, "
                f"without it {self.solved_plain:.0%}"
            )
        else:
            head = "the teacher cannot sample; the hint moves its log-probs of the preferred reply"
        preferred = (
            "" if self.mean_delta is None else f"; preferred reply {self.mean_delta:+.2f} nats/token with the hint"
        )
        return (
            f"OPD premise {self.verdict}: {head} (better on {helped}, worse on {hurt} of {len(self.items)} "
            f"hinted probe turns, sign test p = {self.p_helps:.3g} better, {self.p_hurts:.3g} worse{preferred}; "
            f"{self.probed} prompts, {self.solved} already solved, {self.unhinted} without an accepted hint; "
            f"{self.seconds:.1f}s)"
        )

    def metrics(self) -> dict[str, float]:
        """``premise/*`` figures for the run's log (those measured)."""
        out = {
            "premise/items": float(len(self.items)),
            "premise/p_helps": self.p_helps,
            "premise/p_hurts": self.p_hurts,
            "premise/solved_plain": self.solved_plain,
            "premise/solved_hinted": self.solved_hinted,
            "premise/preferred_delta": self.mean_delta,
        }
        return {k: v for k, v in out.items() if v is not None}


def verdict(values: list[float], alpha: float = 0.05, min_items: int = 4) -> tuple[str, float, float]:
    """``(verdict, p_helps, p_hurts)`` from per-item values (positive = the hint helped) by the exact
    one-sided sign test (zeros, ties, dropped). ``"unmeasured"`` with fewer than ``min_items`` values.

    Example: 14 of 16 worse, 2 better gives ``p_hurts = P(X >= 14 | n=16, 1/2) = 137/65536 = 0.0021``:
    anti-informative at ``alpha`` 0.05.

    Raises:
        ValueError: ``alpha`` outside (0, 1) or ``min_items`` < 1.
    """
    if not 0 < alpha < 1 or min_items < 1:
        raise ValueError(f"need 0 < alpha < 1 and min_items >= 1, got {alpha}, {min_items}")
    up, down = sum(v > 0 for v in values), sum(v < 0 for v in values)
    p_helps, p_hurts = sign_test_p(up, down), sign_test_p(down, up)
    if len(values) < min_items:
        return "unmeasured", p_helps, p_hurts
    if p_helps < alpha:
        return "informative", p_helps, p_hurts
    if p_hurts < alpha:
        return "anti-informative", p_helps, p_hurts
    return "inconclusive", p_helps, p_hurts


class PremiseCheck:
    """The probe of the module docstring, on callables so that it runs without Ray.

    Args:
        env: the job's environment. tokenizer: the policy's (its chat template renders the prompts).
        num_prompts: tasks probed. temperature, seed, max_tokens: of every sampled reply (the
            teacher scores at ``temperature`` too, as it scores live turns).
        follow_n: the teacher's replies per hinted turn, with the hint and without.
        alpha, min_items: of :func:`verdict`.
        untagged_tool_calls: parse replies as the server does with ``serve.untagged_tool_calls``.

    Raises:
        ValueError: ``num_prompts`` or ``follow_n`` < 1 (and :class:`~clawray.evaluation.Evaluator`'s errors).
    """

    def __init__(
        self,
        env: Environment,
        tokenizer: Any,
        num_prompts: int = 16,
        temperature: float = 0.7,
        seed: int = 0,
        max_tokens: int = 96,
        follow_n: int = 4,
        alpha: float = 0.05,
        min_items: int = 4,
        untagged_tool_calls: bool = False,
    ):
        if num_prompts < 1 or follow_n < 1:
            raise ValueError(f"the premise probe needs num_prompts, follow_n >= 1, got {num_prompts}, {follow_n}")
        self.env, self.tokenizer, self.follow_n = env, tokenizer, follow_n
        self.alpha, self.min_items, self.seed = alpha, min_items, seed
        self.sampler = Evaluator(
            env,
            tokenizer,
            n=1,
            num_prompts=num_prompts,
            temperature=temperature,
            seed=seed,
            max_tokens=max_tokens,
            split="eval",
            untagged_tool_calls=untagged_tool_calls,
        )

    def run(
        self,
        generate: Callable[[list[GenerateRequest]], list[Any]],
        hints: Callable[[list[Turn], list[list[dict]]], list[str | None]],
        teacher: Teacher,
    ) -> PremiseResult:
        """Probe the teacher.

        Args:
            generate: ``generate(requests) -> outputs`` (the policy engine; each output a
                ``GenerateOutput`` or a dict with ``response_ids``).
            hints: ``hints(turns, next_states) -> accepted hint or None`` per turn (the hint judge).
            teacher: see :class:`Teacher`.

        Raises:
            RuntimeError: the teacher returned a wrong number of log-probs.
        """
        t0 = time.perf_counter()
        tasks, env = self.sampler.tasks, self.env
        requests = self.sampler.requests()
        turns, task_of, next_states, solved = [], [], [], 0
        for task, request, out in zip(tasks, requests, generate(requests)):
            response_ids = _response_ids(out)
            message = self.sampler.reply_message(response_ids)
            correction, ok = env.feedback(task, message.get("content") or "")
            if ok:
                solved += 1
                continue
            turns.append(self._turn(len(turns), task, request, response_ids, message))
            task_of.append(task)
            next_states.append([{"role": "user", "content": correction}])
        accepted = hints(turns, next_states) if turns else []
        kept = [k for k, h in enumerate(accepted) if h]
        hinted = [(turns[k], task_of[k], accepted[k]) for k in kept]
        items = [
            PremiseItem(task.question, turn.response_message.get("content") or "", hint, None, None)
            for turn, task, hint in hinted
        ]
        if hinted:
            self._follow(hinted, items, teacher)
            self._preferred(hinted, items, teacher)
        result = PremiseResult("unmeasured", items, probed=len(tasks), solved=solved, unhinted=len(turns) - len(kept))
        result.measure = "follow" if any(i.follow is not None for i in items) or not items else "preferred"
        result.verdict, result.p_helps, result.p_hurts = verdict(result.signs(), self.alpha, self.min_items)
        if result.verdict == "unmeasured":
            result.reason = (
                f"{len(items)} hinted probe turn(s) measured, fewer than {self.min_items} ({result.probed} prompts: "
                f"{solved} already solved, {result.unhinted} without an accepted hint)"
            )
        result.seconds = time.perf_counter() - t0
        return result

    def _follow(self, hinted: list[tuple[Turn, Any, str]], items: list[PremiseItem], teacher: Teacher) -> None:
        """The teacher's ``follow_n`` replies per hinted turn, with the hint and without (same seeds)."""
        turns = [t for t, _, _ in hinted]
        prompts = teacher.prompt_ids(turns + turns, [h for _, _, h in hinted] + [""] * len(turns))
        n, s = self.follow_n, self.sampler
        requests = [
            GenerateRequest(
                prompt_ids=list(ids),
                max_tokens=s.max_tokens,
                temperature=s.temperature,
                stop_token_ids=s.stop_ids,
                seed=(self.seed * 1_000_003 + 7919 + (k % len(turns)) * n + j) % 2**31,  # same with and without
            )
            for k, ids in enumerate(prompts)
            for j in range(n)
        ]
        outs = teacher.generate(requests)
        if outs is None:
            return
        graded = []
        for k, out in enumerate(outs):
            task = hinted[(k // n) % len(turns)][1]
            reply = self.sampler.reply_message(_response_ids(out)).get("content") or ""
            graded.append(float(self.env.grade(task, reply)["solved"]))
        for k, item in enumerate(items):
            item.solved_hinted = sum(graded[k * n : (k + 1) * n]) / n
            plain = (len(turns) + k) * n
            item.solved_plain = sum(graded[plain : plain + n]) / n

    def _preferred(self, hinted: list[tuple[Turn, Any, str]], items: list[PremiseItem], teacher: Teacher) -> None:
        """The teacher's mean log-prob of the preferred reply, with the hint and without."""
        if self.env.preferred_reply(hinted[0][1]) is None:
            return
        turns = []
        for turn, task, _ in hinted:
            text = self.env.preferred_reply(task) or ""
            ids = self.tokenizer.encode(text, add_special_tokens=False) + self.sampler.stop_ids
            message = {"role": "assistant", "content": text}
            turns.append(replace(turn, response_message=message, response_ids=ids, rollout_logprobs=[0.0] * len(ids)))
        hints = [h for _, _, h in hinted]
        logprobs = teacher.logprobs(turns + turns, hints + [""] * len(hints))
        for k, (item, turn) in enumerate(zip(items, turns)):
            with_hint, without, n = logprobs[k], logprobs[len(turns) + k], len(turn.response_ids)
            if len(with_hint) != n or len(without) != n:
                raise RuntimeError(f"the teacher returned {len(with_hint)}/{len(without)} log-probs for {n} tokens")
            item.preferred, item.tokens = turn.response_message["content"], n
            item.plain, item.hinted = sum(without) / n, sum(with_hint) / n

    def _turn(self, i: int, task: Any, request: Any, response_ids: list[int], message: dict) -> Turn:
        return Turn(
            session_id=f"premise-{i}",
            turn_index=1,
            messages=self.env.opening(task),
            response_message=message,
            prompt_ids=list(request.prompt_ids),
            response_ids=response_ids,
            rollout_logprobs=[0.0] * len(response_ids),
            policy_version=0,
            finish_reason="stop",
            temperature=request.temperature,
            tools=self.env.tools,
        )


def _response_ids(out: Any) -> list[int]:
    return list(out["response_ids"] if isinstance(out, dict) else out.response_ids)


class PremiseRefused(RuntimeError):
    """A run stopped before training: its teacher is anti-informative (``opd.premise_check=refuse``)."""


def probe_actors(
    cfg: Any, model_path: str, engine: Any, judge: Any, teacher: Any, teacher_engine: Any = None
) -> PremiseResult:
    """:class:`PremiseCheck` through the job's own actors: rollout ``engine`` (the policy), hint
    ``judge`` (a ``JudgeWorker``, with ``opd.accept`` and ``opd.min_hint_chars``), ``teacher`` (a
    ``TeacherWorker``) and ``teacher_engine``, which samples the teacher's replies (None: an endpoint
    teacher, which only scores). Size ``opd.premise_prompts`` x ``opd.premise_follow_n``; sampling
    as ``env.*``."""
    import ray
    from transformers import AutoTokenizer

    from clawray.envs import env_from_config

    opd, env = cfg.opd, cfg.env
    check = PremiseCheck(
        env_from_config(env),
        AutoTokenizer.from_pretrained(model_path),
        num_prompts=opd.premise_prompts,
        temperature=env.temperature,
        seed=env.seed,
        max_tokens=env.max_tokens,
        follow_n=opd.premise_follow_n,
        untagged_tool_calls=cfg.serve.untagged_tool_calls,
    )

    def generate_on(actor: Any) -> Callable[[list[GenerateRequest]], list[Any]]:
        return lambda requests: ray.get([actor.generate.remote(r) for r in requests])

    class Calls:
        def prompt_ids(self, turns: list[Turn], hints: list[str]) -> list[list[int]]:
            return ray.get([teacher.teacher_prompt_ids.remote(t, h) for t, h in zip(turns, hints)])

        def logprobs(self, turns: list[Turn], hints: list[str]) -> list[list[float]]:
            return ray.get([teacher.teacher_logprobs.remote(t, h) for t, h in zip(turns, hints)])

        def generate(self, requests: list[GenerateRequest]) -> list[Any] | None:
            return None if teacher_engine is None else generate_on(teacher_engine)(requests)

    def hints(turns: list[Turn], states: list[list[dict]]) -> list[str | None]:
        calls = [judge.hint.remote(t, s, opd.accept, opd.min_hint_chars) for t, s in zip(turns, states)]
        return [r.hint for r in ray.get(calls)]

    return check.run(generate_on(engine), hints, Calls())


def teacher_name(teacher: str, model_path: str) -> str:
    """``opd.teacher`` in words (an endpoint's URL, which may hold a password, is not repeated)."""
    if teacher == "frozen":
        return f"the initial policy, {model_path}"
    if teacher == "live":
        return "the current policy"
    return "an endpoint" if is_endpoint(teacher) else teacher


def premise_action(result: PremiseResult, mode: str, teacher: str) -> tuple[str, str]:
    """What the job does with ``result`` under ``opd.premise_check`` ``mode``: ``("info" | "warn" |
    "refuse", message)``. ``refuse`` stops a run whose premise is not shown (``anti-informative`` or
    ``inconclusive``: training would at best waste the run); ``warn`` says so and trains. An
    ``informative`` or ``unmeasured`` result is only said. ``teacher`` names the teacher.

    Raises:
        ValueError: an unknown ``mode``.
    """
    if mode not in ("warn", "refuse"):
        raise ValueError(f"opd.premise_check must be 'warn' or 'refuse' here, got {mode!r}")
    if result.verdict in ("informative", "unmeasured"):
        return "info", f"{result.line()} [teacher: {teacher}]"
    effect = "does worse" if result.verdict == "anti-informative" else "does not do measurably better"
    advice = (
        f"with the user's hint the teacher ({teacher}) {effect} at what the user asked for, so OPD has "
        "nothing to distil and can only move the policy away from it. Use a model that reads hints (as the "
        "frozen teacher: opd.teacher=PATH of a larger model with the same tokenizer; or as policy and "
        "teacher: `clawray model qwen2.5-coder-0.5b DIR`, model.path=DIR), or trainer.algo=rl"
    )
    if mode == "refuse":
        return "refuse", f"{result.line()}: {advice}; opd.premise_check=warn trains anyway."
    return "warn", f"{result.line()}: {advice}."
