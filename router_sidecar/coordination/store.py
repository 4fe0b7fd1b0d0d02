"""The coordination store: one small interface, one etcd implementation.

Journal, idempotency and (later) fencing logic are written against `Store`, never against raw client
calls, so they can be exercised against `MemoryStore` in unit tests and against real etcd end to end.
Every key is built in `keys`, one prefix per concern.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import math
import time
from collections.abc import AsyncIterator, Awaitable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

T = TypeVar("T")

_PROGRESS_SUFFIX = "/progress"


class keys:
    """Every etcd key of the project is built (and taken apart) here, one prefix per concern.

    The layout is shared with the gateways and replica agents of earlier releases on the same etcd, so it
    never changes in place (tests/unit/test_store_keys.py holds it byte for byte)."""

    ROOT = "/router-sidecar/"
    REQUESTS_PREFIX = ROOT + "requests/"
    TOOLS_PREFIX = ROOT + "tools/"
    ATTEMPTS_PREFIX = ROOT + "attempts/"
    OWNERS_PREFIX = ROOT + "owners/"
    IN_FLIGHT_PREFIX = ROOT + "inflight/"
    REPLICAS_PREFIX = ROOT + "replicas/"
    # The per-deployment secret that keys credential digests (`coordination/tenancy.py`).
    TENANT_SECRET = ROOT + "config/tenant_secret"

    @staticmethod
    def request(tenant: str, request_id: str) -> str:
        """A logical request's journal record."""
        return f"{keys.REQUESTS_PREFIX}{tenant}/{request_id}"

    @staticmethod
    def tool_call(tenant: str, idempotency_key: str) -> str:
        return f"{keys.TOOLS_PREFIX}{tenant}/{idempotency_key}"

    @staticmethod
    def cancel_ack(attempt_id: str) -> str:
        return f"{keys.ATTEMPTS_PREFIX}{attempt_id}/cancel_ack"

    @staticmethod
    def progress(attempt_id: str) -> str:
        """What the replica side forwarded for an attempt (written at a modest rate under its lease)."""
        return f"{keys.ATTEMPTS_PREFIX}{attempt_id}{_PROGRESS_SUFFIX}"

    @staticmethod
    def attempt_of_progress(key: str) -> str | None:
        """The attempt id of a `progress` key; None for any other key."""
        if key.startswith(keys.ATTEMPTS_PREFIX) and key.endswith(_PROGRESS_SUFFIX):
            return key[len(keys.ATTEMPTS_PREFIX) : -len(_PROGRESS_SUFFIX)] or None
        return None

    @staticmethod
    def owner(instance: str) -> str:
        """A gateway instance's owner key, under its owner lease: present while the instance is alive."""
        return f"{keys.OWNERS_PREFIX}{instance}"

    @staticmethod
    def owner_of(key: str) -> str:
        """The instance an `owner` key names."""
        return key[len(keys.OWNERS_PREFIX) :]

    @staticmethod
    def in_flight(instance: str, tenant: str, request_id: str) -> str:
        """Index of a request record an instance owns until its journal says the request ended."""
        return f"{keys.in_flight_of(instance)}{tenant}/{request_id}"

    @staticmethod
    def in_flight_of(instance: str) -> str:
        """The prefix of one instance's in-flight index entries."""
        return f"{keys.IN_FLIGHT_PREFIX}{instance}/"

    @staticmethod
    def in_flight_parts(key: str) -> tuple[str, str, str]:
        """(instance, tenant, request id) of an `in_flight` key (instance names hold no '/')."""
        instance, _, rest = key[len(keys.IN_FLIGHT_PREFIX) :].partition("/")
        tenant, _, request_id = rest.partition("/")
        return instance, tenant, request_id

    @staticmethod
    def replica(address: str) -> str:
        """A replica's registration (advertised HOST:PORT), under its agent's lease."""
        return f"{keys.REPLICAS_PREFIX}{address}"

    @staticmethod
    def replica_address(key: str) -> str:
        return key[len(keys.REPLICAS_PREFIX) :]


class StoreUnavailable(Exception):
    """The store could not be reached or did not answer in time."""


@dataclass(frozen=True, slots=True)
class Lease:
    id: int
    ttl_seconds: int


@dataclass(frozen=True, slots=True)
class Put:
    """A further write in the same transaction as a record's write (one etcd revision for both)."""

    key: str
    value: bytes
    lease: Lease | None = None


@dataclass(frozen=True, slots=True)
class Delete:
    key: str


Also = Sequence[Put | Delete]


@dataclass(frozen=True, slots=True)
class _Write:
    """One conditional write, what `create`, `replace` and `put` are each made of: `key` := `value` (under
    `lease`) and the further writes `also`, all in one transaction, done only if every condition given
    holds."""

    key: str
    value: bytes
    lease: Lease | None
    also: Also
    new: bool = False  # `key` must be absent
    expected: bytes | None = None  # `key` must hold this
    present: str | None = None  # this key must exist
    absent: str | None = None  # this key must not exist


class Store(Protocol):
    """`also`: further writes done in the same transaction, only if the main one is.

    An implementation subclasses `Store` and implements `_commit`; `create`, `replace` and `put` are written
    here once, on top of it."""

    # Several members behind it: an unavailable call is most likely a member lost or a leader election, over
    # within seconds while the others keep quorum (a caller may wait that out rather than give up).
    replicated: bool = False

    async def create(
        self, key: str, value: bytes, lease: Lease | None = None, *, also: Also = ()
    ) -> bytes | None:
        """Write `value` only if `key` is absent. Returns None on success, else the existing value."""
        written, found = await self._commit(_Write(key, value, lease, also, new=True))
        return None if written else found

    async def replace(
        self,
        key: str,
        expected: bytes,
        value: bytes,
        lease: Lease | None = None,
        *,
        also: Also = (),
        present: str | None = None,
        absent: str | None = None,
    ) -> bool:
        """Write `value` only if `key` still holds `expected` (and the key `present`, if given, exists, and
        the key `absent`, if given, does not). Returns whether it was written."""
        write = _Write(key, value, lease, also, expected=expected, present=present, absent=absent)
        written, _ = await self._commit(write)
        return written

    async def put(
        self,
        key: str,
        value: bytes,
        lease: Lease | None = None,
        *,
        also: Also = (),
        present: str | None = None,
    ) -> bool:
        """Write `value` (only if the key `present`, if given, exists). Returns whether it was written."""
        written, _ = await self._commit(_Write(key, value, lease, also, present=present))
        return written

    async def _commit(self, write: _Write) -> tuple[bool, bytes | None]:
        """Do `write` if its conditions hold. Returns whether it was written and, when a `new` write was
        not, the value found at its key."""
        ...

    async def get(self, key: str) -> bytes | None: ...

    async def get_prefix(self, prefix: str) -> list[tuple[str, bytes]]: ...

    async def delete(self, key: str) -> None: ...

    async def grant_lease(self, ttl_seconds: int) -> Lease: ...

    async def revoke_lease(self, lease: Lease) -> None: ...

    async def refresh_lease(self, lease: Lease) -> int:
        """Keep `lease` alive once; returns its remaining TTL in seconds (≤ 0: it is gone)."""
        ...

    async def check(self) -> None:
        """Raise StoreUnavailable unless the store answers now (readiness)."""
        ...

    async def close(self) -> None: ...


def grpc_target(endpoint: str) -> str:
    """`--etcd` as a gRPC target: HOST:PORT, or several members' IP:PORT separated by commas (a cluster
    without a load balancer in front; for DNS names give one name that resolves to every member, e.g. a
    headless Service)."""
    members = [m.strip() for m in endpoint.split(",") if m.strip()]
    if not members:
        raise ValueError("etcd endpoint is empty: give HOST:PORT (or IP:PORT,IP:PORT,... for a cluster)")
    parsed: list[tuple[str, str]] = []
    for member in members:
        host, _, port = member.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(
                f"etcd endpoint must be HOST:PORT[,HOST:PORT...], got {member!r} in {endpoint!r}"
            )
        parsed.append((host.strip("[]"), port))
    if len(parsed) == 1:
        return members[0]
    families = {_ip_family(host) for host, _ in parsed}
    if families == {4}:
        return "ipv4:" + ",".join(f"{host}:{port}" for host, port in parsed)
    if families == {6}:
        return "ipv6:" + ",".join(f"[{host}]:{port}" for host, port in parsed)
    raise ValueError(
        f"etcd endpoints {endpoint!r}: several members must all be IPv4 or all IPv6 addresses; for DNS "
        "names give one name that resolves to every member (e.g. a headless Service)"
    )


def _ip_family(host: str) -> int | None:
    try:
        return ipaddress.ip_address(host).version
    except ValueError:
        return None


class EtcdStore(Store):
    """`Store` on etcd v3 through aetcd (asyncio, grpc.aio). Every call is bounded by `timeout`."""

    def __init__(self, endpoint: str, *, timeout: float = 2.0) -> None:
        self.endpoint = endpoint
        self._timeout = timeout
        self._target = grpc_target(endpoint)
        # Round robin over the members: load spreads, and a member that dies leaves the picker (its calls
        # fail with UNAVAILABLE, which callers retry) while the others keep serving.
        self.replicated = "," in endpoint  # or one name for several members: `learn_membership` tells
        self._channel_options = {"grpc.lb_policy_name": "round_robin"} if self.replicated else {}
        self._client = self.new_client()

    def new_client(self, options: dict[str, Any] | None = None) -> Any:
        """A further aetcd client to the same members (e.g. one per watch session)."""
        import aetcd  # imported here so pure-logic users of this module need no etcd client

        # aetcd dials f"{host}:{port}"; a multi-member target is split at its last colon to pass through.
        host, _, port = self._target.rpartition(":")
        merged = {**self._channel_options, **(options or {})}
        return aetcd.Client(host=host, port=int(port), timeout=self._timeout, options=merged or None)

    async def _call(self, awaitable: Awaitable[T]) -> T:
        try:
            return await asyncio.wait_for(awaitable, self._timeout)
        except TimeoutError as exc:
            raise StoreUnavailable(f"etcd at {self.endpoint} did not answer within {self._timeout}s") from exc
        except Exception as exc:  # aetcd maps grpc errors to its own exception types
            if type(exc).__module__.startswith("aetcd"):
                raise StoreUnavailable(f"etcd at {self.endpoint}: {exc}") from exc
            raise

    async def check(self) -> None:
        """Raise StoreUnavailable unless etcd answers a status call now."""
        await self._call(self._client.status())

    async def learn_membership(self) -> int:
        """How many members the cluster has (asked of etcd: one DNS name may stand for several)."""
        members = await self._call(_count(self._client.members()))
        self.replicated = self.replicated or members > 1
        return members

    def _ops(self, also: Also) -> list[object]:
        tx = self._client.transactions
        return [
            tx.put(op.key.encode(), op.value, lease=op.lease.id if op.lease else None)
            if isinstance(op, Put)
            else tx.delete(op.key.encode())
            for op in also
        ]

    async def _commit(self, write: _Write) -> tuple[bool, bytes | None]:
        k = write.key.encode()
        lease = write.lease.id if write.lease else None
        tx = self._client.transactions
        compare = []
        if write.new:
            compare.append(tx.create(k) == 0)
        if write.expected is not None:
            compare.append(tx.value(k) == write.expected)
        if write.present is not None:
            compare.append(tx.version(write.present.encode()) > 0)
        if write.absent is not None:
            compare.append(tx.version(write.absent.encode()) == 0)
        if not compare and not write.also:
            await self._call(self._client.put(k, write.value, lease=lease))
            return True, None
        ok, responses = await self._call(
            self._client.transaction(
                compare=compare,
                success=[tx.put(k, write.value, lease=lease), *self._ops(write.also)],
                failure=[tx.get(k)] if write.new else [],
            )
        )
        if ok or not write.new:
            return bool(ok), None
        found = responses[0] if responses else []
        return False, found[0][0] if found else b""

    async def get_prefix(self, prefix: str) -> list[tuple[str, bytes]]:
        result = await self._call(self._client.get_prefix(prefix.encode()))
        return [(kv.key.decode(), kv.value) for kv in result.kvs]

    async def get(self, key: str) -> bytes | None:
        result = await self._call(self._client.get(key.encode()))
        return None if result is None else result.value

    async def delete(self, key: str) -> None:
        await self._call(self._client.delete(key.encode()))

    async def grant_lease(self, ttl_seconds: int) -> Lease:
        granted = await self._call(self._client.lease(ttl_seconds))
        return Lease(id=granted.id, ttl_seconds=granted.ttl)

    async def revoke_lease(self, lease: Lease) -> None:
        await self._call(self._client.revoke_lease(lease.id))

    async def refresh_lease(self, lease: Lease) -> int:
        reply = await self._call(self._client.refresh_lease(lease.id))
        return int(reply.TTL) if reply is not None else 0

    async def watch_prefix(
        self, prefix: str, *, retry_interval: float = 1.0
    ) -> AsyncIterator[tuple[str, bytes | None]]:
        """(key, value) for every later put under `prefix`, value None for a delete; survives etcd loss."""
        while True:
            try:
                watch = await self._call(self._client.watch_prefix(prefix.encode()))
                try:
                    async for event in watch:
                        yield event.kv.key.decode(), (None if event.kind == "DELETE" else event.kv.value)
                finally:
                    with contextlib.suppress(Exception):
                        await asyncio.wait_for(watch.cancel(), 1.0)
            except StoreUnavailable:
                pass
            except Exception as exc:
                if not type(exc).__module__.startswith("aetcd"):
                    raise
            await asyncio.sleep(retry_interval)

    async def close(self) -> None:
        # Bounded: aetcd's close waits for its watch streams, which may never answer during shutdown.
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self._client.close(), 2.0)


class RetentionLeases:
    """Leases for records kept `retention_seconds`: one lease per time bucket (a tenth of the period),
    shared by every record written in it, so that retention costs one lease per bucket, not one per
    record. Records then live between 1.0× and 1.1× the retention period."""

    def __init__(self, store: Store, retention_seconds: float) -> None:
        self._store = store
        self._retention = retention_seconds
        self._bucket_seconds = max(1.0, retention_seconds / 10)
        self._lease: Lease | None = None
        self._bucket = -1.0
        self._granting = asyncio.Lock()

    async def current(self) -> Lease:
        bucket = time.time() // self._bucket_seconds
        if self._lease is not None and bucket == self._bucket:
            return self._lease
        # One grant for everyone asking at once (a bucket's start, or etcd back after an outage): each lease
        # lives a whole retention period.
        async with self._granting:
            bucket = time.time() // self._bucket_seconds  # again: a bucket may have begun while it waited
            if self._lease is None or bucket != self._bucket:
                ttl = max(1, math.ceil(self._retention + self._bucket_seconds))
                self._lease = await self._store.grant_lease(ttl)
                self._bucket = bucket
            return self._lease


async def _count(items: AsyncIterator[object]) -> int:
    return sum([1 async for _ in items])


class MemoryStore(Store):
    """In-process `Store` for unit tests of logic written against the interface (no expiry)."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}
        self.revoked: set[int] = set()
        self._next_lease = 1

    def _apply(self, also: Also) -> None:
        for op in also:
            if isinstance(op, Put):
                self.data[op.key] = op.value
            else:
                self.data.pop(op.key, None)

    async def _commit(self, write: _Write) -> tuple[bool, bytes | None]:
        if write.new and write.key in self.data:
            return False, self.data[write.key]
        if write.expected is not None and self.data.get(write.key) != write.expected:
            return False, None
        if write.present is not None and write.present not in self.data:
            return False, None
        if write.absent is not None and write.absent in self.data:
            return False, None
        self.data[write.key] = write.value
        self._apply(write.also)
        return True, None

    async def get(self, key: str) -> bytes | None:
        return self.data.get(key)

    async def get_prefix(self, prefix: str) -> list[tuple[str, bytes]]:
        return sorted((k, v) for k, v in self.data.items() if k.startswith(prefix))

    async def delete(self, key: str) -> None:
        self.data.pop(key, None)

    async def grant_lease(self, ttl_seconds: int) -> Lease:
        self._next_lease += 1
        return Lease(id=self._next_lease, ttl_seconds=ttl_seconds)

    async def revoke_lease(self, lease: Lease) -> None:
        self.revoked.add(lease.id)

    async def refresh_lease(self, lease: Lease) -> int:
        return 0 if lease.id in self.revoked else lease.ttl_seconds

    async def check(self) -> None:
        return None

    async def close(self) -> None:
        return None
