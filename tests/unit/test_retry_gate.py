"""The logical request's retry gate: admit → Admit / Supersede / AwaitFence / Refuse; verdict → retry or fail.

A retry needs budget left, retries not blocked, the previous attempt fenced, a compatible replica, and (after
uncertain liveness) the policy's `then`. A refusal is final: `on_final` is called once, and every later
attempt is refused with the same answer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from router_sidecar.core.attempt import (
    Admit,
    Answer,
    Attempt,
    AttemptState,
    AwaitFence,
    Failed,
    FailRequest,
    FailureReason,
    FenceProven,
    FenceUnprovable,
    Input,
    LivenessLost,
    Refuse,
    Release,
    ResponseBody,
    ResponseHeaders,
    RetryGate,
    SettleLease,
    StartFence,
    StreamReset,
    Supersede,
    Superseded,
    TriggerRetry,
    VerdictReady,
    WriteAheadDone,
)
from router_sidecar.core.events import Event, EventName, Outcome
from router_sidecar.core.policy import DEFAULT_POLICY, Policy, policy_from_mapping

SSE = "text/event-stream"
CONTENT = b'data: {"choices":[{"index":0,"delta":{"content":"Hi"},"finish_reason":null}]}\n\n'
ROLE = b'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":""},"finish_reason":null}]}\n\n'

THREE = policy_from_mapping({"on_upstream_failure": {"before_first_delta": {"max_attempts": 3}}})
NO_RETRY = policy_from_mapping({"on_upstream_failure": {"before_first_delta": {"action": "fail_request"}}})
FAIL_AFTER_UNCERTAIN = policy_from_mapping(
    {"on_upstream_failure": {"uncertain_source_liveness": {"then": "fail_request"}}}
)


@dataclass
class Gate:
    """A gate with what it emitted and every verdict it ended the request with."""

    gate: RetryGate
    outbox: list[Event] = field(default_factory=list)
    finals: list[FailRequest] = field(default_factory=list)

    def start(self, n: int | None = None) -> Attempt:
        n = n if n is not None else len(self.gate.attempts) + 1
        assert self.gate.admit() == Admit()
        return self.gate.begin(f"att-{n}", f"10.0.0.{n}:8000")

    def names(self) -> list[tuple[str, int | None]]:
        return [(e.name.value, e.attempt) for e in self.outbox]


def new_gate(policy: Policy = DEFAULT_POLICY) -> Gate:
    outbox: list[Event] = []
    finals: list[FailRequest] = []
    return Gate(RetryGate(policy, outbox, finals.append), outbox, finals)


def fail(attempt: Attempt, *inputs: Input) -> Failed:
    """Feed inputs; together they must decide exactly one Failed, which is returned."""
    decisions = [d for event in inputs for d in attempt.handle(event)]
    failed = [d for d in decisions if isinstance(d, Failed)]
    assert len(failed) == 1, decisions
    return failed[0]


def fail_503(attempt: Attempt) -> Failed:
    return fail(attempt, ResponseHeaders(503, "application/json"))


def settle(attempt: Attempt, verdict: TriggerRetry | FailRequest) -> None:
    """The shell's side: answer the verdict, then the closed connection's settlement is confirmed."""
    decisions = attempt.handle(VerdictReady(verdict))
    assert SettleLease("connection_closed") in decisions or attempt.fence is not None
    attempt.handle(FenceProven("connection_closed"))
    assert attempt.fenced or attempt.fence is not None


# --- the budget ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("policy", "max_attempts"),
    [(DEFAULT_POLICY, 2), (THREE, 3), (NO_RETRY, 1)],
    ids=["default", "three", "none"],
)
def test_attempts_up_to_the_budget_then_one_final_error(policy: Policy, max_attempts: int) -> None:
    g = new_gate(policy)
    assert g.gate.max_attempts == max_attempts
    assert g.gate.retries_left == max_attempts
    verdict: TriggerRetry | FailRequest | None = None
    for n in range(1, max_attempts + 1):
        attempt = g.start()
        assert (attempt.number, attempt.attempt_id, attempt.replica) == (n, f"att-{n}", f"10.0.0.{n}:8000")
        assert g.gate.retries_left == max_attempts - n
        failed = fail_503(attempt)
        verdict = g.gate.verdict(attempt, failed, no_compatible_replica=None)
        if n < max_attempts:
            assert verdict == TriggerRetry("upstream_status")
            assert g.finals == []
        settle(attempt, verdict)
    assert isinstance(verdict, FailRequest)
    assert (verdict.status, verdict.code, verdict.retry_after) == (502, Outcome.RETRIES_EXHAUSTED, None)
    assert f"all {max_attempts} attempts failed" in verdict.message
    assert "upstream_status" in verdict.message  # the last attempt's failure is named
    assert g.finals == [verdict]
    assert g.gate.final is verdict
    assert g.gate.retries_left == 0
    assert g.gate.admit() == Refuse(verdict)
    expected: list[tuple[str, int | None]] = []
    for n in range(1, max_attempts + 1):
        expected += [("attempt_started", n), ("attempt_failed", n)]
        expected.append(("retry_triggered", n) if n < max_attempts else ("retry_refused", n))
    assert g.names() == expected
    assert g.outbox[-1].detail == {"reason": "retries_exhausted"}
    assert g.outbox[0].detail == {"attempt_id": "att-1", "replica": "10.0.0.1:8000"}


def test_retry_reason_is_the_failure() -> None:
    for inputs, reason in [
        ((StreamReset(),), "connection_lost"),
        ((ResponseHeaders(200, SSE), ResponseBody(b"", True)), "ended_without_done"),
        ((ResponseHeaders(200, SSE, content_encoding="gzip"),), "content_encoding"),
    ]:
        g = new_gate()
        attempt = g.start()
        assert g.gate.verdict(attempt, fail(attempt, *inputs), no_compatible_replica=None) == TriggerRetry(
            reason
        )
        assert g.outbox[-1] == Event(EventName.RETRY_TRIGGERED, 1, {"reason": reason})


def test_retry_blocked_allows_one_attempt() -> None:
    g = new_gate(THREE)
    g.gate.block("the prompt exceeds the re-prefill cost cap")
    g.gate.block("a second reason")  # the first reason stands
    assert (g.gate.max_attempts, g.gate.retries_left) == (1, 1)
    attempt = g.start()
    verdict = g.gate.verdict(attempt, fail_503(attempt), no_compatible_replica=None)
    assert verdict == FailRequest(
        502, Outcome.RETRY_NOT_ALLOWED, "the prompt exceeds the re-prefill cost cap"
    )
    assert g.finals == [verdict]
    settle(attempt, verdict)
    assert g.gate.admit() == Refuse(verdict)


def test_last_attempt_429_is_429_with_retry_after() -> None:
    g = new_gate()
    first = g.start()
    assert g.gate.verdict(first, fail_503(first), no_compatible_replica=None) == TriggerRetry(
        "upstream_status"
    )
    settle(first, TriggerRetry("upstream_status"))
    second = g.start()
    failed = fail(second, ResponseHeaders(429, "application/json", retry_after="30"))
    assert failed == Failed(FailureReason.OVERLOADED)
    verdict = g.gate.verdict(second, failed, no_compatible_replica=None)
    assert isinstance(verdict, FailRequest)
    assert (verdict.status, verdict.code, verdict.retry_after) == (429, Outcome.REPLICAS_OVERLOADED, "30")
    assert g.finals == [verdict]


def test_overloaded_answer_does_not_claim_what_did_not_happen() -> None:
    # Invariant 9 (nothing lies): attempt 1 got a 503, attempt 2 a 429; the message must not say that every
    # replica tried answered 429.
    g = new_gate()
    first = g.start()
    settle(first, g.gate.verdict(first, fail_503(first), no_compatible_replica=None))
    second = g.start()
    failed = fail(second, ResponseHeaders(429, "application/json", retry_after="30"))
    verdict = g.gate.verdict(second, failed, no_compatible_replica=None)
    assert isinstance(verdict, FailRequest) and verdict.status == 429
    assert "every replica" not in verdict.message


def test_429_within_the_budget_is_retried() -> None:
    g = new_gate()
    attempt = g.start()
    failed = fail(attempt, ResponseHeaders(429, "application/json", retry_after="5"))
    assert g.gate.verdict(attempt, failed, no_compatible_replica=None) == TriggerRetry("replica_overloaded")


def test_no_compatible_replica_to_retry_on() -> None:
    g = new_gate()
    attempt = g.start()
    why = "the only other replica serves weights revision b2"
    verdict = g.gate.verdict(attempt, fail_503(attempt), no_compatible_replica=why)
    assert isinstance(verdict, FailRequest)
    assert (verdict.status, verdict.code) == (503, Outcome.NO_COMPATIBLE_REPLICA)
    assert why in verdict.message
    assert g.finals == [verdict]
    assert [e.name for e in g.outbox].count(EventName.RETRY_TRIGGERED) == 0


def test_fence_unprovable_is_503_whatever_the_budget() -> None:
    g = new_gate(THREE)
    attempt = g.start()
    assert attempt.handle(LivenessLost("heartbeat_lapsed")) == [StartFence()]
    failed = fail(attempt, FenceUnprovable())
    assert failed == Failed(FailureReason.REPLICA_LOST, fence_proven=False)
    verdict = g.gate.verdict(attempt, failed, no_compatible_replica=None)
    assert isinstance(verdict, FailRequest)
    assert (verdict.status, verdict.code) == (503, Outcome.FENCE_UNPROVABLE)
    assert g.finals == [verdict]
    assert g.gate.admit() == Refuse(verdict)  # never fenced, but the refusal comes first


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
]


@pytest.mark.parametrize(("inputs", "reason"), [u[1:] for u in UNCERTAIN], ids=[u[0] for u in UNCERTAIN])
def test_uncertain_liveness_with_then_fail_request(inputs: list[Input], reason: FailureReason) -> None:
    g = new_gate(FAIL_AFTER_UNCERTAIN)
    attempt = g.start()
    failed = fail(attempt, *inputs, FenceProven("lease_expiry", 10_000.0))
    assert failed == Failed(reason)
    verdict = g.gate.verdict(attempt, failed, no_compatible_replica=None)
    assert isinstance(verdict, FailRequest)
    assert (verdict.status, verdict.code) == (502, Outcome.RETRY_NOT_ALLOWED)
    assert "uncertain" in verdict.message
    assert g.finals == [verdict]


@pytest.mark.parametrize(("inputs", "reason"), [u[1:] for u in UNCERTAIN], ids=[u[0] for u in UNCERTAIN])
def test_uncertain_liveness_retried_by_default(inputs: list[Input], reason: FailureReason) -> None:
    g = new_gate()
    attempt = g.start()
    failed = fail(attempt, *inputs, FenceProven("cancel_ack", 40.0))
    assert g.gate.verdict(attempt, failed, no_compatible_replica=None) == TriggerRetry(reason.value)
    assert attempt.fenced is True
    assert g.gate.admit() == Admit()  # fenced by its proof: nothing to wait for


def test_policy_then_fail_request_does_not_stop_certain_failures() -> None:
    g = new_gate(FAIL_AFTER_UNCERTAIN)
    attempt = g.start()
    failed = fail(attempt, ResponseHeaders(200, SSE), StreamReset())
    assert g.gate.verdict(attempt, failed, no_compatible_replica=None) == TriggerRetry("connection_lost")


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
    g = new_gate()
    previous = g.start()
    for event in inputs:
        previous.handle(event)
    assert previous.state is state
    admission = g.gate.admit()
    assert isinstance(admission, Supersede) and admission.attempt is previous
    # The shell feeds it Superseded (Envoy started the next attempt: this one's connection is gone).
    decisions = previous.handle(Superseded())
    failed = decisions[0]
    assert isinstance(failed, Failed)
    assert decisions[1:] == [SettleLease("connection_closed")]
    assert g.gate.verdict(previous, failed, no_compatible_replica=None) == TriggerRetry(failed.reason.value)
    assert previous.handle(VerdictReady(TriggerRetry(failed.reason.value))) == []  # its stream is gone
    admission = g.gate.admit()
    assert isinstance(admission, AwaitFence) and admission.attempt is previous
    previous.handle(FenceProven("connection_closed"))
    assert g.gate.admit() == Admit()
    assert g.gate.begin("att-2", "r2").number == 2


def test_await_fence_while_fencing() -> None:
    g = new_gate()
    previous = g.start()
    previous.handle(ResponseHeaders(200, SSE))
    previous.handle(LivenessLost("heartbeat_lapsed"))
    for _ in range(3):  # asked again and again while the fence lasts
        admission = g.gate.admit()
        assert isinstance(admission, AwaitFence) and admission.attempt is previous
    failed = fail(previous, FenceProven("lease_expiry", 12_000.0))
    assert g.gate.verdict(previous, failed, no_compatible_replica=None) == TriggerRetry("replica_lost")
    assert g.gate.admit() == Admit()


def test_await_fence_until_a_failed_attempts_lease_is_settled() -> None:
    g = new_gate()
    previous = g.start()
    verdict = g.gate.verdict(previous, fail_503(previous), no_compatible_replica=None)
    assert previous.handle(VerdictReady(verdict)) == [
        SettleLease("connection_closed"),
        Answer(TriggerRetry("upstream_status"), 0),
    ]
    admission = g.gate.admit()
    assert isinstance(admission, AwaitFence) and admission.attempt is previous
    previous.handle(FenceProven("connection_closed"))
    assert g.gate.admit() == Admit()


def test_passed_through_attempt_needs_no_fence() -> None:
    g = new_gate()
    previous = g.start()
    assert previous.handle(ResponseHeaders(404, "application/json")) == [Release(0)]
    assert g.gate.admit() == Admit()


def test_fence_timed_out() -> None:
    g = new_gate(THREE)
    previous = g.start()
    previous.handle(LivenessLost("progress_gap"))
    assert isinstance(g.gate.admit(), AwaitFence)
    verdict = g.gate.fence_timed_out(previous)
    assert (verdict.status, verdict.code) == (503, Outcome.FENCE_UNPROVABLE)
    assert "attempt 1" in verdict.message
    assert g.gate.final is verdict and g.finals == [verdict]
    assert g.gate.admit() == Refuse(verdict)
    assert g.outbox[-1] == Event(EventName.RETRY_REFUSED, 1, {"reason": "fence_unprovable"})
    # The fence that ends later changes nothing: the answer is given.
    failed = fail(previous, FenceProven("lease_expiry"))
    assert g.gate.verdict(previous, failed, no_compatible_replica=None) is verdict
    assert g.finals == [verdict]


# --- a refusal is final ------------------------------------------------------------------------------


def test_refuse_forever_after_finish() -> None:
    g = new_gate(THREE)
    first = g.start()
    final = g.gate.finish(FailRequest(504, Outcome.DEADLINE_EXCEEDED, "deadline"))
    assert g.gate.finish(FailRequest(502, Outcome.RETRIES_EXHAUSTED, "other")) is final  # the first one stays
    assert g.gate.retries_left == 0
    for _ in range(3):
        assert g.gate.admit() == Refuse(final)
    # A verdict asked after the end is that end, whatever the attempt's failure.
    assert g.gate.verdict(first, fail_503(first), no_compatible_replica=None) is final
    assert g.finals == [final]
    assert [e.name for e in g.outbox].count(EventName.RETRY_REFUSED) == 1
    assert [e.name for e in g.outbox].count(EventName.RETRY_TRIGGERED) == 0


def test_finish_before_any_attempt() -> None:
    g = new_gate()
    final = g.gate.finish(FailRequest(504, Outcome.DEADLINE_EXCEEDED, "deadline"))
    assert g.gate.admit() == Refuse(final)
    assert g.outbox == [Event(EventName.RETRY_REFUSED, None, {"reason": "deadline_exceeded"})]
    assert g.finals == [final]


def test_refusal_over_the_budget_is_final() -> None:
    # The last allowed attempt failed and is fenced, and Envoy starts one more before its verdict was asked:
    # that attempt is refused, and the refusal ends the request (on_final once, the same answer after).
    g = new_gate()
    first = g.start()
    settle(first, g.gate.verdict(first, fail_503(first), no_compatible_replica=None))
    second = g.start()
    second.handle(ResponseHeaders(200, SSE))
    second.handle(StreamReset())
    second.handle(FenceProven("connection_closed"))
    refusal = g.gate.admit()
    assert isinstance(refusal, Refuse)
    assert (refusal.verdict.status, refusal.verdict.code) == (502, Outcome.RETRIES_EXHAUSTED)
    assert g.gate.final == refusal.verdict
    assert g.finals == [refusal.verdict]
    assert g.gate.admit() == refusal
    assert g.finals == [refusal.verdict]


def test_on_final_exactly_once_over_a_whole_story() -> None:
    g = new_gate()
    first = g.start()
    settle(first, g.gate.verdict(first, fail_503(first), no_compatible_replica=None))
    second = g.start()
    verdict = g.gate.verdict(second, fail_503(second), no_compatible_replica=None)
    settle(second, verdict)
    g.gate.admit()
    g.gate.fence_timed_out(second)
    g.gate.finish(FailRequest(504, Outcome.DEADLINE_EXCEEDED, "late"))
    g.gate.verdict(second, Failed(FailureReason.UPSTREAM_STATUS), no_compatible_replica="none left")
    assert g.finals == [verdict]
    assert g.gate.final is verdict


# --- attempts that never left Envoy ----------------------------------------------------------------------


def test_an_attempt_that_died_at_its_connection_is_journaled_but_not_counted() -> None:
    g = new_gate()  # max_attempts 2
    first = g.start()
    verdict = g.gate.verdict(first, fail_503(first), no_compatible_replica=None)
    assert verdict == TriggerRetry("upstream_status")
    settle(first, verdict)
    # Envoy's retry picked a pooled connection the replica had closed: its stream ended before the sidecar
    # let the request go. Noted, and journaled once Envoy moved on (here: it starts another attempt).
    g.gate.note_never_sent("att-2", "10.0.0.2:8000")
    assert len(g.gate.attempts) == 1
    assert g.gate.admit() == Admit()
    second = g.gate.attempts[-1]
    assert (second.number, second.attempt_id, second.state) == (2, "att-2", AttemptState.FAILED)
    assert second.failure is FailureReason.NOT_SENT and second.fenced
    assert g.gate.counted == 1 and g.gate.retries_left == 1
    third = g.gate.begin("att-3", "10.0.0.3:8000")
    assert third.number == 3
    assert g.gate.verdict(third, fail_503(third), no_compatible_replica=None) == g.finals[0]
    (final,) = g.finals
    assert final.code == Outcome.RETRIES_EXHAUSTED
    assert "all 2 attempts failed" in final.message
    assert "1 more died at their connection before the request was sent" in final.message
    assert g.names()[:6] == [
        ("attempt_started", 1),
        ("attempt_failed", 1),
        ("retry_triggered", 1),
        ("attempt_started", 2),
        ("attempt_failed", 2),
        ("attempt_started", 3),
    ]


def test_a_never_sent_attempt_gets_a_retry_even_without_retries() -> None:
    g = new_gate(NO_RETRY)  # max_attempts 1: a stale connection cost the replica nothing
    g.gate.note_never_sent("att-1", "10.0.0.1:8000")
    assert g.gate.admit() == Admit()
    assert g.gate.retries_left == 1
    second = g.gate.begin("att-2", "10.0.0.2:8000")
    failed = fail_503(second)
    assert isinstance(g.gate.verdict(second, failed, no_compatible_replica=None), FailRequest)


def test_the_attempt_before_a_never_sent_one_must_still_be_fenced() -> None:
    g = new_gate()
    first = g.start()
    verdict = g.gate.verdict(first, fail_503(first), no_compatible_replica=None)
    first.handle(VerdictReady(verdict))  # answered, its lease not yet settled
    g.gate.note_never_sent("att-2", "10.0.0.2:8000")
    assert g.gate.admit() == AwaitFence(first)
    first.handle(FenceProven("connection_closed"))
    assert g.gate.admit() == Admit()


def test_noted_attempts_are_not_journaled_until_envoy_moves_on() -> None:
    g = new_gate()
    g.start()
    g.gate.note_never_sent("att-2", "10.0.0.2:8000")  # e.g. the client left: nothing follows
    assert [a.number for a in g.gate.attempts] == [1]
    g.gate.confirm_never_sent()  # Envoy answered the client itself: the connection had died
    assert [a.failure for a in g.gate.attempts] == [None, FailureReason.NOT_SENT]
    g.gate.confirm_never_sent()
    assert len(g.gate.attempts) == 2


def test_a_released_attempt_behind_a_never_sent_one_is_superseded() -> None:
    """A release that lost the race with its replica's reset (Envoy retried), then a retry that died at its
    connection: the next attempt supersedes the released one instead of awaiting a fence that never comes."""
    g = new_gate()
    first = g.start()
    first.handle(ResponseHeaders(200, SSE))
    first.handle(ResponseBody(ROLE + CONTENT, False))
    first.handle(WriteAheadDone())
    assert first.state is AttemptState.RELEASED
    g.gate.note_never_sent("att-2", "10.0.0.2:8000")
    assert g.gate.admit() == Supersede(first)
