"""Plugin command-line options: ``irgen_register_options`` and ``irgen_configure``.

A plugin adds options to ``irgen run`` (and ``irgen verify``) as ``pytest_addoption``
does: irgen reads ``--plugin`` first, loads the plugins, then parses the whole
command line with the options they register. The values reach ``irgen_configure``
(and frontends, in ``load(path, options)``); ``record=True`` options are kept in
``manifest.json`` for the source check, which takes them back only as far as they
are safe (``runs_code``, ``path`` kinds; an option no plugin registers is refused).
"""

from __future__ import annotations

import json
import shutil
import textwrap
from pathlib import Path

import pytest

from irgen.api import IrgenError, Option
from irgen.cli import main

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "tiny_cnn.onnx"

PLUGIN = """
    import json, os
    from irgen.plugin import Option, hookimpl

    @hookimpl
    def irgen_register_options(register):
        register(Option(name="tile_width", kind="int", default=8, record=True, commands=("run", "verify"),
                        help="width of a tile", group="tiling"))
        register(Option(name="weights_dir", kind="path", record=True, help="a folder of extra weights"))
        register(Option(name="loader_hook", record=True, runs_code=True, help="a module to import"))
        register(Option(name="fast", kind="flag", help="go fast"))

    @hookimpl
    def irgen_configure(options):
        with open(os.environ["SEEN_OPTIONS"], "w") as f:
            json.dump({k: options[k] for k in ("tile_width", "weights_dir", "loader_hook", "fast", "opt_level")},
                      f, default=str)
"""


@pytest.fixture
def plugin(tmp_path, monkeypatch):
    path = tmp_path / "tiling_plugin.py"
    path.write_text(textwrap.dedent(PLUGIN))
    monkeypatch.setenv("SEEN_OPTIONS", str(tmp_path / "seen.json"))
    model = tmp_path / "m.onnx"
    shutil.copy(EXAMPLE, model)
    monkeypatch.chdir(tmp_path)
    return path, model


def _irgen(capsys, *args) -> tuple[int, str, str]:
    capsys.readouterr()
    code = main([*map(str, args)])
    cap = capsys.readouterr()
    return code, cap.out, cap.err


def test_options_show_in_help_under_their_group(plugin, capsys):
    path, _ = plugin
    code, out, _ = _irgen(capsys, "--plugin", path, "run", "--help")
    assert code == 0
    assert "tiling:" in out and "--tile-width INT" in out and "width of a tile" in out
    assert "plugin tiling_plugin:" in out and "--weights-dir PATH" in out and "--fast" in out
    code, out, _ = _irgen(capsys, "verify", "--help", "-p", path)  # -p after the subcommand works too
    assert code == 0 and "--tile-width" in out and "--weights-dir" not in out  # run-only options stay on run
    code, out, _ = _irgen(capsys, "run", "--help")
    assert "--tile-width" not in out  # no plugin, no option


def test_values_reach_configure_and_the_manifest(plugin, tmp_path, capsys):
    path, model = plugin
    weights = tmp_path / "w"
    weights.mkdir()
    code, _, err = _irgen(capsys, "run", model, "-o", tmp_path / "out", "--no-progress", "-p", path,
                          "--tile-width", "32", "--weights-dir", "w", "--fast")
    assert code == 0, err
    seen = json.loads((tmp_path / "seen.json").read_text())
    assert seen == {"tile_width": 32, "weights_dir": "w", "loader_hook": None, "fast": True, "opt_level": 3}
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    # record=True options only (the value used, a default too), a path made absolute
    assert manifest["frontend_options"] == {"tile_width": 32, "weights_dir": str(weights.resolve())}
    # without the option its default reaches the plugin
    code, _, err = _irgen(capsys, "run", model, "-o", tmp_path / "out2", "--no-progress", "-p", path)
    assert code == 0, err
    assert json.loads((tmp_path / "seen.json").read_text())["tile_width"] == 8


def test_bad_value_is_a_usage_error(plugin, tmp_path, capsys):
    path, model = plugin
    code, _, err = _irgen(capsys, "run", model, "-o", tmp_path / "out", "-p", path, "--tile-width", "wide")
    assert code == 2 and "--tile-width" in err and "invalid int value" in err
    assert not (tmp_path / "out").exists()


def test_path_option_is_protected_from_out(plugin, tmp_path, capsys):
    path, model = plugin
    keep = tmp_path / "keep"
    keep.mkdir()
    (keep / "precious.npy").write_bytes(b"x")
    code, _, err = _irgen(capsys, "run", model, "-o", keep, "--force", "--no-progress", "-p", path,
                          "--weights-dir", keep)
    assert code == 2 and "--weights-dir" in err, err
    assert (keep / "precious.npy").read_bytes() == b"x"


def test_a_clash_with_a_core_option_names_the_plugin(tmp_path, capsys):
    bad = tmp_path / "clash.py"
    bad.write_text(textwrap.dedent("""
        from irgen.plugin import Option, hookimpl

        @hookimpl
        def irgen_register_options(register):
            register(Option(name="seed", kind="int", help="mine"))
    """))
    code, _, err = _irgen(capsys, "-p", bad, "run", "--help")
    assert code == 2 and "plugin 'clash' registers option --seed, which irgen run already has" in err


def test_two_plugins_with_one_option_are_named(tmp_path, capsys):
    for name in ("one", "two"):
        (tmp_path / f"{name}.py").write_text(textwrap.dedent("""
            from irgen.plugin import Option, hookimpl

            @hookimpl
            def irgen_register_options(register):
                register(Option(name="tile_width", kind="int", help="x"))
        """))
    code, _, err = _irgen(capsys, "-p", tmp_path / "one.py", "-p", tmp_path / "two.py", "--strict-plugins",
                          "run", "--help")
    assert code == 2 and "option 'tile_width' registered by both 'one' and 'two'" in err


@pytest.mark.parametrize("kwargs, needle", [
    ({"name": "Tile"}, "lower-case"),
    ({"name": "tile", "kind": "list"}, "kind 'list'"),
    ({"name": "tile", "commands": ("inspect",)}, "commands must be"),
])
def test_option_fields_are_checked(kwargs, needle):
    with pytest.raises(IrgenError, match=needle):
        Option(help="h", **kwargs)


def test_verify_takes_recorded_options_only_as_far_as_safe(plugin, tmp_path, capsys):
    path, model = plugin
    weights = tmp_path / "w"
    weights.mkdir()
    out = tmp_path / "out"
    code, _, err = _irgen(capsys, "run", model, "-o", out, "--no-progress", "-p", path, "--weights-dir", weights,
                          "--loader-hook", "evil_module")
    assert code == 0, err
    verify = ("verify", out, "--no-progress", "--no-report", "--mode", "source")
    # the recorded option runs code: not without the user's consent
    code, _, err = _irgen(capsys, *verify, "-p", path)
    assert code == 2 and "--loader-hook 'evil_module'" in err and "--allow-pickle" in err, err
    code, stdout, err = _irgen(capsys, *verify, "-p", path, "--allow-pickle", "--json")
    assert code == 0, err
    result = json.loads(stdout)
    assert any("--weights-dir" in n for n in result["notes"]), result["notes"]
    # a recorded path must still be there
    weights.rmdir()
    code, _, err = _irgen(capsys, *verify, "-p", path, "--allow-pickle")
    assert code == 2 and "--weights-dir" in err, err
    # an option no installed plugin registers is refused, not passed on blindly
    code, _, err = _irgen(capsys, *verify, "--allow-pickle")
    assert code == 2 and "records option(s) 'loader_hook', 'tile_width', 'weights_dir', which no installed plugin registers" in err, err


def test_verify_option_given_again_replaces_the_recorded_one(plugin, tmp_path, capsys, monkeypatch):
    path, model = plugin
    out = tmp_path / "out"
    assert _irgen(capsys, "run", model, "-o", out, "--no-progress", "-p", path, "--tile-width", "32")[0] == 0
    seen: list[dict] = []
    import irgen.source as source

    real = source.resolve_source

    def spy(*args, **kwargs):
        src = real(*args, **kwargs)
        seen.append(dict(src.options))
        return src

    monkeypatch.setattr(source, "resolve_source", spy)
    verify_args = ("verify", out, "--no-progress", "--no-report", "--mode", "source", "-p", path)
    assert _irgen(capsys, *verify_args)[0] == 0
    assert _irgen(capsys, *verify_args, "--tile-width", "64")[0] == 0
    assert [s["tile_width"] for s in seen] == [32, 64]
