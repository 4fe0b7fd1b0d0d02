"""The rendered Envoy config carries the policy: derived timeouts, buffer limits, health checks, admin."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from router_sidecar.core.policy import DEFAULT_POLICY, Policy, policy_from_mapping
from router_sidecar.runtime.envoy_config import Endpoint, GatewaySpec, render


def rendered(
    policy: Policy = DEFAULT_POLICY, replicas: tuple[Endpoint, ...] = (Endpoint("127.0.0.1", 9001),)
) -> dict[str, Any]:
    spec = GatewaySpec(
        listen=Endpoint("127.0.0.1", 8080),
        replicas=replicas,
        sidecar_socket=Path("/run/x/sidecar.sock"),
        access_log_path=Path("/run/x/access.log"),
        admin_socket=Path("/run/x/admin.sock"),
        policy=policy,
    )
    return yaml.safe_load(render(spec))


def clusters(config: dict[str, Any]) -> dict[str, Any]:
    return {c["name"]: c for c in config["static_resources"]["clusters"]}


def downstream_filter(config: dict[str, Any]) -> dict[str, Any]:
    hcm = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    return hcm["http_filters"][0]["typed_config"]


def test_admin_listens_on_a_unix_socket_only() -> None:
    assert rendered()["admin"]["address"] == {"pipe": {"path": "/run/x/admin.sock"}}


def test_admission_timeout_covers_the_tool_wait() -> None:
    assert downstream_filter(rendered())["message_timeout"] == "5s"
    waiting = policy_from_mapping({"tools": {"in_progress_wait_seconds": 8}})
    assert downstream_filter(rendered(waiting))["message_timeout"] == "13s"


def test_buffers_keep_envoy_from_pausing_a_held_attempt() -> None:
    by_name = clusters(rendered())
    assert (
        by_name["llm"]["per_connection_buffer_limit_bytes"] == DEFAULT_POLICY.limits.max_held_response_bytes
    )
    assert by_name["sidecar"]["per_connection_buffer_limit_bytes"] >= 64 * 1024 * 1024


def test_retry_budget_follows_require() -> None:
    thresholds = clusters(rendered())["llm"]["circuit_breakers"]["thresholds"][0]
    assert thresholds["retry_budget"] == {"budget_percent": {"value": 50.0}, "min_retry_concurrency": 3}
    unbudgeted = policy_from_mapping(
        {"on_upstream_failure": {"before_first_delta": {"require": ["source_attempt_fenced"]}}}
    )
    thresholds = clusters(rendered(unbudgeted))["llm"]["circuit_breakers"]["thresholds"][0]
    assert "retry_budget" not in thresholds and thresholds["max_retries"] >= 100000


def test_static_replicas_are_health_checked_and_discovered_ones_are_not() -> None:
    llm = clusters(rendered())["llm"]
    (check,) = llm["health_checks"]
    assert check["http_health_check"] == {"path": "/health"}
    assert check["unhealthy_threshold"] == DEFAULT_POLICY.liveness.static_probe_failures
    assert "health_checks" not in clusters(rendered(replicas=()))["llm"]


def test_deadline_backstop_sits_behind_the_sidecars_timer() -> None:
    route = rendered()["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"][
        "route_config"
    ]["virtual_hosts"][0]["routes"][-1]["route"]
    assert route["timeout"] == f"{DEFAULT_POLICY.deadlines.request_seconds + 1:g}s"


def _options(config: dict[str, Any]) -> dict[str, Any]:
    options = clusters(config)["llm"]["typed_extension_protocol_options"]
    return options["envoy.extensions.upstreams.http.v3.HttpProtocolOptions"]


def test_upstream_connections_close_before_the_engines_keep_alive() -> None:
    # vLLM and SGLang (uvicorn) close a connection idle for 5 s; Envoy's default would keep it for an hour.
    assert _options(rendered())["common_http_protocol_options"] == {"idle_timeout": "4s"}
    shorter = policy_from_mapping({"upstream_connections": {"idle_timeout_seconds": 1.5}})
    assert _options(rendered(shorter))["common_http_protocol_options"] == {"idle_timeout": "1.5s"}


def test_envoy_retries_leave_room_for_attempts_that_die_at_their_connection() -> None:
    def retry_policy(policy: Policy) -> dict[str, Any]:
        hcm = rendered(policy)["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
        return hcm["typed_config"]["route_config"]["virtual_hosts"][0]["routes"][-1]["route"]["retry_policy"]

    # `reset` also retries a reset before the request was sent; Envoy counts it like any other retry.
    assert retry_policy(DEFAULT_POLICY)["retry_on"].split(",")[:2] == ["reset", "connect-failure"]
    for max_attempts, expected in ((2, 3), (3, 5)):
        policy = policy_from_mapping(
            {"on_upstream_failure": {"before_first_delta": {"max_attempts": max_attempts}}}
        )
        assert retry_policy(policy)["num_retries"] == expected
    one = policy_from_mapping({"on_upstream_failure": {"before_first_delta": {"action": "fail_request"}}})
    assert retry_policy(one)["num_retries"] == 1  # no retry of a request a replica saw; a stale connection's


def test_the_downstream_filter_learns_how_many_attempts_envoy_made() -> None:
    assert "upstream.request_attempt_count" in downstream_filter(rendered())["response_attributes"]
