"""Where retries land well: the gateway's memory of where attempts went and how replicas answered (sans-IO).

One `Placement` per gateway instance, fed by the request machines (`core/request.py`) as their attempts start
and fail; read at admission to order a request's attempts (`core/destinations.py`). It knows:

* **which replica is warm for a prompt's prefix**: the prompt is hashed in blocks (`prompt_blocks` in
  `openai_api.py`, chained, so two prompts share a block only if they share everything before it), and each
  replica remembers the blocks of the prompts it was sent, least recently served forgotten first and aged out
  after about an engine's KV-cache lifetime — the way the Gateway API Inference Extension's prefix scorer
  approximates the engines' caches from routing history. A retry goes where the longest leading run of its
  blocks is warm;
* **which replica said it is overloaded**: a 429 or 503 with `Retry-After` takes it out of the order for that
  long (capped), and one whose connection failed before a request was sent goes last for a moment;
* **which replica keeps failing** (a circuit breaker, when `placement.breaker_failures` is set): that many
  attempts failing before content in a row open its circuit, which keeps it out of every order for a while,
  doubled each time it opens again; once the time is up it is tried again, and one success closes it;
* **whose retries a tenant may still start**: a tenant holds at most its share of its own requests in retry.

Nothing here is shared between gateway instances: each learns from its own attempts (a replica's 429 reaches
every gateway that sends to it), and writing every overload signal to etcd would load etcd exactly when the
pool is in trouble (docs/design.md#where-attempts-go).
"""

from __future__ import annotations

import math
import weakref
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from email.utils import parsedate_to_datetime
from typing import TYPE_CHECKING

from router_sidecar.core.destinations import Candidate, Ranking
from router_sidecar.core.policy import BUDGET, Policy

if TYPE_CHECKING:
    from router_sidecar.core.request import LogicalRequest

__all__ = ["Ejection", "Ejections", "Placement", "PrefixIndex", "RetryBudget", "retry_after_seconds"]


class PrefixIndex:
    """Per replica, the prompt blocks it was sent and when (bounded, least recently served dropped first)."""

    def __init__(self, *, per_replica: int, ttl_seconds: float) -> None:
        self._per_replica = per_replica
        self._ttl = ttl_seconds
        self._blocks: dict[str, OrderedDict[int, float]] = {}

    def record(self, replica: str, blocks: Sequence[int], now: float) -> None:
        served = self._blocks.setdefault(replica, OrderedDict())
        for block in blocks[: self._per_replica]:
            served[block] = now
            served.move_to_end(block)
        while len(served) > self._per_replica:
            served.popitem(last=False)

    def warm(self, replica: str, blocks: Sequence[int], now: float) -> int:
        """How many of `blocks`, from the first, the replica served within the TTL."""
        served = self._blocks.get(replica)
        if not served:
            return 0
        count = 0
        for block in blocks:
            seen = served.get(block)
            if seen is None or now - seen > self._ttl:
                break
            count += 1
        return count

    def forget(self, keep: Iterable[str]) -> None:
        """Drop the replicas not in `keep` (removed from the gateway)."""
        kept = set(keep)
        for replica in [r for r in self._blocks if r not in kept]:
            del self._blocks[replica]

    def size(self, replica: str) -> int:
        return len(self._blocks.get(replica, ()))


def retry_after_seconds(value: str | None, wall_now: float) -> float | None:
    """A `Retry-After` value in seconds from now: delay-seconds or an HTTP-date; None if it is neither."""
    if value is None:
        return None
    text = value.strip()
    if text.isdigit():
        return float(int(text[:9]))
    try:
        when = parsedate_to_datetime(text)
    except (TypeError, ValueError, IndexError):
        return None
    if when.tzinfo is None:
        return None
    return max(0.0, when.timestamp() - wall_now)


OVERLOAD, BREAKER, CONNECT = "overload", "breaker", "connect"


@dataclass(frozen=True, slots=True)
class Ejection:
    until: float  # monotonic
    why: str
    kind: str  # OVERLOAD (it said so), BREAKER (its circuit is open): out of the order; CONNECT: last in it

    @property
    def hard(self) -> bool:
        return self.kind != CONNECT


class Ejections:
    def __init__(self) -> None:
        self._by_replica: dict[str, Ejection] = {}

    def eject(self, replica: str, ejection: Ejection) -> None:
        current = self._by_replica.get(replica)
        # A hard ejection is never shortened by a soft one, nor by a shorter hard one.
        if current is None or (ejection.hard, ejection.until) > (current.hard, current.until):
            self._by_replica[replica] = ejection

    def active(self, now: float) -> dict[str, Ejection]:
        for replica in [r for r, e in self._by_replica.items() if e.until <= now]:
            del self._by_replica[replica]  # lapsed: it comes back by itself
        return dict(self._by_replica)


class Breakers:
    """Per replica, the attempts that failed before content since its last success."""

    def __init__(self, *, failures: int, open_seconds: float, max_open_seconds: float) -> None:
        self._failures = failures
        self._open_seconds = open_seconds
        self._max_open_seconds = max_open_seconds
        self._in_a_row: dict[str, int] = {}

    def failed(self, replica: str, now: float) -> Ejection | None:
        """One more failure: the ejection that opens (or opens again) its circuit, if it does."""
        if self._failures <= 0:
            return None
        count = self._in_a_row[replica] = self._in_a_row.get(replica, 0) + 1
        if count < self._failures:
            return None
        seconds = min(self._open_seconds * 2 ** min(count - self._failures, 20), self._max_open_seconds)
        why = f"circuit open: {count} attempts in a row failed before content"
        return Ejection(now + seconds, why, BREAKER)

    def succeeded(self, replica: str) -> None:
        self._in_a_row.pop(replica, None)


class RetryBudget:
    """Each tenant's requests in retry at once, at most max(min, percent × its requests in flight).

    Counted from the live requests themselves (weakly held, so none leaks a slot): a request is in retry from
    the first retry it was given until its first content is delivered (or it ends): the retries that load a
    failing pool are the ones still waiting for a prefill."""

    def __init__(self, *, percent: float, minimum: int) -> None:
        self._percent = percent
        self._minimum = minimum
        self._by_tenant: dict[str, weakref.WeakSet[LogicalRequest]] = {}

    def track(self, request: LogicalRequest) -> None:
        self._by_tenant.setdefault(request.tenant, weakref.WeakSet()).add(request)

    def refusal(self, request: LogicalRequest) -> str | None:
        """Why the tenant may not start this request's retry now (None: it may)."""
        tenant = self._by_tenant.get(request.tenant)
        if tenant is None:
            return None
        live = [r for r in tenant if not r.is_terminal]
        for ended in [r for r in tenant if r.is_terminal]:
            tenant.discard(ended)
        in_retry = sum(1 for r in live if r.retries_given and not r.first_delta_sent and r is not request)
        allowed = max(self._minimum, math.floor(self._percent / 100 * len(live)))
        if in_retry < allowed:
            return None
        return (
            f"tenant budget: {in_retry} of the tenant's {len(live)} requests in flight are in retry, its "
            f"budget allows {allowed} (budgets.tenant_retry_budget_percent {self._percent:g}, "
            f"tenant_min_retry_concurrency {self._minimum})"
        )


class Placement:
    def __init__(
        self,
        policy: Policy,
        *,
        clock: Callable[[], float],  # monotonic seconds: ejections and prefix ages
        wall_clock: Callable[[], float],  # seconds since the epoch: a Retry-After given as an HTTP-date
    ) -> None:
        p = policy.placement
        self._settings = p
        self._clock = clock
        self._wall_clock = wall_clock
        self.prefixes = PrefixIndex(per_replica=p.prefix_blocks_per_replica, ttl_seconds=p.prefix_ttl_seconds)
        self.ejections = Ejections()
        self.breakers = Breakers(
            failures=p.breaker_failures,
            open_seconds=p.breaker_open_seconds,
            max_open_seconds=p.breaker_max_open_seconds,
        )
        self.budget = RetryBudget(
            percent=policy.budgets.tenant_retry_budget_percent,
            minimum=policy.budgets.tenant_min_retry_concurrency,
        )
        self._budgeted = BUDGET in policy.before_first_delta.require
        self._requests: weakref.WeakSet[LogicalRequest] = weakref.WeakSet()

    # --- what the request machines tell it -------------------------------------------------------------

    def admitted(self, request: LogicalRequest) -> None:
        self._requests.add(request)
        self.budget.track(request)

    def attempt_sent(self, replica: str, blocks: Sequence[int]) -> None:
        """The replica has the prompt (it may prefill it): its blocks are warm there from now on."""
        if blocks:
            self.prefixes.record(replica, blocks, self._clock())

    def answered(self, replica: str, status: int, retry_after: str | None) -> None:
        """A replica's refusal: a 429 or 503 with Retry-After takes it out of the order for that long."""
        if status not in (429, 503):
            return
        seconds = retry_after_seconds(retry_after, self._wall_clock())
        if seconds is None or seconds <= 0:
            return
        seconds = min(seconds, self._settings.max_retry_after_seconds)
        if seconds <= 0:
            return
        why = f"answered {status} with Retry-After {retry_after}"
        self.ejections.eject(replica, Ejection(self._clock() + seconds, why, OVERLOAD))

    def unreachable(self, replica: str) -> None:
        """A connection to the replica died before a request was sent on it: last in the order a moment (a
        failure for its circuit breaker too)."""
        seconds = self._settings.connect_failure_seconds
        if seconds > 0:
            why = "its connection failed before a request was sent"
            self.ejections.eject(replica, Ejection(self._clock() + seconds, why, CONNECT))
        self.failed_before_content(replica)

    def failed_before_content(self, replica: str) -> None:
        opened = self.breakers.failed(replica, self._clock())
        if opened is not None:
            self.ejections.eject(replica, opened)

    def succeeded(self, replica: str) -> None:
        """An attempt on the replica delivered content: its circuit is closed."""
        self.breakers.succeeded(replica)

    def retry_refusal(self, request: LogicalRequest) -> str | None:
        return self.budget.refusal(request) if self._budgeted else None

    # --- what admission reads ----------------------------------------------------------------------------

    def ranking(
        self, candidates: Sequence[Candidate], blocks: Sequence[int]
    ) -> tuple[list[Candidate], Ranking]:
        """The candidates with the overloaded ones marked unusable, and how to rank the rest."""
        now = self._clock()
        ejected = self.ejections.active(now)
        marked: list[Candidate] = []
        demoted: set[str] = set()
        for candidate in candidates:
            ejection = ejected.get(candidate.address)
            if ejection is not None and ejection.hard and not candidate.why_not:
                left = ejection.until - now
                why = f"it {ejection.why}" if ejection.kind == OVERLOAD else ejection.why
                candidate = Candidate(
                    candidate.address,
                    candidate.digest,
                    f"ejected for {left:.1f} s more: {why}",
                    ejected_for=left,
                    ejected_by=ejection.kind,
                )
            elif ejection is not None:
                demoted.add(candidate.address)
            marked.append(candidate)
        in_flight = self.in_flight()
        warm = {c.address: self.prefixes.warm(c.address, blocks, now) for c in marked if not c.why_not}
        return marked, Ranking(blocks=len(blocks), warm=warm, in_flight=in_flight, demoted=frozenset(demoted))

    def in_flight(self) -> Mapping[str, int]:
        """Requests of this gateway whose current attempt is on each replica."""
        counts: Counter[str] = Counter()
        for request in [r for r in self._requests if r.is_terminal]:
            self._requests.discard(request)
        for request in self._requests:
            if request.attempts:
                counts[request.attempts[-1].replica] += 1
        return counts
