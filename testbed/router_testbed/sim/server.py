"""A vLLM 0.32 / SGLang 0.5.23 replica simulator: OpenAI-compatible HTTP/1.1 on raw asyncio streams, with
faults, on ``/v1/chat/completions``, ``/v1/completions``, ``/v1/responses`` (with ``GET /v1/responses/{id}``
and ``POST /v1/responses/{id}/cancel``) and ``/v1/messages``.

Run: ``python -m router_testbed.sim --listen 127.0.0.1:0 --name r1 --log /tmp/r1.jsonl [--dialect sglang]``.
It prints ``sim NAME listening on HOST:PORT`` (the bound port, so ``:0`` works) once the socket is bound and
exits 0 on SIGTERM/SIGINT. See :mod:`router_testbed.sim.faults` for the ``x-sim-fault`` grammar (every fault
works in both dialects) and :class:`router_testbed.sim.generation.Dialect` for what differs between them.
The request log is the same in both: it records the ``x-request-id``/``x-attempt-id`` received, the API
(``api``) and the id the replica gave its answer (``response_id``). Every API runs through one flow
(:meth:`Exchange._stream`, :meth:`Exchange._unary`) with the same fault points; what each API writes at them
is its :class:`router_testbed.sim.generation.ApiStream`. The Responses API's store (``--responses-store``,
vLLM's ``VLLM_ENABLE_RESPONSES_API_STORE=1``) is :class:`StoredResponse` entries on the :class:`Simulator`;
a ``background: true`` run is a task of its own that outlives its connection.

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
import json
import os
import re
import socket
import struct
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from email.utils import formatdate
from typing import Any, NoReturn
from urllib.parse import parse_qs, urlsplit

from router_sidecar.runtime.supervise import listen_socket, stop_on_signals
from router_testbed.sim import generation as gen
from router_testbed.sim import messages as messages_api
from router_testbed.sim import toolcall
from router_testbed.sim.faults import (
    DONE,
    HEADER,
    HEADERS,
    ROLE,
    TERMINAL,
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
    429: "Too Many Requests",
    431: "Request Header Fields Too Large",
    500: "Internal Server Error",
    502: "Bad Gateway",
    503: "Service Unavailable",
}
_GEN_PATHS = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "completion",
    "/v1/responses": "responses",
    "/v1/messages": "messages",
}
_STORED_PATH = re.compile(r"^/v1/responses/(?P<id>[^/]+)(?P<cancel>/cancel)?$")


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
    responses_store: bool = False  # vLLM's VLLM_ENABLE_RESPONSES_API_STORE=1


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
    status: int,
    body: bytes,
    replica: str,
    content_type: str | None = "application/json",
    close: bool = False,
    vary: bool = True,
    extra_headers: Sequence[tuple[str, str]] = (),
) -> bytes:
    headers = [("content-length", str(len(body)))]
    if content_type is not None:
        headers.append(("content-type", content_type))
    if vary:
        headers.append(("vary", "Origin"))
    headers.extend(extra_headers)
    headers.append(("x-sim-replica", replica))
    if close:
        headers.append(("connection", "close"))
    return _head(status, headers) + body


# --------------------------------------------------------------------------- the Responses API's store


@dataclass
class StoredResponse:
    """One response a replica holds (``--responses-store``, vLLM's ``VLLM_ENABLE_RESPONSES_API_STORE``):
    the response object as ``GET /v1/responses/{id}`` answers it (``queued`` until a background run ends),
    the conversation it closes (for a later ``previous_response_id``) and, for a background stream, every
    event as written (``GET …?stream=true&starting_after=N`` replays from there)."""

    id: str
    response: dict[str, Any]
    prompt: str
    output_text: str = ""
    events: list[bytes] | None = None
    finished: bool = False  # the run ended (with or without response.completed)
    cancelled: bool = False  # by POST /v1/responses/{id}/cancel
    task: asyncio.Task[Any] | None = None
    _changed: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def status(self) -> str:
        return str(self.response.get("status"))

    def changed(self) -> asyncio.Event:
        """Set at the next change (an event appended, the run's end); take it before looking."""
        return self._changed

    def notify(self) -> None:
        event, self._changed = self._changed, asyncio.Event()
        event.set()


# --------------------------------------------------------------------------- one generation request


class _End(Exception):
    """Unwinds a generation exchange; ``keep_alive`` says whether the connection can be reused."""

    def __init__(self, keep_alive: bool) -> None:
        super().__init__()
        self.keep_alive = keep_alive


@dataclass
class Exchange:
    """One generation request on one connection, any API. A background Responses run (``background: true``
    with the store on) keeps generating when its client is gone: it is *detached* from the connection, and
    its stream's events go to its :class:`StoredResponse` only."""

    sim: Simulator
    conn: Connection
    request: Request
    plan: FaultPlan
    record: dict[str, Any]
    greq: gen.GenRequest | None = None
    stream: gen.ApiStream | None = None
    status: int | None = None
    headers_sent: bool = False
    events_written: int = 0
    content_events_written: int = 0
    outcome: str = "completed"
    finish_pending: str | None = None  # "abort" | "stop": the next content boundary ends the generation
    client_gone_at: float | None = None
    fired: list[str] = field(default_factory=list)
    entry: StoredResponse | None = None  # a background run's store entry
    detached: bool = False
    released: asyncio.Event = field(default_factory=asyncio.Event)  # the connection is no longer needed
    release_keep_alive: bool = False

    @property
    def streaming(self) -> bool:
        return self.greq is not None and self.greq.stream

    @property
    def background(self) -> bool:
        return self.entry is not None

    @property
    def kind(self) -> gen.Kind:
        return self.greq.kind if self.greq is not None else "chat"

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

    def detach(self, keep_alive: bool = False) -> None:
        """A background run goes on without its connection (the client left, or a fault ended it); the log's
        end record says when (``detached_at``), its outcome is the run's."""
        self.detached = True
        self.record.setdefault("detached_at", time.time())
        self.release(keep_alive)

    def release(self, keep_alive: bool) -> None:
        if not self.released.is_set():
            self.release_keep_alive = keep_alive and self.request.keep_alive
            self.released.set()

    def _client_gone(self) -> None:
        """The client went away: the exchange ends, unless it is a background run, which detaches."""
        self._note_gone()
        if self.background:
            self.detach()
            return
        if not self.outcome.startswith("fault:"):
            self.outcome = "client_gone"
        raise _End(False)

    async def send_raw(self, data: bytes) -> None:
        if self.detached:
            return
        if not await self.conn.send(data):
            self._client_gone()

    async def send_reply(
        self, status: int, body: bytes, extra_headers: Sequence[tuple[str, str]] = ()
    ) -> None:
        self.status = status
        await self.send_raw(json_response(status, body, self.sim.config.name, extra_headers=extra_headers))

    async def send_event(self, event: bytes, *, content: bool) -> None:
        if self.entry is not None and self.entry.events is not None:
            self.entry.events.append(event)
            self.entry.notify()
        await self.send_raw(gen.chunk(event))
        self.events_written += 1
        if content:
            self.content_events_written += 1

    async def sleep(self, seconds: float) -> None:
        if self.detached:
            await asyncio.sleep(seconds)
            return
        if (self.conn.gone or seconds > 0) and await self.conn.wait_gone(seconds):
            self._client_gone()
            if self.detached and seconds > 0:
                await asyncio.sleep(seconds)  # a background run keeps its pace

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
        if action in ("abort", "stop"):
            self.finish_pending = self.finish_pending or action
            return
        if action == "oversize":
            return  # the event was rendered big from the start (FaultPlan.oversized)
        if action == "stall":
            self.outcome = "fault:stall"
            if self.detached:
                await asyncio.sleep(clause.duration or 0.0)
            elif await self.conn.wait_gone(clause.duration):
                self._note_gone()
                if not self.background:
                    raise _End(False)
                self.detach()
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
            if self.background and self.streaming:
                self.detach()
                return
            raise _End(False)
        if action == "close":
            if self.streaming and self.headers_sent:
                await self.send_raw(gen.LAST_CHUNK)
                if self.background:
                    self.detach(keep_alive=True)
                    return
                raise _End(self.request.keep_alive)
            raise _End(False)
        if action == "error":
            await self._fail()
        if action in ("status503", "status429"):
            which = "unavailable" if action == "status503" else "too_many"
            extra = []
            if clause.retry_after is not None:
                extra.append(("retry-after", clause.retry_after.header_value(time.time())))
                self.record["retry_after"] = extra[0][1]
            await self.send_reply(*self.sim.dialect.api_error(self.kind, which), extra_headers=extra)
            raise _End(self.request.keep_alive)
        raise AssertionError(f"unhandled fault action {action}")  # pragma: no cover

    async def _fail(self) -> NoReturn:
        """The engine's in-band failure, as each API writes it (status already 200), else its error reply."""
        if self.stream is not None and self.headers_sent:
            events, terminated = self.stream.failure(self.content_events_written)
            for event in events:
                await self.send_event(event, content=False)
            if terminated:
                await self.send_raw(gen.LAST_CHUNK)
                raise _End(self.request.keep_alive)
            if not self.detached:  # the stream just stops: the connection closes without its last chunk
                await self.conn.flush()
                self.conn.close()
            raise _End(False)
        if not self.detached:
            await self.send_reply(*self.sim.dialect.api_error(self.kind, "failed"))
        raise _End(self.request.keep_alive)

    # -- the flows
    async def run(self, greq: gen.GenRequest) -> bool:
        self.greq = greq
        dialect = self.sim.dialect
        output = gen.with_oversize(gen.plan_output(greq, self.sim.config.seed), self.plan.oversized())
        meta = gen.StreamMeta(
            id=dialect.new_id(greq),
            created=int(time.time()),
            model=greq.model,
            fingerprint=self.sim.fingerprint,
        )
        self.record["response_id"] = meta.id
        try:
            if self.sim.tool_target is not None:
                output = toolcall.with_tool_result(output, await self._tool_call(greq))
            if greq.stream:
                self.stream = dialect.stream(greq, output, meta)
                await self._stream(self.stream)
            else:
                await self._unary(greq, output, meta)
        except _End as end:
            self.release(end.keep_alive)
            return end.keep_alive and self.request.keep_alive
        finally:
            if self.entry is not None:
                self.entry.finished = True
                self.entry.notify()
        self.release(True)
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

    def _begin_background(self, meta: gen.StreamMeta, greq: gen.GenRequest, *, events: bool) -> None:
        """``background: true``: the store holds the response as ``queued`` from now on."""
        from router_testbed.sim import responses

        self.entry = self.sim.store_entry(meta.id, responses.queued_object(greq, meta), greq.prompt_text)
        if events:
            self.entry.events = []
        self.entry.task = asyncio.current_task()

    async def _stream(self, s: gen.ApiStream) -> None:
        cfg = self.sim.config
        greq = self.greq
        assert greq is not None
        await self.at(HEADERS)
        if greq.kind == "responses" and greq.params.background:
            self._begin_background(s.meta, greq, events=True)  # type: ignore[attr-defined]
        self.status = 200
        await self.send_raw(stream_head(cfg.name, self.sim.dialect))
        self.headers_sent = True
        refusal = getattr(greq.params, "refusal", None)
        if refusal is not None:  # SGLang's Messages: a request over the context, refused in the stream
            for event in s.refusal(refusal):  # type: ignore[attr-defined]
                await self.send_event(event, content=False)
            await self.send_raw(gen.LAST_CHUNK)
            self.outcome = "refused"
            return
        for event in s.opening():
            await self.send_event(event, content=False)
        await self.sleep(cfg.prefill_delay)
        await self.at(ROLE)
        for event in s.role():
            await self.send_event(event, content=False)
        produced, finish, finish_sent, cut = 0, s.output.finish_reason, False, False  # type: ignore[attr-defined]
        carries = self.sim.dialect.abort_carries_token
        n = len(s.output.pieces)  # type: ignore[attr-defined]
        for i in range(1, n + 1):
            if i > 1:
                await self.sleep(cfg.token_interval)
            await self.at(token_point(i))
            if self.finish_pending is not None:
                finish, cut = self.finish_pending, True
                if finish == "abort" and not carries:
                    for event in s.finish_only(produced, finish):
                        await self.send_event(event, content=False)
                    finish_sent = True
                else:
                    carried = finish if carries else None
                    for event, content in s.piece(i, carried):
                        await self.send_event(event, content=content)
                    produced, finish_sent = i, carried is not None
                break
            natural = s.natural_finish(i)
            for event, content in s.piece(i, natural):
                await self.send_event(event, content=content)
            produced, finish_sent = i, natural is not None
            await self.at(after_point(i))
        if not cut:
            await self.at(DONE)
            if self.finish_pending is not None:
                finish, cut = self.finish_pending, True
                for event in s.finish_only(produced, finish):
                    await self.send_event(event, content=False)
                finish_sent = True
        for event in s.closing(produced, finish, finish_sent):
            await self.send_event(event, content=False)
        await self.at(TERMINAL)
        for event in s.terminal(produced, finish):
            await self.send_event(event, content=False)
        self._keep(greq, s.output, getattr(s, "final", None), produced)  # type: ignore[attr-defined]
        await self.send_raw(gen.LAST_CHUNK)
        self.outcome = f"fault:{finish}" if cut else "completed"

    async def _unary(self, greq: gen.GenRequest, output: gen.Output, meta: gen.StreamMeta) -> None:
        cfg = self.sim.config
        await self.at(HEADERS)
        if greq.kind == "responses" and greq.params.background:
            from router_testbed.sim import responses

            self._begin_background(meta, greq, events=False)
            await self.send_reply(200, gen.dumps(responses.queued_object(greq, meta)).encode())
            self.detach(keep_alive=True)  # the run goes on without the connection
        await self.sleep(cfg.prefill_delay)
        await self.at(ROLE)
        n = len(output.pieces)
        produced, finish = n, output.finish_reason
        for i in range(1, n + 1):
            if i > 1:
                await self.sleep(cfg.token_interval)
            await self.at(token_point(i))
            if self.finish_pending is not None:
                finish = self.finish_pending
                produced = i - 1 if finish == "abort" and not self.sim.dialect.abort_carries_token else i
                break
            await self.at(after_point(i))
        else:
            await self.at(DONE)
            if self.finish_pending is not None:
                finish = self.finish_pending
        await self.at(TERMINAL)
        body = self.sim.dialect.response_body(greq, output, meta, produced, finish)
        if greq.kind == "responses":
            self._keep(greq, output, json.loads(body), produced)
        if not self.detached:
            await self.send_reply(200, body)
        self.outcome = (
            "fault:abort" if finish == "abort" else "fault:stop" if finish == "stop" else "completed"
        )

    def _keep(
        self,
        greq: gen.GenRequest,
        output: gen.Output,
        final: dict[str, Any] | None,
        produced: int | None = None,
    ) -> None:
        """Store a finished Responses answer when the request asked for it and the store is on."""
        if greq.kind != "responses" or final is None or not greq.params.store:
            return
        text = output.text(produced)
        self.sim.store_final(final, greq.prompt_text, text)


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
        self.responses: dict[str, StoredResponse] = {}  # the Responses API's store (--responses-store)
        self._background: set[asyncio.Task[Any]] = set()

    # -- the store
    def store_entry(self, response_id: str, response: dict[str, Any], prompt: str) -> StoredResponse:
        entry = StoredResponse(response_id, response, prompt)
        self.responses[response_id] = entry
        return entry

    def store_final(self, response: dict[str, Any], prompt: str, output_text: str) -> None:
        if not self.config.responses_store:
            return
        entry = self.responses.get(str(response["id"]))
        if entry is None:
            self.store_entry(str(response["id"]), response, prompt).output_text = output_text
        elif entry.status != "cancelled":  # a cancelled background response stays cancelled
            entry.response, entry.output_text = response, output_text

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
        stored = _STORED_PATH.match(path)
        if stored is not None:
            return await self.handle_stored(conn, conn_no, request, stored["id"], bool(stored["cancel"]))
        info_paths = self.dialect.info_paths
        if request.method != "GET" or path not in info_paths:
            status = 405 if path in info_paths else 404
            detail = b'{"detail":"Method Not Allowed"}' if status == 405 else b'{"detail":"Not Found"}'
            await conn.send(json_response(status, detail, name))
            return request.keep_alive
        info = self.dialect.info_reply(path, self.config.model, self.started, self.config.max_model_len)
        reply = json_response(200, info.body, name, content_type=info.content_type)
        return await conn.send(reply) and request.keep_alive

    def _start_record(self, conn_no: int, request: Request, api: str) -> dict[str, Any]:
        h = request.headers
        attempt = parse_attempt(h.get("x-envoy-attempt-count"))
        record: dict[str, Any] = {
            "event": "start",
            "replica": self.config.name,
            "request_id": h.get("x-request-id"),
            "attempt_id": h.get("x-attempt-id"),
            "attempt_count": attempt if attempt is not None else h.get("x-envoy-attempt-count"),
            "path": request.path,
            "method": request.method,
            "api": api,
            "model": self.config.model,  # the model this replica serves (--model)
            "stream": None,
            "fault": h.get(HEADER),
            "pid": os.getpid(),
            "conn": conn_no,
            "t_start": time.time(),
        }
        if h.get("traceparent"):  # the W3C trace context the gateway sent for this attempt
            record["traceparent"] = h.get("traceparent")
        if h.get("idempotency-key"):  # the client's key, if the gateway passed it on: how the drill finds a
            record["idempotency_key"] = h.get("idempotency-key")  # request behind a gateway without a journal
        return record

    async def handle_generation(
        self, conn: Connection, conn_no: int, request: Request, kind: gen.Kind
    ) -> bool:
        h = request.headers
        raw_fault = h.get(HEADER)
        attempt = parse_attempt(h.get("x-envoy-attempt-count"))
        record = self._start_record(conn_no, request, kind)
        error: gen.RequestError | None = None
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
            greq = dataclasses.replace(greq, request_id=h.get("x-request-id"))
            record["stream"] = greq.stream
            if kind == "responses":
                greq = self._responses_state(greq, record)
        except FaultSpecError as exc:
            error = gen.RequestError(400, self.dialect.bad_request_error(str(exc), HEADER))
            if kind == "messages":
                error = gen.RequestError(400, messages_api.error_body("invalid_request_error", str(exc)))
        except gen.RequestError as exc:
            error = exc
        self.log.write(record)
        plan = FaultPlan(clauses, attempt=attempt, replica=self.config.name, model=self.config.model)
        ex = Exchange(self, conn, request, plan, record)
        if error is not None or greq is None:
            return await self._refuse(ex, error)
        if kind == "responses" and greq.params.background:
            return await self._run_background(ex, greq)
        keep = False
        try:
            keep = await ex.run(greq)
        except asyncio.CancelledError:
            ex.outcome = "shutdown"
            raise
        finally:
            self.log.write(ex.end_record())
        return keep

    def _responses_state(self, greq: gen.GenRequest, record: dict[str, Any]) -> gen.GenRequest:
        """What a Responses request needs of the store: ``background`` needs it on, ``previous_response_id``
        needs the response held here (its turns become part of the prompt)."""
        from router_testbed.sim import responses

        p: responses.ResponsesParams = greq.params
        store = p.store and self.config.responses_store
        record.update(store=store, background=p.background, previous_response_id=p.previous_response_id)
        if p.background and p.store and not self.config.responses_store:
            raise gen.RequestError(400, responses.background_without_store_error())
        greq = dataclasses.replace(greq, params=dataclasses.replace(p, store=store))
        if p.previous_response_id is None:
            return greq
        previous = self.responses.get(p.previous_response_id) if self.config.responses_store else None
        if previous is None:
            raise gen.RequestError(404, responses.not_found_error(p.previous_response_id))
        prompt = f"{previous.prompt}\nassistant: {previous.output_text}\n{p.input_text}"
        return responses.with_prompt(greq, prompt, self.config.max_model_len)

    async def _refuse(self, ex: Exchange, error: gen.RequestError | None) -> bool:
        request = ex.request
        status, body = (error.status, error.body) if error is not None else self.dialect.failed_reply()
        ex.outcome = "refused" if error is not None else "error"
        ex.status = status
        try:
            if error is not None and error.plain:  # an exception outside the app (SGLang's /v1/responses)
                reply = json_response(status, body, self.config.name, "text/plain; charset=utf-8", vary=False)
                await ex.send_raw(reply)
            else:
                await ex.send_reply(status, body)
            return request.keep_alive
        except _End as end:
            return end.keep_alive
        finally:
            self.log.write(ex.end_record())

    async def _run_background(self, ex: Exchange, greq: gen.GenRequest) -> bool:
        """``background: true``: the run is a task of its own that outlives the connection. The connection is
        answered (the queued object, or the stream while its client stays) and then released."""

        async def run() -> None:
            try:
                await ex.run(greq)
            except asyncio.CancelledError:
                if ex.entry is None or not ex.entry.cancelled:
                    ex.outcome = "shutdown"
                    raise
                ex.outcome = "cancelled"
                if ex.streaming and not ex.detached:
                    # vLLM's stream then waits for events that never come: its client hangs
                    await ex.conn.wait_gone(None)
                    ex._note_gone()
            finally:
                ex.release(False)
                self.log.write(ex.end_record())

        task = asyncio.create_task(run())
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        await ex.released.wait()
        return ex.release_keep_alive

    # -- GET /v1/responses/{id}, POST /v1/responses/{id}/cancel
    async def handle_stored(
        self, conn: Connection, conn_no: int, request: Request, response_id: str, cancel: bool
    ) -> bool:
        from router_testbed.sim import responses

        name = self.config.name
        want = "POST" if cancel else "GET"
        if request.method != want:
            await conn.send(json_response(405, b'{"detail":"Method Not Allowed"}', name))
            return request.keep_alive
        record = self._start_record(conn_no, request, "responses")
        record["response_id"] = response_id
        self.log.write(record)
        ex = Exchange(self, conn, request, FaultPlan([], attempt=None, replica=name), record)
        keep = request.keep_alive
        try:
            if not self.dialect.serves_responses:
                ex.status, ex.outcome = 500, "error"
                reply = json_response(
                    500, b"Internal Server Error", name, "text/plain; charset=utf-8", vary=False
                )
                await ex.send_raw(reply)
                return keep
            entry = self.responses.get(response_id) if self.config.responses_store else None
            if entry is None:
                ex.outcome = "not_found"
                await ex.send_reply(404, responses.not_found_error(response_id))
                return keep
            if cancel:
                return await self._cancel(ex, entry)
            query = parse_qs(urlsplit(request.target).query)
            stream = query.get("stream", ["false"])[-1].lower() in ("true", "1", "yes", "on")
            if not stream:
                await ex.send_reply(200, gen.dumps(entry.response).encode())
                return keep
            after = query.get("starting_after", [None])[-1]
            start = int(after) + 1 if after is not None and after.lstrip("-").isdigit() else 0
            return await self._replay(ex, entry, start)
        except _End as end:
            return end.keep_alive
        finally:
            self.log.write(ex.end_record())

    async def _cancel(self, ex: Exchange, entry: StoredResponse) -> bool:
        from router_testbed.sim import responses

        if entry.status not in ("queued", "in_progress"):
            ex.outcome = "refused"
            await ex.send_reply(400, responses.cannot_cancel_error())
            return ex.request.keep_alive
        entry.response = {**entry.response, "status": "cancelled"}
        entry.cancelled = True
        if entry.task is not None and not entry.task.done():
            entry.task.cancel()
        ex.outcome = "cancelled"
        await ex.send_reply(200, gen.dumps(entry.response).encode())
        return ex.request.keep_alive

    async def _replay(self, ex: Exchange, entry: StoredResponse, start: int) -> bool:
        """``GET …?stream=true&starting_after=N``: the events of a background stream from N+1 to
        ``response.completed``, as they come. vLLM 0.32 keeps events only for background streams: for any
        other response the stream fails after its status line (connection closed without the last chunk),
        and a run that dies before ``response.completed`` leaves its readers waiting."""
        ex.status = 200
        await ex.send_raw(stream_head(self.config.name, self.dialect))
        if entry.events is None:
            ex.outcome = "error"
            await ex.conn.flush()
            ex.conn.close()
            raise _End(False)
        index = max(start, 0)
        while True:
            while index >= len(entry.events):
                changed = entry.changed()
                waiter = asyncio.ensure_future(changed.wait())
                gone = asyncio.ensure_future(ex.conn.eof.wait())
                done, _ = await asyncio.wait({waiter, gone}, return_when=asyncio.FIRST_COMPLETED)
                for pending in (waiter, gone):
                    if pending not in done:
                        pending.cancel()
                if gone in done:
                    ex._client_gone()
            event = entry.events[index]
            index += 1
            await ex.send_raw(gen.chunk(event))
            ex.events_written += 1
            if event.startswith(b"event: response.completed\n"):
                await ex.send_raw(gen.LAST_CHUNK)
                return ex.request.keep_alive

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
        "--responses-store",
        action="store_true",
        help="keep Responses API answers in memory (vLLM's VLLM_ENABLE_RESPONSES_API_STORE=1): "
        "previous_response_id, GET /v1/responses/{id}, background: true",
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
        responses_store=args.responses_store,
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
