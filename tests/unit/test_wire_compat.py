"""Our wire messages (router_sidecar.wire) against Envoy's own v3 API (xds-protos, aside in .tools/xds).

The sidecar ships its own reduced copies of Envoy's messages so that it installs without xds-protos. They
are only correct if every field they declare has Envoy's number, type, cardinality, map-ness and oneof,
recursively, and if bytes built by one side parse into the same values on the other. xds-protos is
loaded here for comparison only (scripts/setup.sh puts it on the path with a .pth file); without it the
comparison tests skip.
"""

from __future__ import annotations

import asyncio
import importlib
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import grpc
import pytest
from google.protobuf import any_pb2, struct_pb2, wrappers_pb2
from google.protobuf.descriptor import Descriptor, EnumDescriptor, FieldDescriptor, FileDescriptor
from google.protobuf.message import Message

from router_sidecar.core.request import DownstreamLoss
from router_sidecar.extproc import messages as m
from router_sidecar.extproc.access_log import AccessLogServicer
from router_sidecar.extproc.discovery import CLA_TYPE, EndpointDiscovery, load_assignment
from router_sidecar.wire import access_log_pb2, core_pb2, discovery_pb2, ext_proc_pb2, services

REPO = Path(__file__).resolve().parents[2]
WIRE_MODULES = (core_pb2, ext_proc_pb2, access_log_pb2, discovery_pb2)
OUR_FILES: tuple[FileDescriptor, ...] = tuple(mod.DESCRIPTOR for mod in WIRE_MODULES)
OUR_PACKAGE = "router_sidecar.wire.v1"
# Where proto/router_sidecar/<package>/*.proto are generated to (router_sidecar/<package>/).
GENERATED_PACKAGES = ("wire", "records")

# The messages the sidecar exchanges with Envoy, and Envoy's name for each; everything else is reached
# from these through field types.
ROOTS = {
    ext_proc_pb2.ProcessingRequest: "envoy.service.ext_proc.v3.ProcessingRequest",
    ext_proc_pb2.ProcessingResponse: "envoy.service.ext_proc.v3.ProcessingResponse",
    access_log_pb2.StreamAccessLogsMessage: "envoy.service.accesslog.v3.StreamAccessLogsMessage",
    access_log_pb2.StreamAccessLogsResponse: "envoy.service.accesslog.v3.StreamAccessLogsResponse",
    discovery_pb2.DiscoveryRequest: "envoy.service.discovery.v3.DiscoveryRequest",
    discovery_pb2.DiscoveryResponse: "envoy.service.discovery.v3.DiscoveryResponse",
    discovery_pb2.ClusterLoadAssignment: "envoy.config.endpoint.v3.ClusterLoadAssignment",
}

ENVOY_MODULES = (
    "envoy.service.ext_proc.v3.external_processor_pb2",
    "envoy.service.ext_proc.v3.external_processor_pb2_grpc",
    "envoy.service.accesslog.v3.als_pb2",
    "envoy.service.accesslog.v3.als_pb2_grpc",
    "envoy.service.discovery.v3.discovery_pb2",
    "envoy.service.endpoint.v3.eds_pb2",
    "envoy.service.endpoint.v3.eds_pb2_grpc",
    "envoy.config.endpoint.v3.endpoint_pb2",
)


@pytest.fixture(scope="module")
def envoy() -> dict[str, ModuleType]:
    try:
        return {name.rsplit(".", 1)[1]: importlib.import_module(name) for name in ENVOY_MODULES}
    except ImportError as exc:
        pytest.skip(f"Envoy's API modules (xds-protos) are not importable ({exc}); run scripts/setup.sh")


def envoy_class(name: str) -> type[Message]:
    from google.protobuf import descriptor_pool, message_factory

    return message_factory.GetMessageClass(descriptor_pool.Default().FindMessageTypeByName(name))


def our_messages(file: FileDescriptor) -> Iterator[Descriptor]:
    """Every message type we declare, nested ones included (map entries are part of their field)."""
    for desc in file.message_types_by_name.values():
        yield from _with_nested(desc)


def _with_nested(desc: Descriptor) -> Iterator[Descriptor]:
    if desc.GetOptions().map_entry:
        return
    yield desc
    for nested in desc.nested_types:
        yield from _with_nested(nested)


def our_enums() -> Iterator[EnumDescriptor]:
    for file in OUR_FILES:
        yield from file.enum_types_by_name.values()
        for desc in our_messages(file):
            yield from desc.enum_types


# --- structure ------------------------------------------------------------------------------------------


def _is_map(field: FieldDescriptor) -> bool:
    return field.message_type is not None and field.message_type.GetOptions().map_entry


def _oneof(field: FieldDescriptor) -> str | None:
    oneof = field.containing_oneof
    if oneof is None or getattr(oneof, "is_synthetic", False):
        return None
    return oneof.name


def compare_message(ours: Descriptor, theirs: Descriptor, pairs: dict[str, str], problems: list[str]) -> None:
    """Check `ours` field by field against Envoy's `theirs`, recursively; record each pair seen."""
    if ours.full_name in pairs:
        if pairs[ours.full_name] != theirs.full_name:
            problems.append(
                f"{ours.full_name} stands for both {pairs[ours.full_name]} and {theirs.full_name}"
            )
        return
    pairs[ours.full_name] = theirs.full_name
    for field in ours.fields:
        where = f"{ours.full_name}.{field.name} (= {theirs.full_name} #{field.number})"
        other = theirs.fields_by_number.get(field.number)
        if other is None:
            problems.append(f"{where}: Envoy has no field {field.number}")
            continue
        if other.name != field.name:
            problems.append(f"{where}: Envoy calls it {other.name}")
        if other.type != field.type:
            problems.append(f"{where}: type {field.type} vs Envoy's {other.type}")
        if other.is_repeated != field.is_repeated:
            problems.append(f"{where}: repeated {field.is_repeated} vs Envoy's {other.is_repeated}")
        if _is_map(other) != _is_map(field):
            problems.append(f"{where}: map {_is_map(field)} vs Envoy's {_is_map(other)}")
        if _oneof(other) != _oneof(field):
            problems.append(f"{where}: oneof {_oneof(field)} vs Envoy's {_oneof(other)}")
        if other.has_presence != field.has_presence:
            problems.append(f"{where}: presence {field.has_presence} vs Envoy's {other.has_presence}")
        scalar = field.type not in (field.TYPE_MESSAGE, field.TYPE_STRING, field.TYPE_BYTES)
        if field.is_repeated and scalar and field.is_packed != other.is_packed:
            problems.append(f"{where}: packed {field.is_packed} vs Envoy's {other.is_packed}")
        if field.message_type is not None and other.message_type is not None:
            ours_type, their_type = field.message_type, other.message_type
            if ours_type.full_name.startswith(OUR_PACKAGE + "."):
                compare_message(ours_type, their_type, pairs, problems)
            elif ours_type.full_name != their_type.full_name:  # a well-known type: must be the same one
                problems.append(f"{where}: {ours_type.full_name} vs Envoy's {their_type.full_name}")
        if field.enum_type is not None and other.enum_type is not None:
            compare_enum(field.enum_type, other.enum_type, pairs, problems)


def compare_enum(
    ours: EnumDescriptor, theirs: EnumDescriptor, pairs: dict[str, str], problems: list[str]
) -> None:
    pairs[ours.full_name] = theirs.full_name
    if ours.is_closed or theirs.is_closed:
        problems.append(f"{ours.full_name}: enums must be open on both sides (unknown numbers kept)")
    their_numbers = {v.number for v in theirs.values}
    for value in ours.values:
        if value.number not in their_numbers:
            problems.append(
                f"{ours.full_name}.{value.name} = {value.number}: not a value of {theirs.full_name}"
            )
        elif value.number and theirs.values_by_number[value.number].name != value.name:
            problems.append(f"{ours.full_name}.{value.name}: Envoy names {value.number} differently")


def test_every_field_matches_envoy(envoy: dict[str, ModuleType]) -> None:
    from google.protobuf import descriptor_pool

    pool = descriptor_pool.Default()
    pairs: dict[str, str] = {}
    problems: list[str] = []
    for cls, envoy_name in ROOTS.items():
        compare_message(cls.DESCRIPTOR, pool.FindMessageTypeByName(envoy_name), pairs, problems)
    assert problems == []
    # Nothing we declare escapes the comparison (a message reached from no root would be unchecked).
    declared = {d.full_name for f in OUR_FILES for d in our_messages(f)} | {e.full_name for e in our_enums()}
    assert declared - set(pairs) == set()
    # Envoy's names for what they mirror, where the name is ours to choose but the shape is theirs.
    assert pairs[f"{OUR_PACKAGE}.RpcStatus"] == "google.rpc.Status"
    assert pairs[f"{OUR_PACKAGE}.HttpStatusCode"] == "envoy.type.v3.StatusCode"


def test_processing_request_names_every_event(envoy: dict[str, ModuleType]) -> None:
    # WhichOneof("request") must never answer None for an event Envoy sends: all members are declared.
    theirs = envoy["external_processor_pb2"].ProcessingRequest.DESCRIPTOR.oneofs_by_name["request"]
    ours = ext_proc_pb2.ProcessingRequest.DESCRIPTOR.oneofs_by_name["request"]
    assert {f.number for f in ours.fields} == {f.number for f in theirs.fields}


def test_our_package_and_names_never_clash() -> None:
    for file in OUR_FILES:
        assert file.package == OUR_PACKAGE
        assert not file.name.startswith(("envoy/", "google/"))


# --- bytes in both directions ---------------------------------------------------------------------------

STRUCT_SAMPLE = {"fingerprint": "abc123", "n": 1.5, "flag": True, "nested": {"list": ["x", 2.0]}}


def _scalar(field: FieldDescriptor, choice: int) -> Any:
    t = field.type
    if t == field.TYPE_STRING:
        return f"{field.name}-{choice}"
    if t == field.TYPE_BYTES:
        return bytes([0, 255, choice]) + field.name.encode()
    if t == field.TYPE_BOOL:
        return True
    if t == field.TYPE_ENUM:
        numbers = sorted(v.number for v in field.enum_type.values)
        # An enum with only its zero value declared (HTTP status codes) is open: send a real number.
        return numbers[-1] if numbers[-1] else 503
    if t in (field.TYPE_UINT32, field.TYPE_UINT64):
        return 4_000_000_000 + choice if t == field.TYPE_UINT32 else 2**40 + choice
    if t in (field.TYPE_INT32, field.TYPE_INT64, field.TYPE_SINT32, field.TYPE_SINT64):
        return -7 - choice
    if t in (field.TYPE_DOUBLE, field.TYPE_FLOAT):
        return 0.5 + choice
    raise AssertionError(f"no sample for {field.full_name} of type {t}")


def _fill_wkt(target: Message, full_name: str, choice: int) -> None:
    if full_name == "google.protobuf.Struct":
        target.update(STRUCT_SAMPLE)  # type: ignore[attr-defined]
    elif full_name == "google.protobuf.UInt32Value":
        target.value = 200 + choice  # type: ignore[attr-defined]
    elif full_name == "google.protobuf.Any":
        target.type_url = CLA_TYPE  # type: ignore[attr-defined]
        target.value = load_assignment(  # type: ignore[attr-defined]
            {f"10.0.0.{choice}:8000": SimpleNamespace(digest=f"d{choice}")}  # type: ignore[dict-item]
        ).SerializeToString()
    else:
        raise AssertionError(f"no sample for {full_name}")


def fill(spec: Descriptor, target: Message, choice: int) -> None:
    """Set every field `spec` (our descriptor) declares on `target` (ours or Envoy's, by field number).

    Of a oneof, the member at `choice` (the last one past its end) is set, so that samples 0..6 between
    them carry every member of every oneof."""
    chosen = {
        oneof.name: oneof.fields[min(choice, len(oneof.fields) - 1)].number
        for oneof in spec.oneofs
        if not getattr(oneof, "is_synthetic", False)
    }
    for field in spec.fields:
        oneof = _oneof(field)
        if oneof is not None and chosen[oneof] != field.number:
            continue
        dest = target.DESCRIPTOR.fields_by_number[field.number]
        if _is_map(field):
            value_field = field.message_type.fields_by_name["value"]
            container = getattr(target, dest.name)
            for key in ("envoy.lb", f"k{choice}"):
                if value_field.message_type is not None:
                    sub = container[key]
                    _fill_message(value_field.message_type, sub, choice)
                else:
                    container[key] = _scalar(value_field, choice)
        elif field.is_repeated:
            container = getattr(target, dest.name)
            for i in range(2):
                if field.message_type is not None:
                    _fill_message(field.message_type, container.add(), choice + i)
                else:
                    container.append(_scalar(field, choice + i))
        elif field.message_type is not None:
            _fill_message(field.message_type, getattr(target, dest.name), choice)
            if not getattr(target, dest.name).ListFields():  # an empty message still counts as set
                getattr(target, dest.name).SetInParent()
        else:
            setattr(target, dest.name, _scalar(field, choice))


def _fill_message(spec: Descriptor, target: Message, choice: int) -> None:
    if spec.full_name.startswith(OUR_PACKAGE + "."):
        fill(spec, target, choice)
    else:
        _fill_wkt(target, spec.full_name, choice)


CHOICES = range(7)  # the largest oneof we declare (ProcessingResponse.response) has 7 members


@pytest.mark.parametrize("choice", CHOICES)
@pytest.mark.parametrize("ours", list(ROOTS), ids=lambda cls: cls.DESCRIPTOR.name)
def test_envoy_bytes_parse_into_ours_and_back(envoy: dict[str, ModuleType], ours: type, choice: int) -> None:
    theirs = envoy_class(ROOTS[ours])
    sent = theirs()
    fill(ours.DESCRIPTOR, sent, choice)
    parsed = ours.FromString(sent.SerializeToString())
    parsed.DiscardUnknownFields()  # only what we declare may carry the values back
    expected = ours()
    fill(ours.DESCRIPTOR, expected, choice)
    assert parsed == expected
    back = theirs.FromString(parsed.SerializeToString())
    assert back == sent


@pytest.mark.parametrize("choice", CHOICES)
@pytest.mark.parametrize("ours", list(ROOTS), ids=lambda cls: cls.DESCRIPTOR.name)
def test_our_bytes_parse_into_envoy_and_back(envoy: dict[str, ModuleType], ours: type, choice: int) -> None:
    theirs = envoy_class(ROOTS[ours])
    sent = ours()
    fill(ours.DESCRIPTOR, sent, choice)
    parsed = theirs.FromString(sent.SerializeToString())
    parsed.DiscardUnknownFields()  # a field Envoy would not recognise (wrong number or wire type) goes
    expected = theirs()
    fill(ours.DESCRIPTOR, expected, choice)
    assert parsed == expected
    assert ours.FromString(parsed.SerializeToString()) == sent


def test_fields_envoy_adds_are_skipped(envoy: dict[str, ModuleType]) -> None:
    ep = envoy["external_processor_pb2"]
    sent = ep.ProcessingRequest(
        response_body=ep.HttpBody(
            body=b"data: {}\n\n", end_of_stream=True, end_of_stream_without_message=True
        ),
        observability_mode=True,
    )
    sent.metadata_context.filter_metadata["x"].update({"a": 1})
    parsed = m.ProcessingRequest.FromString(sent.SerializeToString())
    assert parsed.WhichOneof("request") == "response_body"
    assert (parsed.response_body.body, parsed.response_body.end_of_stream) == (b"data: {}\n\n", True)


# --- what the sidecar builds, as Envoy reads it ---------------------------------------------------------


def test_replies_as_envoy_reads_them(envoy: dict[str, ModuleType]) -> None:
    ep = envoy["external_processor_pb2"]
    from envoy.config.core.v3 import base_pb2

    reply = ep.ProcessingResponse.FromString(
        m.immediate(429, b'{"error":1}', extra_headers=[("x-request-id", "r1")]).SerializeToString()
    )
    assert reply.immediate_response.status.code == 429
    assert reply.immediate_response.body == b'{"error":1}'
    assert reply.immediate_response.details == "router_sidecar"
    headers = reply.immediate_response.headers.set_headers
    assert [(h.header.key, h.header.raw_value) for h in headers] == [
        ("content-type", b"application/json"),
        ("x-request-id", b"r1"),
    ]
    assert {h.append_action for h in headers} == {base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD}

    chunk = ep.ProcessingResponse.FromString(m.streamed_body(b"abc", True))
    streamed = chunk.response_body.response.body_mutation.streamed_response
    assert (streamed.body, streamed.end_of_stream) == (b"abc", True)

    pin = struct_pb2.Struct()
    pin.update({"envoy.lb": {"fingerprint": "d1"}})
    body = ep.ProcessingResponse.FromString(
        m.request_body_reply(m.header_mutation([("a", "b")], ["c"]), pin).SerializeToString()
    )
    assert body.WhichOneof("response") == "request_body"
    assert body.dynamic_metadata == pin
    assert list(body.request_body.response.header_mutation.remove_headers) == ["c"]
    for reply_ours, which in (
        (m.request_headers_reply(), "request_headers"),
        (m.response_headers_reply(), "response_headers"),
        (m.RESPONSE_BODY_CONTINUE, "response_body"),
        (m.RESPONSE_TRAILERS_CONTINUE, "response_trailers"),
    ):
        assert (
            ep.ProcessingResponse.FromString(reply_ours.SerializeToString()).WhichOneof("response") == which
        )


def test_requests_as_the_sidecar_reads_them(envoy: dict[str, ModuleType]) -> None:
    ep = envoy["external_processor_pb2"]
    from envoy.config.core.v3 import base_pb2

    sent = ep.ProcessingRequest(
        response_headers=ep.HttpHeaders(
            headers=base_pb2.HeaderMap(
                headers=[
                    base_pb2.HeaderValue(key=":status", raw_value=b"200"),
                    base_pb2.HeaderValue(key="X-A", value="old"),
                    base_pb2.HeaderValue(key="x-a", raw_value=b"new\xe9"),
                ]
            ),
            end_of_stream=True,
        )
    )
    sent.attributes["envoy.filters.http.ext_proc"].update(
        {"response.flags": 16, "response.code_details": "via"}
    )
    parsed = m.ProcessingRequest.FromString(sent.SerializeToString())
    assert m.header_pairs(parsed.response_headers) == [(":status", "200"), ("x-a", "old"), ("x-a", "newé")]
    assert parsed.response_headers.end_of_stream
    attrs = m.attributes(parsed)
    assert attrs["response.code_details"] == "via"
    assert m.response_flags(attrs["response.flags"]) == frozenset({"UR"})


def test_endpoint_assignment_as_envoy_reads_it(envoy: dict[str, ModuleType]) -> None:
    replicas = {"127.0.0.1:8001": SimpleNamespace(digest="d1"), "[::1]:8002": SimpleNamespace(digest="d2")}
    resource = any_pb2.Any(type_url=CLA_TYPE, value=load_assignment(replicas).SerializeToString())  # type: ignore[arg-type]
    cla = envoy["endpoint_pb2"].ClusterLoadAssignment()
    assert resource.Unpack(cla)  # Unpack checks the type_url against Envoy's own message name
    assert cla.cluster_name == "llm"
    endpoints = cla.endpoints[0].lb_endpoints
    assert [
        (e.endpoint.address.socket_address.address, e.endpoint.address.socket_address.port_value)
        for e in endpoints
    ] == [
        ("127.0.0.1", 8001),
        ("::1", 8002),
    ]
    assert [dict(e.metadata.filter_metadata["envoy.lb"]) for e in endpoints] == [
        {"fingerprint": "d1"},
        {"fingerprint": "d2"},
    ]


# --- the gRPC services, called through Envoy's own generated stubs ---------------------------------------


def test_service_paths_are_envoys(envoy: dict[str, ModuleType]) -> None:
    def path(module: str, service: str, method: str) -> str:
        desc = envoy[module].DESCRIPTOR.services_by_name[service].methods_by_name[method]
        return f"/{desc.containing_service.full_name}/{desc.name}"

    assert (
        path("external_processor_pb2", "ExternalProcessor", "Process"),
        path("als_pb2", "AccessLogService", "StreamAccessLogs"),
        path("eds_pb2", "EndpointDiscoveryService", "StreamEndpoints"),
    ) == (
        services.PROCESS_METHOD,
        services.STREAM_ACCESS_LOGS_METHOD,
        services.STREAM_ENDPOINTS_METHOD,
    )


class _Echo:
    """An ext_proc servicer that streams every response body chunk straight back."""

    async def Process(self, request_iterator: Any, context: grpc.aio.ServicerContext) -> None:
        async for message in request_iterator:
            body = message.response_body
            await context.write(m.streamed_body(body.body, body.end_of_stream))


class _Notes:
    def __init__(self) -> None:
        self.seen: list[tuple[str, DownstreamLoss | None, int | None, int | None, int | None]] = []

    def note_access_log(
        self,
        request_id: str,
        cause: DownstreamLoss | None,
        status: int | None = None,
        attempts: int | None = None,
        body_bytes: int | None = None,
    ) -> None:
        self.seen.append((request_id, cause, status, attempts, body_bytes))


def test_envoy_stubs_talk_to_our_services(envoy: dict[str, ModuleType]) -> None:
    ep, ep_grpc = envoy["external_processor_pb2"], envoy["external_processor_pb2_grpc"]
    als, als_grpc = envoy["als_pb2"], envoy["als_pb2_grpc"]
    disc, eds_grpc = envoy["discovery_pb2"], envoy["eds_pb2_grpc"]
    from envoy.data.accesslog.v3 import accesslog_pb2

    notes = _Notes()
    liveness = SimpleNamespace(
        first_snapshot=None, changed=None, routable={"127.0.0.1:9001": SimpleNamespace(digest="d9")}
    )

    async def run() -> None:
        liveness.first_snapshot, liveness.changed = asyncio.Event(), asyncio.Event()
        liveness.first_snapshot.set()
        server = grpc.aio.server()
        services.add_external_processor(server, _Echo())
        services.add_access_log_service(server, AccessLogServicer(notes))  # type: ignore[arg-type]
        services.add_endpoint_discovery(server, EndpointDiscovery(liveness))  # type: ignore[arg-type]
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                chunks = [
                    ep.ProcessingRequest(response_body=ep.HttpBody(body=b"x" * 200, end_of_stream=False))
                ]
                chunks.append(ep.ProcessingRequest(response_body=ep.HttpBody(body=b"", end_of_stream=True)))
                replies = [r async for r in ep_grpc.ExternalProcessorStub(channel).Process(iter(chunks))]
                streamed = [r.response_body.response.body_mutation.streamed_response for r in replies]
                assert [(s.body, s.end_of_stream) for s in streamed] == [(b"x" * 200, False), (b"", True)]

                entry = accesslog_pb2.HTTPAccessLogEntry()
                entry.request.request_id = "req-1"
                entry.response.response_code.value = 200
                entry.response.response_body_bytes = 1234  # Envoy's %BYTES_SENT%: our field 3 reads it
                entry.common_properties.response_flags.upstream_remote_reset = True
                entry.common_properties.upstream_request_attempt_count = 3  # Envoy's count of its attempts
                log = als.StreamAccessLogsMessage()
                log.http_logs.log_entry.append(entry)
                await als_grpc.AccessLogServiceStub(channel).StreamAccessLogs(iter([log]))
                assert notes.seen == [("req-1", DownstreamLoss.UPSTREAM_RESET, 200, 3, 1234)]

                call = eds_grpc.EndpointDiscoveryServiceStub(channel).StreamEndpoints()
                await call.write(disc.DiscoveryRequest(type_url=CLA_TYPE))
                answer = await call.read()
                assert answer.type_url == CLA_TYPE and answer.version_info == "1"
                cla = envoy["endpoint_pb2"].ClusterLoadAssignment()
                assert answer.resources[0].Unpack(cla)
                assert cla.endpoints[0].lb_endpoints[0].endpoint.address.socket_address.port_value == 9001
                await call.done_writing()
                call.cancel()
        finally:
            await server.stop(None)

    asyncio.run(run())


def test_access_log_flags_are_classified(envoy: dict[str, ModuleType]) -> None:
    from envoy.data.accesslog.v3 import accesslog_pb2

    from router_sidecar.extproc.access_log import _UPSTREAM_FLAGS, classify

    for name in ("downstream_connection_termination", "downstream_remote_reset", *_UPSTREAM_FLAGS):
        flags = accesslog_pb2.ResponseFlags(**{name: True})
        ours = access_log_pb2.ResponseFlags.FromString(flags.SerializeToString())
        assert getattr(ours, name) is True  # a name classify() looks up but we did not declare would be False
        assert classify(ours) is not None
    assert classify(access_log_pb2.ResponseFlags()) is None


# --- the generated modules --------------------------------------------------------------------------------


@pytest.mark.parametrize("package", GENERATED_PACKAGES)
def test_every_proto_has_its_generated_module(package: str) -> None:
    protos = {p.stem for p in (REPO / "proto/router_sidecar" / package).glob("*.proto")}
    generated = {p.name for p in (REPO / "router_sidecar" / package).glob("*_pb2.py*")}
    assert generated == {f"{stem}_pb2.{ext}" for stem in protos for ext in ("py", "pyi")}
    if package == "wire":
        assert {mod.__name__.rsplit(".", 1)[1] for mod in WIRE_MODULES} == {f"{stem}_pb2" for stem in protos}


def test_import_is_silent_with_the_pinned_runtime() -> None:
    # The runtime refuses gencode newer than itself and may warn about old gencode: neither may happen.
    code = "; ".join(f"import {mod.__name__}" for mod in WIRE_MODULES)
    done = subprocess.run(
        [sys.executable, "-W", "error", "-c", code], capture_output=True, text=True, timeout=60, cwd=REPO
    )
    assert (done.returncode, done.stdout, done.stderr) == (0, "", "")


@pytest.mark.parametrize("package", GENERATED_PACKAGES)
def test_committed_modules_match_the_generator(package: str) -> None:
    script = REPO / "scripts/gen_protos.sh"
    pinned = re.search(r"^GRPCIO_TOOLS_VERSION=(\S+)$", script.read_text(), re.M)
    assert pinned is not None
    protoc = REPO / ".tools/protoc"  # scripts/setup.sh installs it there
    if not (protoc / "grpc_tools").is_dir():
        pytest.skip("no .tools/protoc: run scripts/setup.sh (scripts/gen_protos.sh alone brings its own)")
    assert (protoc / ".version").read_text().strip() == pinned.group(1), "run scripts/setup.sh"
    with tempfile.TemporaryDirectory() as out:
        subprocess.run(
            ["bash", str(script), out],
            check=True,
            capture_output=True,
            timeout=120,
            env={**os.environ, "GEN_PROTOS_PYTHON": sys.executable, "PYTHONPATH": str(protoc)},
        )
        fresh = {p.name: p.read_bytes() for p in (Path(out) / "router_sidecar" / package).iterdir()}
    committed = {p.name: p.read_bytes() for p in (REPO / "router_sidecar" / package).glob("*_pb2.py*")}
    assert sorted(fresh) == sorted(committed)
    stale = [name for name in fresh if fresh[name] != committed[name]]
    assert stale == [], "run scripts/gen_protos.sh and commit the result"


def test_wrappers_are_the_runtime_s_own() -> None:
    # Well-known types come from the protobuf runtime: no private copy may shadow them.
    field = access_log_pb2.HTTPResponseProperties.DESCRIPTOR.fields_by_name["response_code"]
    assert field.message_type is wrappers_pb2.UInt32Value.DESCRIPTOR


@pytest.mark.parametrize("size", [0, 1, 127, 128, 139, 16383, 16384, 2_097_152])
@pytest.mark.parametrize("end_of_stream", [False, True])
def test_hand_encoded_streamed_body_is_the_protobuf_encoding(
    envoy: dict[str, ModuleType], size: int, end_of_stream: bool
) -> None:
    """The per-chunk reply is written in wire form by hand: byte for byte what protobuf itself encodes, for
    our messages and for Envoy's (the varint lengths cross their 1-, 2- and 3-byte boundaries)."""
    ep, our_ep = envoy["external_processor_pb2"], ext_proc_pb2
    data = bytes(range(256)) * (size // 256) + bytes(range(size % 256))
    ours = our_ep.ProcessingResponse(
        response_body=our_ep.BodyResponse(
            response=our_ep.CommonResponse(
                body_mutation=our_ep.BodyMutation(
                    streamed_response=our_ep.StreamedBodyResponse(body=data, end_of_stream=end_of_stream)
                )
            )
        )
    )
    assert m.streamed_body(data, end_of_stream) == ours.SerializeToString()
    envoy = ep.ProcessingResponse.FromString(m.streamed_body(data, end_of_stream))
    streamed = envoy.response_body.response.body_mutation.streamed_response
    assert (streamed.body, streamed.end_of_stream) == (data, end_of_stream)


# --- behind an endpoint picker: the requests it answered itself ---------------------------------------------


def _envoy_entry(
    status: int,
    details: str,
    *,
    path: str = "/v1/chat/completions",
    method: str = "POST",
    attempts: int = 0,
    flag: str | None = None,
    headers: dict[str, str] | None = None,
) -> Message:
    from envoy.config.core.v3 import base_pb2
    from envoy.data.accesslog.v3 import accesslog_pb2

    entry = accesslog_pb2.HTTPAccessLogEntry()
    entry.request.request_id = "0f4c1b6e-7d0e-4a59-9c38-2b1f0f1d2a11"
    entry.request.request_method = base_pb2.RequestMethod.Value(method)
    entry.request.path = path
    entry.request.request_headers.update(headers if headers is not None else {"authorization": "Bearer t"})
    entry.response.response_code.value = status
    entry.response.response_code_details = details
    entry.common_properties.upstream_request_attempt_count = attempts
    entry.common_properties.response_flags.SetInParent()  # Envoy always sends the message, maybe empty
    if flag is not None:
        setattr(entry.common_properties.response_flags, flag, True)
    return entry


def _ours(entry: Message) -> access_log_pb2.HTTPAccessLogEntry:
    return access_log_pb2.HTTPAccessLogEntry.FromString(entry.SerializeToString())


def test_the_pickers_own_answers_are_told_from_every_other_entry(envoy: dict[str, ModuleType]) -> None:
    from router_sidecar.core.events import Outcome
    from router_sidecar.extproc.access_log import picker_answer

    unavailable = "ext_proc_error_gRPC_error_14{upstream_connect_error_or_disconnect}"
    found = picker_answer(_ours(_envoy_entry(503, "router_testbed_epp")))
    assert found is not None
    assert (found.route, found.status, found.details, found.outcome) == (
        "chat.completions",
        503,
        "router_testbed_epp",
        Outcome.NO_REPLICA_AVAILABLE,
    )
    assert found.credentials == {"authorization": "Bearer t"} and found.request_id.startswith("0f4c1b6e")
    assert found.reason == "the endpoint picker answered 503 (router_testbed_epp); no replica was asked"
    shed = picker_answer(_ours(_envoy_entry(429, "shed", path="/v1/messages/", headers={"x-api-key": "k"})))
    assert shed is not None and (shed.route, shed.outcome) == ("messages", Outcome.REPLICAS_OVERLOADED)
    assert shed.credentials == {"x-api-key": "k"}
    down = picker_answer(_ours(_envoy_entry(503, unavailable, path="/v1/responses")))
    assert down is not None and down.outcome is Outcome.ENDPOINT_PICKER_UNAVAILABLE
    assert down.reason.startswith("the endpoint picker could not be asked (ext_proc_error_gRPC_error_14")
    not_the_pickers = [
        _envoy_entry(503, "router_sidecar"),  # the sidecar's own answer (it journals those itself)
        _envoy_entry(503, "no_healthy_upstream", flag="no_healthy_upstream"),  # Envoy's, with its flag
        _envoy_entry(503, "overload", flag="overload_manager"),  # a flag our messages do not declare
        _envoy_entry(503, "via_upstream", attempts=1),  # a replica's answer
        _envoy_entry(500, unavailable),  # our own filter's stream failed (its status: Envoy's default)
        _envoy_entry(504, "ext_proc_error_per-message_timeout_exceeded"),
        _envoy_entry(429, unavailable),
        _envoy_entry(200, "via_upstream", attempts=1),
        _envoy_entry(503, "router_testbed_epp", path="/v1/models"),  # not an inference route
        _envoy_entry(503, "router_testbed_epp", method="GET"),  # 405 territory, not an inference request
        _envoy_entry(503, "router_testbed_epp", path="/v1/requests/x"),
    ]
    for entry in not_the_pickers:
        assert picker_answer(_ours(entry)) is None, entry


class _Rejections:
    def __init__(self) -> None:
        self.recorded: list[tuple[str, str, dict[str, Any]]] = []

    async def record_rejected(self, tenant: str, request_id: str, **fields: Any) -> bool:
        self.recorded.append((tenant, request_id, fields))
        return True


def test_the_access_log_journals_what_the_picker_answered(envoy: dict[str, ModuleType]) -> None:
    """Through Envoy's own stub: an entry of the picker's 503 is journaled under its caller's tenant, an entry
    of a request the registry knows is not (its own stream journals it), nor one of another kind."""
    als, als_grpc = envoy["als_pb2"], envoy["als_pb2_grpc"]
    from router_sidecar.extproc.downstream import tenant_of
    from router_sidecar.extproc.registry import Registry

    journal = _Rejections()
    registry = Registry()
    services_ = SimpleNamespace(journal=journal, tenant_secret=b"secret")
    known = _envoy_entry(503, "router_testbed_epp")
    known.request.request_id = "req_known"
    registry._live["req_known"] = SimpleNamespace(access_logged=asyncio.Event())  # type: ignore[assignment]

    async def run() -> None:
        server = grpc.aio.server()
        services.add_access_log_service(server, AccessLogServicer(registry, services_))  # type: ignore[arg-type]
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                log = als.StreamAccessLogsMessage()
                log.http_logs.log_entry.extend(
                    [
                        _envoy_entry(503, "router_testbed_epp"),
                        known,
                        _envoy_entry(200, "via_upstream", attempts=1),
                    ]
                )
                await als_grpc.AccessLogServiceStub(channel).StreamAccessLogs(iter([log]))
                for _ in range(100):  # the write runs in a task of its own
                    if journal.recorded:
                        break
                    await asyncio.sleep(0.01)
        finally:
            await server.stop(None)

    asyncio.run(run())
    [(tenant, request_id, fields)] = journal.recorded
    assert tenant == tenant_of({"authorization": "Bearer t"}, b"secret")
    assert request_id == "0f4c1b6e-7d0e-4a59-9c38-2b1f0f1d2a11"
    assert fields == {
        "route": "chat.completions",
        "outcome": "no_replica_available",
        "status": 503,
        "reason": "the endpoint picker answered 503 (router_testbed_epp); no replica was asked",
        "details": "router_testbed_epp",
    }
