"""Incremental, sans-IO scanner for OpenAI-style Server-Sent Event streams.

Every response chunk of every stream goes through :class:`SseScanner`, so it is written for
the common case (whole ``data: {...}\\n\\n`` events, LF line endings, nothing held back) and
classifies events with byte scans instead of JSON parsing.

Why the byte scans are exact: in JSON text every ``"`` inside a string is escaped as ``\\"``,
so a ``"key"`` that is not preceded by a backslash and is followed by ``:`` is an object key.
The scans assume keys are written literally (no ``\\u`` escapes inside key names), which every
engine and JSON encoder does. Events whose shape the scans cannot decide (data that is not a
single JSON object, or a non-null ``"error"`` key that is not the first key) fall back to a JSON
parse bounded in depth, so no replica bytes can raise from here.

:class:`UsageTail` reads ``usage.completion_tokens`` of a non-stream body with the same byte scan,
keeping a bounded tail of the body instead of the body.
"""

from __future__ import annotations

import enum
import functools
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from router_sidecar.core import bounded_json
from router_sidecar.records import codec
from router_sidecar.records import records_pb2 as rec

__all__ = [
    "DONE_EVENT",
    "Classifier",
    "EventKind",
    "SseEvent",
    "SseScanner",
    "UsageTail",
    "terminal_error_frame",
]


class EventKind(enum.Enum):
    COMMENT = "comment"  # only comment lines (keep-alives)
    DONE = "done"  # the stream's clean end: data: [DONE] (or a named API's terminal event)
    ERROR = "error"  # in-band error object (status was already 200)
    CONTENT = "content"  # a "first delta" candidate: user-visible content
    # Not a JSON object (nor [DONE]): a broken replica. Held, it fails the attempt (the client saw nothing);
    # once released, its bytes are counted as content (we cannot prove them empty).
    MALFORMED = "malformed"
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
    frame = rec.TerminalFrame(
        error=rec.TerminalError(
            code="upstream_decode_interrupted",
            message=message,
            request_id=request_id,
            partial_output=True,
            delivered_output_tokens=delivered_output_tokens,
            retryable=False,
        )
    )
    # json.dumps never writes a raw newline, so the object stays on one data line.
    return b"data: " + json.dumps(codec.to_dict(frame)).encode("ascii") + b"\n\n" + DONE_EVENT


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
# At most 18 digits: always an int64, and int() never meets Python's limit on digits (a ValueError).
_USAGE_RE = re.compile(rb'"(?<!\\")completion_tokens"\s*:\s*(\d{1,18})(?!\d)')
_USAGE_KEY = b'"completion_tokens"'
# An in-band error is a non-null top-level "error" ("error": null is how some servers say "none").
# The possessive \s*+ keeps the lookahead from being tried before the spaces.
_ERROR_FIRST_RE = re.compile(rb'\{\s*"error"\s*:\s*+(?!null\b)')  # used with .match at the payload start
_ERROR_SET_RE = re.compile(rb'"(?<!\\")error"\s*:\s*+(?!null\b)')
_WS = b" \t\r\n"
_DONE_PAYLOAD = b"[DONE]"
_OPEN_BRACE = ord("{")
_CLOSE_BRACE = ord("}")

_Classified = tuple[EventKind, str | None, int | None]
# How one API reads one event: its `event:` name (None without one) and its data payload buf[p:e] → the
# event's kind, its finish_reason, and the output tokens its usage says (each None where it has none).
Classifier = Callable[[bytes | None, bytes, int, int], _Classified]
_NON_CONTENT: _Classified = (EventKind.NON_CONTENT, None, None)
_DONE: _Classified = (EventKind.DONE, None, None)
_COMMENT: _Classified = (EventKind.COMMENT, None, None)


def classify_openai(name: bytes | None, buf: bytes, p: int, e: int) -> _Classified:
    """Chat completions and completions: `data:`-only events, the end is `data: [DONE]`."""
    return _classify_payload(buf, p, e)


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
    elif buf.find(b'"error"', p, e) >= 0 and _ERROR_SET_RE.search(buf, p, e):
        return _classify_by_json(buf[p:e])  # is that non-null "error" key top-level or nested?
    elif _CONTENT_RE.search(buf, p, e):
        kind = EventKind.CONTENT
    else:
        kind = EventKind.NON_CONTENT
    # Each regex search starts at the first occurrence of its key (a C-speed find), or not at all.
    finish: str | None = None
    i = buf.find(b'"finish_reason"', p, e)
    m = _FINISH_RE.search(buf, i, e) if i >= 0 else None
    if m:
        raw = m.group(1)
        finish = _unescape(raw) if b"\\" in raw else raw.decode("utf-8", "replace")
    usage: int | None = None
    i = buf.find(_USAGE_KEY, p, e)
    m = _USAGE_RE.search(buf, i, e) if i >= 0 else None
    if m:
        usage = int(m.group(1))
    return kind, finish, usage


def _unescape(raw: bytes) -> str:
    """A JSON string body with escapes; an invalid escape (not JSON, so not an engine's) is kept as is."""
    try:
        return json.loads(b'"' + raw + b'"')
    except ValueError:
        return raw.decode("utf-8", "replace")


def _nonempty_str(v: Any) -> bool:
    return isinstance(v, str) and v != ""


# Engines nest an event 4-6 levels deep; the bound keeps a hostile event from costing a deep parse.
_MAX_EVENT_DEPTH = 64
_MAX_USAGE = 10**18  # what _USAGE_RE reads: 18 digits


def _classify_by_json(payload: bytes) -> _Classified:
    try:
        obj = bounded_json.loads(payload, max_depth=_MAX_EVENT_DEPTH)
    except bounded_json.JsonTooDeep:
        # No engine nests an event this deep: a broken replica, failed like an in-band error (retried before
        # the first delta, a terminal frame after it), never forwarded to a client's JSON parser.
        return EventKind.ERROR, None, None
    except ValueError:  # invalid JSON, UnicodeDecodeError, NaN/Infinity (vLLM writes -Infinity logprobs)
        if payload[:1] == b"{" and payload[-1:] == b"}":
            # An object a strict parser refuses (NaN, a 5000-digit int, invalid UTF-8 in a string): read its
            # bytes as the fast path does. Where "error" sits cannot be told: only a leading one counts.
            if _ERROR_FIRST_RE.match(payload):
                return EventKind.ERROR, None, None
            return (EventKind.CONTENT if _CONTENT_RE.search(payload) else EventKind.NON_CONTENT), None, None
        return EventKind.MALFORMED, None, None
    if not isinstance(obj, dict):
        return EventKind.MALFORMED, None, None
    usage: int | None = None
    u = obj.get("usage")
    if isinstance(u, dict):
        ct = u.get("completion_tokens")
        if isinstance(ct, int) and not isinstance(ct, bool) and 0 <= ct < _MAX_USAGE:
            usage = ct
    if obj.get("error") is not None:
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


def _classify_lines(body: bytes, classify: Classifier) -> _Classified:
    """Slow path: an event with several lines, comments, other fields or CR line endings."""
    data: list[bytes] = []
    event: bytes | None = None
    comments = 0
    fields = 0
    for line in _LINE_SPLIT_RE.split(body):
        if line.startswith(b":"):
            comments += 1
            continue
        name, _, value = line.partition(b":")
        value = value[1:] if value.startswith(b" ") else value
        if name == b"data":
            data.append(value)
        else:
            fields += 1  # id:, retry:, unknown: ignored for classification
            if name == b"event":
                event = value
    if data:
        payload = data[0] if len(data) == 1 else b"\n".join(data)
        return classify(event, payload, 0, len(payload))
    if comments and not fields:
        return _COMMENT
    return _NON_CONTENT


# --- framing ---------------------------------------------------------------------------------

# Two consecutive line terminators = end of a non-blank line + a blank line. The atomic groups
# keep "\r\n" one terminator (no backtracking into "\r" + "\n").
_EVENT_END_RE = re.compile(rb"(?>\r\n|\r|\n)(?>\r\n|\r|\n)")
_BLANK_LF_RE = re.compile(rb"\n*")
_BLANK_RE = re.compile(rb"[\r\n]*")
_LF = ord("\n")
_CR = ord("\r")
_DATA_PREFIX = b"data:"
_EVENT_PREFIX = b"event:"
_SPACE = ord(" ")


def _skip_blank(blank: re.Pattern[bytes], buf: bytes | bytearray, pos: int) -> int:
    """Offset of the first byte at or after ``pos`` that is not a line terminator."""
    m = blank.match(buf, pos)
    return m.end() if m else pos


def _event(buf: bytes, start: int, body: int, end: int, classify: Classifier) -> SseEvent:
    """LF framing: event is ``buf[start:end + 2]``; its lines are ``buf[body:end]``."""
    if buf.startswith(_DATA_PREFIX, body) and buf.find(b"\n", body, end) < 0:
        p = body + 5
        if p < end and buf[p] == _SPACE:
            p += 1
        kind, finish, usage = classify(None, buf, p, end)
    elif (
        buf.startswith(_EVENT_PREFIX, body)
        and (nl := buf.find(b"\n", body, end)) > 0
        and (buf.startswith(_DATA_PREFIX, nl + 1) and buf.find(b"\n", nl + 1, end) < 0)
    ):
        # `event: NAME` + one `data:` line, the named APIs' common case: no split, no slow path.
        n = body + 6
        if buf[n] == _SPACE:
            n += 1
        p = nl + 6
        if p < end and buf[p] == _SPACE:
            p += 1
        kind, finish, usage = classify(buf[n:nl], buf, p, end)
    else:
        kind, finish, usage = _classify_lines(buf[body:end], classify)
    return SseEvent(buf[start : end + 2], kind, finish, usage)


class SseScanner:
    """Splits a byte stream into SSE events and classifies each one.

    ``feed`` returns the events completed by the data, in order; bytes of an incomplete event
    are held in ``pending``. ``b"".join(e.raw for e in events) + pending`` is always exactly the
    input, until ``oversized``. Blank lines before an event belong to that event's ``raw``.
    Accepts LF, CRLF and CR line endings and any split of the input into chunks.

    Cost is linear in the input however it is split: held bytes are appended to a buffer, and
    the search for an event's end goes on from where the previous one stopped.

    **Bound.** No event over ``max_event_bytes`` is held or returned. When an event (with the blank
    lines before it), complete or not, exceeds it, the scanner drops it and turns ``oversized``:
    that ``feed`` still returns the events completed before, and every later ``feed`` or
    ``close`` returns ``[]`` and holds nothing. The caller decides what an
    oversized event means for its stream (fail the attempt, or end the stream with an error).
    """

    __slots__ = ("_body", "_buf", "_classify", "_cr", "_max_event_bytes", "_oversized", "_resume")

    def __init__(self, max_event_bytes: int = 1 << 20, classify: Classifier = classify_openai) -> None:
        if max_event_bytes < 1:
            raise ValueError(f"max_event_bytes must be positive, got {max_event_bytes}")
        self._max_event_bytes = max_event_bytes
        self._classify = classify  # how the stream's API reads an event (core/dialects.py)
        self._oversized = False
        # The held bytes of an incomplete event; empty in the common case.
        self._buf = bytearray()
        # Offset in _buf of the event's first line, or -1 while _buf holds only blank lines.
        self._body = -1
        # Offset in _buf from which the search for the event's end goes on: no end starts before it
        # (while _body is -1: the blank lines end no earlier).
        self._resume = 0
        # _buf holds a CR: the event's end is found by the general (CR, CRLF, LF) pattern.
        self._cr = False

    @property
    def pending(self) -> bytes:
        """A copy of the held bytes (``pending_size`` tells whether there are any, without copying)."""
        return bytes(self._buf)

    @property
    def pending_size(self) -> int:
        return len(self._buf)

    @property
    def oversized(self) -> bool:
        """An event grew over ``max_event_bytes``; the scanner has stopped (see the class docstring)."""
        return self._oversized

    def feed(self, data: bytes) -> list[SseEvent]:
        if self._buf:
            return self._feed_held(data)
        if self._oversized:
            return []
        # Fast path, nothing held: scan the chunk itself. bytes(data) does not copy bytes; it
        # freezes a bytearray or memoryview.
        buf = bytes(data)
        if b"\r" in buf:
            body = _skip_blank(_BLANK_RE, buf, 0)
            return self._scan_general(buf, body, body, final=False)
        body = 0 if buf[:1] != b"\n" else _skip_blank(_BLANK_LF_RE, buf, 0)
        return self._scan_lf(buf, body, body)

    def close(self) -> list[SseEvent]:
        """End of input: an event whose blank line is a lone CR at the very end is complete now.

        (``feed`` holds such an event back because a following ``\\n`` would still belong to it.)
        Whatever remains in ``pending`` afterwards is an incomplete event.
        """
        if not self._cr or self._body < 0:
            return []  # without a CR, feed has completed every event it could
        buf = bytes(self._buf)
        self._buf = bytearray()
        return self._scan_general(buf, self._body, self._resume, final=True)

    def _feed_held(self, data: bytes) -> list[SseEvent]:
        """Bytes arrive while an event is held: search only the new bytes for its end."""
        buf = self._buf
        old = len(buf)
        buf += data
        n = len(buf)
        if not self._cr and buf.find(b"\r", old) >= 0:
            self._cr = True
        cr = self._cr
        body = self._body
        if body < 0:
            body = _skip_blank(_BLANK_RE if cr else _BLANK_LF_RE, buf, self._resume)
            if body == n:
                self._resume = n
                return self._check_size()
            self._body = body
        start = max(body, self._resume)
        if cr:
            m = _EVENT_END_RE.search(buf, start)
            if m is None or (m.end() == n and buf[-1] == _CR):
                # No end yet, or one ending in a lone CR whose "\n" may come next: search again from
                # its start; an end spans at most 4 bytes ("\r\n\r\n"), so earlier starts are ruled out.
                self._resume = m.start() if m is not None else max(n - 3, body)
                return self._check_size()
        elif buf.find(b"\n\n", start) < 0:
            self._resume = max(n - 1, body)  # the last byte may be the first "\n" of the end
            return self._check_size()
        # The event is complete: scan on from the same point, in an immutable copy that the events'
        # raw bytes are sliced from (each held byte is copied once more, so the cost stays linear).
        frozen = bytes(buf)
        self._buf = bytearray()
        if cr:
            return self._scan_general(frozen, body, start, final=False)
        return self._scan_lf(frozen, body, start)

    def _check_size(self) -> list[SseEvent]:
        if len(self._buf) > self._max_event_bytes:
            self._stop()
        return []

    def _stop(self) -> None:
        self._oversized = True
        self._buf = bytearray()
        self._body, self._resume, self._cr = -1, 0, False

    def _hold(self, buf: bytes, pos: int, body: int, resume: int, cr: bool) -> None:
        """Hold ``buf[pos:]``, the start of an incomplete event (offsets are in ``buf``)."""
        n = len(buf)
        if n - pos > self._max_event_bytes:
            self._stop()  # before copying what would not be kept
            return
        self._buf = bytearray(memoryview(buf)[pos:]) if pos else bytearray(buf)
        self._body = body - pos if body < n else -1
        self._resume = resume - pos
        self._cr = cr

    def _scan_lf(self, buf: bytes, body: int, start: int) -> list[SseEvent]:
        """The events in ``buf`` (no CR in it), holding an incomplete rest.

        The first event's lines start at ``body`` and its end is searched from ``start``.
        """
        events: list[SseEvent] = []
        n = len(buf)
        pos = 0
        while True:
            end = buf.find(b"\n\n", start)
            if end < 0:
                if pos < n:
                    self._hold(buf, pos, body, max(n - 1, body), cr=False)
                return events
            if end + 2 - pos > self._max_event_bytes:
                self._stop()  # complete, but over the bound all the same: never returned
                return events
            events.append(_event(buf, pos, body, end, self._classify))
            pos = end + 2
            if pos == n:
                return events
            body = start = pos if buf[pos] != _LF else _skip_blank(_BLANK_LF_RE, buf, pos)

    def _scan_general(self, buf: bytes, body: int, start: int, *, final: bool) -> list[SseEvent]:
        """``_scan_lf`` for any line endings; ``final``: the input ends with ``buf``."""
        events: list[SseEvent] = []
        n = len(buf)
        pos = 0
        while True:
            m = _EVENT_END_RE.search(buf, start)
            if m is None or (m.end() == n and buf[-1] == _CR and not final):
                if pos < n:
                    resume = m.start() if m is not None else max(n - 3, body)
                    self._hold(buf, pos, body, resume, cr=buf.find(b"\r", pos) >= 0)
                return events
            end = m.end()
            if end - pos > self._max_event_bytes:
                self._stop()  # complete, but over the bound all the same: never returned
                return events
            kind, finish, usage = _classify_lines(buf[body : m.start()], self._classify)
            events.append(SseEvent(buf[pos:end], kind, finish, usage))
            pos = end
            if pos == n:
                return events
            body = start = _skip_blank(_BLANK_RE, buf, pos)


# --- non-stream usage -------------------------------------------------------------------------

_BACKSLASH = ord("\\")


_ABORT_RE = re.compile(rb'"(?<!\\")finish_reason"\s*:\s*"abort"')
_ABORT_CARRY = 64  # longer than the key, its colon, spaces and the value: a split match is still seen


class AbortScan:
    """Whether a non-stream body says `finish_reason: "abort"` anywhere: the engine cut the answer short (it
    was shutting down), which is an interruption, not a completion. O(size), O(1) memory."""

    __slots__ = ("_carry", "aborted")

    def __init__(self) -> None:
        self._carry = b""
        self.aborted = False

    def feed(self, chunk: bytes) -> None:
        if self.aborted or not chunk:
            return
        data = self._carry + chunk if self._carry else chunk
        if _ABORT_RE.search(data):
            self.aborted = True
        self._carry = data[-_ABORT_CARRY:]


class UsageTail:
    """``usage.completion_tokens`` of a non-stream JSON body, read as it passes, in bounded memory.

    vLLM writes ``usage`` near the end of a non-stream chat/completions body, after ``choices``
    (which can be megabytes with logprobs). ``feed`` keeps only the last ``keep_bytes`` of the
    body, so a key split between chunks is still read whole. ``completion_tokens`` is the value
    of the last unescaped ``"completion_tokens": N`` key of the body (the byte-scan rule of the
    stream events); a key followed by megabytes more (e.g. ``prompt_logprobs``, written after
    ``usage``) is noted as it leaves the tail. Time O(body), memory O(``keep_bytes``).
    """

    __slots__ = ("_before_tail", "_keep_bytes", "_key", "_key_re", "_tail", "_tail_after_backslash")

    def __init__(self, keep_bytes: int = 65536, key: bytes = b"completion_tokens") -> None:
        if keep_bytes < 256:
            raise ValueError(f"keep_bytes must be at least 256, got {keep_bytes}")
        self._keep_bytes = keep_bytes
        # The usage key the API counts output tokens by (completion_tokens; output_tokens for the Responses
        # and Messages APIs), read with the same rule.
        self._key = b'"' + key + b'"'
        self._key_re = _usage_re(key)
        self._tail = bytearray()
        # The value of the last key that left the tail, if any.
        self._before_tail: int | None = None
        # The byte just before the tail was a backslash: a quote at the tail's start is escaped.
        self._tail_after_backslash = False

    def feed(self, chunk: bytes) -> None:
        tail = self._tail
        tail += chunk
        excess = len(tail) - self._keep_bytes
        if excess <= 0:
            return
        # Keys that start in the bytes about to leave, read with the rest of the tail after them.
        stop = excess + len(self._key) - 1
        i = tail.find(self._key, 0, stop)
        while i >= 0:
            value = self._value_at(i)
            if value is not None:
                self._before_tail = value
            i = tail.find(self._key, i + 1, stop)
        self._tail_after_backslash = tail[excess - 1] == _BACKSLASH
        if excess >= self._keep_bytes:
            self._tail = tail[excess:]  # a fresh buffer: do not keep a large chunk's allocation
        else:
            del tail[:excess]

    def completion_tokens(self) -> int | None:
        tail = self._tail
        end = len(tail)
        while (i := tail.rfind(self._key, 0, end)) >= 0:
            value = self._value_at(i)
            if value is not None:
                return value
            end = i + len(self._key) - 1  # keys that start before this one
        return self._before_tail

    def _value_at(self, i: int) -> int | None:
        if i == 0 and self._tail_after_backslash:
            return None
        m = self._key_re.match(self._tail, i)
        return int(m.group(1)) if m else None


@functools.cache
def _usage_re(key: bytes) -> re.Pattern[bytes]:
    return re.compile(rb'"(?<!\\")' + re.escape(key) + rb'"\s*:\s*(\d{1,18})(?!\d)')
