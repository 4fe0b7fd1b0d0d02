"""`router-testbed demo --fast` end to end, exactly as a user runs it: the stack comes up, the drill runs
every scenario the simulator can fault, every one passes, and the report it leaves behind is complete. Its
last scene is the fallback, on its own gateway: big answers for tiny, said out loud."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from router_testbed.demo import FALLBACK_MODEL, FALLBACK_POOL, MODEL
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
        # Sim mode with the demo's freeze/thaw hooks and its fallback model: every scenario but the kill
        # hook's and the tool's.
        hooks = Hooks(functions={"freeze": _unused, "thaw": _unused})
        runnable = [s for s in SCENARIOS if s.runs_in("sim", hooks, None, FALLBACK_MODEL)[0]]
        expected = [s.name for s in run_order(runnable, "sim")]
        assert len(expected) == 14
        assert expected[-3:] == ["frozen-in-prefill", "frozen-after-first-delta", "fallback"]
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
        check_fallback_scene(stdout, results)
        assert sorted(p.name for p in work.iterdir()) == ["drill-report.html", "drill-results.json"]
    finally:
        if work is not None and work.name.startswith("router-sidecar-demo-"):
            shutil.rmtree(work, ignore_errors=True)


def check_fallback_scene(stdout: str, results: dict[str, Any]) -> None:
    """The fallback scene ran on the second gateway (its own pool, registered by agents): both replicas of
    tiny answered 503 before content, big answered, and what the client got and the journal say so."""
    fallback_gateway = re.search(
        r"^  fallback gateway (http://127\.0\.0\.1:\d+) \(Envoy \+ sidecar, pid \d+; policy fallback\.models "
        r"\[big\]\) over (.+), registered by their agents$",
        stdout,
        re.MULTILINE,
    )
    assert fallback_gateway is not None, stdout
    pool = dict(re.findall(r"(\S+) 127\.0\.0\.1:\d+ \((\w+)\)", fallback_gateway.group(2)))
    assert pool == FALLBACK_POOL
    assert f"fallback model {FALLBACK_MODEL} at {fallback_gateway.group(1)}" in stdout
    [scene] = [s for s in results["scenarios"] if s["name"] == "fallback"]
    assert scene["fault"] == f"x-sim-fault: status503@headers model={MODEL}"
    [x] = scene["exchanges"]
    assert (x["status"], x["headers"]["x-router-fallback"], x["headers"]["x-router-attempts"]) == (
        200,
        "big",
        "3",
    )
    chunks = [e["data"] for e in x["events"] if isinstance(e["data"], dict)]
    assert {c["model"] for c in chunks} == {"big"}
    assert chunks[-1]["usage"]["completion_tokens"] == 8
    journal = x["journal"]
    assert (journal["phase"], journal["model"]) == ("completed", MODEL)
    attempts = journal["attempts"]
    assert [(a["outcome"], a["chosen_by"]) for a in attempts] == [
        ("failed", "gateway choice #1"),
        ("failed", "gateway choice #2"),
        ("completed", "fallback to model big, choice #3"),
    ]
    assert journal["fallback"] == {
        "model": "big",
        "requested_model": MODEL,
        "causes": [f"attempt {a['attempt']} on {a['replica']}: upstream_status" for a in attempts[:2]],
    }
    ends = {r["replica"]: r for r in x["replica_records"] if r["event"] == "end"}
    assert {n: (r["model"], r["outcome"], r["content_events_written"]) for n, r in ends.items()} == {
        "tiny-a": (MODEL, "fault:status503", 0),
        "tiny-b": (MODEL, "fault:status503", 0),
        "big-a": ("big", "completed", 8),
    }
    note = f"note fallback: answered by big for {MODEL}: x-router-fallback: big; the events name big; usage 8"
    assert note in stdout and json.dumps(journal["fallback"]) in stdout
