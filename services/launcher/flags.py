"""The `epd` command's flags, one builder per command.

A flag that sets a config field is built from that field (`field_option`): its
type and default are the dataclass's, so the parser, the server and the
drivers read the same value. Each builder imports only its own command's
config classes: `epd triton`, `epd broker` and `epd gateway` import no torch
and no server (tests/test_package_graph.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from services.runtime import env, ports

if TYPE_CHECKING:
    from services.language.engine.config import EngineConfig

MIB = 1024 * 1024

# services.wire.dtypes' names and `auto`, spelled out so that parsing needs no
# torch (checked equal by the tests); each process resolves the name where it
# knows its device.
DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16")
# services.model.demo's SIZES, spelled out for the same reason
DEMO_SIZES = ("tiny", "small", "medium", "tiny-gpu")

# What compose's required EPD_API_KEY is set to for a gateway open to anyone.
NO_API_KEY = "disabled"


def default(config: type, name: str) -> Any:
    """A config dataclass field's default."""
    for f in dataclasses.fields(config):
        if f.name == name:
            if f.default is not dataclasses.MISSING:
                return f.default
            if f.default_factory is not dataclasses.MISSING:
                return f.default_factory()
            raise TypeError(f"{config.__name__}.{name} has no default")
    raise TypeError(f"{config.__name__} has no field {name}")


def field_option(
    p: argparse.ArgumentParser, config: type, name: str, *flags: str, scale: int = 1, **kwargs: Any
) -> None:
    """A flag for a config field, typed and defaulted by it; named --the-field
    unless `flags` say otherwise; `scale`: the field's units in one of the
    flag's (MIB for a byte count given in MiB)."""
    value = default(config, name)
    if scale != 1:
        value //= scale
    names = flags or (f"--{name.replace('_', '-')}",)
    p.add_argument(*names, type=type(value), default=value, **kwargs)


def add_dtype(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument(
        "--dtype",
        choices=DTYPE_CHOICES,
        default=env.DTYPE.get(),
        help=f"{what}: auto (bfloat16 on GPUs and on CPUs with AVX512-BF16/AMX, else "
        "float32), float32, bfloat16 or float16 ($EPD_DTYPE)",
    )


def add_security(p: argparse.ArgumentParser) -> None:
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


def add_tracing(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--trace",
        action="store_true",
        default=env.TRACE.get(),
        help="trace every request (OpenTelemetry spans, kept for `epd trace`) ($EPD_TRACE)",
    )
    p.add_argument(
        "--otlp-endpoint",
        help="also export the spans over OTLP to this collector, e.g. http://127.0.0.1:4317 "
        "(gRPC), or with OTEL_EXPORTER_OTLP_PROTOCOL=http/protobuf http://127.0.0.1:4318/"
        "v1/traces ($OTEL_EXPORTER_OTLP_TRACES_ENDPOINT; the other OTEL_* variables, "
        "OTEL_TRACES_SAMPLER among them, hold too)",
    )


def add_triton_tracing(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--triton-otlp-endpoint",
        default=env.TRITON_OTLP_ENDPOINT.get(),
        help="Triton's own traces, over OTLP/HTTP to this URL (e.g. "
        "http://127.0.0.1:4318/v1/traces): its requests join the encoders' traces "
        "($EPD_TRITON_OTLP_ENDPOINT)",
    )


def add_limits(p: argparse.ArgumentParser) -> None:
    """ImageLimits' fields, each a flag of its name."""
    from services.media.limits import ImageLimits

    helps = {"max_images": "images and videos", "max_video_pixels": "per frame"}
    for f in dataclasses.fields(ImageLimits):
        field_option(p, ImageLimits, f.name, help=helps.get(f.name))


def transports(value: str) -> tuple[Any, ...]:
    from services.wire.transport import Transport

    try:
        return tuple(Transport.parse(name) for name in value.split(",") if name.strip())
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_checkpoint(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--checkpoint",
        default=env.CHECKPOINT.get(),
        required=not env.CHECKPOINT.get(),
        help="checkpoint folder ($EPD_CHECKPOINT)",
    )


def add_chat_template(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--chat-template",
        type=Path,
        help="a chat template file (Jinja, or a processor's chat_template.json) in place of "
        "the checkpoint's, as vLLM's flag: e.g. one that renders tools for a checkpoint "
        "whose own does not; checked at start-up",
    )


def add_instance(p: argparse.ArgumentParser, config: type) -> None:
    """An encoder's or language instance's flags: `config` is its service's
    config (EncoderConfig, LanguageConfig), whose `instance` gives the defaults."""
    from services.broker.instance import InstanceConfig

    instance = default(config, "instance")
    add_checkpoint(p)
    p.add_argument("--model-name", help="served model name (default: the folder's name)")
    field_option(p, InstanceConfig, "host", help="address to bind (0.0.0.0: all)")
    p.add_argument("--port", type=int, default=instance.port)
    p.add_argument(
        "--advertise-host",
        help="the host peers dial (default: --host, or this machine's name when binding 0.0.0.0)",
    )
    field_option(p, InstanceConfig, "metrics_port", help="Prometheus port (0: any free)")
    p.add_argument("--broker", default=env.BROKER.get(), help="broker address ($EPD_BROKER)")
    p.add_argument(
        "--host-id", default=env.HOST_ID.get(), help="same id = shared memory ($EPD_HOST_ID)"
    )
    p.add_argument("--instance-id", help="default: role plus a random suffix")
    p.add_argument(
        "--transports",
        type=transports,
        default=instance.transports,
        help="comma-separated: cuda_ipc, nixl, shm, grpc",
    )


@dataclasses.dataclass(frozen=True)
class EngineOption:
    """A flag of an EngineConfig field (or of its SchedulerConfig's)."""

    field: str
    flag: str = ""  # default: --the-field
    scheduler: bool = False
    scale: int = 1  # the field's units in one of the flag's
    negated: bool = False  # a field on by default, turned off by the flag
    help: str | None = None
    choices: tuple[str, ...] | None = None

    @property
    def name(self) -> str:
        return self.flag or f"--{self.field.replace('_', '-')}"

    @property
    def dest(self) -> str:
        return self.name.removeprefix("--").replace("-", "_")


# The engine's options, one line each: `add_engine` makes their flags, `engine_config`
# reads them into the EngineConfig, and `engine_args` passes them on from `epd serve`
# to its instances. (The dtype has its own flag, shared with the other roles;
# --threads-while-encoding is `epd serve`'s own decision, add_threads_while_encoding.)
ENGINE_OPTIONS = (
    EngineOption("device"),
    EngineOption("max_model_len"),
    EngineOption("kv_cache_bytes", "--kv-cache-mb", scale=MIB),
    EngineOption("page_size"),
    EngineOption("max_num_seqs", scheduler=True),
    EngineOption("max_num_batched_tokens", scheduler=True),
    EngineOption(
        "attention",
        choices=("auto", "torch", "cpu", "flashinfer"),
        help="auto: FlashInfer on CUDA; on CPU in float32 or bfloat16 the compiled paged "
        "decode kernel (built on first use with the machine's C compiler), else torch (SDPA)",
    ),
    EngineOption(
        "decode_threads",
        help="OpenMP threads of a step that only decodes (0: all; fewer leave cores to the "
        "processes that stream the tokens, where they share the engine's)",
    ),
    EngineOption(
        "cuda_graphs",
        "--no-cuda-graphs",
        negated=True,
        help="run decode steps eagerly on CUDA (by default they replay captured CUDA graphs)",
    ),
    EngineOption(
        "prefix_caching",
        "--no-prefix-caching",
        negated=True,
        help="compute every prompt whole (by default a prompt's text before its first image "
        "reuses the KV pages of earlier prompts that began the same)",
    ),
)


def add_engine(p: argparse.ArgumentParser) -> None:
    """ENGINE_OPTIONS' flags, each typed and defaulted by its field."""
    from services.language.engine.config import EngineConfig
    from services.language.engine.scheduler import SchedulerConfig

    for option in ENGINE_OPTIONS:
        if option.negated:
            p.add_argument(option.name, action="store_true", help=option.help)
            continue
        config = SchedulerConfig if option.scheduler else EngineConfig
        kwargs: dict[str, Any] = {"help": option.help}
        if option.choices:
            kwargs["choices"] = option.choices
        field_option(p, config, option.field, option.name, scale=option.scale, **kwargs)


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The EngineConfig a language (or monolithic) instance's flags describe."""
    from services.language.engine.config import EngineConfig
    from services.language.engine.scheduler import SchedulerConfig
    from services.wire.dtypes import resolve_dtype

    values: dict[str, Any] = {
        o.field: not getattr(args, o.dest) if o.negated else getattr(args, o.dest) * o.scale
        for o in ENGINE_OPTIONS
    }
    scheduling = {o.field: values.pop(o.field) for o in ENGINE_OPTIONS if o.scheduler}
    scheduler = SchedulerConfig(**scheduling)
    return EngineConfig(
        **values,
        scheduler=scheduler,
        dtype=resolve_dtype(args.dtype, args.device),
        threads_while_encoding=getattr(args, "threads_while_encoding", 0),
        decode_interval_while_encoding_ms=getattr(args, "decode_interval_while_encoding_ms", 0),
    )


def add_engine_process(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--engine-process",
        choices=("auto", "on", "off"),
        default="auto",
        help="run a language instance's engine loop in a child process, away from the GIL "
        "the gRPC threads take (auto: on for a CPU instance that does prefill and decode both)",
    )


def add_threads_while_encoding(p: argparse.ArgumentParser, serve: bool) -> None:
    auto = (
        " (default: half the CPUs where the language instance shares its cores with the "
        "vision side, one language instance and no --encoder-cpus/--language-cpus; else all)"
        if serve
        else " (0: all)"
    )
    p.add_argument(
        "--threads-while-encoding",
        type=int,
        default=None if serve else 0,
        help="OpenMP threads of the language engine's steps while its requests await their "
        "embeddings: where the vision tower computes on the same cores, the two split them" + auto,
    )


def add_decode_interval_while_encoding(p: argparse.ArgumentParser, serve: bool) -> None:
    from services.launcher.serve import DECODE_INTERVAL_WHILE_ENCODING_MS

    auto = (
        f" (default: {DECODE_INTERVAL_WHILE_ENCODING_MS} where the language instance shares "
        "its cores with the vision side, as for --threads-while-encoding; else 0)"
        if serve
        else " (0: back to back)"
    )
    p.add_argument(
        "--decode-interval-while-encoding-ms",
        type=int,
        default=None if serve else 0,
        help="while the language engine's requests await their embeddings, run a step that "
        "only decodes this many ms after the last step ended: a vision tower on the same cores "
        "computes in between (earlier first tokens for images, a longer TPOT meanwhile)" + auto,
    )


def engine_args(args: argparse.Namespace) -> list[str]:
    """The engine flags `epd serve` passes on to its language (or monolithic) instances."""
    passed: list[str] = []
    for option in ENGINE_OPTIONS:
        value = getattr(args, option.dest)
        if not option.negated:
            passed += [option.name, str(value)]
        elif value:
            passed.append(option.name)
    return passed


def add_prefill_while_encoding(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--no-prefill-while-encoding",
        action="store_true",
        help="a request's images go to Triton together and to the language instance once all "
        "are encoded, and it prefills only then (by default each image goes as soon as it is "
        "encoded, and the prompt is prefilled up to the first image still missing meanwhile)",
    )


def add_responses_store(p: argparse.ArgumentParser) -> None:
    """The bounds of the Responses API's stored responses."""
    from services.gateway.config import GatewayConfig

    field_option(
        p,
        GatewayConfig,
        "responses_store_bytes",
        "--responses-store-mb",
        scale=MIB,
        help="the Responses API's stored responses: the oldest go beyond this",
    )
    field_option(
        p,
        GatewayConfig,
        "responses_ttl_s",
        "--responses-ttl",
        help="seconds a stored response (previous_response_id, GET) is kept",
    )


def add_gateway_common(p: argparse.ArgumentParser) -> None:
    """The flags of a gateway, in front of a broker or of the monolithic engine."""
    from services.gateway.config import FetchPolicy, GatewayConfig

    field_option(p, GatewayConfig, "host")
    field_option(p, GatewayConfig, "port")
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
    add_limits(p)
    field_option(
        p, FetchPolicy, "timeout_s", "--fetch-timeout", help="seconds for a remote image URL"
    )
    p.add_argument(
        "--allow-private-urls",
        action="store_true",
        help="let image URLs reach loopback/private/link-local addresses",
    )
    field_option(
        p,
        GatewayConfig,
        "max_concurrent_requests",
        help="requests in flight beyond which new ones get 429 with Retry-After",
    )
    field_option(
        p,
        GatewayConfig,
        "max_body_bytes",
        "--max-body-mb",
        scale=MIB,
        help="request bodies over this are refused (413)",
    )
    add_responses_store(p)
    field_option(
        p,
        GatewayConfig,
        "encode_timeout_s",
        "--encode-timeout",
        help="seconds for one encoder's Encode",
    )
    p.add_argument(
        "--served-model",
        action="append",
        help="a model this gateway serves: 503 (not 404) while no instance is up; repeatable",
    )


# -- one builder per command -------------------------------------------------------


def protos(p: argparse.ArgumentParser) -> None:
    p.add_argument("--check", action="store_true", help="fail if the generated code is stale")


def demo_model(p: argparse.ArgumentParser) -> None:
    p.add_argument("dir", help="output folder")
    p.add_argument("--size", choices=DEMO_SIZES, default="tiny")
    p.add_argument(
        "--arch", choices=("qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe"), default="qwen2_5_vl"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--template",
        choices=("tools", "released"),
        default="tools",
        help="its chat template: the project's, which renders tools, or the one the "
        "Qwen2.5-VL checkpoints were released with, which does not",
    )


def broker(p: argparse.ArgumentParser) -> None:
    from services.broker.config import BrokerConfig

    field_option(p, BrokerConfig, "host")
    field_option(p, BrokerConfig, "port")
    field_option(p, BrokerConfig, "metrics_port")
    field_option(p, BrokerConfig, "heartbeat_interval_s", "--heartbeat-interval")
    field_option(p, BrokerConfig, "heartbeat_timeout_s", "--heartbeat-timeout")
    field_option(p, BrokerConfig, "rendezvous_ttl_s", "--rendezvous-ttl")
    field_option(
        p,
        BrokerConfig,
        "route_wait_s",
        "--route-wait",
        help="seconds a request waits for an instance to attach before 503 (after a restart)",
    )
    add_routing(p)
    add_security(p)
    add_tracing(p)


def encoder_count(value: str) -> int | str:
    if value == "auto":
        return value
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a number or auto") from None


def add_planner(p: argparse.ArgumentParser) -> None:
    """PlannerConfig's fields (services/launcher/planner.py), for --encoders auto."""
    from services.launcher.planner import PlannerConfig

    for name, flag, meaning in (
        ("min_encoders", "--min-encoders", "the fewest encoders it runs"),
        ("max_encoders", "--max-encoders", "the most encoders it runs"),
        ("queue_per_encoder", "--queue-per-encoder", "add one when more encodes wait each ..."),
        ("latency_target_s", "--encode-latency-target", "... or encodes take longer (s) ..."),
        ("up_after_s", "--scale-up-after", "... for this long (s)"),
        ("down_after_s", "--scale-down-after", "retire one after a quiet this long (s)"),
        ("cooldown_s", "--scale-cooldown", "at least this long between two changes (s)"),
    ):
        field_option(p, PlannerConfig, name, flag, help=meaning)


def add_routing(p: argparse.ArgumentParser) -> None:
    """How the broker picks an encoder and a language instance for a request."""
    from services.broker.config import ENCODER_ROUTINGS, LANGUAGE_ROUTINGS, BrokerConfig

    field_option(
        p,
        BrokerConfig,
        "encoder_routing",
        choices=ENCODER_ROUTINGS,
        help="which encoder takes a request's images: the one whose cache holds the most "
        "of them, within a load bound (cache), or ignoring caches",
    )
    field_option(
        p,
        BrokerConfig,
        "language_routing",
        choices=LANGUAGE_ROUTINGS,
        help="which language instance takes a request: the one sent the longest part of "
        "its chat before, within the load bound (prefix: a conversation's turns meet the "
        "KV its prefix cache holds), or the least loaded",
    )
    field_option(p, BrokerConfig, "load_factor", help="cache routing's load bound: x the least")
    field_option(p, BrokerConfig, "load_slack", help="cache routing's load bound: + this")


def triton(p: argparse.ArgumentParser) -> None:
    from services.triton.launcher import TritonConfig

    add_checkpoint(p)
    p.add_argument(
        "--model-repository", type=Path, default=default(TritonConfig, "model_repository")
    )
    p.add_argument("--model-config-name", help="e.g. gpu: use configs/gpu.pbtxt")
    field_option(p, TritonConfig, "host")
    field_option(p, TritonConfig, "http_port")
    field_option(p, TritonConfig, "grpc_port")
    field_option(p, TritonConfig, "metrics_port")
    add_dtype(p, "the vision tower's dtype")
    add_triton_tracing(p)


def encoder(p: argparse.ArgumentParser) -> None:
    from services.encoder.config import EncoderConfig

    add_instance(p, EncoderConfig)
    add_dtype(p, "embedding dtype (the language instances' dtype)")
    p.add_argument(
        "--triton", default=env.TRITON_URL.get(), help="Triton gRPC address ($EPD_TRITON_URL)"
    )
    p.add_argument(
        "--triton-http",
        default=env.TRITON_HTTP_URL.get(),
        help="Triton HTTP address, for the infers of traced requests: Triton's gRPC server "
        "misreads their traceparent ($EPD_TRITON_HTTP_URL; default: none, all over gRPC)",
    )
    p.add_argument("--no-triton-shm", action="store_true", help="send tensors to Triton over gRPC")
    add_limits(p)
    field_option(p, EncoderConfig, "cache_bytes", "--cache-mb", scale=MIB)
    field_option(p, EncoderConfig, "send_buffer_tokens")
    field_option(
        p,
        EncoderConfig,
        "max_pending",
        help="encodes in progress beyond which new ones get RESOURCE_EXHAUSTED",
    )
    field_option(
        p,
        EncoderConfig,
        "buffer_wait_s",
        "--buffer-wait",
        help="seconds an encode waits for send-buffer room",
    )
    add_prefill_while_encoding(p)
    add_security(p)
    add_tracing(p)


def language(p: argparse.ArgumentParser) -> None:
    from services.language.config import LanguageConfig
    from services.wire.messages import LanguageRole

    add_instance(p, LanguageConfig)
    p.add_argument(
        "--role",
        choices=[r.name.lower() for r in LanguageRole],
        default="both",
        help="E/P/D: prefill hands each request's KV pages to a decode instance after its "
        "first token; decode takes them from one; both does both steps (default)",
    )
    add_chat_template(p)
    add_engine(p)
    add_dtype(p, "model dtype (and the embeddings')")
    add_engine_process(p)
    add_threads_while_encoding(p, serve=False)
    add_decode_interval_while_encoding(p, serve=False)
    add_prefill_while_encoding(p)
    field_option(p, LanguageConfig, "embedding_pool_tokens")
    field_option(p, LanguageConfig, "default_allocate_tokens")
    field_option(
        p,
        LanguageConfig,
        "max_active_requests",
        help="requests in flight (receiving or generating) beyond which new ones get "
        "RESOURCE_EXHAUSTED",
    )
    field_option(
        p,
        LanguageConfig,
        "pool_wait_s",
        "--pool-wait",
        help="seconds a request waits for receive blocks",
    )
    field_option(
        p,
        LanguageConfig,
        "quarantine_s",
        "--quarantine",
        help="seconds receive blocks stay out of use after their request ended while an "
        "encoder may still write them (unless it says it stopped)",
    )
    add_security(p)
    add_tracing(p)


def gateway(p: argparse.ArgumentParser) -> None:
    add_gateway_common(p)
    p.add_argument("--broker", default=env.BROKER.get(), help="broker address ($EPD_BROKER)")
    add_security(p)
    add_tracing(p)


def monolithic(p: argparse.ArgumentParser) -> None:
    add_gateway_common(p)
    add_chat_template(p)
    add_engine(p)
    add_dtype(p, "model dtype")
    p.add_argument("--model-name", help="served model name (default: the folder's name)")


def trace(p: argparse.ArgumentParser) -> None:
    p.add_argument("request_id", help="the request's id (the `id` of its response)")
    p.add_argument("--broker", default=env.BROKER.get(), help="broker address ($EPD_BROKER)")
    p.add_argument(
        "--gateway",
        default=f"http://127.0.0.1:{ports.GATEWAY_PORT}",
        help="the gateway's URL (empty: leave its steps out)",
    )
    p.add_argument("--api-key", default=env.API_KEY.get(), help="the gateway's ($EPD_API_KEY)")
    add_security(p)


def health(p: argparse.ArgumentParser) -> None:
    p.add_argument("target", help="host:port of a gRPC server, or http(s)://... for an HTTP check")
    p.add_argument("--service", default="", help="gRPC service name (default: the server)")
    add_security(p)


def serve(p: argparse.ArgumentParser) -> None:
    """`epd serve`'s options: the model and its front door, how many of each
    component, where they run, the engine, the cores, supervision."""
    from services.launcher.serve import StackConfig

    p.add_argument("--model", help="checkpoint folder (default: the demo checkpoint)")
    p.add_argument("--model-name", help="served model name (default: the folder's name)")
    add_chat_template(p)
    p.add_argument("--demo-size", choices=DEMO_SIZES, default="tiny")
    p.add_argument(
        "--monolithic",
        action="store_true",
        help="one process, no Triton and no broker: the baseline to compare with",
    )
    field_option(
        p,
        StackConfig,
        "host",
        help="address the gateway binds (0.0.0.0: all); the other components listen "
        "on 127.0.0.1 only",
    )
    field_option(p, StackConfig, "port", help="the gateway's port")
    p.add_argument("--api-key", default=env.API_KEY.get())
    p.add_argument("--allow-private-urls", action="store_true")
    add_engine(p)
    add_engine_process(p)
    add_threads_while_encoding(p, serve=True)
    add_decode_interval_while_encoding(p, serve=True)
    add_prefill_while_encoding(p)
    add_dtype(p, "dtype of the vision tower, the embeddings and the language model")
    _serve_scale(p)
    _serve_hosts(p)
    _serve_operation(p)


def _serve_scale(p: argparse.ArgumentParser) -> None:
    from services.launcher.serve import StackConfig

    p.add_argument(
        "--encoders",
        type=encoder_count,
        default=default(StackConfig, "num_encoders"),
        help="encoder instances, or auto: the planner starts and retires them with their "
        "load, between --min-encoders and --max-encoders",
    )
    add_planner(p)
    p.add_argument(
        "--encoder-cache-mb",
        type=int,
        default=0,
        help="each encoder's embedding cache (default: `epd encoder --cache-mb`'s)",
    )
    add_routing(p)
    p.add_argument(
        "--languages",
        type=int,
        default=None,
        help=f"language instances, each doing prefill and decode "
        f"(default {default(StackConfig, 'num_languages')})",
    )
    field_option(
        p,
        StackConfig,
        "num_prefill",
        "--prefill",
        help="E/P/D: prefill instances (with --decode, in place of --languages)",
    )
    field_option(p, StackConfig, "num_decode", "--decode", help="E/P/D: decode instances")


def _serve_hosts(p: argparse.ArgumentParser) -> None:
    from services.launcher.serve import StackConfig

    p.add_argument(
        "--roles",
        default=",".join(default(StackConfig, "roles")),
        help="several machines: this host's share, comma-separated from "
        f"{','.join(default(StackConfig, 'roles'))} (default: all of them)",
    )
    p.add_argument(
        "--broker",
        default=os.environ.get(env.BROKER.name, ""),
        help="the broker's HOST:PORT when this host runs none ($EPD_BROKER)",
    )
    p.add_argument(
        "--advertise-host",
        default="",
        help="the address other hosts dial this host's components at (they then listen "
        "on every address; default: this machine only)",
    )
    p.add_argument(
        "--language-transports",
        type=transports,
        help="comma-separated transports the language instances offer (embeddings in; "
        "E/P/D: KV pages between them), default: each instance's",
    )
    field_option(p, StackConfig, "broker_port")
    field_option(p, StackConfig, "encoder_port", help="the first encoder's port")
    field_option(p, StackConfig, "language_port", help="the first language port")
    http, grpc, metrics = default(StackConfig, "triton_ports")
    p.add_argument("--triton-http-port", type=int, default=http)
    p.add_argument("--triton-grpc-port", type=int, default=grpc)
    p.add_argument("--triton-metrics-port", type=int, default=metrics)


def _serve_operation(p: argparse.ArgumentParser) -> None:
    """Where the components run, their supervision, logs, security and tracing."""
    from services.launcher.serve import StackConfig

    field_option(
        p,
        StackConfig,
        "encoder_cpus",
        help="CPUs for Triton and the encoders, e.g. 1 or 4-7 (default: all)",
    )
    field_option(
        p,
        StackConfig,
        "language_cpus",
        help="CPUs for the language instances, e.g. 0 or 0-3 (default: all); sets "
        "separated by / go to the instances in turn, prefill instances first (0/1)",
    )
    field_option(
        p,
        StackConfig,
        "encoder_nice",
        help="niceness for Triton and the encoders (e.g. 10): the language "
        "engine gets the CPU first when they contend",
    )
    field_option(
        p,
        StackConfig,
        "max_restarts",
        help="a component that dies is restarted; this many restarts within "
        "--restart-window seconds stop the stack",
    )
    field_option(p, StackConfig, "restart_window_s", "--restart-window")
    field_option(
        p,
        StackConfig,
        "shutdown_grace_s",
        "--shutdown-grace",
        help="seconds each component gives its requests in flight on Ctrl-C or SIGTERM "
        "($EPD_SHUTDOWN_GRACE)",
    )
    p.add_argument("--log-dir", help="component logs (default: $EPD_CACHE_DIR/logs)")
    add_security(p)
    add_tracing(p)
    add_triton_tracing(p)
