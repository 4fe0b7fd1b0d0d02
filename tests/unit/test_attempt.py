"""The attempt machine (upstream filter): hold headers until the first delta, fail before it, release at it.

Three layers, h11-style:
* an exhaustive table: every `AttemptState` × every input type, with the next state and the exact decisions,
  written from the docstrings and docs/design.md (not from `TRANSITIONS`); pairs the machine must
  refuse raise;
* stories: lists of steps, each an input and the exact decisions it must produce;
* the real vLLM transcripts in seeded random chunkings.
"""

from __future__ import annotations

import json
import random
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from router_sidecar.core.attempt import (
    MAX_REJECTION_BYTES,
    Answer,
    Attempt,
    AttemptReader,
    AttemptState,
    Decision,
    Failed,
    FailRequest,
    FailureReason,
    FenceProven,
    FenceUnprovable,
    IllegalInput,
    Input,
    Kind,
    LivenessLost,
    NeverSent,
    Rejection,
    Release,
    ResponseBody,
    ResponseHeaders,
    SettleLease,
    StartFence,
    StreamReset,
    Superseded,
    TriggerRetry,
    VerdictReady,
    WriteAhead,
    WriteAheadDone,
    is_context_length,
    read_rejection,
)
from router_sidecar.core.events import Event, EventName, Outcome

REFERENCE = Path("/work/shared/reference/vllm-0.32-cpu")
SSE = "text/event-stream; charset=utf-8"
JSON = "application/json"
# Small bounds, so that the stories can cross them (the policy's defaults are 256 KiB and 1 MiB).
MAX_HELD = 8192
MAX_EVENT = 4096


def chunk(delta: dict[str, Any] | None = None, *, finish: str | None = None, **top: Any) -> bytes:
    """One chat.completion.chunk event as vLLM writes it (compact JSON, LF framing)."""
    obj: dict[str, Any] = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "model": "tiny"}
    obj["choices"] = [] if delta is None else [{"index": 0, "delta": delta, "finish_reason": finish}]
    obj.update(top)
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def cr_only(data: bytes) -> bytes:
    """The same events with CR line endings (JSON never holds a raw line break)."""
    return data.replace(b"\n", b"\r")


def crlf(data: bytes) -> bytes:
    return data.replace(b"\n", b"\r\n")


ROLE = chunk({"role": "assistant", "content": ""})
CONTENT = chunk({"content": "Hel"})
ROLE_AND_CONTENT = chunk({"role": "assistant", "content": "Hi"})
EMPTY_DELTA = chunk({})
EMPTY_CONTENT = chunk({"content": ""})
NULL_CONTENT = chunk({"content": None})
EMPTY_TOOL_CALLS = chunk({"tool_calls": []})
FINISH_STOP = chunk({}, finish="stop")
FINISH_LENGTH = chunk({}, finish="length")
FINISH_ABORT = chunk({}, finish="abort")
ABORT_WITH_CONTENT = chunk({"content": "x"}, finish="abort")
USAGE_ONLY = chunk(None, usage={"prompt_tokens": 3, "completion_tokens": 0, "total_tokens": 3})
KEEPALIVE = b": keep-alive\n\n"
ERROR = b'data: {"error": {"message": "boom", "type": "InternalServerError", "param": null, "code": 500}}\n\n'
DONE = b"data: [DONE]\n\n"
TOOL_CALL = chunk({"tool_calls": [{"index": 0, "id": "c1", "type": "function", "function": {"name": "f"}}]})
REASONING = chunk({"reasoning_content": "think"})
TEXT = b'data: {"object":"text_completion","choices":[{"index":0,"text":"fp","finish_reason":null}]}\n\n'
EMPTY_TEXT = b'data: {"object":"text_completion","choices":[{"index":0,"text":"","finish_reason":null}]}\n\n'

RETRY = TriggerRetry("upstream_status")
FAIL_502 = FailRequest(502, Outcome.RETRIES_EXHAUSTED, "all 2 attempts failed before any content")
SETTLE = SettleLease("connection_closed")
# Replicas' 4xx bodies, as the engines write them (../shared/reference: vLLM 0.32, SGLang 0.5.23).
VLLM_TOO_LONG = (
    b'{"error":{"message":"max_tokens=5000 cannot be greater than max_model_len=1024. Please request fewer '
    b'output tokens. (parameter=max_tokens, value=5000)","type":"BadRequestError","param":"max_tokens",'
    b'"code":400}}'
)
SGLANG_TOO_LONG = (
    b'{"object":"error","message":"Requested token count exceeds the model\'s maximum context length of 1024 '
    b'tokens.","type":"BadRequestError","param":null,"code":400}'
)
NOT_FOUND = (
    b'{"error":{"message":"Response with id \'resp_1\' not found.","type":"NotFoundError","code":404}}'
)


def H(status: int = 200, ctype: str = SSE, **kw: Any) -> ResponseHeaders:
    return ResponseHeaders(status, ctype, **kw)


def B(data: bytes, eos: bool = False) -> ResponseBody:
    return ResponseBody(data, eos)


def new_attempt(outbox: list[Event] | None = None) -> Attempt:
    return Attempt(
        attempt_id="att-1",
        number=1,
        replica="r1",
        outbox=outbox if outbox is not None else [],
        max_held_bytes=MAX_HELD,
        max_event_bytes=MAX_EVENT,
    )


def drive(inputs: list[Input], outbox: list[Event] | None = None) -> Attempt:
    attempt = new_attempt(outbox)
    for event in inputs:
        attempt.handle(event)
    return attempt


# --- 1. the exhaustive table: every state × every input ---------------------------------------------------

INPUT_TYPES: tuple[type, ...] = typing.get_args(Input)

# One representative input of each type (a row may use another).
REPRESENTATIVE: dict[type, Input] = {
    ResponseHeaders: H(200),
    ResponseBody: B(CONTENT),
    StreamReset: StreamReset(),
    NeverSent: NeverSent(),
    LivenessLost: LivenessLost("heartbeat_lapsed"),
    FenceProven: FenceProven("cancel_ack", 5.0),
    FenceUnprovable: FenceUnprovable(),
    WriteAheadDone: WriteAheadDone(),
    Superseded: Superseded(),
    VerdictReady: VerdictReady(RETRY),
}

# How each state is reached, through inputs only (a row may take another way there).
PATHS: dict[AttemptState, list[Input]] = {
    AttemptState.AWAITING_HEADERS: [],
    AttemptState.HOLDING: [H(), B(ROLE)],
    AttemptState.FENCING: [LivenessLost("heartbeat_lapsed")],  # before any headers
    AttemptState.WRITING_AHEAD: [H(), B(ROLE), B(CONTENT)],
    AttemptState.RELEASED: [H(), B(ROLE), B(CONTENT), WriteAheadDone()],
    AttemptState.PASSED_THROUGH: [H(307, JSON)],
    AttemptState.FAILED: [H(503, JSON)],  # headers in, stream open, lease not settled, no verdict yet
    AttemptState.DECIDED: [H(503, JSON), VerdictReady(RETRY)],  # answered: its lease is being settled
    AttemptState.NEVER_SENT: [NeverSent()],  # its lease is being settled
}


@dataclass(frozen=True)
class Row:
    """Expected: the next state and the exact decisions (`ILLEGAL`: the machine must raise)."""

    state: AttemptState | None
    decisions: list[Decision] = field(default_factory=list)
    path: list[Input] | None = None  # None: PATHS[state]
    input: Input | None = None  # None: REPRESENTATIVE[type]


ILLEGAL = Row(None)
S = AttemptState
_AH, _HO, _FE, _WA, _RE, _PT, _FA, _DE, _NS = (
    S.AWAITING_HEADERS,
    S.HOLDING,
    S.FENCING,
    S.WRITING_AHEAD,
    S.RELEASED,
    S.PASSED_THROUGH,
    S.FAILED,
    S.DECIDED,
    S.NEVER_SENT,
)
FENCING_WITH_HEADERS = [H(), B(ROLE), LivenessLost("heartbeat_lapsed")]
FAILED_BY_FENCE_WITH_VERDICT = [
    LivenessLost("heartbeat_lapsed"),
    FenceProven("cancel_ack"),
    VerdictReady(RETRY),
]
FAILED_BY_FENCE = [LivenessLost("heartbeat_lapsed"), FenceProven("cancel_ack")]  # no headers, no verdict
FAILED_BY_RESET = [StreamReset()]
DECIDED_BY_RESET = [StreamReset(), VerdictReady(RETRY)]  # its lease settling, nothing to answer

EXPECTED: dict[tuple[AttemptState, type], Row] = {
    # Sent to its replica, no response headers yet.
    (_AH, ResponseHeaders): Row(_HO),
    (_AH, ResponseBody): ILLEGAL,  # Envoy never sends a body before its headers
    (_AH, StreamReset): Row(_FA, [Failed(FailureReason.CONNECTION_LOST), SETTLE]),
    # Its stream ended before its request was let go: no replica saw it; journaled, fenced, not counted.
    (_AH, NeverSent): Row(_NS, [SETTLE]),  # no replica saw it: no verdict; its lease, if any, settles
    (_AH, LivenessLost): Row(_FE, [StartFence()]),
    (_AH, FenceProven): ILLEGAL,  # no fence and no settlement was started
    (_AH, FenceUnprovable): ILLEGAL,
    (_AH, WriteAheadDone): ILLEGAL,
    (_AH, Superseded): Row(_FA, [Failed(FailureReason.CONNECTION_LOST), SETTLE]),
    (_AH, VerdictReady): ILLEGAL,  # a verdict answers a failure
    # 2xx headers and every chunk held.
    (_HO, ResponseHeaders): ILLEGAL,  # headers twice
    (_HO, ResponseBody): Row(_WA, [WriteAhead()]),
    (_HO, StreamReset): Row(_FA, [Failed(FailureReason.CONNECTION_LOST), SETTLE]),
    (_HO, NeverSent): ILLEGAL,  # only an attempt whose request was never let go
    (_HO, LivenessLost): Row(_FE, [StartFence()]),
    (_HO, FenceProven): ILLEGAL,
    (_HO, FenceUnprovable): ILLEGAL,
    (_HO, WriteAheadDone): ILLEGAL,
    (_HO, Superseded): Row(_FA, [Failed(FailureReason.CONNECTION_LOST), SETTLE]),
    (_HO, VerdictReady): ILLEGAL,
    # Liveness uncertain: waiting for the proof that it stopped; nothing is decided before it.
    (_FE, ResponseHeaders): Row(_FE),  # kept for the answer
    (_FE, ResponseBody): Row(_FE, path=FENCING_WITH_HEADERS),  # never released
    (_FE, StreamReset): Row(_FE),  # the fence goes on: a closed connection proves nothing now
    (_FE, NeverSent): ILLEGAL,  # only an attempt whose request was never let go
    (_FE, LivenessLost): Row(_FE),  # already fencing: no second fence
    (_FE, FenceProven): Row(_FA, [Failed(FailureReason.REPLICA_LOST)]),
    (_FE, FenceUnprovable): Row(_FA, [Failed(FailureReason.REPLICA_LOST, fence_proven=False)]),
    (_FE, WriteAheadDone): Row(_FE),  # fenced while its write-ahead was on its way: never released
    (_FE, Superseded): Row(_FE),
    (_FE, VerdictReady): ILLEGAL,  # not failed yet
    # First delta found: first_delta_sent is being made durable.
    (_WA, ResponseHeaders): ILLEGAL,
    (_WA, ResponseBody): Row(_WA),  # held with the rest
    (_WA, StreamReset): Row(_FA, [Failed(FailureReason.LOST_BEFORE_RELEASE), SETTLE]),
    (_WA, NeverSent): ILLEGAL,  # only an attempt whose request was never let go
    (_WA, LivenessLost): Row(_FE, [StartFence()]),  # not released yet: fence it
    (_WA, FenceProven): ILLEGAL,
    (_WA, FenceUnprovable): ILLEGAL,
    (_WA, WriteAheadDone): Row(_RE, [Release(2)]),
    (_WA, Superseded): Row(_FA, [Failed(FailureReason.LOST_BEFORE_RELEASE), SETTLE]),
    (_WA, VerdictReady): ILLEGAL,
    # Released: the downstream owns the rest of the stream.
    (_RE, ResponseHeaders): ILLEGAL,
    (_RE, ResponseBody): Row(_RE),
    (_RE, StreamReset): Row(_RE),  # the downstream ends the client stream (or sees the reset)
    (_RE, NeverSent): ILLEGAL,  # only an attempt whose request was never let go
    (_RE, LivenessLost): Row(_RE),  # the downstream watches the publisher
    (_RE, FenceProven): ILLEGAL,
    (_RE, FenceUnprovable): ILLEGAL,
    (_RE, WriteAheadDone): ILLEGAL,  # twice
    (_RE, Superseded): Row(_FA, [Failed(FailureReason.LOST_BEFORE_RELEASE), SETTLE]),  # never reached Envoy
    (_RE, VerdictReady): ILLEGAL,
    # Not a replica failure (4xx): released unchanged.
    (_PT, ResponseHeaders): ILLEGAL,
    (_PT, ResponseBody): Row(_PT),
    (_PT, StreamReset): Row(_PT),
    (_PT, NeverSent): ILLEGAL,  # only an attempt whose request was never let go
    (_PT, LivenessLost): Row(_PT),
    (_PT, FenceProven): ILLEGAL,
    (_PT, FenceUnprovable): ILLEGAL,
    (_PT, WriteAheadDone): ILLEGAL,
    (_PT, Superseded): Row(_PT),
    (_PT, VerdictReady): ILLEGAL,
    # Failed before release, its verdict not known yet: nothing is answered before it.
    (_FA, ResponseHeaders): Row(_FA, path=FAILED_BY_FENCE),  # kept for the answer
    (_FA, ResponseBody): Row(_FA),  # a failed attempt's bytes are never released
    (_FA, StreamReset): Row(_FA, [SETTLE]),  # its connection is closed now: that fences it
    (_FA, NeverSent): ILLEGAL,  # only an attempt whose request was never let go
    (_FA, LivenessLost): Row(_FA),
    (_FA, FenceProven): Row(_FA, [], path=FAILED_BY_RESET, input=FenceProven("connection_closed")),
    (_FA, FenceUnprovable): ILLEGAL,  # only a fence's wait ends unprovable, and it ended already
    (_FA, WriteAheadDone): Row(_FA),  # reset while its write-ahead was on its way: nothing to release
    (_FA, Superseded): Row(_FA, [SETTLE]),
    (_FA, VerdictReady): Row(_DE, [SETTLE, Answer(RETRY, 0)]),  # the lease first, then the answer
    # The verdict is known: answered as soon as (and only if) the held headers are there.
    (_DE, ResponseHeaders): Row(_DE, [Answer(RETRY, 0)], path=FAILED_BY_FENCE_WITH_VERDICT),  # deferred
    (_DE, ResponseBody): Row(_DE),
    (_DE, StreamReset): Row(_DE),  # answered: its lease is settling already
    (_DE, LivenessLost): Row(_DE),
    (_DE, FenceProven): Row(_DE, [], path=DECIDED_BY_RESET, input=FenceProven("connection_closed")),
    (_DE, FenceUnprovable): ILLEGAL,
    (_DE, WriteAheadDone): Row(_DE),
    (_DE, Superseded): Row(_DE),
    (_DE, VerdictReady): ILLEGAL,  # one verdict per failure
    (_DE, NeverSent): ILLEGAL,  # only an attempt whose request was never let go
    # Never sent: it has no stream, no replica saw it; only its lease's settlement can still arrive.
    (_NS, ResponseHeaders): ILLEGAL,
    (_NS, ResponseBody): ILLEGAL,
    (_NS, StreamReset): ILLEGAL,
    (_NS, NeverSent): ILLEGAL,
    (_NS, LivenessLost): ILLEGAL,
    (_NS, FenceProven): Row(_NS, [], input=FenceProven("connection_closed")),
    (_NS, FenceUnprovable): ILLEGAL,
    (_NS, WriteAheadDone): ILLEGAL,
    (_NS, Superseded): ILLEGAL,
    (_NS, VerdictReady): ILLEGAL,  # it needs none
}


def test_table_covers_every_state_and_input() -> None:
    assert len(INPUT_TYPES) == 10  # the union of inputs was read
    assert set(EXPECTED) == {(s, t) for s in AttemptState for t in INPUT_TYPES}
    assert set(REPRESENTATIVE) == set(INPUT_TYPES)
    assert set(PATHS) == set(AttemptState)


@pytest.mark.parametrize("state", list(AttemptState), ids=lambda s: s.value)
def test_paths_reach_their_state(state: AttemptState) -> None:
    assert drive(PATHS[state]).state is state


@pytest.mark.parametrize(
    ("state", "kind"), list(EXPECTED), ids=[f"{s.value}-{t.__name__}" for s, t in EXPECTED]
)
def test_transition_table(state: AttemptState, kind: type) -> None:
    row = EXPECTED[(state, kind)]
    attempt = drive(row.path if row.path is not None else PATHS[state])
    assert attempt.state is state
    event = row.input if row.input is not None else REPRESENTATIVE[kind]
    assert type(event) is kind
    if row is ILLEGAL:
        with pytest.raises(IllegalInput, match="att-1"):
            attempt.handle(event)
        assert attempt.state is state  # a refused input changes nothing
        return
    assert attempt.handle(event) == row.decisions
    assert attempt.state is row.state


# --- 2. stories: each step an input and the exact decisions ------------------------------------------------

Step = tuple[Input, list[Decision]]


@dataclass(frozen=True)
class Story:
    id: str
    steps: list[Step]
    state: AttemptState
    first_delta: bool | None = None  # None: not checked
    failure: FailureReason | None = None


def _f(reason: FailureReason, fence_proven: bool = True) -> list[Decision]:
    return [Failed(reason, fence_proven)]


WA: list[Decision] = [WriteAhead()]
NONE: list[Decision] = []
R = FailureReason

STORIES: list[Story] = [
    # --- first delta: write ahead on the chunk that completes the first content event, then release ------
    Story(
        "role_then_content",
        [(H(), NONE), (B(ROLE), NONE), (B(CONTENT), WA), (WriteAheadDone(), [Release(2)])],
        S.RELEASED,
        True,
    ),
    Story(
        "role_and_content_one_event",
        [(H(), NONE), (B(ROLE_AND_CONTENT), WA), (WriteAheadDone(), [Release(1)])],
        S.RELEASED,
        True,
    ),
    Story(
        "role_and_content_one_chunk",
        [(H(), NONE), (B(ROLE + CONTENT), WA), (WriteAheadDone(), [Release(1)])],
        S.RELEASED,
        True,
    ),
    Story(
        "content_event_split_in_json",
        [(H(), NONE), (B(ROLE), NONE), (B(CONTENT[:30]), NONE), (B(CONTENT[30:]), WA)],
        S.WRITING_AHEAD,
        True,
    ),
    Story(
        "content_event_split_before_blank_line",
        [(H(), NONE), (B(ROLE + CONTENT[:-1]), NONE), (B(CONTENT[-1:]), WA)],
        S.WRITING_AHEAD,
        True,
    ),
    Story(
        "content_event_split_in_three",
        [(H(), NONE), (B(CONTENT[:5]), NONE), (B(CONTENT[5:-2]), NONE), (B(CONTENT[-2:]), WA)],
        S.WRITING_AHEAD,
        True,
    ),
    Story(
        "chunks_while_writing_ahead_are_released_too",
        [
            (H(), NONE),
            (B(ROLE), NONE),
            (B(CONTENT), WA),
            (B(CONTENT), NONE),
            (B(DONE, True), NONE),
            (WriteAheadDone(), [Release(4)]),
        ],
        S.RELEASED,
        True,
    ),
    Story("tool_call_is_a_delta", [(H(), NONE), (B(ROLE), NONE), (B(TOOL_CALL), WA)], S.WRITING_AHEAD, True),
    Story("reasoning_is_a_delta", [(H(), NONE), (B(REASONING), WA)], S.WRITING_AHEAD, True),
    Story("completions_text_is_a_delta", [(H(), NONE), (B(TEXT), WA)], S.WRITING_AHEAD, True),
    Story(
        "content_then_error_in_one_chunk_releases",
        [(H(), NONE), (B(CONTENT + ERROR), WA)],
        S.WRITING_AHEAD,
        True,
    ),
    Story(
        "media_type_is_case_insensitive",
        [(H(200, "Text/Event-Stream"), NONE), (B(CONTENT), WA)],
        S.WRITING_AHEAD,
        True,
    ),
    Story(
        "identity_encoding_is_plain",
        [(H(200, SSE, content_encoding="Identity"), NONE), (B(CONTENT), WA)],
        S.WRITING_AHEAD,
        True,
    ),
    # --- not a delta: hold -------------------------------------------------------------------------------
    Story(
        "keepalive_role_and_empty_deltas_hold",
        [
            (H(), NONE),
            (B(KEEPALIVE), NONE),
            (B(ROLE), NONE),
            (B(EMPTY_DELTA), NONE),
            (B(EMPTY_CONTENT), NONE),
            (B(NULL_CONTENT), NONE),
            (B(EMPTY_TOOL_CALLS), NONE),
            (B(EMPTY_TEXT), NONE),
        ],
        S.HOLDING,
        False,
    ),
    Story("usage_only_holds", [(H(), NONE), (B(ROLE), NONE), (B(USAGE_ONLY), NONE)], S.HOLDING, False),
    Story(
        "keepalive_then_content", [(H(), NONE), (B(KEEPALIVE), NONE), (B(CONTENT), WA)], S.WRITING_AHEAD, True
    ),
    Story("empty_chunk_holds", [(H(), NONE), (B(b""), NONE)], S.HOLDING, False),
    # --- failures before the first delta --------------------------------------------------------------
    Story(
        "error_event_before_content",
        [(H(), NONE), (B(ROLE), NONE), (B(ERROR), _f(R.ERROR_EVENT))],
        S.FAILED,
        False,
        R.ERROR_EVENT,
    ),
    Story(
        "error_event_then_content_in_one_chunk",
        [(H(), NONE), (B(ERROR + CONTENT), _f(R.ERROR_EVENT))],
        S.FAILED,
        False,
        R.ERROR_EVENT,
    ),
    Story(
        "abort_before_content",
        [(H(), NONE), (B(ROLE), NONE), (B(FINISH_ABORT), _f(R.ABORTED))],
        S.FAILED,
        False,
        R.ABORTED,
    ),
    Story(
        "abort_event_carrying_content",
        [(H(), NONE), (B(ROLE), NONE), (B(ABORT_WITH_CONTENT), _f(R.ABORTED))],
        S.FAILED,
        False,
        R.ABORTED,
    ),
    Story(
        "end_without_done_or_finish",
        [(H(), NONE), (B(ROLE), NONE), (B(b"", True), _f(R.ENDED_WITHOUT_DONE))],
        S.FAILED,
        False,
        R.ENDED_WITHOUT_DONE,
    ),
    Story(
        "end_with_incomplete_content_event",
        [(H(), NONE), (B(ROLE + CONTENT[:-2], True), _f(R.ENDED_WITHOUT_DONE))],
        S.FAILED,
        False,
        R.ENDED_WITHOUT_DONE,
    ),
    Story(
        "end_of_empty_body",
        [(H(), NONE), (B(b"", True), _f(R.ENDED_WITHOUT_DONE))],
        S.FAILED,
        False,
        R.ENDED_WITHOUT_DONE,
    ),
    Story("status_500", [(H(500), _f(R.UPSTREAM_STATUS))], S.FAILED, False, R.UPSTREAM_STATUS),
    Story("status_503", [(H(503), _f(R.UPSTREAM_STATUS))], S.FAILED, False, R.UPSTREAM_STATUS),
    Story("status_599_json", [(H(599, JSON), _f(R.UPSTREAM_STATUS))], S.FAILED, False, R.UPSTREAM_STATUS),
    Story("status_429", [(H(429, JSON, retry_after="7"), _f(R.OVERLOADED))], S.FAILED, False, R.OVERLOADED),
    Story(
        "gzip_before_content",
        [(H(200, SSE, content_encoding="gzip"), _f(R.CONTENT_ENCODED))],
        S.FAILED,
        False,
        R.CONTENT_ENCODED,
    ),
    Story(
        "br_json_before_content",
        [(H(200, JSON, content_encoding="BR"), _f(R.CONTENT_ENCODED))],
        S.FAILED,
        False,
        R.CONTENT_ENCODED,
    ),
    Story(
        "stream_held_past_max_held_bytes",
        [(H(), NONE), (B(KEEPALIVE * 400), NONE), (B(KEEPALIVE * 200), _f(R.RESPONSE_TOO_LARGE))],
        S.FAILED,
        False,
        R.RESPONSE_TOO_LARGE,
    ),
    Story(
        "one_event_over_max_event_bytes",
        [
            (H(), NONE),
            (B(ROLE), NONE),
            (B(b'data: {"choices":[{"delta":{"x":"' + b"a" * 3000), NONE),
            (B(b"a" * 2000), _f(R.EVENT_TOO_LARGE)),
        ],
        S.FAILED,
        False,
        R.EVENT_TOO_LARGE,
    ),
    # --- a complete generation without content: nothing to retry, released without a first delta --------
    Story(
        "empty_generation_finish_and_done",
        [
            (H(), NONE),
            (B(ROLE), NONE),
            (B(FINISH_STOP), NONE),
            (B(DONE, True), WA),
            (WriteAheadDone(), [Release(3)]),
        ],
        S.RELEASED,
        False,
    ),
    Story(
        "empty_generation_one_chunk",
        [(H(), NONE), (B(ROLE + FINISH_STOP + USAGE_ONLY + DONE, True), WA)],
        S.WRITING_AHEAD,
        False,
    ),
    Story(
        "empty_generation_done_before_end_of_stream",
        [(H(), NONE), (B(ROLE + FINISH_STOP + DONE), WA)],
        S.WRITING_AHEAD,
        False,
    ),
    Story(
        "finish_then_clean_end_without_done",
        [(H(), NONE), (B(ROLE + FINISH_LENGTH), NONE), (B(b"", True), WA), (WriteAheadDone(), [Release(2)])],
        S.RELEASED,
        False,
    ),
    # --- CR-only line endings ----------------------------------------------------------------------------
    Story(
        "cr_only_content_releases",
        [(H(), NONE), (B(cr_only(ROLE + CONTENT) + b"d"), WA)],
        S.WRITING_AHEAD,
        True,
    ),
    Story(
        "cr_only_empty_generation_done_at_the_very_end",
        [(H(), NONE), (B(cr_only(ROLE + FINISH_STOP)), NONE), (B(b"data: [DONE]\r\r", True), WA)],
        S.WRITING_AHEAD,
        False,
    ),
    Story(
        "cr_only_done_then_separate_end",
        [(H(), NONE), (B(cr_only(ROLE + FINISH_STOP + DONE)), NONE), (B(b"", True), WA)],
        S.WRITING_AHEAD,
        False,
    ),
    # --- a 3xx is no replica failure and has nothing to read: passed through --------------------------
    Story("status_307", [(H(307, JSON), [Release(0)])], S.PASSED_THROUGH, False),
    # --- a 4xx (not 429): held while its reason is read, then a rejection (never resent) ----------------
    Story(
        "status_400_context_length_vllm",
        [
            (H(400, JSON), NONE),
            (B(VLLM_TOO_LONG[:40]), NONE),
            (B(VLLM_TOO_LONG[40:], True), _f(R.CONTEXT_LENGTH_EXCEEDED)),
        ],
        S.FAILED,
        False,
        R.CONTEXT_LENGTH_EXCEEDED,
    ),
    Story(
        "status_400_context_length_sglang",
        [(H(400, JSON), NONE), (B(SGLANG_TOO_LONG, True), _f(R.CONTEXT_LENGTH_EXCEEDED))],
        S.FAILED,
        False,
        R.CONTEXT_LENGTH_EXCEEDED,
    ),
    Story(
        "status_404_rejected",
        [(H(404, JSON), NONE), (B(NOT_FOUND, True), _f(R.REJECTED))],
        S.FAILED,
        False,
        R.REJECTED,
    ),
    Story(
        "status_413_gzip_rejected_without_a_reason",
        [(H(413, JSON, content_encoding="gzip"), NONE), (B(b"\x1f\x8b\x08\x00junk", True), _f(R.REJECTED))],
        S.FAILED,
        False,
        R.REJECTED,
    ),
    Story(
        "status_405_without_a_body",
        [(H(405, JSON, end_of_stream=True), _f(R.REJECTED))],
        S.FAILED,
        False,
        R.REJECTED,
    ),
    Story(
        "status_400_body_past_the_hold_bound",
        [(H(400, JSON), NONE), (B(b" " * (MAX_HELD + 1)), _f(R.REJECTED))],
        S.FAILED,
        False,
        R.REJECTED,
    ),
    Story(
        "status_400_reset_before_its_end_is_a_lost_connection",
        [
            (H(400, JSON), NONE),
            (B(VLLM_TOO_LONG[:40]), NONE),
            (StreamReset(), [*_f(R.CONNECTION_LOST), SETTLE]),
        ],
        S.FAILED,
        False,
        R.CONNECTION_LOST,
    ),
    # --- a non-stream JSON answer is its content: held until its end, or until too large ----------------
    Story(
        "json_held_until_end_of_stream",
        [
            (H(200, JSON), NONE),
            (B(b'{"id":"chatcmpl-1","choices":[{"mess'), NONE),
            (B(b'age":{}}]}'), NONE),
            (B(b"", True), WA),
            (WriteAheadDone(), [Release(3)]),
        ],
        S.RELEASED,
        True,
    ),
    Story("json_whole_body_at_once", [(H(200, JSON), NONE), (B(b"{}", True), WA)], S.WRITING_AHEAD, True),
    Story(
        "json_over_max_held_bytes_released_early",
        [
            (H(200, JSON), NONE),
            (B(b'{"x":"' + b"a" * 5000), NONE),
            (B(b"a" * 5000), WA),
            (B(b"a"), NONE),
            (WriteAheadDone(), [Release(3)]),
        ],
        S.RELEASED,
        True,
    ),
    Story(
        "json_abort_split_across_chunks",
        [
            (H(200, JSON), NONE),
            (B(b'{"choices":[{"index":0,"message":{"content":"a b"},"finish_rea'), NONE),
            (B(b'son": "abort"}]}', True), _f(R.ABORTED)),
        ],
        S.FAILED,
        False,
        R.ABORTED,
    ),
    Story(
        "json_abort_before_its_end",
        [(H(200, JSON), NONE), (B(b'{"choices":[{"finish_reason":"abort"'), _f(R.ABORTED))],
        S.FAILED,
        False,
        R.ABORTED,
    ),
    Story(
        "json_escaped_abort_is_text",
        [
            (H(200, JSON), NONE),
            (B(b'{"choices":[{"message":{"content":"\\"finish_reason\\": \\"abort\\""}'), NONE),
            (B(b"}]}", True), WA),
        ],
        S.WRITING_AHEAD,
        True,
    ),
    Story(
        "json_released_early_then_abort_is_the_downstreams",
        [
            (H(200, JSON), NONE),
            (B(b'{"x":"' + b"a" * 9000), WA),
            (B(b'","finish_reason":"abort"}', True), NONE),
            (WriteAheadDone(), [Release(2)]),
        ],
        S.RELEASED,
        True,
    ),
    # --- liveness lost: fence first ------------------------------------------------------------------
    Story(
        "liveness_lost_awaiting_headers",
        [
            (LivenessLost("heartbeat_lapsed"), [StartFence()]),
            (FenceProven("cancel_ack", 3.0), _f(R.REPLICA_LOST)),
        ],
        S.FAILED,
        False,
        R.REPLICA_LOST,
    ),
    Story(
        "progress_gap_while_holding",
        [
            (H(), NONE),
            (B(ROLE), NONE),
            (LivenessLost("progress_gap"), [StartFence()]),
            (FenceProven("lease_expiry"), _f(R.PATH_LOST)),
        ],
        S.FAILED,
        False,
        R.PATH_LOST,
    ),
    Story(
        "lease_lost_while_writing_ahead",
        [
            (H(), NONE),
            (B(CONTENT), WA),
            (LivenessLost("lease_lost"), [StartFence()]),
            (FenceProven("cancel_ack"), _f(R.LEASE_LOST)),
        ],
        S.FAILED,
        False,
        R.LEASE_LOST,
    ),
    Story(
        "fence_unprovable",
        [
            (H(), NONE),
            (LivenessLost("heartbeat_lapsed"), [StartFence()]),
            (FenceUnprovable(), _f(R.REPLICA_LOST, fence_proven=False)),
        ],
        S.FAILED,
        False,
        R.REPLICA_LOST,
    ),
    Story(
        "second_liveness_loss_starts_no_second_fence",
        [
            (LivenessLost("heartbeat_lapsed"), [StartFence()]),
            (LivenessLost("progress_gap"), NONE),
            (FenceProven("cancel_ack"), _f(R.REPLICA_LOST)),
        ],
        S.FAILED,
        False,
        R.REPLICA_LOST,
    ),
    Story(
        "headers_during_a_fence_answered_once_the_verdict_is_ready",
        [
            (LivenessLost("heartbeat_lapsed"), [StartFence()]),
            (H(), NONE),
            (FenceProven("cancel_ack"), _f(R.REPLICA_LOST)),
            (VerdictReady(RETRY), [Answer(RETRY, 0)]),
        ],
        S.DECIDED,
        False,
        R.REPLICA_LOST,
    ),
    Story(
        "verdict_before_headers_waits_for_them",
        [
            (LivenessLost("heartbeat_lapsed"), [StartFence()]),
            (FenceProven("cancel_ack"), _f(R.REPLICA_LOST)),
            (VerdictReady(RETRY), NONE),
            (H(), [Answer(RETRY, 0)]),
        ],
        S.DECIDED,
        False,
        R.REPLICA_LOST,
    ),
    Story(
        "fail_request_before_headers_waits_for_them",
        [
            (LivenessLost("progress_gap"), [StartFence()]),
            (FenceUnprovable(), _f(R.PATH_LOST, False)),
            (VerdictReady(FAIL_502), NONE),
            (H(503), [Answer(FAIL_502, 0)]),
        ],
        S.DECIDED,
        False,
        R.PATH_LOST,
    ),
    Story(
        "chunks_during_a_fence_are_answered_with_the_retry",
        # Envoy holds every chunk it sent until it is answered, and retries only then (`Answer`).
        [
            (H(), NONE),
            (B(ROLE), NONE),
            (LivenessLost("heartbeat_lapsed"), [StartFence()]),
            (B(ROLE), NONE),
            (B(CONTENT), NONE),
            (FenceProven("cancel_ack"), _f(R.REPLICA_LOST)),
            (VerdictReady(RETRY), [Answer(RETRY, 3)]),
        ],
        S.DECIDED,
        False,
        R.REPLICA_LOST,
    ),
    # --- nothing is answered after the stream is gone --------------------------------------------------
    Story(
        "fenced_attempt_whose_stream_is_gone",
        [
            (H(), NONE),
            (LivenessLost("heartbeat_lapsed"), [StartFence()]),
            (StreamReset(), NONE),
            (FenceProven("cancel_ack"), _f(R.REPLICA_LOST)),
            (VerdictReady(RETRY), NONE),
        ],
        S.DECIDED,
        False,
        R.REPLICA_LOST,
    ),
    Story(
        "failed_attempt_whose_stream_is_gone",
        [
            (H(503), _f(R.UPSTREAM_STATUS)),
            (StreamReset(), [SETTLE]),
            (VerdictReady(RETRY), NONE),
            (FenceProven("connection_closed"), NONE),
        ],
        S.DECIDED,
        False,
        R.UPSTREAM_STATUS,
    ),
    Story(
        "reset_awaiting_headers_no_answer",
        [(StreamReset(), [*_f(R.CONNECTION_LOST), SETTLE]), (VerdictReady(RETRY), NONE), (H(), NONE)],
        S.DECIDED,
        False,
        R.CONNECTION_LOST,
    ),
    # --- the verdict's answer: the lease first, a retry lets the held chunks go --------------------------
    Story(
        "settle_before_answer",
        [
            (H(503), _f(R.UPSTREAM_STATUS)),
            (VerdictReady(RETRY), [SETTLE, Answer(RETRY, 0)]),
            (StreamReset(), NONE),
            (FenceProven("connection_closed"), NONE),
        ],
        S.DECIDED,
        False,
        R.UPSTREAM_STATUS,
    ),
    Story(
        "retry_answer_carries_the_held_chunks",
        [
            (H(), NONE),
            (B(KEEPALIVE), NONE),
            (B(ROLE), NONE),
            (B(ERROR), _f(R.ERROR_EVENT)),
            (VerdictReady(RETRY), [SETTLE, Answer(RETRY, 3)]),
        ],
        S.DECIDED,
        False,
        R.ERROR_EVENT,
    ),
    Story(
        "fail_request_answer_carries_no_chunks",
        [
            (H(), NONE),
            (B(KEEPALIVE), NONE),
            (B(ROLE), NONE),
            (B(ERROR), _f(R.ERROR_EVENT)),
            (VerdictReady(FAIL_502), [SETTLE, Answer(FAIL_502, 0)]),
        ],
        S.DECIDED,
        False,
        R.ERROR_EVENT,
    ),
    # --- the stream is reset ------------------------------------------------------------------------------
    Story(
        "reset_awaiting_headers",
        [(StreamReset(), [*_f(R.CONNECTION_LOST), SETTLE])],
        S.FAILED,
        False,
        R.CONNECTION_LOST,
    ),
    Story(
        "reset_holding",
        [(H(), NONE), (B(ROLE), NONE), (StreamReset(), [*_f(R.CONNECTION_LOST), SETTLE])],
        S.FAILED,
        False,
        R.CONNECTION_LOST,
    ),
    Story(
        "reset_holding_json",
        [(H(200, JSON), NONE), (B(b"{"), NONE), (StreamReset(), [*_f(R.CONNECTION_LOST), SETTLE])],
        S.FAILED,
        False,
        R.CONNECTION_LOST,
    ),
    Story(
        "reset_with_liveness_uncertain_awaiting_headers",
        [
            (StreamReset(liveness_uncertain=True), [StartFence()]),
            (FenceProven("lease_expiry"), _f(R.REPLICA_LOST)),
        ],
        S.FAILED,
        False,
        R.REPLICA_LOST,
    ),
    Story(
        "reset_with_liveness_uncertain_holding",
        [(H(), NONE), (B(ROLE), NONE), (StreamReset(liveness_uncertain=True), [StartFence()])],
        S.FENCING,
        False,
        R.REPLICA_LOST,  # the cause it will fail with, once fenced
    ),
    Story(
        "reset_writing_ahead",
        [(H(), NONE), (B(CONTENT), WA), (StreamReset(), [*_f(R.LOST_BEFORE_RELEASE), SETTLE])],
        S.FAILED,
        False,
        R.LOST_BEFORE_RELEASE,
    ),
    Story(
        "reset_with_liveness_uncertain_writing_ahead",
        # Nothing was released yet, and the replica may run on: fenced like a live attempt.
        [(H(), NONE), (B(CONTENT), WA), (StreamReset(liveness_uncertain=True), [StartFence()])],
        S.FENCING,
        False,
        R.REPLICA_LOST,  # the cause it will fail with, once fenced
    ),
    Story(
        "reset_after_release_is_the_downstreams",
        [(H(), NONE), (B(CONTENT), WA), (WriteAheadDone(), [Release(1)]), (StreamReset(), NONE)],
        S.RELEASED,
        True,
    ),
    Story(
        "reset_after_pass_through",
        [(H(307, JSON), [Release(0)]), (StreamReset(), NONE)],
        S.PASSED_THROUGH,
        False,
    ),
    Story(
        "reset_after_failure_is_not_a_second_failure",
        [(H(503), _f(R.UPSTREAM_STATUS)), (StreamReset(), [SETTLE])],
        S.FAILED,
        False,
        R.UPSTREAM_STATUS,
    ),
    # --- superseded: Envoy started the next attempt ------------------------------------------------
    Story(
        "superseded_awaiting_headers",
        [(Superseded(), [*_f(R.CONNECTION_LOST), SETTLE])],
        S.FAILED,
        False,
        R.CONNECTION_LOST,
    ),
    Story(
        "superseded_awaiting_headers_liveness_uncertain",
        [(Superseded(liveness_uncertain=True), [StartFence()])],
        S.FENCING,
        False,
        R.REPLICA_LOST,  # the cause it will fail with, once fenced
    ),
    Story(
        "superseded_holding",
        [(H(), NONE), (B(ROLE), NONE), (Superseded(), [*_f(R.CONNECTION_LOST), SETTLE])],
        S.FAILED,
        False,
        R.CONNECTION_LOST,
    ),
    Story(
        "superseded_holding_liveness_uncertain",
        [
            (H(), NONE),
            (Superseded(liveness_uncertain=True), [StartFence()]),
            (FenceProven("cancel_ack"), _f(R.REPLICA_LOST)),
        ],
        S.FAILED,
        False,
        R.REPLICA_LOST,
    ),
    Story(
        "superseded_writing_ahead",
        [(H(), NONE), (B(CONTENT), WA), (Superseded(), [*_f(R.LOST_BEFORE_RELEASE), SETTLE])],
        S.FAILED,
        False,
        R.LOST_BEFORE_RELEASE,
    ),
    Story(
        "superseded_writing_ahead_liveness_uncertain",
        [(H(), NONE), (B(CONTENT), WA), (Superseded(liveness_uncertain=True), [StartFence()])],
        S.FENCING,
        False,
        R.REPLICA_LOST,  # the cause it will fail with, once fenced
    ),
    Story(
        "superseded_released",
        [
            (H(), NONE),
            (B(CONTENT), WA),
            (WriteAheadDone(), [Release(1)]),
            (Superseded(), [*_f(R.LOST_BEFORE_RELEASE), SETTLE]),
        ],
        S.FAILED,
        False,
        R.LOST_BEFORE_RELEASE,
    ),
    Story(
        "superseded_released_liveness_uncertain",
        [
            (H(), NONE),
            (B(CONTENT), WA),
            (WriteAheadDone(), [Release(1)]),
            (Superseded(liveness_uncertain=True), [StartFence()]),
        ],
        S.FENCING,
        False,
        R.REPLICA_LOST,  # the cause it will fail with, once fenced
    ),
    Story(
        "superseded_fencing",
        [(LivenessLost("heartbeat_lapsed"), [StartFence()]), (Superseded(), NONE)],
        S.FENCING,
        False,
        R.REPLICA_LOST,  # the cause it will fail with, once fenced
    ),
    Story(
        "superseded_passed_through",
        [(H(307, JSON), [Release(0)]), (Superseded(), NONE)],
        S.PASSED_THROUGH,
        False,
    ),
    Story(
        "superseded_failed",
        [(H(503), _f(R.UPSTREAM_STATUS)), (Superseded(), [SETTLE]), (VerdictReady(RETRY), NONE)],
        S.DECIDED,
        False,
        R.UPSTREAM_STATUS,
    ),
    Story(
        "superseded_failed_and_answered",
        [
            (H(503), _f(R.UPSTREAM_STATUS)),
            (VerdictReady(RETRY), [SETTLE, Answer(RETRY, 0)]),
            (Superseded(), NONE),
        ],
        S.DECIDED,
        False,
        R.UPSTREAM_STATUS,
    ),
]


def test_a_second_verdict_is_illegal() -> None:
    attempt = drive([H(429), VerdictReady(RETRY)])
    assert attempt.state is S.DECIDED
    with pytest.raises(IllegalInput, match="att-1"):
        attempt.handle(VerdictReady(FAIL_502))
    assert attempt.verdict == RETRY


@pytest.mark.parametrize("story", STORIES, ids=[s.id for s in STORIES])
def test_attempt_story(story: Story) -> None:
    attempt = new_attempt()
    for index, (event, expected) in enumerate(story.steps):
        assert attempt.handle(event) == expected, (index, event)
    assert attempt.state is story.state
    if story.first_delta is not None:
        assert attempt.first_delta is story.first_delta
    assert attempt.failure is story.failure
    if story.failure is not None:
        assert attempt.detail  # a human-readable detail is always given


def test_story_ids_are_unique() -> None:
    assert len({s.id for s in STORIES}) == len(STORIES)


# Every split of a short stream into two chunks: the first content event is found by the chunk that completes
# it, never earlier. CR-only framing: an event ending in a lone CR at a chunk's end is complete only once the
# next byte shows it is not a CRLF.
STREAM = ROLE + CONTENT + FINISH_STOP + DONE
FRAMINGS = {"lf": (lambda d: d, 0), "crlf": (crlf, 0), "cr": (cr_only, 1)}


@pytest.mark.parametrize("framing", list(FRAMINGS))
def test_every_split_writes_ahead_at_the_first_content_event(framing: str) -> None:
    convert, lookahead = FRAMINGS[framing]
    data = convert(STREAM)
    boundary = len(convert(ROLE + CONTENT))
    for split in range(1, len(data)):
        attempt = new_attempt()
        attempt.handle(H())
        first = attempt.handle(B(data[:split]))
        if split >= boundary + lookahead:
            assert first == [WriteAhead()], split
        else:
            assert first == [], split
            assert attempt.handle(B(data[split:], True)) == [WriteAhead()], split
        assert attempt.first_delta is True


@pytest.mark.parametrize("framing", list(FRAMINGS))
def test_every_split_of_an_empty_generation(framing: str) -> None:
    convert, _ = FRAMINGS[framing]
    data = convert(ROLE + FINISH_STOP + DONE)
    for split in range(1, len(data)):
        attempt = new_attempt()
        attempt.handle(H())
        decisions = attempt.handle(B(data[:split])) + attempt.handle(B(data[split:], True))
        assert decisions == [WriteAhead()], split
        assert attempt.first_delta is False
        assert attempt.handle(WriteAheadDone()) == [Release(2)]


def test_overloaded_keeps_retry_after_and_status() -> None:
    attempt = drive([H(429, JSON, retry_after="7")])
    assert (attempt.status, attempt.retry_after, attempt.failure) == (429, "7", FailureReason.OVERLOADED)


def test_a_retry_after_too_long_to_be_one_is_dropped() -> None:
    date = "Wed, 21 Oct 2026 07:28:00 GMT"
    assert drive([H(429, JSON, retry_after=date)]).retry_after == date
    attempt = drive([H(429, JSON, retry_after="9" * 60_000)])  # a hostile replica's header
    assert (attempt.retry_after, attempt.failure) == (None, FailureReason.OVERLOADED)
    assert len(attempt.detail or "") < 100


def test_status_is_recorded() -> None:
    assert drive([H(503)]).status == 503
    assert drive([H(404, JSON)]).status == 404
    assert drive([LivenessLost("heartbeat_lapsed"), H(503)]).status == 503  # headers that came during a fence
    # Headers that came after the fence ended (the verdict waited for them): the replica's answer is recorded.
    assert drive([LivenessLost("heartbeat_lapsed"), FenceProven("cancel_ack"), H(503)]).status == 503


def test_lost_before_release_is_no_first_delta() -> None:
    for last in (StreamReset(), Superseded()):
        attempt = drive([H(), B(CONTENT)])
        assert attempt.first_delta is True
        attempt.handle(last)
        assert (attempt.first_delta, attempt.failure) == (False, FailureReason.LOST_BEFORE_RELEASE)
    attempt = drive([H(), B(CONTENT), WriteAheadDone(), Superseded()])
    assert (attempt.first_delta, attempt.state) == (False, AttemptState.FAILED)


def test_fence_is_recorded() -> None:
    attempt = drive([LivenessLost("heartbeat_lapsed"), FenceProven("cancel_ack", 12.345)])
    assert attempt.fenced is True
    assert attempt.fence == {"proof": "cancel_ack", "waited_ms": 12.3}
    unprovable = drive([LivenessLost("heartbeat_lapsed"), FenceUnprovable()])
    assert unprovable.fenced is False  # nothing proves it stopped
    assert unprovable.fence == {"proof": None, "waited_ms": 0.0}


def test_closed_connection_fence_sets_fenced_without_an_event() -> None:
    outbox: list[Event] = []
    attempt = drive([H(), StreamReset()], outbox)
    assert attempt.fenced is False  # not before the settlement is confirmed
    before = list(outbox)
    assert attempt.handle(FenceProven("connection_closed")) == []
    assert attempt.fenced is True
    assert attempt.fence is None  # no fence was needed
    assert outbox == before


def test_verdict_is_recorded() -> None:
    attempt = drive([H(503), VerdictReady(FAIL_502)])
    assert attempt.verdict == FAIL_502


# --- the journal events each transition emits ----------------------------------------------------------

# (id, path, input, expected events: (name, detail items that must be in it))
EVENTS: list[tuple[str, list[Input], Input, list[tuple[EventName, dict[str, Any]]]]] = [
    ("headers_2xx", [], H(), [(EventName.HEADERS_HELD, {"status": 200})]),
    ("headers_3xx", [], H(307, JSON), [(EventName.RESPONSE_PASSED_THROUGH, {"status": 307})]),
    ("headers_4xx", [], H(404, JSON), [(EventName.HEADERS_HELD, {"status": 404})]),
    (
        "body_of_a_4xx",
        [H(400, JSON)],
        B(VLLM_TOO_LONG, True),
        [(EventName.ATTEMPT_FAILED, {"reason": "context_length_exceeded"})],
    ),
    ("headers_5xx", [], H(503), [(EventName.ATTEMPT_FAILED, {"reason": "upstream_status"})]),
    (
        "headers_429",
        [],
        H(429, retry_after="7"),
        [(EventName.ATTEMPT_FAILED, {"reason": "replica_overloaded"})],
    ),
    ("body_held", [H()], B(ROLE), []),
    ("first_delta", [H()], B(CONTENT), [(EventName.FIRST_DELTA_SENT, {"attempt_id": "att-1"})]),
    ("empty_generation", [H()], B(ROLE + FINISH_STOP + DONE), []),
    ("error_event", [H()], B(ERROR), [(EventName.ATTEMPT_FAILED, {"reason": "error_event"})]),
    ("write_ahead_done", [H(), B(CONTENT)], WriteAheadDone(), []),
    (
        "liveness_lost",
        [H()],
        LivenessLost("progress_gap"),
        [(EventName.REPLICA_LOST, {"replica": "r1", "cause": "progress_gap"})],
    ),
    (
        "reset_uncertain",
        [H()],
        StreamReset(liveness_uncertain=True),
        [(EventName.REPLICA_LOST, {"replica": "r1", "cause": "connection_closed_uncertain"})],
    ),
    (
        "fence_proven",
        [LivenessLost("heartbeat_lapsed")],
        FenceProven("cancel_ack", 4.0),
        [
            (EventName.ATTEMPT_FENCED, {"attempt_id": "att-1", "proof": "cancel_ack", "waited_ms": 4.0}),
            (EventName.ATTEMPT_FAILED, {"reason": "replica_lost"}),
        ],
    ),
    (
        "fence_unprovable",
        [LivenessLost("lease_lost")],
        FenceUnprovable(),
        [
            (EventName.ATTEMPT_FENCED, {"attempt_id": "att-1", "proof": None}),
            (EventName.ATTEMPT_FAILED, {"reason": "lease_lost"}),
        ],
    ),
    ("reset_live", [H()], StreamReset(), [(EventName.ATTEMPT_FAILED, {"reason": "connection_lost"})]),
    (
        "reset_writing_ahead",
        [H(), B(CONTENT)],
        StreamReset(),
        [(EventName.ATTEMPT_FAILED, {"reason": "lost_before_release"})],
    ),
    (
        "superseded_released",
        [H(), B(CONTENT), WriteAheadDone()],
        Superseded(),
        [(EventName.ATTEMPT_FAILED, {"reason": "lost_before_release"})],
    ),
    ("reset_released", [H(), B(CONTENT), WriteAheadDone()], StreamReset(), []),
    ("closed_connection_settled", [StreamReset()], FenceProven("connection_closed"), []),
    ("verdict", [H(503)], VerdictReady(RETRY), []),
    ("late_headers_answered", [StreamReset()], H(), []),
]


@pytest.mark.parametrize(("path", "event", "expected"), [e[1:] for e in EVENTS], ids=[e[0] for e in EVENTS])
def test_journal_events_of_each_transition(
    path: list[Input], event: Input, expected: list[tuple[EventName, dict[str, Any]]]
) -> None:
    outbox: list[Event] = []
    attempt = drive(path, outbox)
    outbox.clear()
    attempt.handle(event)
    assert [e.name for e in outbox] == [name for name, _ in expected]
    for got, (name, items) in zip(outbox, expected, strict=True):
        assert got.attempt == 1
        assert items.items() <= got.detail.items(), (name, got.detail)
        if name is EventName.ATTEMPT_FAILED:
            assert got.detail["detail"]  # free text, never empty


def test_no_event_is_emitted_by_an_illegal_input() -> None:
    outbox: list[Event] = []
    attempt = drive([H(), B(CONTENT), WriteAheadDone()], outbox)
    before = list(outbox)
    with pytest.raises(IllegalInput):
        attempt.handle(H())
    assert outbox == before


# --- 3. real vLLM transcripts in random chunkings -----------------------------------------------------------


def _is_content(payload: Any) -> bool:
    """An independent reading of "first delta" (json, not the product's scanner)."""
    if not isinstance(payload, dict):
        return False
    for choice in payload.get("choices") or ():
        delta = choice.get("delta") or {}
        if choice.get("text") or delta.get("tool_calls"):
            return True
        if any(delta.get(k) for k in ("content", "reasoning_content", "reasoning", "refusal")):
            return True
    return False


def event_ends(data: bytes) -> list[tuple[int, Any]]:
    """(offset just past each event, its JSON payload or the raw payload) of an LF-framed transcript."""
    out: list[tuple[int, Any]] = []
    offset = 0
    for block in data.split(b"\n\n")[:-1]:
        offset += len(block) + 2
        payload = block.removeprefix(b"data: ")
        out.append((offset, payload if payload == b"[DONE]" else json.loads(payload)))
    return out


def first_content_end(data: bytes) -> int:
    return next(end for end, payload in event_ends(data) if _is_content(payload))


def random_chunks(data: bytes, rng: random.Random) -> list[bytes]:
    out = []
    i = 0
    while i < len(data):
        n = rng.choice((1, 2, 3, rng.randint(1, 40), rng.randint(1, 400), rng.randint(1, 4000)))
        out.append(data[i : i + n])
        i += n
    return out


RELEASING = [
    "chat_stream_usage.sse",
    "chat_stream_continuous_usage.sse",
    "chat_stream_tool_required.sse",
    "chat_stream_killed_midstream.sse",
    "completions_stream.sse",
    "completions_stream_usage.sse",
]
SEEDS = range(12)


def test_first_content_offsets_are_what_the_transcripts_show() -> None:
    # The first content event: the 2nd of a chat transcript (after the role chunk), the 1st of completions.
    for name, index in [
        ("chat_stream_usage.sse", 2),
        ("chat_stream_tool_required.sse", 2),
        ("chat_stream_killed_midstream.sse", 2),
        ("completions_stream.sse", 1),
    ]:
        data = (REFERENCE / name).read_bytes()
        ends = [i + 2 for i in range(len(data)) if data.startswith(b"\n\n", i)]
        assert first_content_end(data) == ends[index - 1], name


def feed_transcript(
    data: bytes, chunks: list[bytes], eos_last: bool
) -> tuple[Attempt, int, int, list[Event]]:
    """Feed until the first decision; returns the attempt, bytes fed, chunks fed and its events."""
    outbox: list[Event] = []
    attempt = new_attempt(outbox)
    assert attempt.handle(H()) == []
    fed = 0
    for i, c in enumerate(chunks):
        decisions = attempt.handle(B(c, eos_last and i == len(chunks) - 1))
        fed += len(c)
        if decisions:
            return attempt, fed, i + 1, outbox
    raise AssertionError("no decision")


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("name", RELEASING)
def test_transcript_releases_once_at_first_content(name: str, seed: int) -> None:
    data = (REFERENCE / name).read_bytes()
    boundary = first_content_end(data)
    chunks = [data] if seed == 0 else random_chunks(data, random.Random(f"{name}:{seed}"))
    attempt, fed, count, outbox = feed_transcript(data, chunks, eos_last=True)
    # The chunk that completes the first content event, and no earlier one, writes ahead.
    assert fed - len(chunks[count - 1]) < boundary <= fed, (seed, count, fed)
    assert attempt.state is AttemptState.WRITING_AHEAD and attempt.first_delta is True
    assert [e.name for e in outbox] == [EventName.HEADERS_HELD, EventName.FIRST_DELTA_SENT]
    assert attempt.handle(WriteAheadDone()) == [Release(count)]  # every chunk fed so far is released
    assert attempt.handle(StreamReset()) == []  # a later reset is no failure of this attempt


@pytest.mark.parametrize("seed", SEEDS)
def test_engine_dead_transcript_fails_with_error_event(seed: int) -> None:
    data = (REFERENCE / "engine_dead_midstream_error.sse").read_bytes()
    chunks = [data] if seed == 0 else random_chunks(data, random.Random(seed))
    error_end = event_ends(data)[0][0]
    attempt, fed, count, outbox = feed_transcript(data, chunks, eos_last=True)
    assert fed - len(chunks[count - 1]) < error_end <= fed
    assert (attempt.state, attempt.failure) == (AttemptState.FAILED, FailureReason.ERROR_EVENT)
    assert [e.name for e in outbox] == [EventName.HEADERS_HELD, EventName.ATTEMPT_FAILED]
    assert attempt.handle(VerdictReady(RETRY)) == [SETTLE, Answer(RETRY, count)]


# --- what a replica's rejection says -------------------------------------------------------------------


def test_a_rejection_carries_the_replicas_reason_and_param() -> None:
    attempt = drive([H(400, JSON), B(VLLM_TOO_LONG, True)])
    assert attempt.reader.rejection == Rejection(
        400,
        "max_tokens=5000 cannot be greater than max_model_len=1024. Please request fewer output tokens. "
        "(parameter=max_tokens, value=5000)",
        "max_tokens",
    )
    assert attempt.detail is not None and attempt.detail.startswith("replica answered 400: max_tokens=5000")


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        (
            SGLANG_TOO_LONG,
            Rejection(
                400, "Requested token count exceeds the model's maximum context length of 1024 tokens."
            ),
        ),
        (
            b'{"type":"error","error":{"type":"invalid_request_error","message":"prompt is too long"}}',
            Rejection(400, "prompt is too long"),
        ),
        (
            b'{"error":{"message":"too many tokens","code":"context_length_exceeded","param":"messages"}}',
            Rejection(400, "too many tokens (context_length_exceeded)", "messages"),
        ),
        (b"<html>Bad Request</html>", Rejection(400, "replica answered 400")),
        (b"[" * 10_000, Rejection(400, "replica answered 400")),  # too deep: not read
        (b'{"error":{"message":""}}', Rejection(400, "replica answered 400")),
        (b'{"error":{"message":7,"param":["x"]}}', Rejection(400, "replica answered 400")),
        (
            b'{"message":"' + b"m" * 5000 + b'","param":"' + b"p" * 500 + b'"}',
            Rejection(400, "m" * 1024, "p" * 256),
        ),
    ],
    ids=["sglang", "anthropic", "openai_code", "html", "deep", "empty", "wrong_types", "long"],
)
def test_read_rejection(body: bytes, expected: Rejection) -> None:
    assert read_rejection(400, body) == expected


@pytest.mark.parametrize(
    ("message", "context"),
    [
        ("max_tokens=5000 cannot be greater than max_model_len=1024.", True),
        ("This model's maximum context length is 1024 tokens. However, you requested 2000 tokens", True),
        ("The decoder prompt (length 3000) is longer than the maximum model length of 1024.", True),
        ("too many tokens (context_length_exceeded)", True),
        ("The model `nope` does not exist.", False),
        ("temperature must be non-negative", False),
    ],
)
def test_context_length_is_told_from_other_rejections(message: str, context: bool) -> None:
    assert is_context_length(Rejection(400, message)) is context


def test_a_rejection_body_is_kept_only_up_to_its_bound() -> None:
    reader = AttemptReader(max_held_bytes=1 << 20, max_event_bytes=1 << 16)
    reader.headers(H(400, JSON))
    body = b'{"error":{"message":"' + b"x" * (MAX_REJECTION_BYTES * 2)
    assert reader.body(B(body)).kind is Kind.BODY_HELD
    assert reader.body(B(b'"}}', True)).reason is FailureReason.REJECTED  # cut: no JSON document to read
    assert reader.rejection == Rejection(400, "replica answered 400")
