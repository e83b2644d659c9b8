"""Evaluation: an environment's held-out prompts through an engine, first-turn success with 95% CIs.

Owns: the protocol below (prompts, seeds, first-reply scoring, Wilson intervals), when the main job
evaluates (:class:`RunEvaluations`) and its ``eval.json``. Must not: start or choose an engine (it takes
a ``generate`` callable), parse a reply otherwise than the server does (:mod:`clawray.serve.reply`) or
end a training run (a failed evaluation is printed).

Used by ``clawray eval`` (a model or checkpoint folder on its own engine) and by the main job (its
rollout engine 0, which serves the current policy, so no extra engine is loaded).

Protocol: the first ``num_prompts`` tasks of ``env.prompts(split, seed)``; each one's opening
message is rendered with the model folder's chat template (and the environment's tools) exactly as
the policy server renders a first turn; ``n`` replies are sampled per prompt at ``temperature``
with per-sample seeds fixed by ``(seed, prompt index, sample index)``, so evaluations of two
policies are paired. The FIRST reply is scored with ``env.check`` (the simulated user's own check);
each success measure gets its mean and a 95% Wilson score interval over all ``prompts x n``
samples (samples of one prompt are not independent, so the interval is somewhat narrow when the
success rate varies a lot between prompts).
"""

from __future__ import annotations

import json
import math
import os
import time
from typing import Any, Callable, Sequence

from clawray.engines.base import GenerateRequest
from clawray.envs.base import Environment, Problem

Z95 = 1.959963984540054  # the 97.5% quantile of the standard normal


def wilson_interval(successes: float, n: int, z: float = Z95) -> tuple[float, float]:
    """The Wilson score interval for a binomial proportion (Wilson 1927, JASA 22:209; Brown, Cai &
    DasGupta 2001, eq. 4): ``(center -/+ half) / (1 + z^2/n)`` with ``center = p + z^2/(2n)`` and
    ``half = z * sqrt(p(1-p)/n + z^2/(4n^2))``, ``p = successes / n``.

    ``successes`` may be fractional (a mean of [0, 1]-valued measures times n).

    Returns:
        ``(lo, hi)`` in [0, 1]; e.g. 56 of 100 at z = 1.96 gives (0.4622, 0.6532).

    Raises:
        ValueError: ``n < 1`` or ``successes`` outside ``[0, n]``.
    """
    if n < 1:
        raise ValueError(f"the Wilson interval needs n >= 1 samples, got {n}")
    if not 0 <= successes <= n:
        raise ValueError(f"successes must be in [0, {n}], got {successes}")
    p = successes / n
    z2 = z * z
    denom = 1 + z2 / n
    center = (p + z2 / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n)) / denom
    # the bounds are exactly 0 at no successes and 1 at all successes (no rounding residue)
    lo = 0.0 if successes == 0 else max(0.0, center - half)
    hi = 1.0 if successes == n else min(1.0, center + half)
    return lo, hi


def summarize(scores: Sequence[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per measure: ``{"mean", "successes", "n", "lo", "hi"}`` (Wilson 95%) over the samples' scores.

    Raises:
        ValueError: no scores, or a measure outside [0, 1].
    """
    if not scores:
        raise ValueError("no scores to summarize")
    out = {}
    for name in scores[0]:
        values = [float(s[name]) for s in scores]
        if any(not 0.0 <= v <= 1.0 for v in values):
            raise ValueError(f"measure {name!r} has values outside [0, 1]")
        k, n = sum(values), len(values)
        lo, hi = wilson_interval(k, n)
        out[name] = {"mean": k / n, "successes": k, "n": n, "lo": lo, "hi": hi}
    return out


def resolve_model_dir(path: str) -> str:
    """The HF model folder behind ``path``: a model folder (has ``config.json``), a checkpoint
    (``ckpt-NNNNNN/``: its ``model/``) or a run's checkpoints folder (the one ``latest`` names).

    Raises:
        FileNotFoundError: none of these, with what was looked for.
    """
    from clawray.checkpoint import latest_checkpoint

    path = os.path.abspath(os.path.expanduser(path))
    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    if os.path.isfile(os.path.join(path, "model", "config.json")):
        return os.path.join(path, "model")
    latest = latest_checkpoint(path)
    if latest is not None and os.path.isfile(os.path.join(latest, "model", "config.json")):
        return os.path.join(latest, "model")
    raise FileNotFoundError(
        f"{path} is neither a model folder (config.json), a checkpoint (model/config.json) "
        "nor a checkpoints folder with a committed ckpt-*"
    )


class Evaluator:
    """Builds the evaluation requests of one environment for one tokenizer and scores the replies.

    Args:
        env: the environment.
        tokenizer: the model folder's HF tokenizer (its chat template renders the prompts).
        n: samples per prompt (>= 1).
        num_prompts: prompts of the split used (0 = all of them).
        temperature: sampling temperature (0 = greedy; then ``n`` should be 1).
        seed: orders the split's prompts and seeds each sample.
        max_tokens: most response tokens per sample.
        split: ``"eval"`` (held out) or ``"train"``.
        untagged_tool_calls: parse replies as the server does with ``serve.untagged_tool_calls``.

    Raises:
        ValueError: ``n`` < 1, ``num_prompts`` < 0, or a split with no prompts.
    """

    def __init__(
        self,
        env: Environment,
        tokenizer: Any,
        *,
        n: int = 4,
        num_prompts: int = 0,
        temperature: float = 0.7,
        seed: int = 0,
        max_tokens: int = 96,
        split: str = "eval",
        untagged_tool_calls: bool = False,
    ):
        if n < 1 or num_prompts < 0 or max_tokens < 1:
            raise ValueError(f"need n >= 1, num_prompts >= 0, max_tokens >= 1; got {n}, {num_prompts}, {max_tokens}")
        self.env, self.tokenizer = env, tokenizer
        self.n, self.temperature, self.seed, self.max_tokens, self.split = n, temperature, seed, max_tokens, split
        self.untagged_tool_calls = untagged_tool_calls
        tasks = env.prompts(split, seed)
        self.tasks: list[Problem] = tasks[:num_prompts] if num_prompts else tasks
        if not self.tasks:
            raise ValueError(f"environment {env.name!r} has no {split} prompts")
        self.stop_ids = [tokenizer.convert_tokens_to_ids(tokenizer.eos_token)]
        from clawray.serve.reply import ReplyDecoder

        self.reply_text = ReplyDecoder(tokenizer)  # the client's text: special tokens hidden, as served

    def requests(self) -> list[GenerateRequest]:
        """``len(tasks) * n`` requests, prompt-major; sample ``j`` of prompt ``i`` has seed
        ``seed * 1_000_003 + i * n + j`` (mod 2**31)."""
        out = []
        for i, task in enumerate(self.tasks):
            text = self.tokenizer.apply_chat_template(
                self.env.opening(task), tools=self.env.tools, add_generation_prompt=True, tokenize=False
            )
            ids = self.tokenizer.encode(text, add_special_tokens=False)
            for j in range(self.n):
                out.append(
                    GenerateRequest(
                        prompt_ids=ids,
                        max_tokens=self.max_tokens,
                        temperature=self.temperature,
                        stop_token_ids=self.stop_ids,
                        seed=(self.seed * 1_000_003 + i * self.n + j) % 2**31,
                    )
                )
        return out

    def reply_message(self, response_ids: list[int]) -> dict[str, Any]:
        """The assistant message of a response, parsed as the policy server parses it."""
        from clawray.serve.reply import parse_reply_text

        body = response_ids[:-1] if response_ids and response_ids[-1] in self.stop_ids else response_ids
        text = self.reply_text.complete(body)
        return parse_reply_text(text, tools=self.env.tools or True, untagged=self.untagged_tool_calls).message()

    def run(self, generate: Callable[[list[GenerateRequest]], list[Any]], chunk: int = 0) -> dict[str, Any]:
        """Generate with ``generate(requests) -> outputs`` (each a ``GenerateOutput`` or a dict with
        ``response_ids``, optionally ``policy_version``) and score every first reply. ``chunk`` > 0
        calls ``generate`` on that many requests at a time and shows a progress bar on the terminal
        (:func:`clawray.console.progress`); 0 makes one call.

        Returns:
            ``{"env", "split", "prompts", "n", "samples", "temperature", "seed", "max_tokens",
            "seconds", "policy_versions" (sorted distinct versions, when reported), "metrics"
            (:func:`summarize`), "replies" ([{"question", "reply", "scores"}])}``.
        """
        t0 = time.perf_counter()
        reqs = self.requests()
        if chunk > 0:
            from clawray.console import progress

            outs = []
            with progress(total=len(reqs), desc="eval", unit="sample") as bar:
                for i in range(0, len(reqs), chunk):
                    outs.extend(generate(reqs[i : i + chunk]))
                    bar.update(len(reqs[i : i + chunk]))
        else:
            outs = generate(reqs)
        versions, replies, scores = set(), [], []
        for k, out in enumerate(outs):
            get = out.get if isinstance(out, dict) else lambda key, d=None, o=out: getattr(o, key, d)
            if get("policy_version") is not None:
                versions.add(get("policy_version"))
            task = self.tasks[k // self.n]
            msg = self.reply_message(list(get("response_ids")))
            s = self.env.check(task, [*self.env.opening(task), msg])
            scores.append(s)
            replies.append({"question": task.question, "reply": msg.get("content"), "scores": s})
        return {
            "env": self.env.name,
            "split": self.split,
            "prompts": len(self.tasks),
            "n": self.n,
            "samples": len(outs),
            "temperature": self.temperature,
            "seed": self.seed,
            "max_tokens": self.max_tokens,
            "seconds": time.perf_counter() - t0,
            "policy_versions": sorted(versions),
            "metrics": summarize(scores),
            "replies": replies,
        }


def format_metrics(metrics: dict[str, dict[str, float]]) -> str:
    """``solved 56.0% [46.2, 65.3] | correct ...``: each measure's mean and 95% CI in percent."""
    return " | ".join(
        f"{k} {100 * m['mean']:.1f}% [{100 * m['lo']:.1f}, {100 * m['hi']:.1f}]" for k, m in metrics.items()
    )


def format_change(before: dict[str, dict[str, float]], after: dict[str, dict[str, float]]) -> list[str]:
    """One line per measure: ``solved: 56.0% [46.2, 65.3] -> 74.8% [70.3, 78.8] (+18.8 points, CIs
    do not overlap)``."""
    lines = []
    for k in before:
        if k not in after:
            continue
        b, a = before[k], after[k]
        overlap = "CIs overlap" if a["lo"] <= b["hi"] and b["lo"] <= a["hi"] else "CIs do not overlap"
        lines.append(
            f"{k}: {100 * b['mean']:.1f}% [{100 * b['lo']:.1f}, {100 * b['hi']:.1f}] -> "
            f"{100 * a['mean']:.1f}% [{100 * a['lo']:.1f}, {100 * a['hi']:.1f}] "
            f"({100 * (a['mean'] - b['mean']):+.1f} points, {overlap})"
        )
    return lines


def flat_metrics(metrics: dict[str, dict[str, float]], prefix: str = "eval/") -> dict[str, float]:
    """``{"eval/<m>": mean, "eval/<m>_lo": lo, "eval/<m>_hi": hi}`` for logging."""
    out = {}
    for k, m in metrics.items():
        out[f"{prefix}{k}"], out[f"{prefix}{k}_lo"], out[f"{prefix}{k}_hi"] = m["mean"], m["lo"], m["hi"]
    return out


class RunEvaluations:
    """The job's evaluations of the current policy (``eval.*``): before the loop, every
    ``eval.every_steps`` steps and after it; each logged, kept in :attr:`results` and written to
    ``run_dir/eval.json``, which a resumed run continues (:meth:`resume`).

    Args:
        eval_cfg: the ``eval`` config section (``enabled``, ``every_steps``, ``n``, ``num_prompts``,
            ``temperature``, ``seed``).
        env_cfg: the ``env`` config section (the environment and its ``max_tokens``).
        run_dir: the run folder.
        untagged_tool_calls: ``serve.untagged_tool_calls`` (replies are parsed as served).
    """

    def __init__(self, eval_cfg: Any, env_cfg: Any, run_dir: str, untagged_tool_calls: bool = False):
        self.cfg, self.env_cfg, self.run_dir = eval_cfg, env_cfg, run_dir
        self.untagged_tool_calls = untagged_tool_calls
        self.results: list[dict[str, Any]] = []  # {"when", "step", "policy_version", "metrics", ...} each
        self._evaluator: Evaluator | None = None

    def resume(self, step: int) -> None:
        """Continue the run's record after a resume from the checkpoint of step ``step``: keep the
        ``eval.json`` evaluations up to that step (later ones judged weights the resume discards), so
        :attr:`results` and the closing before -> after lines still start from the run's first
        evaluation. A missing file keeps none; an unreadable one is said and kept none of."""
        path = os.path.join(self.run_dir, "eval.json")
        try:
            with open(path) as f:
                records = json.load(f)
        except FileNotFoundError:
            return
        except (OSError, ValueError) as e:
            print(
                f"[clawray] eval.json not read on resume ({type(e).__name__}: {e}); its evaluations are left out",
                flush=True,
            )
            return
        if not isinstance(records, list):
            print("[clawray] eval.json not read on resume (not a list); its evaluations are left out", flush=True)
            return
        kept = [r for r in records if isinstance(r, dict) and isinstance(r.get("step"), int) and r["step"] <= step]
        self.results[:] = kept  # the same list: the driver holds it as eval_results

    def evaluated(self, step: int, version: int) -> bool:
        """Whether :attr:`results` holds an evaluation of policy ``version`` at step ``step``."""
        return any(r.get("step") == step and r.get("policy_version") == version for r in self.results)

    def due(self, steps_done: int, last: bool) -> bool:
        """Whether an evaluation follows step ``steps_done`` (not after the ``last`` one: the closing
        evaluation covers it)."""
        every = self.cfg.every_steps
        return every > 0 and steps_done % every == 0 and not last

    def run(
        self, when: str, step: int, version: int, model_path: str, generate: Callable, log: Callable
    ) -> dict[str, Any] | None:
        """Evaluate the policy that ``generate`` serves (version ``version``) on the environment's eval
        split; log ``eval/<measure>``, ``eval/<measure>_lo``/``_hi`` (95% Wilson) and ``eval/seconds``
        through ``log(metrics, step=step)``; append the record to :attr:`results` and write ``eval.json``.

        Args:
            when: ``"before"``, ``"step"``, ``"after"`` or ``"resume"`` (a label in the record and the
                log line; ``"resume"`` is skipped when the resumed step's policy was evaluated already).
            model_path: the policy's model folder (its tokenizer and chat template render the prompts).
            generate: ``generate(requests) -> replies`` (:meth:`Evaluator.run`).

        Returns:
            the record (``{"when", "step", "policy_version", "metrics", ...}``), or None when
            ``eval.enabled`` is false, the evaluation failed (the error is printed, the run goes on)
            or a ``"resume"`` evaluation was skipped.
        """
        if not self.cfg.enabled:
            return None
        if when == "resume" and self.evaluated(step, version):  # the kill came after this policy's evaluation
            return None
        try:
            result = self._build(model_path).run(generate)
        except Exception as e:  # an evaluation never ends a training run
            print(f"[clawray] eval ({when}) failed: {type(e).__name__}: {e}", flush=True)
            return None
        record = {"when": when, "step": step, "policy_version": version, **result}
        self.results.append(record)
        log(
            {**flat_metrics(result["metrics"]), "eval/seconds": result["seconds"], "policy_version": version}, step=step
        )
        try:  # replaced whole (a temporary file, then a rename): a full disk keeps the last good one
            tmp = os.path.join(self.run_dir, ".eval.json.tmp")
            with open(tmp, "w") as f:
                json.dump(self.results, f, indent=2)
            os.replace(tmp, os.path.join(self.run_dir, "eval.json"))
        except OSError as e:
            print(f"[clawray] eval.json not updated ({e.strerror or type(e).__name__})", flush=True)
        print(
            f"[clawray] eval {when} (step {step}, policy v{version}, {result['env']} "
            f"{result['split']}: {result['prompts']} prompts x {result['n']}, T={result['temperature']}, "
            f"{result['seconds']:.1f}s): {format_metrics(result['metrics'])}",
            flush=True,
        )
        return record

    def _build(self, model_path: str) -> Evaluator:
        if self._evaluator is None:
            from transformers import AutoTokenizer

            from clawray.envs import env_from_config

            ev, env = self.cfg, self.env_cfg
            self._evaluator = Evaluator(
                env_from_config(env),
                AutoTokenizer.from_pretrained(model_path),
                n=ev.n,
                num_prompts=ev.num_prompts,
                temperature=ev.temperature,
                seed=ev.seed,
                max_tokens=env.max_tokens,
                split="eval",
                untagged_tool_calls=self.untagged_tool_calls,
            )
        return self._evaluator
