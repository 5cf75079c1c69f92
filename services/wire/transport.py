"""Transport kinds, their order of preference, and the choice per instance pair."""

from __future__ import annotations

import enum

from services.proto import common_pb2

# A transfer that makes no progress this long fails, on the encoder's side and
# the language side; the broker's rendezvous waits as long for a request's
# other half. Each service's config takes it as its default.
TRANSFER_TIMEOUT_S = 30.0


class Transport(enum.IntEnum):
    """Values match epd.v1.Transport. Lower is preferred."""

    CUDA_IPC = common_pb2.TRANSPORT_CUDA_IPC
    NIXL = common_pb2.TRANSPORT_NIXL
    SHM = common_pb2.TRANSPORT_SHM
    GRPC = common_pb2.TRANSPORT_GRPC

    @property
    def same_host_only(self) -> bool:
        return self in (Transport.CUDA_IPC, Transport.SHM)

    @classmethod
    def parse(cls, name: str) -> Transport:
        try:
            return cls[name.strip().upper()]
        except KeyError:
            raise ValueError(
                f"unknown transport {name!r}; choose from {', '.join(t.name.lower() for t in cls)}"
            ) from None


# Same host: copy through shared memory (CPU) or an IPC handle (GPU); NIXL is
# for crossing hosts (RDMA), and gRPC works anywhere.
PREFERENCE = (Transport.CUDA_IPC, Transport.SHM, Transport.NIXL, Transport.GRPC)


def choose_transport(
    sender_transports: tuple[Transport, ...],
    sender_host: str,
    receiver_transports: tuple[Transport, ...],
    receiver_host: str,
) -> Transport | None:
    """The most preferred transport both sides have and their locality allows."""
    for transport in PREFERENCE:
        if transport not in sender_transports or transport not in receiver_transports:
            continue
        if transport.same_host_only and sender_host != receiver_host:
            continue
        return transport
    return None
