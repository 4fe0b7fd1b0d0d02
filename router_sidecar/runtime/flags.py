"""The values `router-sidecar`'s flags take, parsed once, with one-line errors that name the value and what is
allowed (argparse prefixes the flag: `argument --etcd: ...`). Pure functions: nothing here touches etcd, a
socket or a file, except the loopback check's name resolution."""

from __future__ import annotations

import argparse

from router_sidecar.runtime.envoy_config import Endpoint, parse_tool
from router_sidecar.telemetry.logs import LOG_FORMATS
from router_sidecar.telemetry.setup import MetricsListen, TelemetryConfigError

LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
SOCKET_EXAMPLE = "unix:/run/router-sidecar/sidecar.sock"


class FlagValueError(argparse.ArgumentTypeError):
    """A value a flag does not take; its message is one line."""


def endpoint(text: str) -> Endpoint:
    """HOST:PORT (an IPv6 host in brackets)."""
    try:
        return Endpoint.parse(text)
    except ValueError:
        raise FlagValueError(f"{text!r} is not HOST:PORT with a port 1-65535, e.g. 127.0.0.1:8080") from None


def port(text: str) -> int:
    """A TCP port, 1-65535."""
    if not text.isdigit() or not 0 < int(text) < 65536:
        raise FlagValueError(f"{text!r} is not a port 1-65535, e.g. 9003")
    return int(text)


def host_port(text: str) -> str:
    """HOST:PORT, kept as given (the replica agent's addresses)."""
    endpoint(text)
    return text


def tool(text: str) -> tuple[str, Endpoint]:
    try:
        return parse_tool(text)
    except ValueError:
        raise FlagValueError(
            f"{text!r} is not NAME=HOST:PORT (NAME of a-z 0-9 _ -), e.g. payments=10.0.0.9:8080"
        ) from None


def metrics(text: str) -> MetricsListen:
    try:
        return MetricsListen.parse(text)
    except TelemetryConfigError:
        raise FlagValueError(f"{text!r} is not PORT or HOST:PORT, e.g. 127.0.0.1:9464") from None


def log_level(text: str) -> str:
    """A logging level name, any case; returned as logging spells it (INFO)."""
    if text.lower() not in LOG_LEVELS:
        raise FlagValueError(f"{text!r} is not a log level; expected one of {', '.join(LOG_LEVELS)}")
    return text.upper()


def log_format(text: str) -> str:
    if text not in LOG_FORMATS:
        raise FlagValueError(
            f"{text!r} is not a log format; expected {' or '.join(LOG_FORMATS)} "
            "(--log-format, or $ROUTER_SIDECAR_LOG_FORMAT)"
        )
    return text


def etcd_endpoints(text: str) -> str:
    """`--etcd` as etcd's own clients take `--endpoints`: members as HOST:PORT or http://HOST:PORT, several
    separated by commas. Returned as HOST:PORT[,HOST:PORT...], the form the store dials. TLS is not
    implemented: an https:// member is refused as such, not reported later as an unreachable etcd."""
    from router_sidecar.coordination.store import grpc_target

    example = "e.g. 127.0.0.1:2379 or http://10.0.0.1:2379,http://10.0.0.2:2379"
    members = [m.strip() for m in text.split(",")]
    if not any(members):
        raise FlagValueError(
            f"{text!r} names no etcd member; expected HOST:PORT or http://HOST:PORT, {example}"
        )
    addresses: list[str] = []
    for member in members:
        scheme, sep, rest = member.partition("://")
        if sep:
            if scheme.lower() in ("https", "unixs"):
                raise FlagValueError(
                    f"{member!r}: TLS to etcd ({scheme}://) is not implemented; give http:// members (plain "
                    "gRPC) and keep etcd's client port on a network only the gateways and agents reach"
                )
            if scheme.lower() != "http":
                raise FlagValueError(f"{member!r} is not HOST:PORT or http://HOST:PORT, {example}")
            member = rest[:-1] if rest.endswith("/") else rest
        try:
            Endpoint.parse(member)
        except ValueError:
            raise FlagValueError(
                f"{member!r} is not HOST:PORT or http://HOST:PORT (port 1-65535), {example}"
            ) from None
        addresses.append(member)
    joined = ",".join(addresses)
    try:
        grpc_target(joined)
    except ValueError as exc:  # several members must be IP addresses of one family
        raise FlagValueError(f"{text!r}: {exc}") from None
    return joined


def sidecar_listen(text: str) -> str:
    """Where `serve` listens for Envoy: unix:PATH, or a loopback HOST:PORT (ext_proc carries every request
    and response, so never beyond loopback: extproc.server.check_bind_address)."""
    if text.startswith("unix:"):
        if not text[len("unix:") :]:
            raise FlagValueError(f"{text!r} has no path; e.g. {SOCKET_EXAMPLE}")
        return text
    host, sep, port = text.rpartition(":")
    if text.startswith(("/", "./", "~")) or text.endswith(".sock") or not sep:
        raise FlagValueError(
            f"{text!r} is not unix:PATH or 127.0.0.1:PORT; for a unix socket write unix:{text}"
            if text.startswith(("/", "./")) or text.endswith(".sock")
            else f"{text!r} is not unix:PATH or 127.0.0.1:PORT, e.g. {SOCKET_EXAMPLE}"
        )
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise FlagValueError(f"{text!r} is not unix:PATH or 127.0.0.1:PORT (port 1-65535)")
    from router_sidecar.extproc.server import check_bind_address

    try:
        check_bind_address(text)
    except ValueError as exc:
        raise FlagValueError(f"{exc}; give unix:PATH or a loopback address, e.g. 127.0.0.1:{port}") from None
    return text


def socket_path(text: str) -> str:
    """A unix socket's path; `unix:PATH` (as `serve --listen` spells it) is taken too."""
    path = text[len("unix:") :] if text.startswith("unix:") else text
    if not path:
        raise FlagValueError(f"{text!r} is not a socket path, e.g. /run/router-sidecar/sidecar.sock")
    return path
