"""The `epd` command's flags, one builder per command.

A flag that sets a config field is declared once, in services/launcher/options.py's
tables; the builders here add those and the flags that are no field's (security,
tracing, the dtype every component resolves on its own device). Each builder
imports only its own command's config classes: `epd triton`, `epd broker` and
`epd gateway` import no torch and no server (tests/test_package_graph.py).
"""

from __future__ import annotations

import argparse

from services.launcher import options
from services.launcher.options import MIB
from services.runtime import env, ports

__all__ = ["MIB"]

# services.wire.dtypes' names and `auto`, spelled out so that parsing needs no
# torch (checked equal by the tests); each process resolves the name where it
# knows its device.
DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16")
# services.model.demo's SIZES, spelled out for the same reason
DEMO_SIZES = ("tiny", "small", "medium", "tiny-gpu")

# What compose's required EPD_API_KEY is set to for a gateway open to anyone.
NO_API_KEY = "disabled"


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


def add_checkpoint(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--checkpoint",
        default=env.CHECKPOINT.get(),
        required=not env.CHECKPOINT.get(),
        help="checkpoint folder ($EPD_CHECKPOINT)",
    )


def add_model_name(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model-name", help="served model name (default: the folder's name)")


def add_engine_process(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--engine-process",
        choices=("auto", "on", "off"),
        default="auto",
        help="run a language instance's engine loop in a child process, away from the GIL "
        "the gRPC threads take (auto: on for a CPU instance that does prefill and decode both)",
    )


def add_gateway_common(p: argparse.ArgumentParser) -> None:
    """The flags of a gateway, in front of a broker or of the monolithic engine."""
    options.add(p, options.GATEWAY)
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
    options.add(p, options.BROKER)
    add_security(p)
    add_tracing(p)


def encoder_count(value: str) -> int | str:
    if value == "auto":
        return value
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a number or auto") from None


def triton(p: argparse.ArgumentParser) -> None:
    add_checkpoint(p)
    options.add(p, options.TRITON)
    add_dtype(p, "the vision tower's dtype")
    add_triton_tracing(p)


def encoder(p: argparse.ArgumentParser) -> None:
    add_checkpoint(p)
    add_model_name(p)
    options.add(p, options.ENCODER)
    add_dtype(p, "embedding dtype (the language instances' dtype)")
    add_security(p)
    add_tracing(p)


def language(p: argparse.ArgumentParser) -> None:
    from services.wire.messages import LanguageRole

    add_checkpoint(p)
    add_model_name(p)
    options.add(p, options.LANGUAGE)
    p.add_argument(
        "--role",
        choices=[r.name.lower() for r in LanguageRole],
        default="both",
        help="E/P/D: prefill hands each request's KV pages to a decode instance after its "
        "first token; decode takes them from one; both does both steps (default)",
    )
    add_dtype(p, "model dtype (and the embeddings')")
    add_engine_process(p)
    add_security(p)
    add_tracing(p)


def gateway(p: argparse.ArgumentParser) -> None:
    add_gateway_common(p)
    p.add_argument("--broker", default=env.BROKER.get(), help="broker address ($EPD_BROKER)")
    add_security(p)
    add_tracing(p)


def monolithic(p: argparse.ArgumentParser) -> None:
    add_gateway_common(p)
    options.add(p, options.ENGINE_TABLE)
    options.add_flag(p, options.CHAT_TEMPLATE, options.CHAT_TEMPLATE.name, None)
    add_dtype(p, "model dtype")
    add_model_name(p)


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
    """`epd serve`'s options: the model, the stack's own (options.STACK), how many
    of each component, and what it passes on to them (options.SERVED)."""
    from services.launcher.serve import ROLES, StackConfig

    p.add_argument("--model", help="checkpoint folder (default: the demo checkpoint)")
    add_model_name(p)
    p.add_argument("--demo-size", choices=DEMO_SIZES, default="tiny")
    options.add(p, options.STACK)
    options.add_served(p, options.SERVED)
    add_engine_process(p)
    add_dtype(p, "dtype of the vision tower, the embeddings and the language model")
    p.add_argument(
        "--encoders",
        type=encoder_count,
        default=options.field_default(StackConfig, "num_encoders"),
        help="encoder instances, or auto: the planner starts and retires them with their "
        "load, between --min-encoders and --max-encoders",
    )
    options.add(p, options.PLANNER)
    p.add_argument(
        "--languages", type=int, help="language instances, each doing prefill and decode (1)"
    )
    p.add_argument(
        "--roles",
        default=",".join(ROLES),
        help=f"several machines: this host's share, comma-separated from {','.join(ROLES)} "
        "(default: all of them)",
    )
    p.add_argument(
        "--port-base",
        type=int,
        help="every port of the stack in one block from this one (the gateway's; the broker's "
        "+1, Triton's +2..4, the encoders' from +10, the language instances' from +20, each "
        "gRPC port's metrics +100): a second stack on this machine needs only this; a port "
        "flag given as well keeps its value",
    )
    p.add_argument("--log-dir", help="component logs (default: $EPD_CACHE_DIR/logs)")
    add_security(p)
    add_tracing(p)
    add_triton_tracing(p)
