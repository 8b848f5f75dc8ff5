"""``make test`` runs every half (the main suite, the vLLM connector's) even when one fails, and fails at the end.

The project's Makefile runs here with real ``make`` and real pytest, in a
temporary folder holding a copy of it and three small test trees: ``tests/`` (the
main half), ``tests/connectors/vllm/`` and ``tests/connectors/sglang/`` (the engines'
halves, which the main half does not collect, as the project's conftest keeps them
out of the main venv). Each tree has one test that fails when ``FAIL_HALVES`` names its half.
``-o`` keeps make from building the venvs (the set-up targets count as done) and
both halves run from this interpreter.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # starts processes or servers, or takes seconds: outside `make test-fast`

ROOT = Path(__file__).resolve().parents[1]
HALVES = ("main", "vllm", "sglang")


def _tree(root: Path) -> None:
    shutil.copy(ROOT / "Makefile", root / "Makefile")
    (root / "pytest.ini").write_text("[pytest]\ntestpaths = tests\nnorecursedirs = connectors\n")
    for half, folder in (("main", root / "tests"), ("vllm", root / "tests" / "connectors" / "vllm"),
                         ("sglang", root / "tests" / "connectors" / "sglang")):
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"test_{half}_half.py").write_text(
            "import os\n\n\n"
            f"def test_{half}_half_ran() -> None:\n"
            f"    assert '{half}' not in os.environ.get('FAIL_HALVES', '').split(), 'the {half} half failed'\n")


def _make_test(root: Path, fail: tuple[str, ...]) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "FAIL_HALVES": " ".join(fail)}
    env.pop("MAKEFLAGS", None)
    return subprocess.run(["make", "-o", "setup", "-o", "system-deps", "-o", "setup-vllm", "-o", "setup-sglang", "test",
                           f"PY={sys.executable}", f"VLLM_PY={sys.executable}", f"SGLANG_PY={sys.executable}",
                           "PYTEST_ARGS=-q -p no:cacheprovider"],
                          cwd=root, env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("fail", [(), ("main",), ("vllm",), ("sglang",), ("main", "vllm")], ids=lambda f: "+".join(f) or "none")
def test_every_half_runs_and_the_target_fails_at_the_end(tmp_path: Path, fail: tuple[str, ...]) -> None:
    _tree(tmp_path)
    result = _make_test(tmp_path, fail)
    output = result.stdout + result.stderr
    for half in HALVES:  # each half ran its own test, and said whether it passed
        assert f"make test: the {half} half:" in output, output
    assert output.count("1 passed") == len(HALVES) - len(fail), output
    assert output.count("1 failed") == len(fail), output
    if fail:
        assert result.returncode != 0, output
        assert f"make test: FAILED: {' '.join(fail)}" in result.stderr, output
    else:
        assert result.returncode == 0, output
        assert "make test: every half passed" in result.stdout, output
