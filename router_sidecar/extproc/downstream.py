"""The DOWNSTREAM placement (HTTP connection manager chain): one stream per client request.

Request side: admit or reject the request (parse, id, internal headers, idempotency claim), or answer a
journal look-up. Response side (FULL_DUPLEX_STREAMED): every chunk goes through `LogicalRequest`, which
decides what the client receives; this is the only place that ever ends the client stream early.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import hashlib
import json
import logging
import re
import secrets
import time
import urllib.parse

import grpc
from google.protobuf.struct_pb2 import Struct

from router_sidecar.coordination.journal import ClaimConflict
from router_sidecar.coordination.store import StoreUnavailable
from router_sidecar.core.openai_api import RequestRejected, RouteKind, parse_request, route_kind
from router_sidecar.core.request import DownstreamLoss, Forward, LogicalRequest, Phase
from router_sidecar.core.tools import TOOLS_PREFIX
from router_sidecar.extproc import messages as m
from router_sidecar.extproc.discovery import choose_pin, pin_metadata
from router_sidecar.extproc.registry import Live
from router_sidecar.extproc.services import Services
from router_sidecar.extproc.tool_calls import ToolCallStream

log = logging.getLogger(__name__)

# Headers a client may not set: they carry the gateway's own facts to the replicas.
INTERNAL_HEADER_PREFIXES = ("x-attempt-", "x-fencing-", "x-router-sidecar-", "x-envoy-")
INTERNAL_HEADERS = frozenset({"x-attempt-id", "x-fencing-token", "x-sim-replica"})
_IDEMPOTENCY_KEY = re.compile(r"[A-Za-z0-9._:~-]{1,200}")
LOOKUP_PREFIX = "/v1/requests/"
# How long a torn-down stream waits for Envoy's access-log entry that says who tore it down.
ACCESS_LOG_WAIT_SECONDS = 1.0


class DownstreamState(enum.Enum):
    AWAITING_REQUEST_HEADERS = "awaiting_request_headers"
    AWAITING_REQUEST_BODY = "awaiting_request_body"
    TRACKING = "tracking"  # an admitted logical request: the response goes through its machine
    PASS_THROUGH = "pass_through"  # not an inference call (e.g. /v1/models): forwarded untouched
    TOOL_CALL = "tool_call"  # a call to a tool route, under idempotency by key
    ANSWERED = "answered"  # we replied ourselves (rejection, look-up)


def new_request_id() -> str:
    return f"req_{int(time.time() * 1000):012x}{secrets.token_hex(6)}"


def tenant_of(headers: dict[str, str]) -> str:
    """Idempotency and journal records are scoped to the caller's credential, never shared across it."""
    credential = headers.get("authorization") or headers.get("x-api-key")
    return hashlib.sha256(credential.encode()).hexdigest()[:20] if credential else "anonymous"


def _error(
    status: int, code: str, message: str, request_id: str | None, **extra: object
) -> m.ProcessingResponse:
    body = {
        "error": {
            "code": code,
            "message": message,
            "type": "gateway_error",
            "request_id": request_id,
            **extra,
        }
    }
    headers = [("x-request-id", request_id)] if request_id else []
    return m.immediate(status, json.dumps(body).encode(), extra_headers=headers)


class DownstreamStream:
    def __init__(self, services: Services) -> None:
        self._policy = services.policy
        self._registry = services.registry
        self._journal = services.journal
        self._ledger = services.ledger
        self._leases = services.leases
        self._liveness = services.liveness
        self._progress = services.progress
        self._discovery = services.discovery
        self._gateway_id = services.gateway_id
        self._tool: ToolCallStream | None = None
        self._context: grpc.aio.ServicerContext | None = None
        self._write_lock = asyncio.Lock()  # replies to Envoy's messages and our own (fence) writes
        self._ended_by_us = False  # we sent end_of_stream: nothing more goes to the client
        self.state = DownstreamState.AWAITING_REQUEST_HEADERS
        self._request_id: str | None = None
        self._tenant = "anonymous"
        self._kind: RouteKind | None = None
        self._live: Live | None = None

    async def run(self, context: grpc.aio.ServicerContext) -> None:
        self._context = context
        try:
            while True:
                message = await context.read()
                if message is grpc.aio.EOF:
                    break
                reply = await self._handle(message)
                if reply is not None:
                    async with self._write_lock:
                        if not self._ended_by_us:
                            await context.write(reply)
        finally:
            # Possibly cancelled here: settle the outcome in a task of its own.
            if self._live is not None:
                asyncio.get_running_loop().create_task(self._settle(self._live))
            if self._tool is not None:
                asyncio.get_running_loop().create_task(self._tool.on_stream_end())

    async def _handle(self, message: m.ProcessingRequest) -> m.ProcessingResponse | None:
        which = message.WhichOneof("request")
        if which == "request_headers":
            return await self._on_request_headers(message.request_headers)
        if which == "request_body":
            return await self._on_request_body(message.request_body.body)
        if which == "response_headers":
            if self._tool is not None:
                code_details = str(m.attributes(message).get("response.code_details", ""))
                self._tool.on_response_headers(m.header_map(message.response_headers), code_details)
                return m.response_headers_reply()
            return self._on_response_headers(m.header_map(message.response_headers))
        if which == "response_body":
            body = message.response_body
            if self._tool is not None:
                return await self._tool.on_response_body(body.body, body.end_of_stream)
            return self._on_response_body(body.body, body.end_of_stream)
        if which == "response_trailers":
            return m.RESPONSE_TRAILERS_CONTINUE
        return None

    # --- request side ------------------------------------------------------------------------------------

    async def _on_request_headers(self, message: m.ep.HttpHeaders) -> m.ProcessingResponse:
        headers = m.header_map(message)
        method, path = headers.get(":method", ""), headers.get(":path", "")
        self._tenant = tenant_of(headers)
        strip = [h for h in headers if h in INTERNAL_HEADERS or h.startswith(INTERNAL_HEADER_PREFIXES)]
        if method == "GET" and path.startswith(LOOKUP_PREFIX):
            self.state = DownstreamState.ANSWERED
            return await self._lookup(urllib.parse.unquote(path[len(LOOKUP_PREFIX) :].split("?", 1)[0]))
        if path.startswith(TOOLS_PREFIX) and method not in ("GET", "HEAD"):
            return await self._on_tool_call_headers(message, headers, strip)
        self._kind = route_kind(path) if method == "POST" else None
        if self._kind is None:
            self.state = DownstreamState.PASS_THROUGH
            return m.request_headers_reply(m.header_mutation(remove=strip))
        key = headers.get("idempotency-key")
        if key is not None and not _IDEMPOTENCY_KEY.fullmatch(key):
            self.state = DownstreamState.ANSWERED
            return _error(
                400,
                "invalid_idempotency_key",
                "Idempotency-Key must be 1-200 characters of A-Z a-z 0-9 . _ : ~ -",
                None,
            )
        self._request_id = key or new_request_id()
        if message.end_of_stream:
            self.state = DownstreamState.ANSWERED
            return _error(
                400, "invalid_json", "the request has no body; send a JSON object", self._request_id
            )
        self.state = DownstreamState.AWAITING_REQUEST_BODY
        return m.request_headers_reply(m.header_mutation([("x-request-id", self._request_id)], strip))

    async def _on_tool_call_headers(
        self, message: m.ep.HttpHeaders, headers: dict[str, str], strip: list[str]
    ) -> m.ProcessingResponse:
        key = headers.get("idempotency-key")
        if key is None or not _IDEMPOTENCY_KEY.fullmatch(key):
            self.state = DownstreamState.ANSWERED
            return _error(
                428,
                "idempotency_key_required",
                "tool calls through the gateway need an Idempotency-Key (1-200 characters of "
                "A-Z a-z 0-9 . _ : ~ -) derived from the logical action, e.g. {request_id}:call_01",
                None,
            )
        self._tool = ToolCallStream(
            ledger=self._ledger,
            policy=self._policy.tools,
            registry=self._registry,
            journal=self._journal,
            tenant=self._tenant,
            key=key,
            caller_attempt_id=headers.get("x-attempt-id"),
            gateway_id=self._gateway_id,
        )
        self.state = DownstreamState.TOOL_CALL
        if message.end_of_stream:
            answer = await self._tool.on_request_body(b"")
            if answer is not None:
                return answer
        # The tool learns the caller's attempt only as the gateway vouches for it (a live attempt of the
        # request named by the key), never as the caller claims it.
        vouched = [("x-attempt-id", self._tool.attempt_id)] if self._tool.attempt_id else []
        return m.request_headers_reply(m.header_mutation(vouched, strip))

    async def _on_request_body(self, body: bytes) -> m.ProcessingResponse:
        if self._tool is not None:
            return await self._tool.on_request_body(body) or m.request_body_reply()
        assert self._request_id is not None and self._kind is not None
        request_id = self._request_id
        try:
            parsed = parse_request(
                self._kind, body, max_body_bytes=self._policy.limits.max_request_body_bytes, known_models=None
            )
        except RequestRejected as rejected:
            self.state = DownstreamState.ANSWERED
            return m.immediate(
                rejected.status, rejected.body(request_id), extra_headers=[("x-request-id", request_id)]
            )
        request = LogicalRequest(
            request_id=request_id, tenant=self._tenant, parsed=parsed, policy=self._policy
        )
        pin: Struct | None = None
        if self._discovery:
            pinned = choose_pin(self._liveness.replicas, parsed.model)
            if pinned is None:
                self.state = DownstreamState.ANSWERED
                served = sorted({r.fingerprint.model_id or "?" for r in self._liveness.replicas.values()})
                if not served:
                    return _error(
                        503, "no_replica", "no healthy replica is registered; try again later", request_id
                    )
                return _error(
                    404,
                    "model_not_found",
                    f"no healthy replica serves model {parsed.model!r}; served: {', '.join(served)}",
                    request_id,
                )
            # Every attempt of this request goes to this compatibility group only (subset load balancing).
            request.pin(pinned.digest, pinned.fingerprint.weights_revision or pinned.fingerprint.model_id)
            pin = pin_metadata(pinned.digest)
        live = self._registry.add(request)
        if live is None:
            self.state = DownstreamState.ANSWERED
            return _error(
                409,
                "idempotency_key_in_flight",
                "a request with this Idempotency-Key is still in flight; wait for it or look it up",
                request_id,
                journal=LOOKUP_PREFIX + request_id,
            )
        try:
            await self._journal.claim(request)
        except ClaimConflict as conflict:
            self._registry.remove(live)
            self.state = DownstreamState.ANSWERED
            if conflict.in_flight:
                return _error(
                    409,
                    "idempotency_key_in_flight",
                    "a request with this Idempotency-Key is still in flight; wait for it or look it up",
                    request_id,
                    journal=LOOKUP_PREFIX + request_id,
                )
            return _error(
                409,
                "request_already_finished",
                "this Idempotency-Key names a request that already delivered output; its outcome is in "
                "the journal. Send a new key to ask again.",
                request_id,
                journal=LOOKUP_PREFIX + request_id,
                outcome=conflict.existing.get("outcome"),
            )
        except StoreUnavailable as exc:
            # Degraded mode: serve, but without a durable journal no retry can be proven safe.
            log.error("journal unavailable, serving request %s without retries: %s", request_id, exc)
            request.block_retries("the request journal (etcd) is unreachable, so no retry can be proven safe")
        self._live = live
        live.publisher_lost = self._on_publisher_lost
        self.state = DownstreamState.TRACKING
        return m.request_body_reply(dynamic_metadata=pin)

    async def _lookup(self, request_id: str) -> m.ProcessingResponse:
        live = self._registry.get(request_id)
        if live is not None and live.request.tenant == self._tenant:
            record = self._journal.view(live.request)
        else:
            try:
                record = await self._journal.lookup(self._tenant, request_id)
            except StoreUnavailable as exc:
                return _error(
                    503, "journal_unavailable", f"the request journal cannot be read now: {exc}", request_id
                )
        if record is None:
            return _error(
                404,
                "request_not_found",
                "no request with this id is known to this caller (records expire after the retention period)",
                request_id,
            )
        return m.immediate(200, json.dumps(record).encode(), extra_headers=[("x-request-id", request_id)])

    # --- response side -----------------------------------------------------------------------------------

    def _on_response_headers(self, headers: dict[str, str]) -> m.ProcessingResponse:
        if self.state is not DownstreamState.TRACKING or self._live is None:
            return m.response_headers_reply()
        request = self._live.request
        request.on_response_headers(int(headers.get(":status", "0") or 0), headers.get("content-type", ""))
        return m.response_headers_reply(m.header_mutation([("x-request-id", request.request_id)]))

    def _on_response_body(self, chunk: bytes, end_of_stream: bool) -> m.ProcessingResponse | None:
        if self.state is not DownstreamState.TRACKING or self._live is None:
            return m.streamed_body(chunk, end_of_stream)
        request = self._live.request
        if self._live.publisher_progress is not None:
            self._live.publisher_progress.received += len(chunk)
        publisher = request.publisher
        if publisher is not None and publisher.lease is not None and not publisher.lease.publishable():
            # Its right to publish is gone (fenced, or its lease could not be renewed): drop, and end.
            decision = request.on_publisher_lost()
            self._journal.update(request)
            if decision is None:
                return None
            self._ended_by_us = True
            return m.streamed_body(decision.data, True)
        decision = request.on_response_body(chunk, end_of_stream)
        if request.is_terminal:
            self._journal.update(request)
        if isinstance(decision, Forward):
            return m.streamed_body(decision.data, decision.end_of_stream)
        # Terminate: our end_of_stream ends the client stream cleanly and makes Envoy reset the upstream.
        return m.streamed_body(decision.data, True)

    async def _on_publisher_lost(self) -> None:
        """The replica publishing into this stream lost its heartbeat: fence it and end the stream."""
        if self._live is None or self._context is None:
            return
        request = self._live.request
        publisher = request.publisher
        if publisher is not None:
            request.on_replica_lost(publisher)
            if publisher.lease is not None:
                # No retry follows, so there is no proof to wait for: revoke, and stop forwarding now.
                await self._leases.release(publisher.lease)
        async with self._write_lock:
            decision = request.on_publisher_lost()
            self._journal.update(request)
            if decision is None or self._ended_by_us:
                return
            self._ended_by_us = True
            await self._context.write(m.streamed_body(decision.data, True))

    async def _settle(self, live: Live) -> None:
        request = live.request
        try:
            if not request.is_terminal:
                if request.phase is Phase.DECODE:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(live.access_logged.wait(), ACCESS_LOG_WAIT_SECONDS)
                request.on_downstream_lost(live.loss_cause or DownstreamLoss.UNKNOWN)
            self._journal.update(request)
        finally:
            live.stop_watching()
            if live.publisher_progress is not None:
                self._progress.untrack(live.publisher_progress)
            self._registry.remove(live)
            self._journal.release(request)
            for attempt in request.attempts:  # whatever still holds a lease has finished publishing
                if attempt.lease is not None and attempt.lease.revoked_at is None and attempt.lease.lease:
                    await self._leases.release(attempt.lease)
