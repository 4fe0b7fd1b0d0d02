"""Where a request's attempts go (core/destinations.py): the order, its source, what was left out and why,
and the journal's record of it (sans-IO: no servers)."""

from __future__ import annotations

import json
import random

import pytest

from router_sidecar.core import request as r
from router_sidecar.core import views
from router_sidecar.core.destinations import (
    MAX_PICKER_ENTRIES,
    Candidate,
    Destinations,
    choose,
    holder_only,
    picker_list,
)
from router_sidecar.core.dialects import StreamNotes
from router_sidecar.core.openai_api import ParsedRequest, RequestRejected, RouteKind, parse_request
from router_sidecar.core.routes import RouteClass, classify
from tests.unit.test_request import DEFAULT_POLICY, RID, parsed

A, B, C, D = "10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000", "10.0.0.4:8000"


def test_without_a_picker_the_gateway_round_robins_over_the_usable_replicas() -> None:
    candidates = [Candidate(A), Candidate(B), Candidate(C)]
    orders = [choose(candidates, pinned=None, turn=turn).order for turn in range(4)]
    assert orders == [(A, B, C), (B, C, A), (C, A, B), (A, B, C)]
    assert {choose(candidates, pinned=None, turn=t).source for t in range(3)} == {"gateway"}


def test_draining_lost_and_incompatible_replicas_are_left_out_with_why() -> None:
    candidates = [
        Candidate(A, "fp1"),
        Candidate(B, "fp2"),
        Candidate(C, "fp1", "draining"),
        Candidate(D, None, "failing its health checks"),
    ]
    chosen = choose(candidates, pinned="fp1")
    assert chosen.order == (A,)
    assert dict(chosen.excluded) == {
        B: "incompatible with the pinned fingerprint fp1",
        C: "draining",
        D: "failing its health checks",
    }


def test_the_pickers_list_comes_first_in_its_order_then_the_gateways() -> None:
    candidates = [Candidate(A, "fp"), Candidate(B, "fp"), Candidate(C, "fp"), Candidate(D, "other")]
    chosen = choose(candidates, pinned="fp", picker=[C, "10.9.9.9:1", D, A, C], turn=1)
    assert chosen.order == (C, A, B)
    assert chosen.source == "picker+gateway" and chosen.from_picker == 2
    assert chosen.picker == (C, "10.9.9.9:1", D, A, C)
    assert dict(chosen.excluded) == {
        "10.9.9.9:1": "not a replica this gateway knows",
        D: "incompatible with the pinned fingerprint fp",
    }
    assert [chosen.why(x) for x in (C, A, B)] == ["picker choice #1", "picker choice #2", "gateway choice #3"]
    assert chosen.why(D).startswith("envoy:")


def test_a_picker_naming_every_replica_is_the_whole_order() -> None:
    chosen = choose([Candidate(A), Candidate(B)], pinned=None, picker=[B, A])
    assert (chosen.order, chosen.source) == ((B, A), "picker")


def test_no_usable_replica_gives_an_empty_order_that_leaves_envoy_to_choose() -> None:
    chosen = choose([Candidate(A, None, "draining")], pinned=None, picker=["nonsense"])
    assert chosen.order == () and chosen.source == "gateway"
    assert chosen.why(A).startswith("envoy:")


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (f"{A},{B}", (A, B)),
        (f" {A} , ,{B},", (A, B)),
        ([A, f"{B},{C}"], (A, B, C)),
        ("", ()),
        (None, ()),
        (3.0, ()),
        ({"a": 1}, ()),
        ([1.0, None, A], (A,)),
    ],
)
def test_the_pickers_metadata_value_is_read_as_the_protocol_writes_it(value: object, expected: tuple) -> None:
    assert picker_list(value) == expected


def test_a_hostile_picker_list_is_bounded() -> None:
    huge = ",".join(f"10.0.{i // 250}.{i % 250}:80" for i in range(100_000))
    assert len(picker_list(huge)) <= MAX_PICKER_ENTRIES
    assert len(picker_list([huge] * 10_000)) == MAX_PICKER_ENTRIES
    assert picker_list("x" * 10_000_000) == ("x" * 4096,)


def test_any_inputs_give_an_order_of_distinct_usable_compatible_known_replicas() -> None:
    rng = random.Random(2026)  # seeded: replayable
    pool = [f"10.0.0.{i}:80" for i in range(8)]
    for _ in range(2000):
        candidates = [
            Candidate(a, rng.choice([None, "fp1", "fp2"]), rng.choice(["", "", "draining"]))
            for a in rng.sample(pool, rng.randint(0, 8))
        ]
        picker = [rng.choice([*pool, "junk", ""]) for _ in range(rng.randint(0, 10))]
        pinned = rng.choice([None, "fp1"])
        chosen = choose(candidates, pinned=pinned, picker=picker, turn=rng.randint(0, 99))
        known = {c.address: c for c in candidates}
        assert len(set(chosen.order)) == len(chosen.order)
        for address in chosen.order:
            c = known[address]
            assert not c.why_not and (pinned is None or c.digest in (None, pinned))
        usable = {
            a for a, c in known.items() if not c.why_not and (pinned is None or c.digest in (None, pinned))
        }
        assert set(chosen.order) == usable  # every usable replica is in the order: none is skipped
        head = [a for a in dict.fromkeys(picker) if a in usable]
        assert list(chosen.order[: chosen.from_picker]) == head  # the picker's order is kept
        assert set(chosen.order).isdisjoint(dict(chosen.excluded))


# --- the journal -------------------------------------------------------------------------------------------


def new_request() -> r.LogicalRequest:
    return r.LogicalRequest(request_id=RID, tenant="t1", parsed=parsed(), policy=DEFAULT_POLICY)


def test_the_journal_records_the_order_and_why_each_attempt_went_where_it_went() -> None:
    request = new_request()
    chosen = Destinations((B, A), "picker+gateway", picker=(B, C), excluded=((C, "draining"),), from_picker=1)
    request.handle(r.Admitted(chosen))
    request.handle(r.ClaimSettled(r.ClaimOutcome.GRANTED))
    request.handle(r.AttemptArrived("att-1", B, 1))
    request.handle(r.LeaseGranted("att-1", lease=None, ttl_seconds=10, replica_side=False))
    record = views.journal_view(request)
    assert record["destinations"] == {
        "source": "picker+gateway",
        "order": [B, A],
        "picker": [B, C],
        "excluded": [{"replica": C, "why": "draining"}],
    }
    assert record["attempts"][0]["replica"] == B
    assert record["attempts"][0]["chosen_by"] == "picker choice #1"
    started = [e for e in request.drain_events() if e.name.value == "attempt_started"]
    assert started[0].detail["reason"] == "picker choice #1"


def test_without_destinations_the_record_has_none() -> None:
    request = new_request()
    request.handle(r.Admitted())
    record = views.journal_view(request)
    assert "destinations" not in record


# --- state one replica holds -------------------------------------------------------------------------------


def test_a_request_on_stored_state_goes_to_its_holder_only_even_draining() -> None:
    candidates = [
        Candidate(A),
        Candidate(B, None, "draining"),
        Candidate(C, None, "failing its health checks"),
    ]
    only = holder_only(candidates, A, picker=[B])
    assert isinstance(only, Destinations) and only.order == (A,) and only.source == "holder"
    assert only.why(A) == "holder of the stored response it continues"
    assert holder_only(candidates, B).order == (B,)  # type: ignore[union-attr]
    assert holder_only(candidates, C) == "is failing its health checks"
    assert holder_only(candidates, D) == "is no longer a replica of this gateway (lost, or removed)"


@pytest.mark.parametrize(
    ("method", "path", "response_id"),
    [
        ("GET", "/v1/responses/resp_1", "resp_1"),
        ("GET", "/v1/responses/resp_1?stream=true&starting_after=4", "resp_1"),
        ("POST", "/v1/responses/resp_1/cancel", "resp_1"),
        ("DELETE", "/v1/responses//resp_1/", "resp_1"),
        ("GET", "/v1/responses/resp_1/input_items", "resp_1"),
    ],
)
def test_requests_on_a_stored_response_are_routed_by_its_id(method: str, path: str, response_id: str) -> None:
    route = classify(method, path)
    assert route.route_class is RouteClass.STORED_RESPONSE and route.response_id == response_id


def test_an_id_that_cannot_be_a_key_is_passed_through() -> None:
    assert classify("GET", "/v1/responses/" + "x" * 201).route_class is RouteClass.PASS_THROUGH
    assert classify("GET", "/v1/responses/a%2Fb").route_class is RouteClass.PASS_THROUGH


def _responses(**extra: object) -> bytes:
    return json.dumps({"model": "tiny", "input": "hi", **extra}).encode()


def parse(body: bytes) -> ParsedRequest:
    return parse_request(RouteKind.RESPONSES, body, max_body_bytes=1 << 20)


def test_previous_response_id_is_parsed_and_bounded() -> None:
    parsed = parse_request(
        RouteKind.RESPONSES, _responses(previous_response_id="resp_9"), max_body_bytes=1 << 20
    )
    assert parsed.previous_response_id == "resp_9" and parsed.stateful and parsed.stores_response
    assert not parse_request(
        RouteKind.RESPONSES, _responses(store=False), max_body_bytes=1 << 20
    ).stores_response
    for bad in ("a/b", "x" * 201, "with space"):
        with pytest.raises(RequestRejected) as rejected:
            parse(_responses(previous_response_id=bad))
        assert rejected.value.param == "previous_response_id"


def test_a_non_stream_bodys_id_is_read_from_its_first_chunk_only() -> None:
    notes = StreamNotes()
    notes.see_body(b' {"id": "resp_abc", "object": "response"')
    notes.see_body(b'{"id": "call_1"}')
    assert notes.response_id == "resp_abc"
    late = StreamNotes()
    late.see_body(b'{"object": "response", "id": "resp_x"}')  # not first: not trusted
    late.see_body(b'{"id": "resp_y"}')
    assert late.response_id is None
