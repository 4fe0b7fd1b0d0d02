"""Fallback to another model (issue 25), through real Envoy, etcd, replica agents and simulated replicas.

Two replicas serve model `tiny` (t1, t2), one serves `big`; each replica agent registers its engine's model.
A request for `tiny` whose own attempts all failed before content, or that has no replica of `tiny` it can
be sent to, gets one more attempt on `big`, whose request body names `big` (the simulator answers 404 to a
model it does not serve, so its 200 is the rewrite's proof); the answer is big's own, said out loud
(`x-router-fallback: big`, the journal's `fallback` record and `answered_by_fallback` event). Never after the
first delta, never when the request's retries are blocked, never for a cause the policy does not list, never
on a gateway without a fallback policy. The circuit breaker takes a replica that keeps failing out of every
order for a while, and with every replica of the model open the fallback answers at once.

Each check reads three witnesses: what the client got, the journal and the replicas' own logs.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.api_streams import PATHS, ApiStream
from tests.harness import Agent, ClientResult, Gateway, Sim, poll, post
from tests.integration.first_delta_helpers import TERMINAL_PHASES

pytestmark = pytest.mark.integration

FALLBACK_HEADER = "x-router-fallback"
ATTEMPTS = "x-router-attempts"
COST_CAP_TOKENS = 2000
FALLBACK_POLICY = f"""
fallback:
  models: [big]
  causes: [failed_before_content, overloaded, no_compatible_replica, unavailable]
  max_attempts: 1
reprefill_cost_cap:
  max_prompt_tokens: {COST_CAP_TOKENS}
"""
# The breaker's gateway falls back only when overloaded (429s) or unavailable (every circuit open).
OPEN_SECONDS, MAX_OPEN_SECONDS = 1, 4
BREAKER_POLICY = f"""
placement:
  breaker_failures: 2
  breaker_open_seconds: {OPEN_SECONDS}
  breaker_max_open_seconds: {MAX_OPEN_SECONDS}
fallback:
  models: [big]
  causes: [overloaded, unavailable]
"""
TINY = ("t1", "t2")


@dataclass
class Pool:
    sims: dict[str, Sim]
    agents: dict[str, Agent]
    fallback: Gateway  # fallback to big on every cause; a low re-prefill cost cap
    plain: Gateway  # no fallback policy at all
    breaker: Gateway  # the circuit breaker, and a fallback on overloaded/unavailable only

    @property
    def tiny(self) -> list[Sim]:
        return [self.sims[n] for n in TINY]

    @property
    def big(self) -> Sim:
        return self.sims["big"]


def _policy(work: Path, name: str, text: str) -> Path:
    path = work / f"{name}.yaml"
    path.write_text(text)
    return path


@pytest.fixture(scope="module")
def pool(etcd: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pool]:
    work: Path = tmp_path_factory.mktemp("fallback")
    (work / "tiny.yaml").write_text('weights_revision: "aaaa1111"\nblock_size: 16\n')
    (work / "big.yaml").write_text('weights_revision: "bbbb2222"\nblock_size: 16\n')
    sims: dict[str, Sim] = {}
    agents: dict[str, Agent] = {}
    gateways: list[Gateway] = []
    try:
        for name in TINY:
            sims[name] = Sim(name, work, prefill_delay=0.01)
        sims["big"] = Sim("big", work, prefill_delay=0.01, extra_args=("--model", "big"))
        for name, sim in sims.items():
            agents[name] = Agent(
                sim, etcd, work, fingerprint=work / f"{'big' if name == 'big' else 'tiny'}.yaml"
            )
        for name, text in (("fallback", FALLBACK_POLICY), ("plain", ""), ("breaker", BREAKER_POLICY)):
            gw_work = work / name
            gw_work.mkdir()
            gateways.append(
                Gateway(
                    replicas=[],
                    etcd=etcd,
                    work=gw_work,
                    config=_policy(gw_work, name, text) if text else None,
                )
            )
        for gw in gateways:
            gw.wait_replicas_healthy((s.endpoint for s in sims.values()), timeout=20)
        yield Pool(sims, agents, *gateways)
    finally:
        for gw in gateways:
            gw.stop()
        for agent in agents.values():
            agent.stop()
        for sim in sims.values():
            sim.stop()


# --- requests and witnesses ---------------------------------------------------------------------------------


def body(api: str = "chat", max_tokens: int = 3, prompt: str | None = None) -> dict[str, Any]:
    text = prompt or f"[{uuid.uuid4().hex}] Say something"
    if api == "chat":
        return {
            "model": "tiny",
            "stream": True,
            "max_tokens": max_tokens,
            "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": text}],
        }
    if api == "responses":
        return {"model": "tiny", "stream": True, "max_output_tokens": max_tokens, "input": text}
    return {
        "model": "tiny",
        "stream": True,
        "max_tokens": max_tokens,
        "messages": [{"role": "user", "content": text}],
    }


def ask(gw: Gateway, fault: str | None = None, api: str = "chat", **kw: Any) -> ClientResult:
    headers = {"x-sim-fault": fault} if fault else {}
    return post(gw.url + PATHS[api], body(api, **kw), headers=headers)


def finished(gw: Gateway, request_id: str) -> dict[str, Any]:
    return gw.wait_journal(request_id, lambda j: j["phase"] in TERMINAL_PHASES)


def served(pool: Pool, request_id: str, n: int) -> list[dict[str, Any]]:
    """The end records of the request's `n` attempts in the replicas' logs, in start order."""

    def logged() -> list[dict[str, Any]] | None:
        records = sorted(
            (r for s in pool.sims.values() for r in s.requests_for(request_id)), key=lambda r: r["t_start"]
        )
        return records if len(records) == n else None

    return poll(logged, what=f"{n} attempt(s) of {request_id} in the replica logs")


def error_of(result: ClientResult, status: int, code: str) -> dict[str, Any]:
    assert result.status == status, (result.status, result.body[:400])
    assert result.headers["content-type"] == "application/json"
    error = json.loads(result.body)["error"]
    assert (error["code"], error["request_id"]) == (code, result.request_id), error
    return error


def faulted_everywhere(fault: str, names: tuple[str, ...] = TINY) -> str:
    return f"{fault} replica={','.join(names)}"


def models_named(result: ClientResult) -> set[str]:
    """Every `model` the answer's events name (chat chunks, `response.model`, `message.model`)."""
    found: set[str] = set()

    def walk(value: Any) -> None:
        if isinstance(value, dict):
            for key, item in value.items():
                if key == "model" and isinstance(item, str):
                    found.add(item)
                walk(item)
        elif isinstance(value, list):
            for item in value:
                walk(item)

    for payload in result.data():
        walk(payload)
    return found


def assert_answered_by_big(pool: Pool, api: str, result: ClientResult, winner: dict[str, Any]) -> None:
    """One complete answer, big's own: its completion id, chunks naming model big, its usage."""
    assert (result.status, result.transport_error) == (200, None), (result.status, result.body[:400])
    assert result.headers["x-sim-replica"] == "big" and result.headers[FALLBACK_HEADER] == "big"
    assert (winner["replica"], winner["status"], winner["outcome"]) == ("big", 200, "completed"), winner
    assert models_named(result) == {"big"}
    assert b'"usage"' in result.body
    if api == "chat":
        data = result.data()
        assert data[-1] == "[DONE]" and data.count("[DONE]") == 1
        assert len(result.content_chunks()) == 3 and result.completion_ids() == {winner["response_id"]}
        assert data[-2]["usage"]["completion_tokens"] == 3
        return
    stream = ApiStream.read(api, result.body)  # type: ignore[arg-type]
    end = "response.completed" if api == "responses" else "message_stop"
    assert stream.names[-1] == end and stream.clean_ends == 1, stream.names
    assert len(stream.content) == 3 and set(stream.response_ids()) == {winner["response_id"]}


def fallback_event(journal: dict[str, Any]) -> dict[str, Any]:
    [event] = [e for e in journal["events"] if e["event"] == "answered_by_fallback"]
    return event


def no_fallback(pool: Pool, result: ClientResult, journal: dict[str, Any]) -> None:
    """Nothing of the request went to big, and nothing says it did."""
    assert pool.big.started_for(result.request_id) == 0
    assert FALLBACK_HEADER not in result.headers
    assert "fallback" not in journal
    assert not [e for e in journal["events"] if e["event"] == "answered_by_fallback"]
    assert all(not a["chosen_by"].startswith("fallback") for a in journal["attempts"])


def check_fallback_after_failures(
    pool: Pool, gw: Gateway, api: str, result: ClientResult, outcome: str, reason: str, cause: str
) -> None:
    """Both of tiny's attempts (max_attempts 2) failed before content, then big answered (cause `cause`)."""
    first, second, winner = served(pool, result.request_id, 3)
    assert {first["replica"], second["replica"]} == set(TINY)
    assert [first["outcome"], second["outcome"]] == [outcome, outcome]
    assert [first["content_events_written"], second["content_events_written"]] == [0, 0]
    assert_answered_by_big(pool, api, result, winner)
    assert result.headers[ATTEMPTS] == "3"

    journal = finished(gw, result.request_id)
    assert (journal["phase"], journal["outcome"], journal["model"]) == ("completed", "completed", "tiny")
    assert journal["delivered_output_tokens"] == 3
    endpoints = [pool.sims[r["replica"]].endpoint for r in (first, second, winner)]
    assert [(a["replica"], a["outcome"], a["chosen_by"]) for a in journal["attempts"]] == [
        (endpoints[0], "failed", "gateway choice #1"),
        (endpoints[1], "failed", "gateway choice #2"),
        (endpoints[2], "completed", "fallback to model big, choice #3"),
    ]
    assert journal["destinations"]["order"] == endpoints
    assert "excluded" not in journal["destinations"], journal["destinations"]
    causes = [f"attempt {n} on {endpoints[n - 1]}: {reason}" for n in (1, 2)]
    assert journal["fallback"] == {"model": "big", "requested_model": "tiny", "causes": causes}
    event = fallback_event(journal)
    assert (event["attempt"], event["model"], event["requested_model"], event["reason"]) == (
        3,
        "big",
        "tiny",
        cause,
    )
    assert event["detail"] == "; ".join(causes)
    # The fallback answered after the last of tiny's failures, and delivered the first content.
    names = [e["event"] for e in journal["events"]]
    assert (
        names.index("answered_by_fallback")
        > names.index("first_delta_sent")
        > max(i for i, n in enumerate(names) if n == "attempt_failed")
    )


# --- (1) every tiny replica fails before content: big answers, on every API ---------------------------------


@pytest.mark.parametrize("api", ["chat", "messages", "responses"])
def test_a_persistent_503_on_every_tiny_replica_is_answered_by_big(pool: Pool, api: str) -> None:
    """Both tiny replicas answer 503 (max_attempts 2 of tiny's), then big answers: its own answer (it would
    have answered 404 to a body naming tiny), said out loud in the header, the journal and its trace."""
    result = ask(pool.fallback, faulted_everywhere("status503@headers"), api=api)
    check_fallback_after_failures(
        pool, pool.fallback, api, result, "fault:status503", "upstream_status", "failed_before_content"
    )


# --- (2) every tiny replica overloaded ----------------------------------------------------------------------


def test_a_persistent_429_on_every_tiny_replica_is_answered_by_big_as_overloaded(pool: Pool) -> None:
    result = ask(pool.fallback, faulted_everywhere("status429@headers"))
    check_fallback_after_failures(
        pool, pool.fallback, "chat", result, "fault:status429", "replica_overloaded", "overloaded"
    )


# --- (4) never after the first delta ------------------------------------------------------------------------


@pytest.mark.parametrize("cut", ["close", "reset"])
def test_a_stream_cut_after_its_first_content_ends_as_always_and_never_falls_back(
    pool: Pool, cut: str
) -> None:
    """Every tiny replica cuts its stream after two content events: a clean close gets the terminal frame
    and `[DONE]`, a reset reaches the client as a reset; either way no attempt on big, no fallback record."""
    fault = "close@after:2" if cut == "close" else "delay@after:2 for=0.3; reset@after:2"
    result = ask(pool.fallback, faulted_everywhere(fault), max_tokens=6)
    assert result.status == 200 and result.headers[ATTEMPTS] == "1"
    assert len(result.content_chunks()) == 2 and models_named(result) == {"tiny"}
    data = result.data()
    if cut == "close":
        assert result.transport_error is None and data[-1] == "[DONE]" and data.count("[DONE]") == 1
        frame = data[-2]["error"]
        assert frame == {
            "code": "upstream_decode_interrupted",
            "message": frame["message"],
            "request_id": result.request_id,
            "partial_output": True,
            "delivered_output_tokens": 2,
            "retryable": False,
        }
    else:
        assert result.transport_error is not None and "[DONE]" not in data
        assert not [d for d in data if isinstance(d, dict) and "error" in d]
    [record] = served(pool, result.request_id, 1)
    assert record["replica"] in TINY and record["content_events_written"] == 2
    journal = finished(pool.fallback, result.request_id)
    assert (journal["phase"], journal["outcome"]) == ("interrupted", "upstream_decode_interrupted")
    assert (journal["first_delta_sent"], journal["delivered_output_tokens"]) == (True, 2)
    assert [a["replica"] for a in journal["attempts"]] == [pool.sims[record["replica"]].endpoint]
    no_fallback(pool, result, journal)


# --- (6) a request whose retries are blocked never falls back -----------------------------------------------


def test_a_request_over_the_reprefill_cost_cap_never_falls_back(pool: Pool) -> None:
    """Its retries are blocked (a prompt over reprefill_cost_cap.max_prompt_tokens): one attempt on tiny, its
    failure is the client's error, and big is not asked either."""
    prompt = f"[{uuid.uuid4().hex}] " + "tell me a long story " * (COST_CAP_TOKENS // 4)
    result = ask(pool.fallback, faulted_everywhere("status503@headers"), prompt=prompt)
    error = error_of(result, 502, "retry_not_allowed")
    assert f"exceeds the re-prefill cost cap ({COST_CAP_TOKENS})" in error["message"], error["message"]
    assert len(error["attempts"]) == 1 and result.headers[ATTEMPTS] == "1"
    [record] = served(pool, result.request_id, 1)
    assert record["replica"] in TINY and record["outcome"] == "fault:status503"
    journal = finished(pool.fallback, result.request_id)
    assert (journal["phase"], journal["outcome"]) == ("failed", "retry_not_allowed")
    assert journal["input"]["estimated_prompt_tokens"] > COST_CAP_TOKENS
    # Not even in its order: the fallback's entries are for requests that may be retried.
    assert pool.big.endpoint not in journal["destinations"]["order"]
    no_fallback(pool, result, journal)


# --- (7) without a fallback policy: exactly as before -------------------------------------------------------


def test_without_a_fallback_policy_the_same_failure_is_retries_exhausted_and_big_never_sees_it(
    pool: Pool,
) -> None:
    result = ask(pool.plain, faulted_everywhere("status503@headers"))
    error = error_of(result, 502, "retries_exhausted")
    assert len(error["attempts"]) == 2 and result.headers[ATTEMPTS] == "2"
    records = served(pool, result.request_id, 2)
    assert sorted(r["replica"] for r in records) == sorted(TINY)
    journal = finished(pool.plain, result.request_id)
    assert (journal["phase"], journal["outcome"]) == ("failed", "retries_exhausted")
    no_fallback(pool, result, journal)
    # big is left out of the order as another model's replica, as it always was
    assert pool.big.endpoint not in journal["destinations"]["order"]


# --- (5) a cause the policy does not list -------------------------------------------------------------------


def test_a_cause_the_policy_does_not_list_gets_the_requests_own_error(pool: Pool) -> None:
    """The breaker's gateway falls back only when overloaded or unavailable: two 503s (failed before content)
    are the client's `502 retries_exhausted`, as without a fallback; big is in the order but never asked."""
    gw = pool.breaker
    each_tiny_serves(gw, pool)
    result = ask(gw, faulted_everywhere("status503@headers"))
    error = error_of(result, 502, "retries_exhausted")
    assert len(error["attempts"]) == 2 and result.headers[ATTEMPTS] == "2"
    records = served(pool, result.request_id, 2)
    assert sorted(r["replica"] for r in records) == sorted(TINY)
    journal = finished(gw, result.request_id)
    assert (journal["phase"], journal["outcome"]) == ("failed", "retries_exhausted")
    assert journal["destinations"]["order"][-1] == pool.big.endpoint
    no_fallback(pool, result, journal)


# --- (8) the circuit breaker --------------------------------------------------------------------------------

CIRCUIT = re.compile(
    r"ejected for ([0-9.]+) s more: circuit open: (\d+) attempts in a row failed before content"
)


def excluded(journal: dict[str, Any]) -> dict[str, str]:
    return {x["replica"]: x["why"] for x in journal["destinations"].get("excluded", [])}


def circuit_open(journal: dict[str, Any], sim: Sim) -> tuple[float, int] | None:
    """(seconds left, failures in a row) when the request's order left `sim` out for its open circuit."""
    why = excluded(journal).get(sim.endpoint)
    if why is None:
        return None
    match = CIRCUIT.fullmatch(why)
    assert match is not None, why
    return float(match[1]), int(match[2])


def each_tiny_serves(gw: Gateway, pool: Pool) -> None:
    """Clean requests until each tiny replica has answered one: every circuit is closed again (a success
    closes it), whatever an earlier test left open."""
    served_by: set[str] = set()

    def both() -> bool:
        result = ask(gw)
        assert result.status == 200, result.body[:400]
        served_by.add(result.headers["x-sim-replica"])
        return set(TINY) <= served_by

    poll(both, timeout=MAX_OPEN_SECONDS + 10, what="each tiny replica to serve a request")


def accepted_at(journal: dict[str, Any]) -> float:
    return next(e["t"] for e in journal["events"] if e["event"] == "request_accepted")


def test_the_breaker_takes_a_replica_failing_every_request_out_of_the_order_and_tries_it_again_after(
    pool: Pool,
) -> None:
    """t1 answers 503 to every request (t2 serves them: no fallback needed). After breaker_failures (2) of
    t1's attempts failed in a row its circuit opens: it is out of every order ("circuit open") and its log
    stops growing; after breaker_open_seconds it is tried again, fails, and opens again at once for twice as
    long; a success closes it."""
    gw, t1 = pool.breaker, pool.sims["t1"]
    each_tiny_serves(gw, pool)
    fault = faulted_everywhere("status503@headers", ("t1",))

    failures: list[dict[str, Any]] = []  # t1's failed attempts, in order
    opened: tuple[ClientResult, dict[str, Any], tuple[float, int]] | None = None
    for _ in range(12):
        result = ask(gw, fault)
        assert (result.status, result.headers["x-sim-replica"]) == (200, "t2"), result.body[:400]
        assert FALLBACK_HEADER not in result.headers
        journal = finished(gw, result.request_id)
        state = circuit_open(journal, t1)
        if state is not None:
            opened = (result, journal, state)
            break
        failures += t1.requests_for(result.request_id)
        assert result.headers[ATTEMPTS] == str(1 + len(t1.requests_for(result.request_id)))
    assert opened is not None, "t1's circuit never opened"
    result, journal, (left, in_a_row) = opened
    assert [r["outcome"] for r in failures] == ["fault:status503"] * len(failures)
    # Opened by the second failure (or, had the first second lapsed unseen, reopened by the next one).
    assert in_a_row == len(failures) >= 2
    assert 0 < left <= OPEN_SECONDS * 2 ** (in_a_row - 2)
    assert t1.started_for(result.request_id) == 0
    assert journal["destinations"]["order"] == [pool.sims["t2"].endpoint, pool.big.endpoint]
    opened_at = failures[-1]["t_end"]

    # While open, no request touches it; once the time is up it is tried again (and fails: the fault stays).
    while_open: list[str] = [result.request_id]
    logged_before = len(t1.records())

    def tried_again() -> dict[str, Any] | None:
        probe = ask(gw, fault)
        assert probe.status == 200 and probe.headers["x-sim-replica"] == "t2"
        attempts = t1.requests_for(probe.request_id)
        if attempts:
            return attempts[0]
        if circuit_open(finished(gw, probe.request_id), t1) is not None:
            while_open.append(probe.request_id)
        return None

    again = poll(tried_again, timeout=MAX_OPEN_SECONDS + 8, what="t1 tried again")
    assert again["outcome"] == "fault:status503"
    assert again["t_start"] - opened_at >= OPEN_SECONDS * 2 ** (in_a_row - 2) * 0.95
    assert len(t1.records()) == logged_before + 2  # its start and end: none of while_open reached it
    assert all(t1.started_for(rid) == 0 for rid in while_open)

    # Its next failure opened it again at once, for twice as long.
    reopened = ask(gw, fault)
    state = circuit_open(finished(gw, reopened.request_id), t1)
    assert state is not None and state[1] == in_a_row + 1, state
    assert (
        OPEN_SECONDS * 2 ** (in_a_row - 2)
        < state[0]
        <= min(MAX_OPEN_SECONDS, OPEN_SECONDS * 2 ** (in_a_row - 1))
    )
    assert t1.started_for(reopened.request_id) == 0

    # Healthy again: back in the order once its time is up, and one success closes the circuit.
    each_tiny_serves(gw, pool)
    after = [ask(gw, fault) for _ in range(2)]  # round robin: one of them tries t1 first
    first_on_t1 = [r for r in after if t1.requests_for(r.request_id)]
    assert len(first_on_t1) >= 1
    for r in after:
        assert r.status == 200 and circuit_open(finished(gw, r.request_id), t1) is None


def test_with_every_tiny_circuit_open_requests_go_straight_to_big_until_tiny_recovers(pool: Pool) -> None:
    """Both tiny replicas answer 429 to every request. The first requests fall back after their attempts on
    tiny (cause overloaded); once both circuits are open, requests go straight to big (cause unavailable, no
    attempt on tiny): far fewer tiny attempts than requests. When tiny is healthy again, requests are back on
    it within moments of the circuits' time."""
    gw = pool.breaker
    each_tiny_serves(gw, pool)
    fault = faulted_everywhere("status429@headers")
    results = [ask(gw, fault) for _ in range(8)]

    tiny_attempts: list[int] = []
    straight: list[dict[str, Any]] = []
    for result in results:
        assert result.status == 200 and result.headers["x-sim-replica"] == "big", result.body[:400]
        assert result.headers[FALLBACK_HEADER] == "big" and models_named(result) == {"big"}
        journal = finished(gw, result.request_id)
        on_tiny = [r for s in pool.tiny for r in s.requests_for(result.request_id)]
        assert [r["outcome"] for r in on_tiny] == ["fault:status429"] * len(on_tiny)
        tiny_attempts.append(len(on_tiny))
        assert result.headers[ATTEMPTS] == str(len(on_tiny) + 1) == str(len(journal["attempts"]))
        assert journal["attempts"][-1]["replica"] == pool.big.endpoint
        assert journal["fallback"]["model"] == "big"
        if on_tiny:
            assert fallback_event(journal)["reason"] == "overloaded"
            continue
        # Straight to big: every tiny circuit open, the order holds big alone.
        straight.append(journal)
        assert journal["destinations"]["order"] == [pool.big.endpoint]
        assert all(circuit_open(journal, s) is not None for s in pool.tiny), excluded(journal)
        assert journal["fallback"] == {"model": "big", "requested_model": "tiny", "causes": ["unavailable"]}
        assert fallback_event(journal)["reason"] == "unavailable"
        assert journal["attempts"][0]["chosen_by"] == "fallback to model big, choice #1"
    assert tiny_attempts[:2] == [2, 2], tiny_attempts  # two failures each: both circuits open
    assert straight, tiny_attempts
    assert sum(tiny_attempts) < len(results), tiny_attempts

    # tiny recovers (the fault is gone): straight to big while the circuits are open, then tiny again.
    recovered: list[tuple[ClientResult, dict[str, Any]]] = []

    def back_on_tiny() -> bool:
        result = ask(gw)
        assert result.status == 200, result.body[:400]
        journal = finished(gw, result.request_id)
        if result.headers["x-sim-replica"] == "big":
            assert sum(s.started_for(result.request_id) for s in pool.tiny) == 0
            assert any(circuit_open(journal, s) is not None for s in pool.tiny)
            straight.append(journal)
            return False
        recovered.append((result, journal))
        return True

    poll(back_on_tiny, timeout=MAX_OPEN_SECONDS + 8, what="requests back on tiny")
    [(result, journal)] = recovered
    assert FALLBACK_HEADER not in result.headers and result.headers[ATTEMPTS] == "1"
    assert "fallback" not in journal and models_named(result) == {"tiny"}
    # Back as soon as the first circuit's time was up (not before), give or take a request's time.
    lapse = min(accepted_at(j) + min(circuit_open(j, s)[0] for s in pool.tiny) for j in straight)  # type: ignore[index]
    assert lapse - 0.1 <= accepted_at(journal) <= lapse + 3, (accepted_at(journal), lapse)


# --- (3) tiny's replicas all gone: unavailable --------------------------------------------------------------


def llm_hosts(gw: Gateway) -> set[str]:
    hosts = set()
    for line in gw.envoy_admin("/clusters").decode().splitlines():
        parts = line.split("::")
        if len(parts) == 4 and parts[0] == "llm" and parts[2] == "health_flags":
            hosts.add(parts[1])
    return hosts


def test_with_every_tiny_replica_gone_big_answers_as_unavailable(pool: Pool) -> None:
    """tiny's engines stop: their agents withdraw them from the registry. A request for tiny (a model the
    registry has served) is answered by big at once, cause unavailable; the gateway without a fallback says
    `404 model_not_found`, as it always did. When tiny's engines are back, tiny serves again."""
    tiny_endpoints = {s.endpoint for s in pool.tiny}
    for sim in pool.tiny:
        sim.stop()
    try:
        for gw in (pool.fallback, pool.plain):
            poll(lambda gw=gw: not llm_hosts(gw) & tiny_endpoints, timeout=15, what="tiny withdrawn")
        for api in ("chat", "messages"):
            result = ask(pool.fallback, api=api)
            [winner] = served(pool, result.request_id, 1)
            assert_answered_by_big(pool, api, result, winner)
            assert result.headers[ATTEMPTS] == "1"
            journal = finished(pool.fallback, result.request_id)
            assert (journal["phase"], journal["outcome"]) == ("completed", "completed")
            assert [(a["replica"], a["chosen_by"]) for a in journal["attempts"]] == [
                (pool.big.endpoint, "fallback to model big, choice #1")
            ]
            assert journal["destinations"]["order"] == [pool.big.endpoint]
            assert journal["fallback"] == {
                "model": "big",
                "requested_model": "tiny",
                "causes": ["unavailable"],
            }
            event = fallback_event(journal)
            assert (event["reason"], event["detail"], event["attempt"]) == ("unavailable", "unavailable", 1)

        plain = ask(pool.plain)
        error = error_of(plain, 404, "model_not_found")
        assert "no healthy replica serves model 'tiny'" in error["message"], error["message"]
        assert pool.big.started_for(plain.request_id) == 0 and FALLBACK_HEADER not in plain.headers
    finally:
        for sim in pool.tiny:
            sim.ensure_running()
        for gw in (pool.fallback, pool.plain, pool.breaker):
            gw.wait_replicas_healthy((s.endpoint for s in pool.sims.values()), timeout=20)
    back = ask(pool.fallback)
    assert back.status == 200 and back.headers["x-sim-replica"] in TINY
    assert FALLBACK_HEADER not in back.headers
