"""Request bodies are parsed off the event loop when they are large.

`json.loads` holds the GIL for its whole run (about 50 ms for a 4 MiB body of many small objects, the
admission limit), so a thread would still stall every stream on this sidecar; a worker process does not.
Small bodies, the common case, are parsed inline: a round trip to the worker costs more than they do.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import multiprocessing
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool

from router_sidecar.core.openai_api import ParsedRequest, RouteKind, parse_request

log = logging.getLogger(__name__)

INLINE_BODY_BYTES = 64 * 1024


class RequestParser:
    def __init__(self, inline_bytes: int = INLINE_BODY_BYTES) -> None:
        self._inline_bytes = inline_bytes
        self._pool: ProcessPoolExecutor | None = None
        self.offloaded = 0  # bodies parsed in the worker (for tests and metrics)

    def start(self) -> None:
        """Start the worker now (spawned, not forked: this process runs gRPC threads)."""
        self._pool = ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn"))
        self._pool.submit(int)  # warm it up: the first large body should not pay for the start

    async def parse(
        self,
        kind: RouteKind,
        body: bytes,
        *,
        max_body_bytes: int,
        max_json_depth: int,
        prefix_block_bytes: int = 256,
        prefix_max_blocks: int = 512,
    ) -> ParsedRequest:
        parse = functools.partial(
            parse_request,
            kind,
            body,
            max_body_bytes=max_body_bytes,
            max_json_depth=max_json_depth,
            prefix_block_bytes=prefix_block_bytes,
            prefix_max_blocks=prefix_max_blocks,
        )
        if len(body) <= self._inline_bytes or len(body) > max_body_bytes:
            return parse()
        if self._pool is None:
            self.start()
        assert self._pool is not None
        try:
            result = await asyncio.get_running_loop().run_in_executor(self._pool, parse)
        except BrokenProcessPool:
            log.error("request parser worker died; parsing inline and restarting it")
            self.stop()
            return parse()
        self.offloaded += 1
        return result

    def stop(self) -> None:
        if self._pool is not None:
            with contextlib.suppress(Exception):
                self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
