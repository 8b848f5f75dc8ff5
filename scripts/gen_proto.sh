#!/usr/bin/env bash
# Regenerate the checked-in Python stubs of proto/kvstore/v1/kvstore.proto.
#
# Usage: scripts/gen_proto.sh [OUT_DIR]
#   OUT_DIR defaults to the repository root, so the stubs land in kvstore/v1/.
#   tests/server/test_proto.py runs it into a temporary directory and fails when
#   the result differs from the checked-in files (run this script and commit).
# Needs grpcio-tools (pip install -e '.[dev]'); uses the current `python`.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${1:-$ROOT}"
PYTHON="${PYTHON:-python}"

mkdir -p "$OUT/kvstore/v1"
cd "$ROOT/proto"
"$PYTHON" -m grpc_tools.protoc \
  -I . \
  --python_out="$OUT" \
  --pyi_out="$OUT" \
  --grpc_python_out="$OUT" \
  kvstore/v1/kvstore.proto
cat > "$OUT/kvstore/v1/__init__.py" <<'PY'
"""Generated protobuf and gRPC stubs of ``proto/kvstore/v1/kvstore.proto`` (regenerate with ``scripts/gen_proto.sh``)."""
PY
