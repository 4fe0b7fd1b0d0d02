"""Replica liveness as the gateway knows it: from the registry's lease-backed heartbeats.

A replica that was registered and is no longer (its agent withdrew it because the engine stopped
answering, or its heartbeat lease expired because the agent is cut off) is *lost*: liveness of its
attempts is uncertain, so they are fenced. This is not a latency timeout: a slow replica whose agent
still sees it healthy keeps its attempts for as long as the request's deadline allows.

A static replica (`--replica`, no agent) has no heartbeat, so the sidecar probes its `/health` itself: one
that stops accepting connections or answering its health check (a dying engine whose server only waits
for connections to close, a frozen process) is lost after `liveness.static_probe_failures` probes in a
row. It has no replica side either, so its closed connection is the whole fence. One named by DNS
(`--replica engine-0.engine:8000`) is known by the addresses its name resolves to as well (re-resolved every
probe round): Envoy names an attempt's replica by the address it connected to.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import ipaddress
import logging
import socket
import time
from collections.abc import Awaitable, Callable

from router_sidecar.coordination.engine_http import EngineDown, http_get, split_hostport
from router_sidecar.coordination.registry_store import Replica, ReplicaRegistry
from router_sidecar.core.destinations import DRAINING, Candidate

log = logging.getLogger(__name__)

# Called with the cause: "heartbeat_lapsed" (registry) or "health_check_failed" (static replica probe).
LossCallback = Callable[[str], Awaitable[None]]
HEARTBEAT_LAPSED = "heartbeat_lapsed"
HEALTH_CHECK_FAILED = "health_check_failed"


class Liveness(enum.StrEnum):
    HEALTHY = "healthy"  # registered, heartbeat current
    LOST = "lost"  # was registered, is not any more
    UNKNOWN = "unknown"  # never registered: no heartbeat to judge by


class LivenessMonitor:
    def __init__(
        self,
        registry: ReplicaRegistry | None,
        *,
        static: tuple[str, ...] = (),
        probe_interval: float = 1.0,
        probe_timeout: float | None = None,
        probe_failures: int = 2,
    ) -> None:
        self._registry = registry
        self._static_failures = dict.fromkeys(static, 0)  # static replica → failed probes in a row
        # IP:PORT → the static replica named by DNS that resolves to it (Envoy names attempts by IP:PORT).
        self._aliases: dict[str, str] = {}
        self._probe_interval = probe_interval
        self._probe_timeout = probe_interval if probe_timeout is None else probe_timeout
        self._probe_failures = probe_failures
        self.replicas: dict[str, Replica] = {}
        self._ever_registered: set[str] = set()
        # Every model a registered replica ever served: one whose replicas are all gone now is still known
        # (a fallback may answer for it: docs/design.md#fallback), unlike a name no replica ever served.
        self.models_ever_served: set[str] = set()
        # replica → {callback: when it subscribed (monotonic)}: a probe's verdict applies to the attempts
        # that were already there when the probe started.
        self._watchers: dict[str, dict[LossCallback, float]] = {}
        self._task: asyncio.Task[None] | None = None
        self._probe_task: asyncio.Task[None] | None = None
        self.changed = (
            asyncio.Event()
        )  # set (and replaced) after every registry change: discovery waits on it
        self.first_snapshot = asyncio.Event()

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        if self._registry is not None:
            self._task = loop.create_task(self._run())
        if self._static_failures:
            self._probe_task = loop.create_task(self._probe_static())

    async def stop(self) -> None:
        for task in (self._task, self._probe_task):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task

    @property
    def routable(self) -> dict[str, Replica]:
        """The registered replicas a new attempt may go to: not those draining (their attempts in flight
        finish there; they are not lost)."""
        return {address: r for address, r in self.replicas.items() if not r.draining}

    def candidates(self) -> list[Candidate]:
        """Every replica a new attempt could be sent to, as Envoy names it (ip:port), in a stable order, with
        why it may not be now (the request's destinations are chosen from these)."""
        found = [
            Candidate(address, r.digest, DRAINING if r.draining else "")
            for address, r in self.replicas.items()
        ]
        for name, failures in self._static_failures.items():
            down = "failing its health checks" if failures >= self._probe_failures else ""
            addresses = [ip for ip, n in self._aliases.items() if n == name] or (
                [name] if _is_ip(name) else []
            )
            found += [Candidate(address, None, down) for address in addresses]
        return found

    def _static_name(self, address: str) -> str:
        return self._aliases.get(address, address)

    def state(self, address: str) -> Liveness:
        address = self._static_name(address)
        if address in self.replicas:
            return Liveness.HEALTHY
        if address in self._ever_registered:
            return Liveness.LOST
        failures = self._static_failures.get(address)
        if failures is None:
            return Liveness.UNKNOWN
        return Liveness.LOST if failures >= self._probe_failures else Liveness.HEALTHY

    def registered(self, address: str) -> bool:
        """Whether the replica ever had a heartbeat (an agent, maybe a replica side that honours leases)."""
        return address in self._ever_registered

    def on_loss(self, address: str, callback: LossCallback) -> Callable[[], None]:
        """Call `callback(cause)` once if this replica is lost; returns the function that unsubscribes.

        A registered replica that is gone from the registry is lost already: at once. A static replica is
        judged by the probes that start after the subscription: its failure count may be stale (it was down,
        is back, and Envoy's own health check saw it first), and a healthy replica's new attempt must not
        be fenced for what an earlier probe saw.
        """
        if address in self._ever_registered and address not in self.replicas:
            asyncio.get_running_loop().create_task(callback(HEARTBEAT_LAPSED))
            return lambda: None
        address = self._static_name(address)
        self._watchers.setdefault(address, {})[callback] = time.monotonic()

        def unsubscribe() -> None:
            watchers = self._watchers.get(address)
            if watchers is not None:
                watchers.pop(callback, None)
                if not watchers:
                    self._watchers.pop(address, None)

        return unsubscribe

    async def _run(self) -> None:
        assert self._registry is not None
        async for snapshot in self._registry.watch_replicas():
            lost = set(self.replicas) - set(snapshot)
            self.replicas = snapshot
            self._ever_registered.update(snapshot)
            self.models_ever_served.update(
                r.fingerprint.model_id for r in snapshot.values() if r.fingerprint.model_id
            )
            self.first_snapshot.set()
            self.changed.set()
            self.changed = asyncio.Event()
            for address in lost:
                self._lost(address, HEARTBEAT_LAPSED)

    def _lost(self, address: str, cause: str, *, subscribed_by: float | None = None) -> None:
        """Fence the attempts on `address` (those that subscribed by `subscribed_by`, when given)."""
        watchers = self._watchers.get(address, {})
        callbacks = [c for c, at in watchers.items() if subscribed_by is None or at <= subscribed_by]
        for callback in callbacks:
            del watchers[callback]
        if not watchers:
            self._watchers.pop(address, None)
        if callbacks or subscribed_by is None or self._static_failures.get(address) == self._probe_failures:
            log.warning("replica %s lost (%s): fencing %d attempt(s)", address, cause, len(callbacks))
        for callback in callbacks:
            asyncio.get_running_loop().create_task(callback(cause))

    async def _probe_static(self) -> None:
        while True:
            await self._resolve_static()
            started = time.monotonic()
            # Whatever a replica answers (or raises), the loop goes on: it is the static replicas' only fence.
            results = await asyncio.gather(
                *(self._probe(a) for a in self._static_failures), return_exceptions=True
            )
            for address, result in zip(self._static_failures, results, strict=True):
                failures = 0 if result is True else self._static_failures[address] + 1
                self._static_failures[address] = failures
                if failures >= self._probe_failures:
                    # Every failed probe past the threshold fences the attempts that were there when it
                    # started: also those that came after the replica was first found lost.
                    self._lost(address, HEALTH_CHECK_FAILED, subscribed_by=started)
            await asyncio.sleep(self._probe_interval)

    async def _resolve_static(self) -> None:
        """Map the addresses each DNS-named static replica resolves to now onto its name (a name that does
        not resolve this round keeps what it resolved to before)."""
        loop = asyncio.get_running_loop()
        aliases: dict[str, str] = {}
        for name in self._static_failures:
            if _is_ip(name):
                continue  # an address already: Envoy names it the same way
            host, port = split_hostport(name)
            try:
                async with asyncio.timeout(self._probe_timeout):
                    infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
            except (OSError, TimeoutError) as exc:
                log.warning("static replica %s does not resolve now: %s", name, exc)
                aliases.update({ip: n for ip, n in self._aliases.items() if n == name})
                continue
            for family, _, _, _, sockaddr in infos:
                ip = str(sockaddr[0])
                aliases[f"[{ip}]:{port}" if family == socket.AF_INET6 else f"{ip}:{port}"] = name
        self._aliases = aliases

    async def _probe(self, address: str) -> bool:
        host, port = split_hostport(address)
        try:
            status, _ = await http_get(host, port, "/health", self._probe_timeout)
        except (OSError, TimeoutError, EngineDown, ValueError):
            return False  # ValueError: an answer that is not HTTP (a broken chunked body, say)
        return status == 200


def _is_ip(address: str) -> bool:
    """Whether HOST:PORT names its host by address (Envoy names its hosts so), not by a DNS name."""
    host, _ = split_hostport(address)
    try:
        ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return False
    return True
