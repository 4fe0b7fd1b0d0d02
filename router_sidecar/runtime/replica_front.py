"""Replica mode's runner: the fence servicer on a unix socket and the replica's own Envoy in front of the
engine that uses it (`envoy/replica.yaml`, docs/replica-fence.md)."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
from dataclasses import dataclass
from pathlib import Path
from string import Template

import grpc

from router_sidecar.coordination.replica_fence import DEFAULT_SAFETY_MARGIN
from router_sidecar.coordination.store import EtcdStore
from router_sidecar.extproc.replica_side import ReplicaFenceServicer
from router_sidecar.runtime.envoy_config import TEMPLATE_DIR, Endpoint, find_envoy, validate
from router_sidecar.runtime.supervise import Child, start_envoy, wait_envoy_ready
from router_sidecar.wire import services as wire_services

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class FrontSpec:
    front: Endpoint
    engine: Endpoint
    fence_socket: Path
    admin_socket: Path
    connect_timeout: float = 1.0


def render_front(spec: FrontSpec) -> str:
    values = {
        "admin_socket": json.dumps(str(spec.admin_socket)),
        "node_id": f"{socket.gethostname()}-replica-{spec.front.port}",
        "front_host": spec.front.host,
        "front_port": spec.front.port,
        "engine_discovery": "STATIC" if spec.engine.is_ip else "STRICT_DNS",
        "engine_host": json.dumps(spec.engine.host),
        "engine_port": spec.engine.port,
        "connect_timeout": f"{spec.connect_timeout:g}s",
        "fence_socket": json.dumps(str(spec.fence_socket)),
    }
    return Template((TEMPLATE_DIR / "replica.yaml").read_text()).substitute(values)


class FrontEnvoy:
    """The replica's own Envoy in front of the engine, started by the agent and stopped with it."""

    def __init__(self, spec: FrontSpec, work_dir: Path, *, log_level: str = "warn") -> None:
        self.spec = spec
        self.work_dir = work_dir
        self.log_level = log_level
        self.child: Child | None = None

    async def start(self, timeout: float = 30.0) -> None:
        envoy = find_envoy()
        config_path = self.work_dir / "front-envoy.yaml"
        config_path.write_text(render_front(self.spec))
        await asyncio.to_thread(validate, envoy, config_path)
        self.child = start_envoy(
            envoy,
            config_path,
            name="front-envoy",
            log_path=self.work_dir / "front-envoy.log",
            log_level=self.log_level,
        )
        await wait_envoy_ready(self.child, self.spec.admin_socket, timeout)

    def alive(self) -> bool:
        return self.child is not None and self.child.alive()

    async def stop(self) -> None:
        if self.child is not None:
            await asyncio.to_thread(self.child.stop)


class ReplicaFront:
    """Replica mode: the fence servicer (unix socket, this process) and the front Envoy that uses it."""

    def __init__(
        self,
        store: EtcdStore,
        *,
        front: str,
        engine: str,
        work_dir: Path,
        margin: float = DEFAULT_SAFETY_MARGIN,
    ) -> None:
        self.work_dir = work_dir
        self.socket_path = work_dir / "fence.sock"
        self.servicer = ReplicaFenceServicer(store, margin=margin)
        self._server = grpc.aio.server()
        wire_services.add_external_processor(self._server, self.servicer)
        self.envoy = FrontEnvoy(
            FrontSpec(
                front=Endpoint.parse(front),
                engine=Endpoint.parse(engine),
                fence_socket=self.socket_path,
                admin_socket=work_dir / "front-admin.sock",
            ),
            work_dir,
        )

    async def start(self) -> None:
        self.socket_path.unlink(missing_ok=True)
        self._server.add_insecure_port(f"unix:{self.socket_path}")
        await self._server.start()
        await self.envoy.start()
        log.info(
            "replica front on %s → engine %s (fence servicer on %s)",
            self.envoy.spec.front,
            self.envoy.spec.engine,
            self.socket_path,
        )

    def alive(self) -> bool:
        return self.envoy.alive()

    async def stop(self) -> None:
        await self.envoy.stop()
        await self.servicer.acks.drain(timeout=5.0)
        await self._server.stop(1.0)
