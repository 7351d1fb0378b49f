"""The public plugin API (``irgen.plugin``): in-repo plugins use it alone.

(a) every ``.py`` file under ``plugins/`` is parsed (not imported) and may
import from irgen only ``irgen.plugin``, and no other plugin's package;
(b) every name ``irgen.plugin`` exports exists and is documented;
(c) ``API_VERSION`` is a "MAJOR.MINOR" string.
"""

from __future__ import annotations

import ast
import re
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


def import_violations(path: Path, source: str, packages: set[str]) -> list[str]:
    """``file:line: why`` for each import of irgen other than ``irgen.plugin`` and each import of
    another plugin's package in ``source`` (imports inside functions included)."""
    own = _own_package(ROOT / path)  # ROOT / an absolute path is that path
    others = packages - ({own} if own else set())
    bad = []

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
            bad.append(f"{path}:{line}: imports {module}, another plugin's package")

    for node in ast.walk(ast.parse(source, str(path))):
        if isinstance(node, ast.Import):
            for a in node.names:
                check(a.name, node.lineno, [] if a.name != "irgen" else None)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            check(node.module, node.lineno, [a.name for a in node.names])
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
    ("import irgen_qdq", "imports irgen_qdq, another plugin's package"),
    ("from irgen_qdq.spans import operand", "imports irgen_qdq.spans, another plugin's package"),
])
def test_the_check_names_file_and_line(source, expected):
    path = Path("plugins/quantizers/pow2/irgen_pow2/__init__.py")
    bad = import_violations(path, "x = 1\n" + source, {"irgen_pow2", "irgen_qdq"})
    assert len(bad) == 1
    assert bad[0].startswith(f"{path}:{source.count(chr(10)) + 2}: ")
    assert expected in bad[0]


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
                 "arg_ref", "realize_qdq"):
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
