"""The logical-request machine (downstream filter): retry decisions before the first delta, and what the
client receives after it: every byte of one attempt once, then `[DONE]` or exactly one terminal error frame.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest

from router_sidecar.core.attempt import AttemptFailed, FailureReason
from router_sidecar.core.events import EventName
from router_sidecar.core.openai_api import ParsedRequest, RouteKind, parse_request
from router_sidecar.core.policy import DEFAULT_POLICY, Policy, policy_from_mapping
from router_sidecar.core.request import (
    DownstreamLoss,
    FailRequest,
    Forward,
    LogicalRequest,
    Outcome,
    Phase,
    Terminate,
    TriggerRetry,
)
from router_sidecar.core.sse import DONE_EVENT, terminal_error_frame

REFERENCE = Path("/work/shared/reference/vllm-0.32-cpu")
SSE = "text/event-stream; charset=utf-8"
RID = "req-0001"
LONG_PROMPT = "tell me a long story " * 20  # 420 bytes: ~105 estimated tokens


def parsed(prompt: str = "hi", *, kind: RouteKind = RouteKind.CHAT, stream: bool = True) -> ParsedRequest:
    body: dict[str, Any] = {"model": "tiny", "stream": stream, "seed": 7}
    if kind is RouteKind.CHAT:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    return parse_request(kind, json.dumps(body).encode(), max_body_bytes=1 << 20, known_models=None)


def new_request(policy: Policy = DEFAULT_POLICY, prompt: str = "hi", **kw: Any) -> LogicalRequest:
    return LogicalRequest(request_id=RID, tenant="t1", parsed=parsed(prompt, **kw), policy=policy)


def chunk(
    delta: dict[str, Any] | None = None, *, finish: str | None = None, usage: int | None = None
) -> bytes:
    obj: dict[str, Any] = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "model": "tiny"}
    obj["choices"] = [] if delta is None else [{"index": 0, "delta": delta, "finish_reason": finish}]
    if usage is not None:
        obj["usage"] = {"prompt_tokens": 3, "total_tokens": 3 + usage, "completion_tokens": usage}
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


ROLE = chunk({"role": "assistant", "content": ""})
C1, C2, C3 = chunk({"content": "Hel"}), chunk({"content": "lo"}), chunk({"content": " world"})
FINISH = chunk({}, finish="stop")
ABORT = chunk({}, finish="abort")
ABORT_WITH_CONTENT = chunk({"content": "!"}, finish="abort")
ERROR = b'data: {"error": {"message": "boom", "type": "InternalServerError", "param": null, "code": 500}}\n\n'
KEEPALIVE = b": keep-alive\n\n"
ENGINE_DEAD = (REFERENCE / "engine_dead_midstream_error.sse").read_bytes()
KILLED = (REFERENCE / "chat_stream_killed_midstream.sse").read_bytes()


def client_events(data: bytes) -> list[Any]:
    """An independent reading of what a client got: JSON payloads of `data:` events (or "[DONE]")."""
    out: list[Any] = []
    for block in data.split(b"\n\n"):
        lines = [ln[6:] for ln in block.split(b"\n") if ln.startswith(b"data: ")]
        if lines:
            payload = b"\n".join(lines)
            out.append("[DONE]" if payload == b"[DONE]" else json.loads(payload))
    return out


def is_content(obj: Any) -> bool:
    if not isinstance(obj, dict):
        return False
    for ch in obj.get("choices") or ():
        d = ch.get("delta") or {}
        if ch.get("text") or d.get("content") or d.get("tool_calls") or d.get("reasoning_content"):
            return True
    return False


def content_count(data: bytes) -> int:
    return sum(is_content(e) for e in client_events(data))


def last_usage(data: bytes) -> int | None:
    found = None
    for e in client_events(data):
        if isinstance(e, dict) and isinstance(e.get("usage"), dict):
            found = e["usage"]["completion_tokens"]
    return found


def random_chunks(data: bytes, rng: random.Random) -> list[bytes]:
    out, i = [], 0
    while i < len(data):
        n = rng.choice((1, 7, rng.randint(1, 64), rng.randint(1, 700), rng.randint(1, 5000)))
        out.append(data[i : i + n])
        i += n
    return out


def released(request: LogicalRequest, attempt_id: str = "att-1", replica: str = "r1") -> None:
    """An attempt that released its first delta (the upstream filter's side of the story)."""
    record = request.begin_attempt(attempt_id, replica)
    request.on_attempt_released(record, first_delta=True)


def feed(request: LogicalRequest, chunks: list[bytes], *, eos_last: bool = True) -> list[Any]:
    return [request.on_response_body(c, eos_last and i == len(chunks) - 1) for i, c in enumerate(chunks)]


# --- before the first delta: retry or fail --------------------------------------------------------------

TINY_CAP = policy_from_mapping({"reprefill_cost_cap": {"max_prompt_tokens": 8}})
THREE = policy_from_mapping({"on_upstream_failure": {"before_first_delta": {"max_attempts": 3}}})
NO_RETRY = policy_from_mapping({"on_upstream_failure": {"before_first_delta": {"action": "fail_request"}}})

FAILURES = [
    AttemptFailed(FailureReason.CONNECTION_LOST, "lost"),
    AttemptFailed(FailureReason.ERROR_EVENT, "error event"),
    AttemptFailed(FailureReason.UPSTREAM_STATUS, "replica answered 503"),
]


@pytest.mark.parametrize(
    ("policy", "prompt", "max_attempts", "retry_allowed", "code"),
    [
        (DEFAULT_POLICY, "hi", 2, True, "retries_exhausted"),
        (THREE, "hi", 3, True, "retries_exhausted"),
        (NO_RETRY, "hi", 1, True, "retries_exhausted"),
        (TINY_CAP, "short", 2, True, "retries_exhausted"),  # 2 estimated tokens: under the cap of 8
        (TINY_CAP, LONG_PROMPT, 1, False, "retry_not_allowed"),  # ~105 estimated tokens: over the cap
        (DEFAULT_POLICY, LONG_PROMPT, 2, True, "retries_exhausted"),
    ],
    ids=[
        "default",
        "three_attempts",
        "fail_request_action",
        "under_cap",
        "over_cap",
        "long_under_default_cap",
    ],
)
def test_failures_before_first_delta(
    policy: Policy, prompt: str, max_attempts: int, retry_allowed: bool, code: str
) -> None:
    request = new_request(policy, prompt)
    assert request.max_attempts == max_attempts
    assert request.retry_allowed is retry_allowed
    assert request.journal_view()["retry_budget"] == max_attempts
    for n in range(1, max_attempts + 1):
        record = request.begin_attempt(f"att-{n}", f"10.0.0.{n}:8000")
        assert record.number == n
        failure = FAILURES[(n - 1) % len(FAILURES)]
        decision = request.on_attempt_failed(record, failure)
        if n < max_attempts:
            assert decision == TriggerRetry(failure.reason.value)
            assert request.phase is Phase.PREFILL
            assert request.journal_view()["retry_budget"] == max_attempts - n
        else:
            assert isinstance(decision, FailRequest)
    assert decision.status == 502
    err = json.loads(decision.body)["error"]
    assert err["code"] == code
    assert err["request_id"] == RID
    assert err["type"] == "gateway_error"
    assert err["partial_output"] is False
    assert err["attempts"] == [
        {
            "attempt": n,
            "attempt_id": f"att-{n}",
            "replica": f"10.0.0.{n}:8000",
            "outcome": "failed",
            "detail": FAILURES[(n - 1) % len(FAILURES)].reason.value,
            "lease": None,
            "fence": None,
        }
        for n in range(1, max_attempts + 1)
    ]
    if code == "retry_not_allowed":
        assert "cost cap" in err["message"]
    assert request.phase is Phase.FAILED
    assert request.outcome == Outcome(code)
    view = request.journal_view()
    assert (view["phase"], view["outcome"], view["attempt"]) == ("failed", code, max_attempts)
    assert (view["first_delta_sent"], view["retry_budget"], view["delivered_output_tokens"]) == (False, 0, 0)
    events = request.drain_events()
    assert [e.name for e in events][-2:] == [EventName.RETRY_REFUSED, EventName.REQUEST_FAILED]
    assert events[-2].detail["reason"] == code
    assert [e.name for e in events].count(EventName.RETRY_TRIGGERED) == max_attempts - 1


def test_attempt_failure_after_first_delta_is_refused() -> None:
    request = new_request()
    record = request.begin_attempt("att-1", "r1")
    request.on_attempt_released(record, first_delta=True)
    request.on_response_headers(200, SSE)
    request.on_response_body(ROLE + C1, False)
    assert request.phase is Phase.DECODE
    with pytest.raises(RuntimeError):
        request.on_attempt_failed(record, FAILURES[0])


# --- a complete stream: every byte once -------------------------------------------------------------

# (transcript, route, where delivered_output_tokens comes from)
COMPLETE = [
    ("chat_stream_usage.sse", RouteKind.CHAT, "usage"),
    ("chat_stream_continuous_usage.sse", RouteKind.CHAT, "usage"),
    ("completions_stream_usage.sse", RouteKind.COMPLETIONS, "usage"),
    ("chat_stream_tool_required.sse", RouteKind.CHAT, "content_events"),
    ("completions_stream.sse", RouteKind.COMPLETIONS, "content_events"),
]


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize(("name", "kind", "source"), COMPLETE, ids=[c[0] for c in COMPLETE])
def test_complete_transcript_forwarded_exactly_once(
    name: str, kind: RouteKind, source: str, seed: int
) -> None:
    data = (REFERENCE / name).read_bytes()
    chunks = [data] if seed == 0 else random_chunks(data, random.Random(f"{name}:{seed}"))
    request = new_request(kind=kind)
    released(request)
    request.on_response_headers(200, SSE)
    decisions = feed(request, chunks)
    assert all(isinstance(d, Forward) for d in decisions)
    assert [d.end_of_stream for d in decisions] == [False] * (len(chunks) - 1) + [True]
    assert b"".join(d.data for d in decisions) == data
    assert request.phase is Phase.COMPLETED
    assert request.outcome is Outcome.COMPLETED
    expected = last_usage(data) if source == "usage" else content_count(data)
    assert expected is not None and expected > 0
    assert request.delivered_output_tokens == expected
    assert request.delivered_tokens_source == source
    view = request.journal_view()
    assert (view["phase"], view["first_delta_sent"], view["delivered_output_tokens"]) == (
        "completed",
        True,
        expected,
    )
    events = request.drain_events()
    assert events[-1].name is EventName.STREAM_COMPLETED
    assert events[-1].detail == {"delivered_output_tokens": expected}


def test_transcript_token_sources_differ_where_it_matters() -> None:
    # chat_stream_usage: 12 content events and usage 12; a stream whose events carry several tokens each
    # must be counted by usage, not by events.
    assert (content_count((REFERENCE / "chat_stream_usage.sse").read_bytes()), 12) == (12, 12)
    request = new_request()
    released(request)
    request.on_response_headers(200, SSE)
    stream = ROLE + C1 + C2 + FINISH + chunk(None, usage=7) + DONE_EVENT
    assert feed(request, [stream]) == [Forward(stream, True)]
    assert (request.delivered_output_tokens, request.delivered_tokens_source) == (7, "usage")


def test_chunk_split_inside_an_event_forwards_only_whole_events() -> None:
    request = new_request()
    released(request)
    request.on_response_headers(200, SSE)
    decisions = feed(request, [ROLE + C1[:20], C1[20:] + C2[:-1], C2[-1:] + FINISH + DONE_EVENT])
    assert decisions == [
        Forward(ROLE, False),
        Forward(C1, False),
        Forward(C2 + FINISH + DONE_EVENT, True),
    ]
    assert (request.phase, request.delivered_output_tokens) == (Phase.COMPLETED, 2)


# (json file, route, completion_tokens)
@pytest.mark.parametrize(
    ("name", "kind"), [("chat.json", RouteKind.CHAT), ("completions.json", RouteKind.COMPLETIONS)]
)
def test_non_streamed_answer(name: str, kind: RouteKind) -> None:
    data = (REFERENCE / name).read_bytes()
    request = new_request(kind=kind, stream=False)
    released(request)
    request.on_response_headers(200, "application/json")
    assert feed(request, [data[:100], data[100:]]) == [Forward(data[:100], False), Forward(data[100:], True)]
    assert (request.phase, request.outcome) == (Phase.COMPLETED, Outcome.COMPLETED)
    assert request.delivered_output_tokens == json.loads(data)["usage"]["completion_tokens"] == 4


# --- after the first delta: the delivered tail, then exactly one terminal frame ---------------------------

# (id, chunks, eos on the last chunk, expected Forward data before the Terminate, Terminate's tail, N)
TERMINATIONS: list[tuple[str, list[bytes], bool, list[bytes], bytes, int]] = [
    ("error_event_own_chunk", [ROLE, C1, C2, ERROR + DONE_EVENT], False, [ROLE, C1, C2], b"", 2),
    ("error_event_same_chunk", [ROLE + C1 + C2 + ERROR + DONE_EVENT], False, [], ROLE + C1 + C2, 2),
    ("error_event_after_keepalive", [ROLE + C1, KEEPALIVE + ERROR], False, [ROLE + C1], KEEPALIVE, 1),
    ("error_event_split", [ROLE + C1, ERROR[:9], ERROR[9:]], False, [ROLE + C1, b""], b"", 1),
    ("engine_dead_transcript", [ROLE + C1 + C2 + C3, ENGINE_DEAD], True, [ROLE + C1 + C2 + C3], b"", 3),
    ("end_without_done_own_chunk", [ROLE, C1, b""], True, [ROLE, C1], b"", 1),
    ("end_without_done_with_events", [ROLE, C1, C2 + FINISH], True, [ROLE, C1], C2 + FINISH, 2),
    ("end_without_done_incomplete_event", [ROLE, C1, C2 + C3[:25]], True, [ROLE, C1], C2, 2),
    ("end_without_done_only_incomplete_event", [ROLE + C1, C2[:-1]], True, [ROLE + C1], b"", 1),
    ("killed_midstream_transcript", [KILLED], True, [], KILLED, 395),
    ("killed_midstream_transcript_plus_fragment", [KILLED + C1[:30]], True, [], KILLED, 395),
    ("abort_own_chunk", [ROLE, C1, ABORT + DONE_EVENT], False, [ROLE, C1], ABORT, 1),
    ("abort_with_content", [ROLE, C1, ABORT_WITH_CONTENT], False, [ROLE, C1], ABORT_WITH_CONTENT, 2),
    ("abort_then_more_in_chunk", [ROLE + C1 + ABORT + C2 + DONE_EVENT], False, [], ROLE + C1 + ABORT, 1),
    (
        "continuous_usage_counts_usage",
        [ROLE + chunk({"content": "ab"}, usage=2), chunk({"content": "cd"}, usage=5) + ERROR],
        False,
        [ROLE + chunk({"content": "ab"}, usage=2)],
        chunk({"content": "cd"}, usage=5),
        5,
    ),
]


@pytest.mark.parametrize(
    ("chunks", "eos", "forwarded", "tail", "n"),
    [t[1:] for t in TERMINATIONS],
    ids=[t[0] for t in TERMINATIONS],
)
def test_terminate_after_first_delta(
    chunks: list[bytes], eos: bool, forwarded: list[bytes], tail: bytes, n: int
) -> None:
    request = new_request()
    released(request)
    request.on_response_headers(200, SSE)
    request.drain_events()
    decisions = feed(request, chunks, eos_last=eos)
    assert decisions[:-1] == [Forward(f, False) for f in forwarded]
    assert isinstance(decisions[-1], Terminate)
    frame = terminal_error_frame(RID, n)
    assert decisions[-1].data == tail + frame
    client = b"".join(d.data for d in decisions)
    # What the client got: a prefix of the attempt's events, exactly one terminal frame, then [DONE].
    got = client_events(client)
    assert got[-1] == "[DONE]" and got.count("[DONE]") == 1
    assert [e for e in got if isinstance(e, dict) and "error" in e] == [got[-2]]
    err = got[-2]["error"]
    assert err == {
        "code": "upstream_decode_interrupted",
        "message": err["message"],
        "request_id": RID,
        "partial_output": True,
        "delivered_output_tokens": n,
        "retryable": False,
    }
    # Invariant 3: the count in the frame and in the journal is what the client actually got.
    usage = last_usage(client)
    assert n == (usage if usage is not None else content_count(client))
    assert request.delivered_output_tokens == n
    assert (request.phase, request.outcome) == (Phase.INTERRUPTED, Outcome.UPSTREAM_DECODE_INTERRUPTED)
    view = request.journal_view()
    assert (view["phase"], view["outcome"], view["delivered_output_tokens"], view["first_delta_sent"]) == (
        "interrupted",
        "upstream_decode_interrupted",
        n,
        True,
    )
    events = request.drain_events()
    assert [e.name for e in events] == [EventName.STREAM_TERMINATED]
    assert events[0].detail["delivered_output_tokens"] == n
    # Nothing after a Terminate is forwarded, whatever the upstream still sends.
    assert request.on_response_body(C3 + DONE_EVENT, False) == Forward(b"", False)
    assert request.on_response_body(C3, True) == Forward(b"", True)
    request.on_downstream_lost(DownstreamLoss.UPSTREAM_RESET)
    assert (request.phase, request.delivered_output_tokens, request.drain_events()) == (
        Phase.INTERRUPTED,
        n,
        [],
    )


def test_error_before_any_content_is_forwarded_not_terminated() -> None:
    # The downstream direction never sees this in practice (the attempt fails first); if it does, the
    # client got no content, so there is nothing to interrupt: no terminal frame is invented.
    request = new_request()
    request.on_response_headers(200, SSE)
    assert feed(request, [ROLE, ENGINE_DEAD]) == [Forward(ROLE, False), Forward(ENGINE_DEAD, True)]
    assert (request.phase, request.delivered_output_tokens) == (Phase.COMPLETED, 0)


def test_empty_generation_completes_with_zero_tokens() -> None:
    request = new_request()
    record = request.begin_attempt("att-1", "r1")
    request.on_attempt_released(record, first_delta=False)
    request.on_response_headers(200, SSE)
    stream = ROLE + FINISH + DONE_EVENT
    assert feed(request, [stream]) == [Forward(stream, True)]
    assert (request.phase, request.first_delta_sent, request.delivered_output_tokens) == (
        Phase.COMPLETED,
        False,
        0,
    )


# --- the client-facing stream is torn down -----------------------------------------------------------


def _in_prefill(request: LogicalRequest) -> None:
    request.begin_attempt("att-1", "r1")


def _in_decode(request: LogicalRequest) -> None:
    released(request)
    request.on_response_headers(200, SSE)
    feed(request, [ROLE + C1 + C2, C3], eos_last=False)


def _completed(request: LogicalRequest) -> None:
    released(request)
    request.on_response_headers(200, SSE)
    feed(request, [ROLE + C1 + FINISH + DONE_EVENT])


def _terminated(request: LogicalRequest) -> None:
    released(request)
    request.on_response_headers(200, SSE)
    feed(request, [ROLE + C1 + ERROR], eos_last=False)


@pytest.mark.parametrize(
    ("setup", "cause", "phase", "outcome", "event", "n"),
    [
        (
            _in_prefill,
            DownstreamLoss.CLIENT_GONE,
            Phase.CANCELLED,
            Outcome.CLIENT_DISCONNECTED,
            EventName.CLIENT_DISCONNECTED,
            0,
        ),
        (
            _in_prefill,
            DownstreamLoss.UPSTREAM_RESET,
            Phase.CANCELLED,
            Outcome.CLIENT_DISCONNECTED,
            EventName.CLIENT_DISCONNECTED,
            0,
        ),
        (
            _in_prefill,
            DownstreamLoss.UNKNOWN,
            Phase.CANCELLED,
            Outcome.CLIENT_DISCONNECTED,
            EventName.CLIENT_DISCONNECTED,
            0,
        ),
        (
            _in_decode,
            DownstreamLoss.CLIENT_GONE,
            Phase.CANCELLED,
            Outcome.CLIENT_DISCONNECTED,
            EventName.CLIENT_DISCONNECTED,
            3,
        ),
        (
            _in_decode,
            DownstreamLoss.UPSTREAM_RESET,
            Phase.INTERRUPTED,
            Outcome.UPSTREAM_DECODE_INTERRUPTED,
            EventName.STREAM_RESET,
            3,
        ),
        (
            _in_decode,
            DownstreamLoss.UNKNOWN,
            Phase.INTERRUPTED,
            Outcome.UPSTREAM_DECODE_INTERRUPTED,
            EventName.STREAM_RESET,
            3,
        ),
        (_completed, DownstreamLoss.CLIENT_GONE, Phase.COMPLETED, Outcome.COMPLETED, None, 1),
        (_completed, DownstreamLoss.UPSTREAM_RESET, Phase.COMPLETED, Outcome.COMPLETED, None, 1),
        (
            _terminated,
            DownstreamLoss.CLIENT_GONE,
            Phase.INTERRUPTED,
            Outcome.UPSTREAM_DECODE_INTERRUPTED,
            None,
            1,
        ),
    ],
    ids=[
        "prefill_client_gone",
        "prefill_upstream_reset",
        "prefill_unknown",
        "decode_client_gone",
        "decode_upstream_reset",
        "decode_unknown",
        "completed_client_gone",
        "completed_upstream_reset",
        "terminated_client_gone",
    ],
)
def test_downstream_lost(
    setup: Any, cause: DownstreamLoss, phase: Phase, outcome: Outcome, event: EventName | None, n: int
) -> None:
    request = new_request()
    setup(request)
    request.drain_events()
    request.on_downstream_lost(cause)
    assert (request.phase, request.outcome, request.delivered_output_tokens) == (phase, outcome, n)
    events = request.drain_events()
    if event is None:
        assert events == []
    else:
        assert [e.name for e in events] == [event]
        assert events[0].detail["delivered_output_tokens"] == n
        if event is EventName.STREAM_RESET:
            assert events[0].detail["cause"] == cause.value
    assert request.journal_view()["retry_budget"] == 0  # a terminal request never starts another attempt


# --- a release that never reached the router ----------------------------------------------------------


def test_released_attempt_reset_before_release_reached_router() -> None:
    request = new_request()
    first = request.begin_attempt("att-1", "r1")
    request.on_attempt_released(first, first_delta=True)
    assert request.first_delta_sent is True
    assert request.journal_view()["first_delta_sent"] is True
    request.drain_events()
    # Envoy retried on its own: the replica reset before our release reached the router.
    second = request.begin_attempt("att-2", "r2")
    assert (first.outcome, first.detail) == ("failed", "lost_before_release")
    assert request.first_delta_sent is False
    assert request.phase is Phase.PREFILL
    events = request.drain_events()
    assert [(e.name, e.attempt) for e in events] == [
        (EventName.ATTEMPT_FAILED, 1),
        (EventName.ATTEMPT_STARTED, 2),
    ]
    assert events[0].detail["reason"] == "lost_before_release"
    view = request.journal_view()
    assert view["first_delta_sent"] is False
    assert [(a["attempt"], a["outcome"], a["detail"]) for a in view["attempts"]] == [
        (1, "failed", "lost_before_release"),
        (2, None, None),
    ]
    # The second attempt then delivers normally.
    request.on_attempt_released(second, first_delta=True)
    request.on_response_headers(200, SSE)
    feed(request, [ROLE + C1 + FINISH + DONE_EVENT])
    assert (request.phase, request.first_delta_sent, request.delivered_output_tokens) == (
        Phase.COMPLETED,
        True,
        1,
    )


def test_unreported_attempt_is_marked_lost_when_the_next_begins() -> None:
    request = new_request()
    first = request.begin_attempt("att-1", "r1")
    request.begin_attempt("att-2", "r2")
    assert (first.outcome, first.detail) == ("failed", "connection_lost")
    assert request.first_delta_sent is False


def test_released_attempt_whose_release_never_reached_the_client() -> None:
    # The replica reset after our release, Envoy answered the client with an error of its own.
    request = new_request()
    first = request.begin_attempt("att-1", "r1")
    request.on_attempt_released(first, first_delta=True)
    request.on_response_headers(503, "text/plain")
    assert feed(request, [b"upstream connect error"]) == [Forward(b"upstream connect error", True)]
    assert (request.phase, request.outcome, request.first_delta_sent) == (
        Phase.FAILED,
        Outcome.UPSTREAM_ERROR,
        False,
    )
    assert (first.outcome, first.detail) == ("failed", "lost_before_release")


# --- the event trace of a whole story ---------------------------------------------------------------


def test_event_names_retry_then_complete() -> None:
    request = new_request()
    first = request.begin_attempt("att-1", "r1")
    assert request.on_attempt_failed(first, FAILURES[0]) == TriggerRetry("connection_lost")
    second = request.begin_attempt("att-2", "r2")
    request.on_attempt_released(second, first_delta=True)
    request.on_response_headers(200, SSE)
    data = (REFERENCE / "chat_stream_usage.sse").read_bytes()
    assert b"".join(d.data for d in feed(request, random_chunks(data, random.Random(1)))) == data
    events = request.drain_events()
    assert [(e.name.value, e.attempt) for e in events] == [
        ("request_accepted", None),
        ("attempt_started", 1),
        ("attempt_failed", 1),
        ("retry_triggered", 1),
        ("attempt_started", 2),
        ("first_delta_sent", 2),
        ("stream_completed", None),
    ]
    assert events[0].detail["retry_allowed"] is True
    assert events[0].detail["route"] == "chat.completions"
    assert events[4].detail == {"attempt_id": "att-2", "replica": "r2"}
    assert events[-1].detail == {"delivered_output_tokens": 12}
    assert request.drain_events() == []
