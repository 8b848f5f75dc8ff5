"""The vLLM connector's tests run only where vLLM is installed (the ``.venv-vllm`` that ``make test-vllm`` builds).

Everything else in the suite runs from ``.venv``, whose transformers vLLM 0.32 does
not accept; ``make test`` runs this directory a second time from ``.venv-vllm``.
Tests that start real engines are marked ``vllm`` (``-m "not vllm"`` skips them).
"""

from __future__ import annotations

import importlib.util

collect_ignore_glob = [] if importlib.util.find_spec("vllm") is not None else ["test_*.py"]
