"""The one interface every inference backend implements.

Owns: the log-prob and sampling conventions, the :class:`Backend` protocol and its request and output
types, :func:`sample_next_token` and :func:`run_batch`. Must not: import Ray, load a model, or know the
RolloutEngine's thread and jobs (:mod:`clawray.actors.rollout`).

Log-prob convention (used by rollout, teacher scoring and the learner alike): the log-prob of token
``y_t`` is ``log_softmax(logits_t / T)[y_t]`` where ``T`` is the sampling temperature of the request
(``T = 1`` when the request is greedy, ``temperature == 0``). No top-p/top-k renormalisation is
applied, so the learner can recompute exactly the same quantity from logits.

Sampling convention (every backend, vLLM's semantics): a request is sampled with its own parameters
only -- ``temperature``, ``top_p``, ``seed``, ``max_tokens``, ``stop_token_ids`` (plus the model's eos
ids) -- never with defaults inherited from a library or the model folder's ``generation_config.json``
(no top-k, min-p or repetition penalties). The next token is drawn from ``softmax(logits / T)``
restricted to the top-p nucleus (the smallest set of most probable tokens whose mass reaches
``top_p``, renormalised); ``T = 0`` is greedy (argmax). See :func:`sample_next_token`.

Continuous batching: a backend is driven one step at a time (:meth:`Backend.add`, :meth:`Backend.step`,
:meth:`Backend.abort`), so its caller can add requests to the running batch and take each reply as soon
as it finishes, between steps (Orca, Yu et al. 2022, "iteration-level scheduling"). :func:`run_batch`
drives a fixed list of requests to the end; every backend's ``generate`` is that.

Cancellation: :meth:`Backend.abort` (or ``generate``'s ``cancelled(i)``, polled before every step) stops
a request at its next token (or before it starts); it comes back with ``finish_reason == "abort"`` and
the tokens it had.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Iterable, Protocol

if TYPE_CHECKING:  # torch is imported where a token is drawn: the server imports these types without it
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
        canary: canary traffic: the request's session is in the promotion gate's canary fraction
            (:func:`clawray.serve.routing.in_canary`); only an engine serving a canary checks it
            (:meth:`~clawray.actors.rollout.RolloutEngine.set_arm`), backends ignore it.
    """

    prompt_ids: list[int]
    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    stop_token_ids: list[int] = field(default_factory=list)
    seed: int | None = None
    canary: bool = False


@dataclass
class GenerateOutput:
    """What a backend returns for one request.

    Attributes:
        response_ids: sampled token ids, length R (includes the stop token when one ended the reply).
        logprobs: log-prob of each sampled token under the sampling distribution (see module doc),
            length R, natural log units.
        finish_reason: ``"stop"`` (a stop/eos token was sampled), ``"length"`` (max_tokens hit) or
            ``"abort"`` (cancelled part-way, by the caller or by a weight sync's interrupt; never a
            complete reply, but its tokens and log-probs so far are exact).
        rescored: the log-probs were computed after the reply ended, on the weights loaded then (vLLM
            top-p replies, see :mod:`clawray.engines.vllm`): they are that version's, whichever
            version sampled each token (an in-flight load can fall inside the reply).
    """

    response_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    rescored: bool = False


#: ``on_tokens(request_index, new_token_ids)``: streaming callback of :meth:`Backend.generate`.
TokenCallback = Callable[[int, list[int]], None]

#: ``cancelled(request_index) -> bool``: polled by :meth:`Backend.generate` between tokens.
CancelCheck = Callable[[int], bool]


def sample_next_token(
    logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator | None
) -> tuple[int, float]:
    """Draw one token the way vLLM does (temperature, then top-p nucleus) and return its log-prob
    under the module's convention (full softmax at ``T``, no nucleus renormalisation).

    Args:
        logits: ``[V]`` raw next-token logits (any float dtype; computed in float32).
        temperature: ``T``; ``0`` means greedy (argmax, log-prob at ``T = 1``).
        top_p: nucleus mass in (0, 1]: a token is kept when the mass of the tokens more probable
            than it is ``< top_p`` (so the most probable token is always kept; Holtzman et al. 2020,
            "The Curious Case of Neural Text Degeneration", sec. 3.1).
        generator: the RNG of the draw (``torch.multinomial``); unused when greedy.

    Returns:
        ``(token_id, logprob)``: ``logprob = log_softmax(logits / T)[token_id]`` (natural log).
    """
    import torch

    logits = logits.float()
    if temperature <= 0:
        tok = int(logits.argmax())
        return tok, float(torch.log_softmax(logits, dim=-1)[tok])
    logp = torch.log_softmax(logits / temperature, dim=-1)
    probs = logp.exp()
    if top_p < 1.0:
        sorted_p, order = probs.sort(descending=True)
        outside = (sorted_p.cumsum(0) - sorted_p) >= top_p  # mass before the token already reaches top_p
        sorted_p = sorted_p.masked_fill(outside, 0.0)
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_p)
    tok = int(torch.multinomial(probs, 1, generator=generator))
    return tok, float(logp[tok])


@dataclass(frozen=True)
class WeightSpec:
    """Name, shape and dtype of one weight tensor, as exchanged before a weight sync."""

    name: str
    shape: tuple[int, ...]
    dtype: str  # e.g. "torch.float32"


@dataclass
class StepOutput:
    """What one :meth:`Backend.step` produced.

    Attributes:
        new_tokens: request key -> the token ids it sampled in this step (for streaming; a
            finished request's ids are also in its output).
        finished: request key -> the whole output of each request that ended in this step
            (``stop``, ``length`` or ``abort``); the backend forgets these keys.
    """

    new_tokens: dict[int, list[int]] = field(default_factory=dict)
    finished: dict[int, GenerateOutput] = field(default_factory=dict)


class Backend(Protocol):
    """An inference engine driven from a single thread, one step at a time.

    Implementations: :class:`clawray.engines.hf.HFBackend` (one request at a time, in the order they
    were added), :class:`clawray.engines.vllm.VLLMBackend` (vLLM's own continuous batching).
    """

    def add(self, key: int, request: GenerateRequest) -> None:
        """Add a request to the running batch under the caller's ``key`` (unique among running ones).

        Raises:
            ValueError: the engine rejects the request (e.g. prompt longer than ``max_model_len``);
                nothing was added.
        """

    def can_add(self) -> bool:
        """Whether :meth:`add` may be called now. False while the backend needs the running requests
        to finish first (vLLM: a finished top-p reply awaits its re-score, which runs alone)."""

    def step(self) -> StepOutput:
        """Advance the running requests by one engine step (the module's sampling convention)."""

    def abort(self, keys: list[int]) -> None:
        """Stop these running requests; each comes back in the next :meth:`step`'s ``finished`` with
        ``finish_reason == "abort"`` and its tokens (and log-probs) so far. Unknown keys are ignored."""

    def clear(self) -> None:
        """Drop every running request, without outputs (after :meth:`step` raised)."""

    def generate(
        self,
        requests: list[GenerateRequest],
        on_tokens: TokenCallback | None = None,
        cancelled: CancelCheck | None = None,
    ) -> list[GenerateOutput]:
        """:func:`run_batch` on this backend."""

    def logprobs(self, prompt_ids: list[int], response_ids: list[int], temperature: float = 1.0) -> list[float]:
        """Log-probs (length R) of the given response ids after the given prompt (teacher path)."""

    def topk_logprobs(
        self, prompt_ids: list[int], response_ids: list[int], k: int, temperature: float = 1.0
    ) -> tuple[list[list[float]], list[list[int]]]:
        """Top-k log-probs and ids (``[R][k]``, descending) at each response position (top-k teacher)."""

    def weight_specs(self) -> list[WeightSpec]:
        """The HF-named weights this engine loads, in the order a sync sends them."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load HF-named full tensors into the live model and drop any prefix/KV cache.

        May run between two :meth:`step` calls with requests running (``sync.mode: inflight``): their
        KV cache is recomputed on the new weights at the next step, so every token they sample
        afterwards (and its log-prob) is exactly the new weights'."""


def run_batch(
    backend: Backend,
    requests: list[GenerateRequest],
    on_tokens: TokenCallback | None = None,
    cancelled: CancelCheck | None = None,
) -> list[GenerateOutput]:
    """Sample a response for every request (together, as the backend batches) and return the
    outputs in request order.

    ``on_tokens(i, ids)``, when given, is called as request ``i``'s new token ids are sampled
    (streaming); the outputs are the same either way. ``cancelled(i)``, when given, is polled before
    every step: a cancelled request stops there and returns ``finish_reason == "abort"`` with what it
    had so far.

    Raises:
        ValueError: the backend rejected a request (none of them runs).
        Exception: whatever a step raised; the backend is cleared first, so no request is left in it.
    """
    try:
        for i, request in enumerate(requests):
            backend.add(i, request)
        outputs: dict[int, GenerateOutput] = {}
        aborted: set[int] = set()
        while len(outputs) < len(requests):
            if cancelled is not None:
                gone = [i for i in range(len(requests)) if i not in outputs and i not in aborted and cancelled(i)]
                backend.abort(gone)
                aborted.update(gone)
            step = backend.step()
            if on_tokens is not None:
                for i, ids in step.new_tokens.items():
                    on_tokens(i, ids)
            outputs.update(step.finished)
    except BaseException:
        backend.clear()
        raise
    return [outputs[i] for i in range(len(requests))]


class SteppedBackend:
    """Gives a stepped backend its batch ``generate`` (:func:`run_batch`)."""

    def generate(
        self,
        requests: list[GenerateRequest],
        on_tokens: TokenCallback | None = None,
        cancelled: CancelCheck | None = None,
    ) -> list[GenerateOutput]:
        """Sample every request to the end; see :func:`run_batch`."""
        return run_batch(self, requests, on_tokens, cancelled)  # type: ignore[arg-type]
