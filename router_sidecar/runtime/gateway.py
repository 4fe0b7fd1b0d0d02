"""`router-sidecar gateway`: Envoy + the sidecar in front of replicas, supervised as one unit."""

from __future__ import annotations

import asyncio
import logging
import shutil
import signal
import socket
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from router_sidecar.coordination.store import EtcdStore, StoreUnavailable
from router_sidecar.core.policy import Policy
from router_sidecar.extproc.server import SidecarServer
from router_sidecar.runtime.envoy_config import Endpoint, GatewaySpec, find_envoy, render, validate
from router_sidecar.runtime.supervise import Child, http_ok, stop_on_signals

log = logging.getLogger(__name__)


class GatewayError(Exception):
    """A start-up problem with a message that says what to do."""


@dataclass(frozen=True, slots=True)
class GatewayOptions:
    listen: Endpoint
    replicas: tuple[Endpoint, ...]
    etcd: str
    policy: Policy
    work_dir: Path | None = None
    tools: tuple[tuple[str, Endpoint], ...] = ()
    envoy_log_level: str = "warn"


async def connect_store(endpoint: str) -> EtcdStore:
    store = EtcdStore(endpoint)
    try:
        await store.check()
    except StoreUnavailable as exc:
        await store.close()
        raise GatewayError(
            f"etcd at {endpoint} is unreachable ({exc}). Start etcd there, or point --etcd at a running one."
        ) from exc
    return store


async def run_gateway(options: GatewayOptions) -> int:
    with stop_on_signals() as stop:
        return await _run_gateway(options, stop)


async def _run_gateway(options: GatewayOptions, stop: asyncio.Event) -> int:
    envoy = find_envoy()
    store = await connect_store(options.etcd)
    work_dir = options.work_dir or Path(tempfile.mkdtemp(prefix="router-sidecar-"))
    work_dir.mkdir(parents=True, exist_ok=True)
    owns_work_dir = options.work_dir is None
    socket_path = work_dir / "sidecar.sock"
    server = SidecarServer(
        bind=f"unix:{socket_path}",
        policy=options.policy,
        store=store,
        gateway_id=f"{socket.gethostname()}:{options.listen}",
        discovery=not options.replicas,
    )
    envoy_child: Child | None = None
    try:
        await server.start()
        spec = GatewaySpec(
            listen=options.listen,
            replicas=options.replicas,
            sidecar_socket=socket_path,
            access_log_path=work_dir / "access.log",
            tools=options.tools,
            policy=options.policy,
        )
        config_path = work_dir / "envoy.yaml"
        config_path.write_text(render(spec))
        await asyncio.to_thread(validate, envoy, config_path)
        admin_path = work_dir / "admin-address"
        envoy_child = Child(
            "envoy",
            [
                envoy,
                "-c",
                str(config_path),
                "--disable-hot-restart",
                "--log-level",
                options.envoy_log_level,
                "--admin-address-path",
                str(admin_path),
            ],
            log_path=work_dir / "envoy.log",
        )
        await _wait_envoy_ready(envoy_child, admin_path)
        server.start_background()
        print(
            f"ready: gateway on http://{options.listen} → replicas {', '.join(map(str, options.replicas))}; "
            f"etcd {options.etcd}; logs in {work_dir}",
            flush=True,
        )
        await _wait_for_stop(envoy_child, stop)
        return 0 if envoy_child.alive() else 1
    finally:
        if envoy_child is not None:
            code = await asyncio.to_thread(envoy_child.stop)
            if code not in (0, -signal.SIGTERM, None):
                print(
                    f"envoy exited with {code}; last lines of {envoy_child.log_path}:\n{envoy_child.tail()}",
                    file=sys.stderr,
                )
        await server.stop()
        await store.close()
        if owns_work_dir:
            shutil.rmtree(work_dir, ignore_errors=True)


async def _wait_envoy_ready(child: Child, admin_path: Path, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not child.alive():
            raise GatewayError(f"envoy exited with {child.proc.returncode} during start-up:\n{child.tail()}")
        address = admin_path.read_text().strip() if admin_path.exists() else ""
        if address and await asyncio.to_thread(http_ok, f"http://{address}/ready"):
            return
        await asyncio.sleep(0.05)
    raise GatewayError(f"envoy was not ready within {timeout}s:\n{child.tail()}")


async def _wait_for_stop(child: Child, stop: asyncio.Event) -> None:
    envoy_exit = asyncio.ensure_future(asyncio.to_thread(child.proc.wait))
    stopped = asyncio.ensure_future(stop.wait())
    await asyncio.wait({envoy_exit, stopped}, return_when=asyncio.FIRST_COMPLETED)
    if envoy_exit.done():
        print(f"envoy exited unexpectedly with {child.proc.returncode}:\n{child.tail()}", file=sys.stderr)
    stopped.cancel()


async def run_sidecar_only(bind: str, etcd: str, policy: Policy) -> int:
    """`router-sidecar serve`: the sidecar alone, for an Envoy configured elsewhere."""
    store = await connect_store(etcd)
    server = SidecarServer(bind=bind, policy=policy, store=store, gateway_id=f"{socket.gethostname()}:{bind}")
    try:
        with stop_on_signals() as stop:
            await server.start()
            server.start_background()
            print(f"ready: sidecar serving ext_proc and access log on {bind}; etcd {etcd}", flush=True)
            await stop.wait()
        return 0
    finally:
        await server.stop()
        await store.close()
