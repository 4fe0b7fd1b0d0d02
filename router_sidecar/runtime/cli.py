"""`router-sidecar`: gateway, serve, envoy-config, replica, trace."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from collections.abc import Sequence

from router_sidecar.core.policy import Policy, PolicyError, RouteOverlay, load_policy, load_route_policies
from router_sidecar.runtime.envoy_config import Endpoint, EnvoyConfigInvalid, EnvoyNotFound, parse_tool
from router_sidecar.telemetry.logs import LOG_FORMATS, configure_logging
from router_sidecar.telemetry.setup import MetricsListen, TelemetryConfigError

MOVED_TO_TESTBED = ("sim", "demo", "drill")
ETCD_HELP = "etcd HOST:PORT, or every member of a cluster as IP:PORT,IP:PORT,..."
METRICS_HELP = (
    "serve Prometheus metrics on PORT or HOST:PORT (host defaults to 127.0.0.1); OTLP export is on when "
    "OTEL_EXPORTER_OTLP_ENDPOINT is set"
)


def _endpoint(text: str) -> Endpoint:
    try:
        return Endpoint.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def _metrics(text: str) -> MetricsListen:
    try:
        return MetricsListen.parse(text)
    except TelemetryConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def _tool(text: str) -> tuple[str, Endpoint]:
    try:
        return parse_tool(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def _run_async(coro: object) -> int:
    try:
        import uvloop

        return int(uvloop.run(coro))  # type: ignore[arg-type]
    except ImportError:
        return int(asyncio.run(coro))  # type: ignore[arg-type]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="router-sidecar", description=__doc__)
    parser.add_argument("--log-level", default="INFO", help="sidecar log level (default INFO)")
    parser.add_argument(
        "--log-format",
        choices=LOG_FORMATS,
        default=os.environ.get("ROUTER_SIDECAR_LOG_FORMAT", "text"),
        help="text, or json: one object per line with request_id, attempt_id, trace_id "
        "(default text; env ROUTER_SIDECAR_LOG_FORMAT)",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    gw = sub.add_parser("gateway", help="run Envoy + the sidecar in front of replicas")
    gw.add_argument("--listen", type=_endpoint, required=True, help="client-facing HOST:PORT")
    gw.add_argument(
        "--replica",
        type=_endpoint,
        action="append",
        default=[],
        help="static replica HOST:PORT (repeat); without any, replicas are discovered from the etcd registry",
    )
    gw.add_argument("--etcd", required=True, help=ETCD_HELP)
    gw.add_argument("--config", help="policy YAML (see policy.example.yaml); defaults apply without it")
    gw.add_argument(
        "--tool",
        type=_tool,
        action="append",
        default=[],
        help="a tool service NAME=HOST:PORT, routed under /tools/NAME/ with idempotency by key (repeat)",
    )
    gw.add_argument(
        "--work-dir", help="where the rendered Envoy config, socket and logs go (default: temp dir)"
    )
    gw.add_argument("--metrics", type=_metrics, help=METRICS_HELP)

    sv = sub.add_parser("serve", help="run the sidecar alone against an existing Envoy")
    sv.add_argument("--bind", required=True, help="unix:/path/to.sock or 127.0.0.1:PORT (loopback only)")
    sv.add_argument("--etcd", required=True, help=ETCD_HELP)
    sv.add_argument("--config", help="policy YAML")
    sv.add_argument(
        "--replica",
        type=_endpoint,
        action="append",
        default=[],
        help="static replica HOST:PORT (repeat; the same list as the Envoy config's); without any, replicas "
        "are discovered from the etcd registry and served to Envoy over EDS",
    )
    sv.add_argument("--metrics", type=_metrics, help=METRICS_HELP)

    ec = sub.add_parser(
        "envoy-config",
        help="print the gateway's Envoy config, for an Envoy run beside `router-sidecar serve` (Kubernetes)",
    )
    ec.add_argument("--listen", type=_endpoint, required=True, help="client-facing HOST:PORT")
    ec.add_argument("--sidecar-socket", required=True, help="the unix socket `serve --bind unix:PATH` uses")
    ec.add_argument("--admin-socket", required=True, help="unix socket for Envoy's admin interface")
    ec.add_argument("--access-log", default="/dev/stdout", help="Envoy's access log file (default stdout)")
    ec.add_argument(
        "--replica",
        type=_endpoint,
        action="append",
        default=[],
        help="static replica HOST:PORT (repeat); without any, Envoy takes replicas from the sidecar (EDS)",
    )
    ec.add_argument("--tool", type=_tool, action="append", default=[], help="a tool service NAME=HOST:PORT")
    ec.add_argument("--config", help="policy YAML (timeouts, retry budget and limits go into Envoy's config)")
    ec.add_argument("--output", "-o", help="write here instead of stdout")

    rp = sub.add_parser("replica", help="register an engine replica in etcd while it is healthy")
    rp.add_argument("--engine", required=True, help="the engine's OpenAI-compatible HOST:PORT")
    rp.add_argument("--advertise", required=True, help="HOST:PORT the gateways should route to")
    rp.add_argument("--etcd", required=True, help=ETCD_HELP)
    rp.add_argument("--fingerprint", help="fingerprint YAML/JSON (see fingerprint.example.yaml)")
    rp.add_argument("--ttl", type=int, default=10, help="registration lease TTL, seconds (default 10)")
    rp.add_argument("--interval", type=float, default=2.0, help="probe/keep-alive interval, s (default 2)")
    rp.add_argument(
        "--front",
        help="replica mode: front the engine with Envoy on HOST:PORT and enforce the attempt fence there "
        "(point --advertise at it)",
    )
    rp.add_argument(
        "--drain-seconds",
        type=float,
        default=60.0,
        help="an engine that answers /health 503 but still serves (draining) stays registered, marked "
        "draining (no new requests; those in flight finish), at most this long (default 60)",
    )
    rp.add_argument(
        "--fence-margin",
        type=float,
        default=0.5,
        help="replica mode: stop this many seconds before an attempt lease could expire (default 0.5)",
    )

    sub.add_parser(
        "trace", help="a request's journal as a timeline (see `router-sidecar trace --help`)", add_help=False
    )
    # The testbed's tools left the product for their own distribution (router-testbed, testbed/).
    for name in MOVED_TO_TESTBED:
        sub.add_parser(name, add_help=False)

    args, rest = parser.parse_known_args(argv)
    if args.command in MOVED_TO_TESTBED:
        print(
            f"error: `{args.command}` moved to the testbed: run `router-testbed {args.command}` (installed "
            "by `make setup`; elsewhere `pip install ./testbed`)",
            file=sys.stderr,
        )
        return 2
    if args.command == "trace":
        from router_sidecar.runtime.trace_cmd import main as trace_main

        return trace_main(rest)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    configure_logging(args.log_level, args.log_format)
    if args.command == "replica":
        from router_sidecar.runtime.replica_agent import main_async as replica_main

        return _run_async(replica_main(args))
    try:
        policy = load_policy(args.config)
        routes = load_route_policies(args.config, policy)
    except (PolicyError, OSError) as exc:
        print(f"error: invalid policy {args.config}: {exc}", file=sys.stderr)
        return 2
    if args.command == "envoy-config":
        return _envoy_config(args, policy, routes)
    from router_sidecar.runtime.gateway import GatewayError, GatewayOptions, run_gateway, run_sidecar_only

    try:
        if args.command == "gateway":
            from pathlib import Path

            options = GatewayOptions(
                listen=args.listen,
                replicas=tuple(args.replica),
                etcd=args.etcd,
                policy=policy,
                work_dir=Path(args.work_dir) if args.work_dir else None,
                tools=tuple(args.tool),
                routes=routes,
                metrics=args.metrics,
            )
            return _run_async(run_gateway(options))
        return _run_async(
            run_sidecar_only(args.bind, args.etcd, policy, tuple(args.replica), metrics=args.metrics)
        )
    except (GatewayError, EnvoyNotFound, EnvoyConfigInvalid, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def _envoy_config(args: argparse.Namespace, policy: Policy, routes: tuple[RouteOverlay, ...]) -> int:
    from pathlib import Path

    from router_sidecar.runtime.envoy_config import GatewaySpec, render

    text = render(
        GatewaySpec(
            listen=args.listen,
            replicas=tuple(args.replica),
            sidecar_socket=Path(args.sidecar_socket),
            access_log_path=Path(args.access_log),
            admin_socket=Path(args.admin_socket),
            tools=tuple(args.tool),
            policy=policy,
            routes=routes,
        )
    )
    if args.output:
        Path(args.output).write_text(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
