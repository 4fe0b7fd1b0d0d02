"""Faithfulness: the simulator (router_testbed.sim) and real vLLM 0.32 answer the same request shapes
with the same event structure — keys and their order, role event, finish event, usage event, [DONE], error
shapes — on chat completions and completions, and on the Responses and Messages APIs (named events, their
order, sequence numbers, id forms, the chunked body's end, each API's error bodies, and the Responses store).

Text and ids are random, so only structure is compared. When vLLM changes, a failure here lists precisely
where the simulator must follow (every difference of a shape at once, not just the first).
"""

from __future__ import annotations

import contextlib
import json
import re
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest

from router_testbed.real_engine import Installation, VllmReplica
from router_testbed.sim.process import SimProcess, spawn
from tests.unit.sim_wire import parse_reply

TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}},
            "required": ["city"],
            "additionalProperties": False,
        },
        "strict": True,
    },
}
CHAT: dict[str, Any] = {
    "model": "tiny",
    "messages": [{"role": "user", "content": "Say something"}],
    "max_tokens": 8,
    "ignore_eos": True,
}
COMPLETION: dict[str, Any] = {
    "model": "tiny",
    "prompt": "Once upon a time",
    "max_tokens": 8,
    "ignore_eos": True,
}

# name -> (path, body as JSON or raw bytes)
SHAPES: dict[str, tuple[str, Any]] = {
    "chat_stream": ("/v1/chat/completions", {**CHAT, "stream": True}),
    "chat_stream_usage": (
        "/v1/chat/completions",
        {**CHAT, "stream": True, "stream_options": {"include_usage": True}},
    ),
    "chat_stream_continuous_usage": (
        "/v1/chat/completions",
        {**CHAT, "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}},
    ),
    "completions_stream": ("/v1/completions", {**COMPLETION, "stream": True}),
    "completions_stream_usage": (
        "/v1/completions",
        {**COMPLETION, "stream": True, "stream_options": {"include_usage": True}},
    ),
    "chat_stream_tool_required": (
        "/v1/chat/completions",
        {
            **CHAT,
            "stream": True,
            "max_tokens": 200,
            "ignore_eos": False,
            "tools": [TOOL],
            "tool_choice": "required",
            "parallel_tool_calls": False,  # else the random model keeps calling tools up to max_tokens
            "stream_options": {"include_usage": True},
        },
    ),
    "chat_non_stream": ("/v1/chat/completions", CHAT),
    "completions_non_stream": ("/v1/completions", COMPLETION),
    "err_bad_json": ("/v1/chat/completions", b'{"model": "tiny", "messages": [}'),
    "err_wrong_model": ("/v1/chat/completions", {**CHAT, "model": "nope", "stream": True}),
    "err_too_long": ("/v1/chat/completions", {**CHAT, "max_tokens": 5000, "stream": True}),
}

# Values kept verbatim in the structure (they are part of the contract); everything else becomes its type.
VERBATIM = {"object", "role", "finish_reason", "type", "code", "param"}


@pytest.fixture(scope="module")
def sim(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimProcess]:
    work: Path = tmp_path_factory.mktemp("faithfulness-sim")
    proc = spawn(
        name="sim",
        log_path=work / "sim.jsonl",
        args=["--prefill-delay", "0.01", "--token-interval", "0.001", "--max-model-len", "1024"],
    )
    try:
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def vllm(replicas: dict[str, VllmReplica]) -> VllmReplica:
    replica = replicas["a"]
    if getattr(replica, "started_with", None):  # another module's Responses store: these shapes need it off
        replica.env_extra = {}  # type: ignore[attr-defined]
        replica.restart(timeout=120.0)
    assert replica.healthy(), replica.tail()
    return replica


def structure(value: Any, key: str | None = None) -> Any:
    if isinstance(value, dict):
        return {k: structure(v, k) for k, v in value.items()}  # dicts keep key order
    if isinstance(value, list):
        return [structure(v) for v in value]
    if key in VERBATIM and (value is None or isinstance(value, str | int)):
        return value
    return type(value).__name__


def kind(payload: Any) -> str:
    """Classify one SSE payload."""
    if payload == "[DONE]":
        return "done"
    if "error" in payload:
        return "error"
    choices = payload.get("choices")
    if choices == []:
        return "usage"
    choice = choices[0]
    delta = choice.get("delta") or {}
    if choice.get("finish_reason"):
        return "finish"
    if "role" in delta:
        return "role"
    if delta.get("tool_calls"):
        return "tool_call_start" if delta["tool_calls"][0].get("id") else "tool_call_args"
    return "content"


def compressed(kinds: list[str]) -> list[str]:
    out: list[str] = []
    for k in kinds:
        if not out or out[-1] != k:
            out.append(k)
    return out


def sse_payloads(body: bytes) -> tuple[list[Any], bytes]:
    *events, rest = body.replace(b"\r\n", b"\n").split(b"\n\n")
    out: list[Any] = []
    for event in events:
        lines = [ln[5:].lstrip() for ln in event.split(b"\n") if ln.startswith(b"data:")]
        if lines:
            data = b"\n".join(lines)
            out.append("[DONE]" if data == b"[DONE]" else json.loads(data))
    return out, rest


def fetch(url: str, path: str, body: Any) -> dict[str, Any]:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(f"{url}{path}", content=content, headers={"content-type": "application/json"}, timeout=60)
    view: dict[str, Any] = {
        "status": r.status_code,
        "content-type": r.headers.get("content-type"),
        "chunked": r.headers.get("transfer-encoding") == "chunked",
        # x-sim-* headers are the simulator's own (replica name for tests), deliberately extra.
        "header_names": sorted(
            h for h in r.headers if h not in ("date", "content-length") and not h.startswith("x-sim-")
        ),
    }
    if r.headers.get("content-type", "").startswith("text/event-stream"):
        payloads, rest = sse_payloads(r.content)
        view["torn_tail"] = rest.strip() != b""
        view["sequence"] = compressed([kind(p) for p in payloads])
        by_kind: dict[str, Any] = {}
        for p in payloads:
            by_kind.setdefault(kind(p), structure(p))  # the first event of each kind
        view["events"] = by_kind
        view["content_key_orders"] = sorted(
            {json.dumps(list(p["choices"][0].keys())) for p in payloads if kind(p) == "content"}
        )
    else:
        view["body"] = structure(r.json())
    return view


def differences(a: Any, b: Any, where: str = "") -> list[str]:
    """Every place where two structures differ, with its path; key order counts."""
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        if list(a) != list(b):
            out.append(f"{where or '.'}: keys sim={list(a)} vllm={list(b)}")
        for k in a:
            if k in b:
                out += differences(a[k], b[k], f"{where}.{k}")
        return out
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [
            d for i, (x, y) in enumerate(zip(a, b, strict=True)) for d in differences(x, y, f"{where}[{i}]")
        ]
    return [] if a == b else [f"{where or '.'}: sim={a!r} vllm={b!r}"]


@pytest.mark.parametrize("shape", list(SHAPES))
def test_simulator_event_structure_matches_vllm(shape: str, sim: SimProcess, vllm: VllmReplica) -> None:
    path, body = SHAPES[shape]
    got_sim = fetch(sim.url, path, body)
    got_vllm = fetch(vllm.url, path, body)
    diffs = differences(got_sim, got_vllm)
    assert not diffs, f"simulator differs from vLLM 0.32 for {shape}:\n  " + "\n  ".join(diffs)


# --------------------------------------------------------------------------- the Responses and Messages APIs
#
# Named SSE events (``event:`` + ``data:``) read from the raw socket, so that the chunked body's end (or its
# absence) is compared too. A replica with the Responses store on (VLLM_ENABLE_RESPONSES_API_STORE=1, the
# simulator's --responses-store) answers the store's requests: GET, previous_response_id, background runs.

RESPONSES = "/v1/responses"
MESSAGES = "/v1/messages"
RESP: dict[str, Any] = {"model": "tiny", "input": "Say something", "max_output_tokens": 8, "temperature": 0}
RESP_TOOL = {
    "type": "function",
    "name": "get_weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
MSG: dict[str, Any] = {
    "model": "tiny",
    "max_tokens": 8,
    "messages": [{"role": "user", "content": "Say something"}],
    "temperature": 0,
}
MSG_TOOL = {"name": "get_weather", "input_schema": RESP_TOOL["parameters"]}

# name -> (method, path, body as JSON or raw bytes or None, headers)
API_SHAPES: dict[str, tuple[str, str, Any, dict[str, str]]] = {
    "responses_stream": ("POST", RESPONSES, {**RESP, "stream": True}, {"x-request-id": "faith-1"}),
    "responses_non_stream": ("POST", RESPONSES, RESP, {}),
    "responses_stream_tool_required": (
        "POST",
        RESPONSES,
        {**RESP, "stream": True, "max_output_tokens": 60, "tools": [RESP_TOOL], "tool_choice": "required"},
        {},
    ),
    "responses_err_bad_json": ("POST", RESPONSES, b'{"model": "tiny", "input": [}', {}),
    "responses_err_wrong_model": ("POST", RESPONSES, {**RESP, "model": "nope", "stream": True}, {}),
    "responses_err_no_input": ("POST", RESPONSES, {"model": "tiny", "stream": True}, {}),
    "responses_err_too_long": ("POST", RESPONSES, {**RESP, "max_output_tokens": 5000}, {}),
    "responses_err_previous_id": ("POST", RESPONSES, {**RESP, "previous_response_id": "resp_nope"}, {}),
    "responses_err_background_without_store": ("POST", RESPONSES, {**RESP, "background": True}, {}),
    "responses_err_background_store_false": (
        "POST",
        RESPONSES,
        {**RESP, "background": True, "store": False},
        {},
    ),
    "responses_get_without_store": ("GET", f"{RESPONSES}/resp_0123456789abcdef", None, {}),
    "messages_stream": ("POST", MESSAGES, {**MSG, "stream": True}, {"x-request-id": "faith-2"}),
    "messages_non_stream": ("POST", MESSAGES, MSG, {"x-request-id": "faith-3"}),
    "messages_stream_tool_any": (
        "POST",
        MESSAGES,
        {**MSG, "stream": True, "max_tokens": 40, "tools": [MSG_TOOL], "tool_choice": {"type": "any"}},
        {},
    ),
    "messages_err_bad_json": ("POST", MESSAGES, b'{"model": "tiny", "messages": [}', {}),
    "messages_err_wrong_model": ("POST", MESSAGES, {**MSG, "model": "nope", "stream": True}, {}),
    "messages_err_no_max_tokens": ("POST", MESSAGES, {"model": "tiny", "messages": MSG["messages"]}, {}),
    "messages_err_too_long": ("POST", MESSAGES, {**MSG, "max_tokens": 5000, "stream": True}, {}),
}
# Where the tiny model and the simulator cannot end alike: the random model never closes a tool call's
# arguments, the simulator's do close (a ``completed`` response, a ``tool_use`` stop); compared without them.
LOOSE = {"status", "incomplete_details", "stop_reason"}
NAMED_VERBATIM = VERBATIM | {"status", "stop_reason", "role", "model", "background", "tool_choice", "reason"}


def named_structure(value: Any, key: str | None = None, loose: bool = False) -> Any:
    if isinstance(value, dict):
        return {k: named_structure(v, k, loose) for k, v in value.items() if not (loose and k in LOOSE)}
    if isinstance(value, list):
        return [named_structure(v, None, loose) for v in value]
    if isinstance(value, str) and (form := _id_form(value)) is not None:
        return form
    if key in NAMED_VERBATIM and (value is None or isinstance(value, str | int | bool)):
        return value
    return None if value is None else type(value).__name__


_ID_FORMS = [
    (r"resp_[0-9a-f]{16}", "<resp_16hex>"),
    (r"msg_[0-9a-f]{16}", "<msg_16hex>"),
    (r"msg_[0-9a-f]{32}", "<msg_32hex>"),
    (r"fc_[0-9a-f]{16}", "<fc_16hex>"),
    (r"chatcmpl-tool-[0-9a-f]{16}", "<chatcmpl-tool-16hex>"),
    (r"chatcmpl-[0-9a-f]{16}", "<chatcmpl-16hex>"),
    (r"chatcmpl-faith-\d", "<chatcmpl-x-request-id>"),
]


def _id_form(value: str) -> str | None:
    return next((form for pattern, form in _ID_FORMS if re.fullmatch(pattern, value)), None)


def raw_exchange(
    base_url: str, method: str, path: str, body: Any = None, headers: dict[str, str] | None = None
) -> bytes:
    """Every byte of one exchange on a fresh connection (``connection: close``), read to the server's end."""
    url = urlsplit(base_url)
    payload = b"" if body is None else body if isinstance(body, bytes) else json.dumps(body).encode()
    lines = [f"{method} {path} HTTP/1.1", "host: x", "connection: close"]
    if body is not None:
        lines += ["content-type: application/json", f"content-length: {len(payload)}"]
    lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
    with socket.create_connection((url.hostname, url.port), timeout=120) as sock:
        sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode() + payload)
        chunks = []
        with contextlib.suppress(ConnectionResetError):
            while data := sock.recv(65536):
                chunks.append(data)
    return b"".join(chunks)


def named_view(raw: bytes, loose: bool = False) -> dict[str, Any]:
    reply = parse_reply(raw)
    headers = {k.lower() for k, _ in reply.headers} - {"date", "content-length", "connection"}
    view: dict[str, Any] = {
        "status": reply.status,
        "content-type": reply.header("content-type"),
        "chunked": reply.chunked,
        "terminated": reply.terminated,
        "header_names": sorted(h for h in headers if not h.startswith("x-sim-")),
    }
    if reply.chunked:
        events = reply.events()
        view["sequence"] = compressed([str(n) for n, _ in events])
        by_name: dict[str, Any] = {}
        for name, data in events:
            by_name.setdefault(str(name), named_structure(data, loose=loose))
        view["events"] = by_name
        numbers = [d.get("sequence_number") for _, d in events if isinstance(d, dict)]
        if numbers and numbers[0] is not None:
            view["sequence_numbers_consecutive"] = numbers == list(
                range(numbers[0], numbers[0] + len(numbers))
            )
    elif reply.header("content-type") == "application/json":
        view["body"] = named_structure(reply.json())
    else:
        view["body"] = reply.body.decode(errors="replace")
    return view


@pytest.mark.parametrize("shape", list(API_SHAPES))
def test_simulator_responses_and_messages_match_vllm(shape: str, sim: SimProcess, vllm: VllmReplica) -> None:
    method, path, body, headers = API_SHAPES[shape]
    loose = "tool" in shape
    got_sim = named_view(raw_exchange(sim.url, method, path, body, headers), loose)
    got_vllm = named_view(raw_exchange(vllm.url, method, path, body, headers), loose)
    diffs = differences(got_sim, got_vllm)
    assert not diffs, f"simulator differs from vLLM 0.32 for {shape}:\n  " + "\n  ".join(diffs)


class _StoreReplica(VllmReplica):
    """A vLLM replica with its Responses store on (vLLM's VLLM_ENABLE_RESPONSES_API_STORE=1)."""

    def env(self, tmp: Path) -> dict[str, str]:
        env = super().env(tmp)
        env["VLLM_ENABLE_RESPONSES_API_STORE"] = "1"
        return env


@pytest.fixture(scope="module")
def vllm_store(install: Installation, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmReplica]:
    replica = _StoreReplica("store", install, tmp_path_factory.mktemp("vllm-store"))
    replica.start(timeout=180.0)
    try:
        yield replica
    finally:
        replica.stop()


@pytest.fixture(scope="module")
def sim_store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimProcess]:
    work: Path = tmp_path_factory.mktemp("faithfulness-sim-store")
    proc = spawn(
        name="sim-store",
        log_path=work / "sim.jsonl",
        args=["--prefill-delay", "0.01", "--token-interval", "0.001", "--responses-store"],
    )
    try:
        yield proc
    finally:
        proc.stop()


def _store_views(url: str) -> dict[str, Any]:
    """The same conversation with the store on: keep, GET, continue, cancel, replay, background."""

    def post(body: Any) -> bytes:
        return raw_exchange(url, "POST", RESPONSES, body)

    def body_of(raw: bytes) -> Any:
        return parse_reply(raw).json()

    views: dict[str, Any] = {}
    first = post({**RESP, "max_output_tokens": 6})
    views["post"] = named_view(first)
    rid = body_of(first)["id"]
    views["get"] = named_view(raw_exchange(url, "GET", f"{RESPONSES}/{rid}"))
    views["get_unknown"] = named_view(raw_exchange(url, "GET", f"{RESPONSES}/resp_0123456789abcdef"))
    views["get_stream_not_background"] = named_view(
        raw_exchange(url, "GET", f"{RESPONSES}/{rid}?stream=true")
    )
    views["previous_known"] = named_view(post({**RESP, "stream": True, "previous_response_id": rid}))
    views["cancel_finished"] = named_view(raw_exchange(url, "POST", f"{RESPONSES}/{rid}/cancel"))
    unstored = body_of(post({**RESP, "store": False}))["id"]
    views["store_false_get"] = named_view(raw_exchange(url, "GET", f"{RESPONSES}/{unstored}"))
    queued = post({**RESP, "max_output_tokens": 6, "background": True})
    views["background_post"] = named_view(queued)
    qid = body_of(queued)["id"]
    deadline = time.monotonic() + 60
    while body_of(raw_exchange(url, "GET", f"{RESPONSES}/{qid}"))["status"] == "queued":
        assert time.monotonic() < deadline, "the background response never finished"
        time.sleep(0.1)
    views["background_done"] = named_view(raw_exchange(url, "GET", f"{RESPONSES}/{qid}"))
    streamed = post({**RESP, "max_output_tokens": 6, "background": True, "stream": True})
    views["background_stream"] = named_view(streamed)
    sid = parse_reply(streamed).events()[0][1]["response"]["id"]
    views["background_resume"] = named_view(
        raw_exchange(url, "GET", f"{RESPONSES}/{sid}?stream=true&starting_after=3")
    )
    long = body_of(post({**RESP, "max_output_tokens": 900, "background": True}))["id"]
    views["cancel_running"] = named_view(raw_exchange(url, "POST", f"{RESPONSES}/{long}/cancel"))
    views["cancelled_get"] = named_view(raw_exchange(url, "GET", f"{RESPONSES}/{long}"))
    return views


def test_simulator_responses_store_matches_vllm(sim_store: SimProcess, vllm_store: VllmReplica) -> None:
    got_sim = _store_views(sim_store.url)
    got_vllm = _store_views(vllm_store.url)
    diffs = differences(got_sim, got_vllm)
    assert not diffs, "simulator's Responses store differs from vLLM 0.32:\n  " + "\n  ".join(diffs)
