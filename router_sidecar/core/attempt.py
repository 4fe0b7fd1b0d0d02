"""The attempt machine: one try of a logical request on one replica, as seen by the UPSTREAM filter.

Sans-IO. It consumes the attempt's response (headers, body chunks, loss of the stream) and returns one
decision per input. It holds the response headers until the first delta, because while they are held a
failure is still invisible to the client and Envoy can retry (DESIGN.md §5.3). It knows nothing about
retry budgets: a failure is reported as `AttemptFailed` and the logical request decides what follows.

    AWAITING_HEADERS ──headers 2xx──▶ HOLDING ──first delta / complete──▶ RELEASED
          │                              │
          ├──headers 4xx───▶ PASSED_THROUGH
          └──5xx / lost──▶ FAILED ◀──error event, abort, end without [DONE], lost──┘
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from router_sidecar.core.sse import EventKind, SseScanner


class AttemptState(enum.Enum):
    AWAITING_HEADERS = "awaiting_headers"
    HOLDING = "holding"
    RELEASED = "released"
    PASSED_THROUGH = "passed_through"
    FAILED = "failed"


class FailureReason(enum.StrEnum):
    """Why an attempt failed before anything reached the client. All are retriable in principle."""

    UPSTREAM_STATUS = "upstream_status"  # the replica answered 5xx
    CONNECTION_LOST = "connection_lost"  # reset, refused, process exit: Envoy tore the attempt down
    ERROR_EVENT = "error_event"  # in-band `data: {"error": ...}` before any content
    ABORTED = "aborted"  # finish_reason "abort" (engine shutting down) before any content
    ENDED_WITHOUT_DONE = "ended_without_done"  # clean end of body, but neither [DONE] nor a finish
    REPLICA_LOST = "replica_lost"  # its heartbeat lapsed while the connection stayed open: fenced


@dataclass(frozen=True, slots=True)
class Hold:
    """Keep the headers and every chunk so far; answer nothing yet."""


@dataclass(frozen=True, slots=True)
class Release:
    """Release headers and the held chunks, then leave the path (end the ext_proc stream with OK).

    `first_delta` is true when content is among them: the shell must make `first_delta_sent` durable
    in the journal *before* releasing (write-ahead), because after release a retry is forbidden.
    """

    first_delta: bool


@dataclass(frozen=True, slots=True)
class PassThrough:
    """Not a replica failure (e.g. 4xx for a bad request): release unchanged and leave."""

    status: int


@dataclass(frozen=True, slots=True)
class AttemptFailed:
    reason: FailureReason
    detail: str


AttemptDecision = Hold | Release | PassThrough | AttemptFailed

_COMPLETE_FINISH_REASONS = frozenset({"stop", "length", "tool_calls", "function_call", "content_filter"})


def is_event_stream(content_type: str) -> bool:
    # Media types are case-insensitive (RFC 9110 §8.3.1).
    return content_type[:17].lower() == "text/event-stream"


class Attempt:
    def __init__(self, *, request_id: str, attempt_id: str, number: int, replica: str) -> None:
        self.request_id = request_id
        self.attempt_id = attempt_id
        self.number = number
        self.replica = replica
        self.state = AttemptState.AWAITING_HEADERS
        self.status: int | None = None
        self._streaming = False
        self._scanner = SseScanner()
        self._finished = False  # a finish_reason that means "generation complete" was seen

    def on_response_headers(self, status: int, content_type: str) -> AttemptDecision:
        self._expect(AttemptState.AWAITING_HEADERS)
        self.status = status
        if status >= 500:
            return self._fail(FailureReason.UPSTREAM_STATUS, f"replica answered {status}")
        if status >= 300:
            self.state = AttemptState.PASSED_THROUGH
            return PassThrough(status)
        self._streaming = is_event_stream(content_type)
        self.state = AttemptState.HOLDING
        return Hold()

    def on_response_body(self, chunk: bytes, end_of_stream: bool) -> AttemptDecision:
        self._expect(AttemptState.HOLDING)
        if not self._streaming:
            # A non-streamed answer is delivered whole: hold it until it is complete.
            if not end_of_stream:
                return Hold()
            self.state = AttemptState.RELEASED
            return Release(first_delta=True)
        for event in self._scanner.feed(chunk):
            if event.kind is EventKind.ERROR:
                return self._fail(FailureReason.ERROR_EVENT, "in-band error event before any content")
            if event.finish_reason == "abort":
                return self._fail(FailureReason.ABORTED, "finish_reason abort before any content")
            if event.kind is EventKind.CONTENT:
                self.state = AttemptState.RELEASED
                return Release(first_delta=True)
            if event.finish_reason in _COMPLETE_FINISH_REASONS:
                self._finished = True
            elif event.kind is EventKind.DONE:
                # A complete generation without content (e.g. EOS as the first token): nothing to retry.
                self.state = AttemptState.RELEASED
                return Release(first_delta=False)
        if end_of_stream:
            if self._finished:
                self.state = AttemptState.RELEASED
                return Release(first_delta=False)
            return self._fail(FailureReason.ENDED_WITHOUT_DONE, "response ended without content or [DONE]")
        return Hold()

    def on_stream_lost(self) -> AttemptDecision:
        """Envoy closed this attempt's stream: the replica reset, refused, or the downstream went away."""
        if self.state in (AttemptState.AWAITING_HEADERS, AttemptState.HOLDING):
            return self._fail(FailureReason.CONNECTION_LOST, "connection to the replica was lost")
        return Hold()

    def on_replica_lost(self) -> AttemptFailed | None:
        """Liveness is uncertain (heartbeat gone, connection open): the attempt is being fenced."""
        if self.state in (AttemptState.AWAITING_HEADERS, AttemptState.HOLDING):
            return self._fail(FailureReason.REPLICA_LOST, "the replica's heartbeat lapsed before any content")
        return None

    def _fail(self, reason: FailureReason, detail: str) -> AttemptFailed:
        self.state = AttemptState.FAILED
        return AttemptFailed(reason, detail)

    def _expect(self, state: AttemptState) -> None:
        if self.state is not state:
            raise RuntimeError(f"attempt {self.attempt_id}: event not valid in state {self.state.value}")
