"""A burst far beyond what the stack runs at once: every request gets its answer
or a fast 429, never a 5xx, and nothing stays allocated afterwards."""

from __future__ import annotations

import concurrent.futures
from collections import Counter

import httpx

from tests.chaos.conftest import Stack, chat_body, wait_for


def test_a_burst_of_64_image_and_64_text_requests(stack: Stack) -> None:
    def one(i: int) -> tuple[str, int]:
        kind = "image" if i % 2 else "text"
        with httpx.Client(timeout=120) as http:
            reply = http.post(stack.url + "/v1/chat/completions", json=chat_body(kind, 10_000 + i))
        if reply.status_code != 200:
            assert reply.status_code == 429, reply.text
            assert reply.headers["retry-after"]
            assert reply.json()["error"]["type"] == "rate_limit_error"
        return kind, reply.status_code

    with concurrent.futures.ThreadPoolExecutor(128) as pool:
        outcomes = Counter(pool.map(one, range(128)))
    assert sum(outcomes.values()) == 128
    assert outcomes[("image", 200)] > 0 and outcomes[("text", 200)] > 0, outcomes
    wait_for(lambda: pools_are_whole(stack), 30, "every pool whole again")


def pools_are_whole(stack: Stack) -> bool:
    """Every KV page and embedding block back, no send buffer held, nothing in flight."""
    for port in stack.language_ports():
        for name in ("epd_language_kv_blocks_used", "epd_language_embedding_blocks_used"):
            if stack.metric(port + 100, name) != 0:
                return False
    for port in stack.encoder_ports():
        if stack.metric(port + 100, "epd_encoder_send_buffer_bytes") != 0:
            return False
    return stack.metric(stack.ports["gateway"], "epd_gateway_in_flight") == 0
