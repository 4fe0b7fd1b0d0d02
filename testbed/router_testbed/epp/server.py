"""`router-testbed epp`: a local endpoint picker speaking GAIE's endpoint-picker protocol v1.0.0 (ext_proc).

One gRPC stream per request (Envoy's ext_proc filter). What the picker does on each message:

* the first message's ``protocol_config`` says the filter's body modes. With the request body in
  ``FULL_DUPLEX_STREAMED`` the picker holds its answer to the request headers until the body has ended (its
  ``end_of_stream``, or the request trailers), then sends that answer, the body back unchanged as
  ``streamed_response`` chunks (one per chunk received, same bytes, same ``end_of_stream``) and, after
  trailers, a trailers answer that leaves them as they are. In any other mode it answers the headers at once
  and lets the body and trailers continue.
* the answer to the request headers: the header ``x-gateway-destination-endpoint: A[,B...]`` (overwriting
  any the client sent), the same value as dynamic metadata ``envoy.lb`` / ``x-gateway-destination-endpoint``,
  and ``clear_route_cache``. Or the picker's own 503 / 429 as an ``immediate_response``
  (:mod:`router_testbed.epp.picker` says when).
* at the response headers: the served report, ``envoy.lb`` / ``x-gateway-destination-endpoint-served`` in the
  forwarded metadata (and the response header of that name, if any), logged; the served endpoint is also
  set as the response header ``x-conformance-test-served-endpoint``, as GAIE's conformance picker does. The
  response body streams back unchanged in ``FULL_DUPLEX_STREAMED`` (continues otherwise).

The JSON-lines log (``--log``) gets a ``pick`` record when the picker answers the request headers and an
``end`` record when the stream ends; docs/endpoint-picker.md lists the fields.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from google.protobuf.struct_pb2 import Struct

from router_sidecar.extproc import messages as m
from router_sidecar.runtime.supervise import stop_on_signals
from router_sidecar.wire import ext_proc_pb2 as ep
from router_sidecar.wire import services
from router_testbed.epp import wire
from router_testbed.epp.picker import (
    ANSWERS,
    RETRY_AFTER_HEADER,
    Decision,
    Endpoint,
    Picker,
    parse_endpoint,
)
from router_testbed.sim.log import RequestLog

DESTINATION = "x-gateway-destination-endpoint"
SERVED = "x-gateway-destination-endpoint-served"
LB_NAMESPACE = "envoy.lb"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
SUBSET_KEY = "x-gateway-destination-endpoint-subset"
CONFORMANCE_SERVED_HEADER = "x-conformance-test-served-endpoint"
DETAILS = "router_testbed_epp"
TIMES = ("t_request_headers", "t_request_end", "t_picked", "t_response_headers")
HEALTHY_SERVICES = frozenset({"", "liveness", "readiness", services.EXT_PROC_SERVICE})


@dataclass
class _Body:
    """What passed in one direction: its size and digest (the log's proof of byte-exactness)."""

    size: int = 0
    sha256: Any = field(default_factory=hashlib.sha256)
    chunks: int = 0

    def add(self, data: bytes) -> None:
        self.size += len(data)
        self.sha256.update(data)
        self.chunks += 1


class PickerStream:
    """One request's ext_proc stream: messages in, replies out (wire objects or pre-encoded bytes)."""

    def __init__(self, server: PickerServer) -> None:
        self.server = server
        self.config = wire.ProtocolConfig()
        self.request_id: str | None = None
        self.headers: dict[str, str] = {}
        self.subset: list[str] | None = None
        self.decision: Decision | None = None
        self.held: list[tuple[bytes, bool]] = []  # request body chunks received while the headers wait
        self.request_body = _Body()
        self.response_body = _Body()
        self.request_trailers: dict[str, str] | None = None
        self.response_trailers: dict[str, str] | None = None
        self.response_status: str | None = None
        self.served: str | None = None
        self.served_header: str | None = None
        self.response_metadata: dict[str, Any] | None = None
        self.response_done = False
        self.times: dict[str, float] = {}

    def on_message(self, request: ep.ProcessingRequest) -> list[m.Reply]:
        config = wire.protocol_config(request)
        if config is not None:
            self.config = config
        which = request.WhichOneof("request")
        if which == "request_headers":
            return self._request_headers(request)
        if which == "request_body":
            return self._request_body(request.request_body)
        if which == "request_trailers":
            return self._request_trailers(request.request_trailers)
        if which == "response_headers":
            return self._response_headers(request)
        if which == "response_body":
            return self._response_body(request.response_body)
        if which == "response_trailers":
            self.response_trailers = _trailer_map(request.response_trailers)
            self.response_done = True
            return [m.RESPONSE_TRAILERS_CONTINUE]
        return []

    # The request.

    def _request_headers(self, request: ep.ProcessingRequest) -> list[m.Reply]:
        self.times["t_request_headers"] = time.time()
        headers = request.request_headers
        self.headers = m.header_map(headers)
        self.request_id = self.headers.get("x-request-id")
        hint = wire.metadata_context(request).get(SUBSET_NAMESPACE)
        if hint is not None and SUBSET_KEY in hint.fields:
            self.subset = _endpoint_list(wire.plain(hint.fields[SUBSET_KEY]))
        if headers.end_of_stream:
            self._request_ended()
        if headers.end_of_stream or not self.config.request_full_duplex:
            return self._answer_headers()
        return []  # held until the body has ended

    def _request_body(self, body: ep.HttpBody) -> list[m.Reply]:
        self.request_body.add(body.body)
        if body.end_of_stream:
            self._request_ended()
        if not self.config.request_full_duplex:
            return [m.request_body_reply()]
        if self.decision is not None:  # after our answer (not seen here): passed on, one reply per chunk
            return [_streamed_request_body(body.body, body.end_of_stream)]
        self.held.append((body.body, body.end_of_stream))
        return self._answer_headers() if body.end_of_stream else []

    def _request_trailers(self, trailers: ep.HttpTrailers) -> list[m.Reply]:
        self.request_trailers = _trailer_map(trailers)
        self._request_ended()
        replies = self._answer_headers() if self.decision is None else []
        return [*replies, ep.ProcessingResponse(request_trailers=ep.TrailersResponse())]

    def _request_ended(self) -> None:
        self.times["t_request_end"] = time.time()

    def _answer_headers(self) -> list[m.Reply]:
        self.decision = self.server.picker.decide(self.headers, self.subset)
        self.times["t_picked"] = time.time()
        self.server.log.write(self._pick_record())
        if self.decision.status is not None:
            status = self.decision.status
            error = {"message": ANSWERS[status], "type": "endpoint_picker", "code": status}
            retry_after = self.headers.get(RETRY_AFTER_HEADER, "").strip()
            reply = m.immediate(
                status,
                json.dumps({"error": error}, separators=(",", ":")).encode(),
                extra_headers=[("retry-after", retry_after)] if retry_after else (),
            )
            reply.immediate_response.details = DETAILS
            return [reply]
        value = self.decision.value
        metadata = Struct()
        metadata.update({LB_NAMESPACE: {DESTINATION: value}})
        common = wire.clear_route_cache(
            ep.CommonResponse(header_mutation=m.header_mutation([(DESTINATION, value)]))
        )
        reply = ep.ProcessingResponse(request_headers=ep.HeadersResponse(response=common))
        reply.dynamic_metadata.CopyFrom(metadata)
        held, self.held = self.held, []
        return [reply, *(_streamed_request_body(data, end) for data, end in held)]

    # The response.

    def _response_headers(self, request: ep.ProcessingRequest) -> list[m.Reply]:
        self.times["t_response_headers"] = time.time()
        headers = m.header_map(request.response_headers)
        self.response_status = headers.get(":status")
        self.served_header = headers.get(SERVED)
        forwarded = wire.metadata_context(request)
        self.response_metadata = {name: wire.plain_struct(s) for name, s in forwarded.items()}
        lb = forwarded.get(LB_NAMESPACE)
        if lb is not None and SERVED in lb.fields:
            served = wire.plain(lb.fields[SERVED])
            self.served = served if isinstance(served, str) else str(served)
        if request.response_headers.end_of_stream:
            self.response_done = True
        report = self.served or self.served_header
        mutation = m.header_mutation([(CONFORMANCE_SERVED_HEADER, report)]) if report else None
        return [m.response_headers_reply(mutation)]

    def _response_body(self, body: ep.HttpBody) -> list[m.Reply]:
        self.response_body.add(body.body)
        if body.end_of_stream:
            self.response_done = True
        if self.config.response_full_duplex:
            return [m.streamed_body(body.body, body.end_of_stream)]
        return [m.RESPONSE_BODY_CONTINUE]

    # The log.

    def _pick_record(self) -> dict[str, Any]:
        decision = self.decision
        listed = decision is not None and decision.status is None
        return {
            "event": "pick",
            "picker": self.server.name,
            "request_id": self.request_id,
            "path": self.headers.get(":path"),
            "picked": [str(e) for e in decision.endpoints] if decision is not None and listed else None,
            "answer": decision.status if decision is not None else None,
            "reason": decision.reason if decision is not None else None,
            "subset": self.subset,
            "headers": {h: self.headers[h] for h in self.server.log_headers if h in self.headers},
            "mode": self.config.describe(),
            **{k: self.times.get(k) for k in ("t_request_headers", "t_request_end", "t_picked")},
        }

    def end_record(self, outcome: str) -> dict[str, Any]:
        record = self._pick_record()
        record.update(
            {
                "event": "end",
                "served": self.served,
                "served_header": self.served_header,
                "response_status": self.response_status,
                "response_metadata": self.response_metadata,
                "request_body_bytes": self.request_body.size,
                "request_body_sha256": self.request_body.sha256.hexdigest(),
                "request_body_chunks": self.request_body.chunks,
                "request_trailers": self.request_trailers,
                "response_body_bytes": self.response_body.size,
                "response_body_sha256": self.response_body.sha256.hexdigest(),
                "response_body_chunks": self.response_body.chunks,
                "response_trailers": self.response_trailers,
                "outcome": outcome,
                **{k: self.times.get(k) for k in TIMES},
                "t_end": time.time(),
            }
        )
        return record

    def outcome(self) -> str:
        if self.decision is not None and self.decision.status is not None:
            return "answered"  # the picker's own 503/429
        if self.response_done:
            return "completed"
        return "incomplete"  # the stream ended first: client gone, Envoy's reply, an upstream reset


def _streamed_request_body(data: bytes, end_of_stream: bool) -> ep.ProcessingResponse:
    mutation = ep.BodyMutation(
        streamed_response=ep.StreamedBodyResponse(body=data, end_of_stream=end_of_stream)
    )
    return ep.ProcessingResponse(
        request_body=ep.BodyResponse(response=ep.CommonResponse(body_mutation=mutation))
    )


def _trailer_map(trailers: ep.HttpTrailers) -> dict[str, str]:
    """Trailers as lower-cased names to values (Envoy 1.40 sends `raw_value`), the last of duplicates."""
    return m.header_map(ep.HttpHeaders(headers=trailers.trailers))


def _endpoint_list(value: object) -> list[str]:
    """A subset hint: a list of `ip:port` strings, or one comma-separated string (both occur)."""
    items = value if isinstance(value, list) else [value]
    return [
        part.strip() for item in items if isinstance(item, str) for part in item.split(",") if part.strip()
    ]


class PickerServer:
    """The ext_proc servicer (one :class:`PickerStream` per gRPC stream) and the gRPC health service."""

    def __init__(
        self, picker: Picker, log: RequestLog, name: str = "epp", log_headers: Sequence[str] = ()
    ) -> None:
        self.picker = picker
        self.log = log
        self.name = name
        self.log_headers = tuple(h.lower() for h in log_headers)

    async def Process(
        self, request_iterator: AsyncIterator[ep.ProcessingRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[m.Reply]:
        stream = PickerStream(self)
        try:
            async for request in request_iterator:
                for reply in stream.on_message(request):
                    yield reply
        except Exception:
            traceback.print_exc()  # to its output file: gRPC tells Envoy only the exception's type
            raise
        finally:
            self.log.write(stream.end_record(stream.outcome()))

    async def Check(self, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        service = wire.health_request_service(request)
        if service not in HEALTHY_SERVICES:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown service {service!r}")
        return wire.health_response(wire.SERVING)


def add_health(server: grpc.aio.Server, picker: PickerServer) -> None:
    handlers = {"Check": grpc.unary_unary_rpc_method_handler(picker.Check)}
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(wire.HEALTH_SERVICE, handlers),))


@dataclass(frozen=True)
class Config:
    host: str
    port: int
    endpoints: tuple[Endpoint, ...]
    log_path: str | None = None
    list_size: int | None = None
    answer: int | None = None
    tls: bool = False
    log_headers: tuple[str, ...] = ()


def _listen(value: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit():
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {value!r}")
    return host.strip("[]") or "127.0.0.1", int(port)


def _endpoint(value: str) -> Endpoint:
    try:
        return parse_endpoint(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _positive(value: str) -> int:
    if not value.isdigit() or int(value) < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {value!r}")
    return int(value)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="router-testbed epp",
        description="a local endpoint picker (GAIE endpoint-picker protocol v1.0.0 over Envoy ext_proc)",
    )
    p.add_argument("--listen", required=True, type=_listen, help="HOST:PORT of its gRPC server (port 0: any)")
    p.add_argument(
        "--endpoint",
        required=True,
        action="append",
        type=_endpoint,
        help="IP:PORT of a replica it may pick (repeat, in round-robin order)",
    )
    p.add_argument("--log", default=None, help="JSON-lines log of its picks and served reports (appended)")
    p.add_argument(
        "--list-size",
        type=_positive,
        default=None,
        help="endpoints per round-robin answer (default: all, rotated by one per request)",
    )
    p.add_argument(
        "--answer",
        type=int,
        choices=sorted(ANSWERS),
        default=None,
        help="answer every request itself: 503 (no ready endpoint) or 429 (shed)",
    )
    p.add_argument(
        "--log-header",
        action="append",
        default=[],
        metavar="NAME",
        help="also log this request header (repeat): to find a request whose x-request-id a gateway replaces",
    )
    p.add_argument(
        "--tls",
        action="store_true",
        help="serve TLS with a fresh self-signed certificate, as GAIE's and llm-d's pickers do by default "
        "(made with the openssl command)",
    )
    return p


def config_from_args(argv: Sequence[str] | None) -> Config:
    args = build_parser().parse_args(argv)
    host, port = args.listen
    return Config(
        host,
        port,
        tuple(args.endpoint),
        args.log,
        args.list_size,
        args.answer,
        args.tls,
        tuple(args.log_header),
    )


def self_signed_credentials() -> grpc.ServerCredentials:
    """A throw-away key and certificate (P-256, one day, CN router-testbed-epp) made by `openssl`: a client
    that verifies nothing, as Envoy does for a picker's self-signed certificate, can connect."""
    with tempfile.TemporaryDirectory() as tmp:
        key, cert = Path(tmp, "key.pem"), Path(tmp, "cert.pem")
        argv = ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1"]
        argv += [
            "-nodes",
            "-days",
            "1",
            "-subj",
            "/CN=router-testbed-epp",
            "-keyout",
            str(key),
            "-out",
            str(cert),
        ]
        subprocess.run(
            argv,
            check=True,
            capture_output=True,
            timeout=30,
        )
        return grpc.ssl_server_credentials([(key.read_bytes(), cert.read_bytes())])


async def serve(config: Config) -> int:
    with stop_on_signals() as stop:
        log = RequestLog(config.log_path)
        # Envoy sends a body chunk as one message (about 1 MiB seen here); gRPC's default limit is 4 MiB. No
        # SO_REUSEPORT (gRPC's default): a port another process holds is an error, not a shared port.
        options = [("grpc.max_receive_message_length", 64 * 1024 * 1024), ("grpc.so_reuseport", 0)]
        server = grpc.aio.server(options=options)
        bind = f"[{config.host}]:{config.port}" if ":" in config.host else f"{config.host}:{config.port}"
        if config.tls:
            port = server.add_secure_port(bind, self_signed_credentials())
        else:
            port = server.add_insecure_port(bind)
        if port == 0:  # older gRPC returns 0 instead of raising
            raise OSError(f"cannot listen on {bind}")
        address = f"[{config.host}]:{port}" if ":" in config.host else f"{config.host}:{port}"
        chooser = Picker(config.endpoints, list_size=config.list_size, answer=config.answer)
        picker = PickerServer(chooser, log, name=address, log_headers=config.log_headers)
        services.add_external_processor(server, picker)
        add_health(server, picker)
        await server.start()
        endpoints = ",".join(map(str, chooser.endpoints))
        tls = " tls" if config.tls else ""
        print(f"epp listening on {address}{tls} endpoints {endpoints}", flush=True)
        try:
            await stop.wait()
        finally:
            await server.stop(grace=1.0)
            log.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    config = config_from_args(argv)
    try:
        return asyncio.run(serve(config))
    except KeyboardInterrupt:
        return 0


if __name__ == "__main__":
    sys.exit(main())
