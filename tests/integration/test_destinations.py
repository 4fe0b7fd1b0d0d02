"""Where attempts go, through real Envoy and etcd: the gateway's own order of replicas (override_host walks
it), the retry to the next entry, a replica down left out with why, and all of it in the journal."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.harness import Gateway, Sim, chat, gateway_over, poll, post, sim_pool
from tests.integration.first_delta_helpers import attempts_logged, finished

pytestmark = pytest.mark.integration


def served_by(sims: dict[str, Sim], request_id: str, n: int) -> list[str]:
    """The replicas that served the request's `n` attempts, by their own logs, in the order they started."""
    attempts_logged(sims, request_id, n)
    starts = [(r["t_start"], s.endpoint) for s in sims.values() for r in s.requests_for(request_id)]
    return [endpoint for _, endpoint in sorted(starts)]


@pytest.fixture(scope="module")
def trio(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Sim]]:
    with sim_pool(tmp_path_factory.mktemp("sims"), ("a", "b", "c")) as pool:
        yield pool


@pytest.fixture(scope="module")
def gateway3(etcd: str, trio: dict[str, Sim], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    with gateway_over(trio.values(), etcd=etcd, work=tmp_path_factory.mktemp("gateway")) as gw:
        yield gw


@pytest.fixture(autouse=True)
def _all_up(trio: dict[str, Sim], gateway3: Gateway) -> None:
    restarted = [sim.ensure_running() for sim in trio.values()]
    gateway3.wait_replicas_healthy((s.endpoint for s in trio.values()), fresh=any(restarted))


def test_each_first_attempt_goes_to_the_head_of_its_order_and_the_orders_rotate(
    gateway3: Gateway, trio: dict[str, Sim]
) -> None:
    endpoints = {s.endpoint for s in trio.values()}
    heads = []
    for _ in range(6):
        result = post(f"{gateway3.url}/v1/chat/completions", chat(max_tokens=2))
        assert result.status == 200, result.body
        journal = finished(gateway3, result.request_id)
        destinations = journal["destinations"]
        assert destinations["source"] == "gateway" and set(destinations["order"]) == endpoints
        assert "picker" not in destinations and "excluded" not in destinations
        [attempt] = journal["attempts"]
        assert attempt["replica"] == destinations["order"][0]
        assert attempt["chosen_by"] == "gateway choice #1"
        assert served_by(trio, result.request_id, 1) == [attempt["replica"]]  # the replica's own log
        heads.append(destinations["order"][0])
    assert set(heads) == endpoints  # round robin: every replica leads some order


def test_a_retry_goes_to_the_next_replica_of_the_order(gateway3: Gateway, trio: dict[str, Sim]) -> None:
    result = post(
        f"{gateway3.url}/v1/chat/completions",
        chat(max_tokens=3),
        headers={"x-sim-fault": "status503@headers attempt=1"},
    )
    assert result.status == 200, result.body
    journal = finished(gateway3, result.request_id)
    order = journal["destinations"]["order"]
    assert [(a["replica"], a["chosen_by"]) for a in journal["attempts"]] == [
        (order[0], "gateway choice #1"),
        (order[1], "gateway choice #2"),
    ]
    assert served_by(trio, result.request_id, 2) == order[:2]


def test_a_replica_failing_its_health_checks_is_left_out_with_why(
    gateway3: Gateway, trio: dict[str, Sim]
) -> None:
    down = trio["b"]
    down.stop()

    def excluded() -> dict[str, str] | None:
        result = post(f"{gateway3.url}/v1/chat/completions", chat(max_tokens=2))
        assert result.status == 200, result.body  # the order never leads to it once it is known down
        record = finished(gateway3, result.request_id)["destinations"]
        return {x["replica"]: x["why"] for x in record.get("excluded", [])} or None

    assert poll(excluded, timeout=20, what="the stopped replica excluded") == {
        down.endpoint: "failing its health checks"
    }
