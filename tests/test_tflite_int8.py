"""tflite-int8: golden data equals TFLite's reference kernels bit for bit.

Each full-integer model built from Keras is run through irgen for 20 seeded
random int8 inputs; every layer's activation file must equal the TFLite
interpreter's tensor (BUILTIN_REF resolver, all tensors preserved), the model
output included. Every layer is also recomputed in numpy from ``quant`` and the
parameter files alone, and from its ``fused_ops`` program.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

import tflite_models
from layercheck import assert_layer_recomputes, assert_layers_equal, run_each
from irgen.pipeline import run
from irgen.plugins import PluginHost

#: seeded inputs per model, at opt levels 3 and 0 in turn: 4 in the default suite; the
#: ``MODEL-20`` cases (slow) run the same models on 20
N_INPUTS = 4
N_INPUTS_SLOW = 20
MODELS = ["small_cnn", "mlp", "classifier"]
#: layer ops (a spatial MEAN is global_avg_pool2d, as ONNX GlobalAveragePool is)
KINDS = {"conv2d", "depthwise_conv2d", "dense", "add", "max_pool2d", "avg_pool2d", "concatenate", "global_avg_pool2d",
         "softmax"}


@pytest.fixture(scope="module")
def host():
    return PluginHost().load()


#: int8_runs by case: a test that picks its model (indirect parametrization) gets the runs
#: already made instead of pytest setting the module fixture up again for it
_INT8_RUNS: dict[str, tuple] = {}


@pytest.fixture(scope="module", params=[*MODELS, *(pytest.param(f"{m}-{N_INPUTS_SLOW}", marks=pytest.mark.slow)
                                                   for m in MODELS)])
def int8_runs(request, tmp_path_factory, host):
    """(model path, [(input, OUT)] for N_INPUTS seeded inputs, or the number the case names)."""
    if request.param not in _INT8_RUNS:
        name, _, n = request.param.partition("-")
        folder = tmp_path_factory.mktemp(f"int8_{request.param}")
        path, _ = tflite_models.export(name, folder, "int8")
        shape = tuple(tflite_models.BUILDERS[name](tflite_models._tf())[1])
        xs = [np.random.default_rng(1000 + k).integers(-128, 128, shape).astype(np.int8)
              for k in range(int(n or N_INPUTS))]
        _INT8_RUNS[request.param] = path, run_each(host, path, folder, xs)
    return _INT8_RUNS[request.param]


def test_every_int8_activation_equals_the_interpreter(int8_runs):
    path, runs = int8_runs
    checked = 0
    for x, out in runs:
        ir = json.loads((out / "ir.json").read_text())
        assert ir["producer"]["quantizer"] == "tflite-int8"
        checked += assert_layers_equal(out, ir, tflite_models.tflite_reference(path, x), path.name, np.int8)
    assert checked >= len(runs) * 3


def test_layers_recompute_from_quant_and_parameters(int8_runs):
    _, runs = int8_runs
    seen = set()
    for _, out in runs[:2]:
        ir = json.loads((out / "ir.json").read_text())
        for layer in ir["layers"]:
            q = layer["quant"]
            assert q is not None and q["scheme"] == "tflite-int8", layer["name"]
            assert_layer_recomputes(out, layer, 0)
            seen.add(layer["op"])
    assert seen <= KINDS | {"reshape", "flatten"}, seen


def test_quant_record_has_what_hardware_needs(int8_runs):
    _, runs = int8_runs
    ir = json.loads((runs[0][1] / "ir.json").read_text())
    convs = [l for l in ir["layers"] if l["op"] in ("conv2d", "depthwise_conv2d", "dense")]
    assert convs
    for layer in convs:
        q = layer["quant"]
        n = layer["outputs"][0]["shape"][-1]
        assert q["weight"]["dtype"] == "int8" and q["inputs"][0]["dtype"] == "int8"
        assert q["output"]["dtype"] == "int8" and isinstance(q["output"]["zero_point"], int)
        assert len(q["requant"]["multiplier"]) == n and len(q["requant"]["shift"]) == n
        assert all(2**30 <= m < 2**31 for m in q["requant"]["multiplier"])
        assert q["requant"]["rounding"] in ("single", "double") and "round" in q["requant"]["rounding_rule"]
        lo, hi = q["clamp"]
        assert -128 <= lo < hi <= 127
        w = np.load(runs[0][1] / layer["params"]["weight"]["file"])
        assert w.dtype == np.int8
        if q["bias"] is not None:
            b = np.load(runs[0][1] / layer["params"]["bias"]["file"])
            assert b.dtype == np.int32 and b.size == n
        if isinstance(q["weight"]["scale"], list):
            assert len(q["weight"]["scale"]) == w.shape[q["weight"]["axis"]] == n


@pytest.mark.parametrize("int8_runs", ["small_cnn"], indirect=True)
def test_small_cnn_covers_every_layer_type(int8_runs):
    path, runs = int8_runs
    ir = json.loads((runs[0][1] / "ir.json").read_text())
    ops = {l["op"] for l in ir["layers"]}
    assert {"conv2d", "depthwise_conv2d", "dense", "add", "max_pool2d", "avg_pool2d", "concatenate",
            "global_avg_pool2d"} <= ops, ops
    clamps = {tuple(l["quant"]["clamp"]) for l in ir["layers"] if l["quant"].get("clamp")}
    assert any(lo > -128 or hi < 127 for lo, hi in clamps), clamps  # relu6 (and relu) narrow the clamp


@pytest.mark.parametrize("int8_runs", ["classifier"], indirect=True)
def test_softmax_table_and_record(int8_runs):
    """The classifier's int8 softmax: its table is a parameter file equal to
    TFLite's expf table for the input scale, and its record says how it rounds."""
    path, runs = int8_runs
    ir = json.loads((runs[0][1] / "ir.json").read_text())
    (layer,) = [l for l in ir["layers"] if l["op"] == "softmax"]
    q = layer["quant"]
    assert q["kind"] == "softmax" and q["output"]["zero_point"] == -128 and q["output"]["scale"] == 1 / 256
    table = np.load(runs[0][1] / layer["params"]["table"]["file"])
    assert table.dtype == np.float32 and table.shape == (256,)
    s = np.float32(q["inputs"][0]["scale"])
    arg = -s * np.arange(256, dtype=np.float32)  # float32, as TFLite computes it
    # expf correctly rounded (glibc's; numpy's own float32 exp is off by an ulp in places)
    np.testing.assert_array_equal(table[255 - np.arange(256)], np.array([math.exp(a) for a in arg], np.float32))
    assert q["requant"]["rounding"] == "half_away_from_zero"
    # the probabilities of each input add up to about one
    for x, out in runs:
        y = np.load(out / ir["outputs"][0]["file"]).astype(np.float64)
        assert abs(((y + 128) / 256).sum() - 1.0) < 0.05


def test_a_float_input_file_is_quantized_with_the_int8_inputs_scale(tmp_path, host):
    """A full-integer model's input is int8; a float ``--input`` file is quantized with that
    input's scale and zero point (ties to even, clipped), as the user would do before calling
    the interpreter, and the run equals a run on the int8 file made that way by hand."""
    import tensorflow as tf

    path, _ = tflite_models.export("small_cnn", tmp_path, "int8")
    detail = tf.lite.Interpreter(model_path=str(path)).get_input_details()[0]
    scale, zp = detail["quantization"]
    x = np.random.default_rng(7).standard_normal(tuple(detail["shape"])).astype(np.float32) * 40 * scale
    x.flat[0] = 10_000.0 * scale  # beyond int8: clipped
    x.flat[1] = (2.5 - zp) * scale  # a tie: to even
    np.save(tmp_path / "xf.npy", x)
    by_hand = np.clip(np.round(x.astype(np.float64) / scale) + zp, -128, 127).astype(np.int8)
    assert by_hand.flat[0] == 127
    np.save(tmp_path / "xq.npy", by_hand)
    run(host, path, tmp_path / "f", inputs=[str(tmp_path / "xf.npy")])
    run(host, path, tmp_path / "q", inputs=[str(tmp_path / "xq.npy")])
    ir = json.loads((tmp_path / "f" / "ir.json").read_text())
    for layer in ir["layers"]:
        for rec in layer["outputs"]:
            a, b = np.load(tmp_path / "f" / rec["file"]), np.load(tmp_path / "q" / rec["file"])
            assert a.dtype == np.int8 and np.array_equal(a, b), rec["name"]


def _tied_input(path, x: np.ndarray) -> np.ndarray:
    """``x`` with exact rounding ties of the model's input QUANTIZE (``v / scale == k + 0.5`` in
    float32) in front and values far beyond int8 at the end."""
    import tensorflow as tf

    it = tf.lite.Interpreter(model_path=str(path))
    q = [d for d in it.get_tensor_details() if d["dtype"] == np.int8 and d["quantization"][0] > 0][0]
    s = np.float32(q["quantization"][0])
    ties = [v for v in (np.float32((k + 0.5) * np.float64(s)) for k in range(-140, 140))
            if v / s == np.float32(np.float64(v / s)) and float(v / s) % 1 == 0.5]
    x = (x * 3).astype(np.float32)
    flat = x.reshape(-1)
    n = min(len(ties), flat.size - 2)
    flat[:n] = ties[:n]
    flat[-2:] = [1000.0, -1000.0]
    return x


@pytest.mark.parametrize("name", ["small_cnn", "classifier"])
def test_a_float_interface_model_equals_the_interpreter_from_quantize_to_dequantize(name, tmp_path, host):
    """The converter's default interface of a full-integer model is float (no
    ``inference_input_type``): a QUANTIZE of the float input first (TFLite's AffineQuantize:
    float32 division, rounded half away from zero, saturated; TVM's quantize rounds ties to
    even) and a DEQUANTIZE of the int8 result last. Every layer equals the reference kernels
    on an input full of rounding ties and of values beyond int8, and recomputes from its
    record."""
    path, x = tflite_models.export(name, tmp_path, "int8-floatio")
    x = _tied_input(path, x)
    np.save(tmp_path / "x.npy", x)
    out = tmp_path / "out"
    run(host, path, out, inputs=[str(tmp_path / "x.npy")])
    ir = json.loads((out / "ir.json").read_text())
    ref = tflite_models.tflite_reference(path, x)
    first, last = ir["layers"][0], ir["layers"][-1]
    assert first["quant"]["kind"] == "quantize" and first["quant"]["requant"]["rounding"] == "half_away_from_zero"
    assert last["quant"]["kind"] == "dequantize"
    for layer in ir["layers"]:
        for rec, src in zip(layer["outputs"], layer["source"]["outputs"], strict=True):
            got = np.load(out / rec["file"])
            assert got.dtype == ref[src].dtype, layer["name"]
            np.testing.assert_array_equal(got, ref[src], err_msg=layer["name"])
        assert_layer_recomputes(out, layer, 0)
    q = np.load(out / first["outputs"][0]["file"]).reshape(-1)
    assert q[-2] == 127 and q[-1] == -128
    out_rec = ir["outputs"][0]
    y = np.load(out / out_rec["file"])
    assert y.dtype == np.float32
    np.testing.assert_array_equal(y, ref[out_rec["name"]])


@pytest.mark.slow  # per-channel int8 runs by default
def test_per_tensor_weights_verify_and_equal_the_interpreter(tmp_path, host, capsys):
    """Weights with one scale per tensor (``_experimental_disable_per_channel``): TFLite still
    computes a multiplier per output channel; the consistency check compares them with the one
    scale (it failed on the shapes), and every layer equals the reference kernels."""
    from irgen.cli import main as irgen_main

    path, x = tflite_models.export("small_cnn", tmp_path, "int8-pertensor")
    np.save(tmp_path / "x.npy", x)
    out = tmp_path / "out"
    run(host, path, out, inputs=[str(tmp_path / "x.npy")])
    ir = json.loads((out / "ir.json").read_text())
    convs = [l for l in ir["layers"] if l["quant"]["kind"] in ("conv2d", "depthwise_conv2d", "dense")]
    assert convs and all(len(np.asarray(l["quant"]["weight"]["scale"]).reshape(-1)) == 1 for l in convs)
    ref = tflite_models.tflite_reference(path, x)
    for layer in ir["layers"]:
        for rec, src in zip(layer["outputs"], layer["source"]["outputs"], strict=True):
            np.testing.assert_array_equal(np.load(out / rec["file"]), ref[src], err_msg=layer["name"])
    capsys.readouterr()
    code = irgen_main(["verify", str(out), "--no-progress", "--no-report", "--json"])
    r = json.loads(capsys.readouterr().out)
    assert code == 0 and r["passed"], r.get("problems")


def test_buffers_stored_after_the_flatbuffer_are_read_as_the_interpreter_reads_them(tmp_path, host, capsys):
    """Every weight's data at an offset after the flatbuffer (``_experimental_use_buffer_offset``,
    the layout ai-edge-quantizer writes): irgen refused "its data lies outside the flatbuffer";
    now every layer equals the reference kernels and verify passes."""
    import tflite

    from irgen.cli import main as irgen_main

    path, x = tflite_models.export("small_cnn", tmp_path, "int8-offset")
    buf = path.read_bytes()
    model = tflite.Model.GetRootAsModel(buf, 0)
    outside = [i for i in range(model.BuffersLength()) if model.Buffers(i).Offset() > 1]
    assert len(outside) >= 4 and all(model.Buffers(i).DataLength() == 0 for i in outside)
    np.save(tmp_path / "x.npy", x)
    out = tmp_path / "out"
    run(host, path, out, inputs=[str(tmp_path / "x.npy")])
    ir = json.loads((out / "ir.json").read_text())
    assert ir["producer"]["quantizer"] == "tflite-int8"
    assert sum(1 for layer in ir["layers"] if layer["quant"]["kind"] in ("conv2d", "depthwise_conv2d")) >= 2
    assert assert_layers_equal(out, ir, tflite_models.tflite_reference(path, x), path.name, np.int8) >= 3
    capsys.readouterr()
    code = irgen_main(["verify", str(out), "--no-progress", "--no-report", "--json"])
    r = json.loads(capsys.readouterr().out)
    assert code == 0 and r["passed"], r.get("problems")
