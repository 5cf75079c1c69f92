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
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, Protocol

from services.launcher import flags, options
from services.runtime import env, logs
from services.runtime.malloc import advise_huge_pages

if TYPE_CHECKING:
    from services.launcher.serve import StackConfig

Handler = Callable[[argparse.Namespace], int]


class Service(Protocol):
    async def start(self) -> None: ...

    async def stop(self) -> None: ...


def run_until_signalled(make: Callable[[], Service], uvloop: bool = False) -> int:
    """Starts a service, runs it until SIGINT/SIGTERM, stops it cleanly, and
    leaves at once (exit_now). `uvloop`: on uvloop's event loop, as vLLM's API
    server runs: the gateway spends ~10 % less CPU a request on it (with
    httptools under uvicorn), a language instance ~6 %; the broker and the
    encoder, whose loops are not busy, gain nothing (git history of docs/performance.md)."""

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

    if uvloop:
        import uvloop as loops

        loops.run(main())
    else:
        asyncio.run(main())
    exit_now(0)


def exit_now(code: int) -> NoReturn:
    """Leaves without the interpreter's teardown, once a clean stop has released
    what the process holds (servers, shared memory, NIXL agents, Triton, child
    processes): freeing torch's, UCX's and the thread pools' state costs seconds
    of CPU that a stack stopping all at once on two cores pays in wall time
    (measured: an idle tiny stack stopped in 3-4.5 s with it, 1.5-2 s without)."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _local_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _model_name(args: argparse.Namespace) -> str:
    return str(args.model_name or Path(args.checkpoint).resolve().name)


def _protos(args: argparse.Namespace) -> int:
    from services.launcher import protogen

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

    out = build_demo_checkpoint(
        Path(args.dir), size=args.size, seed=args.seed, arch=args.arch, template=args.template
    )
    print(f"demo checkpoint ({args.arch}, {args.size}, seed {args.seed}) written to {out}")
    return 0


def _broker(args: argparse.Namespace) -> int:
    from services.broker.server import BrokerServer

    config = options.build(options.BROKER, args)
    return run_until_signalled(lambda: BrokerServer(config))


def _triton(args: argparse.Namespace) -> int:
    from services.triton.launcher import TritonServer

    config = options.build(
        options.TRITON,
        args,
        checkpoint=Path(args.checkpoint),
        dtype=args.dtype,
        otlp_endpoint=args.triton_otlp_endpoint,
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


def _encoder(args: argparse.Namespace) -> int:
    from services.encoder.server import EncoderServer
    from services.wire.dtypes import resolve_dtype

    config = options.build(
        options.ENCODER,
        args,
        checkpoint=Path(args.checkpoint),
        model_name=_model_name(args),
        dtype=resolve_dtype(args.dtype, _local_device()),
    )
    return run_until_signalled(lambda: EncoderServer(config))


def _language(args: argparse.Namespace) -> int:
    from services.language.server import LanguageServer
    from services.wire.dtypes import resolve_dtype
    from services.wire.messages import LanguageRole

    role = LanguageRole[args.role.upper()]
    auto = role is LanguageRole.BOTH and args.device == "cpu"
    config = options.build(
        options.LANGUAGE,
        args,
        checkpoint=Path(args.checkpoint),
        model_name=_model_name(args),
        role=role,
        engine_process=args.engine_process == "on" or (args.engine_process == "auto" and auto),
    )
    engine = replace(config.engine, dtype=resolve_dtype(args.dtype, args.device))
    config = replace(config, engine=engine)
    # an instance whose engine process died cannot serve: it leaves, to be restarted
    lost = partial(os.kill, os.getpid(), signal.SIGTERM)
    return run_until_signalled(lambda: LanguageServer(config, on_engine_lost=lost), uvloop=True)


def _gateway_config(args: argparse.Namespace) -> Any:
    return options.build(
        options.GATEWAY,
        args,
        broker=getattr(args, "broker", ""),
        checkpoint=Path(args.checkpoint) if args.checkpoint else None,
        api_key="" if args.api_key == flags.NO_API_KEY else args.api_key,
        served_models=tuple(args.served_model or ()),
    )


def _gateway(args: argparse.Namespace) -> int:
    from services.gateway.server import GatewayServer

    return run_until_signalled(lambda: GatewayServer(_gateway_config(args)), uvloop=True)


def _monolithic(args: argparse.Namespace) -> int:
    from services.gateway.server import GatewayServer
    from services.monolithic import LocalBackend
    from services.wire.dtypes import resolve_dtype

    config = _gateway_config(args)
    if config.checkpoint is None:
        raise SystemExit("epd monolithic needs --checkpoint (or $EPD_CHECKPOINT)")
    engine = options.build(options.ENGINE_TABLE, args, dtype=resolve_dtype(args.dtype, args.device))
    return run_until_signalled(
        lambda: GatewayServer(
            config,
            LocalBackend(
                config.checkpoint, _model_name(args), engine, config.limits, args.chat_template
            ),
        ),
        uvloop=True,
    )


def _bench_flags(p: argparse.ArgumentParser) -> None:
    from services.loadgen import command

    command.add_arguments(p)


def _bench(args: argparse.Namespace) -> int:
    from services.loadgen import command

    return command.main(args)


def _trace(args: argparse.Namespace) -> int:
    from services.launcher import timeline

    return timeline.main(args.request_id, args.broker, args.gateway, args.api_key)


def _health(args: argparse.Namespace) -> int:
    from services.launcher.serve import grpc_serving, http_ok

    healthy = (
        http_ok(args.target)
        if args.target.startswith("http")
        else grpc_serving(args.target, args.service)
    )
    print("SERVING" if healthy else "NOT_SERVING")
    return 0 if healthy else 1


def _serve(args: argparse.Namespace) -> int:
    from services.launcher.preflight import ConfigError, check_stack
    from services.launcher.serve import run
    from services.wire.dtypes import DTYPE_NAMES, resolve_dtype

    roles = tuple(r.strip() for r in args.roles.split(",") if r.strip())
    try:
        _check_serve_roles(args, roles)
        checkpoint, name = _serve_checkpoint(args)
        dtype = DTYPE_NAMES[resolve_dtype(args.dtype)]  # one for every component
        config = stack_config(args, roles, checkpoint, name, dtype)
        engine = {k: getattr(args, k) for k in ("kv_cache_mb", "max_model_len", "page_size")}
        claims = check_stack(config, engine)
    except (ConfigError, ValueError) as exc:  # a configuration that cannot work
        print(f"epd serve: {exc}", file=sys.stderr, flush=True)
        return 2
    print(f"dtype: {dtype}" + (" (auto)" if args.dtype == "auto" else ""), flush=True)
    if not env.CLUSTER_TOKEN.get():  # one per stack: the children inherit it
        os.environ[env.CLUSTER_TOKEN.name] = secrets.token_urlsafe(24)
    with claims:  # this host's ports, held until the stack is down
        code = run(config)
    exit_now(code)


def _check_serve_roles(args: argparse.Namespace, roles: tuple[str, ...]) -> None:
    from services.launcher.preflight import ConfigError
    from services.launcher.serve import StackConfig

    if (args.prefill or args.decode) and args.languages is not None:
        raise ConfigError("--prefill/--decode and --languages are mutually exclusive")
    whole = set(roles) == set(options.field_default(StackConfig, "roles"))
    if whole and (args.prefill > 0) != (args.decode > 0):
        raise ConfigError("E/P/D needs --prefill N and --decode M, both at least 1")


def _serve_checkpoint(args: argparse.Namespace) -> tuple[Path, str]:
    """--model's folder and the name it is served under, else the demo's."""
    from services.launcher.preflight import ConfigError
    from services.model.demo import cached_demo_checkpoint

    if args.model:
        checkpoint = Path(args.model).resolve()
        if not checkpoint.is_dir():
            raise ConfigError(f"--model {args.model} is not a folder")
        return checkpoint, args.model_name or checkpoint.name
    print(f"no --model: the {args.demo_size} demo checkpoint (built on first use)", flush=True)
    return cached_demo_checkpoint(args.demo_size), args.model_name or f"demo-{args.demo_size}"


def stack_config(
    args: argparse.Namespace, roles: tuple[str, ...], checkpoint: Path, name: str, dtype: str
) -> StackConfig:
    """`epd serve`'s StackConfig: what each of its components is started with."""
    from services.launcher.serve import StackConfig

    served = options.passed
    language = [*served(options.LANGUAGE, args), "--engine-process", args.engine_process]
    return options.build(
        options.STACK,
        _ported(args),
        checkpoint=checkpoint,
        model_name=name,
        log_dir=Path(args.log_dir or Path(env.CACHE_DIR.get()) / "logs"),
        num_encoders=args.min_encoders if args.encoders == "auto" else args.encoders,
        planner=options.build(options.PLANNER, args) if args.encoders == "auto" else None,
        num_languages=args.languages or options.field_default(StackConfig, "num_languages"),
        roles=roles,
        dtype=dtype,
        language_args=tuple(served(options.MONOLITHIC, args) if args.monolithic else language),
        encoder_args=tuple(served(options.ENCODER, args)),
        broker_args=tuple(served(options.BROKER, args)),
        gateway_args=tuple(served(options.GATEWAY, args)),
    )


def _ported(args: argparse.Namespace) -> argparse.Namespace:
    """--port-base: each port flag still at its default moves into the block
    (services.runtime.ports.SERVE_PORTS); the metrics ports follow theirs."""
    from services.launcher.serve import StackConfig
    from services.runtime.ports import SERVE_PORTS

    if args.port_base is None:
        return args
    moved = argparse.Namespace(**vars(args))
    for flag, offset in SERVE_PORTS.items():
        dest = flag.replace("-", "_")
        if getattr(args, dest) == options.field_default(StackConfig, dest):
            setattr(moved, dest, args.port_base + offset)
    return moved


def export_security(args: argparse.Namespace) -> None:
    """Security flags become this process's environment: its servers and channels
    read it there (services.runtime.security), and its children inherit it."""
    for flag, var in (
        ("cluster_token", env.CLUSTER_TOKEN),
        ("tls_cert", env.TLS_CERT),
        ("tls_key", env.TLS_KEY),
        ("tls_ca", env.TLS_CA),
    ):
        value = getattr(args, flag, None)
        if value:
            os.environ[var.name] = value


def export_tracing(args: argparse.Namespace) -> None:
    """Tracing flags become this process's environment (services.runtime.tracing reads
    it; epd serve's components inherit it)."""
    if getattr(args, "trace", False):
        os.environ[env.TRACE.name] = "1"
    if getattr(args, "otlp_endpoint", None):
        os.environ["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"] = args.otlp_endpoint
    if getattr(args, "triton_otlp_endpoint", None):
        os.environ[env.TRITON_OTLP_ENDPOINT.name] = args.triton_otlp_endpoint


# Each command: its help, its flags (services/launcher/flags.py) and its handler.
COMMANDS: dict[str, tuple[str, Callable[[argparse.ArgumentParser], None], Handler]] = {
    "protos": ("generate services/proto/ from protos/", flags.protos, _protos),
    "demo-model": ("build a small demo checkpoint locally", flags.demo_model, _demo_model),
    "broker": ("run the broker", flags.broker, _broker),
    "triton": (
        "run tritonserver (from the nvidia-pytriton wheel) with the vit model",
        flags.triton,
        _triton,
    ),
    "encoder": ("run an encoder instance", flags.encoder, _encoder),
    "language": ("run a language instance", flags.language, _language),
    "gateway": ("run the OpenAI-compatible gateway", flags.gateway, _gateway),
    "monolithic": (
        "gateway, vision tower and engine in one process (the baseline)",
        flags.monolithic,
        _monolithic,
    ),
    "bench": ("benchmark an OpenAI-compatible server", _bench_flags, _bench),
    "trace": ("show a recent request's steps (stack run with --trace)", flags.trace, _trace),
    "health": ("check a gRPC service (host:port) or an HTTP URL", flags.health, _health),
    "serve": ("run the whole stack on this machine", flags.serve, _serve),
}


# The components that trace their requests (`epd serve` only supervises them).
TRACED = ("broker", "encoder", "language", "gateway")


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The `epd` parser, with the flags of `command` only (all commands' when
    None): a process builds the flags of the one command it runs, importing
    that command's config classes and nothing else."""
    parser = argparse.ArgumentParser(prog="epd", description=__doc__)
    parser.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING, ERROR")
    parser.add_argument(
        "--log-format",
        choices=logs.FORMATS,
        default=env.LOG_FORMAT.get(),
        help="text, or json: one JSON object a line ($EPD_LOG_FORMAT)",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (text, add_flags, handler) in COMMANDS.items():
        p = sub.add_parser(name, help=text)
        if command in (None, name):
            add_flags(p)
        p.set_defaults(handler=handler)
    return parser


def command_of(argv: Sequence[str]) -> str | None:
    return next((arg for arg in argv if arg in COMMANDS), None)


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    """argv parsed by a parser holding only its command's flags."""
    return build_parser(command_of(argv)).parse_args(argv)


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
    argv = sys.argv[1:] if argv is None else argv
    if command_of(argv) == "language":  # its engine's weights and KV cache (malloc.py)
        advise_huge_pages()  # before torch's first allocation: parse_args makes some
    args = parse_args(argv)
    export_security(args)
    export_tracing(args)
    place_process()
    os.environ[env.LOG_FORMAT.name] = args.log_format  # children (epd serve's) inherit it
    logs.configure(args.log_level, args.log_format)
    for chatty in ("httpx", "matplotlib"):  # a line per request / per font otherwise
        logging.getLogger(chatty).setLevel(max(logging.WARNING, logging.getLogger().level))
    if env.SHM_RECLAIM.get():
        from services.transfer.shared_memory import remove_segments

        if removed := remove_segments(env.SHM_PREFIX.get()):
            logging.getLogger(__name__).info("removed %d segments left behind", len(removed))
    if args.command in TRACED:
        from services.runtime import tracing

        tracing.configure(args.command)
    handler: Handler = args.handler
    return handler(args)


if __name__ == "__main__":
    raise SystemExit(main())
