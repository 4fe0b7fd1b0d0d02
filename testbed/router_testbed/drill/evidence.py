"""What the drill recorded, and how it reads it: pure data and pure readers, no I/O.

One :class:`Exchange` is one HTTP request the drill sent and everything it learnt about it: the exact bytes
the client got and when each piece arrived, how the response ended (cleanly, by a transport reset, or by
the client leaving), the gateway's journal record, the replicas' own log records (simulator only) and the
hooks run against a replica meanwhile. The verdicts (`verdicts.py`) are functions of this data only.

The SSE reading here is an independent oracle on purpose: it does not use the product's scanner
(`router_sidecar.core.sse`), because the drill judges that scanner's accounting (first delta, delivered
count) and must not share its mistakes. It reads bytes the way an OpenAI client does: an event ends at a
blank line, its ``data:`` lines joined, its ``event:`` line naming it, a comment or keep-alive carries no
data. What a content event, a clean end and an error event are, and what text an event carries, depends on
the API (`apis.py`: chat and completions as `router_testbed.oracle` reads them, as the test suite's
invariants do; the Responses and Messages APIs by their own named events).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal

from router_testbed.drill import apis
from router_testbed.oracle import DONE, TERMINAL_PHASES

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
    api: str = apis.DEFAULT  # the API the request speaks (how its stream and errors are read)

    @property
    def spec(self) -> apis.Api:
        return apis.of(self.api)

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

    def json_body(self) -> Any:
        """The body, parsed, when it is a JSON answer (else None)."""
        if "application/json" not in self.content_type:
            return None
        try:
            return json.loads(self.body)
        except ValueError:
            return None

    def json_error(self) -> dict[str, Any] | None:
        """The `error` object of a JSON error body (OpenAI's and Anthropic's shapes have one), or None."""
        body = self.json_body()
        error = body.get("error") if isinstance(body, dict) else None
        return error if isinstance(error, dict) else None

    def to_json(self, body_limit: int = 64 * 1024) -> dict[str, Any]:
        view = read_stream(self) if self.is_event_stream else None
        return {
            "label": self.label,
            "method": self.method,
            "path": self.path,
            "api": self.api,
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
                {
                    "t": e.t,
                    "kind": e.kind,
                    **({"event": e.name} if e.name else {}),
                    "data": e.data if e.kind != "unparseable" else None,
                }
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
    name: str | None = None  # its `event:` line (the Responses and Messages APIs name every event)


@dataclass
class StreamView:
    """An SSE body as a client of its API reads it."""

    events: list[SseEvent]
    torn_tail: bytes  # bytes after the last complete event (a stream cut inside an event)
    api: str = apis.DEFAULT

    @property
    def spec(self) -> apis.Api:
        return apis.of(self.api)

    @property
    def payloads(self) -> list[Any]:
        return [e.data for e in self.events if e.kind not in ("comment", "unparseable")]

    @property
    def objects(self) -> list[dict[str, Any]]:
        """The JSON objects of the events, in order."""
        return [p for p in self.payloads if isinstance(p, dict)]

    @property
    def content(self) -> list[dict[str, Any]]:
        return [e.data for e in self.events if e.kind == "content"]

    @property
    def frames(self) -> list[dict[str, Any]]:
        """The error object of every error event: chat's `{"error": ...}`, a Responses `response.failed`'s
        `response.error` (or an `error` event), an Anthropic `event: error`'s `error`."""
        return [self.spec.frame_error(e.data) for e in self.events if e.kind == "frame"]

    @property
    def frame_events(self) -> list[SseEvent]:
        return [e for e in self.events if e.kind == "frame"]

    @property
    def unparseable(self) -> list[bytes]:
        return [e.raw for e in self.events if e.kind == "unparseable"]

    @property
    def done_count(self) -> int:
        """Clean ends: `[DONE]`; `response.completed`/`response.incomplete`; `message_stop`."""
        return sum(1 for e in self.events if e.kind == "done")

    @property
    def usage_tokens(self) -> int | None:
        """The output-token count of the last event carrying one (chat's usage.completion_tokens, the
        Responses terminal event's and Messages' message_delta's output_tokens)."""
        found = None
        for p in self.objects:
            count = self.spec.output_tokens(p)
            if count is not None:
                found = count
        return found

    @property
    def delivered_tokens(self) -> int:
        """What the client got, counted as invariant 3 says: the usage count when the stream carried one."""
        usage = self.usage_tokens
        return usage if usage is not None else len(self.content)

    @property
    def content_ids(self) -> set[str]:
        """Completion ids of the content events (chat): one id = one attempt's generation. The named-event
        APIs carry the id in their preamble only: its ids (`ids`)."""
        if self.spec.named_events:
            return self.ids
        return {str(p.get("id")) for p in self.content}

    @property
    def ids(self) -> set[str]:
        return {i for p in self.objects for i in self.spec.ids(p)}

    @property
    def text(self) -> str:
        return "".join(self.spec.text(p) for p in self.content)

    @property
    def models(self) -> set[str]:
        """Every model the events name, wherever their API puts it (a chat chunk's `model`, the Responses
        `response.model`, the Messages `message.model`): the model that answered."""
        found: set[str] = set()
        pending: list[Any] = list(self.objects)
        while pending:
            value = pending.pop()
            if isinstance(value, dict):
                model = value.get("model")
                if isinstance(model, str):
                    found.add(model)
                pending += value.values()
            elif isinstance(value, list):
                pending += value
        return found

    @property
    def finish_reasons(self) -> list[str]:
        return [reason for p in self.objects for reason in self.spec.finish(p)]

    @property
    def events_after_done(self) -> list[SseEvent]:
        """Events after the end: chat's `[DONE]`; a named-event API's clean end or failure event."""
        ends = ("done",) if not self.spec.named_events else ("done", "frame")
        seen = False
        after = []
        for e in self.events:
            if seen and e.kind != "comment":
                after.append(e)
            seen = seen or e.kind in ends
        return after

    @property
    def last_two(self) -> list[Any]:
        return self.payloads[-2:]

    @property
    def ends_with_frame_then_done(self) -> bool:
        """The stream's honest interrupted end: chat's one frame then `[DONE]`; a named-event API's failure
        event, last (no clean end after it: it replaces it)."""
        if self.spec.named_events:
            kinds = [e.kind for e in self.events if e.kind not in ("comment", "unparseable")]
            return bool(kinds) and kinds[-1] == "frame" and "done" not in kinds
        tail = self.last_two
        return len(tail) == 2 and isinstance(tail[0], dict) and "error" in tail[0] and tail[1] == DONE

    # --- the named-event APIs' own rules ---------------------------------------------------------------

    def named(self, name: str) -> list[SseEvent]:
        return [e for e in self.events if apis.event_type(e.name, e.data) == name]

    @property
    def preamble_count(self) -> int | None:
        """How many times the answer was opened (`response.created`, `message_start`); None for chat."""
        preamble = self.spec.preamble
        return None if preamble is None else len(self.named(preamble))

    @property
    def sequence_numbers(self) -> list[Any]:
        """Every event's `sequence_number`, in order (Responses: 0, 1, 2, … on one stream)."""
        return [p.get("sequence_number") for p in self.objects]

    @property
    def stray_done(self) -> int:
        """`data: [DONE]` events on an API that has none (Responses, Messages)."""
        return sum(1 for e in self.events if e.data == DONE and e.kind != "done")

    @property
    def mislabelled(self) -> list[str]:
        """Named events whose `event:` line is not their data's `type` (`name≠type`)."""
        return [
            f"{e.name}≠{e.data.get('type')}"
            for e in self.events
            if e.name and isinstance(e.data, dict) and e.data.get("type") not in (None, e.name)
        ]

    def first_content_at(self) -> float | None:
        return next((e.t for e in self.events if e.kind == "content"), None)


def _classify(data: Any, api: apis.Api = apis.API[apis.DEFAULT], name: str | None = None) -> EventKind:
    if data == DONE:
        return "done"
    return api.classify(name, data)  # type: ignore[return-value]


def read_events(body: bytes, time_of: Any = None, api: str = apis.DEFAULT) -> StreamView:
    """Split `body` into events (CRLF or LF line ends) as a client of `api` reads them; `time_of(end_offset)`
    stamps each one."""
    spec = apis.of(api)
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
        lines = raw.split(b"\n")
        data_lines = [ln[5:].lstrip(b" ") for ln in lines if ln.startswith(b"data:")]
        names = [ln[6:].strip() for ln in lines if ln.startswith(b"event:")]
        name = names[-1].decode("utf-8", "replace") if names else None
        t = time_of(pos) if time_of is not None else None
        if not data_lines:
            events.append(SseEvent(t, raw, None, "comment", name))
            continue
        payload = b"\n".join(data_lines)
        if payload.strip() == b"[DONE]":
            # Chat's end marker; the named-event APIs have none, so there it ends nothing (`stray_done`).
            events.append(SseEvent(t, raw, DONE, "other" if spec.named_events else "done", name))
            continue
        try:
            data = json.loads(payload)
        except ValueError:
            events.append(SseEvent(t, raw, None, "unparseable", name))
            continue
        events.append(SseEvent(t, raw, data, _classify(data, spec, name), name))
    return StreamView(events, normalized[pos:] if normalized[pos:].strip() else b"", api)


def read_stream(x: Exchange) -> StreamView:
    return read_events(x.body, x.arrival_of, x.api)


def journal_settled(record: dict[str, Any]) -> bool:
    """A record whose phase is terminal and whose trace holds its closing event (or was left out: a clean
    completion keeps its summary only unless `journal.trace_clean_completions` samples it)."""
    events = [e for e in record.get("events") or [] if isinstance(e, dict)]
    if record.get("phase") not in TERMINAL_PHASES:
        return False
    if not events and record.get("trace"):
        return True
    return bool({e.get("event") for e in events} & CLOSING_EVENTS)
