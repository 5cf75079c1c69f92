"""GatewayConfig: the gateway's settings and their defaults (`epd gateway`'s
flags are built from them)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from services.media.limits import ImageLimits
from services.runtime.ports import GATEWAY_PORT


@dataclass(frozen=True, slots=True)
class FetchPolicy:
    """How the gateway fetches an http(s) image or video URL."""

    timeout_s: float = 10.0
    allow_private: bool = False  # loopback, private and link-local addresses
    max_redirects: int = 3


@dataclass(frozen=True, slots=True)
class GatewayConfig:
    broker: str
    checkpoint: Path | None = None  # for token hints: its preprocessor_config.json
    host: str = "127.0.0.1"
    port: int = GATEWAY_PORT
    api_key: str = ""
    limits: ImageLimits = field(default_factory=ImageLimits)
    fetch: FetchPolicy = field(default_factory=FetchPolicy)
    generate_timeout_s: float = 900.0
    encode_timeout_s: float = 60.0
    # Answered 503 with Retry-After, not 404, while no instance serves them.
    served_models: tuple[str, ...] = ()
    max_concurrent_requests: int = 512  # beyond: 429 with Retry-After
    max_body_bytes: int = 64 * 1024 * 1024  # beyond: 413
    # The Responses API's stored responses: the oldest go first beyond this, or at this age.
    responses_store_bytes: int = 256 * 1024 * 1024
    responses_ttl_s: float = 3600.0
