"""Large request bodies are parsed in a worker process: the event loop keeps serving other streams."""

from __future__ import annotations

import asyncio
import json

import pytest

from router_sidecar.core.openai_api import RequestRejected, RouteKind
from router_sidecar.extproc.parsing import RequestParser

LIMIT = 8 << 20


def body(messages: int) -> bytes:
    return json.dumps(
        {"model": "tiny", "messages": [{"role": "user", "content": f"hello {i}"} for i in range(messages)]}
    ).encode()


def test_large_bodies_are_parsed_off_the_loop_while_it_keeps_running() -> None:
    async def main() -> tuple[int, int, int]:
        parser = RequestParser()
        parser.start()
        try:
            ticks = 0
            stop = asyncio.Event()

            async def ticker() -> None:
                nonlocal ticks
                while not stop.is_set():
                    ticks += 1
                    await asyncio.sleep(0)

            task = asyncio.create_task(ticker())
            await asyncio.sleep(0)
            before = ticks
            parsed = await parser.parse(RouteKind.CHAT, body(80_000), max_body_bytes=LIMIT, max_json_depth=64)
            during = ticks - before
            stop.set()
            await task
            assert parsed.model == "tiny" and parsed.estimated_prompt_tokens > 0
            small = await parser.parse(RouteKind.CHAT, body(1), max_body_bytes=LIMIT, max_json_depth=64)
            assert small.model == "tiny"
            return parser.offloaded, during, len(body(80_000))
        finally:
            parser.stop()

    offloaded, ticks_during_parse, size = asyncio.run(main())
    assert size > 3_000_000
    assert offloaded == 1  # the large body went to the worker, the small one did not
    assert ticks_during_parse > 10, "the loop ran nothing else while the body was parsed"


def test_a_rejection_in_the_worker_keeps_its_status_and_code() -> None:
    async def main() -> None:
        parser = RequestParser(inline_bytes=16)
        try:
            with pytest.raises(RequestRejected) as rejected:
                await parser.parse(
                    RouteKind.CHAT, b"[" * 100_000 + b"]" * 100_000, max_body_bytes=LIMIT, max_json_depth=64
                )
            assert (rejected.value.status, rejected.value.code) == (400, "json_too_deep")
            assert parser.offloaded == 0  # raised, not returned
        finally:
            parser.stop()

    asyncio.run(main())
