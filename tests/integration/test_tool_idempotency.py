"""Tool-call idempotency through the gateway: a side effect happens once, however many attempts.

Real Envoy, real etcd, a test tool service that counts executions, and simulator replicas in
agent-worker mode that call the tool through the gateway with the key `{request_id}:call_01`.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from router_sidecar.runtime.supervise import free_port
from router_testbed.toolsvc import ToolSvcProcess, read_executions, spawn_toolsvc
from tests.harness import Gateway, Sim, chat, poll, post, with_credential

pytestmark = pytest.mark.integration

RETENTION_SECONDS = 3
POLICY = f"""
tools:
  retention_seconds: {RETENTION_SECONDS}
  max_stored_response_bytes: 100000
  call_timeout_seconds: 5
"""


@pytest.fixture(scope="module")
def toolsvc(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ToolSvcProcess]:
    work = tmp_path_factory.mktemp("toolsvc")
    svc = spawn_toolsvc(name="payments", log_path=str(work / "executions.jsonl"))
    try:
        yield svc
    finally:
        svc.stop()


@pytest.fixture(scope="module")
def agents_and_gateway(
    etcd: str, toolsvc: ToolSvcProcess, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Gateway, dict[str, Sim]]]:
    work: Path = tmp_path_factory.mktemp("tool-gateway")
    port = free_port()
    tool_url = f"http://127.0.0.1:{port}/tools/payments/charge"
    agents = {n: Sim(n, work, extra_args=("--tool-url", tool_url)) for n in ("agent-a", "agent-b")}
    config = work / "policy.yaml"
    config.write_text(POLICY)
    gateway = None
    try:
        gateway = Gateway(
            replicas=[s.endpoint for s in agents.values()],
            etcd=etcd,
            work=work,
            config=config,
            port=port,
            tools=(f"payments={toolsvc.address}",),
        )
        yield gateway, agents
    finally:
        if gateway is not None:
            gateway.stop()
        for sim in agents.values():
            sim.stop()


@pytest.fixture
def gateway(agents_and_gateway: tuple[Gateway, dict[str, Sim]]) -> Gateway:
    for sim in agents_and_gateway[1].values():
        sim.ensure_running()
    return agents_and_gateway[0]


def executions(toolsvc: ToolSvcProcess, key: str) -> list[dict[str, Any]]:
    assert toolsvc.log_path is not None
    return [e for e in read_executions(toolsvc.log_path) if e.get("key") == key]


def call_tool(
    gateway: Gateway,
    key: str | None,
    body: dict[str, Any],
    path: str = "/tools/payments/charge",
    method: str = "POST",
    **headers: str,
) -> httpx.Response:
    all_headers = {"content-type": "application/json", **headers}
    if key is not None:
        all_headers["idempotency-key"] = key
    return httpx.request(
        method,
        f"{gateway.url}{path}",
        content=json.dumps(body),
        headers=with_credential(all_headers),
        timeout=15,
    )


def test_worker_killed_after_tool_call_retry_replays_the_result(
    gateway: Gateway, agents_and_gateway: tuple[Gateway, dict[str, Sim]], toolsvc: ToolSvcProcess
) -> None:
    # Scenario 5: the worker calls the tool, then dies before its first delta. The gateway retries on the
    # other replica; that attempt derives the same key and gets the stored result: one execution.
    agents = agents_and_gateway[1]
    result = post(
        f"{gateway.url}/v1/chat/completions",
        chat(max_tokens=4),
        headers={"x-sim-fault": "exit@tool attempt=1"},
    )
    assert result.status == 200 and result.transport_error is None
    assert result.data()[-1] == "[DONE]"
    key = f"{result.request_id}:call_01"
    [execution] = executions(toolsvc, key)
    contents = [c["choices"][0]["delta"]["content"] for c in result.content_chunks()]
    assert contents[0] == f"tool:ok-{execution['n']}", "the answer is built on the one execution's result"
    attempts = poll(
        lambda: (
            (
                a := sorted(
                    (r for s in agents.values() for r in s.requests_for(result.request_id)),
                    key=lambda r: r["t_start"],
                )
            )
            and len(a) == 2
            and a
        ),
        what="both attempts",
    )
    assert attempts[0]["outcome"] == "fault:exit" and attempts[0]["tool_replayed"] is False
    assert attempts[1]["tool_replayed"] is True and attempts[1]["tool_status"] == 200
    journal = gateway.wait_journal(result.request_id, lambda j: j["phase"] == "completed")
    [tool_call] = journal["tool_calls"]
    assert tool_call["key"] == key
    assert [(e["event"], e["attempt"]) for e in tool_call["events"]] == [
        ("tool_call_claimed", 1),
        ("tool_call_executed", 1),
        ("tool_call_replayed", 2),
    ]
    assert journal["attempt"] == 2 and journal["attempts"][0]["replica"] != journal["attempts"][1]["replica"]


def test_a_burst_of_parallel_duplicates_executes_once(gateway: Gateway, toolsvc: ToolSvcProcess) -> None:
    key = "burst:call_01"
    body = {"amount": 10}

    def one(_: int) -> httpx.Response:
        return call_tool(gateway, key, body, **{"x-tool-fault": "delay=0.5"})

    with ThreadPoolExecutor(max_workers=12) as pool:
        responses = list(pool.map(one, range(12)))
    statuses = sorted(r.status_code for r in responses)
    assert len(executions(toolsvc, key)) == 1
    assert statuses.count(200) >= 1 and set(statuses) <= {200, 409}, statuses
    in_progress = [r for r in responses if r.status_code == 409]
    assert in_progress and all(r.json()["error"]["code"] == "tool_call_in_progress" for r in in_progress)
    assert all(r.headers.get("retry-after") for r in in_progress)
    # Once it settled, the same key replays the one result.
    replay = call_tool(gateway, key, body)
    assert replay.status_code == 200 and replay.headers["x-idempotent-replay"] == "true"
    assert replay.json()["execution"] == executions(toolsvc, key)[0]["n"]
    assert len(executions(toolsvc, key)) == 1


def test_outcome_unknown_is_never_executed_again(gateway: Gateway, toolsvc: ToolSvcProcess) -> None:
    key = "unknown:call_01"
    first = call_tool(gateway, key, {"amount": 1}, **{"x-tool-fault": "reset"})
    assert first.status_code >= 500
    again = call_tool(gateway, key, {"amount": 1})
    assert again.status_code == 409 and again.json()["error"]["code"] == "tool_outcome_unknown"
    assert len(executions(toolsvc, key)) == 1


@pytest.mark.parametrize(("fault", "status"), [("status=400", 400), ("retriable503", 503)])
def test_a_definite_failure_frees_the_key(
    gateway: Gateway, toolsvc: ToolSvcProcess, fault: str, status: int
) -> None:
    key = f"definite-{status}:call_01"
    failed = call_tool(gateway, key, {"amount": 2}, **{"x-tool-fault": fault})
    assert failed.status_code == status
    assert executions(toolsvc, key) == []
    ok = call_tool(gateway, key, {"amount": 2})
    assert ok.status_code == 200 and "x-idempotent-replay" not in ok.headers
    assert len(executions(toolsvc, key)) == 1


def test_a_result_too_large_to_keep_is_an_error_not_a_rerun(
    gateway: Gateway, toolsvc: ToolSvcProcess
) -> None:
    key = "large:call_01"
    first = call_tool(gateway, key, {"amount": 3}, **{"x-tool-fault": "big=200000"})
    assert first.status_code == 200 and len(first.content) == 200000
    again = call_tool(gateway, key, {"amount": 3})
    assert again.status_code == 409 and again.json()["error"]["code"] == "tool_result_not_stored"
    assert len(executions(toolsvc, key)) == 1


def test_keys_are_scoped_to_the_caller(gateway: Gateway, toolsvc: ToolSvcProcess) -> None:
    key = "shared:call_01"
    alice = call_tool(gateway, key, {"amount": 4}, authorization="Bearer alice")
    bob = call_tool(gateway, key, {"amount": 4}, authorization="Bearer bob")
    assert alice.status_code == bob.status_code == 200
    assert alice.json()["execution"] != bob.json()["execution"], "bob must never get alice's stored result"
    alice_again = call_tool(gateway, key, {"amount": 4}, authorization="Bearer alice")
    assert alice_again.json() == alice.json() and alice_again.headers["x-idempotent-replay"] == "true"
    assert len(executions(toolsvc, key)) == 2


def test_a_key_reused_with_another_body_is_rejected(gateway: Gateway, toolsvc: ToolSvcProcess) -> None:
    key = "reuse:call_01"
    assert call_tool(gateway, key, {"amount": 5}).status_code == 200
    other = call_tool(gateway, key, {"amount": 500})
    assert other.status_code == 422 and other.json()["error"]["code"] == "idempotency_key_reused"
    assert len(executions(toolsvc, key)) == 1


@pytest.mark.parametrize(
    ("path", "method"),
    [
        ("/tools/payments/refund", "POST"),  # another action on the same tool
        ("/tools/payments/charge?currency=eur", "POST"),  # another query string
        ("/tools/payments/charge", "PUT"),  # another method
    ],
)
def test_a_key_names_one_whole_call(
    gateway: Gateway, toolsvc: ToolSvcProcess, path: str, method: str
) -> None:
    key = f"bound:{method}:{abs(hash(path))}"
    charge = call_tool(gateway, key, {"amount": 9})
    assert charge.status_code == 200
    other = call_tool(gateway, key, {"amount": 9}, path=path, method=method)
    assert other.status_code == 422, other.text
    error = other.json()["error"]
    assert error["code"] == "idempotency_key_reused" and "POST /tools/payments/charge" in error["message"]
    assert "x-idempotent-replay" not in other.headers  # never the charge's answer for another call
    assert [e["path"] for e in executions(toolsvc, key)] == ["/tools/payments/charge"]


def test_callers_without_a_credential_are_refused_on_tools_and_look_ups(
    gateway: Gateway, toolsvc: ToolSvcProcess
) -> None:
    key = "anonymous:call_01"
    response = httpx.post(
        f"{gateway.url}/tools/payments/charge",
        json={"amount": 1},
        headers={"idempotency-key": key},
        timeout=15,
    )
    assert response.status_code == 401 and response.json()["error"]["code"] == "authentication_required"
    assert response.headers["www-authenticate"] == "Bearer"
    assert executions(toolsvc, key) == []
    lookup = httpx.get(f"{gateway.url}/v1/requests/req_anything", timeout=10)
    assert lookup.status_code == 401 and lookup.json()["error"]["code"] == "authentication_required"


def test_with_refuse_anonymous_off_callers_without_a_credential_share_one_tenant(
    etcd: str, toolsvc: ToolSvcProcess, agents_and_gateway: tuple[Gateway, dict[str, Sim]], tmp_path: Path
) -> None:
    """The switch's other side: an operator who turns it off (every caller is trusted, e.g. behind an
    authenticating proxy) gets tool calls and look-ups for callers without a credential, all in one tenant."""
    config = tmp_path / "policy.yaml"
    config.write_text(POLICY + "\ntenancy:\n  refuse_anonymous: false\n")
    open_gateway = Gateway(
        replicas=[s.endpoint for s in agents_and_gateway[1].values()],
        etcd=etcd,
        work=tmp_path,
        config=config,
        tools=(f"payments={toolsvc.address}",),
    )
    try:
        key = "anonymous-allowed:call_01"
        url = f"{open_gateway.url}/tools/payments/charge"
        first = httpx.post(url, json={"amount": 1}, headers={"idempotency-key": key}, timeout=15)
        assert first.status_code == 200, first.text
        again = httpx.post(url, json={"amount": 1}, headers={"idempotency-key": key}, timeout=15)
        assert again.headers.get("x-idempotent-replay") == "true" and again.content == first.content
        assert len(executions(toolsvc, key)) == 1
        lookup = httpx.get(f"{open_gateway.url}/v1/requests/req_anything", timeout=10)
        assert (lookup.status_code, lookup.json()["error"]["code"]) == (404, "request_not_found"), lookup.text
        # Still no one's but the anonymous tenant's: a caller with a credential does not see the stored call.
        other = httpx.post(
            url, json={"amount": 1}, headers=with_credential({"idempotency-key": key}), timeout=15
        )
        assert other.status_code == 200 and other.headers.get("x-idempotent-replay") is None
        assert len(executions(toolsvc, key)) == 2
    finally:
        open_gateway.stop()


def test_a_tool_call_without_a_key_is_refused(gateway: Gateway, toolsvc: ToolSvcProcess) -> None:
    before = len(read_executions(toolsvc.log_path or ""))
    response = call_tool(gateway, None, {"amount": 6})
    assert response.status_code == 428 and response.json()["error"]["code"] == "idempotency_key_required"
    assert len(read_executions(toolsvc.log_path or "")) == before


def test_records_expire_after_the_retention_period(gateway: Gateway, toolsvc: ToolSvcProcess) -> None:
    key = "expiry:call_01"
    started = time.monotonic()
    assert call_tool(gateway, key, {"amount": 7}).status_code == 200
    assert call_tool(gateway, key, {"amount": 7}).headers.get("x-idempotent-replay") == "true"

    def executed_again() -> bool:
        return call_tool(gateway, key, {"amount": 7}).headers.get("x-idempotent-replay") != "true"

    poll(executed_again, timeout=RETENTION_SECONDS * 3 + 5, what="the record to expire")
    assert time.monotonic() - started >= RETENTION_SECONDS
    assert len(executions(toolsvc, key)) == 2


WAITING_POLICY = """
deadlines:
  request_seconds: 30
tools:
  call_timeout_seconds: 20
  in_progress_wait_seconds: 8
"""


def test_a_duplicate_waits_for_a_slow_call_longer_than_five_seconds(
    etcd: str, toolsvc: ToolSvcProcess, tmp_path: Path
) -> None:
    # The wait happens inside Envoy's admission message timeout, which the gateway derives from the policy
    # (it was fixed at 5 s: the duplicate got an empty 504).
    config = tmp_path / "policy.yaml"
    config.write_text(WAITING_POLICY)
    gateway = Gateway(
        replicas=[],
        etcd=etcd,
        work=tmp_path,
        config=config,
        tools=(f"payments={toolsvc.address}",),
        up_line=b"waiting for replicas:",  # tools only: no inference replica, so not ready (docs/cli.md)
    )
    try:
        key = "slow:call_01"
        with ThreadPoolExecutor(max_workers=1) as pool:
            first = pool.submit(call_tool, gateway, key, {"amount": 11}, **{"x-tool-fault": "delay=6"})
            poll(lambda: executions(toolsvc, key), what="the first call to execute")
            duplicate = call_tool(gateway, key, {"amount": 11})
            original = first.result(timeout=30)
        assert original.status_code == 200
        assert duplicate.status_code == 200, duplicate.text
        assert duplicate.headers["x-idempotent-replay"] == "true" and duplicate.json() == original.json()
        assert len(executions(toolsvc, key)) == 1
    finally:
        gateway.stop()
