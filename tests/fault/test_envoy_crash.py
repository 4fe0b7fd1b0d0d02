"""Envoy dies under the gateway (as Envoy 1.40 does when a replica's burst overruns what an upstream filter
holds): its log is kept and named, the streams it carried are journaled as lost with Envoy (never as client
disconnects), and the gateway restarts it and keeps serving."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.harness import ClientResult, Gateway, Sim, chat, poll, post

pytestmark = pytest.mark.fault


@pytest.fixture
def stack(etcd: str, tmp_path: Path) -> Iterator[tuple[Gateway, Sim]]:
    sim = Sim("a", tmp_path, token_interval=0.05)
    gateway = Gateway(replicas=[sim.endpoint], etcd=etcd, work=tmp_path)
    try:
        yield gateway, sim
    finally:
        gateway.stop()
        sim.stop()


def test_a_crashed_envoy_is_restarted_and_its_log_kept(stack: tuple[Gateway, Sim]) -> None:
    gateway, sim = stack
    first_envoy = gateway.envoy_pid()
    streaming: dict[str, ClientResult] = {}
    reader = threading.Thread(
        target=lambda: streaming.setdefault(
            "r",
            post(
                f"{gateway.url}/v1/chat/completions", chat(max_tokens=200), headers={"idempotency-key": "mid"}
            ),
        )
    )
    reader.start()
    poll(
        lambda: any(r.get("request_id") == "mid" for r in sim.records()),
        what="the stream reached the replica",
    )
    os.kill(first_envoy, signal.SIGSEGV)
    reader.join(20)
    # The client's stream died with Envoy: a reset, not an answer.
    assert streaming["r"].transport_error is not None or streaming["r"].data()[-1:] != ["[DONE]"]
    work = gateway.work / "gw"
    kept = poll(
        lambda: sorted(work.glob("envoy.crash-*.log")), timeout=15, what="the crashed envoy's log kept"
    )
    assert "Segmentation fault" in kept[0].read_text() or kept[0].stat().st_size > 0
    stderr = poll(
        lambda: "restarted envoy" in (text := gateway.out_path.read_text()) and text,
        timeout=20,
        what="a restart",
    )
    assert f"its log is kept in {kept[0]}" in stderr
    assert gateway.envoy_pid() != first_envoy
    # Still serving, through the new Envoy.
    result = poll(
        lambda: (r := post(f"{gateway.url}/v1/chat/completions", chat(max_tokens=3))).status == 200 and r,
        timeout=20,
        what="a normal request through the restarted envoy",
    )
    assert result.data()[-1] == "[DONE]"
    journal = gateway.wait_journal("mid", lambda j: j["phase"] in ("interrupted", "failed"))
    assert journal["outcome"] == "envoy_exited", journal
    assert gateway.proc.poll() is None
