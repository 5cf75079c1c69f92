"""Every component's options, each declared once, in one table per config.

An Option is a config field (a dotted path into a nested config), its flag and
help, and whether `epd serve` takes it too and passes it on to the components
that do (`serve`). A flag is typed and defaulted by its field, so the parser,
the server and the drivers read the same value. From the tables come each
command's flags (`add`), the config its parsed flags describe (`build`), and
the flags `epd serve` gives its components (`passed`). A field no Option sets
is named in its table's `implied`, with the flag of its command that sets it
(tests/test_options.py holds every table complete). Config classes are
imported only by the command that builds them (`epd broker` imports no torch).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from enum import Enum
from pathlib import Path
from typing import Any

from services.broker.config import ENCODER_ROUTINGS, LANGUAGE_ROUTINGS
from services.runtime import env

MIB = 1024 * 1024
SAME = "="  # Option.serve: `epd serve` takes the component's own flag


@dataclass(frozen=True, slots=True)
class Option:
    field: str  # of the table's config; "part.name": of its nested config `part`
    flag: str = ""  # default: --the-name
    help: str | None = None
    scale: int = 1  # the field's units in one of the flag's (MIB: bytes given in MiB)
    negated: bool = False  # a field on by default, turned off by the flag
    choices: tuple[str, ...] | None = None
    parse: Callable[[str], Any] | None = None  # default: the type of the field's default
    default: Callable[[], Any] | None = None  # in place of the field's (an EPD_* variable)
    # `epd serve`'s flag for it (SAME: this one): it takes it and passes it on
    serve: str = ""

    @property
    def name(self) -> str:
        return self.flag or f"--{self.field.rsplit('.', 1)[-1].replace('_', '-')}"

    @property
    def dest(self) -> str:
        return self.name.removeprefix("--").replace("-", "_")

    @property
    def serve_name(self) -> str:
        return self.name if self.serve == SAME else self.serve


@dataclass(frozen=True, slots=True)
class Table:
    config: str  # "module:Class"
    options: tuple[Option, ...]
    # fields no option sets, each with the flag its command sets it from ("": none,
    # the command's own doing)
    implied: tuple[tuple[str, str], ...] = ()

    @property
    def config_class(self) -> type:
        module, _, name = self.config.partition(":")
        cls: type = getattr(importlib.import_module(module), name)
        return cls


def nested(part: str, options: Sequence[Option]) -> tuple[Option, ...]:
    """Options of a nested config, as fields of the one that holds it in `part`."""
    return tuple(replace(o, field=f"{part}.{o.field}") for o in options)


def field_default(config: type, path: str) -> Any:
    """A field's default: of the config's dataclass, then down its nested configs'
    default values."""
    first, *rest = path.split(".")
    value = _class_default(config, first)
    for name in rest:
        value = getattr(value, name)
    return value


def _class_default(config: type, name: str) -> Any:
    for f in dataclasses.fields(config):
        if f.name == name:
            if f.default is not dataclasses.MISSING:
                return f.default
            if f.default_factory is not dataclasses.MISSING:
                return f.default_factory()
            raise TypeError(f"{config.__name__}.{name} has no default")
    raise TypeError(f"{config.__name__} has no field {name}")


def add(p: argparse.ArgumentParser, table: Table) -> None:
    """The table's flags, each typed and defaulted by its field."""
    config = table.config_class
    for option in table.options:
        add_flag(p, option, option.name, field_default(config, option.field))


def add_flag(p: argparse.ArgumentParser, option: Option, name: str, value: Any) -> None:
    """The option's flag named `name`, typed and defaulted by the field's `value`."""
    if option.negated or value is False:  # a flag that turns the field off, or on
        p.add_argument(name, action="store_true", help=option.help)
        return
    if option.default is not None:
        value = option.default()
    elif option.scale != 1:
        value //= option.scale
    parse = option.parse or (str if value is None else type(value))
    p.add_argument(name, type=parse, default=value, choices=option.choices, help=option.help)


def value(option: Option, args: argparse.Namespace) -> Any:
    """The field's value its flag gave."""
    given = getattr(args, option.dest)
    if option.negated:
        return not given
    return given * option.scale if option.scale != 1 else given


def build(table: Table, args: argparse.Namespace, **given: Any) -> Any:
    """The table's config as the parsed flags describe it; `given`: fields the
    command sets itself (its `implied`)."""
    values: dict[str, Any] = {}
    for option in table.options:
        *parts, name = option.field.split(".")
        node = values
        for part in parts:
            node = node.setdefault(part, {})
        node[name] = value(option, args)
    config = table.config_class
    fields = {
        name: _filled(_class_default(config, name), v) if isinstance(v, dict) else v
        for name, v in values.items()
    }
    return config(**fields, **given)


def _filled(base: Any, values: dict[str, Any]) -> Any:
    """A nested config's default with the flags' values in place."""
    return replace(
        base,
        **{
            k: _filled(getattr(base, k), v) if isinstance(v, dict) else v for k, v in values.items()
        },
    )


def add_served(p: argparse.ArgumentParser, tables: Sequence[Table]) -> None:
    """`epd serve`'s flags for what it passes on (each once, defaulted as the
    component's)."""
    seen: set[str] = set()
    for table in tables:
        config = table.config_class
        for option in table.options:
            if option.serve and option.serve_name not in seen:
                seen.add(option.serve_name)
                add_flag(p, option, option.serve_name, field_default(config, option.field))


def passed(given_to: Table | Sequence[Option], args: argparse.Namespace) -> list[str]:
    """The flags `epd serve` gives a component (its table, or its options): each
    option it takes, as `epd serve` was given it."""
    flags: list[str] = []
    for option in given_to.options if isinstance(given_to, Table) else given_to:
        if not option.serve:
            continue
        given = getattr(args, option.serve_name.removeprefix("--").replace("-", "_"))
        if isinstance(given, bool):
            flags += [option.name] if given else []
        elif given is not None:
            flags += [option.name, _shown(given)]
    return flags


def _shown(value: Any) -> str:
    """A flag's value as its command line spells it."""
    if isinstance(value, Path):
        return os.fspath(value.resolve())
    if isinstance(value, tuple):
        return ",".join(v.name.lower() if isinstance(v, Enum) else str(v) for v in value)
    return str(value)


def transports(value: str) -> tuple[Any, ...]:
    from services.wire.transport import Transport

    try:
        return tuple(Transport.parse(name) for name in value.split(",") if name.strip())
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


# -- the tables --------------------------------------------------------------------

INSTANCE = (
    Option("host", help="address to bind (0.0.0.0: all)"),
    Option("port"),
    Option(
        "advertise_host",
        help="the host peers dial (default: --host, or this machine's name when binding 0.0.0.0)",
    ),
    Option("metrics_port", help="Prometheus port (0: any free)"),
    Option("broker", default=env.BROKER.get, help="broker address ($EPD_BROKER)"),
    Option("host_id", default=env.HOST_ID.get, help="same id = shared memory ($EPD_HOST_ID)"),
    Option("instance_id", help="default: role plus a random suffix"),
    Option("transports", parse=transports, help="comma-separated: cuda_ipc, nixl, shm, grpc"),
)
INSTANCE_IMPLIED = (("instance.role", ""),)  # the command's: `epd encoder`, `epd language`

LIMITS = (
    Option("max_images", help="images and videos"),
    Option("max_image_bytes"),
    Option("max_image_pixels"),
    Option("max_video_bytes"),
    Option("max_video_seconds"),
    Option("max_video_frames"),
    Option("max_video_pixels", help="per frame"),
)

_PREFILL_WHILE_ENCODING_HELP = (
    "a request's images go to Triton together and to the language instance once all are "
    "encoded, and it prefills only then (by default each image goes as soon as it is encoded, "
    "and the prompt is prefilled up to the first image still missing meanwhile)"
)


def prefill_while_encoding(field: str) -> Option:
    """The one flag that turns off, on the encoder and the language instance alike,
    sending and prefilling each image as it is encoded (`field`: each one's own)."""
    return Option(
        field,
        "--no-prefill-while-encoding",
        negated=True,
        serve=SAME,
        help=_PREFILL_WHILE_ENCODING_HELP,
    )


BROKER = Table(
    "services.broker.config:BrokerConfig",
    (
        Option("host"),
        Option("port"),
        Option("metrics_port"),
        Option("heartbeat_interval_s", "--heartbeat-interval"),
        Option("heartbeat_timeout_s", "--heartbeat-timeout"),
        Option("rendezvous_ttl_s", "--rendezvous-ttl"),
        Option("tick_s", "--tick", help="seconds between the broker's sweeps of expired state"),
        Option(
            "route_wait_s",
            "--route-wait",
            help="seconds a request waits for an instance to attach before 503 (after a restart)",
        ),
        Option(
            "encoder_routing",
            choices=ENCODER_ROUTINGS,
            serve=SAME,
            help="which encoder "
            "takes a request's images: the one whose cache holds the most of them, within a "
            "load bound (cache), or ignoring caches",
        ),
        Option(
            "language_routing",
            choices=LANGUAGE_ROUTINGS,
            serve=SAME,
            help="which language "
            "instance takes a request: the one sent the longest part of its chat before, "
            "within the load bound (prefix: a conversation's turns meet the KV its prefix "
            "cache holds), or the least loaded",
        ),
        Option("load_factor", serve=SAME, help="cache routing's load bound: x the least"),
        Option("load_slack", serve=SAME, help="cache routing's load bound: + this"),
        Option(
            "peer_cache",
            "--no-peer-cache",
            negated=True,
            serve=SAME,
            help="encode an item on the encoder routed its request even where another "
            "encoder's cache holds it (by default that one sends it: one encode per item in "
            "the cluster)",
        ),
        Option(
            "prefix_moves",
            "--no-prefix-moves",
            negated=True,
            serve=SAME,
            help="compute a chat's KV again on the language instance routed its turn even "
            "where another instance holds it (by default, where moving the pages is cheaper, "
            "that one sends them: a busy instance's conversations move with their KV)",
        ),
    ),
)

TRITON = Table(
    "services.triton.launcher:TritonConfig",
    (
        Option("model_repository"),
        Option("model_name", help="the vision model's name in the repository"),
        Option("model_config_name", help="e.g. gpu: use configs/gpu.pbtxt"),
        Option("host"),
        Option("http_port"),
        Option("grpc_port"),
        Option("metrics_port"),
        Option("startup_timeout_s", "--startup-timeout", help="seconds tritonserver has to load"),
        Option("log_verbose", help="tritonserver's --log-verbose"),
    ),
    (
        ("checkpoint", "--checkpoint"),
        ("dtype", "--dtype"),
        ("otlp_endpoint", "--triton-otlp-endpoint"),
    ),
)

ENCODER = Table(
    "services.encoder.config:EncoderConfig",
    (
        *nested("instance", INSTANCE),
        Option(
            "triton_url",
            "--triton",
            default=env.TRITON_URL.get,
            help="Triton gRPC address ($EPD_TRITON_URL)",
        ),
        Option(
            "triton_http_url",
            "--triton-http",
            default=env.TRITON_HTTP_URL.get,
            help="Triton HTTP address, for the infers of traced requests: Triton's gRPC "
            "server misreads their traceparent ($EPD_TRITON_HTTP_URL; default: none, all "
            "over gRPC)",
        ),
        Option(
            "triton_shared_memory",
            "--no-triton-shm",
            negated=True,
            help="send tensors to Triton over gRPC",
        ),
        Option("triton_timeout_s", "--triton-timeout", help="seconds for one Triton request"),
        Option("triton_max_in_flight", help="Triton requests at once"),
        Option("triton_check_s", "--triton-check", help="seconds between readiness probes"),
        *nested("limits", LIMITS),
        Option("preprocess_workers", help="processes that decode and preprocess images"),
        Option(
            "cache_bytes",
            "--cache-mb",
            scale=MIB,
            serve="--encoder-cache-mb",
            help="the embedding cache",
        ),
        Option("cache_report_s", "--cache-report", help="seconds between cache reports"),
        Option("send_buffer_tokens"),
        Option("send_block_size", help="tokens a send-buffer block holds"),
        Option(
            "max_pending", help="encodes in progress beyond which new ones get RESOURCE_EXHAUSTED"
        ),
        Option(
            "buffer_wait_s", "--buffer-wait", help="seconds an encode waits for send-buffer room"
        ),
        Option(
            "transfer_timeout_s",
            "--transfer-timeout",
            help="seconds a transfer waits for the language side's blocks",
        ),
        Option("write_timeout_s", "--write-timeout", help="seconds one write may take"),
        prefill_while_encoding("items_one_by_one"),
    ),
    (
        ("checkpoint", "--checkpoint"),
        ("model_name", "--model-name"),
        ("dtype", "--dtype"),
        *INSTANCE_IMPLIED,
    ),
)

ENGINE = (
    Option("device", serve=SAME),
    Option("max_model_len", serve=SAME),
    Option("kv_cache_bytes", "--kv-cache-mb", scale=MIB, serve=SAME),
    Option("page_size", serve=SAME),
    Option("scheduler.max_num_seqs", serve=SAME),
    Option("scheduler.max_num_batched_tokens", serve=SAME),
    Option(
        "attention",
        choices=("auto", "torch", "cpu", "flashinfer"),
        serve=SAME,
        help="auto: FlashInfer on CUDA; on CPU in float32 or bfloat16 the compiled paged "
        "decode kernel (built on first use with the machine's C compiler), else torch "
        "(SDPA)",
    ),
    Option(
        "moe",
        choices=("auto", "torch", "flashinfer"),
        serve=SAME,
        help="MoE experts: auto is FlashInfer on CUDA",
    ),
    Option(
        "linear",
        choices=("auto", "torch", "cpu", "avx512", "onednn", "amx", "avx512bf16"),
        serve=SAME,
        help="projections (services/language/engine/config.py: each kind)",
    ),
    Option(
        "ops",
        choices=("auto", "torch", "cpu"),
        serve=SAME,
        help="RMSNorm and rotary embedding: cpu is compiled and fused",
    ),
    Option(
        "decode_layers",
        choices=("auto", "python", "compiled"),
        serve=SAME,
        help="a decode-only step's decoder layers: compiled runs them in one C call",
    ),
    Option(
        "decode_threads",
        serve=SAME,
        help="OpenMP threads of a step that only decodes (0: "
        "all; fewer leave cores to the processes that stream the tokens, where they share "
        "the engine's)",
    ),
    Option(
        "cuda_graphs",
        "--no-cuda-graphs",
        negated=True,
        serve=SAME,
        help="run decode steps eagerly on CUDA (by default they replay captured CUDA graphs)",
    ),
    Option(
        "prefix_caching",
        "--no-prefix-caching",
        negated=True,
        serve=SAME,
        help="compute every prompt whole (by default a prompt's text before its first image "
        "reuses the KV pages of earlier prompts that began the same)",
    ),
    # epd serve decides these per instance (StackConfig)
    Option(
        "threads_while_encoding",
        help="OpenMP threads of the language engine's steps while "
        "its requests await their embeddings: where the vision tower computes on the same "
        "cores, the two split them (0: all)",
    ),
    Option(
        "decode_interval_while_encoding_ms",
        help="while the language engine's requests "
        "await their embeddings, run a step that only decodes this many ms after the last "
        "step ended: a vision tower on the same cores computes in between (earlier first "
        "tokens for images, a longer TPOT meanwhile; 0: back to back)",
    ),
    Option(
        "tpot_slo_ms",
        help="or pace those steps by this TPOT target (ms): a decode step waits until "
        "the target, kept on the mean over each running request's tokens, leaves only "
        "its measured time (0: no target; a decode interval overrides it)",
    ),
    Option(
        "ttft_slo_ms",
        help="and by this TTFT target (ms): the waits come only as the oldest "
        "request awaiting its embeddings needs them, from a quarter of the target since "
        "it came, whole from half (0: whenever requests await them)",
    ),
)
ENGINE_IMPLIED = (("dtype", "--dtype"),)

CHAT_TEMPLATE = Option(
    "chat_template",
    parse=Path,
    serve=SAME,
    help="a chat template file "
    "(Jinja, or a processor's chat_template.json) in place of the "
    "checkpoint's, as vLLM's flag: e.g. one that renders tools for a "
    "checkpoint whose own does not; checked at start-up",
)

LANGUAGE = Table(
    "services.language.config:LanguageConfig",
    (
        *(
            replace(
                o,
                serve="--language-transports",
                help="comma-separated transports the "
                "language instances offer (embeddings in; E/P/D: KV pages between them)",
            )
            if o.field == "instance.transports"
            else o
            for o in nested("instance", INSTANCE)
        ),
        CHAT_TEMPLATE,
        *nested("engine", ENGINE),
        Option("embedding_pool_tokens"),
        Option("embedding_block_size", help="tokens a receive block holds"),
        Option("default_allocate_tokens"),
        Option("transfer_timeout_s", "--transfer-timeout", help="seconds a transfer may take"),
        Option(
            "max_active_requests",
            help="requests in flight (receiving or generating) "
            "beyond which new ones get RESOURCE_EXHAUSTED",
        ),
        Option("pool_wait_s", "--pool-wait", help="seconds a request waits for receive blocks"),
        Option(
            "quarantine_s",
            "--quarantine",
            help="seconds receive blocks stay out of use "
            "after their request ended while an encoder may still write them (unless it "
            "says it stopped)",
        ),
        prefill_while_encoding("prefill_while_encoding"),
    ),
    (
        ("checkpoint", "--checkpoint"),
        ("model_name", "--model-name"),
        ("role", "--role"),
        ("engine_process", "--engine-process"),
        *INSTANCE_IMPLIED,
        *(("engine." + f, flag) for f, flag in ENGINE_IMPLIED),
    ),
)

FETCH = (
    Option("timeout_s", "--fetch-timeout", help="seconds for a remote image URL"),
    Option(
        "allow_private",
        "--allow-private-urls",
        serve=SAME,
        help="let image URLs reach loopback/private/link-local addresses",
    ),
    Option("max_redirects", help="redirects a remote image URL may take"),
)

GATEWAY = Table(
    "services.gateway.config:GatewayConfig",
    (
        Option("host"),
        Option("port"),
        *nested("limits", LIMITS),
        *nested("fetch", FETCH),
        Option("generate_timeout_s", "--generate-timeout", help="seconds for one generation"),
        Option("encode_timeout_s", "--encode-timeout", help="seconds for one encoder's Encode"),
        Option(
            "max_concurrent_requests",
            help="requests in flight beyond which new ones get 429 with Retry-After",
        ),
        Option(
            "max_body_bytes",
            "--max-body-mb",
            scale=MIB,
            help="request bodies over this are refused (413)",
        ),
        Option(
            "responses_store_bytes",
            "--responses-store-mb",
            scale=MIB,
            help="the Responses API's stored responses: the oldest go beyond this",
        ),
        Option(
            "responses_ttl_s",
            "--responses-ttl",
            help="seconds a stored response (previous_response_id, GET) is kept",
        ),
    ),
    (
        ("broker", "--broker"),
        ("checkpoint", "--checkpoint"),
        ("api_key", "--api-key"),
        ("served_models", "--served-model"),
    ),
)

ENGINE_TABLE = Table("services.language.engine.config:EngineConfig", ENGINE, ENGINE_IMPLIED)
# what `epd serve` passes to `epd monolithic` (a gateway's options, and an engine's)
MONOLITHIC = (CHAT_TEMPLATE, *ENGINE)

PLANNER = Table(
    "services.launcher.planner:PlannerConfig",
    (
        Option("min_encoders", help="the fewest encoders it runs"),
        Option("max_encoders", help="the most encoders it runs"),
        Option("queue_per_encoder", help="add one when more encodes wait each ..."),
        Option(
            "latency_target_s", "--encode-latency-target", help="... or encodes take longer (s) ..."
        ),
        Option("up_after_s", "--scale-up-after", help="... for this long (s)"),
        Option("down_after_s", "--scale-down-after", help="retire one after a quiet this long (s)"),
        Option("cooldown_s", "--scale-cooldown", help="at least this long between two changes (s)"),
    ),
)

STACK = Table(
    "services.launcher.serve:StackConfig",
    (
        Option(
            "host",
            help="address the gateway binds (0.0.0.0: all); the other components "
            "listen on 127.0.0.1 only",
        ),
        Option("port", help="the gateway's port"),
        Option("api_key", default=env.API_KEY.get, help="the gateway's ($EPD_API_KEY)"),
        Option(
            "num_prefill",
            "--prefill",
            help="E/P/D: prefill instances (with --decode, in place of --languages)",
        ),
        Option("num_decode", "--decode", help="E/P/D: decode instances"),
        Option(
            "broker",
            default=lambda: os.environ.get(env.BROKER.name, ""),
            help="the broker's HOST:PORT when this host runs none ($EPD_BROKER)",
        ),
        Option(
            "advertise_host",
            help="the address other hosts dial this host's components at "
            "(they then listen on every address; default: this machine only)",
        ),
        Option("broker_port"),
        Option("encoder_port", help="the first encoder's port"),
        Option("language_port", help="the first language port"),
        Option("triton_http_port"),
        Option("triton_grpc_port"),
        Option("triton_metrics_port"),
        Option("metrics_offset", help="a gRPC component's metrics port: its own + this"),
        Option(
            "startup_timeout_s", "--startup-timeout", help="seconds every component has to come up"
        ),
        Option(
            "threads_while_encoding",
            parse=int,
            help="the language engine's threads while "
            "its requests await their embeddings (default: half the CPUs where the language "
            "instance shares its cores with the vision side, one language instance and no "
            "--encoder-cpus/--language-cpus; else all)",
        ),
        Option(
            "decode_interval_while_encoding_ms",
            parse=int,
            help="how long a step that only "
            "decodes waits meanwhile, fixed (default: paced by --tpot-slo-ms)",
        ),
        Option(
            "tpot_slo_ms",
            parse=int,
            help="the running requests' TPOT target (ms): "
            "where the vision side shares the language instance's cores (as for "
            "--threads-while-encoding), a step that only decodes waits, while images "
            "encode, until the target (a mean over each request's tokens) leaves only a "
            "decode step's measured time, and the tower computes in between (0: back to "
            "back)",
        ),
        Option(
            "ttft_slo_ms",
            parse=int,
            help="the image requests' TTFT target (ms): those waits come only "
            "as the oldest request awaiting its embeddings needs them (0: whenever "
            "requests await them)",
        ),
        Option("monolithic", help="one process, no Triton and no broker: the baseline"),
        Option(
            "encoder_cpus", help="CPUs for Triton and the encoders, e.g. 1 or 4-7 (default: all)"
        ),
        Option(
            "language_cpus",
            help="CPUs for the language instances, e.g. 0 or 0-3 (default: "
            "all); sets separated by / go to the instances in turn, prefill instances "
            "first (0/1)",
        ),
        Option(
            "encoder_nice",
            help="niceness for Triton and the encoders (e.g. 10): the "
            "language engine gets the CPU first when they contend",
        ),
        Option(
            "max_restarts",
            help="a component that dies is restarted; this many restarts "
            "within --restart-window seconds stop the stack",
        ),
        Option("restart_window_s", "--restart-window"),
        Option(
            "restart_backoff_s",
            "--restart-backoff",
            help="seconds before a restart, doubled for each recent one",
        ),
        Option(
            "shutdown_grace_s",
            "--shutdown-grace",
            help="seconds each component gives its "
            "requests in flight on Ctrl-C or SIGTERM ($EPD_SHUTDOWN_GRACE)",
        ),
    ),
    (
        ("checkpoint", "--model"),
        ("model_name", "--model-name"),
        ("log_dir", "--log-dir"),
        ("num_encoders", "--encoders"),
        ("planner", "--encoders"),
        ("num_languages", "--languages"),
        ("roles", "--roles"),
        ("dtype", "--dtype"),
        ("language_args", ""),
        ("gateway_args", ""),
        ("broker_args", ""),
        ("encoder_args", ""),
    ),
)
# the components' tables whose options `epd serve` passes on
SERVED = (LANGUAGE, ENCODER, BROKER, GATEWAY)
