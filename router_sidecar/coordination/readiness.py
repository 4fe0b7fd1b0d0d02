"""Readiness: whether etcd answers, asked at most once per interval however many probes come.

The probe route is on the client-facing listener, so its callers are not only the kubelet: one etcd call
per `interval` (single flight), the answer shared by every probe meanwhile.
"""

from __future__ import annotations

import asyncio
import time

from router_sidecar.coordination.store import Store, StoreUnavailable

# kubelet probes time out after 1 s by default: answer within that.
CHECK_TIMEOUT_SECONDS = 0.8
CHECK_INTERVAL_SECONDS = 1.0


class Readiness:
    def __init__(
        self,
        store: Store,
        *,
        timeout: float = CHECK_TIMEOUT_SECONDS,
        interval: float = CHECK_INTERVAL_SECONDS,
    ) -> None:
        self._store = store
        self._timeout = timeout
        self._interval = interval
        self._checked_at: float | None = None
        self._problem: str | None = None
        self._asking: asyncio.Future[str | None] | None = None

    async def check(self) -> str | None:
        """None when etcd answered (recently), else what is wrong."""
        if self._checked_at is not None and time.monotonic() - self._checked_at < self._interval:
            return self._problem
        if self._asking is None:
            self._asking = asyncio.ensure_future(self._ask())
        return await asyncio.shield(self._asking)

    async def _ask(self) -> str | None:
        try:
            await asyncio.wait_for(self._store.check(), self._timeout)
            self._problem = None
        except (StoreUnavailable, TimeoutError) as exc:
            self._problem = str(exc) or f"no answer within {self._timeout}s"
        finally:
            self._checked_at = time.monotonic()
            self._asking = None
        return self._problem
