"""Retry budgets: the re-prefill cost cap per request, and Envoy's cluster retry budget under mass failure."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.harness import ClientResult, Gateway, Sim, chat, post

pytestmark = pytest.mark.integration

POLICY = """
reprefill_cost_cap:
  max_prompt_tokens: 50
budgets:
  retry_budget_percent: 1
  min_retry_concurrency: 1
"""


@pytest.fixture(scope="module")
def capped_gateway(
    etcd: str, sims: dict[str, Sim], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Gateway]:
    work: Path = tmp_path_factory.mktemp("capped")
    config = work / "policy.yaml"
    config.write_text(POLICY)
    gw = Gateway(replicas=[s.endpoint for s in sims.values()], etcd=etcd, work=work, config=config)
    try:
        yield gw
    finally:
        gw.stop()


def long_prompt_chat(**extra: object) -> dict[str, object]:
    # ~100 estimated tokens (400 bytes / 4): over the cap of 50.
    return {**chat(max_tokens=3), "messages": [{"role": "user", "content": "word " * 80}], **extra}


def test_a_request_over_the_cost_cap_is_served(capped_gateway: Gateway) -> None:
    result = post(f"{capped_gateway.url}/v1/chat/completions", long_prompt_chat())
    assert result.status == 200 and result.data()[-1] == "[DONE]"
    journal = capped_gateway.wait_journal(result.request_id, lambda j: j["phase"] == "completed")
    accepted = journal["events"][0]
    assert accepted["event"] == "request_accepted" and accepted["retry_allowed"] is False
    assert accepted["estimated_prompt_tokens"] > 50


@pytest.mark.parametrize("fault", ["status503@headers attempt=1", "reset@token:1 attempt=1"])
def test_a_request_over_the_cost_cap_is_never_retried(
    capped_gateway: Gateway, sims: dict[str, Sim], fault: str
) -> None:
    result = post(
        f"{capped_gateway.url}/v1/chat/completions", long_prompt_chat(), headers={"x-sim-fault": fault}
    )
    assert result.status in (502, 503)
    assert b"data:" not in result.body
    error = json.loads(result.body)["error"]
    assert error["request_id"] == result.request_id
    if fault.startswith("status503"):
        assert error["code"] == "retry_not_allowed" and "cost cap" in error["message"]
    journal = capped_gateway.wait_journal(result.request_id, lambda j: j["phase"] == "failed")
    assert journal["attempt"] == 1
    assert len([r for s in sims.values() for r in s.requests_for(result.request_id)]) == 1


def test_small_prompts_still_retry_under_the_same_policy(capped_gateway: Gateway) -> None:
    result = post(
        f"{capped_gateway.url}/v1/chat/completions",
        chat(max_tokens=3),
        headers={"x-sim-fault": "reset@token:1 attempt=1"},
    )
    assert result.status == 200 and len(result.content_chunks()) == 3
    journal = capped_gateway.wait_journal(result.request_id, lambda j: j["phase"] == "completed")
    assert journal["attempt"] == 2


def test_mass_failure_is_bounded_by_the_cluster_retry_budget(capped_gateway: Gateway) -> None:
    # Every first attempt fails (slowly, so they overlap); with a budget of max(1% of active, 1) concurrent
    # retries, Envoy refuses most retries instead of doubling the load on the pool.
    def one(_: int) -> ClientResult:
        headers = {"x-sim-fault": "delay@role for=0.4; reset@role attempt=1"}
        return post(f"{capped_gateway.url}/v1/chat/completions", chat(max_tokens=2), headers=headers)

    before = retry_counters(capped_gateway)
    with ThreadPoolExecutor(max_workers=10) as pool:
        results = list(pool.map(one, range(10)))
    statuses = [r.status for r in results]
    after = retry_counters(capped_gateway)
    overflow = after["upstream_rq_retry_overflow"] - before["upstream_rq_retry_overflow"]
    retried = after["upstream_rq_retry"] - before["upstream_rq_retry"]
    assert overflow >= 1, after
    assert retried + overflow == 10 and statuses.count(200) == retried, (statuses, after)
    # The refused ones get one honest JSON error naming why, never a partial body.
    refused = [r for r in results if r.status != 200]
    assert len(refused) == overflow
    for result in refused:
        assert result.status == 503 and result.headers["content-type"] == "application/json", result
        error = json.loads(result.body)["error"]
        assert (error["code"], error["request_id"]) == ("retry_budget_exhausted", result.request_id)
        journal = capped_gateway.wait_journal(result.request_id, lambda j: j["phase"] == "failed")
        assert journal["outcome"] == "retry_budget_exhausted"
        assert all(a["outcome"] == "failed" for a in journal["attempts"]), journal["attempts"]


def retry_counters(gateway: Gateway) -> dict[str, int]:
    stats = gateway.envoy_admin("/stats?filter=cluster.llm.upstream_rq_retry").decode()
    return {
        k.removeprefix("cluster.llm."): int(v)
        for k, v in (ln.split(": ") for ln in stats.strip().splitlines())
    }


def test_a_pool_wide_failure_at_the_default_budget_does_not_double_the_load(
    gateway: Gateway, sims: dict[str, Sim]
) -> None:
    """Default policy (max_attempts 2, retry budget 50 % of the requests in flight, at least 3): every
    attempt of every request fails before its first delta, slowly enough (2 s) that they overlap even when a
    busy machine spreads the requests' arrival. Envoy lets about
    half of them retry and refuses the rest: the pool sees well under twice the requests, and every client
    gets one JSON error naming why, never a partial body."""
    count = 32
    keys = [f"pool-wide-{uuid.uuid4().hex[:8]}-{i}" for i in range(count)]

    def one(i: int) -> ClientResult:
        headers = {"x-sim-fault": "delay@role for=2; reset@role", "idempotency-key": keys[i]}
        return post(f"{gateway.url}/v1/chat/completions", chat(max_tokens=2), headers=headers)

    before = retry_counters(gateway)
    with ThreadPoolExecutor(max_workers=count) as pool:
        results = list(pool.map(one, range(count)))
    after = retry_counters(gateway)
    overflow = after["upstream_rq_retry_overflow"] - before["upstream_rq_retry_overflow"]
    retried = after["upstream_rq_retry"] - before["upstream_rq_retry"]
    served = sum(len(sim.requests_for(key)) for sim in sims.values() for key in keys)
    # Envoy's num_retries leaves room for attempts that die at their connection, so after a request's last
    # allowed attempt failed Envoy may try once more: the budget refuses it (overflow), or the sidecar does
    # (a retry that never reaches a replica). A request that was not retried had its retry refused.
    replica_retries = served - count
    assert replica_retries <= retried, (retried, overflow, served)
    assert count - replica_retries <= overflow <= count, (retried, overflow, served)
    assert 1 <= replica_retries <= 0.75 * count, (retried, overflow)  # ~half: the budget bounds it
    for result in results:
        assert result.status in (502, 503) and result.headers["content-type"] == "application/json", result
        error = json.loads(result.body)["error"]
        assert error["request_id"] == result.request_id
        assert error["code"] in ("retries_exhausted", "retry_budget_exhausted"), error
