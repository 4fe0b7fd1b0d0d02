"""The `Store` interface on `MemoryStore`: the rules the logic above relies on, kept as etcd keeps them.

A watch gives a snapshot, then every change once in revision order; a transaction is one revision; keys go
with their lease; a compaction replaces what a lagging watcher had not received by a snapshot; lease TTLs
can be looked up. `tests/fault/test_store_watch.py` holds the same watch to real etcd.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

import pytest

from router_sidecar.coordination.store import (
    Change,
    Delete,
    Entry,
    EtcdStore,
    MemoryStore,
    Put,
    Snapshot,
    Store,
    WatchItem,
)

T = TypeVar("T")


def run(scenario: Callable[[], Awaitable[T]]) -> T:
    return asyncio.run(asyncio.wait_for(scenario(), 5))


def fold(state: dict[str, bytes], item: WatchItem) -> None:
    """Apply what a watch yielded to what the watcher knows."""
    if isinstance(item, Snapshot):
        state.clear()
        state.update((entry.key, entry.value) for entry in item.entries)
    elif item.value is None:
        state.pop(item.key, None)
    else:
        state[item.key] = item.value


MARK = "/p/~mark"


async def drain(store: MemoryStore, watch: AsyncIterator[WatchItem]) -> list[WatchItem]:
    """Everything the watch yields before a marker written now (which it must yield, last)."""
    await store.put(MARK, str(store.revision).encode())
    items: list[WatchItem] = []
    while not isinstance(item := await anext(watch), Change) or item.key != MARK:
        items.append(item)
    return items


def test_a_watch_starts_with_a_snapshot_then_gives_every_change_in_revision_order() -> None:
    async def scenario() -> None:
        store = MemoryStore()
        await store.put("/p/a", b"1")
        await store.put("/other/x", b"-")
        async with contextlib.aclosing(store.watch_prefix("/p/")) as watch:
            first = await anext(watch)
            assert isinstance(first, Snapshot)
            assert first.entries == (Entry("/p/a", b"1", 0, 2),) and first.revision == 3
            await store.put("/p/b", b"2")
            await store.put("/other/y", b"-")  # outside the prefix: not seen
            await store.delete("/p/a")
            await store.delete("/p/absent")  # nothing deleted: no revision, no change
            assert await store.create("/p/b", b"3") == b"2"  # refused: no change
            assert await drain(store, watch) == [Change("/p/b", b"2", 0, 4), Change("/p/a", None, 0, 6)]

    run(scenario)


def test_a_transaction_is_one_revision_for_all_its_writes() -> None:
    async def scenario() -> None:
        store = MemoryStore()
        await store.put("/p/index", b"")
        async with contextlib.aclosing(store.watch_prefix("/p/")) as watch:
            await anext(watch)
            lease = await store.grant_lease(30)
            written = await store.replace(
                "/p/index", b"", b"x", lease, also=[Put("/p/record", b"r"), Delete("/p/gone")]
            )
            assert written
            [index, record] = await drain(store, watch)  # deleting an absent key is no change
            assert isinstance(index, Change) and isinstance(record, Change)
            assert index.revision == record.revision == 3
            assert (index.lease_id, record.lease_id) == (lease.id, 0)

    run(scenario)


def test_what_a_watcher_folds_is_what_the_store_holds() -> None:
    async def scenario() -> None:
        store = MemoryStore()
        state: dict[str, bytes] = {}
        async with contextlib.aclosing(store.watch_prefix("/p/")) as watch:
            fold(state, await anext(watch))
            for n in range(20):
                await store.put(f"/p/{n % 7}", str(n).encode())
                if n % 3 == 0:
                    await store.delete(f"/p/{(n + 1) % 7}")
            for item in await drain(store, watch):
                fold(state, item)
        assert state == {k: v for k, v in await store.get_prefix("/p/") if k != MARK}

    run(scenario)


def test_revoking_a_lease_deletes_its_keys_and_watchers_see_them_go() -> None:
    async def scenario() -> None:
        store = MemoryStore()
        lease, other = await store.grant_lease(10), await store.grant_lease(10)
        await store.put("/p/a", b"1", lease)
        await store.put("/p/b", b"2", lease)
        await store.put("/p/c", b"3", other)
        await store.put("/p/d", b"4")
        async with contextlib.aclosing(store.watch_prefix("/p/")) as watch:
            await anext(watch)
            await store.revoke_lease(lease)
            gone = await drain(store, watch)
        assert sorted((c.key, c.value) for c in gone if isinstance(c, Change)) == [
            ("/p/a", None),
            ("/p/b", None),
        ]
        assert len({c.revision for c in gone if isinstance(c, Change)}) == 1  # one revision, as in etcd
        assert [k for k, _ in await store.get_prefix("/p/")] == ["/p/c", "/p/d", MARK]

    run(scenario)


def test_compaction_replaces_the_changes_a_lagging_watcher_has_not_received_by_a_snapshot() -> None:
    async def scenario() -> None:
        store = MemoryStore()
        await store.put("/p/a", b"1")
        state: dict[str, bytes] = {}
        async with (
            contextlib.aclosing(store.watch_prefix("/p/")) as lagging,
            contextlib.aclosing(store.watch_prefix("/p/")) as caught_up,
        ):
            fold(state, await anext(lagging))
            await anext(caught_up)
            await store.put("/p/b", b"2")
            await store.delete("/p/a")
            assert [await anext(caught_up), await anext(caught_up)] == [
                Change("/p/b", b"2", 0, 3),
                Change("/p/a", None, 0, 4),
            ]
            store.compact()
            item = await anext(lagging)  # the two changes are gone; the state of now stands in for them
            assert isinstance(item, Snapshot) and item.revision == store.revision == 4
            fold(state, item)
            assert state == {"/p/b": b"2"}
            assert await drain(store, lagging) == []
            assert await drain(store, caught_up) == []  # it had everything: nothing to stand in for

    run(scenario)


def test_a_closed_watch_is_told_nothing_more() -> None:
    async def scenario() -> None:
        store = MemoryStore()
        watch = store.watch_prefix("/p/")
        await anext(watch)
        await watch.aclose()
        await store.put("/p/a", b"1")
        with pytest.raises(StopAsyncIteration):
            await anext(watch)

    run(scenario)


def test_read_prefix_gives_each_key_with_its_lease_and_revision() -> None:
    async def scenario() -> None:
        store = MemoryStore()
        lease = await store.grant_lease(5)
        await store.put("/p/b", b"2", lease)
        await store.put("/p/a", b"1")
        snapshot = await store.read_prefix("/p/")
        assert snapshot == Snapshot((Entry("/p/a", b"1", 0, 3), Entry("/p/b", b"2", lease.id, 2)), 3)
        assert snapshot.by_key()["/p/b"].lease_id == lease.id
        assert await store.get_prefix("/p/") == [("/p/a", b"1"), ("/p/b", b"2")]

    run(scenario)


def test_lease_time_to_live() -> None:
    async def scenario() -> None:
        store = MemoryStore()
        lease = await store.grant_lease(7)
        assert await store.lease_time_to_live(lease.id) == (7, 7)
        await store.revoke_lease(lease)
        assert await store.lease_time_to_live(lease.id) == (-1, 0)  # etcd's answer for a lease that is gone
        assert await store.lease_time_to_live(999) == (-1, 0)

    run(scenario)


def test_shared_says_whether_other_processes_use_the_store() -> None:
    stores: list[Store] = [MemoryStore(), MemoryStore(shared=True), EtcdStore("127.0.0.1:1")]
    assert [store.shared for store in stores] == [False, True, True]
