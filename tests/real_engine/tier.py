"""What the vLLM tier (conftest.py, test_vllm_gateway.py) and the SGLang tier (sglang/) share: starting a
pair of replicas and a gateway in front of them, streaming one chat or completion through it with the SDK,
the checks of what the client got, and the journal look-ups.

One copy, so that both engines are held to the same checks; what differs between the engines (which process
to kill, how a replica is restarted, the length of a long answer) stays in the tiers.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, TypeVar

import httpx
import openai
import pytest

from router_testbed.real_engine import EngineReplica, Installation
from tests.harness import Gateway, poll
from tests.real_engine.client import Streamed, has_content, sdk_client

AUTH = {"authorization": "Bearer unused"}  # the SDK's credential: journal look-ups are scoped to it
CONTINUOUS_USAGE = {"include_usage": True, "continuous_usage_stats": True}
MESSAGES = [{"role": "user", "content": "Tell me a story"}]
TERMINAL_PHASES = {"completed", "interrupted", "cancelled", "rejected", "failed"}
ROUTING_TRIES = 12  # stream_until_routed_to: half a second apart, past the sidecar's next probes

R = TypeVar("R", bound=EngineReplica)
OnChunk = Callable[[Any, Streamed], bool]


# --------------------------------------------------------------------------- replicas and gateway


def mark_tier(items: list[pytest.Item], directory: Path, skip_reason: str | None) -> None:
    """Mark the tests below `directory` real_engine with the tier's timeout; skipped when `skip_reason`."""
    for item in items:
        if directory in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.real_engine)
            item.add_marker(pytest.mark.timeout(300))
            if skip_reason is not None:
                item.add_marker(pytest.mark.skip(reason=skip_reason))


def installed(install: Installation | None, skip_reason: str) -> Installation:
    """The tier's installation, or skip the test that needs it."""
    if install is None:
        pytest.skip(skip_reason)
    return install


@contextlib.contextmanager
def replica_pair(
    engine: str,
    start: Callable[..., dict[str, R]],
    install: Installation,
    tmp_path_factory: pytest.TempPathFactory,
    timeout: float,
) -> Iterator[dict[str, R]]:
    """Replicas "a" and "b" started at once by `start` (start_replicas or start_sglang_replicas), stopped
    on exit."""
    t0 = time.monotonic()
    try:
        pool = start(["a", "b"], install, tmp_path_factory.mktemp(engine.lower()), timeout=timeout)
    except (TimeoutError, RuntimeError) as exc:
        # The engine's start-up is not what the tiers test: on a starved machine it can fail to come up in
        # time (or shut itself down). Once more from scratch, then the failure stands.
        print(f"\nreal_engine: {engine} did not start ({str(exc)[:300]}); starting both once more")
        pool = start(["a", "b"], install, tmp_path_factory.mktemp(engine.lower()), timeout=timeout)
    print(f"\nreal_engine: 2 {engine} replicas ready in {time.monotonic() - t0:.1f}s")
    try:
        yield pool
    finally:
        for replica in pool.values():
            replica.stop()


@contextlib.contextmanager
def gateway_to(replicas: dict[str, R], etcd: str, work: Path) -> Iterator[Gateway]:
    """A gateway with `replicas` as its static replicas, stopped on exit."""
    gateway = Gateway(replicas=[r.endpoint for r in replicas.values()], etcd=etcd, work=work)
    try:
        yield gateway
    finally:
        gateway.stop()


def wait_restarted(replica: EngineReplica, timeout: float) -> float:
    """Wait for a replica just started again; seconds since its start. Once more from scratch if it does
    not come up: as at the tier's start, a starved machine can keep an engine from starting in time."""
    try:
        return replica.wait_ready(timeout)
    except (TimeoutError, RuntimeError) as exc:
        print(f"\nreal_engine: {replica.label} {replica.name} did not restart ({str(exc)[:300]}); once more")
        replica.stop()
        replica.start(wait=False)
        return replica.wait_ready(timeout)


# --------------------------------------------------------------------------- client side


def stream_chat(
    base_url: str,
    *,
    max_tokens: int,
    on_chunk: OnChunk | None = None,
    headers: dict[str, str] | None = None,
    read_timeout: float = 60.0,
    stream_options: dict[str, Any] | None = None,
    messages: list[dict[str, Any]] | None = None,
    **extra: Any,
) -> Streamed:
    """Stream one chat completion with the SDK (`messages`, else MESSAGES); `on_chunk` returning True makes
    the client leave."""
    client, tee = sdk_client(base_url, read_timeout=read_timeout)
    result = Streamed()
    body: dict[str, Any] = {"ignore_eos": True, **extra.pop("extra_body", {})}
    if stream_options is not None:
        body["stream_options"] = stream_options
    try:
        stream = client.chat.completions.create(
            model="tiny",
            messages=messages or MESSAGES,  # type: ignore[arg-type]
            stream=True,
            max_tokens=max_tokens,
            extra_headers=headers,
            extra_body=body,
            **extra,
        )
        result.status, result.headers = tee.status, tee.headers
        result.read(stream, on_chunk)
    except Exception as exc:  # a reset or a terminal frame: recorded, asserted on by the test
        result.error = exc
    finally:
        result.raw = bytes(tee.raw)
        result.status, result.headers = result.status or tee.status, result.headers or tee.headers
        client.close()
    return result


def reference_chat_body(max_tokens: int) -> dict[str, Any]:
    """The body `stream_chat(max_tokens=..., stream_options=CONTINUOUS_USAGE)` sends, to send it straight to
    a replica."""
    return {
        "model": "tiny",
        "messages": MESSAGES,
        "stream": True,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream_options": CONTINUOUS_USAGE,
    }


def stream_completion(base_url: str, *, max_tokens: int) -> Streamed:
    """Stream one text completion ("Once upon a time") with usage through the SDK, to its end."""
    client, tee = sdk_client(base_url)
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
    return Streamed(chunks=chunks, raw=bytes(tee.raw), headers=tee.headers, status=tee.status)


def in_background(target: Callable[[], Streamed]) -> tuple[threading.Thread, dict[str, Any]]:
    """Run one client in a thread; its result lands in the box as ``r``, the time it ended as ``ended``."""
    box: dict[str, Any] = {}

    def run() -> None:
        box["r"] = target()
        box["ended"] = time.monotonic()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, box


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


def assert_complete_chat_with_usage(result: Streamed, max_tokens: int) -> None:
    """A chat stream_chat'ed with CONTINUOUS_USAGE, complete: the role first, usage last, some text."""
    assert result.status == 200 and result.request_id
    assert_complete(result, max_tokens)
    sdk = result.chunks
    assert sdk[0].choices[0].delta.role == "assistant"
    assert sdk[-1].choices == [] and sdk[-1].usage is not None
    assert sdk[-1].usage.completion_tokens == max_tokens
    text = "".join(c.choices[0].delta.content or "" for c in sdk if c.choices)
    assert text  # random bytes: a lone high byte may decode to U+FFFD, as the engine itself sends it


def assert_complete_completion_with_usage(result: Streamed, max_tokens: int) -> None:
    """A stream_completion, complete: text events, usage last."""
    chunks = result.chunks
    assert result.status == 200
    assert_complete(result, max_tokens)
    assert all(c.object == "text_completion" for c in chunks)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == max_tokens
    assert "".join(c.choices[0].text for c in chunks if c.choices)


# --------------------------------------------------------------------------- gateway side


def journal_of(gateway: Gateway, request_id: str) -> dict[str, Any]:
    status, record = gateway.journal(request_id, AUTH)
    return record if status == 200 else {}


def terminal_journal(gateway: Gateway, request_id: str, timeout: float = 15.0) -> dict[str, Any]:
    return gateway.wait_journal(
        request_id, lambda j: j.get("phase") in TERMINAL_PHASES, timeout=timeout, headers=AUTH
    )


def replica_of(gateway: Gateway, request_id: str, replicas: dict[str, R]) -> R | None:
    """The replica of the request's latest attempt, from the journal."""
    attempts = journal_of(gateway, request_id).get("attempts") or []
    address = attempts[-1].get("replica") if attempts else None
    return next((r for r in replicas.values() if r.endpoint == address), None)


def serving_attempt(journal: dict[str, Any]) -> dict[str, Any]:
    """The attempt that published. Earlier ones may have failed before any content (a replica a previous
    test restarted can still count as lost to the sidecar's health probe for a moment, more so on a busy
    machine): retried invisibly, which is the contract too. None may follow the one that published."""
    *before, serving = journal["attempts"]
    assert all(a["outcome"] == "failed" for a in before), journal
    return serving


def assert_completed_with_usage_count(gateway: Gateway, request_id: str, max_tokens: int) -> None:
    """Journaled completed, the whole answer counted as delivered, the count taken from the usage figures."""
    journal = terminal_journal(gateway, request_id)
    assert journal["phase"] == "completed", journal
    serving_attempt(journal)
    assert journal["delivered_output_tokens"] == max_tokens
    assert journal["delivered_output_tokens_source"] == "usage"


# --------------------------------------------------------------------------- faults


@dataclass
class Landed:
    """A chat streaming in the background whose first attempt went to the replica under test."""

    request_id: str
    thread: threading.Thread
    box: dict[str, Any]  # in_background's box: the client's result as ``r``


def stream_until_routed_to(
    victim: R,
    gateway: Gateway,
    replicas: dict[str, R],
    *,
    max_tokens: int,
    id_prefix: str,
    join: float,
    start: Callable[[dict[str, str]], Streamed] | None = None,
) -> Landed | None:
    """Start chats (or whatever `start(headers)` streams: the headers name the request) in the background, one
    at a time, until one's first attempt goes to `victim`; those served elsewhere get `join` seconds to
    finish. Round robin lands within two, once the gateway has the victim among its candidates: a static
    replica just restarted is one again only when the sidecar's own probe saw it healthy
    (`liveness.static_probe_interval_seconds`, 1 s), which may come after Envoy's health check did. So the
    tries go on, half a second apart, for a bounded count. None if none landed (CI, 5 December 2026: four
    tries within 0.6 s after a restart all went to the other replica)."""

    def chat(headers: dict[str, str]) -> Streamed:
        return stream_chat(
            gateway.url, max_tokens=max_tokens, headers=headers, stream_options=CONTINUOUS_USAGE
        )

    for attempt in range(ROUTING_TRIES):
        if attempt:
            time.sleep(0.5)  # paces the tries while the sidecar's probe catches up (not a synchronisation)
        request_id = f"{id_prefix}-{uuid.uuid4().hex[:16]}"
        thread, box = in_background(
            lambda rid=request_id: (start or chat)({"Idempotency-Key": rid})  # type: ignore[misc]
        )
        first = poll(
            lambda rid=request_id: replica_of(gateway, rid, replicas),  # type: ignore[misc]
            timeout=15,
            what="the first attempt's replica",
        )
        if first is victim:
            return Landed(request_id, thread, box)
        thread.join(join)  # served by the healthy replica: a normal answer; try again
    return None


@contextlib.contextmanager
def stopped(pid: int) -> Iterator[None]:
    """The process stopped (SIGSTOP) within; continued on exit unless it is gone (a test may kill it)."""
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)


@dataclass
class AtFirstDelta(Generic[R]):
    """An `on_chunk` for stream_chat (or an `on_event` of the Responses and Messages clients, with their
    `is_content`): at the stream's first content delta, once, `act` on the replica that serves it (found in
    the journal), then let the client read on. The replica lands in `acted`, the time after `act` in
    `acted_at`.

    With `freeze`, every replica's process group is stopped first, so that no further token is generated
    while the serving one is looked up; after `act` the others go on, and the serving one too if
    `thaw_served`."""

    gateway: Gateway
    replicas: dict[str, R]
    act: Callable[[R], None]
    freeze: bool = False
    thaw_served: bool = False
    is_content: Callable[[Any], bool] = chunk_has_content
    acted: list[R] = field(default_factory=list)
    acted_at: list[float] = field(default_factory=list)

    def __call__(self, chunk: Any, so_far: Streamed) -> bool:
        if not self.acted and self.is_content(chunk):
            if self.freeze:
                for replica in self.replicas.values():
                    replica.signal_group(signal.SIGSTOP)
            served = replica_of(self.gateway, so_far.request_id, self.replicas)
            assert served is not None
            self.act(served)
            self.acted.append(served)
            self.acted_at.append(time.monotonic())
            if self.freeze:
                for replica in self.replicas.values():
                    if self.thaw_served or replica is not served:
                        replica.signal_group(signal.SIGCONT)
        return False


def assert_retried_on(
    gateway: Gateway, landed: Landed, victim: EngineReplica, other: EngineReplica, max_tokens: int
) -> list[dict[str, Any]]:
    """The victim failed before any content and the other replica gave one whole answer; the attempts."""
    result: Streamed = landed.box["r"]
    assert result.request_id == landed.request_id
    assert_complete(result, max_tokens)  # one complete answer, no error frame, one attempt's content
    journal = terminal_journal(gateway, result.request_id)
    attempts = journal["attempts"]
    assert journal["phase"] == "completed" and len(attempts) == 2, journal
    assert attempts[0]["replica"] == victim.endpoint and attempts[0]["outcome"] == "failed"
    assert attempts[1]["replica"] == other.endpoint
    assert journal["delivered_output_tokens"] == max_tokens
    return attempts


def assert_prefix_then_reset_or_one_frame(
    gateway: Gateway, result: Streamed
) -> tuple[dict[str, Any], list[dict[str, Any]], int]:
    """The serving replica died after the first delta: the client got a prefix from one attempt, then a
    transport reset or exactly one terminal frame and [DONE]; the journal says interrupted and counts what
    was delivered from the usage figures. Returns the journal, the terminal frames and the client's count."""
    assert result.status == 200 and result.request_id
    assert_one_attempt_content(result)
    assert len(result.content_payloads()) >= 1 and "length" not in result.finish_reasons()
    frames = result.error_frames()
    assert result.error is not None or frames, "the stream ended as if complete"
    assert len(frames) <= 1
    if frames:
        assert frames[0]["code"] == "upstream_decode_interrupted"
        assert result.payloads()[-1] == "[DONE]" and result.done_count() == 1
    else:
        assert result.done_count() == 0
        assert isinstance(result.error, (httpx.TransportError, openai.APIConnectionError)), repr(result.error)
    journal = terminal_journal(gateway, result.request_id)
    assert journal["phase"] == "interrupted", journal
    assert journal["first_delta_sent"] is True
    client_tokens = result.last_usage_tokens()
    assert client_tokens is not None and client_tokens >= 1
    assert journal["delivered_output_tokens_source"] == "usage"
    if frames:  # a clean end: exactly what the client got
        assert journal["delivered_output_tokens"] == client_tokens == frames[0]["delivered_output_tokens"]
    else:  # a reset: what was in flight was delivered (written towards the client) but never read
        assert journal["delivered_output_tokens"] >= client_tokens, (journal, client_tokens)
    return journal, frames, client_tokens


@dataclass
class Together(Generic[R]):
    """Streams started at once, each named by its Idempotency-Key (`streams[name].request_id`), to be frozen
    together at their first content (freeze_at_first_content). `read[name]` is set once that client has read
    a content event."""

    gateway: Gateway
    replicas: dict[str, R]
    streams: dict[str, Landed]
    read: dict[str, threading.Event]


def start_together(
    gateway: Gateway,
    replicas: dict[str, R],
    starts: dict[str, Callable[[dict[str, str], OnChunk], Streamed]],
    is_content: dict[str, Callable[[Any], bool]],
    *,
    id_prefix: str,
) -> Together[R]:
    """Start every `starts[name](headers, on_event)` in the background at once."""
    streams: dict[str, Landed] = {}
    read: dict[str, threading.Event] = {}
    for name, start in starts.items():
        request_id = f"{id_prefix}-{name}-{uuid.uuid4().hex[:12]}"
        seen = read[name] = threading.Event()
        rule = is_content[name]

        def on_event(chunk: Any, so_far: Streamed, seen: threading.Event = seen, rule: Any = rule) -> bool:
            if rule(chunk):
                seen.set()
            return False

        thread, box = in_background(
            lambda start=start, rid=request_id, on_event=on_event: start(  # type: ignore[misc]
                {"Idempotency-Key": rid}, on_event
            )
        )
        streams[name] = Landed(request_id, thread, box)
    return Together(gateway, replicas, streams, read)


def freeze_at_first_content(together: Together[R], *, timeout: float = 30.0) -> dict[str, R]:
    """Every replica frozen (SIGSTOP of its process group) as soon as the gateway has released the first
    content of every stream (journal `first_delta_sent`, polled), so that no answer can be generated whole
    before the fault lands however late a starved client reads; then until each client has read content (what
    was released is in flight; 5 s at most). Returns the replica serving each stream; the caller acts on them
    and thaws what it wants to go on."""

    def released() -> dict[str, dict[str, Any]] | None:
        journals = {n: journal_of(together.gateway, s.request_id) for n, s in together.streams.items()}
        if all(j.get("first_delta_sent") for j in journals.values()):
            return journals
        ended = {n: s.box.get("r") for n, s in together.streams.items() if not s.thread.is_alive()}
        if ended:
            said = {n: (r.status, repr(r.error), r.raw[-300:]) for n, r in ended.items() if r is not None}
            raise AssertionError(f"a stream ended before its first content was released: {said}")
        return None

    poll(released, timeout=timeout, what="the first content of every stream")
    for replica in together.replicas.values():
        replica.signal_group(signal.SIGSTOP)
    deadline = time.monotonic() + 5.0
    for seen in together.read.values():
        seen.wait(max(0.0, deadline - time.monotonic()))
    served = {
        n: replica_of(together.gateway, s.request_id, together.replicas) for n, s in together.streams.items()
    }
    missing = [n for n, r in served.items() if r is None]
    assert not missing, f"no serving replica in the journal for {missing}"
    return served  # type: ignore[return-value]


def frozen_mid_stream(
    begin: Callable[[], Together[R]], *, tries: int = 3
) -> tuple[Together[R], dict[str, R]]:
    """`begin()` the streams and freeze every replica at their first content (freeze_at_first_content);
    again, at most `tries` times, when a stream was answered whole before the freeze landed (a busy machine:
    the later stream's first content was released after the earlier one's whole answer had gone out). Every
    replica is frozen on return; the caller acts, then thaws."""
    for _ in range(tries):
        together = begin()
        served = freeze_at_first_content(together)
        whole = [
            name
            for name, stream in together.streams.items()
            if journal_of(together.gateway, stream.request_id).get("phase") == "completed"
        ]
        if not whole:
            return together, served
        print(f"\nreal_engine: {whole} answered whole before the freeze; again")
        for replica in together.replicas.values():
            replica.signal_group(signal.SIGCONT)
        results_of(together)
    raise AssertionError(f"a stream was answered whole before the freeze {tries} times")


def results_of(together: Together[R], *, timeout: float = 90.0) -> dict[str, Streamed]:
    """Every stream's result, once its client has finished (within `timeout` in all)."""
    deadline = time.monotonic() + timeout
    for name, stream in together.streams.items():
        stream.thread.join(max(0.0, deadline - time.monotonic()))
        assert not stream.thread.is_alive(), f"the {name} client never finished"
    return {name: stream.box["r"] for name, stream in together.streams.items()}
