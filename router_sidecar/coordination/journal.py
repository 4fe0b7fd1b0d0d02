"""The request journal: one etcd record per logical request, queryable by request id.

The record answers, during an incident, whether the router had the right to re-send the input
(`first_delta_sent`), and afterwards what the client got (`delivered_output_tokens`, `outcome`). It is a
view of the logical request plus the ordered trace of its named events.

Writes for one request are serialised and coalesced (the latest state wins), except `write_ahead`, which
returns only once that state is durable. Records expire with a retention lease shared by all records
written in the same time bucket, so the journal costs one lease per bucket, not one per request.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import time
from typing import Any

from router_sidecar.coordination.store import RetentionLeases, Store, StoreUnavailable, keys
from router_sidecar.core.request import TERMINAL_PHASES, LogicalRequest, Phase
from router_sidecar.core.views import journal_view

log = logging.getLogger(__name__)


# A write that etcd did not take is retried with back-off, for about ten minutes.
WRITE_RETRIES = 130
WRITE_RETRY_MAX_SECONDS = 5.0


class ClaimConflict(Exception):
    """The request id is already taken by a logical request that may not be re-run."""

    def __init__(self, existing: dict[str, Any]) -> None:
        super().__init__(existing.get("request_id"))
        self.existing = existing

    @property
    def in_flight(self) -> bool:
        return existing_phase(self.existing) not in TERMINAL_PHASES


def existing_phase(record: dict[str, Any]) -> Phase | None:
    try:
        return Phase(record.get("phase"))
    except ValueError:
        return None


class _Entry:
    __slots__ = ("dirty", "dropped", "failures", "head", "head_size", "lock", "released", "tail")

    def __init__(self, max_events: int) -> None:
        self.lock = asyncio.Lock()
        # The trace keeps its first and its last events: a request that loops on something (a flood of
        # tool calls, a replica's odd output) cannot grow its record past etcd's request size limit.
        self.head: list[dict[str, Any]] = []
        self.head_size = max_events // 2
        self.tail: collections.deque[dict[str, Any]] = collections.deque(maxlen=max_events - max_events // 2)
        self.dropped = 0
        self.dirty = False
        self.failures = 0  # consecutive failed writes (etcd unreachable)
        self.released = False  # the request left this gateway: drop the entry once it is written

    def add(self, events: list[dict[str, Any]]) -> None:
        for event in events:
            if len(self.head) < self.head_size:
                self.head.append(event)
                continue
            if len(self.tail) == self.tail.maxlen:
                self.dropped += 1
            self.tail.append(event)

    def trace(self) -> list[dict[str, Any]]:
        if not self.dropped:
            return [*self.head, *self.tail]
        return [*self.head, {"event": "events_dropped", "count": self.dropped}, *self.tail]


class Journal:
    def __init__(
        self, store: Store, *, retention_seconds: float, gateway_id: str, max_events: int = 256
    ) -> None:
        self._store = store
        self._max_events = max_events
        self._gateway_id = gateway_id
        self._entries: dict[LogicalRequest, _Entry] = {}  # by identity: one id may be re-run
        self._leases = RetentionLeases(store, retention_seconds)

    async def claim(self, request: LogicalRequest) -> None:
        """Create the record if the id is free (or held by a failed run that delivered nothing).

        Raises ClaimConflict when another logical request holds the id; StoreUnavailable when etcd is down.
        """
        entry = self._entry(request)
        self._take_events(request, entry)
        key = keys.request(request.tenant, request.request_id)
        value = self._encode(request, entry)
        existing = await self._store.create(key, value, await self._leases.current())
        if existing is None:
            return
        try:
            record = json.loads(existing)
        except ValueError:
            record = {"request_id": request.request_id, "phase": None}
        phase = existing_phase(record)
        # A run that failed before any content may be re-run under the same key: the client saw nothing.
        # Compare-and-replace, so that of two gateways re-running it at once only one wins.
        if (
            phase is Phase.FAILED
            and not record.get("first_delta_sent")
            and await self._store.replace(key, existing, value, await self._leases.current())
        ):
            return
        self._entries.pop(request, None)  # the id belongs to someone else: keep nothing
        raise ClaimConflict(record)

    async def write_ahead(self, request: LogicalRequest) -> None:
        """Persist the current state and return only once it is durable (raises StoreUnavailable)."""
        entry = self._entry(request)
        self._take_events(request, entry)
        async with entry.lock:
            entry.dirty = False
            await self._put(request, entry)

    def update(self, request: LogicalRequest) -> None:
        """Persist the current state in the background (coalesced); errors are logged, not raised."""
        entry = self._entry(request)
        self._take_events(request, entry)
        if entry.dirty:
            return
        entry.dirty = True
        asyncio.get_running_loop().create_task(self._flush(request, entry))

    def release(self, request: LogicalRequest) -> None:
        """The request is done on this gateway: free its entry once its last write has gone out."""
        entry = self._entries.get(request)
        if entry is None:
            return
        entry.released = True
        if not entry.dirty and not entry.lock.locked():
            self._entries.pop(request, None)

    async def lookup(self, tenant: str, request_id: str) -> dict[str, Any] | None:
        raw = await self._store.get(keys.request(tenant, request_id))
        return None if raw is None else json.loads(raw)

    async def _flush(self, request: LogicalRequest, entry: _Entry) -> None:
        async with entry.lock:
            if not entry.dirty:
                return
            entry.dirty = False
            try:
                await self._put(request, entry)
                entry.failures = 0
            except StoreUnavailable as exc:
                # etcd is away (restarting, partitioned): the record's latest state is written when it is
                # back, or the record would stay at whatever phase the last write that got through said.
                entry.failures += 1
                if entry.failures == 1:
                    log.error(
                        "journal: could not record request %s (will retry): %s", request.request_id, exc
                    )
                if entry.failures <= WRITE_RETRIES:
                    entry.dirty = True
                    delay = min(WRITE_RETRY_MAX_SECONDS, 0.25 * 2 ** (entry.failures - 1))
                    loop = asyncio.get_running_loop()
                    loop.call_later(delay, lambda: loop.create_task(self._flush(request, entry)))
                else:
                    log.error("journal: gave up recording request %s: %s", request.request_id, exc)
        if entry.released and not entry.dirty:
            self._entries.pop(request, None)

    async def _put(self, request: LogicalRequest, entry: _Entry) -> None:
        value = self._encode(request, entry)
        await self._store.put(
            keys.request(request.tenant, request.request_id), value, await self._leases.current()
        )

    def view(self, request: LogicalRequest) -> dict[str, Any]:
        """The record as it would be stored now (for look-ups of requests still in flight here)."""
        entry = self._entry(request)
        self._take_events(request, entry)
        record = journal_view(request)
        record["gateway"] = self._gateway_id
        record["updated_at"] = round(time.time(), 6)
        record["events"] = entry.trace()
        return record

    def _encode(self, request: LogicalRequest, entry: _Entry) -> bytes:
        return json.dumps(self.view(request), separators=(",", ":")).encode()

    def _take_events(self, request: LogicalRequest, entry: _Entry) -> None:
        now = time.time()
        entry.add([event.as_record(now) for event in request.drain_events()])

    def _entry(self, request: LogicalRequest) -> _Entry:
        entry = self._entries.get(request)
        if entry is None:
            entry = self._entries[request] = _Entry(self._max_events)
        return entry
