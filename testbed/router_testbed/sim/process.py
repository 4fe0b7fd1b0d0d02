"""Start simulator replicas as child processes (for tests and demos).

``spawn`` runs ``python -m router_testbed.sim --listen HOST:0 ...`` and waits (with a deadline) for
its ``sim NAME listening on HOST:PORT`` line, so no free-port guessing is needed. Always stop what
you start: use ``with spawn(...) as sim:`` or call :meth:`SimProcess.stop` in a ``finally``.
"""

from __future__ import annotations

import os
import re
import selectors
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from types import TracebackType

_READY = re.compile(r"^sim (?P<name>.+) listening on (?P<host>\[[^\]]+\]|[^:]+):(?P<port>\d+)$")


@dataclass
class SimProcess:
    proc: subprocess.Popen[bytes]
    name: str
    host: str
    port: int
    log_path: str | None

    @property
    def address(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    @property
    def url(self) -> str:
        return f"http://{self.address}"

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stop(self, timeout: float = 5.0) -> int:
        """SIGTERM, wait up to ``timeout``, then SIGKILL; returns the exit code."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        return self.proc.returncode

    def kill(self) -> None:
        """SIGKILL (an abrupt replica death) and reap."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(5.0)

    def __enter__(self) -> SimProcess:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


def _read_ready_line(proc: subprocess.Popen[bytes], deadline: float, what: str = "simulator") -> str:
    assert proc.stdout is not None
    fd = proc.stdout.fileno()
    buf = b""
    with selectors.DefaultSelector() as sel:
        sel.register(fd, selectors.EVENT_READ)
        while b"\n" not in buf:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"{what} did not report listening in time; output so far: {buf!r}")
            if sel.select(remaining):
                data = os.read(fd, 4096)
                if not data:
                    raise RuntimeError(f"{what} exited with {proc.wait()}; output: {buf!r}")
                buf += data
    return buf.split(b"\n", 1)[0].decode()


def spawn(
    *,
    name: str | None = None,
    host: str = "127.0.0.1",
    port: int = 0,
    log_path: str | os.PathLike[str] | None = None,
    dialect: str | None = None,
    args: Sequence[str] = (),
    timeout: float = 10.0,
    python: str = sys.executable,
    env: dict[str, str] | None = None,
) -> SimProcess:
    """Start one simulator; ``dialect`` is ``--dialect`` (vllm when ``None``); ``args`` are extra CLI options
    (``--prefill-delay``, ``--seed``, ...)."""
    cmd = [python, "-m", "router_testbed.sim", "--listen", f"{host}:{port}"]
    if name is not None:
        cmd += ["--name", name]
    if log_path is not None:
        cmd += ["--log", os.fspath(log_path)]
    if dialect is not None:
        cmd += ["--dialect", dialect]
    cmd += list(args)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, env=env)
    try:
        line = _read_ready_line(proc, time.monotonic() + timeout)
        m = _READY.match(line)
        if m is None:
            raise RuntimeError(f"unexpected simulator output: {line!r}")
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    bound_host = m["host"].strip("[]")
    return SimProcess(
        proc, m["name"], bound_host, int(m["port"]), os.fspath(log_path) if log_path is not None else None
    )
