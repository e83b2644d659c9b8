"""Serving overhead: the OpenAI endpoint (Ray Serve + session tracking + recording) vs calling the
RolloutEngine actor directly, on the same prompts with the same seeds (so both produce the same tokens).

For each concurrency C, C sessions each send R single-turn requests back to back; both paths see the
same prompt ids and sampling seeds. Prints mean / p50 latency per request (seconds), generated
tokens per second, the engine's mean batch (requests per backend generate call: the hf engine runs
static batches, so requests that reach it staggered run in smaller ones), and the endpoint/direct
ratios. Target: overhead <= 5% at 16 sessions.

    python bench/serve_overhead.py                         # tiny model, hf engine
    python bench/serve_overhead.py --model ~/.cache/clawray/models/smollm2-135m-instruct --backend vllm
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time

import ray


def _percentile(values: list[float], q: float) -> float:
    return sorted(values)[min(len(values) - 1, int(q * len(values)))]


async def _direct(engine, prompts: list[list[int]], sessions: int, rounds: int, max_tokens: int, stop: list[int]):
    from clawray.engines.base import GenerateRequest

    latencies, tokens = [], 0

    async def session(s: int) -> None:
        nonlocal tokens
        for r in range(rounds):
            req = GenerateRequest(
                prompt_ids=prompts[(s * rounds + r) % len(prompts)],
                max_tokens=max_tokens,
                temperature=1.0,
                stop_token_ids=stop,
                seed=1000 * s + r,
            )
            t0 = time.perf_counter()
            out = await engine.generate.remote(req)
            latencies.append(time.perf_counter() - t0)
            tokens += len(out["response_ids"])

    t0 = time.perf_counter()
    await asyncio.gather(*(session(s) for s in range(sessions)))
    return latencies, tokens, time.perf_counter() - t0


async def _endpoint(base_url: str, questions: list[str], sessions: int, rounds: int, max_tokens: int, tag: str):
    import openai

    client = openai.AsyncOpenAI(base_url=base_url, api_key="x", max_retries=0, timeout=600)
    latencies, tokens = [], 0

    async def session(s: int) -> None:
        nonlocal tokens
        for r in range(rounds):
            q = questions[(s * rounds + r) % len(questions)]
            t0 = time.perf_counter()
            out = await client.chat.completions.create(
                model="m",
                messages=[{"role": "user", "content": q}],
                max_tokens=max_tokens,
                temperature=1.0,
                seed=1000 * s + r,
                extra_headers={"X-Session-Id": f"{tag}-{s}-{r}"},
            )
            latencies.append(time.perf_counter() - t0)
            tokens += out.usage.completion_tokens

    t0 = time.perf_counter()
    await asyncio.gather(*(session(s) for s in range(sessions)))
    await client.close()
    return latencies, tokens, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="", help="HF folder (default: build the tiny model)")
    ap.add_argument("--backend", default="hf", choices=["hf", "vllm"])
    ap.add_argument("--concurrency", default="1,16")
    ap.add_argument("--rounds", type=int, default=4, help="requests per session")
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args()

    from ray import serve
    from transformers import AutoTokenizer

    from clawray.actors.judge import JudgeWorkerActor
    from clawray.actors.queue import TrajectoryQueueActor
    from clawray.actors.rollout import RolloutEngineActor
    from clawray.actors.session import SessionTrackerActor
    from clawray.envs.arith import make_problems
    from clawray.models import build_tiny_model
    from clawray.ray_env import free_port, init_ray
    from clawray.config import ServeConfig
    from clawray.serve.app import start_policy_server

    model = args.model and os.path.expanduser(args.model) or build_tiny_model(os.path.join(tempfile.mkdtemp(), "tiny"))
    init_ray("", 2)
    tok = AutoTokenizer.from_pretrained(model)
    questions = [p.question for p in make_problems(64, level=1, seed=0)]
    prompts = [
        tok.encode(
            tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False),
            add_special_tokens=False,
        )
        for q in questions
    ]
    kwargs = {"dtype": "float32", "max_model_len": 1024, "kv_cache_gib": 0.5} if args.backend == "vllm" else {}
    engine = RolloutEngineActor.options(num_cpus=0.5).remote(args.backend, model, "rollout-0", 2, 16, kwargs)
    ray.get(engine.ready.remote())
    judge = JudgeWorkerActor.options(num_cpus=0).remote({"backend": "feedback", "m": 1})
    tracker = SessionTrackerActor.options(num_cpus=0).remote(
        [judge], TrajectoryQueueActor.options(num_cpus=0).remote(2), records_dir=tempfile.mkdtemp()
    )
    cfg = ServeConfig(
        model_name="m",
        default_max_tokens=args.max_tokens,
        default_temperature=1.0,
        generate_timeout_s=600,
        max_body_mb=1.0,
        api_key="",
        host="127.0.0.1",
        port=free_port(),
        num_cpus=0.1,
    )
    max_model_len = 1024
    base_url = start_policy_server(model, [engine], tracker, cfg, max_model_len)
    stop = [tok.convert_tokens_to_ids(tok.eos_token)]

    print(f"model={model} backend={args.backend} rounds={args.rounds} max_tokens={args.max_tokens}")
    print(f"{'sessions':>8} {'path':>9} {'requests':>8} {'mean_s':>8} {'p50_s':>8} {'tokens/s':>9} {'mean_batch':>10}")
    asyncio.run(_direct(engine, prompts, 2, 1, 8, stop))  # warm up both paths
    asyncio.run(_endpoint(base_url, questions, 2, 1, 8, "warm"))
    for c in [int(x) for x in args.concurrency.split(",")]:
        rows = {}
        for path in ("direct", "endpoint"):
            before = ray.get(engine.stats.remote())
            if path == "direct":
                lat, toks, wall = asyncio.run(_direct(engine, prompts, c, args.rounds, args.max_tokens, stop))
            else:
                lat, toks, wall = asyncio.run(_endpoint(base_url, questions, c, args.rounds, args.max_tokens, f"c{c}"))
            after = ray.get(engine.stats.remote())
            batch = (after["requests"] - before["requests"]) / max(1, after["batches"] - before["batches"])
            rows[path] = (statistics.mean(lat), _percentile(lat, 0.5), toks / wall, toks)
            print(
                f"{c:>8} {path:>9} {len(lat):>8} {rows[path][0]:>8.3f} {rows[path][1]:>8.3f} {rows[path][2]:>9.1f} "
                f"{batch:>10.1f}"
            )
        (dm, dp, dt, dtok), (em, ep, et, etok) = rows["direct"], rows["endpoint"]
        same = "same tokens" if dtok == etok else f"token counts differ: {dtok} vs {etok}"
        print(
            f"{c:>8} {'ratio':>9} {'':>8} {em / dm:>8.3f} {ep / dp:>8.3f} {dt / et:>9.3f}   "
            f"latency overhead {100 * (em / dm - 1):+.1f}%, throughput overhead {100 * (dt / et - 1):+.1f}% ({same})"
        )
    serve.shutdown()
    ray.shutdown()


if __name__ == "__main__":
    sys.exit(main())
