"""Fallback to another model (policy `fallback`, docs/design.md#fallback), in the request machine and the
order: an attempt arriving on a fallback model's replica is admitted (naming the model) only when its own
model's attempts are used up before content, or none could be made, and the policy allows that cause; the
answer then says so (header, journal record, event). Never after the first delta, never when the request's
retries are blocked, never past fallback.max_attempts."""

from __future__ import annotations

from typing import Any

from router_sidecar.core import views
from router_sidecar.core.attempt import (
    Attempt,
    FailRequest,
    FenceProven,
    Input,
    ResponseHeaders,
    StreamReset,
    TriggerRetry,
)
from router_sidecar.core.destinations import GATEWAY, Destinations
from router_sidecar.core.events import EventName, Outcome
from router_sidecar.core.policy import Policy, policy_from_mapping
from router_sidecar.core.request import (
    Admitted,
    ForwardAttempt,
    GrantLease,
    LogicalRequest,
    RefuseAttempt,
)
from tests.unit.test_request import (
    C1,
    JSON,
    ROLE,
    arrive,
    fa,
    feed,
    grant,
    parsed,
    release,
    settle_claim,
    started,
)

FALLBACK = policy_from_mapping({"fallback": {"models": ["big"]}})
ONLY_OVERLOADED = policy_from_mapping({"fallback": {"models": ["big"], "causes": ["overloaded"]}})
CAPPED = policy_from_mapping(
    {"fallback": {"models": ["big"]}, "reprefill_cost_cap": {"max_prompt_tokens": 8}}
)
OWN = Destinations(("r1:1", "r2:1", "r3:1"), GATEWAY, excluded=(("b1:1", "incompatible with the pin"),))
BIG = (("b1:1", "big"), ("b2:1", "big"))


def admitted(
    policy: Policy = FALLBACK, destinations: Destinations | None = None, prompt: str = "hi"
) -> LogicalRequest:
    request = LogicalRequest(request_id="req-fb", tenant="t1", parsed=parsed(prompt), policy=policy)
    order = destinations or OWN.with_fallback(BIG[: policy.fallback.max_attempts], 2)
    request.handle(Admitted(order))
    settle_claim(request)
    return request


def start(request: LogicalRequest, attempt_id: str, replica: str, model: str | None = None) -> Attempt:
    """An attempt admitted on `replica` and forwarded (naming `model` when it is a fallback's)."""
    assert arrive(request, attempt_id, replica) == [GrantLease(attempt_id, replica)]
    assert grant(request, attempt_id) == [ForwardAttempt(attempt_id, model)]
    attempt = request.attempt(attempt_id)
    assert attempt is not None
    return attempt


def fail(
    request: LogicalRequest, attempt_id: str, replica: str, *inputs: Input, model: str | None = None
) -> TriggerRetry | FailRequest:
    attempt = start(request, attempt_id, replica, model)
    for event in inputs or (ResponseHeaders(503, JSON),):
        fa(request, attempt, event)
    assert attempt.verdict is not None
    fa(request, attempt, FenceProven("connection_closed"))
    return attempt.verdict


def events(request: LogicalRequest, name: EventName) -> list[dict[str, Any]]:
    return [{"attempt": e.attempt, **e.detail} for e in request.outbox if e.name is name]


# --- the order ----------------------------------------------------------------------------------------------


def test_the_order_is_cut_to_its_own_attempts_then_the_fallbacks_replicas() -> None:
    order = OWN.with_fallback(BIG, 2, "")
    assert order.order == ("r1:1", "r2:1", "b1:1", "b2:1")
    assert order.fallback == BIG and order.fallback_cause == ""
    assert order.excluded == ()  # in the order now: not "left out" of it
    assert [order.fallback_model(a) for a in order.order] == [None, None, "big", "big"]
    assert order.why("b1:1") == "fallback to model big, choice #3"
    assert order.why("r2:1").startswith("gateway choice #2")
    # A replica already in the request's own entries is not listed twice; one listed twice, once.
    assert OWN.with_fallback([("r1:1", "big"), ("b1:1", "big"), ("b1:1", "big")], 2).order == (
        "r1:1",
        "r2:1",
        "b1:1",
    )


def test_with_no_replica_of_its_own_the_order_is_the_fallbacks_and_no_overload_is_answered() -> None:
    overloaded = Destinations((), GATEWAY, overloaded_for=3.0, ejected_by="breaker")
    order = overloaded.with_fallback(BIG[:1], 2, "unavailable")
    assert (order.order, order.overloaded_for, order.fallback_cause) == (("b1:1",), None, "unavailable")
    assert order.why("b1:1") == "fallback to model big, choice #1"
    # No fallback replica: the overload stands (the client gets its 429/503 with Retry-After).
    assert overloaded.with_fallback([], 2, "unavailable").overloaded_for == 3.0


# --- the machine --------------------------------------------------------------------------------------------


def test_own_attempts_used_up_before_content_then_the_fallback_answers_and_says_so() -> None:
    request = admitted()
    assert isinstance(fail(request, "att-1", "r1:1"), TriggerRetry)
    # The last of its own attempts failed: a retry is still given, for the fallback's entry is next.
    assert isinstance(fail(request, "att-2", "r2:1", StreamReset()), TriggerRetry)
    big = start(request, "att-3", "b1:1", model="big")
    assert big.chosen_by == "fallback to model big, choice #3"
    assert request.answered_by_fallback is None  # not until its content goes out
    release(request, big)
    causes = ("attempt 1 on r1:1: upstream_status", "attempt 2 on r2:1: connection_lost")
    assert request.answered_by_fallback == ("big", causes)
    [event] = events(request, EventName.ANSWERED_BY_FALLBACK)
    assert event == {
        "attempt": 3,
        "model": "big",
        "requested_model": "tiny",
        "reason": "failed_before_content",
        "detail": "; ".join(causes),
    }
    headers = dict(views.request_id_headers(request))
    assert (headers["x-router-attempts"], headers["x-router-fallback"]) == ("3", "big")
    record = views.journal_record(request)
    assert (record.fallback.model, record.fallback.requested_model) == ("big", "tiny")
    assert tuple(record.fallback.causes) == causes
    assert request.counted == 3 and request.own_counted == 2


def test_the_last_own_attempt_overloaded_is_the_overloaded_cause() -> None:
    request = admitted(ONLY_OVERLOADED)
    fail(request, "att-1", "r1:1")
    assert isinstance(fail(request, "att-2", "r2:1", ResponseHeaders(429, JSON)), TriggerRetry)
    release(request, start(request, "att-3", "b1:1", model="big"))
    [event] = events(request, EventName.ANSWERED_BY_FALLBACK)
    assert event["reason"] == "overloaded"


def test_a_cause_the_policy_does_not_list_ends_with_the_requests_own_error() -> None:
    request = admitted(ONLY_OVERLOADED)
    fail(request, "att-1", "r1:1")
    verdict = fail(request, "att-2", "r2:1")  # 503: failed_before_content, not listed
    assert isinstance(verdict, FailRequest) and (verdict.status, verdict.code) == (
        502,
        Outcome.RETRIES_EXHAUSTED,
    )
    # Should Envoy walk on to the fallback's entry anyway, that attempt is refused.
    [refusal] = arrive(request, "att-3", "b1:1")
    assert isinstance(refusal, RefuseAttempt) and refusal.error.code == Outcome.RETRIES_EXHAUSTED
    assert request.answered_by_fallback is None
    assert "x-router-fallback" not in dict(views.request_id_headers(request))


def test_a_request_whose_retries_are_blocked_never_falls_back() -> None:
    request = admitted(CAPPED, prompt="tell me a long story " * 20)
    assert request.retry_blocked is not None
    verdict = fail(request, "att-1", "r1:1")
    assert isinstance(verdict, FailRequest) and verdict.code == Outcome.RETRY_NOT_ALLOWED
    [refusal] = arrive(request, "att-2", "b1:1")
    assert isinstance(refusal, RefuseAttempt)
    assert request.answered_by_fallback is None


def test_the_fallbacks_own_failure_ends_the_request_at_its_max_attempts() -> None:
    request = admitted(destinations=OWN.with_fallback(BIG, 2))  # two fallback entries, max_attempts 1
    fail(request, "att-1", "r1:1")
    fail(request, "att-2", "r2:1")
    verdict = fail(request, "att-3", "b1:1", model="big")
    assert isinstance(verdict, FailRequest) and verdict.code == Outcome.RETRIES_EXHAUSTED
    [refusal] = arrive(request, "att-4", "b2:1")
    assert isinstance(refusal, RefuseAttempt)
    assert request.answered_by_fallback is None and request.counted == 3


def test_never_after_the_first_delta() -> None:
    request = admitted()
    own = start(request, "att-1", "r1:1")
    release(request, own)
    started(request)
    assert len(feed(request, [ROLE + C1], eos_last=False)) == 1  # its first content went to the client
    fa(request, own, StreamReset())  # then its stream is cut
    [refusal] = arrive(request, "att-2", "b1:1")
    assert isinstance(refusal, RefuseAttempt) and refusal.error.code == Outcome.UPSTREAM_DECODE_INTERRUPTED
    assert request.answered_by_fallback is None
    assert not events(request, EventName.ANSWERED_BY_FALLBACK)


def test_no_replica_of_its_own_the_fallback_answers_as_unavailable() -> None:
    order = Destinations((), GATEWAY).with_fallback(BIG[:1], 0, "unavailable")
    request = admitted(destinations=order)
    release(request, start(request, "att-1", "b1:1", model="big"))
    assert request.answered_by_fallback == ("big", ("unavailable",))
    [event] = events(request, EventName.ANSWERED_BY_FALLBACK)
    assert (event["reason"], event["detail"]) == ("unavailable", "unavailable")
    assert dict(views.request_id_headers(request))["x-router-attempts"] == "1"


def test_an_own_answer_is_not_a_fallback() -> None:
    request = admitted()
    fail(request, "att-1", "r1:1")
    release(request, start(request, "att-2", "r2:1"))
    assert request.answered_by_fallback is None
    assert "x-router-fallback" not in dict(views.request_id_headers(request))
    assert not views.journal_record(request).HasField("fallback")


def test_a_first_attempt_on_a_fallback_entry_is_a_fallback_for_unavailable() -> None:
    """Envoy skips an entry it does not know (the request's own replicas gone from EDS since admission):
    a first attempt arriving on a fallback entry has no failure of its own model before it, so its cause is
    `unavailable`, allowed or not by the policy like any other."""
    refused = admitted(ONLY_OVERLOADED)
    [refusal] = arrive(refused, "att-1", "b1:1")
    assert isinstance(refusal, RefuseAttempt) and refused.answered_by_fallback is None
    allowed = admitted()
    release(allowed, start(allowed, "att-1", "b1:1", model="big"))
    assert allowed.answered_by_fallback == ("big", ("unavailable",))
