"""The simulator's byte formats against the real vLLM 0.32 transcripts (structure, not random text)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from router_testbed.sim import generation as gen
from router_testbed.sim.server import json_response, stream_head

REF = Path("/work/shared/reference/vllm-0.32-cpu")
pytestmark = pytest.mark.skipif(not REF.is_dir(), reason="vLLM reference transcripts not available")

# Values that are part of the format (kept verbatim); every other leaf is reduced to its type.
_VERBATIM = {"object", "finish_reason", "role", "type", "stop_reason", "model"}


def shape(value: Any, key: str | None = None) -> Any:
    """Key order, nesting, nulls and format-defining values; random text and numbers become types."""
    if isinstance(value, dict):
        return [(k, shape(v, k)) for k, v in value.items()]
    if isinstance(value, list):
        return [shape(v) for v in value]
    if value is None or isinstance(value, bool) or key in _VERBATIM:
        return value
    return type(value).__name__


def ref_events(name: str) -> list[bytes]:
    return gen.split_events((REF / name).read_bytes())


def ref_shapes(name: str) -> list[Any]:
    return [shape(gen.event_payload(e)) for e in ref_events(name)]


def renderer(
    kind: gen.Kind, *, max_tokens: int | None, include_usage: bool = False, **kw: Any
) -> gen.StreamRenderer:
    req = gen.GenRequest(
        kind=kind,
        model="tiny",
        prompt_text=kw.pop("prompt", "hello"),
        max_tokens=max_tokens,
        stream=True,
        include_usage=include_usage,
        continuous_usage=kw.pop("continuous_usage", False),
        seed=None,
        tool=kw.pop("tool", None),
    )
    meta = gen.StreamMeta(
        id=gen.chat_id() if kind == "chat" else gen.completion_id(),
        created=1796048954,
        model="tiny",
        fingerprint=gen.fingerprint_for("tiny", 0),
    )
    return gen.StreamRenderer(req, gen.plan_output(req, 0), meta)


def our_shapes(r: gen.StreamRenderer) -> list[Any]:
    return [shape(gen.event_payload(e)) for e in gen.clean_stream(r)]


@pytest.mark.parametrize(
    ("name", "kind", "max_tokens", "usage", "continuous"),
    [
        ("chat_stream_usage.sse", "chat", 12, True, False),
        ("chat_stream_continuous_usage.sse", "chat", 2, True, True),
        ("completions_stream.sse", "completion", 4, False, False),
        ("completions_stream_usage.sse", "completion", 3, True, False),
    ],
)
def test_stream_matches_transcript_structure(
    name: str, kind: gen.Kind, max_tokens: int, usage: bool, continuous: bool
) -> None:
    r = renderer(kind, max_tokens=max_tokens, include_usage=usage, continuous_usage=continuous)
    assert our_shapes(r) == ref_shapes(name)


def test_chat_stream_without_usage_puts_fingerprint_on_finish_event() -> None:
    events = [gen.event_payload(e) for e in gen.clean_stream(renderer("chat", max_tokens=3))]
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert [e["choices"][0]["finish_reason"] for e in events[1:-1]] == [None, None, "length"]
    assert "system_fingerprint" in events[-2]
    assert all("system_fingerprint" not in e for e in events[:-2])
    assert events[-1] == "[DONE]"


def test_one_token_per_content_event_and_usage_counts_them() -> None:
    r = renderer("chat", max_tokens=7, include_usage=True)
    events = [gen.event_payload(e) for e in gen.clean_stream(r)]
    content = [e for e in events[1:] if e != "[DONE]" and e["choices"]]
    assert len(content) == 7
    assert all(c["choices"][0]["delta"]["content"] for c in content)
    assert events[-2]["usage"]["completion_tokens"] == 7


def test_events_are_compact_json_like_vllm() -> None:
    for event in gen.clean_stream(renderer("chat", max_tokens=2, include_usage=True))[:-1]:
        assert b'": ' not in event and b'", "' not in event
        assert event.startswith(b"data: {") and event.endswith(b"}\n\n") and event.count(b"\n") == 2


def test_tool_call_stream_matches_transcript_structure() -> None:
    tool = gen.ToolSpec("get_weather", {"type": "object", "properties": {"city": {"type": "string"}}})
    ours = our_shapes(renderer("chat", max_tokens=None, tool=tool))
    ref = ref_shapes("chat_stream_tool_required.sse")
    # The transcript has two calls (index 0 and 1); ours has one. Same event kinds, same order of kinds.
    assert ours[0] == ref[0]
    assert ours[-2:] == ref[-2:]
    assert {json.dumps(s) for s in ours} == {json.dumps(s) for s in ref}
    first_tool = gen.event_payload(gen.clean_stream(renderer("chat", max_tokens=None, tool=tool))[1])
    call = first_tool["choices"][0]["delta"]["tool_calls"][0]
    assert call["id"].startswith("chatcmpl-tool-") and len(call["id"]) == len("chatcmpl-tool-") + 16


def test_tool_call_arguments_are_valid_json_and_deterministic() -> None:
    tool = gen.ToolSpec("f", {"properties": {"city": {"type": "string"}, "days": {"type": "integer"}}})
    a = [gen.event_payload(e) for e in gen.clean_stream(renderer("chat", max_tokens=None, tool=tool))]
    b = [gen.event_payload(e) for e in gen.clean_stream(renderer("chat", max_tokens=None, tool=tool))]
    args = "".join(
        e["choices"][0]["delta"]["tool_calls"][0]["function"].get("arguments", "") for e in a[1:-2]
    )
    assert set(json.loads(args)) == {"city", "days"}
    assert [e["choices"] for e in a[1:-1]] == [e["choices"] for e in b[1:-1]]


def test_nonstream_bodies_match_transcripts() -> None:
    for name, kind in (("chat.json", "chat"), ("completions.json", "completion")):
        r = renderer(kind, max_tokens=4)
        body = gen.response_body(r.req, r.output, r.meta, 4, "length")
        assert shape(json.loads(body)) == shape(json.loads((REF / name).read_bytes()))
        assert b'": ' not in body


def test_abort_event_carries_content() -> None:
    r = renderer("chat", max_tokens=5)
    ev = gen.event_payload(r.content_event(3, "abort"))
    choice = ev["choices"][0]
    assert choice["finish_reason"] == "abort" and choice["delta"]["content"]
    assert list(choice) == ["index", "delta", "logprobs", "finish_reason", "stop_reason", "token_ids"]


def test_inband_error_event_is_byte_exact() -> None:
    assert gen.inband_error_event() + gen.DONE_EVENT == (REF / "engine_dead_midstream_error.sse").read_bytes()


def _ref_http(name: str) -> tuple[list[str], bytes]:
    head, body = (REF / name).read_bytes().split(b"\r\n\r\n", 1)
    return head.decode().split("\r\n"), body


def _without_date_and_replica(lines: list[str]) -> list[str]:
    return [ln for ln in lines if not ln.startswith(("date: ", "x-sim-replica: "))]


@pytest.mark.parametrize(
    ("name", "status", "body"),
    [
        ("err_wrong_model.txt", 404, gen.wrong_model_error("nope", "tiny")),
        ("err_too_long.txt", 400, gen.too_long_error(5000, 1024)),
    ],
)
def test_error_replies_are_byte_exact(name: str, status: int, body: bytes) -> None:
    ref_lines, ref_body = _ref_http(name)
    ours_head, ours_body = json_response(status, body, "r1").split(b"\r\n\r\n", 1)
    assert ours_body == ref_body
    assert _without_date_and_replica(ours_head.decode().split("\r\n")) == _without_date_and_replica(ref_lines)


def test_bad_json_error_is_byte_exact() -> None:
    with pytest.raises(gen.RequestError) as info:
        gen.parse_request("chat", b'{"model":"tiny",}', served_model="tiny")
    _, ref_body = _ref_http("err_bad_json.txt")
    assert info.value.status == 400
    assert info.value.body == ref_body


def test_request_validation() -> None:
    with pytest.raises(gen.RequestError) as wrong:
        gen.parse_request("completion", b'{"model":"nope","prompt":"x"}', served_model="tiny")
    assert wrong.value.status == 404
    with pytest.raises(gen.RequestError) as too_long:
        gen.parse_request("completion", b'{"prompt":"x","max_tokens":5000}', served_model="tiny")
    assert too_long.value.status == 400
    req = gen.parse_request(
        "chat",
        b'{"model":"tiny","messages":[{"role":"user","content":"hi"}],"stream":true,'
        b'"stream_options":{"continuous_usage_stats":true},"seed":7,"ignore_eos":true}',
        served_model="tiny",
    )
    assert req.stream and req.seed == 7 and not req.include_usage and not req.continuous_usage


def test_stream_headers_match_transcript() -> None:
    ref_lines = (REF / "chat_stream.headers").read_bytes().decode().split("\r\n")
    ours = stream_head("r1").decode().split("\r\n")
    assert _without_date_and_replica(ours) == _without_date_and_replica(ref_lines)
    assert "x-sim-replica: r1" in ours
    assert ours[1].startswith("date: ") and ours[1].endswith(" GMT")


def test_tokens_are_deterministic_and_seed_dependent() -> None:
    a = gen.generate_tokens(0, "user: hi", "tiny", 50)
    assert a == gen.generate_tokens(0, "user: hi", "tiny", 50)
    assert a != gen.generate_tokens(1, "user: hi", "tiny", 50)
    assert a != gen.generate_tokens(0, "user: ho", "tiny", 50)
    assert all(t and t.isprintable() and t.strip().isalpha() for t in a)


def test_request_seed_overrides_server_seed() -> None:
    body = b'{"messages":[{"role":"user","content":"hi"}],"seed":5}'
    req = gen.parse_request("chat", body, served_model="tiny")
    assert gen.plan_output(req, 0).pieces == gen.plan_output(req, 99).pieces
    unseeded = gen.parse_request(
        "chat", b'{"messages":[{"role":"user","content":"hi"}]}', served_model="tiny"
    )
    assert gen.plan_output(unseeded, 0).pieces != gen.plan_output(unseeded, 99).pieces
    assert len(gen.plan_output(unseeded, 0).pieces) == gen.DEFAULT_MAX_TOKENS


def test_chunk_framing() -> None:
    assert gen.chunk(b"data: [DONE]\n\n") == b"e\r\ndata: [DONE]\n\n\r\n"
    assert gen.LAST_CHUNK == b"0\r\n\r\n"
