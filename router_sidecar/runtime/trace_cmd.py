"""`router-sidecar trace REQUEST_ID`: a request's journal as a readable timeline, or `--json` for machines.

The record is fetched from the gateway's look-up (`GET /v1/requests/{id}`, with the credential the request
was sent with: look-ups are scoped per tenant) or read from a file; `router_sidecar.core.timeline` renders
it. Standard library only: the product package does not depend on an HTTP client.
"""

from __future__ import annotations

import argparse
import http.client
import ipaddress
import json
import os
import shutil
import sys
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Sequence
from typing import Any

from router_sidecar.core.routes import valid_key
from router_sidecar.core.timeline import DEFAULT_WIDTH, as_json, render_text

PROG = "router-sidecar trace"
DEFAULT_GATEWAY = "http://127.0.0.1:8080"
TIMEOUT_SECONDS = 10.0
MAX_RECORD_BYTES = 16 * 1024 * 1024  # a record is bounded by etcd's value size; more is not a record


class TraceError(Exception):
    """A one-line reason the trace cannot be shown (exit 1)."""


def _header(text: str) -> tuple[str, str]:
    name, sep, value = text.partition(":")
    name, value = name.strip(), value.strip()
    if not sep or not name or any(c in text for c in "\r\n\0") or " " in name:
        raise argparse.ArgumentTypeError(f"expected NAME:VALUE, got {text!r}")
    return name, value


DESCRIPTION = (
    "show a logical request's journal record as a timeline: the request and each attempt side by side, "
    "times relative to admission, and what the client got"
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of `router-sidecar trace` (the product's parser adds them to its subcommand)."""
    parser.add_argument("request_id", nargs="?", metavar="REQUEST_ID", help="the request's id (x-request-id)")
    parser.add_argument(
        "--gateway",
        type=_gateway_url,
        default=os.environ.get("ROUTER_SIDECAR_GATEWAY") or DEFAULT_GATEWAY,
        metavar="URL",
        help=f"the gateway's client-facing URL (default $ROUTER_SIDECAR_GATEWAY or {DEFAULT_GATEWAY})",
    )
    parser.add_argument(
        "--credential",
        default=os.environ.get("ROUTER_SIDECAR_CREDENTIAL"),
        metavar="TOKEN",
        help="the bearer token the request was sent with: records are scoped to it "
        "(default $ROUTER_SIDECAR_CREDENTIAL)",
    )
    parser.add_argument(
        "--header",
        type=_header,
        action="append",
        default=[],
        metavar="NAME:VALUE",
        help="a header for the look-up, e.g. 'x-api-key: KEY' (repeat); overrides --credential",
    )
    parser.add_argument("--json", action="store_true", help="machine-readable output (times as t_ms)")
    parser.add_argument(
        "--file", metavar="PATH", help="render a saved record instead of fetching ('-': stdin)"
    )
    parser.add_argument("--no-color", action="store_true", help="no colours (default: only on a terminal)")
    parser.add_argument(
        "--width", type=_width_value, help="text width, at least 40 (default: the terminal's, else 110)"
    )


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description=DESCRIPTION)
    add_arguments(parser)
    return parser


def _gateway_url(text: str) -> str:
    try:
        _gateway_base(text)
    except TraceError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an http(s) URL, e.g. {DEFAULT_GATEWAY}") from None
    return text


def _width_value(text: str) -> int:
    if not text.isdigit() or int(text) < 40:
        raise argparse.ArgumentTypeError(f"{text!r} is not a width; expected a number of columns >= 40")
    return int(text)


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _gateway_base(url: str) -> str:
    if "://" not in url:
        url = "http://" + url  # `127.0.0.1:8080` as the gateway's --listen spells it
    try:
        parsed = urllib.parse.urlsplit(url)
        scheme, host = parsed.scheme, parsed.hostname
    except ValueError:  # e.g. an unclosed IPv6 bracket
        scheme, host = "", None
    if scheme not in ("http", "https") or not host:
        raise TraceError(f"--gateway must be an http(s) URL such as {DEFAULT_GATEWAY}, got {url!r}")
    return url.rstrip("/")


def _gateway_message(body: bytes) -> str:
    """The `error.message` of the gateway's JSON error, else the start of what it said, on one line."""
    try:
        error = json.loads(body).get("error", {})
        message = f"{error.get('code', '')}: {error.get('message', '')}".strip(": ")
    except (ValueError, AttributeError):
        message = body[:200].decode("utf-8", "replace")
    return " ".join(message.split())[:300] or "(empty answer)"


def fetch(gateway: str, request_id: str, headers: dict[str, str]) -> dict[str, Any]:
    """The record from the gateway's look-up; TraceError with a one-line reason otherwise."""
    base = _gateway_base(gateway)
    # The id goes into the path quoted: an odd id must reach the gateway as one segment (and get its 404).
    url = f"{base}/v1/requests/{urllib.parse.quote(request_id, safe='')}"
    request = urllib.request.Request(url, headers={"accept": "application/json", **headers})
    handlers: list[urllib.request.BaseHandler] = []
    if _is_loopback(urllib.parse.urlsplit(base).hostname or ""):
        handlers.append(urllib.request.ProxyHandler({}))  # a proxy cannot reach our loopback gateway
    opener = urllib.request.build_opener(*handlers)
    try:
        with opener.open(request, timeout=TIMEOUT_SECONDS) as response:
            body = response.read(MAX_RECORD_BYTES + 1)
            content_type = response.headers.get("content-type", "")
    except urllib.error.HTTPError as exc:
        message = _gateway_message(exc.read(64 * 1024))
        if exc.code == 404:
            raise TraceError(
                f"no journal record for {request_id} visible to this credential: {message} "
                "(records are scoped to the credential the request was sent with, and expire)"
            ) from None
        if exc.code in (401, 403):
            raise TraceError(
                f"the gateway refused the look-up ({exc.code}): {message}; pass the credential the request "
                "was sent with (--credential TOKEN or --header NAME:VALUE)"
            ) from None
        raise TraceError(f"the gateway at {base} answered {exc.code}: {message}") from None
    except (urllib.error.URLError, OSError, http.client.HTTPException) as exc:
        # HTTPException: something listens there but does not speak HTTP
        reason = exc.reason if isinstance(exc, urllib.error.URLError) else f"{type(exc).__name__}: {exc}"
        reason = " ".join(str(reason).split())  # one line, whatever the server sent
        raise TraceError(
            f"cannot reach the gateway at {base}: {reason}; is it running? pass --gateway"
        ) from None
    if len(body) > MAX_RECORD_BYTES:
        raise TraceError(f"the gateway at {base} answered more than {MAX_RECORD_BYTES} bytes: not a record")
    try:
        record = json.loads(body)
    except ValueError:
        start = " ".join(body[:80].decode("utf-8", "replace").split())
        raise TraceError(
            f"the gateway at {base} answered with something that is not JSON "
            f"(content-type {content_type or 'none'}): {start!r}; is --gateway the gateway's listener?"
        ) from None
    if not isinstance(record, dict):
        raise TraceError(f"the gateway at {base} answered JSON that is not a record: {type(record).__name__}")
    return record


def load_file(path: str) -> dict[str, Any]:
    try:
        if path == "-":
            text = sys.stdin.buffer.read(MAX_RECORD_BYTES + 1)
        else:
            with open(path, "rb") as f:
                text = f.read(MAX_RECORD_BYTES + 1)
    except OSError as exc:
        raise TraceError(f"cannot read {path}: {exc.strerror or exc}") from None
    name = "stdin" if path == "-" else path
    try:
        record = json.loads(text)
    except ValueError as exc:
        raise TraceError(f"{name} is not JSON: {exc}") from None
    if not isinstance(record, dict):
        raise TraceError(f"{name} holds JSON that is not a journal record (a {type(record).__name__})")
    return record


def _headers(args: argparse.Namespace) -> dict[str, str]:
    headers: dict[str, str] = {}
    if args.credential:
        headers["authorization"] = f"Bearer {args.credential}"
    for name, value in args.header:
        if name.lower() in ("authorization", "x-api-key"):
            headers.pop("authorization", None)  # an explicit credential header replaces --credential
        headers[name.lower()] = value
    return headers


def _width(args: argparse.Namespace, tty: bool) -> int:
    if args.width is not None:
        return args.width
    if tty:
        return max(60, min(shutil.get_terminal_size((DEFAULT_WIDTH, 24)).columns, 160))
    return DEFAULT_WIDTH


def _run(args: argparse.Namespace) -> str:
    if args.file is not None:
        record = load_file(args.file)
        if args.request_id is not None and record.get("request_id") != args.request_id:
            raise TraceError(
                f"{args.file} holds the record of {record.get('request_id')!r}, not {args.request_id!r}"
            )
    else:
        if args.request_id is None:
            raise TraceError("give a REQUEST_ID (the client's x-request-id), or --file PATH")
        if not valid_key(args.request_id):
            raise TraceError(
                f"invalid request id {args.request_id!r}: ids are 1-200 of A-Z a-z 0-9 . _ : ~ - "
                "(the gateway would answer 404)"
            )
        record = fetch(args.gateway, args.request_id, _headers(args))
    if args.json:
        return json.dumps(as_json(record), indent=2, ensure_ascii=False) + "\n"
    tty = sys.stdout.isatty()
    color = tty and not args.no_color and not os.environ.get("NO_COLOR")
    return render_text(record, color=color, width=_width(args, tty))


def main(argv: Sequence[str] | None = None) -> int:
    return run(_parser().parse_args(argv))


def run(args: argparse.Namespace) -> int:
    """Show the record `args` name: 0, or 1 with a one-line reason on stderr."""
    try:
        output = _run(args)
    except TraceError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 1
    try:
        if hasattr(sys.stdout, "reconfigure"):
            sys.stdout.reconfigure(errors="replace")  # a record's text must not crash a non-UTF-8 terminal
        sys.stdout.write(output)
        sys.stdout.flush()
    except BrokenPipeError:
        # `trace ... | head`: the reader is gone; say nothing more (and keep Python's exit flush quiet).
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0
