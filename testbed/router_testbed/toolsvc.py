"""A test tool service: counts side-effect executions, with faults chosen per request.

Run: ``python -m router_testbed.toolsvc --listen 127.0.0.1:0 --log /tmp/tool.jsonl [--name pay]``. It
prints ``toolsvc NAME listening on HOST:PORT`` once bound and exits 0 on SIGTERM/SIGINT. HTTP/1.1 with
keep-alive (``content-length`` or chunked request bodies).

``POST /tools/<tool>/<anything>`` executes the "side effect": the process-wide execution counter ``n``
goes up by one, a line ``{"event":"executed","n":n,"key":<Idempotency-Key>,"attempt_id":<x-attempt-id>,
"path":...,"body_sha256":...,"t":...,"fault":<x-tool-fault>,"auth_sha256":<16 hex of Authorization>}``
is appended to the log at once (one ``O_APPEND`` write), and the answer is
``200 {"result":"ok-<n>","execution":n,"key":<key>}``.
The counter starts after the highest ``n`` already in the log, so a restarted service never repeats one.

Request header ``x-tool-fault`` (clauses separated by ``;``):

* ``delay=SECONDS`` — execute and log, then sleep before answering (the side effect already happened);
  with ``status=``/``retriable503`` it delays the refusal instead.
* ``reset`` — execute and log, then abort the connection with a TCP RST without answering: the caller
  cannot know whether the call executed.
* ``status=CODE`` — answer ``CODE`` (200-599) *without* executing; logs ``"event":"refused"``.
* ``retriable503`` — answer 503 with ``x-tool-retriable: true`` without executing; logs ``"refused"``.
* ``big=BYTES`` — execute and answer a JSON body of exactly ``BYTES`` bytes (padded with a ``"pad"``
  field; a ``BYTES`` smaller than the unpadded body gives the unpadded body).

An unknown ``x-tool-fault`` is answered 400 without executing or logging.
``GET /executions`` returns the log's ``executed`` lines as a JSON list; ``GET /health`` returns 200.
Tests start the service with :func:`spawn_toolsvc` and read the log with :func:`read_executions`.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import hashlib
import json
import math
import os
import re
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

from router_sidecar.runtime.supervise import listen_socket, stop_on_signals
from router_testbed.sim.log import Record, RequestLog, read_log
from router_testbed.sim.process import SimProcess, _read_ready_line
from router_testbed.sim.server import BadRequest, Connection, Request, parse_listen

FAULT_HEADER = "x-tool-fault"
RETRIABLE_HEADER = "x-tool-retriable"
MAX_BIG = 64 * 1024 * 1024
_READY = re.compile(r"^toolsvc (?P<name>.+) listening on (?P<host>\[[^\]]+\]|[^:]+):(?P<port>\d+)$")


# --------------------------------------------------------------------------- x-tool-fault


@dataclass(frozen=True)
class ToolFault:
    delay: float | None = None
    reset: bool = False
    status: int | None = None
    retriable503: bool = False
    big: int | None = None

    @property
    def refuses(self) -> bool:
        return self.status is not None or self.retriable503


def parse_tool_fault(value: str | None) -> ToolFault:
    """Parse an ``x-tool-fault`` header; raises :class:`ValueError` naming the bad clause."""
    fault = ToolFault()
    if value is None:
        return fault
    seen: set[str] = set()
    for raw in value.split(";"):
        clause = raw.strip()
        if not clause:
            continue
        name, eq, arg = clause.partition("=")
        name = name.strip()
        arg = arg.strip()
        if name in seen:
            raise ValueError(f"x-tool-fault clause {clause!r}: {name} given twice")
        seen.add(name)
        if name in ("reset", "retriable503"):
            if eq:
                raise ValueError(f"x-tool-fault clause {clause!r}: {name} takes no value")
            fault = dataclasses.replace(fault, **{name: True})
        elif name == "delay" and eq:
            try:
                seconds = float(arg)
            except ValueError:
                seconds = -1.0
            if not math.isfinite(seconds) or seconds < 0:
                raise ValueError(f"x-tool-fault clause {clause!r}: delay needs a finite number >= 0")
            fault = dataclasses.replace(fault, delay=seconds)
        elif name == "status" and eq:
            if not arg.isdigit() or not 200 <= int(arg) <= 599:
                raise ValueError(f"x-tool-fault clause {clause!r}: status needs an HTTP code 200-599")
            fault = dataclasses.replace(fault, status=int(arg))
        elif name == "big" and eq:
            if not arg.isdigit() or int(arg) > MAX_BIG:
                raise ValueError(f"x-tool-fault clause {clause!r}: big needs a byte count 0-{MAX_BIG}")
            fault = dataclasses.replace(fault, big=int(arg))
        else:
            raise ValueError(
                f"x-tool-fault clause {clause!r}: expected delay=SECONDS, reset, status=CODE, "
                "retriable503 or big=BYTES"
            )
    if fault.status is not None and fault.retriable503:
        raise ValueError(f"x-tool-fault {value!r}: status= and retriable503 exclude each other")
    if fault.refuses and (fault.reset or fault.big is not None):
        raise ValueError(f"x-tool-fault {value!r}: a refusal does not execute, so reset/big cannot apply")
    if fault.reset and fault.big is not None:
        raise ValueError(f"x-tool-fault {value!r}: reset sends no answer, so big cannot apply")
    return fault


# --------------------------------------------------------------------------- responses


def dumps(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def response(
    status: int, body: bytes, name: str, *, keep_alive: bool, extra: Sequence[tuple[str, str]] = ()
) -> bytes:
    try:
        reason = HTTPStatus(status).phrase
    except ValueError:
        reason = "Unknown"
    lines = [f"HTTP/1.1 {status} {reason}", "content-type: application/json"]
    lines += [f"content-length: {len(body)}", f"x-toolsvc: {name}"]
    lines += [f"{k}: {v}" for k, v in extra]
    if not keep_alive:
        lines.append("connection: close")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


def result_body(n: int, key: str | None, big: int | None) -> bytes:
    body: dict[str, Any] = {"result": f"ok-{n}", "execution": n, "key": key}
    plain = dumps(body)
    if big is None or big <= len(plain):
        return plain
    body["pad"] = ""
    pad = big - len(dumps(body))
    if pad < 0:
        return plain
    body["pad"] = "x" * pad
    return dumps(body)


def _digest(value: str | None) -> str | None:
    """A short digest of a credential, so tests can check it was passed without logging it."""
    return None if value is None else hashlib.sha256(value.encode()).hexdigest()[:16]


def read_executions(path: str | os.PathLike[str]) -> list[Record]:
    """The ``executed`` lines of a tool service log, in order (a missing file is an empty list)."""
    return [r for r in read_log(path) if r.get("event") == "executed"]


# --------------------------------------------------------------------------- the server


class ToolService:
    def __init__(self, name: str, log_path: str) -> None:
        self.name = name
        self.log_path = log_path
        self.executions = max((int(r.get("n", 0)) for r in read_executions(log_path)), default=0)
        self.log = RequestLog(log_path)
        self._conns: set[Connection] = set()

    async def handle_connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = Connection(reader, writer)
        self._conns.add(conn)
        try:
            while True:
                try:
                    request = await conn.read_request()
                except BadRequest as exc:
                    body = dumps({"error": str(exc)})
                    await conn.send(response(exc.status, body, self.name, keep_alive=False))
                    break
                if request is None or not await self.handle_request(conn, request):
                    break
        except (ConnectionError, OSError, asyncio.CancelledError):
            pass
        finally:
            self._conns.discard(conn)
            conn.close()

    async def reply(
        self,
        conn: Connection,
        request: Request,
        status: int,
        body: Any,
        extra: Sequence[tuple[str, str]] = (),
    ) -> bool:
        data = body if isinstance(body, bytes) else dumps(body)
        keep = request.keep_alive
        return await conn.send(response(status, data, self.name, keep_alive=keep, extra=extra)) and keep

    async def handle_request(self, conn: Connection, request: Request) -> bool:
        """Serve one request; return whether the connection may be reused."""
        path = request.path
        parts = path.split("/")
        if path in ("/executions", "/health"):
            if request.method != "GET":
                return await self.reply(conn, request, 405, {"error": "method not allowed"})
            if path == "/health":
                return await self.reply(conn, request, 200, {"status": "ok", "name": self.name})
            return await self.reply(conn, request, 200, read_executions(self.log_path))
        if len(parts) >= 4 and parts[1] == "tools" and parts[2] and any(parts[3:]):
            if request.method != "POST":
                return await self.reply(conn, request, 405, {"error": "method not allowed"})
            return await self.tool_call(conn, request)
        return await self.reply(conn, request, 404, {"error": f"no route for {path}"})

    async def tool_call(self, conn: Connection, request: Request) -> bool:
        h = request.headers
        try:
            fault = parse_tool_fault(h.get(FAULT_HEADER))
        except ValueError as exc:
            return await self.reply(conn, request, 400, {"error": str(exc)})
        key = h.get("idempotency-key")
        facts: Record = {
            "key": key,
            "attempt_id": h.get("x-attempt-id"),
            "path": request.path,
            "body_sha256": hashlib.sha256(request.body).hexdigest(),
            "t": time.time(),
            "fault": h.get(FAULT_HEADER),
            "auth_sha256": _digest(h.get("authorization")),
        }
        if fault.refuses:
            status = 503 if fault.retriable503 else fault.status
            assert status is not None
            self.log.write({"event": "refused", "status": status, **facts})
            if fault.delay:
                await conn.wait_gone(fault.delay)
            extra = [(RETRIABLE_HEADER, "true")] if fault.retriable503 else []
            body = {"error": f"refused by {FAULT_HEADER}", "status": status, "key": key}
            return await self.reply(conn, request, status, body, extra)
        self.executions += 1
        n = self.executions
        self.log.write({"event": "executed", "n": n, **facts})
        if fault.delay:
            await conn.wait_gone(fault.delay)
        if fault.reset:
            await conn.flush()
            conn.reset()
            return False
        return await self.reply(conn, request, 200, result_body(n, key, fault.big))

    def close_connections(self) -> None:
        for conn in list(self._conns):
            conn.close()


async def serve(host: str, port: int, name: str | None, log_path: str) -> int:
    sock, address = listen_socket(host, port)
    svc = ToolService(name or address, log_path)
    server = await asyncio.start_server(svc.handle_connection, sock=sock)
    print(f"toolsvc {svc.name} listening on {address}", flush=True)
    with stop_on_signals() as stop:
        try:
            await stop.wait()
        finally:
            server.close()
            svc.close_connections()
            svc.log.close()
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="router-testbed toolsvc", description="test tool service")
    p.add_argument("--listen", required=True, type=parse_listen, help="HOST:PORT (port 0 = any free port)")
    p.add_argument("--log", required=True, help="JSONL execution log (appended)")
    p.add_argument("--name", default=None, help="service name (default: the listen address)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    host, port = args.listen
    try:
        return asyncio.run(serve(host, port, args.name, args.log))
    except KeyboardInterrupt:
        return 0


# --------------------------------------------------------------------------- spawning (tests)


class ToolSvcProcess(SimProcess):
    """A running tool service (stop/kill/url as :class:`~router_testbed.sim.process.SimProcess`)."""

    def tool_url(self, tool: str = "payments", action: str = "charge") -> str:
        return f"{self.url}/tools/{tool}/{action}"

    def executions(self) -> list[Record]:
        assert self.log_path is not None
        return read_executions(self.log_path)


def spawn_toolsvc(
    *,
    log_path: str | os.PathLike[str],
    name: str | None = None,
    host: str = "127.0.0.1",
    port: int = 0,
    timeout: float = 10.0,
    python: str = sys.executable,
    env: dict[str, str] | None = None,
) -> ToolSvcProcess:
    """Start one tool service and wait (up to ``timeout``) for its ready line. Always stop it."""
    cmd = [
        python,
        "-m",
        "router_testbed.toolsvc",
        "--listen",
        f"{host}:{port}",
        "--log",
        os.fspath(log_path),
    ]
    if name is not None:
        cmd += ["--name", name]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, env=env)
    try:
        line = _read_ready_line(proc, time.monotonic() + timeout, what="tool service")
        m = _READY.match(line)
        if m is None:
            raise RuntimeError(f"unexpected tool service output: {line!r}")
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    return ToolSvcProcess(proc, m["name"], m["host"].strip("[]"), int(m["port"]), os.fspath(log_path))


if __name__ == "__main__":
    sys.exit(main())
