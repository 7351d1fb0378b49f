"""tflite-int8 on the converter's 16x8 mode (int16 activations, int8 weights, int64 biases):
golden data equals TFLite's reference kernels bit for bit.

Each model is converted with ``EXPERIMENTAL_TFLITE_BUILTINS_ACTIVATIONS_INT16_WEIGHTS_INT8`` (a
float interface: a QUANTIZE to int16 first, a DEQUANTIZE last) and run through irgen for seeded
float inputs, the last ones of large magnitude (the int16 range saturates) and the first full of
exact rounding ties of the input QUANTIZE; every layer's activation file must equal the TFLite
interpreter's tensor (BUILTIN_REF resolver), and every layer recomputes in numpy from its
``quant`` record and parameter files.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

import tflite_models
from layercheck import assert_layer_recomputes, assert_layers_equal, run_each
from irgen.pipeline import run
from irgen.plugins import PluginHost

N_INPUTS = 6


@pytest.fixture(scope="module")
def host():
    return PluginHost().load()


def _inputs(path, shape, n: int) -> list[np.ndarray]:
    """Seeded inputs: rounding ties of the input QUANTIZE first, large values last."""
    import tensorflow as tf

    it = tf.lite.Interpreter(model_path=str(path))
    q = [d for d in it.get_tensor_details() if d["dtype"] == np.int16 and d["quantization"][0] > 0][0]
    s = np.float32(q["quantization"][0])
    xs = []
    for k in range(n):
        x = np.random.default_rng(700 + k).standard_normal(shape).astype(np.float32) * (1 + 4 * k)
        if k == 0:
            flat = x.reshape(-1)
            ties = [v for v in (np.float32((j + 0.5) * np.float64(s)) for j in range(-flat.size // 2, flat.size // 2))
                    if float(v / s) % 1 == 0.5]
            flat[:len(ties)] = ties[:flat.size]
        xs.append(x)
    return xs


#: runs16 by model: a test that picks its model (indirect parametrization) gets the runs
#: already made instead of pytest setting the module fixture up again for it
_RUNS16: dict[str, tuple] = {}


#: The default suite runs the models the tests below pick (a CNN, the tables, the batch matmul) on
#: the first N_INPUTS_DEFAULT inputs (the rounding ties, then larger values); the ``MODEL-6`` cases,
#: all slow, run every model (the MLPs and the leaky/min/max model too) on N_INPUTS.
#: test_int16_gelu_table_gives_every_code_as_the_interpreter checks the GELU table by default.
N_INPUTS_DEFAULT = 3
MODELS16 = ("small_cnn", "mlp", "classifier", "gated_cnn", "attention_cnn", "leaky_minmax", "gelu_mlp")
CASES16 = [*(n for n in MODELS16 if n in ("small_cnn", "gated_cnn", "attention_cnn")),
           *(pytest.param(f"{n}-{N_INPUTS}", marks=pytest.mark.slow) for n in MODELS16)]


@pytest.fixture(scope="module", params=CASES16)
def runs16(request, tmp_path_factory, host):
    """(model path, [(input, OUT)]) for N_INPUTS_DEFAULT inputs, or the number the case names, at
    opt levels 3 and 0 in turn."""
    if request.param not in _RUNS16:
        name, _, n = request.param.partition("-")
        folder = tmp_path_factory.mktemp(f"x16_{request.param}")
        path, _ = tflite_models.export(name, folder, "int16x8")
        shape = tuple(tflite_models.BUILDERS[name](tflite_models._tf())[1])
        _RUNS16[request.param] = path, run_each(host, path, folder, _inputs(path, shape, int(n or N_INPUTS_DEFAULT)))
    return _RUNS16[request.param]


def test_every_int16_activation_equals_the_interpreter(runs16):
    path, runs = runs16
    checked = 0
    for x, out in runs:
        ir = json.loads((out / "ir.json").read_text())
        assert ir["producer"]["quantizer"] == "tflite-int8"
        checked += assert_layers_equal(out, ir, tflite_models.tflite_reference(path, x), path.name)
        inner = [l for l in ir["layers"] if l["quant"]["kind"] not in ("quantize", "dequantize")]
        assert inner and all(l["outputs"][0]["dtype"] == "int16" for l in inner)
    assert checked >= len(runs) * 3


def test_layers_recompute_from_quant_and_parameters(runs16):
    _, runs = runs16
    for _, out in runs[:2]:
        ir = json.loads((out / "ir.json").read_text())
        for layer in ir["layers"]:
            assert layer["quant"]["scheme"] == "tflite-int8", layer["name"]
            assert_layer_recomputes(out, layer, 0)


@pytest.mark.parametrize("runs16", ["small_cnn"], indirect=True)
def test_16x8_records_int64_biases_and_symmetric_int16(runs16):
    """A 16x8 conv's record: int16 input and output with zero point 0, its int64 bias (a
    parameter file of int64), TFLite's int64 rescaling rule; the ADD's 15-bit headroom."""
    _, runs = runs16
    out = runs[0][1]
    ir = json.loads((out / "ir.json").read_text())
    convs = [l for l in ir["layers"] if l["op"] in ("conv2d", "depthwise_conv2d", "dense")]
    assert {l["op"] for l in convs} == {"conv2d", "depthwise_conv2d", "dense"}
    for layer in convs:
        q = layer["quant"]
        assert q["inputs"][0]["dtype"] == q["output"]["dtype"] == "int16"
        assert q["inputs"][0]["zero_point"] == q["output"]["zero_point"] == 0
        assert q["weight"]["dtype"] == "int8" and q["bias"]["dtype"] == "int64"
        assert np.load(out / layer["params"]["bias"]["file"]).dtype == np.int64
        want = "float64" if layer["op"] == "dense" else "wide"
        assert q["requant"]["rounding"] == want, layer["name"]
        lo, hi = q["clamp"]
        assert -32768 <= lo < hi <= 32767
    (add,) = [l for l in ir["layers"] if l["op"] == "add"]
    assert add["quant"]["requant"]["left_shift"] == 15


@pytest.mark.parametrize("runs16", ["gated_cnn"], indirect=True)
def test_16x8_tables_and_named_ops(runs16):
    """SOFTMAX, LOGISTIC and TANH on int16 are TFLite's own kernels: the softmax's two 513-entry
    tables (exp and 1/(1+x), in double with the midpoint correction) and the sigmoid table are
    parameter files; the layers are named by their op; MUL's multiplier is the float32
    quotient s1 * s2 / s_y (mul.cc) and the int16 requantize before the concatenation is one."""
    from irgen_tflite_int8 import int16

    from irgen.plugin import quantize_multiplier

    _, runs = runs16
    out = runs[0][1]
    ir = json.loads((out / "ir.json").read_text())
    by_kind: dict[str, list] = {}
    for layer in ir["layers"]:
        by_kind.setdefault(layer["quant"]["kind"], []).append(layer)
    (soft,) = by_kind["softmax16"]
    assert soft["op"] == "softmax"
    exp_t, rec_t = (np.load(out / soft["params"][k]["file"]) for k in ("table", "table1"))
    want_exp, want_rec = int16.softmax_tables()
    assert exp_t.dtype == np.int16 and exp_t.shape == (513,)
    np.testing.assert_array_equal(exp_t, want_exp)
    np.testing.assert_array_equal(rec_t, want_rec)
    assert exp_t[-1] == 32767 and rec_t[0] == 32767  # exp(0) and 1/(1+0): one, as Q0.15 saturates it
    assert [l["op"] for l in by_kind["logistic16"]] == ["sigmoid", "sigmoid"]
    assert [l["op"] for l in by_kind["tanh16"]] == ["tanh"]
    for layer in by_kind["logistic16"] + by_kind["tanh16"]:
        np.testing.assert_array_equal(np.load(out / layer["params"]["table"]["file"]), int16.SIGMOID_TABLE)
        assert layer["quant"]["output"]["scale"] == 1 / 32768
    for layer in by_kind["mul"]:
        q = layer["quant"]
        s1, s2, sy = (np.float32(t["scale"]) for t in (*q["inputs"], q["output"]))
        assert (q["requant"]["multiplier"], q["requant"]["shift"]) == quantize_multiplier(float(np.float32(s1 * s2) / sy))
    assert by_kind["requantize"] and all(l["outputs"][0]["dtype"] == "int16" for l in by_kind["requantize"])


@pytest.mark.slow  # test_every_int16_activation_equals_the_interpreter runs by default
def test_16x8_model_verifies(tmp_path, capsys):
    """``irgen run`` then ``irgen verify`` (all three modes, the source check against the
    interpreter) on the gated model: every layer passes."""
    from irgen.cli import main

    path, x = tflite_models.export("gated_cnn", tmp_path, "int16x8")
    np.save(tmp_path / "x.npy", x * 3)
    out = tmp_path / "out"
    assert main(["run", str(path), "-o", str(out), "--input", str(tmp_path / "x.npy"), "--no-progress"]) == 0
    capsys.readouterr()
    assert main(["verify", str(out), "--no-report", "--no-progress"]) == 0
    text = capsys.readouterr().out
    assert "PASS: 20 layers, 20 passed, 0 failed" in text, text[-600:]


def _wide_bias_model(path, dest):
    """``path`` (small_cnn in 16x8) with its first CONV_2D's channel-0 bias set to 2**33 (beyond
    int32, as a dead channel's bias can be) and that conv's output scale raised so that the
    channel lands near 10000 instead of saturating."""
    import struct

    import tflite

    buf = bytearray(path.read_bytes())
    model = tflite.Model.GetRootAsModel(bytes(buf), 0)
    sg = model.Subgraphs(0)
    op = [sg.Operators(i) for i in range(sg.OperatorsLength())
          if model.OperatorCodes(sg.Operators(i).OpcodeIndex()).BuiltinCode() == 3][0]  # CONV_2D
    x_t, w_t, b_t = (sg.Tensors(int(k)) for k in op.InputsAsNumpy())
    y_t = sg.Tensors(int(op.OutputsAsNumpy()[0]))
    data = model.Buffers(b_t.Buffer())
    assert b_t.Type() == 4 and data.DataLength() >= 8  # INT64
    struct.pack_into("<q", buf, data._tab.Vector(data._tab.Offset(4)), 2 ** 33)
    s_x, s_w0 = x_t.Quantization().Scale(0), w_t.Quantization().Scale(0)
    q = y_t.Quantization()
    struct.pack_into("<f", buf, q._tab.Vector(q._tab.Offset(8)), 2.0 ** 33 * s_x * s_w0 / 10000)
    dest.write_bytes(bytes(buf))
    return dest


def test_an_int64_bias_beyond_int32_is_added_in_int64(tmp_path, host):
    """TVM cannot dequantize an int64 bias; the frontend reads one that fits int32 as int32 and
    keeps a larger one as its int64 constant, and the scheme adds either in int64: with a bias of
    2**33, every layer equals the interpreter's reference kernels and the bias file holds it."""
    src, x = tflite_models.export("small_cnn", tmp_path, "int16x8")
    path = _wide_bias_model(src, tmp_path / "wide.tflite")
    np.save(tmp_path / "x.npy", x)
    out = tmp_path / "out"
    run(host, path, out, inputs=[str(tmp_path / "x.npy")])
    ir = json.loads((out / "ir.json").read_text())
    assert_layers_equal(out, ir, tflite_models.tflite_reference(path, x), path.name)
    conv = ir["layers"][1]
    assert conv["op"] == "conv2d" and conv["quant"]["bias"]["dtype"] == "int64"
    bias = np.load(out / conv["params"]["bias"]["file"])
    assert bias.dtype == np.int64 and bias[0] == 2 ** 33
    y = np.load(out / conv["outputs"][0]["file"])
    assert 5000 < y[..., 0].max() < 32767  # the channel is computed, not saturated
    assert_layer_recomputes(out, conv, 0)


@pytest.mark.parametrize("runs16", ["attention_cnn"], indirect=True)
def test_16x8_batch_matmul_sums_in_int64(runs16):
    """BATCH_MATMUL of two int16 activations: TFLite's BatchMatMul<int16_t, int64_t>, int64
    sums rescaled by the int64 multiplier (rounding ``wide``; the int32 kernels' roundings
    missed 8.5% of the values); RESIZE_BILINEAR is the int8 kernel's integer algorithm."""
    _, runs = runs16
    ir = json.loads((runs[0][1] / "ir.json").read_text())
    (mm,) = [l for l in ir["layers"] if l["quant"]["kind"] == "batch_matmul"]
    assert mm["quant"]["requant"]["rounding"] == "wide"
    assert [l["op"] for l in ir["layers"] if l["quant"]["kind"] == "resize_bilinear"] == ["resize_bilinear"]


def test_the_int8_npu_backend_refuses_a_16x8_model_layer_by_layer(tmp_path, capsys):
    """The example NPU backend computes int8 only: a 16x8 model is refused at once, every layer
    named with why (int16 activations, int64 biases), and nothing is written."""
    from layercheck import assert_user_error

    from irgen.cli import main

    path, x = tflite_models.export("small_cnn", tmp_path, "int16x8")
    out = tmp_path / "out"
    line = assert_user_error(lambda a: main(["run", *a, "--no-progress"]), capsys,
                             [str(path), "-o", str(out), "--backend", "npu-int8"], out,
                             "cannot run 11 layer(s)", "a quantized layer (int16): int8 activations only",
                             "bias is int64: int32 only", "quantizes float32 to int16")
    assert "a float layer" not in line


@pytest.mark.parametrize("approximate", [False, True], ids=["erf", "tanh"])
@pytest.mark.parametrize("extent", [0.7, 6.0, 13.0])
def test_int16_gelu_table_gives_every_code_as_the_interpreter(approximate, extent, tmp_path):
    """TFLite's int16 GELU on each of the 65,536 input codes, at three input scales: the
    table irgen puts in the record, looked up as irgen's kernel and recompute do, gives the
    interpreter's output for every one (a float erf form instead of erfc, or the tables in
    double, miss 128 and 2,187 codes at the 6.0 scale)."""
    import tensorflow as tf

    from irgen_tflite_int8 import int16

    L = tf.keras.layers
    x = L.Input((65536,), batch_size=1, name="x")
    model = tf.keras.Model(x, L.Activation(lambda t: tf.nn.gelu(t, approximate=approximate))(x))
    conv = tf.lite.TFLiteConverter.from_keras_model(model)
    conv.optimizations = [tf.lite.Optimize.DEFAULT]
    conv.representative_dataset = lambda: iter([[np.linspace(-extent, extent, 65536, dtype=np.float32)[None]]] * 2)
    conv.target_spec.supported_ops = [tf.lite.OpsSet.EXPERIMENTAL_TFLITE_BUILTINS_ACTIVATIONS_INT16_WEIGHTS_INT8]
    it = tf.lite.Interpreter(model_content=conv.convert(), experimental_preserve_all_tensors=True,
                             experimental_op_resolver_type=tf.lite.experimental.OpResolverType.BUILTIN_REF)
    it.allocate_tensors()
    (gelu,) = [o for o in it._get_ops_details() if o["op_name"] == "GELU"]
    details = {d["index"]: d for d in it.get_tensor_details()}
    (s_in, zp_in), (s_out, zp_out) = (details[gelu[k][0]]["quantization"] for k in ("inputs", "outputs"))
    codes = np.arange(-32768, 32768, dtype=np.int64)
    it.set_tensor(it.get_input_details()[0]["index"], (codes * np.float64(s_in)).astype(np.float32)[None])
    it.invoke()
    q_in = it.get_tensor(gelu["inputs"][0]).reshape(-1)
    assert len(np.unique(q_in)) == 65536  # every code went in
    table = int16.gelu_table16(s_in, zp_in, s_out, zp_out, approximate)
    np.testing.assert_array_equal(int16.gelu16(q_in, table), it.get_tensor(gelu["outputs"][0]).reshape(-1))
