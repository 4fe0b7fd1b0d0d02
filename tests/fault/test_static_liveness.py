"""Static replicas (`--replica`, no agent) have a liveness signal too: the sidecar probes their /health.

A replica that stops answering its health check while its attempt is silent is lost, not slow: before the
first delta its attempt is fenced (its closed connection is the proof: nothing else there honours a lease)
and retried; after it the client gets the terminal frame within a bounded time. A replica that is merely
slow, and answers its health check, is never failed over.
"""

from __future__ import annotations

import json
import signal
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.harness import ClientResult, Gateway, Sim, chat, poll, post, split_events, with_credential

pytestmark = pytest.mark.fault

# Two failed probes in a row (static_probe_failures 2), each up to static_probe_timeout_seconds 3, one
# static_probe_interval_seconds 1 apart, plus scheduling on a busy machine.
DETECTION_BOUND_SECONDS = 12.0


@pytest.fixture(params=["by-address", "by-dns-name"])
def pool(
    etcd: str, tmp_path: Path, request: pytest.FixtureRequest
) -> Iterator[tuple[Gateway, dict[str, Sim]]]:
    sims = {name: Sim(name, tmp_path, token_interval=0.02) for name in ("a", "b")}
    # Given by name, Envoy still names each attempt's replica by the address it connected to.
    named = request.param == "by-dns-name"
    replicas = [s.endpoint.replace("127.0.0.1", "localhost") if named else s.endpoint for s in sims.values()]
    gateway = Gateway(replicas=replicas, etcd=etcd, work=tmp_path)
    try:
        yield gateway, sims
    finally:
        for sim in sims.values():
            if sim.child is not None:
                sim.child.signal(signal.SIGCONT)
        gateway.stop()
        for sim in sims.values():
            sim.stop()


def serving(sims: dict[str, Sim], request_id: str) -> Sim:
    return poll(
        lambda: next(
            (s for s in sims.values() if any(r.get("request_id") == request_id for r in s.records())), None
        ),
        what=f"a replica serving {request_id}",
    )


class Reader:
    """A streaming client in a thread that says when it has read N content events."""

    def __init__(self, gateway: Gateway, key: str, fault: str, *, after: int = 0) -> None:
        self.raw = b""
        self.status = 0
        self.reached = threading.Event()
        self._after = after
        self._gateway, self._key = gateway, key
        self._thread = threading.Thread(target=self._read, args=(gateway, key, fault))
        self._thread.start()

    def _read(self, gateway: Gateway, key: str, fault: str) -> None:
        headers = with_credential({"idempotency-key": key, "x-sim-fault": fault})
        with (
            httpx.Client(timeout=40) as client,
            client.stream(
                "POST", f"{gateway.url}/v1/chat/completions", json=chat(max_tokens=30), headers=headers
            ) as response,
        ):
            self.status = response.status_code
            for chunk in response.iter_raw():
                self.raw += chunk
                if len(self.result().content_chunks()) >= self._after:
                    self.reached.set()
        self.reached.set()

    def result(self) -> ClientResult:
        return ClientResult(self.status, {}, self.raw, events=split_events(self.raw))

    def join(self, timeout: float) -> ClientResult:
        self._thread.join(timeout)
        if self._thread.is_alive():
            # What the gateway knew meanwhile: its journal record and its log (a hang must say where).
            status, record = self._gateway.journal(self._key)
            log = self._gateway.out_path.read_text(errors="replace")[-3000:]
            raise AssertionError(
                f"the client got no end of its stream after {timeout:g}s; got {self.raw[-300:]!r}\n"
                f"journal ({status}): {json.dumps(record)[:3000]}\ngateway log:\n{log}"
            )
        return self.result()


def test_frozen_static_replica_after_the_first_delta_ends_with_the_terminal_frame(
    pool: tuple[Gateway, dict[str, Sim]],
) -> None:
    gateway, sims = pool
    key = f"static-frozen-decode-{uuid.uuid4().hex[:8]}"  # the journal outlives the parametrization
    reader = Reader(gateway, key, "delay@after:2 for=30", after=2)
    assert reader.reached.wait(20)
    sim = serving(sims, key)
    assert sim.child is not None
    frozen_at = time.monotonic()
    sim.child.signal(signal.SIGSTOP)
    result = reader.join(DETECTION_BOUND_SECONDS + 20)
    ended_after = time.monotonic() - frozen_at
    frames = [d for d in result.data() if isinstance(d, dict) and "error" in d]
    assert result.status == 200 and len(frames) == 1 and result.data()[-1] == "[DONE]", result.body[-400:]
    assert frames[0]["error"]["code"] == "upstream_decode_interrupted"
    assert frames[0]["error"]["delivered_output_tokens"] == len(result.content_chunks()) == 2
    assert ended_after < DETECTION_BOUND_SECONDS, (
        f"the terminal frame came {ended_after:.1f}s after the freeze"
    )
    journal = gateway.wait_journal(key, lambda j: j["phase"] == "interrupted")
    assert journal["attempt"] == 1 and journal["delivered_output_tokens"] == 2
    assert any(e["event"] == "replica_lost" for e in journal["events"]), journal["events"]


def test_frozen_static_replica_before_the_first_delta_is_fenced_and_retried(
    pool: tuple[Gateway, dict[str, Sim]],
) -> None:
    gateway, sims = pool
    # Headers and the role event go out, then the replica freezes before any content.
    key = f"static-frozen-prefill-{uuid.uuid4().hex[:8]}"
    reader = Reader(gateway, key, "delay@role for=30 attempt=1")
    sim = serving(sims, key)
    assert sim.child is not None
    frozen_at = time.monotonic()
    sim.child.signal(signal.SIGSTOP)
    result = reader.join(DETECTION_BOUND_SECONDS + 20)
    assert result.status == 200 and result.data()[-1] == "[DONE]" and len(result.content_chunks()) == 30
    assert not [d for d in result.data() if isinstance(d, dict) and "error" in d]
    assert len({d["id"] for d in result.content_chunks()}) == 1
    assert time.monotonic() - frozen_at < DETECTION_BOUND_SECONDS + 5
    journal = gateway.wait_journal(key, lambda j: j["phase"] == "completed")
    first, second = journal["attempts"]
    assert (first["outcome"], first["detail"]) == ("failed", "replica_lost")
    assert first["fence"]["proof"] == "connection_closed"
    assert second["replica"] != first["replica"]
    other = next(s for s in sims.values() if s is not sim)
    assert [r["request_id"] for r in other.records() if r.get("event") == "end"].count(key) == 1


def test_a_slow_static_replica_that_answers_its_health_check_is_not_failed_over(
    pool: tuple[Gateway, dict[str, Sim]],
) -> None:
    gateway, _ = pool
    result = post(
        f"{gateway.url}/v1/chat/completions",
        chat(max_tokens=4),
        headers={"x-sim-fault": "delay@role for=3.5"},  # longer than probe interval × failures
    )
    assert result.status == 200 and result.data()[-1] == "[DONE]" and len(result.content_chunks()) == 4
    journal = gateway.wait_journal(result.request_id, lambda j: j["phase"] == "completed")
    assert journal["attempt"] == 1, json.dumps(journal["attempts"])
