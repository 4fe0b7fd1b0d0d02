"""Views of the machines: the one JSON error a client gets when nothing was delivered, and the journal record.

Rendering only; the requests are built through the machines (`test_request`'s helpers).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest

from router_sidecar.coordination.fencing import AttemptLease
from router_sidecar.coordination.store import Lease
from router_sidecar.core import views
from router_sidecar.core.attempt import (
    FailRequest,
    FenceProven,
    LivenessLost,
    ResponseBody,
    ResponseHeaders,
    StreamReset,
    TriggerRetry,
)
from router_sidecar.core.events import EventName, Outcome
from router_sidecar.core.request import (
    DeadlineReached,
    DownstreamLoss,
    DownstreamLost,
    LogicalRequest,
    Phase,
    ResponseChunk,
    ToolCallNoted,
    WriteAheadJournal,
)
from router_sidecar.core.sse import DONE_EVENT
from tests.unit.test_request import (
    C1,
    C2,
    FINISH,
    JSON,
    RID,
    ROLE,
    SSE,
    begin,
    fa,
    new_request,
    released,
    started,
)


def lease(lease_id: int, *, revoked: bool = False) -> AttemptLease:
    return AttemptLease(
        attempt_id=f"att-{lease_id}",
        lease=Lease(lease_id, 10),
        granted_at=1_800_000_000.25,
        refreshed_at=0.0,
        ttl_seconds=10,
        stopped_at=1_800_000_001.5 if revoked else None,
        revoked_at=1_800_000_001.75 if revoked else None,
    )


def two_failed_attempts(request: LogicalRequest) -> FailRequest:
    """Attempt 1: fenced after its heartbeat lapsed, retried; attempt 2: its replica answered 503, refused."""
    first = begin(request, "att-1", "10.0.0.1:8000")
    first.lease = lease(0x1F, revoked=True)
    fa(request, first, ResponseHeaders(200, SSE))
    fa(request, first, LivenessLost("heartbeat_lapsed"))
    fa(request, first, FenceProven("cancel_ack", 812.34))
    assert isinstance(first.verdict, TriggerRetry)
    second = begin(request, "att-2", "10.0.0.2:8000")
    second.lease = lease(0x2A)
    fa(request, second, ResponseHeaders(503, JSON))
    verdict = second.verdict
    assert isinstance(verdict, FailRequest)
    return verdict


def test_error_body_names_the_request_the_code_and_every_attempt() -> None:
    request = new_request()
    verdict = two_failed_attempts(request)
    body = json.loads(views.error_body(request, verdict))
    assert list(body) == ["error"]
    err: dict[str, Any] = body["error"]
    assert err["request_id"] == RID
    assert err["code"] == "retries_exhausted" == verdict.code.value
    assert err["message"] == verdict.message and "upstream_status" in err["message"]
    assert (err["type"], err["partial_output"]) == ("gateway_error", False)
    assert err["attempts"] == [
        {
            "attempt": 1,
            "attempt_id": "att-1",
            "replica": "10.0.0.1:8000",
            "outcome": "failed",
            "detail": "replica_lost",
            "status": 200,
            "lease": {
                "lease_id": "1f",
                "ttl_seconds": 10,
                "granted_at": 1_800_000_000.25,
                "stopped_at": 1_800_000_001.5,
                "revoked_at": 1_800_000_001.75,
            },
            "fence": {"proof": "cancel_ack", "waited_ms": 812.3},
        },
        {
            "attempt": 2,
            "attempt_id": "att-2",
            "replica": "10.0.0.2:8000",
            "outcome": "failed",
            "detail": "upstream_status",
            "status": 503,
            "lease": {
                "lease_id": "2a",
                "ttl_seconds": 10,
                "granted_at": 1_800_000_000.25,
                "stopped_at": None,
                "revoked_at": None,
            },
            "fence": None,
        },
    ]


def test_error_body_before_any_attempt() -> None:
    request = new_request()
    verdict = FailRequest(503, Outcome.NO_REPLICA_AVAILABLE, "no healthy replica was available")
    err = json.loads(views.error_body(request, verdict))["error"]
    assert (err["request_id"], err["code"], err["attempts"]) == (RID, "no_replica_available", [])


def test_error_headers() -> None:
    request = new_request()
    plain = FailRequest(502, Outcome.RETRIES_EXHAUSTED, "x")
    overloaded = FailRequest(429, Outcome.REPLICAS_OVERLOADED, "x", retry_after="30")
    ids = [("x-request-id", RID), ("x-router-attempts", "0")]  # no attempt reached a replica yet
    assert views.error_headers(request, plain) == ids
    assert views.error_headers(request, overloaded) == [*ids, ("retry-after", "30")]


def test_error_body_is_bounded_json_whatever_the_message() -> None:
    request = new_request()
    verdict = FailRequest(502, Outcome.RETRIES_EXHAUSTED, 'quote " newline \n and \u2028 unicode')
    err = json.loads(views.error_body(request, verdict))["error"]
    assert err["message"] == verdict.message


# --- the publishing attempt's outcome follows its request's end -------------------------------------------


def _decode(request: LogicalRequest) -> None:
    released(request)
    started(request)
    request.handle(ResponseChunk(ROLE + C1, False))


def _completed(request: LogicalRequest) -> None:
    _decode(request)
    request.handle(ResponseChunk(C2 + FINISH + DONE_EVENT, True))


def _interrupted(request: LogicalRequest) -> None:
    _decode(request)
    request.handle(ResponseChunk(b"", True))  # ended without [DONE]


def _deadline(request: LogicalRequest) -> None:
    _decode(request)
    request.handle(DeadlineReached())


def _cancelled(request: LogicalRequest) -> None:
    _decode(request)
    request.handle(DownstreamLost(DownstreamLoss.CLIENT_GONE))


def _reset(request: LogicalRequest) -> None:
    _decode(request)
    request.handle(DownstreamLost(DownstreamLoss.UPSTREAM_RESET))


PUBLISHER: list[tuple[str, Callable[[LogicalRequest], None], Phase, str]] = [
    ("decode", _decode, Phase.DECODE, "released"),
    ("completed", _completed, Phase.COMPLETED, "completed"),
    ("interrupted", _interrupted, Phase.INTERRUPTED, "interrupted"),
    ("deadline", _deadline, Phase.INTERRUPTED, "interrupted"),
    ("cancelled", _cancelled, Phase.CANCELLED, "cancelled"),
    ("reset", _reset, Phase.INTERRUPTED, "interrupted"),
]


@pytest.mark.parametrize(
    ("story", "phase", "outcome"), [p[1:] for p in PUBLISHER], ids=[p[0] for p in PUBLISHER]
)
def test_publishing_attempt_outcome_reads_the_requests_end(
    story: Callable[[LogicalRequest], None], phase: Phase, outcome: str
) -> None:
    request = new_request()
    story(request)
    assert request.phase is phase
    records = views.journal_view(request)["attempts"]
    assert [(a["attempt"], a["outcome"], a["detail"], a["status"]) for a in records] == [
        (1, outcome, None, 200)
    ]


def test_a_failed_attempt_keeps_its_own_outcome_when_the_request_completes() -> None:
    request = new_request()
    first = begin(request, "att-1", "r1")
    fa(request, first, StreamReset())
    fa(request, first, FenceProven("connection_closed"))
    released(request, "att-2", "r2")
    started(request)
    request.handle(ResponseChunk(ROLE + C1 + FINISH + DONE_EVENT, True))
    records = views.journal_view(request)["attempts"]
    assert [(a["attempt"], a["outcome"], a["detail"]) for a in records] == [
        (1, "failed", "connection_lost"),
        (2, "completed", None),
    ]
    assert records[0]["fence"] is None  # a closed connection needed no fence


# --- the journal record -------------------------------------------------------------------------------


def test_journal_view_of_a_completed_request() -> None:
    request = new_request()
    request.pin("sha256:abc", "rev-7")
    _completed(request)
    request.handle(ToolCallNoted(EventName.TOOL_CALL_EXECUTED, "k1", 1, {"status": 200}))
    view = views.journal_view(request)
    added_by_the_journal = ("gateway", "events", "updated_at")
    assert {
        k: view[k] for k in view if k not in ("attempts", "tool_calls", "input", *added_by_the_journal)
    } == {
        "request_id": RID,
        "phase": "completed",
        "outcome": "completed",
        "attempt": 1,
        "first_delta_sent": True,
        "model": "tiny",
        "model_revision": "rev-7",
        "fingerprint_digest": "sha256:abc",
        "retry_budget": 0,
        "delivered_output_tokens": 2,
        "delivered_output_tokens_source": "content_events",
    }
    assert view["tool_calls"] == [
        {"key": "k1", "events": [{"event": "tool_call_executed", "attempt": 1, "status": 200}]}
    ]
    assert view["input"] == {
        "route": "chat.completions",
        "digest": request.parsed.input_digest,
        "seed": 7,
        "stream": True,
        "estimated_prompt_tokens": request.parsed.estimated_prompt_tokens,
    }
    assert "tool_calls_not_listed" not in view
    json.dumps(view)  # a record is JSON as it is


def test_journal_view_of_a_prefill_request() -> None:
    request = new_request()
    fa(request, begin(request), ResponseHeaders(200, SSE))
    view = views.journal_view(request)
    assert (view["phase"], view["outcome"], view["first_delta_sent"], view["retry_budget"]) == (
        "prefill",
        None,
        False,
        1,
    )
    assert view["attempts"][0]["outcome"] == "holding"
    assert fa(request, request.attempts[0], ResponseBody(ROLE + C1, False)) == [WriteAheadJournal("att-1")]
    view = views.journal_view(request)
    assert (view["first_delta_sent"], view["attempts"][0]["outcome"]) == (True, "writing_ahead")
