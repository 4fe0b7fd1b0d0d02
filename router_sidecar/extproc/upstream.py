"""The UPSTREAM placement (cluster `llm` upstream filter chain): one stream per attempt.

STREAMED response body with `send_body_without_waiting_for_header_response`: Envoy keeps sending body
chunks while our reply to the response headers is pending. So we hold the headers (and every chunk) until
the attempt's machine decides: release at the first delta (after the write-ahead journal record), retry
(`:status 503` → Envoy's router retries on another host), or fail with a real error. After a release the
stream ends with OK and Envoy forwards the rest of the response without us (DESIGN.md §5.7).

Fencing: every attempt holds an etcd lease (its right to publish). A new attempt is let through to its
replica only once the previous one can no longer publish. If the replica's heartbeat lapses while the
attempt is held (liveness uncertain: frozen process, partition), the attempt is fenced — lease revoked,
then the cancel ack or the lease's expiry awaited — and only then retried.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time

import grpc

from router_sidecar.coordination.fencing import FenceProof
from router_sidecar.coordination.liveness import Liveness
from router_sidecar.coordination.store import StoreUnavailable
from router_sidecar.core.attempt import Attempt, AttemptFailed, Hold, PassThrough, Release
from router_sidecar.core.request import AttemptRecord, FailRequest, LogicalRequest, TriggerRetry
from router_sidecar.extproc import messages as m
from router_sidecar.extproc.discovery import compatible_alternatives, why_no_compatible_replica
from router_sidecar.extproc.registry import Live
from router_sidecar.extproc.services import Services

log = logging.getLogger(__name__)

_RETRY = m.response_headers_reply(m.header_mutation([(":status", "503")]))


def new_attempt_id() -> str:
    return f"att_{secrets.token_hex(8)}"


class UpstreamStream:
    def __init__(self, services: Services) -> None:
        self._registry = services.registry
        self._journal = services.journal
        self._leases = services.leases
        self._liveness = services.liveness
        self._progress = services.progress
        self._handed_over = False  # the downstream now answers for this attempt's progress
        self._write_lock = asyncio.Lock()
        self._decided = False  # the one final reply for this attempt has been written
        self._fencing = False  # a liveness fence is under way: no release, whatever arrives
        self._deferred: TriggerRetry | FailRequest | None = None  # decided before the headers arrived
        self._headers_arrived = False  # response headers came in while a fence was under way

    async def run(self, context: grpc.aio.ServicerContext) -> None:
        first = await context.read()
        if first is grpc.aio.EOF:
            return
        attrs = m.attributes(first)
        headers = m.header_map(first.request_headers)
        request_id = str(attrs.get("request.id") or headers.get("x-request-id", ""))
        live = self._registry.get(request_id)
        if live is None or live.request.is_terminal:
            # Not an admitted inference request (e.g. /v1/models): nothing to hold, leave the path at once.
            await context.write(m.request_headers_reply())
            return
        request = live.request
        if not request.admits_attempt():
            await self._write_refusal(context, request, request.refuse_attempt())
            return
        if not await self._previous_attempt_fenced(request):
            await self._write_refusal(context, request, request.refuse_attempt())
            return
        replica = str(attrs.get("upstream.address") or "unknown")
        attempt_id = new_attempt_id()
        record = request.begin_attempt(attempt_id, replica)
        record.lease = await self._leases.grant(attempt_id=attempt_id, request_id=request_id, replica=replica)
        attempt = Attempt(request_id=request_id, attempt_id=attempt_id, number=record.number, replica=replica)
        self._journal.update(request)
        lease_header = f"{record.lease.lease.id:x}" if record.lease.lease else ""
        await context.write(
            m.request_headers_reply(
                m.header_mutation(
                    [
                        ("x-request-id", request_id),
                        ("x-attempt-id", attempt_id),
                        ("x-attempt-lease", lease_header),
                    ]
                )
            )
        )

        async def replica_lost(address: str) -> None:
            await self._on_replica_lost(context, request, record, attempt)

        unsubscribe = self._liveness.on_loss(replica, replica_lost)
        self._tracked = self._progress.track(attempt_id, lambda: replica_lost(replica))
        try:
            await self._hold_until_decided(context, live, record, attempt)
        except asyncio.CancelledError:
            # Envoy tore the attempt down (reset/refused, or the client left): its connection is gone,
            # which is what fences it from this stream.
            decision = attempt.on_stream_lost()
            if isinstance(decision, AttemptFailed):
                request.on_attempt_lost(record, decision)
                self._journal.update(request)
                self._settle_in_background(request, record)
            raise
        finally:
            unsubscribe()
            if not self._handed_over:
                # Kept a little longer: the next attempt's gate reads it (see `_liveness_uncertain`).
                self._progress.untrack_later(self._tracked)

    async def _previous_attempt_fenced(self, request: LogicalRequest) -> bool:
        """Hold a retry until the attempt before it can no longer publish."""
        previous = request.attempts[-1] if request.attempts else None
        if previous is None or previous.lease is None or previous.lease.fenced.is_set():
            return True
        if not self._fencing_in_progress(previous):
            # Envoy started another attempt on its own: the previous upstream request is over.
            return await self._settle_closed_attempt(request, previous)
        try:
            await asyncio.wait_for(previous.lease.fenced.wait(), previous.lease.ttl_seconds + 5)
        except TimeoutError:
            log.error("attempt %s never got fenced: refusing the retry", previous.attempt_id)
            return False
        return True

    async def _settle_closed_attempt(self, request: LogicalRequest, record: AttemptRecord) -> bool:
        """An attempt whose connection closed under it. If its replica showed no sign of running on
        (heartbeat fine, no unreceived progress), it is dead and the closed connection is the proof that
        nothing more can arrive from it. Otherwise (heartbeat lapsed, or it reported bytes that never
        arrived: a lost path) it may still be decoding: fence it. False: the fence cannot be proven."""
        assert record.lease is not None
        if not self._liveness_uncertain(record):
            await self._leases.release(record.lease, FenceProof.CONNECTION_CLOSED)
            return True
        request.on_replica_lost(record)
        self._journal.update(request)
        started = time.monotonic()
        proof = await self._leases.fence(record.lease)
        request.on_attempt_fenced(record, proof.value if proof else None, time.monotonic() - started)
        self._journal.update(request)
        return proof is not None

    def _liveness_uncertain(self, record: AttemptRecord) -> bool:
        tracked = self._progress.tracked(record.attempt_id)
        unreceived_progress = tracked is not None and tracked.reported > tracked.received
        return unreceived_progress or self._liveness.state(record.replica) is Liveness.LOST

    @staticmethod
    def _fencing_in_progress(record: AttemptRecord) -> bool:
        return (
            record.lease is not None
            and record.lease.stopped_at is not None
            and not record.lease.fenced.is_set()
        )

    async def _hold_until_decided(
        self, context: grpc.aio.ServicerContext, live: Live, record: AttemptRecord, attempt: Attempt
    ) -> None:
        request = live.request
        held_bodies = 0
        while True:
            message = await context.read()
            if message is grpc.aio.EOF:
                decision = attempt.on_stream_lost()
                if isinstance(decision, AttemptFailed):
                    request.on_attempt_lost(record, decision)
                    self._journal.update(request)
                    self._settle_in_background(request, record)
                return
            which = message.WhichOneof("request")
            if self._decided:
                return
            if which == "response_headers" and self._deferred is not None:
                await self._write_outcome(context, request, self._deferred)
                return
            if self._fencing:
                # Whatever the fenced attempt sends now is dropped; the fence decides. Its response headers
                # (e.g. the replica side's own 503 once it stopped) are what the fence's answer will answer.
                self._headers_arrived = self._headers_arrived or which == "response_headers"
                continue
            if which == "response_headers":
                headers = m.header_map(message.response_headers)
                decision = attempt.on_response_headers(
                    int(headers.get(":status", "0") or 0), headers.get("content-type", "")
                )
            elif which == "response_body":
                held_bodies += 1
                body = message.response_body
                self._tracked.received += len(body.body)
                decision = attempt.on_response_body(body.body, body.end_of_stream)
            else:
                continue
            if isinstance(decision, Hold):
                continue
            if isinstance(decision, Release) and record.lease is not None and not record.lease.publishable():
                continue  # lost its right to publish (fence under way, or lease not renewed): never release
            if isinstance(decision, Release | PassThrough):
                await self._release(context, live, record, decision, held_bodies)
                return
            outcome = request.on_attempt_failed(
                record, decision, no_compatible_replica=self._no_compatible_replica(request, record)
            )
            self._journal.update(request)
            await self._write_outcome(context, request, outcome)
            self._release_in_background(record)
            return

    async def _release(
        self,
        context: grpc.aio.ServicerContext,
        live: Live,
        record: AttemptRecord,
        decision: Release | PassThrough,
        held_bodies: int,
    ) -> None:
        request = live.request
        async with self._write_lock:
            if self._decided or self._fencing:
                return
            self._decided = True
            if isinstance(decision, Release):
                request.on_attempt_released(record, first_delta=decision.first_delta)
                await self._write_ahead(request)
                # From here the downstream owns this attempt: it ends the stream if the replica is lost.
                live.watch_publisher(self._liveness, record, self._tracked)
                self._handed_over = True
            else:
                request.on_attempt_passed_through(record, decision.status)
                self._journal.update(request)
            await context.write(m.response_headers_reply())
            for _ in range(held_bodies):
                await context.write(m.RESPONSE_BODY_CONTINUE)
        # Leave the path: Envoy forwards the rest without us.

    async def _on_replica_lost(
        self,
        context: grpc.aio.ServicerContext,
        request: LogicalRequest,
        record: AttemptRecord,
        attempt: Attempt,
    ) -> None:
        if self._decided or self._fencing:
            return
        failure = attempt.on_replica_lost()
        if failure is None:
            return
        self._fencing = True
        request.on_replica_lost(record)
        self._journal.update(request)
        started = time.monotonic()
        proof = await self._leases.fence(record.lease) if record.lease is not None else None
        request.on_attempt_fenced(record, proof.value if proof else None, time.monotonic() - started)
        outcome = request.on_attempt_failed(
            record,
            failure,
            fence_proven=proof is not None,
            no_compatible_replica=self._no_compatible_replica(request, record),
        )
        self._journal.update(request)
        if attempt.status is None and not self._headers_arrived:
            self._deferred = outcome  # no response headers to answer yet: answer them when they come
            return
        await self._write_outcome(context, request, outcome)

    def _no_compatible_replica(self, request: LogicalRequest, record: AttemptRecord) -> str | None:
        """Why a retry could not land on a replica of the pinned compatibility group (None: it can)."""
        digest = request.fingerprint_digest
        if digest is None:
            return None
        replicas = self._liveness.replicas
        if compatible_alternatives(replicas, digest, exclude=record.replica) > 0:
            return None
        pinned = next((r for r in replicas.values() if r.digest == digest), None)
        if pinned is None:
            return f"no healthy replica with the pinned fingerprint {digest} is left"
        return why_no_compatible_replica(replicas, pinned, exclude=record.replica)

    async def _write_outcome(
        self, context: grpc.aio.ServicerContext, request: LogicalRequest, outcome: TriggerRetry | FailRequest
    ) -> None:
        async with self._write_lock:
            if self._decided:
                return
            self._decided = True
            reply = (
                _RETRY
                if isinstance(outcome, TriggerRetry)
                else m.immediate(
                    outcome.status, outcome.body, extra_headers=[("x-request-id", request.request_id)]
                )
            )
            # A fence decided after Envoy had already torn the attempt down (TCP keepalive, client gone):
            # no one is left to answer; Envoy retries or ends the request on its own.
            with contextlib.suppress(grpc.aio.UsageError):
                await context.write(reply)

    async def _write_refusal(
        self, context: grpc.aio.ServicerContext, request: LogicalRequest, refusal: FailRequest
    ) -> None:
        self._journal.update(request)
        await context.write(
            m.immediate(refusal.status, refusal.body, extra_headers=[("x-request-id", request.request_id)])
        )

    def _settle_in_background(self, request: LogicalRequest, record: AttemptRecord) -> None:
        if record.lease is None or record.lease.fenced.is_set() or self._fencing:
            return
        # Mark it at once, so that a retry's gate waits for this settlement instead of racing it.
        self._leases.stop_honouring(record.lease)
        asyncio.get_running_loop().create_task(self._settle_closed_attempt(request, record))

    def _release_in_background(self, record: AttemptRecord) -> None:
        if record.lease is not None and not record.lease.fenced.is_set() and not self._fencing:
            # The closed connection is the proof; a retry still waits (in `_previous_attempt_fenced`) until
            # etcd confirmed the revocation, so two valid leases never coexist.
            self._leases.stop_honouring(record.lease)
            asyncio.get_running_loop().create_task(
                self._leases.release(record.lease, FenceProof.CONNECTION_CLOSED)
            )

    async def _write_ahead(self, request: LogicalRequest) -> None:
        # first_delta_sent must be durable before the first byte of content can reach the client.
        try:
            await self._journal.write_ahead(request)
        except StoreUnavailable as exc:
            log.error(
                "journal: first_delta_sent of %s not recorded (serving anyway): %s", request.request_id, exc
            )
