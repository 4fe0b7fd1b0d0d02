"""The first-delta contract end to end: real Envoy, real etcd, simulated vLLM replicas on loopback.

Each test checks what the client received byte for byte (events per request id), the journal, and each
replica's own log of what it served (attempt ids, when it saw the client go away).
"""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from tests.harness import (
    ClientResult,
    Gateway,
    Sim,
    chat,
    no_overlapping_content,
    poll,
    post,
    with_credential,
)
from tests.integration.first_delta_helpers import (
    RETRIED_BEFORE_FIRST_DELTA,
    accepted_replica_outcomes,
    assert_terminal_frame,
    attempts_logged,
    finished,
    served,
    terminal_frames,
)

pytestmark = pytest.mark.integration


def assert_complete_answer(result: ClientResult, max_tokens: int) -> None:
    """One complete generation: role event, max_tokens content events, finish on the last, [DONE]."""
    data = result.data()
    assert result.status == 200, result.body
    assert result.transport_error is None
    assert data[-1] == "[DONE]" and data.count("[DONE]") == 1
    chunks = [d for d in data if isinstance(d, dict)]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert len(result.content_chunks()) == max_tokens
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert not any("error" in d for d in chunks)
    assert len({d["id"] for d in chunks}) == 1, "events from more than one attempt"


# --- healthy path -------------------------------------------------------------------------------------


def test_healthy_stream_passes_through_and_is_journaled(gateway: Gateway, sims: dict[str, Sim]) -> None:
    result = post(f"{gateway.url}/v1/chat/completions", chat(max_tokens=6))
    assert_complete_answer(result, 6)
    journal = finished(gateway, result.request_id)
    assert journal["phase"] == "completed" and journal["outcome"] == "completed"
    assert journal["first_delta_sent"] is True
    assert journal["delivered_output_tokens"] == 6
    assert [e["event"] for e in journal["events"]] == [
        "request_accepted",
        "attempt_started",
        "headers_held",
        "first_delta_sent",
        "stream_completed",
    ]
    [attempt] = served(sims, result.request_id)
    assert attempt["attempt_id"] == journal["attempts"][0]["attempt_id"]
    assert attempt["outcome"] == "completed" and attempt["content_events_written"] == 6


def test_usage_figures_are_the_delivered_count(gateway: Gateway) -> None:
    body = chat(max_tokens=5, stream_options={"include_usage": True})
    result = post(f"{gateway.url}/v1/chat/completions", body)
    usage = [d for d in result.data() if isinstance(d, dict) and d.get("usage")][-1]["usage"]
    journal = finished(gateway, result.request_id)
    assert journal["delivered_output_tokens"] == usage["completion_tokens"] == 5
    assert journal["delivered_output_tokens_source"] == "usage"


# --- before the first delta: invisible retry ------------------------------------------------------------


@pytest.mark.parametrize(("fault", "replica_outcome", "attempt_detail"), RETRIED_BEFORE_FIRST_DELTA)
def test_failure_before_first_delta_is_retried_invisibly(
    gateway: Gateway, sims: dict[str, Sim], fault: str, replica_outcome: str, attempt_detail: str
) -> None:
    result = post(f"{gateway.url}/v1/chat/completions", chat(max_tokens=5), headers={"x-sim-fault": fault})
    assert_complete_answer(result, 5)
    journal = finished(gateway, result.request_id)
    assert journal["phase"] == "completed" and journal["attempt"] == 2
    first, second = journal["attempts"]
    assert (first["outcome"], first["detail"]) == ("failed", attempt_detail)
    # Invariant 4: the failed attempt's lease was revoked in etcd before the retry's lease was granted.
    assert first["lease"]["revoked_at"] is not None
    assert first["lease"]["revoked_at"] <= second["lease"]["granted_at"]
    assert second["outcome"] == "completed" and second["replica"] != first["replica"]
    names = [e["event"] for e in journal["events"]]
    assert names.index("attempt_failed") < names.index("first_delta_sent")
    assert names.count("first_delta_sent") == 1
    # The replicas' own logs: attempt 1 died where the fault says, attempt 2 served the whole answer.
    attempts = attempts_logged(sims, result.request_id, 2)
    assert [a["attempt_id"] for a in attempts] == [first["attempt_id"], second["attempt_id"]]
    assert attempts[0]["outcome"] in accepted_replica_outcomes(replica_outcome)
    assert attempts[1]["outcome"] == "completed" and attempts[1]["attempt_count"] == 2
    # Content came from the second attempt only.
    no_overlapping_content(result)


def test_all_replicas_failing_gives_one_clear_error_and_no_partial_body(gateway: Gateway) -> None:
    result = post(f"{gateway.url}/v1/chat/completions", chat(), headers={"x-sim-fault": "status503@headers"})
    assert result.status == 502
    error = json.loads(result.body)["error"]
    assert error["code"] == "retries_exhausted" and error["request_id"] == result.request_id
    assert [a["detail"] for a in error["attempts"]] == ["upstream_status", "upstream_status"]
    assert error["partial_output"] is False
    assert b"data:" not in result.body
    journal = finished(gateway, result.request_id)
    assert (journal["phase"], journal["outcome"], journal["first_delta_sent"]) == (
        "failed",
        "retries_exhausted",
        False,
    )


def test_all_replicas_dead_gives_json_error_naming_request_and_attempts(
    gateway: Gateway, sims: dict[str, Sim]
) -> None:
    for sim in sims.values():
        sim.stop()
    result = post(f"{gateway.url}/v1/chat/completions", chat())
    assert result.status == 503 and result.headers["content-type"] == "application/json"
    error = json.loads(result.body)["error"]
    assert error["request_id"] == result.request_id and error["code"] == "no_replica_available"
    assert "UF" in error["message"] and error["partial_output"] is False  # Envoy's flags are named
    journal = finished(gateway, result.request_id)
    assert (journal["phase"], journal["outcome"]) == ("failed", "no_replica_available")
    assert journal["first_delta_sent"] is False
    assert next(e for e in journal["events"] if e["event"] == "response_replaced")["response_flags"] == [
        "UF",
        "URX",
    ]


def test_a_write_ahead_release_that_loses_the_race_is_retried(gateway: Gateway, sims: dict[str, Sim]) -> None:
    # The replica resets the instant after its first content event, usually while the sidecar is still
    # writing first_delta_sent to etcd: nothing reached the client yet, so Envoy retries. The journal must
    # end saying what the client really got, and content must come from one attempt only.
    result = post(
        f"{gateway.url}/v1/chat/completions",
        chat(max_tokens=4),
        headers={"x-sim-fault": "reset@after:1 attempt=1"},
    )
    assert result.request_id, (result.status, result.headers)  # Envoy's own replies name it too
    journal = finished(gateway, result.request_id)
    no_overlapping_content(result)
    if result.transport_error is None and result.status != 200:
        # The reset reached Envoy between our release and its first write to the client: Envoy answered
        # the client itself (a reset after the response started is not retried), as one JSON error.
        assert result.status == 502 and result.headers["content-type"] == "application/json"
        assert json.loads(result.body)["error"]["request_id"] == result.request_id != ""
        assert (journal["phase"], journal["first_delta_sent"], journal["attempt"]) == ("failed", False, 1)
    elif result.transport_error is None:
        assert_complete_answer(result, 4)
        assert journal["phase"] == "completed" and journal["attempt"] == 2
        assert journal["attempts"][0]["detail"] in ("lost_before_release", "connection_lost")
    else:  # the release won the race: the first delta went out, then a reset; never a retry
        assert journal["phase"] == "interrupted" and journal["attempt"] == 1
        # Delivered = written towards the client; the reset may drop it before the client reads it.
        assert len(result.content_chunks()) <= journal["delivered_output_tokens"] == 1


# --- after the first delta: never a retry -----------------------------------------------------------------


@pytest.mark.parametrize("action", ["reset", "exit"])
def test_replica_dies_right_after_first_delta_client_sees_reset_journal_says_interrupted(
    gateway: Gateway, sims: dict[str, Sim], action: str
) -> None:
    # Scenario 3: the delay makes sure the first delta has reached the client before the replica dies.
    fault = f"delay@after:1 for=0.3; {action}@after:1"
    result = post(f"{gateway.url}/v1/chat/completions", chat(max_tokens=6), headers={"x-sim-fault": fault})
    assert result.status == 200
    assert result.transport_error is not None, "an abrupt upstream death after headers must reach the client"
    assert len(result.content_chunks()) == 1
    assert "[DONE]" not in result.data()
    journal = finished(gateway, result.request_id)
    assert (journal["phase"], journal["outcome"]) == ("interrupted", "upstream_decode_interrupted")
    assert journal["first_delta_sent"] is True
    assert journal["delivered_output_tokens"] == 1
    assert journal["attempt"] == 1, "no second generation may start after the first delta"
    reset = [e for e in journal["events"] if e["event"] == "stream_reset"]
    assert reset and reset[0]["cause"] == "upstream_reset"
    assert len(served(sims, result.request_id)) == 1


def test_an_upstream_death_after_the_first_delta_reaches_the_client_at_once(
    gateway: Gateway, sims: dict[str, Sim]
) -> None:
    """Envoy closes the client's connection after an upstream reset mid-stream (HTTP/1.1); with the connection
    manager's default `delayed_close_timeout` (1 s) the client learned of it a second late. The best of three
    tries is compared (load only adds to a gap, it never hides a fixed second)."""
    fault = "delay@after:1 for=0.3; reset@after:1"
    gaps: list[float] = []
    for _ in range(3):
        error_at: float | None = None
        url, headers = f"{gateway.url}/v1/chat/completions", {"x-sim-fault": fault}
        with (
            httpx.Client(timeout=30) as client,
            client.stream("POST", url, json=chat(max_tokens=6), headers=headers) as response,
        ):
            request_id = response.headers["x-request-id"]
            try:
                for _ in response.iter_raw():
                    pass
            except httpx.HTTPError:
                error_at = time.time()
        assert error_at is not None, "the client was to see the reset"
        [attempt] = attempts_logged(sims, request_id, 1)  # the sim logs its end right after the reset
        gaps.append(error_at - attempt["t_end"])
    assert min(gaps) < 0.5, gaps


@pytest.mark.parametrize(
    ("fault", "delivered", "why"),
    [
        ("close@after:2", 2, "upstream ended without [DONE]"),
        ("error@token:3", 2, "in-band error event after the first delta"),
        ("abort@token:3", 3, "finish_reason abort after the first delta"),  # the abort event carries a token
    ],
)
def test_interruption_after_first_delta_ends_with_one_terminal_frame(
    gateway: Gateway, sims: dict[str, Sim], fault: str, delivered: int, why: str
) -> None:
    result = post(f"{gateway.url}/v1/chat/completions", chat(max_tokens=8), headers={"x-sim-fault": fault})
    assert result.status == 200 and result.transport_error is None
    data = result.data()
    assert data[-1] == "[DONE]" and data.count("[DONE]") == 1
    [frame] = terminal_frames(result)
    assert data[-2] == {"error": frame}, "the terminal frame is the last event before [DONE]"
    assert_terminal_frame(frame, result.request_id, delivered)
    assert len(result.content_chunks()) == delivered
    no_overlapping_content(result)
    journal = finished(gateway, result.request_id)
    assert (journal["phase"], journal["outcome"]) == ("interrupted", "upstream_decode_interrupted")
    assert journal["delivered_output_tokens"] == delivered
    terminated = [e for e in journal["events"] if e["event"] == "stream_terminated"]
    assert [e["reason"] for e in terminated] == [why]
    assert journal["attempt"] == 1 and len(served(sims, result.request_id)) == 1


def test_openai_sdk_raises_api_error_with_the_terminal_frame(gateway: Gateway) -> None:
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="test-key", max_retries=0)
    received: list[str] = []
    with pytest.raises(openai.APIError) as caught:
        stream = client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "hi"}],
            stream=True,
            max_tokens=8,
            extra_headers={"x-sim-fault": "close@after:2"},
        )
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                received.append(chunk.choices[0].delta.content)
    error = caught.value
    assert error.code == "upstream_decode_interrupted"
    assert isinstance(error.body, dict)
    assert error.body["partial_output"] is True and error.body["retryable"] is False
    assert error.body["delivered_output_tokens"] == len(received) == 2
    assert error.body["request_id"].startswith("req_")


# --- the client goes away -------------------------------------------------------------------------------


def test_client_disconnect_mid_stream_cancels_upstream_and_starts_nothing(
    gateway: Gateway, sims: dict[str, Sim]
) -> None:
    result = post(f"{gateway.url}/v1/chat/completions", chat(max_tokens=400), stop_after_content_events=2)
    request_id = result.request_id
    attempt = poll(lambda: (a := served(sims, request_id)) and a[0], what="replica log of the attempt")
    assert attempt["outcome"] == "client_gone" and attempt["client_gone_at"] is not None
    assert attempt["content_events_written"] < 400, "the replica kept generating for a client that left"
    journal = finished(gateway, request_id)
    assert (journal["phase"], journal["outcome"]) == ("cancelled", "client_disconnected")
    assert journal["attempt"] == 1 and len(served(sims, request_id)) == 1


def test_client_disconnect_during_prefill_cancels_and_never_retries(
    gateway: Gateway, sims: dict[str, Sim]
) -> None:
    with pytest.raises(httpx.ReadTimeout), httpx.Client(timeout=httpx.Timeout(5, read=0.5)) as client:
        client.post(
            f"{gateway.url}/v1/chat/completions",
            json=chat(),
            headers=with_credential(
                {"x-sim-fault": "delay@role for=5", "idempotency-key": "disconnect-in-prefill"}
            ),
        )
    attempt = poll(
        lambda: (a := served(sims, "disconnect-in-prefill")) and a[0], what="replica saw the client leave"
    )
    assert attempt["client_gone_at"] is not None
    journal = finished(gateway, "disconnect-in-prefill")
    assert (journal["phase"], journal["outcome"], journal["attempt"]) == (
        "cancelled",
        "client_disconnected",
        1,
    )
    assert len(served(sims, "disconnect-in-prefill")) == 1


# --- slow is not failed -----------------------------------------------------------------------------------


@pytest.mark.parametrize("fault", ["delay@role for=2.5", "delay@after:2 for=2"])
def test_slow_replica_is_not_a_failure(gateway: Gateway, sims: dict[str, Sim], fault: str) -> None:
    result = post(f"{gateway.url}/v1/chat/completions", chat(max_tokens=4), headers={"x-sim-fault": fault})
    assert_complete_answer(result, 4)
    journal = finished(gateway, result.request_id)
    assert journal["attempt"] == 1 and journal["phase"] == "completed"
    assert len(served(sims, result.request_id)) == 1


# --- non-streaming ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fault", [None, "reset@headers attempt=1", "status503@headers attempt=1"])
def test_non_streaming_request_is_whole_or_retried(
    gateway: Gateway, sims: dict[str, Sim], fault: str | None
) -> None:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 7}
    headers = {"x-sim-fault": fault} if fault else {}
    response = httpx.post(
        f"{gateway.url}/v1/chat/completions", json=body, headers=with_credential(headers), timeout=10
    )
    assert response.status_code == 200
    answer = response.json()
    assert answer["object"] == "chat.completion" and answer["usage"]["completion_tokens"] == 7
    request_id = response.headers["x-request-id"]
    journal = finished(gateway, request_id)
    assert journal["phase"] == "completed" and journal["delivered_output_tokens"] == 7
    assert journal["attempt"] == (1 if fault is None else 2)
    assert len(served(sims, request_id)) == journal["attempt"]


def test_completions_route_streams_and_retries(gateway: Gateway) -> None:
    body = {"model": "tiny", "prompt": "Once upon", "stream": True, "max_tokens": 4}
    result = post(f"{gateway.url}/v1/completions", body, headers={"x-sim-fault": "reset@token:1 attempt=1"})
    texts = [d["choices"][0]["text"] for d in result.data() if isinstance(d, dict) and d.get("choices")]
    assert result.data()[-1] == "[DONE]" and len([t for t in texts if t]) == 4
    journal = finished(gateway, result.request_id)
    assert journal["attempt"] == 2 and journal["phase"] == "completed"


# --- idempotency keys, tenants, internal headers ---------------------------------------------------


def test_duplicate_idempotency_key_in_flight_is_409_then_finished_is_409(
    gateway: Gateway, sims: dict[str, Sim]
) -> None:
    key = "dup-key-in-flight"
    first: dict[str, ClientResult] = {}
    slow = threading.Thread(
        target=lambda: first.setdefault(
            "r",
            post(
                f"{gateway.url}/v1/chat/completions",
                chat(max_tokens=3),
                headers={"idempotency-key": key, "x-sim-fault": "delay@role for=1.5"},
            ),
        )
    )
    slow.start()
    try:
        poll(lambda: served_started(sims, key), what="first request reached a replica")
        second = httpx.post(
            f"{gateway.url}/v1/chat/completions",
            json=chat(),
            headers=with_credential({"idempotency-key": key}),
        )
        assert second.status_code == 409
        error = second.json()["error"]
        assert (error["code"], error["request_id"]) == ("idempotency_key_in_flight", key)
    finally:
        slow.join(10)
    assert_complete_answer(first["r"], 3)
    finished(gateway, key)
    third = httpx.post(
        f"{gateway.url}/v1/chat/completions", json=chat(), headers=with_credential({"idempotency-key": key})
    )
    assert third.status_code == 409 and third.json()["error"]["code"] == "request_already_finished"
    # The in-flight duplicate was refused here before any attempt. The finished key's duplicate was claimed
    # beside its first attempt (journal.claim_before_forwarding: false): if that attempt reached a replica,
    # the replica saw it cancelled (the client got only the 409). One run generated the answer.
    poll(
        lambda: sum(s.started_for(key) for s in sims.values()) == len(served(sims, key)),
        what="every attempt of the key ended",
    )
    runs = served(sims, key)
    assert len([r for r in runs if r.get("client_gone_at") is None]) == 1 and len(runs) <= 2


def served_started(sims: dict[str, Sim], request_id: str) -> bool:
    return any(r.get("request_id") == request_id for sim in sims.values() for r in sim.records())


def test_a_key_whose_run_failed_before_any_content_can_be_sent_again(gateway: Gateway) -> None:
    key = "retry-after-failure"
    failed = post(
        f"{gateway.url}/v1/chat/completions",
        chat(),
        headers={"idempotency-key": key, "x-sim-fault": "status503@headers"},
    )
    assert failed.status == 502
    finished(gateway, key)
    again = post(f"{gateway.url}/v1/chat/completions", chat(max_tokens=3), headers={"idempotency-key": key})
    assert_complete_answer(again, 3)


def test_journal_and_keys_are_scoped_to_the_caller(gateway: Gateway) -> None:
    key = "shared-key-name"
    alice = {"authorization": "Bearer alice", "idempotency-key": key}
    bob = {"authorization": "Bearer bob", "idempotency-key": key}
    a = post(f"{gateway.url}/v1/chat/completions", chat(max_tokens=2), headers=alice)
    assert_complete_answer(a, 2)
    gateway.wait_journal(key, lambda j: j["phase"] == "completed", headers={"authorization": "Bearer alice"})
    status, body = gateway.journal(key, {"authorization": "Bearer bob"})
    assert status == 404 and body["error"]["code"] == "request_not_found"
    b = post(f"{gateway.url}/v1/chat/completions", chat(max_tokens=3), headers=bob)
    assert_complete_answer(b, 3)


def test_client_supplied_internal_headers_are_stripped(gateway: Gateway, sims: dict[str, Sim]) -> None:
    result = post(
        f"{gateway.url}/v1/chat/completions",
        chat(max_tokens=2),
        headers={"x-attempt-id": "forged", "x-fencing-token": "forged", "x-envoy-max-retries": "9"},
    )
    assert_complete_answer(result, 2)
    journal = finished(gateway, result.request_id)
    [attempt] = served(sims, result.request_id)
    assert attempt["attempt_id"] == journal["attempts"][0]["attempt_id"] != "forged"


# --- bad input: a clear error before any attempt -----------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "status", "code"),
    [
        (b'{"model": "tiny", "messages": [', 400, "invalid_json"),
        (b'{"messages": [{"role": "user", "content": "hi"}]}', 400, "missing_model"),
        (b"[1, 2]", 400, "invalid_request"),
        (b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "stream": "yes"}', 400, None),
    ],
)
def test_malformed_requests_are_rejected_before_any_attempt(
    gateway: Gateway, sims: dict[str, Sim], body: bytes, status: int, code: str | None
) -> None:
    response = httpx.post(
        f"{gateway.url}/v1/chat/completions",
        content=body,
        headers={"content-type": "application/json"},
        timeout=10,
    )
    assert response.status_code == status
    error = response.json()["error"]
    request_id = response.headers["x-request-id"]
    assert error["request_id"] == request_id and error["message"]
    if code:
        assert error["code"] == code
    assert not served_started(sims, request_id)


def test_oversize_bodies_get_a_json_413(gateway: Gateway) -> None:
    limit = 4 * 1024 * 1024
    for size in (limit + 1000, 2 * limit):
        body = json.dumps({"model": "tiny", "prompt": "x" * size}).encode()
        response = httpx.post(
            f"{gateway.url}/v1/completions",
            content=body,
            headers={"content-type": "application/json"},
            timeout=20,
        )
        assert response.status_code == 413, size
        error = response.json()["error"]
        assert error["code"] == "request_too_large"
        # Envoy refuses it itself (past its buffer limit), and names the request in a header too.
        assert response.headers["x-request-id"] == error["request_id"] != ""


def test_unknown_request_id_is_404(gateway: Gateway) -> None:
    status, body = gateway.journal("req_does_not_exist")
    assert status == 404 and body["error"]["request_id"] == "req_does_not_exist"
