#!/usr/bin/env bash
# Regenerates router_sidecar/{wire,records}/*_pb2.py(i) from proto/router_sidecar/{wire,records}/*.proto.
#
# protoc comes from a pinned grpcio-tools (scripts/setup.sh puts it aside in .tools/protoc; without it, in a
# throwaway venv), so the output does not depend on what is installed. Its gencode version (protoc 35.1 ->
# Python gencode 7.35.1) must not be newer than the pinned runtime (protobuf==7.36.2 in requirements.lock):
# the runtime refuses newer gencode at import time.
#
#   scripts/gen_protos.sh [OUT_DIR]   (default: the repository root, i.e. overwrite the committed modules)
#
# GEN_PROTOS_PYTHON=/path/to/python uses that interpreter's grpc_tools (it must be version
# GRPCIO_TOOLS_VERSION); tests/unit/test_wire_compat.py uses it to check the committed output.
set -euo pipefail
cd "$(dirname "$0")/.."

GRPCIO_TOOLS_VERSION=1.85.0
out=$(realpath "${1:-.}")

python=${GEN_PROTOS_PYTHON:-}
if [ -z "$python" ] && [ -d .tools/protoc/grpc_tools ] && [ -x .venv/bin/python ]; then
  python=.venv/bin/python
  export PYTHONPATH=$(pwd)/.tools/protoc${PYTHONPATH:+:$PYTHONPATH}
fi
if [ -z "$python" ]; then
  venv=$(mktemp -d)
  trap 'rm -rf "$venv"' EXIT
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q --disable-pip-version-check "grpcio-tools==$GRPCIO_TOOLS_VERSION"
  python=$venv/bin/python
fi
have=$("$python" -c 'from importlib.metadata import version; print(version("grpcio-tools"))')
if [ "$have" != "$GRPCIO_TOOLS_VERSION" ]; then
  echo "gen_protos: grpcio-tools $have found, $GRPCIO_TOOLS_VERSION required" >&2
  exit 1
fi

mkdir -p "$out/router_sidecar/wire" "$out/router_sidecar/records"
# grpc_tools.protoc adds its bundled well-known types (google/protobuf/*.proto) to the include path.
"$python" -m grpc_tools.protoc -I proto --python_out="$out" --pyi_out="$out" \
  proto/router_sidecar/wire/*.proto proto/router_sidecar/records/*.proto
echo "gen_protos: wrote $(cd proto && ls router_sidecar/*/*.proto | sed 's/\.proto$/_pb2.py/' | tr '\n' ' ')into $out"
