"""The logical request's retry gate, driven only through `LogicalRequest.handle` (as the shells drive it).

Admission: an attempt Envoy starts is admitted (its lease granted), made to wait (the previous attempt is
superseded, then fenced; the claim is settled), or refused. Verdict: a failed attempt's fate is another
attempt or one error for the client. A retry needs budget left, retries not blocked, the previous attempt
fenced, the claim settled, a compatible replica, and (after uncertain liveness) the policy's `then`. A
refusal is final: every later attempt is refused with the same answer, and the request ends with it once.
"""

from __future__ import annotations

import pytest

from router_sidecar.core.attempt import (
    Attempt,
    AttemptState,
    FailRequest,
    FailureReason,
    FenceProven,
    FenceUnprovable,
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
from router_sidecar.core.policy import DEFAULT_POLICY, Policy, policy_from_mapping
from router_sidecar.core.request import (
    AnswerAttempt,
    AttemptArrived,
    AwaitFence,
    ClaimOutcome,
    ClaimSettled,
    Decision,
    DuplicateRun,
    FailNow,
    FenceAttempt,
    FenceWaitOver,
    ForAttempt,
    ForwardAttempt,
    GrantLease,
    LeaseGranted,
    LogicalRequest,
    PlaceRetry,
    RefuseAttempt,
    ReleaseAttempt,
    ReleaseLease,
    RetryPlaced,
    SupersedeAttempt,
    WriteAheadJournal,
)
from tests.unit.test_request import new_request

SSE = "text/event-stream"
JSON = "application/json"
CONTENT = b'data: {"choices":[{"index":0,"delta":{"content":"Hi"},"finish_reason":null}]}\n\n'
ROLE = b'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":""},"finish_reason":null}]}\n\n'
SETTLED = "connection_closed"
FENCE_WAIT = 15  # the attempt lease's TTL (10 s by default) and 5 s of slack

THREE = policy_from_mapping({"on_upstream_failure": {"before_first_delta": {"max_attempts": 3}}})
NO_RETRY = policy_from_mapping({"on_upstream_failure": {"before_first_delta": {"action": "fail_request"}}})
FAIL_AFTER_UNCERTAIN = policy_from_mapping(
    {"on_upstream_failure": {"uncertain_source_liveness": {"then": "fail_request"}}}
)
EXPIRY_ONLY = policy_from_mapping(
    {"on_upstream_failure": {"uncertain_source_liveness": {"wait_for": "lease_expiry"}}}
)


class G:
    """A request seen from the upstream side: attempts arrive, get leases, fail, are settled."""

    def __init__(self, policy: Policy = DEFAULT_POLICY, *, claimed: bool = True, prompt: str = "hi") -> None:
        self.request: LogicalRequest = new_request(policy, prompt, claimed=claimed)
        self.request.drain_events()

    def handle(self, event: object) -> list[Decision]:
        return self.request.handle(event)  # type: ignore[arg-type]

    def arrive(self, n: int) -> list[Decision]:
        return self.handle(AttemptArrived(f"att-{n}", f"10.0.0.{n}:8000"))

    def grant(self, n: int, *, replica_side: bool = False) -> list[Decision]:
        return self.handle(LeaseGranted(f"att-{n}", lease=None, ttl_seconds=10, replica_side=replica_side))

    def start(self, n: int | None = None, *, replica_side: bool = False) -> Attempt:
        n = n if n is not None else len(self.request.attempts) + 1
        assert self.arrive(n) == [GrantLease(f"att-{n}", f"10.0.0.{n}:8000")]
        assert self.grant(n, replica_side=replica_side) == [ForwardAttempt(f"att-{n}")]
        attempt = self.request.attempt(f"att-{n}")
        assert attempt is not None
        return attempt

    def feed(self, attempt: Attempt, *inputs: Input) -> list[Decision]:
        return [d for event in inputs for d in self.handle(ForAttempt(attempt.attempt_id, event))]

    def settle(self, attempt: Attempt) -> list[Decision]:
        """The closed connection's revocation is confirmed (what `ReleaseLease` answers)."""
        decisions = self.feed(attempt, FenceProven(SETTLED))
        assert attempt.fenced
        return decisions

    def names(self) -> list[tuple[str, int | None]]:
        return [(e.name.value, e.attempt) for e in self.request.drain_events()]


def fail_503(g: G, attempt: Attempt) -> TriggerRetry | FailRequest:
    """The replica answers 503: the attempt fails, its verdict answers the held headers at once."""
    decisions = g.feed(attempt, ResponseHeaders(503, JSON))
    assert attempt.verdict is not None
    assert decisions == [
        ReleaseLease(attempt.attempt_id, SETTLED),
        AnswerAttempt(attempt.attempt_id, attempt.verdict, 0),
    ]
    return attempt.verdict


# --- the budget ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("policy", "max_attempts"),
    [(DEFAULT_POLICY, 2), (THREE, 3), (NO_RETRY, 1)],
    ids=["default", "three", "none"],
)
def test_attempts_up_to_the_budget_then_one_final_error(policy: Policy, max_attempts: int) -> None:
    g = G(policy)
    assert g.request.max_attempts == max_attempts
    assert g.request.retry_budget == max_attempts
    verdict: TriggerRetry | FailRequest | None = None
    for n in range(1, max_attempts + 1):
        attempt = g.start()
        assert (attempt.number, attempt.attempt_id, attempt.replica) == (n, f"att-{n}", f"10.0.0.{n}:8000")
        assert g.request.retry_budget == max_attempts - n
        verdict = fail_503(g, attempt)
        if n < max_attempts:
            assert verdict == TriggerRetry("upstream_status")
            assert g.request.final is None
        g.settle(attempt)
    assert isinstance(verdict, FailRequest)
    assert (verdict.status, verdict.code, verdict.retry_after) == (502, Outcome.RETRIES_EXHAUSTED, None)
    assert f"all {max_attempts} attempts failed" in verdict.message
    assert "upstream_status" in verdict.message  # the last attempt's failure is named
    assert g.request.final is verdict
    assert (g.request.phase.value, g.request.outcome) == ("failed", Outcome.RETRIES_EXHAUSTED)
    assert g.request.retry_budget == 0
    assert g.arrive(9) == [RefuseAttempt("att-9", verdict)]
    expected: list[tuple[str, int | None]] = []
    for n in range(1, max_attempts + 1):
        expected += [("attempt_started", n), ("attempt_failed", n)]
        expected.append(("retry_triggered", n) if n < max_attempts else ("retry_refused", n))
    assert g.names() == [*expected, ("request_failed", None)]


@pytest.mark.parametrize(
    ("inputs", "reason"),
    [
        ((StreamReset(),), "connection_lost"),
        ((ResponseHeaders(200, SSE), ResponseBody(b"", True)), "ended_without_done"),
        ((ResponseHeaders(200, SSE, content_encoding="gzip"),), "content_encoding"),
    ],
)
def test_retry_reason_is_the_failure(inputs: tuple[Input, ...], reason: str) -> None:
    g = G()
    attempt = g.start()
    g.feed(attempt, *inputs)
    assert attempt.verdict == TriggerRetry(reason)
    retried = [e for e in g.request.drain_events() if e.name is EventName.RETRY_TRIGGERED]
    assert [(e.attempt, e.detail) for e in retried] == [(1, {"reason": reason})]


def test_retry_blocked_allows_one_attempt() -> None:
    # The cost cap blocks retries: one attempt is all there is.
    cap = policy_from_mapping(
        {
            "on_upstream_failure": {"before_first_delta": {"max_attempts": 3}},
            "reprefill_cost_cap": {"max_prompt_tokens": 8},
        }
    )
    g = G(cap, prompt="tell me a long story " * 20)
    assert g.request.retry_blocked is not None and "cost cap" in g.request.retry_blocked
    assert (g.request.max_attempts, g.request.retry_budget) == (1, 1)
    attempt = g.start()
    verdict = fail_503(g, attempt)
    assert verdict == FailRequest(502, Outcome.RETRY_NOT_ALLOWED, g.request.retry_blocked)
    g.settle(attempt)
    assert g.arrive(2) == [RefuseAttempt("att-2", verdict)]


def test_last_attempt_429_is_429_with_retry_after() -> None:
    g = G()
    first = g.start()
    assert fail_503(g, first) == TriggerRetry("upstream_status")
    g.settle(first)
    second = g.start()
    g.feed(second, ResponseHeaders(429, JSON, retry_after="30"))
    verdict = second.verdict
    assert isinstance(verdict, FailRequest)
    assert (verdict.status, verdict.code, verdict.retry_after) == (429, Outcome.REPLICAS_OVERLOADED, "30")
    assert second.failure is FailureReason.OVERLOADED
    # Invariant 9 (nothing lies): attempt 1 got a 503, so not every replica tried answered 429.
    assert "1 of the 2 attempts got 429" in verdict.message
    assert g.request.final is verdict


def test_429_within_the_budget_is_retried() -> None:
    g = G()
    attempt = g.start()
    g.feed(attempt, ResponseHeaders(429, JSON, retry_after="5"))
    assert attempt.verdict == TriggerRetry("replica_overloaded")


def test_a_pinned_request_asks_where_a_retry_could_land() -> None:
    g = G()
    g.request.pin("digest-a", "rev-1")
    attempt = g.start()
    assert g.feed(attempt, ResponseHeaders(503, JSON)) == [PlaceRetry("att-1")]
    assert attempt.state is AttemptState.FAILED  # its verdict waits for the placement
    assert g.arrive(2) == []  # and so does the next attempt
    assert g.handle(RetryPlaced("att-1", None)) == [
        ReleaseLease("att-1", SETTLED),
        AnswerAttempt("att-1", TriggerRetry("upstream_status"), 0),
        AwaitFence("att-1", FENCE_WAIT),
    ]
    assert g.settle(attempt) == [GrantLease("att-2", "10.0.0.2:8000")]


def test_no_compatible_replica_to_retry_on() -> None:
    g = G()
    g.request.pin("digest-a", "rev-1")
    attempt = g.start()
    assert g.feed(attempt, ResponseHeaders(503, JSON)) == [PlaceRetry("att-1")]
    why = "the only other replica serves weights revision b2"
    decisions = g.handle(RetryPlaced("att-1", why))
    verdict = attempt.verdict
    assert isinstance(verdict, FailRequest)
    assert decisions == [ReleaseLease("att-1", SETTLED), AnswerAttempt("att-1", verdict, 0)]
    assert (verdict.status, verdict.code) == (503, Outcome.NO_COMPATIBLE_REPLICA)
    assert why in verdict.message
    assert g.request.final is verdict
    assert [n for n, _ in g.names()].count("retry_triggered") == 0


@pytest.mark.parametrize(
    ("policy", "replica_side", "accept_cancel_ack", "connection_only"),
    [
        (DEFAULT_POLICY, True, True, False),
        (EXPIRY_ONLY, True, False, False),
        (DEFAULT_POLICY, False, True, True),  # a static replica: its closed connection is the fence
    ],
    ids=["cancel_ack_or_expiry", "expiry_only", "static_replica"],
)
def test_how_an_uncertain_attempt_is_fenced(
    policy: Policy, replica_side: bool, accept_cancel_ack: bool, connection_only: bool
) -> None:
    g = G(policy)
    attempt = g.start(replica_side=replica_side)
    assert g.feed(attempt, LivenessLost("heartbeat_lapsed")) == [
        FenceAttempt("att-1", accept_cancel_ack=accept_cancel_ack, connection_only=connection_only)
    ]


def test_fence_unprovable_is_503_whatever_the_budget() -> None:
    g = G(THREE)
    attempt = g.start()
    g.feed(attempt, LivenessLost("heartbeat_lapsed"))
    assert g.feed(attempt, ResponseHeaders(200, SSE)) == []  # held: the answer waits for the fence
    decisions = g.feed(attempt, FenceUnprovable())
    verdict = attempt.verdict
    assert isinstance(verdict, FailRequest)
    assert decisions == [AnswerAttempt("att-1", verdict, 0)]  # its lease was revoked by the fence
    assert (verdict.status, verdict.code) == (503, Outcome.FENCE_UNPROVABLE)
    assert g.request.final is verdict
    assert g.arrive(2) == [RefuseAttempt("att-2", verdict)]  # never fenced, but the refusal comes first


# Every way an attempt's liveness becomes uncertain: fenced first, then the policy's `then`.
UNCERTAIN: list[tuple[str, list[Input], FailureReason]] = [
    ("heartbeat_lapsed", [LivenessLost("heartbeat_lapsed")], FailureReason.REPLICA_LOST),
    ("progress_gap", [ResponseHeaders(200, SSE), LivenessLost("progress_gap")], FailureReason.PATH_LOST),
    ("lease_lost", [ResponseHeaders(200, SSE), LivenessLost("lease_lost")], FailureReason.LEASE_LOST),
    # A closed connection whose replica showed a sign of running on is as uncertain as a lapsed heartbeat.
    (
        "reset_uncertain",
        [ResponseHeaders(200, SSE), StreamReset(liveness_uncertain=True)],
        FailureReason.REPLICA_LOST,
    ),
    ("superseded_uncertain", [Superseded(liveness_uncertain=True)], FailureReason.REPLICA_LOST),
    # The write-ahead came back and the lease was no longer honoured: never released, fenced instead.
    (
        "lease_lost_at_release",
        [ResponseHeaders(200, SSE), ResponseBody(CONTENT, False), WriteAheadDone(lease_publishable=False)],
        FailureReason.LEASE_LOST,
    ),
]


@pytest.mark.parametrize(("inputs", "reason"), [u[1:] for u in UNCERTAIN], ids=[u[0] for u in UNCERTAIN])
def test_uncertain_liveness_with_then_fail_request(inputs: list[Input], reason: FailureReason) -> None:
    g = G(FAIL_AFTER_UNCERTAIN)
    attempt = g.start()
    g.feed(attempt, *inputs)
    assert attempt.state is AttemptState.FENCING and attempt.verdict is None
    g.feed(attempt, FenceProven("lease_expiry", 10_000.0))
    verdict = attempt.verdict
    assert attempt.failure is reason
    assert isinstance(verdict, FailRequest)
    assert (verdict.status, verdict.code) == (502, Outcome.RETRY_NOT_ALLOWED)
    assert "uncertain" in verdict.message
    assert g.request.final is verdict


@pytest.mark.parametrize(("inputs", "reason"), [u[1:] for u in UNCERTAIN], ids=[u[0] for u in UNCERTAIN])
def test_uncertain_liveness_retried_by_default(inputs: list[Input], reason: FailureReason) -> None:
    g = G()
    attempt = g.start()
    g.feed(attempt, *inputs)
    g.feed(attempt, FenceProven("cancel_ack", 40.0))
    assert attempt.verdict == TriggerRetry(reason.value)
    assert attempt.fenced is True
    assert attempt.fence == {"proof": "cancel_ack", "waited_ms": 40.0}
    # Fenced by its proof: nothing to wait for.
    assert g.arrive(2) == [GrantLease("att-2", "10.0.0.2:8000")]


def test_policy_then_fail_request_does_not_stop_certain_failures() -> None:
    g = G(FAIL_AFTER_UNCERTAIN)
    attempt = g.start()
    g.feed(attempt, ResponseHeaders(200, SSE), StreamReset())
    assert attempt.verdict == TriggerRetry("connection_lost")


# --- admission: the previous attempt must be over and fenced --------------------------------------------

# (id, how the previous attempt got where it is)
STILL_PUBLISHING: list[tuple[str, list[Input], AttemptState]] = [
    ("awaiting_headers", [], AttemptState.AWAITING_HEADERS),
    ("holding", [ResponseHeaders(200, SSE), ResponseBody(ROLE, False)], AttemptState.HOLDING),
    ("writing_ahead", [ResponseHeaders(200, SSE), ResponseBody(CONTENT, False)], AttemptState.WRITING_AHEAD),
    (
        "released",
        [ResponseHeaders(200, SSE), ResponseBody(CONTENT, False), WriteAheadDone()],
        AttemptState.RELEASED,
    ),
]


@pytest.mark.parametrize(
    ("inputs", "state"), [s[1:] for s in STILL_PUBLISHING], ids=[s[0] for s in STILL_PUBLISHING]
)
def test_supersede_then_await_fence_then_admit(inputs: list[Input], state: AttemptState) -> None:
    g = G()
    previous = g.start()
    g.feed(previous, *inputs)
    assert previous.state is state
    assert g.arrive(2) == [SupersedeAttempt("att-1")]
    # The shell feeds it Superseded (Envoy started the next attempt: this one's connection is gone): it
    # fails, its verdict is a retry (nothing to answer: its stream is gone), and the next one waits for
    # the proof that it is fenced.
    assert g.feed(previous, Superseded()) == [ReleaseLease("att-1", SETTLED), AwaitFence("att-1", FENCE_WAIT)]
    assert previous.verdict == TriggerRetry(previous.failure.value if previous.failure else "")
    assert g.settle(previous) == [GrantLease("att-2", "10.0.0.2:8000")]
    assert g.grant(2) == [ForwardAttempt("att-2")]
    assert g.request.attempts[1].number == 2


def test_await_fence_while_fencing() -> None:
    g = G()
    previous = g.start()
    g.feed(previous, ResponseHeaders(200, SSE), LivenessLost("heartbeat_lapsed"))
    assert g.arrive(2) == [AwaitFence("att-1", FENCE_WAIT)]
    # Asked again while the fence lasts (another input): no second timer.
    assert g.feed(previous, ResponseBody(ROLE, False)) == []
    decisions = g.feed(previous, FenceProven("lease_expiry", 12_000.0))
    assert previous.verdict == TriggerRetry("replica_lost")
    assert decisions == [
        AnswerAttempt("att-1", TriggerRetry("replica_lost"), 1),
        GrantLease("att-2", "10.0.0.2:8000"),
    ]


def test_await_fence_until_a_failed_attempts_lease_is_settled() -> None:
    g = G()
    previous = g.start()
    fail_503(g, previous)
    assert g.arrive(2) == [AwaitFence("att-1", FENCE_WAIT)]
    assert g.settle(previous) == [GrantLease("att-2", "10.0.0.2:8000")]


def test_passed_through_attempt_needs_no_fence() -> None:
    g = G()
    previous = g.start()
    assert g.feed(previous, ResponseHeaders(307, JSON)) == [ReleaseAttempt("att-1", 0)]
    assert g.arrive(2) == [GrantLease("att-2", "10.0.0.2:8000")]


def test_fence_wait_over() -> None:
    g = G(THREE)
    previous = g.start()
    g.feed(previous, LivenessLost("progress_gap"))
    assert g.arrive(2) == [AwaitFence("att-1", FENCE_WAIT)]
    g.request.drain_events()
    refused = g.handle(FenceWaitOver("att-1"))
    verdict = g.request.final
    assert verdict is not None and refused == [RefuseAttempt("att-2", verdict)]
    assert (verdict.status, verdict.code) == (503, Outcome.FENCE_UNPROVABLE)
    assert "attempt 1" in verdict.message
    assert g.names() == [("retry_refused", 1), ("request_failed", None)]
    assert g.arrive(3) == [RefuseAttempt("att-3", verdict)]
    # The fence that ends later changes nothing: its verdict is the request's answer.
    g.feed(previous, FenceProven("lease_expiry"))
    assert previous.verdict is verdict


def test_fence_wait_over_for_a_fenced_attempt_changes_nothing() -> None:
    g = G()
    previous = g.start()
    fail_503(g, previous)
    g.arrive(2)
    g.settle(previous)
    assert g.handle(FenceWaitOver("att-1")) == []
    assert g.request.final is None


def test_an_attempt_whose_stream_went_before_it_was_sent_is_journaled_not_counted() -> None:
    # Its stream went while its lease was granted (the connection Envoy picked died): once Envoy moves on
    # (its next attempt), it is on record, numbered, and not counted; its lease is discarded.
    from router_sidecar.core.request import ArrivalGone, DiscardLease

    g = G(NO_RETRY)  # one attempt allowed: a stale connection cost the replica nothing
    assert g.arrive(1) == [GrantLease("att-1", "10.0.0.1:8000")]
    assert g.handle(ArrivalGone("att-1")) == []
    lease = object()
    assert g.handle(LeaseGranted("att-1", lease, 10, False)) == [DiscardLease(lease)]
    assert g.request.attempts == []  # nothing on record until Envoy's next move says why it went
    second = g.start(2)
    first = g.request.attempts[0]
    assert (first.number, first.attempt_id, first.state, first.failure) == (
        1,
        "att-1",
        AttemptState.NEVER_SENT,
        FailureReason.NOT_SENT,
    )
    assert first.fenced and first.lease is None
    assert (second.number, g.request.counted, g.request.retry_budget) == (2, 1, 0)
    assert fail_503(g, second) == FailRequest(
        502,
        Outcome.RETRIES_EXHAUSTED,
        "all 1 attempts failed before any content; the last: upstream_status; 1 more died at their "
        "connection before the request was sent (not counted)",
    )
    names = g.names()
    assert names[:3] == [("attempt_started", 1), ("attempt_failed", 1), ("attempt_started", 2)]
    assert ("retry_triggered", 1) not in names


def test_a_never_sent_attempt_leaves_the_budget_whole() -> None:
    from router_sidecar.core.request import ArrivalGone

    g = G()
    first = g.start()
    assert fail_503(g, first) == TriggerRetry("upstream_status")
    g.settle(first)
    assert g.arrive(2) == [GrantLease("att-2", "10.0.0.2:8000")]
    g.handle(ArrivalGone("att-2"))
    g.handle(LeaseGranted("att-2", object(), 10, False))
    # Envoy's next attempt (its number 3) is admitted: only one attempt reached a replica.
    assert g.handle(AttemptArrived("att-3", "10.0.0.3:8000", envoy_attempt=3)) == [
        GrantLease("att-3", "10.0.0.3:8000")
    ]
    assert g.grant(3) == [ForwardAttempt("att-3")]
    third = g.request.attempt("att-3")
    assert third is not None and third.number == 3
    verdict = fail_503(g, third)
    assert isinstance(verdict, FailRequest) and verdict.code == Outcome.RETRIES_EXHAUSTED
    assert "all 2 attempts failed" in verdict.message
    assert "1 more died at their connection before the request was sent" in verdict.message


def test_the_attempt_before_a_never_sent_one_must_still_be_fenced() -> None:
    from router_sidecar.core.request import ArrivalGone

    g = G()
    first = g.start()
    fail_503(g, first)  # answered; its lease not yet settled
    assert g.arrive(2) == [AwaitFence("att-1", FENCE_WAIT)]
    g.handle(ArrivalGone("att-2"))  # its stream went while it waited
    assert g.arrive(3) == []  # attempt 2 is on record now (never sent), and attempt 1 is still not fenced
    assert [x.state for x in g.request.attempts] == [AttemptState.DECIDED, AttemptState.NEVER_SENT]
    assert g.settle(first) == [GrantLease("att-3", "10.0.0.3:8000")]


def test_noted_attempts_are_not_journaled_unless_envoy_moves_on() -> None:
    from router_sidecar.core.request import ArrivalGone, DownstreamLoss, DownstreamLost

    g = G()
    first = g.start()
    fail_503(g, first)
    g.settle(first)
    g.arrive(2)
    g.handle(ArrivalGone("att-2"))
    g.handle(DownstreamLost(DownstreamLoss.CLIENT_GONE))  # the client left: that is why its stream went
    assert [x.number for x in g.request.attempts] == [1]


def test_a_gap_in_envoys_numbering_is_an_attempt_that_died_at_its_connection() -> None:
    # A release that lost the race with its replica's reset (Envoy retried), then a retry refused at connect
    # (its stream was cancelled before we read it): the next attempt supersedes the released one, rather than
    # awaiting a fence that never comes.
    g = G()
    first = g.start()
    g.feed(first, ResponseHeaders(200, SSE), ResponseBody(ROLE + CONTENT, False), WriteAheadDone())
    assert first.state is AttemptState.RELEASED
    decisions = g.handle(AttemptArrived("att-3", "10.0.0.3:8000", envoy_attempt=3))
    assert decisions == [SupersedeAttempt("att-1")]
    assert [(x.number, x.state) for x in g.request.attempts] == [
        (1, AttemptState.RELEASED),
        (2, AttemptState.NEVER_SENT),
    ]
    assert g.request.attempts[1].replica == "unknown"


def test_one_admission_at_a_time() -> None:
    # Envoy started the next attempt while the first one's lease was being granted: the second waits, and
    # then supersedes the first.
    g = G()
    assert g.arrive(1) == [GrantLease("att-1", "10.0.0.1:8000")]
    assert g.arrive(2) == []
    assert g.grant(1) == [ForwardAttempt("att-1"), SupersedeAttempt("att-1")]


# --- the claim -----------------------------------------------------------------------------------------


def test_the_first_attempt_does_not_wait_for_the_claim_but_a_retry_does() -> None:
    g = G(claimed=False)
    first = g.start()
    g.feed(first, ResponseHeaders(503, JSON))
    assert first.state is AttemptState.FAILED  # the verdict waits for the claim
    assert g.arrive(2) == []
    decisions = g.handle(ClaimSettled(ClaimOutcome.GRANTED))
    assert decisions == [
        ReleaseLease("att-1", SETTLED),
        AnswerAttempt("att-1", TriggerRetry("upstream_status"), 0),
        AwaitFence("att-1", FENCE_WAIT),
    ]
    assert g.settle(first) == [GrantLease("att-2", "10.0.0.2:8000")]


def test_nothing_is_written_ahead_before_the_claim() -> None:
    g = G(claimed=False)
    attempt = g.start()
    assert g.feed(attempt, ResponseHeaders(200, SSE), ResponseBody(CONTENT, False)) == []
    assert g.feed(attempt, ResponseBody(CONTENT, False)) == []  # held with the rest
    assert g.handle(ClaimSettled(ClaimOutcome.GRANTED)) == [WriteAheadJournal("att-1")]


def test_without_the_journal_no_retry_can_be_proven_safe() -> None:
    g = G(claimed=False)
    attempt = g.start()
    g.feed(attempt, ResponseHeaders(503, JSON))
    why = "the request journal (etcd) is unreachable, so no retry can be proven safe"
    g.handle(ClaimSettled(ClaimOutcome.UNAVAILABLE))
    assert attempt.verdict == FailRequest(502, Outcome.RETRY_NOT_ALLOWED, why)


def test_a_run_refused_by_its_claim_releases_nothing_and_starts_nothing() -> None:
    g = G(claimed=False)
    first = g.start()
    g.feed(first, ResponseHeaders(200, SSE), ResponseBody(CONTENT, False))
    duplicate = DuplicateRun(in_flight=True)
    # The client gets the 409 at once (nothing reached it); the held attempt is never released.
    assert g.handle(ClaimSettled(ClaimOutcome.REFUSED, duplicate=duplicate)) == [FailNow(duplicate)]
    assert first.state is AttemptState.WRITING_AHEAD and g.request.publisher is None
    assert g.arrive(2) == [RefuseAttempt("att-2", duplicate)]
    # Envoy resets the held attempt: it fails; its lease settles; no answer is written on its stream.
    assert g.feed(first, StreamReset()) == [ReleaseLease("att-1", SETTLED)]
    assert g.request.phase.value == "rejected"


# --- a refusal is final ------------------------------------------------------------------------------


def test_refusal_over_the_budget_is_final() -> None:
    # The last allowed attempt failed and is fenced, and Envoy starts one more before its verdict reached it:
    # that attempt is refused, and the refusal ends the request once.
    g = G()
    first = g.start()
    fail_503(g, first)
    g.settle(first)
    second = g.start()
    g.feed(second, ResponseHeaders(200, SSE), StreamReset())
    g.settle(second)
    final = g.request.final
    assert final is not None and (final.status, final.code) == (502, Outcome.RETRIES_EXHAUSTED)
    assert g.arrive(3) == [RefuseAttempt("att-3", final)]
    assert g.arrive(4) == [RefuseAttempt("att-4", final)]
    assert [n for n, _ in g.names()].count("request_failed") == 1


def test_a_verdict_asked_after_the_end_is_that_end() -> None:
    g = G(THREE)
    first = g.start()
    g.feed(first, ResponseHeaders(200, SSE))
    from router_sidecar.core.request import DeadlineReached

    [deadline] = g.handle(DeadlineReached())
    assert isinstance(deadline, FailNow)
    final = g.request.final
    assert final is not None and final.code == Outcome.DEADLINE_EXCEEDED
    g.feed(first, ResponseBody(b'data: {"error": {}}\n\n', False))
    assert first.verdict is final
    assert [n for n, _ in g.names()].count("retry_triggered") == 0
    assert [n for n, _ in g.names()].count("retry_refused") == 0  # drained above: once in all
