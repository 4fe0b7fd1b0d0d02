"""`router-sidecar demo --fast` end to end, exactly as a user runs it: every scenario must pass."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from router_testbed.demo import SCENARIOS, TOTAL
from tests.harness import REPO

pytestmark = pytest.mark.integration

DEMO_TIMEOUT = 75.0  # below the suite-wide pytest timeout (120 s), leaving room for cleanup


def test_demo_fast_passes_every_scenario() -> None:
    env = {**os.environ, "NO_COLOR": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "router_sidecar", "demo", "--fast"],
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
    assert proc.returncode == 0, f"demo exited with {proc.returncode}:\n{output}"
    assert len(SCENARIOS) == TOTAL == 6
    for n, scenario in enumerate(SCENARIOS, 1):
        verdict = re.compile(rf"^VERDICT {n}/{TOTAL} PASS  {re.escape(scenario.title)}: ", re.MULTILINE)
        assert verdict.search(stdout), f"no PASS verdict for scenario {n} ({scenario.title}):\n{output}"
    assert f"{TOTAL}/{TOTAL} scenarios passed" in stdout
    assert "FAIL" not in stdout
