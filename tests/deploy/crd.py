"""Custom resources validated against their CustomResourceDefinitions' OpenAPI schemas, which
kubernetes-validate does not ship. The CRDs are vendored as data in tests/deploy/crds/ (their README says
where from).

Strict as the API server with field validation Strict: an unknown field anywhere is an error (structural
schemas prune unknown fields; kubectl apply refuses them). The CEL rules (x-kubernetes-validations) are
evaluated by a small table of the rules these CRDs carry; a rule not in the table fails loudly, so a new CRD
version cannot pass unchecked.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema
import yaml

CRDS = Path(__file__).resolve().parent / "crds"

# CEL rule (as written in the CRD) -> its meaning over the value it is attached to.
CEL_RULES: dict[str, Callable[[Any], bool]] = {
    # InferencePool .spec.endpointPickerRef (kind defaults to Service)
    "self.kind != 'Service' || has(self.port)": lambda v: (
        v.get("kind", "Service") != "Service" or "port" in v
    ),
    # InferencePool .spec.targetPorts
    "self.all(p1, self.exists_one(p2, p1.number==p2.number))": lambda v: all(
        sum(1 for p2 in v if p2["number"] == p1["number"]) == 1 for p1 in v
    ),
}


def _strict(schema: Any) -> Any:
    """The schema with unknown fields refused and Kubernetes' extensions as JSON Schema."""
    if isinstance(schema, dict):
        schema = {k: _strict(v) for k, v in schema.items()}
        if schema.pop("x-kubernetes-int-or-string", False):
            schema.pop("type", None)
            schema["anyOf"] = [{"type": "integer"}, {"type": "string"}]
        if schema.pop("nullable", False) and "type" in schema:
            schema["type"] = [schema["type"], "null"]
        if (
            "properties" in schema
            and "additionalProperties" not in schema
            and not schema.get("x-kubernetes-preserve-unknown-fields")
        ):
            schema["additionalProperties"] = False
        return schema
    if isinstance(schema, list):
        return [_strict(v) for v in schema]
    return schema


@cache
def schemas() -> dict[tuple[str, str], tuple[dict[str, Any], dict[str, Any]]]:
    """(apiVersion, kind) -> (the strict JSON schema, the CRD's own schema), for every served version."""
    found = {}
    for path in sorted(CRDS.glob("*.yaml")):
        crd = yaml.safe_load(path.read_text())
        group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
        for version in crd["spec"]["versions"]:
            if version.get("served"):
                raw = version["schema"]["openAPIV3Schema"]
                strict = _strict(copy.deepcopy(raw))
                # metadata is the API server's (ObjectMeta): a name, labels and annotations as strings.
                strict["properties"]["metadata"] = {
                    "type": "object",
                    "required": ["name"],
                    "properties": {
                        "name": {"type": "string", "minLength": 1},
                        "namespace": {"type": "string"},
                        "labels": {"type": "object", "additionalProperties": {"type": "string"}},
                        "annotations": {"type": "object", "additionalProperties": {"type": "string"}},
                    },
                    "additionalProperties": False,
                }
                found[(f"{group}/{version['name']}", kind)] = (strict, raw)
    return found


def _rules(schema: dict[str, Any], value: Any, path: str) -> Iterator[str]:
    """Errors of the CEL rules attached anywhere along `value`."""
    for rule in schema.get("x-kubernetes-validations", []):
        check = CEL_RULES.get(rule["rule"])
        if check is None:
            yield f"{path}: CEL rule not evaluated here (add it to tests/deploy/crd.py): {rule['rule']}"
        elif not check(value):
            yield f"{path}: {rule.get('message', rule['rule'])}"
    if isinstance(value, dict):
        for key, child in value.items():
            sub = schema.get("properties", {}).get(key)
            if sub is not None:
                yield from _rules(sub, child, f"{path}.{key}")
    elif isinstance(value, list) and "items" in schema:
        for i, child in enumerate(value):
            yield from _rules(schema["items"], child, f"{path}[{i}]")


def known(obj: dict[str, Any]) -> bool:
    return (obj.get("apiVersion"), obj.get("kind")) in schemas()


def validate(obj: dict[str, Any]) -> list[str]:
    """Every error of one custom resource against its CRD: schema (strict) and CEL rules."""
    strict, raw = schemas()[(obj["apiVersion"], obj["kind"])]
    validator = jsonschema.Draft7Validator(strict)
    errors = [
        f"{'/'.join(str(p) for p in e.absolute_path) or '(root)'}: {e.message}"
        for e in validator.iter_errors(obj)
    ]
    errors += list(_rules(raw, obj, obj["kind"]))
    return errors
