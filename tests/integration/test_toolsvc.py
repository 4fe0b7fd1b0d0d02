"""The test tool service as a real process on loopback: execution counting, x-tool-fault, keep-alive."""

from __future__ import annotations

import hashlib
import json
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from router_testbed.sim.log import read_log, wait_for
from router_testbed.toolsvc import (
    ToolFault,
    ToolSvcProcess,
    parse_tool_fault,
    read_executions,
    result_body,
    spawn_toolsvc,
)

pytestmark = pytest.mark.integration

IO_TIMEOUT = 5.0


@pytest.fixture(scope="module")
def svc(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ToolSvcProcess]:
    proc = spawn_toolsvc(log_path=tmp_path_factory.mktemp("toolsvc") / "tool.jsonl", name="pay")
    try:
        yield proc
    finally:
        proc.stop()


def post(svc: ToolSvcProcess, key: str, fault: str | None = None, body: bytes = b'{"a":1}') -> httpx.Response:
    headers = {"idempotency-key": key, "x-attempt-id": f"att-{key}", "content-type": "application/json"}
    if fault is not None:
        headers["x-tool-fault"] = fault
    return httpx.post(svc.tool_url(), content=body, headers=headers, timeout=IO_TIMEOUT)


def raw_post(path: str, key: str, fault: str | None = None, keep_alive: bool = True) -> bytes:
    body = b'{"a":1}'
    lines = [f"POST {path} HTTP/1.1", "host: t", f"content-length: {len(body)}", f"idempotency-key: {key}"]
    if fault is not None:
        lines.append(f"x-tool-fault: {fault}")
    if not keep_alive:
        lines.append("connection: close")
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


def recv_until(sock: socket.socket, buf: bytes, done: Callable[[bytes], bool]) -> bytes:
    deadline = time.monotonic() + IO_TIMEOUT
    while not done(buf):
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError(f"got {buf!r}")
        sock.settimeout(remaining)
        data = sock.recv(65536)
        if not data:
            raise EOFError(f"closed; got {buf!r}")
        buf += data
    return buf


def responses_complete(n: int) -> Callable[[bytes], bool]:
    def done(buf: bytes) -> bool:
        count, rest = 0, buf
        while count < n:
            head, sep, tail = rest.partition(b"\r\n\r\n")
            if not sep:
                return False
            length = int(
                next(ln.split(b":")[1] for ln in head.split(b"\r\n") if ln.startswith(b"content-length"))
            )
            if len(tail) < length:
                return False
            rest, count = tail[length:], count + 1
        return True

    return done


def executed(svc: ToolSvcProcess, key: str) -> list[dict[str, object]]:
    return [r for r in svc.executions() if r["key"] == key]


# --------------------------------------------------------------------------- pure parts


def test_parse_tool_fault() -> None:
    assert parse_tool_fault(None) == ToolFault()
    assert parse_tool_fault("delay=0.5") == ToolFault(delay=0.5)
    assert parse_tool_fault("reset; delay=1") == ToolFault(delay=1.0, reset=True)
    assert parse_tool_fault("status=400") == ToolFault(status=400)
    assert parse_tool_fault("retriable503").refuses
    assert parse_tool_fault("big=4096") == ToolFault(big=4096)
    for bad in (
        "nope",
        "delay=-1",
        "delay=x",
        "status=99",
        "status=abc",
        "reset=1",
        "big=-3",
        "big",
        "status=400;retriable503",
        "reset;big=10",
        "status=400;reset",
        "delay=1;delay=2",
    ):
        with pytest.raises(ValueError, match="x-tool-fault"):
            parse_tool_fault(bad)


def test_result_body_sizes() -> None:
    for size in (200, 1000, 65536):
        body = result_body(7, "req:call_01", size)
        assert len(body) == size and json.loads(body)["result"] == "ok-7"
    assert json.loads(result_body(7, "k", 5)) == {"result": "ok-7", "execution": 7, "key": "k"}


# --------------------------------------------------------------------------- the process


def test_ready_line_and_health(svc: ToolSvcProcess) -> None:
    assert svc.name == "pay" and svc.port > 0
    assert httpx.get(f"{svc.url}/health", timeout=IO_TIMEOUT).json() == {"status": "ok", "name": "pay"}
    assert httpx.get(f"{svc.url}/nope", timeout=IO_TIMEOUT).status_code == 404
    assert httpx.get(svc.tool_url(), timeout=IO_TIMEOUT).status_code == 405
    assert httpx.post(f"{svc.url}/tools/pay", timeout=IO_TIMEOUT).status_code == 404


def test_every_call_executes_and_is_counted(svc: ToolSvcProcess) -> None:
    before = len(svc.executions())
    body = b'{"amount":5}'
    answers = [post(svc, "req_c:call_01", body=body) for _ in range(3)]
    assert [a.status_code for a in answers] == [200, 200, 200]
    ns = [a.json()["execution"] for a in answers]
    assert ns == [ns[0], ns[0] + 1, ns[0] + 2] and ns[0] == before + 1
    assert answers[0].json() == {
        "result": f"ok-{ns[0]}",
        "execution": ns[0],
        "key": "req_c:call_01",
    }
    lines = executed(svc, "req_c:call_01")
    assert [x["n"] for x in lines] == ns  # the service itself does no deduplication: the gateway does
    assert lines[0]["attempt_id"] == "att-req_c:call_01" and lines[0]["path"] == "/tools/payments/charge"
    assert lines[0]["body_sha256"] == hashlib.sha256(body).hexdigest()
    served = httpx.get(f"{svc.url}/executions", timeout=IO_TIMEOUT).json()
    assert served == svc.executions() and len(served) == before + 3


def test_keep_alive_serves_several_requests_on_one_connection(svc: ToolSvcProcess) -> None:
    with socket.create_connection(("127.0.0.1", svc.port), timeout=IO_TIMEOUT) as sock:
        sock.sendall(raw_post("/tools/payments/charge", "ka:call_01"))
        buf = recv_until(sock, b"", responses_complete(1))
        sock.sendall(raw_post("/tools/mail/send", "ka:call_02") + raw_post("/tools/x/y", "ka:call_03"))
        buf = recv_until(sock, buf, responses_complete(3))
        sock.sendall(raw_post("/tools/x/y", "ka:call_04", keep_alive=False))
        buf = recv_until(sock, buf, responses_complete(4))
        sock.settimeout(IO_TIMEOUT)
        assert sock.recv(1) == b""  # closed after "connection: close"
    assert buf.count(b"HTTP/1.1 200 OK") == 4
    assert [x["path"] for x in svc.executions() if str(x["key"]).startswith("ka:")] == [
        "/tools/payments/charge",
        "/tools/mail/send",
        "/tools/x/y",
        "/tools/x/y",
    ]


def test_delay_executes_before_answering(svc: ToolSvcProcess) -> None:
    with socket.create_connection(("127.0.0.1", svc.port), timeout=IO_TIMEOUT) as sock:
        t0 = time.monotonic()
        sock.sendall(raw_post("/tools/payments/charge", "delay:call_01", fault="delay=0.6"))
        assert svc.log_path is not None
        wait_for(svc.log_path, lambda r: r.get("key") == "delay:call_01" and r["event"] == "executed", 2.0)
        sock.settimeout(0.05)
        if time.monotonic() - t0 < 0.5:
            with pytest.raises(TimeoutError):
                sock.recv(1)  # the side effect happened; the answer has not come yet
        buf = recv_until(sock, b"", responses_complete(1))
        assert time.monotonic() - t0 >= 0.6
    assert buf.startswith(b"HTTP/1.1 200 ")


def test_reset_executes_then_rsts_without_answer(svc: ToolSvcProcess) -> None:
    with socket.create_connection(("127.0.0.1", svc.port), timeout=IO_TIMEOUT) as sock:
        sock.sendall(raw_post("/tools/payments/charge", "rst:call_01", fault="reset"))
        sock.settimeout(IO_TIMEOUT)
        try:
            data: bytes | None = sock.recv(65536)
        except ConnectionResetError:
            data = None
        assert data is None, f"expected a TCP RST and no answer, got {data!r}"
    assert len(executed(svc, "rst:call_01")) == 1
    with pytest.raises(httpx.TransportError):
        post(svc, "rst:call_02", fault="reset")
    assert len(executed(svc, "rst:call_02")) == 1


def test_status_refuses_without_executing(svc: ToolSvcProcess) -> None:
    answer = post(svc, "st:call_01", fault="status=400")
    assert answer.status_code == 400 and answer.json()["status"] == 400
    assert "x-tool-retriable" not in answer.headers
    assert executed(svc, "st:call_01") == []
    assert svc.log_path is not None
    refused = [r for r in read_log(svc.log_path) if r.get("key") == "st:call_01"]
    assert [(r["event"], r["status"]) for r in refused] == [("refused", 400)]


def test_retriable503_refuses_with_header(svc: ToolSvcProcess) -> None:
    answer = post(svc, "r503:call_01", fault="retriable503")
    assert answer.status_code == 503 and answer.headers["x-tool-retriable"] == "true"
    assert executed(svc, "r503:call_01") == []
    ok = post(svc, "r503:call_01")  # the caller may try again: that one executes
    assert ok.status_code == 200 and len(executed(svc, "r503:call_01")) == 1


def test_big_answers_exact_size(svc: ToolSvcProcess) -> None:
    answer = post(svc, "big:call_01", fault="big=300000")
    assert answer.status_code == 200 and len(answer.content) == 300000
    assert int(answer.headers["content-length"]) == 300000
    assert answer.json()["execution"] == executed(svc, "big:call_01")[0]["n"]


def test_bad_fault_header_is_400_and_not_logged(svc: ToolSvcProcess) -> None:
    answer = post(svc, "bad:call_01", fault="explode")
    assert answer.status_code == 400 and "x-tool-fault" in answer.json()["error"]
    assert svc.log_path is not None
    assert [r for r in read_log(svc.log_path) if r.get("key") == "bad:call_01"] == []


def test_restart_continues_the_counter(tmp_path: Path) -> None:
    log = tmp_path / "t.jsonl"
    with spawn_toolsvc(log_path=log) as first:
        assert first.name == first.address
        assert post(first, "k:call_01").json()["execution"] == 1
        assert post(first, "k:call_01").json()["execution"] == 2
    with spawn_toolsvc(log_path=log) as second:
        assert post(second, "k:call_01").json()["execution"] == 3
    assert [r["n"] for r in read_executions(log)] == [1, 2, 3]


def test_spawn_times_out_on_a_busy_port(tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(RuntimeError, match="tool service exited"):
            spawn_toolsvc(log_path=tmp_path / "t.jsonl", port=port, timeout=IO_TIMEOUT)
