"""The official SDKs as the clients (`openai` for chat, completions and Responses; `anthropic` for Messages),
with the raw bytes they read kept aside for byte-level checks."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import anthropic
import httpx
import httpx2
import openai


def _tee_transport(http: ModuleType) -> type[Any]:
    """An HTTP transport of the module `http` (httpx, or httpx2, which the anthropic SDK requires) that
    records every response body byte the client reads."""

    class Tee(http.HTTPTransport):  # type: ignore[name-defined,misc]
        def __init__(self) -> None:
            super().__init__()
            self.raw = bytearray()
            self.headers: dict[str, str] = {}
            self.status = 0

        def handle_request(self, request: Any) -> Any:
            response = super().handle_request(request)
            self.status, self.headers = response.status_code, dict(response.headers)
            tee = self
            inner = response.stream
            assert isinstance(inner, http.SyncByteStream)

            class _Stream(http.SyncByteStream):  # type: ignore[name-defined,misc]
                def __iter__(self) -> Iterator[bytes]:
                    for chunk in inner:
                        tee.raw += chunk
                        yield chunk

                def close(self) -> None:
                    inner.close()

            return http.Response(
                response.status_code,
                headers=response.headers,
                stream=_Stream(),
                extensions=response.extensions,
                request=request,
            )

    Tee.__name__ = Tee.__qualname__ = f"TeeTransport[{http.__name__}]"
    return Tee


TeeTransport = _tee_transport(httpx)
TeeTransport2 = _tee_transport(httpx2)


def sdk_client(base_url: str, *, read_timeout: float = 60.0) -> tuple[openai.OpenAI, Any]:
    tee = TeeTransport()
    http = httpx.Client(transport=tee, timeout=httpx.Timeout(read_timeout, connect=5.0))
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, http_client=http)
    return client, tee


def anthropic_client(base_url: str, *, read_timeout: float = 60.0) -> tuple[anthropic.Anthropic, Any]:
    """The anthropic SDK (it takes an httpx2 client only). Its credential is the bearer token the openai
    client sends (`auth_token`, `Authorization: Bearer unused`): the same tenant, so journal look-ups with the
    tiers' AUTH find its requests."""
    tee = TeeTransport2()
    http = httpx2.Client(transport=tee, timeout=httpx2.Timeout(read_timeout, connect=5.0))
    client = anthropic.Anthropic(base_url=base_url, auth_token="unused", max_retries=0, http_client=http)
    return client, tee


@dataclass(frozen=True)
class Named:
    """One complete SSE event of a named-event API (Responses, Messages) as the client received it."""

    name: str  # its `event:` line ("" when it had none)
    data: dict[str, Any]


def named_events(raw: bytes) -> list[Named]:
    """Every complete event of the raw body (a torn last event is left out: see Streamed.torn_tail)."""
    text = raw.replace(b"\r\n", b"\n")
    *blocks, _rest = text.split(b"\n\n")
    out: list[Named] = []
    for block in blocks:
        name, data = "", []
        for line in block.split(b"\n"):
            if line.startswith(b"event:"):
                name = line[6:].strip().decode()
            elif line.startswith(b"data:"):
                data.append(line[5:].lstrip())
        if data:
            out.append(Named(name, json.loads(b"\n".join(data))))
    return out


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

    def read(self, stream: Any, on_event: Callable[[Any, Streamed], bool] | None) -> None:
        """Every object the SDK's `stream` yields, until `on_event` says stop; the stream closed after."""
        try:
            for event in stream:
                self.chunks.append(event)
                if on_event is not None and on_event(event, self):
                    break
        finally:
            stream.close()

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
