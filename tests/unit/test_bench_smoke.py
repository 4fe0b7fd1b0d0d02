"""bench/: plain-Envoy config derivation, the upstream's events, the client's parser (no Envoy)."""

from __future__ import annotations

import asyncio
import json
import random
import time
from pathlib import Path
from typing import Any, cast

import grpc

from bench import lean_extproc, sse_upstream, stream_overhead
from router_sidecar.core.policy import load_policy
from router_sidecar.core.sse import EventKind, SseScanner
from router_sidecar.extproc import messages as m
from router_sidecar.extproc.server import PLACEMENT_METADATA
from router_sidecar.runtime.envoy_config import Endpoint, GatewaySpec, render


def _rendered() -> str:
    spec = GatewaySpec(
        listen=Endpoint("127.0.0.1", 18080),
        replicas=(Endpoint("127.0.0.1", 19001),),
        sidecar_socket=Path("/tmp/x.sock"),
        access_log_path=Path("/tmp/access.log"),
        admin_socket=Path("/tmp/admin.sock"),
        policy=load_policy(None),
    )
    return render(spec)


def test_plain_config_drops_only_the_sidecar_parts() -> None:
    config = stream_overhead.plain_envoy_config(_rendered())
    hcm = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    assert [f["name"] for f in hcm["http_filters"]] == ["envoy.filters.http.router"]
    assert [a["name"] for a in hcm["access_log"]] == ["envoy.access_loggers.file"]
    assert "retry_policy" in hcm["route_config"]["virtual_hosts"][0]["routes"][0]["route"]
    clusters = {c["name"]: c for c in config["static_resources"]["clusters"]}
    options = clusters["llm"]["typed_extension_protocol_options"]
    assert all("http_filters" not in o for o in options.values())
    assert clusters["llm"]["circuit_breakers"]["thresholds"][0]["retry_budget"]["budget_percent"] == {
        "value": 50.0
    }


def test_upstream_events_are_what_the_sidecar_counts() -> None:
    events = SseScanner().feed(
        sse_upstream.ROLE_EVENT
        + sse_upstream.content_event(time.monotonic_ns())
        + sse_upstream.FINISH_EVENT
        + sse_upstream.DONE_EVENT
    )
    kinds = [e.kind for e in events]
    assert kinds == [EventKind.NON_CONTENT, EventKind.CONTENT, EventKind.NON_CONTENT, EventKind.DONE]
    assert events[2].finish_reason == "stop"
    assert 140 <= len(sse_upstream.content_event(time.monotonic_ns())) <= 160


class _Transport:
    def write(self, data: bytes) -> None:
        pass

    def close(self) -> None:
        pass


def test_client_parses_chunked_stream_split_anywhere() -> None:
    stamps = [1_000 + i for i in range(50)]
    body = sse_upstream.http_chunk(sse_upstream.ROLE_EVENT)
    body += b"".join(sse_upstream.http_chunk(sse_upstream.content_event(t)) for t in stamps)
    body += sse_upstream.http_chunk(sse_upstream.FINISH_EVENT + sse_upstream.DONE_EVENT) + b"0\r\n\r\n"
    wire = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n" + body

    async def run() -> stream_overhead.StreamResult:
        conn = stream_overhead._ClientConn()
        conn.connection_made(cast(Any, _Transport()))
        result, finished = conn.start(b"request")
        rng = random.Random(7)
        pos = 0
        while pos < len(wire):
            step = rng.randint(1, 300)
            conn.data_received(wire[pos : pos + step])
            pos += step
        assert finished.done()
        return result

    result = asyncio.run(run())
    assert result.error is None and result.done and result.status == 200
    assert len(result.latencies_ns) == len(stamps)
    assert result.ttfd_ns is not None


def test_upstream_and_client_end_to_end() -> None:
    async def run() -> list[stream_overhead.StreamResult]:
        server = await asyncio.start_server(lambda r, w: sse_upstream._handle(r, w, 0.0, 0.0), "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        client = stream_overhead.Client(port)
        try:
            # Two streams, one keep-alive connection.
            return [await client.stream(100, timeout=10) for _ in range(2)]
        finally:
            client.close()
            server.close()
            await server.wait_closed()

    for result in asyncio.run(run()):
        assert result.error is None and result.done
        assert len(result.latencies_ns) == 100
        assert all(0 < x < 5_000_000_000 for x in result.latencies_ns)


def test_percentile_interpolates() -> None:
    assert stream_overhead.percentile([], 50) is None
    assert stream_overhead.percentile([1, 2, 3, 4], 50) == 2.5
    assert stream_overhead.percentile([5], 99) == 5


def test_table_compares_the_sidecar_with_the_lean_floor() -> None:
    def setup(name: str, latency_ms: float, cpu: dict[str, float]) -> stream_overhead.Setup:
        s = stream_overhead.Setup(name, 1, 2, 3 if "sidecar" in cpu else None)
        s.streams = [
            stream_overhead.StreamResult(
                sent_ns=0, first_content_ns=1_000_000, latencies_ns=[int(latency_ms * 1e6)] * 1000, done=True
            )
        ]
        s.cpu = cpu
        return s

    summaries = {
        "plain": stream_overhead.summarize(setup("plain", 0.1, {"envoy": 0.05}), 1000),
        "gateway": stream_overhead.summarize(setup("gateway", 0.5, {"envoy": 0.1, "sidecar": 0.12}), 1000),
        "floor": stream_overhead.summarize(setup("floor", 0.4, {"envoy": 0.1, "sidecar": 0.1}), 1000),
    }
    lines = stream_overhead.table("sequential", summaries, "1 stream").splitlines()
    assert lines[-4].split() == ["0.400", "0.400", "100.0", "10000"]  # p50, p99, µs/chunk, chunks/CPU-s
    assert lines[-3].split() == ["sidecar", "CPU", "/", "floor", "CPU", "1.2×"]
    # Time to first delta of the floor (the ext_proc hops alone) against the gateway's.
    assert lines[-2].split()[-4:] == ["1.000", "1.000", "+0.000", "1.0×"]
    assert "1000/1000" in lines[-1]
    without = {k: v for k, v in summaries.items() if k != "floor"}
    assert not any("floor" in line for line in stream_overhead.table("s", without, "d").splitlines())


def test_scale_curve_rows_and_saturation() -> None:
    def summary(p50_ms: float, cpu_us: float | None, rate: float, busy: float | None) -> dict[str, Any]:
        return {
            "latency_ns": {"p50": p50_ms * 1e6, "p99": 2 * p50_ms * 1e6},
            "cpu_us_per_chunk": {} if cpu_us is None else {"sidecar": cpu_us},
            "chunks_per_second": rate,
            "sidecar_cpu_utilisation": busy,
        }

    rows = {
        1: {"plain": summary(0.1, None, 900, None), "gateway": summary(0.4, 260, 800, 0.2)},
        10: {"plain": summary(0.2, None, 9000, None), "gateway": summary(4, 110, 8000, 0.9)},
    }
    lines = stream_overhead.curve_table(rows, 500, 1.0).splitlines()
    assert lines[2].split() == ["1", "0.100/0.200", "0.400/0.800", "260.0", "20%", "800", "-", "-"]
    assert lines[-1] == "the gateway carried at most 8000 chunks/s (at N = 10)"
    assert stream_overhead._widths("1,10,50") == (1, 10, 50)


def test_the_responses_upstream_speaks_the_responses_api() -> None:
    """What the bench upstream writes on /v1/responses is what the gateway's Responses dialect reads: a
    preamble, content deltas, the clean end; sequence numbers from 0 without a gap."""
    from router_sidecar.core.dialects import classify_responses

    stamps = [time.monotonic_ns() + i for i in range(3)]
    events = [
        *sse_upstream.responses_opening(),
        *sse_upstream.responses_item_opened(),
        *(
            sse_upstream.responses_delta(t, sse_upstream.RESPONSES_FIRST_DELTA + i)
            for i, t in enumerate(stamps)
        ),
        *sse_upstream.responses_closing("".join(map(str, stamps)), sse_upstream.RESPONSES_FIRST_DELTA + 3, 3),
    ]
    scanned = SseScanner(classify=classify_responses).feed(b"".join(events))
    kinds = [e.kind for e in scanned]
    assert kinds == [EventKind.NON_CONTENT] * 4 + [EventKind.CONTENT] * 3 + [EventKind.NON_CONTENT] * 3 + [
        EventKind.DONE
    ]
    numbers = [json.loads(e.split(b"data: ", 1)[1])["sequence_number"] for e in events]
    assert numbers == list(range(len(events)))


def test_upstream_and_client_end_to_end_on_the_responses_api() -> None:
    async def run() -> stream_overhead.StreamResult:
        server = await asyncio.start_server(lambda r, w: sse_upstream._handle(r, w, 0.0, 0.0), "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        client = stream_overhead.Client(port)
        try:
            await client.stream(5, timeout=10)  # a chat stream first: one keep-alive connection, either API
            return await client.stream(100, timeout=10, api="responses")
        finally:
            client.close()
            server.close()
            await server.wait_closed()

    result = asyncio.run(run())
    assert result.error is None and result.done and result.status == 200
    assert len(result.latencies_ns) == 100  # only the deltas: the .done events' text is not counted
    assert result.ttfd_ns is not None


def setup(name: str, ttfd_ms: float, latency_ms: float, cpu: dict[str, float]) -> stream_overhead.Setup:
    """A setup's measured phase: one stream of 1000 chunks, and its processes' CPU seconds."""
    s = stream_overhead.Setup(name, 1, 2, 3 if "sidecar" in cpu else None)
    s.streams = [
        stream_overhead.StreamResult(
            sent_ns=0,
            first_content_ns=int(ttfd_ms * 1e6),
            latencies_ns=[int(latency_ms * 1e6)] * 1000,
            done=True,
        )
    ]
    s.cpu = cpu
    return s


def test_the_targets_each_against_its_baseline_in_the_same_run() -> None:
    def phase(gateway_ttfd: float, sidecar: float, envoy: float) -> list[stream_overhead.Setup]:
        return [
            setup("plain", 22.0, 0.1, {"envoy": 0.04}),
            setup("gateway", gateway_ttfd, 0.5, {"envoy": envoy, "sidecar": sidecar}),
            setup("floor", 26.0, 0.4, {"envoy": 0.07, "sidecar": 0.2}),
        ]

    phases = {"sequential": phase(26.0, 0.22, 0.08), "curve ×100": phase(30.0, 0.3, 0.1)}
    args = stream_overhead.parse_args(["--prefill-ms", "20", "--concurrency", "1", "--curve", "100"])
    rows = stream_overhead.targets(phases, args).splitlines()[1:]
    assert [r.split("  ")[1] for r in rows] == [
        "time to first delta added over plain ≤ +4.4 ms, one stream",
        "sidecar CPU per chunk ≤ 1.15× the floor's, one stream",
        "envoy CPU per chunk ≤ 2× plain's, one stream",
        "sidecar CPU per chunk ≤ 1.15× the floor's, 100 streams (curve)",
        "envoy CPU per chunk ≤ 2× plain's, 100 streams (curve)",
    ]
    assert "+4.0 ms" in rows[0] and rows[0].endswith(" met")
    assert "1.10×" in rows[1] and rows[1].endswith(" met")
    assert "2.00×" in rows[2] and "(floor's envoy 1.75×)" in rows[2] and rows[2].endswith(" met")
    assert "1.50×" in rows[3] and rows[3].endswith("NOT met")
    assert "2.50×" in rows[4] and rows[4].endswith("NOT met")
    # Another prefill than the target's: measured, and said so.
    other = stream_overhead.targets(phases, stream_overhead.parse_args(["--concurrency", "1"]))
    assert "(set at --prefill-ms 20)" in other.splitlines()[1]
    no_floor = {"sequential": phase(26.0, 0.22, 0.08)[:2]}
    one = stream_overhead.parse_args(["--prefill-ms", "20", "--concurrency", "1"])
    assert "not measured (--no-floor)" in stream_overhead.targets(no_floor, one).splitlines()[2]


def test_the_apis_side_by_side() -> None:
    phases = {
        "sequential": [
            setup("plain", 2, 0.1, {"envoy": 0.05}),
            setup("gateway", 10, 0.5, {"envoy": 0.1, "sidecar": 0.3}),
        ],
        "sequential responses": [
            setup("plain", 2, 0.1, {"envoy": 0.05}),
            setup("gateway", 12, 0.6, {"envoy": 0.1, "sidecar": 0.33}),
        ],
    }
    args = stream_overhead.parse_args(["--chunks", "1000"])
    assert args.apis == ("chat", "responses")
    lines = stream_overhead.api_table(phases, args, "sequential").splitlines()
    assert lines[1].split() == ["/v1/chat/completions", "/v1/responses"]
    assert lines[3].removeprefix("time to first content p50 (ms)").split() == [
        *("2.000", "10.000", "+8.000", "5.0×"),
        *("2.000", "12.000", "+10.000", "6.0×"),
    ]
    assert lines[-2].split()[-4:] == ["-", "300.0", "-", "330.0"]  # sidecar µs per chunk
    assert stream_overhead.parse_args(["--apis", "responses"]).apis == ("responses",)
    assert "not measured" in stream_overhead.targets({}, stream_overhead.parse_args(["--apis", "responses"]))


class _Stream:
    """One ext_proc stream as `lean_extproc` sees it: Envoy's messages in, our replies recorded."""

    def __init__(self, placement: str, messages: list[Any]) -> None:
        self._pending = list(messages)
        self._metadata = ((PLACEMENT_METADATA, placement),)
        self.replies: list[str] = []

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._metadata

    async def read(self) -> Any:
        return self._pending.pop(0) if self._pending else grpc.aio.EOF

    async def write(self, reply: Any) -> None:
        # A streamed body reply is hand-encoded bytes; the others are messages.
        self.replies.append("body" if isinstance(reply, bytes) else str(reply.WhichOneof("response")))


def _replies(hold: bool, placement: str, messages: list[Any]) -> list[str]:
    stream = _Stream(placement, messages)
    asyncio.run(lean_extproc.LeanProcessor(hold_until_content=hold).Process(None, stream))  # type: ignore[arg-type]
    return stream.replies


def test_the_floor_holds_until_the_first_content_only_when_asked() -> None:
    headers = m.ProcessingRequest(request_headers={})
    response = m.ProcessingRequest(response_headers={})
    role, content = (m.ProcessingRequest(response_body={"body": b}) for b in (b"role", b"content"))
    # Upstream: released at the first body chunk, or with --hold-until-content at the second (the first
    # content after the role event), with every held chunk.
    assert _replies(False, "upstream", [headers, response, role, content]) == [
        "request_headers",
        "response_headers",
        "response_body",
    ]
    assert _replies(True, "upstream", [headers, response, role]) == ["request_headers"]
    assert _replies(True, "upstream", [headers, response, role, content]) == [
        "request_headers",
        "response_headers",
        "response_body",
        "response_body",
    ]
    # Downstream: its reply to the response headers waits for the first body chunk when holding.
    assert _replies(False, "downstream", [response]) == ["response_headers"]
    assert _replies(True, "downstream", [response]) == []
    assert _replies(True, "downstream", [response, role, content]) == ["response_headers", "body", "body"]
