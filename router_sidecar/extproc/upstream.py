"""The UPSTREAM placement (cluster `llm` upstream filter chain): one ext_proc stream per attempt.

A translator and an effect runner around the attempt machine (`core/attempt.py`), which decides
everything: Envoy's messages and the monitors' signals become its inputs, its decisions become replies
to Envoy, lease operations and journal writes. STREAMED response body with
`send_body_without_waiting_for_header_response`: Envoy keeps sending body chunks while our reply to the
response headers is pending, so the headers (and every chunk) are held until the machine decides. After a
release the stream ends with OK and Envoy forwards the rest of the response without us (DESIGN.md §5.7).
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
from router_sidecar.coordination.progress import Tracked
from router_sidecar.coordination.store import StoreUnavailable
from router_sidecar.core import attempt as a
from router_sidecar.core import views
from router_sidecar.core.request import LogicalRequest
from router_sidecar.extproc import messages as m
from router_sidecar.extproc.discovery import compatible_alternatives, why_no_compatible_replica
from router_sidecar.extproc.registry import Live
from router_sidecar.extproc.services import Services
from router_sidecar.records import codec
from router_sidecar.records import records_pb2 as rec
from router_sidecar.telemetry import logs

log = logging.getLogger(__name__)

_RETRY = m.response_headers_reply(m.header_mutation([(":status", "503")]))


def new_attempt_id() -> str:
    return f"att_{secrets.token_hex(8)}"


class UpstreamStream:
    def __init__(self, services: Services) -> None:
        self._services = services
        self._journal = services.journal
        self._leases = services.leases
        self._write_lock = asyncio.Lock()
        self._context: grpc.aio.ServicerContext | None = None
        self._attempt: a.Attempt | None = None  # this stream's attempt (the gate may feed earlier ones)
        self._tracked: Tracked | None = None  # its bytes as received here (liveness from progress)
        self._left = False  # we answered or released: nothing more is written on this stream
        self._handed_over = False  # the downstream now answers for this attempt's progress
        self._gone = False  # Envoy ended this stream: no reply can carry a verdict any more
        self._handled, self._busy = 0, 0.0  # messages handled and time spent (metrics, once per stream)
        self._live: Live | None = None

    async def run(self, context: grpc.aio.ServicerContext) -> None:
        self._context = context
        first = await context.read()
        if first is grpc.aio.EOF:
            return
        attrs = m.attributes(first)
        headers = m.header_map(first.request_headers)
        request_id = str(attrs.get("request.id") or headers.get("x-request-id", ""))
        live = self._live = self._services.registry.get(request_id)
        if live is None:
            # Not an admitted inference request (e.g. /v1/models): nothing to hold, leave the path at once.
            await context.write(m.request_headers_reply())
            return
        request = live.request
        replica = str(attrs.get("upstream.address") or "unknown")
        # Envoy numbers its attempts: one whose stream ended before we read it shows up as a gap.
        envoy_attempt = m.attempt_count(attrs.get("upstream.request_attempt_count"))
        for _ in range(request.gate.unseen_before(envoy_attempt or 0)):
            request.gate.note_never_sent(new_attempt_id(), "unknown")
        # One admission at a time per request: Envoy may start the next attempt while this stream still
        # waits for etcd, and that one must see this attempt (and supersede it) rather than run beside it.
        try:
            async with live.admission:
                if not await self._admit(context, request):
                    return
                # The lease first: an attempt on record always has one (Envoy may cancel this stream now).
                attempt_id = new_attempt_id()
                lease = await self._leases.grant(
                    attempt_id=attempt_id, request_id=request_id, replica=replica
                )
                attempt = self._attempt = request.gate.begin(attempt_id, replica)
                attempt.lease = lease
        except asyncio.CancelledError:
            # Torn down before its request was let go: the connection Envoy had picked died first (a pooled
            # one the replica had closed, a refused connect), or the client left. The gate journals it
            # (uncounted) once Envoy's next attempt or its own answer shows which (docs/envoy-facts.md).
            if request.gate.final is None and not request.is_terminal:
                request.gate.note_never_sent(new_attempt_id(), replica)
            raise
        self._journal.update(request)  # also opens the attempt's span: its context goes to the replica
        telemetry = self._services.telemetry
        logs.bind(request_id=request_id, attempt_id=attempt.attempt_id, trace_id=telemetry.trace_id(request))
        attempt_headers = rec.AttemptHeaders(
            request_id=request_id,
            attempt_id=attempt.attempt_id,
            attempt_lease=f"{attempt.lease.lease.id:x}" if attempt.lease.lease else "",
            traceparent=telemetry.traceparent(request, attempt.number),
        )
        await context.write(m.request_headers_reply(m.header_mutation(codec.to_headers(attempt_headers))))

        async def replica_lost(cause: str) -> None:
            self._feed(request, attempt, a.LivenessLost(cause))

        async def progress_gap() -> None:
            self._feed(request, attempt, a.LivenessLost("progress_gap"))

        unsubscribe = self._services.liveness.on_loss(replica, replica_lost)
        self._tracked = self._services.progress.track(attempt.attempt_id, progress_gap)
        try:
            await self._hold(context, live, attempt)
        except asyncio.CancelledError:
            # Envoy tore the attempt down (reset/refused, or the client left).
            self._gone = True
            self._feed(request, attempt, a.StreamReset(self._liveness_uncertain(attempt)))
            raise
        finally:
            unsubscribe()
            if not self._handed_over:
                # Kept a little longer: the next attempt's gate reads it (see `_liveness_uncertain`).
                self._services.progress.untrack_later(self._tracked)

    async def _admit(self, context: grpc.aio.ServicerContext, request: LogicalRequest) -> bool:
        """The retry gate: the attempt before must be fenced, and the budget must allow this one. A retry
        also waits for the request's claim (etcd away: no retry can be proven safe); no attempt of a run
        refused by its claim starts."""
        claim = self._live.claim if self._live is not None else None
        if (request.gate.attempts or (claim is not None and claim.done())) and await self._claim_conflict():
            await context.write(m.immediate(409, b""))  # the downstream puts the 409's body in
            return False
        while True:
            admission = request.gate.admit()
            if isinstance(admission, a.Admit):
                return True
            if isinstance(admission, a.Supersede):
                previous = admission.attempt
                self._feed(request, previous, a.Superseded(self._liveness_uncertain(previous)))
            elif isinstance(admission, a.AwaitFence):
                previous = admission.attempt
                bound = (previous.lease.ttl_seconds if previous.lease else 0) + 5
                try:
                    await asyncio.wait_for(previous.lease.fenced.wait(), bound)
                except TimeoutError:
                    log.error("attempt %s never got fenced: refusing the retry", previous.attempt_id)
                    request.gate.fence_timed_out(previous)
            else:
                self._journal.update(request)
                await context.write(_answer(request, admission.verdict))
                return False

    async def _hold(self, context: grpc.aio.ServicerContext, live: Live, attempt: a.Attempt) -> None:
        request = live.request
        assert self._tracked is not None
        try:
            await self._hold_messages(context, request, attempt)
        finally:
            self._services.telemetry.stream_handled("upstream", self._handled, self._busy)

    async def _hold_messages(
        self, context: grpc.aio.ServicerContext, request: LogicalRequest, attempt: a.Attempt
    ) -> None:
        assert self._tracked is not None
        while not self._left:
            message = await context.read()
            if message is grpc.aio.EOF:
                self._gone = True
                self._feed(request, attempt, a.StreamReset(self._liveness_uncertain(attempt)))
                return
            started = time.perf_counter()
            which = message.WhichOneof("request")
            if which == "response_headers":
                headers = m.header_map(message.response_headers)
                event: a.Input = a.ResponseHeaders(
                    status=int(headers.get(":status", "0") or 0),
                    content_type=headers.get("content-type", ""),
                    content_encoding=headers.get("content-encoding", ""),
                    retry_after=headers.get("retry-after"),
                )
            elif which == "response_body":
                body = message.response_body
                self._tracked.received += len(body.body)
                event = a.ResponseBody(body.body, body.end_of_stream)
            else:
                continue
            # Inline: no further message is read until these decisions are carried out (the held count).
            await self._carry_out(request, attempt, self._handle(request, attempt, event))
            self._handled += 1
            self._busy += time.perf_counter() - started

    def _handle(self, request: LogicalRequest, attempt: a.Attempt, event: a.Input) -> list[a.Decision]:
        decisions = attempt.handle(event)
        self._journal.update(request)
        return decisions

    def _feed(self, request: LogicalRequest, attempt: a.Attempt, event: a.Input) -> None:
        """An input from outside the read loop (a monitor, a timer, the gate, cancellation)."""
        decisions = self._handle(request, attempt, event)
        if decisions:
            asyncio.get_running_loop().create_task(self._carry_out(request, attempt, decisions))

    async def _carry_out(
        self, request: LogicalRequest, attempt: a.Attempt, decisions: list[a.Decision]
    ) -> None:
        for index, decision in enumerate(decisions):
            try:
                await self._carry_out_one(request, attempt, decision)
            except asyncio.CancelledError:
                # Envoy cancelled this stream while we wrote to it: the lease decisions still happen.
                for rest in decisions[index + 1 :]:
                    if isinstance(rest, a.SettleLease | a.StartFence):
                        await self._carry_out_one(request, attempt, rest)
                raise

    async def _carry_out_one(self, request: LogicalRequest, attempt: a.Attempt, decision: a.Decision) -> None:
        if isinstance(decision, a.Failed):
            # Whether a retry may follow depends on the claim (etcd away: no retry can be proven safe).
            refused = await self._claim_conflict()
            verdict = request.gate.verdict(
                attempt, decision, no_compatible_replica=self._no_compatible_replica(request, attempt)
            )
            if refused:
                # The downstream answers the client (the 409); this attempt only settles its lease.
                decisions = self._handle(request, attempt, a.VerdictReady(verdict))
                for settle in decisions:
                    if isinstance(settle, a.SettleLease | a.StartFence):
                        await self._carry_out_one(request, attempt, settle)
                return
            log.info(
                "attempt %d on %s failed before any content (%s): %s",
                attempt.number,
                attempt.replica,
                decision.reason.value,
                "retrying" if isinstance(verdict, a.TriggerRetry) else f"no retry ({verdict.code})",
            )
            live = self._live
            if isinstance(verdict, a.FailRequest) and self._gone and live is not None and live.fail_now:
                # Nothing can answer on this stream, and Envoy's retries leave room for attempts that die at
                # their connection: the downstream answers now, so Envoy makes none the gate would refuse.
                asyncio.get_running_loop().create_task(live.fail_now(verdict))
            await self._carry_out(request, attempt, self._handle(request, attempt, a.VerdictReady(verdict)))
        elif isinstance(decision, a.Answer):
            held = [m.RESPONSE_BODY_CONTINUE] * decision.held_chunks
            await self._write(attempt, _answer(request, decision.verdict), *held)
        elif isinstance(decision, a.SettleLease):
            self._leases.stop_honouring(attempt.lease)
            asyncio.get_running_loop().create_task(self._settle(request, attempt))
        elif isinstance(decision, a.StartFence):
            asyncio.get_running_loop().create_task(self._fence(request, attempt))
        elif isinstance(decision, a.WriteAhead):
            await self._write_ahead(request, attempt)
        else:
            await self._release(request, attempt, decision)

    async def _write_ahead(self, request: LogicalRequest, attempt: a.Attempt) -> None:
        if await self._claim_conflict():
            return  # the id is another run's: the downstream refuses the request, which resets this attempt
        if attempt.lease is not None and not attempt.lease.publishable():
            # Lost its right to publish (fence under way, or the lease could not be renewed): never release.
            await self._carry_out(
                request, attempt, self._handle(request, attempt, a.LivenessLost("lease_lost"))
            )
            return
        # first_delta_sent must be durable before the first byte of content can reach the client.
        try:
            await self._journal.write_ahead(request)
        except StoreUnavailable as exc:
            log.error(
                "journal: first_delta_sent of %s not recorded (serving anyway): %s", request.request_id, exc
            )
        if attempt.state is a.AttemptState.WRITING_AHEAD:  # not reset or fenced meanwhile
            await self._carry_out(request, attempt, self._handle(request, attempt, a.WriteAheadDone()))

    async def _release(self, request: LogicalRequest, attempt: a.Attempt, release: a.Release) -> None:
        if await self._claim_conflict():
            return  # nothing of a run refused by its claim reaches the client
        live = self._services.registry.get(request.request_id)
        if live is not None and attempt.first_delta and self._tracked is not None:
            # From here the downstream owns this attempt: it ends the stream if the replica is lost.
            live.watch_publisher(self._services.liveness, attempt, self._tracked)
            self._handed_over = True
        await self._write(
            attempt, m.response_headers_reply(), *([m.RESPONSE_BODY_CONTINUE] * release.held_chunks)
        )
        # Leave the path: Envoy forwards the rest without us.

    async def _write(self, attempt: a.Attempt, *replies: m.Reply) -> None:
        assert self._context is not None
        if attempt is not self._attempt:
            return  # an earlier attempt the gate fed: its own stream is gone
        async with self._write_lock:
            if self._left:
                return
            self._left = True
            # A decision made after Envoy tore the attempt down: no one is left to answer.
            with contextlib.suppress(grpc.aio.UsageError, asyncio.InvalidStateError):
                for reply in replies:
                    await self._context.write(reply)

    async def _settle(self, request: LogicalRequest, attempt: a.Attempt) -> None:
        # The closed connection is the proof; a retry still waits (the gate) until etcd confirmed the
        # revocation, so two valid leases never coexist.
        await self._leases.release(attempt.lease, FenceProof.CONNECTION_CLOSED)
        self._feed(request, attempt, a.FenceProven(FenceProof.CONNECTION_CLOSED.value))

    async def _fence(self, request: LogicalRequest, attempt: a.Attempt) -> None:
        started = time.monotonic()
        proof: FenceProof | None
        if not self._services.liveness.registered(attempt.replica):
            # A static replica: no agent, no replica side that could honour a lease. Our answer closes its
            # connection, the only way its bytes could reach the client: that is the whole fence.
            await self._leases.release(attempt.lease, FenceProof.CONNECTION_CLOSED)
            proof = FenceProof.CONNECTION_CLOSED
        else:
            wait_for_ack = request.policy.uncertain_source_liveness.wait_for == "cancel_ack_or_lease_expiry"
            proof = await self._leases.fence(attempt.lease, accept_cancel_ack=wait_for_ack)
        waited_ms = (time.monotonic() - started) * 1000
        fenced = a.FenceProven(proof.value, waited_ms) if proof is not None else a.FenceUnprovable()
        self._feed(request, attempt, fenced)

    def _liveness_uncertain(self, attempt: a.Attempt) -> bool:
        """A closed connection proves the attempt dead only if its replica showed no sign of running on."""
        tracked = self._services.progress.tracked(attempt.attempt_id)
        unreceived_progress = tracked is not None and tracked.reported > tracked.received
        liveness = self._services.liveness
        lost = liveness.registered(attempt.replica) and liveness.state(attempt.replica) is Liveness.LOST
        return unreceived_progress or lost

    def _no_compatible_replica(self, request: LogicalRequest, attempt: a.Attempt) -> str | None:
        """Why a retry could not land on a replica of the pinned compatibility group (None: it can)."""
        digest = request.fingerprint_digest
        if digest is None:
            return None
        replicas = self._services.liveness.routable
        if compatible_alternatives(replicas, digest, exclude=attempt.replica) > 0:
            return None
        pinned = next((r for r in replicas.values() if r.digest == digest), None)
        if pinned is None:
            return f"no healthy replica with the pinned fingerprint {digest} is left"
        return why_no_compatible_replica(replicas, pinned, exclude=attempt.replica)

    async def _claim_conflict(self) -> bool:
        """Wait until the request's journal claim is settled (it runs beside the first attempt); True when
        the id is another run's: then nothing of this one may be released."""
        return self._live is not None and await self._live.claim_conflict() is not None


def _answer(request: LogicalRequest, verdict: a.TriggerRetry | a.FailRequest) -> m.ProcessingResponse:
    if isinstance(verdict, a.TriggerRetry):
        return _RETRY
    return m.immediate(
        verdict.status,
        views.error_body(request, verdict),
        extra_headers=views.error_headers(request, verdict),
    )
