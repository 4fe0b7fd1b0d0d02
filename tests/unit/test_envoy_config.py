"""The rendered Envoy config carries the policy: derived timeouts, buffer limits, health checks, admin."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from router_sidecar.core.policy import DEFAULT_POLICY, Policy, policy_from_mapping
from router_sidecar.runtime.envoy_config import (
    Endpoint,
    EndpointPicker,
    EnvoyNotFound,
    GatewaySpec,
    find_envoy,
    render,
    validate,
)


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


# --- behind an endpoint picker ----------------------------------------------------------------------------


def behind_picker(
    picker: EndpointPicker,
    tools: tuple[tuple[str, Endpoint], ...] = (),
    access_log: Path = Path("/run/x/access.log"),
) -> dict[str, Any]:
    spec = GatewaySpec(
        listen=Endpoint("127.0.0.1", 8080),
        replicas=(Endpoint("127.0.0.1", 9001),),
        sidecar_socket=Path("/run/x/sidecar.sock"),
        access_log_path=access_log,
        admin_socket=Path("/run/x/admin.sock"),
        policy=DEFAULT_POLICY,
        tools=tools,
        endpoint_picker=picker,
    )
    return yaml.safe_load(render(spec))


def hcm_of(config: dict[str, Any]) -> dict[str, Any]:
    return config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]


PICKERS = (
    EndpointPicker(Endpoint("127.0.0.1", 9002)),
    EndpointPicker(Endpoint("epp.pool.svc", 9002), fail_open=True, tls=True, health_port=9003),
)


def test_the_pickers_answers_become_our_json_errors_before_any_other_mapper() -> None:
    plain = hcm_of(rendered())["local_reply_config"]["mappers"]
    mappers = hcm_of(behind_picker(PICKERS[0]))["local_reply_config"]["mappers"]
    ours, theirs = mappers[: -len(plain)], mappers[-len(plain) :]
    assert theirs == plain  # the gateway's own mappers unchanged, after the picker's
    # The gateway's own: Envoy's replies for upstream trouble (they carry response flags) and its 413, each in
    # Anthropic's shape on the Messages API, then in OpenAI's.
    for mapper in plain[0:2]:
        assert "response_flag_filter" in mapper["filter"]["and_filter"]["filters"][0]
    anthropic = plain[0]["body_format_override"]["json_format"]
    assert anthropic["type"] == "error" and anthropic["error"]["details"] == {"error_code": "upstream_error"}
    for mapper in plain[2:4]:
        status = mapper["filter"]["and_filter"]["filters"][0]["status_code_filter"]
        assert status["comparison"]["value"]["default_value"] == 413
    codes = []
    for mapper in ours:
        expression = mapper["filter"]["extension_filter"]["typed_config"]["expression"]
        # Never the sidecar's own answers, never Envoy's flagged ones: the picker's filter's local replies.
        assert expression.startswith("response.code_details != 'router_sidecar' && response.flags == 0u && ")
        body = mapper["body_format_override"]["json_format"]
        messages = "request.url_path.matches('^/v1/messages/?$')" in expression
        error = body["error"]
        assert error["request_id"] == "%REQ(X-REQUEST-ID)%" and error["partial_output"] is False
        assert error["attempts"] == [] and error["retryable"] is True
        names = [h["header"]["key"] for h in mapper["headers_to_add"]]
        if messages:
            assert body["type"] == "error" and error["details"] == {"error_code": error["code"]}
            assert names == ["x-request-id", "request-id", "x-router-attempts"]
        else:
            assert error["type"] == "gateway_error" and names == ["x-request-id", "x-router-attempts"]
        codes.append((error["code"], messages, error["type"]))
    assert codes == [
        ("endpoint_picker_unavailable", True, "overloaded_error"),
        ("endpoint_picker_unavailable", False, "gateway_error"),
        ("no_replica_available", True, "overloaded_error"),
        ("no_replica_available", False, "gateway_error"),
        ("replicas_overloaded", True, "rate_limit_error"),
        ("replicas_overloaded", False, "gateway_error"),
    ]


def test_behind_a_picker_its_failure_is_a_503_and_the_credential_reaches_the_sidecars_access_log() -> None:
    hcm = hcm_of(behind_picker(PICKERS[0]))
    picker, ours = hcm["http_filters"][:2]
    assert picker["name"] == "endpoint_picker" and ours["name"] == "envoy.filters.http.ext_proc"
    assert picker["typed_config"]["status_on_error"] == {"code": 503}
    assert "status_on_error" not in ours["typed_config"]  # ours fails with Envoy's 500: told apart
    grpc_log, file_log = hcm["access_log"]
    assert grpc_log["typed_config"]["additional_request_headers_to_log"] == ["authorization", "x-api-key"]
    assert "additional_request_headers_to_log" not in file_log["typed_config"]
    plain = hcm_of(rendered())
    assert "additional_request_headers_to_log" not in plain["access_log"][0]["typed_config"]


def test_probes_lookups_and_tool_calls_never_go_through_the_picker() -> None:
    tools = (("search", Endpoint("127.0.0.1", 7000)),)
    routes = hcm_of(behind_picker(PICKERS[0], tools))["route_config"]["virtual_hosts"][0]["routes"]
    disabled = {
        "endpoint_picker": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExtProcPerRoute",
            "disabled": True,
        }
    }
    by_match = {json.dumps(r["match"], sort_keys=True): r for r in routes}
    for match in (
        {"path": "/livez"},
        {"path": "/readyz"},
        {"prefix": "/v1/requests/"},
        {"prefix": "/tools/search/"},
    ):
        assert by_match[json.dumps(match, sort_keys=True)]["typed_per_filter_config"] == disabled
    catch_all = routes[-1]
    assert catch_all["match"] == {"prefix": "/"} and "typed_per_filter_config" not in catch_all
    assert [r["match"] for r in routes[:3]] == [
        {"path": "/livez"},
        {"path": "/readyz"},
        {"prefix": "/v1/requests/"},
    ]


@pytest.mark.parametrize("picker", PICKERS, ids=["fail_closed", "fail_open_tls"])
def test_the_config_behind_a_picker_validates(picker: EndpointPicker, tmp_path: Path) -> None:
    try:
        envoy = find_envoy()
    except EnvoyNotFound:
        pytest.skip("no Envoy binary (make setup)")
    path = tmp_path / "envoy.yaml"
    tools = (("search", Endpoint("127.0.0.1", 7000)),)
    path.write_text(yaml.safe_dump(behind_picker(picker, tools, tmp_path / "access.log")))
    validate(envoy, path)
