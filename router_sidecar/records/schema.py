"""JSON Schema (draft 2020-12) of our records, derived from their messages and the JSON mapping of codec.py.

`python -m router_sidecar.records.schema DIR` writes one schema per record into DIR (docs/schema/ holds the
committed ones; tests/unit/test_records.py checks that they are current and that real records validate).
Every object allows properties it does not list: a later version may add fields, and readers ignore them.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message

from router_sidecar.records import options_pb2
from router_sidecar.records import records_pb2 as rec

DIALECT = "https://json-schema.org/draft/2020-12/schema"
ID_PREFIX = "urn:router-sidecar:records:v1:"

# The records others read, by the file their schema goes to.
ROOTS: dict[str, type[Message]] = {
    "journal-record": rec.JournalRecord,
    "gateway-error": rec.GatewayErrorBody,
    "terminal-frame": rec.TerminalFrame,
    "responses-failed-event": rec.ResponsesFailedEvent,
    "messages-error": rec.MessagesErrorBody,
    "replica-registration": rec.ReplicaRegistration,
    "cancel-ack": rec.CancelAck,
    "attempt-progress": rec.AttemptProgress,
}

_SCALARS: dict[int, dict[str, Any]] = {
    FieldDescriptor.TYPE_STRING: {"type": "string"},
    FieldDescriptor.TYPE_BOOL: {"type": "boolean"},
    FieldDescriptor.TYPE_DOUBLE: {"type": "number"},
    FieldDescriptor.TYPE_INT32: {"type": "integer", "minimum": -(2**31), "maximum": 2**31 - 1},
    FieldDescriptor.TYPE_INT64: {"type": "integer", "minimum": -(2**63), "maximum": 2**63 - 1},
    FieldDescriptor.TYPE_UINT32: {"type": "integer", "minimum": 0, "maximum": 2**32 - 1},
    FieldDescriptor.TYPE_UINT64: {"type": "integer", "minimum": 0, "maximum": 2**64 - 1},
}
_WELL_KNOWN: dict[str, dict[str, Any]] = {
    "google.protobuf.ListValue": {"type": "array"},
    "google.protobuf.Struct": {"type": "object"},
    "google.protobuf.Value": {},
}


def json_schema(root: type[Message], name: str) -> dict[str, Any]:
    defs: dict[str, Any] = {}
    _define(root.DESCRIPTOR, defs)
    return {
        "$schema": DIALECT,
        "$id": f"{ID_PREFIX}{name}",
        "title": root.DESCRIPTOR.full_name,
        "$ref": f"#/$defs/{root.DESCRIPTOR.name}",
        "$defs": dict(sorted(defs.items())),
    }


def write(directory: Path) -> list[Path]:
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for name, root in ROOTS.items():
        path = directory / f"{name}.schema.json"
        path.write_text(render(root, name))
        written.append(path)
    return written


def render(root: type[Message], name: str) -> str:
    return json.dumps(json_schema(root, name), indent=2) + "\n"


def _define(descriptor: Descriptor, defs: dict[str, Any]) -> None:
    if descriptor.name in defs or descriptor.full_name in _WELL_KNOWN:
        return
    defs[descriptor.name] = {}  # placeholder: a message may refer to itself
    sparse = descriptor.GetOptions().Extensions[options_pb2.sparse]
    properties: dict[str, Any] = {}
    required: list[str] = []
    for field in descriptor.fields:
        if field.message_type is not None:
            _define(field.message_type, defs)
        omitted = sparse or field.GetOptions().Extensions[options_pb2.omit_unset]
        nullable = not omitted and field.has_presence  # written as null when unset
        properties[field.name] = _field_schema(field, nullable)
        if not omitted:
            required.append(field.name)
    schema: dict[str, Any] = {"type": "object", "properties": properties}
    if required:
        schema["required"] = required
    defs[descriptor.name] = schema


def _field_schema(field: FieldDescriptor, nullable: bool) -> dict[str, Any]:
    if field.message_type is not None:
        wkt = _WELL_KNOWN.get(field.message_type.full_name)
        value = dict(wkt) if wkt is not None else {"$ref": f"#/$defs/{field.message_type.name}"}
    else:
        value = dict(_SCALARS[field.type])
    if field.is_repeated:
        return {"type": "array", "items": value}
    if nullable:
        return {"anyOf": [value, {"type": "null"}]}
    return value


if __name__ == "__main__":
    for path in write(Path(sys.argv[1] if len(sys.argv) > 1 else "docs/schema")):
        print(path)
