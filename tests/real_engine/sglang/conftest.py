"""SGLang tier: two real SGLang 0.5.23 replicas (tiny local model, CPU) behind the real gateway.

Needs `make real-setup` (`.venv-sglang` from scripts/real_setup_sglang.sh, and `.tools/tiny-model`); skips
the whole directory with the reason otherwise. The replicas are started once for the directory (20 s alone
on an idle machine, 45-90 s for two at once on a busy one) and restarted only where a test needs a replica
that an earlier test killed.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from router_testbed.real_engine import (
    Installation,
    SglangReplica,
    find_sglang_installation,
    start_sglang_replicas,
)
from tests.harness import Gateway
from tests.real_engine.tier import gateway_to, installed, mark_tier, replica_pair, wait_restarted

INSTALL, SKIP_REASON = find_sglang_installation()

START_TIMEOUT = 180.0  # two at once on 2 busy cores
RESTART_TIMEOUT = 150.0


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip_reason = None if INSTALL is not None else f"SGLang real_engine tier: {SKIP_REASON}"
    mark_tier(items, Path(__file__).parent, skip_reason)


@pytest.fixture(scope="package")
def sglang_install() -> Installation:
    return installed(INSTALL, SKIP_REASON)


@pytest.fixture(scope="package")
def sglang_replicas(
    sglang_install: Installation, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, SglangReplica]]:
    with replica_pair(
        "SGLang", start_sglang_replicas, sglang_install, tmp_path_factory, START_TIMEOUT
    ) as pool:
        yield pool


@pytest.fixture(scope="module")
def sglang_gateway(
    etcd: str, sglang_replicas: dict[str, SglangReplica], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Gateway]:
    with gateway_to(sglang_replicas, etcd, tmp_path_factory.mktemp("gateway")) as gw:
        yield gw


def restart_dead(replicas: dict[str, SglangReplica]) -> list[SglangReplica]:
    """Start again (same port) every replica that is not running, wait for those and for any still starting
    (a test may have restarted one in the background); returns the ones that were not healthy."""
    for replica in replicas.values():
        if not replica.alive():
            replica.stop()
            replica.start(wait=False)
    waited = [r for r in replicas.values() if not r.healthy()]
    for replica in waited:
        took = wait_restarted(replica, RESTART_TIMEOUT)
        print(f"\nreal_engine: SGLang replica {replica.name} (re)started, ready {took:.1f}s after its start")
    return waited


@pytest.fixture
def both_healthy(
    sglang_replicas: dict[str, SglangReplica], sglang_gateway: Gateway
) -> dict[str, SglangReplica]:
    """Both replicas up, and Envoy routing to both again (a restarted one passed a fresh health check)."""
    waited = restart_dead(sglang_replicas)
    if waited:
        sglang_gateway.wait_replicas_healthy([r.endpoint for r in waited], fresh=True, timeout=30)
    return sglang_replicas
