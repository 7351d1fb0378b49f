"""tflite-int8: operators of the keras.applications CNNs that TVM's importer
refuses or imports as float on int8 tensors (PAD, SHAPE, STRIDED_SLICE,
TRANSPOSE, SQUEEZE, RESIZE_NEAREST_NEIGHBOR; HARD_SWISH, LOGISTIC, MUL, MEAN,
RESIZE_BILINEAR, BATCH_MATMUL, SUB, GELU, SQUARED_DIFFERENCE, RSQRT and
NEG between DEQUANTIZE and QUANTIZE;
FULLY_CONNECTED on 3-D inputs).

Each small Keras model is converted to full int8 with a representative
dataset; for seeded int8 inputs every int8 activation irgen writes must equal
the TFLite interpreter's tensor (BUILTIN_REF kernels, all tensors preserved)
bit for bit, and ``irgen verify`` single/entire passes (conftest runs it after
every run).
"""

from __future__ import annotations

import json

import numpy as np
import pytest

import tflite_models
from layercheck import assert_layer_recomputes, assert_layers_equal, run_each
from irgen.pipeline import run
from irgen.plugins import PluginHost

N_INPUTS = 4


def _conv(L, x, n, **kw):
    return L.Conv2D(n, 3, padding="same", **kw)(x)


def zero_pad(tf):
    """ZeroPadding2D before a conv and before a max pool (ResNet50, DenseNet121)."""
    L = tf.keras.layers
    x = L.Input((12, 12, 3), batch_size=1, name="x")
    y = L.ZeroPadding2D(((1, 2), (0, 1)))(x)
    y = L.Conv2D(8, 3, name="conv")(y)
    y = L.ZeroPadding2D(1)(y)
    return tf.keras.Model(x, L.MaxPooling2D(3, 2)(y)), (1, 12, 12, 3)


def squeeze_excite(tf):
    """GlobalAveragePooling2D -> Reshape -> 1x1 convs -> sigmoid -> Multiply (EfficientNet)."""
    L = tf.keras.layers
    x = L.Input((12, 12, 3), batch_size=1, name="x")
    c = _conv(L, x, 8, activation="relu")
    s = L.Reshape((1, 1, 8))(L.GlobalAveragePooling2D()(c))
    s = L.Conv2D(4, 1, activation="relu")(s)
    s = L.Conv2D(8, 1, activation="sigmoid")(s)
    return tf.keras.Model(x, L.Multiply()([c, s])), (1, 12, 12, 3)


def shape_reshape(tf):
    """A reshape through tf.shape with an open batch: SHAPE -> STRIDED_SLICE -> PACK -> RESHAPE."""
    L = tf.keras.layers
    x = L.Input((12, 12, 3), name="x")
    c = _conv(L, x, 8)
    y = L.Lambda(lambda c: c * tf.nn.sigmoid(tf.reshape(tf.reduce_mean(c, axis=[1, 2]), [tf.shape(c)[0], 1, 1, 8])))(c)
    return tf.keras.Model(x, y), (1, 12, 12, 3)


def strided_slice(tf):
    """x[:, 1:5, :, ::2] and a shrinking slice on int8 (NASNetMobile)."""
    L = tf.keras.layers
    x = L.Input((12, 12, 4), batch_size=1, name="x")
    c = _conv(L, x, 8)
    a = _conv(L, L.Lambda(lambda c: c[:, 1:5, :, ::2])(c), 8)
    return tf.keras.Model(x, L.Lambda(lambda c: c[:, -3:, 2, 1:7])(a)), (1, 12, 12, 4)


def hard_swish(tf):
    """x * relu6(x + 3) / 6, converted to HARD_SWISH (MobileNetV3)."""
    L = tf.keras.layers
    x = L.Input((12, 12, 3), batch_size=1, name="x")
    c = _conv(L, x, 8)
    return tf.keras.Model(x, L.Lambda(lambda c: c * tf.nn.relu6(c + 3.0) / 6.0)(c)), (1, 12, 12, 3)


def resize_nearest(tf):
    """RESIZE_NEAREST_NEIGHBOR, half-pixel and align-corners, non-integer factors."""
    L = tf.keras.layers
    x = L.Input((6, 6, 3), batch_size=1, name="x")
    c = _conv(L, x, 4)
    a = L.Lambda(lambda c: tf.image.resize(c, (9, 13), method="nearest"))(c)
    a = _conv(L, a, 4)
    b = L.Lambda(lambda c: tf.compat.v1.image.resize_nearest_neighbor(c, (11, 7), align_corners=True))(a)
    return tf.keras.Model(x, b), (1, 6, 6, 3)


def resize_bilinear(tf):
    """RESIZE_BILINEAR: UpSampling2D, a non-integer factor, align corners."""
    L = tf.keras.layers
    x = L.Input((5, 6, 3), batch_size=1, name="x")
    c = L.UpSampling2D(2, interpolation="bilinear")(_conv(L, x, 4))
    c = L.Lambda(lambda c: tf.image.resize(c, (13, 9), method="bilinear"))(_conv(L, c, 4))
    c = L.Lambda(lambda c: tf.compat.v1.image.resize_bilinear(c, (7, 17), align_corners=True))(_conv(L, c, 4))
    return tf.keras.Model(x, c), (1, 5, 6, 3)


def transpose_mean(tf):
    """TRANSPOSE then MEAN over one axis."""
    L = tf.keras.layers
    x = L.Input((8, 8, 3), batch_size=1, name="x")
    c = _conv(L, x, 4)
    t = L.Lambda(lambda c: tf.transpose(c, [0, 2, 1, 3]))(c)
    return tf.keras.Model(x, L.Lambda(lambda t: tf.reduce_mean(t, axis=[1]))(t)), (1, 8, 8, 3)


def dense_3d(tf):
    """SQUEEZE to a 3-D tensor, then FULLY_CONNECTED on it."""
    L = tf.keras.layers
    x = L.Input((8, 8, 3), batch_size=1, name="x")
    c = _conv(L, x, 4)
    s = L.Lambda(lambda t: tf.squeeze(t, axis=1))(L.Conv2D(4, (8, 1))(c))
    return tf.keras.Model(x, L.Dense(5)(s)), (1, 8, 8, 3)


def batch_matmul(tf):
    """BATCH_MATMUL of two int8 activations, with and without the adjoint flag (attention scores)."""
    L = tf.keras.layers
    x = L.Input((6, 8), batch_size=1, name="x")
    a, b = L.Dense(8)(x), L.Dense(8)(x)
    s = L.Lambda(lambda ab: tf.matmul(ab[0], ab[1], transpose_b=True))([a, b])
    return tf.keras.Model(x, L.Lambda(lambda sa: tf.matmul(sa[0], sa[1]))([s, a])), (1, 6, 8)


def concat_batch_norm(tf):
    """Concatenate -> BatchNormalization -> ReLU (DenseNet121: MUL and ADD with int8
    constants), ReLU6 after an add, ReLU after a concatenation (NASNetMobile: a
    standalone int8 RELU)."""
    L = tf.keras.layers
    x = L.Input((8, 8, 3), batch_size=1, name="x")
    a, b = _conv(L, x, 4), _conv(L, x, 4)
    gamma = np.linspace(0.5, 1.5, 8).astype(np.float32)  # an inference batch norm: per-channel scale and shift
    beta = np.linspace(-0.3, 0.4, 8).astype(np.float32)
    c = L.ReLU()(L.Lambda(lambda t: t * gamma + beta)(L.Concatenate()([a, b])))
    d = L.ReLU(max_value=6.0)(L.Add()([_conv(L, c, 8), c]))
    e = L.ReLU()(L.Concatenate()([_conv(L, d, 4), L.MaxPooling2D(1)(d)]))
    return tf.keras.Model(x, _conv(L, e, 4)), (1, 8, 8, 3)


def subtract(tf):
    """SUB: keras Normalization (an input minus a per-channel constant mean, EfficientNetV2's
    preprocessing), and one activation minus another, broadcast, with a ReLU after."""
    L = tf.keras.layers
    x = L.Input((8, 8, 3), batch_size=1, name="x")
    n = L.Normalization(mean=[0.485, 0.456, 0.406], variance=[0.229 ** 2, 0.224 ** 2, 0.225 ** 2])(x)
    a = _conv(L, n, 8)
    b = L.Reshape((1, 1, 8))(L.GlobalAveragePooling2D()(_conv(L, n, 8)))
    return tf.keras.Model(x, _conv(L, L.ReLU()(L.Subtract()([a, b])), 4)), (1, 8, 8, 3)


def tanh(tf):
    """TANH on a conv's output and on the int8 input itself (every table entry is reached)."""
    L = tf.keras.layers
    x = L.Input((8, 8, 4), batch_size=1, name="x")
    t = L.Activation("tanh")(_conv(L, x, 4))
    return tf.keras.Model(x, L.Concatenate()([t, L.Activation("tanh")(x)])), (1, 8, 8, 4)


def gelu(tf):
    """GELU in both forms (ConvNeXt, ViT): on the int8 input itself (random inputs reach
    most of its 256 table entries), ``approximate=True`` after a conv."""
    L = tf.keras.layers
    x = L.Input((8, 8, 4), batch_size=1, name="x")
    g = L.Activation(lambda t: tf.nn.gelu(t, approximate=False))(x)
    a = L.Activation(lambda t: tf.nn.gelu(t, approximate=True))(_conv(L, g, 8))
    return tf.keras.Model(x, _conv(L, a, 4)), (1, 8, 8, 4)


def exp_log(tf):
    """EXP of the int8 input itself (random inputs reach every table entry), LOG of its
    positive result, softplus (EXP, ADD, LOG) after a conv."""
    L = tf.keras.layers
    x = L.Input((8, 8, 4), batch_size=1, name="x")
    log = L.Lambda(lambda t: tf.math.log(t), name="log")(L.Lambda(lambda t: tf.exp(t), name="exp")(x))
    return tf.keras.Model(x, L.Concatenate()([log, L.Activation("softplus")(_conv(L, x, 4))])), (1, 8, 8, 4)


def layer_norm(tf):
    """keras LayerNormalization (ConvNeXt): MEAN, the mean negated in float between a
    DEQUANTIZE and a QUANTIZE (NEG), SQUARED_DIFFERENCE, MEAN, ADD, RSQRT, MULs, ADD."""
    L = tf.keras.layers
    x = L.Input((8, 8, 3), batch_size=1, name="x")
    return tf.keras.Model(x, _conv(L, L.LayerNormalization(epsilon=1e-6)(_conv(L, x, 16)), 4)), (1, 8, 8, 3)


MODELS = {
    "zero_pad": (zero_pad, {"PAD"}, {"pad", "conv2d", "max_pool2d"}),
    "squeeze_excite": (squeeze_excite, {"MEAN", "LOGISTIC", "MUL"}, {"mean", "lut", "mul"}),
    "shape_reshape": (shape_reshape, {"SHAPE", "STRIDED_SLICE", "PACK", "LOGISTIC", "MUL"}, {"lut", "mul"}),
    "strided_slice": (strided_slice, {"STRIDED_SLICE"}, {"conv2d"}),
    "hard_swish": (hard_swish, {"HARD_SWISH"}, {"lut"}),
    "resize_nearest": (resize_nearest, {"RESIZE_NEAREST_NEIGHBOR"}, {"conv2d"}),
    "resize_bilinear": (resize_bilinear, {"RESIZE_BILINEAR"}, {"resize_bilinear"}),
    "transpose_mean": (transpose_mean, {"TRANSPOSE", "MEAN"}, {"transpose", "mean"}),
    "batch_matmul": (batch_matmul, {"BATCH_MATMUL", "FULLY_CONNECTED"}, {"batch_matmul", "dense"}),
    "concat_batch_norm": (concat_batch_norm, {"MUL", "ADD", "RELU"}, {"mul", "add", "requantize"}),
    "dense_3d": (dense_3d, {"FULLY_CONNECTED"}, {"dense"}),
    "subtract": (subtract, {"SUB"}, {"subtract"}),
    "tanh": (tanh, {"TANH"}, {"lut", "tanh"}),
    "leaky_minmax": (tflite_models.leaky_minmax, {"LEAKY_RELU", "MAXIMUM", "MINIMUM"},
                     {"leaky_relu", "maximum", "minimum"}),
    "prelu": (tflite_models.prelu_cnn, {"PRELU"}, {"prelu"}),
    "gelu": (gelu, {"GELU"}, {"lut", "gelu:none", "gelu:tanh"}),
    "exp_log": (exp_log, {"EXP", "LOG"}, {"lut", "exp", "log"}),
    "layer_norm": (layer_norm, {"NEG", "SQUARED_DIFFERENCE", "RSQRT"}, {"squared_difference", "rsqrt", "negative"}),
}
tflite_models.BUILDERS.update({name: m[0] for name, m in MODELS.items()})


@pytest.fixture(scope="module")
def host():
    return PluginHost().load()


#: The default suite runs each model on N_INPUTS_DEFAULT inputs (one at opt level 3, one at 0),
#: except the three with the most kernels to build (SLOW); the ``MODEL-4`` cases, all slow, run
#: every model on N_INPUTS.
N_INPUTS_DEFAULT = 2
SLOW = {"layer_norm", "concat_batch_norm", "subtract"}
CASES = [*(n for n in sorted(MODELS) if n not in SLOW),
         *(pytest.param(f"{n}-{N_INPUTS}", marks=pytest.mark.slow) for n in sorted(MODELS))]


@pytest.fixture(scope="module", params=CASES)
def runs(request, tmp_path_factory, host):
    name, _, n = request.param.partition("-")
    folder = tmp_path_factory.mktemp(f"int8_{request.param}")
    path, _ = tflite_models.export(name, folder, "int8")
    shape = tuple(MODELS[name][0](tflite_models._tf())[1])
    xs = [np.random.default_rng(2000 + k).integers(-128, 128, shape).astype(np.int8)
          for k in range(int(n or N_INPUTS_DEFAULT))]
    return name, path, run_each(host, path, folder, xs)


def _tflite_ops(path) -> set[str]:
    tf = tflite_models._tf()
    return {o["op_name"] for o in tf.lite.Interpreter(model_path=str(path))._get_ops_details()}


def test_every_int8_activation_equals_the_interpreter(runs):
    name, path, out = runs
    assert MODELS[name][1] <= _tflite_ops(path)  # the model holds the operators under test
    for x, folder in out:
        ir = json.loads((folder / "ir.json").read_text())
        assert ir["producer"]["quantizer"] == "tflite-int8"
        assert_layers_equal(folder, ir, tflite_models.tflite_reference(path, x), name, np.int8)


def test_layers_recompute_from_quant_records(runs):
    name, _, out = runs
    ir = json.loads((out[0][1] / "ir.json").read_text())
    kinds = set()
    for layer in ir["layers"]:
        assert layer["quant"] is not None and layer["quant"]["scheme"] == "tflite-int8", layer["name"]
        assert_layer_recomputes(out[0][1], layer, 0)
        kinds |= {layer["op"], layer["quant"]["kind"]}
        if layer["op"] == "gelu":  # both forms are tables; the layer says which
            want = "tanh" if layer["quant"]["params"]["approximate"] else "none"
            assert layer["attrs"]["approximate"] == want, (layer["name"], layer["attrs"])
            kinds.add(f"gelu:{want}")
        if layer["quant"]["kind"] == "subtract":  # TFLite's SUB: its ADD with input 2's multiplier negated
            m = layer["quant"]["requant"]["input_multiplier"]
            assert m[0] > 0 > m[1] and layer["op"] == "subtract", (layer["name"], m, layer["op"])
    assert MODELS[name][2] <= kinds, kinds


def test_lut_records_say_how_the_table_is_made(tmp_path, host):
    """LOGISTIC and HARD_SWISH are 256-entry tables; the record names the function
    and (hard swish) TFLite's fixed-point parameters, and the table file equals
    the table rebuilt from the record."""
    from irgen_tflite_int8.kinds import lut_table

    seen = set()
    for name in ("hard_swish", "squeeze_excite"):
        path, x = tflite_models.export(name, tmp_path / name, "int8")
        np.save(tmp_path / f"{name}.npy", x)
        run(host, path, tmp_path / f"{name}_out", inputs=[str(tmp_path / f"{name}.npy")])
        ir = json.loads((tmp_path / f"{name}_out" / "ir.json").read_text())
        for layer in ir["layers"]:
            q = layer["quant"]
            if q["kind"] != "lut":
                continue
            seen.add(q["function"])
            table = np.load(tmp_path / f"{name}_out" / layer["params"]["table"]["file"])
            assert table.dtype == np.int8 and table.shape == (256,)
            np.testing.assert_array_equal(table, lut_table(q))
            if q["function"] == "hard_swish":
                assert set(q["params"]) == {"output_multiplier_int16", "output_exponent",
                                            "reluish_multiplier_int16", "reluish_exponent"}
            else:  # sigmoid's output is fixed by TFLite: scale 1/256, zero point -128
                assert q["output"]["scale"] == 1 / 256 and q["output"]["zero_point"] == -128
    assert seen == {"hard_swish", "logistic"}


def _application(tf, name: str, size: int):
    A = tf.keras.applications
    kw = {"weights": None, "input_shape": (size, size, 3)}
    if name == "MobileNetV3Small":
        return A.MobileNetV3Small(**kw, include_preprocessing=False, minimalistic=False)
    return getattr(A, name)(**kw)


@pytest.mark.slow
@pytest.mark.parametrize("name,size", [("MobileNetV3Small", 32), ("EfficientNetB0", 32), ("ResNet50", 32)])
def test_keras_application_int8_equals_the_interpreter(name, size, tmp_path, host):
    """A keras.applications CNN (random weights, batch-norm statistics kept
    positive) converted to full int8: every int8 activation equals the interpreter's."""
    tf = tflite_models._tf()
    tf.keras.utils.set_random_seed(0)
    model = _application(tf, name, size)
    rng = np.random.default_rng(0)
    for w in model.weights:
        shape = tuple(w.shape)
        if "moving_variance" in w.path or "gamma" in w.path:
            w.assign(rng.uniform(0.5, 1.5, shape).astype(np.float32))
        elif "moving_mean" in w.path or "beta" in w.path:
            w.assign(rng.normal(0.0, 0.1, shape).astype(np.float32))
        else:
            fan_in = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
            w.assign(rng.normal(0.0, 1.0 / np.sqrt(max(fan_in, 1)), size=shape).astype(np.float32))
    conv = tf.lite.TFLiteConverter.from_keras_model(model)
    conv.optimizations = [tf.lite.Optimize.DEFAULT]
    shape = (1, size, size, 3)
    samples = [np.random.default_rng(1 + i).uniform(-1, 1, shape).astype(np.float32) * 127 for i in range(4)]
    conv.representative_dataset = lambda: ([s] for s in samples)
    conv.target_spec.supported_ops = [tf.lite.OpsSet.TFLITE_BUILTINS_INT8]
    conv.inference_input_type = conv.inference_output_type = tf.int8
    path = tmp_path / f"{name}.tflite"
    path.write_bytes(conv.convert())
    x = np.random.default_rng(7).integers(-128, 128, shape).astype(np.int8)
    np.save(tmp_path / "x.npy", x)
    run(host, path, tmp_path / "out", inputs=[str(tmp_path / "x.npy")])
    ir = json.loads((tmp_path / "out" / "ir.json").read_text())
    ref = tflite_models.tflite_reference(path, x)
    for layer in ir["layers"]:
        for rec, src in zip(layer["outputs"], layer["source"]["outputs"], strict=True):
            np.testing.assert_array_equal(np.load(tmp_path / "out" / rec["file"]), ref[src], err_msg=layer["name"])
