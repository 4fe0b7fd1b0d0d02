"""The drill's results, three ways: a verdict table for the terminal, a self-contained HTML report with a
timeline picture (inline SVG) per request, and machine-readable JSON.

The HTML needs nothing else: inline CSS, inline SVG, no script, no external asset; tooltips are SVG
``<title>`` elements and the raw evidence sits in ``<details>``. Times in a picture are seconds from the
moment the drill sent the request; the gateway's journal is stamped by the gateway host's clock, so a skew
between the two hosts shifts the gateway's marks against the client's.
"""

from __future__ import annotations

import html
import json
import math
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from router_testbed.drill import apis
from router_testbed.drill.evidence import Exchange, read_stream
from router_testbed.drill.scenarios import Result

# --- terminal -----------------------------------------------------------------------------------------


class Style:
    """ANSI colour, only when asked for (a TTY without NO_COLOR)."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled

    def _wrap(self, code: str, text: str) -> str:
        return f"\033[{code}m{text}\033[0m" if self.enabled else text

    def bold(self, text: str) -> str:
        return self._wrap("1", text)

    def dim(self, text: str) -> str:
        return self._wrap("2", text)

    def red(self, text: str) -> str:
        return self._wrap("31", text)

    def green(self, text: str) -> str:
        return self._wrap("32", text)

    def yellow(self, text: str) -> str:
        return self._wrap("33", text)


def _cut(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"


def all_passed(results: Sequence[Result]) -> bool:
    """The run's verdict: no violation, and at least one scenario judged (N/A ones are neither)."""
    return any(r.passed for r in results) and not any(r.violated for r in results)


def checks_cell(r: Result) -> str:
    """Checks passed of those that apply, and how many did not apply to this gateway."""
    if r.not_applicable is not None:
        return "—"
    applicable = r.verdict.applicable
    cell = f"{sum(bool(c.ok) for c in applicable)}/{len(applicable)}"
    skipped = len(r.verdict.checks) - len(applicable)
    return cell + (f" +{skipped} N/A" if skipped else "")


def api_cell(r: Result) -> str:
    """The API a result's requests spoke ("-": not an inference API's request, tool-replay)."""
    return r.api or "-"


def _named(r: Result, several: bool) -> str:
    """A scenario as the lines under the table name it: with its API when the run had several."""
    return f"{r.scenario.name} ({r.api})" if several and r.api else r.scenario.name


def verdict_table(results: Sequence[Result], style: Style | None = None) -> str:
    """The verdict table (one row per scenario and API), then every failed check with what was seen, then
    why a scenario did not apply, then the notes."""
    s = style or Style(False)
    several = len({r.api for r in results if r.api}) > 1
    api_w = max([len("api"), *(len(api_cell(r)) for r in results)])
    name_w = max([len("scenario"), *(len(r.scenario.name) for r in results)])
    fault_w = 46
    header = (
        f"  {'scenario':<{name_w}}  {'api':<{api_w}}  {'fault':<{fault_w}}  verdict  {'checks':>12}    time"
    )
    lines = [s.bold(header)]
    marks = {"PASS": s.green("PASS   "), "FAIL": s.red("FAIL   "), "N/A": s.dim("N/A    ")}
    for r in results:
        lines.append(
            f"  {r.scenario.name:<{name_w}}  {api_cell(r):<{api_w}}  {_cut(r.fault, fault_w):<{fault_w}}  "
            f"{marks[r.status]}  {checks_cell(r):>12}  {r.seconds:5.1f}s"
        )
    for r in results:
        if not r.violated:
            continue
        lines.append("")
        title = f"FAIL {r.scenario.name}" + (f" on {apis.of(r.api).title}" if r.api else "")
        lines.append(s.red(title) + f" ({r.scenario.title}): {r.scenario.promise}")
        for c in r.verdict.failed:
            lines.append(f"  ✗ {c.what}")
            lines.append(s.dim(f"      seen: {c.seen}"))
    skipped = [r for r in results if r.not_applicable is not None]
    if skipped:
        lines.append("")
        lines += [s.dim(f"N/A {_named(r, several)}: {r.not_applicable}") for r in skipped]
    notes = [(_named(r, several), n) for r in results for n in r.verdict.notes]
    if notes:
        lines.append("")
        lines += [s.yellow(f"note {name}: {text}") for name, text in notes]
    return "\n".join(lines)


def summary_line(results: Sequence[Result], seconds: float) -> str:
    judged = [r for r in results if r.not_applicable is None]
    passed = sum(r.passed for r in judged)
    several = len({r.api for r in results if r.api}) > 1
    failed = [_named(r, several) for r in judged if r.violated]
    skipped = len(results) - len(judged)
    line = f"{passed}/{len(judged)} scenarios passed"
    line += f" ({skipped} not applicable to this gateway)" if skipped else ""
    line += f" in {seconds:.1f}s"
    return line + (f"; violated: {', '.join(failed)}" if failed else "")


# --- JSON ---------------------------------------------------------------------------------------------


@dataclass
class RunInfo:
    gateway: str
    fault_mode: str
    model: str
    run_id: str
    started_at: float
    seconds: float
    router_sidecar: bool = True  # the gateway keeps router-sidecar's journal
    apis: list[str] = field(default_factory=lambda: [apis.DEFAULT])  # the APIs the matrix ran on


def to_json(info: RunInfo, results: Sequence[Result]) -> dict[str, Any]:
    return {
        "gateway": info.gateway,
        "router_sidecar": info.router_sidecar,
        "apis": info.apis,
        "fault_mode": info.fault_mode,
        "model": info.model,
        "run_id": info.run_id,
        "started_at": info.started_at,
        "seconds": round(info.seconds, 3),
        "passed": all_passed(results),
        "scenarios": [
            {
                "name": r.scenario.name,
                "api": r.api,
                "title": r.scenario.title,
                "promise": r.scenario.promise,
                "source": r.scenario.source,
                "fault": r.fault,
                "verdict": r.status,
                "not_applicable": r.not_applicable,
                "passed": r.passed,
                "seconds": round(r.seconds, 3),
                "checks": [c.to_json() for c in r.verdict.checks],
                "notes": r.verdict.notes,
                "exchanges": [x.to_json() for x in r.evidence.exchanges],
            }
            for r in results
        ],
    }


def _badge(status: str) -> str:
    """The CSS class of a verdict: PASS, FAIL, NA."""
    return "NA" if status == "N/A" else status


# --- the timeline picture -----------------------------------------------------------------------------

WIDTH = 940
LABEL_W = 150
RIGHT = 20
LANE_H = 38
TOP = 8
AXIS_H = 26
OUTCOME_COLOURS = {
    "failed": "#d9534f",
    "completed": "#4cae4c",
    "interrupted": "#f0ad4e",
    "cancelled": "#8c8c8c",
    "released": "#5bc0de",
    "holding": "#5bc0de",
    "writing_ahead": "#5bc0de",
    "passed_through": "#b0b0b0",
}
KEY_EVENTS = {
    "first_delta_sent": "first delta",
    "retry_triggered": "retry",
    "retry_refused": "no retry",
    "replica_lost": "replica lost",
    "attempt_fenced": "fenced",
    "stream_terminated": "terminated",
    "stream_reset": "reset",
    "client_disconnected": "client gone",
    "request_failed": "failed",
    "stream_completed": "completed",
    "response_replaced": "replaced",
}
# A simulated replica's log outcome `fault:ACTION` (router_testbed.sim.faults), as the picture says it.
FAULT_WORDS = {
    "reset": "replica dies (connection reset)",
    "exit": "replica process exits",
    "close": "replica ends the body early",
    "error": "replica sends an error event",
    "abort": "replica aborts",
    "status503": "replica answers 503",
    "stall": "replica stalls",
}


def _num(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and math.isfinite(value) else None


class _Scale:
    def __init__(self, t0: float, t1: float) -> None:
        self.t0 = t0
        self.span = max(t1 - t0, 0.05)
        self.plot_w = WIDTH - LABEL_W - RIGHT

    def x(self, t: float) -> float:
        return LABEL_W + max(0.0, min(1.0, (t - self.t0) / self.span)) * self.plot_w

    def ticks(self) -> list[float]:
        raw = self.span / 6
        magnitude = 10 ** math.floor(math.log10(raw))
        step = next(m * magnitude for m in (1, 2, 2.5, 5, 10) if m * magnitude >= raw)
        return [i * step for i in range(int(self.span / step) + 1)]


class _Labels:
    """Places short labels on a few rows without overlap; a label with no free row is left out (its mark
    keeps the tooltip)."""

    CHAR_W = 5.6  # px per character at the labels' 10 px font, a little generous

    def __init__(self, rows: Sequence[float]) -> None:
        self.rows = list(rows)
        self.taken: dict[float, list[tuple[float, float]]] = {y: [] for y in self.rows}

    def place(self, x: float, text: str, cls: str) -> str:
        width = len(text) * self.CHAR_W
        left, right = (x - 4 - width, x - 4) if _flips(x, width) else (x, x + width)
        for y in self.rows:
            if all(right < a or left > b for a, b in self.taken[y]):
                self.taken[y].append((left - 3, right + 3))
                return f'<text {_anchor(x, width)} y="{y}" class="{cls}">{_e(text)}</text>'
        return ""


def _flips(x: float, width: float) -> bool:
    """Whether a label `width` wide at `x` reads to the left of its mark: near the right edge, or when it
    would run over it."""
    return x > WIDTH - 110 or x + width > WIDTH - 4


def _anchor(x: float, width: float = 0.0) -> str:
    """A label's x: it reads to the right of its mark, or to the left near the picture's right edge."""
    if _flips(x, width):
        return f'x="{x - 4:.1f}" text-anchor="end"'
    return f'x="{x:.1f}"'


def _e(text: Any) -> str:
    return html.escape(str(text), quote=True)


def _attempt_span(x: Exchange, attempt: dict[str, Any], end_default: float) -> tuple[float | None, float]:
    n = attempt.get("attempt")
    lease = attempt.get("lease") if isinstance(attempt.get("lease"), dict) else {}
    start = next(
        (_num(e.get("t")) for e in x.trace if e.get("event") == "attempt_started" and e.get("attempt") == n),
        None,
    ) or _num(lease.get("granted_at"))
    end = (
        next(
            (
                _num(e.get("t"))
                for e in x.trace
                if e.get("event") == "attempt_failed" and e.get("attempt") == n
            ),
            None,
        )
        or _num(lease.get("stopped_at"))
        or _num(lease.get("revoked_at"))
        or end_default
    )
    return start, end


def timeline_svg(x: Exchange) -> str:
    """One request's timeline: the client's events, each attempt as a bar on its replica's lane (with its
    lease and fence marks and, for a simulator, the replica's own view and where its fault fired), the
    gateway's journal events and the hooks run against a replica."""
    height, body = _timeline(x)
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" class="timeline" viewBox="0 0 {WIDTH} {height}" '
        f'width="{WIDTH}" height="{height}" role="img" aria-label="timeline of {_e(x.label)}">{body}</svg>'
    )


def _timeline(x: Exchange) -> tuple[int, str]:
    """The picture's height and its elements, drawn from (0, 0) and WIDTH wide (styled by TIMELINE_CSS)."""
    t0 = x.sent_at
    times = [x.ended_at, x.headers_at, x.disconnected_at]
    times += [_num(e.get("t")) for e in x.trace]
    for a in x.attempts:
        lease = a.get("lease") if isinstance(a.get("lease"), dict) else {}
        times += [_num(lease.get(k)) for k in ("granted_at", "stopped_at", "revoked_at")]
    times += [_num(r.get("t_end")) for r in x.replica_records]
    times += [h.ended_at for h in x.hooks]
    # Marks far outside the request (a skewed clock) would squash the picture; they are clamped instead.
    finite = [t for t in times if t is not None and t0 - 5 <= t <= t0 + 3600]
    t_end = max([t0 + 0.05, *finite])
    scale = _Scale(t0, t_end)
    end_default = x.ended_at or t_end

    replicas: list[str] = []
    for a in x.attempts:
        if str(a.get("replica")) not in replicas:
            replicas.append(str(a.get("replica")))
    names = _replica_names(x)
    lanes = ["client", "gateway", *replicas]
    if not x.attempts and x.replica_records:
        lanes += sorted({f"replica {r.get('replica')}" for r in x.replica_records})
    height = TOP + LANE_H * len(lanes) + AXIS_H
    out: list[str] = []

    def lane_y(i: int) -> float:
        return TOP + LANE_H * i + LANE_H / 2

    for i, lane in enumerate(lanes):
        y = lane_y(i)
        shade = "#f7f7f7" if i % 2 == 0 else "#ffffff"
        out.append(f'<rect x="0" y="{y - LANE_H / 2}" width="{WIDTH}" height="{LANE_H}" fill="{shade}"/>')
        label = lane if lane in ("client", "gateway") or lane.startswith("replica ") else f"replica {lane}"
        if lane in names:  # the simulator's name, its address under it
            out.append(
                f'<text x="6" y="{y - 1}" class="lane">{_e(_cut(names[lane], 24))}</text>'
                f'<text x="6" y="{y + 11}" class="addr">{_e(_cut(lane, 26))}</text>'
            )
        else:
            out.append(f'<text x="6" y="{y + 4}" class="lane">{_e(_cut(label, 24))}</text>')
    axis_y = TOP + LANE_H * len(lanes)
    for tick in scale.ticks():
        tx = scale.x(t0 + tick)
        out.append(f'<line x1="{tx:.1f}" y1="{TOP}" x2="{tx:.1f}" y2="{axis_y}" class="grid"/>')
        out.append(f'<text x="{tx:.1f}" y="{axis_y + 16}" class="tick">{tick:g}s</text>')

    # The top row carries the hooks' names first (what was done to a replica), then the response status.
    top = _Labels([TOP + 10, TOP + LANE_H - 3])
    for h in x.hooks:
        out.append(f'<g class="hook">{top.place(scale.x(h.started_at) + 3, h.action, "hl")}</g>')
    _client_lane(out, x, scale, lane_y(0), top)
    _gateway_lane(out, x, scale, lane_y(1))
    for a in x.attempts:
        i = lanes.index(str(a.get("replica")))
        _attempt_bar(out, x, a, scale, lane_y(i), end_default)
    for r in x.replica_records:
        if r.get("event") != "end":
            continue
        lane = next(
            (str(a.get("replica")) for a in x.attempts if a.get("attempt_id") == r.get("attempt_id")),
            f"replica {r.get('replica')}",
        )
        if lane in lanes:
            _replica_view(out, r, scale, lane_y(lanes.index(lane)))
            if str(r.get("outcome") or "").startswith("fault:") and _num(r.get("t_end")) is not None:
                fx = scale.x(float(r["t_end"]))  # the moment the fault hit, across every lane
                out.append(f'<line x1="{fx:.1f}" y1="{TOP}" x2="{fx:.1f}" y2="{axis_y}" class="faultline"/>')
    for h in x.hooks:
        hx = scale.x(h.started_at)
        out.append(
            f'<g class="hook"><title>{_e(h.describe())}</title>'
            f'<line x1="{hx:.1f}" y1="{TOP}" x2="{hx:.1f}" y2="{axis_y}"/></g>'
        )
    return height, "".join(out)


def _replica_names(x: Exchange) -> dict[str, str]:
    """Journal address -> the simulator's own name, joined on attempt_id."""
    names: dict[str, str] = {}
    for a in x.attempts:
        for r in x.replica_records:
            if r.get("attempt_id") == a.get("attempt_id") and r.get("replica"):
                names[str(a.get("replica"))] = str(r.get("replica"))
    return names


def _client_lane(out: list[str], x: Exchange, scale: _Scale, y: float, top: _Labels) -> None:
    end = x.ended_at or x.sent_at
    out.append(
        f'<line x1="{scale.x(x.sent_at):.1f}" y1="{y}" x2="{scale.x(end):.1f}" y2="{y}" class="span"/>'
        f"<g><title>{_e(f'{x.method} {x.path} sent (key {x.request_id})')}</title>"
        f'<rect x="{scale.x(x.sent_at) - 1:.1f}" y="{y - 9}" width="3" height="18" fill="#333"/></g>'
    )
    if x.headers_at is not None:
        hx = scale.x(x.headers_at)
        error = x.json_error()
        text = f"HTTP {x.status}" + (f" {error.get('code')}" if error else "")
        cls = "err" if x.status >= 400 else "status"
        out.append(
            f"<g><title>{_e(text)} at +{x.headers_at - x.sent_at:.3f}s</title>"
            f'<rect x="{hx - 1:.1f}" y="{y - 7}" width="2" height="14" class="{cls}"/>'
            f"{top.place(hx + 3, _cut(text, 40), cls)}</g>"
        )
    if x.is_event_stream:
        view = read_stream(x)
        for e in view.events:
            if e.t is None:
                continue
            ex = scale.x(e.t)
            at = f"+{e.t - x.sent_at:.3f}s"
            if e.kind == "content":
                out.append(
                    f'<line x1="{ex:.1f}" y1="{y - 5}" x2="{ex:.1f}" y2="{y + 5}" class="content">'
                    f"<title>content event {at}: {_e(_cut(json.dumps(e.data), 300))}</title></line>"
                )
            elif e.kind == "frame":
                what = f"{e.name} event" if e.name else "terminal frame"
                out.append(
                    f"<g><title>{_e(what)} {at}: {_e(_cut(json.dumps(e.data), 600))}</title>"
                    f'<path d="M{ex:.1f},{y - 8} l7,8 l-7,8 l-7,-8 z" class="frame"/></g>'
                )
            elif e.kind == "done":
                out.append(
                    f"<g><title>{_e(e.name or '[DONE]')} {at}</title>"
                    f'<circle cx="{ex:.1f}" cy="{y}" r="5" class="done"/></g>'
                )
            else:
                out.append(
                    f'<line x1="{ex:.1f}" y1="{y - 3}" x2="{ex:.1f}" y2="{y + 3}" class="minor">'
                    f"<title>{_e(e.name or e.kind)} event {at}</title></line>"
                )
    if x.disconnected_at is not None:
        _cross(
            out,
            scale.x(x.disconnected_at),
            y,
            "gone",
            f"the client left at +{x.disconnected_at - x.sent_at:.3f}s",
        )
    elif x.transport_error:
        _cross(out, scale.x(end), y, "reset", f"{x.transport_error} at +{end - x.sent_at:.3f}s")


def _cross(out: list[str], cx: float, y: float, cls: str, title: str) -> None:
    out.append(
        f'<g class="{cls}"><title>{_e(title)}</title>'
        f'<path d="M{cx - 6:.1f},{y - 6} l12,12 m0,-12 l-12,12"/></g>'
    )


def _gateway_lane(out: list[str], x: Exchange, scale: _Scale, y: float) -> None:
    if not x.trace and x.has_record and (x.journal or {}).get("trace"):
        out.append(
            f'<text x="{LABEL_W + 4}" y="{y + 4}" class="muted">{_e((x.journal or {}).get("trace"))}</text>'
        )
    labels = _Labels([y - 7, y + 14])
    for e in x.trace:
        t = _num(e.get("t"))
        if t is None:
            continue
        ex = scale.x(t)
        name = str(e.get("event"))
        out.append(
            f'<g class="ev"><title>{_e(json.dumps(e))}</title><circle cx="{ex:.1f}" cy="{y}" r="3.5"/></g>'
        )
        if name in KEY_EVENTS:
            out.append(labels.place(ex + 2, KEY_EVENTS[name], "evl"))


def _attempt_bar(
    out: list[str], x: Exchange, a: dict[str, Any], scale: _Scale, y: float, end_default: float
) -> None:
    start, end = _attempt_span(x, a, end_default)
    if start is None:
        return
    outcome = str(a.get("outcome"))
    colour = OUTCOME_COLOURS.get(outcome, "#999")
    x1, x2 = scale.x(start), max(scale.x(end), scale.x(start) + 2)
    detail = f" ({a.get('detail')})" if a.get("detail") else ""
    title = f"attempt {a.get('attempt')} {a.get('attempt_id')} on {a.get('replica')}: {outcome}{detail}"
    out.append(
        f"<g><title>{_e(title)}</title>"
        f'<rect x="{x1:.1f}" y="{y - 11}" width="{x2 - x1:.1f}" height="12" rx="2" fill="{colour}"/>'
        f'<text {_anchor(x1 + 2)} y="{y - 13}" class="bar">#{_e(a.get("attempt"))} '
        f"{_e(outcome + detail)}</text></g>"
    )
    lease = a.get("lease") if isinstance(a.get("lease"), dict) else {}
    for key, glyph, cls in (
        ("granted_at", "M{x},{y} l-4,6 h8 z", "grant"),
        ("revoked_at", "M{x},{y} l-4,-6 h8 z", "revoke"),
    ):
        t = _num(lease.get(key))
        if t is not None:
            lx = scale.x(t)
            yy = y + 2 if key == "granted_at" else y + 9
            out.append(
                f'<g class="{cls}"><title>lease {_e(lease.get("lease_id"))} {key.replace("_at", "")} '
                f'+{t - x.sent_at:.3f}s</title><path d="{glyph.format(x=f"{lx:.1f}", y=yy)}"/></g>'
            )
    labels = _Labels([y + 14])
    for e in x.trace:
        if e.get("attempt") != a.get("attempt") or e.get("event") not in ("attempt_fenced", "replica_lost"):
            continue
        t = _num(e.get("t"))
        if t is None:
            continue
        fx = scale.x(t)
        word = "fenced" if e.get("event") == "attempt_fenced" else "lost"
        out.append(
            f'<g class="fence"><title>{_e(json.dumps(e))}</title>'
            f'<line x1="{fx:.1f}" y1="{y - 14}" x2="{fx:.1f}" y2="{y + 4}"/>'
            f"{labels.place(fx + 2, word, 'fl')}</g>"
        )


def _replica_view(out: list[str], r: dict[str, Any], scale: _Scale, y: float) -> None:
    """The replica's own record of the attempt: a thin bar under the gateway's, the client's departure."""
    start, end = _num(r.get("t_start")), _num(r.get("t_end"))
    if start is None or end is None:
        return
    title = (
        f"replica {r.get('replica')} log: {r.get('outcome')}, {r.get('content_events_written')} content "
        f"events written, faults {r.get('faults_fired')}"
    )
    x1, x2 = scale.x(start), max(scale.x(end), scale.x(start) + 2)
    out.append(
        f'<g class="rlog"><title>{_e(title)}</title>'
        f'<rect x="{x1:.1f}" y="{y + 4}" width="{x2 - x1:.1f}" height="4"/></g>'
    )
    gone = _num(r.get("client_gone_at"))
    if gone is not None:
        _cross(out, scale.x(gone), y + 6, "gone", f"the replica saw the client go (cancel) at {gone:.3f}")
    outcome = str(r.get("outcome") or "")
    if outcome.startswith("fault:"):
        # Where the simulator's fault ended the attempt (the moment the replica "died" in sim mode).
        action = outcome.removeprefix("fault:")
        fx = scale.x(end)
        word = FAULT_WORDS.get(action, f"fault: {action}")
        fired = ", ".join(str(f) for f in r.get("faults_fired") or []) or action
        _cross(
            out, fx, y + 6, "fault", f"replica {r.get('replica')}: {word} ({fired}) at +{end - scale.t0:.3f}s"
        )
        # Its label reads under the replica's log bar, left of the mark (to its right, it would touch the
        # label of a bar on the lane below); it may reach under the lane's name, not over its address.
        width = len(word) * _Labels.CHAR_W
        where = f'x="{fx - 9:.1f}" text-anchor="end"' if fx - 9 - width >= 100 else _anchor(fx + 8, width)
        out.append(f'<text {where} y="{y + 17}" class="faultl">{_e(word)}</text>')


# --- HTML ---------------------------------------------------------------------------------------------

PAGE_CSS = """
body{font:14px/1.45 system-ui,-apple-system,Segoe UI,sans-serif;margin:24px auto;max-width:980px;color:#222}
h1{font-size:22px;margin:0 0 4px} h2{font-size:17px;margin:28px 0 4px} .meta,.muted{color:#666}
table.summary{border-collapse:collapse;width:100%;margin:12px 0}
table.summary td,table.summary th{border-bottom:1px solid #e3e3e3;padding:4px 6px;text-align:left;
vertical-align:top}
.badge{font-weight:600;padding:1px 7px;border-radius:3px;color:#fff}
.PASS{background:#4cae4c} .FAIL{background:#d9534f} .NA{background:#999}
section{border-top:2px solid #eee} section.fail{border-top-color:#d9534f}
ul.checks{list-style:none;padding-left:0} ul.checks li{margin:2px 0}
li.ok::before{content:"\\2713  ";color:#4cae4c}
li.bad::before{content:"\\2717  ";color:#d9534f;font-weight:700}
li.na::before{content:"\\2013  ";color:#999} li.na{color:#777}
li.bad{color:#a02622} .seen{color:#666;font-size:12.5px;display:block;margin-left:20px}
.note{color:#8a6d3b} figure{margin:10px 0 4px} figcaption{font-size:13px;color:#444;margin-bottom:2px}
pre{background:#f6f6f6;padding:8px;overflow:auto;max-height:320px;font-size:12px;white-space:pre-wrap}
.legend span{display:inline-block;margin-right:14px;font-size:12.5px}
.sw{display:inline-block;width:12px;height:10px;margin-right:4px;vertical-align:-1px}
svg.timeline{max-width:100%;height:auto;font:11px system-ui,sans-serif}
"""

# The timeline's own classes: the HTML report and the standalone figure (`figure_svg`) both embed them.
TIMELINE_CSS = """
svg .lane{fill:#333} svg .tick{fill:#888;text-anchor:middle} svg .grid{stroke:#e4e4e4}
svg .span{stroke:#bbb;stroke-width:2} svg .content{stroke:#2a6fdb;stroke-width:1.5}
svg .minor{stroke:#aaa} svg .frame{fill:#f0ad4e;stroke:#a66} svg .done{fill:#4cae4c}
svg .status{fill:#333} svg .err{fill:#d9534f} svg text.err{fill:#d9534f}
svg .reset path{stroke:#d9534f;stroke-width:2.5} svg .gone path{stroke:#8e44ad;stroke-width:2.5}
svg .ev circle{fill:#666} svg .evl{fill:#555;font-size:10px} svg .bar{fill:#333;font-size:10px}
svg .grant path{fill:#2e7d32} svg .revoke path{fill:#c62828}
svg .fence line{stroke:#000;stroke-dasharray:2 2} svg .fl{font-size:10px;fill:#000}
svg .hook line{stroke:#8e44ad;stroke-width:1.5;stroke-dasharray:5 3} svg .hl{fill:#8e44ad;font-size:11px}
svg .rlog rect{fill:#777} svg .muted{fill:#888} svg .addr{fill:#777;font-size:9.5px}
svg .fault path{stroke:#d9534f;stroke-width:2.5} svg .faultl{fill:#a02622;font-size:10px}
svg .faultline{stroke:#d9534f;stroke-width:1;stroke-dasharray:4 3;opacity:.7}
"""

CSS = PAGE_CSS + TIMELINE_CSS

LEGEND = (
    '<p class="legend">'
    '<span><i class="sw" style="background:#2a6fdb"></i>content event</span>'
    '<span><i class="sw" style="background:#f0ad4e"></i>terminal frame</span>'
    '<span><i class="sw" style="background:#4cae4c"></i>[DONE] / completed attempt</span>'
    '<span><i class="sw" style="background:#d9534f"></i>reset / failed attempt</span>'
    '<span><i class="sw" style="background:#8e44ad"></i>client gone / hook</span>'
    '<span><i class="sw" style="background:#2e7d32"></i>lease granted</span>'
    '<span><i class="sw" style="background:#c62828"></i>lease revoked</span>'
    '<span><i class="sw" style="background:#777"></i>the replica\'s own log</span>'
    "</p>"
)


PICTURE_HELP = (
    "Each picture: seconds from the moment the drill sent the request. Lanes: what the client got; the "
    "gateway's journal events; one lane per replica with its attempts (bars, coloured by outcome; lease "
    "grant/revoke marks, fence and loss marks; for a simulator its own log as a thin bar). Hover for "
    "details. Journal times come from the gateway host's clock."
)


def _anchor_of(r: Result) -> str:
    """A section's id: the scenario, with its API when it has one other than chat (a run of every API has
    one section per scenario and API; chat's keep the ids they always had)."""
    return r.scenario.name if r.api in (None, apis.DEFAULT) else f"{r.api}-{r.scenario.name}"


def _pre(text: str, limit: int = 48 * 1024) -> str:
    cut = text[:limit] + (f"\n… ({len(text) - limit} more characters)" if len(text) > limit else "")
    return f"<pre>{_e(cut)}</pre>"


def _exchange_html(x: Exchange) -> str:
    parts = [
        "<figure>",
        f"<figcaption><b>{_e(x.label)}</b>: {_e(x.method)} {_e(x.path)} · key <code>{_e(x.request_id)}</code>"
        + (f" · <code>x-sim-fault: {_e(x.fault)}</code>" if x.fault else "")
        + f" · HTTP {x.status or '—'}"
        + (f" · {_e(x.transport_error)}" if x.transport_error else "")
        + "</figcaption>",
        timeline_svg(x),
        "</figure>",
        f"<details><summary>what the client got ({len(x.body)} bytes)</summary>"
        f"{_pre(x.body.decode('utf-8', 'replace'))}</details>",
    ]
    if x.journal is not None:
        parts.append(
            f"<details><summary>journal record (look-up HTTP {x.journal_status})</summary>"
            f"{_pre(json.dumps(x.journal, indent=1))}</details>"
        )
    if x.replica_records:
        lines = "\n".join(json.dumps(r) for r in x.replica_records)
        summary = f"replica log ({len(x.replica_records)} records)"
        parts.append(f"<details><summary>{summary}</summary>{_pre(lines)}</details>")
    if x.hooks:
        lines = "\n".join(f"{h.describe()}\n  $ {h.command}\n{h.output}" for h in x.hooks)
        parts.append(f"<details><summary>hooks</summary>{_pre(lines)}</details>")
    return "".join(parts)


def _checks_html(checks: Iterable[Any]) -> str:
    items = []
    for c in checks:
        cls = "na" if c.ok is None else "ok" if c.ok else "bad"
        seen = f"not applicable: {c.seen}" if c.ok is None else f"seen: {c.seen}"
        items.append(f'<li class="{cls}">{_e(c.what)}<span class="seen">{_e(seen)}</span></li>')
    return '<ul class="checks">' + "".join(items) + "</ul>"


def html_report(info: RunInfo, results: Sequence[Result]) -> str:
    judged = [r for r in results if r.not_applicable is None]
    passed = sum(r.passed for r in judged)
    verdict = "PASS" if all_passed(results) else "FAIL"
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(info.started_at))
    rows = []
    for r in results:
        v = r.status
        first = r.verdict.failed[0].what if r.verdict.failed else r.not_applicable or ""
        rows.append(
            f'<tr><td><a href="#{_e(_anchor_of(r))}">{_e(r.scenario.name)}</a></td>'
            f"<td>{_e(api_cell(r))}</td><td>{_e(r.fault)}</td>"
            f'<td><span class="badge {_badge(v)}">{v}</span></td>'
            f"<td>{_e(checks_cell(r))}</td><td>{r.seconds:.1f}s</td><td>{_e(first)}</td></tr>"
        )
    sections = []
    for r in results:
        v = r.status
        notes = "".join(f'<p class="note">note: {_e(n)}</p>' for n in r.verdict.notes)
        why = f'<p class="note">not applicable: {_e(r.not_applicable)}</p>' if r.not_applicable else ""
        api = (
            f"<p><b>API</b>: {_e(apis.of(r.api).title)} (<code>POST {_e(apis.of(r.api).path)}</code>), "
            f"judged by its own rules: clean end <code>{_e(apis.of(r.api).end)}</code>, terminal event "
            f"<code>{_e(apis.of(r.api).terminal)}</code></p>"
            if r.api
            else ""
        )
        sections.append(
            f'<section id="{_e(_anchor_of(r))}" class="{_badge(v).lower()}">'
            f"<h2>{_e(r.scenario.name)}{_e(f' · {r.api}' if r.api else '')} — {_e(r.scenario.title)} "
            f'<span class="badge {_badge(v)}">{v}</span></h2>'
            f"{api}<p><b>Promise</b> ({_e(r.scenario.source)}): {_e(r.scenario.promise)}</p>"
            f"<p><b>Fault</b>: {_e(r.fault)} · {r.seconds:.1f}s</p>"
            f"{why}{_checks_html(r.verdict.checks)}{notes}"
            + "".join(_exchange_html(x) for x in r.evidence.exchanges)
            + "</section>"
        )
    kind = "router-sidecar (journal judged)" if info.router_sidecar else "not router-sidecar (no journal)"
    applies = f" ({len(results) - len(judged)} not applicable)" if len(judged) < len(results) else ""
    return (
        '<!doctype html>\n<html lang="en"><head><meta charset="utf-8">'
        f"<title>router-testbed drill: {verdict} ({passed}/{len(judged)})</title>"
        f"<style>{CSS}</style></head><body>"
        f"<h1>router-testbed drill: {passed}/{len(judged)} scenarios passed{applies} "
        f'<span class="badge {verdict}">{verdict}</span></h1>'
        f'<p class="meta">gateway {_e(info.gateway)} ({_e(kind)}) · fault mode {_e(info.fault_mode)} · '
        f"model {_e(info.model)} · api {_e(', '.join(info.apis))} · run {_e(info.run_id)} · {when} · "
        f"{info.seconds:.1f}s</p>"
        '<table class="summary"><tr><th>scenario</th><th>api</th><th>fault</th><th>verdict</th>'
        "<th>checks</th><th>time</th><th>first violation</th></tr>"
        + "".join(rows)
        + "</table>"
        + LEGEND
        + f'<p class="muted">{_e(PICTURE_HELP)}</p>'
        + "".join(sections)
        + "</body></html>\n"
    )


# --- the standalone figure ----------------------------------------------------------------------------

# What a standalone SVG needs besides the timeline's classes: its own font (no page around it) and the
# panel titles. No external CSS, font or script: it must render alone, e.g. as an <img> on GitHub.
FIGURE_CSS = (
    "svg{font:11px system-ui,-apple-system,'Segoe UI',Helvetica,Arial,sans-serif}"
    " svg .fh{font-size:14px;font-weight:600;fill:#111} svg .fd{font-size:12px;font-weight:400;fill:#666}"
    " svg .fs{font-size:12px;fill:#333} svg .fk{font-weight:600} svg .lg{fill:#333}"
    " svg .fn{fill:#777;font-size:10.5px}" + TIMELINE_CSS.replace("\n", " ")
)
PANEL_HEAD = 62  # the three title lines above each timeline
PANEL_GAP = 14
LEGEND_ROW = 18


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def _replica_of(x: Exchange, attempt: dict[str, Any]) -> str:
    """An attempt's replica as the picture names it: the simulator's own name when its log says it."""
    return _replica_names(x).get(str(attempt.get("replica")), str(attempt.get("replica")))


def client_got(x: Exchange) -> str:
    """What the client got, in one line: status, content events, how the stream ended, which attempt."""
    if x.status == 0:
        return f"no HTTP response ({_cut(x.transport_error or 'nothing', 80)})"
    if not x.is_event_stream:
        error = x.json_error()
        return f"HTTP {x.status}" + (f" {error.get('code')}" if error else "") + " and no stream"
    view = read_stream(x)
    spec = x.spec
    got = f"HTTP {x.status}, {_plural(len(view.content), 'content event')}"
    frames = view.frames
    word = "terminal event" if spec.named_events else "terminal frame"
    if len(frames) == 1:
        got += f", then one {word} ({frames[0].get('code') or frames[0].get('type')})"
    elif frames:
        got += f", then {len(frames)} {word}s"
    if view.done_count:
        end = next((e.name for e in view.events if e.kind == "done" and e.name), None) or "[DONE]"
        got += f" and {end}" if frames else f", then {end}"
    if x.disconnected_at is not None:
        got += ", then the client left"
    elif x.transport_error:
        kind = x.transport_error.split(":", 1)[0]
        reset = kind in ("RemoteProtocolError", "ReadError")
        got += ", then a transport reset" if reset else f", then {kind}"
        got += "" if view.done_count else f" (no {spec.end})"
    if len(view.content_ids) == 1:
        served = [a for a in x.attempts if a.get("outcome") in ("completed", "interrupted", "cancelled")]
        if len(served) == 1:
            complete = view.done_count == 1 and not frames and not x.transport_error and view.finish_reasons
            got += " — one complete answer," if complete else " —"
            got += f" all from attempt {served[0].get('attempt')} on {_replica_of(x, served[0])}"
    elif len(view.content_ids) > 1:
        got += f" — content from {len(view.content_ids)} completions"
    return got


def journal_said(x: Exchange) -> str:
    """The gateway's journal record in one line: its phase, each attempt, the delivered count."""
    if not x.has_record:
        return f"no record (look-up HTTP {x.journal_status or '—'})"
    record = x.journal or {}
    phase, outcome = record.get("phase"), record.get("outcome")
    said = str(phase) + (f" ({outcome})" if outcome and outcome != phase else "")
    attempts = x.attempts
    described = []
    for a in attempts:
        detail = f" ({a.get('detail')})" if a.get("detail") else ""
        described.append(f"#{a.get('attempt')} on {_replica_of(x, a)} {a.get('outcome')}{detail}")
    said += f" · {_plural(len(attempts), 'attempt')}: " + ", ".join(described) if described else ""
    delivered = record.get("delivered_output_tokens")
    if isinstance(delivered, int):
        said += f" · {_plural(delivered, 'output token')} delivered"
    return said


def _fault_moment(x: Exchange) -> float | None:
    """When the fault hit: a simulated replica's fault (its log), a kill or freeze hook, or else the first
    attempt the journal says failed or was lost."""
    moments = [
        _num(r.get("t_end"))
        for r in x.replica_records
        if r.get("event") == "end" and str(r.get("outcome") or "").startswith("fault:")
    ]
    moments += [h.started_at for h in x.hooks if h.action in ("kill", "freeze")]
    if not any(t is not None for t in moments):
        moments = [_num(e.get("t")) for e in x.trace if e.get("event") in ("attempt_failed", "replica_lost")]
    found = [t for t in moments if t is not None]
    return min(found) if found else None


def fault_against_first_delta(x: Exchange) -> str | None:
    """ "before the first delta" or "after the first delta": when the fault hit, against the gateway's
    first_delta_sent (or the client's first content event); None when nothing failed."""
    fault = _fault_moment(x)
    if fault is None:
        return None
    first = next((_num(e.get("t")) for e in x.trace if e.get("event") == "first_delta_sent"), None)
    if first is None and x.is_event_stream:
        first = read_stream(x).first_content_at()
    return "before the first delta" if first is None or fault < first else "after the first delta"


def _legend(y: float) -> tuple[float, str]:
    """The marks the timelines use, drawn with the same classes; returns the legend's height."""
    items = [
        ('<line x1="{x}" y1="{ym5}" x2="{x}" y2="{yp5}" class="content"/>', "content event"),
        ('<path d="M{x},{ym7} l6,7 l-6,7 l-6,-7 z" class="frame"/>', "terminal frame"),
        ('<circle cx="{x}" cy="{y}" r="5" class="done"/>', "[DONE]"),
        ('<g class="reset"><path d="M{xm5},{ym5} l10,10 m0,-10 l-10,10"/></g>', "connection reset"),
        ('<g class="ev"><circle cx="{x}" cy="{y}" r="3.5"/></g>', "journal event"),
        *(
            (
                f'<rect x="{{xm6}}" y="{{ym5}}" width="14" height="10" rx="2" fill="{OUTCOME_COLOURS[o]}"/>',
                f"{o}",
            )
            for o in ("failed", "completed", "interrupted")
        ),
        ('<g class="grant"><path d="M{x},{ym4} l-4,6 h8 z"/></g>', "lease granted"),
        ('<g class="revoke"><path d="M{x},{yp2} l-4,-6 h8 z"/></g>', "lease revoked"),
        ('<g class="rlog"><rect x="{xm6}" y="{ym2}" width="14" height="4"/></g>', "the replica's own log"),
    ]
    out = [f'<text x="6" y="{y + 4}" class="lg fk">Legend</text>']
    x, row = 60.0, 0
    for glyph, label in items:
        width = 34 + len(label) * 6.6  # generous: a fallback font is wider than system-ui
        if x + width > WIDTH - RIGHT:
            x, row = 60.0, row + 1
        yy = y + row * LEGEND_ROW
        fields = {"x": x + 6, "y": yy, "xm5": x + 1, "xm6": x, "ym2": yy - 2, "ym4": yy - 4, "ym5": yy - 5}
        fields.update({"ym7": yy - 7, "yp2": yy + 2, "yp5": yy + 5})
        out.append(glyph.format(**{k: f"{v:.1f}" for k, v in fields.items()}))
        out.append(f'<text x="{x + 18:.1f}" y="{yy + 4:.1f}" class="lg">{_e(label)}</text>')
        x += width
    return (row + 1) * LEGEND_ROW, "".join(out)


def figure_svg(info: RunInfo, results: Sequence[Result]) -> str:
    """One standalone SVG: the timeline of each request of the scenarios run, one above the other, each
    under a title saying what was done, what the client got and what the journal says; then a legend.
    The timelines are `timeline_svg`'s (the same drawing, the same classes); the CSS they need is
    embedded, on a white background, so the file renders alone (an image in a README)."""
    panels = [(r, x) for r in results if r.not_applicable is None for x in r.evidence.exchanges]
    y = 8.0
    body: list[str] = []
    for r, x in panels:
        when = fault_against_first_delta(x)
        title = f"{when[:1].upper()}{when[1:]}: {r.scenario.title}" if when else r.scenario.title
        title = title[:1].upper() + title[1:] + (f" ({x.label})" if len(r.evidence.exchanges) > 1 else "")
        title += f", {apis.of(r.api).title}" if r.api not in (None, apis.DEFAULT) else ""
        # A space at a <tspan>'s edge may be dropped by a renderer: the gaps are no-break spaces.
        body.append(
            f'<text x="6" y="{y + 16:.1f}" class="fh">{_e(title)}'
            f'<tspan class="fd" dx="6">— {_e(r.scenario.name)}, {_e(r.fault)}</tspan>'
            + (
                f'<tspan class="err" dx="6">FAIL: {_e(_cut(r.verdict.failed[0].what, 60))}</tspan>'
                if r.violated
                else ""
            )
            + "</text>"
            f'<text x="6" y="{y + 35:.1f}" class="fs"><tspan class="fk">The client got:</tspan>\u00a0'
            f"{_e(_cut(client_got(x), 150))}</text>"
            f'<text x="6" y="{y + 52:.1f}" class="fs"><tspan class="fk">The journal:</tspan>\u00a0'
            f"{_e(_cut(journal_said(x), 150))}</text>"
        )
        height, timeline = _timeline(x)
        body.append(f'<g transform="translate(0 {y + PANEL_HEAD:.1f})">{timeline}</g>')
        y += PANEL_HEAD + height + PANEL_GAP
    legend_h, legend = _legend(y + 6)
    body.append(legend)
    y += legend_h + 6
    day = time.strftime("%Y-%m-%d", time.localtime(info.started_at))
    body.append(
        f'<text x="6" y="{y + 12:.1f}" class="fn">Recorded by router-testbed drill on {day}, fault mode '
        f"{_e(info.fault_mode)}. Times: seconds from the moment the client sent the request.</text>"
        f'<text x="6" y="{y + 26:.1f}" class="fn">Lanes: what the client got; the gateway\'s journal '
        "events; one lane per replica with its attempts (bars) and its own log.</text>"
    )
    height = math.ceil(y + 36)
    names = ", ".join(dict.fromkeys(r.scenario.name for r, _ in panels))
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {WIDTH} {height}" width="{WIDTH}" '
        f'height="{height}" role="img" aria-label="{_e(f"router-testbed drill timelines: {names}")}">'
        f"<style>{FIGURE_CSS}</style>"
        f'<rect width="{WIDTH}" height="{height}" fill="#ffffff"/>' + "".join(body) + "</svg>\n"
    )
