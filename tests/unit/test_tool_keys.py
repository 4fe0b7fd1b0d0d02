"""The worker-side helper that derives a tool call's Idempotency-Key from the logical request."""

from __future__ import annotations

import re

import pytest

from router_sidecar.core.tool_keys import MAX_KEY_LENGTH, request_id_of, tool_idempotency_key

GATEWAY_CHARSET = re.compile(r"[A-Za-z0-9._:~-]{1,200}")


def test_ordinal_is_zero_padded() -> None:
    assert tool_idempotency_key("req_01JABC", 7) == "req_01JABC:call_07"
    assert tool_idempotency_key("req_01JABC", 1) == "req_01JABC:call_01"
    assert tool_idempotency_key("req_01JABC", 0) == "req_01JABC:call_00"
    assert tool_idempotency_key("req_01JABC", 123) == "req_01JABC:call_123"


def test_tool_call_id_is_used_as_is() -> None:
    key = tool_idempotency_key("req_01JABC", "chatcmpl-tool-9f1c2e")
    assert key == "req_01JABC:chatcmpl-tool-9f1c2e"


def test_same_logical_action_same_key_whatever_the_attempt() -> None:
    # nothing about the attempt goes in: two attempts of one request derive one key
    assert tool_idempotency_key("a1b2c3", 3) == tool_idempotency_key("a1b2c3", 3)
    assert tool_idempotency_key("a1b2c3", 3) != tool_idempotency_key("a1b2c3", 4)
    assert tool_idempotency_key("a1b2c3", 3) != tool_idempotency_key("a1b2c4", 3)


def test_envoy_uuid_request_id_and_charset() -> None:
    rid = "4c6f3a1e-7d2b-4e8f-9a0c-1b2c3d4e5f60"
    key = tool_idempotency_key(rid, 2)
    assert GATEWAY_CHARSET.fullmatch(key)
    assert tool_idempotency_key("a.b_c~d-e:f", 1) == "a.b_c~d-e:f:call_01"


def test_request_id_round_trip() -> None:
    for rid in ("req_01JABC", "4c6f3a1e-7d2b-4e8f", "tenant:req:9"):
        assert request_id_of(tool_idempotency_key(rid, 7)) == rid
        assert request_id_of(tool_idempotency_key(rid, "call-xyz")) == rid


@pytest.mark.parametrize(
    ("request_id", "call", "fragment"),
    [
        ("", 1, "non-empty"),
        ("req 1", 1, "charset"),
        ("req/1", 1, "'/'"),
        ("réq", 1, "charset"),
        ("req", -1, ">= 0"),
        ("req", True, "int ordinal"),
        ("req", 1.5, "int ordinal"),
        ("req", "", "non-empty"),
        ("req", "a:b", "may not contain ':'"),
        ("req", "a b", "charset"),
        ("r" * 195, 1, "over the limit of 200"),
    ],
)
def test_invalid_inputs_raise_value_error(request_id: str, call: object, fragment: str) -> None:
    with pytest.raises(ValueError, match=re.escape(fragment)):
        tool_idempotency_key(request_id, call)  # type: ignore[arg-type]


def test_length_limit_is_inclusive() -> None:
    rid = "r" * (MAX_KEY_LENGTH - len(":call_01"))
    assert len(tool_idempotency_key(rid, 1)) == MAX_KEY_LENGTH
    with pytest.raises(ValueError):
        tool_idempotency_key(rid + "r", 1)


@pytest.mark.parametrize("key", ["nocolon", ":call_01", "req:"])
def test_request_id_of_rejects_non_keys(key: str) -> None:
    with pytest.raises(ValueError, match="REQUEST_ID:CALL"):
        request_id_of(key)
