"""A replica's rejection (a 4xx other than 429) ends the request after one attempt, with the replica's reason
in the API's error shape, and is never resent (docs/design.md#rejections). Real Envoy, real etcd, two
simulated replicas per engine dialect: the sims refuse `max_tokens` over their `max_model_len` (1024) with the
engine's own 400, as vLLM 0.32 and SGLang 0.5.23 do.

Each test checks the client's status and error body, `x-router-attempts`, the journal, and each replica's own
log: the request reached exactly one replica, once.
"""

from __future__ import annotations

import asyncio
import random
import uuid
from typing import Any

import httpx
import pytest

from tests.api_streams import Api
from tests.harness import ClientResult, post, with_credential
from tests.integration.api_helpers import (
    Fleet,
    Fleets,
    assert_error_body,
    assert_one_complete_answer,
    body,
    fleets_fixture,
)

pytestmark = pytest.mark.integration

fleets = pytest.fixture(scope="module")(fleets_fixture)

# (API, dialect) pairs: chat completions and the Messages API on both engines, the Responses API on vLLM (the
# SGLang sim plays SGLang 0.5.23 without openai-harmony: its /v1/responses answers 500).
CASES = [
    ("chat", "vllm"),
    ("chat", "sglang"),
    ("responses", "vllm"),
    ("messages", "vllm"),
    ("messages", "sglang"),
]
TOO_MANY = 5000  # output tokens asked for: over the sims' max_model_len of 1024


def request_body(api: str, max_tokens: int, *, stream: bool = True, prompt: str = "hello there") -> dict:
    if api == "chat":
        messages = [{"role": "user", "content": prompt}]
        return {"model": "tiny", "messages": messages, "max_tokens": max_tokens, "stream": stream}
    return body(api, max_tokens, stream=stream, prompt=prompt)  # type: ignore[arg-type]


def path_of(api: str) -> str:
    return "/v1/chat/completions" if api == "chat" else f"/v1/{api}"


def starts_of(fleet: Fleet, request_id: str) -> list[dict[str, Any]]:
    return [
        r
        for sim in fleet.sims.values()
        for r in sim.records()
        if r.get("event") == "start" and r.get("request_id") == request_id
    ]


def assert_rejected_once(
    fleet: Fleet, api: str, result: ClientResult, replica_status: int = 400
) -> dict[str, Any]:
    """One 400 in the API's shape with the replica's reason, after one attempt that one replica served (and
    answered `replica_status`: 200 when it refused in-band)."""
    assert result.status == 400, (result.status, result.body[:400])
    shape: Api = "messages" if api == "messages" else "responses"  # chat's shape is the Responses API's
    error = assert_error_body(shape, result.status, result.headers, result.body, "context_length_exceeded")
    assert error["message"].startswith("the replica rejected the request (400): "), error
    assert str(TOO_MANY) in error["message"] and "1024" in error["message"], error
    assert error["retryable"] is False, error
    if shape == "messages":
        assert error["type"] == "invalid_request_error", error
    [attempt] = error["attempts"]
    assert (attempt["status"], attempt["detail"]) == (replica_status, "context_length_exceeded"), attempt
    assert result.headers["x-router-attempts"] == "1"
    journal = fleet.gw.wait_journal(result.request_id, lambda j: j.get("phase") == "failed")
    assert journal["outcome"] == "context_length_exceeded", journal
    names = [e["event"] for e in journal["events"]]
    assert "retry_triggered" not in names, names
    refused = next(e for e in journal["events"] if e["event"] == "retry_refused")
    assert refused["reason"] == "context_length_exceeded" and "rejected again" in refused["detail"], refused
    [start] = starts_of(fleet, result.request_id)
    assert start["path"] == path_of(api) and start["attempt_id"] == attempt["attempt_id"], start
    return error


@pytest.mark.parametrize(("api", "dialect"), CASES, ids=[f"{a}-{d}" for a, d in CASES])
@pytest.mark.parametrize("stream", [True, False], ids=["stream", "unary"])
def test_context_length_exceeded_is_the_replicas_reason_after_one_attempt(
    fleets: Fleets, api: str, dialect: str, stream: bool
) -> None:
    fleet = fleets[dialect]
    fleet.ensure_running()
    result = post(fleet.url + path_of(api), request_body(api, TOO_MANY, stream=stream))
    # SGLang's Messages stream refuses it inside a 200 (an in-band error before content): a rejection too.
    in_band = (api, dialect, stream) == ("messages", "sglang", True)
    error = assert_rejected_once(fleet, api, result, 200 if in_band else 400)
    if dialect == "vllm" and api != "messages":  # (Anthropic's error shape names no field)
        assert error["param"] in ("max_tokens", "max_output_tokens"), error  # the field vLLM names


def test_a_rejection_costs_the_replica_no_failure(fleets: Fleets) -> None:
    """A rejection says nothing against its replica: the next requests go on round robin as before (no
    demotion, no ejection, its circuit closed), each served by one attempt."""
    fleet = fleets["vllm"]
    fleet.ensure_running()
    for _ in range(3):
        assert_rejected_once(fleet, "chat", post(fleet.url + path_of("chat"), request_body("chat", TOO_MANY)))
    served = []
    for _ in range(4):
        result = post(fleet.url + path_of("chat"), request_body("chat", 4))
        assert result.status == 200 and result.headers["x-router-attempts"] == "1", result.body[:300]
        served += [s["replica"] for s in starts_of(fleet, result.request_id)]
    assert sorted(set(served)) == sorted(sim.name for sim in fleet.sims.values()), served


async def _send_all(url: str, requests: list[tuple[str, dict]]) -> list[httpx.Response]:
    async with httpx.AsyncClient(timeout=30) as client:
        return list(
            await asyncio.gather(
                *(client.post(url + path, json=b, headers=with_credential({})) for path, b in requests)
            )
        )


@pytest.mark.parametrize("seed", [3, 11])
def test_rejections_among_many_streams_in_flight(fleets: Fleets, seed: int) -> None:
    """24 streams at once over the three APIs, a random third of them over the context: each rejected one got
    its 400 after one attempt, every other one its whole answer; the replicas saw each request once."""
    rng = random.Random(seed)
    fleet = fleets["vllm"]
    fleet.ensure_running()
    plan = []
    for i in range(24):
        api = rng.choice(["chat", "responses", "messages"])
        rejected = rng.random() < 1 / 3
        prompt = f"many {seed} {i} {uuid.uuid4().hex[:6]}"
        plan.append((api, rejected, request_body(api, TOO_MANY if rejected else 6, prompt=prompt)))
    responses = asyncio.run(_send_all(fleet.url, [(path_of(api), b) for api, _, b in plan]))
    for (api, rejected, sent), response in zip(plan, responses, strict=True):
        result = ClientResult(response.status_code, dict(response.headers), response.content)
        if rejected:
            assert_rejected_once(fleet, api, result)
            continue
        assert response.status_code == 200, (api, response.content[:300])
        assert result.headers["x-router-attempts"] == "1"
        [served] = fleet.attempts_logged(result.request_id, 1)
        assert served["outcome"] == "completed", served
        if api != "chat":
            assert_one_complete_answer(fleet, api, sent, result, served)  # type: ignore[arg-type]
