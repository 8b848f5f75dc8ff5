#!/usr/bin/env bash
# The vLLM connector's CUDA checks (tests/connectors/vllm/test_cuda.py), for a machine with a GPU: vLLM's own
# CUDA cache writers (FlashAttention NHD/HND, MLA) against the connector's views, and device <-> store copies.
# It installs vLLM's CUDA wheel (several GB) into .venv-gpu-vllm.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv-gpu-vllm
.venv-gpu-vllm/bin/pip install -q --upgrade pip
.venv-gpu-vllm/bin/pip install -q -e '.[vllm,dev]'
.venv-gpu-vllm/bin/python -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.cuda.get_device_name())"
.venv-gpu-vllm/bin/python -m pytest -q -p no:cacheprovider -m cuda tests/connectors/vllm
