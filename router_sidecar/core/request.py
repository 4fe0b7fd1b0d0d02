"""The logical-request machine: what the user asked for once, as seen by the DOWNSTREAM filter.

Sans-IO, like `attempt.py`. It owns the phase (prefill → decode → terminal), the delivered-token count,
and what the client receives: the response of the one attempt that was released, ending in `[DONE]` or in
exactly one terminal error frame; or, when no attempt was released, one JSON error naming the request and
why — never a dead attempt's bytes, whatever Envoy decided about a retry. The attempts themselves and the
retry decisions live in `attempt.py` (`RetryGate`); this machine reads them.

The boundary is delivery, not generation: `phase` turns to DECODE when this direction forwards the first
content event towards the client, and from then on no retry is ever allowed.

One verb: `handle(input) -> decision`. Inputs are named by cause (below).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from router_sidecar.core.attempt import (
    COMPLETE_FINISH_REASONS,
    AttemptState,
    FailRequest,
    RetryGate,
    Superseded,
    is_event_stream,
)
from router_sidecar.core.events import Event, EventName, Outcome
from router_sidecar.core.openai_api import ParsedRequest
from router_sidecar.core.policy import Policy
from router_sidecar.core.sse import (
    DONE_EVENT,
    AbortScan,
    EventKind,
    SseEvent,
    SseScanner,
    UsageTail,
    terminal_error_frame,
)


class Phase(enum.StrEnum):
    PREFILL = "prefill"
    DECODE = "decode"
    COMPLETED = "completed"
    INTERRUPTED = "interrupted"
    CANCELLED = "cancelled"
    REJECTED = "rejected"
    FAILED = "failed"


TERMINAL_PHASES = frozenset(
    {Phase.COMPLETED, Phase.INTERRUPTED, Phase.CANCELLED, Phase.REJECTED, Phase.FAILED}
)


class DownstreamLoss(enum.StrEnum):
    """Why the client-facing stream ended without our doing (from Envoy's access log flags)."""

    CLIENT_GONE = "client_gone"
    UPSTREAM_RESET = "upstream_reset"
    DEADLINE = "deadline"  # Envoy's own timeout (the backstop behind the sidecar's deadline)
    ENVOY_EXITED = "envoy_exited"  # the gateway's Envoy died (and was restarted) under the stream
    UNKNOWN = "unknown"


# --- inputs (named by cause) -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ResponseStarted:
    """Response headers on their way to the client. `details` is Envoy's response code details
    ("via_upstream" for a replica's own answer; otherwise Envoy answered itself: no host, connect failure,
    a retry it refused, a timeout), `flags` its response flags (UO, UH, URX, UT, …)."""

    status: int
    content_type: str = ""
    flags: frozenset[str] = frozenset()
    details: str = ""
    # Why a pinned request has nowhere to go (the shell asks the registry), for Envoy's "no host" answers.
    no_compatible_replica: str | None = None
    # How many attempts Envoy made (its upstream.request_attempt_count; None: it did not say).
    envoy_attempts: int | None = None


@dataclass(frozen=True, slots=True)
class ResponseChunk:
    chunk: bytes
    end_of_stream: bool


@dataclass(frozen=True, slots=True)
class PublisherLost:
    """After the first delta the publishing attempt lost its right to publish: `cause` is heartbeat_lapsed,
    progress_gap or lease_lost."""

    cause: str


@dataclass(frozen=True, slots=True)
class DeadlineReached:
    """The gateway's own deadline for this request (deadlines.request_seconds from admission) fired."""


@dataclass(frozen=True, slots=True)
class DownstreamLost:
    cause: DownstreamLoss
    client_status: int | None = None  # what Envoy's access log says the client got (None: unknown)


@dataclass(frozen=True, slots=True)
class ToolCallNoted:
    """A tool call made on behalf of this request (claimed, executed, replayed, refused, …)."""

    name: EventName
    key: str
    attempt: int | None
    detail: dict[str, Any] = field(default_factory=dict)


Input = ResponseStarted | ResponseChunk | PublisherLost | DeadlineReached | DownstreamLost | ToolCallNoted

# --- decisions ---------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PassResponse:
    """Let the response headers through (the shell adds `x-request-id`)."""


@dataclass(frozen=True, slots=True)
class ReplaceResponse:
    """These headers belong to no released attempt: answer the client with this error instead, and drop
    every byte of the response they start."""

    verdict: FailRequest


@dataclass(frozen=True, slots=True)
class Forward:
    data: bytes
    end_of_stream: bool


@dataclass(frozen=True, slots=True)
class Terminate:
    """End the client stream ourselves: `data` is the delivered prefix's tail + terminal frame + [DONE]."""

    data: bytes


@dataclass(frozen=True, slots=True)
class FailNow:
    """No response has started yet: answer the client with this error at once (Envoy then resets the
    upstream request, which cancels whatever attempt is held)."""

    verdict: FailRequest


@dataclass(frozen=True, slots=True)
class NoAction:
    pass


Decision = PassResponse | ReplaceResponse | Forward | Terminate | FailNow | NoAction
NO_ACTION = NoAction()

_PUBLISHER_LOST = {
    "heartbeat_lapsed": "the replica's heartbeat lapsed after the first delta; its attempt was fenced",
    "health_check_failed": "the replica stopped answering its health check after the first delta",
    "progress_gap": "the replica's bytes stopped arriving after the first delta; its attempt was fenced",
    "lease_lost": "the attempt's lease could not be kept after the first delta: it lost its right to publish",
}


@dataclass(slots=True)
class _Response:
    """The response towards the client, as this direction has seen it."""

    status: int | None = None  # None: no response headers yet
    streaming: bool = False
    replaced: bool = False  # its headers were answered with our error: drop everything it sends
    scanner: SseScanner = field(default_factory=SseScanner)
    usage_tail: UsageTail = field(default_factory=UsageTail)
    abort_scan: AbortScan = field(default_factory=AbortScan)
    done_seen: bool = False
    finished: bool = False  # a completing finish_reason was forwarded
    content_events: int = 0
    usage_tokens: int | None = None
    ended: bool = False
    # (attempt number, why) of a publishing attempt found lost: before its first content passed here the
    # stream ends right after the chunk that brings it (a later attempt is not concerned).
    publisher_lost: tuple[int, str] | None = None
    finish_reason: str | None = None  # the last one forwarded (the journal and spans report it)


class LogicalRequest:
    def __init__(self, *, request_id: str, tenant: str, parsed: ParsedRequest, policy: Policy) -> None:
        self.request_id = request_id
        self.tenant = tenant
        self.parsed = parsed
        self.policy = policy
        self.phase = Phase.PREFILL
        self.outcome: Outcome | None = None
        self.model_revision: str | None = None
        self.fingerprint_digest: str | None = None  # the compatibility group every attempt is pinned to
        self.tool_calls: dict[str, dict[str, Any]] = {}  # idempotency key → what happened, by which attempt
        self.tool_calls_dropped = 0  # beyond tools.max_calls_per_request: counted, not listed
        self.outbox: list[Event] = []
        self.envoy_attempts: int | None = None  # as Envoy counts them (a response attribute, its access log)
        self.gate = RetryGate(policy, self.outbox, self._failed)
        cap = policy.reprefill_cost_cap.max_prompt_tokens
        if parsed.estimated_prompt_tokens > cap:
            self.gate.block(
                f"the prompt (~{parsed.estimated_prompt_tokens} tokens) exceeds the re-prefill cost cap "
                f"({cap}), so it is not retried"
            )
        self._response = _Response(scanner=SseScanner(max_event_bytes=policy.limits.max_event_bytes))
        self._emit(
            EventName.REQUEST_ACCEPTED,
            route=parsed.kind.value,
            model=parsed.model,
            stream=parsed.stream,
            seed=parsed.seed,
            input_digest=parsed.input_digest,
            estimated_prompt_tokens=parsed.estimated_prompt_tokens,
            retry_allowed=self.gate.retry_blocked is None,
        )

    # --- derived facts ---------------------------------------------------------------------------------

    @property
    def attempts(self) -> list[Any]:
        return self.gate.attempts

    @property
    def first_delta_sent(self) -> bool:
        """The write-ahead fact: content of an attempt may have reached the client (so no retry, ever).
        False again if Envoy retried after all: the release never reached its router."""
        return self._response.content_events > 0 or any(
            a.first_delta and a.state in (AttemptState.WRITING_AHEAD, AttemptState.RELEASED)
            for a in self.gate.attempts
        )

    @property
    def publisher(self) -> Any:
        """The attempt whose bytes go to the client (released at its first delta), if any."""
        last = self.gate.attempts[-1] if self.gate.attempts else None
        return last if last is not None and last.state is AttemptState.RELEASED else None

    @property
    def finish_reason(self) -> str | None:
        """The finish_reason of the last event forwarded that had one (None: no such event went out)."""
        return self._response.finish_reason

    @property
    def retry_budget(self) -> int:
        """Retries still allowed (the article's `retry_budget`)."""
        return self.gate.retries_left if self.phase is Phase.PREFILL else 0

    @property
    def delivered_output_tokens(self) -> int:
        r = self._response
        return r.usage_tokens if r.usage_tokens is not None else r.content_events

    @property
    def delivered_tokens_source(self) -> str:
        return "usage" if self._response.usage_tokens is not None else "content_events"

    @property
    def is_terminal(self) -> bool:
        return self.phase in TERMINAL_PHASES

    def drain_events(self) -> list[Event]:
        events, self.outbox[:] = list(self.outbox), []
        return events

    def pin(self, fingerprint_digest: str, model_revision: str | None) -> None:
        self.fingerprint_digest, self.model_revision = fingerprint_digest, model_revision

    def attempt_number(self, attempt_id: str | None) -> int | None:
        return next((a.number for a in self.gate.attempts if a.attempt_id == attempt_id), None)

    # --- the one verb ----------------------------------------------------------------------------------

    def handle(self, event: Input) -> Decision:
        if isinstance(event, ResponseChunk):  # first: every chunk of every stream comes this way
            return self._chunk(event)
        if isinstance(event, ResponseStarted):
            return self._started(event)
        if isinstance(event, PublisherLost):
            return self._publisher_lost(event)
        if isinstance(event, DeadlineReached):
            return self._deadline()
        if isinstance(event, DownstreamLost):
            self._downstream_lost(event)
            return NO_ACTION
        self._tool_call(event)
        return NO_ACTION

    # --- response headers ------------------------------------------------------------------------------

    def _started(self, e: ResponseStarted) -> Decision:
        r = self._response
        r.status = e.status
        # Envoy answered: an attempt whose stream ended before its request was let go had lost its connection.
        self.gate.confirm_never_sent()
        self.note_envoy_attempts(e.envoy_attempts)
        last = self.gate.attempts[-1] if self.gate.attempts else None
        released = last is not None and last.state in (AttemptState.RELEASED, AttemptState.PASSED_THROUGH)
        from_replica = e.details in ("via_upstream", "")  # "": Envoy did not say; trust the release
        if (
            not from_replica
            and last is not None
            and last.state in (AttemptState.RELEASED, AttemptState.WRITING_AHEAD)
        ):
            # We released it (or were about to), but the replica reset before the release reached Envoy's
            # router, which then answered itself: nothing of that attempt reached the client, and a
            # write-ahead finishing now must not release it (first_delta_sent stays false).
            last.handle(Superseded())  # its lease is released when the request settles
            released = False
        if self.is_terminal and self.gate.final is not None and not from_replica:
            # Refused already: whatever answer this is (ours from the upstream filter, or Envoy's after a
            # reset it retried or not), the client gets the request's own error.
            r.replaced = True
            return ReplaceResponse(self.gate.final)
        if self.is_terminal or released:
            # Ours to pass: the released attempt's answer.
            r.streaming = e.status < 300 and is_event_stream(e.content_type)
            if not r.streaming and e.status < 300 and self.phase is Phase.PREFILL:
                self.phase = Phase.DECODE  # a non-stream answer is delivered whole, as one delta
            return PassResponse()
        # Headers that no released attempt sent: a retry Envoy did not make (our 503 came back), or
        # Envoy's own answer (no host, connect failure, deadline). Their body must not reach the client.
        r.replaced = True
        self._emit(
            EventName.RESPONSE_REPLACED,
            len(self.gate.attempts) or None,
            status=e.status,
            response_flags=sorted(e.flags),
            details=e.details,
        )
        return ReplaceResponse(self.gate.finish(self._envoy_verdict(e)))

    def note_envoy_attempts(self, count: int | None) -> None:
        """Envoy's own count of the attempts it made (it can only grow)."""
        if count is not None and count > (self.envoy_attempts or 0):
            self.envoy_attempts = count

    def _envoy_verdict(self, e: ResponseStarted) -> FailRequest:
        attempts = len(self.gate.attempts)
        flags = ",".join(sorted(e.flags)) or "none"
        said = f"(Envoy: status {e.status}, response flags {flags}, details {e.details or 'none'})"
        if "UO" in e.flags:
            return FailRequest(
                503,
                Outcome.RETRY_BUDGET_EXHAUSTED,
                f"attempt {attempts} failed before any content and the cluster's retry budget refused the "
                f"retry (budgets.retry_budget_percent, min_retry_concurrency) {said}",
            )
        if "UT" in e.flags:
            return FailRequest(
                504,
                Outcome.DEADLINE_EXCEEDED,
                f"the gateway's request deadline (deadlines.request_seconds) fired before any content {said}",
            )
        if e.flags & {"UH", "NR"}:
            if e.no_compatible_replica is not None:
                return FailRequest(
                    503,
                    Outcome.NO_COMPATIBLE_REPLICA,
                    f"no compatible replica is left to send the request to: {e.no_compatible_replica} {said}",
                )
            return FailRequest(503, Outcome.NO_REPLICA_AVAILABLE, f"no healthy replica was available {said}")
        if attempts == 0 and not self.envoy_attempts:
            return FailRequest(503, Outcome.NO_REPLICA_AVAILABLE, f"no replica could be reached {said}")
        if self.gate.counted == 0:
            # Every attempt died at its connection (refused, or closed before its request was sent).
            told = self._attempts_told(e.flags)
            return FailRequest(
                503, Outcome.NO_REPLICA_AVAILABLE, f"no replica could be reached: {told} {said}"
            )
        return FailRequest(502, Outcome.RETRIES_EXHAUSTED, f"{self._attempts_told(e.flags)} {said}")

    def _attempts_told(self, flags: frozenset[str]) -> str:
        """How many attempts ran and how each ended, as the journal lists them and as Envoy counted them."""
        listed = self.gate.attempts
        made = max(self.envoy_attempts or 0, len(listed))
        ended = ", ".join(f"{a.number}: {a.failure.value if a.failure else a.state.value}" for a in listed)
        told = f"Envoy made {made} attempt(s), none delivered content"
        if listed:
            told += f" ({ended})"
        unseen = made - len(listed)
        if unseen:
            told += f"; {unseen} ended before the gateway saw it (its connection died before it was sent)"
        reached = self.gate.counted
        if "URX" in flags and reached < self.gate.max_attempts:
            told += (
                f"; {reached} reached a replica, fewer than max_attempts ({self.gate.max_attempts}): Envoy's "
                "retry limit was used up by attempts that died at their connection"
            )
        elif "URX" not in flags:
            told += "; Envoy made no further attempt"
        return told

    # --- response body ---------------------------------------------------------------------------------

    def _chunk(self, e: ResponseChunk) -> Decision:
        r = self._response
        if r.ended or r.replaced:
            return Forward(b"", e.end_of_stream) if not r.replaced else NO_ACTION
        if not r.streaming:
            return self._non_stream_chunk(e)
        whole = r.scanner.pending_size == 0  # nothing carried over: the chunk may be forwarded as it is
        events = r.scanner.feed(e.chunk)
        if e.end_of_stream:
            events += r.scanner.close()  # a last event ended by a lone CR is complete now
        for index, event in enumerate(events):
            if event.kind is EventKind.DONE:
                # [DONE] ends the generation: anything the replica sends after it is not forwarded.
                r.done_seen = r.ended = True
                self._finish(Phase.COMPLETED, Outcome.COMPLETED)
                return Forward(_join(events[: index + 1], e.chunk, whole), True)
            if self.phase is Phase.DECODE:
                if event.kind is EventKind.ERROR:
                    return self._terminate(events[:index], "in-band error event after the first delta")
                if event.finish_reason == "abort":
                    self._count(event)
                    return self._terminate(events[: index + 1], "finish_reason abort after the first delta")
            self._count(event)
        lost = r.publisher_lost
        if lost is not None and self.phase is Phase.DECODE and self._noted_publisher(lost[0]):
            return self._terminate(events, lost[1])
        if r.scanner.oversized:
            limit = self.policy.limits.max_event_bytes
            return self._terminate(
                events, f"the replica sent an SSE event over limits.max_event_bytes ({limit})"
            )
        if e.end_of_stream:
            if r.finished:
                # Every content event and the finish were forwarded; only [DONE] was missing: complete.
                r.ended = True
                self._finish(Phase.COMPLETED, Outcome.COMPLETED)
                return Forward(b"".join(ev.raw for ev in events) + DONE_EVENT, True)
            if self.phase is Phase.DECODE:
                return self._terminate(events, "upstream ended without [DONE]")
            r.ended = True
            self._finish(Phase.FAILED, Outcome.UPSTREAM_ERROR)
            return Forward(_join(events, e.chunk, whole), True)
        return Forward(_join(events, e.chunk, whole), False)

    def _non_stream_chunk(self, e: ResponseChunk) -> Forward:
        r = self._response
        ok = r.status is not None and r.status < 300
        if ok:
            r.usage_tail.feed(e.chunk)
            r.abort_scan.feed(e.chunk)
        if e.end_of_stream:
            r.ended = True
            if not ok:
                self._finish(Phase.FAILED, Outcome.UPSTREAM_ERROR)
            elif r.abort_scan.aborted:
                # Released as it came (past the hold bound) and cut short by the engine: the client has it
                # all, and it says so itself (finish_reason "abort"); the journal must not call it complete.
                r.usage_tokens = r.usage_tail.completion_tokens()
                self._emit(EventName.STREAM_TERMINATED, reason="finish_reason abort in a non-stream answer")
                self._finish(Phase.INTERRUPTED, Outcome.UPSTREAM_DECODE_INTERRUPTED)
            else:
                r.usage_tokens = r.usage_tail.completion_tokens()
                self._finish(Phase.COMPLETED, Outcome.COMPLETED)
        return Forward(e.chunk, e.end_of_stream)

    # --- the stream ended without our doing, or must be ended by us ------------------------------------

    def _publisher_lost(self, e: PublisherLost) -> Decision:
        r = self._response
        publisher = self.publisher
        if self.is_terminal or r.ended or publisher is None:
            return NO_ACTION  # before any release the upstream placement answers for the attempt
        noted = r.publisher_lost
        if noted is None or noted[0] != publisher.number:
            self._emit(EventName.REPLICA_LOST, publisher.number, cause=e.cause)
            noted = r.publisher_lost = (publisher.number, _PUBLISHER_LOST.get(e.cause, e.cause))
        if self.phase is Phase.PREFILL:
            # Released, but its first content has not passed here yet: it is on its way through Envoy (its
            # response headers may not even have reached this filter, so nothing can be written to the
            # client now). The stream ends right after the chunk that brings it.
            return NO_ACTION
        return self._terminate([], noted[1])

    def _noted_publisher(self, number: int) -> bool:
        publisher = self.publisher
        return publisher is not None and publisher.number == number

    def _deadline(self) -> Decision:
        if self.is_terminal or self._response.ended:
            return NO_ACTION
        seconds = self.policy.deadlines.request_seconds
        why = f"the gateway's request deadline (deadlines.request_seconds = {seconds:g} s) fired"
        if self._response.status is None:
            return FailNow(
                self.gate.finish(FailRequest(504, Outcome.DEADLINE_EXCEEDED, f"{why} before any content"))
            )
        return self._terminate([], why, outcome=Outcome.DEADLINE_EXCEEDED)

    def _downstream_lost(self, e: DownstreamLost) -> None:
        cause = e.cause
        if self.is_terminal:
            return
        if self._response.done_seen:
            # The client already has the whole generation ([DONE] went out); it just closed first.
            self._finish(Phase.COMPLETED, Outcome.COMPLETED)
            return
        delivered = self.delivered_output_tokens
        if cause is DownstreamLoss.CLIENT_GONE or (
            cause is DownstreamLoss.UNKNOWN and self.phase is Phase.PREFILL
        ):
            self._emit(EventName.CLIENT_DISCONNECTED, delivered_output_tokens=delivered)
            self._finish(Phase.CANCELLED, Outcome.CLIENT_DISCONNECTED)
            return
        # Headers (and chunks) we passed may still have been replaced by Envoy's own answer: a reset right
        # after them, before Envoy had written them out. Then nothing we passed reached the client.
        replaced = e.client_status is not None and e.client_status != self._response.status
        if replaced or (self._response.status is None and self.phase is Phase.PREFILL):
            self._response.content_events, self._response.usage_tokens = 0, None
            delivered = 0
            # Nothing went out: Envoy answered the client itself (or nobody could) before any attempt's
            # headers reached it — e.g. a replica's protocol error while the release was on its way.
            last = self.gate.attempts[-1] if self.gate.attempts else None
            if last is not None and last.state in (AttemptState.RELEASED, AttemptState.WRITING_AHEAD):
                last.handle(Superseded())  # nothing of it reached the client; its lease goes at settle
            self._emit(EventName.STREAM_RESET, cause=cause.value, delivered_output_tokens=delivered)
            failed = Outcome.ENVOY_EXITED if cause is DownstreamLoss.ENVOY_EXITED else Outcome.UPSTREAM_ERROR
            self._finish(Phase.FAILED, failed)
            return
        # The stream had started (headers, maybe content): it was cut.
        self._emit(EventName.STREAM_RESET, cause=cause.value, delivered_output_tokens=delivered)
        outcome = {
            DownstreamLoss.DEADLINE: Outcome.DEADLINE_EXCEEDED,
            DownstreamLoss.ENVOY_EXITED: Outcome.ENVOY_EXITED,
        }.get(cause, Outcome.UPSTREAM_DECODE_INTERRUPTED)
        self._finish(Phase.INTERRUPTED, outcome)

    def _tool_call(self, e: ToolCallNoted) -> None:
        entry = self.tool_calls.get(e.key)
        if entry is None:
            if len(self.tool_calls) >= self.policy.tools.max_calls_per_request:
                self.tool_calls_dropped += 1
                return
            entry = self.tool_calls[e.key] = {"key": e.key, "events": []}
        if len(entry["events"]) < 16:  # one key sees a handful of calls; a flood is not journaled whole
            entry["events"].append({"event": e.name.value, "attempt": e.attempt, **e.detail})
        self._emit(e.name, e.attempt, key=e.key, **e.detail)

    # --- internals -------------------------------------------------------------------------------------

    def _count(self, event: SseEvent) -> None:
        r = self._response
        # Malformed bytes already on their way to the client cannot be proven empty: counted as content.
        if event.kind is EventKind.CONTENT or event.kind is EventKind.MALFORMED:
            r.content_events += 1
            if self.phase is Phase.PREFILL:
                self.phase = Phase.DECODE
        if event.finish_reason is not None:
            r.finish_reason = event.finish_reason
            if event.finish_reason in COMPLETE_FINISH_REASONS:
                r.finished = True
        if event.usage_completion_tokens is not None:
            r.usage_tokens = event.usage_completion_tokens

    def _terminate(
        self, delivered: list[SseEvent], why: str, outcome: Outcome = Outcome.UPSTREAM_DECODE_INTERRUPTED
    ) -> Terminate:
        r = self._response
        r.ended = True
        self._emit(
            EventName.STREAM_TERMINATED, reason=why, delivered_output_tokens=self.delivered_output_tokens
        )
        self._finish(Phase.INTERRUPTED, outcome)
        frame = terminal_error_frame(self.request_id, self.delivered_output_tokens, why)
        return Terminate(b"".join(e.raw for e in delivered) + frame)

    def _failed(self, verdict: FailRequest) -> None:
        """The retry gate refused any further attempt: the request ends with its error."""
        self._finish(Phase.FAILED, Outcome(verdict.code))

    def _finish(self, phase: Phase, outcome: Outcome) -> None:
        if self.is_terminal:
            return
        self.phase, self.outcome = phase, outcome
        if phase is Phase.COMPLETED:
            self._emit(EventName.STREAM_COMPLETED, delivered_output_tokens=self.delivered_output_tokens)
        elif phase is Phase.FAILED:
            self._emit(EventName.REQUEST_FAILED, outcome=outcome.value)

    def _emit(self, name: EventName, attempt: int | None = None, **detail: Any) -> None:
        self.outbox.append(Event(name, attempt, detail))


def _join(events: list[SseEvent], chunk: bytes, whole: bool) -> bytes:
    # Fast path: the chunk was exactly these whole events (the common case), forward it without copying.
    if whole and sum(len(e.raw) for e in events) == len(chunk):
        return chunk
    return b"".join(e.raw for e in events)
