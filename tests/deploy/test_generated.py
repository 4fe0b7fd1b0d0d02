"""One source of truth: the kustomize manifests of deploy/ are generated from the Helm chart
(tests/deploy/generate.py). A generated file that differs from what the generator writes fails here, as does a
manifest that is neither generated nor one of the few hand-written kustomize files, and every overlay must
render the same objects as the chart with its values file."""

from __future__ import annotations

import copy
import json
import re
from typing import Any

import pytest
import yaml

from tests.deploy import generate
from tests.deploy.chart import documents, template
from tests.deploy.kube import DEPLOY, REPO, Obj, pod_specs, pod_template

# Written by hand, read by kustomize beside the generated manifests.
HAND_WRITTEN = {
    "base/kustomization.yaml",
    "base/namespace.yaml",
    "base/policy.yaml",  # policy.example.yaml (test_manifests.py)
    "base/fingerprint.yaml",  # fingerprint.example.yaml
    "components/etcd-external/kustomization.yaml",
    "components/etcd-statefulset/kustomization.yaml",
    "components/replica-front/kustomization.yaml",
    "overlays/etcd-external/kustomization.yaml",
    "overlays/etcd-statefulset/kustomization.yaml",
    "overlays/replica-front/kustomization.yaml",
    "examples/inferencepool/kustomization.yaml",
}
MANIFEST_DIRS = ("base", "components", "overlays", "examples")

# Each overlay and the values file that must render the same objects.
EQUIVALENT = [
    ("overlays/etcd-statefulset", "values-etcd-statefulset.yaml"),
    ("overlays/etcd-external", "values-external-etcd.yaml"),
    ("overlays/replica-front", "values-replica-front.yaml"),
    ("examples/inferencepool", "values-inferencepool.yaml"),
]
HELM_ONLY_LABELS = ("helm.sh/chart", "app.kubernetes.io/managed-by")
# kustomize's content hash suffix (its alphabet has no vowels, no 0, 1, 3).
HASHED = re.compile(r"^(?P<name>.+)-[2456789bcdfghkmt]{10}$")


def test_generated_files_are_current() -> None:
    stale = [
        str(path.relative_to(REPO))
        for path, content in generate.outputs().items()
        if not path.exists() or path.read_text() != content
    ]
    assert not stale, f"generated from the chart, but differ: {stale}: run `{generate.REGENERATE}`"


def test_every_manifest_is_generated_or_hand_written_on_purpose() -> None:
    generated = {str(p.relative_to(DEPLOY)) for p in generate.outputs()}
    on_disk = {
        str(p.relative_to(DEPLOY))
        for d in MANIFEST_DIRS
        for p in (DEPLOY / d).rglob("*")
        if p.is_file() and p.suffix in {".yaml", ".yml", ".json"}
    }
    assert on_disk - generated - HAND_WRITTEN == set(), "a manifest that is neither generated nor listed"
    assert on_disk >= HAND_WRITTEN | generated


def test_generated_files_say_so() -> None:
    for path in generate.outputs():
        assert path.read_text().startswith("# "), path
        assert generate.REGENERATE in path.read_text().split("\n", 2)[0] + path.read_text().split("\n", 2)[1]


def test_json_patch() -> None:
    old = {"a": 1, "b": {"c": [1, 2], "d": [{"x": 1}, {"x": 2}]}, "gone": True, "k/~": 0}
    new = {"a": 1, "b": {"c": [1, 3], "d": [{"x": 1}, {"x": 5}]}, "new": [1], "k/~": 1}
    ops = generate.json_patch(old, new)
    assert ops == [
        {"op": "replace", "path": "/b/c", "value": [1, 3]},  # a list of scalars is replaced whole
        {"op": "replace", "path": "/b/d/1/x", "value": 5},
        {"op": "remove", "path": "/gone"},
        {"op": "replace", "path": "/k~1~0", "value": 1},
        {"op": "add", "path": "/new", "value": [1]},
    ]


def _strip(obj: Obj) -> Obj:
    """Without the labels and annotations only Helm-managed objects carry."""
    obj = copy.deepcopy(obj)
    metas = [obj["metadata"]]
    if obj["kind"] in {"Deployment", "StatefulSet", "DaemonSet", "Job"}:
        metas.append(pod_template(obj)["metadata"])
    if obj["kind"] == "CronJob":
        metas += [obj["spec"]["jobTemplate"]["metadata"], pod_template(obj)["metadata"]]
    for meta in metas:
        for label in HELM_ONLY_LABELS:
            meta.get("labels", {}).pop(label, None)
        annotations = meta.get("annotations", {})
        for key in [k for k in annotations if k.startswith("checksum/")]:
            del annotations[key]
    return obj


def _rename(value: Any, names: dict[str, str]) -> Any:
    if isinstance(value, dict):
        return {k: _rename(v, names) for k, v in value.items()}
    if isinstance(value, list):
        return [_rename(v, names) for v in value]
    return names.get(value, value) if isinstance(value, str) else value


def normalized(objects: list[Obj]) -> tuple[dict[tuple[str, str], Obj], dict[str, Any]]:
    """(the objects by kind and name, ConfigMaps' data parsed as YAML by their unhashed name): the
    Namespace (kustomize's, not the chart's) left out, kustomize's content hashes taken off ConfigMap names
    and references, Helm's own labels and checksums removed."""
    names: dict[str, str] = {}
    config: dict[str, Any] = {}
    for obj in objects:
        if obj["kind"] == "ConfigMap":
            name = obj["metadata"]["name"]
            match = HASHED.match(name)
            plain = match.group("name") if match else name
            names[name] = plain
            config[plain] = {k: yaml.safe_load(v) for k, v in obj["data"].items()}
    result = {
        (o["kind"], o["metadata"]["name"]): _rename(_strip(o), names)
        for o in objects
        if o["kind"] not in {"ConfigMap", "Namespace"}
    }
    return result, config


@pytest.mark.parametrize(("kustomization", "values"), EQUIVALENT)
def test_overlay_renders_what_the_chart_renders(
    rendered: dict[str, list[Obj]], kustomization: str, values: str
) -> None:
    ours, our_config = normalized(rendered[kustomization])
    chart, chart_config = normalized(rendered[f"helm/{values}"])
    assert set(ours) == set(chart)
    for key in ours:
        ops = generate.json_patch(chart[key], ours[key])
        assert not ops, f"{key}: the overlay differs from the chart by {json.dumps(ops)[:2000]}"
    assert our_config == chart_config
    # The comparison saw the Pods: the same images, the same command lines.
    assert [w["metadata"]["name"] for w, _ in pod_specs(list(ours.values()))]


def test_front_patches_are_the_whole_difference() -> None:
    """Applied to the base render, the replica-front patches give the chart's render with the front (both
    without Helm's labels): nothing the front changes is left out of them."""
    base = generate._objects(documents(template(generate.KUSTOMIZE_VALUES).stdout))
    front = generate._objects(documents(template(generate.KUSTOMIZE_VALUES, sets=generate.FRONT).stdout))
    for out, key in generate.FRONT_PATCHES.items():
        ops = yaml.safe_load((DEPLOY / out).read_text())
        assert _apply(base[key], ops) == front[key], out
    assert {k for k in base if base[k] != front[k]} == set(generate.FRONT_PATCHES.values())


def _apply(obj: Obj, ops: list[dict[str, Any]]) -> Obj:
    """RFC 6902 add/remove/replace, enough for the generated patches."""
    obj = copy.deepcopy(obj)
    for op in ops:
        *parents, last = [p.replace("~1", "/").replace("~0", "~") for p in op["path"].split("/")[1:]]
        node: Any = obj
        for part in parents:
            node = node[int(part)] if isinstance(node, list) else node[part]
        key: Any = int(last) if isinstance(node, list) and last != "-" else last
        if op["op"] == "remove":
            del node[key]
        elif op["op"] == "add" and isinstance(node, list):
            node.insert(len(node) if key == "-" else key, op["value"])
        else:
            node[key] = op["value"]
    return obj
