"""Gateway instances on one etcd cluster: each holds an owner lease; the records of a lost one get closed.

An instance's owner key lives under its owner lease, refreshed by this process. If the process dies (or
is cut off from etcd longer than the TTL), the key goes with the lease. Every instance watches the owner
keys; when one disappears, it closes the lost owner's open records (`core/ownership.py`) and revokes their
attempt leases, so no request of a dead gateway stays "in flight" forever and no attempt of it keeps a
right to publish. Closing is a compare-and-swap that also removes the in-flight index entry: of several
instances seeing the loss at once, exactly one closes each record.

A periodic sweep covers what a watch can miss (a loss while etcd was unreachable, or while no instance ran).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import time
from collections import defaultdict

from router_sidecar.coordination.store import (
    Delete,
    Lease,
    RetentionLeases,
    Snapshot,
    Store,
    StoreUnavailable,
    keys,
)
from router_sidecar.core.ownership import attempt_lease_ids, close_lost_record

log = logging.getLogger(__name__)

# Losses the watch missed are found by a full sweep this often (in owner TTLs).
SWEEP_EVERY_TTLS = 6


def new_instance_id(gateway_id: str) -> str:
    """An id for this run of a gateway: its name plus a nonce, so a restarted instance is a new owner."""
    safe = "".join(c if c.isalnum() or c in "-_.:" else "_" for c in gateway_id)[:120]
    return f"{safe}~{secrets.token_hex(4)}"


async def close_lost_owner(store: Store, retention: RetentionLeases, owner: str, closed_by: str) -> int:
    """Close every open record `owner` left; returns how many this call closed."""
    closed = 0
    for index_key, _ in await store.get_prefix(keys.in_flight_of(owner)):
        _, tenant, request_id = keys.in_flight_parts(index_key)
        record_key = keys.request(tenant, request_id)
        raw = await store.get(record_key)
        if raw is None:  # expired with its retention: only the index is left
            await store.delete(index_key)
            continue
        try:
            record = json.loads(raw)
        except ValueError:
            await store.delete(index_key)
            continue
        closed_record = close_lost_record(record, owner=owner, closed_by=closed_by, now=time.time())
        if closed_record is None:  # ended meanwhile, or re-claimed by another instance
            await store.delete(index_key)
            continue
        value = json.dumps(closed_record, separators=(",", ":")).encode()
        lease = await retention.current()
        closing = await store.replace(
            record_key,
            raw,
            value,
            lease,
            also=[Delete(index_key)],
            present=index_key,
            absent=keys.owner(owner),
        )
        if not closing:
            continue  # closed by another instance first, written once more by its owner, or the owner is back
        closed += 1
        log.warning(
            "closed request %s of lost gateway instance %s (%s)",
            request_id,
            owner,
            closed_record["phase"],
        )
        for lease_id in attempt_lease_ids(record):
            with contextlib.suppress(StoreUnavailable):
                await store.revoke_lease(Lease(lease_id, 0))
    return closed


class Ownership:
    """This instance's owner lease, and the watch that closes the records of lost instances."""

    def __init__(self, store: Store, *, instance: str, ttl_seconds: int, retention_seconds: float) -> None:
        self._store = store
        self.instance = instance
        self._ttl = ttl_seconds
        self._retention = RetentionLeases(store, retention_seconds)
        self._lease: Lease | None = None
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self) -> None:
        """Take the owner lease (raises StoreUnavailable) and keep it alive from now on: the gateway's own
        start (validating and starting Envoy) may take longer than its TTL."""
        await self._take_lease()
        self._tasks = [asyncio.get_running_loop().create_task(self._keep_alive())]

    def start_background(self) -> None:
        """Watch the other instances and sweep (a watch is a stream: start it after forking Envoy)."""
        loop = asyncio.get_running_loop()
        self._tasks += [loop.create_task(self._watch_owners()), loop.create_task(self._sweep_periodically())]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._lease is not None:
            # A clean stop: whatever is still open is another instance's to close, now rather than in a TTL.
            with contextlib.suppress(StoreUnavailable):
                await self._store.revoke_lease(self._lease)

    async def _take_lease(self) -> None:
        self._lease = await self._store.grant_lease(self._ttl)
        value = json.dumps({"instance": self.instance, "since": round(time.time(), 3)}).encode()
        await self._store.put(keys.owner(self.instance), value, self._lease)

    async def _keep_alive(self) -> None:
        while True:
            await asyncio.sleep(self._ttl / 3)
            try:
                assert self._lease is not None
                if await self._store.refresh_lease(self._lease) <= 0:
                    # Lapsed (etcd unreachable past the TTL): others may have closed our open records. Take a
                    # new lease under the same id; later writes of ours still say what really happened.
                    log.error("owner lease of %s lapsed; taking a new one", self.instance)
                    await self._take_lease()
            except StoreUnavailable as exc:
                log.warning("owner lease of %s not refreshed: %s", self.instance, exc)

    async def _watch_owners(self) -> None:
        live: set[str] = set()  # the owner keys as last seen
        first = True
        async for item in self._store.watch_prefix(keys.OWNERS_PREFIX):
            lost: set[str] = set()
            if isinstance(item, Snapshot):
                now = {keys.owner_of(entry.key) for entry in item.entries}
                # The first snapshot is the start (the sweep looks after what was lost before); a later one
                # stands for changes the watch could not give: an owner missing from it was lost meanwhile.
                lost = set() if first else live - now
                live, first = now, False
            elif item.value is None:
                lost = {keys.owner_of(item.key)}
                live -= lost
            else:
                live.add(keys.owner_of(item.key))
            for owner in sorted(lost - {self.instance}):
                await self._close(owner)

    async def _sweep_periodically(self) -> None:
        while True:
            with contextlib.suppress(StoreUnavailable):
                await self.sweep()
            await asyncio.sleep(self._ttl * SWEEP_EVERY_TTLS)

    async def sweep(self) -> int:
        """Close the open records of every owner whose owner key is gone."""
        # The index first: an instance that starts after it was read cannot be taken for lost (its entries
        # are not in this read), and closing also requires its owner key to be absent at that moment.
        open_by_owner: dict[str, int] = defaultdict(int)
        for key, _ in await self._store.get_prefix(keys.IN_FLIGHT_PREFIX):
            open_by_owner[keys.in_flight_parts(key)[0]] += 1
        live = {keys.owner_of(key) for key, _ in await self._store.get_prefix(keys.OWNERS_PREFIX)}
        closed = 0
        for owner in open_by_owner:
            if owner not in live and owner != self.instance:
                closed += await self._close(owner)
        return closed

    async def _close(self, owner: str) -> int:
        try:
            return await close_lost_owner(self._store, self._retention, owner, self.instance)
        except StoreUnavailable as exc:
            log.warning("could not close the records of lost instance %s yet: %s", owner, exc)
            return 0
