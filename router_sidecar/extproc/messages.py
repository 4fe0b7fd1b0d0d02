"""Small translators between ext_proc protobuf messages and plain Python values (no decisions here)."""

from __future__ import annotations

from collections.abc import Iterable

from google.protobuf.struct_pb2 import ListValue, Struct

from router_sidecar.wire import core_pb2
from router_sidecar.wire import ext_proc_pb2 as ep

ProcessingRequest = ep.ProcessingRequest
ProcessingResponse = ep.ProcessingResponse


def header_pairs(headers: ep.HttpHeaders) -> list[tuple[str, str]]:
    """Every header as (lower-cased name, value), duplicates kept (Envoy 1.40 sends `raw_value`)."""
    return [
        (h.key.lower(), h.raw_value.decode("latin-1") if h.raw_value else h.value)
        for h in headers.headers.headers
    ]


def header_map(headers: ep.HttpHeaders) -> dict[str, str]:
    """Lower-cased header names to values; of duplicates, the last one."""
    return dict(header_pairs(headers))


# Envoy's response flags (StreamInfo::CoreResponseFlag), bit i = the i-th name, as the `response.flags`
# attribute encodes them.
_RESPONSE_FLAGS = (
    "LH", "UH", "UT", "LR", "UR", "UF", "UC", "UO", "NR", "DI", "FI", "RL", "UAEX", "RLSE", "DC", "URX",
    "SI", "IH", "DPE", "UMSDR", "RFCF", "NFCF", "DT", "UPE", "NC", "OM", "DF", "DO", "DR", "UDO",
)  # fmt: skip


def response_flags(value: object) -> frozenset[str]:
    """The names of the flags set in a `response.flags` attribute value (a number)."""
    try:
        bits = int(value)  # type: ignore[call-overload]
    except (TypeError, ValueError):
        return frozenset()
    return frozenset(name for i, name in enumerate(_RESPONSE_FLAGS) if bits >> i & 1)


def attempt_count(value: object) -> int | None:
    """An `upstream.request_attempt_count` attribute (a number; 0 or absent: Envoy made no attempt or did not
    say)."""
    return int(value) if isinstance(value, int | float) and value >= 1 else None


def attributes(request: ProcessingRequest) -> dict[str, object]:
    """Flatten the attribute structs of a request (keyed by filter name) into one dict."""
    out: dict[str, object] = {}
    for struct in request.attributes.values():
        for key, value in struct.fields.items():
            kind = value.WhichOneof("kind")
            out[key] = getattr(value, kind) if kind else None
    return out


def header_mutation(
    set_headers: Iterable[tuple[str, str]] = (), remove: Iterable[str] = ()
) -> ep.HeaderMutation:
    return ep.HeaderMutation(
        set_headers=[
            core_pb2.HeaderValueOption(
                header=core_pb2.HeaderValue(key=k, raw_value=v.encode("latin-1")),
                append_action=core_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD,
            )
            for k, v in set_headers
        ],
        remove_headers=list(remove),
    )


def _common(mutation: ep.HeaderMutation | None) -> ep.CommonResponse:
    return ep.CommonResponse(header_mutation=mutation) if mutation is not None else ep.CommonResponse()


def request_headers_reply(
    mutation: ep.HeaderMutation | None = None, dynamic_metadata: Struct | None = None
) -> ProcessingResponse:
    reply = ProcessingResponse(request_headers=ep.HeadersResponse(response=_common(mutation)))
    return _with_metadata(reply, dynamic_metadata)


def request_body_reply(
    mutation: ep.HeaderMutation | None = None, dynamic_metadata: Struct | None = None
) -> ProcessingResponse:
    reply = ProcessingResponse(request_body=ep.BodyResponse(response=_common(mutation)))
    return _with_metadata(reply, dynamic_metadata)


def rewritten_body_reply(body: bytes) -> ProcessingResponse:
    """Reply to a BUFFERED request body: this body instead, its content-length to match (Envoy answers a
    mismatch with a local 500, verified on 1.40)."""
    mutation = header_mutation([("content-length", str(len(body)))])
    common = ep.CommonResponse(header_mutation=mutation, body_mutation=ep.BodyMutation(body=body))
    return ProcessingResponse(request_body=ep.BodyResponse(response=common))


def _with_metadata(reply: ProcessingResponse, dynamic_metadata: Struct | None) -> ProcessingResponse:
    if dynamic_metadata is not None:
        reply.dynamic_metadata.CopyFrom(dynamic_metadata)
    return reply


def response_headers_reply(mutation: ep.HeaderMutation | None = None) -> ProcessingResponse:
    return ProcessingResponse(response_headers=ep.HeadersResponse(response=_common(mutation)))


# The dynamic metadata namespace Envoy's load balancers read (the subset pin, override_host's list) and where
# an endpoint picker writes its choice.
LB_NAMESPACE = "envoy.lb"


def lb_metadata(values: dict[str, str]) -> Struct:
    metadata = Struct()
    metadata.update({LB_NAMESPACE: values})
    return metadata


def lb_value(request: ProcessingRequest, key: str) -> object:
    """A value of the request's `envoy.lb` metadata as Envoy forwarded it (None: absent)."""
    namespace = request.metadata_context.filter_metadata.get(LB_NAMESPACE)
    if namespace is None or key not in namespace.fields:
        return None
    value = namespace[key]
    return list(value) if isinstance(value, ListValue) else value


RESPONSE_BODY_CONTINUE = ProcessingResponse(response_body=ep.BodyResponse())
RESPONSE_TRAILERS_CONTINUE = ProcessingResponse(response_trailers=ep.TrailersResponse())


def streamed_body(data: bytes, end_of_stream: bool) -> bytes:
    """A FULL_DUPLEX_STREAMED reply: exactly these bytes go towards the client next.

    One per chunk, so it is encoded by hand, already in wire form (the server's serializer passes bytes
    through): ProcessingResponse.response_body(4) → BodyResponse.response(1) → CommonResponse.body_mutation(3)
    → BodyMutation.streamed_response(3) → StreamedBodyResponse{body(1), end_of_stream(2)}. Building the five
    nested messages cost ~15 µs a chunk; this costs ~1. tests/unit/test_wire_compat.py proves the bytes are
    the protobuf encoding of the same message.
    """
    streamed = (b"\x0a" + _varint(len(data)) + data if data else b"") + (
        b"\x10\x01" if end_of_stream else b""
    )
    mutation = b"\x1a" + _varint(len(streamed)) + streamed
    common = b"\x1a" + _varint(len(mutation)) + mutation
    body_response = b"\x0a" + _varint(len(common)) + common
    return b"\x22" + _varint(len(body_response)) + body_response


def _varint(value: int) -> bytes:
    if value < 0x80:
        return _SMALL_VARINTS[value]
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


_SMALL_VARINTS = tuple(bytes((n,)) for n in range(0x80))


Reply = ProcessingResponse | bytes  # bytes: a reply already in wire form (`streamed_body`)


def immediate(
    status: int,
    body: bytes,
    content_type: str = "application/json",
    extra_headers: Iterable[tuple[str, str]] = (),
) -> ProcessingResponse:
    return ProcessingResponse(
        immediate_response=ep.ImmediateResponse(
            status=core_pb2.HttpStatus(code=status),  # an open enum: any HTTP status number
            headers=header_mutation([("content-type", content_type), *extra_headers]),
            body=body,
            details="router_sidecar",
        )
    )
