"""The packages under services/ import each other without cycles, and the wire
layer sits at the bottom: it imports nothing of services/ but the protos."""

from __future__ import annotations

import ast
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

SERVICES = Path(__file__).resolve().parent.parent / "services"


def _imports() -> dict[str, set[str]]:
    """Top-level package (or module) under services/ -> those it imports."""
    edges: dict[str, set[str]] = defaultdict(set)
    for path in SERVICES.rglob("*.py"):
        me = path.relative_to(SERVICES).parts[0].removesuffix(".py")
        if me == "proto":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else []
            )
            for name in names:
                parts = name.split(".")
                if parts[0] == "services" and len(parts) > 1 and parts[1] != me:
                    edges[me].add(parts[1])
    return edges


def test_no_package_imports_one_that_imports_it_back() -> None:
    edges = _imports()

    def cycle_from(start: str, node: str, path: list[str]) -> list[str] | None:
        for nxt in sorted(edges.get(node, ())):
            if nxt == start:
                return [*path, nxt]
            if nxt not in path:
                found = cycle_from(start, nxt, [*path, nxt])
                if found:
                    return found
        return None

    for package in sorted(edges):
        cycle = cycle_from(package, package, [package])
        assert cycle is None, " -> ".join(cycle)


def test_the_wire_layer_imports_only_the_protos() -> None:
    edges = _imports()
    assert edges["wire"] <= {"proto"}
    assert "transfer" not in edges["broker"]  # the old cycle: broker <-> transfer


def test_the_launchers_import_no_server_and_no_torch() -> None:
    """Every component of `epd serve` parses the same command line and the
    Triton launcher only watches a child: at start-up they run side by side on
    the same cores, so an import each does not need is start-up time lost."""
    code = (
        "import sys\n"
        "from services import cli, serve\n"
        "from services.triton import launcher\n"
        "cli.build_parser().parse_args(['triton', '--checkpoint', 'x'])\n"
        "print(sorted(m for m in sys.modules if m == 'torch' or m.endswith('.server')))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert done.stdout.strip() == "[]", done.stdout
