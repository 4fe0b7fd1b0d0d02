"""Replica liveness as the gateway knows it: from the registry's lease-backed heartbeats.

A replica that was registered and is no longer (its agent withdrew it because the engine stopped
answering, or its heartbeat lease expired because the agent is cut off) is *lost*: liveness of its
attempts is uncertain, so they are fenced. This is not a latency timeout: a slow replica whose agent
still sees it healthy keeps its attempts for as long as the request's deadline allows. A replica that
never registered (static `--replica`) has no heartbeat: only its connection tells about it.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
from collections.abc import Awaitable, Callable

from router_sidecar.coordination.registry_store import Replica, ReplicaRegistry

log = logging.getLogger(__name__)

LossCallback = Callable[[str], Awaitable[None]]


class Liveness(enum.StrEnum):
    HEALTHY = "healthy"  # registered, heartbeat current
    LOST = "lost"  # was registered, is not any more
    UNKNOWN = "unknown"  # never registered: no heartbeat to judge by


class LivenessMonitor:
    def __init__(self, registry: ReplicaRegistry | None) -> None:
        self._registry = registry
        self.replicas: dict[str, Replica] = {}
        self._ever_registered: set[str] = set()
        self._watchers: dict[str, set[LossCallback]] = {}
        self._task: asyncio.Task[None] | None = None
        self.changed = (
            asyncio.Event()
        )  # set (and replaced) after every registry change: discovery waits on it
        self.first_snapshot = asyncio.Event()

    def start(self) -> None:
        if self._registry is not None:
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def state(self, address: str) -> Liveness:
        if address in self.replicas:
            return Liveness.HEALTHY
        return Liveness.LOST if address in self._ever_registered else Liveness.UNKNOWN

    def on_loss(self, address: str, callback: LossCallback) -> Callable[[], None]:
        """Call `callback(address)` once if this replica is lost; returns the function that unsubscribes."""
        self._watchers.setdefault(address, set()).add(callback)

        def unsubscribe() -> None:
            watchers = self._watchers.get(address)
            if watchers is not None:
                watchers.discard(callback)
                if not watchers:
                    self._watchers.pop(address, None)

        return unsubscribe

    async def _run(self) -> None:
        assert self._registry is not None
        async for snapshot in self._registry.watch_replicas():
            lost = set(self.replicas) - set(snapshot)
            self.replicas = snapshot
            self._ever_registered.update(snapshot)
            self.first_snapshot.set()
            self.changed.set()
            self.changed = asyncio.Event()
            for address in lost:
                callbacks = self._watchers.pop(address, set())
                log.warning("replica %s lost its heartbeat: fencing %d attempt(s)", address, len(callbacks))
                for callback in callbacks:
                    asyncio.get_running_loop().create_task(callback(address))
