"""ONNX QOperator-format models (``quantize_static(..., quant_format=QuantFormat.QOperator)``).

The onnx frontend rewrites each QOperator node (QLinearConv, QGemm,
QLinearMatMul, com.microsoft's QLinearAdd/Mul/GlobalAveragePool/AveragePool/
Concat/Sigmoid/LeakyRelu/Softmax) and each plain op on quantized tensors
(MaxPool, Reshape, Split, Gather, ...) into its QDQ node unit
(``irgen_onnx.qoperator``), realized by the ``qdq`` scheme. ``irgen verify``'s
source check runs the original QOperator model in ONNX Runtime: every layer
names a tensor of that model and every integer layer equals it bit for bit.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")
from torch import nn  # noqa: E402

from test_qdq_transformer import Attention  # noqa: E402
from irgen_onnx.runner import inference_session  # noqa: E402  ORT's exact integer kernels on any x86
from test_verify import _assert_source_checked, _run, _verify_json  # noqa: E402


class Cnn(nn.Module):
    """Conv+ReLU, MaxPool, a residual Add, x*sigmoid(x), LeakyReLU, AvgPool, a channel Concat,
    GlobalAveragePool, Flatten and a Linear."""

    def __init__(self):
        super().__init__()
        self.c1, self.c2 = nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 8, 3, padding=1)
        self.c3, self.fc = nn.Conv2d(8, 8, 1), nn.Linear(16, 5)

    def forward(self, x):
        x = nn.functional.max_pool2d(torch.relu(self.c1(x)), 2)
        y = self.c2(x) + x
        y = y * torch.sigmoid(y)
        z = nn.functional.leaky_relu(self.c3(y), 0.1)
        z = torch.cat([z, nn.functional.avg_pool2d(y, 3, 1, 1)], dim=1)
        return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(z, 1), 1))


class Squeeze(nn.Module):
    """MobileNetV3's squeeze-excite on a float HardSwish (which QOperator leaves in float: its result
    feeds a float GlobalAveragePool and a quantized Mul), after a Pad of a quantized tensor."""

    def __init__(self):
        super().__init__()
        self.c1, self.fc1, self.fc2 = nn.Conv2d(3, 8, 3), nn.Conv2d(8, 4, 1), nn.Conv2d(4, 8, 1)

    def forward(self, x):
        h = nn.functional.hardswish(nn.functional.pad(self.c1(x), (1, 1, 1, 1)))
        s = nn.functional.hardsigmoid(self.fc2(torch.relu(self.fc1(nn.functional.adaptive_avg_pool2d(h, 1)))))
        return h * s


MODELS = {"cnn": (Cnn, (1, 3, 16, 16)), "attention": (Attention, (1, 8, 16)), "squeeze": (Squeeze, (1, 3, 10, 10))}

#: QOperator ops each model must hold (so the test covers them)
EXPECTED = {
    "cnn": {"QLinearConv", "MaxPool", "QLinearAdd", "QLinearSigmoid", "QLinearMul", "QLinearLeakyRelu",
            "QLinearAveragePool", "QLinearConcat", "QLinearGlobalAveragePool", "QGemm"},
    "attention": {"QLinearMatMul", "QLinearSoftmax", "QLinearAdd", "QLinearConcat"},
    "squeeze": {"Pad", "HardSwish", "GlobalAveragePool", "QLinearMul"},
}


def _sample(shape, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def quantized(name: str, per_channel: bool, folder: Path) -> tuple[Path, np.ndarray]:
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, quantize_static

    cls, shape = MODELS[name]
    torch.manual_seed(0)
    src = folder / f"{name}.onnx"
    x = _sample(shape, 99)
    torch.onnx.export(cls().eval(), (torch.from_numpy(x),), str(src), dynamo=False, opset_version=17,
                      input_names=["x"], output_names=["y"])

    class Reader(CalibrationDataReader):
        def __init__(self):
            self.it = iter([{"x": _sample(shape, k)} for k in range(4)])

        def get_next(self):
            return next(self.it, None)

    out = folder / f"{name}_{'pc' if per_channel else 'default'}.qop.onnx"
    quantize_static(str(src), str(out), Reader(), quant_format=QuantFormat.QOperator, per_channel=per_channel)
    return out, x


@pytest.mark.parametrize("name,per_channel", [  # each model once by default; the other weight setting is slow
    ("attention", False), pytest.param("attention", True, marks=pytest.mark.slow),
    pytest.param("cnn", False, marks=pytest.mark.slow), ("cnn", True), ("squeeze", False)])
def test_qoperator_against_onnxruntime(name, per_channel, tmp_path, capsys):
    path, x = quantized(name, per_channel, tmp_path)
    ops = {n.op_type for n in onnx.load(str(path)).graph.node}
    assert EXPECTED[name] <= ops, EXPECTED[name] - ops
    np.save(tmp_path / "x.npy", x)
    out = tmp_path / "out"
    _run(path, "-o", out, "--input", f"x={tmp_path / 'x.npy'}")
    ir = json.loads((out / "ir.json").read_text())
    assert ir["producer"]["quantizer"] == "qdq"
    code, r = _verify_json(capsys, out)
    assert code == 0, r["problems"]
    # every layer compared with the original QOperator model in onnxruntime; integer layers bit for bit
    assert _assert_source_checked(r, ir, integer_exact=True) == len(ir["layers"])
    assert sum(row["integer"] for row in r["layers"]) >= 5
    for row in r["layers"]:
        if row["integer"]:
            for mode in ("single", "entire"):
                assert row["checks"][mode]["max_lsb"] == 0, (row["name"], mode, row["checks"][mode])
    # the model output equals ONNX Runtime's on the original model (the CNN's: a dequantized integer
    # output, exactly; the attention's: LayerNorm's float output, within float rounding)
    y = inference_session(path.read_bytes(), quantized=True, int8_kernels=False).run(None, {"x": x})[0]
    got = np.load(out / ir["outputs"][0]["file"])
    if name != "attention":
        np.testing.assert_array_equal(got, y)
    else:
        np.testing.assert_allclose(got, y, rtol=1e-5, atol=1e-6)
    kinds = {(layer["quant"] or {}).get("kind") for layer in ir["layers"]}
    if name == "attention":
        assert {"matmul", "softmax"} <= kinds, kinds
    if name == "squeeze":  # the float pool's result quantized as ORT's QuantizeLinear does
        assert "quantize" in kinds and any(not row["integer"] and "pool" in row["op"] for row in r["layers"]), kinds


def test_rewrite_keeps_names_and_ort_results(tmp_path):
    """The QDQ form runs in onnxruntime to the same integers as the QOperator model, tensor
    for tensor, under the original output names."""
    from irgen_onnx.qoperator import to_qdq

    path, x = quantized("cnn", True, tmp_path)
    model = onnx.load(str(path))
    names = [o for n in model.graph.node if n.op_type != "Constant" for o in n.output]

    def run(m):
        m = onnx.ModelProto.FromString(m.SerializeToString())
        have = {o.name for o in m.graph.output}
        m.graph.output.extend(onnx.ValueInfoProto(name=t) for t in names if t not in have)
        s = inference_session(m.SerializeToString(), quantized=True)
        return dict(zip([o.name for o in s.get_outputs()], s.run(None, {"x": x})))

    before = run(model)
    rewritten = to_qdq(onnx.ModelProto.FromString(model.SerializeToString()))
    assert not {n.op_type for n in rewritten.graph.node} & {"QLinearConv", "QGemm", "QLinearAdd"}
    after = run(rewritten)
    for t in names:
        np.testing.assert_array_equal(after[t], before[t], err_msg=t)
