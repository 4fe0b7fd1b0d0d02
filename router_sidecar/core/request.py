"""The logical-request machine: what the user asked for once, as seen by the DOWNSTREAM filter.

Sans-IO, like `attempt.py`. It owns the phase (prefill → decode → terminal), the retry decision for a
failed attempt, the delivered-token count, and what the client receives after the first delta: the
rest of one attempt's events, ending either in `[DONE]` or in exactly one terminal error frame.

The boundary is delivery, not generation: `phase` turns to DECODE when this direction forwards the
first content event towards the client, and from then on no retry is ever allowed.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from router_sidecar.core.attempt import AttemptFailed, is_event_stream
from router_sidecar.core.events import Event, EventName
from router_sidecar.core.openai_api import ParsedRequest
from router_sidecar.core.policy import Policy
from router_sidecar.core.sse import EventKind, SseScanner, terminal_error_frame

if TYPE_CHECKING:
    from router_sidecar.coordination.fencing import AttemptLease


class Phase(enum.StrEnum):
    PREFILL = "prefill"
    DECODE = "decode"
    COMPLETED = "completed"
    INTERRUPTED = "interrupted"
    CANCELLED = "cancelled"
    REJECTED = "rejected"
    FAILED = "failed"


TERMINAL_PHASES = frozenset(
    {Phase.COMPLETED, Phase.INTERRUPTED, Phase.CANCELLED, Phase.REJECTED, Phase.FAILED}
)


class Outcome(enum.StrEnum):
    """The terminal outcome code of a logical request (journal `outcome`)."""

    COMPLETED = "completed"
    UPSTREAM_DECODE_INTERRUPTED = "upstream_decode_interrupted"
    CLIENT_DISCONNECTED = "client_disconnected"
    RETRIES_EXHAUSTED = "retries_exhausted"
    RETRY_NOT_ALLOWED = "retry_not_allowed"
    FENCE_UNPROVABLE = "fence_unprovable"
    NO_COMPATIBLE_REPLICA = "no_compatible_replica"
    UPSTREAM_ERROR = "upstream_error"
    INVALID_REQUEST = "invalid_request"


class DownstreamLoss(enum.StrEnum):
    """Why the client-facing stream ended without our doing (from Envoy's access log flags)."""

    CLIENT_GONE = "client_gone"
    UPSTREAM_RESET = "upstream_reset"
    UNKNOWN = "unknown"


@dataclass(slots=True)
class AttemptRecord:
    number: int
    attempt_id: str
    replica: str
    outcome: str | None = None
    detail: str | None = None
    lease: AttemptLease | None = None  # its right to publish (fencing.py)
    fence: dict[str, Any] | None = None  # how it was fenced, when it was

    def as_record(self) -> dict[str, Any]:
        return {
            "attempt": self.number,
            "attempt_id": self.attempt_id,
            "replica": self.replica,
            "outcome": self.outcome,
            "detail": self.detail,
            "lease": self.lease.as_record() if self.lease else None,
            "fence": self.fence,
        }


# --- decisions ---------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TriggerRetry:
    """Answer the held response headers with `:status 503` so Envoy's router retries elsewhere."""

    reason: str


@dataclass(frozen=True, slots=True)
class FailRequest:
    """No retry: answer the client with a real HTTP error before any byte of the body went out."""

    status: int
    body: bytes


@dataclass(frozen=True, slots=True)
class Forward:
    data: bytes
    end_of_stream: bool


@dataclass(frozen=True, slots=True)
class Terminate:
    """End the client stream ourselves: `data` is the delivered prefix's tail + terminal frame + [DONE]."""

    data: bytes


BodyDecision = Forward | Terminate


@dataclass(slots=True)
class _ResponseDirection:
    status: int | None = None
    streaming: bool = False
    scanner: SseScanner = field(default_factory=SseScanner)
    done_seen: bool = False
    content_events: int = 0
    usage_tokens: int | None = None
    ended: bool = False
    non_stream_body: bytearray = field(default_factory=bytearray)


class LogicalRequest:
    def __init__(self, *, request_id: str, tenant: str, parsed: ParsedRequest, policy: Policy) -> None:
        self.request_id = request_id
        self.tenant = tenant
        self.parsed = parsed
        self.policy = policy
        self.phase = Phase.PREFILL
        self.outcome: Outcome | None = None
        self.first_delta_sent = False
        self.attempts: list[AttemptRecord] = []
        self.model_revision: str | None = None
        self.fingerprint_digest: str | None = None  # the compatibility group every attempt is pinned to
        self.tool_calls: dict[str, dict[str, Any]] = {}  # idempotency key → what happened, by which attempt
        cap = policy.reprefill_cost_cap.max_prompt_tokens
        # Why no retry may ever start for this request (None: retries allowed within the budget).
        self.retry_blocked: str | None = None
        if parsed.estimated_prompt_tokens > cap:
            self.retry_blocked = (
                f"the prompt (~{parsed.estimated_prompt_tokens} tokens) exceeds the re-prefill cost cap "
                f"({cap}), so it is not retried"
            )
        self._response = _ResponseDirection()
        self._outbox: list[Event] = []
        self._emit(
            EventName.REQUEST_ACCEPTED,
            route=parsed.kind.value,
            model=parsed.model,
            stream=parsed.stream,
            seed=parsed.seed,
            input_digest=parsed.input_digest,
            estimated_prompt_tokens=parsed.estimated_prompt_tokens,
            retry_allowed=self.retry_allowed,
        )

    # --- derived facts ---------------------------------------------------------------------------------

    @property
    def retry_allowed(self) -> bool:
        return self.retry_blocked is None

    def block_retries(self, reason: str) -> None:
        self.retry_blocked = self.retry_blocked or reason

    @property
    def max_attempts(self) -> int:
        return self.policy.on_upstream_failure.before_first_delta.max_attempts if self.retry_allowed else 1

    @property
    def retry_budget(self) -> int:
        """Retries still allowed (the article's `retry_budget`)."""
        return max(0, self.max_attempts - len(self.attempts)) if self.phase is Phase.PREFILL else 0

    @property
    def delivered_output_tokens(self) -> int:
        r = self._response
        return r.usage_tokens if r.usage_tokens is not None else r.content_events

    @property
    def delivered_tokens_source(self) -> str:
        return "usage" if self._response.usage_tokens is not None else "content_events"

    @property
    def is_terminal(self) -> bool:
        return self.phase in TERMINAL_PHASES

    def drain_events(self) -> list[Event]:
        events, self._outbox = self._outbox, []
        return events

    # --- attempts (driven by the upstream filter) ------------------------------------------------------

    def begin_attempt(self, attempt_id: str, replica: str) -> AttemptRecord:
        record = AttemptRecord(number=len(self.attempts) + 1, attempt_id=attempt_id, replica=replica)
        if self.attempts:
            previous = self.attempts[-1]
            if previous.outcome is None:  # Envoy retried on its own (reset/refused) before we heard of it
                previous.outcome, previous.detail = "failed", "connection_lost"
            elif previous.outcome == "released":
                # The replica reset while our release was on its way: Envoy's router retries only while
                # no response byte went downstream, so the write-ahead `first_delta_sent` never came true.
                previous.outcome, previous.detail = "failed", "lost_before_release"
                self.first_delta_sent = False
                self._emit(
                    EventName.ATTEMPT_FAILED,
                    previous.number,
                    reason="lost_before_release",
                    detail="replica reset before the released headers reached the router",
                )
        self.attempts.append(record)
        self._emit(EventName.ATTEMPT_STARTED, record.number, attempt_id=attempt_id, replica=replica)
        return record

    def on_attempt_lost(self, record: AttemptRecord, failure: AttemptFailed) -> None:
        """Envoy tore the attempt down (reset/refused/client gone): Envoy's router decides what follows."""
        record.outcome, record.detail = "failed", failure.reason.value
        self._emit(
            EventName.ATTEMPT_FAILED, record.number, reason=failure.reason.value, detail=failure.detail
        )

    def on_attempt_fenced(self, record: AttemptRecord, proof: str | None, waited_seconds: float) -> None:
        record.fence = {"proof": proof, "waited_ms": round(waited_seconds * 1000, 1)}
        self._emit(
            EventName.ATTEMPT_FENCED,
            record.number,
            attempt_id=record.attempt_id,
            proof=proof,
            waited_ms=record.fence["waited_ms"],
        )

    def on_replica_lost(self, record: AttemptRecord) -> None:
        self._emit(EventName.REPLICA_LOST, record.number, replica=record.replica, phase=self.phase.value)

    @property
    def publisher(self) -> AttemptRecord | None:
        """The attempt whose bytes go to the client (released at its first delta), if any."""
        last = self.attempts[-1] if self.attempts else None
        return last if last is not None and last.outcome == "released" else None

    def on_publisher_lost(self) -> Terminate | None:
        """After the first delta the publishing replica's heartbeat lapsed: end the stream, never retry."""
        if self.phase is not Phase.DECODE or self._response.ended:
            return None
        return self._terminate(
            [], "the replica's heartbeat lapsed after the first delta; its attempt was fenced"
        )

    def pin(self, fingerprint_digest: str, model_revision: str | None) -> None:
        self.fingerprint_digest, self.model_revision = fingerprint_digest, model_revision

    def on_attempt_failed(
        self,
        record: AttemptRecord,
        failure: AttemptFailed,
        *,
        fence_proven: bool = True,
        no_compatible_replica: str | None = None,
    ) -> TriggerRetry | FailRequest:
        """A held attempt failed in a way the sidecar saw: retry elsewhere, or answer a real error.

        `fence_proven` is false when the attempt's liveness was uncertain and its fence could not be
        proven (no lease: etcd was unreachable): then no other attempt may start.
        """
        self.on_attempt_lost(record, failure)
        if not fence_proven:
            why = "the failed attempt may still be running and its fence cannot be proven (etcd unreachable)"
            self._emit(EventName.RETRY_REFUSED, record.number, reason=Outcome.FENCE_UNPROVABLE.value)
            self._finish(Phase.FAILED, Outcome.FENCE_UNPROVABLE)
            return FailRequest(
                status=503, body=self.error_body(Outcome.FENCE_UNPROVABLE, why, retryable=True)
            )
        if self.phase is not Phase.PREFILL:
            # Unreachable by construction (attempts only fail while held), kept as a hard guard.
            raise RuntimeError("an attempt failed after the first delta was delivered")
        if record.number < self.max_attempts and no_compatible_replica is not None:
            self._emit(EventName.RETRY_REFUSED, record.number, reason=Outcome.NO_COMPATIBLE_REPLICA.value)
            self._finish(Phase.FAILED, Outcome.NO_COMPATIBLE_REPLICA)
            why = f"no compatible replica is left to retry on: {no_compatible_replica}"
            return FailRequest(
                status=503, body=self.error_body(Outcome.NO_COMPATIBLE_REPLICA, why, retryable=True)
            )
        if record.number < self.max_attempts:
            self._emit(EventName.RETRY_TRIGGERED, record.number, reason=failure.reason.value)
            return TriggerRetry(failure.reason.value)
        return self._refuse_retry(record.number)

    def admits_attempt(self) -> bool:
        """Envoy retries resets on its own; the sidecar still decides whether another attempt may start."""
        return self.phase is Phase.PREFILL and len(self.attempts) < self.max_attempts

    def refuse_attempt(self) -> FailRequest:
        """Envoy began an attempt beyond the budget (e.g. after a reset): end the request with an error."""
        if self.attempts and self.attempts[-1].outcome is None:
            self.attempts[-1].outcome, self.attempts[-1].detail = "failed", "connection_lost"
        return self._refuse_retry(len(self.attempts))

    def _refuse_retry(self, number: int) -> FailRequest:
        if self.retry_blocked is not None:
            code, why = Outcome.RETRY_NOT_ALLOWED, self.retry_blocked
        else:
            code, why = (
                Outcome.RETRIES_EXHAUSTED,
                f"all {self.max_attempts} attempts failed before any content",
            )
        self._emit(EventName.RETRY_REFUSED, number, reason=code.value)
        self._finish(Phase.FAILED, code)
        return FailRequest(status=502, body=self.error_body(code, why, retryable=True))

    def on_attempt_released(self, record: AttemptRecord, *, first_delta: bool) -> None:
        record.outcome = "released"
        if first_delta:
            self.first_delta_sent = True
            self._emit(EventName.FIRST_DELTA_SENT, record.number, attempt_id=record.attempt_id)

    def on_attempt_passed_through(self, record: AttemptRecord, status: int) -> None:
        record.outcome, record.detail = "passed_through", f"status {status}"
        self._emit(EventName.RESPONSE_PASSED_THROUGH, record.number, status=status)

    def attempt_number(self, attempt_id: str | None) -> int | None:
        return next((a.number for a in self.attempts if a.attempt_id == attempt_id), None)

    def note_tool_call(self, name: EventName, key: str, attempt: int | None, **detail: Any) -> None:
        """A tool call made on behalf of this request (claimed, executed, replayed, refused, …)."""
        entry = self.tool_calls.setdefault(key, {"key": key, "events": []})
        entry["events"].append({"event": name.value, "attempt": attempt, **detail})
        self._emit(name, attempt, key=key, **detail)

    # --- the response towards the client (downstream filter) -------------------------------------------

    def on_response_headers(self, status: int, content_type: str) -> None:
        r = self._response
        r.status = status
        r.streaming = status < 300 and is_event_stream(content_type)

    def on_response_body(self, chunk: bytes, end_of_stream: bool) -> BodyDecision:
        r = self._response
        if r.ended:
            return Forward(b"", end_of_stream)
        if not r.streaming:
            return self._non_stream_body(chunk, end_of_stream)
        events = r.scanner.feed(chunk)
        for index, event in enumerate(events):
            if self.phase is Phase.DECODE:
                if event.kind is EventKind.ERROR:
                    return self._terminate(events[:index], "in-band error event after the first delta")
                if event.finish_reason == "abort":
                    self._count(event)
                    return self._terminate(events[: index + 1], "finish_reason abort after the first delta")
            self._count(event)
            if event.kind is EventKind.DONE:
                r.done_seen = True
        if end_of_stream:
            if not r.done_seen and self.phase is Phase.DECODE:
                return self._terminate(events, "upstream ended without [DONE]")
            r.ended = True
            self._finish(
                Phase.COMPLETED if r.done_seen else Phase.FAILED,
                Outcome.COMPLETED if r.done_seen else Outcome.UPSTREAM_ERROR,
            )
            # An incomplete event left after [DONE] is not worth a client's parse error: drop it.
            return Forward(_join(events, chunk, r.scanner.pending == b""), True)
        return Forward(_join(events, chunk, r.scanner.pending == b""), False)

    def on_downstream_lost(self, cause: DownstreamLoss) -> None:
        """The client-facing stream was torn down (client gone, or an upstream reset after headers)."""
        if self.is_terminal:
            return
        if self._response.done_seen:
            # The client already has the whole generation ([DONE] went out); it just closed first.
            self._finish(Phase.COMPLETED, Outcome.COMPLETED)
            return
        if cause is DownstreamLoss.CLIENT_GONE or self.phase is Phase.PREFILL:
            self._emit(EventName.CLIENT_DISCONNECTED, delivered_output_tokens=self.delivered_output_tokens)
            self._finish(Phase.CANCELLED, Outcome.CLIENT_DISCONNECTED)
            return
        self._emit(
            EventName.STREAM_RESET, cause=cause.value, delivered_output_tokens=self.delivered_output_tokens
        )
        self._finish(Phase.INTERRUPTED, Outcome.UPSTREAM_DECODE_INTERRUPTED)

    # --- views -----------------------------------------------------------------------------------------

    def error_body(self, code: Outcome, message: str, *, retryable: bool) -> bytes:
        return json.dumps(
            {
                "error": {
                    "code": code.value,
                    "message": message,
                    "type": "gateway_error",
                    "request_id": self.request_id,
                    "attempts": [a.as_record() for a in self.attempts],
                    "partial_output": False,
                    "retryable": retryable,
                }
            }
        ).encode()

    def journal_view(self) -> dict[str, Any]:
        return {
            "request_id": self.request_id,
            "phase": self.phase.value,
            "outcome": self.outcome.value if self.outcome else None,
            "attempt": len(self.attempts),
            "first_delta_sent": self.first_delta_sent,
            "model": self.parsed.model,
            "model_revision": self.model_revision,
            "fingerprint_digest": self.fingerprint_digest,
            "retry_budget": self.retry_budget,
            "delivered_output_tokens": self.delivered_output_tokens,
            "delivered_output_tokens_source": self.delivered_tokens_source,
            "attempts": [a.as_record() for a in self.attempts],
            "tool_calls": list(self.tool_calls.values()),
            "input": {
                "route": self.parsed.kind.value,
                "digest": self.parsed.input_digest,
                "seed": self.parsed.seed,
                "stream": self.parsed.stream,
                "estimated_prompt_tokens": self.parsed.estimated_prompt_tokens,
            },
        }

    # --- internals -------------------------------------------------------------------------------------

    def _count(self, event: Any) -> None:
        r = self._response
        if event.kind is EventKind.CONTENT:
            r.content_events += 1
            if self.phase is Phase.PREFILL:
                self.phase = Phase.DECODE
        if event.usage_completion_tokens is not None:
            r.usage_tokens = event.usage_completion_tokens

    def _non_stream_body(self, chunk: bytes, end_of_stream: bool) -> Forward:
        r = self._response
        if r.status is not None and r.status < 300:
            r.non_stream_body += chunk
        if end_of_stream:
            r.ended = True
            ok = r.status is not None and r.status < 300
            if ok:
                self.phase = Phase.DECODE  # delivered whole, as one delta
                r.usage_tokens = _completion_tokens(bytes(r.non_stream_body))
                self._finish(Phase.COMPLETED, Outcome.COMPLETED)
            elif (
                self.attempts
                and len(self.attempts) >= self.max_attempts
                and r.status is not None
                and r.status >= 500
            ):
                self._finish(Phase.FAILED, Outcome.RETRIES_EXHAUSTED)
            else:
                self._finish(Phase.FAILED, Outcome.UPSTREAM_ERROR)
        return Forward(chunk, end_of_stream)

    def _terminate(self, delivered: list[Any], why: str) -> Terminate:
        r = self._response
        r.ended = True
        self._emit(
            EventName.STREAM_TERMINATED, reason=why, delivered_output_tokens=self.delivered_output_tokens
        )
        self._finish(Phase.INTERRUPTED, Outcome.UPSTREAM_DECODE_INTERRUPTED)
        frame = terminal_error_frame(self.request_id, self.delivered_output_tokens)
        return Terminate(b"".join(e.raw for e in delivered) + frame)

    def _finish(self, phase: Phase, outcome: Outcome) -> None:
        if self.is_terminal:
            return
        if self.phase is Phase.PREFILL and self.first_delta_sent:
            # The write-ahead said "may be delivered", but the release never reached the client (the
            # replica reset first and Envoy answered instead): record what the client actually got.
            self.first_delta_sent = False
            for attempt in self.attempts:
                if attempt.outcome == "released":
                    attempt.outcome, attempt.detail = "failed", "lost_before_release"
        self.phase, self.outcome = phase, outcome
        if (
            phase in (Phase.INTERRUPTED, Phase.CANCELLED)
            and self.attempts
            and self.attempts[-1].outcome == "released"
        ):
            self.attempts[-1].outcome = phase.value  # the attempt that was publishing did not finish
        if phase is Phase.COMPLETED:
            self._emit(EventName.STREAM_COMPLETED, delivered_output_tokens=self.delivered_output_tokens)
        elif phase is Phase.FAILED:
            self._emit(EventName.REQUEST_FAILED, outcome=outcome.value)

    def _emit(self, name: EventName, attempt: int | None = None, **detail: Any) -> None:
        self._outbox.append(Event(name, attempt, detail))


def _join(events: list[Any], chunk: bytes, chunk_is_whole_events: bool) -> bytes:
    # Fast path: the chunk was exactly whole events (the common case), forward it without copying.
    if chunk_is_whole_events and len(events) > 0 and sum(len(e.raw) for e in events) == len(chunk):
        return chunk
    return b"".join(e.raw for e in events)


def _completion_tokens(body: bytes) -> int | None:
    try:
        usage = json.loads(body).get("usage") or {}
        tokens = usage.get("completion_tokens")
        return tokens if isinstance(tokens, int) else None
    except (ValueError, AttributeError):
        return None
