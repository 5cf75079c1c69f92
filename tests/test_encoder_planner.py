"""`epd serve --encoders auto` as a user runs it: the planner starts a second
encoder while image requests keep the first one busy (an encode-time target no
encode meets makes any image work pressure), and retires it once image work
has stopped, while text requests go on; every request succeeds throughout."""

from __future__ import annotations

import base64
import json
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from services.loadgen.synthetic import encode_image, random_image
from tests.processes import served

MODEL = "demo-tiny"
FLAGS = (
    *("--encoders", "auto", "--min-encoders", "1", "--max-encoders", "2"),
    *("--encode-latency-target", "0.0001", "--scale-up-after", "1"),
    *("--scale-down-after", "3", "--scale-cooldown", "2"),
)


def encoders(url: str) -> list[str]:
    with urllib.request.urlopen(url + "/health", timeout=10) as reply:
        components = json.load(reply)["components"]
    return sorted(
        name for name, c in components.items() if c["role"] == "encoder" and c["state"] == "serving"
    )


def wait_for(condition: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"not within {timeout_s:.0f}s: {what}"
        time.sleep(0.5)


@contextmanager
def requests(url: str, images: bool) -> Iterator[list[int]]:
    """Two clients sending one request after another (each image new) until the
    block ends: the statuses."""
    statuses: list[int] = []
    stop = threading.Event()

    def client(worker: int) -> None:
        n = 0
        with httpx.Client(timeout=60) as http:
            while not stop.is_set():
                n += 1
                content: list[dict[str, object]] = [{"type": "text", "text": "Describe it."}]
                if images:
                    data = encode_image(random_image(64, 48, seed=worker * 10_000 + n))
                    data_url = "data:image/png;base64," + base64.b64encode(data).decode()
                    content.insert(0, {"type": "image_url", "image_url": {"url": data_url}})
                reply = http.post(
                    url + "/v1/chat/completions",
                    json={
                        "model": MODEL,
                        "max_tokens": 4,
                        "messages": [{"role": "user", "content": content}],
                    },
                )
                statuses.append(reply.status_code)

    threads = [threading.Thread(target=client, args=(w,), daemon=True) for w in range(2)]
    for thread in threads:
        thread.start()
    try:
        yield statuses
    finally:
        stop.set()
        for thread in threads:
            thread.join(60)


def test_the_planner_adds_an_encoder_under_image_work_and_retires_it_after(
    tiny_checkpoint: Path, tmp_path: Path
) -> None:
    with served(tiny_checkpoint, MODEL, tmp_path, *FLAGS) as url:
        assert encoders(url) == ["encoder-0"]
        with requests(url, images=True) as with_images:
            wait_for(lambda: encoders(url) == ["encoder-0", "encoder-1"], 90, "a second encoder")
            time.sleep(2)  # both serve images
        with requests(url, images=False) as text_only:
            wait_for(lambda: encoders(url) == ["encoder-0"], 90, "the second one retired")
            time.sleep(1)
        assert with_images and set(with_images) == {200}
        assert text_only and set(text_only) == {200}
