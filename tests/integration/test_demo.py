"""`router-testbed demo --fast` end to end, exactly as a user runs it: the stack comes up, the drill runs
every scenario the simulator can fault, every one passes, and the report it leaves behind is complete."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from router_testbed.drill.hooks import Hooks
from router_testbed.drill.scenarios import SCENARIOS, run_order
from tests.harness import REPO

pytestmark = pytest.mark.integration

DEMO_TIMEOUT = 75.0  # below the suite-wide pytest timeout (120 s), leaving room for cleanup


def _unused(replica: str) -> tuple[int, str]:
    raise AssertionError("only its presence counts")


def test_demo_fast_passes_every_scenario() -> None:
    env = {**os.environ, "NO_COLOR": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "router_testbed", "demo", "--fast"],
        cwd=REPO,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=DEMO_TIMEOUT)
    except subprocess.TimeoutExpired:
        proc.terminate()  # the demo turns SIGTERM into its cleanup path: no orphaned Envoy or etcd
        stdout, stderr = proc.communicate(timeout=30)
        pytest.fail(f"demo did not finish within {DEMO_TIMEOUT}s:\n{stdout}{stderr}")
    output = stdout + stderr
    report = re.search(r"^HTML report: (.+)$", stdout, re.MULTILINE)
    work = Path(report.group(1)).parent if report else None
    try:
        assert proc.returncode == 0, f"demo exited with {proc.returncode}:\n{output}"
        # Sim mode with the demo's freeze/thaw hooks: every scenario but the kill hook's and the tool's.
        hooks = Hooks(functions={"freeze": _unused, "thaw": _unused})
        expected = [
            s.name for s in run_order([s for s in SCENARIOS if s.runs_in("sim", hooks, None)[0]], "sim")
        ]
        assert len(expected) == 13 and expected[-2:] == ["frozen-in-prefill", "frozen-after-first-delta"]
        for name in expected:
            row = re.compile(rf"^  {re.escape(name)} +x?-?.* PASS +\d+/\d+ ", re.MULTILINE)
            assert row.search(stdout), f"no PASS row for {name}:\n{output}"
            assert f"drill [{expected.index(name) + 1}/{len(expected)}] {name} PASS" in stderr  # not a tty
        assert f"{len(expected)}/{len(expected)} scenarios passed" in stdout
        assert "FAIL" not in stdout
        # The report outlives the demo (the rest of its work dir does not): one picture per request.
        assert report is not None and work is not None, stdout
        html = Path(report.group(1)).read_text()
        results = json.loads((work / "drill-results.json").read_text())
        assert [s["name"] for s in results["scenarios"]] == expected and results["passed"] is True
        requests = sum(len(s["exchanges"]) for s in results["scenarios"])
        assert html.count("<svg") == requests >= len(expected)
        assert sorted(p.name for p in work.iterdir()) == ["drill-report.html", "drill-results.json"]
    finally:
        if work is not None and work.name.startswith("router-sidecar-demo-"):
            shutil.rmtree(work, ignore_errors=True)
