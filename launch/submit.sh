#!/usr/bin/env bash
# Submit a clawray run as a Ray job to a running cluster, from any machine that reaches its dashboard.
#
#   RAY_ADDRESS=http://HEAD:8265 launch/submit.sh conf/rl.yaml conf/cpu.yaml trainer.num_steps=5
#
# What it does (launch/cluster.md has the whole picture):
#   * `ray job submit --working-dir <this checkout>` with a runtime_env that ships the checkout (minus
#     .venv, runs, .git) to every node: each worker imports this clawray, and the job starts in it, so
#     config files are given relative to the checkout (a file outside it is refused);
#   * the `ray` CLI is $CLAWRAY_RAY, else this checkout's .venv/bin/ray, else the one on PATH;
#   * token auth (Ray 2.60): when RAY_AUTH_MODE is unset and a token is at hand (RAY_AUTH_TOKEN,
#     RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token), RAY_AUTH_MODE=token is exported, as `ray start` does;
#   * on the cluster the entrypoint (launch/job_entry.sh) runs `python -m clawray.cli run ... ray.address=auto`
#     with the first of $CLAWRAY_PYTHON (a path on the head node, passed on), python3, python that
#     imports ray and torch;
#   * the run folder defaults to ~/clawray-runs/job-<time> *on the head node* (run_dir=... overrides;
#     a relative one lands in the job's temporary copy of the checkout).
# Extra `ray job submit` flags go in RAY_JOB_FLAGS (e.g. RAY_JOB_FLAGS="--no-wait").
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [[ $# -lt 1 ]]; then
  echo "usage: RAY_ADDRESS=http://HOST:8265 $0 CONFIG.yaml [MORE.yaml ...] [key=value ...]" >&2
  exit 2
fi
export RAY_ADDRESS="${RAY_ADDRESS:-http://127.0.0.1:8265}"

args=()
has_run_dir=0
for a in "$@"; do
  if [[ "$a" != *=* ]]; then
    [[ -f "$a" ]] || { echo "config file not found: $a" >&2; exit 2; }
    abs="$(cd "$(dirname "$a")" && pwd)/$(basename "$a")"
    [[ "$abs" == "$root"/* ]] || { echo "config file $a is outside the checkout $root that is shipped to the cluster: copy it under $root/conf/" >&2; exit 2; }
    args+=("${abs#"$root"/}")
  else
    [[ "$a" == run_dir=* ]] && has_run_dir=1
    args+=("$a")
  fi
done
# resolved by omegaconf on the head node ($HOME there), not by a shell
[[ $has_run_dir == 1 ]] || args+=("run_dir=\${oc.env:HOME}/clawray-runs/job-$(date +%Y%m%d-%H%M%S)")

ray_bin="${CLAWRAY_RAY:-}"
if [[ -z "$ray_bin" ]]; then
  if [[ -x "$root/.venv/bin/ray" ]]; then ray_bin="$root/.venv/bin/ray"
  elif command -v ray >/dev/null 2>&1; then ray_bin="ray"
  else echo "ray not found: run launch/setup.sh (installs .venv/bin/ray) or set CLAWRAY_RAY=/path/to/ray" >&2; exit 2
  fi
fi
if [[ -z "${RAY_AUTH_MODE:-}" ]] && [[ -n "${RAY_AUTH_TOKEN:-}" || -n "${RAY_AUTH_TOKEN_PATH:-}" || -f "$HOME/.ray/auth_token" ]]; then
  export RAY_AUTH_MODE=token
fi

env_vars=""
if [[ -n "${CLAWRAY_PYTHON:-}" ]]; then
  py="${CLAWRAY_PYTHON//\\/\\\\}"
  env_vars=", \"env_vars\": {\"CLAWRAY_PYTHON\": \"${py//\"/\\\"}\"}"
fi
runtime_env="{\"excludes\": [\".venv\", \"runs\", \".git\", \"**/__pycache__\", \"*.pyc\", \".ci\"]$env_vars}"
# shellcheck disable=SC2086
exec "$ray_bin" job submit --address "$RAY_ADDRESS" --working-dir "$root" --runtime-env-json "$runtime_env" \
  ${RAY_JOB_FLAGS:-} -- sh launch/job_entry.sh "${args[@]}" ray.address=auto
