"""The control-plane messages as plain dataclasses, converted to and from
protobuf here and nowhere else (broker, encoder and language all use them)."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from services.model.processor import ImageGrid
from services.proto import broker_pb2, common_pb2
from services.transfer.transport import (
    CudaIpcEndpoint,
    Endpoints,
    GrpcEndpoint,
    NixlEndpoint,
    ShmEndpoint,
    Transport,
)

# Protobuf enums are passed to constructors by name: the generated stubs type
# them as their own int subclasses, which plain ints are not.
_DTYPES: dict[torch.dtype, int] = {
    torch.float32: common_pb2.DTYPE_FLOAT32,
    torch.float16: common_pb2.DTYPE_FLOAT16,
    torch.bfloat16: common_pb2.DTYPE_BFLOAT16,
}
_DTYPES_FROM_PROTO = {v: k for k, v in _DTYPES.items()}


def dtype_to_proto(dtype: torch.dtype) -> str:
    return common_pb2.DType.Name(_DTYPES[dtype])


def transport_to_proto(transport: Transport) -> str:
    return common_pb2.Transport.Name(transport)


def dtype_from_proto(value: int) -> torch.dtype:
    if value not in _DTYPES_FROM_PROTO:
        raise ValueError(f"unknown dtype {value}")
    return _DTYPES_FROM_PROTO[value]


def grids_to_proto(grids: Sequence[ImageGrid]) -> list[common_pb2.ImageGrid]:
    return [common_pb2.ImageGrid(t=g.t, h=g.h, w=g.w) for g in grids]


def grids_from_proto(grids: Sequence[common_pb2.ImageGrid]) -> tuple[ImageGrid, ...]:
    return tuple(ImageGrid(g.t, g.h, g.w) for g in grids)


class Role(enum.IntEnum):
    ENCODER = common_pb2.ROLE_ENCODER
    LANGUAGE = common_pb2.ROLE_LANGUAGE


@dataclass(frozen=True, slots=True)
class PoolInfo:
    """A language instance's receive pool and how to reach it."""

    num_blocks: int
    block_size: int
    hidden_size: int
    deepstack_levels: int
    dtype: torch.dtype
    endpoints: Endpoints

    def to_proto(self) -> common_pb2.PoolDescriptor:
        e = self.endpoints
        endpoints = []
        if e.shm:
            endpoints.append(
                common_pb2.PoolEndpoint(
                    shm=common_pb2.ShmPool(
                        embeddings_name=e.shm.embeddings_name, deepstack_name=e.shm.deepstack_name
                    )
                )
            )
        if e.nixl:
            endpoints.append(
                common_pb2.PoolEndpoint(
                    nixl=common_pb2.NixlPool(
                        agent_name=e.nixl.agent_name,
                        agent_metadata=e.nixl.agent_metadata,
                        embeddings_addr=e.nixl.embeddings_addr,
                        deepstack_addr=e.nixl.deepstack_addr,
                        device_id=e.nixl.device_id,
                        memory_type=e.nixl.memory_type,
                    )
                )
            )
        if e.cuda_ipc:
            endpoints.append(
                common_pb2.PoolEndpoint(
                    cuda_ipc=common_pb2.CudaIpcPool(
                        embeddings_handle=e.cuda_ipc.embeddings_handle,
                        deepstack_handle=e.cuda_ipc.deepstack_handle,
                        device_id=e.cuda_ipc.device_id,
                    )
                )
            )
        if e.grpc:
            endpoints.append(
                common_pb2.PoolEndpoint(grpc=common_pb2.GrpcPool(address=e.grpc.address))
            )
        return common_pb2.PoolDescriptor(
            num_blocks=self.num_blocks,
            block_size=self.block_size,
            hidden_size=self.hidden_size,
            deepstack_levels=self.deepstack_levels,
            dtype=dtype_to_proto(self.dtype),
            endpoints=endpoints,
        )

    @classmethod
    def from_proto(cls, pb: common_pb2.PoolDescriptor) -> PoolInfo:
        shm = nixl = cuda_ipc = grpc = None
        for endpoint in pb.endpoints:
            kind = endpoint.WhichOneof("kind")
            if kind == "shm":
                shm = ShmEndpoint(endpoint.shm.embeddings_name, endpoint.shm.deepstack_name)
            elif kind == "nixl":
                n = endpoint.nixl
                nixl = NixlEndpoint(
                    n.agent_name,
                    n.agent_metadata,
                    n.embeddings_addr,
                    n.deepstack_addr,
                    n.device_id,
                    n.memory_type or "DRAM",
                )
            elif kind == "cuda_ipc":
                c = endpoint.cuda_ipc
                cuda_ipc = CudaIpcEndpoint(c.embeddings_handle, c.deepstack_handle, c.device_id)
            elif kind == "grpc":
                grpc = GrpcEndpoint(endpoint.grpc.address)
        return cls(
            num_blocks=pb.num_blocks,
            block_size=pb.block_size,
            hidden_size=pb.hidden_size,
            deepstack_levels=pb.deepstack_levels,
            dtype=dtype_from_proto(pb.dtype),
            endpoints=Endpoints(shm=shm, nixl=nixl, cuda_ipc=cuda_ipc, grpc=grpc),
        )


@dataclass(frozen=True, slots=True)
class Registration:
    role: Role
    instance_id: str
    grpc_address: str
    host_id: str
    transports: tuple[Transport, ...]
    model: str
    pool: PoolInfo | None = None

    def to_proto(self) -> broker_pb2.Register:
        return broker_pb2.Register(
            role=common_pb2.Role.Name(self.role),
            instance_id=self.instance_id,
            grpc_address=self.grpc_address,
            host_id=self.host_id,
            transports=[transport_to_proto(t) for t in self.transports],
            pool=self.pool.to_proto() if self.pool else None,
            model=self.model,
        )

    @classmethod
    def from_proto(cls, pb: broker_pb2.Register) -> Registration:
        if pb.role not in (common_pb2.ROLE_ENCODER, common_pb2.ROLE_LANGUAGE):
            raise ValueError("Register.role must be ROLE_ENCODER or ROLE_LANGUAGE")
        if not pb.instance_id:
            raise ValueError("Register.instance_id is empty")
        pool = PoolInfo.from_proto(pb.pool) if pb.HasField("pool") else None
        if pb.role == common_pb2.ROLE_LANGUAGE and pool is None:
            raise ValueError("a language instance must register its pool")
        return cls(
            role=Role(pb.role),
            instance_id=pb.instance_id,
            grpc_address=pb.grpc_address,
            host_id=pb.host_id,
            transports=tuple(Transport(t) for t in pb.transports),
            model=pb.model,
            pool=pool,
        )


@dataclass(frozen=True, slots=True)
class Load:
    num_requests: int = 0
    free_blocks: int = 0
    unavailable: bool = False  # cannot take new requests now (e.g. its Triton is down)

    def to_proto(self) -> broker_pb2.Heartbeat:
        return broker_pb2.Heartbeat(
            num_requests=self.num_requests,
            free_blocks=self.free_blocks,
            unavailable=self.unavailable,
        )

    @classmethod
    def from_proto(cls, pb: broker_pb2.Heartbeat) -> Load:
        return cls(pb.num_requests, pb.free_blocks, pb.unavailable)


@dataclass(frozen=True, slots=True)
class EmbeddingMeta:
    request_id: str
    language_instance_id: str
    total_tokens: int
    grids: tuple[ImageGrid, ...]
    hidden_size: int
    dtype: torch.dtype
    deepstack_levels: int = 0
    encoder_instance_id: str = ""
    transport: Transport = Transport.GRPC

    def to_proto(self) -> broker_pb2.EmbeddingMeta:
        return broker_pb2.EmbeddingMeta(
            request_id=self.request_id,
            language_instance_id=self.language_instance_id,
            encoder_instance_id=self.encoder_instance_id,
            total_tokens=self.total_tokens,
            grids=grids_to_proto(self.grids),
            hidden_size=self.hidden_size,
            dtype=dtype_to_proto(self.dtype),
            deepstack_levels=self.deepstack_levels,
            transport=transport_to_proto(self.transport),
        )

    @classmethod
    def from_proto(cls, pb: broker_pb2.EmbeddingMeta) -> EmbeddingMeta:
        return cls(
            request_id=pb.request_id,
            language_instance_id=pb.language_instance_id,
            total_tokens=pb.total_tokens,
            grids=grids_from_proto(pb.grids),
            hidden_size=pb.hidden_size,
            dtype=dtype_from_proto(pb.dtype),
            deepstack_levels=pb.deepstack_levels,
            encoder_instance_id=pb.encoder_instance_id,
            transport=Transport(pb.transport) if pb.transport else Transport.GRPC,
        )


@dataclass(frozen=True, slots=True)
class Prealloc:
    request_id: str
    block_ids: tuple[int, ...]
    allocated_tokens: int
    language_instance_id: str = ""

    def to_proto(self) -> broker_pb2.Prealloc:
        return broker_pb2.Prealloc(
            request_id=self.request_id,
            block_ids=list(self.block_ids),
            allocated_tokens=self.allocated_tokens,
            language_instance_id=self.language_instance_id,
        )

    @classmethod
    def from_proto(cls, pb: broker_pb2.Prealloc) -> Prealloc:
        return cls(pb.request_id, tuple(pb.block_ids), pb.allocated_tokens, pb.language_instance_id)


@dataclass(frozen=True, slots=True)
class TransferDone:
    request_id: str
    sent_tokens: int
    total_tokens: int
    transport: Transport

    @property
    def is_last(self) -> bool:
        return self.sent_tokens >= self.total_tokens

    def to_proto(self) -> broker_pb2.TransferDone:
        return broker_pb2.TransferDone(
            request_id=self.request_id,
            sent_tokens=self.sent_tokens,
            total_tokens=self.total_tokens,
            transport=transport_to_proto(self.transport),
        )

    @classmethod
    def from_proto(cls, pb: broker_pb2.TransferDone) -> TransferDone:
        return cls(pb.request_id, pb.sent_tokens, pb.total_tokens, Transport(pb.transport))


@dataclass(frozen=True, slots=True)
class Resume:
    request_id: str
    block_ids: tuple[int, ...]
    sent_tokens: int
    allocated_tokens: int

    def to_proto(self) -> broker_pb2.Resume:
        return broker_pb2.Resume(
            request_id=self.request_id,
            block_ids=list(self.block_ids),
            sent_tokens=self.sent_tokens,
            allocated_tokens=self.allocated_tokens,
        )

    @classmethod
    def from_proto(cls, pb: broker_pb2.Resume) -> Resume:
        return cls(pb.request_id, tuple(pb.block_ids), pb.sent_tokens, pb.allocated_tokens)


@dataclass(frozen=True, slots=True)
class Abort:
    request_id: str
    reason: str

    def to_proto(self) -> broker_pb2.Abort:
        return broker_pb2.Abort(request_id=self.request_id, reason=self.reason)

    @classmethod
    def from_proto(cls, pb: broker_pb2.Abort) -> Abort:
        return cls(pb.request_id, pb.reason)


@dataclass(frozen=True, slots=True)
class Released:
    """E -> L: no write of E into the request's receive blocks can land any more."""

    request_id: str

    def to_proto(self) -> broker_pb2.Released:
        return broker_pb2.Released(request_id=self.request_id)

    @classmethod
    def from_proto(cls, pb: broker_pb2.Released) -> Released:
        return cls(pb.request_id)


@dataclass(frozen=True, slots=True)
class PeerLost:
    instance_id: str
    request_ids: tuple[str, ...]

    def to_proto(self) -> broker_pb2.PeerLost:
        return broker_pb2.PeerLost(instance_id=self.instance_id, request_ids=list(self.request_ids))

    @classmethod
    def from_proto(cls, pb: broker_pb2.PeerLost) -> PeerLost:
        return cls(pb.instance_id, tuple(pb.request_ids))


@dataclass(frozen=True, slots=True)
class InstanceInfo:
    registration: Registration
    load: Load = field(default_factory=Load)
    seconds_since_heartbeat: float = 0.0

    def to_proto(self) -> broker_pb2.InstanceInfo:
        return broker_pb2.InstanceInfo(
            registration=self.registration.to_proto(),
            load=self.load.to_proto(),
            seconds_since_heartbeat=self.seconds_since_heartbeat,
        )

    @classmethod
    def from_proto(cls, pb: broker_pb2.InstanceInfo) -> InstanceInfo:
        return cls(
            Registration.from_proto(pb.registration),
            Load.from_proto(pb.load),
            pb.seconds_since_heartbeat,
        )


@dataclass(frozen=True, slots=True)
class Registered:
    instance_id: str
    heartbeat_interval_s: float


@dataclass(frozen=True, slots=True)
class InstanceJoined:
    instance: InstanceInfo


PeerMessage = (
    Registration | Load | EmbeddingMeta | Prealloc | TransferDone | Resume | Abort | Released
)
BrokerMessage = (
    Registered
    | EmbeddingMeta
    | Prealloc
    | TransferDone
    | Resume
    | Abort
    | Released
    | PeerLost
    | InstanceJoined
)

_PEER_FIELDS: dict[type, str] = {
    Registration: "register",
    Load: "heartbeat",
    EmbeddingMeta: "meta",
    Prealloc: "prealloc",
    TransferDone: "transfer_done",
    Resume: "resume",
    Abort: "abort",
    Released: "released",
}


def peer_message_to_proto(message: PeerMessage) -> broker_pb2.PeerMessage:
    return broker_pb2.PeerMessage(**{_PEER_FIELDS[type(message)]: message.to_proto()})


def _relayed_from_proto(
    pb: broker_pb2.PeerMessage | broker_pb2.BrokerMessage, kind: str | None
) -> EmbeddingMeta | Prealloc | TransferDone | Resume | Abort | Released:
    if kind == "meta":
        return EmbeddingMeta.from_proto(pb.meta)
    if kind == "prealloc":
        return Prealloc.from_proto(pb.prealloc)
    if kind == "transfer_done":
        return TransferDone.from_proto(pb.transfer_done)
    if kind == "resume":
        return Resume.from_proto(pb.resume)
    if kind == "abort":
        return Abort.from_proto(pb.abort)
    if kind == "released":
        return Released.from_proto(pb.released)
    raise ValueError(f"unexpected message kind {kind!r}")


def peer_message_from_proto(pb: broker_pb2.PeerMessage) -> PeerMessage:
    kind = pb.WhichOneof("kind")
    if kind == "register":
        return Registration.from_proto(pb.register)
    if kind == "heartbeat":
        return Load.from_proto(pb.heartbeat)
    return _relayed_from_proto(pb, kind)


def broker_message_to_proto(message: BrokerMessage) -> broker_pb2.BrokerMessage:
    if isinstance(message, Registered):
        return broker_pb2.BrokerMessage(
            registered=broker_pb2.Registered(
                instance_id=message.instance_id,
                heartbeat_interval_s=message.heartbeat_interval_s,
            )
        )
    if isinstance(message, PeerLost):
        return broker_pb2.BrokerMessage(peer_lost=message.to_proto())
    if isinstance(message, InstanceJoined):
        return broker_pb2.BrokerMessage(
            instance_joined=broker_pb2.InstanceJoined(instance=message.instance.to_proto())
        )
    return broker_pb2.BrokerMessage(**{_PEER_FIELDS[type(message)]: message.to_proto()})


def broker_message_from_proto(pb: broker_pb2.BrokerMessage) -> BrokerMessage:
    kind = pb.WhichOneof("kind")
    if kind == "registered":
        return Registered(pb.registered.instance_id, pb.registered.heartbeat_interval_s)
    if kind == "peer_lost":
        return PeerLost.from_proto(pb.peer_lost)
    if kind == "instance_joined":
        return InstanceJoined(InstanceInfo.from_proto(pb.instance_joined.instance))
    return _relayed_from_proto(pb, kind)
