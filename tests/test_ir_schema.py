"""The JSON Schema of ``ir.json`` (``irgen/schemas/ir.schema.json``, :mod:`irgen.schema`).

irgen's own output validates against it for a float ONNX model, an ONNX QDQ
model, a TFLite int8 model and a ``.pt2`` program; ``irgen verify`` and
``irgen inspect`` refuse an ``ir.json`` that violates it (exit 2, naming the
JSON path of each violation); ``irgen schema`` prints it; ``ir_version`` is
semver and the old integer 1 still reads; and the conftest check fails a test
that leaves an invalid ``ir.json`` in its ``tmp_path``.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from irgen.cli import main
from irgen.ir import IR_VERSION
from irgen.pipeline import run
from irgen.plugins import PluginHost
from irgen.schema import check_ir, ir_version, schema, validate_ir

TESTS = Path(__file__).parent
EXAMPLE = TESTS.parent / "examples" / "tiny_cnn.onnx"


@pytest.fixture(scope="module")
def host():
    return PluginHost().load()


@pytest.fixture(scope="module")
def float_out(tmp_path_factory, host) -> Path:
    out = tmp_path_factory.mktemp("schema_float") / "out"
    run(host, EXAMPLE, out)
    return out


def _ir(out: Path) -> dict:
    return json.loads((out / "ir.json").read_text())


def _assert_valid(out: Path) -> dict:
    ir = _ir(out)
    assert validate_ir(ir) == []
    assert ir["ir_version"] == IR_VERSION == "2.8.0"
    return ir


# ------------------------------------------------------------------ irgen's own output validates


def test_float_onnx_output_validates(float_out):
    ir = _assert_valid(float_out)
    assert [layer["quant"] for layer in ir["layers"]] == [None] * len(ir["layers"])


def test_qdq_output_validates(tmp_path, host):
    pytest.importorskip("onnxruntime")
    from test_qdq import quantized

    path = quantized("small_cnn", True, "s8", tmp_path)
    out = tmp_path / "out"
    run(host, path, out)
    ir = _assert_valid(out)
    schemes = {(layer["quant"] or {}).get("scheme") for layer in ir["layers"]}
    assert "qdq" in schemes and ir["producer"]["quantizer"] == "qdq"


def test_tflite_int8_output_validates(tmp_path, host):
    pytest.importorskip("tensorflow")
    import tflite_models

    path, _ = tflite_models.export("small_cnn", tmp_path, "int8")
    out = tmp_path / "out"
    run(host, path, out)
    ir = _assert_valid(out)
    assert ir["producer"]["quantizer"] == "tflite-int8"
    assert all(layer["quant"]["scheme"] == "tflite-int8" for layer in ir["layers"] if layer["quant"])


def test_pt2_output_validates(tmp_path):
    torch = pytest.importorskip("torch")
    import models

    cls, shape = models.BUILDERS["small_cnn"]
    torch.manual_seed(0)
    model = cls().eval()
    x = torch.randn(*shape)
    path = tmp_path / "m.pt2"
    torch.export.save(torch.export.export(model, (x,)), str(path))
    out = tmp_path / "out"
    assert main(["run", str(path), "-o", str(out), "--no-progress"]) == 0
    ir = _assert_valid(out)
    assert ir["producer"]["frontend"] == "torch"


# ------------------------------------------------------------------ an invalid ir.json is refused


def _corrupt(float_out: Path, tmp_path: Path, edit) -> Path:
    out = tmp_path / "bad"
    shutil.copytree(float_out, out)
    ir = _ir(out)
    edit(ir)
    (out / "ir.json").write_text(json.dumps(ir))
    manifest = json.loads((out / "manifest.json").read_text())  # as if irgen had written it
    for entry in manifest["files"]:
        if entry["path"] == "ir.json":
            data = (out / "ir.json").read_bytes()
            entry["size"], entry["sha256"] = len(data), hashlib.sha256(data).hexdigest()
    (out / "manifest.json").write_text(json.dumps(manifest))
    return out


CORRUPTIONS = {
    # (what is changed, what the error names)
    "missing_key": (lambda ir: ir["layers"][2].pop("source"),
                    "layers[2]: 'source' is a required property"),
    "wrong_type": (lambda ir: ir["producer"].update(opt_level="3"),
                   "producer.opt_level: '3' is not of type 'integer'"),
    "bad_arg": (lambda ir: ir["layers"][0]["fused_ops"][1]["args"].__setitem__(0, "op 0"),
                "layers[0].fused_ops[1].args[0]: 'op 0' does not match"),
    "quant_without_kind": (lambda ir: ir["layers"][1].update(quant={"scheme": "int8"}),
                           "layers[1].quant: 'kind' is a required property"),
    "unknown_layer_key": (lambda ir: ir["layers"][3].update(weights=[1, 2]),
                          "layers[3]: Additional properties are not allowed ('weights' was unexpected)"),
}


@pytest.mark.corrupts_ir
@pytest.mark.parametrize("what", sorted(CORRUPTIONS))
@pytest.mark.parametrize("command", ["verify", "inspect"])
def test_invalid_ir_is_refused(float_out, tmp_path, capsys, what, command):
    edit, needle = CORRUPTIONS[what]
    out = _corrupt(float_out, tmp_path, edit)
    argv = [command, str(out)] + (["--no-report", "--no-progress", "--mode", "single"] if command == "verify" else [])
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"irgen: error: {out / 'ir.json'}: not a valid irgen IR (1 violation of its schema"), err
    assert needle in err, err
    assert len(err.strip().splitlines()) == 1


@pytest.mark.corrupts_ir
def test_many_violations_name_ten(float_out, tmp_path, capsys):
    def edit(ir):
        for layer in ir["layers"]:
            layer["results"] = ["result 0"]
            layer["op"] = ""

    out = _corrupt(float_out, tmp_path, edit)
    n = len(_ir(out)["layers"])
    problems = validate_ir(_ir(out))
    assert problems == [p for i in range(n) for p in (f"layers[{i}].op: '' should be non-empty",
                                                     f"layers[{i}].results[0]: 'result 0' does not match "
                                                     f"'^op:(0|[1-9][0-9]*)(\\\\.(0|[1-9][0-9]*))?$'")]
    assert main(["verify", str(out), "--no-report", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert f"({2 * n} violations of its schema" in err and f"; and {2 * n - 10} more" in err
    assert err.count("should be non-empty") == 5 and err.count("does not match") == 5
    assert "layers[4].results" in err and "layers[5]" not in err


# ------------------------------------------------------------------ ir_version


def test_ir_version_is_semver_and_the_old_integer_reads(float_out):
    ir = _ir(float_out)
    assert ir_version(ir) == "2.8.0"
    assert validate_ir({**ir, "ir_version": 1}) == []
    assert ir_version({**ir, "ir_version": 1}) == "1.0.0"
    assert validate_ir({**ir, "ir_version": "1.0.3"}) == [] == validate_ir({**ir, "ir_version": "1.1.2"})
    assert validate_ir({**ir, "ir_version": "2.0.7"}) == [] == validate_ir({**ir, "ir_version": "2.1.3"}) == validate_ir({**ir, "ir_version": "2.2.1"}) == validate_ir({**ir, "ir_version": "2.3.2"}) == validate_ir({**ir, "ir_version": "2.4.1"}) == validate_ir({**ir, "ir_version": "2.5.2"}) == validate_ir({**ir, "ir_version": "2.6.1"}) == validate_ir({**ir, "ir_version": "2.7.3"}) == validate_ir({**ir, "ir_version": "2.8.1"})
    for bad in ("3.0.0", "2.9.0", "1.2.0", "0.9.0"):
        problems = validate_ir({**ir, "ir_version": bad})
        assert len(problems) == 1 and problems[0].startswith(f"ir_version: '{bad}' is not readable by this irgen"), problems
    for bad in (True, 2, "1.0", "v1.0.0", None):
        problems = validate_ir({**ir, "ir_version": bad})
        assert problems and all(p.startswith("ir_version: ") for p in problems), (bad, problems)
    missing = dict(ir)
    del missing["ir_version"]
    assert validate_ir(missing) == ["'ir_version' is a required property"]


def test_an_old_integer_version_folder_verifies(float_out, tmp_path, capsys):
    out = _corrupt(float_out, tmp_path, lambda ir: ir.update(ir_version=1))
    assert main(["verify", str(out), "--no-report", "--no-progress", "--mode", "single"]) == 0
    capsys.readouterr()
    assert main(["inspect", str(out), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["ir_version"] == "1.0.0"
    assert main(["inspect", str(float_out)]) == 0
    assert "; IR 2.8.0, irgen " in capsys.readouterr().out.splitlines()[0]


# ------------------------------------------------------------------ irgen schema


def test_irgen_schema_prints_the_schema(capsys):
    from jsonschema import Draft202012Validator

    assert main(["schema"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed == schema()
    Draft202012Validator.check_schema(printed)
    assert printed["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    assert printed["required"] == ["ir_version", "producer", "model", "inputs", "outputs", "layers"]
    assert printed["$id"] == f"urn:irgen:ir-schema:{IR_VERSION}"  # a new IR version comes with its schema


def test_check_ir_returns_a_valid_document(float_out):
    ir = _ir(float_out)
    assert check_ir(ir, "x") is ir


# ------------------------------------------------------------------ the conftest check


def test_conftest_fails_a_test_that_leaves_an_invalid_ir(tmp_path_factory, float_out):
    """A test session with tests/conftest.py: a test leaving an invalid ir.json in its
    tmp_path (asked for directly or through a fixture) fails naming the file and the
    violation; the same test marked ``corrupts_ir`` passes."""
    root = tmp_path_factory.mktemp("inner")
    shutil.copy(TESTS / "conftest.py", root / "conftest.py")
    good = json.dumps(_ir(float_out))
    bad = _ir(float_out)
    del bad["layers"][0]["op"]
    (root / "test_inner.py").write_text(f"""
import json, pytest
GOOD = {good!r}
BAD = {json.dumps(bad)!r}

def test_leaves_valid(tmp_path):
    (tmp_path / "a" / "b").mkdir(parents=True)
    (tmp_path / "a" / "b" / "ir.json").write_text(GOOD)

def test_leaves_invalid(tmp_path):
    (tmp_path / "o").mkdir()
    (tmp_path / "o" / "ir.json").write_text(BAD)

@pytest.mark.corrupts_ir
def test_leaves_invalid_marked(tmp_path):
    (tmp_path / "ir.json").write_text(BAD)

@pytest.fixture
def folder(tmp_path):
    return tmp_path

def test_leaves_invalid_through_a_fixture(folder):
    (folder / "ir.json").write_text(BAD)
""")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--basetemp",
                           str(root / "tmp"), "-o", "addopts=", "test_inner.py"],
                          cwd=root, capture_output=True, text=True, timeout=600)
    assert "2 failed, 2 passed" in proc.stdout, proc.stdout + proc.stderr
    assert "FAILED test_inner.py::test_leaves_invalid - " in proc.stdout, proc.stdout
    assert "FAILED test_inner.py::test_leaves_invalid_through_a_fixture - " in proc.stdout, proc.stdout
    assert "test_leaves_invalid0/o/ir.json" in proc.stdout, proc.stdout
    assert "layers[0]: 'op' is a required property" in proc.stdout, proc.stdout



def test_a_non_finite_literal_is_written_as_a_string(tmp_path):
    """A clamp with a lower bound only (torch.clamp(x, min=...), Swin V2) is a clip whose upper
    bound is +inf, a literal JSON cannot hold (irgen stopped with an internal error): ir.json
    says ``"inf"``, the file stays valid, verify recomputes the layer from it and the output
    equals torch's."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("irgen_torch")

    class Net(torch.nn.Module):
        def forward(self, x):
            return torch.clamp(x * 2.0, min=-0.5)

    x = torch.linspace(-1, 1e30, 8).reshape(1, 8)
    path = tmp_path / "clamp.pt2"
    torch.export.save(torch.export.export(Net(), (x,)), str(path))
    np.save(tmp_path / "x.npy", x.numpy())
    out = tmp_path / "out"
    assert main(["run", str(path), "-o", str(out), "--input", str(tmp_path / "x.npy"), "--no-progress"]) == 0
    text = (out / "ir.json").read_text()
    assert '"inf"' in text and "Infinity" not in text
    ir = _assert_valid(out)
    np.testing.assert_array_equal(np.load(out / ir["outputs"][0]["file"]), Net()(x).numpy())
    assert main(["verify", str(out), "--no-progress", "--no-report"]) == 0
