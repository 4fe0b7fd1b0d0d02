"""A draining replica (its engine answers /health 503 but still serves) stays registered, marked draining:
no new attempt goes there (EDS, pinning, retry targets), and the attempts in flight there are not lost."""

from __future__ import annotations

import asyncio
import dataclasses
import json

from router_sidecar.coordination.liveness import Liveness, LivenessMonitor
from router_sidecar.coordination.registry_store import Replica
from router_sidecar.core.fingerprint import EngineInfo, Fingerprint
from router_sidecar.extproc.discovery import choose_pin, compatible_alternatives, load_assignment


def replica(address: str, *, draining: bool = False) -> Replica:
    fingerprint = Fingerprint(model_id="tiny")
    return Replica(
        address=address,
        fingerprint=fingerprint,
        digest=fingerprint.digest(),
        engine_name="sglang",
        engine_version="0.5.23",
        engine=EngineInfo(root=None, max_model_len=None),
        registered_at=1.0,
        agent_id="agent",
        draining=draining,
    )


def test_the_draining_mark_round_trips_and_is_absent_otherwise() -> None:
    plain, draining = replica("10.0.0.1:8000"), replica("10.0.0.1:8000", draining=True)
    assert "draining" not in json.loads(plain.to_value())  # an older reader sees the same value as before
    assert json.loads(draining.to_value())["draining"] is True
    assert Replica.from_value(draining.to_value()).draining is True
    assert Replica.from_value(plain.to_value()).draining is False
    assert not plain.same_content(draining)  # the agent republishes when the mark changes


def test_a_draining_replica_gets_no_new_attempt_and_is_not_lost() -> None:
    async def go() -> None:
        liveness = LivenessMonitor(None)
        liveness.replicas = {
            "10.0.0.1:8000": replica("10.0.0.1:8000", draining=True),
            "10.0.0.2:8000": replica("10.0.0.2:8000"),
        }
        liveness._ever_registered.update(liveness.replicas)
        assert set(liveness.routable) == {"10.0.0.2:8000"}
        assert liveness.state("10.0.0.1:8000") is Liveness.HEALTHY  # its attempts in flight go on
        seen: list[str] = []

        async def lost(cause: str) -> None:
            seen.append(cause)

        liveness.on_loss("10.0.0.1:8000", lost)
        await asyncio.sleep(0)
        assert seen == []
        endpoints = load_assignment(liveness.routable).endpoints[0].lb_endpoints
        assert [e.endpoint.address.socket_address.address for e in endpoints] == ["10.0.0.2"]
        pinned = choose_pin(liveness.routable, "tiny")
        assert pinned is not None and pinned.address == "10.0.0.2:8000"
        digest = pinned.digest
        assert compatible_alternatives(liveness.routable, digest, exclude="10.0.0.2:8000") == 0
        everyone = {a: dataclasses.replace(r, draining=False) for a, r in liveness.replicas.items()}
        assert compatible_alternatives(everyone, digest, exclude="10.0.0.2:8000") == 1

    asyncio.run(go())


def test_engine_facts_round_trip() -> None:
    sglang = dataclasses.replace(
        replica("10.0.0.1:8000"), engine=EngineInfo(root="/m/tiny", max_model_len=1024, model_type="llama")
    )
    assert Replica.from_value(sglang.to_value()).engine == sglang.engine
