"""Route classification: every spelling an engine would route as ours is handled as ours."""

from __future__ import annotations

import pytest

from router_sidecar.core.openai_api import RouteKind
from router_sidecar.core.routes import Probe, RouteClass, canonical_path, classify

INFERENCE, TOOL, LOOKUP, REJECTED, PASS = (
    RouteClass.INFERENCE,
    RouteClass.TOOL_CALL,
    RouteClass.LOOKUP,
    RouteClass.REJECTED,
    RouteClass.PASS_THROUGH,
)


@pytest.mark.parametrize(
    ("method", "path", "route_class", "api", "rewrite"),
    [
        ("POST", "/v1/chat/completions", INFERENCE, RouteKind.CHAT, None),
        ("POST", "/v1/chat/completions?x=1", INFERENCE, RouteKind.CHAT, None),
        ("POST", "/v1/completions", INFERENCE, RouteKind.COMPLETIONS, None),
        # What uvicorn decodes or redirects, the gateway handles as the route itself, with the canonical path.
        ("POST", "/v1/chat/completion%73", INFERENCE, RouteKind.CHAT, "/v1/chat/completions"),
        ("POST", "/v1/chat/%63ompletions?x=1", INFERENCE, RouteKind.CHAT, "/v1/chat/completions?x=1"),
        ("POST", "/v1/chat/completions/", INFERENCE, RouteKind.CHAT, "/v1/chat/completions"),
        ("POST", "//v1//chat/completions", INFERENCE, RouteKind.CHAT, "/v1/chat/completions"),
        ("POST", "/v1/./chat/../chat/completions", INFERENCE, RouteKind.CHAT, "/v1/chat/completions"),
        ("POST", "/v1/%2e/completions", INFERENCE, RouteKind.COMPLETIONS, "/v1/completions"),
        # Not the same route to an engine: an escaped slash, another case, a path parameter.
        ("POST", "/v1/chat%2Fcompletions", PASS, None, None),
        ("POST", "/V1/chat/completions", PASS, None, None),
        ("POST", "/v1/chat/completions;x", PASS, None, None),
        ("POST", "/v1/chat/completions/extra", PASS, None, None),
        ("POST", "/v1/embeddings", PASS, None, None),
        ("GET", "/v1/models", PASS, None, None),
        ("POST", "/tools/payments/charge", TOOL, None, None),
        ("POST", "/tools/%70ayments/charge", TOOL, None, "/tools/payments/charge"),
        ("PUT", "/tools//payments/charge?a=1", TOOL, None, "/tools/payments/charge?a=1"),
        ("GET", "/tools/payments/status", PASS, None, None),
        ("GET", "/tools//payments/status", PASS, None, "/tools/payments/status"),
        ("GET", "/v1/requests/req_1", LOOKUP, None, None),
    ],
)
def test_classify(
    method: str, path: str, route_class: RouteClass, api: RouteKind | None, rewrite: str | None
) -> None:
    route = classify(method, path)
    assert route.route_class is route_class
    assert route.api is api
    assert route.rewrite_path == rewrite


@pytest.mark.parametrize(
    ("method", "path", "allow"),
    [
        ("PUT", "/v1/chat/completions", "POST"),
        ("GET", "/v1/chat/completions", "POST"),
        ("DELETE", "/v1/completion%73", "POST"),
        ("POST", "/v1/requests/x", "GET"),
        ("HEAD", "/v1/requests/x", "GET"),
    ],
)
def test_other_methods_on_our_paths_are_405(method: str, path: str, allow: str) -> None:
    route = classify(method, path)
    assert (route.route_class, route.status, route.code, route.allow) == (
        REJECTED,
        405,
        "method_not_allowed",
        allow,
    )


@pytest.mark.parametrize(
    ("path", "request_id"),
    [
        ("/v1/requests/req_01J:call_07", "req_01J:call_07"),
        ("/v1/requests/%E2%82%AC", None),  # not a key the gateway ever issues or accepts: 404, no echo
        ("/v1/requests/a/b", None),
        ("/v1/requests/" + "x" * 201, None),
        ("/v1/requests/", None),
        ("/v1/requests/ab?x=1", "ab"),
    ],
)
def test_lookup_ids(path: str, request_id: str | None) -> None:
    route = classify("GET", path)
    assert route.route_class is LOOKUP
    assert route.request_id == request_id


@pytest.mark.parametrize(
    ("raw", "canonical"),
    [
        ("/", "/"),
        ("", "/"),
        ("/a/b/", "/a/b"),
        ("/a/../../b", "/b"),
        ("/%41%7a%30%2D%5F%7E", "/Az0-_~"),
        ("/a%20b", "/a%20b"),  # a space is not unreserved: left escaped
        ("/a%2fb", "/a%2fb"),
    ],
)
def test_canonical_path(raw: str, canonical: str) -> None:
    assert canonical_path(raw) == canonical


@pytest.mark.parametrize(
    ("method", "path", "probe"),
    [
        ("GET", "/livez", Probe.LIVE),
        ("HEAD", "/livez", Probe.LIVE),
        ("GET", "/readyz", Probe.READY),
        ("GET", "//readyz/", Probe.READY),
        ("GET", "/ready%7a", Probe.READY),
        ("GET", "/readyz?verbose=1", Probe.READY),
    ],
)
def test_health_probes(method: str, path: str, probe: Probe) -> None:
    route = classify(method, path)
    assert (route.route_class, route.probe) == (RouteClass.HEALTH, probe)


def test_health_probes_take_no_writes() -> None:
    route = classify("POST", "/readyz")
    assert (route.route_class, route.status, route.allow) == (REJECTED, 405, "GET, HEAD")
    assert classify("GET", "/readyz/x").route_class is PASS
