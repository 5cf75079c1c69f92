"""The `epd` command: one subcommand per service or tool."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import secrets
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

from services import env


class Service(Protocol):
    async def start(self) -> None: ...

    async def stop(self) -> None: ...


def run_until_signalled(make: Callable[[], Service]) -> int:
    """Starts a service, runs it until SIGINT/SIGTERM, stops it cleanly."""

    async def main() -> None:
        service = make()
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await service.start()
        try:
            await stop.wait()
        finally:
            await service.stop()

    asyncio.run(main())
    return 0


def _transports(value: str) -> tuple[Any, ...]:
    from services.wire.transport import Transport

    try:
        return tuple(Transport.parse(name) for name in value.split(",") if name.strip())
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


# services.wire.dtypes' names and `auto`, spelled out so that parsing needs no
# torch (checked equal by the tests); each process resolves the name where it
# knows its device.
DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16")


def _add_dtype_option(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument(
        "--dtype",
        choices=DTYPE_CHOICES,
        default=env.DTYPE.get(),
        help=f"{what}: auto (bfloat16 on GPUs and on CPUs with AVX512-BF16/AMX, else "
        "float32), float32, bfloat16 or float16 ($EPD_DTYPE)",
    )


def _local_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _add_limit_options(p: argparse.ArgumentParser) -> None:
    from services.encoder.limits import ImageLimits

    d = ImageLimits()
    p.add_argument("--max-images", type=int, default=d.max_images, help="images and videos")
    p.add_argument("--max-image-bytes", type=int, default=d.max_image_bytes)
    p.add_argument("--max-image-pixels", type=int, default=d.max_image_pixels)
    p.add_argument("--max-video-bytes", type=int, default=d.max_video_bytes)
    p.add_argument("--max-video-seconds", type=float, default=d.max_video_seconds)
    p.add_argument("--max-video-frames", type=int, default=d.max_video_frames)
    p.add_argument("--max-video-pixels", type=int, default=d.max_video_pixels, help="per frame")


def _limits(args: argparse.Namespace) -> Any:
    from services.encoder.limits import ImageLimits

    return ImageLimits(
        args.max_images,
        args.max_image_bytes,
        args.max_image_pixels,
        args.max_video_bytes,
        args.max_video_seconds,
        args.max_video_frames,
        args.max_video_pixels,
    )


def _model_name(args: argparse.Namespace) -> str:
    return str(args.model_name or Path(args.checkpoint).resolve().name)


def _protos(args: argparse.Namespace) -> int:
    from services import protogen

    if args.check:
        try:
            protogen.check()
        except protogen.StaleProtosError as exc:
            print(exc, file=sys.stderr)
            return 1
        print("generated protobuf code is current")
        return 0
    for path in protogen.write():
        print(path.relative_to(protogen.REPO_ROOT))
    return 0


def _demo_model(args: argparse.Namespace) -> int:
    from services.model.demo import build_demo_checkpoint

    out = build_demo_checkpoint(Path(args.dir), size=args.size, seed=args.seed, arch=args.arch)
    print(f"demo checkpoint ({args.arch}, {args.size}, seed {args.seed}) written to {out}")
    return 0


def _broker(args: argparse.Namespace) -> int:
    from services.broker.server import BrokerConfig, BrokerServer

    config = BrokerConfig(
        host=args.host,
        port=args.port,
        metrics_port=args.metrics_port,
        heartbeat_interval_s=args.heartbeat_interval,
        heartbeat_timeout_s=args.heartbeat_timeout,
        rendezvous_ttl_s=args.rendezvous_ttl,
    )
    return run_until_signalled(lambda: BrokerServer(config))


def _triton(args: argparse.Namespace) -> int:
    from services.triton.launcher import TritonConfig, TritonServer

    config = TritonConfig(
        checkpoint=Path(args.checkpoint),
        model_repository=Path(args.model_repository),
        host=args.host,
        http_port=args.http_port,
        grpc_port=args.grpc_port,
        metrics_port=args.metrics_port,
        model_config_name=args.model_config_name,
        dtype=args.dtype,
    )
    stopped = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stopped.set())
    with TritonServer(config) as server:
        print(f"tritonserver ready: grpc {config.grpc_url}, http {config.http_url}", flush=True)
        while not stopped.wait(0.5):
            if not server.running:
                print(f"tritonserver exited:\n{server.log_tail}", file=sys.stderr)
                return 1
    return 0


def _instance(args: argparse.Namespace, role: str) -> Any:
    from services.instance import InstanceConfig
    from services.wire.messages import Role

    return InstanceConfig(
        role=Role[role.upper()],
        port=args.port,
        host=args.host,
        metrics_port=args.metrics_port,
        advertise_host=args.advertise_host,
        instance_id=args.instance_id or "",
        host_id=args.host_id,
        broker=args.broker or None,
        transports=args.transports,
    )


def _encoder(args: argparse.Namespace) -> int:
    from services.encoder.server import EncoderConfig, EncoderServer
    from services.wire.dtypes import resolve_dtype

    config = EncoderConfig(
        checkpoint=Path(args.checkpoint),
        model_name=_model_name(args),
        instance=_instance(args, "encoder"),
        triton_url=args.triton,
        triton_shared_memory=not args.no_triton_shm,
        limits=_limits(args),
        cache_bytes=args.cache_mb * 1024 * 1024,
        send_buffer_tokens=args.send_buffer_tokens,
        max_pending=args.max_pending,
        buffer_wait_s=args.buffer_wait,
        dtype=resolve_dtype(args.dtype, _local_device()),
    )
    return run_until_signalled(lambda: EncoderServer(config))


def _language(args: argparse.Namespace) -> int:
    from services.language.server import LanguageConfig, LanguageServer

    config = LanguageConfig(
        checkpoint=Path(args.checkpoint),
        model_name=_model_name(args),
        instance=_instance(args, "language"),
        embedding_pool_tokens=args.embedding_pool_tokens,
        default_allocate_tokens=args.default_allocate_tokens,
        max_active_requests=args.max_active_requests,
        pool_wait_s=args.pool_wait,
        quarantine_s=args.quarantine,
        engine=_engine_config(args),
    )
    return run_until_signalled(lambda: LanguageServer(config))


def _gateway_config(args: argparse.Namespace) -> Any:
    from services.gateway.images import FetchPolicy
    from services.gateway.server import GatewayConfig

    return GatewayConfig(
        broker=getattr(args, "broker", ""),
        checkpoint=Path(args.checkpoint) if args.checkpoint else None,
        host=args.host,
        port=args.port,
        api_key="" if args.api_key == NO_API_KEY else args.api_key,
        limits=_limits(args),
        fetch=FetchPolicy(timeout_s=args.fetch_timeout, allow_private=args.allow_private_urls),
        encode_timeout_s=args.encode_timeout,
        served_models=tuple(args.served_model or ()),
        max_concurrent_requests=args.max_concurrent_requests,
        max_body_bytes=args.max_body_mb * 1024 * 1024,
    )


def _gateway(args: argparse.Namespace) -> int:
    from services.gateway.server import GatewayServer

    return run_until_signalled(lambda: GatewayServer(_gateway_config(args)))


def _monolithic(args: argparse.Namespace) -> int:
    from services.gateway.server import GatewayServer
    from services.monolithic import LocalBackend

    config = _gateway_config(args)
    if config.checkpoint is None:
        raise SystemExit("epd monolithic needs --checkpoint (or $EPD_CHECKPOINT)")
    engine = _engine_config(args)
    return run_until_signalled(
        lambda: GatewayServer(
            config,
            LocalBackend(config.checkpoint, _model_name(args), engine, config.limits),
        )
    )


def _engine_config(args: argparse.Namespace) -> Any:
    from services.language.engine.config import EngineConfig
    from services.language.engine.scheduler import SchedulerConfig
    from services.wire.dtypes import resolve_dtype

    return EngineConfig(
        max_model_len=args.max_model_len,
        kv_cache_bytes=args.kv_cache_mb * 1024 * 1024,
        page_size=args.page_size,
        scheduler=SchedulerConfig(args.max_num_seqs, args.max_num_batched_tokens),
        dtype=resolve_dtype(args.dtype, args.device),
        device=args.device,
        attention=args.attention,
        cuda_graphs=not args.no_cuda_graphs,
    )


def _add_attention_option(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--attention",
        default="auto",
        choices=("auto", "torch", "cpu", "flashinfer"),
        help="auto: FlashInfer on CUDA; on CPU in float32 the compiled paged decode kernel "
        "(built on first use with the machine's C compiler; cpu: also in bfloat16), "
        "else torch (SDPA)",
    )


def _add_engine_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="cpu")
    _add_dtype_option(p, "model dtype (and the embeddings')")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--kv-cache-mb", type=int, default=512)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    _add_attention_option(p)
    p.add_argument(
        "--no-cuda-graphs",
        action="store_true",
        help="run decode steps eagerly on CUDA (by default they replay captured CUDA graphs)",
    )


def _health(args: argparse.Namespace) -> int:
    from services.serve import grpc_serving, http_ok

    healthy = (
        http_ok(args.target)
        if args.target.startswith("http")
        else grpc_serving(args.target, args.service)
    )
    print("SERVING" if healthy else "NOT_SERVING")
    return 0 if healthy else 1


def serve_language_args(args: argparse.Namespace) -> list[str]:
    """The engine flags `epd serve` passes on to its language (or monolithic) instances."""
    return [
        *("--max-model-len", str(args.max_model_len)),
        *("--kv-cache-mb", str(args.kv_cache_mb)),
        *("--max-num-seqs", str(args.max_num_seqs)),
        *("--max-num-batched-tokens", str(args.max_num_batched_tokens)),
        *("--attention", args.attention),
    ]


def _serve(args: argparse.Namespace) -> int:
    from services.model.demo import cached_demo_checkpoint
    from services.serve import StackConfig, run
    from services.wire.dtypes import DTYPE_NAMES, resolve_dtype

    if args.model:
        checkpoint = Path(args.model).resolve()
        name = args.model_name or checkpoint.name
    else:
        print(
            f"no --model: using the {args.demo_size} demo checkpoint (built on first use)",
            flush=True,
        )
        checkpoint = cached_demo_checkpoint(args.demo_size)
        name = args.model_name or f"demo-{args.demo_size}"
    dtype = DTYPE_NAMES[resolve_dtype(args.dtype)]  # one for every component
    print(f"dtype: {dtype}" + (" (auto)" if args.dtype == "auto" else ""), flush=True)
    gateway = ["--allow-private-urls"] if args.allow_private_urls else []
    if not env.CLUSTER_TOKEN.get():  # one per stack: the children inherit it
        os.environ[env.CLUSTER_TOKEN.name] = secrets.token_urlsafe(24)
    return run(
        StackConfig(
            checkpoint=checkpoint,
            model_name=name,
            log_dir=Path(args.log_dir or Path(env.CACHE_DIR.get()) / "logs"),
            host=args.host,
            port=args.port,
            broker_port=args.broker_port,
            encoder_port=args.encoder_port,
            language_port=args.language_port,
            triton_ports=(args.triton_http_port, args.triton_grpc_port, args.triton_metrics_port),
            num_encoders=args.encoders,
            num_languages=args.languages,
            api_key=args.api_key,
            language_args=tuple(serve_language_args(args)),
            dtype=dtype,
            gateway_args=tuple(gateway),
            monolithic=args.monolithic,
            encoder_cpus=args.encoder_cpus,
            language_cpus=args.language_cpus,
            encoder_nice=args.encoder_nice,
            max_restarts=args.max_restarts,
            restart_window_s=args.restart_window,
        )
    )


# What compose's required EPD_API_KEY is set to for a gateway open to anyone.
NO_API_KEY = "disabled"


def _add_gateway_options(p: argparse.ArgumentParser, port: int) -> None:
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=port)
    p.add_argument(
        "--checkpoint",
        default=env.CHECKPOINT.get() or None,
        help="the model folder, for image token hints ($EPD_CHECKPOINT)",
    )
    p.add_argument(
        "--api-key",
        default=env.API_KEY.get(),
        help=f"require this bearer key ($EPD_API_KEY; '{NO_API_KEY}': none, as when unset)",
    )
    _add_limit_options(p)
    p.add_argument(
        "--fetch-timeout", type=float, default=10.0, help="seconds for a remote image URL"
    )
    p.add_argument(
        "--allow-private-urls",
        action="store_true",
        help="let image URLs reach loopback/private/link-local addresses",
    )
    p.add_argument(
        "--max-concurrent-requests",
        type=int,
        default=512,
        help="requests in flight beyond which new ones get 429 with Retry-After",
    )
    p.add_argument(
        "--max-body-mb", type=int, default=64, help="request bodies over this are refused (413)"
    )
    p.add_argument(
        "--encode-timeout", type=float, default=60.0, help="seconds for one encoder's Encode"
    )
    p.add_argument(
        "--served-model",
        action="append",
        help="a model this gateway serves: 503 (not 404) while no instance is up; repeatable",
    )


def _add_instance_options(p: argparse.ArgumentParser, port: int) -> None:
    p.add_argument(
        "--checkpoint",
        default=env.CHECKPOINT.get(),
        required=not env.CHECKPOINT.get(),
        help="checkpoint folder ($EPD_CHECKPOINT)",
    )
    p.add_argument("--model-name", help="served model name (default: the folder's name)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0: all)")
    p.add_argument("--port", type=int, default=port)
    p.add_argument(
        "--advertise-host",
        help="the host peers dial (default: --host, or this machine's name when binding 0.0.0.0)",
    )
    p.add_argument("--metrics-port", type=int, default=0, help="Prometheus port (0: any free)")
    p.add_argument("--broker", default=env.BROKER.get(), help="broker address ($EPD_BROKER)")
    p.add_argument(
        "--host-id", default=env.HOST_ID.get(), help="same id = shared memory ($EPD_HOST_ID)"
    )
    p.add_argument("--instance-id", help="default: role plus a random suffix")
    p.add_argument(
        "--transports",
        type=_transports,
        default=_transports("shm,nixl,grpc"),
        help="comma-separated: cuda_ipc, nixl, shm, grpc",
    )


def _add_security_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--cluster-token",
        help="secret every internal gRPC call carries ($EPD_CLUSTER_TOKEN; epd serve makes one)",
    )
    p.add_argument("--tls-cert", help="PEM certificate chain: gRPC over TLS ($EPD_TLS_CERT)")
    p.add_argument("--tls-key", help="PEM key of --tls-cert ($EPD_TLS_KEY)")
    p.add_argument(
        "--tls-ca",
        help="PEM roots to verify peers with; servers then require client certificates "
        "(mutual TLS) ($EPD_TLS_CA)",
    )


def export_security(args: argparse.Namespace) -> None:
    """Security flags become this process's environment: its servers and channels
    read it there (services.security), and its children inherit it."""
    for flag, var in (
        ("cluster_token", env.CLUSTER_TOKEN),
        ("tls_cert", env.TLS_CERT),
        ("tls_key", env.TLS_KEY),
        ("tls_ca", env.TLS_CA),
    ):
        value = getattr(args, flag, None)
        if value:
            os.environ[var.name] = value


def build_parser() -> argparse.ArgumentParser:
    from services.ports import BROKER_PORT, ENCODER_PORT, GATEWAY_PORT, LANGUAGE_PORT

    parser = argparse.ArgumentParser(prog="epd", description=__doc__)
    parser.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING, ERROR")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("protos", help="generate services/proto/ from protos/")
    p.add_argument("--check", action="store_true", help="fail if the generated code is stale")
    p.set_defaults(handler=_protos)

    p = sub.add_parser("demo-model", help="build a small demo checkpoint locally")
    p.add_argument("dir", help="output folder")
    p.add_argument("--size", choices=("tiny", "small"), default="tiny")
    p.add_argument(
        "--arch", choices=("qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe"), default="qwen2_5_vl"
    )
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(handler=_demo_model)

    p = sub.add_parser("broker", help="run the broker")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=BROKER_PORT)
    p.add_argument("--metrics-port", type=int, default=0)
    p.add_argument("--heartbeat-interval", type=float, default=1.0)
    p.add_argument("--heartbeat-timeout", type=float, default=5.0)
    p.add_argument("--rendezvous-ttl", type=float, default=30.0)
    _add_security_options(p)
    p.set_defaults(handler=_broker)

    p = sub.add_parser(
        "triton", help="run tritonserver (from the nvidia-pytriton wheel) with the vit model"
    )
    p.add_argument("--checkpoint", default=env.CHECKPOINT.get(), required=not env.CHECKPOINT.get())
    p.add_argument(
        "--model-repository",
        default=str(Path(__file__).resolve().parent.parent / "model_repository"),
    )
    p.add_argument("--model-config-name", help="e.g. gpu: use configs/gpu.pbtxt")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--http-port", type=int, default=8010)
    p.add_argument("--grpc-port", type=int, default=8011)
    p.add_argument("--metrics-port", type=int, default=8012)
    _add_dtype_option(p, "the vision tower's dtype")
    p.set_defaults(handler=_triton)

    p = sub.add_parser("encoder", help="run an encoder instance")
    _add_instance_options(p, ENCODER_PORT)
    _add_dtype_option(p, "embedding dtype (the language instances' dtype)")
    p.add_argument(
        "--triton", default=env.TRITON_URL.get(), help="Triton gRPC address ($EPD_TRITON_URL)"
    )
    p.add_argument("--no-triton-shm", action="store_true", help="send tensors to Triton over gRPC")
    _add_limit_options(p)
    p.add_argument("--cache-mb", type=int, default=256)
    p.add_argument("--send-buffer-tokens", type=int, default=65536)
    p.add_argument(
        "--max-pending",
        type=int,
        default=64,
        help="encodes in progress beyond which new ones get RESOURCE_EXHAUSTED",
    )
    p.add_argument(
        "--buffer-wait",
        type=float,
        default=5.0,
        help="seconds an encode waits for send-buffer room",
    )
    _add_security_options(p)
    p.set_defaults(handler=_encoder)

    p = sub.add_parser("language", help="run a language instance")
    _add_instance_options(p, LANGUAGE_PORT)
    _add_engine_options(p)
    p.add_argument("--embedding-pool-tokens", type=int, default=32768)
    p.add_argument("--default-allocate-tokens", type=int, default=4096)
    p.add_argument(
        "--max-active-requests",
        type=int,
        default=256,
        help="requests in flight (receiving or generating) beyond which new ones get "
        "RESOURCE_EXHAUSTED",
    )
    p.add_argument(
        "--pool-wait", type=float, default=5.0, help="seconds a request waits for receive blocks"
    )
    p.add_argument(
        "--quarantine",
        type=float,
        default=15.0,
        help="seconds receive blocks stay out of use after their request ended while an "
        "encoder may still write them (unless it says it stopped)",
    )
    _add_security_options(p)
    p.set_defaults(handler=_language)

    p = sub.add_parser("gateway", help="run the OpenAI-compatible gateway")
    _add_gateway_options(p, GATEWAY_PORT)
    p.add_argument("--broker", default=env.BROKER.get(), help="broker address ($EPD_BROKER)")
    _add_security_options(p)
    p.set_defaults(handler=_gateway)

    p = sub.add_parser(
        "monolithic", help="gateway, vision tower and engine in one process (the baseline)"
    )
    _add_gateway_options(p, GATEWAY_PORT)
    _add_engine_options(p)
    p.add_argument("--model-name", help="served model name (default: the folder's name)")
    p.set_defaults(handler=_monolithic)

    from services.bench import command as bench

    p = sub.add_parser("bench", help="benchmark an OpenAI-compatible server")
    bench.add_arguments(p)
    p.set_defaults(handler=bench.main)

    p = sub.add_parser("health", help="check a gRPC service (host:port) or an HTTP URL")
    p.add_argument("target", help="host:port of a gRPC server, or http(s)://... for an HTTP check")
    p.add_argument("--service", default="", help="gRPC service name (default: the server)")
    _add_security_options(p)
    p.set_defaults(handler=_health)

    p = sub.add_parser("serve", help="run the whole stack on this machine")
    p.add_argument("--model", help="checkpoint folder (default: the demo checkpoint)")
    p.add_argument("--model-name", help="served model name (default: the folder's name)")
    p.add_argument("--demo-size", choices=("tiny", "small"), default="tiny")
    p.add_argument(
        "--monolithic",
        action="store_true",
        help="one process, no Triton and no broker: the baseline to compare with",
    )
    p.add_argument(
        "--host",
        default="127.0.0.1",
        help="address the gateway binds (0.0.0.0: all); the other components listen "
        "on 127.0.0.1 only",
    )
    p.add_argument("--port", type=int, default=GATEWAY_PORT, help="the gateway's port")
    p.add_argument("--api-key", default=env.API_KEY.get())
    p.add_argument("--allow-private-urls", action="store_true")
    p.add_argument("--encoders", type=int, default=1, help="encoder instances")
    p.add_argument("--languages", type=int, default=1, help="language instances")
    p.add_argument("--broker-port", type=int, default=BROKER_PORT)
    p.add_argument(
        "--encoder-port", type=int, default=ENCODER_PORT, help="the first encoder's port"
    )
    p.add_argument(
        "--language-port", type=int, default=LANGUAGE_PORT, help="the first language port"
    )
    p.add_argument("--triton-http-port", type=int, default=8010)
    p.add_argument("--triton-grpc-port", type=int, default=8011)
    p.add_argument("--triton-metrics-port", type=int, default=8012)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--kv-cache-mb", type=int, default=512)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    _add_attention_option(p)
    _add_dtype_option(p, "dtype of the vision tower, the embeddings and the language model")
    p.add_argument(
        "--encoder-cpus",
        default="",
        help="CPUs for Triton and the encoders, e.g. 1 or 4-7 (default: all)",
    )
    p.add_argument(
        "--language-cpus",
        default="",
        help="CPUs for the language instances, e.g. 0 or 0-3 (default: all)",
    )
    p.add_argument(
        "--encoder-nice",
        type=int,
        default=0,
        help="niceness for Triton and the encoders (e.g. 10): the language "
        "engine gets the CPU first when they contend",
    )
    p.add_argument(
        "--max-restarts",
        type=int,
        default=5,
        help="a component that dies is restarted; this many restarts within "
        "--restart-window seconds stop the stack",
    )
    p.add_argument("--restart-window", type=float, default=60.0)
    p.add_argument("--log-dir", help="component logs (default: $EPD_CACHE_DIR/logs)")
    _add_security_options(p)
    p.set_defaults(handler=_serve)
    return parser


def place_process() -> None:
    """EPD_CPUS and EPD_NICE, applied before torch starts any thread (threads and
    child processes inherit both). On CPUs they stand in for giving a stage its
    own device: its own cores, or a lower priority than the latency-critical
    decode loop so that it only takes the cycles the loop leaves."""
    if env.NICE.get():
        os.nice(env.NICE.get())
    cpus = env.CPUS.get()
    if not cpus:
        return
    os.sched_setaffinity(0, cpus)
    # Read by torch and OpenMP in this process and in children (Triton's Python stub).
    os.environ["OMP_NUM_THREADS"] = str(len(cpus))
    import torch

    torch.set_num_threads(len(cpus))


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    export_security(args)
    place_process()
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    for chatty in ("httpx", "matplotlib"):  # a line per request / per font otherwise
        logging.getLogger(chatty).setLevel(max(logging.WARNING, logging.getLogger().level))
    handler: Callable[[argparse.Namespace], int] = args.handler
    return handler(args)


if __name__ == "__main__":
    raise SystemExit(main())
