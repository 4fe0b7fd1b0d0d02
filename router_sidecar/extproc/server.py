"""The sidecar process: one grpc.aio server serving both ext_proc placements and Envoy's access log."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time

import grpc

from router_sidecar.coordination.fencing import AttemptLeases
from router_sidecar.coordination.journal import Journal
from router_sidecar.coordination.liveness import LivenessMonitor
from router_sidecar.coordination.owners import Ownership, new_instance_id
from router_sidecar.coordination.progress import ProgressMonitor
from router_sidecar.coordination.readiness import Readiness, ReplicaSet
from router_sidecar.coordination.registry_store import ReplicaRegistry
from router_sidecar.coordination.store import Store
from router_sidecar.coordination.tenancy import load_tenant_secret
from router_sidecar.coordination.tool_ledger import ToolLedger
from router_sidecar.core.placement import Placement
from router_sidecar.core.policy import Policy, RoutePolicies
from router_sidecar.extproc.access_log import AccessLogServicer
from router_sidecar.extproc.discovery import EndpointDiscovery
from router_sidecar.extproc.downstream import DownstreamStream
from router_sidecar.extproc.parsing import RequestParser
from router_sidecar.extproc.registry import Registry
from router_sidecar.extproc.rewriter import rewrite_model
from router_sidecar.extproc.services import Services
from router_sidecar.extproc.upstream import UpstreamStream
from router_sidecar.telemetry.observer import Telemetry
from router_sidecar.wire import services as wire_services

log = logging.getLogger(__name__)

PLACEMENT_METADATA = "x-router-sidecar-placement"
STOP_PART_SECONDS = 3.0


class ExternalProcessor:
    """Dispatches each ext_proc stream to the servicer of its filter placement (from initial metadata)."""

    def __init__(self, services: Services) -> None:
        self._services = services

    async def Process(self, request_iterator: object, context: grpc.aio.ServicerContext) -> None:
        placement = dict(context.invocation_metadata() or ()).get(PLACEMENT_METADATA)
        if placement == "downstream":
            await DownstreamStream(self._services).run(context)
        elif placement == "upstream":
            await UpstreamStream(self._services).run(context)
        elif placement == "rewriter":
            await rewrite_model(context)
        else:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"missing or unknown {PLACEMENT_METADATA} metadata: {placement!r}",
            )


def check_bind_address(address: str) -> None:
    """ext_proc carries every request and response: it listens on a unix socket or loopback only."""
    if address.startswith("unix:"):
        return
    host = address.rpartition(":")[0].strip("[]")
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError as exc:
        raise ValueError(f"cannot resolve sidecar bind address {address!r}: {exc}") from exc
    import ipaddress

    if not all(ipaddress.ip_address(info[4][0]).is_loopback for info in infos):
        raise ValueError(f"the sidecar listens on a unix socket or loopback only, not {address!r}")


class SidecarServer:
    def __init__(
        self,
        *,
        bind: str,
        policy: Policy,
        store: Store,
        gateway_id: str,
        discovery: bool = False,
        static_replicas: tuple[str, ...] = (),
        telemetry: Telemetry | None = None,
    ) -> None:
        telemetry = telemetry or Telemetry()
        check_bind_address(bind)
        self.bind = bind
        self.registry = Registry()
        self.store = store
        # Several gateways share one etcd: each run owns the records it serves, under its owner lease.
        self.ownership = (
            Ownership(
                store,
                instance=new_instance_id(gateway_id),
                ttl_seconds=policy.leases.owner_ttl_seconds,
                retention_seconds=policy.journal.retention_seconds,
            )
            if store.shared
            else None
        )
        self.journal = Journal(
            store,
            retention_seconds=policy.journal.retention_seconds,
            gateway_id=gateway_id,
            max_events=policy.journal.max_events,
            instance=self.ownership.instance if self.ownership else None,
            progress_interval=policy.journal.progress_interval_seconds,
            trace_clean_completions=policy.journal.trace_clean_completions,
            telemetry=telemetry,
        )
        self.leases = AttemptLeases(
            store, policy.leases.attempt_ttl_seconds, pool_size=policy.leases.attempt_pool_size
        )
        # Liveness comes from the replica registry's heartbeats, written by the agents into a shared store.
        self.liveness = LivenessMonitor(
            ReplicaRegistry(store) if store.shared else None,
            static=static_replicas,
            probe_interval=policy.liveness.static_probe_interval_seconds,
            probe_timeout=policy.liveness.static_probe_timeout_seconds,
            probe_failures=policy.liveness.static_probe_failures,
        )
        self.progress = ProgressMonitor(store, policy.liveness.progress_gap_seconds)
        self._server = grpc.aio.server(options=[("grpc.max_receive_message_length", 64 * 1024 * 1024)])
        self.services = services = Services(
            policy=policy,
            route_policies=RoutePolicies(policy),
            # Not ready without a replica to send to: static ones while healthy, discovered while registered.
            readiness=Readiness(
                store,
                ReplicaSet(self.liveness, static_replicas) if discovery or static_replicas else None,
            ),
            registry=self.registry,
            journal=self.journal,
            ledger=ToolLedger(store, policy.tools),
            leases=self.leases,
            liveness=self.liveness,
            progress=self.progress,
            discovery=discovery,
            gateway_id=gateway_id,
            parser=RequestParser(),
            placement=Placement(policy, clock=time.monotonic, wall_clock=time.time),
            telemetry=telemetry,
        )
        wire_services.add_external_processor(self._server, ExternalProcessor(services))
        wire_services.add_access_log_service(self._server, AccessLogServicer(self.registry, services))
        wire_services.add_endpoint_discovery(self._server, EndpointDiscovery(self.liveness))

    async def start(self) -> None:
        self.services.tenant_secret = await load_tenant_secret(
            self.store, self.services.policy.tenancy.secret_file
        )
        if self.bind.startswith("unix:"):
            path = self.bind[len("unix:") :]
            if os.path.exists(path):
                os.unlink(path)
        if self._server.add_insecure_port(self.bind) == 0 and not self.bind.startswith("unix:"):
            raise OSError(f"cannot listen on {self.bind}")
        if self.ownership is not None:
            await self.ownership.start()
        await self._server.start()
        log.info("sidecar serving ext_proc on %s", self.bind)

    def start_background(self) -> None:
        """Lease keep-alive and the registry watch. Start them after forking any child process (Envoy):
        a fork while gRPC client streams are busy can crash the child before it execs."""
        self.leases.start()
        self.services.parser.start()
        self.liveness.start()
        self.progress.start()
        if self.ownership is not None:
            self.ownership.start_background()

    async def stop(self, grace: float = 1.0) -> None:
        await self._server.stop(grace)
        self.services.parser.stop()
        parts = [self.liveness.stop(), self.progress.stop(), self.leases.stop()]
        if self.ownership is not None:
            parts.append(self.ownership.stop())
        for part in parts:
            # A watch stream that etcd (or the client library) never lets go of must not keep the process
            # from exiting: each part gets a bounded time.
            try:
                await asyncio.wait_for(part, STOP_PART_SECONDS)
            except TimeoutError:
                log.warning("a background part did not stop within %ss; exiting anyway", STOP_PART_SECONDS)
