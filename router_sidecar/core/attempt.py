"""The attempt machine: one try of a logical request on one replica, its whole life in one place.

Sans-IO, in the manner of h11's `_state.py`: everything that affects an attempt's state lives in this
file, and the file knows nothing about gRPC, etcd or clocks. The upstream servicer translates Envoy's
messages and the monitors' signals into the inputs below, feeds them to `Attempt.handle`, and carries out
the decisions it gets back. Transitions are data (`TRANSITIONS`): a state × input pair that is not in the
table is a bug in the caller, and raises.

    AWAITING_HEADERS ──2xx──▶ HOLDING ──first delta──▶ WRITING_AHEAD ──durable──▶ RELEASED
         │   │                  │  │                        │
         │   ├──stream gone before its request was let go──▶ FAILED (NOT_SENT: not one of max_attempts)
         │   └──4xx──▶ PASSED_THROUGH                        └──reset──▶ FAILED
         │                      │  └──5xx, 429, error event, abort, too large, no [DONE], reset──▶ FAILED
         └───heartbeat lapsed, progress gap, lease lost (either state)──▶ FENCING ──proof──▶ FAILED

Headers are held until the first content delta, because while they are held a failure is invisible to the
client and Envoy can still retry (DESIGN.md §5.3). A failed attempt's fate — retry elsewhere or one error
for the client — is the logical request's `RetryGate` verdict, answered in reply to the held headers
(deferred until they arrive when the failure came first). Before another attempt may start, this one must
be fenced: its lease settled on a closed connection, or revoked and proven by a cancel ack or its expiry.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from router_sidecar.core.events import Event, EventName, Outcome
from router_sidecar.core.policy import FAIL, Policy
from router_sidecar.core.sse import AbortScan, EventKind, SseScanner

# --- states, causes ----------------------------------------------------------------------------------


class AttemptState(enum.Enum):
    AWAITING_HEADERS = "awaiting_headers"  # sent to its replica, no response headers yet
    HOLDING = "holding"  # 2xx headers and every chunk held: a failure is still invisible to the client
    FENCING = "fencing"  # liveness uncertain: its lease is revoked, waiting for the proof it stopped
    WRITING_AHEAD = "writing_ahead"  # first delta found: first_delta_sent is being made durable
    RELEASED = "released"  # headers and held chunks released; the downstream owns the rest
    PASSED_THROUGH = "passed_through"  # not a replica failure (e.g. 4xx): released unchanged
    FAILED = "failed"  # failed before release; the request's verdict is (or will be) its answer


LIVE_STATES = frozenset({AttemptState.AWAITING_HEADERS, AttemptState.HOLDING})


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


_FENCE_CAUSES = {
    "heartbeat_lapsed": FailureReason.REPLICA_LOST,
    "health_check_failed": FailureReason.REPLICA_LOST,  # a static replica stopped answering /health
    "progress_gap": FailureReason.PATH_LOST,
    "lease_lost": FailureReason.LEASE_LOST,
    # Its connection closed, but it showed a sign of running on: as uncertain as a lapsed heartbeat.
    "connection_closed_uncertain": FailureReason.REPLICA_LOST,
}

# --- inputs (named by cause) -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ResponseHeaders:
    status: int
    content_type: str = ""
    content_encoding: str = ""
    retry_after: str | None = None


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
    """`first_delta_sent` is durable (or etcd failed and the gateway serves anyway, logging it)."""


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

# --- verdicts of the retry gate ----------------------------------------------------------------------


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


# --- decisions (what the shell carries out) ----------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Failed:
    """The attempt failed: ask the request's `RetryGate` for the verdict, then feed `VerdictReady`."""

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


def is_event_stream(content_type: str) -> bool:
    # Media types are case-insensitive (RFC 9110 §8.3.1).
    return content_type[:17].lower() == "text/event-stream"


class IllegalInput(RuntimeError):
    """An input that cannot happen in this state: a bug in the caller, never a replica's doing."""


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
    ) -> None:
        self.attempt_id = attempt_id
        self.number = number
        self.replica = replica
        self.state = AttemptState.AWAITING_HEADERS
        self.failure: FailureReason | None = None
        self.detail: str | None = None
        self.status: int | None = None
        self.retry_after: str | None = None  # a 429's Retry-After, passed on if no other replica serves it
        self.first_delta = False  # content is among what this attempt released (or is releasing)
        self.fenced = False  # proven unable to publish: another attempt may start
        self.fence: dict[str, Any] | None = None  # how it was fenced, when a fence was needed
        self.verdict: TriggerRetry | FailRequest | None = None
        self.lease: Any = None  # the shell's lease handle (journal view only; no decision reads it)
        self._outbox = outbox
        self._max_held_bytes = max_held_bytes
        self._streaming = False
        self._scanner = SseScanner(max_event_bytes=max_event_bytes)
        self._abort_scan = AbortScan()  # non-stream answers only
        self._finished = False  # a finish_reason that means "generation complete" was seen
        self._held_bytes = 0
        self._held_chunks = 0
        self._headers_arrived = False
        self._stream_open = True  # Envoy still waits for our answer on this attempt's stream
        self._answered = False
        self._settling = False  # its lease is being released on a closed connection

    def handle(self, event: Input) -> list[Decision]:
        handler = TRANSITIONS.get((self.state, type(event)))
        if handler is None:
            raise IllegalInput(
                f"attempt {self.attempt_id}: {type(event).__name__} in state {self.state.value}"
            )
        return handler(self, event)

    # --- transitions ---------------------------------------------------------------------------------

    def _headers(self, e: ResponseHeaders) -> list[Decision]:
        self.status, self._headers_arrived = e.status, True
        if e.status == 429:
            # Seconds or an HTTP-date (29 characters): anything longer is not a Retry-After, and it would be
            # copied into the journal record and the client's answer.
            retry_after = e.retry_after if e.retry_after is None or len(e.retry_after) <= 64 else None
            self.retry_after = retry_after
            return self._fail(FailureReason.OVERLOADED, f"replica answered 429 (Retry-After {retry_after})")
        if e.status >= 500:
            return self._fail(FailureReason.UPSTREAM_STATUS, f"replica answered {e.status}")
        if e.status >= 300:
            self.state = AttemptState.PASSED_THROUGH
            self._emit(EventName.RESPONSE_PASSED_THROUGH, status=e.status)
            return [Release(self._held_chunks)]
        if e.content_encoding.lower() not in ("", "identity"):
            return self._fail(FailureReason.CONTENT_ENCODED, f"content-encoding {e.content_encoding!r}")
        self._streaming = is_event_stream(e.content_type)
        self.state = AttemptState.HOLDING
        self._emit(EventName.HEADERS_HELD, status=e.status)
        return []

    def _body(self, e: ResponseBody) -> list[Decision]:
        self._held_chunks += 1
        self._held_bytes += len(e.chunk)
        if not self._streaming:
            # A non-stream answer is its content: released whole at its end, or, past the bound, released
            # as it comes (Envoy must not hold a large body for us) — then a later cut is a reset.
            self._abort_scan.feed(e.chunk)
            if self._abort_scan.aborted:
                return self._fail(FailureReason.ABORTED, "finish_reason abort in a non-stream answer")
            if e.end_of_stream or self._held_bytes > self._max_held_bytes:
                return self._write_ahead(first_delta=True)
            return []
        events = self._scanner.feed(e.chunk)
        if e.end_of_stream:
            events += self._scanner.close()
        for event in events:
            if event.kind is EventKind.ERROR:
                return self._fail(FailureReason.ERROR_EVENT, "in-band error event before any content")
            if event.kind is EventKind.MALFORMED:
                # Held, so the client saw none of it: a broken replica, retried like an in-band error.
                return self._fail(FailureReason.MALFORMED_EVENT, "an event that is not a JSON object")
            if event.finish_reason == "abort":
                return self._fail(FailureReason.ABORTED, "finish_reason abort before any content")
            if event.kind is EventKind.CONTENT:
                return self._write_ahead(first_delta=True)
            if event.finish_reason in COMPLETE_FINISH_REASONS:
                self._finished = True
            elif event.kind is EventKind.DONE:
                # A complete generation without content (e.g. EOS as the first token): nothing to retry.
                return self._write_ahead(first_delta=False)
        if self._scanner.oversized:
            return self._fail(FailureReason.EVENT_TOO_LARGE, "an SSE event over limits.max_event_bytes")
        if self._held_bytes > self._max_held_bytes:
            return self._fail(
                FailureReason.RESPONSE_TOO_LARGE,
                f"{self._held_bytes} bytes before any content (limits.max_held_response_bytes)",
            )
        if e.end_of_stream:
            if self._finished:
                return self._write_ahead(first_delta=False)
            return self._fail(FailureReason.ENDED_WITHOUT_DONE, "response ended without content or [DONE]")
        return []

    def _reset_live(self, e: StreamReset) -> list[Decision]:
        self._stream_open = False
        if e.liveness_uncertain:
            return self._start_fence("connection_closed_uncertain")
        decisions = self._fail(FailureReason.CONNECTION_LOST, "connection to the replica was lost")
        return [*decisions, *self._settle()]

    def _never_sent(self, e: NeverSent) -> list[Decision]:
        # Journaled once Envoy's next move confirmed it (RetryGate.confirm_never_sent): there is no stream to
        # answer and no lease to settle, and Envoy retries it by itself.
        self._stream_open = False
        self._fail(
            FailureReason.NOT_SENT, "its connection closed before the request was sent: no replica saw it"
        )
        self.fenced = True  # its request never left Envoy: nothing of it can ever be published
        return []

    def _liveness_lost(self, e: LivenessLost) -> list[Decision]:
        return self._start_fence(e.cause)

    def _stream_gone(self, e: StreamReset | Superseded) -> list[Decision]:
        self._stream_open = False  # nothing can be answered on this stream any more
        return self._settle() if self.state is AttemptState.FAILED else []

    def _headers_while_fencing(self, e: ResponseHeaders) -> list[Decision]:
        # The answer waits for the fence; these headers (e.g. the replica side's own 503 once it stopped)
        # are what it will answer.
        self.status, self._headers_arrived = e.status, True
        return []

    def _drop(self, e: ResponseBody) -> list[Decision]:
        # A fenced or failed attempt's bytes are never released, but Envoy holds each chunk until it is
        # answered: a retry's answer must let them all go, or Envoy never retries (nor answers the client).
        self._held_chunks += 1
        return []

    def _fence_proven(self, e: FenceProven) -> list[Decision]:
        self.fenced = True
        if self.state is not AttemptState.FENCING:
            return []  # a closed connection's lease settled: the proof needed no waiting
        self.fence = {"proof": e.proof, "waited_ms": round(e.waited_ms, 1)}
        self._emit(EventName.ATTEMPT_FENCED, attempt_id=self.attempt_id, proof=e.proof, waited_ms=e.waited_ms)
        assert self.failure is not None
        return self._fail(self.failure, self.detail or "", from_fence=True)

    def _fence_unprovable(self, e: FenceUnprovable) -> list[Decision]:
        self.fence = {"proof": None, "waited_ms": 0.0}
        self._emit(EventName.ATTEMPT_FENCED, attempt_id=self.attempt_id, proof=None, waited_ms=0.0)
        assert self.failure is not None
        return self._fail(self.failure, self.detail or "", from_fence=True, fence_proven=False)

    def _hold_more(self, e: ResponseBody) -> list[Decision]:
        self._held_chunks += 1  # released with the rest
        return []

    def _write_ahead_done(self, e: WriteAheadDone) -> list[Decision]:
        self.state = AttemptState.RELEASED
        return [Release(self._held_chunks)]

    def _reset_writing_ahead(self, e: StreamReset) -> list[Decision]:
        self._stream_open = False
        if e.liveness_uncertain:
            return self._start_fence("connection_closed_uncertain")
        decisions = self._fail(FailureReason.LOST_BEFORE_RELEASE, "replica reset before the release")
        return [*decisions, *self._settle()]

    def _superseded(self, e: Superseded) -> list[Decision]:
        # Envoy retried on its own: whatever we released never reached its router (a reset came first).
        self._stream_open = False
        if e.liveness_uncertain:
            return self._start_fence("connection_closed_uncertain")
        decisions = self._fail(
            FailureReason.LOST_BEFORE_RELEASE
            if self.state in (AttemptState.RELEASED, AttemptState.WRITING_AHEAD)
            else FailureReason.CONNECTION_LOST,
            "Envoy started the next attempt: this one's connection was lost",
        )
        return [*decisions, *self._settle()]

    def _verdict(self, e: VerdictReady) -> list[Decision]:
        self.verdict = e.verdict
        return self._answer_if_possible()

    def _headers_after_failure(self, e: ResponseHeaders) -> list[Decision]:
        self.status, self._headers_arrived = e.status, True
        return self._answer_if_possible()

    def _ignore(self, e: Input) -> list[Decision]:
        return []

    # --- helpers -------------------------------------------------------------------------------------

    def _fail(
        self, reason: FailureReason, detail: str, *, from_fence: bool = False, fence_proven: bool = True
    ) -> list[Decision]:
        if not from_fence:
            self.failure, self.detail = reason, detail
        self.state = AttemptState.FAILED
        self.first_delta = False
        self._emit(EventName.ATTEMPT_FAILED, reason=reason.value, detail=detail)
        return [Failed(reason, fence_proven=fence_proven)]

    def _start_fence(self, cause: str) -> list[Decision]:
        self.failure = _FENCE_CAUSES[cause]
        self.detail = f"liveness uncertain ({cause.replace('_', ' ')}): fenced before anything else"
        self.state = AttemptState.FENCING
        self.first_delta = False  # nothing of a fenced attempt is (or was) released to the client
        self._emit(EventName.REPLICA_LOST, replica=self.replica, cause=cause)
        return [StartFence()]

    def _write_ahead(self, *, first_delta: bool) -> list[Decision]:
        self.first_delta = first_delta
        self.state = AttemptState.WRITING_AHEAD
        if first_delta:
            self._emit(EventName.FIRST_DELTA_SENT, attempt_id=self.attempt_id)
        return [WriteAhead()]

    def _answer_if_possible(self) -> list[Decision]:
        # The answer is a reply to the held response headers: it waits for them, and is lost with the stream.
        if self.verdict is None or self._answered or not self._headers_arrived or not self._stream_open:
            return []
        self._answered = True
        held = self._held_chunks if isinstance(self.verdict, TriggerRetry) else 0
        # Answering ends this attempt's upstream request: its closed connection fences it. The lease stops
        # being honoured first: once the answer is written, Envoy may cancel this stream at any moment.
        return [*self._settle(), Answer(self.verdict, held)]

    def _settle(self) -> list[Decision]:
        if self.fenced or self._settling or self.fence is not None or self.state is AttemptState.FENCING:
            return []
        self._settling = True
        return [SettleLease("connection_closed")]

    def _emit(self, name: EventName, **detail: Any) -> None:
        self._outbox.append(Event(name, self.number, detail))


_S = AttemptState
_Handler = Any  # Callable[[Attempt, Input], list[Decision]]

# The whole lifecycle: state × input → handler (which sets the next state and returns the decisions).
TRANSITIONS: dict[tuple[AttemptState, type], _Handler] = {
    (_S.AWAITING_HEADERS, ResponseHeaders): Attempt._headers,
    (_S.AWAITING_HEADERS, StreamReset): Attempt._reset_live,
    (_S.AWAITING_HEADERS, NeverSent): Attempt._never_sent,
    (_S.AWAITING_HEADERS, LivenessLost): Attempt._liveness_lost,
    (_S.AWAITING_HEADERS, Superseded): Attempt._superseded,
    (_S.HOLDING, ResponseBody): Attempt._body,
    (_S.HOLDING, StreamReset): Attempt._reset_live,
    (_S.HOLDING, LivenessLost): Attempt._liveness_lost,
    (_S.HOLDING, Superseded): Attempt._superseded,
    (_S.FENCING, ResponseHeaders): Attempt._headers_while_fencing,
    (_S.FENCING, ResponseBody): Attempt._drop,
    (_S.FENCING, StreamReset): Attempt._stream_gone,
    (_S.FENCING, LivenessLost): Attempt._ignore,
    (_S.FENCING, FenceProven): Attempt._fence_proven,
    (_S.FENCING, FenceUnprovable): Attempt._fence_unprovable,
    (_S.FENCING, Superseded): Attempt._stream_gone,
    (_S.WRITING_AHEAD, ResponseBody): Attempt._hold_more,
    (_S.WRITING_AHEAD, WriteAheadDone): Attempt._write_ahead_done,
    (_S.WRITING_AHEAD, StreamReset): Attempt._reset_writing_ahead,
    (_S.WRITING_AHEAD, Superseded): Attempt._superseded,
    (_S.WRITING_AHEAD, LivenessLost): Attempt._liveness_lost,  # not released yet: fence instead
    (_S.RELEASED, ResponseBody): Attempt._ignore,
    (_S.RELEASED, StreamReset): Attempt._ignore,
    (_S.RELEASED, LivenessLost): Attempt._ignore,
    (_S.RELEASED, Superseded): Attempt._superseded,
    (_S.PASSED_THROUGH, ResponseBody): Attempt._ignore,
    (_S.PASSED_THROUGH, StreamReset): Attempt._ignore,
    (_S.PASSED_THROUGH, LivenessLost): Attempt._ignore,
    (_S.PASSED_THROUGH, Superseded): Attempt._ignore,
    (_S.FAILED, ResponseHeaders): Attempt._headers_after_failure,
    (_S.FAILED, ResponseBody): Attempt._drop,
    (_S.FAILED, StreamReset): Attempt._stream_gone,
    (_S.FAILED, LivenessLost): Attempt._ignore,
    (_S.FAILED, FenceProven): Attempt._fence_proven,  # the closed connection's lease settled
    (_S.FAILED, Superseded): Attempt._stream_gone,
    (_S.FAILED, VerdictReady): Attempt._verdict,
}


# --- the logical request's retry gate ----------------------------------------------------------------

_UNCERTAIN = frozenset({FailureReason.REPLICA_LOST, FailureReason.PATH_LOST, FailureReason.LEASE_LOST})


@dataclass(frozen=True, slots=True)
class Admit:
    """Let the new attempt through to its replica (call `RetryGate.begin`)."""


@dataclass(frozen=True, slots=True)
class Supersede:
    """Envoy started a new attempt before this one's end reached us: feed it `Superseded`, ask again."""

    attempt: Attempt


@dataclass(frozen=True, slots=True)
class AwaitFence:
    """The previous attempt may still publish: wait until it is fenced, then ask again."""

    attempt: Attempt


@dataclass(frozen=True, slots=True)
class Refuse:
    """No further attempt: answer the new attempt's stream with this error."""

    verdict: FailRequest


Admission = Admit | Supersede | AwaitFence | Refuse


class RetryGate:
    """The attempts of one logical request and the one place that decides whether another may follow.

    Before the first delta only (after it, no attempt ever fails into a retry). A retry needs: budget left
    (`before_first_delta.max_attempts`, counting the attempts a replica may have seen: one that died at its
    connection before its request was sent is listed, not counted), retries not blocked (cost cap, no
    journal), the previous attempt fenced (`source_attempt_fenced`), a compatible replica to land on, and
    for an attempt whose liveness was uncertain the policy's `uncertain_source_liveness.then`. A refusal is
    final: `on_final` ends the logical request with it, and every later attempt Envoy may start is refused
    with the same answer.
    """

    def __init__(self, policy: Policy, outbox: list[Event], on_final: Callable[[FailRequest], None]) -> None:
        self.attempts: list[Attempt] = []
        self.retry_blocked: str | None = None  # why no retry may ever start (None: within the budget)
        self.final: FailRequest | None = None
        # Attempts Envoy started whose stream ended before their request was let go: (attempt_id, replica).
        self._never_sent: list[tuple[str, str]] = []
        self._policy = policy
        self._outbox = outbox
        self._on_final = on_final

    @property
    def max_attempts(self) -> int:
        return self._policy.before_first_delta.max_attempts if self.retry_blocked is None else 1

    @property
    def counted(self) -> int:
        """The attempts that count against max_attempts: those a replica may have seen (all but NOT_SENT)."""
        return sum(1 for a in self.attempts if a.failure is not FailureReason.NOT_SENT)

    @property
    def retries_left(self) -> int:
        return 0 if self.final is not None else max(0, self.max_attempts - self.counted)

    def note_never_sent(self, attempt_id: str, replica: str) -> None:
        """An attempt's stream ended before its request was let go. Its connection died (a pooled connection
        the replica had closed, a refused connect) if Envoy then starts another attempt or answers the client
        itself (`confirm_never_sent`); if the client left instead, nothing is journaled."""
        self._never_sent.append((attempt_id, replica))

    def unseen_before(self, envoy_attempt: int) -> int:
        """How many attempts before Envoy's attempt number `envoy_attempt` the gateway never saw: their
        streams ended before their first message was read (each died at its connection). Note each."""
        return max(0, envoy_attempt - 1 - len(self.attempts) - len(self._never_sent))

    def confirm_never_sent(self) -> None:
        """Envoy moved on (a new attempt, or its own answer): the noted attempts are journaled, uncounted."""
        pending, self._never_sent = self._never_sent, []
        for attempt_id, replica in pending:
            self.begin(attempt_id, replica).handle(NeverSent())

    def block(self, reason: str) -> None:
        self.retry_blocked = self.retry_blocked or reason

    def admit(self) -> Admission:
        if self.final is not None:
            return Refuse(self.final)
        self.confirm_never_sent()
        # The last attempt a replica may have seen (one that never left Envoy may have come after it).
        previous = next((a for a in reversed(self.attempts) if a.failure is not FailureReason.NOT_SENT), None)
        if previous is not None and previous.state in (
            *LIVE_STATES,
            AttemptState.WRITING_AHEAD,
            AttemptState.RELEASED,
        ):
            return Supersede(previous)
        # The last attempt a replica saw may sit behind one that never left Envoy: it is fenced all the same.
        for earlier in reversed(self.attempts):
            if not earlier.fenced and earlier.state is not AttemptState.PASSED_THROUGH:
                return AwaitFence(earlier)
        if self.counted >= self.max_attempts:
            return Refuse(self.finish(self._exhausted(previous)))
        return Admit()

    def begin(self, attempt_id: str, replica: str) -> Attempt:
        limits = self._policy.limits
        attempt = Attempt(
            attempt_id=attempt_id,
            number=len(self.attempts) + 1,
            replica=replica,
            outbox=self._outbox,
            max_held_bytes=limits.max_held_response_bytes,
            max_event_bytes=limits.max_event_bytes,
        )
        self.attempts.append(attempt)
        self._outbox.append(
            Event(EventName.ATTEMPT_STARTED, attempt.number, {"attempt_id": attempt_id, "replica": replica})
        )
        return attempt

    def fence_timed_out(self, attempt: Attempt) -> FailRequest:
        return self.finish(
            FailRequest(
                503,
                Outcome.FENCE_UNPROVABLE,
                f"attempt {attempt.number} was never proven fenced, so no other attempt may start",
            )
        )

    def verdict(
        self, attempt: Attempt, failed: Failed, *, no_compatible_replica: str | None
    ) -> TriggerRetry | FailRequest:
        """The fate of a failed attempt: another attempt, or one error for the client."""
        if self.final is not None:
            return self.final
        if not failed.fence_proven:
            return self.finish(
                FailRequest(
                    503,
                    Outcome.FENCE_UNPROVABLE,
                    "the failed attempt may still be running and its fence cannot be proven "
                    "(etcd unreachable)",
                )
            )
        if failed.reason is FailureReason.NOT_SENT:
            # Envoy retries it by itself (its stream is gone: there is no answer to write); it cost nothing.
            return TriggerRetry(failed.reason.value)
        if failed.reason in _UNCERTAIN and self._policy.uncertain_source_liveness.then == FAIL:
            return self.finish(
                FailRequest(
                    502,
                    Outcome.RETRY_NOT_ALLOWED,
                    f"the replica's liveness was uncertain ({failed.reason.value}); the attempt was fenced "
                    "and the policy (uncertain_source_liveness.then: fail_request) allows no retry",
                )
            )
        if self.counted < self.max_attempts and self.final is None:
            if no_compatible_replica is not None:
                return self.finish(
                    FailRequest(
                        503,
                        Outcome.NO_COMPATIBLE_REPLICA,
                        f"no compatible replica is left to retry on: {no_compatible_replica}",
                    )
                )
            self._outbox.append(
                Event(EventName.RETRY_TRIGGERED, attempt.number, {"reason": failed.reason.value})
            )
            return TriggerRetry(failed.reason.value)
        return self.finish(self._exhausted(attempt))

    def finish(self, verdict: FailRequest) -> FailRequest:
        """Refuse every further attempt with `verdict` and end the logical request with it."""
        if self.final is None:
            self.final = verdict
            number = len(self.attempts) or None
            self._outbox.append(Event(EventName.RETRY_REFUSED, number, {"reason": verdict.code}))
            self._on_final(verdict)
        return self.final

    def _exhausted(self, last: Attempt | None) -> FailRequest:
        if self.retry_blocked is not None:
            return FailRequest(502, Outcome.RETRY_NOT_ALLOWED, self.retry_blocked)
        if last is not None and last.failure is FailureReason.OVERLOADED:
            overloaded = sum(1 for a in self.attempts if a.failure is FailureReason.OVERLOADED)
            return FailRequest(
                429,
                Outcome.REPLICAS_OVERLOADED,
                f"{overloaded} of the {len(self.attempts)} attempts got 429 (overloaded), the last one too; "
                "try again later",
                retry_after=last.retry_after,
            )
        why = f"; the last: {last.failure.value}" if last is not None and last.failure else ""
        unsent = len(self.attempts) - self.counted
        if unsent:
            why += f"; {unsent} more died at their connection before the request was sent (not counted)"
        return FailRequest(
            502, Outcome.RETRIES_EXHAUSTED, f"all {self.max_attempts} attempts failed before any content{why}"
        )
