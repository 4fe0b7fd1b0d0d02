from google.protobuf import struct_pb2 as _struct_pb2
from router_sidecar.records import options_pb2 as _options_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class JournalRecord(_message.Message):
    __slots__ = ("request_id", "phase", "outcome", "attempt", "first_delta_sent", "model", "model_revision", "fingerprint_digest", "retry_budget", "delivered_output_tokens", "delivered_output_tokens_source", "attempts", "tool_calls", "input", "tool_calls_not_listed", "gateway", "owner", "events", "trace", "updated_at", "envoy_attempts", "destinations", "stored_response", "fallback")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    FIRST_DELTA_SENT_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MODEL_REVISION_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_DIGEST_FIELD_NUMBER: _ClassVar[int]
    RETRY_BUDGET_FIELD_NUMBER: _ClassVar[int]
    DELIVERED_OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DELIVERED_OUTPUT_TOKENS_SOURCE_FIELD_NUMBER: _ClassVar[int]
    ATTEMPTS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    INPUT_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_NOT_LISTED_FIELD_NUMBER: _ClassVar[int]
    GATEWAY_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    TRACE_FIELD_NUMBER: _ClassVar[int]
    UPDATED_AT_FIELD_NUMBER: _ClassVar[int]
    ENVOY_ATTEMPTS_FIELD_NUMBER: _ClassVar[int]
    DESTINATIONS_FIELD_NUMBER: _ClassVar[int]
    STORED_RESPONSE_FIELD_NUMBER: _ClassVar[int]
    FALLBACK_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    phase: str
    outcome: str
    attempt: int
    first_delta_sent: bool
    model: str
    model_revision: str
    fingerprint_digest: str
    retry_budget: int
    delivered_output_tokens: int
    delivered_output_tokens_source: str
    attempts: _containers.RepeatedCompositeFieldContainer[AttemptRecord]
    tool_calls: _containers.RepeatedCompositeFieldContainer[ToolCallRecord]
    input: InputRecord
    tool_calls_not_listed: int
    gateway: str
    owner: str
    events: _containers.RepeatedCompositeFieldContainer[JournalEvent]
    trace: str
    updated_at: float
    envoy_attempts: int
    destinations: DestinationsRecord
    stored_response: StoredResponseRecord
    fallback: FallbackRecord
    def __init__(self, request_id: _Optional[str] = ..., phase: _Optional[str] = ..., outcome: _Optional[str] = ..., attempt: _Optional[int] = ..., first_delta_sent: _Optional[bool] = ..., model: _Optional[str] = ..., model_revision: _Optional[str] = ..., fingerprint_digest: _Optional[str] = ..., retry_budget: _Optional[int] = ..., delivered_output_tokens: _Optional[int] = ..., delivered_output_tokens_source: _Optional[str] = ..., attempts: _Optional[_Iterable[_Union[AttemptRecord, _Mapping]]] = ..., tool_calls: _Optional[_Iterable[_Union[ToolCallRecord, _Mapping]]] = ..., input: _Optional[_Union[InputRecord, _Mapping]] = ..., tool_calls_not_listed: _Optional[int] = ..., gateway: _Optional[str] = ..., owner: _Optional[str] = ..., events: _Optional[_Iterable[_Union[JournalEvent, _Mapping]]] = ..., trace: _Optional[str] = ..., updated_at: _Optional[float] = ..., envoy_attempts: _Optional[int] = ..., destinations: _Optional[_Union[DestinationsRecord, _Mapping]] = ..., stored_response: _Optional[_Union[StoredResponseRecord, _Mapping]] = ..., fallback: _Optional[_Union[FallbackRecord, _Mapping]] = ...) -> None: ...

class FallbackRecord(_message.Message):
    __slots__ = ("model", "requested_model", "causes")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    REQUESTED_MODEL_FIELD_NUMBER: _ClassVar[int]
    CAUSES_FIELD_NUMBER: _ClassVar[int]
    model: str
    requested_model: str
    causes: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, model: _Optional[str] = ..., requested_model: _Optional[str] = ..., causes: _Optional[_Iterable[str]] = ...) -> None: ...

class StoredResponseRecord(_message.Message):
    __slots__ = ("id", "replica")
    ID_FIELD_NUMBER: _ClassVar[int]
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    id: str
    replica: str
    def __init__(self, id: _Optional[str] = ..., replica: _Optional[str] = ...) -> None: ...

class DestinationsRecord(_message.Message):
    __slots__ = ("source", "order", "picker", "excluded", "prefix_blocks", "ranked")
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    ORDER_FIELD_NUMBER: _ClassVar[int]
    PICKER_FIELD_NUMBER: _ClassVar[int]
    EXCLUDED_FIELD_NUMBER: _ClassVar[int]
    PREFIX_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    RANKED_FIELD_NUMBER: _ClassVar[int]
    source: str
    order: _containers.RepeatedScalarFieldContainer[str]
    picker: _containers.RepeatedScalarFieldContainer[str]
    excluded: _containers.RepeatedCompositeFieldContainer[ExcludedReplica]
    prefix_blocks: int
    ranked: _containers.RepeatedCompositeFieldContainer[RankedReplica]
    def __init__(self, source: _Optional[str] = ..., order: _Optional[_Iterable[str]] = ..., picker: _Optional[_Iterable[str]] = ..., excluded: _Optional[_Iterable[_Union[ExcludedReplica, _Mapping]]] = ..., prefix_blocks: _Optional[int] = ..., ranked: _Optional[_Iterable[_Union[RankedReplica, _Mapping]]] = ...) -> None: ...

class RankedReplica(_message.Message):
    __slots__ = ("replica", "warm_blocks", "in_flight")
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    WARM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    replica: str
    warm_blocks: int
    in_flight: int
    def __init__(self, replica: _Optional[str] = ..., warm_blocks: _Optional[int] = ..., in_flight: _Optional[int] = ...) -> None: ...

class ExcludedReplica(_message.Message):
    __slots__ = ("replica", "why")
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    WHY_FIELD_NUMBER: _ClassVar[int]
    replica: str
    why: str
    def __init__(self, replica: _Optional[str] = ..., why: _Optional[str] = ...) -> None: ...

class AttemptRecord(_message.Message):
    __slots__ = ("attempt", "attempt_id", "replica", "outcome", "detail", "status", "lease", "fence", "chosen_by")
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_ID_FIELD_NUMBER: _ClassVar[int]
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    LEASE_FIELD_NUMBER: _ClassVar[int]
    FENCE_FIELD_NUMBER: _ClassVar[int]
    CHOSEN_BY_FIELD_NUMBER: _ClassVar[int]
    attempt: int
    attempt_id: str
    replica: str
    outcome: str
    detail: str
    status: int
    lease: LeaseRecord
    fence: FenceRecord
    chosen_by: str
    def __init__(self, attempt: _Optional[int] = ..., attempt_id: _Optional[str] = ..., replica: _Optional[str] = ..., outcome: _Optional[str] = ..., detail: _Optional[str] = ..., status: _Optional[int] = ..., lease: _Optional[_Union[LeaseRecord, _Mapping]] = ..., fence: _Optional[_Union[FenceRecord, _Mapping]] = ..., chosen_by: _Optional[str] = ...) -> None: ...

class LeaseRecord(_message.Message):
    __slots__ = ("lease_id", "ttl_seconds", "granted_at", "stopped_at", "revoked_at")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    GRANTED_AT_FIELD_NUMBER: _ClassVar[int]
    STOPPED_AT_FIELD_NUMBER: _ClassVar[int]
    REVOKED_AT_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    ttl_seconds: int
    granted_at: float
    stopped_at: float
    revoked_at: float
    def __init__(self, lease_id: _Optional[str] = ..., ttl_seconds: _Optional[int] = ..., granted_at: _Optional[float] = ..., stopped_at: _Optional[float] = ..., revoked_at: _Optional[float] = ...) -> None: ...

class FenceRecord(_message.Message):
    __slots__ = ("proof", "waited_ms")
    PROOF_FIELD_NUMBER: _ClassVar[int]
    WAITED_MS_FIELD_NUMBER: _ClassVar[int]
    proof: str
    waited_ms: float
    def __init__(self, proof: _Optional[str] = ..., waited_ms: _Optional[float] = ...) -> None: ...

class ToolCallRecord(_message.Message):
    __slots__ = ("key", "events")
    KEY_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    key: str
    events: _containers.RepeatedCompositeFieldContainer[JournalEvent]
    def __init__(self, key: _Optional[str] = ..., events: _Optional[_Iterable[_Union[JournalEvent, _Mapping]]] = ...) -> None: ...

class InputRecord(_message.Message):
    __slots__ = ("route", "digest", "seed", "stream", "estimated_prompt_tokens")
    ROUTE_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STREAM_FIELD_NUMBER: _ClassVar[int]
    ESTIMATED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    route: str
    digest: str
    seed: int
    stream: bool
    estimated_prompt_tokens: int
    def __init__(self, route: _Optional[str] = ..., digest: _Optional[str] = ..., seed: _Optional[int] = ..., stream: _Optional[bool] = ..., estimated_prompt_tokens: _Optional[int] = ...) -> None: ...

class JournalEvent(_message.Message):
    __slots__ = ("t", "event", "attempt", "attempt_id", "replica", "reason", "cause", "detail", "status", "proof", "waited_ms", "delivered_output_tokens", "outcome", "key", "code", "stored", "response_flags", "details", "route", "model", "stream", "seed", "input_digest", "estimated_prompt_tokens", "retry_allowed", "owner", "closed_by", "count", "requested_model")
    T_FIELD_NUMBER: _ClassVar[int]
    EVENT_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_ID_FIELD_NUMBER: _ClassVar[int]
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    CAUSE_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    PROOF_FIELD_NUMBER: _ClassVar[int]
    WAITED_MS_FIELD_NUMBER: _ClassVar[int]
    DELIVERED_OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    STORED_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FLAGS_FIELD_NUMBER: _ClassVar[int]
    DETAILS_FIELD_NUMBER: _ClassVar[int]
    ROUTE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    STREAM_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    INPUT_DIGEST_FIELD_NUMBER: _ClassVar[int]
    ESTIMATED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RETRY_ALLOWED_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    CLOSED_BY_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    REQUESTED_MODEL_FIELD_NUMBER: _ClassVar[int]
    t: float
    event: str
    attempt: int
    attempt_id: str
    replica: str
    reason: str
    cause: str
    detail: str
    status: int
    proof: str
    waited_ms: float
    delivered_output_tokens: int
    outcome: str
    key: str
    code: str
    stored: bool
    response_flags: _containers.RepeatedScalarFieldContainer[str]
    details: str
    route: str
    model: str
    stream: bool
    seed: int
    input_digest: str
    estimated_prompt_tokens: int
    retry_allowed: bool
    owner: str
    closed_by: str
    count: int
    requested_model: str
    def __init__(self, t: _Optional[float] = ..., event: _Optional[str] = ..., attempt: _Optional[int] = ..., attempt_id: _Optional[str] = ..., replica: _Optional[str] = ..., reason: _Optional[str] = ..., cause: _Optional[str] = ..., detail: _Optional[str] = ..., status: _Optional[int] = ..., proof: _Optional[str] = ..., waited_ms: _Optional[float] = ..., delivered_output_tokens: _Optional[int] = ..., outcome: _Optional[str] = ..., key: _Optional[str] = ..., code: _Optional[str] = ..., stored: _Optional[bool] = ..., response_flags: _Optional[_Iterable[str]] = ..., details: _Optional[str] = ..., route: _Optional[str] = ..., model: _Optional[str] = ..., stream: _Optional[bool] = ..., seed: _Optional[int] = ..., input_digest: _Optional[str] = ..., estimated_prompt_tokens: _Optional[int] = ..., retry_allowed: _Optional[bool] = ..., owner: _Optional[str] = ..., closed_by: _Optional[str] = ..., count: _Optional[int] = ..., requested_model: _Optional[str] = ...) -> None: ...

class GatewayErrorBody(_message.Message):
    __slots__ = ("error",)
    ERROR_FIELD_NUMBER: _ClassVar[int]
    error: GatewayError
    def __init__(self, error: _Optional[_Union[GatewayError, _Mapping]] = ...) -> None: ...

class GatewayError(_message.Message):
    __slots__ = ("code", "message", "type", "request_id", "attempts", "partial_output", "retryable", "param")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    TYPE_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ATTEMPTS_FIELD_NUMBER: _ClassVar[int]
    PARTIAL_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    RETRYABLE_FIELD_NUMBER: _ClassVar[int]
    PARAM_FIELD_NUMBER: _ClassVar[int]
    code: str
    message: str
    type: str
    request_id: str
    attempts: _containers.RepeatedCompositeFieldContainer[AttemptRecord]
    partial_output: bool
    retryable: bool
    param: str
    def __init__(self, code: _Optional[str] = ..., message: _Optional[str] = ..., type: _Optional[str] = ..., request_id: _Optional[str] = ..., attempts: _Optional[_Iterable[_Union[AttemptRecord, _Mapping]]] = ..., partial_output: _Optional[bool] = ..., retryable: _Optional[bool] = ..., param: _Optional[str] = ...) -> None: ...

class TerminalFrame(_message.Message):
    __slots__ = ("error",)
    ERROR_FIELD_NUMBER: _ClassVar[int]
    error: TerminalError
    def __init__(self, error: _Optional[_Union[TerminalError, _Mapping]] = ...) -> None: ...

class TerminalError(_message.Message):
    __slots__ = ("code", "message", "request_id", "partial_output", "delivered_output_tokens", "retryable")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PARTIAL_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    DELIVERED_OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RETRYABLE_FIELD_NUMBER: _ClassVar[int]
    code: str
    message: str
    request_id: str
    partial_output: bool
    delivered_output_tokens: int
    retryable: bool
    def __init__(self, code: _Optional[str] = ..., message: _Optional[str] = ..., request_id: _Optional[str] = ..., partial_output: _Optional[bool] = ..., delivered_output_tokens: _Optional[int] = ..., retryable: _Optional[bool] = ...) -> None: ...

class ResponsesFailedEvent(_message.Message):
    __slots__ = ("type", "sequence_number", "response")
    TYPE_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_NUMBER_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    type: str
    sequence_number: int
    response: ResponsesFailedResponse
    def __init__(self, type: _Optional[str] = ..., sequence_number: _Optional[int] = ..., response: _Optional[_Union[ResponsesFailedResponse, _Mapping]] = ...) -> None: ...

class ResponsesFailedResponse(_message.Message):
    __slots__ = ("id", "object", "created_at", "model", "status", "error")
    ID_FIELD_NUMBER: _ClassVar[int]
    OBJECT_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    id: str
    object: str
    created_at: int
    model: str
    status: str
    error: TerminalError
    def __init__(self, id: _Optional[str] = ..., object: _Optional[str] = ..., created_at: _Optional[int] = ..., model: _Optional[str] = ..., status: _Optional[str] = ..., error: _Optional[_Union[TerminalError, _Mapping]] = ...) -> None: ...

class MessagesErrorBody(_message.Message):
    __slots__ = ("type", "error", "request_id")
    TYPE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    type: str
    error: MessagesError
    request_id: str
    def __init__(self, type: _Optional[str] = ..., error: _Optional[_Union[MessagesError, _Mapping]] = ..., request_id: _Optional[str] = ...) -> None: ...

class MessagesError(_message.Message):
    __slots__ = ("type", "message", "code", "details", "request_id", "partial_output", "delivered_output_tokens", "retryable", "attempts", "param")
    TYPE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    DETAILS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PARTIAL_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    DELIVERED_OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RETRYABLE_FIELD_NUMBER: _ClassVar[int]
    ATTEMPTS_FIELD_NUMBER: _ClassVar[int]
    PARAM_FIELD_NUMBER: _ClassVar[int]
    type: str
    message: str
    code: str
    details: MessagesErrorDetails
    request_id: str
    partial_output: bool
    delivered_output_tokens: int
    retryable: bool
    attempts: _containers.RepeatedCompositeFieldContainer[AttemptRecord]
    param: str
    def __init__(self, type: _Optional[str] = ..., message: _Optional[str] = ..., code: _Optional[str] = ..., details: _Optional[_Union[MessagesErrorDetails, _Mapping]] = ..., request_id: _Optional[str] = ..., partial_output: _Optional[bool] = ..., delivered_output_tokens: _Optional[int] = ..., retryable: _Optional[bool] = ..., attempts: _Optional[_Iterable[_Union[AttemptRecord, _Mapping]]] = ..., param: _Optional[str] = ...) -> None: ...

class MessagesErrorDetails(_message.Message):
    __slots__ = ("error_code",)
    ERROR_CODE_FIELD_NUMBER: _ClassVar[int]
    error_code: str
    def __init__(self, error_code: _Optional[str] = ...) -> None: ...

class ReplicaRegistration(_message.Message):
    __slots__ = ("address", "registered_at", "agent_id", "digest", "fingerprint", "engine", "draining")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    REGISTERED_AT_FIELD_NUMBER: _ClassVar[int]
    AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    address: str
    registered_at: float
    agent_id: str
    digest: str
    fingerprint: Fingerprint
    engine: EngineRecord
    draining: bool
    def __init__(self, address: _Optional[str] = ..., registered_at: _Optional[float] = ..., agent_id: _Optional[str] = ..., digest: _Optional[str] = ..., fingerprint: _Optional[_Union[Fingerprint, _Mapping]] = ..., engine: _Optional[_Union[EngineRecord, _Mapping]] = ..., draining: _Optional[bool] = ...) -> None: ...

class Fingerprint(_message.Message):
    __slots__ = ("model_id", "weights_revision", "quantization", "tokenizer_digest", "chat_template_digest", "attention_backend", "kv_cache_dtype", "block_size", "tensor_parallel_size", "pipeline_parallel_size", "lora_adapters", "engine_name", "engine_version")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_REVISION_FIELD_NUMBER: _ClassVar[int]
    QUANTIZATION_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_DIGEST_FIELD_NUMBER: _ClassVar[int]
    CHAT_TEMPLATE_DIGEST_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_BACKEND_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    PIPELINE_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    LORA_ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    ENGINE_NAME_FIELD_NUMBER: _ClassVar[int]
    ENGINE_VERSION_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    weights_revision: str
    quantization: str
    tokenizer_digest: str
    chat_template_digest: str
    attention_backend: str
    kv_cache_dtype: str
    block_size: int
    tensor_parallel_size: int
    pipeline_parallel_size: int
    lora_adapters: _struct_pb2.ListValue
    engine_name: str
    engine_version: str
    def __init__(self, model_id: _Optional[str] = ..., weights_revision: _Optional[str] = ..., quantization: _Optional[str] = ..., tokenizer_digest: _Optional[str] = ..., chat_template_digest: _Optional[str] = ..., attention_backend: _Optional[str] = ..., kv_cache_dtype: _Optional[str] = ..., block_size: _Optional[int] = ..., tensor_parallel_size: _Optional[int] = ..., pipeline_parallel_size: _Optional[int] = ..., lora_adapters: _Optional[_Union[_struct_pb2.ListValue, _Mapping]] = ..., engine_name: _Optional[str] = ..., engine_version: _Optional[str] = ...) -> None: ...

class EngineRecord(_message.Message):
    __slots__ = ("name", "version", "root", "max_model_len", "model_type")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    ROOT_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    MODEL_TYPE_FIELD_NUMBER: _ClassVar[int]
    name: str
    version: str
    root: str
    max_model_len: int
    model_type: str
    def __init__(self, name: _Optional[str] = ..., version: _Optional[str] = ..., root: _Optional[str] = ..., max_model_len: _Optional[int] = ..., model_type: _Optional[str] = ...) -> None: ...

class CancelAck(_message.Message):
    __slots__ = ("attempt_id", "reason", "at")
    ATTEMPT_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    AT_FIELD_NUMBER: _ClassVar[int]
    attempt_id: str
    reason: str
    at: float
    def __init__(self, attempt_id: _Optional[str] = ..., reason: _Optional[str] = ..., at: _Optional[float] = ...) -> None: ...

class AttemptProgress(_message.Message):
    __slots__ = ("bytes", "at")
    BYTES_FIELD_NUMBER: _ClassVar[int]
    AT_FIELD_NUMBER: _ClassVar[int]
    bytes: int
    at: float
    def __init__(self, bytes: _Optional[int] = ..., at: _Optional[float] = ...) -> None: ...

class AttemptHeaders(_message.Message):
    __slots__ = ("request_id", "attempt_id", "attempt_lease", "traceparent")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_ID_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_LEASE_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    attempt_id: str
    attempt_lease: str
    traceparent: str
    def __init__(self, request_id: _Optional[str] = ..., attempt_id: _Optional[str] = ..., attempt_lease: _Optional[str] = ..., traceparent: _Optional[str] = ...) -> None: ...
