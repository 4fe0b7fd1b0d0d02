from google.protobuf import any_pb2 as _any_pb2
from router_sidecar.wire import core_pb2 as _core_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DiscoveryRequest(_message.Message):
    __slots__ = ("version_info", "error_detail")
    VERSION_INFO_FIELD_NUMBER: _ClassVar[int]
    ERROR_DETAIL_FIELD_NUMBER: _ClassVar[int]
    version_info: str
    error_detail: _core_pb2.RpcStatus
    def __init__(self, version_info: _Optional[str] = ..., error_detail: _Optional[_Union[_core_pb2.RpcStatus, _Mapping]] = ...) -> None: ...

class DiscoveryResponse(_message.Message):
    __slots__ = ("version_info", "resources", "type_url", "nonce")
    VERSION_INFO_FIELD_NUMBER: _ClassVar[int]
    RESOURCES_FIELD_NUMBER: _ClassVar[int]
    TYPE_URL_FIELD_NUMBER: _ClassVar[int]
    NONCE_FIELD_NUMBER: _ClassVar[int]
    version_info: str
    resources: _containers.RepeatedCompositeFieldContainer[_any_pb2.Any]
    type_url: str
    nonce: str
    def __init__(self, version_info: _Optional[str] = ..., resources: _Optional[_Iterable[_Union[_any_pb2.Any, _Mapping]]] = ..., type_url: _Optional[str] = ..., nonce: _Optional[str] = ...) -> None: ...

class ClusterLoadAssignment(_message.Message):
    __slots__ = ("cluster_name", "endpoints")
    CLUSTER_NAME_FIELD_NUMBER: _ClassVar[int]
    ENDPOINTS_FIELD_NUMBER: _ClassVar[int]
    cluster_name: str
    endpoints: _containers.RepeatedCompositeFieldContainer[LocalityLbEndpoints]
    def __init__(self, cluster_name: _Optional[str] = ..., endpoints: _Optional[_Iterable[_Union[LocalityLbEndpoints, _Mapping]]] = ...) -> None: ...

class LocalityLbEndpoints(_message.Message):
    __slots__ = ("lb_endpoints",)
    LB_ENDPOINTS_FIELD_NUMBER: _ClassVar[int]
    lb_endpoints: _containers.RepeatedCompositeFieldContainer[LbEndpoint]
    def __init__(self, lb_endpoints: _Optional[_Iterable[_Union[LbEndpoint, _Mapping]]] = ...) -> None: ...

class LbEndpoint(_message.Message):
    __slots__ = ("endpoint", "metadata")
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    endpoint: Endpoint
    metadata: _core_pb2.Metadata
    def __init__(self, endpoint: _Optional[_Union[Endpoint, _Mapping]] = ..., metadata: _Optional[_Union[_core_pb2.Metadata, _Mapping]] = ...) -> None: ...

class Endpoint(_message.Message):
    __slots__ = ("address",)
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    address: _core_pb2.Address
    def __init__(self, address: _Optional[_Union[_core_pb2.Address, _Mapping]] = ...) -> None: ...
