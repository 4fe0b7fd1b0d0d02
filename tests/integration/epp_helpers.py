"""Helpers of the endpoint-picker tests: the picker as a child process, a minimal Envoy in front of it, a
replica that records the exact bytes it received, and a raw HTTP/1.1 client that sends and reads trailers.

The Envoy configuration is the least the protocol needs (docs/endpoint-picker.md#envoy-behind-a-picker):
one listener, the picker's ext_proc filter, the router; one cluster whose load-balancing policy is
`envoy.load_balancing_policies.override_host` (the picker's list from `envoy.lb` metadata, the host that
served written back with `selected_host_key`) with a round-robin fallback.
"""

from __future__ import annotations

import hashlib
import json
import socket
import struct
import sys
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from router_sidecar.runtime.envoy_config import find_envoy
from router_sidecar.runtime.supervise import (
    Child,
    envoy_admin,
    envoy_ready,
    free_port,
    port_open,
    start_envoy,
    wait_until,
)
from tests.harness import json_lines

PYTHON = sys.executable

HCM = "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager"
EXT_PROC = "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor"
OVERRIDE_HOST = "type.googleapis.com/envoy.extensions.load_balancing_policies.override_host.v3.OverrideHost"
ROUND_ROBIN = "type.googleapis.com/envoy.extensions.load_balancing_policies.round_robin.v3.RoundRobin"
HTTP_OPTIONS = "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions"


def envoy_config(
    *,
    admin_socket: Path,
    port: int,
    picker_port: int,
    replica_ports: Sequence[int],
    failure_mode_allow: bool = False,
    selected_host_key: bool = True,
    request_body_mode: str = "FULL_DUPLEX_STREAMED",
    response_body_mode: str = "FULL_DUPLEX_STREAMED",
    num_retries: int | None = 2,
    picker_health_check: bool = False,
    picker_tls: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The test's Envoy: listener → the picker's ext_proc filter → router → the override_host cluster.
    `num_retries=None`: the route has no retry policy at all. `picker_health_check`: Envoy checks the picker
    with the gRPC health protocol (service `envoy.service.ext_proc.v3.ExternalProcessor`) every 0.2 s and,
    with the panic threshold at 0, sends no stream to a picker it found down. `picker_tls`: the
    `common_tls_context` of a TLS connection to the picker (nothing verified)."""
    lb_key = {"key": "envoy.lb", "path": [{"key": "x-gateway-destination-endpoint"}]}
    override_host: dict[str, Any] = {
        "@type": OVERRIDE_HOST,
        "override_host_sources": [{"metadata": lb_key}],
        "fallback_policy": {
            "policies": [
                {
                    "typed_extension_config": {
                        "name": "envoy.load_balancing_policies.round_robin",
                        "typed_config": {"@type": ROUND_ROBIN},
                    }
                }
            ]
        },
    }
    if selected_host_key:
        override_host["selected_host_key"] = {
            "key": "envoy.lb",
            "path": [{"key": "x-gateway-destination-endpoint-served"}],
        }
    picker_filter = {
        "name": "endpoint-picker",
        "typed_config": {
            "@type": EXT_PROC,
            "grpc_service": {"envoy_grpc": {"cluster_name": "endpoint_picker"}, "timeout": "5s"},
            "failure_mode_allow": failure_mode_allow,
            "processing_mode": {
                "request_header_mode": "SEND",
                "request_body_mode": request_body_mode,
                "request_trailer_mode": "SEND",
                "response_header_mode": "SEND",
                "response_body_mode": response_body_mode,
                "response_trailer_mode": "SEND",
            },
            "metadata_options": {
                "receiving_namespaces": {"untyped": ["envoy.lb"]},
                "forwarding_namespaces": {"untyped": ["envoy.lb", "envoy.lb.subset_hint"]},
            },
        },
    }
    retry = {}
    if num_retries is not None:
        retry["retry_policy"] = {
            "retry_on": "reset,connect-failure,5xx",
            "num_retries": num_retries,
            "retry_back_off": {"base_interval": "0.01s", "max_interval": "0.05s"},
        }
    hcm = {
        "@type": HCM,
        "stat_prefix": "epp_test",
        "preserve_external_request_id": True,
        "http_protocol_options": {"enable_trailers": True},
        "route_config": {
            "virtual_hosts": [
                {
                    "name": "pool",
                    "domains": ["*"],
                    "routes": [
                        {
                            "match": {"prefix": "/"},
                            "route": {"cluster": "pool", "timeout": "30s", **retry},
                        }
                    ],
                }
            ]
        },
        "http_filters": [
            picker_filter,
            {
                "name": "envoy.filters.http.router",
                "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"
                },
            },
        ],
    }

    def cluster(name: str, ports: Iterable[int], http2: bool, **extra: Any) -> dict[str, Any]:
        http = (
            {"http2_protocol_options": {}} if http2 else {"http_protocol_options": {"enable_trailers": True}}
        )
        return {
            "name": name,
            "type": "STATIC",
            "connect_timeout": "0.5s",
            "load_assignment": {
                "cluster_name": name,
                "endpoints": [
                    {
                        "lb_endpoints": [
                            {
                                "endpoint": {
                                    "address": {"socket_address": {"address": "127.0.0.1", "port_value": p}}
                                }
                            }
                            for p in ports
                        ]
                    }
                ],
            },
            "typed_extension_protocol_options": {
                "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                    "@type": HTTP_OPTIONS,
                    "explicit_http_config": http,
                }
            },
            **extra,
        }

    pool = cluster(
        "pool",
        replica_ports,
        False,
        load_balancing_policy={
            "policies": [
                {
                    "typed_extension_config": {
                        "name": "envoy.load_balancing_policies.override_host",
                        "typed_config": override_host,
                    }
                }
            ]
        },
    )
    picker_cluster = cluster("endpoint_picker", [picker_port], True)
    if picker_tls is not None:
        picker_cluster["transport_socket"] = {
            "name": "envoy.transport_sockets.tls",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext",
                "common_tls_context": picker_tls,
            },
        }
    if picker_health_check:
        picker_cluster["health_checks"] = [
            {
                "timeout": "0.5s",
                "interval": "0.2s",
                "no_traffic_interval": "0.2s",  # else 60 s: ext_proc streams do not count as traffic
                "unhealthy_threshold": 1,
                "healthy_threshold": 1,
                "grpc_health_check": {"service_name": "envoy.service.ext_proc.v3.ExternalProcessor"},
            }
        ]
        picker_cluster["common_lb_config"] = {"healthy_panic_threshold": {"value": 0}}
    return {
        "admin": {"address": {"pipe": {"path": str(admin_socket)}}},
        "static_resources": {
            "listeners": [
                {
                    "name": "in",
                    "address": {"socket_address": {"address": "127.0.0.1", "port_value": port}},
                    "filter_chains": [
                        {
                            "filters": [
                                {"name": "envoy.filters.network.http_connection_manager", "typed_config": hcm}
                            ]
                        }
                    ],
                }
            ],
            "clusters": [picker_cluster, pool],
        },
    }


class EnvoyProcess:
    """Envoy with `envoy_config(...)`, started and ready (its listener open)."""

    def __init__(self, work: Path, name: str, **config: Any) -> None:
        self.port = free_port()
        self.admin = work / f"{name}-admin.sock"
        self.config_path = work / f"{name}.yaml"
        self.config_path.write_text(
            yaml.safe_dump(envoy_config(admin_socket=self.admin, port=self.port, **config))
        )
        self.url = f"http://127.0.0.1:{self.port}"
        self.child = start_envoy(find_envoy(), self.config_path, name=name, log_path=work / f"{name}.log")
        try:
            wait_until(
                lambda: envoy_ready(self.admin) and port_open("127.0.0.1", self.port),
                timeout=30,
                what=f"Envoy {name} ready",
                child=self.child,
            )
        except BaseException:
            self.child.stop()
            raise

    def picker_healthy(self) -> bool | None:
        """Whether Envoy's health check finds the picker up (None: no health flags yet)."""
        answer = envoy_admin(self.admin, "/clusters", timeout=5)
        assert answer is not None and answer[0] == 200, answer
        for line in answer[1].decode().splitlines():
            parts = line.split("::")
            if len(parts) == 4 and parts[0] == "endpoint_picker" and parts[2] == "health_flags":
                return parts[3] == "healthy"
        return None

    def stop(self) -> None:
        self.child.stop()


class PickerProcess:
    """`router-testbed epp` as a child process, with its JSON-lines log."""

    def __init__(
        self, work: Path, endpoints: Sequence[str], *, port: int | None = None, extra: Sequence[str] = ()
    ):
        self.port = port or free_port()
        self.log_path = work / f"epp-{self.port}.jsonl"
        self.out_path = work / f"epp-{self.port}.out"
        argv = [
            PYTHON,
            "-m",
            "router_testbed",
            "epp",
            "--listen",
            f"127.0.0.1:{self.port}",
            "--log",
            str(self.log_path),
        ]
        for endpoint in endpoints:
            argv += ["--endpoint", endpoint]
        argv += list(extra)
        self._argv = argv
        self.child: Child | None = None
        self.start()

    def start(self) -> None:
        before = self.out_path.stat().st_size if self.out_path.exists() else 0  # a restart appends
        self.child = Child("epp", self._argv, log_path=self.out_path)
        wait_until(
            lambda: b"epp listening on" in self.out_path.read_bytes()[before:],
            timeout=15,
            what="picker",
            child=self.child,
        )

    def stop(self) -> None:
        if self.child is not None:
            self.child.stop()

    def records(self, event: str = "end") -> list[dict[str, Any]]:
        return [r for r in json_lines(self.log_path) if r.get("event") == event]

    def record_of(self, request_id: str) -> dict[str, Any] | None:
        found = [r for r in self.records() if r.get("request_id") == request_id]
        assert len(found) <= 1, found
        return found[0] if found else None


@dataclass
class Exchange:
    """One HTTP/1.1 message as it was on the wire, decoded: head, body (chunked or not) and trailers."""

    start_line: str
    headers: list[tuple[str, str]]
    body: bytes
    trailers: list[tuple[str, str]] = field(default_factory=list)
    chunks: int = 0

    def header(self, name: str) -> str | None:
        values = [v for k, v in self.headers if k == name]
        return values[-1] if values else None

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.body).hexdigest()


class _Reader:
    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = b""

    def _fill(self) -> None:
        data = self.sock.recv(65536)
        if not data:
            raise ConnectionError("closed")
        self.buf += data

    def line(self) -> bytes:
        while b"\r\n" not in self.buf:
            self._fill()
        line, self.buf = self.buf.split(b"\r\n", 1)
        return line

    def exact(self, n: int) -> bytes:
        while len(self.buf) < n:
            self._fill()
        out, self.buf = self.buf[:n], self.buf[n:]
        return out

    def message(self) -> Exchange:
        start = self.line().decode("latin-1")
        headers = []
        while line := self.line():
            name, _, value = line.decode("latin-1").partition(":")
            headers.append((name.strip().lower(), value.strip()))
        found = Exchange(start, headers, b"")
        if "chunked" in (found.header("transfer-encoding") or ""):
            body = bytearray()
            while size := int(self.line().split(b";")[0], 16):
                body += self.exact(size)
                found.chunks += 1
                assert self.exact(2) == b"\r\n"
            while line := self.line():
                name, _, value = line.decode("latin-1").partition(":")
                found.trailers.append((name.strip().lower(), value.strip()))
            found.body = bytes(body)
        elif found.header("content-length") is not None:
            found.body = self.exact(int(found.header("content-length") or 0))
        return found


def sse_events(count: int) -> bytes:
    """`count` chat-completion-like SSE events and `[DONE]`: the recording replica's streamed answer."""
    events = []
    for i in range(count):
        delta = {"content": f"tok{i} ", "role": "assistant"} if i == 0 else {"content": f"tok{i} "}
        chunk = {
            "id": "chatcmpl-rec",
            "object": "chat.completion.chunk",
            "choices": [{"index": 0, "delta": delta}],
        }
        events.append(b"data: " + json.dumps(chunk, separators=(",", ":")).encode() + b"\n\n")
    events.append(b"data: [DONE]\n\n")
    return b"".join(events)


def irregular_pieces(data: bytes, seed: int = 7) -> list[bytes]:
    """`data` cut at irregular places (from 1 byte to a few KiB, across event boundaries)."""
    pieces, pos, state = [], 0, seed
    while pos < len(data):
        state = (state * 1103515245 + 12345) % 2**31
        size = 1 + state % 3000
        pieces.append(data[pos : pos + size])
        pos += size
    return pieces


RESPONSE_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"


RESET_HEADER = "x-recorder-reset"  # a request carrying the recorder's name is read whole, then reset


class RecordingReplica:
    """An HTTP/1.1 upstream that keeps every request exactly as decoded from the wire and answers each with
    a fixed chunked body, written in irregular pieces, and fixed response trailers; or, when the request's
    `x-recorder-reset` names it, resets the connection (RST) before any response byte."""

    def __init__(self, name: str, body: bytes, trailers: Sequence[tuple[str, str]] = ()) -> None:
        self.name = name
        self.body = body
        self.trailers = list(trailers)
        self.requests: list[Exchange] = []
        self._lock = threading.Lock()
        self._server = socket.create_server(("127.0.0.1", 0))
        self.port = self._server.getsockname()[1]
        self.endpoint = f"127.0.0.1:{self.port}"
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._server.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        reader = _Reader(conn)
        with conn:
            try:
                while True:
                    request = reader.message()
                    with self._lock:
                        self.requests.append(request)
                    if request.header(RESET_HEADER) == self.name:
                        conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                        return  # closing with linger 0: an RST
                    conn.sendall(RESPONSE_HEAD)
                    for piece in irregular_pieces(self.body):
                        conn.sendall(b"%x\r\n%s\r\n" % (len(piece), piece))
                    tail = b"".join(f"{k}: {v}\r\n".encode() for k, v in self.trailers)
                    conn.sendall(b"0\r\n" + tail + b"\r\n")
            except (ConnectionError, OSError):
                return

    def received(self, request_id: str) -> list[Exchange]:
        with self._lock:
            return [r for r in self.requests if r.header("x-request-id") == request_id]

    def stop(self) -> None:
        self._server.close()


def raw_request(
    port: int,
    path: str,
    headers: Sequence[tuple[str, str]],
    body: bytes,
    *,
    trailers: Sequence[tuple[str, str]] = (),
    piece: int = 16384,
    timeout: float = 30.0,
) -> Exchange:
    """POST `body` chunked (in `piece`-byte chunks) with `trailers`, over one raw HTTP/1.1 connection; the
    response as it came (body de-chunked, its trailers kept)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        head = [f"POST {path} HTTP/1.1", "host: epp-test", "transfer-encoding: chunked", "te: trailers"]
        head += [f"{k}: {v}" for k, v in headers]
        out = bytearray(("\r\n".join(head) + "\r\n\r\n").encode())
        for pos in range(0, len(body), piece):
            part = body[pos : pos + piece]
            out += b"%x\r\n%s\r\n" % (len(part), part)
        out += b"0\r\n" + b"".join(f"{k}: {v}\r\n".encode() for k, v in trailers) + b"\r\n"
        sock.sendall(out)
        return _Reader(sock).message()
