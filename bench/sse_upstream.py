"""Bench-only OpenAI-style SSE upstream: one role event, N timestamped content events, finish, [DONE].

Each content event's ``delta.content`` starts with the ``time.monotonic_ns()`` taken right before the
write. CLOCK_MONOTONIC is system-wide on Linux, so the client (another process) subtracts it from its
own receive time to get the one-way latency of that chunk through whatever sits in between.

Run: ``python bench/sse_upstream.py --listen 127.0.0.1:PORT [--interval-ms 1]``. The number of content
events is the request's ``max_tokens``. HTTP/1.1 keep-alive, chunked, one SSE event per HTTP chunk.
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


def http_chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def _error(status: bytes, message: str) -> bytes:
    body = json.dumps({"error": {"message": message, "type": "BadRequestError", "code": 400}}).encode()
    return b"HTTP/1.1 %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (
        status,
        len(body),
        body,
    )


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
            if method != "POST" or path.partition("?")[0] != "/v1/chat/completions":
                writer.write(_error(b"404 Not Found", f"no route {method} {path}"))
                continue
            try:
                chunks = int(json.loads(body).get("max_tokens") or 0)
            except (ValueError, AttributeError, TypeError):
                chunks = -1
            if not 0 < chunks <= MAX_CHUNKS:
                writer.write(_error(b"400 Bad Request", f"max_tokens must be 1..{MAX_CHUNKS}"))
                continue
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
