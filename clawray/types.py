"""The records that flow through clawray: a served :class:`Turn`, a training :class:`Sample`, and the
:class:`SampleMeta` the queue carries beside each sample's object ref (what the driver reads; only the
learners fetch the payload).

Owns: the fields of these records, a sample's shape checks (every per-token list has R entries) and a
turn's ``turns.jsonl`` row. Must not: import Ray, torch or another clawray module: they cross every
actor boundary.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Turn:
    """One main-line request/response, recorded with the exact tokens the engine saw and produced.

    Attributes:
        session_id: the client's session.
        turn_index: 1-based index of this main-line turn in its session.
        messages: the request's (normalised) chat messages, in OpenAI format.
        response_message: the assistant message returned to the client (content, tool_calls).
        prompt_ids: rendered prompt token ids, length P.
        response_ids: sampled token ids, length R (ends with the stop token when finish_reason is stop).
        rollout_logprobs: per-token log-probs of ``response_ids`` under the sampling distribution, length R.
        policy_version: the policy version that sampled the response's OLDEST token (the only one
            unless a weight sync interrupted the generation; see ``token_versions``).
        finish_reason: ``"stop"``, ``"length"`` or ``"tool_calls"``.
        temperature: sampling temperature of the request (the learner scales logits by it; 0 -> 1).
        tools: the request's tool definitions (for judges and teachers), or None.
        truncated: the engine stopped at ``max_tokens`` (or the context end), not at a stop token.
        tool_parse_error: the reply held a ``<tool_call>`` block that was not a valid tool call (hermes JSON or Qwen3-Coder XML).
        spliced: ``prompt_ids`` continue the previous turn's exact prompt + response ids (see
            :mod:`clawray.serve.splice`) instead of a fresh render of the history.
        token_versions: length R, the policy version that sampled each response token (a partial
            rollout: a sync interrupted the generation and it went on with the new weights), or None
            when every token is from ``policy_version``.
        canary: an engine serving the promotion gate's canary sampled it (the session is canary
            traffic, :mod:`clawray.canary`); its ``policy_version`` is then the candidate's.
    """

    session_id: str
    turn_index: int
    messages: list[dict[str, Any]]
    response_message: dict[str, Any]
    prompt_ids: list[int]
    response_ids: list[int]
    rollout_logprobs: list[float]
    policy_version: int
    finish_reason: str
    temperature: float = 1.0
    tools: list[dict[str, Any]] | None = None
    truncated: bool = False
    tool_parse_error: bool = False
    spliced: bool = False
    token_versions: list[int] | None = None
    canary: bool = False

    def record(self) -> dict[str, Any]:
        """The turn as one JSON-able row of ``records/turns.jsonl`` (everything but the tools)."""
        return {k: v for k, v in self.__dict__.items() if k != "tools"}


@dataclass
class Sample:
    """A training unit.

    Attributes:
        tokens: prompt + response token ids, length P + R.
        prompt_len: P, the number of prompt tokens.
        loss_mask: length R, 1 on response tokens that carry gradient.
        rollout_logprobs: length R, behaviour-policy log-probs of the response tokens.
        reward: scalar reward (Binary RL: +1, -1 or 0), or None when the sample has no RL term.
        policy_version: the policy version that sampled the OLDEST response token; staleness (the
            consuming version minus this) is therefore never understated for a partial rollout.
        temperature: sampling temperature (logits are divided by it when recomputing log-probs).
        kind: ``"rl"`` | ``"opd"`` | ``"combine"``.
        teacher_logprobs: length R teacher log-probs (OPD), or None.
        teacher_topk_logprobs, teacher_topk_ids: ``[R][k]`` teacher top-k distribution (top-k
            distillation), or None.
        session_id, turn_index: where the sample came from (for records and debugging).
        info: free-form metadata (judge votes, reasons), never used by the loss.
        token_versions: length R, the policy version that sampled each response token (see
            :class:`Turn`), or None when all are ``policy_version``.

    Raises:
        ValueError: a length differs from R, or ``policy_version`` is not the oldest of ``token_versions``.
    """

    tokens: list[int]
    prompt_len: int
    loss_mask: list[int]
    rollout_logprobs: list[float]
    reward: float | None
    policy_version: int
    temperature: float = 1.0
    kind: str = "rl"
    teacher_logprobs: list[float] | None = None
    teacher_topk_logprobs: list[list[float]] | None = None
    teacher_topk_ids: list[list[int]] | None = None
    session_id: str = ""
    turn_index: int = 0
    info: dict[str, Any] = field(default_factory=dict)
    token_versions: list[int] | None = None

    def __post_init__(self) -> None:
        n_resp = len(self.tokens) - self.prompt_len
        if self.prompt_len < 1 or n_resp < 1:
            raise ValueError(
                f"sample needs >= 1 prompt and response token, got P={self.prompt_len}, len(tokens)={len(self.tokens)}"
            )
        for name in ("loss_mask", "rollout_logprobs"):
            if len(getattr(self, name)) != n_resp:
                raise ValueError(f"{name} has length {len(getattr(self, name))}, expected R={n_resp}")
        if self.teacher_logprobs is not None and len(self.teacher_logprobs) != n_resp:
            raise ValueError(f"teacher_logprobs has length {len(self.teacher_logprobs)}, expected R={n_resp}")
        if self.token_versions is not None:
            if len(self.token_versions) != n_resp:
                raise ValueError(f"token_versions has length {len(self.token_versions)}, expected R={n_resp}")
            if min(self.token_versions) != self.policy_version:
                raise ValueError(
                    f"policy_version {self.policy_version} is not the oldest token version {min(self.token_versions)}"
                )
        for name in ("teacher_topk_logprobs", "teacher_topk_ids"):
            value = getattr(self, name)
            if value is not None and len(value) != n_resp:
                raise ValueError(f"{name} has {len(value)} rows, expected R={n_resp}")

    @property
    def response_len(self) -> int:
        """R, the number of response tokens."""
        return len(self.tokens) - self.prompt_len

    @classmethod
    def from_turn(cls, turn: Turn, reward: float | None, kind: str = "rl", **info: Any) -> "Sample":
        """A sample training every response token of ``turn``."""
        return cls(
            tokens=list(turn.prompt_ids) + list(turn.response_ids),
            prompt_len=len(turn.prompt_ids),
            loss_mask=[1] * len(turn.response_ids),
            rollout_logprobs=list(turn.rollout_logprobs),
            reward=reward,
            policy_version=turn.policy_version,
            temperature=turn.temperature,
            kind=kind,
            session_id=turn.session_id,
            turn_index=turn.turn_index,
            info=dict(info),
            token_versions=None if turn.token_versions is None else list(turn.token_versions),
        )


@dataclass(frozen=True)
class SampleMeta:
    """The few scalars of a :class:`Sample` that the driver needs to take a batch, compute its
    advantages and log the step; the queue keeps them beside the sample's object ref, so the driver
    never fetches a payload (token lists, logprobs, teacher top-k arrays): only the learners do.

    Attributes:
        policy_version: version of the policy that generated the response.
        reward: the sample's scalar reward, or None (pure OPD).
        num_tokens: prompt + response length P + R, in tokens.
        trainable_tokens: response tokens that carry gradient (``sum(loss_mask)``); 0 = all-masked.
        prompt_key: a digest of the prompt token ids (blake2b, 128 bits, hex): equal prompts, equal
            keys; the GRPO group of the sample.
        kind: ``"rl"`` | ``"opd"`` | ``"combine"``.
        session_id, turn_index: where the sample came from ("trained once" audits).
        opening_key: the session's opening (``info["opening"]``, else the session id): its group
            under ``trainer.group_by=session_prefix``.
        outcome: the session outcome the sample's return includes (``info["outcome"]``), or None.
        shaping: ``((term, signed contribution), ...)`` of the dense shaping terms (``info["shaping"]``).
        teacher: the sample carries teacher log-probs (an OPD term; a Combine turn without an accepted
            hint carries none: its reward alone).
    """

    policy_version: int
    reward: float | None
    num_tokens: int
    trainable_tokens: int
    prompt_key: str
    kind: str = "rl"
    session_id: str = ""
    turn_index: int = 0
    opening_key: str = ""
    outcome: float | None = None
    shaping: tuple[tuple[str, float], ...] = ()
    teacher: bool = False

    @classmethod
    def of(cls, sample: Sample) -> "SampleMeta":
        """The metadata of ``sample`` (computed where the sample is built, before it is queued)."""
        prompt = ",".join(map(str, sample.tokens[: sample.prompt_len])).encode()
        return cls(
            policy_version=int(sample.policy_version),
            reward=sample.reward,
            num_tokens=len(sample.tokens),
            trainable_tokens=int(sum(sample.loss_mask)),
            prompt_key=hashlib.blake2b(prompt, digest_size=16).hexdigest(),
            kind=sample.kind,
            session_id=sample.session_id,
            turn_index=sample.turn_index,
            opening_key=str(sample.info.get("opening", sample.session_id)),
            outcome=sample.info.get("outcome"),
            shaping=tuple(sorted((str(k), float(v)) for k, v in sample.info.get("shaping", {}).items())),
            teacher=sample.teacher_logprobs is not None or sample.teacher_topk_logprobs is not None,
        )
