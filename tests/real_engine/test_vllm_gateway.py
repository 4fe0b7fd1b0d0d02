"""Two real vLLM replicas behind the gateway: pass-through, and the first-delta contract under real faults.

Tests run in file order, arranged so that only faults that kill a replica need a restart (25–40 s): the
non-destructive tests first, then the destructive ones, each restarting in the background what the previous
one killed.
"""

from __future__ import annotations

import json
import os
import signal
import time
from typing import Any

import httpx

from router_testbed.real_engine import VllmReplica
from tests.harness import Gateway, poll
from tests.real_engine.client import Streamed
from tests.real_engine.tier import (
    CONTINUOUS_USAGE,
    AtFirstDelta,
    assert_complete_chat_with_usage,
    assert_complete_completion_with_usage,
    assert_completed_with_usage_count,
    assert_one_attempt_content,
    assert_prefix_then_reset_or_one_frame,
    assert_retried_on,
    chunk_has_content,
    content_chunks,
    direct_payloads,
    event_kinds,
    reference_chat_body,
    replica_of,
    serving_attempt,
    stopped,
    stream_chat,
    stream_completion,
    stream_until_routed_to,
    terminal_journal,
)

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather for a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}},
            "required": ["city"],
            "additionalProperties": False,
        },
        "strict": True,
    },
}


# --------------------------------------------------------------------------- pass-through


def shape(payload: Any) -> Any:
    """Structure of an event without its random parts: keys in order, nested; leaves by type."""
    if isinstance(payload, dict):
        return {k: shape(v) for k, v in payload.items()}
    if isinstance(payload, list):
        return [shape(v) for v in payload]
    if isinstance(payload, str) and payload in ("[DONE]", "assistant", "length", "stop", "tool_calls"):
        return payload
    return type(payload).__name__


def test_chat_stream_with_usage_passes_through_unchanged(
    gateway: Gateway, healthy_replicas: dict[str, VllmReplica]
) -> None:
    max_tokens = 24
    result = stream_chat(gateway.url, max_tokens=max_tokens, stream_options=CONTINUOUS_USAGE)
    assert_complete_chat_with_usage(result, max_tokens)
    # Byte-level: the events the client got have exactly the structure vLLM itself sends.
    body = reference_chat_body(max_tokens)
    reference = direct_payloads(next(iter(healthy_replicas.values())).url, "/v1/chat/completions", body)
    got = result.payloads()
    # vLLM may pack several tokens into one event when its API server lags the engine, so the number of
    # events differs between two runs; the structure of each kind of event may not.
    assert event_kinds(got) == event_kinds(reference)
    assert shape(got[0]) == shape(reference[0]) and shape(got[-2]) == shape(reference[-2])
    assert_completed_with_usage_count(gateway, result.request_id, max_tokens)


def test_completions_stream_with_usage_passes_through_unchanged(
    gateway: Gateway, healthy_replicas: dict[str, VllmReplica]
) -> None:
    max_tokens = 16
    result = stream_completion(gateway.url, max_tokens=max_tokens)
    assert_complete_completion_with_usage(result, max_tokens)
    body = {
        "model": "tiny",
        "prompt": "Once upon a time",
        "stream": True,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream_options": {"include_usage": True},
    }
    reference = direct_payloads(next(iter(healthy_replicas.values())).url, "/v1/completions", body)
    # vLLM coalesces tokens into fewer events when it runs ahead of its reader (a busy machine): how many
    # text events there are, and which carries the finish, varies from run to run; their shape does not.
    assert _unfinished(shape(result.payloads()[0])) == _unfinished(shape(reference[0]))
    assert [shape(p) for p in result.payloads()][-2:] == [shape(p) for p in reference][-2:]
    journal = terminal_journal(gateway, result.request_id)
    assert journal["phase"] == "completed" and journal["delivered_output_tokens"] == max_tokens


def _unfinished(event_shape: Any) -> Any:
    """An event's shape with its choices' finish_reason left out (None or a reason, by chunking)."""
    if isinstance(event_shape, dict) and isinstance(event_shape.get("choices"), list):
        choices = [{k: v for k, v in c.items() if k != "finish_reason"} for c in event_shape["choices"]]
        return {**event_shape, "choices": choices}
    return event_shape


def test_streamed_tool_call_passes_through(
    gateway: Gateway, healthy_replicas: dict[str, VllmReplica]
) -> None:
    result = stream_chat(
        gateway.url,
        max_tokens=200,
        tools=[WEATHER_TOOL],
        tool_choice="required",
        parallel_tool_calls=False,  # else the random model keeps calling tools up to max_tokens
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": False},
    )
    assert result.error is None, repr(result.error)
    assert result.payloads()[-1] == "[DONE]" and not result.error_frames()
    assert_one_attempt_content(result)
    tool_deltas = [tc for c in result.chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert tool_deltas, f"no tool call deltas: {result.raw[:2000]!r}"
    first = tool_deltas[0]
    assert first.id and first.id.startswith("chatcmpl-tool-")
    assert first.type == "function" and first.function is not None and first.function.name == "get_weather"
    arguments = "".join(tc.function.arguments or "" for tc in tool_deltas if tc.function)
    finish = result.finish_reasons()
    assert finish == ["tool_calls"], finish
    assert json.loads(arguments)["city"] in ("Paris", "Oslo")
    journal = terminal_journal(gateway, result.request_id)
    assert journal["phase"] == "completed" and journal["first_delta_sent"] is True


# --------------------------------------------------------------------------- client gone


def test_client_disconnect_aborts_the_request_in_vllm_and_starts_no_other(
    gateway: Gateway, healthy_replicas: dict[str, VllmReplica]
) -> None:
    def leave_after_three(chunk: Any, so_far: Streamed) -> bool:
        return content_chunks(so_far) >= 3

    # A client starved of CPU (a busy machine) may read its third delta only after the gateway forwarded
    # the whole answer and its [DONE]: then the request simply completed. Not this test's case: again, a
    # bounded number of times.
    for _ in range(3):
        received_before = {n: len(r.received_request_ids()) for n, r in healthy_replicas.items()}
        aborted_before = {n: len(r.aborted_request_ids()) for n, r in healthy_replicas.items()}
        result = stream_chat(gateway.url, max_tokens=1000, on_chunk=leave_after_three)
        assert result.error is None and result.request_id
        journal = terminal_journal(gateway, result.request_id)
        if journal["phase"] != "completed":
            break
        print("\nreal_engine: the whole answer went out before the client left; running the scenario again")
    assert journal["phase"] == "cancelled", journal
    serving_attempt(journal)
    served = replica_of(gateway, result.request_id, healthy_replicas)
    assert served is not None
    # vLLM logs the abort when its API server notices the closed connection: seconds on a busy machine.
    poll(
        lambda: len(served.aborted_request_ids()) > aborted_before[served.name],
        timeout=45,
        what=f"vLLM {served.name} to log the request aborted",
    )
    time.sleep(1.0)  # a wrongly started later attempt would show up in a log by now
    received = {n: len(r.received_request_ids()) - received_before[n] for n, r in healthy_replicas.items()}
    # One request per attempt (an attempt failed before content reached its replica, or never got there),
    # and the one that served was the last.
    assert sum(received.values()) <= len(journal["attempts"]) and received[served.name] >= 1, received
    assert replica_of(gateway, result.request_id, healthy_replicas) is served


# --------------------------------------------------------------------------- destructive faults


def test_engine_worker_killed_before_first_content_is_retried_on_the_other_replica(
    gateway: Gateway, healthy_replicas: dict[str, VllmReplica]
) -> None:
    victim, other = healthy_replicas["a"], healthy_replicas["b"]
    worker = victim.engine_worker_pid()
    assert worker is not None, f"no engine worker under {victim.name}: {victim.engine_pids()}"
    max_tokens = 32
    # Freeze the worker, then send requests until one lands on the frozen replica (round robin: <= 2).
    with stopped(worker):
        landed = stream_until_routed_to(
            victim, gateway, healthy_replicas, max_tokens=max_tokens, id_prefix="real", join=30
        )
        assert landed, "no request was routed to the frozen replica"
        # The request waits on the frozen worker: nothing can have been delivered yet.
        time.sleep(0.5)
        assert landed.thread.is_alive()
        os.kill(worker, signal.SIGKILL)
    landed.thread.join(60)
    assert not landed.thread.is_alive(), "the client never finished"
    assert_retried_on(gateway, landed, victim, other, max_tokens)
    # vLLM itself sent the in-band error and then exits; start it again in the background.
    poll(lambda: not victim.healthy(), timeout=15, what=f"{victim.name} to go down")
    victim.stop()
    victim.start(wait=False)


def test_process_group_killed_after_first_delta_gives_prefix_then_reset(
    gateway: Gateway, healthy_replicas: dict[str, VllmReplica]
) -> None:
    # Waits for the replica the previous test killed: a replica loading next to the stream starves the
    # gateway's CPU, and the whole 1000-token answer may then be generated before the client's first delta.
    replicas = healthy_replicas
    # Freeze every replica at once (no further token can be generated while we find out which one serves
    # us), then kill the server's group and let the idle one go on.
    kill_after_first_delta = AtFirstDelta(gateway, replicas, VllmReplica.kill_group, freeze=True)
    killed = kill_after_first_delta.acted

    # The scenario needs the kill to land mid-generation. A client starved of CPU (a busy machine) may read
    # its first delta only after vLLM generated all 1000 tokens: then the answer is simply complete (and
    # journaled so). That is not this test's case, so it is run again, a bounded number of times.
    for _ in range(3):
        killed.clear()
        result = stream_chat(
            gateway.url,
            max_tokens=1000,
            on_chunk=kill_after_first_delta,
            stream_options=CONTINUOUS_USAGE,
            read_timeout=30,
        )
        assert killed, "the stream never delivered content"
        if "length" not in result.finish_reasons():
            break
        assert terminal_journal(gateway, result.request_id)["phase"] == "completed"
        print("\nreal_engine: the whole answer arrived before the kill landed; running the scenario again")
        killed[0].stop()
        killed[0].start()
    # Either a transport reset (the SDK raises) or exactly one terminal frame then [DONE].
    journal, _, _ = assert_prefix_then_reset_or_one_frame(gateway, result)
    assert journal["attempts"][-1]["replica"] == killed[0].endpoint
    killed[0].stop()
    killed[0].start(wait=False)


def test_frozen_vllm_mid_stream_is_lost_not_slow(
    gateway: Gateway, healthy_replicas: dict[str, VllmReplica]
) -> None:
    """The stall, made deterministic: the whole engine frozen (SIGSTOP) after the first delta. The gateway
    has static replicas (no agent): its probe of /health finds the replica lost and the client gets the
    terminal frame within a bounded time."""
    replicas = healthy_replicas
    poll(lambda: any(r.healthy() for r in replicas.values()), timeout=90, what="a healthy replica")
    frozen: list[VllmReplica] = []
    frozen_at: list[float] = []

    def freeze_after_first_delta(chunk: Any, so_far: Streamed) -> bool:
        if not frozen and chunk_has_content(chunk):
            # Freeze every replica at once (no further token while we find out which one serves us), then
            # let the idle one go on.
            for replica in replicas.values():
                replica.signal_group(signal.SIGSTOP)
            frozen_at.append(time.monotonic())
            served = replica_of(gateway, so_far.request_id, replicas)
            assert served is not None
            frozen.append(served)
            for replica in replicas.values():
                if replica is not served:
                    replica.signal_group(signal.SIGCONT)
        return False

    def thaw_and_restart() -> None:
        for replica in frozen:  # a thawed engine may have missed its own internal heartbeats: start afresh
            replica.signal_group(signal.SIGCONT)
            replica.stop()
            replica.start(wait=False)

    # A client starved of CPU (a busy machine) may read its first delta only after vLLM generated the whole
    # answer: then it is simply complete. That is not this test's case, so it runs again, a bounded number
    # of times.
    for _ in range(3):
        frozen.clear()
        frozen_at.clear()
        try:
            result = stream_chat(
                gateway.url, max_tokens=1000, on_chunk=freeze_after_first_delta, read_timeout=60
            )
            ended_after = time.monotonic() - frozen_at[0]
        finally:
            thaw_and_restart()
        assert frozen, "the stream never delivered content"
        if result.error_frames() or "length" not in result.finish_reasons():
            break
        assert terminal_journal(gateway, result.request_id)["phase"] == "completed"
        print("\nreal_engine: the whole answer arrived before the freeze landed; running the scenario again")
        # A replica loading beside the next try would starve the client again: wait for both.
        poll(lambda: all(r.healthy() for r in replicas.values()), timeout=120, what="both replicas healthy")
    assert frozen, "the stream never delivered content"
    assert_one_attempt_content(result)
    frames = result.error_frames()
    assert len(frames) == 1 and frames[0]["code"] == "upstream_decode_interrupted", result.payloads()[-3:]
    assert "health check" in frames[0]["message"]
    assert result.payloads()[-1] == "[DONE]"
    assert ended_after < 15, f"the terminal frame came {ended_after:.1f}s after the freeze"
    journal = terminal_journal(gateway, result.request_id, timeout=30)
    assert journal["phase"] == "interrupted", journal
    assert serving_attempt(journal)["replica"] == frozen[0].endpoint, journal
    assert journal["delivered_output_tokens"] == frames[0]["delivered_output_tokens"]
    print(f"\nreal_engine: frozen vLLM mid-stream -> terminal frame {ended_after:.1f}s after the freeze")


def test_api_server_sigterm_mid_stream_never_leaves_the_client_waiting(
    gateway: Gateway, healthy_replicas: dict[str, VllmReplica]
) -> None:
    """REAL_ENGINE.md: after SIGTERM vLLM drains, or sends `finish_reason: "abort"` then [DONE], or stalls
    (the engine is gone, uvicorn "waits for connections to close").

    Drain: one complete answer. Abort: exactly one terminal frame (an abort is an interruption). Stall: the
    replica stops answering its health check, so the sidecar's probe of static replicas finds it lost, and
    the client gets the terminal frame within a bounded time instead of waiting for its own read timeout.
    Every way: content from one attempt, no second attempt.
    """
    replicas = healthy_replicas
    poll(lambda: any(r.healthy() for r in replicas.values()), timeout=90, what="a healthy replica")
    term_after_first_delta = AtFirstDelta(gateway, replicas, VllmReplica.terminate_api_server)
    termed, termed_at = term_after_first_delta.acted, term_after_first_delta.acted_at

    result = stream_chat(
        gateway.url,
        max_tokens=1000,
        on_chunk=term_after_first_delta,
        stream_options=CONTINUOUS_USAGE,
        read_timeout=60,
    )
    ended_after = time.monotonic() - termed_at[0] if termed_at else None
    assert termed, (
        f"the stream never delivered content: {result.status} {result.error!r} {result.raw[-300:]!r}"
    )
    assert_one_attempt_content(result)
    frames = result.error_frames()
    assert len(frames) <= 1, frames
    assert result.done_count() <= 1
    journal = terminal_journal(gateway, result.request_id, timeout=30)
    # No attempt after the SIGTERM.
    assert serving_attempt(journal)["replica"] == termed[0].endpoint, journal
    reasons = result.finish_reasons()
    assert not isinstance(result.error, TimeoutError | httpx.ReadTimeout), "the client was left waiting"
    if frames:  # abort, or a stall the health probe caught: one terminal frame, then [DONE]
        assert "length" not in reasons
        assert frames[0]["code"] == "upstream_decode_interrupted"
        assert result.payloads()[-1] == "[DONE]"
        assert journal["phase"] == "interrupted"
        stalled = "abort" not in reasons
        behaviour = "stall -> health probe -> terminal frame" if stalled else "abort -> terminal frame"
        assert ended_after is not None and ended_after < 20, (
            f"the frame came {ended_after:.1f}s after SIGTERM"
        )
    elif result.error is None:
        # Graceful drain (measured, not in REAL_ENGINE.md's table): uvicorn waits for open connections, so
        # the in-flight generation runs to its end: one complete answer, which is honest.
        assert "abort" not in reasons, "vLLM's abort reached the client without a terminal frame"
        assert reasons == ["length"] and result.payloads()[-1] == "[DONE]"
        assert journal["phase"] == "completed", journal
        behaviour = "graceful drain -> complete answer"
    else:  # the dying server's reset: prefix, then a reset (no proxy can add an event to a reset stream)
        assert "abort" not in reasons, "vLLM's abort reached the client without a terminal frame"
        assert result.done_count() == 0
        assert journal["phase"] == "interrupted", journal
        behaviour = f"reset ({type(result.error).__name__}) -> interrupted"
    behaviour += f", {ended_after:.1f}s after SIGTERM" if ended_after is not None else ""
    print(f"\nreal_engine: SIGTERM mid-stream behaviour: {behaviour}")
    for replica in termed:
        replica.stop()
