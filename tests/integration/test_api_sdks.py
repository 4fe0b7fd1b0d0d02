"""The official SDKs against the real gateway (real Envoy, real etcd, simulated replicas) on the Responses and
Messages APIs: what a caller of `openai` 3.x and `anthropic` 2.x sees of a retry before the first content
and of our terminal event after it (/tmp research notes §1, §2; docs/design.md#the-streaming-apis).

* `openai`: `client.responses.create(stream=True)` and the `client.responses.stream(...)` helper. The
  helper checks the stream's identity (every lifecycle event carries the first `response.created`'s id:
  "Lifecycle response identity changed") and refuses a repeated output index ("Duplicate response output
  index"): a retry that leaked the loser's preamble breaks it. Our `response.failed` comes to the caller as
  the SDK's typed `ResponseFailedEvent`, our fields on `.response.error`.
* `anthropic`: `client.messages.stream(...)` and `create(stream=True)` raise the SDK's own `APIStatusError`
  on our `event: error` (status 200, the stream's), `.type` an Anthropic error type, our code in
  `.error_code` (`error.details.error_code`) and in `.body`.

Both SDKs retry 5xx and 429 by themselves: `max_retries=0` here, so that what is seen is the gateway's.
Every request carries its own `Idempotency-Key`, so its journal record is found by it.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from tests.api_streams import INTERRUPTED
from tests.integration.api_helpers import Fleet, Fleets, body, expected_text, fleets_fixture

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")

pytestmark = pytest.mark.integration

API_KEY = "sdk-tenant"
AUTH = {"authorization": f"Bearer {API_KEY}"}

fleets = pytest.fixture(scope="module")(fleets_fixture)


@pytest.fixture
def vllm(fleets: Fleets) -> Fleet:
    return fleets["vllm"]


@pytest.fixture(params=["vllm", "sglang"])
def messages_fleet(request: pytest.FixtureRequest, fleets: Fleets) -> Fleet:
    return fleets[request.param]


def key(label: str) -> str:
    return f"sdk-{label}-{uuid.uuid4().hex[:8]}"


def headers(idem: str, fault: str | None = None) -> dict[str, str]:
    return {"idempotency-key": idem, **({"x-sim-fault": fault} if fault else {})}


def finished(fleet: Fleet, request_id: str) -> dict[str, Any]:
    return fleet.gw.wait_journal(
        request_id,
        lambda j: j["phase"] in ("completed", "interrupted", "failed", "cancelled", "rejected"),
        headers=AUTH,
    )


@pytest.fixture
def oai(vllm: Fleet) -> Iterator[Any]:
    client = openai.OpenAI(base_url=f"{vllm.url}/v1", api_key=API_KEY, max_retries=0, timeout=30)
    try:
        yield client
    finally:
        client.close()


def claude(fleet: Fleet) -> Any:
    return anthropic.Anthropic(base_url=fleet.url, api_key=API_KEY, max_retries=0, timeout=30)


PROMPT = "hello there"


def responses_args(n: int) -> dict[str, Any]:
    return {"model": "tiny", "input": PROMPT, "max_output_tokens": n}


def messages_args(n: int) -> dict[str, Any]:
    return {"model": "tiny", "max_tokens": n, "messages": [{"role": "user", "content": PROMPT}]}


# --- openai: the Responses API ------------------------------------------------------------------------------


def test_openai_create_stream_after_a_retry_sees_one_response(vllm: Fleet, oai: Any) -> None:
    idem = key("oai-create-retry")
    events = list(
        oai.responses.create(
            stream=True, **responses_args(5), extra_headers=headers(idem, "reset@token:1 attempt=1")
        )
    )
    types = [type(e).__name__ for e in events]
    assert types.count("ResponseCreatedEvent") == 1 and types[-1] == "ResponseCompletedEvent", types
    assert len({e.response.id for e in events if hasattr(e, "response")}) == 1
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if type(e).__name__ == "ResponseTextDeltaEvent")
    assert text == expected_text("responses", body("responses", 5, prompt=PROMPT))
    journal = finished(vllm, idem)
    assert (journal["phase"], journal["attempt"]) == ("completed", 2)
    assert journal["attempts"][0]["detail"] == "connection_lost"


@pytest.mark.parametrize("fault", ["reset@token:1 attempt=1", "close@token:1 attempt=1"])
def test_openai_stream_helper_after_a_retry_keeps_one_identity(vllm: Fleet, oai: Any, fault: str) -> None:
    """The helper raises "Lifecycle response identity changed" on a second `response.created` and "Duplicate
    response output index" on the loser's leaked items: neither happens, the final response is whole."""
    idem = key("oai-helper-retry")
    with oai.responses.stream(**responses_args(6), extra_headers=headers(idem, fault)) as stream:
        seen = [event.type for event in stream]
        final = stream.get_final_response()
    assert seen.count("response.created") == 1 and seen[-1] == "response.completed", seen
    assert final.output_text == expected_text("responses", body("responses", 6, prompt=PROMPT))
    assert final.usage.output_tokens == 6
    [attempt] = [a for a in vllm.attempts_logged(idem, 2) if a["outcome"] == "completed"]
    assert final.id == attempt["response_id"]
    assert finished(vllm, idem)["attempt"] == 2


@pytest.mark.parametrize("fault", ["close@after:2", "close@terminal", "oversize@token:3"])
def test_openai_create_stream_yields_our_response_failed_as_its_typed_event(
    vllm: Fleet, oai: Any, fault: str
) -> None:
    idem = key("oai-create-failed")
    events = list(oai.responses.create(stream=True, **responses_args(8), extra_headers=headers(idem, fault)))
    last = events[-1]
    assert isinstance(last, openai.types.responses.ResponseFailedEvent), type(last)
    assert [type(e).__name__ for e in events].count("ResponseFailedEvent") == 1
    created = events[0]
    assert isinstance(created, openai.types.responses.ResponseCreatedEvent)
    assert last.response.id == created.response.id and last.response.status == "failed"
    assert last.sequence_number == events[-2].sequence_number + 1
    deltas = [e for e in events if isinstance(e, openai.types.responses.ResponseTextDeltaEvent)]
    error = last.response.error
    assert error.code == INTERRUPTED
    # Our fields beyond OpenAI's are kept by the SDK on the typed error.
    assert error.request_id == idem and error.partial_output is True and error.retryable is False
    assert error.delivered_output_tokens == len(deltas)
    journal = finished(vllm, idem)
    assert (journal["phase"], journal["delivered_output_tokens"]) == ("interrupted", len(deltas))


def test_openai_stream_helper_yields_our_response_failed_and_has_no_final_response(
    vllm: Fleet, oai: Any
) -> None:
    idem = key("oai-helper-failed")
    with oai.responses.stream(**responses_args(8), extra_headers=headers(idem, "close@after:3")) as stream:
        events = list(stream)
        failed = events[-1]
        assert isinstance(failed, openai.types.responses.ResponseFailedEvent), [e.type for e in events]
        # The helper filled the failed response's output with what was delivered (ours carries none).
        assert failed.response.output[0].content[0].text == expected_text(
            "responses", body("responses", 8, prompt=PROMPT), 3
        )
        assert failed.response.error.code == INTERRUPTED
        assert failed.response.error.delivered_output_tokens == 3
        with pytest.raises(RuntimeError, match=r"response\.completed"):
            stream.get_final_response()
    assert finished(vllm, idem)["delivered_output_tokens"] == 3


def test_openai_raises_its_status_error_with_our_code_when_every_attempt_failed(oai: Any) -> None:
    idem = key("oai-all-failed")
    with pytest.raises(openai.InternalServerError) as caught:
        oai.responses.create(
            stream=True, **responses_args(5), extra_headers=headers(idem, "status503@headers")
        )
    error = caught.value
    assert error.status_code == 502 and error.code == "retries_exhausted"
    assert error.body["request_id"] == idem and error.request_id == idem  # the body and x-request-id
    with pytest.raises(openai.RateLimitError) as limited:
        oai.responses.create(**responses_args(5), extra_headers=headers(key("oai-429"), "status429@headers"))
    assert limited.value.code == "replicas_overloaded"


# --- anthropic: the Messages API ----------------------------------------------------------------------------


def test_anthropic_stream_after_a_retry_is_one_whole_message(messages_fleet: Fleet) -> None:
    idem = key("claude-retry")
    retried = headers(idem, "reset@token:1 attempt=1")
    with (
        claude(messages_fleet) as client,
        client.messages.stream(**messages_args(6), extra_headers=retried) as s,
    ):
        kinds = [event.type for event in s]
        message = s.get_final_message()
    assert kinds.count("message_start") == 1 and kinds[-1] == "message_stop", kinds
    assert message.stop_reason == "max_tokens" and message.usage.output_tokens == 6
    assert message.content[0].text == expected_text("messages", body("messages", 6, prompt=PROMPT))
    # The replica logs an attempt once its response has ended: after the client has read it, maybe.
    [attempt] = [a for a in messages_fleet.attempts_logged(idem, 2) if a["outcome"] == "completed"]
    assert message.id == attempt["response_id"]
    assert finished(messages_fleet, idem)["attempt"] == 2


@pytest.mark.parametrize("fault", ["error@token:3", "close@after:2", "oversize@token:3"])
def test_anthropic_stream_raises_its_api_status_error_on_our_terminal_event(
    messages_fleet: Fleet, fault: str
) -> None:
    idem = key("claude-failed")
    texts: list[str] = []
    with (
        claude(messages_fleet) as client,
        pytest.raises(anthropic.APIStatusError) as caught,
        client.messages.stream(**messages_args(8), extra_headers=headers(idem, fault)) as stream,
    ):
        texts.extend(stream.text_stream)
    error = caught.value
    assert type(error) is anthropic.APIStatusError and error.status_code == 200  # the stream's status
    assert error.type == "api_error" and error.error_code == INTERRUPTED
    assert error.body["request_id"] == idem and error.body["error"]["request_id"] == idem
    assert error.body["error"]["delivered_output_tokens"] == len(texts) == 2
    assert "".join(texts) == expected_text("messages", body("messages", 8, prompt=PROMPT), 2)
    journal = finished(messages_fleet, idem)
    assert (journal["phase"], journal["delivered_output_tokens"]) == ("interrupted", 2)


def test_anthropic_create_stream_raises_on_a_clean_end_without_message_stop(messages_fleet: Fleet) -> None:
    idem = key("claude-create")
    seen: list[str] = []
    with claude(messages_fleet) as client, pytest.raises(anthropic.APIStatusError) as caught:
        for event in client.messages.create(
            stream=True, **messages_args(5), extra_headers=headers(idem, "close@terminal")
        ):
            seen.append(event.type)
    assert caught.value.type == "api_error" and caught.value.error_code == INTERRUPTED
    assert caught.value.body["error"]["delivered_output_tokens"] == 5
    assert seen.count("message_start") == 1 and "message_stop" not in seen


def test_anthropic_raises_its_status_error_class_when_every_attempt_failed(messages_fleet: Fleet) -> None:
    with claude(messages_fleet) as client:
        idem = key("claude-all-failed")
        with pytest.raises(anthropic.InternalServerError) as caught:
            client.messages.create(**messages_args(5), extra_headers=headers(idem, "status503@headers"))
        assert caught.value.status_code == 502 and caught.value.type == "api_error"
        assert caught.value.error_code == "retries_exhausted" and caught.value.body["request_id"] == idem
        with pytest.raises(anthropic.RateLimitError) as limited:
            client.messages.create(
                stream=True, **messages_args(5), extra_headers=headers(key("claude-429"), "status429@headers")
            )
        assert limited.value.type == "rate_limit_error" and limited.value.error_code == "replicas_overloaded"
