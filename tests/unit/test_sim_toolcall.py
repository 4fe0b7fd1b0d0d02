"""Agent-worker mode helpers of the simulator (pure parts): URL, body, reply parsing, output rewrite."""

from __future__ import annotations

import hashlib
import json

import pytest

from router_testbed.sim import generation as gen
from router_testbed.sim.server import build_parser, config_from_args
from router_testbed.sim.toolcall import (
    ToolOutcome,
    ToolReply,
    parse_tool_url,
    tool_args,
    tool_body,
    tool_failed_error,
    with_tool_result,
)


def chat_req(prompt: str = "hello", **kw: object) -> gen.GenRequest:
    body = {"model": "tiny", "messages": [{"role": "user", "content": prompt}], "max_tokens": 3, **kw}
    return gen.parse_request("chat", json.dumps(body).encode(), served_model="tiny")


def test_parse_tool_url() -> None:
    t = parse_tool_url("http://127.0.0.1:8080/tools/payments/charge?x=1")
    assert (t.host, t.port, t.target, t.host_header) == (
        "127.0.0.1",
        8080,
        "/tools/payments/charge?x=1",
        "127.0.0.1:8080",
    )
    assert parse_tool_url("http://gw/tools/a/b").port == 80
    assert parse_tool_url("http://[::1]:9/t").host_header == "[::1]:9"
    for bad in ("https://gw/tools/a/b", "gw:80/tools", "http:///tools/a", "http://gw:notaport/x"):
        with pytest.raises(ValueError):
            parse_tool_url(bad)


def test_cli_options() -> None:
    cfg = config_from_args(["--listen", "127.0.0.1:0", "--tool-url", "http://127.0.0.1:1/tools/p/c"])
    assert cfg.tool_url == "http://127.0.0.1:1/tools/p/c" and cfg.tool_timeout == 5.0
    cfg = config_from_args(["--listen", "127.0.0.1:0", "--tool-timeout", "0.5"])
    assert cfg.tool_url is None and cfg.tool_timeout == 0.5
    for bad in (["--tool-url", "https://x/y"], ["--tool-timeout", "0"], ["--tool-timeout", "nan"]):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["--listen", "127.0.0.1:0", *bad])


def test_tool_body_is_deterministic_from_prompt() -> None:
    a, b = chat_req("pay 5"), chat_req("pay 5")
    assert tool_args(a) == tool_args(b)
    assert tool_args(a) != tool_args(chat_req("pay 6"))
    body = json.loads(tool_body("req_1", "att_1", a))
    assert body == {"request_id": "req_1", "call": 1, "args": tool_args(a)}
    # Another attempt of the same logical action sends the very same bytes.
    assert tool_body("req_1", "att_2", a) == tool_body("req_1", "att_1", a)
    digest = hashlib.sha256(b"tiny\0user: pay 5").hexdigest()
    assert body["args"]["prompt_sha256"] == digest[:16]


def test_reply_replayed_and_result() -> None:
    r = ToolReply(200, {"x-idempotent-replay": "true"}, b'{"result":"ok-3","execution":3}')
    assert r.ok and r.replayed and r.result() == "ok-3"
    assert not ToolReply(200, {}, b"{}").replayed
    assert ToolReply(200, {}, b"not json").result() is None
    assert ToolReply(200, {}, b'{"result":5}').result() is None
    assert not ToolReply(409, {}, b"").ok


def test_with_tool_result_replaces_first_content_only() -> None:
    greq = chat_req()
    out = gen.plan_output(greq, 0)
    new = with_tool_result(out, "ok-1")
    assert new.pieces[0] == {"content": "tool:ok-1"}
    assert new.pieces[1:] == out.pieces[1:] and len(new.pieces) == len(out.pieces)
    comp = gen.parse_request(
        "completion", b'{"model":"tiny","prompt":"x","max_tokens":2}', served_model="tiny"
    )
    assert with_tool_result(gen.plan_output(comp, 0), "ok-2").pieces[0] == "tool:ok-2"
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    tool_out = gen.plan_output(chat_req(tools=tools, tool_choice="required"), 0)
    assert with_tool_result(tool_out, "ok-3") == tool_out


def test_tool_failed_error_is_vllm_shaped_502() -> None:
    body = json.loads(
        tool_failed_error(ToolOutcome(key="r:call_01", status=409, error="tool answered HTTP 409"))
    )
    assert body["error"]["code"] == 502 and body["error"]["type"] == "BadGatewayError"
    assert "tool status 409" in body["error"]["message"] and "r:call_01" in body["error"]["message"]
    body = json.loads(tool_failed_error(ToolOutcome(key="r:call_01", error="ConnectionRefusedError: x")))
    assert "tool status none" in body["error"]["message"]
