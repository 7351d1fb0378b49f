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
from layercheck import assert_layer_recomputes, assert_layers_equal
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


@pytest.fixture(scope="module", params=["small_cnn", "mlp"])
def runs16(request, tmp_path_factory, host):
    """(model path, [(input, OUT)]) for N_INPUTS inputs, at opt levels 3 and 0 in turn."""
    folder = tmp_path_factory.mktemp(f"x16_{request.param}")
    path, _ = tflite_models.export(request.param, folder, "int16x8")
    shape = tuple(tflite_models.BUILDERS[request.param](tflite_models._tf())[1])
    out = []
    for k, x in enumerate(_inputs(path, shape, N_INPUTS)):
        np.save(folder / f"x{k}.npy", x)
        o = folder / f"out{k}"
        run(host, path, o, inputs=[str(folder / f"x{k}.npy")], opt_level=3 if k % 2 == 0 else 0)
        out.append((x, o))
    return path, out


def test_every_int16_activation_equals_the_interpreter(runs16):
    path, runs = runs16
    checked = 0
    for x, out in runs:
        ir = json.loads((out / "ir.json").read_text())
        assert ir["producer"]["quantizer"] == "tflite-int8"
        checked += assert_layers_equal(out, ir, tflite_models.tflite_reference(path, x), path.name)
        inner = [l for l in ir["layers"] if l["quant"]["kind"] not in ("quantize", "dequantize")]
        assert inner and all(l["outputs"][0]["dtype"] == "int16" for l in inner)
    assert checked >= N_INPUTS * 3


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
        want = "single" if layer["op"] == "dense" else "wide"
        assert q["requant"]["rounding"] == want, layer["name"]
        lo, hi = q["clamp"]
        assert -32768 <= lo < hi <= 32767
    (add,) = [l for l in ir["layers"] if l["op"] == "add"]
    assert add["quant"]["requant"]["left_shift"] == 15
