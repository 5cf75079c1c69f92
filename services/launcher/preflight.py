"""What `epd serve` checks before it starts anything: a configuration that cannot
work is refused with one line that names the flag to change (exit code 2),
not with a child's traceback in a log.

Checked: a port this host's share would listen on that something already
holds, or that another `epd serve` here has claimed (each holds its claims
until its stack is down); no encoder where images need one; a model folder
without the image processor's configuration; a KV cache that holds fewer tokens than
--max-model-len. Reads only files and sockets: no torch, no transformers.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from pathlib import Path
from typing import Any

from services.launcher.serve import LOCAL, StackConfig
from services.runtime.ports import PortClaims, holder, listened_on

MIB = 1024 * 1024
ELEMENT_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json")


class ConfigError(ValueError):
    """A configuration that cannot work: one line that names the flags to change."""


def check_stack(config: StackConfig, engine: dict[str, Any]) -> PortClaims:
    """`engine`: the flags `epd serve` passes the language instances, by name
    (kv_cache_mb, max_model_len, page_size). Returns the claims on this host's
    ports, for the caller to hold while the stack runs."""
    roles = set(config.roles)
    if config.num_encoders < 1 and "encoder" in roles and not config.monolithic:
        raise ConfigError(
            "--encoders 0 leaves no encoder for images: give --encoders 1 or more, or auto"
        )
    if "language" in roles or "encoder" in roles or config.monolithic:
        _check_processor(config.checkpoint)
    if "language" in roles or config.monolithic:
        _check_kv(config, engine)
    return check_ports(config)


def _ports(config: StackConfig) -> list[tuple[int, str, str]]:
    """(port, its flag, the address it binds) of each listener of this host's share."""
    roles, bind, offset = set(config.roles), config.listen_host, config.metrics_offset
    front = "gateway" in roles or config.monolithic
    ports = [(config.port, "--port", config.host)] if front else []
    if config.monolithic:
        return ports
    grpc = []
    if "broker" in roles:
        grpc.append((config.broker_port, "--broker-port"))
    if "encoder" in roles:
        most = config.planner.max_encoders if config.planner else config.num_encoders
        grpc += [(config.encoder_port + i, "--encoder-port") for i in range(most)]
    if "language" in roles:
        count = len(config.languages)
        grpc += [(config.language_port + i, "--language-port") for i in range(count)]
    for port, flag in grpc:
        metrics = f"{flag} (its metrics: + --metrics-offset)"
        ports += [(port, flag, bind), (port + offset, metrics, bind)]
    if "triton" in roles:
        ports += [
            (config.triton_http_port, "--triton-http-port", LOCAL),
            (config.triton_grpc_port, "--triton-grpc-port", LOCAL),
            (config.triton_metrics_port, "--triton-metrics-port", LOCAL),
        ]
    return ports


def check_ports(config: StackConfig) -> PortClaims:
    """Two listeners on one port first (the flags alone say so), then a port that
    something on this machine holds, then one another `epd serve` has claimed and
    not bound (started at the same moment, or an encoder its planner may add).
    Returns the claims."""
    ports = _ports(config)
    seen: dict[int, str] = {}
    for port, flag, _ in ports:
        if port in seen:
            raise ConfigError(
                f"port {port} is both {_named(seen[port], port)} and {_named(flag, port)}: "
                "move one of them, or every port with --port-base"
            )
        seen[port] = flag
    for port, flag, host in ports:
        if listened_on(host, [port]):
            what = holder(port) or "another epd serve?"
            raise ConfigError(
                f"port {port} ({flag}) is in use on this machine ({what}): "
                f"choose another with {flag.split()[0]}, or --port-base"
            )
    claims = PortClaims()
    for port, flag, _ in sorted(ports):  # one order: of two twins, one claims them all
        held = claims.take(port)
        if held is not None:
            claims.close()
            raise ConfigError(
                f"port {port} ({flag}) is claimed by another epd serve on this machine "
                f"({held}) that has not bound it yet: choose another with "
                f"{flag.split()[0]}, or --port-base"
            )
    return claims


def _named(flag: str, port: int) -> str:
    """The flag, and "(its default)" where the port is that flag's default: a user
    who gave only --port 8010 learns where the other 8010 came from."""
    name = flag.split()[0].removeprefix("--").replace("-", "_")
    defaults = {f.name: f.default for f in dataclasses.fields(StackConfig)}
    return f"{flag} (its default)" if defaults.get(name) == port else flag


def _check_processor(checkpoint: Path) -> None:
    if not any((checkpoint / name).is_file() for name in PROCESSOR_FILES):
        raise ConfigError(
            f"--model {checkpoint} has no {PROCESSOR_FILES[0]}: the image processor's "
            "configuration the encoders and the language instances read"
        )


def _check_kv(config: StackConfig, engine: dict[str, Any]) -> None:
    """The KV cache holds at least one request of --max-model-len tokens."""
    text = _text_config(config.checkpoint)
    if text is None:
        return  # the model's own loader says what is wrong with it
    head_dim = text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"]
    kv_heads = text.get("num_key_value_heads", text["num_attention_heads"])
    page = engine["page_size"]
    page_bytes = text["num_hidden_layers"] * 2 * page * kv_heads * head_dim
    page_bytes *= ELEMENT_BYTES.get(config.dtype, 4)
    tokens = engine["kv_cache_mb"] * MIB // page_bytes * page
    wanted = engine["max_model_len"]
    if tokens < wanted:
        needed = -(-(-(-wanted // page) * page_bytes) // MIB)
        raise ConfigError(
            f"--kv-cache-mb {engine['kv_cache_mb']} holds {tokens} tokens of this model in "
            f"{config.dtype}, fewer than --max-model-len {wanted}: give --kv-cache-mb "
            f"{needed} or more, or a smaller --max-model-len"
        )


def _text_config(checkpoint: Path) -> dict[str, Any] | None:
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
        config = json.loads((checkpoint / "config.json").read_text())
        text = config.get("text_config") or config
        if all(k in text for k in ("num_hidden_layers", "num_attention_heads", "hidden_size")):
            return dict(text)
    return None
