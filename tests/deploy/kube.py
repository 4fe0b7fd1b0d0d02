"""Helpers of the deploy tier: rendering deploy/ with kubectl kustomize and walking the objects."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"

# Every directory a user may `kubectl apply -k`: the base alone, each overlay, the Gateway API Inference
# Extension example, the Envoy Gateway example.
KUSTOMIZATIONS = (
    "base",
    "overlays/etcd-statefulset",
    "overlays/etcd-external",
    "overlays/replica-front",
    "examples/inferencepool",
    "envoy-gateway",
)

Obj = dict[str, Any]


def kubectl() -> str | None:
    return shutil.which("kubectl")


def render(kustomization: str) -> list[Obj]:
    binary = kubectl()
    if binary is None:
        missing = "kubectl is not installed: the kustomize renders cannot be checked here"
        if os.environ.get("ROUTER_SIDECAR_REQUIRE_KUBECTL"):
            pytest.fail(f"{missing} (CI requires it: kubectl 1.27 or newer, for kustomize components)")
        pytest.skip(missing)
    result = subprocess.run(
        [binary, "kustomize", str(DEPLOY / kustomization)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, f"kubectl kustomize deploy/{kustomization} failed:\n{result.stderr}"
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def pod_template(workload: Obj) -> Obj:
    """A workload's Pod template (a CronJob's is in its Job template)."""
    spec = workload["spec"]["jobTemplate"]["spec"] if workload["kind"] == "CronJob" else workload["spec"]
    template: Obj = spec["template"]
    return template


def pod_specs(objects: list[Obj]) -> Iterator[tuple[Obj, Obj]]:
    """(workload, its Pod spec) for every workload in a render."""
    for obj in objects:
        if obj["kind"] in {"Deployment", "StatefulSet", "DaemonSet", "Job", "CronJob"}:
            yield obj, pod_template(obj)["spec"]


def containers(spec: Obj) -> Iterator[Obj]:
    yield from spec.get("initContainers", [])
    yield from spec.get("containers", [])


def find(objects: list[Obj], kind: str, name: str) -> Obj:
    matches = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(matches) == 1, f"expected one {kind} named {name}, got {len(matches)}"
    return matches[0]


def container(spec: Obj, name: str) -> Obj:
    found = [c for c in containers(spec) if c["name"] == name]
    assert len(found) == 1, f"expected one container {name!r}"
    return found[0]
