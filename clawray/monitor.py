"""The behaviour-diversity monitor's probe (``monitor.*``): K replies at temperature 1 for P fixed
probe prompts from the current policy, measured by :func:`clawray.algos.behaviour.behaviour_stats`.

Owns: the probe prompts, their seeds and when the probe runs (``monitor.every_steps``). Must not:
compute the statistics (:func:`~clawray.algos.behaviour.behaviour_stats`) or the controller's rule
(:class:`~clawray.algos.invariants.EntropyController`), start or choose an engine (it takes a
``generate`` callable) or end a run (a failed probe is printed).

The probe prompts are fixed for the whole run: the first P prompts of the environment's *train*
split in the order of ``monitor.seed`` (the prompts the simulated user draws from), or the
``{"messages": [...]}`` lines of ``monitor.probe_file``. Sample ``j`` of prompt ``i`` has seed
``seed * 1_000_003 + i * K + j`` at every probe, so two probes differ only by the policy. The
driver generates through rollout engine 0 after the step's weight sync (the current policy).
"""

from __future__ import annotations

import json
import os
import time
from typing import Any, Callable

from clawray.algos.behaviour import behaviour_stats
from clawray.engines.base import GenerateRequest


def load_probe_file(path: str) -> list[list[dict[str, Any]]]:
    """The probe prompts of a JSONL file, one ``{"messages": [...]}`` per line.

    Raises:
        FileNotFoundError: no such file; ValueError: a line without a ``messages`` list, or no line.
    """
    path = os.path.expanduser(path)
    out = []
    with open(path, encoding="utf-8-sig") as f:  # a byte-order mark is no part of the JSON
        for i, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{i}: not JSON ({e.msg})") from None
            if not isinstance(row, dict) or not isinstance(row.get("messages"), list) or not row["messages"]:
                raise ValueError(f'{path}:{i}: expected {{"messages": [...]}}')
            out.append(row["messages"])
    if not out:
        raise ValueError(f"{path} holds no probe prompt")
    return out


class BehaviourProbe:
    """Builds the probe's requests and measures the replies.

    Args:
        tokenizer: the policy's HF tokenizer (chat template, end-of-turn id).
        prompts: ``[P]`` chat message lists; tools: the tool definitions rendered with them, or None.
        k: replies per prompt (>= 2); max_tokens: per reply; seed: see the module docstring;
        ngram: n of the self-similarity n-grams.
        untagged_tool_calls: parse replies as the server does with ``serve.untagged_tool_calls``.
    """

    def __init__(
        self,
        tokenizer: Any,
        prompts: list[list[dict]],
        tools: list | None = None,
        k: int = 4,
        max_tokens: int = 64,
        seed: int = 0,
        ngram: int = 2,
        untagged_tool_calls: bool = False,
    ):
        if k < 2 or not prompts:
            raise ValueError(f"the probe needs k >= 2 and at least one prompt, got k={k}, {len(prompts)} prompts")
        self.tokenizer, self.prompts, self.tools = tokenizer, prompts, tools
        self.k, self.max_tokens, self.seed, self.ngram = k, max_tokens, seed, ngram
        self.untagged_tool_calls = untagged_tool_calls
        self.stop_ids = [tokenizer.convert_tokens_to_ids(tokenizer.eos_token)]

    def requests(self) -> list[GenerateRequest]:
        """``P * K`` requests at temperature 1, prompt-major."""
        out = []
        for i, messages in enumerate(self.prompts):
            text = self.tokenizer.apply_chat_template(
                messages, tools=self.tools, add_generation_prompt=True, tokenize=False
            )
            ids = self.tokenizer.encode(text, add_special_tokens=False)
            out += [
                GenerateRequest(
                    prompt_ids=ids,
                    max_tokens=self.max_tokens,
                    temperature=1.0,
                    stop_token_ids=self.stop_ids,
                    seed=(self.seed * 1_000_003 + i * self.k + j) % 2**31,
                )
                for j in range(self.k)
            ]
        return out

    def run(self, generate: Callable[[list[GenerateRequest]], list[Any]]) -> dict[str, float]:
        """Generate (``generate(requests) -> outputs`` with ``response_ids``) and measure:
        :func:`~clawray.algos.behaviour.behaviour_stats` of the ``[P][K]`` replies."""
        from clawray.serve.reply import ReplyDecoder, parse_reply_text

        outs = generate(self.requests())
        reply_text = ReplyDecoder(self.tokenizer)
        messages = []
        for out in outs:
            ids = list(out["response_ids"] if isinstance(out, dict) else out.response_ids)
            body = ids[:-1] if ids and ids[-1] in self.stop_ids else ids
            text = reply_text.complete(body)
            messages.append(
                parse_reply_text(text, tools=self.tools or True, untagged=self.untagged_tool_calls).message()
            )
        replies = [messages[i * self.k : (i + 1) * self.k] for i in range(len(self.prompts))]
        return behaviour_stats(replies, self.ngram)


class BehaviourMonitor:
    """Every ``monitor.every_steps`` steps: the probe on the current policy, feeding the behaviour
    controller (``learner.behaviour_floor``: an :class:`~clawray.algos.invariants.EntropyController`
    fed ``inv/behaviour_entropy``; its coefficient adds to the entropy bonus).

    Args:
        mon_cfg: the ``monitor`` config section; env_cfg: the ``env`` section (the probe prompts).
        controller: the behaviour controller (checkpointed by the driver).
        untagged_tool_calls: ``serve.untagged_tool_calls`` (replies are parsed as served).
    """

    def __init__(self, mon_cfg: Any, env_cfg: Any, controller: Any, untagged_tool_calls: bool = False):
        self.cfg, self.env_cfg, self.controller = mon_cfg, env_cfg, controller
        self.untagged_tool_calls = untagged_tool_calls
        self._probe: BehaviourProbe | None = None

    def maybe_probe(self, steps_done: int, model_path: str, generate: Callable) -> dict[str, float]:
        """The probe after step ``steps_done`` when it is its turn: the ``inv/behaviour_*`` and
        ``inv/self_similarity`` figures, ``inv/behaviour_coef`` and ``timing/monitor_s`` (seconds);
        ``{}`` when it is not (or the probe failed: printed, the run goes on).

        Args:
            model_path: the policy's model folder (its tokenizer renders the probe prompts).
            generate: ``generate(requests) -> replies`` on the current policy.
        """
        every = self.cfg.every_steps
        if every <= 0 or steps_done % every:
            return {}
        t0 = time.perf_counter()
        try:
            stats = self._build(model_path).run(generate)
        except Exception as e:  # a probe never ends a training run
            print(f"[clawray] behaviour probe failed: {type(e).__name__}: {e}", flush=True)
            return {}
        self.controller.update(stats["inv/behaviour_entropy"])
        return {**stats, "inv/behaviour_coef": self.controller.coef, "timing/monitor_s": time.perf_counter() - t0}

    def _build(self, model_path: str) -> BehaviourProbe:
        if self._probe is None:
            from transformers import AutoTokenizer

            from clawray.envs import env_from_config

            mon = self.cfg
            env = env_from_config(self.env_cfg)
            if mon.probe_file:
                prompts, tools = load_probe_file(mon.probe_file), None
            else:
                prompts, tools = [env.opening(t) for t in env.prompts("train", mon.seed)[: mon.num_prompts]], env.tools
            self._probe = BehaviourProbe(
                AutoTokenizer.from_pretrained(model_path),
                prompts,
                tools or None,
                mon.k,
                mon.max_tokens,
                mon.seed,
                mon.ngram,
                self.untagged_tool_calls,
            )
        return self._probe
