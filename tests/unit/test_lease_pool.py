"""The attempt lease pool (policy `leases.attempt_pool_size`): an attempt starts without an etcd round trip.

Against the in-memory store, counting its grants: a started pool fills, an attempt takes a pooled lease and
the pool refills; a pooled lease whose refresh did not get through is dropped (revoked), not given out; with
etcd away the attempt falls back to its own grant (and runs without a lease, as before); stopping revokes
what is left; a pool of 0 grants per attempt.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import pytest

from router_sidecar.coordination.fencing import AttemptLeases
from router_sidecar.coordination.store import Lease, MemoryStore, StoreUnavailable


class CountingStore(MemoryStore):
    def __init__(self) -> None:
        super().__init__()
        self.grants = 0
        self.refreshed: list[int] = []
        self.available = True

    async def refresh_lease(self, lease: Lease) -> int:
        self.refreshed.append(lease.id)
        return await super().refresh_lease(lease)

    async def grant_lease(self, ttl_seconds: int) -> Lease:
        if not self.available:
            raise StoreUnavailable("etcd away")
        self.grants += 1
        return await super().grant_lease(ttl_seconds)


async def until(condition: Callable[[], bool], seconds: float = 5.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.005)


def run(body: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(asyncio.wait_for(body(), 20))


def test_an_attempt_takes_a_pooled_lease_and_the_pool_refills() -> None:
    async def go() -> None:
        store = CountingStore()
        leases = AttemptLeases(store, 10, pool_size=3)
        leases.start()
        await until(lambda: leases.pooled == 3)
        assert store.grants == 3
        pooled_ids = {p.lease.id for p in leases._pool}
        held = await leases.grant(attempt_id="a1", request_id="r1", replica="h:1")
        assert held.lease is not None and held.lease.id in pooled_ids  # no grant on the attempt's way
        assert held.publishable()
        await until(lambda: leases.pooled == 3)  # refilled in the background
        assert store.grants == 4
        await leases.stop()

    run(go)


def test_a_taken_lease_is_refreshed_at_once() -> None:
    async def go() -> None:
        store = CountingStore()
        leases = AttemptLeases(store, 30, pool_size=1)  # the keep-alive's own round is 10 s away
        leases.start()
        await until(lambda: leases.pooled == 1)
        held = await leases.grant(attempt_id="a1", request_id="r1", replica="h:1")
        assert held.lease is not None
        taken_at = held.refreshed_at
        await until(lambda: held.lease is not None and held.lease.id in store.refreshed)
        assert held.refreshed_at > taken_at  # its TTL restarted when it was taken
        await leases.stop()

    run(go)


def test_short_ttls_get_no_pool() -> None:
    # etcd reports a remaining TTL in whole seconds and the replica side reads 0 as revoked: a pooled lease
    # of a 2 s TTL could reach its replica with "0 s" left.
    async def go() -> None:
        store = CountingStore()
        leases = AttemptLeases(store, 2, pool_size=4)
        leases.start()
        await leases.grant(attempt_id="a1", request_id="r1", replica="h:1")
        assert store.grants == 1 and leases.pooled == 0
        await leases.stop()

    run(go)


def test_each_pooled_lease_goes_to_one_attempt_only() -> None:
    async def go() -> None:
        leases = AttemptLeases(CountingStore(), 10, pool_size=2)
        leases.start()
        await until(lambda: leases.pooled == 2)
        held = [await leases.grant(attempt_id=f"a{n}", request_id="r", replica="h:1") for n in range(6)]
        ids = [h.lease.id for h in held if h.lease is not None]
        assert len(ids) == 6 and len(set(ids)) == 6
        await leases.stop()

    run(go)


def test_a_pooled_lease_whose_refresh_did_not_get_through_is_dropped_not_given_out() -> None:
    async def go() -> None:
        store = CountingStore()
        leases = AttemptLeases(store, 3, pool_size=1)
        leases.start()
        await until(lambda: leases.pooled == 1)
        stale = leases._pool[0]
        stale.refreshed_at -= 10  # its keep-alive has not got through for 10 s
        held = await leases.grant(attempt_id="a1", request_id="r1", replica="h:1")
        assert held.lease is not None and held.lease.id != stale.lease.id
        await until(lambda: stale.lease.id in store.revoked)
        await leases.stop()

    run(go)


def test_with_etcd_away_the_attempt_falls_back_to_its_own_grant(caplog: pytest.LogCaptureFixture) -> None:
    async def go() -> None:
        store = CountingStore()
        store.available = False
        leases = AttemptLeases(store, 10, pool_size=2)
        leases.start()
        held = await leases.grant(attempt_id="a1", request_id="r1", replica="h:1")
        assert held.lease is None and leases.pooled == 0  # runs unfenced, as without a pool
        store.available = True
        held = await leases.grant(attempt_id="a2", request_id="r2", replica="h:1")
        assert held.lease is not None  # its own grant; the pool refills behind it
        await until(lambda: leases.pooled == 2)
        await leases.stop()

    run(go)
    assert "runs without a lease" in caplog.text


def test_stop_revokes_the_pooled_leases() -> None:
    async def go() -> None:
        store = CountingStore()
        leases = AttemptLeases(store, 10, pool_size=3)
        leases.start()
        await until(lambda: leases.pooled == 3)
        ids = {p.lease.id for p in leases._pool}
        await leases.stop()
        assert ids <= store.revoked and leases.pooled == 0

    run(go)


def test_without_a_pool_every_attempt_waits_for_its_own_grant() -> None:
    async def go() -> None:
        store = CountingStore()
        leases = AttemptLeases(store, 10, pool_size=0)
        leases.start()
        for n in range(3):
            await leases.grant(attempt_id=f"a{n}", request_id="r", replica="h:1")
        assert store.grants == 3 and leases.pooled == 0
        await leases.stop()

    run(go)
