"""The simulator's agent-worker mode: one side-effecting tool call before a generation streams.

With ``--tool-url URL`` every generation request first POSTs (HTTP/1.1, raw asyncio, one connection
per call, bounded by ``--tool-timeout``)::

    POST <path of URL>
    Idempotency-Key: <tool_idempotency_key(x-request-id, 1)>
    x-attempt-id: <x-attempt-id>
    Authorization: <copied from the generation request, if it had one>

    {"request_id": ..., "attempt_id": ..., "call": 1, "args": {...}}

``args`` depend only on the prompt and model, so every attempt of one logical request describes the
same action. The tool's ``"result"`` becomes the first content event's text (``"tool:<result>"``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import json
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from router_sidecar.core.tool_keys import tool_idempotency_key
from router_testbed.sim import generation as gen

TOOL_CALL_NUMBER = 1
DEFAULT_TOOL_TIMEOUT = 5.0
MAX_REPLY_HEAD = 64 * 1024
MAX_REPLY_BODY = 16 * 1024 * 1024
REPLAY_HEADER = "x-idempotent-replay"


@dataclass(frozen=True)
class ToolTarget:
    """Where the tool lives: parsed from ``--tool-url`` (``http://HOST:PORT/path?query``)."""

    url: str
    host: str
    port: int
    target: str  # request target: path + query

    @property
    def host_header(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"


def parse_tool_url(url: str) -> ToolTarget:
    """Validate ``--tool-url``; only plain ``http://`` is supported. Raises :class:`ValueError`."""
    parts = urlsplit(url)
    if parts.scheme != "http":
        raise ValueError(f"tool URL must be http://HOST[:PORT]/PATH, got {url!r}")
    if not parts.hostname:
        raise ValueError(f"tool URL has no host: {url!r}")
    try:
        port = parts.port or 80
    except ValueError:
        raise ValueError(f"tool URL has a bad port: {url!r}") from None
    target = parts.path or "/"
    if parts.query:
        target += "?" + parts.query
    return ToolTarget(url=url, host=parts.hostname, port=port, target=target)


def tool_args(greq: gen.GenRequest) -> dict[str, Any]:
    """The tool call's arguments: a pure function of the prompt and model (identical on every attempt)."""
    digest = hashlib.sha256(f"{greq.model}\0{greq.prompt_text}".encode()).hexdigest()
    return {"prompt_sha256": digest[:16], "amount_cents": int(digest[16:24], 16) % 100000}


def tool_body(request_id: str, attempt_id: str | None, greq: gen.GenRequest) -> bytes:
    # The body names the logical action only: every attempt must send the same bytes under the same key
    # (the gateway rejects a key reused with another body). The attempt travels as x-attempt-id.
    del attempt_id
    body = {"request_id": request_id, "call": TOOL_CALL_NUMBER, "args": tool_args(greq)}
    return gen.dumps(body).encode()


@dataclass
class ToolReply:
    status: int
    headers: dict[str, str]
    body: bytes

    @property
    def ok(self) -> bool:
        return 200 <= self.status < 300

    @property
    def replayed(self) -> bool:
        return self.headers.get(REPLAY_HEADER, "").strip().lower() == "true"

    def result(self) -> str | None:
        """The ``"result"`` string of a JSON object body, else ``None``."""
        try:
            payload = json.loads(self.body)
        except (json.JSONDecodeError, UnicodeDecodeError):
            return None
        if isinstance(payload, dict) and isinstance(payload.get("result"), str):
            return payload["result"]
        return None


class ToolCallError(Exception):
    """The tool call did not produce a response (connection refused/reset, timeout, bad framing)."""


@dataclass
class ToolOutcome:
    """What the request log records about the tool call."""

    key: str
    status: int | None = None
    replayed: bool = False
    result: str | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    def log_fields(self) -> dict[str, Any]:
        return {
            "tool_key": self.key,
            "tool_status": self.status,
            "tool_replayed": self.replayed,
            "tool_result": self.result,
            "tool_error": self.error,
        }


def _request_bytes(target: ToolTarget, body: bytes, headers: list[tuple[str, str]]) -> bytes:
    lines = [f"POST {target.target} HTTP/1.1", f"host: {target.host_header}"]
    lines += ["content-type: application/json", f"content-length: {len(body)}", "connection: close"]
    lines += [f"{k}: {v}" for k, v in headers]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


def _parse_head(head: bytes) -> tuple[int, dict[str, str]]:
    lines = head[:-4].decode("latin-1").split("\r\n")
    parts = lines[0].split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
        raise ToolCallError(f"malformed status line {lines[0]!r}")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if not sep:
            raise ToolCallError(f"malformed header line {line!r}")
        headers[name.strip().lower()] = value.strip()
    return int(parts[1]), headers


async def _read_body(reader: asyncio.StreamReader, headers: dict[str, str]) -> bytes:
    if "chunked" in headers.get("transfer-encoding", "").lower():
        out = bytearray()
        while True:
            size_line = await reader.readuntil(b"\r\n")
            try:
                size = int(size_line.split(b";", 1)[0].strip(), 16)
            except ValueError:
                raise ToolCallError(f"bad chunk size line {size_line!r}") from None
            if size == 0:
                while await reader.readuntil(b"\r\n") != b"\r\n":
                    pass  # trailers
                return bytes(out)
            if len(out) + size > MAX_REPLY_BODY:
                raise ToolCallError("tool response body too large")
            out += await reader.readexactly(size)
            if await reader.readexactly(2) != b"\r\n":
                raise ToolCallError("bad chunk terminator")
    length = headers.get("content-length")
    if length is not None:
        if not length.isdigit() or int(length) > MAX_REPLY_BODY:
            raise ToolCallError(f"bad or too large content-length {length!r}")
        return await reader.readexactly(int(length))
    out = bytearray()  # close-delimited
    while data := await reader.read(65536):
        out += data
        if len(out) > MAX_REPLY_BODY:
            raise ToolCallError("tool response body too large")
    return bytes(out)


async def _exchange(target: ToolTarget, request: bytes) -> ToolReply:
    reader, writer = await asyncio.open_connection(target.host, target.port, limit=MAX_REPLY_HEAD)
    try:
        writer.write(request)
        await writer.drain()
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            status, headers = _parse_head(head)
            if status >= 200 or status == 101:
                break  # skip interim 1xx responses
        return ToolReply(status, headers, await _read_body(reader, headers))
    finally:
        writer.close()
        with contextlib.suppress(Exception):
            await writer.wait_closed()


async def post(target: ToolTarget, body: bytes, headers: list[tuple[str, str]], timeout: float) -> ToolReply:
    """One POST; raises :class:`ToolCallError` for anything that is not a complete HTTP response."""
    try:
        return await asyncio.wait_for(_exchange(target, _request_bytes(target, body, headers)), timeout)
    except TimeoutError:
        raise ToolCallError(f"no response within {timeout}s") from None
    except asyncio.IncompleteReadError as exc:
        raise ToolCallError(f"connection closed mid-response after {len(exc.partial)} bytes") from None
    except asyncio.LimitOverrunError:
        raise ToolCallError("tool response head too large") from None
    except (ConnectionError, OSError) as exc:
        raise ToolCallError(f"{type(exc).__name__}: {exc}") from None


async def call_tool(
    target: ToolTarget,
    greq: gen.GenRequest,
    *,
    request_id: str | None,
    attempt_id: str | None,
    authorization: str | None,
    timeout: float,
) -> ToolOutcome:
    """Make the worker's tool call number 1 for this request; never raises for tool failures.

    Raises :class:`ValueError` when no valid tool key can be derived from ``request_id``.
    """
    key = tool_idempotency_key(request_id or "", TOOL_CALL_NUMBER)
    assert request_id is not None
    headers = [("idempotency-key", key)]
    if attempt_id is not None:
        headers.append(("x-attempt-id", attempt_id))
    if authorization is not None:
        headers.append(("authorization", authorization))
    outcome = ToolOutcome(key=key)
    try:
        reply = await post(target, tool_body(request_id, attempt_id, greq), headers, timeout)
    except ToolCallError as exc:
        outcome.error = str(exc)
        return outcome
    outcome.status = reply.status
    outcome.replayed = reply.replayed
    if not reply.ok:
        outcome.error = f"tool answered HTTP {reply.status}"
        return outcome
    outcome.result = reply.result()
    if outcome.result is None:
        outcome.error = f'tool answered HTTP {reply.status} without a JSON string "result"'
    return outcome


def with_tool_result(output: gen.Output, result: str) -> gen.Output:
    """``output`` with the first content event's text replaced by ``"tool:<result>"``.

    The number of content events (= tokens) is unchanged. Tool-call outputs (no text) are left alone.
    """
    if not output.pieces:
        return output
    first = output.pieces[0]
    text = f"tool:{result}"
    if isinstance(first, str):
        new: Any = text
    elif isinstance(first, dict) and isinstance(first.get("content"), str):
        new = {**first, "content": text}
    else:
        return output
    return dataclasses.replace(output, pieces=(new, *output.pieces[1:]))


def tool_failed_error(outcome: ToolOutcome, dialect: gen.Dialect = gen.VLLM) -> bytes:
    """The dialect's 502 error body for a failed tool call; the message names the tool status."""
    status = "none" if outcome.status is None else str(outcome.status)
    message = f"tool call {outcome.key} failed (tool status {status}): {outcome.error}"
    return dialect.error_body(message, "BadGatewayError", None, 502)
