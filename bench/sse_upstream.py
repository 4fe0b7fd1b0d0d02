"""Bench-only OpenAI-style SSE upstream: one role event, N timestamped content events, finish, [DONE].

Each content event's ``delta.content`` starts with the ``time.monotonic_ns()`` taken right before the
write. CLOCK_MONOTONIC is system-wide on Linux, so the client (another process) subtracts it from its
own receive time to get the one-way latency of that chunk through whatever sits in between.

``POST /v1/chat/completions`` answers as above (vLLM's chat chunk shape). ``POST /v1/responses`` answers as
vLLM 0.32's Responses API does: named events with sequence numbers from 0 — ``response.created`` and
``response.in_progress`` at once, then (after the prefill) ``response.output_item.added``,
``response.content_part.added`` and N ``response.output_text.delta`` events whose ``delta`` is the
timestamp, then the ``.done`` events (repeating the text) and ``response.completed`` with its usage; no
``[DONE]``.

Run: ``python bench/sse_upstream.py --listen 127.0.0.1:PORT [--interval-ms 1]``. The number of content
events is the request's ``max_tokens`` (``max_output_tokens`` on /v1/responses). HTTP/1.1 keep-alive,
chunked, one SSE event per HTTP chunk.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import signal
import sys
import time
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")

ROLE_EVENT = (
    b'data: {"id":"chatcmpl-bench","object":"chat.completion.chunk","choices":[{"index":0,'
    b'"delta":{"role":"assistant","content":""},"finish_reason":null}]}\n\n'
)
FINISH_EVENT = (
    b'data: {"id":"chatcmpl-bench","object":"chat.completion.chunk","choices":[{"index":0,'
    b'"delta":{},"finish_reason":"stop"}]}\n\n'
)
DONE_EVENT = b"data: [DONE]\n\n"
_CONTENT_HEAD = (
    b'data: {"id":"chatcmpl-bench","object":"chat.completion.chunk","choices":[{"index":0,'
    b'"delta":{"content":"'
)
_CONTENT_TAIL = b'"},"finish_reason":null}]}\n\n'
# Content events are at least this long (a short vLLM token event); the JSON frame around the
# timestamp already takes ~145 bytes, so padding only matters while the uptime is short.
EVENT_BYTES = 140
MAX_CHUNKS = 1_000_000  # bound on what one request may ask for
_RESPONSE_HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncache-control: no-cache\r\n"
    b"transfer-encoding: chunked\r\n\r\n"
)


def content_event(ts_ns: int) -> bytes:
    text = b"%d" % ts_ns
    pad = EVENT_BYTES - len(_CONTENT_HEAD) - len(_CONTENT_TAIL) - len(text)
    return b"%s%s%s%s" % (_CONTENT_HEAD, text, b" " * max(pad, 0), _CONTENT_TAIL)


# --- the Responses API (vLLM 0.32's event shapes, its key order) ---------------------------------------

RESPONSE_ID = "resp_bench"
ITEM_ID = "msg_bench"


def named_event(payload: dict[str, Any]) -> bytes:
    """`event: <type>` then the payload on one `data:` line, as vLLM writes each Responses event."""
    return b"event: %s\ndata: %s\n\n" % (
        str(payload["type"]).encode(),
        json.dumps(payload, separators=(",", ":")).encode(),
    )


def _response(status: str, output: list[Any], usage: dict[str, Any] | None) -> dict[str, Any]:
    return {
        "id": RESPONSE_ID,
        "created_at": 0,
        "model": "bench",
        "object": "response",
        "output": output,
        "status": status,
        "usage": usage,
    }


def _message(text: str, status: str) -> dict[str, Any]:
    part = {"annotations": [], "text": text, "type": "output_text", "logprobs": None}
    return {
        "id": ITEM_ID,
        "content": [part] if text else [],
        "role": "assistant",
        "status": status,
        "type": "message",
    }


def responses_opening() -> list[bytes]:
    """`response.created` and `response.in_progress`: vLLM writes them before the prefill."""
    return [
        named_event({"response": _response("in_progress", [], None), "sequence_number": n, "type": kind})
        for n, kind in enumerate(("response.created", "response.in_progress"))
    ]


def responses_item_opened() -> list[bytes]:
    """The output item and its text part, written with the first delta."""
    return [
        named_event(
            {
                "item": _message("", "in_progress"),
                "output_index": 0,
                "sequence_number": 2,
                "type": "response.output_item.added",
            }
        ),
        named_event(
            {
                "content_index": 0,
                "item_id": ITEM_ID,
                "output_index": 0,
                "part": {"annotations": [], "text": "", "type": "output_text", "logprobs": []},
                "sequence_number": 3,
                "type": "response.content_part.added",
            }
        ),
    ]


RESPONSES_FIRST_DELTA = 4  # the first delta's sequence number


def responses_delta(ts_ns: int, sequence_number: int) -> bytes:
    return named_event(
        {
            "content_index": 0,
            "delta": str(ts_ns),
            "item_id": ITEM_ID,
            "logprobs": [],
            "output_index": 0,
            "sequence_number": sequence_number,
            "type": "response.output_text.delta",
        }
    )


def responses_closing(text: str, sequence_number: int, output_tokens: int) -> list[bytes]:
    """The `.done` events (each repeats the whole text, as vLLM's do) and `response.completed`."""
    usage = {"input_tokens": 1, "output_tokens": output_tokens, "total_tokens": 1 + output_tokens}
    part = {"annotations": [], "text": text, "type": "output_text", "logprobs": None}
    item = _message(text, "completed")
    events = [
        {
            "content_index": 0,
            "item_id": ITEM_ID,
            "logprobs": [],
            "output_index": 0,
            "text": text,
            "type": "response.output_text.done",
        },
        {
            "content_index": 0,
            "item_id": ITEM_ID,
            "output_index": 0,
            "part": part,
            "type": "response.content_part.done",
        },
        {"item": item, "output_index": 0, "type": "response.output_item.done"},
        {"response": _response("completed", [item], usage), "type": "response.completed"},
    ]
    return [named_event({**e, "sequence_number": sequence_number + i}) for i, e in enumerate(events)]


def http_chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def _error(status: bytes, message: str) -> bytes:
    body = json.dumps({"error": {"message": message, "type": "BadRequestError", "code": 400}}).encode()
    return b"HTTP/1.1 %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (
        status,
        len(body),
        body,
    )


async def _stream_responses(
    writer: asyncio.StreamWriter, chunks: int, interval: float, prefill: float
) -> None:
    writer.write(_RESPONSE_HEAD + b"".join(map(http_chunk, responses_opening())))
    if prefill:
        await writer.drain()
        await asyncio.sleep(prefill)
    stamps: list[str] = []
    for n in range(chunks):
        await asyncio.sleep(interval)
        ts = time.monotonic_ns()
        stamps.append(str(ts))
        event = http_chunk(responses_delta(ts, RESPONSES_FIRST_DELTA + n))
        writer.write(b"".join(map(http_chunk, responses_item_opened())) + event if n == 0 else event)
        await writer.drain()
    closing = responses_closing("".join(stamps), RESPONSES_FIRST_DELTA + chunks, chunks)
    writer.write(b"".join(map(http_chunk, closing)) + b"0\r\n\r\n")
    await writer.drain()


async def _stream(writer: asyncio.StreamWriter, chunks: int, interval: float, prefill: float) -> None:
    writer.write(_RESPONSE_HEAD + http_chunk(ROLE_EVENT))
    if prefill:  # an engine sends its headers and role event at once, the first token after the prefill
        await writer.drain()
        await asyncio.sleep(prefill)
    for _ in range(chunks):
        await asyncio.sleep(interval)
        # Stamp right before write(): with an empty send buffer it hands the bytes to the socket at once.
        writer.write(http_chunk(content_event(time.monotonic_ns())))
        await writer.drain()
    writer.write(http_chunk(FINISH_EVENT) + http_chunk(DONE_EVENT) + b"0\r\n\r\n")
    await writer.drain()


async def _handle(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, interval: float, prefill: float
) -> None:
    try:
        while True:  # keep-alive: one request after another until the client closes
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
                return
            lines = head.decode("latin-1").split("\r\n")
            method, _, rest = lines[0].partition(" ")
            path = rest.partition(" ")[0]
            headers = {
                k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:] if ln)
            }
            body = await reader.readexactly(int(headers.get("content-length", "0")))
            if method == "GET" and path == "/health":  # the gateway health-checks its static replicas
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")
                continue
            route = path.partition("?")[0]
            if method != "POST" or route not in ("/v1/chat/completions", "/v1/responses"):
                writer.write(_error(b"404 Not Found", f"no route {method} {path}"))
                continue
            field = "max_output_tokens" if route == "/v1/responses" else "max_tokens"
            try:
                chunks = int(json.loads(body).get(field) or 0)
            except (ValueError, AttributeError, TypeError):
                chunks = -1
            if not 0 < chunks <= MAX_CHUNKS:
                writer.write(_error(b"400 Bad Request", f"{field} must be 1..{MAX_CHUNKS}"))
                continue
            if route == "/v1/responses":
                await _stream_responses(writer, chunks, interval, prefill)
            else:
                await _stream(writer, chunks, interval, prefill)
    except (ConnectionError, asyncio.IncompleteReadError):
        return  # the client (Envoy) went away mid-stream: nothing to clean up
    finally:
        writer.close()


async def serve(host: str, port: int, interval: float, prefill: float = 0.0) -> None:
    server = await asyncio.start_server(lambda r, w: _handle(r, w, interval, prefill), host, port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    async with server:
        print(f"ready: bench upstream on {host}:{port}", flush=True)
        await stop.wait()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--listen", required=True, help="HOST:PORT (use 127.0.0.1)")
    parser.add_argument("--interval-ms", type=float, default=1.0, help="gap between content events")
    parser.add_argument("--prefill-ms", type=float, default=0.0, help="wait before the first content event")
    args = parser.parse_args(argv)
    host, _, port = args.listen.rpartition(":")
    run_async(serve(host, int(port), args.interval_ms / 1000, args.prefill_ms / 1000))
    return 0


def run_async(coro: Coroutine[Any, Any, T]) -> T:
    """uvloop when installed (less per-wake-up overhead, like the sidecar), else asyncio."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
