"""The request journal: one etcd record per logical request, queryable by request id.

The record answers, during an incident, whether the router had the right to re-send the input
(`first_delta_sent`), and afterwards what the client got (`delivered_output_tokens`, `outcome`). It is a
view of the logical request plus the ordered trace of its named events.

A record is written when the request is admitted (`claim`), when its first delta is about to go out
(`write_ahead`, which returns only once that state is durable), every `progress_interval` while it
streams, and once its stream is over (`finish`, its leases released first): three writes for most
requests. In between, the machines hold the truth (`update` only stamps their events); a look-up on the
serving gateway shows the live state, on another one the last written state. Writes for one request are
serialised and coalesced. A clean completion's record keeps the summary, not the trace, unless sampled
(`trace_clean_completions`). Records expire with a retention lease shared by all records written in the
same time bucket, so the journal costs one lease per bucket, not one per request.

Each record names the gateway instance that owns it (`owner`), and while the request is open an in-flight
index entry under that instance points at it: created in the claim's transaction, removed in the same
transaction as the first write of a terminal phase. If the instance dies, another closes what is left
(`coordination/owners.py`).
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import json
import logging
import random
import time
from typing import TYPE_CHECKING, Any

from router_sidecar.coordination.store import (
    Delete,
    Put,
    RetentionLeases,
    Store,
    StoreUnavailable,
    keys,
)
from router_sidecar.core.destinations import Destinations
from router_sidecar.core.events import Event, EventName
from router_sidecar.core.request import TERMINAL_PHASES, LogicalRequest, Phase
from router_sidecar.core.views import destinations_record, journal_event, journal_record, rejected_record
from router_sidecar.records import codec

if TYPE_CHECKING:
    from router_sidecar.telemetry.observer import Telemetry

log = logging.getLogger(__name__)


# After a request's end, what a placement learns late is still written for this long.
LATE_NEWS_SECONDS = 10.0
# A write that etcd did not take is retried with back-off, for about ten minutes.
WRITE_RETRIES = 130
WRITE_RETRY_MAX_SECONDS = 5.0
# On an etcd cluster, a claim etcd did not take is tried again for this long: a leader election after a
# member's loss takes a few seconds, and a request whose claim fails is served without retries.
CLAIM_PATIENCE_SECONDS = 6.0
CLAIM_RETRY_INTERVAL_SECONDS = 0.25


class RecordTaken(StoreUnavailable):
    """The record was closed by another gateway instance, which took this one for lost (its owner lease
    lapsed): this instance no longer writes it."""


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
    __slots__ = (
        "claiming",
        "dirty",
        "dropped",
        "failures",
        "finished",
        "head",
        "head_size",
        "in_flight_indexed",
        "lock",
        "lost",
        "released",
        "response_indexed",
        "tail",
        "written",
        "written_at",
    )

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
        self.released = False  # the request left this gateway: the entry goes after a grace period
        self.finished = False  # its end was written: later news (a placement learning late) is written too
        self.in_flight_indexed = False  # its in-flight index entry exists (claimed, not yet terminal)
        self.response_indexed = False  # its stored response's holder was written (keys.stored_response)
        self.lost = False  # the record is not ours (another run holds the id, or another instance closed it)
        # While the claim is in flight every other write waits for it: only the claim may create the record.
        self.claiming: asyncio.Future[None] | None = None
        self.written_at = time.monotonic()  # last write sent (progress writes are spaced from it)
        self.written = b""  # what the last write said (less its time): the same again is not rewritten

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
        return [*self.head, journal_event({"event": "events_dropped", "count": self.dropped}), *self.tail]


def _encoded(event: dict[str, Any]) -> dict[str, Any]:
    """The event as a `JournalEvent`. One the schema does not know (a bug: tests/unit/test_records.py checks
    every event the machines emit) is kept as it is rather than lost."""
    try:
        return journal_event(event)
    except (ValueError, TypeError) as exc:
        log.error("journal: event %s does not match the JournalEvent schema: %s", event.get("event"), exc)
        return event


async def _claim_settled(entry: _Entry) -> None:
    if entry.claiming is not None and not entry.claiming.done():
        await asyncio.shield(entry.claiming)


def _stamped(content: bytes) -> bytes:
    """The record's JSON with its `updated_at` (wall clock) appended."""
    return content[:-1] + b',"updated_at":' + str(round(time.time(), 6)).encode() + b"}"


class Journal:
    def __init__(
        self,
        store: Store,
        *,
        retention_seconds: float,
        gateway_id: str,
        max_events: int = 256,
        instance: str | None = None,
        progress_interval: float = 0.0,
        trace_clean_completions: float = 1.0,
        telemetry: Telemetry | None = None,
    ) -> None:
        self._store = store
        self._telemetry = telemetry  # spans and metrics: views of the same events
        self._max_events = max_events
        self._gateway_id = gateway_id
        self.instance = instance  # owner id of this gateway instance (None: no ownership, e.g. unit tests)
        self._progress_interval = progress_interval
        self._trace_clean_completions = trace_clean_completions
        self._entries: dict[LogicalRequest, _Entry] = {}  # by identity: one id may be re-run
        self._leases = RetentionLeases(store, retention_seconds)

    async def claim(self, request: LogicalRequest, *, patient: bool = True) -> None:
        """Create the record if the id is free (or held by a failed run that delivered nothing).

        Raises ClaimConflict when another logical request holds the id (nothing of this one is ever written
        then); StoreUnavailable when etcd is down. The other writes of the request may be asked for while the
        claim is in flight (it runs beside the first attempt): they wait for it. `patient`: on an etcd
        cluster, an unavailable etcd is tried again for CLAIM_PATIENCE_SECONDS (an election) before giving up.
        """
        entry = self.begin(request)
        assert entry.claiming is not None
        try:
            await self._claim(request, entry, patient=patient)
        except (ClaimConflict, StoreUnavailable):
            raise
        except BaseException:
            # Cancelled (shutdown) or a bug: whether the record was created is unknown, so this run writes
            # nothing more rather than risk overwriting another run's record.
            entry.lost = True
            raise
        finally:
            if not entry.claiming.done():
                entry.claiming.set_result(None)

    def begin(self, request: LogicalRequest) -> _Entry:
        """The request's entry, its claim about to start: the writes asked for from now on wait for the claim,
        and its first events (request_accepted) reach the telemetry at once (its span, its trace id)."""
        entry = self._entry(request)
        if entry.claiming is None:
            entry.claiming = asyncio.get_running_loop().create_future()
            self._take_events(request, entry)
        return entry

    async def _claim(self, request: LogicalRequest, entry: _Entry, *, patient: bool) -> None:
        self._take_events(request, entry)
        key = keys.request(request.tenant, request.request_id)
        # What the record says and whether it is indexed as in flight are decided once, together: every try
        # writes the same (a request that ends meanwhile is written so by its later writes).
        content = self._content(request, entry)
        value = _stamped(content)
        indexed = self._indexed(request)
        patience = time.monotonic() + (CLAIM_PATIENCE_SECONDS if patient and self._store.replicated else 0.0)
        while True:
            started = time.perf_counter()
            try:
                lease = await self._leases.current()
                index = [Put(self._index_key(request), b"", lease)] if indexed else []
                existing = await self._store.create(key, value, lease, also=index)
                break
            except StoreUnavailable:
                self._written("claim", started, ok=False)
                if time.monotonic() >= patience:
                    raise
            # Jittered: the claims of one moment do not all come back at once.
            await asyncio.sleep(CLAIM_RETRY_INTERVAL_SECONDS * random.uniform(0.5, 1.5))
        self._written("claim", started, ok=True)
        # Only once etcd confirmed the create: a write conditional on an entry that never came to be would be
        # refused for good. (If etcd took it but its answer was lost, the entry outlives the request until a
        # sweep after this instance is gone, or its retention: harmless.) Our own value found: an earlier try
        # was taken though its answer was lost (the value is stamped, so no other run's is equal to it).
        if existing is None or existing == value:
            entry.in_flight_indexed, entry.written = indexed, content
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
            and await self._store.replace(key, existing, value, lease, also=index)
        ):
            entry.in_flight_indexed, entry.written = indexed, content
            return
        # The id belongs to someone else: write nothing of this run, ever. The entry stays (until `release`)
        # so that a write asked for meanwhile finds it lost rather than creating a record.
        entry.lost = True
        if self._telemetry is not None:
            self._telemetry.forget(request)
        raise ClaimConflict(record)

    async def record_rejected(
        self,
        tenant: str,
        request_id: str,
        *,
        route: str,
        outcome: str,
        status: int,
        reason: str,
        details: str | None = None,
        phase: Phase = Phase.REJECTED,
        destinations: Destinations | None = None,
    ) -> bool:
        """Journal a request that another filter answered before any stream of ours saw it (behind an
        endpoint picker: its own 503 or 429, or the picker unreachable), from Envoy's access log: one terminal
        record, phase `rejected`, no attempt, with a `request_rejected` event, so that the client finds it by
        the id it got. Created only where the id is free (never over another run's record), under the
        retention lease; returns whether this call wrote it. Raises StoreUnavailable (after the claim's
        patience on a cluster)."""
        detail: dict[str, Any] = {"reason": reason, "code": outcome, "status": status}
        if details:
            detail["details"] = details
        event = Event(EventName.REQUEST_REJECTED, detail=detail)
        message = rejected_record(request_id, route=route, outcome=outcome, phase=phase)
        if destinations is not None:  # where it could not go, and why
            message.destinations.CopyFrom(destinations_record(destinations))
        message.gateway = self._gateway_id
        if self.instance is not None:
            message.owner = self.instance
        record = codec.to_dict(message)
        del record["updated_at"]  # stamped when written
        record["events"] = [_encoded(event.as_record(time.time()))]
        value = _stamped(json.dumps(record, separators=(",", ":")).encode())
        key = keys.request(tenant, request_id)
        patience = time.monotonic() + (CLAIM_PATIENCE_SECONDS if self._store.replicated else 0.0)
        while True:
            started = time.perf_counter()
            try:
                lease = await self._leases.current()
                existing = await self._store.create(key, value, lease)
                break
            except StoreUnavailable:
                self._written("rejected", started, ok=False)
                if time.monotonic() >= patience:
                    raise
            await asyncio.sleep(CLAIM_RETRY_INTERVAL_SECONDS * random.uniform(0.5, 1.5))
        self._written("rejected", started, ok=True)
        return existing is None or existing == value

    async def write_ahead(self, request: LogicalRequest) -> None:
        """Persist the current state and return only once it is durable (raises StoreUnavailable)."""
        entry = self._entry(request)
        self._take_events(request, entry)
        async with entry.lock:
            entry.dirty = False
            await self._put(request, entry, "write_ahead")

    def update(self, request: LogicalRequest) -> None:
        """Take the request's new events (stamped now); persist in the background (coalesced; errors are
        logged, not raised) if a progress write is due. Otherwise the next write carries them. Nothing once
        the request was released (a placement's late news about a finished request)."""
        entry = self._entries.get(request)
        if entry is None:
            return
        self._take_events(request, entry)
        if entry.finished or self._progress_due(request, entry):
            self._schedule(request, entry)

    async def finish(self, request: LogicalRequest) -> None:
        """The request's stream is over: write its final state now; if etcd does not take it, keep trying
        in the background (the record would otherwise stay at whatever the last write said). What the other
        placement learns later (e.g. that its release lost a race with a reset) is written as it comes."""
        entry = self._entry(request)
        entry.finished = True
        await _claim_settled(entry)  # a run refused by its claim is not counted, nor traced
        self._take_events(request, entry)
        if self._telemetry is not None and not entry.lost:
            self._telemetry.finished(request)
        try:
            async with entry.lock:
                entry.dirty = False
                await self._put(request, entry, "finish")
        except RecordTaken:
            pass  # logged; the record is another instance's now
        except StoreUnavailable as exc:
            log.error(
                "journal: could not record the end of request %s (will retry): %s", request.request_id, exc
            )
            self._schedule(request, entry)

    def _schedule(self, request: LogicalRequest, entry: _Entry) -> None:
        if entry.dirty:
            return
        entry.dirty = True
        asyncio.get_running_loop().create_task(self._flush(request, entry))

    def progress(self, request: LogicalRequest) -> None:
        """A chunk went out: rewrite the record if its progress interval has passed (cheap otherwise)."""
        if self._progress_interval > 0:
            entry = self._entries.get(request)
            if entry is not None and self._progress_due(request, entry):
                self._take_events(request, entry)
                self._schedule(request, entry)

    def _progress_due(self, request: LogicalRequest, entry: _Entry) -> bool:
        return (
            self._progress_interval > 0
            and request.first_delta_sent
            and time.monotonic() - entry.written_at >= self._progress_interval
        )

    def release(self, request: LogicalRequest) -> None:
        """The request is done on this gateway: its entry goes after a grace period in which the other
        placement's late news is still written (then nothing more is)."""
        entry = self._entries.get(request)
        if entry is None or entry.released:
            return
        entry.released = True
        asyncio.get_running_loop().call_later(LATE_NEWS_SECONDS, self._forget, request, entry)

    def _forget(self, request: LogicalRequest, entry: _Entry) -> None:
        if entry.dirty or entry.lock.locked():  # a write still going (or retrying): after it
            asyncio.get_running_loop().call_later(LATE_NEWS_SECONDS, self._forget, request, entry)
        elif self._entries.get(request) is entry:
            del self._entries[request]

    async def lookup(self, tenant: str, request_id: str) -> dict[str, Any] | None:
        raw = await self._store.get(keys.request(tenant, request_id))
        return None if raw is None else json.loads(raw)

    async def response_holder(self, tenant: str, response_id: str) -> str | None:
        """The replica that holds a stored Responses API response of this tenant (None: not known here)."""
        raw = await self._store.get(keys.stored_response(tenant, response_id))
        if raw is None:
            return None
        try:
            replica = json.loads(raw).get("replica")
        except (ValueError, AttributeError):
            return None  # not ours to read: treated as unknown
        return replica if isinstance(replica, str) else None

    async def _flush(self, request: LogicalRequest, entry: _Entry) -> None:
        async with entry.lock:
            if not entry.dirty:
                return
            entry.dirty = False
            try:
                await self._put(request, entry, "finish" if entry.finished else "progress")
                entry.failures = 0
            except RecordTaken:
                pass  # logged; nothing more is written
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

    async def _put(self, request: LogicalRequest, entry: _Entry, kind: str) -> None:
        await _claim_settled(entry)  # the claim creates the record; nothing may before it
        if entry.lost:
            return
        entry.written_at = time.monotonic()  # also when nothing is new: progress writes stay spaced
        content = self._content(request, entry)
        ends = entry.in_flight_indexed and request.phase in TERMINAL_PHASES
        if content == entry.written and not ends:
            return  # nothing new to say
        value = _stamped(content)
        lease = await self._leases.current()
        also: list[Put | Delete] = [Delete(self._index_key(request))] if ends else []
        stored = request.stored_response
        if stored is not None and not entry.response_indexed:
            # Which replica holds the response, for any gateway instance to send its follow-ups to; kept as
            # long as the record.
            holder = {"replica": stored[1], "request_id": request.request_id}
            also.append(
                Put(keys.stored_response(request.tenant, stored[0]), json.dumps(holder).encode(), lease)
            )
        # While its index entry exists the record is ours; once another instance closed it (and removed the
        # entry), writing would reopen or contradict what it recorded.
        present = self._index_key(request) if entry.in_flight_indexed else None
        key = keys.request(request.tenant, request.request_id)
        started = time.perf_counter()
        try:
            taken = not await self._store.put(key, value, lease, also=also, present=present)
        except StoreUnavailable:
            self._written(kind, started, ok=False)
            raise
        self._written(kind, started, ok=True)
        if taken:
            entry.lost, entry.in_flight_indexed = True, False
            log.error(
                "journal: request %s was closed by another gateway instance (this one was taken for lost); "
                "its record stays as that instance wrote it",
                request.request_id,
            )
            raise RecordTaken(f"request {request.request_id} was closed by another gateway instance")
        entry.written = content
        entry.response_indexed = entry.response_indexed or stored is not None
        if ends:
            entry.in_flight_indexed = False

    def _written(self, kind: str, started: float, *, ok: bool) -> None:
        if self._telemetry is not None:
            self._telemetry.journal_written(kind, time.perf_counter() - started, ok)

    def _index_key(self, request: LogicalRequest) -> str:
        assert self.instance is not None
        return keys.in_flight(self.instance, request.tenant, request.request_id)

    def _indexed(self, request: LogicalRequest) -> bool:
        """A record is indexed as in flight under its owner until it ends (with ownership only)."""
        return self.instance is not None and request.phase not in TERMINAL_PHASES

    def serves(self, request: LogicalRequest) -> bool:
        """The record is this run's: claimed (not refused by its claim, or still claiming), and not closed by
        another instance."""
        entry = self._entries.get(request)
        if entry is None or entry.lost:
            return False
        return entry.claiming is None or entry.claiming.done()

    def view(self, request: LogicalRequest) -> dict[str, Any]:
        """The record as it would be stored now (for look-ups of requests still in flight here)."""
        entry = self._entry(request)
        self._take_events(request, entry)
        record = self._record(request, entry)
        record["updated_at"] = round(time.time(), 6)
        return record

    def _record(self, request: LogicalRequest, entry: _Entry) -> dict[str, Any]:
        message = journal_record(request)
        message.gateway = self._gateway_id
        if self.instance is not None:
            message.owner = self.instance
        record = codec.to_dict(message)
        del record["updated_at"]  # stamped when written
        record["events"] = entry.trace()  # each event was encoded once, when it was drained
        return record

    def _content(self, request: LogicalRequest, entry: _Entry) -> bytes:
        """The record as JSON, without its `updated_at`."""
        record = self._record(request, entry)
        if self._compact(request):
            # What an operator needs of a clean completion is in the summary; the trace is kept for the rest.
            record["events"] = []
            record["trace"] = "omitted: clean completion (journal.trace_clean_completions)"
        return json.dumps(record, separators=(",", ":")).encode()

    def _compact(self, request: LogicalRequest) -> bool:
        if request.phase is not Phase.COMPLETED or len(request.attempts) != 1 or request.tool_calls:
            return False
        if self._trace_clean_completions >= 1:
            return False
        # Sampled by request id: the same request is kept (or not) on every write and every gateway.
        sample = int.from_bytes(hashlib.blake2b(request.request_id.encode(), digest_size=4).digest()) / 2**32
        return sample >= self._trace_clean_completions

    def _take_events(self, request: LogicalRequest, entry: _Entry) -> None:
        events = request.drain_events()
        if not events or entry.lost:
            return
        now = time.time()
        records = [event.as_record(now) for event in events]
        entry.add([_encoded(record) for record in records])
        if self._telemetry is not None:
            self._telemetry.observe(request, records)

    def _entry(self, request: LogicalRequest) -> _Entry:
        entry = self._entries.get(request)
        if entry is None:
            entry = self._entries[request] = _Entry(self._max_events)
        return entry
