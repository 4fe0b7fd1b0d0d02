"""The request journal over the `Store` interface (MemoryStore: no etcd), with requests built through the
machines (the attempt machine, the retry gate and the logical-request machine).

Async code runs under `asyncio.run` inside each test: the project has no pytest async plugin.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from router_sidecar.coordination import journal as journal_module
from router_sidecar.coordination.journal import ClaimConflict, Journal, RecordTaken
from router_sidecar.coordination.store import Also, Lease, MemoryStore, StoreUnavailable, keys
from router_sidecar.core.attempt import (
    FenceProven,
    ResponseBody,
    ResponseHeaders,
    StreamReset,
    TriggerRetry,
)
from router_sidecar.core.events import EventName
from router_sidecar.core.openai_api import MAX_MODEL_NAME_CHARS, RouteKind, parse_request
from router_sidecar.core.policy import DEFAULT_POLICY, Policy, policy_from_mapping
from router_sidecar.core.request import (
    DeadlineReached,
    DownstreamLoss,
    DownstreamLost,
    LogicalRequest,
    ResponseChunk,
    ResponseStarted,
    Terminate,
    ToolCallNoted,
    WriteAheadJournal,
)
from router_sidecar.core.sse import DONE_EVENT
from tests.unit.test_records import validate
from tests.unit.test_request import SSE, begin, fa, failed, released, started

CONTENT = b'data: {"choices":[{"index":0,"delta":{"content":"Hi"},"finish_reason":null}]}\n\n'
FINISH = b'data: {"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}\n\n'


class SlowStore(MemoryStore):
    """A MemoryStore whose calls suspend like network calls, and that counts its writes."""

    def __init__(self) -> None:
        super().__init__()
        self.puts: list[tuple[str, dict[str, Any]]] = []

    async def create(
        self, key: str, value: bytes, lease: Lease | None = None, *, also: Also = ()
    ) -> bytes | None:
        await asyncio.sleep(0)
        return await super().create(key, value, lease, also=also)

    async def put(
        self,
        key: str,
        value: bytes,
        lease: Lease | None = None,
        *,
        also: Also = (),
        present: str | None = None,
    ) -> bool:
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        self.puts.append((key, json.loads(value)))
        return await super().put(key, value, lease, also=also, present=present)


def request(
    request_id: str = "idem-1", tenant: str = "tenant-a", model: str = "tiny", policy: Policy = DEFAULT_POLICY
) -> LogicalRequest:
    body = json.dumps({"model": model, "stream": True, "messages": [{"role": "user", "content": "hi"}]})
    parsed = parse_request(RouteKind.CHAT, body.encode(), max_body_bytes=1 << 20, known_models=None)
    return LogicalRequest(request_id=request_id, tenant=tenant, parsed=parsed, policy=policy)


def journal(store: MemoryStore, gateway: str = "gw-1", max_events: int = 256) -> Journal:
    return Journal(store, retention_seconds=3600, gateway_id=gateway, max_events=max_events)


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


def chunk(r: LogicalRequest, data: bytes, eos: bool) -> None:
    r.handle(ResponseChunk(data, eos))


# --- the states a first run can be in or end in ----------------------------------------------------------


def _failed_before_content(r: LogicalRequest) -> None:
    for n in (1, 2):
        failed(r, attempt_id=f"a{n}")


def _completed(r: LogicalRequest) -> None:
    released(r, "a1", "r")
    started(r)
    chunk(r, CONTENT + FINISH + DONE_EVENT, True)


def _interrupted(r: LogicalRequest) -> None:
    released(r, "a1", "r")
    started(r)
    chunk(r, CONTENT, False)
    [end] = r.handle(ResponseChunk(b"", True))
    assert isinstance(end, Terminate)


def _in_decode(r: LogicalRequest) -> None:
    released(r, "a1", "r")
    started(r)
    chunk(r, CONTENT, False)


def _writing_ahead(r: LogicalRequest) -> None:
    attempt = begin(r, "a1", "r")
    fa(r, attempt, ResponseHeaders(200, SSE))
    assert fa(r, attempt, ResponseBody(CONTENT, False)) == [WriteAheadJournal("a1")]


def _in_prefill(r: LogicalRequest) -> None:
    begin(r, "a1", "r")


def _cancelled_in_prefill(r: LogicalRequest) -> None:
    begin(r, "a1", "r")
    r.handle(DownstreamLost(DownstreamLoss.CLIENT_GONE))


def _cancelled_in_decode(r: LogicalRequest) -> None:
    _in_decode(r)
    r.handle(DownstreamLost(DownstreamLoss.CLIENT_GONE))


def _replaced(r: LogicalRequest) -> None:
    # Our retry 503 came back: Envoy's retry budget refused the retry; the client got our JSON error.
    failed(r, attempt_id="a1")
    r.handle(ResponseStarted(503, "text/plain", frozenset({"UO"}), "via_upstream"))


def _deadline_before_content(r: LogicalRequest) -> None:
    begin(r, "a1", "r")
    r.handle(DeadlineReached())


# (first run's story, phase it ends in, may the id be claimed again, in_flight of the conflict)
CLAIMS: list[tuple[str, Callable[[LogicalRequest], None] | None, str, bool, bool | None]] = [
    ("claimed", None, "prefill", False, True),  # just claimed, nothing else happened
    ("prefill", _in_prefill, "prefill", False, True),
    ("writing_ahead", _writing_ahead, "prefill", False, True),
    ("decode", _in_decode, "decode", False, True),
    ("failed", _failed_before_content, "failed", True, None),
    ("replaced", _replaced, "failed", True, None),
    ("deadline_before_content", _deadline_before_content, "failed", True, None),
    ("completed", _completed, "completed", False, False),
    ("interrupted", _interrupted, "interrupted", False, False),
    ("cancelled_prefill", _cancelled_in_prefill, "cancelled", False, False),
    ("cancelled_decode", _cancelled_in_decode, "cancelled", False, False),
]


@pytest.mark.parametrize(
    ("story", "phase", "reclaimable", "in_flight"), [c[1:] for c in CLAIMS], ids=[c[0] for c in CLAIMS]
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


class ElectingStore(MemoryStore):
    """A replicated store whose first creates fail as during a leader election: `lost_answers` of them are
    taken but their answer is lost, then `refused` are not taken at all."""

    replicated = True

    def __init__(self, *, lost_answers: int = 0, refused: int = 0) -> None:
        super().__init__()
        self.lost_answers, self.refused, self.tries = lost_answers, refused, 0

    async def create(
        self, key: str, value: bytes, lease: Lease | None = None, *, also: Also = ()
    ) -> bytes | None:
        self.tries += 1
        if self.lost_answers:
            self.lost_answers -= 1
            await super().create(key, value, lease, also=also)
            raise StoreUnavailable("the answer was lost")
        if self.refused:
            self.refused -= 1
            raise StoreUnavailable("etcdserver: no leader")
        return await super().create(key, value, lease, also=also)


def test_a_claim_on_a_cluster_waits_out_an_election(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(journal_module, "CLAIM_RETRY_INTERVAL_SECONDS", 0)

    async def go() -> None:
        store = ElectingStore(refused=2)
        await journal(store).claim(request())
        assert store.tries == 3 and stored(store, "tenant-a", "idem-1")["phase"] == "prefill"

    run(go)


def test_a_claim_taken_though_its_answer_was_lost_is_ours(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(journal_module, "CLAIM_RETRY_INTERVAL_SECONDS", 0)

    async def go() -> None:
        store = ElectingStore(lost_answers=1)
        j = journal(store)
        await j.claim(request())  # the second try finds its own record: no ClaimConflict
        assert store.tries == 2
        with pytest.raises(ClaimConflict):  # while another run of the id still conflicts
            await j.claim(request(model="second"))

    run(go)


def test_a_claim_on_a_cluster_gives_up_after_its_patience(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(journal_module, "CLAIM_RETRY_INTERVAL_SECONDS", 0)
    monkeypatch.setattr(journal_module, "CLAIM_PATIENCE_SECONDS", 0.05)

    async def go() -> None:
        store = ElectingStore(refused=10**9)
        with pytest.raises(StoreUnavailable):
            await journal(store).claim(request())
        assert store.tries > 1

    run(go)


def test_a_request_that_ends_while_its_claim_is_tried_again_keeps_its_index_consistent(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The record and its in-flight index entry are decided together, once: a request that ends between two
    tries is created with its index entry (as it was when the claim began), and its end removes it."""
    monkeypatch.setattr(journal_module, "CLAIM_RETRY_INTERVAL_SECONDS", 0)

    async def go() -> None:
        store = ElectingStore(refused=2)
        j = Journal(store, retention_seconds=3600, gateway_id="gw-1", instance="gw-1~0001")
        r = request()
        index_key = keys.in_flight("gw-1~0001", "tenant-a", "idem-1")
        tried = store.create

        async def create(
            key: str, value: bytes, lease: Lease | None = None, *, also: Also = ()
        ) -> bytes | None:
            if store.tries == 1:
                _failed_before_content(r)  # the request ends while its claim waits for etcd
            return await tried(key, value, lease, also=also)

        store.create = create  # type: ignore[method-assign]
        await j.claim(r)
        assert store.tries == 3 and index_key in store.data
        await j.finish(r)
        assert index_key not in store.data and stored(store, "tenant-a", "idem-1")["phase"] == "failed"

    run(go)


def test_a_claim_cancelled_while_it_waits_for_etcd_writes_nothing_more(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(journal_module, "CLAIM_RETRY_INTERVAL_SECONDS", 0.05)

    async def go() -> None:
        store = ElectingStore(refused=10**9)
        j = journal(store)
        r = request()
        claim = asyncio.create_task(j.claim(r))
        while store.tries < 2:
            await asyncio.sleep(0.01)
        claim.cancel()
        with pytest.raises(asyncio.CancelledError):
            await claim
        store.refused = 0
        await j.write_ahead(r)  # waits for the claim, finds the run lost: writes nothing
        assert keys.request("tenant-a", "idem-1") not in store.data

    run(go)


def test_one_retention_lease_for_claims_that_ask_at_once() -> None:
    async def go() -> None:
        store = SlowStore()
        j = journal(store)
        grants = 0
        grant = store.grant_lease

        async def counting_grant(ttl_seconds: int) -> Lease:
            nonlocal grants
            grants += 1
            await asyncio.sleep(0)
            return await grant(ttl_seconds)

        store.grant_lease = counting_grant  # type: ignore[method-assign]
        await asyncio.gather(*(j.claim(request(request_id=f"id-{n}")) for n in range(20)))
        assert grants == 1

    run(go)


def test_a_claim_on_one_etcd_fails_at_once() -> None:
    async def go() -> None:
        store = ElectingStore(refused=1)
        store.replicated = False
        with pytest.raises(StoreUnavailable):
            await journal(store).claim(request())
        assert store.tries == 1

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
        attempt = begin(r, "a1", "r1")
        j.update(r)  # a background flush in flight must not delay or reorder the write-ahead
        fa(r, attempt, ResponseHeaders(200, SSE))
        assert fa(r, attempt, ResponseBody(CONTENT, False)) == [WriteAheadJournal("a1")]
        await j.write_ahead(r)
        now = stored(store, "tenant-a", "idem-1")
        assert now["first_delta_sent"] is True
        assert now["attempts"] == [
            {
                "attempt": 1,
                "attempt_id": "a1",
                "replica": "r1",
                "outcome": "writing_ahead",
                "detail": None,
                "status": 200,
                "lease": None,
                "fence": None,
            }
        ]
        assert event_names(now) == ["request_accepted", "attempt_started", "headers_held", "first_delta_sent"]
        await settle()
        assert stored(store, "tenant-a", "idem-1") == now  # the stale background write did not win

    run(go)


# --- update: background, coalesced, latest state wins, every event once -----------------------------------


def test_updates_before_the_end_wait_for_the_next_durable_write() -> None:
    async def go() -> None:
        store = SlowStore()
        j = journal(store)
        r = request()
        await j.claim(r)
        assert store.puts == []  # the claim is a create, not a put
        # Attempts, a failure, a retry: nothing needs to be durable yet (three writes per request).
        first = begin(r, "a1", "r1")
        j.update(r)
        fa(r, first, ResponseHeaders(200, SSE))
        fa(r, first, StreamReset())
        assert first.failure is not None and isinstance(first.verdict, TriggerRetry)
        j.update(r)
        fa(r, first, FenceProven("connection_closed"))
        released(r, "a2", "r2")
        j.update(r)
        await settle()
        assert store.puts == []
        # The write-ahead carries all of it, every event once.
        await j.write_ahead(r)
        assert len(store.puts) == 1
        record = stored(store, "tenant-a", "idem-1")
        assert (record["attempt"], record["first_delta_sent"], record["phase"]) == (2, True, "prefill")
        expected = [
            "request_accepted",
            "attempt_started",
            "headers_held",
            "attempt_failed",
            "retry_triggered",
            "attempt_started",
            "headers_held",
            "first_delta_sent",
        ]
        assert event_names(record) == expected
        # Streaming: no write per chunk (the progress interval is 0 here: never).
        started(r)
        chunk(r, CONTENT, False)
        j.progress(r)
        j.update(r)
        await settle()
        assert len(store.puts) == 1
        # The end: updates stamp its events; `finish` writes it, once (the same state again is not rewritten).
        chunk(r, FINISH + DONE_EVENT, True)
        j.update(r)
        await settle()
        assert len(store.puts) == 1
        await asyncio.gather(j.finish(r), j.finish(r))
        await settle()
        assert len(store.puts) == 2
        record = stored(store, "tenant-a", "idem-1")
        assert (record["phase"], record["outcome"], record["delivered_output_tokens"]) == (
            "completed",
            "completed",
            1,
        )
        assert event_names(record) == [*expected, "stream_completed"]
        times = [e["t"] for e in record["events"]]
        assert times == sorted(times)
        assert [e.get("attempt") for e in record["events"]] == [None, 1, 1, 1, 1, 2, 2, 2, None]
        assert [(a["attempt"], a["outcome"]) for a in record["attempts"]] == [(1, "failed"), (2, "completed")]

    run(go)


def test_a_long_stream_is_rewritten_every_progress_interval() -> None:
    async def go() -> None:
        store = SlowStore()
        j = Journal(store, retention_seconds=3600, gateway_id="gw-1", progress_interval=1e-9)
        r = request()
        await j.claim(r)
        released(r, "a1", "r")
        await j.write_ahead(r)
        started(r)
        for _ in range(3):
            chunk(r, CONTENT, False)
            j.progress(r)
            await settle()
        assert [p[1]["delivered_output_tokens"] for p in store.puts] == [0, 1, 2, 3]
        assert store.puts[-1][1]["phase"] == "decode"

    run(go)


@pytest.mark.parametrize(
    ("sample", "story", "keeps_trace"),
    [
        (0.0, _completed, False),
        (1.0, _completed, True),
        (0.0, _interrupted, True),
        (0.0, _cancelled_in_decode, True),
        (0.0, _failed_before_content, True),
    ],
)
def test_clean_completions_keep_the_summary_only_unless_sampled(
    sample: float, story: Callable[[LogicalRequest], None], keeps_trace: bool
) -> None:
    async def go() -> None:
        store = MemoryStore()
        j = Journal(store, retention_seconds=3600, gateway_id="gw-1", trace_clean_completions=sample)
        r = request()
        await j.claim(r)
        story(r)
        await j.write_ahead(r)
        record = stored(store, "tenant-a", "idem-1")
        assert bool(record["events"]) is keeps_trace
        assert ("trace" in record) is not keeps_trace
        assert record["attempts"] and record["phase"] == r.phase.value

    run(go)


def test_view_of_a_live_request() -> None:
    async def go() -> None:
        store = MemoryStore()
        j = journal(store, "gw-7")
        r = request()
        await j.claim(r)
        begin(r, "a1", "r1")
        view = j.view(r)
        assert (view["gateway"], view["request_id"], view["attempt"]) == ("gw-7", "idem-1", 1)
        assert event_names(view) == ["request_accepted", "attempt_started"]
        # The view drained the events into the journal's trace: the next write carries them once.
        await j.write_ahead(r)
        assert event_names(stored(store, "tenant-a", "idem-1")) == ["request_accepted", "attempt_started"]

    run(go)


# --- the record stays bounded whatever the request did --------------------------------------------------


def _tool_event(n: int, key: str = "k") -> ToolCallNoted:
    return ToolCallNoted(EventName.TOOL_CALL_REPLAYED, key, 1, {"status": n})


def test_trace_keeps_the_first_and_last_events_and_counts_the_dropped() -> None:
    policy = policy_from_mapping({"journal": {"max_events": 32}})
    max_events = policy.journal.max_events

    async def go() -> None:
        store = MemoryStore()
        j = journal(store, max_events=max_events)
        r = request(policy=policy)
        await j.claim(r)  # request_accepted
        for batch in range(4):  # drained in several batches, as the shell does
            for n in range(batch * 25, batch * 25 + 25):
                r.handle(_tool_event(n))
            j.view(r)
        await j.write_ahead(r)
        events = stored(store, "tenant-a", "idem-1")["events"]
        emitted = 1 + 100
        assert len(events) == max_events + 1  # the kept ones and the marker
        head, marker, tail = events[:16], events[16], events[17:]
        assert head[0]["event"] == "request_accepted"
        assert [e["status"] for e in head[1:]] == list(range(15))
        assert marker == {"event": "events_dropped", "count": emitted - max_events}
        assert [e["status"] for e in tail] == list(range(100 - 16, 100))  # the last ones, in order

    run(go)


def test_trace_within_the_bound_is_whole() -> None:
    async def go() -> None:
        store = MemoryStore()
        j = journal(store, max_events=32)
        r = request()
        await j.claim(r)
        for n in range(31):
            r.handle(_tool_event(n))
        await j.write_ahead(r)
        events = stored(store, "tenant-a", "idem-1")["events"]
        assert len(events) == 32
        assert "events_dropped" not in event_names({"events": events})

    run(go)


def test_thousands_of_tool_calls_still_encode_far_below_one_mib() -> None:
    async def go() -> None:
        store = MemoryStore()
        j = journal(store, max_events=DEFAULT_POLICY.journal.max_events)
        r = request(model="m" * MAX_MODEL_NAME_CHARS)  # the longest name admitted
        await j.claim(r)
        failed(r, attempt_id="a1")
        released(r, "a2", "r2")
        started(r)
        detail = {"status": 200, "stored": True, "attempt_id": "a2", "code": "web_search"}
        for n in range(5000):
            key = f"{n:06d}:" + "k" * 193  # the longest key the gateway accepts (200 characters)
            for name in (
                EventName.TOOL_CALL_CLAIMED,
                EventName.TOOL_CALL_EXECUTED,
                EventName.TOOL_CALL_REPLAYED,
            ):
                r.handle(ToolCallNoted(name, key, 2, detail))
            if n % 500 == 0:
                j.update(r)
        for _ in range(100):  # one key called again and again
            r.handle(ToolCallNoted(EventName.TOOL_CALL_REPLAYED, "000000:" + "k" * 193, 2, detail))
        for _ in range(2000):
            chunk(r, CONTENT, False)
        chunk(r, FINISH + DONE_EVENT, True)
        await j.write_ahead(r)
        await settle()
        raw = store.data[keys.request("tenant-a", "idem-1")]
        assert len(raw) < 256 * 1024, len(raw)
        record = json.loads(raw)
        assert len(record["tool_calls"]) == DEFAULT_POLICY.tools.max_calls_per_request
        # Every noted call of a key beyond the cap is counted (three per key here), none is listed.
        assert record["tool_calls_not_listed"] == 3 * (5000 - DEFAULT_POLICY.tools.max_calls_per_request)
        assert all(len(t["events"]) <= 16 for t in record["tool_calls"])
        assert len(record["events"]) == DEFAULT_POLICY.journal.max_events + 1
        assert record["events"][-1]["event"] == "stream_completed"
        assert (record["phase"], record["delivered_output_tokens"]) == ("completed", 2000)

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


# --- ownership: the in-flight index of a gateway instance ------------------------------------------------


@pytest.mark.parametrize(
    ("story", "phase", "reclaimable", "in_flight"), [c[1:] for c in CLAIMS], ids=[c[0] for c in CLAIMS]
)
def test_in_flight_index_lives_from_claim_to_the_first_terminal_write(
    story: Callable[[LogicalRequest], None] | None, phase: str, reclaimable: bool, in_flight: bool | None
) -> None:
    async def go() -> None:
        store = MemoryStore()
        j = Journal(store, retention_seconds=3600, gateway_id="gw-1", instance="gw-1~0001")
        r = request()
        await j.claim(r)
        index = keys.in_flight("gw-1~0001", "tenant-a", "idem-1")
        assert index in store.data and stored(store, "tenant-a", "idem-1")["owner"] == "gw-1~0001"
        if story is not None:
            story(r)
            await j.write_ahead(r)
        # Open records keep their index entry; an ended one loses it in the write that ends it.
        assert (index in store.data) is (phase in ("prefill", "decode"))

    run(go)


def test_without_an_instance_there_is_no_index() -> None:
    async def go() -> None:
        store = MemoryStore()
        j = journal(store)
        await j.claim(request())
        assert not [k for k in store.data if k.startswith(keys.IN_FLIGHT_PREFIX)]
        assert "owner" not in stored(store, "tenant-a", "idem-1")

    run(go)


def test_a_record_closed_by_another_instance_is_not_written_again() -> None:
    async def go() -> None:
        store = SlowStore()
        j = Journal(store, retention_seconds=3600, gateway_id="gw-1", instance="gw-1~0001")
        r = request()
        await j.claim(r)
        released(r, "a1", "r")
        # Another instance took this one for lost: it closed the record and removed the index entry.
        closed = {**stored(store, "tenant-a", "idem-1"), "phase": "failed", "outcome": "gateway_lost"}
        store.data[keys.request("tenant-a", "idem-1")] = json.dumps(closed).encode()
        del store.data[keys.in_flight("gw-1~0001", "tenant-a", "idem-1")]
        with pytest.raises(RecordTaken):
            await j.write_ahead(r)
        started(r)
        chunk(r, CONTENT + FINISH + DONE_EVENT, True)
        await j.finish(r)  # logged, not raised: the stream is over either way
        await settle()
        assert stored(store, "tenant-a", "idem-1")["outcome"] == "gateway_lost"
        assert len(store.puts) == 1  # the refused write-ahead; nothing after it

    run(go)


def test_late_news_is_written_until_the_entry_is_forgotten(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("router_sidecar.coordination.journal.LATE_NEWS_SECONDS", 0.05)

    async def go() -> None:
        store = SlowStore()
        j = journal(store)
        r = request()
        await j.claim(r)
        released(r, "a1", "r")
        started(r)
        chunk(r, CONTENT, False)
        chunk(r, FINISH + DONE_EVENT, True)
        await j.finish(r)
        j.release(r)
        writes = len(store.puts)
        j.update(r)  # nothing new: not rewritten
        await settle()
        assert len(store.puts) == writes
        # News after the end (here: a tool call the record lists) is written while the entry is kept.
        r.tool_calls["k"] = {"key": "k", "events": []}
        j.update(r)
        await settle()
        assert len(store.puts) == writes + 1 and stored(store, "tenant-a", "idem-1")["tool_calls"] == [
            {"key": "k", "events": []}
        ]
        await asyncio.sleep(0.1)
        assert j._entries == {}  # forgotten after the grace period: later news is not written
        j.update(r)
        await settle()
        assert len(store.puts) == writes + 1

    run(go)


# --- a request another filter answered (an endpoint picker's own 503 or 429) ------------------------------


def rejected(j: Journal, request_id: str = "req-picked", tenant: str = "tenant-a") -> Awaitable[bool]:
    return j.record_rejected(
        tenant,
        request_id,
        route="messages",
        outcome="replicas_overloaded",
        status=429,
        reason="the endpoint picker answered 429 (epp); no replica was asked",
        details="epp",
    )


def test_a_request_the_picker_answered_is_one_terminal_record() -> None:
    async def go() -> None:
        store = MemoryStore()
        j = Journal(store, retention_seconds=3600, gateway_id="gw-1", instance="gw-1~run")
        assert await rejected(j) is True
        record = stored(store, "tenant-a", "req-picked")
        assert (record["phase"], record["outcome"], record["attempt"]) == (
            "rejected",
            "replicas_overloaded",
            0,
        )
        assert record["first_delta_sent"] is False and record["attempts"] == []
        assert record["input"]["route"] == "messages"
        assert (record["gateway"], record["owner"]) == ("gw-1", "gw-1~run")
        [event] = record["events"]
        assert event["event"] == "request_rejected" and event["reason"].startswith("the endpoint picker")
        assert (event["code"], event["status"], event["details"]) == ("replicas_overloaded", 429, "epp")
        assert isinstance(record["updated_at"], float)
        validate("journal-record", record)
        # Under its tenant only, and never in flight: no index entry, and a lease (retention) on the record.
        assert await j.lookup("tenant-b", "req-picked") is None
        assert not [k for k in store.data if k.startswith(keys.IN_FLIGHT_PREFIX)]
        assert store._written[keys.request("tenant-a", "req-picked")][0] != 0  # under the retention lease

    run(go)


def test_a_picker_answer_never_overwrites_a_record_of_the_id() -> None:
    async def go() -> None:
        store = MemoryStore()
        j = journal(store)
        await j.claim(request("req-picked"))
        before = store.data[keys.request("tenant-a", "req-picked")]
        assert await rejected(j) is False
        assert store.data[keys.request("tenant-a", "req-picked")] == before

    run(go)


def test_a_picker_answer_waits_out_an_election_then_gives_up(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(journal_module, "CLAIM_RETRY_INTERVAL_SECONDS", 0)
    monkeypatch.setattr(journal_module, "CLAIM_PATIENCE_SECONDS", 0.05)

    async def go() -> None:
        store = ElectingStore(refused=2)
        assert await rejected(journal(store)) is True and store.tries == 3
        store = ElectingStore(lost_answers=1)  # taken, its answer lost: found as its own on the next try
        assert await rejected(journal(store)) is True and store.tries == 2
        with pytest.raises(StoreUnavailable):
            await rejected(journal(ElectingStore(refused=10**9)))

    run(go)
