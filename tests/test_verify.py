"""``irgen verify``: the numpy self-check, the source-runtime check, tampering, the CLI.

Every output folder the test session writes is also verified in ``single`` and
``entire`` modes by the hook in ``conftest.py``; here each frontend's source
runtime is compared too, tampered copies must fail naming the layer, and the
command line's table, JSON, thresholds and exit codes are checked.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from irgen.cli import main as irgen_main  # noqa: E402
from irgen.verify import MODES, Thresholds, compare, verify_output  # noqa: E402

METRIC_KEYS = {"status", "tensor", "elements", "exact_share", "max_abs", "max_rel", "max_lsb", "cosine", "sqnr_db", "message"}


def _run(*args) -> None:
    assert irgen_main(["run", *map(str, args), "--no-progress"]) == 0


def _verify(capsys, out: Path, *args) -> tuple[int, str, str]:
    capsys.readouterr()  # what came before (TensorFlow prints while converting)
    code = irgen_main(["verify", str(out), "--no-progress", "--no-report", *map(str, args)])
    cap = capsys.readouterr()
    return code, cap.out, cap.err


def _verify_json(capsys, out: Path, *args) -> tuple[int, dict]:
    code, stdout, err = _verify(capsys, out, "--json", *args)
    return code, json.loads(stdout)


def _verify_all(capsys, out: Path, integer_exact: bool) -> tuple[dict, dict]:
    """``irgen verify OUT --json`` passes and every layer was compared with the source
    runtime; returns (result, ir)."""
    ir = json.loads((out / "ir.json").read_text())
    code, result = _verify_json(capsys, out)
    assert code == 0, result["problems"]
    assert _assert_source_checked(result, ir, integer_exact) == len(ir["layers"])
    return result, ir


def _assert_source_checked(result: dict, ir: dict, integer_exact: bool) -> int:
    """Every layer output with a source tensor was compared with the runtime and passed."""
    assert result["passed"], [p for p in result["problems"]]
    assert result["modes"] == list(MODES)
    compared = 0
    for row, layer in zip(result["layers"], ir["layers"], strict=True):
        m = row["checks"]["source"]
        assert m is not None, row["name"]
        assert m["status"] == "pass", (row["name"], m)
        assert m["elements"] == int(np.prod(layer["outputs"][0]["shape"]))
        if integer_exact and row["integer"]:
            assert m["max_lsb"] == 0 and m["exact_share"] == 1.0 and m["exact"], (row["name"], m)
        compared += 1
    return compared


# ------------------------------------------------------------------ one model per frontend


def _generated(tmp_path_factory, name: str, export) -> tuple[Path, Path]:
    """``export(folder) -> (model path, input)``, then ``irgen run`` on it: (model, OUT)."""
    d = tmp_path_factory.mktemp(name)
    path, x = export(d)
    np.save(d / "x.npy", x)
    _run(path, "-o", d / "out", "--input", d / "x.npy")
    return path, d / "out"


@pytest.fixture(scope="module")
def onnx_float(tmp_path_factory):
    import models

    return _generated(tmp_path_factory, "verify_onnx", lambda d: models.export("small_cnn", d))


def test_onnx_float_all_modes(onnx_float, capsys):
    path, out = onnx_float
    result, ir = _verify_all(capsys, out, integer_exact=False)
    assert len(ir["layers"]) >= 8
    for row in result["layers"]:
        for mode in MODES:
            m = row["checks"][mode]
            assert set(m) >= METRIC_KEYS, set(METRIC_KEYS) - set(m)
            assert m["cosine"] > 0.999999 and (m["exact"] or m["sqnr_db"] > 90), (row["name"], mode, m)
            assert m["max_abs"] < 1e-4, (row["name"], mode, m)
    assert result["model"]["path"] == str(path)


def test_json_matches_the_schema(onnx_float, capsys):
    _, out = onnx_float
    ir = json.loads((out / "ir.json").read_text())
    code, r = _verify_json(capsys, out, "--mode", "single", "--mode", "entire")
    assert code == 0
    assert r["irgen_verify"] == 1 and r["out"] == str(out.resolve()) and r["modes"] == ["single", "entire"]
    assert r["producer"] == ir["producer"] and r["model"]["sha256"] == ir["model"]["sha256"]
    assert r["thresholds"] == {"max_lsb": 1, "max_ulp": 4, "atol": 1e-5, "rtol": 1e-4, "min_cosine": None}
    assert r["passed"] is True and r["problems"] == []
    s = r["summary"]
    assert s["layers"] == len(ir["layers"]) == s["passed"] and s["failed"] == s["unsupported"] == 0 and s["seconds"] > 0
    assert [row["name"] for row in r["layers"]] == [layer["name"] for layer in ir["layers"]]
    for row, layer in zip(r["layers"], ir["layers"]):
        assert row["op"] == layer["op"] and row["dtype"] == layer["outputs"][0]["dtype"] and row["integer"] is False
        assert row["scheme"] is None and row["status"] == "pass"
        assert row["inputs"] == [i["producer"] for i in layer["inputs"]]
        assert row["checks"]["source"] is None
        assert row["checks"]["single"]["tensor"] == layer["outputs"][0]["name"]
    assert 1 <= len(r["histograms"]) <= 6
    for name, h in r["histograms"].items():
        assert h["check"] in ("single", "entire")
        assert len(h["edges"]) == len(h["golden"]) + 1 == len(h["reference"]) + 1
        layer = next(l for l in ir["layers"] if l["name"] == name)
        assert sum(h["golden"]) == sum(h["reference"]) == int(np.prod(layer["outputs"][0]["shape"]))


def test_table_worst_layer_first(onnx_float, capsys):
    _, out = onnx_float
    code, stdout, _ = _verify(capsys, out, "--mode", "single")
    assert code == 0
    lines = stdout.splitlines()
    assert lines[0].split()[:4] == ["LAYER", "OP", "DTYPE", "CHECK"]
    assert lines[-1].startswith("PASS: ") and "0 failed" in lines[-1]
    shares = [float(line.split()[4]) for line in lines[1:-1]]
    assert shares == sorted(shares) and shares[0] < 100.0  # lowest exact share first


def test_thresholds_fail_with_exit_1(onnx_float, capsys):
    _, out = onnx_float
    code, stdout, _ = _verify(capsys, out, "--mode", "entire", "--atol", "0", "--rtol", "0")
    assert code == 1
    assert stdout.splitlines()[-1].startswith("FAIL: ")
    assert "FAIL" in stdout.splitlines()[1]  # a failing layer heads the table
    code, r = _verify_json(capsys, out, "--mode", "single", "--min-cosine", "1.5")
    assert code == 1 and not r["passed"]
    assert {p["check"] for p in r["problems"]} == {"single"} and all(p["layer"] for p in r["problems"])
    assert all("cosine" in p["message"] for p in r["problems"])


def test_moved_model_and_usage_errors(onnx_float, tmp_path, capsys):
    path, out = onnx_float
    copy = tmp_path / "out"
    shutil.copytree(out, copy)
    moved = tmp_path / "elsewhere.onnx"
    shutil.copy(path, moved)
    code, r = _verify_json(capsys, copy, "--mode", "source", "--model", moved)
    assert code == 0 and r["model"]["path"] == str(moved) and r["modes"] == ["source"]
    # another model than the one OUT came from
    import onnx

    other = tmp_path / "other.onnx"
    m = onnx.load(str(path))
    m.doc_string = "not the model OUT came from"
    onnx.save(m, str(other))
    code, r = _verify_json(capsys, copy, "--mode", "source", "--model", other)
    assert code == 1 and any("sha256 differs" in p["message"] for p in r["problems"])
    for args, needle in ((["--mode", "source", "--model", tmp_path / "nope.onnx"], "nope.onnx"),):
        code, stdout, err = _verify(capsys, copy, *args)
        assert code == 2 and err.startswith("irgen: error:") and needle in err and len(err.splitlines()) == 1
    code, _, err = _verify(capsys, tmp_path / "missing")
    assert code == 2 and err.startswith("irgen: error:") and "no ir.json" in err
    from irgen.api import IrgenError

    with pytest.raises(IrgenError, match="unknown verify mode.*nope"):
        verify_output(copy, modes=("single", "nope"))


def test_run_with_verify(tmp_path, capsys):
    example = Path(__file__).parents[1] / "examples" / "tiny_cnn.onnx"
    out = tmp_path / "out"
    code = irgen_main(["run", str(example), "-o", str(out), "--verify", "--no-progress"])
    stdout = capsys.readouterr().out
    assert code == 0, stdout
    assert stdout.splitlines()[-1].startswith("PASS: 10 layers, 10 passed") and "single, entire, source" in stdout
    # a threshold nothing float can meet: the output is kept, exit 1
    code = irgen_main(["run", str(example), "-o", str(out), "--force", "--verify", "--no-progress", "--atol", "0", "--rtol", "0"])
    cap = capsys.readouterr()
    assert code == 1 and "verification of" in cap.err and "failed (the output is kept)" in cap.err
    assert (out / "ir.json").is_file()


def test_report_written_next_to_out(onnx_float, tmp_path, capsys):
    pytest.importorskip("irgen.report")
    _, out = onnx_float
    copy = tmp_path / "out"
    shutil.copytree(out, copy)
    code = irgen_main(["verify", str(copy), "--no-progress", "--mode", "single"])
    capsys.readouterr()
    assert code == 0
    report = tmp_path / "out.report.html"
    assert report.is_file() and report.stat().st_size > 1000
    assert sorted(p.name for p in copy.iterdir()) == sorted(p.name for p in out.iterdir())  # OUT untouched


@pytest.fixture(scope="module")
def qdq(tmp_path_factory):
    from test_qdq import quantized

    d = tmp_path_factory.mktemp("verify_qdq")
    path = quantized("small_cnn", True, "s8", d)
    _run(path, "-o", d / "out")
    return path, d / "out"


def test_onnx_qdq_source(qdq, capsys):
    _, out = qdq
    r, ir = _verify_all(capsys, out, integer_exact=False)
    assert ir["producer"]["quantizer"] == "qdq"
    integer = [row for row in r["layers"] if row["integer"]]
    assert len(integer) >= 5 and all(row["scheme"] == "qdq" for row in integer)
    for row in integer:
        for mode in ("single", "entire"):
            assert row["checks"][mode]["max_lsb"] == 0 and row["checks"][mode]["exact"], (row["name"], mode)
        assert row["checks"]["source"]["max_lsb"] <= 1
    # each integer layer also recomputed from ORT's own input tensors (the first one's input is the float x)
    local = [row["checks"]["source"]["local"] for row in integer[1:]]
    assert all(l is not None and l["max_lsb"] <= 1 for l in local), local


@pytest.fixture(scope="module")
def tflite_int8(tmp_path_factory):
    import tflite_models

    return _generated(tmp_path_factory, "verify_tflite", lambda d: tflite_models.export("small_cnn", d, "int8"))


def test_tflite_int8_source_is_exact(tflite_int8, capsys):
    _, out = tflite_int8
    r, _ = _verify_all(capsys, out, integer_exact=True)
    assert all(row["integer"] and row["scheme"] == "tflite-int8" for row in r["layers"])


def _tampered(src: Path, dst: Path) -> tuple[Path, dict]:
    shutil.copytree(src, dst)
    return dst, json.loads((dst / "ir.json").read_text())


def _flip(path: Path, index: int = 0) -> None:
    a = np.load(path)
    flat = a.reshape(-1)
    flat[index] = flat[index] + 1 if flat[index] < np.iinfo(a.dtype).max else flat[index] - 1
    np.save(path, a)


def test_tampering_is_caught(tflite_int8, tmp_path, capsys):
    _, out = tflite_int8
    ir = json.loads((out / "ir.json").read_text())
    convs = [l for l in ir["layers"] if l["op"] == "conv2d" and "bias" in l["params"]]
    victim = convs[1]  # not the first layer: its input is produced by another layer

    # one value in an activation file: the producer no longer reproduces it
    copy, _ = _tampered(out, tmp_path / "act")
    _flip(copy / victim["outputs"][0]["file"], 5)
    code, stdout, _ = _verify(capsys, copy)
    assert code == 1
    failing = [line for line in stdout.splitlines() if line.endswith("FAIL")]
    assert failing and all(line.startswith(victim["name"]) for line in failing), stdout
    assert f"(layer {victim['name']}) changed after generation" in stdout

    # one value in a weight file
    copy, _ = _tampered(out, tmp_path / "weight")
    _flip(copy / victim["params"]["weight"]["file"], 3)
    code, r = _verify_json(capsys, copy, "--mode", "single")
    assert code == 1 and not r["passed"]
    bad = {p["layer"] for p in r["problems"]}
    assert bad == {victim["name"]}, r["problems"]
    assert any(p["check"] == "single" for p in r["problems"]) and any(p["check"] == "manifest" for p in r["problems"])

    # one scale in ir.json: a weight scale (the multipliers no longer follow from it) ...
    copy, ir2 = _tampered(out, tmp_path / "scale")
    layer = next(l for l in ir2["layers"] if l["name"] == victim["name"])
    layer["quant"]["weight"]["scale"][2] *= 1.02
    (copy / "ir.json").write_text(json.dumps(ir2))
    code, r = _verify_json(capsys, copy, "--mode", "single", "--mode", "entire")
    assert code == 1
    assert {p["layer"] for p in r["problems"] if p["check"] == "single"} == {victim["name"]}
    assert any(p["check"] == "manifest" and "ir.json" in p["message"] for p in r["problems"])
    row = next(row for row in r["layers"] if row["name"] == victim["name"])
    assert row["status"] == "fail" and "channel(s) [2]" in row["checks"]["single"]["message"]
    # ... and a requantization multiplier: the recomputed integers differ
    copy, ir2 = _tampered(out, tmp_path / "multiplier")
    layer = next(l for l in ir2["layers"] if l["name"] == victim["name"])
    layer["quant"]["requant"]["multiplier"] = [int(m * 1.05) for m in layer["quant"]["requant"]["multiplier"]]
    (copy / "ir.json").write_text(json.dumps(ir2))
    code, r = _verify_json(capsys, copy, "--mode", "single")
    assert code == 1
    row = next(row for row in r["layers"] if row["name"] == victim["name"])
    assert row["status"] == "fail" and 0 < row["checks"]["single"]["exact_share"] < 1
    assert [row["name"] for row in r["layers"] if row["status"] == "fail"] == [victim["name"]]


def test_tampered_qdq_scale(qdq, tmp_path, capsys):
    _, out = qdq
    copy, ir = _tampered(out, tmp_path / "scale")
    layer = next(l for l in ir["layers"] if (l["quant"] or {}).get("kind") == "conv2d")
    layer["quant"]["requant"]["scale"][0] *= 1.05
    (copy / "ir.json").write_text(json.dumps(ir))
    code, stdout, _ = _verify(capsys, copy, "--mode", "single")
    assert code == 1
    assert f"{layer['name']} [single]: " in stdout


@pytest.fixture(scope="module")
def keras_float(tmp_path_factory):
    import tflite_models

    tf = tflite_models._tf()
    tf.keras.utils.set_random_seed(tflite_models.SEED)
    model, shape = tflite_models.BUILDERS["small_cnn"](tf)
    tflite_models._randomize(model, np.random.default_rng(tflite_models.SEED))
    d = tmp_path_factory.mktemp("verify_keras")
    model.save(d / "m.keras")
    _run(d / "m.keras", "-o", d / "out")
    return d / "m.keras", d / "out"


def test_keras_source(keras_float, capsys):
    _, out = keras_float
    r, _ = _verify_all(capsys, out, integer_exact=False)
    assert {row["dtype"] for row in r["layers"]} == {"float32"}


def test_keras_int8_source_uses_recorded_calibration(tmp_path, capsys):
    import tflite_models

    model, shape = tflite_models.build("mlp")
    model.save(tmp_path / "m.keras")
    calib = tmp_path / "calib"
    calib.mkdir()
    for k in range(4):
        np.save(calib / f"{k}.npy", np.random.default_rng(k).standard_normal(shape[1:]).astype(np.float32))
    _run(tmp_path / "m.keras", "-o", tmp_path / "out", "--calibration", calib)
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["frontend_options"] == {"calibration": str(calib.resolve())}
    r, _ = _verify_all(capsys, tmp_path / "out", integer_exact=True)
    assert {row["dtype"] for row in r["layers"]} == {"int8"}


@pytest.fixture(scope="module")
def torch_float(tmp_path_factory):
    torch = pytest.importorskip("torch")
    import test_torch_frontend

    def export(d: Path):
        model, x = test_torch_frontend.build("small_cnn")
        torch.export.save(torch.export.export(model, (x,)), str(d / "m.pt2"))
        return d / "m.pt2", x.numpy()

    return _generated(tmp_path_factory, "verify_torch", export)

def test_torch_pt2_source(torch_float, capsys):
    _, out = torch_float
    r, ir = _verify_all(capsys, out, integer_exact=False)
    assert ir["producer"]["frontend"] == "torch" and all(row["checks"]["source"]["source_tensor"] for row in r["layers"])


@pytest.mark.slow  # test_torch_pt2_source runs by default
def test_torch_pth_source_uses_recorded_options(tmp_path, capsys, monkeypatch):
    torch = pytest.importorskip("torch")
    import torch_classes

    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    torch.manual_seed(0)
    torch.save(torch_classes.Net(width=6).state_dict(), tmp_path / "net.pth")
    _run(tmp_path / "net.pth", "-o", tmp_path / "out", "--model-class", "torch_classes:Net",
         "--model-args", '{"width": 6}', "--input-shape", "x=1,3,8,8")
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["frontend_options"] == {"input_shapes": {"x": [1, 3, 8, 8]}, "model_class": "torch_classes:Net",
                                            "model_args": {"width": 6}}
    ir = json.loads((tmp_path / "out" / "ir.json").read_text())
    # importing the recorded --model-class runs code: only with the user's consent
    code, _, err = _verify(capsys, tmp_path / "out", "--mode", "source")
    assert code == 2 and "--model-class 'torch_classes:Net'" in err and "--allow-pickle" in err, err
    code, r = _verify_json(capsys, tmp_path / "out", "--mode", "source", "--allow-pickle")
    assert code == 0, r["problems"]
    assert all(row["checks"]["source"]["status"] == "pass" for row in r["layers"]) and len(r["layers"]) == len(ir["layers"])


# ------------------------------------------------------------------ units


def test_compare_metrics():
    th = Thresholds()
    golden = np.array([0, 10, -20, 127], np.int8)
    m = compare(golden.copy(), golden, integer=True, th=th)
    assert m["status"] == "pass" and m["exact"] and m["exact_share"] == 1.0 and m["max_lsb"] == 0 and m["sqnr_db"] is None
    got = golden.copy()
    got[1] = 12
    m = compare(got, golden, integer=True, th=th, lsb_limit=1)
    assert m["status"] == "fail" and m["max_lsb"] == 2 and m["exact_share"] == 0.75
    assert m["sqnr_db"] == pytest.approx(10 * np.log10((100 + 400 + 127 ** 2) / 4))
    m = compare(got, golden, integer=True, th=th, lsb_limit=2)
    assert m["status"] == "pass"
    f = np.array([1.0, -2.0, 3.0], np.float32)
    m = compare(f + np.float32(1e-3), f, integer=False, th=th)
    assert m["status"] == "fail" and m["max_abs"] == pytest.approx(1e-3, rel=1e-3) and m["max_rel"] == pytest.approx(1e-3 / 3, rel=1e-3)
    big = f * 1000
    m = compare(big + np.float32(0.005), big, integer=False, th=th, scaled=True)  # 0.005 <= 1e-5*3000 + 1e-4*|x|
    assert m["status"] == "pass" and m["cosine"] == pytest.approx(1.0)
    m = compare(f[:2], f, integer=False, th=th)
    assert m["status"] == "fail" and "shape" in m["message"]


def test_unsupported_layer_is_reported_not_skipped(onnx_float, tmp_path):
    _, out = onnx_float
    copy, ir = _tampered(out, tmp_path / "unsup")
    ir["layers"][2]["fused_ops"][0]["relax_op"] = "relax.nn.made_up"
    (copy / "ir.json").write_text(json.dumps(ir))
    r = verify_output(copy, modes=("single", "entire"))
    name = ir["layers"][2]["name"]
    row = next(row for row in r["layers"] if row["name"] == name)
    assert row["status"] == "unsupported" and "relax.nn.made_up" in row["checks"]["single"]["message"]
    assert not r["passed"] and r["summary"]["unsupported"] == 1
    assert any(p["layer"] == name and p["check"] == "single" for p in r["problems"])
    # downstream layers still run in entire mode, from the golden file of the missing input
    nxt = next(row for row in r["layers"] if name in row["inputs"])
    assert nxt["checks"]["entire"]["status"] == "pass" and "from golden files" in nxt["checks"]["entire"]["message"]
    allowed = verify_output(copy, modes=("single",), thresholds=Thresholds(allow_unsupported=True))
    assert allowed["summary"]["unsupported"] == 1 and not [p for p in allowed["problems"] if p["check"] == "single"]


@pytest.mark.slow  # test_torch_pt2_source runs by default
def test_torch_reference_quantized_source(tmp_path, capsys):
    """A torch FX reference-quantized (PTQ) program: integer golden data against torch's
    quantize/dequantize graph, within the default 1 LSB."""
    torch = pytest.importorskip("torch")
    import warnings

    from torch.ao.quantization import QConfig, QConfigMapping
    from torch.ao.quantization.observer import MinMaxObserver, PerChannelMinMaxObserver
    from torch.ao.quantization.quantize_fx import _convert_to_reference_decomposed_fx, prepare_fx

    warnings.simplefilter("ignore")
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU(), torch.nn.Flatten(),
                              torch.nn.Linear(8 * 8 * 8, 4)).eval()
    x = torch.randn(1, 3, 8, 8, generator=torch.Generator().manual_seed(1))
    qconfig = QConfig(activation=MinMaxObserver.with_args(dtype=torch.quint8, quant_min=0, quant_max=255),
                      weight=PerChannelMinMaxObserver.with_args(dtype=torch.qint8, qscheme=torch.per_channel_symmetric))
    prepared = prepare_fx(net, QConfigMapping().set_global(qconfig), (x,))
    with torch.no_grad():
        for k in range(4):
            prepared(torch.randn(1, 3, 8, 8, generator=torch.Generator().manual_seed(10 + k)))
    path = tmp_path / "q.pt2"
    torch.export.save(torch.export.export(_convert_to_reference_decomposed_fx(prepared), (x,)), str(path))
    np.save(tmp_path / "x.npy", x.numpy())
    _run(path, "-o", tmp_path / "out", "--input", tmp_path / "x.npy")
    r, ir = _verify_all(capsys, tmp_path / "out", integer_exact=False)
    assert ir["producer"]["quantizer"] == "qdq"
    integer = [row for row in r["layers"] if row["integer"]]
    assert integer and all(row["checks"]["source"]["max_lsb"] <= 1 for row in integer)
    assert all(row["checks"][m]["exact"] for row in integer for m in ("single", "entire"))


# ------------------------------------------------------------------ a source runtime that crashes

CRASHY = '''
import os

from irgen import hookimpl
from irgen.api import Frontend


def _runner(path, options):
    def run(inputs, tensors):
        os.abort()  # as the TFLite interpreter does on some models

    return run


@hookimpl
def irgen_register_frontends(register):
    register(Frontend(name="crashy", suffixes=(".crashy",), load=lambda path, options: None, runner=_runner))
'''


def _as_frontend(out: Path, copy: Path, frontend: str) -> Path:
    """A copy of output folder ``out`` whose ir.json names ``frontend`` (manifest updated)."""
    import hashlib

    shutil.copytree(out, copy)
    ir = json.loads((copy / "ir.json").read_text())
    ir["producer"]["frontend"] = frontend
    (copy / "ir.json").write_text(json.dumps(ir))
    manifest = json.loads((copy / "manifest.json").read_text())
    for f in manifest["files"]:
        if f["path"] == "ir.json":
            f["sha256"] = hashlib.sha256((copy / "ir.json").read_bytes()).hexdigest()
            f["size"] = (copy / "ir.json").stat().st_size
    (copy / "manifest.json").write_text(json.dumps(manifest))
    return copy


def test_a_crashing_source_runtime_is_reported_not_fatal(onnx_float, tmp_path, capsys, plugin_file):
    """The runtime runs in a child process: its abort becomes a note (default checks)
    or a one-line error (``--mode source``), and irgen itself carries on."""
    copy = _as_frontend(onnx_float[1], tmp_path / "out", "crashy")
    plugin = plugin_file("crashy_runtime", CRASHY)

    capsys.readouterr()
    code = irgen_main(["--plugin", str(plugin), "verify", str(copy), "--no-progress", "--no-report"])
    err = capsys.readouterr().err
    assert code == 0, err
    assert "source check skipped" in err and "crashed (signal SIGABRT)" in err, err

    code = irgen_main(["--plugin", str(plugin), "verify", str(copy), "--mode", "source", "--no-progress", "--no-report"])
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1, lines
    assert lines[0].startswith("irgen: error:") and "SIGABRT" in lines[0] and "crashy" in lines[0], lines


FORGETFUL = '''
from irgen import hookimpl
from irgen.api import Frontend


def _runner(path, options):
    def run(inputs, tensors):
        return {}  # runs, and has none of the tensors the layers name

    return run


@hookimpl
def irgen_register_frontends(register):
    register(Frontend(name="forgetful", suffixes=(".forgetful",), load=lambda path, options: None, runner=_runner))
'''


def test_source_tensors_the_runtime_lacks_are_named_in_a_note(onnx_float, tmp_path, capsys, plugin_file):
    """A source runtime that gives none of the tensors the IR names (torch's run of a QAT graph
    lacked every ``<fake-quant node>_q``): the layers' source check is ``missing`` and the run
    still passes on single and entire, so a note says how many tensors were not there."""
    copy = _as_frontend(onnx_float[1], tmp_path / "out", "forgetful")
    plugin = plugin_file("forgetful_runtime", FORGETFUL)
    ir = json.loads((copy / "ir.json").read_text())
    named = sorted({s for la in ir["layers"] for s in la["source"]["outputs"] if s is not None})
    capsys.readouterr()
    code = irgen_main(["--plugin", str(plugin), "verify", str(copy), "--json", "--no-progress", "--no-report"])
    r = json.loads(capsys.readouterr().out)
    assert code == 0 and r["source"]["ran"]
    assert all(row["checks"]["source"]["status"] == "missing" for row in r["layers"])
    note = [n for n in r["notes"] if n.startswith("source check: ")]
    assert note and f"{len(named)} of {len(named)} tensors the layers name are not in the source runtime" in note[0], r["notes"]


def test_single_scales_its_absolute_tolerance_with_the_magnitude(tmp_path):
    """A convolution of large values: outputs that cancel to near zero are off by float32's
    eps times the terms (up to ~1e-7 of the largest output here), which an absolute 1e-5 in
    ``single`` failed though irgen's kernel is right; scaled by max|golden| (as ``entire``
    and ``source`` are) single passes, and a real error of 1e-3 of the peak still fails."""
    onnx = pytest.importorskip("onnx")
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(7)
    w = numpy_helper.from_array((rng.standard_normal((16, 64, 3, 3)) * 100).astype(np.float32), "w")
    graph = helper.make_graph([helper.make_node("Conv", ["x", "w"], ["y"], pads=[1, 1, 1, 1])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 64, 8, 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 16, 8, 8])], [w])
    path = tmp_path / "big.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]), str(path))
    np.save(tmp_path / "x.npy", (rng.standard_normal((1, 64, 8, 8)) * 100).astype(np.float32))
    out = tmp_path / "out"
    assert irgen_main(["run", str(path), "-o", str(out), "--input", str(tmp_path / "x.npy"), "--no-progress"]) == 0
    result = verify_output(out, modes=["single"])
    assert result["passed"], result["problems"]
    ir = json.loads((out / "ir.json").read_text())
    (layer,) = ir["layers"]
    golden = np.load(out / layer["outputs"][0]["file"])
    from irgen.reference import load_layer_params, run_layer

    (recomputed,) = run_layer(layer, [np.load(out / ir["inputs"][0]["file"])], load_layer_params(out, layer))
    th = Thresholds()
    assert compare(recomputed, golden, integer=False, th=th)["status"] == "fail"  # the former unscaled rule
    assert compare(recomputed, golden, integer=False, th=th, scaled=True)["status"] == "pass"
    wrong = golden.copy()
    wrong.flat[0] += np.float32(1e-3 * np.abs(golden).max())
    assert compare(recomputed, wrong, integer=False, th=th, scaled=True)["status"] == "fail"


def test_a_run_on_golden_bits_reuses_the_checked_result(qdq, monkeypatch):
    """verify's entire and source checks run a layer on inputs equal to its golden files (an exact
    model): the single check's result is reused, and only for the same bits."""
    from irgen import quant
    from irgen.runners import LayerRunner, TensorFiles

    _, out = qdq
    ir = json.loads((out / "ir.json").read_text())
    files = TensorFiles(out, ir, None)
    layer = next(l for l in ir["layers"] if l.get("quant") and l["op"] == "conv2d" and l["inputs"][0].get("producer"))
    golden_in = [files.load(r) for r in layer["inputs"]]
    golden_out = [files.load(r) for r in layer["outputs"]]
    runner = LayerRunner(files)
    outs, note = runner.run(layer, golden_in)
    assert note is None and all(np.array_equal(o, g) for o, g in zip(outs, golden_out))
    calls = []
    real = quant.recompute
    monkeypatch.setattr(quant, "recompute", lambda *a, **k: calls.append(1) or real(*a, **k))
    runner.run(layer, golden_in, check=False)
    assert calls == [1]  # nothing remembered yet: computed
    runner.remember(layer, outs)
    again = runner.run(layer, [g.copy() for g in golden_in], check=False)[0]
    assert calls == [1] and all(np.array_equal(a, g) and a.dtype == g.dtype for a, g in zip(again, golden_out))
    changed = golden_in[0].copy()
    flat = changed.reshape(-1)
    flat[:64] = np.where(flat[:64] < 100, flat[:64] + 20, flat[:64] - 20)
    other = runner.run(layer, [changed, *golden_in[1:]], check=False)[0]
    assert calls == [1, 1]  # other bits: computed again, and the result is not the golden one
    assert not np.array_equal(other[0], golden_out[0])
    # a wrong result is never remembered
    fresh = LayerRunner(files)
    fresh.remember(layer, other)
    fresh.run(layer, golden_in, check=False)
    assert calls == [1, 1, 1]


def test_source_runtime_runs_while_single_and_entire_check(onnx_float, monkeypatch):
    """The source runtime's child process is started before the single check and waited for by
    the source check: it works on its own core meanwhile. The values are the same as a run
    started at the source check (the plain call), and an error it raises is the source check's."""
    import threading

    from irgen import source as source_mod
    from irgen import verify as verify_mod

    _, out = onnx_float
    events = []
    real_single = verify_mod._VerifyRun.single
    monkeypatch.setattr(verify_mod._VerifyRun, "single", lambda self: (events.append("single"), real_single(self))[1])
    real_started = source_mod.started

    def started(run, feeds, wanted):
        events.append("start")
        wait = real_started(run, feeds, wanted)
        return lambda: (events.append(f"wait:{threading.current_thread() is threading.main_thread()}"), wait())[1]

    monkeypatch.setattr(source_mod, "started", started)
    background = verify_output(out)
    assert events == ["start", "single", "wait:True"], events
    assert background["passed"] and background["source"]["ran"]
    monkeypatch.setattr(source_mod, "started", lambda run, feeds, wanted: (_ for _ in ()).throw(AssertionError()))
    plain = verify_output(out, source_runner=lambda feeds, wanted: source_mod.isolated_source_runner(
        out, json.loads((out / "ir.json").read_text()))[0](feeds, wanted))
    for a, b in zip(background["layers"], plain["layers"]):
        assert a["checks"]["source"]["max_abs"] == b["checks"]["source"]["max_abs"], a["name"]
