"""A gateway with no replica to send to is up but not ready: its start-up line says it is waiting for
replicas, `/readyz` answers 503 `no_replica_available` naming why, and a request gets the same code (the one
docs/errors.md documents). Once a replica registers it says `ready:` and `/readyz` answers 200."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from tests.harness import Agent, Gateway, Sim, chat, poll, post

pytestmark = pytest.mark.integration


def test_without_replicas_the_gateway_waits_and_says_why(etcd: str, tmp_path: Path) -> None:
    gateway = Gateway(replicas=[], etcd=etcd, work=tmp_path, up_line=b"waiting for replicas:")
    sim: Sim | None = None
    agent: Agent | None = None
    try:
        assert gateway.up.startswith(f"waiting for replicas: gateway on {gateway.url}; no replica to send")
        why = (
            "no replica to send requests to: none is registered in etcd (run `router-sidecar replica` beside "
        )
        assert why in gateway.up and "(no_replica_available)" in gateway.up
        probe = httpx.get(f"{gateway.url}/readyz", timeout=5)
        assert probe.status_code == 503
        assert probe.json()["error"]["code"] == "no_replica_available"
        assert probe.json()["error"]["message"] == "not ready: " + why + "each engine)"
        refused = post(f"{gateway.url}/v1/chat/completions", chat(max_tokens=2))
        assert refused.status == 503 and json.loads(refused.body)["error"]["code"] == "no_replica_available"

        sim = Sim("a", tmp_path)
        agent = Agent(sim, etcd, tmp_path)
        line = gateway.wait_line(b"ready:", timeout=20)
        assert line.startswith(f"ready: gateway on {gateway.url}; sending to {sim.endpoint}; etcd {etcd}")
        poll(lambda: httpx.get(f"{gateway.url}/readyz", timeout=5).status_code == 200, what="/readyz 200")
        served = poll(
            lambda: (r := post(f"{gateway.url}/v1/chat/completions", chat(max_tokens=2))).status == 200 and r,
            what="a request served once the replica is in Envoy's endpoints",
        )
        assert served.data()[-1] == "[DONE]"

        agent.stop()  # withdraws the registration: nothing to send to again, said in the log (not stdout)
        poll(
            lambda: (
                f"not ready: {why}each engine); the readiness probe answers 503 (no_replica_available)"
                in gateway.out_path.read_text()
            ),
            timeout=20,
            what="the gateway to log that it has no replica any more",
        )
        assert httpx.get(f"{gateway.url}/readyz", timeout=5).status_code == 503
    finally:
        gateway.stop()
        if agent is not None:
            agent.stop()
        if sim is not None:
            sim.stop()
