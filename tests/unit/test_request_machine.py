"""The request machine, every situation × every input: an oracle written from
docs/design.md#the-request-machine (not from the code), checked without servers.

A situation is a named point of a request's life, reached through inputs only. For each input type there is
one representative input (the attempt it names is the situation's own). Each row gives the exact decisions (a
`Shape` where a message's text does not matter) and where the request is afterwards, or `ILLEGAL`: the machine
must raise and change nothing.
"""

from __future__ import annotations

import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest

from router_sidecar.core.attempt import (
    Attempt,
    FailRequest,
    IllegalInput,
    ResponseBody,
    ResponseHeaders,
    StreamReset,
    TriggerRetry,
)
from router_sidecar.core.events import EventName
from router_sidecar.core.policy import policy_from_mapping
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
    DuplicateRun,
    FailNow,
    FenceWaitOver,
    ForAttempt,
    Forward,
    ForwardAttempt,
    GrantLease,
    Input,
    LeaseGranted,
    LogicalRequest,
    PassResponse,
    Phase,
    PlaceRetry,
    PublisherLost,
    RefuseAttempt,
    ReleaseAttempt,
    ReleaseLease,
    ReplaceResponse,
    ResponseChunk,
    ResponseStarted,
    RetryPlaced,
    StartClaim,
    StartDeadline,
    SupersedeAttempt,
    Terminate,
    ToolCallNoted,
    WithholdResponse,
)
from tests.unit.test_request import (
    C1,
    C2,
    DONE_EVENT,
    ERROR,
    FINISH,
    JSON,
    ROLE,
    SSE,
    arrive,
    begin,
    fa,
    failed,
    grant,
    new_request,
    parsed,
    released,
    settle_claim,
    started,
)

CLOSED = "connection_closed"
DUP = DuplicateRun(in_flight=True)


@dataclass(frozen=True)
class Shape:
    """A decision whose error message does not matter: its type, and the error's code (or the attempt)."""

    kind: type
    code: str = ""
    attempt_id: str = ""


def begin_unclaimed(request: LogicalRequest) -> Attempt:
    """Attempt 1 forwarded while the claim is still pending (the first attempt does not wait for it)."""
    assert arrive(request, "att-1") == [GrantLease("att-1", "r1")]
    assert grant(request, "att-1") == [ForwardAttempt("att-1")]
    attempt = request.attempt("att-1")
    assert attempt is not None
    return attempt


def shape(d: Decision) -> Decision | Shape:
    if isinstance(d, Terminate):
        return Shape(Terminate)  # its frame is checked by test_request.py
    error = getattr(d, "error", None)
    if isinstance(error, FailRequest):
        return Shape(type(d), str(error.code), getattr(d, "attempt_id", ""))
    return d


# --- the situations ---------------------------------------------------------------------------------------


def _admitting() -> LogicalRequest:
    policy = policy_from_mapping({"journal": {"claim_before_forwarding": True}})
    request = LogicalRequest(request_id="req-0001", tenant="t1", parsed=parsed(), policy=policy)
    assert request.handle(Admitted()) == [StartClaim(patient=False)]
    return request


def _forwarded_claim_pending() -> LogicalRequest:
    return new_request(claimed=False)


def _forwarded() -> LogicalRequest:
    return new_request()


def _granting() -> LogicalRequest:
    request = new_request()
    assert arrive(request, "att-1") == [GrantLease("att-1", "r1")]
    return request


def _holding() -> LogicalRequest:
    request = new_request()
    fa(request, begin(request), ResponseHeaders(200, SSE))
    return request


def _retry_waits_for_fence() -> LogicalRequest:
    request = new_request()
    fa(request, begin(request), ResponseHeaders(503, JSON))  # answered: a retry; its lease settling
    assert arrive(request, "att-2", "r2") == [AwaitFence("att-1", 15)]
    return request


def _released() -> LogicalRequest:
    request = new_request()
    released(request)
    return request


def _headers_wait_for_claim() -> LogicalRequest:
    request = new_request(claimed=False)
    assert fa(request, begin_unclaimed(request), ResponseHeaders(307, JSON)) == [ReleaseAttempt("att-1", 0)]
    assert request.handle(ResponseStarted(307, JSON, frozenset(), "via_upstream")) == []
    return request


def _decode() -> LogicalRequest:
    request = _released()
    started(request)
    request.handle(ResponseChunk(ROLE + C1, False))
    return request


def _completed() -> LogicalRequest:
    request = _decode()
    request.handle(ResponseChunk(FINISH + DONE_EVENT, True))
    return request


def _interrupted() -> LogicalRequest:
    request = _decode()
    request.handle(ResponseChunk(ERROR, False))
    return request


def _failed() -> LogicalRequest:
    request = new_request()
    failed(request, ResponseHeaders(503, JSON))
    failed(request, ResponseHeaders(503, JSON), attempt_id="att-2")
    return request


def _cancelled() -> LogicalRequest:
    request = _holding()
    request.handle(DownstreamLost(DownstreamLoss.CLIENT_GONE))
    return request


def _rejected() -> LogicalRequest:
    request = new_request(claimed=False)
    request.handle(ClaimSettled(ClaimOutcome.REFUSED, duplicate=DUP))
    return request


def _placing() -> LogicalRequest:
    request = new_request()
    request.pin("digest-a", "rev-1")
    assert fa(request, begin(request), ResponseHeaders(503, JSON)) == [PlaceRetry("att-1")]
    return request


SITUATIONS: dict[str, Callable[[], LogicalRequest]] = {
    "admitting": _admitting,
    "forwarded_claim_pending": _forwarded_claim_pending,
    "forwarded": _forwarded,
    "granting": _granting,
    "holding": _holding,
    "retry_waits_for_fence": _retry_waits_for_fence,
    "released": _released,
    "headers_wait_for_claim": _headers_wait_for_claim,
    "decode": _decode,
    "completed": _completed,
    "interrupted": _interrupted,
    "failed": _failed,
    "cancelled": _cancelled,
    "rejected": _rejected,
    "placing": _placing,
}

# Where each situation is: (phase, claim, client stream).
WHERE: dict[str, tuple[Phase, ClaimState, ClientStream]] = {
    "admitting": (Phase.PREFILL, ClaimState.PENDING, ClientStream.ADMITTING),
    "forwarded_claim_pending": (Phase.PREFILL, ClaimState.PENDING, ClientStream.FORWARDED),
    "forwarded": (Phase.PREFILL, ClaimState.HELD, ClientStream.FORWARDED),
    "granting": (Phase.PREFILL, ClaimState.HELD, ClientStream.FORWARDED),
    "holding": (Phase.PREFILL, ClaimState.HELD, ClientStream.FORWARDED),
    "retry_waits_for_fence": (Phase.PREFILL, ClaimState.HELD, ClientStream.FORWARDED),
    "released": (Phase.PREFILL, ClaimState.HELD, ClientStream.FORWARDED),
    "headers_wait_for_claim": (Phase.PREFILL, ClaimState.PENDING, ClientStream.HEADERS_WAITING),
    "decode": (Phase.DECODE, ClaimState.HELD, ClientStream.PASSED),
    "completed": (Phase.COMPLETED, ClaimState.HELD, ClientStream.PASSED),
    "interrupted": (Phase.INTERRUPTED, ClaimState.HELD, ClientStream.PASSED),
    "failed": (Phase.FAILED, ClaimState.HELD, ClientStream.FORWARDED),
    "cancelled": (Phase.CANCELLED, ClaimState.HELD, ClientStream.FORWARDED),
    "rejected": (Phase.REJECTED, ClaimState.REFUSED, ClientStream.ANSWERED),
    "placing": (Phase.PREFILL, ClaimState.HELD, ClientStream.FORWARDED),
}

# --- one representative input of each type ----------------------------------------------------------------

INPUT_TYPES: tuple[type, ...] = typing.get_args(Input)

REPRESENTATIVE: dict[type, Input] = {
    Admitted: Admitted(),
    ClaimSettled: ClaimSettled(ClaimOutcome.GRANTED),
    AttemptArrived: AttemptArrived("att-9", "r9"),
    LeaseGranted: LeaseGranted("att-1", lease=None, ttl_seconds=10, replica_side=False),
    ArrivalGone: ArrivalGone("att-8"),
    ForAttempt: ForAttempt("att-1", StreamReset()),
    RetryPlaced: RetryPlaced("att-1", None),
    FenceWaitOver: FenceWaitOver("att-1"),
    ResponseStarted: ResponseStarted(200, SSE, frozenset(), "via_upstream"),
    ResponseChunk: ResponseChunk(C2, False),
    PublisherLost: PublisherLost("heartbeat_lapsed"),
    DeadlineReached: DeadlineReached(),
    DownstreamLost: DownstreamLost(DownstreamLoss.CLIENT_GONE),
    ToolCallNoted: ToolCallNoted(EventName.TOOL_CALL_CLAIMED, "k1", 1),
}


@dataclass(frozen=True)
class Row:
    """The decisions (exact, or `Shape`s), then where the request is (None: where it was)."""

    decisions: list[Any] = field(default_factory=list)
    phase: Phase | None = None
    client: ClientStream | None = None
    claim: ClaimState | None = None


ILLEGAL = Row(["ILLEGAL"])
NOTHING = Row()
P, C, CS = Phase, ClientStream, ClaimState
GRANT_9 = GrantLease("att-9", "r9")
SUPERSEDE_1 = SupersedeAttempt("att-1")


def fail_now(code: str) -> Shape:
    return Shape(FailNow, code)


def replaced(code: str) -> Shape:
    return Shape(ReplaceResponse, code)


def refused(code: str, attempt_id: str = "att-9") -> Shape:
    return Shape(RefuseAttempt, code, attempt_id)


def terminate() -> Shape:
    return Shape(Terminate)


def _rows(situation: str, **rows: Row) -> dict[tuple[str, type], Row]:
    """A situation's rows: the ones given by input type name; ILLEGAL for `Admitted`, `LeaseGranted` and
    `RetryPlaced` unless given (no situation is before admission, few grant a lease or place a retry), and
    nothing decided for `ArrivalGone` and `ToolCallNoted` unless given."""
    defaults = {
        "Admitted": ILLEGAL,
        "LeaseGranted": ILLEGAL,
        "RetryPlaced": ILLEGAL,
        "ArrivalGone": NOTHING,
        "ToolCallNoted": NOTHING,
    }
    merged = {**defaults, **rows}
    assert set(merged) == {t.__name__ for t in INPUT_TYPES}, (
        situation,
        set(merged) ^ {t.__name__ for t in INPUT_TYPES},
    )
    by_name = {t.__name__: t for t in INPUT_TYPES}
    return {(situation, by_name[name]): row for name, row in merged.items()}


def _before_any_attempt(situation: str, claim_pending: bool) -> dict[tuple[str, type], Row]:
    return _rows(
        situation,
        ClaimSettled=Row([], claim=CS.HELD) if claim_pending else ILLEGAL,
        AttemptArrived=Row([GRANT_9]),  # the first attempt does not wait for the claim
        ForAttempt=ILLEGAL,  # no such attempt
        FenceWaitOver=NOTHING,
        ResponseStarted=(
            Row([], client=C.HEADERS_WAITING)  # nothing reaches the client before the claim is settled
            if claim_pending
            else Row([replaced("no_replica_available")], P.FAILED, C.REPLACED)
        ),
        ResponseChunk=NOTHING,
        PublisherLost=NOTHING,
        DeadlineReached=Row([fail_now("deadline_exceeded")], P.FAILED, C.ANSWERED),
        DownstreamLost=Row([], P.CANCELLED),
    )


def _after_the_end(situation: str, *, chunk: Row, publisher_lost: Row, started: Row, for_attempt: Row,
                   arrived: Row) -> dict[tuple[str, type], Row]:  # fmt: skip
    return _rows(
        situation,
        ClaimSettled=ILLEGAL,
        AttemptArrived=arrived,
        ForAttempt=for_attempt,
        FenceWaitOver=NOTHING,
        ResponseStarted=started,
        ResponseChunk=chunk,
        PublisherLost=publisher_lost,
        DeadlineReached=NOTHING,  # the request is over
        DownstreamLost=NOTHING,
    )


EXPECTED: dict[tuple[str, type], Row] = {
    # The request body waits for the claim (journal.claim_before_forwarding).
    **_rows(
        "admitting",
        ClaimSettled=Row([StartDeadline(300), ContinueRequest()], client=C.FORWARDED, claim=CS.HELD),
        AttemptArrived=Row([GRANT_9]),
        ForAttempt=ILLEGAL,
        FenceWaitOver=NOTHING,
        ResponseStarted=ILLEGAL,  # nothing was forwarded: no response can start
        ResponseChunk=NOTHING,
        PublisherLost=NOTHING,
        DeadlineReached=Row([fail_now("deadline_exceeded")], P.FAILED, C.ANSWERED),
        DownstreamLost=Row([], P.CANCELLED),
    ),
    **_before_any_attempt("forwarded_claim_pending", claim_pending=True),
    **_before_any_attempt("forwarded", claim_pending=False),
    # The first attempt's lease is being granted: a second waits for it.
    **_rows(
        "granting",
        ClaimSettled=ILLEGAL,
        AttemptArrived=NOTHING,
        LeaseGranted=Row([ForwardAttempt("att-1")]),
        ForAttempt=ILLEGAL,  # not on record before its lease
        FenceWaitOver=NOTHING,
        ResponseStarted=Row([replaced("no_replica_available")], P.FAILED, C.REPLACED),
        ResponseChunk=NOTHING,
        PublisherLost=NOTHING,
        DeadlineReached=Row([fail_now("deadline_exceeded")], P.FAILED, C.ANSWERED),
        DownstreamLost=Row([], P.CANCELLED),
    ),
    # Headers held: a failure is still invisible, so it is retried.
    **_rows(
        "holding",
        ClaimSettled=ILLEGAL,
        AttemptArrived=Row([SUPERSEDE_1]),  # Envoy retried before the end of attempt 1 reached us
        ForAttempt=Row([ReleaseLease("att-1", CLOSED)]),  # a retry; nothing to answer on a gone stream
        FenceWaitOver=NOTHING,  # nobody waits for attempt 1
        # No released attempt sent these: the client gets the request's JSON error instead.
        ResponseStarted=Row([replaced("retries_exhausted")], P.FAILED, C.REPLACED),
        ResponseChunk=NOTHING,
        PublisherLost=NOTHING,  # no publisher yet: the attempt's own machine answers for it
        DeadlineReached=Row([fail_now("deadline_exceeded")], P.FAILED, C.ANSWERED),
        DownstreamLost=Row([], P.CANCELLED),
    ),
    # Attempt 1 failed and was answered; attempt 2 waits until attempt 1 is fenced.
    **_rows(
        "retry_waits_for_fence",
        ClaimSettled=ILLEGAL,
        AttemptArrived=NOTHING,  # behind attempt 2
        ForAttempt=NOTHING,  # its lease is settling already
        FenceWaitOver=Row([refused("fence_unprovable", "att-2")], P.FAILED),
        ResponseStarted=Row(
            [replaced("retries_exhausted"), refused("retries_exhausted", "att-2")], P.FAILED, C.REPLACED
        ),
        ResponseChunk=NOTHING,
        PublisherLost=NOTHING,
        DeadlineReached=Row(
            [fail_now("deadline_exceeded"), refused("deadline_exceeded", "att-2")], P.FAILED, C.ANSWERED
        ),
        # The client is gone: the waiting attempt never starts.
        DownstreamLost=Row([refused("client_disconnected", "att-2")], P.CANCELLED),
    ),
    # Released at its first delta; its response has not reached the client filter yet.
    **_rows(
        "released",
        ClaimSettled=ILLEGAL,
        AttemptArrived=Row([SUPERSEDE_1]),  # its release never reached the router: Envoy retried
        ForAttempt=NOTHING,  # released: the client filter answers for the rest
        FenceWaitOver=NOTHING,
        ResponseStarted=Row([PassResponse()], client=C.PASSED),
        ResponseChunk=NOTHING,  # no headers passed yet
        PublisherLost=Row([ReleaseLease("att-1", None)]),  # the stream ends after its first content
        DeadlineReached=Row([fail_now("deadline_exceeded")], P.FAILED, C.ANSWERED),
        DownstreamLost=Row([], P.CANCELLED),
    ),
    # A 3xx passed through before the claim came back: its headers wait for it.
    **_rows(
        "headers_wait_for_claim",
        ClaimSettled=Row([PassResponse()], client=C.PASSED, claim=CS.HELD),
        AttemptArrived=NOTHING,  # a retry waits for the claim
        ForAttempt=NOTHING,  # passed through
        FenceWaitOver=NOTHING,
        ResponseStarted=ILLEGAL,  # twice
        ResponseChunk=NOTHING,
        PublisherLost=NOTHING,
        DeadlineReached=Row([fail_now("deadline_exceeded"), WithholdResponse()], P.FAILED, C.ANSWERED),
        DownstreamLost=Row([], P.CANCELLED),
    ),
    # Content reached the client: never another attempt.
    **_rows(
        "decode",
        ClaimSettled=ILLEGAL,
        AttemptArrived=Row([refused("upstream_decode_interrupted")]),
        ForAttempt=NOTHING,
        FenceWaitOver=NOTHING,
        ResponseStarted=ILLEGAL,
        ResponseChunk=Row([Forward(C2, False)]),
        PublisherLost=Row([ReleaseLease("att-1", None), terminate()], P.INTERRUPTED),
        DeadlineReached=Row([terminate()], P.INTERRUPTED),
        DownstreamLost=Row([], P.CANCELLED),
    ),
    **_after_the_end(
        "completed",
        arrived=Row([refused("completed")]),
        for_attempt=NOTHING,
        started=ILLEGAL,
        chunk=NOTHING,
        publisher_lost=Row([ReleaseLease("att-1", None)]),
    ),
    **_after_the_end(
        "interrupted",
        arrived=Row([refused("upstream_decode_interrupted")]),
        for_attempt=NOTHING,
        started=ILLEGAL,
        chunk=NOTHING,
        publisher_lost=Row([ReleaseLease("att-1", None)]),
    ),
    **_after_the_end(
        "failed",
        arrived=Row([refused("retries_exhausted")]),
        for_attempt=NOTHING,  # fenced already
        started=Row([PassResponse()], client=C.PASSED),  # the replica's own answer to our error: ours
        chunk=NOTHING,
        publisher_lost=NOTHING,
    ),
    **_after_the_end(
        "cancelled",
        arrived=Row([refused("client_disconnected")]),
        for_attempt=Row([ReleaseLease("att-1", CLOSED)]),  # no verdict: the client is gone
        started=Row([PassResponse()], client=C.PASSED),
        chunk=NOTHING,
        publisher_lost=NOTHING,
    ),
    # The id is another run's: one 409 went out; nothing else of this run ever starts or is released.
    **_rows(
        "rejected",
        ClaimSettled=ILLEGAL,
        AttemptArrived=Row([RefuseAttempt("att-9", DUP)]),
        ForAttempt=ILLEGAL,
        FenceWaitOver=NOTHING,
        ResponseStarted=Row([WithholdResponse()]),
        ResponseChunk=NOTHING,
        PublisherLost=NOTHING,
        DeadlineReached=NOTHING,
        DownstreamLost=NOTHING,
    ),
    # A pinned request's failed attempt: its verdict waits for where a retry could land.
    **_rows(
        "placing",
        ClaimSettled=ILLEGAL,
        AttemptArrived=NOTHING,  # waits for the verdict
        RetryPlaced=Row(
            [ReleaseLease("att-1", CLOSED), AnswerAttempt("att-1", TriggerRetry("upstream_status"), 0)]
        ),
        ForAttempt=Row([ReleaseLease("att-1", CLOSED)]),
        FenceWaitOver=NOTHING,
        ResponseStarted=Row([replaced("retries_exhausted")], P.FAILED, C.REPLACED),
        ResponseChunk=NOTHING,
        PublisherLost=NOTHING,
        DeadlineReached=Row([fail_now("deadline_exceeded")], P.FAILED, C.ANSWERED),
        DownstreamLost=Row([], P.CANCELLED),
    ),
}


def test_the_oracle_covers_every_situation_and_input() -> None:
    assert len(INPUT_TYPES) == 14  # the union of inputs was read
    assert set(EXPECTED) == {(s, t) for s in SITUATIONS for t in INPUT_TYPES}
    assert set(REPRESENTATIVE) == set(INPUT_TYPES) and set(WHERE) == set(SITUATIONS)


@pytest.mark.parametrize("situation", list(SITUATIONS))
def test_situations_are_where_they_say(situation: str) -> None:
    request = SITUATIONS[situation]()
    assert (request.phase, request.claim, request.client) == WHERE[situation]


@pytest.mark.parametrize(
    ("situation", "kind"), list(EXPECTED), ids=[f"{s}-{t.__name__}" for s, t in EXPECTED]
)
def test_every_situation_and_input(situation: str, kind: type) -> None:
    row = EXPECTED[(situation, kind)]
    request = SITUATIONS[situation]()
    before = (request.phase, request.claim, request.client)
    request.drain_events()
    event = REPRESENTATIVE[kind]
    if row is ILLEGAL:
        with pytest.raises(IllegalInput, match="req-0001"):
            request.handle(event)
        assert (request.phase, request.claim, request.client) == before  # a refused input changes nothing
        assert request.drain_events() == []
        return
    assert [shape(d) for d in request.handle(event)] == row.decisions
    phase, claim, client = before
    assert request.phase is (row.phase or phase)
    assert request.claim is (row.claim or claim)
    assert request.client is (row.client or client)


def test_no_decision_is_dropped_on_a_supersede_at_the_response() -> None:
    # Envoy answered the client itself after our release went out (a reset before it reached the router):
    # the released attempt is over, and its lease is settled, not left to the request's end.
    request = _released()
    decisions = request.handle(ResponseStarted(503, "text/plain", frozenset({"UC"}), "upstream_reset"))
    assert [shape(d) for d in decisions] == [replaced("retries_exhausted"), ReleaseLease("att-1", CLOSED)]
    assert request.attempts[0].verdict is request.final  # given the request's own end


def test_a_held_attempt_is_never_written_ahead_before_the_claim() -> None:
    request = new_request(claimed=False)
    attempt = begin_unclaimed(request)
    fa(request, attempt, ResponseHeaders(200, SSE))
    assert fa(request, attempt, ResponseBody(ROLE + C1, False)) == []
    assert request.holds_stream("att-1")  # its stream reads nothing more until the release
    assert [type(d).__name__ for d in settle_claim(request)] == ["WriteAheadJournal"]
