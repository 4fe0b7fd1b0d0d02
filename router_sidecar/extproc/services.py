"""What every ext_proc stream of one sidecar shares: built once by the server, handed to each stream."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field

from router_sidecar.coordination.fencing import AttemptLeases
from router_sidecar.coordination.journal import Journal
from router_sidecar.coordination.liveness import LivenessMonitor
from router_sidecar.coordination.progress import ProgressMonitor
from router_sidecar.coordination.readiness import Readiness
from router_sidecar.coordination.tool_ledger import ToolLedger
from router_sidecar.core.placement import Placement
from router_sidecar.core.policy import Policy, RoutePolicies
from router_sidecar.extproc.parsing import RequestParser
from router_sidecar.extproc.registry import Registry
from router_sidecar.telemetry.observer import Telemetry


@dataclass(slots=True)
class Services:
    policy: Policy
    route_policies: RoutePolicies  # a route's policy: `policy` with the overlay Envoy sends for the route
    readiness: Readiness  # whether etcd answers (the /readyz probe)
    registry: Registry  # live logical requests: where the two filter placements meet
    journal: Journal
    ledger: ToolLedger  # tool-call idempotency records
    leases: AttemptLeases
    liveness: LivenessMonitor  # replica heartbeats from the registry
    progress: ProgressMonitor  # replica-reported progress vs bytes received
    discovery: bool  # replicas come from the registry (EDS): pin each request to a compatibility group
    gateway_id: str
    parser: RequestParser  # large request bodies are parsed in a worker process
    placement: Placement  # warm prefixes, overloaded replicas, tenants' retries (core/placement.py)
    tenant_secret: bytes = b""  # keys the credential digests; loaded at start (coordination/tenancy.py)
    telemetry: Telemetry = field(default_factory=Telemetry)  # spans and metrics (no-op unless configured)
    # Each request's turn in the gateway's own round robin over the replicas (core/destinations.py).
    turns: Iterator[int] = field(default_factory=itertools.count)
