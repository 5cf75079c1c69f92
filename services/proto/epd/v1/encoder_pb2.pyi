from epd.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class EncodeRequest(_message.Message):
    __slots__ = ("request_id", "images", "language_instance_id", "video_indices", "held_items", "cache_salt", "peer_addresses")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    LANGUAGE_INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    VIDEO_INDICES_FIELD_NUMBER: _ClassVar[int]
    HELD_ITEMS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    PEER_ADDRESSES_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    images: _containers.RepeatedScalarFieldContainer[bytes]
    language_instance_id: str
    video_indices: _containers.RepeatedScalarFieldContainer[int]
    held_items: int
    cache_salt: str
    peer_addresses: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, request_id: _Optional[str] = ..., images: _Optional[_Iterable[bytes]] = ..., language_instance_id: _Optional[str] = ..., video_indices: _Optional[_Iterable[int]] = ..., held_items: _Optional[int] = ..., cache_salt: _Optional[str] = ..., peer_addresses: _Optional[_Iterable[str]] = ...) -> None: ...

class EncodeReply(_message.Message):
    __slots__ = ("request_id", "total_tokens", "grids", "dtype", "cached_images", "planes", "data")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOTAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GRIDS_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    CACHED_IMAGES_FIELD_NUMBER: _ClassVar[int]
    PLANES_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    total_tokens: int
    grids: _containers.RepeatedCompositeFieldContainer[_common_pb2.MediaGrid]
    dtype: _common_pb2.DType
    cached_images: int
    planes: _containers.RepeatedCompositeFieldContainer[_common_pb2.Plane]
    data: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, request_id: _Optional[str] = ..., total_tokens: _Optional[int] = ..., grids: _Optional[_Iterable[_Union[_common_pb2.MediaGrid, _Mapping]]] = ..., dtype: _Optional[_Union[_common_pb2.DType, str]] = ..., cached_images: _Optional[int] = ..., planes: _Optional[_Iterable[_Union[_common_pb2.Plane, _Mapping]]] = ..., data: _Optional[_Iterable[bytes]] = ...) -> None: ...

class FetchRequest(_message.Message):
    __slots__ = ("key",)
    KEY_FIELD_NUMBER: _ClassVar[int]
    key: str
    def __init__(self, key: _Optional[str] = ...) -> None: ...

class FetchReply(_message.Message):
    __slots__ = ("grid", "dtype", "widths", "data")
    GRID_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    WIDTHS_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    grid: _common_pb2.MediaGrid
    dtype: _common_pb2.DType
    widths: _containers.RepeatedScalarFieldContainer[int]
    data: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, grid: _Optional[_Union[_common_pb2.MediaGrid, _Mapping]] = ..., dtype: _Optional[_Union[_common_pb2.DType, str]] = ..., widths: _Optional[_Iterable[int]] = ..., data: _Optional[_Iterable[bytes]] = ...) -> None: ...
