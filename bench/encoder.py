"""Encoder service throughput against the in-process vision tower, same run.

    .venv/bin/python -m bench.encoder [--size small] [--images 48] [--concurrency 8]

Starts a real tritonserver and the encoder service (Triton over system shared
memory, then over plain gRPC), sends distinct images (so the embedding cache
never hits) from `concurrency` clients, and compares images/s with the same
preprocessing + vision tower run in-process, one image at a time (what a
monolithic server does). The ratio is the figure.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import time
from pathlib import Path

import torch
from PIL import Image

from services.broker.instance import InstanceConfig
from services.encoder.server import EncoderConfig, EncoderServer
from services.loadgen.synthetic import encode_image, random_image
from services.model.checkpoint import load_vision_tower
from services.model.demo import SIZES, cached_demo_checkpoint
from services.model.processor import load_image_processor
from services.model.spec import load_spec
from services.proto import encoder_pb2, encoder_pb2_grpc
from services.runtime.grpc_server import channel
from services.runtime.ports import free_port
from services.triton.launcher import TritonConfig, TritonServer
from services.wire.messages import Role


def make_images(n: int, size: int, seed: int) -> list[bytes]:
    return [encode_image(random_image(size, size, seed=seed + i), "JPEG") for i in range(n)]


def in_process(folder: Path, images: list[bytes]) -> float:
    spec = load_spec(folder)
    processor = load_image_processor(folder)
    tower = load_vision_tower(folder, spec)
    started = time.perf_counter()
    with torch.inference_mode():
        for data in images:
            image = Image.open(io.BytesIO(data)).convert("RGB")
            pixels = processor(images=[image], return_tensors="pt")
            tower(pixels["pixel_values"], grid_thw=pixels["image_grid_thw"])
    return len(images) / (time.perf_counter() - started)


async def service(
    folder: Path, triton: TritonServer, images: list[bytes], concurrency: int, shm: bool
) -> float:
    server = EncoderServer(
        EncoderConfig(
            checkpoint=folder,
            model_name="bench",
            instance=InstanceConfig(Role.ENCODER, port=0, metrics_port=None),
            triton_url=triton.config.grpc_url,
            triton_shared_memory=shm,
        )
    )
    await server.start()
    try:
        ch = channel(server.address)  # held: an intercepted call starts after this line
        stub = encoder_pb2_grpc.EncoderStub(ch)
        await stub.Encode(encoder_pb2.EncodeRequest(images=images[:1]))  # warm-up (cached after)
        queue = list(images[1:])

        async def client() -> None:
            while queue:
                data = queue.pop()
                await stub.Encode(encoder_pb2.EncodeRequest(images=[data]))

        started = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(concurrency)))
        return (len(images) - 1) / (time.perf_counter() - started)
    finally:
        await server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--size", default="small", choices=tuple(SIZES))
    parser.add_argument("--images", type=int, default=48)
    parser.add_argument("--resolution", type=int, default=448)
    parser.add_argument("--concurrency", type=int, default=8)
    args = parser.parse_args()

    folder = cached_demo_checkpoint(args.size)
    config = TritonConfig(
        checkpoint=folder, http_port=free_port(), grpc_port=free_port(), metrics_port=free_port()
    )
    print(
        f"checkpoint: demo {args.size}; {args.images} distinct {args.resolution}x{args.resolution} "
        f"JPEG images; {args.concurrency} concurrent clients"
    )
    baseline = in_process(folder, make_images(args.images // 2, args.resolution, seed=1))
    with TritonServer(config) as triton:
        rates = {
            "triton shm on": asyncio.run(
                service(
                    folder,
                    triton,
                    make_images(args.images, args.resolution, 1000),
                    args.concurrency,
                    True,
                )
            ),
            "triton shm off": asyncio.run(
                service(
                    folder,
                    triton,
                    make_images(args.images, args.resolution, 2000),
                    args.concurrency,
                    False,
                )
            ),
        }
    print(f"{'path':<34} {'images/s':>9} {'vs in-process':>14}")
    print(f"{'in-process vision tower':<34} {baseline:>9.2f} {1.0:>13.2f}x")
    for name, rate in rates.items():
        print(f"{'encoder service, ' + name:<34} {rate:>9.2f} {rate / baseline:>13.2f}x")


if __name__ == "__main__":
    main()
