"""Does vLLM's prefix cache change what the engine computes? Two checks on one model folder, each
with the cache on and off (the CPU demo trained worse with it on: README, "prefix cache"):

1. log-probs on cache hits: rounds of the same long prompt (one full KV block or more, so every
   repeat hits the cache) and second turns that extend each first turn's reply; each reply's sampled
   log-probs (``logprobs_mode=processed_logprobs``, T = 1) against a re-score of prompt + reply
   through ``prompt_logprobs``, which vLLM computes without the cache. Prints the largest
   |difference| over every token.
2. the brief evaluation (``clawray eval``'s: 108 prompts x 2, T = 0.7, seed 0) of the folder.

    PYTHONPATH=. python bench/prefix_cache.py --model ~/.cache/clawray/models/smollm2-135m-instruct
    PYTHONPATH=. python bench/prefix_cache.py --model RUN/checkpoints/ckpt-000001/model --eval
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def logprob_gap(model: str, caching: bool, rounds: int = 4) -> tuple[float, int, float]:
    """Largest |sampled - re-scored| log-prob (nats) over every reply token, the first prompt's
    length, and the share of the sampled requests' prompt tokens read from the cache."""
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=model,
        dtype="float32",
        max_model_len=2049,
        enable_prefix_caching=caching,
        enforce_eager=True,
        enable_chunked_prefill=False,
        max_num_batched_tokens=2049,
        logprobs_mode="processed_logprobs",
        generation_config="vllm",
        seed=0,
        kv_cache_memory_bytes=1 << 30,
    )
    tok = AutoTokenizer.from_pretrained(model)
    text = "Quick question: what is 7 + 8? Keep it brief, I only need the result. " * 12
    chat = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False)
    base = tok(chat, add_special_tokens=False).input_ids
    follow = tok("\nAnd 9 + 4?\n", add_special_tokens=False).input_ids
    sample = SamplingParams(temperature=1.0, top_p=1.0, max_tokens=24, logprobs=0, detokenize=False)
    rescore = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, detokenize=False)

    seen = {"prompt": 0, "cached": 0}

    def run(prompts):
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sample, use_tqdm=False)
        seen["prompt"] += sum(len(p) for p in prompts)
        seen["cached"] += sum(o.num_cached_tokens or 0 for o in outs)
        return [
            (
                p,
                list(o.outputs[0].token_ids),
                [lp[t].logprob for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)],
            )
            for p, o in zip(prompts, outs)
        ]

    worst = 0.0
    for _ in range(rounds):
        first = run([base] * 4)
        replies = first + run([p + r + follow for p, r, _ in first])
        outs = llm.generate([{"prompt_token_ids": p + r} for p, r, _ in replies], rescore, use_tqdm=False)
        for (p, r, lps), o in zip(replies, outs):
            ref = [step[t].logprob for step, t in zip(o.prompt_logprobs[len(p) :], r)]
            worst = max([worst, *(abs(a - b) for a, b in zip(lps, ref))])
    return worst, len(base), seen["cached"] / seen["prompt"]


def brief_eval(model: str, caching: bool) -> str:
    """``clawray eval MODEL --env brief --level 1`` (the job's settings) with the cache on or off."""
    from transformers import AutoTokenizer

    from clawray.engines import make_backend
    from clawray.envs import make_env
    from clawray.evaluation import Evaluator, format_metrics

    ev = Evaluator(
        make_env("brief", 1, None),
        AutoTokenizer.from_pretrained(model),
        n=2,
        num_prompts=0,
        temperature=0.7,
        seed=0,
        max_tokens=48,
        split="eval",
    )
    backend = make_backend("vllm", model, dtype="float32", seed=0, kv_cache_gib=1.0, enable_prefix_caching=caching)
    return format_metrics(ev.run(backend.generate, chunk=64)["metrics"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--caching", choices=["on", "off", "both"], default="both")
    p.add_argument("--eval", action="store_true", help="also run the brief evaluation")
    ns = p.parse_args()
    model = os.path.expanduser(ns.model)
    for caching in {"on": [True], "off": [False], "both": [True, False]}[ns.caching]:
        gap, n, hit = logprob_gap(model, caching)
        print(
            f"prefix cache {'on ' if caching else 'off'}: prompt {n} tokens, {hit:.0%} of prompt tokens from the "
            f"cache, max |sampled - re-scored| {gap:.2e} nats"
        )
        if ns.eval:
            print(f"prefix cache {'on ' if caching else 'off'}: brief eval {brief_eval(model, caching)}")


if __name__ == "__main__":
    main()
