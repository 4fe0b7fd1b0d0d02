"""The replica simulator as a real process on loopback: HTTP/1.1 framing, faults and the request log."""

from __future__ import annotations

import hashlib
import json
import math
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from email.utils import parsedate_to_datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest

from router_sidecar.core.tool_keys import tool_idempotency_key
from router_testbed.sim import generation as gen
from router_testbed.sim.log import read_log, wait_for
from router_testbed.sim.process import SimProcess, spawn
from router_testbed.sim.toolcall import tool_body
from router_testbed.toolsvc import ToolSvcProcess, spawn_toolsvc

pytestmark = pytest.mark.integration

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
IO_TIMEOUT = 5.0


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def sim(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimProcess]:
    log = tmp_path_factory.mktemp("sim") / "sim.jsonl"
    proc = spawn(name="r1", log_path=log)
    try:
        yield proc
    finally:
        proc.stop()


@pytest.fixture
def spawn_sim(tmp_path: Path) -> Iterator[Callable[..., SimProcess]]:
    started: list[SimProcess] = []

    def start(name: str, *args: str) -> SimProcess:
        proc = spawn(name=name, log_path=tmp_path / f"{name}.jsonl", args=args)
        started.append(proc)
        return proc

    try:
        yield start
    finally:
        for proc in started:
            proc.stop()


# --------------------------------------------------------------------------- raw HTTP helpers


def rid() -> str:
    return uuid.uuid4().hex


def chat_body(max_tokens: int = 4, stream: bool = True, **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "hello there"}],
        "max_tokens": max_tokens,
        "stream": stream,
        "ignore_eos": True,
    }
    body.update(extra)
    return body


def raw_request(path: str, body: dict[str, Any], headers: dict[str, str] | None = None) -> bytes:
    payload = json.dumps(body).encode()
    lines = [f"POST {path} HTTP/1.1", "host: sim", "content-type: application/json"]
    lines.append(f"content-length: {len(payload)}")
    lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + payload


class RawClient:
    """A plain TCP client that sees exactly what the server did: bytes, FIN or RST."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=IO_TIMEOUT)
        self.buf = b""

    def __enter__(self) -> RawClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.sock.close()

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def read_until(self, predicate: Callable[[bytes], bool], timeout: float = IO_TIMEOUT) -> bytes:
        deadline = time.monotonic() + timeout
        while not predicate(self.buf):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"waited {timeout}s; got {self.buf!r}")
            self.sock.settimeout(remaining)
            data = self.sock.recv(65536)
            if not data:
                raise EOFError(f"server closed; got {self.buf!r}")
            self.buf += data
        return self.buf

    def read_to_end(self, timeout: float = IO_TIMEOUT) -> BaseException | None:
        """Read until EOF (returns None) or a socket error (returned), bounded by ``timeout``."""
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"no EOF within {timeout}s; got {self.buf!r}")
            self.sock.settimeout(remaining)
            try:
                data = self.sock.recv(65536)
            except ConnectionResetError as exc:
                return exc
            if not data:
                return None
            self.buf += data


def split_response(raw: bytes) -> tuple[int, dict[str, str], bytes]:
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])}
    return int(lines[0].split(" ")[1]), headers, body


def parse_chunked(body: bytes) -> tuple[list[bytes], bool]:
    """Chunks of a chunked body and whether the terminating zero chunk arrived."""
    chunks: list[bytes] = []
    i = 0
    while True:
        j = body.find(b"\r\n", i)
        if j < 0:
            return chunks, False
        size = int(body[i:j], 16)
        if size == 0:
            return chunks, body[j:].startswith(b"\r\n\r\n")
        start, end = j + 2, j + 2 + size
        if len(body) < end + 2:
            return chunks, False
        chunks.append(body[start:end])
        i = end + 2


def kind_of(event: bytes) -> str:
    payload = gen.event_payload(event)
    if payload == "[DONE]":
        return "done"
    if "error" in payload:
        return "error"
    if not payload["choices"]:
        return "usage"
    choice = payload["choices"][0]
    delta = choice.get("delta", {})
    if delta.get("role") == "assistant":
        return "role"
    has_content = bool(delta.get("content") or delta.get("tool_calls") or choice.get("text"))
    finish = choice["finish_reason"]
    if has_content:
        return "content" if finish is None else f"content+{finish}"
    return f"finish:{finish}"


def stream_events(raw: bytes) -> tuple[int, list[bytes], bool]:
    """Status, SSE events (one per chunk, asserted) and whether the chunked body was terminated."""
    status, headers, body = split_response(raw)
    assert headers["transfer-encoding"] == "chunked"
    chunks, terminated = parse_chunked(body)
    for c in chunks:
        assert c.endswith(b"\n\n") and c.count(b"\n\n") == 1, f"chunk is not exactly one event: {c!r}"
    return status, chunks, terminated


def run_raw(port: int, path: str, body: dict[str, Any], headers: dict[str, str]) -> tuple[bytes, Any]:
    with RawClient(port) as client:
        client.send(raw_request(path, body, {"connection": "close", **headers}))
        err = client.read_to_end()
        return client.buf, err


def end_record(sim: SimProcess, request_id: str, timeout: float = IO_TIMEOUT) -> dict[str, Any]:
    assert sim.log_path is not None
    return wait_for(
        sim.log_path, lambda r: r.get("request_id") == request_id and r["event"] == "end", timeout
    )


# --------------------------------------------------------------------------- plain endpoints


def test_health_version_models_and_404(sim: SimProcess) -> None:
    with httpx.Client(base_url=sim.url, timeout=IO_TIMEOUT) as client:
        health = client.get("/health")
        assert health.status_code == 200 and health.content == b""
        assert health.headers["x-sim-replica"] == "r1"
        assert client.get("/version").json() == {"version": "0.32.0"}
        models = client.get("/v1/models").json()
        assert [m["id"] for m in models["data"]] == ["tiny"]
        missing = client.get("/nope")
        assert missing.status_code == 404


def test_clean_stream_exact_sequence_with_usage(sim: SimProcess) -> None:
    r = rid()
    body = chat_body(3, stream_options={"include_usage": True})
    raw, err = run_raw(sim.port, CHAT, body, {"x-request-id": r, "x-attempt-id": "a1"})
    assert err is None
    status, events, terminated = stream_events(raw)
    assert status == 200 and terminated
    assert [kind_of(e) for e in events] == ["role", "content", "content", "content+length", "usage", "done"]
    _, headers, _ = split_response(raw)
    assert headers["content-type"] == "text/event-stream; charset=utf-8"
    assert headers["x-sim-replica"] == "r1"
    rec = end_record(sim, r)
    assert rec["outcome"] == "completed" and rec["status"] == 200 and rec["stream"] is True
    assert rec["events_written"] == 6 and rec["content_events_written"] == 3
    assert rec["attempt_id"] == "a1" and rec["client_gone_at"] is None
    start = wait_for(sim.log_path or "", lambda x: x.get("request_id") == r and x["event"] == "start", 1)
    assert start["t_start"] == rec["t_start"] <= rec["t_end"]


def test_completions_stream_sequence(sim: SimProcess) -> None:
    body = {"model": "tiny", "prompt": "abc", "max_tokens": 3, "stream": True}
    raw, _ = run_raw(sim.port, COMPLETIONS, body, {})
    _, events, terminated = stream_events(raw)
    assert terminated
    assert [kind_of(e) for e in events] == ["content", "content", "content+length", "done"]
    assert gen.event_payload(events[0])["id"].startswith("cmpl-")


def test_keep_alive_and_chunked_request_body(sim: SimProcess) -> None:
    r1, r2 = rid(), rid()
    payload = json.dumps(chat_body(2, stream=False)).encode()

    def chunked() -> Iterator[bytes]:
        yield payload[:10]
        yield payload[10:]

    with httpx.Client(base_url=sim.url, timeout=IO_TIMEOUT) as client:
        a = client.post(CHAT, json=chat_body(2, stream=False), headers={"x-request-id": r1})
        b = client.post(CHAT, content=chunked(), headers={"x-request-id": r2})
    assert a.status_code == b.status_code == 200
    assert a.headers["content-type"] == "application/json"
    # same prompt, same server seed: same text; ids differ
    assert a.json()["choices"][0]["message"]["content"] == b.json()["choices"][0]["message"]["content"]
    assert a.json()["id"] != b.json()["id"]
    assert end_record(sim, r1)["conn"] == end_record(sim, r2)["conn"]


def test_errors_before_stream(sim: SimProcess) -> None:
    with httpx.Client(base_url=sim.url, timeout=IO_TIMEOUT) as client:
        bad = client.post(CHAT, content=b'{"model":"tiny",}')
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "body.16"
        wrong = client.post(CHAT, json=chat_body(model="nope"))
        assert wrong.status_code == 404 and wrong.json()["error"]["type"] == "NotFoundError"
        typo = client.post(CHAT, json=chat_body(), headers={"x-sim-fault": "close@done; rest@token:1"})
        assert typo.status_code == 400
        assert "rest@token:1" in typo.json()["error"]["message"]


# --------------------------------------------------------------------------- faults


def test_close_after_2_exact_sequence(sim: SimProcess) -> None:
    r = rid()
    raw, err = run_raw(sim.port, CHAT, chat_body(5), {"x-sim-fault": "close@after:2", "x-request-id": r})
    assert err is None
    status, events, terminated = stream_events(raw)
    assert status == 200 and terminated
    assert [kind_of(e) for e in events] == ["role", "content", "content"]
    rec = end_record(sim, r)
    assert rec["outcome"] == "fault:close" and rec["content_events_written"] == 2
    assert rec["events_written"] == 3


def test_reset_at_token_1_sends_role_then_rst(sim: SimProcess) -> None:
    r = rid()
    raw, err = run_raw(sim.port, CHAT, chat_body(5), {"x-sim-fault": "reset@token:1", "x-request-id": r})
    assert isinstance(err, ConnectionResetError)
    status, events, terminated = stream_events(raw)
    assert status == 200 and not terminated
    assert [kind_of(e) for e in events] == ["role"]
    rec = end_record(sim, r)
    assert rec["outcome"] == "fault:reset" and rec["content_events_written"] == 0


def test_reset_nonstream_gives_no_response(sim: SimProcess) -> None:
    raw, err = run_raw(sim.port, CHAT, chat_body(5, stream=False), {"x-sim-fault": "reset@token:2"})
    assert isinstance(err, ConnectionResetError) and raw == b""


def test_attempt_filter_only_fires_on_matching_attempt(sim: SimProcess) -> None:
    fault = {"x-sim-fault": "reset@token:1 attempt=2"}
    raw, err = run_raw(sim.port, CHAT, chat_body(3), {**fault, "x-envoy-attempt-count": "1"})
    assert err is None and stream_events(raw)[2]
    raw, err = run_raw(sim.port, CHAT, chat_body(3), {**fault, "x-envoy-attempt-count": "2"})
    assert isinstance(err, ConnectionResetError)
    assert [kind_of(e) for e in stream_events(raw)[1]] == ["role"]


def test_replica_filter(sim: SimProcess) -> None:
    raw, err = run_raw(sim.port, CHAT, chat_body(2), {"x-sim-fault": "reset@role replica=r2,r3"})
    assert err is None and stream_events(raw)[2]
    raw, err = run_raw(sim.port, CHAT, chat_body(2), {"x-sim-fault": "reset@role replica=r1"})
    assert isinstance(err, ConnectionResetError) and stream_events(raw)[1] == []


def test_model_filter_fires_only_on_replicas_serving_that_model(
    sim: SimProcess, spawn_sim: Callable[..., SimProcess]
) -> None:
    """`model=` selects by the model a replica serves (its --model): one header fails every replica of
    tiny and none of big's, as the drill's fallback scenario needs. The log names each replica's model."""
    big = spawn_sim("big", "--model", "big")
    fault = {"x-sim-fault": "status503@headers model=tiny"}
    on_tiny, on_big = rid(), rid()
    with httpx.Client(timeout=IO_TIMEOUT) as client:
        tiny_answer = client.post(
            sim.url + CHAT, json=chat_body(), headers={**fault, "x-request-id": on_tiny}
        )
        big_answer = client.post(
            big.url + CHAT, json=chat_body(2, model="big"), headers={**fault, "x-request-id": on_big}
        )
    assert tiny_answer.status_code == 503 and big_answer.status_code == 200
    tiny_end, big_end = end_record(sim, on_tiny), end_record(big, on_big)
    assert (tiny_end["model"], tiny_end["outcome"], tiny_end["faults_fired"]) == (
        "tiny",
        "fault:status503",
        ["status503@headers"],
    )
    assert (big_end["model"], big_end["outcome"], big_end["faults_fired"]) == ("big", "completed", [])


def test_error_after_1_is_vllm_inband_error(sim: SimProcess) -> None:
    raw, err = run_raw(sim.port, CHAT, chat_body(4), {"x-sim-fault": "error@after:1"})
    assert err is None
    _, events, terminated = stream_events(raw)
    assert terminated
    assert [kind_of(e) for e in events] == ["role", "content", "error", "done"]
    assert events[2] == gen.inband_error_event()


def test_abort_after_2_carries_content_and_usage_counts_it(sim: SimProcess) -> None:
    r = rid()
    body = chat_body(6, stream_options={"include_usage": True})
    raw, _ = run_raw(sim.port, CHAT, body, {"x-sim-fault": "abort@after:2", "x-request-id": r})
    _, events, terminated = stream_events(raw)
    assert terminated
    assert [kind_of(e) for e in events] == ["role", "content", "content", "content+abort", "usage", "done"]
    assert gen.event_payload(events[4])["usage"]["completion_tokens"] == 3
    assert end_record(sim, r)["outcome"] == "fault:abort"


def test_status503_then_connection_is_reused(sim: SimProcess) -> None:
    r1, r2 = rid(), rid()
    with httpx.Client(base_url=sim.url, timeout=IO_TIMEOUT) as client:
        first = client.post(
            CHAT, json=chat_body(), headers={"x-sim-fault": "status503@headers", "x-request-id": r1}
        )
        assert first.status_code == 503
        assert first.json()["error"]["code"] == 503
        second = client.post(CHAT, json=chat_body(2, stream=False), headers={"x-request-id": r2})
        assert second.status_code == 200
    assert end_record(sim, r1)["outcome"] == "fault:status503"
    assert end_record(sim, r1)["conn"] == end_record(sim, r2)["conn"]


def test_status_faults_send_the_retry_after_they_are_given(sim: SimProcess) -> None:
    specs = {
        "status429@headers retry_after=2": (429, "2"),
        "status503@headers retry_after=0": (503, "0"),
        "status429@headers": (429, None),
    }
    with httpx.Client(base_url=sim.url, timeout=IO_TIMEOUT) as client:
        for spec, (status, retry_after) in specs.items():
            r = rid()
            answer = client.post(CHAT, json=chat_body(), headers={"x-sim-fault": spec, "x-request-id": r})
            assert (answer.status_code, answer.headers.get("retry-after")) == (status, retry_after)
            assert answer.json()["error"]["code"] == status
            assert end_record(sim, r).get("retry_after") == retry_after  # the replica's log says it too
        r = rid()
        before = time.time()
        answer = client.post(
            CHAT,
            json=chat_body(),
            headers={"x-sim-fault": "status503@headers retry_after=date:3", "x-request-id": r},
        )
        after = time.time()
    assert answer.status_code == 503
    when = parsedate_to_datetime(answer.headers["retry-after"]).timestamp()
    assert before + 3 <= when <= math.ceil(after) + 3
    assert end_record(sim, r)["retry_after"] == answer.headers["retry-after"]


def test_delay_slows_but_completes(sim: SimProcess) -> None:
    r = rid()
    t0 = time.monotonic()
    raw, _ = run_raw(
        sim.port, CHAT, chat_body(2), {"x-sim-fault": "delay@token:2 for=0.3", "x-request-id": r}
    )
    assert time.monotonic() - t0 >= 0.3
    assert [kind_of(e) for e in stream_events(raw)[1]] == ["role", "content", "content+length", "done"]
    rec = end_record(sim, r)
    assert rec["outcome"] == "completed" and rec["faults_fired"] == ["delay@token:2"]


def test_stall_records_client_gone(sim: SimProcess) -> None:
    r = rid()
    with RawClient(sim.port) as client:
        client.send(raw_request(CHAT, chat_body(5), {"x-sim-fault": "stall@after:1", "x-request-id": r}))
        client.read_until(lambda b: b.count(b"data: ") >= 2)
        assert sim.log_path is not None
        assert not [x for x in read_log(sim.log_path) if x.get("request_id") == r and x["event"] == "end"]
        closed_at = time.time()
    rec = end_record(sim, r)
    assert rec["outcome"] == "fault:stall" and rec["content_events_written"] == 1
    assert rec["client_gone_at"] is not None and rec["client_gone_at"] >= closed_at - 0.05


def test_stall_with_for_continues(sim: SimProcess) -> None:
    raw, err = run_raw(sim.port, CHAT, chat_body(2), {"x-sim-fault": "stall@role for=0.1"})
    assert err is None and [kind_of(e) for e in stream_events(raw)[1]][-1] == "done"


def test_client_disconnect_mid_stream(sim: SimProcess) -> None:
    r = rid()
    with RawClient(sim.port) as client:
        client.send(raw_request(CHAT, chat_body(400), {"x-request-id": r}))
        client.read_until(lambda b: b.count(b"data: ") >= 3)
    rec = end_record(sim, r)
    assert rec["outcome"] == "client_gone" and rec["client_gone_at"] is not None
    assert 2 <= rec["content_events_written"] < 400


def test_exit_kills_the_process(spawn_sim: Callable[..., SimProcess]) -> None:
    victim = spawn_sim("victim")
    r = rid()
    raw, _ = run_raw(victim.port, CHAT, chat_body(5), {"x-sim-fault": "exit@token:2", "x-request-id": r})
    _, events, terminated = stream_events(raw)
    assert not terminated and [kind_of(e) for e in events] == ["role", "content"]
    assert victim.proc.wait(IO_TIMEOUT) == 1
    assert end_record(victim, r)["outcome"] == "fault:exit"


def test_sigterm_exits_zero_and_same_seed_same_output(spawn_sim: Callable[..., SimProcess]) -> None:
    a, b = spawn_sim("a", "--seed", "3"), spawn_sim("b", "--seed", "3")
    texts = []
    for s in (a, b):
        resp = httpx.post(f"{s.url}{CHAT}", json=chat_body(8, stream=False), timeout=IO_TIMEOUT)
        assert resp.headers["x-sim-replica"] == s.name
        texts.append(resp.json()["choices"][0]["message"]["content"])
    assert texts[0] == texts[1] and texts[0]
    assert a.stop() == 0 and b.stop() == 0


# --------------------------------------------------------------------------- agent-worker mode (--tool-url)


@pytest.fixture
def toolsvc(tmp_path: Path) -> Iterator[ToolSvcProcess]:
    proc = spawn_toolsvc(log_path=tmp_path / "tool.jsonl", name="pay")
    try:
        yield proc
    finally:
        proc.stop()


def content_texts(events: list[bytes]) -> list[str]:
    return [
        gen.event_payload(e)["choices"][0]["delta"]["content"]
        for e in events
        if kind_of(e).startswith("content")
    ]


def test_agent_mode_calls_tool_with_derived_key_before_streaming(
    spawn_sim: Callable[..., SimProcess], toolsvc: ToolSvcProcess
) -> None:
    worker = spawn_sim("w1", "--tool-url", toolsvc.tool_url())
    r = f"req_{rid()}"
    headers = {"x-request-id": r, "x-attempt-id": "att-1", "authorization": "Bearer tenant-a"}
    raw, err = run_raw(worker.port, CHAT, chat_body(3), headers)
    assert err is None
    status, events, terminated = stream_events(raw)
    assert status == 200 and terminated
    assert [kind_of(e) for e in events] == ["role", "content", "content", "content+length", "done"]
    (execution,) = toolsvc.executions()
    key = tool_idempotency_key(r, 1)
    assert key == f"{r}:call_01"
    assert execution["key"] == key and execution["attempt_id"] == "att-1"
    assert execution["path"] == "/tools/payments/charge"
    assert execution["auth_sha256"] == hashlib.sha256(b"Bearer tenant-a").hexdigest()[:16]
    greq = gen.parse_request("chat", json.dumps(chat_body(3)).encode(), served_model="tiny")
    assert execution["body_sha256"] == hashlib.sha256(tool_body(r, "att-1", greq)).hexdigest()
    texts = content_texts(events)
    assert texts[0] == f"tool:ok-{execution['n']}" and len(texts) == 3  # token count unchanged
    rec = end_record(worker, r)
    assert rec["outcome"] == "completed" and rec["tool_key"] == key
    assert rec["tool_status"] == 200 and rec["tool_replayed"] is False and rec["tool_error"] is None
    assert rec["tool_result"] == f"ok-{execution['n']}" and execution["t"] <= rec["t_end"]
    # non-streamed requests call the tool too; no Authorization header: none is sent
    r2 = f"req_{rid()}"
    resp = httpx.post(
        f"{worker.url}{CHAT}",
        json=chat_body(2, stream=False),
        headers={"x-request-id": r2},
        timeout=IO_TIMEOUT,
    )
    assert resp.status_code == 200
    second = toolsvc.executions()[-1]
    assert second["key"] == f"{r2}:call_01" and second["auth_sha256"] is None and second["attempt_id"] is None
    assert resp.json()["choices"][0]["message"]["content"].startswith(f"tool:ok-{second['n']}")


def test_agent_exit_at_tool_dies_after_side_effect_before_any_byte(
    spawn_sim: Callable[..., SimProcess], toolsvc: ToolSvcProcess
) -> None:
    fault = "exit@tool attempt=1"
    first = spawn_sim("w1", "--tool-url", toolsvc.tool_url())
    r = f"req_{rid()}"
    h1 = {"x-request-id": r, "x-attempt-id": "att-1", "x-envoy-attempt-count": "1", "x-sim-fault": fault}
    raw, _ = run_raw(first.port, CHAT, chat_body(3), h1)
    assert raw == b""  # died before the status line: nothing reached the client
    assert first.proc.wait(IO_TIMEOUT) == 1
    rec = end_record(first, r)
    assert rec["outcome"] == "fault:exit" and rec["faults_fired"] == ["exit@tool"]
    assert rec["status"] is None and rec["events_written"] == 0
    assert rec["tool_status"] == 200 and rec["tool_key"] == f"{r}:call_01"
    (execution,) = toolsvc.executions()
    assert execution["key"] == f"{r}:call_01" and execution["attempt_id"] == "att-1"
    assert execution["t"] <= rec["t_end"]
    # The retried attempt (attempt 2, another worker) derives the same key from the logical request.
    # Without the tool gateway in between, the tool executes a second time: that is what it is for.
    second = spawn_sim("w2", "--tool-url", toolsvc.tool_url())
    h2 = {**h1, "x-attempt-id": "att-2", "x-envoy-attempt-count": "2"}
    raw, err = run_raw(second.port, CHAT, chat_body(3), h2)
    assert err is None and stream_events(raw)[2]
    executions = toolsvc.executions()
    assert [x["key"] for x in executions] == [f"{r}:call_01", f"{r}:call_01"]
    assert [x["attempt_id"] for x in executions] == ["att-1", "att-2"]
    assert end_record(second, r)["outcome"] == "completed"


def test_agent_tool_failure_is_502_without_stream(
    spawn_sim: Callable[..., SimProcess], toolsvc: ToolSvcProcess
) -> None:
    worker = spawn_sim("w1", "--tool-url", f"{toolsvc.url}/not-a-tool")
    r = f"req_{rid()}"
    raw, err = run_raw(worker.port, CHAT, chat_body(3), {"x-request-id": r})
    status, headers, body = split_response(raw)
    assert err is None and status == 502 and headers["content-type"] == "application/json"
    error = json.loads(body)["error"]
    assert error["code"] == 502 and "tool status 404" in error["message"]
    rec = end_record(worker, r)
    assert rec["outcome"] == "tool_failed" and rec["tool_status"] == 404 and rec["events_written"] == 0
    assert toolsvc.executions() == []
    # the connection survives a tool failure (keep-alive), and a missing x-request-id is a 400
    with httpx.Client(base_url=worker.url, timeout=IO_TIMEOUT) as client:
        first = client.post(CHAT, json=chat_body(2), headers={"x-request-id": rid()})
        second = client.post(CHAT, json=chat_body(2))
    assert first.status_code == 502 and second.status_code == 400
    assert "x-request-id" in second.json()["error"]["message"]


def test_agent_tool_unreachable_or_silent_is_502(spawn_sim: Callable[..., SimProcess]) -> None:
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        dead_port = closed.getsockname()[1]  # bound, never listening: connection refused
    refused = spawn_sim("w1", "--tool-url", f"http://127.0.0.1:{dead_port}/tools/p/c")
    r = f"req_{rid()}"
    resp = httpx.post(
        f"{refused.url}{CHAT}", json=chat_body(2), headers={"x-request-id": r}, timeout=IO_TIMEOUT
    )
    assert resp.status_code == 502 and "tool status none" in resp.json()["error"]["message"]
    rec = end_record(refused, r)
    assert rec["outcome"] == "tool_failed" and rec["tool_status"] is None
    assert "ConnectionRefusedError" in rec["tool_error"]
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()  # accepts (in the kernel) but never answers
        port = silent.getsockname()[1]
        slow = spawn_sim("w2", "--tool-url", f"http://127.0.0.1:{port}/tools/p/c", "--tool-timeout", "0.3")
        r = f"req_{rid()}"
        t0 = time.monotonic()
        resp = httpx.post(
            f"{slow.url}{CHAT}", json=chat_body(2), headers={"x-request-id": r}, timeout=IO_TIMEOUT
        )
        assert 0.3 <= time.monotonic() - t0 < 3.0
    assert resp.status_code == 502
    assert "no response within 0.3s" in end_record(slow, r)["tool_error"]


class _ReplayingTool(BaseHTTPRequestHandler):
    """Stands in for the tool gateway answering from its store: chunked body, x-idempotent-replay."""

    protocol_version = "HTTP/1.1"
    seen: list[dict[str, str]] = []  # noqa: RUF012

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["content-length"]))
        type(self).seen.append({k.lower(): v for k, v in self.headers.items()})
        payload = b'{"result":"ok-41","execution":41}'
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("transfer-encoding", "chunked")
        self.send_header("x-idempotent-replay", "true")
        self.end_headers()
        for part in (payload[:10], payload[10:]):
            self.wfile.write(f"{len(part):x}\r\n".encode() + part + b"\r\n")
        self.wfile.write(b"0\r\n\r\n")

    def log_message(self, format: str, *args: object) -> None:
        pass


def test_agent_records_a_replayed_tool_result(spawn_sim: Callable[..., SimProcess]) -> None:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _ReplayingTool)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        worker = spawn_sim("w1", "--tool-url", f"http://127.0.0.1:{server.server_port}/tools/payments/charge")
        r = f"req_{rid()}"
        raw, err = run_raw(worker.port, CHAT, chat_body(2), {"x-request-id": r, "x-attempt-id": "att-2"})
        assert err is None
        _, events, terminated = stream_events(raw)
        assert terminated and content_texts(events)[0] == "tool:ok-41"
        rec = end_record(worker, r)
        assert rec["tool_replayed"] is True and rec["tool_status"] == 200 and rec["tool_result"] == "ok-41"
        (seen,) = _ReplayingTool.seen
        assert seen["idempotency-key"] == f"{r}:call_01" and seen["x-attempt-id"] == "att-2"
        assert "authorization" not in seen
    finally:
        server.shutdown()
        server.server_close()
        thread.join(IO_TIMEOUT)


def test_tool_point_never_fires_without_tool_url(sim: SimProcess) -> None:
    r = rid()
    raw, err = run_raw(sim.port, CHAT, chat_body(2), {"x-sim-fault": "exit@tool", "x-request-id": r})
    assert err is None and stream_events(raw)[2]
    rec = end_record(sim, r)
    assert rec["outcome"] == "completed" and rec["faults_fired"] == [] and "tool_key" not in rec
