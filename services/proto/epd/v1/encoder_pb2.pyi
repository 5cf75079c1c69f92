from epd.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class EncodeRequest(_message.Message):
    __slots__ = ("request_id", "images", "language_instance_id")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    LANGUAGE_INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    images: _containers.RepeatedScalarFieldContainer[bytes]
    language_instance_id: str
    def __init__(self, request_id: _Optional[str] = ..., images: _Optional[_Iterable[bytes]] = ..., language_instance_id: _Optional[str] = ...) -> None: ...

class EncodeReply(_message.Message):
    __slots__ = ("request_id", "total_tokens", "grids", "hidden_size", "dtype", "deepstack_levels", "cached_images", "embeddings", "deepstack")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOTAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GRIDS_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DEEPSTACK_LEVELS_FIELD_NUMBER: _ClassVar[int]
    CACHED_IMAGES_FIELD_NUMBER: _ClassVar[int]
    EMBEDDINGS_FIELD_NUMBER: _ClassVar[int]
    DEEPSTACK_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    total_tokens: int
    grids: _containers.RepeatedCompositeFieldContainer[_common_pb2.ImageGrid]
    hidden_size: int
    dtype: _common_pb2.DType
    deepstack_levels: int
    cached_images: int
    embeddings: bytes
    deepstack: bytes
    def __init__(self, request_id: _Optional[str] = ..., total_tokens: _Optional[int] = ..., grids: _Optional[_Iterable[_Union[_common_pb2.ImageGrid, _Mapping]]] = ..., hidden_size: _Optional[int] = ..., dtype: _Optional[_Union[_common_pb2.DType, str]] = ..., deepstack_levels: _Optional[int] = ..., cached_images: _Optional[int] = ..., embeddings: _Optional[bytes] = ..., deepstack: _Optional[bytes] = ...) -> None: ...
