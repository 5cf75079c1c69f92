from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class RecentSpansRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class RecentSpansReply(_message.Message):
    __slots__ = ("traces", "tracing")
    TRACES_FIELD_NUMBER: _ClassVar[int]
    TRACING_FIELD_NUMBER: _ClassVar[int]
    traces: bytes
    tracing: bool
    def __init__(self, traces: _Optional[bytes] = ..., tracing: _Optional[bool] = ...) -> None: ...
