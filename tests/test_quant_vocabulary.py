"""One layer vocabulary for int8 models (issue 12): the same network quantized by the
TFLite converter (full-integer int8) and by onnxruntime's ``quantize_static`` (QDQ)
gives the same sequence of layer ops, and the same parameter shapes.

The network: conv+relu, max pool, conv+relu, a residual add, a depthwise conv, a
sigmoid, a global average pool, a dense layer, softmax; built in Keras (NHWC) and
written directly as ONNX (NCHW) with the same structure. The ORT model has layers
the TFLite one does not: the ``quantize``/``dequantize`` of its float input and
output, and ONNX's ``Flatten`` after ``GlobalAveragePool`` (Keras' pooling is 2-D
already); everything that computes has the same op. Both runs pass ``irgen verify``
against their own runtime, so the names describe bit-exact layers.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from irgen.cli import main as irgen_main

pytest.importorskip("onnxruntime")
tf = pytest.importorskip("tensorflow")

SAMPLES = [np.random.default_rng(k).standard_normal((1, 8, 8, 3)).astype(np.float32) for k in range(4)]


def _tflite_int8(path: Path) -> Path:
    k = tf.keras.layers
    x = tf.keras.Input((8, 8, 3), batch_size=1)
    c1 = k.Conv2D(8, 3, padding="same", activation="relu")(x)
    p1 = k.MaxPool2D(2)(c1)
    c2 = k.Conv2D(8, 3, padding="same", activation="relu")(p1)
    d = k.DepthwiseConv2D(3, padding="same")(k.Add()([c2, p1]))
    y = k.Dense(4)(k.GlobalAveragePooling2D()(k.Activation("sigmoid")(d)))
    conv = tf.lite.TFLiteConverter.from_keras_model(tf.keras.Model(x, k.Softmax()(y)))
    conv.optimizations = [tf.lite.Optimize.DEFAULT]
    conv.representative_dataset = lambda: ([s] for s in SAMPLES)
    conv.target_spec.supported_ops = [tf.lite.OpsSet.TFLITE_BUILTINS_INT8]
    conv.inference_input_type = conv.inference_output_type = tf.int8
    path.write_bytes(conv.convert())
    return path


def _ort_qdq(path: Path) -> Path:
    import onnx
    from onnx import TensorProto, helper, numpy_helper
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static

    rng = np.random.default_rng(0)

    def init(name, shape):
        return numpy_helper.from_array((rng.standard_normal(shape) * 0.3).astype(np.float32), name)

    n = helper.make_node
    nodes = [n("Conv", ["x", "w1", "b1"], ["c1"], pads=[1, 1, 1, 1]), n("Relu", ["c1"], ["r1"]),
             n("MaxPool", ["r1"], ["p1"], kernel_shape=[2, 2], strides=[2, 2]),
             n("Conv", ["p1", "w2", "b2"], ["c2"], pads=[1, 1, 1, 1]), n("Relu", ["c2"], ["r2"]),
             n("Add", ["r2", "p1"], ["a"]), n("Conv", ["a", "wd", "bd"], ["d"], pads=[1, 1, 1, 1], group=8),
             n("Sigmoid", ["d"], ["sg"]), n("GlobalAveragePool", ["sg"], ["g"]), n("Flatten", ["g"], ["f"]),
             n("Gemm", ["f", "wf", "bf"], ["y"], transB=1), n("Softmax", ["y"], ["s"])]
    graph = helper.make_graph(
        nodes, "vocabulary", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
        [helper.make_tensor_value_info("s", TensorProto.FLOAT, [1, 4])],
        [init("w1", (8, 3, 3, 3)), init("b1", (8,)), init("w2", (8, 8, 3, 3)), init("b2", (8,)),
         init("wd", (8, 1, 3, 3)), init("bd", (8,)), init("wf", (4, 8)), init("bf", (4,))])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    src = path.with_name("float.onnx")
    onnx.save(model, str(src))

    class Reader(CalibrationDataReader):
        def __init__(self):
            self.it = iter([{"x": s.transpose(0, 3, 1, 2).copy()} for s in SAMPLES])

        def get_next(self):
            return next(self.it, None)

    quantize_static(str(src), str(path), Reader(), quant_format=QuantFormat.QDQ, per_channel=True,
                    activation_type=QuantType.QInt8, weight_type=QuantType.QInt8)
    return path


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("vocabulary")
    irs = {}
    for name, model in (("tflite", _tflite_int8(d / "m.tflite")), ("qdq", _ort_qdq(d / "m.onnx"))):
        out = d / f"out-{name}"
        assert irgen_main(["run", str(model), "-o", str(out), "--no-progress"]) == 0
        assert irgen_main(["verify", str(out), "--no-progress", "--no-report"]) == 0  # source check included
        irs[name] = json.loads((out / "ir.json").read_text())
    return irs


def _compute_ops(ir: dict) -> list[str]:
    """The layer ops, without the model boundary's (de)quantization and shape-only layers."""
    return [l["op"] for l in ir["layers"] if l["op"] not in ("quantize", "dequantize", "flatten", "reshape")]


def test_tflite_int8_and_ort_qdq_give_the_same_layer_ops(runs):
    expected = ["conv2d", "max_pool2d", "conv2d", "add", "depthwise_conv2d", "sigmoid", "global_avg_pool2d", "dense",
                "softmax"]
    assert _compute_ops(runs["tflite"]) == expected
    assert _compute_ops(runs["qdq"]) == expected
    # what the ORT model has besides: its float input and output, and ONNX's Flatten
    assert [l["op"] for l in runs["qdq"]["layers"] if l["op"] not in expected] == ["quantize", "flatten", "dequantize"]


def test_an_integer_table_is_named_after_its_function(runs):
    for ir in runs.values():
        (sig,) = [l for l in ir["layers"] if l["op"] == "sigmoid"]
        assert sig["quant"]["kind"] == "lut"  # the arithmetic stays a table lookup in quant


def test_bias_is_one_value_per_channel_in_both(runs):
    for name, ir in runs.items():
        biased = [l for l in ir["layers"] if "bias" in l["params"]]
        assert {l["op"] for l in biased} >= {"conv2d", "depthwise_conv2d"}, name
        for layer in biased:
            bias = layer["params"]["bias"]
            channels = layer["outputs"][0]["shape"][layer["outputs"][0]["layout"].index("C")]
            assert bias["shape"] == [channels] and bias["layout"] == "C", (name, layer["name"], bias)
            # the broadcast shape lives in fused_ops: a reshape of param:bias, then the add reads it
            first = layer["fused_ops"][0]
            assert first["relax_op"] == "relax.reshape" and first["args"][0] == "param:bias", (name, first)
            assert any("op:0" in op["args"] for op in layer["fused_ops"][1:])
