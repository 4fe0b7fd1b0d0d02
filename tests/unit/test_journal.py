"""The request journal over the `Store` interface (MemoryStore: no etcd).

Async code runs under `asyncio.run` inside each test: the project has no pytest async plugin.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from router_sidecar.coordination.journal import ClaimConflict, Journal
from router_sidecar.coordination.store import Lease, MemoryStore, keys
from router_sidecar.core.attempt import AttemptFailed, FailureReason
from router_sidecar.core.openai_api import RouteKind, parse_request
from router_sidecar.core.policy import DEFAULT_POLICY
from router_sidecar.core.request import DownstreamLoss, LogicalRequest
from router_sidecar.core.sse import DONE_EVENT

SSE = "text/event-stream"
CONTENT = b'data: {"choices":[{"index":0,"delta":{"content":"Hi"},"finish_reason":null}]}\n\n'
FINISH = b'data: {"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}\n\n'
LOST = AttemptFailed(FailureReason.CONNECTION_LOST, "lost")


class SlowStore(MemoryStore):
    """A MemoryStore whose calls suspend like network calls, and that counts its writes."""

    def __init__(self) -> None:
        super().__init__()
        self.puts: list[tuple[str, dict[str, Any]]] = []

    async def create(self, key: str, value: bytes, lease: Lease | None = None) -> bytes | None:
        await asyncio.sleep(0)
        return await super().create(key, value, lease)

    async def put(self, key: str, value: bytes, lease: Lease | None = None) -> None:
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        self.puts.append((key, json.loads(value)))
        await super().put(key, value, lease)


def request(request_id: str = "idem-1", tenant: str = "tenant-a", model: str = "tiny") -> LogicalRequest:
    body = json.dumps({"model": model, "stream": True, "messages": [{"role": "user", "content": "hi"}]})
    parsed = parse_request(RouteKind.CHAT, body.encode(), max_body_bytes=1 << 20, known_models=None)
    return LogicalRequest(request_id=request_id, tenant=tenant, parsed=parsed, policy=DEFAULT_POLICY)


def journal(store: MemoryStore, gateway: str = "gw-1") -> Journal:
    return Journal(store, retention_seconds=3600, gateway_id=gateway)


def run(test: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(asyncio.wait_for(test(), 2))


async def settle() -> None:
    """Let every background flush finish."""
    for _ in range(50):
        await asyncio.sleep(0)


def stored(store: MemoryStore, tenant: str, request_id: str) -> dict[str, Any]:
    return json.loads(store.data[keys.request(tenant, request_id)])


def event_names(record: dict[str, Any]) -> list[str]:
    return [e["event"] for e in record["events"]]


# --- the terminal states a first run can end in ----------------------------------------------------------


def _failed_before_content(r: LogicalRequest) -> None:
    for n in (1, 2):
        r.on_attempt_failed(r.begin_attempt(f"a{n}", "r"), LOST)


def _completed(r: LogicalRequest) -> None:
    r.on_attempt_released(r.begin_attempt("a1", "r"), first_delta=True)
    r.on_response_headers(200, SSE)
    r.on_response_body(CONTENT + FINISH + DONE_EVENT, True)


def _interrupted(r: LogicalRequest) -> None:
    r.on_attempt_released(r.begin_attempt("a1", "r"), first_delta=True)
    r.on_response_headers(200, SSE)
    r.on_response_body(CONTENT, False)
    r.on_response_body(b"", True)


def _in_decode(r: LogicalRequest) -> None:
    r.on_attempt_released(r.begin_attempt("a1", "r"), first_delta=True)
    r.on_response_headers(200, SSE)
    r.on_response_body(CONTENT, False)


def _in_prefill(r: LogicalRequest) -> None:
    r.begin_attempt("a1", "r")


def _cancelled_in_prefill(r: LogicalRequest) -> None:
    r.begin_attempt("a1", "r")
    r.on_downstream_lost(DownstreamLoss.CLIENT_GONE)


def _cancelled_in_decode(r: LogicalRequest) -> None:
    _in_decode(r)
    r.on_downstream_lost(DownstreamLoss.CLIENT_GONE)


# (first run's story, phase it ends in, may the id be claimed again, in_flight of the conflict)
CLAIMS = [
    (None, "prefill", False, True),  # just claimed, nothing else happened
    (_in_prefill, "prefill", False, True),
    (_in_decode, "decode", False, True),
    (_failed_before_content, "failed", True, None),
    (_completed, "completed", False, False),
    (_interrupted, "interrupted", False, False),
    (_cancelled_in_prefill, "cancelled", False, False),
    (_cancelled_in_decode, "cancelled", False, False),
]


@pytest.mark.parametrize(
    ("story", "phase", "reclaimable", "in_flight"),
    CLAIMS,
    ids=[
        "claimed",
        "prefill",
        "decode",
        "failed",
        "completed",
        "interrupted",
        "cancelled_prefill",
        "cancelled_decode",
    ],
)
def test_second_claim_of_same_tenant_and_id(
    story: Callable[[LogicalRequest], None] | None, phase: str, reclaimable: bool, in_flight: bool | None
) -> None:
    async def go() -> None:
        store = MemoryStore()
        j = journal(store)
        first = request(model="first")
        await j.claim(first)
        if story is not None:
            story(first)
            await j.write_ahead(first)
        assert stored(store, "tenant-a", "idem-1")["phase"] == phase
        # A second gateway instance sharing the store (the in-process journal entry must not matter).
        second = request(model="second")
        other = journal(store, "gw-2")
        if reclaimable:
            await other.claim(second)
            record = stored(store, "tenant-a", "idem-1")
            assert (record["model"], record["phase"], record["attempt"], record["gateway"]) == (
                "second",
                "prefill",
                0,
                "gw-2",
            )
            assert event_names(record) == ["request_accepted"]
            return
        with pytest.raises(ClaimConflict) as info:
            await other.claim(second)
        assert info.value.in_flight is in_flight
        assert info.value.existing["model"] == "first"
        assert info.value.existing["phase"] == phase
        assert stored(store, "tenant-a", "idem-1")["model"] == "first"  # untouched

    run(go)


def test_claim_conflict_in_the_same_journal() -> None:
    async def go() -> None:
        store = MemoryStore()
        j = journal(store)
        await j.claim(request(model="first"))
        with pytest.raises(ClaimConflict) as info:
            await j.claim(request(model="second"))
        assert info.value.in_flight is True
        assert info.value.existing["request_id"] == "idem-1"
        assert stored(store, "tenant-a", "idem-1")["model"] == "first"

    run(go)


def test_failed_with_delivery_is_not_reclaimable() -> None:
    # A FAILED record that says content went out: the client saw something, so the id is spent.
    async def go() -> None:
        store = MemoryStore()
        key = keys.request("tenant-a", "idem-1")
        store.data[key] = json.dumps(
            {"request_id": "idem-1", "phase": "failed", "first_delta_sent": True}
        ).encode()
        with pytest.raises(ClaimConflict) as info:
            await journal(store).claim(request())
        assert info.value.in_flight is False
        assert json.loads(store.data[key])["first_delta_sent"] is True

    run(go)


def test_unreadable_existing_record_is_a_conflict() -> None:
    async def go() -> None:
        store = MemoryStore()
        store.data[keys.request("tenant-a", "idem-1")] = b"not json"
        with pytest.raises(ClaimConflict) as info:
            await journal(store).claim(request())
        assert info.value.in_flight is True  # unknown phase: the safe answer

    run(go)


# --- tenants never see each other's records -------------------------------------------------------------


def test_tenants_are_isolated() -> None:
    async def go() -> None:
        store = MemoryStore()
        j = journal(store)
        a = request(tenant="tenant-a", model="model-a")
        assert await j.lookup("tenant-b", "idem-1") is None
        await j.claim(a)
        assert await j.lookup("tenant-b", "idem-1") is None
        b = request(tenant="tenant-b", model="model-b")
        await j.claim(b)  # same id, other tenant: no conflict
        _completed(a)
        await j.write_ahead(a)
        found_a = await j.lookup("tenant-a", "idem-1")
        found_b = await j.lookup("tenant-b", "idem-1")
        assert found_a is not None and found_b is not None
        assert (found_a["model"], found_a["phase"]) == ("model-a", "completed")
        assert (found_b["model"], found_b["phase"]) == ("model-b", "prefill")
        assert event_names(found_b) == ["request_accepted"]
        assert await j.lookup("tenant-c", "idem-1") is None
        assert sorted(store.data) == [keys.request("tenant-a", "idem-1"), keys.request("tenant-b", "idem-1")]
        assert j.view(b)["model"] == "model-b" and j.view(a)["model"] == "model-a"

    run(go)


# --- write-ahead: durable before it returns ----------------------------------------------------------


def test_write_ahead_is_durable_before_it_returns() -> None:
    async def go() -> None:
        store = SlowStore()
        j = journal(store)
        r = request()
        await j.claim(r)
        record = r.begin_attempt("a1", "r1")
        j.update(r)  # a background flush in flight must not delay or reorder the write-ahead
        r.on_attempt_released(record, first_delta=True)
        await j.write_ahead(r)
        now = stored(store, "tenant-a", "idem-1")
        assert now["first_delta_sent"] is True
        assert now["attempts"] == [
            {
                "attempt": 1,
                "attempt_id": "a1",
                "replica": "r1",
                "outcome": "released",
                "detail": None,
                "lease": None,
                "fence": None,
            }
        ]
        assert event_names(now) == ["request_accepted", "attempt_started", "first_delta_sent"]
        await settle()
        assert stored(store, "tenant-a", "idem-1") == now  # the stale background write did not win

    run(go)


# --- update: background, coalesced, latest state wins, every event once -----------------------------------


def test_update_coalesces_to_latest_state() -> None:
    async def go() -> None:
        store = SlowStore()
        j = journal(store)
        r = request()
        await j.claim(r)
        assert store.puts == []  # the claim is a create, not a put
        # Many updates without yielding: one write, of the latest state.
        first = r.begin_attempt("a1", "r1")
        j.update(r)
        r.on_attempt_failed(first, LOST)
        j.update(r)
        second = r.begin_attempt("a2", "r2")
        j.update(r)
        r.on_attempt_released(second, first_delta=True)
        j.update(r)
        assert store.puts == []  # nothing written synchronously
        await settle()
        assert len(store.puts) == 1
        record = stored(store, "tenant-a", "idem-1")
        assert store.puts[0][1] == record
        assert (record["attempt"], record["first_delta_sent"], record["phase"]) == (2, True, "prefill")
        expected = [
            "request_accepted",
            "attempt_started",
            "attempt_failed",
            "retry_triggered",
            "attempt_started",
            "first_delta_sent",
        ]
        assert event_names(record) == expected
        # Updates while a write is in progress: one more write afterwards, still every event exactly once.
        r.on_response_headers(200, SSE)
        r.on_response_body(CONTENT, False)
        j.update(r)
        await asyncio.sleep(0)  # the flush has started and is suspended inside put
        r.on_response_body(FINISH + DONE_EVENT, True)
        j.update(r)
        j.update(r)
        await settle()
        assert len(store.puts) in (2, 3)
        record = stored(store, "tenant-a", "idem-1")
        assert (record["phase"], record["outcome"], record["delivered_output_tokens"]) == (
            "completed",
            "completed",
            1,
        )
        assert event_names(record) == [*expected, "stream_completed"]
        times = [e["t"] for e in record["events"]]
        assert times == sorted(times)
        assert [e.get("attempt") for e in record["events"]] == [None, 1, 1, 1, 2, 2, None]

    run(go)


def test_view_of_a_live_request() -> None:
    async def go() -> None:
        store = MemoryStore()
        j = journal(store, "gw-7")
        r = request()
        await j.claim(r)
        r.begin_attempt("a1", "r1")
        view = j.view(r)
        assert (view["gateway"], view["request_id"], view["attempt"]) == ("gw-7", "idem-1", 1)
        assert event_names(view) == ["request_accepted", "attempt_started"]
        # The view drained the events into the journal's trace: the next write carries them once.
        await j.write_ahead(r)
        assert event_names(stored(store, "tenant-a", "idem-1")) == ["request_accepted", "attempt_started"]

    run(go)


# --- regressions: races around claims of one id ---------------------------------------------------


def test_concurrent_reclaims_of_a_failed_id_admit_one() -> None:
    async def go() -> None:
        store = SlowStore()
        first = request(model="first")
        await journal(store).claim(first)
        _failed_before_content(first)
        await journal(store).write_ahead(first)
        results = await asyncio.gather(
            journal(store, "gw-1").claim(request(model="b1")),
            journal(store, "gw-2").claim(request(model="b2")),
            return_exceptions=True,
        )
        assert sorted(type(r).__name__ for r in results) == ["ClaimConflict", "NoneType"]

    run(go)


def test_claim_racing_a_finished_requests_flush_leaves_its_trace_alone() -> None:
    async def go() -> None:
        store = SlowStore()
        j = journal(store)
        first = request(model="first")
        await j.claim(first)
        _failed_before_content(first)  # 502 retries_exhausted to the client
        j.update(first)  # its final state is written in the background
        with contextlib.suppress(ClaimConflict):
            await j.claim(request(model="second"))  # the client asks again at once, same key
        await settle()
        record = stored(store, "tenant-a", "idem-1")
        assert record["model"] == "first"
        assert event_names(record).count("request_accepted") == 1

    run(go)
