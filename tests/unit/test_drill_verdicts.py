"""The drill's verdicts are pure functions of recorded evidence: each scenario's judge is fed bytes, a
journal record and replica log records shaped like the real ones (taken from runs against a local gateway)
and must pass the honest ones and name exactly what is wrong in the broken ones. Also: the evidence
reader, the report's shape, the scenario selection and the hook command rendering."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from router_testbed.drill import apis
from router_testbed.drill import verdicts as v
from router_testbed.drill.cli import Options, UsageError, select
from router_testbed.drill.evidence import Exchange, HookRun, journal_settled, read_events
from router_testbed.drill.hooks import Hooks, render, run_shell
from router_testbed.drill.report import RunInfo, html_report, to_json, verdict_table
from router_testbed.drill.scenarios import BY_NAME, Result

KEY = "drill-x-scenario-1"
T0 = 1_000.0
REPLICA_A, REPLICA_B = "127.0.0.1:5001", "127.0.0.1:5002"
WORDS = ("xo", "effn", " cbpkc", "swg", "ay", " ztf", "q", "lm")


# --- recorded evidence, built like the gateway and the simulator write it -----------------------------


def sse(payload: Any) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


def role(cid: str = "chatcmpl-a") -> bytes:
    return sse({"id": cid, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})


def content(i: int, cid: str = "chatcmpl-a", finish: str | None = None) -> bytes:
    choice = {"index": 0, "delta": {"content": WORDS[i - 1]}, "finish_reason": finish}
    return sse({"id": cid, "choices": [choice], "usage": {"completion_tokens": i}})


def frame(delivered: int, request_id: str = KEY, code: str = "upstream_decode_interrupted") -> bytes:
    error = {
        "code": code,
        "message": "upstream ended without [DONE]",
        "request_id": request_id,
        "partial_output": True,
        "delivered_output_tokens": delivered,
        "retryable": False,
    }
    return b"data: " + json.dumps({"error": error}).encode() + b"\n\n"


DONE = sse("[DONE]")


def answer(n: int = 8, cid: str = "chatcmpl-a") -> list[bytes]:
    return [role(cid), *(content(i, cid, "length" if i == n else None) for i in range(1, n + 1)), DONE]


def attempt(
    n: int,
    replica: str,
    outcome: str,
    *,
    detail: str | None = None,
    granted: float = 0.0,
    revoked: float = 0.1,
) -> dict[str, Any]:
    return {
        "attempt": n,
        "attempt_id": f"att_{n}",
        "replica": replica,
        "outcome": outcome,
        "detail": detail,
        "status": 200,
        "lease": {
            "lease_id": f"l{n}",
            "granted_at": T0 + granted,
            "stopped_at": None,
            "revoked_at": T0 + revoked,
        },
        "fence": None,
    }


def record(
    phase: str,
    outcome: str,
    attempts: list[dict[str, Any]],
    *,
    delivered: int,
    first_delta: bool,
    events: list[tuple[str, int | None]] = (),  # type: ignore[assignment]
) -> dict[str, Any]:
    trace = [
        {"t": T0 + 0.01 * i, "event": name, **({"attempt": a} if a else {})}
        for i, (name, a) in enumerate(events)
    ]
    return {
        "request_id": KEY,
        "phase": phase,
        "outcome": outcome,
        "attempt": len(attempts),
        "first_delta_sent": first_delta,
        "delivered_output_tokens": delivered,
        "delivered_output_tokens_source": "usage",
        "attempts": attempts,
        "events": trace,
    }


def streamed(
    events: list[bytes],
    journal: dict[str, Any] | None,
    *,
    transport_error: str | None = None,
    disconnected: bool = False,
    replica_records: list[dict[str, Any]] = (),  # type: ignore[assignment]
    max_tokens: int = 8,
    api: str = "chat",
) -> Exchange:
    path = apis.API[api].path
    x = Exchange("the request", "POST", path, KEY, stream=True, max_tokens=max_tokens, api=api)
    x.sent_at, x.headers_at = T0, T0 + 0.05
    x.status = 200
    x.headers = {"content-type": "text/event-stream; charset=utf-8", "x-request-id": KEY}
    for i, e in enumerate(events):
        x.body += e
        x.arrivals.append((T0 + 0.1 + 0.01 * i, len(x.body)))
    x.ended_at = T0 + 0.2 + 0.01 * len(events)
    x.transport_error = transport_error
    if disconnected:
        x.disconnected_at = x.ended_at
    x.journal_status, x.journal = (200, journal) if journal is not None else (404, None)
    x.replica_records = list(replica_records)
    return x


def json_error(
    status: int, error: dict[str, Any], *, header: str | None = KEY, label: str = "the request"
) -> Exchange:
    x = Exchange(label, "POST", "/v1/chat/completions", KEY, stream=True)
    x.sent_at, x.headers_at, x.ended_at = T0, T0 + 0.01, T0 + 0.02
    x.status = status
    x.headers = {"content-type": "application/json", **({"x-request-id": header} if header else {})}
    x.body = json.dumps({"error": error}).encode()
    x.journal_status, x.journal = 404, {"error": {"code": "request_not_found"}}
    return x


def replica_end(
    attempt_id: str, *, outcome: str, written: int, faults: list[str] = (), gone: float | None = None
) -> list[dict[str, Any]]:  # type: ignore[assignment]
    start = {
        "event": "start",
        "replica": "a",
        "request_id": KEY,
        "attempt_id": attempt_id,
        "pid": 0,
        "t_start": T0,
    }
    end = {
        **start,
        "event": "end",
        "outcome": outcome,
        "content_events_written": written,
        "faults_fired": list(faults),
        "t_end": T0 + 0.3,
        "client_gone_at": gone,
    }
    return [start, end]


def failed_checks(verdict: v.Verdict) -> list[tuple[str, str]]:
    return [(c.what, c.seen) for c in verdict.failed]


COMPLETE = record(
    "completed", "completed", [attempt(1, REPLICA_A, "completed")], delivered=8, first_delta=True
)


# --- the evidence reader ------------------------------------------------------------------------------


def test_reader_splits_events_as_a_client_does() -> None:
    body = b": keep-alive\r\n\r\n" + role() + content(1) + b"data: not json\n\n" + DONE + b'data: {"par'
    view = read_events(body)
    assert [e.kind for e in view.events] == ["comment", "role", "content", "unparseable", "done"]
    assert view.torn_tail == b'data: {"par'
    assert view.delivered_tokens == 1 and view.text == "xo"


def test_each_event_is_stamped_with_the_arrival_of_its_last_byte() -> None:
    x = streamed(answer(2), COMPLETE)
    view = v.read_stream(x)
    assert [e.t for e in view.events] == [T0 + 0.1, T0 + 0.11, T0 + 0.12, T0 + 0.13]


def test_a_clean_completion_without_its_trace_is_settled() -> None:
    assert journal_settled({"phase": "completed", "events": [], "trace": "omitted: clean completion"})
    assert not journal_settled({"phase": "completed", "events": []})
    assert not journal_settled({"phase": "decode", "events": [{"event": "stream_completed"}]})
    assert journal_settled({"phase": "failed", "events": [{"event": "request_failed"}]})


# --- healthy ------------------------------------------------------------------------------------------


def test_healthy_passes_one_complete_answer() -> None:
    verdict = v.judge_healthy(v.Evidence([streamed(answer(), COMPLETE)]))
    assert verdict.passed, failed_checks(verdict)
    assert "client: one complete answer: exactly one [DONE], last; no error frame; no reset" in [
        c.what for c in verdict.checks
    ]


def test_healthy_fails_on_content_of_two_attempts() -> None:
    spliced = [role(), content(1), content(2, cid="chatcmpl-b"), *answer()[3:]]
    verdict = v.judge_healthy(v.Evidence([streamed(spliced, COMPLETE)]))
    assert (
        "client: every event comes from one completion (content from at most one attempt)",
        "completion ids ['chatcmpl-a', 'chatcmpl-b']",
    ) in failed_checks(verdict)


def test_healthy_fails_on_a_silent_end_and_says_what_the_client_got() -> None:
    cut = answer()[:-1]
    verdict = v.judge_healthy(v.Evidence([streamed(cut, COMPLETE)]))
    assert failed_checks(verdict) == [
        (
            "client: one complete answer: exactly one [DONE], last; no error frame; no reset",
            "HTTP 200, 8 content events, 0× [DONE]",
        )
    ]


def test_healthy_fails_when_the_journal_count_differs_from_the_client() -> None:
    journal = {**COMPLETE, "delivered_output_tokens": 7}
    verdict = v.judge_healthy(v.Evidence([streamed(answer(), journal)]))
    assert failed_checks(verdict) == [
        (
            "journal: delivered_output_tokens equals what the client got",
            "journal 7 (usage), client 8 (8 content events, usage 8)",
        )
    ]


def test_healthy_fails_without_a_journal_record() -> None:
    verdict = v.judge_healthy(v.Evidence([streamed(answer(), None)]))
    assert failed_checks(verdict) == [
        (
            f"journal: the record of {KEY} is readable by its id and reached a terminal phase",
            "no journal record (look-up answered HTTP 404)",
        )
    ]


def test_the_text_oracle_catches_a_repeated_fragment() -> None:
    repeated = [role(), content(1), content(1), content(2), DONE]
    x = streamed(repeated, COMPLETE)
    x.expected_pieces = WORDS
    verdict = v.judge_healthy(v.Evidence([x], sim=True))
    assert (
        "client: the delivered text is a prefix of the one generation (no repeated fragment, no 2nd answer)",
        "got 'xoxoeffn', expected 'xoeffn cbpkc'",
    ) in failed_checks(verdict)


# --- a failure before the first delta: retried invisibly ----------------------------------------------

RETRIED = record(
    "completed",
    "completed",
    [
        attempt(1, REPLICA_A, "failed", detail="connection_lost", revoked=0.05),
        attempt(2, REPLICA_B, "completed", granted=0.06),
    ],
    delivered=8,
    first_delta=True,
    events=[("attempt_started", 1), ("attempt_failed", 1), ("retry_triggered", None), ("attempt_started", 2)],
)


def test_retried_passes_with_the_replicas_own_account() -> None:
    x = streamed(
        answer(),
        RETRIED,
        replica_records=replica_end("att_1", outcome="fault:reset", written=0, faults=["reset@role"]),
    )
    verdict = v.judge_retried(v.Evidence([x], sim=True))
    assert verdict.passed, failed_checks(verdict)


def test_retried_fails_when_leases_overlap() -> None:
    overlapping = json.loads(json.dumps(RETRIED))
    overlapping["attempts"][0]["lease"]["revoked_at"] = T0 + 0.5
    verdict = v.judge_retried(v.Evidence([streamed(answer(), overlapping)]))
    assert failed_checks(verdict) == [
        (
            "journal: no two attempts held a valid lease at once (each revoked before the next was granted)",
            "attempt 1's lease revoked at 1000.5, 0.440s after attempt 2's was granted",
        )
    ]


def test_retried_fails_when_nothing_was_retried() -> None:
    verdict = v.judge_retried(v.Evidence([streamed(answer(), COMPLETE)]))
    assert failed_checks(verdict) == [
        ("journal: exactly 2 attempts", f"1 attempt: #1 on {REPLICA_A}: completed")
    ]


def test_retried_fails_when_the_dead_attempt_wrote_content() -> None:
    records = replica_end("att_1", outcome="fault:reset", written=2, faults=["reset@after:2"])
    verdict = v.judge_retried(v.Evidence([streamed(answer(), RETRIED, replica_records=records)], sim=True))
    assert [c.what for c in verdict.failed] == [
        "replica log: the fault fired on attempt 1, before any content event was written"
    ]


# --- after the first delta ------------------------------------------------------------------------------

INTERRUPTED = record(
    "interrupted",
    "upstream_decode_interrupted",
    [attempt(1, REPLICA_A, "interrupted")],
    delivered=2,
    first_delta=True,
    events=[("attempt_started", 1), ("first_delta_sent", 1), ("stream_reset", None)],
)


def test_death_after_first_delta_passes_with_a_reset_and_the_count_bounded() -> None:
    x = streamed(
        [role(), content(1), content(2)], INTERRUPTED, transport_error="RemoteProtocolError: peer closed"
    )
    x.replica_records = replica_end("att_1", outcome="fault:reset", written=2)
    verdict = v.judge_death_after_first_delta(v.Evidence([x], sim=True, expect={"content_before_fault": 2}))
    assert verdict.passed, failed_checks(verdict)


def test_death_after_first_delta_fails_when_the_journal_counts_more_than_the_replica_wrote() -> None:
    journal = {**INTERRUPTED, "delivered_output_tokens": 5}
    x = streamed(
        [role(), content(1), content(2)], journal, transport_error="RemoteProtocolError: peer closed"
    )
    x.replica_records = replica_end("att_1", outcome="fault:reset", written=2)
    verdict = v.judge_death_after_first_delta(v.Evidence([x], sim=True))
    assert failed_checks(verdict) == [
        (
            "journal: delivered_output_tokens is at least what the client read and at most what the replica "
            "wrote (a reset drops what was in flight)",
            "journal 5, client read 2, replica wrote 2 (max_tokens 8)",
        )
    ]


def test_death_after_first_delta_fails_on_a_second_answer() -> None:
    journal = record(
        "interrupted",
        "upstream_decode_interrupted",
        [attempt(1, REPLICA_A, "failed"), attempt(2, REPLICA_B, "interrupted")],
        delivered=3,
        first_delta=True,
        events=[
            ("attempt_started", 1),
            ("first_delta_sent", 1),
            ("attempt_started", 2),
            ("stream_reset", None),
        ],
    )
    x = streamed(
        [role(), content(1), content(2), role("chatcmpl-b"), content(1, "chatcmpl-b")],
        journal,
        transport_error="ReadError: x",
    )
    verdict = v.judge_death_after_first_delta(v.Evidence([x], sim=True))
    assert [c.what for c in verdict.failed] == [
        "client: every event comes from one completion (content from at most one attempt)",
        "journal: no attempt after the first delta (one attempt delivered; any earlier one failed before "
        "content)",
    ]
    assert verdict.failed[1].seen == (
        f"#1 on {REPLICA_A}: failed; #2 on {REPLICA_B}: interrupted; "
        "attempt(s) [2] started after the first delta"
    )


def test_a_retry_before_the_first_delta_then_an_interruption_is_honest() -> None:
    journal = record(
        "interrupted",
        "upstream_decode_interrupted",
        [attempt(1, REPLICA_A, "failed", detail="replica_lost"), attempt(2, REPLICA_B, "interrupted")],
        delivered=3,
        first_delta=True,
        events=[
            ("attempt_started", 1),
            ("attempt_started", 2),
            ("first_delta_sent", 2),
            ("stream_terminated", None),
        ],
    )
    x = streamed([role(), content(1), content(2), content(3), frame(3), DONE], journal)
    verdict = v.judge_frame_after_first_delta(v.Evidence([x]))
    assert verdict.passed, failed_checks(verdict)
    assert verdict.notes == [
        f"retried before the first delta: #1 on {REPLICA_A}: failed (replica_lost); "
        f"#2 on {REPLICA_B}: interrupted"
    ]


def test_with_hooks_a_kill_after_the_stream_completed_proves_nothing() -> None:
    x = streamed(answer(), COMPLETE)
    kill = HookRun("kill", REPLICA_A, "kill -9 ...", T0 + 5, T0 + 5.1, 0)
    verdict = v.judge_death_after_first_delta(v.Evidence([x], hooks=[kill]))
    first = verdict.failed[0]
    assert first.what == "hook: the kill landed after the first delta, while the stream was still running"
    assert first.seen.endswith("; the answer had completed: use a longer answer (--long-tokens)")


def test_a_failed_hook_is_a_failed_scenario_with_its_output() -> None:
    x = streamed([role(), content(1)], INTERRUPTED, transport_error="ReadError: x")
    kill = HookRun("kill", REPLICA_A, "ssh nope", T0 + 0.11, T0 + 0.36, 255, "ssh: connect refused")
    verdict = v.judge_death_after_first_delta(v.Evidence([x], hooks=[kill]))
    assert (
        "hook: the kill hook ran against the serving replica and succeeded",
        f"kill {REPLICA_A} (exit 255, 0.25s): ssh: connect refused",
    ) == (verdict.failed[0].what, verdict.failed[0].seen)


TERMINATED = record(
    "interrupted",
    "upstream_decode_interrupted",
    [attempt(1, REPLICA_A, "interrupted")],
    delivered=3,
    first_delta=True,
    events=[("attempt_started", 1), ("first_delta_sent", 1), ("stream_terminated", None)],
)


def test_ends_without_done_passes_with_one_frame_counting_the_client() -> None:
    x = streamed([role(), content(1), content(2), content(3), frame(3), DONE], TERMINATED)
    verdict = v.judge_frame_after_first_delta(v.Evidence([x], expect={"content_before_fault": 3}))
    assert verdict.passed, failed_checks(verdict)


def test_a_silent_cut_is_a_violation() -> None:
    x = streamed([role(), content(1), content(2), content(3)], TERMINATED)
    verdict = v.judge_frame_after_first_delta(v.Evidence([x], expect={"content_before_fault": 3}))
    assert failed_checks(verdict) == [
        (
            "client: exactly one terminal error frame, then [DONE], last",
            "HTTP 200, 3 content events, 0× [DONE]; last events ['chunk', 'chunk', 'chunk']",
        )
    ]


def test_the_replicas_raw_in_band_error_must_not_reach_the_client() -> None:
    raw = b'data: {"error": {"message": "EngineCore encountered an issue", "code": 500}}\n\n'
    x = streamed(
        [role(), content(1), content(2), raw, frame(2), DONE], {**TERMINATED, "delivered_output_tokens": 2}
    )
    verdict = v.judge_frame_after_first_delta(v.Evidence([x], expect={"content_before_fault": 2}))
    assert failed_checks(verdict) == [
        (
            "client: exactly one terminal error frame, then [DONE], last",
            "HTTP 200, 2 content events, 2 error frames [500, 'upstream_decode_interrupted'], 1× [DONE]; "
            "last events ['error:500', 'error:upstream_decode_interrupted', '[DONE]']",
        )
    ]


def test_a_frame_that_miscounts_is_a_violation() -> None:
    x = streamed([role(), content(1), content(2), content(3), frame(2), DONE], TERMINATED)
    verdict = v.judge_frame_after_first_delta(v.Evidence([x]))
    assert failed_checks(verdict) == [
        (
            "client: the frame's delivered_output_tokens equals what the client got",
            "frame 2, client 3 (3 content events, usage 3)",
        )
    ]


def test_frozen_replica_needs_a_frame_and_the_loss_in_the_trace() -> None:
    journal = {
        **TERMINATED,
        "events": [*TERMINATED["events"], {"t": T0 + 3, "event": "replica_lost", "attempt": 1}],
    }
    freeze = HookRun("freeze", REPLICA_A, "kill -STOP", T0 + 0.11, T0 + 0.12, 0)
    good = streamed([role(), content(1), content(2), content(3), frame(3), DONE], journal)
    ev = v.Evidence([good], hooks=[freeze], expect={"end_within_seconds": 30})
    assert v.judge_frozen_after_first_delta(ev).passed
    reset = streamed(
        [role(), content(1)], {**journal, "delivered_output_tokens": 1}, transport_error="ReadError: x"
    )
    bad = v.judge_frozen_after_first_delta(
        v.Evidence([reset], hooks=[freeze], expect={"end_within_seconds": 30})
    )
    assert [c.what for c in bad.failed] == ["client: exactly one terminal error frame, then [DONE], last"]


# --- client disconnect ----------------------------------------------------------------------------------

CANCELLED = record(
    "cancelled",
    "client_disconnected",
    [attempt(1, REPLICA_A, "cancelled")],
    delivered=3,
    first_delta=True,
    events=[("attempt_started", 1), ("first_delta_sent", 1), ("client_disconnected", None)],
)


def test_client_disconnect_passes_when_the_replica_saw_the_client_go() -> None:
    x = streamed([role(), content(1), content(2), content(3)], CANCELLED, disconnected=True, max_tokens=40)
    x.replica_records = replica_end("att_1", outcome="client_gone", written=3, gone=T0 + 0.25)
    verdict = v.judge_client_disconnect(v.Evidence([x], sim=True))
    assert verdict.passed, failed_checks(verdict)


def test_client_disconnect_fails_when_another_attempt_started_after() -> None:
    journal = json.loads(json.dumps(CANCELLED))
    journal["events"].append({"t": T0 + 5, "event": "attempt_started", "attempt": 2})
    x = streamed([role(), content(1), content(2), content(3)], journal, disconnected=True, max_tokens=40)
    x.replica_records = replica_end("att_1", outcome="completed", written=40)
    verdict = v.judge_client_disconnect(v.Evidence([x], sim=True))
    assert [c.what for c in verdict.failed] == [
        "journal: no attempt started after the client left",
        "replica log: exactly one replica request for this id, and it saw the client go (cancelled)",
    ]


def test_client_disconnect_without_replica_logs_is_noted() -> None:
    x = streamed([role(), content(1), content(2), content(3)], CANCELLED, disconnected=True, max_tokens=40)
    verdict = v.judge_client_disconnect(v.Evidence([x], sim=True))
    assert verdict.passed
    assert verdict.notes == ["no replica log given (--replica-log): the replica-side cancel was not checked"]


# --- slow replica, all failing --------------------------------------------------------------------------


def test_slow_replica_fails_on_a_failover_for_slowness() -> None:
    x = streamed(answer(), RETRIED)
    verdict = v.judge_slow_replica(v.Evidence([x], expect={"min_first_content_seconds": 1.0}))
    whats = [c.what for c in verdict.failed]
    assert "journal: exactly 1 attempt" in whats
    assert (
        "journal: no failover for slowness (no attempt_failed, retry_triggered, replica_lost or fence)"
        in whats
    )
    assert "client: the first content came after the replica's 1s delay (the slowness was real)" in whats


def test_slow_replica_passes_when_late_but_whole() -> None:
    x = streamed(answer(), COMPLETE)
    x.arrivals = [(T0 + 1.2 + t - T0, n) for t, n in x.arrivals]
    verdict = v.judge_slow_replica(v.Evidence([x], expect={"min_first_content_seconds": 1.0}))
    assert verdict.passed, failed_checks(verdict)


FAILED = record(
    "failed",
    "retries_exhausted",
    [attempt(1, REPLICA_A, "failed", revoked=0.05), attempt(2, REPLICA_B, "failed", granted=0.06)],
    delivered=0,
    first_delta=False,
    events=[("attempt_started", 1), ("attempt_failed", 1), ("attempt_started", 2), ("request_failed", None)],
)


def test_all_replicas_fail_passes_with_one_json_error() -> None:
    x = json_error(502, {"code": "retries_exhausted", "message": "2 attempts failed", "request_id": KEY})
    x.journal_status, x.journal = 200, FAILED
    assert v.judge_all_replicas_fail(v.Evidence([x])).passed


def test_all_replicas_fail_must_never_leak_a_dead_attempts_bytes() -> None:
    x = streamed([role()], FAILED)
    verdict = v.judge_all_replicas_fail(v.Evidence([x]))
    assert failed_checks(verdict)[0] == (
        "client: one JSON error, HTTP 502/503, code retries_exhausted",
        "HTTP 200 text/event-stream; charset=utf-8 " + repr(role().decode()),
    )
    assert "client: no SSE bytes of any attempt, no replica's raw error in the body" in [
        c.what for c in verdict.failed
    ]


def test_an_error_that_does_not_name_the_request_is_a_violation() -> None:
    x = json_error(502, {"code": "retries_exhausted", "message": "..."})
    x.journal_status, x.journal = 200, FAILED
    verdict = v.judge_all_replicas_fail(v.Evidence([x]))
    assert failed_checks(verdict) == [
        (
            "client: the JSON error names this request (error.request_id)",
            f"error.request_id None, sent key {KEY!r}",
        )
    ]


# --- duplicate key, malformed input, tool replay ---------------------------------------------------------


def _duplicate(dup_status: int, dup_error: dict[str, Any], *, dup_ended: float) -> v.Evidence:
    first = streamed(answer(), COMPLETE)
    first.label = "the first request"
    dup = json_error(dup_status, dup_error, label="the duplicate")
    dup.ended_at = dup_ended
    after = json_error(
        409,
        {"code": "request_already_finished", "request_id": KEY, "outcome": "completed"},
        label="after completion",
    )
    return v.Evidence([first, dup, after])


def test_duplicate_key_passes_with_409_in_flight() -> None:
    ev = _duplicate(409, {"code": "idempotency_key_in_flight", "request_id": KEY}, dup_ended=T0 + 0.15)
    verdict = v.judge_duplicate_key(ev)
    assert verdict.passed, failed_checks(verdict)


def test_duplicate_key_answered_after_the_first_ended_may_say_finished() -> None:
    ev = _duplicate(409, {"code": "request_already_finished", "request_id": KEY}, dup_ended=T0 + 9)
    assert v.judge_duplicate_key(ev).passed


def test_duplicate_key_that_was_served_twice_is_a_violation() -> None:
    ev = _duplicate(409, {"code": "request_already_finished", "request_id": KEY}, dup_ended=T0 + 0.15)
    assert failed_checks(v.judge_duplicate_key(ev)) == [
        (
            "duplicate: 409 idempotency_key_in_flight naming the same request id (sent while the first was "
            "streaming)",
            f"HTTP 409 {json.dumps({'error': {'code': 'request_already_finished', 'request_id': KEY}})!r}",
        )
    ]


@pytest.mark.parametrize(
    ("duplicate_cancelled", "passes"),
    [(True, True), (False, False)],
    ids=["a duplicate that reached a replica was cancelled", "a duplicate generated an answer too"],
)
def test_duplicate_key_one_replica_request_generated_the_answer(
    duplicate_cancelled: bool, passes: bool
) -> None:
    ev = _duplicate(409, {"code": "idempotency_key_in_flight", "request_id": KEY}, dup_ended=T0 + 0.15)
    ev.sim = True
    first = ev.get("the first request")
    assert first is not None
    first.replica_records = [
        {"event": "start", "attempt_id": "a1"},
        {"event": "start", "attempt_id": "a2"},
        {"event": "end", "attempt_id": "a1", "client_gone_at": None},
        {"event": "end", "attempt_id": "a2", "client_gone_at": T0 + 0.1 if duplicate_cancelled else None},
    ]
    verdict = v.judge_duplicate_key(ev)
    assert verdict.passed is passes, failed_checks(verdict)


def _malformed(unknown_model: Exchange) -> v.Evidence:
    bad = json_error(
        400, {"code": "invalid_json", "message": "not JSON", "request_id": KEY}, label="invalid JSON"
    )
    big = json_error(
        413, {"code": "request_too_large", "message": "too big", "request_id": KEY}, label="oversize body"
    )
    expect = {"codes": {"invalid JSON": "invalid_json", "oversize body": "request_too_large"}}
    return v.Evidence([bad, big, unknown_model], expect=expect)


def test_malformed_input_passes_and_notes_a_replicas_own_404() -> None:
    unknown = json_error(
        404,
        {"message": "The model `x` does not exist.", "type": "NotFoundError", "code": 404},
        label="unknown model",
    )
    unknown.journal_status = 200
    unknown.journal = record(
        "failed", "upstream_error", [attempt(1, REPLICA_A, "passed_through")], delivered=0, first_delta=False
    )
    verdict = v.judge_malformed_input(_malformed(unknown))
    assert verdict.passed, failed_checks(verdict)
    assert verdict.notes == [
        "unknown model: HTTP 404 is the replica's own error, passed through; its body does not name the "
        "request (only x-request-id does)"
    ]


def test_a_body_that_is_not_json_but_was_served_is_a_violation() -> None:
    served = streamed(answer(), COMPLETE)
    served.label = "invalid JSON"
    ev = _malformed(json_error(404, {"code": "model_not_found", "message": "no", "request_id": KEY}))
    ev.exchanges[0] = served
    verdict = v.judge_malformed_input(ev)
    assert [c.what for c in verdict.failed] == [
        "invalid JSON: a 4xx JSON error with code invalid_json",
        "invalid JSON: no SSE bytes, no replica's raw 5xx error",
        "invalid JSON: the JSON error names this request (error.request_id)",
        "invalid JSON: journal: nothing journaled as served (no content delivered, no attempt released)",
    ]


def test_an_engine_that_serves_any_model_name_is_noted_not_failed() -> None:
    """SGLang ignores the model field: with static replicas the gateway cannot know the served models."""
    served = streamed(answer(), COMPLETE)
    served.label = "unknown model"
    verdict = v.judge_malformed_input(_malformed(served))
    assert verdict.passed, [c.what for c in verdict.failed]
    assert [n.split(":")[0] for n in verdict.notes] == ["unknown model"]
    assert "served a model name it was never given" in verdict.notes[0]


def test_a_gateway_error_without_its_header_is_noted_not_failed() -> None:
    unknown = json_error(
        404, {"code": "model_not_found", "message": "no", "request_id": KEY}, label="unknown model"
    )
    ev = _malformed(unknown)
    ev.exchanges[1].headers.pop("x-request-id")
    verdict = v.judge_malformed_input(ev)
    assert verdict.passed
    assert verdict.notes == [
        "oversize body: HTTP 413 came without the x-request-id header (absent); its body names the request"
    ]


def _tool(status: int, body: bytes, replay: str | None, label: str) -> Exchange:
    x = Exchange(label, "POST", "/tools/pay/drill", f"{KEY}:call_01")
    x.status, x.body = status, body
    x.headers = {"content-type": "application/json", **({"x-idempotent-replay": replay} if replay else {})}
    return x


def test_tool_replay_passes_with_the_stored_answer() -> None:
    answer_ = b'{"result":"ok-1","execution":1}'
    reused = json.dumps({"error": {"code": "idempotency_key_reused"}}).encode()
    ev = v.Evidence(
        [
            _tool(200, answer_, None, "the call"),
            _tool(200, answer_, "true", "the same call again"),
            _tool(422, reused, None, "another body, same key"),
        ]
    )
    assert v.judge_tool_replay(ev).passed


def test_a_tool_call_executed_twice_is_a_violation() -> None:
    reused = json.dumps({"error": {"code": "idempotency_key_reused"}}).encode()
    ev = v.Evidence(
        [
            _tool(200, b'{"execution":1}', None, "the call"),
            _tool(200, b'{"execution":2}', None, "the same call again"),
            _tool(422, reused, None, "another body, same key"),
        ]
    )
    assert failed_checks(v.judge_tool_replay(ev)) == [
        (
            "the same call again: the stored answer (same status and bytes) with x-idempotent-replay: true",
            "HTTP 200, x-idempotent-replay None, body '{\"execution\":2}'",
        )
    ]


def test_a_scenario_that_recorded_nothing_fails() -> None:
    assert failed_checks(v.judge_healthy(v.Evidence([]))) == [
        ("the drill recorded the request", "nothing was recorded (the scenario did not run)")
    ]


# --- selection, hooks, report -----------------------------------------------------------------------------


def _names(options: Options, hooks: Hooks | None = None) -> tuple[str, list[str]]:
    mode, chosen = select(options, hooks or Hooks())
    return mode, [s.name for s in chosen]


def test_each_fault_mode_runs_what_it_can_produce() -> None:
    mode, sim = _names(Options("http://127.0.0.1:1"))
    assert mode == "sim" and "dies-in-prefill" in sim and "frozen-after-first-delta" not in sim
    assert "tool-replay" not in sim
    assert _names(Options("http://127.0.0.1:1", fault_mode="none"))[1] == [
        "healthy",
        "client-disconnect",
        "duplicate-key",
        "malformed-input",
    ]
    hooks = Hooks({"kill": "k {replica}", "freeze": "f", "thaw": "t"})
    mode, chosen = _names(Options("http://127.0.0.1:1", tool="pay"), hooks)
    # A hook scenario hurts a replica: it runs after the others, the kill last.
    assert mode == "hooks" and chosen[-2:] == ["frozen-after-first-delta", "dies-after-first-delta"]
    assert "tool-replay" in chosen


@pytest.mark.parametrize(
    ("options", "hooks", "message"),
    [
        (Options("127.0.0.1:8080"), Hooks(), "is not an http(s) URL"),
        (Options("http://h", scenarios=["nope"]), Hooks(), "unknown scenario(s) nope"),
        (
            Options("http://h", scenarios=["dies-in-prefill"], fault_mode="none"),
            Hooks(),
            "dies-in-prefill needs a fault",
        ),
        (
            Options("http://h", scenarios=["dies-after-first-delta"], fault_mode="hooks"),
            Hooks(),
            "needs --kill-cmd",
        ),
        (Options("http://h", scenarios=["tool-replay"]), Hooks(), "tool-replay needs --tool NAME"),
        (Options("http://h"), Hooks({"freeze": "f"}), "--freeze-cmd needs --thaw-cmd"),
    ],
)
def test_usage_errors_say_what_to_change(options: Options, hooks: Hooks, message: str) -> None:
    with pytest.raises(UsageError) as caught:
        select(options, hooks)
    assert message in str(caught.value)


def test_hook_commands_get_the_replica_shell_quoted() -> None:
    assert render("kill $(cat /run/{port}.pid) # {replica} on {host}", "10.0.0.5:8000") == (
        "kill $(cat /run/8000.pid) # 10.0.0.5:8000 on 10.0.0.5"
    )
    assert render("echo {replica}", "a b:1; rm -rf x") == "echo 'a b:1; rm -rf x'"
    assert run_shell("echo out; exit 3", 5) == (3, "out\n")
    code, _ = run_shell("sleep 5", 0.2)
    assert code is None


def test_the_report_has_one_picture_per_request_and_nothing_external() -> None:
    ok = v.judge_healthy(v.Evidence([streamed(answer(), COMPLETE)]))
    retried = streamed(
        answer(), RETRIED, replica_records=replica_end("att_1", outcome="fault:reset", written=0)
    )
    bad = v.judge_retried(v.Evidence([streamed(answer(), COMPLETE)]))  # one attempt: not retried
    results = [
        Result(BY_NAME["healthy"], ok, v.Evidence([streamed(answer(), COMPLETE)]), "none", 0.1),
        Result(
            BY_NAME["dies-in-prefill"], bad, v.Evidence([retried, streamed(answer(), COMPLETE)]), "x", 0.2
        ),
    ]
    info = RunInfo("http://127.0.0.1:1", "sim", "tiny", "r1", T0, 0.3)
    page = html_report(info, results)
    assert page.count("<svg") == 3 and page.count("</svg>") == 3
    # Self-contained: no script, no fetched asset (the only URLs are the SVG namespace and the gateway's).
    assert "<script" not in page and "src=" not in page and "url(" not in page and "@import" not in page
    assert set(re.findall(r'https?://[^"<\s]+', page)) == {"http://www.w3.org/2000/svg", info.gateway}
    data = to_json(info, results)
    assert data["passed"] is False and [len(s["exchanges"]) for s in data["scenarios"]] == [1, 2]
    table = verdict_table(results)
    assert table.splitlines()[0].split()[:2] == ["scenario", "api"]
    assert table.splitlines()[1].split()[:4] == ["healthy", "chat", "none", "PASS"]


# --- a replica frozen before the first delta: fenced, then retried ---------------------------------------

FENCED = record(
    "completed",
    "completed",
    [
        attempt(1, REPLICA_A, "failed", detail="replica_lost", revoked=0.05),
        attempt(2, REPLICA_B, "completed", granted=0.06),
    ],
    delivered=8,
    first_delta=True,
    events=[("attempt_started", 1), ("replica_lost", 1), ("attempt_fenced", 1), ("attempt_started", 2)],
)
FENCED["events"][2]["proof"] = "connection_closed"


def _frozen(journal: dict[str, Any], replica: str = REPLICA_A) -> v.Evidence:
    freeze = HookRun("freeze", replica, "kill -STOP", T0 + 0.01, T0 + 0.02, 0)
    return v.Evidence([streamed(answer(), journal)], sim=True, hooks=[freeze])


def test_frozen_in_prefill_passes_when_fenced_before_the_retry() -> None:
    verdict = v.judge_frozen_in_prefill(_frozen(FENCED))
    assert verdict.passed, failed_checks(verdict)


def test_frozen_in_prefill_fails_when_the_retry_started_before_the_fence() -> None:
    early = json.loads(json.dumps(FENCED))
    early["events"][3]["t"] = T0 + 0.015  # attempt 2 started between the loss and the fence
    verdict = v.judge_frozen_in_prefill(_frozen(early))
    assert [c.what for c in verdict.failed] == [
        "journal: no two attempts held a valid lease at once (each revoked before the next was granted)",
        "journal: attempt 1 was lost, then fenced with a proof, before attempt 2 started",
    ]
    assert verdict.failed[0].seen == "attempt 2 started at 1000.015 before attempt 1 was fenced"


def test_frozen_in_prefill_names_the_wrong_replica() -> None:
    verdict = v.judge_frozen_in_prefill(_frozen(FENCED, replica=REPLICA_B))
    assert failed_checks(verdict) == [
        (
            "hook: the frozen replica is the one that held attempt 1",
            f"froze {REPLICA_B}, attempt 1 on {REPLICA_A}",
        )
    ]


def test_a_retry_on_the_same_replica_is_noted() -> None:
    same = json.loads(json.dumps(RETRIED))
    same["attempts"][1]["replica"] = REPLICA_A
    verdict = v.judge_retried(v.Evidence([streamed(answer(), same)]))
    assert verdict.passed
    assert verdict.notes == [f"the retry ran on the same replica ({REPLICA_A}): no other was healthy then"]


# --- another gateway: what only router-sidecar keeps is not applicable, never a violation -------------


def test_against_another_gateway_the_journal_and_frame_fields_are_not_applicable() -> None:
    # Any gateway's terminal error is honest if it is explicit: one error event, then [DONE].
    other_frame = b'data: {"error": {"message": "upstream went away"}}\n\n'
    x = streamed([role(), content(1), content(2), content(3), other_frame, DONE], None)
    verdict = v.judge_frame_after_first_delta(
        v.Evidence([x], expect={"content_before_fault": 3}, router_sidecar=False)
    )
    assert verdict.passed, failed_checks(verdict)
    assert [c.what for c in verdict.checks if c.ok is None] == [
        "client: the frame says code=upstream_decode_interrupted, this request_id, partial_output=true, "
        "retryable=false",
        "client: the frame's delivered_output_tokens equals what the client got",
        f"journal: the record of {KEY} and every check that reads it",
    ]
    assert {c.seen for c in verdict.checks if c.ok is None} == {v.NOT_ROUTER_SIDECAR}
    # The silent cut stays a violation whoever the gateway is.
    cut = streamed([role(), content(1), content(2), content(3)], None)
    verdict = v.judge_frame_after_first_delta(
        v.Evidence([cut], expect={"content_before_fault": 3}, router_sidecar=False)
    )
    assert [what for what, _ in failed_checks(verdict)] == [
        "client: exactly one terminal error frame, then [DONE], last"
    ]


def test_all_replicas_failing_behind_another_gateway_needs_one_json_error_with_any_code() -> None:
    x = json_error(503, {"message": "no healthy upstream", "code": "service_unavailable"}, header=None)
    verdict = v.judge_all_replicas_fail(
        v.Evidence([x], expect={"code": "retries_exhausted"}, router_sidecar=False)
    )
    assert verdict.passed, failed_checks(verdict)
    assert "client: HTTP 502/503, code retries_exhausted" in [c.what for c in verdict.checks if c.ok is None]


def test_a_retry_behind_another_gateway_needs_the_replicas_account() -> None:
    def judged(records: list[dict[str, Any]]) -> v.Verdict:
        x = streamed(answer(), None, replica_records=records)
        return v.judge_retried(v.Evidence([x], sim=True, router_sidecar=False))

    assert "give the replicas' logs" in (judged([]).inconclusive or "")
    never_fired = replica_end("a1", outcome="completed", written=8)
    assert "x-envoy-attempt-count" in (judged(never_fired).inconclusive or "")
    retried = [
        *replica_end("a1", outcome="fault:reset", written=0, faults=["reset@role"]),
        *replica_end("a2", outcome="completed", written=8),
    ]
    verdict = judged(retried)
    assert verdict.passed and verdict.inconclusive is None, failed_checks(verdict)
    not_retried = replica_end("a1", outcome="fault:reset", written=0, faults=["reset@role"])
    assert [w for w, _ in failed_checks(judged(not_retried))] == [
        "replica log: the fault fired on an attempt before any content; another attempt wrote the answer"
    ]


def _target(*, simulator: bool, router_sidecar: bool) -> Any:
    from router_testbed.drill.cli import Target

    return Target("tiny", simulator, router_sidecar)


HOOK_NEEDS_JOURNAL = "not router-sidecar: its hook finds the serving replica in router-sidecar's journal"


def test_what_does_not_apply_to_the_gateway_behind_the_url_is_not_applicable() -> None:
    from router_testbed.drill.cli import applicable

    mode, chosen = select(Options("http://h"), Hooks())
    # Not the simulator and no --fault-mode: no fault; what needs one is N/A, with why.
    mode, runnable, skipped = applicable(
        chosen, mode, _target(simulator=False, router_sidecar=True), Hooks(), None
    )
    assert mode == "none"
    assert [s.name for s in runnable] == ["healthy", "client-disconnect", "duplicate-key", "malformed-input"]
    assert {r.scenario.name for r in skipped} == {s.name for s in chosen} - {s.name for s in runnable}
    assert all(r.status == "N/A" and "x-sim-replica" in (r.not_applicable or "") for r in skipped)
    # The simulator behind another gateway: its faults run; router-sidecar's own promises do not apply.
    hooks = Hooks(functions={"freeze": lambda r: (0, ""), "thaw": lambda r: (0, "")})
    mode, chosen = select(Options("http://h", fault_mode="sim"), hooks)
    mode, runnable, skipped = applicable(
        chosen, mode, _target(simulator=True, router_sidecar=False), hooks, None
    )
    assert mode == "sim" and "dies-in-prefill" in [s.name for s in runnable]
    assert {r.scenario.name: r.not_applicable for r in skipped} == {
        "duplicate-key": "not router-sidecar: one request per Idempotency-Key (409 for a duplicate) is "
        "router-sidecar's",
        "frozen-in-prefill": HOOK_NEEDS_JOURNAL,
        "frozen-after-first-delta": HOOK_NEEDS_JOURNAL,
    }


def test_the_report_counts_what_applied() -> None:
    from router_testbed.drill.report import all_passed, summary_line
    from router_testbed.drill.scenarios import not_applicable

    healthy = v.judge_healthy(v.Evidence([streamed(answer(), None)], router_sidecar=False))
    passed = Result(BY_NAME["healthy"], healthy, v.Evidence([]), "none", 0.5)
    skipped = not_applicable(BY_NAME["duplicate-key"], "none", "not router-sidecar: ...")
    assert (passed.status, skipped.status) == ("PASS", "N/A")
    assert all_passed([passed, skipped]) and not all_passed([skipped])
    assert (
        summary_line([passed, skipped], 1.0)
        == "1/1 scenarios passed (1 not applicable to this gateway) in 1.0s"
    )
    table = verdict_table([passed, skipped])
    assert re.search(r"^  healthy +chat  none +PASS +5/5 \+1 N/A ", table, re.MULTILINE), table
    assert "N/A duplicate-key: not router-sidecar: ..." in table


def test_an_openai_style_base_url_is_taken() -> None:
    from router_testbed.drill.cli import gateway_base

    assert gateway_base("http://gw:8080/v1/") == gateway_base("http://gw:8080") == "http://gw:8080"
    assert gateway_base("https://api.example.com/openai/v1") == "https://api.example.com/openai"


# --- the Responses API and the Messages API: each judged by its own rules -----------------------------

RESP_ID, RESP_ID_B = "resp_7e1fa74e0090858e", "resp_86ec0c8b93bc3750"


def named(payload: dict[str, Any], name: str | None = None) -> bytes:
    """A named event as the engines write it: `event: <type>` then its data."""
    return f"event: {name or payload['type']}\ndata: {json.dumps(payload)}\n\n".encode()


def numbered(payloads: list[dict[str, Any]], start: int = 0) -> list[dict[str, Any]]:
    """Responses events with their sequence numbers, counted from `start`."""
    return [{**p, "sequence_number": start + i} for i, p in enumerate(payloads)]


def responses_events(n: int = 8, rid: str = RESP_ID, *, end: bool = True) -> list[dict[str, Any]]:
    """A Responses stream as vLLM writes it (sequence numbers from 0): the preamble, `n` text deltas and,
    with `end`, the closing `.done` events and `response.completed` (status incomplete: max_output_tokens)."""
    response = {"id": rid, "object": "response", "created_at": 1796410389, "model": "tiny"}
    events: list[dict[str, Any]] = [
        {"type": "response.created", "response": {**response, "status": "in_progress"}},
        {"type": "response.in_progress", "response": {**response, "status": "in_progress"}},
        {"type": "response.output_item.added", "item": {"id": "msg_1", "type": "message"}, "output_index": 0},
        {"type": "response.content_part.added", "item_id": "msg_1", "part": {"type": "output_text"}},
        *({"type": "response.output_text.delta", "delta": WORDS[i], "item_id": "msg_1"} for i in range(n)),
    ]
    if end:
        usage = {"input_tokens": 10, "output_tokens": n, "total_tokens": 10 + n}
        events += [
            {"type": "response.output_text.done", "text": "".join(WORDS[:n]), "item_id": "msg_1"},
            {"type": "response.completed", "response": {**response, "status": "incomplete", "usage": usage}},
        ]
    return numbered(events)


def response_failed(after: list[dict[str, Any]], delivered: int, *, rid: str = RESP_ID) -> dict[str, Any]:
    """Our terminal event: the client's response id, the next sequence number."""
    error = {
        "code": "upstream_decode_interrupted",
        "message": "upstream ended without response.completed",
        "request_id": KEY,
        "partial_output": True,
        "delivered_output_tokens": delivered,
        "retryable": False,
    }
    return {
        "type": "response.failed",
        "sequence_number": after[-1]["sequence_number"] + 1,
        "response": {"id": rid, "object": "response", "status": "failed", "error": error},
    }


def messages_events(n: int = 8, mid: str = "msg_01", *, end: bool = True) -> list[dict[str, Any]]:
    """A Messages stream as vLLM writes it: message_start, a text block, `n` deltas and, with `end`, the
    block's stop, message_delta (stop_reason, output tokens) and message_stop."""
    events: list[dict[str, Any]] = [
        {
            "type": "message_start",
            "message": {"id": mid, "type": "message", "role": "assistant", "content": [], "model": "tiny"},
        },
        {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
        *(
            {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": WORDS[i]}}
            for i in range(n)
        ),
    ]
    if end:
        events += [
            {"type": "content_block_stop", "index": 0},
            {"type": "message_delta", "delta": {"stop_reason": "max_tokens"}, "usage": {"output_tokens": n}},
            {"type": "message_stop"},
        ]
    return events


def messages_error(delivered: int, *, kind: str = "api_error", code: str = v.INTERRUPTED) -> dict[str, Any]:
    error = {
        "type": kind,
        "message": "upstream ended without message_stop",
        "code": code,
        "details": {"error_code": code},
        "request_id": KEY,
        "partial_output": True,
        "delivered_output_tokens": delivered,
        "retryable": False,
    }
    return {"type": "error", "error": error, "request_id": KEY}


def api_stream(
    api: str, payloads: list[dict[str, Any]], journal: dict[str, Any] | None, **kw: Any
) -> Exchange:
    return streamed([named(p) for p in payloads], journal, api=api, **kw)


def test_the_reader_knows_each_apis_events() -> None:
    view = v.read_stream(api_stream("responses", responses_events(2), COMPLETE))
    assert [e.kind for e in view.events] == ["other"] * 4 + ["content", "content", "other", "done"]
    assert (view.text, view.usage_tokens, view.ids, view.finish_reasons) == (
        "xoeffn",
        2,
        {RESP_ID},
        ["incomplete"],
    )
    assert view.sequence_numbers == list(range(8)) and view.preamble_count == 1
    view = v.read_stream(api_stream("messages", messages_events(2), COMPLETE))
    assert [e.kind for e in view.events] == ["other", "other", "content", "content", "other", "other", "done"]
    assert (view.text, view.usage_tokens, view.finish_reasons) == ("xoeffn", 2, ["max_tokens"])
    # A tool call's opening is its first content: Responses' function_call item, Messages' tool_use block.
    call = {"type": "response.output_item.added", "item": {"type": "function_call", "name": "f"}}
    tool = {"type": "content_block_start", "index": 0, "content_block": {"type": "tool_use", "name": "f"}}
    assert v.read_stream(api_stream("responses", [call], None)).events[0].kind == "content"
    assert v.read_stream(api_stream("messages", [tool], None)).events[0].kind == "content"


@pytest.mark.parametrize("api", ["responses", "messages"])
def test_a_healthy_answer_passes_on_each_api(api: str) -> None:
    payloads = responses_events() if api == "responses" else messages_events()
    x = api_stream(api, payloads, COMPLETE)
    x.expected_pieces = WORDS
    verdict = v.judge_healthy(v.Evidence([x], sim=True))
    assert verdict.passed, failed_checks(verdict)
    end = "response.completed/response.incomplete" if api == "responses" else "message_stop"
    assert f"client: one complete answer: exactly one {end}, last; no error event; no reset" in [
        c.what for c in verdict.checks
    ]


def test_responses_a_retry_must_not_add_a_second_preamble() -> None:
    """The failed attempt's response.created (another id, its own numbering from 0) reached the client
    before the winner's: two preambles, two ids, sequence numbers starting over."""
    dead = responses_events(0, RESP_ID_B, end=False)[:2]
    x = api_stream("responses", [*dead, *responses_events()], RETRIED)
    verdict = v.judge_retried(v.Evidence([x]))
    assert failed_checks(verdict) == [
        (
            "client: every event comes from one answer (one response id)",
            f"ids {sorted([RESP_ID, RESP_ID_B])}",
        ),
        (
            "client: one preamble: exactly one response.created, sequence numbers 0, 1, 2, … without a gap "
            "or repeat",
            "2 response.createds; sequence numbers [0..1, 0..13]",
        ),
    ]


def test_responses_a_gap_in_the_sequence_numbers_is_a_violation() -> None:
    events = responses_events()
    del events[5]  # one delta the client never got: the numbers jump from 4 to 6
    x = api_stream("responses", events, {**COMPLETE, "delivered_output_tokens": 8})
    verdict = v.judge_healthy(v.Evidence([x]))
    assert (
        "client: one preamble: exactly one response.created, sequence numbers 0, 1, 2, … without a gap or "
        "repeat",
        "1 response.created; sequence numbers [0..4, 6..13]",
    ) in failed_checks(verdict)


def test_responses_the_terminal_event_continues_the_clients_stream() -> None:
    prefix = responses_events(3, end=False)
    honest = api_stream("responses", [*prefix, response_failed(prefix, 3)], TERMINATED)
    verdict = v.judge_frame_after_first_delta(v.Evidence([honest], expect={"content_before_fault": 3}))
    assert verdict.passed, failed_checks(verdict)
    # Another response's id, a sequence number that starts over: not this stream's end.
    wrong = {**response_failed(prefix, 3, rid=RESP_ID_B), "sequence_number": 0}
    x = api_stream("responses", [*prefix, wrong], TERMINATED)
    verdict = v.judge_frame_after_first_delta(v.Evidence([x], expect={"content_before_fault": 3}))
    assert failed_checks(verdict) == [
        (
            "client: the terminal event continues the stream: the response id of response.created, the next "
            "sequence number",
            f"response.failed of {RESP_ID_B} (response.created: {RESP_ID}), sequence_number 0 after 6",
        ),
        (
            "client: every event comes from one answer (one response id)",
            f"ids {sorted([RESP_ID, RESP_ID_B])}",
        ),
        (
            "client: one preamble: exactly one response.created, sequence numbers 0, 1, 2, … without a gap "
            "or repeat",
            "1 response.created; sequence numbers [0..6, 0]",
        ),
    ]


def test_responses_a_silent_cut_a_done_marker_or_a_completion_after_the_failure_are_violations() -> None:
    prefix = responses_events(3, end=False)
    cut = api_stream("responses", prefix, TERMINATED)
    verdict = v.judge_frame_after_first_delta(v.Evidence([cut], expect={"content_before_fault": 3}))
    assert failed_checks(verdict) == [
        (
            "client: exactly one terminal event (response.failed), last; no response.completed/"
            "response.incomplete",
            "HTTP 200, 3 content events, 0× response.completed/response.incomplete; last events "
            "['response.output_text.delta', 'response.output_text.delta', 'response.output_text.delta']",
        )
    ]
    failed = response_failed(prefix, 3)
    completed = {"type": "response.completed", "sequence_number": 8, "response": {"id": RESP_ID}}
    both = streamed([*map(named, [*prefix, failed, completed]), DONE], TERMINATED, api="responses")
    verdict = v.judge_frame_after_first_delta(v.Evidence([both], expect={"content_before_fault": 3}))
    assert [c.what for c in verdict.failed] == [
        "client: exactly one terminal event (response.failed), last; no response.completed/"
        "response.incomplete",
        "client: every complete event is JSON and named by its type; nothing after "
        "response.completed/response.incomplete or response.failed; no [DONE] (the API has none)",
    ]
    assert verdict.failed[1].seen == "0 unparseable, 2 after the end, 1× [DONE]"


def test_responses_an_in_band_error_that_cuts_the_body_may_reset() -> None:
    """vLLM's Responses route writes no error event: it cuts the body as a dying engine does. With the
    scenario's allowance the verdict is a replica death's, and it says why."""
    prefix = responses_events(2, end=False)
    journal = {**TERMINATED, "delivered_output_tokens": 2}
    x = api_stream("responses", prefix, journal, transport_error="RemoteProtocolError: peer closed")
    x.replica_records = replica_end("att_1", outcome="fault:error", written=2)
    allow = {"content_before_fault": 2, "allow_reset": "vLLM cuts the body"}
    verdict = v.judge_frame_after_first_delta(v.Evidence([x], sim=True, expect=allow))
    assert verdict.passed, failed_checks(verdict)
    assert verdict.notes == ["a reset, not a terminal event: vLLM cuts the body"]
    strict = v.judge_frame_after_first_delta(v.Evidence([x], expect={"content_before_fault": 2}))
    assert next(c.what for c in strict.failed).startswith(
        "client: exactly one terminal event (response.failed)"
    )


def test_messages_a_retry_must_not_add_a_second_message_start() -> None:
    dead = messages_events(0, "msg_dead", end=False)[:1]
    x = api_stream("messages", [*dead, *messages_events()], RETRIED)
    verdict = v.judge_retried(v.Evidence([x]))
    assert failed_checks(verdict) == [
        ("client: every event comes from one answer (one message id)", "ids ['msg_01', 'msg_dead']"),
        ("client: one preamble: exactly one message_start", "2 message_starts"),
    ]


def test_messages_the_terminal_event_is_an_anthropic_error() -> None:
    prefix = messages_events(3, end=False)
    x = api_stream("messages", [*prefix, messages_error(3)], TERMINATED)
    verdict = v.judge_frame_after_first_delta(v.Evidence([x], expect={"content_before_fault": 3}))
    assert verdict.passed, failed_checks(verdict)
    # vLLM's own in-band error (type internal_error, not Anthropic's) passed through, then message_stop.
    raw = {"type": "error", "error": {"type": "internal_error", "message": "1 validation error"}}
    x = api_stream("messages", [*prefix, raw, {"type": "message_stop"}], TERMINATED)
    verdict = v.judge_frame_after_first_delta(v.Evidence([x], expect={"content_before_fault": 3}))
    assert [c.what for c in verdict.failed] == [
        "client: exactly one terminal event (event: error), last; no message_stop",
        "client: the error event has one of Anthropic's error types (its SDK raises by it)",
        "client: the error event says code=upstream_decode_interrupted (and details.error_code), this "
        "request_id, partial_output=true, retryable=false",
        "client: the error event's delivered_output_tokens equals what the client got",
        "client: every complete event is JSON and named by its type; nothing after message_stop or event: "
        "error; no [DONE] (the API has none)",
    ]
    assert verdict.failed[1].seen == "error.type 'internal_error'"


def test_an_event_named_otherwise_than_its_type_is_a_violation() -> None:
    payloads = messages_events()
    body = [named(p) for p in payloads]
    body[2] = named(payloads[2], name="content_block_start")
    x = streamed(body, COMPLETE, api="messages")
    verdict = v.judge_healthy(v.Evidence([x]))
    assert failed_checks(verdict) == [
        (
            "client: every complete event is JSON and named by its type; nothing after message_stop or "
            "event: error; no [DONE] (the API has none)",
            "0 unparseable, 0 after the end, 0× [DONE], named not by their type: "
            "['content_block_start≠content_block_delta']",
        )
    ]


def anthropic_error(status: int, body: dict[str, Any], *, label: str = "the request") -> Exchange:
    x = json_error(status, {}, label=label)
    x.api, x.path = "messages", "/v1/messages"
    x.headers["request-id"] = KEY
    x.body = json.dumps(body).encode()
    return x


def test_errors_before_content_are_in_each_apis_shape() -> None:
    ours = {
        "type": "error",
        "error": {
            "type": "api_error",
            "message": "all 2 attempts failed",
            "code": "retries_exhausted",
            "details": {"error_code": "retries_exhausted"},
            "request_id": KEY,
        },
        "request_id": KEY,
    }
    x = anthropic_error(502, ours)
    x.journal_status, x.journal = 200, FAILED
    verdict = v.judge_all_replicas_fail(v.Evidence([x]))
    assert verdict.passed, failed_checks(verdict)
    assert (
        'client: the error body is in the Messages API\'s shape (Anthropic\'s {"type": "error", "error": '
        '{"type", "message"}})'
    ) in [c.what for c in verdict.checks]
    # The OpenAI shape on the Messages API (Envoy's own 413 is written so): the SDK cannot read its type.
    openai = {"error": {"code": "request_too_large", "message": "too big", "request_id": KEY, "type": "x"}}
    big = anthropic_error(413, openai, label="oversize body")
    bad = anthropic_error(
        400,
        {
            "type": "error",
            "error": {
                "type": "invalid_request_error",
                "message": "no",
                "code": "invalid_json",
                "request_id": KEY,
            },
        },
        label="invalid JSON",
    )
    unknown = anthropic_error(
        404,
        {"type": "error", "error": {"type": "NotFoundError", "message": "no such model"}},
        label="unknown model",
    )
    expect = {"codes": {"invalid JSON": "invalid_json", "oversize body": "request_too_large"}}
    verdict = v.judge_malformed_input(v.Evidence([bad, big, unknown], expect=expect))
    assert [c.what for c in verdict.failed] == [
        'oversize body: the error body is in the Messages API\'s shape (Anthropic\'s {"type": "error", '
        '"error": {"type", "message"}})',
        "oversize body: error.type is Anthropic's type for HTTP 413 (request_too_large)",
    ]
    # vLLM's own 404 passed through is judged on its shape only (its type is vLLM's exception name).
    assert "unknown model: HTTP 404 is the replica's own error" in verdict.notes[0]


def test_against_another_gateway_the_anthropic_type_for_a_status_is_not_applicable() -> None:
    theirs = {"type": "error", "error": {"type": "overloaded_error", "message": "no healthy upstream"}}
    x = anthropic_error(502, theirs)
    verdict = v.judge_all_replicas_fail(
        v.Evidence([x], expect={"code": "retries_exhausted"}, router_sidecar=False)
    )
    assert verdict.passed, failed_checks(verdict)
    assert "client: error.type is Anthropic's type for HTTP 502 (api_error)" in [
        c.what for c in verdict.checks if c.ok is None
    ]


def test_the_apis_and_the_run_plan() -> None:
    from router_testbed.drill.scenarios import plan

    assert apis.parse("all") == ["chat", "completions", "responses", "messages"]
    assert apis.parse("responses") == ["responses"]
    with pytest.raises(ValueError, match="expected one of"):
        apis.parse("embeddings")
    body = apis.API["messages"].body("tiny", 8)
    assert (body["max_tokens"], "ignore_eos" in body, body["stream"]) == (8, False, True)
    assert apis.API["responses"].body("tiny", 8)["max_output_tokens"] == 8
    hooks = Hooks(functions={"freeze": lambda r: (0, ""), "thaw": lambda r: (0, "")})
    mode, chosen = select(Options("http://h", tool="pay", fault_mode="sim"), hooks)
    runs = plan(chosen, mode, ["chat", "messages"])
    # Each API's matrix, tool-replay once on no API, the freezes of every API last.
    assert [(s.name, api) for s, api in runs][:2] == [("healthy", "chat"), ("dies-in-prefill", "chat")]
    assert ("tool-replay", None) in [(s.name, api) for s, api in runs]
    assert [(s.name, api) for s, api in runs][-4:] == [
        ("frozen-in-prefill", "chat"),
        ("frozen-after-first-delta", "chat"),
        ("frozen-in-prefill", "messages"),
        ("frozen-after-first-delta", "messages"),
    ]
    assert BY_NAME["error-after-first-delta"].fault_in("sim", "responses") == (
        "x-sim-fault: delay@after:2 for=0.3; error@after:2"
    )
    # The keys name their API (chat's as before): one run's requests never share a key.
    from router_testbed.drill.scenarios import Context

    ctx = Context(None, "sim", "tiny", "r1")  # type: ignore[arg-type]
    assert ctx.key("healthy") == "drill-r1-healthy-1"
    ctx.api = "messages"
    assert ctx.key("healthy") == "drill-r1-messages-healthy-1"


def test_the_report_names_the_api_of_each_row() -> None:
    x = api_stream("responses", responses_events(), COMPLETE)
    ok = v.judge_healthy(v.Evidence([x]))
    chat_ok = v.judge_healthy(v.Evidence([streamed(answer(), COMPLETE)]))
    results = [
        Result(BY_NAME["healthy"], chat_ok, v.Evidence([streamed(answer(), COMPLETE)]), "none", 0.1),
        Result(BY_NAME["healthy"], ok, v.Evidence([x]), "none", 0.1, api="responses"),
    ]
    table = verdict_table(results).splitlines()
    assert [line.split()[:3] for line in table[1:3]] == [
        ["healthy", "chat", "none"],
        ["healthy", "responses", "none"],
    ]
    info = RunInfo("http://127.0.0.1:1", "sim", "tiny", "r1", T0, 0.3, apis=["chat", "responses"])
    page = html_report(info, results)
    assert '<a href="#healthy">' in page and '<a href="#responses-healthy">' in page
    assert "<td>responses</td>" in page and "api chat, responses" in page
    data = to_json(info, results)
    assert data["apis"] == ["chat", "responses"] and [s["api"] for s in data["scenarios"]] == [
        "chat",
        "responses",
    ]
    assert data["scenarios"][1]["exchanges"][0]["events"][0]["event"] == "response.created"
