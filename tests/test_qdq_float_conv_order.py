"""Convolutions ONNX Runtime runs in float inside a QDQ model, to the last bit (issue 38).

torchvision's ResNets at their default initialization fold every batch norm into a zero
bias; the exporter shares one zero initializer between the convolutions and
``quantize_static`` quantizes it once, with its first reader's scale. ONNX Runtime then
cannot run those node units as integer kernels and runs ``DequantizeLinear -> Conv ->
QuantizeLinear`` in float (MLAS: im2col, SGEMM's fused multiply-adds in K slices). irgen
computed those convolutions in float64: ResNet-50 at 224x224 was 88.7% equal to the runtime.
Now the float span's convolution takes MLAS's order (``irgen_qdq.mlas``), recorded as
``accumulation`` and recomputed by ``irgen.reference.conv2d_fma_blocked``.

* the numpy reference of that order equals ONNX Runtime's float ``Conv`` bit for bit, over the
  shapes that choose each K slice length (128 to 1024), strides, padding, dilation and groups;
* a torchvision ResNet-18 (32x32) at its default initialization, quantized by ``quantize_static``,
  equals onnxruntime on every value of every layer, with its float spans (slow: ResNet-50 at
  224x224, per tensor and per channel, and a 640x640 input).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

from irgen.cli import main as irgen_main  # noqa: E402
from irgen.reference import conv2d_fma_blocked  # noqa: E402
from irgen_qdq.mlas import k_block  # noqa: E402

#: (input channels, filters, size, kernel, stride, padding, dilation, groups): K slices of 128
#: (many positions), 256, 512 and 1024 (few positions), a strided and a dilated window, groups
SHAPES = [(16, 24, 20, 3, 1, 1, 1, 1), (512, 64, 7, 3, 1, 1, 1, 1), (256, 32, 5, 3, 1, 1, 1, 1),
          (1024, 8, 3, 3, 1, 1, 1, 1), (64, 48, 15, 3, 2, 1, 1, 1), (32, 16, 12, 3, 1, 2, 2, 1),
          (64, 64, 9, 3, 1, 1, 1, 4), (300, 40, 6, 1, 1, 0, 1, 1)]


def _ort_conv(x: np.ndarray, w: np.ndarray, stride: int, pad: int, dilation: int, groups: int) -> np.ndarray:
    node = helper.make_node("Conv", ["x", "w"], ["y"], pads=[pad] * 4, strides=[stride] * 2,
                            dilations=[dilation] * 2, group=groups)
    graph = helper.make_graph([node], "conv", [helper.make_tensor_value_info("x", TensorProto.FLOAT, x.shape)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                              [numpy_helper.from_array(w, "w")])
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL  # MLAS's NCHW convolution
    so.intra_op_num_threads = 1  # as verify runs it: with threads, MLAS slices few positions otherwise
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()
    return ort.InferenceSession(model, so, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "c{}-m{}-h{}-k{}-s{}-p{}-d{}-g{}".format(*s))
def test_the_declared_order_is_onnxruntimes_float_conv(shape):
    c, m, size, k, stride, pad, dilation, groups = shape
    rng = np.random.default_rng(sum(shape))
    x = rng.standard_normal((1, c, size, size)).astype(np.float32)
    w = (rng.standard_normal((m, c // groups, k, k)) * 0.1).astype(np.float32)
    y = _ort_conv(x, w, stride, pad, dilation, groups)
    positions = y.shape[2] * y.shape[3]
    attrs = {"strides": [stride] * 2, "padding": [pad] * 4, "dilation": [dilation] * 2, "groups": groups,
             "accumulation": {"order": "im2col", "fma": True, "k_block": k_block(positions, c // groups * k * k)}}
    got = conv2d_fma_blocked(x, w, attrs)
    np.testing.assert_array_equal(got, y)


def _torchvision_qdq(name: str, size: int, per_channel: bool, folder: Path, bn: str = "default") -> tuple[Path, Path]:
    """torchvision's ``name`` at its default initialization (seeded; ``bn="random"``: its batch
    norms randomized, so no bias is zero), exported and quantized by ``quantize_static`` (uint8
    activations, int8 weights, 4 random calibration samples)."""
    import torch
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static

    import zoo

    torchvision = zoo.import_torchvision()
    torch.manual_seed(0)
    model = getattr(torchvision.models, name)(weights=None).eval()
    if bn == "random":
        zoo._randomize_bn(model)
    shape = (1, 3, size, size)
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(1))
    src = folder / f"{name}.onnx"
    torch.onnx.export(model, (x,), str(src), dynamo=False, opset_version=17, input_names=["x"], output_names=["y"])

    class Reader(CalibrationDataReader):
        def __init__(self):
            self.it = iter([{"x": np.random.default_rng(k).standard_normal(shape).astype(np.float32)} for k in range(4)])

        def get_next(self):
            return next(self.it, None)

    out = folder / f"{name}_{size}_{'pc' if per_channel else 'pt'}.onnx"
    quantize_static(str(src), str(out), Reader(), quant_format=QuantFormat.QDQ, per_channel=per_channel,
                    activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8)
    np.save(folder / "x.npy", x.numpy())
    return out, folder / "x.npy"


def _every_value_equals_onnxruntime(model: Path, x: Path, out: Path, capsys) -> dict:
    assert irgen_main(["run", str(model), "-o", str(out), "--input", str(x), "--no-progress"]) == 0
    ir = json.loads((out / "ir.json").read_text())
    capsys.readouterr()
    code = irgen_main(["verify", str(out), "--json", "--no-report", "--no-progress"])
    result = json.loads(capsys.readouterr().out)
    assert code == 0 and result["passed"], result["problems"]
    for row in result["layers"]:
        src = row["checks"]["source"]
        assert src is not None and src["exact"], (row["name"], src)
        assert src["end_to_end"]["exact_share"] == 1.0, (row["name"], src["end_to_end"])  # no drift either
    return ir


#: per channel at the default initialization, ``quantize_static`` writes two DequantizeLinear
#: nodes of one name for the shared zero bias, which onnxruntime refuses too: per channel is
#: checked with randomized batch norms (every node unit an integer kernel)
CASES = [pytest.param("resnet18", 32, False, "default", id="resnet18-32-per_tensor"),
         pytest.param("resnet50", 224, False, "default", id="resnet50-224-per_tensor", marks=pytest.mark.slow),
         pytest.param("resnet50", 224, True, "random", id="resnet50-224-per_channel-bn", marks=pytest.mark.slow),
         pytest.param("resnet18", 640, False, "default", id="resnet18-640-per_tensor", marks=pytest.mark.slow)]


@pytest.mark.parametrize("name,size,per_channel,bn", CASES)
def test_a_torchvision_resnet_equals_onnxruntime_everywhere(name, size, per_channel, bn, tmp_path, capsys):
    model, x = _torchvision_qdq(name, size, per_channel, tmp_path, bn)
    ir = _every_value_equals_onnxruntime(model, x, tmp_path / "out", capsys)
    if bn == "random":
        return
    spans = [layer for layer in ir["layers"] if (layer.get("quant") or {}).get("realization") == "float"]
    assert spans, "no float span: the case no longer tests ONNX Runtime's float convolutions"
    convs = [op for layer in spans for op in layer["quant"]["program"] if op.get("relax_op") == "relax.nn.conv2d"]
    assert convs and all(op["attrs"]["accumulation"]["fma"] for op in convs)
