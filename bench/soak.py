"""Soak: failover under concurrent failures (many streams in flight, replicas SIGKILLed on a schedule).

`--streams` streaming chat requests are kept in flight for `--minutes` through one `router-sidecar gateway`
(tests.harness.Gateway) in front of two simulated replicas (tests.harness.Sim), with an etcd of its own
(tests.fault.fuzz.RestartableEtcd). Every `--kill-every` seconds one replica (alternating) is SIGKILLed
and restarted on the same port `--down-seconds` later.

Replicas are **static** (`--replica`, no agents, no registry): the gateway probes them itself (the
sidecar's /health probe fences a lost one, Envoy's health check stops routing to it and readmits it after
one good probe), and a SIGKILLed replica's closed connection is its whole fence. That is the set-up the
issue describes, with the fewest processes on a 2-core machine (two agents would add two Python processes
and the registry's own etcd traffic, which is not what this soak measures).

Every finished request is checked like a fuzz trial checks it: its evidence (client bytes, journal record
read with the client's credential, the replicas' log records) goes through `tests.invariants.check_request`,
whose reset tolerances cover the streams a kill cuts after their first delta. Every 10 s it samples the
sidecar's and Envoy's RSS, etcd's keys under /router-sidecar/ (by prefix, counted by etcd itself over its
JSON gateway), etcd's leases and DB size, requests completed per second, and CPU per process. The policy
sets `journal.retention_seconds` to `--retention-seconds` (120 by default, not the product's 86400) so
that a 10-minute run shows whether the journal stays bounded.

    .venv/bin/python bench/soak.py [--minutes 10] [--streams 200] [--kill-every 30] [--tokens 40]
        [--token-interval-ms 20] [--seed N] [--work DIR]

Exit status: 0 clean, 1 any invariant violation, 2 the testbed itself failed (nothing proven either way).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import bisect
import itertools
import json
import math
import os
import random
import secrets
import shlex
import signal
import sys
import tempfile
import threading
import time
from array import array
from collections import Counter, deque
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

import httpx

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # `tests` is not installed: the soak reuses the test harness from the repo

from router_sidecar.coordination.store import keys as etcd_keys  # noqa: E402
from router_sidecar.core.policy import load_policy  # noqa: E402
from tests.fault.fuzz import (  # noqa: E402
    CLIENT_TIMEOUT,
    RequestSpec,
    RestartableEtcd,
    gather_evidence,
    request_body,
    rss_mb,
    send_request,
)
from tests.harness import CREDENTIAL, Gateway, Sim  # noqa: E402
from tests.invariants import (  # noqa: E402
    ClientOutcome,
    Evidence,
    GatewayProbe,
    SentRequest,
    Violation,
    check_gateway,
    check_request,
    describe,
    is_content,
    outcome_kind,
    parse_sse,
)

AUTH = CREDENTIAL["Authorization"]
SAMPLE_EVERY = 10.0
# A restarted replica listens again; Envoy's health check (1 s interval, healthy after one good probe)
# readmits it within about a second. Streams overlapping [kill, restart + this] count as touched by a kill.
HEALTH_SETTLE = 2.0
CHECK_BATCH = 64  # finished requests whose evidence is gathered together
CHECK_CONCURRENCY = 4  # evidence batches in flight at once
SHOWN_VIOLATIONS = 5  # violations printed with their evidence (all of them go to violations.jsonl)
ETCD_PREFIXES = {
    "requests": etcd_keys.REQUESTS_PREFIX,
    "attempts": etcd_keys.ATTEMPTS_PREFIX,
    "tools": etcd_keys.TOOLS_PREFIX,
}
FLAT_TOLERANCE = 0.15  # "flat": the last third's max within 15 % of the first third's max
DRAIN_TIMEOUT = CLIENT_TIMEOUT * 2 + 60  # in-flight streams end, then their evidence is checked


# --- the client side ---------------------------------------------------------------------------------


class _TimedStream(httpx.AsyncByteStream):
    """A response body stream that notes (monotonic time, bytes) of every chunk as it arrives."""

    def __init__(self, inner: httpx.AsyncByteStream, marks: list[tuple[float, int]]) -> None:
        self._inner = inner
        self._marks = marks

    async def __aiter__(self) -> AsyncIterator[bytes]:
        async for chunk in self._inner:
            self._marks.append((time.monotonic(), len(chunk)))
            yield chunk

    async def aclose(self) -> None:
        await self._inner.aclose()


class TimingTransport(httpx.AsyncBaseTransport):
    """Wraps the real transport so that `tests.fault.fuzz.send_request` can be used as it is, while the
    arrival time of every chunk is kept per `Idempotency-Key` (for the client-side gaps between deltas)."""

    def __init__(self, inner: httpx.AsyncBaseTransport) -> None:
        self._inner = inner
        self.arrivals: dict[str, list[tuple[float, int]]] = {}

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        response = await self._inner.handle_async_request(request)
        key = request.headers.get("idempotency-key")
        if key is not None and isinstance(response.stream, httpx.AsyncByteStream):
            response.stream = _TimedStream(response.stream, self.arrivals.setdefault(key, []))
        return response

    async def aclose(self) -> None:
        await self._inner.aclose()


def content_gaps_ms(body: bytes, marks: Sequence[tuple[float, int]]) -> list[float]:
    """Milliseconds between consecutive content events, each timed by the chunk that completed it."""
    times: list[float] = []
    start = pos = 0
    for t, n in marks:
        end = pos + n
        scan = max(start, pos - 1)  # a "\n\n" may straddle two chunks
        while (idx := body.find(b"\n\n", scan, end)) != -1:
            payloads, _, _ = parse_sse(body[start : idx + 2])
            if payloads and is_content(payloads[0]):
                times.append(t)
            start = scan = idx + 2
        pos = end
    return [(b - a) * 1000 for a, b in itertools.pairwise(times)]


class LogTail:
    """The replicas' JSONL request logs, read incrementally and indexed by request id (a soak's logs are too
    long to re-read for every request). Records of a checked request are dropped."""

    def __init__(self, paths: Sequence[Path]) -> None:
        self._offsets = dict.fromkeys(paths, 0)
        self._partial = dict.fromkeys(paths, b"")
        self._by_request: dict[str, list[dict[str, Any]]] = {}
        self._done: dict[str, None] = {}  # recently checked ids (insertion order, bounded)

    def refresh(self) -> None:
        for path, offset in self._offsets.items():
            try:
                with path.open("rb") as f:
                    f.seek(offset)
                    data = f.read()
            except FileNotFoundError:
                continue
            if not data:
                continue
            self._offsets[path] = offset + len(data)
            *lines, self._partial[path] = (self._partial[path] + data).split(b"\n")
            for line in lines:
                try:
                    record = json.loads(line)
                except ValueError:
                    continue
                rid = record.get("request_id") if isinstance(record, dict) else None
                if isinstance(rid, str) and rid not in self._done:
                    self._by_request.setdefault(rid, []).append(record)

    def records(self, ids: Iterable[str]) -> list[dict[str, Any]]:
        self.refresh()
        return [r for rid in ids for r in self._by_request.get(rid, ())]

    def forget(self, ids: Iterable[str]) -> None:
        for rid in ids:
            self._by_request.pop(rid, None)
            self._done[rid] = None
        while len(self._done) > 100_000:
            del self._done[next(iter(self._done))]


# --- state shared between the load thread and the main thread ----------------------------------------


@dataclass
class KillWindow:
    replica: str
    killed_at: float  # wall clock
    back_at: float | None = None  # wall clock when the restarted replica listened again

    def touches(self, started: float, ended: float) -> bool:
        end = (self.back_at if self.back_at is not None else math.inf) + HEALTH_SETTLE
        return started < end and ended > self.killed_at


@dataclass
class Results:
    outcomes: Counter[str] = field(default_factory=Counter)
    attempts: Counter[int] = field(default_factory=Counter)  # attempts per request (journal), all outcomes
    violations: list[Violation] = field(default_factory=list)
    shown: list[dict[str, Any]] = field(default_factory=list)  # evidence of the first violating requests
    gaps: Counter[int] = field(default_factory=Counter)  # gap in tenths of a millisecond → how many
    gap_streams: int = 0  # untouched complete streams whose gaps are counted in `gaps`
    touched: int = 0  # streams whose lifetime overlapped a kill window
    checked: int = 0
    testbed_errors: list[str] = field(default_factory=list)
    testbed_notes: list[str] = field(default_factory=list)  # hiccups of the testbed it recovered from


@dataclass
class Shared:
    kills: list[KillWindow] = field(default_factory=list)
    started: array[float] = field(default_factory=lambda: array("d"))  # wall clock of every request sent
    ended: array[float] = field(default_factory=lambda: array("d"))  # ... and of its end at the client
    completed: int = 0
    in_flight: int = 0
    backlog: int = 0  # finished requests waiting for their evidence check
    lag_max: float = 0.0  # the client loop's worst lateness since the last sample (seconds)
    results: Results = field(default_factory=Results)


# --- the load (its own thread, its own event loop) -----------------------------------------------------


class Load:
    def __init__(
        self,
        *,
        url: str,
        streams: int,
        tokens: int,
        nonce: str,
        seed: int,
        shared: Shared,
        tail: LogTail,
        live_pids: Callable[[], frozenset[int]],
        max_attempts: int,
        violations_path: Path,
    ) -> None:
        self.url = url
        self.streams = streams
        self.tokens = tokens
        self.nonce = nonce
        self.rng = random.Random(seed)
        self.shared = shared
        self.tail = tail
        self.live_pids = live_pids
        self.max_attempts = max_attempts
        self.violations_path = violations_path
        self.stop = threading.Event()
        self._index = itertools.count()
        self._queue: deque[tuple[SentRequest, ClientOutcome]] = deque()
        self._sending = True
        self._transport: TimingTransport | None = None

    def run(self) -> None:
        try:
            asyncio.run(self._run())
        except BaseException as exc:  # reported by the main thread
            self.shared.results.testbed_errors.append(f"load thread: {type(exc).__name__}: {exc}")

    async def _run(self) -> None:
        pool = self.streams + 16
        limits = httpx.Limits(max_connections=pool, max_keepalive_connections=pool)
        self._transport = TimingTransport(httpx.AsyncHTTPTransport(limits=limits))
        timeout = httpx.Timeout(CLIENT_TIMEOUT, connect=5)
        async with httpx.AsyncClient(transport=self._transport, timeout=timeout) as client:
            lag = asyncio.create_task(self._watch_lag())
            checker = asyncio.create_task(self._checker())
            try:
                await asyncio.gather(*(self._worker(client, k) for k in range(self.streams)))
            finally:
                self._sending = False
                await checker
                lag.cancel()

    async def _worker(self, client: httpx.AsyncClient, k: int) -> None:
        await asyncio.sleep(self.rng.uniform(0, 1.0))  # spread the first requests over a second
        while not self.stop.is_set():
            i = next(self._index)
            rid = f"soak-{self.nonce}-{i}"
            spec = RequestSpec(i, "chat", True, i % 2 == 1, self.tokens, None, None, 0.0)
            sent = SentRequest(rid, "chat", request_body(spec, rid))
            self.shared.started.append(time.time())
            self.shared.in_flight += 1
            try:
                outcome = await send_request(client, self.url, sent, authorization=AUTH)
            except Exception as exc:  # send_request records transport errors; anything else is ours
                self.shared.results.testbed_errors.append(f"client of {rid}: {type(exc).__name__}: {exc}")
                await asyncio.sleep(1)
                continue
            finally:
                self.shared.in_flight -= 1
            self.shared.ended.append(time.time())
            self.shared.completed += 1
            self._queue.append((sent, outcome))
            self.shared.backlog = len(self._queue)

    async def _watch_lag(self) -> None:
        while True:
            before = time.monotonic()
            await asyncio.sleep(0.1)
            late = time.monotonic() - before - 0.1
            self.shared.lag_max = max(self.shared.lag_max, late)

    async def _checker(self) -> None:
        running: set[asyncio.Task[None]] = set()
        slots = asyncio.Semaphore(CHECK_CONCURRENCY)

        def done(task: asyncio.Task[None]) -> None:
            running.discard(task)
            slots.release()

        while self._sending or self._queue:
            if len(self._queue) < CHECK_BATCH and self._sending:
                await asyncio.sleep(0.5)
            if not self._queue:
                continue
            batch = [self._queue.popleft() for _ in range(min(CHECK_BATCH, len(self._queue)))]
            self.shared.backlog = len(self._queue)
            await slots.acquire()
            task = asyncio.create_task(self._check(batch))
            running.add(task)
            task.add_done_callback(done)
        if running:
            await asyncio.gather(*running)

    async def _check(self, batch: list[tuple[SentRequest, ClientOutcome]]) -> None:
        results = self.shared.results
        sent = [s for s, _ in batch]
        ids = [s.request_id for s in sent]
        try:
            evidence = await gather_evidence(
                self.url,
                sent,
                [o for _, o in batch],
                replica_records=lambda: self.tail.records(ids),
                live_pids=self.live_pids,
                authorization=AUTH,
                max_attempts=self.max_attempts,
            )
        except Exception as exc:
            results.testbed_errors.append(f"evidence of {len(ids)} requests: {type(exc).__name__}: {exc}")
            return
        finally:
            self.tail.forget(ids)
        arrivals = self._transport.arrivals if self._transport is not None else {}
        for ev in evidence:
            await asyncio.sleep(0)  # one request's checks at a time: the clients' reads are on this loop too
            marks = arrivals.pop(ev.request_id, [])
            try:
                self._account(ev, marks)
            except Exception as exc:
                results.testbed_errors.append(f"check of {ev.request_id}: {type(exc).__name__}: {exc}")

    def _account(self, ev: Evidence, marks: Sequence[tuple[float, int]]) -> None:
        results = self.shared.results
        results.checked += 1
        kind = outcome_kind(ev)
        if kind == "reset" and ev.client.transport_error:
            kind = f"reset ({ev.client.transport_error.split(':')[0]})"
        results.outcomes[kind] += 1
        if ev.journal is not None and ev.journal_status == 200:
            results.attempts[len(ev.journal.get("attempts") or [])] += 1
        found = check_request(ev)
        if found:
            self._record_violations(ev, found)
        touched = any(w.touches(ev.client.started_at, ev.client.ended_at) for w in self.shared.kills)
        results.touched += touched
        if kind == "complete" and not touched:
            results.gaps.update(round(g * 10) for g in content_gaps_ms(ev.client.body, marks))
            results.gap_streams += 1

    def _record_violations(self, ev: Evidence, found: list[Violation]) -> None:
        results = self.shared.results
        results.violations += found
        evidence = describe(ev, body_limit=1 << 16)
        with self.violations_path.open("a") as f:
            f.write(json.dumps({"violations": [str(v) for v in found], "evidence": evidence}) + "\n")
        if len(results.shown) < SHOWN_VIOLATIONS:
            results.shown.append(
                {"violations": [str(v) for v in found], "evidence": describe(ev, body_limit=1500)}
            )


# --- the environment and the main thread ---------------------------------------------------------------


@dataclass
class Sample:
    t: float  # seconds since the load started
    wall: float
    sidecar_mb: float | None
    envoy_mb: float | None
    envoy_pid: int | None
    done_per_s: float
    in_flight: int
    etcd_keys: dict[str, int] | None  # total, requests, attempts, tools, other
    leases: int | None
    db_mb: float | None
    db_in_use_mb: float | None
    lag_ms: float
    backlog: int
    checked: int
    violations: int
    cpu: dict[
        str, float
    ]  # % of one core since the last sample: sidecar, envoy, replicas, etcd, client, machine

    def line(self) -> str:
        if self.etcd_keys is None:
            keys = "etcd keys ?"
        else:
            by = ", ".join(f"{p} {self.etcd_keys[p]}" for p in (*ETCD_PREFIXES, "other"))
            keys = f"etcd keys {self.etcd_keys['total']} ({by})"
        return (
            f"t={self.t:5.0f}s  done/s {self.done_per_s:6.1f}  in flight {self.in_flight:4d}  "
            f"sidecar {_mb(self.sidecar_mb)}  envoy {_mb(self.envoy_mb)}  {keys}  "
            f"leases {_num(self.leases)}  db {_mb(self.db_mb, 1)}  "
            f"checked {self.checked} (backlog {self.backlog})  violations {self.violations}  "
            f"client lag max {self.lag_ms:.0f} ms  "
            f"cpu % {' '.join(f'{k} {v:.0f}' for k, v in self.cpu.items())}"
        )


def _mb(value: float | None, digits: int = 0) -> str:
    return "?" if value is None else f"{value:.{digits}f} MB"


def _num(value: int | None) -> str:
    return "?" if value is None else str(value)


_CLK_TCK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int | None) -> float | None:
    """utime + stime of a process (/proc/PID/stat)."""
    if pid is None:
        return None
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / _CLK_TCK


def machine_busy_seconds() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole machine, all cores (/proc/stat)."""
    ticks = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)  # idle + iowait
    return (sum(ticks) - idle) / _CLK_TCK, sum(ticks) / _CLK_TCK


class CpuMeter:
    """CPU use per role between two readings, in % of one core; "machine" is % of all cores."""

    def __init__(self) -> None:
        self._last: dict[int, float] = {}
        self._machine = machine_busy_seconds()
        self._t = time.monotonic()

    def read(self, roles: dict[str, list[int | None]]) -> dict[str, float]:
        now = time.monotonic()
        dt = max(1e-3, now - self._t)
        out: dict[str, float] = {}
        seen: dict[int, float] = {}
        for role, pids in roles.items():
            used = 0.0
            for pid in pids:
                cpu = cpu_seconds(pid)
                if pid is None or cpu is None:
                    continue
                seen[pid] = cpu
                used += cpu - self._last.get(pid, 0.0)  # a new pid (a restarted replica): all of it is new
            out[role] = 100 * used / dt
        busy, total = machine_busy_seconds()
        out["machine"] = 100 * (busy - self._machine[0]) / max(1e-3, total - self._machine[1])
        self._last, self._machine, self._t = seen, (busy, total), now
        return out


class EtcdCounter:
    """Key counts under /router-sidecar/ by prefix, leases and DB size, from etcd's JSON gateway.

    Not with aetcd: this process forks the replicas it restarts, and a live gRPC channel in a forking
    process made a restarted replica abort between fork and exec (grpc's epoll poller: "Bad file
    descriptor"). tests/fault/fuzz.py reads etcd the same way, for the same reason."""

    def __init__(self, endpoint: str) -> None:
        self._url = f"http://{endpoint}"
        self._http = httpx.AsyncClient(timeout=5)

    async def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any] | None:
        try:
            response = await self._http.post(self._url + path, json=body)
            answer = response.json()
        except (httpx.HTTPError, ValueError):
            return None
        return answer if response.status_code == 200 and isinstance(answer, dict) else None

    async def count(self, prefix: str, revision: str | None = None) -> tuple[int, str] | None:
        """(keys under `prefix`, the revision counted at); at `revision` when given."""
        end = prefix[:-1] + chr(ord(prefix[-1]) + 1)
        body: dict[str, Any] = {"key": _b64(prefix), "range_end": _b64(end), "count_only": True}
        if revision is not None:
            body["revision"] = revision
        answer = await self._post("/v3/kv/range", body)
        if answer is None:
            return None
        # int64s are strings in etcd's JSON; a zero count is left out
        return int(answer.get("count", 0)), str(answer.get("header", {}).get("revision", ""))

    async def keys(self) -> dict[str, int] | None:
        """Keys under /router-sidecar/ and under each of ETCD_PREFIXES, all counted at one revision."""
        total = await self.count(etcd_keys.ROOT)
        if total is None:
            return None
        out = {"total": total[0]}
        for part, prefix in ETCD_PREFIXES.items():
            found = await self.count(prefix, total[1] or None)
            if found is None:
                return None
            out[part] = found[0]
        out["other"] = out["total"] - sum(out[p] for p in ETCD_PREFIXES)
        return out

    async def leases_and_db(self) -> tuple[int | None, float | None, float | None]:
        """(leases, DB size MB, DB size in use MB)."""
        leases = await self._post("/v3/lease/leases", {})
        status = await self._post("/v3/maintenance/status", {})
        mb = 1 << 20
        return (
            None if leases is None else len(leases.get("leases") or []),
            None if status is None else int(status.get("dbSize", 0)) / mb,
            None if status is None or "dbSizeInUse" not in status else int(status["dbSizeInUse"]) / mb,
        )

    async def close(self) -> None:
        await self._http.aclose()


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


class Soak:
    def __init__(self, args: argparse.Namespace, run_dir: Path) -> None:
        self.args = args
        self.run_dir = run_dir
        self.rng = random.Random(args.seed)
        self.shared = Shared()
        self.samples: list[Sample] = []
        self.etcd: RestartableEtcd | None = None
        self.sims: dict[str, Sim] = {}
        self.gateway: Gateway | None = None
        self.load: Load | None = None
        self.load_thread: threading.Thread | None = None
        self.envoy_pid_at_start: int | None = None
        self.probe_violations: list[Violation] = []
        self.probe_note = ""
        self.t0 = 0.0
        self.drained = False
        self.max_attempts = 2  # the policy's before_first_delta.max_attempts (read in `start`)
        self.cpu = CpuMeter()

    # -- set-up and tear-down (main thread: the testbed's children die with the thread that started them)

    def start(self) -> None:
        self.etcd = RestartableEtcd(self.run_dir)
        interval = self.args.token_interval_ms / 1000
        for name in ("a", "b"):
            self.sims[name] = Sim(name, self.run_dir, token_interval=interval)
        policy = self.run_dir / "policy.yaml"
        policy.write_text(f"journal:\n  retention_seconds: {self.args.retention_seconds}\n")
        self.max_attempts = load_policy(str(policy)).before_first_delta.max_attempts
        self.gateway = Gateway(
            replicas=[s.endpoint for s in self.sims.values()],
            etcd=self.etcd.endpoint,
            work=self.run_dir,
            config=policy,
        )
        self.envoy_pid_at_start = self.envoy_pid()

    def close(self) -> None:
        if self.load is not None:
            self.load.stop.set()
        if self.gateway is not None:
            self.gateway.stop()
        for sim in self.sims.values():
            sim.stop()
        if self.etcd is not None:
            self.etcd.stop()

    def envoy_pid(self) -> int | None:
        try:
            return self.gw.envoy_pid()
        except (OSError, ValueError):
            return None

    @property
    def gw(self) -> Gateway:
        assert self.gateway is not None
        return self.gateway

    def live_pids(self) -> frozenset[int]:
        return frozenset(s.child.pid for s in self.sims.values() if s.child is not None and s.child.alive())

    # -- the run

    def run(self) -> None:
        tail = LogTail([s.log_path for s in self.sims.values()])
        self.load = Load(
            url=self.gw.url,
            streams=self.args.streams,
            tokens=self.args.tokens,
            nonce=secrets.token_hex(3),
            seed=self.rng.getrandbits(32),
            shared=self.shared,
            tail=tail,
            live_pids=self.live_pids,
            max_attempts=self.max_attempts,
            violations_path=self.run_dir / "violations.jsonl",
        )
        self.load_thread = threading.Thread(target=self.load.run, name="soak-load", daemon=True)
        self.t0 = time.monotonic()
        self.cpu = CpuMeter()
        self.cpu.read(self._roles(self.envoy_pid()))  # the baseline: start-up CPU is not the load's
        self.load_thread.start()
        asyncio.run(self._orchestrate())
        asyncio.run(self._probe(tail))

    def _roles(self, envoy: int | None) -> dict[str, list[int | None]]:
        return {
            "sidecar": [self.gw.proc.pid],
            "envoy": [envoy],
            "replicas": [s.child.pid for s in self.sims.values() if s.child is not None],
            "etcd": [self.etcd.child.pid if self.etcd is not None and self.etcd.child is not None else None],
            "client": [os.getpid()],
        }

    async def _orchestrate(self) -> None:
        assert self.etcd is not None and self.load is not None and self.load_thread is not None
        args = self.args
        counter = EtcdCounter(self.etcd.endpoint)
        victims = itertools.cycle(("a", "b") if self.rng.random() < 0.5 else ("b", "a"))
        end = self.t0 + args.minutes * 60
        next_sample = self.t0 + SAMPLE_EVERY
        next_kill = self.t0 + args.kill_every
        down: tuple[Sim, KillWindow, float] | None = None  # the replica that is down, until when
        last_completed, last_t = 0, self.t0
        try:
            while (now := time.monotonic()) < end:
                restart_at = down[2] if down is not None else math.inf
                await asyncio.sleep(max(0.0, min(next_sample, next_kill, restart_at, end) - now))
                now = time.monotonic()
                if down is not None and now >= down[2]:
                    self._restart(down[0], down[1])
                    down = None
                if now >= next_kill:
                    next_kill += args.kill_every
                    if down is None and now + args.down_seconds < end:  # no kill it cannot see through
                        down = self._kill(self.sims[next(victims)], now)
                if now >= next_sample:
                    next_sample += SAMPLE_EVERY
                    await self._sample(counter, last_completed, last_t)
                    last_completed, last_t = self.shared.completed, now
            print(
                f"-- {args.minutes:g} min elapsed: no new requests; draining the ones in flight", flush=True
            )
        finally:
            self.load.stop.set()
            if down is not None:
                self._restart(down[0], down[1])
        try:
            deadline = time.monotonic() + DRAIN_TIMEOUT
            while self.load_thread.is_alive() and time.monotonic() < deadline:
                await asyncio.sleep(0.2)
            self.drained = not self.load_thread.is_alive()
            if not self.drained:
                self.shared.results.testbed_errors.append(f"the load did not drain within {DRAIN_TIMEOUT}s")
            await self._sample(counter, last_completed, last_t)
        finally:
            await counter.close()

    def _kill(self, sim: Sim, now: float) -> tuple[Sim, KillWindow, float]:
        assert sim.child is not None
        window = KillWindow(sim.name, time.time())
        self.shared.kills.append(window)
        sim.child.signal(signal.SIGKILL)
        sim.child.proc.wait(5)
        print(f"-- t={now - self.t0:5.0f}s SIGKILL replica {sim.name} (pid {sim.child.pid})", flush=True)
        return sim, window, now + self.args.down_seconds

    def _restart(self, sim: Sim, window: KillWindow) -> None:
        for attempt in (1, 2):
            try:
                sim.ensure_running()  # same port: `Sim.start` listens on the endpoint it had
                break
            except Exception as exc:
                if attempt == 2:
                    raise
                self.shared.results.testbed_notes.append(f"restart of replica {sim.name}: {exc}"[:300])
                time.sleep(1)  # e.g. the port still held by the dead process's sockets; once more
        window.back_at = time.time()
        assert sim.child is not None
        print(
            f"-- t={time.monotonic() - self.t0:5.0f}s replica {sim.name} restarted (pid {sim.child.pid})",
            flush=True,
        )

    async def _sample(self, counter: EtcdCounter, last_completed: int, last_t: float) -> None:
        now = time.monotonic()
        keys = await counter.keys()
        leases, db, db_in_use = await counter.leases_and_db()
        envoy = self.envoy_pid()
        results = self.shared.results
        cpu = self.cpu.read(self._roles(envoy))
        sample = Sample(
            t=now - self.t0,
            wall=time.time(),
            sidecar_mb=rss_mb(self.gw.proc.pid),
            envoy_mb=rss_mb(envoy),
            envoy_pid=envoy,
            done_per_s=(self.shared.completed - last_completed) / max(1e-3, now - last_t),
            in_flight=self.shared.in_flight,
            etcd_keys=keys,
            leases=leases,
            db_mb=db,
            db_in_use_mb=db_in_use,
            lag_ms=self.shared.lag_max * 1000,
            backlog=self.shared.backlog,
            checked=results.checked,
            violations=len(results.violations),
            cpu=cpu,
        )
        self.shared.lag_max = 0.0
        self.samples.append(sample)
        print(sample.line(), flush=True)

    async def _probe(self, tail: LogTail) -> None:
        """Invariant 10: after the soak the gateway still serves a normal request, Envoy never restarted."""
        alive = self.gw.proc.poll() is None
        evidence: Evidence | None = None
        if alive:
            rid = f"soak-probe-{secrets.token_hex(4)}"
            sent = SentRequest(
                rid, "chat", request_body(RequestSpec(0, "chat", True, False, 4, None, None, 0), rid)
            )
            async with httpx.AsyncClient(timeout=httpx.Timeout(CLIENT_TIMEOUT, connect=5)) as client:
                outcome = await send_request(client, self.gw.url, sent, authorization=AUTH)
            [evidence] = await gather_evidence(
                self.gw.url,
                [sent],
                [outcome],
                replica_records=lambda: tail.records([rid]),
                live_pids=self.live_pids,
                authorization=AUTH,
                max_attempts=self.max_attempts,
            )
            self.probe_note = f"{rid}: {outcome_kind(evidence)}"
        probe = GatewayProbe(
            sidecar_alive=alive,
            envoy_pid_before=self.envoy_pid_at_start,
            envoy_pid_after=self.envoy_pid() if alive else None,
            normal_request=evidence,
        )
        self.probe_violations = check_gateway(probe)

    # -- the report

    def report(self, command: str) -> int:
        args, results = self.args, self.shared.results
        out: list[str] = ["", "=" * 100, f"soak report: {command}", "=" * 100]
        elapsed = self.samples[-1].t if self.samples else 0.0
        out.append(
            f"{args.streams} streams for {args.minutes:g} min ({elapsed:.0f}s with the drain), max_tokens "
            f"{args.tokens}, token interval {args.token_interval_ms:g} ms, a replica SIGKILLed every "
            f"{args.kill_every:g}s and restarted {args.down_seconds:g}s later "
            f"({len(self.shared.kills)} kills); "
            f"static replicas; journal.retention_seconds {args.retention_seconds:g}; seed {args.seed}; "
            f"work dir {self.run_dir}"
        )
        total = sum(results.outcomes.values())
        out.append(
            f"\nrequests sent {len(self.shared.started)}, finished {self.shared.completed}, checked {total}"
        )
        out.append("streams by outcome:")
        for kind, n in sorted(results.outcomes.items(), key=lambda kv: -kv[1]):
            out.append(f"  {kind:<60} {n:7d}  {100 * n / max(1, total):5.1f} %")
        out.append(
            "attempts per request (journal): "
            + ", ".join(f"{a} attempt(s) {n}" for a, n in sorted(results.attempts.items()))
        )
        out += self._violations_report()
        out += self._rss_report()
        out += self._etcd_report()
        out += self._gaps_report()
        out += self._cpu_report()
        if results.testbed_notes:
            out.append(f"\ntestbed hiccups, recovered ({len(results.testbed_notes)}):")
            out += [f"  {e}"[:500] for e in results.testbed_notes[:10]]
        if results.testbed_errors:
            out.append(f"\ntestbed errors ({len(results.testbed_errors)}):")
            out += [f"  {e}"[:500] for e in results.testbed_errors[:10]]
        violations = len(results.violations) + len(self.probe_violations)
        status = 1 if violations else 2 if results.testbed_errors or not self.drained else 0
        verdict = {0: "PASS", 1: f"FAIL: {violations} violations", 2: "TESTBED ERROR"}[status]
        out.append(f"\n{verdict} (exit {status})")
        print("\n".join(out), flush=True)
        return status

    def _violations_report(self) -> list[str]:
        results = self.shared.results
        out = [
            f"\ninvariant violations: {len(results.violations)}"
            + (" (must be 0)" if results.violations else "")
        ]
        by_check: Counter[tuple[str, str]] = Counter((v.invariant, v.check) for v in results.violations)
        for (invariant, check), n in sorted(by_check.items(), key=lambda kv: (int(kv[0][0]), -kv[1])):
            ids = sorted(
                {v.request_id for v in results.violations if (v.invariant, v.check) == (invariant, check)}
            )
            more = " …" if len(ids) > 5 else ""
            out.append(f"  invariant {invariant} {check}: {n} (requests {', '.join(ids[:5])}{more})")
        for shown in results.shown:
            out.append("  --- " + " | ".join(shown["violations"])[:1500])
            out.append("      evidence: " + json.dumps(shown["evidence"])[:5000])
        if results.violations:
            out.append(f"  every violating request's evidence: {self.run_dir / 'violations.jsonl'}")
        out.append(f"gateway after the soak (invariant 10): {self.probe_note or 'no probe request'}")
        out += [f"  VIOLATION {v}"[:1500] for v in self.probe_violations]
        if self.probe_note and not self.probe_violations:
            out.append(
                f"  sidecar alive, Envoy pid unchanged ({self.envoy_pid_at_start}), normal request complete"
            )
        return out

    def _rss_report(self) -> list[str]:
        out = ["\nRSS (MB), one sample every 10 s (the last one after the drain):"]
        for name, series in (
            ("sidecar", [s.sidecar_mb for s in self.samples]),
            ("envoy", [s.envoy_mb for s in self.samples]),
        ):
            out.append(f"  {name:8} " + " ".join("?" if v is None else f"{v:.0f}" for v in series))
            out.append(f"  {'':8} {flat_verdict([v for v in series if v is not None])}")
        pids = {s.envoy_pid for s in self.samples} - {None}
        if len(pids) > 1:
            out.append(f"  Envoy's pid changed during the run: {sorted(p for p in pids if p is not None)}")
        return out

    def _etcd_report(self) -> list[str]:
        args = self.args
        out = ["\netcd under /router-sidecar/ (keys, every 10 s):"]
        known = [s for s in self.samples if s.etcd_keys is not None]
        for part in ("total", *ETCD_PREFIXES, "other"):
            series = [s.etcd_keys[part] for s in known if s.etcd_keys is not None]
            out.append(f"  {part:9} " + " ".join(map(str, series)))
        out.append("  leases    " + " ".join(_num(s.leases) for s in self.samples))
        out.append(
            "  db MB     " + " ".join("?" if s.db_mb is None else f"{s.db_mb:.1f}" for s in self.samples)
        )
        out.append(
            "  in use MB "
            + " ".join("?" if s.db_in_use_mb is None else f"{s.db_in_use_mb:.1f}" for s in self.samples)
        )
        out.append("  done/s    " + " ".join(f"{s.done_per_s:.0f}" for s in self.samples))
        sized = [s for s in self.samples if s.db_mb is not None]
        if len(sized) >= 2 and sized[-1].wall > sized[0].wall:
            first, last = sized[0], sized[-1]
            assert first.db_mb is not None and last.db_mb is not None
            ends = sorted(self.shared.ended)
            between = bisect.bisect_right(ends, last.wall) - bisect.bisect_right(ends, first.wall)
            grew = last.db_mb - first.db_mb
            per_k = grew / max(1, between) * 1000
            out.append(
                f"  etcd's DB grew {grew:.1f} MB over {between} requests ({per_k:.1f} MB "
                "per 1000): revisions, not live keys (this etcd runs without auto-compaction; its default "
                "quota is 2 GiB)"
            )
        # A journal record expires with its time bucket's retention lease: at most ttl after its last write
        # (the request's end), ttl = ceil(R + R/10) (RetentionLeases), plus etcd's expiry granularity.
        retention = args.retention_seconds
        ttl = math.ceil(retention + max(1.0, retention / 10)) + 2
        starts, ends = sorted(self.shared.started), sorted(self.shared.ended)
        worst: tuple[float, Sample, int] | None = None
        for s in known:
            assert s.etcd_keys is not None
            allowed = bisect.bisect_right(starts, s.wall) - bisect.bisect_left(ends, s.wall - ttl) + 2
            ratio = s.etcd_keys["requests"] / max(1, allowed)
            if worst is None or ratio > worst[0]:
                worst = (ratio, s, allowed)
        last_t = known[-1].t if known else 0.0
        if worst is not None:
            ratio, s, allowed = worst
            within = "within" if ratio <= 1.0 else "ABOVE"
            count = s.etcd_keys["requests"] if s.etcd_keys is not None else "?"
            out.append(
                f"  requests: every sample {within} what the retention allows (records of requests that "
                f"ended < {ttl}s before it); the fullest: t={s.t:.0f}s {count} of {allowed} allowed"
            )
        if last_t < ttl + 2 * SAMPLE_EVERY:
            out.append(
                f"  bounded: NOT SHOWN: the run ({last_t:.0f}s) is shorter than a record's life ({ttl}s with "
                f"journal.retention_seconds {retention:g}); run at least {math.ceil((ttl + 60) / 60)} min or "
                "pass a shorter --retention-seconds"
            )
        else:
            steady = [s for s in known if s.t >= ttl]
            for part in ("total", *ETCD_PREFIXES):
                series = [s.etcd_keys[part] for s in steady if s.etcd_keys is not None]
                out.append(
                    f"  {part:9} after {ttl}s (records expire from then on): {flat_verdict(series, slack=20)}"
                )
            leases = [s.leases for s in steady if s.leases is not None]
            out.append(f"  leases    after {ttl}s: {flat_verdict(leases, slack=5)}")
        return out

    def _gaps_report(self) -> list[str]:
        results = self.shared.results
        nominal = self.args.token_interval_ms
        out = [
            f"\nclient-side gaps between content events (nominal {nominal:g} ms), complete streams not "
            f"touched by a kill ({results.gap_streams} streams; {results.touched} overlapped "
            f"[kill, restart + {HEALTH_SETTLE:g}s]):"
        ]
        if not results.gaps:
            out.append("  none measured")
            return out
        p50, p99 = histogram_percentile(results.gaps, 50) / 10, histogram_percentile(results.gaps, 99) / 10
        out.append(
            f"  p50 {p50:.1f} ms  p99 {p99:.1f} ms  max {max(results.gaps) / 10:.1f} ms  "
            f"({results.gaps.total()} gaps; p50 {p50 / nominal:.2f}x nominal, p99 {p99 / nominal:.2f}x)"
        )
        coalesced = sum(n for tenths, n in results.gaps.items() if tenths < 10) / results.gaps.total()
        out.append(
            f"  {100 * coalesced:.0f} % of the gaps are under 1 ms: events that reached the client together "
            "(after a late read), which pulls p50 below nominal"
        )
        lags = sorted(s.lag_ms for s in self.samples)
        out.append(
            f"  the client's own event loop was late by up to {lags[-1]:.0f} ms per 10 s sample (median "
            f"{lags[len(lags) // 2]:.0f} ms): late client reads widen these gaps too"
        )
        return out

    def _cpu_report(self) -> list[str]:
        loaded = self.samples[:-1] if len(self.samples) > 1 else self.samples  # the last one is the drain
        if not loaded:
            return []
        roles = list(loaded[0].cpu)
        mean = {r: sum(s.cpu.get(r, 0.0) for s in loaded) / len(loaded) for r in roles}
        out = [
            "\nCPU while loaded (mean % of one core; machine: % of all cores): "
            + ", ".join(f"{r} {v:.0f}" for r, v in mean.items())
        ]
        if mean.get("machine", 0.0) > 85:
            out.append(
                "  the machine was saturated: throughput and gaps measure the machine as much as the gateway "
                "(fewer --streams or a longer --token-interval-ms for a non-saturated figure)"
            )
        return out


def histogram_percentile(histogram: Counter[int], p: float) -> int:
    """The nearest-rank percentile of the values a histogram (value → count) counts."""
    rank = max(1, math.ceil(p / 100 * histogram.total()))
    seen = 0
    for value in sorted(histogram):
        seen += histogram[value]
        if seen >= rank:
            return value
    return max(histogram)


def flat_verdict(series: Sequence[float], *, slack: float = 0.0) -> str:
    """Flat: the last third's max is within 15 % (plus `slack`, for small counts) of the first third's."""
    if len(series) < 3:
        return f"verdict: too few samples ({len(series)}) to judge"
    third = len(series) // 3
    first, last = max(series[:third]), max(series[-third:])
    bound = first * (1 + FLAT_TOLERANCE) + slack
    growth = (last - first) / first * 100 if first else math.inf if last else 0.0
    word = "FLAT" if last <= bound else "GROWING"
    return f"verdict: {word} (first third max {first:.0f}, last third max {last:.0f}, {growth:+.0f} %)"


# --- command line -----------------------------------------------------------------------------------------


def _terminate(signum: int, frame: object) -> NoReturn:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench/soak.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=10.0, help="how long requests are sent")
    parser.add_argument("--streams", type=int, default=200, help="concurrent streaming requests")
    parser.add_argument("--kill-every", type=float, default=30.0, help="seconds between replica kills")
    parser.add_argument(
        "--down-seconds", type=float, default=3.0, help="a killed replica restarts after this"
    )
    parser.add_argument("--tokens", type=int, default=40, help="max_tokens of every request")
    parser.add_argument("--token-interval-ms", type=float, default=20.0, help="the replicas' token interval")
    parser.add_argument(
        "--retention-seconds", type=float, default=120.0, help="journal.retention_seconds of the policy"
    )
    parser.add_argument(
        "--seed", type=int, default=None, help="first victim, request spread (default: random)"
    )
    parser.add_argument(
        "--work", type=Path, default=None, help="logs and etcd data go here (default: a temp dir)"
    )
    args = parser.parse_args(argv)
    if args.seed is None:
        args.seed = secrets.randbits(32)
    if not 0 < args.down_seconds < args.kill_every:
        parser.error("--down-seconds must be > 0 and < --kill-every")
    if args.streams < 1 or args.tokens < 2 or args.minutes <= 0:
        parser.error("--streams >= 1, --tokens >= 2, --minutes > 0")
    command = shlex.join(sys.orig_argv if argv is None else [sys.executable, "bench/soak.py", *argv])
    base = args.work or Path(tempfile.mkdtemp(prefix="soak-"))
    run_dir = base / time.strftime("soak-%Y%m%d-%H%M%S")
    run_dir.mkdir(parents=True, exist_ok=False)
    print(f"command: {command}", flush=True)
    print(f"seed {args.seed}; work dir {run_dir}", flush=True)
    signal.signal(signal.SIGTERM, _terminate)
    soak = Soak(args, run_dir)
    try:
        soak.start()
        print(
            f"gateway {soak.gw.url} → replicas {', '.join(s.endpoint for s in soak.sims.values())}",
            flush=True,
        )
        soak.run()
    except KeyboardInterrupt:
        print("interrupted: stopping every process", flush=True)
        soak.shared.results.testbed_errors.append("interrupted before the end")
        if not soak.samples:
            return 130
    except Exception as exc:
        soak.shared.results.testbed_errors.append(f"{type(exc).__name__}: {exc}"[:2000])
        print(f"testbed error: {type(exc).__name__}: {exc}", flush=True)
        if not soak.samples:
            return 2
    finally:
        soak.close()
    return soak.report(command)


if __name__ == "__main__":
    sys.exit(main())
