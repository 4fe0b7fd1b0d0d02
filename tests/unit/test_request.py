"""The logical-request machine (downstream filter): what the client receives.

Either every byte of the one released attempt once, ending in `[DONE]` or in exactly one terminal error frame;
or, when no attempt was released, one JSON error naming the request and why (`ReplaceResponse`, `FailNow`).
Attempts are driven through their own machine and the request's `RetryGate`, as the upstream shell does.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from router_sidecar.core import views
from router_sidecar.core.attempt import (
    Attempt,
    AttemptState,
    FailRequest,
    FailureReason,
    FenceProven,
    Input,
    LivenessLost,
    ResponseBody,
    ResponseHeaders,
    StreamReset,
    Superseded,
    TriggerRetry,
    WriteAheadDone,
)
from router_sidecar.core.events import EventName, Outcome
from router_sidecar.core.openai_api import ParsedRequest, RouteKind, parse_request
from router_sidecar.core.policy import DEFAULT_POLICY, Policy, policy_from_mapping
from router_sidecar.core.request import (
    Admitted,
    AnswerAttempt,
    ArrivalGone,
    AttemptArrived,
    AwaitFence,
    ClaimOutcome,
    ClaimSettled,
    ClaimState,
    ClientStream,
    ContinueRequest,
    DeadlineReached,
    Decision,
    DownstreamLoss,
    DownstreamLost,
    FailNow,
    ForAttempt,
    Forward,
    ForwardAttempt,
    GrantLease,
    LeaseGranted,
    LogicalRequest,
    PassResponse,
    Phase,
    PublisherLost,
    RefuseAttempt,
    ReleaseAttempt,
    ReleaseLease,
    ReplaceResponse,
    ResponseChunk,
    ResponseStarted,
    StartClaim,
    StartDeadline,
    SupersedeAttempt,
    Terminate,
    ToolCallNoted,
    WatchPublisher,
    WriteAheadJournal,
)
from router_sidecar.core.sse import DONE_EVENT, terminal_error_frame

REFERENCE = Path("/work/shared/reference/vllm-0.32-cpu")
SSE = "text/event-stream; charset=utf-8"
JSON = "application/json"
RID = "req-0001"
LONG_PROMPT = "tell me a long story " * 20  # 420 bytes: ~105 estimated tokens


def parsed(prompt: str = "hi", *, kind: RouteKind = RouteKind.CHAT, stream: bool = True) -> ParsedRequest:
    body: dict[str, Any] = {"model": "tiny", "stream": stream, "seed": 7}
    if kind is RouteKind.CHAT:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    return parse_request(kind, json.dumps(body).encode(), max_body_bytes=1 << 20, known_models=None)


def new_request(
    policy: Policy = DEFAULT_POLICY, prompt: str = "hi", *, claimed: bool = True, **kw: Any
) -> LogicalRequest:
    """An admitted request (forwarded); `claimed`: its journal claim came back granted."""
    request = LogicalRequest(request_id=RID, tenant="t1", parsed=parsed(prompt, **kw), policy=policy)
    assert request.handle(Admitted()) == [
        StartClaim(patient=True),
        StartDeadline(policy.deadlines.request_seconds),
        ContinueRequest(),
    ]
    if claimed:
        assert settle_claim(request) == []
    return request


def chunk(
    delta: dict[str, Any] | None = None, *, finish: str | None = None, usage: int | None = None
) -> bytes:
    obj: dict[str, Any] = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "model": "tiny"}
    obj["choices"] = [] if delta is None else [{"index": 0, "delta": delta, "finish_reason": finish}]
    if usage is not None:
        obj["usage"] = {"prompt_tokens": 3, "total_tokens": 3 + usage, "completion_tokens": usage}
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def cr_only(data: bytes) -> bytes:
    return data.replace(b"\n", b"\r")


ROLE = chunk({"role": "assistant", "content": ""})
C1, C2, C3 = chunk({"content": "Hel"}), chunk({"content": "lo"}), chunk({"content": " world"})
FINISH = chunk({}, finish="stop")
ABORT = chunk({}, finish="abort")
ABORT_WITH_CONTENT = chunk({"content": "!"}, finish="abort")
USAGE_2 = chunk(None, usage=2)
ERROR = b'data: {"error": {"message": "boom", "type": "InternalServerError", "param": null, "code": 500}}\n\n'
KEEPALIVE = b": keep-alive\n\n"
ENGINE_DEAD = (REFERENCE / "engine_dead_midstream_error.sse").read_bytes()
KILLED = (REFERENCE / "chat_stream_killed_midstream.sse").read_bytes()


# --- an independent reading of what a client got (json, not the product's scanner) ---------------------


def client_events(data: bytes) -> list[Any]:
    """JSON payloads of `data:` events (or "[DONE]"), LF framing."""
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


# --- the upstream side of the story, through the request machine, as the shells feed it -----------------


def settle_claim(request: LogicalRequest, outcome: ClaimOutcome = ClaimOutcome.GRANTED) -> list[Decision]:
    """The journal claim of the request's id came back (as `Live` feeds it)."""
    return request.handle(ClaimSettled(outcome))


def arrive(request: LogicalRequest, attempt_id: str, replica: str = "r1") -> list[Decision]:
    """Envoy started an attempt: what the request answers its stream (admit, hold, refuse)."""
    return request.handle(AttemptArrived(attempt_id, replica))


def grant(request: LogicalRequest, attempt_id: str) -> list[Decision]:
    return request.handle(LeaseGranted(attempt_id, lease=None, ttl_seconds=10, replica_side=False))


def begin(request: LogicalRequest, attempt_id: str = "att-1", replica: str = "r1") -> Attempt:
    """An attempt admitted and forwarded (its lease granted), its request admitted and its claim settled."""
    if request.client is ClientStream.RECEIVED:
        request.handle(Admitted())
    if request.claim is ClaimState.PENDING:
        settle_claim(request)
    assert arrive(request, attempt_id, replica) == [GrantLease(attempt_id, replica)]
    assert grant(request, attempt_id) == [ForwardAttempt(attempt_id)]
    attempt = request.attempt(attempt_id)
    assert attempt is not None
    return attempt


def fa(request: LogicalRequest, attempt: Attempt, event: Input) -> list[Decision]:
    """An input of one attempt, fed through its request (as the upstream shell and the effects do)."""
    return request.handle(ForAttempt(attempt.attempt_id, event))


def released(
    request: LogicalRequest,
    attempt_id: str = "att-1",
    replica: str = "r1",
    *,
    content: bool = True,
    stream: bool = True,
) -> Attempt:
    """An attempt that wrote ahead and released (at its first delta, or a generation without content)."""
    return release(request, begin(request, attempt_id, replica), content=content, stream=stream)


def release(
    request: LogicalRequest, attempt: Attempt, *, content: bool = True, stream: bool = True
) -> Attempt:
    """A forwarded attempt's response: held, its first delta written ahead, released."""
    attempt_id = attempt.attempt_id
    if stream:
        assert fa(request, attempt, ResponseHeaders(200, SSE)) == []
        body, eos = (ROLE + C1, False) if content else (ROLE + FINISH + DONE_EVENT, True)
    else:
        assert fa(request, attempt, ResponseHeaders(200, JSON)) == []
        body, eos = b"{}", True
    assert fa(request, attempt, ResponseBody(body, eos)) == [WriteAheadJournal(attempt_id)]
    watch = [WatchPublisher(attempt_id)] if content else []
    assert fa(request, attempt, WriteAheadDone()) == [ReleaseAttempt(attempt_id, 1), *watch]
    assert request.publisher is attempt
    return attempt


def failed(request: LogicalRequest, *inputs: Input, attempt_id: str = "att-1") -> TriggerRetry | FailRequest:
    """An attempt that fails; its verdict is given and its closed connection settles its lease."""
    attempt = begin(request, attempt_id)
    for event in inputs or (StreamReset(),):
        fa(request, attempt, event)
    assert attempt.state is AttemptState.DECIDED and attempt.verdict is not None
    fa(request, attempt, FenceProven("connection_closed"))
    assert attempt.fenced
    return attempt.verdict


def started(request: LogicalRequest, status: int = 200, ctype: str = SSE) -> None:
    assert request.handle(ResponseStarted(status, ctype)) == [PassResponse()]


def one(decisions: list[Decision]) -> Decision | None:
    """The client filter's reply to one chunk: at most one decision (None: nothing goes to the client)."""
    assert len(decisions) <= 1, decisions
    return decisions[0] if decisions else None


def feed(request: LogicalRequest, chunks: list[bytes], *, eos_last: bool = True) -> list[Decision | None]:
    return [
        one(request.handle(ResponseChunk(c, eos_last and i == len(chunks) - 1))) for i, c in enumerate(chunks)
    ]


def names(request: LogicalRequest) -> list[str]:
    return [e.name.value for e in request.drain_events()]


# --- before the first delta: retry or fail ------------------------------------------------------------

TINY_CAP = policy_from_mapping({"reprefill_cost_cap": {"max_prompt_tokens": 8}})
THREE = policy_from_mapping({"on_upstream_failure": {"before_first_delta": {"max_attempts": 3}}})
NO_RETRY = policy_from_mapping({"on_upstream_failure": {"before_first_delta": {"action": "fail_request"}}})

FAILURES: list[tuple[Input, ...]] = [
    (StreamReset(),),
    (ResponseHeaders(200, SSE), ResponseBody(ERROR, False)),
    (ResponseHeaders(503, JSON),),
]
FAILURE_REASONS = ["connection_lost", "error_event", "upstream_status"]


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
    assert (request.retry_blocked is None) is retry_allowed
    assert request.drain_events()[0].detail["retry_allowed"] is retry_allowed
    assert views.journal_view(request)["retry_budget"] == max_attempts
    verdict: TriggerRetry | FailRequest | None = None
    for n in range(1, max_attempts + 1):
        verdict = failed(request, *FAILURES[(n - 1) % 3], attempt_id=f"att-{n}")
        if n < max_attempts:
            assert verdict == TriggerRetry(FAILURE_REASONS[(n - 1) % 3])
            assert request.phase is Phase.PREFILL
            assert views.journal_view(request)["retry_budget"] == max_attempts - n
    assert isinstance(verdict, FailRequest)
    assert (verdict.status, verdict.code) == (502, Outcome(code))
    if code == "retry_not_allowed":
        assert "cost cap" in verdict.message
    assert request.phase is Phase.FAILED
    assert request.outcome == Outcome(code)
    assert arrive(request, "att-late") == [RefuseAttempt("att-late", verdict)]
    err = json.loads(views.error_body(request, verdict))["error"]
    assert (err["code"], err["request_id"], err["partial_output"]) == (code, RID, False)
    assert [(a["attempt"], a["outcome"], a["detail"]) for a in err["attempts"]] == [
        (n, "failed", FAILURE_REASONS[(n - 1) % 3]) for n in range(1, max_attempts + 1)
    ]
    view = views.journal_view(request)
    assert (view["phase"], view["outcome"], view["attempt"]) == ("failed", code, max_attempts)
    assert (view["first_delta_sent"], view["retry_budget"], view["delivered_output_tokens"]) == (False, 0, 0)
    events = request.drain_events()
    assert [e.name for e in events][-2:] == [EventName.RETRY_REFUSED, EventName.REQUEST_FAILED]
    assert events[-2].detail["reason"] == code
    assert events[-1].detail == {"outcome": code}
    assert [e.name for e in events].count(EventName.RETRY_TRIGGERED) == max_attempts - 1


def test_released_attempt_cannot_fail_into_a_retry() -> None:
    request = new_request()
    attempt = released(request)
    started(request)
    feed(request, [ROLE + C1], eos_last=False)
    assert request.phase is Phase.DECODE
    assert fa(request, attempt, StreamReset()) == []
    assert fa(request, attempt, LivenessLost("heartbeat_lapsed")) == []
    assert (attempt.state, request.retry_budget, request.first_delta_sent) == (AttemptState.RELEASED, 0, True)


# --- a complete stream: every byte once ----------------------------------------------------------------

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
    started(request)
    decisions = feed(request, chunks)
    forwards = [d for d in decisions if isinstance(d, Forward)]
    assert forwards == decisions
    assert [d.end_of_stream for d in forwards] == [False] * (len(chunks) - 1) + [True]
    assert b"".join(d.data for d in forwards) == data
    assert (request.phase, request.outcome) == (Phase.COMPLETED, Outcome.COMPLETED)
    expected = last_usage(data) if source == "usage" else content_count(data)
    assert expected is not None and expected > 0
    assert (request.delivered_output_tokens, request.delivered_tokens_source) == (expected, source)
    view = views.journal_view(request)
    assert (view["phase"], view["first_delta_sent"], view["delivered_output_tokens"]) == (
        "completed",
        True,
        expected,
    )
    assert view["attempts"][0]["outcome"] == "completed"
    events = request.drain_events()
    assert events[-1].name is EventName.STREAM_COMPLETED
    assert events[-1].detail == {"delivered_output_tokens": expected}
    assert [e.name for e in events].count(EventName.STREAM_TERMINATED) == 0


@pytest.mark.parametrize("seed", range(6))
def test_cr_only_transcript_completes_with_the_replicas_own_done(seed: int) -> None:
    data = cr_only((REFERENCE / "chat_stream_usage.sse").read_bytes())
    assert data.endswith(b"data: [DONE]\r\r")
    chunks = [data] if seed == 0 else random_chunks(data, random.Random(seed))
    request = new_request()
    released(request)
    started(request)
    decisions = feed(request, chunks)
    assert b"".join(d.data for d in decisions if isinstance(d, Forward)) == data  # nothing appended
    assert all(isinstance(d, Forward) for d in decisions)
    assert (request.phase, request.outcome, request.delivered_output_tokens) == (
        Phase.COMPLETED,
        Outcome.COMPLETED,
        12,
    )


def test_cr_only_done_completed_by_the_end_of_stream() -> None:
    # `data: [DONE]\r\r` at the end of a chunk may still be followed by "\n": only the end of stream says.
    data = cr_only(ROLE + C1 + FINISH + DONE_EVENT)
    request = new_request()
    released(request)
    started(request)
    decisions = feed(request, [data, b""])
    assert decisions == [Forward(cr_only(ROLE + C1 + FINISH), False), Forward(b"data: [DONE]\r\r", True)]
    assert request.phase is Phase.COMPLETED


def test_transcript_token_sources_differ_where_it_matters() -> None:
    # chat_stream_usage: 12 content events and usage 12; a stream whose events carry several tokens each
    # must be counted by usage, not by events.
    assert content_count((REFERENCE / "chat_stream_usage.sse").read_bytes()) == 12
    request = new_request()
    released(request)
    started(request)
    stream = ROLE + C1 + C2 + FINISH + chunk(None, usage=7) + DONE_EVENT
    assert feed(request, [stream]) == [Forward(stream, True)]
    assert (request.delivered_output_tokens, request.delivered_tokens_source) == (7, "usage")


def test_chunk_split_inside_an_event_forwards_only_whole_events() -> None:
    request = new_request()
    released(request)
    started(request)
    decisions = feed(request, [ROLE + C1[:20], C1[20:] + C2[:-1], C2[-1:] + FINISH + DONE_EVENT])
    assert decisions == [
        Forward(ROLE, False),
        Forward(C1, False),
        Forward(C2 + FINISH + DONE_EVENT, True),
    ]
    assert (request.phase, request.delivered_output_tokens) == (Phase.COMPLETED, 2)


# A complete answer whose [DONE] is missing (every content event and the finish came, then a clean end):
# forwarded, `data: [DONE]` appended, COMPLETED; no terminal frame.
COMPLETE_WITHOUT_DONE: list[tuple[str, list[bytes], list[Forward], int]] = [
    (
        "finish_in_last_chunk",
        [ROLE, C1, C2 + FINISH],
        [Forward(ROLE, False), Forward(C1, False), Forward(C2 + FINISH + DONE_EVENT, True)],
        2,
    ),
    (
        "finish_and_usage_then_empty_end",
        [ROLE + C1 + C2 + FINISH + USAGE_2, b""],
        [Forward(ROLE + C1 + C2 + FINISH + USAGE_2, False), Forward(DONE_EVENT, True)],
        2,
    ),
    (
        "finish_then_incomplete_event",
        [ROLE + C1 + FINISH, USAGE_2[:20]],
        [Forward(ROLE + C1 + FINISH, False), Forward(DONE_EVENT, True)],
        1,
    ),
]


@pytest.mark.parametrize(
    ("chunks", "expected", "n"),
    [c[1:] for c in COMPLETE_WITHOUT_DONE],
    ids=[c[0] for c in COMPLETE_WITHOUT_DONE],
)
def test_complete_answer_without_done(chunks: list[bytes], expected: list[Forward], n: int) -> None:
    request = new_request()
    released(request)
    started(request)
    request.drain_events()
    assert feed(request, chunks) == expected
    assert (request.phase, request.outcome, request.delivered_output_tokens) == (
        Phase.COMPLETED,
        Outcome.COMPLETED,
        n,
    )
    assert names(request) == ["stream_completed"]


def test_usage_transcript_without_done_is_completed() -> None:
    data = (REFERENCE / "chat_stream_usage.sse").read_bytes()
    assert data.endswith(DONE_EVENT)
    request = new_request()
    released(request)
    started(request)
    decisions = feed(request, random_chunks(data[: -len(DONE_EVENT)], random.Random(3)))
    assert b"".join(d.data for d in decisions if isinstance(d, Forward)) == data
    assert (request.phase, request.delivered_output_tokens) == (Phase.COMPLETED, 12)


def test_bytes_after_done_are_not_forwarded() -> None:
    request = new_request()
    released(request)
    started(request)
    decisions = feed(request, [ROLE + C1 + FINISH + DONE_EVENT + C2, C3 + DONE_EVENT, b""])
    assert decisions == [
        Forward(ROLE + C1 + FINISH + DONE_EVENT, False),  # the end goes with the stream's own (or trailers)
        Forward(b"", False),  # nothing after [DONE] is forwarded
        Forward(b"", True),  # one end of stream, at the stream's end
    ]
    assert (request.phase, request.delivered_output_tokens) == (Phase.COMPLETED, 1)


@pytest.mark.parametrize(
    ("name", "kind"), [("chat.json", RouteKind.CHAT), ("completions.json", RouteKind.COMPLETIONS)]
)
def test_non_streamed_answer(name: str, kind: RouteKind) -> None:
    data = (REFERENCE / name).read_bytes()
    request = new_request(kind=kind, stream=False)
    released(request, stream=False)
    assert request.handle(ResponseStarted(200, JSON)) == [PassResponse()]
    assert request.phase is Phase.DECODE  # delivered whole, as one delta
    assert feed(request, [data[:100], data[100:]]) == [Forward(data[:100], False), Forward(data[100:], True)]
    assert (request.phase, request.outcome) == (Phase.COMPLETED, Outcome.COMPLETED)
    assert request.delivered_output_tokens == json.loads(data)["usage"]["completion_tokens"] == 4
    assert request.delivered_tokens_source == "usage"


@pytest.mark.parametrize("where", ["large_before_usage", "large_after_usage"])
def test_non_stream_usage_from_its_tail_whatever_its_size(where: str) -> None:
    data = (REFERENCE / "chat.json").read_bytes()
    big = b"x" * 400_000
    if where == "large_before_usage":
        data = data.replace(b'"content":" aq syqei ws"', b'"content":"' + big + b'"')
    else:
        data = data.replace(b'"prompt_logprobs":null', b'"prompt_logprobs":"' + big + b'"')
    assert len(data) > 400_000
    request = new_request(stream=False)
    released(request, stream=False)
    assert request.handle(ResponseStarted(200, JSON)) == [PassResponse()]
    chunks = [data[i : i + 16384] for i in range(0, len(data), 16384)]
    decisions = feed(request, chunks)
    assert b"".join(d.data for d in decisions if isinstance(d, Forward)) == data
    assert (request.delivered_output_tokens, request.delivered_tokens_source) == (4, "usage")


def test_non_stream_answer_cut_short_by_the_engine_is_interrupted() -> None:
    # Released as it came (past the hold bound), then the engine says finish_reason "abort": the client has
    # the whole body, which says so itself; the journal must not call it complete.
    data = (
        (REFERENCE / "chat.json")
        .read_bytes()
        .replace(b'"finish_reason":"length"', b'"finish_reason":"abort"')
    )
    assert b'"abort"' in data
    request = new_request(stream=False)
    released(request, stream=False)
    assert request.handle(ResponseStarted(200, JSON)) == [PassResponse()]
    request.drain_events()
    chunks = [data[:200], data[200:]]
    assert feed(request, chunks) == [Forward(chunks[0], False), Forward(chunks[1], True)]
    assert (request.phase, request.outcome) == (Phase.INTERRUPTED, Outcome.UPSTREAM_DECODE_INTERRUPTED)
    assert request.delivered_output_tokens == 4
    assert names(request) == ["stream_terminated"]


# --- after the first delta: the delivered tail, then exactly one terminal frame ---------------------------

# (id, chunks, eos on the last chunk, expected Forward data before the Terminate, Terminate's tail, N)
TERMINATIONS: list[tuple[str, list[bytes], bool, list[bytes], bytes, int]] = [
    ("error_event_own_chunk", [ROLE, C1, C2, ERROR + DONE_EVENT], False, [ROLE, C1, C2], b"", 2),
    ("error_event_same_chunk", [ROLE + C1 + C2 + ERROR + DONE_EVENT], False, [], ROLE + C1 + C2, 2),
    ("error_event_after_keepalive", [ROLE + C1, KEEPALIVE + ERROR], False, [ROLE + C1], KEEPALIVE, 1),
    ("error_event_split", [ROLE + C1, ERROR[:9], ERROR[9:]], False, [ROLE + C1, b""], b"", 1),
    ("engine_dead_transcript", [ROLE + C1 + C2 + C3, ENGINE_DEAD], True, [ROLE + C1 + C2 + C3], b"", 3),
    ("end_without_done_own_chunk", [ROLE, C1, b""], True, [ROLE, C1], b"", 1),
    ("end_without_done_with_events", [ROLE, C1, C2 + C3], True, [ROLE, C1], C2 + C3, 3),
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


def check_one_terminal_frame(client: bytes, n: int) -> dict[str, Any]:
    """What the client got: a prefix of one attempt's events, exactly one terminal frame, then [DONE]."""
    got = client_events(client)
    assert got[-1] == "[DONE]" and got.count("[DONE]") == 1
    assert [e for e in got if isinstance(e, dict) and "error" in e] == [got[-2]]
    err: dict[str, Any] = got[-2]["error"]
    assert err == {
        "code": "upstream_decode_interrupted",
        "message": err["message"],
        "request_id": RID,
        "partial_output": True,
        "delivered_output_tokens": n,
        "retryable": False,
    }
    # Invariant 3: the count in the frame is what the client actually got.
    usage = last_usage(client)
    assert n == (usage if usage is not None else content_count(client))
    return err


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
    started(request)
    request.drain_events()
    decisions = feed(request, chunks, eos_last=eos)
    assert decisions[:-1] == [Forward(f, False) for f in forwarded]
    last = decisions[-1]
    assert isinstance(last, Terminate)
    assert last.data.startswith(tail)
    err = check_one_terminal_frame(b"".join(f for f in forwarded) + last.data, n)
    assert last.data == tail + terminal_error_frame(RID, n, err["message"])
    assert request.delivered_output_tokens == n
    assert (request.phase, request.outcome) == (Phase.INTERRUPTED, Outcome.UPSTREAM_DECODE_INTERRUPTED)
    view = views.journal_view(request)
    assert (view["phase"], view["outcome"], view["delivered_output_tokens"], view["first_delta_sent"]) == (
        "interrupted",
        "upstream_decode_interrupted",
        n,
        True,
    )
    assert view["attempts"][0]["outcome"] == "interrupted"
    events = request.drain_events()
    assert [e.name for e in events] == [EventName.STREAM_TERMINATED]
    assert events[0].detail["delivered_output_tokens"] == n
    # Nothing after a Terminate is forwarded, whatever the upstream still sends.
    assert request.handle(ResponseChunk(C3 + DONE_EVENT, False)) == []
    assert request.handle(ResponseChunk(C3, True)) == []  # our end went out: no second one
    assert request.handle(DeadlineReached()) == []
    # A loss noted after the end only lets the lease go (once).
    assert request.handle(PublisherLost("heartbeat_lapsed")) == [ReleaseLease("att-1", None)]
    request.handle(DownstreamLost(DownstreamLoss.UPSTREAM_RESET))
    assert (request.phase, request.delivered_output_tokens, request.drain_events()) == (
        Phase.INTERRUPTED,
        n,
        [],
    )


def test_oversized_event_after_the_first_delta() -> None:
    policy = policy_from_mapping({"limits": {"max_event_bytes": 4096}})
    request = new_request(policy)
    released(request)
    started(request)
    request.drain_events()
    huge = b'data: {"choices":[{"index":0,"delta":{"content":"' + b"a" * 5000
    decisions = feed(request, [ROLE + C1, C2 + huge, b"a" * 100 + b'"}}]}\n\n'], eos_last=False)
    assert decisions[0] == Forward(ROLE + C1, False)
    last = decisions[1]
    assert isinstance(last, Terminate)
    assert last.data.startswith(C2)
    err = check_one_terminal_frame(ROLE + C1 + last.data, 2)  # C1 and C2 went out
    assert "limits.max_event_bytes" in err["message"]
    assert decisions[2] is None
    assert (request.phase, request.outcome) == (Phase.INTERRUPTED, Outcome.UPSTREAM_DECODE_INTERRUPTED)
    assert names(request) == ["stream_terminated"]


# --- no attempt was released: Envoy's own answer is replaced by ours -------------------------------------


def _one_retry_refused(request: LogicalRequest) -> None:
    assert failed(request, ResponseHeaders(503, JSON)) == TriggerRetry("upstream_status")


def _one_held(request: LogicalRequest) -> None:
    fa(request, begin(request), ResponseHeaders(200, SSE))


def _none(request: LogicalRequest) -> None:
    pass


# (id, setup, flags, Envoy's code details, no_compatible_replica, status, code). "via_upstream": our own 503
# (TriggerRetry) came back because Envoy made no retry; anything else: Envoy answered itself.
_VIA = "via_upstream"
_RESET_DETAILS = "upstream_reset_before_response_started{connection_failure}"
ENVOY_ANSWERS: list[tuple[str, Callable[[LogicalRequest], None], set[str], str, str | None, int, Outcome]] = [
    ("UO_retry_budget", _one_retry_refused, {"UO"}, _VIA, None, 503, Outcome.RETRY_BUDGET_EXHAUSTED),
    ("UO_with_URX", _one_retry_refused, {"UO", "URX"}, _VIA, None, 503, Outcome.RETRY_BUDGET_EXHAUSTED),
    ("UT_deadline", _one_held, {"UT"}, "response_timeout", None, 504, Outcome.DEADLINE_EXCEEDED),
    ("UT_before_any_attempt", _none, {"UT"}, "response_timeout", None, 504, Outcome.DEADLINE_EXCEEDED),
    (
        "UH_no_compatible",
        _one_retry_refused,
        {"UH"},
        "no_healthy_upstream",
        "group gone",
        503,
        Outcome.NO_COMPATIBLE_REPLICA,
    ),
    (
        "UH_no_replica",
        _one_retry_refused,
        {"UH"},
        "no_healthy_upstream",
        None,
        503,
        Outcome.NO_REPLICA_AVAILABLE,
    ),
    ("NR_no_compatible", _none, {"NR"}, "route_not_found", "group gone", 503, Outcome.NO_COMPATIBLE_REPLICA),
    ("NR_no_replica", _none, {"NR"}, "route_not_found", None, 503, Outcome.NO_REPLICA_AVAILABLE),
    ("URX_with_attempts", _one_retry_refused, {"URX"}, _VIA, None, 502, Outcome.RETRIES_EXHAUSTED),
    (
        "UF_with_attempts",
        _one_retry_refused,
        {"UF", "URX"},
        _RESET_DETAILS,
        None,
        502,
        Outcome.RETRIES_EXHAUSTED,
    ),
    ("UC_with_attempts", _one_held, {"UC"}, _RESET_DETAILS, None, 502, Outcome.RETRIES_EXHAUSTED),
    ("URX_no_attempts", _none, {"URX"}, _RESET_DETAILS, None, 503, Outcome.NO_REPLICA_AVAILABLE),
    ("UF_no_attempts", _none, {"UF"}, _RESET_DETAILS, None, 503, Outcome.NO_REPLICA_AVAILABLE),
    ("no_flags_no_attempts", _none, set(), "", None, 503, Outcome.NO_REPLICA_AVAILABLE),
]


@pytest.mark.parametrize(
    ("setup", "flags", "details", "why", "status", "code"),
    [e[1:] for e in ENVOY_ANSWERS],
    ids=[e[0] for e in ENVOY_ANSWERS],
)
def test_response_of_no_released_attempt_is_replaced(
    setup: Callable[[LogicalRequest], None],
    flags: set[str],
    details: str,
    why: str | None,
    status: int,
    code: Outcome,
) -> None:
    request = new_request()
    setup(request)
    request.drain_events()
    attempts = len(request.attempts)
    started_ = ResponseStarted(503, "text/plain", frozenset(flags), details, no_compatible_replica=why)
    [decision] = request.handle(started_)
    assert isinstance(decision, ReplaceResponse) and isinstance(decision.error, FailRequest)
    verdict = decision.error
    assert (verdict.status, verdict.code) == (status, code)
    assert f"response flags {','.join(sorted(flags)) or 'none'}" in verdict.message
    if why is not None:
        assert why in verdict.message
    # The response it starts never reaches the client: every chunk is dropped.
    assert (
        feed(request, [b"upstream connect error or disconnect/reset before headers", b"", ERROR])
        == [None] * 3
    )
    assert (request.phase, request.outcome) == (Phase.FAILED, code)
    assert request.final is verdict
    assert arrive(request, "att-late") == [RefuseAttempt("att-late", verdict)]
    events = request.drain_events()
    assert [e.name for e in events] == [
        EventName.RESPONSE_REPLACED,
        EventName.RETRY_REFUSED,
        EventName.REQUEST_FAILED,
    ]
    assert events[0].attempt == (attempts or None)
    assert events[0].detail == {"status": 503, "response_flags": sorted(flags), "details": details}
    refused = {"reason": code.value}
    if code is Outcome.NO_COMPATIBLE_REPLICA:
        refused["detail"] = verdict.detail  # what differs, as the client's message says
        assert verdict.detail and verdict.detail in verdict.message
    assert events[1].detail == refused
    assert events[2].detail == {"outcome": code.value}
    body = json.loads(views.error_body(request, verdict))["error"]
    assert (body["code"], body["request_id"], body["partial_output"]) == (code.value, RID, False)
    # Later inputs change nothing.
    assert request.handle(DeadlineReached()) == []
    request.handle(DownstreamLost(DownstreamLoss.CLIENT_GONE))
    assert (request.phase, request.outcome, request.drain_events()) == (Phase.FAILED, code, [])


@pytest.mark.parametrize("details", ["", "via_upstream", "ext_proc_immediate_response"])
def test_our_own_error_from_the_upstream_filter(details: str) -> None:
    # The gate refused: the upstream filter answered the client with our error. Whether it passes or is
    # replaced, the client gets the request's one final error, and only once.
    request = new_request(NO_RETRY)
    verdict = failed(request, ResponseHeaders(503, JSON))
    assert isinstance(verdict, FailRequest) and request.phase is Phase.FAILED
    request.drain_events()
    [decision] = request.handle(ResponseStarted(502, JSON, details=details))
    body = views.error_body(request, verdict)
    if isinstance(decision, ReplaceResponse):
        assert decision.error is verdict
        assert feed(request, [body]) == [None]
    else:
        assert decision == PassResponse()
        assert feed(request, [body]) == [Forward(body, True)]
    assert (request.phase, request.outcome) == (Phase.FAILED, Outcome.RETRIES_EXHAUSTED)
    assert [e.name for e in request.drain_events()].count(EventName.REQUEST_FAILED) == 0


def test_released_attempt_whose_release_never_reached_the_client() -> None:
    # The replica reset after our release, before it reached the router; Envoy answered the client itself.
    # Invariant 8: never Envoy's raw error; one JSON error naming the request, and nothing was delivered.
    request = new_request()
    first = released(request)
    request.drain_events()
    decisions = request.handle(ResponseStarted(503, "text/plain", frozenset({"UC"}), _RESET_DETAILS))
    # Its lease settles: the closed connection fences it (nothing of it reached the client).
    assert decisions[1:] == [ReleaseLease(first.attempt_id, "connection_closed")]
    decision = decisions[0]
    assert isinstance(decision, ReplaceResponse) and isinstance(decision.error, FailRequest)
    assert (decision.error.status, decision.error.code) == (502, Outcome.RETRIES_EXHAUSTED)
    assert feed(request, [b"upstream connect error or disconnect/reset before headers"]) == [None]
    assert (request.phase, request.outcome) == (Phase.FAILED, Outcome.RETRIES_EXHAUSTED)
    # It gets the request's own error as its verdict (nothing to answer: its stream is gone).
    assert (first.state, first.failure) == (AttemptState.DECIDED, FailureReason.LOST_BEFORE_RELEASE)
    assert first.verdict is decision.error
    assert request.first_delta_sent is False
    assert request.publisher is None
    view = views.journal_view(request)
    assert (view["first_delta_sent"], view["attempts"][0]["outcome"]) == (False, "failed")
    assert [e.name.value for e in request.drain_events()] == [
        "attempt_failed",
        "response_replaced",
        "retry_refused",
        "request_failed",
    ]


def test_attempt_writing_ahead_when_envoy_answered_itself_is_never_released() -> None:
    # The replica reset while the write-ahead of its first delta was under way (seen in CI's fault suite):
    # Envoy answered the client itself. The write-ahead finishing afterwards must not release that attempt,
    # or the journal would say first_delta_sent although the client got only the JSON error.
    request = new_request()
    attempt = begin(request, "att-1", "r1")
    assert fa(request, attempt, ResponseHeaders(200, SSE)) == []
    assert fa(request, attempt, ResponseBody(ROLE + C1, False)) == [WriteAheadJournal("att-1")]
    assert request.first_delta_sent is True  # the write-ahead says it may have been delivered
    request.drain_events()
    details = "upstream_reset_before_response_started{protocol_error}"
    decisions = request.handle(ResponseStarted(502, "text/plain", frozenset({"UPE", "URX"}), details))
    assert isinstance(decisions[0], ReplaceResponse)
    assert decisions[1:] == [ReleaseLease("att-1", "connection_closed")]
    assert attempt.state in (AttemptState.FAILED, AttemptState.DECIDED)
    assert attempt.failure is FailureReason.LOST_BEFORE_RELEASE
    assert (request.first_delta_sent, request.phase) == (False, Phase.FAILED)
    # The write-ahead finishing now releases nothing: the attempt is no longer writing ahead.
    assert fa(request, attempt, WriteAheadDone()) == []
    assert (request.first_delta_sent, request.publisher) == (False, None)
    assert views.journal_view(request)["first_delta_sent"] is False


def test_passed_through_3xx_is_forwarded_as_is() -> None:
    request = new_request()
    attempt = begin(request)
    assert fa(request, attempt, ResponseHeaders(307, JSON)) == [ReleaseAttempt(attempt.attempt_id, 0)]
    assert request.handle(ResponseStarted(307, JSON)) == [PassResponse()]
    body = (REFERENCE / "err_bad_json.txt").read_bytes()
    assert feed(request, [body]) == [Forward(body, True)]
    assert request.phase is Phase.FAILED
    assert request.first_delta_sent is False


# --- the gateway's own deadline ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "setup", [_none, _one_held, _one_retry_refused], ids=["no_attempt", "held", "retrying"]
)
def test_deadline_before_any_response(setup: Callable[[LogicalRequest], None]) -> None:
    request = new_request()
    setup(request)
    request.drain_events()
    [decision] = request.handle(DeadlineReached())
    assert isinstance(decision, FailNow) and isinstance(decision.error, FailRequest)
    assert (decision.error.status, decision.error.code) == (504, Outcome.DEADLINE_EXCEEDED)
    assert "deadlines.request_seconds" in decision.error.message
    assert (request.phase, request.outcome) == (Phase.FAILED, Outcome.DEADLINE_EXCEEDED)
    assert arrive(request, "att-late") == [RefuseAttempt("att-late", decision.error)]
    assert names(request) == ["retry_refused", "request_failed"]
    assert request.handle(DeadlineReached()) == []


def test_deadline_after_the_first_delta() -> None:
    request = new_request()
    released(request)
    started(request)
    assert feed(request, [ROLE + C1, C2], eos_last=False) == [Forward(ROLE + C1, False), Forward(C2, False)]
    request.drain_events()
    [decision] = request.handle(DeadlineReached())
    assert isinstance(decision, Terminate)
    err = check_one_terminal_frame(ROLE + C1 + C2 + decision.data, 2)
    assert "deadlines.request_seconds = 300 s" in err["message"]
    assert decision.data == terminal_error_frame(RID, 2, err["message"])
    assert (request.phase, request.outcome) == (Phase.INTERRUPTED, Outcome.DEADLINE_EXCEEDED)
    events = request.drain_events()
    assert [e.name for e in events] == [EventName.STREAM_TERMINATED]
    assert events[0].detail["delivered_output_tokens"] == 2
    assert feed(request, [C3 + FINISH + DONE_EVENT]) == [None]
    assert request.outcome is Outcome.DEADLINE_EXCEEDED


def test_deadline_after_the_end() -> None:
    request = new_request()
    released(request)
    started(request)
    feed(request, [ROLE + C1 + FINISH + DONE_EVENT])
    request.drain_events()
    assert request.handle(DeadlineReached()) == []
    assert (request.phase, request.outcome, request.drain_events()) == (
        Phase.COMPLETED,
        Outcome.COMPLETED,
        [],
    )


# --- the publisher lost its right to publish ------------------------------------------------------------


@pytest.mark.parametrize("cause", ["heartbeat_lapsed", "progress_gap", "lease_lost"])
def test_publisher_lost_after_the_first_delta(cause: str) -> None:
    request = new_request()
    released(request)
    started(request)
    feed(request, [ROLE + C1], eos_last=False)
    request.drain_events()
    # No retry follows: its lease is let go at once (no proof to wait for), and the stream ends.
    revoke, decision = request.handle(PublisherLost(cause))
    assert revoke == ReleaseLease("att-1", None)
    assert isinstance(decision, Terminate)
    err = check_one_terminal_frame(ROLE + C1 + decision.data, 1)
    assert {"heartbeat_lapsed": "heartbeat", "progress_gap": "stopped arriving", "lease_lost": "lease"}[
        cause
    ] in (err["message"])
    assert (request.phase, request.outcome) == (Phase.INTERRUPTED, Outcome.UPSTREAM_DECODE_INTERRUPTED)
    events = request.drain_events()
    assert [(e.name, e.attempt) for e in events] == [
        (EventName.REPLICA_LOST, 1),
        (EventName.STREAM_TERMINATED, None),
    ]
    assert events[0].detail == {"cause": cause}
    assert request.handle(ResponseChunk(C2, False)) == []


def test_publisher_lost_before_the_first_delta_or_after_the_end() -> None:
    request = new_request()
    begin(request)
    assert request.handle(PublisherLost("heartbeat_lapsed")) == []
    assert request.phase is Phase.PREFILL
    done = new_request()
    released(done)
    started(done)
    feed(done, [ROLE + C1 + FINISH + DONE_EVENT])
    done.drain_events()
    assert done.handle(PublisherLost("heartbeat_lapsed")) == [ReleaseLease("att-1", None)]
    assert done.handle(PublisherLost("lease_lost")) == []  # let go once
    assert (done.phase, done.drain_events()) == (Phase.COMPLETED, [])


@pytest.mark.parametrize("headers_first", [False, True])
def test_publisher_lost_while_its_release_is_on_its_way(headers_first: bool) -> None:
    """Lost after the release, before its first content passed the downstream filter (its headers may not
    have reached it either): nothing can be written to the client yet, and the content must not be
    dropped unanswered (the stream would hang). The stream ends right after the chunk that brings it."""
    request = new_request()
    released(request)
    if headers_first:
        started(request)
    request.drain_events()
    assert request.handle(PublisherLost("heartbeat_lapsed")) == [ReleaseLease("att-1", None)]
    assert request.handle(PublisherLost("lease_lost")) == []  # noted once
    assert request.phase is Phase.PREFILL
    if not headers_first:
        started(request)
    assert request.handle(ResponseChunk(ROLE, False)) == [Forward(ROLE, False)]  # no content yet
    [decision] = request.handle(ResponseChunk(C1 + C2, False))
    assert isinstance(decision, Terminate)
    err = check_one_terminal_frame(ROLE + decision.data, 2)
    assert "heartbeat" in err["message"]
    assert (request.phase, request.outcome, request.first_delta_sent) == (
        Phase.INTERRUPTED,
        Outcome.UPSTREAM_DECODE_INTERRUPTED,
        True,
    )
    assert [(e.name, e.attempt) for e in request.drain_events()] == [
        (EventName.REPLICA_LOST, 1),
        (EventName.STREAM_TERMINATED, None),
    ]
    assert request.handle(ResponseChunk(C3 + DONE_EVENT, True)) == []


def test_a_loss_noted_for_one_attempt_never_ends_a_later_attempts_stream() -> None:
    """Attempt 1 released, then lost before its content passed here; Envoy retried anyway (the release never
    reached its router): attempt 2 publishes, and the note about attempt 1 must not cut it."""
    request = new_request()
    first = released(request)
    request.handle(PublisherLost("heartbeat_lapsed"))
    # Envoy started attempt 2: the release never reached it.
    assert arrive(request, "att-2", "r2") == [SupersedeAttempt("att-1")]
    superseded = fa(request, first, Superseded())
    assert superseded == [ReleaseLease("att-1", "connection_closed"), AwaitFence("att-1", 15)]
    assert fa(request, first, FenceProven("connection_closed")) == [GrantLease("att-2", "r2")]
    assert grant(request, "att-2") == [ForwardAttempt("att-2")]
    second = request.attempt("att-2")
    assert second is not None
    release(request, second)
    started(request)
    whole = ROLE + C1 + C2 + FINISH + DONE_EVENT
    assert request.handle(ResponseChunk(whole, True)) == [Forward(whole, True)]
    assert (request.phase, request.delivered_output_tokens) == (Phase.COMPLETED, 2)


def test_publisher_lost_while_its_whole_answer_is_on_its_way() -> None:
    """The replica had sent everything before it was lost: the whole answer is delivered."""
    request = new_request()
    released(request)
    request.handle(PublisherLost("heartbeat_lapsed"))
    started(request)
    whole = ROLE + C1 + FINISH + DONE_EVENT
    assert request.handle(ResponseChunk(whole, True)) == [Forward(whole, True)]
    assert (request.phase, request.outcome, request.delivered_output_tokens) == (
        Phase.COMPLETED,
        Outcome.COMPLETED,
        1,
    )


# --- a generation without content -----------------------------------------------------------------------


def test_empty_generation_completes_with_zero_tokens() -> None:
    request = new_request()
    released(request, content=False)
    assert request.first_delta_sent is False
    started(request)
    stream = ROLE + FINISH + DONE_EVENT
    assert feed(request, [stream]) == [Forward(stream, True)]
    assert (request.phase, request.first_delta_sent, request.delivered_output_tokens) == (
        Phase.COMPLETED,
        False,
        0,
    )


# --- the client-facing stream is torn down -----------------------------------------------------------


def _in_prefill(request: LogicalRequest) -> None:
    begin(request)


def _in_decode(request: LogicalRequest) -> None:
    released(request)
    started(request)
    feed(request, [ROLE + C1 + C2, C3], eos_last=False)


def _completed(request: LogicalRequest) -> None:
    released(request)
    started(request)
    feed(request, [ROLE + C1 + FINISH + DONE_EVENT])


def _terminated(request: LogicalRequest) -> None:
    released(request)
    started(request)
    feed(request, [ROLE + C1 + ERROR], eos_last=False)


_CANCELLED = (Phase.CANCELLED, Outcome.CLIENT_DISCONNECTED, EventName.CLIENT_DISCONNECTED)
_STREAM_RESET = (Phase.INTERRUPTED, Outcome.UPSTREAM_DECODE_INTERRUPTED, EventName.STREAM_RESET)
DOWNSTREAM_LOST: list[tuple[str, Callable[[LogicalRequest], None], DownstreamLoss, tuple[Any, ...], int]] = [
    ("prefill_client_gone", _in_prefill, DownstreamLoss.CLIENT_GONE, _CANCELLED, 0),
    (
        "prefill_upstream_reset",  # the real cause: the upstream's, not the client's
        _in_prefill,
        DownstreamLoss.UPSTREAM_RESET,
        (Phase.FAILED, Outcome.UPSTREAM_ERROR, EventName.STREAM_RESET),
        0,
    ),
    ("prefill_unknown", _in_prefill, DownstreamLoss.UNKNOWN, _CANCELLED, 0),
    ("decode_client_gone", _in_decode, DownstreamLoss.CLIENT_GONE, _CANCELLED, 3),
    ("decode_upstream_reset", _in_decode, DownstreamLoss.UPSTREAM_RESET, _STREAM_RESET, 3),
    ("decode_unknown", _in_decode, DownstreamLoss.UNKNOWN, _STREAM_RESET, 3),
    (
        "decode_envoy_deadline",
        _in_decode,
        DownstreamLoss.DEADLINE,
        (Phase.INTERRUPTED, Outcome.DEADLINE_EXCEEDED, EventName.STREAM_RESET),
        3,
    ),
    (
        "prefill_envoy_exited",
        _in_prefill,
        DownstreamLoss.ENVOY_EXITED,
        (Phase.FAILED, Outcome.ENVOY_EXITED, EventName.STREAM_RESET),
        0,
    ),
    (
        "decode_envoy_exited",
        _in_decode,
        DownstreamLoss.ENVOY_EXITED,
        (Phase.INTERRUPTED, Outcome.ENVOY_EXITED, EventName.STREAM_RESET),
        3,
    ),
    (
        "completed_client_gone",
        _completed,
        DownstreamLoss.CLIENT_GONE,
        (Phase.COMPLETED, Outcome.COMPLETED, None),
        1,
    ),
    (
        "completed_upstream_reset",
        _completed,
        DownstreamLoss.UPSTREAM_RESET,
        (Phase.COMPLETED, Outcome.COMPLETED, None),
        1,
    ),
    (
        "terminated_client_gone",
        _terminated,
        DownstreamLoss.CLIENT_GONE,
        (Phase.INTERRUPTED, Outcome.UPSTREAM_DECODE_INTERRUPTED, None),
        1,
    ),
]


@pytest.mark.parametrize(
    ("setup", "cause", "expected", "n"), [d[1:] for d in DOWNSTREAM_LOST], ids=[d[0] for d in DOWNSTREAM_LOST]
)
def test_downstream_lost(
    setup: Callable[[LogicalRequest], None], cause: DownstreamLoss, expected: tuple[Any, ...], n: int
) -> None:
    phase, outcome, event = expected
    request = new_request()
    setup(request)
    request.drain_events()
    assert request.handle(DownstreamLost(cause)) == []
    assert (request.phase, request.outcome, request.delivered_output_tokens) == (phase, outcome, n)
    events = request.drain_events()
    if event is None:
        assert events == []
    else:
        failed = [EventName.REQUEST_FAILED] if phase is Phase.FAILED else []
        assert [e.name for e in events] == [event, *failed]
        assert events[0].detail["delivered_output_tokens"] == n
        if event is EventName.STREAM_RESET:
            assert events[0].detail["cause"] == cause.value
    assert request.retry_budget == 0  # a terminal request never starts another attempt
    assert views.journal_view(request)["retry_budget"] == 0


@pytest.mark.parametrize("release", [False, True], ids=["writing_ahead", "released"])
def test_upstream_reset_before_any_headers_reached_the_client(release: bool) -> None:
    # Envoy answered the client itself (a reset it does not retry) while our release was on its way.
    request = new_request()
    attempt = begin(request)
    fa(request, attempt, ResponseHeaders(200, SSE))
    fa(request, attempt, ResponseBody(ROLE + C1, False))
    if release:
        fa(request, attempt, WriteAheadDone())
    assert request.first_delta_sent is True
    request.drain_events()
    # Its lease settles (the closed connection fences it); the request is over, so no verdict is asked.
    lost = request.handle(DownstreamLost(DownstreamLoss.UPSTREAM_RESET))
    assert lost == [ReleaseLease("att-1", "connection_closed")]
    assert (request.phase, request.outcome) == (Phase.FAILED, Outcome.UPSTREAM_ERROR)
    assert (attempt.state, attempt.failure) == (AttemptState.FAILED, FailureReason.LOST_BEFORE_RELEASE)
    assert request.first_delta_sent is False  # nothing of it reached the client: the id may be re-run
    events = request.drain_events()
    assert [e.name for e in events] == [
        EventName.ATTEMPT_FAILED,
        EventName.STREAM_RESET,
        EventName.REQUEST_FAILED,
    ]
    assert events[1].detail == {"cause": "upstream_reset", "delivered_output_tokens": 0}


# --- a release that never reached the router: Envoy retried on its own ------------------------------------


def test_released_attempt_superseded_before_its_release_reached_the_router() -> None:
    request = new_request()
    first = released(request)
    assert request.first_delta_sent is True
    assert views.journal_view(request)["first_delta_sent"] is True
    request.drain_events()
    assert arrive(request, "att-2", "r2") == [SupersedeAttempt("att-1")]
    decisions = fa(request, first, Superseded())
    # Its lease settles on the closed connection; the next attempt waits for that proof.
    assert decisions == [ReleaseLease("att-1", "connection_closed"), AwaitFence("att-1", 15)]
    assert (first.state, first.failure) == (AttemptState.DECIDED, FailureReason.LOST_BEFORE_RELEASE)
    assert first.verdict == TriggerRetry("lost_before_release")
    assert request.first_delta_sent is False
    assert request.publisher is None
    assert request.phase is Phase.PREFILL
    assert fa(request, first, FenceProven("connection_closed")) == [GrantLease("att-2", "r2")]
    assert grant(request, "att-2") == [ForwardAttempt("att-2")]
    second = request.attempt("att-2")
    assert second is not None
    events = request.drain_events()
    assert [(e.name, e.attempt) for e in events] == [
        (EventName.ATTEMPT_FAILED, 1),
        (EventName.RETRY_TRIGGERED, 1),
        (EventName.ATTEMPT_STARTED, 2),
    ]
    assert events[0].detail["reason"] == "lost_before_release"
    view = views.journal_view(request)
    assert view["first_delta_sent"] is False
    assert [(a["attempt"], a["outcome"], a["detail"]) for a in view["attempts"]] == [
        (1, "failed", "lost_before_release"),
        (2, "awaiting_headers", None),
    ]
    # The second attempt then delivers normally.
    release(request, second)
    started(request)
    feed(request, [ROLE + C1 + FINISH + DONE_EVENT])
    assert (request.phase, request.first_delta_sent, request.delivered_output_tokens) == (
        Phase.COMPLETED,
        True,
        1,
    )


def test_unreported_attempt_is_marked_lost_when_the_next_begins() -> None:
    request = new_request()
    first = begin(request)
    assert arrive(request, "att-2", "r2") == [SupersedeAttempt("att-1")]
    assert fa(request, first, Superseded()) == [
        ReleaseLease("att-1", "connection_closed"),
        AwaitFence("att-1", 15),
    ]
    assert (first.state, first.failure) == (AttemptState.DECIDED, FailureReason.CONNECTION_LOST)
    assert request.first_delta_sent is False


# --- first_delta_sent is derived ---------------------------------------------------------------------

# (id, attempt inputs after begin, first_delta_sent)
FIRST_DELTA: list[tuple[str, list[Input], bool]] = [
    ("awaiting_headers", [], False),
    ("holding", [ResponseHeaders(200, SSE), ResponseBody(ROLE, False)], False),
    ("writing_ahead", [ResponseHeaders(200, SSE), ResponseBody(C1, False)], True),
    ("writing_ahead_reset", [ResponseHeaders(200, SSE), ResponseBody(C1, False), StreamReset()], False),
    (
        "writing_ahead_fenced",
        [ResponseHeaders(200, SSE), ResponseBody(C1, False), LivenessLost("lease_lost")],
        False,
    ),
    ("released", [ResponseHeaders(200, SSE), ResponseBody(C1, False), WriteAheadDone()], True),
    (
        "released_superseded",
        [ResponseHeaders(200, SSE), ResponseBody(C1, False), WriteAheadDone(), Superseded()],
        False,
    ),
    (
        "empty_generation_writing_ahead",
        [ResponseHeaders(200, SSE), ResponseBody(FINISH + DONE_EVENT, True)],
        False,
    ),
    (
        "empty_generation_released",
        [ResponseHeaders(200, SSE), ResponseBody(FINISH + DONE_EVENT, True), WriteAheadDone()],
        False,
    ),
    ("non_stream_released", [ResponseHeaders(200, JSON), ResponseBody(b"{}", True), WriteAheadDone()], True),
    ("passed_through", [ResponseHeaders(404, JSON)], False),
    ("failed", [ResponseHeaders(503, JSON)], False),
]


@pytest.mark.parametrize(("inputs", "sent"), [f[1:] for f in FIRST_DELTA], ids=[f[0] for f in FIRST_DELTA])
def test_first_delta_sent_is_derived(inputs: list[Input], sent: bool) -> None:
    request = new_request()
    attempt = begin(request)
    for event in inputs:
        fa(request, attempt, event)
    assert request.first_delta_sent is sent
    assert views.journal_view(request)["first_delta_sent"] is sent


def test_first_delta_sent_once_content_was_forwarded() -> None:
    request = new_request()
    released(request)
    started(request)
    feed(request, [ROLE + C1], eos_last=False)
    assert (request.first_delta_sent, request.phase, request.retry_budget) == (True, Phase.DECODE, 0)


# --- tool calls ----------------------------------------------------------------------------------------


def test_tool_calls_beyond_the_cap_are_counted_not_listed() -> None:
    policy = policy_from_mapping({"tools": {"max_calls_per_request": 2}})
    request = new_request(policy)
    request.drain_events()
    for key in ("k1", "k2", "k3", "k4"):
        assert request.handle(ToolCallNoted(EventName.TOOL_CALL_CLAIMED, key, 1, {"status": 200})) == []
    for _ in range(20):
        request.handle(ToolCallNoted(EventName.TOOL_CALL_REPLAYED, "k1", 1))
    request.handle(ToolCallNoted(EventName.TOOL_CALL_EXECUTED, "k3", 1))  # not listed: still not listed
    assert list(request.tool_calls) == ["k1", "k2"]
    assert request.tool_calls_dropped == 3
    k1 = request.tool_calls["k1"]
    assert len(k1["events"]) == 16  # one key's flood is not listed whole
    assert k1["events"][0] == {"event": "tool_call_claimed", "attempt": 1, "status": 200}
    view = views.journal_view(request)
    assert [t["key"] for t in view["tool_calls"]] == ["k1", "k2"]
    assert view["tool_calls_not_listed"] == 3
    events = request.drain_events()
    assert [(e.name.value, e.detail["key"]) for e in events[:2]] == [
        ("tool_call_claimed", "k1"),
        ("tool_call_claimed", "k2"),
    ]
    assert len(events) == 2 + 20


# --- the event trace of a whole story ---------------------------------------------------------------


def test_event_names_retry_then_complete() -> None:
    request = new_request()
    assert failed(request, ResponseHeaders(200, SSE), StreamReset()) == TriggerRetry("connection_lost")
    second = begin(request, "att-2", "r2")
    fa(request, second, ResponseHeaders(200, SSE))
    data = (REFERENCE / "chat_stream_usage.sse").read_bytes()
    chunks = random_chunks(data, random.Random(1))
    held = 0
    for c in chunks:
        held += 1
        if fa(request, second, ResponseBody(c, False)):
            break
    assert fa(request, second, WriteAheadDone()) == [ReleaseAttempt("att-2", held), WatchPublisher("att-2")]
    started(request)
    assert b"".join(d.data for d in feed(request, chunks) if isinstance(d, Forward)) == data
    events = request.drain_events()
    assert [(e.name.value, e.attempt) for e in events] == [
        ("request_accepted", None),
        ("attempt_started", 1),
        ("headers_held", 1),
        ("attempt_failed", 1),
        ("retry_triggered", 1),
        ("attempt_started", 2),
        ("headers_held", 2),
        ("first_delta_sent", 2),
        ("stream_completed", None),
    ]
    assert events[0].detail["retry_allowed"] is True
    assert events[0].detail["route"] == "chat.completions"
    assert events[5].detail == {"attempt_id": "att-2", "replica": "r2"}
    assert events[-1].detail == {"delivered_output_tokens": 12}
    assert request.drain_events() == []


@pytest.mark.parametrize(
    "payload",
    [b"data: this is not json\n\n", b"data: [1, 2]\n\n", b"data: \xff\xfe\n\n", b'data: "text"\n\n'],
)
def test_a_malformed_event_before_any_content_fails_the_attempt(payload: bytes) -> None:
    # Held bytes the client never saw: a broken replica, retried, never released as if they were content
    # (found by the hostile replica's garbage when the write-ahead beat the replica's close).
    r = new_request()
    attempt = begin(r, "a1", "r1")
    fa(r, attempt, ResponseHeaders(200, SSE))
    # Failed: retried (the verdict answers the held headers, whose closed connection fences it).
    decisions = fa(r, attempt, ResponseBody(payload, False))
    assert decisions == [
        ReleaseLease("a1", "connection_closed"),
        AnswerAttempt("a1", TriggerRetry("malformed_event"), 1),
    ]
    assert attempt.failure is FailureReason.MALFORMED_EVENT and not attempt.first_delta


def test_the_verdict_counts_the_attempt_that_died_at_its_connection() -> None:
    """The issue's run: attempt 1 failed before content and was retried; Envoy's retry met a pooled connection
    the replica had just closed, its stream ended before the sidecar let the request go, and Envoy's retry
    limit ended the request. The verdict says how many attempts ran, how each ended, and why it ended."""
    request = new_request()
    _one_retry_refused(request)  # attempt 1: the replica answered 503, the sidecar asked Envoy to retry
    assert arrive(request, "att_2", "10.0.0.2:8000") == [GrantLease("att_2", "10.0.0.2:8000")]
    request.handle(ArrivalGone("att_2"))  # attempt 2's stream: cancelled before its request was let go
    request.drain_events()
    details = "upstream_reset_before_response_started{connection_termination}"
    decision, *_ = request.handle(
        ResponseStarted(503, "text/plain", frozenset({"UC", "URX"}), details, envoy_attempts=2)
    )
    assert isinstance(decision, ReplaceResponse) and isinstance(decision.error, FailRequest)
    verdict = decision.error
    assert verdict.code == Outcome.RETRIES_EXHAUSTED
    told = "Envoy made 2 attempt(s), none delivered content (1: upstream_status, 2: connection_lost_before_"
    assert told in verdict.message
    assert "1 reached a replica, fewer than max_attempts (2)" in verdict.message
    assert "no further attempt" not in verdict.message
    assert [(x.number, x.failure) for x in request.attempts] == [
        (1, FailureReason.UPSTREAM_STATUS),
        (2, FailureReason.NOT_SENT),
    ]
    assert request.attempts[1].state is AttemptState.NEVER_SENT and request.attempts[1].fenced
    assert request.envoy_attempts == 2
    assert views.journal_view(request)["envoy_attempts"] == 2
    assert [e.name for e in request.drain_events()][:2] == [
        EventName.ATTEMPT_STARTED,
        EventName.ATTEMPT_FAILED,
    ]


def test_attempts_envoy_made_that_the_gateway_never_saw_are_told() -> None:
    request = new_request()
    _one_retry_refused(request)
    started_ = ResponseStarted(503, "text/plain", frozenset({"UC", "URX"}), _RESET_DETAILS, envoy_attempts=3)
    [decision] = request.handle(started_)
    assert isinstance(decision, ReplaceResponse) and isinstance(decision.error, FailRequest)
    assert "Envoy made 3 attempt(s)" in decision.error.message
    assert "2 ended before the gateway saw it" in decision.error.message


def test_a_request_none_of_whose_attempts_reached_a_replica_had_no_replica() -> None:
    request = new_request()
    assert arrive(request, "att_1", "r1") == [GrantLease("att_1", "r1")]
    request.handle(ArrivalGone("att_1"))
    started_ = ResponseStarted(503, "text/plain", frozenset({"UF", "URX"}), _RESET_DETAILS, envoy_attempts=3)
    [decision] = request.handle(started_)
    assert isinstance(decision, ReplaceResponse) and isinstance(decision.error, FailRequest)
    assert (decision.error.status, decision.error.code) == (503, Outcome.NO_REPLICA_AVAILABLE)
    assert "Envoy made 3 attempt(s)" in decision.error.message
