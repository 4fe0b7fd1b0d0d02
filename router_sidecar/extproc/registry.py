"""Where the two filter placements meet: live logical requests, keyed by request id.

The downstream servicer registers a request once it is admitted; each upstream (attempt) stream finds it
by the `request.id` attribute, which the downstream filter has set to the logical request id. Envoy's
access-log entries land here too, so a torn-down stream can be classified (client gone or upstream reset).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from router_sidecar.coordination.journal import ClaimConflict
from router_sidecar.coordination.liveness import LivenessMonitor
from router_sidecar.coordination.progress import Tracked
from router_sidecar.core.attempt import Attempt, FailRequest
from router_sidecar.core.request import DownstreamLoss, LogicalRequest


@dataclass(slots=True)
class Live:
    request: LogicalRequest
    loss_cause: DownstreamLoss | None = None
    admission: asyncio.Lock = field(default_factory=asyncio.Lock)  # one attempt admitted at a time
    client_status: int | None = None  # the status Envoy sent the client (its access log)
    access_logged: asyncio.Event = field(default_factory=asyncio.Event)
    # Set by the downstream stream: ends the client stream when the publishing replica is lost.
    publisher_lost: Callable[[str], Awaitable[None]] | None = None
    # Set by the downstream stream: answers the client with the request's error at once (no response started),
    # when the attempt that ended the request cannot (its stream is gone) and Envoy would try again.
    fail_now: Callable[[FailRequest], Awaitable[None]] | None = None
    publisher_progress: Tracked | None = None  # bytes of the publishing attempt that arrived here
    # The journal claim of the request's id (set by the downstream stream): None once settled in this run's
    # favour (or etcd is away), else the conflict. Nothing reaches the client before it is settled.
    claim: asyncio.Task[ClaimConflict | None] | None = None

    async def claim_conflict(self) -> ClaimConflict | None:
        """Wait until the claim is settled (shielded: a stream that goes does not cancel it); the conflict if
        the id is another run's."""
        return None if self.claim is None else await asyncio.shield(self.claim)

    _unwatch: Callable[[], None] | None = None

    def watch_publisher(self, liveness: LivenessMonitor, attempt: Attempt, progress: Tracked) -> None:
        """After the first delta, the downstream stream answers for the attempt that publishes."""

        async def replica_lost(cause: str) -> None:
            if self.publisher_lost is not None:
                await self.publisher_lost(cause)

        async def progress_gap() -> None:
            if self.publisher_lost is not None:
                await self.publisher_lost("progress_gap")

        self.stop_watching()
        self._unwatch = liveness.on_loss(attempt.replica, replica_lost)
        # The held bytes flow through the downstream filter again after the release: count from zero.
        progress.received, progress.gap_since, progress.on_lost = 0, None, progress_gap
        self.publisher_progress = progress

    def stop_watching(self) -> None:
        if self._unwatch is not None:
            self._unwatch()
            self._unwatch = None


class Registry:
    def __init__(self) -> None:
        self._live: dict[str, Live] = {}

    def __len__(self) -> int:
        return len(self._live)

    def add(self, request: LogicalRequest) -> Live | None:
        """Register; returns None when the id is already live (the caller answers 409)."""
        if request.request_id in self._live:
            return None
        live = self._live[request.request_id] = Live(request)
        return live

    def get(self, request_id: str) -> Live | None:
        return self._live.get(request_id)

    def remove(self, live: Live) -> None:
        if self._live.get(live.request.request_id) is live:
            del self._live[live.request.request_id]

    def note_envoy_exit(self) -> None:
        """Envoy died: every live stream ends now, and neither its client nor its replica did that."""
        for live in self._live.values():
            live.loss_cause = DownstreamLoss.ENVOY_EXITED
            live.access_logged.set()

    def note_access_log(
        self,
        request_id: str,
        cause: DownstreamLoss | None,
        status: int | None = None,
        attempts: int | None = None,
    ) -> None:
        live = self._live.get(request_id)
        if live is not None:
            live.loss_cause, live.client_status = cause, status
            live.request.note_envoy_attempts(attempts)  # Envoy's count, for the journal record
            live.access_logged.set()
