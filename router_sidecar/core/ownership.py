"""Records of a lost gateway instance (sans-IO): what another instance writes when it closes them.

Every instance holds an owner lease; each request record it serves names it (`owner`) and has an in-flight
index entry under it until the journal says the request ended. When an owner lease lapses, whichever
instance sees it first closes that owner's open records — once, by compare-and-swap — with the facts the
record already holds: the request ends `interrupted` if its client had content (the count is the last
journaled one), else `failed`; either way with outcome `gateway_lost`.
"""

from __future__ import annotations

from typing import Any

from router_sidecar.core.events import EventName, Outcome
from router_sidecar.core.request import TERMINAL_PHASES, Phase
from router_sidecar.core.views import journal_event

_TERMINAL = {phase.value for phase in TERMINAL_PHASES}


def close_lost_record(
    record: dict[str, Any], *, owner: str, closed_by: str, now: float
) -> dict[str, Any] | None:
    """The record closed for its lost owner, or None when it is not that owner's open record."""
    if record.get("phase") in _TERMINAL or record.get("owner") != owner:
        return None
    phase = Phase.INTERRUPTED if record.get("first_delta_sent") else Phase.FAILED
    event = journal_event(
        {
            "t": round(now, 6),
            "event": EventName.GATEWAY_LOST.value,
            "owner": owner,
            "closed_by": closed_by,
            "delivered_output_tokens": record.get("delivered_output_tokens", 0),
        }
    )
    # The record stays the dict it was read as: fields a newer gateway wrote are kept as they are.
    return {
        **record,
        "phase": phase.value,
        "outcome": Outcome.GATEWAY_LOST.value,
        "updated_at": round(now, 6),
        "events": [*record.get("events", []), event],
    }


def attempt_lease_ids(record: dict[str, Any]) -> list[int]:
    """The etcd leases of the record's attempts that were not yet revoked (to revoke them now)."""
    ids: list[int] = []
    for attempt in record.get("attempts", []):
        lease = attempt.get("lease") or {}
        if lease.get("lease_id") and not lease.get("revoked_at"):
            try:
                ids.append(int(lease["lease_id"], 16))
            except (TypeError, ValueError):
                continue
    return ids
