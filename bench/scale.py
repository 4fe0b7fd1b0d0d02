"""Scale curve: N concurrent slow streams through plain Envoy and through the gateway, in one run.

For each width N of `--steps` (100, 300, 1000 by default) both setups of `stream_overhead.py` carry N
streams at once: plain Envoy (the gateway's own listener, route and cluster, no ext_proc) and the real
`router-sidecar gateway` (Envoy + sidecar + etcd), in front of the same `sse_upstream.py`, which sends
`--rate` content events per second per stream (each stamped with CLOCK_MONOTONIC as it is written).

Each of the N slots runs streams back to back (each `--stream-seconds` long), the slots' first streams
spread over one stream's length, so that N streams are in flight at any time and requests arrive at a
steady N / `--stream-seconds` per second. Once every slot has started, a window of `--seconds` is measured:
the chunks that arrived in it (carried chunks/s, receive − send latency per chunk), the time to first
content of the streams started in it, the CPU every process spent in it (utime + stime from
/proc/PID/stat), the sidecar's and Envoy's RSS (sampled every second), and, over the whole step, etcd's
own counters (its /metrics on the client URL) per request. Every stream must end with [DONE] and carry
every content event it asked for; one that did not is a contract violation.

The client runs in `--clients` processes (asyncio with uvloop when installed, one HTTP/1.1 keep-alive
connection per slot). Everything listens on 127.0.0.1; Ctrl-C or SIGTERM stops every process it started.

    .venv/bin/python bench/scale.py [--steps 100,300,1000] [--seconds 20] [--stream-seconds 20] \
        [--rate 15] [--clients 2] [--json FILE] [--quick] [--work-dir DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import math
import multiprocessing
import os
import re
import resource
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from array import array
from collections import Counter
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

from stream_overhead import (
    BENCH_DIR,
    HOST,
    StreamResult,
    _ClientConn,
    _envoy_version,
    _kill_if_envoy,
    _raise_interrupt,
    _request,
    _run_async,
    _widths,
    child_pid,
    cpu_seconds,
    machine_busy_seconds,
    percentile,
    start_gateway,
    start_plain_envoy,
)

from router_sidecar.core.policy import load_policy
from router_sidecar.runtime.envoy_config import Endpoint, GatewaySpec, find_envoy
from router_sidecar.runtime.supervise import (
    Child,
    ProcessFailed,
    free_ports,
    port_open,
    start_etcd,
    wait_until,
)

SETUPS = ("plain", "gateway")
SETTLE_SECONDS = 1.0  # after the last slot's first request, before the window opens
BETWEEN_RUNS_SECONDS = 5.0  # Envoy's idle upstream connections (4 s) close before the next run
IDLE_SECONDS = 5.0  # the gateway's background CPU and etcd traffic, measured once with no load
JOURNAL_LAND_SECONDS = 1.5  # a request's last journal write may land after the client saw [DONE]
MAX_STREAMS_PER_SLOT = 10_000
MAX_JOBS_PER_WORKER = 1_000
LAG_TICK = 0.05  # the client loop's lateness probe
SATURATED = 0.95  # a process at this share of one core, or a carried rate below this share of plain's
# etcd's own counters (etcd 3.4): every raft proposal committed is one durable write (put, txn with a write,
# delete, lease grant or revoke); a read-only txn or range and a lease keep-alive are not proposals.
ETCD_COUNTERS = {
    "writes": "etcd_server_proposals_committed_total",
    "revisions": "etcd_debugging_mvcc_current_revision",
    "puts": "etcd_mvcc_put_total",
    "txns": "etcd_mvcc_txn_total",
    "deletes": "etcd_mvcc_delete_total",
    "ranges": "etcd_mvcc_range_total",
    "put_bytes": "etcd_debugging_mvcc_total_put_size_in_bytes",
    "lease_grants": "etcd_debugging_lease_granted_total",
}


# --- the client (runs in `--clients` worker processes) -------------------------------------------------


@dataclass(frozen=True)
class Job:
    """One run of one setup at one width, as one worker process drives its share of the slots."""

    port: int
    slots: tuple[int, ...]  # this worker's slot numbers (of `width`)
    width: int
    chunks: int  # content events per stream
    start_at: float  # time.monotonic() of slot 0's first request
    stagger: float  # slot i's first request: start_at + stagger * i / width
    window: tuple[float, float]  # measured; no stream starts after its end
    timeout: float  # one stream's bound


@dataclass
class WorkerReport:
    # Per stream: sent_ns, first content ns (0: none), end ns, content events, complete, error.
    streams: list[tuple[int, int, int, int, bool, str | None]] = field(default_factory=list)
    latencies: bytes = b""  # array("q") of receive − send, chunks that arrived in the window
    lags: bytes = b""  # array("d") of the loop's lateness (s) per tick in the window


class _Arrivals(list[int]):
    """A stream's per-chunk latencies as `_ClientConn` appends them, each noted with its arrival time."""

    def __init__(self) -> None:
        super().__init__()
        self.at = array("q")

    def append(self, latency_ns: int) -> None:
        super().append(latency_ns)
        self.at.append(time.monotonic_ns())


class _Collector:
    def __init__(self, job: Job) -> None:
        self.job = job
        self.window_ns = (int(job.window[0] * 1e9), int(job.window[1] * 1e9))
        self.report = WorkerReport()
        self.latencies = array("q")
        self.lags = array("d")

    def add(self, result: StreamResult, arrivals: _Arrivals) -> None:
        lo, hi = self.window_ns
        self.latencies.extend(lat for lat, at in zip(arrivals, arrivals.at, strict=True) if lo <= at < hi)
        complete = result.done and result.error is None and len(arrivals) == self.job.chunks
        error = result.error
        if error is None and not complete:
            error = f"ended with [DONE] after {len(arrivals)} of {self.job.chunks} content events"
        first = result.first_content_ns or 0
        self.report.streams.append(
            (result.sent_ns, first, time.monotonic_ns(), len(arrivals), complete, error)
        )


async def _slot(job: Job, slot: int, out: _Collector) -> None:
    """Streams back to back on one keep-alive connection, from the slot's start until the window's end."""
    loop = asyncio.get_running_loop()
    await asyncio.sleep(max(0.0, job.start_at + job.stagger * slot / job.width - time.monotonic()))
    request = _request(job.port, job.chunks)
    conn: _ClientConn | None = None
    try:
        for _ in range(MAX_STREAMS_PER_SLOT):
            if time.monotonic() >= job.window[1]:
                return
            arrivals = _Arrivals()
            try:
                if conn is None or conn.lost:
                    connecting = loop.create_connection(_ClientConn, HOST, job.port)
                    conn = (await asyncio.wait_for(connecting, 5))[1]
                result, finished = conn.start(request)
                result.latencies_ns = arrivals
                if not (await asyncio.wait({finished}, timeout=job.timeout))[0]:
                    result.error = f"no end within {job.timeout:.0f} s"
            except (OSError, TimeoutError) as exc:
                result = StreamResult(sent_ns=time.monotonic_ns(), error=f"connect: {exc!r}")
            out.add(result, arrivals)
            if result.error:
                if conn is not None and conn.transport is not None:
                    conn.transport.close()  # its state is unknown now: the next stream opens a new one
                conn = None
                await asyncio.sleep(0.05)
    finally:
        if conn is not None and conn.transport is not None:
            conn.transport.close()


async def _watch_lag(job: Job, out: _Collector) -> None:
    while time.monotonic() < job.window[1]:
        before = time.monotonic()
        await asyncio.sleep(LAG_TICK)
        if job.window[0] <= before:
            out.lags.append(time.monotonic() - before - LAG_TICK)


async def _drive(job: Job) -> WorkerReport:
    out = _Collector(job)
    await asyncio.gather(_watch_lag(job, out), *(_slot(job, s, out) for s in job.slots))
    out.report.latencies = out.latencies.tobytes()
    out.report.lags = out.lags.tobytes()
    return out.report


def _worker(conn: Connection) -> None:
    """A client process: runs the jobs it is sent until None or its parent's end (EOF)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the parent, which stops us
    for _ in range(MAX_JOBS_PER_WORKER):
        try:
            job = conn.recv()
        except EOFError:
            return
        if job is None:
            return
        conn.send(_run_async(_drive(job)))


class Clients:
    """`count` client processes; a run's slots are dealt out among them."""

    def __init__(self, count: int) -> None:
        context = multiprocessing.get_context("spawn")
        self.procs: list[BaseProcess] = []
        self.conns: list[Connection] = []
        for k in range(count):
            parent, child = context.Pipe()
            proc = context.Process(target=_worker, args=(child,), name=f"scale-client-{k}", daemon=True)
            proc.start()
            child.close()
            self.procs.append(proc)
            self.conns.append(parent)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs if p.pid is not None]

    def start(self, job: Job) -> int:
        """Deal the job's slots out (slot k to worker k mod count); returns how many workers got some."""
        busy = 0
        for k, conn in enumerate(self.conns):
            if share := job.slots[k :: len(self.conns)]:
                conn.send(dataclasses.replace(job, slots=share))
                busy += 1
        return busy

    def collect(self, busy: int, deadline: float) -> list[WorkerReport]:
        reports: list[WorkerReport] = []
        for conn in self.conns[:busy]:
            if not conn.poll(max(0.0, deadline - time.monotonic())):
                raise ProcessFailed("a client process sent no report before the run's deadline")
            try:
                reports.append(conn.recv())
            except EOFError:
                raise ProcessFailed("a client process died during a run") from None
        return reports

    def stop(self) -> None:
        for conn in self.conns:
            with contextlib.suppress(OSError):
                conn.send(None)
        for proc in self.procs:
            proc.join(3)
            if proc.is_alive():
                proc.kill()
                proc.join(3)


# --- measuring the processes ---------------------------------------------------------------------------


def rss_kib(pid: int) -> int | None:
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return None


def children(parent: int) -> list[int]:
    pids: list[int] = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, ValueError, IndexError):
                if int((entry / "stat").read_text().rpartition(")")[2].split()[1]) == parent:
                    pids.append(int(entry.name))
    return pids


def etcd_counters(endpoint: str) -> dict[str, float]:
    with urllib.request.urlopen(f"http://{endpoint}/metrics", timeout=5) as response:
        text = response.read().decode()
    values: dict[str, float] = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if not line.startswith("#") and value:
            values[name] = float(value)
    return {key: values.get(metric, math.nan) for key, metric in ETCD_COUNTERS.items()}


@dataclass
class Processes:
    """Every process this bench started, by role (`envoy plain`, `envoy gateway`, `sidecar`, `upstream`,
    `etcd`, `clients`, `bench`), and etcd's client endpoint."""

    pids: dict[str, list[int]]
    etcd_endpoint: str

    def cpu(self) -> dict[str, float]:
        try:
            return {role: sum(cpu_seconds(p) for p in pids) for role, pids in self.pids.items()}
        except OSError as exc:  # e.g. the gateway restarted an Envoy that died: the run is void
            raise ProcessFailed(f"a measured process is gone: {exc}") from None

    def rss(self, role: str) -> int | None:
        samples = [rss_kib(pid) for pid in self.pids[role]]
        return None if None in samples else sum(s for s in samples if s is not None)


@dataclass
class Idle:
    sidecar_cpu: float  # CPU seconds per second with no load (in its per-chunk CPU too)
    rss_kib: dict[str, int]  # sidecar and each Envoy, after the warm-up
    etcd_rate: dict[str, float]  # etcd's counters per second with no load (the gateway's background)


def measure_idle(procs: Processes) -> Idle:
    cpu0, etcd0, t0 = procs.cpu(), etcd_counters(procs.etcd_endpoint), time.monotonic()
    time.sleep(IDLE_SECONDS)
    cpu1, etcd1, elapsed = procs.cpu(), etcd_counters(procs.etcd_endpoint), time.monotonic() - t0
    roles = ("sidecar", "sidecar helpers", "envoy plain", "envoy gateway")
    return Idle(
        sidecar_cpu=(cpu1["sidecar"] - cpu0["sidecar"]) / elapsed,
        rss_kib={role: procs.rss(role) or 0 for role in roles},
        etcd_rate={k: (etcd1[k] - etcd0[k]) / elapsed for k in ETCD_COUNTERS},
    )


# --- one run: one setup at one width --------------------------------------------------------------------


@dataclass
class Run:
    setup: str
    width: int
    rate: float
    chunks_per_stream: int
    window: tuple[float, float]
    reports: list[WorkerReport]
    cpu: dict[str, float]  # role -> CPU seconds in the window
    cpu_seconds: float  # how long the CPU window was, as measured here
    machine_busy: float  # CPU seconds of the whole machine in the window
    rss_kib: dict[str, list[int]]  # sidecar, the setup's Envoy -> samples in the window
    etcd: dict[str, float]  # counter deltas over the whole run
    etcd_seconds: float


def _sleep_until(when: float) -> None:
    time.sleep(max(0.0, when - time.monotonic()))


def run_once(
    setup: str,
    port: int,
    width: int,
    *,
    rate: float,
    stream_seconds: float,
    seconds: float,
    procs: Processes,
    clients: Clients,
) -> Run:
    """`width` slots through one setup: slots start over one stream's length, the window opens once every
    slot has started, no stream starts after it closes; this process samples CPU and RSS meanwhile."""
    chunks = max(1, round(rate * stream_seconds))
    start_at = time.monotonic() + 0.5
    window_start = start_at + stream_seconds + SETTLE_SECONDS
    window = (window_start, window_start + seconds)
    timeout = 60 + 10 * chunks / rate  # a saturated gateway slows streams down; this only bounds them
    job = Job(port, tuple(range(width)), width, chunks, start_at, stream_seconds, window, timeout)
    watched = ("sidecar", "envoy gateway") if setup == "gateway" else ("envoy plain",)
    etcd0, etcd_t0 = etcd_counters(procs.etcd_endpoint), time.monotonic()
    busy = clients.start(job)
    _sleep_until(window[0])
    cpu0, machine0, t0 = procs.cpu(), machine_busy_seconds(), time.monotonic()
    rss: dict[str, list[int]] = {role: [] for role in watched}
    for _ in range(math.ceil(seconds) + 1):  # one RSS sample a second
        for role in watched:
            if (kib := procs.rss(role)) is not None:
                rss[role].append(kib)
        if time.monotonic() + 1.0 >= window[1]:
            break
        time.sleep(1.0)
    _sleep_until(window[1])
    cpu1, machine1, t1 = procs.cpu(), machine_busy_seconds(), time.monotonic()
    reports = clients.collect(busy, window[1] + timeout + 30)
    time.sleep(JOURNAL_LAND_SECONDS)
    etcd1, etcd_t1 = etcd_counters(procs.etcd_endpoint), time.monotonic()
    return Run(
        setup=setup,
        width=width,
        rate=rate,
        chunks_per_stream=chunks,
        window=window,
        reports=reports,
        cpu={role: cpu1[role] - cpu0[role] for role in cpu0},
        cpu_seconds=t1 - t0,
        machine_busy=machine1 - machine0,
        rss_kib=rss,
        etcd={k: etcd1[k] - etcd0[k] for k in ETCD_COUNTERS},
        etcd_seconds=etcd_t1 - etcd_t0,
    )


# --- summaries ------------------------------------------------------------------------------------------


def summarize(run: Run, idle: Idle) -> dict[str, Any]:
    """One run's figures (JSON-able): the window's chunks, latencies, CPU and RSS; the whole run's streams
    and etcd counters."""
    lo, hi = (int(t * 1e9) for t in run.window)
    streams = [s for r in run.reports for s in r.streams]
    latencies, lags = array("q"), array("d")
    for r in run.reports:
        latencies.frombytes(r.latencies)
        lags.frombytes(r.lags)
    lat = latencies.tolist()
    window_s = (hi - lo) / 1e9
    chunks = len(lat)
    ttft = [first - sent for sent, first, _, _, _, _ in streams if lo <= sent < hi and first]
    in_flight = sum(max(0, min(end, hi) - max(sent, lo)) for sent, _, end, _, _, _ in streams) / (hi - lo)
    gaps = [
        (end - first) / (n - 1)
        for sent, first, end, n, complete, _ in streams
        if complete and first and n > 1
    ]
    envoy = f"envoy {run.setup}"
    roles = ["upstream", "clients", "etcd", envoy]
    roles += ["sidecar", "sidecar helpers"] if run.setup == "gateway" else []
    out: dict[str, Any] = {
        "setup": run.setup,
        "width": run.width,
        "streams": len(streams),
        "complete": sum(1 for s in streams if s[4]),
        "violations": [s[5] for s in streams if not s[4]],
        "violations_by_kind": dict(Counter(failure_kind(str(s[5])) for s in streams if not s[4])),
        "in_flight_mean": in_flight,
        "chunks_in_window": chunks,
        "chunks_per_second": chunks / window_s,
        "offered_per_second_nominal": run.width * run.rate,
        "token_interval_ms_mean": sum(gaps) / len(gaps) / 1e6 if gaps else None,
        "latency_ms": {f"p{q}": _ms(percentile(lat, q)) for q in (50, 90, 99, 99.9)}
        | {"max": _ms(max(lat, default=None))},
        "ttft_ms": {f"p{q}": _ms(percentile(ttft, q)) for q in (50, 90, 99)} | {"n": len(ttft)},
        "cpu_seconds": {role: run.cpu[role] for role in roles},
        "cpu_us_per_chunk": {role: run.cpu[role] / chunks * 1e6 if chunks else None for role in roles},
        "cpu_share_of_one_core": {role: run.cpu[role] / run.cpu_seconds for role in roles},
        "machine_busy_share": run.machine_busy / run.cpu_seconds / (os.cpu_count() or 1),
        "others_share_of_one_core": max(0.0, run.machine_busy - sum(run.cpu.values())) / run.cpu_seconds,
        "client_lag_ms": {"p99": _ms_s(percentile(lags.tolist(), 99)), "max": _ms_s(max(lags, default=None))},
        "rss_kib": {role: {"max": max(v, default=None), "samples": v} for role, v in run.rss_kib.items()},
    }
    per_stream: dict[str, float | None] = {}
    for role, samples in run.rss_kib.items():
        base = idle.rss_kib.get(role)
        per_stream[role] = (max(samples) - base) / run.width if samples and base else None
    out["rss_kib_per_stream"] = per_stream
    if run.setup == "gateway":
        requests = max(1, len(streams))
        out["etcd_per_request"] = {
            k: (v - idle.etcd_rate[k] * run.etcd_seconds) / requests for k, v in run.etcd.items()
        }
        out["etcd_raw"] = run.etcd | {"seconds": run.etcd_seconds, "requests": len(streams)}
    return out


def _ms(ns: float | None) -> float | None:
    return None if ns is None else ns / 1e6


def _ms_s(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1e3


# --- the report -----------------------------------------------------------------------------------------

_L, _C = 34, 12


def _f(v: float | None, digits: int = 1) -> str:
    return "-" if v is None else f"{v:,.{digits}f}"


def _pair(label: str, p: float | None, g: float | None, digits: int = 1, *, added: bool = True) -> str:
    cells = [_f(p, digits), _f(g, digits)]
    if p is not None and g is not None:
        cells.append(f"{g - p:+,.{digits}f}" if added else "")
        cells.append(f"{g / p:.2f}×" if p > 0 else "-")
    return f"{label:<{_L}}" + "".join(f"{c:>{_C}}" for c in cells)


def _gateway_only(label: str, value: str) -> str:
    return f"{label:<{_L}}{'-':>{_C}}{value:>{_C}}"


def step_table(p: dict[str, Any], g: dict[str, Any], args: argparse.Namespace) -> str:
    n = g["width"]
    pct = 100.0
    chunks = max(1, round(args.rate * args.stream_seconds))
    lines = [
        f"N = {n} streams at once: {args.rate:g} content events/s each, {chunks} per stream, a new stream "
        f"every {args.stream_seconds:g} s per slot; window {args.seconds:g} s",
        f"{'':<{_L}}" + "".join(f"{h:>{_C}}" for h in ("plain", "gateway", "added", "ratio")),
        f"{'streams complete / started':<{_L}}"
        + "".join(f"{str(s['complete']) + '/' + str(s['streams']):>{_C}}" for s in (p, g)),
        _pair("contract violations", len(p["violations"]), len(g["violations"]), 0, added=False),
        _pair("streams in flight (mean)", p["in_flight_mean"], g["in_flight_mean"], added=False),
        _pair("chunks/s carried", p["chunks_per_second"], g["chunks_per_second"], 0, added=False),
        _pair("token interval (ms, mean)", p["token_interval_ms_mean"], g["token_interval_ms_mean"], 2),
        _pair("chunk latency p50 (ms)", p["latency_ms"]["p50"], g["latency_ms"]["p50"], 3),
        _pair("chunk latency p99 (ms)", p["latency_ms"]["p99"], g["latency_ms"]["p99"], 3),
        _pair("time to first content p50 (ms)", p["ttft_ms"]["p50"], g["ttft_ms"]["p50"], 2),
        _pair("time to first content p99 (ms)", p["ttft_ms"]["p99"], g["ttft_ms"]["p99"], 2),
        _pair(
            "envoy CPU (µs/chunk)",
            p["cpu_us_per_chunk"]["envoy plain"],
            g["cpu_us_per_chunk"]["envoy gateway"],
        ),
        _pair(
            "envoy CPU (% of one core)",
            p["cpu_share_of_one_core"]["envoy plain"] * pct,
            g["cpu_share_of_one_core"]["envoy gateway"] * pct,
            0,
        ),
        _gateway_only("sidecar CPU (µs/chunk)", _f(g["cpu_us_per_chunk"]["sidecar"])),
        _gateway_only("sidecar CPU (% of one core)", _f(g["cpu_share_of_one_core"]["sidecar"] * pct, 0)),
        _gateway_only("sidecar RSS peak (MiB)", _f(_mib(g["rss_kib"]["sidecar"]["max"]))),
        _gateway_only("sidecar RSS per stream (KiB)", _f(g["rss_kib_per_stream"]["sidecar"])),
        _pair(
            "envoy RSS per stream (KiB)",
            p["rss_kib_per_stream"]["envoy plain"],
            g["rss_kib_per_stream"]["envoy gateway"],
        ),
    ]
    etcd = g["etcd_per_request"]
    lines += [
        _gateway_only("etcd writes per request (raft)", _f(etcd["writes"], 2)),
        _gateway_only("  puts / txns per request", f"{etcd['puts']:.2f} / {etcd['txns']:.2f}"),
        _gateway_only("  revisions per request", _f(etcd["revisions"], 2)),
        _gateway_only("  KiB put per request", _f(etcd["put_bytes"] / 1024, 2)),
        _gateway_only(
            "  ranges / lease grants per req.", f"{etcd['ranges']:.2f} / {etcd['lease_grants']:.2f}"
        ),
    ]
    for role in ("upstream", "clients", "etcd"):
        lines.append(
            _pair(
                f"{role} CPU (% of one core)",
                p["cpu_share_of_one_core"][role] * pct,
                g["cpu_share_of_one_core"][role] * pct,
                0,
                added=False,
            )
        )
    lines += [
        _pair(
            f"machine busy (% of {os.cpu_count()} cores)",
            p["machine_busy_share"] * pct,
            g["machine_busy_share"] * pct,
            0,
            added=False,
        ),
        _pair(
            "others (% of one core)",
            p["others_share_of_one_core"] * pct,
            g["others_share_of_one_core"] * pct,
            0,
            added=False,
        ),
        _pair("client loop lag max (ms)", p["client_lag_ms"]["max"], g["client_lag_ms"]["max"], added=False),
    ]
    for s in (p, g):
        kinds = Counter(failure_kind(str(e)) for e in s["violations"])
        for kind, count in kinds.most_common():
            example = next(str(e) for e in s["violations"] if failure_kind(str(e)) == kind)
            lines.append(f"  ! {s['setup']}: {count} × {kind}, e.g. {' '.join(example.split())[:240]}")
    return "\n".join(lines)


_FRAME_CODE = re.compile(r'"code": ?"([a-z_]+)"')


def failure_kind(error: str) -> str:
    """What kind of end a stream that was not complete had (the client's error text, stream_overhead's)."""
    if error.startswith("HTTP "):
        return error.split(":")[0]
    if error.startswith("in-band error"):  # the gateway's terminal frame (or a replica's error event)
        match = _FRAME_CODE.search(error)
        return f"terminal frame {match.group(1) if match else '?'}"
    for prefix, kind in (
        ("connection closed", "cut (connection closed)"),
        ("stream ended without", "ended without [DONE]"),
        ("ended with [DONE] after", "events missing before [DONE]"),
        ("no end within", "no end within the client's bound"),
        ("connect:", "connect failed"),
    ):
        if error.startswith(prefix):
            return kind
    return error[:60]


def _mib(kib: float | None) -> float | None:
    return None if kib is None else kib / 1024


def _p50_p99(ms: dict[str, float | None]) -> str:
    return f"{_f(ms['p50'])}/{_f(ms['p99'])}"


def curve_table(steps: list[tuple[dict[str, Any], dict[str, Any]]]) -> str:
    """One line per width, gateway against plain: the rate carried, CPU per chunk, latency added, time to
    first content, memory per stream, etcd writes per request, violations."""
    head = (
        f"{'N':>5} {'chunks/s plain/gw':>17} {'sidecar µs/chunk':>16} {'busy':>5} "
        f"{'envoy µs/chunk p/gw':>19} {'ratio':>6} {'added p50/p99 ms':>16} {'TTFT p50/p99 ms (plain)':>29} "
        f"{'RSS KiB/stream sc/envoy':>23} {'etcd w/req':>10} {'viol.':>6}"
    )
    lines = [head]
    for p, g in steps:
        pe, ge = p["cpu_us_per_chunk"]["envoy plain"], g["cpu_us_per_chunk"]["envoy gateway"]
        added = [
            None
            if p["latency_ms"][q] is None or g["latency_ms"][q] is None
            else g["latency_ms"][q] - p["latency_ms"][q]
            for q in ("p50", "p99")
        ]
        ttft = f"{_p50_p99(g['ttft_ms'])} ({_p50_p99(p['ttft_ms'])})"
        rss = f"{_f(g['rss_kib_per_stream']['sidecar'])}/{_f(g['rss_kib_per_stream']['envoy gateway'])}"
        lines.append(
            f"{g['width']:>5} {_f(p['chunks_per_second'], 0) + '/' + _f(g['chunks_per_second'], 0):>17} "
            f"{_f(g['cpu_us_per_chunk']['sidecar']):>16} "
            f"{_f(g['cpu_share_of_one_core']['sidecar'] * 100, 0) + '%':>5} "
            f"{_f(pe) + '/' + _f(ge):>19} {(f'{ge / pe:.2f}×' if pe and ge else '-'):>6} "
            f"{'/'.join(f'{a:+.2f}' if a is not None else '-' for a in added):>16} {ttft:>29} "
            f"{rss:>23} {_f(g['etcd_per_request']['writes'], 2):>10} "
            f"{len(p['violations']) + len(g['violations']):>6}"
        )
    return "\n".join(lines)


def sizing(
    steps: list[tuple[dict[str, Any], dict[str, Any]]], idle: Idle, saturated_at: int | None
) -> list[str]:
    """What 1 000 streams need, scaled from the widest step below saturation (its CPU per chunk is higher
    than a wider step's would be, so this errs on the generous side): CPU per chunk × the rate plain Envoy
    carried there (what the upstream offered), RSS idle + per stream × 1 000."""
    below = [(p, g) for p, g in steps if saturated_at is None or g["width"] < saturated_at] or steps[:1]
    p, g = below[-1]
    rate = p["chunks_per_second"] / p["width"]  # per stream
    cores = {r: (g["cpu_us_per_chunk"][r] or 0.0) * 1e-6 * rate * 1000 for r in ("sidecar", "envoy gateway")}
    per_stream = {r: g["rss_kib_per_stream"][r] or 0.0 for r in ("sidecar", "envoy gateway")}
    base = {"sidecar": idle.rss_kib["sidecar"] + idle.rss_kib["sidecar helpers"]}
    base["envoy gateway"] = idle.rss_kib["envoy gateway"]
    mib = {r: (base[r] + per_stream[r] * 1000) / 1024 for r in base}
    out = [
        f"per 1 000 streams at {rate:.1f} chunks/s each (scaled from N = {g['width']}): sidecar "
        f"{cores['sidecar']:.2f} cores, Envoy {cores['envoy gateway']:.2f} cores; RSS sidecar "
        f"{mib['sidecar']:.0f} MiB (its helpers included), Envoy {mib['envoy gateway']:.0f} MiB (idle + per "
        "stream × 1 000); etcd apart (shared by every gateway)"
    ]
    if cores["sidecar"] > SATURATED:
        # Today's gateway has one sidecar process: past one core, more gateway replicas.
        each = math.floor(SATURATED / cores["sidecar"] * 1000)
        pods = math.ceil(1000 / max(1, each))
        pod_mib = sum(base[r] + per_stream[r] * each for r in base) / 1024
        envoy = cores["envoy gateway"] * each / 1000
        out.append(
            f"  one sidecar process (≤ {SATURATED * 100:.0f}% of a core) carries ~{each} such streams: "
            f"1 000 streams = {pods} gateway Pods of ~{SATURATED + envoy:.1f} cores (sidecar "
            f"{SATURATED:.2f} + Envoy {envoy:.2f}) and ~{pod_mib:.0f} MiB each"
        )
    return out


def verdicts(steps: list[tuple[dict[str, Any], dict[str, Any]]], idle: Idle, args: argparse.Namespace) -> str:
    """Where one sidecar process saturates, what a Pod needs per 1 000 streams, whether etcd's writes per
    request stay flat, and the contract."""
    lines: list[str] = []
    saturated = None
    for p, g in steps:
        busy = g["cpu_share_of_one_core"]["sidecar"]
        carried = g["chunks_per_second"] / p["chunks_per_second"] if p["chunks_per_second"] else 0.0
        if busy >= SATURATED or carried < SATURATED:
            saturated = (g["width"], busy, carried, g["machine_busy_share"])
            break
    top_p, top_g = steps[-1]
    top_cost = top_g["cpu_us_per_chunk"]["sidecar"]
    if saturated is not None:
        n, busy, carried, machine = saturated
        lines.append(
            f"saturation: at N = {n} the sidecar used {busy * 100:.0f}% of one core and the gateway carried "
            f"{carried:.2f}× plain's chunks/s (the machine: {machine * 100:.0f}% of {os.cpu_count()} cores "
            "busy)"
        )
    else:
        busy = top_g["cpu_share_of_one_core"]["sidecar"]
        capacity = 1e6 / top_cost if top_cost else None
        lines.append(
            f"saturation: not reached up to N = {top_g['width']} (sidecar {busy * 100:.0f}% of one core, "
            f"carried {top_g['chunks_per_second'] / top_p['chunks_per_second']:.2f}× plain); at "
            f"{_f(top_cost)} µs/chunk one process's core would carry ~{_f(capacity, 0)} chunks/s "
            f"≈ {_f(capacity / args.rate if capacity else None, 0)} streams at {args.rate:g}/s "
            "(the cost per chunk falls as streams are added, so this is a lower bound)"
        )
    lines += sizing(steps, idle, saturated[0] if saturated else None)
    writes = [g["etcd_per_request"]["writes"] for _, g in steps]
    spread = max(writes) / min(writes) if min(writes) > 0 else math.inf
    word = "flat" if spread <= 1.1 else "NOT flat"
    lines.append(
        f"etcd writes per request: {' / '.join(f'{w:.2f}' for w in writes)} at N = "
        f"{' / '.join(str(g['width']) for _, g in steps)}: {word} (max/min {spread:.2f}); "
        f"idle background {idle.etcd_rate['writes']:.1f} writes/s subtracted"
    )
    bad = sum(len(p["violations"]) + len(g["violations"]) for p, g in steps)
    total = sum(p["streams"] + g["streams"] for p, g in steps)
    kinds = Counter(failure_kind(str(e)) for p, g in steps for e in p["violations"] + g["violations"])
    by_kind = f": {', '.join(f'{n} × {k}' for k, n in kinds.most_common())}" if kinds else ""
    lines.append(f"contract: {bad} of {total} streams did not end complete with [DONE] (must be 0){by_kind}")
    return "\n".join(lines)


# --- main -----------------------------------------------------------------------------------------------


def start_upstream(args: argparse.Namespace, work: Path) -> tuple[Child, int]:
    (port,) = free_ports(1, HOST)
    argv = [sys.executable, str(BENCH_DIR / "sse_upstream.py"), "--listen", f"{HOST}:{port}"]
    argv += ["--interval-ms", f"{1000 / args.rate:.3f}", "--prefill-ms", f"{args.prefill_ms:g}"]
    child = Child("upstream", argv, log_path=work / "upstream.log")
    return child, port


def start_gateway_and_find_envoy(
    port: int, upstream_port: int, etcd_endpoint: str, work: Path, stack: contextlib.ExitStack
) -> tuple[int, int]:
    """`router-sidecar gateway` (its process is the sidecar; its Envoy is its child): the two pids."""
    gateway = start_gateway(port, upstream_port, etcd_endpoint, work)
    envoy_pid = child_pid(gateway.pid, "envoy")

    def stop() -> None:
        gateway.stop(timeout=15)
        _kill_if_envoy(envoy_pid)  # only an Envoy orphaned by a gateway that died is still there

    stack.callback(stop)
    if envoy_pid is None:
        raise ProcessFailed("gateway is ready but its envoy child was not found in /proc")
    return gateway.pid, envoy_pid


def _run(
    args: argparse.Namespace, envoy: str, work: Path, stack: contextlib.ExitStack
) -> tuple[Idle, list[tuple[dict[str, Any], dict[str, Any]]]]:
    """Start everything (each stop registered on `stack` at once), warm up, then the steps."""
    clients = Clients(args.clients)  # first: the spawned clients inherit none of the others' descriptors
    stack.callback(clients.stop)
    upstream, upstream_port = start_upstream(args, work)
    stack.callback(upstream.stop)
    wait_until(lambda: port_open(HOST, upstream_port), timeout=15, what="bench upstream", child=upstream)
    etcd, etcd_endpoint = start_etcd(work / "etcd", log_path=work / "etcd.log")
    stack.callback(etcd.stop)

    (plain_port,) = free_ports(1, HOST)
    # The gateway's own listener, route and cluster (stream_overhead.plain_envoy_config drops the rest).
    listen, replica = Endpoint(HOST, plain_port), Endpoint(HOST, upstream_port)
    unused_socket, access_log, admin = (
        work / "unused.sock",
        work / "plain-access.log",
        work / "plain-admin.sock",
    )
    spec = GatewaySpec(listen, (replica,), unused_socket, access_log, load_policy(None), admin)
    plain = start_plain_envoy(envoy, spec, work)
    stack.callback(plain.stop)
    (gateway_port,) = free_ports(1, HOST)
    sidecar_pid, gateway_envoy = start_gateway_and_find_envoy(
        gateway_port, upstream_port, etcd_endpoint, work, stack
    )

    procs = Processes(
        pids={
            "envoy plain": [plain.pid],
            "envoy gateway": [gateway_envoy],
            "sidecar": [sidecar_pid],
            # The sidecar's own helpers (its large-body parser worker, multiprocessing's resource tracker).
            "sidecar helpers": [pid for pid in children(sidecar_pid) if pid != gateway_envoy],
            "upstream": [upstream.pid],
            "etcd": [etcd.pid],
            "clients": clients.pids,
            "bench": [os.getpid()],
        },
        etcd_endpoint=etcd_endpoint,
    )
    ports = {"plain": plain_port, "gateway": gateway_port}
    print(
        f"measuring: upstream :{upstream_port}, plain envoy :{plain_port}, gateway :{gateway_port}, "
        f"etcd {etcd_endpoint}, {args.clients} client processes; work dir {work}",
        file=sys.stderr,
        flush=True,
    )
    for setup in SETUPS:  # unmeasured: first-request costs, connection pools, Python's warm-up
        warm = run_once(
            setup,
            ports[setup],
            min(20, args.steps[0]),
            rate=args.rate,
            stream_seconds=1.0,
            seconds=1.0,
            procs=procs,
            clients=clients,
        )
        if bad := [s[5] for r in warm.reports for s in r.streams if not s[4]]:
            raise ProcessFailed(f"warm-up through {setup}: {len(bad)} streams failed, first: {bad[0]}")
    time.sleep(BETWEEN_RUNS_SECONDS)
    idle = measure_idle(procs)
    steps: list[tuple[dict[str, Any], dict[str, Any]]] = []
    for i, width in enumerate(args.steps):
        by_setup: dict[str, dict[str, Any]] = {}
        for setup in SETUPS if i % 2 == 0 else SETUPS[::-1]:  # alternate, so drift hits both alike
            time.sleep(BETWEEN_RUNS_SECONDS)
            run = run_once(
                setup,
                ports[setup],
                width,
                rate=args.rate,
                stream_seconds=args.stream_seconds,
                seconds=args.seconds,
                procs=procs,
                clients=clients,
            )
            by_setup[setup] = summary = summarize(run, idle)
            lat = summary["latency_ms"]
            print(
                f"  N = {width} {setup}: {summary['complete']}/{summary['streams']} complete, "
                f"{summary['chunks_per_second']:.0f} chunks/s, p50 {_f(lat['p50'], 3)} ms, "
                f"p99 {_f(lat['p99'], 3)} ms",
                file=sys.stderr,
                flush=True,
            )
        steps.append((by_setup["plain"], by_setup["gateway"]))
    return idle, steps


def _code_version() -> str:
    import router_sidecar

    root = Path(router_sidecar.__file__).resolve().parents[1]
    try:
        out = subprocess.run(
            ["git", "-C", str(root), "describe", "--always", "--dirty"],
            capture_output=True,
            text=True,
            timeout=10,
        )
    except OSError:
        return f"{root} (no git)"
    return f"{root} at {out.stdout.strip() or '? (not a git checkout)'}"


def _report(
    args: argparse.Namespace,
    envoy: str,
    idle: Idle,
    steps: list[tuple[dict[str, Any], dict[str, Any]]],
    command: list[str],
) -> None:
    print(
        f"machine: {os.cpu_count()} CPUs, Envoy {_envoy_version(envoy)}, Python {sys.version.split()[0]}, "
        f"{time.strftime('%Y-%m-%d %H:%M %Z')}; code: {_code_version()}"
    )
    mib = {role: f"{kib / 1024:.0f} MiB" for role, kib in idle.rss_kib.items()}
    print(
        f"idle gateway: sidecar {idle.sidecar_cpu * 1000:.1f} ms CPU/s, RSS sidecar {mib['sidecar']} "
        f"(its helpers {mib['sidecar helpers']}), Envoy {mib['envoy gateway']} "
        f"(plain Envoy {mib['envoy plain']}); etcd "
        f"{idle.etcd_rate['writes']:.2f} writes/s"
    )
    print(
        "per chunk: receive − send (CLOCK_MONOTONIC); added = gateway − plain, ratio = gateway / plain; CPU "
        "and latency over the window, streams and etcd over the whole run; RSS per stream = (peak in the "
        "window − idle) / N; time to first content includes the upstream's wait before its first event "
        "(one interval, 1 / --rate)"
    )
    for p, g in steps:
        print()
        print(step_table(p, g, args))
    print()
    print(f"the curve ({args.rate:g} content events/s per stream), gateway against plain Envoy, same run")
    print(curve_table(steps))
    print()
    print(verdicts(steps, idle, args))
    if args.json:
        raw = {
            "command": command,
            "args": {k: str(v) for k, v in vars(args).items()},
            "idle": dataclasses.asdict(idle),
            "steps": [{"plain": p, "gateway": g} for p, g in steps],
        }
        args.json.write_text(json.dumps(raw, indent=1))
        print(f"\nraw numbers: {args.json}")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--steps", type=_widths, default=(100, 300, 1000), help="concurrent streams per step (100,300,1000)"
    )
    parser.add_argument("--seconds", type=float, default=20.0, help="the measured window per run (20)")
    parser.add_argument(
        "--stream-seconds", type=float, default=20.0, help="one stream's length; slots restart them (20)"
    )
    parser.add_argument("--rate", type=float, default=15.0, help="content events per second per stream (15)")
    parser.add_argument(
        "--prefill-ms", type=float, default=0.0, help="the upstream's wait before content (0)"
    )
    parser.add_argument("--clients", type=int, default=2, help="client processes (2)")
    parser.add_argument("--quick", action="store_true", help="a short run: steps 20,50, 5 s, 3 s streams")
    parser.add_argument("--json", type=Path, help="write every run's figures here")
    parser.add_argument("--work-dir", type=Path, help="keep configs and logs here (default: temp, removed)")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.seconds, args.stream_seconds = (20, 50), 5.0, 3.0
    if not 1 <= args.seconds <= 600 or not 1 <= args.stream_seconds <= 600:
        parser.error("--seconds and --stream-seconds must be 1..600")
    if not 0.5 <= args.rate <= 1000:
        parser.error("--rate must be 0.5..1000")
    if not 0 <= args.prefill_ms <= 10_000:
        parser.error("--prefill-ms must be 0..10000")
    if not 1 <= args.clients <= 16:
        parser.error("--clients must be 1..16")
    return args


def raise_fd_limit(widest: int) -> None:
    """Each stream holds a client socket, and Envoy a downstream and an upstream one (plus the gRPC
    streams): raise the soft limit towards the hard one, which every process started here inherits."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = 4 * widest + 1024
    if soft != resource.RLIM_INFINITY and soft < want:
        target = want if hard == resource.RLIM_INFINITY else min(want, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        if target < want:
            print(f"warning: open files limited to {target} (want {want})", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    command = sys.orig_argv if argv is None else [sys.executable, __file__, *argv]
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    print(f"command: {shlex.join(command)}")
    signal.signal(signal.SIGTERM, _raise_interrupt)  # SIGTERM unwinds like Ctrl-C: every process stops
    raise_fd_limit(max(args.steps))
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="bench-scale-"))
    work.mkdir(parents=True, exist_ok=True)
    envoy = find_envoy()
    try:
        with contextlib.ExitStack() as stack:  # each process's stop, run in reverse start order
            idle, steps = _run(args, envoy, work, stack)
    except (KeyboardInterrupt, ProcessFailed) as exc:
        interrupted = isinstance(exc, KeyboardInterrupt)
        why = "interrupted" if interrupted else f"error: {exc}"
        print(f"{why}\nevery process stopped; logs in {work}", file=sys.stderr)
        return 130 if interrupted else 1
    _report(args, envoy, idle, steps, command)
    if args.work_dir is None:
        shutil.rmtree(work, ignore_errors=True)
    violations = sum(len(p["violations"]) + len(g["violations"]) for p, g in steps)
    return 1 if violations else 0


if __name__ == "__main__":
    sys.exit(main())
