"""The store's one watch loop against real etcd: restarted, compacted, replaced by a new one, black-holed.

The watcher reaches etcd on 127.0.0.2, the writer on 127.0.0.1 (one member listening on both, same port).
Started without 127.0.0.2, etcd is up for the writer and away for the watcher, so what is written then the
watcher can only have by resuming from its last revision (or, when that history is gone, by reading the
prefix whole again). Each test compares what the watch yielded with every write made, in order.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from router_sidecar.coordination.store import (
    Change,
    EtcdStore,
    Snapshot,
    StoreUnavailable,
    WatchItem,
)
from router_sidecar.runtime.supervise import Child, free_ports, start_etcd

pytestmark = pytest.mark.fault

PREFIX = "/router-sidecar-test/watch/"  # not the product's root: nothing in it reads these
WATCHER_HOST = "127.0.0.2"
Write = tuple[str, bytes | None]  # (key, value), None: deleted


class TwoDoorEtcd:
    """One etcd member, stopped and started again on the same ports, with or without the watcher's door."""

    def __init__(self, work: Path) -> None:
        self.work = work
        self.port, self.peer_port = free_ports(2)
        self.child: Child | None = None
        self.starts = 0
        self.writer_endpoint = f"127.0.0.1:{self.port}"
        self.watcher_endpoint = f"{WATCHER_HOST}:{self.port}"

    def start(self, *, watcher_door: bool = True, data: str = "data") -> None:
        self.starts += 1
        self.child, _ = start_etcd(
            self.work / data,
            client_port=self.port,
            peer_port=self.peer_port,
            also_listen_on=(WATCHER_HOST,) if watcher_door else (),
            log_path=self.work / f"etcd-{self.starts}.log",
        )

    def stop(self) -> None:
        if self.child is not None:
            self.child.stop()

    def compact(self, revision: int) -> None:
        """Compact etcd's history up to `revision` (through its JSON gateway), waiting until it is done."""
        reply = httpx.post(
            f"http://{self.writer_endpoint}/v3/kv/compaction",
            json={"revision": str(revision), "physical": True},
            timeout=10,
        )
        reply.raise_for_status()


@pytest.fixture
def etcd(tmp_path: Path) -> TwoDoorEtcd:
    return TwoDoorEtcd(tmp_path)


class Follower:
    """A watch of PREFIX run in the background: every item it yields, and the state they add up to."""

    def __init__(self, store: EtcdStore, **watch_options: float) -> None:
        self.items: list[WatchItem] = []
        self.state: dict[str, bytes] = {}
        self._task = asyncio.create_task(self._follow(store, watch_options))

    async def _follow(self, store: EtcdStore, watch_options: dict[str, float]) -> None:
        async with contextlib.aclosing(store.watch_prefix(PREFIX, **watch_options)) as watch:
            async for item in watch:
                self.items.append(item)
                if isinstance(item, Snapshot):
                    self.state = {entry.key: entry.value for entry in item.entries}
                elif item.value is None:
                    self.state.pop(item.key, None)
                else:
                    self.state[item.key] = item.value

    @property
    def snapshots(self) -> list[Snapshot]:
        return [item for item in self.items if isinstance(item, Snapshot)]

    @property
    def changes(self) -> list[Write]:
        return [(item.key, item.value) for item in self.items if isinstance(item, Change)]

    async def stop(self) -> None:
        self._task.cancel()
        await asyncio.wait([self._task], timeout=5)
        assert self._task.cancelled(), "the watch ended on its own"


async def until(condition: Callable[[], bool], what: str, seconds: float = 20.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"timed out after {seconds}s waiting for {what}"
        await asyncio.sleep(0.02)


async def answers(store: EtcdStore) -> None:
    """Wait until `store` reaches etcd (after a restart)."""
    deadline = time.monotonic() + 20
    while True:
        try:
            await store.check()
            return
        except StoreUnavailable:
            assert time.monotonic() < deadline, "etcd did not answer the writer again"
            await asyncio.sleep(0.05)


async def write(store: EtcdStore, writes: list[Write], done: list[Write]) -> None:
    """Make `writes` in order (one revision each), appending each to `done` as it is made."""
    for key, value in writes:
        if value is None:
            await store.delete(key)
        else:
            await store.put(key, value)
        done.append((key, value))


def batch(name: str, count: int) -> list[Write]:
    """`count` puts, then the deletion of the first: every batch has both kinds of change."""
    puts: list[Write] = [(f"{PREFIX}{name}-{n}", f"{name}{n}".encode()) for n in range(count)]
    return [*puts, (puts[0][0], None)]


async def stores(etcd: TwoDoorEtcd, **watcher_options: float) -> tuple[EtcdStore, EtcdStore]:
    return EtcdStore(etcd.writer_endpoint), EtcdStore(etcd.watcher_endpoint, **watcher_options)


def test_a_watch_resumes_after_an_etcd_restart_and_misses_no_change(etcd: TwoDoorEtcd) -> None:
    async def scenario() -> None:
        writer, watcher = await stores(etcd)
        follower = Follower(watcher, retry_interval=0.05)
        try:
            await until(lambda: len(follower.items) == 1, "the first snapshot")
            done: list[Write] = []
            await write(writer, batch("before", 4), done)
            await until(lambda: follower.changes == done, "the changes before the restart")

            await asyncio.to_thread(etcd.stop)
            await asyncio.to_thread(etcd.start, watcher_door=False)
            await answers(writer)
            await write(writer, batch("while-away", 5), done)
            assert len(follower.changes) == 5  # the watcher cannot reach etcd: nothing of it yet

            await asyncio.to_thread(etcd.stop)
            await asyncio.to_thread(etcd.start)
            await until(lambda: len(follower.changes) >= len(done), "the changes made while it was away")
            assert follower.changes == done  # each once, in order: resumed from the last revision
            assert len(follower.snapshots) == 1  # nothing had to be read whole again
            revisions = [item.revision for item in follower.items if isinstance(item, Change)]
            assert revisions == sorted(set(revisions))
            assert follower.state == dict(await writer.get_prefix(PREFIX))
            assert watcher.watch_streams >= 2
        finally:
            await follower.stop()
            await asyncio.gather(writer.close(), watcher.close())

    try:
        etcd.start()
        asyncio.run(asyncio.wait_for(scenario(), 90))
    finally:
        etcd.stop()


def test_a_watch_whose_history_was_compacted_reads_the_prefix_whole_again(etcd: TwoDoorEtcd) -> None:
    async def scenario() -> None:
        writer, watcher = await stores(etcd)
        await write(writer, batch("first", 2), [])  # in the first snapshot
        follower = Follower(watcher, retry_interval=0.05)
        try:
            await until(lambda: len(follower.items) == 1, "the first snapshot")
            done: list[Write] = []
            await write(writer, batch("before", 3), done)
            await until(lambda: follower.changes == done, "the changes before the restart")

            await asyncio.to_thread(etcd.stop)
            await asyncio.to_thread(etcd.start, watcher_door=False)
            await answers(writer)
            await write(writer, batch("compacted", 4), [])
            etcd.compact((await writer.read_prefix(PREFIX)).revision)

            await asyncio.to_thread(etcd.stop)
            await asyncio.to_thread(etcd.start)
            await until(lambda: len(follower.snapshots) == 2, "the prefix read whole again")
            store_now = await writer.read_prefix(PREFIX)
            assert follower.snapshots[-1] == store_now
            assert follower.state == dict(await writer.get_prefix(PREFIX))
            assert follower.changes == done  # the compacted changes are not made up: the snapshot stands in
            await write(writer, [(f"{PREFIX}after", b"1")], done)  # and the watch goes on after it
            await until(lambda: follower.changes == done, "a change after the snapshot")
        finally:
            await follower.stop()
            await asyncio.gather(writer.close(), watcher.close())

    try:
        etcd.start()
        asyncio.run(asyncio.wait_for(scenario(), 90))
    finally:
        etcd.stop()


def test_a_watch_on_an_etcd_that_lost_its_data_reads_the_new_one_whole(etcd: TwoDoorEtcd) -> None:
    async def scenario() -> None:
        writer, watcher = await stores(etcd)
        follower = Follower(watcher, retry_interval=0.05)
        try:
            await until(lambda: len(follower.items) == 1, "the first snapshot")
            done: list[Write] = []
            await write(writer, batch("old", 10), done)
            await until(lambda: follower.changes == done, "the changes on the old etcd")

            # Same name, same ports, a new data directory: the same cluster and member ids as before, a
            # revision that starts again from 1. Only the revision going back tells the watcher.
            await asyncio.to_thread(etcd.stop)
            await asyncio.to_thread(etcd.start, watcher_door=False, data="data-new")
            await answers(writer)
            await write(writer, batch("new", 2), [])
            await asyncio.to_thread(etcd.stop)
            await asyncio.to_thread(etcd.start, data="data-new")

            await until(lambda: len(follower.snapshots) == 2, "the new etcd read whole")
            assert follower.state == dict(await writer.get_prefix(PREFIX)) == {f"{PREFIX}new-1": b"new1"}
            assert follower.changes == done
        finally:
            await follower.stop()
            await asyncio.gather(writer.close(), watcher.close())

    try:
        etcd.start()
        asyncio.run(asyncio.wait_for(scenario(), 90))
    finally:
        etcd.stop()


class BlackHole:
    """A TCP relay to etcd whose open connections can be made to swallow every byte both ways while they
    stay open (a route that black-holes); connections made after that are relayed as before."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = 0
        self._server: asyncio.Server | None = None
        self._links: list[dict[str, bool]] = []
        self._tasks: set[asyncio.Task[None]] = set()
        self._writers: list[asyncio.StreamWriter] = []

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        link = {"swallowed": False}
        self._links.append(link)
        self._writers += [writer, up_writer]
        for source, sink in ((reader, up_writer), (up_reader, writer)):
            task = asyncio.create_task(self._relay(source, sink, link))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    @staticmethod
    async def _relay(source: asyncio.StreamReader, sink: asyncio.StreamWriter, link: dict[str, bool]) -> None:
        with contextlib.suppress(ConnectionError):
            while data := await source.read(65536):
                if not link["swallowed"]:
                    sink.write(data)
                    await sink.drain()
        sink.close()

    def swallow(self) -> None:
        for link in self._links:
            link["swallowed"] = True

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for writer in self._writers:
            writer.close()


def test_a_watch_that_went_silent_is_noticed_and_resumed(etcd: TwoDoorEtcd) -> None:
    async def scenario() -> None:
        hole = BlackHole(etcd.port)
        await hole.start()
        writer, watcher = EtcdStore(etcd.writer_endpoint), EtcdStore(f"127.0.0.1:{hole.port}", timeout=1.0)
        follower = Follower(watcher, retry_interval=0.05, probe_after=0.3)
        try:
            await until(lambda: len(follower.items) == 1, "the first snapshot")
            done: list[Write] = []
            await write(writer, batch("before", 2), done)
            await until(lambda: follower.changes == done, "the changes before the black hole")

            hole.swallow()  # the watch stream's connection stays open and says nothing any more
            await write(writer, batch("swallowed", 3), done)
            await until(lambda: follower.changes == done, "the changes the black hole swallowed")
            assert len(follower.snapshots) == 1 and watcher.watch_streams == 2
        finally:
            await follower.stop()
            await asyncio.gather(writer.close(), watcher.close())
            await hole.close()

    try:
        etcd.start()
        asyncio.run(asyncio.wait_for(scenario(), 60))
    finally:
        etcd.stop()


def test_a_revoked_lease_takes_its_keys_and_its_time_to_live(etcd: TwoDoorEtcd) -> None:
    """What `MemoryStore` imitates, on etcd: keys go with their lease, in one revision, seen by a watch."""

    async def scenario() -> None:
        writer, watcher = await stores(etcd)
        follower = Follower(watcher)
        try:
            lease = await writer.grant_lease(30)
            await until(lambda: len(follower.items) == 1, "the first snapshot")
            await writer.put(f"{PREFIX}a", b"1", lease)
            await writer.put(f"{PREFIX}b", b"2", lease)
            remaining, granted = await writer.lease_time_to_live(lease.id)
            assert 0 < remaining <= granted == 30
            entries = (await writer.read_prefix(PREFIX)).entries
            assert [(e.key, e.lease_id) for e in entries] == [
                (f"{PREFIX}a", lease.id),
                (f"{PREFIX}b", lease.id),
            ]
            await writer.revoke_lease(lease)
            await until(lambda: len(follower.changes) == 4, "the keys to go")
            gone = [item for item in follower.items[-2:] if isinstance(item, Change)]
            assert sorted((c.key, c.value) for c in gone) == [(f"{PREFIX}a", None), (f"{PREFIX}b", None)]
            assert gone[0].revision == gone[1].revision
            assert (await writer.lease_time_to_live(lease.id))[0] <= 0
        finally:
            await follower.stop()
            await asyncio.gather(writer.close(), watcher.close())

    try:
        etcd.start()
        asyncio.run(asyncio.wait_for(scenario(), 60))
    finally:
        etcd.stop()
