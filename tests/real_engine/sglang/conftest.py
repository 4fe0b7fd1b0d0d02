"""SGLang tier: two real SGLang 0.5.23 replicas (tiny local model, CPU) behind the real gateway.

Needs `make real-setup` (`.venv-sglang` from scripts/real_setup_sglang.sh, and `.tools/tiny-model`); skips
the whole directory with the reason otherwise. The replicas are started once for the directory (20 s alone
on an idle machine, 45-90 s for two at once on a busy one) and restarted only where a test needs a replica
that an earlier test killed.
"""

from __future__ import annotations

import time
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

INSTALL, SKIP_REASON = find_sglang_installation()

START_TIMEOUT = 180.0  # two at once on 2 busy cores
RESTART_TIMEOUT = 150.0


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.real_engine)
            item.add_marker(pytest.mark.timeout(300))
            if INSTALL is None:
                item.add_marker(pytest.mark.skip(reason=f"SGLang real_engine tier: {SKIP_REASON}"))


@pytest.fixture(scope="package")
def sglang_install() -> Installation:
    if INSTALL is None:
        pytest.skip(SKIP_REASON)
    return INSTALL


@pytest.fixture(scope="package")
def sglang_replicas(
    sglang_install: Installation, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, SglangReplica]]:
    t0 = time.monotonic()
    try:
        pool = start_sglang_replicas(
            ["a", "b"], sglang_install, tmp_path_factory.mktemp("sglang"), timeout=START_TIMEOUT
        )
    except (TimeoutError, RuntimeError) as exc:
        # SGLang's start-up is not what this tier tests: on a starved machine it can fail to come up in
        # time (or shut itself down). Once more from scratch, then the failure stands.
        print(f"\nreal_engine: SGLang did not start ({str(exc)[:300]}); starting both once more")
        pool = start_sglang_replicas(
            ["a", "b"], sglang_install, tmp_path_factory.mktemp("sglang"), timeout=START_TIMEOUT
        )
    print(f"\nreal_engine: 2 SGLang replicas ready in {time.monotonic() - t0:.1f}s")
    try:
        yield pool
    finally:
        for replica in pool.values():
            replica.stop()


@pytest.fixture(scope="module")
def sglang_gateway(
    etcd: str, sglang_replicas: dict[str, SglangReplica], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Gateway]:
    work = tmp_path_factory.mktemp("gateway")
    gw = Gateway(replicas=[r.endpoint for r in sglang_replicas.values()], etcd=etcd, work=work)
    try:
        yield gw
    finally:
        gw.stop()


def restart_dead(replicas: dict[str, SglangReplica]) -> list[SglangReplica]:
    """Start again (same port) every replica that is not running, wait for those and for any still starting
    (a test may have restarted one in the background); returns the ones that were not healthy."""
    for replica in replicas.values():
        if not replica.alive():
            replica.stop()
            replica.start(wait=False)
    waited = [r for r in replicas.values() if not r.healthy()]
    for replica in waited:
        try:
            took = replica.wait_ready(RESTART_TIMEOUT)
        except (TimeoutError, RuntimeError) as exc:
            print(f"\nreal_engine: SGLang {replica.name} did not restart ({str(exc)[:300]}); once more")
            replica.stop()
            replica.start(wait=False)
            took = replica.wait_ready(RESTART_TIMEOUT)
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
