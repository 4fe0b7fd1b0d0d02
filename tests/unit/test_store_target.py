"""`--etcd` parsing: one member, or several members' addresses as one gRPC target."""

from __future__ import annotations

import pytest

from router_sidecar.coordination.store import grpc_target


@pytest.mark.parametrize(
    ("endpoint", "target"),
    [
        ("127.0.0.1:2379", "127.0.0.1:2379"),
        ("etcd-client.router:2379", "etcd-client.router:2379"),
        ("127.0.0.1:1, 127.0.0.2:2,127.0.0.3:3", "ipv4:127.0.0.1:1,127.0.0.2:2,127.0.0.3:3"),
        ("[::1]:1,[::1]:2", "ipv6:[::1]:1,[::1]:2"),
        ("127.0.0.1:2379,", "127.0.0.1:2379"),
    ],
)
def test_targets(endpoint: str, target: str) -> None:
    assert grpc_target(endpoint) == target


@pytest.mark.parametrize(
    ("endpoint", "says"),
    [
        ("", "empty"),
        ("127.0.0.1", "HOST:PORT"),
        ("127.0.0.1:0", "HOST:PORT"),
        ("127.0.0.1:2379,127.0.0.1:x", "'127.0.0.1:x'"),
        ("etcd-0:2379,etcd-1:2379", "one name that resolves to every member"),
        ("127.0.0.1:1,[::1]:2", "all be IPv4 or all IPv6"),
    ],
)
def test_bad_endpoints_say_what_to_give(endpoint: str, says: str) -> None:
    with pytest.raises(ValueError, match="etcd endpoint") as caught:
        grpc_target(endpoint)
    assert says in str(caught.value)
