"""irgen verify on quantized models as users quantize them (issue 10).

* a quantized Concat whose inputs have other scales than its output (SqueezeNet's
  Fire module, GoogLeNet's Inception block; ORT ``quantize_static`` default
  options, and ``per_channel=True``): ``single``, ``entire`` and ``source`` pass;
* the source verdict is per layer (``local``), end-to-end drift is reported beside
  it with the first layer where it appears;
* the TFLite source check falls back to the builtin optimized kernels when the
  reference kernels abort, and says so; a PASS whose source check was skipped says
  so in its verdict line and report.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from irgen.cli import main as irgen_main
from irgen.verify import MODES


def _run(*args) -> None:
    assert irgen_main(["run", *map(str, args), "--no-progress"]) == 0


def _verify_json(capsys, out: Path, *args) -> tuple[int, dict, str]:
    capsys.readouterr()
    code = irgen_main(["verify", str(out), "--no-progress", "--no-report", "--json", *map(str, args)])
    cap = capsys.readouterr()
    return code, json.loads(cap.out), cap.err


def _calibration(shape):
    """quantize_static's calibration data: 8 seeded normal samples of input ``x``."""
    from onnxruntime.quantization import CalibrationDataReader

    class Reader(CalibrationDataReader):
        def __init__(self):
            self.it = iter([{"x": np.random.default_rng(k).standard_normal(shape).astype(np.float32)}
                            for k in range(8)])

        def get_next(self):
            return next(self.it, None)

    return Reader()


# ------------------------------------------------------------------ quantized Concat (ORT QDQ)


def _branches_model(folder: Path, per_channel: bool) -> tuple[Path, Path]:
    """Conv stem, then two blocks whose branches (1x1, 3x3, 5x5 convs + ReLU) are
    concatenated: a Fire module (2 branches) and an Inception-like block (4 branches,
    the widest range in the middle so an input whose scale is the output's comes
    before others that are requantized). Exported to ONNX, quantize_static defaults."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("onnxruntime")
    from torch import nn

    from onnxruntime.quantization import quantize_static

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.stem = nn.Conv2d(3, 16, 3, stride=2, padding=1)
            self.squeeze = nn.Conv2d(16, 8, 1)
            self.e1, self.e3 = nn.Conv2d(8, 8, 1), nn.Conv2d(8, 8, 3, padding=1)
            self.b = nn.ModuleList([nn.Conv2d(16, 4, 1), nn.Conv2d(16, 4, 3, padding=1),
                                    nn.Conv2d(16, 4, 5, padding=2), nn.Conv2d(16, 4, 1)])
            self.head = nn.Conv2d(16, 10, 1)

        def forward(self, x):
            x = torch.relu(self.stem(x))
            s = torch.relu(self.squeeze(x))
            x = torch.cat([torch.relu(self.e1(s)), torch.relu(self.e3(s))], 1)
            x = torch.cat([torch.relu(c(x)) for c in self.b], 1)
            x = nn.functional.max_pool2d(x, 3, 2, ceil_mode=True)
            return torch.flatten(nn.functional.adaptive_avg_pool2d(self.head(x), 1), 1)

    torch.manual_seed(0)
    net = Net().eval()
    with torch.no_grad():
        for p in net.parameters():
            p.normal_(0, 0.3)
    x = torch.randn(1, 3, 24, 24, generator=torch.Generator().manual_seed(1))
    fp = folder / "branches.onnx"
    torch.onnx.export(net, x, str(fp), input_names=["x"], output_names=["y"], dynamo=False, opset_version=17)

    q = folder / f"branches_{'pc' if per_channel else 'pt'}.onnx"
    quantize_static(str(fp), str(q), _calibration((1, 3, 24, 24)), per_channel=per_channel)
    np.save(folder / "x.npy", x.numpy())
    return q, folder / "x.npy"


@pytest.mark.parametrize("per_channel", [False, pytest.param(True, marks=pytest.mark.slow)],
                         ids=["default", "per_channel"])
def test_qdq_concat_of_differently_scaled_inputs(tmp_path, capsys, per_channel):
    model, x = _branches_model(tmp_path, per_channel)
    out = tmp_path / "out"
    _run(model, "-o", out, "--input", x)
    ir = json.loads((out / "ir.json").read_text())
    concats = [l for l in ir["layers"] if (l.get("quant") or {}).get("kind") == "concatenate"]
    assert len(concats) == 2
    # some operand is requantized by a table and some later operand is not: the layer's inputs are not in
    # operand order, and the record says which layer input each operand is
    inc = concats[1]
    tables = inc["quant"]["tables"]
    assert any(t is None for t in tables) and tables[-1] is not None
    assert sorted(inc["quant"]["operands"]) == list(range(len(inc["inputs"])))
    assert inc["quant"]["operands"] != list(range(len(inc["inputs"])))
    code, r, err = _verify_json(capsys, out)
    assert code == 0 and r["passed"], r["problems"]
    assert r["modes"] == list(MODES), err
    for row in r["layers"]:
        if row["integer"]:
            for mode in ("single", "entire"):
                assert row["checks"][mode]["exact"], (row["name"], mode, row["checks"][mode])
            assert row["checks"]["source"]["status"] == "pass", row
    for layer in concats:
        row = next(row for row in r["layers"] if row["name"] == layer["name"])
        assert row["checks"]["source"]["exact"], row  # ORT's QLinearConcat, bit for bit


@pytest.fixture(scope="module")
def branches(tmp_path_factory):
    d = tmp_path_factory.mktemp("verify_branches")
    model, x = _branches_model(d, False)
    _run(model, "-o", d / "out", "--input", x)
    return model, d / "out"


# ------------------------------------------------------------------ the source verdict is per layer; drift beside it


def _drifting_runtime(out: Path, target: str, bump: int = 1):
    """A stand-in source runtime: every layer computed by irgen's own numpy recompute, chained,
    except that one element of ``target``'s output is ``bump`` LSB off (as a near tie rounded
    the other way in another runtime); the layers after it compute from that value."""
    from irgen.irfile import read_ir
    from irgen.verify import _Files, _Layers

    def run(feeds, wanted):
        ir = read_ir(out)
        layers = _Layers(_Files(out, ir, None))
        values = dict(feeds)
        by_source = {}
        for layer in ir["layers"]:
            outs, _ = layers.run(layer, [values[r["name"]] for r in layer["inputs"]])
            if layer["name"] == target:
                o = outs[0].copy()
                flat = o.reshape(-1)
                k = int(np.argmax(flat < np.iinfo(flat.dtype).max - bump))
                flat[k] += bump
                outs = [o, *outs[1:]]
            for rec, src, v in zip(layer["outputs"], layer["source"]["outputs"], outs):
                values[rec["name"]] = v
                by_source[src] = v
        return {name: by_source[name] for name in wanted if name in by_source}

    run.runtime = "a drifting stand-in runtime"
    return run


def test_source_verdict_is_local_and_drift_is_reported_with_its_first_layer(branches):
    from irgen.verify import Thresholds, format_table, verify_output

    _, out = branches
    ir = json.loads((out / "ir.json").read_text())
    convs = [l["name"] for l in ir["layers"] if (l.get("quant") or {}).get("kind") == "conv2d"]
    target = convs[0]
    run = _drifting_runtime(out, target)
    r = verify_output(out, source_runner=run)
    assert r["passed"], format_table(r)
    d = r["source"]["end_to_end"]
    assert r["source"]["ran"] and r["source"]["runtime"] == "a drifting stand-in runtime"
    assert d["first"]["layer"] == target and d["first"]["max_lsb"] == 1 and not d["exact"]
    assert d["layers"] >= 2 and d["max_lsb"] >= 1  # the difference travels down the chain
    rows = {row["name"]: row for row in r["layers"]}
    assert rows[target]["checks"]["source"]["local"]["max_lsb"] == 1  # the layer that differs, by its own arithmetic
    after = [name for name in convs[1:] if not rows[name]["checks"]["source"]["end_to_end"]["exact"]]
    assert after, "the drift reaches a later convolution"
    for name in after:  # each later layer equals the runtime from the runtime's own inputs
        m = rows[name]["checks"]["source"]
        assert m["verdict"] == "local" and m["exact"] and m["status"] == "pass", m
    table = format_table(r)
    assert f"first at layer {target} (1 LSB)" in table and "source: a drifting stand-in runtime" in table
    assert table.splitlines()[-1].startswith("PASS: ")

    # a layer off by more than --max-lsb fails, named; drift alone does not fail the later layers
    r = verify_output(out, source_runner=_drifting_runtime(out, target, bump=3), thresholds=Thresholds(max_lsb=1))
    assert not r["passed"]
    bad = [p for p in r["problems"] if p["check"] == "source"]
    assert [p["layer"] for p in bad] == [target], bad
    assert "from the runtime's own inputs" in bad[0]["message"]
    assert r["source"]["end_to_end"]["first_beyond_max_lsb"]["layer"] == target


def test_skipped_source_check_says_so_in_the_verdict_and_report(branches, tmp_path, capsys):
    import shutil

    from irgen.report import render_report

    model, out = branches
    moved = tmp_path / "elsewhere.onnx"
    shutil.copy(model, moved)
    model.rename(model.with_suffix(".gone"))
    try:
        code, r, err = _verify_json(capsys, out)
        assert code == 0 and r["passed"] and r["modes"] == ["single", "entire"]
        assert r["source"]["ran"] is False and "give its path with --model" in r["source"]["skipped"]
        from irgen.verify import format_table

        last = format_table(r).splitlines()[-1]
        assert last.startswith("PASS (source check skipped: ") and "--model" in last, last
        html = render_report(r)
        assert 'id="source-skipped"' in html and "source check skipped" in html
        code, r, _ = _verify_json(capsys, out, "--model", moved)  # given the model: it runs
        assert code == 0 and r["source"]["ran"] and r["source"]["skipped"] is None
        assert r["source"]["end_to_end"]["exact"], r["source"]["end_to_end"]  # ORT's integer kernels, bit for bit
    finally:
        model.with_suffix(".gone").rename(model)


# ------------------------------------------------------------------ TFLite: reference kernels abort


def _keras_int8(folder: Path, tiny_logits: bool) -> Path:
    """A small Keras model, full-int8 TFLite. ``tiny_logits``: the classifier's weights are
    ~1e-7, so the softmax input scale is ~1e-9, which TFLite's reference softmax cannot
    represent: the reference kernels abort (as on keras.applications MobileNetV2 with
    random weights); the builtin optimized kernels run it."""
    tf = pytest.importorskip("tensorflow")
    L = tf.keras.layers
    tf.keras.utils.set_random_seed(0)
    inp = tf.keras.Input((16, 16, 3))
    x = L.Conv2D(8, 3, padding="same", activation="relu")(inp)
    x = L.GlobalAveragePooling2D()(x)
    init = tf.keras.initializers.RandomUniform(-1e-7, 1e-7, seed=1) if tiny_logits else "glorot_uniform"
    x = L.Dense(10, activation="softmax", kernel_initializer=init)(x)
    conv = tf.lite.TFLiteConverter.from_keras_model(tf.keras.Model(inp, x))
    conv.optimizations = [tf.lite.Optimize.DEFAULT]

    def rep():
        for k in range(4):
            yield [np.random.default_rng(k).standard_normal((1, 16, 16, 3)).astype(np.float32)]

    conv.representative_dataset = rep
    conv.target_spec.supported_ops = [tf.lite.OpsSet.TFLITE_BUILTINS_INT8]
    conv.inference_input_type = conv.inference_output_type = tf.int8
    path = folder / ("tiny_logits.tflite" if tiny_logits else "plain.tflite")
    path.write_bytes(conv.convert())
    np.save(folder / "x.npy", np.random.default_rng(3).integers(-128, 128, (1, 16, 16, 3)).astype(np.int8))
    return path


@pytest.mark.slow  # three verifies, each a crashing and a falling-back TensorFlow child (15-45 s)
def test_tflite_source_check_falls_back_when_the_reference_kernels_abort(tmp_path, capsys):
    model = _keras_int8(tmp_path, tiny_logits=True)
    out = tmp_path / "out"
    _run(model, "-o", out, "--input", tmp_path / "x.npy")
    code, r, err = _verify_json(capsys, out)
    assert code == 0 and r["passed"], r["problems"]
    assert r["modes"] == list(MODES) and r["source"]["ran"], err
    assert r["source"]["runtime"] == ("TFLite interpreter (builtin optimized kernels; "
                                      "reference kernels crashed: signal SIGABRT)")
    for row in r["layers"]:
        m = row["checks"]["source"]
        assert m["status"] == "pass" and m["verdict"] == "local" and m["max_lsb"] <= 1, (row["name"], m)
    softmax = next(row for row in r["layers"] if row["op"] == "softmax")
    assert softmax["checks"]["source"]["exact"], softmax
    capsys.readouterr()
    assert irgen_main(["verify", str(out), "--no-progress", "--no-report"]) == 0
    table = capsys.readouterr().out
    assert "source: TFLite interpreter (builtin optimized kernels; reference kernels crashed: signal SIGABRT)" in table
    html = (tmp_path / "out.report.html")
    assert irgen_main(["verify", str(out), "--no-progress", "--report", str(html)]) == 0
    assert "builtin optimized kernels; reference kernels crashed" in html.read_text()


def test_tflite_source_check_uses_the_reference_kernels_when_they_run(tmp_path, capsys):
    model = _keras_int8(tmp_path, tiny_logits=False)
    out = tmp_path / "out"
    _run(model, "-o", out, "--input", tmp_path / "x.npy")
    code, r, _ = _verify_json(capsys, out)
    assert code == 0 and r["source"]["runtime"] == "TFLite interpreter (reference kernels)"
    # the child timed loading the model into the interpreter and running it
    seconds = r["source"]["seconds"]
    assert set(seconds) == {"load", "run"} and seconds["load"] > 0 and seconds["run"] > 0, seconds
    assert r["source"]["end_to_end"]["exact"] and all(row["checks"]["source"]["exact"] for row in r["layers"])


@pytest.mark.slow
def test_keras_applications_mobilenet_v2_int8_source_check_runs(tmp_path, capsys):
    """keras.applications MobileNetV2 (random weights, 32x32) as full-int8 TFLite: the reference
    kernels abort on it (its softmax input scale is ~1e-8); the check runs on the builtin
    optimized kernels, each layer within 1 LSB of them from their own inputs."""
    tf = pytest.importorskip("tensorflow")
    tf.keras.utils.set_random_seed(0)
    net = tf.keras.applications.MobileNetV2(input_shape=(32, 32, 3), weights=None, classes=10)
    conv = tf.lite.TFLiteConverter.from_keras_model(net)
    conv.optimizations = [tf.lite.Optimize.DEFAULT]

    def rep():
        for k in range(4):
            yield [np.random.default_rng(k).standard_normal((1, 32, 32, 3)).astype(np.float32)]

    conv.representative_dataset = rep
    conv.target_spec.supported_ops = [tf.lite.OpsSet.TFLITE_BUILTINS_INT8]
    conv.inference_input_type = conv.inference_output_type = tf.int8
    model = tmp_path / "mobilenet_v2.tflite"
    model.write_bytes(conv.convert())
    np.save(tmp_path / "x.npy", np.random.default_rng(3).integers(-128, 128, (1, 32, 32, 3)).astype(np.int8))
    _run(model, "-o", tmp_path / "out", "--input", tmp_path / "x.npy")
    code, r, _ = _verify_json(capsys, tmp_path / "out")
    assert code == 0 and r["passed"] and r["source"]["ran"], r["problems"]
    assert "builtin optimized kernels; reference kernels crashed" in r["source"]["runtime"]
    assert all(row["checks"]["source"]["status"] == "pass" and row["checks"]["source"]["max_lsb"] <= 1
               for row in r["layers"])


# ------------------------------------------------------------------ uint8 weights (weight_type=QUInt8)


@pytest.mark.parametrize("per_channel", [False, True], ids=["per_tensor", "per_channel"])
def test_uint8_weights_with_zero_points_equal_ort(tmp_path, capsys, per_channel):
    """``quantize_static(weight_type=QUInt8)``: uint8 weights with non-zero zero points. The
    parameter file holds ``w - zp_w`` (int16), the record says so, and every layer equals
    ORT's QLinearConv bit for bit."""
    from onnxruntime.quantization import QuantType, quantize_static

    _branches_model(tmp_path, False)
    fp = tmp_path / "branches.onnx"

    q = tmp_path / "u8.onnx"
    quantize_static(str(fp), str(q), _calibration((1, 3, 24, 24)), per_channel=per_channel,
                    activation_type=QuantType.QUInt8, weight_type=QuantType.QUInt8)
    out = tmp_path / "out"
    _run(q, "-o", out, "--input", tmp_path / "x.npy")
    ir = json.loads((out / "ir.json").read_text())
    convs = [l for l in ir["layers"] if (l.get("quant") or {}).get("kind") == "conv2d"]
    assert convs
    for layer in convs:
        w = layer["quant"]["weight"]
        assert w["dtype"] == "uint8" and w["zero_point_applied"]
        assert np.any(np.asarray(w["zero_point"]) != 0)
        assert np.load(out / layer["params"]["weight"]["file"]).dtype == np.int16
    code, r, err = _verify_json(capsys, out)
    assert code == 0 and r["passed"], r["problems"]
    assert r["source"]["ran"], err
    for row in r["layers"]:
        assert row["checks"]["source"]["exact"], (row["name"], row["checks"]["source"])


# ------------------------------------------------------------------ a conv bias shared with a quantized Add


def test_conv_whose_bias_the_exporter_shared_with_a_quantized_add(tmp_path, capsys):
    """ConvNeXt's pattern: torch's exporter merges equal initializers, so a Conv's bias becomes
    an Identity of a Linear's bias that quantize_static quantizes as an int8 Add operand. ORT
    has no integer kernel for a Conv with an int8 bias and runs that node unit in float: irgen
    realizes it as a float layer and every layer equals ORT within 1 LSB from ORT's inputs."""
    import onnx
    import torch
    from torch import nn

    from onnxruntime.quantization import quantize_static

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Conv2d(3, 8, 3, padding=1)
            self.fc = nn.Linear(8, 8)  # first: the exporter keeps its bias, the conv's is an Identity of it
            self.down = nn.Conv2d(8, 8, 2, stride=2)

        def forward(self, x):  # the Linear first: its Add quantizes the shared bias as an int8 operand
            x = self.fc(torch.relu(self.a(x)).permute(0, 2, 3, 1)).permute(0, 3, 1, 2)
            return self.down(x)

    torch.manual_seed(0)
    net = Net().eval()
    with torch.no_grad():
        net.down.bias.copy_(torch.linspace(-0.5, 0.5, 8))
        net.fc.bias.copy_(net.down.bias)  # equal values: the exporter keeps one initializer
    x = torch.randn(1, 3, 16, 16, generator=torch.Generator().manual_seed(1))
    fp = tmp_path / "shared.onnx"
    torch.onnx.export(net, (x,), str(fp), input_names=["x"], output_names=["y"], dynamo=False, opset_version=17)
    assert any(n.op_type == "Identity" for n in onnx.load(str(fp)).graph.node), "the exporter shared the bias"

    q = tmp_path / "shared_q.onnx"
    quantize_static(str(fp), str(q), _calibration((1, 3, 16, 16)))
    np.save(tmp_path / "x.npy", x.numpy())
    out = tmp_path / "out"
    _run(q, "-o", out, "--input", tmp_path / "x.npy")
    ir = json.loads((out / "ir.json").read_text())
    floats = [l for l in ir["layers"] if (l.get("quant") or {}).get("realization") == "float"]
    assert any("relax.nn.conv2d" in {op["relax_op"] for op in l["fused_ops"]} for l in floats), \
        [(l["name"], (l.get("quant") or {}).get("kind")) for l in ir["layers"]]
    code, r, err = _verify_json(capsys, out)
    assert code == 0 and r["passed"], r["problems"]
    assert r["source"]["ran"], err
    for row in r["layers"]:
        m = row["checks"]["source"]
        assert m["status"] == "pass" and (m.get("local") or m)["max_lsb"] in (0, 1, None), (row["name"], m)


def test_an_integer_layer_one_lsb_off_the_runtime_fails_with_its_location(tmp_path, monkeypatch):
    """Issue 38: when the source runtime ran the integer kernels the scheme reproduces (the
    runner says ``exact``), a layer recomputed from the runtime's own inputs must equal it to
    the last bit: one element 1 LSB off is a failure naming where, not a pass within 1 LSB."""
    from irgen import runners
    from irgen.testing.models import qdq_onnx
    from irgen.verify import verify_output

    model = qdq_onnx(tmp_path / "q.onnx", seed=3)
    out = tmp_path / "out"
    _run(str(model), "-o", str(out))
    ir = json.loads((out / "ir.json").read_text())
    target = next(layer for layer in ir["layers"] if layer["op"] == "conv2d" and layer["quant"])["name"]
    real = runners.LayerRunner.run

    def one_off(self, layer, inputs, *args, **kwargs):
        outs, note = real(self, layer, inputs, *args, **kwargs)
        if layer["name"] == target and len(inputs) and inputs[0].dtype.kind in "iu" and kwargs.get("_tag") is None:
            first = outs[0].copy()
            flat = first.reshape(-1)
            flat[0] = flat[0] + 1 if flat[0] < np.iinfo(first.dtype).max else flat[0] - 1
            outs = [first, *outs[1:]]
        return outs, note

    monkeypatch.setattr(runners.LayerRunner, "run", one_off)
    r = verify_output(out, modes=("source",))
    row = next(row for row in r["layers"] if row["name"] == target)
    m = row["checks"]["source"]
    assert r["source"]["ran"] and m["status"] == "fail", m
    assert "allowed 0" in m["message"] and "the first at [0, 0, 0, 0]" in m["message"], m["message"]
    others = [row for row in r["layers"] if row["name"] != target and row["checks"]["source"]]
    assert all(row["checks"]["source"]["status"] == "pass" for row in others)
