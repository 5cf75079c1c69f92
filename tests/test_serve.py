"""`epd serve` as a user runs it: a subprocess on real ports, driven with the
official openai client; Ctrl-C must leave nothing behind."""

from __future__ import annotations

import base64
import concurrent.futures
import io
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai import OpenAI
from PIL import Image

from services.launcher.serve import launch
from services.loadgen.synthetic import encode_image, random_image
from services.model.processor import load_image_processor
from services.model.spec import load_spec
from services.model.tokenizer import load_tokenizer
from services.runtime import env
from services.runtime.ports import free_serve_ports, serve_port_args
from services.transfer.shared_memory import SHM_DIR
from tests.bad_images import png_header_only
from tests.processes import family
from tests.reference import chat, hf_greedy
from tests.reflection import grpcurl

MODEL = "demo-tiny"
SHM_PREFIX = "epdserve_"


@dataclass
class Served:
    process: subprocess.Popen[str]
    url: str
    ports: dict[str, int]
    banner: str
    segments: list[str]  # its shared memory as it came up

    @property
    def openai(self) -> OpenAI:
        return OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0, timeout=120)

    def language_metric(self, name: str) -> float:
        port = self.ports["language-port"] + 100
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        line = next(line for line in text.splitlines() if line.startswith(name + " "))
        return float(line.split()[-1])


def _our_processes(marker: str) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if marker in cmdline:
            pids.append(int(entry.name))
    return pids


@pytest.fixture(scope="module")
def served(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    ports = free_serve_ports()
    banner: list[str] = []
    process = launch(
        [
            "--model",
            str(tiny_checkpoint),
            "--model-name",
            MODEL,
            *serve_port_args(ports),
            "--max-model-len",
            "512",
            "--kv-cache-mb",
            "64",
            "--log-dir",
            str(tmp_path_factory.mktemp("logs")),
        ],
        banner=banner,
        env={
            **{k: v for k, v in os.environ.items() if k != env.CLUSTER_TOKEN.name},
            env.SHM_PREFIX.name: SHM_PREFIX,  # this stack's segments, apart from the tests'
        },
    )
    url = f"http://127.0.0.1:{ports['port']}"
    segments = [p.name for p in SHM_DIR.glob(SHM_PREFIX + "*")]
    served = Served(process, url, ports, "".join(banner), segments)
    yield served
    if process.poll() is None:
        process.send_signal(signal.SIGINT)
        process.wait(60)


def image_url(image: Image.Image) -> str:
    return "data:image/png;base64," + base64.b64encode(encode_image(image)).decode()


@pytest.mark.parametrize("num_images", [0, 1, 2])
@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_completions_equal_hf_generate(
    served: Served, tiny_checkpoint: Path, num_images: int, stream: bool
) -> None:
    check_completion(served.openai, tiny_checkpoint, num_images, stream)


def check_completion(client: OpenAI, tiny_checkpoint: Path, num_images: int, stream: bool) -> None:
    """A greedy chat completion with `num_images` images equals HF generate(), and
    its usage counts the prompt's tokens (image tokens included) and the output's."""
    images = [random_image(180 + 60 * i, 150 + 30 * i, seed=70 + i) for i in range(num_images)]
    text = "Describe what you see." if num_images else "Say something nice."
    content: list[dict[str, Any]] = [
        {"type": "image_url", "image_url": {"url": image_url(i)}} for i in images
    ]
    content.append({"type": "text", "text": text})
    decoded = [Image.open(io.BytesIO(encode_image(i))).convert("RGB") for i in images]
    expected = hf_greedy(tiny_checkpoint, chat(text, num_images), decoded, 20)
    expected_text = load_tokenizer(tiny_checkpoint).decode(expected, skip_special_tokens=True)
    kwargs: dict[str, Any] = {
        "model": MODEL,
        "max_tokens": 20,
        "temperature": 0,
        "messages": [{"role": "user", "content": content}],
    }
    if stream:
        chunks = list(
            client.chat.completions.create(
                stream=True, stream_options={"include_usage": True}, **kwargs
            )
        )
        got = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        usage = chunks[-1].usage
    else:
        reply = client.chat.completions.create(**kwargs)
        got, usage = reply.choices[0].message.content, reply.usage
    assert got == expected_text
    assert usage is not None and usage.completion_tokens == len(expected)
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    tokenizer = load_tokenizer(tiny_checkpoint)
    prompt = tokenizer.apply_chat_template(
        chat(text, num_images), tokenize=False, add_generation_prompt=True
    )
    image_tokens = 0
    if decoded:
        grids = load_image_processor(tiny_checkpoint)(images=decoded, return_tensors="pt")[
            "image_grid_thw"
        ]
        image_tokens = int(grids.prod(-1).sum()) // 4
    assert usage.prompt_tokens == len(tokenizer(prompt)["input_ids"]) - num_images + image_tokens


PENALTIES = {
    "repetition and bias": (
        {"repetition_penalty": 1.5, "logit_bias": {"40": 3.0, "41": -100.0}},
        {"repetition_penalty": 1.5, "sequence_bias": {(40,): 3.0, (41,): -100.0}},
    ),
    # EOS pushed up by 100: the request stops right after min_tokens.
    "min_tokens against a biased EOS": (
        {"min_tokens": 6, "logit_bias": {"EOS": 100.0}},
        {"min_new_tokens": 6, "sequence_bias": {("EOS",): 100.0}},
    ),
}


@pytest.mark.parametrize("case", list(PENALTIES))
def test_penalised_greedy_equals_hf_generate(
    served: Served, tiny_checkpoint: Path, case: str
) -> None:
    """The logits processors end to end (one image): the same tokens as HF
    generate() with its own processors for the same parameters."""
    ours, theirs = PENALTIES[case]
    eos = load_spec(tiny_checkpoint).eos_token_ids[0]

    def with_eos(value: Any) -> Any:
        if isinstance(value, dict):
            return {with_eos(k): v for k, v in value.items()}
        if isinstance(value, tuple):
            return tuple(eos if t == "EOS" else t for t in value)
        return str(eos) if value == "EOS" else value

    ours = {k: with_eos(v) for k, v in ours.items()}
    theirs = {k: with_eos(v) for k, v in theirs.items()}
    image = random_image(120, 90, seed=5)
    decoded = [Image.open(io.BytesIO(encode_image(image))).convert("RGB")]
    text = "Describe it, twice."
    expected = hf_greedy(tiny_checkpoint, chat(text, 1), decoded, 20, eos_token_id=eos, **theirs)
    tokenizer = load_tokenizer(tiny_checkpoint)
    expected_tokens = [tokenizer.decode([t], skip_special_tokens=False) for t in expected]
    content = [{"type": "image_url", "image_url": {"url": image_url(image)}}]
    reply = served.openai.chat.completions.create(
        model=MODEL,
        max_tokens=20,
        temperature=0,
        messages=[{"role": "user", "content": [*content, {"type": "text", "text": text}]}],
        logit_bias=ours.pop("logit_bias"),
        logprobs=True,  # token by token, not text (a trailing half character is held back)
        extra_body=ours,
    )
    logprobs = reply.choices[0].logprobs
    assert logprobs is not None and logprobs.content is not None
    assert [t.token for t in logprobs.content] == expected_tokens
    assert reply.usage is not None and reply.usage.completion_tokens == len(expected)
    if "min_tokens" in ours:
        assert (len(expected), reply.choices[0].finish_reason) == (7, "stop")


def test_eight_concurrent_requests(served: Served) -> None:
    def one(i: int) -> str:
        content: list[dict[str, Any]] = [{"type": "text", "text": f"Request {i}"}]
        if i % 2:
            content.insert(
                0,
                {
                    "type": "image_url",
                    "image_url": {"url": image_url(random_image(150, 150, seed=i))},
                },
            )
        reply = served.openai.chat.completions.create(
            model=MODEL, max_tokens=12, messages=[{"role": "user", "content": content}]
        )
        return reply.choices[0].finish_reason

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        reasons = list(pool.map(one, range(8)))
    assert all(r in ("stop", "length") for r in reasons)


def _part(url: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}}


GOOD_IMAGE = (
    "data:image/png;base64," + base64.b64encode(encode_image(random_image(64, 64))).decode()
)
BAD_REQUESTS = [
    ("malformed JSON", b"{'model': nope", 400, "not valid JSON"),
    (
        "unknown model",
        {"model": "other", "messages": [{"role": "user", "content": "x"}]},
        404,
        "does not exist",
    ),
    (
        "negative max_tokens",
        {"model": MODEL, "max_tokens": -5, "messages": [{"role": "user", "content": "x"}]},
        400,
        "max_tokens",
    ),
    (
        "unreadable image",
        {
            "model": MODEL,
            "messages": [
                {
                    "role": "user",
                    "content": [
                        _part(
                            "data:image/png;base64," + base64.b64encode(b"not a picture").decode()
                        )
                    ],
                }
            ],
        },
        400,
        "image 0: not a valid image",
    ),
    (
        "oversized image",
        {
            "model": MODEL,
            "messages": [
                {
                    "role": "user",
                    "content": [
                        _part(
                            "data:image/png;base64,"
                            + base64.b64encode(png_header_only(8000, 8000)).decode()
                        )
                    ],
                }
            ],
        },
        400,
        "exceeds the limit of 16777216 pixels",
    ),
    (
        "private-address URL",
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": [_part("http://127.0.0.1:8000/secret.png")]}],
        },
        400,
        "non-public address",
    ),
    (
        "too many images",
        {"model": MODEL, "messages": [{"role": "user", "content": [_part(GOOD_IMAGE)] * 17}]},
        400,
        "too many images: 17 > limit of 16",
    ),
    (
        "prompt over the context length",
        {"model": MODEL, "messages": [{"role": "user", "content": "lorem ipsum " * 400}]},
        400,
        "exceeds the context length of 512 tokens",
    ),
]


@pytest.mark.parametrize(
    ("name", "body", "status", "message"), BAD_REQUESTS, ids=[b[0] for b in BAD_REQUESTS]
)
def test_bad_requests_then_a_good_one(
    served: Served, name: str, body: Any, status: int, message: str
) -> None:
    with httpx.Client(timeout=60) as http:
        url = served.url + "/v1/chat/completions"
        if isinstance(body, bytes):
            reply = http.post(url, content=body, headers={"Content-Type": "application/json"})
        else:
            reply = http.post(url, json=body)
        assert reply.status_code == status, reply.text
        assert message in reply.json()["error"]["message"]
        ok = http.post(
            url,
            json={
                "model": MODEL,
                "max_tokens": 3,
                "messages": [
                    {"role": "user", "content": [_part(GOOD_IMAGE), {"type": "text", "text": "hi"}]}
                ],
            },
        )
        assert ok.status_code == 200, ok.text


def test_a_client_that_leaves_mid_stream_frees_everything(served: Served) -> None:
    body = {
        "model": MODEL,
        "max_tokens": 400,
        "stream": True,
        "messages": [
            {
                "role": "user",
                "content": [_part(GOOD_IMAGE), {"type": "text", "text": "Go on and on."}],
            }
        ],
    }
    with (
        httpx.Client(timeout=60) as http,
        http.stream("POST", served.url + "/v1/chat/completions", json=body) as reply,
    ):
        lines = 0
        for line in reply.iter_lines():
            lines += bool(line)
            if lines == 3:
                break  # and the connection closes
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if (
            served.language_metric("epd_language_kv_blocks_used") == 0
            and served.language_metric("epd_language_embedding_blocks_used") == 0
            and served.language_metric("epd_language_running_requests") == 0
        ):
            break
        time.sleep(0.25)
    assert served.language_metric("epd_language_kv_blocks_used") == 0
    assert served.language_metric("epd_language_embedding_blocks_used") == 0
    assert served.language_metric("epd_language_running_requests") == 0


def test_epd_bench_against_the_stack(served: Served, tmp_path: Path) -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "services.launcher.cli",
            "bench",
            "--base-url",
            served.url + "/v1",
            "--num-prompts",
            "6",
            "--image-ratio",
            "0.5",
            "--image-size",
            "96x96",
            "--output-len",
            "4",
            "--input-len",
            "8",
            "--request-rate",
            "20",
            "inf",
            "--goodput",
            "ttft:60000",
            "--result-json",
            str(tmp_path / "bench.json"),
            "--plot-dir",
            str(tmp_path / "plots"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads((tmp_path / "bench.json").read_text())
    assert report["model"] == MODEL
    assert [run["summary"]["request_rate"] for run in report["runs"]] == [20, "inf"]
    for run in report["runs"]:
        summary = run["summary"]
        assert (summary["completed"], summary["failed"]) == (6, 0)
        assert summary["total_output_tokens"] == 24  # ignore_eos: exactly 4 each
        assert summary["by_kind"]["image"]["completed"] == 3
        assert summary["by_kind"]["text"]["completed"] == 3
        assert summary["goodput"] == pytest.approx(summary["request_throughput"])
        for metric in ("ttft", "tpot", "itl", "e2e"):
            assert set(summary["latency_ms"][metric]) == {"mean", "median", "p90", "p99"}
        assert len(run["requests"]) == 6
        assert all(r["ok"] and r["ttft"] > 0 and r["output_tokens"] == 4 for r in run["requests"])
    assert (tmp_path / "plots" / "latency_cdf.png").stat().st_size > 0
    assert (tmp_path / "plots" / "throughput_vs_rate.png").stat().st_size > 0
    assert "request throughput" in result.stdout


def test_only_the_stacks_token_opens_its_control_plane(served: Served) -> None:
    """`epd serve` made a cluster token and printed it in the grpcurl command of its
    banner: that command, run with the real grpcurl, lists the instances; without
    the token, or with another, the broker refuses; `list` stays open."""
    match = re.search(
        r"grpcurl (-plaintext -H 'authorization: Bearer (\S+)' \S+ \S+)\)", served.banner
    )
    assert match is not None, served.banner
    printed = shlex.split(match.group(1))
    listed = grpcurl(*printed)
    assert listed.returncode == 0, listed.stderr
    instances = json.loads(listed.stdout)["instances"]
    names = sorted(i["registration"]["instance_id"] for i in instances)  # grpcurl: proto names
    assert names == ["encoder-0", "language-0"]
    broker = f"127.0.0.1:{served.ports['broker-port']}"
    for header in ([], ["-H", "authorization: Bearer guess"]):
        refused = grpcurl("-plaintext", *header, broker, "epd.v1.Broker/ListInstances")
        assert "Code: Unauthenticated" in refused.stderr, refused.stderr
    assert "epd.v1.Broker" in grpcurl("-plaintext", broker, "list").stdout


def _advised(pid: int) -> bool:
    """Whether a mapping of the process is advised into huge pages (VmFlags hg)."""
    smaps = Path(f"/proc/{pid}/smaps").read_text().splitlines()
    return any(line.startswith("VmFlags:") and " hg" in line for line in smaps)


def test_the_engine_process_asks_for_huge_pages(served: Served) -> None:
    """`epd language` sets torch's huge-page switch before its first allocation
    (malloc.advise_huge_pages), and the engine process it starts inherits it:
    its weights and KV cache lie in mappings advised into huge pages. The
    encoder does not set it (it gained nothing there)."""
    processes = family(served.process.pid)
    (engine,) = [p for p, line in processes.items() if "engine.process import main" in line]
    assert _advised(engine), "no mapping of the engine process is advised into huge pages"
    (encoder,) = [p for p, line in processes.items() if "launcher.cli encoder" in line]
    assert not _advised(encoder)


def test_ctrl_c_leaves_no_process_and_no_shared_memory(served: Served) -> None:
    marker = f"--broker {served.url.split(':')[1][2:]}:{served.ports['broker-port']}"
    assert _our_processes(f":{served.ports['broker-port']}"), "the stack's processes are running"
    assert served.segments, "the stack made shared memory as it came up"
    served.process.send_signal(signal.SIGINT)
    assert served.process.wait(60) == 0
    assert _our_processes(f":{served.ports['broker-port']}") == [], marker
    assert list(SHM_DIR.glob(SHM_PREFIX + "*")) == []
