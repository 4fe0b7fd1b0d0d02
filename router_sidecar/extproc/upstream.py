"""The UPSTREAM placement (cluster `llm` upstream filter chain): one ext_proc stream per attempt.

A translator around the request machine (`core/request.py`), which decides everything: Envoy's messages and
the monitors' signals become inputs of this attempt (`ForAttempt`), and the replies the machine addresses to
this stream are written here. STREAMED response body with `send_body_without_waiting_for_header_response`:
Envoy keeps sending body chunks while our reply to the response headers is pending, so the headers (and every
chunk) are held until the machine decides. After a release the stream ends with OK and Envoy forwards the
rest of the response without us (docs/design.md#the-two-filter-placements).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time

import grpc

from router_sidecar.coordination.progress import Tracked
from router_sidecar.core import attempt as a
from router_sidecar.core import request as r
from router_sidecar.core import views
from router_sidecar.extproc import messages as m
from router_sidecar.extproc.registry import Live
from router_sidecar.extproc.rewriter import FALLBACK_MODEL_HEADER
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
        self._write_lock = asyncio.Lock()
        self._context: grpc.aio.ServicerContext | None = None
        self._live: Live | None = None
        self._attempt_id = ""
        self._admission: asyncio.Future[r.Decision] | None = None  # ForwardAttempt or RefuseAttempt
        self.tracked: Tracked | None = None  # its bytes as received here (liveness from progress)
        self._left = False  # we answered or released: nothing more is written on this stream
        self._replied = asyncio.Event()  # set once our reply (answer or release) is written
        self._handed_over = False  # the downstream now answers for this attempt's progress
        self._handled, self._busy = 0, 0.0  # messages handled and time spent (metrics, once per stream)

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
        replica = str(attrs.get("upstream.address") or "unknown")
        attempt_id = self._attempt_id = new_attempt_id()
        self._admission = asyncio.get_running_loop().create_future()
        live.attempts[attempt_id] = self
        # Envoy's own number for this attempt: a gap before it is an attempt whose stream we never saw.
        envoy_attempt = m.attempt_count(attrs.get("upstream.request_attempt_count"))
        try:
            await live.feed(r.AttemptArrived(attempt_id, replica, envoy_attempt))
            admission = await self._admission
        except asyncio.CancelledError:
            # Torn down before its request was let go: the connection Envoy had picked died first (a pooled
            # one the replica had closed), or the client left (docs/envoy-facts.md).
            if self._admission.done() and isinstance(self._admission.result(), r.ForwardAttempt):
                live.feed_soon(r.ForAttempt(attempt_id, a.NeverSent()))
            else:
                live.feed_soon(r.ArrivalGone(attempt_id))
            raise
        if isinstance(admission, r.RefuseAttempt):
            await context.write(self._refusal(live, admission.error))
            return
        assert isinstance(admission, r.ForwardAttempt)
        await self._forward(context, live, replica, admission.model)

    async def _forward(
        self, context: grpc.aio.ServicerContext, live: Live, replica: str, fallback_model: str | None
    ) -> None:
        request, attempt_id = live.request, self._attempt_id
        attempt = request.attempt(attempt_id)
        assert attempt is not None
        telemetry = self._services.telemetry
        logs.bind(request_id=request.request_id, attempt_id=attempt_id)
        attempt_headers = rec.AttemptHeaders(
            request_id=request.request_id,
            attempt_id=attempt_id,
            attempt_lease=f"{attempt.lease.lease.id:x}" if attempt.lease.lease else "",
            traceparent=telemetry.traceparent(request, attempt.number),
        )

        async def replica_lost(cause: str) -> None:
            await live.feed(r.ForAttempt(attempt_id, a.LivenessLost(cause)))

        async def progress_gap() -> None:
            await live.feed(r.ForAttempt(attempt_id, a.LivenessLost("progress_gap")))

        unsubscribe = self._services.liveness.on_loss(replica, replica_lost)
        self.tracked = self._services.progress.track(attempt_id, progress_gap)
        sent = False
        try:
            headers = codec.to_headers(attempt_headers)
            if fallback_model is not None:
                # The rewriter placement, next in the chain, sends this attempt the body naming that model.
                headers.append((FALLBACK_MODEL_HEADER, fallback_model))
            # Sent from the moment the release is being written: a cancel during the write may come after
            # Envoy read it, and an attempt a replica may have seen is never journaled as one no replica saw.
            sent = True
            await context.write(m.request_headers_reply(m.header_mutation(headers)))
            await self._hold(context, live)
        except asyncio.CancelledError:
            # Envoy tore the attempt down: before our reply let the request go (its connection died), or after
            # (reset/refused, or the client left).
            lost = a.StreamReset(live.liveness_uncertain(attempt)) if sent else a.NeverSent()
            live.feed_soon(r.ForAttempt(attempt_id, lost))
            raise
        finally:
            unsubscribe()
            if not self._handed_over:
                # Kept a little longer: the next attempt's admission reads it (`Live.liveness_uncertain`).
                self._services.progress.untrack_later(self.tracked)
            self._services.telemetry.stream_handled("upstream", self._handled, self._busy)

    async def _hold(self, context: grpc.aio.ServicerContext, live: Live) -> None:
        assert self.tracked is not None
        attempt_id = self._attempt_id
        while not self._left:
            message = await context.read()
            if message is grpc.aio.EOF:
                attempt = live.request.attempt(attempt_id)
                assert attempt is not None
                await live.feed(r.ForAttempt(attempt_id, a.StreamReset(live.liveness_uncertain(attempt))))
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
                    end_of_stream=message.response_headers.end_of_stream,
                )
            elif which == "response_body":
                body = message.response_body
                self.tracked.received += len(body.body)
                event = a.ResponseBody(body.body, body.end_of_stream)
            else:
                continue
            # No further message is read until the replies this one causes are written (the held count).
            await live.feed(r.ForAttempt(attempt_id, event))
            self._handled += 1
            self._busy += time.perf_counter() - started
            if live.request.holds_stream(attempt_id):
                await self._replied.wait()  # its release (or answer) comes once the claim is settled

    # --- what the machine addresses to this stream -----------------------------------------------------

    async def deliver(self, decision: r.Decision) -> None:
        if isinstance(decision, r.ForwardAttempt | r.RefuseAttempt):
            if self._admission is not None and not self._admission.done():
                self._admission.set_result(decision)
        elif isinstance(decision, r.AnswerAttempt):
            assert self._live is not None
            attempt = self._live.request.attempt(decision.attempt_id)
            verdict = decision.verdict
            if attempt is not None and attempt.failure is not None:
                log.info(
                    "attempt %d on %s failed before any content (%s): %s",
                    attempt.number,
                    attempt.replica,
                    attempt.failure.value,
                    "retrying" if isinstance(verdict, a.TriggerRetry) else f"no retry ({verdict.code})",
                    extra={"attempt_id": decision.attempt_id},  # this may run in another stream's task
                )
            held = [m.RESPONSE_BODY_CONTINUE] * decision.held_chunks
            await self._write(_answer(self._live.request, verdict), *held)
        else:
            assert isinstance(decision, r.ReleaseAttempt), decision
            # Leave the path after these: Envoy forwards the rest without us.
            await self._write(
                m.response_headers_reply(), *([m.RESPONSE_BODY_CONTINUE] * decision.held_chunks)
            )

    def hand_over(self) -> None:
        self._handed_over = True

    async def _write(self, *replies: m.Reply) -> None:
        assert self._context is not None
        async with self._write_lock:
            if self._left:
                return
            self._left = True
            # A decision made after Envoy tore the attempt down: no one is left to answer.
            try:
                with contextlib.suppress(grpc.aio.UsageError, asyncio.InvalidStateError):
                    for reply in replies:
                        await self._context.write(reply)
            finally:
                self._replied.set()

    def _refusal(self, live: Live, error: r.ClientError) -> m.ProcessingResponse:
        if isinstance(error, r.DuplicateRun):
            return m.immediate(409, b"")  # the downstream answers the client with the 409's body
        return _answer(live.request, error)


def _answer(request: r.LogicalRequest, verdict: a.TriggerRetry | a.FailRequest) -> m.ProcessingResponse:
    if isinstance(verdict, a.TriggerRetry):
        return _RETRY
    return m.immediate(
        verdict.status,
        views.error_body(request, verdict),
        extra_headers=views.error_headers(request, verdict),
    )
