"""The streaming APIs the engines serve, as the core reads and writes them: one dialect each (sans-IO).

The machines are the same for every API — hold the response until its first content, retry invisibly
before it, end the stream with one terminal event after it, journal it all — and what differs between the
APIs is read here, behind one interface, the way Envoy AI Gateway gives each route kind its processor
rather than an `if api == …` in the shells (docs/design.md#the-streaming-apis):

* chat completions, completions: `data:` only; first content is non-empty content, a tool call, reasoning
  or text; the clean end is `data: [DONE]` (added after a completing finish without it); an in-band failure is
  `data: {"error": …}` or finish `abort`; our terminal event is `data: {"error": …}` then `[DONE]`.
* Responses (`/v1/responses`): `event:` + `data:`; first content is a non-empty `*.delta` or an opened call
  item; the clean end is `response.completed` or `response.incomplete`; a failure is `response.failed` or
  `error`; ours is `response.failed` (the client's response id, the next sequence number).
* Messages (`/v1/messages`): `event:` + `data:`; first content is a non-empty `content_block_delta` or a
  `tool_use` block; the clean end is `message_stop`; a failure is `error`; ours is `error`.

Everything before the first content (`response.created`, `message_start`, an opened text block) is preamble:
held with the rest, so when a retry wins the client gets only the winner's — one id, sequence numbers from
0. Output tokens are counted from the API's own usage when its stream carries it (chat's `completion_tokens`,
the Responses terminal event's and Messages' `message_delta`'s `output_tokens`), else from content events.
"""

from __future__ import annotations

import enum
import json
import re
from dataclasses import dataclass

from router_sidecar.core import bounded_json
from router_sidecar.core.openai_api import RouteKind
from router_sidecar.core.sse import (
    DONE_EVENT,
    Classifier,
    EventKind,
    SseEvent,
    classify_openai,
    terminal_error_frame,
)
from router_sidecar.records import codec
from router_sidecar.records import records_pb2 as rec

__all__ = ["Dialect", "ErrorShape", "StreamNotes", "anthropic_error_type", "dialect_for"]

_Classified = tuple[EventKind, str | None, int | None]
_NON_CONTENT: _Classified = (EventKind.NON_CONTENT, None, None)
_CONTENT: _Classified = (EventKind.CONTENT, None, None)
_ERROR: _Classified = (EventKind.ERROR, None, None)
_MALFORMED: _Classified = (EventKind.MALFORMED, None, None)
_WS = b" \t\r\n"
_MAX_EVENT_DEPTH = 64

INTERRUPTED = "upstream_decode_interrupted"


class ErrorShape(enum.Enum):
    """How the API's errors look: `{"error": {…}}` (OpenAI, and vLLM's own), or Anthropic's
    `{"type": "error", "error": {"type": …}}`."""

    OPENAI = "openai"
    ANTHROPIC = "anthropic"


# --- reading events ----------------------------------------------------------------------------------------

# The output tokens of a usage object (the Responses terminal event's, Messages' message_delta's).
_OUTPUT_TOKENS_RE = re.compile(rb'"(?<!\\")output_tokens"\s*:\s*(\d{1,18})(?!\d)')
# A delta event's `delta` is a non-empty string (Responses: text, reasoning, arguments, refusal, …).
_NONEMPTY_DELTA_RE = re.compile(rb'"(?<!\\")delta"\s*:\s*"(?!")')
# A Messages delta's visible part: text, thinking, or a tool's input JSON.
_NONEMPTY_BLOCK_DELTA_RE = re.compile(rb'"(?<!\\")(?:text|thinking|partial_json)"\s*:\s*"(?!")')
# Items whose opening shows the model's action (a tool's name, a server-side call): content.
_CALL_ITEM_RE = re.compile(
    rb'"(?<!\\")type"\s*:\s*"(?:function_call|custom_tool_call|mcp_call|web_search_call|'
    rb'code_interpreter_call|file_search_call|computer_call|shell_call|local_shell_call|image_generation_call)"'
)
_TOOL_BLOCK_RE = re.compile(rb'"(?<!\\")type"\s*:\s*"(?:tool_use|server_tool_use)"')
# Without an `event:` line the event's own top-level "type" names it (engines write one either way).
_TYPE_RE = re.compile(rb'"(?<!\\")type"\s*:\s*"([a-z_.]+)"')
_ERROR_FIRST_RE = re.compile(rb'\{\s*"error"\s*:\s*+(?!null\b)')  # vLLM's chat-shaped error frame


def _payload_kind(buf: bytes, p: int, e: int) -> tuple[int, int, _Classified | None]:
    """Trim the payload; a payload that is not one JSON object, or vLLM's chat-shaped error, decides it."""
    while p < e and buf[p] in _WS:
        p += 1
    while e > p and buf[e - 1] in _WS:
        e -= 1
    if p == e:
        return p, e, _NON_CONTENT
    if buf[p : p + 1] != b"{" or buf[e - 1 : e] != b"}":
        try:
            obj = bounded_json.loads(buf[p:e], max_depth=_MAX_EVENT_DEPTH)
        except ValueError:
            return p, e, _MALFORMED
        return p, e, (_MALFORMED if not isinstance(obj, dict) else None)
    if _ERROR_FIRST_RE.match(buf, p, e):
        return p, e, _ERROR
    return p, e, None


def _name(name: bytes | None, buf: bytes, p: int, e: int) -> bytes:
    if name:
        return name
    m = _TYPE_RE.search(buf, p, e)
    return m.group(1) if m else b""


def _output_tokens(buf: bytes, p: int, e: int) -> int | None:
    m = _OUTPUT_TOKENS_RE.search(buf, p, e)
    return int(m.group(1)) if m else None


_RESPONSES_END = frozenset({b"response.completed", b"response.incomplete"})
_RESPONSES_FAILED = frozenset({b"response.failed", b"error"})


def classify_responses(name: bytes | None, buf: bytes, p: int, e: int) -> _Classified:
    """The Responses API (vLLM `entrypoints/openai/responses`, SGLang `serving_responses.py`)."""
    p, e, decided = _payload_kind(buf, p, e)
    if decided is not None:
        return decided
    name = _name(name, buf, p, e)
    if name.endswith(b".delta"):
        return _CONTENT if _NONEMPTY_DELTA_RE.search(buf, p, e) else _NON_CONTENT
    if name == b"response.output_item.added":
        return _CONTENT if _CALL_ITEM_RE.search(buf, p, e) else _NON_CONTENT
    if name in _RESPONSES_END:
        return EventKind.DONE, None, _output_tokens(buf, p, e)
    if name in _RESPONSES_FAILED:
        return _ERROR
    return _NON_CONTENT


def classify_messages(name: bytes | None, buf: bytes, p: int, e: int) -> _Classified:
    """The Messages API (vLLM `entrypoints/anthropic`, SGLang `entrypoints/anthropic`)."""
    p, e, decided = _payload_kind(buf, p, e)
    if decided is not None:
        return decided
    name = _name(name, buf, p, e)
    if name == b"content_block_delta":
        return _CONTENT if _NONEMPTY_BLOCK_DELTA_RE.search(buf, p, e) else _NON_CONTENT
    if name == b"content_block_start":
        return _CONTENT if _TOOL_BLOCK_RE.search(buf, p, e) else _NON_CONTENT
    if name == b"message_delta":
        return EventKind.NON_CONTENT, None, _output_tokens(buf, p, e)  # the final count
    if name == b"message_stop":
        return EventKind.DONE, None, None
    if name == b"error":
        return _ERROR  # even when a message_stop follows it (SGLang): the answer did not end well
    return _NON_CONTENT


# --- what the client holds: the notes a terminal event needs ----------------------------------------------

_SEQUENCE_RE = re.compile(rb'"(?<!\\")sequence_number"\s*:\s*(\d{1,18})(?!\d)')
# A non-stream Responses body starts with its id (vLLM and SGLang write `id` first).
_BODY_ID_RE = re.compile(rb'\A\s*\{\s*"id"\s*:\s*"([A-Za-z0-9._:~-]{1,200})"')


class StreamNotes:
    """What has gone to the client that our terminal event must continue: the Responses API's response id,
    its creation time and model (from `response.created`) and the last sequence number."""

    __slots__ = ("body_seen", "created_at", "model", "response_id", "sequence")

    def __init__(self) -> None:
        self.response_id: str | None = None
        self.created_at: int | None = None
        self.model: str | None = None
        self.sequence: int | None = None
        self.body_seen = False  # a non-stream body's first chunk was read (its id is read there only)

    def see_body(self, chunk: bytes) -> None:
        """A chunk of a non-stream answer: the response id is its first key."""
        if not self.body_seen:
            self.body_seen = True
            m = _BODY_ID_RE.match(chunk[:512])
            if m:
                self.response_id = m.group(1).decode()

    def see(self, event: SseEvent) -> None:
        raw = event.raw
        m = _SEQUENCE_RE.search(raw)
        if m:
            self.sequence = int(m.group(1))
        if self.response_id is None and b"response.created" in raw:
            self._created(raw)

    def _created(self, raw: bytes) -> None:
        for line in raw.splitlines():
            if line.startswith(b"data:"):
                try:
                    obj = bounded_json.loads(line[5:], max_depth=_MAX_EVENT_DEPTH)
                except ValueError:
                    return
                response = obj.get("response") if isinstance(obj, dict) else None
                if isinstance(response, dict) and isinstance(response.get("id"), str):
                    self.response_id = response["id"]
                    created, model = response.get("created_at"), response.get("model")
                    self.created_at = int(created) if isinstance(created, int | float) else None
                    self.model = model if isinstance(model, str) else None
                return


# --- the dialects ------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Dialect:
    kind: RouteKind
    classify: Classifier
    # Appended to an answer that ended with every content event and a completing finish but without its
    # end marker (chat's `[DONE]`); None: the API's end is an event of its own, which nothing replaces.
    end_marker: bytes | None
    usage_key: bytes  # the non-stream body's output-token count
    end_name: str  # what its clean end is called (in our messages)
    errors: ErrorShape
    tracks_stream: bool  # its terminal event continues what the client holds (StreamNotes)

    def notes(self) -> StreamNotes | None:
        return StreamNotes() if self.tracks_stream else None

    def terminal_event(
        self, notes: StreamNotes | None, request_id: str, delivered: int, message: str
    ) -> bytes:
        """The last event of a stream interrupted after its first delta, in the client's API."""
        if self.kind is RouteKind.RESPONSES:
            notes = notes or StreamNotes()
            failed = rec.ResponsesFailedEvent(
                type="response.failed",
                sequence_number=0 if notes.sequence is None else notes.sequence + 1,
                response=rec.ResponsesFailedResponse(
                    id=notes.response_id or request_id,
                    object="response",
                    created_at=notes.created_at,
                    model=notes.model,
                    status="failed",
                    error=_terminal_error(request_id, delivered, message),
                ),
            )
            return _named(b"response.failed", codec.to_dict(failed))
        if self.kind is RouteKind.MESSAGES:
            error = rec.MessagesErrorBody(
                type="error",
                error=rec.MessagesError(
                    type="api_error",
                    message=message,
                    code=INTERRUPTED,
                    details=rec.MessagesErrorDetails(error_code=INTERRUPTED),
                    request_id=request_id,
                    partial_output=True,
                    delivered_output_tokens=delivered,
                    retryable=False,
                ),
                request_id=request_id,
            )
            return _named(b"error", codec.to_dict(error))
        return terminal_error_frame(request_id, delivered, message)


def _terminal_error(request_id: str, delivered: int, message: str) -> rec.TerminalError:
    return rec.TerminalError(
        code=INTERRUPTED,
        message=message,
        request_id=request_id,
        partial_output=True,
        delivered_output_tokens=delivered,
        retryable=False,
    )


def _named(name: bytes, data: dict[str, object]) -> bytes:
    # json.dumps never writes a raw newline: one data line.
    return b"event: " + name + b"\ndata: " + json.dumps(data).encode("ascii") + b"\n\n"


_COMPLETION = b"completion_tokens"
_OUTPUT = b"output_tokens"
_DIALECTS = {
    RouteKind.CHAT: Dialect(
        RouteKind.CHAT, classify_openai, DONE_EVENT, _COMPLETION, "[DONE]", ErrorShape.OPENAI, False
    ),
    RouteKind.COMPLETIONS: Dialect(
        RouteKind.COMPLETIONS, classify_openai, DONE_EVENT, _COMPLETION, "[DONE]", ErrorShape.OPENAI, False
    ),
    RouteKind.RESPONSES: Dialect(
        RouteKind.RESPONSES, classify_responses, None, _OUTPUT, "response.completed", ErrorShape.OPENAI, True
    ),
    RouteKind.MESSAGES: Dialect(
        RouteKind.MESSAGES, classify_messages, None, _OUTPUT, "message_stop", ErrorShape.ANTHROPIC, False
    ),
}


def dialect_for(kind: RouteKind) -> Dialect:
    return _DIALECTS[kind]


# Anthropic's error types by HTTP status (what its SDK and clients expect in `error.type`).
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    409: "invalid_request_error",
    413: "request_too_large",
    428: "invalid_request_error",
    429: "rate_limit_error",
    503: "overloaded_error",
    504: "timeout_error",
    529: "overloaded_error",
}


def anthropic_error_type(status: int) -> str:
    return _ANTHROPIC_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
