"""The ext_proc fields an endpoint picker needs that the product's wire messages do not declare.

`router_sidecar.wire` mirrors only what the gateway's sidecar uses of Envoy's ext_proc API. The picker also
needs three more fields of Envoy's messages, with Envoy's numbers:

* ``ProcessingRequest.metadata_context`` (8, ``envoy.config.core.v3.Metadata``): the dynamic metadata Envoy
  forwards (``metadata_options.forwarding_namespaces``): the served endpoint at the response headers, the
  data plane's subset hint at the request headers;
* ``ProcessingRequest.protocol_config`` (11, ``ProtocolConfiguration``): on the first message of a stream, the
  filter's request and response body modes;
* ``CommonResponse.clear_route_cache`` (5, bool): the protocol's route-cache clear.

A field a message does not declare is kept as an unknown field on parse and written back on serialize, so
the product's messages carry them: read with :class:`google.protobuf.unknown_fields.UnknownFieldSet` (or as
the declared field, once the product's message declares one), written by merging the field's encoded bytes
(which sets it either way). tests/unit/test_epp.py checks both against Envoy's own messages.

The gRPC health service the protocol asks of a picker (``grpc.health.v1.Health/Check``) has two one-field
messages; they are encoded here by hand too.
"""

from __future__ import annotations

from dataclasses import dataclass

from google.protobuf.message import Message
from google.protobuf.struct_pb2 import Struct, Value
from google.protobuf.unknown_fields import UnknownFieldSet

from router_sidecar.wire import core_pb2
from router_sidecar.wire import ext_proc_pb2 as ep

METADATA_CONTEXT = 8  # ProcessingRequest.metadata_context
PROTOCOL_CONFIG = 11  # ProcessingRequest.protocol_config
CLEAR_ROUTE_CACHE = b"\x28\x01"  # CommonResponse field 5 (varint) = true

# envoy.extensions.filters.http.ext_proc.v3.ProcessingMode.BodySendMode
BODY_MODES = {0: "NONE", 1: "STREAMED", 2: "BUFFERED", 3: "BUFFERED_PARTIAL", 4: "FULL_DUPLEX_STREAMED"}
FULL_DUPLEX_STREAMED = 4

HEALTH_SERVICE = "grpc.health.v1.Health"
SERVING, NOT_SERVING, SERVICE_UNKNOWN = 1, 2, 3


@dataclass(frozen=True)
class ProtocolConfig:
    """What the first message of a stream says about the filter (Envoy's ProtocolConfiguration)."""

    request_body_mode: int = 0
    response_body_mode: int = 0
    send_body_without_waiting_for_header_response: bool = False

    @property
    def request_full_duplex(self) -> bool:
        return self.request_body_mode == FULL_DUPLEX_STREAMED

    @property
    def response_full_duplex(self) -> bool:
        return self.response_body_mode == FULL_DUPLEX_STREAMED

    def describe(self) -> dict[str, str]:
        return {
            "request_body_mode": BODY_MODES.get(self.request_body_mode, str(self.request_body_mode)),
            "response_body_mode": BODY_MODES.get(self.response_body_mode, str(self.response_body_mode)),
        }


def _field_bytes(message: Message, name: str, number: int) -> bytes | None:
    """The encoded value of message field `name` (number `number`): read as a declared field if the product's
    message has come to declare it, else from the fields it kept unknown (the last occurrence)."""
    if name in message.DESCRIPTOR.fields_by_name:
        return getattr(message, name).SerializeToString() if message.HasField(name) else None
    found = None
    for field in UnknownFieldSet(message):
        if field.field_number == number and isinstance(field.data, bytes):
            found = field.data
    return found


def protocol_config(request: ep.ProcessingRequest) -> ProtocolConfig | None:
    """The request's `protocol_config`, or None when it has none (every message after the first)."""
    data = _field_bytes(request, "protocol_config", PROTOCOL_CONFIG)
    if data is None:
        return None
    values = _varints(data)
    return ProtocolConfig(values.get(1, 0), values.get(2, 0), bool(values.get(3, 0)))


def metadata_context(request: ep.ProcessingRequest) -> dict[str, Struct]:
    """The request's forwarded dynamic metadata: namespace → its (untyped) Struct."""
    data = _field_bytes(request, "metadata_context", METADATA_CONTEXT)
    if data is None:
        return {}
    metadata = core_pb2.Metadata.FromString(data)
    return {name: metadata.filter_metadata[name] for name in metadata.filter_metadata}


def clear_route_cache(response: ep.CommonResponse) -> ep.CommonResponse:
    """`response` with `clear_route_cache: true` (modified in place, and returned)."""
    response.MergeFromString(CLEAR_ROUTE_CACHE)
    return response


def plain(value: Value) -> object:
    """A google.protobuf.Value as plain Python (strings, numbers, bools, None, lists, dicts)."""
    kind = value.WhichOneof("kind")
    if kind == "list_value":
        return [plain(v) for v in value.list_value.values]
    if kind == "struct_value":
        return {k: plain(v) for k, v in value.struct_value.fields.items()}
    if kind == "null_value" or kind is None:
        return None
    return getattr(value, kind)


def plain_struct(struct: Struct) -> dict[str, object]:
    return {key: plain(value) for key, value in struct.fields.items()}


def health_request_service(data: bytes) -> str:
    """The `service` of a grpc.health.v1.HealthCheckRequest (field 1, a string)."""
    out = ""
    pos = 0
    while pos < len(data):
        key, pos = _varint(data, pos)
        number, wire_type = key >> 3, key & 7
        if wire_type == 2:
            length, pos = _varint(data, pos)
            if number == 1:
                out = data[pos : pos + length].decode("utf-8", "replace")
            pos += length
        elif wire_type == 0:
            _, pos = _varint(data, pos)
        else:
            raise ValueError(f"unexpected wire type {wire_type} in a HealthCheckRequest")
    return out


def health_response(status: int) -> bytes:
    """A grpc.health.v1.HealthCheckResponse: field 1, the ServingStatus enum."""
    return b"\x08" + bytes((status,))


def _varints(data: bytes) -> dict[int, int]:
    """The varint fields of a small message (others skipped): number → value."""
    out: dict[int, int] = {}
    pos = 0
    while pos < len(data):
        key, pos = _varint(data, pos)
        number, wire_type = key >> 3, key & 7
        if wire_type == 0:
            out[number], pos = _varint(data, pos)
        elif wire_type == 2:
            length, pos = _varint(data, pos)
            pos += length
        elif wire_type == 1:
            pos += 8
        elif wire_type == 5:
            pos += 4
        else:
            raise ValueError(f"unexpected wire type {wire_type}")
    return out


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(data):
            raise ValueError("truncated varint")
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7
