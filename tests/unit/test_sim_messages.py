"""The simulator's Messages API against the real engines' bytes: vLLM 0.32 (reference messages_*,
tests/unit/sim_captures/vllm-0.32/msg_*) and SGLang 0.5.23 (transcripts, sim_captures/sglang-0.5.23/)."""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any

import pytest

from router_testbed.sim import generation as gen
from router_testbed.sim.server import json_response
from tests.unit.sim_wire import (
    REF_SGLANG,
    REF_VLLM,
    SGLANG,
    VLLM,
    capture,
    compressed,
    first_shapes,
    parse_events,
    parse_reply,
    shape,
)

M: dict[str, Any] = {
    "model": "tiny",
    "max_tokens": 8,
    "messages": [{"role": "user", "content": "Say something"}],
    "temperature": 0,
}
TOOL = {
    "name": "get_weather",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
TEXT_ORDER = [
    "message_start",
    "content_block_start",
    "content_block_delta",
    "content_block_stop",
    "message_delta",
    "message_stop",
]


def sim_request(
    body: dict[str, Any], dialect: gen.Dialect = gen.VLLM, request_id: str | None = None
) -> gen.GenRequest:
    req = gen.parse_request("messages", json.dumps(body).encode(), served_model="tiny", dialect=dialect)
    return dataclasses.replace(req, request_id=request_id)


def sim_stream(body: dict[str, Any], dialect: gen.Dialect = gen.VLLM, request_id: str | None = None) -> Any:
    req = sim_request({**body, "stream": True}, dialect, request_id)
    meta = gen.StreamMeta(id=dialect.new_id(req), created=0, model="tiny", fingerprint="")
    return dialect.stream(req, gen.plan_output(req, 0), meta)


def sim_events(
    body: dict[str, Any], dialect: gen.Dialect = gen.VLLM, request_id: str | None = None
) -> list[Any]:
    stream = sim_stream(body, dialect, request_id)
    carries = dialect.abort_carries_token and dialect.name == "vllm"
    return parse_events(b"".join(gen.api_clean_stream(stream, carries_finish=carries)))


def names(events: list[tuple[str | None, Any]]) -> list[str]:
    return [str(n) for n, _ in events]


# --------------------------------------------------------------------------- vLLM


@pytest.mark.skipif(not (REF_VLLM / "messages_stream.sse").is_file(), reason="shared reference not available")
def test_vllm_stream_matches_the_shared_reference() -> None:
    ref = parse_events((REF_VLLM / "messages_stream.sse").read_bytes())
    ours = sim_events({**M, "max_tokens": 12}, request_id="rec-msg-1")
    assert names(ours) == names(ref)  # one token per delta on both sides here
    assert first_shapes(ours) == first_shapes(ref)
    assert ours[0][1]["message"]["id"] == ref[0][1]["message"]["id"] == "chatcmpl-rec-msg-1"


def test_vllm_stream_matches_the_captures_and_its_id_is_the_request_id() -> None:
    for name, rid in (("msg_stream_xrid", "rec-9"), ("msg_stream", None)):
        ref = capture(VLLM, name).events()
        ours = sim_events(M, request_id=rid)
        assert compressed(names(ours)) == compressed(names(ref)) == TEXT_ORDER
        assert first_shapes(ours) == first_shapes(ref)
        ref_id, our_id = ref[0][1]["message"]["id"], ours[0][1]["message"]["id"]
        if rid is None:
            assert re.fullmatch(r"chatcmpl-[0-9a-f]{16}", ref_id) and re.fullmatch(
                r"chatcmpl-[0-9a-f]{16}", our_id
            )
        else:
            assert ref_id == our_id == f"chatcmpl-{rid}"


def test_vllm_events_are_compact_and_named() -> None:
    for event in gen.api_clean_stream(sim_stream(M)):
        head, data, blank = event.split(b"\n", 2)
        assert head.startswith(b"event: ") and data.startswith(b"data: {") and blank == b"\n"
        assert json.loads(data[6:])["type"] == head[7:].decode()
        assert b'": ' not in data


def test_vllm_tool_stream_matches_the_capture() -> None:
    ref = capture(VLLM, "msg_tool_any").events()
    body = {**M, "max_tokens": 3, "tools": [TOOL], "tool_choice": {"type": "any"}}
    ours = sim_events(body)
    assert compressed(names(ours)) == compressed(names(ref)) == TEXT_ORDER
    assert first_shapes(ours) == first_shapes(ref)
    block = ours[1][1]["content_block"]
    assert block["type"] == "tool_use" and block["name"] == "get_weather" and block["input"] == {}
    assert re.fullmatch(r"chatcmpl-tool-[0-9a-f]{16}", block["id"])
    assert {d["delta"]["type"] for n, d in ours if n == "content_block_delta"} == {"input_json_delta"}


def test_vllm_stop_reasons() -> None:
    def delta(body: dict[str, Any], finish: str, produced: int) -> dict[str, Any]:
        s = sim_stream(body)
        s.role()
        for i in range(1, produced + 1):
            s.piece(i, None)
        return parse_events(s.closing(produced, finish, False)[-1])[0][1]["delta"]

    assert delta(M, "length", 8) == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert delta(M, "stop", 3) == {"stop_reason": "end_turn", "stop_sequence": None}
    assert delta(M, "abort", 3) == {"stop_reason": None, "stop_sequence": None}
    tool = {**M, "max_tokens": 100, "tools": [TOOL], "tool_choice": {"type": "tool", "name": "get_weather"}}
    pieces = len(gen.plan_output(sim_request(tool), 0).pieces)
    assert delta(tool, "tool_calls", pieces)["stop_reason"] == "tool_use"
    assert delta(tool, "stop", 2)["stop_reason"] == "tool_use"  # a tool was used


@pytest.mark.skipif(not (REF_VLLM / "messages_engine_dead_midstream.sse").is_file(), reason="no reference")
def test_vllm_in_band_failure_is_byte_exact() -> None:
    events, terminated = sim_stream(M).failure(3)
    ref = (REF_VLLM / "messages_engine_dead_midstream.sse").read_bytes()
    assert terminated and events == [ref[ref.rindex(b"event: error\n") :]]


def test_vllm_nonstream_bodies() -> None:
    req = sim_request(M, request_id="rec-10")
    meta = gen.StreamMeta(id=gen.VLLM.new_id(req), created=0, model="tiny", fingerprint="")
    output = gen.plan_output(req, 0)
    ours = json.loads(gen.VLLM.response_body(req, output, meta, 8, "length"))
    ref = capture(VLLM, "msg_nonstream_xrid").json()
    assert shape(ours) == shape(ref) and ours["id"] == ref["id"] == "chatcmpl-rec-10"
    if (REF_VLLM / "messages.json").is_file():
        anonymous = sim_request(M)
        meta_a = gen.StreamMeta(id=gen.VLLM.new_id(anonymous), created=0, model="tiny", fingerprint="")
        body = json.loads(gen.VLLM.response_body(anonymous, output, meta_a, 8, "length"))
        assert shape(body) == shape(json.loads((REF_VLLM / "messages.json").read_bytes()))
    aborted = json.loads(gen.VLLM.response_body(req, output, meta, 2, "abort"))
    assert "stop_reason" not in aborted  # exclude_none: a null stop_reason is left out
    tool = sim_request({**M, "max_tokens": 100, "tools": [TOOL], "tool_choice": {"type": "any"}})
    tool_out = gen.plan_output(tool, 0)
    body = json.loads(gen.VLLM.response_body(tool, tool_out, meta, len(tool_out.pieces), "tool_calls"))
    assert body["content"][0]["type"] == "tool_use" and set(body["content"][0]["input"]) == {"city"}
    assert body["stop_reason"] == "tool_use"
    cut = json.loads(gen.VLLM.response_body(tool, tool_out, meta, 2, "length"))
    assert shape(cut["content"]) == shape(capture(VLLM, "msg_tool_named_nonstream").json()["content"])


def _error(body: dict[str, Any] | bytes, dialect: gen.Dialect = gen.VLLM) -> gen.RequestError:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    with pytest.raises(gen.RequestError) as info:
        gen.parse_request("messages", raw, served_model="tiny", max_model_len=1024, dialect=dialect)
    return info.value


def _assert_reply_like(err: gen.RequestError, raw: bytes) -> None:
    ref = parse_reply(raw)
    assert (err.status, err.body) == (ref.status, ref.body)
    ours = parse_reply(json_response(err.status, err.body, "r1"))
    drop = ("date", "x-sim-replica", "connection")
    assert [h for h in ours.headers if h[0].lower() not in drop] == [
        h for h in ref.headers if h[0].lower() not in drop
    ]


@pytest.mark.parametrize(
    ("name", "body"),
    [
        ("msg_wrong_model", {**M, "model": "nope", "stream": True}),
        ("msg_too_long", {**M, "max_tokens": 5000, "stream": True}),
        ("msg_no_max_tokens", {"model": "tiny", "messages": [{"role": "user", "content": "x"}]}),
        ("msg_bad_json", b'{"model": "tiny", "messages": [}'),
    ],
)
def test_vllm_error_replies_are_byte_exact(name: str, body: Any) -> None:
    _assert_reply_like(_error(body), (VLLM / f"{name}.raw").read_bytes())


def test_vllm_shared_reference_wrong_model() -> None:
    if not (REF_VLLM / "messages_err_wrong_model.txt").is_file():
        pytest.skip("shared reference not available")
    assert _error({**M, "model": "nope"}).body == (REF_VLLM / "messages_err_wrong_model.txt").read_bytes()


def test_fault_replies_have_the_anthropic_shape() -> None:
    for which, status in (("unavailable", 503), ("too_many", 429), ("failed", 500)):
        code, body = gen.VLLM.api_error("messages", which)
        assert code == status and list(json.loads(body)) == ["type", "error"]
    code, body = gen.SGLANG.api_error("messages", "failed")
    assert (code, body) == (503, capture(SGLANG, "msg_timeout_ns").body)


# --------------------------------------------------------------------------- SGLang


def test_sglang_stream_matches_the_captures() -> None:
    ref = capture(SGLANG, "msg_stream_xrid").events()
    ours = sim_events({**M, "max_tokens": 6}, gen.SGLANG, request_id="rec-s")
    assert names(ours) == names(ref)
    assert first_shapes(ours) == first_shapes(ref)
    assert re.fullmatch(r"msg_[0-9a-f]{32}", ours[0][1]["message"]["id"])  # x-request-id plays no part
    if (REF_SGLANG / "messages_stream.txt").is_file():
        shared = parse_reply((REF_SGLANG / "messages_stream.txt").read_bytes()).events()
        assert first_shapes(ours) == first_shapes(shared)


def test_sglang_serves_any_model_and_echoes_it() -> None:
    ref = capture(SGLANG, "msg_wrong_model").events()
    ours = sim_events({**M, "max_tokens": 6, "model": "nope"}, gen.SGLANG)
    assert first_shapes(ours) == first_shapes(ref)
    assert ours[0][1]["message"]["model"] == ref[0][1]["message"]["model"] == "nope"
    req = sim_request({**M, "model": "nope"}, gen.SGLANG)
    meta = gen.StreamMeta(id=gen.SGLANG.new_id(req), created=0, model="nope", fingerprint="")
    body = json.loads(gen.SGLANG.response_body(req, gen.plan_output(req, 0), meta, 6, "length"))
    assert shape(body) == shape(capture(SGLANG, "msg_wrong_model_ns").json())


def test_sglang_nonstream_body() -> None:
    if not (REF_SGLANG / "messages.txt").is_file():
        pytest.skip("shared reference not available")
    req = sim_request({**M, "max_tokens": 12}, gen.SGLANG)
    meta = gen.StreamMeta(id=gen.SGLANG.new_id(req), created=0, model="tiny", fingerprint="")
    body = json.loads(gen.SGLANG.response_body(req, gen.plan_output(req, 0), meta, 12, "length"))
    assert shape(body) == shape(parse_reply((REF_SGLANG / "messages.txt").read_bytes()).json())


def test_sglang_in_band_failure_matches_the_timeout_capture() -> None:
    ref = capture(SGLANG, "msg_timeout")
    s = sim_stream({**M, "max_tokens": 6}, gen.SGLANG)
    events = [e for e, _ in s.piece(1, None)] + [e for e, _ in s.piece(2, None)]
    failure, terminated = s.failure(2)
    assert terminated and ref.terminated
    assert failure == ref.chunks[-3:]  # content_block_stop, error, message_stop: byte for byte
    assert names(parse_events(b"".join(events + failure)))[-3:] == [
        "content_block_stop",
        "error",
        "message_stop",
    ]


def test_sglang_refuses_a_request_over_the_context_inside_the_stream() -> None:
    ref = capture(SGLANG, "msg_too_long")
    req = sim_request({**M, "max_tokens": 5000, "stream": True}, gen.SGLANG)
    assert req.params.refusal is not None
    meta = gen.StreamMeta(id=gen.SGLANG.new_id(req), created=0, model="tiny", fingerprint="")
    s = gen.SGLANG.stream(req, gen.plan_output(req, 0), meta)
    ours = parse_events(b"".join(s.refusal(req.params.refusal)))
    assert first_shapes(ours) == first_shapes(ref.events()) and names(ours) == names(ref.events())
    assert ours[1][1]["error"]["message"].startswith("Requested token count exceeds")
    with pytest.raises(gen.RequestError) as info:
        sim_request({**M, "max_tokens": 5000}, gen.SGLANG)
    assert info.value.status == 400


@pytest.mark.parametrize(
    ("name", "body"),
    [
        ("msg_bad_json", b'{"model": "tiny", "messages": [}'),
        ("msg_no_max", {"model": "tiny", "messages": [{"role": "user", "content": "x"}]}),
    ],
)
def test_sglang_error_replies_are_byte_exact(name: str, body: Any) -> None:
    err = _error(body, gen.SGLANG)
    ref = parse_reply((SGLANG / f"{name}.raw").read_bytes())
    assert (err.status, err.body) == (ref.status, ref.body)


def test_sglang_abort_is_end_turn_and_starts_the_message_if_nothing_did() -> None:
    s = sim_stream(M, gen.SGLANG)
    assert s.role() == []
    start = s.finish_only(0, "abort")
    assert names(parse_events(b"".join(start))) == ["message_start"]
    closing = parse_events(b"".join(s.closing(0, "abort", True)))
    assert closing[-1][1] == {
        "type": "message_delta",
        "delta": {"stop_reason": "end_turn"},
        "usage": {"output_tokens": 0},
    }
