"""The tool-call stream's request side without servers (MemoryStore): where a call's digest is computed."""

from __future__ import annotations

import asyncio
import threading

import pytest

from router_sidecar.coordination.journal import Journal
from router_sidecar.coordination.store import MemoryStore, keys
from router_sidecar.coordination.tool_ledger import ToolLedger
from router_sidecar.core.policy import DEFAULT_POLICY
from router_sidecar.core.tools import call_digest
from router_sidecar.extproc import tool_calls
from router_sidecar.extproc.parsing import INLINE_BODY_BYTES
from router_sidecar.extproc.registry import Registry


def stream(store: MemoryStore, key: str) -> tool_calls.ToolCallStream:
    return tool_calls.ToolCallStream(
        ledger=ToolLedger(store, DEFAULT_POLICY.tools),
        policy=DEFAULT_POLICY.tools,
        registry=Registry(),
        journal=Journal(store, retention_seconds=3600, gateway_id="gw-1"),
        tenant="tenant-a",
        key=key,
        method="POST",
        path="/tools/payments/charge",
        caller_attempt_id=None,
        gateway_id="gw-1",
    )


@pytest.mark.parametrize(("size", "off_loop"), [(100, False), (INLINE_BODY_BYTES + 1, True), (4 << 20, True)])
def test_large_tool_bodies_are_hashed_off_the_event_loop(
    monkeypatch: pytest.MonkeyPatch, size: int, off_loop: bool
) -> None:
    """A 4 MiB body takes ~5 ms to hash: on the loop, every other stream's chunks would wait for it."""
    hashed_on: list[int] = []

    def recording_digest(method: str, path: str, body: bytes) -> str:
        hashed_on.append(threading.get_ident())
        return call_digest(method, path, body)

    monkeypatch.setattr(tool_calls, "call_digest", recording_digest)
    body = b"x" * size

    async def go() -> bytes | None:
        store = MemoryStore()
        answer = await stream(store, "call-1").on_request_body(body)
        assert answer is None  # claimed: the tool is called
        [(_, value)] = await store.get_prefix(keys.TOOLS_PREFIX)
        return value

    value = asyncio.run(go())
    assert value is not None and call_digest("POST", "/tools/payments/charge", body).encode() in value
    assert len(hashed_on) == 1 and (hashed_on[0] != threading.get_ident()) == off_loop
