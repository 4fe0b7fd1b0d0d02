"""docs/errors.md is the whole list of error codes: every code the product can emit is documented there, and
every code documented there is emitted somewhere. The emitted codes are collected from the source (AST):
the `Outcome` enum (a request's outcome is its error's code), the literal code of every error the product
builds (`_error`, `error_document`, `_reject`/`RequestRejected`, tool `Refuse`, the replica side's `_refusal`,
readiness `NotReady`, any `code=` argument or `"code":` key), and the JSON of Envoy's own replies in
envoy/gateway.yaml. The body fields documented there agree with the records' JSON Schemas."""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import yaml

from router_sidecar.core.events import Outcome
from router_sidecar.core.policy import Policy
from router_sidecar.runtime.envoy_config import Endpoint, EndpointPicker, GatewaySpec, render

REPO = Path(__file__).resolve().parents[2]
PRODUCT = REPO / "router_sidecar"
ERRORS_DOC = REPO / "docs" / "errors.md"
# The functions and classes that take an error code as their first string argument.
EMITTERS = frozenset(
    {"_error", "error_document", "_reject", "RequestRejected", "Refuse", "_refusal", "NotReady"}
)
CODE = re.compile(r"[a-z][a-z0-9]*(?:_[a-z0-9]+)+")
DOCUMENTED_ROW = re.compile(r"^\| `([a-z0-9_]+)` \| ", re.MULTILINE)


def _string(node: ast.expr, constants: dict[str, str]) -> str | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.Name):  # a module-level constant, e.g. readiness.NO_REPLICA_AVAILABLE
        return constants.get(node.id)
    return None


def codes_in_module(path: Path, root: Path = REPO) -> dict[str, list[str]]:
    """code -> where (`file:line`) for every error code a module builds literally."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    constants = {
        target.id: node.value.value
        for node in tree.body
        if isinstance(node, ast.Assign)
        and isinstance(node.value, ast.Constant)
        and isinstance(node.value.value, str)
        for target in node.targets
        if isinstance(target, ast.Name)
    }
    found: dict[str, list[str]] = {}

    def note(value: str | None, node: ast.AST) -> None:
        if value is not None and CODE.fullmatch(value):
            found.setdefault(value, []).append(f"{path.relative_to(root)}:{getattr(node, 'lineno', 0)}")

    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            name = (
                func.id
                if isinstance(func, ast.Name)
                else func.attr
                if isinstance(func, ast.Attribute)
                else ""
            )
            if name in EMITTERS:
                first = next((s for a in node.args if (s := _string(a, constants)) is not None), None)
                note(first, node)
            for keyword in node.keywords:
                if keyword.arg == "code":
                    note(_string(keyword.value, constants), node)
        elif isinstance(node, ast.Dict):
            for key, value in zip(node.keys, node.values, strict=True):
                if isinstance(key, ast.Constant) and key.value == "code":
                    note(_string(value, constants), node)
    return found


def envoy_reply_codes() -> set[str]:
    """The `error.code` of each JSON body Envoy's own local replies carry, in the config the gateway renders
    from envoy/gateway.yaml, alone and behind an endpoint picker (whose answers get mappers of their own)."""
    codes: set[str] = set()
    for picker in (None, EndpointPicker(Endpoint("127.0.0.1", 9002))):
        rendered = render(
            GatewaySpec(
                listen=Endpoint("127.0.0.1", 8080),
                replicas=(Endpoint("127.0.0.1", 9001),),
                sidecar_socket=Path("/run/s.sock"),
                access_log_path=Path("/dev/null"),
                policy=Policy(),
                admin_socket=Path("/run/a.sock"),
                endpoint_picker=picker,
            )
        )
        codes |= _json_format_codes(yaml.safe_load(rendered))
    return codes


def _json_format_codes(config: object) -> set[str]:
    codes: set[str] = set()

    def walk(node: object) -> None:
        if isinstance(node, dict):
            error = (
                node.get("json_format", {}).get("error")
                if isinstance(node.get("json_format"), dict)
                else None
            )
            if isinstance(error, dict) and isinstance(error.get("code"), str):
                codes.add(error["code"])
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(config)
    return codes


def emitted_codes() -> dict[str, list[str]]:
    found: dict[str, list[str]] = {o.value: ["router_sidecar/core/events.py: Outcome"] for o in Outcome}
    for module in sorted(PRODUCT.rglob("*.py")):
        if module.name.endswith("_pb2.py"):
            continue
        for code, where in codes_in_module(module).items():
            found.setdefault(code, []).extend(where)
    for code in envoy_reply_codes():
        found.setdefault(code, []).append("envoy/gateway.yaml: local_reply_config")
    return found


def documented_codes() -> set[str]:
    """The first column of every `| code | HTTP | when | what the client should do |` table."""
    tables = [block for block in ERRORS_DOC.read_text().split("\n\n") if block.startswith("| code | HTTP |")]
    assert len(tables) >= 8, "docs/errors.md lost its code tables"
    return {code for table in tables for code in DOCUMENTED_ROW.findall(table)}


def test_every_emitted_code_is_documented_and_every_documented_code_is_emitted() -> None:
    emitted, documented = emitted_codes(), documented_codes()
    missing = {code: where for code, where in emitted.items() if code not in documented}
    never_emitted = documented - set(emitted)
    assert missing == {}, "emitted but not in docs/errors.md"
    assert never_emitted == set(), "in docs/errors.md but never emitted"


def test_the_collection_sees_each_kind_of_emitter() -> None:
    """Guards the collector itself: one code of each way of building an error, from where it is built."""
    emitted = emitted_codes()
    expected = {
        "no_replica_available": "router_sidecar/extproc/downstream.py",  # _error at admission
        "idempotency_key_in_flight": "router_sidecar/extproc/downstream.py",  # error_document
        "json_too_deep": "router_sidecar/core/openai_api.py",  # _reject
        "idempotency_key_reused": "router_sidecar/core/tools.py",  # Refuse
        "idempotency_store_unavailable": "router_sidecar/extproc/tool_calls.py",  # Refuse
        "tool_call_in_progress": "router_sidecar/coordination/tool_ledger.py",  # Refuse
        "method_not_allowed": "router_sidecar/core/routes.py",  # code= keyword
        "upstream_decode_interrupted": "router_sidecar/core/sse.py",  # the terminal frame's code=
        "attempt_fenced": "router_sidecar/extproc/replica_side.py",  # _refusal
        "etcd_unreachable": "router_sidecar/coordination/readiness.py",  # NotReady(CONSTANT, ...)
        "upstream_error": "envoy/gateway.yaml",  # Envoy's local reply
        "endpoint_picker_unavailable": "envoy/gateway.yaml",  # ... and behind a picker
    }
    for code, where in expected.items():
        assert any(w.startswith(where) for w in emitted.get(code, [])), (code, emitted.get(code))
    assert "no_replica" not in emitted  # the code the README never documented is gone


def test_the_collector_reads_a_module(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text(
        "CODE = 'from_a_constant'\n"
        "_error(400, 'literal_code', 'message', None)\n"
        "NotReady(CODE, 'message')\n"
        "Route(status=405, code='keyword_code')\n"
        "body = {'error': {'code': 'dict_code'}}\n"
        "_error(status, code, 'not a literal: not collected', None)\n"
        "log.info('plain_words are not codes')\n"
    )
    assert codes_in_module(module, tmp_path) == {
        "literal_code": ["m.py:2"],
        "from_a_constant": ["m.py:3"],
        "keyword_code": ["m.py:4"],
        "dict_code": ["m.py:5"],
    }


def _documented_fields(title: str) -> list[str]:
    """The `field` column of the table under the paragraph that starts with `title` in docs/errors.md."""
    text = ERRORS_DOC.read_text()
    section = text[text.index(title) :]
    table = section[section.index("| field |") :].split("\n\n", 1)[0]
    return re.findall(r"^\| `([a-z_]+)` \|", table, re.MULTILINE)


def _schema_fields(name: str, definition: str) -> tuple[list[str], list[str]]:
    schema = json.loads((REPO / "docs" / "schema" / f"{name}.schema.json").read_text())
    body = schema["$defs"][definition]
    return list(body["properties"]), list(body["required"])


def test_the_documented_bodies_agree_with_the_schemas() -> None:
    properties, required = _schema_fields("gateway-error", "GatewayError")
    assert _documented_fields("**A request that delivered nothing**") == properties
    assert [f for f in properties if f not in required] == ["param"]  # only on a rejection that names one
    properties, required = _schema_fields("terminal-frame", "TerminalError")
    assert _documented_fields("**The terminal frame**") == properties == required
