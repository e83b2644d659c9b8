"""The latency a weight sync adds to the requests it overlaps, ``sync.mode`` drain vs interrupt vs inflight.

One RolloutEngine actor serves steady traffic: requests arrive at random (Poisson, mean gap
``--gap`` seconds, fixed seeds, ``--max-tokens``, T = 1), each awaited on its own, so a request
that arrives during a drain waits for it (an open loop: the hf engine serves a batch's requests one
after the other, so keep the engine below saturation, or queueing swamps the sync's effect). Meanwhile the driver runs
``--syncs`` weight syncs through :class:`clawray.weight_sync.WeightSyncController` (``--transport``:
the gloo collective by default, or ipc; ``auto``, the job's default, picks ipc on one host), one every ``--interval`` seconds; the sender is a small actor
holding the model's weights (shifted by 1e-3 per version, built before the pause as the learners
gather theirs), standing in for the learner group, so only the engine side of a sync is measured. Each mode gets its own fresh engine.

Added latency of a request = its latency - its token count x the median seconds per token of the
requests that overlapped no sync (same run; the machine's load drifts between runs).
Reported over the requests whose [start, end] overlaps a sync's [call, return]: p50 and p99, with
the sync's own numbers: pause (``sync/pause_s``), transfer + load (the engine's receive + load
seconds, the part no mode can avoid) and the generations interrupted (interrupt) or running across
the load (inflight). The last lines give the ratio p99 added latency / mean (transfer + load) per
mode; target <= 1.5. ``--runs N`` repeats the whole measurement N times (a fresh engine per mode and
run, the modes taking turns so the machine's drift falls on each alike; issue #29: the median of 5): the
last lines then give each mode's ratio as the median over the runs with its spread, and the p99 of all
runs' overlapping requests pooled (with ~22 overlapping requests in a run of 30 syncs, a run's p99 is
its maximum).

``--engine-cpus 0 --engine-threads 1`` runs the engine thread on CPU 0 (``rollout.cpu_affinity``) and
the bench, Ray's processes and the sender on the other CPUs, as a GPU host does (decoding on the GPU,
the sync's CPU work elsewhere): on 2 cores the sync's own CPU work (staging, sending, Ray) otherwise
preempts the decode steps around each sync.

    nice -n 19 env PYTHONPATH=. python bench/sync_pause.py                  # tiny model, hf engine
    nice -n 19 env PYTHONPATH=. python bench/sync_pause.py --model ~/.cache/clawray/models/smollm2-135m-instruct \\
        --backend vllm
"""

from __future__ import annotations

import argparse
import json
import asyncio
import os
import random
import statistics
import sys
import tempfile
import time

import ray
import torch


class _Sender:
    """Rank 0 of a stand-in learner group: the model's weights, shifted by 1e-3 per version."""

    def __init__(self, model_path: str):
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
        self.base = {k: v.detach().clone() for k, v in model.state_dict().items()}
        self.transport = None
        self.staged = None

    def ready(self) -> int:
        return 0

    def sync_rendezvous(self, host: str = "") -> tuple[str, int]:
        from clawray.ray_env import reserve_rendezvous

        return reserve_rendezvous(host, 0)

    def init_weight_sender(self, spec, check=True) -> None:
        from clawray.weight_sync import make_transport

        if self.transport is not None:
            self.transport.close()
        self.transport = make_transport(spec, 0)

    def stage_weights(self, version: int) -> dict:
        """Build version ``version``'s weights before the pause, as the learners gather theirs."""
        t0 = time.perf_counter()
        self.staged = {k: v + 1e-3 * version if v.is_floating_point() else v for k, v in self.base.items()}
        return {"gather_s": time.perf_counter() - t0}

    def sync_weights(self, version: int) -> dict:
        stats = self.transport.send(self.staged, version)
        self.staged = None
        return {"bytes": stats["bytes"], "gather_s": 0.0, "send_s": stats["seconds"]}


def _percentile(values: list[float], q: float) -> float:
    """The ``q`` quantile (nearest rank) of ``values``; nan when there are none."""
    return sorted(values)[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


async def _run_mode(mode: str, args, model: str, prompts: list[list[int]], stop: list[int]) -> dict:
    from clawray.actors.rollout import RolloutEngineActor
    from clawray.engines.base import GenerateRequest
    from clawray.weight_sync import WeightSyncController

    rollout = {
        "backend": args.backend,
        "torch_threads": args.engine_threads,
        "cpu_affinity": args.engine_cpus,
        "dtype": "float32",
        "max_model_len": 1024,
        "kv_cache_gib": 0.5,
    }
    engine = RolloutEngineActor.options(num_cpus=0.5).remote(model, rollout)
    sender = ray.remote(_Sender).options(num_cpus=0.1).remote(model)
    await engine.ready.remote()
    plan = await engine.weight_specs.remote()
    ctl = WeightSyncController(
        [sender], [engine], ["rollout-0"], plan, timeout_s=120.0, mode=mode, transport=args.transport
    )
    loop = asyncio.get_running_loop()
    await loop.run_in_executor(None, ctl.connect)
    # a fresh engine's first generation is several times slower (vLLM on CPU: 4.7 s for 32 tokens, 1.6 s
    # after): run one before the traffic, or it overlaps the first sync and sets the p99 of both modes
    await engine.generate.remote(
        GenerateRequest(prompt_ids=prompts[0], max_tokens=args.max_tokens, stop_token_ids=stop)
    )
    requests: list[tuple[float, float, int]] = []  # (start, end, tokens)
    stop_at = [float("inf")]

    async def one(k: int) -> None:
        req = GenerateRequest(
            prompt_ids=prompts[k % len(prompts)],
            max_tokens=args.max_tokens,
            temperature=1.0,
            stop_token_ids=stop,
            seed=k,
        )
        t0 = time.perf_counter()
        out = await engine.generate.remote(req)
        requests.append((t0, time.perf_counter(), len(out["response_ids"])))

    async def arrivals() -> None:  # open loop: Poisson arrivals, fixed seed
        rng, tasks, k = random.Random(0), [], 0
        while time.perf_counter() < stop_at[0]:
            tasks.append(asyncio.ensure_future(one(k)))
            k += 1
            await asyncio.sleep(rng.expovariate(1.0 / args.gap))
        await asyncio.gather(*tasks)

    clients = [asyncio.ensure_future(arrivals())]
    syncs: list[tuple[float, float, dict]] = []
    await asyncio.sleep(args.warmup)
    for v in range(1, args.syncs + 1):
        t0 = time.perf_counter()
        result = await loop.run_in_executor(None, ctl.sync, v)
        syncs.append((t0, time.perf_counter(), result))
        if not result["ok"]:
            raise RuntimeError(result["error"])
        await asyncio.sleep(args.interval)
    stop_at[0] = time.perf_counter()
    await asyncio.gather(*clients)
    await loop.run_in_executor(None, ctl.close)
    ray.kill(engine)
    ray.kill(sender)

    def overlaps(s: float, e: float) -> bool:
        return any(s < pe and e > ps for ps, pe, _ in syncs)

    clean = [(e - s) / max(n, 1) for s, e, n in requests if not overlaps(s, e)]
    per_token = statistics.median(clean) if clean else float("nan")
    added = [(e - s) - per_token * n for s, e, n in requests if overlaps(s, e)]
    results = [r for _, _, r in syncs]

    def detail(s: float, e: float, n: int) -> dict:  # one overlapping request against its sync
        ps, pe, r = next((ps, pe, r) for ps, pe, r in syncs if s < pe and e > ps)
        return {"start_vs_sync_s": s - ps, "end_vs_sync_end_s": e - pe, "tokens": n, "pause_s": r["pause_s"]}

    return {
        "requests": len(requests),
        "overlapping": len(added),
        "clean": len(clean),
        "s_per_token": per_token,
        "p50": _percentile(added, 0.5),
        "p99": _percentile(added, 0.99),
        "pause_s": statistics.mean(r["pause_s"] for r in results),
        "transfer_load_s": statistics.mean(r["receive_s"]["rollout-0"] + r["load_s"]["rollout-0"] for r in results),
        "engine_cpus": ",".join(map(str, args.engine_cpus)),  # "" = anywhere
        "interrupted": sum(r["interrupted"] for r in results),
        "inflight": sum(r.get("inflight", 0) for r in results),
        "added_s": added,  # per overlapping request, with its place against the sync it overlapped:
        "overlap_detail": [detail(s, e, n) for s, e, n in requests if overlaps(s, e)],
    }


def summarize_runs(runs: list[dict]) -> dict:
    """One mode's runs as one row: the figures of the run whose ratio p99 / (transfer + load) is the
    median (the lower middle one for an even count), plus ``ratios`` (each run's), ``pooled_p99`` (the
    p99 of every run's overlapping requests together), ``pooled_overlapping`` (their count) and
    ``pooled_ratio`` (``pooled_p99`` / the runs' mean transfer + load).

    Raises:
        ValueError: ``runs`` is empty.
    """
    if not runs:
        raise ValueError("summarize_runs: no runs")
    ratios = [r["p99"] / r["transfer_load_s"] for r in runs]
    middle = runs[ratios.index(statistics.median_low(ratios))]
    pooled = [a for r in runs for a in r["added_s"]]
    pooled_p99 = _percentile(pooled, 0.99)
    return {
        **middle,
        "ratios": ratios,
        "pooled_p99": pooled_p99,
        "pooled_overlapping": len(pooled),
        "pooled_ratio": pooled_p99 / statistics.mean(r["transfer_load_s"] for r in runs),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="", help="HF folder (default: build the tiny model)")
    ap.add_argument("--backend", default="hf", choices=["hf", "vllm"])
    ap.add_argument("--gap", type=float, default=1.5, help="mean seconds between request arrivals (Poisson)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--syncs", type=int, default=6)
    ap.add_argument("--interval", type=float, default=6.0, help="seconds between syncs")
    ap.add_argument("--warmup", type=float, default=3.0, help="seconds of traffic before the first sync")
    ap.add_argument("--modes", default="drain,interrupt,inflight")
    ap.add_argument(
        "--transport", default="collective", choices=["collective", "ipc", "auto"], help="sync.transport (gloo or ipc)"
    )
    ap.add_argument("--engine-threads", type=int, default=2, help="rollout.torch_threads")
    ap.add_argument(
        "--engine-cpus",
        type=lambda v: sorted({int(c) for c in v.split(",")}),
        default=[],
        help="rollout.cpu_affinity, e.g. 0 (comma-separated); the bench, Ray and the sender run on the other CPUs",
    )
    ap.add_argument("--runs", type=int, default=1, help="repeat the measurement; ratios are medians over runs")
    ap.add_argument("--json", default="", help="also write the figures as JSON here (bench/summary.py)")
    args = ap.parse_args()

    from transformers import AutoTokenizer

    from clawray.envs.arith import make_problems
    from clawray.model_folders import build_tiny_model
    from clawray.ray_env import init_ray

    model = args.model and os.path.expanduser(args.model) or build_tiny_model(os.path.join(tempfile.mkdtemp(), "tiny"))
    if args.engine_threads < 1:
        ap.error(f"--engine-threads {args.engine_threads}: must be >= 1")
    if args.runs < 1:
        ap.error(f"--runs {args.runs}: must be >= 1")
    if args.engine_cpus:  # Ray's processes and the sender start from here: they inherit the rest
        here = set(os.sched_getaffinity(0))
        if not set(args.engine_cpus) <= here:
            ap.error(f"--engine-cpus {args.engine_cpus}: this process may run on CPUs {sorted(here)} only")
        rest = here - set(args.engine_cpus)
        if not rest:
            ap.error(f"--engine-cpus {args.engine_cpus} leaves no CPU for Ray, the driver and the sender")
        os.sched_setaffinity(0, rest)
    init_ray("", 2)
    tok = AutoTokenizer.from_pretrained(model)
    questions = [p.question for p in make_problems(32, level=1, seed=0)]
    prompts = [
        tok.encode(
            tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False),
            add_special_tokens=False,
        )
        for q in questions
    ]
    stop = [tok.convert_tokens_to_ids(tok.eos_token)]
    print(
        f"model={model} backend={args.backend} gap={args.gap}s max_tokens={args.max_tokens} "
        f"syncs={args.syncs} interval={args.interval}s engine_threads={args.engine_threads} "
        f"engine_cpus={args.engine_cpus or 'any'}"
    )
    print(
        f"{'mode':>9} {'requests':>8} {'overlap':>7} {'s/token':>8} {'added_p50_s':>11} {'added_p99_s':>11} "
        f"{'pause_s':>8} {'xfer+load_s':>11} {'interrupted':>11} {'inflight':>8}"
    )
    modes = args.modes.split(",")
    runs: dict[str, list[dict]] = {mode: [] for mode in modes}
    for _ in range(args.runs):
        for mode in modes:
            r = asyncio.run(_run_mode(mode, args, model, prompts, stop))
            runs[mode].append(r)
            print(
                f"{mode:>9} {r['requests']:>8} {r['overlapping']:>7} {r['s_per_token']:>8.4f} {r['p50']:>11.3f} "
                f"{r['p99']:>11.3f} "
                f"{r['pause_s']:>8.3f} {r['transfer_load_s']:>11.3f} {r['interrupted']:>11} {r['inflight']:>8}",
                flush=True,
            )
    rows = {mode: summarize_runs(mode_runs) for mode, mode_runs in runs.items()}
    for mode, r in rows.items():
        line = f"{mode}: p99 added latency / (transfer + load) = {r['p99'] / r['transfer_load_s']:.2f}"
        if len(r["ratios"]) > 1:
            line += (
                f" (median of {len(r['ratios'])} runs, {min(r['ratios']):.2f}-{max(r['ratios']):.2f}; "
                f"pooled p99 over {r['pooled_overlapping']} requests {r['pooled_ratio']:.2f})"
            )
        print(line)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f)
    ray.shutdown()


if __name__ == "__main__":
    sys.exit(main())
