"""The replica-side ext_proc servicer (replica mode of the agent): forward a chunk only under a valid lease.

Runs in the agent process, behind the replica's own Envoy (`envoy/replica.yaml`): DOWNSTREAM placement,
response body FULL_DUPLEX_STREAMED, so every chunk the engine writes goes on only when we send it back.

* No ``x-attempt-id`` / ``x-attempt-lease`` (health probes, ``/v1/models``, a gateway in degraded mode):
  pass through — every chunk is sent back unchanged.
* With them: the lease's remaining TTL is checked in etcd before the request goes to the engine (refused
  with 503 if it is already gone or etcd cannot tell), then every TTL/3 in the background
  (`replica_fence.AttemptGuard`). Each chunk is checked against the local state only. Once the lease is
  revoked or past its local deadline — found by a chunk or by the guard's timer while no chunk arrives (a
  frozen engine) — nothing more is forwarded: an unsolicited end_of_stream ends the gateway's side and
  makes Envoy reset the engine request (docs/envoy-facts.md#ending-a-client-stream), and the cancel ack
  is written to etcd.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time

import grpc

from router_sidecar.coordination.replica_fence import (
    DEFAULT_SAFETY_MARGIN,
    AttemptGuard,
    CancelAcks,
    parse_lease_header,
)
from router_sidecar.coordination.store import EtcdStore, Lease, StoreUnavailable, keys
from router_sidecar.extproc import messages as m
from router_sidecar.records import codec
from router_sidecar.records import records_pb2 as rec

log = logging.getLogger(__name__)

# The first check runs while Envoy holds the request headers (its message_timeout is 5 s).
FIRST_CHECK_TIMEOUT = 2.0
PROGRESS_INTERVAL_SECONDS = 1.0  # how often an attempt's forwarded byte count goes to etcd (if it changed)


def _refusal(code: str, message: str) -> m.ProcessingResponse:
    body = json.dumps({"error": {"code": code, "message": message, "type": "replica_fence"}}).encode()
    return m.immediate(503, body)


class ReplicaFenceServicer:
    def __init__(self, store: EtcdStore, *, margin: float = DEFAULT_SAFETY_MARGIN) -> None:
        self.store = store
        self.margin = margin
        self.acks = CancelAcks(store)
        self.fenced: list[tuple[str, str, float]] = []  # (attempt_id, reason, monotonic time): for tests/logs

    async def Process(self, request_iterator: object, context: grpc.aio.ServicerContext) -> None:
        await FenceStream(self, context).run()


class FenceStream:
    def __init__(self, owner: ReplicaFenceServicer, context: grpc.aio.ServicerContext) -> None:
        self._owner = owner
        self._context = context
        self._lock = asyncio.Lock()
        self._guard: AttemptGuard | None = None
        self._headers_seen = False  # response headers answered: an end now is a streamed end_of_stream
        self._ended = False  # we ended the stream (or the engine's response ended): write nothing more
        self._forwarded = 0  # body bytes sent towards the gateway (reported as the attempt's progress)
        self._reported = 0

    async def run(self) -> None:
        context = self._context
        first = await context.read()
        if first is grpc.aio.EOF:
            return
        if first.WhichOneof("request") != "request_headers":
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "expected request_headers first")
            return
        headers = m.header_map(first.request_headers)
        sent = codec.from_headers(rec.AttemptHeaders, headers)
        attempt_id = sent.attempt_id
        lease_id = parse_lease_header(sent.attempt_lease)
        if attempt_id and lease_id is not None:
            guard = AttemptGuard(self._owner.store, attempt_id, lease_id, margin=self._owner.margin)
            if not await self._admit(guard):
                return
            self._guard = guard
        elif attempt_id and sent.attempt_lease:
            log.warning("attempt %s: unreadable x-attempt-lease %r", attempt_id, sent.attempt_lease)
        await context.write(m.request_headers_reply())
        loop = asyncio.get_running_loop()
        helpers = (
            [loop.create_task(self._watch(self._guard)), loop.create_task(self._report_progress(self._guard))]
            if self._guard
            else []
        )
        try:
            await self._forward()
        finally:
            if self._guard is not None:
                # Detached: Envoy may cancel this handler as soon as the stream is over.
                asyncio.get_running_loop().create_task(self._close_attempt(self._guard))
            for helper in helpers:
                helper.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await helper
            if self._guard is not None:
                self._guard.close()

    async def _admit(self, guard: AttemptGuard) -> bool:
        """The lease must be known valid before the engine sees the request."""
        answered = await guard.check(timeout=FIRST_CHECK_TIMEOUT)
        if answered and guard.valid():
            return True
        if not answered:
            reply = _refusal("attempt_lease_unverifiable", "etcd did not answer the attempt's lease check")
            log.warning("attempt %s refused: lease %x cannot be checked", guard.attempt_id, guard.lease_id)
        else:
            reply = _refusal("attempt_fenced", f"the attempt's lease is no longer valid ({guard.reason})")
            log.info("attempt %s refused: %s", guard.attempt_id, guard.reason)
            self._acknowledge(guard)
        self._ended = True
        await self._context.write(reply)
        return False

    async def _forward(self) -> None:
        context = self._context
        while True:
            message = await context.read()
            if message is grpc.aio.EOF:
                return
            which = message.WhichOneof("request")
            async with self._lock:
                if self._ended:
                    continue  # we ended it: whatever the engine still sends is dropped
                if which == "response_headers":
                    self._headers_seen = True
                    await context.write(m.response_headers_reply())
                elif which == "response_body":
                    body = message.response_body
                    if self._guard is not None and not self._guard.valid():
                        await self._end(self._guard)
                        continue
                    await context.write(m.streamed_body(body.body, body.end_of_stream))
                    self._forwarded += len(body.body)
                    if body.end_of_stream:
                        self._ended = True
                elif which == "response_trailers":
                    await context.write(m.RESPONSE_TRAILERS_CONTINUE)
                    self._ended = True
                elif which == "request_headers":  # never twice; answer rather than stall Envoy
                    await context.write(m.request_headers_reply())

    async def _close_attempt(self, guard: AttemptGuard) -> None:
        """The response is over on this side. Report the last progress (else the gateway never learns of
        bytes it did not get: the reporter runs once a second), and, unless a fence already acknowledged
        it, write the cancel ack: the attempt can publish nothing more, which is what a later fence asks."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._put_progress(guard), 1.0)
        if not guard.stopped.is_set():
            self._owner.acks.write(guard.attempt_id, "finished")

    async def _report_progress(self, guard: AttemptGuard) -> None:
        """Tell the gateway, at a modest rate, how much of this attempt left the replica: if it never
        arrives there, the gateway learns that the path is lost although this replica is alive."""
        while not guard.stopped.is_set():
            await asyncio.sleep(PROGRESS_INTERVAL_SECONDS)
            await self._put_progress(guard)

    async def _put_progress(self, guard: AttemptGuard) -> None:
        if self._forwarded == self._reported:
            return
        forwarded = self._forwarded
        record = codec.dumps(rec.AttemptProgress(bytes=forwarded, at=round(time.time(), 3)))
        with contextlib.suppress(StoreUnavailable):  # cut off from etcd: the local deadline stops it anyway
            await self._owner.store.put(keys.progress(guard.attempt_id), record, Lease(guard.lease_id, 0))
            self._reported = forwarded

    async def _watch(self, guard: AttemptGuard) -> None:
        await guard.watch()
        # The guard no longer passes a chunk (`_forward` checks it first), so the attempt cannot publish from
        # here on: acknowledge now. Ending the stream may wait on Envoy (a downstream that takes nothing
        # more, e.g. a lost path), and the ack must not wait with it.
        self._acknowledge(guard)
        async with self._lock:
            if not self._ended:
                await self._end(guard, acknowledged=True)

    async def _end(self, guard: AttemptGuard, *, acknowledged: bool = False) -> None:
        """Stop publishing (lock held): end the gateway's side; Envoy resets the engine request."""
        self._ended = True
        reason = guard.reason or "local_deadline"
        log.warning("attempt %s fenced on the replica (%s): ending its stream", guard.attempt_id, reason)
        if not acknowledged:
            self._acknowledge(guard)
        if self._headers_seen:
            await self._context.write(m.streamed_body(b"", True))
        else:
            # Nothing went out yet, and Envoy takes no unsolicited answer while it waits for the engine's
            # headers: end the ext_proc stream with an error instead. The front (fail closed) then answers
            # the gateway with an error status, which is just as final there, and resets the engine request.
            with contextlib.suppress(grpc.aio.AbortError):
                await self._context.abort(
                    grpc.StatusCode.ABORTED, f"attempt {guard.attempt_id} fenced ({reason})"
                )

    def _acknowledge(self, guard: AttemptGuard) -> None:
        reason = guard.reason or "local_deadline"
        self._owner.fenced.append((guard.attempt_id, reason, time.monotonic()))
        self._owner.acks.write(guard.attempt_id, reason)
