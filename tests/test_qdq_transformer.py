"""qdq: transformer blocks quantized by ``quantize_static``, bit-exact with ONNX Runtime.

Small torch modules reproduce the int8 transformer patterns of timm's ViT and
transformers' BERT; each is exported to ONNX (opset 17), quantized by
``quantize_static`` (QDQ, default options and ``per_channel=True``), then
``irgen run`` and ``irgen verify`` (single, entire and the source check against
onnxruntime with ``session.qdqisint8allowed=1``) must pass with every integer
layer equal to ONNX Runtime's tensor:

* ``attention`` (ViT): the class token (a constant quantized at run time: a
  literal operand of QLinearConcat), position embeddings, qkv Linear, Reshape/Transpose, a ``Split`` with three
  quantized outputs (integer slices), Squeeze, ``scaled_dot_product_attention``
  (its ``sqrt(1/sqrt(d))`` scale computed from a shape and quantized: QLinearMul
  with a constant), Q·Kᵀ and A·V (QLinearMatMul of two activations, kind
  ``matmul``), QLinearSoftmax, LayerNorm (a float layer), the class token picked
  by a Gather;
* ``embedding`` (BERT): token ids gathering rows of a quantized embedding table
  (an integer gather), position rows gathered by constant indices (folded: the
  add records them as a literal), explicit ``q @ k.transpose`` attention.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("onnxruntime")
from torch import nn  # noqa: E402

from irgen_onnx.runner import inference_session  # noqa: E402  ORT's exact integer kernels on any x86
from test_verify import _assert_source_checked, _run, _verify_json  # noqa: E402


class Attention(nn.Module):
    """ViT: a class token before 8 patch tokens, position embeddings, one attention block
    (2 heads) on the 9 tokens, then the class token's LayerNorm."""

    def __init__(self):
        super().__init__()
        self.cls, self.pos = nn.Parameter(torch.randn(1, 1, 16) * 0.02), nn.Parameter(torch.randn(1, 9, 16) * 0.1)
        self.qkv, self.proj, self.norm = nn.Linear(16, 48), nn.Linear(16, 16), nn.LayerNorm(16)

    def forward(self, x):
        x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], dim=1) + self.pos
        q, k, v = self.qkv(x).reshape(1, 9, 3, 2, 8).permute(2, 0, 3, 1, 4).unbind(0)
        a = nn.functional.scaled_dot_product_attention(q, k, v)
        x = x + self.proj(a.transpose(1, 2).reshape(1, 9, 16))
        return self.norm(x)[:, 0]


class Embedding(nn.Module):
    """BERT's embeddings (token and position rows added) and one attention head written out."""

    def __init__(self):
        super().__init__()
        self.words, self.pos = nn.Embedding(32, 16), nn.Embedding(8, 16)
        self.norm, self.q, self.k, self.v = nn.LayerNorm(16), nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, ids):
        h = self.norm(self.words(ids) + self.pos(torch.arange(8).unsqueeze(0)))
        s = self.q(h) @ self.k(h).transpose(-1, -2) * 0.25
        return torch.softmax(s, dim=-1) @ self.v(h)


MODELS = {"attention": (Attention, "x", (1, 8, 16)), "embedding": (Embedding, "ids", (1, 8))}


def _sample(name: str, shape, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.integers(0, 32, shape).astype(np.int64) if name == "ids" else rng.standard_normal(shape).astype(np.float32)


def quantized(name: str, per_channel: bool, folder: Path) -> tuple[Path, np.ndarray]:
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, quantize_static

    cls, input_name, shape = MODELS[name]
    torch.manual_seed(0)
    model = cls().eval()
    src = folder / f"{name}.onnx"
    x = _sample(input_name, shape, 99)
    torch.onnx.export(model, (torch.from_numpy(x),), str(src), dynamo=False, opset_version=17,
                      input_names=[input_name], output_names=["y"])

    class Reader(CalibrationDataReader):
        def __init__(self):
            self.it = iter([{input_name: _sample(input_name, shape, k)} for k in range(4)])

        def get_next(self):
            return next(self.it, None)

    out = folder / f"{name}_{'pc' if per_channel else 'default'}.onnx"
    quantize_static(str(src), str(out), Reader(), quant_format=QuantFormat.QDQ, per_channel=per_channel)
    return out, x


def _golden_vs_ort(model: Path, out: Path, ir: dict, x: np.ndarray, input_name: str) -> None:
    """The model output irgen wrote equals ONNX Runtime's (the integers before the last dequantize)."""
    y = inference_session(model.read_bytes(), quantized=True).run(None, {input_name: x})[0]
    rec = ir["outputs"][0]
    got = np.load(out / rec["file"])
    np.testing.assert_array_equal(got, y)


# each model once by default (the attention per tensor, the embedding per channel); the rest is slow
@pytest.mark.parametrize("name,per_channel", [
    pytest.param(n, pc, id=f"{n}-{'per_channel' if pc else 'default'}",
                 marks=[] if (n, pc) in {("attention", False), ("embedding", True)} else [pytest.mark.slow])
    for n in sorted(MODELS) for pc in (False, True)])
def test_transformer_against_onnxruntime(name, per_channel, tmp_path, capsys):
    path, x = quantized(name, per_channel, tmp_path)
    input_name = MODELS[name][1]
    np.save(tmp_path / "x.npy", x)
    out = tmp_path / "out"
    _run(path, "-o", out, "--input", f"{input_name}={tmp_path / 'x.npy'}")
    ir = json.loads((out / "ir.json").read_text())
    assert ir["producer"]["quantizer"] == "qdq"
    code, r = _verify_json(capsys, out)
    assert code == 0, r["problems"]
    # every layer compared with onnxruntime; integer layers bit for bit
    assert _assert_source_checked(r, ir, integer_exact=True) == len(ir["layers"])
    for row in r["layers"]:
        if row["integer"]:
            for mode in ("single", "entire"):
                assert row["checks"][mode]["max_lsb"] == 0, (row["name"], mode, row["checks"][mode])
    _golden_vs_ort(path, out, ir, x, input_name)
    quant = [layer["quant"] or {} for layer in ir["layers"]]
    kinds = {q.get("kind") for q in quant}
    assert {"matmul", "softmax", "float"} <= kinds, kinds
    matmuls = [q for q in quant if q.get("kind") == "matmul"]
    assert len(matmuls) == 2 and all(len(q["inputs"]) == 2 for q in matmuls)
    assert any("layer_norm" in q.get("op", "") for q in quant if q.get("realization") == "float")
    if name == "attention":  # q, k, v: three integer slices of one tensor; the class token: a gather
        assert sum(q.get("op") == "strided_slice" for q in quant) == 3, [q.get("op") for q in quant]
        assert any(q.get("op") == "take" for q in quant)
        # the class token is a constant quantized at run time: a literal operand of the concatenation
        assert any(q.get("kind") == "concatenate" and q.get("constants") for q in quant), kinds
    else:  # the token ids gather integer rows; the position rows are a literal operand of the add
        gather = [q for q in quant if q.get("op") == "take" and not q["inputs"]]
        assert len(gather) == 1 and gather[0]["table"]["dtype"] == gather[0]["output"]["dtype"]
        assert any(q.get("kind") == "add" and q.get("constants") for q in quant)


def _softmax_against_onnxruntime(tmp_path, capsys, x: np.ndarray, axis: int, sx, zx, sy, zy) -> None:
    """DequantizeLinear -> Softmax -> QuantizeLinear on ``x`` (int8 or uint8) through irgen:
    one softmax layer, its golden output equal to onnxruntime's, and verify passes."""
    onnx = pytest.importorskip("onnx")
    from onnx import helper, numpy_helper

    np_t = x.dtype.type
    t = helper.np_dtype_to_tensor_dtype(x.dtype)
    inits = [numpy_helper.from_array(np.float32(sx), "sx"), numpy_helper.from_array(np_t(zx), "zx"),
             numpy_helper.from_array(np.float32(sy), "sy"), numpy_helper.from_array(np_t(zy), "zy")]
    nodes = [helper.make_node("DequantizeLinear", ["x", "sx", "zx"], ["d"]),
             helper.make_node("Softmax", ["d"], ["s"], axis=axis), helper.make_node("QuantizeLinear", ["s", "sy", "zy"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", t, list(x.shape))],
                              [helper.make_tensor_value_info("y", t, list(x.shape))], inits)
    path = tmp_path / "softmax.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]), str(path))
    np.save(tmp_path / "x.npy", x)
    out = tmp_path / "out"
    _run(path, "-o", out, "--input", tmp_path / "x.npy")
    ir = json.loads((out / "ir.json").read_text())
    assert [la["quant"]["kind"] for la in ir["layers"]] == ["softmax"]
    want = inference_session(path.read_bytes(), quantized=True).run(None, {"x": x})[0]
    np.testing.assert_array_equal(np.load(out / ir["outputs"][0]["file"]), want)
    code, result = _verify_json(capsys, out)
    assert code == 0 and result["passed"], result["problems"]


@pytest.mark.parametrize("n, axis", [(1, -1), (2, -1), (16, -1), (16, 1)])
def test_softmax_over_few_elements_equals_onnxruntime(n, axis, tmp_path, capsys):
    """QLinearSoftmax over an axis of 1 (MobileViT's attention over one patch): its table
    entry is FLT_MAX / e^5, so the float32 product e * floor(1 / s_y) overflowed and irgen
    wrote -1 where ONNX Runtime gives floor(1 / s_y) + zp (126 here); 2 and 16 elements as
    before. Over another axis than the last (CoaT's factorized attention: axis 1 here) ORT
    moves it last and back; irgen refused it."""
    shape = [4, n] if axis == -1 else [2, n, 3]
    x = np.random.default_rng(n).integers(-60, 60, shape).astype(np.int8)
    _softmax_against_onnxruntime(tmp_path, capsys, x, axis, 1.4151e-4 if axis == -1 else 0.05, -3, 1 / 255, -128)


@pytest.mark.parametrize("dtype", ["int8", "uint8"])
@pytest.mark.parametrize("n", [5, 17])
def test_softmax_with_a_calibrated_output_scale_equals_onnxruntime(dtype, n, tmp_path, capsys):
    """``quantize_static(op_types_to_quantize=["MatMul"])`` calibrates a softmax's output scale as
    the next MatMul's input (2.4e-4 on ViT, not 1/256). ONNX Runtime still fuses QLinearSoftmax;
    irgen's float32 product ``e * floor(1 / s_y)`` overflowed to inf and its int8 results wrapped
    (127 LSB off), where ORT's quotient is finite and saturates."""
    from irgen_qdq.ort import ort_softmax_table

    signed = dtype == "int8"
    sx, sy = 3.36356e-4, 2.4029499e-4
    with np.errstate(over="ignore"):  # the case: the float32 product overflows
        assert np.isinf(ort_softmax_table(sx, n, signed).max() * np.float32(np.floor(1 / np.float32(sy))))
    lo, hi = (-128, 128) if signed else (0, 256)
    x = np.random.default_rng(n).integers(lo, hi, [8, n]).astype(dtype)
    _softmax_against_onnxruntime(tmp_path, capsys, x, -1, sx, 15 if signed else 140, sy, -128 if signed else 0)


def test_pool_token_mixer_recomputes_from_its_fused_ops(tmp_path, capsys):
    """PoolFormer / EfficientFormer's token mixer: a QDQ AveragePool 3x3, stride 1, pads 1,
    count_include_pad=0. The golden data equalled onnxruntime's, but verify's single check
    recomputed the layer's fused_ops with a float64 window sum and flipped ~0.1% of the
    roundings ("fused_ops and the quant record compute different values"); the numpy
    reference now sums a float window in float32, row by row, as the kernel does."""
    onnx = pytest.importorskip("onnx")
    from onnx import TensorProto, helper, numpy_helper

    inits = [numpy_helper.from_array(np.float32(0.00846), "s"), numpy_helper.from_array(np.int8(-128), "z")]
    nodes = [helper.make_node("DequantizeLinear", ["x", "s", "z"], ["d"]),
             helper.make_node("AveragePool", ["d"], ["p"], kernel_shape=[3, 3], strides=[1, 1], pads=[1, 1, 1, 1],
                              count_include_pad=0),
             helper.make_node("QuantizeLinear", ["p", "s", "z"], ["y"])]
    shape = [1, 16, 32, 32]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.INT8, shape)],
                              [helper.make_tensor_value_info("y", TensorProto.INT8, shape)], inits)
    path = tmp_path / "pool.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]), str(path))
    x = np.random.default_rng(3).integers(-128, 128, shape).astype(np.int8)
    np.save(tmp_path / "x.npy", x)
    out = tmp_path / "out"
    _run(path, "-o", out, "--input", tmp_path / "x.npy")
    ir = json.loads((out / "ir.json").read_text())
    assert [(la["op"], la["quant"]["kind"]) for la in ir["layers"]] == [("avg_pool2d", "avg_pool2d")]
    want = inference_session(path.read_bytes(), quantized=True).run(None, {"x": x})[0]
    np.testing.assert_array_equal(np.load(out / ir["outputs"][0]["file"]), want)
    code, result = _verify_json(capsys, out)
    assert code == 0 and result["passed"], result["problems"]
