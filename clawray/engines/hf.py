"""The ``hf`` backend: transformers ``generate`` on CPU or GPU; the fast test path."""

from __future__ import annotations

from typing import Iterable

import torch
from transformers import GenerationConfig

from clawray.algos.losses import sequence_logprobs
from clawray.engines.base import GenerateOutput, GenerateRequest, TokenCallback, WeightSpec


class _TokenStreamer:
    """transformers streamer protocol (``put``/``end``): forwards each sampled token to ``on_tokens``.
    ``generate`` first puts the prompt, which is skipped."""

    def __init__(self, index: int, on_tokens: TokenCallback):
        self.index, self.on_tokens, self.prompt_seen = index, on_tokens, False

    def put(self, value: torch.Tensor) -> None:
        if not self.prompt_seen:
            self.prompt_seen = True
            return
        self.on_tokens(self.index, value.reshape(-1).tolist())

    def end(self) -> None:
        pass


class HFBackend:
    """A transformers causal LM that samples, scores and loads weights.

    Requests are served one at a time (no padding, so each request's log-probs are exact).

    Args:
        model_path: a local HF folder.
        dtype: torch dtype name of the weights in memory (``"float32"`` default).
        device: ``"cpu"`` or ``"cuda"``.
        seed: seeds the engine's RNG once; requests without a seed continue its stream.
        **_: other engine options (ignored here, accepted so configs can switch backends).
    """

    def __init__(self, model_path: str, *, dtype: str = "float32", device: str = "cpu", seed: int = 0, **_):
        from transformers import AutoModelForCausalLM

        self.device = torch.device(device)
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype)).to(self.device)
        self.model.eval()
        self.eos_ids = self._eos_ids(self.model.generation_config)
        self.pad_id = self.model.config.pad_token_id if self.model.config.pad_token_id is not None else self.eos_ids[0]
        torch.manual_seed(seed)

    @staticmethod
    def _eos_ids(gen_config) -> list[int]:
        eos = gen_config.eos_token_id
        if eos is None:
            return []
        return [eos] if isinstance(eos, int) else list(eos)

    @torch.inference_mode()
    def generate(self, requests: list[GenerateRequest], on_tokens: TokenCallback | None = None) -> list[GenerateOutput]:
        """Sample each request in turn; see :meth:`clawray.engines.base.Backend.generate`."""
        return [self._generate_one(r, _TokenStreamer(i, on_tokens) if on_tokens else None)
                for i, r in enumerate(requests)]

    def _generate_one(self, req: GenerateRequest, streamer: _TokenStreamer | None = None) -> GenerateOutput:
        stop = list(dict.fromkeys(list(req.stop_token_ids) + self.eos_ids))
        greedy = req.temperature <= 0
        if req.seed is not None:  # unseeded requests continue the engine's RNG stream
            torch.manual_seed(req.seed)
        ids = torch.tensor([req.prompt_ids], device=self.device)
        gen_config = GenerationConfig(
            do_sample=not greedy,
            temperature=None if greedy else req.temperature,
            top_p=None if greedy else req.top_p,
            top_k=None,
            max_new_tokens=req.max_tokens,
            eos_token_id=stop or None,
            pad_token_id=self.pad_id,
            output_logits=True,
            return_dict_in_generate=True,
        )
        out = self.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=gen_config,
                                  streamer=streamer)
        response = out.sequences[0, ids.shape[1]:]
        logits = torch.stack(out.logits, dim=1)[0, : response.shape[0]]  # [R, V] raw logits
        logprobs = sequence_logprobs(logits, response, req.temperature)
        response_ids = response.tolist()
        finish = "stop" if response_ids and response_ids[-1] in stop else "length"
        return GenerateOutput(response_ids=response_ids, logprobs=logprobs.tolist(), finish_reason=finish)

    @torch.inference_mode()
    def score(self, prompt_ids: list[int], response_ids: list[int], temperature: float = 1.0) -> list[float]:
        """Log-probs (length R) of ``response_ids`` after ``prompt_ids`` from one forward pass."""
        if not prompt_ids or not response_ids:
            raise ValueError("score needs a non-empty prompt and response")
        ids = torch.tensor([list(prompt_ids) + list(response_ids)], device=self.device)
        logits = self.model(input_ids=ids).logits[0, len(prompt_ids) - 1 : -1]
        return sequence_logprobs(logits, ids[0, len(prompt_ids):], temperature).tolist()

    @torch.inference_mode()
    def score_topk(self, prompt_ids: list[int], response_ids: list[int], k: int,
                   temperature: float = 1.0) -> tuple[list[list[float]], list[list[int]]]:
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
