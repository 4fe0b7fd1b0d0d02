"""Replica discovery for Envoy (EDS, served by the sidecar from the etcd registry) and compatibility pins.

Each registered replica becomes an endpoint of cluster `llm` with its fingerprint digest as `envoy.lb`
metadata. The cluster's subset load balancer groups endpoints by that digest; the downstream filter pins
each logical request to one group at admission (`envoy.lb` dynamic metadata), so every attempt of it —
the first and any retry — lands on an interchangeable replica, never on one that runs another model
revision, tokenizer, chat template, KV-cache layout or adapter set.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter
from collections.abc import Mapping

import grpc
from google.protobuf import any_pb2

from router_sidecar.coordination.liveness import LivenessMonitor
from router_sidecar.coordination.registry_store import Replica
from router_sidecar.core.fingerprint import describe_difference
from router_sidecar.wire import core_pb2, discovery_pb2

log = logging.getLogger(__name__)

CLUSTER = "llm"
# Envoy checks each resource's type_url against its own type name; Any.Pack would write our proto package's.
CLA_TYPE = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment"
PIN_KEY = "fingerprint"
FIRST_SNAPSHOT_WAIT_SECONDS = 5.0


def load_assignment(replicas: Mapping[str, Replica]) -> discovery_pb2.ClusterLoadAssignment:
    endpoints = []
    for address, replica in sorted(replicas.items()):
        host, _, port = address.rpartition(":")
        metadata = core_pb2.Metadata()
        metadata.filter_metadata["envoy.lb"].update({PIN_KEY: replica.digest})
        endpoints.append(
            discovery_pb2.LbEndpoint(
                endpoint=discovery_pb2.Endpoint(
                    address=core_pb2.Address(
                        socket_address=core_pb2.SocketAddress(address=host.strip("[]"), port_value=int(port))
                    )
                ),
                metadata=metadata,
            )
        )
    return discovery_pb2.ClusterLoadAssignment(
        cluster_name=CLUSTER, endpoints=[discovery_pb2.LocalityLbEndpoints(lb_endpoints=endpoints)]
    )


def choose_pin(replicas: Mapping[str, Replica], model: str) -> Replica | None:
    """The compatibility group a new request is pinned to: the largest group serving `model`."""
    serving = [r for r in replicas.values() if r.fingerprint.model_id == model]
    if not serving:
        return None
    sizes = Counter(r.digest for r in serving)
    best = max(sizes, key=lambda digest: (sizes[digest], digest))
    return next(r for r in serving if r.digest == best)


def compatible_alternatives(replicas: Mapping[str, Replica], digest: str, exclude: str) -> int:
    return sum(1 for address, r in replicas.items() if r.digest == digest and address != exclude)


def why_no_compatible_replica(replicas: Mapping[str, Replica], pinned: Replica, exclude: str) -> str:
    others = [r for a, r in sorted(replicas.items()) if a != exclude and r.digest != pinned.digest]
    if not others:
        return f"no other healthy replica serves {pinned.fingerprint.model_id!r}"
    details = "; ".join(
        f"{r.address}: {describe_difference(pinned.fingerprint, r.fingerprint)}" for r in others[:3]
    )
    return f"the other healthy replicas are not compatible with the pinned fingerprint ({details})"


class EndpointDiscovery:
    """State-of-the-world EDS for cluster `llm`: a new ClusterLoadAssignment after every registry change."""

    def __init__(self, liveness: LivenessMonitor) -> None:
        self._liveness = liveness

    async def StreamEndpoints(self, request_iterator: object, context: grpc.aio.ServicerContext) -> None:
        first = await context.read()
        if first is grpc.aio.EOF:
            return
        reader = asyncio.get_running_loop().create_task(self._read_acks(context))
        try:
            # Envoy warms the cluster with the first answer: give the registry watch a moment to have one.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._liveness.first_snapshot.wait(), FIRST_SNAPSHOT_WAIT_SECONDS)
            version = 0
            while not reader.done():
                changed = self._liveness.changed
                version += 1
                resource = any_pb2.Any(
                    type_url=CLA_TYPE, value=load_assignment(self._liveness.routable).SerializeToString()
                )
                await context.write(
                    discovery_pb2.DiscoveryResponse(
                        version_info=str(version), resources=[resource], type_url=CLA_TYPE, nonce=str(version)
                    )
                )
                waiter = asyncio.ensure_future(changed.wait())
                await asyncio.wait({waiter, reader}, return_when=asyncio.FIRST_COMPLETED)
                waiter.cancel()
        finally:
            reader.cancel()

    @staticmethod
    async def _read_acks(context: grpc.aio.ServicerContext) -> None:
        while True:
            request = await context.read()
            if request is grpc.aio.EOF:
                return
            if request.HasField("error_detail"):
                log.error(
                    "envoy rejected endpoints version %s: %s",
                    request.version_info,
                    request.error_detail.message,
                )
