"""Where a request's attempts go: an ordered list of replicas, decided once at admission, with its reasons
(sans-IO).

Envoy's `override_host` load-balancing policy takes the list from the request's `envoy.lb` metadata: the
first attempt goes to its first entry, each retry to the next one (an entry Envoy does not know is skipped),
and only when the list runs out does the cluster's own balancer choose (inside the pinned compatibility group,
never a host tried before). So where an attempt goes is our decision, made here and journaled with why
(docs/design.md#where-attempts-go):

* behind an endpoint picker (GAIE's EPP, llm-d) its list comes first, in its order, less the entries that are
  not ours to send to (unknown to the gateway, incompatible with the pinned fingerprint, draining, lost);
* then our own order of the other usable, compatible replicas. Without a picker the first attempt goes round
  robin, one step per request; the replicas after it (every retry's) are ranked: the longest warm prefix of
  the prompt first, then the fewest requests in flight, then round robin (`core/placement.py` says which
  replica is warm and which is overloaded). A replica that announced an overload (Retry-After) is left out;
  one whose connection just failed goes last.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

__all__ = [
    "DRAINING",
    "PICKER_KEY",
    "Candidate",
    "Destinations",
    "Ranking",
    "choose",
    "holder_only",
    "picker_list",
]

# The endpoint picker protocol's key (GAIE 004-endpoint-picker-protocol) in dynamic metadata namespace
# `envoy.lb`: the picker's list, which the gateway replaces with its order of attempts. (The replica that
# served goes back under `x-gateway-destination-endpoint-served`: Envoy's override_host writes it.)
PICKER_KEY = "x-gateway-destination-endpoint"
# A picker names a few endpoints; a list past these bounds is cut, not trusted.
MAX_PICKER_ENTRIES = 64
MAX_PICKER_TEXT = 4096

PICKER, GATEWAY, PICKER_THEN_GATEWAY = "picker", "gateway", "picker+gateway"
HOLDER = "holder"  # the one replica that holds the state the request continues
DRAINING = "draining"


@dataclass(frozen=True, slots=True)
class Candidate:
    """A replica the gateway knows, as Envoy names it (`ip:port`)."""

    address: str
    digest: str | None = None  # its compatibility fingerprint (None: a static replica, compatible with all)
    why_not: str = ""  # why no new attempt may go to it now (draining, failing its health checks); "": it may
    ejected_for: float | None = None  # seconds left of its ejection (why_not says why)
    ejected_by: str = ""  # "overload" (it announced one) or "breaker" (its circuit is open)


@dataclass(frozen=True, slots=True)
class Ranking:
    """What ranks the replicas after the first attempt's: the prompt's blocks warm on each, their load."""

    blocks: int = 0  # the prompt's blocks
    warm: Mapping[str, int] = field(default_factory=dict)  # leading blocks of the prompt each replica has
    in_flight: Mapping[str, int] = field(default_factory=dict)  # this gateway's requests on each
    demoted: frozenset[str] = frozenset()  # last in the order (their connection just failed)


@dataclass(frozen=True, slots=True)
class Destinations:
    order: tuple[str, ...]  # the attempts' replicas, first attempt first
    source: str  # PICKER, GATEWAY or PICKER_THEN_GATEWAY
    picker: tuple[str, ...] = ()  # the picker's list as it came
    excluded: tuple[tuple[str, str], ...] = ()  # (address, why) left out of the order
    from_picker: int = 0  # how many entries of `order` (its head) are the picker's
    prefix_blocks: int = 0  # the prompt's blocks (core/placement.py)
    # (address, warm blocks, requests in flight) of the entries the gateway ranked, in the order's order
    ranked: tuple[tuple[str, int, int], ...] = ()
    # Every usable compatible replica is ejected: the shortest time left (no attempt is made), and by what
    # ("overload": it announced one; "breaker": its circuit is open).
    overloaded_for: float | None = None
    ejected_by: str = ""
    # (address, model) of the replicas of fallback models, at the order's end (policy fallback.models)
    fallback: tuple[tuple[str, str], ...] = ()
    # Why the order holds no replica of the request's own model, when it holds only fallback ones.
    fallback_cause: str = ""

    def fallback_model(self, address: str) -> str | None:
        """The fallback model `address` serves in this order (None: not a fallback entry)."""
        return next((model for a, model in self.fallback if a == address), None)

    def with_fallback(self, targets: Sequence[tuple[str, str]], own: int, cause: str = "") -> Destinations:
        """This order's first `own` entries, then the fallback models' replicas `targets` (address, model)."""
        own_order = self.order[:own]
        fallback = tuple((a, m) for a, m in dict(targets).items() if a not in own_order)
        addresses = tuple(a for a, _ in fallback)
        return dataclasses.replace(
            self,
            order=own_order + addresses,
            # In the order now, so not "left out" of it (a fallback replica is incompatible with the pin).
            excluded=tuple(x for x in self.excluded if x[0] not in addresses),
            fallback=fallback,
            fallback_cause=cause,
            overloaded_for=None if fallback else self.overloaded_for,
        )

    def why(self, address: str) -> str:
        """Why an attempt that went to `address` went there."""
        if address in self.order:
            index = self.order.index(address)
            if self.source == HOLDER:
                return "holder of the stored response it continues"
            model = self.fallback_model(address)
            if model is not None:
                return f"fallback to model {model}, choice #{index + 1}"
            why = f"{PICKER if index < self.from_picker else GATEWAY} choice #{index + 1}"
            score = next((r for r in self.ranked if r[0] == address), None)
            if score is not None:
                why += f" (warm prefix {score[1]} of {self.prefix_blocks} blocks, {score[2]} in flight)"
            return why
        return "envoy: past the end of the order, or a replica the order does not name"


def picker_list(value: object) -> tuple[str, ...]:
    """The picker's endpoints from its metadata value: a comma-separated string (the protocol), or a list
    of such strings; anything else is no list. Bounded, blanks dropped (entries are judged by `choose`)."""
    if isinstance(value, str):
        parts = value[:MAX_PICKER_TEXT].split(",")
    elif isinstance(value, list | tuple):
        texts = [v[:MAX_PICKER_TEXT] for v in value[:MAX_PICKER_ENTRIES] if isinstance(v, str)]
        parts = [part for text in texts for part in text.split(",")]
    else:
        return ()
    return tuple(p.strip() for p in parts if p.strip())[:MAX_PICKER_ENTRIES]


def choose(
    candidates: Sequence[Candidate],
    *,
    pinned: str | None,
    picker: Sequence[str] = (),
    turn: int = 0,
    ranking: Ranking | None = None,
) -> Destinations:
    """The order of attempts: the picker's usable, compatible entries in its order, then the other usable,
    compatible candidates: without a picker the first round robin from `turn`, then the rest ranked."""
    ranking = ranking or Ranking()
    known = {c.address: c for c in candidates}
    excluded: dict[str, str] = {}

    def fits(address: str) -> bool:
        candidate = known.get(address)
        if candidate is None:
            why = "not a replica this gateway knows"
        elif candidate.why_not:
            why = candidate.why_not
        elif pinned is not None and candidate.digest not in (None, pinned):
            why = f"incompatible with the pinned fingerprint {pinned}"
        else:
            return True
        excluded.setdefault(address, why)
        return False

    from_picker = [a for a in dict.fromkeys(picker) if fits(a)]
    rest = [a for a in known if a not in from_picker and fits(a)]
    if rest:
        step = turn % len(rest)
        rest = rest[step:] + rest[:step]
    head: list[str] = []
    if not from_picker and rest:
        # The first attempt: round robin, a demoted replica only when there is no other.
        head = [next((a for a in rest if a not in ranking.demoted), rest[0])]
        rest.remove(head[0])
    position = {a: i for i, a in enumerate(rest)}
    rest.sort(
        key=lambda a: (
            a in ranking.demoted,
            -ranking.warm.get(a, 0),
            ranking.in_flight.get(a, 0),
            position[a],
        )
    )
    ranked = tuple((a, ranking.warm.get(a, 0), ranking.in_flight.get(a, 0)) for a in rest)
    gateway = head + rest
    source = PICKER_THEN_GATEWAY if from_picker and gateway else PICKER if from_picker else GATEWAY
    order = tuple(from_picker + gateway)
    overloaded_for, ejected_by = None, ""
    if not order:
        ejected = [
            (c.ejected_for, c.ejected_by)
            for c in candidates
            if c.ejected_for is not None and (pinned is None or c.digest in (None, pinned))
        ]
        if ejected:
            overloaded_for, ejected_by = min(ejected)
    return Destinations(
        order,
        source,
        tuple(picker),
        tuple(excluded.items()),
        from_picker=len(from_picker),
        prefix_blocks=ranking.blocks,
        ranked=ranked if ranking.blocks else (),
        overloaded_for=overloaded_for,
        ejected_by=ejected_by,
    )


def holder_only(
    candidates: Sequence[Candidate], holder: str, picker: Sequence[str] = ()
) -> Destinations | str:
    """A request on state that one replica holds (a stored response): that replica only, or why it cannot
    be. A draining replica still serves what it holds; a picker's list does not apply."""
    candidate = next((c for c in candidates if c.address == holder), None)
    if candidate is None:
        return "is no longer a replica of this gateway (lost, or removed)"
    if candidate.why_not and candidate.why_not != DRAINING:
        return f"is {candidate.why_not}"
    return Destinations((holder,), HOLDER, tuple(picker))
