"""The logical-request machine: what the user asked for once, its attempts, and what the client receives.

Sans-IO, like `attempt.py`. Both filter placements feed this one machine (through `Live` in
`extproc/registry.py`, where they meet) and carry out what it decides; no shell decides anything itself.

* **Admission and the claim.** The journal claim of the request's id runs beside the first attempt (or before
  it, `journal.claim_before_forwarding`); its result is an input (`ClaimSettled`). Until it is settled nothing
  of any attempt reaches the client and no retry starts; a run refused by it (the id is another run's) ends
  with one 409, and nothing of it is released.
* **Attempts.** Each attempt Envoy starts arrives here (`AttemptArrived`) and is admitted, made to wait for
  its predecessor's fence, or refused: this is the retry gate (budget, fence, claim, placement, policy). Every
  input of an attempt goes through `ForAttempt` to its machine (`attempt.py`); a failure's verdict — another
  attempt or one error for the client — is given here and answered on the attempt's stream.
* **The client's response.** The phase (prefill → decode → terminal) and the delivered-token count: the
  response of the one attempt that was released, ending in `[DONE]` or in exactly one terminal error frame;
  or, when no attempt was released, one JSON error naming the request and why — never a dead attempt's bytes,
  whatever Envoy decided about a retry.

The boundary is delivery, not generation: `phase` turns to DECODE when the client-facing filter forwards the
first content event, and from then on no retry is ever allowed (docs/design.md#the-request-machine).

One verb: `handle(input) -> list[decision]`. Inputs are named by cause; decisions are addressed (the client
stream, one attempt's stream, or an effect the shell runs and answers with another input).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from router_sidecar.core import attempt as a
from router_sidecar.core.attempt import (
    COMPLETE_FINISH_REASONS,
    UNCERTAIN_FAILURES,
    Attempt,
    AttemptState,
    FailRequest,
    IllegalInput,
    TriggerRetry,
    is_event_stream,
)
from router_sidecar.core.destinations import HOLDER, Destinations
from router_sidecar.core.dialects import Dialect, dialect_for
from router_sidecar.core.events import Event, EventName, Outcome
from router_sidecar.core.openai_api import ParsedRequest
from router_sidecar.core.placement import Placement
from router_sidecar.core.policy import FAIL, Policy
from router_sidecar.core.sse import AbortScan, EventKind, SseEvent, SseScanner, UsageTail

# A previous attempt that was never proven fenced blocks the next one at most its lease's TTL plus this.
FENCE_WAIT_SLACK_SECONDS = 5


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


class ClaimState(enum.Enum):
    """The journal claim of the request's id."""

    PENDING = "pending"  # running (beside the first attempt, or before it)
    HELD = "held"  # this run holds the id
    UNAVAILABLE = "unavailable"  # etcd could not be asked: served, but no retry can be proven safe
    REFUSED = "refused"  # the id is another run's: nothing of this one reaches the client


class ClaimOutcome(enum.Enum):
    GRANTED = "granted"
    REFUSED = "refused"
    UNAVAILABLE = "unavailable"  # the store did not answer (or could not record it)


class ClientStream(enum.Enum):
    """The client-facing stream, as this machine has answered it."""

    RECEIVED = "received"  # the request body arrived; admission is under way
    ADMITTING = "admitting"  # the request body waits for our reply: the claim, which comes first
    FORWARDED = "forwarded"  # sent on to the attempts; no response has reached the client filter yet
    HEADERS_WAITING = "headers_waiting"  # response headers reached it and wait for the claim
    PASSED = "passed"  # the released attempt's response goes to the client
    REPLACED = "replaced"  # our JSON error went out in place of a response: the rest of it is dropped
    ANSWERED = "answered"  # we answered the client ourselves, unsolicited: nothing more goes to it
    REJECTED = "rejected"  # refused at admission (its id is another run's)


class DownstreamLoss(enum.StrEnum):
    """Why the client-facing stream ended without our doing (from Envoy's access log flags)."""

    CLIENT_GONE = "client_gone"
    UPSTREAM_RESET = "upstream_reset"
    DEADLINE = "deadline"  # Envoy's own timeout (the backstop behind the sidecar's deadline)
    ENVOY_EXITED = "envoy_exited"  # the gateway's Envoy died (and was restarted) under the stream
    UNKNOWN = "unknown"


@dataclass(frozen=True, slots=True)
class DuplicateRun:
    """The refusal of a run whose id another run holds: still in flight, or finished with output."""

    in_flight: bool
    outcome: str | None = None  # the other run's outcome, when it finished


ClientError = FailRequest | DuplicateRun


def holder_unavailable(response_id: str | None, holder: str, why: str) -> FailRequest:
    """The error of a request on a stored response whose holder cannot serve it (docs/errors.md)."""
    return FailRequest(
        503,
        Outcome.STORED_RESPONSE_UNAVAILABLE,
        f"the response {response_id} is stored on replica {holder}, which {why}; it exists nowhere else. "
        "Try again if that replica may come back, or start over without it",
    )


# --- inputs (named by cause) -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Admitted:
    """The request passed admission (parsed, pinned, registered): claim its id and forward it.
    `destinations`: the order of replicas its attempts walk (None: none chosen; Envoy's balancer chooses)."""

    destinations: Destinations | None = None


@dataclass(frozen=True, slots=True)
class ClaimSettled:
    outcome: ClaimOutcome
    why: str = ""  # for UNAVAILABLE: why no retry can be proven safe
    duplicate: DuplicateRun | None = None  # for REFUSED


@dataclass(frozen=True, slots=True)
class AttemptArrived:
    """Envoy started an attempt: its upstream stream's request headers wait for our reply. `envoy_attempt` is
    Envoy's own number for it (`upstream.request_attempt_count`): a gap before it is an attempt whose stream
    ended before we saw it (its connection died)."""

    attempt_id: str
    replica: str
    envoy_attempt: int | None = None


@dataclass(frozen=True, slots=True)
class LeaseGranted:
    """The admitted attempt's lease (the shell's handle; `ttl_seconds` None: etcd was away, no lease).
    `replica_side`: its replica can honour a lease (registered with an agent); a static replica cannot, and
    its closed connection is its whole fence."""

    attempt_id: str
    lease: Any
    ttl_seconds: int | None
    replica_side: bool


@dataclass(frozen=True, slots=True)
class ArrivalGone:
    """The stream of an attempt that was not admitted yet was torn down: its connection died (a pooled one the
    replica had closed), or the client left. Which one, Envoy's next move tells (`_confirm_never_sent`)."""

    attempt_id: str


@dataclass(frozen=True, slots=True)
class ForAttempt:
    """An input of one attempt's machine (its stream's messages, monitors, fence and journal results)."""

    attempt_id: str
    input: a.Input


@dataclass(frozen=True, slots=True)
class RetryPlaced:
    """Where a retry of the failed attempt could land (`no_compatible_replica`: why nowhere, else None)."""

    attempt_id: str
    no_compatible_replica: str | None = None


@dataclass(frozen=True, slots=True)
class FenceWaitOver:
    """The bound on waiting for this attempt's fence passed."""

    attempt_id: str


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
    envoy_attempts: int | None = None  # how many attempts Envoy made, by its access log
    client_body_bytes: int | None = None  # the body bytes Envoy sent the client, by its access log


@dataclass(frozen=True, slots=True)
class ToolCallNoted:
    """A tool call made on behalf of this request (claimed, executed, replayed, refused, …)."""

    name: EventName
    key: str
    attempt: int | None
    detail: dict[str, Any] = field(default_factory=dict)


Input = (
    Admitted
    | ClaimSettled
    | AttemptArrived
    | LeaseGranted
    | ArrivalGone
    | ForAttempt
    | RetryPlaced
    | FenceWaitOver
    | ResponseStarted
    | ResponseChunk
    | PublisherLost
    | DeadlineReached
    | DownstreamLost
    | ToolCallNoted
)

# --- decisions: the client stream --------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ContinueRequest:
    """Reply to the request body: send it on (Envoy then starts the first attempt)."""


@dataclass(frozen=True, slots=True)
class RejectRequest:
    """Reply to the request body with this error instead: no attempt starts."""

    error: ClientError


@dataclass(frozen=True, slots=True)
class PassResponse:
    """Let the response headers through (the shell adds `x-request-id`)."""


@dataclass(frozen=True, slots=True)
class ReplaceResponse:
    """These headers belong to no released attempt: answer the client with this error instead, and drop
    every byte of the response they start."""

    error: ClientError


@dataclass(frozen=True, slots=True)
class WithholdResponse:
    """No reply to these headers: the client was answered already (unsolicited) and the stream is ending."""


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
    """No response has reached the client: answer it with this error at once, unsolicited (Envoy then resets
    the upstream request, which cancels whatever attempt is held)."""

    error: ClientError


# --- decisions: an attempt's stream ------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ForwardAttempt:
    """Reply to the attempt's request headers: send it to its replica, with its attempt headers (and, on a
    fallback model's replica, the request body with `model` naming it)."""

    attempt_id: str
    model: str | None = None


@dataclass(frozen=True, slots=True)
class RefuseAttempt:
    """Reply to the attempt's request headers with this error: it never reaches a replica. (For a
    `DuplicateRun` the body is the client filter's to write: it answers the client itself.)"""

    attempt_id: str
    error: ClientError


@dataclass(frozen=True, slots=True)
class AnswerAttempt:
    """Write the verdict in reply to the attempt's held response headers (with its held chunks on a retry)."""

    attempt_id: str
    verdict: TriggerRetry | FailRequest
    held_chunks: int


@dataclass(frozen=True, slots=True)
class ReleaseAttempt:
    """Release the attempt's held headers and `held_chunks` chunks, then leave its path."""

    attempt_id: str
    held_chunks: int


# --- decisions: effects (the shell runs them; most answer with an input) -----------------------------


@dataclass(frozen=True, slots=True)
class StartClaim:
    """Claim the request's id in the journal; answer `ClaimSettled`. `patient`: on an etcd cluster, wait out
    an election (not when the claim runs inside Envoy's admission timeout)."""

    patient: bool


@dataclass(frozen=True, slots=True)
class StartDeadline:
    """Feed `DeadlineReached` after `seconds`."""

    seconds: float


@dataclass(frozen=True, slots=True)
class GrantLease:
    """Grant the admitted attempt its lease; answer `LeaseGranted`."""

    attempt_id: str
    replica: str


@dataclass(frozen=True, slots=True)
class DiscardLease:
    """A lease granted for an attempt whose stream went meanwhile: no attempt will ever hold it."""

    lease: Any


@dataclass(frozen=True, slots=True)
class AwaitFence:
    """The next attempt waits until `attempt_id` is fenced (its `FenceProven` arrives here); feed
    `FenceWaitOver` if that has not happened after `seconds`."""

    attempt_id: str
    seconds: float


@dataclass(frozen=True, slots=True)
class SupersedeAttempt:
    """Envoy started the next attempt while this one was live: feed it `Superseded`, with whether its
    replica showed a sign of running on (`liveness_uncertain`)."""

    attempt_id: str


@dataclass(frozen=True, slots=True)
class ReleaseLease:
    """Stop honouring the attempt's lease now and revoke it. `proof` (the closed connection) fences it:
    answer `FenceProven` once etcd confirmed. Without a proof nothing is answered (no retry follows)."""

    attempt_id: str
    proof: str | None


@dataclass(frozen=True, slots=True)
class FenceAttempt:
    """Revoke the attempt's lease and wait for the proof it stopped; answer `FenceProven`/`FenceUnprovable`.
    `connection_only`: no replica side can honour a lease (static replica): the closed connection is the
    proof. `accept_cancel_ack`: the replica side's cancel ack proves it (else only the lease's expiry)."""

    attempt_id: str
    accept_cancel_ack: bool
    connection_only: bool


@dataclass(frozen=True, slots=True)
class WriteAheadJournal:
    """Make the request's state (its first delta) durable; answer `WriteAheadDone` with whether the
    attempt's lease is still honoured."""

    attempt_id: str


@dataclass(frozen=True, slots=True)
class PlaceRetry:
    """Find where a retry of this failed attempt could land; answer `RetryPlaced`."""

    attempt_id: str


@dataclass(frozen=True, slots=True)
class WatchPublisher:
    """From here the client filter answers for this attempt: watch its replica's liveness and progress."""

    attempt_id: str


Decision = (
    ContinueRequest
    | RejectRequest
    | PassResponse
    | ReplaceResponse
    | WithholdResponse
    | Forward
    | Terminate
    | FailNow
    | ForwardAttempt
    | RefuseAttempt
    | AnswerAttempt
    | ReleaseAttempt
    | StartClaim
    | StartDeadline
    | GrantLease
    | DiscardLease
    | AwaitFence
    | SupersedeAttempt
    | ReleaseLease
    | FenceAttempt
    | WriteAheadJournal
    | PlaceRetry
    | WatchPublisher
)

_PUBLISHER_LOST = {
    "heartbeat_lapsed": "the replica's heartbeat lapsed after the first delta; its attempt was fenced",
    "health_check_failed": "the replica stopped answering its health check after the first delta",
    "progress_gap": "the replica's bytes stopped arriving after the first delta; its attempt was fenced",
    "lease_lost": "the attempt's lease could not be kept after the first delta: it lost its right to publish",
}


@dataclass(slots=True)
class _Response:
    """The response towards the client, as the client filter has read it."""

    status: int | None = None  # None: no response headers yet
    streaming: bool = False
    scanner: SseScanner = field(default_factory=SseScanner)
    usage_tail: UsageTail = field(default_factory=UsageTail)
    abort_scan: AbortScan = field(default_factory=AbortScan)
    done_seen: bool = False
    finished: bool = False  # a completing finish_reason was forwarded
    content_events: int = 0
    usage_tokens: int | None = None
    ended: bool = False  # nothing more of the response goes to the client
    # Our end_of_stream went out: nothing more is answered at all (a second end makes Envoy cut the client's
    # stream when another full-duplex filter is in front, docs/envoy-facts.md).
    end_sent: bool = False
    # (attempt number, why) of a publishing attempt found lost: before its first content passed here the
    # stream ends right after the chunk that brings it (a later attempt is not concerned).
    publisher_lost: tuple[int, str] | None = None
    finish_reason: str | None = None  # the last one forwarded (the journal and spans report it)


@dataclass(slots=True)
class _Attempts:
    """What the retry gate knows beyond the attempts themselves: who waits for what."""

    arrivals: list[AttemptArrived] = field(default_factory=list)  # wait to be admitted, in order
    granting: AttemptArrived | None = None  # admitted; its lease is being granted
    gone_while_granting: set[str] = field(default_factory=set)
    # Decisions of attempts that wait for the claim (a verdict, a write-ahead), in order.
    awaiting_claim: list[tuple[Attempt, a.Failed | a.WriteAhead]] = field(default_factory=list)
    awaiting_placement: dict[str, a.Failed] = field(default_factory=dict)  # by attempt id
    # Attempts whose stream ended before they were admitted, until Envoy's next move says their connection
    # died (then they are journaled, uncounted): (attempt id, replica).
    never_sent: list[tuple[str, str]] = field(default_factory=list)
    fence_waits: set[str] = field(default_factory=set)  # attempts a next one waits for (timer running)
    connection_only: set[str] = field(default_factory=set)  # attempts on replicas without a replica side
    lease_ttl: dict[str, int | None] = field(default_factory=dict)


class LogicalRequest:
    def __init__(
        self,
        *,
        request_id: str,
        tenant: str,
        parsed: ParsedRequest,
        policy: Policy,
        placement: Placement | None = None,
    ) -> None:
        self.request_id = request_id
        self.tenant = tenant
        self.parsed = parsed
        self.policy = policy
        self.dialect: Dialect = dialect_for(parsed.kind)  # how its API's stream reads and ends
        self.phase = Phase.PREFILL
        self.outcome: Outcome | None = None
        self.claim = ClaimState.PENDING
        self.client = ClientStream.RECEIVED
        self.model_revision: str | None = None
        self.fingerprint_digest: str | None = None  # the compatibility group every attempt is pinned to
        self.destinations: Destinations | None = None  # the replicas its attempts walk, in order
        self.tool_calls: dict[str, dict[str, Any]] = {}  # idempotency key → what happened, by which attempt
        self.tool_calls_dropped = 0  # beyond tools.max_calls_per_request: counted, not listed
        self.outbox: list[Event] = []
        self.attempts: list[Attempt] = []
        self.retry_blocked: str | None = None  # why no retry may ever start (None: within the budget)
        self.final: FailRequest | None = None  # the refusal that ended the request (every later attempt's)
        self.duplicate: DuplicateRun | None = None  # the claim's refusal
        self.envoy_attempts: int | None = None  # as Envoy counts them (a response attribute, its access log)
        # The gateway's memory of where attempts went (prefixes, overloads, each tenant's retries): told as
        # attempts start and fail, asked before a retry is given.
        self.placement = placement
        # The failed attempts the placement was told of: a verdict that waited for the claim is given again
        # once it settles, and must not count the same failure twice (a circuit opened by one failure).
        self._failures_told: set[str] = set()
        self.retries_given = 0
        # Attempts on a fallback model's replica: attempt id -> (model, the cause that allowed it).
        self._fallbacks: dict[str, tuple[str, str]] = {}
        self._fallback_granting: tuple[str, str] | None = None
        # (model, causes) once a fallback model's attempt delivered the first content.
        self.answered_by_fallback: tuple[str, tuple[str, ...]] | None = None
        self._waiting = _Attempts()
        self._headers_waiting: ResponseStarted | None = None
        if parsed.stateful is not None:
            # Another replica would answer from nothing (or 404): only the one that holds the state may.
            self._block(f"the request may only be served where its state is: {parsed.stateful}")
        cap = policy.reprefill_cost_cap.max_prompt_tokens
        if parsed.estimated_prompt_tokens > cap:
            self._block(
                f"the prompt (~{parsed.estimated_prompt_tokens} tokens) exceeds the re-prefill cost cap "
                f"({cap}), so it is not retried"
            )
        self._response = _Response(
            scanner=SseScanner(max_event_bytes=policy.limits.max_event_bytes, classify=self.dialect.classify),
            usage_tail=UsageTail(key=self.dialect.usage_key),
        )
        self._notes = self.dialect.notes()  # what our terminal event continues (the Responses API's id)
        self._emit(
            EventName.REQUEST_ACCEPTED,
            route=parsed.kind.value,
            model=parsed.model,
            stream=parsed.stream,
            seed=parsed.seed,
            input_digest=parsed.input_digest,
            estimated_prompt_tokens=parsed.estimated_prompt_tokens,
            retry_allowed=self.retry_blocked is None,
        )
        if placement is not None:
            placement.admitted(self)

    # --- derived facts ---------------------------------------------------------------------------------

    @property
    def max_attempts(self) -> int:
        return self.policy.before_first_delta.max_attempts if self.retry_blocked is None else 1

    @property
    def counted(self) -> int:
        """The attempts a replica may have seen (of its own model and of fallback models)."""
        return sum(1 for x in self.attempts if x.state is not AttemptState.NEVER_SENT)

    @property
    def own_counted(self) -> int:
        """The attempts that count against max_attempts: those of its own model a replica may have seen."""
        return sum(
            1
            for x in self.attempts
            if x.state is not AttemptState.NEVER_SENT and x.attempt_id not in self._fallbacks
        )

    @property
    def first_delta_sent(self) -> bool:
        """The write-ahead fact: content of an attempt may have reached the client (so no retry, ever).
        False again if Envoy retried after all: the release never reached its router."""
        return self._response.content_events > 0 or any(a.first_delta for a in self.attempts)

    @property
    def content_passed(self) -> bool:
        """Content of the response, or its end, has passed the client filter: the earliest a client may be
        shown the response's headers (a non-stream answer is its content)."""
        response = self._response
        return (
            response.content_events > 0
            or response.done_seen
            or response.finished
            or response.ended
            or not response.streaming
        )

    @property
    def publisher(self) -> Attempt | None:
        """The attempt whose bytes go to the client (released at its first delta), if any."""
        last = self.attempts[-1] if self.attempts else None
        return last if last is not None and last.state is AttemptState.RELEASED else None

    @property
    def stored_response(self) -> tuple[str, str] | None:
        """(response id, replica): the Responses API response the client got, stored by the replica that
        made it (`store` not false). Follow-ups naming it go there only (docs/design.md#stored-responses)."""
        notes, publisher = self._notes, self.publisher
        if notes is None or notes.response_id is None or publisher is None or not self.parsed.stores_response:
            return None
        return notes.response_id, publisher.replica

    @property
    def finish_reason(self) -> str | None:
        """The finish_reason of the last event forwarded that had one (None: no such event went out)."""
        return self._response.finish_reason

    @property
    def retry_budget(self) -> int:
        """Retries still allowed (the article's `retry_budget`)."""
        if self.phase is not Phase.PREFILL or self.final is not None:
            return 0
        return max(0, self.max_attempts - self.own_counted)

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

    def attempt(self, attempt_id: str) -> Attempt | None:
        return next((x for x in self.attempts if x.attempt_id == attempt_id), None)

    def holds_stream(self, attempt_id: str) -> bool:
        """Whether the attempt's stream must read nothing more until its reply is written: its first delta
        is being written ahead (after the claim), and the chunks held until then are what the release lets
        go. (Envoy then holds what the replica sends next, and the replica is held back.)"""
        attempt = self.attempt(attempt_id)
        return attempt is not None and attempt.state is AttemptState.WRITING_AHEAD

    def attempt_number(self, attempt_id: str | None) -> int | None:
        found = self.attempt(attempt_id) if attempt_id else None
        return found.number if found is not None else None

    # --- the one verb ----------------------------------------------------------------------------------

    def handle(self, event: Input) -> list[Decision]:
        if type(event) is ResponseChunk:  # first: every chunk of every stream comes this way
            return self._chunk(event)
        handler = _HANDLERS.get(type(event))
        if handler is None:
            raise IllegalInput(f"request {self.request_id}: unknown input {type(event).__name__}")
        decisions: list[Decision] = handler(self, event)
        if self._waiting.arrivals:  # whatever changed may let a waiting attempt through (or refuse it)
            decisions += self._admit_waiting()
        return decisions

    # --- admission and the claim -----------------------------------------------------------------------

    def _admitted(self, e: Admitted) -> list[Decision]:
        if self.client is not ClientStream.RECEIVED:
            raise IllegalInput(f"request {self.request_id}: admitted twice")
        self.destinations = e.destinations
        before = self.policy.journal.claim_before_forwarding
        # Claimed before forwarding, the claim runs inside Envoy's admission timeout: no patience then.
        decisions: list[Decision] = [StartClaim(patient=not before)]
        if before:
            self.client = ClientStream.ADMITTING
            return decisions  # the request body's reply waits for the claim
        return [*decisions, *self._forward()]

    def _forward(self) -> list[Decision]:
        self.client = ClientStream.FORWARDED
        return [StartDeadline(self.policy.deadlines.request_seconds), ContinueRequest()]

    def _claim_settled(self, e: ClaimSettled) -> list[Decision]:
        if self.claim is not ClaimState.PENDING:
            raise IllegalInput(f"request {self.request_id}: claim settled twice")
        if e.outcome is ClaimOutcome.REFUSED:
            assert e.duplicate is not None
            self.claim, self.duplicate = ClaimState.REFUSED, e.duplicate
            self._block("the request id belongs to another run")
            return self._refused_by_claim(e.duplicate)
        if e.outcome is ClaimOutcome.UNAVAILABLE:
            # Degraded mode: served, but without a durable journal no retry can be proven safe.
            self.claim = ClaimState.UNAVAILABLE
            self._block(e.why or "the request journal (etcd) is unreachable, so no retry can be proven safe")
        else:
            self.claim = ClaimState.HELD
        decisions: list[Decision] = []
        if self.client is ClientStream.ADMITTING and not self.is_terminal:
            decisions += self._forward()
        decisions += self._after_claim()
        waiting, self._headers_waiting = self._headers_waiting, None
        if waiting is not None:
            self.client = ClientStream.FORWARDED
            decisions += self._started(waiting)
        return decisions

    def _refused_by_claim(self, duplicate: DuplicateRun) -> list[Decision]:
        """The id is another run's: the client gets one 409, nothing of any attempt is released, and no
        attempt of this run starts (the journal writes nothing of it)."""
        decisions = self._after_claim()  # verdicts are given (retries blocked), write-aheads dropped
        client = self.client
        if not self.is_terminal:
            self.phase = Phase.REJECTED
        if client is ClientStream.ADMITTING:
            self.client = ClientStream.REJECTED
            decisions.append(RejectRequest(duplicate))
        elif client is ClientStream.FORWARDED:
            self.client = ClientStream.ANSWERED
            decisions.append(FailNow(duplicate))
        elif client is ClientStream.HEADERS_WAITING:
            self._headers_waiting = None
            self.client = ClientStream.REPLACED
            decisions.append(ReplaceResponse(duplicate))
        return decisions

    def _after_claim(self) -> list[Decision]:
        """What waited for the claim: failed attempts' verdicts and write-aheads."""
        waiting, self._waiting.awaiting_claim = self._waiting.awaiting_claim, []
        decisions: list[Decision] = []
        for attempt, decision in waiting:
            decisions += self._route(attempt, [decision])
        return decisions

    # --- attempts: the retry gate ----------------------------------------------------------------------

    def _arrived(self, e: AttemptArrived) -> list[Decision]:
        w = self._waiting
        if e.envoy_attempt is not None:
            # Envoy numbers its attempts: one whose stream ended before its first message was read (a refused
            # connect) shows up as a gap.
            seen = len(self.attempts) + len(w.never_sent) + len(w.arrivals) + (w.granting is not None)
            w.never_sent += [(f"{e.attempt_id}~{n}", "unknown") for n in range(e.envoy_attempt - 1 - seen)]
        self._confirm_never_sent()  # Envoy moved on: those noted before this one died at their connection
        if self.claim is ClaimState.REFUSED:
            assert self.duplicate is not None
            return [RefuseAttempt(e.attempt_id, self.duplicate)]
        w.arrivals.append(e)
        return []  # handle() admits it if it can

    def _confirm_never_sent(self) -> None:
        """Journal the noted attempts whose stream ended before their request was let go: not counted."""
        noted, self._waiting.never_sent = self._waiting.never_sent, []
        for attempt_id, replica in noted:
            attempt = self._new_attempt(attempt_id, replica, leased=False)
            attempt.handle(a.NeverSent())  # no decisions: no stream, no lease, no verdict
            if self.placement is not None and replica != "unknown":
                self.placement.unreachable(replica)

    def _admit_waiting(self) -> list[Decision]:
        """Admit, hold or refuse the attempts Envoy started, in order. A retry needs the claim settled, the
        previous attempt fenced (and its verdict given), budget left, and retries not blocked."""
        w = self._waiting
        decisions: list[Decision] = []
        while w.arrivals and w.granting is None:
            arrival = w.arrivals[0]
            # The last attempt a replica may have seen (one that never left Envoy may have come after it).
            previous = next(
                (x for x in reversed(self.attempts) if x.state is not AttemptState.NEVER_SENT), None
            )
            if self.claim is ClaimState.REFUSED:
                assert self.duplicate is not None
                w.arrivals.pop(0)
                decisions.append(RefuseAttempt(arrival.attempt_id, self.duplicate))
                continue
            if self.final is not None or self.phase is not Phase.PREFILL:
                # The request ended, or content was delivered: no other attempt may ever start.
                w.arrivals.pop(0)
                decisions.append(RefuseAttempt(arrival.attempt_id, self.final or self._over()))
                continue
            if previous is not None:
                if self.claim is ClaimState.PENDING:
                    break  # no retry before the claim is settled (etcd away: none can be proven safe)
                if previous.state in (*_LIVE, AttemptState.RELEASED):
                    # Envoy started the next attempt before this one's end reached us: it is over.
                    decisions.append(SupersedeAttempt(previous.attempt_id))
                    break
                if previous.state is AttemptState.FAILED and (
                    previous.attempt_id in w.awaiting_placement
                    or any(x is previous for x, _ in w.awaiting_claim)
                ):
                    break  # its verdict is on its way
            unfenced = next(
                (
                    x
                    for x in reversed(self.attempts)
                    if not x.fenced and x.state is not AttemptState.PASSED_THROUGH
                ),
                None,
            )
            if unfenced is not None:
                # Fenced first, even behind an attempt that never left Envoy.
                if unfenced.attempt_id not in w.fence_waits:
                    w.fence_waits.add(unfenced.attempt_id)
                    ttl = w.lease_ttl.get(unfenced.attempt_id) or 0
                    decisions.append(AwaitFence(unfenced.attempt_id, ttl + FENCE_WAIT_SLACK_SECONDS))
                break
            destinations = self.destinations
            if (
                destinations is not None
                and destinations.source == HOLDER
                and arrival.replica not in destinations.order
            ):
                # Envoy's fallback, once the holder's connection failed: any other replica would answer from
                # nothing (a 404 for the response it continues).
                w.arrivals.pop(0)
                why = "could not be reached (its connection failed before the request was sent)"
                refusal = holder_unavailable(self.parsed.previous_response_id, destinations.order[0], why)
                decisions.append(RefuseAttempt(arrival.attempt_id, self._end_with(refusal)))
                continue
            model = destinations.fallback_model(arrival.replica) if destinations is not None else None
            if model is not None:
                cause = self._fallback_cause()
                if self._fallback_refusal(cause) is not None:
                    w.arrivals.pop(0)
                    refusal = self._end_with(self._exhausted(previous))
                    decisions.append(RefuseAttempt(arrival.attempt_id, refusal))
                    continue
                self._fallback_granting = (model, cause)
                w.granting = w.arrivals.pop(0)
                decisions.append(GrantLease(arrival.attempt_id, arrival.replica))
                continue
            if self.own_counted >= self.max_attempts:
                w.arrivals.pop(0)
                decisions.append(RefuseAttempt(arrival.attempt_id, self._end_with(self._exhausted(previous))))
                continue
            w.granting = w.arrivals.pop(0)
            decisions.append(GrantLease(arrival.attempt_id, arrival.replica))
        return decisions

    def _over(self) -> FailRequest:
        """The refusal of an attempt that arrives after the first delta or the request's end."""
        outcome = self.outcome or Outcome.UPSTREAM_DECODE_INTERRUPTED
        why = "content was delivered" if self.phase is Phase.DECODE else f"the request has ended ({outcome})"
        return FailRequest(503, outcome, f"{why}: no other attempt may start")

    def _lease_granted(self, e: LeaseGranted) -> list[Decision]:
        w = self._waiting
        if w.granting is None or w.granting.attempt_id != e.attempt_id:
            raise IllegalInput(
                f"request {self.request_id}: a lease for {e.attempt_id}, which was not admitted"
            )
        arrival, w.granting = w.granting, None
        if e.attempt_id in w.gone_while_granting:
            w.gone_while_granting.discard(e.attempt_id)
            return [DiscardLease(e.lease)]  # its stream went meanwhile: no attempt on record
        fallback, self._fallback_granting = self._fallback_granting, None
        if fallback is not None:
            self._fallbacks[e.attempt_id] = fallback
        attempt = self._new_attempt(e.attempt_id, arrival.replica)
        attempt.lease = e.lease
        if self.placement is not None:
            self.placement.attempt_sent(arrival.replica, self.parsed.prefix_blocks)
        w.lease_ttl[e.attempt_id] = e.ttl_seconds
        if not e.replica_side:
            w.connection_only.add(e.attempt_id)
        return [ForwardAttempt(e.attempt_id, fallback[0] if fallback is not None else None)]

    def _new_attempt(self, attempt_id: str, replica: str, *, leased: bool = True) -> Attempt:
        limits = self.policy.limits
        attempt = Attempt(
            attempt_id=attempt_id,
            number=len(self.attempts) + 1,
            replica=replica,
            outbox=self.outbox,
            max_held_bytes=limits.max_held_response_bytes,
            max_event_bytes=limits.max_event_bytes,
            classify=self.dialect.classify,
            leased=leased,
            chosen_by=self.destinations.why(replica) if self.destinations is not None else None,
        )
        self.attempts.append(attempt)
        why = {"reason": attempt.chosen_by} if attempt.chosen_by else {}
        self._emit(EventName.ATTEMPT_STARTED, attempt.number, attempt_id=attempt_id, replica=replica, **why)
        return attempt

    def _arrival_gone(self, e: ArrivalGone) -> list[Decision]:
        w = self._waiting
        gone = next((x for x in w.arrivals if x.attempt_id == e.attempt_id), None)
        if gone is not None:
            w.arrivals.remove(gone)
        elif w.granting is not None and w.granting.attempt_id == e.attempt_id:
            gone = w.granting
            w.gone_while_granting.add(e.attempt_id)
        if gone is not None and self.final is None and not self.is_terminal:
            w.never_sent.append((gone.attempt_id, gone.replica))  # journaled if Envoy moves on
        return []

    def _for_attempt(self, e: ForAttempt) -> list[Decision]:
        attempt = self.attempt(e.attempt_id)
        if attempt is None:
            raise IllegalInput(f"request {self.request_id}: no attempt {e.attempt_id}")
        return self._route(attempt, attempt.handle(e.input))

    def _retry_placed(self, e: RetryPlaced) -> list[Decision]:
        failed = self._waiting.awaiting_placement.pop(e.attempt_id, None)
        attempt = self.attempt(e.attempt_id)
        if failed is None or attempt is None:
            raise IllegalInput(f"request {self.request_id}: no retry of {e.attempt_id} is being placed")
        if self.final is not None or self.is_terminal:
            return self._route(attempt, [failed])  # the request ended meanwhile
        if e.no_compatible_replica is not None and self._fallback_next("no_compatible_replica"):
            verdict: TriggerRetry | FailRequest = self._retry(attempt, failed)
        elif e.no_compatible_replica is not None:
            verdict = self._end_with(
                FailRequest(
                    503,
                    Outcome.NO_COMPATIBLE_REPLICA,
                    f"no compatible replica is left to retry on: {e.no_compatible_replica}",
                    detail=e.no_compatible_replica,
                )
            )
        else:
            verdict = self._retry(attempt, failed)
        return self._give(attempt, verdict)

    def _fence_wait_over(self, e: FenceWaitOver) -> list[Decision]:
        if e.attempt_id not in self._waiting.fence_waits:
            return []  # no attempt waited for this one (any more)
        self._waiting.fence_waits.discard(e.attempt_id)
        attempt = self.attempt(e.attempt_id)
        if attempt is not None and not attempt.fenced and attempt.state is not AttemptState.PASSED_THROUGH:
            self._end_with(
                FailRequest(
                    503,
                    Outcome.FENCE_UNPROVABLE,
                    f"attempt {attempt.number} was never proven fenced, so no other attempt may start",
                )
            )
        return []

    def _route(self, attempt: Attempt, decisions: list[a.Decision]) -> list[Decision]:
        """Carry an attempt's decisions on: give verdicts, hold what waits for the claim, address the rest."""
        out: list[Decision] = []
        for d in decisions:
            if isinstance(d, a.Failed):
                out += self._verdict(attempt, d)
            elif isinstance(d, a.WriteAhead):
                if attempt.state is not AttemptState.WRITING_AHEAD:
                    continue  # it failed (reset, fenced) while the claim was settled: nothing to write
                if self.claim is ClaimState.PENDING:
                    self._waiting.awaiting_claim.append((attempt, d))
                elif self.claim is not ClaimState.REFUSED:  # nothing of a refused run is released
                    out.append(WriteAheadJournal(attempt.attempt_id))
            elif isinstance(d, a.Release):
                if self.placement is not None:
                    self.placement.succeeded(attempt.replica)
                if attempt.attempt_id in self._fallbacks and attempt.first_delta:
                    self._answered_by_fallback(attempt)
                out.append(ReleaseAttempt(attempt.attempt_id, d.held_chunks))
                if attempt.first_delta:
                    out.append(WatchPublisher(attempt.attempt_id))
            elif isinstance(d, a.Answer):
                if self.claim is not ClaimState.REFUSED:  # else the client filter answers the client (409)
                    out.append(AnswerAttempt(attempt.attempt_id, d.verdict, d.held_chunks))
            elif isinstance(d, a.SettleLease):
                out.append(ReleaseLease(attempt.attempt_id, d.proof))
            else:
                assert isinstance(d, a.StartFence)
                out.append(
                    FenceAttempt(
                        attempt.attempt_id,
                        accept_cancel_ack=self.policy.uncertain_source_liveness.wait_for
                        == "cancel_ack_or_lease_expiry",
                        connection_only=attempt.attempt_id in self._waiting.connection_only,
                    )
                )
        return out

    def _verdict(self, attempt: Attempt, failed: a.Failed) -> list[Decision]:
        """The fate of a failed attempt: another attempt, or one error for the client."""
        if self.placement is not None and attempt.attempt_id not in self._failures_told:
            self._failures_told.add(attempt.attempt_id)
            if attempt.status is not None:
                self.placement.answered(attempt.replica, attempt.status, attempt.retry_after)
            if failed.reason in a.REJECTIONS:
                self.placement.succeeded(attempt.replica)  # it answered: the request is what failed
            elif self.phase is Phase.PREFILL and failed.reason is not a.FailureReason.LEASE_LOST:
                self.placement.failed_before_content(attempt.replica)  # (a lost lease is etcd's failure)
        verdict: TriggerRetry | FailRequest
        if self.final is not None:
            verdict = self.final
        elif self.phase is not Phase.PREFILL:
            return []  # content was delivered, or the client is gone: no verdict, its lease settles
        elif self.claim is ClaimState.PENDING:
            self._waiting.awaiting_claim.append((attempt, failed))
            return []
        elif not failed.fence_proven:
            verdict = self._end_with(
                FailRequest(
                    503,
                    Outcome.FENCE_UNPROVABLE,
                    "the failed attempt may still be running and its fence cannot be proven "
                    "(etcd unreachable)",
                )
            )
        elif failed.reason in UNCERTAIN_FAILURES and self.policy.uncertain_source_liveness.then == FAIL:
            verdict = self._end_with(
                FailRequest(
                    502,
                    Outcome.RETRY_NOT_ALLOWED,
                    f"the replica's liveness was uncertain ({failed.reason.value}); the attempt was fenced "
                    "and the policy (uncertain_source_liveness.then: fail_request) allows no retry",
                )
            )
        elif failed.reason in a.REJECTIONS:
            verdict = self._end_with(self._rejected(attempt, failed.reason))
        elif attempt.attempt_id not in self._fallbacks and self.own_counted < self.max_attempts:
            if self.fingerprint_digest is not None:
                # Pinned to a compatibility group: a retry needs a compatible replica to land on.
                self._waiting.awaiting_placement[attempt.attempt_id] = failed
                return [PlaceRetry(attempt.attempt_id)]
            verdict = self._retry(attempt, failed)
        elif self._fallback_next(self._fallback_cause()):
            verdict = self._retry(attempt, failed)  # Envoy's next entry is a fallback model's replica
        else:
            verdict = self._end_with(self._exhausted(attempt))
        return self._give(attempt, verdict)

    # --- fallback (docs/design.md#fallback) ------------------------------------------------------------

    def _fallback_cause(self) -> str:
        """What the request's own model came to: the cause a fallback needs (policy fallback.causes)."""
        own = [x for x in self.attempts if x.attempt_id not in self._fallbacks and x.failure is not None]
        counted = [x for x in own if x.state is not AttemptState.NEVER_SENT]
        if not counted:  # no attempt of its own model reached a replica
            destinations = self.destinations
            return (destinations.fallback_cause if destinations is not None else "") or "unavailable"
        return "overloaded" if counted[-1].failure is a.FailureReason.OVERLOADED else "failed_before_content"

    def _fallback_refusal(self, cause: str) -> str | None:
        """Why no fallback model may answer now (None: one may). Never after the first delta (no attempt at
        all may start then), never for a request whose state or tools bind it to its own model."""
        fallback = self.policy.fallback
        if self.retry_blocked is not None:
            return self.retry_blocked
        if self.tool_calls:
            return "the request's tool calls went through the gateway: another model would act again"
        if cause not in fallback.causes:
            return f"fallback.causes does not allow a fallback when {cause}"
        if len(self._fallbacks) >= fallback.max_attempts:
            return f"its fallback attempts are used up (fallback.max_attempts {fallback.max_attempts})"
        return None

    def _fallback_next(self, cause: str) -> bool:
        """Whether the order's next entries hold a fallback model's replica, and one may answer now."""
        destinations = self.destinations
        if destinations is None or len(self._fallbacks) >= len(destinations.fallback):
            return False
        return self._fallback_refusal(cause) is None

    def _answered_by_fallback(self, attempt: Attempt) -> None:
        model, cause = self._fallbacks[attempt.attempt_id]
        causes = tuple(
            f"attempt {x.number} on {x.replica}: {x.failure.value}"
            for x in self.attempts
            if x.failure is not None and x.attempt_id not in self._fallbacks
        ) or (cause,)
        self.answered_by_fallback = (model, causes)
        self._emit(
            EventName.ANSWERED_BY_FALLBACK,
            attempt.number,
            model=model,
            requested_model=self.parsed.model,
            reason=cause,
            detail="; ".join(causes),
        )

    def _give(self, attempt: Attempt, verdict: TriggerRetry | FailRequest) -> list[Decision]:
        """The verdict to its attempt. An error the attempt cannot carry (its stream is gone) goes to the
        client at once, while no response has reached it (Envoy would otherwise try again, to be refused)."""
        decisions = self._route(attempt, attempt.handle(a.VerdictReady(verdict)))
        if (
            isinstance(verdict, FailRequest)
            and attempt.reply is a.Reply.STREAM_GONE
            and self.client is ClientStream.FORWARDED
            and self.claim is not ClaimState.REFUSED
        ):
            self.client = ClientStream.ANSWERED
            decisions.append(FailNow(verdict))
        return decisions

    def _retry(self, attempt: Attempt, failed: a.Failed) -> TriggerRetry | FailRequest:
        refusal = self.placement.retry_refusal(self) if self.placement is not None else None
        if refusal is not None:
            return self._end_with(
                FailRequest(
                    503,
                    Outcome.RETRY_BUDGET_EXHAUSTED,
                    f"attempt {attempt.number} failed before any content and the tenant's retry budget "
                    f"refused the retry ({refusal.removeprefix('tenant budget: ')})",
                    detail=refusal,
                )
            )
        self.retries_given += 1
        self._emit(EventName.RETRY_TRIGGERED, attempt.number, reason=failed.reason.value)
        return TriggerRetry(failed.reason.value)

    def _block(self, reason: str) -> None:
        self.retry_blocked = self.retry_blocked or reason

    def _end_with(self, verdict: FailRequest) -> FailRequest:
        """Refuse every further attempt with `verdict` and end the logical request with it."""
        if self.final is None:
            self.final = verdict
            detail = {"detail": verdict.detail} if verdict.detail else {}
            self._emit(EventName.RETRY_REFUSED, len(self.attempts) or None, reason=verdict.code, **detail)
            self._finish(Phase.FAILED, Outcome(verdict.code))
        return self.final

    def _rejected(self, attempt: Attempt, reason: a.FailureReason) -> FailRequest:
        """The replica refused the request itself: its status and reason, in the API's error shape. Another
        replica of the model would refuse it the same way, so it is not resent (docs/design.md#rejections)."""
        rejection = attempt.reader.rejection
        assert rejection is not None
        outcome = (
            Outcome.CONTEXT_LENGTH_EXCEEDED
            if reason is a.FailureReason.CONTEXT_LENGTH_EXCEEDED
            else Outcome.REJECTED_BY_REPLICA
        )
        return FailRequest(
            rejection.status,
            outcome,
            f"the replica rejected the request ({rejection.status}): {rejection.message}",
            detail=f"attempt {attempt.number} on {attempt.replica}: sent again it would be rejected again",
            retryable=False,
            param=rejection.param,
        )

    def _exhausted(self, last: Attempt | None) -> FailRequest:
        if self.retry_blocked is not None:
            return FailRequest(502, Outcome.RETRY_NOT_ALLOWED, self.retry_blocked)
        if last is not None and last.failure is a.FailureReason.OVERLOADED:
            overloaded = sum(1 for x in self.attempts if x.failure is a.FailureReason.OVERLOADED)
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

    # --- response headers ------------------------------------------------------------------------------

    def _response_started(self, e: ResponseStarted) -> list[Decision]:
        if self.client is ClientStream.ANSWERED:
            return [WithholdResponse()]  # the refusal or the deadline's error went out already
        if self.client is not ClientStream.FORWARDED:
            raise IllegalInput(f"request {self.request_id}: response headers while {self.client.value}")
        if self.claim is ClaimState.PENDING:
            # Nothing reaches the client before the claim is settled: these headers wait for it.
            self.client, self._headers_waiting = ClientStream.HEADERS_WAITING, e
            return []
        return self._started(e)

    def _started(self, e: ResponseStarted) -> list[Decision]:
        r = self._response
        r.status = e.status
        # Envoy answered: an attempt whose stream ended before its request was let go had lost its connection.
        self._confirm_never_sent()
        self._note_envoy_attempts(e.envoy_attempts)
        last = self.attempts[-1] if self.attempts else None
        released = last is not None and last.state in (AttemptState.RELEASED, AttemptState.PASSED_THROUGH)
        from_replica = e.details in ("via_upstream", "")  # "": Envoy did not say; trust the release
        superseded: list[a.Decision] = []
        if (
            not from_replica
            and last is not None
            and last.state in (AttemptState.RELEASED, AttemptState.WRITING_AHEAD)
        ):
            # We released it (or were about to), but the replica reset before the release reached Envoy's
            # router, which then answered itself: nothing of that attempt reached the client, and a
            # write-ahead finishing now must not release it (first_delta_sent stays false).
            superseded = last.handle(a.Superseded())
            released = False
        decisions: list[Decision]
        if self.is_terminal and self.final is not None and not from_replica:
            # Refused already: whatever answer this is (ours from the upstream filter, or Envoy's after a
            # reset it retried or not), the client gets the request's own error.
            self.client = ClientStream.REPLACED
            decisions = [ReplaceResponse(self.final)]
        elif self.is_terminal or released:
            # Ours to pass: the released attempt's answer.
            self.client = ClientStream.PASSED
            r.streaming = e.status < 300 and is_event_stream(e.content_type)
            if not r.streaming and e.status < 300 and self.phase is Phase.PREFILL:
                self.phase = Phase.DECODE  # a non-stream answer is delivered whole, as one delta
            decisions = [PassResponse()]
        else:
            # Headers that no released attempt sent: a retry Envoy did not make (our 503 came back), or
            # Envoy's own answer (no host, connect failure, deadline). Their body must not reach the client.
            self.client = ClientStream.REPLACED
            self._emit(
                EventName.RESPONSE_REPLACED,
                len(self.attempts) or None,
                status=e.status,
                response_flags=sorted(e.flags),
                details=e.details,
            )
            decisions = [ReplaceResponse(self._end_with(self._envoy_verdict(e)))]
        if last is not None and superseded:
            decisions += self._route(last, superseded)  # its lease settles; the request answered already
        return decisions

    def _envoy_verdict(self, e: ResponseStarted) -> FailRequest:
        attempts = len(self.attempts)
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
                    detail=e.no_compatible_replica,
                )
            return FailRequest(503, Outcome.NO_REPLICA_AVAILABLE, f"no healthy replica was available {said}")
        if attempts == 0 and not self.envoy_attempts:
            return FailRequest(503, Outcome.NO_REPLICA_AVAILABLE, f"no replica could be reached {said}")
        told = self._attempts_told(e.flags)
        destinations = self.destinations
        if self.counted == 0 and destinations is not None and destinations.source == HOLDER:
            return holder_unavailable(
                self.parsed.previous_response_id,
                destinations.order[0],
                f"could not be reached: {told} {said}",
            )
        if self.counted == 0:
            # Every attempt died at its connection (refused, or closed before its request was sent).
            return FailRequest(
                503, Outcome.NO_REPLICA_AVAILABLE, f"no replica could be reached: {told} {said}"
            )
        return FailRequest(502, Outcome.RETRIES_EXHAUSTED, f"{told} {said}")

    def _attempts_told(self, flags: frozenset[str]) -> str:
        """How many attempts ran and how each ended, as the journal lists them and as Envoy counted them."""
        listed = self.attempts
        made = max(self.envoy_attempts or 0, len(listed))
        ended = ", ".join(f"{x.number}: {x.failure.value if x.failure else x.state.value}" for x in listed)
        told = f"Envoy made {made} attempt(s), none delivered content"
        if listed:
            told += f" ({ended})"
        unseen = made - len(listed)
        if unseen:
            told += f"; {unseen} ended before the gateway saw it (its connection died before it was sent)"
        if "URX" in flags and self.counted < self.max_attempts:
            told += (
                f"; {self.counted} reached a replica, fewer than max_attempts ({self.max_attempts}): Envoy's "
                "retry limit was used up by attempts that died at their connection"
            )
        elif "URX" not in flags:
            told += "; Envoy made no further attempt"
        return told

    def _note_envoy_attempts(self, count: int | None) -> None:
        """Envoy's own count of the attempts it made (it can only grow)."""
        if count is not None and count > (self.envoy_attempts or 0):
            self.envoy_attempts = count

    # --- response body ---------------------------------------------------------------------------------

    def _chunk(self, e: ResponseChunk) -> list[Decision]:
        r = self._response
        if self.client is not ClientStream.PASSED:
            return []  # replaced by our error, or answered already: nothing of it goes to the client
        if r.ended:
            if r.end_sent:
                return []
            # Ended at its [DONE]: nothing more is forwarded, and the one end goes with the stream's own end
            # (or its trailers), which Envoy still has to pass.
            r.end_sent = e.end_of_stream
            return [Forward(b"", e.end_of_stream)]
        if not r.streaming:
            return [self._non_stream_chunk(e)]
        whole = r.scanner.pending_size == 0  # nothing carried over: the chunk may be forwarded as it is
        events = r.scanner.feed(e.chunk)
        if e.end_of_stream:
            events += r.scanner.close()  # a last event ended by a lone CR is complete now
        for index, event in enumerate(events):
            if event.kind is EventKind.DONE:
                # The end ([DONE], or the API's end event with its usage): nothing after it is forwarded.
                self._count(event)
                r.done_seen = r.ended = True
                r.end_sent = e.end_of_stream
                self._finish(Phase.COMPLETED, Outcome.COMPLETED)
                return [Forward(_join(events[: index + 1], e.chunk, whole), e.end_of_stream)]
            if self.phase is Phase.DECODE:
                if event.kind is EventKind.ERROR:
                    return [self._terminate(events[:index], "in-band error event after the first delta")]
                if event.kind is EventKind.MALFORMED:
                    # The client's parser would choke on it: it never goes out; the stream ends here.
                    why = "the replica sent an event that is not a JSON object after the first delta"
                    return [self._terminate(events[:index], why)]
                if event.finish_reason == "abort":
                    self._count(event)
                    return [self._terminate(events[: index + 1], "finish_reason abort after the first delta")]
            self._count(event)
        lost = r.publisher_lost
        if lost is not None and self.phase is Phase.DECODE and self._noted_publisher(lost[0]):
            return [self._terminate(events, lost[1])]
        if r.scanner.oversized:
            limit = self.policy.limits.max_event_bytes
            return [
                self._terminate(
                    events, f"the replica sent an SSE event over limits.max_event_bytes ({limit})"
                )
            ]
        if e.end_of_stream:
            if r.finished:
                # Every content event and the finish were forwarded; only [DONE] was missing: complete.
                # (Only an API whose end is a marker gets here: the others' finish is their end event.)
                assert self.dialect.end_marker is not None
                r.ended = r.end_sent = True
                self._finish(Phase.COMPLETED, Outcome.COMPLETED)
                return [Forward(b"".join(ev.raw for ev in events) + self.dialect.end_marker, True)]
            if self.phase is Phase.DECODE:
                return [self._terminate(events, f"upstream ended without {self.dialect.end_name}")]
            r.ended = r.end_sent = True
            self._finish(Phase.FAILED, Outcome.UPSTREAM_ERROR)
            return [Forward(_join(events, e.chunk, whole), True)]
        return [Forward(_join(events, e.chunk, whole), False)]

    def _non_stream_chunk(self, e: ResponseChunk) -> Forward:
        r = self._response
        ok = r.status is not None and r.status < 300
        if ok:
            r.usage_tail.feed(e.chunk)
            r.abort_scan.feed(e.chunk)
            if self._notes is not None:
                self._notes.see_body(e.chunk)
        if e.end_of_stream:
            r.ended = r.end_sent = True
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

    def _publisher_lost(self, e: PublisherLost) -> list[Decision]:
        r = self._response
        publisher = self.publisher
        if publisher is None:
            return []  # before any release the attempt's own machine answers for it
        decisions: list[Decision] = []
        noted = r.publisher_lost
        over = self.is_terminal or r.ended
        if noted is None or noted[0] != publisher.number:
            # No retry follows, so there is no proof to wait for: stop honouring its lease, revoke it now.
            decisions.append(ReleaseLease(publisher.attempt_id, None))
            if not over:
                self._emit(EventName.REPLICA_LOST, publisher.number, cause=e.cause)
            noted = r.publisher_lost = (publisher.number, _PUBLISHER_LOST.get(e.cause, e.cause))
        if over:
            return decisions
        if self.phase is Phase.PREFILL:
            # Released, but its first content has not passed here yet: it is on its way through Envoy (its
            # response headers may not even have reached this filter, so nothing can be written to the
            # client now). The stream ends right after the chunk that brings it.
            return decisions
        return [*decisions, self._terminate([], noted[1])]

    def _noted_publisher(self, number: int) -> bool:
        publisher = self.publisher
        return publisher is not None and publisher.number == number

    def _deadline(self, e: DeadlineReached) -> list[Decision]:
        if self.is_terminal or self._response.ended:
            return []
        seconds = self.policy.deadlines.request_seconds
        why = f"the gateway's request deadline (deadlines.request_seconds = {seconds:g} s) fired"
        if self._response.status is None:
            error = self._end_with(FailRequest(504, Outcome.DEADLINE_EXCEEDED, f"{why} before any content"))
            decisions: list[Decision] = [FailNow(error)]
            if self.client is ClientStream.HEADERS_WAITING:
                self._headers_waiting = None
                decisions.append(WithholdResponse())  # they waited for the claim: no reply to them now
            self.client = ClientStream.ANSWERED
            return decisions
        return [self._terminate([], why, outcome=Outcome.DEADLINE_EXCEEDED)]

    def _downstream_lost(self, e: DownstreamLost) -> list[Decision]:
        self._note_envoy_attempts(e.envoy_attempts)
        cause = e.cause
        if self.is_terminal:
            return []
        if self._response.done_seen:
            # The client already has the whole generation ([DONE] went out); it just closed first.
            self._finish(Phase.COMPLETED, Outcome.COMPLETED)
            return []
        delivered = self.delivered_output_tokens
        if cause is DownstreamLoss.CLIENT_GONE or (
            cause is DownstreamLoss.UNKNOWN and self.phase is Phase.PREFILL
        ):
            self._emit(EventName.CLIENT_DISCONNECTED, delivered_output_tokens=delivered)
            self._finish(Phase.CANCELLED, Outcome.CLIENT_DISCONNECTED)
            return []
        # Headers (and chunks) we passed may still have been replaced by Envoy's own answer: a reset right
        # after them, before Envoy had written them out. Then nothing we passed reached the client.
        replaced = e.client_status is not None and e.client_status != self._response.status
        # Or the client got our headers and not one byte of the body: the reset came between the two replies
        # that answer them (docs/design.md#the-two-filter-placements). What we forwarded never reached it.
        empty = e.client_body_bytes == 0 and cause is DownstreamLoss.UPSTREAM_RESET
        if replaced or empty or (self._response.status is None and self.phase is Phase.PREFILL):
            self._response.content_events, self._response.usage_tokens = 0, None
            delivered = 0
            # Nothing went out: Envoy answered the client itself (or nobody could) before any attempt's
            # headers reached it — e.g. a replica's protocol error while the release was on its way.
            last = self.attempts[-1] if self.attempts else None
            superseded: list[a.Decision] = []
            if last is not None and last.state in (AttemptState.RELEASED, AttemptState.WRITING_AHEAD):
                superseded = last.handle(a.Superseded())  # nothing of it reached the client
            self._emit(EventName.STREAM_RESET, cause=cause.value, delivered_output_tokens=delivered)
            failed = Outcome.ENVOY_EXITED if cause is DownstreamLoss.ENVOY_EXITED else Outcome.UPSTREAM_ERROR
            self._finish(Phase.FAILED, failed)
            return self._route(last, superseded) if last is not None else []
        # The stream had started (headers, maybe content): it was cut.
        self._emit(EventName.STREAM_RESET, cause=cause.value, delivered_output_tokens=delivered)
        outcome = {
            DownstreamLoss.DEADLINE: Outcome.DEADLINE_EXCEEDED,
            DownstreamLoss.ENVOY_EXITED: Outcome.ENVOY_EXITED,
        }.get(cause, Outcome.UPSTREAM_DECODE_INTERRUPTED)
        self._finish(Phase.INTERRUPTED, outcome)
        return []

    def _tool_call(self, e: ToolCallNoted) -> list[Decision]:
        entry = self.tool_calls.get(e.key)
        if entry is None:
            if len(self.tool_calls) >= self.policy.tools.max_calls_per_request:
                self.tool_calls_dropped += 1
                return []
            entry = self.tool_calls[e.key] = {"key": e.key, "events": []}
        if len(entry["events"]) < 16:  # one key sees a handful of calls; a flood is not journaled whole
            entry["events"].append({"event": e.name.value, "attempt": e.attempt, **e.detail})
        self._emit(e.name, e.attempt, key=e.key, **e.detail)
        return []

    # --- internals -------------------------------------------------------------------------------------

    def _count(self, event: SseEvent) -> None:
        r = self._response
        if self._notes is not None:
            self._notes.see(event)
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
        r.ended = r.end_sent = True
        self._emit(
            EventName.STREAM_TERMINATED, reason=why, delivered_output_tokens=self.delivered_output_tokens
        )
        self._finish(Phase.INTERRUPTED, outcome)
        frame = self.dialect.terminal_event(self._notes, self.request_id, self.delivered_output_tokens, why)
        return Terminate(b"".join(e.raw for e in delivered) + frame)

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


_LIVE = (AttemptState.AWAITING_HEADERS, AttemptState.HOLDING, AttemptState.WRITING_AHEAD)

# Which handler takes which input (ResponseChunk, the hot path, is dispatched before this table).
_HANDLERS: dict[type, Any] = {
    Admitted: LogicalRequest._admitted,
    ClaimSettled: LogicalRequest._claim_settled,
    AttemptArrived: LogicalRequest._arrived,
    LeaseGranted: LogicalRequest._lease_granted,
    ArrivalGone: LogicalRequest._arrival_gone,
    ForAttempt: LogicalRequest._for_attempt,
    RetryPlaced: LogicalRequest._retry_placed,
    FenceWaitOver: LogicalRequest._fence_wait_over,
    ResponseStarted: LogicalRequest._response_started,
    PublisherLost: LogicalRequest._publisher_lost,
    DeadlineReached: LogicalRequest._deadline,
    DownstreamLost: LogicalRequest._downstream_lost,
    ToolCallNoted: LogicalRequest._tool_call,
}


def _join(events: list[SseEvent], chunk: bytes, whole: bool) -> bytes:
    # Fast path: the chunk was exactly these whole events (the common case), forward it without copying.
    if whole and sum(len(e.raw) for e in events) == len(chunk):
        return chunk
    return b"".join(e.raw for e in events)
