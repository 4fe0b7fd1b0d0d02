"""Child processes (Envoy, etcd, simulated replicas): start in their own process group, stop for sure."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path


class ProcessFailed(Exception):
    pass


def _load_prctl() -> Callable[[], None] | None:
    try:
        import ctypes

        prctl = ctypes.CDLL("libc.so.6", use_errno=True).prctl
    except (OSError, AttributeError):
        return None

    def die_with_parent() -> None:
        # Linux: if the supervisor is killed outright (SIGKILL, OOM), the child gets SIGKILL too, so an
        # Envoy or a replica never outlives the process that was responsible for stopping it. Runs between
        # fork and exec: no imports or allocations of Python objects that could need a lock.
        prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG

    return die_with_parent


_die_with_parent = _load_prctl()


class Child:
    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        *,
        log_path: Path | None = None,
        env: dict[str, str] | None = None,
        cwd: Path | None = None,
    ) -> None:
        self.name = name
        self.argv = list(argv)
        self.log_path = log_path
        self._log = open(log_path, "ab") if log_path else subprocess.DEVNULL  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            self.argv,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            cwd=cwd,
            start_new_session=True,  # own process group: a stop kills helpers it forked too
            preexec_fn=_die_with_parent,
        )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def signal(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, sig)

    def stop(self, timeout: float = 5.0) -> int | None:
        if self.alive():
            self.signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.signal(signal.SIGKILL)
                self.proc.wait(timeout)
        else:
            self.signal(signal.SIGKILL)  # leftovers of the group, if any
        if self._log is not subprocess.DEVNULL:
            self._log.close()
        return self.proc.returncode

    def tail(self, lines: int = 20) -> str:
        if not self.log_path or not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])


def wait_until(
    predicate: Callable[[], bool],
    *,
    timeout: float,
    what: str,
    child: Child | None = None,
    interval: float = 0.02,
) -> None:
    """Poll `predicate` until it holds; fail with `what` (and the child's log tail) at the deadline."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        if child is not None and not child.alive():
            raise ProcessFailed(
                f"{child.name} exited with {child.proc.returncode} while waiting for {what}:\n{child.tail()}"
            )
        time.sleep(interval)
    tail = f"\n{child.tail()}" if child else ""
    raise ProcessFailed(f"timed out after {timeout}s waiting for {what}{tail}")


def port_open(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.settimeout(0.2)
        return s.connect_ex((host, port)) == 0


def http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=0.5) as response:
            return bool(200 <= response.status < 300)
    except OSError:
        return False


def envoy_admin(admin_socket: Path, path: str, timeout: float = 0.5) -> tuple[int, bytes] | None:
    """GET `path` from Envoy's admin interface, over the unix socket it listens on (never a TCP port)."""
    import http.client

    class _UnixConnection(http.client.HTTPConnection):
        def connect(self) -> None:
            self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self.sock.settimeout(timeout)
            self.sock.connect(str(admin_socket))

    if not admin_socket.exists():
        return None
    connection = _UnixConnection("localhost", timeout=timeout)
    try:
        connection.request("GET", path)
        response = connection.getresponse()
        return response.status, response.read()
    except OSError:
        return None
    finally:
        connection.close()


def envoy_ready(admin_socket: Path) -> bool:
    answer = envoy_admin(admin_socket, "/ready")
    return answer is not None and answer[0] == 200


def start_envoy(
    envoy: str, config_path: Path, *, name: str, log_path: Path, log_level: str = "warn"
) -> Child:
    """Envoy in its own process group, the way every runner here starts it."""
    argv = [envoy, "-c", str(config_path), "--disable-hot-restart", "--log-level", log_level]
    return Child(name, argv, log_path=log_path)


async def wait_envoy_ready(child: Child, admin_socket: Path, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not child.alive():
            raise ProcessFailed(
                f"{child.name} exited with {child.proc.returncode} during start-up:\n{child.tail()}"
            )
        if await asyncio.to_thread(envoy_ready, admin_socket):
            return
        await asyncio.sleep(0.05)
    raise ProcessFailed(f"{child.name} was not ready within {timeout}s:\n{child.tail()}")


def free_port(host: str = "127.0.0.1") -> int:
    return free_ports(1, host)[0]


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """`count` distinct free ports: all bound at once (one at a time, the kernel may hand out one twice)."""
    with contextlib.ExitStack() as stack:
        sockets = [stack.enter_context(socket.socket()) for _ in range(count)]
        for s in sockets:
            s.bind((host, 0))
        return [int(s.getsockname()[1]) for s in sockets]


def find_etcd() -> str:
    import shutil

    for candidate in (os.environ.get("ROUTER_SIDECAR_ETCD"), shutil.which("etcd"), "/usr/bin/etcd"):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    raise ProcessFailed(
        "etcd not found: run `make setup` (installs Debian's etcd-server) or put etcd on PATH"
    )


def start_etcd(
    data_dir: Path,
    *,
    host: str = "127.0.0.1",
    client_port: int | None = None,
    log_path: Path | None = None,
    also_listen_on: tuple[str, ...] = (),
    name: str = "router-sidecar-local",
    peer_port: int | None = None,
    initial_cluster: str | None = None,
    wait: bool = True,
    extra_args: tuple[str, ...] = (),
) -> tuple[Child, str]:
    """A throw-away etcd member on loopback (tests, demo); alone unless `initial_cluster` names its peers
    (NAME=http://HOST:PEER_PORT,...). Returns the child and its client HOST:PORT.

    `also_listen_on`: further local addresses for clients (e.g. a test's own network namespace link).
    `wait=False`: return at once (the members of a new cluster only get healthy together)."""
    if client_port is None or peer_port is None:
        spare = free_ports(2, host)  # distinct (bound at once)
        client_port, peer_port = client_port or spare[0], peer_port or spare[1]
    argv = [
        find_etcd(),
        "--name",
        name,
        "--data-dir",
        str(data_dir),
        "--listen-client-urls",
        ",".join(f"http://{h}:{client_port}" for h in (host, *also_listen_on)),
        "--advertise-client-urls",
        f"http://{host}:{client_port}",
        "--listen-peer-urls",
        f"http://{host}:{peer_port}",
        "--initial-advertise-peer-urls",
        f"http://{host}:{peer_port}",
        "--initial-cluster",
        initial_cluster or f"{name}=http://{host}:{peer_port}",
        "--log-level",
        "warn",
        *extra_args,
    ]
    child = Child(f"etcd-{name}", argv, log_path=log_path)
    endpoint = f"{host}:{client_port}"
    if wait:
        wait_etcd_healthy(child, endpoint)
    return child, endpoint


def wait_etcd_healthy(child: Child, endpoint: str, timeout: float = 20.0) -> None:
    try:
        wait_until(
            lambda: http_ok(f"http://{endpoint}/health"),
            timeout=timeout,
            what=f"etcd on {endpoint}",
            child=child,
        )
    except BaseException:
        child.stop()  # never leave a half-started etcd behind
        raise


@contextlib.contextmanager
def stop_on_signals() -> Iterator[asyncio.Event]:
    """SIGINT/SIGTERM set the returned event. Installed first thing, so a signal during start-up is not
    lost (nor fatal): the process finishes starting and then stops cleanly."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        yield stop
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(Exception):
                loop.remove_signal_handler(sig)


def listen_socket(host: str, port: int) -> tuple[socket.socket, str]:
    """A bound listening TCP socket (port 0: any free one) and its address as HOST:PORT."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.create_server((host, port), family=family, reuse_port=False)
    bound = sock.getsockname()
    return sock, f"[{bound[0]}]:{bound[1]}" if family == socket.AF_INET6 else f"{bound[0]}:{bound[1]}"
