"""Attempt leases: an attempt's right to publish is its etcd lease.

Each attempt gets a lease when it starts; the gateway keeps it alive (one loop for all attempts) while the
attempt is legitimate. To fence an attempt the gateway revokes the lease and then waits until the old
attempt provably can no longer publish: either its replica side acknowledged the cancel (it writes
`/attempts/<id>/cancel_ack`), or the lease's expiry bound has passed — a replica side cut off from etcd
stops on its own clock before the lease it last saw would expire. Only then may another attempt start.

Whether the attempt may still publish is checked from local state (`publishable`), never with an etcd
round trip per chunk.

Granting a lease is an etcd round trip (a raft write) on the way to the replica. So a few leases are granted
ahead (policy `leases.attempt_pool_size`) and kept alive like the attempts' own: an attempt takes one and
starts at once, and the pool is refilled in the background. A pooled lease belongs to no attempt until
taken (its id reaches a replica only in the attempt's headers), is used once, is given to an attempt only
if refreshed in the keep-alive's last round, and is refreshed again the moment it is taken: its remaining
TTL is then that of a lease granted now. (With TTLs under 3 s there is no pool: etcd reports remaining
TTLs in whole seconds, and a replica side reads "0" as revoked.)
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import enum
import logging
import time
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any

from router_sidecar.coordination.store import Lease, Store, StoreUnavailable, keys

log = logging.getLogger(__name__)

# Slack added to the lease's expiry bound: clock-rate differences and the replica side's check interval
# are covered by its own safety margin; this covers our side's measurement of "last refresh".
EXPIRY_SLACK_SECONDS = 0.25
# Leases the keep-alive refreshes at once (one round trip each: a slow one must not hold the rest up).
REFRESH_CONCURRENCY = 32
# The shortest TTL that gets a pool (see the module docstring).
POOL_MIN_TTL_SECONDS = 3


class FenceProof(enum.StrEnum):
    CANCEL_ACK = "cancel_ack"  # the replica side confirmed it stopped publishing
    LEASE_EXPIRY = "lease_expiry"  # the lease's expiry bound passed: any holder has stopped on its own clock
    CONNECTION_CLOSED = "connection_closed"  # the stream's connection is gone: nothing can arrive over it


@dataclass(slots=True)
class AttemptLease:
    attempt_id: str
    lease: Lease | None  # None: etcd was unreachable when the attempt started; it cannot be fenced by lease
    granted_at: float  # wall clock, for the journal
    refreshed_at: float  # monotonic time of the last successful grant/refresh
    ttl_seconds: int
    stopped_at: float | None = None  # wall clock: we stopped honouring it (nothing of it is released since)
    revoked_at: float | None = None  # wall clock: etcd confirmed the revocation (or it expired)
    fenced: asyncio.Event = field(default_factory=asyncio.Event)  # proven: the attempt can no longer publish

    @property
    def expiry_bound(self) -> float:
        """Monotonic time after which no holder of this lease can still believe it valid."""
        return self.refreshed_at + self.ttl_seconds + EXPIRY_SLACK_SECONDS

    def publishable(self, now: float | None = None) -> bool:
        """The local check before releasing bytes: not revoked, and not past its last known validity."""
        if self.stopped_at is not None:
            return False
        if self.lease is None:
            return True  # degraded mode (no etcd at start): nothing to check against
        return (now if now is not None else time.monotonic()) < self.refreshed_at + self.ttl_seconds

    def as_record(self) -> dict[str, object]:
        return {
            "lease_id": f"{self.lease.id:x}" if self.lease else None,
            "ttl_seconds": self.ttl_seconds,
            "granted_at": round(self.granted_at, 6),
            "stopped_at": round(self.stopped_at, 6) if self.stopped_at else None,
            "revoked_at": round(self.revoked_at, 6) if self.revoked_at else None,
        }


@dataclass(slots=True)
class _Pooled:
    """A lease granted ahead, not yet any attempt's."""

    lease: Lease
    refreshed_at: float  # monotonic time of its grant or last refresh


class AttemptLeases:
    def __init__(self, store: Store, ttl_seconds: int, *, pool_size: int = 0) -> None:
        self._store = store
        self.ttl_seconds = ttl_seconds
        self._active: dict[str, AttemptLease] = {}
        self._keepalive: asyncio.Task[None] | None = None
        self._pool_size = pool_size if ttl_seconds >= POOL_MIN_TTL_SECONDS else 0
        self._pool: collections.deque[_Pooled] = collections.deque()
        self._refill: asyncio.Task[None] | None = None
        self._started = False

    def start(self) -> None:
        self._started = True
        self._keepalive = asyncio.get_running_loop().create_task(self._keep_alive_loop())
        self._refill_pool()

    async def stop(self) -> None:
        self._started = False
        for task in (self._keepalive, self._refill):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        pooled, self._pool = list(self._pool), collections.deque()
        with contextlib.suppress(StoreUnavailable, TimeoutError):  # else they expire on their own
            async with asyncio.timeout(2.0):
                await asyncio.gather(*(self._store.revoke_lease(p.lease) for p in pooled))

    @property
    def pooled(self) -> int:
        return len(self._pool)

    @property
    def _refresh_interval(self) -> float:
        return max(0.2, self.ttl_seconds / 3)

    def _take_pooled(self) -> _Pooled | None:
        """A pooled lease refreshed in the keep-alive's last round, with at least 1.5 s of TTL left; older
        ones are dropped (their refresh did not get through)."""
        fresh_since = time.monotonic() - min(self._refresh_interval, self.ttl_seconds - 1.5)
        while self._pool:
            pooled = self._pool.popleft()
            if pooled.refreshed_at >= fresh_since:
                return pooled
            asyncio.get_running_loop().create_task(self._revoke_quietly(pooled.lease))
        return None

    def _refill_pool(self) -> None:
        if self._started and self._pool_size and (self._refill is None or self._refill.done()):
            self._refill = asyncio.get_running_loop().create_task(self._fill())

    async def _fill(self) -> None:
        missing = self._pool_size - len(self._pool)
        if missing <= 0:
            return
        granted = await asyncio.gather(
            *(self._store.grant_lease(self.ttl_seconds) for _ in range(missing)), return_exceptions=True
        )
        for lease in granted:
            if isinstance(lease, Lease):
                self._pool.append(_Pooled(lease, time.monotonic()))
            elif not isinstance(lease, StoreUnavailable):
                log.error("attempt lease pool: unexpected grant failure: %r", lease)
        # Refused grants (etcd away) are tried again with the next attempt's grant.

    async def grant(self, *, attempt_id: str, request_id: str, replica: str) -> AttemptLease:
        """A lease for a new attempt (its id travels to the replica side in `x-attempt-lease`; the journal
        records which attempt holds it: no key of its own, one etcd write less per attempt). From the pool
        when it has one (no round trip), else granted now."""
        pooled = self._take_pooled()
        self._refill_pool()
        if pooled is not None:
            held = AttemptLease(attempt_id, pooled.lease, time.time(), pooled.refreshed_at, self.ttl_seconds)
            self._active[attempt_id] = held
            # Its TTL restarts now, not at the keep-alive's next round.
            asyncio.get_running_loop().create_task(self._refresh(held))
            return held
        lease: Lease | None = None
        try:
            lease = await self._store.grant_lease(self.ttl_seconds)
        except StoreUnavailable as exc:
            log.error("attempt %s runs without a lease (cannot be fenced by etcd): %s", attempt_id, exc)
            lease = None
        except asyncio.CancelledError:
            # The attempt's stream was torn down meanwhile: no attempt will ever hold this lease.
            if lease is not None:
                asyncio.get_running_loop().create_task(self._revoke_quietly(lease))
            raise
        held = AttemptLease(attempt_id, lease, time.time(), time.monotonic(), self.ttl_seconds)
        self._active[attempt_id] = held
        return held

    async def _keep_pool_alive(self) -> None:
        async def refresh(pooled: _Pooled) -> None:
            try:
                remaining = await self._store.refresh_lease(pooled.lease)
            except StoreUnavailable:
                return  # too old by the time it is taken: dropped then
            if remaining > 0:
                pooled.refreshed_at = time.monotonic()
            else:
                with contextlib.suppress(ValueError):
                    self._pool.remove(pooled)

        await _gather_bounded([refresh(pooled) for pooled in list(self._pool)])
        self._refill_pool()

    async def _revoke_quietly(self, lease: Lease) -> None:
        with contextlib.suppress(StoreUnavailable):
            await self._store.revoke_lease(lease)

    def stop_honouring(self, held: AttemptLease) -> None:
        """Stop honouring the lease at once (no etcd call): nothing of this attempt is released from now."""
        self._active.pop(held.attempt_id, None)
        if held.stopped_at is None:
            held.stopped_at = time.time()

    async def revoke(self, held: AttemptLease) -> None:
        """Revoke in etcd (idempotent). If etcd cannot be reached the lease is no longer refreshed and
        expires on etcd's clock instead; `revoked_at` then stays unset until proven by `fence`."""
        self.stop_honouring(held)
        if held.revoked_at is not None:
            return
        if held.lease is None:
            held.revoked_at = time.time()
            return
        try:
            await self._store.revoke_lease(held.lease)
        except StoreUnavailable as exc:
            log.warning("attempt lease %s not revoked (%s): it will expire", held.attempt_id, exc)
            return
        held.revoked_at = held.revoked_at or time.time()

    async def release(self, held: AttemptLease, proof: FenceProof | None = None) -> None:
        """The attempt is over (finished, or its connection is gone): revoke; `proof` marks it fenced.

        A revocation etcd did not confirm (unreachable) is proven by the lease's expiry instead: until then a
        replica side may still take the lease for valid, so no other attempt's lease is granted before."""
        await self.revoke(held)
        if proof is None:
            return
        if held.revoked_at is None and held.lease is not None:
            await asyncio.sleep(max(0.0, held.expiry_bound - time.monotonic()))
            held.revoked_at = time.time()  # expired on etcd's clock
        held.fenced.set()

    async def fence(self, held: AttemptLease, *, accept_cancel_ack: bool = True) -> FenceProof | None:
        """Revoke, then wait for the cancel ack (policy `wait_for: cancel_ack_or_lease_expiry`) or the
        expiry bound (`lease_expiry`: always the whole TTL). None: cannot be proven (no lease)."""
        if held.lease is None:
            self.stop_honouring(held)
            return None
        await self.revoke(held)
        while time.monotonic() < held.expiry_bound:
            try:
                if accept_cancel_ack and await self._store.get(keys.cancel_ack(held.attempt_id)) is not None:
                    held.fenced.set()
                    return FenceProof.CANCEL_ACK
            except StoreUnavailable:
                pass
            await asyncio.sleep(min(0.05, max(0.0, held.expiry_bound - time.monotonic())))
        held.revoked_at = held.revoked_at or time.time()  # expired, if the revoke never got through
        held.fenced.set()
        return FenceProof.LEASE_EXPIRY

    async def _keep_alive_loop(self) -> None:
        while True:
            await asyncio.sleep(self._refresh_interval)
            # The attempts' own leases first, then the pool's.
            await _gather_bounded([self._refresh(held) for held in list(self._active.values())])
            await self._keep_pool_alive()

    async def _refresh(self, held: AttemptLease) -> None:
        if held.lease is None or held.stopped_at is not None:
            return
        try:
            remaining = await self._store.refresh_lease(held.lease)
        except StoreUnavailable as exc:
            log.warning("attempt lease %s not refreshed: %s", held.attempt_id, exc)
            return
        if remaining > 0:
            held.refreshed_at = max(held.refreshed_at, time.monotonic())
        else:  # revoked or expired server-side: the attempt lost its right to publish
            held.stopped_at = held.stopped_at or time.time()


async def _gather_bounded(calls: list[Coroutine[Any, Any, None]]) -> None:
    """Run the calls, at most REFRESH_CONCURRENCY at a time."""
    gate = asyncio.Semaphore(REFRESH_CONCURRENCY)

    async def bounded(call: Coroutine[Any, Any, None]) -> None:
        async with gate:
            await call

    await asyncio.gather(*(bounded(call) for call in calls))
