"""A real network partition: the replica keeps running in its own network namespace, packets dropped.

The replica (simulator) and its agent run in a namespace this test creates, linked to the host by a veth
pair; nftables in the namespace then drops every packet. The replica process is alive and may decode on,
but the gateway cannot see it and its agent cannot reach etcd: its registration lease expires, the
gateway fences the attempt (lease revoked, expiry awaited), and only then retries — or, after the first
delta, ends the stream with the terminal frame. Needs root (namespaces, nftables); skips elsewhere.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from router_sidecar.coordination.registry_store import ReplicaRegistry
from router_sidecar.coordination.store import EtcdStore
from router_sidecar.runtime.supervise import Child, free_port, port_open, start_etcd, wait_until
from tests.harness import (
    PYTHON,
    Agent,
    ClientResult,
    Gateway,
    Sim,
    chat,
    no_overlapping_content,
    poll,
    post,
    split_events,
    with_credential,
)

pytestmark = pytest.mark.fault

NS = f"rs-part-{os.getpid()}"
HOST_SIDE, NS_SIDE = "10.203.7.1", "10.203.7.2"  # the test's own link, inside this machine only
LEASE_TTL = 2


def _run(*argv: str) -> None:
    subprocess.run(argv, check=True, capture_output=True, timeout=10)


def _can_partition() -> str | None:
    if os.geteuid() != 0:
        return "needs root for network namespaces and nftables"
    if shutil.which("ip") is None or shutil.which("nft") is None:
        return "needs iproute2 and nftables (make setup installs them as root)"
    return None


class Namespace:
    def __init__(self) -> None:
        _run("ip", "netns", "add", NS)
        _run("ip", "link", "add", f"{NS}-h", "type", "veth", "peer", "name", f"{NS}-n")
        _run("ip", "link", "set", f"{NS}-n", "netns", NS)
        _run("ip", "addr", "add", f"{HOST_SIDE}/30", "dev", f"{NS}-h")
        _run("ip", "link", "set", f"{NS}-h", "up")
        _run("ip", "netns", "exec", NS, "ip", "addr", "add", f"{NS_SIDE}/30", "dev", f"{NS}-n")
        _run("ip", "netns", "exec", NS, "ip", "link", "set", f"{NS}-n", "up")
        _run("ip", "netns", "exec", NS, "ip", "link", "set", "lo", "up")

    def cut_port(self, port: int) -> None:
        """Drop only the traffic of one TCP port (gateway ↔ replica); etcd stays reachable from inside."""
        _run(
            "ip",
            "netns",
            "exec",
            NS,
            "nft",
            "add table inet cut; "
            f"add chain inet cut in {{ type filter hook input priority 0; policy accept; "
            f"tcp dport {port} drop; }}; "
            f"add chain inet cut out {{ type filter hook output priority 0; policy accept; "
            f"tcp sport {port} drop; }}",
        )

    def partition(self) -> None:
        """Drop every packet in and out of the namespace; connections stay 'open' on both ends."""
        _run(
            "ip",
            "netns",
            "exec",
            NS,
            "nft",
            "add table inet cut; "
            "add chain inet cut in { type filter hook input priority 0; policy drop; }; "
            "add chain inet cut out { type filter hook output priority 0; policy drop; }",
        )

    def heal(self) -> None:
        subprocess.run(
            ["ip", "netns", "exec", NS, "nft", "delete", "table", "inet", "cut"], capture_output=True
        )

    def delete(self) -> None:
        subprocess.run(["ip", "link", "del", f"{NS}-h"], capture_output=True)
        subprocess.run(["ip", "netns", "del", NS], capture_output=True)


class NsSim(Sim):
    """A simulated replica running inside the namespace."""

    def __init__(self, work: Path) -> None:
        self.name = "ns"
        self.port = free_port()
        self.endpoint = f"{NS_SIDE}:{self.port}"
        self.log_path = work / "sim-ns.jsonl"
        self.out_path = work / "sim-ns.out"
        self._args = ["--prefill-delay", "0.02", "--token-interval", "0.05"]
        self.child = None
        self.start()

    def start(self) -> None:
        argv = [
            "ip",
            "netns",
            "exec",
            NS,
            PYTHON,
            "-m",
            "router_testbed.sim",
            "--listen",
            self.endpoint,
            "--name",
            self.name,
            "--log",
            str(self.log_path),
            *self._args,
        ]
        self.child = Child("sim-ns", argv, log_path=self.out_path)
        wait_until(
            lambda: port_open(NS_SIDE, self.port), timeout=15, what="sim in the namespace", child=self.child
        )


class NsAgent(Agent):
    """The agent of the namespace replica, in replica mode: its own Envoy fronts the engine (the
    replica-side fence, which also reports each attempt's progress); gateways route to the front."""

    def __init__(self, sim: Sim, etcd: str, work: Path) -> None:
        self.front = f"{NS_SIDE}:{free_port()}"
        super().__init__(sim, etcd, work, ttl=LEASE_TTL, interval=0.3)

    def start(self) -> None:
        if self._argv[0] != "ip":
            advertise = self._argv.index("--advertise")
            self._argv[advertise + 1] = self.front
            self._argv = ["ip", "netns", "exec", NS, *self._argv, "--front", self.front]
        super().start()


@pytest.fixture(scope="module")
def partitioned(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Gateway, Sim, Sim, Namespace]]:
    reason = _can_partition()
    if reason:
        pytest.skip(reason)
    work: Path = tmp_path_factory.mktemp("partition")
    ns = Namespace()
    started: list[Any] = []
    try:
        etcd_child, etcd = start_etcd(work / "etcd", log_path=work / "etcd.log", also_listen_on=(HOST_SIDE,))
        started.append(etcd_child)
        etcd_port = etcd.rpartition(":")[2]
        inside, outside = NsSim(work), Sim("host", work, token_interval=0.05)
        started += [inside, outside]
        ns_agent = NsAgent(inside, f"{HOST_SIDE}:{etcd_port}", work)
        started.append(ns_agent)
        started.append(Agent(outside, etcd, work, ttl=LEASE_TTL, interval=0.3))
        config = work / "policy.yaml"
        config.write_text(f"leases:\n  attempt_ttl_seconds: {LEASE_TTL}\n")
        gateway = Gateway(replicas=[ns_agent.front, outside.endpoint], etcd=etcd, work=work, config=config)
        started.append(gateway)
        inside.front = ns_agent.front  # type: ignore[attr-defined]
        yield gateway, inside, outside, ns
    finally:
        ns.heal()
        for process in reversed(started):
            process.stop()
        ns.delete()


def registered(etcd: str, address: str) -> bool:
    async def look() -> bool:
        store = EtcdStore(etcd)
        try:
            return address in await ReplicaRegistry(store).list_replicas()
        finally:
            await store.close()

    return asyncio.run(look())


def landed_on(sim: Sim, key: str) -> bool:
    return any(r.get("request_id") == key for r in sim.records())


def start_on_namespace_replica(
    gateway: Gateway, inside: Sim, outside: Sim, body: dict[str, Any], prefix: str
) -> tuple[str, threading.Thread, dict[str, Any]]:
    """Round robin decides where a request lands: send until one lands on the replica in the namespace."""
    for n in range(6):
        key = f"{prefix}-{n}"
        box: dict[str, Any] = {}
        thread = threading.Thread(
            target=lambda k=key, b=box: b.setdefault(
                "r",
                post(
                    f"{gateway.url}/v1/chat/completions",
                    body,
                    headers={"idempotency-key": k, "x-sim-fault": "delay@role for=1.5 replica=ns"},
                ),
            )
        )
        thread.start()
        where = poll(
            lambda k=key: (landed_on(inside, k) and "ns") or (landed_on(outside, k) and "host"),
            timeout=10,
            what="the first attempt to land",
        )
        if where == "ns":
            return key, thread, box
        thread.join(15)
    raise AssertionError("no request landed on the namespace replica in 6 tries")


def order(journal: dict[str, Any]) -> list[tuple[str, int | None]]:
    return [(e["event"], e.get("attempt")) for e in journal["events"]]


def test_partition_before_first_delta_fences_then_retries(
    partitioned: tuple[Gateway, Sim, Sim, Namespace],
) -> None:
    gateway, inside, outside, ns = partitioned
    key, client, box = start_on_namespace_replica(gateway, inside, outside, chat(max_tokens=3), "cut-prefill")
    cut_at = time.time()
    ns.partition()
    try:
        client.join(30)
        result: ClientResult = box["r"]
    finally:
        ns.heal()
    assert result.status == 200 and result.data()[-1] == "[DONE]" and len(result.content_chunks()) == 3
    no_overlapping_content(result)
    journal = gateway.wait_journal(key, lambda j: j["phase"] == "completed")
    first, second = journal["attempts"]
    assert first["replica"] == inside.front and second["replica"] == outside.endpoint
    assert first["fence"]["proof"] == "lease_expiry"
    events = order(journal)
    assert (
        events.index(("replica_lost", 1))
        < events.index(("attempt_fenced", 1))
        < events.index(("attempt_started", 2))
    )
    assert first["lease"]["revoked_at"] <= second["lease"]["granted_at"], "two valid leases at once"
    times = {e["event"] + str(e.get("attempt")): e["t"] for e in journal["events"]}
    print(
        f"partition → replica lost {times['replica_lost1'] - cut_at:.2f}s, → fenced "
        f"{times['attempt_fenced1'] - cut_at:.2f}s, → retry started {times['attempt_started2'] - cut_at:.2f}s"
    )


def test_partition_after_first_delta_ends_with_terminal_frame(
    partitioned: tuple[Gateway, Sim, Sim, Namespace],
) -> None:
    gateway, inside, _, ns = partitioned
    # After the previous partition healed, the agent registers the replica again (a new lease).
    poll(lambda: registered(gateway.etcd, inside.front), timeout=20, what="the replica registered again")
    raw = bytearray()
    two_deltas, done = threading.Event(), threading.Event()
    for n in itertools.count():
        assert n < 6, "no stream landed on the namespace replica"
        key = f"cut-decode-{n}"
        raw.clear()
        two_deltas.clear()
        done.clear()

        def read(k: str = key) -> None:
            with (
                httpx.Client(timeout=40) as http,
                http.stream(
                    "POST",
                    f"{gateway.url}/v1/chat/completions",
                    json=chat(max_tokens=200),
                    headers=with_credential({"idempotency-key": k}),
                ) as response,
            ):
                for chunk in response.iter_raw():
                    raw.extend(chunk)
                    events = split_events(bytes(raw))
                    if len(ClientResult(200, {}, bytes(raw), events=events).content_chunks()) >= 2:
                        two_deltas.set()
            done.set()

        client = threading.Thread(target=read)
        client.start()
        assert two_deltas.wait(15)
        if landed_on(inside, key):
            break
        client.join(30)
    ns.partition()
    try:
        assert done.wait(30), "the stream must end although the replica is unreachable"
        final = bytes(raw)
    finally:
        ns.heal()
    client.join(5)
    answer = ClientResult(200, {}, final, events=split_events(final))
    data = answer.data()
    frames = [d["error"] for d in data if isinstance(d, dict) and "error" in d]
    assert data[-1] == "[DONE]" and len(frames) == 1
    assert frames[0]["delivered_output_tokens"] == len(answer.content_chunks())
    journal = gateway.wait_journal(key, lambda j: j["phase"] == "interrupted")
    assert journal["attempt"] == 1 and ("replica_lost", 1) in order(journal)
    # Healed: the replica's late bytes never reach the client (its stream is over).
    time_limit = time.monotonic() + 3
    while time.monotonic() < time_limit and len(raw) == len(final):
        time.sleep(0.1)
    assert bytes(raw) == final


def test_path_lost_while_the_replica_reaches_etcd_is_seen_from_its_progress(
    partitioned: tuple[Gateway, Sim, Sim, Namespace],
) -> None:
    """Only gateway ↔ replica is cut: the heartbeat stays fine, but the replica side reports bytes that
    never arrive. That is the evidence of a lost path (not slowness): fence — acknowledged by the replica
    side, which still reaches etcd — then retry."""
    gateway, inside, outside, ns = partitioned
    poll(lambda: registered(gateway.etcd, inside.front), timeout=20, what="the replica registered")
    front_port = int(inside.front.rpartition(":")[2])  # type: ignore[attr-defined]
    key, client, box = start_on_namespace_replica(gateway, inside, outside, chat(max_tokens=30), "cut-path")
    cut_at = time.time()
    ns.cut_port(front_port)
    try:
        client.join(40)
        result: ClientResult = box["r"]
    finally:
        ns.heal()
    assert result.status == 200 and result.data()[-1] == "[DONE]" and len(result.content_chunks()) == 30
    no_overlapping_content(result)
    journal = gateway.wait_journal(key, lambda j: j["phase"] == "completed")
    first, second = journal["attempts"]
    assert first["replica"] == inside.front and second["replica"] == outside.endpoint  # type: ignore[attr-defined]
    # Its path was found lost either from the progress gap (still held) or when the connection dropped
    # (TCP keepalive); either way it was fenced with the replica side's acknowledgement before the retry.
    assert first["fence"]["proof"] == "cancel_ack", json.dumps([cut_at, journal["events"]])
    assert registered(gateway.etcd, inside.front), "the heartbeat never lapsed: this was not a dead replica"  # type: ignore[attr-defined]
    events = order(journal)
    assert (
        events.index(("replica_lost", 1))
        < events.index(("attempt_fenced", 1))
        < events.index(("attempt_started", 2))
    )
    assert first["lease"]["revoked_at"] <= second["lease"]["granted_at"]
    at = {f"{e['event']}{e.get('attempt')}": e["t"] for e in journal["events"]}
    print(
        f"path cut → lost {at['replica_lost1'] - cut_at:.2f}s, "
        f"→ fenced (ack) {at['attempt_fenced1'] - cut_at:.2f}s, "
        f"→ retry {at['attempt_started2'] - cut_at:.2f}s"
    )
