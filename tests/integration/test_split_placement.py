"""The Kubernetes placement on loopback: `router-sidecar serve` and a separate Envoy started from the config
`router-sidecar envoy-config` renders (as the gateway Pod's init container does), sharing a unix socket.

The probes the Pod uses are answered through Envoy by the sidecar: /livez needs Envoy and the sidecar,
/readyz needs etcd too, and says so when it is gone.
"""

from __future__ import annotations

import base64
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from router_sidecar.coordination.store import keys
from router_sidecar.runtime.envoy_config import find_envoy
from router_sidecar.runtime.supervise import Child, free_port, port_open, start_envoy, start_etcd, wait_until
from tests.harness import CREDENTIAL, PYTHON, Sim, chat, poll, post

pytestmark = pytest.mark.integration


@pytest.fixture
def own_etcd(tmp_path: Path) -> Iterator[tuple[Child, str]]:
    # Its own etcd: the test stops it.
    child, endpoint = start_etcd(tmp_path / "etcd", log_path=tmp_path / "etcd.log")
    try:
        yield child, endpoint
    finally:
        child.stop()


def _run(*args: str) -> str:
    result = subprocess.run(
        [PYTHON, "-m", "router_sidecar", *args], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_serve_plus_rendered_envoy_serves_and_probes(own_etcd: tuple[Child, str], tmp_path: Path) -> None:
    etcd_child, etcd = own_etcd
    sim = Sim("a", tmp_path)
    port = free_port()
    socket_path, admin_path = tmp_path / "sidecar.sock", tmp_path / "admin.sock"
    config = tmp_path / "envoy.yaml"
    _run(
        "envoy-config",
        "--listen",
        f"127.0.0.1:{port}",
        "--sidecar-socket",
        str(socket_path),
        "--admin-socket",
        str(admin_path),
        "--access-log",
        str(tmp_path / "access.log"),
        "--replica",
        sim.endpoint,
        "--output",
        str(config),
    )
    serve = ["serve", "--listen", f"unix:{socket_path}", "--etcd", etcd, "--replica", sim.endpoint]
    sidecar = Child("sidecar", [PYTHON, "-m", "router_sidecar", *serve], log_path=tmp_path / "sidecar.out")
    envoy: Child | None = None
    try:
        out = tmp_path / "sidecar.out"
        wait_until(lambda: "ready" in out.read_text(), timeout=30, what="sidecar ready", child=sidecar)
        assert f"replicas from {sim.endpoint}" in out.read_text()
        envoy = start_envoy(find_envoy(), config, name="envoy", log_path=tmp_path / "envoy.log")
        wait_until(lambda: port_open("127.0.0.1", port), timeout=30, what="envoy listening", child=envoy)
        url = f"http://127.0.0.1:{port}"

        live = httpx.get(f"{url}/livez", timeout=5)
        ready = httpx.get(f"{url}/readyz", timeout=5)
        assert (live.status_code, ready.status_code) == (200, 200), (live.text, ready.text)
        assert ready.json()["status"] == "ok"
        assert not [r for r in sim.records() if r.get("request_id")], "a probe reached the replica"

        result = post(f"{url}/v1/chat/completions", chat(max_tokens=6))
        assert result.status == 200 and result.data()[-1] == "[DONE]", result.body
        assert len(result.content_chunks()) == 6
        poll(lambda: sim.requests_for(result.request_id), timeout=10, what="the replica's log of the request")
        # The default policy keeps a clean completion's summary, not its trace (journal sizing).
        record = poll(
            lambda: (
                (
                    j := httpx.get(
                        f"{url}/v1/requests/{result.request_id}", headers=CREDENTIAL, timeout=5
                    ).json()
                )
                and j.get("phase") == "completed"
                and j
            ),
            what="the completed record",
        )
        assert record["events"] == [] and record["trace"].startswith("omitted: clean completion")
        assert record["delivered_output_tokens"] == 6 and record["attempts"][0]["outcome"] == "completed"

        # The end was written in one transaction with the removal of the request's in-flight index entry.
        assert _count(etcd, keys.IN_FLIGHT_PREFIX) == 0
        assert _count(etcd, keys.OWNERS_PREFIX) == 1  # the sidecar's owner lease

        etcd_child.stop()
        # Readiness is checked at most once a second (probes come on the client listener too).
        not_ready = poll(
            lambda: (r := httpx.get(f"{url}/readyz", timeout=5)).status_code == 503 and r,
            timeout=5,
            what="/readyz to say etcd is gone",
        )
        assert not_ready.json()["error"]["code"] == "etcd_unreachable"
        assert httpx.get(f"{url}/livez", timeout=5).status_code == 200  # no restart for an etcd outage

        sidecar.stop()
        # Without the sidecar nothing is admitted: the liveness probe fails (Envoy's ext_proc fails closed).
        assert httpx.get(f"{url}/livez", timeout=5).status_code >= 500
    finally:
        if envoy is not None:
            envoy.stop()
        sidecar.stop()
        sim.stop()


def _count(etcd: str, prefix: str) -> int:
    end = prefix[:-1] + chr(ord(prefix[-1]) + 1)
    body = {"key": _b64(prefix), "range_end": _b64(end), "count_only": True}
    return int(httpx.post(f"http://{etcd}/v3/kv/range", json=body, timeout=5).json().get("count", 0))


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def test_envoy_config_without_replicas_takes_them_from_the_sidecar() -> None:
    text = _run(
        "envoy-config",
        "--listen",
        "0.0.0.0:8080",
        "--sidecar-socket",
        "/run/router-sidecar/sidecar.sock",
        "--admin-socket",
        "/run/router-sidecar/admin.sock",
    )
    assert "type: EDS" in text and "/run/router-sidecar/sidecar.sock" in text
    assert "path: /dev/stdout" in text


def test_envoy_config_rejects_a_bad_policy(tmp_path: Path) -> None:
    policy = tmp_path / "p.yaml"
    policy.write_text("budgets: {retry_budget_percent: 500}\n")
    render = ["envoy-config", "--policy", str(policy), "--listen", "0.0.0.0:8080"]
    render += ["--sidecar-socket", "/s", "--admin-socket", "/a"]
    result = subprocess.run(
        [sys.executable, "-m", "router_sidecar", *render],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 2 and "retry_budget_percent" in result.stderr, result.stderr
