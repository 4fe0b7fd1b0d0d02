"""Readiness: whether the gateway can serve a request now. It cannot while etcd does not answer (no attempt
could be journaled or fenced), nor while it has no replica to send one to.

etcd is asked at most once per interval however many probes come: the probe route is on the client-facing
listener, so its callers are not only the kubelet (one etcd call per `interval`, single flight, the answer
shared by every probe meanwhile). The replicas are local state (`LivenessMonitor`): looked at every time.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from router_sidecar.coordination.liveness import Liveness, LivenessMonitor
from router_sidecar.coordination.store import Store, StoreUnavailable

# kubelet probes time out after 1 s by default: answer within that.
CHECK_TIMEOUT_SECONDS = 0.8
CHECK_INTERVAL_SECONDS = 1.0

# The error codes of a 503 from /readyz (docs/errors.md).
ETCD_UNREACHABLE = "etcd_unreachable"
NO_REPLICA_AVAILABLE = "no_replica_available"  # the same word as a request's outcome when Envoy finds none


@dataclass(frozen=True, slots=True)
class NotReady:
    code: str  # ETCD_UNREACHABLE | NO_REPLICA_AVAILABLE
    message: str  # what is wrong, in one line


class ReplicaSet:
    """The replicas a new attempt may go to, as readiness counts them: static ones (`--replica`) while their
    health probe passes (before the first probe they count), discovered ones while registered and not
    draining."""

    def __init__(self, liveness: LivenessMonitor, static: tuple[str, ...] = ()) -> None:
        self._liveness = liveness
        self._static = static

    def routable(self) -> list[str]:
        if self._static:
            return [a for a in self._static if self._liveness.state(a) is Liveness.HEALTHY]
        return sorted(self._liveness.routable)

    def problem(self) -> NotReady | None:
        if self.routable():
            return None
        if self._static:
            why = f"every static replica fails its health probe ({', '.join(self._static)})"
        elif self._liveness.replicas:
            why = f"every registered replica is draining ({', '.join(sorted(self._liveness.replicas))})"
        else:
            why = "none is registered in etcd (run `router-sidecar replica` beside each engine)"
        return NotReady(NO_REPLICA_AVAILABLE, f"no replica to send requests to: {why}")


class Readiness:
    def __init__(
        self,
        store: Store,
        replicas: ReplicaSet | None = None,
        *,
        timeout: float = CHECK_TIMEOUT_SECONDS,
        interval: float = CHECK_INTERVAL_SECONDS,
    ) -> None:
        self._store = store
        self.replicas = replicas  # None: not counted (a sidecar that routes nothing itself)
        self._timeout = timeout
        self._interval = interval
        self._checked_at: float | None = None
        self._problem: NotReady | None = None
        self._asking: asyncio.Future[NotReady | None] | None = None

    async def check(self) -> NotReady | None:
        """None when the gateway can serve, else why not: etcd first (without it nothing can be journaled,
        and the registry's replica list is stale), then the replicas."""
        etcd = await self._check_etcd()
        if etcd is not None or self.replicas is None:
            return etcd
        return self.replicas.problem()

    async def _check_etcd(self) -> NotReady | None:
        if self._checked_at is not None and time.monotonic() - self._checked_at < self._interval:
            return self._problem
        if self._asking is None:
            self._asking = asyncio.ensure_future(self._ask())
        return await asyncio.shield(self._asking)

    async def _ask(self) -> NotReady | None:
        try:
            await asyncio.wait_for(self._store.check(), self._timeout)
            self._problem = None
        except (StoreUnavailable, TimeoutError) as exc:
            why = str(exc) or f"no answer within {self._timeout}s"
            self._problem = NotReady(ETCD_UNREACHABLE, f"etcd does not answer ({why})")
        finally:
            self._checked_at = time.monotonic()
            self._asking = None
        return self._problem
