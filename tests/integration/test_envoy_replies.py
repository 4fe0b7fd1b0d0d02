"""Answers Envoy makes itself (an upstream it cannot reach) are JSON in the gateway's error shape and name
the request in the `x-request-id` header as well as the body, like every answer of the gateway."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from router_sidecar.runtime.supervise import free_port
from tests.harness import Gateway, Sim

pytestmark = pytest.mark.integration


def test_envoys_own_reply_names_the_request_in_header_and_body(etcd: str, tmp_path: Path) -> None:
    sim = Sim("a", tmp_path)
    gateway = Gateway(
        replicas=[sim.endpoint], etcd=etcd, work=tmp_path, tools=(f"down=127.0.0.1:{free_port()}",)
    )
    try:
        answer = httpx.get(f"{gateway.url}/tools/down/status", timeout=10)  # passes through to a dead tool
    finally:
        gateway.stop()
        sim.stop()
    assert answer.status_code == 503 and answer.headers["content-type"] == "application/json"
    error = answer.json()["error"]
    assert error["code"] == "upstream_error" and "UF" in error["response_flags"]
    assert error["request_id"] and answer.headers["x-request-id"] == error["request_id"]
