"""The plugin host (irgen.plugins) and the CLI around it (irgen.cli)."""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

import irgen
from irgen.api import Frontend, IrgenError, Serializer
from irgen.cli import main
from irgen.hookspecs import hookimpl
from irgen.plugins import PluginHost, Registry

CORE = Path(irgen.__file__).resolve().parent.parent
HEAVY = {"tvm", "torch", "tensorflow", "onnx", "onnxruntime"}

GOOD = """
    from irgen import hookimpl
    from irgen.api import Frontend, Serializer

    __version__ = "1.2.3"

    @hookimpl
    def irgen_register_frontends(register):
        register(Frontend(name="testfmt", suffixes=(".tst",), load=lambda path, options: None))

    @hookimpl
    def irgen_register_serializers(register):
        register(Serializer(name="yamlish", write=lambda ir, out: []))
"""

OTHER_TESTFMT = """
    from irgen import hookimpl
    from irgen.api import Frontend

    @hookimpl
    def irgen_register_frontends(register):
        register(Frontend(name="testfmt", suffixes=(".x",), load=lambda path, options: None))
"""

BROKEN = """
    raise ImportError("needs the frobnicator")
"""


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("IRGEN_BLOCK_PLUGINS", raising=False)
    monkeypatch.delenv("IRGEN_PLUGINS_STRICT", raising=False)


@pytest.fixture
def no_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    """An empty world: no installed entry-point plugins (onnx, generic, json are installed)."""

    def entry_points(**selection):
        assert selection == {"group": "irgen"}
        return []

    monkeypatch.setattr(importlib.metadata, "entry_points", entry_points)


def plugins_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, dict]:
    assert main(["plugins", "--json", *argv]) == 0
    return {row["name"]: row for row in json.loads(capsys.readouterr().out)}


def test_file_plugin_registers_frontend_and_serializer(no_installed, plugin_file) -> None:
    host = PluginHost().load(extra=[str(plugin_file("myplugin", GOOD))])
    frontend = host.frontends.get("testfmt")
    assert frontend.claims_file(Path("model.TST"))
    assert not frontend.claims_file(Path("model.onnx"))
    assert host.serializers.names() == ["yamlish"]
    assert host.frontends.owner("testfmt") == "myplugin"
    assert host.serializers.owner("yamlish") == "myplugin"
    assert len(host.backends) == 0 and len(host.quantizers) == 0


def test_plugins_json_lists_file_plugin_with_hooks(plugin_file, capsys) -> None:
    rows = plugins_json(capsys, "--plugin", str(plugin_file("myplugin", GOOD)))
    row = rows["myplugin"]
    assert row["version"] == "1.2.3"
    assert row["source"] == "--plugin"
    assert row["status"] == "loaded"
    assert row["hooks"] == ["irgen_register_frontends", "irgen_register_serializers"]
    assert row["kinds"] == ["frontend", "serializer"]
    assert row["registered"] == {"frontend": ["testfmt"], "serializer": ["yamlish"]}


def test_plugins_table_and_global_option_before_subcommand(no_installed, plugin_file, capsys) -> None:
    assert main(["--plugin", str(plugin_file("myplugin", GOOD)), "plugins"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["NAME", "VERSION", "SOURCE", "STATUS", "KINDS", "HOOKS"]
    assert lines[1].startswith("myplugin  1.2.3")
    assert "frontend, serializer" in lines[1]
    assert "irgen_register_serializers" in lines[1]


def test_plugin_given_as_dotted_module(plugin_file, monkeypatch, capsys) -> None:
    path = plugin_file("irgen_test_dotted_plugin", GOOD)
    monkeypatch.syspath_prepend(str(path.parent))
    monkeypatch.delitem(sys.modules, path.stem, raising=False)
    rows = plugins_json(capsys, "--plugin", path.stem)
    assert rows[path.stem]["registered"]["frontend"] == ["testfmt"]


def test_duplicate_name_names_both_plugins(plugin_file, capsys) -> None:
    first = plugin_file("first", GOOD)
    second = plugin_file("second", OTHER_TESTFMT)
    assert main(["plugins", "--plugin", str(first), "--plugin", str(second)]) == 2
    err = capsys.readouterr().err
    assert err == "irgen: error: frontend 'testfmt' registered by both 'first' and 'second'\n"


def test_no_name_blocks_plugin_before_import(no_installed, plugin_file, capsys) -> None:
    good = plugin_file("myplugin", GOOD)
    broken = plugin_file("broken", BROKEN)
    host = PluginHost().load(extra=[str(good), str(broken), "no:myplugin", "no:broken"])
    assert "testfmt" not in host.frontends
    assert capsys.readouterr().err == ""  # 'broken' was never imported
    status = {row["name"]: row["status"] for row in host.describe()}
    assert status == {"myplugin": "blocked", "broken": "blocked"}


def test_blocked_argument_and_env_var(plugin_file, monkeypatch) -> None:
    good = str(plugin_file("myplugin", GOOD))
    assert "testfmt" not in PluginHost().load(extra=[good], blocked=["myplugin"]).frontends
    monkeypatch.setenv("IRGEN_BLOCK_PLUGINS", "other, myplugin")
    assert "testfmt" not in PluginHost().load(extra=[good]).frontends
    monkeypatch.setenv("IRGEN_BLOCK_PLUGINS", "other")
    assert "testfmt" in PluginHost().load(extra=[good]).frontends


def test_broken_plugin_is_reported_and_skipped(plugin_file, capsys) -> None:
    broken = plugin_file("broken", BROKEN)
    good = plugin_file("myplugin", GOOD)
    assert main(["plugins", "--json", "--plugin", str(broken), "--plugin", str(good)]) == 0
    out, err = capsys.readouterr()
    assert err == "irgen: warning: plugin 'broken' failed to load: ImportError: needs the frobnicator\n"
    rows = {row["name"]: row for row in json.loads(out)}
    assert rows["broken"]["status"] == "failed"
    assert rows["broken"]["error"] == "ImportError: needs the frobnicator"
    assert rows["myplugin"]["status"] == "loaded"


@pytest.mark.parametrize("how", ["flag-before", "flag-after", "env"])
def test_broken_plugin_is_fatal_when_strict(plugin_file, monkeypatch, capsys, how) -> None:
    argv = ["plugins", "--plugin", str(plugin_file("broken", BROKEN))]
    if how == "flag-before":
        argv.insert(0, "--strict-plugins")
    elif how == "flag-after":
        argv.append("--strict-plugins")
    else:
        monkeypatch.setenv("IRGEN_PLUGINS_STRICT", "1")
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == (
        "irgen: error: plugin 'broken' failed to load: ImportError: needs the frobnicator\n"
    )


def test_missing_plugin_file_or_module_is_an_error(tmp_path, capsys) -> None:
    assert main(["plugins", "--plugin", str(tmp_path / "nope.py")]) == 2
    assert capsys.readouterr().err == f"irgen: error: --plugin '{tmp_path / 'nope.py'}': no such file\n"
    assert main(["plugins", "--plugin", "irgen_no_such_module_xyz"]) == 2
    assert "no module named 'irgen_no_such_module_xyz'" in capsys.readouterr().err


def test_plugin_with_misspelled_hook_is_rejected(plugin_file, capsys) -> None:
    typo = plugin_file("typo", """
        from irgen import hookimpl

        @hookimpl
        def irgen_register_frontend(register):
            pass
    """)
    host = PluginHost().load(extra=[str(typo)])
    assert "unknown hook(s): irgen_register_frontend" in capsys.readouterr().err
    assert [f.name for f in host.failures] == ["typo"]


def test_plugin_whose_hook_raises_is_dropped_entirely(no_installed, plugin_file, capsys) -> None:
    bad = plugin_file("halfway", """
        from irgen import hookimpl
        from irgen.api import Serializer

        @hookimpl
        def irgen_register_frontends(register):
            raise RuntimeError("boom")

        @hookimpl
        def irgen_register_serializers(register):
            register(Serializer(name="half", write=lambda ir, out: []))
    """)
    good = plugin_file("myplugin", GOOD)
    host = PluginHost().load(extra=[str(bad), str(good)])
    err = capsys.readouterr().err
    assert "plugin 'halfway' failed in irgen_register_frontends: RuntimeError: boom" in err
    assert host.serializers.names() == ["yamlish"]
    assert host.frontends.names() == ["testfmt"]


def test_wrong_object_kind_is_an_error() -> None:
    class Confused:
        @hookimpl
        def irgen_register_backends(self, register):
            register(Serializer(name="json2", write=lambda ir, out: []))

    with pytest.raises(IrgenError, match="plugin 'confused' registered a Serializer as a backend"):
        PluginHost().register_plugin(Confused(), "confused")


def test_register_plugin_and_unregister() -> None:
    class Fake:
        @hookimpl
        def irgen_register_frontends(self, register):
            register(Frontend(name="fake", suffixes=(".fake",), load=lambda path, options: None))

    host = PluginHost()
    host.register_plugin(Fake(), "fake-plugin")
    assert host.frontends.owner("fake") == "fake-plugin"
    assert host.describe()[0]["source"] == "api"
    with pytest.raises(IrgenError, match="already registered"):
        host.register_plugin(Fake(), "fake-plugin")
    host.unregister("fake-plugin")
    assert host.frontends.names() == [] and host.describe() == []


def test_registry_get_unknown_lists_available() -> None:
    registry: Registry[Serializer] = Registry("serializer", Serializer)
    with pytest.raises(IrgenError, match=r"unknown serializer 'json' \(available: none registered\)"):
        registry.get("json")
    registry.register(Serializer(name="b", write=lambda ir, out: []), "p1")
    registry.register(Serializer(name="a", write=lambda ir, out: []), "p2")
    with pytest.raises(IrgenError, match=r"unknown serializer 'json' \(available: a, b\)"):
        registry.get("json")
    assert [name for name, _ in registry.items()] == ["a", "b"]
    assert registry.owner("a") == "p2"


def test_entry_point_plugins_are_loaded_and_blockable(plugin_file, monkeypatch, capsys) -> None:
    path = plugin_file("irgen_test_ep_plugin", GOOD)
    broken = plugin_file("irgen_test_ep_broken", BROKEN)
    monkeypatch.syspath_prepend(str(path.parent))
    eps = [
        importlib.metadata.EntryPoint("testep", path.stem, "irgen"),
        importlib.metadata.EntryPoint("brokenep", broken.stem, "irgen"),
    ]
    calls = []

    def entry_points(**selection):
        calls.append(selection)
        return eps

    monkeypatch.setattr(importlib.metadata, "entry_points", entry_points)
    host = PluginHost().load()
    assert calls == [{"group": "irgen"}]
    assert host.frontends.owner("testfmt") == "testep"
    rows = {row["name"]: row for row in host.describe()}
    assert rows["testep"]["source"] == "entry point"
    assert rows["brokenep"]["status"] == "failed"
    assert "plugin 'brokenep' failed to load" in capsys.readouterr().err

    host = PluginHost().load(extra=["no:testep", "no:brokenep"])
    assert host.frontends.names() == [] and capsys.readouterr().err == ""
    with pytest.raises(IrgenError, match="two plugins named 'testep'"):
        PluginHost().load(extra=[str(plugin_file("testep", OTHER_TESTFMT))])


INSTALLED = {  # plugin name -> (kind, registered name) of the distributions in this repo
    "onnx": ("frontend", "onnx"),
    "generic": ("backend", "generic"),
    "json": ("serializer", "json"),
}


def test_installed_plugins_are_listed(capsys) -> None:
    rows = plugins_json(capsys)
    for name, (kind, registered) in INSTALLED.items():
        row = rows[name]
        assert row["source"] == "entry point" and row["status"] == "loaded", row
        assert row["version"] and row["error"] in (None, "")
        assert row["kinds"] == [kind]
        assert registered in row["registered"][kind]
    assert main(["plugins"]) == 0
    table = capsys.readouterr().out.splitlines()
    assert {line.split()[0] for line in table[1:]} >= set(INSTALLED)


def test_installed_plugins_can_be_blocked(capsys, monkeypatch) -> None:
    rows = plugins_json(capsys, "--plugin", "no:onnx")
    assert rows["onnx"]["status"] == "blocked" and rows["generic"]["status"] == "loaded"
    monkeypatch.setenv("IRGEN_BLOCK_PLUGINS", "generic,json")
    host = PluginHost().load()
    assert "generic" not in host.backends and "json" not in host.serializers
    assert "onnx" in host.frontends


def test_run_passes_args_and_host_to_pipeline(plugin_file, monkeypatch, capsys, tmp_path) -> None:
    seen = {}

    def run_cli(args, host):
        seen.update(vars(args), host=host)
        if args.seed == 7:
            raise IrgenError("model.tst: bad\nthing")
        return 5

    fake = types.ModuleType("irgen.pipeline")
    fake.run_cli = run_cli
    monkeypatch.setitem(sys.modules, "irgen.pipeline", fake)
    monkeypatch.setattr(irgen, "pipeline", fake, raising=False)
    plugin = str(plugin_file("myplugin", GOOD))
    argv = ["run", "m.tst", "-o", str(tmp_path / "out"), "--input", "x:1,3:float32",
            "--plugin", plugin, "--opt-level", "1"]
    assert main(argv) == 5
    assert seen["model"] == Path("m.tst") and seen["output"] == tmp_path / "out"
    assert seen["input"] == ["x:1,3:float32"] and seen["opt_level"] == 1
    assert (seen["backend"], seen["serializer"], seen["frontend"]) == ("generic", None, None)  # None: ir.json only
    assert (seen["force"], seen["seed"], seen["no_progress"]) == (False, 0, False)
    assert seen["plugin"] == [plugin] and seen["strict_plugins"] is False
    assert "testfmt" in seen["host"].frontends

    assert main([*argv, "--seed", "7"]) == 2
    assert capsys.readouterr().err == "irgen: error: model.tst: bad thing\n"
    assert main(["run", "m.tst", "-o", "out", "--opt-level", "5"]) == 2


def test_keyboard_interrupt(monkeypatch, capsys) -> None:
    def interrupted(self, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(PluginHost, "load", interrupted)
    assert main(["plugins"]) == 130
    assert capsys.readouterr().err == "irgen: interrupted\n"


def test_version(capsys) -> None:
    assert main(["--version"]) == 0
    assert capsys.readouterr().out == f"irgen {irgen.__version__}\n"


@pytest.mark.parametrize("argv", [["--help"], ["plugins"], ["plugins", "--json"]])
def test_help_and_plugins_do_not_import_heavy_modules(argv) -> None:
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "irgen", *argv],
        capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(CORE)}, timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    imported = {
        line.rsplit("|", 1)[1].strip()
        for line in proc.stderr.splitlines() if line.startswith("import time:") and "|" in line
    }
    assert "irgen.cli" in imported and "pluggy" in imported  # the check sees real imports
    assert not {name.split(".")[0] for name in imported} & HEAVY
