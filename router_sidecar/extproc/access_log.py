"""Envoy's gRPC access-log stream: the authoritative word on why a client stream ended.

After the first delta, a client-facing stream can be torn down by the client (disconnect) or by the
replica (reset after headers went out). Both look the same to the ext_proc stream (it is cancelled);
the access-log entry's response flags tell them apart. The entry also says how many attempts Envoy made,
one whose connection died before the sidecar saw its stream included (docs/envoy-facts.md).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

import grpc

from router_sidecar.core.request import DownstreamLoss
from router_sidecar.extproc.registry import Registry
from router_sidecar.wire import access_log_pb2 as als_pb2

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


class AccessLogServicer:
    def __init__(self, registry: Registry) -> None:
        self._registry = registry

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
                    )
        return als_pb2.StreamAccessLogsResponse()
