"""Incremental, sans-IO scanner for OpenAI-style Server-Sent Event streams.

Every response chunk of every stream goes through :class:`SseScanner`, so it is written for
the common case (whole ``data: {...}\\n\\n`` events, LF line endings, nothing held back) and
classifies events with byte scans instead of JSON parsing.

Why the byte scans are exact: in JSON text every ``"`` inside a string is escaped as ``\\"``,
so a ``"key"`` that is not preceded by a backslash and is followed by ``:`` is an object key.
The scans assume keys are written literally (no ``\\u`` escapes inside key names), which every
engine and JSON encoder does. Events whose shape the scans cannot decide (data that is not a
single JSON object, or an ``"error"`` key that is not the first key) fall back to ``json.loads``.
"""

from __future__ import annotations

import enum
import json
import re
from dataclasses import dataclass
from typing import Any

__all__ = [
    "DONE_EVENT",
    "EventKind",
    "SseEvent",
    "SseScanner",
    "terminal_error_frame",
]


class EventKind(enum.Enum):
    COMMENT = "comment"  # only comment lines (keep-alives)
    DONE = "done"  # data: [DONE]
    ERROR = "error"  # in-band error object (status was already 200)
    CONTENT = "content"  # a "first delta" candidate: user-visible content
    NON_CONTENT = "non_content"  # role-only, empty delta, finish-only, usage-only, field-only


@dataclass(frozen=True, slots=True)
class SseEvent:
    # The complete event exactly as received, including leading blank lines and the blank line ending it.
    raw: bytes
    kind: EventKind
    # finish_reason of the first choice that has one ("stop", "length", "tool_calls", "abort", ...).
    finish_reason: str | None
    # usage.completion_tokens when the event carries usage (final usage event or continuous_usage_stats).
    usage_completion_tokens: int | None


DONE_EVENT = b"data: [DONE]\n\n"

_DEFAULT_INTERRUPTED_MESSAGE = (
    "generation was interrupted after part of the answer was delivered; "
    "the gateway does not retry automatically"
)


def terminal_error_frame(
    request_id: str, delivered_output_tokens: int, message: str = _DEFAULT_INTERRUPTED_MESSAGE
) -> bytes:
    """The last event of an interrupted stream, followed by ``data: [DONE]``.

    Same ``data: {"error": {...}}`` shape (with spaces) that vLLM writes for an in-band error,
    so clients that already handle vLLM's mid-stream errors handle this one too.
    """
    obj = {
        "error": {
            "code": "upstream_decode_interrupted",
            "message": message,
            "request_id": request_id,
            "partial_output": True,
            "delivered_output_tokens": delivered_output_tokens,
            "retryable": False,
        }
    }
    # json.dumps never writes a raw newline, so the object stays on one data line.
    return b"data: " + json.dumps(obj).encode("ascii") + b"\n\n" + DONE_EVENT


# --- classification --------------------------------------------------------------------------

# A non-empty string value: the first byte after the opening quote is not the closing quote.
# "reasoning" (newer vLLM) and "refusal" (OpenAI) are visible text too; counting them is the safe side.
# Each pattern starts with a literal quote and then looks back at it (`"(?<!\\")`: not an escaped
# quote), which lets the regex engine skip to quotes instead of trying a lookbehind at every byte.
_CONTENT_RE = re.compile(
    rb'"(?<!\\")(?:(?:content|reasoning_content|reasoning|refusal|text)"\s*:\s*"(?!")'
    rb'|tool_calls"\s*:\s*\[\s*[^\s\]])'
)
_FINISH_RE = re.compile(rb'"(?<!\\")finish_reason"\s*:\s*"((?:[^"\\]|\\.)*)"')
_USAGE_RE = re.compile(rb'"(?<!\\")completion_tokens"\s*:\s*(\d+)')
_ERROR_FIRST_RE = re.compile(rb'\{\s*"error"\s*:')  # used with .match at the payload start
_ERROR_ANY_RE = re.compile(rb'"(?<!\\")error"\s*:')
_WS = b" \t\r\n"
_DONE_PAYLOAD = b"[DONE]"
_OPEN_BRACE = ord("{")
_CLOSE_BRACE = ord("}")

_Classified = tuple[EventKind, str | None, int | None]
_NON_CONTENT: _Classified = (EventKind.NON_CONTENT, None, None)
_DONE: _Classified = (EventKind.DONE, None, None)
_COMMENT: _Classified = (EventKind.COMMENT, None, None)


def _classify_payload(buf: bytes, p: int, e: int) -> _Classified:
    """Classify the data payload ``buf[p:e]`` without slicing it in the common case."""
    while p < e and buf[p] in _WS:
        p += 1
    while e > p and buf[e - 1] in _WS:
        e -= 1
    if p == e:
        return _NON_CONTENT  # empty data: nothing visible
    if e - p == 6 and buf.startswith(_DONE_PAYLOAD, p):
        return _DONE
    if buf[p] != _OPEN_BRACE or buf[e - 1] != _CLOSE_BRACE:
        return _classify_by_json(buf[p:e])
    if _ERROR_FIRST_RE.match(buf, p, e):
        kind = EventKind.ERROR
    elif buf.find(b'"error"', p, e) >= 0 and _ERROR_ANY_RE.search(buf, p, e):
        return _classify_by_json(buf[p:e])  # is that "error" key top-level or nested?
    elif _CONTENT_RE.search(buf, p, e):
        kind = EventKind.CONTENT
    else:
        kind = EventKind.NON_CONTENT
    finish: str | None = None
    m = _FINISH_RE.search(buf, p, e)
    if m:
        raw = m.group(1)
        finish = json.loads(b'"' + raw + b'"') if b"\\" in raw else raw.decode("utf-8", "replace")
    usage: int | None = None
    m = _USAGE_RE.search(buf, p, e)
    if m:
        usage = int(m.group(1))
    return kind, finish, usage


def _nonempty_str(v: Any) -> bool:
    return isinstance(v, str) and v != ""


def _classify_by_json(payload: bytes) -> _Classified:
    try:
        obj = json.loads(payload)
    except ValueError:  # includes UnicodeDecodeError
        obj = None
    if not isinstance(obj, dict):
        # Bytes the client will see that we cannot prove empty: count them as content, which
        # forbids a retry (safe) instead of risking two attempts' output in one stream.
        return EventKind.CONTENT, None, None
    usage: int | None = None
    u = obj.get("usage")
    if isinstance(u, dict):
        ct = u.get("completion_tokens")
        if isinstance(ct, int) and not isinstance(ct, bool):
            usage = ct
    if "error" in obj:
        return EventKind.ERROR, None, usage
    content = False
    finish: str | None = None
    choices = obj.get("choices")
    for ch in choices if isinstance(choices, list) else ():
        if not isinstance(ch, dict):
            continue
        fr = ch.get("finish_reason")
        if finish is None and isinstance(fr, str):
            finish = fr
        if _nonempty_str(ch.get("text")):
            content = True
        delta = ch.get("delta")
        if isinstance(delta, dict):
            tc = delta.get("tool_calls")
            if (isinstance(tc, list) and tc) or any(
                _nonempty_str(delta.get(k)) for k in ("content", "reasoning_content", "reasoning", "refusal")
            ):
                content = True
    return (EventKind.CONTENT if content else EventKind.NON_CONTENT), finish, usage


_LINE_SPLIT_RE = re.compile(rb"\r\n|\r|\n")


def _classify_lines(body: bytes) -> _Classified:
    """Slow path: an event with several lines, comments, other fields or CR line endings."""
    data: list[bytes] = []
    comments = 0
    fields = 0
    for line in _LINE_SPLIT_RE.split(body):
        if line.startswith(b":"):
            comments += 1
            continue
        name, _, value = line.partition(b":")
        if name == b"data":
            data.append(value[1:] if value.startswith(b" ") else value)
        else:
            fields += 1  # event:, id:, retry:, unknown: ignored for classification
    if data:
        payload = data[0] if len(data) == 1 else b"\n".join(data)
        return _classify_payload(payload, 0, len(payload))
    if comments and not fields:
        return _COMMENT
    return _NON_CONTENT


# --- framing ---------------------------------------------------------------------------------

# Two consecutive line terminators = end of a non-blank line + a blank line. The atomic groups
# keep "\r\n" one terminator (no backtracking into "\r" + "\n").
_EVENT_END_RE = re.compile(rb"(?>\r\n|\r|\n)(?>\r\n|\r|\n)")
_LF = ord("\n")
_CR = ord("\r")
_DATA_PREFIX = b"data:"
_SPACE = ord(" ")


def _event(buf: bytes, start: int, body: int, end: int) -> SseEvent:
    """LF framing: event is ``buf[start:end + 2]``; its lines are ``buf[body:end]``."""
    if buf.startswith(_DATA_PREFIX, body) and buf.find(b"\n", body, end) < 0:
        p = body + 5
        if p < end and buf[p] == _SPACE:
            p += 1
        kind, finish, usage = _classify_payload(buf, p, end)
    else:
        kind, finish, usage = _classify_lines(buf[body:end])
    return SseEvent(buf[start : end + 2], kind, finish, usage)


class SseScanner:
    """Splits a byte stream into SSE events and classifies each one.

    ``feed`` returns the events completed by the data, in order; bytes of an incomplete event
    are held in ``pending``. ``b"".join(e.raw for e in events) + pending`` is always exactly the
    input. Blank lines before an event belong to that event's ``raw``. Accepts LF, CRLF and CR
    line endings and any split of the input into chunks.
    """

    __slots__ = ("_buf", "_resume")

    def __init__(self) -> None:
        self._buf = b""
        # Offset in _buf before which no event end can start: the bytes were scanned already.
        self._resume = 0

    @property
    def pending(self) -> bytes:
        return self._buf

    def feed(self, data: bytes) -> list[SseEvent]:
        # bytes(data) does not copy bytes; it freezes a bytearray or memoryview.
        buf = self._buf + data if self._buf else bytes(data)
        if b"\r" in buf:
            return self._feed_general(buf, final=False)
        events: list[SseEvent] = []
        n = len(buf)
        pos = 0
        resume = self._resume
        while pos < n:
            body = pos
            while body < n and buf[body] == _LF:
                body += 1
            end = buf.find(b"\n\n", max(body, resume))
            if end < 0:
                break
            events.append(_event(buf, pos, body, end))
            pos = end + 2
            resume = 0
        self._buf = buf[pos:] if pos else buf
        # The last byte may be the first half of an event end, so it is scanned again.
        self._resume = max(len(self._buf) - 1, 0) if self._buf else 0
        return events

    def close(self) -> list[SseEvent]:
        """End of input: an event whose blank line is a lone CR at the very end is complete now.

        (``feed`` holds such an event back because a following ``\\n`` would still belong to it.)
        Whatever remains in ``pending`` afterwards is an incomplete event.
        """
        if not self._buf:
            return []
        return self._feed_general(self._buf, final=True)

    def _feed_general(self, buf: bytes, *, final: bool) -> list[SseEvent]:
        events: list[SseEvent] = []
        n = len(buf)
        pos = 0
        resume = self._resume
        held = -1
        while pos < n:
            body = pos
            while body < n and (buf[body] == _LF or buf[body] == _CR):
                body += 1
            m = _EVENT_END_RE.search(buf, max(body, resume))
            if m is None:
                break
            end = m.end()
            if end == n and buf[-1] == _CR and not final:
                held = m.start()  # a "\n" in the next chunk still belongs to this event
                break
            kind, finish, usage = _classify_lines(buf[body : m.start()])
            events.append(SseEvent(buf[pos:end], kind, finish, usage))
            pos = end
            resume = 0
        self._buf = buf[pos:] if pos else buf
        # An event end spans at most 4 bytes ("\r\n\r\n"), so earlier starts were ruled out.
        self._resume = held - pos if held >= 0 else max(len(self._buf) - 3, 0)
        return events
