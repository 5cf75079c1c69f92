"""Cache-aware encoder routing: how many of a workload's images an encoder cache
serves, routed by cache against round-robin, and against one encoder.

    .venv/bin/python -m bench.encoder_cache [--doc]

Three stacks, one at a time, on the small demo checkpoint, each sent the same
image requests whose images are drawn from a pool of K distinct ones (`epd
bench --distinct-images K`: every image recurs, as in a catalogue or a chat
that shows the same pictures to many users):

- `--encoders 3` routed by cache (the broker's default, services/broker/placement.py),
- `--encoders 3 --encoder-routing round-robin --no-peer-cache` (what vLLM's
  disaggregated proxy, SGLang and Dynamo do with several encoders),
- `--encoders 1 --encoder-cache-mb 3 x C`: one encoder with the three's cache.

From the encoders' own counters (epd_encoder_cache_hits / _encoded_items /
_shared_encodes / _peer_fetches, summed over the encoders): the share of images
served from a cache, and encodes per distinct image (images sent to Triton / the
distinct images sent). The figure of merit is cache routing's share as a ratio
of the single encoder's (the issue's goal: >= 0.9x), beside round-robin's.

Then the cluster as one cache: a skewed pool (`--image-skew`: a few popular
images among many) sent as Poisson arrivals past one encoder's capacity (its
closed-loop req/s on new images, measured first), to three encoders with the
peers' cache (the default: an encoder fetches what another holds) and without
(`--no-peer-cache`: the load bound alone). `--doc` writes the section of
docs/encoder-cache.md.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import time
import urllib.request
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from bench.peer import with_section
from bench.report import CACHE_END, CACHE_START, Setup, machine, serve
from bench.report import ENCODER_CACHE_DOC as DOC
from services.loadgen.runner import RunConfig, run
from services.loadgen.summary import summarize
from services.loadgen.workload import Workload, build_requests
from services.runtime.ports import METRICS_OFFSET, free_serve_ports

CACHE_MB = 64  # each of the three encoders'; the single one gets 3x
COUNTERS = ("cache_hits", "encoded_items", "shared_encodes", "peer_fetches", "peer_fetch_bytes")
FETCH_SECONDS = "peer_fetch_seconds"  # a histogram: its _sum and _count are summed too
SKEW = 1.1  # the skewed pool's Zipf exponent
OVERLOAD = 3.0  # the skewed arrivals' rate, x one encoder's capacity (--overload)


@dataclass(frozen=True)
class Stack:
    setup: Setup
    encoders: int


def stacks() -> list[Stack]:
    return [
        Stack(Setup("3 encoders, cache routing", ("--encoders", "3")), 3),
        Stack(
            Setup(
                "3 encoders, round-robin",
                ("--encoders", "3", "--encoder-routing", "round-robin", "--no-peer-cache"),
            ),
            3,
        ),
        Stack(
            Setup(
                "1 encoder, 3x the cache",
                ("--encoders", "1", "--encoder-cache-mb", str(3 * CACHE_MB)),
            ),
            1,
        ),
    ]


def counters(ports: list[int]) -> dict[str, float]:
    """The encoders' cache counters, summed, and their fetches' seconds (sum, count)."""
    totals = dict.fromkeys((*COUNTERS, "fetch_s", "fetches_timed"), 0.0)
    for port in ports:
        url = f"http://127.0.0.1:{port + METRICS_OFFSET}/metrics"
        with urllib.request.urlopen(url, timeout=5) as reply:
            text = reply.read().decode()
        for family in text_string_to_metric_families(text):
            name = family.name.removeprefix("epd_encoder_")
            if name in totals:  # of the peers' fetches, those that brought the item
                totals[name] += sum(
                    s.value
                    for s in family.samples
                    if s.name.endswith("_total") and s.labels.get("outcome", "fetched") == "fetched"
                )
            if name == FETCH_SECONDS:
                for s in family.samples:
                    if s.name.endswith("_sum"):
                        totals["fetch_s"] += s.value
                    elif s.name.endswith("_count"):
                        totals["fetches_timed"] += s.value
    return totals


def measure(
    stack: Stack, workload: Workload, concurrency: int | None, rate: float = math.inf
) -> dict[str, Any]:
    """The workload on the stack (closed loop at `concurrency`, or Poisson
    arrivals at `rate`): the encoders' counters, req/s and image TTFT."""
    ports = free_serve_ports(encoders=4, languages=4)
    encoder_ports = [ports["encoder-port"] + i for i in range(stack.encoders)]
    args = stack.setup.args
    if stack.encoders == 3:
        args = (*args, "--encoder-cache-mb", str(CACHE_MB))
    setup = Setup(stack.setup.name, args)
    log_dir = Path("/tmp/epd-encoder-cache") / stack.setup.name.replace(" ", "-").replace(",", "")
    requests = build_requests(workload, "demo-small")
    with serve(setup, log_dir, ports=ports) as (url, _):
        before = counters(encoder_ports)
        config = RunConfig(
            base_url=url, request_rate=rate, max_concurrency=concurrency, warmup=0, progress=False
        )
        result = asyncio.run(run(config, requests))
        after = counters(encoder_ports)
    got = {name: after[name] - before[name] for name in after}
    distinct = len({u for r in requests for u in _image_urls(r.body)})
    images = workload.num_prompts * workload.images_per_request
    summary = summarize(result)
    ttft = summary["latency_ms"]["ttft"]
    return {
        **got,
        "images": images,
        "distinct": distinct,
        "hit_share": got["cache_hits"] / images,
        "encodes_per_image": got["encoded_items"] / distinct,
        "request_throughput": summary["request_throughput"],
        "ttft_p50": ttft["median"],
        "ttft_p99": ttft["p99"],
        "failed": summary["failed"],
    }


def _image_urls(body: dict[str, Any]) -> list[str]:
    return [
        part["image_url"]["url"]
        for message in body["messages"]
        if isinstance(message["content"], list)
        for part in message["content"]
        if part.get("type") == "image_url"
    ]


def markdown(
    results: dict[str, dict[str, Any]], pairs: dict[str, dict[str, Any]], workload: Workload
) -> str:
    cache, round_robin, single = (results[s.setup.name] for s in stacks())
    lines = [
        "## Encoder cache routing",
        "",
        f"Generated by `bench/encoder_cache.py` on {time.strftime('%Y-%m-%d')}: {machine()}; "
        f"the small demo checkpoint; {workload.num_prompts} image requests whose images are "
        f"drawn from {workload.distinct_images} distinct ones; {CACHE_MB} MiB of cache per "
        "encoder of three, three times that for the single one.",
        "",
        "```",
        "python -m bench.encoder_cache",
        "```",
        "",
        "| stack | images a request | served from its cache | fetched from a peer "
        "| encodes per distinct image | shared encodes | req/s | failed |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for per_request, runs in ((1, results), (2, pairs)):
        for name, r in runs.items():
            lines.append(
                f"| {name} | {per_request} | {r['hit_share']:.3f} "
                f"| {r['peer_fetches'] / r['images']:.3f} | {r['encodes_per_image']:.2f} "
                f"| {int(r['shared_encodes'])} | {r['request_throughput']:.2f} | {r['failed']} |"
            )
    split = _split_bound(pairs)
    lines += [
        "",
        f"Cache routing serves {cache['hit_share'] / single['hit_share']:.2f}x the share of "
        "images one encoder with the same total cache serves from it (the goal: at least "
        f"0.9x); round-robin {round_robin['hit_share'] / single['hit_share']:.2f}x.",
        "",
        "A request goes to one encoder; the images it does not hold that another encoder "
        "holds (or is encoding) it fetches from that one (the peers' cache), so splitting "
        "a request across encoders would save no encode. With two images a request, cache "
        f"routing sent {split:.1%} of the images to Triton beyond what the single encoder did.",
    ]
    return "\n".join(lines)


def _split_bound(pairs: dict[str, dict[str, Any]]) -> float:
    """Extra encodes of cache routing over the one encoder, per image."""
    cache, single = pairs.values()
    return max(0.0, cache["encoded_items"] - single["encoded_items"]) / cache["images"]


def skewed_stacks() -> list[Stack]:
    return [
        Stack(Setup("3 encoders, the peers' cache", ("--encoders", "3")), 3),
        Stack(
            Setup("3 encoders, the load bound alone", ("--encoders", "3", "--no-peer-cache")),
            3,
        ),
    ]


def skewed(
    workload: Workload, concurrency: int, overload: float
) -> tuple[float, dict[str, dict[str, Any]]]:
    """One encoder's capacity (closed loop, every image new), then the skewed
    pool at `overload` x that rate on each of `skewed_stacks`."""
    single = Stack(Setup("1 encoder, new images", ("--encoders", "1")), 1)
    fresh = replace(workload, num_prompts=48, distinct_images=0, seed=8)
    capacity = measure(single, fresh, concurrency)["request_throughput"]
    print(f"== one encoder's capacity on new images: {capacity:.2f} req/s", flush=True)
    pool = replace(workload, distinct_images=100, image_skew=SKEW, seed=9)
    results = {}
    for stack in skewed_stacks():
        print(f"== {stack.setup.name}, skewed, {overload * capacity:.2f} req/s", flush=True)
        r = results[stack.setup.name] = measure(stack, pool, None, overload * capacity)
        fetched = max(r["fetches_timed"], 1)
        print(
            f"   encodes per distinct image {r['encodes_per_image']:.3f} "
            f"({int(r['encoded_items'])} of {r['distinct']}), fetched {int(r['peer_fetches'])} "
            f"({r['peer_fetch_bytes'] / fetched / 1024:.0f} KiB, "
            f"{r['fetch_s'] / fetched * 1e3:.1f} ms each), "
            f"{r['request_throughput']:.2f} req/s, TTFT p50/p99 {r['ttft_p50']:.0f}/"
            f"{r['ttft_p99']:.0f} ms, failed {r['failed']}",
            flush=True,
        )
    return capacity, results


def skewed_markdown(
    capacity: float, results: dict[str, dict[str, Any]], prompts: int, overload: float
) -> str:
    peers, bound = results.values()
    rows = [
        f"| {name} | {r['encodes_per_image']:.3f} | {int(r['encoded_items'])} / {r['distinct']} "
        f"| {int(r['peer_fetches'])} | {r['request_throughput']:.2f} | {r['ttft_p50']:.0f} "
        f"| {r['ttft_p99']:.0f} | {r['failed']} |"
        for name, r in results.items()
    ]
    return "\n".join(
        [
            "",
            "",
            "### The cluster as one cache: a skewed pool past one encoder's capacity",
            "",
            f"{prompts} image requests drawn from a pool of 100 images with Zipf weights "
            f"(1/k^{SKEW}), as Poisson arrivals at {overload:g}x one encoder's closed-loop "
            f"capacity on new images ({capacity:.2f} req/s, so {overload * capacity:.2f} req/s); "
            "three encoders with the peers' cache (the default) and with the load bound alone "
            "(`--no-peer-cache`), one stack at a time.",
            "",
            "| stack | encodes per distinct image | encodes / distinct images | fetched from a "
            "peer | req/s | image TTFT p50 (ms) | p99 (ms) | failed |",
            "|---|---:|---:|---:|---:|---:|---:|---:|",
            *rows,
            "",
            f"With the peers' cache the cluster encoded {peers['encodes_per_image']:.3f} times "
            f"per distinct image, against {bound['encodes_per_image']:.3f} with the bound alone; "
            f"req/s {peers['request_throughput'] / bound['request_throughput']:.2f}x, image "
            f"TTFT p50 {peers['ttft_p50'] / bound['ttft_p50']:.2f}x and p99 "
            f"{peers['ttft_p99'] / bound['ttft_p99']:.2f}x the bound alone's.",
        ]
    )


def routing_tables(
    workload: Workload, concurrency: int
) -> tuple[dict[str, dict[str, Any]], dict[str, dict[str, Any]]]:
    """Each stack on one image a request, then cache routing and the single
    encoder on two."""
    pair_workload = replace(workload, images_per_request=2, seed=6)
    results: dict[str, dict[str, Any]] = {}
    pairs: dict[str, dict[str, Any]] = {}
    for runs, load, chosen in ((results, workload, stacks()), (pairs, pair_workload, None)):
        for stack in chosen or [stacks()[0], stacks()[2]]:
            print(f"== {stack.setup.name}, {load.images_per_request} image(s) a request")
            r = runs[stack.setup.name] = measure(stack, load, concurrency)
            print(
                f"   served from its cache {r['hit_share']:.3f}, fetched from a peer "
                f"{int(r['peer_fetches'])}, encodes per distinct image "
                f"{r['encodes_per_image']:.2f}, shared {int(r['shared_encodes'])}, "
                f"{r['request_throughput']:.2f} req/s, failed {r['failed']}",
                flush=True,
            )
    return results, pairs


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--distinct-images", type=int, default=20, metavar="K")
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--skewed-requests", type=int, default=240)
    parser.add_argument("--overload", type=float, default=OVERLOAD, metavar="X")
    parser.add_argument("--skewed-only", action="store_true", help="only the skewed pool")
    parser.add_argument("--doc", action="store_true", help=f"write {DOC.name}'s section")
    args = parser.parse_args()
    if args.doc and args.skewed_only:
        parser.error("--doc writes the whole section: not with --skewed-only")
    workload = Workload(
        num_prompts=args.requests,
        input_len=16,
        output_len=4,
        image_ratio=1.0,
        distinct_images=args.distinct_images,
        seed=5,
    )
    body = ""
    if not args.skewed_only:
        body = markdown(*routing_tables(workload, args.concurrency), workload)
    skewed_load = replace(workload, num_prompts=args.skewed_requests)
    capacity, skew = skewed(skewed_load, args.concurrency, args.overload)
    body += skewed_markdown(capacity, skew, args.skewed_requests, args.overload)
    print(body)
    if args.doc:
        DOC.write_text(with_section(DOC.read_text(), body, CACHE_START, CACHE_END))


if __name__ == "__main__":
    main()
