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
* the same for 3-D convolutions (MLAS's vol2col: input channel, kernel depth, row, column), recomputed
  by ``irgen.reference.conv3d_fma_blocked``: R(2+1)D's 1x3x3 and 3x1x1 kernels, a strided 3x3x3
  window, K slices of 128 to 512, dilation and groups; a QDQ model of 3-D convolutions sharing
  one bias (float spans) equals onnxruntime on every value;
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
from irgen.reference import conv2d_fma_blocked, conv3d_fma_blocked  # noqa: E402
from irgen_qdq.mlas import k_block  # noqa: E402

#: (input channels, filters, size, kernel, stride, padding, dilation, groups): K slices of 128
#: (many positions), 256, 512 and 1024 (few positions), a strided and a dilated window, groups
SHAPES = [(16, 24, 20, 3, 1, 1, 1, 1), (512, 64, 7, 3, 1, 1, 1, 1), (256, 32, 5, 3, 1, 1, 1, 1),
          (1024, 8, 3, 3, 1, 1, 1, 1), (64, 48, 15, 3, 2, 1, 1, 1), (32, 16, 12, 3, 1, 2, 2, 1),
          (64, 64, 9, 3, 1, 1, 1, 4), (300, 40, 6, 1, 1, 0, 1, 1)]


def _ort_conv(x: np.ndarray, w: np.ndarray, stride, pad, dilation, groups: int) -> np.ndarray:
    """ONNX Runtime's float Conv, one thread (an int attribute: the same on each spatial axis)."""
    nd = x.ndim - 2
    stride, pad, dilation = ([v] * nd if isinstance(v, int) else list(v) for v in (stride, pad, dilation))
    node = helper.make_node("Conv", ["x", "w"], ["y"], pads=pad * 2, strides=stride, dilations=dilation, group=groups)
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



#: 3-D: (input channels, filters, (depth, height, width), kernel, stride, padding, dilation, groups):
#: a strided 3x3x3 window (K slice 256: few positions), R(2+1)D's 1x3x3 and 3x1x1 kernels (128),
#: K of 1728 in slices of 128 and of 3456 in slices of 512, dilations with groups, a strided 1x1x1
SHAPES_3D = [(8, 16, (4, 10, 10), (3, 3, 3), (2, 2, 2), (1, 1, 1), (1, 1, 1), 1),
             (16, 24, (4, 12, 12), (1, 3, 3), (1, 1, 1), (0, 1, 1), (1, 1, 1), 1),
             (24, 16, (6, 8, 8), (3, 1, 1), (1, 1, 1), (1, 0, 0), (1, 1, 1), 1),
             (64, 32, (4, 6, 6), (3, 3, 3), (1, 1, 1), (1, 1, 1), (1, 1, 1), 1),
             (128, 16, (2, 4, 4), (3, 3, 3), (1, 1, 1), (1, 1, 1), (1, 1, 1), 1),
             (16, 16, (5, 7, 7), (3, 3, 3), (1, 2, 1), (2, 1, 2), (2, 1, 2), 2),
             (32, 16, (4, 8, 8), (1, 1, 1), (2, 2, 2), (0, 0, 0), (1, 1, 1), 1)]


def _id_3d(s) -> str:
    return "c{}-m{}-{}x{}x{}-k{}x{}x{}-s{}{}{}-p{}{}{}-d{}{}{}-g{}".format(s[0], s[1], *s[2], *s[3], *s[4], *s[5], *s[6], s[7])


@pytest.mark.parametrize("shape", SHAPES_3D, ids=_id_3d)
def test_the_declared_3d_order_is_onnxruntimes_float_conv(shape):
    c, m, size, kernel, stride, pad, dilation, groups = shape
    rng = np.random.default_rng(c + m)
    x = rng.standard_normal((1, c, *size)).astype(np.float32)
    w = (rng.standard_normal((m, c // groups, *kernel)) * 0.1).astype(np.float32)
    y = _ort_conv(x, w, stride, pad, dilation, groups)
    positions, k = int(np.prod(y.shape[2:])), c // groups * int(np.prod(kernel))
    attrs = {"strides": list(stride), "padding": list(pad) * 2, "dilation": list(dilation), "groups": groups,
             "accumulation": {"order": "im2col", "fma": True, "k_block": k_block(positions, k)}}
    np.testing.assert_array_equal(conv3d_fma_blocked(x, w, attrs), y)


def _conv3d_qdq(folder: Path) -> tuple[Path, Path]:
    """3-D convolutions (a strided 3x3x3, R(2+1)D's 1x3x3 and 3x1x1, a 3x3x3 of K 864) sharing one
    bias initializer, quantized by ``quantize_static``: the bias is quantized once, with its first
    reader's scale, so ONNX Runtime runs the others' node units in float (MlasConv's vol2col)."""
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static

    rng = np.random.default_rng(3)
    convs = [((3, 3, 3), (2, 2, 2), (1, 1, 1)), ((1, 3, 3), (1, 1, 1), (0, 1, 1)),
             ((3, 1, 1), (1, 1, 1), (1, 0, 0)), ((3, 3, 3), (1, 1, 1), (1, 1, 1))]
    # a bias of 4 keeps the activations near 4 and the weights of each filter sum to zero: the sums
    # cancel, so their float32 rounding reaches the quantized outputs (else a float64 sum is as good)
    inits, nodes, src = [numpy_helper.from_array((4 + rng.standard_normal(32) * 0.1).astype(np.float32), "b")], [], "x"
    for i, (kernel, stride, pad) in enumerate(convs):
        c = 3 if i == 0 else 32
        w = rng.standard_normal((32, c, *kernel)) * 0.2
        w -= w.mean(axis=tuple(range(1, 5)), keepdims=True)
        inits.append(numpy_helper.from_array(w.astype(np.float32), f"w{i}"))
        nodes += [helper.make_node("Conv", [src, f"w{i}", "b"], [f"c{i}"], kernel_shape=list(kernel),
                                   strides=list(stride), pads=list(pad) * 2),
                  helper.make_node("Relu", [f"c{i}"], [f"r{i}"])]
        src = f"r{i}"
    shape = (1, 3, 8, 32, 32)
    graph = helper.make_graph(nodes, "conv3d", [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
                              [helper.make_tensor_value_info(src, TensorProto.FLOAT, None)], inits)
    src_path, out = folder / "conv3d.onnx", folder / "conv3d_qdq.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), src_path)

    class Reader(CalibrationDataReader):
        def __init__(self):
            self.it = iter([{"x": np.random.default_rng(k).standard_normal(shape).astype(np.float32)} for k in range(4)])

        def get_next(self):
            return next(self.it, None)

    quantize_static(str(src_path), str(out), Reader(), quant_format=QuantFormat.QDQ,
                    activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8)
    np.save(folder / "x.npy", rng.standard_normal(shape).astype(np.float32))
    return out, folder / "x.npy"


def test_3d_float_spans_equal_onnxruntime_everywhere(tmp_path, capsys):
    model, x = _conv3d_qdq(tmp_path)
    ir = _every_value_equals_onnxruntime(model, x, tmp_path / "out", capsys)
    spans = [layer for layer in ir["layers"] if (layer.get("quant") or {}).get("realization") == "float"]
    convs = [op for layer in spans for op in layer["quant"]["program"] if op.get("relax_op") == "relax.nn.conv3d"]
    assert len(convs) == 3, "the shared bias no longer makes float spans: the case tests nothing"
    assert all(op["attrs"]["accumulation"]["fma"] for op in convs)

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
