"""Parsing of the simulator's per-request fault spec (request header ``x-sim-fault``).

Pure: no I/O. Grammar (one or more ``;``-separated clauses)::

    spec     := clause (";" clause)*
    clause   := ACTION "@" POINT (" " MODIFIER)*
    ACTION   := exit | reset | stall | close | error | abort | stop | status503 | status429 | oversize | delay
    POINT    := tool | headers | role | token:N | after:N | done | terminal   (N >= 1)
    MODIFIER := attempt=K[,K...] | replica=NAME[,NAME...] | model=NAME[,NAME...] | for=SECONDS
              | bytes=N | retry_after=SECONDS | retry_after=date:SECONDS

``model=`` selects the replicas serving one of those models (their ``--model``): a fault on every replica of
one model and on none of another, as a fallback to another model needs. ``for`` is only accepted on ``stall``
(optional: stall that long, then continue) and ``delay`` (required). ``status503`` and ``status429`` are only
accepted at ``@headers``, and only they take ``retry_after``: their reply then carries a ``Retry-After``
header, ``retry_after=2`` as delta-seconds (``Retry-After: 2``; whole seconds >= 0), ``retry_after=date:2`` as
the HTTP-date that many seconds after the reply, rounded up to the whole second (``Retry-After: Fri, 04 Dec
2026 21:08:30 GMT``); without it no ``Retry-After`` is sent. ``oversize`` only at ``@token:N`` (``bytes=`` is
its size, default :data:`DEFAULT_OVERSIZE_BYTES`). ``abort`` and ``stop`` take effect at the next content
event boundary (``abort@after:2`` ends with event 3). Anything else is a :class:`FaultSpecError` naming the
bad clause, so that a typo in a test fails loudly instead of silently running clean.

The same names work on every API the simulator serves (chat completions, completions, the Responses API,
the Messages API); what each does there is :mod:`router_testbed.sim.server`'s and ``docs/simulator.md``'s
table. ``stop`` is not a failure: the model ends at content event N (``finish_reason`` ``"stop"``, a
Responses ``status`` of ``"completed"``, a Messages ``stop_reason`` of ``"end_turn"``).

Points, in the order a request passes them:

* ``tool`` — agent-worker mode only (``--tool-url``): right after the tool call returned, before anything
  is written to the client (no status line, no byte). ``exit@tool attempt=1`` is a worker that dies after
  its side effect and before its first delta. Without ``--tool-url`` a ``@tool`` clause never fires.
* ``headers`` — just before the status line is written.
* ``role`` — after the status line and the prefill delay, before chat's role-only event.
* ``token:N`` / ``after:N`` — just before / right after content event N was written.
* ``done`` — after the last content event, before the finish/usage events and ``[DONE]`` (Responses: before
  the ``*.done`` events; Messages: before ``content_block_stop``).
* ``terminal`` — just before the API's terminal event: ``data: [DONE]``, ``response.completed``,
  ``message_stop``. ``close@terminal`` is a clean end without it.
"""

from __future__ import annotations

import email.utils
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal

Action = Literal[
    "exit", "reset", "stall", "close", "error", "abort", "stop", "status503", "status429", "oversize", "delay"
]
PointKind = Literal["tool", "headers", "role", "token", "after", "done", "terminal"]

ACTIONS: frozenset[str] = frozenset(
    {
        "exit",
        "reset",
        "stall",
        "close",
        "error",
        "abort",
        "stop",
        "status503",
        "status429",
        "oversize",
        "delay",
    }
)
_SIMPLE_POINTS: frozenset[str] = frozenset({"tool", "headers", "role", "done", "terminal"})
_INDEXED_POINTS: frozenset[str] = frozenset({"token", "after"})
_STATUS_ACTIONS: frozenset[str] = frozenset({"status503", "status429"})

HEADER = "x-sim-fault"
# oversize's default size: above the gateway's default limits.max_event_bytes (1 MiB).
DEFAULT_OVERSIZE_BYTES = 2 * 1024 * 1024
MAX_OVERSIZE_BYTES = 64 * 1024 * 1024
MAX_RETRY_AFTER_SECONDS = 86400
_MODIFIERS = ("attempt", "replica", "model", "for", "bytes", "retry_after")


class FaultSpecError(ValueError):
    """A clause of the fault spec could not be parsed; ``clause`` is the offending text."""

    def __init__(self, clause: str, reason: str) -> None:
        super().__init__(f"invalid x-sim-fault clause {clause!r}: {reason}")
        self.clause = clause
        self.reason = reason


@dataclass(frozen=True)
class Point:
    kind: PointKind
    n: int | None = None

    def __str__(self) -> str:
        return self.kind if self.n is None else f"{self.kind}:{self.n}"


TOOL = Point("tool")
HEADERS = Point("headers")
ROLE = Point("role")
DONE = Point("done")
TERMINAL = Point("terminal")


def token_point(n: int) -> Point:
    """The point just before content event ``n`` (1-based) is written."""
    return Point("token", n)


def after_point(n: int) -> Point:
    """The point right after content event ``n`` (1-based) was written and flushed."""
    return Point("after", n)


@dataclass(frozen=True)
class RetryAfter:
    """A status fault's ``Retry-After``: ``seconds`` from the reply, sent as delta-seconds or, with
    ``http_date``, as the HTTP-date that many seconds after the reply."""

    seconds: int
    http_date: bool = False

    def header_value(self, now: float) -> str:
        """The header's value for a reply written at ``now`` (epoch seconds)."""
        if not self.http_date:
            return str(self.seconds)
        return email.utils.formatdate(math.ceil(now) + self.seconds, usegmt=True)


@dataclass(frozen=True)
class Clause:
    action: Action
    point: Point
    attempts: frozenset[int] | None = None
    replicas: frozenset[str] | None = None
    models: frozenset[str] | None = None  # only on a replica serving one of these models
    duration: float | None = None
    size: int | None = None  # oversize: bytes of the event's text
    raw: str = field(default="", compare=False)
    retry_after: RetryAfter | None = None  # status503/status429: the reply's Retry-After

    def label(self) -> str:
        return f"{self.action}@{self.point}"

    def applies_to(self, *, attempt: int | None, replica: str, model: str | None = None) -> bool:
        """Whether the clause's ``attempt=``/``replica=``/``model=`` filters select this request on this
        replica (serving ``model``).

        A clause with ``attempt=`` never applies to a request without a parseable
        ``x-envoy-attempt-count`` header.
        """
        if self.attempts is not None and (attempt is None or attempt not in self.attempts):
            return False
        if self.models is not None and model not in self.models:
            return False
        return self.replicas is None or replica in self.replicas


def _parse_point(text: str, clause: str) -> Point:
    if text in _SIMPLE_POINTS:
        return Point(text)  # type: ignore[arg-type]
    kind, sep, num = text.partition(":")
    if sep and kind in _INDEXED_POINTS:
        if not num.isdigit() or int(num) < 1:
            raise FaultSpecError(clause, f"point {text!r} needs an integer N >= 1")
        return Point(kind, int(num))  # type: ignore[arg-type]
    raise FaultSpecError(
        clause, f"unknown point {text!r} (expected tool, headers, role, token:N, after:N, done, terminal)"
    )


def _parse_ints(value: str, clause: str) -> frozenset[int]:
    items = [v.strip() for v in value.split(",")]
    if not items or any(not v.isdigit() or int(v) < 1 for v in items):
        raise FaultSpecError(clause, f"attempt={value!r} must be a comma-separated list of integers >= 1")
    return frozenset(int(v) for v in items)


def _parse_names(key: str, value: str, clause: str) -> frozenset[str]:
    items = [v.strip() for v in value.split(",")]
    if not items or any(not v for v in items):
        raise FaultSpecError(clause, f"{key}={value!r} must be a comma-separated list of names")
    return frozenset(items)


def _parse_seconds(value: str, clause: str) -> float:
    try:
        seconds = float(value)
    except ValueError:
        raise FaultSpecError(clause, f"for={value!r} is not a number of seconds") from None
    if not math.isfinite(seconds) or seconds < 0:
        raise FaultSpecError(clause, f"for={value!r} must be a finite number >= 0")
    return seconds


def _parse_size(value: str, clause: str) -> int:
    if not value.isdigit() or not 1 <= int(value) <= MAX_OVERSIZE_BYTES:
        raise FaultSpecError(clause, f"bytes={value!r} must be an integer from 1 to {MAX_OVERSIZE_BYTES}")
    return int(value)


def _parse_retry_after(value: str, clause: str) -> RetryAfter:
    seconds = value.removeprefix("date:")
    if not seconds.isdigit() or int(seconds) > MAX_RETRY_AFTER_SECONDS:
        raise FaultSpecError(
            clause,
            f"retry_after={value!r} must be whole seconds from 0 to {MAX_RETRY_AFTER_SECONDS}, "
            "or date:SECONDS",
        )
    return RetryAfter(int(seconds), http_date=value.startswith("date:"))


def parse_clause(text: str) -> Clause:
    """Parse one clause, e.g. ``"reset@token:3 attempt=1 replica=r1"``."""
    clause = text.strip()
    head, *mods = clause.split()
    action, sep, point_text = head.partition("@")
    if not sep:
        raise FaultSpecError(clause, "expected ACTION@POINT")
    if action not in ACTIONS:
        expected = ", ".join(sorted(ACTIONS))
        raise FaultSpecError(clause, f"unknown action {action!r} (expected one of {expected})")
    point = _parse_point(point_text, clause)
    attempts: frozenset[int] | None = None
    replicas: frozenset[str] | None = None
    models: frozenset[str] | None = None
    duration: float | None = None
    size: int | None = None
    retry_after: RetryAfter | None = None
    for mod in mods:
        key, eq, value = mod.partition("=")
        if not eq or not value:
            raise FaultSpecError(clause, f"modifier {mod!r} is not key=value")
        if key == "attempt" and attempts is None:
            attempts = _parse_ints(value, clause)
        elif key == "replica" and replicas is None:
            replicas = _parse_names(key, value, clause)
        elif key == "model" and models is None:
            models = _parse_names(key, value, clause)
        elif key == "for" and duration is None:
            duration = _parse_seconds(value, clause)
        elif key == "bytes" and size is None:
            size = _parse_size(value, clause)
        elif key == "retry_after" and retry_after is None:
            retry_after = _parse_retry_after(value, clause)
        elif key in _MODIFIERS:
            raise FaultSpecError(clause, f"modifier {key!r} given twice")
        else:
            expected = "attempt=, replica=, model=, for=, bytes=, retry_after="
            raise FaultSpecError(clause, f"unknown modifier {key!r} (expected {expected})")
    if duration is not None and action not in ("stall", "delay"):
        raise FaultSpecError(clause, "for= is only valid with stall or delay")
    if action == "delay" and duration is None:
        raise FaultSpecError(clause, "delay needs for=SECONDS")
    if action in _STATUS_ACTIONS and point != HEADERS:
        raise FaultSpecError(clause, f"{action} is only valid at @headers")
    if size is not None and action != "oversize":
        raise FaultSpecError(clause, "bytes= is only valid with oversize")
    if retry_after is not None and action not in _STATUS_ACTIONS:
        raise FaultSpecError(clause, "retry_after= is only valid with status503 or status429")
    if action == "oversize":
        if point.kind != "token":
            raise FaultSpecError(
                clause, "oversize is only valid at @token:N (content event N is the big one)"
            )
        size = size or DEFAULT_OVERSIZE_BYTES
    return Clause(
        action=action,  # type: ignore[arg-type]
        point=point,
        attempts=attempts,
        replicas=replicas,
        models=models,
        duration=duration,
        size=size,
        raw=clause,
        retry_after=retry_after,
    )


def parse_fault_spec(spec: str | None) -> list[Clause]:
    """Parse a whole ``x-sim-fault`` header value; ``None``/blank means no fault."""
    if spec is None:
        return []
    return [parse_clause(part) for part in spec.split(";") if part.strip()]


def parse_attempt(value: str | None) -> int | None:
    """Parse ``x-envoy-attempt-count``; anything unparseable counts as absent."""
    if value is None:
        return None
    value = value.strip()
    return int(value) if value.isdigit() else None


class FaultPlan:
    """The clauses that apply to one request on one replica (serving ``model``); each fires at most once."""

    def __init__(
        self, clauses: Iterable[Clause], *, attempt: int | None, replica: str, model: str | None = None
    ) -> None:
        self._pending: list[Clause] = [
            c for c in clauses if c.applies_to(attempt=attempt, replica=replica, model=model)
        ]
        self.fired: list[Clause] = []

    @property
    def empty(self) -> bool:
        return not self._pending

    def oversized(self) -> dict[int, int]:
        """Content event number -> bytes, for every pending ``oversize`` clause (the event is rendered big
        from the start; the clause still fires, and is logged, when its point is reached)."""
        return {
            c.point.n or 0: c.size or DEFAULT_OVERSIZE_BYTES for c in self._pending if c.action == "oversize"
        }

    def take(self, point: Point) -> Clause | None:
        """Return (and consume) the first pending clause at ``point``, if any."""
        for i, clause in enumerate(self._pending):
            if clause.point == point:
                del self._pending[i]
                self.fired.append(clause)
                return clause
        return None
