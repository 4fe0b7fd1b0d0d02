"""Faithfulness of the simulator's SGLang dialect on the Messages and Responses routes: `--dialect sglang`
and a real SGLang 0.5.23 replica answer the same requests with the same structure (named events, their order,
key order, id forms, the chunked body's end, error bodies; SGLang's /v1/responses as it is for this model: a
text/plain 500). Random text is compared as types, as in tests/real_engine/test_sim_faithfulness.py."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from router_testbed.real_engine import SglangReplica
from router_testbed.sim.process import SimProcess, spawn
from tests.real_engine.test_sim_faithfulness import (
    MESSAGES,
    MSG,
    RESP,
    RESPONSES,
    differences,
    named_view,
    raw_exchange,
)

SHAPES: dict[str, tuple[str, str, Any, dict[str, str]]] = {
    "messages_stream": ("POST", MESSAGES, {**MSG, "stream": True}, {"x-request-id": "faith-s1"}),
    "messages_non_stream": ("POST", MESSAGES, MSG, {}),
    "messages_stream_any_model": ("POST", MESSAGES, {**MSG, "model": "nope", "stream": True}, {}),
    "messages_err_bad_json": ("POST", MESSAGES, b'{"model": "tiny", "messages": [}', {}),
    "messages_err_no_max_tokens": ("POST", MESSAGES, {"model": "tiny", "messages": MSG["messages"]}, {}),
    "messages_refused_too_long": ("POST", MESSAGES, {**MSG, "max_tokens": 5000, "stream": True}, {}),
    "responses_stream": ("POST", RESPONSES, {**RESP, "stream": True}, {}),
    "responses_get": ("GET", f"{RESPONSES}/resp_0123456789abcdef", None, {}),
}


@pytest.fixture(scope="module")
def sglang_sim(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimProcess]:
    work: Path = tmp_path_factory.mktemp("faithfulness-sim-sglang")
    proc = spawn(
        name="sim-sglang",
        log_path=work / "sim.jsonl",
        dialect="sglang",
        args=["--prefill-delay", "0.01", "--token-interval", "0.001", "--max-model-len", "1024"],
    )
    try:
        yield proc
    finally:
        proc.stop()


@pytest.mark.parametrize("shape", list(SHAPES))
def test_sglang_dialect_matches_sglang_on_messages_and_responses(
    shape: str, sglang_sim: SimProcess, sglang_replicas: dict[str, SglangReplica]
) -> None:
    replica = sglang_replicas["a"]
    assert replica.healthy(), replica.tail()
    method, path, body, headers = SHAPES[shape]
    got_sim = named_view(raw_exchange(sglang_sim.url, method, path, body, headers))
    got_sglang = named_view(raw_exchange(replica.url, method, path, body, headers))
    diffs = differences(got_sim, got_sglang)
    assert not diffs, f"simulator differs from SGLang 0.5.23 for {shape}:\n  " + "\n  ".join(diffs)
