"""The SGLang backend's tests run only where SGLang is installed (the ``.venv-sglang`` that ``make setup-sglang`` builds).

sglang 0.5.23 is installed there ``--no-deps`` beside the CPU torch (its own
dependencies pin CUDA torch); ``make test`` runs this directory a second time
from that venv, and the main venv runs only the tests that need no SGLang.
Tests that start real SGLang servers are marked ``sglang`` (``-m "not sglang"``
skips them); each module starts its servers once (``server.py``).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

SGLANG_FREE = ("test_config.py",)
"""Tests of the settings and the page keys, which import no SGLang: they run in every venv."""

collect_ignore = [] if importlib.util.find_spec("sglang") is not None else [
    p.name for p in Path(__file__).parent.glob("test_*.py") if p.name not in SGLANG_FREE]


@pytest.fixture(scope="session")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Two tiny Qwen2 models of one shape and different random weights (``server.write_qwen2``), written once."""
    from tests.connectors.sglang.server import write_qwen2

    root = tmp_path_factory.mktemp("sglang-models")
    return {"qwen2": write_qwen2(root / "qwen2", seed=1), "qwen2-other": write_qwen2(root / "qwen2-other", seed=2)}
