"""The etcd key layout, byte for byte: gateways and replica agents of the previous release share one etcd
with new ones, so every key `keys` builds must stay what it was. This file is the one place where the
layout is written out literally; everything else builds keys through `keys`."""

from __future__ import annotations

from router_sidecar.coordination.store import keys
from router_sidecar.coordination.tenancy import SECRET_KEY


def test_every_key_is_the_previous_releases() -> None:
    assert keys.request("t1", "req-1") == "/router-sidecar/requests/t1/req-1"
    assert keys.tool_call("t1", "idem-1") == "/router-sidecar/tools/t1/idem-1"
    assert keys.cancel_ack("att-1") == "/router-sidecar/attempts/att-1/cancel_ack"
    assert keys.progress("att-1") == "/router-sidecar/attempts/att-1/progress"
    assert keys.owner("gw:8080~a1b2c3d4") == "/router-sidecar/owners/gw:8080~a1b2c3d4"
    assert keys.in_flight("gw~1", "t1", "req-1") == "/router-sidecar/inflight/gw~1/t1/req-1"
    assert keys.replica("127.0.0.1:8000") == "/router-sidecar/replicas/127.0.0.1:8000"
    assert keys.stored_response("t1", "resp_1") == "/router-sidecar/responses/t1/resp_1"
    assert keys.TENANT_SECRET == SECRET_KEY == "/router-sidecar/config/tenant_secret"


def test_every_prefix_is_the_previous_releases() -> None:
    assert keys.ROOT == "/router-sidecar/"
    assert keys.REQUESTS_PREFIX == "/router-sidecar/requests/"
    assert keys.TOOLS_PREFIX == "/router-sidecar/tools/"
    assert keys.ATTEMPTS_PREFIX == "/router-sidecar/attempts/"
    assert keys.OWNERS_PREFIX == "/router-sidecar/owners/"
    assert keys.IN_FLIGHT_PREFIX == "/router-sidecar/inflight/"
    assert keys.REPLICAS_PREFIX == "/router-sidecar/replicas/"
    assert keys.RESPONSES_PREFIX == "/router-sidecar/responses/"
    assert keys.in_flight_of("gw~1") == "/router-sidecar/inflight/gw~1/"


def test_keys_taken_apart_give_what_built_them() -> None:
    assert keys.attempt_of_progress(keys.progress("att-1")) == "att-1"
    assert keys.attempt_of_progress(keys.cancel_ack("att-1")) is None
    assert keys.attempt_of_progress(keys.request("t", "r")) is None
    assert keys.owner_of(keys.owner("gw~1")) == "gw~1"
    assert keys.in_flight_parts(keys.in_flight("gw~1", "t1", "req/with/slashes")) == (
        "gw~1",
        "t1",
        "req/with/slashes",
    )
    assert keys.replica_address(keys.replica("[::1]:8000")) == "[::1]:8000"
    assert keys.in_flight("gw~1", "t1", "r").startswith(keys.in_flight_of("gw~1"))
