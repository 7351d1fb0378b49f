"""irgen.stepwise: the bfloat16 accumulating kernels of ``--accumulate bf16``, compiled by TVM
for the CPU, against numpy.

* the rounding (integer arithmetic on the float32 bits) equals ml_dtypes' float32 -> bfloat16
  conversion on ties, overflow, subnormals, infinities and NaNs;
* each kernel (conv1d, conv2d with groups/strides/dilations/asymmetric padding, a transposed
  conv2d, matmul with batch broadcasting and 1-D operands) equals, bit for bit, a plain Python
  loop that adds the float32 products one at a time from zero in the declared order and rounds
  each partial sum with ml_dtypes, and ``irgen.declared`` (the verify reference) too;
* the result differs from a float32 sum rounded once (the test sees a bfloat16 accumulator).
"""

from __future__ import annotations

import numpy as np
import pytest

ml_dtypes = pytest.importorskip("ml_dtypes")
tvm = pytest.importorskip("tvm")

from tvm import relax, te  # noqa: E402

from irgen import declared, stepwise  # noqa: E402
from irgen.plugin import attrs_to_dict  # noqa: E402

BF16 = np.dtype(ml_dtypes.bfloat16)


def _bf16_values(rng, shape, scale=1.0) -> np.ndarray:
    return (rng.standard_normal(shape) * scale).astype(np.float32).astype(BF16).astype(np.float32)


def _build(func, x: np.ndarray) -> np.ndarray:
    ex = tvm.compile(tvm.IRModule({"main": func}), target="llvm")
    out = tvm.runtime.empty(x.shape, "float32")
    ex["main"](tvm.runtime.tensor(x), out)
    return out.numpy()


def test_rounding_is_ml_dtypes_round_to_nearest_even():
    bits = np.array([
        0x3F808000, 0x3F818000, 0x3F808001, 0x3F807FFF,  # ties to even (down, up), just above / below a tie
        0x7F7FFFFF, 0xFF7F8000, 0x7F7F7FFF,  # the largest float32 (rounds to inf), a tie at the top, below it
        0x00000001, 0x00008000, 0x00018000, 0x807FFFFF,  # subnormals
        0x7F800000, 0xFF800000, 0x00000000, 0x80000000,  # infinities, zeros
        0x7FC00000, 0xFFC00001, 0x7F800001, 0xFFA00001,  # NaNs, quiet and signalling
    ], np.uint32)
    rng = np.random.default_rng(0)
    bits = np.concatenate([bits, rng.integers(0, 2 ** 32, 4000, dtype=np.uint64).astype(np.uint32)])
    x = te.placeholder((bits.size,), "float32", "x")
    y = te.compute((bits.size,), lambda i: stepwise.round_bf16(x[i]))
    got = _build(te.create_prim_func([x, y]), bits.view(np.float32)).view(np.uint32)
    with np.errstate(invalid="ignore"):
        want = bits.view(np.float32).astype(BF16).view(np.uint16).astype(np.uint32) << 16
    assert np.array_equal(got, want), [(hex(b), hex(g), hex(w)) for b, g, w in zip(bits, got, want) if g != w][:5]


def _steps(products) -> np.float32:
    """A bfloat16 accumulator: float32 products added one by one from zero, each sum rounded."""
    acc = np.float32(0)
    for p in products:
        acc = np.float32(np.float32(acc + np.float32(p)).astype(BF16))
    return acc


def _loop_conv2d(x, w, strides, pads, dil, groups, at):
    """One output of an NCHW/OIHW convolution, the products over (input channel, row, column)."""
    n, oc, oy, ox = at
    cg, kh, kw = w.shape[1:]
    c0 = oc // (w.shape[0] // groups) * cg
    products = []
    for ci in range(cg):
        for i in range(kh):
            for j in range(kw):
                iy, ix = oy * strides[0] - pads[0] + i * dil[0], ox * strides[1] - pads[1] + j * dil[1]
                inside = 0 <= iy < x.shape[2] and 0 <= ix < x.shape[3]
                products.append(np.float32(x[n, c0 + ci, iy, ix] if inside else 0) * np.float32(w[oc, ci, i, j]))
    return _steps(products)


def _call(op, x, w, **attrs) -> tuple[np.ndarray, dict]:
    """The stepwise kernel of ``op`` on ``x``, ``w`` (float32 holding bfloat16 values), compiled
    and run through Relax, and the op's attributes."""
    opf = {"relax.nn.conv2d": relax.op.nn.conv2d, "relax.nn.conv1d": relax.op.nn.conv1d,
           "relax.nn.conv2d_transpose": relax.op.nn.conv2d_transpose, "relax.matmul": relax.op.matmul}[op]
    bb = relax.BlockBuilder()
    xv, wv = (relax.Var(n, relax.TensorType(a.shape, "float32")) for n, a in (("x", x), ("w", w)))
    ref = bb.normalize(opf(xv, wv, **attrs))
    with bb.function("main", [xv, wv]):
        with bb.dataflow():
            y = bb.emit(stepwise.accumulating_call(bb, op, [xv, wv], ref.attrs,
                                                   [int(d) for d in ref.ty.shape.values], "t"))
            out = bb.emit_output(y)
        bb.emit_func_output(out)
    ex = tvm.compile(relax.transform.LegalizeOps()(bb.get()), target="llvm")
    got = relax.VirtualMachine(ex, tvm.cpu())["main"](tvm.runtime.tensor(x), tvm.runtime.tensor(w)).numpy()
    return got, attrs_to_dict(ref.attrs)


STEP = declared._storage_step(BF16, np.dtype(np.float32))


def test_conv2d_groups_strides_dilation_padding():
    rng = np.random.default_rng(1)
    x, w = _bf16_values(rng, (2, 6, 7, 9)), _bf16_values(rng, (4, 3, 3, 2))
    got, attrs = _call("relax.nn.conv2d", x, w, strides=(2, 1), padding=(1, 0, 2, 1), dilation=(1, 2), groups=2)
    assert np.array_equal(got, declared.conv_f32(x, w, attrs, STEP))
    for at in [(0, 0, 0, 0), (1, 3, 3, 7), (0, 2, 1, 4)]:
        assert got[at] == _loop_conv2d(x, w, (2, 1), (1, 0), (1, 2), 2, at), at
    once = declared.conv_f32(x, w, attrs).astype(BF16).astype(np.float32)
    assert (got != once).mean() > 0.2  # a float32 sum rounded once is another result


def test_conv2d_long_reduction():
    """K = 576 products: the partial sums grow past the products' precision."""
    rng = np.random.default_rng(2)
    x, w = _bf16_values(rng, (1, 64, 5, 5)), _bf16_values(rng, (3, 64, 3, 3), 0.1)
    got, attrs = _call("relax.nn.conv2d", x, w, padding=1)
    assert np.array_equal(got, declared.conv_f32(x, w, attrs, STEP))
    assert got[0, 2, 2, 2] == _loop_conv2d(x, w, (1, 1), (1, 1), (1, 1), 1, (0, 2, 2, 2))


def test_conv1d():
    rng = np.random.default_rng(3)
    x, w = _bf16_values(rng, (1, 4, 11)), _bf16_values(rng, (5, 4, 3))
    got, attrs = _call("relax.nn.conv1d", x, w, strides=2, padding=(1, 2))
    assert np.array_equal(got, declared.conv_f32(x, w, declared._ncw(attrs), STEP))
    assert got[0, 3, 2] == _loop_conv2d(x[:, :, None], w[:, :, None], (1, 2), (0, 1), (1, 1), 1, (0, 3, 0, 2))


def test_conv2d_transpose():
    rng = np.random.default_rng(4)
    x, w = _bf16_values(rng, (1, 3, 5, 4)), _bf16_values(rng, (3, 2, 3, 2))
    got, attrs = _call("relax.nn.conv2d_transpose", x, w, strides=(2, 2), padding=(1, 0, 0, 1),
                       output_padding=(1, 1))
    assert got.shape == (1, 2, 11, 8)
    assert np.array_equal(got, declared.conv_transpose_f32(x, w, attrs, STEP))


@pytest.mark.parametrize("a_shape,b_shape", [((3, 1, 4, 37), (2, 37, 5)), ((37,), (2, 37, 5)),
                                             ((2, 3, 37), (37,)), ((6, 40), (40, 3))])
def test_matmul(a_shape, b_shape):
    rng = np.random.default_rng(5)
    a, b = _bf16_values(rng, a_shape), _bf16_values(rng, b_shape)
    got, attrs = _call("relax.matmul", a, b)
    assert got.shape == np.matmul(a, b).shape
    assert np.array_equal(got, declared.matmul_f32(a, b, attrs, STEP))
    a2 = a.reshape(-1, a.shape[-1])[0]
    b2 = b if b.ndim == 1 else b.reshape(-1, *b.shape[-2:])[0][:, 0]
    assert got.reshape(-1)[0] == _steps(a2 * b2)


def test_unsupported_op_is_an_error():
    from irgen.api import IrgenError

    x = relax.Var("x", relax.TensorType((1, 2, 3, 3, 3), "float32"))
    with pytest.raises(IrgenError, match="conv3d .* has no bfloat16 accumulating kernel"):
        stepwise.accumulating_call(relax.BlockBuilder(), "relax.nn.conv3d", [x, x], None, [1, 2, 1, 1, 1], "c")
