"""`router-sidecar replica` against real etcd and real simulator processes (no mocks).

Every wait polls with a deadline; every process a test starts is stopped by it. Registrations are told
apart by advertise address, so the tests can share the session's etcd. Timing parameters are small
(TTL 3 s, interval 0.5 s) to keep the tier fast; the measured times are printed (`pytest -s`).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from router_sidecar.coordination.registry_store import Replica, ReplicaRegistry
from router_sidecar.coordination.store import EtcdStore
from router_sidecar.core.fingerprint import Fingerprint, describe_difference, load_fingerprint_file, merge
from router_sidecar.runtime.replica_agent import SGLANG_HEALTH_ALLOWANCE, EngineDown, EngineProbe
from router_sidecar.runtime.supervise import _die_with_parent, free_port, start_etcd
from tests.harness import Sim

pytestmark = pytest.mark.integration

TTL = 3
INTERVAL = 0.5
PROBE_TIMEOUT = 0.5  # the agent's probe timeout: min(interval, 2 s)
SLACK = 1.0  # scheduling, process start-up, etcd's lease-expiry check period (500 ms in 3.4)
# What the simulator (router_testbed.sim) reports: model "tiny", vLLM 0.32.0, no adapters.
REPLICA = [sys.executable, "-m", "router_sidecar", "replica"]
SIM_REPORTS = Fingerprint(model_id="tiny", lora_adapters=(), engine_name="vllm", engine_version="0.32.0")

FILE_A = """\
weights_revision: "7ae557604adf67be50417f59c2c2f167def9a775"
quantization: none
tokenizer_digest: "sha256:{tok}"
chat_template_digest: "sha256:{tpl}"
attention_backend: FLASH_ATTN
kv_cache_dtype: auto
block_size: 16
tensor_parallel_size: 1
pipeline_parallel_size: 1
""".format(tok="a" * 64, tpl="b" * 64)


class Agent:
    """`python -m router_sidecar replica ...` exactly as an operator runs it."""

    def __init__(
        self,
        *,
        engine: str,
        etcd: str,
        work: Path,
        advertise: str | None = None,
        fingerprint: Path | None = None,
        ttl: int = TTL,
        interval: float = INTERVAL,
    ) -> None:
        self.advertise = advertise or engine
        argv = [
            *REPLICA,
            "--engine",
            engine,
            "--advertise",
            self.advertise,
            "--etcd",
            etcd,
            "--ttl",
            str(ttl),
            "--interval",
            str(interval),
        ]
        if fingerprint is not None:
            argv += ["--fingerprint", str(fingerprint)]
        self.err_path = work / f"agent-{self.advertise.replace(':', '_')}-{time.monotonic_ns()}.err"
        self._err = open(self.err_path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            argv,
            stdout=subprocess.PIPE,
            stderr=self._err,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=_die_with_parent,  # never outlive a killed test run
        )
        self.stdout = b""

    def wait_ready(self, timeout: float = 20.0) -> str:
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            ready, _, _ = select.select([self.proc.stdout], [], [], 0.05)
            if ready:
                line = self.proc.stdout.readline()
                self.stdout += line
                if line.startswith(b"ready"):
                    return line.decode()
                if not line:
                    break
            if self.proc.poll() is not None and not ready:
                break
        raise AssertionError(f"agent not ready; stdout {self.stdout!r}; stderr:\n{self.stderr()}")

    def stderr(self) -> str:
        return self.err_path.read_text(errors="replace")

    def signal(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, sig)

    def wait(self, timeout: float = 10.0) -> int:
        return self.proc.wait(timeout)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.signal(signal.SIGKILL)
                self.proc.wait(5)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self._err.close()


def registry_call(etcd: str, call: Callable[[ReplicaRegistry], Any]) -> Any:
    async def run() -> Any:
        store = EtcdStore(etcd)
        try:
            return await call(ReplicaRegistry(store))
        finally:
            await store.close()

    return asyncio.run(run())


def replicas(etcd: str) -> dict[str, Replica]:
    result: dict[str, Replica] = registry_call(etcd, lambda r: r.list_replicas())
    return result


def lease_remaining(etcd: str, lease_id: int) -> int:
    async def ttl(r: ReplicaRegistry) -> int:
        remaining, _ = await r.store.lease_time_to_live(lease_id)
        return remaining

    result: int = registry_call(etcd, ttl)
    return result


def wait_for(predicate: Callable[[], bool], *, timeout: float, what: str, interval: float = 0.02) -> float:
    """Poll until ``predicate`` holds; returns the seconds it took."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if predicate():
            return time.monotonic() - start
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


@pytest.fixture
def work(tmp_path: Path) -> Path:
    return tmp_path


@pytest.fixture
def sim(work: Path) -> Iterator[Sim]:
    s = Sim("a", work)
    try:
        yield s
    finally:
        s.stop()


@pytest.fixture
def agents() -> Iterator[list[Agent]]:
    started: list[Agent] = []
    try:
        yield started
    finally:
        for agent in started:
            agent.stop()


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_registration_has_the_right_digest(etcd: str, sim: Sim, work: Path, agents: list[Agent]) -> None:
    file = write(work / "fp.yaml", FILE_A)
    agent = Agent(engine=sim.endpoint, etcd=etcd, work=work, fingerprint=file)
    agents.append(agent)
    ready = agent.wait_ready()
    expected = merge(load_fingerprint_file(file), SIM_REPORTS)
    assert f"digest {expected.digest()}" in ready

    registered = replicas(etcd)[sim.endpoint]
    assert registered.digest == expected.digest() == registered.fingerprint.digest()
    assert registered.fingerprint == expected
    assert registered.fingerprint.attention_backend == "flash_attn"  # normalised
    assert (registered.engine_name, registered.engine_version) == ("vllm", "0.32.0")
    assert registered.engine.root == "tiny" and registered.engine.max_model_len == 1024
    assert registered.agent_id.split(":")[1] == str(agent.proc.pid)
    assert registered.lease_id != 0
    assert 0 < lease_remaining(etcd, registered.lease_id) <= TTL


def test_sigterm_withdraws_at_once(etcd: str, sim: Sim, work: Path, agents: list[Agent]) -> None:
    agent = Agent(engine=sim.endpoint, etcd=etcd, work=work)
    agents.append(agent)
    agent.wait_ready()
    lease = replicas(etcd)[sim.endpoint].lease_id
    start = time.monotonic()
    agent.signal(signal.SIGTERM)
    assert agent.wait() == 0
    gone = time.monotonic() - start
    assert sim.endpoint not in replicas(etcd), "the key must be gone when the agent has exited"
    assert lease_remaining(etcd, lease) == -1, "the lease must be revoked, not left to expire"
    print(f"\nSIGTERM → agent exited with the key withdrawn in {gone:.3f}s")
    assert gone < 2.0
    assert "withdrawn" in agent.stderr()


def test_sigkill_key_expires_with_the_lease(etcd: str, sim: Sim, work: Path, agents: list[Agent]) -> None:
    agent = Agent(engine=sim.endpoint, etcd=etcd, work=work)
    agents.append(agent)
    agent.wait_ready()
    lease = replicas(etcd)[sim.endpoint].lease_id
    # Let a few keep-alives happen, so the lease's age says nothing about when the agent started.
    time.sleep(3 * INTERVAL)
    agent.signal(signal.SIGKILL)
    killed = time.monotonic()
    agent.wait()
    remaining_at_kill = lease_remaining(etcd, lease)
    wait_for(lambda: sim.endpoint not in replicas(etcd), timeout=TTL + 5, what="the key to expire")
    took = time.monotonic() - killed
    print(f"\nSIGKILL → key gone after {took:.2f}s (TTL {TTL}s, interval {INTERVAL}s)", end=" ")
    print(f"(lease had {remaining_at_kill}s left at the kill)")
    # The TTL runs from the last keep-alive, which was at most one interval before the kill.
    assert TTL - INTERVAL - 0.2 <= took <= TTL + SLACK
    assert lease_remaining(etcd, lease) == -1


def test_engine_killed_then_restarted(etcd: str, sim: Sim, work: Path, agents: list[Agent]) -> None:
    agent = Agent(engine=sim.endpoint, etcd=etcd, work=work)
    agents.append(agent)
    agent.wait_ready()
    before = replicas(etcd)[sim.endpoint]
    assert sim.child is not None
    sim.child.signal(signal.SIGKILL)
    sim.child.proc.wait(5)
    withdrawn = wait_for(lambda: sim.endpoint not in replicas(etcd), timeout=5, what="withdrawal")
    print(f"\nengine SIGKILL → withdrawn after {withdrawn:.2f}s (interval {INTERVAL}s)")
    assert withdrawn <= INTERVAL + SLACK
    assert lease_remaining(etcd, before.lease_id) == -1, "withdrawal revokes the lease"

    sim.ensure_running()
    back = wait_for(lambda: sim.endpoint in replicas(etcd), timeout=10, what="re-registration")
    print(f"engine restarted → registered again after {back:.2f}s")
    after = replicas(etcd)[sim.endpoint]
    assert after.digest == before.digest and after.agent_id == before.agent_id
    assert after.lease_id != before.lease_id and after.registered_at > before.registered_at
    assert agent.proc.poll() is None


def test_frozen_engine_is_withdrawn_and_returns(etcd: str, sim: Sim, work: Path, agents: list[Agent]) -> None:
    agent = Agent(engine=sim.endpoint, etcd=etcd, work=work)
    agents.append(agent)
    agent.wait_ready()
    assert sim.child is not None
    sim.child.signal(signal.SIGSTOP)  # the port still accepts connections; nothing answers
    try:
        withdrawn = wait_for(lambda: sim.endpoint not in replicas(etcd), timeout=5, what="withdrawal")
        print(f"\nengine SIGSTOP → withdrawn after {withdrawn:.2f}s")
        # The first probe that times out is kept (a busy engine is slow, not down); the second withdraws it.
        # After a miss the agent no longer knows the engine, so the second /health gets SGLang's allowance.
        assert withdrawn <= INTERVAL + PROBE_TIMEOUT + (PROBE_TIMEOUT + SGLANG_HEALTH_ALLOWANCE) + SLACK
    finally:
        sim.child.signal(signal.SIGCONT)
    wait_for(lambda: sim.endpoint in replicas(etcd), timeout=10, what="re-registration after SIGCONT")


def test_two_fingerprints_two_digests(etcd: str, work: Path, agents: list[Agent]) -> None:
    sim_a, sim_b = Sim("a", work), Sim("b", work)
    try:
        file_a = write(work / "a.yaml", FILE_A)
        file_b = write(work / "b.yaml", FILE_A.replace("block_size: 16", "block_size: 32"))
        for s, file in ((sim_a, file_a), (sim_b, file_b)):
            agent = Agent(engine=s.endpoint, etcd=etcd, work=work, fingerprint=file)
            agents.append(agent)
            agent.wait_ready()
        seen = replicas(etcd)
        a, b = seen[sim_a.endpoint], seen[sim_b.endpoint]
        assert a.digest != b.digest
        assert a.digest == merge(load_fingerprint_file(file_a), SIM_REPORTS).digest()
        assert b.digest == merge(load_fingerprint_file(file_b), SIM_REPORTS).digest()
        assert describe_difference(a.fingerprint, b.fingerprint) == "block_size: pinned 16 vs candidate 32"
    finally:
        sim_a.stop()
        sim_b.stop()


def test_watch_yields_join_and_leave(etcd: str, sim: Sim, work: Path, agents: list[Agent]) -> None:
    address = sim.endpoint

    async def scenario() -> list[bool]:
        store = EtcdStore(etcd)
        states: list[bool] = []  # is our replica in each snapshot the watch yielded
        joined, left = asyncio.Event(), asyncio.Event()

        async def follow() -> None:
            async with contextlib.aclosing(ReplicaRegistry(store).watch_replicas()) as snapshots:
                async for snapshot in snapshots:
                    present = address in snapshot
                    if not states or states[-1] != present:
                        states.append(present)
                        (joined if present else left).set()

        watcher = asyncio.create_task(follow())
        try:
            agent = Agent(engine=address, etcd=etcd, work=work)
            agents.append(agent)
            await asyncio.to_thread(agent.wait_ready)
            await asyncio.wait_for(joined.wait(), 5)
            left.clear()
            agent.signal(signal.SIGTERM)
            await asyncio.wait_for(left.wait(), 5)
            assert await asyncio.to_thread(agent.wait) == 0
            return states
        finally:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher
            await store.close()

    states = asyncio.run(asyncio.wait_for(scenario(), 30))
    assert states == [False, True, False]


def test_etcd_unreachable_at_start_exits_2(sim: Sim, work: Path) -> None:
    dead = f"127.0.0.1:{free_port()}"
    result = subprocess.run(
        [*REPLICA, "--engine", sim.endpoint, "--advertise", sim.endpoint, "--etcd", dead],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 2
    assert f"etcd at {dead} is unreachable" in result.stderr and "Traceback" not in result.stderr
    assert "ready" not in result.stdout


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("kv_cache_type: fp8\n", "fingerprint: kv_cache_type: unknown key"),
        ("model_id: llama\n", "model_id: file 'llama' vs engine 'tiny'"),
        ('engine_version: "0.31.0"\n', "engine_version: file '0.31.0' vs engine '0.32.0'"),
    ],
)
def test_bad_or_conflicting_fingerprint_file_exits_2(
    etcd: str, sim: Sim, work: Path, text: str, message: str
) -> None:
    file = write(work / "fp.yaml", text)
    result = subprocess.run(
        [
            *REPLICA,
            "--engine",
            sim.endpoint,
            "--advertise",
            sim.endpoint,
            "--etcd",
            etcd,
            "--fingerprint",
            file,
        ],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 2, result.stderr
    assert message in result.stderr and "Traceback" not in result.stderr
    assert sim.endpoint not in replicas(etcd)


def test_etcd_lost_and_back_registers_with_a_new_lease(sim: Sim, work: Path, agents: list[Agent]) -> None:
    port = free_port()
    etcd_child, endpoint = start_etcd(work / "etcd1", client_port=port, log_path=work / "etcd1.log")
    try:
        agent = Agent(engine=sim.endpoint, etcd=endpoint, work=work)
        agents.append(agent)
        agent.wait_ready()
        before = replicas(endpoint)[sim.endpoint]
        etcd_child.stop()
        time.sleep(TTL + INTERVAL)  # longer than the TTL: whatever etcd comes back, the old lease is void
        assert agent.proc.poll() is None, "losing etcd later is not fatal"
        # A fresh etcd on the same address (total loss of the old cluster's data).
        etcd_child, _ = start_etcd(work / "etcd2", client_port=port, log_path=work / "etcd2.log")
        back = wait_for(lambda: sim.endpoint in replicas(endpoint), timeout=15, what="re-registration")
        print(f"\netcd back → registered again after {back:.2f}s")
        after = replicas(endpoint)[sim.endpoint]
        assert after.digest == before.digest
        assert lease_remaining(endpoint, after.lease_id) > 0
        assert "etcd unreachable" in agent.stderr()
        # And it still follows the engine: SIGTERM withdraws from the new etcd.
        agent.signal(signal.SIGTERM)
        assert agent.wait() == 0
        assert sim.endpoint not in replicas(endpoint)
    finally:
        etcd_child.stop()


@pytest.mark.parametrize(
    ("reply", "fragment"),
    [
        (b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\n\r\n", "GET /health: HTTP 503"),
        (b"garbage\r\n\r\n", "not an HTTP response"),
        (b"", "not an HTTP response"),
    ],
)
def test_probe_treats_non_200_as_down(reply: bytes, fragment: str) -> None:
    async def scenario() -> str:
        async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.readuntil(b"\r\n\r\n")
            writer.write(reply)
            await writer.drain()
            writer.close()

        server = await asyncio.start_server(answer, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        try:
            with pytest.raises(EngineDown) as info:
                await EngineProbe(f"127.0.0.1:{port}", timeout=1.0).check(None)
            return str(info.value)
        finally:
            server.close()
            await server.wait_closed()

    assert fragment in asyncio.run(scenario())


def test_probe_refused_is_down() -> None:
    probe = EngineProbe(f"127.0.0.1:{free_port()}", timeout=1.0)
    with pytest.raises(EngineDown, match="GET /health"):
        asyncio.run(probe.check(None))


def test_watch_survives_an_etcd_restart(sim: Sim, work: Path, agents: list[Agent]) -> None:
    port = free_port()
    children = [start_etcd(work / "etcd1", client_port=port, log_path=work / "etcd1.log")[0]]
    endpoint = f"127.0.0.1:{port}"
    address = sim.endpoint

    async def scenario() -> list[int]:
        store = EtcdStore(endpoint)
        leases: list[int] = []  # lease id of our replica in each snapshot that has it, deduplicated
        changed = asyncio.Event()

        async def follow() -> None:
            async with contextlib.aclosing(ReplicaRegistry(store).watch_replicas(retry_interval=0.2)) as it:
                async for snapshot in it:
                    if address in snapshot and snapshot[address].lease_id not in leases:
                        leases.append(snapshot[address].lease_id)
                        changed.set()

        watcher = asyncio.create_task(follow())
        try:
            agent = Agent(engine=address, etcd=endpoint, work=work)
            agents.append(agent)
            await asyncio.to_thread(agent.wait_ready)
            await asyncio.wait_for(changed.wait(), 5)
            changed.clear()
            await asyncio.to_thread(children[0].stop)
            await asyncio.sleep(TTL + INTERVAL)
            child, _ = await asyncio.to_thread(
                start_etcd, work / "etcd2", client_port=port, log_path=work / "etcd2.log"
            )
            children.append(child)
            await asyncio.wait_for(changed.wait(), 15)
            return leases
        finally:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher
            await store.close()

    try:
        leases = asyncio.run(asyncio.wait_for(scenario(), 40))
    finally:
        for child in children:
            child.stop()
    assert len(leases) == 2 and leases[0] != leases[1]
