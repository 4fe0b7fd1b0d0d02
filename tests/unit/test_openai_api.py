from __future__ import annotations

import hashlib
import json
import math
from typing import Any

import pytest

from router_sidecar.core.openai_api import (
    MAX_MODEL_NAME_CHARS,
    ParsedRequest,
    RequestRejected,
    RouteKind,
    parse_request,
)

MODELS = frozenset({"tiny", "llama"})
LIMIT = 1 << 20


def parse(obj: Any, kind: RouteKind = RouteKind.CHAT, **kw: Any) -> ParsedRequest:
    body = obj if isinstance(obj, bytes) else json.dumps(obj).encode()
    kw.setdefault("max_body_bytes", LIMIT)
    kw.setdefault("known_models", MODELS)
    return parse_request(kind, body, **kw)


def rejected(obj: Any, kind: RouteKind = RouteKind.CHAT, **kw: Any) -> RequestRejected:
    with pytest.raises(RequestRejected) as info:
        parse(obj, kind, **kw)
    return info.value


CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hello"}]}


def test_chat_minimal() -> None:
    body = json.dumps(CHAT).encode()
    r = parse_request(RouteKind.CHAT, body, max_body_bytes=LIMIT, known_models=MODELS)
    assert r == ParsedRequest(
        kind=RouteKind.CHAT,
        model="tiny",
        stream=False,
        include_usage=False,
        continuous_usage=False,
        seed=None,
        max_tokens=None,
        has_tools=False,
        estimated_prompt_tokens=math.ceil(len("hello") / 4),
        input_digest="sha256:" + hashlib.sha256(body).hexdigest(),
    )


def test_chat_full_streaming() -> None:
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    r = parse(
        {
            **CHAT,
            "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
            "seed": 7,
            "max_tokens": 12,
            "n": 1,
            "tools": tools,
        }
    )
    assert (r.stream, r.include_usage, r.continuous_usage, r.seed, r.max_tokens, r.has_tools) == (
        True,
        True,
        True,
        7,
        12,
        True,
    )
    tools_bytes = len(json.dumps(tools, separators=(",", ":")))
    assert r.estimated_prompt_tokens == math.ceil((5 + tools_bytes) / 4)


def test_continuous_usage_needs_include_usage() -> None:
    # vLLM sends running usage only when include_usage is on too.
    r = parse({**CHAT, "stream": True, "stream_options": {"continuous_usage_stats": True}})
    assert (r.include_usage, r.continuous_usage) == (False, False)


def test_max_completion_tokens_and_null_stream() -> None:
    r = parse({**CHAT, "max_tokens": None, "max_completion_tokens": 30, "stream": None})
    assert r.max_tokens == 30
    assert r.stream is False


def test_known_models_none_accepts_any_model() -> None:
    assert parse({**CHAT, "model": "whatever"}, known_models=None).model == "whatever"


def test_estimate_counts_text_parts_multibyte_and_tool_call_arguments() -> None:
    messages = [
        {"role": "system", "content": "abcd"},
        {"role": "user", "content": [{"type": "text", "text": "\u00e9\u00e9"}, {"type": "image_url"}]},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"function": {"name": "f", "arguments": '{"a":1}'}}],
        },
        {"role": "tool", "content": "\u4f60"},
    ]
    r = parse({"model": "tiny", "messages": messages})
    assert r.estimated_prompt_tokens == math.ceil((4 + 4 + 7 + 3) / 4)


@pytest.mark.parametrize(
    ("prompt", "tokens"),
    [
        ("abcdefgh", 2),
        ("abcdefghi", 3),
        (["abcd", "efgh"], 2),
        ([1, 2, 3], 3),
        ([[1, 2], [3]], 3),
        ("", 0),
    ],
)
def test_completions_estimate(prompt: Any, tokens: int) -> None:
    r = parse({"model": "tiny", "prompt": prompt}, RouteKind.COMPLETIONS)
    assert r.kind is RouteKind.COMPLETIONS
    assert r.estimated_prompt_tokens == tokens


def test_completions_single_prompt_list_may_stream() -> None:
    assert parse({"model": "tiny", "prompt": ["one"], "stream": True}, RouteKind.COMPLETIONS).stream
    assert parse({"model": "tiny", "prompt": [1, 2, 3], "stream": True}, RouteKind.COMPLETIONS).stream


def test_digest_is_of_raw_bytes() -> None:
    a = b'{"model":"tiny","messages":[{"role":"user","content":"x"}]}'
    b = b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}]}'
    assert parse(a).input_digest != parse(b).input_digest
    assert parse(a).input_digest == "sha256:" + hashlib.sha256(a).hexdigest()


# --- rejections -------------------------------------------------------------------------------


def test_too_large() -> None:
    body = json.dumps(CHAT).encode()
    e = rejected(body, max_body_bytes=len(body) - 1)
    assert (e.status, e.code) == (413, "request_too_large")
    assert str(len(body) - 1) in e.message
    assert parse(body, max_body_bytes=len(body)).model == "tiny"  # the limit itself is allowed


def test_not_utf8() -> None:
    e = rejected(b'{"model": "\xff"}')
    assert (e.status, e.code) == (400, "invalid_json")
    assert "UTF-8" in e.message


def test_malformed_json_reports_position() -> None:
    e = rejected(b'{"model": "tiny",\n  "messages": [}')
    assert (e.status, e.code) == (400, "invalid_json")
    assert "line 2 column" in e.message
    assert "(char " in e.message


def test_nan_is_not_json() -> None:
    e = rejected(b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "temperature": NaN}')
    assert (e.status, e.code) == (400, "invalid_json")


@pytest.mark.parametrize("body", [b"[]", b'"x"', b"1", b"null", b"true"])
def test_top_level_not_object(body: bytes) -> None:
    e = rejected(body)
    assert (e.status, e.code) == (400, "invalid_request")


@pytest.mark.parametrize("model", [None, "", 3, ["tiny"]])
def test_missing_model(model: Any) -> None:
    obj = {**CHAT, "model": model}
    if model is None:
        del obj["model"]
    e = rejected(obj)
    assert (e.status, e.code, e.param) == (400, "missing_model", "model")


def test_a_model_name_longer_than_the_bound_is_refused() -> None:
    longest = "m" * MAX_MODEL_NAME_CHARS
    assert parse({**CHAT, "model": longest}, known_models=None).model == longest
    e = rejected({**CHAT, "model": "m" * (MAX_MODEL_NAME_CHARS + 1)})
    assert (e.status, e.code, e.param) == (400, "invalid_parameter", "model")
    assert f"at most {MAX_MODEL_NAME_CHARS}" in e.message


def test_model_not_found_lists_known() -> None:
    e = rejected({**CHAT, "model": "nope"})
    assert (e.status, e.code, e.param) == (404, "model_not_found", "model")
    assert "`nope`" in e.message
    assert "llama, tiny" in e.message


@pytest.mark.parametrize("messages", [None, [], "hi", {"role": "user"}])
def test_chat_needs_messages(messages: Any) -> None:
    obj = {"model": "tiny", "messages": messages}
    if messages is None:
        del obj["messages"]
    e = rejected(obj)
    assert (e.status, e.code, e.param) == (400, "missing_messages", "messages")


@pytest.mark.parametrize("obj", [{"model": "tiny"}, {"model": "tiny", "prompt": None}])
def test_completions_need_prompt(obj: dict[str, Any]) -> None:
    e = rejected(obj, RouteKind.COMPLETIONS)
    assert (e.status, e.code, e.param) == (400, "missing_prompt", "prompt")


@pytest.mark.parametrize("stream", ["true", 1, 0, {}])
def test_stream_must_be_bool(stream: Any) -> None:
    e = rejected({**CHAT, "stream": stream})
    assert (e.status, e.code, e.param) == (400, "invalid_parameter", "stream")


def test_n_greater_than_one_with_stream() -> None:
    e = rejected({**CHAT, "stream": True, "n": 2})
    assert (e.status, e.code, e.param) == (400, "unsupported", "n")
    assert "per single choice" in e.message
    assert parse({**CHAT, "n": 2}).stream is False  # not streamed: fine


def test_n_must_be_int() -> None:
    e = rejected({**CHAT, "stream": True, "n": "2"})
    assert (e.status, e.code, e.param) == (400, "invalid_parameter", "n")


def test_several_prompts_with_stream() -> None:
    e = rejected({"model": "tiny", "prompt": ["a", "b"], "stream": True}, RouteKind.COMPLETIONS)
    assert (e.status, e.code, e.param) == (400, "unsupported", "prompt")


def test_stream_options_must_be_object() -> None:
    e = rejected({**CHAT, "stream": True, "stream_options": True})
    assert (e.status, e.code, e.param) == (400, "invalid_parameter", "stream_options")


def test_rejection_body_shape() -> None:
    e = rejected({**CHAT, "model": "nope"})
    body = json.loads(e.body("req-42"))
    assert body == {
        "error": {
            "message": e.message,
            "type": "NotFoundError",
            "param": "model",
            "code": "model_not_found",
            "request_id": "req-42",
        }
    }
    assert json.loads(rejected(b"{").body("r"))["error"]["param"] is None
