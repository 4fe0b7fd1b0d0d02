"""Two real vLLM replicas behind the gateway on the Responses API (`POST /v1/responses`) and the Messages API
(`POST /v1/messages`), streamed: a clean stream passes through unchanged, a client that leaves aborts the
request in vLLM, a replica killed before the first content is retried invisibly on the other one, and after
the first content the client gets the prefix then a reset or exactly one terminal event in the API's shape
(tests/real_engine/apis.py has the checks). Stored responses: a follow-up (`previous_response_id`) lands on
the replica that holds the response, and with that replica killed the client is told so (503
`stored_response_unavailable`), not given the other replica's 404.

The tier's two replicas, restarted once (both at once) for this module with vLLM's Responses store on
(`VLLM_ENABLE_RESPONSES_API_STORE=1`, vllm/envs.py; without it vLLM keeps nothing and any follow-up is its own
404). The module runs after test_vllm_gateway.py (file order), whose last test leaves a replica stopped, so
one of the two starts was due anyway. Then the non-destructive tests; the worker of a killed before the first
content (a started again in the background); the holder killed (b, the one serving meanwhile); after the first
content, a Responses and a Messages stream at once on the replica standing: its worker killed (the other one
started again meanwhile), then the last one frozen. Three rounds of starts: at the module's start, a and b
overlapping, and the second test after the first content waiting for its replica.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from tests.harness import Gateway, poll
from tests.real_engine.apis import (
    STREAM,
    WHOLE,
    assert_completed,
    assert_prefix_then_reset_or_terminal_event,
    direct_events,
    leave_after,
    normalized,
    reference_body,
    sdk_content,
    stream_responses,
)
from tests.real_engine.client import Streamed, named_events
from tests.real_engine.conftest import RESTART_TIMEOUT, TierVllmReplica
from tests.real_engine.tier import (
    AUTH,
    Landed,
    Together,
    frozen_mid_stream,
    gateway_to,
    replica_of,
    results_of,
    serving_attempt,
    start_together,
    stopped,
    stream_until_routed_to,
    terminal_journal,
    wait_restarted,
)

APIS = ["responses", "messages"]
STORE = {"VLLM_ENABLE_RESPONSES_API_STORE": "1"}
# Greedy, so that two runs of a request give the same text (the clean tests compare the gateway's stream with
# vLLM's own), and the long ones run to their limit; on the Responses API vLLM also takes `ignore_eos` (its
# Messages API does not: the tiny model's greedy text for this prompt reaches max_tokens, measured).
GREEDY = {"responses": {"temperature": 0, "ignore_eos": True}, "messages": {"temperature": 0}}
LONG = 1000


@pytest.fixture(scope="module")
def store_on(replicas: dict[str, TierVllmReplica]) -> Iterator[dict[str, TierVllmReplica]]:
    """The tier's replicas with vLLM's Responses store on for this module: each one running without it (or
    not running) is started again with it, all at once. Later starts go without it again."""
    t0 = time.monotonic()
    for replica in replicas.values():
        replica.env_extra = dict(STORE)
    stale = [r for r in replicas.values() if not r.healthy() or r.started_with != STORE]
    for replica in stale:
        replica.stop()
        replica.start(wait=False)
    for replica in stale:
        wait_restarted(replica, RESTART_TIMEOUT)
    if stale:
        names = ", ".join(r.name for r in stale)
        print(f"\nreal_engine: vLLM {names} started with the Responses store in {time.monotonic() - t0:.1f}s")
    try:
        yield replicas
    finally:
        for replica in replicas.values():
            replica.env_extra = {}


@pytest.fixture(scope="module")
def gateway(
    etcd: str, store_on: dict[str, TierVllmReplica], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Gateway]:
    """The module's gateway, started once the replicas run with the store."""
    with gateway_to(store_on, etcd, tmp_path_factory.mktemp("gateway")) as gw:
        yield gw


@pytest.fixture
def up(store_on: dict[str, TierVllmReplica], gateway: Gateway) -> dict[str, TierVllmReplica]:
    """Both replicas healthy with the store (those a test killed started again, or still starting waited
    for), and Envoy routing to both again."""
    replicas = store_on
    for replica in replicas.values():
        if not replica.alive():
            replica.stop()
            replica.start(wait=False)
    waited = [r for r in replicas.values() if not r.healthy()]
    for replica in waited:
        took = wait_restarted(replica, RESTART_TIMEOUT)
        print(f"\nreal_engine: vLLM {replica.name} ready {took:.1f}s after its start")
    gateway.wait_replicas_healthy([r.endpoint for r in replicas.values()], fresh=bool(waited), timeout=30)
    return replicas


def other_than(replicas: dict[str, TierVllmReplica], one: TierVllmReplica) -> TierVllmReplica:
    return next(r for r in replicas.values() if r is not one)


def by_endpoint(replicas: dict[str, TierVllmReplica], endpoint: str) -> TierVllmReplica:
    return next(r for r in replicas.values() if r.endpoint == endpoint)


def created_id(result: Streamed) -> str:
    return str(named_events(result.raw)[0].data["response"]["id"])


def vllm_request_id(api: str, result: Streamed) -> str:
    """vLLM's own id of the request (its log's `Received request <id>`): the response id + `_0` on the
    Responses API; `chatcmpl-` + the X-Request-Id the gateway sent (its request id) on the Messages API."""
    return f"{created_id(result)}_0" if api == "responses" else f"chatcmpl-{result.request_id}"


# --------------------------------------------------------------------------- pass-through


@pytest.mark.parametrize("api", APIS)
def test_clean_stream_passes_through_unchanged(
    api: str, gateway: Gateway, up: dict[str, TierVllmReplica]
) -> None:
    max_tokens = 24
    result = STREAM[api](gateway.url, max_tokens=max_tokens, body=GREEDY[api])
    events, output_tokens = WHOLE[api](result)
    assert output_tokens == max_tokens
    # The same request straight to vLLM: event for event the same (ids, timestamps and sequence numbers
    # aside, and how the text was cut into deltas), the same greedy text.
    reference = direct_events(next(iter(up.values())).url, api, reference_body(api, max_tokens, GREEDY[api]))
    got, want = normalized(api, events), normalized(api, reference)
    assert got[1] == want[1], "not vLLM's text"
    assert got[0] == want[0]
    journal = assert_completed(gateway, result.request_id, output_tokens)
    if api == "responses":  # the store is on: the gateway records which replica holds the response
        assert journal["stored_response"] == {
            "id": created_id(result),
            "replica": serving_attempt(journal)["replica"],
        }
    else:  # the anthropic SDK reads the request id from `request-id`
        assert result.headers["request-id"] == result.request_id
        assert "stored_response" not in journal


def test_a_follow_up_lands_on_the_replica_holding_its_previous_response(
    gateway: Gateway, up: dict[str, TierVllmReplica]
) -> None:
    first = stream_responses(gateway.url, max_tokens=8, body=GREEDY["responses"])
    WHOLE["responses"](first)
    journal = assert_completed(gateway, first.request_id, 8)
    response_id, holder = (
        journal["stored_response"]["id"],
        by_endpoint(up, journal["stored_response"]["replica"]),
    )
    other = other_than(up, holder)
    # What the gateway keeps the client from: the other replica does not have it (vLLM's own 404).
    elsewhere = httpx.post(
        f"{other.url}/v1/responses",
        json={
            "model": "tiny",
            "input": "And then?",
            "max_output_tokens": 4,
            "previous_response_id": response_id,
        },
        timeout=30,
    )
    assert elsewhere.status_code == 404 and response_id in elsewhere.json()["error"]["message"], (
        elsewhere.text
    )
    # Four turns, each continuing the last: round robin would have sent every other one to the other replica.
    for _ in range(4):
        result = stream_responses(
            gateway.url, max_tokens=8, body={**GREEDY["responses"], "previous_response_id": response_id}
        )
        events, output_tokens = WHOLE["responses"](result)
        assert events[0].data["response"]["previous_response_id"] == response_id
        journal = assert_completed(gateway, result.request_id, output_tokens)
        assert journal["destinations"] == {"source": "holder", "order": [holder.endpoint]}, journal
        assert [(a["replica"], a["chosen_by"]) for a in journal["attempts"]] == [
            (holder.endpoint, "holder of the stored response it continues")
        ]
        # vLLM's own log: the turn was served there, never on the other replica.
        own = vllm_request_id("responses", result)
        assert own in holder.received_request_ids() and own not in other.received_request_ids()
        response_id = created_id(result)
        assert journal["stored_response"] == {"id": response_id, "replica": holder.endpoint}
    # Retrieval goes to the holder as well.
    for _ in range(2):
        got = httpx.get(f"{gateway.url}/v1/responses/{response_id}", headers=AUTH, timeout=30)
        assert got.status_code == 200 and got.json()["id"] == response_id, got.text
    print(f"\nreal_engine: 4 follow-ups and 2 retrievals all on the holder {holder.name}")


# --------------------------------------------------------------------------- client gone


@pytest.mark.parametrize("api", APIS)
@pytest.mark.xfail(
    strict=False,
    reason="seen once in CI 2026-12-04 on a busy machine: vLLM had not logged the Responses request's abort "
    "45 s after the client left (the gateway's journal said cancelled); not reproduced since",
)
def test_client_disconnect_aborts_the_request_in_vllm(
    api: str, gateway: Gateway, up: dict[str, TierVllmReplica]
) -> None:
    # A client starved of CPU may read its third delta only after the whole answer went out: then the request
    # simply completed. Not this test's case: again, a bounded number of times.
    for _ in range(3):
        received_before = {n: len(r.received_request_ids()) for n, r in up.items()}
        result = STREAM[api](gateway.url, max_tokens=LONG, on_event=leave_after(api, 3), body=GREEDY[api])
        assert result.error is None and result.request_id, repr(result.error)
        journal = terminal_journal(gateway, result.request_id)
        if journal["phase"] != "completed":
            break
        print("\nreal_engine: the whole answer went out before the client left; running the scenario again")
    assert journal["phase"] == "cancelled", journal
    serving_attempt(journal)
    served = replica_of(gateway, result.request_id, up)
    assert served is not None
    own = vllm_request_id(api, result)
    # vLLM logs the abort when its API server notices the closed connection: seconds on a busy machine.
    poll(
        lambda: own in served.aborted_request_ids(),
        timeout=45,
        what=f"vLLM {served.name} to log {own} aborted",
    )
    received = {n: r.received_request_ids()[received_before[n] :] for n, r in up.items()}
    assert own in received[served.name]
    assert sum(len(ids) for ids in received.values()) <= len(journal["attempts"]), received


# --------------------------------------------------------------------------- before the first content


def test_worker_killed_before_first_content_both_apis_are_retried_on_the_other_replica(
    gateway: Gateway, up: dict[str, TierVllmReplica]
) -> None:
    """The engine worker of replica a frozen, one Responses and one Messages stream waiting on it, then the
    worker SIGKILLed: vLLM fails them before any content (its Responses stream had already sent
    `response.created` and `response.in_progress`, held by the gateway) and the gateway retries both on b.
    Each client gets one complete stream: b's preamble only, one id, sequence numbers from 0."""
    victim, other = up["a"], up["b"]
    worker = victim.engine_worker_pid()
    assert worker is not None, f"no engine worker under {victim.name}: {victim.engine_pids()}"
    max_tokens = 32
    landed: dict[str, Landed] = {}
    held: dict[str, str] = {}  # api -> vLLM's id of the attempt on the victim
    with stopped(worker):
        for api in APIS:
            before = len(victim.received_request_ids())

            def start(headers: dict[str, str], api: str = api) -> Streamed:
                return STREAM[api](gateway.url, max_tokens=max_tokens, headers=headers, body=GREEDY[api])

            got = stream_until_routed_to(
                victim, gateway, up, max_tokens=max_tokens, id_prefix=api, join=30, start=start
            )
            assert got, f"no {api} request was routed to the frozen replica"
            landed[api] = got
            ids = poll(
                lambda before=before: victim.received_request_ids()[before:],
                timeout=10,
                what=f"vLLM {victim.name} to receive the {api} request",
            )
            held[api] = ids[-1]
        # Both wait on the frozen worker: nothing can have been delivered yet.
        assert all(t.thread.is_alive() for t in landed.values())
        os.kill(worker, signal.SIGKILL)
    for api, one in landed.items():
        one.thread.join(60)
        assert not one.thread.is_alive(), f"the {api} client never finished"
        result: Streamed = one.box["r"]
        assert result.request_id == one.request_id
        events, output_tokens = WHOLE[api](result)
        assert output_tokens == max_tokens
        journal = terminal_journal(gateway, result.request_id)
        attempts = journal["attempts"]
        assert journal["phase"] == "completed" and len(attempts) == 2, journal
        assert attempts[0]["replica"] == victim.endpoint and attempts[0]["outcome"] == "failed", attempts
        assert attempts[1]["replica"] == other.endpoint and attempts[1]["outcome"] == "completed", attempts
        assert journal["delivered_output_tokens"] == output_tokens
        own = vllm_request_id(api, result)
        assert own in other.received_request_ids()
        if api == "responses":  # the victim's response.created (its own resp_ id) never reached the client
            assert held[api] != own, (held, own)
        else:  # vLLM names a message after the X-Request-Id: the same on both attempts, one message_start
            assert held[api] == own
        print(
            f"\nreal_engine: {api}: vLLM worker killed before content -> retried on {other.name} "
            f"(first attempt: {attempts[0]['detail']}); {len(events)} events, one preamble"
        )
    # vLLM exits once its worker is gone; start it again in the background.
    poll(lambda: not victim.healthy(), timeout=15, what=f"{victim.name} to go down")
    victim.stop()
    victim.start(wait=False)


# --------------------------------------------------------------------------- the holder killed


def test_with_the_holder_killed_a_follow_up_is_told_so_not_given_a_404(
    gateway: Gateway, store_on: dict[str, TierVllmReplica]
) -> None:
    """No waiting for the replica the previous test restarts: the stored response is made on whichever
    replica serves, and that one is killed."""
    replicas = store_on
    poll(lambda: any(r.healthy() for r in replicas.values()), timeout=60, what="a healthy replica")
    first = stream_responses(gateway.url, max_tokens=8, body=GREEDY["responses"])
    WHOLE["responses"](first)
    journal = assert_completed(gateway, first.request_id, 8)
    response_id, holder = (
        journal["stored_response"]["id"],
        by_endpoint(replicas, journal["stored_response"]["replica"]),
    )
    holder.kill_group()
    killed_at = time.monotonic()
    answers: list[tuple[float, int, dict[str, Any]]] = []

    def follow_up() -> dict[str, Any] | None:
        result = stream_responses(
            gateway.url, max_tokens=8, body={**GREEDY["responses"], "previous_response_id": response_id}
        )
        try:
            body = json.loads(result.raw)
        except ValueError:
            body = {"raw": result.raw[:300].decode(errors="replace")}
        answers.append((time.monotonic() - killed_at, result.status, body))
        assert result.status != 200 and result.status != 404, (result.status, result.raw[:500])
        if result.status == 503 and body.get("error", {}).get("code") == "stored_response_unavailable":
            assert isinstance(result.error, openai.InternalServerError)
            assert result.error.code == "stored_response_unavailable"
            return dict(body["error"])
        return None

    # Until the gateway's probe has found the holder lost (2 failed probes, 1 s apart), a follow-up still
    # goes to it and fails at its connection ("could not be reached"); after, it is refused before any
    # attempt.
    error = poll(follow_up, timeout=20, what="a follow-up refused as stored_response_unavailable")
    assert response_id in error["message"] and holder.endpoint in error["message"], error
    refused = poll(
        lambda: (e := follow_up()) is not None and "failing its health checks" in e["message"] and e,
        timeout=20,
        what="the holder known as failing its health checks",
    )
    assert refused
    got = httpx.get(f"{gateway.url}/v1/responses/{response_id}", headers=AUTH, timeout=30)
    assert got.status_code == 503 and got.json()["error"]["code"] == "stored_response_unavailable", got.text
    seen = [(round(t, 1), status, body.get("error", {}).get("code")) for t, status, body in answers]
    print(f"\nreal_engine: follow-ups after the holder {holder.name} was killed: {seen}")
    print(f"real_engine: the first answer: {json.dumps(answers[0][2])}")
    HOLDER_KILLED.update(first=answers[0], response_id=response_id, holder=holder.endpoint)
    holder.stop()  # started again by the next test, after the other one is up (its streams go there)


HOLDER_KILLED: dict[
    str, Any
] = {}  # what the holder test saw: its first follow-up (seconds after the kill, ...)


def test_the_first_follow_up_after_the_holder_died_is_already_told_where_its_response_is() -> None:
    if not HOLDER_KILLED:
        pytest.skip("the holder test did not run to its end")
    after, status, body = HOLDER_KILLED["first"]
    assert after < 1.0, f"sent {after:.1f}s after the kill: not before the probe could have found it lost"
    assert status == 503 and body["error"]["code"] == "stored_response_unavailable", body
    message = body["error"]["message"]
    assert HOLDER_KILLED["response_id"] in message and HOLDER_KILLED["holder"] in message, message


# --------------------------------------------------------------------------- after the first content


def kill_worker(replica: TierVllmReplica) -> None:
    worker = replica.engine_worker_pid()
    assert worker is not None, replica.engine_pids()
    os.kill(worker, signal.SIGKILL)


def standing(
    replicas: dict[str, TierVllmReplica], gateway: Gateway, *, restart_others: bool
) -> list[TierVllmReplica]:
    """The replicas up (at least one, waited for; Envoy routing to them); with `restart_others` the ones not
    running are started again in the background, for a later test. The streams of the test go to the ones
    standing now."""
    poll(lambda: any(r.healthy() for r in replicas.values()), timeout=RESTART_TIMEOUT, what="a replica up")
    live = [r for r in replicas.values() if r.healthy()]
    gateway.wait_replicas_healthy([r.endpoint for r in live], timeout=30)
    for replica in replicas.values():
        if restart_others and not replica.alive():
            replica.stop()
            replica.start(wait=False)
    return live


def both_apis_together(
    gateway: Gateway, replicas: dict[str, TierVllmReplica], id_prefix: str
) -> Together[Any]:
    """A long Responses stream and a long Messages stream, started at once."""

    def start(api: str) -> Any:
        return lambda headers, on_event: STREAM[api](
            gateway.url,
            max_tokens=LONG,
            headers=headers,
            on_event=on_event,
            read_timeout=60,
            body=GREEDY[api],
        )

    return start_together(
        gateway,
        replicas,
        {api: start(api) for api in APIS},
        {api: sdk_content(api) for api in APIS},
        id_prefix=id_prefix,
    )


@pytest.mark.xfail(
    strict=False,
    reason="timing race on a busy 2-core machine, seen in CI 2026-12-04: the tiny model answers a whole "
    "1000-token stream before the later stream's first content is released, so the freeze lands too late "
    "(3 tries); the behaviour itself passes in other runs (docs/real-engine.md)",
)
def test_worker_killed_after_first_content_gives_prefix_then_reset_or_one_terminal_event(
    gateway: Gateway, store_on: dict[str, TierVllmReplica]
) -> None:
    """A Responses and a Messages stream at once, on the replica standing (the other is restarted for the next
    test); once the gateway has released the first content of both, every replica frozen, the serving
    engine worker SIGKILLed and the replica thawed: vLLM's Responses stream is cut (its GenerationError
    frame fails its own validation), its Messages stream ends with vLLM's own `event: error`, which the
    gateway replaces by its terminal event."""
    replicas = store_on
    standing(replicas, gateway, restart_others=True)
    together, served = frozen_mid_stream(lambda: both_apis_together(gateway, replicas, "killed"))
    killed = list(dict.fromkeys(served.values()))
    for replica in killed:
        kill_worker(replica)
    for replica in replicas.values():
        replica.signal_group(signal.SIGCONT)
    results = results_of(together)
    seen: dict[str, str] = {}
    for api, result in results.items():
        journal, event, client_count = assert_prefix_then_reset_or_terminal_event(api, gateway, result)
        assert serving_attempt(journal)["replica"] == served[api].endpoint, journal
        what = (
            f"terminal event {json.dumps(event)[:300]}" if event else f"reset ({type(result.error).__name__})"
        )
        seen[api] = (
            f"{what} after {client_count} content events, journal {journal['delivered_output_tokens']}"
        )
    names = ", ".join(r.name for r in killed)
    print(f"\nreal_engine: vLLM {names} worker killed after the first content: {json.dumps(seen, indent=1)}")
    for replica in killed:
        poll(lambda r=replica: not r.healthy(), timeout=15, what=f"vLLM {replica.name} to go down")


@pytest.mark.xfail(
    strict=False,
    reason="timing race on a busy 2-core machine, seen in CI 2026-12-04: the tiny model answers a whole "
    "1000-token stream before the later stream's first content is released, so the freeze lands too late "
    "(3 tries); the behaviour itself passes in other runs (docs/real-engine.md)",
)
def test_frozen_after_first_content_ends_with_one_terminal_event_in_the_apis_shape(
    gateway: Gateway, store_on: dict[str, TierVllmReplica]
) -> None:
    """A Responses and a Messages stream at once, on the replica standing; once the gateway has released the
    first content of both, the serving replica stays frozen whole (SIGSTOP): the gateway's probe finds it
    lost and ends each stream with exactly one terminal event of its own, in the API's shape, within a bounded
    time. The frozen replica is stopped here (nothing after this test needs it)."""
    replicas = store_on
    standing(replicas, gateway, restart_others=False)
    together, served = frozen_mid_stream(lambda: both_apis_together(gateway, replicas, "frozen"))
    frozen = list(dict.fromkeys(served.values()))
    frozen_at = time.monotonic()
    try:
        for replica in replicas.values():
            if replica not in frozen:
                replica.signal_group(signal.SIGCONT)
        results = results_of(together)
        for api, result in results.items():
            ended_after = together.streams[api].box["ended"] - frozen_at
            journal, event, client_count = assert_prefix_then_reset_or_terminal_event(api, gateway, result)
            assert event is not None, f"a frozen replica's {api} stream was cut, not ended: {result.error!r}"
            error = event["response"]["error"] if api == "responses" else event["error"]
            assert "health check" in error["message"], error
            assert ended_after < 15, f"the {api} terminal event came {ended_after:.1f}s after the freeze"
            assert serving_attempt(journal)["replica"] == served[api].endpoint, journal
            print(
                f"\nreal_engine: {api}: frozen vLLM {served[api].name} after {client_count} content events "
                f"-> one terminal event {ended_after:.1f}s after the freeze: {json.dumps(event)[:400]}"
            )
    finally:
        for replica in frozen:
            replica.signal_group(signal.SIGCONT)
            replica.stop()
