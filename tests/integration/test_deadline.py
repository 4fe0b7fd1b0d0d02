"""The gateway's own deadline (deadlines.request_seconds) is the gateway's doing, and says so.

Before the first delta the client gets `504 deadline_exceeded` (JSON, naming the request); after it, the
delivered prefix and one terminal frame whose message names the deadline. The journal says
`deadline_exceeded` either way, never an upstream reset, and the replica sees the request cancelled.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.harness import Gateway, Sim, chat, poll, post

pytestmark = pytest.mark.integration

DEADLINE_SECONDS = 6
POLICY = f"""
deadlines:
  request_seconds: {DEADLINE_SECONDS}
leases:
  attempt_ttl_seconds: 3
"""


@pytest.fixture(scope="module")
def stack(etcd: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Gateway, Sim]]:
    work: Path = tmp_path_factory.mktemp("deadline")
    (work / "policy.yaml").write_text(POLICY)
    sim = Sim("a", work)
    gateway = Gateway(replicas=[sim.endpoint], etcd=etcd, work=work, config=work / "policy.yaml")
    try:
        yield gateway, sim
    finally:
        gateway.stop()
        sim.stop()


def replica_record(sim: Sim, request_id: str) -> dict[str, object]:
    return poll(lambda: next(iter(sim.requests_for(request_id)), None), what="the replica's record")


def test_deadline_after_the_first_delta_ends_with_a_terminal_frame_naming_it(
    stack: tuple[Gateway, Sim],
) -> None:
    gateway, sim = stack
    started = time.monotonic()
    result = post(
        f"{gateway.url}/v1/chat/completions",
        chat(max_tokens=20),
        headers={"x-sim-fault": "delay@after:2 for=30"},
        timeout=30,
    )
    took = time.monotonic() - started
    assert result.status == 200 and result.transport_error is None
    frames = [d["error"] for d in result.data() if isinstance(d, dict) and "error" in d]
    assert len(frames) == 1 and result.data()[-1] == "[DONE]"
    assert frames[0]["code"] == "upstream_decode_interrupted"
    assert "deadlines.request_seconds" in frames[0]["message"]
    assert frames[0]["delivered_output_tokens"] == len(result.content_chunks()) == 2
    assert took < DEADLINE_SECONDS + 5
    journal = gateway.wait_journal(result.request_id, lambda j: j["phase"] == "interrupted")
    assert journal["outcome"] == "deadline_exceeded" and journal["delivered_output_tokens"] == 2
    assert not any(e.get("cause") == "upstream_reset" for e in journal["events"])
    assert replica_record(sim, result.request_id)["client_gone_at"] is not None  # the replica was cancelled


def test_deadline_before_the_first_delta_is_a_504_naming_the_request(stack: tuple[Gateway, Sim]) -> None:
    gateway, sim = stack
    result = post(
        f"{gateway.url}/v1/chat/completions",
        chat(max_tokens=5),
        headers={"x-sim-fault": "delay@role for=30"},
        timeout=30,
    )
    assert result.status == 504 and result.headers["content-type"] == "application/json", result.body
    error = json.loads(result.body)["error"]
    assert (error["code"], error["request_id"]) == ("deadline_exceeded", result.request_id)
    assert "deadlines.request_seconds" in error["message"]
    journal = gateway.wait_journal(result.request_id, lambda j: j["phase"] == "failed")
    assert journal["outcome"] == "deadline_exceeded" and journal["attempt"] == 1
    assert replica_record(sim, result.request_id)["client_gone_at"] is not None
