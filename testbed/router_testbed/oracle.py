"""What the testbed's two judges of the contract read the same way: the drill (`router_testbed.drill`) and
the test suite's invariants (`tests/invariants.py`).

Both are independent oracles of the gateway's own accounting on purpose: this module reads OpenAI stream
payloads and journal records with plain ``json`` data and never imports the product's scanner
(`router_sidecar.core.sse`) or its machines, so that a mistake there is not shared here.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

DONE = "[DONE]"
TERMINAL_PHASES = frozenset({"completed", "interrupted", "cancelled", "rejected", "failed"})
INTERRUPTED = "upstream_decode_interrupted"  # the code of the gateway's terminal frame
# Text only a replica writes: its raw error must never reach a client as the gateway's answer.
RAW_REPLICA_ERROR_MARKERS = (b"EngineCore encountered an issue",)


def is_content(payload: Any) -> bool:
    """The "first delta" of docs/design.md#vocabulary: non-empty delta.content, any delta.tool_calls,
    delta.reasoning_content, or text (completions). A role-only chunk or an empty delta is not content."""
    if not isinstance(payload, dict):
        return False
    choices = payload.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        return False
    choice = choices[0]
    delta = choice.get("delta") if isinstance(choice.get("delta"), dict) else {}
    return bool(
        delta.get("content")
        or delta.get("tool_calls")
        or delta.get("reasoning_content")
        or choice.get("text")
    )


def piece_text(payload: dict[str, Any]) -> str:
    """The text a content event carries (chat: delta.content; completions: text)."""
    choice = payload["choices"][0]
    if isinstance(choice.get("delta"), dict):
        content = choice["delta"].get("content")
        return content if isinstance(content, str) else ""
    text = choice.get("text")
    return text if isinstance(text, str) else ""


def attempt_times(trace: Iterable[dict[str, Any]], event: str) -> dict[Any, float]:
    """When `event` (e.g. "attempt_started") happened, by attempt number, from a journal record's trace;
    events without a numeric time are left out."""
    return {
        e.get("attempt"): float(e["t"])
        for e in trace
        if e.get("event") == event and isinstance(e.get("t"), int | float)
    }
