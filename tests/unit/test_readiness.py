"""Readiness: etcd is asked at most once per interval, however many probes come at once; and the gateway is
not ready while it has no replica to send to (static ones count while their probe passes, discovered ones
while registered and not draining)."""

from __future__ import annotations

import asyncio

from router_sidecar.coordination.liveness import LivenessMonitor
from router_sidecar.coordination.readiness import (
    ETCD_UNREACHABLE,
    NO_REPLICA_AVAILABLE,
    NotReady,
    Readiness,
    ReplicaSet,
)
from router_sidecar.coordination.registry_store import Replica
from router_sidecar.coordination.store import MemoryStore, StoreUnavailable
from router_sidecar.core.fingerprint import EngineInfo, Fingerprint


class CountingStore(MemoryStore):
    def __init__(self) -> None:
        super().__init__()
        self.checks = 0
        self.down = False

    async def check(self) -> None:
        self.checks += 1
        await asyncio.sleep(0.01)
        if self.down:
            raise StoreUnavailable("etcd at x: connection refused")


def test_probes_share_one_check_per_interval() -> None:
    async def go() -> None:
        store = CountingStore()
        readiness = Readiness(store, timeout=0.5, interval=60)
        answers = await asyncio.gather(*(readiness.check() for _ in range(50)))
        assert answers == [None] * 50 and store.checks == 1
        store.down = True
        assert await readiness.check() is None and store.checks == 1  # within the interval: the same answer
        fresh = Readiness(store, timeout=0.5, interval=0)
        assert await fresh.check() == NotReady(
            ETCD_UNREACHABLE, "etcd does not answer (etcd at x: connection refused)"
        )

    asyncio.run(asyncio.wait_for(go(), 5))


def test_a_check_that_hangs_is_an_answer_too() -> None:
    class Hanging(CountingStore):
        async def check(self) -> None:
            await asyncio.sleep(10)

    async def go() -> None:
        problem = await Readiness(Hanging(), timeout=0.05, interval=0).check()
        assert problem == NotReady(ETCD_UNREACHABLE, "etcd does not answer (no answer within 0.05s)")

    asyncio.run(asyncio.wait_for(go(), 5))


def registration(address: str, *, draining: bool = False) -> Replica:
    fingerprint = Fingerprint(model_id="tiny")
    return Replica(
        address=address,
        fingerprint=fingerprint,
        digest=fingerprint.digest(),
        engine_name="vllm",
        engine_version="0.32.0",
        engine=EngineInfo(),
        registered_at=1.0,
        agent_id="agent",
        draining=draining,
    )


def test_discovered_replicas_count_while_registered_and_not_draining() -> None:
    async def go() -> None:
        liveness = LivenessMonitor(None)
        readiness = Readiness(MemoryStore(), ReplicaSet(liveness), interval=0)
        assert await readiness.check() == NotReady(
            NO_REPLICA_AVAILABLE,
            "no replica to send requests to: none is registered in etcd (run `router-sidecar replica` "
            "beside each engine)",
        )
        liveness.replicas = {"10.0.0.1:8000": registration("10.0.0.1:8000", draining=True)}
        assert await readiness.check() == NotReady(
            NO_REPLICA_AVAILABLE,
            "no replica to send requests to: every registered replica is draining (10.0.0.1:8000)",
        )
        liveness.replicas["10.0.0.2:8000"] = registration("10.0.0.2:8000")
        assert await readiness.check() is None
        assert readiness.replicas is not None and readiness.replicas.routable() == ["10.0.0.2:8000"]

    asyncio.run(go())


def test_static_replicas_count_until_their_probe_fails() -> None:
    async def go() -> None:
        a, b = "127.0.0.1:9001", "127.0.0.1:9002"
        liveness = LivenessMonitor(None, static=(a, b), probe_failures=2)
        readiness = Readiness(MemoryStore(), ReplicaSet(liveness, (a, b)), interval=0)
        assert await readiness.check() is None  # before any probe: presumed healthy
        liveness._static_failures[a] = 2
        assert await readiness.check() is None
        liveness._static_failures[b] = 2
        assert await readiness.check() == NotReady(
            NO_REPLICA_AVAILABLE,
            f"no replica to send requests to: every static replica fails its health probe ({a}, {b})",
        )
        liveness._static_failures[b] = 0  # a probe passed again
        assert await readiness.check() is None

    asyncio.run(go())


def test_etcd_is_named_before_the_replicas() -> None:
    async def go() -> None:
        store = CountingStore()
        store.down = True
        readiness = Readiness(store, ReplicaSet(LivenessMonitor(None)), interval=0)
        problem = await readiness.check()
        assert problem is not None and problem.code == ETCD_UNREACHABLE

    asyncio.run(go())
