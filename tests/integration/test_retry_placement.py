"""Retries that land well (issue 24), through real Envoy, etcd, the testbed's endpoint picker and simulated
replicas: a retry goes to the replica warm for the prompt's prefix, then to the least loaded; a replica that
answered 429 with `Retry-After` is left out of every order (first placement too) until that lapses, and when
every replica is out the client gets `429 replicas_overloaded` with no attempt made; a tenant may hold only
its own share of requests in retry; `no_compatible_replica` names the difference in the journal; and every
response says how many attempts reached a replica (`x-router-attempts`).

Each check reads three witnesses: what the client got (bytes, status, headers), the journal
(`GET /v1/requests/{id}`: `destinations.order`, `ranked`, `excluded`, each attempt's `chosen_by`, the
`retry_refused` event) and the replicas' own logs of what they served.

The picker's list is steered per request (`test-epp-endpoint-selection`): with one entry, the order is that
replica, then the ones the gateway ranked. Every test uses prompts of its own (a fresh tag at their start), so
that no replica is warm for them by an earlier test.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import socket
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Literal

import pytest

from tests.api_streams import PATHS, ApiStream
from tests.harness import Agent, ClientResult, Gateway, Sim, poll, post, sim_pool, with_credential
from tests.integration.epp_helpers import PickerProcess
from tests.integration.first_delta_helpers import TERMINAL_PHASES

pytestmark = pytest.mark.integration

Api = Literal["chat", "completions", "responses", "messages"]

SELECT = "test-epp-endpoint-selection"  # the testbed picker lists exactly these endpoints
PICKER_SERVED = "x-conformance-test-served-endpoint"  # the testbed picker's own response header (a test aid)
ATTEMPTS = "x-router-attempts"
MAX_RETRY_AFTER = 4  # the picker gateway's placement.max_retry_after_seconds
PICKER_POLICY = f"""
placement:
  max_retry_after_seconds: {MAX_RETRY_AFTER}
"""
# A tenant may have one request in retry at once, whatever its load; Envoy's budget for the whole gateway is
# far above what the test sends, so every refusal is the tenant's.
TENANT_POLICY = """
budgets:
  retry_budget_percent: 100
  min_retry_concurrency: 50
  tenant_retry_budget_percent: 0
  tenant_min_retry_concurrency: 1
"""


# --- fixtures -----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sims(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Sim]]:
    with sim_pool(tmp_path_factory.mktemp("sims"), ("a", "b", "c"), prefill_delay=0.01) as pool:
        yield pool


@pytest.fixture(scope="module")
def picker(sims: dict[str, Sim], tmp_path_factory: pytest.TempPathFactory) -> Iterator[PickerProcess]:
    process = PickerProcess(tmp_path_factory.mktemp("picker"), [s.endpoint for s in sims.values()])
    try:
        yield process
    finally:
        process.stop()


def policy_file(work: Path, text: str) -> Path:
    path = work / "policy.yaml"
    path.write_text(text)
    return path


@pytest.fixture(scope="module")
def gateway(
    etcd: str, sims: dict[str, Sim], picker: PickerProcess, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Gateway]:
    """The gateway behind the picker (named `gateway`: conftest's autouse fixture keeps its replicas up)."""
    work = tmp_path_factory.mktemp("gateway")
    gw = Gateway(
        replicas=[s.endpoint for s in sims.values()],
        etcd=etcd,
        work=work,
        config=policy_file(work, PICKER_POLICY),
        extra_args=("--endpoint-picker", f"127.0.0.1:{picker.port}"),
    )
    try:
        yield gw
    finally:
        gw.stop()


@pytest.fixture(scope="module")
def tenant_gateway(
    etcd: str, sims: dict[str, Sim], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Gateway]:
    """A gateway of its own over the same replicas (no picker) with the tight tenant budget."""
    work = tmp_path_factory.mktemp("tenant-gateway")
    gw = Gateway(
        replicas=[s.endpoint for s in sims.values()],
        etcd=etcd,
        work=work,
        config=policy_file(work, TENANT_POLICY),
    )
    try:
        gw.wait_replicas_healthy(s.endpoint for s in sims.values())
        yield gw
    finally:
        gw.stop()


@pytest.fixture(autouse=True)
def _nothing_ejected(request: pytest.FixtureRequest) -> None:
    """Every test on the picker gateway starts with no replica left out of the order (a test that failed
    half-way may have left one ejected until its Retry-After lapses)."""
    if "gateway" in request.fixturenames:
        wait_every_replica_placed(request.getfixturevalue("gateway"), request.getfixturevalue("sims"))


# --- requests -----------------------------------------------------------------------------------------------


def shared_text(size: int = 900) -> str:
    """A prompt part of its own (a fresh tag first), `size` bytes: several 256-byte blocks."""
    text = f"[{uuid.uuid4().hex}] You are a careful assistant." + "".join(
        f" Rule {i}: answer plainly." for i in range(size // 20)
    )
    return text[:size]


def prompt_body(api: Api, shared: str, own: str = "Say something", max_tokens: int = 3) -> dict[str, Any]:
    """A streamed request of `api` whose prompt starts with `shared` (the system part) and ends with `own`."""
    if api == "chat":
        messages = [{"role": "system", "content": shared}, {"role": "user", "content": own}]
        return {"model": "tiny", "stream": True, "max_tokens": max_tokens, "messages": messages}
    if api == "completions":
        return {"model": "tiny", "stream": True, "max_tokens": max_tokens, "prompt": f"{shared}\n{own}"}
    if api == "responses":
        return {
            "model": "tiny",
            "stream": True,
            "max_output_tokens": max_tokens,
            "instructions": shared,
            "input": own,
        }
    messages = [{"role": "user", "content": own}]
    return {"model": "tiny", "stream": True, "max_tokens": max_tokens, "system": shared, "messages": messages}


def ask(
    gateway: Gateway,
    body: dict[str, Any],
    *,
    api: Api = "chat",
    select: Sim | None = None,
    fault: str | None = None,
    headers: dict[str, str] | None = None,
) -> ClientResult:
    sent = dict(headers or {})
    if select is not None:
        sent[SELECT] = select.endpoint
    if fault is not None:
        sent["x-sim-fault"] = fault
    return post(gateway.url + PATHS[api], body, headers=sent)


def finished(gateway: Gateway, request_id: str, credential: dict[str, str] | None = None) -> dict[str, Any]:
    return gateway.wait_journal(request_id, lambda j: j["phase"] in TERMINAL_PHASES, headers=credential)


def served_on(sims: dict[str, Sim], request_id: str, n: int) -> list[dict[str, Any]]:
    """The end records of the request's `n` attempts in the replicas' own logs, in start order."""

    def logged() -> list[dict[str, Any]] | None:
        records = sorted(
            (r for s in sims.values() for r in s.requests_for(request_id)), key=lambda r: r["t_start"]
        )
        return records if len(records) == n else None

    return poll(logged, what=f"{n} attempt(s) of {request_id} in the replica logs")


def unseen(sims: dict[str, Sim], request_id: str) -> None:
    assert {s.name: s.started_for(request_id) for s in sims.values()} == {s: 0 for s in sims}


def attempts_header(result: ClientResult, n: int, sims: dict[str, Sim]) -> None:
    """`x-router-attempts: n`, and no replica's address in any header the gateway wrote."""
    assert result.headers.get(ATTEMPTS) == str(n), (result.status, result.headers)
    addresses = {s.endpoint for s in sims.values()}
    leaked = {
        k: v for k, v in result.headers.items() if k != PICKER_SERVED and any(a in v for a in addresses)
    }
    assert leaked == {}, leaked


def assert_answer(api: Api, result: ClientResult, winner: dict[str, Any], tokens: int = 3) -> None:
    """One complete answer, and it is the winning attempt's (the id its replica gave it, its name)."""
    assert (result.status, result.transport_error) == (200, None), (result.status, result.body[:400])
    assert result.headers["x-sim-replica"] == winner["replica"]
    assert winner["outcome"] == "completed", winner
    if api in ("chat", "completions"):
        data = result.data()
        assert data[-1] == "[DONE]" and data.count("[DONE]") == 1
        assert len(result.content_chunks()) == tokens
        assert result.completion_ids() == {winner["response_id"]}
        return
    stream = ApiStream.read(api, result.body)
    end = "response.completed" if api == "responses" else "message_stop"
    assert stream.names[-1] == end and stream.clean_ends == 1, stream.names
    assert len(stream.content) == tokens
    assert set(stream.response_ids()) == {winner["response_id"]}


def error_of(result: ClientResult, status: int, code: str) -> dict[str, Any]:
    """Our JSON error (OpenAI shape), naming the request; its error object."""
    assert result.status == status, (result.status, result.body[:400])
    assert result.headers["content-type"] == "application/json"
    error = json.loads(result.body)["error"]
    assert (error["code"], error["request_id"]) == (code, result.request_id), error
    return error


def chosen(journal: dict[str, Any]) -> list[tuple[str, str]]:
    return [(a["replica"], a["chosen_by"]) for a in journal["attempts"]]


def ranked_choice(n: int, warm: int, blocks: int, in_flight: int = 0) -> str:
    return f"gateway choice #{n} (warm prefix {warm} of {blocks} blocks, {in_flight} in flight)"


def excluded(journal: dict[str, Any]) -> dict[str, str]:
    return {x["replica"]: x["why"] for x in journal["destinations"].get("excluded", [])}


def assert_ejected(why: str | None) -> None:
    assert why is not None and why.startswith("ejected") and "Retry-After" in why, why


def wait_every_replica_placed(gateway: Gateway, sims: dict[str, Sim], timeout: float = 15.0) -> float:
    """Until a request's order holds every replica again (no ejection left): returns when it was answered."""

    def placed() -> float | None:
        result = post(f"{gateway.url}/v1/chat/completions", prompt_body("chat", shared_text(300)))
        if result.status != 200:
            error_of(result, 429, "replicas_overloaded")  # every replica still out
            return None
        journal = finished(gateway, result.request_id)
        if journal["destinations"].get("excluded"):
            return None
        assert sorted(journal["destinations"]["order"]) == sorted(s.endpoint for s in sims.values())
        return time.monotonic()

    return poll(placed, timeout=timeout, what="every replica back in the order")


@contextlib.contextmanager
def held_request(gateway: Gateway, sims: dict[str, Sim], on: Sim) -> Iterator[str]:
    """A request of the gateway's in flight on `on` (it stalls there) until the block ends; then its client
    leaves and the request is cancelled. Yields its request id."""
    key = f"held-{uuid.uuid4().hex[:12]}"
    payload = json.dumps(prompt_body("chat", shared_text(300))).encode()
    headers = with_credential(
        {
            "host": f"127.0.0.1:{gateway.port}",
            "content-type": "application/json",
            "content-length": str(len(payload)),
            "idempotency-key": key,
            SELECT: on.endpoint,
            "x-sim-fault": "stall@headers for=30",
        }
    )
    head = "POST /v1/chat/completions HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    sock = socket.create_connection(("127.0.0.1", gateway.port), timeout=10)
    try:
        sock.sendall(head.encode() + b"\r\n" + payload)
        poll(lambda: on.started_for(key) == 1, what=f"the held request on {on.name}")
        yield key
    finally:
        sock.close()
    journal = gateway.wait_journal(key, lambda j: j["phase"] in TERMINAL_PHASES)
    assert journal["phase"] == "cancelled" and [a["replica"] for a in journal["attempts"]] == [on.endpoint]
    assert {s.name: s.started_for(key) for s in sims.values()} == {
        s.name: int(s is on) for s in sims.values()
    }


# --- (a) the retry goes to the replica warm for the prompt's prefix -----------------------------------------


def test_a_retry_goes_to_the_replica_warm_for_the_prompts_prefix(
    gateway: Gateway, sims: dict[str, Sim]
) -> None:
    """Every (warm, cold-first) pair: the picker names a cold replica alone, it fails before content, and the
    retry goes to the replica that served the prompt's prefix before, never the other cold one (round robin
    would pick it about half the time). Same prompt (every block warm) or the same system part and another
    question (a leading run of blocks warm)."""
    for i, (warm, first) in enumerate(itertools.permutations(sims.values(), 2)):
        other = next(s for s in sims.values() if s not in (warm, first))
        shared = shared_text()
        earlier = ask(gateway, prompt_body("chat", shared, "What is a block?"), select=warm)
        [record] = served_on(sims, earlier.request_id, 1)
        assert_answer("chat", earlier, record)
        attempts_header(earlier, 1, sims)
        assert chosen(finished(gateway, earlier.request_id)) == [(warm.endpoint, "picker choice #1")]

        same_prompt = i % 2 == 0
        question = "What is a block?" if same_prompt else "And how long does a block stay warm? " * 20
        result = ask(
            gateway,
            prompt_body("chat", shared, question),
            select=first,
            fault="status503@headers attempt=1",
        )
        failed, winner = served_on(sims, result.request_id, 2)
        assert (failed["replica"], failed["outcome"], winner["replica"]) == (
            first.name,
            "fault:status503",
            warm.name,
        )
        assert_answer("chat", result, winner)
        attempts_header(result, 2, sims)
        assert other.started_for(result.request_id) == 0

        journal = finished(gateway, result.request_id)
        destinations = journal["destinations"]
        blocks = destinations["prefix_blocks"]
        hot = destinations["ranked"][0]["warm_blocks"]
        if same_prompt:
            assert hot == blocks >= 3, destinations
        else:
            assert 3 <= hot < blocks, destinations  # the shared system part, not the new question
        assert destinations["ranked"] == [
            {"replica": warm.endpoint, "warm_blocks": hot, "in_flight": 0},
            {"replica": other.endpoint, "warm_blocks": 0, "in_flight": 0},
        ]
        assert destinations["picker"] == [first.endpoint] and destinations["source"] == "picker+gateway"
        assert destinations["order"] == [first.endpoint, warm.endpoint, other.endpoint]
        assert "excluded" not in destinations
        assert chosen(journal) == [
            (first.endpoint, "picker choice #1"),
            (warm.endpoint, ranked_choice(2, hot, blocks)),
        ]
        assert [a["outcome"] for a in journal["attempts"]] == ["failed", "completed"]
        started = [e["reason"] for e in journal["events"] if e["event"] == "attempt_started"]
        assert started == [c for _, c in chosen(journal)]


@pytest.mark.parametrize("api", ["completions", "responses", "messages"])
def test_the_warm_replica_is_found_from_every_apis_prompt(
    gateway: Gateway, sims: dict[str, Sim], api: Api
) -> None:
    """The prompt's parts of each API (completions `prompt`, Responses `instructions`/`input`, Messages
    `system`/`messages`) make its blocks: a retry goes to the replica that served the same instructions or
    system prompt under another question."""
    a, b, c = sims.values()
    for warm, first, other in ((a, b, c), (c, b, a)):
        shared = shared_text()
        earlier = ask(gateway, prompt_body(api, shared, "Who are you?"), api=api, select=warm)
        [record] = served_on(sims, earlier.request_id, 1)
        assert_answer(api, earlier, record)
        attempts_header(earlier, 1, sims)
        assert chosen(finished(gateway, earlier.request_id)) == [(warm.endpoint, "picker choice #1")]

        result = ask(
            gateway,
            prompt_body(api, shared, "What can you do? " * 30),
            api=api,
            select=first,
            fault="status503@headers attempt=1",
        )
        failed, winner = served_on(sims, result.request_id, 2)
        assert (failed["replica"], winner["replica"]) == (first.name, warm.name)
        assert_answer(api, result, winner)
        attempts_header(result, 2, sims)
        assert other.started_for(result.request_id) == 0
        journal = finished(gateway, result.request_id)
        destinations = journal["destinations"]
        blocks = destinations["prefix_blocks"]
        hot = destinations["ranked"][0]["warm_blocks"]
        assert 3 <= hot < blocks, destinations
        assert destinations["ranked"] == [
            {"replica": warm.endpoint, "warm_blocks": hot, "in_flight": 0},
            {"replica": other.endpoint, "warm_blocks": 0, "in_flight": 0},
        ]
        assert chosen(journal)[1] == (warm.endpoint, ranked_choice(2, hot, blocks))


# --- (b) the warm replica failed: a cold one, the least loaded ----------------------------------------------


def test_when_the_warm_replica_fails_the_retry_goes_to_the_least_loaded_cold_one(
    gateway: Gateway, sims: dict[str, Sim]
) -> None:
    """The picker names the warm replica, and it is the one that fails: the retry goes to a cold replica,
    the one with no request of this gateway in flight rather than the one holding a stalled request (each
    pair once, so round robin would miss)."""
    for warm, busy in itertools.permutations(sims.values(), 2):
        idle = next(s for s in sims.values() if s not in (warm, busy))
        shared = shared_text()
        body = prompt_body("chat", shared)
        earlier = ask(gateway, body, select=warm)
        assert earlier.status == 200 and served_on(sims, earlier.request_id, 1)[0]["replica"] == warm.name
        finished(gateway, earlier.request_id)  # ended: in flight nowhere

        with held_request(gateway, sims, busy):
            result = ask(gateway, body, select=warm, fault="status503@headers attempt=1")
        failed, winner = served_on(sims, result.request_id, 2)
        assert (failed["replica"], failed["outcome"], winner["replica"]) == (
            warm.name,
            "fault:status503",
            idle.name,
        )
        assert_answer("chat", result, winner)
        attempts_header(result, 2, sims)
        assert busy.started_for(result.request_id) == 0

        journal = finished(gateway, result.request_id)
        destinations = journal["destinations"]
        blocks = destinations["prefix_blocks"]
        assert blocks >= 3
        assert destinations["ranked"] == [
            {"replica": idle.endpoint, "warm_blocks": 0, "in_flight": 0},
            {"replica": busy.endpoint, "warm_blocks": 0, "in_flight": 1},
        ]
        assert chosen(journal) == [
            (warm.endpoint, "picker choice #1"),
            (idle.endpoint, ranked_choice(2, 0, blocks)),
        ]


# --- (c) a replica that said 429 + Retry-After is left out until it lapses ----------------------------------


@pytest.mark.parametrize("retry_after", ["2", "date:2"], ids=["seconds", "http-date"])
def test_a_replica_that_answered_429_with_retry_after_is_left_out_until_it_lapses(
    gateway: Gateway, sims: dict[str, Sim], retry_after: str
) -> None:
    """The warm replica answers 429 with `Retry-After` (2 s, or an HTTP-date 2 s on): a retry that would
    have gone to it goes to the cold one, a first attempt the picker sends to it goes elsewhere, and once
    the time has lapsed (not before) the picker's choice of it is followed again."""
    a, b, c = sims.values()
    warm, first, other = (b, a, c) if retry_after == "2" else (c, b, a)
    shared = shared_text()
    earlier = ask(gateway, prompt_body("chat", shared), select=warm)
    assert earlier.status == 200 and served_on(sims, earlier.request_id, 1)[0]["replica"] == warm.name

    # The warm replica says it is overloaded (on another prompt): the request itself is retried elsewhere.
    t0 = time.monotonic()
    overloaded = ask(
        gateway,
        prompt_body("chat", shared_text()),
        select=warm,
        fault=f"status429@headers retry_after={retry_after} attempt=1",
    )
    overloaded_journal = finished(gateway, overloaded.request_id)  # ended: in flight nowhere
    # A retry that would go to the warm replica, at once.
    result = ask(gateway, prompt_body("chat", shared), select=first, fault="status503@headers attempt=1")
    # A first attempt the picker sends to it.
    avoided = ask(gateway, prompt_body("chat", shared), select=warm)
    sent_by = time.monotonic()
    assert sent_by - t0 < 2, "the machine is too slow for this test: the ejection lapsed meanwhile"

    refused, retried = served_on(sims, overloaded.request_id, 2)
    assert (refused["replica"], refused["status"], refused["outcome"]) == (warm.name, 429, "fault:status429")
    if retry_after == "2":
        assert refused["retry_after"] == "2"
    else:
        assert refused["retry_after"].endswith(" GMT")  # the replica sent an HTTP-date
    assert_answer("chat", overloaded, retried)
    attempts_header(overloaded, 2, sims)
    assert [(x["replica"], x["status"], x["detail"]) for x in overloaded_journal["attempts"]] == [
        (warm.endpoint, 429, "replica_overloaded"),
        (sims[retried["replica"]].endpoint, 200, None),
    ]

    failed, winner = served_on(sims, result.request_id, 2)
    assert (failed["replica"], winner["replica"]) == (first.name, other.name)  # not the warm one
    assert_answer("chat", result, winner)
    assert warm.started_for(result.request_id) == 0
    journal = finished(gateway, result.request_id)
    destinations = journal["destinations"]
    assert_ejected(excluded(journal).get(warm.endpoint))
    assert list(excluded(journal)) == [warm.endpoint]
    assert destinations["order"] == [first.endpoint, other.endpoint]
    assert destinations["ranked"] == [{"replica": other.endpoint, "warm_blocks": 0, "in_flight": 0}]
    assert chosen(journal) == [
        (first.endpoint, "picker choice #1"),
        (other.endpoint, ranked_choice(2, 0, destinations["prefix_blocks"])),
    ]

    [placed] = served_on(sims, avoided.request_id, 1)
    assert placed["replica"] != warm.name and warm.started_for(avoided.request_id) == 0
    assert_answer("chat", avoided, placed)
    attempts_header(avoided, 1, sims)
    journal = finished(gateway, avoided.request_id)
    assert journal["destinations"]["picker"] == [warm.endpoint]
    assert warm.endpoint not in journal["destinations"]["order"]
    assert_ejected(excluded(journal).get(warm.endpoint))
    assert journal["attempts"][0]["replica"] == sims[placed["replica"]].endpoint

    # It comes back by itself: the picker's choice of it is followed again once the Retry-After lapsed.
    def back() -> float | None:
        probe = ask(gateway, prompt_body("chat", shared_text(300)), select=warm)
        answered = time.monotonic()
        journal = finished(gateway, probe.request_id)
        assert probe.status == 200, probe.body
        if journal["attempts"][0]["replica"] != warm.endpoint:
            assert_ejected(excluded(journal).get(warm.endpoint))
            return None
        assert (
            chosen(journal) == [(warm.endpoint, "picker choice #1")]
            and "excluded" not in journal["destinations"]
        )
        assert [r["replica"] for r in served_on(sims, probe.request_id, 1)] == [warm.name]
        return answered

    answered = poll(back, timeout=12, what=f"{warm.name} in the order again")
    assert answered - t0 >= 2, "the replica was used again before its Retry-After lapsed"


# --- (d) every replica overloaded: 429 at once, no attempt --------------------------------------------------


def test_with_every_replica_ejected_the_client_gets_429_replicas_overloaded_and_no_replica_is_asked(
    gateway: Gateway, sims: dict[str, Sim]
) -> None:
    """Every replica answers 429 with `Retry-After: 3600`, capped by placement.max_retry_after_seconds (4):
    then a request is answered `429 replicas_overloaded` at once with the shortest time left, rounded up to
    whole seconds, no replica asked; after the cap (not an hour) the replicas are used again."""
    a = sims["a"]
    fault = "status429@headers retry_after=3600"
    t_send1 = time.monotonic()
    first = ask(gateway, prompt_body("chat", shared_text(300)), select=a, fault=f"{fault} attempt=1")
    t_recv1 = time.monotonic()
    # The picker lists all three; a is left out; the other two both answer 429.
    both = ask(gateway, prompt_body("chat", shared_text(300)), fault=fault)
    t_send3 = time.monotonic()
    result = ask(gateway, prompt_body("chat", shared_text(300)))
    t_recv3 = time.monotonic()
    assert t_recv3 - t_send1 < MAX_RETRY_AFTER - 1, "the machine is too slow for this test"

    assert first.status == 200 and served_on(sims, first.request_id, 2)[0]["replica"] == "a"
    error_of(both, 429, "replicas_overloaded")
    attempts_header(both, 2, sims)
    tried = served_on(sims, both.request_id, 2)
    assert sorted(r["replica"] for r in tried) == ["b", "c"]
    assert [(r["status"], r["retry_after"]) for r in tried] == [(429, "3600")] * 2
    assert_ejected(excluded(finished(gateway, both.request_id)).get(a.endpoint))

    error = error_of(result, 429, "replicas_overloaded")
    assert error["type"] == "gateway_error" and error.get("attempts", []) == []
    attempts_header(result, 0, sims)
    # a was ejected first, between t_send1 and t_recv1, for the cap; the request was admitted in between.
    lowest = math.ceil(t_send1 + MAX_RETRY_AFTER - t_recv3)
    highest = math.ceil(t_recv1 + MAX_RETRY_AFTER - t_send3)
    assert lowest <= int(result.headers["retry-after"]) <= min(highest, MAX_RETRY_AFTER), (
        result.headers["retry-after"],
        lowest,
        highest,
    )
    unseen(sims, result.request_id)

    back = wait_every_replica_placed(gateway, sims)
    assert back - t_send1 >= MAX_RETRY_AFTER  # the cap, whole

    journal = finished(gateway, result.request_id)
    assert (journal["outcome"], journal["attempts"]) == ("replicas_overloaded", [])
    assert journal["destinations"].get("order", []) == []
    why = excluded(journal)
    assert sorted(why) == sorted(s.endpoint for s in sims.values())
    for reason in why.values():
        assert_ejected(reason)


# --- (e) a tenant's share of retries ------------------------------------------------------------------------


def tenant(name: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {name}-{uuid.uuid4().hex[:8]}"}


def retry_overflow(gateway: Gateway) -> int:
    stats = gateway.envoy_admin("/stats?filter=cluster.llm.upstream_rq_retry_overflow").decode()
    return sum(int(line.split(": ")[1]) for line in stats.strip().splitlines())


@pytest.mark.parametrize(
    "failure",
    [
        "delay@headers for=1 attempt=1; status503@headers attempt=1",
        "delay@role for=1 attempt=1; reset@role attempt=1",
        "delay@headers for=1 attempt=1; reset@headers attempt=1",
    ],
    ids=["503", "reset-after-headers", "reset-before-headers"],
)
def test_a_tenant_flooding_failures_spends_only_its_own_retry_budget(
    tenant_gateway: Gateway, sims: dict[str, Sim], failure: str
) -> None:
    """Tenant budget: at most max(1, 0 % of its requests in flight) of a tenant's requests in retry at once.
    Tenant A sends five requests whose first attempts fail together, their retries slow (2 s): one is
    retried at a time and the others are refused, naming the tenant's budget; tenant B's request failing
    meanwhile is retried and completes. Envoy's own budget refuses nothing."""
    gw = tenant_gateway
    a_credential, b_credential = tenant("tenant-a"), tenant("tenant-b")
    keys = [f"flood-{uuid.uuid4().hex[:10]}" for _ in range(5)]
    overflow_before = retry_overflow(gw)

    def flood(key: str) -> ClientResult:
        headers = {
            **a_credential,
            "idempotency-key": key,
            "x-sim-fault": f"{failure}; delay@headers for=2 attempt=2",
        }
        return post(f"{gw.url}/v1/chat/completions", prompt_body("chat", shared_text(300)), headers=headers)

    def a_retry_running() -> bool:
        return any(
            r.get("event") == "start" and r.get("attempt_count") == 2 and r.get("request_id") in keys
            for s in sims.values()
            for r in s.records()
        )

    with ThreadPoolExecutor(max_workers=len(keys)) as pool:
        flooding = [pool.submit(flood, key) for key in keys]
        poll(a_retry_running, timeout=15, what="a retry of tenant A's running")
        b = post(
            f"{gw.url}/v1/chat/completions",
            prompt_body("chat", shared_text(300)),
            headers={**b_credential, "x-sim-fault": "status503@headers attempt=1"},
        )
        results = dict(zip(keys, (f.result(timeout=60) for f in flooding), strict=True))

    assert retry_overflow(gw) == overflow_before  # no refusal was Envoy's

    # Tenant B: retried and complete, while one of A's retries held A's whole budget.
    failed, winner = served_on(sims, b.request_id, 2)
    assert failed["outcome"] == "fault:status503"
    assert_answer("chat", b, winner)
    attempts_header(b, 2, sims)
    journal = finished(gw, b.request_id, b_credential)
    assert (journal["outcome"], [x["outcome"] for x in journal["attempts"]]) == (
        "completed",
        ["failed", "completed"],
    )

    retried = {k: r for k, r in results.items() if r.status == 200}
    refused = {k: r for k, r in results.items() if r.status != 200}
    assert len(retried) >= 1 and len(refused) >= 2, {k: r.status for k, r in results.items()}
    a_retries: list[tuple[float, float]] = []
    for key, result in retried.items():
        second = served_on(sims, key, 2)[1]
        assert second["attempt_count"] == 2
        assert_answer("chat", result, second)
        attempts_header(result, 2, sims)
        a_retries.append((second["t_start"], second["t_end"]))
        assert finished(gw, key, a_credential)["outcome"] == "completed"
    # One of A's requests in retry at a time: their retries never overlap.
    a_retries.sort()
    assert all(end <= start for (_, end), (start, _) in itertools.pairwise(a_retries)), a_retries
    assert any(start <= winner["t_start"] <= end for start, end in a_retries), (a_retries, winner)

    for key, result in refused.items():
        error = error_of(result, 503, "retry_budget_exhausted")
        assert "the tenant's retry budget" in error["message"], error["message"]
        assert result.body.count(b"data:") == 0
        attempts_header(result, 1, sims)
        assert [r["attempt_count"] for r in served_on(sims, key, 1)] == [1]
        journal = finished(gw, key, a_credential)
        assert (journal["phase"], journal["outcome"]) == ("failed", "retry_budget_exhausted")
        assert [x["outcome"] for x in journal["attempts"]] == ["failed"]
        [refusal] = [e for e in journal["events"] if e["event"] == "retry_refused"]
        assert refusal["reason"] == "retry_budget_exhausted"
        assert refusal["detail"].startswith("tenant budget"), refusal


# --- (f) x-router-attempts ----------------------------------------------------------------------------------


def test_every_response_says_how_many_attempts_reached_a_replica(
    gateway: Gateway, sims: dict[str, Sim]
) -> None:
    """`x-router-attempts`: 1 on a clean answer, 2 on a retried one, 1 on a stream cut after its first
    content (the terminal frame), 2 on the error after both attempts failed (OpenAI's and Anthropic's
    shapes); never a replica's address in the client's headers."""
    clean = ask(gateway, prompt_body("chat", shared_text(300)))
    [record] = served_on(sims, clean.request_id, 1)
    assert_answer("chat", clean, record)
    attempts_header(clean, 1, sims)

    retried = ask(gateway, prompt_body("chat", shared_text(300)), fault="reset@role attempt=1")
    assert_answer("chat", retried, served_on(sims, retried.request_id, 2)[1])
    attempts_header(retried, 2, sims)

    cut = ask(gateway, prompt_body("chat", shared_text(300)), fault="error@token:2")
    assert cut.status == 200 and len(cut.content_chunks()) == 1
    [frame] = [d["error"] for d in cut.data() if isinstance(d, dict) and "error" in d]
    assert (frame["code"], frame["delivered_output_tokens"]) == ("upstream_decode_interrupted", 1)
    attempts_header(cut, 1, sims)
    assert [r["outcome"] for r in served_on(sims, cut.request_id, 1)] == ["fault:error"]

    exhausted = ask(gateway, prompt_body("chat", shared_text(300)), fault="status503@headers")
    error = error_of(exhausted, 502, "retries_exhausted")
    assert len(error["attempts"]) == 2
    attempts_header(exhausted, 2, sims)
    assert [r["outcome"] for r in served_on(sims, exhausted.request_id, 2)] == ["fault:status503"] * 2
    assert len(finished(gateway, exhausted.request_id)["attempts"]) == 2

    anthropic = ask(
        gateway, prompt_body("messages", shared_text(300)), api="messages", fault="status503@headers"
    )
    assert anthropic.status == 502 and anthropic.headers["content-type"] == "application/json"
    document = json.loads(anthropic.body)
    assert (document["type"], document["error"]["details"]) == ("error", {"error_code": "retries_exhausted"})
    attempts_header(anthropic, 2, sims)
    assert len(served_on(sims, anthropic.request_id, 2)) == 2


@pytest.mark.parametrize(
    ("headers", "body", "status", "code"),
    [
        ({}, {"model": "tiny", "stream": True, "messages": "none"}, 400, "missing_messages"),
        ({"idempotency-key": "not a key!"}, None, 400, "invalid_idempotency_key"),
        ({"test-epp-answer": "429"}, None, 429, "replicas_overloaded"),
    ],
    ids=["body-refused", "bad-idempotency-key", "picker-shed"],
)
def test_our_errors_before_any_attempt_say_zero_attempts(
    gateway: Gateway,
    sims: dict[str, Sim],
    headers: dict[str, str],
    body: dict[str, Any] | None,
    status: int,
    code: str,
) -> None:
    """Our own errors made before any attempt (a body or a header the gateway refuses, the picker's own
    429 answered as our JSON error) say `x-router-attempts: 0`."""
    refused = post(
        f"{gateway.url}/v1/chat/completions",
        body or prompt_body("chat", shared_text(300)),
        headers=headers,
    )
    assert (refused.status, refused.headers["content-type"]) == (status, "application/json"), refused.body
    error = json.loads(refused.body)["error"]
    # A request refused for its Idempotency-Key has no request id at all.
    assert (error["code"], error["request_id"]) == (code, refused.headers.get("x-request-id"))
    if refused.request_id:
        unseen(sims, refused.request_id)
    attempts_header(refused, 0, sims)


# --- (g) no compatible replica: the journal names the difference --------------------------------------------


@pytest.fixture(scope="module")
def split_pool(
    etcd: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Gateway, dict[str, Sim]]]:
    """Two replicas from the registry whose fingerprints differ in block_size only: one group each."""
    work: Path = tmp_path_factory.mktemp("split")
    sizes = {"p": 16, "q": 32}
    agents: list[Agent] = []
    gw: Gateway | None = None
    with sim_pool(work, sizes) as pool:
        try:
            for name, size in sizes.items():
                fingerprint = work / f"{name}.yaml"
                fingerprint.write_text(f'weights_revision: "aaaa1111"\nblock_size: {size}\n')
                agents.append(Agent(pool[name], etcd, work, fingerprint=fingerprint))
            gw = Gateway(replicas=[], etcd=etcd, work=work)
            gw.wait_replicas_healthy((s.endpoint for s in pool.values()), timeout=20)
            yield gw, pool
        finally:
            if gw is not None:
                gw.stop()
            for agent in agents:
                agent.stop()


def test_no_compatible_replica_is_journaled_naming_the_field_and_both_values(
    split_pool: tuple[Gateway, dict[str, Sim]],
) -> None:
    gw, pool = split_pool
    sizes = {"p": 16, "q": 32}
    result = post(
        f"{gw.url}/v1/chat/completions",
        prompt_body("chat", shared_text(300)),
        headers={"x-sim-fault": "status503@headers attempt=1"},
    )
    error = error_of(result, 503, "no_compatible_replica")
    [attempt] = served_on(pool, result.request_id, 1)
    pinned = attempt["replica"]
    candidate = next(n for n in sizes if n != pinned)
    difference = f"block_size: pinned {sizes[pinned]} vs candidate {sizes[candidate]}"
    assert difference in error["message"], error["message"]
    attempts_header(result, 1, pool)
    assert pool[candidate].started_for(result.request_id) == 0
    journal = finished(gw, result.request_id)
    assert (journal["phase"], journal["outcome"]) == ("failed", "no_compatible_replica")
    [refusal] = [e for e in journal["events"] if e["event"] == "retry_refused"]
    assert refusal["reason"] == "no_compatible_replica"
    assert difference in refusal["detail"], refusal
