#!/usr/bin/env bash
# Submit a clawray run as a Ray job to a running cluster.
#
#   ray start --head --num-cpus=2 --dashboard-host=127.0.0.1        # once, on the head node
#   RAY_ADDRESS=http://127.0.0.1:8265 launch/submit.sh conf/rl.yaml conf/cpu.yaml trainer.num_steps=5
#
# Config files are passed as absolute paths (the job's working directory is not this one) and the
# run folder defaults to ./runs/job-<time> here. Extra `ray job submit` flags go in RAY_JOB_FLAGS
# (e.g. RAY_JOB_FLAGS="--no-wait"). With a token-authenticated cluster (Ray 2.60's default for
# `ray start`) export RAY_AUTH_MODE=token so the CLI sends ~/.ray/auth_token.
set -euo pipefail

if [[ $# -lt 1 ]]; then
  echo "usage: RAY_ADDRESS=http://HOST:8265 $0 CONFIG.yaml [MORE.yaml ...] [key=value ...]" >&2
  exit 2
fi
RAY_ADDRESS="${RAY_ADDRESS:-http://127.0.0.1:8265}"
PYTHON="${CLAWRAY_PYTHON:-python}"

args=()
has_run_dir=0
for a in "$@"; do
  if [[ "$a" != *=* ]]; then
    [[ -f "$a" ]] || { echo "config file not found: $a" >&2; exit 2; }
    args+=("$(cd "$(dirname "$a")" && pwd)/$(basename "$a")")
  else
    [[ "$a" == run_dir=* ]] && has_run_dir=1
    args+=("$a")
  fi
done
[[ $has_run_dir == 1 ]] || args+=("run_dir=$PWD/runs/job-$(date +%Y%m%d-%H%M%S)")

# shellcheck disable=SC2086
exec ray job submit --address "$RAY_ADDRESS" ${RAY_JOB_FLAGS:-} -- \
  "$PYTHON" -m clawray.cli run "${args[@]}" ray.address=auto
