"""Spans, metrics and logs of a real gateway: a real OTLP gRPC receiver in this process, a Prometheus scrape
parsed with prometheus_client's parser, the replica's own log of the trace context it was sent."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2, metrics_service_pb2_grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from tests.harness import CREDENTIAL, Agent, Gateway, Sim, chat, free_port, json_lines, poll, post

pytestmark = pytest.mark.integration

CLIENT_TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_TRACEPARENT = f"00-{CLIENT_TRACE_ID}-00f067aa0ba902b7-01"


class OtlpReceiver(
    trace_service_pb2_grpc.TraceServiceServicer, metrics_service_pb2_grpc.MetricsServiceServicer
):
    """A collector's OTLP/gRPC endpoint: keeps every span and metric name it is sent."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.spans: list[dict[str, Any]] = []
        self.metric_names: set[str] = set()
        self.port = free_port()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self.server)
        metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(self, self.server)
        self.server.add_insecure_port(f"127.0.0.1:{self.port}")
        self.server.start()

    def Export(self, request: Any, context: Any) -> Any:
        if isinstance(request, trace_service_pb2.ExportTraceServiceRequest):
            with self.lock:
                for resource_spans in request.resource_spans:
                    for scope in resource_spans.scope_spans:
                        self.spans.extend(_span(s) for s in scope.spans)
            return trace_service_pb2.ExportTraceServiceResponse()
        with self.lock:
            for resource_metrics in request.resource_metrics:
                for scope in resource_metrics.scope_metrics:
                    self.metric_names.update(m.name for m in scope.metrics)
        return metrics_service_pb2.ExportMetricsServiceResponse()

    def spans_of(self, request_id: str) -> list[dict[str, Any]]:
        with self.lock:
            roots = [s for s in self.spans if s["attributes"].get("router_sidecar.request_id") == request_id]
            if not roots:
                return []
            trace_id = roots[0]["trace_id"]
            return [s for s in self.spans if s["trace_id"] == trace_id]


def _value(any_value: Any) -> Any:
    kind = any_value.WhichOneof("value")
    if kind == "array_value":
        return [_value(v) for v in any_value.array_value.values]
    return getattr(any_value, kind) if kind else None


def _span(span: Any) -> dict[str, Any]:
    return {
        "name": span.name,
        "trace_id": span.trace_id.hex(),
        "span_id": span.span_id.hex(),
        "parent_span_id": span.parent_span_id.hex(),
        "attributes": {a.key: _value(a.value) for a in span.attributes},
        "events": [(e.name, {a.key: _value(a.value) for a in e.attributes}) for e in span.events],
        "status": span.status.code,
        "start": span.start_time_unix_nano,
        "end": span.end_time_unix_nano,
    }


@pytest.fixture(scope="module")
def receiver() -> Iterator[OtlpReceiver]:
    otlp = OtlpReceiver()
    try:
        yield otlp
    finally:
        otlp.server.stop(0)


def _otlp_env(receiver: OtlpReceiver) -> dict[str, str]:
    return {
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{receiver.port}",
        "OTEL_EXPORTER_OTLP_INSECURE": "true",
        "OTEL_BSP_SCHEDULE_DELAY": "100",  # ms: spans reach the receiver within the test's patience
        "OTEL_METRIC_EXPORT_INTERVAL": "500",
        "ROUTER_SIDECAR_LOG_FORMAT": "json",
    }


@pytest.fixture(scope="module")
def observed(
    etcd: str, sims: dict[str, Sim], receiver: OtlpReceiver, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Gateway]:
    work: Path = tmp_path_factory.mktemp("telemetry")
    metrics_port = free_port()
    gw = Gateway(
        replicas=[s.endpoint for s in sims.values()],
        etcd=etcd,
        work=work,
        extra_args=("--metrics", f"127.0.0.1:{metrics_port}"),
        env=_otlp_env(receiver),
    )
    gw.metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"  # type: ignore[attr-defined]
    try:
        yield gw
    finally:
        gw.stop()


def _spans(receiver: OtlpReceiver, request_id: str, count: int) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = []

    def enough() -> bool:
        nonlocal found
        found = receiver.spans_of(request_id)
        return len(found) >= count

    poll(enough, timeout=15, what=f"{count} spans of {request_id} at the OTLP receiver")
    return found


def _scrape(gateway: Gateway) -> dict[str, list[Any]]:
    text = httpx.get(gateway.metrics_url, timeout=5).text  # type: ignore[attr-defined]
    return {family.name: family.samples for family in text_string_to_metric_families(text)}


def test_a_retried_request_is_one_trace_with_a_span_per_attempt(
    observed: Gateway, sims: dict[str, Sim], receiver: OtlpReceiver
) -> None:
    result = post(
        f"{observed.url}/v1/chat/completions",
        chat(max_tokens=5),
        headers={"traceparent": CLIENT_TRACEPARENT, "x-sim-fault": "reset@role attempt=1"},
    )
    assert result.status == 200 and result.request_id
    spans = _spans(receiver, result.request_id, 3)
    [root] = [s for s in spans if s["attributes"].get("router_sidecar.request_id") == result.request_id]
    attempts = sorted((s for s in spans if s["parent_span_id"] == root["span_id"]), key=lambda s: s["start"])
    # The client's trace is the trace: its span is the request span's parent.
    assert root["trace_id"] == CLIENT_TRACE_ID and root["parent_span_id"] == "00f067aa0ba902b7"
    assert root["name"] == "chat tiny"
    attributes = root["attributes"]
    assert attributes["gen_ai.operation.name"] == "chat" and attributes["gen_ai.request.model"] == "tiny"
    # Static replicas: nothing registered their engine.
    assert (attributes["router_sidecar.api"], attributes["gen_ai.provider.name"]) == (
        "chat.completions",
        "unknown",
    )
    assert attributes["router_sidecar.phase"] == "completed"
    assert attributes["router_sidecar.delivered_output_tokens"] == 5
    assert attributes["gen_ai.usage.output_tokens"] == 5
    assert attributes["gen_ai.response.finish_reasons"] == ["length"]
    assert "error.type" not in attributes
    assert [e for e, _ in root["events"]] == ["stream_completed"]
    assert [s["name"] for s in attempts] == ["attempt 1", "attempt 2"]
    first, second = attempts
    assert first["attributes"]["router_sidecar.outcome"] == "failed"
    assert first["attributes"]["error.type"] == "connection_lost"
    assert first["status"] == 2  # STATUS_CODE_ERROR
    assert [e for e, _ in first["events"]] == ["headers_held", "attempt_failed", "retry_triggered"]
    assert second["attributes"]["router_sidecar.outcome"] == "completed"
    assert [e for e, _ in second["events"]] == ["headers_held", "first_delta"]
    assert {s["attributes"]["router_sidecar.replica"] for s in attempts} == {
        s.endpoint for s in sims.values()
    }
    # Each attempt sent its own span as the replica's parent: a replica with tracing on joins this trace.
    sent = {
        r["attempt_id"]: r.get("traceparent")
        for sim in sims.values()
        for r in sim.records()
        if r.get("request_id") == result.request_id and r.get("event") == "start"
    }
    for span in attempts:
        assert (
            sent[span["attributes"]["router_sidecar.attempt_id"]]
            == f"00-{CLIENT_TRACE_ID}-{span['span_id']}-01"
        )


def test_a_cut_after_the_first_delta_is_an_error_span_with_a_terminal_frame(
    observed: Gateway, receiver: OtlpReceiver
) -> None:
    result = post(
        f"{observed.url}/v1/chat/completions", chat(max_tokens=8), headers={"x-sim-fault": "close@after:3"}
    )
    assert result.status == 200 and result.request_id
    spans = _spans(receiver, result.request_id, 2)
    [root] = [s for s in spans if s["parent_span_id"] == ""]
    assert root["trace_id"] != CLIENT_TRACE_ID  # no client context: a trace of its own
    assert root["attributes"]["router_sidecar.phase"] == "interrupted"
    assert root["attributes"]["error.type"] == "upstream_decode_interrupted"
    assert root["attributes"]["router_sidecar.delivered_output_tokens"] == 3
    assert root["status"] == 2
    [(_, detail)] = [(n, d) for n, d in root["events"] if n == "terminal_frame"]
    assert detail["delivered_output_tokens"] == 3


def test_metrics_scrape_and_otlp_export(observed: Gateway, receiver: OtlpReceiver) -> None:
    for _ in range(2):
        assert post(f"{observed.url}/v1/chat/completions", chat(max_tokens=4)).status == 200
    families: dict[str, list[Any]] = {}

    def scraped() -> bool:
        nonlocal families
        families = _scrape(observed)
        completed = [
            s
            for s in families.get("router_sidecar_requests", [])
            if s.name == "router_sidecar_requests_total" and s.labels.get("phase") == "completed"
        ]
        return bool(completed) and completed[0].value >= 2

    poll(scraped, timeout=15, what="two completed requests in the Prometheus scrape")
    ttft = {s.name: s for s in families["gen_ai_server_time_to_first_token_seconds"]}
    count = ttft["gen_ai_server_time_to_first_token_seconds_count"]
    assert count.value >= 2
    assert count.labels["gen_ai_operation_name"] == "chat" and count.labels["gen_ai_request_model"] == "tiny"
    # The conventions' bucket advice, not the SDK's defaults.
    buckets = {
        s.labels["le"] for s in families["gen_ai_server_time_to_first_token_seconds"] if "le" in s.labels
    }
    assert {"0.001", "0.02", "10.0", "+Inf"} <= buckets
    for family in (
        "gen_ai_server_request_duration_seconds",
        "gen_ai_server_time_per_output_token_seconds",
        "gen_ai_client_token_usage",
        "router_sidecar_attempts",
        "router_sidecar_journal_write_duration_seconds",
        "router_sidecar_extproc_messages",
        "router_sidecar_extproc_busy_time_seconds",
    ):
        assert family in families, sorted(families)
    usage = [s for s in families["gen_ai_client_token_usage"] if s.name.endswith("_count")]
    assert {s.labels["gen_ai_token_type"] for s in usage} == {"output"}
    # No request ids on metrics: every label value comes from a small set.
    for samples in families.values():
        for sample in samples:
            assert not any(v.startswith(("req_", "att_")) for v in sample.labels.values()), sample
    poll(
        lambda: "gen_ai.server.time_to_first_token" in receiver.metric_names,
        timeout=15,
        what="metrics at the OTLP receiver",
    )


def test_json_logs_name_the_request_and_its_trace(observed: Gateway) -> None:
    # A failed attempt is logged (INFO), with the ids of what the line is about.
    result = post(
        f"{observed.url}/v1/chat/completions",
        chat(max_tokens=6),
        headers={"traceparent": CLIENT_TRACEPARENT, "x-sim-fault": "status503@headers attempt=1"},
    )
    assert result.status == 200
    journal = observed.wait_journal(
        result.request_id, lambda j: j.get("phase") == "completed", headers=dict(CREDENTIAL)
    )
    first = journal["attempts"][0]
    lines: list[dict[str, Any]] = []

    def logged() -> bool:
        nonlocal lines
        lines = json_lines(observed.out_path, prefix="{")
        return any(line.get("request_id") == result.request_id for line in lines)

    poll(logged, timeout=10, what="a JSON log line about the request")
    assert all({"time", "level", "logger", "message"} <= set(line) for line in lines)
    [line] = [x for x in lines if x.get("request_id") == result.request_id]
    assert (
        line["level"] == "INFO" and "failed before any content (upstream_status): retrying" in line["message"]
    )
    assert (line["attempt_id"], line["trace_id"]) == (first["attempt_id"], CLIENT_TRACE_ID)
    # What the request is: its API, and the engine behind the attempt's replica (static: unknown).
    assert (line["api"], line["gen_ai.operation.name"], line["gen_ai.provider.name"]) == (
        "chat.completions",
        "chat",
        "unknown",
    )


# --- each API, and the engine behind a registered replica -----------------------------------------------

RESPONSES_BODY = {"model": "tiny", "input": "Say something", "stream": True, "max_output_tokens": 4}
MESSAGES_BODY = {
    "model": "tiny",
    "messages": [{"role": "user", "content": "Say something"}],
    "stream": True,
    "max_tokens": 4,
}


def test_each_api_is_named_on_spans_and_metrics(observed: Gateway, receiver: OtlpReceiver) -> None:
    """The Responses and Messages APIs are `chat` operations by the GenAI conventions; which route it was is
    `router_sidecar.api`, on the spans and the metrics."""
    for path, body, api in (
        ("/v1/responses", RESPONSES_BODY, "responses"),
        ("/v1/messages", MESSAGES_BODY, "messages"),
        (
            "/v1/completions",
            {"model": "tiny", "prompt": "Say", "stream": True, "max_tokens": 4},
            "completions",
        ),
    ):
        result = post(f"{observed.url}{path}", body)
        assert result.status == 200 and result.request_id, result.body[:200]
        spans = _spans(receiver, result.request_id, 2)
        [root] = [s for s in spans if s["parent_span_id"] == ""]
        operation = "text_completion" if api == "completions" else "chat"
        assert root["name"] == f"{operation} tiny"
        assert (
            root["attributes"]["gen_ai.operation.name"],
            root["attributes"]["router_sidecar.api"],
            root["attributes"]["gen_ai.provider.name"],
        ) == (operation, api, "unknown")
        [attempt] = [s for s in spans if s["parent_span_id"] == root["span_id"]]
        assert attempt["attributes"]["gen_ai.provider.name"] == "unknown"
    families: dict[str, list[Any]] = {}

    def scraped() -> bool:
        nonlocal families
        families = _scrape(observed)
        apis = {
            s.labels.get("router_sidecar_api")
            for s in families.get("gen_ai_server_time_to_first_token_seconds", [])
            if s.name.endswith("_count")
        }
        return {"responses", "messages", "completions"} <= apis

    poll(scraped, timeout=15, what="the three APIs in the Prometheus scrape")
    [count] = [
        s
        for s in families["gen_ai_server_time_to_first_token_seconds"]
        if s.name.endswith("_count") and s.labels["router_sidecar_api"] == "messages"
    ]
    assert (
        count.labels["gen_ai_operation_name"] == "chat" and count.labels["gen_ai_provider_name"] == "unknown"
    )


def test_a_registered_replica_names_its_engine(
    etcd: str, receiver: OtlpReceiver, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Behind discovery, the engine the replica agent fingerprinted (the simulator answers /v1/models as
    vLLM does, `owned_by: "vllm"`) is `gen_ai.provider.name` on the request span (from its pin, at its
    start) and on the attempt span."""
    work: Path = tmp_path_factory.mktemp("telemetry-registered")
    sim = Sim("registered", work)
    agent = gateway = None
    try:
        agent = Agent(sim, etcd, work)
        gateway = Gateway(replicas=[], etcd=etcd, work=work, env=_otlp_env(receiver))
        result = post(f"{gateway.url}/v1/messages", MESSAGES_BODY)
        assert result.status == 200 and result.request_id, result.body[:200]
        spans = _spans(receiver, result.request_id, 2)
    finally:
        if gateway is not None:
            gateway.stop()
        if agent is not None:
            agent.stop()
        sim.stop()
    [root] = [s for s in spans if s["parent_span_id"] == ""]
    [attempt] = [s for s in spans if s["parent_span_id"] == root["span_id"]]
    assert root["attributes"]["router_sidecar.api"] == "messages"
    assert root["attributes"]["gen_ai.provider.name"] == "vllm"
    assert attempt["attributes"]["gen_ai.provider.name"] == "vllm"
