"""The control-plane messages as plain dataclasses.

Each is named as its protobuf message in protos/epd/v1/ and has the same
field names (convert.py relies on both); a field is a Python value (a
torch.dtype, an enum, a tuple, another of these dataclasses) where the proto
has an enum, a repeated field or a message.
"""

from __future__ import annotations

import enum
import hashlib
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import TypeVar

import torch

from services.proto import common_pb2
from services.wire.transport import PREFERENCE, Transport


class Role(enum.IntEnum):
    ENCODER = common_pb2.ROLE_ENCODER
    LANGUAGE = common_pb2.ROLE_LANGUAGE


class LanguageRole(enum.IntEnum):
    """What a language instance does with a request: both steps, or one of E/P/D's."""

    BOTH = common_pb2.LANGUAGE_ROLE_BOTH
    PREFILL = common_pb2.LANGUAGE_ROLE_PREFILL
    DECODE = common_pb2.LANGUAGE_ROLE_DECODE

    @property
    def takes_requests(self) -> bool:
        """Requests start here (an encoder's embeddings come here): not a decode instance."""
        return self is not LanguageRole.DECODE


# A request's KV transfer (E/P/D: prefill to decode instance) goes by this id,
# beside the embedding transfer (encoder to prefill instance) of the same request.
KV_TRANSFER_SUFFIX = "/kv"


def kv_transfer_id(request_id: str) -> str:
    return request_id + KV_TRANSFER_SUFFIX


def is_kv_transfer(transfer_id: str) -> bool:
    return transfer_id.endswith(KV_TRANSFER_SUFFIX)


@dataclass(frozen=True, slots=True)
class MediaGrid:
    """An image's or a video's patch grid (temporal, height, width) before the
    spatial merge; a video's also says how many seconds a temporal patch spans
    and, for Qwen3-VL, each temporal patch's timestamp."""

    t: int
    h: int
    w: int
    second_per_grid_t: float = 0.0  # 0: an image
    frame_seconds: tuple[float, ...] = ()

    @property
    def is_video(self) -> bool:
        return self.second_per_grid_t > 0

    def num_tokens(self, merge_size: int) -> int:
        return self.t * self.h * self.w // (merge_size * merge_size)

    @property
    def num_patches(self) -> int:
        return self.t * self.h * self.w


@dataclass(frozen=True, slots=True)
class Plane:
    """One per-token tensor of a pool or a transfer: `width` values a token.
    Planes are listed embeddings first; per-plane data follows that order."""

    name: str
    width: int

    def __str__(self) -> str:
        return f"{self.name}[{self.width}]"


# How an encoder reaches a language instance's pool, one per transport; the
# per-plane fields follow the pool's planes.


@dataclass(frozen=True, slots=True)
class ShmPool:
    segment_names: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class NixlPool:
    agent_name: str
    agent_metadata: bytes
    plane_addrs: tuple[int, ...]
    device_id: int = 0
    memory_type: str = "DRAM"


@dataclass(frozen=True, slots=True)
class CudaIpcPool:
    plane_handles: tuple[bytes, ...]
    device_id: int = 0  # the receiver's own index
    pci_bus_id: str = ""  # the same GPU in the writer's numbering (empty: device_id)


@dataclass(frozen=True, slots=True)
class GrpcPool:
    address: str


PoolEndpoint = ShmPool | NixlPool | CudaIpcPool | GrpcPool
E = TypeVar("E", ShmPool, NixlPool, CudaIpcPool, GrpcPool)


@dataclass(frozen=True, slots=True)
class PoolDescriptor:
    """A language instance's receive pool (a decode instance's: its KV cache) and
    how to reach it (None: not offered)."""

    num_blocks: int
    block_size: int
    planes: tuple[Plane, ...]
    dtype: torch.dtype
    shm: ShmPool | None = None
    nixl: NixlPool | None = None
    cuda_ipc: CudaIpcPool | None = None
    grpc: GrpcPool | None = None

    def endpoint(self, transport: Transport) -> PoolEndpoint | None:
        return {
            Transport.SHM: self.shm,
            Transport.NIXL: self.nixl,
            Transport.CUDA_IPC: self.cuda_ipc,
            Transport.GRPC: self.grpc,
        }[transport]

    @property
    def transports(self) -> tuple[Transport, ...]:
        return tuple(t for t in PREFERENCE if self.endpoint(t) is not None)

    def reached_by(self, endpoints: Iterable[PoolEndpoint]) -> PoolDescriptor:
        """This pool with these endpoints (one of each kind at most)."""
        found = list(endpoints)
        return replace(
            self,
            shm=_one(found, ShmPool),
            nixl=_one(found, NixlPool),
            cuda_ipc=_one(found, CudaIpcPool),
            grpc=_one(found, GrpcPool),
        )


def _one(endpoints: list[PoolEndpoint], kind: type[E]) -> E | None:
    matching = [e for e in endpoints if isinstance(e, kind)]
    if len(matching) > 1:
        raise ValueError(f"more than one {kind.__name__} endpoint")
    return matching[0] if matching else None


@dataclass(frozen=True, slots=True)
class Register:
    role: Role
    instance_id: str
    grpc_address: str
    host_id: str
    transports: tuple[Transport, ...]
    model: str
    pool: PoolDescriptor | None = None
    language_role: LanguageRole = LanguageRole.BOTH

    def __post_init__(self) -> None:
        if not self.instance_id:
            raise ValueError("Register.instance_id is empty")
        if self.role == Role.LANGUAGE and self.pool is None:
            raise ValueError("a language instance must register its pool")


@dataclass(frozen=True, slots=True)
class Heartbeat:
    num_requests: int = 0
    free_blocks: int = 0
    unavailable: bool = False  # cannot take new requests now (e.g. its Triton is down)
    # encoders: their embedding cache (lookups and hits since start) and their work
    cached_items: int = 0
    cache_lookups: int = 0
    cache_hits: int = 0
    queue_depth: int = 0  # encodes in progress
    encode_seconds: float = 0.0  # recent mean of an encode's time
    max_requests: int = 0  # language instances: what they admit at once


def media_key(data: bytes, salt: str = "") -> str:
    """An image's or a video's content hash, as the client sent its bytes, within
    the client's cache scope (`salt`, OpenAI's cache_salt): the encoders'
    embedding-cache key, what the gateway routes by and what the prefix cache
    knows the item's KV by. Under another salt the same bytes are another item."""
    scope = hashlib.sha256(salt.encode()).digest() if salt else b""  # BLAKE2's key
    return hashlib.blake2b(data, digest_size=20, key=scope).hexdigest()


@dataclass(frozen=True, slots=True)
class CacheReport:
    """E -> broker: what entered and left its embedding cache since its last
    report; `full`: the whole cache, replacing what the broker knew."""

    added: tuple[str, ...] = ()
    evicted: tuple[str, ...] = ()
    full: bool = False


@dataclass(frozen=True, slots=True)
class EmbeddingMeta:
    request_id: str
    language_instance_id: str
    total_tokens: int
    grids: tuple[MediaGrid, ...]
    planes: tuple[Plane, ...]
    dtype: torch.dtype
    encoder_instance_id: str = ""
    transport: Transport = Transport.GRPC

    @property
    def sender_id(self) -> str:
        return self.encoder_instance_id

    @property
    def target_id(self) -> str:
        return self.language_instance_id

    def relayed_from(self, sender_id: str) -> EmbeddingMeta:
        return replace(self, encoder_instance_id=sender_id)


@dataclass(frozen=True, slots=True)
class FirstToken:
    """A choice's first token, sampled by the prefill instance (E/P/D)."""

    token_id: int
    logprob: float | None = None
    top_ids: tuple[int, ...] = ()
    top_logprobs: tuple[float, ...] = ()
    generator_state: bytes = b""


@dataclass(frozen=True, slots=True)
class KvMeta:
    """P -> D: a request's prompt is prefilled; its KV pages are ready to go.
    As a transfer it is an EmbeddingMeta's twin: planes of tokens, the prefill
    instance as the sender and the decode instance as the receiver."""

    request_id: str  # the transfer's: kv_transfer_id(the request's)
    decode_instance_id: str
    total_tokens: int
    planes: tuple[Plane, ...]
    dtype: torch.dtype
    page_size: int
    prompt_token_ids: tuple[int, ...]
    first_tokens: tuple[FirstToken, ...]
    mrope_delta: int = 0
    prefill_instance_id: str = ""
    transport: Transport = Transport.GRPC

    @property
    def sender_id(self) -> str:
        return self.prefill_instance_id

    @property
    def target_id(self) -> str:
        return self.decode_instance_id

    def relayed_from(self, sender_id: str) -> KvMeta:
        return replace(self, prefill_instance_id=sender_id)


# What a transfer's sender announces first.
TransferMeta = EmbeddingMeta | KvMeta


@dataclass(frozen=True, slots=True)
class Prealloc:
    request_id: str
    block_ids: tuple[int, ...]
    allocated_tokens: int
    language_instance_id: str = ""
    # tokens from the first that are not wanted (the prefix cache holds their KV)
    skip_tokens: int = 0


@dataclass(frozen=True, slots=True)
class TransferDone:
    request_id: str
    sent_tokens: int
    total_tokens: int
    transport: Transport

    @property
    def is_last(self) -> bool:
        return self.sent_tokens >= self.total_tokens


@dataclass(frozen=True, slots=True)
class Resume:
    request_id: str
    block_ids: tuple[int, ...]
    sent_tokens: int
    allocated_tokens: int


@dataclass(frozen=True, slots=True)
class Abort:
    request_id: str
    reason: str


@dataclass(frozen=True, slots=True)
class Released:
    """E -> L: no write of E into the request's receive blocks can land any more."""

    request_id: str


@dataclass(frozen=True, slots=True)
class PeerLost:
    instance_id: str
    request_ids: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Registered:
    instance_id: str
    heartbeat_interval_s: float


@dataclass(frozen=True, slots=True)
class InstanceInfo:
    registration: Register
    load: Heartbeat = field(default_factory=Heartbeat)
    seconds_since_heartbeat: float = 0.0


@dataclass(frozen=True, slots=True)
class InstanceJoined:
    instance: InstanceInfo


# -- routing: the gateway asks the broker where a request runs (broker.proto) ------


@dataclass(frozen=True, slots=True)
class RouteRequest:
    """A request to place. A failover names what failed: `failed_encoder_id` (its
    encoder failed before any embedding landed: it stays on `language_id`) or
    `failed_language_id` (its language instance failed before producing anything)."""

    request_id: str
    model: str = ""  # empty: any
    needs_encoder: bool = False  # false for text-only requests
    language_id: str = ""
    failed_encoder_id: str = ""
    failed_language_id: str = ""
    media_hashes: tuple[str, ...] = ()  # each item's content hash, in prompt order
    prefix_hashes: tuple[str, ...] = ()  # a chat's prefixes, shortest first (prefix_hashes())


@dataclass(frozen=True, slots=True)
class RouteReply:
    """Where it runs: a language instance, an encoder for its media (and the
    transport between them), and under E/P/D the decode instance that takes it
    from the prefill instance `language_id`."""

    language_id: str
    language_address: str
    encoder_id: str = ""
    encoder_address: str = ""
    transport: Transport | None = None
    decode_id: str = ""
    decode_address: str = ""
    prefix_depth: int = 0  # how many of the prefix hashes the language instance was sent before
    # per media hash: another encoder that holds (or is encoding) the item, "" for none
    holder_ids: tuple[str, ...] = ()
    holder_addresses: tuple[str, ...] = ()
    # another language instance sent a longer prefix of the chat: the pages move from it
    prefix_holder_id: str = ""
    prefix_holder_address: str = ""
    prefix_holder_depth: int = 0


# What an instance sends on its Attach stream, and what the broker sends back.
PeerMessage = (
    Register
    | Heartbeat
    | EmbeddingMeta
    | KvMeta
    | Prealloc
    | TransferDone
    | Resume
    | Abort
    | Released
    | CacheReport
)
BrokerMessage = (
    Registered
    | EmbeddingMeta
    | KvMeta
    | Prealloc
    | TransferDone
    | Resume
    | Abort
    | Released
    | PeerLost
    | InstanceJoined
)
