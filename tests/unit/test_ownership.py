"""Closing the records of a lost gateway instance: the pure rule, and the compare-and-swap over a store."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from router_sidecar.coordination.owners import close_lost_owner, new_instance_id
from router_sidecar.coordination.store import MemoryStore, RetentionLeases, keys
from router_sidecar.core.ownership import attempt_lease_ids, close_lost_record

OWNER = "gw-a~00000001"


def record(
    request_id: str, phase: str, *, first_delta: bool, delivered: int = 0, owner: str = OWNER
) -> dict[str, Any]:
    return {
        "request_id": request_id,
        "phase": phase,
        "outcome": None,
        "first_delta_sent": first_delta,
        "delivered_output_tokens": delivered,
        "owner": owner,
        "attempts": [
            {"attempt": 1, "lease": {"lease_id": "1f", "revoked_at": 1.0}},
            {"attempt": 2, "lease": {"lease_id": "2a", "revoked_at": None}},
        ],
        "events": [{"t": 1.0, "event": "request_accepted"}],
    }


@pytest.mark.parametrize(
    ("phase", "first_delta", "closed_phase"),
    [("decode", True, "interrupted"), ("prefill", False, "failed"), ("prefill", True, "interrupted")],
)
def test_an_open_record_is_closed_with_what_it_knows(
    phase: str, first_delta: bool, closed_phase: str
) -> None:
    open_record = record("r1", phase, first_delta=first_delta, delivered=7 if first_delta else 0)
    closed = close_lost_record(open_record, owner=OWNER, closed_by="gw-b~2", now=5.0)
    assert closed is not None
    assert (closed["phase"], closed["outcome"]) == (closed_phase, "gateway_lost")
    assert closed["delivered_output_tokens"] == open_record["delivered_output_tokens"]
    assert closed["events"][-1] == {
        "t": 5.0,
        "event": "gateway_lost",
        "owner": OWNER,
        "closed_by": "gw-b~2",
        "delivered_output_tokens": open_record["delivered_output_tokens"],
    }
    assert open_record["phase"] == phase  # the input is not changed


@pytest.mark.parametrize("phase", ["completed", "interrupted", "cancelled", "rejected", "failed"])
def test_an_ended_record_is_left_alone(phase: str) -> None:
    assert close_lost_record(record("r1", phase, first_delta=True), owner=OWNER, closed_by="x", now=1) is None


def test_another_owners_record_is_left_alone() -> None:
    # Re-claimed by a live instance (a failed run re-run under the same key): not the lost owner's to close.
    mine = record("r1", "prefill", first_delta=False, owner="gw-c~3")
    assert close_lost_record(mine, owner=OWNER, closed_by="x", now=1) is None


def test_attempt_leases_not_yet_revoked() -> None:
    assert attempt_lease_ids(record("r1", "decode", first_delta=True)) == [0x2A]
    assert attempt_lease_ids({"attempts": [{"lease": None}, {"lease": {"lease_id": "zz"}}]}) == []


def test_instance_ids_are_key_segments_and_unique() -> None:
    first, second = new_instance_id("host/1:127.0.0.1:80"), new_instance_id("host/1:127.0.0.1:80")
    assert first != second and "/" not in first and first.startswith("host_1:127.0.0.1:80~")


def _seed(store: MemoryStore, tenant: str, rec: dict[str, Any], owner: str = OWNER) -> None:
    store.data[keys.request(tenant, rec["request_id"])] = json.dumps(rec).encode()
    store.data[keys.in_flight(owner, tenant, rec["request_id"])] = b""


def test_closing_a_lost_owner_closes_each_open_record_exactly_once() -> None:
    async def go() -> None:
        store = MemoryStore()
        _seed(store, "t1", record("open-decode", "decode", first_delta=True, delivered=4))
        _seed(store, "t2", record("open-prefill", "prefill", first_delta=False))
        _seed(store, "t1", record("ended", "completed", first_delta=True))  # index left by a crash mid-write
        _seed(store, "t1", record("reclaimed", "prefill", first_delta=False, owner="gw-c~3"))
        store.data[keys.in_flight(OWNER, "t1", "expired")] = b""  # its record expired already
        _seed(store, "t1", record("other-owner", "decode", first_delta=True, owner="gw-c~3"), owner="gw-c~3")
        retention = RetentionLeases(store, 3600)
        closers = await asyncio.gather(
            close_lost_owner(store, retention, OWNER, "gw-b~2"),
            close_lost_owner(store, retention, OWNER, "gw-d~4"),
        )
        assert sum(closers) == 2
        by_id = {
            json.loads(v)["request_id"]: json.loads(v)
            for k, v in store.data.items()
            if k.startswith(keys.REQUESTS_PREFIX)
        }
        assert (by_id["open-decode"]["phase"], by_id["open-decode"]["delivered_output_tokens"]) == (
            "interrupted",
            4,
        )
        assert by_id["open-prefill"]["phase"] == "failed"
        assert [e["event"] for e in by_id["open-decode"]["events"]].count("gateway_lost") == 1
        assert by_id["ended"]["phase"] == "completed" and by_id["reclaimed"]["phase"] == "prefill"
        assert by_id["other-owner"]["phase"] == "decode"
        left = [k for k in store.data if k.startswith(keys.IN_FLIGHT_PREFIX)]
        assert left == [keys.in_flight("gw-c~3", "t1", "other-owner")]
        assert store.revoked == {0x2A}
        assert await close_lost_owner(store, retention, OWNER, "gw-b~2") == 0

    asyncio.run(asyncio.wait_for(go(), 5))


class InterleavingStore(MemoryStore):
    """Yields between every call, so that concurrent closers really interleave their reads and writes."""

    async def get(self, key: str) -> bytes | None:
        await asyncio.sleep(0)
        return await super().get(key)

    async def replace(self, *args: Any, **kwargs: Any) -> bool:
        await asyncio.sleep(0)
        return await super().replace(*args, **kwargs)


def test_concurrent_closers_close_each_record_once() -> None:
    async def go() -> None:
        store = InterleavingStore()
        for n in range(5):
            _seed(store, "t1", record(f"r{n}", "decode", first_delta=True, delivered=n))
        retention = RetentionLeases(store, 3600)
        closed = await asyncio.gather(
            *(close_lost_owner(store, retention, OWNER, f"gw-{i}~x") for i in range(3))
        )
        assert sum(closed) == 5
        for n in range(5):
            events = json.loads(store.data[keys.request("t1", f"r{n}")])["events"]
            assert [e["event"] for e in events].count("gateway_lost") == 1

    asyncio.run(asyncio.wait_for(go(), 5))


def test_an_owner_that_is_back_keeps_its_records() -> None:
    async def go() -> None:
        store = MemoryStore()
        _seed(store, "t1", record("r1", "decode", first_delta=True))
        store.data[keys.owner(OWNER)] = b"{}"  # its lease was taken again before the closer got there
        assert await close_lost_owner(store, RetentionLeases(store, 3600), OWNER, "gw-b~2") == 0
        assert json.loads(store.data[keys.request("t1", "r1")])["phase"] == "decode"

    asyncio.run(asyncio.wait_for(go(), 5))
