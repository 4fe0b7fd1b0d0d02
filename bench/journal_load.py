"""Journal load on etcd: what the request journal costs etcd at a production rate, and whether it levels off.

Drives the product's `Journal` (real records of real `LogicalRequest`s, built through the machines) against
a real etcd started with auto-compaction, at `--rate` requests per second for `--minutes`: each request is
claimed, written ahead at its first delta, streams for `--stream-seconds`, and finishes (3 writes). A
share of them is retried before content or interrupted (their records keep the full trace); clean
completions keep the summary only (`journal.trace_clean_completions: 0`, the default). No Envoy and no
replicas: this measures etcd's side alone (the gateway's path was counted apart: 3 etcd revisions per
request, `tests/integration` and docs/journal.md#sizing).

Every 10 s: etcd revision, keys under /router-sidecar/, DB size and size in use. At the end: writes per
request, bytes written per request, the live record size, and the request rate one etcd cluster sustains
for a given retention within its quota.

    .venv/bin/python bench/journal_load.py [--rate 100] [--minutes 10] [--retention-seconds 120]
        [--compaction-retention 1m] [--quota-bytes 8589934592]
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import random
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # the request helpers come from the repository's tests

from bench.soak import EtcdCounter  # noqa: E402
from router_sidecar.coordination.journal import Journal  # noqa: E402
from router_sidecar.coordination.owners import new_instance_id  # noqa: E402
from router_sidecar.coordination.store import PREFIX, EtcdStore  # noqa: E402
from router_sidecar.core.request import ResponseChunk  # noqa: E402
from router_sidecar.core.sse import DONE_EVENT  # noqa: E402
from router_sidecar.runtime.supervise import start_etcd  # noqa: E402
from tests.unit.test_journal import CONTENT, FINISH, request  # noqa: E402
from tests.unit.test_request import failed, released, started  # noqa: E402

MB = 1 << 20


class Load:
    def __init__(self, journal: Journal, rng: random.Random, stream_seconds: float, tokens: int) -> None:
        self.journal = journal
        self.rng = rng
        self.stream_seconds = stream_seconds
        self.tokens = tokens
        self.done = 0
        self.bytes_written = 0

    async def one(self, n: int) -> None:
        r = request(request_id=f"load-{n:08d}", tenant=f"tenant-{n % 7}")
        await self.journal.claim(r)
        story = self.rng.random()
        if story < 0.05:  # a retry before content: two attempts
            failed(r, attempt_id=f"a{n}-1")
        released(r, f"a{n}-{len(r.attempts) + 1}", "10.0.0.5:8000")
        await self.journal.write_ahead(r)
        started(r)
        for _ in range(self.tokens):
            r.handle(ResponseChunk(CONTENT, False))
        self.journal.update(r)
        await asyncio.sleep(self.stream_seconds)
        if story > 0.98:  # interrupted after the first delta
            r.handle(ResponseChunk(b"", True))
        else:
            r.handle(ResponseChunk(FINISH + DONE_EVENT, True))
        await self.journal.finish(r)
        self.journal.release(r)
        self.done += 1


async def run(args: argparse.Namespace) -> int:
    work = Path(tempfile.mkdtemp(prefix="journal-load-"))
    etcd_child, endpoint = start_etcd(
        work / "etcd",
        log_path=work / "etcd.log",
        extra_args=(
            "--auto-compaction-mode=periodic",
            f"--auto-compaction-retention={args.compaction_retention}",
            f"--quota-backend-bytes={args.quota_bytes}",
        ),
    )
    store = EtcdStore(endpoint)
    counter = EtcdCounter(endpoint)
    try:
        journal = Journal(
            store,
            retention_seconds=args.retention_seconds,
            gateway_id="load",
            instance=new_instance_id("load"),
            trace_clean_completions=0.0,
        )
        load = Load(journal, random.Random(args.seed), args.stream_seconds, args.tokens)
        start_revision = await _revision(counter)
        tasks: set[asyncio.Task[None]] = set()
        began = time.monotonic()
        next_sample = began
        n = 0
        print("t_s  requests  revision  keys  db_MB  db_in_use_MB", flush=True)
        while time.monotonic() - began < args.minutes * 60:
            due = int((time.monotonic() - began) * args.rate)
            while n < due:
                task = asyncio.get_running_loop().create_task(load.one(n))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
                n += 1
            if time.monotonic() >= next_sample:
                await _sample(counter, began, load.done)
                next_sample += 10
            await asyncio.sleep(0.01)
        await asyncio.gather(*tasks)
        await _sample(counter, began, load.done)
        end_revision = await _revision(counter)
        sizes = await _record_sizes(endpoint)
        writes = (end_revision - start_revision) / max(1, load.done)
        live_bytes = sum(sizes) / max(1, len(sizes))
        print(f"\nrequests {load.done} at {args.rate}/s; etcd revisions per request {writes:.2f}")
        print(f"live record size: mean {live_bytes:.0f} B over {len(sizes)} records (no trace on clean ones)")
        print(f"bytes written per request ≈ {writes * live_bytes:.0f} B (history, before compaction)")
        for retention in (3600, 86400):
            rate = args.quota_bytes * 0.5 / (live_bytes * retention)
            print(
                f"sustainable rate for {retention // 3600} h retention in a {args.quota_bytes / MB:.0f} MiB "
                f"quota (live records ≤ half of it): {rate:.0f} requests/s"
            )
        return 0
    finally:
        await counter.close()
        await store.close()
        etcd_child.stop()


async def _revision(counter: EtcdCounter) -> int:
    found = await counter.count(f"{PREFIX}/")
    assert found is not None, "etcd did not answer"
    return int(found[1])


async def _sample(counter: EtcdCounter, began: float, done: int) -> None:
    found = await counter.count(f"{PREFIX}/")
    _, db, in_use = await counter.leases_and_db()
    keys, revision = found if found is not None else (None, "?")
    elapsed = time.monotonic() - began
    print(f"{elapsed:5.0f}  {done:8d}  {revision:>8}  {keys}  {db or 0:.1f}  {in_use or 0:.1f}", flush=True)


async def _record_sizes(endpoint: str, sample: int = 2000) -> list[int]:
    """Sizes of up to `sample` live request records (etcd's JSON gateway: a whole range of thousands of
    records is over gRPC's default message limit)."""
    prefix = f"{PREFIX}/requests/"
    end = prefix[:-1] + chr(ord(prefix[-1]) + 1)
    body = {"key": _b64(prefix), "range_end": _b64(end), "limit": sample}
    async with httpx.AsyncClient(timeout=10) as client:
        answer = (await client.post(f"http://{endpoint}/v3/kv/range", json=body)).json()
    return [len(base64.b64decode(kv.get("value", ""))) for kv in answer.get("kvs", [])]


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rate", type=float, default=100.0, help="requests per second (default 100)")
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--stream-seconds", type=float, default=2.0, help="time between write-ahead and end")
    parser.add_argument("--tokens", type=int, default=40, help="content events per request")
    parser.add_argument("--retention-seconds", type=float, default=120.0, help="journal.retention_seconds")
    parser.add_argument("--compaction-retention", default="1m", help="etcd --auto-compaction-retention")
    parser.add_argument("--quota-bytes", type=int, default=8 * 1024 * MB, help="etcd --quota-backend-bytes")
    parser.add_argument("--seed", type=int, default=1)
    return asyncio.run(run(parser.parse_args()))


if __name__ == "__main__":
    sys.exit(main())
