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
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from router_sidecar.coordination.store import EtcdStore, StoreUnavailable
from router_sidecar.core.policy import Policy, RouteOverlay
from router_sidecar.extproc.server import SidecarServer
from router_sidecar.runtime.envoy_config import (
    Endpoint,
    EndpointPicker,
    GatewaySpec,
    find_envoy,
    render,
    validate,
)
from router_sidecar.runtime.supervise import (
    Child,
    ProcessFailed,
    start_envoy,
    stop_on_signals,
    wait_envoy_ready,
)
from router_sidecar.telemetry.setup import (
    MetricsListen,
    TelemetryConfigError,
    TelemetryRuntime,
    build_telemetry,
)

log = logging.getLogger(__name__)

# A crashed Envoy is restarted (the streams it carried are lost either way); one that keeps crashing is not.
ENVOY_RESTARTS = 5
ENVOY_RESTART_WINDOW_SECONDS = 300.0
# How often the start-up line's successor is decided: `ready:` / `waiting for replicas:` on a change.
READINESS_POLL_SECONDS = 0.5


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
    routes: tuple[RouteOverlay, ...] = ()
    envoy_log_level: str = "warn"
    metrics: MetricsListen | None = None  # serve Prometheus metrics here
    endpoint_picker: EndpointPicker | None = None  # an endpoint picker's filter before ours


async def connect_store(endpoint: str) -> EtcdStore:
    store = EtcdStore(endpoint)
    try:
        await store.check()
        await store.learn_membership()
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
    gateway_id = f"{socket.gethostname()}:{options.listen}"
    telemetry = _telemetry(options.metrics, gateway_id)
    try:
        store = await connect_store(options.etcd)
    except GatewayError:
        telemetry.shutdown()
        raise
    work_dir = options.work_dir or Path(tempfile.mkdtemp(prefix="router-sidecar-"))
    work_dir.mkdir(parents=True, exist_ok=True)
    owns_work_dir = options.work_dir is None
    socket_path = work_dir / "sidecar.sock"
    server = SidecarServer(
        bind=f"unix:{socket_path}",
        policy=options.policy,
        store=store,
        gateway_id=gateway_id,
        discovery=not options.replicas,
        static_replicas=tuple(map(str, options.replicas)),
        telemetry=telemetry.telemetry,
    )
    telemetry.telemetry.read_engines(server.liveness)  # gen_ai.provider.name: a registered replica's engine
    envoy_child: Child | None = None
    announcer: asyncio.Future[None] | None = None
    keep_logs = False
    try:
        await server.start()
        spec = GatewaySpec(
            listen=options.listen,
            replicas=options.replicas,
            sidecar_socket=socket_path,
            access_log_path=work_dir / "access.log",
            admin_socket=work_dir / "admin.sock",
            tools=options.tools,
            policy=options.policy,
            routes=options.routes,
            endpoint_picker=options.endpoint_picker,
        )
        config_path = work_dir / "envoy.yaml"
        config_path.write_text(render(spec))
        await asyncio.to_thread(validate, envoy, config_path)
        # The background parts (the registry watch among them) start once Envoy's process has exec'd, not once
        # it is ready: its readiness waits for our first EDS answer, which waits for the watch's first
        # snapshot (up to FIRST_SNAPSHOT_WAIT_SECONDS).
        envoy_child = await _start_envoy(
            envoy,
            config_path,
            spec.admin_socket,
            work_dir,
            options.envoy_log_level,
            started=server.start_background,
        )
        where = f"gateway on http://{options.listen}"
        tail = f"etcd {options.etcd}; logs in {work_dir}{_telemetry_note(telemetry)}"
        announcer = asyncio.ensure_future(_announce_readiness(server, where, tail))
        crashes: list[float] = []
        while True:
            await _wait_for_stop(envoy_child, stop)
            if envoy_child.alive():
                return 0
            # Envoy died under us, and every stream in flight with it. Keep the evidence, say where, tell the
            # sidecar (its journal must not call those streams client disconnects), and restart it.
            keep_logs = True
            crashes = [t for t in crashes if time.monotonic() - t < ENVOY_RESTART_WINDOW_SECONDS]
            crashes.append(time.monotonic())
            kept = work_dir / f"envoy.crash-{len(crashes)}-{int(time.time())}.log"
            envoy_child.stop()
            (work_dir / "envoy.log").rename(kept)
            server.registry.note_envoy_exit()
            print(
                f"envoy exited unexpectedly with {envoy_child.proc.returncode}; its log is kept in {kept} "
                f"(config: {config_path}, access log: {spec.access_log_path})",
                file=sys.stderr,
                flush=True,
            )
            if len(crashes) > ENVOY_RESTARTS:
                print(
                    f"envoy crashed {len(crashes)} times within {ENVOY_RESTART_WINDOW_SECONDS:g} s: "
                    "giving up (exit 1). Run the gateway under a supervisor that restarts it (systemd "
                    "Restart=on-failure, a Kubernetes container restart policy).",
                    file=sys.stderr,
                )
                return 1
            envoy_child = await _start_envoy(
                envoy, config_path, spec.admin_socket, work_dir, options.envoy_log_level
            )
            print(f"restarted envoy (pid {envoy_child.pid})", file=sys.stderr, flush=True)
    finally:
        if announcer is not None:
            announcer.cancel()
        if envoy_child is not None:
            code = await asyncio.to_thread(envoy_child.stop)
            if code not in (0, -signal.SIGTERM, None):
                keep_logs = True
                print(
                    f"envoy exited with {code}; last lines of {envoy_child.log_path}:\n{envoy_child.tail()}",
                    file=sys.stderr,
                )
        await server.stop()
        await store.close()
        telemetry.shutdown()
        if owns_work_dir and not keep_logs:
            shutil.rmtree(work_dir, ignore_errors=True)


async def _start_envoy(
    envoy: str,
    config: Path,
    admin_socket: Path,
    work_dir: Path,
    log_level: str,
    *,
    started: Callable[[], None] | None = None,
) -> Child:
    """Start Envoy and wait until it is ready; `started` runs once its process has exec'd (no fork is under
    way then: what `SidecarServer.start_background` needs)."""
    child = start_envoy(envoy, config, name="envoy", log_path=work_dir / "envoy.log", log_level=log_level)
    (work_dir / "envoy.pid").write_text(f"{child.pid}\n")
    if started is not None:
        started()
    try:
        await wait_envoy_ready(child, admin_socket)
    except ProcessFailed as exc:
        child.stop()
        raise GatewayError(str(exc)) from exc
    return child


async def _wait_for_stop(child: Child, stop: asyncio.Event) -> None:
    envoy_exit = asyncio.ensure_future(asyncio.to_thread(child.proc.wait))
    stopped = asyncio.ensure_future(stop.wait())
    await asyncio.wait({envoy_exit, stopped}, return_when=asyncio.FIRST_COMPLETED)
    stopped.cancel()


async def run_sidecar_only(
    bind: str,
    etcd: str,
    policy: Policy,
    replicas: tuple[Endpoint, ...] = (),
    metrics: MetricsListen | None = None,
) -> int:
    """`router-sidecar serve`: the sidecar alone, for an Envoy configured elsewhere (`envoy-config`)."""
    gateway_id = f"{socket.gethostname()}:{bind}"
    telemetry = _telemetry(metrics, gateway_id)
    try:
        store = await connect_store(etcd)
    except GatewayError:
        telemetry.shutdown()
        raise
    server = SidecarServer(
        bind=bind,
        policy=policy,
        store=store,
        gateway_id=gateway_id,
        discovery=not replicas,
        static_replicas=tuple(map(str, replicas)),
        telemetry=telemetry.telemetry,
    )
    telemetry.telemetry.read_engines(server.liveness)  # gen_ai.provider.name: a registered replica's engine
    try:
        with stop_on_signals() as stop:
            await server.start()
            server.start_background()
            source = ", ".join(map(str, replicas)) if replicas else "the etcd registry (EDS)"
            where = f"sidecar serving ext_proc, access log and EDS on {bind}; replicas from {source}"
            announcer = asyncio.ensure_future(
                _announce_readiness(server, where, f"etcd {etcd}{_telemetry_note(telemetry)}")
            )
            try:
                await stop.wait()
            finally:
                announcer.cancel()
        return 0
    finally:
        await server.stop()
        await store.close()
        telemetry.shutdown()


async def _announce_readiness(server: SidecarServer, where: str, tail: str) -> None:
    """On stdout, once: `ready: ...` when there is a replica to send requests to, after `waiting for
    replicas: ...` if at start there was none (the readiness probe answers 503 meanwhile). Supervisors and
    tests wait for the `ready:` line; the waiting line never contains that word. Later changes go to the log:
    a supervisor's stdout pipe that nobody reads any more must never fill up and block the gateway."""
    replicas = server.services.readiness.replicas
    was_ready: bool | None = None
    said_ready = False
    while True:
        problem = replicas.problem() if replicas is not None else None
        ready = problem is None
        if ready != was_ready:
            routable = ", ".join(replicas.routable()) if replicas is not None else "no replica"
            if ready and not said_ready:
                print(f"ready: {where}; sending to {routable}; {tail}", flush=True)
                said_ready = True
            elif problem is not None and was_ready is None:
                print(
                    f"waiting for replicas: {where}; {problem.message}; the readiness probe answers 503 "
                    f"({problem.code}) until there is one; {tail}",
                    flush=True,
                )
            elif problem is not None:
                log.warning(
                    "not ready: %s; the readiness probe answers 503 (%s)", problem.message, problem.code
                )
            else:
                log.warning("ready again: sending to %s", routable)
            was_ready = ready
        await asyncio.sleep(READINESS_POLL_SECONDS)


def _telemetry(metrics: MetricsListen | None, instance_id: str) -> TelemetryRuntime:
    try:
        return build_telemetry(metrics=metrics, instance_id=instance_id)
    except TelemetryConfigError as exc:
        raise GatewayError(str(exc)) from exc


def _telemetry_note(runtime: TelemetryRuntime) -> str:
    note = f"; metrics on {runtime.metrics_url}" if runtime.metrics_url else ""
    if runtime.otlp_endpoint:
        note += f"; OTLP to {runtime.otlp_endpoint}"
    return note
