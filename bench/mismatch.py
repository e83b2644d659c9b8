"""On-policy gap at lr = 0: ``inv/logprob_mismatch_kl`` between a rollout engine and the FSDP2 learner.

With a zero learning rate the weights never change, so every difference between the engine's
log-probs and the learner's recomputation of the same tokens is engine numerics (kernels, dtype).
Runs 5 train+sync steps per configuration and prints the per-step KL (k3) and the mean |Δ logp|.

    python bench/mismatch.py --model /path/to/hf-folder --backend vllm --dtype bfloat16
    python bench/mismatch.py --tiny                      # builds the tiny model, runs hf + vllm fp32/bf16
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import ray
import torch

from clawray.actors.learner import LearnerGroup
from clawray.actors.rollout import RolloutEngineActor
from clawray.engines.base import GenerateRequest
from clawray.ray_env import free_port, init_ray
from clawray.types import Sample
from clawray.weight_sync import TransportSpec

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


def run(model: str, backend: str, dtype: str, steps: int = 5, batch: int = 4, max_tokens: int = 32) -> list[dict]:
    rollout = {"backend": backend, "torch_threads": 2, "dtype": dtype, "max_model_len": 1024, "kv_cache_gib": 0.5}
    hf_dtype = {"dtype": dtype} if backend == "hf" else None  # the hf backend runs float32 unless told
    engine = RolloutEngineActor.options(num_cpus=0.5).remote(model, rollout, name="bench", engine_kwargs=hf_dtype)
    learners = None
    try:
        learners = LearnerGroup(model, LEARNER, free_port())
        ray.get(engine.ready.remote())
        plan = ray.get(engine.weight_specs.remote())
        port = free_port()
        spec = TransportSpec("collective", 2, plan, bucket_bytes=64 << 20, timeout_s=120, port=port)
        ray.get(learners.init_weight_sender(spec) + [engine.init_weight_receiver.remote(1, spec)])
        prompt = list(range(10, 30))
        rows = []
        for step in range(steps):
            outs = ray.get(
                [
                    engine.generate.remote(
                        GenerateRequest(prompt, max_tokens=max_tokens, temperature=1.0, seed=step * 100 + i)
                    )
                    for i in range(batch)
                ]
            )
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
            m = learners.train_step(refs, step + 1)
            ray.get(learners.sync_weights(step + 1) + [engine.receive_weights.remote(step + 1)])
            rows.append(
                {
                    "step": step + 1,
                    "kl": m["inv/logprob_mismatch_kl"],
                    "ratio_max": m["inv/ratio_max"],
                    "tokens": m["num_tokens"],
                }
            )
        return rows
    finally:
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
    args = parser.parse_args()
    init_ray(num_cpus=os.cpu_count())
    if args.tiny:
        from clawray.model_folders import build_tiny_model

        model = build_tiny_model(os.path.join(tempfile.mkdtemp(), "tiny"))
        configs = [("hf", "float32"), ("vllm", "float32"), ("vllm", "bfloat16")]
    elif args.model:
        model, configs = args.model, [(args.backend, args.dtype)]
    else:
        parser.error("give --model PATH or --tiny")
    print(f"model: {model}")
    print("| backend | dtype | KL per step (k3, mean over tokens) | max | ratio_max |")
    print("|---|---|---|---|---|")
    for backend, dtype in configs:
        t0 = time.perf_counter()
        rows = run(model, backend, dtype)
        kls = [r["kl"] for r in rows]
        print(
            f"| {backend} | {dtype} | {' '.join(f'{k:.2e}' for k in kls)} | {max(kls):.2e} | "
            f"{max(r['ratio_max'] for r in rows):.4f} |  ({time.perf_counter() - t0:.0f}s)",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    torch.set_num_threads(1)
    sys.exit(main())
