"""`router-sidecar`: gateway, serve, envoy-config, replica, trace, version.

The conventions (docs/cli.md), those of etcdctl, envoy and kubectl: `--version`; the global flags
(`--log-level`, `--log-format`) before or after the subcommand; one spelling per concept (`--listen` is what
this process listens on, `--etcd` where etcd is, `--replica` where replicas are, `--policy` the policy file);
the old spellings (`--bind`, `--config`) work for one release and say so on stderr; a bad value exits 2 with
one line naming the flag, the value and what is allowed, before anything starts and before etcd is asked.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import os
import sys
from collections.abc import Sequence
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any, NoReturn

from router_sidecar.core.policy import Policy, PolicyError, RouteOverlay, load_policy, load_route_policies
from router_sidecar.runtime import flags
from router_sidecar.runtime.envoy_config import EndpointPicker, EnvoyConfigInvalid, EnvoyNotFound
from router_sidecar.telemetry.logs import configure_logging

PROG = "router-sidecar"
# Old spelling -> new: accepted through the 0.1 releases, with one line on stderr each time it is used.
DEPRECATED = {"--bind": "--listen", "--config": "--policy"}
# The testbed's tools left the product for their own distribution (router-testbed, testbed/).
MOVED_TO_TESTBED = ("sim", "demo", "drill")

ETCD_HELP = (
    "etcd as its own clients take it: HOST:PORT or http://HOST:PORT, every member of a cluster separated by "
    "commas (IP addresses), or one name that resolves to all of them; https:// (TLS) is not implemented"
)
METRICS_HELP = (
    "serve Prometheus metrics on PORT or HOST:PORT (host defaults to 127.0.0.1); OTLP export is on when "
    "OTEL_EXPORTER_OTLP_ENDPOINT is set"
)
POLICY_HELP = "the policy file, YAML (see policy.example.yaml); defaults apply without it (formerly --config)"


def package_version() -> str:
    try:
        return version("router-sidecar")
    except PackageNotFoundError:  # a checkout on sys.path without an install: say so rather than guess
        return "unknown (not installed)"


class _Parser(argparse.ArgumentParser):
    """argparse whose errors are one line: the usage is one `--help` away, not printed over the message."""

    def error(self, message: str) -> NoReturn:
        for old, new in DEPRECATED.items():  # argparse names a flag by all its spellings: the current one
            message = message.replace(f"{new}/{old}", new)
        self.exit(2, f"{self.prog}: error: {message}\n")


class _Formatter(argparse.HelpFormatter):
    """Help without the deprecated spellings (docs/cli.md lists them); each flag's help names its old one."""

    def _format_action_invocation(self, action: argparse.Action) -> str:
        shown = [o for o in action.option_strings if o not in DEPRECATED]
        if shown != action.option_strings:
            action = copy.copy(action)
            action.option_strings = shown
        return super()._format_action_invocation(action)


_warned: set[str] = set()


class _Store(argparse.Action):
    """argparse's store, except that a deprecated spelling also says once on stderr what replaces it."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        if option_string in DEPRECATED and option_string not in _warned:
            _warned.add(option_string)
            print(
                f"{PROG}: {option_string} is deprecated, use {DEPRECATED[option_string]} "
                "(the old spelling is accepted through the 0.1 releases)",
                file=sys.stderr,
            )
        setattr(namespace, self.dest, values)


def _global_flags(parser: argparse.ArgumentParser, *, after_command: bool) -> None:
    """--log-level and --log-format: on the top-level parser with their defaults, and on every subcommand
    (defaults suppressed, so a flag given before the subcommand is not overwritten by one not given after)."""
    parser.add_argument(
        "--log-level",
        type=flags.log_level,
        default=argparse.SUPPRESS if after_command else "INFO",
        metavar="LEVEL",
        help=f"log level: {', '.join(flags.LOG_LEVELS)}, any case (default info)",
    )
    parser.add_argument(
        "--log-format",
        type=flags.log_format,
        default=argparse.SUPPRESS if after_command else os.environ.get("ROUTER_SIDECAR_LOG_FORMAT", "text"),
        metavar="FORMAT",
        help="text, or json: one object per line with request_id, attempt_id, trace_id "
        "(default text; env ROUTER_SIDECAR_LOG_FORMAT)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog=PROG,
        description="Honest failover for streaming LLM requests behind Envoy (docs/cli.md).",
        formatter_class=_Formatter,
    )
    parser.add_argument("--version", action="version", version=f"{PROG} {package_version()}")
    _global_flags(parser, after_command=False)
    common = _Parser(add_help=False)
    _global_flags(common, after_command=True)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, help_text: str, **kwargs: Any) -> argparse.ArgumentParser:
        return sub.add_parser(
            name,
            help=help_text,
            parents=[common],
            formatter_class=_Formatter,
            description=help_text,
            **kwargs,
        )

    gw = command("gateway", "run Envoy + the sidecar in front of replicas")
    gw.add_argument(
        "--listen", type=flags.endpoint, required=True, metavar="HOST:PORT", help="the client-facing address"
    )
    _replicas(gw, "without any, replicas are discovered from the etcd registry")
    gw.add_argument("--etcd", type=flags.etcd_endpoints, required=True, metavar="ENDPOINTS", help=ETCD_HELP)
    _policy(gw)
    _tools(gw)
    _endpoint_picker(gw)
    gw.add_argument(
        "--work-dir",
        metavar="DIR",
        help="where the rendered Envoy config, socket and logs go (default: temp dir)",
    )
    gw.add_argument("--metrics", type=flags.metrics, metavar="[HOST:]PORT", help=METRICS_HELP)

    sv = command("serve", "run the sidecar alone against an existing Envoy (see envoy-config)")
    sv.add_argument(
        "--listen",
        "--bind",
        action=_Store,
        type=flags.sidecar_listen,
        required=True,
        metavar="ADDRESS",
        help=f"where Envoy reaches the sidecar: unix:PATH (e.g. {flags.SOCKET_EXAMPLE}) or 127.0.0.1:PORT "
        "(loopback only) (formerly --bind)",
    )
    sv.add_argument("--etcd", type=flags.etcd_endpoints, required=True, metavar="ENDPOINTS", help=ETCD_HELP)
    _policy(sv)
    _replicas(
        sv,
        "the same list as the Envoy config's; without any, replicas are discovered from the etcd registry "
        "and served to Envoy over EDS",
    )
    sv.add_argument("--metrics", type=flags.metrics, metavar="[HOST:]PORT", help=METRICS_HELP)

    ec = command(
        "envoy-config",
        "print the gateway's Envoy config, for an Envoy run beside `router-sidecar serve` (Kubernetes)",
    )
    ec.add_argument(
        "--listen", type=flags.endpoint, required=True, metavar="HOST:PORT", help="the client-facing address"
    )
    ec.add_argument(
        "--sidecar-socket",
        type=flags.socket_path,
        required=True,
        metavar="PATH",
        help="the unix socket `serve --listen unix:PATH` listens on (PATH, or unix:PATH)",
    )
    ec.add_argument(
        "--admin-socket",
        type=flags.socket_path,
        required=True,
        metavar="PATH",
        help="unix socket for Envoy's admin interface",
    )
    ec.add_argument(
        "--access-log", default="/dev/stdout", metavar="PATH", help="Envoy's access log file (default stdout)"
    )
    _replicas(ec, "without any, Envoy takes replicas from the sidecar (EDS)")
    _tools(ec)
    _endpoint_picker(ec)
    _policy(ec, "; its timeouts, retry budget and limits go into Envoy's config")
    ec.add_argument("--output", "-o", metavar="PATH", help="write here instead of stdout")

    rp = command("replica", "register an engine replica in etcd while it is healthy")
    rp.add_argument(
        "--engine",
        type=flags.host_port,
        required=True,
        metavar="HOST:PORT",
        help="the engine's OpenAI-compatible HOST:PORT",
    )
    rp.add_argument(
        "--advertise",
        type=flags.host_port,
        required=True,
        metavar="HOST:PORT",
        help="HOST:PORT the gateways route to: this replica's own address as others reach it (as etcd's "
        "--advertise-client-urls); a gateway's --replica names the same kind of address",
    )
    rp.add_argument("--etcd", type=flags.etcd_endpoints, required=True, metavar="ENDPOINTS", help=ETCD_HELP)
    rp.add_argument(
        "--fingerprint", metavar="PATH", help="fingerprint YAML/JSON (see fingerprint.example.yaml)"
    )
    rp.add_argument(
        "--ttl", type=int, default=10, metavar="SECONDS", help="registration lease TTL, seconds (default 10)"
    )
    rp.add_argument(
        "--interval",
        type=float,
        default=2.0,
        metavar="SECONDS",
        help="probe/keep-alive interval, s (default 2)",
    )
    rp.add_argument(
        "--front",
        type=flags.host_port,
        metavar="HOST:PORT",
        help="replica mode: front the engine with Envoy listening on HOST:PORT and enforce the attempt fence "
        "there (point --advertise at it)",
    )
    rp.add_argument(
        "--drain-seconds",
        type=float,
        default=60.0,
        metavar="SECONDS",
        help="an engine that answers /health 503 but still serves (draining) stays registered, marked "
        "draining (no new requests; those in flight finish), at most this long (default 60)",
    )
    rp.add_argument(
        "--fence-margin",
        type=float,
        default=0.5,
        metavar="SECONDS",
        help="replica mode: stop this many seconds before an attempt lease could expire (default 0.5)",
    )

    from router_sidecar.runtime import trace_cmd

    tr = command("trace", trace_cmd.DESCRIPTION)
    trace_cmd.add_arguments(tr)
    command("version", "print the version")
    for name in MOVED_TO_TESTBED:  # no help=: not listed, only there to say where they went
        sub.add_parser(name, add_help=False, parents=[common])
    return parser


def _replicas(parser: argparse.ArgumentParser, without: str) -> None:
    parser.add_argument(
        "--replica",
        type=flags.endpoint,
        action="append",
        default=[],
        metavar="HOST:PORT",
        help=f"a static replica (repeat); {without}",
    )


def _policy(parser: argparse.ArgumentParser, more: str = "") -> None:
    parser.add_argument("--policy", "--config", action=_Store, metavar="PATH", help=POLICY_HELP + more)


def _tools(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--tool",
        type=flags.tool,
        action="append",
        default=[],
        metavar="NAME=HOST:PORT",
        help="a tool service, routed under /tools/NAME/ with idempotency by key (repeat)",
    )


def _endpoint_picker(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--endpoint-picker",
        type=flags.endpoint,
        metavar="HOST:PORT",
        help="an endpoint picker (Gateway API Inference Extension EPP, e.g. llm-d) over gRPC: its ext_proc "
        "filter runs before the sidecar's, and each request's attempts follow its list of endpoints first",
    )
    parser.add_argument(
        "--endpoint-picker-fail-open",
        action="store_true",
        help="with the picker unreachable, serve requests in the gateway's own order (default: fail closed, "
        "every inference request answered 503 endpoint_picker_unavailable)",
    )
    parser.add_argument(
        "--endpoint-picker-health-port",
        type=flags.port,
        metavar="PORT",
        help="with --endpoint-picker-fail-open, the port of the picker's gRPC health service, which Envoy "
        "checks (GAIE's and llm-d's pickers: 9003); default: the picker's own port",
    )
    parser.add_argument(
        "--endpoint-picker-tls",
        action="store_true",
        help="dial the picker over TLS without verifying its certificate (GAIE's and llm-d's pickers serve a "
        "self-signed one by default); default plaintext, for a picker on loopback",
    )


def _picker(args: argparse.Namespace) -> EndpointPicker | None:
    if args.endpoint_picker is None:
        return None
    return EndpointPicker(
        args.endpoint_picker,
        fail_open=args.endpoint_picker_fail_open,
        tls=args.endpoint_picker_tls,
        health_port=args.endpoint_picker_health_port,
    )


def _run_async(coro: object) -> int:
    try:
        import uvloop

        return int(uvloop.run(coro))  # type: ignore[arg-type]
    except ImportError:
        return int(asyncio.run(coro))  # type: ignore[arg-type]


def _fail(message: str, command: str | None = None) -> int:
    """Exit 2 with one line, in argparse's form (`router-sidecar gateway: error: ...`)."""
    one_line = "; ".join(part.strip() for part in message.splitlines() if part.strip())
    print(f"{PROG}{f' {command}' if command else ''}: error: {one_line}", file=sys.stderr)
    return 2


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if args.command in MOVED_TO_TESTBED:
        return _fail(
            f"`{args.command}` moved to the testbed: run `router-testbed {args.command}` (installed by "
            "`make setup`; elsewhere `pip install ./testbed`)"
        )
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if getattr(args, "endpoint_picker_health_port", None) and not args.endpoint_picker_fail_open:
        return _fail("--endpoint-picker-health-port is for --endpoint-picker-fail-open", args.command)
    for option in ("fail_open", "tls"):
        if getattr(args, f"endpoint_picker_{option}", False) and args.endpoint_picker is None:
            flag = "--endpoint-picker-" + option.replace("_", "-")
            return _fail(f"{flag} needs --endpoint-picker HOST:PORT", args.command)
    configure_logging(args.log_level, args.log_format)
    if args.command == "version":
        print(f"{PROG} {package_version()}")
        return 0
    if args.command == "trace":
        from router_sidecar.runtime import trace_cmd

        return trace_cmd.run(args)
    if args.command == "replica":
        from router_sidecar.runtime.replica_agent import AgentOptions, ConfigError
        from router_sidecar.runtime.replica_agent import main_async as replica_main

        try:  # the ranges (--ttl, --interval < --ttl, ...) before etcd is asked, in the parser's form
            AgentOptions.from_args(args).validate()
        except ConfigError as exc:
            return _fail(str(exc), args.command)
        return _run_async(replica_main(args))
    try:
        policy = load_policy(args.policy)
        routes = load_route_policies(args.policy, policy)
    except (PolicyError, OSError) as exc:
        return _fail(f"--policy {args.policy}: {exc}", args.command)
    if policy.fallback.models and getattr(args, "replica", None) and args.command in ("gateway", "serve"):
        # A fallback needs to know which replica serves which model: the registry says, --replica does not.
        return _fail(
            f"--policy {args.policy}: fallback.models needs replicas from the registry (router-sidecar "
            "replica agents, which register each engine's model); with --replica no replica has a model to "
            "fall back to. Drop --replica, or remove fallback.models",
            args.command,
        )
    if args.command == "envoy-config":
        return _envoy_config(args, policy, routes)
    from router_sidecar.runtime.gateway import GatewayError, GatewayOptions, run_gateway, run_sidecar_only

    try:
        if args.command == "gateway":
            options = GatewayOptions(
                listen=args.listen,
                replicas=tuple(args.replica),
                etcd=args.etcd,
                policy=policy,
                work_dir=Path(args.work_dir) if args.work_dir else None,
                tools=tuple(args.tool),
                routes=routes,
                metrics=args.metrics,
                endpoint_picker=_picker(args),
            )
            return _run_async(run_gateway(options))
        return _run_async(
            run_sidecar_only(args.listen, args.etcd, policy, tuple(args.replica), metrics=args.metrics)
        )
    except (GatewayError, EnvoyNotFound, EnvoyConfigInvalid, ValueError) as exc:
        return _fail(str(exc), args.command)
    except KeyboardInterrupt:
        return 130


def _envoy_config(args: argparse.Namespace, policy: Policy, routes: tuple[RouteOverlay, ...]) -> int:
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
            endpoint_picker=_picker(args),
        )
    )
    if args.output:
        Path(args.output).write_text(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
