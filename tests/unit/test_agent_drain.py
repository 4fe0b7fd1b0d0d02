"""The replica agent while its engine drains: one probe the busy engine misses does not withdraw it (the
attempts in flight there would be taken for lost); a second miss in a row does, as does the drain's end."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

from router_sidecar.coordination.registry_store import Replica
from router_sidecar.core.fingerprint import EngineInfo, Fingerprint
from router_sidecar.runtime.replica_agent import AgentOptions, EngineDown, EngineDraining, ReplicaAgent


class ScriptedProbe:
    def __init__(self, answers: list[Any]) -> None:
        self.answers = answers

    async def check(self, model_id: str | None) -> tuple[Fingerprint, EngineInfo]:
        answer = self.answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer


class RecordingHeartbeat:
    def __init__(self) -> None:
        self.wanted: Replica | None = None
        self.log: list[str] = []

    @property
    def registered(self) -> bool:
        return self.wanted is not None

    async def publish(self, replica: Replica) -> bool:
        self.wanted = replica
        self.log.append("draining" if replica.draining else "registered")
        return True

    async def withdraw(self) -> bool:
        self.wanted = None
        self.log.append("withdrawn")
        return True


HEALTHY = (Fingerprint(model_id="tiny", engine_name="sglang", engine_version="0.5.23"), EngineInfo())
DRAINING = EngineDraining("GET /health: HTTP 503 while the server still answers: draining")
MISSED = EngineDown("GET /v1/models: no answer within 2s", slow=True)
REFUSED = EngineDown("GET /v1/models: Connection refused")


def heartbeats(answers: list[Any], *, drain_seconds: float = 60.0) -> list[str]:
    """What the agent did with its registration, tick by tick, for these probe answers."""
    options = AgentOptions(
        engine="127.0.0.1:1", advertise="127.0.0.1:2", etcd="127.0.0.1:3", drain_seconds=drain_seconds
    )
    etcd_unused = SimpleNamespace(_client=None)  # the heartbeat below stands in for the registry
    agent = ReplicaAgent(options, Fingerprint(model_id="tiny"), store=etcd_unused)  # type: ignore[arg-type]
    heartbeat = RecordingHeartbeat()
    agent.probe, agent.heartbeat = ScriptedProbe(list(answers)), heartbeat  # type: ignore[assignment]

    async def ticks() -> None:
        for _ in answers:
            await agent.tick()

    asyncio.run(ticks())
    return heartbeat.log


def test_one_missed_probe_while_draining_keeps_the_draining_registration() -> None:
    assert heartbeats([HEALTHY, DRAINING, MISSED, DRAINING]) == ["registered", "draining", "draining"]


def test_two_missed_probes_in_a_row_while_draining_withdraw_it() -> None:
    assert heartbeats([HEALTHY, DRAINING, MISSED, MISSED]) == ["registered", "draining", "withdrawn"]


def test_misses_apart_are_each_tolerated_once() -> None:
    answers = [HEALTHY, DRAINING, MISSED, DRAINING, MISSED, DRAINING]
    assert heartbeats(answers) == ["registered", "draining", "draining", "draining"]


def test_a_refused_probe_when_not_draining_withdraws_at_once() -> None:
    assert heartbeats([HEALTHY, REFUSED]) == ["registered", "withdrawn"]


def test_a_healthy_engine_too_busy_to_answer_in_time_is_kept_once() -> None:
    # Slowness is not failure: one probe that times out keeps the registration; a second in a row (a frozen
    # engine) withdraws it, one interval later than a refused connection would.
    assert heartbeats([HEALTHY, MISSED, HEALTHY]) == ["registered", "registered"]
    assert heartbeats([HEALTHY, MISSED, MISSED]) == ["registered", "withdrawn"]
    assert heartbeats([HEALTHY, MISSED, HEALTHY, MISSED, HEALTHY]) == ["registered"] * 3


def test_a_slow_first_probe_registers_nothing() -> None:
    assert heartbeats([MISSED, HEALTHY]) == ["withdrawn", "registered"]


def test_the_drain_ends_after_drain_seconds() -> None:
    assert heartbeats([HEALTHY, DRAINING], drain_seconds=0) == ["registered", "withdrawn"]
