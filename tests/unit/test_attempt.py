"""The attempt machine (upstream filter): hold headers until the first delta, fail before it, release at it.

Every rule is a row: a story is a list of steps, each step an input and the exact decision it must produce.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from router_sidecar.core.attempt import (
    Attempt,
    AttemptFailed,
    AttemptState,
    FailureReason,
    Hold,
    PassThrough,
    Release,
)
from router_sidecar.core.sse import EventKind, SseScanner

REFERENCE = Path("/work/shared/reference/vllm-0.32-cpu")
SSE = "text/event-stream; charset=utf-8"
JSON = "application/json"


def chunk(delta: dict[str, Any] | None = None, *, finish: str | None = None, **top: Any) -> bytes:
    """One chat.completion.chunk event as vLLM writes it (compact JSON, LF framing)."""
    obj: dict[str, Any] = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "model": "tiny"}
    obj["choices"] = [] if delta is None else [{"index": 0, "delta": delta, "finish_reason": finish}]
    obj.update(top)
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


ROLE = chunk({"role": "assistant", "content": ""})
CONTENT = chunk({"content": "Hel"})
ROLE_AND_CONTENT = chunk({"role": "assistant", "content": "Hi"})
EMPTY_DELTA = chunk({})
EMPTY_CONTENT = chunk({"content": ""})
NULL_CONTENT = chunk({"content": None})
FINISH_STOP = chunk({}, finish="stop")
FINISH_ABORT = chunk({}, finish="abort")
ABORT_WITH_CONTENT = chunk({"content": "x"}, finish="abort")
USAGE_ONLY = chunk(None, usage={"prompt_tokens": 3, "completion_tokens": 0, "total_tokens": 3})
KEEPALIVE = b": keep-alive\n\n"
ERROR = b'data: {"error": {"message": "boom", "type": "InternalServerError", "param": null, "code": 500}}\n\n'
DONE = b"data: [DONE]\n\n"
TOOL_CALL = chunk({"tool_calls": [{"index": 0, "id": "c1", "type": "function", "function": {"name": "f"}}]})
REASONING = chunk({"reasoning_content": "think"})
TEXT = b'data: {"object":"text_completion","choices":[{"index":0,"text":"fp","finish_reason":null}]}\n\n'

HOLD = Hold()
RELEASE_DELTA = Release(first_delta=True)
RELEASE_EMPTY = Release(first_delta=False)


@dataclass(frozen=True)
class Failed:
    """Expected: AttemptFailed with this reason (its detail is free text, but never empty)."""

    reason: FailureReason


def new_attempt() -> Attempt:
    return Attempt(request_id="req-1", attempt_id="att-1", number=1, replica="r1")


def run(steps: list[tuple[Any, ...]]) -> tuple[Attempt, list[Any]]:
    """Drive an attempt through steps: ("headers", status, ctype) | ("body", bytes, eos) | ("lost",)."""
    a = new_attempt()
    out = []
    for step in steps:
        if step[0] == "headers":
            out.append(a.on_response_headers(step[1], step[2]))
        elif step[0] == "body":
            out.append(a.on_response_body(step[1], step[2]))
        else:
            out.append(a.on_stream_lost())
    return a, out


def H(status: int = 200, ctype: str = SSE) -> tuple[Any, ...]:
    return ("headers", status, ctype)


def B(data: bytes, eos: bool = False) -> tuple[Any, ...]:
    return ("body", data, eos)


LOST = ("lost",)


def check(decisions: list[Any], expected: list[Any]) -> None:
    assert len(decisions) == len(expected)
    for got, want in zip(decisions, expected, strict=True):
        if isinstance(want, Failed):
            assert isinstance(got, AttemptFailed), got
            assert got.reason is want.reason
            assert got.detail  # a human-readable detail is always given
        else:
            assert got == want


# (id, steps, expected decisions, final state or None: not checked)
STORIES: list[tuple[str, list[tuple[Any, ...]], list[Any], AttemptState | None]] = [
    # --- first delta: release on the chunk that completes the first content event -------------------------
    ("role_then_content", [H(), B(ROLE), B(CONTENT)], [HOLD, HOLD, RELEASE_DELTA], AttemptState.RELEASED),
    ("role_and_content_one_event", [H(), B(ROLE_AND_CONTENT)], [HOLD, RELEASE_DELTA], AttemptState.RELEASED),
    ("role_and_content_one_chunk", [H(), B(ROLE + CONTENT)], [HOLD, RELEASE_DELTA], AttemptState.RELEASED),
    (
        "content_event_split_in_json",
        [H(), B(ROLE), B(CONTENT[:30]), B(CONTENT[30:])],
        [HOLD, HOLD, HOLD, RELEASE_DELTA],
        AttemptState.RELEASED,
    ),
    (
        "content_event_split_before_blank_line",
        [H(), B(ROLE + CONTENT[:-1]), B(CONTENT[-1:])],
        [HOLD, HOLD, RELEASE_DELTA],
        AttemptState.RELEASED,
    ),
    (
        "content_event_split_in_three",
        [H(), B(CONTENT[:5]), B(CONTENT[5:-2]), B(CONTENT[-2:])],
        [HOLD, HOLD, HOLD, RELEASE_DELTA],
        AttemptState.RELEASED,
    ),
    (
        "tool_call_is_a_delta",
        [H(), B(ROLE), B(TOOL_CALL)],
        [HOLD, HOLD, RELEASE_DELTA],
        AttemptState.RELEASED,
    ),
    ("reasoning_is_a_delta", [H(), B(REASONING)], [HOLD, RELEASE_DELTA], AttemptState.RELEASED),
    ("completions_text_is_a_delta", [H(), B(TEXT)], [HOLD, RELEASE_DELTA], AttemptState.RELEASED),
    (
        "content_then_error_in_one_chunk_releases",
        [H(), B(CONTENT + ERROR)],
        [HOLD, RELEASE_DELTA],
        AttemptState.RELEASED,
    ),
    # --- not a delta: hold ---------------------------------------------------------------------------------
    (
        "keepalive_and_empty_deltas_hold",
        [H(), B(KEEPALIVE), B(ROLE), B(EMPTY_DELTA), B(EMPTY_CONTENT), B(NULL_CONTENT), B(USAGE_ONLY)],
        [HOLD] * 7,
        AttemptState.HOLDING,
    ),
    (
        "keepalive_then_content",
        [H(), B(KEEPALIVE), B(CONTENT)],
        [HOLD, HOLD, RELEASE_DELTA],
        AttemptState.RELEASED,
    ),
    ("empty_chunk_holds", [H(), B(b"")], [HOLD, HOLD], AttemptState.HOLDING),
    # --- failures before the first delta ---------------------------------------------------------------
    (
        "error_event_before_content",
        [H(), B(ROLE), B(ERROR)],
        [HOLD, HOLD, Failed(FailureReason.ERROR_EVENT)],
        AttemptState.FAILED,
    ),
    (
        "error_event_then_content_in_one_chunk",
        [H(), B(ERROR + CONTENT)],
        [HOLD, Failed(FailureReason.ERROR_EVENT)],
        AttemptState.FAILED,
    ),
    (
        "abort_before_content",
        [H(), B(ROLE), B(FINISH_ABORT)],
        [HOLD, HOLD, Failed(FailureReason.ABORTED)],
        AttemptState.FAILED,
    ),
    (
        "abort_event_carrying_content",
        [H(), B(ROLE), B(ABORT_WITH_CONTENT)],
        [HOLD, HOLD, Failed(FailureReason.ABORTED)],
        AttemptState.FAILED,
    ),
    (
        "end_without_done_or_finish",
        [H(), B(ROLE), B(b"", True)],
        [HOLD, HOLD, Failed(FailureReason.ENDED_WITHOUT_DONE)],
        AttemptState.FAILED,
    ),
    (
        "end_with_incomplete_content_event",
        [H(), B(ROLE + CONTENT[:-2], True)],
        [HOLD, Failed(FailureReason.ENDED_WITHOUT_DONE)],
        AttemptState.FAILED,
    ),
    (
        "end_of_empty_body",
        [H(), B(b"", True)],
        [HOLD, Failed(FailureReason.ENDED_WITHOUT_DONE)],
        AttemptState.FAILED,
    ),
    ("status_500", [H(500)], [Failed(FailureReason.UPSTREAM_STATUS)], AttemptState.FAILED),
    ("status_503", [H(503)], [Failed(FailureReason.UPSTREAM_STATUS)], AttemptState.FAILED),
    ("status_599_json", [H(599, JSON)], [Failed(FailureReason.UPSTREAM_STATUS)], AttemptState.FAILED),
    # --- a complete generation without content: nothing to retry ------------------------------------------
    (
        "empty_generation_finish_and_done",
        [H(), B(ROLE), B(FINISH_STOP), B(DONE, True)],
        [HOLD, HOLD, HOLD, RELEASE_EMPTY],
        AttemptState.RELEASED,
    ),
    (
        "empty_generation_one_chunk",
        [H(), B(ROLE + FINISH_STOP + USAGE_ONLY + DONE, True)],
        [HOLD, RELEASE_EMPTY],
        AttemptState.RELEASED,
    ),
    (
        "empty_generation_done_before_end_of_stream",
        [H(), B(ROLE + FINISH_STOP + DONE)],
        [HOLD, RELEASE_EMPTY],
        AttemptState.RELEASED,
    ),
    (
        "finish_stop_then_end_without_done",
        [H(), B(ROLE + FINISH_STOP), B(b"", True)],
        [HOLD, HOLD, RELEASE_EMPTY],
        AttemptState.RELEASED,
    ),
    # --- not replica failures: pass through ------------------------------------------------------------
    ("status_400", [H(400, JSON)], [PassThrough(400)], AttemptState.PASSED_THROUGH),
    ("status_404", [H(404, JSON)], [PassThrough(404)], AttemptState.PASSED_THROUGH),
    ("status_429", [H(429, JSON)], [PassThrough(429)], AttemptState.PASSED_THROUGH),
    # --- non-streamed JSON: delivered whole --------------------------------------------------------------
    (
        "json_held_until_end_of_stream",
        [H(200, JSON), B(b'{"id":"chatcmpl-1","choices":[{"mess'), B(b'age":{}}]}'), B(b"", True)],
        [HOLD, HOLD, HOLD, RELEASE_DELTA],
        None,  # see test_json_release_then_lost_is_no_failure
    ),
    ("json_whole_body_at_once", [H(200, JSON), B(b"{}", True)], [HOLD, RELEASE_DELTA], None),
    # --- the stream is lost ----------------------------------------------------------------------------
    ("lost_awaiting_headers", [LOST], [Failed(FailureReason.CONNECTION_LOST)], AttemptState.FAILED),
    (
        "lost_holding",
        [H(), B(ROLE), LOST],
        [HOLD, HOLD, Failed(FailureReason.CONNECTION_LOST)],
        AttemptState.FAILED,
    ),
    (
        "lost_holding_json",
        [H(200, JSON), B(b"{"), LOST],
        [HOLD, HOLD, Failed(FailureReason.CONNECTION_LOST)],
        AttemptState.FAILED,
    ),
    ("lost_after_release", [H(), B(CONTENT), LOST], [HOLD, RELEASE_DELTA, HOLD], AttemptState.RELEASED),
    ("lost_after_pass_through", [H(404, JSON), LOST], [PassThrough(404), HOLD], AttemptState.PASSED_THROUGH),
    (
        "lost_after_failure_is_not_a_second_failure",
        [H(503), LOST],
        [Failed(FailureReason.UPSTREAM_STATUS), HOLD],
        AttemptState.FAILED,
    ),
]


@pytest.mark.parametrize(
    ("steps", "expected", "state"), [s[1:] for s in STORIES], ids=[s[0] for s in STORIES]
)
def test_attempt_story(steps: list[tuple[Any, ...]], expected: list[Any], state: AttemptState | None) -> None:
    attempt, decisions = run(steps)
    check(decisions, expected)
    if state is not None:
        assert attempt.state is state


def test_json_release_then_lost_is_no_failure() -> None:
    attempt, decisions = run([H(200, JSON), B(b"{}", True), LOST])
    assert decisions == [HOLD, RELEASE_DELTA, HOLD]
    assert attempt.state is AttemptState.RELEASED


@pytest.mark.parametrize(
    ("steps", "bad"),
    [
        ([], B(CONTENT)),  # body before headers
        ([H()], H()),  # headers twice
        ([H(), B(CONTENT)], B(DONE)),  # body after release: the filter has left the path
        ([H(503)], B(ERROR)),  # body after failure
        ([H(404, JSON)], B(b"{}", True)),  # body after pass-through
    ],
    ids=[
        "body_before_headers",
        "headers_twice",
        "body_after_release",
        "body_after_failure",
        "body_after_4xx",
    ],
)
def test_event_in_wrong_state_is_a_bug(steps: list[tuple[Any, ...]], bad: tuple[Any, ...]) -> None:
    attempt, _ = run(steps)
    with pytest.raises(RuntimeError, match="att-1"):
        if bad[0] == "headers":
            attempt.on_response_headers(bad[1], bad[2])
        else:
            attempt.on_response_body(bad[1], bad[2])


def test_media_type_is_case_insensitive() -> None:
    _, decisions = run([H(200, "Text/Event-Stream"), B(CONTENT)])
    assert decisions == [HOLD, RELEASE_DELTA]


def test_status_is_recorded() -> None:
    attempt, _ = run([H(503)])
    assert attempt.status == 503
    assert attempt.on_stream_lost() == HOLD


# --- real vLLM transcripts in random chunkings ----------------------------------------------------------


def first_content_end(data: bytes) -> int:
    """Offset just past the first content event of a transcript (independently of the attempt machine)."""
    offset = 0
    for event in SseScanner().feed(data):
        offset += len(event.raw)
        if event.kind is EventKind.CONTENT:
            return offset
    raise AssertionError("transcript has no content event")


def random_chunks(data: bytes, rng: random.Random) -> list[bytes]:
    out = []
    i = 0
    while i < len(data):
        n = rng.choice((1, 2, 3, rng.randint(1, 40), rng.randint(1, 400), rng.randint(1, 4000)))
        out.append(data[i : i + n])
        i += n
    return out


RELEASING = ["chat_stream_usage.sse", "chat_stream_tool_required.sse", "completions_stream.sse"]
SEEDS = range(12)


def test_first_content_offsets_are_what_the_transcripts_show() -> None:
    # The first content event: the 2nd of a chat transcript (after the role chunk), the 1st of completions.
    for name, index in [
        ("chat_stream_usage.sse", 2),
        ("chat_stream_tool_required.sse", 2),
        ("completions_stream.sse", 1),
    ]:
        data = (REFERENCE / name).read_bytes()
        ends = [i + 2 for i in range(len(data)) if data.startswith(b"\n\n", i)]
        assert first_content_end(data) == ends[index - 1], name


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("name", RELEASING)
def test_transcript_releases_once_at_first_content(name: str, seed: int) -> None:
    data = (REFERENCE / name).read_bytes()
    boundary = first_content_end(data)
    chunks = random_chunks(data, random.Random(f"{name}:{seed}"))
    attempt = new_attempt()
    assert attempt.on_response_headers(200, SSE) == HOLD
    fed = 0
    for i, c in enumerate(chunks):
        decision = attempt.on_response_body(c, i == len(chunks) - 1)
        fed += len(c)
        if fed < boundary:
            assert decision == HOLD, (seed, i, fed)
        else:
            # The chunk that completes the first content event, and no earlier one, releases.
            assert decision == RELEASE_DELTA, (seed, i, fed)
            break
    else:
        raise AssertionError("never released")
    assert attempt.state is AttemptState.RELEASED
    assert fed - len(c) < boundary <= fed
    assert attempt.on_stream_lost() == HOLD  # a later reset is no failure of this machine


@pytest.mark.parametrize("seed", SEEDS)
def test_engine_dead_transcript_fails_with_error_event(seed: int) -> None:
    data = (REFERENCE / "engine_dead_midstream_error.sse").read_bytes()
    chunks = [data] if seed == 0 else random_chunks(data, random.Random(seed))
    attempt = new_attempt()
    assert attempt.on_response_headers(200, SSE) == HOLD
    error_end = data.index(b"\n\n") + 2
    fed = 0
    for i, c in enumerate(chunks):
        decision = attempt.on_response_body(c, i == len(chunks) - 1)
        fed += len(c)
        if fed < error_end:
            assert decision == HOLD
            continue
        assert isinstance(decision, AttemptFailed)
        assert decision.reason is FailureReason.ERROR_EVENT
        break
    assert attempt.state is AttemptState.FAILED


@pytest.mark.parametrize("seed", range(4))
def test_killed_midstream_transcript_releases_at_first_content(seed: int) -> None:
    data = (REFERENCE / "chat_stream_killed_midstream.sse").read_bytes()
    boundary = first_content_end(data)
    attempt = new_attempt()
    attempt.on_response_headers(200, SSE)
    fed = 0
    for c in random_chunks(data, random.Random(seed)):
        fed += len(c)
        decision = attempt.on_response_body(c, False)
        if decision != HOLD:
            break
    assert decision == RELEASE_DELTA
    assert fed - len(c) < boundary <= fed
