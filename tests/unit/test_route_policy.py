"""Per-route policy: overlays over the gateway's policy, the policy file's `routes:`, their Envoy routes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from router_sidecar.core.policy import (
    DEFAULT_POLICY,
    ROUTE_POLICY_METADATA,
    PolicyError,
    RoutePolicies,
    load_policy,
    load_route_policies,
    policy_from_mapping,
    route_policy,
)
from router_sidecar.runtime.envoy_config import Endpoint, GatewaySpec, render

STRICT = {"on_upstream_failure": {"before_first_delta": {"action": "fail_request"}}}


def test_an_overlay_changes_what_it_names_and_what_follows_from_it() -> None:
    strict = route_policy(DEFAULT_POLICY, STRICT)
    assert not strict.retries_enabled
    # Derived keys follow the overlay's action instead of contradicting it.
    assert strict.before_first_delta.max_attempts == 1
    assert strict.uncertain_source_liveness.then == "fail_request"
    assert strict.limits == DEFAULT_POLICY.limits and strict.budgets == DEFAULT_POLICY.budgets
    generous = route_policy(
        DEFAULT_POLICY,
        {"reprefill_cost_cap": {"max_prompt_tokens": 1000}, "deadlines": {"request_seconds": 60}},
    )
    assert generous.reprefill_cost_cap.max_prompt_tokens == 1000 and generous.retries_enabled


@pytest.mark.parametrize(
    ("overlay", "path", "says"),
    [
        ({"budgets": {"retry_budget_percent": 10}}, "budgets.retry_budget_percent", "gateway-wide"),
        ({"limits": {"max_event_bytes": 4096}}, "limits.max_event_bytes", "gateway-wide"),
        ({"deadlines": {"connect_seconds": 3}}, "deadlines.connect_seconds", "gateway-wide"),
        ({"deadlines": {"request_seconds": 900}}, "deadlines.request_seconds", "exceeds the gateway's"),
        ({"reprefill_cost_cap": {"max_prompt_tokens": 0}}, "reprefill_cost_cap.max_prompt_tokens", ">= 1"),
        ({}, "", "non-empty mapping"),
        # Requests choose their route: a route may not make re-sending the input more frequent or costlier.
        (
            {"on_upstream_failure": {"before_first_delta": {"max_attempts": 3}}},
            "on_upstream_failure.before_first_delta.max_attempts",
            "only tighten",
        ),
        (
            {"on_upstream_failure": {"before_first_delta": {"require": ["source_attempt_fenced"]}}},
            "on_upstream_failure.before_first_delta.require",
            "drops retry_budget_available",
        ),
        (
            {"reprefill_cost_cap": {"max_prompt_tokens": 100000}},
            "reprefill_cost_cap.max_prompt_tokens",
            "only",
        ),
        ([1], "", "non-empty mapping"),
    ],
)
def test_bad_overlays_name_the_key(overlay: Any, path: str, says: str) -> None:
    with pytest.raises(PolicyError) as caught:
        route_policy(DEFAULT_POLICY, overlay)
    assert caught.value.path == path and says in str(caught.value)


def test_a_route_narrows_the_fallback_or_turns_it_off() -> None:
    base = policy_from_mapping(
        {
            "fallback": {
                "models": ["big", "other"],
                "causes": ["failed_before_content", "overloaded"],
                "max_attempts": 2,
            }
        }
    )
    narrow = route_policy(
        base, {"fallback": {"models": ["other"], "causes": ["overloaded"], "max_attempts": 1}}
    )
    assert (narrow.fallback.models, narrow.fallback.causes, narrow.fallback.max_attempts) == (
        ("other",),
        frozenset({"overloaded"}),
        1,
    )
    assert route_policy(base, {"fallback": {"models": []}}).fallback.models == ()
    for overlay, path, says in [
        ({"fallback": {"models": ["big", "huge"]}}, "fallback.models", "names huge, not in the gateway's"),
        ({"fallback": {"causes": ["unavailable"]}}, "fallback.causes", "adds unavailable"),
        ({"fallback": {"max_attempts": 3}}, "fallback.max_attempts", "(3) exceeds the gateway's (2)"),
    ]:
        with pytest.raises(PolicyError) as caught:
            route_policy(base, overlay)
        assert caught.value.path == path and says in str(caught.value), caught.value
    # A gateway without a fallback: no route may add one.
    with pytest.raises(PolicyError, match=r"not in the gateway's fallback\.models"):
        route_policy(DEFAULT_POLICY, {"fallback": {"models": ["big"]}})


def test_route_policies_parse_each_text_once_and_keep_the_error() -> None:
    policies = RoutePolicies(DEFAULT_POLICY)
    assert policies.get(None) is DEFAULT_POLICY and policies.get("") is DEFAULT_POLICY
    text = json.dumps(STRICT)
    assert policies.get(text) is policies.get(text)
    assert not policies.get(text).retries_enabled
    for bad in ("{not json", '{"budgets": {"retry_budget_percent": 1}}'):
        for _ in range(2):
            with pytest.raises(PolicyError):
                policies.get(bad)


def _file(tmp_path: Path, routes: Any) -> str:
    path = tmp_path / "policy.yaml"
    path.write_text(yaml.safe_dump({"deadlines": {"request_seconds": 120}, "routes": routes}))
    return str(path)


def test_the_policy_file_routes(tmp_path: Path) -> None:
    path = _file(
        tmp_path, [{"name": "strict", "match": {"header": "x-tier", "value": "strict"}, "policy": STRICT}]
    )
    base = load_policy(path)
    assert base.deadlines.request_seconds == 120  # `routes:` is not part of the gateway's policy
    (strict,) = load_route_policies(path, base)
    assert (strict.name, strict.header, strict.value, strict.overlay) == (
        "strict",
        "x-tier",
        "strict",
        STRICT,
    )
    assert not strict.policy.retries_enabled and strict.policy.deadlines.request_seconds == 120
    assert load_route_policies(None, DEFAULT_POLICY) == ()


@pytest.mark.parametrize(
    ("routes", "path"),
    [
        ({"name": "x"}, "routes"),
        ([{"name": "Bad Name", "match": {"header": "x", "value": "y"}, "policy": STRICT}], "routes[0].name"),
        ([{"name": "a", "match": {"header": "X Y", "value": "y"}, "policy": STRICT}], "routes[0].match"),
        ([{"name": "a", "match": {"header": "x"}, "policy": STRICT}], "routes[0].match"),
        (
            [
                {
                    "name": "a",
                    "match": {"header": "x", "value": "y"},
                    "policy": {"tools": {"retention_seconds": 1}},
                }
            ],
            "routes[0].policy.tools.retention_seconds",
        ),
        (
            [
                {"name": "a", "match": {"header": "x", "value": "1"}, "policy": STRICT},
                {"name": "a", "match": {"header": "x", "value": "2"}, "policy": STRICT},
            ],
            "routes[1].name",
        ),
        ([{"name": "a", "match": {"header": "x", "value": "y"}, "policy": STRICT, "extra": 1}], "routes[0]"),
    ],
)
def test_bad_routes_name_the_entry(tmp_path: Path, routes: Any, path: str) -> None:
    file = _file(tmp_path, routes)
    with pytest.raises(PolicyError) as caught:
        load_route_policies(file, load_policy(file))
    assert caught.value.path.startswith(path), caught.value


def test_each_route_is_rendered_before_the_catch_all_with_its_overlay(tmp_path: Path) -> None:
    path = _file(
        tmp_path,
        [
            {"name": "strict", "match": {"header": "x-tier", "value": "strict"}, "policy": STRICT},
            {
                "name": "cheap",
                "match": {"header": "x-tier", "value": "cheap"},
                "policy": {"reprefill_cost_cap": {"max_prompt_tokens": 1000}},
            },
        ],
    )
    base = load_policy(path)
    spec = GatewaySpec(
        listen=Endpoint("127.0.0.1", 8080),
        replicas=(Endpoint("127.0.0.1", 9001),),
        sidecar_socket=Path("/run/x/sidecar.sock"),
        access_log_path=Path("/run/x/access.log"),
        admin_socket=Path("/run/x/admin.sock"),
        policy=base,
        tools=(("pay", Endpoint("127.0.0.1", 9100)),),
        routes=load_route_policies(path, base),
    )
    config = yaml.safe_load(render(spec))
    hcm = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    routes = hcm["route_config"]["virtual_hosts"][0]["routes"]
    assert [r.get("name") for r in routes] == [None, "strict", "cheap", None]  # tools, ours, catch-all
    assert routes[0]["match"] == {"prefix": "/tools/pay/"}
    strict, cheap, catch_all = routes[1], routes[2], routes[3]
    assert strict["match"]["headers"] == [{"name": "x-tier", "string_match": {"exact": "strict"}}]
    # The route's retries, plus one per attempt for one that dies at its connection before it is sent.
    assert strict["route"]["retry_policy"]["num_retries"] == 1
    assert cheap["route"]["retry_policy"]["num_retries"] == 3
    assert catch_all["route"]["retry_policy"]["num_retries"] == 3
    assert strict["route"]["timeout"] == catch_all["route"]["timeout"]
    (metadata,) = strict["typed_per_filter_config"]["envoy.filters.http.ext_proc"]["overrides"][
        "grpc_initial_metadata"
    ]
    assert metadata["key"] == ROUTE_POLICY_METADATA and json.loads(metadata["value"]) == STRICT
    assert "typed_per_filter_config" not in catch_all
