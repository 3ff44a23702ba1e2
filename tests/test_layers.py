"""The package's layers, enforced: the engine core and the simulator never reach up
into serving (HTTP) or book support (plots, widgets, labs, benchmarks), and inside
the core every module imports only modules below it, so no two import each other.

Imports are read from the source with ``ast`` (function-level and relative imports
included), so a lazy import inside a function cannot hide a dependency, and a name
that is not a module of the package fails instead of being skipped.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

import tinyserve

PACKAGE = Path(tinyserve.__file__).parent

# The core in rows, lowest first: a core module may import only modules of lower rows.
# Two stacks meet in engine: the step loop (request, kv_cache -> policies -> scheduler ->
# core) and the model (kernels, native -> our C kernels -> model -> compiled_step ->
# packed_gemm -> executor); checkpoint (the file format) sits on the model, never under it.
CORE_ROWS = [
    ["request", "kv_cache", "metrics", "hardware", "workload", "diagnose_facts", "routing",
     "tokenizer", "chat_template", "kernels", "host"],            # import nothing of ours
    ["policies", "hf_tokenizer", "diagnose", "sampler", "native"],
    ["bf16_gemm", "cpu_attention", "cpu_rmsnorm"],
    ["scheduler", "model"],
    ["core", "checkpoint", "compiled_step"],
    ["packed_gemm"],
    ["executor", "measure"],                                      # measure times packed GEMMs
    ["engine"],
]
CORE = [name for row in CORE_ROWS for name in row]
CORE_ROW = {name: i for i, row in enumerate(CORE_ROWS) for name in row}
# Top-level names of the package by layer; a layer may import only from the layers
# before it in LAYERS (and from itself).
LAYERS = {"core": CORE, "sim": ["sim"], "serving": ["serving"], "bench": ["bench"],
          "book": ["book"], "labs": ["labs"], "entry": ["cli", "__main__", "__init__"]}
MAY_IMPORT = {"core": {"core"}, "sim": {"core", "sim"}, "serving": {"core", "sim", "serving"},
              "bench": {"core", "sim", "serving", "bench"},
              "book": {"core", "sim", "serving", "bench", "book"},
              "labs": {"core", "sim", "serving", "bench", "book", "labs"},
              "entry": set(LAYERS)}
HTTP_LIBRARIES = ["aiohttp", "http", "urllib", "requests", "httpx", "socket"]
# The claims machinery of the book in rows, lowest first: the registry and verdicts know no
# check; the checks know no runner (claims <-> chapter_checks was a cycle).
CLAIMS_ROWS = [["claims"], ["chapter_checks"], ["make_claims"]]


def module_files(name: str) -> list[Path]:
    path = PACKAGE / name
    return sorted(path.rglob("*.py")) if path.is_dir() else [path.with_suffix(".py")]


def module_path(module: str) -> Path | None:
    """The file of ``tinyserve.a.b`` (``a/b.py`` or ``a/b/__init__.py``), None if there is none."""
    base = PACKAGE.joinpath(*module.split(".")[1:])
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def package_of(path: Path) -> str:
    """The package a file's relative imports start from."""
    parts = path.relative_to(PACKAGE).parent.parts
    return ".".join(("tinyserve", *parts))


def reexports() -> dict[str, str]:
    """Names ``tinyserve/__init__.py`` re-exports, each with its module: ``LLM`` ->
    ``tinyserve.engine`` (its ``EXPORTS`` table, imported on first use)."""
    tree = ast.parse((PACKAGE / "__init__.py").read_text())
    table = next(node.value for node in tree.body if isinstance(node, ast.Assign)
                 and any(isinstance(t, ast.Name) and t.id == "EXPORTS" for t in node.targets))
    return {name: module for name, (module, _) in ast.literal_eval(table).items()}


def imported_modules(path: Path) -> set[str]:
    """Every module a file imports, as absolute names. ``from tinyserve import LLM``
    counts as the module that defines it (``tinyserve.engine``), ``from .x import y``
    as ``<this package>.x``, ``from tinyserve.sim import cluster`` also as
    ``tinyserve.sim.cluster``. A bare ``import tinyserve`` is its ``__init__``."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                package = package_of(path).split(".")
                if node.level > len(package):
                    raise AssertionError(f"{path}: relative import beyond the package")
                base = ".".join(package[:len(package) - node.level + 1])
                module = f"{base}.{node.module}" if node.module else base
            else:
                module = node.module
            if module != "tinyserve":       # `from tinyserve import x` is about x alone
                names.add(module)
            if not module.startswith("tinyserve"):
                continue
            for alias in node.names:
                if module_path(f"{module}.{alias.name}") is not None:
                    names.add(f"{module}.{alias.name}")
                elif module == "tinyserve":
                    # Not a module: a name __init__ re-exports (or a typo, caught below).
                    names.add(reexports().get(alias.name, f"tinyserve.{alias.name}"))
    return {"tinyserve.__init__" if n == "tinyserve" else n for n in names}


def top_name(module: str) -> str:
    """``tinyserve.kernels.softmax`` -> ``kernels``."""
    return module.split(".")[1]


def layer_of(module: str) -> str | None:
    """The layer of a module of the package; None for other libraries."""
    if module.split(".")[0] != "tinyserve":
        return None
    layer = next((layer for layer, names in LAYERS.items() if top_name(module) in names), None)
    assert layer is not None, f"{module} is in no layer"
    return layer


def files_of(layer: str) -> list[Path]:
    return [f for name in LAYERS[layer] for f in module_files(name)]


def all_files() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def test_every_module_belongs_to_exactly_one_layer_and_every_listed_name_exists():
    listed = [name for names in LAYERS.values() for name in names]
    top = {p.stem for p in PACKAGE.glob("*.py")}
    top |= {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}
    assert top - set(listed) == set(), f"modules with no layer: {sorted(top - set(listed))}"
    assert set(listed) - top == set(), f"listed but no such module: {sorted(set(listed) - top)}"
    assert len(listed) == len(set(listed)), "a module is listed twice"
    assert sorted(CORE) == sorted(set(CORE)), "a core module is in two rows"


def test_every_imported_module_of_the_package_exists():
    """A misspelt or removed module fails here, even in a lazy import that no test runs."""
    missing = [f"{path.relative_to(PACKAGE)}: {m}" for path in all_files()
               for m in imported_modules(path)
               if m.split(".")[0] == "tinyserve" and m != "tinyserve.__init__"
               and module_path(m) is None]
    assert not missing, "imports of modules that do not exist:\n" + "\n".join(missing)


@pytest.mark.parametrize("layer", list(LAYERS))
def test_a_layer_imports_only_from_the_layers_below_it(layer):
    for path in files_of(layer):
        bad = {m for m in imported_modules(path)
               if layer_of(m) is not None and layer_of(m) not in MAY_IMPORT[layer]}
        assert not bad, f"{path.relative_to(PACKAGE)} ({layer}) imports {sorted(bad)}"


@pytest.mark.parametrize("name", CORE)
def test_a_core_module_imports_only_the_rows_below_it(name):
    """So the core has no import cycle (model <-> checkpoint was one): each module can be
    read, and tested, knowing only the ones in lower rows of CORE_ROWS."""
    for path in module_files(name):
        bad = {m for m in imported_modules(path) if layer_of(m) == "core"
               and top_name(m) != name and CORE_ROW[top_name(m)] >= CORE_ROW[name]}
        assert not bad, (f"{path.relative_to(PACKAGE)} (row {CORE_ROW[name]}) imports "
                         f"{sorted(bad)}, not from a lower row")


@pytest.mark.parametrize("layer", ["core", "sim"])
def test_core_and_sim_import_no_http_library(layer):
    for path in files_of(layer):
        bad = {m for m in imported_modules(path) if m.split(".")[0] in HTTP_LIBRARIES}
        assert not bad, f"{path.relative_to(PACKAGE)} imports {sorted(bad)}"


def test_private_names_are_never_imported_across_modules():
    found = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("tinyserve")):
                private = [a.name for a in node.names if a.name.startswith("_")]
                private += [part for part in (node.module or "").split(".") if part.startswith("_")]
                if private:
                    found.append(f"{path.relative_to(PACKAGE)}: {private} from {node.module}")
    assert not found, "private names imported across modules:\n" + "\n".join(found)


def cycle_among(files: list[Path]) -> list[str] | None:
    """A chain of imports among ``files`` that comes back to where it started, or None."""
    names = {f"{package_of(f)}.{f.stem}": f for f in files if f.stem != "__init__"}
    edges = {name: sorted(m for m in imported_modules(f) if m in names and m != name)
             for name, f in names.items()}
    done, path = set(), []

    def visit(name: str) -> list[str] | None:
        if name in path:
            return path[path.index(name):] + [name]
        if name in done:
            return None
        path.append(name)
        for m in edges[name]:
            if (found := visit(m)) is not None:
                return found
        path.pop()
        done.add(name)
        return None

    return next((c for c in map(visit, sorted(names)) if c is not None), None)


@pytest.mark.parametrize("subpackage", ["serving", "sim", "bench", "kernels", "book"])
def test_the_modules_of_a_subpackage_import_each_other_in_one_order(subpackage):
    """Inside a folder the table above does not reach: no circle of imports (the
    OpenAI format's modules, for one, stack responses -> errors -> request_parsing)."""
    cycle = cycle_among(module_files(subpackage))
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_cycle_finder_finds_a_cycle(tmp_path):
    (tmp_path / "a.py").write_text("from tinyserve.b import x\n")
    (tmp_path / "b.py").write_text("import tinyserve.a\n")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sys.modules[__name__], "PACKAGE", tmp_path)
        assert cycle_among([tmp_path / "a.py", tmp_path / "b.py"]) == [
            "tinyserve.a", "tinyserve.b", "tinyserve.a"]


def test_the_claims_machinery_imports_only_the_rows_below_it():
    row = {name: i for i, names in enumerate(CLAIMS_ROWS) for name in names}
    for name, i in row.items():
        for path in module_files(f"book/{name}"):
            above = {m for m in imported_modules(path) if m.startswith("tinyserve.book.")
                     and m.split(".")[2] in row and row[m.split(".")[2]] > i}
            assert not above, f"{path.relative_to(PACKAGE)} (row {i}) imports {sorted(above)}"
