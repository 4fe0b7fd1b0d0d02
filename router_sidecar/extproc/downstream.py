"""The DOWNSTREAM placement (HTTP connection manager chain): one stream per client request.

The route is classified once, at the request headers (`core/routes.py`), and one processor handles the
whole stream, as Envoy AI Gateway picks one processor per route: inference (admission, then every response
chunk through the `LogicalRequest` machine — the only place that ever ends a client stream early), a tool
call (idempotency by key), a journal look-up, a rejection, or a plain pass-through. The response body is
FULL_DUPLEX_STREAMED for every route, so each processor answers every chunk with the bytes to forward.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import json
import logging
import math
import secrets
import time

import grpc
from google.protobuf.struct_pb2 import Struct

from router_sidecar.coordination.registry_store import Replica
from router_sidecar.coordination.store import StoreUnavailable
from router_sidecar.core import request as r
from router_sidecar.core import views
from router_sidecar.core.destinations import (
    GATEWAY,
    PICKER_KEY,
    Candidate,
    Destinations,
    choose,
    holder_only,
    picker_list,
)
from router_sidecar.core.dialects import ErrorShape, dialect_for
from router_sidecar.core.events import Outcome
from router_sidecar.core.openai_api import RequestRejected
from router_sidecar.core.placement import BREAKER
from router_sidecar.core.policy import ROUTE_POLICY_METADATA, Policy, PolicyError
from router_sidecar.core.routes import LOOKUP_PREFIX, Probe, Route, RouteClass, classify, valid_key
from router_sidecar.extproc import messages as m
from router_sidecar.extproc.discovery import PIN_KEY, choose_pin, why_no_compatible_replica
from router_sidecar.extproc.registry import Live
from router_sidecar.extproc.services import Services
from router_sidecar.extproc.tool_calls import ToolCallStream
from router_sidecar.telemetry import logs

log = logging.getLogger(__name__)

# Headers a client may not set: they carry the gateway's own facts to the replicas.
INTERNAL_HEADER_PREFIXES = ("x-attempt-", "x-fencing-", "x-router-sidecar-", "x-envoy-")
INTERNAL_HEADERS = frozenset({"x-attempt-id", "x-fencing-token", "x-sim-replica"})
# The gateway reads every inference response: it never asks a replica for a compressed one.
INFERENCE_STRIPPED = frozenset({"accept-encoding"})
# W3C trace context: the client's is the parent of the request's span (each attempt sends its own on).
TRACE_CONTEXT_HEADERS = ("traceparent", "tracestate")
# How long a torn-down stream waits for Envoy's access-log entry that says who tore it down.
ACCESS_LOG_WAIT_SECONDS = 1.0
ANONYMOUS = "anonymous"


def new_request_id() -> str:
    return f"req_{int(time.time() * 1000):012x}{secrets.token_hex(6)}"


def tenant_of(headers: dict[str, str], secret: bytes) -> str:
    """Idempotency and journal records are scoped to the caller's credential, never shared across it. The
    digest is an etcd key segment: keyed with the deployment's secret, it says nothing about the credential
    to whoever can list keys."""
    credential = headers.get("authorization") or headers.get("x-api-key")
    if not credential:
        return ANONYMOUS
    return hmac.new(secret, credential.encode("utf-8", "surrogateescape"), hashlib.sha256).hexdigest()[:32]


def _error(
    status: int,
    code: str,
    message: str,
    request_id: str | None,
    *,
    shape: ErrorShape = ErrorShape.OPENAI,
    headers: tuple[tuple[str, str], ...] = (),
    attempts: bool = True,
    **extra: object,
) -> m.ProcessingResponse:
    """An answer of ours; with `request_id`, to an inference request (`attempts`: none reached a replica)."""
    extra_headers = [*headers, *(views.id_headers(request_id, shape) if request_id else [])]
    if request_id and attempts:
        extra_headers.append((views.ATTEMPTS_HEADER, "0"))
    body = views.error_document(shape, status, code, message, request_id, **extra)
    return m.immediate(status, body, extra_headers=extra_headers)


# Journal writes that outlive the stream that started them (held here so that they are not collected).
_BACKGROUND: set[asyncio.Task[None]] = set()


class _Writer:
    """Replies to Envoy's messages and our own unsolicited writes (terminal frames), in order."""

    def __init__(self, context: grpc.aio.ServicerContext) -> None:
        self._context = context
        self._lock = asyncio.Lock()
        self.ended_by_us = False  # we sent end_of_stream: nothing more goes to the client

    async def write(self, reply: m.Reply | None, *, ends_stream: bool = False) -> None:
        if reply is None:
            return
        async with self._lock:
            if self.ended_by_us:
                return
            self.ended_by_us = ends_stream
            with contextlib.suppress(grpc.aio.UsageError, asyncio.InvalidStateError):
                await self._context.write(reply)


class PassThrough:
    """Not ours to judge (e.g. /v1/models, /v1/embeddings): every message continues unchanged."""

    async def on_request_body(self, body: bytes) -> m.Reply | None:
        return m.request_body_reply()

    async def on_response_headers(self, message: m.ProcessingRequest) -> m.Reply | None:
        return m.response_headers_reply()

    async def on_response_body(self, chunk: bytes, end_of_stream: bool) -> m.Reply | None:
        return m.streamed_body(chunk, end_of_stream)

    async def on_response_trailers(self) -> m.Reply | None:
        return m.RESPONSE_TRAILERS_CONTINUE

    def on_stream_end(self) -> None:
        pass


class ToolCall(PassThrough):
    def __init__(self, stream: ToolCallStream) -> None:
        self._stream = stream

    async def on_request_body(self, body: bytes) -> m.Reply | None:
        return await self._stream.on_request_body(body) or m.request_body_reply()

    async def on_response_headers(self, message: m.ProcessingRequest) -> m.Reply | None:
        code_details = str(m.attributes(message).get("response.code_details", ""))
        self._stream.on_response_headers(m.header_map(message.response_headers), code_details)
        return m.response_headers_reply()

    async def on_response_body(self, chunk: bytes, end_of_stream: bool) -> m.Reply | None:
        return await self._stream.on_response_body(chunk, end_of_stream)

    def on_stream_end(self) -> None:
        asyncio.get_running_loop().create_task(self._stream.on_stream_end())


class Inference(PassThrough):
    """An admitted inference request: its admission, then its response, through the request machine."""

    def __init__(
        self,
        services: Services,
        writer: _Writer,
        route: Route,
        request_id: str,
        tenant: str,
        policy: Policy,
        trace_context: dict[str, str],
        picker: tuple[str, ...] = (),
    ) -> None:
        self._services = services
        self._picker = picker  # an endpoint picker's list of replicas for this request (envoy.lb metadata)
        self._trace_context = trace_context  # the client's traceparent/tracestate: our spans' parent
        self._policy = policy  # the gateway's, or its route's overlay of it
        self._writer = writer
        self._route = route
        self._request_id = request_id
        self._tenant = tenant
        self._live: Live | None = None
        assert route.api is not None
        self._shape = dialect_for(route.api).errors  # the API's error shape, for every error it gets
        self._replacement: bytes | None = None  # our error body, sent instead of the response's own
        # The machine's reply to the message being handled (request body, response headers), when it comes.
        self._reply: asyncio.Future[r.Decision] | None = None
        self._headers_only = False  # the response being answered has no body (its headers end it)
        # Our reply to the response headers, and the body before the first content (a stream's preamble),
        # held until the chunk with the first content (or the end) is answered: the client gets no `200`
        # before content passed here, so a reset in between is Envoy's own JSON error (journaled as nothing
        # delivered), never a 200 cut short with nothing in it (docs/design.md#the-two-filter-placements).
        # Bounded: what comes before the first content was held by the attempt (max_held_response_bytes).
        self._held_headers: m.Reply | None = None
        self._held_body = b""

    # --- admission -------------------------------------------------------------------------------------

    async def on_request_body(self, body: bytes) -> m.Reply | None:
        services, request_id, policy = self._services, self._request_id, self._policy
        assert self._route.api is not None
        try:
            parsed = await services.parser.parse(
                self._route.api,
                body,
                max_body_bytes=policy.limits.max_request_body_bytes,
                max_json_depth=policy.limits.max_json_depth,
                prefix_block_bytes=services.policy.placement.prefix_block_bytes,
                prefix_max_blocks=services.policy.placement.prefix_max_blocks,
            )
        except RequestRejected as rejected:
            return m.immediate(
                rejected.status,
                views.rejection_body(rejected, request_id, self._shape),
                extra_headers=[*views.id_headers(request_id, self._shape), (views.ATTEMPTS_HEADER, "0")],
            )
        request = r.LogicalRequest(
            request_id=request_id,
            tenant=self._tenant,
            parsed=parsed,
            policy=policy,
            placement=services.placement,
        )
        destinations = await self._destinations(request)
        if isinstance(destinations, m.ProcessingResponse):
            return destinations
        live = services.registry.add(request, services)
        if live is None:
            return _in_flight(request_id, self._shape)
        live.client = self
        self._live = live
        services.telemetry.admitted(request, self._trace_context)
        logs.bind(request_id=request_id)
        services.journal.begin(request)
        # The claim runs beside the first attempt (policy journal.claim_before_forwarding: before it); the
        # machine holds back whatever must wait for it.
        decision = await self._decided(r.Admitted(destinations))
        if isinstance(decision, r.RejectRequest):
            # A duplicate refused before forwarding: nothing of this run was journaled, nothing is served.
            self._live = None
            services.registry.remove(live)
            services.journal.release(request)
            return self._immediate(request, decision.error)
        return m.request_body_reply(dynamic_metadata=_lb_metadata(request, destinations))

    async def _destinations(self, request: r.LogicalRequest) -> Destinations | m.ProcessingResponse:
        """Where the request's attempts go (core/destinations.py), its compatibility pin first; or the error
        that says why it can go nowhere."""
        services, parsed, request_id = self._services, request.parsed, request.request_id
        candidates = services.liveness.candidates()
        previous = parsed.previous_response_id
        holder = await _response_holder(services, self._tenant, previous) if previous else None
        if holder is not None:
            # State one replica holds: there or nowhere (its retries are blocked by the machine).
            only = holder_only(candidates, holder, self._picker)
            if isinstance(only, str):
                return _holder_unavailable(previous, holder, only, request_id, self._shape)
            replica = services.liveness.replicas.get(holder)
            if replica is not None:
                _pin(request, replica)  # its group, should the order run out
            return only
        if services.discovery:
            pinned = choose_pin(services.liveness.routable, parsed.model)
            known = parsed.model in services.liveness.models_ever_served
            if pinned is None and known and (targets := self._fallback_targets(request, candidates)):
                # Its model was registered but no replica of it can be sent to now (none healthy: their
                # agents withdrew them; every one draining): the fallback's, if allowed.
                return Destinations((), GATEWAY).with_fallback(targets, 0, "unavailable")
            if pinned is None:
                served = sorted({x.fingerprint.model_id or "?" for x in services.liveness.routable.values()})
                if not served:
                    return _error(
                        503,
                        "no_replica_available",
                        "no healthy replica is registered; try again later",
                        request_id,
                        shape=self._shape,
                    )
                return _error(
                    404,
                    "model_not_found",
                    f"no healthy replica serves model {parsed.model!r}; served: {', '.join(served)}",
                    request_id,
                    shape=self._shape,
                )
            # Every attempt of this request goes to this compatibility group only (subset load balancing).
            _pin(request, pinned)
        turn = next(services.turns)
        targets = self._fallback_targets(request, candidates) if services.discovery else []
        candidates, ranking = services.placement.ranking(candidates, parsed.prefix_blocks)
        destinations = choose(
            candidates, pinned=request.fingerprint_digest, picker=self._picker, turn=turn, ranking=ranking
        )
        if targets:
            cause = "" if destinations.order else "unavailable"
            destinations = destinations.with_fallback(targets, request.max_attempts, cause)
        if destinations.overloaded_for is not None:
            # Every replica it could go to is ejected, for a while yet: no attempt is made.
            retry_after = max(1, math.ceil(destinations.overloaded_for))
            if destinations.ejected_by == BREAKER:
                error = r.FailRequest(
                    503,
                    Outcome.NO_REPLICA_AVAILABLE,
                    f"every replica that serves model {parsed.model!r} failed before content too often in a "
                    f"row (its circuit is open, placement.breaker_failures); the first is tried again in "
                    f"{retry_after} s",
                    retry_after=str(retry_after),
                )
            else:
                error = r.FailRequest(
                    429,
                    Outcome.REPLICAS_OVERLOADED,
                    f"every replica that serves model {parsed.model!r} answered 429 or 503 with Retry-After "
                    f"(overloaded); the first is back in {retry_after} s: try again then",
                    retry_after=str(retry_after),
                )
            self._journal_refusal(request, error, destinations)
            return self._immediate(request, error)
        return destinations

    def _fallback_targets(
        self, request: r.LogicalRequest, candidates: list[Candidate]
    ) -> list[tuple[str, str]]:
        """(address, model) of the fallback models' replicas a fallback attempt may go to, in the policy's
        order of models (policy fallback; replicas from the registry: each names its model)."""
        fallback, liveness = request.policy.fallback, self._services.liveness
        if not fallback.models or request.retry_blocked is not None:
            return []
        usable, _ = self._services.placement.ranking(candidates, ())
        usable_addresses = {c.address for c in usable if not c.why_not}
        targets: list[tuple[str, str]] = []
        for model in fallback.models:
            if model == request.parsed.model:
                continue
            group = choose_pin(liveness.routable, model)
            if group is None:
                continue
            targets += [
                (address, model)
                for address, replica in sorted(liveness.routable.items())
                if replica.digest == group.digest and address in usable_addresses
            ]
        return targets[: fallback.max_attempts]

    def _journal_refusal(
        self, request: r.LogicalRequest, error: r.FailRequest, destinations: Destinations
    ) -> None:
        """Journal a request refused before any attempt (failed, so that the same Idempotency-Key may run
        again), beside the answer: the client does not wait for etcd."""

        async def write() -> None:
            try:
                await self._services.journal.record_rejected(
                    self._tenant,
                    request.request_id,
                    route=request.parsed.kind.value,
                    outcome=str(error.code),
                    status=error.status,
                    reason=error.message,
                    phase=r.Phase.FAILED,
                    destinations=destinations,
                )
            except StoreUnavailable as exc:
                log.warning("request %s refused, not journaled (etcd: %s)", request.request_id, exc)

        task = asyncio.get_running_loop().create_task(write())
        _BACKGROUND.add(task)
        task.add_done_callback(_BACKGROUND.discard)

    async def _decided(self, event: r.Input) -> r.Decision:
        """Feed `event` and wait for the machine's reply to the message it came with (now, or once what it
        waits for — the claim — is settled)."""
        assert self._live is not None
        reply = self._reply = asyncio.get_running_loop().create_future()
        await self._live.feed(event)
        return await reply

    # --- what the machine addresses to the client stream -----------------------------------------------

    async def deliver(self, decision: r.Decision) -> None:
        if isinstance(decision, r.FailNow):
            # Unsolicited, while Envoy waits for the response headers: it answers the client and resets the
            # upstream request (verified on Envoy 1.40).
            assert self._live is not None
            self._held_headers = None  # answered instead
            await self._writer.write(self._immediate(self._live.request, decision.error), ends_stream=True)
        elif isinstance(decision, r.Terminate):
            # Our end_of_stream ends the client stream cleanly and makes Envoy reset the upstream (= cancel).
            await self._release_headers()
            await self._writer.write(m.streamed_body(decision.data, True), ends_stream=True)
        elif self._reply is not None and not self._reply.done():
            self._reply.set_result(decision)

    def _immediate(self, request: r.LogicalRequest, error: r.ClientError) -> m.ProcessingResponse:
        if isinstance(error, r.DuplicateRun):
            body = _duplicate_body(error, self._request_id, self._shape)
            return m.immediate(409, body, extra_headers=self._id_header)
        return m.immediate(
            error.status, views.error_body(request, error), extra_headers=views.error_headers(request, error)
        )

    @property
    def _id_header(self) -> list[tuple[str, str]]:
        return views.id_headers(self._request_id, self._shape)

    # --- response --------------------------------------------------------------------------------------

    async def on_response_headers(self, message: m.ProcessingRequest) -> m.Reply | None:
        if self._live is None:
            return m.response_headers_reply()
        request = self._live.request
        headers = m.header_map(message.response_headers)
        attrs = m.attributes(message)
        self._headers_only = message.response_headers.end_of_stream
        decision = await self._decided(
            r.ResponseStarted(
                status=int(headers.get(":status", "0") or 0),
                content_type=headers.get("content-type", ""),
                flags=m.response_flags(attrs.get("response.flags")),
                details=str(attrs.get("response.code_details", "")),
                no_compatible_replica=self._no_compatible_replica(request),
                envoy_attempts=m.attempt_count(attrs.get("upstream.request_attempt_count")),
            )
        )
        if isinstance(decision, r.WithholdResponse):
            return None  # the client was answered already
        if isinstance(decision, r.ReplaceResponse):
            return self._replace(request, decision.error)
        reply = m.response_headers_reply(m.header_mutation(views.request_id_headers(request)))
        if self._headers_only:
            return reply
        self._held_headers = reply  # written with the first body chunk's answer (`_release_headers`)
        return None

    async def _release_headers(self, then: bytes = b"", end_of_stream: bool = False) -> None:
        """Our held reply to the response headers, then the held body and `then` (a stream's messages are
        answered in order)."""
        held, self._held_headers = self._held_headers, None
        body, self._held_body = self._held_body + then, b""
        await self._writer.write(held)
        if body or end_of_stream:
            await self._writer.write(m.streamed_body(body, end_of_stream))

    async def on_response_trailers(self) -> m.Reply | None:
        await self._release_headers()
        return m.RESPONSE_TRAILERS_CONTINUE

    def _replace(self, request: r.LogicalRequest, error: r.ClientError) -> m.ProcessingResponse:
        if self._headers_only:
            return self._immediate(request, error)
        if isinstance(error, r.DuplicateRun):
            status, body, headers = (
                409,
                _duplicate_body(error, self._request_id, self._shape),
                self._id_header,
            )
        else:
            status, body = error.status, views.error_body(request, error)
            headers = views.error_headers(request, error)
        # Our status and content type now, our body in place of the first chunk; the rest is dropped.
        self._replacement = body
        mutation = m.header_mutation(
            [(":status", str(status)), ("content-type", "application/json"), *headers],
            remove=["content-length", "content-encoding", "transfer-encoding"],
        )
        return m.response_headers_reply(mutation)

    async def on_response_body(self, chunk: bytes, end_of_stream: bool) -> m.Reply | None:
        live = self._live
        if live is None:
            return m.streamed_body(chunk, end_of_stream)
        if self._replacement is not None:
            body, self._replacement = self._replacement, b""
            if body:
                await self._writer.write(m.streamed_body(body, True), ends_stream=True)
            return None
        request = live.request
        if live.publisher_progress is not None:
            live.publisher_progress.received += len(chunk)
        publisher = request.publisher
        if publisher is not None and publisher.lease is not None and not publisher.lease.publishable():
            # Its right to publish is gone (fenced, or its lease could not be renewed): the machine ends the
            # stream (before its first content passed here: right after the chunk that brings it).
            for decision in await live.feed(r.PublisherLost("lease_lost")):
                if isinstance(decision, r.Terminate):
                    return None
        forward: r.Forward | None = None
        for decision in request.handle(r.ResponseChunk(chunk, end_of_stream)):
            if isinstance(decision, r.Forward):
                forward = decision
            elif isinstance(decision, r.Terminate):
                # Our end_of_stream ends the client stream cleanly and makes Envoy reset the upstream.
                await self._release_headers()
                await self._writer.write(m.streamed_body(decision.data, True), ends_stream=True)
        self._services.journal.progress(request)
        if forward is None:
            return None
        if self._held_headers is not None:
            if not request.content_passed and not forward.end_of_stream:
                self._held_body += forward.data  # the preamble waits for the first content
                return None
            await self._release_headers(forward.data, forward.end_of_stream)
            return None
        return m.streamed_body(forward.data, forward.end_of_stream)

    def _no_compatible_replica(self, request: r.LogicalRequest) -> str | None:
        digest = request.fingerprint_digest
        if digest is None:
            return None
        replicas = self._services.liveness.routable
        pinned = next((x for x in replicas.values() if x.digest == digest), None)
        if pinned is None:
            return f"no healthy replica with the pinned fingerprint {digest} is left"
        exclude = request.attempts[-1].replica if request.attempts else ""
        return why_no_compatible_replica(replicas, pinned, exclude=exclude)

    def on_stream_end(self) -> None:
        if self._reply is not None and not self._reply.done():
            self._reply.cancel()
        if self._live is not None:
            self._live.stop()  # its deadline must not fire while the stream's end is being classified
            # Possibly cancelled here: settle the outcome in a task of its own.
            asyncio.get_running_loop().create_task(self._settle(self._live))

    async def _settle(self, live: Live) -> None:
        services = self._services
        request = live.request
        try:
            if not request.is_terminal:
                # Who tore the stream down (the client, the replica, Envoy itself) is in Envoy's access log.
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(live.access_logged.wait(), ACCESS_LOG_WAIT_SECONDS)
                cause = live.loss_cause or r.DownstreamLoss.UNKNOWN
                await live.feed(
                    r.DownstreamLost(cause, live.client_status, live.envoy_attempts, live.client_body_bytes)
                )
        finally:
            live.stop()
            if live.publisher_progress is not None:
                services.progress.untrack(live.publisher_progress)
            try:
                for attempt in request.attempts:  # whatever still holds a lease has finished publishing
                    lease = attempt.lease
                    if lease is not None and lease.revoked_at is None and lease.lease:
                        await services.leases.release(lease)
                # One write of the end, leases included; look-ups here see the live state until it is written.
                await services.journal.finish(request)
            finally:
                services.registry.remove(live)
                services.journal.release(request)


async def _response_holder(services: Services, tenant: str, response_id: str) -> str | None:
    """The replica that holds a stored response of this tenant, if the journal knows it. Unknown (etcd
    away, or made before the gateway recorded holders): the request goes as any other."""
    try:
        return await services.journal.response_holder(tenant, response_id)
    except StoreUnavailable as exc:
        log.warning("stored response %s: its holder is unknown (etcd: %s)", response_id, exc)
        return None


def _holder_unavailable(
    response_id: str | None,
    holder: str,
    why: str,
    request_id: str | None,
    shape: ErrorShape = ErrorShape.OPENAI,
) -> m.ProcessingResponse:
    error = r.holder_unavailable(response_id, holder, why)
    return _error(error.status, error.code, error.message, request_id, shape=shape)


def _pin(request: r.LogicalRequest, replica: Replica) -> None:
    request.pin(replica.digest, replica.fingerprint.weights_revision or replica.fingerprint.model_id)


def _lb_metadata(request: r.LogicalRequest, destinations: Destinations) -> Struct | None:
    """What the cluster's load balancer reads: the order of the attempts' replicas (override_host; an
    endpoint picker's list, if any, is replaced by it) and the compatibility pin (its fallback, past the
    order's end)."""
    values = {PICKER_KEY: ",".join(destinations.order)} if destinations.order else {}
    if request.fingerprint_digest is not None:
        values[PIN_KEY] = request.fingerprint_digest
    return m.lb_metadata(values) if values else None


def _duplicate_body(duplicate: r.DuplicateRun, request_id: str, shape: ErrorShape) -> bytes:
    """The 409 body for a request whose id another run holds: still in flight, or finished with output."""
    if duplicate.in_flight:
        return _in_flight_body(request_id, shape)
    return views.error_document(
        shape,
        409,
        "request_already_finished",
        "this Idempotency-Key names a request that already delivered output; its outcome is in "
        "the journal. Send a new key to ask again.",
        request_id,
        journal=LOOKUP_PREFIX + request_id,
        outcome=duplicate.outcome,
    )


def _in_flight(request_id: str, shape: ErrorShape) -> m.ProcessingResponse:
    body = _in_flight_body(request_id, shape)
    return m.immediate(409, body, extra_headers=views.id_headers(request_id, shape))


def _in_flight_body(request_id: str, shape: ErrorShape) -> bytes:
    return views.error_document(
        shape,
        409,
        "idempotency_key_in_flight",
        "a request with this Idempotency-Key is still in flight; wait for it or look it up",
        request_id,
        journal=LOOKUP_PREFIX + request_id,
    )


class DownstreamStream:
    """Dispatches one client stream's messages to the processor chosen at its request headers."""

    def __init__(self, services: Services) -> None:
        self._services = services

    async def run(self, context: grpc.aio.ServicerContext) -> None:
        writer = _Writer(context)
        # The route's policy overlay, if its Envoy route carries one (ExtProcPerRoute initial metadata).
        route_policy = dict(context.invocation_metadata() or ()).get(ROUTE_POLICY_METADATA)
        first = await context.read()
        if first is grpc.aio.EOF:
            return
        if first.WhichOneof("request") == "request_headers":
            picker = picker_list(m.lb_value(first, PICKER_KEY))
            processor, reply = await self._choose(first.request_headers, writer, route_policy, picker)
            await writer.write(reply)
            pending = None
        else:
            # Envoy's own reply to a request it could not parse (431, 400): no request headers ever came.
            processor, pending = PassThrough(), first
        # Time spent on each message (metrics), summed here and reported once per stream, not per chunk.
        handled, busy = 0, 0.0
        try:
            while True:
                message = pending if pending is not None else await context.read()
                pending = None
                if message is grpc.aio.EOF:
                    break
                started = time.perf_counter()
                which = message.WhichOneof("request")
                if which == "request_body":
                    reply = await processor.on_request_body(message.request_body.body)
                elif which == "response_headers":
                    reply = await processor.on_response_headers(message)
                elif which == "response_body":
                    body = message.response_body
                    reply = await processor.on_response_body(body.body, body.end_of_stream)
                elif which == "response_trailers":
                    reply = await processor.on_response_trailers()
                else:
                    continue
                await writer.write(reply)
                handled += 1
                busy += time.perf_counter() - started
        finally:
            processor.on_stream_end()
            self._services.telemetry.stream_handled("downstream", handled, busy)

    async def _choose(
        self,
        message: m.ep.HttpHeaders,
        writer: _Writer,
        route_policy: str | None = None,
        picker: tuple[str, ...] = (),
    ) -> tuple[PassThrough, m.ProcessingResponse]:
        services = self._services
        pairs = m.header_pairs(message)
        headers = dict(pairs)
        method, path = headers.get(":method", ""), headers.get(":path", "")
        strip = [k for k, _ in pairs if k in INTERNAL_HEADERS or k.startswith(INTERNAL_HEADER_PREFIXES)]
        tenant = tenant_of(headers, services.tenant_secret)
        route = classify(method, path)
        rewrite = [(":path", route.rewrite_path)] if route.rewrite_path else []
        keys = [v for k, v in pairs if k == "idempotency-key"]
        if len(keys) > 1 and route.route_class in (RouteClass.INFERENCE, RouteClass.TOOL_CALL):
            return PassThrough(), _error(
                400,
                "duplicate_idempotency_key",
                f"the request carries {len(keys)} Idempotency-Key headers; send exactly one",
                None,
            )
        key = keys[0] if keys else None
        anonymous_refused = services.policy.tenancy.refuse_anonymous and tenant == ANONYMOUS
        if route.route_class is RouteClass.REJECTED:
            return PassThrough(), _error(
                route.status, route.code, route.message, None, headers=(("allow", route.allow),)
            )
        if route.route_class is RouteClass.HEALTH:
            return PassThrough(), await self._probe(route.probe)
        if route.route_class is RouteClass.LOOKUP:
            if anonymous_refused:
                return PassThrough(), _authentication_required("journal look-ups")
            return PassThrough(), await self._lookup(route.request_id, tenant)
        if route.route_class is RouteClass.TOOL_CALL:
            if anonymous_refused:
                return PassThrough(), _authentication_required("tool calls")
            if key is None or not valid_key(key):
                return PassThrough(), _error(
                    428,
                    "idempotency_key_required",
                    "tool calls through the gateway need an Idempotency-Key (1-200 characters of "
                    "A-Z a-z 0-9 . _ : ~ -) derived from the logical action, e.g. {request_id}:call_01",
                    None,
                )
            tool = ToolCallStream(
                ledger=services.ledger,
                policy=services.policy.tools,
                registry=services.registry,
                journal=services.journal,
                tenant=tenant,
                key=key,
                method=method,
                path=route.rewrite_path or path,
                caller_attempt_id=headers.get("x-attempt-id"),
                gateway_id=services.gateway_id,
            )
            if message.end_of_stream:
                answer = await tool.on_request_body(b"")
                if answer is not None:
                    return PassThrough(), answer
            # The tool learns the caller's attempt only as the gateway vouches for it (a live attempt of the
            # request named by the key), never as the caller claims it.
            vouched = [("x-attempt-id", tool.attempt_id)] if tool.attempt_id else []
            return ToolCall(tool), m.request_headers_reply(m.header_mutation([*rewrite, *vouched], strip))
        if route.route_class is RouteClass.STORED_RESPONSE:
            assert route.response_id is not None
            return PassThrough(), await self._to_holder(route.response_id, tenant, rewrite, strip)
        if route.route_class is RouteClass.PASS_THROUGH:
            return PassThrough(), m.request_headers_reply(m.header_mutation(rewrite, strip))
        # Inference.
        assert route.api is not None
        shape = dialect_for(route.api).errors
        if key is not None and not valid_key(key):
            return PassThrough(), _error(
                400,
                "invalid_idempotency_key",
                "Idempotency-Key must be 1-200 characters of A-Z a-z 0-9 . _ : ~ -",
                None,
                shape=shape,
                headers=((views.ATTEMPTS_HEADER, "0"),),
            )
        request_id = key or new_request_id()
        try:
            policy = services.route_policies.get(route_policy)
        except PolicyError as exc:
            log.error("the route's policy overlay is invalid: %s", exc)
            return PassThrough(), _error(
                500,
                "invalid_route_policy",
                f"this route's policy (Envoy route config, {ROUTE_POLICY_METADATA}) is invalid: {exc}; "
                "the gateway's operator must fix it",
                request_id,
                shape=shape,
            )
        if message.end_of_stream:
            return PassThrough(), _error(
                400, "invalid_json", "the request has no body; send a JSON object", request_id, shape=shape
            )
        strip += [k for k, _ in pairs if k in INFERENCE_STRIPPED]
        reply = m.request_headers_reply(m.header_mutation([*rewrite, ("x-request-id", request_id)], strip))
        trace_context = {k: headers[k] for k in TRACE_CONTEXT_HEADERS if k in headers}
        return Inference(services, writer, route, request_id, tenant, policy, trace_context, picker), reply

    async def _to_holder(
        self, response_id: str, tenant: str, rewrite: list[tuple[str, str]], strip: list[str]
    ) -> m.ProcessingResponse:
        """A request on a stored response (retrieve, resume its stream, cancel, delete) goes to the replica
        that holds it, as far as the journal knows; else as any other request."""
        mutation = m.header_mutation(rewrite, strip)
        holder = await _response_holder(self._services, tenant, response_id)
        if holder is None:
            return m.request_headers_reply(mutation)
        only = holder_only(self._services.liveness.candidates(), holder)
        if isinstance(only, str):
            return _holder_unavailable(response_id, holder, only, None)
        return m.request_headers_reply(mutation, m.lb_metadata({PICKER_KEY: holder}))

    async def _probe(self, probe: Probe | None) -> m.ProcessingResponse:
        """Answered here, not by Envoy: a probe through the listener proves Envoy, the ext_proc path and
        (ready) etcd, without which no attempt can be journaled or fenced."""
        if probe is Probe.READY:
            problem = await self._services.readiness.check()
            if problem is not None:
                return _error(503, problem.code, f"not ready: {problem.message}", None)
        return m.immediate(200, b'{"status": "ok"}')

    async def _lookup(self, request_id: str | None, tenant: str) -> m.ProcessingResponse:
        not_found = _error(
            404,
            "request_not_found",
            "no request with this id is known to this caller (records expire after the retention period)",
            request_id,  # None when it is not a valid id: never echoed into a header
            attempts=False,  # a look-up, not an answer to the request
        )
        if request_id is None:
            return not_found
        services = self._services
        live = services.registry.get(request_id)
        if live is not None and live.request.tenant == tenant and services.journal.serves(live.request):
            record = services.journal.view(live.request)
        else:
            try:
                record = await services.journal.lookup(tenant, request_id)
            except StoreUnavailable as exc:
                return _error(
                    503,
                    "journal_unavailable",
                    f"the request journal cannot be read now: {exc}",
                    request_id,
                    attempts=False,
                )
        if record is None:
            return not_found
        return m.immediate(200, json.dumps(record).encode(), extra_headers=[("x-request-id", request_id)])


def _authentication_required(what: str) -> m.ProcessingResponse:
    return _error(
        401,
        "authentication_required",
        f"{what} need a credential (Authorization or x-api-key): records are scoped to the caller, and "
        "callers without one would share them (tenancy.refuse_anonymous)",
        None,
        headers=(("www-authenticate", "Bearer"),),
    )
