"""Operands of the integer kernels that are not plain dequantized activations.

``quantize_static`` puts Q->DQ on constants feeding Add/Mul (the bias Add after a MatMul, a
layer-scale gamma, GELU's ``+ 1`` and ``* 0.5``); ONNX Runtime fuses those into
QLinearAdd/QLinearMul with the integer constant as an operand (:func:`operand`). Scalars computed
from shapes and quantized (``sqrt(1/sqrt(d))`` of ``scaled_dot_product_attention``) and operands
computed from constants alone (:func:`constant_tensor`) are folded by TVM into literals, which the
quant record carries as ``constants`` (:func:`constants_record`). :func:`elementwise_dag` finds an
elementwise graph on one dequantized tensor (HardSwish ``x * clip(x + 3, 0, 6) / 6``, GELU's
``x/sqrt2 -> erf``), which becomes a 256-entry table.
"""

from __future__ import annotations

import numpy as np

from irgen.plugin import IrgenError

from .common import SCHEME, _const_chain, _dequantized, _drop, _is_torch, _ops, _qparams


#: elementwise ops a table can absorb (on one dequantized tensor and scalar constants)
ELEMENTWISE = {"relax.add", "relax.subtract", "relax.multiply", "relax.divide", "relax.clip", "relax.nn.relu",
               "relax.sigmoid", "relax.tanh", "relax.exp", "relax.minimum", "relax.maximum", "relax.negative",
               "relax.abs", "relax.sqrt", "relax.power", "relax.erf"}


def _args(value):
    """The variables and constants a binding's value reads, Tuple fields flattened."""
    from tvm import relax

    if isinstance(value, relax.TupleGetItem):
        return [value.tuple_value]
    if isinstance(value, relax.Tuple):
        return list(value.fields)
    out = []
    for a in getattr(value, "args", []):
        out.extend(a.fields if isinstance(a, relax.Tuple) else [a])
    return out


def _users_inside(qg, name: str, members: set[str]) -> bool:
    return qg.n_users(name) == len(qg.users.get(name, [])) and all(
        qg.bindings[i].name in members for i in qg.users.get(name, []))


def operand(qg, expr, tensor: str, what: str = "an input"):
    """An integer operand of QLinearAdd/QLinearMul: ``(relax expr of the integers, QTensor, names to drop,
    constant array or None)`` for a dequantized activation or a per-tensor dequantized constant."""
    from tvm import relax

    qc = quantized_constant(qg, expr)
    r = None if qc is not None else _dequantized(qg, expr)
    if r is not None:
        x, qt, d = r
        c = constant_tensor(qg, x)
        if c is not None and qt.scale.size == 1:  # computed from constants: TVM folds it into a literal
            return relax.const(c), qt, [d], c
        return x, qt, [d], None
    if qc is not None:
        arr, qt, names = qc
        chain = [qg.by_name[n] for n in names]
    else:
        try:
            arr, qt, chain = _const_chain(qg, expr, tensor, what)
        except IrgenError:
            from irgen.plugin import Constant

            if isinstance(expr, Constant) and str(expr.ty.dtype).startswith("float"):
                # a float constant no QuantizeLinear gave (an op quantize_static left out of
                # op_types_to_quantize): ORT runs the op in float
                raise IrgenError(f"{SCHEME}: {what} of {tensor!r} is a float constant; no integer kernel") from None
            pb = qg.producer(expr) if isinstance(expr, relax.Var) else None
            if pb is not None and pb.op not in ("relax.dequantize", "relax.quantize") and constant_tensor(qg, expr) is None:
                # computed in float from dequantized tensors (an InstanceNormalization before its bias
                # add): ORT runs the whole span in float
                raise IrgenError(f"{SCHEME}: {what} of {tensor!r} is computed in float; no integer kernel") from None
            raise IrgenError(f"{SCHEME}: {what} of {tensor!r} is not a dequantized integer tensor") from None
    if qt.scale.size != 1:
        raise IrgenError(f"{SCHEME}: {what} of {tensor!r} is a per-channel constant; no integer kernel")
    if str(arr.dtype) not in ("int8", "uint8"):
        raise IrgenError(f"{SCHEME}: {what} of {tensor!r} is a {arr.dtype} constant; no integer kernel")
    return relax.const(arr), qt, _drop(qg, chain), arr


def constant_tensor(qg, expr):
    """The value of a tensor computed from constants alone (a realized gather of an embedding table
    by constant positions, a quantized class token, a dequantized constant gathered in float),
    evaluated with irgen's numpy reference; else
    None. TVM folds such layers into literals, so the layers reading them record the values."""
    from irgen.plugin import Constant

    if isinstance(expr, Constant):
        return _const_array(expr)
    members = _constant_members(qg, expr)
    if members is None:
        return None
    values: dict[str, object] = {}
    for b in qg.bindings:
        if b.name in members:
            try:
                values[b.name] = _constant_value(b, values)
            except _NotEvaluated:
                return None
    return np.asarray(values[expr.name])


def _constant_members(qg, expr):
    """The names of the bindings ``expr`` is computed with, when it is computed from constants
    alone (ONNX: through a QuantizeLinear of constants too: GPT-J's rotary table, Swin V2's
    position bias), else None."""
    from tvm import relax

    from irgen.plugin import Constant

    torch = _is_torch(qg)
    members, stack = {}, [expr]
    while stack:
        e = stack.pop()
        if isinstance(e, relax.Tuple):
            stack.extend(e.fields)
            continue
        if not isinstance(e, relax.Var):
            if isinstance(e, (Constant, relax.ShapeExpr)) or hasattr(e, "value"):
                continue
            return None
        b = qg.producer(e)
        if b is None or (b.op == "relax.quantize" and torch) or (b.op == "relax.dequantize" and not all(
                isinstance(a, Constant) for a in b.value.args[0 if torch else 1:])):
            return None  # (ONNX: the dequantized integers may be computed from constants: GPT-J's rotary tables)
        if b.name in members:
            continue
        if not isinstance(b.value, (relax.Call, relax.TupleGetItem, relax.ShapeExpr)):
            return None
        members[b.name] = b
        if isinstance(b.value, relax.ShapeExpr):
            continue
        stack.extend([b.value.tuple_value] if isinstance(b.value, relax.TupleGetItem) else list(b.value.args))
    return members


class _NotEvaluated(Exception):
    """An op of a constant computation that irgen's numpy reference lacks: TVM computes it, as a layer."""


def _constant_operand(a, values: dict):
    """An operand of a constant computation as an array (``values``: the bindings evaluated so far)."""
    from tvm import relax

    from irgen.plugin import Constant

    if isinstance(a, relax.Var):
        return values[a.name]
    if isinstance(a, Constant):
        return _const_array(a)
    if isinstance(a, relax.ShapeExpr):
        return np.asarray([int(d) for d in a.values], np.int64)
    if hasattr(a, "value"):
        return np.asarray(a.value)
    raise IrgenError(f"{SCHEME}: cannot evaluate {a!r}")


def _constant_value(b, values: dict):
    """The value of binding ``b`` of a constant computation: a quantize as ONNX Runtime's
    QuantizeLinear, a dequantize of a constant as ``float32(q - zp) * scale`` (per tensor or per
    axis), any other op with irgen's numpy reference (:class:`_NotEvaluated` when it lacks it)."""
    from tvm import relax

    from irgen.plugin import attrs_to_dict, quantize_linear, run_op

    v = b.value
    if isinstance(v, relax.TupleGetItem):
        return values[v.tuple_value.name][int(v.index)]
    if isinstance(v, relax.ShapeExpr):
        return _constant_operand(v, values)
    args = []
    for a in v.args:
        args.extend([_constant_operand(f, values) for f in a.fields] if isinstance(a, relax.Tuple)
                    else [_constant_operand(a, values)])
    if b.op == "relax.shape_to_tensor":
        return np.asarray(args[0], np.int64)
    if b.op == "relax.quantize" and np.asarray(args[1]).size == 1:  # as ONNX Runtime's QuantizeLinear
        return quantize_linear(args[0], np.float32(np.asarray(args[1]).reshape(())),
                               int(np.asarray(args[2]).reshape(())), str(v.attrs.out_dtype))
    if b.op == "relax.dequantize":  # of a constant: float32(q - zp) * scale, per tensor or per axis
        q, scale, zp = args
        shape = [1] * q.ndim
        if np.asarray(scale).size > 1:
            shape[int(v.attrs.axis) % q.ndim] = -1
        offset = q.astype(np.int32) - np.asarray(zp, np.int32).reshape(shape or ())
        return offset.astype(np.float32) * np.asarray(scale, np.float32).reshape(shape or ())
    try:
        return run_op(b.op, args, attrs_to_dict(v.attrs) if v.attrs is not None else {}, b.name)
    except Exception as err:  # noqa: BLE001  an op the numpy reference lacks: left to TVM, as a layer
        raise _NotEvaluated(str(err)) from err


def _const_array(c) -> np.ndarray:
    """A constant's value as an array (scalar literals hold a Python number)."""
    v = c.value
    if hasattr(v, "numpy"):
        return v.numpy()
    dtype = getattr(getattr(c, "ty", None), "dtype", None)
    return np.asarray(v, str(dtype) if dtype is not None else None)


def quantized_constant(qg, expr):
    """``DQ(Q(float constant))`` (a Constant node quantized at run time, GELU's 1 and 0.5):
    (integer array as QuantizeLinear computes it, QTensor, [dq, q] bindings) or None."""
    dq = qg.producer(expr)
    if dq is None or dq.op != "relax.dequantize":
        return None
    qb = qg.producer(dq.value.args[0])
    if qb is None or qb.op != "relax.quantize":
        return None
    found = run_time_quantized(qg, qb)
    if found is None or found[0] is None:
        return None
    return found[0], _qparams(qg, dq.value, dq.name), [dq.name, qb.name]


def run_time_quantized(qg, qb):
    """A quantize ``qb`` of a float constant (ONNX Runtime quantizes it at run time): (its integers
    as QuantizeLinear computes them, or None when it is per channel; its QTensor), or None when its
    input is not a constant (:func:`constant_value`)."""
    from irgen.plugin import quantize_linear

    value = constant_value(qg, qb.value.args[0])
    if value is None:
        return None
    qt = _qparams(qg, qb.value, qb.name)
    if qt.scale.size != 1:
        return None, qt
    return quantize_linear(value, np.float32(qt.scale[0]), int(qt.zero_point[0]), qt.dtype), qt


def _dequantized_constant(qg, b) -> np.ndarray:
    """ORT's DequantizeLinear of a constant: ``float32(q - zp) * float32(scale)`` per axis."""
    arr = b.value.args[0].value.numpy()
    ax = int(b.value.attrs.axis) % max(arr.ndim, 1)
    qt = _qparams(qg, b.value, b.name, arr.shape[ax] if arr.ndim else 1)
    shape = [1] * arr.ndim
    if qt.scale.size > 1:
        shape[ax] = qt.scale.size
    s = qt.scale.astype(np.float32).reshape(shape if qt.scale.size > 1 else ())
    z = qt.zero_point.astype(np.int64).reshape(shape if qt.zero_point.size > 1 else ())
    return (arr.astype(np.int64) - z).astype(np.float32) * s


def constant_value(qg, expr):
    """The float32 value of a float constant, or of a dequantized integer constant (an initializer
    shared through Identity and quantized again, DenseNet's BatchNorm weights), else None."""
    from irgen.plugin import Constant

    if isinstance(expr, Constant):
        v = expr.value.numpy()
        return v if v.dtype == np.float32 else None
    b = qg.producer(expr)
    if b is not None and b.op == "relax.dequantize" and isinstance(b.value.args[0], Constant):
        return _dequantized_constant(qg, b)
    v = _scalar_constant(qg, expr)
    return v if v is not None and v.dtype == np.float32 else None


def _scalar_constant(qg, expr, depth: int = 0):
    """The value of a scalar computed from constants only (ViT's ``sqrt(1 / sqrt(head_dim))`` from a
    folded shape), evaluated in numpy as ORT's float32 kernels do (sqrt, divide: correctly rounded), or None."""
    from tvm import relax

    from irgen.plugin import Constant, attrs_to_dict, run_op

    if isinstance(expr, Constant):
        return _const_array(expr)
    b = qg.producer(expr)
    if depth > 16 or b is None or not isinstance(b.value, relax.Call) or b.op in (
            "relax.quantize", "relax.dequantize", None) or b.op not in _SCALAR_OPS:
        return None
    args = []
    for a in b.value.args:
        v = _scalar_constant(qg, a, depth + 1)
        if v is None:
            return None
        args.append(v)
    out = np.asarray(run_op(b.op, args, attrs_to_dict(b.value.attrs) if b.value.attrs is not None else {}, b.name))
    return out if out.size == 1 else None


#: ops a scalar constant may be computed with (each correctly rounded in float32, as ORT computes them)
_SCALAR_OPS = {"relax.sqrt", "relax.divide", "relax.multiply", "relax.add", "relax.subtract", "relax.astype",
               "relax.negative", "relax.reshape"}


def constants_record(arrays) -> dict:
    """``{operand index: {"shape", "values"}}`` of the constant operands of an integer layer."""
    return {str(k): {"shape": list(a.shape), "values": [int(v) for v in a.reshape(-1)]}
            for k, a in enumerate(arrays) if a is not None}


def _float_operand(qg, expr) -> bool:
    """``expr`` is a float tensor computed by float ops (not a dequantize, nor from constants)."""
    relax, _, _, _ = _ops()
    b = qg.producer(expr) if isinstance(expr, relax.Var) else None
    return b is not None and b.op != "relax.dequantize" and constant_value(qg, expr) is None \
        and quantized_constant(qg, expr) is None


def elementwise_dag(qg, last):
    """The bindings from one dequantize(int var) to ``last`` when all are elementwise ops on that
    tensor and scalar constants, each used only inside: ((int var, QTensor, dq name), bindings in order)."""
    from tvm import relax

    from irgen.plugin import Constant

    members: dict[str, object] = {}
    source = None
    stack = [last]
    while stack:
        b = stack.pop()
        if b.name in members:
            continue
        if b.op not in ELEMENTWISE:
            return None
        members[b.name] = b
        for a in _args(b.value):
            if isinstance(a, relax.Var):
                d = _dequantized(qg, a)
                if d is not None:
                    if source is not None and source[2] != d[2]:
                        return None
                    source = d
                    continue
                pb = qg.producer(a)
                if pb is None:
                    return None
                stack.append(pb)
            elif isinstance(a, Constant) and hasattr(a.value, "numpy") and a.value.numpy().size != 1:
                return None  # a per-channel operand (a float bias add): no table
    if source is None:
        return None
    names = set(members)
    if any(n != last.name and not _users_inside(qg, n, names) for n in names):
        return None
    return source, [b for b in qg.bindings if b.name in names]
