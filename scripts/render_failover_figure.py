"""Render the README's failover figure, docs/img/failover.svg, from a real run.

It starts what `make demo` starts, all on 127.0.0.1: etcd, two simulated replicas and the gateway
(`router_testbed.demo.Stack`), then runs the drill's two scenarios in which a replica dies before the first
content delta (`dies-after-token`: it sent `200` and its role event, then reset its connection) and after it
(`dies-after-first-delta`: two content events, then the reset), and writes their timelines as one standalone
SVG with `router-testbed drill --figure` (`router_testbed.drill.report.figure_svg`, the HTML report's
timeline drawing). Every process it started is stopped before it exits, also on Ctrl-C.

    .venv/bin/python scripts/render_failover_figure.py [--out docs/img/failover.svg] [--keep]

Exit status: the drill's (0: both scenarios passed; 1: a promise was violated, the figure shows it and
must not be committed as the README's picture; 2: the drill could not run).
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import signal
import sys
import tempfile
from pathlib import Path

from router_testbed.demo import REPLICA_NAMES, TOKEN_INTERVAL, Stack
from router_testbed.drill import Options, run

REPO = Path(__file__).resolve().parents[1]
FIGURE = REPO / "docs" / "img" / "failover.svg"
# Before the first delta (retried, invisible to the client), then after it (the prefix, then the end).
SCENARIOS = ("dies-after-token", "dies-after-first-delta")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=FIGURE, metavar="PATH.svg", help=f"default {FIGURE}")
    parser.add_argument(
        "--scenario",
        action="append",
        metavar="NAME",
        help=f"a drill scenario to draw, in this order (repeat; default: {' '.join(SCENARIOS)})",
    )
    parser.add_argument("--keep", action="store_true", help="keep the work dir (logs, the drill's report)")
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="failover-figure-"))
    stack = Stack(work, token_interval=TOKEN_INTERVAL)
    code = 2
    try:
        stack.start()
        options = Options(
            gateway=stack.url,
            credential="figure",
            scenarios=list(args.scenario or SCENARIOS),
            fault_mode="sim",
            replica_logs=[stack.sim_log(name) for name in REPLICA_NAMES],
            report=work / "drill-report.html",
            figure=args.out,
            progress=False,
            # As the demo's: a replica frozen and thawed in-process (for frozen-* scenarios, if asked for).
            hook_functions={
                action: (lambda address, sig=sig: stack.signal_replica(address, sig))
                for action, sig in (("freeze", signal.SIGSTOP), ("thaw", signal.SIGCONT))
            },
        )
        code = run(options, between=stack.between_scenarios)
    except KeyboardInterrupt:
        code = 130
    finally:
        stack.stop()
        if args.keep:
            print(f"kept {work}")
        else:
            with contextlib.suppress(OSError):
                shutil.rmtree(work)
    if code == 1:
        print(f"a promise was violated: {args.out} shows it; do not commit it as the README's figure")
    return code


if __name__ == "__main__":
    sys.exit(main())
