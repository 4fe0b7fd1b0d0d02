"""`router-testbed`, the testbed's own command: its subcommands, its version, one-line errors; and the
testbed finds the checkout it lives in (testbed/router_testbed/), where the real-engine venvs are."""

from __future__ import annotations

from pathlib import Path

import pytest

from router_testbed import cli, real_engine

REPO = Path(__file__).resolve().parents[2]


def test_the_commands_and_the_version(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out == "router-testbed 0.1.0\n"
    assert cli.main(["--help"]) == 0
    usage = capsys.readouterr().out
    assert usage.startswith("usage: router-testbed [--version] COMMAND [ARGS...]\n")
    assert [line.split()[0] for line in usage.splitlines() if line.startswith("  ")] == [
        "sim",
        "demo",
        "drill",
        "toolsvc",
        "epp",
    ]


def test_a_missing_or_unknown_command_exits_2_with_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["simulate"]) == 2
    assert capsys.readouterr().err == (
        "router-testbed: unknown command 'simulate'; expected one of sim, demo, drill, toolsvc, epp\n"
    )
    assert cli.main([]) == 2
    assert capsys.readouterr().err.startswith("usage: router-testbed")


def test_each_command_parses_its_own_flags_under_its_own_name(capsys: pytest.CaptureFixture[str]) -> None:
    for name in cli.COMMANDS:
        with pytest.raises(SystemExit) as stopped:
            cli.main([name, "--help"])
        assert stopped.value.code == 0
        assert capsys.readouterr().out.startswith(f"usage: router-testbed {name} ")


def test_the_real_engine_launcher_looks_in_the_checkout() -> None:
    assert real_engine.REPO == REPO
    assert (
        real_engine.VLLM_VENV == REPO / ".venv-vllm"
        and real_engine.TINY_MODEL == REPO / ".tools" / "tiny-model"
    )
