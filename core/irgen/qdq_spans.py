"""The QDQ realization engine (:mod:`irgen.qdq`), part two: spans of ``quantize_static`` graphs that ONNX Runtime does not run as one integer kernel.

* **Dequantized constants as integer operands**: ``quantize_static`` puts Q->DQ on
  constants feeding Add/Mul (the bias Add after a MatMul, a layer-scale gamma,
  GELU's ``+ 1`` and ``* 0.5``); ORT fuses those into QLinearAdd/QLinearMul with
  the integer constant as an operand (:func:`operand`).
* **Float layers** (:func:`realize_float`): a span ``DQ -> float ops -> Q`` whose
  ops have no integer kernel in ORT (LayerNormalization, BatchNormalization not
  folded into a conv, a per-channel constant operand...). ORT dequantizes the
  inputs (constants too), runs the float ops and quantizes the result; irgen
  does the same, the float ops in float64 on the float32 dequantized values,
  rounded once to float32 before the quantize (so TVM and the numpy recompute
  agree), and records ``"realization": "float"`` with the program of the ops.
* **Elementwise graphs on one tensor** (:func:`elementwise_dag`): HardSwish
  (``x * clip(x + 3, 0, 6) / 6``), GELU's ``x/sqrt2 -> erf``: a 256-entry table.
* **Channel split** (:func:`realize_slice`): ``Slice``/``Split`` on a quantized
  tensor, a data movement on the integers; each quantized output of a ``Split``
  (ViT's q, k, v) is an integer slice (:func:`realize_split_item`).
* **Transformer spans**: MatMul of two activations as QLinearMatMul
  (:func:`realize_matmul`, kind ``matmul``); ``Gather`` of a quantized embedding
  table by token ids (:func:`realize_gather_table`); scalars computed from
  shapes and quantized (``sqrt(1/sqrt(d))`` of ``scaled_dot_product_attention``)
  and operands computed from constants alone (:func:`constant_tensor`), which TVM
  folds into literals and the quant record carries as ``constants``.
"""

from __future__ import annotations

import numpy as np

from irgen.api import IrgenError

#: elementwise ops a table can absorb (on one dequantized tensor and scalar constants)
ELEMENTWISE = {"relax.add", "relax.subtract", "relax.multiply", "relax.divide", "relax.clip", "relax.nn.relu",
               "relax.sigmoid", "relax.tanh", "relax.exp", "relax.minimum", "relax.maximum", "relax.negative",
               "relax.abs", "relax.sqrt", "relax.power", "relax.erf"}


def _pkg():
    from irgen import qdq

    return qdq


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


# ------------------------------------------------------------------ integer operands


def operand(qg, expr, tensor: str, what: str = "an input"):
    """An integer operand of QLinearAdd/QLinearMul: ``(relax expr of the integers, QTensor, names to drop,
    constant array or None)`` for a dequantized activation or a per-tensor dequantized constant."""
    from tvm import relax

    p = _pkg()
    qc = quantized_constant(qg, expr)
    r = None if qc is not None else p._dequantized(qg, expr)
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
            arr, qt, chain = p._const_chain(qg, expr, tensor, what)
        except IrgenError:
            from irgen.graph import Constant

            if isinstance(expr, Constant) and str(expr.ty.dtype).startswith("float"):
                # a float constant no QuantizeLinear gave (an op quantize_static left out of
                # op_types_to_quantize): ORT runs the op in float
                raise IrgenError(f"{p.SCHEME}: {what} of {tensor!r} is a float constant; no integer kernel") from None
            pb = qg.producer(expr) if isinstance(expr, relax.Var) else None
            if pb is not None and pb.op not in ("relax.dequantize", "relax.quantize") and constant_tensor(qg, expr) is None:
                # computed in float from dequantized tensors (an InstanceNormalization before its bias
                # add): ORT runs the whole span in float
                raise IrgenError(f"{p.SCHEME}: {what} of {tensor!r} is computed in float; no integer kernel") from None
            raise IrgenError(f"{p.SCHEME}: {what} of {tensor!r} is not a dequantized integer tensor") from None
    if qt.scale.size != 1:
        raise IrgenError(f"{p.SCHEME}: {what} of {tensor!r} is a per-channel constant; no integer kernel")
    if str(arr.dtype) not in ("int8", "uint8"):
        raise IrgenError(f"{p.SCHEME}: {what} of {tensor!r} is a {arr.dtype} constant; no integer kernel")
    return relax.const(arr), qt, p._drop(qg, chain), arr


def constant_tensor(qg, expr):
    """The value of a tensor computed from constants alone (a realized gather of an embedding table
    by constant positions, a quantized class token, a dequantized constant gathered in float),
    evaluated with irgen's numpy reference; else
    None. TVM folds such layers into literals, so the layers reading them record the values."""
    from tvm import relax

    from irgen.graph import Constant, attrs_to_dict
    from irgen.quant import quantize_linear
    from irgen.reference import run_op

    if isinstance(expr, Constant):
        return _const_array(expr)
    # ONNX: through a QuantizeLinear of constants too (GPT-J's rotary table, Swin V2's position bias)
    torch = _pkg()._is_torch(qg)
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
    values: dict[str, object] = {}

    def val(a):
        if isinstance(a, relax.Var):
            return values[a.name]
        if isinstance(a, Constant):
            return _const_array(a)
        if isinstance(a, relax.ShapeExpr):
            return np.asarray([int(d) for d in a.values], np.int64)
        if hasattr(a, "value"):
            return np.asarray(a.value)
        raise IrgenError(f"{_pkg().SCHEME}: cannot evaluate {a!r}")

    for b in qg.bindings:
        if b.name not in members:
            continue
        v = b.value
        if isinstance(v, relax.TupleGetItem):
            values[b.name] = values[v.tuple_value.name][int(v.index)]
            continue
        if isinstance(v, relax.ShapeExpr):
            values[b.name] = val(v)
            continue
        args = []
        for a in v.args:
            args.extend([val(f) for f in a.fields] if isinstance(a, relax.Tuple) else [val(a)])
        if b.op == "relax.shape_to_tensor":
            values[b.name] = np.asarray(args[0], np.int64)
            continue
        if b.op == "relax.quantize" and np.asarray(args[1]).size == 1:  # as ONNX Runtime's QuantizeLinear
            values[b.name] = quantize_linear(args[0], np.float32(np.asarray(args[1]).reshape(())),
                                             int(np.asarray(args[2]).reshape(())), str(v.attrs.out_dtype))
            continue
        if b.op == "relax.dequantize":  # of a constant: float32(q - zp) * scale, per tensor or per axis
            q, scale, zp = args
            shape = [1] * q.ndim
            if np.asarray(scale).size > 1:
                shape[int(v.attrs.axis) % q.ndim] = -1
            offset = q.astype(np.int32) - np.asarray(zp, np.int32).reshape(shape or ())
            values[b.name] = offset.astype(np.float32) * np.asarray(scale, np.float32).reshape(shape or ())
            continue
        try:
            values[b.name] = run_op(b.op, args, attrs_to_dict(v.attrs) if v.attrs is not None else {}, b.name)
        except Exception:  # noqa: BLE001  an op the numpy reference lacks: left to TVM, as a layer
            return None
    return np.asarray(values[expr.name])


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
    p = _pkg()
    dq = qg.producer(expr)
    if dq is None or dq.op != "relax.dequantize":
        return None
    qb = qg.producer(dq.value.args[0])
    if qb is None or qb.op != "relax.quantize":
        return None
    found = run_time_quantized(qg, qb)
    if found is None or found[0] is None:
        return None
    return found[0], p._qparams(qg, dq.value, dq.name), [dq.name, qb.name]


def run_time_quantized(qg, qb):
    """A quantize ``qb`` of a float constant (ONNX Runtime quantizes it at run time): (its integers
    as QuantizeLinear computes them, or None when it is per channel; its QTensor), or None when its
    input is not a constant (:func:`constant_value`)."""
    from irgen.quant import quantize_linear

    value = constant_value(qg, qb.value.args[0])
    if value is None:
        return None
    qt = _pkg()._qparams(qg, qb.value, qb.name)
    if qt.scale.size != 1:
        return None, qt
    return quantize_linear(value, np.float32(qt.scale[0]), int(qt.zero_point[0]), qt.dtype), qt


def constant_value(qg, expr):
    """The float32 value of a float constant, or of a dequantized integer constant (an initializer
    shared through Identity and quantized again, DenseNet's BatchNorm weights), else None."""
    from irgen.graph import Constant

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

    from irgen.graph import Constant, attrs_to_dict
    from irgen.reference import run_op

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


# ------------------------------------------------------------------ elementwise tables


def elementwise_dag(qg, last):
    """The bindings from one dequantize(int var) to ``last`` when all are elementwise ops on that
    tensor and scalar constants, each used only inside: ((int var, QTensor, dq name), bindings in order)."""
    from tvm import relax

    from irgen.graph import Constant

    p = _pkg()
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
                d = p._dequantized(qg, a)
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


# ------------------------------------------------------------------ float layers


class UnquantizedSource(IrgenError):
    """A float span reaches a tensor no dequantize gives (a model input, or what float ops compute
    from one: the embeddings of a model ``quantize_static`` quantized only at its MatMuls). Its
    float ops stay float layers and the quantize quantizes their result
    (:func:`irgen.qdq._realize_span`)."""


def recompute_float(layer, inputs, params=None) -> np.ndarray:
    """A ``realization: float`` layer from its record: its ``program`` (fused-ops form, float64) on the
    dequantized inputs, rounded to float32, then QuantizeLinear."""
    from irgen.quant import quantize_linear
    from irgen.reference import run_layer

    qr = layer["quant"]
    out = qr["output"]
    deq = [((x.astype(np.int32) - int(i["zero_point"])).astype(np.float32) * np.float32(i["scale"])).astype(np.float64)
           for x, i in zip(inputs, qr["inputs"])]
    prog = qr["program"]
    # the span's value: the program's last op, or the one ``result`` names (an item of a split)
    y = run_layer({"name": layer.get("name", "?"), "fused_ops": prog, "results": [qr.get("result") or f"op:{len(prog) - 1}"]},
                  deq, params or {})[0]
    y = np.asarray(y).astype(np.float32)
    if qr.get("reference") == "torch":
        from irgen.quant import torch_quantize

        return torch_quantize(y, out["scale"], int(out["zero_point"]), *qr["clamp"], out["dtype"])
    return quantize_linear(y, np.float32(out["scale"]), int(out["zero_point"]), out["dtype"])


def _dequantized_constant(qg, b) -> np.ndarray:
    """ORT's DequantizeLinear of a constant: ``float32(q - zp) * float32(scale)`` per axis."""
    p = _pkg()
    arr = b.value.args[0].value.numpy()
    ax = int(b.value.attrs.axis) % max(arr.ndim, 1)
    qt = p._qparams(qg, b.value, b.name, arr.shape[ax] if arr.ndim else 1)
    shape = [1] * arr.ndim
    if qt.scale.size > 1:
        shape[ax] = qt.scale.size
    s = qt.scale.astype(np.float32).reshape(shape if qt.scale.size > 1 else ())
    z = qt.zero_point.astype(np.int64).reshape(shape if qt.zero_point.size > 1 else ())
    return (arr.astype(np.int64) - z).astype(np.float32) * s


def realize_float(qg, qb, last, out):
    """``DQ -> float ops -> Q`` as ORT runs it without an integer kernel: the float ops on the
    dequantized inputs (float64 here, rounded once to float32), then QuantizeLinear. In a torch
    reference graph (torch runs every op between its dequantize and quantize in float32) the
    same float ops, then torch's quantize_per_tensor (multiply by the float32 inverse scale)."""
    from tvm import relax
    from tvm.relax import op

    from irgen.graph import Constant, attrs_to_dict
    from irgen.ir import op_args, program_arg

    p = _pkg()
    _, _, q, _ = p._ops()
    tensor = qb.name
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
            raise IrgenError(f"{p.SCHEME}: cannot realize {b.op} before {tensor!r}")
        members[b.name] = b
        for a in _args(b.value):
            if not isinstance(a, relax.Var):
                continue
            pb = qg.producer(a)
            if pb is None:
                raise UnquantizedSource(f"{p.SCHEME}: an input of {tensor!r} ({a.name!r}) is a float tensor that "
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
                    d = p._dequantized(qg, a)
                    if d is None:
                        raise IrgenError(f"{p.SCHEME}: an input of {tensor!r} is not a dequantized integer tensor")
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
    names = set(members)
    # float ops another span reads too (torch: a pad each of four sliced-and-quantized windows
    # reads; ONNX: ConvNeXt V2's ReduceL2 read by its quantized mean and by the division) are
    # computed again in each span, the same values; they stay while read
    order = [b for b in qg.bindings if b.name in names]
    e = qg.emit
    new: dict[str, object] = {}
    refs: dict[str, str] = {}
    acts.sort(key=lambda d: min(j for j, b in enumerate(order) if d[2] in [getattr(a, "name", None) for a in _args(b.value)]))
    # dequantized first, in this order: the layer's inputs follow it. One tensor dequantized by two
    # nodes (PT2E's Arm quantizer gives each reader its own: SqueezeNet's two expand convs) is one input
    seen: dict[str, tuple] = {}
    inputs = []
    for x, qx, d in acts:
        key = getattr(x, "name", None) or str(id(x))
        if key in seen:
            other, qo = seen[key]
            if (qo.scale[0], qo.zero_point[0], qo.dtype) != (qx.scale[0], qx.zero_point[0], qx.dtype):
                raise IrgenError(f"{p.SCHEME}: {key!r} is dequantized with two sets of parameters before {tensor!r}")
            new[d] = new[other]
            continue
        seen[key] = (d, qx)
        f = e(op.multiply(e(op.astype(p._offset(qg, x, int(qx.zero_point[0])), "float32")),
                          q.rx_const(qx.scale[0], "float32")))
        new[d] = e(op.astype(f, "float64"))
        refs[new[d].name] = f"input:{len(inputs)}"
        inputs.append(qx)
    for d, v in consts.items():
        new[d] = relax.const(v.astype(np.float64), "float64")

    def arg(a):
        if isinstance(a, relax.Var):
            v = new[a.name]
            return relax.Tuple(v) if isinstance(v, list) else v  # a decomposed tuple read whole
        if isinstance(a, relax.Tuple):
            return relax.Tuple([arg(f) for f in a.fields])
        if isinstance(a, Constant) and str(a.ty.dtype) == "float32":
            return relax.const(a.value.numpy().astype(np.float64), "float64")
        return a

    start = len(qg._pending)
    e = _folding(qg.emit)
    for b in order:
        v = b.value
        if isinstance(v, relax.TupleGetItem) and isinstance(new.get(v.tuple_value.name), list):
            new[b.name] = new[v.tuple_value.name][int(v.index)]  # an item of a decomposed tuple op
        elif isinstance(v, relax.TupleGetItem):
            new[b.name] = e(relax.TupleGetItem(arg(v.tuple_value), int(v.index)))
        elif isinstance(v, relax.Tuple):  # a tuple bound whole (timm's qkv.unbind(0)): its items
            new[b.name] = [arg(f) for f in v.fields]
        elif b.op == "relax.astype" and str(v.attrs.dtype) == "float32":
            new[b.name] = e(op.astype(arg(v.args[0]), "float64"))
        elif b.op in FLOAT64:
            new[b.name] = FLOAT64[b.op](e, [arg(a) for a in v.args], v.attrs)
        elif isinstance(v, relax.Call):
            new[b.name] = e(relax.Call(v.op, [arg(a) for a in v.args], _float64_out(v.attrs), getattr(v, "sinfo_args", None)))
        elif isinstance(v, relax.ShapeExpr):  # a reshape's target shape bound on its own (Swin)
            new[b.name] = v
        else:
            raise IrgenError(f"{p.SCHEME}: cannot realize {b.kind} before {tensor!r}")
    # the program of the float ops as bound (the quant record's own copy of the arithmetic)
    program = []
    for pb in qg._pending[start:]:
        v = pb.value
        if isinstance(v, relax.TupleGetItem):
            program.append({"relax_op": "tgi", "attrs": {"index": int(v.index)}, "args": [refs[v.tuple_value.name]]})
        else:
            program.append({"relax_op": str(v.op.name), "attrs": attrs_to_dict(v.attrs) if v.attrs is not None else {},
                            "args": [program_arg(a, refs) for a in op_args(v)]})
        refs[pb.name] = f"op:{len(program) - 1}"
    result = refs.get(getattr(new[last.name], "name", None), f"op:{len(program) - 1}")
    y = e(op.astype(new[last.name], "float32"))
    info = np.iinfo(out.dtype)
    torch = p._is_torch(qg)
    if torch:
        expr = p._rx_torch_quantize(qg, y, out)
        rule = ("y = saturate(round_half_even(float32(program(float64(float32(x - zp_x) * s_x))) * float32(1 / s_y)) "
                "+ zp_y) (torch: dequantize_per_tensor, the float ops, quantize_per_tensor)")
    else:
        expr = q.rx_round_to_int(e, e(op.divide(y, q.rx_const(out.scale[0], "float32"))), int(out.zero_point[0]),
                                 int(info.min), int(info.max), out.dtype)
        rule = ("y = saturate(round_half_even(float32(program(float64(float32(x - zp_x) * s_x))) / s_y) + zp_y); "
                "constants dequantized as float32(q - zp) * s (ONNX Runtime: DequantizeLinear, the float "
                "ops, QuantizeLinear)")
    ops = "+".join(b.op.removeprefix("relax.") for b in order if b.op)
    rec = {"scheme": p.SCHEME, "kind": "float", "realization": "float", "op": ops,
           **({"reference": "torch"} if torch else {}),
           "inputs": [qx.record() for qx in inputs], "output": out.record(), "program": program,
           "result": result, "requant": {"rounding": "half_to_even", "rounding_rule": rule},
           "clamp": [out.lo, out.hi]}
    return dqs + [b.name for b in order] + [qb.name], expr, rec


def _folding(emit):
    """``emit``, except that a call of constants alone is evaluated now (irgen's numpy reference
    ops) and returned as a constant: TVM would fold it after the span is realized (a weight's
    transpose, a norm's ``sqrt(var + eps)``) into a new constant that the record's ``program``,
    written now, could not name as the layer parameter it becomes."""
    from tvm import relax

    from irgen.graph import Constant, attrs_to_dict
    from irgen.reference import run_op

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

    from irgen.quant import per_axis

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


def drop_dead_items(qg) -> None:
    """Remove tuple items nobody reads (batch_norm's mean and variance)."""
    from tvm import relax

    dead = [b.name for b in qg.bindings if isinstance(b.value, relax.TupleGetItem) and qg.n_users(b.name) == 0]
    if dead:
        qg.bindings = [b for b in qg.bindings if b.name not in dead]
        qg._index()


# ------------------------------------------------------------------ channel split


def _evaluate(qg, expr):
    """The value of a shape computation (shape_of on static shapes, constants, index arithmetic) in numpy."""
    from tvm import relax

    from irgen.graph import Constant, attrs_to_dict
    from irgen.reference import run_op

    p = _pkg()
    if isinstance(expr, Constant):
        return expr.value.numpy()
    if isinstance(expr, relax.ShapeExpr):
        return np.asarray([int(d) for d in expr.values], np.int64)
    b = qg.producer(expr)
    if b is not None and isinstance(b.value, relax.ShapeExpr):  # a static shape_of (static_shape_of)
        return _evaluate(qg, b.value)
    if b is None or not isinstance(b.value, relax.Call):
        raise IrgenError(f"{p.SCHEME}: cannot evaluate {getattr(expr, 'name', expr)!r}: not a shape computation")
    v = b.value
    if b.op == "relax.shape_of":
        shape = getattr(getattr(v.args[0], "ty", None), "shape", None)
        if shape is not None and hasattr(shape, "values"):
            return np.asarray([int(d) for d in shape.values], np.int64)
        return np.asarray(np.shape(_evaluate(qg, v.args[0])), np.int64)
    if b.op in ("relax.dequantize", "relax.quantize"):
        raise IrgenError(f"{p.SCHEME}: {b.name!r} is not a shape computation")
    args = [_evaluate(qg, a) for a in v.args]
    if b.op == "relax.shape_to_tensor":
        return np.asarray(args[0], np.int64)
    if b.op == "relax.scatter_elements":
        data, idx, upd = (np.asarray(a) for a in args)
        out = data.copy()
        np.put_along_axis(out, idx.astype(np.int64), np.broadcast_to(upd, idx.shape).astype(out.dtype),
                          int(v.attrs.axis))
        return out
    return np.asarray(run_op(b.op, args, attrs_to_dict(v.attrs) if v.attrs is not None else {}, b.name))


def realize_slice(qg, qb, comp, out):
    """``Slice`` on a quantized tensor (ShuffleNet's channel split) whose begin/end/steps are computed
    from static shapes: a strided slice of the integers (ORT drops the Q/DQ around Slice)."""
    from tvm.relax import op

    p = _pkg()
    tensor = qb.name
    x, qx, dqx = p._need(qg, comp.value.args[0], "the input", tensor)
    if qx.scale[0] != out.scale[0] or qx.zero_point[0] != out.zero_point[0] or qx.dtype != out.dtype:
        raise IrgenError(f"{p.SCHEME}: the slice at {tensor!r} changes quantization parameters; not supported")
    shape = [int(d) for d in x.ty.shape.values]
    begin, end, strides = (_evaluate(qg, a).reshape(-1) for a in comp.value.args[1:4])
    axes, b0, e0, s0 = [], [], [], []
    for a, dim in enumerate(shape):
        if a >= len(begin):
            break
        start, stop, step = slice(int(begin[a]), int(end[a]), int(strides[a])).indices(dim)
        if (start, stop, step) != (0, dim, 1):
            axes.append(a), b0.append(start), e0.append(stop), s0.append(step)
    expr = op.strided_slice(x, axes, b0, e0, s0)
    rec = {"scheme": p.SCHEME, "kind": "integer", "op": "strided_slice", "inputs": [qx.record()], "output": out.record(),
           "slice": {"axes": axes, "begin": b0, "end": e0, "strides": s0}}
    return [dqx, comp.name, qb.name], expr, rec


# ------------------------------------------------------------------ split, gather, matmul of activations


def split_item(qg, f):
    """``(split binding, int var, QTensor, dq name)`` when ``f`` is an item of ``relax.split`` of a
    dequantized tensor read only by one quantize, else None."""
    from tvm import relax

    if f is None or not isinstance(f.value, relax.TupleGetItem) or qg.n_users(f.name) != 1:
        return None
    sb = qg.producer(f.value.tuple_value)
    if sb is None or sb.op != "relax.split":
        return None
    d = _pkg()._dequantized(qg, sb.value.args[0])
    return None if d is None else (sb, *d)


def realize_split_item(qg, qb, f, out):
    """One output of ``Split`` on a quantized tensor (ViT's q, k, v): a slice of the integers
    (ORT's QDQ Split runs on the integers when the parameters agree); the split and its dequantize
    go when their last item is realized."""
    from tvm.relax import op

    p = _pkg()
    tensor = qb.name
    sb, x, qx, _ = split_item(qg, f)
    table = None
    if qx.scale[0] != out.scale[0] or qx.zero_point[0] != out.zero_point[0] or qx.dtype != out.dtype:
        # each item quantized with its own parameters (torchvision ShuffleNetV2's chunk under FX PTQ; ORT
        # runs such a Split in float): a table, then the slice, as a requantizing Slice is
        torch = p._is_torch(qg)
        table = p._table(qx, out, torch_rule=torch)
    shape = [int(d) for d in x.ty.shape.values]
    a = sb.value.attrs
    axis = int(a.axis) % len(shape)
    ios = a.indices_or_sections
    if isinstance(ios, (int, np.integer)) or hasattr(ios, "value"):
        n = int(ios.value if hasattr(ios, "value") else ios)
        size = -(-shape[axis] // n)
        bounds = [min(k * size, shape[axis]) for k in range(1, n)]
    else:
        bounds = [int(v) for v in ios]
    edges = [0] + bounds + [shape[axis]]
    k = int(f.value.index)
    begin, end = edges[k], edges[k + 1]
    rec = {"scheme": p.SCHEME, "kind": "integer", "op": "strided_slice", "inputs": [qx.record()], "output": out.record(),
           "slice": {"axes": [axis], "begin": [begin], "end": [end], "strides": [1]}}
    if table is not None:
        x = qg.emit(p._lut(qg, x, table, qx.dtype))
        rec.update(kind="lut", table=[int(t) for t in table], **({"reference": "torch"} if torch else {}),
                   requant={"rounding": "half_to_even", "rounding_rule": "table[i - min] = quantize(dequantize(i)), "
                            "then the slice"})
    return [f.name, qb.name], op.strided_slice(x, [axis], [begin], [end], [1]), rec


def gathered_table(qg, comp):
    """``(integer table, QTensor, dq binding)`` when ``comp`` takes rows of a dequantized constant
    (an embedding table gathered by token ids), else None."""
    from irgen.graph import Constant

    dq = qg.producer(comp.value.args[0])
    if dq is None or dq.op != "relax.dequantize" or not isinstance(dq.value.args[0], Constant):
        return None
    return dq.value.args[0].value.numpy(), dq


def realize_gather_table(qg, qb, comp, out):
    """``Gather(DQ(table), ids) -> Q``: ORT gathers the integers (Q/DQ dropped when the parameters
    agree, else the float values requantized); both are ``Q_out(DQ(table))`` gathered, which irgen
    computes once: a gather of an integer table by the (integer) indices."""
    from tvm import relax

    from irgen.quant import quantize_linear

    p = _pkg()
    arr, dq = gathered_table(qg, comp)
    qt = p._qparams(qg, dq.value, dq.name, arr.shape[int(dq.value.attrs.axis) % arr.ndim] if arr.ndim else 1)
    same = qt.scale.size == 1 and qt.scale[0] == out.scale[0] and qt.zero_point[0] == out.zero_point[0] \
        and str(arr.dtype) == out.dtype
    table = arr if same else quantize_linear(_dequantized_constant(qg, dq), np.float32(out.scale[0]),
                                             int(out.zero_point[0]), out.dtype)
    v = comp.value
    expr = relax.Call(v.op, [relax.const(table)] + list(v.args[1:]), v.attrs)
    rec = {"scheme": p.SCHEME, "kind": "integer", "op": "take", "inputs": [], "output": out.record(),
           "table": qt.record(),
           "requant": {"rounding": "half_to_even", "rounding_rule":
                       "parameter 'table' = the integer table (when its parameters are the output's) or "
                       "quantize(dequantize(table)) with the output's parameters; y = table[ids]"}}
    names = [dq.name] if qg.n_users(dq.name) == 1 else []
    return names + [comp.name, qb.name], expr, rec


def realize_matmul(qg, qb, comp, out):
    """MatMul of two quantized activations (attention's Q·Kᵀ and A·V) as ORT's QLinearMatMul:
    int32 ``sum((a - zp_a) * (b - zp_b))``, MLAS requantization by ``float32(s_a * s_b) / s_y``."""
    from tvm.relax import op

    p = _pkg()
    _, _, q, _ = p._ops()
    tensor = qb.name
    a, qa, da = p._need(qg, comp.value.args[0], "the first input", tensor)
    b, qb_, db = p._need(qg, comp.value.args[1], "the second input", tensor)
    xa = p._offset(qg, a, int(qa.zero_point[0]))
    xb = xa if a.same_as(b) and qa.zero_point[0] == qb_.zero_point[0] else p._offset(qg, b, int(qb_.zero_point[0]))
    acc = qg.emit(op.matmul(xa, xb, out_dtype="int32"))
    scale = np.float32(np.float32(qa.scale[0]) * np.float32(qb_.scale[0])) / np.float32(out.scale[0])
    info = np.iinfo(out.dtype)
    lo, hi = int(info.min), int(info.max)
    expr = q.rx_requantize_float(qg.emit, acc, np.float32(scale), int(out.zero_point[0]), lo, hi, out.dtype)
    rec = {"scheme": p.SCHEME, "kind": "matmul", "inputs": [qa.record(), qb_.record()], "output": out.record(),
           **({"operands": [0, 0]} if a.same_as(b) else {}),
           "requant": {"scale": float(scale), "rounding": "half_to_even",
                       "rounding_rule": "y = clamp(round_half_even(float32(acc) * scale) + zp_y, clamp); acc = int32 "
                                        "sum((a - zp_a) * (b - zp_b)); scale = float32(s_a * s_b) / s_y (QLinearMatMul)"},
           "clamp": [lo, hi]}
    return [da, db, comp.name, qb.name], expr, rec


def recompute_matmul(layer, inputs, params=None) -> np.ndarray:
    """A ``matmul`` layer (QLinearMatMul of two activations) from its record."""
    from irgen.quant import requantize_float

    qr = layer["quant"]
    out = qr["output"]
    ops = [inputs[k] for k in qr.get("operands") or (0, 1)]
    za, zb = (int(i["zero_point"]) for i in qr["inputs"])
    acc = np.matmul(ops[0].astype(np.int64) - za, ops[1].astype(np.int64) - zb)
    lo, hi = qr["clamp"]
    return requantize_float(acc.astype(np.int32), np.float32(qr["requant"]["scale"]), int(out["zero_point"]), lo, hi,
                            out["dtype"])


def static_shape_of(qg) -> None:
    """``shape_of`` of a tensor with a static shape becomes that shape (the index arithmetic of a
    Gather reads the shape of its dequantized table: the table is gathered as integers)."""
    from tvm import relax

    for b in list(qg.bindings):
        if b.op != "relax.shape_of":
            continue
        shape = getattr(b.value.args[0].ty, "shape", None)
        if shape is None or not hasattr(shape, "values") or any(not hasattr(d, "value") for d in shape.values):
            continue
        qg.replace([b.name], relax.ShapeExpr([int(d) for d in shape.values]))


def recompute_concat(layer, inputs, params=None) -> np.ndarray:
    """A ``concatenate`` layer: operand k is the layer input ``operands[k]`` (through ``tables[k]``
    when its parameters differ from the output's, QLinearConcat) or the literal ``constants[k]``."""
    qr = layer["quant"]
    out = qr["output"]
    consts = qr.get("constants") or {}
    order = qr.get("operands") or list(range(len(qr["tables"])))
    parts = []
    for k, t in enumerate(qr["tables"]):
        c = consts.get(str(k))
        if c is not None:
            parts.append(np.asarray(c["values"], out["dtype"]).reshape(c["shape"]))
            continue
        inp = inputs[order[k]]
        parts.append(inp if t is None else np.asarray(t, out["dtype"])[inp.astype(np.int64) - np.iinfo(inp.dtype).min])
    return np.concatenate(parts, axis=qr["axis"])


def drop_dead(qg) -> None:
    """Remove bindings nobody reads any more (shape computations of realized slices)."""
    while True:
        dead = {b.name for b in qg.bindings if qg.n_users(b.name) == 0 and b.op not in ("relax.quantize",)}
        if not dead:
            return
        qg.bindings = [b for b in qg.bindings if b.name not in dead]
        qg._index()


def retype(qg) -> None:
    """Infer the static shapes of the bindings after a realized dynamic slice (its consumers were
    imported with unknown shapes): each binding renormalized, its variable renewed when its type changed."""
    from tvm import relax

    from irgen.graph import Binding, substitute

    bb = relax.BlockBuilder()
    vmap: dict[str, object] = {}
    new = []
    for b in qg.bindings:
        val = bb.normalize(substitute(b.value, vmap)) if vmap else b.value
        var = b.var
        if vmap and not tvm_equal(val.ty, b.var.ty):
            var = (relax.DataflowVar if isinstance(b.var, relax.DataflowVar) else relax.Var)(b.name, val.ty)
            vmap[b.name] = var
        elif not vmap and _dynamic(b.var):
            val = bb.normalize(b.value)
            if not tvm_equal(val.ty, b.var.ty):
                var = (relax.DataflowVar if isinstance(b.var, relax.DataflowVar) else relax.Var)(b.name, val.ty)
                vmap[b.name] = var
        new.append(Binding(b.name, var, val))
    if not vmap:
        return
    func = qg.mod["main"]
    out = substitute(func.body.body, vmap)
    ret = relax.TupleType([f.ty for f in out.fields]) if isinstance(out, relax.Tuple) else out.ty
    block = relax.DataflowBlock([relax.VarBinding(b.var, b.value) for b in new])
    mod = qg.mod.__class__({gv: f for gv, f in qg.mod.functions.items() if gv.name_hint != "main"})
    mod["main"] = relax.Function(func.params, relax.SeqExpr([block], out), ret, func.is_pure, func.attrs)
    qg.mod = relax.transform.Normalize()(mod)
    from irgen.graph import main_bindings

    _, qg.bindings = main_bindings(qg.mod)
    qg._index()


def _dynamic(var) -> bool:
    shape = getattr(var.ty, "shape", None)
    return shape is None or not hasattr(shape, "values") or any(not hasattr(d, "value") for d in shape.values)


def tvm_equal(a, b) -> bool:
    return str(a) == str(b)


#: quant kind -> verify's recompute ``fn(layer, inputs, params)`` of the kinds realized here; the ``qdq``
#: plugin registers them under its scheme (schemes built on qdq, such as pow2, find them there)
RECOMPUTE = {"float": recompute_float, "matmul": recompute_matmul, "concatenate": recompute_concat}
