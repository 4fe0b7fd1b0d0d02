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
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from router_sidecar.coordination.registry_store import Replica, ReplicaRegistry, open_store
from router_sidecar.runtime.supervise import Child, start_etcd
from router_testbed.real_engine import SglangReplica
from tests.harness import Gateway, poll
from tests.real_engine.client import Streamed, has_content, sdk_client

AUTH = {"authorization": "Bearer unused"}  # the SDK's credential: journal look-ups are scoped to it
CONTINUOUS_USAGE = {"include_usage": True, "continuous_usage_stats": True}
MESSAGES = [{"role": "user", "content": "Tell me a story"}]
TERMINAL = {"completed", "interrupted", "cancelled", "rejected", "failed"}
# A long answer: SGLang counts the prompt (25 tokens here) into the 1024-token context, unlike vLLM's 1000.
LONG = 960

OnChunk = Callable[[Any, Streamed], bool]


# --------------------------------------------------------------------------- client side


def stream_chat(
    base_url: str,
    *,
    max_tokens: int,
    on_chunk: OnChunk | None = None,
    headers: dict[str, str] | None = None,
    read_timeout: float = 60.0,
    stream_options: dict[str, Any] | None = None,
) -> Streamed:
    """Stream one chat completion with the SDK; `on_chunk` returning True makes the client leave."""
    client, tee = sdk_client(base_url, read_timeout=read_timeout)
    result = Streamed()
    body: dict[str, Any] = {"ignore_eos": True}
    if stream_options is not None:
        body["stream_options"] = stream_options
    try:
        stream = client.chat.completions.create(
            model="tiny",
            messages=MESSAGES,  # type: ignore[arg-type]
            stream=True,
            max_tokens=max_tokens,
            extra_headers=headers,
            extra_body=body,
        )
        result.status, result.headers = tee.status, tee.headers
        try:
            for chunk in stream:
                result.chunks.append(chunk)
                if on_chunk is not None and on_chunk(chunk, result):
                    break
        finally:
            stream.close()
    except Exception as exc:  # a reset or a terminal frame: recorded, asserted on by the test
        result.error = exc
    finally:
        result.raw = bytes(tee.raw)
        result.status, result.headers = result.status or tee.status, result.headers or tee.headers
        client.close()
    return result


def chunk_has_content(chunk: Any) -> bool:
    return has_content(chunk.model_dump())


def content_chunks(result: Streamed) -> int:
    return sum(1 for c in result.chunks if chunk_has_content(c))


def direct_payloads(url: str, path: str, body: dict[str, Any]) -> list[Any]:
    """The same request straight to a replica: raw SSE payloads, the reference for 'unchanged'."""
    response = httpx.post(f"{url}{path}", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return Streamed(raw=response.content).payloads()


def event_kinds(payloads: list[Any]) -> list[tuple[str, ...] | str]:
    """The distinct key lists of a stream's events, in order of first appearance, then [DONE]."""
    kinds: list[tuple[str, ...] | str] = []
    for p in payloads:
        kind = tuple(p) if isinstance(p, dict) else p
        if kind not in kinds:
            kinds.append(kind)
    return kinds


def assert_one_attempt_content(result: Streamed) -> None:
    ids = result.content_ids()
    assert len(ids) <= 1, f"content from several attempts reached the client: {ids}"
    assert {c.id for c in result.chunks if chunk_has_content(c)} <= ids


def assert_complete(result: Streamed, max_tokens: int) -> None:
    assert result.error is None, f"{result.error!r}\n{result.raw[-2000:]!r}"
    assert result.payloads()[-1] == "[DONE]" and result.done_count() == 1
    assert not result.error_frames()
    assert_one_attempt_content(result)
    assert result.finish_reasons() == ["length"]
    assert result.last_usage_tokens() == max_tokens


# --------------------------------------------------------------------------- gateway side


def journal_of(gateway: Gateway, request_id: str) -> dict[str, Any]:
    status, record = gateway.journal(request_id, AUTH)
    return record if status == 200 else {}


def terminal_journal(gateway: Gateway, request_id: str, timeout: float = 15.0) -> dict[str, Any]:
    return gateway.wait_journal(
        request_id, lambda j: j.get("phase") in TERMINAL, timeout=timeout, headers=AUTH
    )


def replica_of(gateway: Gateway, request_id: str, replicas: dict[str, SglangReplica]) -> SglangReplica | None:
    """The replica of the request's latest attempt, from the journal."""
    attempts = journal_of(gateway, request_id).get("attempts") or []
    address = attempts[-1].get("replica") if attempts else None
    return next((r for r in replicas.values() if r.endpoint == address), None)


def serving_attempt(journal: dict[str, Any]) -> dict[str, Any]:
    """The attempt that published; any before it failed before content (retried invisibly: the contract)."""
    *before, serving = journal["attempts"]
    assert all(a["outcome"] == "failed" for a in before), journal
    return serving


def in_background(target: Callable[[], Streamed]) -> tuple[threading.Thread, dict[str, Any]]:
    """Run one client in a thread; its result lands in the box as ``r``, the time it ended as ``ended``."""
    box: dict[str, Any] = {}

    def run() -> None:
        box["r"] = target()
        box["ended"] = time.monotonic()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, box


# --------------------------------------------------------------------------- pass-through


def test_chat_stream_with_usage_is_one_complete_answer(
    sglang_gateway: Gateway, sglang_replicas: dict[str, SglangReplica]
) -> None:
    max_tokens = 24
    result = stream_chat(sglang_gateway.url, max_tokens=max_tokens, stream_options=CONTINUOUS_USAGE)
    assert result.status == 200 and result.request_id
    assert_complete(result, max_tokens)
    sdk = result.chunks
    assert sdk[0].choices[0].delta.role == "assistant"
    assert (
        sdk[-1].choices == [] and sdk[-1].usage is not None and sdk[-1].usage.completion_tokens == max_tokens
    )
    assert "".join(c.choices[0].delta.content or "" for c in sdk if c.choices)
    # The events the client got have the structure SGLang itself sends (its role event with
    # reasoning_content, matched_stop, usage on content events but not on the finish event).
    body = {
        "model": "tiny",
        "messages": MESSAGES,
        "stream": True,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream_options": CONTINUOUS_USAGE,
    }
    reference = direct_payloads(sglang_replicas["a"].url, "/v1/chat/completions", body)
    assert event_kinds(result.payloads()) == event_kinds(reference)
    journal = terminal_journal(sglang_gateway, result.request_id)
    assert journal["phase"] == "completed", journal
    serving_attempt(journal)
    assert journal["delivered_output_tokens"] == max_tokens
    assert journal["delivered_output_tokens_source"] == "usage"


def test_completions_stream_with_usage_is_one_complete_answer(sglang_gateway: Gateway) -> None:
    max_tokens = 16
    client, tee = sdk_client(sglang_gateway.url)
    try:
        stream = client.completions.create(
            model="tiny",
            prompt="Once upon a time",
            stream=True,
            max_tokens=max_tokens,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        chunks = list(stream)
    finally:
        client.close()
    result = Streamed(chunks=chunks, raw=bytes(tee.raw), headers=tee.headers, status=tee.status)
    assert result.status == 200
    assert_complete(result, max_tokens)
    # SGLang's completions stream has no role event: every event but the usage one has a text choice (the
    # first may be empty while the detokenizer holds back a partial UTF-8 sequence).
    assert all(c.object == "text_completion" for c in chunks)
    assert all(c.choices and c.choices[0].text is not None for c in chunks[:-1])
    assert "".join(c.choices[0].text for c in chunks if c.choices)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == max_tokens
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
        store = open_store(etcd)
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

        termed: list[SglangReplica] = []
        termed_at: list[float] = []

        def term_after_first_delta(chunk: Any, so_far: Streamed) -> bool:
            if not termed and chunk_has_content(chunk):
                served = replica_of(gateway, so_far.request_id, replicas)
                assert served is not None
                served.terminate_server()
                termed.append(served)
                termed_at.append(time.monotonic())
            return False

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
    os.kill(scheduler, signal.SIGSTOP)
    landed: dict[str, Any] = {}
    try:
        for _ in range(4):
            request_id = f"sched-{uuid.uuid4().hex[:16]}"
            thread, box = in_background(
                lambda rid=request_id: stream_chat(  # type: ignore[misc]
                    sglang_gateway.url,
                    max_tokens=max_tokens,
                    headers={"Idempotency-Key": rid},
                    stream_options=CONTINUOUS_USAGE,
                )
            )
            first = poll(
                lambda rid=request_id: replica_of(sglang_gateway, rid, replicas),  # type: ignore[misc]
                timeout=15,
                what="the first attempt's replica",
            )
            if first is victim:
                landed = {"request_id": request_id, "thread": thread, "box": box}
                break
            thread.join(60)  # served by the healthy replica: a normal answer; try again
        assert landed, "no request was routed to the replica with the frozen scheduler"
        poll(lambda: victim.rids_of(landed["request_id"]), timeout=10, what="SGLang to receive the request")
        assert landed["thread"].is_alive()  # nothing can have been generated: the scheduler is frozen
        os.kill(scheduler, signal.SIGKILL)
        killed_at = time.monotonic()
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(scheduler, signal.SIGCONT)
    landed["thread"].join(90)
    assert not landed["thread"].is_alive(), "the client never finished"
    took = time.monotonic() - killed_at
    result: Streamed = landed["box"]["r"]
    assert result.request_id == landed["request_id"]
    assert_complete(result, max_tokens)  # one complete answer, no error frame, one attempt's content
    journal = terminal_journal(sglang_gateway, result.request_id)
    attempts = journal["attempts"]
    assert journal["phase"] == "completed" and len(attempts) == 2, journal
    assert attempts[0]["replica"] == victim.endpoint and attempts[0]["outcome"] == "failed"
    assert attempts[1]["replica"] == other.endpoint
    assert journal["delivered_output_tokens"] == max_tokens
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
    killed: list[SglangReplica] = []

    def kill_after_first_delta(chunk: Any, so_far: Streamed) -> bool:
        if not killed and chunk_has_content(chunk):
            # Freeze every replica (no further token while we find out which one serves us), kill the
            # server process of that one, and let the processes go on (its children notice and die).
            for replica in replicas.values():
                replica.signal_group(signal.SIGSTOP)
            served = replica_of(sglang_gateway, so_far.request_id, replicas)
            assert served is not None
            served.kill_server()
            killed.append(served)
            for replica in replicas.values():
                replica.signal_group(signal.SIGCONT)
        return False

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
    assert result.status == 200 and result.request_id
    assert_one_attempt_content(result)
    assert len(result.content_payloads()) >= 1 and "length" not in result.finish_reasons()
    frames = result.error_frames()
    # Either a transport reset (the SDK raises) or exactly one terminal frame then [DONE].
    assert result.error is not None or frames, "the stream ended as if complete"
    assert len(frames) <= 1
    if frames:
        assert frames[0]["code"] == "upstream_decode_interrupted"
        assert result.payloads()[-1] == "[DONE]" and result.done_count() == 1
    else:
        assert result.done_count() == 0
        assert isinstance(result.error, (httpx.TransportError, openai.APIConnectionError)), repr(result.error)
    journal = terminal_journal(sglang_gateway, result.request_id)
    assert journal["phase"] == "interrupted", journal
    assert journal["first_delta_sent"] is True
    assert serving_attempt(journal)["replica"] == killed[0].endpoint, journal
    client_tokens = result.last_usage_tokens()
    assert client_tokens is not None and client_tokens >= 1
    assert journal["delivered_output_tokens_source"] == "usage"
    if frames:  # a clean end: exactly what the client got
        assert journal["delivered_output_tokens"] == client_tokens == frames[0]["delivered_output_tokens"]
    else:  # a reset: what was in flight was delivered (written towards the client) but never read
        assert journal["delivered_output_tokens"] >= client_tokens, (journal, client_tokens)
    outcome = (
        f"terminal frame ({frames[0]['message']})" if frames else f"reset ({type(result.error).__name__})"
    )
    print(f"\nreal_engine: SGLang server killed after {client_tokens} tokens -> {outcome}")
    poll(lambda: not killed[0].alive(), timeout=10, what="the killed server to be gone")
