"""The replica-side fence's pure deadline logic (`LeaseValidity`) and header parsing."""

from __future__ import annotations

import pytest

from router_sidecar.coordination.replica_fence import (
    MIN_CHECK_INTERVAL,
    REASON_DEADLINE,
    REASON_REVOKED,
    LeaseValidity,
    parse_lease_header,
)


def test_not_valid_before_the_first_check() -> None:
    v = LeaseValidity()
    assert v.reason(0.0) == REASON_DEADLINE and not v.valid(0.0)


def test_deadline_is_check_sent_time_plus_remaining_minus_margin() -> None:
    v = LeaseValidity(margin=0.5)
    v.on_check(sent_at=10.0, remaining_ttl=3, granted_ttl=3)
    assert v.deadline == pytest.approx(12.5)
    assert v.valid(12.49)
    assert v.reason(12.5) == REASON_DEADLINE


def test_revoked_or_missing_lease_stops_for_good() -> None:
    v = LeaseValidity()
    v.on_check(sent_at=1.0, remaining_ttl=3, granted_ttl=3)
    v.on_check(sent_at=2.0, remaining_ttl=-1)  # etcd: lease not found
    assert v.reason(2.0) == REASON_REVOKED
    v.on_check(sent_at=3.0, remaining_ttl=3)  # nothing brings it back
    assert v.reason(3.0) == REASON_REVOKED


def test_zero_remaining_is_revoked() -> None:
    v = LeaseValidity()
    v.on_check(sent_at=1.0, remaining_ttl=0, granted_ttl=3)
    assert not v.valid(1.0) and v.reason(1.0) == REASON_REVOKED


def test_a_late_answer_to_an_older_question_never_moves_the_deadline_back() -> None:
    v = LeaseValidity(margin=0.5)
    v.on_check(sent_at=5.0, remaining_ttl=3, granted_ttl=3)  # deadline 7.5
    v.on_check(sent_at=4.0, remaining_ttl=2, granted_ttl=3)  # older question, answered late: 5.5
    assert v.deadline == pytest.approx(7.5)


def test_refresh_moves_the_deadline_forward() -> None:
    v = LeaseValidity(margin=0.5)
    v.on_check(sent_at=0.0, remaining_ttl=3, granted_ttl=3)
    v.on_check(sent_at=1.0, remaining_ttl=3, granted_ttl=3)
    assert v.deadline == pytest.approx(3.5)


def test_without_checks_the_attempt_stops_before_the_lease_can_expire() -> None:
    """Cut off from etcd: the last answer said `remaining` at `sent_at`; etcd expires the lease no earlier
    than sent_at + remaining (the answer was true when sent, at the latest). We stop `margin` before."""
    v = LeaseValidity(margin=0.5)
    v.on_check(sent_at=100.0, remaining_ttl=2, granted_ttl=3)
    expires_no_earlier_than = 100.0 + 2
    assert v.valid(101.0)
    assert not v.valid(expires_no_earlier_than - 0.5)


def test_checks_every_ttl_third() -> None:
    v = LeaseValidity(margin=0.5)
    v.on_check(sent_at=0.0, remaining_ttl=9, granted_ttl=9)  # deadline 8.5
    assert v.next_check_at(0.01) == pytest.approx(3.0)


def test_checks_early_when_the_deadline_is_near() -> None:
    # etcd reports whole seconds: one check may see only 1 s left although the gateway keeps refreshing.
    v = LeaseValidity(margin=0.5)
    v.on_check(sent_at=0.0, remaining_ttl=1, granted_ttl=3)  # deadline 0.5: re-check well before it
    at = v.next_check_at(0.0)
    assert at == pytest.approx(0.25)
    assert at < v.deadline  # type: ignore[operator]


def test_never_busy_loops() -> None:
    v = LeaseValidity(margin=0.5)
    v.on_check(sent_at=0.0, remaining_ttl=1, granted_ttl=3)
    assert v.next_check_at(0.49) >= 0.49 + MIN_CHECK_INTERVAL


def test_default_interval_before_the_ttl_is_known() -> None:
    assert LeaseValidity().next_check_at(5.0) == pytest.approx(6.0)


@pytest.mark.parametrize(
    ("value", "expected"),
    [("694d7f1a2b3c4d5e", 0x694D7F1A2B3C4D5E), ("", None), (None, None), ("zz", None), ("0", None)],
)
def test_parse_lease_header(value: str | None, expected: int | None) -> None:
    assert parse_lease_header(value) == expected
