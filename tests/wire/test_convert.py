"""The generic conversion: every control-plane dataclass to protobuf bytes and back."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from services.proto import broker_pb2, common_pb2
from services.wire import messages
from services.wire.convert import from_proto, to_proto, unwrap, wrap
from services.wire.messages import (
    Abort,
    CudaIpcPool,
    EmbeddingMeta,
    GrpcPool,
    Heartbeat,
    InstanceInfo,
    InstanceJoined,
    MediaGrid,
    NixlPool,
    PeerLost,
    Plane,
    PoolDescriptor,
    Prealloc,
    Register,
    Registered,
    Released,
    Resume,
    Role,
    ShmPool,
    TransferDone,
)
from services.wire.transport import Transport

POOL = PoolDescriptor(
    64,
    256,
    (Plane("embeddings", 2048), Plane("deepstack", 3 * 2048)),
    torch.bfloat16,
    shm=ShmPool(("epd_e", "epd_d")),
    nixl=NixlPool("agent", b"\x00meta", (1 << 40, 1 << 41), 1, "VRAM"),
    cuda_ipc=CudaIpcPool((b"handle", b"deep"), 2),
    grpc=GrpcPool("10.0.0.2:50071"),
)
LANGUAGE = Register(
    Role.LANGUAGE, "language-0", "10.0.0.2:50071", "node-1", POOL.transports, "m", POOL
)
META = EmbeddingMeta(
    "r1", "language-0", 120, (MediaGrid(1, 10, 12), MediaGrid(2, 4, 4)), POOL.planes,
    torch.float16, "encoder-1", Transport.NIXL,
)  # fmt: skip
PEER = [
    LANGUAGE,
    Register(Role.ENCODER, "encoder-1", "e:1", "node-1", (Transport.SHM,), "m"),
    Heartbeat(3, 17, True),
    META,
    Prealloc("r1", (4, 9, 2), 768, "language-0"),
    TransferDone("r1", 100, 120, Transport.SHM),
    Resume("r1", (5,), 100, 256),
    Abort("r1", "the client left"),
    Released("r1"),
]
BROKER = [
    Registered("language-0", 1.5),
    META,
    Prealloc("r1", (4,), 256),
    TransferDone("r1", 120, 120, Transport.GRPC),
    Resume("r1", (1, 2), 5, 512),
    Abort("r1", "timeout"),
    Released("r1"),
    PeerLost("encoder-1", ("r1", "r2")),
    InstanceJoined(InstanceInfo(LANGUAGE, Heartbeat(1, 2), 0.25)),
]


def _through_bytes(message: Any) -> Any:
    pb = to_proto(message)
    return from_proto(type(message), type(pb).FromString(pb.SerializeToString()))


@pytest.mark.parametrize("message", [*PEER, *BROKER, POOL], ids=lambda m: type(m).__name__)
def test_every_message_survives_the_wire(message: Any) -> None:
    assert _through_bytes(message) == message


@pytest.mark.parametrize("message", PEER, ids=lambda m: type(m).__name__)
def test_peer_envelope(message: Any) -> None:
    pb = wrap(broker_pb2.PeerMessage, message)
    assert unwrap(broker_pb2.PeerMessage.FromString(pb.SerializeToString())) == message


@pytest.mark.parametrize("message", BROKER, ids=lambda m: type(m).__name__)
def test_broker_envelope(message: Any) -> None:
    pb = wrap(broker_pb2.BrokerMessage, message)
    assert unwrap(broker_pb2.BrokerMessage.FromString(pb.SerializeToString())) == message


def test_every_dataclass_is_named_and_shaped_as_its_proto() -> None:
    for value in vars(messages).values():
        if not (isinstance(value, type) and dataclasses.is_dataclass(value)):
            continue
        pb = getattr(broker_pb2, value.__name__, None) or getattr(common_pb2, value.__name__)
        names = {f.name for f in dataclasses.fields(value)}
        assert names <= set(pb.DESCRIPTOR.fields_by_name), value.__name__


def test_zero_values_take_the_dataclass_default() -> None:
    meta = from_proto(
        EmbeddingMeta, broker_pb2.EmbeddingMeta(request_id="r", dtype="DTYPE_FLOAT32")
    )
    assert meta.transport == Transport.GRPC and meta.encoder_instance_id == ""
    assert from_proto(NixlPool, common_pb2.NixlPool(agent_name="a")).memory_type == "DRAM"
    pool = from_proto(PoolDescriptor, common_pb2.PoolDescriptor(dtype="DTYPE_FLOAT32"))
    assert pool.shm is None and pool.transports == ()


@pytest.mark.parametrize(
    ("cls", "pb", "error"),
    [
        (Register, broker_pb2.Register(instance_id="x"), "Register.role: 0 is not a valid Role"),
        (Register, broker_pb2.Register(role="ROLE_ENCODER"), "Register.instance_id is empty"),
        (
            Register,
            broker_pb2.Register(role="ROLE_LANGUAGE", instance_id="l"),
            "must register its pool",
        ),
        (PoolDescriptor, common_pb2.PoolDescriptor(), "PoolDescriptor.dtype: unknown dtype 0"),
        (TransferDone, broker_pb2.TransferDone(transport=9), "TransferDone.transport"),
    ],
)
def test_invalid_values_name_the_field(cls: type, pb: Any, error: str) -> None:
    with pytest.raises(ValueError, match=error):
        from_proto(cls, pb)


def test_an_empty_envelope_is_refused() -> None:
    with pytest.raises(ValueError, match="an empty PeerMessage"):
        unwrap(broker_pb2.PeerMessage())
