"""Kernels that accumulate in bfloat16, one rounded add at a time (``--accumulate bf16``).

TVM's bfloat16 kernels cannot hold a bfloat16 accumulator: its bfloat16 legalization
(``BF16ComputeLegalize``) computes a kernel's bfloat16 values in float32 and drops a cast to
bfloat16 between two float32 values, so partial sums and the results of fused ops stay float32
inside a kernel. The kernels here compute on float32 tensors that hold bfloat16 values and
round with integer arithmetic on the float32 bit pattern (:func:`round_bf16`), which no
legalization touches:

* :func:`accumulating_call`: a convolution (1-D, 2-D; NCW/OIW, NCHW/OIHW; groups, strides,
  dilations, padding), a 2-D transposed convolution (one group) or a ``relax.matmul`` (batch
  broadcasting, 1-D operands) whose sums are a ``te.comm_reducer`` with ``round_bf16(acc + p)``
  as its combine, identity 0: per output, the products (exact in float32: two 8-bit
  significands) added one by one from zero in the order of ``irgen.declared.conv_f32`` and
  ``matmul_f32`` (input channel of the group, kernel row, kernel column; ``k``), each partial
  sum rounded to bfloat16. The reduction loops nest in that order, :mod:`irgen.schedule` never
  moves them and LLVM does not reassociate float adds (TVM builds without fast-math; the
  rounding is integer arithmetic between any two adds anyway).
* :func:`rounding_call`: a float32 tensor rounded to bfloat16 values elementwise (the rounding
  after every other op of a ``"round": "op"`` layer).

Rounding is to nearest even, as ml_dtypes rounds (a NaN becomes the quiet NaN of its sign).
"""

from __future__ import annotations

from typing import Any, Callable

from tvm import relax, te, tirx

from irgen.api import IrgenError
from irgen.graph import tensor_type


def _u32(v: int):
    return tirx.const(v, "uint32")


def round_bf16(x):
    """The float32 expression ``x`` rounded to the nearest bfloat16 value, ties to even, as a
    float32 expression: ``(u + 0x7FFF + (u >> 16 & 1)) & 0xFFFF0000`` on its bits ``u`` (an
    overflow gives infinity); a NaN gives ``0x7FC00000`` with its sign."""
    u = tirx.reinterpret("uint32", x)
    nan = (u & _u32(0x7FFFFFFF)) > _u32(0x7F800000)
    up = u + (_u32(0x7FFF) + ((u >> _u32(16)) & _u32(1)))
    bits = tirx.Select(nan, (u & _u32(0x80000000)) | _u32(0x7FC00000), up & _u32(0xFFFF0000))
    return tirx.reinterpret("float32", bits)


#: a sum whose every partial sum is rounded to bfloat16 (from zero)
bf16_sum = te.comm_reducer(lambda acc, p: round_bf16(acc + p), lambda t: tirx.const(0, t), name="bf16_sum")


def _ints(v: Any) -> list[int]:
    return [int(x) for x in v]


def _pads(pad: list[int], nd: int) -> tuple[list[int], list[int]]:
    """(before, after) padding of ``nd`` spatial axes from Relax's padding attribute."""
    if len(pad) == 1:
        pad = pad * 2 * nd
    elif len(pad) == nd:
        pad = pad * 2
    if len(pad) != 2 * nd:
        raise IrgenError(f"--accumulate bf16: a padding of {pad} for {nd} spatial axes")
    return pad[:nd], pad[nd:]


def _padded(x: te.Tensor, before: list[int], after: list[int], name: str = "pad") -> te.Tensor:
    """``x`` (N, C, *spatial) with zeros around its spatial axes."""
    if not any(before) and not any(after):
        return x
    spatial = _ints(x.shape[2:])
    shape = _ints(x.shape[:2]) + [s + b + a for s, b, a in zip(spatial, before, after)]

    def f(n, c, *s):
        at = [p - b for p, b in zip(s, before)]
        inside = tirx.all(*[tirx.all(i >= 0, i < size) for i, size in zip(at, spatial)])
        return tirx.if_then_else(inside, x[(n, c, *at)], tirx.const(0, "float32"))

    return te.compute(shape, f, name=name)


def _conv(x: te.Tensor, w: te.Tensor, out_shape: list[int], strides: list[int], dilation: list[int],
          groups: int) -> te.Tensor:
    """A convolution of the padded ``x`` (N, C, *spatial) by ``w`` (O, C / groups, *kernel), the
    reduction over (input channel of the group, *kernel) in that order."""
    o, cg, *kernel = _ints(w.shape)
    per_group = o // groups
    rc = te.reduce_axis((0, cg), "rc")
    rk = [te.reduce_axis((0, k), f"rk{d}") for d, k in enumerate(kernel)]

    def f(n, oc, *s):
        at = [p * st + r * dl for p, r, st, dl in zip(s, rk, strides, dilation)]
        return bf16_sum(x[(n, oc // per_group * cg + rc, *at)] * w[(oc, rc, *rk)], axis=[rc, *rk])

    return te.compute(out_shape, f, name="conv_bf16_steps")


def _conv_kernel(attrs, x_shape, w_shape, out_shape, layouts: tuple[str, str]):
    a = attrs
    if (str(a.data_layout), str(a.kernel_layout), str(a.out_layout or a.data_layout)) != (*layouts, layouts[0]):
        raise IrgenError(f"--accumulate bf16: a convolution in layout {a.data_layout}/{a.kernel_layout} "
                         f"(only {layouts[0]}/{layouts[1]} is computed)")
    nd = len(x_shape) - 2
    before, after = _pads(_ints(a.padding), nd)
    x, w = te.placeholder(x_shape, "float32", "x"), te.placeholder(w_shape, "float32", "w")
    y = _conv(_padded(x, before, after), w, out_shape, _ints(a.strides), _ints(a.dilation), int(a.groups))
    return [x, w, y]


def _conv_transpose_kernel(attrs, x_shape, w_shape, out_shape):
    """As ``irgen.declared.conv_transpose_f32``: the input dilated by the strides and padded by
    ``kernel - 1 - padding`` (the far end also by ``output_padding``), convolved with the flipped,
    transposed kernel."""
    a = attrs
    if (str(a.data_layout), str(a.kernel_layout), str(a.out_layout or a.data_layout)) != ("NCHW", "IOHW", "NCHW") \
            or int(a.groups) != 1 or _ints(a.dilation) != [1, 1]:
        raise IrgenError("--accumulate bf16: a transposed convolution other than NCHW/IOHW, one group, no dilation")
    (n, c, h, wd), (_, o, kh, kw) = x_shape, w_shape
    strides = _ints(a.strides)
    before, after = _pads(_ints(a.padding), 2)
    extra = _ints(a.output_padding)
    lo = [k - 1 - b for k, b in zip((kh, kw), before)]
    hi = [k - 1 - e + p for k, e, p in zip((kh, kw), after, extra)]
    if min(lo + hi) < 0:
        raise IrgenError("--accumulate bf16: a transposed convolution padded by more than its kernel")
    x, w = te.placeholder(x_shape, "float32", "x"), te.placeholder(w_shape, "float32", "w")
    size = [(s - 1) * st + 1 + l + r for s, st, l, r in zip((h, wd), strides, lo, hi)]

    def spread(b, ch, py, px):
        at = [p - l for p, l in zip((py, px), lo)]
        ok = [tirx.all(i >= 0, i < (s - 1) * st + 1, tirx.floormod(i, st) == 0)
              for i, s, st in zip(at, (h, wd), strides)]
        return tirx.if_then_else(tirx.all(*ok), x[b, ch, tirx.floordiv(at[0], strides[0]),
                                                  tirx.floordiv(at[1], strides[1])], tirx.const(0, "float32"))

    xp = te.compute([n, c, *size], spread, name="spread")
    flipped = te.compute([o, c, kh, kw], lambda oc, ic, i, j: w[ic, oc, kh - 1 - i, kw - 1 - j], name="flip")
    return [x, w, _conv(xp, flipped, out_shape, [1, 1], [1, 1], 1)]


def _matmul_kernel(attrs, a_shape, b_shape, out_shape):
    """``relax.matmul`` with batch broadcasting; a 1-D operand as numpy's matmul reads it."""
    va, vb = len(a_shape) == 1, len(b_shape) == 1
    a, b = te.placeholder(a_shape, "float32", "a"), te.placeholder(b_shape, "float32", "b")
    k = te.reduce_axis((0, int(a_shape[-1])), "k")
    a_batch, b_batch = ([] if va else a_shape[:-2]), ([] if vb else b_shape[:-2])

    def pick(batch_dims: list[int], batch) -> list:
        lead = len(batch) - len(batch_dims)
        return [0 if d == 1 else batch[lead + i] for i, d in enumerate(batch_dims)]

    def f(*idx):
        idx = list(idx)
        n = None if vb else idx.pop()
        m = None if va else idx.pop()
        av = a[k] if va else a[(*pick(a_batch, idx), m, k)]
        bv = b[k] if vb else b[(*pick(b_batch, idx), k, n)]
        return bf16_sum(av * bv, axis=[k])

    return [a, b, te.compute(out_shape, f, name="matmul_bf16_steps")]


#: op -> (attrs, first operand's shape, second's, output shape) -> the kernel's tensors
_KERNELS: dict[str, Callable] = {
    "relax.nn.conv1d": lambda at, xs, ws, os: _conv_kernel(at, xs, ws, os, ("NCW", "OIW")),
    "relax.nn.conv2d": lambda at, xs, ws, os: _conv_kernel(at, xs, ws, os, ("NCHW", "OIHW")),
    "relax.nn.conv2d_transpose": _conv_transpose_kernel,
    "relax.matmul": _matmul_kernel,
}
#: the ops :func:`accumulating_call` computes
OPS = tuple(_KERNELS)


def _prim_func(tensors: list[te.Tensor]) -> tirx.PrimFunc:
    """The kernel of ``tensors`` (inputs, then the output), int64 indices as Relax's, private."""
    return te.create_prim_func(tensors, "int64").without_attr("global_symbol")


def _static_shape(expr: relax.Expr, what: str) -> list[int]:
    t = tensor_type(expr)
    if t is None or any(not isinstance(d, int) for d in t[0]):
        raise IrgenError(f"--accumulate bf16: {what} needs static shapes (got {expr.ty})")
    return list(t[0])


def accumulating_call(bb: relax.BlockBuilder, op: str, args: list[relax.Expr], attrs, out_shape: list[int],
                      where: str) -> relax.Call:
    """A ``call_tir`` computing ``op`` (one of :data:`OPS`) on the float32 operands ``args``,
    accumulating in bfloat16 (module docstring); its kernel added to ``bb``'s module."""
    if op not in _KERNELS:
        raise IrgenError(f"--accumulate bf16: {op} at {where!r} has no bfloat16 accumulating kernel "
                         f"(computed: {', '.join(OPS)})")
    shapes = [_static_shape(e, f"{op} at {where!r}") for e in args[:2]]
    out_shape = [int(d) for d in out_shape]
    gv = bb.add_func(_prim_func(_KERNELS[op](attrs, *shapes, out_shape)), op.rsplit(".", 1)[-1] + "_bf16_steps")
    return relax.call_tir(gv, relax.Tuple(list(args[:2])), relax.TensorType(out_shape, "float32"))


def rounding_call(bb: relax.BlockBuilder, arg: relax.Expr, where: str) -> relax.Call:
    """A ``call_tir`` rounding the float32 tensor ``arg`` to bfloat16 values (kept float32)."""
    shape = _static_shape(arg, f"rounding at {where!r}")
    x = te.placeholder(shape, "float32", "x")
    y = te.compute(shape, lambda *i: round_bf16(x[i]), name="round_bf16")
    gv = bb.add_func(_prim_func([x, y]), "round_bf16")
    return relax.call_tir(gv, relax.Tuple([arg]), relax.TensorType(shape, "float32"))
