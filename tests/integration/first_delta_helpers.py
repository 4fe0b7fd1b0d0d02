"""What the first-delta contract tests share across the two wire dialects, test_first_delta_contract.py
(vLLM's, the simulator's default) and test_sglang_contract.py (SGLang's): the look-ups of the journal and of
the replicas' request logs, the failures that must be retried invisibly, and the terminal frame.

One copy, so that both dialects are held to the same cases and the same frame.
"""

from __future__ import annotations

from typing import Any

from tests.harness import ClientResult, Gateway, Sim, poll

TERMINAL_PHASES = {"completed", "interrupted", "cancelled", "rejected", "failed"}

# Failures before the first content delta, which the gateway must retry invisibly:
# (x-sim-fault, the failed attempt's outcome in the replica's log, its detail in the journal).
RETRIED_BEFORE_FIRST_DELTA: list[tuple[str, str, str]] = [
    # Scenario 1: killed during prefill, before any downstream byte.
    ("exit@headers attempt=1", "fault:exit", "connection_lost"),
    ("reset@role attempt=1", "fault:reset", "connection_lost"),
    # Scenario 2: a token was computed but its event never left ("200 + role event sent, then died").
    ("reset@token:1 attempt=1", "fault:reset", "connection_lost"),
    ("exit@token:1 attempt=1", "fault:exit", "connection_lost"),
    # Failures the sidecar itself sees while holding the headers. In SGLang's dialect the error event and
    # the abort (a finish-only event) are each followed by the usage event and [DONE].
    ("status503@headers attempt=1", "fault:status503", "upstream_status"),
    ("error@token:1 attempt=1", "fault:error", "error_event"),
    ("abort@token:1 attempt=1", "fault:abort", "aborted"),
    ("close@role attempt=1", "fault:close", "ended_without_done"),
]


def served(sims: dict[str, Sim], request_id: str) -> list[dict[str, Any]]:
    """Every attempt the replicas served for this request (their end records), in start order."""
    records = [r for sim in sims.values() for r in sim.requests_for(request_id)]
    return sorted(records, key=lambda r: r["t_start"])


def attempts_logged(sims: dict[str, Sim], request_id: str, n: int) -> list[dict[str, Any]]:
    """The request's `n` attempts in the replicas' logs, once all of them are there."""
    return poll(
        lambda: (a := served(sims, request_id)) and len(a) == n and a,
        what=f"{n} attempt(s) in the replica logs",
    )


def finished(gateway: Gateway, request_id: str) -> dict[str, Any]:
    return gateway.wait_journal(request_id, lambda j: j["phase"] in TERMINAL_PHASES)


def accepted_replica_outcomes(replica_outcome: str) -> set[str]:
    """What the replica may log for an attempt that failed with `replica_outcome`. An abort event is the end
    of the attempt for the gateway: it may reset the stream before the replica wrote the usage and [DONE]
    that follow it, and the replica then logs that its client left."""
    return {replica_outcome, "client_gone"} if replica_outcome == "fault:abort" else {replica_outcome}


def terminal_frames(result: ClientResult) -> list[dict[str, Any]]:
    return [d["error"] for d in result.data() if isinstance(d, dict) and "error" in d]


def assert_terminal_frame(frame: dict[str, Any], request_id: str, delivered: int) -> None:
    """The gateway's terminal frame, exactly: partial output of `delivered` tokens, not retryable."""
    assert frame == {
        "code": "upstream_decode_interrupted",
        "message": frame["message"],
        "request_id": request_id,
        "partial_output": True,
        "delivered_output_tokens": delivered,
        "retryable": False,
    }
