"""Faithfulness: the simulator (router_testbed.sim) and real vLLM 0.32 answer the same request shapes
with the same event structure — keys and their order, role event, finish event, usage event, [DONE], error
shapes.

Text and ids are random, so only structure is compared. When vLLM changes, a failure here lists precisely
where the simulator must follow (every difference of a shape at once, not just the first).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from router_testbed.real_engine import VllmReplica
from router_testbed.sim.process import SimProcess, spawn

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
