"""The readiness probe asks etcd at most once per interval, however many probes come at once."""

from __future__ import annotations

import asyncio

from router_sidecar.coordination.readiness import Readiness
from router_sidecar.coordination.store import MemoryStore, StoreUnavailable


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
        assert "connection refused" in (await fresh.check() or "")

    asyncio.run(asyncio.wait_for(go(), 5))


def test_a_check_that_hangs_is_an_answer_too() -> None:
    class Hanging(CountingStore):
        async def check(self) -> None:
            await asyncio.sleep(10)

    async def go() -> None:
        problem = await Readiness(Hanging(), timeout=0.05, interval=0).check()
        assert problem is not None and "0.05" in problem

    asyncio.run(asyncio.wait_for(go(), 5))
