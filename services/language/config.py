"""LanguageConfig: a language instance's settings and their defaults (`epd
language`'s flags are built from them, and from its EngineConfig's)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from services.broker.instance import InstanceConfig
from services.language.engine.config import EngineConfig
from services.runtime.ports import LANGUAGE_PORT
from services.transfer.receiver import DEFAULT_ALLOCATE_TOKENS
from services.wire.messages import LanguageRole, Role
from services.wire.transport import TRANSFER_TIMEOUT_S


@dataclass(frozen=True, slots=True)
class LanguageConfig:
    checkpoint: Path
    model_name: str
    chat_template: Path | None = None  # in place of the checkpoint's (vLLM's --chat-template)
    instance: InstanceConfig = field(
        default_factory=lambda: InstanceConfig(Role.LANGUAGE, LANGUAGE_PORT)
    )
    embedding_pool_tokens: int = 32768
    embedding_block_size: int = 256
    default_allocate_tokens: int = DEFAULT_ALLOCATE_TOKENS
    transfer_timeout_s: float = TRANSFER_TIMEOUT_S
    # Admission: beyond this many requests in flight, Generate answers
    # RESOURCE_EXHAUSTED at once; a request waits at most pool_wait_s for receive blocks.
    max_active_requests: int = 256
    pool_wait_s: float = 5.0
    # Blocks given up while an encoder may still write them stay out of use until
    # it says Released, or this long: more than the encoders' write timeout.
    quarantine_s: float = 15.0
    engine: EngineConfig = field(default_factory=EngineConfig)
    # E/P/D: prefill and decode as their own instances (both: one does both)
    role: LanguageRole = LanguageRole.BOTH
    # The engine loop in a child process (EngineProcess), out of reach of the
    # GIL that gRPC's threads take; else on a thread of this one (AsyncEngine).
    # Prefill and decode instances hand KV pages over from the engine's own
    # cache, so theirs stays here.
    engine_process: bool = False
    # A request's prompt prefilled up to its first image whose embeddings are
    # still missing while they arrive (needs the gateway's grid hints); else
    # only once all are here.
    prefill_while_encoding: bool = True

    def __post_init__(self) -> None:
        if self.embedding_pool_tokens < self.embedding_block_size:
            raise ValueError("embedding_pool_tokens must hold at least one block")
        if self.engine_process and self.role is not LanguageRole.BOTH:
            raise ValueError("a prefill or decode instance runs its engine in its own process")

    @property
    def dtype(self) -> torch.dtype:
        return self.engine.dtype
