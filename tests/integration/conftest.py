from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.harness import Gateway, Sim


@pytest.fixture(scope="module")
def sims(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Sim]]:
    work = tmp_path_factory.mktemp("sims")
    pool = {name: Sim(name, work) for name in ("a", "b")}
    try:
        yield pool
    finally:
        for sim in pool.values():
            sim.stop()


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
    work: Path = tmp_path_factory.mktemp("gateway")
    gw = Gateway(replicas=[s.endpoint for s in sims.values()], etcd=etcd, work=work)
    try:
        yield gw
    finally:
        gw.stop()
