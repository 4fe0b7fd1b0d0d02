"""The first-delta contract on SGLang's dialect: real Envoy, real etcd, two ``--dialect sglang`` simulators.

The same scenarios as test_first_delta_contract.py (the article's and ours), on SGLang 0.5.23's wire format:
bare ids, a separate chat finish event, completions without a role event, top-level error bodies, and above
all SGLang's in-band error, which is followed by the usage event and ``[DONE]`` — a stream that ends with
``[DONE]`` and is still an interruption. Every test checks the client's bytes against the bytes the replica
wrote (rebuilt from the simulator's deterministic output and the id/created the client saw), the journal,
and the replicas' own request logs.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from router_testbed.sim import generation as gen
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

SG = gen.SGLANG
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
USAGE = {"stream_options": {"include_usage": True}}


@pytest.fixture(scope="module")
def sims(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Sim]]:
    work = tmp_path_factory.mktemp("sglang-sims")
    pool: dict[str, Sim] = {}
    try:
        for name in ("a", "b"):
            pool[name] = Sim(name, work, extra_args=("--dialect", "sglang"))
        yield pool
    finally:
        for sim in pool.values():
            sim.stop()


@pytest.fixture(scope="module")
def gateway(etcd: str, sims: dict[str, Sim], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    work: Path = tmp_path_factory.mktemp("sglang-gateway")
    gw = Gateway(replicas=[s.endpoint for s in sims.values()], etcd=etcd, work=work)
    try:
        yield gw
    finally:
        gw.stop()


# --- helpers ----------------------------------------------------------------------------------------------


def completion(max_tokens: int = 8, **extra: Any) -> dict[str, Any]:
    return {"model": "tiny", "prompt": "Once upon", "stream": True, "max_tokens": max_tokens, **extra}


def replica_renderer(path: str, body: dict[str, Any], result: ClientResult) -> gen.StreamRenderer:
    """The renderer of the attempt whose events the client got: same request, the simulators' default
    seed, and the id and created time that attempt gave its events."""
    kind: gen.Kind = "chat" if path == CHAT else "completion"
    greq = gen.parse_request(kind, json.dumps(body).encode(), served_model="tiny", dialect=SG)
    first = next(d for d in result.data() if isinstance(d, dict) and "id" in d)
    meta = gen.StreamMeta(id=first["id"], created=first["created"], model="tiny", fingerprint="")
    return SG.renderer(greq, gen.plan_output(greq, 0), meta)


def prefix(r: gen.StreamRenderer, n: int) -> bytes:
    """The replica's bytes up to and including content event ``n``."""
    role = r.role_event()
    return (role or b"") + b"".join(r.content_event(i, r.natural_finish(i)) for i in range(1, n + 1))


def assert_whole_answer(path: str, body: dict[str, Any], result: ClientResult) -> gen.StreamRenderer:
    """One complete generation, exactly the bytes one SGLang replica wrote."""
    assert result.status == 200 and result.transport_error is None, (result.status, result.body[-500:])
    r = replica_renderer(path, body, result)
    assert result.body == b"".join(gen.clean_stream(r))
    return r


def assert_one_frame_after(result: ClientResult, expected_prefix: bytes, delivered: int) -> dict[str, Any]:
    """The delivered prefix, byte for byte, then exactly one terminal frame, then one [DONE]."""
    assert result.status == 200 and result.transport_error is None
    assert result.body.startswith(expected_prefix)
    rest = gen.split_events(result.body[len(expected_prefix) :])
    assert len(rest) == 2 and rest[1] == gen.DONE_EVENT.rstrip(b"\n"), rest
    [frame] = terminal_frames(result)
    assert gen.event_payload(rest[0]) == {"error": frame}
    assert_terminal_frame(frame, result.request_id, delivered)
    assert b"Request running timeout reached." not in result.body, (
        "the replica's raw error reached the client"
    )
    assert result.data().count("[DONE]") == 1
    return frame


# --- healthy: the replica's bytes, untouched ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "body"),
    [
        (CHAT, chat(max_tokens=5)),
        (CHAT, chat(max_tokens=5, **USAGE)),
        (COMPLETIONS, completion(max_tokens=5)),
        (COMPLETIONS, completion(max_tokens=5, **USAGE)),
    ],
    ids=["chat", "chat-usage", "completions", "completions-usage"],
)
def test_healthy_stream_is_the_replicas_bytes_and_is_journaled(
    gateway: Gateway, sims: dict[str, Sim], path: str, body: dict[str, Any]
) -> None:
    result = post(f"{gateway.url}{path}", body)
    assert_whole_answer(path, body, result)
    data = [d for d in result.data() if isinstance(d, dict)]
    assert data[0]["id"] != result.request_id and len(data[0]["id"]) == 32  # SGLang's own id, bare hex
    journal = finished(gateway, result.request_id)
    assert (journal["phase"], journal["outcome"], journal["attempt"]) == ("completed", "completed", 1)
    assert journal["delivered_output_tokens"] == 5
    usage = "stream_options" in body
    assert journal["delivered_output_tokens_source"] == ("usage" if usage else "content_events")
    if usage:
        assert data[-1]["usage"]["completion_tokens"] == 5
    [attempt] = attempts_logged(sims, result.request_id, 1)
    # The replica logs the x-request-id and x-attempt-id it received (SGLang itself ignores them).
    assert attempt["attempt_id"] == journal["attempts"][0]["attempt_id"]
    assert attempt["outcome"] == "completed" and attempt["content_events_written"] == 5


def test_body_rid_is_the_completion_id_and_the_log_keeps_the_gateways_ids(
    gateway: Gateway, sims: dict[str, Sim]
) -> None:
    body = chat(max_tokens=3, rid="client-rid-1")
    result = post(f"{gateway.url}{CHAT}", body, headers={"x-sim-fault": "reset@role attempt=1"})
    assert_whole_answer(CHAT, body, result)
    assert result.completion_ids() == {"client-rid-1"}
    first, second = attempts_logged(sims, result.request_id, 2)
    journal = finished(gateway, result.request_id)
    assert [first["attempt_id"], second["attempt_id"]] == [a["attempt_id"] for a in journal["attempts"]]
    assert first["request_id"] == second["request_id"] == result.request_id != "client-rid-1"


# --- before the first delta: invisible retry ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("fault", "replica_outcome", "detail"),
    # exit@token:1 left out: its point is covered by reset@token:1 and its kind of death by exit@headers.
    [case for case in RETRIED_BEFORE_FIRST_DELTA if case[0] != "exit@token:1 attempt=1"],
)
def test_failure_before_first_delta_is_retried_invisibly(
    gateway: Gateway, sims: dict[str, Sim], fault: str, replica_outcome: str, detail: str
) -> None:
    body = chat(max_tokens=4, **USAGE)
    result = post(f"{gateway.url}{CHAT}", body, headers={"x-sim-fault": fault})
    assert_whole_answer(CHAT, body, result)
    no_overlapping_content(result)
    journal = finished(gateway, result.request_id)
    assert (journal["phase"], journal["attempt"]) == ("completed", 2)
    first, second = journal["attempts"]
    assert (first["outcome"], first["detail"]) == ("failed", detail)
    assert second["outcome"] == "completed" and second["replica"] != first["replica"]
    assert journal["delivered_output_tokens"] == 4
    names = [e["event"] for e in journal["events"]]
    assert (
        names.index("attempt_failed") < names.index("first_delta_sent")
        and names.count("first_delta_sent") == 1
    )
    logged = attempts_logged(sims, result.request_id, 2)
    assert logged[0]["outcome"] in accepted_replica_outcomes(replica_outcome)
    assert logged[1]["outcome"] == "completed" and logged[1]["attempt_count"] == 2


def test_completions_error_before_first_delta_is_retried(gateway: Gateway, sims: dict[str, Sim]) -> None:
    # Completions have no role event: the error event is the very first event of the attempt.
    body = completion(max_tokens=3, **USAGE)
    result = post(f"{gateway.url}{COMPLETIONS}", body, headers={"x-sim-fault": "error@token:1 attempt=1"})
    assert_whole_answer(COMPLETIONS, body, result)
    journal = finished(gateway, result.request_id)
    assert journal["attempt"] == 2 and journal["attempts"][0]["detail"] == "error_event"


# --- after the first delta: never a retry -------------------------------------------------------------------


@pytest.mark.parametrize("action", ["reset", "exit"])
def test_abrupt_death_after_first_delta_is_prefix_then_reset(
    gateway: Gateway, sims: dict[str, Sim], action: str
) -> None:
    # exit is SGLang losing its process (or, after its ~6 s of silence, its scheduler): the connection
    # closes without the last chunk. The delay lets the first delta reach the client first.
    body = chat(max_tokens=6)
    fault = f"delay@after:1 for=0.3; {action}@after:1"
    result = post(f"{gateway.url}{CHAT}", body, headers={"x-sim-fault": fault})
    assert result.status == 200 and result.transport_error is not None
    assert result.body == prefix(replica_renderer(CHAT, body, result), 1)
    journal = finished(gateway, result.request_id)
    assert (journal["phase"], journal["outcome"]) == ("interrupted", "upstream_decode_interrupted")
    assert journal["delivered_output_tokens"] == 1 and journal["attempt"] == 1
    assert [e["cause"] for e in journal["events"] if e["event"] == "stream_reset"] == ["upstream_reset"]
    assert len(served(sims, result.request_id)) == 1


@pytest.mark.parametrize(
    ("path", "body"),
    [
        (CHAT, chat(max_tokens=8, **USAGE)),
        (CHAT, chat(max_tokens=8)),
        (COMPLETIONS, completion(max_tokens=8, **USAGE)),
    ],
    ids=["chat-usage", "chat", "completions-usage"],
)
def test_sglang_inband_error_after_first_delta_is_prefix_one_frame_done(
    gateway: Gateway, sims: dict[str, Sim], path: str, body: dict[str, Any]
) -> None:
    # The replica writes: role (chat), 2 content events, its error event, its usage event (if asked), [DONE].
    result = post(f"{gateway.url}{path}", body, headers={"x-sim-fault": "error@token:3"})
    r = replica_renderer(path, body, result)
    frame = assert_one_frame_after(result, prefix(r, 2), delivered=2)
    assert not any(isinstance(d, dict) and d.get("usage") for d in result.data()), (
        "usage after the error leaked"
    )
    no_overlapping_content(result)
    journal = finished(gateway, result.request_id)
    assert (journal["phase"], journal["outcome"]) == ("interrupted", "upstream_decode_interrupted")
    assert journal["delivered_output_tokens"] == frame["delivered_output_tokens"] == 2
    # The usage event comes after the error, so it is never read: the count is the content events passed.
    assert journal["delivered_output_tokens_source"] == "content_events"
    terminated = [e["reason"] for e in journal["events"] if e["event"] == "stream_terminated"]
    assert terminated == ["in-band error event after the first delta"]
    [attempt] = attempts_logged(sims, result.request_id, 1)
    # The replica did write its whole tail: the error, usage when asked, [DONE].
    assert attempt["outcome"] in ("fault:error", "client_gone") and attempt["content_events_written"] == 2
    assert journal["attempt"] == 1


def test_clean_close_without_done_after_first_delta_is_prefix_one_frame_done(
    gateway: Gateway, sims: dict[str, Sim]
) -> None:
    body = chat(max_tokens=8)
    result = post(f"{gateway.url}{CHAT}", body, headers={"x-sim-fault": "close@after:2"})
    assert_one_frame_after(result, prefix(replica_renderer(CHAT, body, result), 2), delivered=2)
    journal = finished(gateway, result.request_id)
    assert (journal["phase"], journal["delivered_output_tokens"], journal["attempt"]) == ("interrupted", 2, 1)
    terminated = [e["reason"] for e in journal["events"] if e["event"] == "stream_terminated"]
    assert terminated == ["upstream ended without [DONE]"]


def test_abort_after_first_delta_is_prefix_abort_event_one_frame_done(
    gateway: Gateway, sims: dict[str, Sim]
) -> None:
    # SGLang's abort is a finish-only event (no token): it passes, then the frame; the usage after it never.
    body = chat(max_tokens=8, **USAGE)
    result = post(f"{gateway.url}{CHAT}", body, headers={"x-sim-fault": "abort@token:3"})
    r = replica_renderer(CHAT, body, result)
    frame = assert_one_frame_after(result, prefix(r, 2) + r.empty_event(2, "abort"), delivered=2)
    journal = finished(gateway, result.request_id)
    assert (journal["phase"], journal["outcome"]) == ("interrupted", "upstream_decode_interrupted")
    assert journal["delivered_output_tokens"] == frame["delivered_output_tokens"] == 2
    terminated = [e["reason"] for e in journal["events"] if e["event"] == "stream_terminated"]
    assert terminated == ["finish_reason abort after the first delta"]
    assert journal["attempt"] == 1 and len(served(sims, result.request_id)) == 1


# --- the client goes away -----------------------------------------------------------------------------------


def test_client_disconnect_cancels_the_attempt_and_starts_no_other(
    gateway: Gateway, sims: dict[str, Sim]
) -> None:
    result = post(f"{gateway.url}{CHAT}", chat(max_tokens=400), stop_after_content_events=2)
    attempt = poll(
        lambda: (a := served(sims, result.request_id)) and a[0], what="the replica saw the client go"
    )
    assert attempt["outcome"] == "client_gone" and attempt["client_gone_at"] is not None
    assert attempt["content_events_written"] < 400
    journal = finished(gateway, result.request_id)
    assert (journal["phase"], journal["outcome"], journal["attempt"]) == (
        "cancelled",
        "client_disconnected",
        1,
    )
    assert len(served(sims, result.request_id)) == 1


# --- non-streaming ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fault", "attempts"),
    [
        (None, 1),
        ("status503@headers attempt=1", 2),
        ("error@role attempt=1", 2),
        ("reset@headers attempt=1", 2),
    ],
)
def test_non_stream_is_whole_or_retried(
    gateway: Gateway, sims: dict[str, Sim], fault: str | None, attempts: int
) -> None:
    # error@role without a stream is SGLang's 503 {"object":"error",...,"type":"503"} (no error wrapper).
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 7}
    headers = {"x-sim-fault": fault} if fault else {}
    response = httpx.post(f"{gateway.url}{CHAT}", json=body, headers=with_credential(headers), timeout=10)
    assert response.status_code == 200, response.text
    answer = response.json()
    assert list(answer) == ["id", "object", "created", "model", "choices", "usage", "metadata"]
    assert answer["choices"][0]["finish_reason"] == "length" and answer["usage"]["completion_tokens"] == 7
    greq = gen.parse_request("chat", json.dumps(body).encode(), served_model="tiny", dialect=SG)
    meta = gen.StreamMeta(id=answer["id"], created=answer["created"], model="tiny", fingerprint="")
    assert response.content == SG.response_body(greq, gen.plan_output(greq, 0), meta, 7, "length")
    request_id = response.headers["x-request-id"]
    journal = finished(gateway, request_id)
    assert (journal["phase"], journal["delivered_output_tokens"], journal["attempt"]) == (
        "completed",
        7,
        attempts,
    )
    assert len(attempts_logged(sims, request_id, attempts)) == attempts


def test_every_replica_failing_gives_one_json_error_never_sglangs_body(gateway: Gateway) -> None:
    result = post(f"{gateway.url}{CHAT}", chat(), headers={"x-sim-fault": "error@headers"})
    assert result.status == 502 and b"data:" not in result.body
    error = json.loads(result.body)["error"]
    assert (error["code"], error["request_id"]) == ("retries_exhausted", result.request_id)
    assert [a["detail"] for a in error["attempts"]] == ["upstream_status", "upstream_status"]
    assert b"Request running timeout reached." not in result.body
    journal = finished(gateway, result.request_id)
    assert (journal["phase"], journal["outcome"]) == ("failed", "retries_exhausted")


# --- the simulator itself, in SGLang's dialect (no gateway) -----------------------------------------------


def test_sim_speaks_sglang_endpoints(sims: dict[str, Sim]) -> None:
    url = f"http://{sims['a'].endpoint}"
    for path in ("/health", "/health_generate"):
        reply = httpx.get(url + path, timeout=5)
        assert (reply.status_code, reply.content, reply.headers.get("content-type")) == (200, b"", None)
    [model] = httpx.get(url + "/v1/models", timeout=5).json()["data"]
    assert (model["owned_by"], model["root"], model["parent"]) == ("sglang", "tiny", None)
    info = httpx.get(url + "/get_model_info", timeout=5).json()
    assert (info["model_path"], info["model_type"], info["weight_version"]) == ("tiny", "llama", "default")
    assert httpx.get(url + "/version", timeout=5).status_code == 404


@pytest.mark.parametrize(
    ("fault", "events"),
    [
        ("error@token:3", ["role", "content", "content", "error", "usage", "[DONE]"]),
        ("abort@token:3", ["role", "content", "content", "finish:abort", "usage", "[DONE]"]),
        ("abort@done", ["role", "content", "content", "content", "finish:abort", "usage", "[DONE]"]),
        ("close@after:2", ["role", "content", "content"]),
        (
            "stall@after:1 for=0.1",
            ["role", "content", "content", "content", "finish:length", "usage", "[DONE]"],
        ),
        ("delay@role for=0.1", ["role", "content", "content", "content", "finish:length", "usage", "[DONE]"]),
    ],
)
def test_sim_fault_sequences_in_sglang_dialect(sims: dict[str, Sim], fault: str, events: list[str]) -> None:
    body = chat(max_tokens=3, **USAGE)
    headers = {"x-sim-fault": fault, "x-request-id": f"direct-{fault}", "x-attempt-id": "att-1"}
    result = post(f"http://{sims['a'].endpoint}{CHAT}", body, headers=headers)
    kinds = []
    for d in result.data():
        if d == "[DONE]" or "error" in d:
            kinds.append("[DONE]" if d == "[DONE]" else "error")
        elif not d["choices"]:
            kinds.append("usage")
        elif d["choices"][0]["finish_reason"]:
            kinds.append(f"finish:{d['choices'][0]['finish_reason']}")
        else:
            kinds.append("role" if "role" in d["choices"][0]["delta"] else "content")
    assert kinds == events
    [record] = poll(lambda: sims["a"].requests_for(f"direct-{fault}"), what="the sim's end record")
    assert record["attempt_id"] == "att-1" and record["faults_fired"]
