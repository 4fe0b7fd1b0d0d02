"""The simulator's Responses and Messages routes as a real process on loopback: the stream on the wire (one
SSE event per HTTP chunk, the chunked terminator or its absence, FIN or RST), every fault point, the request
log, and the Responses store (GET, resume, background, cancel)."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from router_testbed.sim.process import SimProcess, spawn
from tests.integration.test_sim_server import (
    IO_TIMEOUT,
    RawClient,
    end_record,
    parse_chunked,
    raw_request,
    rid,
    run_raw,
    split_response,
)

pytestmark = pytest.mark.integration

RESPONSES = "/v1/responses"
MESSAGES = "/v1/messages"
DELTA = "response.output_text.delta"
RESP_PREAMBLE = ["response.created", "response.in_progress"]
RESP_ITEM = ["response.output_item.added", "response.content_part.added"]
RESP_DONE = ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
TOOL = {
    "type": "function",
    "name": "get_weather",
    "parameters": {"type": "object", "properties": {"city": {}}},
}


def resp_body(n: int = 4, stream: bool = True, **extra: Any) -> dict[str, Any]:
    return {"model": "tiny", "input": "hello there", "max_output_tokens": n, "stream": stream, **extra}


def msg_body(n: int = 4, stream: bool = True, **extra: Any) -> dict[str, Any]:
    body = {
        "model": "tiny",
        "max_tokens": n,
        "messages": [{"role": "user", "content": "hello"}],
        "stream": stream,
    }
    return {**body, **extra}


@pytest.fixture(scope="module")
def api_sims(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, SimProcess]]:
    work = tmp_path_factory.mktemp("sim-apis")
    started: dict[str, SimProcess] = {}
    try:
        started["plain"] = spawn(name="r1", log_path=work / "r1.jsonl")
        started["store"] = spawn(name="r2", log_path=work / "r2.jsonl", args=["--responses-store"])
        started["sglang"] = spawn(name="s1", log_path=work / "s1.jsonl", dialect="sglang")
        yield started
    finally:
        for proc in started.values():
            proc.stop()


@pytest.fixture
def sim(api_sims: dict[str, SimProcess]) -> SimProcess:
    return api_sims["plain"]


def events_of(raw: bytes) -> tuple[int, list[tuple[str, Any]], bool, dict[str, str]]:
    """Status, ``(event name, data)`` per chunk (each chunk exactly one named event), terminator seen,
    headers."""
    status, headers, body = split_response(raw)
    assert headers["transfer-encoding"] == "chunked"
    chunks, terminated = parse_chunked(body)
    out = []
    for c in chunks:
        assert c.endswith(b"\n\n") and c.count(b"\n\n") == 1, f"chunk is not one event: {c[:200]!r}"
        head, data = c[:-2].split(b"\n", 1)
        assert head.startswith(b"event: ") and data.startswith(b"data: ")
        out.append((head[7:].decode(), json.loads(data[6:])))
    return status, out, terminated, headers


def names(events: list[tuple[str, Any]]) -> list[str]:
    return [n for n, _ in events]


def fault(spec: str, r: str) -> dict[str, str]:
    return {"x-sim-fault": spec, "x-request-id": r}


# --------------------------------------------------------------------------- Responses: clean and faults


def test_responses_clean_stream_and_its_log(sim: SimProcess) -> None:
    r = rid()
    raw, err = run_raw(sim.port, RESPONSES, resp_body(3), {"x-request-id": r, "x-attempt-id": "a1"})
    assert err is None
    status, events, terminated, headers = events_of(raw)
    assert status == 200 and terminated and headers["content-type"] == "text/event-stream; charset=utf-8"
    assert names(events) == [
        *RESP_PREAMBLE,
        *RESP_ITEM,
        DELTA,
        DELTA,
        DELTA,
        *RESP_DONE,
        "response.completed",
    ]
    assert [d["sequence_number"] for _, d in events] == list(range(len(events)))
    response_id = events[0][1]["response"]["id"]
    assert re.fullmatch(r"resp_[0-9a-f]{16}", response_id)
    rec = end_record(sim, r)
    assert rec["api"] == "responses" and rec["path"] == RESPONSES and rec["method"] == "POST"
    assert rec["response_id"] == response_id and rec["outcome"] == "completed" and rec["stream"] is True
    assert rec["content_events_written"] == 3 and rec["events_written"] == len(events)
    assert rec["store"] is False and rec["background"] is False  # the store is off on this replica


def test_each_replica_and_request_numbers_from_zero_with_its_own_id(api_sims: dict[str, SimProcess]) -> None:
    ids = []
    for proc in (api_sims["plain"], api_sims["store"], api_sims["plain"]):
        raw, _ = run_raw(proc.port, RESPONSES, resp_body(2), {"x-request-id": "same"})
        _, events, terminated, _ = events_of(raw)
        assert terminated and events[0][1]["sequence_number"] == 0
        ids.append(events[0][1]["response"]["id"])
    assert len(set(ids)) == 3


@pytest.mark.parametrize(
    ("spec", "expected", "content"),
    [
        ("reset@headers", [], 0),
        ("reset@role", RESP_PREAMBLE, 0),
        ("reset@token:1", RESP_PREAMBLE, 0),
        ("reset@after:2", [*RESP_PREAMBLE, *RESP_ITEM, DELTA, DELTA], 2),
    ],
)
def test_responses_reset_is_an_rst_without_the_last_chunk(
    sim: SimProcess, spec: str, expected: list[str], content: int
) -> None:
    r = rid()
    raw, err = run_raw(sim.port, RESPONSES, resp_body(5), fault(spec, r))
    assert isinstance(err, ConnectionResetError)
    if expected:
        _, events, terminated, _ = events_of(raw)
        assert names(events) == expected and not terminated
    else:
        assert raw == b""
    rec = end_record(sim, r)
    assert rec["outcome"] == "fault:reset" and rec["content_events_written"] == content


def test_responses_in_band_failure_stops_without_a_terminal_event_or_last_chunk(sim: SimProcess) -> None:
    # responses_engine_dead_midstream.sse: no error event, no response.completed, no 0\r\n\r\n; a FIN
    r = rid()
    raw, err = run_raw(sim.port, RESPONSES, resp_body(5), fault("error@after:2", r))
    assert err is None
    _, events, terminated, _ = events_of(raw)
    assert names(events) == [*RESP_PREAMBLE, *RESP_ITEM, DELTA, DELTA] and not terminated
    assert end_record(sim, r)["outcome"] == "fault:error"


def test_responses_error_before_the_stream_and_without_one(sim: SimProcess) -> None:
    for spec, body in (("error@headers", resp_body(3)), ("error@token:2", resp_body(3, stream=False))):
        resp = httpx.post(
            f"{sim.url}{RESPONSES}", json=body, headers={"x-sim-fault": spec}, timeout=IO_TIMEOUT
        )
        assert resp.status_code == 500 and resp.json()["error"]["type"] == "InternalServerError"


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("close@role", RESP_PREAMBLE),
        ("close@done", [*RESP_PREAMBLE, *RESP_ITEM, DELTA, DELTA]),
        ("close@terminal", [*RESP_PREAMBLE, *RESP_ITEM, DELTA, DELTA, *RESP_DONE]),
    ],
)
def test_responses_clean_end_without_the_terminal_event(
    sim: SimProcess, spec: str, expected: list[str]
) -> None:
    r = rid()
    raw, err = run_raw(sim.port, RESPONSES, resp_body(2), fault(spec, r))
    assert err is None
    _, events, terminated, _ = events_of(raw)
    assert terminated and names(events) == expected
    assert end_record(sim, r)["outcome"] == "fault:close"


def test_responses_stall_then_the_client_leaves(sim: SimProcess) -> None:
    r = rid()
    with RawClient(sim.port) as client:
        client.send(raw_request(RESPONSES, resp_body(5), fault("stall@after:1", r)))
        client.read_until(lambda b: b.count(b"event: response.output_text.delta") >= 1)
        closed_at = time.time()
    rec = end_record(sim, r)
    assert rec["outcome"] == "fault:stall" and rec["content_events_written"] == 1
    assert rec["client_gone_at"] is not None and rec["client_gone_at"] >= closed_at - 0.05


def test_responses_oversized_event(sim: SimProcess) -> None:
    r = rid()
    raw, err = run_raw(sim.port, RESPONSES, resp_body(3), fault("oversize@token:2 bytes=300000", r))
    assert err is None
    _, _, body = split_response(raw)
    chunks, terminated = parse_chunked(body)
    assert terminated
    deltas = [c for c in chunks if c.startswith(b"event: response.output_text.delta\n")]
    assert len(deltas[0]) < 1000 and len(deltas[1]) >= 300000 and len(deltas[2]) < 1000
    assert end_record(sim, r)["faults_fired"] == ["oversize@token:2"]


@pytest.mark.parametrize(("spec", "status"), [("status503@headers", 503), ("status429@headers", 429)])
def test_responses_5xx_and_429_before_the_stream(sim: SimProcess, spec: str, status: int) -> None:
    resp = httpx.post(
        f"{sim.url}{RESPONSES}", json=resp_body(2), headers={"x-sim-fault": spec}, timeout=IO_TIMEOUT
    )
    assert resp.status_code == status
    error = resp.json()["error"]
    assert error["code"] == status and set(error) == {"message", "type", "param", "code"}


@pytest.mark.parametrize(
    ("spec", "tokens", "status"), [("stop@token:3", 3, "completed"), ("abort@after:2", 3, "completed")]
)
def test_responses_finish_variants(sim: SimProcess, spec: str, tokens: int, status: str) -> None:
    raw, err = run_raw(sim.port, RESPONSES, resp_body(6), fault(spec, rid()))
    assert err is None
    _, events, terminated, _ = events_of(raw)
    assert terminated and names(events)[-1] == "response.completed"
    final = events[-1][1]["response"]
    assert final["status"] == status and final["incomplete_details"] is None
    assert final["usage"]["output_tokens"] == tokens
    assert names(events).count(DELTA) == tokens


def test_responses_tool_call_stream(sim: SimProcess) -> None:
    body = resp_body(50, tools=[TOOL], tool_choice="required")
    raw, _ = run_raw(sim.port, RESPONSES, body, {})
    _, events, terminated, _ = events_of(raw)
    assert terminated
    seq = names(events)
    assert seq[2] == "response.output_item.added" and events[2][1]["item"]["type"] == "function_call"
    assert set(seq[3:-3]) == {"response.function_call_arguments.delta"}
    assert seq[-3:] == [
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    # the first content is the item that names the tool: reset before it leaves only the preamble
    raw, err = run_raw(sim.port, RESPONSES, body, {"x-sim-fault": "reset@token:1"})
    assert isinstance(err, ConnectionResetError) and names(events_of(raw)[1]) == RESP_PREAMBLE


def test_responses_nonstream_and_errors(sim: SimProcess) -> None:
    with httpx.Client(base_url=sim.url, timeout=IO_TIMEOUT) as client:
        ok = client.post(RESPONSES, json=resp_body(3, stream=False))
        assert ok.status_code == 200 and ok.json()["object"] == "response"
        assert ok.json()["usage"]["output_tokens"] == 3
        wrong = client.post(RESPONSES, json=resp_body(model="nope"))
        assert wrong.status_code == 404 and wrong.json()["error"]["type"] == "NotFoundError"
        bad = client.post(RESPONSES, content=b'{"model": "tiny", "input": [}')
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "body.28"
        prev = client.post(RESPONSES, json=resp_body(previous_response_id="resp_nope"))
        assert prev.status_code == 404 and prev.json()["error"]["param"] == "response_id"
        typo = client.post(RESPONSES, json=resp_body(), headers={"x-sim-fault": "oversize@role"})
        assert typo.status_code == 400 and "oversize@role" in typo.json()["error"]["message"]
    raw, err = run_raw(sim.port, RESPONSES, resp_body(5, stream=False), {"x-sim-fault": "reset@token:2"})
    assert isinstance(err, ConnectionResetError) and raw == b""


# --------------------------------------------------------------------------- Messages


MSG_TEXT = ["message_start", "content_block_start", "content_block_delta"]


def test_messages_clean_stream_and_its_log(sim: SimProcess) -> None:
    r = rid()
    raw, err = run_raw(sim.port, MESSAGES, msg_body(3), {"x-request-id": r})
    assert err is None
    status, events, terminated, _ = events_of(raw)
    assert status == 200 and terminated
    assert names(events) == [
        *MSG_TEXT,
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert events[0][1]["message"]["id"] == f"chatcmpl-{r}"  # vLLM names it after x-request-id
    assert events[-2][1]["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    rec = end_record(sim, r)
    assert rec["api"] == "messages" and rec["response_id"] == f"chatcmpl-{r}"
    assert rec["content_events_written"] == 3 and rec["outcome"] == "completed"


@pytest.mark.parametrize(
    ("spec", "expected", "terminated", "reset"),
    [
        ("reset@token:1", ["message_start"], False, True),
        ("reset@after:2", [*MSG_TEXT, "content_block_delta"], False, True),
        ("error@after:2", [*MSG_TEXT, "content_block_delta", "error"], True, False),
        ("error@role", ["error"], True, False),
        ("close@done", [*MSG_TEXT, "content_block_delta", "content_block_delta"], True, False),
        (
            "close@terminal",
            [*MSG_TEXT, "content_block_delta", "content_block_delta", "content_block_stop", "message_delta"],
            True,
            False,
        ),
    ],
)
def test_messages_faults(
    sim: SimProcess, spec: str, expected: list[str], terminated: bool, reset: bool
) -> None:
    raw, err = run_raw(sim.port, MESSAGES, msg_body(3), fault(spec, rid()))
    assert isinstance(err, ConnectionResetError) if reset else err is None
    _, events, done, _ = events_of(raw)
    assert names(events) == expected and done is terminated
    if "error" in expected:
        assert events[-1][1]["error"]["type"] == "internal_error"


@pytest.mark.parametrize(
    ("spec", "stop_reason", "tokens"), [("stop@token:2", "end_turn", 2), ("abort@token:2", None, 2)]
)
def test_messages_stop_reasons(sim: SimProcess, spec: str, stop_reason: str | None, tokens: int) -> None:
    raw, _ = run_raw(sim.port, MESSAGES, msg_body(5), {"x-sim-fault": spec})
    _, events, terminated, _ = events_of(raw)
    assert terminated and events[-2][1]["delta"]["stop_reason"] == stop_reason
    assert events[-2][1]["usage"]["output_tokens"] == tokens


def test_messages_errors_in_the_anthropic_shape(sim: SimProcess) -> None:
    with httpx.Client(base_url=sim.url, timeout=IO_TIMEOUT) as client:
        for spec, status in (("status503@headers", 503), ("status429@headers", 429), ("error@headers", 500)):
            resp = client.post(MESSAGES, json=msg_body(), headers={"x-sim-fault": spec})
            assert resp.status_code == status and resp.json()["type"] == "error"
        wrong = client.post(MESSAGES, json=msg_body(model="nope"))
        assert wrong.status_code == 404 and wrong.json() == {
            "type": "error",
            "error": {
                "type": "NotFoundError",
                "message": "The model `nope` does not exist. Valid aliases: tiny.",
            },
        }
        bad = client.post(MESSAGES, content=b'{"model": "tiny", "messages": [}')
        assert bad.status_code == 400 and "error" in bad.json() and "type" not in bad.json()  # FastAPI's
        ok = client.post(MESSAGES, json=msg_body(3, stream=False))
        assert ok.status_code == 200 and ok.json()["stop_reason"] == "max_tokens"
        tool = client.post(
            MESSAGES,
            json=msg_body(
                80, stream=False, tools=[{"name": "f", "input_schema": {}}], tool_choice={"type": "any"}
            ),
        )
        assert tool.json()["content"][0]["type"] == "tool_use" and tool.json()["stop_reason"] == "tool_use"


def test_sglang_messages_and_responses(api_sims: dict[str, SimProcess]) -> None:
    sgl = api_sims["sglang"]
    raw, err = run_raw(sgl.port, MESSAGES, msg_body(4), {"x-sim-fault": "error@after:2"})
    assert err is None
    _, events, terminated, _ = events_of(raw)
    assert terminated and "Transfer-Encoding" in (raw.split(b"\r\n\r\n")[0].decode())
    assert names(events) == [*MSG_TEXT, "content_block_delta", "content_block_stop", "error", "message_stop"]
    assert events[-2][1]["error"] == {
        "type": "overloaded_error",
        "message": "Request running timeout reached.",
    }
    assert re.fullmatch(r"msg_[0-9a-f]{32}", events[0][1]["message"]["id"])
    resp = httpx.post(f"{sgl.url}{RESPONSES}", json=resp_body(2), timeout=IO_TIMEOUT)
    assert resp.status_code == 500 and resp.text == "Internal Server Error" and "vary" not in resp.headers
    assert httpx.get(f"{sgl.url}/v1/responses/resp_x", timeout=IO_TIMEOUT).status_code == 500


# --------------------------------------------------------------------------- the Responses store


def poll(check: Callable[[], Any], deadline: float = IO_TIMEOUT) -> Any:
    end = time.monotonic() + deadline
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > end:
            raise TimeoutError("condition not met in time")
        time.sleep(0.02)


def test_without_the_store_nothing_is_kept(sim: SimProcess) -> None:
    with httpx.Client(base_url=sim.url, timeout=IO_TIMEOUT) as client:
        first = client.post(RESPONSES, json=resp_body(2, stream=False)).json()
        assert client.get(f"/v1/responses/{first['id']}").status_code == 404
        follow = client.post(RESPONSES, json=resp_body(2, previous_response_id=first["id"]))
        assert follow.status_code == 404
        background = client.post(RESPONSES, json=resp_body(2, stream=False, background=True))
        assert background.status_code == 400 and background.json()["error"]["param"] == "background"


def test_store_get_and_previous_response_id(api_sims: dict[str, SimProcess]) -> None:
    store = api_sims["store"]
    with httpx.Client(base_url=store.url, timeout=IO_TIMEOUT) as client:
        first = client.post(RESPONSES, json=resp_body(3, stream=False)).json()
        got = client.get(f"/v1/responses/{first['id']}")
        assert got.status_code == 200 and got.json() == first
        follow = client.post(RESPONSES, json=resp_body(3, stream=False, previous_response_id=first["id"]))
        assert follow.status_code == 200 and follow.json()["previous_response_id"] == first["id"]
        unstored = client.post(RESPONSES, json=resp_body(2, stream=False, store=False)).json()
        assert client.get(f"/v1/responses/{unstored['id']}").status_code == 404
        cancel = client.post(f"/v1/responses/{first['id']}/cancel")
        assert cancel.status_code == 400
        assert cancel.json()["error"]["message"] == "Cannot cancel a synchronous response."
        elsewhere = httpx.get(f"{api_sims['plain'].url}/v1/responses/{first['id']}", timeout=IO_TIMEOUT)
        assert elsewhere.status_code == 404  # another replica does not hold it
    # a streamed answer is kept too, once it completed
    raw, _ = run_raw(store.port, RESPONSES, resp_body(2), {})
    _, events, _, _ = events_of(raw)
    streamed_id = events[0][1]["response"]["id"]
    assert (
        httpx.get(f"{store.url}/v1/responses/{streamed_id}", timeout=IO_TIMEOUT).json()
        == events[-1][1]["response"]
    )
    # ...but its events are not: GET ?stream=true fails after the status line, as vLLM's does
    raw, err = _get(store, f"/v1/responses/{streamed_id}?stream=true")
    assert err is None
    status, headers, body = split_response(raw)
    assert status == 200 and headers["transfer-encoding"] == "chunked" and parse_chunked(body) == ([], False)


def test_background_stream_outlives_its_client_and_resumes(api_sims: dict[str, SimProcess]) -> None:
    store = api_sims["store"]
    r = rid()
    raw, err = run_raw(store.port, RESPONSES, resp_body(4, background=True), fault("reset@after:1", r))
    assert isinstance(err, ConnectionResetError)
    _, events, terminated, _ = events_of(raw)
    assert not terminated and names(events)[-1] == DELTA and events[0][1]["response"]["background"] is True
    response_id = events[0][1]["response"]["id"]
    rec = end_record(store, r)  # the run went on and finished
    assert (
        rec["outcome"] == "completed"
        and rec["detached_at"] is not None
        and rec["content_events_written"] == 4
    )
    raw, err = _get(store, f"/v1/responses/{response_id}?stream=true&starting_after=4")
    assert err is None
    _, resumed, terminated, _ = events_of(raw)
    assert terminated and [d["sequence_number"] for _, d in resumed] == list(range(5, 5 + len(resumed)))
    assert names(resumed)[-1] == "response.completed" and names(resumed).count(DELTA) == 3
    final = httpx.get(f"{store.url}/v1/responses/{response_id}", timeout=IO_TIMEOUT).json()
    assert final == resumed[-1][1]["response"] and final["status"] == "incomplete"


def test_background_nonstream_is_queued_then_done_and_can_be_cancelled(
    api_sims: dict[str, SimProcess],
) -> None:
    store = api_sims["store"]
    with httpx.Client(base_url=store.url, timeout=IO_TIMEOUT) as client:
        queued = client.post(RESPONSES, json=resp_body(3, stream=False, background=True))
        assert (
            queued.status_code == 200
            and queued.json()["status"] == "queued"
            and queued.json()["output"] == []
        )
        response_id = queued.json()["id"]
        done = poll(
            lambda: (g := client.get(f"/v1/responses/{response_id}").json())["status"] != "queued" and g
        )
        assert done["status"] == "incomplete" and done["usage"]["output_tokens"] == 3
        long = client.post(RESPONSES, json=resp_body(900, stream=False, background=True)).json()
        cancelled = client.post(f"/v1/responses/{long['id']}/cancel")
        assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled"
        assert client.get(f"/v1/responses/{long['id']}").json()["status"] == "cancelled"
    rec = poll(
        lambda: [
            x
            for x in _records(store)
            if x.get("response_id") == long["id"] and x["event"] == "end" and x["path"] == RESPONSES
        ]
    )
    assert rec[0]["outcome"] == "cancelled" and rec[0]["background"] is True


def _get(proc: SimProcess, target: str) -> tuple[bytes, Any]:
    with RawClient(proc.port) as client:
        client.send(f"GET {target} HTTP/1.1\r\nhost: sim\r\nconnection: close\r\n\r\n".encode())
        err = client.read_to_end()
        return client.buf, err


def _records(proc: SimProcess) -> list[dict[str, Any]]:
    from router_testbed.sim.log import read_log

    assert proc.log_path is not None
    return read_log(Path(proc.log_path))
