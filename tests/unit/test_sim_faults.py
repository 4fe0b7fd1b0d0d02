"""Parsing and selection of the simulator's ``x-sim-fault`` spec."""

from __future__ import annotations

import pytest

from router_testbed.sim.faults import (
    DEFAULT_OVERSIZE_BYTES,
    DONE,
    HEADERS,
    ROLE,
    TERMINAL,
    TOOL,
    Clause,
    FaultPlan,
    FaultSpecError,
    Point,
    RetryAfter,
    after_point,
    parse_attempt,
    parse_clause,
    parse_fault_spec,
    token_point,
)


def test_parse_full_clause() -> None:
    (c,) = parse_fault_spec("reset@token:3 attempt=1,3 replica=r1,r2")
    assert c == Clause("reset", Point("token", 3), frozenset({1, 3}), frozenset({"r1", "r2"}))
    assert c.label() == "reset@token:3"


@pytest.mark.parametrize(
    ("text", "point"),
    [
        ("exit@tool", TOOL),
        ("exit@headers", HEADERS),
        ("close@role", ROLE),
        ("error@after:2", after_point(2)),
        ("abort@token:1", token_point(1)),
        ("stall@done", DONE),
        ("close@terminal", TERMINAL),
        ("stop@token:2", token_point(2)),
        ("status429@headers", HEADERS),
        ("oversize@token:3", token_point(3)),
    ],
)
def test_points(text: str, point: Point) -> None:
    assert parse_clause(text).point == point


def test_multiple_clauses_and_blank() -> None:
    spec = " delay@role for=0.5 ; reset@token:1 attempt=1;stall@after:2 for=1.5; "
    clauses = parse_fault_spec(spec)
    assert [c.label() for c in clauses] == ["delay@role", "reset@token:1", "stall@after:2"]
    assert clauses[0].duration == 0.5 and clauses[2].duration == 1.5 and clauses[1].duration is None
    assert parse_fault_spec(None) == [] and parse_fault_spec("  ") == []


@pytest.mark.parametrize(
    ("spec", "fragment"),
    [
        ("rest@token:1", "unknown action 'rest'"),
        ("reset@tokn:1", "unknown point 'tokn:1'"),
        ("exit@tools", "expected tool, headers, role"),
        ("exit@tool:1", "unknown point 'tool:1'"),
        ("status503@tool", "only valid at @headers"),
        ("reset@token:0", "N >= 1"),
        ("reset@token:x", "N >= 1"),
        ("reset@token", "unknown point 'token'"),
        ("reset", "expected ACTION@POINT"),
        ("reset@role atempt=1", "unknown modifier 'atempt'"),
        ("reset@role attempt=one", "attempt="),
        ("reset@role attempt=0", "attempt="),
        ("reset@role attempt", "not key=value"),
        ("reset@role for=1", "only valid with stall or delay"),
        ("delay@role", "delay needs for=SECONDS"),
        ("stall@role for=-1", "finite number >= 0"),
        ("status503@token:1", "only valid at @headers"),
        ("reset@role attempt=1 attempt=2", "given twice"),
        ("status429@role", "only valid at @headers"),
        ("oversize@after:1", "only valid at @token:N"),
        ("oversize@headers", "only valid at @token:N"),
        ("oversize@token:1 bytes=0", "bytes="),
        ("oversize@token:1 bytes=lots", "bytes="),
        ("oversize@token:1 bytes=99999999999", "bytes="),
        ("reset@token:1 bytes=10", "only valid with oversize"),
        ("close@terminl", "terminal"),
        ("reset@role retry_after=1", "only valid with status503 or status429"),
        ("status429@headers retry_after=-1", "whole seconds"),
        ("status429@headers retry_after=1.5", "whole seconds"),
        ("status503@headers retry_after=date:", "whole seconds"),
        ("status503@headers retry_after=99999999", "whole seconds"),
        ("status429@headers retry_after=1 retry_after=2", "given twice"),
    ],
)
def test_errors_name_the_clause(spec: str, fragment: str) -> None:
    with pytest.raises(FaultSpecError) as info:
        parse_fault_spec(f"close@done; {spec}")
    assert info.value.clause == spec
    assert spec in str(info.value) and fragment in str(info.value)


def test_attempt_filter() -> None:
    clauses = parse_fault_spec("reset@token:1 attempt=2")
    assert FaultPlan(clauses, attempt=1, replica="r").empty
    assert not FaultPlan(clauses, attempt=2, replica="r").empty
    assert FaultPlan(clauses, attempt=None, replica="r").empty  # no header: attempt clauses never fire
    assert not FaultPlan(parse_fault_spec("reset@token:1"), attempt=None, replica="r").empty


def test_replica_filter() -> None:
    clauses = parse_fault_spec("exit@headers replica=a,b")
    assert not FaultPlan(clauses, attempt=1, replica="b").empty
    assert FaultPlan(clauses, attempt=1, replica="c").empty


def test_plan_fires_each_clause_once_in_order() -> None:
    plan = FaultPlan(parse_fault_spec("delay@role for=0; reset@role; error@after:1"), attempt=1, replica="r")
    assert plan.take(HEADERS) is None
    first = plan.take(ROLE)
    second = plan.take(ROLE)
    assert first is not None and first.action == "delay"
    assert second is not None and second.action == "reset"
    assert plan.take(ROLE) is None
    assert plan.take(after_point(2)) is None
    assert [c.label() for c in plan.fired] == ["delay@role", "reset@role"]


def test_parse_attempt() -> None:
    assert parse_attempt("2") == 2
    assert parse_attempt(" 1 ") == 1
    assert parse_attempt(None) is None
    assert parse_attempt("x") is None


def test_tool_point_clause_with_attempt_filter() -> None:
    (c,) = parse_fault_spec("exit@tool attempt=1")
    assert c == Clause("exit", TOOL, frozenset({1}))
    assert c.label() == "exit@tool" and str(TOOL) == "tool"
    plan = FaultPlan([c], attempt=1, replica="w1")
    assert plan.take(HEADERS) is None
    assert plan.take(TOOL) is c and plan.take(TOOL) is None
    assert FaultPlan([c], attempt=2, replica="w1").empty


@pytest.mark.parametrize("spec", ["delay@tool for=0.2", "stall@tool for=1", "reset@tool", "error@tool"])
def test_other_actions_at_tool(spec: str) -> None:
    assert parse_clause(spec).point == TOOL


def test_oversize_sizes_and_the_plan_knows_them_in_advance() -> None:
    spec = parse_fault_spec("oversize@token:2; oversize@token:5 bytes=4096")
    plan = FaultPlan(spec, attempt=1, replica="r")
    assert plan.oversized() == {2: DEFAULT_OVERSIZE_BYTES, 5: 4096}
    assert DEFAULT_OVERSIZE_BYTES > 1024 * 1024  # over the gateway's default limits.max_event_bytes
    clause = plan.take(token_point(2))
    assert clause is not None and clause.size == DEFAULT_OVERSIZE_BYTES
    assert plan.oversized() == {5: 4096}  # fired clauses are no longer pending
    filtered = FaultPlan(parse_fault_spec("oversize@token:1 attempt=2"), attempt=1, replica="r")
    assert filtered.oversized() == {}


@pytest.mark.parametrize("spec", ["stop@after:3", "stop@done", "abort@role", "stop@headers"])
def test_finish_actions_parse_at_any_point(spec: str) -> None:
    # abort/stop take effect at the next content boundary; the fuzz suite draws them anywhere
    assert parse_clause(spec).action in ("abort", "stop")


def test_status_faults_take_a_retry_after() -> None:
    (seconds, date, none) = parse_fault_spec(
        "status429@headers retry_after=2; status503@headers retry_after=date:3 attempt=1; status503@headers"
    )
    assert (seconds.retry_after, date.retry_after, none.retry_after) == (
        RetryAfter(2),
        RetryAfter(3, http_date=True),
        None,
    )
    assert date.attempts == frozenset({1})
    assert seconds.retry_after is not None and seconds.retry_after.header_value(1e9) == "2"
    # 2001-09-09T01:46:40Z, rounded up to the second, plus 3 s.
    assert date.retry_after is not None
    assert date.retry_after.header_value(1e9 + 0.25) == "Sun, 09 Sep 2001 01:46:44 GMT"
