"""On-policy gap: ``inv/logprob_mismatch_kl`` between a rollout engine and the FSDP2 learner.

With a zero learning rate (the default) the weights never change, so every difference between the
engine's log-probs and the learner's recomputation of the same tokens is numerics (kernels, dtype);
with ``--lr`` > 0 later steps add what the engine's copy of the updated weights rounds otherwise.
Runs 5 train+sync steps per configuration (weights over ``--transport``, default ``auto``: ipc on
one host; figures before 2026-12-05 used the gloo ``collective``) and prints the per-step KL (k3),
the max ratio, the engine's sampling tokens/s and the learner's step seconds.

    python bench/mismatch.py --model /path/to/hf-folder --backend vllm --dtype bfloat16
    python bench/mismatch.py --tiny                      # builds the tiny model, runs hf + vllm fp32/bf16
    python bench/mismatch.py --model M --backend hf --gpu --lr 1e-5 --steps 6
        # one GPU: the engine and one learner share it (ipc sync); the four pairs engine bf16/fp32 x
        # learner compute bf16/fp32 (GPU_CONFIGS; --dtype and --compute-dtype do not apply); the
        # figures of README "GPU check" (launch/gpu_check_offline.sh step 5)
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import ray
import torch

from clawray.actors.learner import LearnerGroup
from clawray.actors.rollout import RolloutEngineActor
from clawray.checkpoint import learner_compute_dtype
from clawray.engines.base import GenerateRequest
from clawray.ray_env import free_port, init_ray
from clawray.types import Sample
from clawray.weight_sync import WeightSyncController

LEARNER = dict(
    num_workers=2,
    num_cpus=0.25,
    torch_threads=1,
    lr=0.0,
    weight_decay=0.0,
    betas=[0.9, 0.98],
    grad_clip=1.0,
    eps=0.2,
    eps_high=0.28,
    dist_timeout_s=120,
)
# (engine dtype, learner compute dtype) on one GPU: today's GPU preset first
GPU_CONFIGS = [("bfloat16", "bfloat16"), ("float32", "bfloat16"), ("bfloat16", "float32"), ("float32", "float32")]


def run(
    model: str,
    backend: str,
    dtype: str,
    steps: int = 5,
    batch: int = 4,
    max_tokens: int = 32,
    gpu: bool = False,
    compute_dtype: str = "auto",
    lr: float = 0.0,
    transport: str = "auto",
) -> list[dict]:
    """``steps`` rows of ``{"step", "kl", "ratio_max", "tokens", "gen_tokens_per_s", "train_s"}``:
    the engine (``backend``, ``dtype``) samples ``batch`` replies, the learners score and train on them
    at ``lr`` (0: the KL is numerics alone; > 0: step 1's is, later steps add what the engine's copy
    of the updated weights loses, e.g. fp32 master weights rounded to a bf16 engine), then sync over
    ``transport``. ``gpu``: engine and one learner rank share the GPU (half each in Ray's accounting),
    else two CPU ranks; the learners compute in ``compute_dtype`` (``learner.compute_dtype``)."""
    rollout = {"backend": backend, "torch_threads": 2, "dtype": dtype, "max_model_len": 1024, "kv_cache_gib": 0.5}
    if gpu:
        rollout["gpu_memory_utilization"] = 0.3
    hf_dtype = {"dtype": dtype} if backend == "hf" else None  # the hf backend runs float32 unless told
    engine = RolloutEngineActor.options(num_cpus=0.5, num_gpus=0.5 if gpu else 0).remote(
        model, rollout, name="bench", engine_kwargs=hf_dtype
    )
    learner = dict(LEARNER, lr=lr, compute_dtype=compute_dtype)
    if gpu:
        learner.update(num_workers=1, num_gpus=0.5)
    learners = sync = None
    try:
        learners = LearnerGroup(model, learner, free_port())
        ray.get(engine.ready.remote())
        plan = ray.get(engine.weight_specs.remote())
        sync = WeightSyncController(learners.workers, [engine], ["bench"], plan, transport=transport, timeout_s=120)
        sync.connect()
        prompt = list(range(10, 30))
        rows = []
        for step in range(steps):
            t0 = time.perf_counter()
            outs = ray.get(
                [
                    engine.generate.remote(
                        GenerateRequest(prompt, max_tokens=max_tokens, temperature=1.0, seed=step * 100 + i)
                    )
                    for i in range(batch)
                ]
            )
            gen_s = time.perf_counter() - t0
            refs = [
                ray.put(
                    Sample(
                        tokens=prompt + o["response_ids"],
                        prompt_len=len(prompt),
                        loss_mask=[1] * len(o["response_ids"]),
                        rollout_logprobs=o["logprobs"],
                        reward=1.0 if i % 2 else -1.0,
                        policy_version=o["policy_version"],
                    )
                )
                for i, o in enumerate(outs)
            ]
            t0 = time.perf_counter()
            m = learners.train_step(refs, step + 1)
            train_s = time.perf_counter() - t0
            result = sync.sync(step + 1)
            if result.get("error"):
                raise RuntimeError(f"weight sync to v{step + 1} failed: {result['error']}")
            rows.append(
                {
                    "step": step + 1,
                    "kl": m["inv/logprob_mismatch_kl"],
                    "ratio_max": m["inv/ratio_max"],
                    "tokens": m["num_tokens"],
                    "gen_tokens_per_s": sum(len(o["response_ids"]) for o in outs) / gen_s,
                    "train_s": train_s,
                }
            )
        return rows
    finally:
        if sync is not None:
            sync.close()
        ray.kill(engine)
        if learners is not None:
            learners.shutdown()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model")
    parser.add_argument(
        "--tiny", action="store_true", help="build the tiny model and run hf fp32, vllm fp32, vllm bf16"
    )
    parser.add_argument("--backend", default="vllm")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument(
        "--gpu",
        action="store_true",
        help="one GPU: the four engine dtype x learner compute dtype pairs (GPU_CONFIGS; not --dtype/--compute-dtype)",
    )
    parser.add_argument(
        "--compute-dtype", default="auto", choices=["auto", "bfloat16", "float32"], help="learner.compute_dtype"
    )
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--lr", type=float, default=0.0, help="> 0: later steps add the weight-update drift")
    parser.add_argument("--transport", default="auto", choices=["auto", "ipc", "collective", "object_store"])
    args = parser.parse_args()
    init_ray(num_cpus=os.cpu_count())
    if args.tiny:
        from clawray.model_folders import build_tiny_model

        model = build_tiny_model(os.path.join(tempfile.mkdtemp(), "tiny"))
        configs = [("hf", "float32", "auto"), ("vllm", "float32", "auto"), ("vllm", "bfloat16", "auto")]
    elif args.model:
        model = args.model
        configs = (
            [(args.backend, e, c) for e, c in GPU_CONFIGS]
            if args.gpu
            else [(args.backend, args.dtype, args.compute_dtype)]
        )
    else:
        parser.error("give --model PATH or --tiny")
    print(f"model: {model}, lr {args.lr:g}, transport {args.transport}")
    print(
        "| backend | engine dtype | learner compute | KL per step (k3, mean over tokens) | max | ratio_max "
        "| engine tokens/s | learner step s |"
    )
    print("|---|---|---|---|---|---|---|---|")
    failed = False
    for backend, dtype, compute in configs:
        t0 = time.perf_counter()
        compute = learner_compute_dtype(1.0 if args.gpu else 0.0, compute)
        try:
            rows = run(
                model, backend, dtype, steps=args.steps, gpu=args.gpu, compute_dtype=compute,
                lr=args.lr, transport=args.transport,
            )  # fmt: skip
        except Exception as e:  # noqa: BLE001 - one failed configuration leaves the others' rows
            print(f"| {backend} | {dtype} | {compute} | failed: {str(e)[:300]} |", flush=True)
            failed = True
            continue
        kls = [r["kl"] for r in rows]
        later = rows[1:] or rows  # the first step includes warm-up
        print(
            f"| {backend} | {dtype} | {compute} | {' '.join(f'{k:.2e}' for k in kls)} | "
            f"{max(kls):.2e} | {max(r['ratio_max'] for r in rows):.4f} | "
            f"{statistics.median(r['gen_tokens_per_s'] for r in later):.0f} | "
            f"{statistics.median(r['train_s'] for r in later):.3f} |  ({time.perf_counter() - t0:.0f}s)",
            flush=True,
        )
    return 1 if failed else 0


if __name__ == "__main__":
    torch.set_num_threads(1)
    sys.exit(main())
