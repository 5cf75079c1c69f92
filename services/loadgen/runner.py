"""Runs a workload against a server: Poisson (or burst) arrivals, an optional
concurrency cap, warm-up requests, a progress line."""

from __future__ import annotations

import asyncio
import math
import random
import sys
import time
from dataclasses import dataclass

import aiohttp

from services.loadgen.client import RequestResult, send
from services.loadgen.workload import BenchRequest


@dataclass(frozen=True, slots=True)
class RunConfig:
    base_url: str  # .../v1
    request_rate: float = math.inf  # requests/s; inf: all at once
    max_concurrency: int | None = None
    warmup: int = 1
    api_key: str = ""
    timeout_s: float = 600.0
    seed: int = 0
    progress: bool = True


@dataclass(frozen=True, slots=True)
class RunResult:
    request_rate: float
    duration_s: float
    results: list[RequestResult]


def arrival_times(count: int, rate: float, seed: int) -> list[float]:
    """Seconds from the start at which each request is sent (a Poisson process)."""
    if math.isinf(rate):
        return [0.0] * count
    rng = random.Random(seed)
    times, now = [], 0.0
    for _ in range(count):
        times.append(now)
        now += rng.expovariate(rate)
    return times


async def run(config: RunConfig, requests: list[BenchRequest]) -> RunResult:
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    base = config.base_url.rstrip("/")
    async with aiohttp.ClientSession(
        headers=headers,
        # a deadline on each connect and read, not on a whole (long) generation
        timeout=aiohttp.ClientTimeout(
            total=None, sock_connect=config.timeout_s, sock_read=config.timeout_s
        ),
        connector=aiohttp.TCPConnector(limit=0),  # as many connections as requests in flight
        read_bufsize=1 << 20,  # an event's line may be long (logprobs, a tool call)
    ) as client:
        for request in requests[: config.warmup]:
            await send(client, base + request.path, request, time.perf_counter())
        gate = asyncio.Semaphore(config.max_concurrency or len(requests))
        done: list[RequestResult] = []
        start = time.perf_counter()

        async def one(request: BenchRequest, at: float) -> RequestResult:
            await asyncio.sleep(max(0.0, at - (time.perf_counter() - start)))
            async with gate:
                result = await send(client, base + request.path, request, start)
            done.append(result)
            if config.progress:
                errors = sum(not r.ok for r in done)
                print(
                    f"\r  {len(done)}/{len(requests)} requests done, {errors} errors",
                    end="",
                    file=sys.stderr,
                    flush=True,
                )
            return result

        times = arrival_times(len(requests), config.request_rate, config.seed)
        results = await asyncio.gather(*(one(r, t) for r, t in zip(requests, times, strict=True)))
        duration = time.perf_counter() - start
    if config.progress:
        print(file=sys.stderr)
    return RunResult(config.request_rate, duration, list(results))
