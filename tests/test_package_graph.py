"""The packages under services/ import each other without cycles, and the wire
layer sits at the bottom: it imports nothing of services/ but the protos."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

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


@pytest.mark.parametrize(
    "argv",
    [
        ["triton", "--checkpoint", "x"],
        ["broker"],
        ["gateway", "--broker", "127.0.0.1:1"],
    ],
)
def test_the_launchers_import_no_server_and_no_torch(argv: list[str]) -> None:
    """Every component of `epd serve` parses its own command line and the
    Triton launcher only watches a child: at start-up they run side by side on
    the same cores, so an import each does not need is start-up time lost."""
    code = (
        "import sys\n"
        "from services.launcher import cli, serve\n"
        "from services.triton import launcher\n"
        f"cli.parse_args({argv!r})\n"
        "print(sorted(m for m in sys.modules if m == 'torch' or m.endswith('.server')))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert done.stdout.strip() == "[]", done.stdout


def _modules_imported_by(path: Path) -> set[str]:
    """The services.* modules a file imports (absolute names)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            found |= {node.module, *(f"{node.module}.{a.name}" for a in node.names)}
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
    return {m for m in found if m.startswith("services.")}


def test_the_gateway_reaches_the_language_side_only_through_the_wire_types() -> None:
    for path in (SERVICES / "gateway").rglob("*.py"):
        language = {m for m in _modules_imported_by(path) if m.startswith("services.language")}
        assert not language, f"{path.relative_to(SERVICES)} imports {sorted(language)}"


def test_the_monolithic_backend_reaches_the_engine_without_the_servicer() -> None:
    code = (
        "import sys\n"
        "import services.monolithic\n"
        "names = [m for m in sys.modules if m.startswith('services.')]\n"
        "print(sorted(m for m in names if m.endswith(('.servicer', '.server'))))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert done.stdout.strip() == "[]", done.stdout


# The request path's protobuf messages: only the generic converter builds them.
REQUEST_MESSAGES = {
    "GenerateRequest",
    "GenerateResponse",
    "GenerateChunk",
    "GenerateComplete",
    "GenerateError",
    "ChatMessage",
    "ContentPart",
    "ImagePart",
    "VideoPart",
    "SamplingParams",
    "TokenLogprob",
    "TopLogprob",
    "RouteRequest",
    "RouteReply",
    "EncodeRequest",
}


def test_request_messages_are_converted_in_one_place() -> None:
    """A request (its sampling parameters, its route, its encode) crosses protobuf
    only through services/wire/convert.py: no module builds or reads those pb2
    classes."""
    for path in SERVICES.rglob("*.py"):
        if path.is_relative_to(SERVICES / "proto") or path.parent == SERVICES / "wire":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id.endswith("_pb2")
                and node.attr in REQUEST_MESSAGES
                and not _annotation_of_a_servicer(path, node)
            ):
                where = f"{path.relative_to(SERVICES)}:{node.lineno}"
                raise AssertionError(f"{where} uses {node.value.id}.{node.attr}")


def _annotation_of_a_servicer(path: Path, node: ast.Attribute) -> bool:
    """A gRPC method's parameter or return annotation (protobuf at the edge)."""
    edge = ("GenerateRequest", "GenerateResponse", "RouteRequest", "RouteReply", "EncodeRequest")
    return path.name == "servicer.py" and node.attr in edge


def test_finish_reasons_are_defined_once() -> None:
    """FinishReason (services/wire/request.py) is the one table of them."""
    defined = []
    for path in SERVICES.rglob("*.py"):
        if path.is_relative_to(SERVICES / "proto"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            targets = (
                [node.name]
                if isinstance(node, ast.ClassDef)
                else [t.id for t in node.targets if isinstance(t, ast.Name)]
                if isinstance(node, ast.Assign)
                else []
            )
            named = [t for t in targets if "finishreason" in t.lower().replace("_", "")]
            defined += [f"{path.relative_to(SERVICES)}:{t}" for t in named]
    assert defined == ["wire/request.py:FinishReason"]


MAX_LINES = 60


def test_functions_fit_on_a_screen() -> None:
    """Under services/, a function over 60 lines says why in a `# Long:` comment
    on the line above it."""
    for path in _modules():
        lines = path.read_text().splitlines()
        for node in ast.walk(ast.parse("\n".join(lines))):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            length = (node.end_lineno or node.lineno) - node.lineno + 1
            first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
            said_why = lines[first - 2].strip().startswith("# Long:")
            where = f"{path.relative_to(SERVICES)}:{node.lineno} {node.name}"
            assert length <= MAX_LINES or said_why, f"{where} has {length} lines"


def _modules() -> list[Path]:
    """Every Python module under services/ but the generated protos."""
    return [p for p in SERVICES.rglob("*.py") if not p.is_relative_to(SERVICES / "proto")]


def _packages() -> list[Path]:
    return sorted(p.parent for p in _modules() if p.name == "__init__.py")


def _map(package: Path) -> set[str]:
    """What a package's docstring lists, one `module.py` or `subpackage/` a line."""
    doc = ast.get_docstring(ast.parse((package / "__init__.py").read_text())) or ""
    return {m.group(1) for m in re.finditer(r"^(\w+\.py|\w+/) ", doc, re.M)}


@pytest.mark.parametrize("package", _packages(), ids=lambda p: str(p.relative_to(SERVICES)))
def test_each_package_map_names_every_module_and_only_those(package: Path) -> None:
    """A newcomer reads a package's __init__ to find their way: its map lists
    every module and subpackage in it, and nothing that is not there."""
    there = {p.name for p in package.glob("*.py") if p.name != "__init__.py"}
    there |= {f"{p.name}/" for p in package.iterdir() if (p / "__init__.py").exists()}
    assert _map(package) == there


def test_the_language_package_holds_the_service_and_the_engine_loop_only() -> None:
    language = SERVICES / "language"
    assert {p.name for p in language.glob("*.py")} == {
        "__init__.py",
        "config.py",
        "frontend.py",
        "kv_handoff.py",
        "metrics.py",
        "prefix_moves.py",
        "server.py",
        "servicer.py",
    }
    assert {p.name for p in language.iterdir() if p.is_dir() and p.name != "__pycache__"} == {
        "engine"
    }
    assert not list((language / "engine").glob("*.c")), "kernels live in services/layers/"


def test_the_vision_side_does_not_reach_into_the_language_service() -> None:
    """Triton's model, the encoder and the Triton launcher take the tower and
    everything else from services/layers/ and services/model/, not from the
    language service."""
    paths = [
        *(SERVICES.parent / "model_repository").rglob("*.py"),
        *(SERVICES / "encoder").rglob("*.py"),
        *(SERVICES / "triton").rglob("*.py"),
    ]
    for path in paths:
        language = {m for m in _modules_imported_by(path) if m.startswith("services.language")}
        assert not language, f"{path} imports {sorted(language)}"


def test_no_package_holds_a_fifth_of_the_code() -> None:
    """Lines of Python and C in each folder under services/ (its own files, not its
    subpackages'), the generated protos left out."""
    lines: dict[Path, int] = defaultdict(int)
    for path in [*_modules(), *SERVICES.rglob("*.c"), *SERVICES.rglob("*.h")]:
        folder = path.parent.parent if path.parent.name == "csrc" else path.parent
        lines[folder] += len(path.read_text().splitlines())
    total = sum(lines.values())
    largest = max(lines, key=lambda folder: lines[folder])
    share = lines[largest] / total
    assert share < 0.2, f"{largest.relative_to(SERVICES.parent)} holds {share:.0%} of the lines"
