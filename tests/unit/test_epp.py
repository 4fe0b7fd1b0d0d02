"""The testbed's endpoint picker without Envoy: what it picks, the ext_proc fields it reads and writes beyond
the product's wire messages (checked against Envoy's own messages, from xds-protos), and its answers to each
message of an ext_proc stream in each body mode."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from google.protobuf.message import Message

from router_sidecar.wire import ext_proc_pb2 as ep
from router_testbed.epp import wire
from router_testbed.epp.picker import Decision, Endpoint, Picker, parse_endpoint
from router_testbed.epp.server import PickerServer, PickerStream
from router_testbed.sim.log import RequestLog, read_log

A, B, C = (parse_endpoint(f"10.0.0.{i}:8000") for i in (1, 2, 3))
FULL_DUPLEX, BUFFERED, NONE = 4, 2, 0


@pytest.fixture(scope="module")
def envoy_ep() -> ModuleType:
    try:
        from envoy.service.ext_proc.v3 import external_processor_pb2
    except ImportError as exc:  # xds-protos is put aside by scripts/setup.sh
        pytest.skip(f"Envoy's API modules (xds-protos) are not importable ({exc}); run scripts/setup.sh")
    return external_processor_pb2


# What is picked.


def test_round_robin_rotates_the_whole_list_by_one_per_request() -> None:
    picker = Picker([A, B, C])
    lists = [picker.decide({}).endpoints for _ in range(4)]
    assert lists == [(A, B, C), (B, C, A), (C, A, B), (A, B, C)]
    assert picker.decide({}).reason == "round_robin"
    assert Decision((B, A)).value == "10.0.0.2:8000,10.0.0.1:8000"


def test_list_size_cuts_the_rotated_list() -> None:
    picker = Picker([A, B, C], list_size=2)
    assert [picker.decide({}).endpoints for _ in range(3)] == [(A, B), (B, C), (C, A)]
    assert Picker([A], list_size=5).decide({}).endpoints == (A,)


def test_the_selection_header_is_the_list_in_its_order() -> None:
    picker = Picker([A, B, C])
    header = "test-epp-endpoint-selection"
    assert picker.decide({header: "10.0.0.3:8000,10.0.0.1:8000"}) == Decision(
        (C, A), reason="selection_header"
    )
    # Repeats kept once, unknown entries dropped, spaces ignored, a bare IP names every endpoint on it.
    got = picker.decide({header: " 10.0.0.2:8000 , 10.0.0.2:8000,10.9.9.9:1,10.0.0.1"})
    assert got.endpoints == (B, A)
    both = Picker([A, Endpoint("10.0.0.1", 9000)]).decide({header: "10.0.0.1"})
    assert both.value == "10.0.0.1:8000,10.0.0.1:9000"
    # Naming no known endpoint leaves nothing to pick from: the protocol's 503.
    assert picker.decide({header: "10.9.9.9:1,not-an-address"}) == Decision(status=503, reason="no_endpoint")
    # The header does not advance the round robin.
    assert picker.decide({}).endpoints == (A, B, C)


def test_the_picker_answers_503_or_429_when_asked() -> None:
    picker = Picker([A, B])
    assert picker.decide({"test-epp-answer": "429"}) == Decision(status=429, reason="answer_header")
    assert picker.decide({"test-epp-answer": "503"}).status == 503
    assert picker.decide({"test-epp-answer": "yes"}).status == 503
    assert Picker([A], answer=429).decide({}) == Decision(status=429, reason="answer_flag")
    with pytest.raises(ValueError, match="503 or 429"):
        Picker([A], answer=500)


def test_a_subset_hint_restricts_every_choice() -> None:
    picker = Picker([A, B, C])
    assert picker.decide({}, subset=["10.0.0.3:8000", "10.0.0.2:8000"]).endpoints == (B, C)
    assert picker.decide({}, subset=["10.0.0.3:8000", "10.0.0.2:8000"]).endpoints == (C, B)
    steered = picker.decide(
        {"test-epp-endpoint-selection": "10.0.0.1:8000,10.0.0.2:8000"}, subset=["10.0.0.2:8000"]
    )
    assert steered.endpoints == (B,)
    assert picker.decide({}, subset=[]) == Decision(status=503, reason="no_endpoint")
    assert picker.decide({}, subset=["10.9.9.9:80"]).status == 503


def test_endpoints_are_addresses() -> None:
    assert str(parse_endpoint("[::1]:80")) == "[::1]:80"
    assert parse_endpoint("127.0.0.1:8000") == Endpoint("127.0.0.1", 8000)
    for bad in ("localhost:8000", "::1:80", "127.0.0.1", "127.0.0.1:0", "127.0.0.1:99999", ""):
        with pytest.raises(ValueError):
            parse_endpoint(bad)


# The fields beyond the product's wire messages, against Envoy's own.


def test_protocol_config_and_metadata_context_read_from_envoys_message(envoy_ep: ModuleType) -> None:
    sent = envoy_ep.ProcessingRequest()
    sent.request_headers.end_of_stream = False
    sent.protocol_config.request_body_mode = FULL_DUPLEX
    sent.protocol_config.response_body_mode = BUFFERED
    sent.protocol_config.send_body_without_waiting_for_header_response = True
    sent.metadata_context.filter_metadata["envoy.lb"].update(
        {"x-gateway-destination-endpoint-served": "10.0.0.1:8000"}
    )
    ours = ep.ProcessingRequest.FromString(sent.SerializeToString())
    assert wire.protocol_config(ours) == wire.ProtocolConfig(FULL_DUPLEX, BUFFERED, True)
    assert wire.protocol_config(ours).describe() == {  # type: ignore[union-attr]
        "request_body_mode": "FULL_DUPLEX_STREAMED",
        "response_body_mode": "BUFFERED",
    }
    metadata = wire.metadata_context(ours)
    assert {k: wire.plain_struct(v) for k, v in metadata.items()} == {
        "envoy.lb": {"x-gateway-destination-endpoint-served": "10.0.0.1:8000"}
    }
    later = ep.ProcessingRequest.FromString(
        envoy_ep.ProcessingRequest(request_body={"body": b"x"}).SerializeToString()
    )
    assert wire.protocol_config(later) is None and wire.metadata_context(later) == {}


def test_clear_route_cache_reaches_envoys_message(envoy_ep: ModuleType) -> None:
    common = wire.clear_route_cache(ep.CommonResponse())
    reply = ep.ProcessingResponse(request_headers=ep.HeadersResponse(response=common))
    parsed = envoy_ep.ProcessingResponse.FromString(reply.SerializeToString())
    assert parsed.request_headers.response.clear_route_cache is True


def test_health_messages() -> None:
    assert wire.health_request_service(b"") == ""
    assert wire.health_request_service(b"\x0a\x09readiness") == "readiness"
    assert wire.health_response(wire.SERVING) == b"\x08\x01"


# One stream, message by message.


class _Log(RequestLog):
    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.path = path

    def records(self) -> list[dict[str, Any]]:
        return read_log(self.path)


@pytest.fixture
def log(tmp_path: Path) -> Iterator[_Log]:
    out = _Log(tmp_path / "epp.jsonl")
    yield out
    out.close()


def _first(
    envoy_ep: ModuleType, request_mode: int, response_mode: int, headers: dict[str, str], eos: bool
) -> Any:
    sent = envoy_ep.ProcessingRequest()
    sent.protocol_config.request_body_mode = request_mode
    sent.protocol_config.response_body_mode = response_mode
    sent.request_headers.end_of_stream = eos
    for key, value in headers.items():
        sent.request_headers.headers.headers.add(key=key, raw_value=value.encode())
    return sent


def _ours(message: Message) -> ep.ProcessingRequest:
    return ep.ProcessingRequest.FromString(message.SerializeToString())


def _envoys(envoy_ep: ModuleType, replies: list[Any]) -> list[Any]:
    return [
        envoy_ep.ProcessingResponse.FromString(r if isinstance(r, bytes) else r.SerializeToString())
        for r in replies
    ]


def test_full_duplex_holds_the_headers_until_the_body_ends(envoy_ep: ModuleType, log: _Log) -> None:
    stream = PickerStream(PickerServer(Picker([A, B]), log, "test", log_headers=["X-Test-Id"]))
    first = _first(
        envoy_ep,
        FULL_DUPLEX,
        FULL_DUPLEX,
        {":path": "/v1/chat/completions", "x-request-id": "r1", "x-test-id": "t-1"},
        False,
    )
    assert stream.on_message(_ours(first)) == []
    assert stream.on_message(_ours(envoy_ep.ProcessingRequest(request_body={"body": b"abc"}))) == []
    end = envoy_ep.ProcessingRequest(request_body={"body": b"def", "end_of_stream": True})
    headers, *bodies = _envoys(envoy_ep, stream.on_message(_ours(end)))
    common = headers.request_headers.response
    assert [(h.header.key, h.header.raw_value) for h in common.header_mutation.set_headers] == [
        ("x-gateway-destination-endpoint", b"10.0.0.1:8000,10.0.0.2:8000")
    ]
    assert common.clear_route_cache
    lb = headers.dynamic_metadata.fields["envoy.lb"].struct_value.fields
    assert lb["x-gateway-destination-endpoint"].string_value == "10.0.0.1:8000,10.0.0.2:8000"
    assert [
        (
            b.request_body.response.body_mutation.streamed_response.body,
            b.request_body.response.body_mutation.streamed_response.end_of_stream,
        )
        for b in bodies
    ] == [(b"abc", False), (b"def", True)]
    # The response: the served report read, the body streamed back as it came.
    response = envoy_ep.ProcessingRequest()
    response.response_headers.headers.headers.add(key=":status", raw_value=b"200")
    response.metadata_context.filter_metadata["envoy.lb"].update(
        {
            "x-gateway-destination-endpoint": "10.0.0.1:8000,10.0.0.2:8000",
            "x-gateway-destination-endpoint-served": "10.0.0.2:8000",
        }
    )
    (answer,) = _envoys(envoy_ep, stream.on_message(_ours(response)))
    assert [
        (h.header.key, h.header.raw_value)
        for h in answer.response_headers.response.header_mutation.set_headers
    ] == [("x-conformance-test-served-endpoint", b"10.0.0.2:8000")]
    chunk = envoy_ep.ProcessingRequest(response_body={"body": b"data: x\n\n", "end_of_stream": True})
    (streamed,) = _envoys(envoy_ep, stream.on_message(_ours(chunk)))
    assert streamed.response_body.response.body_mutation.streamed_response.body == b"data: x\n\n"
    assert streamed.response_body.response.body_mutation.streamed_response.end_of_stream
    record = stream.end_record(stream.outcome())
    assert record["event"] == "end" and record["outcome"] == "completed"
    assert record["headers"] == {"x-test-id": "t-1"}
    assert (record["request_id"], record["picked"], record["served"]) == (
        "r1",
        ["10.0.0.1:8000", "10.0.0.2:8000"],
        "10.0.0.2:8000",
    )
    assert (
        record["request_body_sha256"] == hashlib.sha256(b"abcdef").hexdigest()
        and record["request_body_chunks"] == 2
    )
    assert record["response_body_bytes"] == 9 and record["response_status"] == "200"
    assert (
        record["t_request_headers"]
        <= record["t_request_end"]
        <= record["t_picked"]
        <= record["t_response_headers"]
    )
    (pick,) = log.records()
    assert (
        pick["event"] == "pick"
        and pick["reason"] == "round_robin"
        and pick["mode"]["request_body_mode"] == "FULL_DUPLEX_STREAMED"
    )


def test_trailers_end_the_body_in_full_duplex(envoy_ep: ModuleType, log: _Log) -> None:
    stream = PickerStream(PickerServer(Picker([A]), log))
    assert stream.on_message(_ours(_first(envoy_ep, FULL_DUPLEX, NONE, {"x-request-id": "t"}, False))) == []
    assert stream.on_message(_ours(envoy_ep.ProcessingRequest(request_body={"body": b"abc"}))) == []
    trailers = envoy_ep.ProcessingRequest()
    trailers.request_trailers.trailers.headers.add(key="x-checksum", raw_value=b"42")
    headers, body, end = _envoys(envoy_ep, stream.on_message(_ours(trailers)))
    assert headers.WhichOneof("response") == "request_headers"
    assert body.request_body.response.body_mutation.streamed_response.body == b"abc"
    assert not body.request_body.response.body_mutation.streamed_response.end_of_stream
    assert end.WhichOneof("response") == "request_trailers" and not end.request_trailers.HasField(
        "header_mutation"
    )
    assert stream.end_record("x")["request_trailers"] == {"x-checksum": "42"}


def test_other_modes_answer_the_headers_at_once_and_continue_the_body(
    envoy_ep: ModuleType, log: _Log
) -> None:
    stream = PickerStream(PickerServer(Picker([A, B]), log))
    (headers,) = _envoys(envoy_ep, stream.on_message(_ours(_first(envoy_ep, BUFFERED, NONE, {}, False))))
    assert headers.request_headers.response.clear_route_cache
    (body,) = _envoys(
        envoy_ep,
        stream.on_message(
            _ours(envoy_ep.ProcessingRequest(request_body={"body": b"x", "end_of_stream": True}))
        ),
    )
    assert body.WhichOneof("response") == "request_body" and not body.request_body.response.HasField(
        "body_mutation"
    )
    response = envoy_ep.ProcessingRequest()
    response.response_headers.headers.headers.add(
        key="x-gateway-destination-endpoint-served", raw_value=b"10.0.0.1:8000"
    )
    (answer,) = _envoys(envoy_ep, stream.on_message(_ours(response)))
    assert (
        answer.response_headers.response.header_mutation.set_headers[0].header.raw_value == b"10.0.0.1:8000"
    )
    (more,) = _envoys(
        envoy_ep, stream.on_message(_ours(envoy_ep.ProcessingRequest(response_body={"body": b"y"})))
    )
    assert more.WhichOneof("response") == "response_body" and not more.response_body.response.HasField(
        "body_mutation"
    )
    record = stream.end_record(stream.outcome())
    assert (record["served"], record["served_header"], record["outcome"]) == (
        None,
        "10.0.0.1:8000",
        "incomplete",
    )


def test_the_pickers_own_answer_is_an_immediate_response(envoy_ep: ModuleType, log: _Log) -> None:
    stream = PickerStream(PickerServer(Picker([A]), log))
    first = _first(
        envoy_ep, FULL_DUPLEX, FULL_DUPLEX, {"x-request-id": "shed", "test-epp-answer": "429"}, True
    )
    (reply,) = _envoys(envoy_ep, stream.on_message(_ours(first)))
    immediate = reply.immediate_response
    assert immediate.status.code == 429
    assert json.loads(immediate.body) == {
        "error": {"message": "request shed", "type": "endpoint_picker", "code": 429}
    }
    assert "retry-after" not in {h.header.key for h in immediate.headers.set_headers}
    record = stream.end_record(stream.outcome())
    assert (record["picked"], record["answer"], record["outcome"]) == (None, 429, "answered")
    # Asked to, it says when to come back.
    stream = PickerStream(PickerServer(Picker([A]), log))
    headers = {"x-request-id": "shed", "test-epp-answer": "429", "test-epp-retry-after": "7"}
    (reply,) = _envoys(
        envoy_ep, stream.on_message(_ours(_first(envoy_ep, FULL_DUPLEX, FULL_DUPLEX, headers, True)))
    )
    set_headers = {h.header.key: h.header.raw_value for h in reply.immediate_response.headers.set_headers}
    assert set_headers["retry-after"] == b"7"


def test_the_command_line(capsys: pytest.CaptureFixture[str]) -> None:
    from router_testbed.epp.server import Config, config_from_args

    argv = ["--listen", "127.0.0.1:0", "--endpoint", "10.0.0.1:8000", "--endpoint", "[::1]:9000"]
    assert config_from_args(argv) == Config("127.0.0.1", 0, (A, Endpoint("::1", 9000)))
    more = config_from_args(
        [*argv, "--log", "x.jsonl", "--list-size", "1", "--answer", "429", "--tls", "--log-header", "X-Test"]
    )
    assert (more.log_path, more.list_size, more.answer, more.tls) == ("x.jsonl", 1, 429, True)
    assert more.log_headers == ("X-Test",)
    listen = ["--listen", "127.0.0.1:0"]
    for bad in (
        [*listen, "--endpoint", "localhost:8000"],
        [*argv, "--list-size", "0"],
        [*argv, "--answer", "500"],
        listen,  # no endpoint
    ):
        with pytest.raises(SystemExit) as stopped:
            config_from_args(bad)
        assert stopped.value.code == 2
    assert "localhost:8000" in capsys.readouterr().err
