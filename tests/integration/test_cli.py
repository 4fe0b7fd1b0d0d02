"""Start-up failures say what is wrong and what to do, and exit non-zero without leaving processes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from router_sidecar.runtime.supervise import free_port

pytestmark = pytest.mark.integration


def run_cli(
    *args: str, env: dict[str, str] | None = None, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "router_sidecar", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


def test_etcd_unreachable_at_start_is_a_clear_error() -> None:
    dead = f"127.0.0.1:{free_port()}"
    result = run_cli(
        "gateway", "--listen", f"127.0.0.1:{free_port()}", "--replica", "127.0.0.1:9", "--etcd", dead
    )
    assert result.returncode == 2
    assert f"etcd at {dead} is unreachable" in result.stderr
    assert "--etcd" in result.stderr and "Traceback" not in result.stderr
    assert "ready" not in result.stdout


def test_envoy_not_found_is_a_clear_error(etcd: str, tmp_path: Path) -> None:
    # Point every lookup away from a real binary: env var, PATH, and the project's .tools (via a copy).
    result = run_cli(
        "gateway",
        "--listen",
        f"127.0.0.1:{free_port()}",
        "--replica",
        "127.0.0.1:9",
        "--etcd",
        etcd,
        env={
            "ROUTER_SIDECAR_ENVOY": str(tmp_path / "no-envoy"),
            "PATH": "/usr/bin:/bin",
        },
    )
    assert result.returncode == 2
    assert "Envoy binary not found" in result.stderr and "make setup" in result.stderr


def test_invalid_policy_names_the_offending_key(etcd: str, tmp_path: Path) -> None:
    policy = tmp_path / "policy.yaml"
    policy.write_text("on_upstream_failure:\n  after_first_delta:\n    automatic_retry: true\n")
    result = run_cli(
        "gateway",
        "--listen",
        f"127.0.0.1:{free_port()}",
        "--replica",
        "127.0.0.1:9",
        "--etcd",
        etcd,
        "--config",
        str(policy),
    )
    assert result.returncode == 2
    assert "automatic_retry" in result.stderr and "Traceback" not in result.stderr


def test_bad_replica_address_is_rejected_by_the_parser() -> None:
    result = run_cli(
        "gateway", "--listen", "127.0.0.1:1", "--replica", "no-port-here", "--etcd", "127.0.0.1:1"
    )
    assert result.returncode == 2 and "HOST:PORT" in result.stderr


def test_sidecar_refuses_a_non_loopback_bind(etcd: str) -> None:
    result = run_cli("serve", "--bind", "0.0.0.0:50051", "--etcd", etcd)
    assert result.returncode == 2 and "loopback" in result.stderr


def test_serve_runs_the_sidecar_alone_and_stops_on_sigterm(etcd: str, tmp_path: Path) -> None:
    import signal

    from tests.harness import poll

    socket_path = tmp_path / "sidecar.sock"
    proc = subprocess.Popen(
        [sys.executable, "-m", "router_sidecar", "serve", "--bind", f"unix:{socket_path}", "--etcd", etcd],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        # No --replica and none registered: up, but waiting for replicas rather than claiming to be ready.
        line = proc.stdout.readline()
        assert line.startswith("waiting for replicas: sidecar serving ext_proc, access log and EDS on unix:")
        assert "the readiness probe answers 503 (no_replica_available) until there is one" in line, line
        poll(socket_path.exists, timeout=5, what="the unix socket")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
