#!/usr/bin/env bash
# One-GPU check: the vLLM engine and one FSDP2 learner on the SAME GPU, weights synced over CUDA IPC
# (sync.transport=ipc; two processes on one GPU cannot form an NCCL group), 3 updates of the tiny
# model, then the sync seconds, sync GB/s and generation tokens/s of every step.
#
#   bash launch/gpu_check.sh                      # installs (.venv, CUDA torch + vLLM), then runs
#   bash launch/gpu_check.sh rollout.gpu_memory_utilization=0.3   # extra key=value overrides
#   WITH_LOOP=1 bash launch/gpu_check.sh          # then step 6: async vs serial loop on SmolLM2 (about 5 min more)
#
# Steps: (1) setup.sh gpu; (2) nvidia-smi and torch / vLLM / CUDA versions; (3) an IpcTransport round
# trip between two Ray actors holding 0.5 GPU each (CUDA tensors, bit-exact, timed); (4)
# `clawray run conf/rl.yaml conf/gpu.yaml trainer.num_steps=3` in a fresh run folder; (5) a table from
# the run's metrics.jsonl; with WITH_LOOP=1, (6) bench/loop_throughput.py on SmolLM2-135M-Instruct with
# conf/gpu.yaml and the CPU demo's workload (brief, 2 turns), whose last line is the async / serial ratio
# (#16's target: >= 1.8x). Exits non-zero when any step fails, a sync failed or a metric is missing.
set -euo pipefail
cd "$(dirname "$0")/.."

echo "== 1. install (launch/setup.sh gpu)"
bash launch/setup.sh gpu
# shellcheck disable=SC1091
. .venv/bin/activate
export RAY_AUTH_MODE="${RAY_AUTH_MODE:-disabled}" WANDB_MODE="${WANDB_MODE:-offline}"

echo "== 2. machine"
nvidia-smi
python - <<'EOF'
import torch, vllm, ray
print(f"torch {torch.__version__} (CUDA {torch.version.cuda}) | vllm {vllm.__version__} | ray {ray.__version__}")
assert torch.cuda.is_available(), "torch sees no CUDA device"
print(f"device 0: {torch.cuda.get_device_name(0)}, {torch.cuda.get_device_properties(0).total_memory / 2**30:.0f} GiB, "
      f"{torch.cuda.device_count()} visible")
EOF

echo "== 3. ipc transport between two Ray actors sharing the GPU (0.5 GPU each)"
python - <<'EOF'
import time
import ray, torch
from clawray.engines.base import WeightSpec
from clawray.ray_env import init_ray

init_ray()  # a local Ray on loopback, as `clawray run` starts it
from clawray.weight_sync import IpcTransport, WeightMailboxActor

PLAN = [WeightSpec(f"w{i}", (4096, 4096), "torch.bfloat16") for i in range(16)]  # 512 MiB


class Peer:
    def __init__(self, rank, mailbox):
        self.t = IpcTransport(rank, 2, PLAN, 256 << 20, 60.0, mailbox, device="cuda", name=f"peer-{rank}")
        gen = torch.Generator(device="cuda").manual_seed(0)
        self.state = {s.name: torch.randn(s.shape, generator=gen, device="cuda").to(torch.bfloat16) for s in PLAN}

    def send(self, version):
        return self.t.send(self.state, version)

    def receive(self, version):
        t0 = time.perf_counter()
        items = list(self.t.receive(version))
        ok = all(v.is_cuda for _, v in items) and all(torch.equal(v, self.state[n]) for n, v in items)
        del items
        self.t.done()
        return ok, time.perf_counter() - t0


mailbox = WeightMailboxActor.options(num_cpus=0).remote()
peer = ray.remote(Peer).options(num_cpus=1, num_gpus=0.5)
sender, receiver = peer.remote(0, mailbox), peer.remote(1, mailbox)
for v in (1, 2, 3):
    stats, (ok, recv_s) = ray.get([sender.send.remote(v), receiver.receive.remote(v)], timeout=300)
    assert ok, "received tensors are not bit-exact CUDA tensors"
    print(f"ipc sync v{v}: {stats['bytes'] / 2**20:.0f} MiB in {stats['seconds']:.3f}s "
          f"({stats['bytes'] / 1e9 / stats['seconds']:.1f} GB/s incl. pack + ack), receiver {recv_s:.3f}s, bit-exact on cuda")
ray.shutdown()
EOF

echo "== 4. clawray run conf/rl.yaml conf/gpu.yaml trainer.num_steps=3"
RUN_DIR="runs/gpu-check-$(date +%Y%m%d-%H%M%S)"
clawray run conf/rl.yaml conf/gpu.yaml trainer.num_steps=3 "run_dir=$RUN_DIR" "$@"

echo "== 5. per-step figures from $RUN_DIR/metrics.jsonl"
python - "$RUN_DIR/metrics.jsonl" <<'EOF'
import json, sys

rows = [json.loads(line) for line in open(sys.argv[1]) if line.strip()]
keys = ["timing/weight_sync_s", "sync/gbytes_per_s", "sync/bytes", "rollout/tokens_per_s", "rollout/tokens"]
print("| step | policy v | weight_sync_s | sync GB/s | sync MB | gen tokens/s | gen tokens |")
print("|---|---|---|---|---|---|---|")
bad = []
for r in rows:
    missing = [k for k in keys if k not in r]
    if missing:
        bad.append(f"step {r['step']} lacks {missing}")
        continue
    if r.get("sync/ok", 1.0) != 1.0:
        bad.append(f"step {r['step']}: the weight sync failed")
    print(f"| {r['step']} | {r['policy_version']} | {r['timing/weight_sync_s']:.3f} | {r['sync/gbytes_per_s']:.2f} "
          f"| {r['sync/bytes'] / 1e6:.1f} | {r['rollout/tokens_per_s']:.0f} | {r['rollout/tokens']:.0f} |")
if len(rows) < 3:
    bad.append(f"{len(rows)} step(s) logged, expected 3")
if bad:
    sys.exit("gpu_check FAILED: " + "; ".join(bad))
print("gpu_check ok")
EOF

if [[ "${WITH_LOOP:-0}" == 1 ]]; then
  echo "== 6. loop throughput on one GPU: async vs serial (bench/loop_throughput.py, SmolLM2-135M-Instruct)"
  SMOL="$HOME/.cache/clawray/models/smollm2-135m-instruct"
  [[ -d "$SMOL" ]] || clawray model smollm2 "$SMOL"
  PYTHONPATH=. python bench/loop_throughput.py --model "$SMOL" --backend vllm --preset conf/gpu.yaml \
    --set env.name=brief env.max_turns=2
fi
