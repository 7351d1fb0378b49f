"""Meta-tests of the hook specifications (:mod:`irgen.hookspecs`): every hook a plugin can
implement is documented (its docstring, and by name in ``docs/writing-a-plugin.md``) and
exercised by a test that implements it.

The hooks are discovered from the module, not listed here: a new hook spec fails these
tests until it has a docstring, a place in the guide and a row in :data:`TESTED_BY`.
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

from irgen import hookspecs

ROOT = Path(__file__).resolve().parent.parent
GUIDE = ROOT / "docs" / "writing-a-plugin.md"

#: hook name -> the test ("tests/FILE.py::FUNCTION") that registers a plugin implementing it
#: and checks its effect
TESTED_BY = {
    "irgen_register_frontends": "tests/test_plugins.py::test_file_plugin_registers_frontend_and_serializer",
    "irgen_register_quantizers": "tests/test_quant_plugins.py::test_third_party_scheme_takes_effect",
    "irgen_register_backends": "tests/test_plugin_contracts.py::test_backend_files_read_back_by_the_backend",
    "irgen_register_serializers": "tests/test_plugin_kit.py::test_conformance_fails_on_a_broken_plugin_of_each_kind",
    "irgen_register_options": "tests/test_plugin_options.py::test_values_reach_configure_and_the_manifest",
    "irgen_configure": "tests/test_plugin_options.py::test_values_reach_configure_and_the_manifest",
    "irgen_register_signatures": "tests/test_compare.py::test_plugin_signature_and_reader",
    "irgen_register_dump_readers": "tests/test_compare.py::test_plugin_signature_and_reader",
}


def hook_specs() -> dict[str, object]:
    """Every function of :mod:`irgen.hookspecs` marked ``@hookspec``, by name."""
    marker = f"{hookspecs.PROJECT}_spec"  # pluggy's HookspecMarker sets this attribute
    return {name: fn for name, fn in vars(hookspecs).items()
            if inspect.isfunction(fn) and getattr(fn, marker, None) is not None}


def test_the_discovery_finds_the_hooks_and_only_them():
    specs = hook_specs()
    assert {"irgen_register_frontends", "irgen_register_quantizers", "irgen_register_backends",
            "irgen_register_serializers"} <= set(specs)
    assert "hookspec" not in specs and "hookimpl" not in specs
    # the same set pluggy registers on a plugin host
    from irgen.plugins import PluginHost

    host = PluginHost()
    assert set(specs) == {name for name in dir(host.pm.hook) if name.startswith(hookspecs.PROJECT + "_")}


@pytest.mark.parametrize("name", sorted(hook_specs()))
def test_every_hook_is_documented(name):
    fn = hook_specs()[name]
    doc = inspect.getdoc(fn) or ""
    assert len(doc) >= 80 and "." in doc, f"{name}: its docstring must say when it is called and what it gets"
    for param in inspect.signature(fn).parameters:
        assert param in doc, f"{name}: the docstring does not explain the argument {param!r}"
    assert f"`{name}`" in GUIDE.read_text(encoding="utf-8"), f"{name} is not named in {GUIDE.relative_to(ROOT)}"


@pytest.mark.parametrize("name", sorted(hook_specs()))
def test_every_hook_has_a_test_that_implements_it(name):
    assert name in TESTED_BY, f"{name}: add the test that exercises it to TESTED_BY in {Path(__file__).name}"
    path, _, function = TESTED_BY[name].partition("::")
    source = (ROOT / path).read_text(encoding="utf-8")
    tests = {node.name for node in ast.walk(ast.parse(source)) if isinstance(node, ast.FunctionDef)}
    assert function in tests, f"{TESTED_BY[name]} does not exist"
    assert f"def {name}(" in source, f"{path} never implements {name}"


def test_the_table_names_only_hooks():
    assert set(TESTED_BY) <= set(hook_specs()), set(TESTED_BY) - set(hook_specs())
