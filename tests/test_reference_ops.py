"""The numpy reference of verify (``irgen.reference.OPS``) on the ops transformers,
upsampling heads and detection necks bring, and the layers they form.

* ``test_op_matches_tvm``: each op, built as a one-op Relax function, compiled by
  TVM (its legalization, the kernels irgen's golden data come from) and run;
  the reference, given the attributes as ``ir.json`` records them
  (``graph.attrs_to_dict``, ``ir._arg_ref``), must agree within float rounding
  (integers and booleans exactly).
* ``test_model``: small torch modules with the op pattern, exported as ONNX
  (torchscript exporter, opset 17) and as ``.pt2``: ``irgen run`` (the session's
  conftest then runs ``verify`` single + entire, failing on ``unsupported``),
  then ``verify`` with the source check run, and every layer's golden output
  against ONNX Runtime / torch; the layer op names are the hardware names.
* ``test_transformer_encoder``: a 2-layer encoder (embedding gather, LayerNorm,
  q/k/v matmuls + softmax, GELU MLP, residuals) as ONNX and ``.pt2``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from layercheck import assert_layers_match  # noqa: E402

torch = pytest.importorskip("torch")
tvm = pytest.importorskip("tvm")
from torch import nn  # noqa: E402
from torch.nn import functional as F  # noqa: E402
from tvm import relax  # noqa: E402

from irgen import reference  # noqa: E402
from irgen.cli import main as irgen_main  # noqa: E402
from irgen.graph import attrs_to_dict  # noqa: E402
from irgen.ir import _arg_ref, op_args  # noqa: E402
from irgen.verify import format_table, verify_output  # noqa: E402

R = np.random.default_rng(0)


def _f(*shape, lo=None):
    a = R.standard_normal(shape).astype("float32")
    return np.abs(a) + lo if lo is not None else a


# ---------------------------------------------------------------- one op against TVM


def run_tvm(make, inputs: list[np.ndarray]):
    """``make(*vars) -> relax.Call`` as the only binding of ``main``: (call, TVM's result as numpy)."""
    bb = relax.BlockBuilder()
    params = [relax.Var(f"x{i}", relax.TensorType(a.shape, str(a.dtype))) for i, a in enumerate(inputs)]
    with bb.function("main", params):
        with bb.dataflow():
            out = bb.emit_output(bb.emit(make(*params)))
        bb.emit_func_output(out)
    mod = bb.get()
    call = mod["main"].body.blocks[0].bindings[0].value
    ex = tvm.compile(relax.transform.LegalizeOps()(mod), target="llvm")
    y = relax.VirtualMachine(ex, tvm.cpu())["main"](*[tvm.runtime.tensor(a) for a in inputs])
    ys = [t.numpy() for t in y] if isinstance(y, (list, tuple)) or hasattr(y, "__len__") and not hasattr(y, "numpy") else [y.numpy()]
    return call, ys


def _args(call: relax.Call, inputs: list[np.ndarray]) -> list:
    """The call's arguments as the reference receives them from an ir.json record."""
    refs = {f"x{i}": f"input:{i}" for i in range(len(inputs))}
    return [reference._resolve(_arg_ref(a, refs, []), "l", "op", inputs, {}, []) for a in op_args(call)]


op = relax.op
nn_ = relax.op.nn
img = relax.op.image
c = relax.const
nan_in = np.array([[0.0, np.nan, 1.5, -np.inf], [np.inf, -2.0, np.nan, 3.0]], "float32")

OP_CASES = {
    # transformers
    "layer_norm": (lambda x, g, b: nn_.layer_norm(x, g, b, axes=[-1], epsilon=1e-3), [_f(2, 5, 16), _f(16), _f(16)]),
    "gelu": (lambda x: nn_.gelu(x), [_f(4, 33) * 3]),
    "gelu_tanh": (lambda x: nn_.gelu_tanh(x), [_f(4, 33) * 3]),
    "silu": (lambda x: nn_.silu(x), [_f(4, 33) * 3]),
    "erf": (lambda x: op.erf(x), [_f(4, 33)]),
    "softmax4d": (lambda x: nn_.softmax(x, axis=-1), [_f(1, 2, 5, 8) * 4]),
    "log_softmax": (lambda x: nn_.log_softmax(x, axis=1), [_f(3, 7)]),
    "rms_norm": (lambda x, w: nn_.rms_norm(x, w, axes=[-1], epsilon=1e-6), [_f(2, 5, 16), _f(16)]),
    "group_norm": (lambda x, g, b: nn_.group_norm(x, g, b, num_groups=2, channel_axis=1, axes=[2, 3]),
                   [_f(2, 4, 3, 5), _f(4), _f(4)]),
    "instance_norm": (lambda x, g, b: nn_.instance_norm(x, g, b, channel_axis=1, axes=[2, 3]),
                      [_f(2, 4, 3, 5), _f(4), _f(4)]),
    "attention": (lambda q, k, v: nn_.attention(q, k, v), [_f(1, 5, 2, 8), _f(1, 6, 2, 8), _f(1, 6, 2, 4)]),
    "attention_scale_causal": (lambda q, k, v: nn_.attention(q, k, v, scale=0.3, causal_mask="TopLeft"),
                               [_f(2, 5, 2, 8), _f(2, 5, 2, 8), _f(2, 5, 2, 8)]),
    "attention_bottom_right": (lambda q, k, v: nn_.attention(q, k, v, causal_mask="BottomRight"),
                               [_f(1, 4, 2, 8), _f(1, 6, 2, 8), _f(1, 6, 2, 8)]),
    "attention_bias": (lambda q, k, v, b: nn_.attention(q, k, v, b),
                       [_f(1, 5, 2, 8), _f(1, 5, 2, 8), _f(1, 5, 2, 8), _f(1, 2, 5, 5)]),
    "matmul_batched": (lambda a, b: op.matmul(a, b), [_f(2, 3, 5, 8), _f(2, 3, 8, 4)]),
    "take": (lambda t, i: op.take(t, i, axis=0), [_f(10, 8), R.integers(0, 10, (2, 5)).astype("int64")]),
    "split_sections": (lambda x: op.split(x, 3, axis=2), [_f(1, 2, 7)]),
    "split_indices": (lambda x: op.split(x, [2, 5], axis=-1), [_f(1, 2, 9)]),
    "strided_slice": (lambda x: op.strided_slice(x, [1, 2], [1, 0], [4, 16], [1, 3]), [_f(2, 5, 16)]),
    "dynamic_strided_slice": (lambda x, b, e, s: op.dynamic_strided_slice(x, b, e, s),
                              [_f(2, 5, 16), np.array([0, 1, 2], "int64"), np.array([2, 5, 15], "int64"),
                               np.array([1, 2, 4], "int64")]),
    "cumsum": (lambda x: op.cumsum(x, axis=1), [_f(3, 40)]),
    "cumsum_exclusive": (lambda x: op.cumsum(x, axis=0, exclusive=True), [_f(6, 4)]),
    "cumsum_int": (lambda x: op.cumsum(x, axis=1, dtype="int64"), [R.integers(-5, 5, (3, 9)).astype("int32")]),
    "cumprod": (lambda x: op.cumprod(x, axis=1), [_f(3, 6)]),
    # nan / inf tests and masks
    "isnan": (lambda x: op.isnan(x), [nan_in]),
    "isinf": (lambda x: op.isinf(x), [nan_in]),
    "isfinite": (lambda x: op.isfinite(x), [nan_in]),
    "not_equal": (lambda a, b: op.not_equal(a, b), [np.array([1, 2, 3], "float32"), np.array([1, 0, 3], "float32")]),
    "logical_and": (lambda a, b: op.logical_and(a, b), [np.array([1, 0, 1, 0], bool), np.array([1, 1, 0, 0], bool)]),
    "logical_or": (lambda a, b: op.logical_or(a, b), [np.array([1, 0, 1, 0], bool), np.array([1, 1, 0, 0], bool)]),
    "logical_not": (lambda a: op.logical_not(a), [np.array([1, 0, 1, 0], bool)]),
    "tril": (lambda x: op.tril(x, 1), [_f(2, 5, 6)]),
    "triu": (lambda x: op.triu(x, -1), [_f(5, 6)]),
    "full": (lambda x: op.full((2, 3), c(np.float32(2.5)), "float32"), [_f(2, 3)]),
    "zeros_like": (lambda x: op.zeros_like(x), [_f(2, 3)]),
    "ones_like": (lambda x: op.ones_like(x), [_f(2, 3)]),
    "ones": (lambda x: op.ones((2, 3), "float32"), [_f(2, 3)]),
    "arange": (lambda x: op.arange(0, 6, 2, "float32"), [_f(2, 3)]),
    # a static shape as a tensor (TVM's ONNX Shape, left in a float span of Swin-T quantized at its MatMuls)
    "shape_to_tensor": (lambda x: op.shape_to_tensor(relax.ShapeExpr([3, 9, 49, 32])), [_f(2, 3)]),
    # elementwise and reductions
    "log": (lambda x: op.log(x), [_f(3, 5, lo=0.1)]),
    "sin": (lambda x: op.sin(x), [_f(3, 5)]),
    "cos": (lambda x: op.cos(x), [_f(3, 5)]),
    "square": (lambda x: op.square(x), [_f(3, 5)]),
    "sign": (lambda x: op.sign(x), [_f(3, 5)]),
    "ceil": (lambda x: op.ceil(x), [_f(3, 5) * 3]),
    "trunc": (lambda x: op.trunc(x), [_f(3, 5) * 3]),
    "floor_mod": (lambda a, b: op.floor_mod(a, b), [_f(3, 5) * 5, _f(3, 5, lo=0.5)]),
    "power": (lambda a: op.power(a, c(np.float32(3.0))), [_f(3, 5)]),
    "variance": (lambda x: op.variance(x, axis=[-1], keepdims=True), [_f(3, 9)]),
    "std": (lambda x: op.std(x, axis=[1]), [_f(3, 9)]),
    "prod": (lambda x: op.prod(x, axis=[1]), [_f(3, 4)]),
    "argmax": (lambda x: op.argmax(x, axis=1), [_f(3, 9)]),
    "argmin": (lambda x: op.argmin(x, axis=0, keepdims=True), [_f(3, 9)]),
    "tile": (lambda x: op.tile(x, [2, 1, 3]), [_f(2, 3)]),
    "repeat": (lambda x: op.repeat(x, 2, axis=1), [_f(2, 3)]),
    "flip": (lambda x: op.flip(x, axis=1), [_f(2, 3)]),
    "einsum": (lambda a, b: op.einsum([a, b], "bhqd,bhkd->bhqk"), [_f(1, 2, 4, 8), _f(1, 2, 5, 8)]),
    "gather_elements": (lambda x, i: op.gather_elements(x, i, axis=1),
                        [_f(3, 4), R.integers(0, 4, (3, 2)).astype("int64")]),
    "gather_nd": (lambda x, i: op.gather_nd(x, i), [_f(3, 4, 2), R.integers(0, 3, (5, 2)).astype("int64")]),
    # a .pt2's aten.index.Tensor (transformers' attention mask: broadcast index tensors)
    "index_tensor": (lambda x, i, j: op.index_tensor(x, [i, j]),
                     [_f(3, 5, 2), R.integers(0, 3, (2, 1)).astype("int64"), R.integers(0, 5, (1, 4)).astype("int64")]),
    "one_hot": (lambda i: op.one_hot(i, relax.prim_value(tvm.tirx.FloatImm("float32", 1.0)),
                                     relax.prim_value(tvm.tirx.FloatImm("float32", 0.0)), 5, -1),
                [R.integers(0, 5, (2, 3)).astype("int32")]),
    "leakyrelu": (lambda x: nn_.leakyrelu(x, 0.1), [_f(3, 5)]),
    # BEiT's relative position index is written with ScatterND
    "scatter_nd": (lambda x, i, u: op.scatter_nd(x, i, u, "update"),
                   [_f(4, 5, 3), np.array([[[0, 1], [3, 4]], [[2, 0], [1, 1]]], "int64"), _f(2, 2, 3)]),
    "scatter_nd_add": (lambda x, i, u: op.scatter_nd(x, i, u, "add"),
                       [_f(6, 2), np.array([[1], [4], [1]], "int64"), _f(3, 2)]),
    # audio front ends (wav2vec2's feature extractor) and decoders' upsampling
    "conv1d": (lambda x, w: nn_.conv1d(x, w, strides=2, padding=(1, 2), dilation=2, groups=2),
               [_f(1, 4, 19), _f(6, 2, 3)]),
    "conv2d_transpose": (lambda x, w: nn_.conv2d_transpose(x, w, strides=(2, 3), padding=(1, 0, 1, 0),
                                                           output_padding=(1, 2), groups=2),
                         [_f(1, 4, 5, 6), _f(4, 3, 3, 2)]),
    "conv2d_transpose_int8": (lambda x, w: nn_.conv2d_transpose(x, w, strides=2, padding=1, out_dtype="int32"),
                              [R.integers(-128, 128, (1, 3, 4, 5)).astype("int8"),
                               R.integers(-128, 128, (3, 2, 3, 3)).astype("int8")]),
    "prelu": (lambda x, a: nn_.prelu(x, a, axis=1), [_f(2, 3, 4), _f(3)]),
    "softplus": (lambda x: nn_.softplus(x, 1.5, 4.0), [_f(3, 9) * 4]),
    # resize (nearest, bilinear) with the coordinate modes
    "resize_linear_half_pixel": (lambda x: img.resize2d(x, (9, 13), method="linear",
                                                        coordinate_transformation_mode="half_pixel"), [_f(1, 2, 5, 7)]),
    "resize_linear_align_corners": (lambda x: img.resize2d(x, (9, 13), method="linear",
                                                           coordinate_transformation_mode="align_corners"), [_f(1, 2, 5, 7)]),
    "resize_linear_asymmetric": (lambda x: img.resize2d(x, (10, 14), method="linear",
                                                        coordinate_transformation_mode="asymmetric"), [_f(1, 2, 5, 7)]),
    "resize_linear_pytorch_half_pixel": (lambda x: img.resize2d(x, (3, 4), method="linear",
                                                                coordinate_transformation_mode="pytorch_half_pixel"),
                                         [_f(1, 2, 5, 7)]),
    "resize_linear_nhwc": (lambda x: img.resize2d(x, (8, 6), layout="NHWC", method="linear",
                                                  coordinate_transformation_mode="half_pixel"), [_f(1, 5, 7, 3)]),
    "resize_nearest_asymmetric_floor": (lambda x: img.resize2d(x, (10, 14), method="nearest_neighbor",
                                                               coordinate_transformation_mode="asymmetric",
                                                               rounding_method="floor"), [_f(1, 2, 5, 7)]),
    "resize_nearest_asymmetric_3x": (lambda x: img.resize2d(x, (15, 21), method="nearest_neighbor",
                                                            coordinate_transformation_mode="asymmetric",
                                                            rounding_method="floor"), [_f(1, 2, 5, 7)]),
    "resize_nearest_half_pixel_prefer_ceil": (lambda x: img.resize2d(x, (9, 11), method="nearest_neighbor",
                                                                     coordinate_transformation_mode="half_pixel",
                                                                     rounding_method="round_prefer_ceil"),
                                              [_f(1, 2, 5, 7)]),
    "resize_nearest_align_corners_round": (lambda x: img.resize2d(x, (9, 11), method="nearest_neighbor",
                                                                  coordinate_transformation_mode="align_corners",
                                                                  rounding_method="round"), [_f(1, 2, 5, 7)]),
    "resize_nearest_tf_half_pixel": (lambda x: img.resize2d(x, (3, 4), method="nearest_neighbor",
                                                            coordinate_transformation_mode="tf_half_pixel_for_nn",
                                                            rounding_method="floor"), [_f(1, 2, 5, 7)]),
}


@pytest.mark.parametrize("name", sorted(OP_CASES))
def test_op_matches_tvm(name):
    make, inputs = OP_CASES[name]
    call, want = run_tvm(make, inputs)
    relax_op = call.op.name
    if relax_op not in reference.OPS:
        pytest.skip(f"{relax_op} not in the reference")  # an op another change adds
    got = reference.run_op(relax_op, _args(call, inputs), attrs_to_dict(call.attrs))
    got = list(got) if isinstance(got, tuple) else [got]
    assert len(got) == len(want), name
    for g, w in zip(got, want):
        g = np.asarray(g)
        assert g.shape == w.shape and g.dtype == w.dtype, (name, g.shape, g.dtype, w.shape, w.dtype)
        if w.dtype.kind in "iub":
            np.testing.assert_array_equal(g, w, err_msg=name)
        else:
            np.testing.assert_allclose(g, w, rtol=2e-5, atol=2e-6, err_msg=name)


def test_pixel_shuffle_matches_torch():
    x = _f(2, 12, 3, 4)
    got = reference.run_op("relax.nn.pixel_shuffle", [x], {"upscale_factor": 2})
    np.testing.assert_array_equal(got, F.pixel_shuffle(torch.from_numpy(x), 2).numpy())


# ---------------------------------------------------------------- models through irgen


class Fn(nn.Module):
    def __init__(self, fn, **mods):
        super().__init__()
        self.fn = fn
        for k, m in mods.items():
            setattr(self, k, m)

    def forward(self, x):
        return self.fn(self, x)


def _ln(n):
    ln = nn.LayerNorm(n)
    with torch.no_grad():
        ln.weight.normal_()
        ln.bias.normal_()
    return ln


def _attn(m, x):
    b, s, d = x.shape
    q, k, v = m.qkv(x).split(d, dim=-1)
    q, k, v = (t.reshape(b, s, 2, d // 2).transpose(1, 2) for t in (q, k, v))
    return m.o(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, s, d))


def _models():
    torch.manual_seed(0)
    return {
        # LayerNorm, GELU (erf and tanh), SiLU, split, strided slice, mean, rsqrt, cumsum, isnan/where
        "mlp_ops": (Fn(lambda m, x: torch.cat([
            F.gelu(m.l1(m.ln(x))),
            F.gelu(x, approximate="tanh"),
            F.silu(x),
        ], dim=-1).split([16, 32], dim=-1)[1] * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
            + torch.cumsum(torch.where(torch.isnan(x), torch.zeros_like(x), x), dim=1)[..., :1],
            ln=_ln(16), l1=nn.Linear(16, 16)), (2, 5, 16),
            {"layer_norm", "split", "cumsum", "isnan", "strided_slice"}),
        # attention (F.scaled_dot_product_attention): the same matmul/multiply/softmax layers from torch and ONNX
        "attention": (Fn(_attn, qkv=nn.Linear(16, 48), o=nn.Linear(16, 16)), (1, 6, 16), {"dense"}),
        # upsampling: nearest and bilinear (half-pixel and align-corners)
        "resize": (Fn(lambda m, x: torch.cat([
            F.interpolate(x, scale_factor=2, mode="nearest"),
            F.interpolate(x, scale_factor=2, mode="bilinear", align_corners=False),
            F.interpolate(x, size=(8, 8), mode="bilinear", align_corners=True)], dim=1)), (1, 2, 4, 4), {"resize"}),
        # embedding gather
        "embedding": (Fn(lambda m, x: m.e((x.abs() * 3).long() % 10).sum(1), e=nn.Embedding(10, 8)),
                      (2, 5), {"gather"}),
        # an audio front end (wav2vec2's strided 1-D convolutions) and a decoder's transposed convolutions
        "conv1d_transpose2d": (Fn(lambda m, x: m.up2(F.relu(m.up(
            F.gelu(m.c2(F.gelu(m.c1(x.flatten(2)))))[:, :, None, :]))),
            c1=nn.Conv1d(2, 8, 5, stride=2, padding=1), c2=nn.Conv1d(8, 8, 3, stride=2, groups=2),
            up=nn.ConvTranspose2d(8, 4, 3, stride=2, padding=1, output_padding=1),
            up2=nn.ConvTranspose2d(4, 4, (1, 2), stride=(1, 2), groups=2)), (1, 2, 40),
            {"conv1d", "conv2d_transpose"}),
    }


def _export(model, x, d: Path, fmt: str) -> Path:
    if fmt == "onnx":
        p = d / "m.onnx"
        torch.onnx.export(model, (x,), str(p), dynamo=False, opset_version=17, input_names=["x"],
                          do_constant_folding=False)
    else:
        p = d / "m.pt2"
        torch.export.save(torch.export.export(model, (x,)), str(p))
    return p


def _reference_values(path: Path, x: np.ndarray, ir: dict, fmt: str) -> dict[str, np.ndarray]:
    wanted = sorted({t for layer in ir["layers"] for t in layer["source"].get("outputs", [])})
    if fmt == "onnx":
        from test_onnx_layers import ort_run

        return ort_run(path, x, wanted)
    from irgen_torch import record_nodes

    return record_nodes(torch.export.load(str(path)), [torch.from_numpy(x)])


def run_and_check(model, shape, tmp: Path, fmt: str, opt: int = 3, unseen: int = 0) -> dict:
    """Run and verify ``model``; every layer is compared with the source runtime except
    ``unseen`` ones without a source tensor (the steps inside one attention op)."""
    model.eval()
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(1))
    np.save(tmp / "x.npy", x.numpy())
    path = _export(model, x, tmp, fmt)
    out = tmp / "out"
    rc = irgen_main(["run", str(path), "-o", str(out), "--input", str(tmp / "x.npy"), "--opt-level", str(opt),
                     "--no-progress"])
    assert rc == 0
    result = verify_output(out, modes=("single", "entire", "source"))
    assert result["passed"], format_table(result)
    assert result["summary"]["unsupported"] == 0
    ir = json.loads((out / "ir.json").read_text())
    seen = [layer for layer in ir["layers"] if layer["source"]["outputs"]]
    assert len(ir["layers"]) - len(seen) == unseen, [l["op"] for l in ir["layers"] if l not in seen]
    for row, layer in zip(result["layers"], ir["layers"], strict=True):
        want = "pass" if layer in seen else "missing"
        assert row["checks"].get("source") and row["checks"]["source"]["status"] == want, (row["name"], row["checks"])
    ref = _reference_values(path, x.numpy(), ir, fmt)
    assert_layers_match(out, {**ir, "layers": seen}, ref, f"{path.name} -O{opt}")
    return ir


# every model from ONNX; from .pt2 (its source check runs torch in a child process, 3-5 s) the
# MLP's ops and the attention by default, the rest slow
@pytest.mark.parametrize("name,fmt", [
    pytest.param(n, f, id=f"{n}-{f}",
                 marks=[pytest.mark.slow] if f == "pt2" and n not in ("mlp_ops", "attention") else [])
    for n in ["mlp_ops", "attention", "resize", "embedding", "conv1d_transpose2d"] for f in ["onnx", "pt2"]])
def test_model(name, fmt, tmp_path):
    model, shape, ops = _models()[name]
    # attention's steps have no source tensor: ONNX's unscaled q·kᵀ; .pt2's kᵀ, q·kᵀ, × scale, softmax
    unseen = {"onnx": 1, "pt2": 4}[fmt] if name == "attention" else 0
    ir = run_and_check(model, shape, tmp_path, fmt, unseen=unseen)
    have = {layer["op"] for layer in ir["layers"]}
    assert ops <= have, (ops - have, have)
    assert not any(op.startswith("aten.") for op in have), have
    if name == "attention":  # sdpa as its steps from both formats (the same layer ops)
        steps = [layer["op"] for layer in ir["layers"] if layer["op"] in ("matmul", "multiply", "softmax")]
        assert steps == ["matmul", "multiply", "softmax", "matmul"], steps
        assert "attention" not in have, have
    if name == "mlp_ops" and fmt == "onnx":  # opset 17 has no Gelu: its Div, Erf, Add, Mul, Mul fused to one gelu
        assert "gelu" in have and "erf" not in have, have
    if name == "mlp_ops" and fmt == "pt2":
        forms = {layer["attrs"].get("approximate") for layer in ir["layers"] if layer["op"] == "gelu"}
        assert forms == {"none", "tanh"}, forms
        assert "silu" in have


# ---------------------------------------------------------------- a 2-layer transformer encoder


class Encoder(nn.Module):
    """Token embedding + position, 2 pre-norm blocks (LayerNorm, q/k/v matmuls, softmax
    attention over 2 heads, GELU MLP, residual adds), final LayerNorm."""

    def __init__(self, vocab=20, d=16, heads=2, seq=6):
        super().__init__()
        self.heads = heads
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.randn(1, seq, d) * 0.1)
        self.blocks = nn.ModuleList()
        for _ in range(2):
            blk = nn.Module()
            blk.ln1, blk.ln2 = _ln(d), _ln(d)
            blk.q, blk.k, blk.v, blk.o = (nn.Linear(d, d) for _ in range(4))
            blk.fc1, blk.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
            self.blocks.append(blk)
        self.ln = _ln(d)

    def forward(self, ids):
        x = self.tok(ids) + self.pos
        b, s, d = x.shape
        h = self.heads
        for blk in self.blocks:
            y = blk.ln1(x)
            q, k, v = (lin(y).reshape(b, s, h, d // h).transpose(1, 2) for lin in (blk.q, blk.k, blk.v))
            a = torch.softmax(q @ k.transpose(-1, -2) / (d // h) ** 0.5, dim=-1) @ v
            x = x + blk.o(a.transpose(1, 2).reshape(b, s, d))
            x = x + blk.fc2(F.gelu(blk.fc1(blk.ln2(x))))
        return self.ln(x)


@pytest.mark.parametrize("fmt", ["onnx", pytest.param("pt2", marks=pytest.mark.slow)])  # .pt2: test_model's attention
def test_transformer_encoder(fmt, tmp_path):
    torch.manual_seed(0)
    model = Encoder().eval()
    ids = torch.randint(0, 20, (1, 6), generator=torch.Generator().manual_seed(1))
    np.save(tmp_path / "x.npy", ids.numpy())
    path = _export(model, ids, tmp_path, fmt)
    out = tmp_path / "out"
    assert irgen_main(["run", str(path), "-o", str(out), "--input", str(tmp_path / "x.npy"), "--no-progress"]) == 0
    result = verify_output(out, modes=("single", "entire", "source"))
    assert result["passed"] and result["summary"]["unsupported"] == 0, format_table(result)
    assert all(row["checks"].get("source", {}).get("status") == "pass" for row in result["layers"]), format_table(result)
    ir = json.loads((out / "ir.json").read_text())
    have = [layer["op"] for layer in ir["layers"]]
    assert have.count("layer_norm") == 5, have
    assert have.count("softmax") == 2 and "gather" in have, have
    assert sum(op == "matmul" for op in have) >= 4, have  # q k^T and attn v per block: two activations
    ref = _reference_values(path, ids.numpy(), ir, fmt)
    assert_layers_match(out, ir, ref, f"encoder {fmt}")
    with torch.no_grad():
        want = model(ids).numpy()
    np.testing.assert_allclose(np.load(out / ir["outputs"][0]["file"]), want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("size", [(1, 1), (3, 4)])
def test_adaptive_avg_pool_is_bit_equal_to_tvm(size):
    """Adaptive average pooling (a global pool before its quantize in torch's quantized
    MobileNetV2): the reference sums each window in float32 in row-major order and divides
    by the count, as TVM's kernel does, so a value the quantize after it rounds agrees to
    the bit. A float64 mean differed from the golden data in the last bit, and after the
    quantize by one LSB (verify then failed a correct layer)."""
    x = (R.standard_normal((1, 64, 7, 9)) * 100).astype(np.float32)
    call, (want,) = run_tvm(lambda v: nn_.adaptive_avg_pool2d(v, size), [x])
    got = reference.run_op(call.op.name, [x], attrs_to_dict(call.attrs))
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("axis,keepdims", [([2, 3], True), ([2, 3], False), ([1], False), ([-1], True), (None, False)])
def test_mean_is_bit_equal_to_tvm(axis, keepdims):
    """``mean`` on float32 as TVM computes it: the reduced elements added in row-major order, then
    divided by their count (torch's quantized ShuffleNetV2 head: a float64 mean put verify one LSB
    off the golden data after the quantize)."""
    x = (R.standard_normal((2, 24, 7, 9)) * 100).astype(np.float32)
    call, (want,) = run_tvm(lambda v: op.mean(v, axis, keepdims), [x])
    got = reference.run_op(call.op.name, [x], attrs_to_dict(call.attrs))
    np.testing.assert_array_equal(got, want)
