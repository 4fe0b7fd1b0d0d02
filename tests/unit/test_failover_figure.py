"""The README's failover figure: `router-testbed drill --figure` (`report.figure_svg`) renders the timelines
of the scenarios run as one standalone SVG, and `scripts/render_failover_figure.py` drives it against a local
stack. Here the figure is rendered from a fabricated pair of exchanges shaped like a real run's (no server):
a replica that dies before the first delta (retried) and one that dies after it (the prefix, then a reset).
The committed docs/img/failover.svg is checked to be such a figure."""

from __future__ import annotations

import importlib.util
import json
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

from router_testbed.drill import verdicts as v
from router_testbed.drill.cli import options_from_args
from router_testbed.drill.evidence import Exchange
from router_testbed.drill.report import (
    TIMELINE_CSS,
    RunInfo,
    client_got,
    fault_against_first_delta,
    figure_svg,
    journal_said,
)
from router_testbed.drill.scenarios import BY_NAME, Result

REPO = Path(__file__).resolve().parents[2]
SVG = "{http://www.w3.org/2000/svg}"
T0 = 1_800_000_000.0
A, B = "127.0.0.1:5001", "127.0.0.1:5002"
BEFORE = "Before the first delta: replica dies after computing a token"
AFTER = "After the first delta: replica dies after the first delta"


def sse(payload: Any) -> bytes:
    return b"data: " + (payload if isinstance(payload, bytes) else json.dumps(payload).encode()) + b"\n\n"


def chunk(cid: str, n: int, *, finish: str | None = None) -> bytes:
    choice = {"index": 0, "delta": {"content": f"w{n}"}, "finish_reason": finish}
    return sse({"id": cid, "choices": [choice], "usage": {"completion_tokens": n}})


def attempt(n: int, replica: str, outcome: str, start: float, end: float, detail: str | None = None) -> dict:
    lease = {"lease_id": f"l{n}", "granted_at": T0 + start, "stopped_at": T0 + end, "revoked_at": T0 + end}
    return {
        "attempt": n,
        "attempt_id": f"att_{n}",
        "replica": replica,
        "outcome": outcome,
        "detail": detail,
        "lease": lease,
    }


def replica_log(name: str, n: int, start: float, end: float, outcome: str, faults: list[str]) -> list[dict]:
    begin = {"event": "start", "replica": name, "attempt_id": f"att_{n}", "t_start": T0 + start}
    return [begin, {**begin, "event": "end", "t_end": T0 + end, "outcome": outcome, "faults_fired": faults}]


def exchange(events: list[bytes], *, first_at: float, every: float, end: float) -> Exchange:
    x = Exchange("the request", "POST", "/v1/chat/completions", "drill-r-1", stream=True, max_tokens=8)
    x.sent_at, x.headers_at, x.ended_at, x.status = T0, T0 + first_at, T0 + end, 200
    x.headers = {"content-type": "text/event-stream; charset=utf-8", "x-request-id": "drill-r-1"}
    for i, event in enumerate(events):
        x.body += event
        x.arrivals.append((T0 + first_at + every * i, len(x.body)))
    x.journal_status = 200
    return x


def died_before_first_delta() -> Exchange:
    """dies-after-token as recorded: replica-b reset after its role event; attempt 2 on replica-a served."""
    role = sse({"id": "chatcmpl-2", "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
    events = [role, *(chunk("chatcmpl-2", n, finish="length" if n == 8 else None) for n in range(1, 9))]
    x = exchange([*events, sse(b"[DONE]")], first_at=0.136, every=0.02, end=0.31)
    trace = [(0.007, "request_accepted", None), (0.01, "attempt_started", 1), (0.066, "attempt_failed", 1)]
    trace += [(0.066, "retry_triggered", None), (0.078, "attempt_started", 2), (0.136, "first_delta_sent", 2)]
    trace += [(0.29, "stream_completed", None)]
    x.journal = {
        "phase": "completed",
        "outcome": "completed",
        "delivered_output_tokens": 8,
        "attempts": [
            attempt(1, B, "failed", 0.01, 0.066, "connection_lost"),
            attempt(2, A, "completed", 0.078, 0.29),
        ],
        "events": [{"t": T0 + t, "event": e, **({"attempt": n} if n else {})} for t, e, n in trace],
    }
    x.replica_records = replica_log("replica-b", 1, 0.012, 0.064, "fault:reset", ["reset@token:1"])
    x.replica_records += replica_log("replica-a", 2, 0.08, 0.28, "completed", [])
    return x


def died_after_first_delta() -> Exchange:
    """dies-after-first-delta as recorded: two content events, then replica-b reset; the client a reset."""
    role = sse({"id": "chatcmpl-1", "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
    x = exchange([role, chunk("chatcmpl-1", 1), chunk("chatcmpl-1", 2)], first_at=0.067, every=0.02, end=0.49)
    x.transport_error = "RemoteProtocolError: peer closed connection without sending complete message body"
    trace = [(0.002, "request_accepted", None), (0.007, "attempt_started", 1), (0.067, "first_delta_sent", 1)]
    trace += [(0.393, "stream_reset", None)]
    x.journal = {
        "phase": "interrupted",
        "outcome": "upstream_decode_interrupted",
        "delivered_output_tokens": 2,
        "attempts": [attempt(1, B, "interrupted", 0.007, 0.39)],
        "events": [{"t": T0 + t, "event": e, **({"attempt": n} if n else {})} for t, e, n in trace],
    }
    x.replica_records = replica_log("replica-b", 1, 0.004, 0.39, "fault:reset", ["reset@after:2"])
    return x


def result(name: str, x: Exchange, *, passed: bool = True) -> Result:
    verdict = v.Verdict()
    verdict.check("the client got what was promised", passed, "fabricated")
    sc = BY_NAME[name]
    return Result(sc, verdict, v.Evidence([x], sim=True), sc.fault_in("sim"), 0.3)


def render(results: list[Result]) -> tuple[str, ET.Element]:
    info = RunInfo("http://127.0.0.1:8080", "sim", "tiny", "r", T0, 1.0)
    svg = figure_svg(info, results)
    return svg, ET.fromstring(svg)


def texts(root: ET.Element) -> list[str]:
    return ["".join(t.itertext()) for t in root.iter(f"{SVG}text")]


def assert_standalone(svg: str, root: ET.Element) -> None:
    """One SVG document that renders alone: its own size and style, a white background, nothing fetched
    or run, no nested document."""
    assert root.tag == f"{SVG}svg" and svg.count("<svg") == 1
    width, height = int(root.get("width", "0")), int(root.get("height", "0"))
    assert 800 <= width <= 1000 and root.get("viewBox") == f"0 0 {width} {height}"
    (style,) = root.iter(f"{SVG}style")
    assert TIMELINE_CSS.strip().replace("\n", " ") in (style.text or "")
    background = root.find(f"{SVG}rect")
    assert background is not None and background.get("fill") == "#ffffff"
    for forbidden in ("<script", "href=", "url(", "@import", "<foreignObject", "<image"):
        assert forbidden not in svg


def test_the_pair_renders_as_one_standalone_figure_with_a_title_per_timeline() -> None:
    svg, root = render(
        [
            result("dies-after-token", died_before_first_delta()),
            result("dies-after-first-delta", died_after_first_delta()),
        ]
    )
    assert_standalone(svg, root)
    lines = texts(root)
    heads = [t for t in lines if t.startswith(("Before", "After"))]
    assert [h.split("\u2014")[0].strip() for h in heads] == [BEFORE, AFTER]
    assert "x-sim-fault: reset@token:1 attempt=1" in heads[0]
    got = [t for t in lines if t.startswith("The client got:")]
    assert got == [
        "The client got:\u00a0HTTP 200, 8 content events, then [DONE] — one complete answer, all from "
        "attempt 2 on replica-a",
        "The client got:\u00a0HTTP 200, 2 content events, then a transport reset (no [DONE]) — all from "
        "attempt 1 on replica-b",
    ]
    journal = [t for t in lines if t.startswith("The journal:")]
    assert journal[0].endswith(
        "completed · 2 attempts: #1 on replica-b failed (connection_lost), #2 on replica-a completed · "
        "8 output tokens delivered"
    )
    assert "interrupted (upstream_decode_interrupted) · 1 attempt" in journal[1]
    # What a newcomer looks for: the kill moment, the retry, the end of each stream.
    assert lines.count("replica dies (connection reset)") == 2
    assert {"retry", "first delta", "completed", "reset"} <= set(lines)
    # Each once in its timeline, once in the legend: the second stream's reset, the first's [DONE].
    assert svg.count('class="faultline"') == 2 and svg.count('class="reset"') == 2
    assert svg.count('class="done"') == 2
    assert len(svg.encode()) < 40_000


def test_the_words_come_from_the_evidence() -> None:
    before, after = died_before_first_delta(), died_after_first_delta()
    assert fault_against_first_delta(before) == "before the first delta"
    assert fault_against_first_delta(after) == "after the first delta"
    # A terminal frame instead of the reset, and a request nothing happened to.
    framed = died_after_first_delta()
    framed.transport_error = None
    error = {"code": "upstream_decode_interrupted", "request_id": "drill-r-1", "partial_output": True}
    framed.body += sse({"error": error}) + sse(b"[DONE]")
    framed.arrivals.append((T0 + 0.4, len(framed.body)))
    assert client_got(framed) == (
        "HTTP 200, 2 content events, then one terminal frame (upstream_decode_interrupted) and [DONE] — all "
        "from attempt 1 on replica-b"
    )
    framed.replica_records, framed.journal = [], {**(framed.journal or {}), "events": []}
    assert fault_against_first_delta(framed) is None
    framed.journal_status = 404
    assert journal_said(framed) == "no record (look-up HTTP 404)"


def test_a_violation_is_said_in_its_title() -> None:
    _, root = render([result("dies-after-first-delta", died_after_first_delta(), passed=False)])
    (head,) = [t for t in texts(root) if t.startswith("After")]
    assert "FAIL: the client got what was promised" in head


def test_the_drill_takes_figure_and_the_script_asks_for_two_sim_scenarios() -> None:
    options = options_from_args(["--gateway", "http://127.0.0.1:1", "--figure", "out/f.svg"])
    assert options.figure == Path("out/f.svg")
    spec = importlib.util.spec_from_file_location(
        "render_failover_figure", REPO / "scripts/render_failover_figure.py"
    )
    assert spec is not None and spec.loader is not None
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert script.FIGURE == REPO / "docs/img/failover.svg"
    assert [BY_NAME[name].sim_fault is not None for name in script.SCENARIOS] == [True, True]


def test_the_committed_figure_is_such_a_figure() -> None:
    path = REPO / "docs/img/failover.svg"
    svg = path.read_text(encoding="utf-8")
    root = ET.fromstring(svg)
    assert_standalone(svg, root)
    heads = [t.split("\u2014")[0].strip() for t in texts(root) if t.startswith(("Before", "After"))]
    assert heads == [BEFORE, AFTER]
    assert "FAIL:" not in svg
    assert path.stat().st_size < 50_000
