"""What the drill recorded, and how it reads it: pure data and pure readers, no I/O.

One :class:`Exchange` is one HTTP request the drill sent and everything it learnt about it: the exact bytes
the client got and when each piece arrived, how the response ended (cleanly, by a transport reset, or by
the client leaving), the gateway's journal record, the replicas' own log records (simulator only) and the
hooks run against a replica meanwhile. The verdicts (`verdicts.py`) are functions of this data only.

The SSE reading here is an independent oracle on purpose: it does not use the product's scanner
(`router_sidecar.core.sse`), because the drill judges that scanner's accounting (first delta, delivered
count) and must not share its mistakes. It reads bytes the way an OpenAI client does: an event ends at a
blank line, its ``data:`` lines joined, a comment or keep-alive carries no data. What a content event is,
and its text, it reads with `router_testbed.oracle`, as the test suite's invariants do.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal

from router_testbed.oracle import DONE, TERMINAL_PHASES, is_content, piece_text

# Trace events that close a request's story: a look-up may show a terminal phase a moment before the trace
# holds its closing event, so the drill waits for both.
CLOSING_EVENTS = frozenset(
    {
        "stream_completed",
        "stream_terminated",
        "stream_reset",
        "client_disconnected",
        "request_failed",
        "request_rejected",
    }
)

EventKind = Literal["content", "role", "frame", "done", "comment", "other", "unparseable"]


@dataclass
class HookRun:
    """One `--kill-cmd`/`--freeze-cmd`/`--thaw-cmd` run (or an in-process hook) against one replica."""

    action: str
    replica: str
    command: str
    started_at: float
    ended_at: float
    returncode: int | None  # None: it did not finish within the hook timeout (it was killed)
    output: str = ""

    @property
    def ok(self) -> bool:
        return self.returncode == 0

    def describe(self) -> str:
        status = "timed out" if self.returncode is None else f"exit {self.returncode}"
        tail = f": {self.output.strip()[-200:]}" if self.output.strip() and not self.ok else ""
        return f"{self.action} {self.replica} ({status}, {self.ended_at - self.started_at:.2f}s){tail}"


@dataclass
class Exchange:
    """One request the drill sent and what came of it (times are the drill host's wall clock)."""

    label: str  # what this request is for, within its scenario ("the request", "the duplicate", ...)
    method: str
    path: str
    request_id: str | None  # the Idempotency-Key sent: the gateway's request id for it
    fault: str | None = None  # the x-sim-fault header sent, if any
    stream: bool = False
    max_tokens: int | None = None
    request_bytes: int = 0
    sent_at: float = 0.0
    headers_at: float | None = None
    ended_at: float | None = None
    status: int = 0  # 0: no HTTP response at all
    headers: dict[str, str] = field(default_factory=dict)  # lower-case names
    body: bytes = b""
    # (arrival time, body length after this chunk): the time of each byte, so each event's time is known.
    arrivals: list[tuple[float, int]] = field(default_factory=list)
    transport_error: str | None = None  # e.g. "RemoteProtocolError: ..." (a reset), "ReadTimeout: ..."
    disconnected_at: float | None = None  # the client left on purpose
    journal_status: int = 0  # HTTP status of the last journal look-up (0: none answered)
    journal: dict[str, Any] | None = None
    replica_records: list[dict[str, Any]] = field(default_factory=list)  # simulator log records
    hooks: list[HookRun] = field(default_factory=list)
    # The one generation a simulated replica produces for this request, one piece per content event (None:
    # unknown): the delivered text must be a prefix of it.
    expected_pieces: tuple[str, ...] | None = None

    @property
    def response_request_id(self) -> str:
        return self.headers.get("x-request-id", "")

    @property
    def content_type(self) -> str:
        return self.headers.get("content-type", "").lower()

    @property
    def is_event_stream(self) -> bool:
        return self.status == 200 and "text/event-stream" in self.content_type

    @property
    def has_record(self) -> bool:
        return self.journal_status == 200 and isinstance(self.journal, dict)

    @property
    def attempts(self) -> list[dict[str, Any]]:
        if not self.has_record:
            return []
        return [a for a in (self.journal or {}).get("attempts") or [] if isinstance(a, dict)]

    @property
    def trace(self) -> list[dict[str, Any]]:
        if not self.has_record:
            return []
        return [e for e in (self.journal or {}).get("events") or [] if isinstance(e, dict)]

    def arrival_of(self, end_offset: int) -> float | None:
        """When the byte just before `end_offset` arrived."""
        for t, length in self.arrivals:
            if length >= end_offset:
                return t
        return None

    def json_error(self) -> dict[str, Any] | None:
        """The `error` object of a JSON error body, or None."""
        if "application/json" not in self.content_type:
            return None
        try:
            body = json.loads(self.body)
        except ValueError:
            return None
        error = body.get("error") if isinstance(body, dict) else None
        return error if isinstance(error, dict) else None

    def to_json(self, body_limit: int = 64 * 1024) -> dict[str, Any]:
        view = read_stream(self) if self.is_event_stream else None
        return {
            "label": self.label,
            "method": self.method,
            "path": self.path,
            "request_id": self.request_id,
            "fault": self.fault,
            "stream": self.stream,
            "max_tokens": self.max_tokens,
            "request_bytes": self.request_bytes,
            "sent_at": self.sent_at,
            "headers_at": self.headers_at,
            "ended_at": self.ended_at,
            "status": self.status,
            "headers": self.headers,
            "body": self.body[:body_limit].decode("utf-8", "replace"),
            "body_bytes": len(self.body),
            "events": [
                {"t": e.t, "kind": e.kind, "data": e.data if e.kind != "unparseable" else None}
                for e in (view.events if view else [])
            ],
            "transport_error": self.transport_error,
            "disconnected_at": self.disconnected_at,
            "journal_status": self.journal_status,
            "journal": self.journal,
            "replica_records": self.replica_records,
            "hooks": [vars(h) for h in self.hooks],
        }


# --- reading an SSE body ------------------------------------------------------------------------------


@dataclass(frozen=True)
class SseEvent:
    t: float | None  # when its last byte arrived
    raw: bytes
    data: Any  # parsed JSON, "[DONE]", or None (a comment / keep-alive, or unparseable)
    kind: EventKind


@dataclass
class StreamView:
    """An SSE body as a client reads it."""

    events: list[SseEvent]
    torn_tail: bytes  # bytes after the last complete event (a stream cut inside an event)

    @property
    def payloads(self) -> list[Any]:
        return [e.data for e in self.events if e.kind not in ("comment", "unparseable")]

    @property
    def content(self) -> list[dict[str, Any]]:
        return [e.data for e in self.events if e.kind == "content"]

    @property
    def frames(self) -> list[dict[str, Any]]:
        """The inside of every `{"error": ...}` event."""
        return [e.data["error"] for e in self.events if e.kind == "frame"]

    @property
    def unparseable(self) -> list[bytes]:
        return [e.raw for e in self.events if e.kind == "unparseable"]

    @property
    def done_count(self) -> int:
        return sum(1 for e in self.events if e.kind == "done")

    @property
    def usage_tokens(self) -> int | None:
        """usage.completion_tokens of the last event carrying it."""
        found = None
        for p in self.payloads:
            usage = p.get("usage") if isinstance(p, dict) else None
            if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
                found = usage["completion_tokens"]
        return found

    @property
    def delivered_tokens(self) -> int:
        """What the client got, counted as invariant 3 says: the usage count when the stream carried one."""
        usage = self.usage_tokens
        return usage if usage is not None else len(self.content)

    @property
    def content_ids(self) -> set[str]:
        """Completion ids of the content events: one id = one attempt's generation."""
        return {str(p.get("id")) for p in self.content}

    @property
    def ids(self) -> set[str]:
        return {p["id"] for p in self.payloads if isinstance(p, dict) and isinstance(p.get("id"), str)}

    @property
    def text(self) -> str:
        return "".join(piece_text(p) for p in self.content)

    @property
    def finish_reasons(self) -> list[str]:
        return [
            str(c["finish_reason"])
            for p in self.payloads
            if isinstance(p, dict) and isinstance(p.get("choices"), list)
            for c in p["choices"]
            if isinstance(c, dict) and c.get("finish_reason")
        ]

    @property
    def events_after_done(self) -> list[SseEvent]:
        seen = False
        after = []
        for e in self.events:
            if seen and e.kind != "comment":
                after.append(e)
            seen = seen or e.kind == "done"
        return after

    @property
    def last_two(self) -> list[Any]:
        return self.payloads[-2:]

    @property
    def ends_with_frame_then_done(self) -> bool:
        tail = self.last_two
        return len(tail) == 2 and isinstance(tail[0], dict) and "error" in tail[0] and tail[1] == DONE

    def first_content_at(self) -> float | None:
        return next((e.t for e in self.events if e.kind == "content"), None)


def _classify(data: Any) -> EventKind:
    if data == DONE:
        return "done"
    if isinstance(data, dict) and isinstance(data.get("error"), dict):
        return "frame"
    if is_content(data):
        return "content"
    if isinstance(data, dict) and isinstance(data.get("choices"), list):
        return "role"  # role-only, empty delta, finish-only or usage-only: no visible content
    return "other"


def read_events(body: bytes, time_of: Any = None) -> StreamView:
    """Split `body` into events (CRLF or LF line ends); `time_of(end_offset)` stamps each one."""
    events: list[SseEvent] = []
    pos = 0
    normalized = body.replace(b"\r\n", b"\n")
    # Offsets are computed on the normalized bytes; with CRLF they drift, so times are then approximate.
    while True:
        end = normalized.find(b"\n\n", pos)
        if end < 0:
            break
        raw = normalized[pos:end]
        pos = end + 2
        if not raw.strip(b"\n"):
            continue
        lines = [ln[5:].lstrip(b" ") for ln in raw.split(b"\n") if ln.startswith(b"data:")]
        t = time_of(pos) if time_of is not None else None
        if not lines:
            events.append(SseEvent(t, raw, None, "comment"))
            continue
        payload = b"\n".join(lines)
        if payload.strip() == b"[DONE]":
            events.append(SseEvent(t, raw, DONE, "done"))
            continue
        try:
            data = json.loads(payload)
        except ValueError:
            events.append(SseEvent(t, raw, None, "unparseable"))
            continue
        events.append(SseEvent(t, raw, data, _classify(data)))
    return StreamView(events, normalized[pos:] if normalized[pos:].strip() else b"")


def read_stream(x: Exchange) -> StreamView:
    return read_events(x.body, x.arrival_of)


def journal_settled(record: dict[str, Any]) -> bool:
    """A record whose phase is terminal and whose trace holds its closing event (or was left out: a clean
    completion keeps its summary only unless `journal.trace_clean_completions` samples it)."""
    events = [e for e in record.get("events") or [] if isinstance(e, dict)]
    if record.get("phase") not in TERMINAL_PHASES:
        return False
    if not events and record.get("trace"):
        return True
    return bool({e.get("event") for e in events} & CLOSING_EVENTS)
