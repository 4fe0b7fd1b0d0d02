"""Spans and metrics as views of the machines' named events.

The journal drains every request's events (stamped with the wall clock) and hands them here as well: a span
per logical request, a child span per attempt, span events for what happened to each, and the metrics. Nothing
here decides anything, and nothing runs per chunk: a request's events are a handful, drained when the shells
already touch the journal. Metric labels are bounded (phase, outcome, reason, proof, code; the API, one of
four; the engine, the first 8 names the registry gave, then "other"; the model name cut to 64 characters,
the first 32 names seen, then "other"); no request ids on metrics.

Each request names its API and the engine behind it, as the OpenTelemetry GenAI conventions ask:
`gen_ai.operation.name` is `chat` for chat completions, the Responses API and the Messages API (the
conventions' value for a chat-style generation; they define none for either of the latter) and
`text_completion` for completions; `router_sidecar.api` says which of the four routes it was
(`chat.completions`, `completions`, `responses`, `messages`); `gen_ai.provider.name` is the engine behind the
replica (`vllm`, `sglang`: the engine a registered replica's agent fingerprinted, `Fingerprint.engine_name`;
custom values, the conventions list hosted providers only) or `unknown` for a replica nothing registered (a
static `--replica`: the gateway only probes its /health, which does not say).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.metrics import Meter, MeterProvider, NoOpMeterProvider
from opentelemetry.trace import SpanKind, Status, StatusCode, Tracer, TracerProvider
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from router_sidecar.core import views
from router_sidecar.core.events import EventName
from router_sidecar.core.request import LogicalRequest, Phase
from router_sidecar.telemetry import logs

log = logging.getLogger(__name__)

_PROPAGATOR = TraceContextTextMapPropagator()
_NS = "router_sidecar."

# The GenAI semantic conventions' advice for each histogram's buckets.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
DURATION_BUCKETS = (0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96, 81.92)
TOKEN_BUCKETS = (1, 4, 16, 64, 256, 1024, 4096, 16384, 65536, 262144, 1048576, 4194304, 16777216, 67108864)
# Ours: fences and journal writes are milliseconds to a lease TTL.
FENCE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
WRITE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)

# gen_ai.operation.name by route: the conventions' `chat` covers the chat-style APIs (OpenAI's Chat
# Completions and Responses, Anthropic's Messages; the OpenAI conventions tell the first two apart with
# `openai.api.type`, an attribute for provider `openai` only), `text_completion` the legacy completions.
_OPERATION = {
    "chat.completions": "chat",
    "completions": "text_completion",
    "responses": "chat",
    "messages": "chat",
}
API = _NS + "api"  # which route: chat.completions, completions, responses, messages
PROVIDER = "gen_ai.provider.name"
# The engine behind a replica nothing registered (a static --replica): not known to the gateway.
UNKNOWN_PROVIDER = "unknown"
MAX_PROVIDER_LABELS = 8  # engine names come from registrations (operators), bounded anyway
_PROVIDER_RE = re.compile(r"[a-z0-9][a-z0-9_.-]{0,31}")
# Where the engine of a replica comes from: the replica's address (HOST:PORT, as attempts name it) or a
# compatibility pin's fingerprint digest -> the engine's name (None: unknown).
EngineLookup = Callable[[str], str | None]
# A client-chosen string on a metric: bounded in length, and in number (later names are "other"). A name takes
# one of the slots only once it is known to be served: pinned to a registered replica's fingerprint, or a
# replica sent content for it (static replicas accept any string; a client must not be able to fill them).
MAX_MODEL_LABEL = 64
MAX_MODEL_LABELS = 32
UNSERVED_MODEL = "other"

# Span event names for the machines' events (the issue's vocabulary: fence started/proven, terminal frame).
_SPAN_EVENT = {
    EventName.HEADERS_HELD: "headers_held",
    EventName.FIRST_DELTA_SENT: "first_delta",
    EventName.REPLICA_LOST: "fence_started",
    EventName.ATTEMPT_FENCED: "fence_proven",
    EventName.ATTEMPT_FAILED: "attempt_failed",
    EventName.RETRY_TRIGGERED: "retry_triggered",
    EventName.RETRY_REFUSED: "retry_refused",
    EventName.RESPONSE_PASSED_THROUGH: "response_passed_through",
    EventName.RESPONSE_REPLACED: "response_replaced",
    EventName.STREAM_TERMINATED: "terminal_frame",
    EventName.STREAM_RESET: "stream_reset",
    EventName.CLIENT_DISCONNECTED: "client_disconnect",
    EventName.STREAM_COMPLETED: "stream_completed",
    EventName.REQUEST_FAILED: "request_failed",
}


def _ns(seconds: float) -> int:
    return int(seconds * 1e9)


def _scalar_attributes(record: Mapping[str, Any]) -> dict[str, Any]:
    """A journal event's details as span event attributes (scalars only; `t` and `event` are the event)."""
    out: dict[str, Any] = {}
    for key, value in record.items():
        if key in ("t", "event"):
            continue
        if isinstance(value, bool | int | float | str):
            out[key] = value
        elif isinstance(value, list | tuple) and all(isinstance(v, str) for v in value):
            out[key] = list(value)
    return out


@dataclass(slots=True)
class _Traced:
    """One request's open spans and the times its metrics need."""

    span: trace.Span | None
    accepted_at: float
    attributes: dict[str, str]  # the bounded metric attributes of this request
    attempts: dict[int, trace.Span] = field(default_factory=dict)
    providers: dict[int, str] = field(default_factory=dict)  # the engine behind each attempt's replica
    attempt_started_at: dict[int, float] = field(default_factory=dict)
    first_delta_at: float | None = None
    last_at: float = 0.0


class Telemetry:
    """Turns drained events into spans and metrics. Without providers it costs next to nothing: a no-op
    tracer is never asked for spans and the no-op meter's instruments do nothing."""

    def __init__(
        self,
        tracer_provider: TracerProvider | None = None,
        meter_provider: MeterProvider | None = None,
        *,
        engines: EngineLookup | None = None,
        pinned_engines: EngineLookup | None = None,
    ) -> None:
        self._tracer: Tracer | None = (
            tracer_provider.get_tracer("router_sidecar") if tracer_provider else None
        )
        meter: Meter = (meter_provider or NoOpMeterProvider()).get_meter("router_sidecar")
        self._engines = engines
        self._pinned_engines = pinned_engines
        self._provider_labels: set[str] = set()
        self._model_labels: set[str] = set()
        self._parents: dict[LogicalRequest, otel_context.Context] = {}
        self._open: dict[LogicalRequest, _Traced] = {}
        # GenAI semantic conventions.
        self.ttft = meter.create_histogram(
            "gen_ai.server.time_to_first_token",
            unit="s",
            description="Time from admission to the first content released towards the client",
            explicit_bucket_boundaries_advisory=TTFT_BUCKETS,
        )
        self.tpot = meter.create_histogram(
            "gen_ai.server.time_per_output_token",
            unit="s",
            description="Time per output token after the first, per request",
            explicit_bucket_boundaries_advisory=TPOT_BUCKETS,
        )
        self.duration = meter.create_histogram(
            "gen_ai.server.request.duration",
            unit="s",
            description="Time from admission to the end of the logical request's stream",
            explicit_bucket_boundaries_advisory=DURATION_BUCKETS,
        )
        self.token_usage = meter.create_histogram(
            "gen_ai.client.token.usage",
            unit="{token}",
            description="Output tokens delivered to the client, per request",
            explicit_bucket_boundaries_advisory=TOKEN_BUCKETS,
        )
        # Ours.
        self.requests = meter.create_counter(
            _NS + "requests", unit="{request}", description="Logical requests by final phase and outcome"
        )
        self.attempts = meter.create_counter(
            _NS + "attempts", unit="{attempt}", description="Attempts by outcome"
        )
        self.retries = meter.create_counter(
            _NS + "retries", unit="{retry}", description="Retries triggered, by the failure that caused them"
        )
        self.retries_refused = meter.create_counter(
            _NS + "retries.refused",
            unit="{retry}",
            description="Retries refused (budget, cost cap, no compatible replica, fence unprovable, ...)",
        )
        self.terminal_frames = meter.create_counter(
            _NS + "terminal_frames", unit="{frame}", description="Terminal error frames sent, by code"
        )
        self.fence_duration = meter.create_histogram(
            _NS + "fence.duration",
            unit="s",
            description="Time to prove an attempt fenced, by proof (cancel_ack: the replica's cancel ack)",
            explicit_bucket_boundaries_advisory=FENCE_BUCKETS,
        )
        self.journal_write = meter.create_histogram(
            _NS + "journal.write.duration",
            unit="s",
            description="etcd writes of the request journal, by kind and result",
            explicit_bucket_boundaries_advisory=WRITE_BUCKETS,
        )
        self.extproc_messages = meter.create_counter(
            _NS + "extproc.messages", unit="{message}", description="ext_proc messages handled, by placement"
        )
        self.extproc_busy = meter.create_counter(
            _NS + "extproc.busy_time",
            unit="s",
            description="Time from receiving an ext_proc message to replying to it, awaits included, by "
            "placement (divide by extproc.messages for the time per message)",
        )

    # --- where the engines come from ---------------------------------------------------------------------

    def read_engines(self, registry: object) -> None:
        """Name the engine behind each registered replica from `registry.replicas` (address -> its
        registration, whose `engine_name` and `digest` the replica agent's fingerprint gave: the gateway's
        LivenessMonitor). Read at each look-up, so registrations that come and go are followed."""

        def replicas() -> Mapping[str, object]:
            found = getattr(registry, "replicas", None)
            return found if isinstance(found, Mapping) else {}

        def engine_of(address: str) -> str | None:
            return _engine_name(replicas().get(address))

        def engine_of_pin(digest: str) -> str | None:
            engines = {_engine_name(r) for r in replicas().values() if getattr(r, "digest", None) == digest}
            return engines.pop() if len(engines) == 1 else None

        self._engines, self._pinned_engines = engine_of, engine_of_pin

    def provider(self, replica: str) -> str:
        """`gen_ai.provider.name` of the engine behind `replica` (a bounded label)."""
        return self._provider_label(_lookup(self._engines, replica))

    # --- what the shells tell us -------------------------------------------------------------------------

    def admitted(self, request: LogicalRequest, headers: Mapping[str, str]) -> None:
        """The client's trace context (its `traceparent`) is the parent of the request's span. From here on,
        the log lines about the request name its API, and those about an attempt the engine behind it."""
        if self._tracer is not None and "traceparent" in headers:
            self._parents[request] = _PROPAGATOR.extract(headers)
        route = request.parsed.kind.value
        about_request = {"api": route, "gen_ai.operation.name": _OPERATION.get(route, route)}

        def about(attempt_id: str | None) -> dict[str, str]:
            trace_id = self.trace_id(request)
            line = about_request if trace_id is None else {"trace_id": trace_id, **about_request}
            attempt = request.attempt(attempt_id) if attempt_id else None
            if attempt is None and request.attempts:
                attempt = request.attempts[-1]
            if attempt is None:
                return line
            return {**line, PROVIDER: self.provider(attempt.replica)}

        logs.describe(request.request_id, about)

    def traceparent(self, request: LogicalRequest, attempt_number: int) -> str | None:
        """The attempt span's context, for the attempt's request to the replica (None: not tracing)."""
        traced = self._open.get(request)
        span = traced.attempts.get(attempt_number) if traced is not None else None
        if span is None:
            return None
        carrier: dict[str, str] = {}
        _PROPAGATOR.inject(carrier, trace.set_span_in_context(span))
        return carrier.get("traceparent")

    def trace_id(self, request: LogicalRequest) -> str | None:
        """The request span's trace id (hex), for log lines (None: not tracing)."""
        traced = self._open.get(request)
        if traced is None or traced.span is None:
            return None
        return format(traced.span.get_span_context().trace_id, "032x")

    def stream_handled(self, placement: str, messages: int, busy_seconds: float) -> None:
        attributes = {"placement": placement}
        self.extproc_messages.add(messages, attributes)
        self.extproc_busy.add(busy_seconds, attributes)

    def journal_written(self, kind: str, seconds: float, ok: bool) -> None:
        self.journal_write.record(seconds, {"kind": kind, "result": "ok" if ok else "error"})

    # --- the events --------------------------------------------------------------------------------------

    def observe(self, request: LogicalRequest, records: list[dict[str, Any]]) -> None:
        try:
            self._observe(request, records)
        except Exception:  # a view must never fail the request it looks at
            log.exception("telemetry: events of request %s not recorded", request.request_id)

    def _observe(self, request: LogicalRequest, records: list[dict[str, Any]]) -> None:
        for record in records:
            try:
                name = EventName(record.get("event"))
            except ValueError:
                continue
            at = record.get("t")
            if not isinstance(at, int | float):
                continue
            if name is EventName.REQUEST_ACCEPTED:
                self._accepted(request, record, at)
                continue
            traced = self._open.get(request)
            if traced is None:
                continue
            traced.last_at = max(traced.last_at, at)
            attempt = record.get("attempt")
            if name is EventName.ATTEMPT_STARTED and isinstance(attempt, int):
                self._attempt_started(traced, attempt, record, at)
            elif name is EventName.FIRST_DELTA_SENT and traced.first_delta_at is None:
                traced.first_delta_at = at
                # A replica sent content for this model: it is served.
                traced.attributes["gen_ai.request.model"] = self._model_label(request, served=True)
                if isinstance(attempt, int) and attempt in traced.providers:
                    traced.attributes[PROVIDER] = traced.providers[attempt]  # the engine that delivered
                self.ttft.record(max(0.0, at - traced.accepted_at), traced.attributes)
            elif name is EventName.ATTEMPT_FENCED and isinstance(record.get("proof"), str):
                waited = float(record.get("waited_ms") or 0.0) / 1000
                self.fence_duration.record(waited, {"proof": record["proof"]})
            elif name is EventName.ANSWERED_BY_FALLBACK:
                # The model that answered (a policy's name: bounded), beside the one asked for.
                traced.attributes["gen_ai.response.model"] = str(record.get("model"))[:MAX_MODEL_LABEL]
            elif name is EventName.RETRY_TRIGGERED:
                self.retries.add(1, {"reason": str(record.get("reason"))})
            elif name is EventName.RETRY_REFUSED:
                self.retries_refused.add(1, {"reason": str(record.get("reason"))})
            elif name is EventName.STREAM_TERMINATED:
                code = request.outcome.value if request.outcome else "upstream_decode_interrupted"
                self.terminal_frames.add(1, {"code": code, API: traced.attributes[API]})
            if name in _SPAN_EVENT:
                span = traced.attempts.get(attempt) if isinstance(attempt, int) else None
                target = span if span is not None and name is not EventName.RETRY_REFUSED else traced.span
                if target is not None:
                    target.add_event(_SPAN_EVENT[name], _scalar_attributes(record), timestamp=_ns(at))
                if name is EventName.ATTEMPT_FAILED and span is not None:
                    span.set_status(Status(StatusCode.ERROR, str(record.get("detail") or "")))
                    span.set_attribute("error.type", str(record.get("reason")))

    def finished(self, request: LogicalRequest) -> None:
        """The request's stream is over (its last journal write): end its spans, count its metrics."""
        try:
            self._finished(request)
        except Exception:  # a view must never fail the request it looks at
            log.exception("telemetry: the end of request %s not recorded", request.request_id)
        finally:
            logs.forget(request.request_id)

    def _finished(self, request: LogicalRequest) -> None:
        self._parents.pop(request, None)
        traced = self._open.pop(request, None)
        if traced is None:
            return
        end = traced.last_at or traced.accepted_at
        phase = request.phase.value
        outcome = request.outcome.value if request.outcome else "unknown"
        failed = request.phase is not Phase.COMPLETED
        if request.attempts and request.attempts[-1].number in traced.providers:
            # The engine of the attempt that served (or was the last to try): retries stay in one group.
            traced.attributes[PROVIDER] = traced.providers[request.attempts[-1].number]
        attributes = dict(traced.attributes)
        if failed:
            attributes["error.type"] = outcome
        self.requests.add(1, {**traced.attributes, "phase": phase, "outcome": outcome})
        self.duration.record(max(0.0, end - traced.accepted_at), attributes)
        delivered = request.delivered_output_tokens
        if delivered:
            self.token_usage.record(delivered, {**traced.attributes, "gen_ai.token.type": "output"})
        if traced.first_delta_at is not None and delivered > 1:
            self.tpot.record(max(0.0, end - traced.first_delta_at) / (delivered - 1), traced.attributes)
        for attempt in request.attempts:
            self.attempts.add(1, {"outcome": views.attempt_outcome(attempt, request.phase)})
            span = traced.attempts.get(attempt.number)
            if span is not None:
                span.set_attribute(_NS + "outcome", views.attempt_outcome(attempt, request.phase))
                if attempt.failure is not None:
                    span.set_attribute(_NS + "failure", attempt.failure.value)
                if attempt.status is not None:
                    span.set_attribute("http.response.status_code", attempt.status)
                span.end(end_time=_ns(end))
        span = traced.span
        if span is None:
            return
        span.set_attribute(PROVIDER, traced.attributes[PROVIDER])
        span.set_attribute(_NS + "phase", phase)
        span.set_attribute(_NS + "outcome", outcome)
        span.set_attribute(_NS + "delivered_output_tokens", delivered)
        span.set_attribute(_NS + "first_delta_sent", request.first_delta_sent)
        span.set_attribute("gen_ai.usage.output_tokens", delivered)
        if request.finish_reason is not None:
            span.set_attribute("gen_ai.response.finish_reasons", [request.finish_reason])
        if failed:
            span.set_attribute("error.type", outcome)
            span.set_status(Status(StatusCode.ERROR, outcome))
        span.end(end_time=_ns(end))

    def forget(self, request: LogicalRequest) -> None:
        """Never served (its id was taken): no spans, no metrics."""
        self._parents.pop(request, None)
        self._open.pop(request, None)
        logs.forget(request.request_id)

    # --- internals ---------------------------------------------------------------------------------------

    def _accepted(self, request: LogicalRequest, record: Mapping[str, Any], at: float) -> None:
        route = str(record.get("route") or request.parsed.kind.value)
        operation = _OPERATION.get(route, route)
        served = request.fingerprint_digest is not None  # pinned to a registered replica that serves it
        # Pinned to a compatibility group, the engine is known now (every attempt goes to that group).
        engine = _lookup(self._pinned_engines, request.fingerprint_digest) if served else None
        attributes = {
            "gen_ai.operation.name": operation,
            PROVIDER: self._provider_label(engine),
            API: route if route in _OPERATION else "other",
            "gen_ai.request.model": self._model_label(request, served=served),
        }
        span = None
        if self._tracer is not None:
            model = (request.parsed.model or "")[:MAX_MODEL_LABEL]  # a client's string: bounded
            span = self._tracer.start_span(
                f"{operation} {model}",
                context=self._parents.get(request),
                kind=SpanKind.SERVER,
                start_time=_ns(at),
                attributes={
                    **attributes,
                    "gen_ai.request.model": model,
                    _NS + "request_id": request.request_id,
                    _NS + "stream": bool(request.parsed.stream),
                    _NS + "estimated_prompt_tokens": request.parsed.estimated_prompt_tokens,
                },
            )
        self._open[request] = _Traced(span=span, accepted_at=at, attributes=attributes, last_at=at)

    def _model_label(self, request: LogicalRequest, *, served: bool) -> str:
        model = (request.parsed.model or "")[:MAX_MODEL_LABEL]
        if model in self._model_labels:
            return model
        if not served or len(self._model_labels) >= MAX_MODEL_LABELS:
            return UNSERVED_MODEL
        self._model_labels.add(model)
        return model

    def _provider_label(self, engine: str | None) -> str:
        if engine is None:
            return UNKNOWN_PROVIDER
        name = engine.strip().lower()
        if not _PROVIDER_RE.fullmatch(name):
            return UNSERVED_MODEL
        if name in self._provider_labels:
            return name
        if len(self._provider_labels) >= MAX_PROVIDER_LABELS:
            return UNSERVED_MODEL
        self._provider_labels.add(name)
        return name

    def _attempt_started(self, traced: _Traced, number: int, record: Mapping[str, Any], at: float) -> None:
        traced.attempt_started_at[number] = at
        replica = str(record.get("replica") or "")
        provider = traced.providers[number] = self.provider(replica)
        if traced.attributes[PROVIDER] == UNKNOWN_PROVIDER:
            traced.attributes[PROVIDER] = provider
        if traced.span is None or self._tracer is None:
            return
        host, _, port = replica.rpartition(":")
        attributes: dict[str, Any] = {
            PROVIDER: provider,
            _NS + "attempt": number,
            _NS + "attempt_id": str(record.get("attempt_id") or ""),
            _NS + "replica": replica,
            "server.address": host or replica,
        }
        if port.isdigit():
            attributes["server.port"] = int(port)
        traced.attempts[number] = self._tracer.start_span(
            f"attempt {number}",
            context=trace.set_span_in_context(traced.span),
            kind=SpanKind.CLIENT,
            start_time=_ns(at),
            attributes=attributes,
        )


def _engine_name(registration: object) -> str | None:
    name = getattr(registration, "engine_name", None) if registration is not None else None
    return name if isinstance(name, str) and name else None


def _lookup(lookup: EngineLookup | None, key: str | None) -> str | None:
    """A look-up that cannot fail the view: an error is an unknown engine."""
    if lookup is None or key is None:
        return None
    try:
        return lookup(key)
    except Exception:
        log.debug("telemetry: no engine for %s", key, exc_info=True)
        return None
