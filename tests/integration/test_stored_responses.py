"""Responses API state that lives on one replica, through real Envoy and etcd: the journal records which
replica holds each stored response; follow-ups (previous_response_id, GET /v1/responses/{id}) go to that
replica only; with it gone, a clear 503 naming it, never another replica's 404; tenants share no index."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.harness import Gateway, Sim, gateway_over, poll, post, sim_pool, with_credential
from tests.integration.first_delta_helpers import finished

pytestmark = pytest.mark.integration

RESPONSES = "/v1/responses"


def body(tokens: int = 3, *, stream: bool = True, **extra: Any) -> dict[str, Any]:
    return {"model": "tiny", "input": "hello", "max_output_tokens": tokens, "stream": stream, **extra}


@pytest.fixture(scope="module")
def stores(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Sim]]:
    with sim_pool(
        tmp_path_factory.mktemp("sims"), ("a", "b", "c"), extra_args=("--responses-store",)
    ) as pool:
        yield pool


@pytest.fixture(scope="module")
def gateway(etcd: str, stores: dict[str, Sim], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    with gateway_over(stores.values(), etcd=etcd, work=tmp_path_factory.mktemp("gateway")) as gw:
        yield gw


@pytest.fixture(autouse=True)
def _all_up(stores: dict[str, Sim], gateway: Gateway) -> None:
    restarted = [sim.ensure_running() for sim in stores.values()]
    gateway.wait_replicas_healthy((s.endpoint for s in stores.values()), fresh=any(restarted))


def served_on(sims: dict[str, Sim], request_id: str) -> list[str]:
    """The replicas whose own logs show an attempt of the request."""
    return [s.endpoint for s in sims.values() if s.started_for(request_id)]


def stored(gateway: Gateway, headers: dict[str, str] | None = None, **extra: Any) -> tuple[str, str]:
    """A stored response made through the gateway: (its id as the client got it, the replica holding it)."""
    result = post(f"{gateway.url}{RESPONSES}", body(**extra), headers=headers)
    assert result.status == 200, result.body
    journal = gateway.wait_journal(
        result.request_id, lambda j: j["phase"] == "completed" and "stored_response" in j, headers=headers
    )
    record = journal["stored_response"]
    if extra.get("stream", True):
        created = json.loads(result.events[0].split(b"data:", 1)[1])
        assert record["id"] == created["response"]["id"]  # the id the client saw
    else:
        assert record["id"] == json.loads(result.body)["id"]
    [attempt] = journal["attempts"]
    assert record["replica"] == attempt["replica"]
    return record["id"], record["replica"]


def test_a_follow_up_goes_to_the_replica_holding_its_previous_response(
    gateway: Gateway, stores: dict[str, Sim]
) -> None:
    response_id, holder = stored(gateway)
    for _ in range(4):  # the gateway's own order would have spread these over three replicas
        result = post(f"{gateway.url}{RESPONSES}", body(previous_response_id=response_id))
        assert result.status == 200, result.body
        journal = finished(gateway, result.request_id)
        assert journal["destinations"] == {"source": "holder", "order": [holder]}
        assert [(a["replica"], a["chosen_by"]) for a in journal["attempts"]] == [
            (holder, "holder of the stored response it continues")
        ]
        assert poll(lambda rid=result.request_id: served_on(stores, rid), what="the replica log") == [holder]
        # the next turn continues this one, on the same replica
        response_id, holder = journal["stored_response"]["id"], journal["stored_response"]["replica"]


def test_a_non_stream_response_is_recorded_and_retrieved_from_its_holder(
    gateway: Gateway, stores: dict[str, Sim]
) -> None:
    response_id, _ = stored(gateway, stream=False)
    for _ in range(4):
        got = httpx.get(f"{gateway.url}{RESPONSES}/{response_id}", headers=with_credential(None), timeout=10)
        assert got.status_code == 200, got.text  # any other replica would answer 404
        assert got.json()["id"] == response_id


def test_with_the_holder_gone_the_client_is_told_so_not_given_another_replicas_404(
    gateway: Gateway, stores: dict[str, Sim]
) -> None:
    response_id, holder = stored(gateway)
    sim = next(s for s in stores.values() if s.endpoint == holder)
    sim.stop()
    answers: list[tuple[int, dict[str, Any]]] = []

    def refused() -> dict[str, Any] | None:
        result = post(f"{gateway.url}{RESPONSES}", body(previous_response_id=response_id))
        error = json.loads(result.body)["error"]
        answers.append((result.status, error))
        return error if "failing its health checks" in error["message"] else None

    poll(refused, timeout=20, what="the follow-up refused once the holder is known down")
    # Every answer names the response and its holder: before the probe finds it down, the follow-up dies at
    # its connection ("could not be reached"); after, it is refused before any attempt.
    for status, error in answers:
        assert (status, error["code"]) == (503, "stored_response_unavailable"), answers
        assert response_id in error["message"] and holder in error["message"], error
        assert "could not be reached" in error["message"] or "failing its health checks" in error["message"]
    got = httpx.get(f"{gateway.url}{RESPONSES}/{response_id}", headers=with_credential(None), timeout=10)
    assert got.status_code == 503 and got.json()["error"]["code"] == "stored_response_unavailable"


def test_the_index_is_per_tenant(gateway: Gateway, stores: dict[str, Sim]) -> None:
    response_id, _ = stored(gateway)
    other = {"authorization": "Bearer another-tenant"}
    result = post(f"{gateway.url}{RESPONSES}", body(previous_response_id=response_id), headers=other)
    # Landed on the holder by the gateway's own order, the engine serves it (the engine's store knows no
    # tenants); elsewhere, its own 404. Either way the gateway did not steer it by another tenant's record.
    assert result.status in (200, 404), result.body
    ended = gateway.wait_journal(
        result.request_id, lambda j: j["phase"] in ("completed", "failed"), headers=other
    )
    assert ended["destinations"]["source"] == "gateway"


def test_an_unknown_id_goes_like_any_request(gateway: Gateway) -> None:
    result = post(f"{gateway.url}{RESPONSES}", body(previous_response_id="resp_unknown0000"))
    assert result.status == 404, result.body  # the engine's own answer: it holds no such response
    journal = gateway.wait_journal(result.request_id, lambda j: j["phase"] == "failed")
    assert journal["destinations"]["source"] == "gateway" and len(journal["attempts"]) == 1
