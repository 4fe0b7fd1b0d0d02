"""The journal record as a timeline (`router-sidecar trace`): pure rendering, text and JSON.

The records here are shaped like the gateway's (`views.journal_view` + `Journal._record`); the first is a
real one. Hostile ones (missing keys, wrong types, junk) must render, never raise.
"""

from __future__ import annotations

import copy
import json
import math
import re
from typing import Any

import pytest

from router_sidecar.core.timeline import REQUEST_COLUMN, as_json, outcome_sentence, render_text, timeline

ANSI = re.compile(r"\x1b\[[0-9;]*m")

# A real record: the client went away after the first delta.
CANCELLED: dict[str, Any] = {
    "request_id": "fz-e36844-1c4d75df-18",
    "phase": "cancelled",
    "outcome": "client_disconnected",
    "attempt": 1,
    "first_delta_sent": True,
    "model": "tiny",
    "model_revision": None,
    "fingerprint_digest": None,
    "retry_budget": 0,
    "delivered_output_tokens": 0,
    "delivered_output_tokens_source": "content_events",
    "attempts": [
        {
            "attempt": 1,
            "attempt_id": "att_21b26503fb243f04",
            "replica": "127.0.0.1:42345",
            "outcome": "cancelled",
            "detail": None,
            "status": 200,
            "lease": {
                "lease_id": "6188a231f6c6e242",
                "ttl_seconds": 2,
                "granted_at": 1796134588.910809,
                "stopped_at": 1796134588.985565,
                "revoked_at": 1796134588.999121,
            },
            "fence": None,
        }
    ],
    "tool_calls": [],
    "input": {
        "route": "chat.completions",
        "digest": "sha256:...",
        "seed": None,
        "stream": True,
        "estimated_prompt_tokens": 7,
    },
    "gateway": "vm:127.0.0.1:57057",
    "owner": "vm:127.0.0.1:57057~134b4ad4",
    "events": [
        {
            "t": 1796134588.84785,
            "event": "request_accepted",
            "route": "chat.completions",
            "model": "tiny",
            "stream": True,
            "seed": None,
            "input_digest": "sha256:...",
            "estimated_prompt_tokens": 7,
            "retry_allowed": True,
        },
        {
            "t": 1796134588.910822,
            "event": "attempt_started",
            "attempt": 1,
            "attempt_id": "att_21b26503fb243f04",
            "replica": "127.0.0.1:42345",
        },
        {
            "t": 1796134588.964747,
            "event": "first_delta_sent",
            "attempt": 1,
            "attempt_id": "att_21b26503fb243f04",
        },
        {"t": 1796134608.869236, "event": "client_disconnected", "delivered_output_tokens": 0},
    ],
    "updated_at": 1796134608.869476,
}

CANCELLED_TEXT = """\
request   fz-e36844-1c4d75df-18
result    cancelled: client_disconnected
model     tiny
delivered 0 output tokens (counted from content_events), first delta sent: yes
attempts  1 (retry budget left: 0)
gateway   vm:127.0.0.1:57057 (owner vm:127.0.0.1:57057~134b4ad4)
admitted  2026-12-01 14:16:28.847 UTC
          attempt 1  att_21b26503fb243f04  on 127.0.0.1:42345: cancelled, status 200

       time  request                                          attempt 1 127.0.0.1:42345
-----------  -----------------------------------------------  -----------------------------------------------
    +0.0 ms  accepted chat.completions, model tiny, stream, ~7 prompt tokens
   +63.0 ms                                                   lease granted (ttl 2 s)
   +63.0 ms                                                   started on 127.0.0.1:42345
  +116.9 ms                                                   first delta sent to the client
  +137.7 ms                                                   lease stopped
  +151.3 ms                                                   lease revoked
+20021.4 ms  client disconnected (0 output tokens delivered)

The client went away after the first delta (0 output tokens delivered); attempt 1 on 127.0.0.1:42345 was
cancelled and no other attempt was started.
"""

T0 = 1_800_000_000.0  # 2027-01-15 08:00:00 UTC


def two_attempts() -> dict[str, Any]:
    """Attempt 1's replica was lost in prefill (fenced by its cancel ack), attempt 2 completed."""
    return {
        "request_id": "req-two",
        "phase": "completed",
        "outcome": "completed",
        "attempt": 2,
        "first_delta_sent": True,
        "model": "tiny",
        "retry_budget": 0,
        "delivered_output_tokens": 5,
        "delivered_output_tokens_source": "usage",
        "attempts": [
            {
                "attempt": 1,
                "attempt_id": "att_one",
                "replica": "10.0.0.1:8000",
                "outcome": "failed",
                "detail": "replica_lost",
                "status": 200,
                "lease": {
                    "lease_id": "a1",
                    "ttl_seconds": 2,
                    "granted_at": T0 + 0.00212,
                    "stopped_at": T0 + 0.30118,
                    "revoked_at": T0 + 0.30243,
                },
                "fence": {"proof": "cancel_ack", "waited_ms": 1.2},
            },
            {
                "attempt": 2,
                "attempt_id": "att_two",
                "replica": "10.0.0.2:8000",
                "outcome": "completed",
                "detail": None,
                "status": 200,
                "lease": {
                    "lease_id": "a2",
                    "ttl_seconds": 2,
                    "granted_at": T0 + 0.30411,
                    "stopped_at": T0 + 0.42019,
                    "revoked_at": T0 + 0.42131,
                },
                "fence": None,
            },
        ],
        "tool_calls": [],
        "gateway": "gw-1",
        "events": [
            {
                "t": T0,
                "event": "request_accepted",
                "route": "chat.completions",
                "model": "tiny",
                "stream": True,
                "estimated_prompt_tokens": 9,
                "retry_allowed": True,
            },
            {"t": T0 + 0.00231, "event": "attempt_started", "attempt": 1, "replica": "10.0.0.1:8000"},
            {"t": T0 + 0.29902, "event": "replica_lost", "attempt": 1, "cause": "heartbeat_lapsed"},
            {
                "t": T0 + 0.30104,
                "event": "attempt_fenced",
                "attempt": 1,
                "attempt_id": "att_one",
                "proof": "cancel_ack",
                "waited_ms": 1.2,
            },
            {
                "t": T0 + 0.30109,
                "event": "attempt_failed",
                "attempt": 1,
                "reason": "replica_lost",
                "detail": "heartbeat lapsed in prefill",
            },
            {"t": T0 + 0.30111, "event": "retry_triggered", "attempt": 1, "reason": "replica_lost"},
            {"t": T0 + 0.30422, "event": "attempt_started", "attempt": 2, "replica": "10.0.0.2:8000"},
            {"t": T0 + 0.35117, "event": "first_delta_sent", "attempt": 2, "attempt_id": "att_two"},
            {"t": T0 + 0.42126, "event": "stream_completed", "delivered_output_tokens": 5},
        ],
    }


TWO_TEXT_TABLE = """\
     time  request                          attempt 1 10.0.0.1:8000          attempt 2 10.0.0.2:8000
---------  -------------------------------  -------------------------------  -------------------------------
  +0.0 ms  accepted chat.completions, model tiny, stream, ~9 prompt tokens
  +2.1 ms                                   lease granted (ttl 2 s)
  +2.3 ms                                   started on 10.0.0.1:8000
+299.0 ms                                   replica lost: heartbeat_lapsed
+301.0 ms                                   fenced by cancel_ack after 1.2 ms
+301.1 ms                                   failed: replica_lost (heartbeat lapsed in prefill)
+301.1 ms                                   retry triggered: replica_lost
+301.2 ms                                   lease stopped
+302.4 ms                                   lease revoked
+304.1 ms                                                                    lease granted (ttl 2 s)
+304.2 ms                                                                    started on 10.0.0.2:8000
+351.2 ms                                                                    first delta sent to the client
+420.2 ms                                                                    lease stopped
+421.3 ms  stream completed: 5 output tokens delivered
+421.3 ms                                                                    lease revoked
"""


def flat(text: str) -> str:
    return " ".join(text.split())


# --- the real record, exactly ---------------------------------------------------------------------------


def test_real_record_renders_exactly() -> None:
    assert render_text(CANCELLED) == CANCELLED_TEXT


def test_times_are_relative_to_admission_and_rows_in_time_order() -> None:
    tl = timeline(CANCELLED)
    assert tl.admitted_at == tl.zero_at == 1796134588.84785
    assert tl.columns == (1,)
    got = [(round(r.t_ms, 1) if r.t_ms is not None else None, r.column, r.kind) for r in tl.rows]
    assert got == [
        (0.0, REQUEST_COLUMN, "event"),
        (63.0, 1, "lease"),
        (63.0, 1, "event"),
        (116.9, 1, "event"),
        (137.7, 1, "lease"),
        (151.3, 1, "lease"),
        (20021.4, REQUEST_COLUMN, "event"),
    ]


def test_record_is_not_modified() -> None:
    record = copy.deepcopy(CANCELLED)
    render_text(record, color=True)
    as_json(record)
    assert record == CANCELLED


# --- two attempts side by side --------------------------------------------------------------------------


def test_two_attempts_render_side_by_side() -> None:
    text = render_text(two_attempts())
    head, table, tail = text.split("\n\n")
    assert head.splitlines() == [
        "request   req-two",
        "result    completed",
        "model     tiny",
        "delivered 5 output tokens (counted from usage), first delta sent: yes",
        "attempts  2 (retry budget left: 0)",
        "gateway   gw-1",
        "admitted  2027-01-15 08:00:00.000 UTC",
        "          attempt 1  att_one  on 10.0.0.1:8000: failed (replica_lost), status 200",
        "          attempt 2  att_two  on 10.0.0.2:8000: completed, status 200",
    ]
    assert table + "\n" == TWO_TEXT_TABLE
    assert flat(tail) == (
        "The client got one complete answer from attempt 2 on 10.0.0.2:8000 (5 output tokens), "
        "after 1 attempt that failed before any content."
    )


def test_each_attempts_rows_start_in_its_own_lane() -> None:
    lines = render_text(two_attempts()).splitlines()
    header = next(line for line in lines if line.lstrip().startswith("time"))
    lane = {1: header.index("attempt 1"), 2: header.index("attempt 2")}
    for text, number in [
        ("started on 10.0.0.1:8000", 1),
        ("fenced by cancel_ack", 1),
        ("started on 10.0.0.2:8000", 2),
        ("first delta sent to the client", 2),
    ]:
        line = next(line for line in lines if text in line)
        assert line.index(text) == lane[number], (text, line)
    assert next(line for line in lines if "stream completed" in line).index("stream") == header.index(
        "request"
    )


def test_fence_proof_of_an_attempt_without_its_event_is_folded_in_at_its_revocation() -> None:
    record = two_attempts()
    record["events"] = [e for e in record["events"] if e["event"] != "attempt_fenced"]
    rows = [r for r in timeline(record).rows if r.kind == "fence"]
    assert len(rows) == 1
    assert (rows[0].column, rows[0].text) == (1, "fenced by cancel_ack after 1.2 ms")
    assert rows[0].t_ms == pytest.approx(302.43, abs=0.01)  # the lease's revocation
    # With its event in the trace, the proof is not shown twice.
    assert not [r for r in timeline(two_attempts()).rows if r.kind == "fence"]


def test_unprovable_fence_says_so() -> None:
    record = two_attempts()
    record["events"][3].update(proof=None, waited_ms=0.0)
    assert "fence unprovable: no proof it stopped publishing" in render_text(record)


# --- trace omitted (a clean completion) -----------------------------------------------------------------


def omitted() -> dict[str, Any]:
    record = copy.deepcopy(CANCELLED)
    record.update(phase="completed", outcome="completed", delivered_output_tokens=8, events=[])
    record["attempts"][0]["outcome"] = "completed"
    record["trace"] = "omitted: clean completion (journal.trace_clean_completions)"
    return record


def test_omitted_trace_renders_summary_and_says_so() -> None:
    text = render_text(omitted())
    lines = text.splitlines()
    assert "result    completed" in lines
    assert (
        "admitted  not in the trace; times count from the first stamp, 2026-12-01 14:16:28.910 UTC" in lines
    )
    # The lease stamps are still there, counted from the grant.
    assert [line.split("  ")[0].strip() for line in lines if "lease " in line] == [
        "+0.0 ms",
        "+74.8 ms",
        "+88.3 ms",
    ]
    assert (
        "trace omitted: clean completion (journal.trace_clean_completions): the journal kept the summary, "
        "not the events" in flat(text)
    )
    assert flat(text).endswith(
        "The client got one complete answer from attempt 1 on 127.0.0.1:42345 (8 output tokens)."
    )


def test_omitted_trace_without_leases_has_no_table() -> None:
    record = omitted()
    record["attempts"][0]["lease"] = None
    text = render_text(record)
    assert "time  request" not in text
    assert "admitted  not in the trace, and no usable time in the record" in text
    assert "trace omitted: clean completion" in text


# --- outcome sentences ----------------------------------------------------------------------------------


def with_outcome(phase: str, outcome: str | None, *, first_delta: bool, events: list[Any]) -> dict[str, Any]:
    record = copy.deepcopy(CANCELLED)
    record.update(
        phase=phase,
        outcome=outcome,
        first_delta_sent=first_delta,
        delivered_output_tokens=3,
        events=list(events),
    )
    record["attempts"][0]["outcome"] = phase
    return record


@pytest.mark.parametrize(
    ("phase", "outcome", "first_delta", "events", "expected"),
    [
        (
            "interrupted",
            "upstream_decode_interrupted",
            True,
            [{"event": "stream_terminated", "reason": "replica_lost"}],
            "The client got 3 output tokens from attempt 1 on 127.0.0.1:42345, then one terminal error frame "
            "(upstream_decode_interrupted); nothing is retried after the first delta.",
        ),
        (
            "interrupted",
            "upstream_decode_interrupted",
            True,
            [{"event": "stream_reset", "cause": "upstream_reset"}],
            "The client got 3 output tokens from attempt 1 on 127.0.0.1:42345, then a transport reset "
            "(upstream_reset); nothing is retried after the first delta.",
        ),
        (
            "failed",
            "retries_exhausted",
            False,
            [],
            "All 1 attempt failed before any content: the client got one HTTP error (retries_exhausted), "
            "no partial body.",
        ),
        (
            "failed",
            "deadline_exceeded",
            False,
            [],
            "The request failed before any content (the gateway's deadline fired): the client got one HTTP "
            "error, deadline_exceeded.",
        ),
        (
            "failed",
            "no_compatible_replica",
            False,
            [],
            "The request failed before any content (no compatible replica was left to retry on): the client "
            "got one HTTP error, no_compatible_replica.",
        ),
        (
            "cancelled",
            "client_disconnected",
            False,
            [],
            "The client went away before any content; attempt 1 on 127.0.0.1:42345 was cancelled and no "
            "other attempt was started.",
        ),
        (
            "interrupted",
            "gateway_lost",
            True,
            [],
            "The client got 3 output tokens from attempt 1 on 127.0.0.1:42345, then the gateway serving it "
            "was lost (gateway_lost); nothing is retried after the first delta.",
        ),
        ("decode", None, True, [], "Still in flight (decode): 3 output tokens delivered so far."),
        (
            "rejected",
            "bad_request",
            False,
            [],
            "The request was rejected (bad_request): no attempt was made.",
        ),
        (
            "rejected",
            "replicas_overloaded",
            False,
            [
                {
                    "event": "request_rejected",
                    "reason": "the endpoint picker answered 429 (router_testbed_epp)",
                }
            ],
            "The request was rejected (replicas_overloaded): the endpoint picker answered 429 "
            "(router_testbed_epp); no attempt was made.",
        ),
        ("weird", "stranger", False, [], "The request ended weird with outcome stranger."),
    ],
)
def test_outcome_sentence(
    phase: str, outcome: str | None, first_delta: bool, events: list[Any], expected: str
) -> None:
    record = with_outcome(phase, outcome, first_delta=first_delta, events=events)
    assert outcome_sentence(record) == expected
    assert flat(render_text(record)).endswith(expected)


# --- colour and width -----------------------------------------------------------------------------------


def test_colour_only_when_asked_and_layout_unchanged() -> None:
    plain = render_text(two_attempts())
    coloured = render_text(two_attempts(), color=True)
    assert "\x1b[" not in plain
    assert "\x1b[31m" in coloured and "\x1b[32m" in coloured  # a failure in red, the completion in green
    assert ANSI.sub("", coloured) == plain


@pytest.mark.parametrize("width", [60, 100, 110, 120, 160])
def test_lines_fit_the_width(width: int) -> None:
    record = two_attempts()
    record["events"][4]["detail"] = "a very long detail " * 30
    record["request_id"] = "r" * 200
    for rendered in (render_text(record, width=width), render_text(CANCELLED, width=width)):
        for line in rendered.splitlines():
            assert len(line) <= width, line


def test_long_details_are_wrapped_then_cut() -> None:
    record = two_attempts()
    record["events"][4]["detail"] = "word " * 500
    lines = render_text(record).splitlines()
    start = next(i for i, line in enumerate(lines) if "failed: replica_lost" in line)
    assert lines[start + 2].endswith("…")
    assert lines[start + 3].lstrip().startswith("+301.1 ms  ")  # the next event: at most 3 lines each


def test_many_attempts_are_stacked_with_labels() -> None:
    record = copy.deepcopy(CANCELLED)
    record["events"] = [
        {"t": 1796134588.84785 + n / 1000, "event": "attempt_started", "attempt": n, "replica": f"r{n}"}
        for n in range(1, 9)
    ]
    text = render_text(record, width=100)
    assert "request / attempt" in text
    assert "[attempt 8] started on r8" in text
    assert all(len(line) <= 100 for line in text.splitlines())


# --- hostile records ------------------------------------------------------------------------------------


def _mutated(**changes: Any) -> dict[str, Any]:
    record = copy.deepcopy(CANCELLED)
    record.update(changes)
    return record


HOSTILE: list[Any] = [
    {},
    {"events": None, "attempts": None},
    {"events": "not a list", "attempts": {"1": "x"}},
    {"events": [1, "two", None, [3], {"t": "soon", "event": "request_accepted"}]},
    _mutated(events=[{"t": "12:00", "event": "attempt_started", "attempt": 1}]),
    _mutated(events=[{"t": float("nan"), "event": "x"}, {"t": float("inf"), "event": "y"}, {"t": True}]),
    _mutated(events=[{"t": 1e308, "event": "request_accepted"}, {"t": -1e308, "event": "z"}]),
    _mutated(events=[{"t": 10**400, "event": 10**5000, "attempt": 10**50}]),
    _mutated(events=[{"event": "martian_landing", "attempt": 1, "crew": ["a"] * 50, "x": {"y": {"z": 1}}}]),
    _mutated(events=[{"event": None, "attempt": "1"}, {"event": {"nested": "name"}, "attempt": True}]),
    _mutated(
        events=[{"event": "attempt_started", "attempt": -3}, {"event": "first_delta_sent", "attempt": 0}]
    ),
    _mutated(attempts=[{"attempt": "one", "lease": "soon", "fence": "yes"}, None, 7]),
    _mutated(attempts=[{"lease": {"granted_at": "x", "stopped_at": None, "revoked_at": float("nan")}}]),
    _mutated(attempts=[{"attempt": 1, "fence": {"proof": {"deep": [1, 2]}, "waited_ms": "long"}}]),
    _mutated(request_id=None, phase=None, outcome=None, delivered_output_tokens="many", retry_budget=[]),
    _mutated(request_id={"a": [1, {"b": None}]}, model=["x"], gateway=12, owner=False, trace=["omitted"]),
    _mutated(phase="completed", outcome="completed", attempts=[]),
    _mutated(events=[{"t": 1.0, "event": "stream_completed", "delivered_output_tokens": float("inf")}]),
    {1: "int key", None: "none key", "events": [{2: "int key in event", "event": "x"}]},
    _mutated(events=[{"event": "events_dropped", "count": "lots"}]),
    _mutated(events=[{"event": "tool_call_claimed", "key": None}, {"event": "tool_call_"}]),
    _mutated(events=[{"event": "response_replaced", "response_flags": "UF", "status": {}}]),
]


def _nested(depth: int) -> Any:
    value: Any = "bottom"
    for _ in range(depth):
        value = {"down": [value]}
    return value


HOSTILE.append(
    _mutated(events=[{"event": "deep", "t": 1796134589.0, "junk": _nested(200)}], input=_nested(200))
)


@pytest.mark.parametrize("record", HOSTILE, ids=range(len(HOSTILE)))
def test_hostile_records_never_raise(record: Any) -> None:
    for color in (False, True):
        for width in (1, 40, 110, 10_000):
            text = render_text(record, color=color, width=width)
            assert isinstance(text, str) and text.endswith("\n")
    json.dumps(as_json(record), allow_nan=False)  # always plain JSON
    timeline(record)
    outcome_sentence(record)


def test_unknown_events_show_their_name_and_fields() -> None:
    record = _mutated(events=[{"t": 1796134589.0, "event": "martian_landing", "attempt": 1, "crew": 3}])
    assert "martian_landing: crew=3" in render_text(record)


def test_events_without_time_keep_the_journals_order() -> None:
    record = two_attempts()
    events = record["events"]
    events.insert(3, {"event": "events_dropped", "count": 480})
    events[5]["t"] = "not a time"
    rows = [r for r in timeline(record).rows if r.kind != "lease"]
    texts = [r.text for r in rows]
    assert texts.index("… 480 events dropped from the journal's trace here …") == 3
    assert rows[3].t_ms is None and rows[5].t_ms is None
    assert texts[5].startswith("failed: replica_lost")  # still after the fence, before the retry
    lines = render_text(record).splitlines()
    assert any(line.lstrip().startswith("?  ") and "480 events dropped" in line for line in lines)


def test_control_characters_cannot_drive_the_terminal() -> None:
    record = two_attempts()
    record["attempts"][0]["replica"] = "evil\x1b[2J\x07host"
    record["events"][2]["cause"] = "line\nbreak\x1b]0;title\x07"
    text = render_text(record)
    assert "\x1b" not in text and "\x07" not in text
    assert "evil\\x1b[2J\\x07host" in text
    assert "replica lost: line break\\x1b]0;title\\x07" in text


def test_a_thousand_events_render() -> None:
    record = copy.deepcopy(CANCELLED)
    record["events"] = [
        {
            "t": 1796134588.84785 + i / 1000,
            "event": "attempt_started" if i % 2 else "mystery",
            "attempt": 1 + i % 3,
        }
        for i in range(1000)
    ]
    text = render_text(record)
    assert len(text.splitlines()) > 1000
    doc = as_json(record)
    assert sum(len(a["events"]) for a in doc["attempts"]) == 1000


def test_a_flood_of_events_is_cut_in_text_but_whole_in_json() -> None:
    record = copy.deepcopy(CANCELLED)
    record["events"] = [{"t": 1796134588.84785 + i / 1e4, "event": "x"} for i in range(3000)]
    text = render_text(record)
    assert "more rows not shown (see --json)" in text
    assert len(as_json(record)["events"]) == 3000


@pytest.mark.parametrize("not_a_record", [[], "text", None, 3, 1.5, [CANCELLED]])
def test_input_that_is_not_an_object_is_a_value_error(not_a_record: Any) -> None:
    for render in (render_text, as_json, timeline, outcome_sentence):
        with pytest.raises(ValueError, match="a journal record is a JSON object"):
            render(not_a_record)


# --- JSON -----------------------------------------------------------------------------------------------


def test_as_json_groups_events_per_attempt_with_relative_times() -> None:
    doc = as_json(two_attempts())
    assert json.loads(json.dumps(doc, allow_nan=False)) == doc
    assert {k: doc[k] for k in ("request_id", "phase", "outcome", "attempt_count", "trace_omitted")} == {
        "request_id": "req-two",
        "phase": "completed",
        "outcome": "completed",
        "attempt_count": 2,
        "trace_omitted": None,
    }
    assert doc["admitted_at"] == doc["t_ms_from"] == T0
    assert doc["client_got"].startswith("The client got one complete answer from attempt 2")
    assert [(e["event"], e["t_ms"]) for e in doc["events"]] == [
        ("request_accepted", 0.0),
        ("stream_completed", pytest.approx(421.26, abs=1e-3)),
    ]
    first, second = doc["attempts"]
    assert (first["attempt"], first["replica"], first["outcome"]) == (1, "10.0.0.1:8000", "failed")
    assert [e["event"] for e in first["events"]] == [
        "attempt_started",
        "replica_lost",
        "attempt_fenced",
        "attempt_failed",
        "retry_triggered",
    ]
    assert [e["event"] for e in second["events"]] == ["attempt_started", "first_delta_sent"]
    assert second["events"][1]["t_ms"] == pytest.approx(351.17, abs=1e-3)
    assert first["fence"] == {"proof": "cancel_ack", "waited_ms": 1.2}
    assert first["lease"]["granted_ms"] == pytest.approx(2.12, abs=1e-3)
    assert first["lease"]["revoked_ms"] == pytest.approx(302.43, abs=1e-3)
    assert first["lease"]["revoked_ms"] < second["lease"]["granted_ms"]


def test_as_json_of_odd_events() -> None:
    record = _mutated(
        events=[
            {"t": "later", "event": "request_accepted"},
            {"t": float("nan"), "event": "attempt_started", "attempt": 2},
            {"event": "x", "attempt": "2"},
        ]
    )
    doc = as_json(record)
    assert doc["admitted_at"] is None
    assert doc["t_ms_from"] == 1796134588.910809  # the only usable stamp: the lease grant
    assert [(e["event"], e["t_ms"]) for e in doc["events"]] == [("request_accepted", None), ("x", None)]
    assert [a["attempt"] for a in doc["attempts"]] == [1, 2]
    assert doc["attempts"][1]["events"][0]["t"] is None  # NaN is not JSON
    assert not math.isnan(doc["attempts"][0]["lease"]["granted_ms"])


def test_as_json_of_omitted_trace() -> None:
    doc = as_json(omitted())
    assert doc["trace_omitted"] == "omitted: clean completion (journal.trace_clean_completions)"
    assert doc["events"] == [] and doc["attempts"][0]["events"] == []
    assert doc["attempts"][0]["lease"]["granted_ms"] == 0.0
