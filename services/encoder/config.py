"""EncoderConfig: an encoder's settings and their defaults (`epd encoder`'s
flags are built from them)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from services.broker.instance import InstanceConfig
from services.media.limits import ImageLimits
from services.runtime.ports import ENCODER_PORT, TRITON_URL
from services.wire.messages import Role
from services.wire.transport import TRANSFER_TIMEOUT_S


@dataclass(frozen=True, slots=True)
class EncoderConfig:
    checkpoint: Path
    model_name: str
    instance: InstanceConfig = field(
        default_factory=lambda: InstanceConfig(Role.ENCODER, ENCODER_PORT)
    )
    triton_url: str = TRITON_URL
    triton_http_url: str = ""  # for traced infers (triton_client.py says why); "": gRPC only
    triton_shared_memory: bool = True
    triton_timeout_s: float = 60.0
    triton_max_in_flight: int = 8
    limits: ImageLimits = field(default_factory=ImageLimits)
    preprocess_workers: int = 2
    cache_bytes: int = 256 * 1024 * 1024
    send_buffer_tokens: int = 65536
    send_block_size: int = 256
    # Admission: beyond max_pending encodes in progress, Encode answers
    # RESOURCE_EXHAUSTED at once; a request waits at most buffer_wait_s for room
    # in the send buffer.
    max_pending: int = 64
    buffer_wait_s: float = 5.0
    transfer_timeout_s: float = TRANSFER_TIMEOUT_S  # waiting for the language side's blocks
    # One write into a language pool. The language side quarantines blocks it
    # gave up on for as long (plus a margin) unless this encoder says Released.
    write_timeout_s: float = 10.0
    triton_check_s: float = 1.0  # how often Triton's readiness is probed
    cache_report_s: float = 0.1  # how often the broker hears what entered and left the cache
    # Each item of a request to Triton on its own and to the language instance as
    # soon as it is encoded (which prefills meanwhile); else all in one batch, sent once.
    items_one_by_one: bool = True
    dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        if self.send_buffer_tokens < self.send_block_size:
            raise ValueError("send_buffer_tokens must hold at least one block")
