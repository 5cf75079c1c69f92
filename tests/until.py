"""Waiting in a test for what happens on its own: a condition, polled, with a deadline."""

from __future__ import annotations

import asyncio
from collections.abc import Callable


async def until(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    """Returns once condition() holds; AssertionError after timeout_s."""
    for _ in range(int(timeout_s / 0.02)):
        if condition():
            return
        await asyncio.sleep(0.02)
    assert condition(), f"condition not met within {timeout_s:g}s"
