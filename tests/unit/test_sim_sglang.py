"""The simulator's SGLang dialect against the real SGLang 0.5.23 transcripts (structure, not random text).

Each transcript is an HTTP exchange recorded with ``curl -i`` (headers, then the de-chunked body). Streams are
compared event by event: key names and order, nulls, the values that define the format (``object``,
``finish_reason``, ``role``, error ``type``/``code``...), and the sequence of event kinds with runs of
content events collapsed (the real engine coalesces tokens; the simulator writes one per event). Where the
transcript fixes the bytes (error replies, the in-band error event, ``/v1/models``, ``/get_model_info``),
the bytes are compared.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from router_testbed.sim import generation as gen
from router_testbed.sim.server import json_response, stream_head

REF = Path("/work/shared/reference/sglang-0.5.23-cpu/transcripts")
pytestmark = pytest.mark.skipif(not REF.is_dir(), reason="SGLang reference transcripts not available")

SG = gen.SGLANG
_VERBATIM = {"object", "finish_reason", "role", "type", "code", "param", "message", "owned_by"}


def shape(value: Any, key: str | None = None) -> Any:
    """Key order, nesting, nulls and format-defining values; random text and numbers become types."""
    if isinstance(value, dict):
        return [(k, shape(v, k)) for k, v in value.items()]
    if isinstance(value, list):
        return [shape(v) for v in value]
    if value is None or isinstance(value, bool) or (key in _VERBATIM and isinstance(value, str | int)):
        return value
    return type(value).__name__


def collapsed(shapes: list[Any]) -> list[Any]:
    """Runs of identical shapes (content events) become one."""
    out: list[Any] = []
    for s in shapes:
        if not out or out[-1] != s:
            out.append(s)
    return out


def transcript(name: str) -> tuple[list[str], bytes]:
    head, body = (REF / name).read_bytes().split(b"\r\n\r\n", 1)
    return head.decode().split("\r\n"), re.sub(rb"\ncurl_rc=\d+\n?$", b"", body)


def ref_events(name: str) -> list[bytes]:
    """The transcript's SSE events, each with the blank line that ends it."""
    return [e + b"\n\n" for e in gen.split_events(transcript(name)[1])]


def shapes_of(events: list[bytes]) -> list[Any]:
    return [shape(gen.event_payload(e)) for e in events]


def without_date_and_replica(lines: list[str]) -> list[str]:
    return [ln for ln in lines if not ln.startswith(("date: ", "x-sim-replica: "))]


def request(
    kind: gen.Kind, *, max_tokens: int | None, include_usage: bool = False, **kw: Any
) -> gen.GenRequest:
    return gen.GenRequest(
        kind=kind,
        model="/tmp/sgl/tiny",
        prompt_text=kw.pop("prompt", "hello"),
        max_tokens=max_tokens,
        stream=kw.pop("stream", True),
        include_usage=include_usage,
        continuous_usage=False,
        seed=None,
        tool=kw.pop("tool", None),
        rid=kw.pop("rid", None),
    )


def renderer(kind: gen.Kind, *, max_tokens: int, include_usage: bool = False) -> gen.StreamRenderer:
    req = request(kind, max_tokens=max_tokens, include_usage=include_usage)
    meta = gen.StreamMeta(id=SG.new_id(req), created=1796104919, model=req.model, fingerprint="unused")
    return SG.renderer(req, gen.plan_output(req, 0), meta)


def interrupted(r: gen.StreamRenderer, after: int) -> list[bytes]:
    """What the simulator writes for ``error@token:{after + 1}``: the events so far, then the error tail."""
    events = [e for e in [r.role_event()] if e is not None]
    events += [r.content_event(i, r.natural_finish(i)) for i in range(1, after + 1)]
    return events + r.error_events(after)


def aborted(r: gen.StreamRenderer, after: int) -> list[bytes]:
    """What the simulator writes for ``abort@token:{after + 1}`` in this dialect (finish-only abort)."""
    assert not SG.abort_carries_token
    events = [e for e in [r.role_event()] if e is not None]
    events += [r.content_event(i, r.natural_finish(i)) for i in range(1, after + 1)]
    events.append(r.empty_event(after, "abort"))
    usage = r.usage_event(after)
    return events + ([usage] if usage is not None else []) + [gen.DONE_EVENT]


# --------------------------------------------------------------------------- streams


@pytest.mark.parametrize(
    ("name", "kind", "usage"),
    [
        ("chat_stream.txt", "chat", True),
        ("chat_stream_nousage.txt", "chat", False),
        ("completions_stream.txt", "completion", True),
    ],
)
def test_clean_stream_matches_transcript_event_by_event(name: str, kind: gen.Kind, usage: bool) -> None:
    ours = gen.clean_stream(renderer(kind, max_tokens=7, include_usage=usage))
    assert collapsed(shapes_of(ours)) == collapsed(shapes_of(ref_events(name)))


def test_chat_stream_sequence_role_content_finish_usage_done() -> None:
    events = [
        gen.event_payload(e) for e in gen.clean_stream(renderer("chat", max_tokens=3, include_usage=True))
    ]
    role, *content, finish, usage, done = events
    assert role["choices"][0]["delta"] == {"reasoning_content": None, "role": "assistant", "content": ""}
    assert [c["choices"][0]["delta"] for c in content] == [
        {"reasoning_content": None, "content": c["choices"][0]["delta"]["content"]} for c in content
    ]
    assert len(content) == 3 and all(c["choices"][0]["finish_reason"] is None for c in content)
    # The finish event has no content key; chat events have no usage key; nothing has a fingerprint.
    assert finish["choices"][0]["delta"] == {"reasoning_content": None}
    assert finish["choices"][0]["finish_reason"] == "length" and finish["choices"][0]["matched_stop"] is None
    assert all("usage" not in e and "system_fingerprint" not in e for e in (role, *content, finish))
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 3
    assert list(usage["usage"]) == [
        "prompt_tokens",
        "total_tokens",
        "completion_tokens",
        "prompt_tokens_details",
        "reasoning_tokens",
        "completion_tokens_details",
    ]
    assert done == "[DONE]"


def test_completions_stream_has_no_role_event_usage_null_and_finish_on_last_text() -> None:
    for usage in (True, False):
        events = [
            gen.event_payload(e)
            for e in gen.clean_stream(renderer("completion", max_tokens=4, include_usage=usage))
        ]
        texts = [e for e in events if isinstance(e, dict) and e["choices"]]
        assert len(texts) == 4 and all(t["choices"][0]["text"] for t in texts)
        assert all(t["usage"] is None for t in texts)
        assert [t["choices"][0]["finish_reason"] for t in texts] == [None, None, None, "length"]
        tail = events[len(texts) :]
        if usage:
            assert tail[0]["choices"] == [] and list(tail[0]["usage"]) == [
                "prompt_tokens",
                "total_tokens",
                "completion_tokens",
                "reasoning_tokens",
            ]
            tail = tail[1:]
        assert tail == ["[DONE]"]


def test_events_are_compact_json() -> None:
    for kind in ("chat", "completion"):
        for event in gen.clean_stream(renderer(kind, max_tokens=2, include_usage=True))[:-1]:
            assert b'": ' not in event and b'", "' not in event
            assert event.startswith(b"data: {") and event.endswith(b"}\n\n") and event.count(b"\n") == 2


def test_stream_headers_match_transcript() -> None:
    ref_lines, _ = transcript("chat_stream.txt")
    ours = stream_head("r1", SG).decode().removesuffix("\r\n\r\n").split("\r\n")
    assert without_date_and_replica(ours) == without_date_and_replica(ref_lines)
    assert "Transfer-Encoding: chunked" in ours and "x-sim-replica: r1" in ours


# --------------------------------------------------------------------------- the in-band error


@pytest.mark.parametrize(
    ("name", "kind"),
    [
        ("inband_error_running_timeout_chat.txt", "chat"),
        ("inband_error_running_timeout_completions.txt", "completion"),
    ],
)
def test_inband_error_then_usage_then_done_matches_transcript(name: str, kind: gen.Kind) -> None:
    ref = ref_events(name)
    ours = interrupted(renderer(kind, max_tokens=8, include_usage=True), after=5)
    assert collapsed(shapes_of(ours)) == collapsed(shapes_of(ref))
    # The error event, byte for byte (json.dumps with its spaces), then the usage event, then [DONE].
    assert ours[-3] == ref[-3] == gen.sglang_inband_error_event()
    assert b'"error": {"object": "error", "message": "Request running timeout reached."' in ours[-3]
    assert gen.event_payload(ours[-2])["usage"]["completion_tokens"] == 5
    assert ours[-1] == ref[-1] == gen.DONE_EVENT
    # No finish event: nothing before the error carries a finish_reason.
    assert all(gen.event_payload(e)["choices"][0]["finish_reason"] is None for e in ours[:-3] if e)


def test_inband_error_without_usage_is_error_then_done() -> None:
    r = renderer("chat", max_tokens=8)
    assert r.error_events(3) == [gen.sglang_inband_error_event(), gen.DONE_EVENT]


def test_error_without_a_stream_is_the_recorded_503() -> None:
    ref_lines, ref_body = transcript("inband_error_running_timeout_nonstream.txt")
    status, body = SG.failed_reply()
    assert status == 503 and body == ref_body
    ours_head, ours_body = json_response(status, body, "r1").split(b"\r\n\r\n", 1)
    assert ours_body == ref_body
    assert without_date_and_replica(ours_head.decode().split("\r\n")) == without_date_and_replica(ref_lines)


# --------------------------------------------------------------------------- abort


def test_abort_is_a_finish_only_event_then_usage_and_done_like_the_transcript() -> None:
    ref = ref_events("abort_request_midstream.txt")
    ours = aborted(renderer("chat", max_tokens=8, include_usage=True), after=4)
    assert collapsed(shapes_of(ours)) == collapsed(shapes_of(ref))
    finish = gen.event_payload(ours[-3])["choices"][0]
    assert finish == {
        "index": 0,
        "delta": {"reasoning_content": None},
        "logprobs": None,
        "finish_reason": "abort",
        "matched_stop": None,
    }
    assert gen.event_payload(ours[-2])["usage"]["completion_tokens"] == 4


def test_completions_abort_is_an_empty_text_event_with_usage_null() -> None:
    # Not recorded: SGLang writes one event per engine output, and the aborting output brings no text.
    ev = gen.event_payload(renderer("completion", max_tokens=8).empty_event(2, "abort"))
    assert ev["choices"] == [
        {"index": 0, "text": "", "logprobs": None, "finish_reason": "abort", "matched_stop": None}
    ]
    assert ev["usage"] is None


# --------------------------------------------------------------------------- non-stream bodies


def test_nonstream_chat_body_matches_transcript() -> None:
    req = request("chat", max_tokens=6, stream=False)
    meta = gen.StreamMeta(id=SG.new_id(req), created=1796104919, model=req.model, fingerprint="unused")
    body = SG.response_body(req, gen.plan_output(req, 0), meta, 6, "length")
    ref_lines, ref_body = transcript("chat_nonstream.txt")
    assert shape(json.loads(body)) == shape(json.loads(ref_body))
    answer = json.loads(body)
    assert answer["metadata"]["weight_versions"] == [{"version": "default", "start": 0, "end": 6}]
    assert answer["usage"]["completion_tokens"] == 6 and b'": ' not in body
    ours_head = json_response(200, body, "r1").split(b"\r\n\r\n", 1)[0].decode().split("\r\n")
    # The length differs with the random text; every other header is the transcript's.
    assert without_date_and_replica(ours_head)[:2] == without_date_and_replica(ref_lines)[:2]
    assert without_date_and_replica(ours_head)[3:] == without_date_and_replica(ref_lines)[3:]


def test_nonstream_abort_body_counts_the_tokens_before_the_abort() -> None:
    req = request("completion", max_tokens=6, stream=False)
    meta = gen.StreamMeta(id="abortme", created=1, model=req.model, fingerprint="unused")
    answer = json.loads(SG.response_body(req, gen.plan_output(req, 0), meta, 2, "abort"))
    assert answer["id"] == "abortme" and answer["object"] == "text_completion"
    assert answer["choices"][0]["finish_reason"] == "abort"
    assert answer["usage"]["completion_tokens"] == 2
    assert answer["choices"][0]["text"] == gen.plan_output(req, 0).text(2)


# --------------------------------------------------------------------------- ids and requests


def test_ids_are_32_hex_without_prefix_and_rid_sets_them() -> None:
    plain = request("chat", max_tokens=2)
    ids = {SG.new_id(plain) for _ in range(5)}
    assert len(ids) == 5 and all(re.fullmatch(r"[0-9a-f]{32}", i) for i in ids)
    assert SG.new_id(request("completion", max_tokens=2)).isalnum()
    assert SG.new_id(request("chat", max_tokens=2, rid="abortme")) == "abortme"
    # The vLLM dialect keeps its prefixes and has no use for rid.
    assert gen.VLLM.new_id(request("chat", max_tokens=2, rid="abortme")).startswith("chatcmpl-")


def test_parse_request_reads_rid_and_answers_errors_in_sglang_shape() -> None:
    body = b'{"model":"tiny","messages":[{"role":"user","content":"hi"}],"rid":"my-rid","stream":true}'
    assert gen.parse_request("chat", body, served_model="tiny", dialect=SG).rid == "my-rid"
    for raw, status in (
        (b'{"model":"tiny",}', 400),
        (b'{"model":"nope","prompt":"x"}', 404),
        (b'{"model":"tiny","prompt":"x","max_tokens":0}', 400),
        (b'{"model":"tiny"}', 400),
    ):
        with pytest.raises(gen.RequestError) as info:
            gen.parse_request("completion", raw, served_model="tiny", dialect=SG)
        error = json.loads(info.value.body)
        assert info.value.status == status == error["code"]
        assert list(error) == ["object", "message", "type", "param", "code"] and error["object"] == "error"


def test_continuous_usage_is_not_emitted() -> None:
    body = (
        b'{"messages":[{"role":"user","content":"hi"}],"stream":true,'
        b'"stream_options":{"include_usage":true,"continuous_usage_stats":true}}'
    )
    req = gen.parse_request("chat", body, served_model="tiny", dialect=SG)
    assert req.include_usage and not req.continuous_usage


def test_too_long_counts_prompt_and_max_tokens_like_the_transcript() -> None:
    _, ref_body = transcript("chat_stream_badreq.txt")
    assert SG.too_long_error(17, 4000, 1024) == ref_body
    assert SG.too_long_error(17, 1007, 1024) is None and SG.too_long_error(17, 1008, 1024) is not None
    ref_lines, _ = transcript("chat_stream_badreq.txt")
    ours_head = json_response(400, ref_body, "r1").split(b"\r\n\r\n", 1)[0].decode().split("\r\n")
    assert without_date_and_replica(ours_head) == without_date_and_replica(ref_lines)


# --------------------------------------------------------------------------- other endpoints


@pytest.mark.parametrize(
    ("path", "name"),
    [
        ("/health", "health.txt"),
        ("/health_generate", "health_generate.txt"),
        ("/v1/models", "models.txt"),
        ("/get_model_info", "get_model_info.txt"),
    ],
)
def test_endpoints_are_byte_exact(path: str, name: str) -> None:
    assert path in SG.info_paths
    info = SG.info_reply(path, "/tmp/sgl/tiny", 1796104918, 1024)
    ref_lines, ref_body = transcript(name)
    ours_head, ours_body = json_response(200, info.body, "r1", content_type=info.content_type).split(
        b"\r\n\r\n", 1
    )
    assert ours_body == ref_body
    assert without_date_and_replica(ours_head.decode().split("\r\n")) == without_date_and_replica(ref_lines)


def test_sglang_has_no_vllm_version_endpoint() -> None:
    assert "/version" not in SG.info_paths and "/get_model_info" not in gen.VLLM.info_paths
