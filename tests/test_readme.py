"""The README is built from docs/ (scripts/build_readme.py), so the two never drift apart."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_readme_is_built_from_docs() -> None:
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "build_readme.py"), "--check"],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_readme_opens_with_the_two_commands() -> None:
    head = (ROOT / "README.md").read_text().split("\n\n", 2)[1]
    assert "make demo" in head and "make test" in head
    assert "make test" in (ROOT / ".ci" / "run").read_text()
