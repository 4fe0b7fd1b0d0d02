"""Real-engine tier: two real vLLM replicas (tiny local model, CPU) behind the real gateway.

Needs `make real-setup` (a separate `.venv-vllm` and `.tools/tiny-model`); skips the whole tier with the
reason otherwise. Replicas are package-scoped (one start for the tier) and restarted (25–40 s) only
after a test killed one.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from router_sidecar.runtime.supervise import start_etcd
from router_testbed.real_engine import Installation, VllmReplica, find_installation
from tests.harness import Gateway
from tests.real_engine.tier import gateway_to, installed, mark_tier, replica_pair, wait_restarted

INSTALL, SKIP_REASON = find_installation()

# Two replicas load concurrently on 2 cores: allow more than one replica's 22–40 s.
START_TIMEOUT = 120.0
RESTART_TIMEOUT = 90.0


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip_reason = None if INSTALL is not None else f"real_engine tier: {SKIP_REASON}"
    mark_tier(items, Path(__file__).parent, skip_reason)


@pytest.fixture(scope="package")
def install() -> Installation:
    return installed(INSTALL, SKIP_REASON)


@pytest.fixture(scope="module")
def etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    work = tmp_path_factory.mktemp("etcd")
    child, endpoint = start_etcd(work / "data", log_path=work / "etcd.log")
    try:
        yield endpoint
    finally:
        child.stop()


class TierVllmReplica(VllmReplica):
    """A VllmReplica whose next starts get `env_extra` on top of the launcher's environment (a module that
    needs vLLM's Responses store sets VLLM_ENABLE_RESPONSES_API_STORE there); `started_with` is what the
    running process got."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.env_extra: dict[str, str] = {}
        self.started_with: dict[str, str] = {}

    def env(self, tmp: Path) -> dict[str, str]:
        self.started_with = dict(self.env_extra)
        return {**super().env(tmp), **self.env_extra}


def start_tier_replicas(
    names: list[str], install: Installation, work: Path, *, timeout: float
) -> dict[str, TierVllmReplica]:
    """Start the replicas at once (they share the CPU while loading) and wait for all of them."""
    pool = {name: TierVllmReplica(name, install, work) for name in names}
    try:
        for replica in pool.values():
            replica.start(wait=False)
        for replica in pool.values():
            replica.wait_ready(timeout)
    except BaseException:
        for replica in pool.values():
            replica.stop()
        raise
    return pool


@pytest.fixture(scope="package")  # shared by the tier's modules: one start for all
def replicas(
    install: Installation, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, TierVllmReplica]]:
    with replica_pair("vLLM", start_tier_replicas, install, tmp_path_factory, START_TIMEOUT) as pool:
        yield pool


@pytest.fixture(scope="module")
def gateway(
    etcd: str, replicas: dict[str, VllmReplica], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Gateway]:
    with gateway_to(replicas, etcd, tmp_path_factory.mktemp("gateway")) as gw:
        yield gw


@pytest.fixture
def healthy_replicas(replicas: dict[str, VllmReplica]) -> dict[str, VllmReplica]:
    """Every replica up and healthy; restart (on the same port) the ones a previous test killed."""
    dead = [r for r in replicas.values() if not r.healthy()]
    for replica in dead:
        replica.stop()
        replica.start(wait=False)
    for replica in dead:
        took = wait_restarted(replica, RESTART_TIMEOUT)
        print(f"\nreal_engine: restarted replica {replica.name} in {took:.1f}s")
    return replicas
