"""The simulator's Responses API against real vLLM 0.32's bytes (tests/unit/sim_captures/vllm-0.32/ and the
shared reference): event names and order, keys and their order, id forms, sequence numbers, the echoed
request, bodies and error replies. Random text and counts are compared as types."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from router_testbed.sim import generation as gen
from router_testbed.sim import responses
from router_testbed.sim.server import json_response, stream_head
from tests.unit.sim_wire import (
    REF_VLLM,
    SGLANG,
    VLLM,
    capture,
    compressed,
    first_shapes,
    parse_events,
    shape,
)

R: dict[str, Any] = {"model": "tiny", "input": "Say something", "temperature": 0}
TOOL = {
    "type": "function",
    "name": "get_weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
CREATED = 1796353518


def sim_request(body: dict[str, Any], dialect: gen.Dialect = gen.VLLM) -> gen.GenRequest:
    return gen.parse_request("responses", json.dumps(body).encode(), served_model="tiny", dialect=dialect)


def sim_stream(body: dict[str, Any]) -> responses.ResponsesStream:
    req = sim_request({**body, "stream": True})
    meta = gen.StreamMeta(id=gen.VLLM.new_id(req), created=CREATED, model="tiny", fingerprint="")
    stream = gen.VLLM.stream(req, gen.plan_output(req, 0), meta)
    assert isinstance(stream, responses.ResponsesStream)
    return stream


def sim_events(body: dict[str, Any]) -> list[tuple[str | None, Any]]:
    return parse_events(b"".join(gen.api_clean_stream(sim_stream(body))))


def names(events: list[tuple[str | None, Any]]) -> list[str]:
    return [str(n) for n, _ in events]


def without_ids(response: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in response.items() if k not in ("id", "created_at")}


def test_text_stream_matches_the_capture() -> None:
    ref = capture(VLLM, "resp_stream_xrid").events()
    ours = sim_events({**R, "max_output_tokens": 8})
    assert (
        compressed(names(ours))
        == compressed(names(ref))
        == [
            "response.created",
            "response.in_progress",
            "response.output_item.added",
            "response.content_part.added",
            "response.output_text.delta",
            "response.output_text.done",
            "response.content_part.done",
            "response.output_item.done",
            "response.completed",
        ]
    )
    assert first_shapes(ours) == first_shapes(ref)
    # the echoed request is the same object, value for value
    assert without_ids(ours[0][1]["response"]) == without_ids(ref[0][1]["response"])
    # every event names itself twice: the SSE event name is the payload's type
    assert all(name == data["type"] for name, data in ours)


@pytest.mark.skipif(
    not (REF_VLLM / "responses_stream.sse").is_file(), reason="shared reference not available"
)
def test_text_stream_matches_the_shared_reference() -> None:
    ref = parse_events((REF_VLLM / "responses_stream.sse").read_bytes())
    ours = sim_events({**R, "max_output_tokens": 12})
    assert compressed(names(ours)) == compressed(names(ref))
    assert first_shapes(ours) == first_shapes(ref)
    completed = ours[-1][1]["response"]
    assert completed["status"] == "incomplete" and completed["incomplete_details"] == {
        "reason": "max_output_tokens"
    }
    assert completed["usage"]["output_tokens"] == 12  # one token per delta in the simulator


def test_bytes_are_event_then_compact_data() -> None:
    for event in gen.api_clean_stream(sim_stream({**R, "max_output_tokens": 2})):
        head, data, blank = event.split(b"\n", 2)
        assert head.startswith(b"event: response.") and data.startswith(b"data: {") and blank == b"\n"
        assert b'": ' not in data and b'", "' not in data


def test_sequence_numbers_are_gapless_from_zero_and_ids_hold_their_form() -> None:
    ours = sim_events({**R, "max_output_tokens": 5})
    assert [data["sequence_number"] for _, data in ours] == list(range(len(ours)))
    response_id = ours[0][1]["response"]["id"]
    assert re.fullmatch(r"resp_[0-9a-f]{16}", response_id)
    assert ours[-1][1]["response"]["id"] == response_id
    item_ids = {data.get("item_id") or data.get("item", {}).get("id") for _, data in ours[2:-1]}
    assert len(item_ids) == 1 and re.fullmatch(r"msg_[0-9a-f]{16}", item_ids.pop() or "")
    # each request its own ids
    again = sim_events({**R, "max_output_tokens": 5})
    assert again[0][1]["response"]["id"] != response_id


def test_the_body_request_id_names_the_response() -> None:
    ref = capture(VLLM, "resp_body_request_id").json()
    assert ref["id"] == "myid"
    req = sim_request({**R, "request_id": "myid"})
    assert gen.VLLM.new_id(req) == "myid"


def test_tool_call_stream_matches_the_capture() -> None:
    ref = capture(VLLM, "resp_tool_required").events()
    body = {**R, "tools": [TOOL], "tool_choice": "required", "parallel_tool_calls": False}
    ours = sim_events({**body, "max_output_tokens": 4})  # cut by max_output_tokens, as the capture was
    expected = [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert compressed(names(ours)) == compressed(names(ref)) == expected
    assert first_shapes(ours) == first_shapes(ref)
    added = ours[2][1]["item"]
    assert added["type"] == "function_call" and added["name"] == "get_weather" and added["arguments"] == ""
    assert re.fullmatch(r"chatcmpl-tool-[0-9a-f]{16}", added["call_id"])
    echoed = {**without_ids(ours[0][1]["response"]), "max_output_tokens": 200}
    assert echoed == without_ids(ref[0][1]["response"])
    args = "".join(data["delta"] for name, data in ours if name == "response.function_call_arguments.delta")
    assert ours[-3][1]["arguments"] == args


def test_a_complete_tool_call_is_a_completed_response() -> None:
    body = {**R, "tools": [TOOL], "tool_choice": {"type": "function", "name": "get_weather"}}
    ours = sim_events(body)
    completed = ours[-1][1]["response"]
    assert completed["status"] == "completed" and completed["incomplete_details"] is None
    assert completed["tool_choice"] == {"name": "get_weather", "type": "function"}
    (item,) = completed["output"]
    assert item["status"] == "completed" and json.loads(item["arguments"]).keys() == {"city"}


def test_stop_is_completed_like_the_capture() -> None:
    ref = capture(VLLM, "resp_stop").events()
    s = sim_stream({**R, "max_output_tokens": 8})
    events = [*s.opening()]
    for i in (1, 2, 3):
        events += [e for e, _ in s.piece(i, "stop")]
    events += s.closing(3, "stop", True) + s.terminal(3, "stop")
    ours = parse_events(b"".join(events))
    assert first_shapes(ours) == first_shapes(ref)
    assert ours[-1][1]["response"]["status"] == "completed"
    assert ours[-1][1]["response"]["usage"]["output_tokens"] == 3


def test_in_band_failure_is_a_cut_without_events() -> None:
    # responses_engine_dead_midstream.sse: the last event is a delta, then the connection closes
    assert sim_stream(R).failure(3) == ([], False)
    if (REF_VLLM / "responses_engine_dead_midstream.sse").is_file():
        ref = parse_events((REF_VLLM / "responses_engine_dead_midstream.sse").read_bytes())
        assert ref[-1][0] == "response.output_text.delta"
        assert [d["sequence_number"] for _, d in ref] == list(range(len(ref)))


def test_nonstream_body_matches_the_capture() -> None:
    req = sim_request({**R, "max_output_tokens": 8})
    meta = gen.StreamMeta(id=gen.VLLM.new_id(req), created=CREATED, model="tiny", fingerprint="")
    body = gen.VLLM.response_body(req, gen.plan_output(req, 0), meta, 8, "length")
    ref = capture(VLLM, "resp_nonstream")
    assert shape(json.loads(body)) == shape(ref.json())
    assert without_ids(json.loads(body))["output"][0].keys() == ref.json()["output"][0].keys()
    assert b'": ' not in body


def test_nonstream_tool_call_cut_short_stays_text_like_vllm() -> None:
    body = {**R, "tools": [TOOL], "tool_choice": {"type": "function", "name": "get_weather"}}
    req = sim_request({**body, "max_output_tokens": 2})
    output = gen.plan_output(req, 0)
    meta = gen.StreamMeta(id="resp_0", created=CREATED, model="tiny", fingerprint="")
    ours = json.loads(gen.VLLM.response_body(req, output, meta, 2, "length"))
    ref = capture(VLLM, "resp_tool_named_nonstream").json()
    assert shape(ours["output"]) == shape(ref["output"])
    assert ours["output"][0]["content"][0]["text"].startswith(
        '<tool_call>\n{"name": "get_weather", "arguments": '
    )
    whole = json.loads(gen.VLLM.response_body(req, output, meta, len(output.pieces), "tool_calls"))
    assert whole["output"] == [] or whole["output"][0]["type"] in ("function_call", "message")


def test_the_stored_objects_match_the_captures() -> None:
    queued = capture(VLLM, "bg_post").json()
    req = sim_request({**R, "max_output_tokens": 50, "background": True})
    meta = gen.StreamMeta(id="resp_0123456789abcdef", created=CREATED, model="tiny", fingerprint="")
    ours = responses.queued_object(req, meta)
    assert shape(ours) == shape(queued)
    assert without_ids(ours) == without_ids(queued)
    cancelled = capture(VLLM, "bg_cancel_inflight").json()
    assert cancelled["status"] == "cancelled" and cancelled["output"] == []


def _ref_http(name: str) -> tuple[list[str], bytes]:
    raw = (VLLM / f"{name}.raw").read_bytes()
    head, body = raw.split(b"\r\n\r\n", 1)
    return head.decode().split("\r\n"), body


def _comparable(lines: list[str]) -> list[str]:
    return [ln for ln in lines if not ln.startswith(("date: ", "x-sim-replica: ", "connection: "))]


def _error(body: dict[str, Any] | bytes) -> gen.RequestError:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    with pytest.raises(gen.RequestError) as info:
        gen.parse_request("responses", raw, served_model="tiny", max_model_len=1024)
    return info.value


@pytest.mark.parametrize(
    ("name", "error"),
    [
        ("resp_wrong_model", lambda: _error({**R, "model": "nope", "stream": True})),
        ("resp_too_long", lambda: _error({**R, "max_output_tokens": 5000, "stream": True})),
        ("resp_no_input", lambda: _error({"model": "tiny", "stream": True})),
        ("resp_bad_json", lambda: _error(b'{"model": "tiny", "input": [}')),
        ("resp_prev_unknown", lambda: gen.RequestError(404, responses.not_found_error("resp_nope"))),
        ("store_cancel_sync", lambda: gen.RequestError(400, responses.cannot_cancel_error())),
    ],
)
def test_error_replies_are_byte_exact(name: str, error: Any) -> None:
    err = error()
    ref_lines, ref_body = _ref_http(name)
    ours_head, ours_body = json_response(err.status, err.body, "r1").split(b"\r\n\r\n", 1)
    assert ours_body == ref_body
    assert _comparable(ours_head.decode().split("\r\n")) == _comparable(ref_lines)


def test_background_without_the_store_and_with_store_false_are_refused() -> None:
    assert json.loads(responses.background_without_store_error())["error"]["param"] == "background"
    err = _error({**R, "background": True, "store": False})
    assert err.status == 400 and json.loads(err.body)["error"]["param"] == "background"


def test_stream_headers_match_the_capture() -> None:
    ref_lines, _ = _ref_http("resp_stream_xrid")
    ours = stream_head("r1").split(b"\r\n\r\n")[0].decode().split("\r\n")
    assert _comparable(ours) == _comparable(ref_lines)


def test_sglang_serves_no_responses() -> None:
    with pytest.raises(gen.RequestError) as info:
        sim_request({**R, "stream": True}, dialect=gen.SGLANG)
    ref = capture(SGLANG, "resp")
    assert (info.value.status, info.value.body, info.value.plain) == (ref.status, ref.body, True)
    assert ref.header("vary") is None and ref.header("content-type") == "text/plain; charset=utf-8"
    ours = json_response(500, info.value.body, "r1", "text/plain; charset=utf-8", vary=False)
    ref_head = (SGLANG / "resp.raw").read_bytes().split(b"\r\n\r\n")[0].decode().split("\r\n")
    assert _comparable(ours.split(b"\r\n\r\n")[0].decode().split("\r\n")) == [
        ln for ln in _comparable(ref_head) if not ln.startswith("Connection: ")
    ]
    with pytest.raises(gen.RequestError) as bad:
        gen.parse_request(
            "responses", b'{"model": "tiny", "input": [}', served_model="tiny", dialect=gen.SGLANG
        )
    assert shape(json.loads(bad.value.body)) == shape(capture(SGLANG, "resp_bad_json").json())


@pytest.mark.parametrize("size", [5000, 2 * 1024 * 1024])
def test_oversize_pads_one_delta(size: int) -> None:
    req = sim_request({**R, "max_output_tokens": 4, "stream": True})
    output = gen.with_oversize(gen.plan_output(req, 0), {2: size})
    meta = gen.StreamMeta(id="resp_0", created=CREATED, model="tiny", fingerprint="")
    s = gen.VLLM.stream(req, output, meta)
    s.opening()
    first = s.piece(1, None)
    second = s.piece(2, None)
    assert len(first[-1][0]) < 1000 and len(second[-1][0]) >= size and second[-1][1] is True
