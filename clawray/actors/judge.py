"""JudgeWorker (Binary RL): scores a turn from its next state with m PRM votes and a majority.

Owns: the judge prompts, the parsing of a vote or a hint, the majority and hint-acceptance rules, and the
judge calls' concurrency, timeout and retries. Must not: decide what a score makes of a turn
(:mod:`clawray.algos.algorithm`), pair turns with next states (the SessionTracker), or define the
``feedback`` grammar (:mod:`clawray.algos.feedback`).

Backends:
  * ``engine``: a frozen copy of the initial policy on its own RolloutEngine, prompted to reason
    and answer ``\\boxed{1}``, ``\\boxed{-1}`` or ``\\boxed{0}`` (OpenClaw-RL's PRM, arXiv 2603.10165).
  * ``openai``: the same prompt sent to any OpenAI-compatible endpoint.
  * ``feedback``: reads explicit signals in the next state (:mod:`clawray.algos.feedback` owns the
    grammar, ``docs/feedback.md``); deterministic, so it casts one vote.

Besides the per-turn score, :meth:`JudgeWorker.judge_session` scores a whole closed session once
(``trainer.outcome_judge``, long-horizon credit): the same m votes and majority over a transcript of
the session (:func:`build_session_messages`); the ``feedback`` backend reads the conversation's last
user or tool message (:func:`session_feedback_score`: on the simulated user's environments, its
words for the environment's own final check). A malformed answer is an invalid vote, as for turns.
:meth:`JudgeWorker.compare` asks which of two replies to one conversation is better (the promotion
gate's judge-compared probe items), with the same votes and majority.
"""

from __future__ import annotations

import asyncio
import json
import re
import zlib
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable

import ray

from clawray.actors.call_health import CallHealth
from clawray.algos.feedback import feedback_score, message_text
from clawray.chat import SpecialTokenStripper, end_of_turn_ids, without_surrogates
from clawray.config import JudgeConfig, section
from clawray.ray_env import CONTROL_GROUP, CONTROL_GROUPS
from clawray.types import Turn

_BOX_OPEN = "\\boxed{"
_BRACE = re.compile(r"[{}]")
_VOTE = re.compile(r"\s*([+-]?[01])\s*", re.ASCII)  # ASCII digits only: a "１" or "١" is not a vote
MAX_ANSWER_CHARS = 65536  # a judge answer is parsed and kept by its last 64 Ki characters


def _last_box(text: str) -> int | None:
    """The value of the *last* ``\\boxed{...}`` in ``text`` when it is exactly -1, 0 or 1 (an optional
    sign and spaces allowed); None when there is no box or the last one holds anything else (braces
    included, as ``\\boxed{\\text{-1}}``, or never closed), so a malformed final answer never lets an
    earlier box decide. Linear in ``len(text)``."""
    start = text.rfind(_BOX_OPEN)
    if start < 0:
        return None
    start += len(_BOX_OPEN)
    depth = 1
    for brace in _BRACE.finditer(text, start):  # the box's content runs to its matching brace
        depth += 1 if brace.group() == "{" else -1
        if depth == 0:
            match = _VOTE.fullmatch(text[start : brace.start()])
            return int(match.group(1)) if match else None
    return None  # never closed


def parse_score(text: str) -> int | None:
    """The last ``\\boxed{n}`` in ``text`` if n is 1, -1 or 0; otherwise None (an invalid vote).

    Anything but a string (a judge that answered with a list or an object) is an invalid vote.
    """
    return _last_box(text) if isinstance(text, str) else None


def majority_vote(votes: list[int | None]) -> tuple[int, dict[str, int]]:
    """Majority of the valid votes; a tie at the top or no valid vote gives 0.

    Returns:
        ``(score, counts)`` with counts ``{"valid", "invalid", "tie"}`` (tie is 0 or 1).

    Examples: ``[1, -1, None] -> 0`` (tie); ``[1, None, None] -> 1``; ``[None] * 3 -> 0``.
    """
    valid = [v for v in votes if v is not None]
    counts = {"valid": len(valid), "invalid": len(votes) - len(valid), "tie": 0}
    if not valid:
        return 0, counts
    ranked = Counter(valid).most_common()
    if len(ranked) > 1 and ranked[0][1] == ranked[1][1]:
        counts["tie"] = 1
        return 0, counts
    return ranked[0][0], counts


def render_response(message: dict[str, Any]) -> str:
    """The assistant message as a judge reads it: its text plus one line per tool call."""
    parts = [message_text(message.get("content"))]
    for call in message.get("tool_calls") or []:
        fn = call.get("function", {})
        parts.append(f"[tool call] {fn.get('name')}({fn.get('arguments')})")
    return "\n".join(p for p in parts if p).strip() or "(empty reply)"


PRM_SYSTEM = (
    "You judge one step of an AI assistant's work. You see the assistant's output and the state that "
    "followed it: the user's next message, or the result of a tool the assistant called. Decide whether "
    "the output served the user's intent at that step.\n"
    "Score 1: the next state shows progress (the user accepts, thanks, confirms success or moves on; "
    "a tool returns a clean result).\n"
    "Score -1: the next state asks for a redo, corrects the assistant, repeats or rephrases the request, "
    "asks for a change, or shows an error caused by the assistant's action.\n"
    "Score 0: the next state is ambiguous or says too little.\n"
    "Think briefly, then give the score as \\boxed{1}, \\boxed{-1} or \\boxed{0} at the very end."
)


def render_context(turn: Turn, context_messages: int) -> str:
    """The last ``context_messages`` messages of the turn's request, one ``[role] text`` line each
    (tool calls rendered readably); empty when ``context_messages`` is 0."""
    if context_messages <= 0:
        return ""
    lines = [
        f"[{m.get('role')}] {render_response(m) if m.get('role') == 'assistant' else message_text(m.get('content'))}"
        for m in turn.messages[-context_messages:]
    ]
    return "## Conversation so far\n" + "\n".join(lines) + "\n\n"


def build_prm_messages(turn: Turn, next_state: list[dict[str, Any]], context_messages: int = 4) -> list[dict[str, str]]:
    """Chat messages asking a PRM judge to score ``turn`` from ``next_state``, with the last
    ``context_messages`` messages of the conversation as context (OpenClaw-RL's judge saw none)."""
    state = "\n".join(f"[{m.get('role')}] {message_text(m.get('content'))}" for m in next_state)
    user = (
        f"{render_context(turn, context_messages)}## Assistant output\n{render_response(turn.response_message)}\n\n"
        f"## Next state\n{state}\n\n"
        "Is the next state (a) progress, (b) a correction or redo, or (c) ambiguous? "
        "End with \\boxed{1}, \\boxed{-1} or \\boxed{0}."
    )
    return [{"role": "system", "content": PRM_SYSTEM}, {"role": "user", "content": user}]


SESSION_SYSTEM = (
    "You judge a whole conversation between a user and an AI assistant after it ended. Decide whether, "
    "by the end, the assistant achieved what the user wanted.\n"
    "Score 1: the task was accomplished (the user confirms, thanks or accepts the result; a tool run "
    "that checks it passes).\n"
    "Score -1: it was not (the user still corrects the assistant, gives up or stops unsatisfied; the "
    "last tool result is an error).\n"
    "Score 0: the conversation does not show whether it was.\n"
    "Think briefly, then give the score as \\boxed{1}, \\boxed{-1} or \\boxed{0} at the very end."
)
COMPARE_SYSTEM = (
    "You compare two replies an AI assistant could give at the same point of a conversation. Decide "
    "which one serves the user better: correct, does what was asked, in the form that was asked for.\n"
    "Score 1: reply A is better. Score -1: reply B is better. Score 0: they are equally good or equally bad.\n"
    "Ignore the order in which they are shown. Think briefly, then give the score as \\boxed{1}, "
    "\\boxed{-1} or \\boxed{0} at the very end."
)


def build_compare_messages(
    messages: list[dict[str, Any]], reply_a: dict[str, Any], reply_b: dict[str, Any], context_messages: int = 4
) -> list[dict[str, str]]:
    """Chat messages asking a judge which of two assistant replies to ``messages`` (the conversation up
    to the reply) is better: ``\\boxed{1}`` A, ``\\boxed{-1}`` B, ``\\boxed{0}`` equal (the promotion
    gate's judge-compared probe items, :mod:`clawray.gate`). The last ``context_messages`` messages
    are shown (at least the last one: the request the replies answer)."""
    context = [
        f"[{m.get('role')}] {render_response(m) if m.get('role') == 'assistant' else message_text(m.get('content'))}"
        for m in messages[-max(1, context_messages) :]
    ]
    user = (
        "## Conversation so far\n" + "\n".join(context) + "\n\n"
        f"## Reply A\n{render_response(reply_a)}\n\n## Reply B\n{render_response(reply_b)}\n\n"
        "Which reply is better? End with \\boxed{1} (A), \\boxed{-1} (B) or \\boxed{0} (equal)."
    )
    return [{"role": "system", "content": COMPARE_SYSTEM}, {"role": "user", "content": user}]


SESSION_MAX_CHARS = 24000  # the transcript shown to a session judge (its opening and its most recent part)


def render_session(messages: list[dict[str, Any]], max_chars: int = SESSION_MAX_CHARS) -> str:
    """A session's messages as ``[role] text`` lines (assistant tool calls rendered readably). Longer
    than ``max_chars`` characters: the lines up to the first user message (the task), a
    ``[... N messages omitted ...]`` line, then as many of the last lines as fit."""
    lines = [
        f"[{m.get('role')}] {render_response(m) if m.get('role') == 'assistant' else message_text(m.get('content'))}"
        for m in messages
    ]
    if sum(len(x) + 1 for x in lines) <= max_chars:
        return "\n".join(lines)
    head_n = next((i + 1 for i, m in enumerate(messages) if m.get("role") == "user"), 1)
    head = [x[: max_chars // 2] for x in lines[:head_n]]
    budget, tail = max_chars - sum(len(x) + 1 for x in head), []
    for x in reversed(lines[head_n:]):
        if len(x) + 1 > budget:
            break
        tail.insert(0, x)
        budget -= len(x) + 1
    omitted = len(lines) - head_n - len(tail)
    return "\n".join([*head, f"[... {omitted} messages omitted ...]", *tail])


def build_session_messages(messages: list[dict[str, Any]], max_chars: int = SESSION_MAX_CHARS) -> list[dict[str, str]]:
    """Chat messages asking a judge whether a whole session (``messages``: the last request's history
    plus its reply) achieved the user's goal, to be answered with a boxed 1, -1 or 0."""
    user = (
        f"## Conversation\n{render_session(messages, max_chars)}\n\n"
        "Did the assistant achieve what the user wanted by the end? End with \\boxed{1}, \\boxed{-1} or \\boxed{0}."
    )
    return [{"role": "system", "content": SESSION_SYSTEM}, {"role": "user", "content": user}]


def session_feedback_score(messages: list[dict[str, Any]]) -> int | None:
    """The ``feedback`` backend's session score: :func:`feedback_score` of the conversation's last user
    or tool message (the simulated user's verdict on the final reply: "Correct, thanks!" -> 1, "That's
    wrong ..." -> -1); None (an invalid vote) when there is none or it carries no signal."""
    last = next((m for m in reversed(messages) if m.get("role") in ("user", "tool")), None)
    return feedback_score([last]) if last is not None else None


HINT_SYSTEM = (
    "You read one step of an AI assistant's work in hindsight: its output and the state that followed "
    "(the user's next message, or a tool result). Decide whether that next state reveals something the "
    "assistant should have known or done to give a better output (a preference, a correction, a missing "
    "fact). A clean tool result usually means the action was right and teaches nothing.\n"
    "Answer \\boxed{1} if it does and \\boxed{-1} if it does not. Only after \\boxed{1}, give a short, "
    "concrete instruction of one to three sentences that would have produced the better output, between "
    "[HINT_START] and [HINT_END]."
)
_HINT_START, _HINT_END = "[HINT_START]", "[HINT_END]"


def build_hint_messages(
    turn: Turn, next_state: list[dict[str, Any]], context_messages: int = 4
) -> list[dict[str, str]]:
    """Chat messages asking a judge for a hindsight hint on ``turn`` given ``next_state`` (with context)."""
    state = "\n".join(f"[{m.get('role')}] {message_text(m.get('content'))}" for m in next_state)
    user = (
        f"{render_context(turn, context_messages)}## Assistant output\n{render_response(turn.response_message)}\n\n## Next state\n{state}\n\n"
        "Does the next state reveal how the output should have been? Answer \\boxed{1} or \\boxed{-1}; "
        "after \\boxed{1} give [HINT_START] your instruction [HINT_END]."
    )
    return [{"role": "system", "content": HINT_SYSTEM}, {"role": "user", "content": user}]


def _hint_blocks(text: str) -> list[tuple[int, int]]:
    """``(start, end)`` spans of the ``[HINT_START]...[HINT_END]`` blocks, left to right, each ending
    at the first end tag after its start tag. Linear in ``len(text)`` (a regex with a lazy ``.*?``
    is quadratic on many start tags without an end tag)."""
    spans, pos = [], 0
    while (start := text.find(_HINT_START, pos)) != -1:
        end = text.find(_HINT_END, start + len(_HINT_START))
        if end == -1:
            break
        pos = end + len(_HINT_END)
        spans.append((start, pos))
    return spans


def parse_hint(text: str) -> tuple[int | None, str | None]:
    """``(decision, hint)`` from a hint-judge answer.

    decision: the last ``\\boxed{n}`` *outside* the hint blocks if n is 1 or -1, else None (an invalid
    vote; 0 is not on this scale, and a box quoted inside a hint is part of the hint). hint: the
    last ``[HINT_START]...[HINT_END]`` block, stripped, or None. Anything but a string is ``(None,
    None)``.
    """
    if not isinstance(text, str):
        return None, None
    spans = _hint_blocks(text)
    outside, pos = [], 0
    for start, end in spans:
        outside.append(text[pos:start])
        pos = end
    outside.append(text[pos:])
    decision = _last_box("".join(outside))
    hint = text[spans[-1][0] + len(_HINT_START) : spans[-1][1] - len(_HINT_END)].strip() if spans else None
    return (decision if decision in (1, -1) else None), (hint or None)


def feedback_hint(next_state: list[dict[str, Any]]) -> tuple[int | None, str | None]:
    """The ``feedback`` backend's hint vote: a user message with a negative signal *is* the hint
    (the correction, verbatim); any other next state votes -1 (nothing to learn in hindsight);
    no next state is an invalid vote."""
    if not next_state:
        return None, None
    if feedback_score(next_state) == -1:
        users = [message_text(m.get("content")) for m in next_state if m.get("role") == "user"]
        if users:
            return 1, users[-1].strip()
    return -1, None


@dataclass
class HintResult:
    """Hint votes for one turn.

    Attributes:
        hint: the accepted hint (longest among accepted votes), or None.
        votes: each vote's ``(decision, hint)``; decision None = invalid vote.
        raw: each vote's raw text.
        hints: every qualifying hint when the turn's hint is accepted, longest first (equal lengths in
            vote order), each text once; ``hints[0] == hint``; empty when none is accepted.
    """

    hint: str | None
    votes: list[tuple[int | None, str | None]]
    raw: list[str] = field(default_factory=list)
    hints: list[str] = field(default_factory=list)


def accept_hint(
    votes: list[tuple[int | None, str | None]],
    accept: str = "any",
    min_chars: int = 10,
    plain: Callable[[str], str] | None = None,
) -> HintResult:
    """Apply the acceptance rule to hint votes.

    A vote *qualifies* when its decision is 1 and its hint is longer than ``min_chars`` characters,
    measured and kept as the teacher will read it: ``plain(hint).strip()`` when ``plain`` is given
    (:class:`clawray.chat.SpecialTokenStripper`: a hint of special-token strings is empty).
    ``any``: accept when at least one vote qualifies (OpenClaw-RL). ``majority``: accept when the
    qualifying votes are more than half of the valid votes. The longest qualifying hint wins; all of
    them are kept in ``hints`` (for ``opd.max_hints`` > 1).

    Raises:
        ValueError: unknown ``accept`` rule.
    """
    if accept not in ("any", "majority"):
        raise ValueError(f"unknown hint acceptance rule {accept!r}; expected 'any' or 'majority'")
    texts = [None if h is None or d != 1 else (plain(h).strip() if plain else h) for d, h in votes]
    qualifying = [h for h in texts if h is not None and len(h) > min_chars]
    valid = sum(d is not None for d, _ in votes)
    ok = bool(qualifying) and (accept == "any" or 2 * len(qualifying) > valid)
    hints = sorted(dict.fromkeys(qualifying), key=len, reverse=True) if ok else []  # a stable sort
    return HintResult(hint=hints[0] if hints else None, votes=list(votes), hints=hints)


@dataclass
class JudgeResult:
    """The outcome of judging one turn.

    Attributes:
        score: majority score in {1, -1, 0}.
        votes: each vote's parsed value (None = invalid).
        raw: each vote's raw text.
        counts: ``{"valid", "invalid", "tie"}``.
    """

    score: int
    votes: list[int | None]
    raw: list[str] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)


class JudgeWorker:
    """Scores turns with one of the backends above.

    Args:
        cfg: the ``judge`` config section (:class:`clawray.config.JudgeConfig`; a mapping of some of its
            keys is completed with the schema's defaults, :func:`clawray.config.section`).
        engine: RolloutEngine actor handle (backend ``engine``).
        tokenizer_path: the policy's tokenizer folder: the judge engine's (backend ``engine``) and, on
            every backend, the special-token strings a hint is measured without (:func:`accept_hint`).
    """

    def __init__(self, cfg: JudgeConfig | dict, engine: Any = None, tokenizer_path: str | None = None):
        self.cfg = cfg = section(JudgeConfig, cfg)
        self.backend = cfg.backend
        self.engine = engine
        self.tokenizer_path = tokenizer_path
        self._hint_stripper: SpecialTokenStripper | None = None
        self.stats: Counter[str] = Counter()
        self.semaphore = asyncio.Semaphore(cfg.concurrency)
        # a judgement's own bound is (1 + retries) calls of timeout_s each; twice that is slow
        self.calls = CallHealth("judgements", 2 * (1 + int(cfg.retries)) * float(cfg.timeout_s))
        if self.backend == "engine":
            from transformers import AutoTokenizer

            if engine is None or tokenizer_path is None:
                raise ValueError("judge backend 'engine' needs an engine and a tokenizer path")
            self.tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
            self.plain = SpecialTokenStripper(self.tokenizer)  # the judged text cannot forge judge turns
            self.end_ids = end_of_turn_ids(tokenizer_path, self.tokenizer)  # the policy's own stop list
        elif self.backend == "openai":
            from openai import AsyncOpenAI

            if not cfg.base_url or not cfg.model:
                raise ValueError("judge backend 'openai' needs judge.base_url and judge.model")
            # no retries inside the client: judge.retries is the one retry policy
            self.client = AsyncOpenAI(base_url=cfg.base_url, api_key=cfg.api_key, timeout=cfg.timeout_s, max_retries=0)

    async def judge(self, turn: Turn, next_state: list[dict[str, Any]]) -> JudgeResult:
        """Score ``turn`` from ``next_state``; never raises for a bad judge answer or a failed call
        (those are invalid votes)."""
        if self.backend == "feedback":
            votes, raw = [feedback_score(next_state)], [json.dumps(next_state)[:500]]
        else:
            messages = build_prm_messages(turn, next_state, self.cfg.context_messages)
            votes, raw = await self._score_votes(messages, f"prm/{turn.session_id}/{turn.turn_index}")
        score, counts = majority_vote(votes)
        self.stats["turns"] += 1
        self.stats["votes"] += len(votes)
        self.stats["invalid_votes"] += counts["invalid"]
        self.stats["ties"] += counts["tie"]
        self.stats["agree_votes"] += sum(v == score for v in votes if v is not None)
        self.stats[f"score_{score}"] += 1
        return JudgeResult(score=score, votes=votes, raw=list(raw), counts=counts)

    async def judge_session(self, messages: list[dict[str, Any]], session_id: str = "") -> JudgeResult:
        """Score a whole closed session from its transcript (``messages``: the last request's history
        plus its reply): m votes (one for ``feedback``, :func:`session_feedback_score`) and their
        majority, on the turn judge's scale (1 achieved, -1 not, 0 cannot tell). Never raises for a
        bad judge answer or a failed call (invalid votes, counted in ``session_invalid_votes``)."""
        if self.backend == "feedback":
            votes, raw = [session_feedback_score(messages)], [json.dumps(messages[-2:])[:500]]
        else:
            votes, raw = await self._score_votes(build_session_messages(messages), f"session/{session_id}")
        score, counts = majority_vote(votes)
        self.stats["sessions"] += 1
        self.stats["session_votes"] += len(votes)
        self.stats["session_invalid_votes"] += counts["invalid"]
        return JudgeResult(score=score, votes=votes, raw=list(raw), counts=counts)

    async def compare(
        self, messages: list[dict[str, Any]], reply_a: dict[str, Any], reply_b: dict[str, Any], key: str = ""
    ) -> JudgeResult:
        """Which of two assistant replies to ``messages`` is better (:func:`build_compare_messages`): m
        votes and their majority, 1 = A, -1 = B, 0 = equal or no valid vote. ``key`` seeds the votes.
        Never raises for a bad answer or a failed call (invalid votes, ``compare_invalid_votes``).

        Raises:
            ValueError: the ``feedback`` backend, which reads next states and cannot compare replies.
        """
        if self.backend == "feedback":
            raise ValueError("the feedback judge cannot compare two replies: use judge.backend engine or openai")
        prompt = build_compare_messages(messages, reply_a, reply_b, self.cfg.context_messages)
        votes, raw = await self._score_votes(prompt, f"compare/{key}")
        score, counts = majority_vote(votes)
        self.stats["compares"] += 1
        self.stats["compare_votes"] += len(votes)
        self.stats["compare_invalid_votes"] += counts["invalid"]
        return JudgeResult(score=score, votes=votes, raw=list(raw), counts=counts)

    def _plain_hint(self) -> Callable[[str], str] | None:
        """The policy tokenizer's :class:`~clawray.chat.SpecialTokenStripper` (loaded at the first hint),
        or None without a tokenizer path."""
        if self._hint_stripper is None and self.tokenizer_path:
            if self.backend == "engine":
                self._hint_stripper = self.plain
            else:
                from transformers import AutoTokenizer

                self._hint_stripper = SpecialTokenStripper(AutoTokenizer.from_pretrained(self.tokenizer_path))
        return self._hint_stripper

    async def hint(
        self, turn: Turn, next_state: list[dict[str, Any]], accept: str = "any", min_chars: int = 10
    ) -> HintResult:
        """OPD hint votes for ``turn``: m votes (one for ``feedback``), accepted by ``accept``
        (``"any"`` positive vote, as OpenClaw-RL, or ``"majority"`` of valid votes) among votes with
        a hint longer than ``min_chars``; the longest accepted hint wins. Never raises for a bad
        answer or a failed call (invalid votes)."""
        if self.backend == "feedback":
            votes = [feedback_hint(next_state)]
            raw = [json.dumps(next_state)[:500]]
        else:
            messages = build_hint_messages(turn, next_state, self.cfg.context_messages)
            with self.calls.work():
                raw = await asyncio.gather(
                    *(self._ask(messages, f"hint/{turn.session_id}/{turn.turn_index}/{i}") for i in range(self.cfg.m))
                )
            votes = [parse_hint(r) for r in raw]
        result = accept_hint(votes, accept, min_chars, self._plain_hint())
        result.raw = list(raw)
        self.stats["hint_turns"] += 1
        self.stats["hint_votes"] += len(votes)
        self.stats["hint_invalid_votes"] += sum(d is None for d, _ in votes)
        self.stats["hints_accepted"] += int(result.hint is not None)
        self.stats["hint_chars"] += len(result.hint or "")
        return result

    async def _score_votes(self, prompt: list[dict[str, str]], seed_key: str) -> tuple[list[int | None], list[str]]:
        """m concurrent calls on ``prompt`` (vote i seeded by ``seed_key/i``): each vote's parsed
        score (None = invalid) and its raw text."""
        with self.calls.work():
            raw = await asyncio.gather(*(self._ask(prompt, f"{seed_key}/{i}") for i in range(self.cfg.m)))
        return [parse_score(r) for r in raw], list(raw)

    async def _ask(self, messages: list[dict[str, str]], seed_key: str) -> str:
        """One judge completion, at most ``concurrency`` at a time per worker, each attempt bounded by
        ``timeout_s`` and retried ``retries`` times; a vote that still fails returns a marker text
        (an invalid vote, counted), never an exception. An answer is kept by its last
        ``MAX_ANSWER_CHARS`` characters (the final verdict is at the end)."""
        attempts = 1 + int(self.cfg.retries)
        text = ""
        for attempt in range(attempts):
            async with self.semaphore:
                try:
                    answer = await asyncio.wait_for(
                        self._ask_once(messages, f"{seed_key}/{attempt}"), timeout=self.cfg.timeout_s
                    )
                    self.calls.call_ended()
                    return answer[-MAX_ANSWER_CHARS:]
                except Exception as e:
                    self.stats["failed_calls"] += 1
                    timed_out = isinstance(e, asyncio.TimeoutError)
                    self.calls.call_ended(
                        f"{type(e).__name__}{f' after {self.cfg.timeout_s:g} s' if timed_out else ''}"
                    )
                    text = f"<judge call failed: {type(e).__name__}: {e}>"
        self.stats["failed_votes"] += 1
        return text

    async def _ask_once(self, messages: list[dict[str, str]], seed_key: str) -> str:
        if self.backend == "engine":
            from clawray.engines.base import GenerateRequest

            messages = [{**m, "content": self.plain(m["content"])} for m in messages]
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            from clawray.actors.rollout import await_cancellable

            # a timed-out vote cancels its generation in the engine too
            out = await await_cancellable(
                self.engine.generate.remote(
                    GenerateRequest(
                        prompt_ids=self.tokenizer.encode(text, add_special_tokens=False),
                        max_tokens=self.cfg.max_tokens,
                        temperature=self.cfg.temperature,
                        stop_token_ids=self.end_ids,
                        seed=zlib.crc32(seed_key.encode()),
                    )
                )
            )
            return self.tokenizer.decode(out["response_ids"], skip_special_tokens=True)
        resp = await self.client.chat.completions.create(
            model=self.cfg.model, messages=messages, temperature=self.cfg.temperature, max_tokens=self.cfg.max_tokens
        )
        content = resp.choices[0].message.content
        if isinstance(content, list):  # content parts, as some OpenAI-compatible servers answer
            content = "".join(p.get("text") or "" for p in content if isinstance(p, dict))
        if content is not None and not isinstance(content, str):
            raise TypeError(f"the judge answered with {type(content).__name__} content, not text")
        return without_surrogates(content or "")  # a lone "\\ud800" escape: no tokenizer reads it

    @ray.method(concurrency_group=CONTROL_GROUP)
    async def get_stats(self) -> dict:
        """Counters: turns, votes, invalid_votes, failed_calls, failed_votes, ties, score_{1,0,-1},
        hint_turns, hint_votes, hint_invalid_votes, hints_accepted, hint_chars, sessions,
        session_votes, session_invalid_votes, compares, compare_votes, compare_invalid_votes. Answered in the actor's ``control`` concurrency group,
        never queued behind judge calls (a slow judge endpoint held thousands of them, and the
        driver's metrics waited behind them)."""
        return dict(self.stats)

    @ray.method(concurrency_group=CONTROL_GROUP)
    async def health(self) -> dict:
        """Whether the judge's model keeps up: :meth:`clawray.actors.call_health.CallHealth.report`
        (``state`` ok/slow/failing and the ``reason``); in the ``control`` group, never behind work."""
        return self.calls.report()


JudgeWorkerActor = ray.remote(concurrency_groups=CONTROL_GROUPS)(JudgeWorker)
