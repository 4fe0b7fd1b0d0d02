from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.harness import Gateway, Sim, gateway_over, sim_pool


@pytest.fixture(scope="module")
def sims(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Sim]]:
    with sim_pool(tmp_path_factory.mktemp("sims"), ("a", "b")) as pool:
        yield pool


@pytest.fixture(autouse=True)
def _replicas_running(request: pytest.FixtureRequest) -> None:
    # A test may kill a replica on purpose; the next one starts with every replica up again.
    if "sims" in request.fixturenames:
        sims = request.getfixturevalue("sims")
        restarted = [sim.ensure_running() for sim in sims.values()]
        if "gateway" in request.fixturenames:
            request.getfixturevalue("gateway").wait_replicas_healthy(
                (s.endpoint for s in sims.values()), fresh=any(restarted)
            )


@pytest.fixture(scope="module")
def gateway(etcd: str, sims: dict[str, Sim], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    with gateway_over(sims.values(), etcd=etcd, work=tmp_path_factory.mktemp("gateway")) as gw:
        yield gw
