"""Float layers: a span ``DQ -> float ops -> Q`` whose ops have no integer kernel in ONNX Runtime
(LayerNormalization, BatchNormalization not folded into a conv, a per-channel constant
operand...). ORT dequantizes the inputs (constants too), runs the float ops and quantizes the
result; irgen does the same, the float ops in float64 on the float32 dequantized values, rounded
once to float32 before the quantize (so TVM and the numpy recompute agree), and records
``"realization": "float"`` with the program of the ops (:func:`realize_float`,
:func:`recompute_float`). A torch reference graph's span is the same, quantized with torch's rule.
"""

from __future__ import annotations

import numpy as np

from irgen.plugin import IrgenError

from .common import SCHEME, _is_torch, _offset, _ops
from .operands import _args, _const_array, _dequantized_constant, constant_tensor, quantized_constant
from .torch_ref import torch_quantize
from .torch_spans import _rx_torch_quantize


class UnquantizedSource(IrgenError):
    """A float span reaches a tensor no dequantize gives (a model input, or what float ops compute
    from one: the embeddings of a model ``quantize_static`` quantized only at its MatMuls). Its
    float ops stay float layers and the quantize quantizes their result
    (:func:`irgen_qdq.realize._realize_span`)."""


def recompute_float(layer, inputs, params=None) -> np.ndarray:
    """A ``realization: float`` layer from its record: its ``program`` (fused-ops form, float64) on the
    dequantized inputs, rounded to float32, then QuantizeLinear."""
    from irgen.plugin import quantize_linear, run_layer

    qr = layer["quant"]
    out = qr["output"]
    deq = [((x.astype(np.int32) - along(i["zero_point"], i, x.ndim, np.int32)).astype(np.float32)
            * along(i["scale"], i, x.ndim, np.float32)).astype(np.float64) for x, i in zip(inputs, qr["inputs"])]
    prog = qr["program"]
    # the span's value: the program's last op, or the one ``result`` names (an item of a split)
    y = run_layer({"name": layer.get("name", "?"), "fused_ops": prog, "results": [qr.get("result") or f"op:{len(prog) - 1}"]},
                  deq, params or {})[0]
    y = np.asarray(y).astype(np.float32)
    if qr.get("reference") == "torch":

        return torch_quantize(y, out["scale"], int(out["zero_point"]), *qr["clamp"], out["dtype"])
    return quantize_linear(y, along(out["scale"], out, y.ndim, np.float32), along(out["zero_point"], out, y.ndim,
                                                                                   np.int64), out["dtype"])


def along(values, rec: dict, ndim: int, dtype):
    """A record's scale or zero point as a scalar, or per channel shaped along its ``axis`` (NNCF
    quantizes a depthwise convolution's input per channel)."""
    from irgen.plugin import per_axis

    v = np.asarray(values, dtype)
    return v.reshape(-1)[0].item() if v.size == 1 and v.dtype.kind in "iu" else v.reshape(-1)[0] if v.size == 1 \
        else per_axis(v, int(rec["axis"]), ndim)


def realize_float(qg, qb, last, out):
    """``DQ -> float ops -> Q`` as ORT runs it without an integer kernel: the float ops on the
    dequantized inputs (float64 here, rounded once to float32), then QuantizeLinear. In a torch
    reference graph (torch runs every op between its dequantize and quantize in float32) the
    same float ops, then torch's quantize_per_tensor (multiply by the float32 inverse scale)."""
    from tvm.relax import op

    tensor = qb.name
    names, acts, consts, dqs = _span_members(qg, last, tensor)
    # float ops another span reads too (torch: a pad each of four sliced-and-quantized windows
    # reads; ONNX: ConvNeXt V2's ReduceL2 read by its quantized mean and by the division) are
    # computed again in each span, the same values; they stay while read
    order = [b for b in qg.bindings if b.name in names]
    new, refs, inputs = _dequantized_inputs(qg, acts, consts, order, tensor)
    start = len(qg._pending)
    e = _folding(qg.emit)
    torch = _is_torch(qg)
    for b in order:
        conv = None if torch else _mlas_conv(qg, e, b, new)
        new[b.name] = conv if conv is not None else _float64_op(e, b, new, tensor)
    program = _program(qg._pending[start:], refs)
    result = refs.get(getattr(new[last.name], "name", None), f"op:{len(program) - 1}")
    y = e(op.astype(new[last.name], "float32"))
    expr, rule = _quantized_result(qg, e, y, out, torch)
    ops = "+".join(b.op.removeprefix("relax.") for b in order if b.op)
    rec = {"scheme": SCHEME, "kind": "float", "realization": "float", "op": ops,
           **({"reference": "torch"} if torch else {}),
           "inputs": [qx.record() for qx in inputs], "output": out.record(), "program": program,
           "result": result, "requant": {"rounding": "half_to_even", "rounding_rule": rule},
           "clamp": [out.lo, out.hi]}
    return dqs + [b.name for b in order] + [qb.name], expr, rec


def _span_members(qg, last, tensor: str):
    """The float span ending at binding ``last``, walked back to its dequantizes: ``(the names of
    its float ops, its dequantized activations (int var, QTensor, dq name) in first-use order,
    {dq name: float32 values} of its dequantized constants, the dequantize/quantize bindings it
    folds)``. A float input no dequantize gives is :class:`UnquantizedSource`."""
    from tvm import relax

    from irgen.plugin import Constant

    members: dict[str, object] = {}
    acts: list = []  # (int var, QTensor, dq name), in first-use order
    consts: dict[str, np.ndarray] = {}  # dq name -> float32 values
    dqs: list[str] = []
    stack = [last]
    while stack:
        b = stack.pop()
        if b.name in members:
            continue
        if b.op in ("relax.quantize", "relax.dequantize"):
            raise IrgenError(f"{SCHEME}: cannot realize {b.op} before {tensor!r}")
        members[b.name] = b
        for a in _args(b.value):
            if not isinstance(a, relax.Var):
                continue
            pb = qg.producer(a)
            if pb is None:
                raise UnquantizedSource(f"{SCHEME}: an input of {tensor!r} ({a.name!r}) is a float tensor that "
                                        "is not quantized")
            qc = quantized_constant(qg, a)
            if qc is not None:
                arr, qt, qnames = qc
                consts.setdefault(pb.name, (arr.astype(np.int64) - int(qt.zero_point[0])).astype(np.float32)
                                  * np.float32(qt.scale[0]))
                dqs.extend(qnames)
            elif pb.op == "relax.dequantize":
                if isinstance(pb.value.args[0], Constant):
                    consts.setdefault(pb.name, _dequantized_constant(qg, pb))
                elif pb.name not in [d for _, _, d in acts]:
                    d = dequantized_activation(qg, a)
                    if d is None:
                        raise IrgenError(f"{SCHEME}: an input of {tensor!r} is not a dequantized integer tensor")
                    c = constant_tensor(qg, d[0])
                    if c is not None:  # integers computed from constants (a quantized position bias): TVM
                        # folds them into a literal, so the span reads them dequantized, as a constant
                        consts[pb.name] = (c.astype(np.int64) - int(d[1].zero_point[0])).astype(np.float32) \
                            * np.float32(d[1].scale[0])
                    else:
                        acts.append(d)
                dqs.append(pb.name)
            else:
                stack.append(pb)
    return set(members), acts, consts, dqs


def dequantized_activation(qg, expr):
    """``(int var, QTensor, dq name)`` when ``expr`` is the dequantize of an activation, its
    parameters per tensor or per channel (a float span dequantizes either), else None."""
    from tvm import relax

    from .common import _qparams

    b = qg.producer(expr)
    if b is None or b.op != "relax.dequantize" or not isinstance(b.value.args[0], relax.Var):
        return None
    src = b.value.args[0]
    return src, _qparams(qg, b.value, src.name), b.name


def rx_along(qt, values, ndim: int, dtype: str):
    """``values`` (a QTensor's scale or zero point) as a Relax constant: a scalar, or per channel
    along the QTensor's axis."""
    from irgen.plugin import per_axis

    _, _, q, _ = _ops()
    v = np.asarray(values).reshape(-1)
    return q.rx_const(v[0] if v.size == 1 else per_axis(v, int(qt.axis), ndim), dtype)


def _dequantized_inputs(qg, acts, consts, order, tensor: str):
    """The span's dequantized activations as float64 Relax values, bound first and in the order
    the span's ops first read them (the layer's inputs follow it), and its constants as float64
    literals: ``(dq name -> value, value name -> "input:K", the inputs' QTensors)``. One tensor
    dequantized by two nodes (PT2E's Arm quantizer gives each reader its own: SqueezeNet's two
    expand convs) is one input."""
    from tvm import relax
    from tvm.relax import op

    e = qg.emit
    new: dict[str, object] = {}
    refs: dict[str, str] = {}
    acts.sort(key=lambda d: min(j for j, b in enumerate(order) if d[2] in [getattr(a, "name", None) for a in _args(b.value)]))
    seen: dict[str, tuple] = {}
    inputs = []
    for x, qx, d in acts:
        key = getattr(x, "name", None) or str(id(x))
        if key in seen:
            other, qo = seen[key]
            if not (np.array_equal(qo.scale, qx.scale) and np.array_equal(qo.zero_point, qx.zero_point)
                    and qo.dtype == qx.dtype):
                raise IrgenError(f"{SCHEME}: {key!r} is dequantized with two sets of parameters before {tensor!r}")
            new[d] = new[other]
            continue
        seen[key] = (d, qx)
        ndim = len(x.ty.shape.values)
        xs = _offset(qg, x, int(qx.zero_point[0])) if qx.zero_point.size == 1 else \
            e(op.subtract(e(op.astype(x, "int32")), rx_along(qx, qx.zero_point, ndim, "int32")))
        f = e(op.multiply(e(op.astype(xs, "float32")), rx_along(qx, qx.scale, ndim, "float32")))
        new[d] = e(op.astype(f, "float64"))
        refs[new[d].name] = f"input:{len(inputs)}"
        inputs.append(qx)
    for d, v in consts.items():
        new[d] = relax.const(v.astype(np.float64), "float64")
    return new, refs, inputs


def _float64_arg(a, new: dict):
    """An argument of a span's op in the float64 copy: a variable as its new value (``new``), a
    float32 constant as float64."""
    from tvm import relax

    from irgen.plugin import Constant

    if isinstance(a, relax.Var):
        v = new[a.name]
        return relax.Tuple(v) if isinstance(v, list) else v  # a decomposed tuple read whole
    if isinstance(a, relax.Tuple):
        return relax.Tuple([_float64_arg(f, new) for f in a.fields])
    if isinstance(a, Constant) and str(a.ty.dtype) == "float32":
        return relax.const(a.value.numpy().astype(np.float64), "float64")
    return a


def _float64_op(e, b, new: dict, tensor: str):
    """Binding ``b`` of the span computed in float64 (bound with ``e``): its new value (a list for a
    tuple-valued op decomposed into its items)."""
    from tvm import relax
    from tvm.relax import op

    v = b.value
    if isinstance(v, relax.TupleGetItem) and isinstance(new.get(v.tuple_value.name), list):
        return new[v.tuple_value.name][int(v.index)]  # an item of a decomposed tuple op
    if isinstance(v, relax.TupleGetItem):
        return e(relax.TupleGetItem(_float64_arg(v.tuple_value, new), int(v.index)))
    if isinstance(v, relax.Tuple):  # a tuple bound whole (timm's qkv.unbind(0)): its items
        return [_float64_arg(f, new) for f in v.fields]
    if b.op == "relax.astype" and str(v.attrs.dtype) == "float32":
        return e(op.astype(_float64_arg(v.args[0], new), "float64"))
    if b.op in FLOAT64:
        return FLOAT64[b.op](e, [_float64_arg(a, new) for a in v.args], v.attrs)
    if isinstance(v, relax.Call):
        return e(relax.Call(v.op, [_float64_arg(a, new) for a in v.args], _float64_out(v.attrs),
                            getattr(v, "sinfo_args", None)))
    if isinstance(v, relax.ShapeExpr):  # a reshape's target shape bound on its own (Swin)
        return v
    raise IrgenError(f"{SCHEME}: cannot realize {b.kind} before {tensor!r}")


def _mlas_conv(qg, e, b, new: dict):
    """A convolution of the span as ONNX Runtime's MLAS computes it in float32 (:mod:`.mlas`), as a
    float64 value (exact); None where MLAS's order is not the one :mod:`.mlas` knows (the span then
    computes it in float64)."""
    from tvm.relax import op

    from irgen.plugin import Constant

    from . import mlas

    if b.op not in ("relax.nn.conv2d", "relax.nn.conv3d"):
        return None
    x, w = (_float64_arg(a, new) for a in b.value.args[:2])
    if not isinstance(w, Constant):
        return None
    w64 = w.value.numpy()
    w32 = w64.astype(np.float32)
    if not np.array_equal(w32.astype(np.float64), w64) or not mlas.applies(b.value, x.ty.shape.values, w32.shape):
        return None
    y = mlas.emit_conv(qg, e, b.value, e(op.astype(x, "float32")), w32)
    return e(op.astype(y, "float64"))


def _program(bound, refs: dict[str, str]) -> list[dict]:
    """The program of the float ops as ``bound`` (the quant record's own copy of the arithmetic, in
    fused-ops form); ``refs`` gains each binding's ``"op:K"``."""
    from tvm import relax

    from irgen.plugin import attrs_to_dict, kernel_op, op_args, program_arg

    program = []
    for pb in bound:
        v = pb.value
        if isinstance(v, relax.TupleGetItem):
            program.append({"relax_op": "tgi", "attrs": {"index": int(v.index)}, "args": [refs[v.tuple_value.name]]})
        elif isinstance(v, relax.Call) and str(v.op.name) == "relax.call_tir":  # a kernel of .mlas
            name, attrs = kernel_op(v.args[0].name_hint)
            program.append({"relax_op": name, "attrs": attrs, "args": [program_arg(a, refs) for a in v.args[1].fields]})
        else:
            program.append({"relax_op": str(v.op.name), "attrs": attrs_to_dict(v.attrs) if v.attrs is not None else {},
                            "args": [program_arg(a, refs) for a in op_args(v)]})
        refs[pb.name] = f"op:{len(program) - 1}"
    return program


def _quantized_result(qg, e, y, out, torch: bool):
    """``(expr, rounding rule)``: the span's float32 result ``y`` quantized, with torch's
    quantize_per_tensor or ONNX Runtime's QuantizeLinear (bound with ``e``)."""
    from tvm.relax import op

    if torch:
        return _rx_torch_quantize(qg, y, out), (
            "y = saturate(round_half_even(float32(program(float64(float32(x - zp_x) * s_x))) * float32(1 / s_y)) "
            "+ zp_y) (torch: dequantize_per_tensor, the float ops, quantize_per_tensor)")
    info = np.iinfo(out.dtype)
    # MLAS's QuantizeLinear: x / s_y, clamped with max then min, rounded half to even, + zp_y; per
    # channel (NNCF) each channel's. The max as ``where(f > low, f, low)``: a NaN (0/0 in a float
    # span) becomes the type's minimum, in TVM and in numpy alike (``isnan`` fuses with no convolution)
    ndim = len(y.ty.shape.values)
    zp = np.broadcast_to(out.zero_point.reshape(-1), out.scale.shape).astype(np.int64)
    f = e(op.divide(y, rx_along(out, out.scale, ndim, "float32")))
    low = rx_along(out, int(info.min) - zp, ndim, "float32")
    f = e(op.minimum(e(op.where(e(op.greater(f, low)), f, low)), rx_along(out, int(info.max) - zp, ndim, "float32")))
    r = e(op.astype(e(op.round(f)), "int32"))
    expr = op.astype(e(op.add(r, rx_along(out, zp, ndim, "int32"))), out.dtype)
    return expr, ("y = saturate(round_half_even(float32(program(float64(float32(x - zp_x) * s_x))) / s_y) + zp_y); "
                  "constants dequantized as float32(q - zp) * s (ONNX Runtime: DequantizeLinear, the float "
                  "ops, QuantizeLinear)")


def _folding(emit):
    """``emit``, except that a call of constants alone is evaluated now (irgen's numpy reference
    ops) and returned as a constant: TVM would fold it after the span is realized (a weight's
    transpose, a norm's ``sqrt(var + eps)``) into a new constant that the record's ``program``,
    written now, could not name as the layer parameter it becomes."""
    from tvm import relax

    from irgen.plugin import Constant, attrs_to_dict, run_op

    def arg(a):
        if isinstance(a, Constant):
            return _const_array(a)
        if isinstance(a, relax.ShapeExpr):
            return {"shape": [int(x) for x in a.values]}
        raise TypeError

    def folding(expr):
        if not isinstance(expr, relax.Call) or not any(isinstance(a, Constant) for a in expr.args):
            return emit(expr)
        try:
            args = [arg(a) for a in expr.args]
            ty = relax.BlockBuilder().normalize(expr).ty
            value = run_op(str(expr.op.name), args, attrs_to_dict(expr.attrs))
            return relax.const(np.asarray(value).astype(str(ty.dtype)).reshape([int(d) for d in ty.shape]),
                               str(ty.dtype))
        except Exception:  # noqa: BLE001  a variable operand, a tuple result, an op the reference lacks: TVM's
            return emit(expr)

    return folding


def _float64_out(attrs):
    """A call's attributes with a float ``out_dtype`` (torch's importer writes ``float32`` on a float
    matmul or conv; ONNX's leaves it unset) made ``float64``, so the float span stays in float64."""
    import tvm

    if attrs is None or str(getattr(attrs, "out_dtype", None) or "") not in ("float32", "float16"):
        return attrs
    info = type(attrs).__tvm_ffi_type_info__
    fields = {f.name: getattr(attrs, f.name) for f in info.fields}
    return tvm.ir.make_node(info.type_key, **{**fields, "out_dtype": "float64"})


def _layer_norm64(e, args, attrs):
    """relax.nn.layer_norm (float32/16 only in TVM) as float64 elementary ops:
    ``(x - mean) / sqrt(var + eps) * gamma + beta``, sums in index order."""
    from tvm.relax import op

    x, gamma, beta = args
    y = _standardize64(e, x, [int(a) % len(x.ty.shape.values) for a in attrs.axes], float(attrs.epsilon))
    if bool(attrs.scale):
        y = e(op.multiply(y, gamma))
    if bool(attrs.center):
        y = e(op.add(y, beta))
    return y


def _standardize64(e, x, axes: list[int], epsilon: float):
    """``(x - mean) / sqrt(var + eps)`` over ``axes`` in float64 elementary ops, sums in index
    order: the core of LayerNorm and GroupNorm."""
    from tvm.relax import op

    shape = [int(d) for d in x.ty.shape.values]
    n = _f64(float(np.prod([shape[a] for a in axes])))
    mean = e(op.divide(e(op.sum(x, axis=axes, keepdims=True)), n))
    xc = e(op.subtract(x, mean))
    var = e(op.divide(e(op.sum(e(op.multiply(xc, xc)), axis=axes, keepdims=True)), n))
    return e(op.divide(xc, e(op.sqrt(e(op.add(var, _f64(epsilon)))))))


def _group_norm64(e, args, attrs):
    """relax.nn.group_norm (float32/16 only in TVM) as float64 elementary ops, as TVM's
    ``group_norm``: the channel axis split into (groups, channels per group), each group's
    ``(x - mean) / sqrt(var + eps)`` over its channels and ``axes``, then ``* gamma + beta``
    per channel (PoolFormer's GroupNorm(1, C))."""
    from tvm.relax import op

    x, gamma, beta = args
    shape = [int(d) for d in x.ty.shape.values]
    nd = len(shape)
    c, groups = int(attrs.channel_axis) % nd, int(attrs.num_groups)
    grouped = [*shape[:c], groups, shape[c] // groups, *shape[c + 1:]]
    axes = [c + 1, *(a if a < c else a + 1 for a in (int(a) % nd for a in attrs.axes))]
    y = e(op.reshape(_standardize64(e, e(op.reshape(x, grouped)), axes, float(attrs.epsilon)), shape))
    per_channel = [shape[c] if a == c else 1 for a in range(nd)]
    if bool(attrs.scale):
        y = e(op.multiply(y, e(op.reshape(gamma, per_channel))))
    if bool(attrs.center):
        y = e(op.add(y, e(op.reshape(beta, per_channel))))
    return y


def _f64(v):
    from tvm import relax

    return relax.const(np.asarray(v, np.float64), "float64")


def _batch_norm64(e, args, attrs):
    """relax.nn.batch_norm (inference) as float64 elementary ops, a list of its outputs:
    ``[(x - mean) / sqrt(var + eps) * gamma + beta, mean, var]``."""
    from tvm.relax import op

    from irgen.plugin import per_axis

    x, gamma, beta, mean, var = args
    ndim = len(x.ty.shape.values)
    axis = int(attrs.axis) % ndim

    def chan(c):
        return _f64(per_axis(c.value.numpy(), axis, ndim))

    y = e(op.divide(e(op.subtract(x, chan(mean))), e(op.sqrt(e(op.add(chan(var), _f64(float(attrs.epsilon))))))))
    if bool(attrs.scale):
        y = e(op.multiply(y, chan(gamma)))
    if bool(attrs.center):
        y = e(op.add(y, chan(beta)))
    return [y, mean, var]


#: float ops TVM computes only in float32 (or as tuples), as float64 elementary ops
def _split64(e, args, attrs):
    """relax.split as one strided slice per item (a tuple-valued op inside a float layer would
    leave its items outside the layer): the list of items."""
    from tvm.relax import op

    x = args[0]
    shape = [int(d) for d in x.ty.shape.values]
    axis = int(attrs.axis) % len(shape)
    ios = attrs.indices_or_sections
    if hasattr(ios, "value"):  # sections of equal size
        step = -(-shape[axis] // int(ios.value))
        cuts = list(range(step, shape[axis], step))
    else:
        cuts = [int(i) for i in ios]
    bounds = [0, *cuts, shape[axis]]
    return [e(op.strided_slice(x, [axis], [b], [max(b, n)])) for b, n in zip(bounds, bounds[1:])]


FLOAT64 = {"relax.nn.layer_norm": _layer_norm64, "relax.nn.group_norm": _group_norm64, "relax.nn.batch_norm": _batch_norm64,
           "relax.split": _split64}
