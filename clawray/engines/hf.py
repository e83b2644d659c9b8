"""The ``hf`` backend: a transformers causal LM with its own sampling loop; the fast test path.

Owns: the model in this process and its sampling loop. Must not: import Ray, call ``model.generate``, or
take sampling defaults from the model folder (only its eos ids).

The loop (one forward per token with the KV cache, then :func:`clawray.engines.base.sample_next_token`,
one request at a time in the order they were added: a step samples one token of the oldest request)
replaces ``model.generate`` on purpose: ``generate`` merges in library defaults (``top_k=50``) and the
model folder's ``generation_config.json`` (``top_k``, ``temperature``, ``repetition_penalty``, ...), so
it would sample from another distribution than the one whose log-probs are recorded. Here a request is
sampled with its own parameters only; the folder's generation config contributes its eos ids (as in
vLLM) and nothing else. A request aborted between steps stops before its next token.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable

import torch

from clawray.algos.losses import sequence_logprobs
from clawray.engines.base import (
    GenerateOutput,
    GenerateRequest,
    SteppedBackend,
    StepOutput,
    WeightSpec,
    sample_next_token,
)


@dataclass
class _Run:
    """One request's sampling state: its KV cache, the next input ids and the reply so far."""

    request: GenerateRequest
    stop: set[int]
    generator: torch.Generator
    inputs: torch.Tensor  # [1, P] before the first token (after an in-flight load: P + tokens so far), then [1, 1]
    past: Any = None
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)


class HFBackend(SteppedBackend):
    """A transformers causal LM that samples, scores and loads weights.

    Requests are served one at a time, oldest first (no padding, so each request's log-probs are
    exact): :meth:`step` samples one token of the oldest running request.

    Args:
        model_path: a local HF folder.
        dtype: torch dtype name of the weights in memory (``"float32"`` default).
        device: ``"cpu"`` or ``"cuda"``.
        seed: seeds the engine's own RNG once; requests without a seed continue its stream, a
            request with a seed gets a fresh generator seeded with it (same seed, same reply).
        **_: other engine options (ignored here, accepted so configs can switch backends).
    """

    def __init__(self, model_path: str, *, dtype: str = "float32", device: str = "cpu", seed: int = 0, **_):
        from transformers import AutoModelForCausalLM

        self.device = torch.device(device)
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype)).to(self.device)
        self.model.eval()
        self.eos_ids = self._eos_ids(self.model.generation_config)
        self.rng = torch.Generator(self.device).manual_seed(seed)
        self._runs: dict[int, _Run] = {}  # running requests by key, oldest first
        self._aborted: list[int] = []

    @staticmethod
    def _eos_ids(gen_config) -> list[int]:
        eos = gen_config.eos_token_id
        if eos is None:
            return []
        return [eos] if isinstance(eos, int) else list(eos)

    def add(self, key: int, request: GenerateRequest) -> None:
        """Queue a request behind the running ones (see :meth:`clawray.engines.base.Backend.add`)."""
        if not request.prompt_ids:
            raise ValueError("generate needs a non-empty prompt")
        gen = self.rng if request.seed is None else torch.Generator(self.device).manual_seed(request.seed)
        inputs = torch.tensor([request.prompt_ids], device=self.device)
        self._runs[key] = _Run(request, set(request.stop_token_ids) | set(self.eos_ids), gen, inputs)

    def can_add(self) -> bool:
        """Always: a request added now runs after the ones before it."""
        return True

    def abort(self, keys: list[int]) -> None:
        """Stop these requests before their next token (reported by the next :meth:`step`)."""
        self._aborted += [k for k in keys if k in self._runs]

    def clear(self) -> None:
        """Drop every request."""
        self._runs.clear()
        self._aborted = []

    @torch.inference_mode()
    def step(self) -> StepOutput:
        """Report the aborted requests, then sample one token of the oldest running request (one
        forward pass with its KV cache)."""
        out = StepOutput()
        for key in self._aborted:
            if key in self._runs:
                run = self._runs.pop(key)
                out.finished[key] = GenerateOutput(run.ids, run.logprobs, "abort")
        self._aborted = []
        if not self._runs:
            return out
        key, run = next(iter(self._runs.items()))
        fwd = self.model(input_ids=run.inputs, past_key_values=run.past, use_cache=True, logits_to_keep=1)
        run.past = fwd.past_key_values
        tok, lp = sample_next_token(fwd.logits[0, -1], run.request.temperature, run.request.top_p, run.generator)
        run.ids.append(tok)
        run.logprobs.append(lp)
        out.new_tokens[key] = [tok]
        finish = "stop" if tok in run.stop else "length" if len(run.ids) >= run.request.max_tokens else None
        if finish is None:
            run.inputs = torch.tensor([[tok]], device=self.device)
        else:
            del self._runs[key]
            out.finished[key] = GenerateOutput(run.ids, run.logprobs, finish)
        return out

    @torch.inference_mode()
    def logprobs(self, prompt_ids: list[int], response_ids: list[int], temperature: float = 1.0) -> list[float]:
        """Log-probs (length R) of ``response_ids`` after ``prompt_ids`` from one forward pass (only the
        R + 1 positions from the prompt's last token on reach the vocabulary projection)."""
        if not prompt_ids or not response_ids:
            raise ValueError("score needs a non-empty prompt and response")
        ids = torch.tensor([list(prompt_ids) + list(response_ids)], device=self.device)
        logits = self.model(input_ids=ids, logits_to_keep=len(response_ids) + 1).logits[0, :-1]
        return sequence_logprobs(logits, ids[0, len(prompt_ids) :], temperature).tolist()

    @torch.inference_mode()
    def topk_logprobs(
        self, prompt_ids: list[int], response_ids: list[int], k: int, temperature: float = 1.0
    ) -> tuple[list[list[float]], list[list[int]]]:
        """The top-``k`` log-probs and ids at each response position (``[R][k]`` each, descending)."""
        if not prompt_ids or not response_ids:
            raise ValueError("topk_logprobs needs a non-empty prompt and response")
        ids = torch.tensor([list(prompt_ids) + list(response_ids)], device=self.device)
        logits = self.model(input_ids=ids, logits_to_keep=len(response_ids) + 1).logits[0, :-1].float()
        t = temperature if temperature > 0 else 1.0
        top = torch.log_softmax(logits / t, dim=-1).topk(k, dim=-1)
        return top.values.tolist(), top.indices.tolist()

    def weight_specs(self) -> list[WeightSpec]:
        """Every tensor of the model's state dict, sorted by name (tied aliases included)."""
        sd = self.model.state_dict()
        return [WeightSpec(k, tuple(v.shape), str(v.dtype)) for k, v in sorted(sd.items())]

    @torch.inference_mode()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy full HF-named tensors into the model in place. Running requests (an in-flight load)
        drop their KV cache: the next step re-prefills prompt + tokens so far on the new weights.

        Raises:
            KeyError: a name the model does not have.
            ValueError: a shape that differs from the model's.
        """
        params = self.model.state_dict()
        for name, tensor in weights:
            if name not in params:
                raise KeyError(f"weight {name!r} is not a parameter of this model")
            if tuple(params[name].shape) != tuple(tensor.shape):
                raise ValueError(f"weight {name!r}: shape {tuple(tensor.shape)} != model's {tuple(params[name].shape)}")
            params[name].copy_(tensor)
        for run in self._runs.values():  # an in-flight load: recompute each running reply's KV on these weights
            if run.past is not None:
                prefix = list(run.request.prompt_ids) + run.ids
                run.inputs, run.past = torch.tensor([prefix], device=self.device), None
