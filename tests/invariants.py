"""The invariants of docs/design.md#the-invariants, checked for one logical request from its evidence.

The evidence of one request is what the client sent and got (status, headers, raw bytes, transport error,
whether it left on purpose and after how many content events), the journal record (``GET
/v1/requests/{id}`` with the client's own credential) and every replica's log records for the request id.
:func:`check_request` returns the violations — each names the invariant and the evidence — instead of
asserting, so that a fuzz run or a soak script can collect them all and report them by invariant.
:func:`check_gateway` covers invariant 10 for a batch of requests.

Covered: 1, 2, 3, 4, 5, 8, 9 per request, 10 per batch. Invariants 6 (tool calls execute once) and 7 (no
retry onto an incompatible fingerprint) need a tool service or an incompatible replica; their own tiers
check them.

This module is meant to be an *independent oracle* of the gateway's own accounting
(``router_sidecar.core.sse`` and the request machine): it reads the client's bytes with the test harness's
SSE splitter and ``json``, and never imports the product's scanner or machines. What a content event is,
its text and the contract's literals come from ``router_testbed.oracle``, which the drill reads with too
(it imports nothing of the product either). The only product-side import is the simulator's deterministic
generator (``testbed.sim.generation``), used to know the exact text a simulated replica produces for a
request, so that a repeated fragment, a second answer or content of another request shows up as text that
is not a prefix of the one generation.

Every journal record read, and every terminal frame, is also checked against the published JSON Schema
(``docs/schema/``): the contract a client in another language relies on.
"""

from __future__ import annotations

import functools
import itertools
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from router_testbed.oracle import (
    DONE,
    INTERRUPTED,
    RAW_REPLICA_ERROR_MARKERS,
    TERMINAL_PHASES,
    attempt_times,
    is_content,
    piece_text,
)
from tests import api_streams
from tests.api_streams import ApiStream
from tests.harness import split_events

CLIENT_DISCONNECTED = "client_disconnected"
# The journal's detail of an attempt whose connection died before its request was sent (not counted).
NOT_SENT = "connection_lost_before_request"
# Replica outcomes (simulator log) of an abrupt death: the only ones that may reach a client as a reset.
ABRUPT_REPLICA_OUTCOMES = frozenset({"fault:reset", "fault:exit"})
# Per API, where it differs: vLLM's Responses route has no error event, its generation error cuts the body
# without its last chunk (docs/simulator.md), which reaches the client as a reset too.
# What the journal's `input.route` calls each route.
JOURNAL_ROUTES = {
    "chat": "chat.completions",
    "completions": "completions",
    "responses": "responses",
    "messages": "messages",
}
ABRUPT_BY_ROUTE = {"responses": ABRUPT_REPLICA_OUTCOMES | {"fault:error"}}

Route = Literal["chat", "completions", "responses", "messages"]
OutcomeKind = Literal["complete", "terminal_frame", "reset", "json_error", "disconnect", "other"]


@dataclass(frozen=True)
class Violation:
    """One broken invariant of one request (`invariant` is its number in docs/design.md, as text)."""

    invariant: str
    check: str  # a short stable name of what is broken, to group violations across requests
    request_id: str
    detail: str

    def __str__(self) -> str:
        return f"invariant {self.invariant} ({self.check}) [{self.request_id}]: {self.detail}"


@dataclass(frozen=True)
class SentRequest:
    """What the client asked for, once (its `Idempotency-Key` is `request_id`)."""

    request_id: str
    route: Route
    body: dict[str, Any]
    fault: str | None = None  # the `x-sim-fault` header, if any

    @property
    def stream(self) -> bool:
        return bool(self.body.get("stream"))

    @property
    def max_tokens(self) -> int | None:
        value = self.body.get("max_output_tokens" if self.route == "responses" else "max_tokens")
        return value if isinstance(value, int) else None

    @property
    def path(self) -> str:
        return api_streams.PATHS[self.route]

    @property
    def named(self) -> bool:
        """An API of named events (Responses, Messages), read by `tests.api_streams`."""
        return self.route in api_streams.NAMED_APIS


@dataclass
class ClientOutcome:
    """What the client got. `body` is every byte it received, as received."""

    status: int  # 0: no HTTP response at all
    headers: dict[str, str]  # lower-case names
    body: bytes
    transport_error: str | None = None  # e.g. "RemoteProtocolError: ..." (a reset), "ReadTimeout: ..."
    disconnected: bool = False  # the client closed the connection on purpose before the response ended
    content_events_read: int | None = None  # when disconnected: content events it had read when it left
    disconnected_at: float | None = None  # wall clock of the disconnect
    started_at: float = 0.0
    ended_at: float = 0.0


@dataclass
class Evidence:
    sent: SentRequest
    client: ClientOutcome
    journal_status: int  # HTTP status of the last look-up (0: the gateway never answered one)
    journal: dict[str, Any] | None  # the last record read (None: never read)
    replica_records: list[dict[str, Any]]  # every replica's start and end records for this request id
    # Replica processes that were alive when the evidence was gathered: a start record without an end
    # record from any other pid is an attempt whose replica died abruptly (SIGKILL, `exit` fault).
    live_replica_pids: frozenset[int] = frozenset()
    # The one generation a replica produces for this request, one piece per content event (None: unknown,
    # e.g. a real engine): the delivered text must be a prefix of it.
    expected_pieces: tuple[str, ...] | None = None
    max_attempts: int = 2  # the policy's before_first_delta.max_attempts
    max_event_bytes: int = 1 << 20  # the policy's limits.max_event_bytes
    # Other generations a replica may write for this request because of its fault (`oversize`'s padded
    # text, on the attempts the clause applies to): a prefix of one of them is a prefix of one generation.
    variant_pieces: tuple[tuple[str, ...], ...] = ()

    @property
    def request_id(self) -> str:
        return self.sent.request_id


# --- reading the client's bytes ---------------------------------------------------------------------


@dataclass
class Delivered:
    """The client's bytes, read as an OpenAI client would."""

    kind: OutcomeKind
    payloads: list[Any] = field(default_factory=list)  # parsed events: JSON objects or "[DONE]"
    unparseable: list[bytes] = field(default_factory=list)  # complete events that are not JSON
    torn_tail: bool = False  # the bytes end inside an event
    content: list[dict[str, Any]] = field(default_factory=list)  # content events (docs/design.md#vocabulary)
    text: str = ""  # the delivered text, concatenated
    frames: list[dict[str, Any]] = field(default_factory=list)  # `{"error": ...}` events (their inside)
    usage_tokens: int | None = None  # usage.completion_tokens of the last event carrying usage
    unary: dict[str, Any] | None = None  # a non-streamed 200 answer
    error: dict[str, Any] | None = None  # a JSON error body's `error` object
    note: str = ""  # for kind "other": what it was
    route: Route = "chat"
    stream: ApiStream | None = None  # Responses, Messages: the named events as their clients read them

    @property
    def done_count(self) -> int:
        return sum(1 for p in self.payloads if p == DONE)

    @property
    def delivered_tokens(self) -> int:
        """What the client got, counted like invariant 3 says: usage when the stream carried it."""
        if self.unary is not None:
            return api_streams.unary_output_tokens(self.route, self.unary) or 0
        return self.usage_tokens if self.usage_tokens is not None else len(self.content)

    def ids(self) -> set[str]:
        return {p["id"] for p in self.payloads if isinstance(p, dict) and isinstance(p.get("id"), str)}


def parse_sse(raw: bytes) -> tuple[list[Any], list[bytes], bool]:
    """(payloads, unparseable complete events, torn tail). Comments/keep-alives are skipped; an event the
    bytes end inside (no blank line after it) is not an event an SSE client dispatches: it is left out."""
    normalized = raw.replace(b"\r\n", b"\n")
    events = split_events(raw)
    torn = bool(normalized.strip()) and not normalized.endswith(b"\n\n")
    if torn and events:
        events = events[:-1]
    payloads: list[Any] = []
    unparseable: list[bytes] = []
    for event in events:
        lines = [
            ln[5:].lstrip() for ln in event.replace(b"\r\n", b"\n").split(b"\n") if ln.startswith(b"data:")
        ]
        if not lines:
            continue
        data = b"\n".join(lines)
        if data == b"[DONE]":
            payloads.append(DONE)
            continue
        try:
            payloads.append(json.loads(data))
        except ValueError:
            unparseable.append(event)
    return payloads, unparseable, torn


def count_content_events(raw: bytes, route: Route = "chat") -> int:
    """Content events among the complete events in `raw` (for a client deciding when to leave)."""
    if route in api_streams.NAMED_APIS:
        return len(ApiStream.read(route, raw).content)
    payloads, _, _ = parse_sse(raw)
    return sum(1 for p in payloads if is_content(p))


def stream_ended(raw: bytes, route: Route = "chat") -> bool:
    """The complete events in `raw` include the stream's end (`[DONE]`; a Responses/Messages clean end or
    failure): a client leaving after it leaves nothing behind."""
    if route in api_streams.NAMED_APIS:
        stream = ApiStream.read(route, raw)
        return bool(stream.clean_ends or stream.terminal_events())
    payloads, _, _ = parse_sse(raw)
    return bool(payloads) and payloads[-1] == DONE


def _unary_completion_tokens(answer: dict[str, Any]) -> int | None:
    usage = answer.get("usage")
    tokens = usage.get("completion_tokens") if isinstance(usage, dict) else None
    return tokens if isinstance(tokens, int) else None


def _content_type(client: ClientOutcome) -> str:
    return client.headers.get("content-type", "").lower()


def _read_named(sent: SentRequest, client: ClientOutcome) -> Delivered:
    """A Responses or Messages stream: its events, content, text, terminal events and usage."""
    stream = ApiStream.read(sent.route, client.body)
    d = Delivered("other", route=sent.route, stream=stream, torn_tail=stream.torn)
    d.unparseable = [e.raw for e in stream.events if not e.json_ok]
    d.payloads = [e.data for e in stream.events if e.json_ok]
    d.content = [e.data for e in stream.content]
    d.text = stream.text
    d.frames = [api_streams.terminal_error(sent.route, e) for e in stream.terminal_events()]
    d.usage_tokens = stream.usage_output_tokens()
    if client.disconnected:
        d.kind = "disconnect"
    elif client.transport_error is not None:
        d.kind = "reset"
    elif d.frames:
        d.kind = "terminal_frame"
    elif stream.clean_ends:
        d.kind = "complete"
    else:
        end = "response.completed" if sent.route == "responses" else "message_stop"
        d.note = f"SSE body that ended cleanly with neither {end} nor a terminal event"
    return d


def read_delivered(sent: SentRequest, client: ClientOutcome) -> Delivered:
    ctype = _content_type(client)
    if sent.named:
        if client.status == 200 and "text/event-stream" in ctype:
            return _read_named(sent, client)
        if client.status == 200 and "application/json" in ctype and not sent.stream:
            try:
                answer = json.loads(client.body)
            except ValueError:
                return Delivered("other", note="200 with a body that is not JSON", route=sent.route)
            if not api_streams.unary_is_answer(sent.route, answer):
                return Delivered(
                    "other", note=f"200 JSON that is not a {sent.route} answer", route=sent.route
                )
            d = Delivered("complete", unary=answer, route=sent.route)
            d.text = api_streams.unary_text(sent.route, answer)
            if client.transport_error is not None:
                d.kind, d.note = "other", f"200 JSON answer cut by {client.transport_error}"
            return d
    if client.status == 200 and "text/event-stream" in ctype:
        payloads, unparseable, torn = parse_sse(client.body)
        d = Delivered("other", payloads, unparseable, torn)
        d.content = [p for p in payloads if is_content(p)]
        d.text = "".join(piece_text(p) for p in d.content)
        d.frames = [p["error"] for p in payloads if isinstance(p, dict) and isinstance(p.get("error"), dict)]
        for p in payloads:
            if isinstance(p, dict) and isinstance(p.get("usage"), dict):
                tokens = p["usage"].get("completion_tokens")
                if isinstance(tokens, int):
                    d.usage_tokens = tokens
        if client.disconnected:
            d.kind = "disconnect"
        elif client.transport_error is not None:
            d.kind = "reset"
        elif d.frames:
            d.kind = "terminal_frame"
        elif d.done_count:
            d.kind = "complete"
        else:
            d.note = "SSE body that ended cleanly with neither [DONE] nor a terminal frame"
        return d
    if client.status == 200 and "application/json" in ctype and not sent.stream:
        try:
            answer = json.loads(client.body)
        except ValueError:
            return Delivered("other", note="200 with a body that is not JSON")
        if not isinstance(answer, dict) or not isinstance(answer.get("choices"), list):
            return Delivered("other", note="200 JSON without choices")
        d = Delivered("complete", unary=answer)
        choice = answer["choices"][0] if answer["choices"] else {}
        message = choice.get("message") if isinstance(choice.get("message"), dict) else {}
        text = message.get("content") if sent.route == "chat" else choice.get("text")
        d.text = text if isinstance(text, str) else ""
        if client.transport_error is not None:
            d.kind, d.note = "other", f"200 JSON answer cut by {client.transport_error}"
        return d
    if client.status >= 400 and "application/json" in ctype:
        try:
            body = json.loads(client.body)
        except ValueError:
            return Delivered("other", note=f"HTTP {client.status} application/json body that is not JSON")
        error = body.get("error") if isinstance(body, dict) else None
        if not isinstance(error, dict):
            return Delivered(
                "other", note=f"HTTP {client.status} JSON body without an error object", route=sent.route
            )
        return Delivered("json_error", error=error, route=sent.route)
    if client.status == 0:
        return Delivered("other", note=f"no HTTP response at all ({client.transport_error})")
    return Delivered("other", note=f"HTTP {client.status} with content-type {ctype or '(none)'!r}")


def outcome_kind(ev: Evidence) -> str:
    """A short label of what the client got, for summaries: complete, terminal_frame, reset, disconnect,
    json_error:<code>, other:<what>."""
    d = read_delivered(ev.sent, ev.client)
    if d.kind == "json_error" and d.error is not None:
        return f"json_error:{d.error.get('code')}"
    if d.kind == "other":
        return f"other:{d.note[:60]}"
    return d.kind


# --- the checks ---------------------------------------------------------------------------------------


def _short(data: bytes | str, limit: int = 240) -> str:
    text = data.decode("utf-8", "replace") if isinstance(data, bytes) else data
    return repr(text[:limit] + ("…" if len(text) > limit else ""))


SCHEMAS = Path(__file__).resolve().parents[1] / "docs/schema"


@functools.cache
def _schema_validator(name: str) -> Any:
    import jsonschema  # only the checks need it

    return jsonschema.Draft202012Validator(json.loads((SCHEMAS / f"{name}.schema.json").read_text()))


def schema_errors(name: str, document: Any) -> list[str]:
    """What in `document` breaks the published schema `name` (empty: it conforms)."""
    errors = _schema_validator(name).iter_errors(document)
    return [f"{'/'.join(map(str, e.absolute_path)) or '(top)'}: {e.message}" for e in errors][:5]


class _Check:
    def __init__(self, ev: Evidence) -> None:
        self.ev = ev
        self.sent = ev.sent
        self.client = ev.client
        self.d = read_delivered(ev.sent, ev.client)
        # A look-up that did not answer 200 (404, 503 journal_unavailable) carries an error body, no record.
        self.has_journal = ev.journal is not None and ev.journal_status == 200
        self.journal: dict[str, Any] = (ev.journal or {}) if self.has_journal else {}
        self.attempts: list[dict[str, Any]] = list(self.journal.get("attempts") or [])
        self.events: list[dict[str, Any]] = list(self.journal.get("events") or [])
        # A record that never reached a terminal phase is one violation (9); comparing its phase, outcome
        # and count with the client's bytes would only repeat it.
        self.final = self.has_journal and self.journal.get("phase") in TERMINAL_PHASES
        self.violations: list[Violation] = []

    def flag(self, invariant: str, check: str, detail: str) -> None:
        self.violations.append(Violation(invariant, check, self.sent.request_id, detail))

    # -- replica logs

    def replica_ends(self) -> list[dict[str, Any]]:
        return [r for r in self.ev.replica_records if r.get("event") == "end"]

    def replica_starts(self) -> list[dict[str, Any]]:
        return [r for r in self.ev.replica_records if r.get("event") == "start"]

    def died_abruptly(self, start: dict[str, Any]) -> bool:
        """A start record without an end record, from a replica process that is gone."""
        ended = any(
            e.get("attempt_id") == start.get("attempt_id") and e.get("t_start") == start.get("t_start")
            for e in self.replica_ends()
        )
        return not ended and start.get("pid") not in self.ev.live_replica_pids

    def replica_attempt(self, attempt_id: str | None) -> tuple[dict[str, Any] | None, bool]:
        """(end record, died abruptly) of the replica side of one attempt."""
        if attempt_id is None:
            return None, False
        for end in self.replica_ends():
            if end.get("attempt_id") == attempt_id:
                return end, False
        starts = [s for s in self.replica_starts() if s.get("attempt_id") == attempt_id]
        return None, any(self.died_abruptly(s) for s in starts)

    def serving_attempt_id(self) -> str | None:
        """The attempt whose bytes reached the client: the journal's last attempt, or (no journal) the last
        one a replica logged."""
        if self.attempts:
            return self.attempts[-1].get("attempt_id")
        starts = sorted(self.replica_starts(), key=lambda s: s.get("t_start", 0))
        return starts[-1].get("attempt_id") if starts else None

    # -- the invariants

    def run(self) -> list[Violation]:
        d = self.d
        if not self.has_journal:
            self.flag(
                "9",
                "no-journal",
                f"the journal never answered for this request id "
                f"(last look-up: HTTP {self.ev.journal_status})"
                f"; the client got {outcome_kind(self.ev)}",
            )
        if d.unary is None and d.kind != "json_error" and self.client.status == 200:
            if self.sent.named:
                self.check_named_shape()
            else:
                self.check_stream_shape()
        if d.kind == "complete":
            if self.sent.named:
                self.check_named_complete()
            else:
                self.check_complete()
        elif d.kind == "terminal_frame":
            if self.sent.named:
                self.check_named_terminal()
            else:
                self.check_terminal_frame()
        elif d.kind == "reset":
            self.check_reset()
        elif d.kind == "disconnect":
            self.check_disconnect()
        elif d.kind == "json_error":
            self.check_json_error()
        else:
            self.check_other()
        if self.has_journal:
            self.check_journal_consistency()
            self.check_leases()
            broken = schema_errors("journal-record", self.journal)
            if broken:
                self.flag("9", "journal-schema", f"the journal record breaks its published schema: {broken}")
        return self.violations

    def is_the_generation(self, text: str, n: int) -> bool:
        """`text` is the first `n` content events of the request's one generation (or of a variant a fault
        makes a replica write, e.g. `oversize`'s padded text); True when the generation is unknown."""
        expected = self.ev.expected_pieces
        if expected is None:
            return True
        return any(
            n <= len(pieces) and text == "".join(pieces[:n]) for pieces in (expected, *self.ev.variant_pieces)
        )

    def check_prefix_of_the_generation(self) -> None:
        d, expected = self.d, self.ev.expected_pieces
        n = len(d.content)
        if expected is not None and not self.is_the_generation(d.text, n):
            self.flag(
                "2",
                "not-a-prefix-of-the-generation",
                f"the delivered text ({n} content events) is not a prefix of the one generation "
                f"({len(expected)} events): a repeated fragment or another answer: got {_short(d.text)}, "
                f"expected {_short(''.join(expected[:n]))}",
            )

    def check_event_sizes(self) -> None:
        """Invariant 10: no SSE event over limits.max_event_bytes reaches a client (docs/bounds.md: the
        attempt fails before the first delta, the stream ends with the terminal event after it)."""
        events = split_events(self.client.body)
        biggest = max((len(e) for e in events), default=0)
        if biggest > self.ev.max_event_bytes:
            self.flag(
                "10",
                "oversized-event-delivered",
                f"an SSE event of {biggest} bytes reached the client, over limits.max_event_bytes "
                f"({self.ev.max_event_bytes})",
            )

    def check_stream_shape(self) -> None:
        """Invariants 1 and 2 on any SSE body: one attempt's events, one generation's text, whole events."""
        d = self.d
        self.check_event_sizes()
        content_ids = {p["id"] for p in d.content if isinstance(p.get("id"), str)}
        if len(content_ids) > 1:
            self.flag(
                "1",
                "content-of-several-attempts",
                f"content events of {len(content_ids)} completions reached the client: {content_ids}",
            )
        elif len(d.ids()) > 1:
            self.flag(
                "2",
                "events-of-several-completions",
                f"events of {len(d.ids())} completions in one stream ({d.ids()}): a dead attempt's events "
                "(e.g. its role event) were delivered before another attempt's content",
            )
        if d.unparseable:
            self.flag(
                "2",
                "unparseable-event",
                f"{len(d.unparseable)} event(s) that are not JSON, e.g. {_short(d.unparseable[0])}",
            )
        if d.torn_tail and self.client.transport_error is None and not self.client.disconnected:
            self.flag(
                "2",
                "torn-event",
                f"the stream ended cleanly inside an event: tail {_short(self.client.body[-200:])}",
            )
        self.check_prefix_of_the_generation()
        after_done = False
        for p in d.payloads:
            if after_done:
                self.flag("2", "event-after-done", f"an event after [DONE]: {_short(json.dumps(p))}")
                break
            after_done = p == DONE

    def check_complete(self) -> None:
        d, sent = self.d, self.sent
        if d.unary is not None:
            choice = d.unary["choices"][0] if d.unary["choices"] else {}
            finish = choice.get("finish_reason")
            tokens = _unary_completion_tokens(d.unary)
            if finish != "length" or (sent.max_tokens is not None and tokens != sent.max_tokens):
                self.flag(
                    "2",
                    "unary-not-complete",
                    f"a non-streamed 200 that is not one complete generation: finish_reason {finish!r}, "
                    f"completion_tokens {tokens} of max_tokens {sent.max_tokens}",
                )
            if tokens is not None and not self.is_the_generation(d.text, tokens):
                self.flag("2", "unary-text", f"non-streamed text {_short(d.text)} is not the generation's")
        else:
            if d.done_count != 1 or d.payloads[-1] != DONE:
                self.flag(
                    "2",
                    "done-count",
                    f"[DONE] {d.done_count} times, last event {_short(json.dumps(d.payloads[-1]))}",
                )
            if sent.max_tokens is not None and len(d.content) != sent.max_tokens:
                self.flag(
                    "2",
                    "done-without-whole-generation",
                    f"a stream ending in [DONE] without a terminal frame carries {len(d.content)} content "
                    f"events, not the whole generation of {sent.max_tokens}: an interruption labelled "
                    "complete",
                )
            finishes = [
                c.get("finish_reason")
                for p in d.payloads
                if isinstance(p, dict) and isinstance(p.get("choices"), list)
                for c in p["choices"]
                if isinstance(c, dict) and c.get("finish_reason")
            ]
            if finishes != ["length"]:
                self.flag(
                    "2",
                    "finish-reasons",
                    f"a complete stream must finish once with 'length'; finish reasons: {finishes}",
                )
            # A usage event the stream carries must count what was delivered (its absence, e.g. when the
            # replica closed after the finish, is not a §8 matter).
            if d.usage_tokens is not None and d.usage_tokens != len(d.content):
                self.flag(
                    "3",
                    "usage-mismatch",
                    f"usage says {d.usage_tokens} completion tokens, the client got {len(d.content)}",
                )
        self.expect_journal("completed", "completed", "a complete answer")
        self.expect_delivered_in_journal(d.delivered_tokens)

    def check_terminal_frame(self) -> None:
        d = self.d
        n = len(d.content)
        for frame in d.frames:
            broken = schema_errors("terminal-frame", {"error": frame})
            if broken:
                self.flag("2", "frame-schema", f"the terminal frame breaks its published schema: {broken}")
        if len(d.frames) != 1:
            self.flag(
                "2", "frame-count", f"{len(d.frames)} terminal error frames, not exactly one: {d.frames}"
            )
        if (
            d.done_count != 1
            or d.payloads[-1] != DONE
            or not (len(d.payloads) >= 2 and isinstance(d.payloads[-2], dict) and "error" in d.payloads[-2])
        ):
            self.flag(
                "2",
                "frame-not-last",
                f"the terminal frame is not the last event before one final [DONE]: {d.payloads[-3:]}",
            )
        if n == 0:
            self.flag(
                "8",
                "frame-without-content",
                "a terminal error frame in a 200 stream that delivered no content: a request without content "
                f"must end complete or with one JSON HTTP error; frames {d.frames}",
            )
        frame = d.frames[-1]
        if frame.get("code") != INTERRUPTED or frame.get("request_id") != self.sent.request_id:
            self.flag(
                "2", "frame-shape", f"terminal frame without code {INTERRUPTED} naming this request: {frame}"
            )
        if frame.get("delivered_output_tokens") != d.delivered_tokens:
            self.flag(
                "3",
                "frame-count-mismatch",
                f"terminal frame says delivered_output_tokens={frame.get('delivered_output_tokens')}, the "
                f"client got {d.delivered_tokens}",
            )
        self.expect_journal("interrupted", INTERRUPTED, "a stream ended by a terminal frame")
        self.expect_delivered_in_journal(d.delivered_tokens)

    # -- Responses and Messages (tests/api_streams.py reads them)

    def check_named_shape(self) -> None:
        """Invariants 1 and 2 on a Responses/Messages stream: whole named JSON events of one attempt, one
        opening and one id, Responses' sequence numbers gapless from 0, one generation's text, nothing after
        the end."""
        d, stream, route = self.d, self.d.stream, self.sent.route
        assert stream is not None
        self.check_event_sizes()
        opening = "response.created" if route == "responses" else "message_start"
        if stream.preambles > 1:
            self.flag(
                "1",
                "several-preambles",
                f"{stream.preambles} {opening} events in one stream: a dead attempt's opening reached the "
                f"client beside the winner's (ids {stream.response_ids()})",
            )
        if len(set(stream.response_ids())) > 1:
            self.flag(
                "2",
                "events-of-several-answers",
                f"the stream names {len(set(stream.response_ids()))} answers: {stream.response_ids()}",
            )
        if stream.events and stream.names[0] != opening:
            self.flag("2", "opening-not-first", f"the stream starts with {stream.names[0]}, not {opening}")
        if d.unparseable:
            self.flag(
                "2",
                "unparseable-event",
                f"{len(d.unparseable)} event(s) that are not JSON, e.g. {_short(d.unparseable[0])}",
            )
        malformed = [e.raw for e in stream.events if e.json_ok and not e.well_formed]
        if malformed:
            self.flag(
                "2",
                "event-shape",
                f"{len(malformed)} event(s) that are not one `event:` line naming the data's type and one "
                f"`data:` line, e.g. {_short(malformed[0])}",
            )
        if d.torn_tail and self.client.transport_error is None and not self.client.disconnected:
            self.flag(
                "2",
                "torn-event",
                f"the stream ended cleanly inside an event: tail {_short(self.client.body[-200:])}",
            )
        if route == "responses":
            numbers = stream.sequence_numbers()
            if numbers != list(range(len(numbers))):
                self.flag(
                    "2",
                    "sequence-numbers",
                    "sequence numbers are not gapless from 0 (a loser's events, or ours misnumbered): "
                    f"{numbers}",
                )
        self.check_prefix_of_the_generation()
        ends = [
            i
            for i, name in enumerate(stream.names)
            if name in api_streams.RESPONSES_CLEAN_END or name in ("message_stop", "response.failed", "error")
        ]
        if ends and ends[0] != len(stream.events) - 1:
            self.flag(
                "2",
                "event-after-end",
                f"events after the stream's end ({stream.names[ends[0]]}): {stream.names[ends[0] + 1 :][:5]}",
            )

    def check_named_complete(self) -> None:
        d, sent, route = self.d, self.sent, self.sent.route
        if d.unary is not None:
            tokens = api_streams.unary_output_tokens(route, d.unary)
            if not api_streams.unary_complete(route, d.unary) or (
                sent.max_tokens is not None and tokens != sent.max_tokens
            ):
                self.flag(
                    "2",
                    "unary-not-complete",
                    f"a non-streamed 200 that is not one complete generation: {_short(json.dumps(d.unary))}, "
                    f"output_tokens {tokens} of {sent.max_tokens}",
                )
            if tokens is not None and not self.is_the_generation(d.text, tokens):
                self.flag("2", "unary-text", f"non-streamed text {_short(d.text)} is not the generation's")
        else:
            stream = d.stream
            assert stream is not None
            if stream.clean_ends != 1:
                self.flag("2", "end-count", f"{stream.clean_ends} clean ends: {stream.names[-5:]}")
            if sent.max_tokens is not None and len(d.content) != sent.max_tokens:
                self.flag(
                    "2",
                    "done-without-whole-generation",
                    f"a stream ending cleanly without a terminal event carries {len(d.content)} content "
                    f"events, not the whole generation of {sent.max_tokens}: an interruption labelled "
                    "complete",
                )
            last = stream.events[-1].data if stream.events else {}
            if route == "responses":
                response = last.get("response") if isinstance(last, dict) else None
                details = response.get("incomplete_details") if isinstance(response, dict) else None
                finished = isinstance(response, dict) and response.get("status") == "incomplete"
                if (
                    not finished
                    or not isinstance(details, dict)
                    or details.get("reason") != "max_output_tokens"
                ):
                    self.flag(
                        "2",
                        "finish-reasons",
                        "a complete Responses stream must end at max_output_tokens: "
                        f"{_short(json.dumps(last))}",
                    )
            else:
                reasons = [
                    e.data.get("delta", {}).get("stop_reason")
                    for e in stream.events
                    if api_streams.event_name(e) == "message_delta" and isinstance(e.data, dict)
                ]
                if reasons != ["max_tokens"]:
                    self.flag(
                        "2",
                        "finish-reasons",
                        f"a complete Messages stream must stop once at max_tokens: {reasons}",
                    )
            if d.usage_tokens is not None and d.usage_tokens != len(d.content):
                self.flag(
                    "3",
                    "usage-mismatch",
                    f"usage says {d.usage_tokens} output tokens, the client got {len(d.content)}",
                )
        self.expect_journal("completed", "completed", "a complete answer")
        self.expect_delivered_in_journal(d.delivered_tokens)

    def check_named_terminal(self) -> None:
        """Exactly one terminal event of ours, last, in the client's API: Responses' `response.failed` with
        the id of the client's `response.created` and the next sequence number, Messages' `event: error` with
        an Anthropic error type and our code in `details.error_code`; the count is what the client got."""
        d, route = self.d, self.sent.route
        stream = d.stream
        assert stream is not None
        terminal = stream.terminal_events()
        n = len(d.content)
        if len(terminal) != 1:
            self.flag(
                "2",
                "frame-count",
                f"{len(terminal)} terminal events, not exactly one: {[e.raw[:200] for e in terminal]}",
            )
        last = terminal[-1]
        if stream.events[-1] is not last:
            self.flag("2", "frame-not-last", f"the terminal event is not the last event: {stream.names[-3:]}")
        if n == 0:
            self.flag(
                "8",
                "frame-without-content",
                "a terminal event in a 200 stream that delivered no content: a request without content must "
                f"end complete or with one JSON HTTP error; got {_short(last.raw)}",
            )
        data = last.data if isinstance(last.data, dict) else {}
        error = api_streams.terminal_error(route, last)
        if route == "responses":
            name = api_streams.event_name(last)
            created = (
                stream.events[0].data.get("response") if stream.events and stream.events[0].json_ok else None
            )
            response = data.get("response") if isinstance(data.get("response"), dict) else {}
            if name != "response.failed":
                self.flag(
                    "2",
                    "frame-shape",
                    f"a Responses stream ended by {name}, not our response.failed: {_short(last.raw)}",
                )
            elif not isinstance(created, dict) or response.get("id") != created.get("id"):
                self.flag(
                    "2",
                    "frame-identity",
                    f"response.failed names {response.get('id')!r}, the client's response is "
                    f"{created.get('id') if isinstance(created, dict) else None!r}",
                )
            broken = schema_errors("responses-failed-event", data)
        else:
            if error.get("type") not in api_streams.ANTHROPIC_ERROR_TYPES:
                self.flag(
                    "2",
                    "frame-error-type",
                    f"error.type {error.get('type')!r} is not an Anthropic error type",
                )
            details = error.get("details") if isinstance(error.get("details"), dict) else {}
            if (
                details.get("error_code") != error.get("code")
                or data.get("request_id") != self.sent.request_id
            ):
                self.flag(
                    "2",
                    "frame-shape",
                    f"our code and request id not where Anthropic's SDK reads them: {data}",
                )
            broken = schema_errors("messages-error", data)
        if broken:
            self.flag("2", "frame-schema", f"the terminal event breaks its published schema: {broken}")
        if (
            error.get("code") != INTERRUPTED
            or error.get("request_id") != self.sent.request_id
            or error.get("partial_output") is not True
            or error.get("retryable") is not False
        ):
            self.flag(
                "2", "frame-shape", f"terminal event without code {INTERRUPTED} naming this request: {error}"
            )
        if error.get("delivered_output_tokens") != d.delivered_tokens:
            self.flag(
                "3",
                "frame-count-mismatch",
                f"terminal event says delivered_output_tokens={error.get('delivered_output_tokens')}, the "
                f"client got {d.delivered_tokens}",
            )
        for marker in api_streams.REPLICA_ERROR_MARKERS:
            if marker in self.client.body:
                self.flag("8", "raw-replica-error", f"a replica's own error reached the client: {marker!r}")
        self.expect_journal("interrupted", INTERRUPTED, "a stream ended by a terminal event")
        self.expect_delivered_in_journal(d.delivered_tokens)

    def check_reset(self) -> None:
        d, client = self.d, self.client
        end, died = self.replica_attempt(self.serving_attempt_id())
        abrupt_outcomes = ABRUPT_BY_ROUTE.get(self.sent.route, ABRUPT_REPLICA_OUTCOMES)
        abrupt = died or (end is not None and end.get("outcome") in abrupt_outcomes)
        # Released by the gateway (the write-ahead says so): the first delta was on its way when the replica
        # died, and Envoy may drop what it had not yet written to the client with the reset
        # (docs/envoy-facts.md#a-reset-stays-a-reset), so "200, then a reset" without content is the honest
        # outcome, journaled as an interruption.
        journal_count = self.journal.get("delivered_output_tokens")
        released = bool(self.journal.get("first_delta_sent"))
        journal_end = (self.journal.get("phase"), self.journal.get("outcome"), journal_count, released)
        if not d.content and abrupt and journal_end == ("failed", "upstream_error", 0, False):
            # The reset came between the gateway's two replies (the held headers, then the first content): the
            # client got a 200 and no body byte, and the journal says nothing was delivered (Envoy's access
            # log), as docs/design.md#the-two-filter-placements says.
            return
        if not d.content and not (abrupt and released):
            self.flag(
                "8",
                "reset-without-content",
                f"HTTP 200 then a transport reset ({client.transport_error}) and no content was written "
                f"towards the client: a request that delivered no content must end complete or with one "
                f"JSON error; got {_short(client.body)}",
            )
        ended = d.stream.clean_ends if d.stream is not None else d.done_count
        if ended or d.frames:
            self.flag(
                "2",
                "reset-after-end",
                f"a reset after [DONE] or a terminal frame ({d.done_count} [DONE], {d.frames})",
            )
        if not abrupt:
            self.flag(
                "2",
                "reset-without-replica-death",
                f"the client got a transport reset ({client.transport_error}) although the replica that "
                f"served it did not die abruptly (its log: "
                f"{'no record' if end is None else end.get('outcome')}): it should have got a terminal frame",
            )
        self.expect_journal("interrupted", INTERRUPTED, "a stream cut by a reset after the first delta")
        # Invariant 3, with a tolerance. After an abrupt upstream reset Envoy resets the client connection and
        # what it had not written yet is lost: the tail of an event, or whole events whose ext_proc answer was
        # still on its way (docs/envoy-facts.md#a-reset-stays-a-reset: nothing can be added or flushed then).
        # `delivered` is what the gateway wrote towards the client (docs/design.md#vocabulary), so the journal
        # may exceed what arrived by what was in flight at the reset, but never what the replica wrote: what
        # the client got <= journal <= what the replica wrote (max_tokens when its log died with it).
        written = end.get("content_events_written") if end is not None else None
        bounds = [x for x in (written, self.sent.max_tokens) if isinstance(x, int)]
        if not self.final:
            return
        if not isinstance(journal_count, int) or journal_count < d.delivered_tokens:
            self.flag(
                "3",
                "journal-below-client",
                f"the client got {d.delivered_tokens} content events before the reset, the journal says "
                f"delivered_output_tokens={journal_count}",
            )
        elif bounds and journal_count > min(bounds):
            self.flag(
                "3",
                "journal-above-replica",
                f"the journal says delivered_output_tokens={journal_count}, more than the replica wrote "
                f"({written}) / max_tokens ({self.sent.max_tokens})",
            )

    def check_disconnect(self) -> None:
        d, client = self.d, self.client
        got = len(d.content)
        end, died = self.replica_attempt(self.serving_attempt_id())
        # Invariant 5: the replica serving it saw the client go (or had already finished, or died anyway).
        if not died and end is None:
            self.flag(
                "5",
                "replica-never-ended",
                "the client left, but the replica serving it never logged the end of its attempt",
            )
        elif (
            end is not None
            and end.get("client_gone_at") is None
            and end.get("outcome") != "completed"
            and not str(end.get("outcome", "")).startswith("fault:")
        ):
            self.flag(
                "5",
                "replica-never-saw-client-leave",
                f"the client left, but its replica never saw it go: {end}",
            )
        # ... and no other attempt started after it left.
        left = client.disconnected_at or client.ended_at
        late = [s for s in self.replica_starts() if s.get("t_start", 0) > left]
        if late:
            self.flag(
                "5",
                "attempt-after-disconnect",
                f"{len(late)} attempt(s) reached a replica after the client left at {left:.3f}: "
                f"{[(s.get('replica'), s.get('attempt_id'), s.get('t_start')) for s in late]}",
            )
        late_journal = [
            e for e in self.events if e.get("event") == "attempt_started" and float(e.get("t", 0)) > left
        ]
        if late_journal:
            self.flag(
                "5",
                "journal-attempt-after-disconnect",
                f"the journal started attempt(s) after the client left: {late_journal}",
            )
        # Invariant 3, with a tolerance. `delivered` is what the gateway wrote towards the client
        # (docs/design.md#vocabulary); a client that leaves has not read what was in flight: Envoy's and the
        # kernel's socket buffers on both sides of the client connection, and the events the gateway forwarded
        # until it learnt of the disconnect. That amount has no useful fixed bound (it depends on buffer sizes
        # and scheduling), but it is bounded by what the replica wrote for this attempt: the gateway cannot
        # deliver what was never generated. So: what the client got <= journal <= what the replica wrote
        # (<= max_tokens).
        journal_count = self.journal.get("delivered_output_tokens")
        written = end.get("content_events_written") if end is not None else None
        bounds = [x for x in (written, self.sent.max_tokens) if isinstance(x, int)]
        upper = min(bounds) if bounds else None
        if self.final:
            if not isinstance(journal_count, int) or journal_count < got:
                self.flag(
                    "3",
                    "journal-below-client",
                    f"the client read {got} content events before leaving, the journal says "
                    f"delivered_output_tokens={journal_count}",
                )
            elif upper is not None and journal_count > upper:
                self.flag(
                    "3",
                    "journal-above-replica",
                    f"the journal says delivered_output_tokens={journal_count}, more than the replica wrote "
                    f"({written}) / max_tokens ({self.sent.max_tokens})",
                )
        phase, outcome = self.journal.get("phase"), self.journal.get("outcome")
        allowed = {("cancelled", CLIENT_DISCONNECTED)}
        if isinstance(journal_count, int) and journal_count == self.sent.max_tokens:
            allowed.add(("completed", "completed"))  # the whole answer was written before it left
        if died or (end is not None and str(end.get("outcome", "")).startswith("fault:")):
            allowed.add(("interrupted", INTERRUPTED))  # it was being interrupted anyway when it left
        if self.final and (phase, outcome) not in allowed:
            self.flag(
                "9",
                "disconnect-journal-phase",
                f"the client left after {got} content events; the journal says phase={phase} "
                f"outcome={outcome} (expected one of {sorted(allowed)})",
            )
        if d.frames and got == 0:
            self.flag("8", "frame-without-content", f"a terminal frame before any content: {d.frames}")

    def check_json_error(self) -> None:
        error = self.d.error or {}
        self.check_error_body()
        code = error.get("code")
        phase, outcome = self.journal.get("phase"), self.journal.get("outcome")
        if self.final and (phase not in ("failed", "rejected") or outcome != code):
            self.flag(
                "9",
                "cause-mismatch",
                f"the client got HTTP {self.client.status} {code!r}; the journal says phase={phase} "
                f"outcome={outcome}: its cause must be the one the client was told",
            )
        if code == "retries_exhausted" and self.final:
            # Retries run out only when max_attempts attempts reached a replica, or Envoy's whole num_retries
            # (2 x max_attempts - 1: room for attempts that die at their connection) was used up.
            counted = [a for a in self.attempts if a.get("detail") != NOT_SENT]
            made = max(self.journal.get("envoy_attempts") or 0, len(self.attempts))
            if len(counted) < self.ev.max_attempts and made < 2 * self.ev.max_attempts:
                self.flag(
                    "9",
                    "premature-exhaustion",
                    f"retries_exhausted after {len(counted)} counted attempt(s) of {self.ev.max_attempts} "
                    f"(Envoy made {made}): {self._attempts()}",
                )
        self.expect_delivered_in_journal(0)

    def check_error_body(self) -> None:
        """Invariant 8 on an HTTP error: one JSON error naming the request and why, nothing of a replica."""
        client, body = self.client, self.client.body
        ctype = _content_type(client)
        if "application/json" not in ctype:
            self.flag(
                "8",
                "error-not-json",
                f"HTTP {client.status} with content-type {ctype or '(none)'!r}, not one JSON error: body "
                f"{_short(body)}",
            )
        if b"data:" in body:
            self.flag(
                "8",
                "error-carries-sse",
                f"HTTP {client.status} carrying SSE events (a dead attempt's bytes): {_short(body)}",
            )
        markers = RAW_REPLICA_ERROR_MARKERS + (api_streams.REPLICA_ERROR_MARKERS if self.sent.named else ())
        for marker in markers:
            if marker in body:
                self.flag(
                    "8", "raw-replica-error", f"a replica's raw error reached the client: {_short(body)}"
                )
        error = self.d.error
        if error is None:
            return
        if self.sent.route == "messages":
            # Anthropic's shape: {"type": "error", "error": {"type": <Anthropic's>, …}}, our code where its
            # SDK reads it (error.details.error_code).
            try:
                whole = json.loads(body)
            except ValueError:
                whole = {}
            details = error.get("details") if isinstance(error.get("details"), dict) else {}
            if (
                whole.get("type") != "error"
                or error.get("type") not in api_streams.ANTHROPIC_ERROR_TYPES
                or details.get("error_code") != error.get("code")
            ):
                # Envoy's own local reply (envoy/gateway.yaml's local_reply_config names its flags) is a case
                # of its own: a known product bug (test_api_contract.py's release race).
                envoys = "response_flags" in error
                self.flag(
                    "8",
                    "envoy-reply-not-in-the-apis-shape" if envoys else "error-not-in-the-apis-shape",
                    f"a Messages error that is not Anthropic's shape with our code: {_short(body)}",
                )
        code = error.get("code")
        if not isinstance(code, str) or not code:
            self.flag(
                "8",
                "error-without-code",
                f"the JSON error names no reason (error.code={code!r}): {_short(body)}",
            )
        if error.get("request_id") != self.sent.request_id:
            self.flag(
                "8",
                "error-without-request-id",
                f"the JSON error names request_id {error.get('request_id')!r}: {_short(body)}",
            )

    def check_other(self) -> None:
        client = self.client
        if client.transport_error and client.transport_error.startswith(("ReadTimeout", "PoolTimeout")):
            self.flag(
                "9",
                "hang",
                f"the response never ended ({client.transport_error}) after {len(self.d.content)} content "
                f"events: an interruption must never be silent",
            )
        elif client.status >= 400:
            self.check_error_body()  # says what is wrong with it (not JSON, SSE events, a replica's error)
        elif not self.d.content:
            self.flag(
                "8",
                "no-content-no-error",
                f"a request that delivered no content ended with {self.d.note}; body {_short(client.body)}",
            )
        else:
            self.flag(
                "9",
                "silent-interruption",
                f"an interruption that is neither a terminal frame nor a reset: {self.d.note}",
            )

    # -- the journal

    def expect_journal(self, phase: str, outcome: str, what: str) -> None:
        if not self.final:
            return
        got = (self.journal.get("phase"), self.journal.get("outcome"))
        if got != (phase, outcome):
            self.flag(
                "9",
                "journal-phase-mismatch",
                f"the client got {what}; the journal says phase={got[0]} outcome={got[1]}",
            )

    def expect_delivered_in_journal(self, count: int) -> None:
        if not self.final:
            return
        journal_count = self.journal.get("delivered_output_tokens")
        if journal_count != count:
            self.flag(
                "3",
                "journal-count-mismatch",
                f"the journal says delivered_output_tokens={journal_count}, the client got {count}",
            )

    def check_journal_consistency(self) -> None:
        j = self.journal
        phase = j.get("phase")
        route = (j.get("input") or {}).get("route")
        if route is not None and route != JOURNAL_ROUTES[self.sent.route]:
            self.flag(
                "9",
                "journal-route",
                f"the journal names route {route!r}, the client sent {self.sent.route!r}",
            )
        if phase not in TERMINAL_PHASES:
            self.flag(
                "9",
                "never-terminal",
                f"the journal record never reached a terminal phase: phase={phase}, events {self._trace()}",
            )
        else:
            open_attempts = [a.get("attempt") for a in self.attempts if a.get("outcome") is None]
            if open_attempts:
                self.flag(
                    "9",
                    "attempt-without-outcome",
                    f"the request is {phase} but attempt(s) {open_attempts} have no outcome: "
                    f"{self._attempts()}",
                )
            started = {e.get("attempt") for e in self.events if e.get("event") == "attempt_started"}
            listed = {a.get("attempt") for a in self.attempts}
            if started - listed:
                self.flag(
                    "9",
                    "attempt-not-listed",
                    f"attempt_started for attempt(s) {sorted(started - listed)} the record does not list",
                )
        if j.get("attempt") != len(self.attempts):
            self.flag(
                "9",
                "attempt-count",
                f"journal attempt={j.get('attempt')} but {len(self.attempts)} attempts are listed",
            )
        # An attempt that died at its connection before its request was sent is listed, not counted.
        counted = [a for a in self.attempts if a.get("detail") != NOT_SENT]
        if len(counted) > self.ev.max_attempts:
            self.flag(
                "9",
                "too-many-attempts",
                f"{len(counted)} attempts reached a replica, more than max_attempts {self.ev.max_attempts}",
            )
        # No attempt goes uncounted: each one a replica served is journaled under Envoy's own number for it
        # (x-envoy-attempt-count), so an attempt Envoy made that the journal missed shows up as a gap.
        numbers = {a.get("attempt_id"): a.get("attempt") for a in self.attempts}
        for start in self.replica_starts():
            journaled = numbers.get(start.get("attempt_id"))
            if self.final and journaled is not None and journaled != start.get("attempt_count"):
                self.flag(
                    "9",
                    "attempt-undercounted",
                    f"the replica served Envoy's attempt {start.get('attempt_count')} "
                    f"({start.get('attempt_id')}), which the journal lists as attempt {journaled}: "
                    f"{self._attempts()}",
                )
        delivered_content = bool(self.d.content) or self.d.unary is not None
        # After a reset the first delta may have been written and lost in flight (see `check_reset`).
        lost_in_flight = self.d.kind == "reset" and not delivered_content
        if (
            phase in TERMINAL_PHASES
            and bool(j.get("first_delta_sent")) != delivered_content
            and not lost_in_flight
        ):
            self.flag(
                "9",
                "first-delta-sent-mismatch",
                f"first_delta_sent={j.get('first_delta_sent')} but the client got "
                f"{len(self.d.content) if self.d.unary is None else 'a whole answer'} content",
            )
        known = {a.get("attempt_id") for a in self.attempts}
        unjournaled = {s.get("attempt_id") for s in self.replica_starts()} - known
        if unjournaled and self.final:
            self.flag(
                "9",
                "unjournaled-attempt",
                f"replicas served attempt(s) {sorted(map(str, unjournaled))} the journal does not list",
            )

    def check_leases(self) -> None:
        """Invariant 4, as tests/fault/test_fencing.py checks it: each attempt's lease was revoked in etcd
        before the next attempt's was granted, and a fenced attempt was proven fenced before the next
        began."""
        for attempt in self.attempts:
            # One that never left Envoy had no lease to hold (nothing of it could be published).
            if not isinstance(attempt.get("lease"), dict) and attempt.get("detail") != NOT_SENT:
                self.flag(
                    "4", "no-lease-record", f"attempt {attempt.get('attempt')} has no lease record: {attempt}"
                )
        started = attempt_times(self.events, "attempt_started")
        fenced = attempt_times(self.events, "attempt_fenced")
        # An attempt that never left Envoy held no lease: the leases to compare are those of the others.
        leased = [a for a in self.attempts if a.get("detail") != NOT_SENT]
        for earlier, later in itertools.pairwise(leased):
            lease_e = earlier.get("lease") or {}
            lease_l = later.get("lease") or {}
            revoked, granted = lease_e.get("revoked_at"), lease_l.get("granted_at")
            n, m = earlier.get("attempt"), later.get("attempt")
            if revoked is None:
                self.flag(
                    "4",
                    "lease-never-revoked",
                    f"attempt {m} got a lease (granted_at {granted}) but attempt {n}'s lease was never "
                    f"revoked (stopped_at {lease_e.get('stopped_at')}): {self._attempts()}",
                )
            elif granted is not None and revoked > granted:
                self.flag(
                    "4",
                    "leases-overlap",
                    f"attempt {n}'s lease was revoked at {revoked}, {revoked - granted:.3f}s after "
                    f"attempt {m}'s was granted at {granted}: two valid leases at once",
                )
            if earlier.get("fence") and n in fenced and m in started and fenced[n] > started[m]:
                self.flag(
                    "4",
                    "started-before-fenced",
                    f"attempt {m} started at {started[m]} before attempt {n} was fenced at {fenced[n]}",
                )

    def _attempts(self) -> str:
        return json.dumps(
            [
                {k: a.get(k) for k in ("attempt", "replica", "outcome", "detail", "lease", "fence")}
                for a in self.attempts
            ]
        )

    def _trace(self) -> str:
        return json.dumps([(e.get("event"), e.get("attempt")) for e in self.events])


def check_request(ev: Evidence) -> list[Violation]:
    """Every §8 invariant this evidence can show broken (1, 2, 3, 4, 5, 8, 9); empty when all hold."""
    return _Check(ev).run()


@dataclass
class GatewayProbe:
    """Invariant 10 evidence for a batch: the gateway's processes before/after, and one normal request."""

    sidecar_alive: bool
    envoy_pid_before: int | None
    envoy_pid_after: int | None
    normal_request: Evidence | None  # a fault-free request sent after the batch


def check_gateway(probe: GatewayProbe) -> list[Violation]:
    out: list[Violation] = []
    rid = probe.normal_request.request_id if probe.normal_request is not None else "-"
    if not probe.sidecar_alive:
        out.append(
            Violation("10", "sidecar-exited", rid, "the gateway (sidecar) process exited during the batch")
        )
    if probe.envoy_pid_after is None or probe.envoy_pid_after != probe.envoy_pid_before:
        out.append(
            Violation(
                "10",
                "envoy-restarted",
                rid,
                f"Envoy's pid changed during the batch: {probe.envoy_pid_before} → {probe.envoy_pid_after} "
                "(crashed or restarted)",
            )
        )
    if probe.normal_request is None:
        out.append(
            Violation("10", "no-normal-request", rid, "no normal request could be sent after the batch")
        )
        return out
    kind = outcome_kind(probe.normal_request)
    if kind != "complete":
        out.append(
            Violation(
                "10",
                "normal-request-failed",
                rid,
                f"a normal request after the batch got {kind}, not a complete answer: "
                f"HTTP {probe.normal_request.client.status} {_short(probe.normal_request.client.body)}",
            )
        )
    out.extend(check_request(probe.normal_request))
    return out


# --- the simulator as oracle ---------------------------------------------------------------------------


def simulated_pieces(route: Route, body: dict[str, Any], *, server_seed: int = 0) -> tuple[str, ...]:
    """The text of each content event a simulated replica (started with `--seed server_seed`) writes for
    this request: the simulator is deterministic in (seed, model, prompt, max_tokens)."""
    from router_testbed.sim import generation as gen

    kind: gen.Kind = {"chat": "chat", "completions": "completion"}.get(route, route)  # type: ignore[assignment]
    request = gen.parse_request(kind, json.dumps(body).encode(), served_model=str(body.get("model", "tiny")))
    output = gen.plan_output(request, server_seed)
    return tuple(p if isinstance(p, str) else str(p.get("content") or "") for p in output.pieces)


def simulated_variants(
    route: Route, body: dict[str, Any], fault: str | None, *, server_seed: int = 0
) -> tuple[tuple[str, ...], ...]:
    """The generations a simulated replica writes for this request under its fault's `oversize` clauses
    (content event N's text padded to the clause's size), one per clause."""
    if not fault or "oversize" not in fault:
        return ()
    from router_testbed.sim import generation as gen
    from router_testbed.sim.faults import DEFAULT_OVERSIZE_BYTES, parse_fault_spec

    kind: gen.Kind = {"chat": "chat", "completions": "completion"}.get(route, route)  # type: ignore[assignment]
    request = gen.parse_request(kind, json.dumps(body).encode(), served_model=str(body.get("model", "tiny")))
    output = gen.plan_output(request, server_seed)
    out = []
    for clause in parse_fault_spec(fault):
        if clause.action == "oversize" and clause.point.n is not None:
            size = clause.size or DEFAULT_OVERSIZE_BYTES
            padded = gen.with_oversize(output, {clause.point.n: size})
            out.append(tuple(p if isinstance(p, str) else str(p.get("content") or "") for p in padded.pieces))
    return tuple(out)


def records_by_request(records: Iterable[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    for record in records:
        rid = record.get("request_id")
        if isinstance(rid, str):
            out.setdefault(rid, []).append(record)
    return out


def unfinished_attempts(records: Sequence[dict[str, Any]], live_pids: frozenset[int]) -> list[dict[str, Any]]:
    """Start records without an end record whose replica process is still alive (still being served)."""
    ends = {(r.get("attempt_id"), r.get("t_start")) for r in records if r.get("event") == "end"}
    return [
        r
        for r in records
        if r.get("event") == "start"
        and (r.get("attempt_id"), r.get("t_start")) not in ends
        and r.get("pid") in live_pids
    ]


def describe(ev: Evidence, *, body_limit: int = 3000) -> dict[str, Any]:
    """The evidence as JSON-able data, for a failure report (bodies cut to `body_limit` bytes)."""
    client = ev.client
    return {
        "request": {
            "request_id": ev.sent.request_id,
            "route": ev.sent.route,
            "body": ev.sent.body,
            "fault": ev.sent.fault,
        },
        "client": {
            "status": client.status,
            "headers": {k: v for k, v in client.headers.items() if k in ("content-type", "x-request-id")},
            "body": client.body[:body_limit].decode("utf-8", "replace"),
            "body_bytes": len(client.body),
            "transport_error": client.transport_error,
            "disconnected": client.disconnected,
            "content_events_read": client.content_events_read,
            "disconnected_at": client.disconnected_at,
            "started_at": client.started_at,
            "ended_at": client.ended_at,
        },
        "outcome": outcome_kind(ev),
        "journal_status": ev.journal_status,
        "journal": ev.journal,
        "replica_records": ev.replica_records,
    }
