"""The official `openai` SDK as the client, with the raw bytes it read kept aside for byte-level checks."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import openai


class TeeTransport(httpx.HTTPTransport):
    """An httpx transport that records every response body byte the client reads."""

    def __init__(self) -> None:
        super().__init__()
        self.raw = bytearray()
        self.headers: dict[str, str] = {}
        self.status = 0

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        response = super().handle_request(request)
        self.status, self.headers = response.status_code, dict(response.headers)
        tee = self
        inner = response.stream
        assert isinstance(inner, httpx.SyncByteStream)

        class _Stream(httpx.SyncByteStream):
            def __iter__(self) -> Iterator[bytes]:
                for chunk in inner:
                    tee.raw += chunk
                    yield chunk

            def close(self) -> None:
                inner.close()

        return httpx.Response(
            response.status_code,
            headers=response.headers,
            stream=_Stream(),
            extensions=response.extensions,
            request=request,
        )


def sdk_client(base_url: str, *, read_timeout: float = 60.0) -> tuple[openai.OpenAI, TeeTransport]:
    tee = TeeTransport()
    http = httpx.Client(transport=tee, timeout=httpx.Timeout(read_timeout, connect=5.0))
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, http_client=http)
    return client, tee


@dataclass
class Streamed:
    """What one streamed request gave the client: SDK objects, the SDK's exception, and the raw bytes."""

    chunks: list[Any] = field(default_factory=list)
    error: BaseException | None = None
    raw: bytes = b""
    headers: dict[str, str] = field(default_factory=dict)
    status: int = 0

    @property
    def request_id(self) -> str:
        return self.headers.get("x-request-id", "")

    def payloads(self) -> list[Any]:
        """Every complete SSE event's data from the raw bytes: parsed JSON or the string ``[DONE]``."""
        text = self.raw.replace(b"\r\n", b"\n")
        *events, _rest = text.split(b"\n\n")
        out: list[Any] = []
        for event in events:
            lines = [ln[5:].lstrip() for ln in event.split(b"\n") if ln.startswith(b"data:")]
            if not lines:
                continue
            data = b"\n".join(lines)
            out.append("[DONE]" if data == b"[DONE]" else json.loads(data))
        return out

    def torn_tail(self) -> bytes:
        return self.raw.replace(b"\r\n", b"\n").split(b"\n\n")[-1]

    def content_payloads(self) -> list[dict[str, Any]]:
        return [p for p in self.payloads() if isinstance(p, dict) and has_content(p)]

    def content_ids(self) -> set[str]:
        return {p["id"] for p in self.content_payloads()}

    def error_frames(self) -> list[dict[str, Any]]:
        return [
            p["error"] for p in self.payloads() if isinstance(p, dict) and isinstance(p.get("error"), dict)
        ]

    def done_count(self) -> int:
        return sum(1 for p in self.payloads() if p == "[DONE]")

    def last_usage_tokens(self) -> int | None:
        """completion_tokens of the last usage figure the client received (continuous usage stats)."""
        found = None
        for p in self.payloads():
            if isinstance(p, dict) and isinstance(p.get("usage"), dict):
                found = p["usage"].get("completion_tokens")
        return found

    def finish_reasons(self) -> list[str]:
        return [
            c["finish_reason"]
            for p in self.payloads()
            if isinstance(p, dict)
            for c in p.get("choices") or []
            if c.get("finish_reason")
        ]


def has_content(payload: dict[str, Any]) -> bool:
    choices = payload.get("choices") or []
    if not choices:
        return False
    choice = choices[0]
    delta = choice.get("delta") or {}
    return bool(
        delta.get("content")
        or delta.get("tool_calls")
        or delta.get("reasoning_content")
        or choice.get("text")
    )
