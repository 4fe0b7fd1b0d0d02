"""`router-sidecar trace` against a real gateway: the command a user runs, as a subprocess.

One request fails over (attempt 1 answers 503 before any content, attempt 2 completes), then its journal is
shown as text and as JSON; look-up failures (unknown id, another tenant, no credential, nothing listening)
exit 1 with one clear line.
"""

from __future__ import annotations

import http.server
import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

from router_sidecar.runtime.supervise import free_port
from tests.harness import REPO, Gateway, chat, post

pytestmark = pytest.mark.integration

TOKEN = "test-tenant"  # the harness's credential (tests.harness.CREDENTIAL)


def trace(*args: str, stdin: str = "", env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("ROUTER_SIDECAR_")}
    return subprocess.run(
        [sys.executable, "-m", "router_sidecar", "trace", *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=30,
        cwd=REPO,
        env={**clean, **(env or {})},
    )


@pytest.fixture(scope="module")
def failed_over(gateway: Gateway) -> dict[str, Any]:
    """A request whose first attempt failed before content and whose second completed: its final record."""
    result = post(
        f"{gateway.url}/v1/chat/completions",
        chat(max_tokens=4),
        headers={"x-sim-fault": "status503@headers attempt=1"},
    )
    assert result.status == 200, result.body
    return gateway.wait_journal(
        result.request_id,
        lambda j: j["phase"] == "completed" and any(e["event"] == "stream_completed" for e in j["events"]),
    )


def test_trace_shows_both_attempts_side_by_side(gateway: Gateway, failed_over: dict[str, Any]) -> None:
    rid = failed_over["request_id"]
    first, second = failed_over["attempts"]
    out = trace(rid, "--gateway", gateway.url, "--credential", TOKEN, "--width", "120")
    assert out.returncode == 0, out.stderr
    assert out.stderr == ""
    text = out.stdout
    assert "\x1b[" not in text  # not a terminal: no colours
    assert f"request   {rid}\n" in text
    assert "result    completed\n" in text
    assert "attempts  2" in text
    assert f"attempt 1  {first['attempt_id']}  on {first['replica']}: failed (upstream_status)" in text
    assert f"attempt 2  {second['attempt_id']}  on {second['replica']}: completed" in text
    lines = text.splitlines()
    header = next(line for line in lines if line.lstrip().startswith("time"))
    assert header.index("request") < header.index(f"attempt 1 {first['replica']}")
    assert header.index(f"attempt 1 {first['replica']}") < header.index(f"attempt 2 {second['replica']}")
    col_1, col_2 = header.index("attempt 1"), header.index("attempt 2")

    def row(text_start: str) -> str:
        return next(line for line in lines if line[col_1:].lstrip().startswith(text_start))

    # Each attempt's events are printed in its own column.
    assert row(f"started on {first['replica']}").index("started") == col_1
    assert row("failed: upstream_status").index("failed") == col_1
    assert row(f"started on {second['replica']}").index("started") == col_2
    assert row("first delta sent").index("first delta") == col_2
    assert any(
        line.lstrip().startswith("+0.0 ms  accepted chat.completions, model tiny, stream") for line in lines
    )
    assert "stream completed: 4 output tokens delivered" in text
    # The last lines: what the client got, in one (wrapped) sentence.
    assert " ".join(text.split()).endswith(
        f"The client got one complete answer from attempt 2 on {second['replica']} (4 output tokens), "
        "after 1 attempt that failed before any content."
    )


def test_trace_json_groups_events_per_attempt(gateway: Gateway, failed_over: dict[str, Any]) -> None:
    rid = failed_over["request_id"]
    out = trace(rid, "--gateway", gateway.url, "--header", f"Authorization: Bearer {TOKEN}", "--json")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert (doc["request_id"], doc["phase"], doc["outcome"]) == (rid, "completed", "completed")
    assert doc["attempt_count"] == 2 and [a["attempt"] for a in doc["attempts"]] == [1, 2]
    assert (doc["events"][0]["event"], doc["events"][0]["t_ms"]) == ("request_accepted", 0)
    first, second = doc["attempts"]
    assert first["outcome"] == "failed" and second["outcome"] == "completed"
    assert second["replica"] == failed_over["attempts"][1]["replica"]
    assert "attempt_failed" in [e["event"] for e in first["events"]]
    assert "first_delta_sent" in [e["event"] for e in second["events"]]
    for event in [*doc["events"], *first["events"], *second["events"]]:
        assert isinstance(event["t_ms"], float | int) and 0 <= event["t_ms"] < 30_000
    # The retry's lease was granted after the failed attempt's was revoked (in the machine form too).
    assert first["lease"]["revoked_ms"] <= second["lease"]["granted_ms"]


def test_gateway_and_credential_from_the_environment(gateway: Gateway, failed_over: dict[str, Any]) -> None:
    env = {"ROUTER_SIDECAR_GATEWAY": gateway.url, "ROUTER_SIDECAR_CREDENTIAL": TOKEN}
    out = trace(failed_over["request_id"], "--json", env=env)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["request_id"] == failed_over["request_id"]


def test_trace_of_a_saved_record(failed_over: dict[str, Any], tmp_path: Path) -> None:
    path = tmp_path / "record.json"
    path.write_text(json.dumps(failed_over))
    out = trace("--file", str(path))
    assert out.returncode == 0, out.stderr
    assert f"request   {failed_over['request_id']}" in out.stdout
    from_stdin = trace(failed_over["request_id"], "--file", "-", stdin=json.dumps(failed_over))
    assert from_stdin.returncode == 0 and from_stdin.stdout == out.stdout
    other = trace("someone-elses-id", "--file", str(path))
    assert other.returncode == 1
    assert f"holds the record of {failed_over['request_id']!r}, not 'someone-elses-id'" in other.stderr


@pytest.mark.parametrize(
    ("content", "error"),
    [
        (None, "cannot read"),
        ("{not json", "is not JSON"),
        ("[1, 2]", "holds JSON that is not a journal record (a list)"),
    ],
)
def test_a_saved_record_that_is_not_one(tmp_path: Path, content: str | None, error: str) -> None:
    path = tmp_path / "record.json"
    if content is not None:
        path.write_text(content)
    out = trace("--file", str(path))
    assert out.returncode == 1 and out.stdout == ""
    assert error in out.stderr and len(out.stderr.strip().splitlines()) == 1


def test_no_request_id_says_what_to_give() -> None:
    out = trace()
    assert out.returncode == 1
    assert "give a REQUEST_ID" in out.stderr


def test_unknown_request_id_is_a_clear_404(gateway: Gateway) -> None:
    out = trace("no-such-request-1", "--gateway", gateway.url, "--credential", TOKEN)
    assert out.returncode == 1 and out.stdout == ""
    assert out.stderr.startswith(
        "router-sidecar trace: no journal record for no-such-request-1 visible to this credential: "
        "request_not_found"
    ), out.stderr
    assert len(out.stderr.strip().splitlines()) == 1


def test_another_tenants_record_is_not_visible(gateway: Gateway, failed_over: dict[str, Any]) -> None:
    out = trace(failed_over["request_id"], "--gateway", gateway.url, "--credential", "someone-else")
    assert out.returncode == 1
    assert f"no journal record for {failed_over['request_id']} visible to this credential" in out.stderr


def test_no_credential_is_refused_and_says_what_to_pass(gateway: Gateway) -> None:
    out = trace("any-request", "--gateway", gateway.url)
    assert out.returncode == 1
    assert "the gateway refused the look-up (401): authentication_required" in out.stderr
    assert "--credential" in out.stderr


def test_invalid_request_id_is_refused_before_asking(gateway: Gateway) -> None:
    out = trace("../v1/models", "--gateway", gateway.url, "--credential", TOKEN)
    assert out.returncode == 1
    assert "invalid request id '../v1/models'" in out.stderr


def test_nothing_listening_says_cannot_reach() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    out = trace("some-request", "--gateway", url, "--credential", TOKEN)
    assert out.returncode == 1 and out.stdout == ""
    assert out.stderr.startswith(f"router-sidecar trace: cannot reach the gateway at {url}: "), out.stderr
    assert "is it running? pass --gateway" in out.stderr
    assert "Traceback" not in out.stderr


class _NotAGateway(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = b"<html>hello</html>"
        self.send_response(200)
        self.send_header("content-type", "text/html")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        pass


def test_an_answer_that_is_not_json_is_a_clear_error() -> None:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _NotAGateway)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        out = trace("some-request", "--gateway", url, "--credential", TOKEN)
    finally:
        server.shutdown()
        server.server_close()
    assert out.returncode == 1
    assert f"the gateway at {url} answered with something that is not JSON (content-type text/html)" in (
        out.stderr
    )
