"""Liveness from progress: fire only on a sustained gap between what the replica reported and what arrived."""

from __future__ import annotations

from router_sidecar.coordination.progress import ProgressMonitor
from router_sidecar.coordination.store import MemoryStore


async def _never() -> None:
    return None


def test_no_report_no_gap_however_long_nothing_arrives() -> None:
    monitor = ProgressMonitor(MemoryStore(), gap_seconds=3)
    monitor.track("a", _never)
    assert monitor.check(0.0) == [] and monitor.check(1000.0) == []  # slow is not lost


def test_a_gap_fires_once_after_gap_seconds() -> None:
    monitor = ProgressMonitor(MemoryStore(), gap_seconds=3)
    tracked = monitor.track("a", _never)
    tracked.reported = 500
    assert monitor.check(10.0) == []
    assert monitor.check(12.9) == []
    assert monitor.check(13.0) == [tracked]
    assert monitor.check(20.0) == [], "fires once"


def test_bytes_arriving_close_the_gap_and_restart_the_clock() -> None:
    monitor = ProgressMonitor(MemoryStore(), gap_seconds=3)
    tracked = monitor.track("a", _never)
    tracked.reported = 500
    monitor.check(10.0)
    tracked.received = 500  # it all arrived: only late, not lost
    assert monitor.check(12.0) == [] and tracked.gap_since is None
    tracked.reported = 900
    assert monitor.check(12.5) == []
    assert monitor.check(15.4) == []
    assert monitor.check(15.5) == [tracked]


def test_untracked_attempts_are_never_reported() -> None:
    monitor = ProgressMonitor(MemoryStore(), gap_seconds=1)
    tracked = monitor.track("a", _never)
    tracked.reported = 1
    monitor.untrack(tracked)
    assert monitor.check(0.0) == [] and monitor.check(5.0) == []
    assert monitor.tracked("a") is None
