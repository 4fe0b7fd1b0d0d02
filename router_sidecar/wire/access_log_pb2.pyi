from google.protobuf import wrappers_pb2 as _wrappers_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RequestMethod(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    METHOD_UNSPECIFIED: _ClassVar[RequestMethod]
    GET: _ClassVar[RequestMethod]
    HEAD: _ClassVar[RequestMethod]
    POST: _ClassVar[RequestMethod]
    PUT: _ClassVar[RequestMethod]
    DELETE: _ClassVar[RequestMethod]
    CONNECT: _ClassVar[RequestMethod]
    OPTIONS: _ClassVar[RequestMethod]
    TRACE: _ClassVar[RequestMethod]
    PATCH: _ClassVar[RequestMethod]
METHOD_UNSPECIFIED: RequestMethod
GET: RequestMethod
HEAD: RequestMethod
POST: RequestMethod
PUT: RequestMethod
DELETE: RequestMethod
CONNECT: RequestMethod
OPTIONS: RequestMethod
TRACE: RequestMethod
PATCH: RequestMethod

class StreamAccessLogsMessage(_message.Message):
    __slots__ = ("http_logs",)
    class HTTPAccessLogEntries(_message.Message):
        __slots__ = ("log_entry",)
        LOG_ENTRY_FIELD_NUMBER: _ClassVar[int]
        log_entry: _containers.RepeatedCompositeFieldContainer[HTTPAccessLogEntry]
        def __init__(self, log_entry: _Optional[_Iterable[_Union[HTTPAccessLogEntry, _Mapping]]] = ...) -> None: ...
    HTTP_LOGS_FIELD_NUMBER: _ClassVar[int]
    http_logs: StreamAccessLogsMessage.HTTPAccessLogEntries
    def __init__(self, http_logs: _Optional[_Union[StreamAccessLogsMessage.HTTPAccessLogEntries, _Mapping]] = ...) -> None: ...

class StreamAccessLogsResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HTTPAccessLogEntry(_message.Message):
    __slots__ = ("common_properties", "request", "response")
    COMMON_PROPERTIES_FIELD_NUMBER: _ClassVar[int]
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    common_properties: AccessLogCommon
    request: HTTPRequestProperties
    response: HTTPResponseProperties
    def __init__(self, common_properties: _Optional[_Union[AccessLogCommon, _Mapping]] = ..., request: _Optional[_Union[HTTPRequestProperties, _Mapping]] = ..., response: _Optional[_Union[HTTPResponseProperties, _Mapping]] = ...) -> None: ...

class AccessLogCommon(_message.Message):
    __slots__ = ("response_flags", "upstream_request_attempt_count")
    RESPONSE_FLAGS_FIELD_NUMBER: _ClassVar[int]
    UPSTREAM_REQUEST_ATTEMPT_COUNT_FIELD_NUMBER: _ClassVar[int]
    response_flags: ResponseFlags
    upstream_request_attempt_count: int
    def __init__(self, response_flags: _Optional[_Union[ResponseFlags, _Mapping]] = ..., upstream_request_attempt_count: _Optional[int] = ...) -> None: ...

class HTTPRequestProperties(_message.Message):
    __slots__ = ("request_method", "path", "request_id", "request_headers")
    class RequestHeadersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    REQUEST_METHOD_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_HEADERS_FIELD_NUMBER: _ClassVar[int]
    request_method: RequestMethod
    path: str
    request_id: str
    request_headers: _containers.ScalarMap[str, str]
    def __init__(self, request_method: _Optional[_Union[RequestMethod, str]] = ..., path: _Optional[str] = ..., request_id: _Optional[str] = ..., request_headers: _Optional[_Mapping[str, str]] = ...) -> None: ...

class HTTPResponseProperties(_message.Message):
    __slots__ = ("response_code", "response_body_bytes", "response_code_details")
    RESPONSE_CODE_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_BODY_BYTES_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_CODE_DETAILS_FIELD_NUMBER: _ClassVar[int]
    response_code: _wrappers_pb2.UInt32Value
    response_body_bytes: int
    response_code_details: str
    def __init__(self, response_code: _Optional[_Union[_wrappers_pb2.UInt32Value, _Mapping]] = ..., response_body_bytes: _Optional[int] = ..., response_code_details: _Optional[str] = ...) -> None: ...

class ResponseFlags(_message.Message):
    __slots__ = ("upstream_request_timeout", "upstream_remote_reset", "upstream_connection_failure", "upstream_connection_termination", "downstream_connection_termination", "stream_idle_timeout", "upstream_max_stream_duration_reached", "duration_timeout", "upstream_protocol_error", "downstream_remote_reset")
    UPSTREAM_REQUEST_TIMEOUT_FIELD_NUMBER: _ClassVar[int]
    UPSTREAM_REMOTE_RESET_FIELD_NUMBER: _ClassVar[int]
    UPSTREAM_CONNECTION_FAILURE_FIELD_NUMBER: _ClassVar[int]
    UPSTREAM_CONNECTION_TERMINATION_FIELD_NUMBER: _ClassVar[int]
    DOWNSTREAM_CONNECTION_TERMINATION_FIELD_NUMBER: _ClassVar[int]
    STREAM_IDLE_TIMEOUT_FIELD_NUMBER: _ClassVar[int]
    UPSTREAM_MAX_STREAM_DURATION_REACHED_FIELD_NUMBER: _ClassVar[int]
    DURATION_TIMEOUT_FIELD_NUMBER: _ClassVar[int]
    UPSTREAM_PROTOCOL_ERROR_FIELD_NUMBER: _ClassVar[int]
    DOWNSTREAM_REMOTE_RESET_FIELD_NUMBER: _ClassVar[int]
    upstream_request_timeout: bool
    upstream_remote_reset: bool
    upstream_connection_failure: bool
    upstream_connection_termination: bool
    downstream_connection_termination: bool
    stream_idle_timeout: bool
    upstream_max_stream_duration_reached: bool
    duration_timeout: bool
    upstream_protocol_error: bool
    downstream_remote_reset: bool
    def __init__(self, upstream_request_timeout: _Optional[bool] = ..., upstream_remote_reset: _Optional[bool] = ..., upstream_connection_failure: _Optional[bool] = ..., upstream_connection_termination: _Optional[bool] = ..., downstream_connection_termination: _Optional[bool] = ..., stream_idle_timeout: _Optional[bool] = ..., upstream_max_stream_duration_reached: _Optional[bool] = ..., duration_timeout: _Optional[bool] = ..., upstream_protocol_error: _Optional[bool] = ..., downstream_remote_reset: _Optional[bool] = ...) -> None: ...
