"""deploy/envoy-gateway: the custom resources reference what the example defines, and every Envoy setting they
carry (EnvoyExtensionPolicy fields, EnvoyPatchPolicy values) equals the gateway's own Envoy config, rendered
from envoy/gateway.yaml with the deployed policy: the example cannot drift from the design silently."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from router_sidecar.core.policy import load_policy
from router_sidecar.runtime.envoy_config import Endpoint, GatewaySpec, render
from tests.deploy.kube import DEPLOY, Obj

JSON_PATCH_OPS = {"add", "remove", "replace", "move", "copy", "test"}


@pytest.fixture(scope="module")
def gateway_config() -> dict[str, Any]:
    spec = GatewaySpec(
        listen=Endpoint.parse("0.0.0.0:8080"),
        replicas=(),  # replicas from the sidecar's EDS, as patched in
        sidecar_socket=Path("/run/router-sidecar/sidecar.sock"),
        access_log_path=Path("/dev/stdout"),
        policy=load_policy(str(DEPLOY / "base" / "policy.yaml")),
        admin_socket=Path("/run/router-sidecar/envoy-admin.sock"),
    )
    config: dict[str, Any] = yaml.safe_load(render(spec))
    return config


@pytest.fixture(scope="module")
def objects(rendered: dict[str, list[Obj]]) -> dict[str, Obj]:
    by_kind: dict[str, Obj] = {}
    for obj in rendered["envoy-gateway"]:
        if obj["kind"] in {"HTTPRoute", "EnvoyExtensionPolicy", "EnvoyPatchPolicy"}:
            assert obj["kind"] not in by_kind
            by_kind[obj["kind"]] = obj
    assert set(by_kind) == {"HTTPRoute", "EnvoyExtensionPolicy", "EnvoyPatchPolicy"}
    by_kind["services"] = {
        o["metadata"]["name"]: o for o in rendered["envoy-gateway"] if o["kind"] == "Service"
    }
    return by_kind


def _hcm(config: dict[str, Any]) -> dict[str, Any]:
    typed: dict[str, Any] = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0][
        "typed_config"
    ]
    return typed


def _downstream_ext_proc(config: dict[str, Any]) -> dict[str, Any]:
    (f,) = [f for f in _hcm(config)["http_filters"] if f["name"] == "envoy.filters.http.ext_proc"]
    typed: dict[str, Any] = f["typed_config"]
    return typed


def _llm_cluster(config: dict[str, Any]) -> dict[str, Any]:
    (cluster,) = [c for c in config["static_resources"]["clusters"] if c["name"] == "llm"]
    return cluster


def _patches(objects: dict[str, Obj]) -> list[dict[str, Any]]:
    patches: list[dict[str, Any]] = objects["EnvoyPatchPolicy"]["spec"]["jsonPatches"]
    return patches


def _patch(objects: dict[str, Obj], path: str) -> dict[str, Any]:
    (found,) = [p for p in _patches(objects) if p["operation"]["path"] == path]
    return found


def _ext_proc_cluster(objects: dict[str, Obj]) -> str:
    policy = objects["EnvoyExtensionPolicy"]["metadata"]
    return f"envoyextensionpolicy/{policy['namespace']}/{policy['name']}/extproc/0"


def _with_cluster(value: Any, old: str, new: str) -> Any:
    """A deep copy with every envoy_grpc cluster_name `old` replaced by `new`."""
    value = copy.deepcopy(value)

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            if node.get("cluster_name") == old:
                node["cluster_name"] = new
            for child in node.values():
                walk(child)
        elif isinstance(node, list):
            for child in node:
                walk(child)

    walk(value)
    return value


def test_references_resolve(objects: dict[str, Obj]) -> None:
    route, policy = objects["HTTPRoute"], objects["EnvoyExtensionPolicy"]
    services = objects["services"]
    for ref in route["spec"]["rules"][0]["backendRefs"]:
        assert ref["port"] in [p["port"] for p in services[ref["name"]]["spec"]["ports"]]
    assert policy["spec"]["targetRefs"] == [
        {"group": "gateway.networking.k8s.io", "kind": "HTTPRoute", "name": route["metadata"]["name"]}
    ]
    (ext_proc,) = policy["spec"]["extProc"]
    for ref in ext_proc["backendRefs"]:
        assert ref["port"] in [p["port"] for p in services[ref["name"]]["spec"]["ports"]]
    # The patch policy targets the route's Gateway; generated names follow from the route and the listener.
    (parent,) = route["spec"]["parentRefs"]
    patch_policy = objects["EnvoyPatchPolicy"]["spec"]
    assert patch_policy["targetRef"]["name"] == parent["name"] and patch_policy["type"] == "JSONPatch"
    namespace = route["metadata"]["namespace"]
    listener = f"{namespace}/{parent['name']}/{parent['sectionName']}"
    cluster = f"httproute/{namespace}/{route['metadata']['name']}/rule/0"
    for patch in _patches(objects):
        assert patch["operation"]["op"] in JSON_PATCH_OPS
        assert patch["operation"]["path"].startswith("/")
        expected = {"Listener": listener, "Cluster": cluster}[patch["type"].rpartition(".")[2]]
        assert patch["name"] == expected, patch["name"]
        if "jsonPath" in patch["operation"]:
            assert (
                f"'envoy.filters.http.ext_proc/{_ext_proc_cluster(objects)}'"
                in patch["operation"]["jsonPath"]
            )


def test_downstream_filter_matches_the_gateway(
    objects: dict[str, Obj], gateway_config: dict[str, Any]
) -> None:
    ours = _downstream_ext_proc(gateway_config)
    (ext_proc,) = objects["EnvoyExtensionPolicy"]["spec"]["extProc"]
    mode = ext_proc["processingMode"]
    camel = {"BUFFERED": "Buffered", "STREAMED": "Streamed", "FULL_DUPLEX_STREAMED": "FullDuplexStreamed"}
    assert mode["request"]["body"] == camel[ours["processing_mode"]["request_body_mode"]]
    assert mode["response"]["body"] == camel[ours["processing_mode"]["response_body_mode"]]
    assert mode["request"]["attributes"] == ours["request_attributes"]
    assert mode["response"]["attributes"] == ours["response_attributes"]
    assert ext_proc["failOpen"] is ours["failure_mode_allow"] is False
    assert ext_proc["messageTimeout"] == ours["message_timeout"]
    assert (
        ext_proc["metadata"]["writableNamespaces"]
        == ours["metadata_options"]["receiving_namespaces"]["untyped"]
    )
    # What the API cannot say is patched in, with the gateway's values.
    placement = _patch(objects, "/initial_metadata")["operation"]["value"]
    assert placement == ours["grpc_service"]["initial_metadata"]
    trailers = _patch(objects, "/response_trailer_mode")["operation"]["value"]
    assert trailers == ours["processing_mode"]["response_trailer_mode"]


def test_upstream_filter_matches_the_gateway(objects: dict[str, Obj], gateway_config: dict[str, Any]) -> None:
    cluster = _llm_cluster(gateway_config)
    value = _patch(objects, "/typed_extension_protocol_options")["operation"]["value"]
    expected = _with_cluster(
        cluster["typed_extension_protocol_options"], "sidecar", _ext_proc_cluster(objects)
    )
    assert value == expected
    held = _patch(objects, "/per_connection_buffer_limit_bytes")["operation"]["value"]
    assert held == cluster["per_connection_buffer_limit_bytes"]


def test_access_log_and_eds_match_the_gateway(
    objects: dict[str, Obj], gateway_config: dict[str, Any]
) -> None:
    sidecar = _ext_proc_cluster(objects)
    (grpc_log,) = [
        a for a in _hcm(gateway_config)["access_log"] if a["name"] == "envoy.access_loggers.http_grpc"
    ]
    patch = _patch(objects, "/default_filter_chain/filters/0/typed_config/access_log/-")
    assert patch["operation"]["value"] == _with_cluster(grpc_log, "sidecar", sidecar)
    cluster = _llm_cluster(gateway_config)
    eds = _patch(objects, "/eds_cluster_config")["operation"]["value"]
    assert eds == _with_cluster(cluster["eds_cluster_config"], "sidecar", sidecar)
    balancer = _patch(objects, "/load_balancing_policy")["operation"]["value"]
    assert balancer == cluster["load_balancing_policy"]


def test_network_policy_guards_the_sidecar(rendered: dict[str, list[Obj]], objects: dict[str, Obj]) -> None:
    (policy,) = [o for o in rendered["envoy-gateway"] if o["kind"] == "NetworkPolicy"]
    service = objects["services"]["router-sidecar-extproc"]
    assert policy["spec"]["podSelector"]["matchLabels"] == service["spec"]["selector"]
    (rule,) = policy["spec"]["ingress"]
    assert [p["port"] for p in rule["ports"]] == [p["targetPort"] for p in service["spec"]["ports"]]
    (source,) = rule["from"]
    assert set(source) == {"namespaceSelector", "podSelector"}, "only the proxy Pods of Envoy Gateway"


def test_readme_states_the_limits() -> None:
    text = (DEPLOY / "envoy-gateway" / "README.md").read_text()
    for phrase in ("EnvoyPatchPolicy", "upstream", "unix socket", "NetworkPolicy", "loopback", "egctl"):
        assert phrase in text, phrase
