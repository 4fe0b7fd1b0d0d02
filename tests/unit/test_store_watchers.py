"""The logic that watches the store, on `MemoryStore` (no etcd): the replica registry and the liveness it
feeds, the closing of a lost gateway instance's records, progress reports, the replica side's lease check.
Each is shown to act on a change it is given, and on a snapshot that stands in for changes it was not
given (what a compaction of etcd's history leaves a watcher that had not caught up)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from router_sidecar.coordination.liveness import HEARTBEAT_LAPSED, Liveness, LivenessMonitor
from router_sidecar.coordination.owners import Ownership
from router_sidecar.coordination.progress import ProgressMonitor
from router_sidecar.coordination.registry_store import Heartbeat, Replica, ReplicaRegistry
from router_sidecar.coordination.replica_fence import REASON_REVOKED, AttemptGuard
from router_sidecar.coordination.store import Lease, MemoryStore, keys
from router_sidecar.core.fingerprint import EngineInfo, Fingerprint
from router_sidecar.records import codec
from router_sidecar.records import records_pb2 as rec

T = TypeVar("T")
ADDRESS = "10.0.0.1:8000"


def run(scenario: Callable[[], Awaitable[T]]) -> T:
    return asyncio.run(asyncio.wait_for(scenario(), 10))


async def until(condition: Callable[[], bool], what: str, seconds: float = 5.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.005)


def replica(address: str = ADDRESS) -> Replica:
    fingerprint = Fingerprint(model_id="tiny")
    return Replica(
        address=address,
        fingerprint=fingerprint,
        digest=fingerprint.digest(),
        engine_name="vllm",
        engine_version="0.32.0",
        engine=EngineInfo(root=None, max_model_len=None),
        registered_at=1.0,
        agent_id="agent",
    )


# -- the registry


def test_the_registry_watch_yields_each_join_and_leave() -> None:
    async def scenario() -> None:
        store = MemoryStore(shared=True)
        registry = ReplicaRegistry(store)
        seen: list[set[str]] = []
        async with contextlib.aclosing(registry.watch_replicas()) as registries:
            seen.append(set(await anext(registries)))
            lease = await store.grant_lease(10)
            await registry.put(replica(), lease)
            now = await anext(registries)
            seen.append(set(now))
            assert now[ADDRESS].lease_id == lease.id and now[ADDRESS].mod_revision == store.revision
            await registry.put(replica("10.0.0.2:8000"), lease)
            seen.append(set(await anext(registries)))
            await store.revoke_lease(lease)  # the agent's lease ended: both go (one change each)
            seen += [set(await anext(registries)), set(await anext(registries))]
        assert seen == [set(), {ADDRESS}, {ADDRESS, "10.0.0.2:8000"}, {"10.0.0.2:8000"}, set()]
        assert await registry.list_replicas() == {}

    run(scenario)


def test_the_registry_after_a_compaction_is_the_store_s() -> None:
    async def scenario() -> None:
        store = MemoryStore(shared=True)
        registry = ReplicaRegistry(store)
        lease = await store.grant_lease(10)
        await registry.put(replica(), lease)
        async with contextlib.aclosing(registry.watch_replicas()) as registries:
            assert set(await anext(registries)) == {ADDRESS}
            await registry.withdraw(ADDRESS, lease)
            await registry.put(replica("10.0.0.2:8000"), await store.grant_lease(10))
            store.compact()  # neither change reached the watcher
            assert set(await anext(registries)) == {"10.0.0.2:8000"}
        assert set(await registry.list_replicas()) == {"10.0.0.2:8000"}

    run(scenario)


def test_a_withdrawn_or_lapsed_replica_is_lost_to_liveness() -> None:
    async def scenario() -> None:
        store = MemoryStore(shared=True)
        registry = ReplicaRegistry(store)
        heartbeats = [Heartbeat(registry, a, ttl=10, interval=1) for a in (ADDRESS, "10.0.0.2:8000")]
        for heartbeat, address in zip(heartbeats, (ADDRESS, "10.0.0.2:8000"), strict=True):
            assert await heartbeat.publish(replica(address))
        liveness = LivenessMonitor(registry)
        liveness.start()
        try:
            await asyncio.wait_for(liveness.first_snapshot.wait(), 5)
            assert liveness.state(ADDRESS) == liveness.state("10.0.0.2:8000") == Liveness.HEALTHY
            causes: list[tuple[str, str]] = []

            def record(address: str) -> Callable[[str], Awaitable[None]]:
                async def lost(cause: str) -> None:
                    causes.append((address, cause))

                return lost

            for address in (ADDRESS, "10.0.0.2:8000"):
                liveness.on_loss(address, record(address))
            assert await heartbeats[0].withdraw()  # the engine stopped answering: withdrawn
            await until(lambda: len(causes) == 1, "the withdrawn replica to be lost")
            lease = heartbeats[1].lease
            assert lease is not None
            await store.revoke_lease(lease)  # its agent died: the lease ended with its key
            await until(lambda: len(causes) == 2, "the lapsed replica to be lost")
            assert causes == [(ADDRESS, HEARTBEAT_LAPSED), ("10.0.0.2:8000", HEARTBEAT_LAPSED)]
            assert liveness.state(ADDRESS) == liveness.state("10.0.0.2:8000") == Liveness.LOST
        finally:
            await liveness.stop()

    run(scenario)


# -- gateway instances


def _open_record(owner: str, request_id: str) -> dict[str, Any]:
    return {
        "request_id": request_id,
        "phase": "decode",
        "outcome": None,
        "first_delta_sent": True,
        "delivered_output_tokens": 3,
        "owner": owner,
        "attempts": [],
        "events": [{"t": 1.0, "event": "request_accepted"}],
    }


async def _instances(store: MemoryStore) -> tuple[Ownership, Ownership]:
    """Instance a (with one open record) and instance b (watching), both started. A long owner TTL: b's
    periodic sweep (every 6 TTLs) cannot be what closes a's records here."""
    a, b = (
        Ownership(store, instance=name, ttl_seconds=60, retention_seconds=3600)
        for name in ("gw-a~1", "gw-b~2")
    )
    await a.start()
    store.data[keys.request("t1", "r1")] = json.dumps(_open_record(a.instance, "r1")).encode()
    store.data[keys.in_flight(a.instance, "t1", "r1")] = b""
    await b.start()
    b.start_background()
    await until(lambda: store.watching(keys.OWNERS_PREFIX) == 1, "b to watch the owners")
    return a, b


def _phase(store: MemoryStore) -> str:
    return str(json.loads(store.data[keys.request("t1", "r1")])["phase"])


async def _lease_of(store: MemoryStore, key: str) -> Lease:
    return Lease((await store.read_prefix(key)).by_key()[key].lease_id, 0)


def test_an_instance_whose_owner_lease_ends_has_its_records_closed_by_another() -> None:
    async def scenario() -> None:
        store = MemoryStore(shared=True)
        a, b = await _instances(store)
        try:
            assert _phase(store) == "decode"
            await store.revoke_lease(await _lease_of(store, keys.owner(a.instance)))  # a's lease lapsed
            await until(lambda: _phase(store) == "interrupted", "b to close a's record")
            assert keys.in_flight(a.instance, "t1", "r1") not in store.data
        finally:
            await asyncio.gather(a.stop(), b.stop())

    run(scenario)


def test_an_instance_lost_while_the_watch_was_behind_is_found_in_the_snapshot() -> None:
    async def scenario() -> None:
        store = MemoryStore(shared=True)
        a, b = await _instances(store)
        try:
            await store.revoke_lease(await _lease_of(store, keys.owner(a.instance)))
            store.compact()  # the deletion of a's owner key never reaches b's watch as a change
            await until(lambda: _phase(store) == "interrupted", "b to close a's record")
        finally:
            await asyncio.gather(a.stop(), b.stop())

    run(scenario)


# -- progress reports and the replica side


def _progress(forwarded: int) -> bytes:
    return codec.dumps(rec.AttemptProgress(bytes=forwarded, at=1.0))


def test_progress_the_replica_reported_but_that_never_arrived_loses_the_path() -> None:
    async def scenario() -> None:
        store = MemoryStore(shared=True)
        monitor = ProgressMonitor(store, gap_seconds=0.3)
        lost = asyncio.Event()

        async def on_lost() -> None:
            lost.set()

        monitor.start()
        try:
            tracked = monitor.track("att-1", on_lost)
            untracked = monitor.track("att-2", on_lost)
            await until(lambda: store.watching(keys.ATTEMPTS_PREFIX) == 1, "the progress watch")
            tracked.received = untracked.received = 100
            lease = await store.grant_lease(10)
            await store.put(keys.progress("att-1"), _progress(100), lease)
            await store.put(keys.cancel_ack("att-1"), b"{}")  # another key under the attempt: ignored
            await until(lambda: tracked.reported == 100, "the report")
            await store.put(keys.progress("att-1"), _progress(250), lease)
            await store.put(keys.progress("att-2"), _progress(180), lease)
            store.compact()  # delivered as a snapshot: the reports in it count all the same
            await until(lambda: (tracked.reported, untracked.reported) == (250, 180), "the later reports")
            untracked.received = 180
            await asyncio.wait_for(lost.wait(), 5)  # att-1: 150 bytes reported and missing for 0.3 s
            assert tracked.fired and not untracked.fired
        finally:
            await monitor.stop()

    run(scenario)


def test_the_replica_side_stops_an_attempt_whose_lease_was_revoked() -> None:
    async def scenario() -> None:
        store = MemoryStore()
        lease = await store.grant_lease(30)
        guard = AttemptGuard(store, "att-1", lease.id)
        assert await guard.check() and guard.valid()
        await store.revoke_lease(lease)
        assert await guard.check() and not guard.valid()
        assert guard.reason == REASON_REVOKED

    run(scenario)
