"""One conversion between the dataclasses of messages.py and request.py and
protobuf, driven by the proto descriptors: a dataclass is converted to the
message of its name, field by field (by name); enums by name (`Role.ENCODER`
is ROLE_ENCODER, torch dtypes DTYPE_<name>), repeated fields from and to
tuples, maps from and to sorted tuples of pairs, messages recursively.

Oneofs: a dataclass field named as a oneof holds the member's value, and the
member is picked by the value's type; a message that is nothing but a oneof
named `kind` (ContentPart, the Attach envelopes PeerMessage and BrokerMessage)
has no dataclass: a field of its type holds the member's value directly.

From protobuf, a scalar left at its zero value (proto3 cannot tell it from
unset) takes the dataclass field's default where it has one; an unset message
or optional field is None (or its default). A value that is not valid raises
ValueError naming the field.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from typing import Any, TypeVar

import torch
from google.protobuf.descriptor import Descriptor, EnumDescriptor, FieldDescriptor, OneofDescriptor
from google.protobuf.message import Message

from services.proto import broker_pb2, common_pb2, encoder_pb2, language_pb2
from services.wire import messages, request
from services.wire.dtypes import DTYPE_NAMES, DTYPES_BY_NAME
from services.wire.transport import Transport

T = TypeVar("T")

_PROTO_MODULES = (common_pb2, broker_pb2, encoder_pb2, language_pb2)
_DATACLASSES: dict[str, type] = {
    name: value
    for module in (messages, request)
    for name, value in vars(module).items()
    if isinstance(value, type) and dataclasses.is_dataclass(value)
}
_ENUMS: dict[str, type[enum.Enum]] = {
    "Role": messages.Role,
    "LanguageRole": messages.LanguageRole,
    "Transport": Transport,
    "FinishReason": request.FinishReason,
}
# A oneof's scalar member takes values of this Python type.
_SCALARS = {FieldDescriptor.CPPTYPE_STRING: str}


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
    kind: str  # "scalar", "message", "repeated", "map" or "oneof"
    required: bool  # no dataclass default: proto3's zero value is a value
    presence: bool  # the proto tracks whether it is set (messages, optional scalars)
    zero: Any  # the proto field's default (unset) value
    encode: Callable[[Any], Any]
    decode: Callable[[Any], Any]
    oneof: OneofDescriptor | None = None


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
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        oneof = proto.DESCRIPTOR.oneofs_by_name.get(f.name)
        if oneof is not None:
            fields.append(_Field(f.name, "oneof", required, True, None, _nothing, _nothing, oneof))
            continue
        fd = proto.DESCRIPTOR.fields_by_name[f.name]
        kind = (
            "map"
            if _is_map(fd)
            else "repeated"
            if fd.is_repeated
            else "message"
            if fd.message_type is not None
            else "scalar"
        )
        fields.append(
            _Field(
                f.name,
                kind,
                required,
                fd.has_presence,
                None if fd.is_repeated else fd.default_value,
                _encoder(fd),
                _decoder(fd),
            )
        )
    return proto, tuple(fields)


def _nothing(value: Any) -> Any:
    return value


def _is_map(fd: FieldDescriptor) -> bool:
    return fd.message_type is not None and fd.message_type.GetOptions().map_entry


def _is_envelope(descriptor: Descriptor) -> bool:
    """A message that is only a oneof `kind`: its dataclass is the member's."""
    kind = descriptor.oneofs_by_name.get("kind")
    return kind is not None and len(kind.fields) == len(descriptor.fields)


@cache  # a oneof's member is looked up per value: its coder, once
def _encoder(fd: FieldDescriptor) -> Callable[[Any], Any]:
    if _is_map(fd):
        return dict
    if fd.message_type is not None:
        if _is_envelope(fd.message_type):
            envelope = _proto_class(fd.message_type.name)
            return lambda value: wrap(envelope, value)
        return to_proto
    if fd.enum_type is None:
        return _nothing
    if fd.enum_type.name == "DType":
        return dtype_to_proto
    prefix = _enum_prefix(fd.enum_type)
    return lambda value: prefix + value.name


@cache
def _decoder(fd: FieldDescriptor) -> Callable[[Any], Any]:
    if _is_map(fd):
        return lambda raw: tuple(sorted(raw.items()))
    if fd.message_type is not None:
        if _is_envelope(fd.message_type):
            return unwrap
        cls = _DATACLASSES[fd.message_type.name]
        return lambda raw: from_proto(cls, raw)
    if fd.enum_type is None:
        return _nothing
    if fd.enum_type.name == "DType":
        return dtype_from_proto
    return _enum_decoder(fd.enum_type)


def _enum_prefix(descriptor: EnumDescriptor) -> str:
    """ROLE_ of ROLE_UNSPECIFIED: every proto enum here names its zero so."""
    return descriptor.values_by_number[0].name.removesuffix("UNSPECIFIED")


def _enum_decoder(descriptor: EnumDescriptor) -> Callable[[int], Any]:
    cls, prefix = _ENUMS[descriptor.name], _enum_prefix(descriptor)

    def decode(number: int) -> Any:
        value = descriptor.values_by_number.get(number)
        member = value.name.removeprefix(prefix) if value is not None else ""
        if member not in cls.__members__:
            raise ValueError(f"{number} is not a valid {cls.__name__}")
        return cls[member]

    return decode


def to_proto(value: Any) -> Any:
    """The protobuf message of a messages.py or request.py dataclass."""
    proto, fields = _plan(type(value))
    kwargs = {}
    for f in fields:
        item = getattr(value, f.name)
        if item is None:
            continue
        if f.kind == "oneof":
            assert f.oneof is not None
            member = _member(f.oneof, item)
            kwargs[member.name] = _encoder(member)(item)
        elif f.kind == "repeated":
            kwargs[f.name] = [f.encode(x) for x in item]
        else:
            kwargs[f.name] = f.encode(item)
    return proto(**kwargs)


def from_proto(cls: type[T], pb: Any) -> T:
    """The dataclass `cls` from its protobuf message; ValueError if a value is invalid."""
    _, fields = _plan(cls)
    kwargs = {}
    for f in fields:
        try:
            if f.kind == "oneof":
                if pb.WhichOneof(f.name) is not None:
                    kwargs[f.name] = _unwrap_oneof(pb, f.name)
                elif f.required:
                    raise ValueError("is required")
                continue
            raw = getattr(pb, f.name)
            if f.kind == "repeated":
                kwargs[f.name] = tuple(f.decode(x) for x in raw)
            elif f.kind == "map":
                kwargs[f.name] = f.decode(raw)
            elif f.presence:
                if pb.HasField(f.name):
                    kwargs[f.name] = f.decode(raw)
                elif f.required:
                    raise ValueError("is required")
            elif f.required or raw != f.zero:
                kwargs[f.name] = f.decode(raw)
        except ValueError as exc:
            raise ValueError(f"{pb.DESCRIPTOR.name}.{f.name}: {exc}") from None
    return cls(**kwargs)


def wrap(envelope: type[Message], value: Any) -> Any:
    """An envelope (ContentPart, PeerMessage, BrokerMessage) holding `value` in its oneof."""
    member = _member(envelope.DESCRIPTOR.oneofs_by_name["kind"], value)
    return envelope(**{member.name: _encoder(member)(value)})


def unwrap(envelope: Any) -> Any:
    """The value an envelope holds; ValueError if it holds nothing."""
    if envelope.WhichOneof("kind") is None:
        raise ValueError(f"an empty {envelope.DESCRIPTOR.name}")
    return _unwrap_oneof(envelope, "kind")


def _unwrap_oneof(pb: Any, oneof: str) -> Any:
    member = pb.DESCRIPTOR.fields_by_name[pb.WhichOneof(oneof)]
    return _decoder(member)(getattr(pb, member.name))


def _member(oneof: OneofDescriptor, value: Any) -> FieldDescriptor:
    """The member of a oneof that carries a value of this type."""
    return _members(oneof)[type(value)]


@cache
def _members(oneof: OneofDescriptor) -> dict[type, FieldDescriptor]:
    return {
        _DATACLASSES[fd.message_type.name] if fd.message_type else _SCALARS[fd.cpp_type]: fd
        for fd in oneof.fields
    }


def dtype_to_proto(dtype: torch.dtype) -> str:
    """The DType enum name of a dtype (DTYPE_ and its name in dtypes.py)."""
    return f"DTYPE_{DTYPE_NAMES[dtype].upper()}"


def dtype_from_proto(value: int) -> torch.dtype:
    value_descriptor = common_pb2.DType.DESCRIPTOR.values_by_number.get(value)
    name = value_descriptor.name.removeprefix("DTYPE_").lower() if value_descriptor else ""
    if name not in DTYPES_BY_NAME:
        raise ValueError(f"unknown dtype {value}")
    return DTYPES_BY_NAME[name]
