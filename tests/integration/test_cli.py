"""The CLI as a user runs it: start-up failures say what is wrong and what to do, and exit non-zero without
leaving processes; a bad flag value is one line on stderr and exit 2, reported before etcd is asked; the
old spellings work and say what replaces them; `--etcd` takes etcd's own URL form."""

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
        "--policy",
        str(policy),
    )
    assert result.returncode == 2
    assert "automatic_retry" in result.stderr and "Traceback" not in result.stderr
    assert result.stderr.startswith(f"router-sidecar gateway: error: --policy {policy}: ")
    assert result.stderr.count("\n") == 1  # one line, whatever the policy's own message looks like


def test_a_policy_that_is_not_yaml_is_one_line_too(tmp_path: Path) -> None:
    policy = tmp_path / "policy.yaml"
    policy.write_text("deadlines:\n  request_seconds: [1,\n")
    render = ["envoy-config", "--listen", "127.0.0.1:8080", "--sidecar-socket", "s", "--admin-socket", "a"]
    result = run_cli(*render, "--policy", str(policy))
    assert (result.returncode, result.stdout) == (2, "")
    assert result.stderr.startswith(f"router-sidecar envoy-config: error: --policy {policy}: ")
    assert "is not valid YAML" in result.stderr and result.stderr.count("\n") == 1


def test_a_fallback_with_static_replicas_is_refused_before_etcd_is_asked(tmp_path: Path) -> None:
    # --replica says nothing of the models replicas serve: a fallback would never happen (inert config).
    policy = tmp_path / "policy.yaml"
    policy.write_text("fallback:\n  models: [big]\n")
    result = run_cli(
        "gateway",
        "--listen",
        "127.0.0.1:1",
        "--replica",
        "127.0.0.1:9",
        "--etcd",
        f"127.0.0.1:{free_port()}",
        "--policy",
        str(policy),
    )
    assert (result.returncode, result.stdout) == (2, "")
    assert "fallback.models needs replicas from the registry" in result.stderr
    assert result.stderr.count("\n") == 1


def test_bad_replica_address_is_rejected_by_the_parser() -> None:
    result = run_cli(
        "gateway", "--listen", "127.0.0.1:1", "--replica", "no-port-here", "--etcd", "127.0.0.1:1"
    )
    assert result.returncode == 2 and "HOST:PORT" in result.stderr


def test_sidecar_refuses_a_non_loopback_bind_before_asking_etcd() -> None:
    # etcd is not running there either: the first thing wrong is the address, and that is what is said.
    result = run_cli("serve", "--listen", "0.0.0.0:50051", "--etcd", f"127.0.0.1:{free_port()}")
    assert (result.returncode, result.stdout) == (2, "")
    assert result.stderr == (
        "router-sidecar serve: error: argument --listen: the sidecar listens on a unix socket or loopback "
        "only, not '0.0.0.0:50051'; give unix:PATH or a loopback address, e.g. 127.0.0.1:50051\n"
    )


def test_version() -> None:
    for argv in (["--version"], ["version"]):
        result = run_cli(*argv)
        assert (result.returncode, result.stdout, result.stderr) == (0, "router-sidecar 0.1.0\n", "")


AGENT = ["replica", "--engine", "127.0.0.1:8000", "--advertise", "10.0.0.5:8000", "--etcd", "127.0.0.1:1"]
BAD_VALUES = [
    (
        ["--log-level", "LOUD", "envoy-config"],
        "router-sidecar: error: argument --log-level: 'LOUD' is not a log level; expected one of debug, "
        "info, warning, error, critical",
    ),
    (
        ["gateway", "--listen", "127.0.0.1:1", "--etcd", "127.0.0.1:1", "--log-level", "LOUD"],
        "router-sidecar gateway: error: argument --log-level: 'LOUD' is not a log level; expected one of "
        "debug, info, warning, error, critical",
    ),
    (
        ["serve", "--listen", "/run/x/sidecar.sock", "--etcd", "127.0.0.1:1"],
        "router-sidecar serve: error: argument --listen: '/run/x/sidecar.sock' is not unix:PATH or "
        "127.0.0.1:PORT; for a unix socket write unix:/run/x/sidecar.sock",
    ),
    (
        ["serve", "--bind", "/run/x/sidecar.sock", "--etcd", "127.0.0.1:1"],
        "router-sidecar serve: error: argument --listen: '/run/x/sidecar.sock' is not unix:PATH or "
        "127.0.0.1:PORT; for a unix socket write unix:/run/x/sidecar.sock",
    ),
    (
        ["gateway", "--listen", "127.0.0.1:1", "--etcd", "https://127.0.0.1:2379"],
        "router-sidecar gateway: error: argument --etcd: 'https://127.0.0.1:2379': TLS to etcd (https://) is "
        "not implemented; give http:// members (plain gRPC) and keep etcd's client port on a network only "
        "the gateways and agents reach",
    ),
    (
        ["gateway", "--listen", "127.0.0.1:1", "--etcd", "http://10.0.0.1:2379,etcd-b:2379"],
        "router-sidecar gateway: error: argument --etcd: 'http://10.0.0.1:2379,etcd-b:2379': etcd endpoints "
        "'10.0.0.1:2379,etcd-b:2379': several members must all be IPv4 or all IPv6 addresses; for DNS names "
        "give one name that resolves to every member (e.g. a headless Service)",
    ),
    (
        ["gateway", "--listen", "8080", "--etcd", "127.0.0.1:1"],
        "router-sidecar gateway: error: argument --listen: '8080' is not HOST:PORT with a port 1-65535, e.g. "
        "127.0.0.1:8080",
    ),
    (
        ["gateway", "--listen", "127.0.0.1:1", "--replica", "no-port-here", "--etcd", "127.0.0.1:1"],
        "router-sidecar gateway: error: argument --replica: 'no-port-here' is not HOST:PORT with a port "
        "1-65535, e.g. 127.0.0.1:8080",
    ),
    (
        ["gateway", "--listen", "127.0.0.1:1", "--etcd", "127.0.0.1:1", "--metrics", "lots"],
        "router-sidecar gateway: error: argument --metrics: 'lots' is not PORT or HOST:PORT, e.g. "
        "127.0.0.1:9464",
    ),
    (
        ["replica", "--engine", "127.0.0.1:8000", "--advertise", "10.0.0.5", "--etcd", "127.0.0.1:1"],
        "router-sidecar replica: error: argument --advertise: '10.0.0.5' is not HOST:PORT with a port "
        "1-65535, e.g. 127.0.0.1:8080",
    ),
    (
        ["serve", "--etcd", "127.0.0.1:1"],
        "router-sidecar serve: error: the following arguments are required: --listen",
    ),
    (
        [*AGENT, "--ttl", "0"],
        "router-sidecar replica: error: --ttl must be ≥ 1 second, got 0",
    ),
    (
        [*AGENT, "--interval", "20"],
        "router-sidecar replica: error: --interval must be > 0 and < --ttl (10s), got 20",
    ),
]


@pytest.mark.parametrize(("argv", "line"), BAD_VALUES, ids=[" ".join(a) for a, _ in BAD_VALUES])
def test_a_bad_value_is_one_line_and_exit_2(argv: list[str], line: str) -> None:
    result = run_cli(*argv)
    assert (result.returncode, result.stdout, result.stderr) == (2, "", line + "\n")


def test_a_bad_log_format_in_the_environment_is_named_too() -> None:
    result = run_cli("version", env={"ROUTER_SIDECAR_LOG_FORMAT": "xml"})
    assert (result.returncode, result.stderr) == (
        2,
        "router-sidecar: error: argument --log-format: 'xml' is not a log format; expected text or json "
        "(--log-format, or $ROUTER_SIDECAR_LOG_FORMAT)\n",
    )


def test_the_testbed_commands_say_where_they_went() -> None:
    for command in ("sim", "demo", "drill"):
        result = run_cli(command, "--listen", "127.0.0.1:1")
        assert (result.returncode, result.stdout) == (2, "")
        assert result.stderr == (
            f"router-sidecar: error: `{command}` moved to the testbed: run `router-testbed {command}` "
            "(installed by `make setup`; elsewhere `pip install ./testbed`)\n"
        )


def test_global_flags_after_the_subcommand_and_the_old_policy_spelling(tmp_path: Path) -> None:
    policy = tmp_path / "policy.yaml"
    policy.write_text("liveness:\n  static_probe_failures: 7\n")
    render = [
        "envoy-config",
        "--listen",
        "127.0.0.1:8080",
        "--sidecar-socket",
        "unix:/run/s.sock",  # the spelling `serve --listen` uses is taken too
        "--admin-socket",
        "/run/a.sock",
        "--replica",
        "10.0.0.5:8000",
    ]
    new = run_cli(*render, "--policy", str(policy), "--log-level", "debug", "--log-format", "json")
    old = run_cli("--log-level", "DEBUG", *render, "--config", str(policy))
    assert (new.returncode, new.stderr) == (0, "")
    assert (old.returncode, old.stdout) == (0, new.stdout)
    assert old.stderr == (
        "router-sidecar: --config is deprecated, use --policy (the old spelling is accepted through the 0.1 "
        "releases)\n"
    )
    assert "path: /run/s.sock" in new.stdout and "unhealthy_threshold: 7" in new.stdout


def test_serve_runs_the_sidecar_alone_and_stops_on_sigterm(etcd: str, tmp_path: Path) -> None:
    """Old spelling (--bind) and etcd's URL form (http://): it works, says what replaces the flag, and waits
    for replicas (none registered) rather than claiming to be ready."""
    import signal

    from tests.harness import poll

    socket_path = tmp_path / "sidecar.sock"
    argv = ["serve", "--bind", f"unix:{socket_path}", "--etcd", f"http://{etcd}"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "router_sidecar", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None and proc.stderr is not None
        line = proc.stdout.readline()
        assert line.startswith(
            f"waiting for replicas: sidecar serving ext_proc, access log and EDS on unix:{socket_path}"
        )
        assert (
            "no replica to send requests to: none is registered in etcd (run `router-sidecar replica` beside "
            "each engine); the readiness probe answers 503 (no_replica_available) until there is one; "
            f"etcd {etcd}" in line
        ), line
        poll(socket_path.exists, timeout=5, what="the unix socket")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 0
        assert proc.stderr.readline() == (
            "router-sidecar: --bind is deprecated, use --listen (the old spelling is accepted through the "
            "0.1 releases)\n"
        )
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
