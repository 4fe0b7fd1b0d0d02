"""`router-testbed`: the testbed's tools, one subcommand each (each parses its own flags).

router-testbed sim --listen HOST:PORT ...     a simulated vLLM / SGLang replica
router-testbed demo [--fast] [--real-vllm]    etcd + 2 replicas + the gateway, then the drill against it
router-testbed drill --gateway URL ...        the failover scenarios against any OpenAI-compatible gateway
router-testbed toolsvc --listen HOST:PORT ... the test tool service (executions logged)
router-testbed epp --listen HOST:PORT --endpoint IP:PORT ...   a local endpoint picker (GAIE protocol)
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence
from importlib.metadata import PackageNotFoundError, version

PROG = "router-testbed"
# name -> (module whose main(argv) runs it, one line for the usage)
COMMANDS: dict[str, tuple[str, str]] = {
    "sim": (
        "router_testbed.sim.server",
        "a simulated vLLM 0.32 / SGLang 0.5.23 replica with fault injection",
    ),
    "demo": (
        "router_testbed.demo",
        "etcd + two replicas + the gateway on loopback, then the drill against it",
    ),
    "drill": (
        "router_testbed.drill.cli",
        "the failover scenarios against a running OpenAI-compatible gateway, judged (HTML report)",
    ),
    "toolsvc": ("router_testbed.toolsvc", "the test tool service: a side effect per call, logged"),
    "epp": (
        "router_testbed.epp.server",
        "a local endpoint picker: GAIE's endpoint-picker protocol v1.0.0 over Envoy ext_proc",
    ),
}


def package_version() -> str:
    try:
        return version("router-testbed")
    except PackageNotFoundError:  # run from a checkout without installing: say so rather than guess
        return "unknown (not installed)"


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = [f"usage: {PROG} [--version] COMMAND [ARGS...]", "", "commands:"]
    lines += [f"  {name:<{width}}  {what}" for name, (_, what) in COMMANDS.items()]
    lines += [
        "",
        f"`{PROG} COMMAND --help` lists a command's flags. "
        "See docs/drill.md, docs/simulator.md, docs/endpoint-picker.md.",
    ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args:
        print(usage(), file=sys.stderr)
        return 2
    if args[0] in ("-h", "--help"):
        print(usage())
        return 0
    if args[0] == "--version":
        print(f"{PROG} {package_version()}")
        return 0
    name, rest = args[0], args[1:]
    if name not in COMMANDS:
        print(f"{PROG}: unknown command {name!r}; expected one of {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[name][0])
    return int(module.main(rest))


if __name__ == "__main__":
    sys.exit(main())
