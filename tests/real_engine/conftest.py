"""Real-engine tier: two real vLLM replicas (tiny local model, CPU) behind the real gateway.

Needs `make real-setup` (a separate `.venv-vllm` and `.tools/tiny-model`); skips the whole tier with the
reason otherwise. Replicas are package-scoped (one start for the tier) and restarted (25–40 s) only
after a test killed one.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from router_sidecar.runtime.supervise import start_etcd
from router_testbed.real_engine import Installation, VllmReplica, find_installation, start_replicas
from tests.harness import Gateway

INSTALL, SKIP_REASON = find_installation()

# Two replicas load concurrently on 2 cores: allow more than one replica's 22–40 s.
START_TIMEOUT = 120.0
RESTART_TIMEOUT = 90.0


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.real_engine)
            item.add_marker(pytest.mark.timeout(300))
            if INSTALL is None:
                item.add_marker(pytest.mark.skip(reason=f"real_engine tier: {SKIP_REASON}"))


@pytest.fixture(scope="package")
def install() -> Installation:
    if INSTALL is None:
        pytest.skip(SKIP_REASON)
    return INSTALL


@pytest.fixture(scope="module")
def etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    work = tmp_path_factory.mktemp("etcd")
    child, endpoint = start_etcd(work / "data", log_path=work / "etcd.log")
    try:
        yield endpoint
    finally:
        child.stop()


@pytest.fixture(scope="package")  # shared by the tier's modules: one start for all
def replicas(
    install: Installation, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, VllmReplica]]:
    t0 = time.monotonic()
    try:
        pool = start_replicas(["a", "b"], install, tmp_path_factory.mktemp("vllm"), timeout=START_TIMEOUT)
    except (TimeoutError, RuntimeError) as exc:
        # vLLM's start-up is not what this tier tests: on a starved machine its engine workers can fail to
        # come up in time. Once more from scratch, then the failure stands.
        print(f"\nreal_engine: vLLM did not start ({str(exc)[:300]}); starting both once more")
        pool = start_replicas(["a", "b"], install, tmp_path_factory.mktemp("vllm"), timeout=START_TIMEOUT)
    print(f"\nreal_engine: 2 vLLM replicas ready in {time.monotonic() - t0:.1f}s")
    try:
        yield pool
    finally:
        for replica in pool.values():
            replica.stop()


@pytest.fixture(scope="module")
def gateway(
    etcd: str, replicas: dict[str, VllmReplica], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Gateway]:
    work = tmp_path_factory.mktemp("gateway")
    gw = Gateway(replicas=[r.endpoint for r in replicas.values()], etcd=etcd, work=work)
    try:
        yield gw
    finally:
        gw.stop()


@pytest.fixture
def healthy_replicas(replicas: dict[str, VllmReplica]) -> dict[str, VllmReplica]:
    """Every replica up and healthy; restart (on the same port) the ones a previous test killed."""
    dead = [r for r in replicas.values() if not r.healthy()]
    for replica in dead:
        replica.stop()
        replica.start(wait=False)
    for replica in dead:
        try:
            took = replica.wait_ready(RESTART_TIMEOUT)
        except (TimeoutError, RuntimeError) as exc:
            # As at the tier's start: a starved machine can keep vLLM's engine workers from coming up.
            print(f"\nreal_engine: {replica.name} did not restart ({str(exc)[:300]}); once more")
            replica.stop()
            replica.start(wait=False)
            took = replica.wait_ready(RESTART_TIMEOUT)
        print(f"\nreal_engine: restarted replica {replica.name} in {took:.1f}s")
    return replicas
