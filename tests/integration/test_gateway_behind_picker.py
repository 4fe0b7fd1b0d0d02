"""The gateway behind an endpoint picker (`gateway --endpoint-picker`), through real Envoy, etcd, the
testbed's picker and simulated replicas: the picker's list is the order of attempts, then ours; a replica
that fails before the first content is followed by the picker's next endpoint; after it, the terminal frame
as always; the picker learns which endpoint served; streams and large bodies pass whole through both filters;
the picker's own answers reach the client as our JSON errors, journaled; the picker down fails closed with
our JSON error, or open when configured so, in the gateway's own order, and is followed again once back.

GAIE's conformance intents at the gateway's level (docs/endpoint-picker.md#the-gateway-behind-a-picker):
gateway_following_epp_routing, gateway_destination_endpoint_served, epp_unavailable_fail_open."""

from __future__ import annotations

import asyncio
import collections
import hashlib
import json
import os
import random
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from router_sidecar.core.dialects import anthropic_error_type
from tests.fault.fuzz import gather_evidence, send_request
from tests.harness import CREDENTIAL, Gateway, Sim, chat, poll, post
from tests.integration.epp_helpers import (
    RESET_HEADER,
    PickerProcess,
    RecordingReplica,
    raw_request,
    sse_events,
)
from tests.integration.first_delta_helpers import assert_terminal_frame, finished, terminal_frames
from tests.invariants import Evidence, SentRequest, check_request, outcome_kind, schema_errors

pytestmark = pytest.mark.integration

SELECT = "test-epp-endpoint-selection"
TAG = "x-test-tag"  # the picker logs it (--log-header): our Envoy replaces x-request-id before its filter
PICKER_DETAILS = "router_testbed_epp"  # the testbed picker's `details` on its own answers
PICKER_BODIES = {
    503: {"error": {"message": "no ready endpoint", "type": "endpoint_picker", "code": 503}},
    429: {"error": {"message": "request shed", "type": "endpoint_picker", "code": 429}},
}
CODES = {503: "no_replica_available", 429: "replicas_overloaded"}


@pytest.fixture(scope="module")
def sims(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Sim]]:
    work = tmp_path_factory.mktemp("sims")
    pool = {name: Sim(name, work) for name in ("a", "b", "c")}
    try:
        yield pool
    finally:
        for sim in pool.values():
            sim.stop()


@pytest.fixture(scope="module")
def picker(sims: dict[str, Sim], tmp_path_factory: pytest.TempPathFactory) -> Iterator[PickerProcess]:
    work = tmp_path_factory.mktemp("picker")
    process = PickerProcess(work, [s.endpoint for s in sims.values()], extra=("--log-header", TAG))
    try:
        yield process
    finally:
        process.stop()


@pytest.fixture(scope="module")
def gateway(
    etcd: str, sims: dict[str, Sim], picker: PickerProcess, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Gateway]:
    work: Path = tmp_path_factory.mktemp("gateway")
    gw = Gateway(
        replicas=[s.endpoint for s in sims.values()],
        etcd=etcd,
        work=work,
        extra_args=("--endpoint-picker", f"127.0.0.1:{picker.port}"),
    )
    try:
        yield gw
    finally:
        gw.stop()


@pytest.fixture(autouse=True)
def _all_up(request: pytest.FixtureRequest, sims: dict[str, Sim]) -> None:
    restarted = [sim.ensure_running() for sim in sims.values()]
    for name in ("gateway", "open_gateway"):
        if name in request.fixturenames:
            gw = request.getfixturevalue(name)
            gw.wait_replicas_healthy((s.endpoint for s in sims.values()), fresh=any(restarted))


def served_on(sims: dict[str, Sim], request_id: str, n: int) -> list[str]:
    """The replicas that saw the request's `n` attempts, by their own logs, in start order."""

    def logged() -> list[tuple[float, str]] | None:
        starts = [(r["t_start"], s.endpoint) for s in sims.values() for r in s.requests_for(request_id)]
        return sorted(starts) if len(starts) == n else None

    return [endpoint for _, endpoint in poll(logged, what=f"{n} attempt(s) in the replica logs")]


def complete(result: Any, tokens: int) -> None:
    data = result.data()
    assert result.status == 200 and result.transport_error is None, (result.status, result.transport_error)
    assert data[-1] == "[DONE]" and data.count("[DONE]") == 1
    assert len(result.content_chunks()) == tokens


def picker_record(picker: PickerProcess, tag: str) -> dict[str, Any]:
    """The picker's `end` record of the request that carried `tag` (once it wrote it)."""

    def found() -> dict[str, Any] | None:
        records = [r for r in picker.records() if (r.get("headers") or {}).get(TAG) == tag]
        assert len(records) <= 1, records
        return records[0] if records else None

    return poll(found, what=f"the picker's record of {tag}")


def messages(max_tokens: int = 8) -> dict[str, Any]:
    return {
        "model": "tiny",
        "max_tokens": max_tokens,
        "stream": True,
        "messages": [{"role": "user", "content": "Say something"}],
    }


def rejected(gateway: Gateway, request_id: str) -> dict[str, Any]:
    return gateway.wait_journal(request_id, lambda j: j.get("phase") == "rejected")


def check_error_document(result: Any, status: int, code: str, path: str) -> dict[str, Any]:
    """Our JSON error of a request that delivered nothing, in the API's shape, naming the request; its error
    object."""
    assert result.status == status, (result.status, result.body[:300])
    assert result.headers.get("content-type") == "application/json"
    request_id = result.headers.get("x-request-id", "")
    assert request_id
    document = json.loads(result.body)
    if path == "/v1/messages":
        assert schema_errors("messages-error", document) == []
        error = document["error"]
        assert document["type"] == "error" and document["request_id"] == request_id
        assert error["type"] == anthropic_error_type(status) and error["details"] == {"error_code": code}
        assert error["delivered_output_tokens"] == 0
        assert result.headers.get("request-id") == request_id  # where Anthropic's SDK reads it
    else:
        assert schema_errors("gateway-error", document) == []
        error = document["error"]
        assert error["type"] == "gateway_error"
    assert (error["code"], error["request_id"], error["attempts"]) == (code, request_id, [])
    assert error["partial_output"] is False and error["retryable"] is True
    return error


def unseen_by_replicas(sims: dict[str, Sim], request_id: str) -> None:
    # Our filter never saw the request: a replica asked would have logged Envoy's id, the one the client got.
    assert [s.name for s in sims.values() if s.started_for(request_id)] == []


# --- where attempts go, and what the picker is told ---------------------------------------------------------


def test_the_pickers_first_endpoint_serves_and_every_stream_arrives_whole(
    gateway: Gateway, sims: dict[str, Sim]
) -> None:
    endpoints = [s.endpoint for s in sims.values()]
    for i in range(12):
        chosen = endpoints[i % 3]
        result = post(f"{gateway.url}/v1/chat/completions", chat(max_tokens=6), headers={SELECT: chosen})
        complete(result, 6)
        journal = finished(gateway, result.request_id)
        destinations = journal["destinations"]
        assert destinations["picker"] == [chosen]
        assert destinations["order"][0] == chosen and destinations["source"] == "picker+gateway"
        assert [(a["replica"], a["chosen_by"]) for a in journal["attempts"]] == [(chosen, "picker choice #1")]
        assert served_on(sims, result.request_id, 1) == [chosen]


def test_a_failure_before_content_goes_to_the_pickers_next_endpoint(
    gateway: Gateway, sims: dict[str, Sim]
) -> None:
    first, second = sims["b"].endpoint, sims["c"].endpoint
    result = post(
        f"{gateway.url}/v1/chat/completions",
        chat(max_tokens=4),
        headers={SELECT: f"{first},{second}", "x-sim-fault": "reset@role attempt=1"},
    )
    complete(result, 4)
    journal = finished(gateway, result.request_id)
    assert [(a["replica"], a["chosen_by"]) for a in journal["attempts"]] == [
        (first, "picker choice #1"),
        (second, "picker choice #2"),
    ]
    assert served_on(sims, result.request_id, 2) == [first, second]


def test_after_content_the_terminal_frame_as_always(gateway: Gateway, sims: dict[str, Sim]) -> None:
    chosen = sims["a"].endpoint
    result = post(
        f"{gateway.url}/v1/chat/completions",
        chat(max_tokens=6),
        headers={SELECT: chosen, "x-sim-fault": "error@token:3"},
    )
    [frame] = terminal_frames(result)
    assert_terminal_frame(frame, result.request_id, 2)
    assert result.data()[-1] == "[DONE]"
    journal = finished(gateway, result.request_id)
    assert journal["outcome"] == "upstream_decode_interrupted" and len(journal["attempts"]) == 1


def test_the_picker_is_told_which_endpoint_served(
    gateway: Gateway, sims: dict[str, Sim], picker: PickerProcess
) -> None:
    """GAIE's gateway_destination_endpoint_served through the gateway: Envoy writes the replica that served
    (after a retry, the picker's second entry) where the picker's filter reads it at the response headers,
    and the picker's response header reaches the client through our filter."""
    first, second = sims["b"].endpoint, sims["a"].endpoint
    for fault, served in ((None, first), ("reset@role attempt=1", second)):
        tag = secrets.token_hex(8)
        headers = {SELECT: f"{first},{second}", TAG: tag}
        if fault is not None:
            headers["x-sim-fault"] = fault
        result = post(f"{gateway.url}/v1/chat/completions", chat(max_tokens=4), headers=headers)
        complete(result, 4)
        assert result.headers.get("x-conformance-test-served-endpoint") == served
        record = picker_record(picker, tag)
        assert (record["picked"], record["served"], record["response_status"]) == (
            [first, second],
            served,
            "200",  # as the picker logs it
        )
        assert record["outcome"] == "completed"
        attempts = finished(gateway, result.request_id)["attempts"]
        assert attempts[-1]["replica"] == served


# --- the picker's own answers ---------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages"])
@pytest.mark.parametrize("status", [503, 429])
def test_the_pickers_own_answer_is_our_json_error_and_journaled(
    gateway: Gateway, sims: dict[str, Sim], picker: PickerProcess, status: int, path: str
) -> None:
    tag = secrets.token_hex(8)
    headers = {"test-epp-answer": str(status), "test-epp-retry-after": "3", TAG: tag}
    body = messages() if path == "/v1/messages" else chat()
    result = post(gateway.url + path, body, headers=headers)
    error = check_error_document(result, status, CODES[status], path)
    prefix = f"the endpoint picker answered {status}: "
    assert error["message"].startswith(prefix)
    assert json.loads(error["message"].removeprefix(prefix)) == PICKER_BODIES[status]  # the picker's body
    assert result.headers.get("retry-after") == "3"  # the picker's header kept
    request_id = result.request_id
    record = picker_record(picker, tag)
    assert (record["answer"], record["outcome"], record["picked"]) == (status, "answered", None)
    unseen_by_replicas(sims, request_id)
    # Journaled from Envoy's access log, under the caller's tenant, found by the id the client got.
    journal = rejected(gateway, request_id)
    assert schema_errors("journal-record", journal) == []
    assert (journal["outcome"], journal["attempt"], journal["attempts"]) == (CODES[status], 0, [])
    assert journal["first_delta_sent"] is False and journal["request_id"] == request_id
    assert journal["input"]["route"] == ("messages" if path == "/v1/messages" else "chat.completions")
    [event] = journal["events"]
    assert event["event"] == "request_rejected" and (event["code"], event["status"]) == (
        CODES[status],
        status,
    )
    assert (
        event["reason"] == f"the endpoint picker answered {status} ({PICKER_DETAILS}); no replica was asked"
    )
    assert event["details"] == PICKER_DETAILS
    assert gateway.journal(request_id, {"Authorization": "Bearer someone-else"})[0] == 404


def test_a_request_the_picker_shed_can_be_sent_again_with_its_idempotency_key(gateway: Gateway) -> None:
    """The picker's answer is journaled under the id Envoy made (the client's x-request-id), never under the
    request's Idempotency-Key, which the gateway did not read: the same key again is a new run, served."""
    key = f"shed-{secrets.token_hex(6)}"
    url = f"{gateway.url}/v1/chat/completions"
    shed = post(url, chat(max_tokens=3), headers={"idempotency-key": key, "test-epp-answer": "429"})
    assert shed.status == 429 and shed.request_id != key
    assert rejected(gateway, shed.request_id)["outcome"] == "replicas_overloaded"
    again = post(url, chat(max_tokens=3), headers={"idempotency-key": key})
    complete(again, 3)
    assert again.request_id == key and finished(gateway, key)["outcome"] == "completed"


# --- what passes through both filters ---------------------------------------------------------------------

EVENTS = 1000
RESPONSE_TRAILERS = [("x-upstream-trailer", "end-of-answer")]
REQUEST_TRAILERS = [("x-client-trailer", "t-1")]
Recorders = dict[str, RecordingReplica]


@pytest.fixture(scope="module")
def recorders() -> Iterator[Recorders]:
    """Replicas that record every byte they are sent and answer 1 000 events: r1 and r2 end their answer
    plainly, t with response trailers."""
    body = sse_events(EVENTS)
    pool = {
        "r1": RecordingReplica("r1", body),
        "r2": RecordingReplica("r2", body),
        "t": RecordingReplica("t", body, trailers=RESPONSE_TRAILERS),
    }
    try:
        yield pool
    finally:
        for replica in pool.values():
            replica.stop()


@pytest.fixture(scope="module")
def recording_gateway(
    etcd: str, recorders: Recorders, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Gateway, PickerProcess]]:
    """A gateway behind its own picker over the recording replicas."""
    work: Path = tmp_path_factory.mktemp("recording")
    endpoints = [r.endpoint for r in recorders.values()]
    pick = PickerProcess(work, endpoints, extra=("--log-header", TAG))
    try:
        gw = Gateway(
            replicas=endpoints,
            etcd=etcd,
            work=work,
            extra_args=("--endpoint-picker", f"127.0.0.1:{pick.port}"),
        )
        try:
            gw.wait_replicas_healthy(endpoints)
            yield gw, pick
        finally:
            gw.stop()
    finally:
        pick.stop()


LARGE_BODY_BYTES = 130_000


def large_body() -> bytes:
    """A chat request of exactly 130 000 bytes, with bytes that a JSON re-encoding would change (raw UTF-8,
    escapes, escaped backslashes)."""

    def encoded(content: str) -> bytes:
        message = {"role": "user", "content": content}
        return json.dumps(
            {"model": "tiny", "stream": True, "messages": [message]}, ensure_ascii=False
        ).encode()

    words = " ".join(f"w{i}-é\\u00e9\\\\" for i in range(5_000))
    pad = LARGE_BODY_BYTES - len(encoded(words))
    assert pad > 0
    return encoded(words + "x" * pad)


def send_raw(
    gw: Gateway,
    order: list[RecordingReplica],
    body: bytes,
    *,
    trailers: list[tuple[str, str]],
    reset: RecordingReplica | None = None,
    timeout: float = 30.0,
) -> tuple[Any, str]:
    """POST `body` chunked over HTTP/1.1 with `trailers`, the picker told to answer `order`; the response
    as it came, and the tag the picker logged it under."""
    tag = secrets.token_hex(8)
    headers = [
        ("content-type", "application/json"),
        ("authorization", CREDENTIAL["Authorization"]),
        (SELECT, ",".join(r.endpoint for r in order)),
        (TAG, tag),
    ]
    if reset is not None:
        headers.append((RESET_HEADER, reset.name))
    response = raw_request(gw.port, "/v1/chat/completions", headers, body, trailers=trailers, timeout=timeout)
    assert response.start_line.startswith("HTTP/1.1 200"), response.start_line
    return response, tag


@pytest.mark.parametrize("first_resets", [False, True], ids=["first_entry", "after_a_reset"])
def test_a_large_body_with_trailers_and_a_long_stream_pass_byte_exact(
    recording_gateway: tuple[Gateway, PickerProcess], recorders: Recorders, first_resets: bool
) -> None:
    """130 000 bytes of request body (chunked, with HTTP/1.1 request trailers) and a 1 000-event response
    through the picker's full-duplex filter and ours, byte-exact both ways; after a reset of the picker's
    first entry, the body reaches its second entry whole, once: Envoy 1.40's doubling of a body with
    trailers on a route with retries (envoyproxy/envoy#45470) does not happen with our BUFFERED filter after
    the picker's."""
    gw, pick = recording_gateway
    first, second = recorders["r1"], recorders["r2"]
    body = large_body()
    assert len(body) == LARGE_BODY_BYTES
    response, tag = send_raw(
        gw, [first, second], body, trailers=REQUEST_TRAILERS, reset=first if first_resets else None
    )
    request_id = response.header("x-request-id") or ""
    expected = sse_events(EVENTS)
    assert response.body == expected, (len(response.body), len(expected))
    assert response.trailers == []
    served = second if first_resets else first
    [got] = served.received(request_id)
    assert got.body == body and got.trailers == REQUEST_TRAILERS
    if first_resets:
        [reset] = first.received(request_id)  # it read the whole request, then reset the connection
        assert reset.body == body and reset.trailers == REQUEST_TRAILERS
    else:
        assert second.received(request_id) == []
    journal = finished(gw, request_id)
    chosen = [(a["replica"], a["chosen_by"]) for a in journal["attempts"]]
    want = [(first.endpoint, "picker choice #1")]
    if first_resets:
        want.append((second.endpoint, "picker choice #2"))
    assert chosen == want and journal["outcome"] == "completed"
    assert journal["delivered_output_tokens"] == EVENTS
    record = picker_record(pick, tag)
    assert (record["request_body_bytes"], record["request_body_sha256"]) == (len(body), got.sha256)
    assert record["request_trailers"] == dict(REQUEST_TRAILERS)
    assert record["response_body_sha256"] == hashlib.sha256(expected).hexdigest()
    assert record["served"] == served.endpoint


def test_response_trailers_reach_the_client(
    recording_gateway: tuple[Gateway, PickerProcess], recorders: Recorders
) -> None:
    """A replica's response trailers pass both filters (behind a picker the replicas' cluster keeps HTTP/1.1
    trailers), when the request had none: see the next test."""
    gw, pick = recording_gateway
    body = large_body()
    response, tag = send_raw(gw, [recorders["t"]], body, trailers=[])
    assert response.body == sse_events(EVENTS) and response.trailers == RESPONSE_TRAILERS
    assert picker_record(pick, tag)["response_trailers"] == dict(RESPONSE_TRAILERS)


def test_response_trailers_of_a_request_with_trailers_reach_the_client(
    recording_gateway: tuple[Gateway, PickerProcess], recorders: Recorders
) -> None:
    gw, _ = recording_gateway
    response, _ = send_raw(gw, [recorders["t"]], large_body(), trailers=REQUEST_TRAILERS, timeout=5)
    assert response.body == sse_events(EVENTS) and response.trailers == RESPONSE_TRAILERS


# --- several streams at once ----------------------------------------------------------------------------

STREAMS = 16
SEED = int(os.environ.get("PICKER_BURST_SEED", "0")) or random.randrange(1, 2**31)
BEFORE_CONTENT = (
    "reset@role attempt=1",
    "status503@headers attempt=1",
    "close@token:1 attempt=1",
    "error@token:1 attempt=1",
    "abort@token:1 attempt=1",
)
# After content the replica ends the stream itself without [DONE] (close), with an in-band error or with
# finish_reason "abort": the gateway's terminal frame. (A reset after content reaches the client as a reset,
# by design: docs/design.md, "A reset stays a reset".)
AFTER_CONTENT = ("close@token:4", "error@token:3", "abort@after:2")
BURST_TOKENS = 24  # at 5 ms a token the streams overlap
BURST_CREDENTIAL = "Bearer picker-burst"


async def _burst(url: str, sent: list[SentRequest]) -> list[Any]:
    limits = httpx.Limits(max_connections=STREAMS, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=httpx.Timeout(30, connect=5), limits=limits) as client:
        tasks = [send_request(client, url, s, authorization=BURST_CREDENTIAL) for s in sent]
        return list(await asyncio.gather(*tasks))


def _max_in_flight(evidence: list[Evidence]) -> int:
    edges = sorted(
        (t, step)
        for ev in evidence
        for r in ev.replica_records
        if r.get("event") == "end"
        for t, step in ((r["t_start"], 1), (r["t_end"], -1))
    )
    level = peak = 0
    for _, step in edges:
        level += step
        peak = max(peak, level)
    return peak


def test_sixteen_streams_at_once_each_complete_or_one_terminal_frame(
    gateway: Gateway, sims: dict[str, Sim]
) -> None:
    rng = random.Random(SEED)
    print(f"picker burst seed {SEED} (PICKER_BURST_SEED={SEED} replays it)")
    nonce = secrets.token_hex(3)
    sent = []
    for i in range(STREAMS):
        fault = rng.choice((None, None, *BEFORE_CONTENT, *AFTER_CONTENT))
        body = chat(max_tokens=BURST_TOKENS, messages=[{"role": "user", "content": f"burst {nonce} {i}"}])
        sent.append(SentRequest(f"pb-{nonce}-{i:02d}", "chat", body, fault))
    outcomes = asyncio.run(_burst(gateway.url, sent))
    evidence = asyncio.run(
        gather_evidence(
            gateway.url,
            sent,
            outcomes,
            replica_records=lambda: [r for sim in sims.values() for r in sim.records()],
            live_pids=lambda: frozenset(
                s.child.pid for s in sims.values() if s.child is not None and s.child.alive()
            ),
            authorization=BURST_CREDENTIAL,
        )
    )
    problems = [f"seed {SEED}: {v}" for ev in evidence for v in check_request(ev)]
    kinds = []
    for ev in evidence:
        kind, fault = outcome_kind(ev), ev.sent.fault
        kinds.append(kind)
        # Before content: a complete answer from the retry, or, when Envoy's retry budget refused the retry
        # under the burst (policy budgets), one JSON error saying so; after content, one terminal frame.
        wanted = {"terminal_frame"} if fault in AFTER_CONTENT else {"complete"}
        if fault in BEFORE_CONTENT:
            wanted.add("json_error:retry_budget_exhausted")
        if kind not in wanted:
            problems.append(
                f"seed {SEED}: {ev.request_id} (fault {fault}): {kind}, expected {sorted(wanted)}"
            )
        journal = ev.journal or {}
        destinations = journal.get("destinations") or {}
        first = (journal.get("attempts") or [{}])[0]
        if destinations.get("source") not in ("picker", "picker+gateway") or (
            first.get("chosen_by"),
            first.get("replica"),
        ) != ("picker choice #1", destinations.get("picker", [None])[0]):
            problems.append(
                f"{ev.request_id}: not placed by the picker: {destinations}, first attempt {first}"
            )
    print(f"seed {SEED}: {dict(collections.Counter(kinds))}")
    assert not problems, "\n".join(problems)
    assert _max_in_flight(evidence) >= STREAMS // 2, "the streams did not overlap: the burst proves nothing"


# --- the picker down ------------------------------------------------------------------------------------


def test_the_picker_down_fails_closed_with_our_json_error_and_is_followed_again_once_back(
    gateway: Gateway, sims: dict[str, Sim], picker: PickerProcess
) -> None:
    picker.stop()
    try:
        for path, body in (("/v1/chat/completions", chat()), ("/v1/messages", messages())):
            result = post(gateway.url + path, body)
            error = check_error_document(result, 503, "endpoint_picker_unavailable", path)
            assert error["message"].startswith(
                "the endpoint picker could not be asked (ext_proc_error_gRPC_error_"
            )
            unseen_by_replicas(sims, result.request_id)
            journal = rejected(gateway, result.request_id)
            assert (journal["outcome"], journal["attempt"]) == ("endpoint_picker_unavailable", 0)
            [event] = journal["events"]
            assert event["reason"].startswith(
                "the endpoint picker could not be asked (ext_proc_error_gRPC_error_"
            )
        # The gateway's own answers never ask the picker: still live, ready, its journal readable (above).
        for probe in ("/livez", "/readyz"):
            assert httpx.get(gateway.url + probe, timeout=5).status_code == 200, probe
    finally:
        picker.start()
    chosen = sims["c"].endpoint

    def steered() -> Any:
        result = post(f"{gateway.url}/v1/chat/completions", chat(max_tokens=4), headers={SELECT: chosen})
        return result if result.status == 200 else None

    result = poll(steered, timeout=15, what="a request steered by the picker once it is back")
    complete(result, 4)
    assert finished(gateway, result.request_id)["destinations"]["picker"] == [chosen]
    assert served_on(sims, result.request_id, 1) == [chosen]


@pytest.fixture(scope="module")
def open_picker(sims: dict[str, Sim], tmp_path_factory: pytest.TempPathFactory) -> Iterator[PickerProcess]:
    work = tmp_path_factory.mktemp("open-picker")
    process = PickerProcess(work, [s.endpoint for s in sims.values()], extra=("--log-header", TAG))
    try:
        yield process
    finally:
        process.stop()


@pytest.fixture(scope="module")
def open_gateway(
    etcd: str, sims: dict[str, Sim], open_picker: PickerProcess, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Gateway]:
    work: Path = tmp_path_factory.mktemp("open-gateway")
    gw = Gateway(
        replicas=[s.endpoint for s in sims.values()],
        etcd=etcd,
        work=work,
        extra_args=("--endpoint-picker", f"127.0.0.1:{open_picker.port}", "--endpoint-picker-fail-open"),
    )
    try:
        yield gw
    finally:
        gw.stop()


def picker_healthy(gateway: Gateway) -> bool | None:
    """Whether Envoy's health check finds the picker up (None: no verdict yet)."""
    for line in gateway.envoy_admin("/clusters").decode().splitlines():
        parts = line.split("::")
        if len(parts) == 4 and parts[0] == "endpoint_picker" and parts[2] == "health_flags":
            return parts[3] == "healthy"
    return None


def test_fail_open_serves_in_the_gateways_order_while_the_picker_is_down(
    open_gateway: Gateway, sims: dict[str, Sim], open_picker: PickerProcess
) -> None:
    """GAIE's epp_unavailable_fail_open through the gateway: with the picker stopped and found down by
    Envoy's health check, requests with a body are served in the gateway's own order (round robin over the
    replicas, journaled as such); once it is back and found up, they follow its list again."""
    chosen = sims["c"].endpoint
    result = post(f"{open_gateway.url}/v1/chat/completions", chat(max_tokens=4), headers={SELECT: chosen})
    complete(result, 4)
    assert finished(open_gateway, result.request_id)["destinations"]["source"] == "picker+gateway"
    open_picker.stop()
    try:
        poll(lambda: picker_healthy(open_gateway) is False, timeout=15, what="Envoy finds the picker down")
        served = []
        for _ in range(6):
            result = post(
                f"{open_gateway.url}/v1/chat/completions", chat(max_tokens=4), headers={SELECT: chosen}
            )
            complete(result, 4)
            journal = finished(open_gateway, result.request_id)
            destinations = journal["destinations"]
            assert destinations["source"] == "gateway" and not destinations.get("picker"), destinations
            [attempt] = journal["attempts"]
            assert attempt["chosen_by"] == "gateway choice #1"
            served.append(attempt["replica"])
        assert set(served) == {s.endpoint for s in sims.values()}, served  # its round robin, not the header
    finally:
        open_picker.start()
    poll(lambda: picker_healthy(open_gateway) is True, timeout=15, what="Envoy finds the picker up again")

    def steered() -> bool:
        result = post(f"{open_gateway.url}/v1/chat/completions", chat(max_tokens=4), headers={SELECT: chosen})
        complete(result, 4)
        return finished(open_gateway, result.request_id)["destinations"]["source"] == "picker+gateway"

    # Envoy's workers learn of the health change a moment after its admin page shows it (docs/envoy-facts.md).
    poll(steered, timeout=10, what="a request steered by the picker once it is back")
    for _ in range(3):
        result = post(f"{open_gateway.url}/v1/chat/completions", chat(max_tokens=4), headers={SELECT: chosen})
        complete(result, 4)
        journal = finished(open_gateway, result.request_id)
        assert journal["destinations"]["picker"] == [chosen]
        assert served_on(sims, result.request_id, 1) == [chosen]
