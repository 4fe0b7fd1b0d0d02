"""A scriptable hostile replica: raw HTTP/1.1 on asyncio streams, standard library only.

Run: ``python -m tests.hostile_replica --listen 127.0.0.1:PORT --log FILE`` (from the repository root);
it prints ``hostile replica listening on HOST:PORT`` once bound and exits 0 on SIGTERM/SIGINT.
:class:`HostileReplica` starts it as a supervised child for tests, like ``tests.harness.Sim``.

Per request it reads the head and the body (Content-Length or chunked), appends one JSON line

    {"event": "request", "method", "path", "target", "headers": {name: [values…]}, "attempt",
     "request_id", "attempt_id", "scenario", "cid", "body_bytes", "body_sha256", "exchange", "t"}

then plays the scenario named by the request header ``x-hostile: NAME[:SIZE][;attempt=K[,K…]]`` (sizes
as ``123``, ``64KiB`` or ``8MiB``; the scenario applies only to the listed ``x-envoy-attempt-count``
values, default all; every other attempt gets a normal answer), and appends when done

    {"event": "end", "how": "complete"|"reset"|"closed"|"client_gone", "bytes_sent", "payload_bytes",
     "payload_sha256", "status", "client_gone_at", "cid", "request_id", "attempt", "exchange", "t"}

``how``: ``complete`` = the response was written to its end (framing intact); ``closed`` / ``reset`` = the
scenario itself closed the connection (FIN) / aborted it (RST) mid-response; ``client_gone`` = the peer
(Envoy) closed or reset the connection while the response was being written: a cancel. ``payload_*``
describe the entity body written (after content coding, before chunked framing). Everything written is
deterministic given ``cid`` (``chatcmpl-<x-attempt-id>``), so tests can render the exact expected bytes
with the functions below.

A request head that is cut off is logged as ``{"event": "incomplete_request", …}`` (never played).

Scenarios (:data:`SCENARIOS`; bytes exact):

* ``normal`` — 200, ``content-type: text/event-stream; charset=utf-8``, chunked, one event per HTTP chunk:
  role, four content events ``"content":"tok{i} "`` (i = 0…3), finish (``"stop"``), usage
  (``prompt 5, completion 4, total 9``, ``"choices":[]``), ``data: [DONE]``. For ``"stream": false``
  (or absent), a ``chat.completion`` JSON body with the same usage, Content-Length framed.
* ``comments_before_delta:N`` — N bytes of SSE comment events (``: pad…\\n\\n``, 16 KiB each) after the
  200 head and before the role event, then the normal stream.
* ``big_nonstream:N`` / ``big_nonstream_chunked:N`` — a ``chat.completion`` JSON body of exactly N
  bytes (bulk: a logprobs-like ``content`` array, ``usage`` last, ``completion_tokens`` = its length),
  Content-Length framed / chunked in 16 KiB chunks.
* ``cr_only`` — the normal stream with every event ending ``\\r\\r`` (``data: [DONE]\\r\\r`` last).
* ``endless_event_after_delta:N`` — role, one content event, then ``data: {"choices":[{"delta":
  {"content":"`` and N bytes of text that never end the event, then the connection is closed (FIN, no
  last chunk).
* ``gzip`` — the normal stream gzip-compressed (sync-flushed per event), ``content-encoding: gzip``.
* ``no_done_complete`` — the normal stream without ``data: [DONE]``; the chunked body ends cleanly.
* ``error_null_content`` — the normal stream whose content events carry ``"error":null``.
* ``status429`` — ``429`` with a JSON error body and ``retry-after: 7``.
* ``rejected:N`` — ``400`` with a JSON error body of exactly N bytes (its ``message`` padded with ``x``),
  Content-Length framed: a rejection whose reason may be past what the gateway reads.
* ``rejected_garbage`` — ``400`` with :func:`garbage_payload` as a JSON body. ``rejected_deep`` — ``400`` with
  a JSON body nested 100 000 levels deep. ``rejected_empty`` — ``422`` with no body (Content-Length 0).
* ``garbage`` — 200 event-stream, then random bytes (invalid UTF-8, NULs), lone ``\\r``, ``data:``
  lines that are not JSON (one a cut-off content delta), then the connection is closed (FIN).
* ``deep_json_event`` — role, then ``data: [[[…]]]`` 100 000 levels deep, then the rest of the stream.
* ``bad_status_line`` — ``HTTP/1.1 OK 200`` as the status line, then close.
* ``bad_chunk_size`` — 200 chunked head, the role event, then a chunk of size ``zz``, then close.
* ``short_content_length`` — 200 event-stream declaring ``content-length: 1000``, 10 bytes, close.
* ``huge_headers`` — the normal stream with a 100 KiB ``x-huge`` response header.
* ``events_after_done`` — the normal stream, then a content event ``tok4`` and a second ``[DONE]``.
* ``tiny_events:N`` — role, N one-token content events (``"content":"t"``) in one burst, finish, usage
  (``completion_tokens`` = N), ``[DONE]``.
* ``trickle`` — the normal stream, its wire bytes up to the end of the first content event written one
  byte at a time 2 ms apart (slow is not failure), the rest at once.
* ``reset`` — 200 head and the role event, then a TCP RST.

Paths: ``/v1/chat/completions`` and ``/v1/completions`` (POST) play scenarios; ``GET /v1/models``
answers a model list; any other path answers ``404`` JSON (another method on a generation path: ``405``).

``/v1/responses`` and ``/v1/messages`` (POST) play the scenarios of :data:`API_SCENARIOS` in the API's own
named events (vLLM's shapes; every event one ``event:`` line and one ``data:`` line, one per HTTP chunk), with
the answer's id derived from ``cid`` (:func:`api_ids`):

* ``normal`` — Responses: ``response.created``, ``response.in_progress``, ``output_item.added``,
  ``content_part.added``, four ``response.output_text.delta`` (``tok{i} ``), the three ``*.done`` events,
  ``response.completed`` (``usage.output_tokens`` 4), sequence numbers from 0; Messages: ``message_start``,
  ``content_block_start``, four ``content_block_delta``, ``content_block_stop``, ``message_delta``
  (``end_turn``, 4 output tokens), ``message_stop``. Without ``"stream": true``: the API's JSON answer.
* ``not_json_before_delta`` / ``not_json_after_delta`` — the opening (+ one content event), then an event
  whose data is not JSON, then the rest of the normal stream.
* ``endless_preamble:N`` — the opening, then N bytes of preamble events (Responses ``response.in_progress``,
  Messages ``ping``), never content, then the normal rest.
* ``unfinished_preamble:N`` — the opening, then one preamble event that never ends: N bytes of its data, then
  the connection is closed (FIN, no last chunk).
* ``replica_failed_before_delta`` / ``replica_failed_after_delta`` — the opening (+ two content events), then
  the engine's own failure, as SGLang writes it: Responses ``response.failed`` (``server_error``, "Request
  running timeout reached."), Messages ``content_block_stop``, ``event: error`` (``overloaded_error``),
  ``message_stop``; the body ends cleanly.
* ``incomplete_end`` (Responses) — the normal stream ending with ``response.incomplete`` (SGLang's end at
  ``max_output_tokens``) instead of ``response.completed``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import os
import random
import re
import signal
import socket
import struct
import sys
import time
import zlib
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from router_testbed.sim.server import BadRequest, Connection

if TYPE_CHECKING:
    from router_sidecar.runtime.supervise import Child

KiB = 1024
MiB = 1024 * KiB
MAX_HEAD = 1 * MiB
MAX_BODY = 64 * MiB
HIGH_WATER = 256 * KiB  # drain (and notice a gone peer) when this much is waiting in the transport
CREATED = 1_700_000_000
MODEL = "tiny"
USAGE = {"prompt_tokens": 5, "completion_tokens": 4, "total_tokens": 9}
CONTENT_EVENTS = 4
COMMENT_EVENT_BYTES = 16 * KiB
DEEP_LEVELS = 100_000
HUGE_HEADER_BYTES = 100 * KiB
TRICKLE_GAP = 0.002
RETRY_AFTER = "7"
GEN_PATHS = ("/v1/chat/completions", "/v1/completions")
API_PATHS = {"/v1/responses": "responses", "/v1/messages": "messages"}
LAST_CHUNK = b"0\r\n\r\n"
DONE = b"data: [DONE]"

Record = dict[str, Any]


# --------------------------------------------------------------------------- pure renderers (tests use them)


def compact(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def chunk_obj(cid: str, delta: dict[str, Any], finish: str | None = None, **extra: Any) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
    if finish is not None:
        choice["stop_reason"] = None
    return {
        "id": cid,
        "object": "chat.completion.chunk",
        "created": CREATED,
        "model": MODEL,
        "choices": [choice],
        **extra,
    }


def sse(payload: dict[str, Any] | bytes, end: bytes = b"\n\n") -> bytes:
    data = payload if isinstance(payload, bytes) else compact(payload)
    return b"data: " + data + end


def role_event(cid: str, end: bytes = b"\n\n") -> bytes:
    return sse(chunk_obj(cid, {"role": "assistant", "content": ""}), end)


def content_event(cid: str, text: str, end: bytes = b"\n\n", **extra: Any) -> bytes:
    return sse(chunk_obj(cid, {"content": text}, **extra), end)


def finish_event(cid: str, end: bytes = b"\n\n") -> bytes:
    return sse(chunk_obj(cid, {}, "stop"), end)


def usage_event(cid: str, completion_tokens: int = 4, end: bytes = b"\n\n") -> bytes:
    usage = {
        "prompt_tokens": 5,
        "completion_tokens": completion_tokens,
        "total_tokens": 5 + completion_tokens,
    }
    obj = {
        "id": cid,
        "object": "chat.completion.chunk",
        "created": CREATED,
        "model": MODEL,
        "choices": [],
        "usage": usage,
    }
    return sse(obj, end)


def normal_stream_events(cid: str, *, end: bytes = b"\n\n", error_null: bool = False) -> list[bytes]:
    """The normal stream, one item per SSE event: role, 4 content, finish, usage, [DONE]."""
    extra: dict[str, Any] = {"error": None} if error_null else {}
    return [
        role_event(cid, end),
        *(content_event(cid, f"tok{i} ", end, **extra) for i in range(CONTENT_EVENTS)),
        finish_event(cid, end),
        usage_event(cid, CONTENT_EVENTS, end),
        DONE + end,
    ]


def normal_stream_payload(cid: str) -> bytes:
    return b"".join(normal_stream_events(cid))


def normal_completion_body(cid: str) -> bytes:
    text = "".join(f"tok{i} " for i in range(CONTENT_EVENTS))
    return compact(
        {
            "id": cid,
            "object": "chat.completion",
            "created": CREATED,
            "model": MODEL,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": text, "tool_calls": []},
                    "logprobs": None,
                    "finish_reason": "stop",
                    "stop_reason": None,
                }
            ],
            "usage": USAGE,
        }
    )


def comment_event_sizes(total: int) -> list[int]:
    """Sizes of the comment events that add up to exactly `total` bytes (each at least 3: ``:\\n\\n``)."""
    if total < 3:
        raise ValueError("comments need at least 3 bytes")
    sizes: list[int] = []
    remaining = total
    while remaining > 0:
        size = min(COMMENT_EVENT_BYTES, remaining)
        if 0 < remaining - size < 3:
            size -= 3
        sizes.append(size)
        remaining -= size
    return sizes


def comment_event(size: int) -> bytes:
    if size == 3:
        return b":\n\n"
    pad = (b"pad " * (size // 4 + 1))[: size - 4]
    return b": " + pad + b"\n\n"


def comment_payload(total: int) -> bytes:
    return b"".join(comment_event(s) for s in comment_event_sizes(total))


_LOGPROB_ENTRY = b'{"token":"tok","logprob":-0.5,"bytes":[116,111,107],"top_logprobs":[]}'


def big_completion_body(cid: str, total: int) -> bytes:
    """A valid chat.completion of exactly `total` bytes; `usage` is its last key."""
    text = "".join(f"tok{i} " for i in range(CONTENT_EVENTS))
    prefix = (
        b'{"id":'
        + compact(cid)
        + b',"object":"chat.completion","created":'
        + str(CREATED).encode()
        + b',"model":"tiny","choices":[{"index":0,"message":{"role":"assistant","content":'
        + compact(text)
        + b'},"logprobs":{"content":['
    )

    def suffix(k: int) -> bytes:
        usage = {"prompt_tokens": 5, "completion_tokens": k, "total_tokens": 5 + k}
        return b']},"finish_reason":"stop","stop_reason":null}],"usage":' + compact(usage) + b"}"

    e = len(_LOGPROB_ENTRY)
    k = max(1, (total - len(prefix) - len(suffix(1))) // (e + 1))
    while True:
        extra = total - (len(prefix) + len(suffix(k)) + k * e + (k - 1))
        if extra >= 0:
            break
        if k == 1:
            raise ValueError(f"big_nonstream needs at least {total - extra} bytes")
        k -= 1
    last = _LOGPROB_ENTRY.replace(b'"token":"tok"', b'"token":"tok' + b"x" * extra + b'"')
    body = prefix + b",".join([_LOGPROB_ENTRY] * (k - 1) + [last]) + suffix(k)
    assert len(body) == total
    return body


def tiny_content_event(cid: str) -> bytes:
    return content_event(cid, "t")


def tiny_stream_payload(cid: str, n: int) -> bytes:
    return b"".join(
        [role_event(cid), tiny_content_event(cid) * n, finish_event(cid), usage_event(cid, n), DONE + b"\n\n"]
    )


def deep_json_event() -> bytes:
    return b"data: " + b"[" * DEEP_LEVELS + b"]" * DEEP_LEVELS + b"\n\n"


ENDLESS_PREFIX = b'data: {"choices":[{"delta":{"content":"'


def error_body_429() -> bytes:
    return compact(
        {
            "error": {
                "message": "The server is overloaded: too many requests in the queue, retry later.",
                "type": "TooManyRequests",
                "param": None,
                "code": 429,
            }
        }
    )


# --------------------------------------------------------------------------- the Responses and Messages APIs


def named_event(name: str, data: dict[str, Any]) -> bytes:
    """One named event as the engines write it: `event:` line, one `data:` line."""
    return b"event: " + name.encode() + b"\ndata: " + compact({"type": name, **data}) + b"\n\n"


def api_ids(cid: str) -> tuple[str, str]:
    """(the answer's id, its message item's id) for a stream id: deterministic, one per attempt."""
    digest = hashlib.sha256(cid.encode()).hexdigest()
    return f"resp_{digest[:16]}", f"msg_{digest[16:32]}"


class ResponsesEvents:
    """A Responses stream of one attempt, numbered as it is written (vLLM's event shapes, trimmed)."""

    def __init__(self, cid: str) -> None:
        self.id, self.item = api_ids(cid)
        self.seq = 0

    def event(self, name: str, **data: Any) -> bytes:
        out = named_event(name, {**data, "sequence_number": self.seq})
        self.seq += 1
        return out

    def response(self, status: str, **extra: Any) -> dict[str, Any]:
        base = {"id": self.id, "created_at": CREATED, "model": MODEL, "object": "response", "output": []}
        return {**base, "status": status, "usage": None, **extra}

    def opening(self) -> list[bytes]:
        item = {
            "id": self.item,
            "content": [],
            "role": "assistant",
            "status": "in_progress",
            "type": "message",
        }
        part = {"annotations": [], "text": "", "type": "output_text"}
        return [
            self.event("response.created", response=self.response("in_progress")),
            self.event("response.in_progress", response=self.response("in_progress")),
            self.event("response.output_item.added", item=item, output_index=0),
            self.event(
                "response.content_part.added", content_index=0, item_id=self.item, output_index=0, part=part
            ),
        ]

    def delta(self, text: str) -> bytes:
        return self.event(
            "response.output_text.delta", content_index=0, delta=text, item_id=self.item, output_index=0
        )

    def closing(self, n: int, end: str = "response.completed") -> list[bytes]:
        text = "".join(f"tok{i} " for i in range(n))
        part = {"annotations": [], "text": text, "type": "output_text"}
        item = {
            "id": self.item,
            "content": [part],
            "role": "assistant",
            "status": "completed",
            "type": "message",
        }
        usage = {"input_tokens": 5, "output_tokens": n, "total_tokens": 5 + n}
        status = "completed" if end == "response.completed" else "incomplete"
        extra = {"incomplete_details": {"reason": "max_output_tokens"}} if status == "incomplete" else {}
        return [
            self.event(
                "response.output_text.done", content_index=0, item_id=self.item, output_index=0, text=text
            ),
            self.event(
                "response.content_part.done", content_index=0, item_id=self.item, output_index=0, part=part
            ),
            self.event("response.output_item.done", item=item, output_index=0),
            self.event(end, response={**self.response(status, output=[item], usage=usage), **extra}),
        ]

    def failed(self, n: int) -> list[bytes]:
        """SGLang's in-band failure: its own `response.failed` (server_error, its timeout message)."""
        usage = {"input_tokens": 5, "output_tokens": n, "total_tokens": 5 + n}
        error = {"code": "server_error", "message": "Request running timeout reached."}
        return [self.event("response.failed", response=self.response("failed", error=error, usage=usage))]


def messages_opening(cid: str) -> list[bytes]:
    message_id = "msg_" + hashlib.sha256(cid.encode()).hexdigest()[:32]
    message = {"id": message_id, "type": "message", "role": "assistant", "content": [], "model": MODEL}
    return [
        named_event(
            "message_start", {"message": {**message, "usage": {"input_tokens": 5, "output_tokens": 0}}}
        ),
        named_event("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}}),
    ]


def messages_delta(text: str) -> bytes:
    return named_event("content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": text}})


def messages_closing(n: int) -> list[bytes]:
    return [
        named_event("content_block_stop", {"index": 0}),
        named_event("message_delta", {"delta": {"stop_reason": "end_turn"}, "usage": {"output_tokens": n}}),
        named_event("message_stop", {}),
    ]


def messages_failed() -> list[bytes]:
    """SGLang's in-band failure: the open block closed, its error event, then `message_stop`."""
    error = {"type": "overloaded_error", "message": "Request running timeout reached."}
    return [
        named_event("content_block_stop", {"index": 0}),
        named_event("error", {"error": error}),
        named_event("message_stop", {}),
    ]


def api_stream_events(api: str, cid: str, *, end: str = "response.completed") -> list[bytes]:
    """The normal stream of an API, one item per event (what `normal` writes)."""
    tokens = [f"tok{i} " for i in range(CONTENT_EVENTS)]
    if api == "responses":
        r = ResponsesEvents(cid)
        return [*r.opening(), *(r.delta(t) for t in tokens), *r.closing(CONTENT_EVENTS, end)]
    return [*messages_opening(cid), *(messages_delta(t) for t in tokens), *messages_closing(CONTENT_EVENTS)]


def api_stream_payload(api: str, cid: str) -> bytes:
    return b"".join(api_stream_events(api, cid))


def api_unary_body(api: str, cid: str) -> bytes:
    text = "".join(f"tok{i} " for i in range(CONTENT_EVENTS))
    if api == "responses":
        r = ResponsesEvents(cid)
        part = {"annotations": [], "text": text, "type": "output_text"}
        item = {
            "id": r.item,
            "content": [part],
            "role": "assistant",
            "status": "completed",
            "type": "message",
        }
        usage = {"input_tokens": 5, "output_tokens": CONTENT_EVENTS, "total_tokens": 5 + CONTENT_EVENTS}
        return compact(r.response("completed", output=[item], usage=usage))
    message_id = "msg_" + hashlib.sha256(cid.encode()).hexdigest()[:32]
    return compact(
        {
            "id": message_id,
            "type": "message",
            "role": "assistant",
            "content": [{"type": "text", "text": text}],
            "model": MODEL,
            "stop_reason": "end_turn",
            "usage": {"input_tokens": 5, "output_tokens": CONTENT_EVENTS},
        }
    )


NOT_JSON_EVENT = {
    "responses": b"event: response.output_text.delta\n"
    b'data: {"type":"response.output_text.delta","delta":tok\n\n',
    "messages": b'event: content_block_delta\ndata: {"type":"content_block_delta", this is not json\n\n',
}


def hchunk(data: bytes) -> bytes:
    return b"%x\r\n" % len(data) + data + b"\r\n"


_REASONS = {
    200: "OK",
    400: "Bad Request",
    404: "Not Found",
    405: "Method Not Allowed",
    422: "Unprocessable Content",
    429: "Too Many Requests",
}


def head(status: int, headers: list[tuple[str, str]]) -> bytes:
    lines = [f"HTTP/1.1 {status} {_REASONS.get(status, 'Unknown')}", "server: uvicorn"]
    lines += [f"{k}: {v}" for k, v in headers]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


STREAM_HEADERS = [
    ("content-type", "text/event-stream; charset=utf-8"),
    ("cache-control", "no-cache"),
    ("transfer-encoding", "chunked"),
]


def parse_size(text: str) -> int:
    m = re.fullmatch(r"(\d+)\s*(KiB|MiB|K|M|k)?", text.strip())
    if m is None:
        raise ValueError(f"bad size {text!r}")
    factor = {"KiB": KiB, "K": KiB, "k": KiB, "MiB": MiB, "M": MiB}.get(m.group(2) or "", 1)
    return int(m.group(1)) * factor


@dataclass(frozen=True)
class Scenario:
    name: str
    size: int | None = None
    attempts: frozenset[int] | None = None  # None: every attempt

    def applies(self, attempt: int) -> bool:
        return self.attempts is None or attempt in self.attempts


def parse_scenario(value: str) -> Scenario:
    """``NAME[:SIZE][;attempt=K[,K…]]``."""
    first, *params = [p.strip() for p in value.split(";") if p.strip()]
    name, _, size_text = first.partition(":")
    name = name.strip()
    if name not in SCENARIOS and name not in API_SCENARIOS:
        raise ValueError(f"unknown hostile scenario {name!r}")
    size = parse_size(size_text) if size_text else None
    if name in SIZED | API_SIZED and size is None:
        raise ValueError(f"{name} needs a size: {name}:N")
    attempts: frozenset[int] | None = None
    for param in params:
        key, _, val = param.partition("=")
        if key.strip() != "attempt":
            raise ValueError(f"unknown scenario parameter {param!r}")
        attempts = frozenset(int(x) for x in val.split(","))
    return Scenario(name, size, attempts)


def stream_id(attempt_id: str | None, seq: int) -> str:
    safe = re.sub(r"[^A-Za-z0-9_.:-]", "", attempt_id or "")[:80]
    return f"chatcmpl-{safe}" if safe else f"chatcmpl-hostile{seq}"


# --------------------------------------------------------------------------- the connection


class ClientGone(Exception):
    """The peer (Envoy) closed or reset the connection while a response was being written."""


class Incomplete(Exception):
    def __init__(self, head: bytes) -> None:
        super().__init__("request cut off")
        self.head = head


@dataclass
class Request:
    method: str
    target: str
    version: str
    headers: list[tuple[str, str]]
    body: bytes
    t: float

    @property
    def path(self) -> str:
        return self.target.split("?", 1)[0]

    def values(self, name: str) -> list[str]:
        return [v for k, v in self.headers if k == name]

    def header(self, name: str) -> str | None:
        found = self.values(name)
        return found[0] if found else None

    def header_map(self) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {}
        for k, v in self.headers:
            out.setdefault(k, []).append(v)
        return out


class Conn(Connection):
    """One connection, read like the simulator's (a pump task, so the peer leaving is seen at once); this
    replica keeps duplicate headers and counts what it wrote."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        super().__init__(reader, writer)
        self.written = 0

    async def read_request(self) -> Request | None:
        """The next request; None when the peer closed between requests; Incomplete when cut off."""
        try:
            raw_head = await self.read_until(b"\r\n\r\n", MAX_HEAD)
        except EOFError:
            if self.buf:
                raise Incomplete(bytes(self.buf)) from None
            return None
        lines = raw_head[:-4].decode("latin-1").split("\r\n")
        parts = lines[0].split(" ")
        if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
            raise BadRequest(400, "malformed request line")
        headers: list[tuple[str, str]] = []
        for line in lines[1:]:
            name, sep, value = line.partition(":")
            if not sep:
                raise BadRequest(400, "malformed header line")
            headers.append((name.strip().lower(), value.strip()))
        request = Request(parts[0], parts[1], parts[2], headers, b"", 0.0)
        if (request.header("expect") or "").lower() == "100-continue":
            self.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        try:
            request.body = await self._read_body(request)
        except EOFError:
            raise Incomplete(raw_head) from None
        request.t = time.time()
        return request

    async def _read_body(self, request: Request) -> bytes:
        if "chunked" in (request.header("transfer-encoding") or "").lower():
            out = bytearray()
            while True:
                size_line = await self.read_until(b"\r\n", MAX_HEAD)
                try:
                    size = int(size_line.split(b";", 1)[0].strip(), 16)
                except ValueError:
                    raise BadRequest(400, "bad chunk size") from None
                if size == 0:
                    while await self.read_until(b"\r\n", MAX_HEAD) != b"\r\n":
                        pass
                    return bytes(out)
                if len(out) + size > MAX_BODY:
                    raise BadRequest(413, "request body too large")
                out += await self.read_exact(size)
                if await self.read_exact(2) != b"\r\n":
                    raise BadRequest(400, "bad chunk terminator")
        length = request.header("content-length")
        if length is None:
            return b""
        if not length.isdigit() or int(length) > MAX_BODY:
            raise BadRequest(400, "bad content-length")
        return await self.read_exact(int(length))

    @property
    def gone(self) -> bool:
        return self.eof.is_set() or self.writer.transport.is_closing()

    async def send(self, data: bytes) -> None:
        if self.gone:
            raise ClientGone
        self.writer.write(data)
        self.written += len(data)
        if self.writer.transport.get_write_buffer_size() > HIGH_WATER:
            await self._drain_or_gone()

    async def _drain_or_gone(self) -> None:
        drain = asyncio.ensure_future(self.writer.drain())
        gone = asyncio.ensure_future(self.eof.wait())
        try:
            await asyncio.wait({drain, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (drain, gone):
                if not task.done():
                    task.cancel()
        failed = drain.done() and not drain.cancelled() and drain.exception() is not None
        if gone.done() or failed or not drain.done():
            raise ClientGone

    async def flush(self) -> None:
        """Everything written has reached the kernel (or the peer is gone)."""
        if self.writer.transport.get_write_buffer_size() > 0:
            await self._drain_or_gone()
        if self.writer.transport.is_closing():
            raise ClientGone

    async def sleep(self, seconds: float) -> None:
        try:
            await asyncio.wait_for(self.eof.wait(), seconds)
        except TimeoutError:
            return
        raise ClientGone

    def bytes_on_wire(self) -> int:
        return self.written - self.writer.transport.get_write_buffer_size()

    def close(self) -> None:
        self._pump_task.cancel()
        if not self.writer.transport.is_closing():
            self.writer.close()

    def reset(self) -> None:
        sock = self.writer.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.writer.transport.abort()


# --------------------------------------------------------------------------- one exchange


class Log:
    def __init__(self, path: str | None) -> None:
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644) if path else None

    def write(self, record: Record) -> None:
        if self._fd is not None:
            os.write(self._fd, (json.dumps(record, separators=(",", ":")) + "\n").encode())


@dataclass
class Exchange:
    conn: Conn
    request: Request
    seq: int
    cid: str
    stream: bool
    chunked: bool = False
    status: int | None = None
    payload_bytes: int = 0
    payload: Any = field(default_factory=hashlib.sha256)

    async def head(self, status: int, headers: list[tuple[str, str]]) -> None:
        self.status = status
        self.chunked = any(k == "transfer-encoding" and "chunked" in v for k, v in headers)
        await self.conn.send(head(status, headers))

    async def body(self, data: bytes) -> None:
        """Entity bytes: framed as one HTTP chunk when the response is chunked."""
        self.payload.update(data)
        self.payload_bytes += len(data)
        await self.conn.send(hchunk(data) if self.chunked else data)

    async def raw(self, data: bytes) -> None:
        await self.conn.send(data)

    async def end(self) -> str:
        if self.chunked:
            await self.conn.send(LAST_CHUNK)
        await self.conn.flush()
        return "complete"

    async def json(self, status: int, body: bytes, extra: list[tuple[str, str]] | None = None) -> str:
        headers = [("content-type", "application/json"), ("content-length", str(len(body))), *(extra or [])]
        await self.head(status, headers)
        await self.body(body)
        return await self.end()

    async def events(self, events: list[bytes]) -> None:
        for event in events:
            await self.body(event)


Play = Callable[[Exchange, int | None], Awaitable[str]]


async def play_normal(ex: Exchange, _size: int | None = None) -> str:
    if not ex.stream:
        return await ex.json(200, normal_completion_body(ex.cid))
    await ex.head(200, STREAM_HEADERS)
    await ex.events(normal_stream_events(ex.cid))
    return await ex.end()


async def play_comments_before_delta(ex: Exchange, size: int | None) -> str:
    assert size is not None
    await ex.head(200, STREAM_HEADERS)
    for s in comment_event_sizes(size):
        await ex.body(comment_event(s))
    await ex.events(normal_stream_events(ex.cid))
    return await ex.end()


async def _big(ex: Exchange, size: int | None, *, chunked: bool) -> str:
    assert size is not None
    body = big_completion_body(ex.cid, size)
    if chunked:
        await ex.head(200, [("content-type", "application/json"), ("transfer-encoding", "chunked")])
        step = 16 * KiB
    else:
        await ex.head(200, [("content-type", "application/json"), ("content-length", str(len(body)))])
        step = 64 * KiB
    for i in range(0, len(body), step):
        await ex.body(body[i : i + step])
    return await ex.end()


async def play_big_nonstream(ex: Exchange, size: int | None) -> str:
    return await _big(ex, size, chunked=False)


async def play_big_nonstream_chunked(ex: Exchange, size: int | None) -> str:
    return await _big(ex, size, chunked=True)


async def play_cr_only(ex: Exchange, _size: int | None) -> str:
    await ex.head(200, STREAM_HEADERS)
    await ex.events(normal_stream_events(ex.cid, end=b"\r\r"))
    return await ex.end()


async def play_endless_event_after_delta(ex: Exchange, size: int | None) -> str:
    assert size is not None
    await ex.head(200, STREAM_HEADERS)
    await ex.events([role_event(ex.cid), content_event(ex.cid, "tok0 ")])
    await ex.body(ENDLESS_PREFIX)
    block = (b"lorem ipsum " * (64 * KiB // 12 + 1))[: 64 * KiB]
    remaining = size
    while remaining > 0:
        piece = block[: min(len(block), remaining)]
        await ex.body(piece)
        remaining -= len(piece)
    await ex.conn.flush()
    return "closed"


async def play_gzip(ex: Exchange, _size: int | None) -> str:
    await ex.head(200, [*STREAM_HEADERS[:2], ("content-encoding", "gzip"), STREAM_HEADERS[2]])
    comp = zlib.compressobj(6, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
    for event in normal_stream_events(ex.cid):
        await ex.body(comp.compress(event) + comp.flush(zlib.Z_SYNC_FLUSH))
    await ex.body(comp.flush())
    return await ex.end()


async def play_no_done_complete(ex: Exchange, _size: int | None) -> str:
    await ex.head(200, STREAM_HEADERS)
    await ex.events(normal_stream_events(ex.cid)[:-1])
    return await ex.end()


async def play_error_null_content(ex: Exchange, _size: int | None) -> str:
    await ex.head(200, STREAM_HEADERS)
    await ex.events(normal_stream_events(ex.cid, error_null=True))
    return await ex.end()


async def play_status429(ex: Exchange, _size: int | None) -> str:
    return await ex.json(429, error_body_429(), [("retry-after", RETRY_AFTER)])


REJECTION_MESSAGE = "temperature must be at most 2 "  # the start of the `rejected` scenario's message


def rejected_body(size: int) -> bytes:
    """A 400 error body of exactly `size` bytes (at least its frame's), the message padded with `x`."""
    frame = compact(
        {"error": {"message": REJECTION_MESSAGE, "type": "BadRequestError", "param": "temperature"}}
    )
    return frame.replace(
        REJECTION_MESSAGE.encode(), REJECTION_MESSAGE.encode() + b"x" * max(0, size - len(frame))
    )


async def play_rejected(ex: Exchange, size: int | None) -> str:
    return await ex.json(400, rejected_body(size or 200))


async def play_rejected_garbage(ex: Exchange, _size: int | None) -> str:
    return await ex.json(400, garbage_payload(ex.cid))


async def play_rejected_deep(ex: Exchange, _size: int | None) -> str:
    return await ex.json(400, b"[" * DEEP_LEVELS + b"]" * DEEP_LEVELS)


async def play_rejected_empty(ex: Exchange, _size: int | None) -> str:
    return await ex.json(422, b"")


def garbage_payload(seed: str) -> bytes:
    rng = random.Random(seed)
    pieces = [
        bytes(rng.randrange(256) for _ in range(300)),
        b"\x00\x00\x00\n\n",
        b"data: this is not json\n\n",
        b"\r",
        b"data: \xff\xfe\xfd\xc3\x28\n\n",
        b'data: {"choices":[{"delta":{"content":"tok0 \n\n',
        b'data: {"id": 1,,}\r\r',
        bytes(rng.randrange(256) for _ in range(300)),
        b"\rdata: [DONE\r",
        b"data:\x00\n\n",
    ]
    return b"".join(pieces)


async def play_garbage(ex: Exchange, _size: int | None) -> str:
    await ex.head(200, STREAM_HEADERS)
    data = garbage_payload(ex.cid)
    for i in range(0, len(data), 97):
        await ex.body(data[i : i + 97])
    await ex.conn.flush()
    return "closed"


async def play_deep_json_event(ex: Exchange, _size: int | None) -> str:
    await ex.head(200, STREAM_HEADERS)
    events = normal_stream_events(ex.cid)
    await ex.body(events[0])
    deep = deep_json_event()
    for i in range(0, len(deep), 16 * KiB):
        await ex.body(deep[i : i + 16 * KiB])
    await ex.events(events[1:])
    return await ex.end()


async def play_bad_status_line(ex: Exchange, _size: int | None) -> str:
    ex.status = None
    await ex.raw(b"HTTP/1.1 OK 200\r\ncontent-type: text/event-stream\r\n\r\n" + role_event(ex.cid))
    await ex.conn.flush()
    return "closed"


async def play_bad_chunk_size(ex: Exchange, _size: int | None) -> str:
    await ex.head(200, STREAM_HEADERS)
    await ex.body(role_event(ex.cid))
    await ex.raw(b"zz\r\n" + content_event(ex.cid, "tok0 ") + b"\r\n")
    await ex.conn.flush()
    return "closed"


async def play_short_content_length(ex: Exchange, _size: int | None) -> str:
    await ex.head(200, [("content-type", "text/event-stream; charset=utf-8"), ("content-length", "1000")])
    await ex.body(b'data: {"id')
    await ex.conn.flush()
    return "closed"


async def play_huge_headers(ex: Exchange, _size: int | None) -> str:
    await ex.head(200, [*STREAM_HEADERS[:2], ("x-huge", "h" * HUGE_HEADER_BYTES), STREAM_HEADERS[2]])
    await ex.events(normal_stream_events(ex.cid))
    return await ex.end()


async def play_events_after_done(ex: Exchange, _size: int | None) -> str:
    await ex.head(200, STREAM_HEADERS)
    await ex.events([*normal_stream_events(ex.cid), content_event(ex.cid, "tok4 "), DONE + b"\n\n"])
    return await ex.end()


async def play_tiny_events(ex: Exchange, size: int | None) -> str:
    assert size is not None
    await ex.head(200, STREAM_HEADERS)
    await ex.body(role_event(ex.cid))
    event = tiny_content_event(ex.cid)
    for _ in range(size):
        await ex.body(event)
    await ex.events([finish_event(ex.cid), usage_event(ex.cid, size), DONE + b"\n\n"])
    return await ex.end()


async def play_trickle(ex: Exchange, _size: int | None) -> str:
    events = normal_stream_events(ex.cid)
    ex.status = 200
    ex.chunked = True
    slow = head(200, STREAM_HEADERS) + hchunk(events[0]) + hchunk(events[1])
    for e in events[:2]:
        ex.payload.update(e)
        ex.payload_bytes += len(e)
    for i in range(len(slow)):
        await ex.raw(slow[i : i + 1])
        await ex.conn.sleep(TRICKLE_GAP)
    await ex.events(events[2:])
    return await ex.end()


async def play_reset(ex: Exchange, _size: int | None) -> str:
    await ex.head(200, STREAM_HEADERS)
    await ex.body(role_event(ex.cid))
    await ex.conn.flush()
    ex.conn.reset()
    return "reset"


# --------------------------------------------------------------------------- the APIs' scenarios

ApiPlay = Callable[[Exchange, str, int | None], Awaitable[str]]


def _api_parts(api: str, cid: str) -> tuple[list[bytes], list[bytes], Callable[[int], list[bytes]]]:
    """(the opening, the content events, the closing after n of them) of an API's normal stream."""
    tokens = [f"tok{i} " for i in range(CONTENT_EVENTS)]
    if api == "responses":
        r = ResponsesEvents(cid)
        opening = r.opening()
        content = [r.delta(t) for t in tokens]
        return opening, content, lambda n: r.closing(n)
    return messages_opening(cid), [messages_delta(t) for t in tokens], messages_closing


async def api_normal(ex: Exchange, api: str, _size: int | None = None) -> str:
    if not ex.stream:
        return await ex.json(200, api_unary_body(api, ex.cid))
    await ex.head(200, STREAM_HEADERS)
    await ex.events(api_stream_events(api, ex.cid))
    return await ex.end()


async def api_not_json(ex: Exchange, api: str, before: int) -> str:
    opening, content, closing = _api_parts(api, ex.cid)
    await ex.head(200, STREAM_HEADERS)
    await ex.events(
        [*opening, *content[:before], NOT_JSON_EVENT[api], *content[before:], *closing(len(content))]
    )
    return await ex.end()


async def api_not_json_before_delta(ex: Exchange, api: str, _size: int | None) -> str:
    return await api_not_json(ex, api, 0)


async def api_not_json_after_delta(ex: Exchange, api: str, _size: int | None) -> str:
    return await api_not_json(ex, api, 1)


async def api_endless_preamble(ex: Exchange, api: str, size: int | None) -> str:
    assert size is not None
    opening, content, closing = _api_parts(api, ex.cid)
    await ex.head(200, STREAM_HEADERS)
    await ex.events(opening)
    if api == "responses":
        filler = named_event(
            "response.in_progress", {"response": {"id": api_ids(ex.cid)[0]}, "pad": "p" * 4000}
        )
    else:
        filler = named_event("ping", {"pad": "p" * 4000})
    for _ in range(size // len(filler) + 1):
        await ex.body(filler)
    await ex.events([*content, *closing(len(content))])
    return await ex.end()


async def api_unfinished_preamble(ex: Exchange, api: str, size: int | None) -> str:
    assert size is not None
    opening, _content, _closing = _api_parts(api, ex.cid)
    await ex.head(200, STREAM_HEADERS)
    await ex.events(opening)
    name = b"response.in_progress" if api == "responses" else b"ping"
    await ex.body(b"event: " + name + b'\ndata: {"type":"' + name + b'","pad":"')
    block = b"p" * (64 * KiB)
    remaining = size
    while remaining > 0:
        await ex.body(block[: min(len(block), remaining)])
        remaining -= len(block)
    await ex.conn.flush()
    return "closed"


def api_failed_events(api: str, cid: str, before: int) -> list[bytes]:
    """The opening, `before` content events, then the engine's own failure (SGLang's), one item per event."""
    tokens = [f"tok{i} " for i in range(before)]
    if api == "responses":
        r = ResponsesEvents(cid)
        return [*r.opening(), *(r.delta(t) for t in tokens), *r.failed(before)]
    return [*messages_opening(cid), *(messages_delta(t) for t in tokens), *messages_failed()]


async def api_replica_failed(ex: Exchange, api: str, before: int) -> str:
    await ex.head(200, STREAM_HEADERS)
    await ex.events(api_failed_events(api, ex.cid, before))
    return await ex.end()


async def api_replica_failed_before_delta(ex: Exchange, api: str, _size: int | None) -> str:
    return await api_replica_failed(ex, api, 0)


async def api_replica_failed_after_delta(ex: Exchange, api: str, _size: int | None) -> str:
    return await api_replica_failed(ex, api, 2)


async def api_incomplete_end(ex: Exchange, api: str, _size: int | None) -> str:
    await ex.head(200, STREAM_HEADERS)
    await ex.events(api_stream_events(api, ex.cid, end="response.incomplete"))
    return await ex.end()


API_SCENARIOS: dict[str, ApiPlay] = {
    "normal": api_normal,
    "not_json_before_delta": api_not_json_before_delta,
    "not_json_after_delta": api_not_json_after_delta,
    "endless_preamble": api_endless_preamble,
    "unfinished_preamble": api_unfinished_preamble,
    "replica_failed_before_delta": api_replica_failed_before_delta,
    "replica_failed_after_delta": api_replica_failed_after_delta,
    "incomplete_end": api_incomplete_end,
}
API_SIZED = frozenset({"endless_preamble", "unfinished_preamble"})


SCENARIOS: dict[str, Play] = {
    "normal": play_normal,
    "comments_before_delta": play_comments_before_delta,
    "big_nonstream": play_big_nonstream,
    "big_nonstream_chunked": play_big_nonstream_chunked,
    "cr_only": play_cr_only,
    "endless_event_after_delta": play_endless_event_after_delta,
    "gzip": play_gzip,
    "no_done_complete": play_no_done_complete,
    "error_null_content": play_error_null_content,
    "status429": play_status429,
    "garbage": play_garbage,
    "deep_json_event": play_deep_json_event,
    "bad_status_line": play_bad_status_line,
    "bad_chunk_size": play_bad_chunk_size,
    "short_content_length": play_short_content_length,
    "huge_headers": play_huge_headers,
    "events_after_done": play_events_after_done,
    "tiny_events": play_tiny_events,
    "trickle": play_trickle,
    "reset": play_reset,
    "rejected": play_rejected,
    "rejected_garbage": play_rejected_garbage,
    "rejected_deep": play_rejected_deep,
    "rejected_empty": play_rejected_empty,
}
SIZED = frozenset(
    {
        "comments_before_delta",
        "big_nonstream",
        "big_nonstream_chunked",
        "endless_event_after_delta",
        "tiny_events",
        "rejected",
    }
)
KEEP_ALIVE_AFTER = {"complete"}


# --------------------------------------------------------------------------- the server


class Server:
    def __init__(self, log_path: str | None) -> None:
        self.log = Log(log_path)
        self.seq = 0
        self.tasks: set[asyncio.Task[None]] = set()

    async def on_connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self.tasks.add(task)
        conn = Conn(reader, writer)
        try:
            while True:
                try:
                    request = await conn.read_request()
                except Incomplete as cut:
                    self.log.write(
                        {
                            "event": "incomplete_request",
                            "head": cut.head[:4096].decode("latin-1"),
                            "t": time.time(),
                        }
                    )
                    return
                except BadRequest as bad:
                    body = compact(
                        {"error": {"message": str(bad), "type": "BadRequestError", "code": bad.status}}
                    )
                    headers = [
                        ("content-type", "application/json"),
                        ("content-length", str(len(body))),
                        ("connection", "close"),
                    ]
                    with contextlib.suppress(ConnectionError, OSError):
                        writer.write(head(bad.status, headers) + body)
                        await writer.drain()
                    return
                if request is None:
                    return
                if not await self.exchange(conn, request):
                    return
        finally:
            conn.close()
            self.tasks.discard(task)

    async def exchange(self, conn: Conn, request: Request) -> bool:
        if request.path == "/health" and request.method == "GET":
            # The gateway's health checks of a static replica (Envoy's and the sidecar's): always healthy,
            # never logged (they come every second and are not what a test looks at).
            ex = Exchange(conn, request, 0, "health", False)
            await ex.json(200, b"")
            return not conn.gone and "close" not in (request.header("connection") or "").lower()
        self.seq += 1
        seq = self.seq
        attempt_text = request.header("x-envoy-attempt-count")
        attempt = int(attempt_text) if attempt_text and attempt_text.isdigit() else None
        attempt_id = request.header("x-attempt-id")
        cid = stream_id(attempt_id, seq)
        try:
            parsed = json.loads(request.body) if request.body else None
        except (ValueError, RecursionError):
            parsed = None
        stream = isinstance(parsed, dict) and parsed.get("stream") is True
        scenario_text = request.header("x-hostile")
        common = {
            "exchange": seq,
            "request_id": request.header("x-request-id"),
            "attempt": attempt,
            "attempt_id": attempt_id,
            "cid": cid,
            "scenario": scenario_text,
        }
        self.log.write(
            {
                "event": "request",
                **common,
                "method": request.method,
                "path": request.path,
                "target": request.target,
                "version": request.version,
                "headers": request.header_map(),
                "body_bytes": len(request.body),
                "body_sha256": hashlib.sha256(request.body).hexdigest(),
                "stream": stream,
                "t": request.t,
            }
        )
        ex = Exchange(conn, request, seq, cid, stream)
        written_before = conn.written  # the connection may have carried earlier exchanges (keep-alive)
        how = "complete"
        try:
            how = await self._dispatch(ex, request, scenario_text, attempt or 1)
        except (ClientGone, ConnectionError, OSError):
            how = "client_gone"
            if conn.gone_at is None:  # a failed write can come before the reader sees the close
                conn.gone_at = time.time()
        end: Record = {
            "event": "end",
            **common,
            "how": how,
            "status": ex.status,
            "bytes_sent": (conn.bytes_on_wire() if how != "reset" else conn.written) - written_before,
            "payload_bytes": ex.payload_bytes,
            "payload_sha256": ex.payload.hexdigest(),
            "client_gone_at": conn.gone_at if how == "client_gone" else None,
            "t": time.time(),
        }
        self.log.write(end)
        if how == "closed":
            conn.close()
        close_requested = "close" in (request.header("connection") or "").lower()
        return how in KEEP_ALIVE_AFTER and not conn.gone and not close_requested

    async def _dispatch(self, ex: Exchange, request: Request, scenario_text: str | None, attempt: int) -> str:
        api = API_PATHS.get(request.path)
        if api is not None and request.method == "POST":
            return await self._dispatch_api(ex, api, scenario_text, attempt)
        if request.path not in GEN_PATHS:
            if request.path == "/v1/models" and request.method == "GET":
                models = {"object": "list", "data": [{"id": MODEL, "object": "model", "owned_by": "hostile"}]}
                return await ex.json(200, compact(models))
            body = compact(
                {"error": {"message": f"Not Found: {request.path}", "type": "NotFound", "code": 404}}
            )
            return await ex.json(404, body)
        if request.method != "POST":
            return await ex.json(405, compact({"error": {"message": "Method Not Allowed", "code": 405}}))
        if not scenario_text:
            return await play_normal(ex)
        try:
            scenario = parse_scenario(scenario_text)
        except ValueError as exc:
            return await ex.json(400, compact({"error": {"message": str(exc), "code": 400}}))
        if scenario.name not in SCENARIOS:
            message = f"scenario {scenario.name!r} is played on /v1/responses and /v1/messages only"
            return await ex.json(400, compact({"error": {"message": message, "code": 400}}))
        if not scenario.applies(attempt):
            return await play_normal(ex)
        return await SCENARIOS[scenario.name](ex, scenario.size)

    async def _dispatch_api(self, ex: Exchange, api: str, scenario_text: str | None, attempt: int) -> str:
        if not scenario_text:
            return await api_normal(ex, api)
        try:
            scenario = parse_scenario(scenario_text)
        except ValueError as exc:
            return await ex.json(400, compact({"error": {"message": str(exc), "code": 400}}))
        if scenario.name not in API_SCENARIOS:
            message = f"scenario {scenario.name!r} is not played on /v1/{api}"
            return await ex.json(400, compact({"error": {"message": message, "code": 400}}))
        if not scenario.applies(attempt):
            return await api_normal(ex, api)
        return await API_SCENARIOS[scenario.name](ex, api, scenario.size)


async def serve(host: str, port: int, log_path: str | None) -> None:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    server = Server(log_path)
    listener = await asyncio.start_server(server.on_connection, host, port, reuse_address=True)
    bound = listener.sockets[0].getsockname()
    print(f"hostile replica listening on {bound[0]}:{bound[1]}", flush=True)
    async with listener:
        await stop.wait()
        listener.close()
        for task in list(server.tasks):
            task.cancel()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tests.hostile_replica", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--listen", required=True, help="HOST:PORT")
    parser.add_argument("--log", default=None, help="JSONL request log")
    args = parser.parse_args(argv)
    host, _, port = args.listen.rpartition(":")
    asyncio.run(serve(host.strip("[]"), int(port), args.log))
    return 0


# --------------------------------------------------------------------------- the test-side handle

REPO = Path(__file__).resolve().parent.parent


class HostileReplica:
    """The hostile replica as a supervised child process with its JSONL log (like tests.harness.Sim)."""

    def __init__(self, name: str, work: Path) -> None:
        from router_sidecar.runtime.supervise import free_port

        self.name = name
        self.port = free_port()
        self.endpoint = f"127.0.0.1:{self.port}"
        self.log_path = work / f"hostile-{name}.jsonl"
        self.out_path = work / f"hostile-{name}.out"
        self.child: Child | None = None
        self.start()

    def start(self) -> None:
        from router_sidecar.runtime.supervise import Child, port_open, wait_until

        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
        argv = [
            sys.executable,
            "-m",
            "tests.hostile_replica",
            "--listen",
            self.endpoint,
            "--log",
            str(self.log_path),
        ]
        self.child = Child(f"hostile-{self.name}", argv, log_path=self.out_path, env=env)
        wait_until(
            lambda: port_open("127.0.0.1", self.port),
            timeout=15,
            what=f"hostile {self.name}",
            child=self.child,
        )

    def ensure_running(self) -> None:
        if self.child is None or not self.child.alive():
            if self.child is not None:
                self.child.stop()
            self.start()

    def stop(self) -> None:
        if self.child is not None:
            self.child.stop()

    def records(self) -> list[Record]:
        try:
            data = self.log_path.read_bytes()
        except FileNotFoundError:
            return []
        out: list[Record] = []
        for line in data.split(b"\n"):
            if line.strip():
                with contextlib.suppress(json.JSONDecodeError):
                    out.append(json.loads(line))
        return out

    def requests(self, request_id: str | None = None) -> list[Record]:
        return [
            r
            for r in self.records()
            if r.get("event") == "request" and (request_id is None or r.get("request_id") == request_id)
        ]

    def ends(self, request_id: str | None = None) -> list[Record]:
        return [
            r
            for r in self.records()
            if r.get("event") == "end" and (request_id is None or r.get("request_id") == request_id)
        ]

    def saw_header_value(self, name: str, value: str) -> bool:
        """Whether any request (complete or cut off) carried header `name` with `value`."""
        for r in self.records():
            if r.get("event") == "request" and value in r.get("headers", {}).get(name, []):
                return True
            if r.get("event") == "incomplete_request" and value in r.get("head", ""):
                return True
        return False

    def wait_ends(self, request_id: str, count: int, timeout: float = 10.0) -> list[Record]:
        """The first `count` end records of this request (by exchange order), waiting for them."""
        deadline = time.monotonic() + timeout
        ends: list[Record] = []
        while time.monotonic() < deadline:
            ends = sorted(self.ends(request_id), key=lambda r: r["exchange"])
            if len(ends) >= count:
                return ends
            time.sleep(0.02)
        raise AssertionError(f"replica logged {len(ends)} of {count} ends for {request_id}: {ends}")


def iter_sse_events(payload: bytes) -> Iterator[bytes]:
    """Events of an SSE payload, any of the three line endings (for the self-tests)."""
    normalized = payload.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
    for event in normalized.split(b"\n\n"):
        if event.strip():
            yield event


if __name__ == "__main__":
    sys.exit(main())
