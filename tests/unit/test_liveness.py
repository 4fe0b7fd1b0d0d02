"""The static replica probe's verdicts apply to the attempts that were there when the probe started: a
replica that was down and is back (Envoy's own health check may see it first) must not have a new attempt
fenced for what an earlier probe saw. Scripted probe results, no network."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from router_sidecar.coordination.liveness import (
    HEALTH_CHECK_FAILED,
    HEARTBEAT_LAPSED,
    Liveness,
    LivenessMonitor,
)

REPLICA = "127.0.0.1:9"


class ScriptedProbes:
    """Each probe of the monitor waits for the next scripted result; `started` counts probes begun."""

    def __init__(self, monitor: LivenessMonitor) -> None:
        self.results: asyncio.Queue[bool] = asyncio.Queue()
        self.started = 0
        self.done = 0

        async def probe(address: str) -> bool:
            self.started += 1
            result = await self.results.get()
            self.done += 1
            return result

        monitor._probe = probe  # type: ignore[method-assign]

    async def answer(self, *results: bool) -> None:
        """Answer the probe in flight, then the next ones, each once it has started."""
        for result in results:
            await until(lambda: self.started > self.done)
            before = self.done
            self.results.put_nowait(result)
            await until(lambda before=before: self.done > before)


async def until(condition: Callable[[], bool], timeout: float = 2.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await asyncio.sleep(0.001)


def watcher(seen: list[str]) -> Callable[[str], Awaitable[None]]:
    async def lost(cause: str) -> None:
        seen.append(cause)

    return lost


def monitor() -> tuple[LivenessMonitor, ScriptedProbes]:
    m = LivenessMonitor(None, static=(REPLICA,), probe_interval=0.001, probe_timeout=0.001, probe_failures=2)
    return m, ScriptedProbes(m)


def test_an_attempt_on_a_replica_that_is_back_is_not_fenced_by_an_earlier_probe() -> None:
    async def go() -> None:
        m, probes = monitor()
        m.start()
        try:
            await probes.answer(False, False)  # down: two failures in a row, lost
            await until(lambda: m.state(REPLICA) is Liveness.LOST)
            await until(lambda: probes.started > probes.done)  # the next probe is under way...
            seen: list[str] = []
            m.on_loss(REPLICA, watcher(seen))  # ...when an attempt starts (the replica is back)
            await asyncio.sleep(0.01)
            assert seen == []  # the failure count is stale: no verdict yet
            await probes.answer(False)  # that probe started before the attempt: not its verdict
            await asyncio.sleep(0.01)
            assert seen == []
            await probes.answer(True, False)  # back: the count starts over
            await asyncio.sleep(0.01)
            assert (seen, m.state(REPLICA)) == ([], Liveness.HEALTHY)
        finally:
            await m.stop()

    asyncio.run(go())


def test_an_attempt_on_a_replica_that_stays_down_is_fenced_by_the_next_failed_probe() -> None:
    async def go() -> None:
        m, probes = monitor()
        m.start()
        try:
            await probes.answer(False, False)
            await until(lambda: m.state(REPLICA) is Liveness.LOST)
            seen: list[str] = []
            await probes.answer(False)  # the probe under way, if any, predates the attempt
            await until(lambda: probes.started > probes.done)
            m.on_loss(REPLICA, watcher(seen))
            await probes.answer(False)  # started before the subscription: not yet
            await asyncio.sleep(0.01)
            assert seen == []
            await probes.answer(False)  # started after it, and failed: lost
            await until(lambda: seen == [HEALTH_CHECK_FAILED])
        finally:
            await m.stop()

    asyncio.run(go())


def test_a_healthy_replica_is_lost_after_the_failures_in_a_row() -> None:
    async def go() -> None:
        m, probes = monitor()
        m.start()
        try:
            await until(lambda: probes.started > probes.done)
            seen: list[str] = []
            unsubscribe = m.on_loss(REPLICA, watcher(seen))
            other: list[str] = []
            m.on_loss(REPLICA, watcher(other))()  # unsubscribed at once: never called
            await probes.answer(True, False)
            await asyncio.sleep(0.01)
            assert seen == []
            await probes.answer(False)
            await until(lambda: seen == [HEALTH_CHECK_FAILED])
            await probes.answer(False, False)  # called once, not once per failed probe
            await asyncio.sleep(0.01)
            assert (seen, other) == ([HEALTH_CHECK_FAILED], [])
            unsubscribe()  # after the call: harmless
        finally:
            await m.stop()

    asyncio.run(go())


def test_a_registered_replica_gone_from_the_registry_is_lost_at_once() -> None:
    async def go() -> None:
        m = LivenessMonitor(None)
        m._ever_registered.add(REPLICA)  # it had a heartbeat; the registry no longer lists it
        seen: list[str] = []
        m.on_loss(REPLICA, watcher(seen))
        await until(lambda: seen == [HEARTBEAT_LAPSED])

    asyncio.run(go())


def test_a_probe_that_raises_counts_as_failed_and_the_probing_goes_on() -> None:
    """A hostile /health (a broken chunked body raises ValueError deep in the parser) must not end the loop
    that is the static replicas' only fence."""

    async def go() -> None:
        m = LivenessMonitor(
            None, static=(REPLICA,), probe_interval=0.001, probe_timeout=0.001, probe_failures=2
        )
        calls = 0

        async def probe(address: str) -> bool:
            nonlocal calls
            calls += 1
            raise ValueError("invalid chunk size")

        m._probe = probe  # type: ignore[method-assign]
        seen: list[str] = []
        m.on_loss(REPLICA, watcher(seen))
        m.start()
        try:
            await until(lambda: seen == [HEALTH_CHECK_FAILED] and calls >= 4)
            assert m.state(REPLICA) is Liveness.LOST
        finally:
            await m.stop()

    asyncio.run(go())


def test_a_static_replica_named_by_dns_is_fenced_under_the_address_envoy_names() -> None:
    # Envoy names an attempt's replica by the IP:PORT it connected to; the replica was given by name.
    async def go() -> None:
        m = LivenessMonitor(
            None, static=("localhost:9",), probe_interval=0.001, probe_timeout=1.0, probe_failures=2
        )
        probes = ScriptedProbes(m)
        m.start()
        try:
            await until(lambda: probes.started > probes.done)  # resolved before its first probe
            seen: list[str] = []
            m.on_loss("127.0.0.1:9", watcher(seen))
            await probes.answer(False, False, False)
            await until(lambda: seen == [HEALTH_CHECK_FAILED])
            assert m.state("127.0.0.1:9") is Liveness.LOST and m.state("localhost:9") is Liveness.LOST
            assert m.state("127.0.0.2:9") is Liveness.UNKNOWN  # not one of its addresses
        finally:
            await m.stop()

    asyncio.run(go())
