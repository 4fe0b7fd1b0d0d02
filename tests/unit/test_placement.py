"""Where retries land (core/placement.py, core/destinations.py ranking): prompt blocks, warm prefixes,
overload ejections, each tenant's retry budget, and the request machine telling it what happened."""

from __future__ import annotations

import json
import random
from datetime import UTC, datetime
from email.utils import format_datetime
from typing import Any

import pytest

from router_sidecar.core.attempt import FailRequest, ResponseHeaders, StreamReset, TriggerRetry
from router_sidecar.core.destinations import HOLDER, Candidate, Destinations, Ranking, choose
from router_sidecar.core.events import EventName, Outcome
from router_sidecar.core.openai_api import RouteKind, parse_request, prompt_blocks
from router_sidecar.core.placement import (
    CONNECT,
    OVERLOAD,
    Ejection,
    Ejections,
    Placement,
    PrefixIndex,
    retry_after_seconds,
)
from router_sidecar.core.policy import DEFAULT_POLICY, Policy, policy_from_mapping
from router_sidecar.core.request import (
    Admitted,
    AttemptArrived,
    ForwardAttempt,
    GrantLease,
    LogicalRequest,
    RefuseAttempt,
)
from tests.unit.test_request import SSE, begin, fa, failed, grant, parsed, settle_claim

BLOCK = 32


def blocks(route: str, body: dict[str, Any], max_blocks: int = 512) -> tuple[int, ...]:
    return prompt_blocks(route, body, block_bytes=BLOCK, max_blocks=max_blocks)


def chat(*turns: str, model: str = "m") -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": t} for t in turns]}


# --- prompt blocks ---------------------------------------------------------------------------------------


def test_a_conversation_that_grows_keeps_its_earlier_blocks() -> None:
    first = blocks("chat.completions", chat("x" * 200))
    grown = blocks("chat.completions", chat("x" * 200, "and then " * 30))
    assert len(first) >= 6 and len(grown) > len(first)
    # Every whole block of the shorter prompt but the one its end cuts is shared.
    assert first[:-1] == grown[: len(first) - 1]


def test_blocks_are_chained_model_bound_and_bounded() -> None:
    base = blocks("chat.completions", chat("y" * 400))
    # A different first message changes every block after it, even where the bytes are the same.
    other = blocks("chat.completions", chat("z" + "y" * 399))
    assert not set(base) & set(other)
    assert not set(base) & set(blocks("chat.completions", chat("y" * 400, model="other")))
    assert len(blocks("chat.completions", chat("y" * 400), max_blocks=3)) == 3
    # No whole block: nothing to be warm for.
    assert prompt_blocks("chat.completions", chat("short"), block_bytes=256, max_blocks=8) == ()
    assert blocks("chat.completions", chat("y" * 400)) == base  # deterministic


@pytest.mark.parametrize(
    ("route", "body"),
    [
        ("completions", {"model": "m", "prompt": "p" * 300}),
        ("responses", {"model": "m", "instructions": "be brief " * 10, "input": "i" * 200}),
        ("responses", {"model": "m", "input": [{"role": "user", "content": "c" * 300}]}),
        (
            "messages",
            {"model": "m", "system": "s" * 100, "messages": [{"role": "user", "content": "u" * 200}]},
        ),
    ],
)
def test_every_api_has_prompt_blocks(route: str, body: dict[str, Any]) -> None:
    assert len(blocks(route, body)) >= 5


def test_parse_request_carries_the_prompt_blocks() -> None:
    body = json.dumps(chat("w" * 2000)).encode()
    parsed_request = parse_request(RouteKind.CHAT, body, max_body_bytes=1 << 20, prefix_block_bytes=256)
    assert len(parsed_request.prefix_blocks) == len(blocks("chat.completions", chat("w" * 2000))) // 8


def test_hostile_prompts_hash_without_error() -> None:
    rng = random.Random(7)
    for _ in range(200):
        value: Any = rng.choice(
            [None, 3, [], [1, 2], {"a": [None]}, "é" * rng.randint(0, 300), [{"x": "y"}] * 5]
        )
        body = {"model": rng.choice(["m", 5, None]), "messages": value, "prompt": value, "input": value}
        for route in ("chat.completions", "completions", "responses", "messages"):
            assert all(isinstance(b, int) for b in blocks(route, body))


# --- the prefix index ---------------------------------------------------------------------------------


def test_warm_counts_leading_blocks_within_the_ttl() -> None:
    index = PrefixIndex(per_replica=100, ttl_seconds=10)
    index.record("a", (1, 2, 3), now=0)
    assert index.warm("a", (1, 2, 3, 4), now=5) == 3
    assert index.warm("a", (9, 2, 3), now=5) == 0  # leading only: a cache holds prefixes
    assert index.warm("b", (1, 2, 3), now=5) == 0
    assert index.warm("a", (1, 2, 3), now=11) == 0  # aged out
    index.record("a", (1,), now=11)
    assert index.warm("a", (1, 2, 3), now=12) == 1


def test_the_index_is_bounded_per_replica_least_recently_served_first() -> None:
    index = PrefixIndex(per_replica=4, ttl_seconds=100)
    index.record("a", (1, 2, 3), now=0)
    index.record("a", (7, 8), now=1)
    assert index.size("a") == 4
    assert index.warm("a", (1,), now=2) == 0 and index.warm("a", (2, 3), now=2) == 2
    index.record("a", range(1000), now=3)  # one huge prompt cannot grow it past the bound
    assert index.size("a") == 4
    index.forget(["b"])
    assert index.size("a") == 0


# --- Retry-After and ejections ---------------------------------------------------------------------


def test_retry_after_seconds_and_dates() -> None:
    now = 1_800_000_000.0
    assert retry_after_seconds("5", now) == 5
    assert retry_after_seconds(" 12 ", now) == 12
    date = format_datetime(datetime.fromtimestamp(now + 30, UTC), usegmt=True)
    assert retry_after_seconds(date, now) == pytest.approx(30)
    past = format_datetime(datetime.fromtimestamp(now - 30, UTC), usegmt=True)
    assert retry_after_seconds(past, now) == 0
    for junk in (None, "", "soon", "-3", "1.5", "Mon, 99 Foo", "9" * 60):
        value = retry_after_seconds(junk, now)
        assert value is None or value >= 0


def test_a_hard_ejection_is_not_shortened_and_lapses() -> None:
    ejections = Ejections()
    ejections.eject("a", Ejection(10, "429", OVERLOAD))
    ejections.eject("a", Ejection(20, "connect", CONNECT))
    ejections.eject("a", Ejection(5, "shorter", OVERLOAD))
    assert ejections.active(1)["a"].why == "429"
    assert ejections.active(10) == {}


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def placement(policy: Policy = DEFAULT_POLICY) -> tuple[Placement, Clock]:
    clock = Clock()
    return Placement(policy, clock=clock, wall_clock=lambda: 1_800_000_000.0), clock


CANDIDATES = [Candidate("a:1"), Candidate("b:1"), Candidate("c:1")]


def test_a_replica_that_announced_an_overload_is_out_of_the_order_until_it_lapses() -> None:
    book, clock = placement()
    book.answered("b:1", 429, "3")
    book.answered("c:1", 500, "3")  # not an overload
    book.answered("c:1", 503, None)  # no time said: nothing to hold it out for
    marked, ranking = book.ranking(CANDIDATES, ())
    destinations = choose(marked, pinned=None, ranking=ranking)
    assert "b:1" not in destinations.order and len(destinations.order) == 2
    (why,) = [w for a, w in destinations.excluded if a == "b:1"]
    assert why.startswith("ejected for 3.0 s more") and "429 with Retry-After 3" in why
    clock.now += 3.01
    marked, ranking = book.ranking(CANDIDATES, ())
    assert len(choose(marked, pinned=None, ranking=ranking).order) == 3


def test_retry_after_is_capped_by_policy() -> None:
    book, clock = placement(policy_from_mapping({"placement": {"max_retry_after_seconds": 2}}))
    book.answered("a:1", 503, "3600")
    clock.now += 2.5
    marked, _ = book.ranking(CANDIDATES, ())
    assert all(not c.why_not for c in marked)


def test_every_replica_overloaded_is_the_shortest_time_left_and_no_order() -> None:
    book, clock = placement()
    for address, seconds in (("a:1", "9"), ("b:1", "4"), ("c:1", "30")):
        book.answered(address, 429, seconds)
    clock.now += 1
    marked, ranking = book.ranking(CANDIDATES, ())
    destinations = choose(marked, pinned=None, ranking=ranking)
    assert destinations.order == () and destinations.overloaded_for == pytest.approx(3)


def test_a_connect_failure_puts_the_replica_last_for_a_moment() -> None:
    book, clock = placement()
    book.unreachable("a:1")
    for turn in range(3):
        marked, ranking = book.ranking(CANDIDATES, ())
        assert choose(marked, pinned=None, turn=turn, ranking=ranking).order[-1] == "a:1"
    clock.now += 2.01
    marked, ranking = book.ranking(CANDIDATES, ())
    assert choose(marked, pinned=None, turn=0, ranking=ranking).order[0] == "a:1"


# --- ranking ------------------------------------------------------------------------------------------


def test_retries_go_warm_first_then_least_loaded_the_first_attempt_round_robin() -> None:
    ranking = Ranking(blocks=8, warm={"c:1": 6, "b:1": 2}, in_flight={"b:1": 0, "c:1": 5})
    seen_first = set()
    for turn in range(6):
        d = choose(CANDIDATES, pinned=None, turn=turn, ranking=ranking)
        seen_first.add(d.order[0])
        rest = [a for a in ("c:1", "b:1", "a:1") if a != d.order[0]]
        assert list(d.order[1:]) == rest  # warmest first, whatever the turn
    assert seen_first == {"a:1", "b:1", "c:1"}
    d = choose(CANDIDATES, pinned=None, turn=0, ranking=ranking)
    assert d.why("c:1") == "gateway choice #2 (warm prefix 6 of 8 blocks, 5 in flight)"
    # Equally warm: fewer in flight first.
    even = Ranking(blocks=8, warm={}, in_flight={"b:1": 3, "c:1": 1})
    assert choose(CANDIDATES, pinned=None, turn=0, ranking=even).order == ("a:1", "c:1", "b:1")


def test_behind_a_picker_its_list_comes_first_and_the_rest_is_ranked() -> None:
    ranking = Ranking(blocks=4, warm={"a:1": 4}, in_flight={})
    d = choose(CANDIDATES, pinned=None, picker=["b:1"], ranking=ranking)
    assert d.order == ("b:1", "a:1", "c:1") and d.from_picker == 1
    assert d.ranked == (("a:1", 4, 0), ("c:1", 0, 0))
    assert d.why("b:1") == "picker choice #1"
    # The warm replica is the picker's own choice: the retry goes to a cold one.
    assert choose(CANDIDATES, pinned=None, picker=["a:1"], ranking=ranking).order[:2] in (
        ("a:1", "b:1"),
        ("a:1", "c:1"),
    )


def test_the_placement_ranks_by_what_it_was_told() -> None:
    book, clock = placement()
    warm = blocks("chat.completions", chat("q" * 400))
    book.attempt_sent("c:1", warm)
    marked, ranking = book.ranking(CANDIDATES, warm)
    assert ranking.warm["c:1"] == len(warm) and ranking.blocks == len(warm)
    d = choose(marked, pinned=None, picker=["a:1"], ranking=ranking)
    assert d.order == ("a:1", "c:1", "b:1")
    clock.now += DEFAULT_POLICY.placement.prefix_ttl_seconds + 1
    marked, ranking = book.ranking(CANDIDATES, warm)
    assert ranking.warm["c:1"] == 0


# --- the request machine tells it; the tenant budget ---------------------------------------------------


def admitted(book: Placement, tenant: str, prompt: str = "hi") -> LogicalRequest:
    request = LogicalRequest(
        request_id=f"req-{random.random()}",
        tenant=tenant,
        parsed=parsed(prompt),
        policy=book_policy,
        placement=book,
    )
    request.handle(Admitted())
    settle_claim(request)
    return request


book_policy = policy_from_mapping(
    {"budgets": {"tenant_retry_budget_percent": 0, "tenant_min_retry_concurrency": 1}}
)


def test_a_tenant_past_its_budget_is_refused_another_tenant_is_not() -> None:
    book, _ = placement(book_policy)
    first, second, other = admitted(book, "t1"), admitted(book, "t1"), admitted(book, "t2")
    assert failed(first, ResponseHeaders(200, SSE), StreamReset()) == TriggerRetry("connection_lost")
    refused = failed(second, ResponseHeaders(200, SSE), StreamReset())
    assert isinstance(refused, FailRequest)
    assert (refused.status, refused.code) == (503, Outcome.RETRY_BUDGET_EXHAUSTED)
    assert "tenant's retry budget" in refused.message and refused.detail is not None
    assert refused.detail.startswith("tenant budget: 1 of the tenant's 2 requests in flight are in retry")
    events = {e.name: e.detail for e in second.drain_events()}
    assert events[EventName.RETRY_REFUSED] == {"reason": "retry_budget_exhausted", "detail": refused.detail}
    assert failed(other, ResponseHeaders(200, SSE), StreamReset()) == TriggerRetry("connection_lost")


def test_a_slot_is_free_again_when_its_request_ends() -> None:
    book, _ = placement(book_policy)
    first = admitted(book, "t1")
    assert failed(first, ResponseHeaders(200, SSE), StreamReset()) == TriggerRetry("connection_lost")
    # Its retry fails too, and the request ends (max_attempts 2): the tenant's slot is free.
    assert isinstance(
        failed(first, ResponseHeaders(200, SSE), StreamReset(), attempt_id="att-2"), FailRequest
    )
    assert first.is_terminal
    second = admitted(book, "t1")
    assert failed(second, ResponseHeaders(200, SSE), StreamReset()) == TriggerRetry("connection_lost")


def test_no_budget_applies_when_the_policy_does_not_require_one() -> None:
    policy = policy_from_mapping(
        {
            "on_upstream_failure": {"before_first_delta": {"require": ["source_attempt_fenced"]}},
            "budgets": {"tenant_retry_budget_percent": 0, "tenant_min_retry_concurrency": 0},
        }
    )
    book, _ = placement(policy)
    request = LogicalRequest(request_id="r", tenant="t", parsed=parsed(), policy=policy, placement=book)
    request.handle(Admitted())
    settle_claim(request)
    assert failed(request, ResponseHeaders(200, SSE), StreamReset()) == TriggerRetry("connection_lost")


def test_the_machine_records_where_prompts_went_and_who_refused() -> None:
    book, _ = placement()
    request = admitted(book, "t1", prompt="p" * 2000)
    attempt = begin(request, "att-1", "r1")
    assert (
        book.prefixes.warm("r1", request.parsed.prefix_blocks, book_clock(book))
        == len(request.parsed.prefix_blocks)
        > 0
    )
    fa(request, attempt, ResponseHeaders(429, "application/json", retry_after="7"))
    marked, _ = book.ranking([Candidate("r1"), Candidate("r2")], ())
    assert marked[0].why_not.startswith("ejected for 7.0 s more: it answered 429 with Retry-After 7")
    assert marked[0].ejected_for == pytest.approx(7)


def book_clock(book: Placement) -> float:
    return book._clock()


def test_a_request_on_a_stored_response_never_goes_past_its_holder() -> None:
    """Envoy's fallback, once the holder's connection failed, would send it to a replica that answers 404:
    the machine refuses that attempt with the error that names the response and its holder."""
    body = {"model": "m", "input": "hi", "stream": True, "previous_response_id": "resp_1"}
    parsed_request = parse_request(RouteKind.RESPONSES, json.dumps(body).encode(), max_body_bytes=1 << 20)
    request = LogicalRequest(request_id="r", tenant="t", parsed=parsed_request, policy=DEFAULT_POLICY)
    request.handle(Admitted(Destinations(("holder:1",), HOLDER)))
    settle_claim(request)
    decisions = request.handle(AttemptArrived("att-1", "other:1", envoy_attempt=2))
    (refusal,) = [d for d in decisions if isinstance(d, RefuseAttempt)]
    error = refusal.error
    assert isinstance(error, FailRequest)
    assert (error.status, error.code) == (503, Outcome.STORED_RESPONSE_UNAVAILABLE)
    assert "resp_1 is stored on replica holder:1, which could not be reached" in error.message
    assert request.is_terminal and [a.state.value for a in request.attempts] == ["never_sent"]


def test_a_lone_surrogate_in_the_prompt_is_hashed_not_refused() -> None:
    body = b'{"model": "m", "messages": [{"role": "user", "content": "\\ud800' + b"x" * 600 + b'"}]}'
    assert len(parse_request(RouteKind.CHAT, body, max_body_bytes=1 << 20).prefix_blocks) == 2


def test_only_what_is_hashed_is_serialized() -> None:
    turns = ["t" * 100] * 1000  # ~100 KB of messages; 4 blocks of 32 bytes are wanted
    assert len(blocks("chat.completions", chat(*turns), max_blocks=4)) == 4
    assert blocks("chat.completions", chat(*turns), max_blocks=4) == blocks(
        "chat.completions", chat(*turns[:2]), max_blocks=4
    )


# --- the circuit breaker -------------------------------------------------------------------------------


BREAKER_POLICY = policy_from_mapping(
    {"placement": {"breaker_failures": 3, "breaker_open_seconds": 2, "breaker_max_open_seconds": 5}}
)


def test_failures_in_a_row_open_the_circuit_which_doubles_and_a_success_closes_it() -> None:
    book, clock = placement(BREAKER_POLICY)
    for _ in range(2):
        book.failed_before_content("a:1")
    marked, _ = book.ranking(CANDIDATES, ())
    assert not marked[0].why_not  # two in a row: still closed
    book.failed_before_content("a:1")
    marked, _ = book.ranking(CANDIDATES, ())
    assert marked[0].why_not.startswith("ejected for 2.0 s more: circuit open: 3 attempts in a row")
    assert marked[0].ejected_by == "breaker"
    clock.now += 2.01
    marked, _ = book.ranking(CANDIDATES, ())
    assert not marked[0].why_not  # tried again
    book.failed_before_content("a:1")  # the trial failed: open again, twice as long
    clock.now += 3.9
    assert book.ranking(CANDIDATES, ())[0][0].why_not
    clock.now += 0.2
    book.failed_before_content("a:1")  # capped at 5 s
    clock.now += 5.01
    assert not book.ranking(CANDIDATES, ())[0][0].why_not
    book.succeeded("a:1")
    book.failed_before_content("a:1")
    assert not book.ranking(CANDIDATES, ())[0][0].why_not  # one success closed it: counting from 0


def test_every_circuit_open_is_no_order_and_the_shortest_time_left() -> None:
    book, clock = placement(BREAKER_POLICY)
    for address in ("a:1", "b:1", "c:1"):
        for _ in range(3):
            book.failed_before_content(address)
        clock.now += 0.5
    marked, ranking = book.ranking(CANDIDATES, ())
    destinations = choose(marked, pinned=None, ranking=ranking)
    assert destinations.order == () and destinations.ejected_by == "breaker"
    assert destinations.overloaded_for == pytest.approx(0.5)


def test_no_breaker_by_default() -> None:
    book, _ = placement()
    for _ in range(100):
        book.failed_before_content("a:1")
    assert all(not c.why_not for c in book.ranking(CANDIDATES, ())[0])


def test_the_machine_counts_failures_before_content_and_successes() -> None:
    book, _ = placement(BREAKER_POLICY)
    for _ in range(3):
        request = LogicalRequest(
            request_id="r", tenant="t", parsed=parsed(), policy=BREAKER_POLICY, placement=book
        )
        request.handle(Admitted())
        settle_claim(request)
        failed(request, ResponseHeaders(200, SSE), StreamReset())  # on r1 (the helper's replica)
    assert book.ranking([Candidate("r1")], ())[0][0].ejected_by == "breaker"


def test_a_failure_whose_verdict_waited_for_the_claim_is_counted_once() -> None:
    """The first attempt may fail before the request's journal claim settled: its verdict waits and is
    given again once the claim is back. The breaker counts that failure once (it counted it twice, so one
    503 opened a circuit of breaker_failures 2)."""
    policy = policy_from_mapping({"placement": {"breaker_failures": 2, "breaker_open_seconds": 2}})
    book, _ = placement(policy)
    request = LogicalRequest(request_id="r", tenant="t", parsed=parsed(), policy=policy, placement=book)
    request.handle(Admitted())  # the claim is pending
    assert request.handle(AttemptArrived("att-1", "r1")) == [GrantLease("att-1", "r1")]
    assert grant(request, "att-1") == [ForwardAttempt("att-1")]
    attempt = request.attempt("att-1")
    assert attempt is not None
    fa(request, attempt, ResponseHeaders(503, "application/json"))
    assert attempt.verdict is None  # waiting for the claim
    settle_claim(request)
    assert isinstance(attempt.verdict, TriggerRetry)
    assert not book.ranking([Candidate("r1")], ())[0][0].why_not  # one failure: still closed
    book.failed_before_content("r1")
    assert book.ranking([Candidate("r1")], ())[0][0].ejected_by == "breaker"  # the second opens it
