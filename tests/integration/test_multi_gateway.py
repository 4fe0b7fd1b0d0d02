"""Several gateways, one etcd cluster: two gateway instances on a 3-member etcd, on loopback.

What one instance knows, the other knows through etcd: a request id (Idempotency-Key) in flight on one is
refused on the other, its outcome is readable from both, and a tool key claimed through one replays through
the other. A member of the cluster killed under load (the leader) and restarted loses no journal record.
"""

from __future__ import annotations

import asyncio
import base64
import itertools
import json
import os
import random
import signal
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import yaml

from router_sidecar.coordination.store import EtcdStore
from router_sidecar.coordination.store import keys as etcd_keys
from router_testbed.toolsvc import ToolSvcProcess, read_executions, spawn_toolsvc
from tests.harness import ClientResult, EtcdCluster, Gateway, Sim, chat, poll, post, with_credential

pytestmark = pytest.mark.integration


class Deployment:
    def __init__(self, work: Path) -> None:
        self.cluster = EtcdCluster(work / "etcd")
        self.sims: dict[str, Sim] = {}
        self.gateways: list[Gateway] = []
        self.toolsvc: ToolSvcProcess | None = None
        try:
            self.toolsvc = spawn_toolsvc(name="payments", log_path=str(work / "executions.jsonl"))
            self.sims = {n: Sim(n, work, token_interval=0.02) for n in ("a", "b")}
            for index in range(2):
                gw_work = work / f"gw{index}"
                gw_work.mkdir()
                self.gateways.append(
                    Gateway(
                        replicas=[s.endpoint for s in self.sims.values()],
                        etcd=self.cluster.endpoints,
                        work=gw_work,
                        tools=(f"payments={self.toolsvc.address}",),
                    )
                )
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        for gateway in self.gateways:
            gateway.stop()
        for sim in self.sims.values():
            sim.stop()
        if self.toolsvc is not None:
            self.toolsvc.stop()
        self.cluster.stop()

    def served(self, request_id: str) -> list[dict[str, object]]:
        return [r for sim in self.sims.values() for r in sim.requests_for(request_id)]

    def started(self, request_id: str) -> int:
        return sum(sim.started_for(request_id) for sim in self.sims.values())


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    d = Deployment(tmp_path_factory.mktemp("multi-gateway"))
    try:
        yield d
    finally:
        d.stop()


def test_a_key_in_flight_on_one_instance_is_refused_by_the_other(deployment: Deployment) -> None:
    one, other = deployment.gateways
    key = "multi-gw-in-flight"
    first: dict[str, ClientResult] = {}
    slow = threading.Thread(
        target=lambda: first.setdefault(
            "r",
            post(
                f"{one.url}/v1/chat/completions",
                chat(max_tokens=3),
                headers={"idempotency-key": key, "x-sim-fault": "delay@role for=1.5"},
            ),
        )
    )
    slow.start()
    try:
        poll(
            lambda: any(r.get("request_id") == key for s in deployment.sims.values() for r in s.records()),
            what="the first request reached a replica",
        )
        second = httpx.post(
            f"{other.url}/v1/chat/completions", json=chat(), headers=with_credential({"idempotency-key": key})
        )
        assert second.status_code == 409, second.text
        assert (second.json()["error"]["code"], second.json()["error"]["request_id"]) == (
            "idempotency_key_in_flight",
            key,
        )
    finally:
        slow.join(15)
    result = first["r"]
    assert result.status == 200 and result.data()[-1] == "[DONE]" and len(result.content_chunks()) == 3
    # The outcome, from either instance; the record names the instance that served it.
    records = [gw.wait_journal(key, lambda j: j["phase"] == "completed") for gw in (one, other)]
    assert records[0]["gateway"] == records[1]["gateway"]
    assert records[1]["delivered_output_tokens"] == 3
    third = httpx.post(
        f"{other.url}/v1/chat/completions", json=chat(), headers=with_credential({"idempotency-key": key})
    )
    assert third.status_code == 409 and third.json()["error"]["code"] == "request_already_finished"
    # Both duplicates were claimed beside their first attempt (journal.claim_before_forwarding: false): one
    # of theirs that reached a replica was cancelled there (their clients got only the 409s). One run
    # generated the answer.
    poll(lambda: deployment.started(key) == len(deployment.served(key)), what="every attempt ended")
    assert len([r for r in deployment.served(key) if r.get("client_gone_at") is None]) == 1


def test_a_tool_key_claimed_through_one_instance_replays_through_the_other(deployment: Deployment) -> None:
    one, other = deployment.gateways
    assert deployment.toolsvc is not None and deployment.toolsvc.log_path is not None
    key, body = "multi-gw-tool:call_01", {"amount": 42, "currency": "EUR"}
    headers = with_credential({"idempotency-key": key, "content-type": "application/json"})
    first = httpx.post(
        f"{one.url}/tools/payments/charge", content=json.dumps(body), headers=headers, timeout=15
    )
    assert first.status_code == 200, first.text
    again = httpx.post(
        f"{other.url}/tools/payments/charge", content=json.dumps(body), headers=headers, timeout=15
    )
    assert again.status_code == 200 and again.headers.get("x-idempotent-replay") == "true", again.text
    assert again.content == first.content
    executions = [e for e in read_executions(deployment.toolsvc.log_path) if e.get("key") == key]
    assert len(executions) == 1, executions
    # Bound to the whole call on every instance: another path through the other one is refused.
    refund = httpx.post(
        f"{other.url}/tools/payments/refund", content=json.dumps(body), headers=headers, timeout=15
    )
    assert refund.status_code == 422 and refund.json()["error"]["code"] == "idempotency_key_reused"


def test_etcd_leader_killed_and_restarted_under_load_loses_no_journal_record(deployment: Deployment) -> None:
    """Streams through both instances while the etcd leader is SIGKILLed, then restarted while they still
    run; every third fails before its first delta on attempt 1, so retries (and their lease fencing) happen
    while the cluster changes. Every request the clients made ends honestly (a complete answer, or one JSON
    error / terminal frame) with a journal record that agrees with what its client got; the restarted member
    catches up and holds every one of those records; no two attempts of a request held a valid publish lease
    at once. The gateways know every member (`--etcd` lists them): with one down they stay ready."""
    rng = random.Random(20261201)
    cluster = deployment.cluster
    count = 24
    keys = [f"multi-gw-leader-{i}" for i in range(count)]
    killed: list[str] = []

    def one(i: int) -> ClientResult:
        headers = {"idempotency-key": keys[i]}
        if i % 3 == 0:
            headers["x-sim-fault"] = "close@token:1 attempt=1"
        return post(
            f"{deployment.gateways[i % 2].url}/v1/chat/completions",
            chat(max_tokens=rng.randrange(20, 40)),
            headers=headers,
            timeout=60,
        )

    def started(batch: range) -> bool:
        return all(deployment.started(keys[i]) for i in batch)

    thirds = [range(k * count // 3, (k + 1) * count // 3) for k in range(3)]
    try:
        with ThreadPoolExecutor(max_workers=count) as pool:
            futures = [pool.submit(one, i) for i in thirds[0]]
            poll(lambda: started(thirds[0]), what="the first third reached the replicas", timeout=30)
            killed.append(cluster.leader())
            cluster.kill(killed[0])
            futures += [pool.submit(one, i) for i in thirds[1]]
            poll(lambda: started(thirds[1]), what="the second third reached the replicas", timeout=30)
            cluster.restart(killed[0])  # back while streams run on, and more arrive
            futures += [pool.submit(one, i) for i in thirds[2]]
            results = [f.result() for f in futures]
        for gateway in deployment.gateways:
            assert httpx.get(f"{gateway.url}/readyz", timeout=5).status_code == 200
        outcomes = _check_outcomes(deployment, keys, results)
    finally:
        if killed and not cluster.children[killed[0]].alive():
            cluster.restart(killed[0])
    others = [(i, o, r.status, r.body[:700]) for i, (o, r) in enumerate(zip(outcomes, results, strict=True))]
    # etcd keeps quorum with one member down, and a claim waits out the election: every request completes.
    assert all(o == "completed" for _, o, _, _ in others), [x for x in others if x[1] != "completed"]
    # The restarted member caught up: read from it alone (serializable), every record is there and final.
    member = cluster.endpoint_of(killed[0])
    records = poll(lambda: _records_on(member, keys, final=True), what=f"{killed[0]} has them", timeout=30)
    for key in keys:
        attempts = records[key]["attempts"]
        assert (len(attempts) == 2) == (keys.index(key) % 3 == 0), (key, attempts)
        for earlier, later in itertools.pairwise(attempts):
            assert earlier["lease"]["revoked_at"] is not None, (key, attempts)
            assert earlier["lease"]["revoked_at"] <= later["lease"]["granted_at"], (key, attempts)


_FINAL = ("completed", "interrupted", "failed", "cancelled")


def test_a_member_given_alone_is_known_as_one_of_a_cluster(deployment: Deployment, etcd: str) -> None:
    """`--etcd` may name one member (or one DNS name for all of them): the gateway asks etcd how many there
    are, and a claim on a cluster waits out an election; on a single etcd it fails at once."""

    async def members(endpoint: str) -> tuple[int, bool]:
        store = EtcdStore(endpoint)
        try:
            return await store.learn_membership(), store.replicated
        finally:
            await store.close()

    cluster = deployment.cluster
    assert asyncio.run(members(cluster.endpoint_of(cluster.names[0]))) == (3, True)
    assert asyncio.run(members(etcd)) == (1, False)


def _records_on(member: str, keys: list[str], *, final: bool) -> dict[str, dict[str, object]] | None:
    """The journal records of `keys` as one member alone holds them (None until it holds them all)."""
    prefix = etcd_keys.REQUESTS_PREFIX
    end = prefix[:-1] + chr(ord(prefix[-1]) + 1)
    reply = httpx.post(
        f"http://{member}/v3/kv/range",
        json={"key": _b64(prefix), "range_end": _b64(end), "serializable": True},
        timeout=5,
    ).json()
    found: dict[str, dict[str, object]] = {}
    for kv in reply.get("kvs", []):
        record = json.loads(base64.b64decode(kv["value"]))
        if record.get("request_id") in keys and (not final or record.get("phase") in _FINAL):
            found[record["request_id"]] = record
    return found if len(found) == len(keys) else None


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def _check_outcomes(deployment: Deployment, keys: list[str], results: list[ClientResult]) -> list[str]:
    outcomes: list[str] = []
    for key, result in zip(keys, results, strict=True):
        data = result.data()
        if result.status == 200 and data and data[-1] == "[DONE]" and not _frames(data):
            expect = "completed"
        elif result.status == 200:
            assert len(_frames(data)) == 1, result.body[-500:]
            expect = "interrupted"
        else:
            assert result.headers.get("content-type", "").startswith("application/json"), result.body[:300]
            expect = "failed"
        record = deployment.gateways[0].wait_journal(key, lambda j, e=expect: j["phase"] == e, timeout=30)
        if expect == "completed":
            assert record["delivered_output_tokens"] == len(result.content_chunks())
        outcomes.append(expect)
    return outcomes


def _frames(data: list[object]) -> list[object]:
    return [d for d in data if isinstance(d, dict) and "error" in d]


def test_a_gateway_killed_mid_stream_has_its_open_records_closed_by_another(
    deployment: Deployment, tmp_path: Path
) -> None:
    """SIGKILL to a third instance while it streams: its owner lease lapses, one of the live instances
    closes the record it left open (interrupted / gateway_lost, the last journaled count), exactly once, and
    revokes the attempt's lease, so the attempt's key is gone too."""
    config = tmp_path / "policy.yaml"
    # A long attempt TTL: the attempt's lease can only be gone in time because the closer revoked it.
    # Owner TTL 5 s: the record must still be the dead instance's when the test reads it after the kill.
    policy = {"leases": {"owner_ttl_seconds": 5, "attempt_ttl_seconds": 60}}
    config.write_text(yaml.safe_dump({**policy, "journal": {"progress_interval_seconds": 0.2}}))
    doomed = Gateway(
        replicas=[s.endpoint for s in deployment.sims.values()],
        etcd=deployment.cluster.endpoints,
        work=tmp_path,
        config=config,
    )
    key = "multi-gw-killed-gateway"
    client: dict[str, ClientResult] = {}
    streaming = threading.Thread(
        target=lambda: client.setdefault(
            "r",
            post(f"{doomed.url}/v1/chat/completions", chat(max_tokens=400), headers={"idempotency-key": key}),
        )
    )
    streaming.start()
    try:
        # Through another instance: what etcd holds (the record is rewritten as the stream progresses).
        deployment.gateways[1].wait_journal(key, lambda j: j["delivered_output_tokens"] > 0)
    finally:
        os.killpg(doomed.proc.pid, signal.SIGKILL)
        doomed.stop()
    # What the dead instance last journaled (its owner lease has 5 s to lapse before anyone closes it).
    status, last = deployment.gateways[1].journal(key)
    assert status == 200 and last["phase"] == "decode", last
    streaming.join(30)
    result = client["r"]
    assert 0 < len(result.content_chunks()) < 400, "the stream was to be cut mid-way"
    survivor = deployment.gateways[0]
    record = survivor.wait_journal(key, lambda j: j["phase"] != "decode", timeout=30)
    assert (record["phase"], record["outcome"]) == ("interrupted", "gateway_lost"), record
    lost = [e for e in record["events"] if e["event"] == "gateway_lost"]
    assert len(lost) == 1 and lost[0]["owner"] == record["owner"]
    assert lost[0]["closed_by"] != record["owner"]
    assert record["delivered_output_tokens"] == last["delivered_output_tokens"], (last, record)
    assert 0 < record["delivered_output_tokens"] <= len(result.content_chunks()) + 1
    # The attempt's right to publish went with it: the closer revoked its lease (well before its TTL).
    lease_id = int(record["attempts"][-1]["lease"]["lease_id"], 16)
    poll(lambda: _lease_ttl(deployment, lease_id) == -1, timeout=5, what="the attempt's lease revoked")


def _lease_ttl(deployment: Deployment, lease_id: int) -> int:
    """What etcd says is left of a lease (-1: it does not exist: revoked or expired)."""
    endpoint = deployment.cluster.endpoint_of(deployment.cluster.names[0])
    answer = httpx.post(f"http://{endpoint}/v3/lease/timetolive", json={"ID": str(lease_id)}, timeout=5)
    return int(answer.json().get("TTL", -1))
