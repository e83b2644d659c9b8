"""Serving overhead: the OpenAI endpoint (Ray Serve + session tracking + recording) vs calling the
RolloutEngine actor directly, on the same prompts with the same seeds (so both produce the same tokens).

For each concurrency C, C sessions each send R single-turn requests back to back; both paths see the
same prompt ids and sampling seeds. Prints mean / p50 latency per request (seconds), generated
tokens per second, the CPU milliseconds per request of each process on the path (engine, Serve
proxy, Serve replica, session tracker, Serve controller, and this process: the client), the engine's
mean batch (requests in the engine per backend step; the hf engine samples them one at a time,
oldest first, so this is its queue depth), and the endpoint/direct ratios. A third path, ``bare``, is the least an OpenAI endpoint on Ray Serve does (chat template, one
engine call, detokenize; no sessions or recording), on the same Serve proxy: ``bare`` vs ``direct``
is Ray Serve's own cost on this machine, ``endpoint`` vs ``bare`` is clawray's. Target: endpoint
overhead <= 5% at 16 sessions.

    python bench/serve_overhead.py                         # tiny model, hf engine
    python bench/serve_overhead.py --model ~/.cache/clawray/models/smollm2-135m-instruct --backend vllm
    python bench/serve_overhead.py --model ~/.cache/clawray/models/smollm2-135m-instruct --backend vllm \
        --concurrency 16 --rounds 8 --raw        # and vLLM's own engine on the same requests
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import statistics
import sys
import tempfile
import time

import ray


#: process groups whose CPU time the bench reports per request: (label, prefix of the process's command line)
_GROUPS = [
    ("engine", "ray::RolloutEngine"),
    ("proxy", "ray::ProxyActor"),
    ("replica", "ray::ServeReplica"),
    ("tracker", "ray::SessionTracker"),
    ("serve_ctl", "ray::ServeController"),
]


def _cpu_seconds() -> dict[str, float]:
    """User + system CPU seconds so far of each process group of :data:`_GROUPS` and of this process
    (``client``: the HTTP client or the direct caller), from ``psutil``."""
    import psutil

    out = {label: 0.0 for label, _ in _GROUPS} | {"client": 0.0}
    for proc in psutil.process_iter(["pid", "cmdline", "cpu_times"]):
        cmd, times = " ".join(proc.info["cmdline"] or []), proc.info["cpu_times"]
        label = (
            "client"
            if proc.info["pid"] == os.getpid()
            else next((lb for lb, pre in _GROUPS if cmd.startswith(pre)), None)
        )
        if label is not None and times is not None:  # None: the process is gone or not ours to read
            out[label] += times.user + times.system
    return out


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


def _raw_llm(model: str, rollout: dict, max_num_seqs: int):
    """vLLM's own in-process engine with the options clawray's vllm backend gives it (fp32, no chunked
    prefill on CPU, ``generation_config="vllm"``, eager), batching continuously up to
    ``max_num_seqs`` requests: the limit the serving paths are measured against."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    import torch
    from vllm import LLM

    torch.set_num_threads(rollout["torch_threads"])
    return LLM(
        model=model,
        tokenizer=model,
        dtype=rollout["dtype"],
        max_model_len=rollout["max_model_len"],
        kv_cache_memory_bytes=int(rollout["kv_cache_gib"] * 2**30),
        enable_chunked_prefill=False,
        max_num_batched_tokens=2048,
        max_num_seqs=max_num_seqs,
        generation_config="vllm",
        enforce_eager=True,
        logprobs_mode="processed_logprobs",
        seed=0,
    )


def _raw(llm, prompts: list[list[int]], sessions: int, rounds: int, max_tokens: int, stop: list[int]):
    """The same C x R requests (prompts, seeds, sampling) as :func:`_direct`, all handed to
    ``llm.generate`` at once (at most ``max_num_seqs`` = C run together). Latency per request is not
    defined here (one call); returns ``(None, tokens, wall seconds)``."""
    from vllm import SamplingParams

    inputs, params = [], []
    for s in range(sessions):
        for r in range(rounds):
            inputs.append({"prompt_token_ids": prompts[(s * rounds + r) % len(prompts)]})
            params.append(
                SamplingParams(
                    temperature=1.0, max_tokens=max_tokens, stop_token_ids=stop, seed=1000 * s + r, logprobs=0
                )
            )
    t0 = time.perf_counter()
    outs = llm.generate(inputs, params, use_tqdm=False)
    return None, sum(len(o.outputs[0].token_ids) for o in outs), time.perf_counter() - t0


def _start_bare_server(engine, model: str) -> None:
    """Deploy, next to clawray's endpoint (same Serve proxy and port), the least an OpenAI chat endpoint
    on Ray Serve does: FastAPI ingress, chat template + tokenize, one engine call, detokenize, the
    response JSON. No sessions, no recording, no validation: the floor clawray's endpoint is held to.
    It answers at ``/bare/v1/chat/completions``."""
    from fastapi import FastAPI
    from ray import serve

    app = FastAPI()

    @serve.deployment(ray_actor_options={"num_cpus": 0.1}, max_ongoing_requests=256)  # as clawray's
    @serve.ingress(app)
    class BareOpenAI:
        def __init__(self, engine, model: str):
            from transformers import AutoTokenizer

            self.engine, self.tok = engine, AutoTokenizer.from_pretrained(model)
            self.stop = [self.tok.convert_tokens_to_ids(self.tok.eos_token)]

        @app.post("/v1/chat/completions")
        async def chat(self, body: dict) -> dict:
            from clawray.engines.base import GenerateRequest

            text = self.tok.apply_chat_template(body["messages"], add_generation_prompt=True, tokenize=False)
            ids = self.tok.encode(text, add_special_tokens=False)
            req = GenerateRequest(
                ids, body["max_tokens"], body["temperature"], stop_token_ids=self.stop, seed=body["seed"]
            )
            out = await self.engine.generate.remote(req)
            n = len(out["response_ids"])
            message = {"role": "assistant", "content": self.tok.decode(out["response_ids"], skip_special_tokens=True)}
            return {
                "id": "bare",
                "object": "chat.completion",
                "created": 0,
                "model": body["model"],
                "choices": [{"index": 0, "message": message, "finish_reason": out["finish_reason"]}],
                "usage": {"prompt_tokens": len(ids), "completion_tokens": n, "total_tokens": len(ids) + n},
            }

    serve.run(BareOpenAI.bind(engine, model), name="bare", route_prefix="/bare")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="", help="HF folder (default: build the tiny model)")
    ap.add_argument("--backend", default="hf", choices=["hf", "vllm"])
    ap.add_argument("--concurrency", default="1,16")
    ap.add_argument("--rounds", type=int, default=4, help="requests per session")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument(
        "--raw",
        action="store_true",
        help="vllm: also run vLLM's own engine in this process on the largest concurrency's requests "
        "(max_num_seqs = that concurrency) and print endpoint / raw throughput",
    )
    ap.add_argument("--json", default="", help="also write the figures as JSON here (bench/summary.py)")
    args = ap.parse_args()

    from transformers import AutoTokenizer

    from clawray.actors.judge import JudgeWorkerActor
    from clawray.actors.queue import TrajectoryQueueActor
    from clawray.actors.rollout import RolloutEngineActor
    from clawray.actors.session import SessionTrackerActor
    from clawray.envs.arith import make_problems
    from clawray.model_folders import build_tiny_model
    from clawray.ray_env import free_port, init_ray
    from clawray.config import ServeConfig
    from clawray.serve.deploy import start_policy_server
    from clawray.serve.instance import shutdown_serve

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
    rollout = {
        "backend": args.backend,
        "torch_threads": 2,
        "dtype": "float32",
        "max_model_len": 1024,
        "kv_cache_gib": 0.5,
    }
    engine = RolloutEngineActor.options(num_cpus=0.5).remote(model, rollout)
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
    _start_bare_server(engine, model)
    bare_url = base_url.removesuffix("/v1") + "/bare/v1"
    stop = [tok.convert_tokens_to_ids(tok.eos_token)]

    print(f"model={model} backend={args.backend} rounds={args.rounds} max_tokens={args.max_tokens}")
    print(f"{'sessions':>8} {'path':>9} {'requests':>8} {'mean_s':>8} {'p50_s':>8} {'tokens/s':>9} {'mean_batch':>10}")
    asyncio.run(_direct(engine, prompts, 2, 1, 8, stop))  # warm up both paths
    asyncio.run(_endpoint(base_url, questions, 2, 1, 8, "warm"))
    asyncio.run(_endpoint(bare_url, questions, 2, 1, 8, "warm"))
    report = {}  # {sessions: {path: figures}}, for --json
    for c in [int(x) for x in args.concurrency.split(",")]:
        rows, cpu = {}, {}
        for path in ("direct", "bare", "endpoint"):
            before, cpu0 = ray.get(engine.stats.remote()), _cpu_seconds()
            if path == "direct":
                lat, toks, wall = asyncio.run(_direct(engine, prompts, c, args.rounds, args.max_tokens, stop))
            else:
                url = bare_url if path == "bare" else base_url
                lat, toks, wall = asyncio.run(_endpoint(url, questions, c, args.rounds, args.max_tokens, f"c{c}"))
            after, cpu1 = ray.get(engine.stats.remote()), _cpu_seconds()
            cpu[path] = {k: 1000 * (cpu1[k] - cpu0[k]) / len(lat) for k in cpu1}
            steps = max(1, after["steps"] - before["steps"])
            batch = (after["step_requests"] - before["step_requests"]) / steps
            rows[path] = (statistics.mean(lat), _percentile(lat, 0.5), toks / wall, toks)
            print(
                f"{c:>8} {path:>9} {len(lat):>8} {rows[path][0]:>8.3f} {rows[path][1]:>8.3f} {rows[path][2]:>9.1f} "
                f"{batch:>10.1f}"
            )
        if args.raw and args.backend == "vllm" and c == max(int(x) for x in args.concurrency.split(",")):
            llm = _raw_llm(model, rollout, c)
            _raw(llm, prompts, 2, 1, 8, stop)  # warm up
            _, toks, wall = _raw(llm, prompts, c, args.rounds, args.max_tokens, stop)
            rows["raw"] = (math.nan, math.nan, toks / wall, toks)
            print(f"{c:>8} {'raw':>9} {c * args.rounds:>8} {'':>8} {'':>8} {toks / wall:>9.1f} {'':>10}")
            for path in ("direct", "endpoint"):
                print(
                    f"{c:>8} {path + '/raw':>9} throughput {rows[path][2] / rows['raw'][2]:.3f}x of vLLM's own "
                    f"engine ({rows[path][3]} vs {toks} tokens)"
                )
            del llm
        report[c] = {
            p: {"mean_s": m, "p50_s": p50, "tokens_per_s": t, "tokens": n} for p, (m, p50, t, n) in rows.items()
        }
        for path, ms in cpu.items():
            print(f"{c:>8} {path:>9} cpu ms/request: " + ", ".join(f"{k} {v:.1f}" for k, v in ms.items()))
        # bare/dir: Ray Serve's own cost; endpoint/bare: clawray's; endpoint/dir (last): the target's figure
        for label, path, base in (
            ("bare/dir", "bare", "direct"),
            ("end/bare", "endpoint", "bare"),
            ("end/dir", "endpoint", "direct"),
        ):
            (bm, bp, bt, btok), (em, ep, et, etok) = rows[base], rows[path]
            same = "same tokens" if btok == etok else f"token counts differ: {btok} vs {etok}"
            print(
                f"{c:>8} {label:>9} {'':>8} {em / bm:>8.3f} {ep / bp:>8.3f} {bt / et:>9.3f}   "
                f"latency overhead {100 * (em / bm - 1):+.1f}%, throughput overhead {100 * (bt / et - 1):+.1f}% "
                f"({same})"
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f)
    shutdown_serve()  # serve.shutdown() without its raylet's 'graceful_shutdown failed' line
    ray.shutdown()


if __name__ == "__main__":
    sys.exit(main())
