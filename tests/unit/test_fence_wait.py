"""What a fence waits for (policy `uncertain_source_liveness.wait_for`), against the in-memory store.

`cancel_ack_or_lease_expiry` (the default) takes the replica side's cancel ack as the proof as soon as it is
there; `lease_expiry` ignores any ack and always waits out the lease's expiry bound (for replica sides that
are not trusted to ack honestly, at the cost of a whole TTL per fence).
"""

from __future__ import annotations

import asyncio
import time

import pytest

from router_sidecar.coordination.fencing import AttemptLeases, FenceProof
from router_sidecar.coordination.store import MemoryStore, keys


@pytest.mark.parametrize(
    ("accept_cancel_ack", "proof"),
    [(True, FenceProof.CANCEL_ACK), (False, FenceProof.LEASE_EXPIRY)],
)
def test_a_fence_takes_the_cancel_ack_only_when_the_policy_accepts_it(
    accept_cancel_ack: bool, proof: FenceProof
) -> None:
    async def go() -> tuple[FenceProof | None, float, float]:
        store = MemoryStore()
        leases = AttemptLeases(store, 2)
        held = await leases.grant(attempt_id="a1", request_id="r1", replica="h:1")
        assert held.lease is not None
        await store.put(keys.cancel_ack("a1"), b"{}")  # the replica side already acked its cancel
        result = await leases.fence(held, accept_cancel_ack=accept_cancel_ack)
        assert held.fenced.is_set() and held.lease.id in store.revoked
        return result, time.monotonic(), held.expiry_bound

    result, ended, expiry_bound = asyncio.run(asyncio.wait_for(go(), 15))
    assert result is proof
    # Proven by the ack: long before the lease could have expired; by expiry: never before its bound.
    assert (ended >= expiry_bound) is (proof is FenceProof.LEASE_EXPIRY)
