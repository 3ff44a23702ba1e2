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

# Top-level names of the package by layer; a layer may import only from the layers
# before it in LAYERS (and from itself).
CORE = ["request", "kv_cache", "scheduler", "policies", "core", "executor", "compiled_step", "packed_gemm",
        "model", "checkpoint", "engine", "tokenizer", "hf_tokenizer", "chat_template", "metrics", "diagnose", "hardware",
        "measure", "workload", "kernels"]
LAYERS = {"core": CORE, "sim": ["sim"], "serving": ["serving"], "bench": ["bench"],
          "book": ["book"], "labs": ["labs"], "entry": ["cli", "__main__", "__init__"]}
MAY_IMPORT = {"core": {"core"}, "sim": {"core", "sim"}, "serving": {"core", "sim", "serving"},
              "bench": {"core", "sim", "serving", "bench"},
              "book": {"core", "sim", "serving", "bench", "book"},
              "labs": {"core", "sim", "serving", "bench", "book", "labs"},
              "entry": set(LAYERS)}
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
    return next((layer for layer, names in LAYERS.items() if parts[1] in names), None)


def files_of(layer: str) -> list[Path]:
    return [f for name in LAYERS[layer] for f in module_files(name) if f.exists()]


def test_every_module_belongs_to_a_layer():
    listed = {name for names in LAYERS.values() for name in names}
    top = {p.stem for p in PACKAGE.glob("*.py")}
    top |= {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}
    assert top <= listed, f"modules with no layer: {sorted(top - listed)}"


@pytest.mark.parametrize("layer", list(LAYERS))
def test_a_layer_imports_only_from_the_layers_below_it(layer):
    for path in files_of(layer):
        bad = {m for m in imported_modules(path)
               if layer_of(m) is not None and layer_of(m) not in MAY_IMPORT[layer]}
        assert not bad, f"{path.relative_to(PACKAGE)} ({layer}) imports {sorted(bad)}"


@pytest.mark.parametrize("layer", ["core", "sim"])
def test_core_and_sim_import_no_http_library(layer):
    for path in files_of(layer):
        bad = {m for m in imported_modules(path) if m.split(".")[0] in HTTP_LIBRARIES}
        assert not bad, f"{path.relative_to(PACKAGE)} imports {sorted(bad)}"


def test_private_names_are_never_imported_across_modules():
    found = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("tinyserve"):
                private = [a.name for a in node.names if a.name.startswith("_")]
                private += [part for part in node.module.split(".") if part.startswith("_")]
                if private:
                    found.append(f"{path.relative_to(PACKAGE)}: {private} from {node.module}")
    assert not found, "private names imported across modules:\n" + "\n".join(found)
