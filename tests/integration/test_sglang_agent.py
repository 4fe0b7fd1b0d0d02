"""`router-sidecar replica` in front of SGLang: a fake SGLang HTTP server on 127.0.0.1, real etcd.

A real SGLang takes 20-60 s to start on this machine, too slow for this tier (tests/real_engine/sglang/ runs
the real one). The fake answers what the agent reads, with the bodies of a real SGLang 0.5.23, and behaves
like it where the agent depends on it: `/health` answers only after a second (SGLang waits that long for a
one-token generation), and while draining after SIGTERM `/health` is 503 while everything else still answers.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from router_sidecar.core.fingerprint import from_sglang
from tests.integration.test_replica_agent import INTERVAL, SLACK, Agent, lease_remaining, replicas, wait_for
from tests.unit.test_fingerprint import SGLANG_MODEL_INFO, SGLANG_MODELS, SGLANG_SERVER_INFO

pytestmark = pytest.mark.integration

HEALTH_SECONDS = 1.0  # SGLang 0.5.23's /health: it polls for the health generation's output once a second


class FakeSglang:
    """The endpoints the agent reads, as SGLang 0.5.23 answers them; `draining` flips /health to 503."""

    def __init__(self) -> None:
        self.draining = False
        self.health_seconds = HEALTH_SECONDS
        self.hits: dict[str, int] = {}
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                fake.hits[self.path] = fake.hits.get(self.path, 0) + 1
                if self.path == "/health":
                    if fake.draining:
                        self._send(503, b"")  # SGLang checks the drain flag first: no wait
                        return
                    time.sleep(fake.health_seconds)
                    self._send(200, b"")
                elif self.path == "/v1/models":
                    self._send(200, SGLANG_MODELS.encode())
                elif self.path == "/get_model_info":
                    self._send(200, SGLANG_MODEL_INFO.encode())
                elif self.path == "/get_server_info":
                    self._send(200, json.dumps(SGLANG_SERVER_INFO).encode())
                else:  # /version among them: SGLang has none
                    self._send(404, b'{"detail":"Not Found"}')

            def _send(self, status: int, body: bytes) -> None:
                try:
                    self.send_response(status)
                    self.send_header("content-length", str(len(body)))
                    if body:
                        self.send_header("content-type", "application/json")
                    self.end_headers()
                    self.wfile.write(body)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the agent gave up waiting (the frozen case): what it should do

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.endpoint = f"127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05})
        self.thread.start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(5)


@pytest.fixture
def sglang() -> Iterator[FakeSglang]:
    fake = FakeSglang()
    try:
        yield fake
    finally:
        fake.stop()


@pytest.fixture
def agent(etcd: str, sglang: FakeSglang, tmp_path: Path) -> Iterator[Agent]:
    started = Agent(engine=sglang.endpoint, etcd=etcd, work=tmp_path)
    try:
        yield started
    finally:
        started.stop()


def test_sglang_is_registered_with_what_it_reports(etcd: str, sglang: FakeSglang, agent: Agent) -> None:
    ready = agent.wait_ready()
    expected, info = from_sglang(
        json.loads(SGLANG_MODELS), json.loads(SGLANG_MODEL_INFO), SGLANG_SERVER_INFO, model_id=None
    )
    assert f"digest {expected.digest()}" in ready
    registered = replicas(etcd)[sglang.endpoint]
    assert registered.fingerprint == expected
    assert (registered.engine_name, registered.engine_version) == ("sglang", "0.5.23")
    assert (
        registered.fingerprint.attention_backend == "torch_native" and registered.fingerprint.block_size == 1
    )
    assert registered.engine.root == "/tmp/sgl/tiny" == info.root
    assert sglang.hits.get("/version") is None, "SGLang has no /version: it must not be needed"
    assert "(sglang 0.5.23) healthy" in agent.stderr()


def test_a_health_check_that_takes_a_second_keeps_it_registered(
    etcd: str, sglang: FakeSglang, agent: Agent
) -> None:
    """The probe timeout is min(interval, 2 s) = 0.5 s here; SGLang's /health needs ≥ 1 s by design."""
    agent.wait_ready()
    lease = replicas(etcd)[sglang.endpoint].lease_id
    probes_before = sglang.hits["/health"]
    wait_for(lambda: sglang.hits["/health"] >= probes_before + 3, timeout=15, what="three more health probes")
    assert replicas(etcd)[sglang.endpoint].lease_id == lease, "withdrawn and registered again in between"
    assert "unhealthy" not in agent.stderr()


def test_draining_503_is_marked_draining_then_withdrawn_when_it_stops_answering(
    etcd: str, sglang: FakeSglang, agent: Agent
) -> None:
    """SIGTERM: SGLang drains, /health 503 while its port still serves. The registration stays, marked
    draining (gateways send nothing new there; the attempts in flight are not lost and finish); when the
    engine stops answering it is withdrawn, lease revoked."""
    agent.wait_ready()
    lease = replicas(etcd)[sglang.endpoint].lease_id
    sglang.draining = True
    marked = wait_for(
        lambda: (r := replicas(etcd).get(sglang.endpoint)) is not None and r.draining,
        timeout=10,
        what="the registration marked draining",
    )
    print(f"\nSGLang draining (/health 503) → marked draining after {marked:.2f}s (interval {INTERVAL}s)")
    assert marked <= HEALTH_SECONDS + INTERVAL + SLACK  # one probe under way (≤ 1 s), then one interval
    assert replicas(etcd)[sglang.endpoint].lease_id == lease, "the same registration, not a new one"
    assert "draining (GET /health: HTTP 503 while the server still answers" in agent.stderr()
    assert agent.proc.poll() is None

    sglang.draining, sglang.health_seconds = False, 30.0  # the drain is over: the engine no longer answers
    withdrawn = wait_for(lambda: sglang.endpoint not in replicas(etcd), timeout=15, what="withdrawal")
    print(f"engine gone → withdrawn after {withdrawn:.2f}s")
    # The key is deleted first, then the lease revoked: the second write may still be on its way.
    wait_for(
        lambda: lease_remaining(etcd, lease) == -1, timeout=2, what="the lease revoked, not left to expire"
    )

    sglang.health_seconds = HEALTH_SECONDS  # e.g. restarted on the same port
    back = wait_for(lambda: sglang.endpoint in replicas(etcd), timeout=15, what="re-registration")
    print(f"healthy again → registered after {back:.2f}s")
    registered = replicas(etcd)[sglang.endpoint]
    assert registered.lease_id != lease and not registered.draining


def test_a_frozen_sglang_is_withdrawn(etcd: str, sglang: FakeSglang, agent: Agent) -> None:
    """A scheduler that never produces the health token: SGLang itself would answer 503 only after 20 s;
    the agent's probe gives up after its timeout plus SGLang's allowance."""
    agent.wait_ready()
    sglang.health_seconds = 30.0
    withdrawn = wait_for(lambda: sglang.endpoint not in replicas(etcd), timeout=15, what="withdrawal")
    print(f"\nSGLang /health unanswered → withdrawn after {withdrawn:.2f}s")
    # A probe in flight, then two that time out (timeout + allowance each): the first is kept (a busy
    # engine is slow, not down), the second withdraws it.
    assert withdrawn <= HEALTH_SECONDS + 2 * (INTERVAL + 0.5 + 2.0) + SLACK
    assert "GET /health: no answer within 2.5s" in agent.stderr()
