"""The checked-in stubs under kvstore/v1/ are exactly what scripts/gen_proto.sh generates from the .proto."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
STUBS = ("__init__.py", "kvstore_pb2.py", "kvstore_pb2.pyi", "kvstore_pb2_grpc.py")


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("grpc_tools") is None, reason="grpcio-tools is not installed")
def test_regenerating_the_stubs_changes_nothing(tmp_path: Path) -> None:
    subprocess.run(["bash", str(REPO_ROOT / "scripts" / "gen_proto.sh"), str(tmp_path)], check=True,
                   env={**os.environ, "PYTHON": sys.executable}, capture_output=True, timeout=120)
    for name in STUBS:
        fresh = (tmp_path / "kvstore" / "v1" / name).read_text()
        checked_in = (REPO_ROOT / "kvstore" / "v1" / name).read_text()
        assert fresh == checked_in, f"kvstore/v1/{name} is stale: run scripts/gen_proto.sh and commit the result"


def test_generated_imports_are_clean() -> None:
    text = (REPO_ROOT / "kvstore" / "v1" / "kvstore_pb2_grpc.py").read_text()
    assert "from kvstore.v1 import kvstore_pb2" in text
