"""`router-testbed drill --gateway URL`: the failure scenarios against a running deployment, judged.

The scenario matrix (`scenarios.py`) sends requests through the gateway with faults injected into the
replicas (the simulator's ``x-sim-fault`` header, or shell hooks against real replicas), records the exact
bytes and times the client got and the gateway's journal (`client.py`, `evidence.py`), judges them against
the contract (`verdicts.py`, pure) and reports a verdict table, an HTML report with a timeline per request
and JSON (`report.py`). `run(Options)` is the in-process entry (the demo uses it); `main(argv)` the CLI's.
"""

from __future__ import annotations

from collections.abc import Sequence

from router_testbed.drill.cli import Options, run


def main(argv: Sequence[str] | None = None) -> int:
    from router_testbed.drill.cli import main as cli_main

    return cli_main(argv)


__all__ = ["Options", "main", "run"]
