from epd.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Register(_message.Message):
    __slots__ = ("role", "instance_id", "grpc_address", "host_id", "transports", "pool", "model", "language_role")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    GRPC_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    TRANSPORTS_FIELD_NUMBER: _ClassVar[int]
    POOL_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    LANGUAGE_ROLE_FIELD_NUMBER: _ClassVar[int]
    role: _common_pb2.Role
    instance_id: str
    grpc_address: str
    host_id: str
    transports: _containers.RepeatedScalarFieldContainer[_common_pb2.Transport]
    pool: _common_pb2.PoolDescriptor
    model: str
    language_role: _common_pb2.LanguageRole
    def __init__(self, role: _Optional[_Union[_common_pb2.Role, str]] = ..., instance_id: _Optional[str] = ..., grpc_address: _Optional[str] = ..., host_id: _Optional[str] = ..., transports: _Optional[_Iterable[_Union[_common_pb2.Transport, str]]] = ..., pool: _Optional[_Union[_common_pb2.PoolDescriptor, _Mapping]] = ..., model: _Optional[str] = ..., language_role: _Optional[_Union[_common_pb2.LanguageRole, str]] = ...) -> None: ...

class Heartbeat(_message.Message):
    __slots__ = ("num_requests", "free_blocks", "unavailable", "cached_items", "cache_lookups", "cache_hits", "queue_depth", "encode_seconds", "max_requests")
    NUM_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    UNAVAILABLE_FIELD_NUMBER: _ClassVar[int]
    CACHED_ITEMS_FIELD_NUMBER: _ClassVar[int]
    CACHE_LOOKUPS_FIELD_NUMBER: _ClassVar[int]
    CACHE_HITS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_DEPTH_FIELD_NUMBER: _ClassVar[int]
    ENCODE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    MAX_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    num_requests: int
    free_blocks: int
    unavailable: bool
    cached_items: int
    cache_lookups: int
    cache_hits: int
    queue_depth: int
    encode_seconds: float
    max_requests: int
    def __init__(self, num_requests: _Optional[int] = ..., free_blocks: _Optional[int] = ..., unavailable: _Optional[bool] = ..., cached_items: _Optional[int] = ..., cache_lookups: _Optional[int] = ..., cache_hits: _Optional[int] = ..., queue_depth: _Optional[int] = ..., encode_seconds: _Optional[float] = ..., max_requests: _Optional[int] = ...) -> None: ...

class CacheReport(_message.Message):
    __slots__ = ("added", "evicted", "full")
    ADDED_FIELD_NUMBER: _ClassVar[int]
    EVICTED_FIELD_NUMBER: _ClassVar[int]
    FULL_FIELD_NUMBER: _ClassVar[int]
    added: _containers.RepeatedScalarFieldContainer[str]
    evicted: _containers.RepeatedScalarFieldContainer[str]
    full: bool
    def __init__(self, added: _Optional[_Iterable[str]] = ..., evicted: _Optional[_Iterable[str]] = ..., full: _Optional[bool] = ...) -> None: ...

class EmbeddingMeta(_message.Message):
    __slots__ = ("request_id", "language_instance_id", "encoder_instance_id", "total_tokens", "grids", "dtype", "transport", "planes")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    LANGUAGE_INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    ENCODER_INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    TOTAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GRIDS_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    PLANES_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    language_instance_id: str
    encoder_instance_id: str
    total_tokens: int
    grids: _containers.RepeatedCompositeFieldContainer[_common_pb2.MediaGrid]
    dtype: _common_pb2.DType
    transport: _common_pb2.Transport
    planes: _containers.RepeatedCompositeFieldContainer[_common_pb2.Plane]
    def __init__(self, request_id: _Optional[str] = ..., language_instance_id: _Optional[str] = ..., encoder_instance_id: _Optional[str] = ..., total_tokens: _Optional[int] = ..., grids: _Optional[_Iterable[_Union[_common_pb2.MediaGrid, _Mapping]]] = ..., dtype: _Optional[_Union[_common_pb2.DType, str]] = ..., transport: _Optional[_Union[_common_pb2.Transport, str]] = ..., planes: _Optional[_Iterable[_Union[_common_pb2.Plane, _Mapping]]] = ...) -> None: ...

class KvMeta(_message.Message):
    __slots__ = ("request_id", "decode_instance_id", "prefill_instance_id", "total_tokens", "planes", "dtype", "transport", "page_size", "prompt_token_ids", "mrope_delta", "first_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    DECODE_INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    PREFILL_INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    TOTAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PLANES_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MROPE_DELTA_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    decode_instance_id: str
    prefill_instance_id: str
    total_tokens: int
    planes: _containers.RepeatedCompositeFieldContainer[_common_pb2.Plane]
    dtype: _common_pb2.DType
    transport: _common_pb2.Transport
    page_size: int
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    mrope_delta: int
    first_tokens: _containers.RepeatedCompositeFieldContainer[FirstToken]
    def __init__(self, request_id: _Optional[str] = ..., decode_instance_id: _Optional[str] = ..., prefill_instance_id: _Optional[str] = ..., total_tokens: _Optional[int] = ..., planes: _Optional[_Iterable[_Union[_common_pb2.Plane, _Mapping]]] = ..., dtype: _Optional[_Union[_common_pb2.DType, str]] = ..., transport: _Optional[_Union[_common_pb2.Transport, str]] = ..., page_size: _Optional[int] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., mrope_delta: _Optional[int] = ..., first_tokens: _Optional[_Iterable[_Union[FirstToken, _Mapping]]] = ...) -> None: ...

class FirstToken(_message.Message):
    __slots__ = ("token_id", "logprob", "top_ids", "top_logprobs", "generator_state")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    GENERATOR_STATE_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    top_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    generator_state: bytes
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., top_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ..., generator_state: _Optional[bytes] = ...) -> None: ...

class Prealloc(_message.Message):
    __slots__ = ("request_id", "block_ids", "allocated_tokens", "language_instance_id", "skip_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    ALLOCATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LANGUAGE_INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    SKIP_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    allocated_tokens: int
    language_instance_id: str
    skip_tokens: int
    def __init__(self, request_id: _Optional[str] = ..., block_ids: _Optional[_Iterable[int]] = ..., allocated_tokens: _Optional[int] = ..., language_instance_id: _Optional[str] = ..., skip_tokens: _Optional[int] = ...) -> None: ...

class TransferDone(_message.Message):
    __slots__ = ("request_id", "sent_tokens", "total_tokens", "transport")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SENT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    sent_tokens: int
    total_tokens: int
    transport: _common_pb2.Transport
    def __init__(self, request_id: _Optional[str] = ..., sent_tokens: _Optional[int] = ..., total_tokens: _Optional[int] = ..., transport: _Optional[_Union[_common_pb2.Transport, str]] = ...) -> None: ...

class Resume(_message.Message):
    __slots__ = ("request_id", "block_ids", "sent_tokens", "allocated_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    SENT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ALLOCATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    sent_tokens: int
    allocated_tokens: int
    def __init__(self, request_id: _Optional[str] = ..., block_ids: _Optional[_Iterable[int]] = ..., sent_tokens: _Optional[int] = ..., allocated_tokens: _Optional[int] = ...) -> None: ...

class Abort(_message.Message):
    __slots__ = ("request_id", "reason")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    reason: str
    def __init__(self, request_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class Released(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class Registered(_message.Message):
    __slots__ = ("instance_id", "heartbeat_interval_s")
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    heartbeat_interval_s: float
    def __init__(self, instance_id: _Optional[str] = ..., heartbeat_interval_s: _Optional[float] = ...) -> None: ...

class InstanceJoined(_message.Message):
    __slots__ = ("instance",)
    INSTANCE_FIELD_NUMBER: _ClassVar[int]
    instance: InstanceInfo
    def __init__(self, instance: _Optional[_Union[InstanceInfo, _Mapping]] = ...) -> None: ...

class PeerLost(_message.Message):
    __slots__ = ("instance_id", "request_ids")
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, instance_id: _Optional[str] = ..., request_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class PeerMessage(_message.Message):
    __slots__ = ("register", "heartbeat", "meta", "prealloc", "transfer_done", "resume", "abort", "released", "kv_meta", "cache_report")
    REGISTER_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    META_FIELD_NUMBER: _ClassVar[int]
    PREALLOC_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_DONE_FIELD_NUMBER: _ClassVar[int]
    RESUME_FIELD_NUMBER: _ClassVar[int]
    ABORT_FIELD_NUMBER: _ClassVar[int]
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    KV_META_FIELD_NUMBER: _ClassVar[int]
    CACHE_REPORT_FIELD_NUMBER: _ClassVar[int]
    register: Register
    heartbeat: Heartbeat
    meta: EmbeddingMeta
    prealloc: Prealloc
    transfer_done: TransferDone
    resume: Resume
    abort: Abort
    released: Released
    kv_meta: KvMeta
    cache_report: CacheReport
    def __init__(self, register: _Optional[_Union[Register, _Mapping]] = ..., heartbeat: _Optional[_Union[Heartbeat, _Mapping]] = ..., meta: _Optional[_Union[EmbeddingMeta, _Mapping]] = ..., prealloc: _Optional[_Union[Prealloc, _Mapping]] = ..., transfer_done: _Optional[_Union[TransferDone, _Mapping]] = ..., resume: _Optional[_Union[Resume, _Mapping]] = ..., abort: _Optional[_Union[Abort, _Mapping]] = ..., released: _Optional[_Union[Released, _Mapping]] = ..., kv_meta: _Optional[_Union[KvMeta, _Mapping]] = ..., cache_report: _Optional[_Union[CacheReport, _Mapping]] = ...) -> None: ...

class BrokerMessage(_message.Message):
    __slots__ = ("registered", "meta", "prealloc", "transfer_done", "resume", "abort", "peer_lost", "instance_joined", "released", "kv_meta")
    REGISTERED_FIELD_NUMBER: _ClassVar[int]
    META_FIELD_NUMBER: _ClassVar[int]
    PREALLOC_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_DONE_FIELD_NUMBER: _ClassVar[int]
    RESUME_FIELD_NUMBER: _ClassVar[int]
    ABORT_FIELD_NUMBER: _ClassVar[int]
    PEER_LOST_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_JOINED_FIELD_NUMBER: _ClassVar[int]
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    KV_META_FIELD_NUMBER: _ClassVar[int]
    registered: Registered
    meta: EmbeddingMeta
    prealloc: Prealloc
    transfer_done: TransferDone
    resume: Resume
    abort: Abort
    peer_lost: PeerLost
    instance_joined: InstanceJoined
    released: Released
    kv_meta: KvMeta
    def __init__(self, registered: _Optional[_Union[Registered, _Mapping]] = ..., meta: _Optional[_Union[EmbeddingMeta, _Mapping]] = ..., prealloc: _Optional[_Union[Prealloc, _Mapping]] = ..., transfer_done: _Optional[_Union[TransferDone, _Mapping]] = ..., resume: _Optional[_Union[Resume, _Mapping]] = ..., abort: _Optional[_Union[Abort, _Mapping]] = ..., peer_lost: _Optional[_Union[PeerLost, _Mapping]] = ..., instance_joined: _Optional[_Union[InstanceJoined, _Mapping]] = ..., released: _Optional[_Union[Released, _Mapping]] = ..., kv_meta: _Optional[_Union[KvMeta, _Mapping]] = ...) -> None: ...

class InstanceInfo(_message.Message):
    __slots__ = ("registration", "load", "seconds_since_heartbeat")
    REGISTRATION_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    SECONDS_SINCE_HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    registration: Register
    load: Heartbeat
    seconds_since_heartbeat: float
    def __init__(self, registration: _Optional[_Union[Register, _Mapping]] = ..., load: _Optional[_Union[Heartbeat, _Mapping]] = ..., seconds_since_heartbeat: _Optional[float] = ...) -> None: ...

class RouteRequest(_message.Message):
    __slots__ = ("request_id", "model", "needs_encoder", "language_id", "failed_encoder_id", "failed_language_id", "media_hashes", "prefix_hashes")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    NEEDS_ENCODER_FIELD_NUMBER: _ClassVar[int]
    LANGUAGE_ID_FIELD_NUMBER: _ClassVar[int]
    FAILED_ENCODER_ID_FIELD_NUMBER: _ClassVar[int]
    FAILED_LANGUAGE_ID_FIELD_NUMBER: _ClassVar[int]
    MEDIA_HASHES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HASHES_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    model: str
    needs_encoder: bool
    language_id: str
    failed_encoder_id: str
    failed_language_id: str
    media_hashes: _containers.RepeatedScalarFieldContainer[str]
    prefix_hashes: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, request_id: _Optional[str] = ..., model: _Optional[str] = ..., needs_encoder: _Optional[bool] = ..., language_id: _Optional[str] = ..., failed_encoder_id: _Optional[str] = ..., failed_language_id: _Optional[str] = ..., media_hashes: _Optional[_Iterable[str]] = ..., prefix_hashes: _Optional[_Iterable[str]] = ...) -> None: ...

class RouteReply(_message.Message):
    __slots__ = ("encoder_id", "encoder_address", "language_id", "language_address", "transport", "decode_id", "decode_address", "prefix_depth", "holder_ids", "holder_addresses", "prefix_holder_id", "prefix_holder_address", "prefix_holder_depth")
    ENCODER_ID_FIELD_NUMBER: _ClassVar[int]
    ENCODER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    LANGUAGE_ID_FIELD_NUMBER: _ClassVar[int]
    LANGUAGE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    DECODE_ID_FIELD_NUMBER: _ClassVar[int]
    DECODE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_DEPTH_FIELD_NUMBER: _ClassVar[int]
    HOLDER_IDS_FIELD_NUMBER: _ClassVar[int]
    HOLDER_ADDRESSES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HOLDER_ID_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HOLDER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HOLDER_DEPTH_FIELD_NUMBER: _ClassVar[int]
    encoder_id: str
    encoder_address: str
    language_id: str
    language_address: str
    transport: _common_pb2.Transport
    decode_id: str
    decode_address: str
    prefix_depth: int
    holder_ids: _containers.RepeatedScalarFieldContainer[str]
    holder_addresses: _containers.RepeatedScalarFieldContainer[str]
    prefix_holder_id: str
    prefix_holder_address: str
    prefix_holder_depth: int
    def __init__(self, encoder_id: _Optional[str] = ..., encoder_address: _Optional[str] = ..., language_id: _Optional[str] = ..., language_address: _Optional[str] = ..., transport: _Optional[_Union[_common_pb2.Transport, str]] = ..., decode_id: _Optional[str] = ..., decode_address: _Optional[str] = ..., prefix_depth: _Optional[int] = ..., holder_ids: _Optional[_Iterable[str]] = ..., holder_addresses: _Optional[_Iterable[str]] = ..., prefix_holder_id: _Optional[str] = ..., prefix_holder_address: _Optional[str] = ..., prefix_holder_depth: _Optional[int] = ...) -> None: ...

class ListInstancesRequest(_message.Message):
    __slots__ = ("role",)
    ROLE_FIELD_NUMBER: _ClassVar[int]
    role: _common_pb2.Role
    def __init__(self, role: _Optional[_Union[_common_pb2.Role, str]] = ...) -> None: ...

class ListInstancesReply(_message.Message):
    __slots__ = ("instances", "routed_with_media", "routed_text")
    INSTANCES_FIELD_NUMBER: _ClassVar[int]
    ROUTED_WITH_MEDIA_FIELD_NUMBER: _ClassVar[int]
    ROUTED_TEXT_FIELD_NUMBER: _ClassVar[int]
    instances: _containers.RepeatedCompositeFieldContainer[InstanceInfo]
    routed_with_media: int
    routed_text: int
    def __init__(self, instances: _Optional[_Iterable[_Union[InstanceInfo, _Mapping]]] = ..., routed_with_media: _Optional[int] = ..., routed_text: _Optional[int] = ...) -> None: ...

class DescribeRequestRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class RequestDescription(_message.Message):
    __slots__ = ("request_id", "phase", "encoder_id", "language_id", "has_meta", "has_prealloc", "sent_tokens", "total_tokens", "num_resumes", "abort_reason", "age_s", "num_failovers")
    class Phase(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        PHASE_UNSPECIFIED: _ClassVar[RequestDescription.Phase]
        PHASE_ROUTED: _ClassVar[RequestDescription.Phase]
        PHASE_WAITING: _ClassVar[RequestDescription.Phase]
        PHASE_TRANSFERRING: _ClassVar[RequestDescription.Phase]
        PHASE_DONE: _ClassVar[RequestDescription.Phase]
        PHASE_ABORTED: _ClassVar[RequestDescription.Phase]
    PHASE_UNSPECIFIED: RequestDescription.Phase
    PHASE_ROUTED: RequestDescription.Phase
    PHASE_WAITING: RequestDescription.Phase
    PHASE_TRANSFERRING: RequestDescription.Phase
    PHASE_DONE: RequestDescription.Phase
    PHASE_ABORTED: RequestDescription.Phase
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    ENCODER_ID_FIELD_NUMBER: _ClassVar[int]
    LANGUAGE_ID_FIELD_NUMBER: _ClassVar[int]
    HAS_META_FIELD_NUMBER: _ClassVar[int]
    HAS_PREALLOC_FIELD_NUMBER: _ClassVar[int]
    SENT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_RESUMES_FIELD_NUMBER: _ClassVar[int]
    ABORT_REASON_FIELD_NUMBER: _ClassVar[int]
    AGE_S_FIELD_NUMBER: _ClassVar[int]
    NUM_FAILOVERS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    phase: RequestDescription.Phase
    encoder_id: str
    language_id: str
    has_meta: bool
    has_prealloc: bool
    sent_tokens: int
    total_tokens: int
    num_resumes: int
    abort_reason: str
    age_s: float
    num_failovers: int
    def __init__(self, request_id: _Optional[str] = ..., phase: _Optional[_Union[RequestDescription.Phase, str]] = ..., encoder_id: _Optional[str] = ..., language_id: _Optional[str] = ..., has_meta: _Optional[bool] = ..., has_prealloc: _Optional[bool] = ..., sent_tokens: _Optional[int] = ..., total_tokens: _Optional[int] = ..., num_resumes: _Optional[int] = ..., abort_reason: _Optional[str] = ..., age_s: _Optional[float] = ..., num_failovers: _Optional[int] = ...) -> None: ...
