"""The attempt machine's figures in docs/design.md are what its tables draw now (see
scripts/machine_diagrams.py)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from router_sidecar.core.attempt import TRANSITIONS, AttemptState, Kind

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "machine_diagrams.py"


def load_script():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("machine_diagrams", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_design_documents_figures_are_drawn_from_the_tables() -> None:
    script = load_script()
    assert script.main(["--check"]) == 0, "run: .venv/bin/python scripts/machine_diagrams.py"


def test_every_state_change_of_the_table_is_in_the_figure() -> None:
    figure = load_script().attempt_diagram()
    for (state, kind), step in TRANSITIONS.items():
        if step.next is not state:
            edge = f"{state.name} --> {step.next.name}: "
            lines = [line for line in figure.splitlines() if edge in line]
            assert any(kind.value in line for line in lines), (state, kind)


def test_every_state_is_reachable_and_every_kind_used() -> None:
    reached = {AttemptState.AWAITING_HEADERS} | {step.next for step in TRANSITIONS.values()}
    assert reached == set(AttemptState)
    assert {kind for _, kind in TRANSITIONS} == set(Kind)
