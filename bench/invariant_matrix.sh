#!/usr/bin/env bash
# The seed's overview matrix, measured on REAL tiny-model runs: Binary RL, OPD and Combine, each a few
# policy updates of the whole loop (simulated users -> hf engine -> feedback judge -> queue -> FSDP2
# learner -> weight sync, behaviour monitor on), then `clawray report` over the three run folders,
# which prints nothing but writes the matrix into the first run's report/summary.md (printed here)
# and report/index.html. The tiny model's replies are random text: this checks that every invariant
# is measured in every mode, not that the tiny model learns.
#
#   bash bench/invariant_matrix.sh [OUT_DIR] [STEPS]      # default /tmp/clawray-matrix, 4 steps
#
# Environment: CLAWRAY (the clawray command; default .venv/bin/clawray, else `clawray` on PATH), PORT
# (the policy endpoint's port; default a free one).
# About 2-4 minutes per run on a 2-core CPU (the three run one after another).
set -euo pipefail
OUT=${1:-/tmp/clawray-matrix}
STEPS=${2:-4}
CLAWRAY=${CLAWRAY:-$( [ -x .venv/bin/clawray ] && echo .venv/bin/clawray || echo clawray )}
mkdir -p "$OUT"
# ray.init() without an address joins the newest cluster that `ray start` left on this machine (a
# test's, another user's); "local" makes each run start its own
export RAY_ADDRESS=${RAY_ADDRESS:-local}
PORT=${PORT:-$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}
[ -f "$OUT/tiny/config.json" ] || "$CLAWRAY" model tiny "$OUT/tiny"
COMMON=(
  model.path="$OUT/tiny" model.build=none rollout.backend=hf rollout.num_cpus=0.25 rollout.torch_threads=1
  judge.backend=feedback eval.enabled=false wandb.mode=disabled queue.max_staleness=2
  trainer.batch_size=2 trainer.num_steps="$STEPS" trainer.batch_timeout_s=300 learner.lr=1e-3
  env.concurrency=2 env.max_tokens=12 env.max_turns=2 serve.port="$PORT"
  monitor.every_steps=1 monitor.k=4 monitor.num_prompts=2 monitor.max_tokens=12
)
for mode in rl opd combine; do
  presets=(conf/rl.yaml conf/cpu.yaml)
  [ "$mode" = rl ] || presets+=("conf/$mode.yaml")
  echo "[matrix] $mode: ${presets[*]} -> $OUT/$mode"
  start=$(date +%s)
  "$CLAWRAY" run "${presets[@]}" "${COMMON[@]}" run_dir="$OUT/$mode" >"$OUT/$mode.log" 2>&1 \
    || { echo "[matrix] $mode failed, see $OUT/$mode.log"; tail -20 "$OUT/$mode.log"; exit 1; }
  echo "[matrix] $mode done in $(( $(date +%s) - start ))s"
done
"$CLAWRAY" report "$OUT/rl" "$OUT/opd" "$OUT/combine" >"$OUT/report.log" 2>&1
sed -n '/## Invariant matrix/,$p' "$OUT/rl/report/summary.md"
echo "[matrix] html: $OUT/rl/report/index.html"
