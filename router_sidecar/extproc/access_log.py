"""Envoy's gRPC access-log stream: the authoritative word on why a client stream ended.

After the first delta, a client-facing stream can be torn down by the client (disconnect) or by the
replica (reset after headers went out). Both look the same to the ext_proc stream (it is cancelled);
the access-log entry's response flags tell them apart. The entry also says how many attempts Envoy made,
one whose connection died before the sidecar saw its stream included (docs/envoy-facts.md).

Behind an endpoint picker, the entry is also the only news of a request the picker's filter answered itself
(its own 503 or 429, or the picker unreachable when the gateway fails closed): no stream of ours was ever
opened for it. Such a request is journaled from its entry (`picker_answer`), under its caller's tenant (from
the credential headers Envoy logs to the sidecar in that mode), so that the client finds it by the id it got.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import grpc

from router_sidecar.coordination.store import StoreUnavailable
from router_sidecar.core.events import Outcome
from router_sidecar.core.request import DownstreamLoss
from router_sidecar.core.routes import RouteClass
from router_sidecar.core.routes import classify as classify_route
from router_sidecar.extproc.downstream import tenant_of
from router_sidecar.extproc.registry import Registry
from router_sidecar.wire import access_log_pb2 as als_pb2

if TYPE_CHECKING:
    from router_sidecar.extproc.services import Services

log = logging.getLogger(__name__)


def classify(flags: object) -> DownstreamLoss | None:
    if getattr(flags, "downstream_connection_termination", False) or getattr(
        flags, "downstream_remote_reset", False
    ):
        return DownstreamLoss.CLIENT_GONE
    if any(getattr(flags, name, False) for name in _UPSTREAM_FLAGS):
        return DownstreamLoss.UPSTREAM_RESET
    return None


# A body cut short by the replica shows up as UR/UC, or as UPE when HTTP/1.1 chunking is truncated.
_UPSTREAM_FLAGS = (
    "upstream_remote_reset",
    "upstream_connection_termination",
    "upstream_connection_failure",
    "upstream_protocol_error",
    "upstream_request_timeout",
    "upstream_max_stream_duration_reached",
    "stream_idle_timeout",
    "duration_timeout",
)

# The details of the sidecar's own ImmediateResponses (extproc/messages.py immediate).
OUR_DETAILS = "router_sidecar"
# The details of Envoy's answer when an ext_proc filter's gRPC stream failed; behind a picker, with the status
# its filter is configured to answer then (runtime/envoy_config.py, status_on_error), the picker's.
EXT_PROC_ERROR = "ext_proc_error"
PICKER_UNAVAILABLE_STATUS = 503
# The headers a request's tenant comes from (downstream.tenant_of), logged by Envoy behind a picker.
CREDENTIAL_HEADERS = ("authorization", "x-api-key")
_METHODS = {v.number: v.name for v in als_pb2.RequestMethod.DESCRIPTOR.values}


@dataclass(frozen=True, slots=True)
class PickerAnswer:
    """An inference request the endpoint picker's filter answered before any of ours saw it."""

    request_id: str
    route: str  # the API (RouteKind value)
    status: int
    details: str  # Envoy's %RESPONSE_CODE_DETAILS%: the picker's `details`, or the ext_proc error
    outcome: Outcome
    credentials: dict[str, str]  # the credential headers Envoy logged, lower-case names

    @property
    def reason(self) -> str:
        said = f" ({self.details})" if self.details else ""
        if self.outcome is Outcome.ENDPOINT_PICKER_UNAVAILABLE:
            return f"the endpoint picker could not be asked{said}; no replica was asked"
        return f"the endpoint picker answered {self.status}{said}; no replica was asked"


def picker_answer(entry: als_pb2.HTTPAccessLogEntry) -> PickerAnswer | None:
    """The entry of an inference request that an endpoint picker answered itself (503: no ready endpoint; 429:
    shed) or that failed because the picker could not be asked: Envoy answered it locally without any flag,
    not with the sidecar's details, and made no attempt. None for any other entry."""
    request, response, common = entry.request, entry.response, entry.common_properties
    if (
        not request.request_id
        or common.upstream_request_attempt_count
        or not response.HasField("response_code")
    ):
        return None
    status, details = response.response_code.value, response.response_code_details
    # Any response flag (those not declared are kept as unknown fields) is Envoy's own trouble, not the
    # picker's.
    if status not in (503, 429) or details == OUR_DETAILS or common.response_flags.ByteSize():
        return None
    route = classify_route(_METHODS.get(request.request_method, ""), request.path)
    if route.route_class is not RouteClass.INFERENCE or route.api is None:
        return None
    if details.startswith(EXT_PROC_ERROR):
        if status != PICKER_UNAVAILABLE_STATUS:
            return None
        outcome = Outcome.ENDPOINT_PICKER_UNAVAILABLE
    else:
        outcome = Outcome.NO_REPLICA_AVAILABLE if status == 503 else Outcome.REPLICAS_OVERLOADED
    credentials = {k: v for k, v in request.request_headers.items() if k.lower() in CREDENTIAL_HEADERS}
    return PickerAnswer(request.request_id, route.api.value, status, details, outcome, credentials)


class AccessLogServicer:
    def __init__(self, registry: Registry, services: Services | None = None) -> None:
        self._registry = registry
        self._services = services  # to journal the picker's answers (None: not journaled)
        self._writes: set[asyncio.Task[None]] = set()

    async def StreamAccessLogs(
        self,
        request_iterator: AsyncIterator[als_pb2.StreamAccessLogsMessage],
        context: grpc.aio.ServicerContext,
    ) -> als_pb2.StreamAccessLogsResponse:
        async for message in request_iterator:
            for entry in message.http_logs.log_entry:
                request_id = entry.request.request_id
                log.debug("access log: %s flags=%s", request_id, entry.common_properties.response_flags)
                if request_id:
                    code = (
                        entry.response.response_code.value
                        if entry.response.HasField("response_code")
                        else None
                    )
                    common = entry.common_properties
                    self._registry.note_access_log(
                        request_id,
                        classify(common.response_flags),
                        code,
                        attempts=common.upstream_request_attempt_count or None,
                        body_bytes=entry.response.response_body_bytes if code is not None else None,
                    )
                    self._journal_picker_answer(entry)
        return als_pb2.StreamAccessLogsResponse()

    def _journal_picker_answer(self, entry: als_pb2.HTTPAccessLogEntry) -> None:
        if self._services is None:
            return
        answer = picker_answer(entry)
        # A request the registry knows is one of ours (its own stream journals it).
        if answer is None or self._registry.get(answer.request_id) is not None:
            return
        task = asyncio.get_running_loop().create_task(self._record(answer))
        self._writes.add(task)
        task.add_done_callback(self._writes.discard)

    async def _record(self, answer: PickerAnswer) -> None:
        services = self._services
        assert services is not None
        tenant = tenant_of(answer.credentials, services.tenant_secret)
        try:
            written = await services.journal.record_rejected(
                tenant,
                answer.request_id,
                route=answer.route,
                outcome=answer.outcome.value,
                status=answer.status,
                reason=answer.reason,
                details=answer.details or None,
            )
        except StoreUnavailable as exc:
            log.error("journal: could not record request %s (%s): %s", answer.request_id, answer.outcome, exc)
            return
        if written:
            log.info(
                "request %s answered by the endpoint picker: %s (%s %s)",
                answer.request_id,
                answer.outcome.value,
                answer.status,
                answer.details,
            )
        else:
            log.warning(
                "request %s: its id has a journal record already; the picker's answer is not journaled",
                answer.request_id,
            )
