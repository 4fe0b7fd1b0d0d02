"""Hostile input on the Responses (`/v1/responses`) and Messages (`/v1/messages`) routes (invariant 10,
docs/design.md; modelled on `test_hostile_input.py`): a replica that breaks the API's stream (events that
are not JSON, a preamble that never ends or never finishes its event, its own in-band failure, SGLang's
`response.incomplete` end) and clients that send bodies no engine should see (malformed, deep, oversized,
without `input` / `messages`). Each gets a clear answer in the API's own shape, nothing crashes, and the
gateway keeps serving.

The gateway here has ONE replica, the scriptable raw one in `tests/hostile_replica.py` (its API scenarios),
so every attempt, retries included, goes to it; `x-hostile: NAME[:SIZE][;attempt=K]` picks what it does per
attempt. Each test checks the client's exact bytes (the replica's are deterministic in its stream id), the
journal and the replica's log. The module is bounded in time (HOSTILE_API_BUDGET_SECONDS, default 120).
"""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests import hostile_replica as hr
from tests.api_streams import INTERRUPTED, ApiStream, event_name
from tests.harness import ClientResult, post
from tests.hostile_replica import HostileReplica, MiB
from tests.integration.api_helpers import assert_error_body, assert_terminal_event, assert_well_formed
from tests.integration.hostile_conftest_helpers import (
    AUTH,
    Budget,
    HostileStack,
    RssSampler,
    assert_same_bytes,
    status_kib,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

BUDGET = Budget(float(os.environ.get("HOSTILE_API_BUDGET_SECONDS", "120")))
APIS = ["responses", "messages"]


@pytest.fixture(scope="module")
def replica(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HostileReplica]:
    BUDGET.start()
    r = HostileReplica("apis", tmp_path_factory.mktemp("hostile-apis"))
    try:
        yield r
    finally:
        r.stop()


@pytest.fixture(scope="module")
def stack(
    etcd: str, replica: HostileReplica, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[HostileStack]:
    s = HostileStack(etcd, tmp_path_factory.mktemp("hostile-apis-gw"), replica, BUDGET)
    try:
        yield s
    finally:
        s.stop()


@pytest.fixture(autouse=True)
def _within_budget_and_running(request: pytest.FixtureRequest) -> None:
    BUDGET.check()
    if "stack" in request.fixturenames:
        request.getfixturevalue("stack").ensure()


def request_body(api: str, *, stream: bool = True) -> dict[str, Any]:
    if api == "responses":
        return {"model": "tiny", "input": "hello", "max_output_tokens": 4, "stream": stream}
    return {
        "model": "tiny",
        "max_tokens": 4,
        "messages": [{"role": "user", "content": "hello"}],
        "stream": stream,
    }


def send(stack: HostileStack, api: str, scenario: str | None, *, stream: bool = True) -> ClientResult:
    headers = {**AUTH, **({"x-hostile": scenario} if scenario else {})}
    seconds = BUDGET.timeout(20)
    try:
        return post(
            f"{stack.url}/v1/{api}", request_body(api, stream=stream), headers=headers, timeout=seconds
        )
    except httpx.TimeoutException:
        pytest.fail(f"no answer within {seconds:.0f}s (x-hostile: {scenario})", pytrace=False)


def served_by(stack: HostileStack, request_id: str, attempts: int) -> list[dict[str, Any]]:
    ends = stack.replica.wait_ends(request_id, attempts, timeout=BUDGET.timeout(10))
    ends = sorted(ends, key=lambda r: (r.get("attempt") or 0, r["exchange"]))
    assert [e["attempt"] for e in ends] == list(range(1, attempts + 1)), ends
    return ends


def assert_normal_answer(
    stack: HostileStack, api: str, result: ClientResult, attempts: int
) -> dict[str, Any]:
    """Exactly the normal stream of the request's last attempt, byte for byte; journaled completed."""
    assert result.status == 200 and result.transport_error is None, (result.status, result.body[:400])
    last = served_by(stack, result.request_id, attempts)[-1]
    assert last["how"] == "complete", last
    assert_same_bytes(
        result.body, hr.api_stream_payload(api, last["cid"]), "client body vs the serving attempt"
    )
    journal = stack.finished(result.request_id)
    assert (journal["phase"], journal["outcome"], journal["attempt"]) == ("completed", "completed", attempts)
    assert journal["delivered_output_tokens"] == hr.CONTENT_EVENTS
    return journal


# --------------------------------------------------------------------------- the replica's own stream


@pytest.mark.parametrize("api", APIS)
def test_the_replicas_normal_streams_are_well_formed_answers(api: str) -> None:
    """The oracle reads the hostile replica's normal streams as one complete answer each (its self-test)."""
    stream = ApiStream.read(api, hr.api_stream_payload(api, "chatcmpl-self"))  # type: ignore[arg-type]
    assert_well_formed(stream)
    assert stream.preambles == 1 and stream.clean_ends == 1 and not stream.terminal_events()
    assert stream.text == "tok0 tok1 tok2 tok3 " and stream.usage_output_tokens() == 4
    if api == "responses":
        assert stream.sequence_numbers() == list(range(len(stream.events)))


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "unary"])
@pytest.mark.parametrize("api", APIS)
def test_a_normal_answer_passes_byte_for_byte(stack: HostileStack, api: str, stream: bool) -> None:
    result = send(stack, api, None, stream=stream)
    if stream:
        assert_normal_answer(stack, api, result, 1)
    else:
        [end] = served_by(stack, result.request_id, 1)
        assert result.status == 200, result.body[:300]
        assert_same_bytes(result.body, hr.api_unary_body(api, end["cid"]))
        assert stack.finished(result.request_id)["delivered_output_tokens"] == 4


# --------------------------------------------------------------------------- broken streams from the replica

# Scenarios that break the stream before its first content: (x-hostile, the failed attempt's detail).
BEFORE_CONTENT = [
    ("not_json_before_delta", "malformed_event"),
    ("endless_preamble:2MiB", "response_too_large"),
    ("unfinished_preamble:4MiB", "response_too_large"),
    ("replica_failed_before_delta", "error_event"),
]


@pytest.mark.parametrize(("scenario", "detail"), BEFORE_CONTENT, ids=[s for s, _ in BEFORE_CONTENT])
@pytest.mark.parametrize("api", APIS)
def test_a_broken_stream_before_the_first_content_is_retried(
    stack: HostileStack, api: str, scenario: str, detail: str
) -> None:
    envoy = stack.envoy_pid()
    result = send(stack, api, f"{scenario};attempt=1")
    assert stack.envoy_pid() == envoy
    journal = assert_normal_answer(stack, api, result, 2)
    assert (journal["attempts"][0]["outcome"], journal["attempts"][0]["detail"]) == ("failed", detail)


@pytest.mark.parametrize(("scenario", "detail"), BEFORE_CONTENT, ids=[s for s, _ in BEFORE_CONTENT])
@pytest.mark.parametrize("api", APIS)
def test_a_broken_stream_on_every_attempt_is_one_error_in_the_apis_shape(
    stack: HostileStack, api: str, scenario: str, detail: str
) -> None:
    pid = stack.gateway.proc.pid
    before = status_kib(pid, "VmRSS")
    with RssSampler(pid) as rss:
        result = send(stack, api, scenario)
    assert result.status == 502 and result.transport_error is None, (result.status, result.body[:300])
    error = assert_error_body(api, result.status, result.headers, result.body, "retries_exhausted")
    assert [a["detail"] for a in error["attempts"]] == [detail, detail]
    for replica_bytes in (b"tok0", b"resp_", b"msg_", b"pad", b"not json", b"Request running timeout"):
        assert replica_bytes not in result.body, (replica_bytes, result.body[:400])
    served_by(stack, result.request_id, 2)
    journal = stack.finished(result.request_id)
    assert (journal["phase"], journal["outcome"], journal["first_delta_sent"]) == (
        "failed",
        "retries_exhausted",
        False,
    )
    growth_mib = (max(rss.peak_kib, status_kib(pid, "VmRSS")) - before) / 1024
    assert growth_mib < 64, f"the sidecar's RSS grew by {growth_mib:.0f} MiB"


@pytest.mark.parametrize("api", APIS)
def test_the_replicas_own_failure_after_the_first_content_is_replaced_by_our_terminal_event(
    stack: HostileStack, api: str
) -> None:
    """SGLang's in-band failure after two content events: Responses' own `response.failed`, Messages'
    `content_block_stop`, `error` (`overloaded_error`), `message_stop`. The client gets the replica's events
    up to its failure, byte for byte, then exactly one of ours: never the replica's failure or its end."""
    result = send(stack, api, "replica_failed_after_delta")
    assert result.status == 200 and result.transport_error is None, (result.status, result.transport_error)
    [end] = served_by(stack, result.request_id, 1)
    failing = ("response.failed",) if api == "responses" else ("error",)
    written = hr.api_failed_events(api, end["cid"], 2)
    upto = next(
        i for i, e in enumerate(written) if any(b"event: " + n.encode() + b"\n" in e for n in failing)
    )
    stream = ApiStream.read(api, result.body)  # type: ignore[arg-type]
    assert_well_formed(stream)
    assert_same_bytes(result.body[: len(b"".join(written[:upto]))], b"".join(written[:upto]))
    assert len(stream.events) == upto + 1
    assert_terminal_event(api, stream, result.request_id, 2, "in-band error event after the first delta")  # type: ignore[arg-type]
    assert b"server_error" not in result.body and b"overloaded_error" not in result.body
    assert event_name(stream.events[-1]) == ("response.failed" if api == "responses" else "error")
    journal = stack.finished(result.request_id)
    assert (journal["phase"], journal["outcome"], journal["attempt"]) == ("interrupted", INTERRUPTED, 1)
    assert journal["delivered_output_tokens"] == 2


@pytest.mark.parametrize("api", APIS)
def test_an_event_that_is_not_json_after_the_first_content_is_never_forwarded(
    stack: HostileStack, api: str
) -> None:
    result = send(stack, api, "not_json_after_delta")
    assert result.status == 200 and result.transport_error is None
    [end] = served_by(stack, result.request_id, 1)
    assert hr.NOT_JSON_EVENT[api] not in result.body, "the replica's broken event reached the client's parser"
    stream = ApiStream.read(api, result.body)  # type: ignore[arg-type]
    assert_well_formed(stream)
    opening = 4 if api == "responses" else 2
    prefix = b"".join(hr.api_stream_events(api, end["cid"])[: opening + 1])
    assert_same_bytes(result.body[: len(prefix)], prefix)
    why = "the replica sent an event that is not a JSON object after the first delta"
    assert_terminal_event(api, stream, result.request_id, 1, why)  # type: ignore[arg-type]
    journal = stack.finished(result.request_id)
    assert (journal["phase"], journal["delivered_output_tokens"]) == ("interrupted", 1)


def test_sglangs_response_incomplete_is_a_clean_end(stack: HostileStack) -> None:
    result = send(stack, "responses", "incomplete_end")
    assert result.status == 200 and result.transport_error is None
    [end] = served_by(stack, result.request_id, 1)
    want = hr.api_stream_events("responses", end["cid"], end="response.incomplete")
    assert_same_bytes(result.body, b"".join(want))
    journal = stack.finished(result.request_id)
    assert (journal["phase"], journal["delivered_output_tokens"]) == ("completed", 4)
    assert journal["delivered_output_tokens_source"] == "usage"


# --------------------------------------------------------------------------- hostile clients

DEEP = b"[" * 100_000 + b"]" * 100_000
# (body, status, code) per API: what the gateway answers before any attempt.
BAD_BODIES: dict[str, dict[str, tuple[bytes, int, str]]] = {
    "responses": {
        "malformed_json": (b'{"model": "tiny", "input": [', 400, "invalid_json"),
        "deep_json": (b'{"model":"tiny","input":' + DEEP + b',"stream":true}', 400, "json_too_deep"),
        "not_an_object": (b'["tiny"]', 400, "invalid_request"),
        "missing_input": (b'{"model":"tiny","stream":true}', 400, "missing_input"),
        "empty_input": (b'{"model":"tiny","input":[],"stream":true}', 400, "missing_input"),
        "oversize": (b'{"model":"tiny","input":"' + b"x" * (4 * MiB + 16) + b'"}', 413, "request_too_large"),
    },
    "messages": {
        "malformed_json": (b'{"model": "tiny", "messages": [', 400, "invalid_json"),
        "deep_json": (b'{"model":"tiny","max_tokens":4,"messages":' + DEEP + b"}", 400, "json_too_deep"),
        "not_an_object": (b'["tiny"]', 400, "invalid_request"),
        "missing_messages": (b'{"model":"tiny","max_tokens":4,"stream":true}', 400, "missing_messages"),
        "oversize": (
            b'{"model":"tiny","max_tokens":4,"messages":[{"role":"user","content":"'
            + b"x" * (4 * MiB + 16)
            + b'"}]}',
            413,
            "request_too_large",
        ),
    },
}
BAD_CASES = [
    pytest.param(
        api,
        case,
        id=f"{api}-{case}",
    )
    for api, cases in BAD_BODIES.items()
    for case in cases
]


@pytest.mark.parametrize(("api", "case"), BAD_CASES)
def test_a_bad_client_body_gets_one_4xx_in_the_apis_shape_and_never_reaches_the_replica(
    stack: HostileStack, api: str, case: str
) -> None:
    body, status, code = BAD_BODIES[api][case]
    probe = uuid.uuid4().hex
    try:
        response = httpx.post(
            f"{stack.url}/v1/{api}",
            content=body,
            headers={**AUTH, "content-type": "application/json", "x-hostile-probe": probe},
            timeout=BUDGET.timeout(20),
        )
    except httpx.TransportError as exc:
        pytest.fail(f"the gateway dropped the connection without an answer: {exc!r}", pytrace=False)
    assert response.status_code == status, (response.status_code, response.content[:300])
    headers = {k.lower(): v for k, v in response.headers.items()}
    assert_error_body(api, response.status_code, headers, response.content, code, schema=False)
    assert not [r for r in stack.replica.requests() if probe in r["headers"].get("x-hostile-probe", [])]


# --------------------------------------------------------------------------- and it keeps serving


@pytest.mark.parametrize("api", APIS)
def test_the_gateway_keeps_serving_both_apis(stack: HostileStack, api: str) -> None:
    envoy = stack.envoy_pid()
    assert envoy is not None and stack.restarts == 0, "the gateway or its Envoy died during the module"
    assert_normal_answer(stack, api, send(stack, api, None), 1)
    assert stack.envoy_pid() == envoy
    assert json.loads(hr.api_unary_body(api, "x"))  # the replica's own answer is JSON (self-check)
