"""A journal record as a timeline: what happened to one logical request, readable and for machines (sans-IO).

`router-sidecar trace` fetches the record; everything here only renders it. Times are relative to admission
(the `request_accepted` event), the request and each attempt get their own column so attempts read side by
side, and the attempts' lease stamps and fence proof are folded in as rows of their attempt.

The record comes from a gateway (or a file) we do not control: every field may be missing, of the wrong
type or absurd, and rendering must still work. Only an input that is not a JSON object is refused.
"""

from __future__ import annotations

import datetime
import json
import math
import textwrap
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from router_sidecar.core.events import EventName, Outcome

__all__ = ["Row", "Timeline", "as_json", "outcome_sentence", "render_text", "timeline"]

REQUEST_COLUMN = 0  # the request's column; attempt n is column n
DEFAULT_WIDTH = 110
_MIN_COLUMN = 18  # narrower than this, columns become unreadable: attempts are stacked with a label instead
_MAX_CELL_LINES = 3  # a long detail wraps this far, then is cut
_MAX_ROWS = 2000  # a hostile trace must not print forever; --json still has every event
_MAX_TEXT = 300  # one field's text before it is cut
_MAX_DEPTH = 16  # nesting kept by as_json before junk is summarised

# Tones for colour: what went wrong stands out, lease bookkeeping recedes.
_BAD = "bad"
_WARN = "warn"
_GOOD = "good"
_DIM = "dim"
_ANSI = {_BAD: "31", _WARN: "33", _GOOD: "32", _DIM: "2", "bold": "1"}


@dataclass(frozen=True, slots=True)
class Row:
    t_ms: float | None  # relative to admission; None when the entry has no usable time
    column: int  # REQUEST_COLUMN, or the attempt's number
    text: str
    kind: str = "event"  # "event", "lease", "fence" or "marker" (the journal dropped events here)
    tone: str = ""


@dataclass(frozen=True, slots=True)
class Timeline:
    admitted_at: float | None  # wall clock (s) of admission (its event), None when the trace has none
    zero_at: float | None  # what every row's t_ms counts from: admission, else the earliest stamp known
    columns: tuple[int, ...]  # attempt numbers with a column, in order
    rows: tuple[Row, ...]  # in time order
    trace_omitted: str | None = None  # the journal kept no trace (a clean completion): why
    unreadable: int = 0  # trace entries that were not objects, skipped


# --- reading odd values safely ---------------------------------------------------------------------------


def _number(value: Any) -> float | None:
    """A finite number, or None (bools, strings, NaN and infinities are not times or counts)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    try:
        number = float(value)
    except OverflowError:
        return None
    return number if math.isfinite(number) else None


_MAX_ATTEMPT = 10**6  # far above any retry budget; bigger is junk, read as no attempt number


def _attempt_number(value: Any) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= _MAX_ATTEMPT:
        return None
    return value


def _clean(value: Any, limit: int = _MAX_TEXT) -> str:
    """Text safe for a terminal: control characters escaped (a record must not drive the terminal), cut."""
    if isinstance(value, str):
        text = value
    elif isinstance(value, bool):
        text = "yes" if value else "no"
    elif value is None:
        text = "-"
    elif isinstance(value, int | float):
        text = _format_number(value)
    else:
        try:
            text = json.dumps(_plain(value), separators=(",", ":"), ensure_ascii=False)
        except (TypeError, ValueError):
            text = type(value).__name__
    if len(text) > limit * 4:
        text = text[: limit * 4]
    out = "".join(ch if ch.isprintable() else " " if ch in "\t\n\r" else _escape(ch) for ch in text)
    return out if len(out) <= limit else out[: limit - 1] + "…"


def _escape(ch: str) -> str:
    return f"\\x{ord(ch):02x}" if ord(ch) < 256 else "?"


def _format_number(value: int | float) -> str:
    if isinstance(value, int) and abs(value) >= 10**15:
        # Python refuses to print (or float) an int of thousands of digits: its size is what matters.
        return f"{value:.3g}" if value.bit_length() < 1000 else "(a huge number)"
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value)


def _get(mapping: Any, key: str) -> Any:
    return mapping.get(key) if isinstance(mapping, Mapping) else None


def _mappings(value: Any) -> list[Mapping[str, Any]]:
    return [item for item in value if isinstance(item, Mapping)] if isinstance(value, list) else []


def _plain(value: Any, depth: int = 0) -> Any:
    """`value` as plain JSON (str keys, finite numbers): what json.dumps can always write."""
    if depth > _MAX_DEPTH:
        return "…"
    if value is None or isinstance(value, bool | str):
        return value
    if isinstance(value, int):
        return value if value.bit_length() <= 64 else _format_number(value)  # JSON readers lose more
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {str(k): _plain(v, depth + 1) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v, depth + 1) for v in value]
    return str(value)


def _tokens(value: Any) -> str:
    number = _number(value)
    if number is None:
        return "?"
    return _format_number(int(number) if number.is_integer() else number)


def _plural(count: int, word: str) -> str:
    return f"{count} {word}" if count == 1 else f"{count} {word}s"


# --- the events in words --------------------------------------------------------------------------------


def _event_name(event: Mapping[str, Any]) -> str:
    name = event.get("event")
    return _clean(name, 60) if isinstance(name, str) and name else "(unnamed event)"


def _extras(event: Mapping[str, Any], skip: Iterable[str] = ()) -> str:
    """An unknown event's fields, briefly: the name alone would hide what it says."""
    skipped = {"t", "event", "attempt", "attempt_id", *skip}
    parts = [f"{_clean(k, 30)}={_clean(v, 40)}" for k, v in event.items() if k not in skipped]
    return ", ".join(parts[:6]) + (", …" if len(parts) > 6 else "")


def _describe(event: Mapping[str, Any]) -> tuple[str, str]:
    """The event in words, and its tone."""
    name = event.get("event")
    g = event.get
    delivered = f"{_tokens(g('delivered_output_tokens'))} output tokens delivered"
    match name:
        case EventName.REQUEST_ACCEPTED:
            parts = [f"accepted {_clean(g('route'), 40)}" if g("route") is not None else "accepted"]
            if g("model") is not None:
                parts.append(f"model {_clean(g('model'), 60)}")
            if isinstance(g("stream"), bool):
                parts.append("stream" if g("stream") else "not streamed")
            if _number(g("estimated_prompt_tokens")) is not None:
                parts.append(f"~{_tokens(g('estimated_prompt_tokens'))} prompt tokens")
            if g("retry_allowed") is False:
                parts.append("no retry allowed")
            return ", ".join(parts), ""
        case EventName.REQUEST_REJECTED:
            why = g("reason") or g("code") or g("detail") or _extras(event)
            return f"rejected: {_clean(why)}", _BAD
        case EventName.ATTEMPT_STARTED:
            return f"started on {_clean(g('replica'), 80)}", ""
        case EventName.ATTEMPT_FAILED:
            text = f"failed: {_clean(g('reason'), 60)}"
            if g("detail"):
                text += f" ({_clean(g('detail'))})"
            return text, _BAD
        case EventName.REPLICA_LOST:
            return f"replica lost: {_clean(g('cause'), 80)}", _BAD
        case EventName.ATTEMPT_FENCED:
            return _fence_text(g("proof"), g("waited_ms")), _WARN
        case EventName.RETRY_TRIGGERED:
            return f"retry triggered: {_clean(g('reason'), 80)}", _WARN
        case EventName.RETRY_REFUSED:
            return f"retry refused: {_clean(g('reason'), 80)}", _BAD
        case EventName.FIRST_DELTA_SENT:
            return "first delta sent to the client", _GOOD
        case EventName.RESPONSE_PASSED_THROUGH:
            return f"response passed through (status {_clean(g('status'), 10)})", ""
        case EventName.RESPONSE_REPLACED:
            flags = g("response_flags")
            flags_text = ",".join(_clean(f, 10) for f in flags[:10]) if isinstance(flags, list) else "-"
            text = f"Envoy's own answer replaced: status {_clean(g('status'), 10)}, flags {flags_text or '-'}"
            if g("details"):
                text += f", {_clean(g('details'))}"
            return text, _BAD
        case EventName.STREAM_COMPLETED:
            return f"stream completed: {delivered}", _GOOD
        case EventName.STREAM_TERMINATED:
            return f"terminal error frame: {_clean(g('reason'))} ({delivered})", _BAD
        case EventName.STREAM_RESET:
            return f"stream reset: {_clean(g('cause'), 60)} ({delivered})", _BAD
        case EventName.CLIENT_DISCONNECTED:
            return f"client disconnected ({delivered})", _WARN
        case EventName.REQUEST_FAILED:
            return f"request failed: {_clean(g('outcome'), 60)}", _BAD
        case EventName.GATEWAY_LOST:
            return (
                f"gateway lost: {_clean(g('owner'), 80)}, record closed by {_clean(g('closed_by'), 80)} "
                f"({delivered})",
                _BAD,
            )
        case "headers_held":  # the replica answered: its headers wait for the first delta
            return f"headers held (status {_clean(g('status'), 10)})", ""
        case "events_dropped":
            return f"… {_tokens(g('count'))} events dropped from the journal's trace here …", _DIM
    if isinstance(name, str) and name.startswith("tool_call_"):
        return _tool_call_text(event), _BAD if name == EventName.TOOL_CALL_OUTCOME_UNKNOWN else ""
    extras = _extras(event)
    return _event_name(event) + (f": {extras}" if extras else ""), ""


def _tool_call_text(event: Mapping[str, Any]) -> str:
    what = _event_name(event).removeprefix("tool_call_").replace("_", " ")
    text = f"tool call {_clean(event.get('key'), 60)}: {what}"
    extras = _extras(event, skip=("key",))
    return text + (f" ({extras})" if extras else "")


def _fence_text(proof: Any, waited_ms: Any) -> str:
    if proof is None:
        return "fence unprovable: no proof it stopped publishing"
    waited = _number(waited_ms)
    return f"fenced by {_clean(proof, 40)}" + (f" after {waited:.1f} ms" if waited is not None else "")


# --- the timeline ---------------------------------------------------------------------------------------


def _require_object(record: Any) -> Mapping[str, Any]:
    if not isinstance(record, Mapping):
        raise ValueError(f"a journal record is a JSON object, not {type(record).__name__}")
    return record


def _admission(events: list[Mapping[str, Any]]) -> float | None:
    for event in events:
        if event.get("event") == EventName.REQUEST_ACCEPTED and _number(event.get("t")) is not None:
            return _number(event.get("t"))
    return None


def _earliest(events: list[Mapping[str, Any]], attempts: list[Mapping[str, Any]]) -> float | None:
    stamps = [_number(e.get("t")) for e in events]
    stamps += [_number(_get(a.get("lease"), "granted_at")) for a in attempts]
    known = [s for s in stamps if s is not None]
    return min(known) if known else None


def _relative_ms(t: float | None, zero: float | None) -> float | None:
    if t is None or zero is None:
        return None
    ms = (t - zero) * 1000.0
    return ms if math.isfinite(ms) else None


def _attempts_by_number(record: Mapping[str, Any]) -> dict[int, Mapping[str, Any]]:
    by_number: dict[int, Mapping[str, Any]] = {}
    for position, attempt in enumerate(_mappings(record.get("attempts")), start=1):
        number = _attempt_number(attempt.get("attempt")) or position
        by_number.setdefault(number, attempt)
    return by_number


def timeline(record: Any) -> Timeline:
    """The record's events, lease stamps and fence proofs as rows in time order, one column per attempt."""
    record = _require_object(record)
    raw_events = record.get("events")
    raw_events = raw_events if isinstance(raw_events, list) else []
    events = [e for e in raw_events if isinstance(e, Mapping)]
    attempts = _attempts_by_number(record)
    admitted = _admission(events)
    # No admission event (trace omitted or trimmed): times count from the earliest stamp instead.
    zero = admitted if admitted is not None else _earliest(events, list(attempts.values()))

    # (sort time, source rank, index, row): the journal's order is kept among equal or unknown times
    entries: list[tuple[float, int, int, Row]] = []
    last_t = -math.inf
    fenced_by_event: set[int] = set()
    columns: set[int] = set(attempts)
    for index, event in enumerate(events):
        t = _number(event.get("t"))
        # An entry without a usable time stays where the journal put it (after the one before it).
        sort_t = t if t is not None else last_t
        last_t = sort_t
        number = _attempt_number(event.get("attempt"))
        column = number if number is not None else REQUEST_COLUMN
        if number is not None:
            columns.add(number)
        if event.get("event") == EventName.ATTEMPT_FENCED and number is not None:
            fenced_by_event.add(number)
        text, tone = _describe(event)
        kind = "marker" if event.get("event") == "events_dropped" else "event"
        entries.append((sort_t, 0, index, Row(_relative_ms(t, zero), column, text, kind, tone)))

    for number, attempt in attempts.items():
        lease = attempt.get("lease")
        lease = lease if isinstance(lease, Mapping) else {}
        ttl = _number(lease.get("ttl_seconds"))
        for key, text in (
            ("granted_at", "lease granted" + (f" (ttl {_format_number(ttl)} s)" if ttl is not None else "")),
            ("stopped_at", "lease stopped"),
            ("revoked_at", "lease revoked"),
        ):
            stamp = _number(lease.get(key))
            if stamp is not None:
                row = Row(_relative_ms(stamp, zero), number, text, "lease", _DIM)
                entries.append((stamp, 1, len(entries), row))
        fence = attempt.get("fence")
        if isinstance(fence, Mapping) and number not in fenced_by_event:
            # No fence event in the trace (omitted or trimmed): the proof is shown where the lease ended.
            stamp = _number(lease.get("revoked_at")) or _number(lease.get("stopped_at"))
            row = Row(
                _relative_ms(stamp, zero),
                number,
                _fence_text(fence.get("proof"), fence.get("waited_ms")),
                "fence",
                _WARN,
            )
            entries.append((stamp if stamp is not None else math.inf, 2, len(entries), row))

    entries.sort(key=lambda entry: entry[:3])
    return Timeline(
        admitted_at=admitted,
        zero_at=zero,
        columns=tuple(sorted(columns)),
        rows=tuple(entry[3] for entry in entries),
        trace_omitted=_clean(record.get("trace")) if record.get("trace") is not None else None,
        unreadable=len(raw_events) - len(events),
    )


# --- the outcome in one sentence ------------------------------------------------------------------------

_FAILED_BECAUSE = {
    Outcome.RETRY_NOT_ALLOWED: "a retry was not allowed",
    Outcome.RETRY_BUDGET_EXHAUSTED: "Envoy's cluster retry budget refused the retry",
    Outcome.FENCE_UNPROVABLE: "a failed attempt could not be proven fenced, so no retry was started",
    Outcome.NO_COMPATIBLE_REPLICA: "no compatible replica was left to retry on",
    Outcome.NO_REPLICA_AVAILABLE: "Envoy found no healthy replica to send an attempt to",
    Outcome.UPSTREAM_ERROR: "the upstream failed",
    Outcome.ENVOY_EXITED: "the gateway's Envoy exited",
    Outcome.GATEWAY_LOST: "the gateway instance serving it was lost and another closed its record",
    Outcome.DEADLINE_EXCEEDED: "the gateway's deadline fired",
}


def _publisher(record: Mapping[str, Any]) -> tuple[str, Mapping[str, Any] | None]:
    """The attempt whose answer the client got (it ends with its request's phase), else the last one."""
    attempts = _attempts_by_number(record)
    phase = record.get("phase")
    for number, attempt in attempts.items():
        if attempt.get("outcome") == phase:
            return _attempt_label(number, attempt), attempt
    if attempts:
        number = max(attempts)
        return _attempt_label(number, attempts[number]), attempts[number]
    return "an attempt", None


def _attempt_label(number: int, attempt: Mapping[str, Any]) -> str:
    replica = attempt.get("replica")
    return f"attempt {number}" + (f" on {_clean(replica, 80)}" if replica is not None else "")


def _last_event(record: Mapping[str, Any], names: set[str]) -> Mapping[str, Any] | None:
    found = None
    for event in _mappings(record.get("events")):
        if event.get("event") in names:
            found = event
    return found


def outcome_sentence(record: Any) -> str:
    """What the client got, in one sentence."""
    record = _require_object(record)
    phase, outcome = record.get("phase"), record.get("outcome")
    tokens = _tokens(record.get("delivered_output_tokens"))
    label, _ = _publisher(record)
    attempts = _attempts_by_number(record)
    phase_text, outcome_text = _clean(phase, 40), _clean(outcome, 60)
    if phase in ("prefill", "decode"):
        return f"Still in flight ({phase_text}): {tokens} output tokens delivered so far."
    if outcome == Outcome.COMPLETED:
        failed = sum(1 for a in attempts.values() if a.get("outcome") not in ("completed", None))
        after = f", after {_plural(failed, 'attempt')} that failed before any content" if failed else ""
        return f"The client got one complete answer from {label} ({tokens} output tokens){after}."
    if outcome == Outcome.CLIENT_DISCONNECTED:
        when = f"after the first delta ({tokens} output tokens delivered)"
        if not record.get("first_delta_sent"):
            when = "before any content"
        return f"The client went away {when}; {label} was cancelled and no other attempt was started."
    if outcome == Outcome.RETRIES_EXHAUSTED:
        return (
            f"All {_plural(len(attempts), 'attempt')} failed before any content: the client got one HTTP "
            "error (retries_exhausted), no partial body."
        )
    if outcome == Outcome.REPLICAS_OVERLOADED and phase != "rejected":
        return (
            "The last attempt allowed was refused with 429: the client got one error "
            "(replicas_overloaded), with the replica's Retry-After if it sent one."
        )
    if record.get("first_delta_sent") or phase == "interrupted":
        ending = _last_event(record, {EventName.STREAM_TERMINATED, EventName.STREAM_RESET})
        if ending is not None and ending.get("event") == EventName.STREAM_RESET:
            then = f"then a transport reset ({_clean(ending.get('cause'), 40)})"
        elif outcome == Outcome.GATEWAY_LOST:
            then = "then the gateway serving it was lost (gateway_lost)"
        else:
            then = f"then one terminal error frame ({outcome_text})"
        return (
            f"The client got {tokens} output tokens from {label}, {then}; "
            "nothing is retried after the first delta."
        )
    if phase == "rejected":
        rejected = _last_event(record, {EventName.REQUEST_REJECTED})
        why = _clean(rejected.get("reason")) if rejected is not None and rejected.get("reason") else None
        if why is not None:  # e.g. the endpoint picker's own answer
            return f"The request was rejected ({outcome_text}): {why}; no attempt was made."
        return f"The request was rejected ({outcome_text}): no attempt was made."
    if phase == "failed":
        because = _FAILED_BECAUSE.get(outcome) if isinstance(outcome, str) else None
        reason = f" ({because})" if because else ""
        return (
            f"The request failed before any content{reason}: the client got one HTTP error, {outcome_text}."
        )
    return f"The request ended {phase_text} with outcome {outcome_text}."


# --- text -----------------------------------------------------------------------------------------------


def _format_ms(ms: float | None) -> str:
    if ms is None:
        return "?"
    if abs(ms) >= 1e9:  # over 11 days: not a real request's span, but printed briefly all the same
        return f"{ms:+.3g} ms"
    return f"{ms:+.1f} ms"


def _wall_clock(t: float) -> str:
    try:
        stamp = datetime.datetime.fromtimestamp(t, tz=datetime.UTC)
    except (OverflowError, OSError, ValueError):
        return f"{_format_number(t)} (not a valid wall-clock time)"
    return stamp.strftime("%Y-%m-%d %H:%M:%S.") + f"{stamp.microsecond // 1000:03d} UTC"


class _Paint:
    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled

    def __call__(self, text: str, tone: str) -> str:
        code = _ANSI.get(tone)
        if not self.enabled or not code or not text:
            return text
        return f"\x1b[{code}m{text}\x1b[0m"


def _admitted_text(tl: Timeline) -> str:
    if tl.admitted_at is not None:
        return _wall_clock(tl.admitted_at)
    if tl.zero_at is not None:
        return f"not in the trace; times count from the first stamp, {_wall_clock(tl.zero_at)}"
    return "not in the trace, and no usable time in the record"


def _outcome_tone(record: Mapping[str, Any]) -> str:
    outcome = record.get("outcome")
    if outcome == Outcome.COMPLETED:
        return _GOOD
    if outcome == Outcome.CLIENT_DISCONNECTED or outcome is None:
        return _WARN
    return _BAD


def _header(record: Mapping[str, Any], tl: Timeline, paint: _Paint, width: int) -> list[str]:
    attempts = _attempts_by_number(record)
    outcome = record.get("outcome")
    result = _clean(record.get("phase"), 40)
    if outcome is not None and outcome != record.get("phase"):
        result += f": {_clean(outcome, 60)}"
    source = record.get("delivered_output_tokens_source")
    delivered = f"{_tokens(record.get('delivered_output_tokens'))} output tokens"
    if source is not None:
        delivered += f" (counted from {_clean(source, 40)})"
    gateway = _clean(record.get("gateway"), 80)
    if record.get("owner") is not None:
        gateway += f" (owner {_clean(record.get('owner'), 80)})"
    attempts_text = str(len(attempts))
    if _number(record.get("retry_budget")) is not None:
        attempts_text += f" (retry budget left: {_tokens(record.get('retry_budget'))})"
    fields: list[tuple[str, str, str]] = [
        ("request", _clean(record.get("request_id"), 200), "bold"),
        ("result", result, _outcome_tone(record)),
        ("model", _clean(record.get("model"), 100), ""),
        ("delivered", f"{delivered}, first delta sent: {_clean(record.get('first_delta_sent'), 10)}", ""),
        ("attempts", attempts_text, ""),
        ("gateway", gateway, ""),
        ("admitted", _admitted_text(tl), ""),
    ]
    shown = sorted(attempts.items())[:50]
    for number, attempt in shown:
        attempt_id, replica = _clean(attempt.get("attempt_id"), 60), _clean(attempt.get("replica"), 80)
        text = f"attempt {number}  {attempt_id}  on {replica}: {_clean(attempt.get('outcome'), 40)}"
        if attempt.get("detail") is not None:
            text += f" ({_clean(attempt.get('detail'), 80)})"
        if attempt.get("status") is not None:
            text += f", status {_clean(attempt.get('status'), 10)}"
        fields.append(("", text, ""))
    if len(attempts) > len(shown):
        fields.append(("", f"… {len(attempts) - len(shown)} more attempts (see --json)", ""))
    lines: list[str] = []
    for name, value, tone in fields:
        # Wrapped before painting: colour codes would count as text.
        pieces = textwrap.wrap(value, max(20, width - 10), break_on_hyphens=False) or [""]
        for n, piece in enumerate(pieces):
            lines.append(f"{name if n == 0 else '':<10}{paint(piece, tone)}".rstrip())
    return lines


def _cell_lines(text: str, width: int) -> list[str]:
    lines = textwrap.wrap(text, width, break_long_words=True, break_on_hyphens=False) or [""]
    if len(lines) > _MAX_CELL_LINES:
        lines = lines[:_MAX_CELL_LINES]
        last = lines[-1]
        lines[-1] = (last[: width - 1] if len(last) >= width else last) + "…"
    return lines


def render_text(record: Any, *, color: bool = False, width: int = DEFAULT_WIDTH) -> str:
    """The record for a person: a summary, the events side by side per attempt, and the outcome."""
    record = _require_object(record)
    tl = timeline(record)
    paint = _Paint(color)
    width = max(40, min(int(width), 1000))
    lines = _header(record, tl, paint, width)
    lines.append("")

    rows = tl.rows[:_MAX_ROWS]
    time_texts = [_format_ms(row.t_ms) for row in rows]
    time_w = max([len("time"), *map(len, time_texts)])
    gap = "  "
    ncols = 1 + len(tl.columns)
    col_w = (width - time_w - len(gap) * ncols) // ncols
    if col_w < _MIN_COLUMN:
        # Too many attempts for lanes: one text column, each attempt's rows labelled with its number.
        ncols, col_w = 1, max(_MIN_COLUMN, width - time_w - len(gap))
        titles = ["request / attempt"]
    else:
        attempts = _attempts_by_number(record)
        titles = ["request"]
        for number in tl.columns:
            replica = _get(attempts.get(number), "replica")
            titles.append(f"attempt {number}" + (f" {_clean(replica, 80)}" if replica is not None else ""))
    lanes = {number: i + 1 for i, number in enumerate(tl.columns)} if ncols > 1 else {}
    lane_w = col_w + len(gap)
    text_w = ncols * lane_w - len(gap)

    if rows:
        head = gap.join(
            [_clean("time", time_w).rjust(time_w)] + [_clean(t, col_w).ljust(col_w) for t in titles]
        )
        lines.append(paint(head.rstrip(), "bold"))
        lines.append(gap.join(["-" * time_w] + ["-" * col_w] * ncols))
    for row, time_text in zip(rows, time_texts, strict=True):
        lane = lanes.get(row.column, 0)
        text = row.text
        if not lanes and row.column != REQUEST_COLUMN:
            text = f"[attempt {row.column}] {text}"
        # A row holds one entry: it starts in its lane and may run on over the (empty) lanes to its right.
        indent = " " * (lane * lane_w)
        for n, piece in enumerate(_cell_lines(text, text_w - lane * lane_w)):
            stamp = paint(time_text.rjust(time_w), _DIM) if n == 0 else " " * time_w
            lines.append(stamp + gap + indent + paint(piece, row.tone))
    if len(tl.rows) > len(rows):
        lines.append(f"… {len(tl.rows) - len(rows)} more rows not shown (see --json)")
    notes: list[str] = []
    if tl.trace_omitted is not None:
        notes.append(f"trace {tl.trace_omitted}: the journal kept the summary, not the events")
    elif not tl.rows:
        notes.append("(the record has no events)")
    if tl.unreadable:
        notes.append(f"({_plural(tl.unreadable, 'trace entry')} that were not objects skipped)")
    if notes and rows:
        lines.append("")
    for note in notes:
        lines += textwrap.wrap(note, width)
    lines.append("")
    tone = _outcome_tone(record)
    lines += [paint(piece, tone) for piece in textwrap.wrap(outcome_sentence(record), width)]
    return "\n".join(lines) + "\n"


# --- JSON -----------------------------------------------------------------------------------------------

_SUMMARY_KEYS = (
    "request_id",
    "phase",
    "outcome",
    "model",
    "model_revision",
    "first_delta_sent",
    "delivered_output_tokens",
    "delivered_output_tokens_source",
    "fingerprint_digest",
    "retry_budget",
    "gateway",
    "owner",
    "updated_at",
)


def as_json(record: Any) -> dict[str, Any]:
    """The machine form: the record's summary, then its events with `t_ms` (relative to admission), the
    request's own events apart and the others grouped under their attempt. Always plain JSON."""
    record = _require_object(record)
    tl = timeline(record)
    zero = tl.zero_at
    request_events: list[dict[str, Any]] = []
    by_attempt: dict[int, list[dict[str, Any]]] = {number: [] for number in tl.columns}
    raw_events = record.get("events")
    for event in raw_events if isinstance(raw_events, list) else []:
        if not isinstance(event, Mapping):
            continue
        item = _plain(event)
        t_ms = _relative_ms(_number(event.get("t")), zero)
        item["t_ms"] = round(t_ms, 3) if t_ms is not None else None
        number = _attempt_number(event.get("attempt"))
        (by_attempt.setdefault(number, []) if number is not None else request_events).append(item)

    attempts = _attempts_by_number(record)
    grouped: list[dict[str, Any]] = []
    for number in sorted(by_attempt):
        attempt = _plain(attempts.get(number, {}))
        attempt["attempt"] = number
        lease = attempt.get("lease")
        if isinstance(lease, dict):
            for key in ("granted_at", "stopped_at", "revoked_at"):
                t_ms = _relative_ms(_number(lease.get(key)), zero)
                lease[key.removesuffix("_at") + "_ms"] = round(t_ms, 3) if t_ms is not None else None
        attempt["events"] = by_attempt[number]
        grouped.append(attempt)

    summary = {key: _plain(record.get(key)) for key in _SUMMARY_KEYS}
    return {
        **summary,
        "attempt_count": len(attempts),
        "admitted_at": tl.admitted_at,
        "t_ms_from": zero,  # admission, or the earliest stamp when the record has no admission event
        "client_got": outcome_sentence(record),
        "trace_omitted": tl.trace_omitted,
        "input": _plain(record.get("input")) if isinstance(record.get("input"), Mapping) else None,
        "tool_calls": _plain(record.get("tool_calls")) if isinstance(record.get("tool_calls"), list) else [],
        "events": request_events,
        "attempts": grouped,
    }
