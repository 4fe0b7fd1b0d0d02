"""The Responses and Messages APIs through the pure core: their events read, their first content found, their
preamble held, their ends told apart, and our own events and errors in their shapes — checked on the real
vLLM 0.32 transcripts (/work/shared/reference/vllm-0.32-cpu) in seeded random chunkings, and parsed back with
the official SDKs' own types where that is what a client would do.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest

from router_sidecar.core import views
from router_sidecar.core.attempt import FailRequest, ResponseBody, ResponseHeaders, StreamReset
from router_sidecar.core.dialects import anthropic_error_type, classify_messages, classify_responses
from router_sidecar.core.events import Outcome
from router_sidecar.core.openai_api import RequestRejected, RouteKind, parse_request
from router_sidecar.core.policy import DEFAULT_POLICY, policy_from_mapping
from router_sidecar.core.request import (
    Admitted,
    ClaimOutcome,
    ClaimSettled,
    Forward,
    LogicalRequest,
    Phase,
    ReleaseAttempt,
    ResponseChunk,
    ResponseStarted,
    Terminate,
    WatchPublisher,
    WriteAheadJournal,
)
from router_sidecar.core.sse import EventKind, SseScanner
from tests.unit.test_request import begin, fa

REFERENCE = Path("/work/shared/reference/vllm-0.32-cpu")
SSE = "text/event-stream; charset=utf-8"
RID = "req-0001"

RESPONSES_STREAM = (REFERENCE / "responses_stream.sse").read_bytes()
RESPONSES_DEAD = (REFERENCE / "responses_engine_dead_midstream.sse").read_bytes()
RESPONSES_NO_CONTENT = (REFERENCE / "responses_stream_tool_required.sse").read_bytes()
MESSAGES_STREAM = (REFERENCE / "messages_stream.sse").read_bytes()
MESSAGES_DEAD = (REFERENCE / "messages_engine_dead_midstream.sse").read_bytes()


def request_for(kind: RouteKind, body: dict[str, Any], policy: Any = DEFAULT_POLICY) -> LogicalRequest:
    parsed = parse_request(kind, json.dumps(body).encode(), max_body_bytes=1 << 20)
    request = LogicalRequest(request_id=RID, tenant="t1", parsed=parsed, policy=policy)
    request.handle(Admitted())
    request.handle(ClaimSettled(ClaimOutcome.GRANTED))
    return request


def responses_request(**extra: Any) -> LogicalRequest:
    return request_for(RouteKind.RESPONSES, {"model": "tiny", "input": "hi", "stream": True, **extra})


def messages_request(**extra: Any) -> LogicalRequest:
    body = {
        "model": "tiny",
        "max_tokens": 12,
        "messages": [{"role": "user", "content": "hi"}],
        "stream": True,
    }
    return request_for(RouteKind.MESSAGES, {**body, **extra})


def events(data: bytes) -> list[tuple[str, dict[str, Any]]]:
    """(event name, data object) of each event, read independently of the product (LF framing)."""
    out = []
    for block in data.split(b"\n\n"):
        name, payload = "", None
        for line in block.split(b"\n"):
            if line.startswith(b"event: "):
                name = line[7:].decode()
            elif line.startswith(b"data: "):
                payload = json.loads(line[6:])
        if payload is not None:
            out.append((name, payload))
    return out


def chunks(data: bytes, seed: int) -> list[bytes]:
    if seed == 0:
        return [data]
    rng, out, i = random.Random(seed), [], 0
    while i < len(data):
        n = rng.choice((1, 9, rng.randint(1, 80), rng.randint(1, 900)))
        out.append(data[i : i + n])
        i += n
    return out


# --- reading: every event of the transcripts ---------------------------------------------------------------


def kinds(data: bytes, classify: Any) -> list[tuple[str, EventKind]]:
    scanner = SseScanner(classify=classify)
    found = scanner.feed(data) + scanner.close()
    return [(events(e.raw)[0][0], e.kind) for e in found if events(e.raw)]


def test_responses_events_are_read_as_the_api_says() -> None:
    read = kinds(RESPONSES_STREAM, classify_responses)
    assert read[:4] == [
        ("response.created", EventKind.NON_CONTENT),
        ("response.in_progress", EventKind.NON_CONTENT),
        ("response.output_item.added", EventKind.NON_CONTENT),  # a message item: preamble
        ("response.content_part.added", EventKind.NON_CONTENT),
    ]
    assert read[4] == ("response.output_text.delta", EventKind.CONTENT)  # the first content
    assert read[-1] == ("response.completed", EventKind.DONE)  # the clean end (its status: incomplete)
    assert {k for n, k in read if n.endswith(".done")} == {EventKind.NON_CONTENT}


def test_responses_terminal_event_carries_the_output_tokens() -> None:
    scanner = SseScanner(classify=classify_responses)
    last = scanner.feed(RESPONSES_STREAM)[-1]
    assert (last.kind, last.usage_completion_tokens) == (EventKind.DONE, 12)


def test_messages_events_are_read_as_the_api_says() -> None:
    read = kinds(MESSAGES_STREAM, classify_messages)
    assert read[:2] == [
        ("message_start", EventKind.NON_CONTENT),
        ("content_block_start", EventKind.NON_CONTENT),  # an empty text block: preamble
    ]
    assert read[2] == ("content_block_delta", EventKind.CONTENT)
    assert read[-1] == ("message_stop", EventKind.DONE)
    dead = kinds(MESSAGES_DEAD, classify_messages)
    assert dead[-1] == ("error", EventKind.ERROR)  # vLLM's internal_error after content


@pytest.mark.parametrize(
    ("name", "data", "kind"),
    [
        ("response.output_text.delta", {"delta": ""}, EventKind.NON_CONTENT),
        ("response.function_call_arguments.delta", {"delta": '{"a'}, EventKind.CONTENT),
        ("response.reasoning_text.delta", {"delta": "think"}, EventKind.CONTENT),
        ("response.output_item.added", {"item": {"type": "function_call", "name": "f"}}, EventKind.CONTENT),
        ("response.output_item.added", {"item": {"type": "reasoning", "id": "rs_1"}}, EventKind.NON_CONTENT),
        ("response.incomplete", {"response": {"usage": {"output_tokens": 3}}}, EventKind.DONE),
        ("response.failed", {"response": {"error": {"code": "server_error"}}}, EventKind.ERROR),
        ("error", {"code": "x", "message": "m"}, EventKind.ERROR),
        ("", {"error": {"message": "EngineCore died"}}, EventKind.ERROR),  # vLLM's chat-shaped frame
        ("", {"type": "response.output_text.delta", "delta": "x"}, EventKind.CONTENT),  # no event: line
    ],
)
def test_responses_event_cases(name: str, data: dict[str, Any], kind: EventKind) -> None:
    raw = (f"event: {name}\n" if name else "").encode() + b"data: " + json.dumps(data).encode() + b"\n\n"
    [event] = SseScanner(classify=classify_responses).feed(raw)
    assert event.kind is kind


def _delta(kind: str, **fields: str) -> dict[str, Any]:
    return {"delta": {"type": kind, **fields}}


NC, CONTENT, ERROR = EventKind.NON_CONTENT, EventKind.CONTENT, EventKind.ERROR


@pytest.mark.parametrize(
    ("name", "data", "kind"),
    [
        ("content_block_delta", _delta("text_delta", text=""), NC),
        ("content_block_delta", _delta("thinking_delta", thinking="t"), CONTENT),
        ("content_block_delta", _delta("input_json_delta", partial_json="{"), CONTENT),
        ("content_block_delta", _delta("signature_delta", signature="s"), NC),  # follows thinking: no text
        ("content_block_start", {"content_block": {"type": "tool_use", "name": "f"}}, CONTENT),
        ("message_delta", {"delta": {"stop_reason": "end_turn"}, "usage": {"output_tokens": 4}}, NC),
        ("ping", {"type": "ping"}, NC),
        ("error", {"type": "error", "error": {"type": "overloaded_error"}}, ERROR),
    ],
)
def test_messages_event_cases(name: str, data: dict[str, Any], kind: EventKind) -> None:
    raw = f"event: {name}\ndata: ".encode() + json.dumps(data).encode() + b"\n\n"
    [event] = SseScanner(classify=classify_messages).feed(raw)
    assert event.kind is kind


@pytest.mark.parametrize("classify", [classify_responses, classify_messages])
@pytest.mark.parametrize("payload", [b"not json", b"[1, 2]", b'"text"', b"\xff\xfe"])
def test_a_broken_event_is_malformed(classify: Any, payload: bytes) -> None:
    [event] = SseScanner(classify=classify).feed(b"event: x\ndata: " + payload + b"\n\n")
    assert event.kind is EventKind.MALFORMED


# --- through the machines: the whole stream once, or its prefix and our event ------------------------------


def release(request: LogicalRequest, data: list[bytes]) -> list[bytes]:
    """Attempt 1 holds `data` until its first content, writes ahead, releases; the chunks after that."""
    attempt = begin(request)
    assert fa(request, attempt, ResponseHeaders(200, SSE)) == []
    for i, chunk in enumerate(data):
        decisions = fa(request, attempt, ResponseBody(chunk, i == len(data) - 1))
        if decisions:
            assert decisions == [WriteAheadJournal("att-1")]
            break
    from router_sidecar.core.attempt import WriteAheadDone

    released = fa(request, attempt, WriteAheadDone())
    assert released[0] == ReleaseAttempt("att-1", i + 1)
    return data[i + 1 :]


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize(
    ("make", "data", "usage"),
    [(responses_request, RESPONSES_STREAM, 12), (messages_request, MESSAGES_STREAM, 12)],
    ids=["responses", "messages"],
)
def test_a_complete_stream_is_forwarded_exactly_once(make: Any, data: bytes, usage: int, seed: int) -> None:
    request = make()
    pieces = chunks(data, seed)
    release(request, pieces)
    assert request.handle(ResponseStarted(200, SSE)) != []
    out = [request.handle(ResponseChunk(c, i == len(pieces) - 1)) for i, c in enumerate(pieces)]
    assert b"".join(d[0].data for d in out if d and isinstance(d[0], Forward)) == data  # nothing added
    assert (request.phase, request.outcome) == (Phase.COMPLETED, Outcome.COMPLETED)
    assert (request.delivered_output_tokens, request.delivered_tokens_source) == (usage, "usage")


def test_a_stream_with_no_content_is_complete_and_not_first_delta() -> None:
    request = responses_request()
    attempt = begin(request)
    fa(request, attempt, ResponseHeaders(200, SSE))
    assert fa(request, attempt, ResponseBody(RESPONSES_NO_CONTENT, True)) == [WriteAheadJournal("att-1")]
    assert not request.first_delta_sent  # completed with `output: []`: nothing to retry, nothing delivered


def test_responses_cut_after_content_ends_with_our_response_failed() -> None:
    # The engine died mid-stream: vLLM sends no terminal event and closes without the chunked terminator.
    # If the body ends cleanly instead (seen by the gateway as an end without response.completed), the
    # client gets our response.failed: the same response id, the next sequence number.
    request = responses_request()
    cut = RESPONSES_DEAD[: RESPONSES_DEAD.rindex(b"event: ")]
    release(request, [cut])
    request.handle(ResponseStarted(200, SSE))
    [end] = request.handle(ResponseChunk(cut, True))
    assert isinstance(end, Terminate)
    sent = events(cut)
    name, failed = events(end.data)[-1]
    assert name == "response.failed" == failed["type"]
    created = sent[0][1]["response"]
    assert failed["response"]["id"] == created["id"] and failed["response"]["id"].startswith("resp_")
    assert failed["sequence_number"] == sent[-1][1]["sequence_number"] + 1
    error = failed["response"]["error"]
    deltas = sum(1 for n, _ in sent if n == "response.output_text.delta")
    assert error == {
        "code": "upstream_decode_interrupted",
        "message": error["message"],
        "request_id": RID,
        "partial_output": True,
        "delivered_output_tokens": deltas,
        "retryable": False,
    }
    assert failed["response"]["status"] == "failed" and failed["response"]["model"] == "tiny"
    assert b"data: [DONE]" not in end.data  # this API has no [DONE]
    assert "response.completed" in error["message"]  # what was missing, in the API's own words
    assert (request.phase, request.outcome) == (Phase.INTERRUPTED, Outcome.UPSTREAM_DECODE_INTERRUPTED)
    # The openai SDK hands it to the caller as its own typed event, with our fields.
    import httpx2
    import openai
    from openai.types.responses import ResponseFailedEvent

    body = cut + end.data

    def serve(http_request: httpx2.Request) -> httpx2.Response:
        return httpx2.Response(200, headers={"content-type": "text/event-stream"}, content=body)

    client = openai.OpenAI(api_key="k", http_client=httpx2.Client(transport=httpx2.MockTransport(serve)))
    got = list(client.responses.create(model="tiny", input="hi", stream=True))
    assert isinstance(got[-1], ResponseFailedEvent)
    assert got[-1].response.error is not None and got[-1].response.error.code == "upstream_decode_interrupted"
    assert got[-1].response.id == created["id"]
    assert len({e.response.id for e in got if hasattr(e, "response")}) == 1  # one response, one id


def test_messages_error_after_content_is_replaced_by_ours() -> None:
    request = messages_request()
    release(request, [MESSAGES_DEAD])
    request.handle(ResponseStarted(200, SSE))
    [end] = request.handle(ResponseChunk(MESSAGES_DEAD, True))
    assert isinstance(end, Terminate)
    name, error = events(end.data)[-1]
    assert (name, error["type"], error["request_id"]) == ("error", "error", RID)
    assert error["error"]["type"] == "api_error"  # an Anthropic error type (vLLM's internal_error is not)
    assert error["error"]["code"] == error["error"]["details"]["error_code"] == "upstream_decode_interrupted"
    assert (error["error"]["partial_output"], error["error"]["retryable"]) == (True, False)
    replica_error = MESSAGES_DEAD[MESSAGES_DEAD.rindex(b"event: error") :]
    assert replica_error not in end.data  # the replica's own error never reaches the client
    assert events(end.data)[:-1] == events(MESSAGES_DEAD)[:-1]  # the content before it, unchanged
    assert request.phase is Phase.INTERRUPTED


def test_the_anthropic_sdk_raises_its_own_error_for_our_event() -> None:
    import anthropic
    import httpx2

    request = messages_request()
    release(request, [MESSAGES_STREAM[:600]])
    request.handle(ResponseStarted(200, SSE))
    [forward] = request.handle(ResponseChunk(MESSAGES_STREAM[:600], False))
    [end] = request.handle(ResponseChunk(b"", True))
    assert isinstance(forward, Forward) and isinstance(end, Terminate)
    body = forward.data + end.data

    def serve(http_request: httpx2.Request) -> httpx2.Response:
        return httpx2.Response(
            200, headers={"content-type": "text/event-stream", "request-id": RID}, content=body
        )

    client = anthropic.Anthropic(
        api_key="k", http_client=httpx2.Client(transport=httpx2.MockTransport(serve))
    )
    with pytest.raises(anthropic.APIStatusError) as raised:
        for _ in client.messages.create(
            model="tiny", max_tokens=12, messages=[{"role": "user", "content": "hi"}], stream=True
        ):
            pass
    assert raised.value.type == "api_error"  # type: ignore[attr-defined]
    assert raised.value.body["error"]["code"] == "upstream_decode_interrupted"  # type: ignore[index]


# --- errors before any content, in each API's shape ---------------------------------------------------


def test_a_messages_error_before_content_has_anthropics_shape() -> None:
    request = messages_request()
    attempt = begin(request)
    fa(request, attempt, StreamReset())
    verdict = FailRequest(503, Outcome.NO_REPLICA_AVAILABLE, "no healthy replica was available")
    body = json.loads(views.error_body(request, verdict))
    assert (body["type"], body["request_id"]) == ("error", RID)
    assert body["error"]["type"] == "overloaded_error" == anthropic_error_type(503)
    assert body["error"]["code"] == body["error"]["details"]["error_code"] == "no_replica_available"
    assert [a["outcome"] for a in body["error"]["attempts"]] == ["failed"]


def test_a_rejected_messages_request_has_anthropics_shape() -> None:
    rejected = RequestRejected(400, "missing_messages", "a Messages request needs `messages`", "messages")
    from router_sidecar.core.dialects import ErrorShape

    body = json.loads(views.rejection_body(rejected, RID, ErrorShape.ANTHROPIC))
    assert body["error"]["type"] == "invalid_request_error" and body["error"]["code"] == "missing_messages"
    openai = json.loads(views.rejection_body(rejected, RID, ErrorShape.OPENAI))
    assert openai["error"]["code"] == "missing_messages"


@pytest.mark.parametrize(
    ("kind", "body", "code"),
    [
        (RouteKind.RESPONSES, {"model": "m"}, "missing_input"),
        (RouteKind.RESPONSES, {"model": "m", "input": []}, "missing_input"),
        (RouteKind.MESSAGES, {"model": "m", "max_tokens": 1}, "missing_messages"),
        (RouteKind.RESPONSES, {"model": "m", "input": "x", "previous_response_id": 7}, "invalid_parameter"),
    ],
)
def test_admission_of_the_new_apis(kind: RouteKind, body: dict[str, Any], code: str) -> None:
    with pytest.raises(RequestRejected) as raised:
        parse_request(kind, json.dumps(body).encode(), max_body_bytes=1 << 20)
    assert raised.value.code == code


def test_a_request_on_state_of_one_replica_is_never_retried_elsewhere() -> None:
    request = responses_request(previous_response_id="resp_abc")
    assert request.retry_blocked is not None and "resp_abc" in request.retry_blocked
    assert request.max_attempts == 1
    cap = policy_from_mapping({"reprefill_cost_cap": {"max_prompt_tokens": 100000}})
    background = request_for(
        RouteKind.RESPONSES, {"model": "tiny", "input": "hi", "background": True, "store": True}, cap
    )
    assert background.retry_blocked is not None and "background" in background.retry_blocked


def test_prompt_estimates_read_each_apis_text() -> None:
    text = "x" * 400
    item = {"role": "user", "content": [{"type": "input_text", "text": text}]}
    body = {"model": "m", "input": [item], "instructions": text}
    responses = parse_request(RouteKind.RESPONSES, json.dumps(body).encode(), max_body_bytes=1 << 20)
    messages = parse_request(
        RouteKind.MESSAGES,
        json.dumps({"model": "m", "system": text, "messages": [{"role": "user", "content": text}]}).encode(),
        max_body_bytes=1 << 20,
    )
    assert responses.estimated_prompt_tokens == messages.estimated_prompt_tokens == 200


def test_watch_after_content_only() -> None:
    # The publisher is watched from its release at the first delta (the same as chat).
    request = messages_request()
    attempt = begin(request)
    fa(request, attempt, ResponseHeaders(200, SSE))
    fa(request, attempt, ResponseBody(MESSAGES_STREAM[:600], False))
    from router_sidecar.core.attempt import WriteAheadDone

    assert WatchPublisher("att-1") in fa(request, attempt, WriteAheadDone())
