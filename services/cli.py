"""The `epd` command: one subcommand per service or tool."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable, Sequence
from pathlib import Path


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

    out = build_demo_checkpoint(Path(args.dir), size=args.size, seed=args.seed)
    print(f"demo checkpoint ({args.size}, seed {args.seed}) written to {out}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="epd", description=__doc__)
    parser.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING, ERROR")
    sub = parser.add_subparsers(dest="command", required=True)

    protos = sub.add_parser("protos", help="generate services/proto/ from protos/")
    protos.add_argument("--check", action="store_true", help="fail if the generated code is stale")
    protos.set_defaults(handler=_protos)

    demo = sub.add_parser("demo-model", help="build a small Qwen2.5-VL checkpoint locally")
    demo.add_argument("dir", help="output folder")
    demo.add_argument("--size", choices=("tiny", "small"), default="tiny")
    demo.add_argument("--seed", type=int, default=0)
    demo.set_defaults(handler=_demo_model)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    handler: Callable[[argparse.Namespace], int] = args.handler
    return handler(args)


if __name__ == "__main__":
    raise SystemExit(main())
