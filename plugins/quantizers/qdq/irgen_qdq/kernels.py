"""The elementwise integer kernels: Add (MLAS QLinearAdd), Mul (QLinearMul), Softmax
(QLinearSoftmax), lookup tables (unary ops, elementwise chains, requantizing data movements,
requantize), data movements on the integers, and QuantizeLinear of a float tensor. An operand
without an integer kernel turns the span into a float span (:func:`_or_float`)."""

from __future__ import annotations

import numpy as np

from irgen.plugin import IrgenError

from .common import SCHEME, _UNARY, _clamp_of, _is_torch, _lut, _need, _offset, _ops, _table
from .float_span import realize_float
from .operands import constants_record, operand
from .ort import ort_softmax_table
from .torch_spans import _realize_binary_torch, _rx_torch_quantize, _torch_compound, _torch_fn


def _or_float(qg, qb, f, out, realize, *args):
    """``realize`` an integer kernel; when an operand is no integer tensor (a per-channel or int32
    constant: ORT has no QLinear kernel for it), the float span as ORT runs it."""
    try:
        return realize(qg, qb, *args, out)
    except IrgenError as e:
        if _is_torch(qg) or "no integer kernel" not in str(e):
            raise
        return realize_float(qg, qb, f, out)


def _qlinear_add_constant(ra, rb, zp_a, zp_b, zp_y) -> np.float32:
    """MLAS's QLinearAdd fixed part, ``zp_y - (ratio_a * zp_a + ratio_b * zp_b)`` in float32
    as its AVX2 build computes it (the first product contracted into an fma)."""
    f32 = np.float32
    inner = f32(np.float64(ra) * np.float64(f32(zp_a)) + np.float64(f32(rb * f32(zp_b))))
    return f32(f32(zp_y) - inner)


def _realize_add(qg, qb, comp, acts, out):
    _, op, q, _ = _ops()
    tensor = qb.name
    if _is_torch(qg):
        ins = [_need(qg, a, "an input", tensor) for a in comp.value.args]
        return _realize_binary_torch(qg, qb, ins, comp, acts, out, "add")
    (x1, q1, d1, c1), (x2, q2, d2, c2) = [operand(qg, a, tensor) for a in comp.value.args]
    if c1 is not None and c1.size == 1 and (c2 is None or c2.size > 1):
        # QLinearAdd passes a scalar A to MLAS as its scalar B: the roles swap
        (x1, q1, d1, c1), (x2, q2, d2, c2) = (x2, q2, d2, c2), (x1, q1, d1, c1)
    sy = np.float32(out.scale[0])
    ra, rb = np.float32(q1.scale[0]) / sy, np.float32(q2.scale[0]) / sy
    const = _qlinear_add_constant(ra, rb, q1.zero_point[0], q2.zero_point[0], out.zero_point[0])
    e = qg.emit
    # MLAS (AVX2): fma(x_a, ratio_a, fma(x_b, ratio_b, constant)) in float32; float64 holds each fma exactly
    xa, xb = e(op.astype(x1, "float64")), e(op.astype(x2, "float64"))  # in this order: the layer's inputs follow it
    t = e(op.add(e(op.multiply(xb, q.rx_const(rb, "float64"))), q.rx_const(const, "float64")))
    t = e(op.astype(e(op.astype(t, "float32")), "float64"))
    f = e(op.add(e(op.multiply(xa, q.rx_const(ra, "float64"))), t))
    f = e(op.astype(f, "float32"))
    lo, hi = _clamp_of(acts, out.dtype, out)
    expr = q.rx_round_to_int(e, f, 0, lo, hi, out.dtype)
    rec = {"scheme": SCHEME, "kind": "add", "inputs": [q1.record(), q2.record()], "output": out.record(),
           **({"constants": constants_record([c1, c2])} if c1 is not None or c2 is not None else {}),
           "requant": {"scale": [float(ra), float(rb)], "constant": float(const), "rounding": "half_to_even",
                       "rounding_rule": "y = clamp(round_half_even(fma(x_a, scale[0], fma(x_b, scale[1], constant)))), "
                                        "each fma rounded once to float32; constant = float32(zp_y - "
                                        "fma(scale[0], zp_a, float32(scale[1] * zp_b))) (MLAS QLinearAdd, AVX2)"},
           "clamp": [lo, hi]}
    return d1 + d2 + [comp.name] + [b.name for b in acts] + [qb.name], expr, rec


def _realize_mul(qg, qb, comp, out):
    """MLAS QLinearMul (SSE2): ``rint(float32(float32(int32((a - zp_a) * (b - zp_b))) * r) + float32(zp_y))``
    with ``r = float32(float32(s_a * s_b) / s_y)``, saturated to the output type."""
    _, op, q, _ = _ops()
    tensor = qb.name
    if _is_torch(qg):
        return _realize_binary_torch(qg, qb, [_need(qg, a, "an input", tensor) for a in comp.value.args], comp, [],
                                     out, "mul")
    (x1, q1, d1, c1), (x2, q2, d2, c2) = [operand(qg, a, tensor) for a in comp.value.args]
    ratio = np.float32(np.float32(np.float32(q1.scale[0]) * np.float32(q2.scale[0])) / np.float32(out.scale[0]))
    e = qg.emit
    prod = e(op.multiply(_offset(qg, x1, int(q1.zero_point[0])), _offset(qg, x2, int(q2.zero_point[0]))))
    f = e(op.multiply(e(op.astype(prod, "float32")), q.rx_const(ratio, "float32")))
    f = e(op.add(f, q.rx_const(float(out.zero_point[0]), "float32")))
    info = np.iinfo(out.dtype)
    expr = q.rx_round_to_int(e, f, 0, int(info.min), int(info.max), out.dtype)
    rec = {"scheme": SCHEME, "kind": "mul", "inputs": [q1.record(), q2.record()], "output": out.record(),
           **({"constants": constants_record([c1, c2])} if c1 is not None or c2 is not None else {}),
           "requant": {"scale": float(ratio), "rounding": "half_to_even",
                       "rounding_rule": "y = clamp(round_half_even(float32(float32((x_a - zp_a) * (x_b - zp_b)) * scale) "
                                        "+ float32(zp_y))); scale = float32(float32(s_a * s_b) / s_y) (MLAS QLinearMul)"},
           "clamp": [int(info.min), int(info.max)]}
    return d1 + d2 + [comp.name, qb.name], expr, rec


def _chain_fn(chain, start: str):
    """A float32 function evaluating ``chain`` (numpy, irgen.reference's ops) on the values of ``start``."""
    from irgen.plugin import arg_ref, attrs_to_dict, run_layer

    relax, _, _, _ = _ops()
    index = {b.name: j for j, b in enumerate(chain)}
    ops = []
    for b in chain:
        args = []
        for a in b.value.args:
            if isinstance(a, relax.Var):
                args.append("input:0" if a.name == start else f"op:{index[a.name]}")
            else:
                args.append(arg_ref(a, {}, []))
        ops.append({"relax_op": b.op, "attrs": attrs_to_dict(b.value.attrs) if b.value.attrs is not None else {},
                    "args": args})
    layer = {"name": chain[-1].name, "fused_ops": ops, "results": [f"op:{len(ops) - 1}"]}
    return lambda v: run_layer(layer, [np.asarray(v, np.float32)], {})[0].astype(np.float32)


def _realize_table_chain(qg, qb, found, out):
    """An elementwise float chain between a dequantize and the quantize, as a 256-entry table:
    ONNX Runtime runs such ops in float on the dequantized values, one value at a time."""
    (x, qx, dqx), chain = found
    if _is_torch(qg):
        compound = _torch_compound(chain, dqx)
        if compound is None:  # torch runs the chain in float: a float span, as any other
            return realize_float(qg, qb, qg.producer(qb.value.args[0]), out)
        name, fn = compound
        table = _table(qx, out, fn, torch_rule=True)
        rec = {"scheme": SCHEME, "kind": "lut", "reference": "torch", "op": name, "inputs": [qx.record()],
               "output": out.record(), "table": [int(v) for v in table],
               "requant": {"rounding": "half_to_even", "rounding_rule":
                           f"table[i - min] = quantize_per_tensor(torch.nn.functional.{name}(dequantize(i))) (torch)"}}
        return [dqx] + [b.name for b in chain] + [qb.name], _lut(qg, x, table, qx.dtype), rec
    table = _table(qx, out, _chain_fn(chain, dqx))
    ops = "+".join(b.op.removeprefix("relax.") for b in chain)
    rec = {"scheme": SCHEME, "kind": "lut", "op": ops, "inputs": [qx.record()], "output": out.record(),
           "table": [int(v) for v in table],
           "requant": {"rounding": "half_to_even",
                       "rounding_rule": f"table[i - min] = quantize({ops}(dequantize(i))) in float32"}}
    return [dqx] + [b.name for b in chain] + [qb.name], _lut(qg, x, table, qx.dtype), rec


def _realize_unary(qg, qb, comp, out):
    tensor = qb.name
    x, qx, dqx = _need(qg, comp.value.args[0], "the input", tensor)
    if comp.op == "relax.clip":
        lo_v, hi_v = np.float32(comp.value.args[1].value), np.float32(comp.value.args[2].value)
        fn = lambda v: np.clip(v, lo_v, hi_v)  # noqa: E731
    else:
        fn = _torch_fn(comp.op) if _is_torch(qg) else _UNARY[comp.op]
    table = _table(qx, out, fn, _is_torch(qg))
    rec = {"scheme": SCHEME, "kind": "lut", "op": comp.op.removeprefix("relax."), "inputs": [qx.record()],
           **({"reference": "torch"} if _is_torch(qg) else {}),
           "output": out.record(), "table": [int(v) for v in table],
           "requant": {"rounding": "half_to_even",
                       "rounding_rule": "table[i - min] = quantize(f(dequantize(i))) in float32 (QlinearBuildLookupTable)"}}
    return [dqx, comp.name, qb.name], _lut(qg, x, table, qx.dtype), rec


def _realize_requantize(qg, qb, comp, out):
    """A dequantize straight into a quantize (torch's reference graph around an op the importer
    drops, such as an eval-mode dropout that torch's FX quantization observed on its own; an ONNX
    DQ -> Q pair): per element, so a table, with the frontend's quantize rule."""
    x, qx, dqx = _need(qg, comp.var, "the input", qb.name)
    torch = _is_torch(qg)
    table = _table(qx, out, torch_rule=torch)
    rule = ("table[i - min] = quantize_per_tensor(dequantize(i)) (torch)" if torch else
            "table[i - min] = quantize(dequantize(i)) in float32 (DequantizeLinear, QuantizeLinear)")
    rec = {"scheme": SCHEME, "kind": "lut", **({"reference": "torch"} if torch else {}), "op": "requantize",
           "inputs": [qx.record()], "output": out.record(), "table": [int(t) for t in table],
           "requant": {"rounding": "half_to_even", "rounding_rule": rule}}
    return [dqx, qb.name], _lut(qg, x, table, qx.dtype), rec


def _realize_move(qg, qb, comp, out):
    relax, _, _, _ = _ops()
    tensor = qb.name
    x, qx, dqx = _need(qg, comp.value.args[0], "the input", tensor)
    differ = qx.scale[0] != out.scale[0] or qx.zero_point[0] != out.zero_point[0] or qx.dtype != out.dtype
    torch = _is_torch(qg)
    if differ:
        # dequantize -> the move in float -> quantize with other parameters: per element, so a table then
        # the move on the integers. ORT runs such a node unit in float (its integer Slice/Transpose/MaxPool
        # need equal parameters), as torch's reference graph does (Inception V3's pool branch into a
        # concat); a max pool commutes with the table, which never decreases.
        table = _table(qx, out, torch_rule=torch)
        xt = qg.emit(_lut(qg, x, table, qx.dtype))
        v = comp.value
        expr = relax.Call(v.op, [xt] + list(v.args[1:]), v.attrs, v.sinfo_args if hasattr(v, "sinfo_args") else None)
        rule = ("table[i - min] = quantize_per_tensor(dequantize(i)) (torch), then the data movement" if torch else
                "table[i - min] = quantize(dequantize(i)) in float32 (DequantizeLinear, QuantizeLinear), then the "
                "data movement")
        rec = {"scheme": SCHEME, "kind": "lut", **({"reference": "torch"} if torch else {}),
               "op": comp.op.removeprefix("relax."), "inputs": [qx.record()], "output": out.record(),
               "table": [int(t) for t in table], "requant": {"rounding": "half_to_even", "rounding_rule": rule}}
        return [dqx, comp.name, qb.name], expr, rec
    v = comp.value
    expr = relax.Call(v.op, [x] + list(v.args[1:]), v.attrs, v.sinfo_args if hasattr(v, "sinfo_args") else None)
    rec = {"scheme": SCHEME, "kind": "integer", "op": comp.op.removeprefix("relax.").removeprefix("nn."),
           "inputs": [qx.record()], "output": out.record()}
    return [dqx, comp.name, qb.name], expr, rec


def _realize_quantize(qg, qb, out):
    _, op, q, _ = _ops()
    x = qb.value.args[0]
    if _is_torch(qg):
        rec = {"scheme": SCHEME, "kind": "quantize", "reference": "torch", "inputs": [], "output": out.record(),
               "clamp": [out.lo, out.hi], "requant": {"rounding": "half_to_even",
                           "rounding_rule": "y = saturate(round_half_even(x * float32(1/scale)) + zp) (torch)"}}
        return [qb.name], _rx_torch_quantize(qg, x, out), rec
    f = qg.emit(op.divide(x, q.rx_const(out.scale[0], "float32")))
    # a range narrower than the dtype's (an integer Clip after the QuantizeLinear, .ranges): ORT
    # saturates to the dtype, then clips; NaN -> the dtype's minimum -> lo
    expr = q.rx_round_to_int(qg.emit, f, int(out.zero_point[0]), out.lo, out.hi, out.dtype, nan_to_lo=True)
    rec = {"scheme": SCHEME, "kind": "quantize", "inputs": [], "output": out.record(),
           **({"clamp": [out.lo, out.hi]} if out.range else {}),
           "requant": {"rounding": "half_to_even",
                       "rounding_rule": "y = saturate(round_half_even(x / scale) + zp); NaN -> the type's minimum"}}
    return [qb.name], expr, rec


def _realize_softmax(qg, qb, comp, out):
    """ONNX Runtime's QLinearSoftmax (see :func:`irgen_qdq.ort.ort_softmax`)."""
    relax, op, q, _ = _ops()
    tensor = qb.name
    if _is_torch(qg):  # torch's softmax runs in float: the float span (no integer kernel)
        return None
    x, qx, dqx = _need(qg, comp.value.args[0], "the input", tensor)
    shape = [int(d) for d in x.ty.shape.values]
    axis = int(comp.value.attrs.axis) % len(shape)
    perm = None
    if axis != len(shape) - 1:  # ORT's opset-13 kernel transposes the axis last, and back
        perm = [d for d in range(len(shape)) if d != axis] + [axis]
        x = qg.emit(op.permute_dims(x, perm))
        shape = [shape[d] for d in perm]
    if qx.dtype != out.dtype:
        raise IrgenError(f"{SCHEME}: softmax {tensor!r} changes the integer type ({qx.dtype} -> {out.dtype})")
    signed = out.dtype == "int8"
    table = ort_softmax_table(float(qx.scale[0]), shape[-1], signed)
    e = qg.emit
    xi = e(op.astype(x, "int32"))
    idx = e(op.add(e(op.subtract(xi, e(op.max(xi, axis=[-1], keepdims=True)))),
                   q.rx_const(127 if signed else 255, "int32")))
    if signed:
        idx = e(op.bitwise_and(idx, q.rx_const(255, "int32")))
    ex = e(op.take(relax.const(table), idx, axis=0, mode="clip"))  # idx is in 0..255
    total = e(op.sum(ex, axis=[-1], keepdims=True))
    ys = float(np.floor(np.float32(1.0) / np.float32(out.scale[0])))
    # e * floor(1 / s_y) / sum in float64: finite for every output scale (in float32 the product
    # overflows when floor(1 / s_y) > n * e^5, a calibrated scale such as a MatMul input's)
    v = e(op.divide(e(op.multiply(e(op.astype(ex, "float64")), relax.const(ys, "float64"))),
                    e(op.astype(total, "float64"))))
    lo, hi = (-128, 127) if signed else (0, 255)
    vq = e(op.clip(e(op.add(e(op.round(v)), relax.const(float(out.zero_point[0]), "float64"))), lo, hi))
    vq = e(op.astype(vq, "int32"))
    if perm is not None:
        vq = e(op.permute_dims(vq, [perm.index(d) for d in range(len(perm))]))
    rec = {"scheme": SCHEME, "kind": "softmax", "axis": -1 if perm is None else axis, "inputs": [qx.record()],
           "output": out.record(),
           "table": "parameter 'table' (float32[256]): exp((i - 255 + b) * s_x), b = max(0, log(FLT_MAX / n) - 5) / s_x",
           "requant": {"rounding": "half_to_even",
                       "rounding_rule": "y = saturate(rint(e * floor(1 / s_y) / sum) + zp_y), e = table[x - max + 127 "
                                        "(int8) | 255 (uint8)], sum in float32 in row order, the quotient in "
                                        "float64 (ONNX Runtime's QLinearSoftmax)"}}
    return [dqx, comp.name, qb.name], op.astype(vq, out.dtype), rec
