"""Which processor a client request gets, decided once from its method and path (sans-IO).

Envoy normalises the path before any filter sees it (`normalize_path`, `merge_slashes`, escaped slashes
rejected), but an engine behind it may decode more than Envoy does: a percent-encoded unreserved
character (`/v1/chat/completion%73`) or a trailing slash is the same route to uvicorn. So the gateway
canonicalises once more here, and a request whose canonical path is one of ours is handled as that route
(and forwarded with the canonical path), never passed through beside admission, the hold and the journal.

    inference  POST /v1/chat/completions, /v1/completions,           → admitted, held, journaled
               /v1/responses (OpenAI), /v1/messages (Anthropic)        (docs/design.md#the-streaming-apis)
    tool call  /tools/NAME/... with a method other than GET/HEAD    → idempotency by key
    stored     /v1/responses/{id}[/...] (retrieve, resume, cancel…)  → sent to the replica holding it
    look-up    GET /v1/requests/{request_id}                         → answered from the journal
    health     GET /livez, GET /readyz                               → answered by the sidecar (probes)
    rejected   another method on an inference or look-up path        → 405 with Allow
    pass-through anything else (/v1/models, /v1/embeddings, …)       → forwarded untouched
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass

from router_sidecar.core.openai_api import RouteKind, valid_key

__all__ = [
    "HEALTH_PATHS",
    "LOOKUP_PREFIX",
    "TOOLS_PREFIX",
    "Probe",
    "Route",
    "RouteClass",
    "canonical_path",
    "classify",
    "valid_key",
]

LOOKUP_PREFIX = "/v1/requests/"
STORED_RESPONSES_PREFIX = "/v1/responses/"
TOOLS_PREFIX = "/tools/"
# Probes of the whole gateway (Envoy + sidecar), the Kubernetes convention's names.


class Probe(enum.Enum):
    LIVE = "live"  # Envoy and the sidecar answer
    READY = "ready"  # ... and etcd answers: without it no attempt can be journaled or fenced


HEALTH_PATHS = {"/livez": Probe.LIVE, "/readyz": Probe.READY}
_INFERENCE = {
    "/v1/chat/completions": RouteKind.CHAT,
    "/v1/completions": RouteKind.COMPLETIONS,
    "/v1/responses": RouteKind.RESPONSES,
    "/v1/messages": RouteKind.MESSAGES,
}
_UNRESERVED_ESCAPE = re.compile(r"%(2[dDeE]|3[0-9]|[46][1-9a-fA-F]|[57][0-9aA]|5[fF]|7[eE])")


class RouteClass(enum.Enum):
    INFERENCE = "inference"
    TOOL_CALL = "tool_call"
    LOOKUP = "lookup"
    STORED_RESPONSE = "stored_response"
    HEALTH = "health"
    REJECTED = "rejected"
    PASS_THROUGH = "pass_through"


@dataclass(frozen=True, slots=True)
class Route:
    route_class: RouteClass
    # The path (with its query) to forward instead of the client's, when canonicalisation changed it.
    rewrite_path: str | None = None
    api: RouteKind | None = None  # inference: which API
    request_id: str | None = None  # look-up: the id asked for (None: not a valid id → 404)
    response_id: str | None = None  # stored response: the Responses API id it names
    probe: Probe | None = None  # health: which probe
    status: int = 0  # rejected: the answer
    code: str = ""
    message: str = ""
    allow: str = ""


def canonical_path(path: str) -> str:
    """The path as an engine would route it: unreserved escapes decoded, dot segments removed, repeated
    and trailing slashes dropped. Other escapes stay as they are (`%2F` is not a separator)."""
    path = _UNRESERVED_ESCAPE.sub(lambda m: chr(int(m.group(1), 16)), path)
    segments: list[str] = []
    for segment in path.split("/"):
        if segment in ("", "."):
            continue
        if segment == "..":
            if segments:
                segments.pop()
            continue
        segments.append(segment)
    return "/" + "/".join(segments)


def classify(method: str, raw_path: str) -> Route:
    path, sep, query = raw_path.partition("?")
    canonical = canonical_path(path)
    rewrite = canonical + sep + query if canonical != path else None
    api = _INFERENCE.get(canonical)
    if api is not None:
        if method != "POST":
            return _method_not_allowed(canonical, "POST")
        return Route(RouteClass.INFERENCE, rewrite, api=api)
    if (canonical + "/").startswith(LOOKUP_PREFIX):
        if method != "GET":
            return _method_not_allowed(canonical, "GET")
        request_id = canonical[len(LOOKUP_PREFIX) :]
        return Route(RouteClass.LOOKUP, request_id=request_id if valid_key(request_id) else None)
    if canonical.startswith(STORED_RESPONSES_PREFIX):
        response_id = canonical[len(STORED_RESPONSES_PREFIX) :].partition("/")[0]
        if valid_key(response_id):
            return Route(RouteClass.STORED_RESPONSE, rewrite, response_id=response_id)
    probe = HEALTH_PATHS.get(canonical)
    if probe is not None:
        if method not in ("GET", "HEAD"):
            return _method_not_allowed(canonical, "GET, HEAD")
        return Route(RouteClass.HEALTH, probe=probe)
    if canonical.startswith(TOOLS_PREFIX) and method not in ("GET", "HEAD"):
        return Route(RouteClass.TOOL_CALL, rewrite)
    return Route(RouteClass.PASS_THROUGH, rewrite if canonical.startswith(TOOLS_PREFIX) else None)


def _method_not_allowed(path: str, allow: str) -> Route:
    return Route(
        RouteClass.REJECTED,
        status=405,
        code="method_not_allowed",
        message=f"{path} accepts {allow} only",
        allow=allow,
    )
