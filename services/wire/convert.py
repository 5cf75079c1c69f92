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
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
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


@cache
def _proto_class(name: str) -> type[Message]:
    for module in _PROTO_MODULES:
        if (cls := getattr(module, name, None)) is not None:
            return cls
    raise TypeError(f"no protobuf message named {name}")


@dataclass(frozen=True, slots=True)
class _Field:
    """How one dataclass field crosses, worked out once per class."""

    name: str
    repeated: bool
    message: bool
    required: bool  # no dataclass default: proto3's zero value is a value
    zero: Any  # the proto field's default (unset) value
    encode: Callable[[Any], Any]
    decode: Callable[[Any], Any]


Plan = tuple[type[Message], tuple[_Field, ...]]
_PLANS: dict[type, Plan] = {}


def _plan(cls: type) -> Plan:
    plan = _PLANS.get(cls)
    if plan is None:
        plan = _PLANS[cls] = _make_plan(cls)
    return plan


def _make_plan(cls: type) -> Plan:
    proto = _proto_class(cls.__name__)
    fields = []
    for f in dataclasses.fields(cls):
        fd = proto.DESCRIPTOR.fields_by_name[f.name]
        has_default = f.default is not dataclasses.MISSING or (
            f.default_factory is not dataclasses.MISSING
        )
        fields.append(
            _Field(
                f.name,
                bool(fd.is_repeated),
                fd.message_type is not None,
                not has_default,
                fd.default_value if not fd.is_repeated else None,
                _encoder(fd),
                _decoder(fd),
            )
        )
    return proto, tuple(fields)


def _encoder(fd: FieldDescriptor) -> Callable[[Any], Any]:
    if fd.message_type is not None:
        return to_proto
    if fd.enum_type is None:
        return lambda value: value
    if fd.enum_type.name == "DType":
        return dtype_to_proto
    # By name: the generated stubs type enum fields as their own int subclass.
    names = {number: value.name for number, value in fd.enum_type.values_by_number.items()}
    return lambda value: names[int(value)]


def _decoder(fd: FieldDescriptor) -> Callable[[Any], Any]:
    if fd.message_type is not None:
        cls = _DATACLASSES[fd.message_type.name]
        return lambda raw: from_proto(cls, raw)
    if fd.enum_type is None:
        return lambda raw: raw
    if fd.enum_type.name == "DType":
        return dtype_from_proto
    return _ENUMS[fd.enum_type.name]


def to_proto(value: Any) -> Any:
    """The protobuf message of a messages.py dataclass."""
    proto, fields = _plan(type(value))
    kwargs = {}
    for f in fields:
        item = getattr(value, f.name)
        if item is None:
            continue
        kwargs[f.name] = [f.encode(x) for x in item] if f.repeated else f.encode(item)
    return proto(**kwargs)


def from_proto(cls: type[T], pb: Any) -> T:
    """The dataclass `cls` from its protobuf message; ValueError if a value is invalid."""
    _, fields = _plan(cls)
    kwargs = {}
    for f in fields:
        raw = getattr(pb, f.name)
        try:
            if f.repeated:
                kwargs[f.name] = tuple(f.decode(x) for x in raw)
            elif f.message:
                if pb.HasField(f.name):
                    kwargs[f.name] = f.decode(raw)
                elif f.required:
                    raise ValueError("is required")
            elif f.required or raw != f.zero:
                kwargs[f.name] = f.decode(raw)
        except ValueError as exc:
            raise ValueError(f"{pb.DESCRIPTOR.name}.{f.name}: {exc}") from None
    return cls(**kwargs)


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


@cache
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
