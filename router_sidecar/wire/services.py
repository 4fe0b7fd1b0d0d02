"""gRPC registration of the services Envoy calls on the sidecar, by Envoy's own method paths.

There are no generated `_pb2_grpc` modules: a service is a name, method names and the (de)serializers of
our wire messages. Our proto package differs from Envoy's, so the paths are spelled out here; Envoy
calls exactly these. Servicers are plain classes with grpc.aio-style methods.
"""

from __future__ import annotations

from typing import Any, Protocol

import grpc

from router_sidecar.wire import access_log_pb2, discovery_pb2, ext_proc_pb2

EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
ACCESS_LOG_SERVICE = "envoy.service.accesslog.v3.AccessLogService"
ENDPOINT_DISCOVERY_SERVICE = "envoy.service.endpoint.v3.EndpointDiscoveryService"

# Full paths, as Envoy sends them in :path (for tests and logs).
PROCESS_METHOD = f"/{EXT_PROC_SERVICE}/Process"
STREAM_ACCESS_LOGS_METHOD = f"/{ACCESS_LOG_SERVICE}/StreamAccessLogs"
STREAM_ENDPOINTS_METHOD = f"/{ENDPOINT_DISCOVERY_SERVICE}/StreamEndpoints"


class ExternalProcessorServicer(Protocol):
    async def Process(self, request_iterator: Any, context: grpc.aio.ServicerContext) -> Any: ...


class AccessLogServicer(Protocol):
    async def StreamAccessLogs(self, request_iterator: Any, context: grpc.aio.ServicerContext) -> Any: ...


class EndpointDiscoveryServicer(Protocol):
    async def StreamEndpoints(self, request_iterator: Any, context: grpc.aio.ServicerContext) -> Any: ...


def _register(server: grpc.aio.Server, service: str, handlers: dict[str, grpc.RpcMethodHandler]) -> None:
    # Registered methods are matched by grpc core without the per-call generic lookup; the generic handler
    # is kept as a fallback, as generated code does.
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, handlers),))
    server.add_registered_method_handlers(service, handlers)


def add_external_processor(server: grpc.aio.Server, servicer: ExternalProcessorServicer) -> None:
    """Serve ext_proc's bidirectional Process stream."""
    _register(
        server,
        EXT_PROC_SERVICE,
        {
            "Process": grpc.stream_stream_rpc_method_handler(
                servicer.Process,
                request_deserializer=ext_proc_pb2.ProcessingRequest.FromString,
                # The hottest reply (a streamed body chunk) is written already serialized.
                response_serializer=_serialize_processing_response,
            )
        },
    )


def _serialize_processing_response(reply: ext_proc_pb2.ProcessingResponse | bytes) -> bytes:
    return reply if isinstance(reply, bytes) else reply.SerializeToString()


def add_access_log_service(server: grpc.aio.Server, servicer: AccessLogServicer) -> None:
    """Serve the access-log stream (client streaming: Envoy writes, one empty reply at the end)."""
    _register(
        server,
        ACCESS_LOG_SERVICE,
        {
            "StreamAccessLogs": grpc.stream_unary_rpc_method_handler(
                servicer.StreamAccessLogs,
                request_deserializer=access_log_pb2.StreamAccessLogsMessage.FromString,
                response_serializer=access_log_pb2.StreamAccessLogsResponse.SerializeToString,
            )
        },
    )


def add_endpoint_discovery(server: grpc.aio.Server, servicer: EndpointDiscoveryServicer) -> None:
    """Serve state-of-the-world EDS only; delta and fetch calls get UNIMPLEMENTED, as before."""
    _register(
        server,
        ENDPOINT_DISCOVERY_SERVICE,
        {
            "StreamEndpoints": grpc.stream_stream_rpc_method_handler(
                servicer.StreamEndpoints,
                request_deserializer=discovery_pb2.DiscoveryRequest.FromString,
                response_serializer=discovery_pb2.DiscoveryResponse.SerializeToString,
            )
        },
    )
