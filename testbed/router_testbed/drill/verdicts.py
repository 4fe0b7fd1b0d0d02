"""The drill's verdicts: pure functions of the recorded evidence (no I/O, no clock).

Each scenario's judge turns its :class:`Evidence` into a :class:`Verdict`: a list of checks, each saying
what was checked (the promise, in one line) and what was seen (always recorded; shown when it failed).
The checks are the invariants of docs/design.md#the-invariants, read from the client's exact bytes, the
gateway's journal record and, for simulated replicas, the replica's own log:

1. the client gets content from at most one attempt;
2. one complete generation ending in the API's clean end, or a prefix followed by exactly one terminal event
   (or a transport reset when the replica died abruptly) — never a repeated fragment;
3. `delivered_output_tokens` in the frame and the journal equal what the client got (after a reset or a
   client disconnect: at least what it read, at most what the replica wrote);
4. no two attempts held a valid lease at once;
5. a client disconnect cancels the attempt and starts no other;
8. a request that delivered nothing ends complete or with one JSON error naming the request and why;
9. the journal's phase, outcome, first_delta_sent and attempts agree with what the client got.

Against a gateway that is not router-sidecar (any other OpenAI-compatible one) the checks that read its
journal, or hold it to router-sidecar's own vocabulary (error codes, the terminal frame's fields, the
request id in bodies and headers), are recorded as not applicable (`Check.ok is None`), never as failed:
what any honest gateway owes its client is judged the same way for every gateway.

Each request is read by its API's rules (`apis.py`): chat completions and completions end with `[DONE]` and
their terminal event is one `{"error": …}` frame then `[DONE]`; the Responses API ends with
`response.completed`/`response.incomplete`, its terminal event is a `response.failed` that continues the
client's stream (its response id, the next sequence number) and its preamble comes once (one
`response.created`, sequence numbers from 0 without a gap); the Messages API ends with `message_stop`, its
terminal event is an `event: error` with one of Anthropic's error types, its preamble one `message_start`.
Errors before any content are in each API's shape (OpenAI's `{"error": …}`, Anthropic's
`{"type": "error", "error": {"type", "message"}}`). What the API itself requires is judged for every gateway.
"""

from __future__ import annotations

import functools
import itertools
import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from router_testbed.drill import apis
from router_testbed.drill.evidence import DONE, Exchange, HookRun, StreamView, read_stream
from router_testbed.oracle import INTERRUPTED, RAW_REPLICA_ERROR_MARKERS, attempt_times

# Journal events that mean the gateway treated the attempt as failed or lost.
FAILOVER_EVENTS = frozenset({"attempt_failed", "retry_triggered", "replica_lost", "attempt_fenced"})


NOT_ROUTER_SIDECAR = "the gateway is not router-sidecar"


@dataclass(frozen=True)
class Check:
    what: str  # what was checked: the promise, in one line
    ok: bool | None  # None: not applicable to this gateway (`seen` says why)
    seen: str  # what was seen

    def to_json(self) -> dict[str, Any]:
        return {"what": self.what, "ok": self.ok, "seen": self.seen}


@dataclass
class Verdict:
    checks: list[Check] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # observations that are not violations
    # The gateway is router-sidecar: its journal, error codes and frame fields are judged too.
    router_sidecar: bool = True
    # Why nothing here shows the scenario's fault took effect (then, with no failed check, the scenario is
    # not applicable rather than passed: a fault that never fired proves nothing).
    inconclusive: str | None = None

    @property
    def passed(self) -> bool:
        return bool(self.applicable) and all(c.ok for c in self.applicable)

    @property
    def applicable(self) -> list[Check]:
        return [c for c in self.checks if c.ok is not None]

    @property
    def failed(self) -> list[Check]:
        return [c for c in self.checks if c.ok is False]

    def check(self, what: str, ok: bool, seen: str) -> bool:
        self.checks.append(Check(what, bool(ok), seen))
        return bool(ok)

    def check_router_sidecar(self, what: str, ok: bool, seen: str) -> bool:
        """A promise of router-sidecar's own (its codes, its frame's fields, its request ids): judged against
        router-sidecar, recorded as not applicable against another gateway."""
        if not self.router_sidecar:
            self.not_applicable(what)
            return False
        return self.check(what, ok, seen)

    def not_applicable(self, what: str, why: str = NOT_ROUTER_SIDECAR) -> None:
        self.checks.append(Check(what, None, why))

    def note(self, text: str) -> None:
        self.notes.append(text)


@dataclass
class Evidence:
    """Everything one scenario recorded."""

    exchanges: list[Exchange]
    sim: bool = False  # the replicas are the simulator (its faults were injected)
    # What the scenario's fault leads to, e.g. {"content_before_fault": 2} (set by the scenario).
    expect: dict[str, Any] = field(default_factory=dict)
    hooks: list[HookRun] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # what the runner observed while driving the scenario
    router_sidecar: bool = True  # the gateway keeps router-sidecar's journal and speaks its vocabulary

    def get(self, label: str) -> Exchange | None:
        return next((x for x in self.exchanges if x.label == label), None)

    @property
    def main(self) -> Exchange | None:
        return self.exchanges[0] if self.exchanges else None


Judge = Callable[[Evidence], Verdict]


# --- small helpers ----------------------------------------------------------------------------------


def _short(data: bytes | str, limit: int = 200) -> str:
    text = data.decode("utf-8", "replace") if isinstance(data, bytes) else data
    return repr(text[:limit] + ("…" if len(text) > limit else ""))


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def _ended(x: Exchange, view: StreamView | None = None) -> str:
    """How the response ended, in a few words."""
    if x.status == 0:
        return f"no HTTP response ({x.transport_error})"
    if not x.is_event_stream:
        return f"HTTP {x.status} {x.content_type or '(no content type)'} {_short(x.body, 160)}"
    view = view or read_stream(x)
    spec = x.spec
    parts = [f"HTTP 200, {_plural(len(view.content), 'content event')}"]
    if view.frames:
        word = "error event" if spec.named_events else "error frame"
        parts.append(f"{_plural(len(view.frames), word)} {[_code(f) for f in view.frames]}")
    if spec.named_events:
        ends = [apis.event_type(e.name, e.data) for e in view.events if e.kind == "done"]
        parts.append(f"{view.done_count}× {'/'.join(sorted(set(ends))) or spec.end}")
        if view.stray_done:
            parts.append(f"{view.stray_done}× [DONE] (the API has none)")
    else:
        parts.append(f"{view.done_count}× [DONE]")
    if x.disconnected_at is not None:
        parts.append("then the client left")
    elif x.transport_error:
        parts.append(f"then {x.transport_error.split(':')[0]}")
    if view.torn_tail:
        parts.append(f"{len(view.torn_tail)} bytes of a torn event")
    return ", ".join(parts)


def _journal_summary(x: Exchange) -> str:
    if not x.has_record:
        return f"no journal record (look-up answered HTTP {x.journal_status})"
    j = x.journal or {}
    return (
        f"phase={j.get('phase')} outcome={j.get('outcome')} first_delta_sent={j.get('first_delta_sent')} "
        f"delivered_output_tokens={j.get('delivered_output_tokens')} attempts={len(x.attempts)}"
    )


def _attempts_summary(x: Exchange) -> str:
    return (
        "; ".join(
            f"#{a.get('attempt')} on {a.get('replica')}: {a.get('outcome')}"
            + (f" ({a.get('detail')})" if a.get("detail") else "")
            for a in x.attempts
        )
        or "none"
    )


def _trace_names(x: Exchange) -> list[str]:
    return [str(e.get("event")) for e in x.trace]


def _lease(attempt: dict[str, Any]) -> dict[str, Any]:
    lease = attempt.get("lease")
    return lease if isinstance(lease, dict) else {}


# --- building blocks --------------------------------------------------------------------------------


def check_record(v: Verdict, x: Exchange) -> bool:
    """The gateway journaled the request and its record reached a terminal phase. Another gateway keeps no
    journal: this check and every one that reads the record are not applicable (False: skip them)."""
    if not v.router_sidecar:
        v.not_applicable(f"journal: the record of {x.request_id} and every check that reads it")
        return False
    settled = x.has_record and (x.journal or {}).get("phase") in (
        "completed",
        "interrupted",
        "cancelled",
        "rejected",
        "failed",
    )
    v.check(
        f"journal: the record of {x.request_id} is readable by its id and reached a terminal phase",
        settled,
        _journal_summary(x),
    )
    if settled:
        j = x.journal or {}
        v.check(
            "journal: its attempt count matches the attempts it lists, each with an outcome",
            j.get("attempt") == len(x.attempts) and all(a.get("outcome") for a in x.attempts),
            f"attempt={j.get('attempt')}, listed: {_attempts_summary(x)}",
        )
    return settled


def check_journal(v: Verdict, x: Exchange, phase: str, outcome: str, *, first_delta: bool) -> None:
    j = x.journal or {}
    v.check(
        f"journal: phase={phase} outcome={outcome} first_delta_sent={first_delta}",
        (j.get("phase"), j.get("outcome"), bool(j.get("first_delta_sent"))) == (phase, outcome, first_delta),
        _journal_summary(x),
    )


def check_attempts(v: Verdict, x: Exchange, n: int) -> None:
    v.check(
        f"journal: exactly {_plural(n, 'attempt')}",
        len(x.attempts) == n,
        f"{_plural(len(x.attempts), 'attempt')}: {_attempts_summary(x)}",
    )


def check_no_attempt_after_first_delta(v: Verdict, x: Exchange) -> None:
    """After the first delta there is no retry: the attempt that delivered is the last one, and any earlier
    attempt failed before any content (a retry then is allowed, and noted)."""
    first_delta = [
        float(e["t"]) for e in x.trace if e.get("event") == "first_delta_sent" and _num(e.get("t"))
    ]
    late = [
        e.get("attempt")
        for e in x.trace
        if e.get("event") == "attempt_started" and first_delta and float(e.get("t") or 0) > first_delta[0]
    ]
    earlier_failed = all(a.get("outcome") == "failed" for a in x.attempts[:-1])
    v.check(
        "journal: no attempt after the first delta (one attempt delivered; any earlier one failed before "
        "content)",
        bool(x.attempts) and earlier_failed and not late,
        f"{_attempts_summary(x)}" + (f"; attempt(s) {late} started after the first delta" if late else ""),
    )
    if len(x.attempts) > 1 and earlier_failed and not late:
        v.note(f"retried before the first delta: {_attempts_summary(x)}")


def _num(value: Any) -> bool:
    return isinstance(value, int | float)


def check_leases(v: Verdict, x: Exchange) -> None:
    """Invariant 4 from the journal: each attempt's lease was revoked before the next one's was granted,
    and a fenced attempt was fenced before the next one started."""
    if len(x.attempts) < 2:
        return
    problems = []
    started = attempt_times(x.trace, "attempt_started")
    fenced = attempt_times(x.trace, "attempt_fenced")
    for earlier, later in itertools.pairwise(x.attempts):
        n, m = earlier.get("attempt"), later.get("attempt")
        revoked, granted = _lease(earlier).get("revoked_at"), _lease(later).get("granted_at")
        if not _lease(earlier):
            problems.append(f"attempt {n} has no lease record")
        elif revoked is None:
            problems.append(f"attempt {n}'s lease was never revoked, attempt {m}'s granted at {granted}")
        elif granted is not None and revoked > granted:
            problems.append(
                f"attempt {n}'s lease revoked at {revoked}, {revoked - granted:.3f}s after attempt {m}'s "
                "was granted"
            )
        if n in fenced and m in started and fenced[n] > started[m]:
            problems.append(f"attempt {m} started at {started[m]} before attempt {n} was fenced")
    v.check(
        "journal: no two attempts held a valid lease at once (each revoked before the next was granted)",
        not problems,
        "; ".join(problems) or f"{len(x.attempts)} leases, one after the other",
    )


def check_stream_shape(v: Verdict, x: Exchange, view: StreamView) -> None:
    """Invariants 1 and 2 on any SSE body: one attempt's events, whole JSON events, nothing after the end;
    on the named-event APIs, one preamble (one `response.created`/`message_start`, Responses' sequence
    numbers 0, 1, 2, … without a gap or repeat) and every event named by its type."""
    spec = x.spec
    ids = view.ids
    if spec.named_events:
        v.check(
            "client: every event comes from one answer (one response id)"
            if spec.sequenced
            else "client: every event comes from one answer (one message id)",
            len(ids) <= 1,
            f"ids {sorted(ids)}" if ids else "no answer id",
        )
        v.check(
            f"client: every complete event is JSON and named by its type; nothing after {spec.end} or "
            f"{spec.terminal}; no [DONE] (the API has none)",
            not view.unparseable
            and not view.events_after_done
            and not view.mislabelled
            and not view.stray_done,
            f"{len(view.unparseable)} unparseable, {len(view.events_after_done)} after the end, "
            f"{view.stray_done}× [DONE]"
            + (f", named not by their type: {view.mislabelled[:3]}" if view.mislabelled else "")
            + (f", e.g. {_short(view.unparseable[0])}" if view.unparseable else ""),
        )
        check_preamble(v, view)
    else:
        v.check(
            "client: every event comes from one completion (content from at most one attempt)",
            len(ids) <= 1,
            f"completion ids {sorted(ids)}" if ids else "no completion id",
        )
        v.check(
            "client: every complete event is JSON or [DONE], nothing after [DONE]",
            not view.unparseable and not view.events_after_done,
            f"{len(view.unparseable)} unparseable, {len(view.events_after_done)} after [DONE]"
            + (f", e.g. {_short(view.unparseable[0])}" if view.unparseable else ""),
        )
    expected = x.expected_pieces
    if expected is None or not view.content:
        return
    n = len(view.content)
    if view.content and expected and view.text[: len(expected[0])] != expected[0]:
        # Not the simulator's plain generation (an agent worker, another model): no text oracle.
        v.note("the replica's text is not the simulator's plain generation: the prefix check was skipped")
        return
    want = "".join(expected[:n])
    v.check(
        "client: the delivered text is a prefix of the one generation (no repeated fragment, no 2nd answer)",
        n <= len(expected) and view.text == want,
        f"got {_short(view.text)}, expected {_short(want)}",
    )


def check_preamble(v: Verdict, view: StreamView) -> None:
    """One opening of the answer, whoever served it: a retry's preamble replaces the failed attempt's, it is
    never added to it (a second `response.created` with another id, sequence numbers starting over)."""
    spec = view.spec
    opened = view.preamble_count or 0
    if spec.sequenced:
        numbers = view.sequence_numbers
        gapless = numbers == list(range(len(numbers)))
        v.check(
            "client: one preamble: exactly one response.created, sequence numbers 0, 1, 2, … without a gap "
            "or repeat",
            opened == 1 and gapless,
            f"{_plural(opened, 'response.created')}; sequence numbers {_runs(numbers)}",
        )
    else:
        v.check(
            f"client: one preamble: exactly one {spec.preamble}",
            opened == 1,
            f"{_plural(opened, str(spec.preamble))}",
        )


def _runs(numbers: list[Any]) -> str:
    """0..11, or where the numbers break: [0..5, 0..3]."""
    if not numbers:
        return "none"
    parts: list[str] = []
    start = prev = numbers[0]
    for n in numbers[1:]:
        if isinstance(n, int) and isinstance(prev, int) and n == prev + 1:
            prev = n
            continue
        parts.append(f"{start}..{prev}" if start != prev else f"{start}")
        start = prev = n
    parts.append(f"{start}..{prev}" if start != prev else f"{start}")
    return parts[0] if len(parts) == 1 else f"[{', '.join(parts)}]"


def check_complete(v: Verdict, x: Exchange, *, attempts: int | None) -> StreamView | None:
    """One complete answer ending in the API's clean end, and a journal that says so with `attempts`
    attempts (None: the caller checks them)."""
    if not v.check("client: HTTP 200 with an event stream", x.is_event_stream, _ended(x)):
        return None
    view = read_stream(x)
    spec = x.spec
    kinds = [e.kind for e in view.events if e.kind not in ("comment", "unparseable")]
    v.check(
        f"client: one complete answer: exactly one {spec.end}, last; no error "
        f"{'event' if spec.named_events else 'frame'}; no reset",
        view.done_count == 1
        and bool(kinds)
        and kinds[-1] == "done"
        and not view.frames
        and x.transport_error is None
        and not view.torn_tail,
        _ended(x, view),
    )
    finishes = view.finish_reasons
    v.check(
        "client: the generation finished once, not aborted",
        len(finishes) == 1 and finishes[0] != "abort",
        f"finish reasons {finishes}",
    )
    check_stream_shape(v, x, view)
    if check_record(v, x):
        check_journal(v, x, "completed", "completed", first_delta=True)
        if attempts is not None:
            check_attempts(v, x, attempts)
        j = x.journal or {}
        v.check(
            "journal: delivered_output_tokens equals what the client got",
            j.get("delivered_output_tokens") == view.delivered_tokens,
            f"journal {j.get('delivered_output_tokens')} ({j.get('delivered_output_tokens_source')}), "
            f"client {view.delivered_tokens} ({_plural(len(view.content), 'content event')}, "
            f"usage {view.usage_tokens})",
        )
        check_leases(v, x)
    return view


def check_retried(v: Verdict, x: Exchange) -> None:
    """The first attempt failed before any content; the answer came from a later one. Envoy prefers another
    replica for the retry (previous_hosts), but with only one healthy replica left the same one may serve
    it: a new prefill, not the failed attempt's state. That is noted, not failed."""
    if len(x.attempts) < 2:
        return
    first, last = x.attempts[0], x.attempts[-1]
    v.check(
        "journal: attempt 1 failed before any content; a later attempt served the answer",
        first.get("outcome") == "failed" and last.get("outcome") == "completed",
        _attempts_summary(x),
    )
    if first.get("replica") == last.get("replica"):
        v.note(f"the retry ran on the same replica ({last.get('replica')}): no other was healthy then")


def check_frame(v: Verdict, x: Exchange, view: StreamView) -> None:
    """Exactly one terminal event, the gateway's, last (chat: a frame then [DONE]), in the client's API,
    counting what the client got."""
    spec = x.spec
    frames = view.frames
    last = [_label(e.data, e.name) for e in view.events if e.kind not in ("comment", "unparseable")][-3:]
    if spec.named_events:
        v.check(
            f"client: exactly one terminal event ({spec.terminal}), last; no {spec.end}",
            len(frames) == 1 and view.ends_with_frame_then_done,
            _ended(x, view) + f"; last events {last}",
        )
    else:
        v.check(
            "client: exactly one terminal error frame, then [DONE], last",
            len(frames) == 1 and view.ends_with_frame_then_done and view.done_count == 1,
            _ended(x, view) + f"; last events {last}",
        )
    if not frames:
        return
    frame = frames[-1]
    if spec.sequenced:
        check_failed_continues(v, view)
    elif spec.anthropic:
        kind = frame.get("type")
        v.check(
            "client: the error event has one of Anthropic's error types (its SDK raises by it)",
            kind in apis.ANTHROPIC_ERROR_TYPES,
            f"error.type {kind!r}",
        )
    # Its fields are router-sidecar's documented frame (docs/errors.md); another gateway's is its own.
    what = {"responses": "the response.failed's error", "messages": "the error event"}.get(x.api, "the frame")
    fields_ok = (
        frame.get("code") == INTERRUPTED
        and frame.get("request_id") == x.request_id
        and frame.get("partial_output") is True
        and frame.get("retryable") is False
    )
    if spec.anthropic:
        details = frame.get("details")
        fields_ok = fields_ok and isinstance(details, dict) and details.get("error_code") == INTERRUPTED
    v.check_router_sidecar(
        f"client: {what} says code={INTERRUPTED}"
        + (" (and details.error_code)" if spec.anthropic else "")
        + ", this request_id, partial_output=true, retryable=false",
        fields_ok,
        json.dumps(frame)[:300],
    )
    v.check_router_sidecar(
        f"client: {what}'s delivered_output_tokens equals what the client got"
        if spec.named_events
        else "client: the frame's delivered_output_tokens equals what the client got",
        frame.get("delivered_output_tokens") == view.delivered_tokens,
        f"frame {frame.get('delivered_output_tokens')}, client {view.delivered_tokens} "
        f"({_plural(len(view.content), 'content event')}, usage {view.usage_tokens})",
    )


def check_failed_continues(v: Verdict, view: StreamView) -> None:
    """The Responses API's terminal event continues the stream the client holds: a `response.failed` names
    the response of its `response.created` and takes the next sequence number (the numbering of the whole
    stream is checked with the preamble)."""
    event = view.frame_events[-1]
    data = event.data if isinstance(event.data, dict) else {}
    created = [e.data for e in view.named("response.created") if isinstance(e.data, dict)]
    created_id = (created[0].get("response") or {}).get("id") if created else None
    response = data.get("response") if isinstance(data.get("response"), dict) else None
    earlier = view.events[: view.events.index(event)]
    numbers = [e.data.get("sequence_number") for e in earlier if isinstance(e.data, dict)]
    before = numbers[-1] if numbers else None
    number = data.get("sequence_number")
    same = response is None or response.get("id") == created_id
    v.check(
        "client: the terminal event continues the stream: the response id of response.created, the next "
        "sequence number",
        same and isinstance(number, int) and isinstance(before, int) and number == before + 1,
        f"{apis.event_type(event.name, data)} of {response.get('id') if response else '(no response)'} "
        f"(response.created: {created_id}), sequence_number {number} after {before}",
    )


def _code(error: dict[str, Any]) -> Any:
    return error.get("code") if error.get("code") is not None else error.get("type")


def _label(payload: Any, name: str | None = None) -> str:
    if payload == DONE:
        return DONE
    if name or (isinstance(payload, dict) and isinstance(payload.get("type"), str)):
        kind = apis.event_type(name, payload)
        if kind in ("error", "response.failed") and isinstance(payload, dict):
            error = payload.get("error")
            if not isinstance(error, dict) and isinstance(payload.get("response"), dict):
                error = payload["response"].get("error")
            code = _code(error) if isinstance(error, dict) else payload.get("code")
            return f"{kind}:{code}"
        return kind
    if isinstance(payload, dict) and isinstance(payload.get("error"), dict):
        return f"error:{payload['error'].get('code')}"
    return "chunk"


def _written(x: Exchange) -> int | None:
    """Content events the replica wrote for the attempt that reached the client (simulator log)."""
    serving = x.attempts[-1].get("attempt_id") if x.attempts else None
    for r in x.replica_records:
        if r.get("event") == "end" and r.get("attempt_id") == serving:
            written = r.get("content_events_written")
            return written if isinstance(written, int) else None
    return None


def check_count_bounds(v: Verdict, x: Exchange, view: StreamView, why: str) -> None:
    """Invariant 3 when the client did not read to the end (reset, disconnect): `delivered` is what the
    gateway wrote towards the client, so the journal may exceed what arrived by what was in flight, never
    what the replica wrote: client <= journal <= replica wrote (max_tokens when unknown)."""
    j = x.journal or {}
    count = j.get("delivered_output_tokens")
    written = _written(x)
    bounds = [b for b in (written, x.max_tokens) if isinstance(b, int)]
    upper = min(bounds) if bounds else None
    got = view.delivered_tokens
    ok = isinstance(count, int) and count >= got and (upper is None or count <= upper)
    v.check(
        f"journal: delivered_output_tokens is at least what the client read and at most what the replica "
        f"wrote ({why})",
        ok,
        f"journal {count}, client read {got}, replica wrote {written if written is not None else '?'}"
        f" (max_tokens {x.max_tokens})",
    )


def check_interrupted(
    v: Verdict, x: Exchange, *, allow_reset: bool, content_before_fault: int | None = None
) -> StreamView | None:
    """A prefix of one attempt, then one terminal event (chat: a frame and [DONE]; or, if allowed, a transport
    reset); the journal says interrupted with the count the client got; no second attempt."""
    if not v.check("client: HTTP 200 with an event stream", x.is_event_stream, _ended(x)):
        return None
    view = read_stream(x)
    want = "at least one" if content_before_fault is None else f"exactly {content_before_fault}"
    v.check(
        f"client: a prefix of the answer ({want} content events before the fault)",
        len(view.content) >= 1 if content_before_fault is None else len(view.content) == content_before_fault,
        f"{_plural(len(view.content), 'content event')}",
    )
    reset = x.transport_error is not None and x.disconnected_at is None
    if reset and allow_reset:
        spec = x.spec
        v.check(
            f"client: the stream was cut by a transport reset after the prefix: no {spec.end}, no terminal "
            "event"
            if spec.named_events
            else "client: the stream was cut by a transport reset after the prefix: no [DONE], no frame",
            view.done_count == 0 and not view.frames,
            _ended(x, view),
        )
    else:
        check_frame(v, x, view)
    check_stream_shape(v, x, view)
    if check_record(v, x):
        check_journal(v, x, "interrupted", INTERRUPTED, first_delta=True)
        check_no_attempt_after_first_delta(v, x)
        v.check(
            "client: x-request-id names the request, so a cut stream can be looked up",
            x.response_request_id == x.request_id,
            f"x-request-id {x.response_request_id!r}, sent key {x.request_id!r}",
        )
        if reset and allow_reset:
            check_count_bounds(v, x, view, "a reset drops what was in flight")
        else:
            j = x.journal or {}
            v.check(
                "journal: delivered_output_tokens equals what the client got",
                j.get("delivered_output_tokens") == view.delivered_tokens,
                f"journal {j.get('delivered_output_tokens')}, client {view.delivered_tokens}",
            )
    return view


def check_json_error(v: Verdict, x: Exchange, *, statuses: Iterable[int], code: str | None) -> None:
    """Invariant 8: one JSON error that names the request and why; no SSE bytes, nothing of a replica."""
    allowed = sorted(set(statuses))
    error = x.json_error()
    if not v.router_sidecar:
        # Any gateway owes one JSON error that says why; the status and code are router-sidecar's own.
        v.check(
            "client: one JSON error that says why (an error object with a code or message), HTTP 5xx",
            500 <= x.status < 600 and error is not None and bool(error.get("code") or error.get("message")),
            f"HTTP {x.status} {x.content_type or '(none)'} {_short(x.body)}",
        )
        v.not_applicable(f"client: HTTP {'/'.join(map(str, allowed))}" + (f", code {code}" if code else ""))
    v.check_router_sidecar(
        f"client: one JSON error, HTTP {'/'.join(map(str, allowed))}"
        + (f", code {code}" if code else ", with a code"),
        x.status in allowed
        and error is not None
        and (
            error.get("code") == code if code else isinstance(error.get("code"), str) and error["code"] != ""
        ),
        f"HTTP {x.status} {x.content_type or '(none)'} {_short(x.body)}",
    )
    check_error_shape(v, x, prefix="client", gateways_own=True)
    check_names_request(v, x, error, prefix="client")
    v.check(
        "client: no SSE bytes of any attempt, no replica's raw error in the body",
        b"data:" not in x.body and not any(m in x.body for m in RAW_REPLICA_ERROR_MARKERS),
        _short(x.body),
    )


def check_names_request(v: Verdict, x: Exchange, error: dict[str, Any] | None, *, prefix: str) -> None:
    """Invariant 8: the JSON error's body names the request. The x-request-id header (README: returned on
    every answer) is how a client finds a record when the body cannot say it; when the body does, a missing
    header is noted, not a violation."""
    if not v.router_sidecar:
        v.not_applicable(f"{prefix}: the JSON error names this request (error.request_id)")
        return
    body_ok = error is not None and error.get("request_id") == x.request_id
    v.check(
        f"{prefix}: the JSON error names this request (error.request_id)",
        body_ok,
        f"error.request_id {None if error is None else error.get('request_id')!r}, sent key {x.request_id!r}",
    )
    if body_ok and x.response_request_id != x.request_id:
        v.note(
            f"{prefix}: HTTP {x.status} came without the x-request-id header "
            f"({x.response_request_id or 'absent'}); its body names the request"
        )
    if body_ok and x.spec.anthropic and x.headers.get("request-id") != x.request_id:
        v.note(
            f"{prefix}: HTTP {x.status} came without Anthropic's request-id header "
            f"({x.headers.get('request-id') or 'absent'}); its body names the request"
        )


def check_error_shape(v: Verdict, x: Exchange, *, prefix: str, gateways_own: bool) -> None:
    """An error before any content reaches a client of the Responses or Messages API in that API's shape
    (OpenAI's `{"error": {"message", …}}`; Anthropic's `{"type": "error", "error": {"type", "message"}}`):
    what its SDK parses. Judged for any gateway. The gateway's own Anthropic errors (router-sidecar's) carry
    the type Anthropic's API gives that status. (Chat completions' errors are read as before: an `error`
    object with a code or message.)"""
    spec = x.spec
    if not spec.named_events:
        return
    body = x.json_body()
    wrong = spec.error_shape(body)
    v.check(
        f"{prefix}: the error body is in the {spec.title}'s shape ({spec.shape_name})",
        wrong is None,
        f"HTTP {x.status}: {wrong}: {_short(x.body)}" if wrong else f"HTTP {x.status} {_short(x.body, 120)}",
    )
    if not spec.anthropic or not gateways_own:
        return
    expected = apis.ANTHROPIC_TYPE_BY_STATUS.get(
        x.status, "invalid_request_error" if x.status < 500 else "api_error"
    )
    error = x.json_error() or {}
    v.check_router_sidecar(
        f"{prefix}: error.type is Anthropic's type for HTTP {x.status} ({expected})",
        error.get("type") == expected,
        f"error.type {error.get('type')!r}",
    )


def check_nothing_served(v: Verdict, x: Exchange, *, prefix: str = "journal") -> None:
    """A refused request: either never journaled, or journaled as refused/failed with nothing delivered."""
    if not v.router_sidecar:
        v.not_applicable(f"{prefix}: nothing journaled as served")
        return
    if not x.has_record:
        v.check(
            f"{prefix}: nothing journaled as served",
            x.journal_status == 404,
            f"look-up answered HTTP {x.journal_status} {_short(json.dumps(x.journal) if x.journal else '')}",
        )
        return
    j = x.journal or {}
    served = [a for a in x.attempts if a.get("outcome") in ("released", "completed", "interrupted")]
    v.check(
        f"{prefix}: nothing journaled as served (no content delivered, no attempt released)",
        j.get("phase") in ("rejected", "failed")
        and not j.get("first_delta_sent")
        and j.get("delivered_output_tokens") in (0, None)
        and not served,
        _journal_summary(x) + f"; attempts: {_attempts_summary(x)}",
    )


def check_replica_log(v: Verdict, x: Exchange, ev: Evidence) -> None:
    """Simulated replicas: they served only attempts the journal lists (none behind its back)."""
    if not ev.sim or not v.router_sidecar or not x.replica_records or not x.has_record:
        return
    listed = {a.get("attempt_id") for a in x.attempts}
    served = {r.get("attempt_id") for r in x.replica_records if r.get("event") == "start"}
    v.check(
        "replica log: the replicas served only attempts the journal lists",
        served <= listed,
        f"replica attempts {sorted(map(str, served))}, journal {sorted(map(str, listed))}",
    )


def _ends(x: Exchange) -> list[dict[str, Any]]:
    return [r for r in x.replica_records if r.get("event") == "end"]


def check_hook(v: Verdict, ev: Evidence, action: str) -> HookRun | None:
    runs = [h for h in ev.hooks if h.action == action]
    run = runs[0] if runs else None
    v.check(
        f"hook: the {action} hook ran against the serving replica and succeeded",
        run is not None and run.ok,
        run.describe() if run is not None else f"the {action} hook never ran",
    )
    return run


# --- the scenarios' judges --------------------------------------------------------------------------


def _missing(v: Verdict, label: str) -> Verdict:
    v.check(f"the drill recorded the {label}", False, "nothing was recorded (the scenario did not run)")
    return v


def _judge_of_main(judge: Callable[[Verdict, Exchange, Evidence], None]) -> Judge:
    """The judge of a scenario of one request: `judge` adds its checks of that request (`ev.main`) to a new
    verdict; a scenario that recorded no request fails with one check that says so."""

    @functools.wraps(judge)
    def judge_evidence(ev: Evidence) -> Verdict:
        v = Verdict(router_sidecar=ev.router_sidecar)
        if ev.main is None:
            return _missing(v, "request")
        judge(v, ev.main, ev)
        return v

    return judge_evidence


@_judge_of_main
def judge_healthy(v: Verdict, x: Exchange, ev: Evidence) -> None:
    check_complete(v, x, attempts=1)
    check_replica_log(v, x, ev)


@_judge_of_main
def judge_retried(v: Verdict, x: Exchange, ev: Evidence) -> None:
    """A failure before the first delta: retried invisibly, one complete answer from the second attempt."""
    check_complete(v, x, attempts=2)
    if not v.router_sidecar:
        check_fault_fired_before_content(v, x)
        return
    check_retried(v, x)
    check_replica_log(v, x, ev)
    if ev.sim and x.replica_records:
        first = x.attempts[0].get("attempt_id") if x.attempts else None
        ends = [r for r in _ends(x) if r.get("attempt_id") == first]
        v.check(
            "replica log: the fault fired on attempt 1, before any content event was written",
            bool(ends) and all(r.get("faults_fired") and r.get("content_events_written") == 0 for r in ends),
            "attempt 1's replica record: "
            + str([(r.get("outcome"), r.get("faults_fired"), r.get("content_events_written")) for r in ends]),
        )


def check_fault_fired_before_content(v: Verdict, x: Exchange) -> None:
    """Behind a gateway without a journal, only the simulator's own log shows that the fault took effect:
    one attempt failed before any content, and another wrote the answer. A fault scoped to attempt 1 fires
    only where the gateway numbers its attempts (x-envoy-attempt-count); an answer without it proves
    nothing."""
    if not x.replica_records:
        v.inconclusive = (
            "behind this gateway nothing shows whether the simulator's fault fired: give the replicas' logs "
            "(--replica-log; the simulator logs each request's Idempotency-Key when the gateway passes it on)"
        )
        return
    ends = _ends(x)
    fired = [r for r in ends if r.get("faults_fired")]
    if not fired:
        v.inconclusive = (
            "the simulator's fault never fired: it is scoped to attempt 1, which the simulator tells by "
            "x-envoy-attempt-count, and this gateway does not send that header"
        )
        return
    served = [r for r in ends if not r.get("faults_fired") and r.get("outcome") == "completed"]
    v.check(
        "replica log: the fault fired on an attempt before any content; another attempt wrote the answer",
        all(r.get("content_events_written") == 0 for r in fired) and len(served) == 1,
        "replica records: "
        + str(
            [
                (r.get("replica"), r.get("outcome"), r.get("faults_fired"), r.get("content_events_written"))
                for r in ends
            ]
        ),
    )


@_judge_of_main
def judge_death_after_first_delta(v: Verdict, x: Exchange, ev: Evidence) -> None:
    """The replica dies after the first delta: the prefix, then a reset or one terminal frame; no retry."""
    if not ev.sim:
        kill = check_hook(v, ev, "kill")
        view = read_stream(x) if x.is_event_stream else None
        first = view.first_content_at() if view is not None else None
        completed = view is not None and view.done_count == 1 and not view.frames and not x.transport_error
        v.check(
            "hook: the kill landed after the first delta, while the stream was still running",
            kill is not None and first is not None and kill.started_at >= first and not completed,
            f"first content at {first}, kill at {kill.started_at if kill else None}; the client got "
            f"{_ended(x, view)}"
            + ("; the answer had completed: use a longer answer (--long-tokens)" if completed else ""),
        )
    check_interrupted(v, x, allow_reset=True, content_before_fault=ev.expect.get("content_before_fault"))
    check_replica_log(v, x, ev)


@_judge_of_main
def judge_frame_after_first_delta(v: Verdict, x: Exchange, ev: Evidence) -> None:
    """The upstream ends wrongly after the first delta (a clean end without the API's end, an in-band error):
    the prefix, then exactly one terminal event; the replica's own error never reaches the client. Where the
    API's replica writes no error event but cuts its body (vLLM's Responses route), `expect["allow_reset"]`
    says why a reset is then honest: the verdict is a replica death's."""
    why_reset = ev.expect.get("allow_reset")
    if why_reset and x.transport_error is not None and x.disconnected_at is None:
        v.note(f"a reset, not a terminal event: {why_reset}")
    check_interrupted(
        v, x, allow_reset=bool(why_reset), content_before_fault=ev.expect.get("content_before_fault")
    )
    check_replica_log(v, x, ev)


@_judge_of_main
def judge_frozen_after_first_delta(v: Verdict, x: Exchange, ev: Evidence) -> None:
    """The serving replica freezes after the first delta (alive, silent): the gateway loses it and ends the
    stream with one terminal frame within a bounded time; the journal says why."""
    freeze = check_hook(v, ev, "freeze")
    check_interrupted(v, x, allow_reset=False)
    names = _trace_names(x)
    v.check(
        "journal: the trace says the replica was lost (replica_lost)",
        "replica_lost" in names,
        f"trace {names}",
    )
    if freeze is not None and x.ended_at is not None:
        bound = float(ev.expect.get("end_within_seconds", 0) or 0)
        took = x.ended_at - freeze.ended_at
        v.check(
            f"client: the stream ended within {bound:g}s of the freeze"
            if bound
            else "client: the stream ended after the freeze",
            took <= bound if bound else True,
            f"ended {took:.2f}s after the freeze",
        )


@_judge_of_main
def judge_frozen_in_prefill(v: Verdict, x: Exchange, ev: Evidence) -> None:
    """The replica holding the request freezes before any content: lost, fenced (proof: cancel ack or lease
    expiry), and only then retried elsewhere; one complete answer."""
    freeze = check_hook(v, ev, "freeze")
    check_complete(v, x, attempts=2)
    check_retried(v, x)
    if freeze is not None and x.attempts:
        v.check(
            "hook: the frozen replica is the one that held attempt 1",
            freeze.replica == x.attempts[0].get("replica"),
            f"froze {freeze.replica}, attempt 1 on {x.attempts[0].get('replica')}",
        )
    lost = [e for e in x.trace if e.get("event") == "replica_lost" and e.get("attempt") == 1]
    fenced = [e for e in x.trace if e.get("event") == "attempt_fenced" and e.get("attempt") == 1]
    started = [e for e in x.trace if e.get("event") == "attempt_started" and e.get("attempt") == 2]
    ordered = bool(lost and fenced and started) and float(lost[0].get("t") or 0) <= float(
        fenced[0].get("t") or 0
    ) <= float(started[0].get("t") or 0)
    proof = fenced[0].get("proof") if fenced else None
    v.check(
        "journal: attempt 1 was lost, then fenced with a proof, before attempt 2 started",
        ordered and proof in ("cancel_ack", "lease_expiry", "connection_closed"),
        f"replica_lost {[e.get('t') for e in lost]}, attempt_fenced "
        f"{[(e.get('t'), e.get('proof'), e.get('waited_ms')) for e in fenced]}, attempt 2 started "
        f"{[e.get('t') for e in started]}",
    )


@_judge_of_main
def judge_client_disconnect(v: Verdict, x: Exchange, ev: Evidence) -> None:
    """The client leaves mid-stream: the attempt is cancelled (the replica sees it go) and no other starts."""
    if not v.check("client: HTTP 200 with an event stream", x.is_event_stream, _ended(x)):
        return
    view = read_stream(x)
    v.check(
        f"client: it left mid-stream, after content and before {x.spec.end}",
        x.disconnected_at is not None and len(view.content) >= 1 and view.done_count == 0,
        _ended(x, view),
    )
    check_stream_shape(v, x, view)
    left = x.disconnected_at or x.ended_at or 0.0
    if check_record(v, x):
        j = x.journal or {}
        v.check(
            "journal: phase=cancelled outcome=client_disconnected",
            (j.get("phase"), j.get("outcome")) == ("cancelled", "client_disconnected"),
            _journal_summary(x),
        )
        check_attempts(v, x, 1)
        late = [e for e in x.trace if e.get("event") == "attempt_started" and float(e.get("t") or 0) > left]
        v.check(
            "journal: no attempt started after the client left",
            not late,
            f"{len(late)} attempt(s) started after {left:.3f}: {late}" if late else "none",
        )
        check_count_bounds(v, x, view, "what was in flight when the client left was never read")
    if ev.sim and not v.router_sidecar:
        # The replicas' logs name requests by the id the gateway sends them (router-sidecar's x-request-id).
        v.not_applicable("replica log: the replica saw the client go, and no other request began")
    elif ev.sim:
        if not x.replica_records:
            v.note("no replica log given (--replica-log): the replica-side cancel was not checked")
            return
        starts = [r for r in x.replica_records if r.get("event") == "start"]
        gone = [r for r in _ends(x) if r.get("client_gone_at") is not None]
        v.check(
            "replica log: exactly one replica request for this id, and it saw the client go (cancelled)",
            len(starts) == 1 and len(gone) == 1,
            f"{_plural(len(starts), 'replica request')}; ends: "
            f"{[(r.get('replica'), r.get('outcome'), r.get('client_gone_at')) for r in _ends(x)]}",
        )
        late_starts = [r for r in starts if float(r.get("t_start") or 0) > left]
        v.check(
            "replica log: no replica request began after the client left",
            not late_starts,
            f"{len(late_starts)} began after {left:.3f}" if late_starts else "none",
        )


@_judge_of_main
def judge_slow_replica(v: Verdict, x: Exchange, ev: Evidence) -> None:
    """A slow prefill is not a failure: one attempt, one complete answer, late; no retry, no fence."""
    view = check_complete(v, x, attempts=1)
    names = _trace_names(x)
    v.check_router_sidecar(
        "journal: no failover for slowness (no attempt_failed, retry_triggered, replica_lost or fence)",
        not (set(names) & FAILOVER_EVENTS),
        f"trace {names}" if names else "no trace (a clean completion keeps its summary only)",
    )
    slow = float(ev.expect.get("min_first_content_seconds", 0) or 0)
    if slow and view is not None:
        first = view.first_content_at()
        waited = (first - x.sent_at) if first is not None else None
        v.check(
            f"client: the first content came after the replica's {slow:g}s delay (the slowness was real)",
            waited is not None and waited >= slow,
            f"first content {waited:.2f}s after the request" if waited is not None else "no content",
        )
    check_replica_log(v, x, ev)


@_judge_of_main
def judge_all_replicas_fail(v: Verdict, x: Exchange, ev: Evidence) -> None:
    """Every attempt fails before content: one JSON error naming the request; nothing of a dead attempt."""
    check_json_error(v, x, statuses=(502, 503), code=ev.expect.get("code", "retries_exhausted"))
    if check_record(v, x):
        check_journal(v, x, "failed", ev.expect.get("code", "retries_exhausted"), first_delta=False)
        j = x.journal or {}
        v.check(
            "journal: every attempt failed, nothing delivered",
            len(x.attempts) >= 2
            and all(a.get("outcome") == "failed" for a in x.attempts)
            and j.get("delivered_output_tokens") == 0,
            f"{_attempts_summary(x)}; delivered_output_tokens={j.get('delivered_output_tokens')}",
        )
        check_leases(v, x)
    check_replica_log(v, x, ev)


@_judge_of_main
def judge_fallback(v: Verdict, x: Exchange, ev: Evidence) -> None:
    """Every replica of the requested model fails before content; the fallback model answers: one complete
    answer that is the fallback's own (every event names its model; its usage), said out loud (the
    `x-router-fallback` header, the journal's `fallback` record and its `answered_by_fallback` event)."""
    fallback, requested = str(ev.expect["fallback_model"]), str(ev.expect["requested_model"])
    view = check_complete(v, x, attempts=None)
    if view is not None:
        v.check(
            f"client: the answer is the fallback model's own: its events name {fallback}, none {requested}",
            view.models == {fallback},
            f"the events name {sorted(view.models) or 'no model'}",
        )
        v.check(
            "client: the answer carries its usage (the fallback's output tokens)",
            bool(view.usage_tokens),
            f"usage: {view.usage_tokens} output tokens, {_plural(len(view.content), 'content event')}",
        )
    header = x.headers.get("x-router-fallback")
    v.check_router_sidecar(
        f"client: x-router-fallback names the model that answered ({fallback})",
        header == fallback,
        f"x-router-fallback: {header or '(absent)'}",
    )
    record = (x.journal or {}).get("fallback") if x.has_record else None
    if view is not None:
        v.note(
            f"answered by {fallback} for {requested}: x-router-fallback: {header or '(absent)'}; the events "
            f"name {', '.join(sorted(view.models)) or 'no model'}; usage {view.usage_tokens} output tokens; "
            f"journal fallback: {json.dumps(record) if record is not None else '(none)'}"
        )
    if v.router_sidecar and x.has_record:
        check_fallback_journal(v, x, ev, fallback, requested)
    if ev.sim and x.replica_records:
        ends = _ends(x)
        own = [r for r in ends if r.get("model") == requested]
        answers = [r for r in ends if r.get("model") == fallback]
        v.check(
            f"replica log: every attempt on a replica of {requested} failed before any content; one on a "
            f"replica of {fallback} wrote the answer",
            bool(own)
            and all(r.get("faults_fired") and r.get("content_events_written") == 0 for r in own)
            and [(r.get("outcome"), r.get("faults_fired")) for r in answers] == [("completed", [])]
            and len(own) + len(answers) == len(ends),
            "replica records: "
            + str(
                [
                    (r.get("replica"), r.get("model"), r.get("outcome"), r.get("content_events_written"))
                    for r in ends
                ]
            ),
        )
    check_replica_log(v, x, ev)


def check_fallback_journal(v: Verdict, x: Exchange, ev: Evidence, fallback: str, requested: str) -> None:
    """The journal's account of a fallback: the requested model's attempts failed, then one attempt chosen as
    the fallback completed; the `fallback` record names both models and one cause per failed attempt; one
    `answered_by_fallback` event (its cause), after the last failure; `x-router-attempts` counts them all."""
    attempts = x.attempts
    own, last = attempts[:-1], attempts[-1] if attempts else {}
    v.check(
        f"journal: every attempt on {requested} failed before content, then one chosen as its fallback "
        f"to {fallback} completed",
        bool(own)
        and all(a.get("outcome") == "failed" for a in own)
        and not any(str(a.get("chosen_by")).startswith("fallback") for a in own)
        and last.get("outcome") == "completed"
        and str(last.get("chosen_by")).startswith(f"fallback to model {fallback},"),
        "; ".join(f"#{a.get('attempt')} {a.get('outcome')} ({a.get('chosen_by')})" for a in attempts),
    )
    record = (x.journal or {}).get("fallback")
    causes = record.get("causes") if isinstance(record, dict) else None
    v.check(
        f"journal: its fallback record names {fallback} for {requested}, with one cause per failed attempt",
        isinstance(record, dict)
        and (record.get("model"), record.get("requested_model")) == (fallback, requested)
        and isinstance(causes, list)
        and len(causes) == len(own)
        and all(
            str(c).startswith(f"attempt {a.get('attempt')} on {a.get('replica')}: ")
            for c, a in zip(causes, own, strict=False)
        ),
        f"fallback: {json.dumps(record)}",
    )
    names = _trace_names(x)
    events = [e for e in x.trace if e.get("event") == "answered_by_fallback"]
    cause = ev.expect.get("cause", "failed_before_content")
    failures = [i for i, name in enumerate(names) if name == "attempt_failed"]
    v.check(
        f"journal: one answered_by_fallback event ({fallback} for {requested}, cause {cause}), after the "
        "last failed attempt",
        len(events) == 1
        and (events[0].get("model"), events[0].get("requested_model"), events[0].get("reason"))
        == (fallback, requested, cause)
        and bool(failures)
        and names.index("answered_by_fallback") > failures[-1],
        f"answered_by_fallback: {json.dumps(events)}; trace {names}",
    )
    counted = x.headers.get("x-router-attempts")
    v.check(
        "client: x-router-attempts counts every attempt the journal lists",
        counted == str(len(attempts)),
        f"x-router-attempts: {counted}, journal {_plural(len(attempts), 'attempt')}",
    )


def judge_duplicate_key(ev: Evidence) -> Verdict:
    """Two requests with one Idempotency-Key: one is served; the other is refused with 409 (in flight while
    the first runs, already finished after it); nothing of it reaches the client, and an attempt of it that
    reached a replica (the claim runs beside the first attempt) is cancelled there."""
    v = Verdict(router_sidecar=ev.router_sidecar)
    first, dup, after = ev.get("the first request"), ev.get("the duplicate"), ev.get("after completion")
    if first is None or dup is None or after is None:
        return _missing(v, "three requests")
    view = check_complete(v, first, attempts=1)
    # The duplicate must be refused as in flight if its answer came while the first was still running.
    in_flight = dup.ended_at is not None and first.ended_at is not None and dup.ended_at < first.ended_at
    codes = (
        ("idempotency_key_in_flight",)
        if in_flight
        else ("idempotency_key_in_flight", "request_already_finished")
    )
    error = dup.json_error() or {}
    v.check(
        "duplicate: 409 "
        + " or ".join(codes)
        + " naming the same request id"
        + (" (sent while the first was streaming)" if in_flight else ""),
        dup.status == 409 and error.get("code") in codes and error.get("request_id") == first.request_id,
        f"HTTP {dup.status} {_short(dup.body)}",
    )
    error = after.json_error() or {}
    v.check(
        "after completion: 409 request_already_finished naming the request, outcome completed",
        after.status == 409
        and error.get("code") == "request_already_finished"
        and error.get("request_id") == first.request_id
        and error.get("outcome") == "completed",
        f"HTTP {after.status} {_short(after.body)}",
    )
    for x in (dup, after):
        v.check(
            f"{x.label}: no SSE bytes (nothing of the first request's answer)",
            b"data:" not in x.body,
            _short(x.body),
        )
        check_error_shape(v, x, prefix=x.label, gateways_own=True)
    if first.has_record and view is not None:
        check_attempts(v, first, 1)
    if ev.sim and first.replica_records:
        ends = [r for r in first.replica_records if r.get("event") == "end"]
        generated = [r for r in ends if r.get("client_gone_at") is None]
        v.check(
            "replica log: one replica request generated the answer (a duplicate's attempt that reached a "
            "replica, while its claim ran, was cancelled there)",
            len(generated) == 1,
            f"{_plural(len(generated), 'replica request')} not cancelled, of {len(ends)}",
        )
    return v


def judge_malformed_input(ev: Evidence) -> Verdict:
    """Bad input gets a clear 4xx JSON error naming the request before any attempt; nothing is served."""
    v = Verdict(router_sidecar=ev.router_sidecar)
    if not ev.exchanges:
        return _missing(v, "requests")
    for x in ev.exchanges:
        # The exact codes are router-sidecar's (docs/errors.md); any gateway owes a 4xx JSON error saying why.
        code = ev.expect.get("codes", {}).get(x.label) if v.router_sidecar else None
        error = x.json_error()
        if not v.router_sidecar and x.label == "oversize body":
            v.not_applicable(f"{x.label}: a 4xx JSON error (the body limit is router-sidecar's own)")
            continue
        if code is None and 200 <= x.status < 300:
            # An engine that serves whatever model name it is asked for (SGLang ignores the field): with
            # static replicas the gateway cannot know the served models (with discovery it pins requests by
            # model and refuses an unknown one itself, 404 model_not_found). Nothing to hold against it.
            v.check_router_sidecar(
                f"{x.label}: x-request-id names the request",
                x.response_request_id == x.request_id,
                f"x-request-id {x.response_request_id!r}, sent key {x.request_id!r}",
            )
            v.note(
                f"{x.label}: HTTP {x.status}: the replica served a model name it was never given (an engine "
                "that ignores the field, e.g. SGLang); static replicas leave the model to the engine"
            )
            continue
        v.check(
            f"{x.label}: a 4xx JSON error" + (f" with code {code}" if code else " that says why"),
            400 <= x.status < 500
            and error is not None
            and (error.get("code") == code if code else bool(error.get("message") or error.get("code"))),
            f"HTTP {x.status} {x.content_type or '(none)'} {_short(x.body)}",
        )
        v.check(
            f"{x.label}: no SSE bytes, no replica's raw 5xx error",
            b"data:" not in x.body and not any(m in x.body for m in RAW_REPLICA_ERROR_MARKERS),
            _short(x.body),
        )
        # The gateway's own refusals (its codes, or a body naming the request) carry its Anthropic type; a
        # replica's own error passed through is judged on its shape only.
        own = code is not None or (error is not None and error.get("request_id") is not None)
        check_error_shape(v, x, prefix=x.label, gateways_own=own)
        # The gateway's own refusals name the request in the body. With static replicas the gateway does not
        # know the served models: an unknown model is the replica's own 4xx, passed through; it names the
        # request only in x-request-id. The scenario's promise (a clear 4xx JSON error, nothing served) holds;
        # the stricter reading of invariant 8 (the body names the request) is noted.
        if not v.router_sidecar:
            v.not_applicable(f"{x.label}: the error names the request (error.request_id or x-request-id)")
        elif code is not None or (error is not None and error.get("request_id") is not None):
            check_names_request(v, x, error, prefix=x.label)
        else:
            v.check(
                f"{x.label}: x-request-id names the request",
                x.response_request_id == x.request_id,
                f"x-request-id {x.response_request_id!r}, sent key {x.request_id!r}",
            )
            v.note(
                f"{x.label}: HTTP {x.status} is the replica's own error, passed through; its body does not "
                "name the request (only x-request-id does)"
            )
        check_nothing_served(v, x, prefix=f"{x.label}: journal")
    return v


def judge_tool_replay(ev: Evidence) -> Verdict:
    """A tool call with a key executes once: the same call again gets the stored answer, marked as a replay;
    the same key on another call is refused (422 idempotency_key_reused)."""
    v = Verdict(router_sidecar=ev.router_sidecar)
    call, replay, other = ev.get("the call"), ev.get("the same call again"), ev.get("another body, same key")
    if call is None or replay is None or other is None:
        return _missing(v, "three tool calls")
    v.check(
        "the call: answered 2xx, not marked as a replay",
        200 <= call.status < 300 and call.headers.get("x-idempotent-replay") != "true",
        f"HTTP {call.status}, x-idempotent-replay {call.headers.get('x-idempotent-replay')!r} "
        f"{_short(call.body)}",
    )
    v.check(
        "the same call again: the stored answer (same status and bytes) with x-idempotent-replay: true",
        replay.status == call.status
        and replay.body == call.body
        and replay.headers.get("x-idempotent-replay") == "true",
        f"HTTP {replay.status}, x-idempotent-replay {replay.headers.get('x-idempotent-replay')!r}, "
        f"body {'identical' if replay.body == call.body else _short(replay.body)}",
    )
    error = other.json_error() or {}
    v.check(
        "another body with the same key: 422 idempotency_key_reused, not executed, not the stored answer",
        other.status == 422
        and error.get("code") == "idempotency_key_reused"
        and other.headers.get("x-idempotent-replay") != "true",
        f"HTTP {other.status} {_short(other.body)}",
    )
    return v
