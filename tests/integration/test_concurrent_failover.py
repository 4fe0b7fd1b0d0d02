"""A burst of early failures among concurrent streams: every client still gets one clean outcome.

24 streaming chat requests at once (one httpx.AsyncClient, 24 tasks, each with its own Idempotency-Key)
through a gateway with two simulated replicas; every third request fails before its first delta, cycling
through a reset-free close, an in-band error, a 503 and an abort. Nothing reached those clients yet, so each
is retried invisibly, or — when a retry budget refuses the retry — answered with ONE JSON error naming the
request and why. The known bug this reproduces: under such a burst Envoy's retry budget/breaker refuses
some retries, and the client receives the held attempt itself (HTTP 503 with `text/event-stream` and the
dead attempt's role event) or the replica's raw in-band error.

Each request's evidence (client bytes, journal, replica logs) also goes through `tests.invariants`.
"""

from __future__ import annotations

import asyncio
import json
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.fault.fuzz import gather_evidence, send_request
from tests.harness import Gateway, Sim
from tests.invariants import ClientOutcome, Evidence, SentRequest, check_request, outcome_kind

pytestmark = pytest.mark.integration

STREAMS = 24
MAX_TOKENS = 8
# Slow enough tokens that the 24 streams (and the retries) are all in flight together: 8 x 50 ms each.
TOKEN_INTERVAL = 0.05
MIN_IN_FLIGHT = (
    12  # the burst really overlapped (checked from the replicas' logs), or the test proves nothing
)
FAULTS = (
    "close@token:1 attempt=1",
    "error@token:1 attempt=1",
    "status503@headers attempt=1",
    "abort@token:1 attempt=1",
)
# One retry in flight at a time: 0 % of the active requests, floor 1. (`budgets.max_concurrent_retries: 1`
# would say the same twice: Envoy ignores the max_retries circuit breaker once a retry_budget is set, and
# the key is leaving the policy.)
TIGHT_POLICY = """
budgets:
  retry_budget_percent: 0
  min_retry_concurrency: 1
"""
BUDGET_EXHAUSTED = "retry_budget_exhausted"
CREDENTIAL = "Bearer concurrent-failover"  # requests and journal look-ups share one tenant


def fault_of(i: int) -> str | None:
    """Every third request fails before its first delta, cycling through FAULTS."""
    return FAULTS[(i // 3) % len(FAULTS)] if i % 3 == 0 else None


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Sim]]:
    work = tmp_path_factory.mktemp("concurrent-sims")
    sims: dict[str, Sim] = {}
    try:
        for name in ("a", "b"):
            sims[name] = Sim(name, work, token_interval=TOKEN_INTERVAL)
        yield sims
    finally:
        for sim in sims.values():
            sim.stop()


@pytest.fixture(scope="module")
def default_gateway(
    etcd: str, pool: dict[str, Sim], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Gateway]:
    work: Path = tmp_path_factory.mktemp("concurrent-default")
    gateway = Gateway(replicas=[s.endpoint for s in pool.values()], etcd=etcd, work=work)
    try:
        yield gateway
    finally:
        gateway.stop()


@pytest.fixture(scope="module")
def tight_gateway(
    etcd: str, pool: dict[str, Sim], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Gateway]:
    work: Path = tmp_path_factory.mktemp("concurrent-tight")
    config = work / "policy.yaml"
    config.write_text(TIGHT_POLICY)
    gateway = Gateway(replicas=[s.endpoint for s in pool.values()], etcd=etcd, work=work, config=config)
    try:
        yield gateway
    finally:
        gateway.stop()


async def _burst(url: str, sent: list[SentRequest]) -> list[ClientOutcome]:
    limits = httpx.Limits(max_connections=STREAMS, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=httpx.Timeout(30, connect=5), limits=limits) as client:
        tasks = [send_request(client, url, s, authorization=CREDENTIAL) for s in sent]
        return list(await asyncio.gather(*tasks))


def burst(gateway: Gateway, pool: dict[str, Sim], label: str) -> list[Evidence]:
    nonce = secrets.token_hex(3)
    sent = []
    for i in range(STREAMS):
        rid = f"cf-{label}-{nonce}-{i:02d}"
        body = {
            "model": "tiny",
            "messages": [{"role": "user", "content": f"burst {rid}"}],
            "stream": True,
            "max_tokens": MAX_TOKENS,
        }
        sent.append(SentRequest(rid, "chat", body, fault_of(i)))
    outcomes = asyncio.run(_burst(gateway.url, sent))
    return asyncio.run(
        gather_evidence(
            gateway.url,
            sent,
            outcomes,
            replica_records=lambda: [r for sim in pool.values() for r in sim.records()],
            live_pids=lambda: frozenset(
                s.child.pid for s in pool.values() if s.child is not None and s.child.alive()
            ),
            authorization=CREDENTIAL,
        )
    )


def max_in_flight(evidence: list[Evidence]) -> int:
    """The most attempts the replicas were serving at one instant, from their own logs."""
    edges: list[tuple[float, int]] = []
    for ev in evidence:
        for record in ev.replica_records:
            if record.get("event") == "end":
                edges += [(record["t_start"], 1), (record["t_end"], -1)]
    level = peak = 0
    for _, step in sorted(edges):
        level += step
        peak = max(peak, level)
    return peak


def what_the_client_got(ev: Evidence) -> str:
    client = ev.client
    return (
        f"{ev.request_id} (fault {ev.sent.fault}): {outcome_kind(ev)}, HTTP {client.status} "
        f"{client.headers.get('content-type', '')!r}, transport error {client.transport_error}, "
        f"body {client.body[:300]!r}"
    )


def replica_outcomes(ev: Evidence) -> list[Any]:
    ends = sorted((r for r in ev.replica_records if r.get("event") == "end"), key=lambda r: r["t_start"])
    return [r.get("outcome") for r in ends]


def complete_answer_problems(ev: Evidence) -> list[str]:
    """One complete generation from one attempt: 200, every content event, [DONE] once, no terminal frame,
    journal completed — after 2 attempts if the request carried a fault, 1 otherwise."""
    problems: list[str] = []
    journal = ev.journal or {}
    if outcome_kind(ev) != "complete":
        return [f"not a complete answer: {what_the_client_got(ev)}"]
    if (journal.get("phase"), journal.get("outcome")) != ("completed", "completed"):
        problems.append(
            f"{ev.request_id}: journal phase={journal.get('phase')} outcome={journal.get('outcome')}"
        )
    want = 2 if ev.sent.fault else 1
    if journal.get("attempt") != want:
        problems.append(
            f"{ev.request_id} (fault {ev.sent.fault}): {journal.get('attempt')} attempts in the journal, "
            f"expected {want}; replicas logged {replica_outcomes(ev)}"
        )
    elif ev.sent.fault and replica_outcomes(ev)[-1:] != ["completed"]:
        problems.append(f"{ev.request_id}: the last attempt did not complete: {replica_outcomes(ev)}")
    return problems


def test_a_burst_of_early_failures_all_get_complete_answers(
    default_gateway: Gateway, pool: dict[str, Sim]
) -> None:
    evidence = burst(default_gateway, pool, "default")
    assert max_in_flight(evidence) >= MIN_IN_FLIGHT, (
        "the 24 streams did not overlap: the burst proves nothing"
    )
    problems = [str(v) for ev in evidence for v in check_request(ev)]
    problems += [p for ev in evidence for p in complete_answer_problems(ev)]
    assert not problems, f"{len(problems)} problems among {STREAMS} concurrent streams:\n" + "\n".join(
        problems
    )


def test_with_a_tight_retry_budget_each_gets_a_complete_answer_or_one_json_error(
    tight_gateway: Gateway, pool: dict[str, Sim]
) -> None:
    evidence = burst(tight_gateway, pool, "tight")
    assert max_in_flight(evidence) >= MIN_IN_FLIGHT, (
        "the 24 streams did not overlap: the burst proves nothing"
    )
    problems = [str(v) for ev in evidence for v in check_request(ev)]
    refused = 0
    for ev in evidence:
        kind = outcome_kind(ev)
        if kind == "complete":
            problems += complete_answer_problems(ev)
            continue
        if ev.sent.fault is None:
            problems.append(f"a healthy request did not get a complete answer: {what_the_client_got(ev)}")
            continue
        if kind != f"json_error:{BUDGET_EXHAUSTED}":
            problems.append(
                f"neither a complete answer nor ONE JSON {BUDGET_EXHAUSTED}: {what_the_client_got(ev)}"
            )
            continue
        refused += 1
        client, journal = ev.client, ev.journal or {}
        error = json.loads(client.body)["error"]
        attempts = error.get("attempts")
        named = len(attempts) if isinstance(attempts, list) else attempts
        if (
            client.status == 200
            or error.get("request_id") != ev.request_id
            or named != journal.get("attempt")
        ):
            problems.append(
                f"{ev.request_id}: HTTP {client.status}, error names request {error.get('request_id')!r} and "
                f"attempts {attempts!r}, the journal lists {journal.get('attempt')}"
            )
        if (journal.get("phase"), journal.get("outcome")) != ("failed", BUDGET_EXHAUSTED):
            problems.append(
                f"{ev.request_id}: client told {BUDGET_EXHAUSTED}, journal says phase={journal.get('phase')} "
                f"outcome={journal.get('outcome')}"
            )
        open_attempts = [a for a in journal.get("attempts") or [] if a.get("outcome") is None]
        if open_attempts:
            problems.append(f"{ev.request_id}: attempts left without an outcome: {open_attempts}")
    assert not problems, f"{len(problems)} problems among {STREAMS} concurrent streams:\n" + "\n".join(
        problems
    )
    # 8 failures at once against max 1 concurrent retry: the budget must have refused at least one retry,
    # or this variant did not exercise what it is about.
    assert refused >= 1, f"no retry was refused: {[outcome_kind(ev) for ev in evidence]}"
