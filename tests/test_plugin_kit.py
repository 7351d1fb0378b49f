"""The plugin author's kit: ``irgen new-plugin``, ``irgen.testing`` (fixtures, helpers, the
conformance suite) and ``irgen plugins`` showing what each plugin registers.

The acceptance: a plugin of each kind written by ``irgen new-plugin``, ``pip install``ed
into one fresh virtual environment beside irgen, is listed by ``irgen plugins`` there,
takes effect in ``irgen run`` and passes ``irgen verify``; the generated projects' own
tests pass there with pytest. The conformance suite passes on the in-repository plugins
(onnx, qdq, generic, json) and fails on a broken plugin of each kind.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import numpy as np
import pytest

import irgen.testing as it
from irgen.api import IrgenError
from irgen.cli import main
from irgen.plugin import Backend, Frontend, Quantizer, Serializer, hookimpl
from irgen.plugins import PluginHost
from irgen.scaffold import KINDS, new_plugin
from irgen.testing import conformance
from test_plugin_api import PACKAGES, import_violations

ROOT = Path(__file__).resolve().parent.parent
TEMPLATES = ROOT / "core" / "irgen" / "scaffold" / "templates"
#: the generated plugins of the acceptance test: kind -> name
KIT = {"frontend": "kit-fe", "quantizer": "kit-q", "backend": "kit-be", "serializer": "kit-ser"}


# -- irgen new-plugin -----------------------------------------------------------------------------

@pytest.mark.parametrize("kind", KINDS)
def test_each_kind_is_a_project_with_an_entry_point_that_imports_only_irgen_plugin(kind, tmp_path):
    path = new_plugin(kind, "acme-thing", tmp_path / "proj")
    files = sorted(p.relative_to(path).as_posix() for p in path.rglob("*") if p.is_file())
    assert files == ["README.md", "irgen_acme_thing/__init__.py", "pyproject.toml", "tests/test_plugin.py"]
    project = tomllib.loads((path / "pyproject.toml").read_text())
    assert project["project"]["name"] == "irgen-acme-thing"
    assert project["project"]["entry-points"]["irgen"] == {"acme-thing": "irgen_acme_thing"}
    assert any(re.fullmatch(r"irgen>=\d+\.\d+\.\d+", d) for d in project["project"]["dependencies"])
    source = (path / "irgen_acme_thing" / "__init__.py").read_text()
    assert not re.search(r"\{\{[A-Z_]+\}\}", source) and "from irgen.plugin import" in source and f"def irgen_register_{kind}s(" in source
    compile(source, "x.py", "exec")
    assert not import_violations(path / "irgen_acme_thing" / "__init__.py", source, set(PACKAGES.values()))
    test = (path / "tests" / "test_plugin.py").read_text()
    assert "irgen_plugin(irgen_acme_thing)" in test and "conformance.check_" in test
    readme = (path / "README.md").read_text()
    assert not re.search(r"\{\{[A-Z_]+\}\}", readme) and "irgen-acme-thing" in readme and "acme-thing" in readme


def test_the_templates_ship_in_the_wheel_and_irgen_testing_is_a_pytest_plugin():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    setuptools = project["tool"]["setuptools"]
    assert {"irgen", "irgen.testing", "irgen.scaffold"} <= set(setuptools["packages"])
    globs = setuptools["package-data"]["irgen"]
    templates = [p.relative_to(ROOT / "core" / "irgen") for p in TEMPLATES.rglob("*") if p.is_file()]
    assert len(templates) == 2 + 3 * len(KINDS)  # common: pyproject, README; each kind: package, tests, about.json
    for rel in templates:
        assert any(rel.match(g) and len(rel.parts) == len(Path(g).parts) for g in globs), rel
    assert project["project"]["entry-points"]["pytest11"] == {"irgen": "irgen.testing.pytest_plugin"}


@pytest.mark.parametrize("name", ["", "Acme", "a b", "../x", "a/b", "a--b", "a_", "-a", "1abc", "a.b", "x" * 41,
                                  "naïve", "a\nb"])
def test_an_unsafe_name_is_refused_and_nothing_is_written(name, tmp_path):
    with pytest.raises(IrgenError, match="plugin name"):
        new_plugin("serializer", name, tmp_path / "proj")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("what", ["file", "empty folder", "dangling link"])
def test_an_existing_target_is_refused(what, tmp_path):
    target = tmp_path / "proj"
    if what == "file":
        target.write_text("mine")
    elif what == "empty folder":
        target.mkdir()
    else:
        target.symlink_to(tmp_path / "nowhere")
    with pytest.raises(IrgenError, match="already exists"):
        new_plugin("backend", "acme", target)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["proj"]
    assert what != "file" or target.read_text() == "mine"


def test_a_failure_while_writing_leaves_nothing_half_written(tmp_path, monkeypatch):
    import irgen.scaffold as scaffold

    real = scaffold._templates

    def failing(kind):
        for k, item in enumerate(real(kind)):
            if k == 2:
                raise OSError(28, "No space left on device")
            yield item

    monkeypatch.setattr(scaffold, "_templates", failing)
    with pytest.raises(OSError, match="No space"):
        new_plugin("frontend", "acme", tmp_path / "proj")
    assert list(tmp_path.iterdir()) == []  # neither the project nor the hidden folder it was written in


def test_the_command(tmp_path, capsys):
    assert main(["new-plugin", "quantizer", "acme-int8", "-o", str(tmp_path / "p")]) == 0
    out = capsys.readouterr().out
    assert f"wrote {tmp_path / 'p'}" in out and "irgen_acme_int8" in out
    assert (tmp_path / "p" / "irgen_acme_int8" / "__init__.py").is_file()
    assert main(["new-plugin", "quantizer", "acme-int8", "-o", str(tmp_path / "p")]) == 2
    assert "already exists" in capsys.readouterr().err
    assert main(["new-plugin", "quantizer", "Acme", "-o", str(tmp_path / "q")]) == 2
    assert "plugin name 'Acme'" in capsys.readouterr().err
    assert main(["new-plugin", "optimizer", "acme", "-o", str(tmp_path / "q")]) == 2
    assert "invalid choice" in capsys.readouterr().err and not (tmp_path / "q").exists()


# -- irgen.testing: registering for one test, irgen plugins -------------------------------------

class Yaml:
    """A serializer plugin object (not a module) for the registration tests."""

    __name__ = "kit-yaml-plugin"

    @hookimpl
    def irgen_register_serializers(self, register):
        register(Serializer(name="kit-yaml", write=lambda ir, out: [], description="layers as YAML (test)"))


def test_registered_plugins_join_every_host_and_leave_with_their_recomputes(capsys):
    from irgen import quant
    from irgen.plugin import register_recompute

    before = dict(quant.RECOMPUTE)
    with it.registered(Yaml()) as host:
        assert host.serializers.owner("kit-yaml") == "kit-yaml-plugin"
        assert "kit-yaml" in PluginHost().load().serializers  # any host loaded meanwhile: irgen run, verify...
        with pytest.deprecated_call():  # API 2.0: Quantizer(recompute=...); the 1.x way still works
            register_recompute("kit-scheme", "*", lambda layer, inputs, params: inputs[0])
        assert main(["plugins", "--json"]) == 0
        rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
        assert rows["kit-yaml-plugin"]["registered"] == {"serializer": ["kit-yaml"]}
        assert rows["kit-yaml-plugin"]["descriptions"] == {"serializer": {"kit-yaml": "layers as YAML (test)"}}
        assert main(["plugins"]) == 0
        text = capsys.readouterr().out.splitlines()
    assert "kit-yaml" not in PluginHost().load().serializers
    assert quant.RECOMPUTE == before and it._ORIGINAL_LOAD is None and not it._ACTIVE
    # the listing: the plugin table, then what each plugin registers by kind and name
    assert text[0].split() == ["NAME", "VERSION", "SOURCE", "STATUS", "KINDS", "HOOKS"]
    at = text.index(next(line for line in text if line.split() == ["KIND", "NAME", "PLUGIN", "DESCRIPTION"]))
    listed = [line.split(None, 3) for line in text[at + 1:]]
    assert ["serializer", "kit-yaml", "kit-yaml-plugin", "layers as YAML (test)"] in listed
    assert ["frontend", "onnx", "onnx", "ONNX models through TVM's Relax ONNX importer"] in listed
    assert ["backend", "generic"] == listed[[r[1] for r in listed].index("generic")][:2]
    kinds = [r[0] for r in listed]
    assert kinds == sorted(kinds, key=["frontend", "quantizer", "backend", "serializer", "option", "signature",
                                      "dump-reader"].index)


def test_the_pytest_plugin_is_loaded_and_its_fixture_removes_the_plugin(request, irgen_plugin):
    assert request.config.pluginmanager.hasplugin("irgen")
    host = irgen_plugin(Yaml(), name="yaml-for-one-test")
    assert host.serializers.owner("kit-yaml") == "yaml-for-one-test"
    with pytest.raises(IrgenError, match="serializer 'kit-yaml' registered by both 'yaml-for-one-test' and 'second'"):
        irgen_plugin(Yaml(), name="second")  # the name kit-yaml is taken: an error, not a warning

    class Failing:
        @hookimpl
        def irgen_register_backends(self, register):
            raise RuntimeError("no licence for the acme toolchain")

    with pytest.raises(IrgenError, match="plugin 'failing' could not be registered: RuntimeError: no licence"):
        irgen_plugin(Failing(), name="failing")


def test_the_fixture_left_nothing_behind():
    assert "kit-yaml" not in PluginHost().load().serializers


# -- the conformance suite ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def onnx_models(tmp_path_factory):
    pytest.importorskip("onnxruntime")
    d = tmp_path_factory.mktemp("kit_models")
    return {"float": it.models.float_onnx(d / "float.onnx"), "qdq": it.models.qdq_onnx(d / "qdq.onnx"),
            "x": it.models.input_npy(d / "x.npy")}


def test_conformance_of_the_in_repo_plugins(onnx_models, tmp_path):
    fe = conformance.check_frontend("onnx", onnx_models["float"], tmp=tmp_path, min_source_layers=5)
    assert fe["layers"] == 7 and fe["source_checked"] >= 5 and "onnxruntime" in fe["runtime"].lower()
    scheme = conformance.check_scheme("qdq", onnx_models["qdq"], tmp=tmp_path)
    assert scheme["recomputed"]["conv2d"] == 2 and scheme["recomputed"]["dense"] == 1
    be = conformance.check_backend("generic", onnx_models["float"], tmp=tmp_path)
    assert be["suffixes"] == [".npy"] and be["files"] == 14
    ser = conformance.check_serializer("json", lambda out: json.loads((out / "ir.json").read_text()),
                                       onnx_models["float"], tmp=tmp_path)
    assert ser == {"layers": 7, "files": []}


class SkewedFrontend:
    """The onnx frontend whose source runtime is 2 % off."""

    @hookimpl
    def irgen_register_frontends(self, register):
        import irgen_onnx

        def runner(path, options):
            run = irgen_onnx.source_runner(path, options)
            return lambda inputs, tensors: {k: np.asarray(v) * np.float32(1.02) for k, v in run(inputs, tensors).items()}

        register(Frontend(name="onnx-skewed", suffixes=(), load=irgen_onnx.load_onnx, runner=runner))


class OffByOneBackend:
    """The generic backend's fusion, raw files, one value of each weight read back wrong."""

    @hookimpl
    def irgen_register_backends(self, register):
        import irgen_generic

        def write(path, array):
            out = path.with_name(path.name + ".raw")
            np.ascontiguousarray(array).tofile(out)
            return out

        def read(path, record):
            a = np.fromfile(path, record["dtype"]).reshape(record["shape"])
            if a.size and "weight" in path.name:
                a.flat[0] += 1
            return a

        register(Backend(name="off-by-one", fusion_rules=irgen_generic.RULES, write_tensor=write, read_tensor=read))


class ForgetfulSerializer:
    """Writes ir.json's layers but its parser drops the last one."""

    @hookimpl
    def irgen_register_serializers(self, register):
        register(Serializer(name="forgetful", write=lambda ir, out: []))

    @staticmethod
    def parse(out):
        return json.loads((out / "ir.json").read_text())["layers"][:-1]


class DriftingScheme:
    """qdq's realization under another name, with a conv2d recompute that flips one bit."""

    @hookimpl
    def irgen_register_quantizers(self, register):
        import irgen_qdq

        def flipped(layer, inputs, params):
            out = irgen_qdq.RECOMPUTE["*"](layer, inputs, params)
            out.flat[0] ^= 1
            return out

        register(Quantizer(name="qdq-drift", detect=lambda qg: False,
                           realize=lambda qg: irgen_qdq.realize(qg, "qdq-drift"),
                           recompute={**irgen_qdq.RECOMPUTE, "conv2d": flipped}))


def test_conformance_fails_on_a_broken_plugin_of_each_kind(onnx_models, tmp_path, irgen_plugin, monkeypatch):
    import irgen.pipeline
    from conftest import _run  # without the session's self-check: the conformance suite is what must fail here

    monkeypatch.setattr(irgen.pipeline, "run", _run)

    irgen_plugin(SkewedFrontend(), name="skewed")
    with pytest.raises(AssertionError, match="irgen verify failed"):
        conformance.check_frontend("onnx-skewed", onnx_models["float"], tmp=tmp_path)

    irgen_plugin(OffByOneBackend(), name="off-by-one")
    with pytest.raises(AssertionError, match=r"weight\.raw differs from the generic backend's values"):
        conformance.check_backend("off-by-one", onnx_models["float"], tmp=tmp_path)

    irgen_plugin(ForgetfulSerializer(), name="forgetful")
    with pytest.raises(AssertionError, match="parsed layers"):
        conformance.check_serializer("forgetful", ForgetfulSerializer.parse, onnx_models["float"], tmp=tmp_path)

    irgen_plugin(DriftingScheme(), name="drift")
    with pytest.raises(AssertionError, match=r"layer '\w+' \(conv2d\): 1 of \d+ values differ"):
        conformance.check_scheme("qdq-drift", onnx_models["qdq"], tmp=tmp_path)
    with pytest.raises(AssertionError, match="no quantizer named 'qdq-absent'"):
        conformance.check_scheme("qdq-absent", onnx_models["qdq"], tmp=tmp_path)


# -- the acceptance: generated plugins installed beside irgen ----------------------------------

VENV_SCRIPT = r"""
import contextlib, io, json, sys
from pathlib import Path
from irgen.cli import main

jobs = json.loads(sys.argv[1])
results = []
for argv in jobs:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    results.append({"argv": argv, "code": code, "out": out.getvalue(), "err": err.getvalue()})
import irgen_kit_ser
results.append(irgen_kit_ser.parse(Path(sys.argv[2])))
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def kit(tmp_path_factory, onnx_models):
    """The four generated plugins installed into one fresh venv; the runs made with them there."""
    d = tmp_path_factory.mktemp("kit")
    projects = {kind: new_plugin(kind, name, d / f"irgen-{name}") for kind, name in KIT.items()}
    py = it.fresh_venv(d / "venv", *projects.values())
    for name in KIT.values():  # importable in the venv only
        package = "irgen_" + name.replace("-", "_")
        assert subprocess.run([sys.executable, "-c", f"import {package}"], capture_output=True, cwd=d).returncode
    mlp = d / "mlp.kit-fe.json"
    subprocess.run([str(py), "-c", f"import irgen_kit_fe; irgen_kit_fe.example({str(mlp)!r})"], check=True, cwd=d)
    x = str(onnx_models["x"])
    jobs = [
        ["plugins", "--json"], ["plugins"],
        ["run", str(mlp), "-o", str(d / "fe"), "--no-progress"],
        ["verify", str(d / "fe"), "--json", "--no-report", "--no-progress"],
        ["run", str(onnx_models["qdq"]), "-o", str(d / "q"), "--quantizer", "kit-q", "--input", x, "--no-progress"],
        ["verify", str(d / "q"), "--json", "--no-report", "--no-progress"],
        ["run", str(onnx_models["float"]), "-o", str(d / "be"), "--backend", "kit-be", "--serializer", "kit-ser",
         "--input", x, "--no-progress"],
        ["verify", str(d / "be"), "--json", "--no-report", "--no-progress"],
    ]
    r = subprocess.run([str(py), "-c", VENV_SCRIPT, json.dumps(jobs), str(d / "be")], capture_output=True, text=True,
                       cwd=d, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    *results, parsed = json.loads(r.stdout.strip().splitlines()[-1])
    for res in results:
        assert res["code"] == 0, f"irgen {' '.join(res['argv'])} exited {res['code']}:\n{res['err'][-3000:]}"
    return {"dir": d, "py": py, "projects": projects, "results": results, "parsed": parsed}


@pytest.mark.slow  # the kit fixture builds a fresh venv
def test_generated_plugins_are_listed_by_irgen_plugins(kit):
    rows = {r["name"]: r for r in json.loads(kit["results"][0]["out"])}
    for kind, name in KIT.items():
        row = rows[name]
        assert row["dist"] == f"irgen-{name}" and row["version"] == "0.1.0" and row["status"] == "loaded", row
        assert row["source"] == "entry point" and row["registered"] == {kind: [name]}
    text = kit["results"][1]["out"].splitlines()
    for kind, name in KIT.items():
        assert any(line.split()[:3] == [kind, name, name] for line in text), text


@pytest.mark.slow  # the kit fixture builds a fresh venv
def test_generated_plugins_take_effect_in_irgen_run_and_verify_passes(kit):
    d = kit["dir"]
    verdicts = {job: json.loads(kit["results"][k]["out"]) for job, k in (("fe", 3), ("q", 5), ("be", 7))}
    for job, result in verdicts.items():
        assert result["passed"] and result["summary"]["failed"] == 0, (job, result["problems"])
    fe = json.loads((d / "fe" / "ir.json").read_text())
    assert fe["producer"]["frontend"] == "kit-fe" and [layer["op"] for layer in fe["layers"]] == ["dense"] * 3
    assert verdicts["fe"]["source"]["ran"] and "kit-fe numpy forward pass" in verdicts["fe"]["source"]["runtime"]
    assert all(layer["checks"]["source"]["status"] == "pass" for layer in verdicts["fe"]["layers"])

    q = json.loads((d / "q" / "ir.json").read_text())
    assert q["producer"]["quantizer"] == "kit-q" and {layer["quant"]["scheme"] for layer in q["layers"]} == {"kit-q"}
    macs = [layer["quant"]["requant"] for layer in q["layers"] if layer["quant"]["kind"] in ("conv2d", "dense")]
    assert len(macs) == 3 and all(rq["rounding"] == "double" and rq["multiplier"] for rq in macs)
    assert verdicts["q"]["source"]["ran"] and "onnxruntime" in verdicts["q"]["source"]["runtime"].lower()

    be = json.loads((d / "be" / "ir.json").read_text())
    assert be["producer"]["backend"] == "kit-be" and "kit-ser" in be["producer"]["serializers"]
    files = [t["file"] for t in it.tensor_records(be)]
    assert len(files) == 13 and all(f.endswith(".tns") for f in files)  # the pool output is no tensor
    assert be["layers"][0]["op"] == "conv2d" and be["layers"][0]["fused_ops"][-1]["op"] == "max_pool2d"
    assert [(layer["name"], layer["op"]) for layer in kit["parsed"]["layers"]] == \
        [(layer["name"], layer["op"]) for layer in be["layers"]]


@pytest.mark.slow  # the kit fixture builds a fresh venv
def test_generated_plugins_pass_their_own_tests_in_the_venv(kit):
    tests = [str(p / "tests") for p in kit["projects"].values()]
    r = subprocess.run([str(kit["py"]), "-m", "pytest", "-q", "-p", "no:cacheprovider", "--import-mode=importlib",
                        "--basetemp", str(kit["dir"] / "pytest"), *tests], capture_output=True, text=True, cwd=kit["dir"], timeout=900)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert re.search(r"\b18 passed\b", r.stdout) and "failed" not in r.stdout and "skipped" not in r.stdout, r.stdout
