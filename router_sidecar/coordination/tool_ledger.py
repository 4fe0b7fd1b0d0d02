"""Tool-call records in the store, keyed by tenant and idempotency key (the decisions are in `core.tools`)."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

from router_sidecar.coordination.store import RetentionLeases, Store, keys
from router_sidecar.core.policy import ToolsPolicy
from router_sidecar.core.tools import Refuse, Replay, StillRunning, answer_for_existing


class ToolLedger:
    """Tool-call records in the store, keyed by tenant and idempotency key."""

    def __init__(self, store: Store, policy: ToolsPolicy) -> None:
        self._store = store
        self._policy = policy
        self._leases = RetentionLeases(store, policy.retention_seconds)

    async def claim(self, tenant: str, key: str, record: dict[str, Any]) -> dict[str, Any] | None:
        """Create the in_progress record atomically. Returns the existing record if the key is taken."""
        existing = await self._store.create(
            keys.tool_call(tenant, key), _encode(record), await self._leases.current()
        )
        return None if existing is None else json.loads(existing)

    async def wait_while_running(self, tenant: str, key: str, digest: str, until: float) -> Replay | Refuse:
        """A duplicate of a running call: poll (bounded) until it settles, else 409 with a retry hint."""
        while True:
            raw = await self._store.get(keys.tool_call(tenant, key))
            if raw is None:
                return Refuse(
                    409,
                    "tool_call_in_progress",
                    "the earlier call with this key just failed without executing; send the call again",
                    retry_after_seconds=0,
                )
            answer = answer_for_existing(json.loads(raw), digest, time.time())
            if not isinstance(answer, StillRunning):
                return answer
            if time.time() >= until:
                return Refuse(
                    409,
                    "tool_call_in_progress",
                    "a call with this Idempotency-Key is still in progress; "
                    "retry later with the same key to get its result",
                    retry_after_seconds=max(1, round(min(answer.deadline, until + 5) - time.time())),
                )
            await asyncio.sleep(0.05)

    async def settle(self, tenant: str, key: str, record: dict[str, Any] | None) -> None:
        """Write the final record, or free the key (record None)."""
        if record is None:
            await self._store.delete(keys.tool_call(tenant, key))
        else:
            await self._store.put(keys.tool_call(tenant, key), _encode(record), await self._leases.current())


def _encode(record: dict[str, Any]) -> bytes:
    return json.dumps(record, separators=(",", ":")).encode()
