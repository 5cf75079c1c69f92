"""One conversion between the dataclasses of messages.py and protobuf, driven
by the proto descriptors: a dataclass is converted to the message of its name,
field by field (by name); enums by number (torch dtypes by DTYPE_<name>),
repeated fields from and to tuples, messages recursively, and an Attach
envelope (PeerMessage, BrokerMessage) by the oneof member of the message's type.

From protobuf, a scalar left at its zero value (proto3 cannot tell it from
unset) takes the dataclass field's default where it has one; an unset message
field is None. A value that is not valid raises ValueError naming the field.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any, TypeVar

import torch
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message

from services.proto import broker_pb2, common_pb2
from services.wire import messages
from services.wire.dtypes import DTYPE_NAMES, DTYPES_BY_NAME
from services.wire.transport import Transport

T = TypeVar("T")

_PROTO_MODULES = (common_pb2, broker_pb2)
_DATACLASSES: dict[str, type] = {
    name: value
    for name, value in vars(messages).items()
    if isinstance(value, type) and dataclasses.is_dataclass(value)
}
_ENUMS: dict[str, type[enum.IntEnum]] = {"Role": messages.Role, "Transport": Transport}


def _proto_class(name: str) -> type[Message]:
    for module in _PROTO_MODULES:
        if (cls := getattr(module, name, None)) is not None:
            return cls
    raise TypeError(f"no protobuf message named {name}")


def to_proto(value: Any) -> Any:
    """The protobuf message of a messages.py dataclass."""
    cls = _proto_class(type(value).__name__)
    fields = cls.DESCRIPTOR.fields_by_name
    kwargs = {}
    for f in dataclasses.fields(value):
        fd = fields[f.name]
        item = getattr(value, f.name)
        if item is None:
            continue
        if _is_repeated(fd):
            kwargs[f.name] = [_scalar_to_proto(fd, x) for x in item]
        else:
            kwargs[f.name] = _scalar_to_proto(fd, item)
    return cls(**kwargs)


def _is_repeated(fd: FieldDescriptor) -> bool:
    return bool(fd.is_repeated)


def _scalar_to_proto(fd: FieldDescriptor, value: Any) -> Any:
    if fd.message_type is not None:
        return to_proto(value)
    if fd.enum_type is not None:
        # By name: the generated stubs type enum fields as their own int subclass.
        if fd.enum_type.name == "DType":
            return dtype_to_proto(value)
        return fd.enum_type.values_by_number[int(value)].name
    return value


def from_proto(cls: type[T], pb: Any) -> T:
    """The dataclass `cls` from its protobuf message; ValueError if a value is invalid."""
    descriptor: Descriptor = pb.DESCRIPTOR
    kwargs = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        fd = descriptor.fields_by_name[f.name]
        raw = getattr(pb, f.name)
        has_default = f.default is not dataclasses.MISSING or (
            f.default_factory is not dataclasses.MISSING
        )
        try:
            if _is_repeated(fd):
                kwargs[f.name] = tuple(_scalar_from_proto(fd, x) for x in raw)
            elif fd.message_type is not None:
                if pb.HasField(f.name):
                    kwargs[f.name] = _scalar_from_proto(fd, raw)
                elif not has_default:
                    raise ValueError("is required")
            elif raw != fd.default_value or not has_default:
                kwargs[f.name] = _scalar_from_proto(fd, raw)
        except ValueError as exc:
            raise ValueError(f"{descriptor.name}.{f.name}: {exc}") from None
    return cls(**kwargs)


def _scalar_from_proto(fd: FieldDescriptor, raw: Any) -> Any:
    if fd.message_type is not None:
        return from_proto(_DATACLASSES[fd.message_type.name], raw)
    if fd.enum_type is not None:
        if fd.enum_type.name == "DType":
            return dtype_from_proto(raw)
        return _ENUMS[fd.enum_type.name](raw)
    return raw


def wrap(envelope: type[Message], message: Any) -> Any:
    """An envelope (PeerMessage, BrokerMessage) holding `message` in its oneof."""
    kind = _kinds(envelope.DESCRIPTOR)[type(message).__name__]
    return envelope(**{kind: to_proto(message)})


def unwrap(envelope: Any) -> Any:
    """The dataclass an envelope holds; ValueError if it holds nothing."""
    kind = envelope.WhichOneof("kind")
    if kind is None:
        raise ValueError(f"an empty {envelope.DESCRIPTOR.name}")
    fd = envelope.DESCRIPTOR.fields_by_name[kind]
    return from_proto(_DATACLASSES[fd.message_type.name], getattr(envelope, kind))


def _kinds(descriptor: Descriptor) -> dict[str, str]:
    """Message type name -> the oneof member that carries it."""
    return {fd.message_type.name: fd.name for fd in descriptor.oneofs_by_name["kind"].fields}


def dtype_to_proto(dtype: torch.dtype) -> str:
    """The DType enum name of a dtype (DTYPE_ and its name in dtypes.py)."""
    return f"DTYPE_{DTYPE_NAMES[dtype].upper()}"


def dtype_from_proto(value: int) -> torch.dtype:
    value_descriptor = common_pb2.DType.DESCRIPTOR.values_by_number.get(value)
    name = value_descriptor.name.removeprefix("DTYPE_").lower() if value_descriptor else ""
    if name not in DTYPES_BY_NAME:
        raise ValueError(f"unknown dtype {value}")
    return DTYPES_BY_NAME[name]
