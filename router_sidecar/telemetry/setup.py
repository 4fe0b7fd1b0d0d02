"""Where spans and metrics go: a Prometheus endpoint (`--metrics HOST:PORT`) and OTLP over gRPC when
`OTEL_EXPORTER_OTLP_ENDPOINT` (or its per-signal variants) is set. Neither: a `Telemetry` that records
nothing (no tracer, a no-op meter).

The standard OpenTelemetry environment variables apply as the SDK reads them (`OTEL_SERVICE_NAME`,
`OTEL_RESOURCE_ATTRIBUTES`, `OTEL_TRACES_SAMPLER`, `OTEL_EXPORTER_OTLP_HEADERS`, `..._INSECURE`,
`OTEL_METRIC_EXPORT_INTERVAL`). Only the gRPC protocol is built in.
"""

from __future__ import annotations

import ipaddress
import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from router_sidecar.telemetry.observer import Telemetry

if TYPE_CHECKING:
    from opentelemetry.sdk.metrics.export import MetricReader

log = logging.getLogger(__name__)

DEFAULT_METRICS_HOST = "127.0.0.1"


class TelemetryConfigError(ValueError):
    """A telemetry setting that cannot work, with what to do instead."""


@dataclass(frozen=True, slots=True)
class MetricsListen:
    host: str
    port: int

    @classmethod
    def parse(cls, text: str) -> MetricsListen:
        """`PORT`, `:PORT` (loopback) or `HOST:PORT`. Another host than loopback is the operator's choice
        (a Prometheus in another Pod must reach it); the metrics carry no request data."""
        host, sep, port = text.rpartition(":")
        if not sep:
            host, port = "", text
        host = host.strip("[]") or DEFAULT_METRICS_HOST
        if not port.isdigit() or not 0 < int(port) < 65536:
            raise TelemetryConfigError(f"--metrics {text!r}: expected PORT or HOST:PORT, e.g. 127.0.0.1:9464")
        return cls(host, int(port))

    @property
    def is_loopback(self) -> bool:
        try:
            return ipaddress.ip_address(self.host).is_loopback
        except ValueError:
            return self.host == "localhost"


@dataclass(slots=True)
class TelemetryRuntime:
    telemetry: Telemetry
    metrics_url: str | None = None  # where Prometheus scrapes, when served
    otlp_endpoint: str | None = None
    _shutdown: list[Callable[[], object]] = field(default_factory=list)

    def shutdown(self) -> None:
        """Flush what is batched (spans, the last metrics) and stop the endpoint."""
        for step in self._shutdown:
            try:
                step()
            except Exception as exc:  # an exporter that cannot flush must not keep the process up
                log.warning("telemetry: shutdown step failed: %s", exc)


def otlp_endpoint(env: Mapping[str, str]) -> str | None:
    for name in (
        "OTEL_EXPORTER_OTLP_ENDPOINT",
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
        "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT",
    ):
        if env.get(name):
            return env[name]
    return None


def build_telemetry(
    *,
    metrics: MetricsListen | None,
    instance_id: str,
    env: Mapping[str, str] | None = None,
) -> TelemetryRuntime:
    env = os.environ if env is None else env
    endpoint = otlp_endpoint(env)
    if metrics is None and endpoint is None:
        return TelemetryRuntime(Telemetry())
    protocol = env.get("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
    if endpoint is not None and protocol != "grpc":
        raise TelemetryConfigError(
            f"OTEL_EXPORTER_OTLP_PROTOCOL={protocol!r}: the sidecar exports OTLP over gRPC only; unset it or "
            "set it to grpc, and point OTEL_EXPORTER_OTLP_ENDPOINT at the collector's gRPC port (4317)"
        )
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.resources import Resource

    resource = Resource.create({"service.name": env.get("OTEL_SERVICE_NAME", "router-sidecar")}).merge(
        Resource({"service.instance.id": instance_id})
    )
    runtime = TelemetryRuntime(Telemetry(), otlp_endpoint=endpoint)
    readers: list[MetricReader] = []
    if metrics is not None:
        readers.append(_serve_prometheus(metrics, runtime))
    tracer_provider = None
    if endpoint is not None:
        from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        tracer_provider = TracerProvider(resource=resource)
        tracer_provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
        runtime._shutdown.insert(0, tracer_provider.shutdown)
        readers.append(PeriodicExportingMetricReader(OTLPMetricExporter()))
    meter_provider = MeterProvider(resource=resource, metric_readers=readers)
    runtime._shutdown.insert(0, meter_provider.shutdown)
    runtime.telemetry = Telemetry(tracer_provider, meter_provider)
    return runtime


def _serve_prometheus(listen: MetricsListen, runtime: TelemetryRuntime) -> MetricReader:
    from opentelemetry.exporter.prometheus import PrometheusMetricReader
    from prometheus_client import CollectorRegistry, start_http_server

    registry = CollectorRegistry()  # ours alone: no process/platform collectors of the default one
    reader = PrometheusMetricReader(registry=registry, scope_info_enabled=False)  # no otel_scope_* labels
    try:
        server, _thread = start_http_server(  # a daemon thread; shutdown() stops it
            listen.port, addr=listen.host, registry=registry
        )
    except OSError as exc:
        raise TelemetryConfigError(
            f"cannot serve metrics on {listen.host}:{listen.port} ({exc}); pick a free port with --metrics"
        ) from exc
    port = server.server_address[1]
    host = listen.host if ":" not in listen.host else f"[{listen.host}]"
    runtime.metrics_url = f"http://{host}:{port}/metrics"
    runtime._shutdown.append(server.shutdown)
    if not listen.is_loopback:
        log.warning(
            "metrics served on %s (not loopback): make sure only your scraper reaches it", listen.host
        )
    return reader
