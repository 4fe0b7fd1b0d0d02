"""The operator policy: short, strict, validated at start-up (docs/policy.md).

Unknown keys and impossible combinations are errors, not warnings: a typo in a safety policy
must stop the sidecar instead of silently running with a default. Every key is optional;
a missing key takes the value of :data:`DEFAULT_POLICY` (``policy.example.yaml`` shows them all).

The frozen dataclass tree below *is* the schema: a field's type says what is accepted (``int``,
``float``, ``bool``, ``Literal[...]``, ``frozenset[Literal[...]]``, ``tuple[str, ...]`` (an ordered list of
names), ``str | None``, or a nested section),
its :class:`KeySpec` metadata says the bounds and the doc. One generic walker reads a mapping against it;
the only hand-written rules are the cross-field checks in :data:`_CHECKS`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
import sys
import types
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, Final, Literal, Union, get_args, get_origin, get_type_hints

import yaml

__all__ = [
    "ADMISSION_MARGIN_SECONDS",
    "DEFAULT_POLICY",
    "ROUTE_POLICY_KEYS",
    "ROUTE_POLICY_METADATA",
    "BeforeFirstDelta",
    "Budgets",
    "CostCap",
    "Deadlines",
    "Fallback",
    "JournalPolicy",
    "KeySpec",
    "Leases",
    "Limits",
    "LivenessPolicy",
    "OnUpstreamFailure",
    "Placement",
    "Policy",
    "PolicyError",
    "PolicyKey",
    "RouteOverlay",
    "RoutePolicies",
    "TenancyPolicy",
    "ToolsPolicy",
    "UncertainLiveness",
    "UpstreamConnections",
    "load_policy",
    "load_route_policies",
    "policy_from_mapping",
    "policy_keys",
    "policy_to_mapping",
    "route_policy",
]

RETRY: Final = "retry_prefill_on_healthy_replica"
FAIL: Final = "fail_request"
FENCED: Final = "source_attempt_fenced"
BUDGET: Final = "retry_budget_available"
RETRY_IF_NO_DELTA: Final = "retry_only_if_no_delta_was_sent"

# Envoy's admission message timeout is this plus tools.in_progress_wait_seconds (the gateway renders it so):
# it must end before deadlines.request_seconds does.
ADMISSION_MARGIN_SECONDS: Final = 5

BeforeAction = Literal["retry_prefill_on_healthy_replica", "fail_request"]
Requirement = Literal["source_attempt_fenced", "retry_budget_available"]
FenceWait = Literal["cancel_ack_or_lease_expiry", "lease_expiry"]
FallbackCause = Literal["failed_before_content", "overloaded", "no_compatible_replica", "unavailable"]
UncertainThen = Literal["retry_only_if_no_delta_was_sent", "fail_request"]


class PolicyError(ValueError):
    """An invalid policy; ``path`` is the dotted key that is wrong ("" for the whole document)."""

    def __init__(self, path: str, message: str) -> None:
        super().__init__(f"policy: {path}: {message}" if path else f"policy: {message}")
        self.path = path
        self.message = message


# --- the schema vocabulary --------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class KeySpec:
    """What a policy key means and which values it takes beyond its type (read by the walker)."""

    doc: str
    lo: float | None = None  # numbers only
    hi: float | None = None
    open_lo: bool = False  # True: the bound itself is refused
    open_hi: bool = False
    why: str = ""  # appended to the error of a refused value: why the allowed ones are the only ones
    # When the key is absent its default follows the rest of the policy instead of contradicting it:
    # called with the policy as written and the static default.
    default_for: Callable[[Policy, Any], Any] | None = None


@dataclass(frozen=True, slots=True)
class PolicyKey:
    """One leaf of the schema, for documentation and generated tests (see :func:`policy_keys`)."""

    path: str  # dotted, e.g. "limits.max_event_bytes"
    type: Any  # the resolved annotation, e.g. int or Literal["a", "b"]
    default: Any  # the static default (a key with spec.default_for may default differently)
    spec: KeySpec


_SPEC = "policy"


def _key(doc: str, **constraints: Any) -> dict[str, KeySpec]:
    """The metadata of a leaf key: ``field(default=..., metadata=_key("one-line doc", lo=1, ...))``.

    A nested section is ``field(default_factory=Section)``; its class docstring is its doc.
    """
    return {_SPEC: KeySpec(doc, **constraints)}


def _one_attempt_unless_retrying(policy: Policy, default: int) -> int:
    return default if policy.retries_enabled else 1


def _fail_unless_retrying(policy: Policy, default: str) -> str:
    return default if policy.retries_enabled else FAIL


# Keys that earlier versions accepted with one value only: the rules they named are fixed, not configurable.
# A policy that still sets one is refused with the rule it tried to configure (never silently ignored).
_FIXED_RULES: Final[dict[str, str]] = {
    "on_upstream_failure.after_first_delta.action": (
        "after the first delta a failed stream always ends with a terminal error frame (then [DONE]): the "
        "decode state exists only in the failed replica, so nothing can continue it"
    ),
    "on_upstream_failure.after_first_delta.client_error": (
        "the terminal error frame's code is always upstream_decode_interrupted (the code clients and the "
        "journal know)"
    ),
    "on_upstream_failure.after_first_delta.automatic_retry": (
        "there is never an automatic retry after the first delta: the client already holds part of one "
        "answer, and a retry would append a different one"
    ),
    "on_upstream_failure.uncertain_source_liveness.action": (
        "an attempt whose replica may still be alive is always fenced first (its lease revoked); "
        "uncertain_source_liveness.wait_for and .then say what ends the fence and what follows"
    ),
}


# --- the schema -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class BeforeFirstDelta:
    """Nothing was delivered yet: a failure is invisible to the client."""

    require: frozenset[Requirement] = field(
        default=frozenset({FENCED, BUDGET}),
        metadata=_key("conditions for a retry; source_attempt_fenced is mandatory for one"),
    )
    action: BeforeAction = field(
        default=RETRY, metadata=_key("retry the prefill on a healthy replica, or fail the request")
    )
    max_attempts: int = field(
        default=2,
        metadata=_key(
            "attempts of one logical request that reach a replica, the first one included (one whose "
            "connection dies before its request is sent is journaled, not counted)",
            lo=1,
            hi=10,
            default_for=_one_attempt_unless_retrying,
        ),
    )


@dataclass(frozen=True, slots=True)
class UncertainLiveness:
    """The path is lost but the replica may be alive (partition, frozen process): its attempt is always fenced
    first (its lease revoked); these keys say what ends the fence and what follows it."""

    wait_for: FenceWait = field(
        default="cancel_ack_or_lease_expiry",
        metadata=_key(
            "what ends the fence: the replica-side cancel ack or the lease's expiry, or always the expiry",
            why="A partitioned replica may never acknowledge a cancel, so lease expiry must end the wait.",
        ),
    )
    then: UncertainThen = field(
        default=RETRY_IF_NO_DELTA,
        metadata=_key("after the fence: retry if nothing was delivered", default_for=_fail_unless_retrying),
    )


@dataclass(frozen=True, slots=True)
class OnUpstreamFailure:
    """What a failed attempt leads to, by what the client already has."""

    before_first_delta: BeforeFirstDelta = field(default_factory=BeforeFirstDelta)
    uncertain_source_liveness: UncertainLiveness = field(default_factory=UncertainLiveness)


@dataclass(frozen=True, slots=True)
class Budgets:
    """Retry budgets, rendered into Envoy's cluster."""

    # 50 %: when one replica of a pool of N >= 2 dies, the requests it held in prefill (about 1/N of those in
    # flight) all get their retry; when the whole pool fails at once, at most half of the requests are
    # retried at the same time, so a mass failure adds at most 50 % load instead of doubling it.
    retry_budget_percent: float = field(
        default=50.0,
        metadata=_key(
            "Envoy retry_budget: concurrent retries at most this % of requests in flight", lo=0, hi=100
        ),
    )
    min_retry_concurrency: int = field(
        default=3,
        metadata=_key("Envoy retry_budget floor: this many concurrent retries are always allowed", lo=0),
    )
    # A tenant's own share, counted by the sidecar: a tenant whose requests all fail before content holds at
    # most this share of its own requests in retry, so it cannot spend the retries other tenants need.
    tenant_retry_budget_percent: float = field(
        default=50.0,
        metadata=_key(
            "a tenant's requests in retry at once: at most this % of its own requests in flight", lo=0, hi=100
        ),
    )
    tenant_min_retry_concurrency: int = field(
        default=3,
        metadata=_key("a tenant may always have this many requests in retry at once", lo=0),
    )


@dataclass(frozen=True, slots=True)
class Placement:
    """Where retries land (docs/design.md#where-attempts-go): onto a replica warm for the prompt's prefix,
    away from one that said it is overloaded."""

    prefix_block_bytes: int = field(
        default=256,
        metadata=_key("the prompt is hashed in blocks of this many bytes (~64 tokens)", lo=16, hi=65536),
    )
    prefix_max_blocks: int = field(
        default=512, metadata=_key("blocks of a prompt considered (its first ones)", lo=1, hi=8192)
    )
    prefix_blocks_per_replica: int = field(
        default=16384,
        metadata=_key("prefix blocks remembered per replica (least recently served forgotten first)", lo=1),
    )
    # vLLM and SGLang evict KV-cache blocks by LRU under load; minutes is the order of their lifetime.
    prefix_ttl_seconds: float = field(
        default=300.0,
        metadata=_key(
            "a replica's prefix block counts as warm this long after it served it", lo=0, open_lo=True
        ),
    )
    max_retry_after_seconds: float = field(
        default=60.0,
        metadata=_key(
            "a replica's 429/503 with Retry-After takes it out of the attempts' order this long at most "
            "(0: a Retry-After never does)",
            lo=0,
            hi=3600,
        ),
    )
    connect_failure_seconds: float = field(
        default=2.0,
        metadata=_key(
            "a replica whose connection failed before a request was sent goes last in the order this long",
            lo=0,
            hi=600,
        ),
    )
    # A circuit breaker per replica: off by default, so that without it the gateway behaves as it always did.
    breaker_failures: int = field(
        default=0,
        metadata=_key(
            "attempts on one replica that fail before content in a row to open its circuit (0: no breaker)",
            lo=0,
            hi=1000,
        ),
    )
    breaker_open_seconds: float = field(
        default=2.0,
        metadata=_key(
            "an open circuit keeps its replica out of every order this long, doubled each time it opens "
            "again without a success between",
            lo=0.1,
            hi=600,
        ),
    )
    breaker_max_open_seconds: float = field(
        default=30.0,
        metadata=_key("the longest an open circuit keeps its replica out", lo=0.1, hi=3600),
    )


@dataclass(frozen=True, slots=True)
class Fallback:
    """Another model answers when the request's own cannot, before the first delta only, said out loud
    (docs/design.md#fallback). Off unless `models` names one."""

    models: tuple[str, ...] = field(
        default=(),
        metadata=_key(
            "models (as replica agents register them) that may answer instead, in order; empty: no fallback"
        ),
    )
    causes: frozenset[FallbackCause] = field(
        default=frozenset({"failed_before_content", "overloaded", "no_compatible_replica", "unavailable"}),
        metadata=_key(
            "what allows a fallback: every attempt failed before content (failed_before_content), the last "
            "with a 429 (overloaded), no compatible replica of the model left (no_compatible_replica), or "
            "none of its replicas could be sent to at all (unavailable: none healthy, every circuit open)"
        ),
    )
    max_attempts: int = field(
        default=1,
        metadata=_key("attempts on fallback models, beyond the request's own max_attempts", lo=1, hi=4),
    )


@dataclass(frozen=True, slots=True)
class CostCap:
    """The re-prefill cost cap."""

    max_prompt_tokens: int = field(
        default=32768,
        metadata=_key("estimated prompt tokens above which a request is served but never retried", lo=1),
    )


@dataclass(frozen=True, slots=True)
class Deadlines:
    """Hard deadlines (no soft latency failover: a slow replica is not a failed one)."""

    request_seconds: float = field(
        default=300.0,
        metadata=_key(
            "whole logical request: all attempts and the whole stream; longer than the admission timeout",
            lo=ADMISSION_MARGIN_SECONDS,
            open_lo=True,
        ),
    )
    connect_seconds: float = field(default=1.0, metadata=_key("TCP connect to a replica", lo=0, open_lo=True))


@dataclass(frozen=True, slots=True)
class UpstreamConnections:
    """Envoy's pooled HTTP/1.1 connections to the replicas (rendered into the replicas' cluster)."""

    # vLLM's and SGLang's uvicorn close a connection idle for 5 s (VLLM_HTTP_TIMEOUT_KEEP_ALIVE,
    # SGLANG_TIMEOUT_KEEP_ALIVE). A request Envoy sends on a connection the engine is closing dies on the
    # wire; closing idle connections first, on Envoy's side, takes that race away (docs/envoy-facts.md).
    idle_timeout_seconds: float = field(
        default=4.0,
        metadata=_key(
            "Envoy closes a connection to a replica once it was idle this long: keep it below the engines' "
            "keep-alive (5 s in vLLM and SGLang), so that no replica closes a connection Envoy may reuse",
            lo=0.1,
            hi=3600,
        ),
    )


@dataclass(frozen=True, slots=True)
class Leases:
    """etcd leases."""

    attempt_ttl_seconds: int = field(
        default=10, metadata=_key("etcd lease of an attempt (TTLs are whole seconds)", lo=1)
    )
    owner_ttl_seconds: int = field(
        default=10,
        metadata=_key(
            "etcd lease of a gateway instance: when it lapses, another instance closes the requests the "
            "lost one was serving (gateway_lost)",
            lo=2,
        ),
    )
    attempt_pool_size: int = field(
        default=4,
        metadata=_key(
            "attempt leases granted ahead and kept alive, so that an attempt starts without waiting for an "
            "etcd round trip (0: each attempt waits for its own grant)",
            lo=0,
            hi=256,
        ),
    )


@dataclass(frozen=True, slots=True)
class Limits:
    """Sizes the sidecar accepts or holds."""

    max_request_body_bytes: int = field(
        default=4 * 1024 * 1024,
        metadata=_key("larger request bodies are answered 413 before any attempt", lo=1),
    )
    # Envoy 1.40 crashes holding ~1 MiB in the upstream filter (docs/envoy-facts.md): the bound is well below.
    max_held_response_bytes: int = field(
        default=256 * 1024,
        metadata=_key(
            "bytes of one attempt's response held before its first content delta; beyond it a streaming "
            "attempt fails (and may be retried) and a non-stream answer is passed through unheld",
            lo=4096,
            hi=512 * 1024,
        ),
    )
    max_event_bytes: int = field(
        default=1024 * 1024,
        metadata=_key(
            "largest SSE event accepted from a replica; a larger one fails the attempt before the first "
            "delta, or ends the stream with the terminal frame after it",
            lo=4096,
            hi=16 * 1024 * 1024,
        ),
    )
    max_json_depth: int = field(
        default=64, metadata=_key("request bodies nested deeper are answered 400", lo=8, hi=512)
    )


@dataclass(frozen=True, slots=True)
class JournalPolicy:
    """The request journal (queryable by request id)."""

    retention_seconds: float = field(
        default=86400.0, metadata=_key("how long request records stay queryable", lo=0, open_lo=True)
    )
    # etcd refuses requests over 1.5 MiB: a record must stay far below that whatever the stream did.
    max_events: int = field(
        default=256,
        metadata=_key(
            "trace events kept per request record (the first and the last ones; it counts the dropped ones)",
            lo=32,
            hi=4096,
        ),
    )
    # A record is written at admission, at the first delta (write-ahead) and at the end; a long stream's
    # also every interval, so that a lost gateway's record is closed with a recent delivered count.
    progress_interval_seconds: float = field(
        default=5.0,
        metadata=_key(
            "a streaming request's record is rewritten with its delivered count this often (0: never)", lo=0
        ),
    )
    trace_clean_completions: float = field(
        default=0.0,
        metadata=_key(
            "share of clean completions (one attempt, no tool call) whose record keeps its event trace; the "
            "others keep the summary only (records of retried, interrupted, failed and cancelled requests "
            "always keep it)",
            lo=0,
            hi=1,
        ),
    )
    # The claim (the record's create) is a raft write. Written while the first attempt already runs, it
    # costs the first token nothing; nothing of the attempt reaches the client before it is settled, and a
    # key that belongs to another run is refused then (its replica's prefill is cancelled).
    claim_before_forwarding: bool = field(
        default=False,
        metadata=_key(
            "true: forward a request only once its record is claimed (one etcd round trip more before the "
            "first token; a duplicate key never reaches a replica); false: claim while the first attempt "
            "runs",
        ),
    )


@dataclass(frozen=True, slots=True)
class ToolsPolicy:
    """Tool services behind the gateway."""

    retention_seconds: float = field(
        default=86400.0,
        metadata=_key(
            "a tool result stays replayable under its idempotency key this long", lo=0, open_lo=True
        ),
    )
    max_stored_response_bytes: int = field(
        default=1024 * 1024,
        metadata=_key(
            "larger results are not kept: later calls with the key get an error, not a re-run", lo=0
        ),
    )
    call_timeout_seconds: float = field(
        default=30.0, metadata=_key("route timeout of one tool call", lo=0, open_lo=True)
    )
    in_progress_wait_seconds: float = field(
        default=0.0,
        metadata=_key("a duplicate of a call still running waits up to this, then gets 409", lo=0),
    )
    max_calls_per_request: int = field(
        default=64,
        metadata=_key(
            "tool calls listed in one request's journal record (more are counted, not listed)", lo=1, hi=1024
        ),
    )


@dataclass(frozen=True, slots=True)
class LivenessPolicy:
    """Liveness signals beside the registry's heartbeats: the replica side's progress reports, and the
    sidecar's own health probe of static replicas (no agent, no heartbeat)."""

    progress_gap_seconds: float = field(
        default=3.0,
        metadata=_key(
            "the replica side reported bytes that have not arrived for this long: the path is lost",
            lo=0,
            open_lo=True,
        ),
    )
    static_probe_interval_seconds: float = field(
        default=1.0,
        metadata=_key("how often the sidecar probes each static replica's /health", lo=0.1, hi=60),
    )
    static_probe_timeout_seconds: float = field(
        default=3.0,
        metadata=_key(
            "how long the sidecar and Envoy wait for a static replica's /health (SGLang answers after ~1 s)",
            lo=0.1,
            hi=60,
        ),
    )
    static_probe_failures: int = field(
        default=2,
        metadata=_key("failed /health probes in a row after which a static replica is lost", lo=1, hi=10),
    )


@dataclass(frozen=True, slots=True)
class TenancyPolicy:
    """Who a caller is, on tool-call and journal look-up routes."""

    refuse_anonymous: bool = field(
        default=True,
        metadata=_key(
            "refuse callers without a credential on those routes (they would all share one tenant)"
        ),
    )
    secret_file: str | None = field(
        default=None,
        metadata=_key(
            "file holding the per-deployment secret that salts credential digests; "
            "null: $ROUTER_SIDECAR_TENANT_SECRET, else a secret kept in etcd"
        ),
    )


@dataclass(frozen=True, slots=True)
class Policy:
    """The whole policy (docs/policy.md)."""

    on_upstream_failure: OnUpstreamFailure = field(default_factory=OnUpstreamFailure)
    budgets: Budgets = field(default_factory=Budgets)
    placement: Placement = field(default_factory=Placement)
    fallback: Fallback = field(default_factory=Fallback)
    reprefill_cost_cap: CostCap = field(default_factory=CostCap)
    deadlines: Deadlines = field(default_factory=Deadlines)
    upstream_connections: UpstreamConnections = field(default_factory=UpstreamConnections)
    leases: Leases = field(default_factory=Leases)
    limits: Limits = field(default_factory=Limits)
    journal: JournalPolicy = field(default_factory=JournalPolicy)
    tools: ToolsPolicy = field(default_factory=ToolsPolicy)
    liveness: LivenessPolicy = field(default_factory=LivenessPolicy)
    tenancy: TenancyPolicy = field(default_factory=TenancyPolicy)

    # Shortcuts: policy.before_first_delta is policy.on_upstream_failure.before_first_delta.
    @property
    def before_first_delta(self) -> BeforeFirstDelta:
        return self.on_upstream_failure.before_first_delta

    @property
    def uncertain_source_liveness(self) -> UncertainLiveness:
        return self.on_upstream_failure.uncertain_source_liveness

    @property
    def retries_enabled(self) -> bool:
        return self.on_upstream_failure.before_first_delta.action == RETRY


DEFAULT_POLICY = Policy()


# --- impossible combinations ------------------------------------------------------------------

_BFD = "on_upstream_failure.before_first_delta"


def _retry_needs_a_second_attempt(p: Policy) -> None:
    if p.retries_enabled and p.before_first_delta.max_attempts < 2:
        raise PolicyError(
            f"{_BFD}.max_attempts",
            f"is {p.before_first_delta.max_attempts} with action {RETRY}: that allows no retry; "
            f"use action: {FAIL}, or max_attempts >= 2",
        )


def _fail_request_makes_one_attempt(p: Policy) -> None:
    n = p.before_first_delta.max_attempts
    if not p.retries_enabled and n != 1:
        raise PolicyError(
            f"{_BFD}.max_attempts", f"is {n} with action {FAIL}: {FAIL} makes one attempt; set it to 1"
        )


def _retry_requires_fencing(p: Policy) -> None:
    if p.retries_enabled and FENCED not in p.before_first_delta.require:
        raise PolicyError(
            f"{_BFD}.require",
            f"must include {FENCED} when action is {RETRY}: a retry may start only when the previous "
            "attempt can no longer publish, or the client may get content from two attempts",
        )


def _then_follows_action(p: Policy) -> None:
    if p.uncertain_source_liveness.then == RETRY_IF_NO_DELTA and not p.retries_enabled:
        raise PolicyError(
            "on_upstream_failure.uncertain_source_liveness.then",
            f"is {RETRY_IF_NO_DELTA} but before_first_delta.action is {FAIL}; set then: {FAIL}",
        )


def _budget_allows_a_retry(p: Policy) -> None:
    b = p.budgets
    if (
        p.retries_enabled
        and BUDGET in p.before_first_delta.require
        and b.retry_budget_percent == 0
        and b.min_retry_concurrency == 0
    ):
        raise PolicyError(
            "budgets",
            f"retry_budget_percent 0 and min_retry_concurrency 0 allow no retry, but action is {RETRY} "
            f"and require has {BUDGET}; raise one of them or use action: {FAIL}",
        )


def _deadline_covers_connect(p: Policy) -> None:
    d = p.deadlines
    if d.request_seconds <= d.connect_seconds:
        raise PolicyError(
            "deadlines.request_seconds",
            f"({d.request_seconds:g}) must be greater than deadlines.connect_seconds "
            f"({d.connect_seconds:g}): the request deadline covers every connect",
        )


def _lease_fits_in_deadline(p: Policy) -> None:
    ttl, deadline = p.leases.attempt_ttl_seconds, p.deadlines.request_seconds
    if p.retries_enabled and ttl >= deadline:
        raise PolicyError(
            "leases.attempt_ttl_seconds",
            f"({ttl}) must be less than deadlines.request_seconds ({deadline:g}): "
            "fencing may wait a whole TTL before a retry can start",
        )


def _tool_wait_fits_in_admission_timeout(p: Policy) -> None:
    wait, deadline = p.tools.in_progress_wait_seconds, p.deadlines.request_seconds
    if wait >= deadline - ADMISSION_MARGIN_SECONDS:
        raise PolicyError(
            "tools.in_progress_wait_seconds",
            f"({wait:g}) must be less than deadlines.request_seconds minus {ADMISSION_MARGIN_SECONDS} "
            f"({deadline - ADMISSION_MARGIN_SECONDS:g}): the wait is spent inside Envoy's admission "
            f"message timeout ({ADMISSION_MARGIN_SECONDS} s plus the wait), which must end before the "
            "request deadline",
        )


# In this order: the first broken rule is reported.
_CHECKS: tuple[Callable[[Policy], None], ...] = (
    _retry_needs_a_second_attempt,
    _fail_request_makes_one_attempt,
    _retry_requires_fencing,
    _then_follows_action,
    _budget_allows_a_retry,
    _deadline_covers_connect,
    _lease_fits_in_deadline,
    _tool_wait_fits_in_admission_timeout,
)


# --- the walker -------------------------------------------------------------------------------

# (dotted path, default_for, static default) of absent keys whose default follows the rest.
_Derived = tuple[str, Callable[[Policy, Any], Any], Any]


def policy_from_mapping(m: Any) -> Policy:
    """Build and validate a :class:`Policy` from parsed YAML/JSON (None: all defaults)."""
    derived: list[_Derived] = []
    policy: Policy = _section(Policy, m, "", derived)
    # Every derived default is computed from the policy as written, then all are applied.
    for path, value in [(path, rule(policy, default)) for path, rule, default in derived]:
        policy = _replace_at(policy, path.split("."), value)
    for check in _CHECKS:
        check(policy)
    return policy


def policy_to_mapping(policy: Policy) -> dict[str, Any]:
    """The effective policy in the YAML shape (for logs and ``--print-policy``-style output)."""
    return _to_mapping(policy)


def _to_mapping(section: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for f in fields(section):
        value, kind = getattr(section, f.name), _hints(type(section))[f.name]
        if _is_section(kind):
            out[f.name] = _to_mapping(value)
        elif get_origin(kind) is frozenset:
            out[f.name] = [item for item in get_args(get_args(kind)[0]) if item in value]  # schema order
        elif get_origin(kind) is tuple:
            out[f.name] = list(value)
        else:
            out[f.name] = value
    return out


def policy_keys() -> tuple[PolicyKey, ...]:
    """Every leaf key of the schema, depth first in declaration order."""
    return tuple(_keys(Policy, ""))


def _keys(cls: type[Any], path: str) -> Iterator[PolicyKey]:
    for f in fields(cls):
        kind, where = _hints(cls)[f.name], _join(path, f.name)
        if _is_section(kind):
            yield from _keys(kind, where)
        else:
            yield PolicyKey(where, kind, f.default, _spec(f, where))


def _section(cls: type[Any], raw: Any, path: str, derived: list[_Derived]) -> Any:
    given = _mapping(raw, path, tuple(f.name for f in fields(cls)))
    values: dict[str, Any] = {}
    for f in fields(cls):
        kind, where = _hints(cls)[f.name], _join(path, f.name)
        if _is_section(kind):
            values[f.name] = _section(kind, given.get(f.name), where, derived)
        elif f.name in given:
            values[f.name] = _leaf(kind, given[f.name], where, _spec(f, where))
        elif (rule := _spec(f, where).default_for) is not None:
            derived.append((where, rule, f.default))
    return cls(**values)


def _mapping(v: Any, path: str, allowed: tuple[str, ...]) -> Mapping[str, Any]:
    if v is None:
        # "budgets:" with nothing under it: YAML null. Treated as "all defaults", like a missing key.
        return {}
    if not isinstance(v, Mapping):
        raise PolicyError(path, f"must be a mapping with keys {', '.join(allowed)}; got {_show(v)}")
    for key in v:
        if key not in allowed:
            where = _join(path, str(key))
            _refuse_fixed_rule(where, v[key])
            raise PolicyError(where, f"unknown key; allowed here: {', '.join(allowed)}")
    return v


def _refuse_fixed_rule(where: str, value: Any) -> None:
    """A key (or a section of keys) that names a fixed rule: refused with the rule and what to do."""
    if where in _FIXED_RULES:
        raise PolicyError(
            where,
            f"is not configurable (the rule is fixed: {_FIXED_RULES[where]}); remove the key from the policy",
        )
    inside = [path for path in _FIXED_RULES if path.startswith(where + ".")]
    if inside:
        given = [_join(where, str(k)) for k in value] if isinstance(value, Mapping) else []
        named = next((path for path in given if path in _FIXED_RULES), None)
        if named is not None:
            _refuse_fixed_rule(named, None)
        rules = "; ".join(_FIXED_RULES[path] for path in inside)
        raise PolicyError(
            where,
            f"is not configurable (its rules are fixed: {rules}); remove the section from the policy",
        )


def _leaf(kind: Any, v: Any, where: str, spec: KeySpec) -> Any:
    if get_origin(kind) is frozenset:
        return _literal_set(get_args(get_args(kind)[0]), v, where)
    if get_origin(kind) is tuple:
        return _names(v, where)
    if not _accepts(kind, v):
        why = f". {spec.why}" if spec.why else ""
        raise PolicyError(where, f"must be {_describe(kind)}; got {_show(v)}{why}")
    if _out_of_bounds(v, spec):
        raise PolicyError(where, f"must be {_bounds(spec)}; got {_show(v)}")
    return float(v) if kind is float else v  # an int is a fine number; keep one type per field


def _literal_set(allowed: tuple[Any, ...], v: Any, where: str) -> frozenset[Any]:
    if not isinstance(v, list):
        raise PolicyError(where, f"must be a list, a subset of [{', '.join(allowed)}]; got {_show(v)}")
    for i, item in enumerate(v):
        if not _is_one_of(item, allowed):
            raise PolicyError(f"{where}[{i}]", f"must be one of: {', '.join(allowed)}; got {_show(item)}")
    if len(set(v)) != len(v):
        raise PolicyError(where, f"lists a value twice: {v!r}")
    return frozenset(v)


def _names(v: Any, where: str) -> tuple[str, ...]:
    names = isinstance(v, list) and all(isinstance(item, str) and item.strip() for item in v)
    if not names or len(set(v)) != len(v):
        raise PolicyError(where, f"must be a list of distinct non-empty strings; got {_show(v)}")
    return tuple(v)


def _accepts(kind: Any, v: Any) -> bool:
    origin = get_origin(kind)
    if origin in (Union, types.UnionType):
        return any(_accepts(option, v) for option in get_args(kind))
    if origin is Literal:
        return _is_one_of(v, get_args(kind))
    if kind is type(None):
        return v is None
    if kind is bool:
        return type(v) is bool  # YAML's yes/true are booleans already; the string "true" is not
    if kind is int:
        return isinstance(v, int) and not isinstance(v, bool)
    if kind is float:
        if isinstance(v, bool) or not isinstance(v, int | float):
            return False
        return math.isfinite(v) if isinstance(v, float) else abs(v) <= sys.float_info.max
    if kind is str:
        return isinstance(v, str) and v.strip() != ""
    raise TypeError(f"policy schema: unsupported type {kind!r}")


def _describe(kind: Any) -> str:
    origin = get_origin(kind)
    if origin in (Union, types.UnionType):
        return " or ".join(_describe(option) for option in get_args(kind))
    if origin is Literal:
        allowed = [_yaml(a) for a in get_args(kind)]
        return allowed[0] if len(allowed) == 1 else f"one of: {', '.join(allowed)}"
    names = {
        type(None): "null",
        bool: "true or false",
        int: "an integer",
        float: "a finite number",
        str: "a non-empty string",
    }
    if kind in names:
        return names[kind]
    raise TypeError(f"policy schema: unsupported type {kind!r}")


def _is_one_of(v: Any, allowed: Sequence[Any]) -> bool:
    # Compare types too: 0 == False and 1 == True in Python, not in a policy.
    return any(type(v) is type(a) and v == a for a in allowed)


def _out_of_bounds(v: Any, spec: KeySpec) -> bool:
    below = spec.lo is not None and (v <= spec.lo if spec.open_lo else v < spec.lo)
    above = spec.hi is not None and (v >= spec.hi if spec.open_hi else v > spec.hi)
    return below or above


def _bounds(spec: KeySpec) -> str:
    if spec.lo is not None and spec.hi is not None and not (spec.open_lo or spec.open_hi):
        return f"between {_num(spec.lo)} and {_num(spec.hi)}"
    parts = []
    if spec.lo is not None:
        parts.append(f"{'>' if spec.open_lo else '>='} {_num(spec.lo)}")
    if spec.hi is not None:
        parts.append(f"{'<' if spec.open_hi else '<='} {_num(spec.hi)}")
    return " and ".join(parts)


def _spec(f: dataclasses.Field[Any], where: str) -> KeySpec:
    spec = f.metadata.get(_SPEC)
    if not isinstance(spec, KeySpec):
        raise TypeError(
            f"policy schema: {where} has no KeySpec; declare it with field(default=..., metadata=_key(...))"
        )
    return spec


@functools.cache
def _hints(cls: type[Any]) -> dict[str, Any]:
    return get_type_hints(cls)


def _is_section(kind: Any) -> bool:
    return isinstance(kind, type) and dataclasses.is_dataclass(kind)


def _replace_at(obj: Any, keys: Sequence[str], value: Any) -> Any:
    head, *rest = keys
    return dataclasses.replace(obj, **{head: _replace_at(getattr(obj, head), rest, value) if rest else value})


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _num(x: float) -> str:
    return str(x) if isinstance(x, int) else f"{x:g}"


def _yaml(v: Any) -> str:
    """A value as an operator writes it in YAML."""
    if isinstance(v, bool):
        return "true" if v else "false"
    return "null" if v is None else str(v)


def _show(v: Any) -> str:
    """A refused value with its kind, as the operator wrote it."""
    kinds = {bool: "boolean", int: "integer", float: "number", str: "string", list: "list", dict: "mapping"}
    shown = _yaml(v) if isinstance(v, bool) or v is None else repr(v)
    return shown if v is None else f"{kinds.get(type(v), type(v).__name__)} {shown}"


# --- loading ----------------------------------------------------------------------------------


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that rejects duplicate keys (PyYAML silently keeps the last one)."""


def _construct_mapping(loader: _StrictLoader, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
    seen: set[Any] = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            raise yaml.constructor.ConstructorError(
                "while constructing a mapping",
                node.start_mark,
                f"found duplicate key {key!r}",
                key_node.start_mark,
            )
        seen.add(key)
    return loader.construct_mapping(node, deep=deep)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def load_policy(path: str | None) -> Policy:
    """Load and validate a policy file; None gives :data:`DEFAULT_POLICY`."""
    if path is None:
        return DEFAULT_POLICY
    return policy_from_mapping(_policy_part(_load_document(path)))


def load_route_policies(path: str | None, base: Policy) -> tuple[RouteOverlay, ...]:
    """The `routes:` of a policy file (see policy.example.yaml), each validated over `base`."""
    document = _load_document(path)
    raw = document.get("routes", []) if isinstance(document, Mapping) else []
    if not isinstance(raw, list):
        raise PolicyError("routes", "is a list of {name, match: {header, value}, policy}")
    overlays: list[RouteOverlay] = []
    for index, entry in enumerate(raw):
        where = f"routes[{index}]"
        given = _mapping(entry, where, ("name", "match", "policy"))
        name, match = given.get("name"), _mapping(given.get("match"), f"{where}.match", ("header", "value"))
        if not isinstance(name, str) or not _ROUTE_NAME.fullmatch(name):
            raise PolicyError(f"{where}.name", "is 1-63 characters of a-z 0-9 _ - (the Envoy route's name)")
        header, value = match.get("header"), match.get("value")
        if not isinstance(header, str) or not _HEADER_NAME.fullmatch(header) or not isinstance(value, str):
            raise PolicyError(
                f"{where}.match", "is {header: a lower-case header name, value: its exact value}"
            )
        try:
            policy = route_policy(base, given.get("policy"))
        except PolicyError as exc:
            path = f"{where}.policy" + (f".{exc.path}" if exc.path else "")
            raise PolicyError(path, exc.message) from exc
        if any(o.name == name for o in overlays):
            raise PolicyError(f"{where}.name", f"{name!r} is used twice")
        overlays.append(RouteOverlay(name, header, value, dict(given["policy"]), policy))
    return tuple(overlays)


def _load_document(path: str | None) -> Any:
    if path is None:
        return None
    try:
        with open(path, encoding="utf-8") as f:
            return yaml.load(f, Loader=_StrictLoader)  # a SafeLoader subclass: no arbitrary objects
    except OSError as exc:
        raise PolicyError("", f"cannot read {path}: {exc.strerror or exc}") from exc
    except yaml.YAMLError as exc:
        raise PolicyError("", f"{path} is not valid YAML: {exc}") from exc


def _policy_part(document: Any) -> Any:
    """The document without its `routes:` (read by :func:`load_route_policies`)."""
    if isinstance(document, Mapping) and "routes" in document:
        return {k: v for k, v in document.items() if k != "routes"}
    return document


# --- per-route policy -------------------------------------------------------------------------
#
# A route of the gateway's Envoy config may carry an overlay of the policy (JSON, in the gRPC initial
# metadata Envoy sends with the route's ext_proc stream: ExtProcPerRoute.overrides.grpc_initial_metadata).
# Only what the sidecar decides per request can differ by route; what is rendered into Envoy's listener or
# cluster, or shared by every request of the gateway, cannot.

ROUTE_POLICY_METADATA: Final = "x-router-sidecar-policy"
_ROUTE_NAME = re.compile(r"[a-z0-9][a-z0-9_-]{0,62}")
_HEADER_NAME = re.compile(r"[a-z0-9!#$%&'*+.^_`|~-]+")


@dataclass(frozen=True, slots=True)
class RouteOverlay:
    """A route of the gateway's own Envoy config with its policy (policy file `routes:`)."""

    name: str
    header: str  # requests carrying this header with this exact value take the route
    value: str
    overlay: Mapping[str, Any]  # as written: sent to the sidecar by Envoy with the route's ext_proc stream
    policy: Policy  # the effective policy of the route


ROUTE_POLICY_KEYS: Final = (
    "on_upstream_failure",
    "reprefill_cost_cap",
    "deadlines.request_seconds",
    "fallback",
)


def route_policy(base: Policy, overlay: Any) -> Policy:
    """`overlay` (the policy file's shape, per-request keys only) applied over the gateway's effective
    policy and validated as a whole. Raises PolicyError naming the key."""
    if not isinstance(overlay, Mapping) or not overlay:
        raise PolicyError("", "a route's policy is a non-empty mapping in the policy file's shape")
    for path in _overlay_paths(overlay, ""):
        if not any(path == key or path.startswith(key + ".") for key in ROUTE_POLICY_KEYS):
            raise PolicyError(
                path,
                "is gateway-wide (rendered into Envoy's listener or cluster, or shared by every request): "
                f"set it in the gateway's policy; a route may set {', '.join(ROUTE_POLICY_KEYS)}",
            )
    policy = policy_from_mapping(_merged(_as_written(base), overlay))
    if policy.deadlines.request_seconds > base.deadlines.request_seconds:
        raise PolicyError(
            "deadlines.request_seconds",
            f"({_num(policy.deadlines.request_seconds)}) exceeds the gateway's "
            f"({_num(base.deadlines.request_seconds)}): Envoy's own timeouts are rendered from the gateway's",
        )
    _only_tightens(base, policy)
    return policy


def _only_tightens(base: Policy, route: Policy) -> None:
    """A route is chosen by what a request carries (a header, a path), often by the caller: it may make
    re-sending the input rarer or cheaper than the gateway's policy allows, never more frequent."""
    why = "a route may only tighten the gateway's policy (requests choose their route)"
    if route.retries_enabled and not base.retries_enabled:
        raise PolicyError(f"{_BFD}.action", f"retries where the gateway's policy fails the request: {why}")
    if route.before_first_delta.max_attempts > base.before_first_delta.max_attempts:
        raise PolicyError(
            f"{_BFD}.max_attempts",
            f"({route.before_first_delta.max_attempts}) exceeds the gateway's "
            f"({base.before_first_delta.max_attempts}): {why}",
        )
    if not base.before_first_delta.require <= route.before_first_delta.require:
        missing = sorted(base.before_first_delta.require - route.before_first_delta.require)
        raise PolicyError(f"{_BFD}.require", f"drops {', '.join(missing)}: {why}")
    # A fallback answers with another model: a route may narrow the gateway's fallback or turn it off, never
    # name a model, a cause or more attempts the gateway's policy does not allow.
    extra = [m for m in route.fallback.models if m not in base.fallback.models]
    if extra:
        raise PolicyError(
            "fallback.models", f"names {', '.join(extra)}, not in the gateway's fallback.models: {why}"
        )
    if not set(route.fallback.causes) <= set(base.fallback.causes):
        added = sorted(set(route.fallback.causes) - set(base.fallback.causes))
        raise PolicyError("fallback.causes", f"adds {', '.join(added)}: {why}")
    if route.fallback.max_attempts > base.fallback.max_attempts:
        raise PolicyError(
            "fallback.max_attempts",
            f"({route.fallback.max_attempts}) exceeds the gateway's ({base.fallback.max_attempts}): {why}",
        )
    if route.reprefill_cost_cap.max_prompt_tokens > base.reprefill_cost_cap.max_prompt_tokens:
        raise PolicyError(
            "reprefill_cost_cap.max_prompt_tokens",
            f"({route.reprefill_cost_cap.max_prompt_tokens}) exceeds the gateway's "
            f"({base.reprefill_cost_cap.max_prompt_tokens}): {why}",
        )


class RoutePolicies:
    """The policy of each route overlay seen so far (parsed and validated once per distinct text)."""

    def __init__(self, base: Policy, max_entries: int = 256) -> None:
        self.base = base
        self._max_entries = max_entries  # overlays come from the Envoy config: a handful, never unbounded
        self._known: dict[str, Policy | PolicyError] = {}

    def get(self, text: str | None) -> Policy:
        """The policy for a route's overlay text (None or empty: the gateway's). Raises PolicyError."""
        if not text:
            return self.base
        found = self._known.get(text)
        if found is None:
            found = self._parse(text)
            if len(self._known) < self._max_entries:
                self._known[text] = found
        if isinstance(found, PolicyError):
            raise found
        return found

    def _parse(self, text: str) -> Policy | PolicyError:
        try:
            overlay = yaml.load(text, Loader=_StrictLoader)  # JSON is YAML
        except yaml.YAMLError as exc:
            return PolicyError("", f"a route's policy is not valid JSON/YAML: {exc}")
        try:
            return route_policy(self.base, overlay)
        except PolicyError as exc:
            return exc


def _as_written(policy: Policy) -> dict[str, Any]:
    """The policy's mapping without the keys whose value is what their rule derives (e.g. `then` following
    `action`), so that an overlay changing the rule's inputs gets them derived again."""
    mapping = policy_to_mapping(policy)
    for key in policy_keys():
        rule = key.spec.default_for
        *parents, leaf = key.path.split(".")
        value: Any = policy
        for part in key.path.split("."):
            value = getattr(value, part)
        if rule is not None and value == rule(policy, key.default):
            section = mapping
            for part in parents:
                section = section[part]
            del section[leaf]
    return mapping


def _overlay_paths(overlay: Mapping[str, Any], path: str) -> Iterator[str]:
    for key, value in overlay.items():
        where = _join(path, str(key))
        if isinstance(value, Mapping) and value:
            yield from _overlay_paths(value, where)
        else:
            yield where


def _merged(base: Mapping[str, Any], overlay: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in overlay.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = _merged(out[key], value)
        else:
            out[key] = value
    return out
