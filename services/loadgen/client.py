"""One streamed chat completion against any OpenAI-compatible server, timed.

On aiohttp, as vLLM's own benchmark client (`vllm bench serve`): its C HTTP
parser reads a token's SSE event for ~35 us of CPU, httpx's pure-Python h11 for
~77 (256 streams of 64 events from a local server; a 2-core machine's client
shares the cores with the server it measures)."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import aiohttp

from services.loadgen.workload import BenchRequest


@dataclass(slots=True)
class RequestResult:
    index: int
    kind: str
    start: float  # seconds since the run began
    ok: bool = False
    status: int = 0
    error: str = ""
    ttft: float | None = None  # seconds to the first content
    itls: list[float] = field(default_factory=list)  # seconds between content chunks
    e2e: float = 0.0
    prompt_tokens: int = 0
    output_tokens: int = 0
    text: str = ""  # the content it streamed (a multi-turn workload resends it)

    @property
    def tpot(self) -> float | None:
        """Seconds per output token after the first."""
        if self.ttft is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


async def send(
    session: aiohttp.ClientSession, url: str, request: BenchRequest, run_start: float
) -> RequestResult:
    started = time.perf_counter()
    result = RequestResult(request.index, request.kind, started - run_start)
    chunks = 0
    pieces: list[str] = []
    last = started
    try:
        async with session.post(url, json=request.body) as response:
            result.status = response.status
            if response.status != 200:
                body = (await response.read()).decode(errors="replace")
                result.error = f"HTTP {response.status}: {body[:300]}"
                return result
            async for raw in response.content:  # a line a time
                line = raw.rstrip(b"\r\n")
                if not line.startswith(b"data: "):
                    continue
                payload = line[len(b"data: ") :]
                if payload == b"[DONE]":
                    break
                event = json.loads(payload)
                if "error" in event:
                    result.error = str(event["error"].get("message", event["error"]))
                    return result
                now = time.perf_counter()
                if event.get("usage"):
                    result.prompt_tokens = event["usage"]["prompt_tokens"]
                    result.output_tokens = event["usage"]["completion_tokens"]
                for choice in event.get("choices") or ():
                    # A chat delta's content, or a text completion's text.
                    if piece := (choice.get("delta") or {}).get("content") or choice.get("text"):
                        pieces.append(piece)
                        chunks += 1
                        if result.ttft is None:
                            result.ttft = now - started
                        else:
                            result.itls.append(now - last)
                        last = now
    except (aiohttp.ClientError, TimeoutError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
        return result
    result.e2e = time.perf_counter() - started
    result.text = "".join(pieces)
    if not result.output_tokens:
        result.output_tokens = chunks  # a server that sends no usage: one token a chunk
    result.ok = True
    return result
