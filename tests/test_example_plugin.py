"""The third-party plugin example (examples/vendor_plugin, package ``irgen_acme``), as a user installs it.

A fresh virtual environment next to this interpreter's irgen (``--system-site-packages``,
no downloads) gets the example ``pip install``ed from a copy; then, with that
environment's python only:

* ``irgen plugins --json`` lists its scheme ``acme-qdq``, backend ``acme-npu`` and
  serializer ``acme-header``;
* ``irgen run`` on a symmetric int8 ONNX QDQ model with all three, then ``irgen
  verify`` (single, entire and the ONNX Runtime source check) pass; every data file
  is a raw ``.bin`` holding exactly what the generic backend writes as ``.npy`` for
  the same model and input; the C header compiles;
* the plugin's own recompute reproduces every layer it registers;
* an asymmetric model and a float model are refused with the scheme's and the
  backend's reasons;

and the plugin's source imports nothing from irgen but ``irgen.plugin``.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")

from irgen.testing import fresh_venv  # noqa: E402
from irgen.testing import models as testing_models  # noqa: E402
from test_plugin_api import PACKAGES, import_violations  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "vendor_plugin"


# The tests that need this venv are marked slow: building it and running irgen there is
# outside the default suite's time budget; the default suite keeps the import check at the end.
@pytest.fixture(scope="module")
def venv(tmp_path_factory) -> Path:
    """A fresh venv seeing this interpreter's packages, with the example installed from a copy."""
    tmp = tmp_path_factory.mktemp("acme_venv")
    src = tmp / "vendor_plugin"
    shutil.copytree(EXAMPLE, src, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    py = fresh_venv(tmp / "venv", src)
    # the plugin is importable in the venv only, not by the interpreter running the tests
    assert subprocess.run([sys.executable, "-c", "import irgen_acme"], capture_output=True, cwd=tmp).returncode != 0
    return py


def irgen(py: Path, *args: str, cwd: Path, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run([str(py), "-m", "irgen", *args], capture_output=True, text=True, cwd=cwd)
    if check:
        assert r.returncode == 0, f"irgen {' '.join(args)} exited {r.returncode}:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("acme_models")
    return {"float": testing_models.float_onnx(d / "float.onnx"), "x": testing_models.input_npy(d / "x.npy"),
            "sym": testing_models.qdq_onnx(d / "sym_int8.onnx", symmetric=True),
            "asym": testing_models.qdq_onnx(d / "asym_int8.onnx", symmetric=False, weight_symmetric=False)}


@pytest.fixture(scope="module")
def outputs(venv, models, tmp_path_factory) -> dict[str, Path]:
    """The symmetric model through acme-qdq with the acme backend and serializer, and with the generic backend."""
    d = tmp_path_factory.mktemp("acme_out")
    acme, generic = d / "acme", d / "generic"
    common = [str(models["sym"]), "--input", str(models["x"]), "--quantizer", "acme-qdq"]
    irgen(venv, "run", *common, "-o", str(acme), "--backend", "acme-npu", "--serializer", "acme-header", cwd=d)
    irgen(venv, "run", *common, "-o", str(generic), "--backend", "generic", cwd=d)
    return {"acme": acme, "generic": generic, "dir": d}


def _tensor_records(ir: dict):
    yield from ir["inputs"]
    for layer in ir["layers"]:
        yield from layer.get("inputs") or []
        yield from layer["outputs"]
        yield from (layer.get("params") or {}).values()


@pytest.mark.slow  # the venv
def test_the_plugin_lists_its_scheme_backend_and_serializer(venv, tmp_path):
    entries = json.loads(irgen(venv, "plugins", "--json", cwd=tmp_path).stdout)
    acme = [e for e in entries if e.get("dist") == "irgen-acme"]
    assert len(acme) == 1, entries
    assert acme[0]["status"] == "loaded" and acme[0]["error"] is None
    assert acme[0]["registered"] == {"quantizer": ["acme-qdq"], "backend": ["acme-npu"], "serializer": ["acme-header"]}


@pytest.mark.slow  # the venv
def test_run_then_verify_pass_with_the_plugins_scheme_backend_and_serializer(venv, outputs):
    out = outputs["acme"]
    ir = json.loads((out / "ir.json").read_text())
    assert ir["producer"]["quantizer"] == "acme-qdq" and ir["producer"]["backend"] == "acme-npu"
    assert "acme-header" in ir["producer"]["serializers"]
    assert {layer["quant"]["scheme"] for layer in ir["layers"]} == {"acme-qdq"}
    kinds = {layer["quant"]["kind"] for layer in ir["layers"]}
    assert {"conv2d", "dense", "add", "global_avg_pool", "lut", "quantize", "dequantize"} <= kinds
    convs = [layer for layer in ir["layers"] if layer["quant"]["kind"] in ("conv2d", "dense")]
    assert len(convs) == 3
    for layer in convs:  # the scheme's own fixed-point requantization, not ONNX Runtime's float one
        rq = layer["quant"]["requant"]
        assert rq["rounding"] == "single" and len(rq["multiplier"]) == len(rq["shift"]) > 1
        assert all(2**30 <= m < 2**31 for m in rq["multiplier"])

    r = irgen(venv, "verify", str(out), "--json", "--no-report", cwd=outputs["dir"])
    result = json.loads(r.stdout)
    assert result["passed"], json.dumps(result["problems"], indent=1)
    assert result["summary"]["failed"] == 0 and result["summary"]["passed"] == len(ir["layers"]) == 11
    assert result["source"]["ran"] and "onnxruntime" in result["source"]["runtime"]
    assert result["modes"] == ["single", "entire", "source"]
    assert all(layer["checks"]["source"]["status"] == "pass" for layer in result["layers"]
               if "source" in layer["checks"])
    assert sum("source" in layer["checks"] for layer in result["layers"]) >= 9


@pytest.mark.slow  # the venv
def test_the_data_files_are_raw_bin_with_the_generic_backends_values(outputs):
    acme = json.loads((outputs["acme"] / "ir.json").read_text())
    generic = json.loads((outputs["generic"] / "ir.json").read_text())
    assert [layer["name"] for layer in acme["layers"]] == [layer["name"] for layer in generic["layers"]]
    assert [layer["op"] for layer in acme["layers"]] == [layer["op"] for layer in generic["layers"]]
    theirs = {t["name"]: t for t in _tensor_records(generic)}
    seen = 0
    for t in _tensor_records(acme):
        assert t["file"].endswith(".bin"), t
        raw = (outputs["acme"] / t["file"]).read_bytes()
        # the format the backend documents: raw little-endian, C order, no header
        got = np.frombuffer(raw, np.dtype(t["dtype"]).newbyteorder("<")).reshape(t["shape"])
        g = theirs[t["name"]]
        assert g["file"].endswith(".npy")
        want = np.load(outputs["generic"] / g["file"], allow_pickle=False)
        assert got.dtype == want.dtype and got.shape == want.shape and np.array_equal(got, want), t["name"]
        seen += 1
    assert seen >= 30
    assert not list(outputs["acme"].glob("activations/*.npy")) and not list(outputs["acme"].glob("parameters/*.npy"))


@pytest.mark.slow  # the venv
def test_the_header_describes_every_layer_and_compiles(outputs, tmp_path):
    ir = json.loads((outputs["acme"] / "ir.json").read_text())
    header = outputs["acme"] / "acme_layers.h"
    text = header.read_text()
    assert f"#define ACME_N_LAYERS {len(ir['layers'])}" in text
    for layer in ir["layers"]:
        assert f'{{"{layer["name"]}", "{layer["op"]}", {len(layer["inputs"])}u,' in text
        for t in [*layer["inputs"], *layer["outputs"]]:
            assert f'{{"{t["name"]}", "{t["dtype"]}", {len(t["shape"])}u, {{{", ".join(map(str, t["shape"]))}}}' in text
    manifest = json.loads((outputs["acme"] / "manifest.json").read_text())
    assert "acme_layers.h" in {f["path"] for f in manifest["files"]}
    cc = shutil.which("cc")
    if cc is None:
        pytest.skip("no C compiler (cc) on this machine")
    first = ir["layers"][1]
    check = tmp_path / "check.c"
    check.write_text(
        f'#include "{header}"\n'
        f"_Static_assert(sizeof(acme_layers) / sizeof(acme_layers[0]) == {len(ir['layers'])}, \"layer count\");\n"
        f"int conv_rank(void) {{ return (int)acme_layers[1].outputs[0].rank + {first['outputs'][0]['shape'][1]}; }}\n")
    r = subprocess.run([cc, "-std=c11", "-Wall", "-Werror", "-fsyntax-only", str(check)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


RECOMPUTE_SCRIPT = r"""
import json, sys
from pathlib import Path
import numpy as np
from irgen_acme import backend, recompute

out = Path(sys.argv[1])
ir = json.loads((out / "ir.json").read_text())
read = lambda t: backend.read_tensor(out / t["file"], t)
checked = {}
for layer in ir["layers"]:
    fn = recompute.OWN.get(layer["quant"]["kind"])
    if fn is None:
        continue
    got = fn(layer, [read(t) for t in layer["inputs"]], {r: read(t) for r, t in (layer.get("params") or {}).items()})
    want = read(layer["outputs"][0])
    checked[layer["name"]] = [layer["quant"]["kind"], bool(got.dtype == want.dtype and np.array_equal(got, want))]
print(json.dumps(checked))
"""


@pytest.mark.slow  # the venv
def test_the_plugins_recompute_reproduces_each_layer_it_registers(venv, outputs):
    """verify falls back to ``fused_ops`` where a recompute raises: this calls the plugin's own directly."""
    r = subprocess.run([str(venv), "-c", RECOMPUTE_SCRIPT, str(outputs["acme"])], capture_output=True, text=True,
                       cwd=outputs["dir"])
    assert r.returncode == 0, r.stderr
    checked = json.loads(r.stdout)
    assert {kind for kind, _ in checked.values()} >= {"conv2d", "dense", "add", "global_avg_pool", "lut", "quantize",
                                                       "dequantize"}
    assert all(ok for _, ok in checked.values()), checked


@pytest.mark.slow  # the venv
def test_the_scheme_refuses_an_asymmetric_model_and_the_backend_a_float_one(venv, models, tmp_path):
    r = irgen(venv, "run", str(models["asym"]), "-o", str(tmp_path / "a"), "--quantizer", "acme-qdq", cwd=tmp_path,
              check=False)
    assert r.returncode == 2, r.stderr
    assert "acme-qdq: not a symmetric int8 QDQ model" in r.stderr and "is not 0" in r.stderr
    assert "Traceback" not in r.stderr and not (tmp_path / "a" / "ir.json").exists()

    r = irgen(venv, "run", str(models["float"]), "-o", str(tmp_path / "f"), "--backend", "acme-npu", cwd=tmp_path,
              check=False)
    assert r.returncode == 2, r.stderr
    assert "backend 'acme-npu' cannot run 3 layer(s)" in r.stderr
    assert "parameter weight is float32" in r.stderr and "Traceback" not in r.stderr


def test_the_plugin_imports_nothing_from_irgen_but_irgen_plugin():
    files = sorted((EXAMPLE / "irgen_acme").rglob("*.py"))
    assert len(files) >= 5
    bad = []
    for path in files:
        bad += import_violations(path, path.read_text(encoding="utf-8"), set(PACKAGES.values()))
    assert not bad, "\n".join(bad)
    assert any("from irgen.plugin import" in p.read_text() for p in files)
    # the checker flags what it must (so an empty list above means something)
    assert import_violations(EXAMPLE / "x.py", "from irgen.quant import recompute\nimport irgen_generic\n",
                             set(PACKAGES.values())).__len__() == 2
