"""Time to first token of a short request that arrives while long replies are generating: the rollout
engine's continuous batching against static batches, on the same engine and the same requests.

Each trial starts ``--long`` long requests (``--long-tokens`` each, no stop token, so every long reply
runs to its length), waits until they all stream, then lets a short request (``--short-tokens``)
*arrive* at an offset drawn from [0, half the long batch's expected time) (fixed seed):

* ``continuous``: the request goes to the engine at its arrival; the engine admits it between two
  steps of the running batch (what clawray's engines do);
* ``static``: the request waits until the running batch has finished, then goes to the engine
  (what an engine that runs static batches does to a late arrival: it joins the next batch).

TTFT is the time from the arrival to the first streamed token (seconds, this process's clock, through
the RolloutEngine actor's ``generate_stream``). Trials alternate between the two modes. Prints the
p50 and p99 (nearest rank; with N trials per mode the p99 is the largest of them) of each mode and the
continuous / static ratios. Meaningful with ``--backend vllm``: the hf engine samples its requests one
at a time (oldest first), so with it the long replies have mostly ended before the last one streams.

    python bench/ttft.py                                   # tiny model, hf engine
    python bench/ttft.py --model ~/.cache/clawray/models/smollm2-135m-instruct --backend vllm
"""

from __future__ import annotations

import argparse
import json
import asyncio
import math
import os
import random
import statistics
import tempfile
import time

import ray


def percentile(values: list[float], q: float) -> float:
    """The nearest-rank ``q``-quantile (0 < q <= 1) of ``values``: the smallest value with at least
    ``q`` of them at or below it."""
    ordered = sorted(values)
    return ordered[max(1, math.ceil(q * len(ordered))) - 1]


async def _stream(engine, request, started: asyncio.Event | None = None) -> float:
    """Run ``request`` through ``engine.generate_stream`` to its end; returns the time of its first
    streamed token (``time.perf_counter``), and sets ``started`` then."""
    first = None
    async for ref in engine.generate_stream.remote(request):
        item = await ref
        if first is None and item.get("token_ids"):
            first = time.perf_counter()
            if started is not None:
                started.set()
    return first if first is not None else time.perf_counter()


async def trial(engine, mode: str, longs: list, short, offset_s: float) -> float:
    """One trial in ``mode`` (``continuous`` or ``static``); returns the short request's TTFT (s)."""
    started = [asyncio.Event() for _ in longs]
    running = [asyncio.ensure_future(_stream(engine, r, e)) for r, e in zip(longs, started)]
    await asyncio.gather(*(e.wait() for e in started))  # every long reply streams
    await asyncio.sleep(offset_s)
    arrival = time.perf_counter()
    if mode == "static":  # a static engine admits the late request with its next batch
        await asyncio.gather(*running)
    first = await _stream(engine, short)
    await asyncio.gather(*running)
    return first - arrival


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="", help="HF folder (default: build the tiny model)")
    ap.add_argument("--backend", default="hf", choices=["hf", "vllm"])
    ap.add_argument("--long", type=int, default=8, help="long requests running when the short one arrives")
    ap.add_argument("--long-tokens", type=int, default=128)
    ap.add_argument("--short-tokens", type=int, default=8)
    ap.add_argument("--trials", type=int, default=10, help="per mode")
    ap.add_argument("--json", default="", help="also write the figures as JSON here (bench/summary.py)")
    args = ap.parse_args()

    from transformers import AutoTokenizer

    from clawray.actors.rollout import RolloutEngineActor
    from clawray.engines.base import GenerateRequest
    from clawray.envs.arith import make_problems
    from clawray.model_folders import build_tiny_model
    from clawray.ray_env import init_ray

    model = args.model and os.path.expanduser(args.model) or build_tiny_model(os.path.join(tempfile.mkdtemp(), "tiny"))
    init_ray("", 2)
    tok = AutoTokenizer.from_pretrained(model)

    def prompt(q: str) -> list[int]:
        text = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
        return tok.encode(text, add_special_tokens=False)

    questions = [p.question for p in make_problems(args.long + 1, level=1, seed=0)]
    rollout = {
        "backend": args.backend,
        "torch_threads": 2,
        "dtype": "float32",
        "max_model_len": 1024,
        "kv_cache_gib": 0.5,
        "max_batch_size": args.long + 1,
    }
    engine = RolloutEngineActor.options(num_cpus=0.5).remote(model, rollout)
    ray.get(engine.ready.remote())
    longs = [
        GenerateRequest(prompt_ids=prompt(q), max_tokens=args.long_tokens, temperature=1.0, seed=i)
        for i, q in enumerate(questions[: args.long])
    ]
    short = GenerateRequest(prompt_ids=prompt(questions[-1]), max_tokens=args.short_tokens, temperature=1.0, seed=99)

    async def run() -> dict[str, list[float]]:
        await asyncio.gather(*(_stream(engine, r) for r in longs))  # warm-up
        t0 = time.perf_counter()
        await asyncio.gather(*(_stream(engine, r) for r in longs))  # the long batch's length, warm
        batch_s = time.perf_counter() - t0
        print(
            f"model={model} backend={args.backend} long={args.long}x{args.long_tokens} tokens "
            f"short={args.short_tokens} tokens; one long batch takes {batch_s:.2f} s",
            flush=True,
        )
        rng = random.Random(0)
        ttft: dict[str, list[float]] = {"continuous": [], "static": []}
        for k in range(args.trials):
            offset = rng.uniform(0, batch_s / 2)
            for mode in ("continuous", "static") if k % 2 == 0 else ("static", "continuous"):
                ttft[mode].append(await trial(engine, mode, longs, short, offset))
                print(f"trial {k + 1:>3} {mode:>10}: arrival +{offset:.2f} s, ttft {ttft[mode][-1]:.3f} s", flush=True)
        return ttft

    ttft = asyncio.run(run())
    print(f"{'mode':>10} {'n':>3} {'mean_s':>8} {'p50_s':>8} {'p99_s':>8}")
    for mode, values in ttft.items():
        print(
            f"{mode:>10} {len(values):>3} {statistics.mean(values):>8.3f} {percentile(values, 0.5):>8.3f} "
            f"{percentile(values, 0.99):>8.3f}"
        )
    c, s = ttft["continuous"], ttft["static"]
    print(
        f"continuous/static: p50 {percentile(c, 0.5) / percentile(s, 0.5):.3f}x, "
        f"p99 {percentile(c, 0.99) / percentile(s, 0.99):.3f}x"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {m: {"p50_s": percentile(v, 0.5), "p99_s": percentile(v, 0.99), "n": len(v)} for m, v in ttft.items()},
                f,
            )
    ray.shutdown()


if __name__ == "__main__":
    main()
