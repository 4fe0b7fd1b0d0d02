"""A vLLM 0.32 / SGLang 0.5.23 replica simulator: OpenAI-compatible HTTP/1.1 on raw asyncio streams, with
faults.

Run: ``python -m router_testbed.sim --listen 127.0.0.1:0 --name r1 --log /tmp/r1.jsonl [--dialect sglang]``.
It prints ``sim NAME listening on HOST:PORT`` (the bound port, so ``:0`` works) once the socket is bound and
exits 0 on SIGTERM/SIGINT. See :mod:`router_testbed.sim.faults` for the ``x-sim-fault`` grammar (every fault
works in both dialects) and :class:`router_testbed.sim.generation.Dialect` for what differs between them.
The request log is the same in both: it records the ``x-request-id``/``x-attempt-id`` received, whatever
id the dialect gives the completion.

Agent-worker mode (``--tool-url URL [--tool-timeout S]``, see :mod:`router_testbed.sim.toolcall`):
every
generation request first makes one tool call keyed ``tool_idempotency_key(x-request-id, 1)``, before the
status line is written; then the ``tool`` fault point; then the usual flow. The tool's result is the first
content event's text (``"tool:<result>"``). The request log's end record gains ``tool_key``,
``tool_status``, ``tool_replayed``, ``tool_result`` and ``tool_error``. A failed tool call (non-2xx,
connection error, timeout) is answered 502 in vLLM's error shape, outcome ``tool_failed``; a request
without a usable ``x-request-id`` is answered 400, outcome ``tool_failed``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import os
import socket
import struct
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from email.utils import formatdate
from typing import Any, NoReturn

from router_sidecar.runtime.supervise import listen_socket, stop_on_signals
from router_testbed.sim import generation as gen
from router_testbed.sim import toolcall
from router_testbed.sim.faults import (
    DONE,
    HEADER,
    HEADERS,
    ROLE,
    TOOL,
    Clause,
    FaultPlan,
    FaultSpecError,
    Point,
    after_point,
    parse_attempt,
    parse_fault_spec,
    token_point,
)
from router_testbed.sim.log import RequestLog

MAX_HEAD = 64 * 1024
MAX_BODY = 16 * 1024 * 1024
FLUSH_TIMEOUT = 1.0

_REASONS = {
    200: "OK",
    400: "Bad Request",
    404: "Not Found",
    405: "Method Not Allowed",
    413: "Request Entity Too Large",
    431: "Request Header Fields Too Large",
    500: "Internal Server Error",
    502: "Bad Gateway",
    503: "Service Unavailable",
}
_GEN_PATHS = {"/v1/chat/completions": "chat", "/v1/completions": "completion"}


@dataclass(frozen=True)
class SimConfig:
    host: str
    port: int
    name: str = ""  # empty: the bound listen address
    model: str = "tiny"
    prefill_delay: float = 0.02
    token_interval: float = 0.005
    log_path: str | None = None
    seed: int = 0
    max_model_len: int = gen.DEFAULT_MAX_MODEL_LEN
    tool_url: str | None = None  # agent-worker mode: call this tool before every generation
    tool_timeout: float = toolcall.DEFAULT_TOOL_TIMEOUT
    dialect: str = "vllm"  # a key of generation.DIALECTS


# --------------------------------------------------------------------------- connection


class BadRequest(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class Request:
    method: str
    target: str
    version: str
    headers: dict[str, str]
    body: bytes

    @property
    def path(self) -> str:
        return self.target.split("?", 1)[0]

    @property
    def keep_alive(self) -> bool:
        conn = self.headers.get("connection", "").lower()
        if self.version == "HTTP/1.0":
            return "keep-alive" in conn
        return "close" not in conn


class Connection:
    """One client connection: a pump task reads everything into a buffer so EOF is seen at once."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.buf = bytearray()
        self.eof = asyncio.Event()
        self.gone_at: float | None = None
        self._data = asyncio.Event()
        self._pump_task = asyncio.create_task(self._pump())

    async def _pump(self) -> None:
        try:
            while True:
                data = await self.reader.read(65536)
                if not data:
                    break
                self.buf += data
                self._data.set()
        except (ConnectionError, OSError):
            pass
        finally:
            self.gone_at = time.time()
            self.eof.set()
            self._data.set()

    async def _more(self) -> None:
        if self.eof.is_set():
            raise EOFError
        self._data.clear()
        await self._data.wait()

    async def read_until(self, sep: bytes, limit: int) -> bytes:
        while True:
            idx = self.buf.find(sep)
            if idx >= 0:
                out = bytes(self.buf[: idx + len(sep)])
                del self.buf[: idx + len(sep)]
                return out
            if len(self.buf) > limit:
                raise BadRequest(431, "request head too large")
            await self._more()

    async def read_exact(self, n: int) -> bytes:
        while len(self.buf) < n:
            await self._more()
        out = bytes(self.buf[:n])
        del self.buf[:n]
        return out

    async def read_request(self) -> Request | None:
        """The next request, or ``None`` when the client closed the connection between requests."""
        try:
            head = await self.read_until(b"\r\n\r\n", MAX_HEAD)
        except EOFError:
            return None
        lines = head[:-4].decode("latin-1").split("\r\n")
        parts = lines[0].split(" ")
        if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
            raise BadRequest(400, "malformed request line")
        headers: dict[str, str] = {}
        for line in lines[1:]:
            name, sep, value = line.partition(":")
            if not sep:
                raise BadRequest(400, "malformed header line")
            headers[name.strip().lower()] = value.strip()
        if headers.get("expect", "").lower() == "100-continue":
            self.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        try:
            body = await self._read_body(headers)
        except EOFError:
            return None
        return Request(parts[0], parts[1], parts[2], headers, body)

    async def _read_body(self, headers: dict[str, str]) -> bytes:
        if "chunked" in headers.get("transfer-encoding", "").lower():
            out = bytearray()
            while True:
                size_line = await self.read_until(b"\r\n", MAX_HEAD)
                try:
                    size = int(size_line.split(b";", 1)[0].strip(), 16)
                except ValueError:
                    raise BadRequest(400, "bad chunk size") from None
                if size == 0:
                    while await self.read_until(b"\r\n", MAX_HEAD) != b"\r\n":
                        pass  # trailers
                    return bytes(out)
                if len(out) + size > MAX_BODY:
                    raise BadRequest(413, "request body too large")
                out += await self.read_exact(size)
                if await self.read_exact(2) != b"\r\n":
                    raise BadRequest(400, "bad chunk terminator")
        length = headers.get("content-length")
        if length is None:
            return b""
        if not length.isdigit():
            raise BadRequest(400, "bad content-length")
        if int(length) > MAX_BODY:
            raise BadRequest(413, "request body too large")
        return await self.read_exact(int(length))

    @property
    def gone(self) -> bool:
        return self.eof.is_set() or self.writer.transport.is_closing()

    async def send(self, data: bytes) -> bool:
        """Write and drain; ``False`` if the client is gone."""
        if self.gone:
            return False
        self.writer.write(data)
        try:
            await self.writer.drain()
        except (ConnectionError, OSError):
            return False
        return not self.writer.transport.is_closing()

    async def wait_gone(self, timeout: float | None) -> bool:
        """Wait up to ``timeout`` seconds (forever if ``None``) for the client to go; ``True`` if it did."""
        if self.eof.is_set():
            return True
        try:
            await asyncio.wait_for(self.eof.wait(), timeout)
        except TimeoutError:
            return False
        return True

    async def flush(self) -> None:
        """Wait (bounded) until asyncio's write buffer is handed to the kernel."""
        deadline = time.monotonic() + FLUSH_TIMEOUT
        transport = self.writer.transport
        while transport.get_write_buffer_size() > 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.001)

    def reset(self) -> None:
        """Abort with a TCP RST (SO_LINGER 0, then close)."""
        sock = self.writer.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.writer.transport.abort()

    def close(self) -> None:
        self._pump_task.cancel()
        if not self.writer.transport.is_closing():
            self.writer.close()


# --------------------------------------------------------------------------- response heads


def _head(status: int, headers: Sequence[tuple[str, str]]) -> bytes:
    lines = [f"HTTP/1.1 {status} {_REASONS.get(status, 'Unknown')}"]
    lines.append(f"date: {formatdate(usegmt=True)}")
    lines.append("server: uvicorn")
    lines += [f"{k}: {v}" for k, v in headers]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def stream_head(replica: str, dialect: gen.Dialect = gen.VLLM) -> bytes:
    """Status line and headers of a streamed response (chat_stream.headers + ``x-sim-replica``)."""
    return _head(
        200,
        [
            ("content-type", "text/event-stream; charset=utf-8"),
            ("vary", "Origin"),
            ("x-sim-replica", replica),
            (dialect.transfer_encoding_header, "chunked"),
        ],
    )


def json_response(
    status: int, body: bytes, replica: str, content_type: str | None = "application/json", close: bool = False
) -> bytes:
    headers = [("content-length", str(len(body)))]
    if content_type is not None:
        headers.append(("content-type", content_type))
    headers += [("vary", "Origin"), ("x-sim-replica", replica)]
    if close:
        headers.append(("connection", "close"))
    return _head(status, headers) + body


# --------------------------------------------------------------------------- one generation request


class _End(Exception):
    """Unwinds a generation exchange; ``keep_alive`` says whether the connection can be reused."""

    def __init__(self, keep_alive: bool) -> None:
        super().__init__()
        self.keep_alive = keep_alive


@dataclass
class Exchange:
    sim: Simulator
    conn: Connection
    request: Request
    plan: FaultPlan
    record: dict[str, Any]
    greq: gen.GenRequest | None = None
    renderer: gen.StreamRenderer | None = None
    status: int | None = None
    headers_sent: bool = False
    events_written: int = 0
    content_events_written: int = 0
    outcome: str = "completed"
    abort_pending: bool = False
    client_gone_at: float | None = None
    fired: list[str] = field(default_factory=list)

    @property
    def streaming(self) -> bool:
        return self.greq is not None and self.greq.stream

    # -- logging
    def end_record(self) -> dict[str, Any]:
        rec = dict(self.record)
        rec.update(
            event="end",
            status=self.status,
            events_written=self.events_written,
            content_events_written=self.content_events_written,
            outcome=self.outcome,
            faults_fired=self.fired,
            t_end=time.time(),
            client_gone_at=self.client_gone_at,
        )
        return rec

    # -- I/O helpers
    def _note_gone(self) -> None:
        if self.client_gone_at is None:
            self.client_gone_at = self.conn.gone_at or time.time()

    def _client_gone(self) -> NoReturn:
        self._note_gone()
        if not self.outcome.startswith("fault:"):
            self.outcome = "client_gone"
        raise _End(False)

    async def send_raw(self, data: bytes) -> None:
        if not await self.conn.send(data):
            self._client_gone()

    async def send_reply(self, status: int, body: bytes) -> None:
        self.status = status
        await self.send_raw(json_response(status, body, self.sim.config.name))

    async def send_event(self, event: bytes, *, content: bool) -> None:
        await self.send_raw(gen.chunk(event))
        self.events_written += 1
        if content:
            self.content_events_written += 1

    async def sleep(self, seconds: float) -> None:
        if (self.conn.gone or seconds > 0) and await self.conn.wait_gone(seconds):
            self._client_gone()

    # -- faults
    async def at(self, point: Point) -> None:
        while (clause := self.plan.take(point)) is not None:
            self.fired.append(clause.label())
            await self.apply(clause)

    async def apply(self, clause: Clause) -> None:
        action = clause.action
        if action == "delay":
            await self.sleep(clause.duration or 0.0)
            return
        if action == "abort":
            self.abort_pending = True
            return
        if action == "stall":
            self.outcome = "fault:stall"
            if await self.conn.wait_gone(clause.duration):
                self._note_gone()
                raise _End(False)
            self.outcome = "completed"
            return
        self.outcome = f"fault:{action}"
        if action == "exit":
            await self.conn.flush()
            self.sim.log.write(self.end_record())
            os._exit(1)
        if action == "reset":
            await self.conn.flush()
            self.conn.reset()
            raise _End(False)
        if action == "close":
            if self.streaming and self.headers_sent:
                await self.send_raw(gen.LAST_CHUNK)
                raise _End(self.request.keep_alive)
            raise _End(False)
        if action == "error":
            if self.renderer is not None and self.headers_sent:
                for event in self.renderer.error_events(self.content_events_written):
                    await self.send_event(event, content=False)
                await self.send_raw(gen.LAST_CHUNK)
            else:
                await self.send_reply(*self.sim.dialect.failed_reply())
            raise _End(self.request.keep_alive)
        if action == "status503":
            await self.send_reply(503, self.sim.dialect.unavailable_error())
            raise _End(self.request.keep_alive)
        raise AssertionError(f"unhandled fault action {action}")  # pragma: no cover

    # -- the flows
    async def run(self, greq: gen.GenRequest) -> bool:
        self.greq = greq
        dialect = self.sim.dialect
        output = gen.plan_output(greq, self.sim.config.seed)
        meta = gen.StreamMeta(
            id=dialect.new_id(greq),
            created=int(time.time()),
            model=greq.model,
            fingerprint=self.sim.fingerprint,
        )
        try:
            if self.sim.tool_target is not None:
                output = toolcall.with_tool_result(output, await self._tool_call(greq))
            if greq.stream:
                self.renderer = dialect.renderer(greq, output, meta)
                await self._stream(self.renderer)
            else:
                await self._unary(greq, output, meta)
        except _End as end:
            return end.keep_alive and self.request.keep_alive
        return self.request.keep_alive

    async def _tool_call(self, greq: gen.GenRequest) -> str:
        """Agent-worker mode: the tool call, then the ``tool`` fault point; nothing written yet."""
        target = self.sim.tool_target
        assert target is not None
        h = self.request.headers
        try:
            outcome = await toolcall.call_tool(
                target,
                greq,
                request_id=h.get("x-request-id"),
                attempt_id=h.get("x-attempt-id"),
                authorization=h.get("authorization"),
                timeout=self.sim.config.tool_timeout,
            )
        except ValueError as exc:
            self.outcome = "tool_failed"
            self.record["tool_error"] = f"no tool key: {exc}"
            body = self.sim.dialect.bad_request_error(f"agent mode needs x-request-id: {exc}")
            await self.send_reply(400, body)
            raise _End(self.request.keep_alive) from None
        self.record.update(outcome.log_fields())
        if not outcome.ok or outcome.result is None:
            self.outcome = "tool_failed"
            await self.send_reply(502, toolcall.tool_failed_error(outcome, self.sim.dialect))
            raise _End(self.request.keep_alive)
        await self.at(TOOL)
        return outcome.result

    async def _stream(self, r: gen.StreamRenderer) -> None:
        cfg = self.sim.config
        await self.at(HEADERS)
        self.status = 200
        await self.send_raw(stream_head(cfg.name, self.sim.dialect))
        self.headers_sent = True
        await self.sleep(cfg.prefill_delay)
        await self.at(ROLE)
        role = r.role_event()
        if role is not None:
            await self.send_event(role, content=False)
        n = len(r.output.pieces)
        aborted = False
        for i in range(1, n + 1):
            if i > 1:
                await self.sleep(cfg.token_interval)
            await self.at(token_point(i))
            if self.abort_pending:
                if self.sim.dialect.abort_carries_token:
                    await self.send_event(r.content_event(i, "abort"), content=True)
                else:
                    await self.send_event(r.empty_event(self.content_events_written, "abort"), content=False)
                aborted = True
                break
            await self.send_event(r.content_event(i, r.natural_finish(i)), content=True)
            await self.at(after_point(i))
        if not aborted:
            await self.at(DONE)
            if self.abort_pending:
                await self.send_event(r.empty_event(self.content_events_written, "abort"), content=False)
                aborted = True
            elif r.separate_finish:
                await self.send_event(r.empty_event(n, r.output.finish_reason), content=False)
        usage = r.usage_event(self.content_events_written)
        if usage is not None:
            await self.send_event(usage, content=False)
        await self.send_event(gen.DONE_EVENT, content=False)
        await self.send_raw(gen.LAST_CHUNK)
        self.outcome = "fault:abort" if aborted else "completed"

    async def _unary(self, greq: gen.GenRequest, output: gen.Output, meta: gen.StreamMeta) -> None:
        cfg = self.sim.config
        await self.at(HEADERS)
        await self.sleep(cfg.prefill_delay)
        await self.at(ROLE)
        n = len(output.pieces)
        produced, finish = n, output.finish_reason
        for i in range(1, n + 1):
            if i > 1:
                await self.sleep(cfg.token_interval)
            await self.at(token_point(i))
            if self.abort_pending:
                produced = i if self.sim.dialect.abort_carries_token else i - 1
                finish = "abort"
                break
            await self.at(after_point(i))
        else:
            await self.at(DONE)
            if self.abort_pending:
                finish = "abort"
        await self.send_reply(200, self.sim.dialect.response_body(greq, output, meta, produced, finish))
        self.outcome = "fault:abort" if finish == "abort" else "completed"


# --------------------------------------------------------------------------- the server


class Simulator:
    def __init__(self, config: SimConfig) -> None:
        self.config = config
        self.dialect = gen.DIALECTS[config.dialect]
        self.log = RequestLog(config.log_path)
        self.fingerprint = gen.fingerprint_for(config.model, config.seed)
        self.tool_target = toolcall.parse_tool_url(config.tool_url) if config.tool_url else None
        self.started = int(time.time())
        self._conn_seq = 0
        self._conns: set[Connection] = set()

    async def handle_connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._conn_seq += 1
        conn_no = self._conn_seq
        conn = Connection(reader, writer)
        self._conns.add(conn)
        try:
            while True:
                try:
                    request = await conn.read_request()
                except BadRequest as exc:
                    body = self.dialect.bad_request_error(str(exc))
                    await conn.send(json_response(exc.status, body, self.config.name, close=True))
                    break
                if request is None:
                    break
                if not await self.handle_request(conn, conn_no, request):
                    break
        except (ConnectionError, OSError):
            pass
        except asyncio.CancelledError:
            pass  # shutdown: end the connection task quietly (3.11 logs cancelled stream callbacks)
        finally:
            self._conns.discard(conn)
            conn.close()

    async def handle_request(self, conn: Connection, conn_no: int, request: Request) -> bool:
        """Serve one request; return whether the connection may be reused."""
        name = self.config.name
        path = request.path
        kind = _GEN_PATHS.get(path)
        if kind is not None:
            if request.method != "POST":
                await conn.send(json_response(405, b'{"detail":"Method Not Allowed"}', name))
                return request.keep_alive
            return await self.handle_generation(conn, conn_no, request, kind)  # type: ignore[arg-type]
        info_paths = self.dialect.info_paths
        if request.method != "GET" or path not in info_paths:
            status = 405 if path in info_paths else 404
            detail = b'{"detail":"Method Not Allowed"}' if status == 405 else b'{"detail":"Not Found"}'
            await conn.send(json_response(status, detail, name))
            return request.keep_alive
        info = self.dialect.info_reply(path, self.config.model, self.started, self.config.max_model_len)
        reply = json_response(200, info.body, name, content_type=info.content_type)
        return await conn.send(reply) and request.keep_alive

    async def handle_generation(
        self, conn: Connection, conn_no: int, request: Request, kind: gen.Kind
    ) -> bool:
        h = request.headers
        raw_fault = h.get(HEADER)
        attempt = parse_attempt(h.get("x-envoy-attempt-count"))
        record: dict[str, Any] = {
            "event": "start",
            "replica": self.config.name,
            "request_id": h.get("x-request-id"),
            "attempt_id": h.get("x-attempt-id"),
            "attempt_count": attempt if attempt is not None else h.get("x-envoy-attempt-count"),
            "path": request.path,
            "stream": None,
            "fault": raw_fault,
            "pid": os.getpid(),
            "conn": conn_no,
            "t_start": time.time(),
        }
        if h.get("traceparent"):  # the W3C trace context the gateway sent for this attempt
            record["traceparent"] = h.get("traceparent")
        if h.get("idempotency-key"):  # the client's key, if the gateway passed it on: how the drill finds a
            record["idempotency_key"] = h.get("idempotency-key")  # request behind a gateway without a journal
        error: tuple[int, bytes] | None = None
        greq: gen.GenRequest | None = None
        clauses: list[Clause] = []
        try:
            clauses = parse_fault_spec(raw_fault)
            greq = gen.parse_request(
                kind,
                request.body,
                served_model=self.config.model,
                max_model_len=self.config.max_model_len,
                dialect=self.dialect,
            )
            record["stream"] = greq.stream
        except FaultSpecError as exc:
            error = (400, self.dialect.bad_request_error(str(exc), HEADER))
        except gen.RequestError as exc:
            error = (exc.status, exc.body)
        self.log.write(record)
        plan = FaultPlan(clauses, attempt=attempt, replica=self.config.name)
        ex = Exchange(self, conn, request, plan, record)
        keep = False
        try:
            if error is not None or greq is None:
                status, body = error or self.dialect.failed_reply()
                try:
                    await ex.send_reply(status, body)
                    keep = request.keep_alive
                except _End as end:
                    keep = end.keep_alive
            else:
                keep = await ex.run(greq)
        except asyncio.CancelledError:
            ex.outcome = "shutdown"
            raise
        finally:
            self.log.write(ex.end_record())
        return keep

    def close_connections(self) -> None:
        for conn in list(self._conns):
            conn.close()


def parse_listen(value: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit():
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {value!r}")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host or "127.0.0.1", int(port)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="router-testbed sim", description="vLLM 0.32 / SGLang 0.5.23 replica simulator"
    )
    p.add_argument("--listen", required=True, type=parse_listen, help="HOST:PORT (port 0 = any free port)")
    p.add_argument("--name", default=None, help="replica name (default: the listen address)")
    p.add_argument("--model", default="tiny", help="served model name")
    p.add_argument("--prefill-delay", type=float, default=0.02, help="seconds before the first token")
    p.add_argument("--token-interval", type=float, default=0.005, help="seconds between tokens")
    p.add_argument("--log", default=None, help="JSONL request log (appended)")
    p.add_argument("--seed", type=int, default=0, help="server seed (used when a request has none)")
    p.add_argument("--max-model-len", type=int, default=gen.DEFAULT_MAX_MODEL_LEN)
    p.add_argument(
        "--dialect",
        choices=sorted(gen.DIALECTS),
        default="vllm",
        help="whose OpenAI server to speak: ids, events, errors, endpoints (default %(default)s)",
    )
    p.add_argument(
        "--tool-url",
        default=None,
        type=_tool_url,
        help="agent-worker mode: POST one tool call to this http:// URL before every generation",
    )
    p.add_argument(
        "--tool-timeout",
        type=_positive_seconds,
        default=toolcall.DEFAULT_TOOL_TIMEOUT,
        help="seconds a tool call may take in total (default %(default)s)",
    )
    return p


def _tool_url(value: str) -> str:
    try:
        toolcall.parse_tool_url(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return value


def _positive_seconds(value: str) -> float:
    try:
        seconds = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {value!r}") from None
    if not seconds > 0 or seconds == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a finite number of seconds > 0, got {value!r}")
    return seconds


def config_from_args(argv: Sequence[str] | None) -> SimConfig:
    args = build_parser().parse_args(argv)
    host, port = args.listen
    return SimConfig(
        host=host,
        port=port,
        name=args.name or "",
        model=args.model,
        prefill_delay=args.prefill_delay,
        token_interval=args.token_interval,
        log_path=args.log,
        seed=args.seed,
        max_model_len=args.max_model_len,
        tool_url=args.tool_url,
        tool_timeout=args.tool_timeout,
        dialect=args.dialect,
    )


async def serve(config: SimConfig) -> int:
    sock, address = listen_socket(config.host, config.port)
    if not config.name:
        config = dataclasses.replace(config, name=address)
    sim = Simulator(config)
    server = await asyncio.start_server(sim.handle_connection, sock=sock)
    print(f"sim {config.name} listening on {address}", flush=True)
    with stop_on_signals() as stop:
        try:
            await stop.wait()
        finally:
            server.close()
            sim.close_connections()
    return 0


def main(argv: list[str] | None = None) -> int:
    config = config_from_args(argv)
    try:
        return asyncio.run(serve(config))
    except KeyboardInterrupt:
        return 0


if __name__ == "__main__":
    sys.exit(main())
