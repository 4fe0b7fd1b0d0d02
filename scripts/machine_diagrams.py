"""Draw the attempt machine's tables (`router_sidecar/core/attempt.py`) as Mermaid state diagrams.

The diagrams in docs/design.md#the-attempt-machine are this script's output, pasted between markers; the
figure cannot drift from the code, because `tests/unit/test_machine_diagrams.py` fails when the document's
copy differs from what the tables draw now. h11 does the same for its state tables.

    .venv/bin/python scripts/machine_diagrams.py           # rewrite the diagrams in docs/design.md
    .venv/bin/python scripts/machine_diagrams.py --check   # exit 1 if they are out of date
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

from router_sidecar.core.attempt import LEASE_TRANSITIONS, REPLY_TRANSITIONS, TRANSITIONS, Action

DESIGN_DOC = Path(__file__).resolve().parents[1] / "docs" / "design.md"


def attempt_diagram() -> str:
    """Every transition that changes the state, and every one that stays but does something. Pairs that stay
    and do nothing (a chunk held, a late signal ignored) are left out; pairs not in the table raise."""
    edges: dict[tuple[str, str, tuple[Action, ...]], list[str]] = defaultdict(list)
    for (state, kind), step in TRANSITIONS.items():
        if step.next is state and not step.actions:
            continue
        edges[(state.name, step.next.name, step.actions)].append(kind.value)
    lines = ["stateDiagram-v2", "    direction LR", "    [*] --> AWAITING_HEADERS"]
    for (source, target, actions), kinds in edges.items():
        label = " / ".join(filter(None, [", ".join(kinds), " + ".join(a.value for a in actions)]))
        lines.append(f"    {source} --> {target}: {label}")
    return "\n".join(lines)


def small_diagram(table: dict, initial: str) -> str:  # type: ignore[type-arg]
    """A table `(state, event) → state` (the reply and the lease): its state-changing transitions."""
    edges: dict[tuple[str, str], list[str]] = defaultdict(list)
    for (state, event), after in table.items():
        if after is not state:
            edges[(state.name, after.name)].append(event.value)
    lines = ["stateDiagram-v2", "    direction LR", f"    [*] --> {initial}"]
    lines += [f"    {s} --> {t}: {', '.join(events)}" for (s, t), events in edges.items()]
    return "\n".join(lines)


DIAGRAMS = {
    "attempt-machine": attempt_diagram,
    "attempt-reply": lambda: small_diagram(REPLY_TRANSITIONS, "NOTHING_YET"),
    "attempt-lease": lambda: small_diagram(LEASE_TRANSITIONS, "HELD"),
}


def render(text: str) -> str:
    """`text` with every generated block replaced by what the tables draw now."""
    for name, draw in DIAGRAMS.items():
        begin, end = f"<!-- BEGIN generated: {name} -->", f"<!-- END generated: {name} -->"
        head, found, rest = text.partition(begin)
        if not found:
            raise SystemExit(f"{DESIGN_DOC}: no '{begin}' marker")
        _, found, tail = rest.partition(end)
        if not found:
            raise SystemExit(f"{DESIGN_DOC}: no '{end}' marker")
        text = f"{head}{begin}\n```mermaid\n{draw()}\n```\n{end}{tail}"
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if docs/design.md is out of date")
    args = parser.parse_args(argv)
    current = DESIGN_DOC.read_text()
    fresh = render(current)
    if args.check:
        if fresh != current:
            print("docs/design.md: the machine diagrams are out of date; run scripts/machine_diagrams.py")
            return 1
        return 0
    DESIGN_DOC.write_text(fresh)
    return 0


if __name__ == "__main__":
    sys.exit(main())
