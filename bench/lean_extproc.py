"""The floor: a lean ext_proc server that does nothing but pass every message on, for `stream_overhead.py`.

It speaks the same placements as the sidecar, with the same grpc.aio server, the same registration, the
same hand-encoded per-chunk reply and uvloop, so the gap between its CPU per chunk and the sidecar's is the
cost of what the sidecar decides, not of gRPC. Downstream: every message answered unchanged (request body,
response headers, each body chunk echoed as a streamed body). Upstream: request headers continued; at the
first response body chunk, the headers and that chunk released, then the stream ends (the sidecar's own
release at the first delta). Access log: consumed.

With `--hold-until-content` the upstream placement holds the response until its second body chunk (the
first content after the role event, in the bench upstream's streams), as the sidecar's first-delta rule
does, and the downstream placement holds its reply to the response headers until the first body chunk: the
same ext_proc hops after the first content as the sidecar's, with nothing decided and no etcd.

    python bench/lean_extproc.py --listen unix:/path/to.sock [--hold-until-content]
"""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

import grpc

from router_sidecar.extproc import messages as m
from router_sidecar.extproc.server import PLACEMENT_METADATA
from router_sidecar.wire import access_log_pb2
from router_sidecar.wire import services as wire_services


class LeanProcessor:
    def __init__(self, *, hold_until_content: bool = False) -> None:
        self._hold = hold_until_content

    async def Process(self, request_iterator: Any, context: grpc.aio.ServicerContext) -> None:
        placement = dict(context.invocation_metadata() or ()).get(PLACEMENT_METADATA)
        if placement == "upstream":
            await self._upstream(context)
        else:
            await self._downstream(context)

    async def _downstream(self, context: grpc.aio.ServicerContext) -> None:
        held_headers = False
        while True:
            message = await context.read()
            if message is grpc.aio.EOF:
                return
            which = message.WhichOneof("request")
            if which == "response_body":
                body = message.response_body
                if held_headers:
                    held_headers = False
                    await context.write(m.response_headers_reply())
                await context.write(m.streamed_body(body.body, body.end_of_stream))
            elif which == "request_headers":
                await context.write(m.request_headers_reply())
            elif which == "request_body":
                await context.write(m.request_body_reply())
            elif which == "response_headers":
                if self._hold and not message.response_headers.end_of_stream:
                    held_headers = True  # answered with the first body chunk
                else:
                    await context.write(m.response_headers_reply())
            elif which == "response_trailers":
                await context.write(m.RESPONSE_TRAILERS_CONTINUE)

    async def _upstream(self, context: grpc.aio.ServicerContext) -> None:
        held_chunks = 0
        while True:
            message = await context.read()
            if message is grpc.aio.EOF:
                return
            which = message.WhichOneof("request")
            if which == "request_headers":
                await context.write(m.request_headers_reply())
            elif which == "response_body":
                held_chunks += 1
                if self._hold and held_chunks < 2 and not message.response_body.end_of_stream:
                    continue  # the role event: held until the first content
                await context.write(m.response_headers_reply())
                for _ in range(held_chunks):
                    await context.write(m.RESPONSE_BODY_CONTINUE)
                return  # leave the path: Envoy forwards the rest without us


class LeanAccessLog:
    async def StreamAccessLogs(self, request_iterator: Any, context: grpc.aio.ServicerContext) -> Any:
        async for _ in request_iterator:
            pass
        return access_log_pb2.StreamAccessLogsResponse()


async def serve(bind: str, hold_until_content: bool) -> None:
    server = grpc.aio.server()
    wire_services.add_external_processor(server, LeanProcessor(hold_until_content=hold_until_content))
    wire_services.add_access_log_service(server, LeanAccessLog())
    server.add_insecure_port(bind)
    await server.start()
    print(f"ready: lean ext_proc on {bind}", flush=True)
    await server.wait_for_termination()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--listen", required=True, help="unix:/path or 127.0.0.1:PORT")
    parser.add_argument(
        "--hold-until-content",
        action="store_true",
        help="hold the response until its first content, as the sidecar does (upstream and downstream)",
    )
    args = parser.parse_args()
    try:
        import uvloop

        uvloop.run(serve(args.listen, args.hold_until_content))
    except ImportError:
        asyncio.run(serve(args.listen, args.hold_until_content))


if __name__ == "__main__":
    main()
