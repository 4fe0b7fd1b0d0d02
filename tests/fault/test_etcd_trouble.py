"""etcd unreachable while serving: the gateway keeps serving, but starts no retry it cannot prove safe."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from router_sidecar.runtime.supervise import Child, free_port, start_etcd
from tests.harness import CREDENTIAL, Gateway, Sim, chat, poll, post

pytestmark = pytest.mark.fault


class OwnEtcd:
    """An etcd this module may stop and start again (same port, same data)."""

    def __init__(self, work: Path) -> None:
        self.work = work
        self.port = free_port()
        self.child: Child | None = None
        self.endpoint = f"127.0.0.1:{self.port}"
        self.start()

    def start(self) -> None:
        self.child, _ = start_etcd(self.work / "data", client_port=self.port, log_path=self.work / "etcd.log")

    def stop(self) -> None:
        if self.child is not None:
            self.child.stop()


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Gateway, dict[str, Sim], OwnEtcd]]:
    work: Path = tmp_path_factory.mktemp("etcd-trouble")
    etcd = OwnEtcd(work)
    sims = {n: Sim(n, work) for n in ("a", "b")}
    gateway = None
    try:
        gateway = Gateway(replicas=[s.endpoint for s in sims.values()], etcd=etcd.endpoint, work=work)
        yield gateway, sims, etcd
    finally:
        if gateway is not None:
            gateway.stop()
        for sim in sims.values():
            sim.stop()
        etcd.stop()


def test_etcd_down_serving_continues_without_unprovable_retries(
    setup: tuple[Gateway, dict[str, Sim], OwnEtcd],
) -> None:
    gateway, sims, etcd = setup
    before = post(f"{gateway.url}/v1/chat/completions", chat(max_tokens=3))
    assert before.status == 200 and before.data()[-1] == "[DONE]"
    gateway.wait_journal(before.request_id, lambda j: j["phase"] == "completed")

    etcd.stop()
    try:
        # Still serving: a healthy request streams completely.
        served = post(f"{gateway.url}/v1/chat/completions", chat(max_tokens=3))
        assert served.status == 200 and len(served.content_chunks()) == 3 and served.data()[-1] == "[DONE]"
        # The journal cannot be read: a clear error, not a wrong answer.
        lookup = httpx.get(f"{gateway.url}/v1/requests/{served.request_id}", headers=CREDENTIAL, timeout=10)
        assert lookup.status_code == 503 and lookup.json()["error"]["code"] == "journal_unavailable"
        # A failure before the first delta is NOT retried: nothing could prove the retry safe.
        failed = post(
            f"{gateway.url}/v1/chat/completions",
            chat(max_tokens=3),
            headers={"x-sim-fault": "status503@headers attempt=1", "idempotency-key": "no-etcd"},
        )
        assert failed.status == 502
        error = json.loads(failed.body)["error"]
        assert error["code"] == "retry_not_allowed" and "etcd" in error["message"]
        assert len([r for s in sims.values() for r in s.requests_for("no-etcd")]) == 1
    finally:
        etcd.start()

    # etcd is back: the journal works again for new requests.
    def journaled() -> bool:
        result = post(f"{gateway.url}/v1/chat/completions", chat(max_tokens=2))
        status, record = gateway.journal(result.request_id)
        return status == 200 and record["attempt"] == 1

    poll(journaled, timeout=30, what="the journal to work again after etcd came back")
