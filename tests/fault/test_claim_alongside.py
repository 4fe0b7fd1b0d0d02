"""The journal claim runs beside the first attempt (policy `journal.claim_before_forwarding: false`).

The claim (the record's create, a raft write) is off the way to the first token: the request is forwarded at
once and the claim settles while its first attempt runs. What must hold anyway:

* nothing of the attempt reaches the client before the claim is settled: with etcd frozen while the replica
  answers a duplicate of a finished key, the client gets only the `409 request_already_finished`, none of the
  replica's bytes, and the first run's record is untouched;
* with `claim_before_forwarding: true` a duplicate key never reaches a replica.

etcd is frozen (SIGSTOP) for less than the store's 2 s call timeout, so the claim is slow, not unreachable
(unreachable is degraded mode: served without retries, tests/fault/test_etcd_trouble.py).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from router_sidecar.runtime.supervise import Child, start_etcd
from tests.harness import ClientResult, Gateway, Sim, chat, poll, post, with_credential

pytestmark = pytest.mark.fault

FREEZE_AT_MOST_SECONDS = 1.2  # below the store's 2 s call timeout, with room for a busy machine


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Child, Sim, Gateway, Gateway]]:
    work: Path = tmp_path_factory.mktemp("claim-alongside")
    etcd, endpoint = start_etcd(work / "etcd", log_path=work / "etcd.log")
    (work / "before.yaml").write_text("journal:\n  claim_before_forwarding: true\n")
    sim = Sim("a", work)
    for name in ("alongside", "before"):
        (work / name).mkdir()
    alongside = before = None
    try:
        alongside = Gateway(replicas=[sim.endpoint], etcd=endpoint, work=work / "alongside")
        before = Gateway(
            replicas=[sim.endpoint], etcd=endpoint, work=work / "before", config=work / "before.yaml"
        )
        yield etcd, sim, alongside, before
    finally:
        for gateway in (alongside, before):
            if gateway is not None:
                gateway.stop()
        sim.stop()
        etcd.stop()


def finished_run(gateway: Gateway, key: str) -> dict[str, Any]:
    first = post(f"{gateway.url}/v1/chat/completions", chat(max_tokens=2), headers={"idempotency-key": key})
    assert first.status == 200 and first.data()[-1] == "[DONE]"
    return gateway.wait_journal(key, lambda j: j["phase"] == "completed")


@contextlib.contextmanager
def frozen(etcd: Child) -> Iterator[None]:
    os.kill(etcd.proc.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(etcd.proc.pid, signal.SIGCONT)


def test_nothing_reaches_the_client_before_the_claim_is_settled(
    stack: tuple[Child, Sim, Gateway, Gateway],
) -> None:
    etcd, sim, gateway, _ = stack
    key = "claim-alongside-finished"
    record = finished_run(gateway, key)
    duplicate: dict[str, ClientResult] = {}
    client = threading.Thread(
        target=lambda: duplicate.setdefault(
            "r",
            post(f"{gateway.url}/v1/chat/completions", chat(max_tokens=2), headers={"idempotency-key": key}),
        )
    )
    with frozen(etcd):
        client.start()
        # The attempt is forwarded while the claim waits for etcd; give the replica time to answer it whole
        # (bounded: etcd must be back before the store gives up on it).
        deadline = time.monotonic() + FREEZE_AT_MOST_SECONDS
        while time.monotonic() < deadline and len(sim.requests_for(key)) < 2:
            time.sleep(0.02)
        reached_the_replica = sim.started_for(key) == 2
    client.join(30)
    answer = duplicate["r"]
    assert answer.status == 409, answer.body
    assert json.loads(answer.body)["error"]["code"] == "request_already_finished"
    assert b"data:" not in answer.body  # none of the replica's answer
    assert reached_the_replica, "the duplicate's attempt did not run beside its claim"
    after = gateway.wait_journal(key, lambda j: j["phase"] == "completed")
    assert {k: after[k] for k in ("attempts", "events", "outcome")} == {
        k: record[k] for k in ("attempts", "events", "outcome")
    }


def test_claim_before_forwarding_never_sends_a_duplicate_key_to_a_replica(
    stack: tuple[Child, Sim, Gateway, Gateway],
) -> None:
    _, sim, _, gateway = stack
    key = "claim-before-finished"
    finished_run(gateway, key)
    answer = post(f"{gateway.url}/v1/chat/completions", chat(max_tokens=2), headers={"idempotency-key": key})
    assert answer.status == 409 and json.loads(answer.body)["error"]["code"] == "request_already_finished"
    poll(lambda: len(sim.requests_for(key)) == 1, what="the first run's end record")
    assert sim.started_for(key) == 1


def test_claim_before_forwarding_a_client_gone_during_the_claim_leaves_no_key_in_flight(
    stack: tuple[Child, Sim, Gateway, Gateway],
) -> None:
    etcd, sim, _, gateway = stack
    key = "claim-before-client-gone"
    # The client gives up while the claim waits for etcd (Envoy then cancels the stream).
    with frozen(etcd), contextlib.suppress(httpx.TimeoutException):
        httpx.post(
            f"{gateway.url}/v1/chat/completions",
            json=chat(max_tokens=2),
            headers=with_credential({"idempotency-key": key}),
            timeout=0.5,
        )
    # The claim then wins: the record says the request ended, it does not stay "in flight" for good.
    record = gateway.wait_journal(key, lambda j: j["phase"] not in ("admitted", "prefill", "decode"))
    assert (record["phase"], record["first_delta_sent"], record["attempts"]) == ("cancelled", False, [])
    again = post(f"{gateway.url}/v1/chat/completions", chat(max_tokens=2), headers={"idempotency-key": key})
    assert json.loads(answer_body(again)).get("error", {}).get("code") != "idempotency_key_in_flight"
    assert sim.started_for(key) == 0


def answer_body(result: ClientResult) -> bytes:
    return result.body if result.status != 200 else b"{}"
