"""The Responses API (`POST /v1/responses`) and the Messages API (`POST /v1/messages`) in the real-engine
tiers: the clients (the `openai` SDK's `responses.create` and the `anthropic` SDK's `messages.create`, each
over a transport that keeps the raw bytes), what counts as content, and the checks both engines are held to.

The contract on these routes (docs/design.md#the-streaming-apis): the preamble (`response.created` with the
replica's `resp_…` id and sequence numbers from 0, `message_start`, an opened text block) is held until the
first content, so a retry before it is invisible: one `response.created` / `message_start`, one id, sequence
numbers 0, 1, 2, … without a gap. After the first content the stream ends with a transport reset or exactly
one terminal event in the API's own shape: Responses `event: response.failed` (the client's response id, the
next sequence number, our error fields), Messages `event: error` (an Anthropic error type, our code). The
journal says `interrupted`, with the delivered count taken from the content events (neither API carries
usage before its end).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import anthropic
import httpx
import httpx2
import openai

from tests.harness import Gateway
from tests.real_engine.client import Named, Streamed, anthropic_client, named_events, sdk_client
from tests.real_engine.tier import MESSAGES, serving_attempt, terminal_journal

RESPONSES_PATH = "/v1/responses"
MESSAGES_PATH = "/v1/messages"
PATHS = {"responses": RESPONSES_PATH, "messages": MESSAGES_PATH}
PROMPT = MESSAGES[0]["content"]  # the same prompt as the chat tests: 25 tokens with the tiny model's template
INTERRUPTED = "upstream_decode_interrupted"
# Anthropic's error types (anthropic 2.17 `types/shared/error_type.py`).
ANTHROPIC_ERROR_TYPES = {
    "invalid_request_error",
    "authentication_error",
    "billing_error",
    "permission_error",
    "not_found_error",
    "rate_limit_error",
    "timeout_error",
    "api_error",
    "overloaded_error",
}
# Responses output items whose opening is content (a tool's name, a server-side action).
CALL_ITEMS = {"function_call", "custom_tool_call", "mcp_call", "web_search_call", "code_interpreter_call"}
OnEvent = Callable[[Any, Streamed], bool]


# --------------------------------------------------------------------------- clients


def stream_responses(
    base_url: str,
    *,
    max_tokens: int,
    on_event: OnEvent | None = None,
    headers: dict[str, str] | None = None,
    read_timeout: float = 60.0,
    body: dict[str, Any] | None = None,
) -> Streamed:
    """One streamed Responses request with the openai SDK (`responses.create(stream=True)`, which yields the
    events as they come, our `response.failed` too); `on_event` returning True makes the client leave."""
    client, tee = sdk_client(base_url, read_timeout=read_timeout)
    result = Streamed()
    try:
        stream = client.responses.create(
            model="tiny",
            input=PROMPT,
            stream=True,
            max_output_tokens=max_tokens,
            extra_headers=headers,
            extra_body=body,
        )
        result.status, result.headers = tee.status, tee.headers
        result.read(stream, on_event)
    except Exception as exc:  # a reset, an HTTP error: recorded, asserted on by the test
        result.error = exc
    finally:
        result.raw = bytes(tee.raw)
        result.status, result.headers = result.status or tee.status, result.headers or tee.headers
        client.close()
    return result


def stream_messages(
    base_url: str,
    *,
    max_tokens: int,
    on_event: OnEvent | None = None,
    headers: dict[str, str] | None = None,
    read_timeout: float = 60.0,
    body: dict[str, Any] | None = None,
) -> Streamed:
    """One streamed Messages request with the anthropic SDK (`messages.create(stream=True)`, which raises
    `APIStatusError` on an `event: error`); `on_event` returning True makes the client leave."""
    client, tee = anthropic_client(base_url, read_timeout=read_timeout)
    result = Streamed()
    try:
        stream = client.messages.create(
            model="tiny",
            max_tokens=max_tokens,
            messages=MESSAGES,  # type: ignore[arg-type]
            stream=True,
            extra_headers=headers,
            extra_body=body,
        )
        result.status, result.headers = tee.status, tee.headers
        result.read(stream, on_event)
    except Exception as exc:
        result.error = exc
    finally:
        result.raw = bytes(tee.raw)
        result.status, result.headers = result.status or tee.status, result.headers or tee.headers
        client.close()
    return result


STREAM: dict[str, Callable[..., Streamed]] = {"responses": stream_responses, "messages": stream_messages}


def reference_body(api: str, max_tokens: int, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """The body the client above sends, to send the same request straight to a replica."""
    if api == "responses":
        body = {"model": "tiny", "input": PROMPT, "stream": True, "max_output_tokens": max_tokens}
    else:
        body = {"model": "tiny", "max_tokens": max_tokens, "messages": MESSAGES, "stream": True}
    return {**body, **(extra or {})}


def direct_events(url: str, api: str, body: dict[str, Any]) -> list[Named]:
    response = httpx.post(f"{url}{PATHS[api]}", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return named_events(response.content)


# --------------------------------------------------------------------------- content


def responses_content(data: dict[str, Any]) -> bool:
    """A non-empty `*.delta`, or an opened call item (docs/design.md: the Responses API's first content)."""
    kind = str(data.get("type", ""))
    if kind.endswith(".delta"):
        return isinstance(data.get("delta"), str) and bool(data["delta"])
    if kind == "response.output_item.added":
        return (data.get("item") or {}).get("type") in CALL_ITEMS
    return False


def messages_content(data: dict[str, Any]) -> bool:
    """A `content_block_delta` with text, thinking or a tool's input, or an opened `tool_use` block."""
    kind = data.get("type")
    if kind == "content_block_delta":
        delta = data.get("delta") or {}
        return any(isinstance(delta.get(k), str) and delta[k] for k in ("text", "thinking", "partial_json"))
    if kind == "content_block_start":
        return (data.get("content_block") or {}).get("type") in ("tool_use", "server_tool_use")
    return False


CONTENT = {"responses": responses_content, "messages": messages_content}


def sdk_content(api: str) -> Callable[[Any], bool]:
    """The content rule on the SDK's event objects (for AtFirstDelta and the clients' `on_event`)."""
    rule = CONTENT[api]
    return lambda event: rule(event.model_dump())


def leave_after(api: str, n: int) -> OnEvent:
    """An `on_event` that makes the client leave once it has read `n` content events."""
    rule = sdk_content(api)
    return lambda event, so_far: sum(1 for e in so_far.chunks if rule(e)) >= n


def content_count(api: str, events: list[Named]) -> int:
    return sum(1 for e in events if CONTENT[api](e.data))


# --------------------------------------------------------------------------- what the client got


def _wire(result: Streamed) -> list[Named]:
    """The events on the wire, each named by an `event:` line equal to its `type`."""
    assert result.status == 200 and result.request_id, (result.status, result.headers, result.raw[:500])
    assert result.headers.get("content-type", "").startswith("text/event-stream"), result.headers
    events = named_events(result.raw)
    assert events, result.raw[:500]
    unnamed = [(e.name, e.data.get("type")) for e in events if e.name != e.data.get("type")]
    assert not unnamed, f"events whose event: line is not their type: {unnamed}"
    return events


def _one_responses_preamble(events: list[Named]) -> str:
    """One `response.created`, first; sequence numbers 0, 1, 2, … without a gap; one response id
    throughout; one output item."""
    names = [e.name for e in events]
    assert names[0] == "response.created" and names.count("response.created") == 1, names[:6]
    sequence = [e.data.get("sequence_number") for e in events]
    assert sequence == list(range(len(events))), f"sequence numbers: {sequence}"
    ids = {e.data["response"]["id"] for e in events if isinstance(e.data.get("response"), dict)}
    assert len(ids) == 1, f"several response ids reached the client: {ids}"
    item_ids = {e.data["item_id"] for e in events if "item_id" in e.data}
    item_ids |= {e.data["item"]["id"] for e in events if isinstance(e.data.get("item"), dict)}
    assert len(item_ids) <= 1, f"several output items (attempts) reached the client: {item_ids}"
    return ids.pop()


def _one_message_start(events: list[Named]) -> str:
    names = [e.name for e in events]
    assert names[0] == "message_start" and names.count("message_start") == 1, names[:6]
    return str(events[0].data["message"]["id"])


def assert_responses_whole(result: Streamed) -> tuple[list[Named], int]:
    """One complete Responses stream from one attempt, as the engine ends it: `response.completed` (vLLM's
    with status `incomplete` at max_output_tokens) or `response.incomplete` (SGLang), last, and nothing torn
    after it; the SDK yielded the same events and raised nothing. Returns the events and the output tokens."""
    assert result.error is None, f"{result.error!r}\n{result.raw[-1500:]!r}"
    events = _wire(result)
    response_id = _one_responses_preamble(events)
    names = [e.name for e in events]
    assert names[-1] in ("response.completed", "response.incomplete"), names[-3:]
    assert not {"response.failed", "error"} & set(names), names
    assert result.raw.endswith(b"\n\n") and not result.torn_tail()
    assert [getattr(e, "type", None) for e in result.chunks] == names
    text = "".join(e.data["delta"] for e in events if e.name == "response.output_text.delta")
    done = [e.data["text"] for e in events if e.name == "response.output_text.done"]
    assert text and done == [text], (text, done)
    final = events[-1].data["response"]
    assert final["id"] == response_id and final["status"] in ("completed", "incomplete")
    return events, int(final["usage"]["output_tokens"])


def assert_messages_whole(result: Streamed) -> tuple[list[Named], int]:
    """One complete Messages stream from one attempt: one `message_start` first, the text block, a
    `message_delta` with the stop reason and the output tokens, `message_stop` last, no `error`."""
    assert result.error is None, f"{result.error!r}\n{result.raw[-1500:]!r}"
    events = _wire(result)
    _one_message_start(events)
    names = [e.name for e in events]
    assert names[-1] == "message_stop" and names.count("message_stop") == 1, names[-3:]
    assert "error" not in names, names
    assert result.raw.endswith(b"\n\n") and not result.torn_tail()
    assert [getattr(e, "type", None) for e in result.chunks] == names
    [delta] = [e.data for e in events if e.name == "message_delta"]
    assert delta["delta"]["stop_reason"] in ("max_tokens", "end_turn"), delta
    text = "".join(e.data["delta"].get("text", "") for e in events if e.name == "content_block_delta")
    assert text
    return events, int(delta["usage"]["output_tokens"])


WHOLE = {"responses": assert_responses_whole, "messages": assert_messages_whole}


_ID = re.compile(r"^(resp|msg|chatcmpl|fc|rs|call|ctc)([-_])[A-Za-z0-9_-]+$")


def normalized(api: str, events: list[Named]) -> tuple[list[Any], str]:
    """A stream without what differs between two runs of the same greedy request: its ids (`resp_…`,
    `msg_…`, `chatcmpl-…`), timestamps, prefix-cache hits, sequence numbers, and how its text was cut into
    delta events (the engine coalesces tokens when its reader lags). Returns the other events and the text of
    the deltas."""

    def norm(value: Any, key: str | None = None) -> Any:
        if isinstance(value, dict):
            return {k: norm(v, k) for k, v in value.items() if k != "sequence_number"}
        if isinstance(value, list):
            return [norm(v) for v in value]
        if key in (
            "created_at",
            "cached_tokens",
        ):  # a clock; the prefix cache's hits (SGLang: the same prompt)
            return type(value).__name__
        if isinstance(value, str) and (m := _ID.match(value)):
            return m.group(1) + m.group(2) + "…"
        return value

    delta = "response.output_text.delta" if api == "responses" else "content_block_delta"
    text = "".join(
        e.data["delta"] if api == "responses" else e.data["delta"].get("text", "")
        for e in events
        if e.name == delta
    )
    return [(e.name, norm(e.data)) for e in events if e.name != delta], text


# --------------------------------------------------------------------------- the journal


def assert_completed(gateway: Gateway, request_id: str, output_tokens: int) -> dict[str, Any]:
    """Journaled completed, the whole answer counted as delivered, from the API's own usage."""
    journal = terminal_journal(gateway, request_id)
    assert journal["phase"] == "completed", journal
    serving_attempt(journal)
    assert journal["delivered_output_tokens"] == output_tokens, journal
    assert journal["delivered_output_tokens_source"] == "usage", journal
    return journal


# --------------------------------------------------------------------------- after the first content


def assert_prefix_then_reset_or_terminal_event(
    api: str, gateway: Gateway, result: Streamed
) -> tuple[dict[str, Any], dict[str, Any] | None, int]:
    """The serving replica failed after the first content: the client got a prefix from one attempt (one
    preamble, one id, gapless sequence numbers), then a transport reset or exactly one terminal event in the
    API's shape, and nothing after it; the journal says interrupted and counts the content events. Returns the
    journal, the terminal event's data (None after a reset) and the client's count of content events."""
    events = _wire(result)
    names = [e.name for e in events]
    content = content_count(api, events)
    assert content >= 1, names
    if api == "responses":
        response_id = _one_responses_preamble(events)
        assert not {"response.completed", "response.incomplete", "error"} & set(names), names[-5:]
        terminal = [e for e in events if e.name == "response.failed"]
    else:
        _one_message_start(events)
        assert "message_stop" not in names and "message_delta" not in names, names[-5:]
        terminal = [e for e in events if e.name == "error"]
    assert len(terminal) <= 1, terminal
    assert result.error is not None or terminal, "the stream ended as if complete"
    event = terminal[0].data if terminal else None
    if terminal:
        assert events[-1] is terminal[0] and result.raw.endswith(b"\n\n"), (
            "something followed the terminal event"
        )
        assert not result.torn_tail()
    if event is not None and api == "responses":
        # The openai SDK yields it as its typed event (it raises nothing while iterating).
        assert result.error is None, repr(result.error)
        assert getattr(result.chunks[-1], "type", None) == "response.failed"
        assert result.chunks[-1].response.error.code == INTERRUPTED
        response = event["response"]
        assert response["id"] == response_id and response["status"] == "failed", response
        error = response["error"]
        assert error["code"] == INTERRUPTED and error["message"], error
        assert error["request_id"] == result.request_id
        assert error["partial_output"] is True and error["retryable"] is False
        assert error["delivered_output_tokens"] == content, (error, content)
    elif event is not None:
        # Anthropic's shape; the anthropic SDK raises APIStatusError (status 200, its `type` the error type).
        assert event["type"] == "error" and event["request_id"] == result.request_id, event
        error = event["error"]
        assert error["type"] in ANTHROPIC_ERROR_TYPES, error
        assert error["code"] == INTERRUPTED and error["details"] == {"error_code": INTERRUPTED}, error
        assert error["partial_output"] is True and error["retryable"] is False and error["message"]
        assert error["delivered_output_tokens"] == content, (error, content)
        raised = result.error
        assert isinstance(raised, anthropic.APIStatusError), repr(raised)
        assert raised.status_code == 200 and raised.type == error["type"], (raised.status_code, raised.type)
        assert raised.error_code == INTERRUPTED and raised.request_id == result.request_id
    else:
        resets = (
            httpx.TransportError,
            httpx2.TransportError,
            openai.APIConnectionError,
            anthropic.APIConnectionError,
        )
        assert isinstance(result.error, resets), repr(result.error)
    journal = terminal_journal(gateway, result.request_id)
    assert journal["phase"] == "interrupted", journal
    assert journal["first_delta_sent"] is True
    assert journal["delivered_output_tokens_source"] == "content_events", journal
    if event is not None:  # a clean end: exactly what the client got
        assert journal["delivered_output_tokens"] == content, (journal, content)
    else:  # a reset: what was in flight was delivered (written towards the client) but never read
        assert journal["delivered_output_tokens"] >= content, (journal, content)
    return journal, event, content
