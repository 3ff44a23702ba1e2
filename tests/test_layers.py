"""The package's layers, enforced: the engine core and the simulator never reach up
into serving (HTTP) or book support (plots, widgets, labs, benchmarks).

Imports are read from the source with ``ast`` (function-level imports included),
so a lazy import inside a function cannot hide a dependency.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import tinyserve

PACKAGE = Path(tinyserve.__file__).parent

CORE = ["request", "kv_cache", "scheduler", "core", "executor", "model", "engine", "tokenizer",
        "metrics", "hardware", "workload", "kernels"]
SIM = ["sim", "cluster", "routing"]
SERVING = ["server", "client", "router", "cli"]
BOOK = ["plots", "widgets", "notebooks", "demo", "labs", "bench", "sim_bench", "crossover",
        "replay", "train", "build_tokenizer"]
HTTP_LIBRARIES = ["aiohttp", "http", "urllib", "requests", "httpx", "socket"]


def module_files(name: str) -> list[Path]:
    path = PACKAGE / name
    return sorted(path.rglob("*.py")) if path.is_dir() else [path.with_suffix(".py")]


def imported_modules(path: Path) -> set[str]:
    """Every module a file imports; ``from tinyserve import x`` counts as ``tinyserve.x``."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            if node.module == "tinyserve":
                names.update(f"tinyserve.{alias.name}" for alias in node.names)
    return names


def layer_of(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != "tinyserve" or len(parts) < 2:
        return None
    for layer, members in (("core", CORE), ("sim", SIM), ("serving", SERVING), ("book", BOOK)):
        if parts[1] in members:
            return layer
    return None


def test_every_module_belongs_to_a_layer():
    listed = set(CORE + SIM + SERVING + BOOK)
    top = {p.stem for p in PACKAGE.glob("*.py") if p.stem not in ("__init__", "__main__")}
    top |= {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}
    assert top <= listed, f"modules with no layer: {sorted(top - listed)}"


@pytest.mark.parametrize("name", CORE + SIM)
def test_core_and_sim_import_nothing_from_serving_or_book_support(name):
    for path in module_files(name):
        bad = {m for m in imported_modules(path) if layer_of(m) in ("serving", "book")}
        assert not bad, f"{path.relative_to(PACKAGE)} imports {sorted(bad)}"


@pytest.mark.parametrize("name", CORE + SIM)
def test_core_and_sim_import_no_http_library(name):
    for path in module_files(name):
        bad = {m for m in imported_modules(path) if m.split(".")[0] in HTTP_LIBRARIES}
        assert not bad, f"{path.relative_to(PACKAGE)} imports {sorted(bad)}"


@pytest.mark.parametrize("name", CORE)
def test_core_imports_nothing_from_the_simulator(name):
    for path in module_files(name):
        bad = {m for m in imported_modules(path) if layer_of(m) == "sim"}
        assert not bad, f"{path.relative_to(PACKAGE)} imports {sorted(bad)}"
