"""The public plugin API (``irgen.plugin``): in-repo plugins use it alone.

(a) every ``.py`` file under ``plugins/`` is parsed (not imported) and may
import from irgen only ``irgen.plugin``, and from another plugin's package only
what that package documents as its public API (its ``__all__``), and only when
the plugin's ``pyproject.toml`` declares that plugin's distribution as a dependency
(``pow2`` builds on ``qdq`` this way);
(b) every name ``irgen.plugin`` exports exists and is documented;
(c) ``API_VERSION`` is a "MAJOR.MINOR" string.
"""

from __future__ import annotations

import ast
import re
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PLUGINS = ROOT / "plugins"


def _plugin_packages() -> dict[Path, str]:
    """Each plugin package folder (``plugins/<kind>/<dist>/<package>``) -> its import name."""
    return {init.parent: init.parent.name for init in PLUGINS.glob("*/*/*/__init__.py")
            if not init.parent.name.endswith(".egg-info")}


PACKAGES = _plugin_packages()


def _own_package(path: Path) -> str | None:
    for folder, name in PACKAGES.items():
        if folder in path.parents:
            return name
    return None


def public_api(package: str) -> set[str]:
    """The names an in-repo plugin package documents for other plugins: its ``__all__``."""
    for folder, name in PACKAGES.items():
        if name == package:
            for node in ast.parse((folder / "__init__.py").read_text(encoding="utf-8")).body:
                if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
                    return set(ast.literal_eval(node.value))
    return set()


def declared_plugins(path: Path) -> set[str]:
    """The import names (``irgen-qdq`` -> ``irgen_qdq``) of the distributions the project of
    ``path`` declares as dependencies: its nearest ``pyproject.toml``'s ``project.dependencies``."""
    for folder in Path(path).resolve().parents:
        project = folder / "pyproject.toml"
        if project.is_file():
            deps = tomllib.loads(project.read_text(encoding="utf-8")).get("project", {}).get("dependencies", [])
            return {re.match(r"[A-Za-z0-9_.-]+", d).group(0).lower().replace("-", "_") for d in deps}
    return set()


def import_violations(path: Path, source: str, packages: set[str]) -> list[str]:
    """``file:line: why`` for each import of irgen other than ``irgen.plugin``, and each use of
    another plugin's package beyond its public API or without the dependency declared, in
    ``source`` (imports inside functions included)."""
    own = _own_package(ROOT / path)  # ROOT / an absolute path is that path
    others = packages - ({own} if own else set())
    declared = declared_plugins(ROOT / path) & others
    tree = ast.parse(source, str(path))
    bad = []

    def other_plugin(module: str, line: int, names: list[str] | None) -> None:
        top = module.split(".")[0]
        if top not in declared:
            bad.append(f"{path}:{line}: imports {module}, another plugin's package (not a declared dependency)")
        elif module != top:
            bad.append(f"{path}:{line}: imports {module}, a private module of another plugin's package")
        else:
            bad.extend(f"{path}:{line}: imports {n!r} from {top}, not in its public API (__all__)"
                       for n in names or [] if n not in public_api(top))

    def check(module: str, line: int, names: list[str] | None = None) -> None:
        top = module.split(".")[0]
        if top == "irgen":
            if module == "irgen":
                for n in names or ["<module>"]:
                    if n != "plugin":
                        bad.append(f"{path}:{line}: imports {n!r} from irgen, not irgen.plugin")
            elif module != "irgen.plugin":
                bad.append(f"{path}:{line}: imports {module}, not irgen.plugin")
        elif top in others:
            other_plugin(module, line, names)

    aliases: dict[str, str] = {}  # local name of an imported plugin package -> the package
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                check(a.name, node.lineno, [] if a.name != "irgen" else None)
                if a.name in declared:
                    aliases[a.asname or a.name] = a.name
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            check(node.module, node.lineno, [a.name for a in node.names])
    for node in ast.walk(tree):  # irgen_qdq.NAME where the package is imported whole
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases:
            package = aliases[node.value.id]
            if node.attr not in public_api(package):
                bad.append(f"{path}:{node.lineno}: uses {package}.{node.attr}, not in its public API (__all__)")
    return bad


def _plugin_files() -> list[Path]:
    return sorted(p for p in PLUGINS.rglob("*.py") if ".egg-info" not in str(p) and "build" not in p.parts)


def test_the_plugins_are_found():
    assert {"irgen_onnx", "irgen_torch", "irgen_tensorflow", "irgen_qdq", "irgen_pow2", "irgen_tflite_int8",
            "irgen_generic"} <= set(PACKAGES.values())
    assert len(_plugin_files()) >= 20


def test_plugins_import_only_irgen_plugin():
    bad = []
    for path in _plugin_files():
        bad += import_violations(path.relative_to(ROOT), path.read_text(encoding="utf-8"), set(PACKAGES.values()))
    assert not bad, "plugins import irgen internals or each other:\n" + "\n".join(bad)


@pytest.mark.parametrize("source, expected", [
    ("from irgen.quant import per_axis", "imports irgen.quant"),
    ("import irgen.graph", "imports irgen.graph"),
    ("from irgen import quant as q", "imports 'quant' from irgen"),
    ("from irgen import hookimpl", "imports 'hookimpl' from irgen"),
    ("import irgen", "imports '<module>' from irgen"),
    ("def f():\n    from irgen.ir import _arg_ref", "imports irgen.ir"),
    ("import irgen_tflite_int8", "imports irgen_tflite_int8, another plugin's package (not a declared dependency)"),
    ("from irgen_qdq.operands import operand", "imports irgen_qdq.operands, a private module"),
    ("from irgen_qdq import _ops", "imports '_ops' from irgen_qdq, not in its public API"),
    ("import irgen_qdq\nirgen_qdq.common._ops()", "uses irgen_qdq.common, not in its public API"),
])
def test_the_check_names_file_and_line(source, expected):
    path = Path("plugins/quantizers/pow2/irgen_pow2/__init__.py")
    bad = import_violations(path, "x = 1\n" + source, {"irgen_pow2", "irgen_qdq", "irgen_tflite_int8"})
    assert len(bad) == 1, bad
    assert bad[0].startswith(f"{path}:{source.count(chr(10)) + 2}: ")
    assert expected in bad[0]


def test_a_plugin_built_on_another_uses_its_public_api_once_declared():
    """pow2 declares irgen-qdq: it may use irgen_qdq's ``__all__``; qdq declares nothing of pow2."""
    packages = {"irgen_pow2", "irgen_qdq"}
    pow2 = Path("plugins/quantizers/pow2/irgen_pow2/__init__.py")
    assert "irgen_qdq" in declared_plugins(ROOT / pow2) and {"realize", "RECOMPUTE"} <= public_api("irgen_qdq")
    assert import_violations(pow2, "import irgen_qdq\nirgen_qdq.realize(qg)\nfrom irgen_qdq import RECOMPUTE\n",
                             packages) == []
    qdq = Path("plugins/quantizers/qdq/irgen_qdq/__init__.py")
    assert import_violations(qdq, "from irgen_pow2 import SCHEME\n", packages)


def test_the_check_allows_the_api_and_own_package():
    path = ROOT / "plugins/quantizers/qdq/irgen_qdq/__init__.py"
    src = ("from irgen.plugin import hookimpl, Quantizer\nimport irgen.plugin\nfrom irgen import plugin\n"
           "from irgen_qdq import spans\nimport numpy\nfrom . import spans\n")
    assert import_violations(path, src, {"irgen_pow2", "irgen_qdq"}) == []


def test_every_exported_name_exists_and_is_documented():
    import irgen.plugin as api

    doc = api.__doc__ or ""
    assert len(api.__all__) == len(set(api.__all__))
    missing, undocumented = [], []
    for name in api.__all__:
        if not hasattr(api, name):
            missing.append(name)
            continue
        obj = getattr(api, name)
        own_doc = getattr(obj, "__doc__", None) if callable(obj) or isinstance(obj, type) else None
        if not own_doc and not re.search(rf"``{re.escape(name)}``|\b{re.escape(name)}\b", doc):
            undocumented.append(name)
    assert not missing, f"irgen.plugin.__all__ names missing from the module: {missing}"
    assert not undocumented, f"irgen.plugin exports without a docstring or mention in the module docstring: {undocumented}"


def test_the_api_covers_what_the_plugins_used():
    import irgen.plugin as api

    for name in ("hookimpl", "Frontend", "Quantizer", "Backend", "Serializer", "FusionRule", "ATTENTION_FUSION",
                 "ImportedModel", "InputSpec", "Provenance", "IrgenError", "UnsupportedOpsError", "QGraph",
                 "QTensor", "Binding", "Constant", "attrs_to_dict", "substitute", "main_bindings", "module_bindings",
                 "check_tensor_sizes", "tuple_output_outside_dataflow", "quantize_linear",
                 "multiply_by_quantized_multiplier", "quantize_multiplier", "requantize_float", "per_axis",
                 "register_recompute", "run_op", "run_layer", "SafeNames", "identifier", "check_tensor_size",
                 "regular_file", "open_regular", "DEFAULT_MAX_TENSOR_BYTES", "MAX_JSON_BYTES", "human_bytes",
                 "arg_ref"):
        assert name in api.__all__, name
    from irgen import api as registration, hookspecs, quant

    assert api.Quantizer is registration.Quantizer and api.hookimpl is hookspecs.hookimpl
    assert api.QGraph is quant.QGraph
    assert api.QGraph.__doc__ and api.QGraph.replace.__doc__ and api.QGraph.emit.__doc__


def test_api_version_is_major_minor():
    import irgen.plugin as api

    assert isinstance(api.API_VERSION, str)
    assert re.fullmatch(r"(0|[1-9]\d*)\.(0|[1-9]\d*)", api.API_VERSION), api.API_VERSION
    assert "API_VERSION" in api.__all__
    assert "minor" in api.__doc__.lower() and "major" in api.__doc__.lower()


def test_backwards_compatible_entry_points():
    import irgen
    import irgen.api
    import irgen.plugin

    assert irgen.hookimpl is irgen.plugin.hookimpl
    assert irgen.api.Serializer is irgen.plugin.Serializer
