"""Replica-side fence: each replica fronted by its agent's own Envoy (`router-sidecar replica --front`).

Real Envoy (gateway and two fronts), real etcd, simulated engines, real agent processes. A replica frozen
in prefill (SIGSTOP) is withdrawn by its agent; the gateway fences the attempt by revoking its lease, and
the replica side — which keeps running although its engine is frozen — notices the revocation, ends the
stream (Envoy resets the engine request) and writes the cancel ack. The gateway's fence is then proven by
the ack, well before the lease could expire, and the retry runs on the other replica.

A second test cuts a replica-side fence off from etcd (its etcd is stopped) and checks that the attempt
stops on the replica's own clock: by the local deadline, before the lease could have expired.
"""

from __future__ import annotations

import asyncio
import json
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from router_sidecar.coordination.replica_fence import AttemptGuard
from router_sidecar.coordination.store import EtcdStore, keys
from router_sidecar.runtime.supervise import Child, free_port, start_etcd, wait_until
from tests.harness import PYTHON, ClientResult, Gateway, Sim, chat, no_overlapping_content, poll, post

pytestmark = pytest.mark.fault

LEASE_TTL = 5  # generous: the cancel ack (within ~TTL/3) must beat the expiry even on a loaded machine
POLICY = f"leases:\n  attempt_ttl_seconds: {LEASE_TTL}\n"


class FrontAgent:
    """`router-sidecar replica --front`: the agent fronts its sim with Envoy and advertises the front."""

    def __init__(self, sim: Sim, etcd: str, work: Path, *, ttl: int = 2, interval: float = 0.3) -> None:
        self.sim = sim
        self.front = f"127.0.0.1:{free_port()}"
        self.out = work / f"front-agent-{sim.name}.out"
        self.out.write_text("")
        argv = [
            PYTHON,
            "-m",
            "router_sidecar",
            "replica",
            "--engine",
            sim.endpoint,
            "--front",
            self.front,
            "--advertise",
            self.front,
            "--etcd",
            etcd,
            "--ttl",
            str(ttl),
            "--interval",
            str(interval),
        ]
        self.child = Child(f"front-agent-{sim.name}", argv, log_path=self.out)
        wait_until(
            lambda: "ready" in self.out.read_text(),
            timeout=40,
            what="front agent registered",
            child=self.child,
        )

    def stop(self) -> None:
        self.child.stop()


@pytest.fixture(scope="module")
def cluster(etcd: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Gateway, dict[str, Any]]]:
    work: Path = tmp_path_factory.mktemp("replica-fence")
    sims = {n: Sim(n, work, token_interval=0.05) for n in ("a", "b")}
    agents: dict[str, FrontAgent] = {}
    gateway = None
    try:
        for name, sim in sims.items():
            agents[name] = FrontAgent(sim, etcd, work)
        config = work / "policy.yaml"
        config.write_text(POLICY)
        gateway = Gateway(replicas=[a.front for a in agents.values()], etcd=etcd, work=work, config=config)
        yield gateway, {"sims": sims, "agents": agents, "etcd": etcd}
    finally:
        if gateway is not None:
            gateway.stop()
        for agent in agents.values():
            agent.stop()
        for sim in sims.values():
            if sim.child is not None:
                sim.child.signal(signal.SIGCONT)
            sim.stop()


def test_plain_request_passes_through_the_front(cluster: tuple[Gateway, dict[str, Any]]) -> None:
    gateway, _ = cluster
    answer = post(f"{gateway.url}/v1/chat/completions", chat(max_tokens=5))
    assert answer.status == 200 and answer.transport_error is None, answer.body[-500:]
    assert answer.data()[-1] == "[DONE]" and len(answer.content_chunks()) == 5


@pytest.mark.parametrize(
    "fault",
    [
        "delay@role for=2 attempt=1",  # frozen after the response headers went out (vLLM sends them at once)
        "delay@headers for=2 attempt=1",  # frozen before any response byte: the front answers 503 itself
    ],
)
def test_frozen_in_prefill_is_fenced_by_cancel_ack(
    cluster: tuple[Gateway, dict[str, Any]], fault: str
) -> None:
    gateway, parts = cluster
    sims: dict[str, Sim] = parts["sims"]
    key = f"replica-fence-frozen-in-prefill-{fault.split('@')[1].split()[0]}"
    result: dict[str, ClientResult] = {}
    client = threading.Thread(
        target=lambda: result.setdefault(
            "r",
            post(
                f"{gateway.url}/v1/chat/completions",
                chat(max_tokens=4),
                headers={"idempotency-key": key, "x-sim-fault": fault},
            ),
        )
    )
    client.start()

    def serving() -> Sim | None:
        return next((s for s in sims.values() if any(r.get("request_id") == key for r in s.records())), None)

    frozen: Sim = poll(serving, timeout=10, what="the replica serving the request")
    assert frozen.child is not None
    frozen.child.signal(signal.SIGSTOP)
    frozen_at, frozen_wall = time.monotonic(), time.time()
    try:
        client.join(30)
        answered_at = time.monotonic()
        answer = result["r"]
    finally:
        frozen.child.signal(signal.SIGCONT)
    assert answer.status == 200 and answer.transport_error is None, answer.body[-500:]
    assert answer.data()[-1] == "[DONE]" and len(answer.content_chunks()) == 4
    no_overlapping_content(answer)

    journal = gateway.wait_journal(key, lambda j: j["phase"] == "completed")
    first, second = journal["attempts"]
    front_of = {a.sim.name: a.front for a in parts["agents"].values()}
    assert first["replica"] == front_of[frozen.name] and second["replica"] != first["replica"]
    assert first["fence"]["proof"] == "cancel_ack", json.dumps(journal, indent=1)
    # The ack comes from the replica side's periodic check (every TTL/3): well below the lease TTL.
    assert first["fence"]["waited_ms"] < LEASE_TTL * 1000 * 0.6, first["fence"]
    order = [(e["event"], e.get("attempt")) for e in journal["events"]]
    assert (
        order.index(("replica_lost", 1))
        < order.index(("attempt_fenced", 1))
        < order.index(("attempt_started", 2))
    )
    leases = [a["lease"] for a in journal["attempts"]]
    assert leases[0]["revoked_at"] is not None and leases[0]["revoked_at"] <= leases[1]["granted_at"]

    # The ack itself, written by the replica side.
    async def read_ack() -> dict[str, Any] | None:
        store = EtcdStore(parts["etcd"])
        try:
            raw = await store.get(keys.cancel_ack(first["attempt_id"]))
        finally:
            await store.close()
        return json.loads(raw) if raw else None

    ack = asyncio.run(read_ack())
    assert ack is not None and ack["attempt_id"] == first["attempt_id"] and ack["reason"] == "lease_revoked"

    # After SIGCONT the engine finds its client (the front Envoy) gone: the request was cancelled.
    resumed = poll(lambda: frozen.requests_for(key), timeout=15, what="the resumed engine's record")
    assert resumed[0]["outcome"] == "client_gone" or resumed[0]["client_gone_at"], resumed[0]
    assert resumed[0]["content_events_written"] == 0
    at = {(e["event"], e.get("attempt")): e["t"] for e in journal["events"]}
    print(
        f"\ntimings after SIGSTOP: replica_lost +{at[('replica_lost', 1)] - frozen_wall:.3f}s, "
        f"cancel ack +{ack['at'] - frozen_wall:.3f}s, "
        f"attempt_fenced +{at[('attempt_fenced', 1)] - frozen_wall:.3f}s "
        f"(fence waited {first['fence']['waited_ms']} ms), "
        f"attempt 2 started +{at[('attempt_started', 2)] - frozen_wall:.3f}s, "
        f"client answer complete +{answered_at - frozen_at:.3f}s"
    )


def test_revoked_mid_stream_stops_forwarding_at_the_front(cluster: tuple[Gateway, dict[str, Any]]) -> None:
    """Straight to one front (no gateway): a lease revoked while the engine streams ends the stream cleanly
    at the front, the engine sees its client go, and the ack says `lease_revoked`."""
    _, parts = cluster
    agent: FrontAgent = parts["agents"]["a"]
    key = "replica-fence-revoked-mid-stream"

    async def scenario() -> tuple[int, bytes, float, dict[str, Any] | None]:
        store = EtcdStore(parts["etcd"])
        try:
            lease = await store.grant_lease(LEASE_TTL)
            attempt_id = "att_midstream_test"
            headers = {"x-request-id": key, "x-attempt-id": attempt_id, "x-attempt-lease": f"{lease.id:x}"}
            raw = b""
            revoked_at = 0.0
            async with (
                httpx.AsyncClient(timeout=20) as http,
                http.stream(
                    "POST",
                    f"http://{agent.front}/v1/chat/completions",
                    json=chat(max_tokens=200),
                    headers=headers,
                ) as response,
            ):
                async for chunk in response.aiter_raw():
                    raw += chunk
                    if not revoked_at and raw.count(b'"content"') >= 3:
                        await store.revoke_lease(lease)
                        revoked_at = time.monotonic()
                status = response.status_code
            ended_after = time.monotonic() - revoked_at
            # The front ends the stream first, then writes the ack: wait for it (bounded).
            ack, deadline = None, time.monotonic() + 5
            while ack is None and time.monotonic() < deadline:
                ack = await store.get(keys.cancel_ack(attempt_id))
                if ack is None:
                    await asyncio.sleep(0.02)
            return status, raw, ended_after, json.loads(ack) if ack else None
        finally:
            await store.close()

    status, raw, ended_after, ack = asyncio.run(scenario())
    assert status == 200
    assert b"[DONE]" not in raw  # stopped, not finished
    assert ended_after < LEASE_TTL / 3 + 0.5, ended_after  # within one check interval
    assert ack is not None and ack["reason"] == "lease_revoked"
    record = poll(lambda: parts["sims"]["a"].requests_for(key), timeout=10, what="the engine's record")[0]
    assert record["outcome"] == "client_gone", record
    print(f"\nrevoked mid-stream: stream ended {ended_after:.3f}s after the revoke")


@pytest.fixture
def private_etcd(tmp_path: Path) -> Iterator[tuple[Child, str]]:
    child, endpoint = start_etcd(tmp_path / "data", log_path=tmp_path / "etcd.log")
    try:
        yield child, endpoint
    finally:
        child.stop()


def test_cut_off_from_etcd_stops_at_local_deadline(private_etcd: tuple[Child, str]) -> None:
    """A guard whose etcd goes away stops by check time + remaining TTL − margin, before the lease expiry."""
    child, endpoint = private_etcd
    ttl, margin = 3, 0.5

    async def scenario() -> tuple[str, float, float]:
        store = EtcdStore(endpoint, timeout=0.5)
        try:
            lease = await store.grant_lease(ttl)
            granted_at = time.monotonic()
            guard = AttemptGuard(store, "att_cutoff", lease.id, margin=margin)
            assert await guard.check(timeout=2)
            assert guard.valid()
            watch = asyncio.create_task(guard.watch())
            await asyncio.to_thread(child.stop)  # etcd gone: no check can answer any more
            reason = await asyncio.wait_for(watch, ttl + 2)
            assert guard.validity.deadline is not None
            return reason, time.monotonic() - granted_at, guard.validity.deadline - granted_at
        finally:
            await store.close()

    reason, stopped_after, deadline_after = asyncio.run(scenario())
    assert reason == "local_deadline"
    # Nobody keeps the lease alive: it expires `ttl` after its grant; the replica stopped before that,
    # at its own local deadline (not later).
    assert stopped_after < ttl, stopped_after
    assert deadline_after - 0.01 <= stopped_after < deadline_after + 0.3
    print(f"\ncut off from etcd: stopped {stopped_after:.3f}s after the grant (lease TTL {ttl}s)")
