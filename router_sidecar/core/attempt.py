"""The attempt machine: one try of a logical request on one replica, its whole life in one place.

Sans-IO, in the manner of h11's `_state.py`: everything that affects an attempt's state lives in this
file, and the file knows nothing about gRPC, etcd or clocks. The logical request (`request.py`) feeds it
the inputs below and turns the decisions it gets back into its own; no shell calls it directly.

Three small machines, each a table of data (docs/design.md#the-attempt-machine draws them):

* `TRANSITIONS`: what the attempt is — `AttemptState × Kind → Step(next state, actions)`. A raw input is
  first read into a `Kind` (`AttemptReader`: the status line, the held body's SSE events), the way h11's
  readers turn bytes into events before its state table sees them.
* `REPLY_TRANSITIONS`: what Envoy waits for on the attempt's ext_proc stream (nothing yet, our reply to the
  held response headers, nothing any more).
* `LEASE_TRANSITIONS`: the attempt's right to publish (held, being settled or fenced, proven gone).

    AWAITING_HEADERS ──2xx, 4xx──▶ HOLDING ──first delta──▶ WRITING_AHEAD ──durable──▶ RELEASED
         │   │                  │  │                        │
         │   └──3xx──▶ PASSED_THROUGH                        └──reset──▶ FAILED
         │                      │  └──5xx, 429, error event, abort, too large, no [DONE], reset──▶ FAILED
         │                      └──4xx body read to its end (rejected: never resent unchanged)──▶ FAILED
         └───heartbeat lapsed, progress gap, lease lost (either state)──▶ FENCING ──proof──▶ FAILED
    FAILED ──verdict──▶ DECIDED      (the verdict is written once the held headers are there to answer)

Headers are held until the first content delta, because while they are held a failure is invisible to the
client and Envoy can still retry (docs/design.md#the-two-filter-placements). A failed attempt's fate — retry
elsewhere or one error for the client — is the logical request's verdict, answered in reply to the held
headers (deferred until they arrive when the failure came first). Before another attempt may start, this one
must be fenced: its lease settled on a closed connection, or revoked and proven by a cancel ack or its expiry.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass
from typing import Any

from router_sidecar.core import bounded_json
from router_sidecar.core.events import Event, EventName
from router_sidecar.core.sse import AbortScan, Classifier, EventKind, SseScanner, classify_openai

# --- states, causes ----------------------------------------------------------------------------------


class AttemptState(enum.Enum):
    AWAITING_HEADERS = "awaiting_headers"  # sent to its replica, no response headers yet
    HOLDING = "holding"  # 2xx headers and every chunk held: a failure is still invisible to the client
    FENCING = "fencing"  # liveness uncertain: its lease is revoked, waiting for the proof it stopped
    WRITING_AHEAD = "writing_ahead"  # first delta found: first_delta_sent is being made durable
    RELEASED = "released"  # headers and held chunks released; the downstream owns the rest
    PASSED_THROUGH = "passed_through"  # not a replica failure and nothing to read (3xx): released unchanged
    FAILED = "failed"  # failed before release; the request's verdict is not known yet
    DECIDED = "decided"  # failed, and the verdict (retry or one error) is known: answered when it can be
    # Its stream ended before its request was let go (the connection Envoy picked was closed, a connect was
    # refused): no replica saw it, so it needs no verdict and is not one of max_attempts.
    NEVER_SENT = "never_sent"


# The journal and the client's error body say "failed" for these: the verdict is not an attempt outcome.
FAILED_STATES = frozenset({AttemptState.FAILED, AttemptState.DECIDED, AttemptState.NEVER_SENT})


class Reply(enum.Enum):
    """What Envoy waits for on the attempt's ext_proc stream."""

    NOTHING_YET = "nothing_yet"  # no response headers yet: nothing to answer
    HEADERS_HELD = "headers_held"  # Envoy waits for our reply to the response headers
    REPLIED = "replied"  # we answered (a verdict) or released: nothing more is written on the stream
    STREAM_GONE = "stream_gone"  # Envoy tore the stream down before we replied: nothing can be written


class LeaseState(enum.Enum):
    """The attempt's right to publish (its etcd lease, as the gateway knows it)."""

    HELD = "held"  # honoured: what the attempt publishes may be released
    SETTLING = "settling"  # its connection is closed (the proof): the revocation is on its way
    FENCING = "fencing"  # revoked; waiting for the replica side's cancel ack or the lease's expiry
    FENCED = "fenced"  # proven unable to publish: another attempt may start
    UNPROVABLE = "unprovable"  # no lease to revoke (etcd was away at its start): nothing proves it stopped


class FailureReason(enum.StrEnum):
    """Why an attempt failed before anything of it reached the client."""

    UPSTREAM_STATUS = "upstream_status"  # the replica answered 5xx
    OVERLOADED = "replica_overloaded"  # 429: overloaded, not broken; another replica may serve it
    CONTENT_ENCODED = "content_encoding"  # a compressed body the gateway cannot read (it never asks for one)
    CONNECTION_LOST = "connection_lost"  # reset, refused, process exit: Envoy tore the attempt down
    ERROR_EVENT = "error_event"  # in-band `data: {"error": ...}` before any content
    MALFORMED_EVENT = "malformed_event"  # an event that is not a JSON object before any content
    ABORTED = "aborted"  # finish_reason "abort" (engine shutting down) before any content
    ENDED_WITHOUT_DONE = "ended_without_done"  # clean end of body, but neither [DONE] nor a finish
    RESPONSE_TOO_LARGE = "response_too_large"  # more than limits.max_held_response_bytes before content
    EVENT_TOO_LARGE = "event_too_large"  # one SSE event over limits.max_event_bytes
    REPLICA_LOST = "replica_lost"  # its heartbeat lapsed while the connection stayed open: fenced
    PATH_LOST = "path_lost"  # the replica side reported bytes that never arrived: fenced
    LEASE_LOST = "lease_lost"  # its lease could not be kept (etcd): it lost the right to publish
    LOST_BEFORE_RELEASE = "lost_before_release"  # reset while our release was on its way; Envoy retried
    # Its stream ended before its request was let go to the replica (a pooled connection the replica had
    # closed, a refused connect): no replica saw it, so it is not one of max_attempts.
    NOT_SENT = "connection_lost_before_request"
    # A 4xx other than 429: the replica refused the request itself (invalid, content policy, unknown state).
    # Resent unchanged it would be refused again, so it never is: the client gets the replica's reason.
    REJECTED = "rejected_by_replica"
    # A 4xx saying the request does not fit the model's context (prompt plus max_tokens): a rejection too.
    CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"


# A replica refused the request itself: no other replica of its model is asked (docs/design.md#rejections).
REJECTIONS = frozenset({FailureReason.REJECTED, FailureReason.CONTEXT_LENGTH_EXCEEDED})


# Liveness causes (monitors, the shell's reading of a closed connection) → why the fenced attempt failed.
FENCE_CAUSES = {
    "heartbeat_lapsed": FailureReason.REPLICA_LOST,
    "health_check_failed": FailureReason.REPLICA_LOST,  # a static replica stopped answering /health
    "progress_gap": FailureReason.PATH_LOST,
    "lease_lost": FailureReason.LEASE_LOST,
    # Its connection closed, but it showed a sign of running on: as uncertain as a lapsed heartbeat.
    "connection_closed_uncertain": FailureReason.REPLICA_LOST,
}
UNCERTAIN_FAILURES = frozenset(
    {FailureReason.REPLICA_LOST, FailureReason.PATH_LOST, FailureReason.LEASE_LOST}
)

# --- inputs (named by cause) -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ResponseHeaders:
    status: int
    content_type: str = ""
    content_encoding: str = ""
    retry_after: str | None = None
    end_of_stream: bool = False  # no body follows


@dataclass(frozen=True, slots=True)
class ResponseBody:
    chunk: bytes
    end_of_stream: bool


@dataclass(frozen=True, slots=True)
class StreamReset:
    """Envoy tore the attempt's stream down (replica reset or refused, connect failure, client gone).

    `liveness_uncertain`: the replica showed a sign of running on (heartbeat lapsed, or it reported bytes
    that never arrived), so the closed connection proves nothing and the attempt must be fenced."""

    liveness_uncertain: bool = False


@dataclass(frozen=True, slots=True)
class NeverSent:
    """Envoy tore the attempt's stream down before the sidecar let its request go (its request headers were
    not answered yet): the connection Envoy had picked for it died first. The replica never saw it."""


@dataclass(frozen=True, slots=True)
class LivenessLost:
    """The attempt may still be running where we cannot see it: `cause` is heartbeat_lapsed, progress_gap
    or lease_lost (its lease could not be renewed)."""

    cause: str


@dataclass(frozen=True, slots=True)
class FenceProven:
    proof: str  # cancel_ack | lease_expiry | connection_closed
    waited_ms: float = 0.0


@dataclass(frozen=True, slots=True)
class FenceUnprovable:
    """No lease to revoke (etcd was unreachable when the attempt started): nothing proves it stopped."""


@dataclass(frozen=True, slots=True)
class WriteAheadDone:
    """`first_delta_sent` is durable (or etcd failed and the gateway serves anyway, logging it).

    `lease_publishable`: the attempt's lease was still honoured when the write came back (read by the shell
    from its local lease state); if not, nothing of the attempt may be released."""

    lease_publishable: bool = True


@dataclass(frozen=True, slots=True)
class Superseded:
    """Envoy started the next attempt while this one was released or still live: it is over."""

    liveness_uncertain: bool = False


@dataclass(frozen=True, slots=True)
class VerdictReady:
    verdict: TriggerRetry | FailRequest


Input = (
    ResponseHeaders
    | ResponseBody
    | StreamReset
    | NeverSent
    | LivenessLost
    | FenceProven
    | FenceUnprovable
    | WriteAheadDone
    | Superseded
    | VerdictReady
)

# --- verdicts of the logical request -----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TriggerRetry:
    """Answer the held response headers with `:status 503` so Envoy's router retries elsewhere."""

    reason: str


@dataclass(frozen=True, slots=True)
class FailRequest:
    """No retry: one HTTP error for the client, before any byte of a body went out."""

    status: int
    code: str
    message: str
    retry_after: str | None = None
    detail: str | None = None  # for the journal's retry_refused: what exactly refused it (a field, a budget)
    retryable: bool = True  # whether the same request sent again may succeed (a rejection's: no)
    param: str | None = None  # the request field a rejection names (the replica's `param`)


# --- decisions (what the logical request carries on) -------------------------------------------------


@dataclass(frozen=True, slots=True)
class Failed:
    """The attempt failed: the logical request gives its verdict (`VerdictReady`)."""

    reason: FailureReason
    fence_proven: bool = True


@dataclass(frozen=True, slots=True)
class Answer:
    """Write the verdict in reply to the held response headers, then leave the path. A retry also lets
    the `held_chunks` go: Envoy retries only once they are answered, and if it refuses the retry they reach
    the downstream filter, which replaces that whole response."""

    verdict: TriggerRetry | FailRequest
    held_chunks: int = 0


@dataclass(frozen=True, slots=True)
class StartFence:
    """Stop honouring the lease, revoke it, wait for the cancel ack or its expiry; feed the result."""


@dataclass(frozen=True, slots=True)
class SettleLease:
    """Revoke the lease in the background: `proof` (the closed connection) already fences the attempt."""

    proof: str


@dataclass(frozen=True, slots=True)
class WriteAhead:
    """Make `first_delta_sent` durable in the journal, then feed `WriteAheadDone`."""


@dataclass(frozen=True, slots=True)
class Release:
    """Release the held headers and `held_chunks` body chunks unchanged, then leave the path."""

    held_chunks: int


Decision = Failed | Answer | StartFence | SettleLease | WriteAhead | Release

COMPLETE_FINISH_REASONS = frozenset({"stop", "length", "tool_calls", "function_call", "content_filter"})
CONNECTION_CLOSED = "connection_closed"


def is_event_stream(content_type: str) -> bool:
    # Media types are case-insensitive (RFC 9110 §8.3.1).
    return content_type[:17].lower() == "text/event-stream"


class IllegalInput(RuntimeError):
    """An input that cannot happen in this state: a bug in the caller, never a replica's doing."""


# --- what an input says: the reader ------------------------------------------------------------------


class Kind(enum.Enum):
    """An input as the tables see it: raw inputs are read into one of these first."""

    HEADERS_OK = "2xx"  # a response the gateway reads and holds
    HEADERS_PASS = "3xx"  # not a replica failure, nothing to read: passed through unchanged
    HEADERS_REJECTED = "4xx"  # the replica refused the request: held while its reason is read
    HEADERS_FAILED = "5xx, 429, encoded"
    BODY_HELD = "nothing yet"  # read while holding: no content, no failure
    BODY_FIRST_DELTA = "first delta"  # the first content event (or a whole non-stream answer)
    BODY_COMPLETE = "complete without content"  # [DONE] or a completing finish with nothing in it
    BODY_FAILED = "error, abort, malformed, too large, no [DONE]"
    CHUNK = "chunk"  # a body chunk in a state that no longer reads: held (never released) or ignored
    RESET = "reset"
    NEVER_SENT = "gone before its request was sent"
    RESET_UNCERTAIN = "reset (uncertain)"
    LIVENESS_LOST = "liveness lost"
    FENCE_PROVEN = "fence proven"
    FENCE_UNPROVABLE = "fence unprovable"
    WRITE_AHEAD_DONE = "durable"
    WRITE_AHEAD_DONE_LEASE_LOST = "durable (lease not honoured)"
    SUPERSEDED = "superseded"
    SUPERSEDED_UNCERTAIN = "superseded (uncertain)"
    VERDICT = "verdict"


@dataclass(frozen=True, slots=True)
class Reading:
    """What a raw input says: its `Kind`, and for a failure why."""

    kind: Kind
    reason: FailureReason | None = None
    detail: str = ""


@dataclass(frozen=True, slots=True)
class Rejection:
    """What a replica's 4xx said, read from its error body (OpenAI's, vLLM's older, or Anthropic's shape)."""

    status: int
    message: str
    param: str | None = None


MAX_REJECTION_BYTES = 16 * 1024  # of a 4xx body kept to read its reason (a longer one is cut, not trusted)
MAX_REJECTION_MESSAGE = 1024  # characters of the replica's message carried to the client and the journal
# How vLLM (max_model_len, "maximum context length"), SGLang and OpenAI say a request does not fit.
_CONTEXT_LENGTH = re.compile(
    r"context[ _]length|max_model_len|maximum model length|context window|prompt is too long", re.IGNORECASE
)


def read_rejection(status: int, body: bytes) -> Rejection:
    """The replica's reason from its 4xx body (a body that is not such a JSON document: only the status)."""
    try:
        doc = bounded_json.loads(body, max_depth=8)
    except ValueError:
        doc = None
    error = doc.get("error") if isinstance(doc, dict) else None
    fields = error if isinstance(error, dict) else doc if isinstance(doc, dict) else {}
    message, param, code = fields.get("message"), fields.get("param"), fields.get("code")
    if not isinstance(message, str) or not message:
        return Rejection(status, f"replica answered {status}")
    if isinstance(code, str) and code and code not in message:
        message = f"{message} ({code})"
    return Rejection(
        status, message[:MAX_REJECTION_MESSAGE], param[:256] if isinstance(param, str) and param else None
    )


def is_context_length(rejection: Rejection) -> bool:
    return _CONTEXT_LENGTH.search(rejection.message) is not None


def in_band_rejection(event: bytes) -> Rejection | None:
    """An in-band error event before any content that says the request does not fit the context (a 400 in
    all but its framing), or None: any other in-band error may be the replica's own trouble (retried)."""
    payload = b"\n".join(line[5:].strip() for line in event.splitlines() if line.startswith(b"data:"))
    rejection = read_rejection(400, payload)
    return rejection if is_context_length(rejection) else None


_HELD = Reading(Kind.BODY_HELD)
_FIRST_DELTA = Reading(Kind.BODY_FIRST_DELTA)
_COMPLETE = Reading(Kind.BODY_COMPLETE)
_CHUNK = Reading(Kind.CHUNK)


class AttemptReader:
    """Reads the held response: its status line once, then its body (SSE events, or one JSON answer)
    until the first content, a failure, or a complete generation without content."""

    def __init__(
        self, *, max_held_bytes: int, max_event_bytes: int, classify: Classifier = classify_openai
    ) -> None:
        self.held_bytes = 0
        # A 429's or 503's Retry-After: it ejects the replica a while (a 429's goes to the client if no
        # other replica serves the request).
        self.retry_after: str | None = None
        self._max_held_bytes = max_held_bytes
        self._streaming = False
        self._scanner = SseScanner(max_event_bytes=max_event_bytes, classify=classify)  # the API's reading
        self._abort_scan = AbortScan()  # non-stream answers only
        self._finished = False  # a finish_reason that means "generation complete" was seen
        self._rejected_status: int | None = None  # a 4xx: its body is read for the reason, not scanned
        self._rejection_body = bytearray()
        self.rejection: Rejection | None = None  # what the replica's 4xx said, once its body was read

    def headers(self, e: ResponseHeaders) -> Reading:
        if e.status in (429, 503):
            # Seconds or an HTTP-date (29 characters): anything longer is not a Retry-After, and it would be
            # copied into the journal record and the client's answer. (A 503's only ejects its replica.)
            self.retry_after = e.retry_after if e.retry_after is None or len(e.retry_after) <= 64 else None
        if e.status == 429:
            retry_after = self.retry_after
            return Reading(
                Kind.HEADERS_FAILED,
                FailureReason.OVERLOADED,
                f"replica answered 429 (Retry-After {retry_after})",
            )
        if e.status >= 500:
            return Reading(Kind.HEADERS_FAILED, FailureReason.UPSTREAM_STATUS, f"replica answered {e.status}")
        if 400 <= e.status < 500:
            self._rejected_status = e.status
            if e.end_of_stream:  # no body to read a reason from
                self.rejection = Rejection(e.status, f"replica answered {e.status}")
                return Reading(Kind.HEADERS_FAILED, FailureReason.REJECTED, self.rejection.message)
            return Reading(Kind.HEADERS_REJECTED)
        if e.status >= 300:
            return Reading(Kind.HEADERS_PASS)
        if e.content_encoding.lower() not in ("", "identity"):
            return Reading(
                Kind.HEADERS_FAILED, FailureReason.CONTENT_ENCODED, f"content-encoding {e.content_encoding!r}"
            )
        self._streaming = is_event_stream(e.content_type)
        return Reading(Kind.HEADERS_OK)

    def body(self, e: ResponseBody) -> Reading:
        self.held_bytes += len(e.chunk)
        if self._rejected_status is not None:
            return self._rejection_read(e)
        if not self._streaming:
            # A non-stream answer is its content: released whole at its end, or, past the bound, released
            # as it comes (Envoy must not hold a large body for us) — then a later cut is a reset.
            self._abort_scan.feed(e.chunk)
            if self._abort_scan.aborted:
                return Reading(
                    Kind.BODY_FAILED, FailureReason.ABORTED, "finish_reason abort in a non-stream answer"
                )
            if e.end_of_stream or self.held_bytes > self._max_held_bytes:
                return _FIRST_DELTA
            return _HELD
        events = self._scanner.feed(e.chunk)
        if e.end_of_stream:
            events += self._scanner.close()
        for event in events:
            if event.kind is EventKind.ERROR:
                rejection = in_band_rejection(event.raw)
                if rejection is not None:  # SGLang's Messages stream refuses an over-long request in-band
                    self.rejection = rejection
                    return Reading(
                        Kind.BODY_FAILED,
                        FailureReason.CONTEXT_LENGTH_EXCEEDED,
                        f"in-band error before any content: {rejection.message}",
                    )
                return Reading(
                    Kind.BODY_FAILED, FailureReason.ERROR_EVENT, "in-band error event before any content"
                )
            if event.kind is EventKind.MALFORMED:
                # Held, so the client saw none of it: a broken replica, retried like an in-band error.
                return Reading(
                    Kind.BODY_FAILED, FailureReason.MALFORMED_EVENT, "an event that is not a JSON object"
                )
            if event.finish_reason == "abort":
                return Reading(
                    Kind.BODY_FAILED, FailureReason.ABORTED, "finish_reason abort before any content"
                )
            if event.kind is EventKind.CONTENT:
                return _FIRST_DELTA
            if event.finish_reason in COMPLETE_FINISH_REASONS:
                self._finished = True
            elif event.kind is EventKind.DONE:
                # A complete generation without content (e.g. EOS as the first token): nothing to retry.
                return _COMPLETE
        if self._scanner.oversized:
            return Reading(
                Kind.BODY_FAILED, FailureReason.EVENT_TOO_LARGE, "an SSE event over limits.max_event_bytes"
            )
        if self.held_bytes > self._max_held_bytes:
            return Reading(
                Kind.BODY_FAILED,
                FailureReason.RESPONSE_TOO_LARGE,
                f"{self.held_bytes} bytes before any content (limits.max_held_response_bytes)",
            )
        if e.end_of_stream:
            if self._finished:
                return _COMPLETE
            return Reading(
                Kind.BODY_FAILED, FailureReason.ENDED_WITHOUT_DONE, "response ended without content or [DONE]"
            )
        return _HELD

    def _rejection_read(self, e: ResponseBody) -> Reading:
        assert self._rejected_status is not None
        kept = MAX_REJECTION_BYTES - len(self._rejection_body)
        if kept > 0:
            self._rejection_body += e.chunk[:kept]
        if not e.end_of_stream and self.held_bytes <= self._max_held_bytes:
            return _HELD
        # Whole (or past the hold's bound: what came is all that is read).
        rejection = self.rejection = read_rejection(self._rejected_status, bytes(self._rejection_body))
        reason = (
            FailureReason.CONTEXT_LENGTH_EXCEEDED if is_context_length(rejection) else FailureReason.REJECTED
        )
        return Reading(Kind.BODY_FAILED, reason, f"replica answered {rejection.status}: {rejection.message}")


# --- the tables --------------------------------------------------------------------------------------


class Action(enum.Enum):
    """What a step does besides moving to its next state (carried out in this order)."""

    HOLD = "hold"  # journal: headers_held
    PASS = "pass"  # journal: response_passed_through; release everything unchanged
    FAIL = "fail"  # record why (the row's reason, else the reading's); the request gives its verdict
    FENCE = "fence"  # record why (the liveness cause); revoke the lease and wait for the proof
    FENCED = "fenced"  # the fence's proof is in: fail with the reason recorded when it started
    SETTLE = "settle"  # the closed connection fences it: revoke its lease in the background
    WRITE_AHEAD = "write_ahead"  # make first_delta_sent durable before anything is released
    RELEASE = "release"  # release the held headers and chunks
    DECIDE = "decide"  # record the verdict (answered by the reply table when the headers are held)
    PROVEN = "proven"  # the revocation of a closed connection's lease went through: it is fenced
    UNSENT = "unsent"  # record that no replica saw it (no verdict: Envoy retries it by itself)


@dataclass(frozen=True, slots=True)
class Step:
    next: AttemptState
    actions: tuple[Action, ...] = ()
    reason: FailureReason | None = None  # for FAIL: why (None: what the reading says)
    detail: str = ""  # for FAIL with a reason of its own: what happened
    cause: str | None = None  # for FENCE: the liveness cause (None: the input's own)


_S, _K, _A, _R = AttemptState, Kind, Action, FailureReason
_UNCERTAIN = "connection_closed_uncertain"


def _stay(state: AttemptState, *kinds: Kind) -> dict[tuple[AttemptState, Kind], Step]:
    return {(state, kind): Step(state) for kind in kinds}


_SUPERSEDED_DETAIL = "Envoy started the next attempt: this one's connection was lost"


def _lost_while_live(
    state: AttemptState, reason: FailureReason, reset_detail: str
) -> dict[tuple[AttemptState, Kind], Step]:
    """Before release: a closed connection fails it (and fences it); an uncertain one must be fenced."""
    return {
        (state, _K.RESET): Step(_S.FAILED, (_A.FAIL, _A.SETTLE), reason, reset_detail),
        (state, _K.RESET_UNCERTAIN): Step(_S.FENCING, (_A.FENCE,), cause=_UNCERTAIN),
        (state, _K.SUPERSEDED): Step(_S.FAILED, (_A.FAIL, _A.SETTLE), reason, _SUPERSEDED_DETAIL),
        (state, _K.SUPERSEDED_UNCERTAIN): Step(_S.FENCING, (_A.FENCE,), cause=_UNCERTAIN),
        (state, _K.LIVENESS_LOST): Step(_S.FENCING, (_A.FENCE,)),
    }


_CONNECTION_LOST_DETAIL = "connection to the replica was lost"
_HEADERS = (_K.HEADERS_OK, _K.HEADERS_PASS, _K.HEADERS_REJECTED, _K.HEADERS_FAILED)
_GONE = (_K.RESET, _K.RESET_UNCERTAIN, _K.SUPERSEDED, _K.SUPERSEDED_UNCERTAIN)

# The whole lifecycle: state × kind → next state and actions. A pair that is not here is a bug in the
# caller (IllegalInput). Body chunks are read (`AttemptReader`) only while HOLDING; in every other state
# a chunk is CHUNK: held until the reply lets it go, never released after a failure.
TRANSITIONS: dict[tuple[AttemptState, Kind], Step] = {
    # Sent to its replica, no response headers yet.
    (_S.AWAITING_HEADERS, _K.HEADERS_OK): Step(_S.HOLDING, (_A.HOLD,)),
    # A 4xx is held like a 2xx while its body is read; it ends FAILED (rejected) and is never resent.
    (_S.AWAITING_HEADERS, _K.HEADERS_REJECTED): Step(_S.HOLDING, (_A.HOLD,)),
    (_S.AWAITING_HEADERS, _K.HEADERS_PASS): Step(_S.PASSED_THROUGH, (_A.PASS,)),
    (_S.AWAITING_HEADERS, _K.HEADERS_FAILED): Step(_S.FAILED, (_A.FAIL,)),
    **_lost_while_live(_S.AWAITING_HEADERS, _R.CONNECTION_LOST, _CONNECTION_LOST_DETAIL),
    (_S.AWAITING_HEADERS, _K.NEVER_SENT): Step(
        _S.NEVER_SENT,
        (_A.UNSENT, _A.SETTLE),
        _R.NOT_SENT,
        "its connection closed before the request was sent: no replica saw it",
    ),
    # 2xx headers and every chunk held.
    (_S.HOLDING, _K.BODY_HELD): Step(_S.HOLDING),
    (_S.HOLDING, _K.BODY_FIRST_DELTA): Step(_S.WRITING_AHEAD, (_A.WRITE_AHEAD,)),
    (_S.HOLDING, _K.BODY_COMPLETE): Step(_S.WRITING_AHEAD, (_A.WRITE_AHEAD,)),
    (_S.HOLDING, _K.BODY_FAILED): Step(_S.FAILED, (_A.FAIL,)),
    **_lost_while_live(_S.HOLDING, _R.CONNECTION_LOST, _CONNECTION_LOST_DETAIL),
    # First delta found: first_delta_sent is being made durable; later chunks are released with the rest.
    (_S.WRITING_AHEAD, _K.CHUNK): Step(_S.WRITING_AHEAD),
    (_S.WRITING_AHEAD, _K.WRITE_AHEAD_DONE): Step(_S.RELEASED, (_A.RELEASE,)),
    # Its lease was not honoured any more when the write came back: never released, fenced instead.
    (_S.WRITING_AHEAD, _K.WRITE_AHEAD_DONE_LEASE_LOST): Step(_S.FENCING, (_A.FENCE,), cause="lease_lost"),
    **_lost_while_live(_S.WRITING_AHEAD, _R.LOST_BEFORE_RELEASE, "replica reset before the release"),
    # Released: the downstream owns the rest of the stream (it ends the client stream, watches the replica).
    **_stay(_S.RELEASED, _K.CHUNK, _K.RESET, _K.RESET_UNCERTAIN, _K.LIVENESS_LOST),
    # ... unless Envoy retried after all: the release never reached its router (a reset came first).
    (_S.RELEASED, _K.SUPERSEDED): Step(
        _S.FAILED, (_A.FAIL, _A.SETTLE), _R.LOST_BEFORE_RELEASE, _SUPERSEDED_DETAIL
    ),
    (_S.RELEASED, _K.SUPERSEDED_UNCERTAIN): Step(_S.FENCING, (_A.FENCE,), cause=_UNCERTAIN),
    # Not a replica failure (3xx): released unchanged; nothing here concerns it any more.
    **_stay(_S.PASSED_THROUGH, _K.CHUNK, *_GONE, _K.LIVENESS_LOST),
    # Liveness uncertain: waiting for the proof that it stopped; nothing is decided before it. Headers that
    # come meanwhile (e.g. the replica side's own 503 once it stopped) are what the verdict will answer.
    **_stay(_S.FENCING, *_HEADERS, _K.CHUNK, *_GONE, _K.LIVENESS_LOST),
    **_stay(_S.FENCING, _K.WRITE_AHEAD_DONE, _K.WRITE_AHEAD_DONE_LEASE_LOST),  # too late: not released
    (_S.FENCING, _K.FENCE_PROVEN): Step(_S.FAILED, (_A.FENCED,)),
    (_S.FENCING, _K.FENCE_UNPROVABLE): Step(_S.FAILED, (_A.FENCED,)),
    # Failed before release, verdict not known yet: its bytes are never released.
    **_stay(_S.FAILED, *_HEADERS, _K.CHUNK, _K.LIVENESS_LOST),
    (_S.FAILED, _K.FENCE_PROVEN): Step(_S.FAILED, (_A.PROVEN,)),
    **_stay(_S.FAILED, _K.WRITE_AHEAD_DONE, _K.WRITE_AHEAD_DONE_LEASE_LOST),  # reset during the write
    **{(_S.FAILED, kind): Step(_S.FAILED, (_A.SETTLE,)) for kind in _GONE},  # the closed connection fences it
    (_S.FAILED, _K.VERDICT): Step(_S.DECIDED, (_A.DECIDE,)),
    # The verdict is known: it is written once the held headers are there (REPLY_TRANSITIONS).
    **_stay(_S.DECIDED, *_HEADERS, _K.CHUNK, _K.LIVENESS_LOST),
    (_S.DECIDED, _K.FENCE_PROVEN): Step(_S.DECIDED, (_A.PROVEN,)),
    **_stay(_S.DECIDED, _K.WRITE_AHEAD_DONE, _K.WRITE_AHEAD_DONE_LEASE_LOST),
    **{(_S.DECIDED, kind): Step(_S.DECIDED, (_A.SETTLE,)) for kind in _GONE},
    # Never sent: nothing of it exists beyond Envoy; only its lease, if it had one, is settled.
    (_S.NEVER_SENT, _K.FENCE_PROVEN): Step(_S.NEVER_SENT, (_A.PROVEN,)),
}


class ReplyEvent(enum.Enum):
    HEADERS = "response headers"
    STREAM_GONE = "stream gone"
    WRITE = "we reply"  # an answer or a release


# What Envoy waits for: the response headers make a reply owed; ours (answer, release) or the stream's
# end settle it. A pair not here cannot happen (IllegalInput).
REPLY_TRANSITIONS: dict[tuple[Reply, ReplyEvent], Reply] = {
    (Reply.NOTHING_YET, ReplyEvent.HEADERS): Reply.HEADERS_HELD,
    (Reply.NOTHING_YET, ReplyEvent.STREAM_GONE): Reply.STREAM_GONE,
    (Reply.HEADERS_HELD, ReplyEvent.WRITE): Reply.REPLIED,
    (Reply.HEADERS_HELD, ReplyEvent.STREAM_GONE): Reply.STREAM_GONE,
    (Reply.REPLIED, ReplyEvent.STREAM_GONE): Reply.REPLIED,  # we had left the path already
    (Reply.STREAM_GONE, ReplyEvent.STREAM_GONE): Reply.STREAM_GONE,
    # Superseded while a message of the stream was still on its way: nothing can be answered any more.
    (Reply.STREAM_GONE, ReplyEvent.HEADERS): Reply.STREAM_GONE,
}


class LeaseEvent(enum.Enum):
    SETTLE = "settle"  # the connection is closed: revoke, the closed connection is the proof
    FENCE = "fence"  # liveness uncertain: revoke and wait for a proof
    PROVEN = "proven"
    UNPROVABLE = "unprovable"


# The lease: settled or fenced once (a second request to do either is moot), proven once.
LEASE_TRANSITIONS: dict[tuple[LeaseState, LeaseEvent], LeaseState] = {
    (LeaseState.HELD, LeaseEvent.SETTLE): LeaseState.SETTLING,
    (LeaseState.HELD, LeaseEvent.FENCE): LeaseState.FENCING,
    **{(s, LeaseEvent.SETTLE): s for s in LeaseState if s is not LeaseState.HELD},
    **{(s, LeaseEvent.FENCE): s for s in LeaseState if s is not LeaseState.HELD},
    (LeaseState.SETTLING, LeaseEvent.PROVEN): LeaseState.FENCED,
    (LeaseState.FENCING, LeaseEvent.PROVEN): LeaseState.FENCED,
    (LeaseState.FENCED, LeaseEvent.PROVEN): LeaseState.FENCED,
    (LeaseState.FENCING, LeaseEvent.UNPROVABLE): LeaseState.UNPROVABLE,
}


class Attempt:
    """One attempt. `handle(input)` returns the decisions to carry out, in order."""

    def __init__(
        self,
        *,
        attempt_id: str,
        number: int,
        replica: str,
        outbox: list[Event],
        max_held_bytes: int,
        max_event_bytes: int,
        classify: Classifier = classify_openai,
        leased: bool = True,
        chosen_by: str | None = None,
    ) -> None:
        self.attempt_id = attempt_id
        self.number = number
        self.replica = replica
        self.chosen_by = chosen_by  # why it went to its replica (the request's destinations), journal only
        self.state = AttemptState.AWAITING_HEADERS
        self.reply = Reply.NOTHING_YET
        # An attempt that never had a lease (its stream went before it got one) cannot publish: fenced.
        self.lease_state = LeaseState.HELD if leased else LeaseState.FENCED
        self.failure: FailureReason | None = None
        self.detail: str | None = None
        self.status: int | None = None
        self.releases_content = False  # what it writes ahead for: content, or a generation without any
        self.fence: dict[str, Any] | None = None  # how it was fenced, when a fence was needed
        self.verdict: TriggerRetry | FailRequest | None = None
        self.lease: Any = None  # the shell's lease handle (journal view only; no decision reads it)
        self.held_chunks = 0  # body chunks Envoy sent that wait for our reply
        self.reader = AttemptReader(
            max_held_bytes=max_held_bytes, max_event_bytes=max_event_bytes, classify=classify
        )
        self._outbox = outbox

    # --- derived facts ---------------------------------------------------------------------------------

    @property
    def first_delta(self) -> bool:
        """Content is among what this attempt released (or is releasing)."""
        return self.releases_content and self.state in (AttemptState.WRITING_AHEAD, AttemptState.RELEASED)

    @property
    def fenced(self) -> bool:
        """Proven unable to publish: another attempt may start."""
        return self.lease_state is LeaseState.FENCED

    @property
    def retry_after(self) -> str | None:
        return self.reader.retry_after

    # --- the one verb ----------------------------------------------------------------------------------

    def handle(self, event: Input) -> list[Decision]:
        reading = self._read(event)
        step = TRANSITIONS.get((self.state, reading.kind))
        if step is None:
            raise IllegalInput(
                f"attempt {self.attempt_id}: {type(event).__name__} ({reading.kind.value}) "
                f"in state {self.state.value}"
            )
        reply_event = _REPLY_EVENTS.get(type(event))
        if reply_event is not None:
            self._reply(reply_event)  # first: an input the stream cannot carry changes nothing
        if isinstance(event, ResponseHeaders):
            self.status = event.status
        elif isinstance(event, ResponseBody) and self.reply is not Reply.REPLIED:
            self.held_chunks += 1  # Envoy holds it until our reply lets it go
        decisions: list[Decision] = []
        self.state = step.next
        for action in step.actions:
            decisions += self._act(action, step, reading, event)
        if self.state is AttemptState.DECIDED and self.reply is Reply.HEADERS_HELD:
            decisions += self._answer()
        return decisions

    # --- reading inputs ----------------------------------------------------------------------------------

    def _read(self, event: Input) -> Reading:
        if isinstance(event, ResponseHeaders):
            if self.state is AttemptState.AWAITING_HEADERS:
                return self.reader.headers(event)
            return Reading(Kind.HEADERS_OK if event.status < 300 else Kind.HEADERS_FAILED)
        if isinstance(event, ResponseBody):
            return self.reader.body(event) if self.state is AttemptState.HOLDING else _CHUNK
        if isinstance(event, StreamReset):
            return Reading(Kind.RESET_UNCERTAIN if event.liveness_uncertain else Kind.RESET)
        if isinstance(event, Superseded):
            return Reading(Kind.SUPERSEDED_UNCERTAIN if event.liveness_uncertain else Kind.SUPERSEDED)
        if isinstance(event, WriteAheadDone):
            return Reading(
                Kind.WRITE_AHEAD_DONE if event.lease_publishable else Kind.WRITE_AHEAD_DONE_LEASE_LOST
            )
        return Reading(_KINDS[type(event)])

    # --- actions -----------------------------------------------------------------------------------------

    def _act(self, action: Action, step: Step, reading: Reading, event: Input) -> list[Decision]:
        if action is Action.HOLD:
            self._emit(EventName.HEADERS_HELD, status=self.status)
            return []
        if action is Action.PASS:
            self._emit(EventName.RESPONSE_PASSED_THROUGH, status=self.status)
            self._reply(ReplyEvent.WRITE)
            return [Release(self.held_chunks)]
        if action is Action.FAIL:
            reason = step.reason or reading.reason
            assert reason is not None
            self.failure = reason
            self.detail = step.detail or reading.detail
            self._emit(EventName.ATTEMPT_FAILED, reason=reason.value, detail=self.detail)
            return [Failed(reason)]
        if action is Action.FENCE:
            cause = step.cause or (event.cause if isinstance(event, LivenessLost) else _UNCERTAIN)
            self.failure = FENCE_CAUSES[cause]
            self.detail = f"liveness uncertain ({cause.replace('_', ' ')}): fenced before anything else"
            self._emit(EventName.REPLICA_LOST, replica=self.replica, cause=cause)
            return [StartFence()] if self._lease(LeaseEvent.FENCE) else []
        if action is Action.FENCED:
            proven = isinstance(event, FenceProven)
            proof = event.proof if isinstance(event, FenceProven) else None
            waited_ms = event.waited_ms if isinstance(event, FenceProven) else 0.0
            self._lease(LeaseEvent.PROVEN if proven else LeaseEvent.UNPROVABLE)
            self.fence = {"proof": proof, "waited_ms": round(waited_ms, 1)}
            self._emit(EventName.ATTEMPT_FENCED, attempt_id=self.attempt_id, proof=proof, waited_ms=waited_ms)
            assert self.failure is not None
            self._emit(EventName.ATTEMPT_FAILED, reason=self.failure.value, detail=self.detail or "")
            return [Failed(self.failure, fence_proven=proven)]
        if action is Action.SETTLE:
            return [SettleLease(CONNECTION_CLOSED)] if self._lease(LeaseEvent.SETTLE) else []
        if action is Action.WRITE_AHEAD:
            self.releases_content = reading.kind is Kind.BODY_FIRST_DELTA
            if self.releases_content:
                self._emit(EventName.FIRST_DELTA_SENT, attempt_id=self.attempt_id)
            return [WriteAhead()]
        if action is Action.RELEASE:
            self._reply(ReplyEvent.WRITE)
            return [Release(self.held_chunks)]
        if action is Action.PROVEN:
            self._lease(LeaseEvent.PROVEN)
            return []
        if action is Action.UNSENT:
            self.failure, self.detail = step.reason, step.detail
            assert self.failure is not None
            self._emit(EventName.ATTEMPT_FAILED, reason=self.failure.value, detail=self.detail)
            return []
        assert action is Action.DECIDE and isinstance(event, VerdictReady)
        self.verdict = event.verdict
        return []

    def _answer(self) -> list[Decision]:
        # The answer is a reply to the held response headers: it waits for them, and is lost with the stream.
        # Answering ends this attempt's upstream request: its closed connection fences it. The lease stops
        # being honoured first: once the answer is written, Envoy may cancel this stream at any moment.
        assert self.verdict is not None
        self._reply(ReplyEvent.WRITE)
        held = self.held_chunks if isinstance(self.verdict, TriggerRetry) else 0
        settle = [SettleLease(CONNECTION_CLOSED)] if self._lease(LeaseEvent.SETTLE) else []
        return [*settle, Answer(self.verdict, held)]

    def _reply(self, event: ReplyEvent) -> None:
        after = REPLY_TRANSITIONS.get((self.reply, event))
        if after is None:
            raise IllegalInput(f"attempt {self.attempt_id}: {event.value} with reply {self.reply.value}")
        self.reply = after

    def _lease(self, event: LeaseEvent) -> bool:
        """Move the lease's machine; True when it left HELD now (the revocation is to be carried out)."""
        after = LEASE_TRANSITIONS.get((self.lease_state, event))
        if after is None:
            raise IllegalInput(
                f"attempt {self.attempt_id}: lease {event.value} while {self.lease_state.value}"
            )
        started = self.lease_state is LeaseState.HELD and after is not LeaseState.HELD
        self.lease_state = after
        return started

    def _emit(self, name: EventName, **detail: Any) -> None:
        self._outbox.append(Event(name, self.number, detail))


_KINDS: dict[type, Kind] = {
    NeverSent: Kind.NEVER_SENT,
    LivenessLost: Kind.LIVENESS_LOST,
    FenceProven: Kind.FENCE_PROVEN,
    FenceUnprovable: Kind.FENCE_UNPROVABLE,
    VerdictReady: Kind.VERDICT,
}

_REPLY_EVENTS: dict[type, ReplyEvent] = {
    ResponseHeaders: ReplyEvent.HEADERS,
    StreamReset: ReplyEvent.STREAM_GONE,
    NeverSent: ReplyEvent.STREAM_GONE,
    Superseded: ReplyEvent.STREAM_GONE,
}
