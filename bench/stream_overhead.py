"""What the gateway adds to a token stream: plain Envoy vs. Envoy + sidecar, measured in one run.

Both setups front the same bench upstream (bench/sse_upstream.py) with the same listener, route and
cluster; the plain one is the gateway's own rendered config minus the ext_proc filters and the gRPC
access logger. Streams alternate between the two setups, so drift of the machine hits both alike.
Per content chunk: receive time − send time (both CLOCK_MONOTONIC, system-wide on Linux); per stream:
time from sending the request to the first content chunk. Each API (`--apis`: chat completions and the
Responses API by default) is measured the same way in the same run, its phases one after the other. See
bench/README.md.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import yaml

from router_sidecar.coordination.store import EtcdStore
from router_sidecar.core.policy import load_policy
from router_sidecar.runtime.envoy_config import Endpoint, GatewaySpec, find_envoy, render
from router_sidecar.runtime.supervise import (
    Child,
    ProcessFailed,
    envoy_ready,
    free_port,
    port_open,
    start_envoy,
    start_etcd,
    wait_until,
)

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
HOST = "127.0.0.1"
_CLK_TCK = os.sysconf("SC_CLK_TCK")
# The upstream's timestamp: chat's delta.content, the Responses API's output_text.delta `delta`.
_TS_RE = re.compile(rb'"(?:content|delta)":"(\d+)')
APIS = {"chat": "/v1/chat/completions", "responses": "/v1/responses"}
API_TITLES = {"chat": "POST /v1/chat/completions", "responses": "POST /v1/responses"}
# What ends a stream well, and what is a failure, per API (the Responses API has no [DONE]).
_END = {"chat": b"data: [DONE]", "responses": b"event: response.completed"}
_FAILED = {"chat": (b'{"error"',), "responses": (b"event: response.failed", b"event: error")}
IDLE_SECONDS = 2.0


# --- plain Envoy config ------------------------------------------------------------------------


def plain_envoy_config(rendered: str) -> dict[str, Any]:
    """The gateway's config without the sidecar's part: no ext_proc (either placement), no gRPC access log."""
    config: dict[str, Any] = yaml.safe_load(rendered)
    for listener in config["static_resources"]["listeners"]:
        for chain in listener["filter_chains"]:
            for net_filter in chain["filters"]:
                hcm = net_filter["typed_config"]
                hcm["http_filters"] = [
                    f for f in hcm["http_filters"] if f["name"] != "envoy.filters.http.ext_proc"
                ]
                hcm["access_log"] = [
                    a for a in hcm.get("access_log", []) if a["name"] != "envoy.access_loggers.http_grpc"
                ]
    for cluster in config["static_resources"]["clusters"]:
        if cluster["name"] == "llm":
            for options in cluster.get("typed_extension_protocol_options", {}).values():
                options.pop("http_filters", None)
    return config


# --- client ------------------------------------------------------------------------------------


@dataclass
class StreamResult:
    sent_ns: int = 0
    first_content_ns: int | None = None
    latencies_ns: list[int] = field(default_factory=list)
    done: bool = False
    status: int = 0
    error: str | None = None

    @property
    def ttfd_ns(self) -> int | None:
        return None if self.first_content_ns is None else self.first_content_ns - self.sent_ns


class _ClientConn(asyncio.Protocol):
    """HTTP/1.1 keep-alive client for one stream at a time; stamps every read as it arrives.

    A Protocol rather than streams: the receive time is taken in data_received itself, with no extra
    task wake-up between the socket read and the timestamp.
    """

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.api = "chat"
        self.lost = False
        self._result = StreamResult()
        self._finished: asyncio.Future[None] | None = None
        self._buf = bytearray()
        self._events = bytearray()
        self._state = "idle"  # head, size, data, crlf, trailer, length, idle
        self._remaining = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self._finish(f"connection closed in state {self._state}: {exc}" if self._state != "idle" else None)

    def start(self, request: bytes, api: str = "chat") -> tuple[StreamResult, asyncio.Future[None]]:
        assert self.transport is not None and self._state == "idle"
        self.api = api
        self._result = StreamResult()
        self._finished = asyncio.get_running_loop().create_future()
        self._buf.clear()
        self._events.clear()
        self._state = "head"
        self._result.sent_ns = time.monotonic_ns()
        self.transport.write(request)
        return self._result, self._finished

    def _finish(self, error: str | None = None) -> None:
        if error and self._result.error is None:
            self._result.error = error
        self._state = "idle"
        if self._finished is not None and not self._finished.done():
            self._finished.set_result(None)

    def data_received(self, data: bytes) -> None:
        now = time.monotonic_ns()
        if self._state == "idle":
            return
        self._buf += data
        while self._state != "idle" and self._step(now):
            pass
        self._scan_events(now)

    def _step(self, now: int) -> bool:
        """Advance the HTTP parser by one element; False: need more bytes (or done)."""
        buf = self._buf
        if self._state == "head":
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                return False
            lines = bytes(buf[:end]).decode("latin-1").split("\r\n")
            del buf[: end + 4]
            self._result.status = int(lines[0].split()[1])
            headers = {
                k.strip().lower(): v.strip().lower() for k, _, v in (ln.partition(":") for ln in lines[1:])
            }
            if "chunked" in headers.get("transfer-encoding", ""):
                self._state = "size"
            else:
                self._remaining = int(headers.get("content-length", "0"))
                self._state = "length"
            return True
        if self._state == "size":
            end = buf.find(b"\r\n")
            if end < 0:
                return False
            size = int(bytes(buf[:end]).split(b";")[0], 16)
            del buf[: end + 2]
            self._remaining = size
            self._state = "data" if size else "trailer"
            return True
        if self._state in ("data", "length"):
            if self._remaining and not buf:
                return False
            take = min(self._remaining, len(buf))
            self._events += buf[:take]
            del buf[:take]
            self._remaining -= take
            if self._remaining == 0:
                if self._state == "length":
                    self._end_response(now)
                    return False
                self._state = "crlf"
            return True
        if self._state == "crlf":
            if len(buf) < 2:
                return False
            del buf[:2]
            self._state = "size"
            return True
        if self._state == "trailer":
            if buf.startswith(b"\r\n"):
                del buf[:2]
            else:
                end = buf.find(b"\r\n\r\n")
                if end < 0:
                    return False
                del buf[: end + 4]
            self._end_response(now)
        return False

    def _scan_events(self, now: int) -> None:
        end = self._events.rfind(b"\n\n")
        if end < 0:
            return
        complete = bytes(self._events[: end + 2])
        del self._events[: end + 2]
        result = self._result
        for match in _TS_RE.finditer(complete):
            result.latencies_ns.append(now - int(match.group(1)))
        if result.first_content_ns is None and result.latencies_ns:
            result.first_content_ns = now
        if _END[self.api] in complete:
            result.done = True
        for marker in _FAILED[self.api]:
            if marker in complete and result.error is None:
                result.error = "in-band error: " + complete[complete.find(marker) :][:300].decode(
                    errors="replace"
                )

    def _end_response(self, now: int) -> None:
        self._scan_events(now)
        if self._result.status != 200:
            body = bytes(self._events[:300]).decode(errors="replace")
            self._finish(f"HTTP {self._result.status}: {body}")
        else:
            ended = _END[self.api].decode()
            self._finish(None if self._result.done else f"stream ended without {ended}")


def _request(port: int, chunks: int, api: str = "chat") -> bytes:
    if api == "responses":
        fields: dict[str, Any] = {"input": "bench", "max_output_tokens": chunks}
    else:
        fields = {"messages": [{"role": "user", "content": "bench"}], "max_tokens": chunks}
    body = json.dumps({"model": "bench", "stream": True, **fields}).encode()
    head = (
        f"POST {APIS[api]} HTTP/1.1\r\nhost: {HOST}:{port}\r\ncontent-type: application/json\r\n"
        f"accept: text/event-stream\r\ncontent-length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


class Client:
    """One keep-alive connection to one setup; reconnects when the server closed it."""

    def __init__(self, port: int) -> None:
        self.port = port
        self._conn: _ClientConn | None = None

    async def stream(self, chunks: int, timeout: float, api: str = "chat") -> StreamResult:
        loop = asyncio.get_running_loop()
        if self._conn is None or self._conn.lost:
            _, self._conn = await asyncio.wait_for(loop.create_connection(_ClientConn, HOST, self.port), 5)
        result, finished = self._conn.start(_request(self.port, chunks, api), api)
        try:
            await asyncio.wait_for(finished, timeout)
        except TimeoutError:
            result.error = f"timed out after {timeout:.0f}s"
            self.close()
        if result.error:
            self.close()  # the connection's state is unknown now: start over on a fresh one
        return result

    def close(self) -> None:
        if self._conn is not None and self._conn.transport is not None:
            self._conn.transport.close()
        self._conn = None


# --- processes ---------------------------------------------------------------------------------


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process (all its threads, not its children) from /proc/PID/stat."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / _CLK_TCK


def machine_busy_seconds() -> float:
    """user + nice + system time of the whole machine (all cores) from /proc/stat.

    Interrupt time is left out: it is charged to no process, so it would count as "others".
    """
    user, nice, system = (int(v) for v in Path("/proc/stat").read_text().split(maxsplit=4)[1:4])
    return (user + nice + system) / _CLK_TCK


def child_pid(parent: int, comm: str) -> int | None:
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        name = stat[stat.find("(") + 1 : stat.rfind(")")]
        ppid = int(stat.rpartition(")")[2].split()[1])
        if ppid == parent and name == comm:
            return int(entry.name)
    return None


@dataclass
class Setup:
    name: str
    port: int
    envoy_pid: int
    sidecar_pid: int | None = None
    streams: list[StreamResult] = field(default_factory=list)
    cpu: dict[str, float] = field(default_factory=dict)  # process -> CPU seconds spent during its streams
    wall: float = 0.0  # seconds its measured streams took

    def pids(self) -> dict[str, int]:
        pids = {"envoy": self.envoy_pid}
        if self.sidecar_pid is not None:
            pids["sidecar"] = self.sidecar_pid
        return pids


def start_plain_envoy(envoy: str, spec: GatewaySpec, work: Path) -> Child:
    config_path = work / "plain-envoy.yaml"
    config_path.write_text(yaml.safe_dump(plain_envoy_config(render(spec)), sort_keys=False))
    # Started the way router_sidecar/runtime/gateway.py starts its Envoy.
    child = start_envoy(envoy, config_path, name="plain-envoy", log_path=work / "plain-envoy.log")
    wait_until(lambda: envoy_ready(spec.admin_socket), timeout=30, what="plain envoy ready", child=child)
    return child


def start_gateway(listen: int, upstream: int, etcd: str, work: Path) -> Child:
    argv = [sys.executable, "-m", "router_sidecar", "gateway", "--listen", f"{HOST}:{listen}"]
    argv += ["--replica", f"{HOST}:{upstream}", "--etcd", etcd, "--work-dir", str(work / "gateway")]
    log = work / "gateway.out"
    child = Child("gateway", argv, log_path=log)
    wait_until(
        lambda: log.exists() and "ready: gateway" in log.read_text(errors="replace"),
        timeout=60,
        what="gateway ready",
        child=child,
    )
    return child


def start_floor(
    envoy: str, listen: int, upstream: int, work: Path, *, holds: bool = False
) -> tuple[Child, Child]:
    """Envoy with the gateway's own config, its ext_proc pointed at `lean_extproc.py` (the gRPC floor);
    `holds`: the floor holds the response until its first content, as the sidecar does."""
    socket_path = work / "lean.sock"
    lean = Child(
        "lean-extproc",
        [sys.executable, str(BENCH_DIR / "lean_extproc.py"), "--listen", f"unix:{socket_path}"]
        + (["--hold-until-content"] if holds else []),
        log_path=work / "lean-extproc.log",
    )
    wait_until(socket_path.exists, timeout=30, what="lean ext_proc ready", child=lean)
    spec = GatewaySpec(
        listen=Endpoint(HOST, listen),
        replicas=(Endpoint(HOST, upstream),),
        sidecar_socket=socket_path,
        access_log_path=work / "floor-access.log",
        admin_socket=work / "floor-admin.sock",
        policy=load_policy(None),
    )
    config_path = work / "floor-envoy.yaml"
    config_path.write_text(render(spec))
    floor = start_envoy(envoy, config_path, name="floor-envoy", log_path=work / "floor-envoy.log")
    wait_until(lambda: envoy_ready(spec.admin_socket), timeout=30, what="floor envoy ready", child=floor)
    return lean, floor


def _kill_if_envoy(pid: int | None) -> None:
    """The gateway stops its Envoy itself; this only catches an Envoy orphaned by a gateway that died."""
    if pid is None:
        return
    with contextlib.suppress(OSError):
        if Path(f"/proc/{pid}/comm").read_text().strip() == "envoy":
            os.kill(pid, signal.SIGKILL)


# --- load --------------------------------------------------------------------------------------


def _stream_timeout(chunks: int, interval: float) -> float:
    return 30 + chunks * interval * 10


async def _measured(setup: Setup, run: Callable[[], Awaitable[list[StreamResult]]]) -> list[StreamResult]:
    before = {k: cpu_seconds(p) for k, p in setup.pids().items()}
    started = time.monotonic()
    out = await run()
    setup.wall += time.monotonic() - started
    for k, p in setup.pids().items():
        setup.cpu[k] = setup.cpu.get(k, 0.0) + cpu_seconds(p) - before[k]
    return out


async def _parallel(
    clients: list[Client], chunks: int, timeout: float, api: str = "chat"
) -> list[StreamResult]:
    return list(await asyncio.gather(*(c.stream(chunks, timeout, api) for c in clients)))


def phase_name(base: str, api: str) -> str:
    """`sequential`, `concurrent` for chat completions (as before); `sequential responses`, … for another."""
    return base if api == "chat" else f"{base} {api}"


async def run_load(setups: list[Setup], args: argparse.Namespace) -> dict[str, list[Setup]]:
    """Per API: its sequential phase (one stream at a time), then its concurrent phase; setups alternate
    throughout. The scale curve, if asked for, on chat completions last."""
    interval = args.interval_ms / 1000
    timeout = _stream_timeout(args.chunks, interval)
    warm_timeout = _stream_timeout(args.warmup_chunks, interval)
    width = max([args.concurrency, *args.curve])
    clients = {s.name: [Client(s.port) for _ in range(width)] for s in setups}

    async def warm_up(s: Setup, width: int, api: str = "chat") -> None:
        # Unmeasured: opens the client and Envoy's upstream connections, and pays the sidecar's and
        # Python's first-request costs (of this API's route too), so the measured streams see the steady
        # state.
        for r in await _parallel(clients[s.name][:width], args.warmup_chunks, warm_timeout, api):
            if r.error:
                raise ProcessFailed(f"warm-up stream ({APIS[api]}) through {s.name} failed: {r.error}")

    try:
        phases: dict[str, list[Setup]] = {}
        for api in args.apis:
            sequential = phase_name("sequential", api)
            phases[sequential] = [Setup(s.name, s.port, s.envoy_pid, s.sidecar_pid) for s in setups]
            for s in setups:
                await warm_up(s, 1, api)
            for i in range(args.streams):
                for s in phases[sequential]:
                    results = await _measured(
                        s, lambda s=s, api=api: _parallel(clients[s.name][:1], args.chunks, timeout, api)
                    )
                    s.streams += results
                    _progress(f"{sequential} {i + 1}/{args.streams} {s.name}", results)
            if args.concurrency > 1:
                concurrent = phase_name("concurrent", api)
                phases[concurrent] = [Setup(s.name, s.port, s.envoy_pid, s.sidecar_pid) for s in setups]
                for s in setups:
                    await warm_up(s, args.concurrency, api)
                for s in phases[concurrent]:
                    results = await _measured(
                        s,
                        lambda s=s, api=api: _parallel(
                            clients[s.name][: args.concurrency], args.chunks, timeout, api
                        ),
                    )
                    s.streams += results
                    _progress(f"{concurrent} ×{args.concurrency} {s.name}", results)
        curve_timeout = _stream_timeout(args.curve_chunks, interval) * 2  # queues build up at width 100
        for n in args.curve:
            phase = phases[f"curve ×{n}"] = [
                Setup(s.name, s.port, s.envoy_pid, s.sidecar_pid) for s in setups
            ]
            for s in setups:
                await warm_up(s, n)
            for s in phase:
                results = await _measured(
                    s, lambda s=s, n=n: _parallel(clients[s.name][:n], args.curve_chunks, curve_timeout)
                )
                s.streams += results
                _progress(f"curve ×{n} {s.name}", results)
        return phases
    finally:
        for cs in clients.values():
            for c in cs:
                c.close()


def _progress(label: str, results: list[StreamResult]) -> None:
    lat = [x for r in results for x in r.latencies_ns]
    errors = [r.error for r in results if r.error]
    note = f"  errors: {errors[0]}" if errors else ""
    print(
        f"  {label}: {len(lat)} chunks, p50 {_ms(percentile(lat, 50))} ms{note}",
        file=sys.stderr,
        flush=True,
    )


# --- report ------------------------------------------------------------------------------------


def percentile(values: list[int], q: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default)."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def _ms(ns: float | None) -> str:
    return "-" if ns is None else f"{ns / 1e6:.3f}"


def summarize(setup: Setup, chunks_per_stream: int) -> dict[str, Any]:
    lat = [x for r in setup.streams for x in r.latencies_ns]
    ttfd = [t for r in setup.streams if (t := r.ttfd_ns) is not None]
    received = len(lat)
    out: dict[str, Any] = {
        "streams": len(setup.streams),
        "complete_streams": sum(1 for r in setup.streams if r.done and not r.error),
        "errors": [r.error for r in setup.streams if r.error],
        "chunks_expected": len(setup.streams) * chunks_per_stream,
        "chunks_received": received,
        "latency_ns": {f"p{q}": percentile(lat, q) for q in (50, 90, 99)} | {"max": max(lat, default=None)},
        "ttfd_ns": {f"p{q}": percentile(ttfd, q) for q in (50, 99)},
        "cpu_seconds": dict(setup.cpu),
        "cpu_us_per_chunk": {k: v / received * 1e6 for k, v in setup.cpu.items()} if received else {},
    }
    sidecar = setup.cpu.get("sidecar")
    out["chunks_per_sidecar_cpu_second"] = received / sidecar if sidecar else None
    out["wall_seconds"] = setup.wall
    out["chunks_per_second"] = received / setup.wall if setup.wall else None
    # How busy the sidecar (or the lean servicer) was: 1.0 is one core, its ceiling (one event loop).
    out["sidecar_cpu_utilisation"] = sidecar / setup.wall if sidecar and setup.wall else None
    return out


# The performance targets, each against a baseline measured in the same run: what `targets` checks.
# Time to first content: half of what the gateway added over plain Envoy at 2191dbb (+8.7 ms at a 20 ms
# prefill, `--prefill-ms 20`).
TARGET_TTFD_ADDED_MS, TARGET_TTFD_PREFILL_MS = 4.4, 20.0
TARGET_CPU_OVER_FLOOR = 1.15  # the sidecar's CPU per chunk over the lean pass-through servicer's
TARGET_ENVOY_OVER_PLAIN = 2.0  # the gateway's Envoy CPU per chunk over plain Envoy's


def targets(phases: dict[str, list[Setup]], args: argparse.Namespace) -> str:
    """One row per target: the figure this run measured, its baseline from the same run, and whether it
    is met."""
    if "sequential" not in phases:
        return "targets: set on chat completions; not measured (--apis has no chat)"
    rows: list[tuple[str, str, str]] = []

    def check(label: str, value: float | None, bound: float, fmt: str, note: str = "") -> None:
        if value is None:
            rows.append((label, "-", "not measured" + (f" ({note})" if note else "")))
        else:
            rows.append((label, fmt.format(value) + (f"  {note}" if note else ""), _verdict(value <= bound)))

    one = {s.name: summarize(s, args.chunks) for s in phases["sequential"]}
    plain, gateway = one["plain"]["ttfd_ns"]["p50"], one["gateway"]["ttfd_ns"]["p50"]
    added = None if plain is None or gateway is None else (gateway - plain) / 1e6
    at = f"(set at --prefill-ms {TARGET_TTFD_PREFILL_MS:g})"
    at = "" if args.prefill_ms == TARGET_TTFD_PREFILL_MS else at
    check(
        f"time to first delta added over plain ≤ +{TARGET_TTFD_ADDED_MS:g} ms, one stream",
        added,
        TARGET_TTFD_ADDED_MS,
        "+{:.1f} ms",
        at,
    )
    widths = [("one stream", "sequential", args.chunks)]
    if "concurrent" in phases:
        widths.append((f"{args.concurrency} streams", "concurrent", args.chunks))
    widths += [(f"{n} streams (curve)", f"curve ×{n}", args.curve_chunks) for n in args.curve]
    for label, phase, chunks in widths:
        by = {s.name: summarize(s, chunks) for s in phases[phase]}
        g_cpu, p_cpu = by["gateway"]["cpu_us_per_chunk"], by["plain"]["cpu_us_per_chunk"]
        floor = by["floor"]["cpu_us_per_chunk"].get("sidecar") if "floor" in by else None
        sidecar = g_cpu.get("sidecar")
        ratio = sidecar / floor if sidecar and floor else None
        check(
            f"sidecar CPU per chunk ≤ {TARGET_CPU_OVER_FLOOR:g}× the floor's, {label}",
            ratio,
            TARGET_CPU_OVER_FLOOR,
            "{:.2f}×",
            "" if "floor" in by else "--no-floor",
        )
        envoy = _ratio(g_cpu.get("envoy"), p_cpu.get("envoy"))
        floor_envoy = (
            _ratio(by["floor"]["cpu_us_per_chunk"].get("envoy"), p_cpu.get("envoy")) if floor else None
        )
        check(
            f"envoy CPU per chunk ≤ {TARGET_ENVOY_OVER_PLAIN:g}× plain's, {label}",
            envoy,
            TARGET_ENVOY_OVER_PLAIN,
            "{:.2f}×",
            "" if floor_envoy is None else f"(floor's envoy {floor_envoy:.2f}×)",
        )
    width = max(len(label) for label, _, _ in rows)
    lines = ["targets (each against this run's own baseline, quiet machine assumed):"]
    lines += [f"  {label:<{width}}  {value:>30}  {verdict}" for label, value, verdict in rows]
    if not args.curve:
        lines.append("  100 streams: add --curve 1,10,100 (make bench does)")
    return "\n".join(lines)


def _ratio(value: float | None, baseline: float | None) -> float | None:
    return value / baseline if value and baseline else None


def _verdict(ok: bool) -> str:
    return "met" if ok else "NOT met"


_LABEL, _COL = 30, 12


def _line(label: str, *cells: str) -> str:
    return f"{label:<{_LABEL}}" + "".join(f"{c:>{_COL}}" for c in cells)


def _row(label: str, plain: float | None, gateway: float | None, *, ms: bool = True) -> str:
    if plain is None or gateway is None:
        return _line(label, _num(plain), _num(gateway))
    fmt: Callable[[float], str] = (lambda v: f"{v / 1e6:.3f}") if ms else (lambda v: f"{v:.1f}")
    added = gateway - plain
    ratio = f"{gateway / plain:.1f}×" if plain > 0 else "-"
    return _line(label, fmt(plain), fmt(gateway), ("+" if added >= 0 else "-") + fmt(abs(added)), ratio)


def table(phase: str, summaries: dict[str, dict[str, Any]], desc: str) -> str:
    p, g = summaries["plain"], summaries["gateway"]
    p_cpu, g_cpu = p["cpu_us_per_chunk"], g["cpu_us_per_chunk"]
    lines = [
        f"{phase}: {desc}",
        _line("", "plain", "gateway", "added", "ratio"),
        _row("chunk latency p50 (ms)", p["latency_ns"]["p50"], g["latency_ns"]["p50"]),
        _row("chunk latency p99 (ms)", p["latency_ns"]["p99"], g["latency_ns"]["p99"]),
        _row("time to first delta p50 (ms)", p["ttfd_ns"]["p50"], g["ttfd_ns"]["p50"]),
        _row("envoy CPU (µs/chunk)", p_cpu.get("envoy"), g_cpu.get("envoy"), ms=False),
        _line("sidecar CPU (µs/chunk)", "-", _num(g_cpu.get("sidecar"))),
        _line("chunks per sidecar CPU-s", "-", _num(g["chunks_per_sidecar_cpu_second"], 0)),
        _line("chunks received", _count(p), _count(g)),
    ]
    f = summaries.get("floor")
    if f is not None:
        # The same Envoy config and gRPC server with a servicer that only passes messages on: the part of the
        # sidecar's cost that is gRPC's, not the sidecar's decisions.
        f_cpu = f["cpu_us_per_chunk"].get("sidecar")
        ratio = f"{g_cpu['sidecar'] / f_cpu:.1f}×" if f_cpu and g_cpu.get("sidecar") else "-"
        lines += [
            _line("floor: lean ext_proc", "p50 (ms)", "p99 (ms)", "µs/chunk", "per CPU-s"),
            _line(
                "",
                _ms(f["latency_ns"]["p50"]),
                _ms(f["latency_ns"]["p99"]),
                _num(f_cpu),
                _num(f["chunks_per_sidecar_cpu_second"], 0),
            ),
            _line("sidecar CPU / floor CPU", "", "", ratio),
            # The floor passes every message on at once: its time to first delta is what the ext_proc hops
            # alone add; the gateway's excess over it is its own (holding, the journal in etcd, decisions).
            _row("time to first delta p50: floor / gateway", f["ttfd_ns"]["p50"], g["ttfd_ns"]["p50"]),
            _line("chunks received (floor)", _count(f)),
        ]
    for name, summary in summaries.items():
        for err in summary["errors"][:3]:
            lines.append(f"  ! {name}: {err}")
    return "\n".join(lines)


def api_table(phases: dict[str, list[Setup]], args: argparse.Namespace, base: str) -> str:
    """The APIs side by side for one phase: time to first content and the per-chunk cost, each against plain
    Envoy in the same run (ratio = gateway / plain)."""
    by_api = {
        api: {s.name: summarize(s, args.chunks) for s in phases[phase_name(base, api)]} for api in args.apis
    }
    width = 10
    head = "".join(f"{API_TITLES[api].removeprefix('POST '):>{4 * width}}" for api in args.apis)
    cols = "".join(
        f"{'plain':>{width}}{'gateway':>{width}}{'added':>{width}}{'ratio':>{width}}" for _ in args.apis
    )
    what = "one stream at a time" if base == "sequential" else f"{args.concurrency} streams at once"
    lines = [
        f"per API ({base}, {what}): gateway against plain Envoy, same run",
        f"{'':<30}{head}",
        f"{'':<30}{cols}",
    ]

    def cells(plain: float | None, gateway: float | None, scale: float, digits: int) -> str:
        if plain is None or gateway is None:
            return f"{_num(plain):>{width}}{_num(gateway):>{width}}{'-':>{width}}{'-':>{width}}"
        ratio = f"{gateway / plain:.1f}×" if plain > 0 else "-"
        added = gateway - plain
        sign = "+" if added >= 0 else "-"
        return (
            f"{plain / scale:>{width}.{digits}f}{gateway / scale:>{width}.{digits}f}"
            f"{f'{sign}{abs(added) / scale:.{digits}f}':>{width}}{ratio:>{width}}"
        )

    rows: list[tuple[str, Callable[[dict[str, Any]], float | None], float, int]] = [
        ("time to first content p50 (ms)", lambda s: s["ttfd_ns"]["p50"], 1e6, 3),
        ("chunk latency p50 (ms)", lambda s: s["latency_ns"]["p50"], 1e6, 3),
        ("chunk latency p99 (ms)", lambda s: s["latency_ns"]["p99"], 1e6, 3),
        ("envoy CPU (µs/chunk)", lambda s: s["cpu_us_per_chunk"].get("envoy"), 1.0, 1),
    ]
    for label, get, scale, digits in rows:
        lines.append(
            f"{label:<30}"
            + "".join(
                cells(get(by_api[a]["plain"]), get(by_api[a]["gateway"]), scale, digits) for a in args.apis
            )
        )
    sidecar = "".join(
        f"{'-':>{width}}{_num(by_api[a]['gateway']['cpu_us_per_chunk'].get('sidecar')):>{width}}"
        f"{'':>{2 * width}}"
        for a in args.apis
    )
    lines.append(f"{'sidecar CPU (µs/chunk)':<30}{sidecar}")
    if all("floor" in by_api[a] for a in args.apis):
        # The lean pass-through ext_proc on the same route: the part of the sidecar's cost that is gRPC's.
        floor = "".join(
            f"{'-':>{width}}{_num(by_api[a]['floor']['cpu_us_per_chunk'].get('sidecar')):>{width}}"
            f"{'':>{2 * width}}"
            for a in args.apis
        )
        lines.append(f"{'floor: lean ext_proc (µs/chunk)':<30}{floor}")
    received = "".join(
        f"{_count(by_api[a]['plain']):>{2 * width}}{_count(by_api[a]['gateway']):>{2 * width}}"
        for a in args.apis
    )
    lines.append(f"{'chunks received':<30}{received}")
    return "\n".join(lines)


def curve_table(rows: dict[int, dict[str, dict[str, Any]]], chunks: int, interval_ms: float) -> str:
    """One line per width: latency, the sidecar's (and the floor's) CPU per chunk and how busy it was, and
    the chunks per second that got through; the width where that stops growing is where it saturates."""
    lines = [
        f"scale curve: N streams at once × {chunks} chunks, {interval_ms:g} ms apart",
        f"{'N':>4}  {'plain p50/p99 ms':>17}  {'gateway p50/p99 ms':>19}  {'sidecar µs/chunk':>16}  "
        f"{'busy':>5}  {'chunks/s':>8}  {'floor µs/chunk':>14}  {'busy':>5}",
    ]
    best: tuple[float, int] = (0.0, 0)
    for n, by_setup in rows.items():
        p, g, f = by_setup["plain"], by_setup["gateway"], by_setup.get("floor")
        g_rate = g["chunks_per_second"] or 0.0
        best = max(best, (g_rate, n))

        def lat(s: dict[str, Any]) -> str:
            return f"{_ms(s['latency_ns']['p50'])}/{_ms(s['latency_ns']['p99'])}"

        def busy(s: dict[str, Any] | None) -> str:
            u = s["sidecar_cpu_utilisation"] if s else None
            return "-" if u is None else f"{u * 100:.0f}%"

        f_cpu = f["cpu_us_per_chunk"].get("sidecar") if f else None
        lines.append(
            f"{n:>4}  {lat(p):>17}  {lat(g):>19}  {_num(g['cpu_us_per_chunk'].get('sidecar')):>16}  "
            f"{busy(g):>5}  {_num(g_rate, 0):>8}  {_num(f_cpu):>14}  {busy(f):>5}"
        )
    lines.append(f"the gateway carried at most {best[0]:.0f} chunks/s (at N = {best[1]})")
    return "\n".join(lines)


def _num(v: float | None, digits: int = 1) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def _count(s: dict[str, Any]) -> str:
    return f"{s['chunks_received']}/{s['chunks_expected']}"


# --- main --------------------------------------------------------------------------------------


def _envoy_version(envoy: str) -> str:
    out = subprocess.run([envoy, "--version"], capture_output=True, text=True, timeout=10).stdout
    match = re.search(r"/(\d+\.\d+\.\d+)/", out)
    return match.group(1) if match else "?"


def _apis(text: str) -> tuple[str, ...]:
    apis = tuple(dict.fromkeys(a.strip() for a in text.split(",") if a.strip()))
    if not apis or any(a not in APIS for a in apis):
        raise argparse.ArgumentTypeError(f"expected a list of {', '.join(APIS)}, got {text!r}")
    return apis


def _widths(text: str) -> tuple[int, ...]:
    try:
        widths = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected numbers like 1,10,50,100, got {text!r}") from None
    if not widths or not all(1 <= w <= 1000 for w in widths):
        raise argparse.ArgumentTypeError(f"each width must be 1..1000, got {text!r}")
    return widths


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=3, help="sequential streams per setup (default 3)")
    parser.add_argument("--chunks", type=int, default=2000, help="content chunks per stream (default 2000)")
    parser.add_argument("--interval-ms", type=float, default=1.0, help="gap between chunks (default 1)")
    parser.add_argument(
        "--prefill-ms",
        type=float,
        default=0.0,
        help="the upstream's wait before its first content event, like an engine's prefill (default 0: the "
        "journal claim, which runs beside it, is then on the way to the first delta)",
    )
    parser.add_argument(
        "--apis",
        type=_apis,
        default=("chat", "responses"),
        help="the APIs to measure, each in its own phases of the same run: chat (POST /v1/chat/completions), "
        "responses (POST /v1/responses); default chat,responses",
    )
    parser.add_argument(
        "--concurrency",
        type=int,
        default=10,
        help="parallel streams of the concurrent phase (default 10; 1 skips it)",
    )
    parser.add_argument(
        "--warmup-chunks", type=int, default=200, help="chunks of the unmeasured first stream"
    )
    parser.add_argument("--json", type=Path, help="write the raw numbers (every per-chunk latency) here")
    parser.add_argument(
        "--curve",
        type=_widths,
        default=(),
        help="also a scale curve: these numbers of concurrent streams, e.g. 1,10,50,100",
    )
    parser.add_argument(
        "--curve-chunks", type=int, default=500, help="content chunks per stream in the curve (default 500)"
    )
    parser.add_argument(
        "--no-floor",
        dest="floor",
        action="store_false",
        help="skip the third setup: the same Envoy config with a lean pass-through ext_proc (the gRPC floor)",
    )
    parser.add_argument(
        "--floor-holds",
        action="store_true",
        help="the floor holds each response until its first content, as the sidecar does: the same ext_proc "
        "hops after the first content, so the time to first delta it adds is what the first-delta rule costs "
        "in hops (nothing decided, no etcd)",
    )
    parser.add_argument(
        "--work-dir", type=Path, help="keep configs and logs here (default: temp dir, removed)"
    )
    args = parser.parse_args(argv)
    for name in ("streams", "chunks", "concurrency", "warmup_chunks", "curve_chunks"):
        if not 1 <= getattr(args, name) <= 100_000:
            parser.error(f"--{name.replace('_', '-')} must be 1..100000")
    if not 0 <= args.interval_ms <= 1000:
        parser.error("--interval-ms must be 0..1000")
    if not 0 <= args.prefill_ms <= 10_000:
        parser.error("--prefill-ms must be 0..10000")
    return args


def _raise_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # SIGTERM takes the same path as Ctrl-C: every finally block runs


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # Line-buffered, so the table and the progress lines on stderr keep their order in a terminal.
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    command = sys.orig_argv if argv is None else [sys.executable, __file__, *argv]
    print(f"command: {shlex.join(command)}")
    signal.signal(signal.SIGTERM, _raise_interrupt)
    envoy = find_envoy()
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="bench-stream-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        with contextlib.ExitStack() as stack:  # stops every process, in reverse start order
            phases, sidecar_idle, others = _run(args, envoy, work, stack)
    except KeyboardInterrupt:
        print(f"interrupted; everything stopped (logs in {work})", file=sys.stderr)
        return 130
    except ProcessFailed as exc:
        print(f"error: {exc}\n(logs kept in {work})", file=sys.stderr)
        return 1
    if args.work_dir is None:
        shutil.rmtree(work, ignore_errors=True)
    _report(args, envoy, phases, sidecar_idle, others)
    return 0


def _run(
    args: argparse.Namespace, envoy: str, work: Path, stack: contextlib.ExitStack
) -> tuple[dict[str, list[Setup]], float, float]:
    """Start everything (each stop registered on `stack` at once) and run the load."""
    upstream_port = free_port(HOST)
    upstream = Child(
        "upstream",
        [
            sys.executable,
            str(BENCH_DIR / "sse_upstream.py"),
            "--listen",
            f"{HOST}:{upstream_port}",
            "--interval-ms",
            str(args.interval_ms),
            "--prefill-ms",
            str(args.prefill_ms),
        ],
        log_path=work / "upstream.log",
    )
    stack.callback(upstream.stop)
    wait_until(lambda: port_open(HOST, upstream_port), timeout=15, what="bench upstream", child=upstream)

    etcd, etcd_endpoint = start_etcd(work / "etcd", log_path=work / "etcd.log")
    stack.callback(etcd.stop)
    args.etcd_write_ns = _run_async(etcd_write_p50_ns(etcd_endpoint))

    plain_port = free_port(HOST)
    spec = GatewaySpec(
        listen=Endpoint(HOST, plain_port),
        replicas=(Endpoint(HOST, upstream_port),),
        sidecar_socket=work / "unused.sock",
        access_log_path=work / "plain-access.log",
        admin_socket=work / "plain-admin.sock",
        policy=load_policy(None),
    )
    plain = start_plain_envoy(envoy, spec, work)
    stack.callback(plain.stop)

    gateway_port = free_port(HOST)
    gateway = start_gateway(gateway_port, upstream_port, etcd_endpoint, work)
    gateway_envoy: list[int | None] = [None]
    stack.callback(lambda: _kill_if_envoy(gateway_envoy[0]))  # runs after gateway.stop (LIFO)
    stack.callback(lambda: gateway.stop(timeout=15))
    # The gateway process is the sidecar; its Envoy is its child (own process group).
    gateway_envoy[0] = child_pid(gateway.pid, "envoy")
    if gateway_envoy[0] is None:
        raise ProcessFailed("gateway is ready but its envoy child was not found in /proc")

    setups = [
        Setup("plain", plain_port, plain.pid),
        Setup("gateway", gateway_port, gateway_envoy[0], gateway.pid),
    ]
    ours_extra: list[int] = []
    if args.floor:
        floor_port = free_port(HOST)
        lean, floor_envoy = start_floor(envoy, floor_port, upstream_port, work, holds=args.floor_holds)
        stack.callback(lean.stop)
        stack.callback(floor_envoy.stop)
        setups.append(Setup("floor", floor_port, floor_envoy.pid, lean.pid))
        ours_extra = [lean.pid, floor_envoy.pid]
    print(
        f"measuring: upstream :{upstream_port}, plain envoy :{plain_port}, gateway :{gateway_port}"
        + (f", floor :{setups[-1].port}" if args.floor else "")
        + (" (holding until the first content)" if args.floor and args.floor_holds else ""),
        file=sys.stderr,
        flush=True,
    )
    # The sidecar's own background work (etcd lease keep-alives, timers) is in its per-chunk CPU too;
    # measured alone here so the reader can judge how much.
    before = cpu_seconds(gateway.pid)
    time.sleep(IDLE_SECONDS)
    sidecar_idle = (cpu_seconds(gateway.pid) - before) / IDLE_SECONDS
    ours = [upstream.pid, etcd.pid, plain.pid, gateway.pid, gateway_envoy[0], os.getpid(), *ours_extra]
    busy_before, ours_before, t0 = machine_busy_seconds(), sum(map(cpu_seconds, ours)), time.monotonic()
    phases = _run_async(run_load(setups, args))
    others = machine_busy_seconds() - busy_before - (sum(map(cpu_seconds, ours)) - ours_before)
    return phases, sidecar_idle, max(others, 0.0) / (time.monotonic() - t0)


async def etcd_write_p50_ns(endpoint: str, writes: int = 50) -> int:
    """One etcd round trip as the write-ahead pays it: a write etcd has made durable (fsync), p50."""
    store = EtcdStore(endpoint)
    try:
        taken: list[int] = []
        for n in range(writes):
            started = time.monotonic_ns()
            await store.put(f"/bench/rtt/{n}", b"x" * 1400)
            taken.append(time.monotonic_ns() - started)
        return int(percentile(taken, 50) or 0)
    finally:
        await store.close()


def _run_async(coro: Coroutine[Any, Any, Any]) -> Any:
    """uvloop when installed, as the sidecar uses it: less loop overhead in the client's own numbers."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


def _report(
    args: argparse.Namespace, envoy: str, phases: dict[str, list[Setup]], sidecar_idle: float, others: float
) -> None:
    print(f"machine: {os.cpu_count()} CPUs, Envoy {_envoy_version(envoy)}, Python {sys.version.split()[0]}")
    print(
        f"other processes used {others * 100:.0f}% of one CPU during the load "
        "(anything but ~0 shows up in p99 first)"
    )
    print(f"sidecar idle: {sidecar_idle * 1000:.1f} ms CPU per second (included in its per-chunk CPU)")
    print(
        f"etcd: a write's p50 {args.etcd_write_ns / 1e6:.2f} ms "
        "(the write-ahead before the first delta is one)"
    )
    print(
        "per chunk: receive − send time (CLOCK_MONOTONIC), added = gateway − plain, ratio = gateway / plain"
    )
    raw: dict[str, Any] = {
        "command": sys.orig_argv,
        "sidecar_idle_cpu_seconds_per_second": sidecar_idle,
        "other_processes_cpu_seconds_per_second": others,
        "args": {k: str(v) for k, v in vars(args).items()},
        "phases": {},
    }
    each = f"{args.chunks} chunks, {args.interval_ms:g} ms apart" + (
        f", first after a {args.prefill_ms:g} ms prefill" if args.prefill_ms else ""
    )
    descs: dict[str, str] = {}
    for api in args.apis:
        streams = f"{args.streams} stream{'s' if args.streams != 1 else ''} one after another × {each}"
        descs[phase_name("sequential", api)] = f"{API_TITLES[api]}, {streams}"
        descs[phase_name("concurrent", api)] = (
            f"{API_TITLES[api]}, {args.concurrency} streams at once × {each}"
        )
    curve: dict[int, dict[str, dict[str, Any]]] = {}
    for phase, setups in phases.items():
        if phase.startswith("curve ×"):
            summaries = {s.name: summarize(s, args.curve_chunks) for s in setups}
            curve[int(phase.removeprefix("curve ×"))] = summaries
        else:
            summaries = {s.name: summarize(s, args.chunks) for s in setups}
            print()
            print(table(phase, summaries, descs[phase]))
        raw["phases"][phase] = {
            s.name: summaries[s.name]
            | {
                "latencies_ns_per_stream": [r.latencies_ns for r in s.streams],
                "ttfd_ns_per_stream": [r.ttfd_ns for r in s.streams],
            }
            for s in setups
        }
    if curve:
        print()
        print(curve_table(curve, args.curve_chunks, args.interval_ms))
    if len(args.apis) > 1:
        for base in ("sequential", "concurrent"):
            if all(phase_name(base, api) in phases for api in args.apis):
                print()
                print(api_table(phases, args, base))
    print()
    print(targets(phases, args))
    if args.json:
        args.json.write_text(json.dumps(raw))
        print(f"\nraw numbers: {args.json}")


if __name__ == "__main__":
    sys.exit(main())
