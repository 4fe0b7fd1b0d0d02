"""Replica-side fence: an attempt may publish only while its etcd lease is valid, on the replica's clock.

The gateway sends every attempt to the replica with ``x-attempt-id`` and ``x-attempt-lease`` (the lease id,
hex). In replica mode (``router-sidecar replica --front HOST:PORT``) the agent fronts its engine with its
own Envoy; a DOWNSTREAM ext_proc filter (FULL_DUPLEX_STREAMED response body) hands every response chunk to
`router_sidecar.extproc.replica_side`, which forwards it only while the attempt's lease is valid.

Validity is local (no etcd round trip per chunk): the lease's remaining TTL is asked from etcd
(LeaseTimeToLive) when the request arrives and every TTL/3 after that, and each answer sets a local
deadline = time the question was *sent* + remaining TTL − safety margin. A replica cut off from etcd thus
stops on its own clock before the lease could have expired on etcd's, which is what lets the gateway treat
the lease's expiry as a fence. A revoked lease (remaining TTL ≤ 0, lease not found) stops the attempt at
the next check. Stopping means: no further byte is forwarded, the client side of the front Envoy is ended
(which resets the engine request) and the cancel ack ``keys.cancel_ack(attempt_id)`` is written, so that
the gateway's fence completes without waiting for the lease's expiry.

This module holds the pure logic (`LeaseValidity`), the lease checks, the cancel-ack writer and the front
Envoy (render, validate, start). Nothing here decides about retries: that is the gateway's business.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from router_sidecar.coordination.store import RetentionLeases, Store, StoreUnavailable, keys
from router_sidecar.records import codec
from router_sidecar.records import records_pb2 as rec

log = logging.getLogger(__name__)

DEFAULT_SAFETY_MARGIN = 0.5
# Never wait longer than this between checks, whatever the TTL; never shorter than the floor.
MIN_CHECK_INTERVAL = 0.05
ACK_RETRY_SECONDS = 60.0
ACK_RETENTION_SECONDS = 600.0

REASON_REVOKED = "lease_revoked"
REASON_DEADLINE = "local_deadline"


@dataclass(slots=True)
class LeaseValidity:
    """What the replica believes about one attempt lease. Pure: every method takes `now` (monotonic).

    `deadline` is None until the first successful check; an attempt is never valid before that.
    """

    margin: float = DEFAULT_SAFETY_MARGIN
    deadline: float | None = None
    granted_ttl: float | None = None
    revoked: bool = False
    last_check_sent: float | None = None

    def on_check(self, sent_at: float, remaining_ttl: float, granted_ttl: float | None = None) -> None:
        """An answer from etcd to a question sent at `sent_at` (monotonic): `remaining_ttl` seconds left."""
        if granted_ttl is not None and granted_ttl > 0:
            self.granted_ttl = granted_ttl
        self.last_check_sent = sent_at
        if remaining_ttl <= 0:
            self.revoked = True
            return
        candidate = sent_at + remaining_ttl - self.margin
        # Answers can arrive out of order (a slow one after a fast one): the deadline only moves forward
        # with a newer question, never because an older answer came late.
        if self.deadline is None or candidate > self.deadline:
            self.deadline = candidate

    def reason(self, now: float) -> str | None:
        """None while the attempt may publish; else why not (`lease_revoked` / `local_deadline`)."""
        if self.revoked:
            return REASON_REVOKED
        if self.deadline is None or now >= self.deadline:
            return REASON_DEADLINE
        return None

    def valid(self, now: float) -> bool:
        return self.reason(now) is None

    def next_check_at(self, now: float) -> float:
        """When to ask etcd again: every TTL/3, and early enough to renew the deadline before it passes
        (etcd reports whole seconds, so a check can see much less than the gateway's refresh keeps)."""
        interval = (self.granted_ttl or 3.0) / 3
        base = self.last_check_sent if self.last_check_sent is not None else now
        at = base + interval
        if self.deadline is not None:
            at = min(at, now + max(MIN_CHECK_INTERVAL, (self.deadline - now) / 2))
        return max(at, now + MIN_CHECK_INTERVAL)


def parse_lease_header(value: str | None) -> int | None:
    """`x-attempt-lease` (lease id in hex). Empty/absent: the gateway had no lease (degraded mode)."""
    if not value:
        return None
    try:
        lease_id = int(value.strip(), 16)
    except ValueError:
        return None
    return lease_id if lease_id > 0 else None


class CancelAcks:
    """Writes `keys.cancel_ack(attempt_id)`; if etcd does not answer, retries in the background (≤ 60 s).

    Acks are kept `ACK_RETENTION_SECONDS` (bucketed retention leases), not forever."""

    def __init__(self, store: Store, *, retry_seconds: float = ACK_RETRY_SECONDS) -> None:
        self._store = store
        self._retry_seconds = retry_seconds
        self._retention = RetentionLeases(store, ACK_RETENTION_SECONDS)
        self._tasks: set[asyncio.Task[bool]] = set()

    def write(self, attempt_id: str, reason: str) -> asyncio.Task[bool]:
        record = rec.CancelAck(attempt_id=attempt_id, reason=reason, at=round(time.time(), 6))
        task = asyncio.get_running_loop().create_task(self._write(attempt_id, record))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _write(self, attempt_id: str, record: rec.CancelAck) -> bool:
        deadline = time.monotonic() + self._retry_seconds
        value = codec.dumps(record)
        delay = 0.05
        while True:
            try:
                lease = None
                with contextlib.suppress(StoreUnavailable):
                    lease = await self._retention.current()
                await self._store.put(keys.cancel_ack(attempt_id), value, lease)
                log.info("cancel ack %s written (%s)", attempt_id, record.reason)
                return True
            except StoreUnavailable as exc:
                if time.monotonic() + delay >= deadline:
                    log.error(
                        "cancel ack %s not written within %gs: %s", attempt_id, self._retry_seconds, exc
                    )
                    return False
                await asyncio.sleep(delay)
                delay = min(1.0, delay * 2)

    async def drain(self, timeout: float) -> None:
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=timeout)


class AttemptGuard:
    """The fence of one attempt on the replica: checks etcd in the background, answers `valid()` locally,
    and sets `stopped` (with `reason`) once the attempt lost its right to publish — also when no chunk
    arrives at all (frozen engine)."""

    def __init__(
        self,
        store: Store,
        attempt_id: str,
        lease_id: int,
        *,
        margin: float = DEFAULT_SAFETY_MARGIN,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.store = store
        self.attempt_id = attempt_id
        self.lease_id = lease_id
        self.validity = LeaseValidity(margin=margin)
        self._clock = clock
        self.stopped = asyncio.Event()
        self.reason: str | None = None
        self._checking: asyncio.Task[bool] | None = None
        self._next_check = clock()
        self._wake = asyncio.Event()

    def valid(self) -> bool:
        if self.stopped.is_set():
            return False
        reason = self.validity.reason(self._clock())
        if reason is not None:
            self._stop(reason)
            return False
        return True

    def _stop(self, reason: str) -> None:
        if not self.stopped.is_set():
            self.reason = reason
            self.stopped.set()

    async def check(self, timeout: float | None = None) -> bool:
        """Ask etcd once; True if it answered. Updates the validity (and stops on revocation)."""
        sent_at = self._clock()
        try:
            coro = self.store.lease_time_to_live(self.lease_id)
            remaining, granted = await (asyncio.wait_for(coro, timeout) if timeout else coro)
        except (StoreUnavailable, TimeoutError) as exc:
            log.warning("attempt %s: lease %x not checked: %s", self.attempt_id, self.lease_id, exc)
            return False
        self.validity.on_check(sent_at, remaining, granted)
        if self.validity.revoked:
            self._stop(REASON_REVOKED)
        self._next_check = self.validity.next_check_at(self._clock())
        return True

    async def watch(self) -> str:
        """Runs until the attempt must stop; returns why. Checks etcd on schedule; the deadline timer is
        independent of the checks, so an etcd that hangs cannot keep the attempt alive."""
        loop = asyncio.get_running_loop()
        while not self.stopped.is_set():
            now = self._clock()
            reason = self.validity.reason(now)
            if reason is not None:
                self._stop(reason)
                break
            if self._checking is None and now >= self._next_check:
                self._checking = loop.create_task(self.check())
                self._checking.add_done_callback(self._check_done)
            wake = self.validity.deadline if self.validity.deadline is not None else now
            if self._checking is None:
                wake = min(wake, self._next_check)
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), max(0.0, wake - self._clock()))
        return self.reason or REASON_DEADLINE

    def _check_done(self, task: asyncio.Task[bool]) -> None:
        self._checking = None
        self._next_check = self.validity.next_check_at(self._clock())
        self._wake.set()
        if not task.cancelled() and task.exception() is not None:
            log.error("attempt %s: lease check failed: %r", self.attempt_id, task.exception())

    def close(self) -> None:
        if self._checking is not None:
            self._checking.cancel()
