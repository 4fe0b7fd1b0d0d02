"""The coordination store: one small interface, one etcd implementation, one in-memory one.

Journal, idempotency, fencing, the replica registry, gateway ownership and progress reports are written
against `Store`, never against raw client calls, so they can be exercised against `MemoryStore` in unit
tests and against real etcd end to end. Every key is built in `keys`, one prefix per concern. This is the
only module that knows the etcd client (aetcd, and grpc for the watch stream).
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import math
import random
import time
from collections.abc import AsyncIterator, Awaitable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

if TYPE_CHECKING:
    import grpc

T = TypeVar("T")

log = logging.getLogger(__name__)


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
    RESPONSES_PREFIX = ROOT + "responses/"
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
    def stored_response(tenant: str, response_id: str) -> str:
        """Which replica holds a Responses API response it stored (and which request made it); written with
        the request's journal record, under the same retention lease."""
        return f"{keys.RESPONSES_PREFIX}{tenant}/{response_id}"

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
class Entry:
    """One key as read: its value, the lease it lives under (0: none) and the revision that wrote it."""

    key: str
    value: bytes
    lease_id: int = 0
    mod_revision: int = 0


@dataclass(frozen=True, slots=True)
class Snapshot:
    """Every key under a prefix at one revision. From a watch: what the watcher knows is replaced by it."""

    entries: tuple[Entry, ...]
    revision: int

    def by_key(self) -> dict[str, Entry]:
        return {entry.key: entry for entry in self.entries}


@dataclass(frozen=True, slots=True)
class Change:
    """One write under a watched prefix; `value` None: the key is gone (deleted, or its lease ended)."""

    key: str
    value: bytes | None
    lease_id: int
    revision: int

    def entry(self) -> Entry | None:
        """The key as this change left it; None if it is gone."""
        return None if self.value is None else Entry(self.key, self.value, self.lease_id, self.revision)


WatchItem = Snapshot | Change


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


# A watch whose stream was silent this long asks etcd whether it is still there (a progress request);
# without an answer within the store's timeout the stream is taken for dead and opened again.
WATCH_PROBE_AFTER_SECONDS = 5.0
# Back-off between tries to watch again while etcd is away: doubled from the first up to the last.
WATCH_RETRY_FIRST_SECONDS = 0.25
WATCH_RETRY_MAX_SECONDS = 2.0


class Store(Protocol):
    """`also`: further writes done in the same transaction, only if the main one is.

    An implementation subclasses `Store` and implements `_commit`; `create`, `replace` and `put` are written
    here once, on top of it."""

    # Several members behind it: an unavailable call is most likely a member lost or a leader election, over
    # within seconds while the others keep quorum (a caller may wait that out rather than give up).
    replicated: bool = False
    # Other processes read and write it (gateway instances, replica agents): ownership of records between
    # instances and a replica registry only mean something in a shared store.
    shared: bool = False

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

    async def read_prefix(self, prefix: str) -> Snapshot:
        """Every key under `prefix`, with its lease and revision, at one revision."""
        ...

    async def get_prefix(self, prefix: str) -> list[tuple[str, bytes]]:
        """(key, value) of every key under `prefix`, in key order."""
        return [(entry.key, entry.value) for entry in (await self.read_prefix(prefix)).entries]

    def watch_prefix(
        self,
        prefix: str,
        *,
        retry_interval: float = WATCH_RETRY_FIRST_SECONDS,
        probe_after: float = WATCH_PROBE_AFTER_SECONDS,
    ) -> AsyncIterator[WatchItem]:
        """What is under `prefix`, kept current: a `Snapshot` first, then every later `Change` once, in
        revision order. Where the changes since the last one yielded cannot all be given (etcd compacted
        them away, or it is not the same etcd any more), a new `Snapshot` stands in for them, so applying
        what was yielded always gives what the store holds. If the store goes away the watch waits for it
        (back-off from `retry_interval`) and resumes where it left off. Runs until the caller stops."""
        ...

    async def delete(self, key: str) -> None: ...

    async def grant_lease(self, ttl_seconds: int) -> Lease: ...

    async def revoke_lease(self, lease: Lease) -> None:
        """End `lease` now; the keys under it are deleted with it."""
        ...

    async def refresh_lease(self, lease: Lease) -> int:
        """Keep `lease` alive once; returns its remaining TTL in seconds (≤ 0: it is gone)."""
        ...

    async def lease_time_to_live(self, lease_id: int) -> tuple[int, int]:
        """(remaining, granted) TTL of a lease, in seconds, without refreshing it; remaining ≤ 0: gone."""
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


# gRPC's default reconnect back-off grows to 120 s: after an etcd outage of a few seconds a client could
# stay "unreachable" long after etcd is back. Capped at 1 s, recovery follows etcd within ~1-2 s.
RECONNECT_OPTIONS: dict[str, Any] = {
    "grpc.initial_reconnect_backoff_ms": 250,
    "grpc.min_reconnect_backoff_ms": 250,
    "grpc.max_reconnect_backoff_ms": 1000,
}
# What etcd's own clients send on a watch stream: a member that lost its leader ends the stream instead of
# keeping it open with nothing to say while the rest of the cluster moves on.
_REQUIRE_LEADER = (("hasleader", "true"),)


class EtcdStore(Store):
    """`Store` on etcd v3 through aetcd (asyncio, grpc.aio). Every call is bounded by `timeout`."""

    shared = True

    def __init__(self, endpoint: str, *, timeout: float = 2.0) -> None:
        self.endpoint = endpoint
        self._timeout = timeout
        self._target = grpc_target(endpoint)
        # Round robin over the members: load spreads, and a member that dies leaves the picker (its calls
        # fail with UNAVAILABLE, which callers retry) while the others keep serving.
        self.replicated = "," in endpoint  # or one name for several members: `learn_membership` tells
        balance = {"grpc.lb_policy_name": "round_robin"} if self.replicated else {}
        self._channel_options = {**RECONNECT_OPTIONS, **balance}
        self._client = self._new_client()
        self._watches: set[_WatchStream] = set()
        self._closed = False
        self.watch_streams = 0  # watch streams opened so far (one per watch, and one per resumption)

    def _new_client(self) -> Any:
        import aetcd  # imported here so pure-logic users of this module need no etcd client

        # aetcd dials f"{host}:{port}"; a multi-member target is split at its last colon to pass through.
        host, _, port = self._target.rpartition(":")
        return aetcd.Client(host=host, port=int(port), timeout=self._timeout, options=self._channel_options)

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

    async def get(self, key: str) -> bytes | None:
        result = await self._call(self._client.get(key.encode()))
        return None if result is None else result.value

    async def read_prefix(self, prefix: str) -> Snapshot:
        snapshot, _ = await self._read(prefix)
        return snapshot

    async def _read(self, prefix: str) -> tuple[Snapshot, _WatchPosition]:
        """The prefix now, and where a watch of it would start."""
        result = await self._call(self._client.get_prefix(prefix.encode()))
        entries = tuple(Entry(kv.key.decode(), kv.value, kv.lease, kv.mod_revision) for kv in result.kvs)
        header = result.header
        position = _WatchPosition(header.revision + 1, header.cluster_id, {header.member_id: header.revision})
        return Snapshot(entries, header.revision), position

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

    async def lease_time_to_live(self, lease_id: int) -> tuple[int, int]:
        # etcd answers TTL -1 for a lease that does not exist (revoked or expired).
        reply = await self._call(self._client.get_lease_info(lease_id, keys=False))
        return int(reply.TTL), int(reply.grantedTTL)

    async def watch_prefix(
        self,
        prefix: str,
        *,
        retry_interval: float = WATCH_RETRY_FIRST_SECONDS,
        probe_after: float = WATCH_PROBE_AFTER_SECONDS,
    ) -> AsyncIterator[WatchItem]:
        # The one watch loop: snapshot, then a stream from the revision after it; a broken stream is opened
        # again from the revision after the last change handed over, a lost history read whole again.
        position: _WatchPosition | None = None
        delay = retry_interval
        trouble: str | None = None  # why the watch is not running (logged once per outage)
        while not self._closed:
            stream: _WatchStream | None = None
            try:
                if position is None:
                    snapshot, position = await self._read(prefix)
                    yield snapshot
                stream = await self._open_watch(prefix, position)
                if trouble is not None:
                    log.info("watch of %s resumed from revision %d", prefix, position.revision)
                    trouble = None
                delay = retry_interval
                while True:
                    changes = await stream.changes(position, probe_after)
                    for change in changes:
                        yield change
                    position.revision = changes[-1].revision + 1
            except _HistoryLost as exc:
                log.warning("watch of %s: %s; reading it whole again", prefix, exc)
                position = None
                trouble = str(exc)
            except StoreUnavailable as exc:
                if trouble is None:
                    log.warning("watch of %s: %s; watching again when etcd answers", prefix, exc)
                trouble = str(exc)
            finally:
                if stream is not None:
                    self._watches.discard(stream)
                    await stream.close()
            if self._closed:
                break
            # Jittered: the watchers of many gateways do not all come back at the same instant.
            await asyncio.sleep(delay * random.uniform(0.8, 1.2))
            delay = min(WATCH_RETRY_MAX_SECONDS, delay * 2)

    async def _open_watch(self, prefix: str, position: _WatchPosition) -> _WatchStream:
        """A watch stream of `prefix` from `position`, on a channel of its own: a connection that went
        silent (a frozen member, a black-holed route) is never reused for the next stream."""
        import grpc
        from aetcd import rpc

        # gRPC shares connections between channels to one target unless told not to.
        options = {**self._channel_options, "grpc.use_local_subchannel_pool": 1}
        channel = grpc.aio.insecure_channel(self._target, options=list(options.items()))
        call = rpc.WatchStub(channel).Watch(metadata=_REQUIRE_LEADER)
        stream = _WatchStream(channel, call, self._timeout, f"etcd at {self.endpoint}")
        self._watches.add(stream)
        try:
            key = prefix.encode()
            create = rpc.WatchCreateRequest(
                key=key, range_end=_prefix_end(key), start_revision=position.revision
            )
            await stream.write(rpc.WatchRequest(create_request=create))
            try:
                created = await stream.next(self._timeout)
            except TimeoutError:
                raise StoreUnavailable(f"{stream.what}: no watch within {self._timeout}s") from None
            if not created.created or created.canceled:
                _raise_if_compacted(created, position)
                raise StoreUnavailable(
                    f"{stream.what}: watch refused ({created.cancel_reason or 'not created'})"
                )
            position.check(created.header)
            self.watch_streams += 1
            return stream
        except BaseException:
            self._watches.discard(stream)
            await stream.close()
            raise

    async def close(self) -> None:
        self._closed = True
        for stream in list(self._watches):
            await stream.close()
        # Bounded: aetcd's close may wait for streams that never answer during shutdown.
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self._client.close(), 2.0)


class _HistoryLost(Exception):
    """The changes since a watch's last revision cannot be replayed: it starts again from a snapshot."""


@dataclass(slots=True)
class _WatchPosition:
    """Where a watch resumes: the next revision, of which cluster. Each member's highest revision seen
    tells a member that lost its data (its revision went back, and the history with it)."""

    revision: int
    cluster_id: int
    member_revisions: dict[int, int] = field(default_factory=dict)

    def check(self, header: Any) -> None:
        if header.cluster_id != self.cluster_id:
            raise _HistoryLost(
                f"etcd is another cluster now ({header.cluster_id:x}, was {self.cluster_id:x})"
            )
        before = self.member_revisions.get(header.member_id, 0)
        if header.revision < before:
            raise _HistoryLost(
                f"etcd member {header.member_id:x} went back from revision {before} to {header.revision}"
            )
        self.member_revisions[header.member_id] = header.revision


def _raise_if_compacted(response: Any, position: _WatchPosition) -> None:
    if response.compact_revision:
        raise _HistoryLost(
            f"etcd compacted its history up to revision {response.compact_revision}, "
            f"past revision {position.revision} the watch resumes from"
        )


class _WatchStream:
    """One etcd watch stream and its channel. A reader task moves responses into a queue, so that waiting
    for one can time out without cancelling a read on the stream."""

    def __init__(self, channel: grpc.aio.Channel, call: Any, timeout: float, what: str) -> None:
        self._channel = channel
        self._call = call
        self._timeout = timeout
        self.what = what
        self._responses: asyncio.Queue[Any] = asyncio.Queue()
        self._reader = asyncio.get_running_loop().create_task(self._read_all())
        self._closed = False

    async def _read_all(self) -> None:
        import grpc

        try:
            while True:
                response = await self._call.read()
                if response is grpc.aio.EOF:
                    self._responses.put_nowait(None)
                    return
                self._responses.put_nowait(response)
        except Exception as exc:  # the stream failed: the waiting side raises it
            self._responses.put_nowait(exc)

    async def next(self, wait: float) -> Any:
        """The next response within `wait` seconds (else TimeoutError)."""
        response = await asyncio.wait_for(self._responses.get(), wait)
        if response is None:
            raise StoreUnavailable(f"{self.what}: the watch stream ended")
        if isinstance(response, Exception):
            raise StoreUnavailable(f"{self.what}: {_rpc_error(response)}") from response
        return response

    async def write(self, request: Any) -> None:
        import grpc

        try:
            await asyncio.wait_for(self._call.write(request), self._timeout)
        except TimeoutError:
            raise StoreUnavailable(f"{self.what}: a request not sent within {self._timeout}s") from None
        except (grpc.RpcError, grpc.aio.UsageError, asyncio.InvalidStateError) as exc:
            raise StoreUnavailable(f"{self.what}: {_rpc_error(exc)}") from exc

    async def changes(self, position: _WatchPosition, probe_after: float) -> list[Change]:
        """The next changes (one response's), in revision order. Silent for `probe_after` seconds, the
        stream is asked for a progress report; no answer to that within the timeout: StoreUnavailable."""
        from aetcd import rpc

        probing = False
        while True:
            try:
                response = await self.next(self._timeout if probing else probe_after)
            except TimeoutError:
                if probing:
                    raise StoreUnavailable(
                        f"{self.what}: the watch stream fell silent (no answer to a progress request within "
                        f"{self._timeout}s)"
                    ) from None
                await self.write(rpc.WatchRequest(progress_request=rpc.WatchProgressRequest()))
                probing = True
                continue
            probing = False
            _raise_if_compacted(response, position)
            if response.canceled:
                raise StoreUnavailable(
                    f"{self.what}: watch cancelled ({response.cancel_reason or 'no reason given'})"
                )
            position.check(response.header)
            if response.events:
                return [
                    Change(
                        event.kv.key.decode(),
                        None if event.type == rpc.Event.DELETE else event.kv.value,
                        event.kv.lease,
                        event.kv.mod_revision,
                    )
                    for event in response.events
                ]

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._call.cancel()
        self._reader.cancel()
        await asyncio.wait([self._reader], timeout=1.0)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self._channel.close(), 1.0)


def _rpc_error(exc: BaseException) -> str:
    code, details = getattr(exc, "code", None), getattr(exc, "details", None)
    if callable(code) and callable(details):
        return f"{code().name}: {details()}"
    return str(exc) or type(exc).__name__


def _prefix_end(prefix: bytes) -> bytes:
    """The end of the key range that holds every key starting with `prefix` (etcd's own rule)."""
    end = bytearray(prefix)
    while end:
        if end[-1] < 0xFF:
            end[-1] += 1
            return bytes(end)
        end.pop()
    return b"\0"  # every key from `prefix` on


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


@dataclass(eq=False, slots=True)
class _MemoryWatch:
    prefix: str
    pending: asyncio.Queue[WatchItem] = field(default_factory=asyncio.Queue)


class MemoryStore(Store):
    """In-process `Store` for unit tests of logic written against the interface.

    It keeps etcd's rules where the logic can tell: one revision per transaction, keys deleted with their
    lease, a watch fed by its own writes (a snapshot, then every change). Leases never expire on their own:
    `revoke_lease` is how one ends. `shared=True` stands for a store other processes write in too (a test
    then writes what they would)."""

    def __init__(self, *, shared: bool = False) -> None:
        self.shared = shared
        self.data: dict[str, bytes] = {}  # tests may seed it directly: such keys have no lease, revision 0
        self.revoked: set[int] = set()
        self.revision = 1  # as a new etcd's
        self._next_lease = 1
        self._granted: dict[int, int] = {}  # live lease id → granted TTL
        self._written: dict[str, tuple[int, int]] = {}  # key → (lease id, revision that wrote it)
        self._watches: list[_MemoryWatch] = []

    def _apply(self, ops: Sequence[Put | Delete]) -> None:
        """One transaction: every write in it at one new revision, and each watcher told."""
        revision = self.revision + 1
        changes: list[Change] = []
        for op in ops:
            if isinstance(op, Put):
                lease_id = op.lease.id if op.lease else 0
                self.data[op.key] = op.value
                self._written[op.key] = (lease_id, revision)
                changes.append(Change(op.key, op.value, lease_id, revision))
            elif op.key in self.data:
                del self.data[op.key]
                self._written.pop(op.key, None)
                changes.append(Change(op.key, None, 0, revision))
        if not changes:
            return
        self.revision = revision
        for watch in self._watches:
            for change in changes:
                if change.key.startswith(watch.prefix):
                    watch.pending.put_nowait(change)

    async def _commit(self, write: _Write) -> tuple[bool, bytes | None]:
        if write.new and write.key in self.data:
            return False, self.data[write.key]
        if write.expected is not None and self.data.get(write.key) != write.expected:
            return False, None
        if write.present is not None and write.present not in self.data:
            return False, None
        if write.absent is not None and write.absent in self.data:
            return False, None
        self._apply([Put(write.key, write.value, write.lease), *write.also])
        return True, None

    async def get(self, key: str) -> bytes | None:
        return self.data.get(key)

    def _snapshot(self, prefix: str) -> Snapshot:
        entries = tuple(
            Entry(key, value, *self._written.get(key, (0, 0)))
            for key, value in sorted(self.data.items())
            if key.startswith(prefix)
        )
        return Snapshot(entries, self.revision)

    async def read_prefix(self, prefix: str) -> Snapshot:
        return self._snapshot(prefix)

    async def watch_prefix(
        self,
        prefix: str,
        *,
        retry_interval: float = WATCH_RETRY_FIRST_SECONDS,
        probe_after: float = WATCH_PROBE_AFTER_SECONDS,
    ) -> AsyncIterator[WatchItem]:
        # Taken and registered in one step (no await between): no write falls between the two.
        watch = _MemoryWatch(prefix)
        self._watches.append(watch)
        try:
            yield self._snapshot(prefix)
            while True:
                yield await watch.pending.get()
        finally:
            self._watches.remove(watch)

    def watching(self, prefix: str) -> int:
        """How many watches of `prefix` are open (each has taken its snapshot: it misses no later change)."""
        return sum(watch.prefix == prefix for watch in self._watches)

    def compact(self) -> None:
        """What etcd's compaction does to a watcher that had not caught up: the changes not yet handed to
        it are gone, and a snapshot of now stands in for them."""
        for watch in self._watches:
            if watch.pending.empty():
                continue
            while not watch.pending.empty():
                watch.pending.get_nowait()
            watch.pending.put_nowait(self._snapshot(watch.prefix))

    async def delete(self, key: str) -> None:
        self._apply([Delete(key)])

    async def grant_lease(self, ttl_seconds: int) -> Lease:
        self._next_lease += 1
        self._granted[self._next_lease] = ttl_seconds
        return Lease(id=self._next_lease, ttl_seconds=ttl_seconds)

    async def revoke_lease(self, lease: Lease) -> None:
        self.revoked.add(lease.id)
        self._granted.pop(lease.id, None)
        if lease.id:
            self._apply([Delete(k) for k, (lease_id, _) in self._written.items() if lease_id == lease.id])

    async def refresh_lease(self, lease: Lease) -> int:
        return 0 if lease.id in self.revoked else lease.ttl_seconds

    async def lease_time_to_live(self, lease_id: int) -> tuple[int, int]:
        granted = self._granted.get(lease_id)
        return (-1, 0) if granted is None else (granted, granted)

    async def check(self) -> None:
        return None

    async def close(self) -> None:
        return None
