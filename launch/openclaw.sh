#!/usr/bin/env bash
# Run the real OpenClaw agent against a clawray endpoint: installs pinned Node.js 24 + OpenClaw once into
# ~/.cache/clawray/openclaw, writes an isolated OpenClaw config for the endpoint, then runs `openclaw ARGS`.
#   launch/openclaw.sh [--url http://127.0.0.1:8000/v1] [--workspace DIR] agent --local --session-id s1 -m "hello"
# Options: .venv/bin/clawray openclaw --help; what clawray makes of OpenClaw's requests: docs/openclaw.md
set -euo pipefail
cd "$(dirname "$0")/.."
exec .venv/bin/clawray openclaw "$@"
