"""Spans and metrics as views of the machines' events: the real machines, in-memory exporters, no servers."""

from __future__ import annotations

import dataclasses
import io
import json
import logging
import types
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
from router_sidecar.core.openai_api import RouteKind, parse_request
from router_sidecar.core.request import (
    Admitted,
    DownstreamLoss,
    DownstreamLost,
    LogicalRequest,
    ResponseChunk,
)
from router_sidecar.telemetry import logs
from router_sidecar.telemetry.observer import MAX_MODEL_LABELS, TTFT_BUCKETS, Telemetry
from router_sidecar.telemetry.setup import MetricsListen, TelemetryConfigError, build_telemetry
from tests.unit.test_request import (
    C1,
    C2,
    DEFAULT_POLICY,
    DONE_EVENT,
    FINISH,
    ROLE,
    SSE,
    begin,
    fa,
    new_request,
    settle_claim,
    started,
)

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
        "gen_ai.provider.name": "unknown",  # static replicas: nothing registered their engine
        "router_sidecar.api": "chat.completions",
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

    attrs = (
        ("gen_ai.operation.name", "chat"),
        ("gen_ai.provider.name", "unknown"),
        ("gen_ai.request.model", "tiny"),
        ("router_sidecar.api", "chat.completions"),
    )
    assert points(h, "gen_ai.server.time_to_first_token")[attrs].count == 1
    assert list(points(h, "gen_ai.server.time_to_first_token")[attrs].explicit_bounds) == list(TTFT_BUCKETS)
    assert points(h, "gen_ai.server.request.duration")[attrs].count == 1
    assert points(h, "gen_ai.server.time_per_output_token")[attrs].count == 1
    usage = points(h, "gen_ai.client.token.usage")[tuple(sorted((*attrs, ("gen_ai.token.type", "output"))))]
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
    code = (("code", "upstream_decode_interrupted"), ("router_sidecar.api", "chat.completions"))
    assert frames[code].value == 1
    attrs = (
        ("error.type", "upstream_decode_interrupted"),
        ("gen_ai.operation.name", "chat"),
        ("gen_ai.provider.name", "unknown"),
        ("gen_ai.request.model", "tiny"),
        ("router_sidecar.api", "chat.completions"),
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
            logs.bind(request_id="req-1", attempt_id="att-1")
            logger.warning("attempt %d failed", 1)
            # A line about another attempt, from this task (a verdict delivered for another stream).
            logger.warning("attempt %d failed", 2, extra={"attempt_id": "att-2"})

        import contextvars

        logs.describe("req-1", lambda attempt_id: {"trace_id": "ab" * 16})
        contextvars.copy_context().run(in_a_stream)
        logger.warning("outside any stream")
    finally:
        logs.forget("req-1")
        logger.removeHandler(handler)
    first, other, second = (json.loads(line) for line in stream.getvalue().splitlines())
    assert first["message"] == "attempt 1 failed" and first["level"] == "WARNING"
    assert (first["request_id"], first["attempt_id"], first["trace_id"]) == ("req-1", "att-1", "ab" * 16)
    assert (other["request_id"], other["attempt_id"], other["trace_id"]) == ("req-1", "att-2", "ab" * 16)
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


# --- the API and the engine behind it --------------------------------------------------------------------


def api_request(kind: RouteKind) -> LogicalRequest:
    """An admitted, claimed request of one of the four APIs."""
    body: dict[str, Any] = {"model": "tiny", "stream": True}
    if kind is RouteKind.RESPONSES:
        body["input"] = "hi"
    elif kind is RouteKind.COMPLETIONS:
        body["prompt"] = "hi"
    else:
        body["messages"] = [{"role": "user", "content": "hi"}]
        body["max_tokens"] = 8
    parsed = parse_request(kind, json.dumps(body).encode(), max_body_bytes=1 << 20, known_models=None)
    request = LogicalRequest(request_id="req-api", tenant="t1", parsed=parsed, policy=DEFAULT_POLICY)
    request.handle(Admitted())
    settle_claim(request)
    return request


def named(kind: str, **fields: Any) -> bytes:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **fields})}\n\n".encode()


# Each API's stream: what precedes the first content, the first content, the rest up to the clean end.
STREAMS = {
    RouteKind.CHAT: (ROLE, C1, C2 + FINISH + DONE_EVENT),
    RouteKind.COMPLETIONS: (
        b"",
        b'data: {"id":"cmpl-1","choices":[{"index":0,"text":"Hel","finish_reason":null}]}\n\n',
        b'data: {"id":"cmpl-1","choices":[{"index":0,"text":"lo","finish_reason":"stop"}]}\n\n' + DONE_EVENT,
    ),
    RouteKind.RESPONSES: (
        named("response.created", sequence_number=0, response={"id": "resp_1", "status": "in_progress"}),
        named("response.output_text.delta", sequence_number=1, delta="Hel"),
        named("response.output_text.delta", sequence_number=2, delta="lo")
        + named(
            "response.completed",
            sequence_number=3,
            response={"id": "resp_1", "status": "completed", "usage": {"output_tokens": 2}},
        ),
    ),
    RouteKind.MESSAGES: (
        named("message_start", message={"id": "msg_1", "type": "message", "role": "assistant"}),
        named("content_block_delta", index=0, delta={"type": "text_delta", "text": "Hel"}),
        named("content_block_delta", index=0, delta={"type": "text_delta", "text": "lo"})
        + named("message_delta", delta={"stop_reason": "end_turn"}, usage={"output_tokens": 2})
        + named("message_stop"),
    ),
}


def serve_api(h: Harness, request: LogicalRequest, attempt_id: str, replica: str) -> None:
    preamble, first, rest = STREAMS[request.parsed.kind]
    attempt = begin(request, attempt_id, replica)
    h.drain(request)
    fa(request, attempt, ResponseHeaders(200, SSE))
    fa(request, attempt, ResponseBody(preamble + first, False))
    h.drain(request)
    fa(request, attempt, WriteAheadDone())
    started(request)
    request.handle(ResponseChunk(preamble + first + rest, True))
    h.drain(request)


class Registry:
    """What the gateway's LivenessMonitor holds: registrations by address, from the replica agents."""

    def __init__(self, engines: dict[str, str | None]) -> None:
        self.replicas = {
            address: types.SimpleNamespace(engine_name=engine, digest="sha256:" + "ab" * 32)
            for address, engine in engines.items()
        }


@pytest.mark.parametrize(
    ("kind", "operation"),
    [
        (RouteKind.CHAT, "chat"),
        (RouteKind.COMPLETIONS, "text_completion"),
        (RouteKind.RESPONSES, "chat"),
        (RouteKind.MESSAGES, "chat"),
    ],
)
def test_every_signal_names_the_api_and_the_engine_behind_it(kind: RouteKind, operation: str) -> None:
    h = Harness()
    h.telemetry.read_engines(Registry({"10.0.0.1:8000": "vllm"}))
    request = api_request(kind)
    h.drain(request)
    serve_api(h, request, "att-1", "10.0.0.1:8000")
    h.finish(request)
    spans = h.finished_spans()
    assert set(spans) == {f"{operation} tiny", "attempt 1"}
    root, attempt = spans[f"{operation} tiny"], spans["attempt 1"]
    for span in (root, attempt):
        assert dict(span.attributes or {})["gen_ai.provider.name"] == "vllm"
    assert dict(root.attributes or {})["gen_ai.operation.name"] == operation
    assert dict(root.attributes or {})["router_sidecar.api"] == kind.value
    assert dict(root.attributes or {})["router_sidecar.phase"] == "completed"
    labels = (
        ("gen_ai.operation.name", operation),
        ("gen_ai.provider.name", "vllm"),
        ("gen_ai.request.model", "tiny"),
        ("router_sidecar.api", kind.value),
    )
    for metric in (
        "gen_ai.server.time_to_first_token",
        "gen_ai.server.request.duration",
        "gen_ai.server.time_per_output_token",
    ):
        assert points(h, metric)[labels].count == 1, metric
    usage = points(h, "gen_ai.client.token.usage")[tuple(sorted((*labels, ("gen_ai.token.type", "output"))))]
    assert usage.sum == 2
    assert [dict(k)["router_sidecar.api"] for k in points(h, "router_sidecar.requests")] == [kind.value]


def test_a_pinned_request_names_its_engine_at_its_start() -> None:
    """With discovery a request is pinned to one compatibility group: its engine is known before any
    attempt (the conventions ask for gen_ai.provider.name at span creation)."""
    h = Harness()
    h.telemetry.read_engines(Registry({"10.0.0.1:8000": "sglang", "10.0.0.2:8000": "sglang"}))
    request = api_request(RouteKind.MESSAGES)
    request.pin("sha256:" + "ab" * 32, None)
    h.drain(request)
    [(span, traced)] = [(t.span, t) for t in h.telemetry._open.values()]
    assert span is not None and dict(span.attributes or {})["gen_ai.provider.name"] == "sglang"  # type: ignore[attr-defined]
    assert traced.attributes["gen_ai.provider.name"] == "sglang"


def test_an_engine_nothing_registered_is_unknown_and_odd_names_are_bounded() -> None:
    h = Harness()
    h.telemetry.read_engines(Registry({"10.0.0.1:8000": "vLLM", "10.0.0.2:8000": "Not An Engine!"}))
    assert h.telemetry.provider("10.0.0.1:8000") == "vllm"  # lower-cased, as fingerprints are
    assert h.telemetry.provider("10.0.0.2:8000") == "other"
    assert h.telemetry.provider("10.0.0.9:8000") == "unknown"  # a static replica: nothing registered it
    for index in range(10):
        h.telemetry.read_engines(Registry({"r:1": f"engine{index}"}))
        h.telemetry.provider("r:1")
    assert h.telemetry.provider("r:1") == "other"  # past MAX_PROVIDER_LABELS distinct names

    def broken(address: str) -> str | None:
        raise RuntimeError("registry bug")

    assert Telemetry(engines=broken).provider("r:1") == "unknown"  # a look-up never fails the view


def test_a_retry_on_another_engine_names_the_one_that_served() -> None:
    h = Harness()
    h.telemetry.read_engines(Registry({"10.0.0.1:8000": "vllm", "10.0.0.2:8000": "sglang"}))
    request = api_request(RouteKind.RESPONSES)
    h.drain(request)
    first = begin(request, "att-1", "10.0.0.1:8000")
    h.drain(request)
    fa(request, first, ResponseHeaders(503, SSE))
    fa(request, first, FenceProven("connection_closed"))
    h.drain(request)
    serve_api(h, request, "att-2", "10.0.0.2:8000")
    h.finish(request)
    spans = h.finished_spans()
    assert dict(spans["attempt 1"].attributes or {})["gen_ai.provider.name"] == "vllm"
    assert dict(spans["attempt 2"].attributes or {})["gen_ai.provider.name"] == "sglang"
    assert dict(spans["chat tiny"].attributes or {})["gen_ai.provider.name"] == "sglang"
    [ttft] = points(h, "gen_ai.server.time_to_first_token")
    assert dict(ttft)["gen_ai.provider.name"] == "sglang"  # the engine that delivered the first content


def test_json_log_lines_name_the_api_and_the_engine() -> None:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logs.JsonFormatter())
    logger = logging.getLogger("test.telemetry.api")
    logger.addHandler(handler)
    logger.propagate = False
    telemetry = Telemetry()
    telemetry.read_engines(Registry({"10.0.0.1:8000": "vllm"}))
    request = api_request(RouteKind.MESSAGES)
    telemetry.admitted(request, {})
    try:

        def in_a_stream(attempt_id: str | None) -> None:
            logs.bind(request_id=request.request_id, attempt_id=attempt_id)
            logger.warning("about the request")

        import contextvars

        contextvars.copy_context().run(in_a_stream, None)  # no attempt yet
        begin(request, "att-1", "10.0.0.1:8000")
        contextvars.copy_context().run(in_a_stream, "att-1")
        telemetry.finished(request)  # its end: the description goes
        contextvars.copy_context().run(in_a_stream, "att-1")
    finally:
        logger.removeHandler(handler)
    before, during, after = (json.loads(line) for line in stream.getvalue().splitlines())
    assert (before["api"], before["gen_ai.operation.name"]) == ("messages", "chat")
    assert "gen_ai.provider.name" not in before
    assert (during["api"], during["gen_ai.provider.name"], during["attempt_id"]) == (
        "messages",
        "vllm",
        "att-1",
    )
    assert "api" not in after and after["request_id"] == request.request_id
