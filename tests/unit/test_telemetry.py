"""Spans and metrics as views of the machines' events: the real machines, in-memory exporters, no servers."""

from __future__ import annotations

import dataclasses
import io
import json
import logging
from typing import Any

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from router_sidecar.core.attempt import (
    FenceProven,
    LivenessLost,
    ResponseBody,
    ResponseHeaders,
    WriteAheadDone,
)
from router_sidecar.core.request import DownstreamLoss, DownstreamLost, LogicalRequest, ResponseChunk
from router_sidecar.telemetry import logs
from router_sidecar.telemetry.observer import MAX_MODEL_LABELS, TTFT_BUCKETS, Telemetry
from router_sidecar.telemetry.setup import MetricsListen, TelemetryConfigError, build_telemetry
from tests.unit.test_request import C1, C2, DONE_EVENT, FINISH, ROLE, SSE, begin, fa, new_request, started

TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


class Harness:
    """A Telemetry with in-memory exporters, fed the way the journal feeds it: drained events, stamped."""

    def __init__(self) -> None:
        self.spans = InMemorySpanExporter()
        tracer_provider = TracerProvider()
        tracer_provider.add_span_processor(SimpleSpanProcessor(self.spans))
        self.reader = InMemoryMetricReader()
        self.telemetry = Telemetry(tracer_provider, MeterProvider(metric_readers=[self.reader]))
        self.clock = 1000.0

    def drain(self, request: LogicalRequest, advance: float = 0.010) -> None:
        self.clock += advance
        records = [event.as_record(self.clock) for event in request.drain_events()]
        self.telemetry.observe(request, records)

    def finish(self, request: LogicalRequest) -> None:
        self.drain(request)
        self.telemetry.finished(request)

    def finished_spans(self) -> dict[str, ReadableSpan]:
        return {span.name: span for span in self.spans.get_finished_spans()}

    def metrics(self) -> dict[str, list[Any]]:
        data = self.reader.get_metrics_data()
        out: dict[str, list[Any]] = {}
        for resource in data.resource_metrics if data else ():
            for scope in resource.scope_metrics:
                for metric in scope.metrics:
                    out[metric.name] = list(metric.data.data_points)
        return out


def points(h: Harness, name: str) -> dict[tuple[tuple[str, Any], ...], Any]:
    return {tuple(sorted(p.attributes.items())): p for p in h.metrics().get(name, [])}


def serve(h: Harness, request: LogicalRequest, attempt_id: str, replica: str, *, content: bytes) -> None:
    """One attempt that holds, writes ahead at its first delta and publishes `content` whole."""
    attempt = begin(request, attempt_id, replica)
    h.drain(request)
    fa(request, attempt, ResponseHeaders(200, SSE))
    fa(request, attempt, ResponseBody(ROLE + C1, False))
    h.drain(request)
    fa(request, attempt, WriteAheadDone())
    started(request)
    request.handle(ResponseChunk(content, content.endswith(DONE_EVENT)))
    h.drain(request)


def test_a_retried_then_completed_request() -> None:
    h = Harness()
    request = new_request()
    h.telemetry.admitted(request, {"traceparent": TRACEPARENT})
    h.drain(request)
    first = begin(request, "att-1", "10.0.0.1:8000")
    h.drain(request)
    assert h.telemetry.traceparent(request, 1) is not None
    fa(request, first, ResponseHeaders(503, SSE))
    fa(request, first, FenceProven("connection_closed"))
    h.drain(request)
    serve(h, request, "att-2", "10.0.0.2:8000", content=ROLE + C1 + C2 + FINISH + DONE_EVENT)
    h.finish(request)

    spans = h.finished_spans()
    assert set(spans) == {"chat tiny", "attempt 1", "attempt 2"}
    root, one, two = spans["chat tiny"], spans["attempt 1"], spans["attempt 2"]
    # The client's trace context is the parent; attempts are children of the request span.
    assert format(root.context.trace_id, "032x") == "0af7651916cd43dd8448eb211c80319c"
    assert root.parent is not None and format(root.parent.span_id, "016x") == "b7ad6b7169203331"
    assert one.parent is not None and one.parent.span_id == root.context.span_id
    assert (root.kind, one.kind) == (SpanKind.SERVER, SpanKind.CLIENT)
    assert dict(root.attributes or {}) == {
        "gen_ai.operation.name": "chat",
        "gen_ai.request.model": "tiny",
        "router_sidecar.request_id": "req-0001",
        "router_sidecar.stream": True,
        "router_sidecar.estimated_prompt_tokens": request.parsed.estimated_prompt_tokens,
        "router_sidecar.phase": "completed",
        "router_sidecar.outcome": "completed",
        "router_sidecar.delivered_output_tokens": 2,
        "router_sidecar.first_delta_sent": True,
        "gen_ai.usage.output_tokens": 2,
        "gen_ai.response.finish_reasons": ("stop",),
    }
    assert root.status.status_code is StatusCode.UNSET
    assert [e.name for e in root.events] == ["stream_completed"]
    assert [e.name for e in one.events] == ["attempt_failed", "retry_triggered"]
    assert dict(one.events[1].attributes or {}) == {"attempt": 1, "reason": "upstream_status"}
    assert one.status.status_code is StatusCode.ERROR
    assert dict(one.attributes or {})["error.type"] == "upstream_status"
    assert dict(one.attributes or {})["router_sidecar.failure"] == "upstream_status"
    assert dict(one.attributes or {})["server.address"] == "10.0.0.1"
    assert dict(one.attributes or {})["server.port"] == 8000
    assert dict(one.attributes or {})["http.response.status_code"] == 503
    assert [e.name for e in two.events] == ["headers_held", "first_delta"]
    assert dict(two.attributes or {})["router_sidecar.outcome"] == "completed"
    # Event times are the journal's: the spans are drawn on the same clock.
    assert root.start_time == int(1000.010 * 1e9) and root.end_time == root.events[-1].timestamp

    attrs = (("gen_ai.operation.name", "chat"), ("gen_ai.request.model", "tiny"))
    assert points(h, "gen_ai.server.time_to_first_token")[attrs].count == 1
    assert list(points(h, "gen_ai.server.time_to_first_token")[attrs].explicit_bounds) == list(TTFT_BUCKETS)
    assert points(h, "gen_ai.server.request.duration")[attrs].count == 1
    assert points(h, "gen_ai.server.time_per_output_token")[attrs].count == 1
    usage = points(h, "gen_ai.client.token.usage")[(*attrs, ("gen_ai.token.type", "output"))]
    assert (usage.count, usage.sum) == (1, 2)
    assert points(h, "router_sidecar.retries")[(("reason", "upstream_status"),)].value == 1
    attempts = points(h, "router_sidecar.attempts")
    assert {k: p.value for k, p in attempts.items()} == {
        (("outcome", "failed"),): 1,
        (("outcome", "completed"),): 1,
    }
    requests = points(h, "router_sidecar.requests")
    assert [(dict(k)["phase"], p.value) for k, p in requests.items()] == [("completed", 1)]


def test_a_fenced_attempt_records_its_proof_and_latency() -> None:
    h = Harness()
    request = new_request()
    h.drain(request)
    attempt = begin(request, "att-1", "r1:1")
    fa(request, attempt, ResponseHeaders(200, SSE))
    fa(request, attempt, LivenessLost("heartbeat_lapsed"))
    h.drain(request)
    fa(request, attempt, FenceProven("cancel_ack", 42.0))
    h.drain(request)
    h.finish(request)
    span = h.finished_spans()["attempt 1"]
    assert [e.name for e in span.events] == [
        "headers_held",
        "fence_started",
        "fence_proven",
        "attempt_failed",
        "retry_triggered",  # the request's verdict on it
    ]
    assert dict(span.events[2].attributes or {}) == {
        "attempt": 1,
        "attempt_id": "att-1",
        "proof": "cancel_ack",
        "waited_ms": 42.0,
    }
    fence = points(h, "router_sidecar.fence.duration")[(("proof", "cancel_ack"),)]
    assert (fence.count, fence.sum) == (1, 0.042)


def test_an_interrupted_request_is_an_error_with_a_terminal_frame() -> None:
    h = Harness()
    request = new_request()
    h.drain(request)
    serve(h, request, "att-1", "r1:1", content=ROLE + C1 + C2)
    request.handle(ResponseChunk(b"", True))  # a clean end without [DONE]: the terminal frame
    h.finish(request)
    root = h.finished_spans()["chat tiny"]
    assert root.status.status_code is StatusCode.ERROR
    assert dict(root.attributes or {})["error.type"] == "upstream_decode_interrupted"
    assert [e.name for e in root.events] == ["terminal_frame"]
    frames = points(h, "router_sidecar.terminal_frames")
    assert frames[(("code", "upstream_decode_interrupted"),)].value == 1
    attrs = (
        ("error.type", "upstream_decode_interrupted"),
        ("gen_ai.operation.name", "chat"),
        ("gen_ai.request.model", "tiny"),
    )
    assert points(h, "gen_ai.server.request.duration")[attrs].count == 1


def test_a_client_disconnect_is_a_span_event() -> None:
    h = Harness()
    request = new_request()
    h.drain(request)
    serve(h, request, "att-1", "r1:1", content=ROLE + C1)
    request.handle(DownstreamLost(DownstreamLoss.CLIENT_GONE, None))
    h.finish(request)
    root = h.finished_spans()["chat tiny"]
    assert [e.name for e in root.events] == ["client_disconnect"]
    assert dict(root.attributes or {})["router_sidecar.phase"] == "cancelled"


def test_without_providers_nothing_is_recorded_and_nothing_breaks() -> None:
    telemetry = Telemetry()
    request = new_request()
    telemetry.admitted(request, {"traceparent": TRACEPARENT})
    telemetry.observe(request, [e.as_record(1.0) for e in request.drain_events()])
    begin(request, "att-1", "r1:1")
    telemetry.observe(request, [e.as_record(1.1) for e in request.drain_events()])
    assert telemetry.traceparent(request, 1) is None and telemetry.trace_id(request) is None
    telemetry.finished(request)


def test_odd_records_are_ignored() -> None:
    h = Harness()
    request = new_request()
    h.telemetry.observe(request, [{"event": "no_such_event", "t": 1}, {"t": "x"}, {}])
    h.drain(request)
    h.telemetry.observe(request, [{"event": "attempt_started", "attempt": "one", "t": 2}])
    h.finish(request)
    assert set(h.finished_spans()) == {"chat tiny"}


def test_model_labels_are_bounded() -> None:
    h = Harness()
    for index in range(MAX_MODEL_LABELS + 5):
        request = new_request()
        request.parsed = dataclasses.replace(request.parsed, model=f"m{index}" * 40)
        request.pin(f"sha256:{index:064x}", None)  # served by a registered replica
        h.drain(request)
        h.finish(request)
    models = {dict(k)["gen_ai.request.model"] for k in points(h, "router_sidecar.requests")}
    assert len(models) == MAX_MODEL_LABELS + 1 and "other" in models
    assert max(len(m) for m in models) <= 64


def test_made_up_model_names_do_not_take_the_label_slots() -> None:
    # Static replicas accept any model string: a name is a label only once a replica sent content for it.
    h = Harness()
    for index in range(MAX_MODEL_LABELS + 5):
        request = new_request()
        request.parsed = dataclasses.replace(request.parsed, model=f"made-up-{index}")
        h.drain(request)  # never served: no content
        h.finish(request)
    served = new_request()
    served.parsed = dataclasses.replace(served.parsed, model="tiny-served")
    h.drain(served)
    serve(h, served, "att-1", "10.0.0.1:8000", content=ROLE + C1 + FINISH + DONE_EVENT)
    h.finish(served)
    models = {dict(k)["gen_ai.request.model"] for k in points(h, "router_sidecar.requests")}
    assert models == {"other", "tiny-served"}


def test_a_request_whose_id_was_taken_leaves_nothing() -> None:
    h = Harness()
    request = new_request()
    h.telemetry.admitted(request, {"traceparent": TRACEPARENT})
    h.drain(request)
    h.telemetry.forget(request)
    h.telemetry.finished(request)
    assert h.finished_spans() == {} and "router_sidecar.requests" not in h.metrics()


# --- settings --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "host", "port"),
    [("9464", "127.0.0.1", 9464), (":9464", "127.0.0.1", 9464), ("0.0.0.0:1", "0.0.0.0", 1)],
)
def test_metrics_listen_parses(text: str, host: str, port: int) -> None:
    assert MetricsListen.parse(text) == MetricsListen(host, port)


@pytest.mark.parametrize("text", ["", "x", "127.0.0.1:", "127.0.0.1:70000", "h:0"])
def test_metrics_listen_refuses(text: str) -> None:
    with pytest.raises(TelemetryConfigError, match="PORT or HOST:PORT"):
        MetricsListen.parse(text)


def test_otlp_over_http_is_refused_with_what_to_do() -> None:
    env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318",
        "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
    }
    with pytest.raises(TelemetryConfigError, match="gRPC only"):
        build_telemetry(metrics=None, instance_id="gw", env=env)


def test_nothing_configured_builds_a_no_op() -> None:
    runtime = build_telemetry(metrics=None, instance_id="gw", env={})
    assert (runtime.metrics_url, runtime.otlp_endpoint) == (None, None)
    runtime.shutdown()


def test_json_log_lines_name_their_request() -> None:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logs.JsonFormatter())
    logger = logging.getLogger("test.telemetry.json")
    logger.addHandler(handler)
    logger.propagate = False
    try:

        def in_a_stream() -> None:
            logs.bind(request_id="req-1", attempt_id="att-1", trace_id="ab" * 16)
            logger.warning("attempt %d failed", 1)

        import contextvars

        contextvars.copy_context().run(in_a_stream)
        logger.warning("outside any stream")
    finally:
        logger.removeHandler(handler)
    first, second = (json.loads(line) for line in stream.getvalue().splitlines())
    assert first["message"] == "attempt 1 failed" and first["level"] == "WARNING"
    assert (first["request_id"], first["attempt_id"], first["trace_id"]) == ("req-1", "att-1", "ab" * 16)
    assert "request_id" not in second  # another task's ids never leak into this one's lines


def test_a_broken_view_never_fails_the_request(caplog: pytest.LogCaptureFixture) -> None:
    """Telemetry runs inside the journal's drain: whatever goes wrong there is logged, not raised."""

    class Broken(Telemetry):
        def _observe(self, request: LogicalRequest, records: list[dict[str, Any]]) -> None:
            raise RuntimeError("exporter bug")

        def _finished(self, request: LogicalRequest) -> None:
            raise RuntimeError("exporter bug")

    request = new_request()
    broken = Broken()
    broken.observe(request, [e.as_record(1.0) for e in request.drain_events()])
    broken.finished(request)
    assert [r.message for r in caplog.records] == [
        "telemetry: events of request req-0001 not recorded",
        "telemetry: the end of request req-0001 not recorded",
    ]
