"""Where the two filter placements meet, and where the request machine's decisions are carried out.

The client-facing (downstream) stream registers a request once it is admitted; each attempt's (upstream)
stream finds it by the `request.id` attribute, which the downstream filter has set to the logical request
id. Every input of the request — from either placement, a monitor, a timer, etcd — goes through
`Live.feed`, which hands it to the request machine (`core/request.py`) and carries out what comes back:
replies go to the stream they address, effects (the journal claim, leases and fences, timers, placement)
run here and answer with further inputs. Nothing here decides; Envoy's access-log entries land here too,
so a torn-down stream can be classified (client gone or upstream reset).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from router_sidecar.coordination.fencing import FenceProof
from router_sidecar.coordination.journal import ClaimConflict
from router_sidecar.coordination.liveness import Liveness
from router_sidecar.coordination.progress import Tracked
from router_sidecar.coordination.store import StoreUnavailable
from router_sidecar.core import attempt as a
from router_sidecar.core import request as r
from router_sidecar.core.attempt import Attempt
from router_sidecar.extproc.discovery import compatible_alternatives, why_no_compatible_replica

if TYPE_CHECKING:
    from router_sidecar.extproc.services import Services

log = logging.getLogger(__name__)

# Decisions written on a stream, by the stream they address.
CLIENT_DECISIONS = (
    r.ContinueRequest,
    r.RejectRequest,
    r.PassResponse,
    r.ReplaceResponse,
    r.WithholdResponse,
    r.Forward,
    r.Terminate,
    r.FailNow,
)
ATTEMPT_DECISIONS = (r.ForwardAttempt, r.RefuseAttempt, r.AnswerAttempt, r.ReleaseAttempt)


class Sink(Protocol):
    """A stream that decisions are written to (the client's, or one attempt's)."""

    async def deliver(self, decision: r.Decision) -> None: ...


class AttemptSink(Sink, Protocol):
    tracked: Tracked | None  # its bytes as received (liveness from progress)

    def hand_over(self) -> None:
        """The client stream answers for its progress from now on."""


@dataclass(slots=True, eq=False)
class Live:
    request: r.LogicalRequest
    services: Services
    client: Sink | None = None  # the client-facing stream (set at admission)
    attempts: dict[str, AttemptSink] = field(default_factory=dict)  # by attempt id
    loss_cause: r.DownstreamLoss | None = None
    client_status: int | None = None  # the status Envoy sent the client (its access log)
    client_body_bytes: int | None = None  # the body bytes Envoy sent the client (its access log)
    envoy_attempts: int | None = None  # how many attempts Envoy made (its access log)
    access_logged: asyncio.Event = field(default_factory=asyncio.Event)
    publisher_progress: Tracked | None = None  # bytes of the publishing attempt that arrived here
    _timers: list[asyncio.TimerHandle] = field(default_factory=list)
    _tasks: set[asyncio.Task[None]] = field(default_factory=set)  # effects under way (kept referenced)
    _unwatch: Callable[[], None] | None = None

    # --- the one way in ----------------------------------------------------------------------------------

    async def feed(self, event: r.Input) -> list[r.Decision]:
        """Hand `event` to the request machine and carry out its decisions, in order: replies are written
        before this returns (a stream reads its next message only then), waiting effects run on their own."""
        decisions = self.request.handle(event)
        if self.request.outbox:  # what the record says changes with its events
            self.services.journal.update(self.request)
        if decisions:
            # Shielded: a stream that Envoy tears down meanwhile must not leave the rest undone (another
            # stream's reply, a lease to settle).
            await asyncio.shield(self._carry_out_all(decisions))
        return decisions

    async def _carry_out_all(self, decisions: list[r.Decision]) -> None:
        for decision in decisions:
            await self._carry_out(decision)

    def feed_soon(self, event: r.Input) -> None:
        """An input from a callback or a cancelled stream: fed in a task of its own."""
        self._spawn(self.feed(event))

    def _spawn(self, work: Coroutine[object, object, object]) -> None:
        task = asyncio.get_running_loop().create_task(work)  # type: ignore[arg-type]
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def stop(self) -> None:
        """The request is over: its timers and its publisher's watch go."""
        for timer in self._timers:
            timer.cancel()
        self._timers.clear()
        if self._unwatch is not None:
            self._unwatch()
            self._unwatch = None

    # --- carrying out -------------------------------------------------------------------------------------

    async def _carry_out(self, d: r.Decision) -> None:
        if isinstance(d, CLIENT_DECISIONS):
            if self.client is not None:
                await self.client.deliver(d)
        elif isinstance(d, ATTEMPT_DECISIONS):
            sink = self.attempts.get(d.attempt_id)
            if sink is not None:
                await sink.deliver(d)
        elif isinstance(d, r.WriteAheadJournal):
            await self._write_ahead(d.attempt_id)  # inline: nothing of the attempt moves meanwhile
        elif isinstance(d, r.SupersedeAttempt):
            attempt = self._attempt(d.attempt_id)
            await self.feed(r.ForAttempt(d.attempt_id, a.Superseded(self.liveness_uncertain(attempt))))
        elif isinstance(d, r.PlaceRetry):
            reason = self._no_compatible_replica(self._attempt(d.attempt_id))
            await self.feed(r.RetryPlaced(d.attempt_id, reason))
        elif isinstance(d, r.ReleaseLease):
            self._release_lease(d)
        elif isinstance(d, r.WatchPublisher):
            self._watch_publisher(d.attempt_id)
        else:
            self._start(d)

    def _start(self, d: r.Decision) -> None:
        """Effects that wait (etcd, timers): they feed their result when it comes."""
        loop = asyncio.get_running_loop()
        if isinstance(d, r.StartClaim):
            self._spawn(self._claim(d.patient))
        elif isinstance(d, r.StartDeadline):
            self._timers.append(loop.call_later(d.seconds, self.feed_soon, r.DeadlineReached()))
        elif isinstance(d, r.GrantLease):
            self._spawn(self._grant(d))
        elif isinstance(d, r.DiscardLease):
            self._spawn(self.services.leases.release(d.lease))
        elif isinstance(d, r.AwaitFence):
            self._timers.append(loop.call_later(d.seconds, self.feed_soon, r.FenceWaitOver(d.attempt_id)))
        else:
            assert isinstance(d, r.FenceAttempt), d
            self._spawn(self._fence(d))

    async def _claim(self, patient: bool) -> None:
        """Claim the request's id in the journal (beside the first attempt, or before it)."""
        request = self.request
        settled: r.ClaimSettled
        try:
            await self.services.journal.claim(request, patient=patient)
            settled = r.ClaimSettled(r.ClaimOutcome.GRANTED)
        except ClaimConflict as conflict:
            # Nothing of this run is journaled: the id is another run's.
            duplicate = r.DuplicateRun(conflict.in_flight, conflict.existing.get("outcome"))
            settled = r.ClaimSettled(r.ClaimOutcome.REFUSED, duplicate=duplicate)
        except StoreUnavailable as exc:
            log.error("journal unavailable, serving request %s without retries: %s", request.request_id, exc)
            settled = r.ClaimSettled(r.ClaimOutcome.UNAVAILABLE)
        except Exception:
            # A bug: served like degraded mode (the journal writes nothing more of this run).
            log.exception("journal claim of %s failed; serving it without retries", request.request_id)
            settled = r.ClaimSettled(
                r.ClaimOutcome.UNAVAILABLE,
                "the request journal could not record this request, so no retry is safe",
            )
        await self.feed(settled)

    async def _grant(self, d: r.GrantLease) -> None:
        services = self.services
        lease = await services.leases.grant(
            attempt_id=d.attempt_id, request_id=self.request.request_id, replica=d.replica
        )
        await self.feed(
            r.LeaseGranted(
                d.attempt_id,
                lease,
                ttl_seconds=lease.ttl_seconds,
                replica_side=services.liveness.registered(d.replica),
            )
        )

    async def _write_ahead(self, attempt_id: str) -> None:
        attempt = self._attempt(attempt_id)
        # first_delta_sent must be durable before the first byte of content can reach the client.
        try:
            await self.services.journal.write_ahead(self.request)
        except StoreUnavailable as exc:
            log.error(
                "journal: first_delta_sent of %s not recorded (serving anyway): %s",
                self.request.request_id,
                exc,
            )
        publishable = attempt.lease is None or attempt.lease.publishable()
        await self.feed(r.ForAttempt(attempt_id, a.WriteAheadDone(lease_publishable=publishable)))

    def _release_lease(self, d: r.ReleaseLease) -> None:
        lease = self._attempt(d.attempt_id).lease
        if lease is None:
            return
        leases = self.services.leases
        leases.stop_honouring(lease)  # at once: nothing of the attempt is released from now

        async def release() -> None:
            if d.proof is None:
                await leases.release(lease)
                return
            # The closed connection is the proof; a retry still waits until etcd confirmed the revocation,
            # so two valid leases never coexist.
            await leases.release(lease, FenceProof(d.proof))
            await self.feed(r.ForAttempt(d.attempt_id, a.FenceProven(d.proof)))

        self._spawn(release())

    async def _fence(self, d: r.FenceAttempt) -> None:
        lease = self._attempt(d.attempt_id).lease
        leases = self.services.leases
        started = time.monotonic()
        proof: FenceProof | None
        if d.connection_only:
            # A static replica: no agent, no replica side that could honour a lease. Our answer closes its
            # connection, the only way its bytes could reach the client: that is the whole fence.
            await leases.release(lease, FenceProof.CONNECTION_CLOSED)
            proof = FenceProof.CONNECTION_CLOSED
        else:
            proof = await leases.fence(lease, accept_cancel_ack=d.accept_cancel_ack)
        waited_ms = (time.monotonic() - started) * 1000
        fenced = a.FenceProven(proof.value, waited_ms) if proof is not None else a.FenceUnprovable()
        await self.feed(r.ForAttempt(d.attempt_id, fenced))

    def _watch_publisher(self, attempt_id: str) -> None:
        """After the first delta the client stream answers for the attempt that publishes."""
        sink = self.attempts.get(attempt_id)
        if sink is None or sink.tracked is None:
            return
        sink.hand_over()
        progress = sink.tracked

        async def replica_lost(cause: str) -> None:
            await self.feed(r.PublisherLost(cause))

        async def progress_gap() -> None:
            await self.feed(r.PublisherLost("progress_gap"))

        if self._unwatch is not None:
            self._unwatch()
        replica = self._attempt(attempt_id).replica
        self._unwatch = self.services.liveness.on_loss(replica, replica_lost)
        # The held bytes flow through the downstream filter again after the release: count from zero.
        progress.received, progress.gap_since, progress.on_lost = 0, None, progress_gap
        self.publisher_progress = progress

    # --- facts the machine asks for --------------------------------------------------------------------

    def liveness_uncertain(self, attempt: Attempt) -> bool:
        """A closed connection proves the attempt dead only if its replica showed no sign of running on."""
        services = self.services
        tracked = services.progress.tracked(attempt.attempt_id)
        unreceived_progress = tracked is not None and tracked.reported > tracked.received
        liveness = services.liveness
        lost = liveness.registered(attempt.replica) and liveness.state(attempt.replica) is Liveness.LOST
        return unreceived_progress or lost

    def _no_compatible_replica(self, attempt: Attempt) -> str | None:
        """Why a retry could not land on a replica of the pinned compatibility group (None: it can)."""
        digest = self.request.fingerprint_digest
        if digest is None:
            return None
        replicas = self.services.liveness.routable
        if compatible_alternatives(replicas, digest, exclude=attempt.replica) > 0:
            return None
        pinned = next((x for x in replicas.values() if x.digest == digest), None)
        if pinned is None:
            return f"no healthy replica with the pinned fingerprint {digest} is left"
        return why_no_compatible_replica(replicas, pinned, exclude=attempt.replica)

    def _attempt(self, attempt_id: str) -> Attempt:
        attempt = self.request.attempt(attempt_id)
        assert attempt is not None, attempt_id
        return attempt


class Registry:
    def __init__(self) -> None:
        self._live: dict[str, Live] = {}

    def __len__(self) -> int:
        return len(self._live)

    def add(self, request: r.LogicalRequest, services: Services) -> Live | None:
        """Register; returns None when the id is already live (the caller answers 409)."""
        if request.request_id in self._live:
            return None
        live = self._live[request.request_id] = Live(request, services)
        return live

    def get(self, request_id: str) -> Live | None:
        return self._live.get(request_id)

    def remove(self, live: Live) -> None:
        if self._live.get(live.request.request_id) is live:
            del self._live[live.request.request_id]

    def note_envoy_exit(self) -> None:
        """Envoy died: every live stream ends now, and neither its client nor its replica did that."""
        for live in self._live.values():
            live.loss_cause = r.DownstreamLoss.ENVOY_EXITED
            live.access_logged.set()

    def note_access_log(
        self,
        request_id: str,
        cause: r.DownstreamLoss | None,
        status: int | None = None,
        attempts: int | None = None,
        body_bytes: int | None = None,
    ) -> None:
        live = self._live.get(request_id)
        if live is not None:
            live.loss_cause, live.client_status, live.envoy_attempts = cause, status, attempts
            live.client_body_bytes = body_bytes
            live.access_logged.set()
