"""`router-testbed drill` as a user runs it (a subprocess), against a real local gateway (Envoy + sidecar +
etcd) with simulated replicas: every scenario passes in sim mode and with shell hooks; against a server
that breaks the contract it exits 1 naming the violated scenario; against nothing it exits 2."""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from router_sidecar.runtime.envoy_config import find_envoy
from router_sidecar.runtime.supervise import free_port, port_open, start_envoy, wait_until
from router_testbed.drill.hooks import Hooks
from router_testbed.drill.scenarios import SCENARIOS
from router_testbed.toolsvc import spawn_toolsvc
from tests.harness import REPO, Agent, Gateway, Sim, sim_pool

pytestmark = pytest.mark.integration

DRILL_TIMEOUT = 60.0


def drill(*args: str, timeout: float = DRILL_TIMEOUT) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "router_testbed", "drill", *args],
        cwd=REPO,
        env={**os.environ, "NO_COLOR": "1"},
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def results(path: Path) -> dict[str, Any]:
    return dict(json.loads(path.read_text()))


# What the drill finds wrong in this repository's gateway today, by (API, scenario): the checks that fail
# (none: the last one, the 413 on /v1/messages in OpenAI's shape, was fixed in envoy/gateway.yaml).
KNOWN_VIOLATIONS: dict[tuple[str, str], list[str]] = {}


def test_every_scenario_passes_on_every_api_against_the_local_gateway(
    gateway: Gateway, sims: dict[str, Sim], tmp_path: Path
) -> None:
    """The matrix on chat completions, completions, the Responses API and the Messages API, each judged by
    its own rules, in one run (about 18 s here)."""
    report, data = tmp_path / "drill.html", tmp_path / "drill.json"
    logs = [arg for s in sims.values() for arg in ("--replica-log", str(s.log_path))]
    run = drill("--gateway", gateway.url, "--api", "all", *logs, "--report", str(report), "--json", str(data))
    output = run.stdout + run.stderr
    expected = [s.name for s in SCENARIOS if s.runs_in("sim", Hooks(), None)[0]]
    got = results(data)
    assert got["fault_mode"] == "sim" and got["apis"] == ["chat", "completions", "responses", "messages"]
    assert [(s["api"], s["name"]) for s in got["scenarios"]] == [
        (api, name) for api in got["apis"] for name in expected
    ]
    failed = {
        (s["api"], s["name"]): [c["what"] for c in s["checks"] if c["ok"] is False]
        for s in got["scenarios"]
        if not s["passed"]
    }
    assert failed == KNOWN_VIOLATIONS, output
    assert run.returncode == (1 if KNOWN_VIOLATIONS else 0), output
    # Each verdict says what it checked, by its API's rules; the replicas' own logs were read where they
    # matter.
    checks = {(s["api"], s["name"]): [c["what"] for c in s["checks"]] for s in got["scenarios"]}
    assert all(len(c) >= 5 for c in checks.values()), checks
    assert any(
        w.startswith("replica log: exactly one replica request")
        for w in checks[("chat", "client-disconnect")]
    )
    assert (
        "client: one preamble: exactly one response.created, sequence numbers 0, 1, 2, … without a gap or "
        "repeat" in checks[("responses", "dies-after-token")]
    )
    assert "client: one preamble: exactly one message_start" in checks[("messages", "dies-after-token")]
    assert (
        "client: the terminal event continues the stream: the response id of response.created, the next "
        "sequence number" in checks[("responses", "ends-without-done")]
    )
    assert (
        "client: the error event has one of Anthropic's error types (its SDK raises by it)"
        in checks[("messages", "error-after-first-delta")]
    )
    html = report.read_text()
    requests = sum(len(s["exchanges"]) for s in got["scenarios"])
    assert html.count("<svg") == requests >= 4 * len(expected)
    assert '<a href="#messages-healthy">' in html
    total = 4 * len(expected)
    assert f"{total - len(KNOWN_VIOLATIONS)}/{total} scenarios passed" in run.stdout


def test_hooks_freeze_and_kill_real_processes(gateway: Gateway, sims: dict[str, Sim], tmp_path: Path) -> None:
    # The hooks find a replica's process from the port the journal names: like a real deployment's hook
    # would map HOST:PORT to a pod or a unit.
    pids = tmp_path / "pids"
    pids.mkdir()
    for sim in sims.values():
        assert sim.child is not None
        (pids / str(sim.port)).write_text(str(sim.child.pid))
    data = tmp_path / "hooks.json"
    run = drill(
        "--gateway",
        gateway.url,
        "--freeze-cmd",
        f"kill -STOP $(cat {pids}/{{port}})",
        "--thaw-cmd",
        f"kill -CONT $(cat {pids}/{{port}})",
        "--kill-cmd",
        f"kill -KILL $(cat {pids}/{{port}})",
        "--scenario",
        "dies-after-first-delta",
        "--scenario",
        "frozen-after-first-delta",
        "--json",
        str(data),
    )
    assert run.returncode == 0, run.stdout + run.stderr
    got = results(data)
    assert got["fault_mode"] == "hooks"
    # The freeze runs first (its replica is thawed afterwards), the kill last.
    assert [s["name"] for s in got["scenarios"]] == ["frozen-after-first-delta", "dies-after-first-delta"]
    hooks = [h for s in got["scenarios"] for x in s["exchanges"] for h in x["hooks"]]
    assert [(h["action"], h["returncode"]) for h in hooks] == [("freeze", 0), ("thaw", 0), ("kill", 0)]
    # Whatever the drill froze, it thawed: no replica process is left stopped.
    for sim in sims.values():
        assert sim.child is not None
        if sim.child.alive():
            state = Path(f"/proc/{sim.child.pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            assert state != "T", f"{sim.name} left stopped"


def test_tool_replay_executes_the_side_effect_once(etcd: str, sims: dict[str, Sim], tmp_path: Path) -> None:
    toolsvc = spawn_toolsvc(name="payments", log_path=tmp_path / "executions.jsonl")
    gateway = None
    try:
        gateway = Gateway(
            replicas=[s.endpoint for s in sims.values()],
            etcd=etcd,
            work=tmp_path,
            tools=(f"payments={toolsvc.address}",),
        )
        data = tmp_path / "tool.json"
        args = ("--fault-mode", "none", "--scenario", "tool-replay", "--tool", "payments/charge")
        run = drill("--gateway", gateway.url, *args, "--json", str(data))
        assert run.returncode == 0, run.stdout + run.stderr
        [scenario] = results(data)["scenarios"]
        key = scenario["exchanges"][0]["request_id"]
        # The drill's verdict agrees with the tool's own log: one execution for three calls with the key.
        assert [e["key"] for e in toolsvc.executions()] == [key]
    finally:
        if gateway is not None:
            gateway.stop()
        toolsvc.stop()


class _BrokenGateway(BaseHTTPRequestHandler):
    """Answers like a gateway that cuts a stream silently: 200, two content events, then the end of the
    body without [DONE] or a terminal frame. It journals nothing."""

    protocol_version = "HTTP/1.0"  # the body ends when the connection closes

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def _json(self, status: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        if self.path == "/v1/models":
            self._json(200, {"data": [{"id": "tiny"}]})
        else:
            self._json(404, {"error": {"code": "not_found"}})

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("content-length", "0")))
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.send_header("x-request-id", self.headers.get("idempotency-key", ""))
        self.end_headers()
        for word in ("Once", " upon"):
            chunk = {"id": "chatcmpl-1", "choices": [{"index": 0, "delta": {"content": word}}]}
            self.wfile.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")


@pytest.fixture
def broken_gateway() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _BrokenGateway)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def test_a_silent_cut_is_a_violation_named_by_scenario(broken_gateway: str, tmp_path: Path) -> None:
    data = tmp_path / "broken.json"
    args = ("--gateway", broken_gateway, "--fault-mode", "none", "--scenario", "healthy", "--timeout", "2")
    run = drill(*args, "--json", str(data))
    assert run.returncode == 1, run.stdout + run.stderr
    assert re.search(r"^  healthy +chat  none +FAIL ", run.stdout, re.MULTILINE), run.stdout
    assert "FAIL healthy on chat completions (healthy request)" in run.stdout
    assert "  ✗ client: one complete answer: exactly one [DONE], last; no error frame; no reset" in run.stdout
    assert "      seen: HTTP 200, 2 content events, 0× [DONE]" in run.stdout
    assert "violated: healthy" in run.stdout
    [scenario] = results(data)["scenarios"]
    assert scenario["name"] == "healthy" and scenario["passed"] is False


def test_sim_mode_refuses_replicas_that_are_not_the_simulator(broken_gateway: str) -> None:
    run = drill("--gateway", broken_gateway, "--fault-mode", "sim")
    assert run.returncode == 2
    assert "do not look like the simulator" in run.stderr and "--fault-mode hooks" in run.stderr


def test_without_a_fault_mode_what_needs_the_simulator_is_not_applicable(
    broken_gateway: str, tmp_path: Path
) -> None:
    """Another gateway, replicas that are not the simulator: what needs no fault is judged, the rest is N/A
    with the reason, never a violation."""
    data = tmp_path / "other.json"
    run = drill("--gateway", broken_gateway, "--timeout", "2", "--json", str(data))
    assert run.returncode == 1, run.stdout + run.stderr  # its silent cut is still a violation
    assert "not router-sidecar: no journal at /v1/requests/{id}, its checks are N/A" in run.stdout
    got = results(data)
    assert got["router_sidecar"] is False and got["fault_mode"] == "none"
    verdicts = {s["name"]: s["verdict"] for s in got["scenarios"]}
    assert verdicts["healthy"] == "FAIL" and verdicts["malformed-input"] in ("PASS", "FAIL")
    assert verdicts["dies-in-prefill"] == verdicts["ends-without-done"] == "N/A"
    assert verdicts["duplicate-key"] == "N/A"
    assert (
        "N/A dies-in-prefill: needs router-testbed's simulator behind the gateway (x-sim-fault); GET "
        "/v1/models came without its x-sim-replica header" in run.stdout
    )
    assert (
        "N/A duplicate-key: not router-sidecar: one request per Idempotency-Key (409 for a duplicate) is "
        "router-sidecar's" in run.stdout
    )


PLAIN_ENVOY = """
static_resources:
  listeners:
  - name: plain
    address: {{socket_address: {{address: 127.0.0.1, port_value: {port}}}}}
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": {hcm}
          stat_prefix: plain
          route_config:
            virtual_hosts:
            - name: all
              domains: ["*"]
              include_request_attempt_count: true  # the simulator's attempt=1 faults need it
              routes:
              - match: {{prefix: "/"}}
                route:
                  cluster: replicas
                  timeout: 30s
                  retry_policy: {{retry_on: "reset,connect-failure,5xx", num_retries: 1}}
          http_filters:
          - name: envoy.filters.http.router
            typed_config: {{"@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router}}
  clusters:
  - name: replicas
    type: STATIC
    connect_timeout: 1s
    load_assignment:
      cluster_name: replicas
      endpoints:
      - lb_endpoints:
{endpoints}
"""


def test_plain_envoy_with_retries_is_judged_as_any_other_gateway(
    sims: dict[str, Sim], tmp_path: Path
) -> None:
    """The conformance run against another gateway: plain Envoy with retries in front of the simulators.
    It retries what fails before the response headers, but a replica that dies after its 200 and role
    event, or ends without [DONE], reaches the client as a broken stream: those are violations, the journal
    checks are N/A, and the replicas' logs (keyed by the client's Idempotency-Key) show the faults fired. The
    same on the Responses and Messages APIs, judged by their own ends."""
    port = free_port()
    endpoints = "\n".join(
        f"        - endpoint: {{address: {{socket_address: {{address: 127.0.0.1, port_value: {s.port}}}}}}}"
        for s in sims.values()
    )
    config = tmp_path / "plain-envoy.yaml"
    hcm = "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3."
    hcm += "HttpConnectionManager"
    config.write_text(PLAIN_ENVOY.format(port=port, endpoints=endpoints, hcm=hcm))
    envoy = start_envoy(find_envoy(), config, name="plain-envoy", log_path=tmp_path / "envoy.log")
    try:
        wait_until(lambda: port_open("127.0.0.1", port), timeout=30, what="plain Envoy", child=envoy)
        data = tmp_path / "plain.json"
        logs = [arg for s in sims.values() for arg in ("--replica-log", str(s.log_path))]
        run = drill("--gateway", f"http://127.0.0.1:{port}/v1", *logs, "--timeout", "10", "--json", str(data))
        # The named-event APIs, by their own rules: a retry after the preamble was sent, a silent cut.
        other = {
            api: drill(
                "--gateway",
                f"http://127.0.0.1:{port}",
                *logs,
                "--api",
                api,
                "--scenario",
                "dies-after-token",
                "--scenario",
                "ends-without-done",
                "--timeout",
                "10",
                "--json",
                str(tmp_path / f"plain-{api}.json"),
            )
            for api in ("responses", "messages")
        }
    finally:
        envoy.stop()
    # Each judged by its API's own end: no response.completed / message_stop, no terminal event.
    for api, end, terminal in (
        ("responses", "response.completed/response.incomplete", "response.failed"),
        ("messages", "message_stop", "event: error"),
    ):
        api_run = other[api]
        assert api_run.returncode == 1, api_run.stdout + api_run.stderr
        verdicts = {(s["api"], s["name"]): s for s in results(tmp_path / f"plain-{api}.json")["scenarios"]}
        assert {k: s["verdict"] for k, s in verdicts.items()} == {
            (api, "dies-after-token"): "FAIL",
            (api, "ends-without-done"): "FAIL",
        }
        failed = [c["what"] for c in verdicts[(api, "ends-without-done")]["checks"] if c["ok"] is False]
        assert failed == [f"client: exactly one terminal event ({terminal}), last; no {end}"], api_run.stdout
        failed = [c["what"] for c in verdicts[(api, "dies-after-token")]["checks"] if c["ok"] is False]
        assert f"client: one complete answer: exactly one {end}, last; no error event; no reset" in failed
    assert run.returncode == 1, run.stdout + run.stderr
    got = results(data)
    assert (got["router_sidecar"], got["fault_mode"]) == (False, "sim")
    verdicts = {s["name"]: s["verdict"] for s in got["scenarios"]}
    for name in ("dies-in-prefill", "dies-after-token", "ends-without-done", "all-replicas-fail"):
        assert verdicts[name] == "FAIL", (name, run.stdout)
    for name in ("healthy", "dies-after-first-delta", "slow-replica", "client-disconnect"):
        assert verdicts[name] == "PASS", (name, run.stdout)
    assert verdicts["duplicate-key"] == "N/A"
    prefill = next(s for s in got["scenarios"] if s["name"] == "dies-in-prefill")
    failed = [c["what"] for c in prefill["checks"] if c["ok"] is False]
    assert "client: one complete answer: exactly one [DONE], last; no error frame; no reset" in failed
    assert any(c["ok"] is None and c["what"].startswith("journal: the record of") for c in prefill["checks"])
    assert "violated: dies-in-prefill, dies-after-token, ends-without-done" in run.stdout


def test_an_unreachable_gateway_is_a_usage_error() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    run = drill("--gateway", url, "--fault-mode", "none")
    assert run.returncode == 2, run.stdout + run.stderr
    assert f"cannot reach the gateway at {url} (ConnectError" in run.stderr
    assert "Is it running and listening there?" in run.stderr
    assert run.stdout == ""


# --- the fallback scenario ------------------------------------------------------------------------------

FALLBACK_POLICY = """
fallback:
  models: [big]
  causes: [failed_before_content]
"""
TINY = ("t1", "t2")


@pytest.fixture(scope="module")
def fallback_pool(etcd: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Gateway, list[Sim]]]:
    """Two replicas of tiny and one of big, each registered by its agent, behind a gateway whose policy falls
    back from tiny to big (a fallback needs discovery: the registry says which replica serves which model)."""
    work: Path = tmp_path_factory.mktemp("drill-fallback")
    policy = work / "fallback.yaml"
    policy.write_text(FALLBACK_POLICY)
    with contextlib.ExitStack() as stack:
        tiny = stack.enter_context(sim_pool(work, TINY))
        big = stack.enter_context(sim_pool(work, ("big",), extra_args=("--model", "big")))
        sims = [*tiny.values(), *big.values()]
        for sim in sims:
            stack.callback(Agent(sim, etcd, work).stop)
        gateway = Gateway(replicas=[], etcd=etcd, work=work, config=policy)
        stack.callback(gateway.stop)
        gateway.wait_replicas_healthy(s.endpoint for s in sims)
        yield gateway, sims


def test_the_fallback_scenario_shows_big_answering_for_tiny_on_every_api(
    fallback_pool: tuple[Gateway, list[Sim]], tmp_path: Path
) -> None:
    """`--fallback-model big`: every replica of tiny answers 503 (the fault is scoped to tiny's replicas),
    big answers; the drill's evidence is the header, the model in the events, the usage, the journal's
    fallback record and the replicas' logs, on each API."""
    gateway, sims = fallback_pool
    data = tmp_path / "fallback.json"
    logs = [arg for s in sims for arg in ("--replica-log", str(s.log_path))]
    args = ("--model", "tiny", "--fallback-model", "big", "--scenario", "fallback", "--api", "all")
    run = drill("--gateway", gateway.url, *args, *logs, "--json", str(data))
    assert run.returncode == 0, run.stdout + run.stderr
    got = results(data)
    assert [(s["api"], s["name"], s["verdict"]) for s in got["scenarios"]] == [
        (api, "fallback", "PASS") for api in ("chat", "completions", "responses", "messages")
    ]
    endpoints = {s.endpoint: s.name for s in sims}
    for scenario in got["scenarios"]:
        [x] = scenario["exchanges"]
        assert (
            x["fault"] == "status503@headers model=tiny" and scenario["fault"] == f"x-sim-fault: {x['fault']}"
        )
        assert (x["status"], x["headers"]["x-router-fallback"], x["headers"]["x-router-attempts"]) == (
            200,
            "big",
            "3",
        )
        journal = x["journal"]
        assert (journal["phase"], journal["model"]) == ("completed", "tiny")
        attempts = journal["attempts"]
        assert [(a["outcome"], a["chosen_by"]) for a in attempts] == [
            ("failed", "gateway choice #1"),
            ("failed", "gateway choice #2"),
            ("completed", "fallback to model big, choice #3"),
        ]
        assert sorted(endpoints[a["replica"]] for a in attempts[:2]) == list(TINY)
        assert endpoints[attempts[2]["replica"]] == "big"
        fallback = journal["fallback"]
        assert (fallback["model"], fallback["requested_model"]) == ("big", "tiny")
        assert fallback["causes"] == [
            f"attempt {a['attempt']} on {a['replica']}: upstream_status" for a in journal["attempts"][:2]
        ]
        ends = [r for r in x["replica_records"] if r["event"] == "end"]
        assert sorted(
            (r["replica"], r["model"], r["outcome"], r["content_events_written"]) for r in ends
        ) == [
            ("big", "big", "completed", 8),
            ("t1", "tiny", "fault:status503", 0),
            ("t2", "tiny", "fault:status503", 0),
        ]
        passed = {c["what"] for c in scenario["checks"] if c["ok"] is True}
        assert {
            "client: the answer is the fallback model's own: its events name big, none tiny",
            "client: the answer carries its usage (the fallback's output tokens)",
            "client: x-router-fallback names the model that answered (big)",
            "journal: its fallback record names big for tiny, with one cause per failed attempt",
            "journal: one answered_by_fallback event (big for tiny, cause failed_before_content), after the "
            "last failed attempt",
            "replica log: every attempt on a replica of tiny failed before any content; one on a replica of "
            "big wrote the answer",
        } <= passed, scenario["checks"]
        [note] = [n for n in scenario["notes"] if n.startswith("answered by big for tiny")]
        assert (
            "x-router-fallback: big; the events name big; usage 8 output tokens; journal fallback: " in note
        )
        assert json.dumps(fallback) in note
    # The verdict table says so, and the note under it is the evidence.
    assert re.search(r"^  fallback +chat +x-sim-fault: status503@headers model=tiny +PASS ", run.stdout, re.M)
    assert "note fallback (chat): answered by big for tiny: x-router-fallback: big;" in run.stdout


def test_the_fallback_scenario_fails_against_a_gateway_without_a_fallback(
    gateway: Gateway, sims: dict[str, Sim], tmp_path: Path
) -> None:
    """The same request against a gateway with no fallback policy: both replicas of tiny answer 503 and the
    client gets retries_exhausted; the scenario names what is missing (the judge is not vacuous)."""
    data = tmp_path / "no-fallback.json"
    logs = [arg for s in sims.values() for arg in ("--replica-log", str(s.log_path))]
    run = drill(
        "--gateway",
        gateway.url,
        "--fallback-model",
        "big",
        "--scenario",
        "fallback",
        *logs,
        "--json",
        str(data),
    )
    assert run.returncode == 1, run.stdout + run.stderr
    [scenario] = results(data)["scenarios"]
    [x] = scenario["exchanges"]
    assert x["status"] == 502 and "x-router-fallback" not in x["headers"]
    failed = [c["what"] for c in scenario["checks"] if c["ok"] is False]
    assert failed == [
        "client: HTTP 200 with an event stream",
        "client: x-router-fallback names the model that answered (big)",
        "journal: every attempt on tiny failed before content, then one chosen as its fallback to big "
        "completed",
        "journal: its fallback record names big for tiny, with one cause per failed attempt",
        "journal: one answered_by_fallback event (big for tiny, cause failed_before_content), after the last "
        "failed attempt",
        "replica log: every attempt on a replica of tiny failed before any content; one on a replica of big "
        "wrote the answer",
    ], scenario["checks"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--scenario", "fallback"), "fallback needs --fallback-model NAME"),
        (("--fallback-gateway", "http://127.0.0.1:1"), "--fallback-gateway needs --fallback-model"),
        (("--model", "tiny", "--fallback-model", "tiny"), "--fallback-model must name another model"),
        (("--fallback-model", "big", "--fallback-gateway", "gw:8080"), "--fallback-gateway 'gw:8080' is not"),
    ],
)
def test_fallback_usage_errors(args: tuple[str, ...], message: str) -> None:
    run = drill("--gateway", "http://127.0.0.1:1", *args)
    assert run.returncode == 2 and message in run.stderr, run.stderr
