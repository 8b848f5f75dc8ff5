"""The SGLang backend's tests run only where SGLang is installed (the ``.venv-sglang`` that ``make setup-sglang`` builds).

sglang 0.5.23 is installed there ``--no-deps`` beside the CPU torch (its own
dependencies pin CUDA torch); ``make test`` runs this directory a second time
from that venv, and the main venv runs only the tests that need no SGLang.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

SGLANG_FREE = ("test_config.py",)
"""Tests of the settings and the page keys, which import no SGLang: they run in every venv."""

collect_ignore = [] if importlib.util.find_spec("sglang") is not None else [
    p.name for p in Path(__file__).parent.glob("test_*.py") if p.name not in SGLANG_FREE]
