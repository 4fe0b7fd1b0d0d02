"""What the Responses/Messages contract tests and the SDK tests share: a fleet per simulator dialect (two
replicas and a gateway over real etcd), the request bodies, a request sent straight to a replica (what the
replica itself writes, to compare the client's bytes with), and the checks of one complete answer and of
our terminal event."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.api_streams import (
    ANTHROPIC_ERROR_TYPES,
    INTERRUPTED,
    PATHS,
    REPLICA_ERROR_MARKERS,
    Api,
    ApiStream,
    event_name,
    normalized,
)
from tests.harness import ClientResult, Gateway, Sim, poll
from tests.integration.first_delta_helpers import TERMINAL_PHASES
from tests.invariants import schema_errors, simulated_pieces

# (API, simulator dialect) pairs a contract holds on. SGLang 0.5.23's /v1/responses answers every request
# with a text/plain 500 in the simulator as in the engine without openai-harmony: its own tests below.
API_DIALECTS: list[tuple[Api, str]] = [("responses", "vllm"), ("messages", "vllm"), ("messages", "sglang")]
API_DIALECT_IDS = [f"{a}-{d}" for a, d in API_DIALECTS]


class Fleet:
    """Two simulated replicas of one dialect and a gateway in front of them."""

    def __init__(self, etcd: str, work: Path, dialect: str) -> None:
        self.dialect = dialect
        self.sims: dict[str, Sim] = {}
        self.gateway: Gateway | None = None
        try:
            for name in ("a", "b"):
                self.sims[name] = Sim(f"{dialect}-{name}", work, extra_args=("--dialect", dialect))
            self.gateway = Gateway(replicas=[s.endpoint for s in self.sims.values()], etcd=etcd, work=work)
        except BaseException:
            self.stop()
            raise

    @property
    def gw(self) -> Gateway:
        assert self.gateway is not None
        return self.gateway

    @property
    def url(self) -> str:
        return self.gw.url

    def ensure_running(self) -> None:
        restarted = [sim.ensure_running() for sim in self.sims.values()]
        self.gw.wait_replicas_healthy((s.endpoint for s in self.sims.values()), fresh=any(restarted))

    def sim_of(self, record: dict[str, Any]) -> Sim:
        """The replica that wrote a log record (started again if a fault killed it)."""
        sim = next(s for s in self.sims.values() if s.name == record["replica"])
        sim.ensure_running()
        return sim

    def replica_stream(
        self, record: dict[str, Any], api: Api, request: dict[str, Any], fault: str | None = None
    ) -> bytes:
        """What the replica that served `record` writes for this request, asked again directly."""
        return direct(self.sim_of(record), api, request, fault)

    def served(self, request_id: str) -> list[dict[str, Any]]:
        records = [r for sim in self.sims.values() for r in sim.requests_for(request_id)]
        return sorted(records, key=lambda r: r["t_start"])

    def attempts_logged(self, request_id: str, n: int) -> list[dict[str, Any]]:
        return poll(
            lambda: (a := self.served(request_id)) and len(a) == n and a,
            what=f"{n} attempt(s) of {request_id} in the replica logs",
        )

    def finished(self, request_id: str) -> dict[str, Any]:
        return self.gw.wait_journal(request_id, lambda j: j["phase"] in TERMINAL_PHASES)

    def stop(self) -> None:
        if self.gateway is not None:
            self.gateway.stop()
        for sim in self.sims.values():
            sim.stop()


class Fleets:
    """One fleet per dialect, started when a test first asks for it, stopped with the module."""

    def __init__(self, etcd: str, factory: pytest.TempPathFactory) -> None:
        self.etcd = etcd
        self.factory = factory
        self.started: dict[str, Fleet] = {}

    def __getitem__(self, dialect: str) -> Fleet:
        if dialect not in self.started:
            self.started[dialect] = Fleet(self.etcd, self.factory.mktemp(f"fleet-{dialect}"), dialect)
        fleet = self.started[dialect]
        fleet.ensure_running()
        return fleet

    def stop(self) -> None:
        for fleet in self.started.values():
            fleet.stop()


def fleets_fixture(etcd: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleets]:
    fleets = Fleets(etcd, tmp_path_factory)
    try:
        yield fleets
    finally:
        fleets.stop()


# --- requests -----------------------------------------------------------------------------------------------


def body(
    api: Api, n: int, *, stream: bool = True, prompt: str = "hello there", **extra: Any
) -> dict[str, Any]:
    if api == "responses":
        return {"model": "tiny", "input": prompt, "max_output_tokens": n, "stream": stream, **extra}
    if api == "messages":
        messages = [{"role": "user", "content": prompt}]
        return {"model": "tiny", "max_tokens": n, "messages": messages, "stream": stream, **extra}
    raise ValueError(api)


def tool_body(api: Api, n: int, **extra: Any) -> dict[str, Any]:
    """A request whose answer is a call of the one tool it declares (forced by tool_choice)."""
    if api == "responses":
        tool = {"type": "function", "name": "get_weather", "parameters": {"type": "object"}}
        return body(api, n, tools=[tool], tool_choice="required", **extra)
    tool = {"name": "get_weather", "input_schema": {"type": "object"}}
    return body(api, n, tools=[tool], tool_choice={"type": "any"}, **extra)


def expected_text(api: Api, request: dict[str, Any], n: int | None = None) -> str:
    """The text a simulated replica generates for the request (its first n content events)."""
    pieces = simulated_pieces(api, request)
    return "".join(pieces[:n])


def direct(sim: Sim, api: Api, request: dict[str, Any], fault: str | None = None) -> bytes:
    """What the replica itself writes for this request (the entity body, up to a cut), asked without the
    gateway under an id of its own (its log keeps the test's records apart)."""
    headers = {"x-request-id": f"direct-{uuid.uuid4().hex[:12]}"}
    if fault:
        headers["x-sim-fault"] = fault
    raw = b""
    with httpx.Client(timeout=10) as client:
        try:
            url = f"http://{sim.endpoint}{PATHS[api]}"
            with client.stream("POST", url, json=request, headers=headers) as response:
                for chunk in response.iter_raw():
                    raw += chunk
        except (httpx.RemoteProtocolError, httpx.ReadError):
            pass
    return raw


def events_bytes(stream: ApiStream) -> list[bytes]:
    return [normalized(e.raw) for e in stream.events]


def stream_of(api: Api, result: ClientResult) -> ApiStream:
    return ApiStream.read(api, result.body)


# --- checks -------------------------------------------------------------------------------------------------


def assert_well_formed(stream: ApiStream) -> None:
    """Every event is one `event:` line naming its data's type and one `data:` line of JSON."""
    bad = [e.raw[:200] for e in stream.events if not e.well_formed]
    assert not bad, f"events that are not one named JSON event: {bad}"
    assert not stream.torn, "the stream ended inside an event"


def assert_one_complete_answer(
    fleet: Fleet, api: Api, request: dict[str, Any], result: ClientResult, winner: dict[str, Any]
) -> ApiStream:
    """The client got exactly one complete answer, the winning attempt's (its replica's log record
    `winner`): one opening, one id (the winner's), sequence numbers gapless from 0, every content event of
    the generation, the clean end, and byte for byte what that replica writes for the request."""
    assert result.status == 200, (result.status, result.body[:600])
    assert result.transport_error is None, result.transport_error
    assert result.headers["content-type"].startswith("text/event-stream"), result.headers
    stream = stream_of(api, result)
    assert_well_formed(stream)
    n = request["max_output_tokens" if api == "responses" else "max_tokens"]
    names = stream.names
    if api == "responses":
        assert names[0] == "response.created" and stream.preambles == 1, names
        assert names[-1] == "response.completed" and stream.clean_ends == 1, names
        assert stream.sequence_numbers() == list(range(len(stream.events))), stream.sequence_numbers()
        assert not stream.terminal_events()
    else:
        assert names[0] == "message_start" and stream.preambles == 1, names
        assert names[-1] == "message_stop" and stream.clean_ends == 1, names
        assert "error" not in names
    assert set(stream.response_ids()) == {winner["response_id"]}, (stream.response_ids(), winner)
    assert len(stream.content) == n and stream.text == expected_text(api, request)
    assert stream.usage_output_tokens() == n
    assert len(stream.events) == winner["events_written"], (len(stream.events), winner)
    # Byte for byte what the winning replica writes for this request (ids and times aside).
    want = fleet.replica_stream(winner, api, request)
    assert normalized(result.body) == normalized(want), "the client's bytes are not the replica's"
    return stream


def assert_terminal_event(
    api: Api,
    stream: ApiStream,
    request_id: str,
    delivered: int,
    message: str,
) -> dict[str, Any]:
    """The stream's last event is our one terminal event, exactly, in the client's API; returns its data."""
    last = stream.events[-1]
    assert last.well_formed, last.raw[:300]
    assert [event_name(e) for e in stream.terminal_events()] == [event_name(last)], stream.names
    data = last.data
    if api == "responses":
        created = stream.events[0].data["response"]
        assert last.raw.startswith(b"event: response.failed\ndata: {"), last.raw[:100]
        assert data == {
            "type": "response.failed",
            "sequence_number": stream.events[-2].data["sequence_number"] + 1,
            "response": {
                "id": created["id"],
                "object": "response",
                "created_at": created["created_at"],
                "model": created["model"],
                "status": "failed",
                "error": {
                    "code": INTERRUPTED,
                    "message": message,
                    "request_id": request_id,
                    "partial_output": True,
                    "delivered_output_tokens": delivered,
                    "retryable": False,
                },
            },
        }
        assert stream.sequence_numbers() == list(range(len(stream.events)))
        assert stream.clean_ends == 0
        assert not schema_errors("responses-failed-event", data)
    else:
        assert last.raw.startswith(b"event: error\ndata: {"), last.raw[:100]
        error = data["error"]
        assert data["type"] == "error" and data["request_id"] == request_id, data
        assert {k: error[k] for k in error if k != "attempts"} == {
            "type": "api_error",
            "message": message,
            "code": INTERRUPTED,
            "details": {"error_code": INTERRUPTED},
            "request_id": request_id,
            "partial_output": True,
            "delivered_output_tokens": delivered,
            "retryable": False,
        }
        assert error.get("attempts", []) == [], error
        assert stream.clean_ends == 0, "a message_stop around our error event"
        assert not schema_errors("messages-error", data)
    for marker in REPLICA_ERROR_MARKERS:
        assert marker not in b"".join(e.raw for e in stream.events), (
            f"a replica's error reached the client: {marker}"
        )
    return data


def assert_error_body(
    api: Api, response_status: int, headers: dict[str, str], raw: bytes, code: str, *, schema: bool = True
) -> dict[str, Any]:
    """One HTTP error in the API's own shape naming the request and why, nothing of a replica's. `schema`:
    it is one of the published records (the errors after admission; docs/records.md: admission errors
    have the API's shape plus `request_id`, no schema yet)."""
    assert headers["content-type"] == "application/json", headers
    assert b"data:" not in raw and b"event:" not in raw, raw[:300]
    for marker in REPLICA_ERROR_MARKERS:
        assert marker not in raw, raw[:300]
    answer = json.loads(raw)
    request_id = headers["x-request-id"]
    if api == "messages":
        assert answer.get("type") == "error" and answer.get("request_id") == request_id, answer
        error = answer["error"]
        assert error.get("details") == {"error_code": code}, error
        assert error.get("type") in ANTHROPIC_ERROR_TYPES, error
        assert not schema or not schema_errors("messages-error", answer)
    else:
        assert set(answer) == {"error"}, answer
        error = answer["error"]
        assert not schema or not schema_errors("gateway-error", answer)
    assert error["code"] == code and error["request_id"] == request_id and error["message"], error
    assert not schema or error["partial_output"] is False
    return error
