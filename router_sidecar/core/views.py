"""Views of the machines, for the client and for the journal: the JSON error bodies and the journal record.

Rendering only: nothing here decides anything. The machines (`attempt.py`, `request.py`) hold the facts; the
shapes are the messages of proto/router_sidecar/records/records.proto, written with their JSON mapping.
"""

from __future__ import annotations

import json
from typing import Any

from router_sidecar.core.attempt import FAILED_STATES, Attempt, AttemptState, FailRequest
from router_sidecar.core.destinations import Destinations
from router_sidecar.core.dialects import ErrorShape, anthropic_error_type
from router_sidecar.core.openai_api import RequestRejected
from router_sidecar.core.request import TERMINAL_PHASES, LogicalRequest, Phase
from router_sidecar.records import codec
from router_sidecar.records import records_pb2 as rec


def attempt_outcome(attempt: Attempt, request_phase: Phase) -> str:
    """How the attempt ended, as the journal, the client's error body and the metrics say it."""
    if attempt.state is AttemptState.RELEASED and request_phase in TERMINAL_PHASES:
        # The publishing attempt ends with its request: it completed, or was interrupted or cancelled.
        return request_phase.value
    # Failed, whatever its verdict was (retry or the request's error): that is the request's to say.
    return AttemptState.FAILED.value if attempt.state in FAILED_STATES else attempt.state.value


def attempt_record(attempt: Attempt, request_phase: Phase) -> rec.AttemptRecord:
    outcome = attempt_outcome(attempt, request_phase)
    lease = attempt.lease
    return rec.AttemptRecord(
        attempt=attempt.number,
        attempt_id=attempt.attempt_id,
        replica=attempt.replica,
        outcome=outcome,
        detail=attempt.failure.value if attempt.failure else None,
        status=attempt.status,
        lease=rec.LeaseRecord(**lease.as_record()) if lease is not None else None,
        fence=rec.FenceRecord(**attempt.fence) if attempt.fence is not None else None,
        chosen_by=attempt.chosen_by,
    )


def destinations_record(destinations: Destinations | None) -> rec.DestinationsRecord | None:
    if destinations is None:
        return None
    return rec.DestinationsRecord(
        source=destinations.source,
        order=destinations.order,
        picker=destinations.picker,
        excluded=[rec.ExcludedReplica(replica=a, why=why) for a, why in destinations.excluded],
        prefix_blocks=destinations.prefix_blocks or None,
        ranked=[
            rec.RankedReplica(replica=a, warm_blocks=warm, in_flight=load)
            for a, warm, load in destinations.ranked
        ],
    )


def error_body(request: LogicalRequest, verdict: FailRequest) -> bytes:
    """The one JSON error a client gets when no content was delivered: names the request and why, in the
    shape of the request's API."""
    attempts = [attempt_record(a, request.phase) for a in request.attempts]
    if request.dialect.errors is ErrorShape.ANTHROPIC:
        messages = rec.MessagesErrorBody(
            type="error",
            error=rec.MessagesError(
                type=anthropic_error_type(verdict.status),
                message=verdict.message,
                code=str(verdict.code),
                details=rec.MessagesErrorDetails(error_code=str(verdict.code)),
                request_id=request.request_id,
                partial_output=False,
                retryable=verdict.retryable,
                attempts=attempts,
                param=verdict.param,
            ),
            request_id=request.request_id,
        )
        return json.dumps(codec.to_dict(messages)).encode()
    body = rec.GatewayErrorBody(
        error=rec.GatewayError(
            code=str(verdict.code),
            message=verdict.message,
            type="gateway_error",
            request_id=request.request_id,
            attempts=attempts,
            partial_output=False,
            retryable=verdict.retryable,
            param=verdict.param,
        )
    )
    return json.dumps(codec.to_dict(body)).encode()


def error_document(
    shape: ErrorShape, status: int, code: str, message: str, request_id: str | None, **extra: object
) -> bytes:
    """A gateway error that concerns no attempt (admission, keys, look-ups), in the API's shape: OpenAI's
    `{"error": {…, "type": "gateway_error"}}`, or Anthropic's `{"type": "error", "error": {"type": …}}`."""
    if shape is ErrorShape.ANTHROPIC:
        error = {
            "type": anthropic_error_type(status),
            "message": message,
            "code": code,
            "details": {"error_code": code},
            "request_id": request_id,
            **extra,
        }
        return json.dumps({"type": "error", "error": error, "request_id": request_id}).encode()
    body = {
        "error": {
            "code": code,
            "message": message,
            "type": "gateway_error",
            "request_id": request_id,
            **extra,
        }
    }
    return json.dumps(body).encode()


def rejection_body(rejected: RequestRejected, request_id: str, shape: ErrorShape) -> bytes:
    """A request refused at admission (bad JSON, no model, too large): vLLM's own error shape for the
    OpenAI APIs (its exception name in `type`), Anthropic's for the Messages API."""
    if shape is ErrorShape.ANTHROPIC:
        return error_document(
            shape, rejected.status, rejected.code, rejected.message, request_id, param=rejected.param
        )
    return rejected.body(request_id)


# The number of attempts that reached a replica for the request (never where they went).
ATTEMPTS_HEADER = "x-router-attempts"
# The fallback model that answered instead of the one the client asked for (docs/design.md#fallback).
FALLBACK_HEADER = "x-router-fallback"


def request_id_headers(request: LogicalRequest) -> list[tuple[str, str]]:
    """The headers of every answer to a request: its id, how many attempts reached a replica, and the
    fallback model that answered, if one did."""
    headers = [
        *id_headers(request.request_id, request.dialect.errors),
        (ATTEMPTS_HEADER, str(request.counted)),
    ]
    if request.answered_by_fallback is not None:
        headers.append((FALLBACK_HEADER, request.answered_by_fallback[0]))
    return headers


def id_headers(request_id: str, shape: ErrorShape) -> list[tuple[str, str]]:
    """The request id on a response: `x-request-id`, and Anthropic's `request-id` on the Messages API (its
    SDK reads the id there)."""
    if shape is ErrorShape.ANTHROPIC:
        return [("x-request-id", request_id), ("request-id", request_id)]
    return [("x-request-id", request_id)]


def error_headers(request: LogicalRequest, verdict: FailRequest) -> list[tuple[str, str]]:
    headers = request_id_headers(request)
    if verdict.retry_after is not None:
        headers.append(("retry-after", verdict.retry_after))
    return headers


def journal_record(request: LogicalRequest) -> rec.JournalRecord:
    """The journal record of the request without what the journal adds (gateway, owner, events, time)."""
    parsed = request.parsed
    return rec.JournalRecord(
        request_id=request.request_id,
        phase=request.phase.value,
        outcome=request.outcome.value if request.outcome else None,
        attempt=len(request.attempts),
        first_delta_sent=request.first_delta_sent,
        model=parsed.model,
        model_revision=request.model_revision,
        fingerprint_digest=request.fingerprint_digest,
        retry_budget=request.retry_budget,
        delivered_output_tokens=request.delivered_output_tokens,
        delivered_output_tokens_source=request.delivered_tokens_source,
        attempts=[attempt_record(a, request.phase) for a in request.attempts],
        tool_calls=[
            rec.ToolCallRecord(key=call["key"], events=[rec.JournalEvent(**e) for e in call["events"]])
            for call in request.tool_calls.values()
        ],
        input=rec.InputRecord(
            route=parsed.kind.value,
            digest=parsed.input_digest,
            seed=parsed.seed,
            stream=parsed.stream,
            estimated_prompt_tokens=parsed.estimated_prompt_tokens,
        ),
        tool_calls_not_listed=request.tool_calls_dropped or None,
        envoy_attempts=request.envoy_attempts,
        destinations=destinations_record(request.destinations),
        stored_response=(
            rec.StoredResponseRecord(id=stored[0], replica=stored[1])
            if (stored := request.stored_response) is not None
            else None
        ),
        fallback=(
            rec.FallbackRecord(model=answered[0], requested_model=parsed.model, causes=answered[1])
            if (answered := request.answered_by_fallback) is not None
            else None
        ),
    )


def rejected_record(
    request_id: str, *, route: str, outcome: str, phase: Phase = Phase.REJECTED
) -> rec.JournalRecord:
    """The journal record of a request that no stream of ours saw, answered before it by another filter (an
    endpoint picker's own 503 or 429, or the picker unreachable): rejected, no attempt, nothing delivered, its
    input unread (only its route is known). The journal adds the rest as for every record."""
    return rec.JournalRecord(
        request_id=request_id,
        phase=phase.value,
        outcome=outcome,
        attempt=0,
        first_delta_sent=False,
        model="",
        retry_budget=0,
        delivered_output_tokens=0,
        delivered_output_tokens_source="content_events",
        input=rec.InputRecord(route=route),
    )


def journal_view(request: LogicalRequest) -> dict[str, Any]:
    """`journal_record` as JSON-ready data (for tests and tools; the journal adds its own fields first)."""
    return codec.to_dict(journal_record(request))


def journal_event(event: dict[str, Any]) -> dict[str, Any]:
    """One event of the trace (`Event.as_record`) as the journal writes it (a `JournalEvent`)."""
    return codec.to_dict(rec.JournalEvent(**event))
