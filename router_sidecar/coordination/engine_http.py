"""A minimal HTTP/1.1 GET for probing engines (`/health`, `/v1/models`, `/version`): the replica agent's
probes and the sidecar's health probe of static replicas. The project has no HTTP client dependency."""

from __future__ import annotations

import asyncio
import contextlib

_MAX_BODY = 1 << 20


class EngineDown(Exception):
    """The engine did not answer a probe properly; the message says how. `slow`: it did not answer in time
    (a busy engine is slow, not down: one such miss is not taken for a failure)."""

    def __init__(self, message: str, *, slow: bool = False) -> None:
        super().__init__(message)
        self.slow = slow


def split_hostport(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    host = host.strip("[]")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"expected HOST:PORT, got {text!r}")
    return host, int(port)


async def http_get(host: str, port: int, path: str, timeout: float) -> tuple[int, bytes]:
    """A minimal HTTP/1.1 GET (Connection: close); the project has no HTTP client dependency."""
    host_header = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    async with asyncio.timeout(timeout):
        reader, writer = await asyncio.open_connection(host, port)
        try:
            request = (
                f"GET {path} HTTP/1.1\r\nHost: {host_header}\r\nAccept: application/json\r\n"
                "User-Agent: router-sidecar\r\nConnection: close\r\n\r\n"
            )
            writer.write(request.encode())
            await writer.drain()
            raw = b""
            while len(raw) <= _MAX_BODY and not _complete(raw):
                chunk = await reader.read(65536)
                if not chunk:
                    break
                raw += chunk
        finally:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()
    head, sep, body = raw.partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    parts = lines[0].split(b" ", 2)
    if not sep or len(parts) < 2 or not parts[0].startswith(b"HTTP/") or not parts[1].isdigit():
        raise EngineDown(f"GET {path}: not an HTTP response")
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        headers[name.strip().lower()] = value.strip()
    if headers.get(b"transfer-encoding", b"").lower() == b"chunked":
        body = _dechunk(body)
    elif b"content-length" in headers and headers[b"content-length"].isdigit():
        body = body[: int(headers[b"content-length"])]
    return int(parts[1]), body


def _dechunk(data: bytes) -> bytes:
    out = b""
    while data:
        size_line, _, rest = data.partition(b"\r\n")
        size = int(size_line.split(b";")[0] or b"0", 16)
        if size == 0:
            break
        out += rest[:size]
        data = rest[size + 2 :]
    return out


def _complete(raw: bytes) -> bool:
    """A response framed by Content-Length is complete without waiting for the server to close (a server
    may keep the connection open despite `Connection: close`)."""
    head, sep, body = raw.partition(b"\r\n\r\n")
    if not sep:
        return False
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length" and value.strip().isdigit():
            return len(body) >= int(value.strip())
    return False
