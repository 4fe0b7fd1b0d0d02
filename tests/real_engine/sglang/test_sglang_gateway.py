"""Two real SGLang replicas behind the gateway: pass-through, and the first-delta contract under its faults.

The faults are the ones measured on SGLang 0.5.23 (shared/reference/sglang-0.5.23-cpu/README.md): the
scheduler SIGKILLed (the server says nothing for ~5 s, then kills its process tree: the connection closes
without the last chunk), the server process SIGKILLed (the stream is cut at once), SIGTERM (a drain: /health
503 at once while new requests are still accepted and served, exit once nothing is in flight).

Tests run in file order, so that one replica restart (20-60 s) is enough: the non-destructive tests, the drain
(its replica exits; restarted in the background), the scheduler kill (needs both replicas; kills its own), and
last the server kill on the replica that is left.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from router_sidecar.coordination.registry_store import Replica, ReplicaRegistry
from router_sidecar.coordination.store import EtcdStore
from router_sidecar.runtime.supervise import Child, start_etcd
from router_testbed.real_engine import SglangReplica
from tests.harness import Gateway, poll
from tests.real_engine.tier import (
    AUTH,
    CONTINUOUS_USAGE,
    MESSAGES,
    AtFirstDelta,
    assert_complete_chat_with_usage,
    assert_complete_completion_with_usage,
    assert_completed_with_usage_count,
    assert_one_attempt_content,
    assert_prefix_then_reset_or_one_frame,
    assert_retried_on,
    content_chunks,
    direct_payloads,
    event_kinds,
    in_background,
    reference_chat_body,
    replica_of,
    serving_attempt,
    stopped,
    stream_chat,
    stream_completion,
    stream_until_routed_to,
    terminal_journal,
)

# A long answer: SGLang counts the prompt (25 tokens here) into the 1024-token context, unlike vLLM's 1000.
LONG = 960


# --------------------------------------------------------------------------- pass-through


def test_chat_stream_with_usage_is_one_complete_answer(
    sglang_gateway: Gateway, sglang_replicas: dict[str, SglangReplica]
) -> None:
    max_tokens = 24
    result = stream_chat(sglang_gateway.url, max_tokens=max_tokens, stream_options=CONTINUOUS_USAGE)
    assert_complete_chat_with_usage(result, max_tokens)
    # The events the client got have the structure SGLang itself sends (its role event with
    # reasoning_content, matched_stop, usage on content events but not on the finish event).
    body = reference_chat_body(max_tokens)
    reference = direct_payloads(sglang_replicas["a"].url, "/v1/chat/completions", body)
    assert event_kinds(result.payloads()) == event_kinds(reference)
    assert_completed_with_usage_count(sglang_gateway, result.request_id, max_tokens)


def test_completions_stream_with_usage_is_one_complete_answer(sglang_gateway: Gateway) -> None:
    max_tokens = 16
    result = stream_completion(sglang_gateway.url, max_tokens=max_tokens)
    assert_complete_completion_with_usage(result, max_tokens)
    # SGLang's completions stream has no role event: every event but the usage one has a text choice (the
    # first may be empty while the detokenizer holds back a partial UTF-8 sequence).
    assert all(c.choices and c.choices[0].text is not None for c in result.chunks[:-1])
    journal = terminal_journal(sglang_gateway, result.request_id)
    assert journal["phase"] == "completed" and journal["delivered_output_tokens"] == max_tokens
    assert journal["delivered_output_tokens_source"] == "usage"


def test_static_sglang_replicas_pass_the_default_health_checks(
    sglang_gateway: Gateway, sglang_replicas: dict[str, SglangReplica]
) -> None:
    """SGLang's /health answers after >= 1 s (it polls for a one-token generation once a second). With a probe
    timeout equal to the probe interval (1 s, before liveness.static_probe_timeout_seconds) every check of a
    healthy SGLang failed: on an idle machine every request was 503 no_replica_available (Envoy flags UH), on
    a busy one they flapped (502s seen). The default timeout (3 s) must let every check pass."""
    sglang_gateway.wait_replicas_healthy([r.endpoint for r in sglang_replicas.values()], timeout=15)

    def counters() -> dict[str, int]:
        stats = sglang_gateway.envoy_admin("/stats?filter=cluster.llm.health_check").decode()
        pairs = (line.split(": ", 1) for line in stats.splitlines() if ": " in line)
        return {name.removeprefix("cluster.llm.health_check."): int(value) for name, value in pairs}

    # Three rounds of checks of both replicas (one a second), or the first failure.
    poll(
        lambda: counters()["success"] >= 6 or counters()["failure"], timeout=20, what="3 health-check rounds"
    )
    seen = counters()
    print(f"\nreal_engine: static SGLang, default policy: health checks {seen}")
    assert seen["failure"] == 0 and seen["success"] >= 6, seen


# --------------------------------------------------------------------------- client gone


def test_client_disconnect_aborts_the_request_in_sglang_and_starts_no_other(
    sglang_gateway: Gateway, sglang_replicas: dict[str, SglangReplica]
) -> None:
    result = stream_chat(
        sglang_gateway.url, max_tokens=LONG, on_chunk=lambda chunk, so_far: content_chunks(so_far) >= 3
    )
    assert result.error is None and result.request_id
    journal = terminal_journal(sglang_gateway, result.request_id)
    assert journal["phase"] == "cancelled", journal
    serving_attempt(journal)
    served = replica_of(sglang_gateway, result.request_id, sglang_replicas)
    assert served is not None
    rids = served.rids_of(result.request_id)
    assert rids, f"SGLang {served.name} logged no request with x-request-id {result.request_id}"
    # SGLang aborts a streamed request whose client (Envoy) went away; its scheduler logs it (debug level).
    poll(
        lambda: rids[-1] in served.aborted_request_ids(),
        timeout=45,
        what=f"SGLang {served.name} to log request {rids[-1]} aborted",
    )
    # No other attempt: the other replica never saw this request, and this one once per attempt.
    others = [r for r in sglang_replicas.values() if r is not served]
    assert all(not r.rids_of(result.request_id) for r in others)
    assert len(rids) <= len(journal["attempts"])
    assert replica_of(sglang_gateway, result.request_id, sglang_replicas) is served


# --------------------------------------------------------------------------- drain, with agents


class ReplicaAgent:
    """`router-sidecar replica` for one SGLang replica, as an operator runs it beside the engine."""

    def __init__(self, replica: SglangReplica, etcd: str, work: Path) -> None:
        self.out = work / f"agent-{replica.name}.out"
        argv = [sys.executable, "-m", "router_sidecar", "replica", "--engine", replica.endpoint]
        argv += ["--advertise", replica.endpoint, "--etcd", etcd, "--ttl", "3", "--interval", "0.5"]
        self.child = Child(f"agent-{replica.name}", argv, log_path=self.out)

    def wait_ready(self, timeout: float = 30.0) -> None:
        poll(lambda: "ready" in self.out.read_text() or not self.child.alive(), timeout=timeout, what="agent")
        assert "ready" in self.out.read_text(), self.out.read_text()

    def stop(self) -> None:
        self.child.stop()


def registered(etcd: str) -> dict[str, Replica]:
    async def read() -> dict[str, Replica]:
        store = EtcdStore(etcd)
        try:
            return dict(await ReplicaRegistry(store).list_replicas())
        finally:
            await store.close()

    return asyncio.run(read())


@contextlib.contextmanager
def discovery_cluster(
    replicas: dict[str, SglangReplica], work: Path
) -> Iterator[tuple[Gateway, str, dict[str, ReplicaAgent]]]:
    """Its own etcd, an agent per replica, and a gateway that discovers the replicas from the registry."""
    etcd_child, etcd = start_etcd(work / "etcd", log_path=work / "etcd.log")
    agents: dict[str, ReplicaAgent] = {}
    gateway = None
    try:
        for name, replica in replicas.items():
            agents[name] = ReplicaAgent(replica, etcd, work)
        for agent in agents.values():
            agent.wait_ready()
        gateway = Gateway(replicas=[], etcd=etcd, work=work)
        yield gateway, etcd, agents
    finally:
        if gateway is not None:
            gateway.stop()
        for agent in agents.values():
            agent.stop()
        etcd_child.stop()


def short_chat(base_url: str, request_id: str) -> httpx.Response:
    return httpx.post(
        f"{base_url}/v1/chat/completions",
        json={"model": "tiny", "messages": MESSAGES, "max_tokens": 4, "ignore_eos": True},
        headers={**AUTH, "Idempotency-Key": request_id},
        timeout=60,
    )


def test_sigterm_drain_withdraws_the_replica_and_no_new_attempt_lands_on_it(
    both_healthy: dict[str, SglangReplica], tmp_path: Path
) -> None:
    replicas = both_healthy
    with discovery_cluster(replicas, tmp_path) as (gateway, etcd, agents):

        def reached_both() -> bool:
            ids = [f"warm-{uuid.uuid4().hex[:12]}" for _ in range(4)]
            for request_id in ids:
                short_chat(gateway.url, request_id)
            return all(any(r.rids_of(i) for i in ids) for r in replicas.values())

        poll(reached_both, timeout=30, what="discovered endpoints reaching both replicas")

        term_after_first_delta = AtFirstDelta(gateway, replicas, SglangReplica.terminate_server)
        termed, termed_at = term_after_first_delta.acted, term_after_first_delta.acted_at

        thread, box = in_background(
            lambda: stream_chat(
                gateway.url, max_tokens=LONG, on_chunk=term_after_first_delta, stream_options=CONTINUOUS_USAGE
            )
        )
        poll(lambda: termed or not thread.is_alive(), timeout=30, what="the stream's first content delta")
        if not termed:
            thread.join(5)
            failed = box.get("r")
            raise AssertionError(f"no content: {failed and (failed.status, failed.error, failed.raw[-500:])}")
        draining = termed[0]
        other = next(r for r in replicas.values() if r is not draining)

        # What SGLang does while draining: /health 503 at once, yet a new request is still served.
        status = httpx.get(f"{draining.url}/health", timeout=5).status_code
        direct = short_chat(draining.url, f"direct-{uuid.uuid4().hex[:12]}")
        # Its agent keeps it registered, marked draining: no new attempt goes there, the one in flight is
        # not lost.
        poll(
            lambda: (r := registered(etcd).get(draining.endpoint)) is not None and r.draining,
            timeout=10,
            what="the draining replica marked draining",
        )
        withdrawn_at = time.monotonic()
        withdrawn_after = withdrawn_at - termed_at[0]
        print(
            f"\nreal_engine: SGLang SIGTERM -> /health {status}, marked draining after {withdrawn_after:.2f}s"
        )
        assert status == 503
        assert direct.status_code == 200 and direct.json()["choices"][0]["finish_reason"] == "length"
        assert "GET /health: HTTP 503 while the server still answers" in agents[draining.name].out.read_text()

        # The gateway follows the registry: new requests all go to the other replica, none to the draining one
        # (which would still accept them). Envoy learns the new endpoints within a moment: ask until they do.
        def only_other() -> bool:
            ids = [f"after-{uuid.uuid4().hex[:12]}" for _ in range(6)]
            answers = [short_chat(gateway.url, i) for i in ids]
            assert all(a.status_code == 200 for a in answers), [
                a.text for a in answers if a.status_code != 200
            ]
            return not any(draining.rids_of(i) for i in ids)

        poll(only_other, timeout=15, what="no new attempt on the draining replica")
        later = [f"after-{uuid.uuid4().hex[:12]}" for _ in range(6)]
        for request_id in later:
            assert short_chat(gateway.url, request_id).status_code == 200
            assert replica_of(gateway, request_id, replicas) is other
            assert not draining.rids_of(request_id), "a new attempt landed on the draining replica"

        thread.join(90)
        assert not thread.is_alive(), "the in-flight stream never ended"
        result = box["r"]
        assert_one_attempt_content(result)
        frames = result.error_frames()
        assert len(frames) <= 1 and result.done_count() <= 1
        journal = terminal_journal(gateway, result.request_id, timeout=30)
        assert serving_attempt(journal)["replica"] == draining.endpoint, journal
        reasons = result.finish_reasons()
        if frames:  # the gateway treats a withdrawn replica as lost and ends its streams honestly
            assert frames[0]["code"] == "upstream_decode_interrupted" and result.payloads()[-1] == "[DONE]"
            assert journal["phase"] == "interrupted", journal
            behaviour = f"ended with a terminal frame ({frames[0]['message']})"
        else:  # SGLang drained it and the gateway let it finish
            assert result.error is None and reasons == ["length"], (result.error, reasons)
            assert journal["phase"] == "completed", journal
            behaviour = "completed by SGLang's drain"
        print(f"real_engine: the stream in flight on the draining replica {behaviour}")
        # For the next test: what happened to the stream, and did it end after the withdrawal?
        DRAIN_EVIDENCE.update(phase=journal["phase"], frames=frames, ended_after=box["ended"] > withdrawn_at)
    # SGLang exits once its drain has nothing left in flight; the next test starts it again.
    poll(lambda: not draining.alive(), timeout=30, what=f"SGLang {draining.name} to exit after its drain")
    draining.stop()
    draining.start(wait=False)


DRAIN_EVIDENCE: dict[str, Any] = {}  # what the drain test saw of the stream in flight on the draining replica


def test_a_stream_in_flight_on_a_draining_replica_completes() -> None:
    """A draining replica is not a lost one: its agent marks it draining, the gateway sends it nothing new
    and lets the stream in flight there finish (a rolling restart cuts no stream)."""
    if not DRAIN_EVIDENCE:
        pytest.skip("the drain test did not run to its end")
    if DRAIN_EVIDENCE["phase"] == "completed" and not DRAIN_EVIDENCE["ended_after"]:
        pytest.skip("the stream was complete before the replica was withdrawn: nothing to judge")
    assert DRAIN_EVIDENCE["phase"] == "completed", DRAIN_EVIDENCE


# --------------------------------------------------------------------------- destructive faults


def test_scheduler_killed_before_first_content_is_retried_on_the_other_replica(
    sglang_gateway: Gateway, both_healthy: dict[str, SglangReplica]
) -> None:
    replicas = both_healthy
    victim, other = replicas["a"], replicas["b"]
    scheduler = victim.scheduler_pid()
    assert scheduler is not None, f"no sglang::scheduler under {victim.name}: {victim.descendants()}"
    max_tokens = 32
    # Freeze the scheduler (no token can come), send requests until one lands on it (round robin: <= 2).
    with stopped(scheduler):
        landed = stream_until_routed_to(
            victim, sglang_gateway, replicas, max_tokens=max_tokens, id_prefix="sched", join=60
        )
        assert landed, "no request was routed to the replica with the frozen scheduler"
        poll(lambda: victim.rids_of(landed.request_id), timeout=10, what="SGLang to receive the request")
        assert landed.thread.is_alive()  # nothing can have been generated: the scheduler is frozen
        os.kill(scheduler, signal.SIGKILL)
        killed_at = time.monotonic()
    landed.thread.join(90)
    assert not landed.thread.is_alive(), "the client never finished"
    took = time.monotonic() - killed_at
    attempts = assert_retried_on(sglang_gateway, landed, victim, other, max_tokens)
    print(
        f"\nreal_engine: SGLang scheduler killed before content -> answered by {other.name} "
        f"{took:.1f}s later (first attempt failed: {attempts[0]['detail']})"
    )
    # SGLang's server notices its scheduler died and kills its own process tree (~5 s).
    poll(
        lambda: not victim.alive(), timeout=30, what=f"SGLang {victim.name} to exit after its scheduler died"
    )


def test_server_killed_after_first_delta_gives_prefix_then_reset_or_one_terminal_frame(
    sglang_gateway: Gateway, sglang_replicas: dict[str, SglangReplica]
) -> None:
    replicas = sglang_replicas
    poll(lambda: any(r.alive() for r in replicas.values()), timeout=5, what="a running replica")
    # Freeze every replica (no further token while we find out which one serves us), kill the server
    # process of that one, and let the processes go on (its children notice and die).
    kill_after_first_delta = AtFirstDelta(
        sglang_gateway, replicas, SglangReplica.kill_server, freeze=True, thaw_served=True
    )
    killed = kill_after_first_delta.acted

    # The kill must land mid-generation. A client starved of CPU may read its first delta only after SGLang
    # generated all LONG tokens: then the answer is simply complete (and journaled so). That is not this
    # test's case: it runs again, a bounded number of times.
    for _ in range(3):
        killed.clear()
        result = stream_chat(
            sglang_gateway.url,
            max_tokens=LONG,
            on_chunk=kill_after_first_delta,
            stream_options=CONTINUOUS_USAGE,
            read_timeout=30,
        )
        assert killed, f"the stream never delivered content: {result.status} {result.error!r}"
        if "length" not in result.finish_reasons():
            break
        assert terminal_journal(sglang_gateway, result.request_id)["phase"] == "completed"
        print("\nreal_engine: the whole answer arrived before the kill landed; running the scenario again")
        killed[0].stop()
        killed[0].start(wait=True, timeout=150)
    # Either a transport reset (the SDK raises) or exactly one terminal frame then [DONE].
    journal, frames, client_tokens = assert_prefix_then_reset_or_one_frame(sglang_gateway, result)
    assert serving_attempt(journal)["replica"] == killed[0].endpoint, journal
    outcome = (
        f"terminal frame ({frames[0]['message']})" if frames else f"reset ({type(result.error).__name__})"
    )
    print(f"\nreal_engine: SGLang server killed after {client_tokens} tokens -> {outcome}")
    poll(lambda: not killed[0].alive(), timeout=10, what="the killed server to be gone")
