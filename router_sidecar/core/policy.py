"""The operator policy: short, strict, validated at start-up (DESIGN.md §7).

Unknown keys and impossible combinations are errors, not warnings: a typo in a safety policy
must stop the sidecar instead of silently running with a default. Every key is optional;
a missing key takes the value of :data:`DEFAULT_POLICY` (``policy.example.yaml`` shows them all).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, cast

import yaml

__all__ = [
    "DEFAULT_POLICY",
    "AfterFirstDelta",
    "BeforeFirstDelta",
    "Budgets",
    "CostCap",
    "Deadlines",
    "JournalPolicy",
    "Leases",
    "Limits",
    "LivenessPolicy",
    "OnUpstreamFailure",
    "Policy",
    "PolicyError",
    "ToolsPolicy",
    "UncertainLiveness",
    "load_policy",
    "policy_from_mapping",
    "policy_to_mapping",
]

RETRY = "retry_prefill_on_healthy_replica"
FAIL = "fail_request"
FENCED = "source_attempt_fenced"
BUDGET = "retry_budget_available"
RETRY_IF_NO_DELTA = "retry_only_if_no_delta_was_sent"

BeforeAction = Literal["retry_prefill_on_healthy_replica", "fail_request"]
Requirement = Literal["source_attempt_fenced", "retry_budget_available"]
FenceWait = Literal["cancel_ack_or_lease_expiry", "lease_expiry"]
UncertainThen = Literal["retry_only_if_no_delta_was_sent", "fail_request"]


class PolicyError(ValueError):
    """An invalid policy; ``path`` is the dotted key that is wrong ("" for the whole document)."""

    def __init__(self, path: str, message: str) -> None:
        super().__init__(f"policy: {path}: {message}" if path else f"policy: {message}")
        self.path = path


@dataclass(frozen=True, slots=True)
class BeforeFirstDelta:
    require: frozenset[Requirement]
    action: BeforeAction
    max_attempts: int  # all attempts of one logical request, the first one included


@dataclass(frozen=True, slots=True)
class AfterFirstDelta:
    action: Literal["terminate_stream"]
    client_error: Literal["upstream_decode_interrupted"]
    automatic_retry: Literal[False]


@dataclass(frozen=True, slots=True)
class UncertainLiveness:
    action: Literal["fence_source_attempt"]
    wait_for: FenceWait
    then: UncertainThen


@dataclass(frozen=True, slots=True)
class Budgets:
    retry_budget_percent: float  # Envoy retry_budget: retries at most this % of active requests
    min_retry_concurrency: int  # Envoy retry_budget floor
    max_concurrent_retries: int  # Envoy circuit breaker max_retries


@dataclass(frozen=True, slots=True)
class CostCap:
    max_prompt_tokens: int  # above this estimate a request is served but never retried


@dataclass(frozen=True, slots=True)
class Deadlines:
    request_seconds: float  # whole logical request: all attempts and the whole stream
    connect_seconds: float


@dataclass(frozen=True, slots=True)
class Leases:
    attempt_ttl_seconds: int  # etcd lease TTLs are whole seconds


@dataclass(frozen=True, slots=True)
class Limits:
    max_request_body_bytes: int


@dataclass(frozen=True, slots=True)
class JournalPolicy:
    retention_seconds: float


@dataclass(frozen=True, slots=True)
class LivenessPolicy:
    # The replica side reported bytes that have not arrived here for this long: the path is lost.
    progress_gap_seconds: float


@dataclass(frozen=True, slots=True)
class ToolsPolicy:
    retention_seconds: float  # how long a tool result stays replayable under its idempotency key
    max_stored_response_bytes: int  # larger results are not kept: later calls get an error, not a re-run
    call_timeout_seconds: float  # route timeout of a tool call
    in_progress_wait_seconds: float  # a duplicate of a call in progress waits this long, then gets 409


@dataclass(frozen=True, slots=True)
class OnUpstreamFailure:
    before_first_delta: BeforeFirstDelta
    after_first_delta: AfterFirstDelta
    uncertain_source_liveness: UncertainLiveness


@dataclass(frozen=True, slots=True)
class Policy:
    on_upstream_failure: OnUpstreamFailure
    budgets: Budgets
    reprefill_cost_cap: CostCap
    deadlines: Deadlines
    leases: Leases
    limits: Limits
    journal: JournalPolicy
    tools: ToolsPolicy
    liveness: LivenessPolicy

    # Shortcuts: policy.before_first_delta is policy.on_upstream_failure.before_first_delta.
    @property
    def before_first_delta(self) -> BeforeFirstDelta:
        return self.on_upstream_failure.before_first_delta

    @property
    def after_first_delta(self) -> AfterFirstDelta:
        return self.on_upstream_failure.after_first_delta

    @property
    def uncertain_source_liveness(self) -> UncertainLiveness:
        return self.on_upstream_failure.uncertain_source_liveness

    @property
    def retries_enabled(self) -> bool:
        return self.on_upstream_failure.before_first_delta.action == RETRY


DEFAULT_POLICY = Policy(
    on_upstream_failure=OnUpstreamFailure(
        before_first_delta=BeforeFirstDelta(frozenset({FENCED, BUDGET}), RETRY, 2),
        after_first_delta=AfterFirstDelta("terminate_stream", "upstream_decode_interrupted", False),
        uncertain_source_liveness=UncertainLiveness(
            "fence_source_attempt", "cancel_ack_or_lease_expiry", RETRY_IF_NO_DELTA
        ),
    ),
    budgets=Budgets(retry_budget_percent=20, min_retry_concurrency=3, max_concurrent_retries=64),
    reprefill_cost_cap=CostCap(max_prompt_tokens=32768),
    deadlines=Deadlines(request_seconds=300, connect_seconds=1),
    leases=Leases(attempt_ttl_seconds=10),
    limits=Limits(max_request_body_bytes=4 * 1024 * 1024),
    journal=JournalPolicy(retention_seconds=86400),
    tools=ToolsPolicy(
        retention_seconds=86400,
        max_stored_response_bytes=1024 * 1024,
        call_timeout_seconds=30,
        in_progress_wait_seconds=0,
    ),
    liveness=LivenessPolicy(progress_gap_seconds=3),
)


# --- validation helpers -----------------------------------------------------------------------


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _mapping(v: Any, path: str, allowed: tuple[str, ...]) -> Mapping[str, Any]:
    if v is None:
        # "budgets:" with nothing under it: YAML null. Treated as "all defaults", like a missing key.
        return {}
    if not isinstance(v, Mapping):
        raise PolicyError(path, f"must be a mapping with keys {', '.join(allowed)}; got {_type(v)}")
    for key in v:
        if key not in allowed:
            raise PolicyError(_join(path, str(key)), f"unknown key; allowed here: {', '.join(allowed)}")
    return v


def _type(v: Any) -> str:
    return "null" if v is None else type(v).__name__


def _int(m: Mapping[str, Any], key: str, path: str, default: int, lo: int, hi: int | None = None) -> int:
    if key not in m:
        return default
    v = m[key]
    where = _join(path, key)
    if not isinstance(v, int) or isinstance(v, bool):
        raise PolicyError(where, f"must be an integer; got {_type(v)} {v!r}")
    if v < lo or (hi is not None and v > hi):
        raise PolicyError(
            where,
            f"must be between {lo} and {hi}; got {v}" if hi is not None else f"must be >= {lo}; got {v}",
        )
    return v


def _number(
    m: Mapping[str, Any],
    key: str,
    path: str,
    default: float,
    *,
    lo: float,
    hi: float | None = None,
    open_lo: bool,
) -> float:
    if key not in m:
        return default
    v = m[key]
    where = _join(path, key)
    if not isinstance(v, int | float) or isinstance(v, bool) or v != v or v in (float("inf"), float("-inf")):
        raise PolicyError(where, f"must be a finite number; got {_type(v)} {v!r}")
    if (v <= lo if open_lo else v < lo) or (hi is not None and v > hi):
        if hi is not None:
            raise PolicyError(where, f"must be between {lo:g} and {hi:g}; got {v}")
        raise PolicyError(where, f"must be {'>' if open_lo else '>='} {lo:g}; got {v}")
    return v


def _choice(
    m: Mapping[str, Any], key: str, path: str, default: str, allowed: tuple[str, ...], why: str = ""
) -> str:
    if key not in m:
        return default
    v = m[key]
    if v not in allowed or not isinstance(v, str):
        msg = f"must be one of: {', '.join(allowed)}; got {v!r}"
        raise PolicyError(_join(path, key), msg + (f" ({why})" if why else ""))
    return v


# --- the policy -------------------------------------------------------------------------------


def policy_from_mapping(m: Any) -> Policy:
    """Build and validate a :class:`Policy` from parsed YAML/JSON (None: all defaults)."""
    d = DEFAULT_POLICY
    top = _mapping(
        m,
        "",
        (
            "on_upstream_failure",
            "budgets",
            "reprefill_cost_cap",
            "deadlines",
            "leases",
            "limits",
            "journal",
            "tools",
            "liveness",
        ),
    )
    ouf = _mapping(
        top.get("on_upstream_failure"),
        "on_upstream_failure",
        ("before_first_delta", "after_first_delta", "uncertain_source_liveness"),
    )

    p = "on_upstream_failure.before_first_delta"
    bfd = _mapping(ouf.get("before_first_delta"), p, ("require", "action", "max_attempts"))
    action = _choice(bfd, "action", p, d.before_first_delta.action, (RETRY, FAIL))
    retry = action == RETRY
    # With fail_request the defaults follow the action instead of contradicting it.
    max_attempts = _int(bfd, "max_attempts", p, d.before_first_delta.max_attempts if retry else 1, 1, 10)
    if retry and max_attempts < 2:
        raise PolicyError(
            f"{p}.max_attempts",
            f"is 1 with action {RETRY}: that allows no retry; use action: {FAIL}, or max_attempts >= 2",
        )
    if not retry and max_attempts != 1:
        raise PolicyError(
            f"{p}.max_attempts",
            f"is {max_attempts} with action {FAIL}: {FAIL} makes one attempt; set it to 1",
        )
    require = _require(bfd, p, d.before_first_delta.require)
    if retry and FENCED not in require:
        raise PolicyError(
            f"{p}.require",
            f"must include {FENCED} when action is {RETRY}: a retry may start only when the previous "
            "attempt can no longer publish, or the client may get content from two attempts",
        )

    p = "on_upstream_failure.after_first_delta"
    afd = _mapping(ouf.get("after_first_delta"), p, ("action", "client_error", "automatic_retry"))
    after_action = _choice(
        afd,
        "action",
        p,
        "terminate_stream",
        ("terminate_stream",),
        "after the first delta the decode state exists only in the failed replica; nothing can continue it",
    )
    client_error = _choice(
        afd, "client_error", p, "upstream_decode_interrupted", ("upstream_decode_interrupted",)
    )
    if "automatic_retry" in afd and afd["automatic_retry"] is not False:
        raise PolicyError(
            f"{p}.automatic_retry",
            f"must be false; got {afd['automatic_retry']!r}. After the first delta the client already holds "
            "part of one answer; a retry would append a different answer (a repeated fragment or two answers "
            "in one stream). The client decides whether to ask again.",
        )

    p = "on_upstream_failure.uncertain_source_liveness"
    usl = _mapping(ouf.get("uncertain_source_liveness"), p, ("action", "wait_for", "then"))
    usl_action = _choice(
        usl,
        "action",
        p,
        "fence_source_attempt",
        ("fence_source_attempt",),
        "a replica that may be alive must be fenced before anything else happens",
    )
    wait_for = _choice(
        usl,
        "wait_for",
        p,
        d.uncertain_source_liveness.wait_for,
        ("cancel_ack_or_lease_expiry", "lease_expiry"),
        "a partitioned replica may never acknowledge a cancel, so lease expiry must end the wait",
    )
    then = _choice(usl, "then", p, RETRY_IF_NO_DELTA if retry else FAIL, (RETRY_IF_NO_DELTA, FAIL))
    if then == RETRY_IF_NO_DELTA and not retry:
        raise PolicyError(
            f"{p}.then",
            f"is {RETRY_IF_NO_DELTA} but before_first_delta.action is {FAIL}; set then: {FAIL}",
        )

    p = "budgets"
    b = _mapping(top.get(p), p, ("retry_budget_percent", "min_retry_concurrency", "max_concurrent_retries"))
    budgets = Budgets(
        retry_budget_percent=_number(
            b, "retry_budget_percent", p, d.budgets.retry_budget_percent, lo=0, hi=100, open_lo=False
        ),
        min_retry_concurrency=_int(b, "min_retry_concurrency", p, d.budgets.min_retry_concurrency, 0),
        max_concurrent_retries=_int(b, "max_concurrent_retries", p, d.budgets.max_concurrent_retries, 1),
    )
    if (
        retry
        and BUDGET in require
        and budgets.retry_budget_percent == 0
        and budgets.min_retry_concurrency == 0
    ):
        raise PolicyError(
            p,
            f"retry_budget_percent 0 and min_retry_concurrency 0 allow no retry, but action is {RETRY} "
            f"and require has {BUDGET}; raise one of them or use action: {FAIL}",
        )

    p = "reprefill_cost_cap"
    cc = _mapping(top.get(p), p, ("max_prompt_tokens",))
    cost_cap = CostCap(_int(cc, "max_prompt_tokens", p, d.reprefill_cost_cap.max_prompt_tokens, 1))

    p = "deadlines"
    dl = _mapping(top.get(p), p, ("request_seconds", "connect_seconds"))
    deadlines = Deadlines(
        request_seconds=_number(dl, "request_seconds", p, d.deadlines.request_seconds, lo=0, open_lo=True),
        connect_seconds=_number(dl, "connect_seconds", p, d.deadlines.connect_seconds, lo=0, open_lo=True),
    )
    if deadlines.request_seconds <= deadlines.connect_seconds:
        raise PolicyError(
            "deadlines.request_seconds",
            f"({deadlines.request_seconds:g}) must be greater than deadlines.connect_seconds "
            f"({deadlines.connect_seconds:g}): the request deadline covers every connect",
        )

    p = "leases"
    ls = _mapping(top.get(p), p, ("attempt_ttl_seconds",))
    leases = Leases(_int(ls, "attempt_ttl_seconds", p, d.leases.attempt_ttl_seconds, 1))
    if retry and leases.attempt_ttl_seconds >= deadlines.request_seconds:
        raise PolicyError(
            "leases.attempt_ttl_seconds",
            f"({leases.attempt_ttl_seconds}) must be less than deadlines.request_seconds "
            f"({deadlines.request_seconds:g}): fencing may wait a whole TTL before a retry can start",
        )

    p = "limits"
    lm = _mapping(top.get(p), p, ("max_request_body_bytes",))
    limits = Limits(_int(lm, "max_request_body_bytes", p, d.limits.max_request_body_bytes, 1))

    p = "journal"
    jn = _mapping(top.get(p), p, ("retention_seconds",))
    journal = JournalPolicy(
        _number(jn, "retention_seconds", p, d.journal.retention_seconds, lo=0, open_lo=True)
    )

    p = "tools"
    tl = _mapping(
        top.get(p),
        p,
        (
            "retention_seconds",
            "max_stored_response_bytes",
            "call_timeout_seconds",
            "in_progress_wait_seconds",
        ),
    )
    dt = d.tools
    tools = ToolsPolicy(
        retention_seconds=_number(tl, "retention_seconds", p, dt.retention_seconds, lo=0, open_lo=True),
        max_stored_response_bytes=_int(tl, "max_stored_response_bytes", p, dt.max_stored_response_bytes, 0),
        call_timeout_seconds=_number(
            tl, "call_timeout_seconds", p, dt.call_timeout_seconds, lo=0, open_lo=True
        ),
        in_progress_wait_seconds=_number(
            tl, "in_progress_wait_seconds", p, dt.in_progress_wait_seconds, lo=0, open_lo=False
        ),
    )

    p = "liveness"
    lv = _mapping(top.get(p), p, ("progress_gap_seconds",))
    liveness = LivenessPolicy(
        _number(lv, "progress_gap_seconds", p, d.liveness.progress_gap_seconds, lo=0, open_lo=True)
    )

    return Policy(
        on_upstream_failure=OnUpstreamFailure(
            before_first_delta=BeforeFirstDelta(require, cast(BeforeAction, action), max_attempts),
            after_first_delta=AfterFirstDelta(
                cast(Literal["terminate_stream"], after_action),
                cast(Literal["upstream_decode_interrupted"], client_error),
                False,
            ),
            uncertain_source_liveness=UncertainLiveness(
                cast(Literal["fence_source_attempt"], usl_action),
                cast(FenceWait, wait_for),
                cast(UncertainThen, then),
            ),
        ),
        budgets=budgets,
        reprefill_cost_cap=cost_cap,
        deadlines=deadlines,
        leases=leases,
        limits=limits,
        journal=journal,
        tools=tools,
        liveness=liveness,
    )


def _require(m: Mapping[str, Any], path: str, default: frozenset[Requirement]) -> frozenset[Requirement]:
    if "require" not in m:
        return default
    v = m["require"]
    where = _join(path, "require")
    allowed = (FENCED, BUDGET)
    if not isinstance(v, list):
        raise PolicyError(where, f"must be a list, a subset of [{', '.join(allowed)}]; got {_type(v)}")
    for i, item in enumerate(v):
        if item not in allowed or not isinstance(item, str):
            raise PolicyError(f"{where}[{i}]", f"must be one of: {', '.join(allowed)}; got {item!r}")
    if len(set(v)) != len(v):
        raise PolicyError(where, f"lists a condition twice: {v!r}")
    return cast(frozenset[Requirement], frozenset(v))


def policy_to_mapping(policy: Policy) -> dict[str, Any]:
    """The effective policy in the YAML shape (for logs and ``--print-policy``-style output)."""
    b, a, u = policy.before_first_delta, policy.after_first_delta, policy.uncertain_source_liveness
    return {
        "on_upstream_failure": {
            "before_first_delta": {
                "require": [r for r in (FENCED, BUDGET) if r in b.require],
                "action": b.action,
                "max_attempts": b.max_attempts,
            },
            "after_first_delta": {
                "action": a.action,
                "client_error": a.client_error,
                "automatic_retry": a.automatic_retry,
            },
            "uncertain_source_liveness": {"action": u.action, "wait_for": u.wait_for, "then": u.then},
        },
        "budgets": {
            "retry_budget_percent": policy.budgets.retry_budget_percent,
            "min_retry_concurrency": policy.budgets.min_retry_concurrency,
            "max_concurrent_retries": policy.budgets.max_concurrent_retries,
        },
        "reprefill_cost_cap": {"max_prompt_tokens": policy.reprefill_cost_cap.max_prompt_tokens},
        "deadlines": {
            "request_seconds": policy.deadlines.request_seconds,
            "connect_seconds": policy.deadlines.connect_seconds,
        },
        "leases": {"attempt_ttl_seconds": policy.leases.attempt_ttl_seconds},
        "limits": {"max_request_body_bytes": policy.limits.max_request_body_bytes},
        "journal": {"retention_seconds": policy.journal.retention_seconds},
        "tools": {
            "retention_seconds": policy.tools.retention_seconds,
            "max_stored_response_bytes": policy.tools.max_stored_response_bytes,
            "call_timeout_seconds": policy.tools.call_timeout_seconds,
            "in_progress_wait_seconds": policy.tools.in_progress_wait_seconds,
        },
        "liveness": {"progress_gap_seconds": policy.liveness.progress_gap_seconds},
    }


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
    try:
        with open(path, encoding="utf-8") as f:
            doc = yaml.load(f, Loader=_StrictLoader)  # a SafeLoader subclass: no arbitrary objects
    except OSError as exc:
        raise PolicyError("", f"cannot read {path}: {exc.strerror or exc}") from exc
    except yaml.YAMLError as exc:
        raise PolicyError("", f"{path} is not valid YAML: {exc}") from exc
    return policy_from_mapping(doc)
