"""The core in layers you can see (issue 35): every module of ``core/irgen`` sits in one layer of
:data:`LAYERS`, and every import, at module level or inside a function, points to its own
layer or a lower one. No import cycle, and a function-level import of an irgen module only
defers a heavy library (TVM, numpy, torch, ...) that the module imports, or, in the CLI's
entry module, a large one its command does not need (``irgen --help`` stays fast).

A new module is placed in :data:`LAYERS` here (and in ``docs/contributing.md``'s table);
the test fails on a module that is not.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

CORE = Path(__file__).resolve().parent.parent / "core" / "irgen"

#: lowest first; a module may import its own layer and the ones above it in this list
LAYERS: list[tuple[str, set[str]]] = [
    ("base: errors, records, names, files, metrics", {
        "api", "names", "envflags", "safeio", "schema", "irfile", "output", "lean_import", "comparators", "dumpmap"}),
    ("plugin host", {"hookspecs", "plugins", "serializers"}),
    ("IR model, numpy reference, model inputs", {"reference", "declared", "runkey", "inputs"}),
    ("Relax passes and kernels", {
        "graph", "canonical", "ops", "recurrent", "quant", "spill", "share", "schedule", "target", "vm", "parallel_build",
        "execute", "widen", "stepwise"}),
    ("layer forming and records", {"layers", "ir", "forming"}),
    ("compile and plan", {"plan", "cache", "compile"}),
    ("run", {"pipeline", "decode", "runners", "capture", "workers", "sweep", "cliargs", "cachetool"}),
    ("check and compare", {"source", "verify", "diagnose", "compare", "compare_report", "extract", "report",
                           "summary"}),
    ("interfaces: the command line, the plugin API, test kits", {
        "cli", "__main__", "plugin", "testing", "testing.conformance", "testing.models", "testing.pytest_plugin"}),
]
#: third-party modules whose import is slow enough to defer
HEAVY = {"tvm", "tvm_ffi", "numpy", "torch", "tensorflow", "onnx", "onnxruntime", "yaml", "jsonschema", "ml_dtypes"}
#: modules whose function-level imports may defer any module (startup time of ``irgen --help``)
LAZY_ENTRY = {"cli"}


def _modules() -> dict[str, Path]:
    mods = {}
    for p in CORE.rglob("*.py"):
        if "scaffold" in p.parts:
            continue
        parts = p.relative_to(CORE).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        mods[name or "__init__"] = p
    return mods


MODULES = _modules()


def _target(name: str) -> str | None:
    """The core module an ``irgen....`` import name refers to (None: the package itself)."""
    name = name.removeprefix("irgen").removeprefix(".")
    while name and name not in MODULES:
        name = name.rsplit(".", 1)[0] if "." in name else ""
    return name or None


@functools.cache
def imports(module: str) -> tuple[frozenset, frozenset, frozenset]:
    """(core modules imported at module level, those imported only inside functions, heavy
    third-party modules imported at module level)."""
    tree = ast.parse(MODULES[module].read_text())
    top: set[str] = set()
    inner: set[str] = set()
    heavy: set[str] = set()

    def visit(node, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            nested = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
            if isinstance(child, ast.Import):
                names = [a.name for a in child.names]
            elif isinstance(child, ast.ImportFrom) and child.level == 0 and child.module:
                names = [child.module] + [f"{child.module}.{a.name}" for a in child.names]
            else:
                visit(child, nested)
                continue
            for name in names:
                if name.split(".")[0] != "irgen":
                    if not nested and name.split(".")[0] in HEAVY:
                        heavy.add(name.split(".")[0])
                    continue
                t = _target(name)
                if t is not None and t != module:
                    (inner if nested else top).add(t)
    visit(tree, False)
    return frozenset(top), frozenset(inner - top), frozenset(heavy)


@functools.cache
def is_heavy(module: str) -> bool:
    top, _, heavy = imports(module)
    return bool(heavy) or any(is_heavy(t) for t in top)


def _layer(module: str) -> int:
    found = [i for i, (_, names) in enumerate(LAYERS) if module in names]
    assert len(found) == 1, f"core/irgen module {module!r} is in {len(found)} layers of LAYERS (place it in one)"
    return found[0]


def test_every_module_has_a_layer():
    for module in MODULES:
        if module != "__init__":
            _layer(module)
    listed = set().union(*(names for _, names in LAYERS))
    assert listed <= set(MODULES), f"LAYERS names modules that do not exist: {sorted(listed - set(MODULES))}"


def test_imports_point_down_the_layers():
    wrong = []
    for module in MODULES:
        if module == "__init__":
            continue
        top, inner, _ = imports(module)
        for t in top | inner:
            if t != "__init__" and _layer(t) > _layer(module):
                wrong.append(f"{module} ({LAYERS[_layer(module)][0]}) imports {t} ({LAYERS[_layer(t)][0]})")
    assert not wrong, "imports against the layer order:\n" + "\n".join(sorted(wrong))


def test_no_import_cycle():
    graph = {m: set(imports(m)[0] | imports(m)[1]) - {"__init__"} for m in MODULES}
    state: dict[str, int] = {}
    path: list[str] = []

    def walk(m: str) -> None:
        state[m] = 1
        path.append(m)
        for t in sorted(graph[m]):
            assert state.get(t) != 1, "import cycle: " + " -> ".join(path[path.index(t):] + [t])
            if t not in state:
                walk(t)
        path.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            walk(m)


def test_function_level_imports_only_defer_heavy_modules():
    light = []
    for module in MODULES:
        if module in LAZY_ENTRY:
            continue
        _, inner, _ = imports(module)
        light += [f"{module} imports {t} inside a function" for t in sorted(inner) if not is_heavy(t)]
    assert not light, ("import these at module level (they import no heavy library):\n" + "\n".join(light))


def test_the_checks_see_a_wrong_import():
    """The analysis itself: an upward import and a light function-level import are found."""
    assert "pipeline" in imports("cli")[1] and is_heavy("graph") and not is_heavy("names")
    assert _layer("cli") > _layer("pipeline") > _layer("graph") > _layer("api")
