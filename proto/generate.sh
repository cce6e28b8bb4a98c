#!/usr/bin/env bash
# Regenerate specmesh/v1/*_pb2*.py from proto/specmesh/v1/*.proto (grpcio-tools, pinned in
# pyproject.toml). `proto/generate.sh --check` fails if the committed code is stale.
set -euo pipefail
cd "$(dirname "$0")/.."
out=$(mktemp -d)
python3 -m grpc_tools.protoc -Iproto --python_out="$out" --pyi_out="$out" --grpc_python_out="$out" proto/specmesh/v1/*.proto
# generated modules import "specmesh.v1.x_pb2": they live in the specmesh package, as specmesh/v1/
if [ "${1:-}" = "--check" ]; then
  if ! diff -r -x __init__.py -x __pycache__ "$out/specmesh/v1" specmesh/v1 >/dev/null; then
    echo "generated protobuf code is stale: run proto/generate.sh" >&2
    diff -r -x __init__.py -x __pycache__ "$out/specmesh/v1" specmesh/v1 | head -20 >&2
    exit 1
  fi
  echo "generated protobuf code is fresh"
else
  mkdir -p specmesh/v1
  cp "$out"/specmesh/v1/*.py "$out"/specmesh/v1/*.pyi specmesh/v1/
  [ -f specmesh/v1/__init__.py ] || echo '"""Generated protobuf and gRPC code (proto/specmesh/v1). Do not edit."""' > specmesh/v1/__init__.py
fi
rm -rf "$out"
