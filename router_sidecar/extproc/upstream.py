"""The UPSTREAM placement (cluster `llm` upstream filter chain): one stream per attempt.

STREAMED response body with `send_body_without_waiting_for_header_response`: Envoy keeps sending body
chunks while our reply to the response headers is pending. So we hold the headers (and every chunk) until
the attempt's machine decides: release at the first delta (after the write-ahead journal record), retry
(`:status 503` → Envoy's router retries on another host), or fail with a real error. After a release the
stream ends with OK and Envoy forwards the rest of the response without us (DESIGN.md §5.7).
"""

from __future__ import annotations

import asyncio
import logging
import secrets

import grpc

from router_sidecar.attempt import Attempt, AttemptFailed, Hold, PassThrough, Release
from router_sidecar.extproc import messages as m
from router_sidecar.extproc.registry import Registry
from router_sidecar.journal import Journal
from router_sidecar.request import AttemptRecord, FailRequest, LogicalRequest, TriggerRetry
from router_sidecar.store import StoreUnavailable

log = logging.getLogger(__name__)

_RETRY = m.response_headers_reply(m.header_mutation([(":status", "503")]))


def new_attempt_id() -> str:
    return f"att_{secrets.token_hex(8)}"


class UpstreamStream:
    def __init__(self, *, registry: Registry, journal: Journal) -> None:
        self._registry = registry
        self._journal = journal

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
            refusal = request.refuse_attempt()
            self._journal.update(request)
            await context.write(
                m.immediate(refusal.status, refusal.body, extra_headers=[("x-request-id", request_id)])
            )
            return
        replica = str(attrs.get("upstream.address") or "unknown")
        attempt_id = new_attempt_id()
        record = request.begin_attempt(attempt_id, replica)
        attempt = Attempt(request_id=request_id, attempt_id=attempt_id, number=record.number, replica=replica)
        self._journal.update(request)
        await context.write(
            m.request_headers_reply(
                m.header_mutation([("x-request-id", request_id), ("x-attempt-id", attempt_id)])
            )
        )
        try:
            await self._hold_until_decided(context, request, record, attempt)
        except asyncio.CancelledError:
            decision = attempt.on_stream_lost()
            if isinstance(decision, AttemptFailed):
                request.on_attempt_lost(record, decision)
                self._journal.update(request)
            raise

    async def _hold_until_decided(
        self,
        context: grpc.aio.ServicerContext,
        request: LogicalRequest,
        record: AttemptRecord,
        attempt: Attempt,
    ) -> None:
        held_bodies = 0
        while True:
            message = await context.read()
            if message is grpc.aio.EOF:
                decision = attempt.on_stream_lost()
                if isinstance(decision, AttemptFailed):
                    request.on_attempt_lost(record, decision)
                    self._journal.update(request)
                return
            which = message.WhichOneof("request")
            if which == "response_headers":
                headers = m.header_map(message.response_headers)
                decision = attempt.on_response_headers(
                    int(headers.get(":status", "0") or 0), headers.get("content-type", "")
                )
            elif which == "response_body":
                held_bodies += 1
                decision = attempt.on_response_body(
                    message.response_body.body, message.response_body.end_of_stream
                )
            else:
                continue
            if isinstance(decision, Hold):
                continue
            if isinstance(decision, Release | PassThrough):
                if isinstance(decision, Release):
                    request.on_attempt_released(record, first_delta=decision.first_delta)
                    await self._write_ahead(request)
                else:
                    request.on_attempt_passed_through(record, decision.status)
                    self._journal.update(request)
                await context.write(m.response_headers_reply())
                for _ in range(held_bodies):
                    await context.write(m.RESPONSE_BODY_CONTINUE)
                return  # leave the path: Envoy forwards the rest without us
            outcome = request.on_attempt_failed(record, decision)
            self._journal.update(request)
            if isinstance(outcome, TriggerRetry):
                await context.write(_RETRY)
            else:
                assert isinstance(outcome, FailRequest)
                await context.write(
                    m.immediate(
                        outcome.status, outcome.body, extra_headers=[("x-request-id", request.request_id)]
                    )
                )
            return

    async def _write_ahead(self, request: LogicalRequest) -> None:
        # first_delta_sent must be durable before the first byte of content can reach the client.
        try:
            await self._journal.write_ahead(request)
        except StoreUnavailable as exc:
            log.error(
                "journal: first_delta_sent of %s not recorded (serving anyway): %s", request.request_id, exc
            )
