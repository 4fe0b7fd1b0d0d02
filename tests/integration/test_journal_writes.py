"""The journal's cost in etcd through a real gateway: every request is three etcd revisions (the claim, the
write-ahead, the end), streamed or not, retried or not; the numbers docs/journal.md#sizing rests on.

Its own etcd, so that nothing but this gateway writes there (lease keep-alives and grants make no revision).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from router_sidecar.runtime.supervise import start_etcd
from tests.harness import Gateway, Sim, chat, post

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def quiet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Gateway, str]]:
    work: Path = tmp_path_factory.mktemp("journal-writes")
    etcd, endpoint = start_etcd(work / "etcd", log_path=work / "etcd.log")
    sims: list[Sim] = []
    gateway: Gateway | None = None
    try:
        sims = [Sim(n, work) for n in ("a", "b")]
        gateway = Gateway(replicas=[s.endpoint for s in sims], etcd=endpoint, work=work)
        gateway.wait_replicas_healthy([s.endpoint for s in sims])
        yield gateway, endpoint
    finally:
        if gateway is not None:
            gateway.stop()
        for sim in sims:
            sim.stop()
        etcd.stop()


def revision(endpoint: str) -> int:
    reply = httpx.post(f"http://{endpoint}/v3/maintenance/status", json={}, timeout=5).json()
    return int(reply["header"]["revision"])


@pytest.mark.parametrize(
    ("body", "fault", "phase"),
    [
        (chat(max_tokens=6), None, "completed"),
        ({**chat(max_tokens=6), "stream": False}, None, "completed"),
        (chat(max_tokens=6), "status503@headers attempt=1", "completed"),  # two attempts, one record
        (chat(max_tokens=6), "close@token:3", "interrupted"),
    ],
    ids=["streamed", "non-stream", "retried", "interrupted"],
)
def test_each_request_costs_three_etcd_revisions(
    quiet: tuple[Gateway, str], body: dict[str, object], fault: str | None, phase: str
) -> None:
    gateway, endpoint = quiet
    before = revision(endpoint)
    count = 4
    for _ in range(count):
        headers = {"x-sim-fault": fault} if fault else {}
        result = post(f"{gateway.url}/v1/chat/completions", body, headers=headers)
        gateway.wait_journal(result.request_id, lambda j: j["phase"] == phase)
    # The end write is the one that makes the phase final: nothing of these requests is written after it.
    assert revision(endpoint) - before == 3 * count
