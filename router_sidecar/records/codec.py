"""The JSON and header mapping of our records (the rules are in proto/router_sidecar/records/options.proto).

proto3's own JSON printer would rename nothing here but would write 64-bit integers as strings and leave out
every field without a value; today's readers of the journal expect numbers and explicit nulls. So writing is
ours (a walk over the descriptor, planned once per message type), and reading is the protobuf runtime's
parser, told to ignore fields it does not know (what a newer writer added).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from google.protobuf import json_format
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message

from router_sidecar.records import options_pb2

M = TypeVar("M", bound=Message)

# Well-known types whose JSON is not an object of their fields (ListValue is a bare list, Struct an object).
_WELL_KNOWN = frozenset({"google.protobuf.ListValue", "google.protobuf.Struct", "google.protobuf.Value"})

# One field's part of the plan: (name, how to read it from a message, whether to leave it out when unset).
_Step = tuple[str, Callable[[Message], Any], bool]
_plans: dict[str, list[_Step]] = {}


class RecordError(ValueError):
    """A record that does not parse as its message (not JSON, or a field of the wrong type)."""


def to_dict(message: Message) -> dict[str, Any]:
    """The record as a JSON-ready dict, fields in declaration order."""
    descriptor = message.DESCRIPTOR
    if descriptor.GetOptions().Extensions[options_pb2.sparse]:
        return {field.name: _value(field, value) for field, value in message.ListFields()}
    out: dict[str, Any] = {}
    for name, read, omit_unset in _plan(descriptor):
        value = read(message)
        if value is None and omit_unset:
            continue
        out[name] = value
    return out


def dumps(message: Message, *, sort_keys: bool = False) -> bytes:
    """Compact JSON (no spaces), as stored in etcd."""
    return json.dumps(to_dict(message), separators=(",", ":"), sort_keys=sort_keys).encode()


def from_dict(cls: type[M], data: Mapping[str, Any]) -> M:
    """Parse a JSON object into `cls`; unknown fields are ignored, nulls are unset fields."""
    try:
        return json_format.ParseDict(data, cls(), ignore_unknown_fields=True)
    except json_format.ParseError as exc:
        raise RecordError(f"not a valid {cls.DESCRIPTOR.name}: {exc}") from exc


def loads(cls: type[M], raw: bytes | str) -> M:
    try:
        data = json.loads(raw)
    except ValueError as exc:
        raise RecordError(f"not a valid {cls.DESCRIPTOR.name}: not JSON ({exc})") from exc
    if not isinstance(data, dict):
        raise RecordError(f"not a valid {cls.DESCRIPTOR.name}: not a JSON object")
    return from_dict(cls, data)


def header_names(cls: type[Message]) -> tuple[str, ...]:
    """The HTTP headers the fields of `cls` travel in."""
    return tuple(_header(field) for field in cls.DESCRIPTOR.fields)


def to_headers(message: Message) -> list[tuple[str, str]]:
    """The message as headers, in declaration order: every field, but an `optional` one only when set."""
    return [
        (_header(field), str(getattr(message, field.name)))
        for field in message.DESCRIPTOR.fields
        if not field.has_presence or message.HasField(field.name)
    ]


def from_headers(cls: type[M], headers: Mapping[str, str]) -> M:
    """The message from a request's headers (lower-case names); absent headers are unset fields."""
    message = cls()
    for field in cls.DESCRIPTOR.fields:
        value = headers.get(_header(field))
        if value is not None:
            setattr(message, field.name, value.strip())
    return message


def _header(field: FieldDescriptor) -> str:
    name = field.GetOptions().Extensions[options_pb2.header]
    if not name:
        raise TypeError(f"{field.full_name} names no header")
    return name


def _plan(descriptor: Descriptor) -> list[_Step]:
    plan = _plans.get(descriptor.full_name)
    if plan is None:
        plan = _plans[descriptor.full_name] = [_step(field) for field in descriptor.fields]
    return plan


def _step(field: FieldDescriptor) -> _Step:
    name = field.name
    omit_unset = field.GetOptions().Extensions[options_pb2.omit_unset]
    if field.is_repeated:
        if field.message_type is not None:

            def read(message: Message) -> Any:
                values = getattr(message, name)
                return [_message_value(v) for v in values] if values or not omit_unset else None

        else:

            def read(message: Message) -> Any:
                values = getattr(message, name)
                return list(values) if values or not omit_unset else None

    elif field.message_type is not None:

        def read(message: Message) -> Any:
            return _message_value(getattr(message, name)) if message.HasField(name) else None

    elif field.has_presence:

        def read(message: Message) -> Any:
            return getattr(message, name) if message.HasField(name) else None

    else:

        def read(message: Message) -> Any:
            return getattr(message, name)

    return name, read, omit_unset


def _value(field: FieldDescriptor, value: Any) -> Any:
    if field.message_type is None:
        return list(value) if field.is_repeated else value
    if field.is_repeated:
        return [_message_value(v) for v in value]
    return _message_value(value)


def _message_value(message: Message) -> Any:
    if message.DESCRIPTOR.full_name in _WELL_KNOWN:
        return json_format.MessageToDict(message)
    return to_dict(message)
