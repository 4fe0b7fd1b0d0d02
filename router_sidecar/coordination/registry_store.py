"""The replica registry in etcd: one lease-backed key per replica, and the readers the gateway uses.

Layout: ``keys.replica(<advertise HOST:PORT>)`` → the `ReplicaRegistration` record (JSON)
``{address, fingerprint: {fields}, digest, engine: {name, version, root, max_model_len}, registered_at,
agent_id}``, attached to the agent's lease. The key lives exactly as long as the agent keeps the lease
alive, so a replica whose agent died (or was cut off from etcd) disappears after the TTL on etcd's own
clock; a clean withdrawal deletes the key and revokes the lease at once.

Written against `Store` alone: the watch (reconnect, resumption, snapshots after a lost history) is the
store's.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field

from google.protobuf import struct_pb2

from router_sidecar.coordination.store import (
    WATCH_RETRY_FIRST_SECONDS,
    Entry,
    Lease,
    Snapshot,
    Store,
    StoreUnavailable,
    keys,
)
from router_sidecar.core.fingerprint import EngineInfo, Fingerprint, FingerprintError
from router_sidecar.records import codec
from router_sidecar.records import records_pb2 as rec

__all__ = ["Heartbeat", "Replica", "ReplicaRegistry"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Replica:
    """One registration as the gateway sees it."""

    address: str
    fingerprint: Fingerprint
    digest: str
    engine_name: str | None
    engine_version: str | None
    engine: EngineInfo
    registered_at: float
    agent_id: str
    lease_id: int = 0
    mod_revision: int = 0
    # The engine drains (SIGTERM): no new attempt goes there, the ones in flight finish. Still registered,
    # so its attempts are not lost; gone from the registry when the engine stops (or the drain runs out).
    draining: bool = False

    def to_value(self) -> bytes:
        """The `ReplicaRegistration` record (keys sorted: equal registrations are equal bytes)."""
        adapters = self.fingerprint.lora_adapters
        fingerprint = rec.Fingerprint(
            **{
                name: value
                for name, value in self.fingerprint.to_mapping().items()
                if name != "lora_adapters"
            },
            lora_adapters=None if adapters is None else struct_pb2.ListValue(values=_strings(adapters)),
        )
        record = rec.ReplicaRegistration(
            address=self.address,
            registered_at=self.registered_at,
            agent_id=self.agent_id,
            digest=self.digest,
            fingerprint=fingerprint,
            engine=rec.EngineRecord(
                name=self.engine_name,
                version=self.engine_version,
                root=self.engine.root,
                max_model_len=self.engine.max_model_len,
                model_type=self.engine.model_type,
            ),
            # Absent unless draining: a value an older gateway reads exactly as before.
            draining=True if self.draining else None,
        )
        return codec.dumps(record, sort_keys=True)

    @classmethod
    def from_value(cls, value: bytes, *, lease_id: int = 0, mod_revision: int = 0) -> Replica:
        """Raises RecordError (a ValueError) or FingerprintError for a record that cannot be routed to."""
        record = codec.loads(rec.ReplicaRegistration, value)
        for name in ("address", "digest", "agent_id"):
            if not getattr(record, name):
                raise codec.RecordError(f"not a valid ReplicaRegistration: {name} is missing")
        if not record.HasField("fingerprint"):
            raise codec.RecordError("not a valid ReplicaRegistration: fingerprint is missing")
        engine = record.engine
        return cls(
            address=record.address,
            fingerprint=Fingerprint.from_mapping(codec.to_dict(record.fingerprint)),
            digest=record.digest,
            engine_name=engine.name if engine.HasField("name") else None,
            engine_version=engine.version if engine.HasField("version") else None,
            engine=EngineInfo(
                root=engine.root if engine.HasField("root") else None,
                max_model_len=engine.max_model_len if engine.HasField("max_model_len") else None,
                model_type=engine.model_type if engine.HasField("model_type") else None,
            ),
            registered_at=record.registered_at,
            agent_id=record.agent_id,
            lease_id=lease_id,
            mod_revision=mod_revision,
            draining=record.draining,
        )

    def same_content(self, other: Replica) -> bool:
        """Equal except for ``registered_at``: re-publishing it would be a no-op for routing."""
        return self.to_value() == dataclasses.replace(other, registered_at=self.registered_at).to_value()


def _strings(values: tuple[str, ...]) -> list[struct_pb2.Value]:
    return [struct_pb2.Value(string_value=v) for v in values]


def _parse(entry: Entry) -> Replica | None:
    try:
        return Replica.from_value(entry.value, lease_id=entry.lease_id, mod_revision=entry.mod_revision)
    except (ValueError, KeyError, TypeError, FingerprintError) as exc:
        # A record we cannot read (other schema, hand-written) is never routed to: skipping is the
        # conservative choice, and the warning tells the operator why a replica is missing.
        log.warning("ignoring unreadable replica record %s: %s", entry.key, exc)
        return None


def _replicas(entries: tuple[Entry, ...]) -> dict[str, Replica]:
    replicas: dict[str, Replica] = {}
    for entry in entries:
        replica = _parse(entry)
        if replica is not None:
            replicas[replica.address] = replica
    return replicas


class ReplicaRegistry:
    """Writer (agent side) and reader (gateway side) of the registry, on top of a `Store`."""

    def __init__(self, store: Store) -> None:
        self.store = store

    # -- agent side

    async def put(self, replica: Replica, lease: Lease) -> None:
        await self.store.put(keys.replica(replica.address), replica.to_value(), lease)

    async def keep_alive(self, lease: Lease) -> int:
        """Refresh ``lease`` once; returns the remaining TTL in seconds, ≤ 0 when the lease is gone."""
        return await self.store.refresh_lease(lease)

    async def withdraw(self, address: str, lease: Lease | None) -> None:
        """Delete the key first (watchers see an explicit leave), then revoke the lease."""
        await self.store.delete(keys.replica(address))
        if lease is not None:
            await self.store.revoke_lease(lease)

    # -- gateway side

    async def list_replicas(self) -> dict[str, Replica]:
        return _replicas((await self.store.read_prefix(keys.REPLICAS_PREFIX)).entries)

    async def watch_replicas(
        self, *, retry_interval: float = WATCH_RETRY_FIRST_SECONDS
    ) -> AsyncIterator[dict[str, Replica]]:
        """Yield the full registry now, then again after every change (address → Replica).

        On the store's watch: it resumes after an etcd outage without losing a change, and gives the
        registry whole again where it cannot (`retry_interval`: its first back-off). Only registries that
        differ from the last one yielded are yielded.
        """
        current: dict[str, Replica] = {}
        last: dict[str, Replica] | None = None
        async for item in self.store.watch_prefix(keys.REPLICAS_PREFIX, retry_interval=retry_interval):
            if isinstance(item, Snapshot):
                current = _replicas(item.entries)
            else:
                entry = item.entry()
                replica = None if entry is None else _parse(entry)
                if replica is None:
                    current.pop(keys.replica_address(item.key), None)
                else:
                    current[keys.replica_address(item.key)] = replica
            if last is None or not _same(current, last):
                last = dict(current)
                yield dict(current)


def _same(a: Mapping[str, Replica], b: Mapping[str, Replica]) -> bool:
    # Lease and revision included: a replica re-registered under a new lease (say, after an etcd
    # outage the reader did not see) is a change, even if the stored value is byte-identical.
    return a == b


@dataclass
class Heartbeat:
    """One replica's registration and its keep-alive loop.

    The agent says what it wants (`publish` a record, or `withdraw`); the heartbeat makes etcd match
    and keeps it matching: it refreshes the lease every ``interval``, and if the lease was lost (etcd
    was unreachable for longer than the TTL) or a write failed, it re-registers with a new lease as
    soon as etcd answers again. All etcd writes go through one lock, so a withdrawal can never be
    overtaken by a concurrent re-registration.
    """

    registry: ReplicaRegistry
    address: str
    ttl: int
    interval: float
    lease: Lease | None = None
    wanted: Replica | None = None  # None: the replica must not be registered
    in_sync: bool = False  # etcd holds exactly `wanted` (or nothing, when wanted is None)
    registrations: int = 0  # successful (re-)registrations, for logs and tests
    _lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    _etcd_ok: bool = True

    @property
    def registered(self) -> bool:
        return self.wanted is not None and self.in_sync

    async def publish(self, replica: Replica) -> bool:
        """Register (or update) ``replica``; returns whether etcd holds it now."""
        async with self._lock:
            if self.wanted is not None and self.wanted.same_content(replica):
                if self.in_sync:
                    return True
                replica = self.wanted  # keep registered_at: this is the same registration being repaired
            self.wanted, self.in_sync = replica, False
            await self._sync()
            return self.in_sync

    async def withdraw(self) -> bool:
        """Remove the registration; returns whether etcd confirmed it (else the loop retries)."""
        async with self._lock:
            if self.wanted is None and self.in_sync:
                return True
            self.wanted, self.in_sync = None, False
            await self._sync()
            return self.in_sync

    async def run(self) -> None:
        """Keep-alive loop; runs until cancelled."""
        while True:
            await asyncio.sleep(self.interval)
            async with self._lock:
                await self._sync(refresh=True)

    async def _sync(self, *, refresh: bool = False) -> None:
        try:
            if self.wanted is None:
                if self.lease is not None or not self.in_sync:
                    await self.registry.withdraw(self.address, self.lease)
                    self.lease = None
                self.in_sync = True
            else:
                if self.lease is not None and (refresh or not self.in_sync):
                    remaining = await self.registry.keep_alive(self.lease)
                    if remaining <= 0:
                        log.warning("lease %x of %s expired; registering again", self.lease.id, self.address)
                        self.lease, self.in_sync = None, False
                if self.lease is None:
                    self.lease = await self.registry.store.grant_lease(self.ttl)
                if not self.in_sync:
                    await self.registry.put(self.wanted, self.lease)
                    self.in_sync = True
                    self.registrations += 1
            if not self._etcd_ok:
                log.info("etcd reachable again; registry in sync for %s", self.address)
            self._etcd_ok = True
        except StoreUnavailable as exc:
            # Keep the lease id: after a short outage (or an etcd restart, which renews leases) it may
            # still be valid, and re-using it avoids a spurious leave/join for the gateways.
            self.in_sync = False
            if self._etcd_ok:
                log.warning("etcd unreachable (%s); will re-register when it is back", exc)
            self._etcd_ok = False

    async def close(self, timeout: float = 3.0) -> None:
        """Withdraw within ``timeout``; if etcd does not answer, the lease expires on its own."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.withdraw(), timeout)
