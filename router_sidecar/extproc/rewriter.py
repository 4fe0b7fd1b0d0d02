"""The REWRITER placement: a fallback model's attempt gets the request body with `model` naming it.

Envoy's upstream chain runs this filter only on an attempt whose request carries the marker header that the
upstream placement sets when the machine sends the attempt to a fallback model's replica (an
`ExtensionWithMatcher` skips it on every other attempt: no stream, no buffering, no cost). It reads the
marker, removes it, and answers the BUFFERED body with the same JSON naming the fallback model. A filter of
its own because the upstream placement must see response bodies without waiting for its header replies,
which rules out switching its request body mode per attempt (docs/envoy-facts.md).
"""

from __future__ import annotations

import grpc

from router_sidecar.core.openai_api import with_model
from router_sidecar.extproc import messages as m

# Set by the upstream placement on a fallback model's attempt (the edge strips it from clients: its prefix).
FALLBACK_MODEL_HEADER = "x-router-sidecar-fallback-model"


async def rewrite_model(context: grpc.aio.ServicerContext) -> None:
    first = await context.read()
    if first is grpc.aio.EOF:
        return
    model = m.header_map(first.request_headers).get(FALLBACK_MODEL_HEADER, "")
    await context.write(m.request_headers_reply(m.header_mutation([], remove=[FALLBACK_MODEL_HEADER])))
    body = b""
    while True:
        message = await context.read()
        if message is grpc.aio.EOF:
            return
        if message.WhichOneof("request") != "request_body":
            continue
        body += message.request_body.body
        if message.request_body.end_of_stream:
            break
    await context.write(m.rewritten_body_reply(with_model(body, model) if model else body))
