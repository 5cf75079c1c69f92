"""services/launcher/options.py's tables: every config field is set by a flag, and
`epd serve` hands every option it takes on to the component that reads it."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from services.launcher import cli, options
from services.launcher.options import Option, Table
from services.launcher.serve import StackConfig, components

TABLES = {
    "broker": options.BROKER,
    "triton": options.TRITON,
    "encoder": options.ENCODER,
    "language": options.LANGUAGE,
    "gateway": options.GATEWAY,
    "monolithic": options.ENGINE_TABLE,
    "serve": options.STACK,
}


def _flags(command: str) -> set[str]:
    parser = cli.build_parser(command)
    (sub,) = [a for a in parser._actions if a.dest == "command"]
    return {flag for a in sub.choices[command]._actions for flag in a.option_strings}


def _unset(config: type, prefix: str, table: Table) -> list[str]:
    """The fields of `config` (at `prefix`) that no option and no `implied` sets."""
    fields = {o.field for o in table.options} | {f for f, _ in table.implied}
    missing = []
    for field in dataclasses.fields(config):
        path = prefix + field.name
        if path in fields:
            continue
        if any(f.startswith(path + ".") for f in fields):  # a nested config's options
            nested = type(options.field_default(table.config_class, path))
            missing += _unset(nested, path + ".", table)
        else:
            missing.append(path)
    return missing


@pytest.mark.parametrize("command", sorted(TABLES))
def test_every_config_field_is_set_by_a_flag(command: str) -> None:
    table = TABLES[command]
    assert _unset(table.config_class, "", table) == []
    flags = _flags(command)
    assert {o.name for o in table.options} <= flags
    assert {flag for _, flag in table.implied if flag} <= flags
    dests = [o.dest for o in table.options]
    assert len(dests) == len(set(dests)), "two options share a flag"


def _other(option: Option, default: Any, tmp_path: Path) -> tuple[list[str], Any]:
    """A value unlike the default: its flag's arguments (as `epd serve` takes
    them), and the field's value they give."""
    if isinstance(default, bool):
        return [], not default
    if option.choices:
        choice = next(c for c in option.choices if c != default)
        return [choice], choice
    if option.field.endswith("chat_template"):
        return [str(tmp_path / "t.jinja")], tmp_path / "t.jinja"
    if option.field.endswith("transports"):
        from services.wire.transport import Transport

        return ["grpc"], (Transport.GRPC,)
    if isinstance(default, int | float):
        return [str(default // option.scale + 3)], (default // option.scale + 3) * option.scale
    return ["other"], "other"


# the component each table's options reach, and the `epd serve` flags that run it
REACHES = {
    "language": (options.LANGUAGE, "language-0", []),
    "encoder": (options.ENCODER, "encoder-0", []),
    "broker": (options.BROKER, "broker", []),
    "gateway": (options.GATEWAY, "gateway", []),
    "monolithic": (options.ENGINE_TABLE, "monolithic", ["--monolithic"]),
}


def _served(given_to: str) -> list[Option]:
    table = REACHES[given_to][0]
    chosen = options.MONOLITHIC if given_to == "monolithic" else table.options
    return [o for o in chosen if o.serve]


@pytest.mark.parametrize(
    ("given_to", "option"),
    [(name, o) for name in REACHES for o in _served(name)],
    ids=lambda x: x if isinstance(x, str) else x.name,
)
def test_serve_passes_each_option_it_takes_to_the_component(
    given_to: str, option: Option, tmp_path: Path
) -> None:
    table, name, extra = REACHES[given_to]
    field = option.field
    default = None if field == "chat_template" else options.field_default(table.config_class, field)
    argv, want = _other(option, default, tmp_path)
    serve = cli.parse_args(["serve", *extra, option.serve_name, *argv])
    stack = cli.stack_config(
        serve, ("broker", "triton", "encoder", "language", "gateway"), tmp_path, "m", "float32"
    )
    (part,) = [p for p in components(stack) if p.name == name]
    args = cli.parse_args(part.args)
    if field == "chat_template":
        assert args.chat_template == want
        return
    got = options.build(table, args, **_required(given_to, args))
    for name_ in field.split("."):
        got = getattr(got, name_)
    assert got == want


def _required(command: str, args: Any) -> dict[str, Any]:
    """What a command sets itself (its table's `implied` that have no default)."""
    if command in ("language", "encoder"):
        given = {"checkpoint": Path(args.checkpoint), "model_name": "m"}
        if command == "language":
            from services.wire.messages import LanguageRole

            given["role"] = LanguageRole[args.role.upper()]
        return given
    if command == "gateway":
        return {"broker": args.broker}
    return {}


def test_a_stack_passes_its_components_only_what_they_parse(tmp_path: Path) -> None:
    """Every component's command line parses, and gives the config's defaults
    where `epd serve` was given none."""
    serve = cli.parse_args(["serve"])
    stack = cli.stack_config(
        serve, ("broker", "triton", "encoder", "language", "gateway"), tmp_path, "m", "float32"
    )
    assert isinstance(stack, StackConfig)
    for part in components(stack):
        args = cli.parse_args(part.args)
        if part.name == "language-0":
            config = options.build(options.LANGUAGE, args, **_required("language", args))
            assert config.engine == dataclasses.replace(
                options.field_default(type(config), "engine"),
                threads_while_encoding=config.engine.threads_while_encoding,
                decode_interval_while_encoding_ms=config.engine.decode_interval_while_encoding_ms,
                tpot_slo_ms=config.engine.tpot_slo_ms,
                ttft_slo_ms=config.engine.ttft_slo_ms,
            )
