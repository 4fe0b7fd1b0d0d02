"""Views of the machines, for the client and for the journal: the JSON error bodies and the journal record.

Rendering only: nothing here decides anything. The machines (`attempt.py`, `request.py`) hold the facts.
"""

from __future__ import annotations

import json
from typing import Any

from router_sidecar.core.attempt import Attempt, AttemptState, FailRequest
from router_sidecar.core.request import TERMINAL_PHASES, LogicalRequest, Phase


def attempt_record(attempt: Attempt, request_phase: Phase) -> dict[str, Any]:
    outcome = attempt.state.value
    if attempt.state is AttemptState.RELEASED and request_phase in TERMINAL_PHASES:
        # The publishing attempt ends with its request: it completed, or was interrupted or cancelled.
        outcome = request_phase.value
    lease = attempt.lease
    return {
        "attempt": attempt.number,
        "attempt_id": attempt.attempt_id,
        "replica": attempt.replica,
        "outcome": outcome,
        "detail": attempt.failure.value if attempt.failure else None,
        "status": attempt.status,
        "lease": lease.as_record() if lease is not None else None,
        "fence": attempt.fence,
    }


def error_body(request: LogicalRequest, verdict: FailRequest) -> bytes:
    """The one JSON error a client gets when no content was delivered: names the request and why."""
    return json.dumps(
        {
            "error": {
                "code": str(verdict.code),
                "message": verdict.message,
                "type": "gateway_error",
                "request_id": request.request_id,
                "attempts": [attempt_record(a, request.phase) for a in request.attempts],
                "partial_output": False,
                "retryable": True,
            }
        }
    ).encode()


def error_headers(request: LogicalRequest, verdict: FailRequest) -> list[tuple[str, str]]:
    headers = [("x-request-id", request.request_id)]
    if verdict.retry_after is not None:
        headers.append(("retry-after", verdict.retry_after))
    return headers


def journal_view(request: LogicalRequest) -> dict[str, Any]:
    parsed = request.parsed
    view: dict[str, Any] = {
        "request_id": request.request_id,
        "phase": request.phase.value,
        "outcome": request.outcome.value if request.outcome else None,
        "attempt": len(request.attempts),
        "first_delta_sent": request.first_delta_sent,
        "model": parsed.model,
        "model_revision": request.model_revision,
        "fingerprint_digest": request.fingerprint_digest,
        "retry_budget": request.retry_budget,
        "delivered_output_tokens": request.delivered_output_tokens,
        "delivered_output_tokens_source": request.delivered_tokens_source,
        "attempts": [attempt_record(a, request.phase) for a in request.attempts],
        "tool_calls": list(request.tool_calls.values()),
        "input": {
            "route": parsed.kind.value,
            "digest": parsed.input_digest,
            "seed": parsed.seed,
            "stream": parsed.stream,
            "estimated_prompt_tokens": parsed.estimated_prompt_tokens,
        },
    }
    if request.tool_calls_dropped:
        view["tool_calls_not_listed"] = request.tool_calls_dropped
    return view
