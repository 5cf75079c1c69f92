from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Role(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ROLE_UNSPECIFIED: _ClassVar[Role]
    ROLE_ENCODER: _ClassVar[Role]
    ROLE_LANGUAGE: _ClassVar[Role]

class LanguageRole(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    LANGUAGE_ROLE_UNSPECIFIED: _ClassVar[LanguageRole]
    LANGUAGE_ROLE_BOTH: _ClassVar[LanguageRole]
    LANGUAGE_ROLE_PREFILL: _ClassVar[LanguageRole]
    LANGUAGE_ROLE_DECODE: _ClassVar[LanguageRole]

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    DTYPE_FLOAT32: _ClassVar[DType]
    DTYPE_FLOAT16: _ClassVar[DType]
    DTYPE_BFLOAT16: _ClassVar[DType]

class Transport(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TRANSPORT_UNSPECIFIED: _ClassVar[Transport]
    TRANSPORT_CUDA_IPC: _ClassVar[Transport]
    TRANSPORT_NIXL: _ClassVar[Transport]
    TRANSPORT_SHM: _ClassVar[Transport]
    TRANSPORT_GRPC: _ClassVar[Transport]
ROLE_UNSPECIFIED: Role
ROLE_ENCODER: Role
ROLE_LANGUAGE: Role
LANGUAGE_ROLE_UNSPECIFIED: LanguageRole
LANGUAGE_ROLE_BOTH: LanguageRole
LANGUAGE_ROLE_PREFILL: LanguageRole
LANGUAGE_ROLE_DECODE: LanguageRole
DTYPE_UNSPECIFIED: DType
DTYPE_FLOAT32: DType
DTYPE_FLOAT16: DType
DTYPE_BFLOAT16: DType
TRANSPORT_UNSPECIFIED: Transport
TRANSPORT_CUDA_IPC: Transport
TRANSPORT_NIXL: Transport
TRANSPORT_SHM: Transport
TRANSPORT_GRPC: Transport

class MediaGrid(_message.Message):
    __slots__ = ("t", "h", "w", "second_per_grid_t", "frame_seconds")
    T_FIELD_NUMBER: _ClassVar[int]
    H_FIELD_NUMBER: _ClassVar[int]
    W_FIELD_NUMBER: _ClassVar[int]
    SECOND_PER_GRID_T_FIELD_NUMBER: _ClassVar[int]
    FRAME_SECONDS_FIELD_NUMBER: _ClassVar[int]
    t: int
    h: int
    w: int
    second_per_grid_t: float
    frame_seconds: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, t: _Optional[int] = ..., h: _Optional[int] = ..., w: _Optional[int] = ..., second_per_grid_t: _Optional[float] = ..., frame_seconds: _Optional[_Iterable[float]] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "max_tokens", "seed", "stop", "stop_token_ids", "ignore_eos", "logprobs", "top_logprobs", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens", "logit_bias", "json_schema", "json_object", "n", "structural_tag")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    JSON_OBJECT_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    STRUCTURAL_TAG_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    max_tokens: int
    seed: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    logprobs: bool
    top_logprobs: int
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    min_tokens: int
    logit_bias: _containers.ScalarMap[int, float]
    json_schema: str
    json_object: bool
    n: int
    structural_tag: str
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., max_tokens: _Optional[int] = ..., seed: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., logprobs: _Optional[bool] = ..., top_logprobs: _Optional[int] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., min_tokens: _Optional[int] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., json_schema: _Optional[str] = ..., json_object: _Optional[bool] = ..., n: _Optional[int] = ..., structural_tag: _Optional[str] = ...) -> None: ...

class Plane(_message.Message):
    __slots__ = ("name", "width")
    NAME_FIELD_NUMBER: _ClassVar[int]
    WIDTH_FIELD_NUMBER: _ClassVar[int]
    name: str
    width: int
    def __init__(self, name: _Optional[str] = ..., width: _Optional[int] = ...) -> None: ...

class ShmPool(_message.Message):
    __slots__ = ("segment_names",)
    SEGMENT_NAMES_FIELD_NUMBER: _ClassVar[int]
    segment_names: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, segment_names: _Optional[_Iterable[str]] = ...) -> None: ...

class NixlPool(_message.Message):
    __slots__ = ("agent_name", "agent_metadata", "device_id", "memory_type", "plane_addrs")
    AGENT_NAME_FIELD_NUMBER: _ClassVar[int]
    AGENT_METADATA_FIELD_NUMBER: _ClassVar[int]
    DEVICE_ID_FIELD_NUMBER: _ClassVar[int]
    MEMORY_TYPE_FIELD_NUMBER: _ClassVar[int]
    PLANE_ADDRS_FIELD_NUMBER: _ClassVar[int]
    agent_name: str
    agent_metadata: bytes
    device_id: int
    memory_type: str
    plane_addrs: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, agent_name: _Optional[str] = ..., agent_metadata: _Optional[bytes] = ..., device_id: _Optional[int] = ..., memory_type: _Optional[str] = ..., plane_addrs: _Optional[_Iterable[int]] = ...) -> None: ...

class CudaIpcPool(_message.Message):
    __slots__ = ("device_id", "plane_handles", "pci_bus_id")
    DEVICE_ID_FIELD_NUMBER: _ClassVar[int]
    PLANE_HANDLES_FIELD_NUMBER: _ClassVar[int]
    PCI_BUS_ID_FIELD_NUMBER: _ClassVar[int]
    device_id: int
    plane_handles: _containers.RepeatedScalarFieldContainer[bytes]
    pci_bus_id: str
    def __init__(self, device_id: _Optional[int] = ..., plane_handles: _Optional[_Iterable[bytes]] = ..., pci_bus_id: _Optional[str] = ...) -> None: ...

class GrpcPool(_message.Message):
    __slots__ = ("address",)
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    address: str
    def __init__(self, address: _Optional[str] = ...) -> None: ...

class PoolDescriptor(_message.Message):
    __slots__ = ("num_blocks", "block_size", "dtype", "shm", "nixl", "cuda_ipc", "grpc", "planes")
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHM_FIELD_NUMBER: _ClassVar[int]
    NIXL_FIELD_NUMBER: _ClassVar[int]
    CUDA_IPC_FIELD_NUMBER: _ClassVar[int]
    GRPC_FIELD_NUMBER: _ClassVar[int]
    PLANES_FIELD_NUMBER: _ClassVar[int]
    num_blocks: int
    block_size: int
    dtype: DType
    shm: ShmPool
    nixl: NixlPool
    cuda_ipc: CudaIpcPool
    grpc: GrpcPool
    planes: _containers.RepeatedCompositeFieldContainer[Plane]
    def __init__(self, num_blocks: _Optional[int] = ..., block_size: _Optional[int] = ..., dtype: _Optional[_Union[DType, str]] = ..., shm: _Optional[_Union[ShmPool, _Mapping]] = ..., nixl: _Optional[_Union[NixlPool, _Mapping]] = ..., cuda_ipc: _Optional[_Union[CudaIpcPool, _Mapping]] = ..., grpc: _Optional[_Union[GrpcPool, _Mapping]] = ..., planes: _Optional[_Iterable[_Union[Plane, _Mapping]]] = ...) -> None: ...
