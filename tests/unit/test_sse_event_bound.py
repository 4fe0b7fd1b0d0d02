"""`limits.max_event_bytes` (docs/bounds.md: "one SSE event from a replica … the attempt fails before the
first delta; the terminal frame after it") as the SSE scanner enforces it, whatever the chunking.

Found by the Responses/Messages contract tests (`test_api_contract.py`, an event of 1.2 MB after the first
content reaches the client whole) and the fault fuzz: the scanner turns `oversized` only when the bytes it
holds of an *incomplete* event exceed the limit; an event that is completed by the chunk that brings its end
is returned, however large. Sans-IO here, so the reproduction is exact.
"""

from __future__ import annotations

import pytest

from router_sidecar.core.sse import SseScanner

LIMIT = 1 << 20
EVENT = b'data: {"x":"' + b"x" * 1_200_000 + b'"}\n\n'  # 1.2 MB: over the limit


def test_an_event_whose_incomplete_part_crosses_the_limit_is_refused() -> None:
    scanner = SseScanner(max_event_bytes=LIMIT)
    assert scanner.feed(EVENT[:1_100_000]) == [] and scanner.oversized
    assert scanner.feed(EVENT[1_100_000:]) == []


@pytest.mark.parametrize("split", [None, 900_000], ids=["one-chunk", "completed-by-its-last-chunk"])
def test_an_event_over_the_limit_is_refused_however_it_is_chunked(split: int | None) -> None:
    scanner = SseScanner(max_event_bytes=LIMIT)
    chunks = [EVENT] if split is None else [EVENT[:split], EVENT[split:]]
    events = [e for chunk in chunks for e in scanner.feed(chunk)]
    assert events == [] and scanner.oversized, [len(e.raw) for e in events]
