"""`router-testbed epp` behind real Envoy 1.40: the picker's ext_proc filter, the router, and a cluster whose
`override_host` load-balancing policy takes the picker's list (docs/endpoint-picker.md).

What GAIE's conformance suite intends, here on loopback: the request goes where the picker said
(`gateway_following_epp_routing`), the picker learns which endpoint served
(`gateway_destination_endpoint_served`) and a picker that is down leaves requests flowing in fail-open
(`epp_unavailable_fail_open`), refused in fail-closed. Beyond it: the walk down the picker's list when a
replica dies before any byte, the picker's own 503/429, and bodies (130 KB up, 1 000 events down, trailers)
byte-exact through the picker's full-duplex filter. The replicas' own logs say who served; the picker's log
says what it picked and what it was told served.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.harness import ClientResult, Sim, chat, poll, post
from tests.integration.epp_helpers import (
    RESET_HEADER,
    EnvoyProcess,
    PickerProcess,
    RecordingReplica,
    raw_request,
    sse_events,
)

pytestmark = pytest.mark.integration

SELECT = "test-epp-endpoint-selection"
SERVED_HEADER = "x-conformance-test-served-endpoint"
FULL_DUPLEX = {"request_body_mode": "FULL_DUPLEX_STREAMED", "response_body_mode": "FULL_DUPLEX_STREAMED"}
EVENTS = sse_events(1000)
RESPONSE_TRAILERS = [("x-response-checksum", hashlib.sha256(EVENTS).hexdigest())]


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("epp")


@pytest.fixture(scope="module")
def replicas(work: Path) -> Iterator[dict[str, Sim]]:
    pool: dict[str, Sim] = {}
    try:
        for name in ("a", "b", "c"):
            pool[name] = Sim(name, work, prefill_delay=0.01, token_interval=0.001)
        yield pool
    finally:
        for sim in pool.values():
            sim.stop()


@pytest.fixture(autouse=True)
def _replicas_up(request: pytest.FixtureRequest) -> None:
    # A test may stop a replica on purpose; the next one starts with all of them up.
    if "replicas" in request.fixturenames:
        for sim in request.getfixturevalue("replicas").values():
            sim.ensure_running()


@pytest.fixture(scope="module")
def picker(work: Path, replicas: dict[str, Sim]) -> Iterator[PickerProcess]:
    process = PickerProcess(work, [s.endpoint for s in replicas.values()])
    try:
        yield process
    finally:
        process.stop()


@pytest.fixture(scope="module")
def envoy(work: Path, replicas: dict[str, Sim], picker: PickerProcess) -> Iterator[EnvoyProcess]:
    process = EnvoyProcess(
        work, "envoy", picker_port=picker.port, replica_ports=[s.port for s in replicas.values()]
    )
    try:
        yield process
    finally:
        process.stop()


def ask(
    envoy: EnvoyProcess, request_id: str, headers: dict[str, str] | None = None, **body: Any
) -> ClientResult:
    return post(
        f"{envoy.url}/v1/chat/completions",
        chat(**body),
        headers={"x-request-id": request_id, **(headers or {})},
    )


def complete(result: ClientResult) -> bool:
    data = result.data()
    return result.status == 200 and result.transport_error is None and bool(data) and data[-1] == "[DONE]"


def record(picker: PickerProcess, request_id: str) -> dict[str, Any]:
    """The picker's end record of the request (written when its ext_proc stream ends)."""
    return poll(lambda: picker.record_of(request_id), timeout=10, what=f"the picker's record of {request_id}")


def served_by(replicas: dict[str, Sim], request_id: str) -> list[str]:
    """The replicas whose own log has the request completed (a replica writes that record just after its
    last byte: waited for)."""

    def completed() -> list[str]:
        return [
            s.endpoint
            for s in replicas.values()
            if any(r["outcome"] == "completed" for r in s.requests_for(request_id))
        ]

    return poll(completed, timeout=10, what=f"a replica's record of {request_id} completed")


def ended(sim: Sim, request_id: str) -> dict[str, Any]:
    found = poll(
        lambda: sim.requests_for(request_id), timeout=10, what=f"{sim.name}'s end record of {request_id}"
    )
    return found[-1]


# gateway_following_epp_routing


def test_round_robin_lists_every_replica_and_the_first_one_serves(
    replicas: dict[str, Sim], picker: PickerProcess, envoy: EnvoyProcess
) -> None:
    ids = [f"round-robin-{i}" for i in range(3)]
    results = [ask(envoy, rid) for rid in ids]
    assert all(map(complete, results)), [r.status for r in results]
    records = [record(picker, rid) for rid in ids]
    lists = [r["picked"] for r in records]
    assert sorted(lists[0]) == sorted(s.endpoint for s in replicas.values())
    assert lists[1] == lists[0][1:] + lists[0][:1] and lists[2] == lists[1][1:] + lists[1][:1]
    for rid, result, rec in zip(ids, results, records, strict=True):
        first = rec["picked"][0]
        assert served_by(replicas, rid) == [first]
        assert (rec["served"], result.headers[SERVED_HEADER], rec["reason"]) == (first, first, "round_robin")
        # Held until the request body had ended, as the filter runs full duplex.
        assert rec["mode"] == FULL_DUPLEX and rec["t_request_end"] <= rec["t_picked"]


def test_the_selection_header_steers_every_request_into_its_list(
    replicas: dict[str, Sim], picker: PickerProcess, envoy: EnvoyProcess
) -> None:
    a, b, c = (replicas[n].endpoint for n in "abc")
    for name, sim in replicas.items():
        for i in range(2):
            rid = f"steer-{name}-{i}"
            assert complete(ask(envoy, rid, {SELECT: sim.endpoint}))
            assert record(picker, rid)["picked"] == [sim.endpoint]
            assert served_by(replicas, rid) == [sim.endpoint]
    for i in range(3):
        rid = f"steer-list-{i}"
        assert complete(ask(envoy, rid, {SELECT: f"{c},{a}"}))
        assert (record(picker, rid)["picked"], served_by(replicas, rid)) == ([c, a], [c])
    # A bare IP names every replica on it (all of them, on loopback), in the picker's own order.
    assert complete(ask(envoy, "steer-ip", {SELECT: "127.0.0.1"}))
    assert record(picker, "steer-ip")["picked"] == [a, b, c]


# The walk down the list before any byte.


def test_a_replica_reset_before_any_byte_hands_the_request_to_the_next_entry(
    replicas: dict[str, Sim], picker: PickerProcess, envoy: EnvoyProcess
) -> None:
    a, b = replicas["a"].endpoint, replicas["b"].endpoint
    result = ask(envoy, "reset-first", {SELECT: f"{a},{b}", "x-sim-fault": "reset@headers replica=a"})
    assert complete(result) and result.headers[SERVED_HEADER] == b
    assert ended(replicas["a"], "reset-first")["outcome"] == "fault:reset"
    assert ended(replicas["b"], "reset-first")["outcome"] == "completed"
    assert replicas["c"].started_for("reset-first") == 0
    rec = record(picker, "reset-first")
    assert (rec["picked"], rec["served"], rec["outcome"]) == ([a, b], b, "completed")


def test_a_stopped_replica_hands_the_request_to_the_next_entry(
    replicas: dict[str, Sim], picker: PickerProcess, envoy: EnvoyProcess
) -> None:
    a, c = replicas["a"].endpoint, replicas["c"].endpoint
    replicas["a"].stop()
    result = ask(envoy, "stopped-first", {SELECT: f"{a},{c}"})
    assert complete(result)
    assert served_by(replicas, "stopped-first") == [c] and replicas["b"].started_for("stopped-first") == 0
    assert (record(picker, "stopped-first")["served"], result.headers[SERVED_HEADER]) == (c, c)


# gateway_destination_endpoint_served


def test_the_served_report_reaches_the_picker(
    replicas: dict[str, Sim], picker: PickerProcess, envoy: EnvoyProcess
) -> None:
    for name, sim in replicas.items():
        rid = f"served-{name}"
        result = ask(envoy, rid, {SELECT: sim.endpoint})
        assert complete(result) and result.headers[SERVED_HEADER] == sim.endpoint
        rec = record(picker, rid)
        assert rec["served"] == sim.endpoint and rec["served_header"] is None
        assert rec["response_metadata"] == {
            "envoy.lb": {
                "x-gateway-destination-endpoint": sim.endpoint,
                "x-gateway-destination-endpoint-served": sim.endpoint,
            }
        }


def test_without_selected_host_key_no_served_report_reaches_the_picker(
    work: Path, replicas: dict[str, Sim], picker: PickerProcess
) -> None:
    envoy = EnvoyProcess(
        work,
        "envoy-no-selected-key",
        picker_port=picker.port,
        replica_ports=[s.port for s in replicas.values()],
        selected_host_key=False,
    )
    try:
        b = replicas["b"].endpoint
        result = ask(envoy, "no-served-report", {SELECT: b})
    finally:
        envoy.stop()
    assert complete(result) and SERVED_HEADER not in result.headers
    assert served_by(replicas, "no-served-report") == [b]
    rec = record(picker, "no-served-report")
    assert rec["served"] is None
    assert rec["response_metadata"] == {"envoy.lb": {"x-gateway-destination-endpoint": b}}


# The picker's own answers.


def test_the_pickers_503_and_429_reach_the_client(
    replicas: dict[str, Sim], picker: PickerProcess, envoy: EnvoyProcess
) -> None:
    cases = [
        ("answer-503", {"test-epp-answer": "503"}, 503, "no ready endpoint"),
        ("answer-429", {"test-epp-answer": "429"}, 429, "request shed"),
        ("answer-none-listed", {SELECT: "127.0.0.1:1"}, 503, "no ready endpoint"),
    ]
    for rid, headers, status, message in cases:
        result = ask(envoy, rid, headers)
        assert result.status == status
        error = {"message": message, "type": "endpoint_picker", "code": status}
        assert result.body == json.dumps({"error": error}, separators=(",", ":")).encode()
        rec = record(picker, rid)
        assert (rec["picked"], rec["answer"], rec["outcome"]) == (None, status, "answered")
        assert not any(s.started_for(rid) for s in replicas.values())


# Bodies through the picker's full-duplex filter.


def test_a_1000_event_stream_from_a_replica_passes_through_unchanged(
    replicas: dict[str, Sim], picker: PickerProcess, envoy: EnvoyProcess
) -> None:
    result = ask(envoy, "thousand", {SELECT: replicas["c"].endpoint}, max_tokens=1000)
    assert complete(result) and len(result.content_chunks()) == 1000
    assert ended(replicas["c"], "thousand")["outcome"] == "completed"
    rec = record(picker, "thousand")
    assert rec["response_body_bytes"] == len(result.body)
    assert rec["response_body_sha256"] == hashlib.sha256(result.body).hexdigest()


@pytest.fixture(scope="module")
def recorders() -> Iterator[dict[str, RecordingReplica]]:
    pool = {name: RecordingReplica(name, EVENTS, RESPONSE_TRAILERS) for name in ("r1", "r2")}
    try:
        yield pool
    finally:
        for replica in pool.values():
            replica.stop()


@pytest.fixture(scope="module")
def recording_picker(work: Path, recorders: dict[str, RecordingReplica]) -> Iterator[PickerProcess]:
    process = PickerProcess(work, [r.endpoint for r in recorders.values()])
    try:
        yield process
    finally:
        process.stop()


@pytest.fixture(scope="module")
def recording_envoy(
    work: Path, recorders: dict[str, RecordingReplica], recording_picker: PickerProcess
) -> Iterator[EnvoyProcess]:
    process = EnvoyProcess(
        work,
        "envoy-recording",
        picker_port=recording_picker.port,
        replica_ports=[r.port for r in recorders.values()],
    )
    try:
        yield process
    finally:
        process.stop()


def request_body(size: int = 130 * 1024) -> bytes:
    """A well-formed chat request of exactly `size` bytes (its content padded), non-ASCII text included."""
    prefix = b'{"model":"tiny","stream":true,"messages":[{"role":"user","content":"'
    suffix = b'"}]}'
    words = " ".join(f"mot{i}-\u00fcn\u00efcode-{i * 7919 % 1000}" for i in range(size // 8)).encode()
    fill = words[: size - len(prefix) - len(suffix)].decode("utf-8", "ignore").encode()
    fill += b" " * (size - len(prefix) - len(suffix) - len(fill))
    return prefix + fill + suffix


def test_a_130_kb_request_and_1000_events_pass_byte_exact(
    recorders: dict[str, RecordingReplica], recording_picker: PickerProcess, recording_envoy: EnvoyProcess
) -> None:
    body = request_body()
    assert len(body) == 130 * 1024 and json.loads(body)["messages"]
    r1 = recorders["r1"]
    answer = raw_request(
        recording_envoy.port, "/v1/chat/completions", [("x-request-id", "bytes"), (SELECT, r1.endpoint)], body
    )
    assert answer.start_line == "HTTP/1.1 200 OK"
    assert answer.body == EVENTS and answer.trailers == RESPONSE_TRAILERS
    (got,) = r1.received("bytes")
    assert got.body == body and got.trailers == []
    # The picker's header went upstream with the request.
    assert got.header("x-gateway-destination-endpoint") == r1.endpoint
    assert recorders["r2"].received("bytes") == []
    rec = record(recording_picker, "bytes")
    assert (rec["request_body_bytes"], rec["request_body_sha256"]) == (
        len(body),
        hashlib.sha256(body).hexdigest(),
    )
    assert (rec["response_body_bytes"], rec["response_body_sha256"]) == (
        len(EVENTS),
        hashlib.sha256(EVENTS).hexdigest(),
    )
    assert rec["response_trailers"] == dict(RESPONSE_TRAILERS) and rec["request_trailers"] is None
    assert rec["served"] == r1.endpoint and rec["t_request_end"] <= rec["t_picked"]


def test_a_body_retried_after_a_reset_reaches_the_next_entry_whole(
    recorders: dict[str, RecordingReplica], recording_picker: PickerProcess, recording_envoy: EnvoyProcess
) -> None:
    body = request_body()
    r1, r2 = recorders["r1"], recorders["r2"]
    headers = [
        ("x-request-id", "bytes-retried"),
        (SELECT, f"{r1.endpoint},{r2.endpoint}"),
        (RESET_HEADER, "r1"),
    ]
    answer = raw_request(recording_envoy.port, "/v1/chat/completions", headers, body)
    assert answer.start_line == "HTTP/1.1 200 OK" and answer.body == EVENTS
    assert [r.body == body for r in r1.received("bytes-retried")] == [True]  # read whole, then reset
    assert [r.body == body for r in r2.received("bytes-retried")] == [True]
    assert record(recording_picker, "bytes-retried")["served"] == r2.endpoint


TRAILERS = [("x-request-checksum", "sha256-of-the-body"), ("x-request-note", "last")]


def test_request_trailers_pass_byte_exact_on_a_route_without_retries(
    work: Path, recorders: dict[str, RecordingReplica], recording_picker: PickerProcess
) -> None:
    envoy = EnvoyProcess(
        work,
        "envoy-no-retries",
        picker_port=recording_picker.port,
        replica_ports=[r.port for r in recorders.values()],
        num_retries=None,
    )
    body = request_body()
    r2 = recorders["r2"]
    try:
        headers = [("x-request-id", "trailers"), (SELECT, r2.endpoint)]
        answer = raw_request(envoy.port, "/v1/chat/completions", headers, body, trailers=TRAILERS)
    finally:
        envoy.stop()
    assert (
        answer.start_line == "HTTP/1.1 200 OK"
        and answer.body == EVENTS
        and answer.trailers == RESPONSE_TRAILERS
    )
    (got,) = r2.received("trailers")
    assert got.body == body and got.trailers == TRAILERS
    rec = record(recording_picker, "trailers")
    assert (
        rec["request_trailers"] == dict(TRAILERS)
        and rec["request_body_sha256"] == hashlib.sha256(body).hexdigest()
    )
    assert rec["t_request_end"] <= rec["t_picked"]


def test_request_trailers_on_a_route_with_retries_double_the_body_in_envoy_1_40(
    recorders: dict[str, RecordingReplica], recording_picker: PickerProcess, recording_envoy: EnvoyProcess
) -> None:
    """Envoy 1.40's bug (envoyproxy/envoy#45470, fix proposed in #46095): with the request body in
    FULL_DUPLEX_STREAMED, request trailers and any retry policy on the route, the body the picker streamed
    back reaches the upstream twice (the router's retry buffer is replayed when the trailers answer resumes
    the filter chain). The picker saw and returned it once. When this test fails, Envoy has fixed it: update
    docs/envoy-facts.md#envoy-140-behind-an-endpoint-picker and turn this into the byte-exact check."""
    body = request_body()
    r1 = recorders["r1"]
    headers = [("x-request-id", "trailers-doubled"), (SELECT, r1.endpoint)]
    answer = raw_request(recording_envoy.port, "/v1/chat/completions", headers, body, trailers=TRAILERS)
    assert answer.start_line == "HTTP/1.1 200 OK" and answer.body == EVENTS
    (got,) = r1.received("trailers-doubled")
    assert got.body == body + body and got.trailers == TRAILERS
    rec = record(recording_picker, "trailers-doubled")
    assert rec["request_body_bytes"] == len(body) and rec["request_trailers"] == dict(TRAILERS)


# Over TLS, as GAIE's and llm-d's pickers serve by default


def test_a_picker_serving_tls_with_a_self_signed_certificate(work: Path, replicas: dict[str, Sim]) -> None:
    picker = PickerProcess(work, [s.endpoint for s in replicas.values()], extra=["--tls"])
    envoy = None
    try:
        assert b" tls endpoints " in picker.out_path.read_bytes()
        envoy = EnvoyProcess(
            work,
            "envoy-tls",
            picker_port=picker.port,
            replica_ports=[s.port for s in replicas.values()],
            picker_tls={"alpn_protocols": ["h2"]},  # nothing verified
            picker_health_check=True,
        )
        assert envoy.picker_healthy() is True  # the gRPC health check passed over TLS
        b = replicas["b"].endpoint
        result = ask(envoy, "over-tls", {SELECT: b})
        assert complete(result) and result.headers[SERVED_HEADER] == b
        assert served_by(replicas, "over-tls") == [b] and record(picker, "over-tls")["served"] == b
    finally:
        if envoy is not None:
            envoy.stop()
        picker.stop()


# epp_unavailable_fail_open, and fail-closed


@pytest.fixture
def lone_picker(work: Path, replicas: dict[str, Sim]) -> Iterator[PickerProcess]:
    """A picker of the test's own, that the test stops."""
    process = PickerProcess(work, [s.endpoint for s in replicas.values()])
    try:
        yield process
    finally:
        process.stop()


def steered_while_up(envoy: EnvoyProcess, picker: PickerProcess, replicas: dict[str, Sim], rid: str) -> None:
    c = replicas["c"].endpoint
    assert complete(ask(envoy, rid, {SELECT: c}))
    assert served_by(replicas, rid) == [c] and record(picker, rid)["served"] == c


def steered_again(envoy: EnvoyProcess, picker: PickerProcess, replicas: dict[str, Sim], prefix: str) -> None:
    """After the picker's restart, requests are steered by it again. Not necessarily the first one: Envoy's
    workers learn the picker's health from its main thread a moment after the admin page shows it."""
    c = replicas["c"].endpoint
    attempt = iter(range(50))

    def steered() -> str | None:
        rid = f"{prefix}-{next(attempt)}"
        result = ask(envoy, rid, {SELECT: c})
        return rid if complete(result) and result.headers.get(SERVED_HEADER) == c else None

    rid = poll(steered, timeout=10, what="a request steered by the restarted picker")
    assert served_by(replicas, rid) == [c] and record(picker, rid)["served"] == c


def test_the_picker_down_fail_closed(
    work: Path, replicas: dict[str, Sim], lone_picker: PickerProcess
) -> None:
    """`failure_mode_allow: false`: without its picker Envoy answers 500 itself, no replica is asked."""
    envoy = EnvoyProcess(
        work,
        "envoy-fail-closed",
        picker_port=lone_picker.port,
        replica_ports=[s.port for s in replicas.values()],
    )
    try:
        steered_while_up(envoy, lone_picker, replicas, "closed-up")
        lone_picker.stop()
        ids = [f"closed-down-{i}" for i in range(3)]
        results = [ask(envoy, rid, {SELECT: replicas["c"].endpoint}) for rid in ids]
        assert [(r.status, r.body) for r in results] == [(500, b"")] * 3
        assert not any(s.started_for(rid) for s in replicas.values() for rid in ids)
        lone_picker.start()
        steered_again(envoy, lone_picker, replicas, "closed-back")
    finally:
        envoy.stop()


@pytest.mark.parametrize(
    ("request_body_mode", "picker_health_check"),
    [("FULL_DUPLEX_STREAMED", True), ("BUFFERED", False)],
    ids=["full-duplex-health-checked", "buffered"],
)
def test_the_picker_down_fail_open(
    work: Path,
    replicas: dict[str, Sim],
    lone_picker: PickerProcess,
    request_body_mode: str,
    picker_health_check: bool,
) -> None:
    """`failure_mode_allow: true`: without its picker Envoy sends the request on, and the override_host
    policy, finding no list, falls back to its round robin. Requests with a body fail open this way only
    when Envoy learns the picker is gone before the body reaches the filter: with the request body BUFFERED,
    or in FULL_DUPLEX_STREAMED once its health check marked the picker down (see the next test)."""
    envoy = EnvoyProcess(
        work,
        f"envoy-fail-open-{request_body_mode.lower()}",
        picker_port=lone_picker.port,
        replica_ports=[s.port for s in replicas.values()],
        failure_mode_allow=True,
        request_body_mode=request_body_mode,
        picker_health_check=picker_health_check,
    )
    try:
        steered_while_up(envoy, lone_picker, replicas, f"open-{request_body_mode}-up")
        lone_picker.stop()
        if picker_health_check:
            poll(lambda: envoy.picker_healthy() is False, timeout=10, what="Envoy finds the picker down")
        ids = [f"open-{request_body_mode}-down-{i}" for i in range(6)]
        results = [ask(envoy, rid, {SELECT: replicas["c"].endpoint}) for rid in ids]
        assert all(map(complete, results)), [(r.status, r.body[:80]) for r in results]
        assert all(SERVED_HEADER not in r.headers for r in results)
        served = [served_by(replicas, rid) for rid in ids]
        assert all(len(s) == 1 for s in served), served
        assert len({s[0] for s in served}) > 1  # round robin, not the header's replica every time
        assert not any(lone_picker.record_of(rid) for rid in ids)
        lone_picker.start()
        steered_again(envoy, lone_picker, replicas, f"open-{request_body_mode}-back")
    finally:
        envoy.stop()


def test_full_duplex_fails_open_only_before_the_body_reaches_the_filter(
    work: Path, replicas: dict[str, Sim], lone_picker: PickerProcess
) -> None:
    """Envoy 1.40 fails open in FULL_DUPLEX_STREAMED only until the first body chunk went to the processor
    (envoyproxy/envoy#41276). With the picker simply gone (no health check), the refused connection is
    reported after the body of a POST usually reached the filter: that request gets Envoy's 500 (38 of 50
    here); a request without a body always goes on."""
    envoy = EnvoyProcess(
        work,
        "envoy-fail-open-unchecked",
        picker_port=lone_picker.port,
        replica_ports=[s.port for s in replicas.values()],
        failure_mode_allow=True,
    )
    try:
        lone_picker.stop()
        for _ in range(3):
            answer = httpx.get(f"{envoy.url}/v1/models", timeout=10)
            assert answer.status_code == 200 and answer.headers["x-sim-replica"] in replicas
        results = [ask(envoy, f"open-unchecked-{i}") for i in range(6)]
        assert all(complete(r) or (r.status, r.body) == (500, b"") for r in results)
    finally:
        envoy.stop()
