#!/usr/bin/env bash
# The CUDA checks, as one short script for a machine with a GPU (the device tool, or a developer's box):
# the memory tier on cuda:N and on pinned host memory, and the HF connector's bf16 exact-match test.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv-gpu
.venv-gpu/bin/pip install -q --upgrade pip
.venv-gpu/bin/pip install -q torch           # the CUDA build on a GPU machine
.venv-gpu/bin/pip install -q -e '.[hf,dev]'
.venv-gpu/bin/python -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.cuda.get_device_name())"
.venv-gpu/bin/python -m pytest -q -p no:cacheprovider -m cuda tests/tiers tests/connectors
