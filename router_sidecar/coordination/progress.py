"""Liveness from progress: the replica side says it sent bytes that never arrive here.

A replica whose heartbeat is fine but whose bytes stop reaching the gateway (a partition between the two
only) looks exactly like a slow one from the gateway's side. The replica-side fence reports, at a modest
rate, how many bytes of each attempt it forwarded (`keys.progress(attempt_id)`, under the attempt's lease).
When the replica has reported more than the gateway received for `gap_seconds` in a row, the path is
lost while the replica may be alive: the attempt is fenced like one whose heartbeat lapsed. This is
evidence-driven, not a latency timeout: a slow replica reports no progress that is missing here.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from router_sidecar.coordination.store import Entry, Snapshot, Store, keys
from router_sidecar.records import codec
from router_sidecar.records import records_pb2 as rec

log = logging.getLogger(__name__)

CHECK_INTERVAL_SECONDS = 0.25


@dataclass(slots=True)
class Tracked:
    """One attempt's byte count as received here, and what to do if its path is lost."""

    attempt_id: str
    on_lost: Callable[[], Awaitable[None]]
    received: int = 0
    reported: int = 0
    gap_since: float | None = None
    fired: bool = False


class ProgressMonitor:
    def __init__(self, store: Store, gap_seconds: float) -> None:
        self._store = store
        self.gap_seconds = gap_seconds
        self._tracked: dict[str, Tracked] = {}
        self._tasks: list[asyncio.Task[None]] = []

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._watch()), loop.create_task(self._check_loop())]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def track(self, attempt_id: str, on_lost: Callable[[], Awaitable[None]]) -> Tracked:
        tracked = self._tracked[attempt_id] = Tracked(attempt_id, on_lost)
        return tracked

    def untrack(self, tracked: Tracked) -> None:
        if self._tracked.get(tracked.attempt_id) is tracked:
            del self._tracked[tracked.attempt_id]

    def untrack_later(self, tracked: Tracked, seconds: float = 30.0) -> None:
        """Stop acting on it now, forget it later: a retry's gate still asks what it reported."""
        tracked.fired = True
        asyncio.get_running_loop().call_later(seconds, self.untrack, tracked)

    def tracked(self, attempt_id: str) -> Tracked | None:
        return self._tracked.get(attempt_id)

    def check(self, now: float) -> list[Tracked]:
        """The attempts whose path is lost as of `now` (each returned once)."""
        lost = []
        for tracked in list(self._tracked.values()):
            if tracked.reported <= tracked.received:
                tracked.gap_since = None
                continue
            if tracked.gap_since is None:
                tracked.gap_since = now
            elif not tracked.fired and now - tracked.gap_since >= self.gap_seconds:
                tracked.fired = True
                lost.append(tracked)
        return lost

    async def _check_loop(self) -> None:
        while True:
            await asyncio.sleep(CHECK_INTERVAL_SECONDS)
            for tracked in self.check(time.monotonic()):
                log.warning(
                    "attempt %s: the replica reported %d bytes, %d arrived for %.1fs: path lost",
                    tracked.attempt_id,
                    tracked.reported,
                    tracked.received,
                    self.gap_seconds,
                )
                asyncio.get_running_loop().create_task(tracked.on_lost())

    async def _watch(self) -> None:
        async for item in self._store.watch_prefix(keys.ATTEMPTS_PREFIX):
            if isinstance(item, Snapshot):
                for entry in item.entries:
                    self._reported(entry)
            else:
                entry = item.entry()
                if entry is not None:
                    self._reported(entry)

    def _reported(self, entry: Entry) -> None:
        attempt_id = keys.attempt_of_progress(entry.key)
        tracked = None if attempt_id is None else self._tracked.get(attempt_id)
        if tracked is None:
            return
        try:
            reported = codec.loads(rec.AttemptProgress, entry.value).bytes
        except codec.RecordError as exc:
            log.warning("attempt %s: unreadable progress report ignored: %s", attempt_id, exc)
            return
        tracked.reported = max(tracked.reported, reported)
