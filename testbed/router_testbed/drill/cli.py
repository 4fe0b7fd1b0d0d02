"""`router-testbed drill --gateway URL`: options, the pre-flight check, the run, the reports, the exit code.

The gateway may be router-sidecar or any other OpenAI-compatible one (a conformance run for honest
failover). The pre-flight finds out what is there: whether the replicas behind it are router-testbed's
simulator (its fault header works) and whether the gateway keeps router-sidecar's journal. What cannot be
judged against it is reported as not applicable (N/A), never as a violation.

`--api` picks the streaming API the matrix runs on (chat completions by default; `all`: each of the four in
turn), each judged by its own rules (`apis.py`).

Exit status: 0 when every scenario that applies passed, 1 when any promise was violated, 2 on a usage error
or when the gateway cannot be used (unreachable, not the replicas an explicit --fault-mode needs, or no
scenario applies).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import secrets
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, TextIO
from urllib.parse import urlsplit

from router_testbed.drill import apis
from router_testbed.drill.hooks import DEFAULT_HOOK_TIMEOUT, HookFunction, Hooks
from router_testbed.drill.scenarios import (
    BY_NAME,
    DEFAULT_OVERSIZE,
    MODES,
    SCENARIOS,
    Result,
    Scenario,
    not_applicable,
    plan,
    run_order,
)

if TYPE_CHECKING:
    from router_testbed.drill.client import Client

EXIT_PASSED, EXIT_VIOLATION, EXIT_USAGE = 0, 1, 2


class UsageError(Exception):
    """What is wrong and what to do; the drill exits 2 with it."""


@dataclass
class Options:
    gateway: str
    credential: str = "drill"
    scenarios: list[str] = field(default_factory=list)  # empty: every one the fault mode supports
    fault_mode: str | None = None  # None: hooks if a hook is given, else sim
    hooks: dict[str, str] = field(default_factory=dict)  # action -> shell command template
    hook_functions: dict[str, HookFunction] = field(default_factory=dict)  # in-process hooks (the demo)
    hook_timeout: float = DEFAULT_HOOK_TIMEOUT
    replica_logs: list[Path] = field(default_factory=list)
    tool: str | None = None
    model: str | None = None
    fallback_model: str | None = None  # the model the gateway's policy falls back to: the fallback scenario
    fallback_gateway: str | None = None  # the gateway with that policy, when it is not `gateway`
    report: Path | None = None
    json_path: Path | None = None
    figure: Path | None = None  # one standalone SVG with the timelines of the scenarios run
    timeout: float = 30.0
    long_tokens: int = 400
    oversize_bytes: int = DEFAULT_OVERSIZE
    progress: bool = True
    color: bool | None = None  # None: on a terminal without NO_COLOR
    apis: list[str] = field(default_factory=lambda: [apis.DEFAULT])  # the APIs to run the matrix on


def build_parser() -> argparse.ArgumentParser:
    names = ", ".join(s.name for s in SCENARIOS)
    p = argparse.ArgumentParser(
        prog="router-testbed drill",
        description="Run the failure scenarios against a running gateway, router-sidecar or any other "
        "OpenAI-compatible one, and judge what the client got, the journal (router-sidecar's) and "
        "(simulator) the replicas' logs. Exit 0: every promise that applies held; 1: a violation; "
        "2: usage error or unusable gateway.",
        epilog=f"scenarios: {names}. See docs/drill.md.",
    )
    p.add_argument(
        "--gateway",
        required=True,
        metavar="URL",
        help="the gateway's base URL, http(s)://HOST:PORT (an OpenAI-style base URL ending in /v1 is taken "
        "too)",
    )
    p.add_argument(
        "--credential",
        default="drill",
        metavar="KEY",
        help="the API key, sent as Authorization: Bearer KEY (default: drill; router-sidecar scopes journal "
        "look-ups to it)",
    )
    p.add_argument(
        "--api",
        choices=(*apis.NAMES, apis.ALL),
        default=apis.DEFAULT,
        help="the streaming API to run the matrix on: chat (POST /v1/chat/completions, the default), "
        "completions, responses (OpenAI's Responses API), messages (Anthropic's Messages API), or all (the "
        "matrix once per API); each judged by its API's own rules",
    )
    p.add_argument(
        "--scenario",
        action="append",
        default=[],
        metavar="NAME",
        help="run this scenario (repeat; default: every one the fault mode supports)",
    )
    p.add_argument(
        "--fault-mode",
        choices=MODES,
        default=None,
        help="sim: the simulator's x-sim-fault header; hooks: --kill-cmd/--freeze-cmd against real "
        "replicas; none: no fault (default: hooks when a hook is given, else sim when the replicas are the "
        "simulator, else none, with the scenarios that need a fault reported N/A)",
    )
    p.add_argument("--kill-cmd", metavar="CMD", help="kill a replica: shell command, {replica}=HOST:PORT")
    p.add_argument("--freeze-cmd", metavar="CMD", help="freeze a replica (e.g. SIGSTOP): shell command")
    p.add_argument("--thaw-cmd", metavar="CMD", help="thaw a frozen replica (e.g. SIGCONT): shell command")
    p.add_argument("--hook-timeout", type=float, default=DEFAULT_HOOK_TIMEOUT, metavar="S")
    p.add_argument(
        "--replica-log",
        action="append",
        default=[],
        type=Path,
        metavar="PATH",
        help="a simulated replica's JSONL log (repeat): also judge what the replicas themselves saw",
    )
    p.add_argument("--tool", metavar="NAME[/PATH]", help="run tool-replay against POST /tools/NAME/PATH")
    p.add_argument("--model", help="the model to ask for (default: the first of GET /v1/models)")
    p.add_argument(
        "--fallback-model",
        metavar="NAME",
        help="run the fallback scenario: the gateway's policy falls back from --model to NAME "
        "(fallback.models, its replicas registered beside --model's); every replica of --model answers 503 "
        "(x-sim-fault)",
    )
    p.add_argument(
        "--fallback-gateway",
        metavar="URL",
        help="the gateway the fallback scenario runs against, when that policy is another gateway's than "
        "--gateway's (default: --gateway)",
    )
    p.add_argument("--report", type=Path, metavar="PATH.html", help="write the HTML report here")
    p.add_argument("--json", dest="json_path", type=Path, metavar="PATH", help="write JSON results here")
    p.add_argument(
        "--figure",
        type=Path,
        metavar="PATH.svg",
        help="write the timelines of the scenarios run (pick them with --scenario), one above the other, "
        "as one standalone SVG image (docs/img/failover.svg is one)",
    )
    p.add_argument("--timeout", type=float, default=30.0, metavar="S", help="per request (default 30)")
    p.add_argument(
        "--long-tokens",
        type=int,
        default=400,
        metavar="N",
        help="max_tokens of a stream that a real replica must still be writing when a hook hits it",
    )
    p.add_argument("--oversize-bytes", type=int, default=DEFAULT_OVERSIZE, metavar="N")
    p.add_argument("--no-progress", action="store_true", help="no progress bar or lines on stderr")
    return p


def gateway_base(url: str) -> str:
    """The URL the drill's paths (/v1/...) go under: an OpenAI-style base URL (`.../v1`) is taken too."""
    base = url.rstrip("/")
    return base[: -len("/v1")] if base.endswith("/v1") else base


def options_from_args(argv: Sequence[str] | None) -> Options:
    parser = build_parser()
    a = parser.parse_args(argv)
    hooks = {k: c for k, c in (("kill", a.kill_cmd), ("freeze", a.freeze_cmd), ("thaw", a.thaw_cmd)) if c}
    return Options(
        gateway=gateway_base(a.gateway),
        credential=a.credential,
        scenarios=list(a.scenario),
        fault_mode=a.fault_mode,
        hooks=hooks,
        hook_timeout=a.hook_timeout,
        replica_logs=list(a.replica_log),
        tool=a.tool,
        model=a.model,
        fallback_model=a.fallback_model,
        fallback_gateway=a.fallback_gateway and gateway_base(a.fallback_gateway),
        report=a.report,
        json_path=a.json_path,
        figure=a.figure,
        timeout=a.timeout,
        long_tokens=a.long_tokens,
        oversize_bytes=a.oversize_bytes,
        progress=not a.no_progress,
        apis=apis.parse(a.api),
    )


def select(options: Options, hooks: Hooks) -> tuple[str, list[Scenario]]:
    """The fault mode and the scenarios to run, or a UsageError saying what to change."""
    for flag, gateway in (("--gateway", options.gateway), ("--fallback-gateway", options.fallback_gateway)):
        url = urlsplit(gateway or "http://unset")
        if url.scheme not in ("http", "https") or not url.netloc:
            raise UsageError(f"{flag} {gateway!r} is not an http(s) URL, e.g. http://127.0.0.1:8080")
    if options.fallback_gateway and not options.fallback_model:
        raise UsageError("--fallback-gateway needs --fallback-model (the model its policy falls back to)")
    if options.fallback_model is not None and options.fallback_model == options.model:
        raise UsageError("--fallback-model must name another model than --model")
    for name, value in (("--timeout", options.timeout), ("--hook-timeout", options.hook_timeout)):
        if not value > 0:
            raise UsageError(f"{name} must be a number of seconds > 0")
    if options.long_tokens < 8:
        raise UsageError("--long-tokens must be at least 8")
    unknown_apis = [a for a in options.apis if a not in apis.API]
    if unknown_apis or not options.apis:
        raise UsageError(f"--api: expected one of {', '.join(apis.NAMES)} or {apis.ALL}")
    mode = options.fault_mode or ("hooks" if hooks.available else "sim")
    if "freeze" in hooks.available and "thaw" not in hooks.available:
        raise UsageError("--freeze-cmd needs --thaw-cmd: a frozen replica must be thawed after its scenario")
    unknown = [n for n in options.scenarios if n not in BY_NAME]
    if unknown:
        raise UsageError(f"unknown scenario(s) {', '.join(unknown)}; known: {', '.join(BY_NAME)}")
    if options.scenarios:
        chosen = [BY_NAME[n] for n in dict.fromkeys(options.scenarios)]
        allowed = {s.name: s.runs_in(mode, hooks, options.tool, options.fallback_model) for s in chosen}
        refused = [f"{name} {why}" for name, (ok, why) in allowed.items() if not ok]
        if refused:
            raise UsageError(f"with --fault-mode {mode}: {'; '.join(refused)}")
    else:
        chosen = [s for s in SCENARIOS if s.runs_in(mode, hooks, options.tool, options.fallback_model)[0]]
    if not chosen:
        raise UsageError(f"no scenario can run with --fault-mode {mode}")
    return mode, run_order(chosen, mode)


def _unreachable(gateway: str, exc: Exception) -> UsageError:
    return UsageError(
        f"cannot reach the gateway at {gateway} ({type(exc).__name__}: {exc}). Is it running and listening "
        "there? Start one with `router-sidecar gateway --listen HOST:PORT --replica ... --etcd ...` (or "
        "`make demo`), or fix --gateway."
    )


@dataclass(frozen=True)
class Target:
    """What the pre-flight found behind --gateway."""

    model: str
    simulator: bool  # the replicas are router-testbed's simulator: x-sim-fault works
    router_sidecar: bool  # the gateway keeps router-sidecar's journal (GET /v1/requests/{id})


def preflight(client: Client, options: Options, mode: str, run_id: str) -> Target:
    """Reach the gateway, learn the model, and find out whether the replicas are the simulator and whether
    the gateway is router-sidecar. An explicit --fault-mode sim needs the simulator (a real engine ignores
    x-sim-fault, and every fault scenario would then fail for the wrong reason)."""
    import httpx

    try:
        response = client.get("/v1/models")
        router_sidecar = client.keeps_journal(f"drill-{run_id}-probe")
    except httpx.HTTPError as exc:
        raise _unreachable(options.gateway, exc) from None
    model = options.model
    if model is None:
        try:
            data = response.json().get("data") if response.status_code == 200 else None
            model = str(data[0]["id"]) if isinstance(data, list) and data else None
        except (ValueError, AttributeError, KeyError, TypeError):
            model = None
    simulator = "x-sim-replica" in response.headers
    if mode == "sim" and options.fault_mode == "sim" and not simulator:
        raise UsageError(
            f"--fault-mode sim, but the replicas behind {options.gateway} do not look like the simulator "
            f"(GET /v1/models answered HTTP {response.status_code} without its x-sim-replica header), so "
            "the x-sim-fault header would be ignored. Use --fault-mode hooks with --kill-cmd/--freeze-cmd "
            "for real replicas, or --fault-mode none."
        )
    return Target(model or "tiny", simulator, router_sidecar)


def applicable(
    chosen: list[Scenario], mode: str, target: Target, hooks: Hooks, tool: str | None
) -> tuple[str, list[Scenario], list[Result]]:
    """The fault mode after the pre-flight, the scenarios to run, and those that do not apply to this
    gateway (each with why). Without an explicit --fault-mode, replicas that are not the simulator mean no
    fault: what needs one is not applicable. A gateway that is not router-sidecar cannot be judged on the
    promises only router-sidecar makes, nor drive a hook that looks the serving replica up in its journal."""
    na: list[Result] = []
    if mode == "sim" and not target.simulator:
        mode = "none"
        runnable = [s for s in chosen if s.runs_in(mode, hooks, tool)[0]]
        na += [
            not_applicable(
                s,
                "sim",
                "needs router-testbed's simulator behind the gateway (x-sim-fault); GET /v1/models came "
                "without its x-sim-replica header",
            )
            for s in chosen
            if s not in runnable
        ]
        chosen = runnable
    if not target.router_sidecar:
        na += [
            not_applicable(s, mode, f"not router-sidecar: {why}")
            for s in chosen
            if (why := s.needs_router_sidecar(mode)) is not None
        ]
        chosen = [s for s in chosen if s.needs_router_sidecar(mode) is None]
    return mode, chosen, na


def run(
    options: Options,
    *,
    out: TextIO | None = None,
    err: TextIO | None = None,
    before: Callable[[Scenario], None] | None = None,
    between: Callable[[], None] | None = None,
) -> int:
    """Run the drill; print the verdict table to `out`, progress and errors to `err`; write the reports.
    `before` runs before each scenario (the demo waits there for the gateway a scenario needs), `between`
    after each (the demo restarts a replica a scenario killed)."""
    out = out or sys.stdout
    err = err or sys.stderr
    from router_testbed.drill import report
    from router_testbed.drill.client import Client
    from router_testbed.drill.progress import Progress
    from router_testbed.drill.scenarios import Context, run_scenario

    hooks = Hooks(options.hooks, options.hook_functions, options.hook_timeout)
    try:
        mode, chosen = select(options, hooks)
    except UsageError as exc:
        err.write(f"router-testbed drill: {exc}\n")
        return EXIT_USAGE
    client = Client(
        gateway_base(options.gateway),
        credential=options.credential,
        timeout=options.timeout,
        replica_logs=options.replica_logs,
    )
    # The fallback scenario's gateway, when its policy is another gateway's (the demo runs one for it).
    fallback_client = (
        Client(
            options.fallback_gateway,
            credential=options.credential,
            timeout=options.timeout,
            replica_logs=options.replica_logs,
        )
        if options.fallback_gateway and options.fallback_gateway != gateway_base(options.gateway)
        else None
    )
    started_at, started = time.time(), time.monotonic()
    run_id = time.strftime("%H%M%S") + secrets.token_hex(2)
    results: list[Result] = []
    try:
        try:
            target = preflight(client, options, mode, run_id)
        except UsageError as exc:
            err.write(f"router-testbed drill: {exc}\n")
            return EXIT_USAGE
        model = target.model
        mode, chosen, skipped = applicable(chosen, mode, target, hooks, options.tool)
        if not chosen:
            reasons = "; ".join(f"{r.scenario.name}: {r.not_applicable}" for r in skipped)
            err.write(f"router-testbed drill: no chosen scenario applies to {options.gateway} ({reasons})\n")
            return EXIT_USAGE
        client.journal = target.router_sidecar
        if fallback_client is not None:
            fallback_client.journal = target.router_sidecar  # a gateway of the same deployment
        runs = plan(chosen, mode, options.apis)
        # What does not apply to this gateway does not, on any API (tool-replay on none).
        skipped = [
            dataclasses.replace(
                r, api=api if r.scenario.per_api else None, fault=r.scenario.fault_in(mode, api, model)
            )
            for api in options.apis
            for r in skipped
            if r.scenario.per_api or api == options.apis[0]
        ]
        ctx = Context(
            client,
            mode,
            model,
            run_id,
            hooks=hooks,
            tool=options.tool,
            long_tokens=options.long_tokens,
            oversize_bytes=options.oversize_bytes,
            timeout=options.timeout,
            router_sidecar=target.router_sidecar,
            fallback_model=options.fallback_model,
            fallback_client=fallback_client,
        )
        progress = Progress(len(runs), err, enabled=options.progress)
        for scenario, api in runs:
            ctx.api = api or options.apis[0]
            label = scenario.name if api is None or len(options.apis) == 1 else f"{api} {scenario.name}"
            if before is not None:
                before(scenario)
            progress.start(label)
            result = run_scenario(ctx, scenario)
            results.append(result)
            progress.finish(label, result.passed, result.seconds)
            if between is not None:
                between()
        progress.close()
        results += skipped
    finally:
        client.close()
        if fallback_client is not None:
            fallback_client.close()
    seconds = time.monotonic() - started
    color = options.color if options.color is not None else out.isatty() and not os.environ.get("NO_COLOR")
    style = report.Style(color)
    info = report.RunInfo(
        options.gateway, mode, model, run_id, started_at, seconds, target.router_sidecar, list(options.apis)
    )
    kind = (
        "router-sidecar: its journal is judged too"
        if target.router_sidecar
        else "not router-sidecar: no journal at /v1/requests/{id}, its checks are N/A"
    )
    fallback = ""
    if options.fallback_model is not None:
        at = f" at {fallback_client.gateway}" if fallback_client is not None else ""
        fallback = f", fallback model {options.fallback_model}{at}"
    out.write(
        f"router-testbed drill against {options.gateway} (fault mode {mode}, model {model}{fallback}, "
        f"api {', '.join(options.apis)}; {kind})\n"
    )
    out.write(report.verdict_table(results, style) + "\n\n")
    line = report.summary_line(results, seconds)
    passed = report.all_passed(results)
    out.write((style.green(line) if passed else style.red(line)) + "\n")
    if options.report is not None:
        options.report.parent.mkdir(parents=True, exist_ok=True)
        options.report.write_text(report.html_report(info, results), encoding="utf-8")
        out.write(f"HTML report: {options.report}\n")
    if options.json_path is not None:
        options.json_path.parent.mkdir(parents=True, exist_ok=True)
        options.json_path.write_text(json.dumps(report.to_json(info, results), indent=1), encoding="utf-8")
        out.write(f"JSON results: {options.json_path}\n")
    if options.figure is not None:
        options.figure.parent.mkdir(parents=True, exist_ok=True)
        options.figure.write_text(report.figure_svg(info, results), encoding="utf-8")
        out.write(f"figure: {options.figure}\n")
    out.flush()
    return EXIT_PASSED if passed else EXIT_VIOLATION


def main(argv: Sequence[str] | None = None) -> int:
    try:
        import httpx  # noqa: F401 - the testbed extra; say so instead of a traceback
    except ImportError:
        sys.stderr.write(
            "router-testbed drill needs httpx, a dependency of router-testbed: pip install httpx\n"
        )
        return EXIT_USAGE
    options = options_from_args(argv)
    try:
        return run(options)
    except KeyboardInterrupt:
        sys.stderr.write("\nrouter-testbed drill: interrupted\n")
        return 130
