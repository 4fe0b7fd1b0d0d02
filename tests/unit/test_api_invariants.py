"""The invariants oracle (`tests/invariants.py`, `tests/api_streams.py`) on the Responses and Messages APIs,
against fabricated evidence: what a correct gateway sends passes, and each way of breaking the contract on
these APIs is named (so that the fault suite's silence on them means something)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from router_sidecar.records import codec
from router_sidecar.records import records_pb2 as rec
from tests.api_streams import INTERRUPTED, ApiStream, normalized
from tests.invariants import ClientOutcome, Evidence, SentRequest, check_request, outcome_kind

RID = "req_fabricated"
PIECES = ("Hel", "lo", " wor", "ld")
SSE = {"content-type": "text/event-stream; charset=utf-8", "x-request-id": RID}
JSON = {"content-type": "application/json", "x-request-id": RID}


def named(name: str, data: dict[str, Any]) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + json.dumps({"type": name, **data}).encode() + b"\n\n"


# --- Responses --------------------------------------------------------------------------------------------


class Responses:
    """A vLLM-shaped Responses stream, numbered as it is built."""

    def __init__(self, response_id: str = "resp_0123456789abcdef", start: int = 0) -> None:
        self.id = response_id
        self.seq = start
        self.out = b""

    def add(self, name: str, **data: Any) -> Responses:
        self.out += named(name, {**data, "sequence_number": self.seq})
        self.seq += 1
        return self

    def response(self, status: str, **extra: Any) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "response",
            "created_at": 1,
            "model": "tiny",
            "status": status,
            **extra,
        }

    def opening(self) -> Responses:
        self.add("response.created", response=self.response("in_progress"))
        self.add("response.in_progress", response=self.response("in_progress"))
        item = {"id": "msg_0123456789abcdef", "type": "message", "role": "assistant", "content": []}
        self.add("response.output_item.added", item=item, output_index=0)
        return self.add("response.content_part.added", item_id=item["id"], output_index=0, content_index=0)

    def deltas(self, n: int) -> Responses:
        for piece in PIECES[:n]:
            self.add(
                "response.output_text.delta", delta=piece, item_id="msg_0123456789abcdef", output_index=0
            )
        return self

    def completed(self, n: int) -> Responses:
        usage = {"input_tokens": 3, "output_tokens": n, "total_tokens": 3 + n}
        details = {"reason": "max_output_tokens"}
        return self.add(
            "response.completed",
            response=self.response("incomplete", incomplete_details=details, usage=usage),
        )

    def failed(self, delivered: int, *, response_id: str | None = None, code: str = INTERRUPTED) -> Responses:
        error = {
            "code": code,
            "message": "upstream ended without response.completed",
            "request_id": RID,
            "partial_output": True,
            "delivered_output_tokens": delivered,
            "retryable": False,
        }
        response = {**self.response("failed", error=error), "id": response_id or self.id}
        return self.add("response.failed", response=response)


def misnumbered_failure() -> bytes:
    stream = Responses().opening().deltas(2)
    stream.seq += 1  # our event skips a number
    return stream.failed(2).out


# --- Messages ---------------------------------------------------------------------------------------------


def message_start(message_id: str = "msg_0123456789abcdef0123456789abcdef") -> bytes:
    message = {"id": message_id, "type": "message", "role": "assistant", "content": [], "model": "tiny"}
    return named("message_start", {"message": {**message, "usage": {"input_tokens": 3, "output_tokens": 0}}})


def message_deltas(n: int) -> bytes:
    out = named("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}})
    for piece in PIECES[:n]:
        out += named("content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": piece}})
    return out


def message_end(n: int) -> bytes:
    return (
        named("content_block_stop", {"index": 0})
        + named("message_delta", {"delta": {"stop_reason": "max_tokens"}, "usage": {"output_tokens": n}})
        + named("message_stop", {})
    )


def our_error(delivered: int, *, error_type: str = "api_error") -> bytes:
    error = {
        "type": error_type,
        "message": "upstream ended without message_stop",
        "code": INTERRUPTED,
        "details": {"error_code": INTERRUPTED},
        "request_id": RID,
        "partial_output": True,
        "delivered_output_tokens": delivered,
        "retryable": False,
        "attempts": [],
    }
    return named("error", {"error": error, "request_id": RID})


VLLM_INTERNAL_ERROR = named("error", {"error": {"type": "internal_error", "message": "2 validation errors"}})


# --- evidence ----------------------------------------------------------------------------------------------


def journal(
    route: str, phase: str, outcome: str, delivered: int, *, first_delta: bool = True
) -> dict[str, Any]:
    record = rec.JournalRecord(
        request_id=RID,
        phase=phase,
        outcome=outcome,
        attempt=1,
        first_delta_sent=first_delta,
        model="tiny",
        delivered_output_tokens=delivered,
        delivered_output_tokens_source="content_events",
        attempts=[
            rec.AttemptRecord(
                attempt=1,
                attempt_id="att_1",
                replica="127.0.0.1:1",
                outcome=phase,
                lease=rec.LeaseRecord(lease_id="1", ttl_seconds=10, granted_at=1.0, revoked_at=2.0),
            )
        ],
        input=rec.InputRecord(route=route, digest="sha256:0", stream=True),
    )
    return codec.to_dict(record)


def evidence(
    route: str,
    body: bytes,
    record: dict[str, Any],
    *,
    status: int = 200,
    headers: dict[str, str] = SSE,
    stream: bool = True,
    max_tokens: int = 4,
) -> Evidence:
    key = "max_output_tokens" if route == "responses" else "max_tokens"
    sent = SentRequest(RID, route, {"model": "tiny", "stream": stream, key: max_tokens})  # type: ignore[arg-type]
    client = ClientOutcome(status=status, headers=headers, body=body)
    return Evidence(sent, client, 200, record, [], expected_pieces=PIECES)


def checks(ev: Evidence) -> set[str]:
    return {v.check for v in check_request(ev)}


COMPLETED = ("completed", "completed")
INTERRUPTED_PHASE = ("interrupted", INTERRUPTED)


def test_a_whole_responses_stream_passes() -> None:
    body = Responses().opening().deltas(4).completed(4).out
    ev = evidence("responses", body, journal("responses", *COMPLETED, 4))
    assert outcome_kind(ev) == "complete" and checks(ev) == set()


def test_our_response_failed_after_the_prefix_passes() -> None:
    body = Responses().opening().deltas(2).failed(2).out
    ev = evidence("responses", body, journal("responses", *INTERRUPTED_PHASE, 2))
    assert outcome_kind(ev) == "terminal_frame" and checks(ev) == set()


@pytest.mark.parametrize(
    ("body", "delivered", "broken"),
    [
        # The loser's opening leaked before the winner's answer.
        (
            Responses("resp_aaaaaaaaaaaaaaaa")
            .add("response.created", response={"id": "resp_aaaaaaaaaaaaaaaa"})
            .out
            + Responses().opening().deltas(4).completed(4).out,
            4,
            {"several-preambles", "events-of-several-answers", "sequence-numbers"},
        ),
        # Our event names another response than the client's.
        (
            Responses().opening().deltas(2).failed(2, response_id="resp_ffffffffffffffff").out,
            2,
            {"frame-identity", "events-of-several-answers"},
        ),
        # Our count is not what the client got.
        (Responses().opening().deltas(2).failed(3).out, 2, {"frame-count-mismatch"}),
        # Our event misnumbered (a sequence number skipped).
        (misnumbered_failure(), 2, {"sequence-numbers"}),
        # The replica's own error event reached the client, not ours.
        (
            Responses().opening().deltas(2).add("error", code="server_error", message="boom", param=None).out,
            2,
            {"frame-shape", "frame-schema"},
        ),
        # A clean end with neither response.completed nor our event: a silent cut.
        (Responses().opening().deltas(2).out, 2, {"silent-interruption"}),
    ],
    ids=["two-openings", "other-id", "count", "misnumbered", "replica-error", "silent"],
)
def test_responses_breaches_are_named(body: bytes, delivered: int, broken: set[str]) -> None:
    phase = COMPLETED if b"event: response.completed" in body else INTERRUPTED_PHASE
    ev = evidence("responses", body, journal("responses", *phase, delivered))
    assert broken <= checks(ev), (broken, checks(ev))


def test_a_whole_messages_stream_passes() -> None:
    body = message_start() + message_deltas(4) + message_end(4)
    ev = evidence("messages", body, journal("messages", *COMPLETED, 4))
    assert outcome_kind(ev) == "complete" and checks(ev) == set()


def test_our_messages_error_after_the_prefix_passes() -> None:
    body = message_start() + message_deltas(2) + our_error(2)
    ev = evidence("messages", body, journal("messages", *INTERRUPTED_PHASE, 2))
    assert outcome_kind(ev) == "terminal_frame" and checks(ev) == set()


@pytest.mark.parametrize(
    ("body", "delivered", "broken"),
    [
        # vLLM's own in-band error forwarded, as is (not an Anthropic type, not our code).
        (
            message_start() + message_deltas(2) + VLLM_INTERNAL_ERROR,
            2,
            {"frame-error-type", "raw-replica-error"},
        ),
        # Ours, then a message_stop (SGLang's, after its own error).
        (
            message_start() + message_deltas(2) + our_error(2) + named("message_stop", {}),
            2,
            {"event-after-end"},
        ),
        # Two openings: a dead attempt's message_start leaked.
        (
            message_start("msg_dead") + message_start() + message_deltas(4) + message_end(4),
            4,
            {"several-preambles"},
        ),
        # Our error with a type Anthropic's SDK does not know.
        (
            message_start() + message_deltas(2) + our_error(2, error_type="gateway_error"),
            2,
            {"frame-error-type"},
        ),
        # A clean end without message_stop and without our event.
        (message_start() + message_deltas(3), 3, {"silent-interruption"}),
        # An event without its `event:` line (Anthropic's SDK skips it: the error would be lost).
        (
            message_start() + message_deltas(2) + our_error(2).replace(b"event: error\n", b""),
            2,
            {"event-shape"},
        ),
    ],
    ids=["replica-error", "stop-after-error", "two-openings", "not-anthropic-type", "silent", "unnamed"],
)
def test_messages_breaches_are_named(body: bytes, delivered: int, broken: set[str]) -> None:
    phase = COMPLETED if b"event: message_stop" in body and b"event: error" not in body else INTERRUPTED_PHASE
    ev = evidence("messages", body, journal("messages", *phase, delivered))
    assert broken <= checks(ev), (broken, checks(ev))


def test_error_bodies_are_judged_in_each_apis_shape() -> None:
    anthropic = {
        "type": "error",
        "error": {
            "type": "api_error",
            "message": "all 2 attempts failed",
            "code": "retries_exhausted",
            "details": {"error_code": "retries_exhausted"},
            "request_id": RID,
            "partial_output": False,
            "delivered_output_tokens": 0,
            "retryable": True,
            "attempts": [],
        },
        "request_id": RID,
    }
    failed = journal("messages", "failed", "retries_exhausted", 0, first_delta=False)
    failed["attempts"] = []
    failed["attempt"] = 0
    good = evidence("messages", json.dumps(anthropic).encode(), failed, status=502, headers=JSON)
    assert "error-not-in-the-apis-shape" not in checks(good)
    openai_shaped = {"error": {k: v for k, v in anthropic["error"].items() if k not in ("type", "details")}}
    bad = evidence("messages", json.dumps(openai_shaped).encode(), failed, status=502, headers=JSON)
    assert "error-not-in-the-apis-shape" in checks(bad)


def test_normalized_keeps_everything_but_ids_and_times() -> None:
    a = Responses("resp_0000000000000001").opening().deltas(2).out
    b = Responses("resp_0000000000000002").opening().deltas(2).out
    assert a != b and normalized(a) == normalized(b)
    assert normalized(a) != normalized(Responses().opening().deltas(3).out)
    assert ApiStream.read("responses", a).text == "Hello"


def test_an_event_over_the_limit_that_reached_the_client_is_named() -> None:
    stream = Responses().opening().deltas(2)
    stream.add("response.output_text.delta", delta="x" * (1 << 20), item_id="msg_0123456789abcdef")
    ev = evidence("responses", stream.completed(3).out, journal("responses", *COMPLETED, 3), max_tokens=3)
    assert "oversized-event-delivered" in checks(ev)


def test_a_faults_padded_generation_is_a_generation_too() -> None:
    """`oversize@token:N` makes the replica write content event N padded: when that event reaches the client
    (the scanner bug) the check names the oversized event, not a second answer."""
    from tests.invariants import simulated_pieces, simulated_variants

    body = {"model": "tiny", "input": "fuzz x", "max_output_tokens": 4, "stream": True}
    [padded] = simulated_variants("responses", body, "oversize@token:2 bytes=2000000 attempt=1")
    plain = simulated_pieces("responses", body)
    assert padded[0] == plain[0] and padded[1].startswith(plain[1]) and len(padded[1]) == 2_000_000
    assert simulated_variants("responses", body, "reset@after:2") == ()
