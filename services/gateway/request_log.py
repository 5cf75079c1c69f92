"""One log line per request at its end: what an operator needs to tell why a
request failed or was slow (its id, status, instances, tokens, times, the
error and the component that raised it), never what it said (no prompt, no
image).

The InFlight wrapper (app.py) makes a RequestRecord for each generation
request and logs it when the response ends, whatever ended it; the handlers
and the backend fill it in as they learn.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from typing import Any

logger = logging.getLogger("epd.requests")


@dataclass(slots=True)
class RequestRecord:
    path: str
    request_id: str = "-"
    model: str = "-"
    status: int = 0
    media: int = 0  # images and videos
    prompt_tokens: int = 0
    cached_tokens: int = 0  # of those, the ones whose KV the prefix cache held
    completion_tokens: int = 0
    ttft_ms: float | None = None
    total_ms: float = 0.0
    language: str = "-"  # the instance that generated
    prefix_depth: int = 0  # the chat's messages the broker had sent it before (routing)
    prefix_from: str = ""  # the language instance it was to fetch the chat's KV pages from
    encoder: str = "-"  # the one that encoded (the last, after failovers)
    peer_items: int = 0  # items it was to fetch from other encoders' caches, not encode
    error: str = ""
    component: str = ""  # what raised the error: gateway, broker, an instance
    trace_id: str = ""  # with tracing on: the request's trace (`epd trace` shows it)

    def fields(self) -> dict[str, Any]:
        out = asdict(self)
        if self.ttft_ms is not None:
            out["ttft_ms"] = round(self.ttft_ms, 1)
        out["total_ms"] = round(self.total_ms, 1)
        return out


def log(record: RequestRecord) -> None:
    fields = record.fields()
    text = " ".join(f"{k}={_plain(v)}" for k, v in fields.items() if k != "request_id")
    logger.info("request %s %s", record.request_id, text, extra={"fields": fields})


def _plain(value: Any) -> str:
    if value is None or value == "":
        return "-"
    text = str(value)
    return repr(text) if " " in text else text
