"""The ``hf`` backend: a transformers causal LM with its own sampling loop; the fast test path.

The loop (one forward per token with the KV cache, then :func:`clawray.engines.base.sample_next_token`)
replaces ``model.generate`` on purpose: ``generate`` merges in library defaults (``top_k=50``) and the
model folder's ``generation_config.json`` (``top_k``, ``temperature``, ``repetition_penalty``, ...), so
it would sample from another distribution than the one whose log-probs are recorded. Here a request is
sampled with its own parameters only; the folder's generation config contributes its eos ids (as in
vLLM) and nothing else. The loop also polls the caller's cancel check before every token.
"""

from __future__ import annotations

from typing import Iterable

import torch

from clawray.algos.losses import sequence_logprobs
from clawray.engines.base import (
    CancelCheck,
    GenerateOutput,
    GenerateRequest,
    TokenCallback,
    WeightSpec,
    sample_next_token,
)


class HFBackend:
    """A transformers causal LM that samples, scores and loads weights.

    Requests are served one at a time (no padding, so each request's log-probs are exact).

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

    @staticmethod
    def _eos_ids(gen_config) -> list[int]:
        eos = gen_config.eos_token_id
        if eos is None:
            return []
        return [eos] if isinstance(eos, int) else list(eos)

    @torch.inference_mode()
    def generate(
        self,
        requests: list[GenerateRequest],
        on_tokens: TokenCallback | None = None,
        cancelled: CancelCheck | None = None,
    ) -> list[GenerateOutput]:
        """Sample each request in turn; see :meth:`clawray.engines.base.Backend.generate`."""
        return [self._generate_one(i, r, on_tokens, cancelled) for i, r in enumerate(requests)]

    def _generate_one(
        self, index: int, req: GenerateRequest, on_tokens: TokenCallback | None, cancelled: CancelCheck | None
    ) -> GenerateOutput:
        stop = set(req.stop_token_ids) | set(self.eos_ids)
        gen = self.rng if req.seed is None else torch.Generator(self.device).manual_seed(req.seed)
        inputs = torch.tensor([req.prompt_ids], device=self.device)
        past = None
        response: list[int] = []
        logprobs: list[float] = []
        finish = "length"
        while len(response) < req.max_tokens:
            if cancelled is not None and cancelled(index):
                finish = "abort"
                break
            out = self.model(input_ids=inputs, past_key_values=past, use_cache=True)
            past = out.past_key_values
            tok, lp = sample_next_token(out.logits[0, -1], req.temperature, req.top_p, gen)
            response.append(tok)
            logprobs.append(lp)
            if on_tokens is not None:
                on_tokens(index, [tok])
            if tok in stop:
                finish = "stop"
                break
            inputs = torch.tensor([[tok]], device=self.device)
        return GenerateOutput(response_ids=response, logprobs=logprobs, finish_reason=finish)

    @torch.inference_mode()
    def score(self, prompt_ids: list[int], response_ids: list[int], temperature: float = 1.0) -> list[float]:
        """Log-probs (length R) of ``response_ids`` after ``prompt_ids`` from one forward pass."""
        if not prompt_ids or not response_ids:
            raise ValueError("score needs a non-empty prompt and response")
        ids = torch.tensor([list(prompt_ids) + list(response_ids)], device=self.device)
        logits = self.model(input_ids=ids).logits[0, len(prompt_ids) - 1 : -1]
        return sequence_logprobs(logits, ids[0, len(prompt_ids) :], temperature).tolist()

    @torch.inference_mode()
    def score_topk(
        self, prompt_ids: list[int], response_ids: list[int], k: int, temperature: float = 1.0
    ) -> tuple[list[list[float]], list[list[int]]]:
        """The top-``k`` log-probs and ids at each response position (``[R][k]`` each, descending)."""
        if not prompt_ids or not response_ids:
            raise ValueError("score_topk needs a non-empty prompt and response")
        ids = torch.tensor([list(prompt_ids) + list(response_ids)], device=self.device)
        logits = self.model(input_ids=ids).logits[0, len(prompt_ids) - 1 : -1].float()
        t = temperature if temperature > 0 else 1.0
        top = torch.log_softmax(logits / t, dim=-1).topk(k, dim=-1)
        return top.values.tolist(), top.indices.tolist()

    def weight_specs(self) -> list[WeightSpec]:
        """Every tensor of the model's state dict, sorted by name (tied aliases included)."""
        sd = self.model.state_dict()
        return [WeightSpec(k, tuple(v.shape), str(v.dtype)) for k, v in sorted(sd.items())]

    @torch.inference_mode()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy full HF-named tensors into the model in place.

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
