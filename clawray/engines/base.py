"""The one interface every inference backend implements.

Log-prob convention (used by rollout, teacher scoring and the learner alike): the log-prob of token
``y_t`` is ``log_softmax(logits_t / T)[y_t]`` where ``T`` is the sampling temperature of the request
(``T = 1`` when the request is greedy, ``temperature == 0``). No top-p/top-k renormalisation is
applied, so the learner can recompute exactly the same quantity from logits.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable, Protocol

import torch


@dataclass
class GenerateRequest:
    """One generation request in token space.

    Attributes:
        prompt_ids: prompt token ids, length P >= 1.
        max_tokens: maximum number of response tokens to sample (>= 1).
        temperature: sampling temperature; 0 means greedy.
        top_p: nucleus mass in (0, 1].
        stop_token_ids: token ids that end the response (the stop token is kept in the output).
        seed: per-request sampling seed, or None.
    """

    prompt_ids: list[int]
    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    stop_token_ids: list[int] = field(default_factory=list)
    seed: int | None = None


@dataclass
class GenerateOutput:
    """What a backend returns for one request.

    Attributes:
        response_ids: sampled token ids, length R (includes the stop token when one ended the reply).
        logprobs: log-prob of each sampled token under the sampling distribution (see module doc),
            length R, natural log units.
        finish_reason: ``"stop"`` (a stop/eos token was sampled) or ``"length"`` (max_tokens hit).
    """

    response_ids: list[int]
    logprobs: list[float]
    finish_reason: str


#: ``on_tokens(request_index, new_token_ids)``: streaming callback of :meth:`Backend.generate`.
TokenCallback = Callable[[int, list[int]], None]


@dataclass(frozen=True)
class WeightSpec:
    """Name, shape and dtype of one weight tensor, as exchanged before a weight sync."""

    name: str
    shape: tuple[int, ...]
    dtype: str  # e.g. "torch.float32"


class Backend(Protocol):
    """An inference engine driven from a single thread.

    Implementations: :class:`clawray.engines.hf.HFBackend`, :class:`clawray.engines.vllm.VLLMBackend`.
    """

    def generate(self, requests: list[GenerateRequest], on_tokens: TokenCallback | None = None) -> list[GenerateOutput]:
        """Sample a response for every request (batched where the engine can).

        ``on_tokens(i, ids)``, when given, is called from the engine thread as request ``i``'s new
        token ids are sampled (streaming); the returned outputs are the same either way.
        """

    def score(self, prompt_ids: list[int], response_ids: list[int], temperature: float = 1.0) -> list[float]:
        """Log-probs (length R) of the given response ids after the given prompt (teacher path)."""

    def score_topk(self, prompt_ids: list[int], response_ids: list[int], k: int,
                   temperature: float = 1.0) -> tuple[list[list[float]], list[list[int]]]:
        """Top-k log-probs and ids (``[R][k]``, descending) at each response position (top-k teacher)."""

    def weight_specs(self) -> list[WeightSpec]:
        """The HF-named weights this engine loads, in the order a sync sends them."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load HF-named full tensors into the live model and drop any prefix/KV cache."""
