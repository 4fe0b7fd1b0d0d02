"""One gateway, two routes, two policies: the same failure before the first delta is retried on the default
route and fails at once on a route whose policy says fail_request. The overlay travels in the Envoy route
config (ExtProcPerRoute initial metadata); a bad one is refused at start-up, or answered 500 when an Envoy
config of someone else's carries it."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from router_sidecar.core.policy import ROUTE_POLICY_METADATA
from router_sidecar.runtime.envoy_config import find_envoy
from router_sidecar.runtime.supervise import Child, free_port, port_open, start_envoy, wait_until
from tests.harness import PYTHON, Gateway, Sim, chat, poll, post

pytestmark = pytest.mark.integration

STRICT = {"on_upstream_failure": {"before_first_delta": {"action": "fail_request"}}}
ROUTES = {"routes": [{"name": "strict", "match": {"header": "x-tier", "value": "strict"}, "policy": STRICT}]}
FAULT = "status503@headers attempt=1"


@pytest.fixture(scope="module")
def routed(etcd: str, sims: dict[str, Sim], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    work: Path = tmp_path_factory.mktemp("routed")
    config = work / "policy.yaml"
    config.write_text(yaml.safe_dump(ROUTES))
    gateway = Gateway(replicas=[s.endpoint for s in sims.values()], etcd=etcd, work=work, config=config)
    try:
        yield gateway
    finally:
        gateway.stop()


def _attempts_served(sims: dict[str, Sim], request_id: str) -> int:
    return len([r for s in sims.values() for r in s.requests_for(request_id)])


def test_the_same_failure_is_retried_on_one_route_and_not_on_the_other(
    routed: Gateway, sims: dict[str, Sim]
) -> None:
    default = post(f"{routed.url}/v1/chat/completions", chat(max_tokens=4), headers={"x-sim-fault": FAULT})
    assert default.status == 200 and default.data()[-1] == "[DONE]" and len(default.content_chunks()) == 4
    record = routed.wait_journal(default.request_id, lambda j: j["phase"] == "completed")
    assert [a["outcome"] for a in record["attempts"]] == ["failed", "completed"]

    strict = post(
        f"{routed.url}/v1/chat/completions",
        chat(max_tokens=4),
        headers={"x-sim-fault": FAULT, "x-tier": "strict"},
    )
    assert strict.status == 502 and strict.headers["content-type"].startswith("application/json"), strict.body
    error = json.loads(strict.body)["error"]
    assert error["request_id"] == strict.request_id and len(error["attempts"]) == 1
    assert error["code"] == "retries_exhausted" and error["attempts"][0]["detail"] == "upstream_status"
    record = routed.wait_journal(strict.request_id, lambda j: j["phase"] == "failed")
    assert record["attempt"] == 1 and record["retry_budget"] == 0
    poll(lambda: _attempts_served(sims, strict.request_id) == 1, what="the replica's log of the one attempt")
    # Healthy requests on the strict route are served as usual.
    ok = post(f"{routed.url}/v1/chat/completions", chat(max_tokens=3), headers={"x-tier": "strict"})
    assert ok.status == 200 and len(ok.content_chunks()) == 3


def test_a_bad_route_policy_stops_the_gateway_at_start(etcd: str, tmp_path: Path) -> None:
    config = tmp_path / "policy.yaml"
    bad = {
        "routes": [
            {
                "name": "x",
                "match": {"header": "x-tier", "value": "x"},
                "policy": {"budgets": {"min_retry_concurrency": 1}},
            }
        ]
    }
    config.write_text(yaml.safe_dump(bad))
    gateway = ["gateway", "--listen", f"127.0.0.1:{free_port()}", "--replica", "127.0.0.1:9"]
    result = subprocess.run(
        [PYTHON, "-m", "router_sidecar", *gateway, "--etcd", etcd, "--policy", str(config)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 2, result.stderr
    assert (
        "routes[0].policy.budgets.min_retry_concurrency" in result.stderr and "gateway-wide" in result.stderr
    )


def test_an_envoy_config_carrying_a_bad_overlay_gets_a_clear_500(
    etcd: str, sims: dict[str, Sim], tmp_path: Path
) -> None:
    """An Envoy config written by someone else (Envoy Gateway, a mesh): the overlay is read as it comes."""
    policy = tmp_path / "policy.yaml"
    policy.write_text(yaml.safe_dump(ROUTES))
    port, sock = free_port(), tmp_path / "sidecar.sock"
    rendered = subprocess.run(
        [PYTHON, "-m", "router_sidecar", "envoy-config", "--listen", f"127.0.0.1:{port}"]
        + ["--sidecar-socket", str(sock), "--admin-socket", str(tmp_path / "admin.sock")]
        + ["--access-log", str(tmp_path / "access.log"), "--policy", str(policy)]
        + [arg for s in sims.values() for arg in ("--replica", s.endpoint)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    config = yaml.safe_load(rendered)
    hcm = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    (strict,) = [r for r in hcm["route_config"]["virtual_hosts"][0]["routes"] if r.get("name") == "strict"]
    (entry,) = strict["typed_per_filter_config"]["envoy.filters.http.ext_proc"]["overrides"][
        "grpc_initial_metadata"
    ]
    assert entry["key"] == ROUTE_POLICY_METADATA
    entry["value"] = json.dumps({"limits": {"max_event_bytes": 4096}})  # gateway-wide: not per route
    envoy_yaml = tmp_path / "envoy.yaml"
    envoy_yaml.write_text(yaml.safe_dump(config))
    serve = ["serve", "--listen", f"unix:{sock}", "--etcd", etcd, "--policy", str(policy)]
    serve += [arg for s in sims.values() for arg in ("--replica", s.endpoint)]
    sidecar = Child("sidecar", [PYTHON, "-m", "router_sidecar", *serve], log_path=tmp_path / "sidecar.out")
    envoy: Child | None = None
    try:
        wait_until(
            lambda: "ready" in (tmp_path / "sidecar.out").read_text(),
            timeout=30,
            what="sidecar",
            child=sidecar,
        )
        envoy = start_envoy(find_envoy(), envoy_yaml, name="envoy", log_path=tmp_path / "envoy.log")
        wait_until(lambda: port_open("127.0.0.1", port), timeout=30, what="envoy", child=envoy)
        answer = httpx.post(
            f"http://127.0.0.1:{port}/v1/chat/completions",
            json=chat(max_tokens=2),
            headers={"x-tier": "strict", "authorization": "Bearer t"},
            timeout=10,
        )
        assert answer.status_code == 500, answer.text
        error = answer.json()["error"]
        assert error["code"] == "invalid_route_policy" and "limits.max_event_bytes" in error["message"]
        default = httpx.post(
            f"http://127.0.0.1:{port}/v1/chat/completions", json=chat(max_tokens=2), timeout=10
        )
        assert default.status_code == 200  # the other routes are not affected
    finally:
        if envoy is not None:
            envoy.stop()
        sidecar.stop()
