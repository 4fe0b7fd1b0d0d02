"""Named events emitted by the request and attempt state machines.

The journal's trace, log lines and (later) spans and metrics are all views of these events, so every
decision the gateway takes is visible under one name everywhere. The machines are clock-free; the shell
stamps each event with the wall-clock time when it drains them.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any


class EventName(enum.StrEnum):
    REQUEST_ACCEPTED = "request_accepted"
    REQUEST_REJECTED = "request_rejected"
    ATTEMPT_STARTED = "attempt_started"
    HEADERS_HELD = "headers_held"  # the replica answered 200: its headers are held until the first delta
    ATTEMPT_FAILED = "attempt_failed"
    REPLICA_LOST = "replica_lost"
    ATTEMPT_FENCED = "attempt_fenced"
    RETRY_TRIGGERED = "retry_triggered"
    RETRY_REFUSED = "retry_refused"
    FIRST_DELTA_SENT = "first_delta_sent"
    RESPONSE_PASSED_THROUGH = "response_passed_through"
    RESPONSE_REPLACED = "response_replaced"  # headers no released attempt sent (Envoy's answer): replaced
    STREAM_COMPLETED = "stream_completed"
    STREAM_TERMINATED = "stream_terminated"
    STREAM_RESET = "stream_reset"
    CLIENT_DISCONNECTED = "client_disconnected"
    REQUEST_FAILED = "request_failed"
    TOOL_CALL_CLAIMED = "tool_call_claimed"
    TOOL_CALL_EXECUTED = "tool_call_executed"
    TOOL_CALL_REPLAYED = "tool_call_replayed"
    TOOL_CALL_REFUSED = "tool_call_refused"
    TOOL_CALL_FREED = "tool_call_freed"
    TOOL_CALL_OUTCOME_UNKNOWN = "tool_call_outcome_unknown"
    GATEWAY_LOST = "gateway_lost"  # the instance serving the request is gone; another closed its record
    ANSWERED_BY_FALLBACK = "answered_by_fallback"  # a fallback model's attempt delivered the first content


class Outcome(enum.StrEnum):
    """The terminal outcome of a logical request (journal `outcome`, `error.code` of its HTTP error)."""

    COMPLETED = "completed"
    UPSTREAM_DECODE_INTERRUPTED = "upstream_decode_interrupted"  # after the first delta: the terminal frame
    DEADLINE_EXCEEDED = "deadline_exceeded"  # the gateway's own request deadline fired
    CLIENT_DISCONNECTED = "client_disconnected"
    RETRIES_EXHAUSTED = "retries_exhausted"  # every allowed attempt failed before content
    RETRY_NOT_ALLOWED = "retry_not_allowed"  # cost cap, policy, or no journal to prove a retry safe
    RETRY_BUDGET_EXHAUSTED = (
        "retry_budget_exhausted"  # the cluster's or the tenant's retry budget refused a retry
    )
    REPLICAS_OVERLOADED = "replicas_overloaded"  # the last allowed attempt got 429 (or a picker shed it)
    FENCE_UNPROVABLE = "fence_unprovable"
    # A replica refused the request itself (a 4xx other than 429): not resent, its reason goes to the client.
    REJECTED_BY_REPLICA = "rejected_by_replica"
    CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"  # a rejection: it does not fit the model's context
    NO_COMPATIBLE_REPLICA = "no_compatible_replica"
    STORED_RESPONSE_UNAVAILABLE = "stored_response_unavailable"  # the replica holding it cannot be reached
    NO_REPLICA_AVAILABLE = "no_replica_available"  # Envoy (or an endpoint picker) found no host to send to
    ENDPOINT_PICKER_UNAVAILABLE = "endpoint_picker_unavailable"  # the picker could not be asked (fail-closed)
    UPSTREAM_ERROR = "upstream_error"
    ENVOY_EXITED = "envoy_exited"  # the gateway's own Envoy died under the stream
    GATEWAY_LOST = "gateway_lost"  # the gateway instance serving it died (its owner lease lapsed)


@dataclass(frozen=True, slots=True)
class Event:
    name: EventName
    attempt: int | None = None
    detail: dict[str, Any] = field(default_factory=dict)

    def as_record(self, at: float) -> dict[str, Any]:
        record: dict[str, Any] = {"t": round(at, 6), "event": self.name.value}
        if self.attempt is not None:
            record["attempt"] = self.attempt
        record.update(self.detail)
        return record
