"""TFLite ``WHILE`` loops with a static trip count, unrolled one iteration at a time.

The TFLite converter writes Keras' recurrent layers (``LSTM``, ``GRU``, ``SimpleRNN``, and
both directions of a ``Bidirectional``) as a ``WHILE`` whose condition compares loop counters
with constants. TVM's importer lowers a ``WHILE`` to a recursive Relax function, which irgen's
layers cannot hold. :func:`convert_while` instead computes the trip count first, before it
converts any operator (:mod:`.trip_count`: the counters and the condition run in numpy straight
from the flatbuffer, microseconds an iteration, so a loop of more than ``MAX_RECURRENT_STEPS``
iterations, or whose condition reads data, is refused at once), then converts the body
subgraph's operators once per iteration, the loop-carried tensors bound to the previous
iteration's results. Before each iteration it also converts the condition subgraph and folds it
to a constant, which must agree with that count (else the loop is refused).

Iteration ``t`` of loop ``WHILE_<k>`` records each body operator under the node
``WHILE_<k>.t<t>.<OP>_<i>`` (so layer forming makes each iteration's operators layers of
their own) and its result as the source tensor ``<body tensor>@WHILE_<k>.t<t>``, which the
source runner reads from the interpreter run with the loop stopped after iteration ``t``
(:mod:`irgen_tensorflow.loop_states`); the last iteration's results are recorded as the
``WHILE``'s own output tensors, which the interpreter gives.

In the body, integer tensors that fold to constants (the counters, and the slice bounds and
gather indices the converter derives from them) are read as constant buffers; a slice that
comes out empty (the tensor list before its first item, after its last) is a constant of zero
elements that a ``CONCATENATION`` leaves out.
"""

from __future__ import annotations

import functools

import numpy as np


def _name(subgraph, idx: int) -> str:
    from tvm.relax.frontend.tflite.tflite_frontend import get_tensor_name

    return get_tensor_name(subgraph, idx)


def _int_const(expr) -> bool:
    import tvm

    return isinstance(expr, tvm.ir.Constant) and str(expr.ty.dtype) in ("int32", "int64")


def _empty(expr) -> bool:
    from tvm import relax

    ty = getattr(expr, "ty", None)
    if not isinstance(ty, relax.TensorType) or not isinstance(ty.shape, relax.ShapeExpr):
        return False
    return any(isinstance(d, int) and d == 0 or getattr(d, "value", None) == 0 for d in ty.shape.values)


#: relax ops the loop's integer bookkeeping (counters, bounds, the condition) uses, folded in numpy:
#: TVM's FoldConstant compiles a kernel for each (tens of milliseconds an operator and iteration)
_BINARY = {"relax.add": np.add, "relax.subtract": np.subtract, "relax.multiply": np.multiply,
           "relax.maximum": np.maximum, "relax.minimum": np.minimum, "relax.less": np.less,
           "relax.less_equal": np.less_equal, "relax.greater": np.greater, "relax.greater_equal": np.greater_equal,
           "relax.equal": np.equal, "relax.not_equal": np.not_equal, "relax.logical_and": np.logical_and,
           "relax.logical_or": np.logical_or}
_FOLDED = ("int32", "int64", "bool")


def _numpy_fold(expr):
    """``expr`` folded in numpy when it is one of :data:`_BINARY`, a reshape, a concat or a cast
    of integer or boolean constants; else None."""
    import tvm
    from tvm import relax

    if not isinstance(expr, relax.Call) or not isinstance(expr.op, tvm.ir.Op):
        return None
    name, args = expr.op.name, list(expr.args)
    if name == "relax.concat" and args and isinstance(args[0], relax.Tuple):
        args = list(args[0].fields)
    if not args or not all(isinstance(a, tvm.ir.Constant) and str(a.ty.dtype) in _FOLDED for a in args[:2]):
        return None
    v = [np.asarray(a.value.numpy()) for a in args if isinstance(a, tvm.ir.Constant)]
    if name in _BINARY and len(args) == 2:
        out = _BINARY[name](v[0], v[1])
    elif name == "relax.reshape" and len(args) == 2 and isinstance(args[1], relax.ShapeExpr):
        out = v[0].reshape([int(d) for d in args[1].values])
    elif name == "relax.concat" and len(v) == len(args):
        out = np.concatenate(v, axis=int(expr.attrs.axis))
    elif name == "relax.astype" and str(expr.attrs.dtype) in _FOLDED:
        out = v[0].astype(str(expr.attrs.dtype))
    else:
        return None
    return relax.const(np.asarray(out), str(np.asarray(out).dtype))


def _fold(conv, op, expr, dtypes=("int32", "int64")):
    from irgen_tensorflow import converters

    folded = _numpy_fold(expr)
    return folded if folded is not None else converters.fold_constant(conv, op, expr, dtypes=dtypes)


def _loop_class(base: type) -> type:
    """``base`` (the frontend's converter) reading integer constant expressions as buffers."""
    if getattr(base, "irgen_in_loop", False):
        return base
    from tvm.relax.frontend.tflite.tflite_frontend import OperatorConverter

    def get_tensor_value(self, tensor, is_sparse=False):
        name = _name(self.subgraph, tensor.tensor_idx)
        if self.exp_tab.has_expr(name) and _int_const(self.exp_tab.get_expr(name)):
            return self.exp_tab.get_expr(name).value.numpy()
        return OperatorConverter.get_tensor_value(self, tensor, is_sparse)

    return type("LoopConverter", (base,), {"irgen_in_loop": True, "irgen_suffix": "",
                                           "get_tensor_value": get_tensor_value})


def _sub(conv, subgraph, bb):
    """A converter of ``subgraph`` (a condition or body) that shares ``conv``'s naming."""
    from tvm.relax.frontend.tflite.tflite_frontend import ExprTable

    sub = _loop_class(type(conv))(conv.model, subgraph, ExprTable(), bb, conv.conversion_state)
    sub.convert_map["CONCATENATION"] = functools.partial(_concat, sub, sub.convert_map["CONCATENATION"])
    sub.convert_map["GATHER"] = functools.partial(_gather, sub, sub.convert_map["GATHER"])
    return sub


def _options(op, cls):
    table = op.BuiltinOptions()
    options = cls()
    if table is not None:
        options.Init(table.Bytes, table.Pos)
    return options


def _concat(conv, inner, op):
    """CONCATENATION leaving out the inputs of zero elements (the converter's own otherwise)."""
    from tflite.ConcatenationOptions import ConcatenationOptions
    from tvm import relax

    from irgen_tensorflow.converters import _same_qparams

    ins = conv.get_input_tensors(op)
    kept = [(t, conv.get_tensor_expr(t)) for t in ins]
    kept = [(t, e) for t, e in kept if not _empty(e)]
    if len(kept) == len(ins) or not kept:
        return inner(op=op)
    options = _options(op, ConcatenationOptions)
    if options.FusedActivationFunction():
        raise ValueError("CONCATENATION of an empty tensor with a fused activation is not supported")
    (out,) = conv.get_output_tensors(op)
    for t, _ in kept:
        _same_qparams(conv, op, t, out, "CONCATENATION")
    if len(kept) == 1:
        return kept[0][1]
    return relax.op.concat([e for _, e in kept], axis=int(options.Axis()))


def _gather(conv, inner, op):
    """GATHER at constant indices (a loop counter): a ``take`` of those indices, checked."""
    from tflite.GatherOptions import GatherOptions
    from tvm import relax

    from irgen_tensorflow.converters import _same_qparams

    x, idx = conv.get_input_tensors(op)[:2]
    if not conv.has_expr(idx.tensor_idx) or not _int_const(conv.get_expr(idx.tensor_idx)):
        return inner(op=op)
    options = _options(op, GatherOptions)
    if options.BatchDims():
        raise ValueError("GATHER with batch_dims is not supported")
    data = conv.get_tensor_expr(x)
    shape = [int(d) for d in data.ty.shape.values]
    axis = int(options.Axis()) % len(shape)
    value = conv.get_expr(idx.tensor_idx).value.numpy().astype(np.int64)
    if value.size and (value.min() < 0 or value.max() >= shape[axis]):
        raise ValueError(f"GATHER: index {value.reshape(-1).tolist()} out of range for a dimension of {shape[axis]}")
    _same_qparams(conv, op, x, conv.get_output_tensors(op)[0], "GATHER")
    return relax.op.take(data, relax.const(value.astype(np.int32)), axis=axis, mode="fast")


def _bind_inputs(sub, values) -> None:
    from tvm.relax.frontend.tflite.tflite_frontend import ExprTable

    sub.exp_tab, sub.prefetched_nodes = ExprTable(), {}
    for k in range(sub.subgraph.InputsLength()):
        sub.exp_tab.set_expr(_name(sub.subgraph, sub.subgraph.Inputs(k)), values[k])


def _results(sub) -> list:
    sg = sub.subgraph
    return [sub.get_tensor_expr(t) for t in sub.get_tensors([sg.Outputs(k) for k in range(sg.OutputsLength())])]


def _condition(cond, values, node: str, where: str) -> bool:
    """The condition subgraph on ``values``, folded to one boolean; refused when it does not fold."""
    from irgen.plugin import IrgenError

    _bind_inputs(cond, values)
    try:
        for i in range(cond.subgraph.OperatorsLength()):
            op = cond.subgraph.Operators(i)
            code = cond.get_op_code_str(op)
            cond.irgen_state["current"] = (f"{node}.cond.{code}_{i}", code)
            ret = cond.convert_map[code](op=op)
            ret = _fold(cond, op, ret, dtypes=_FOLDED)
            outs = [_name(cond.subgraph, t.tensor_idx) for t in cond.get_output_tensors(op)]
            for k, n in enumerate(outs):
                cond.exp_tab.set_expr(n, ret if len(outs) == 1 else ret[k])
        (value,) = _results(cond)
    except IrgenError:
        raise
    except Exception as err:  # noqa: BLE001  the condition reads a tensor: no constant to fold
        value, why = None, f" ({type(err).__name__}: {' '.join(str(err).split())[:200]})"
    else:
        why = ""
    import tvm

    if not isinstance(value, tvm.ir.Constant) or value.value.numpy().size != 1:
        from irgen_tensorflow.trip_count import unfoldable

        raise unfoldable(where, why)
    return bool(value.value.numpy().reshape(-1)[0])


def _iteration(body, values, node: str, suffix: str) -> list:
    """One iteration of the body on ``values``: its operators bound under ``node``, their
    results recorded as the body's tensors tagged ``suffix``; the body's results."""
    from tvm import relax

    from irgen_tensorflow import _bind_outputs

    _bind_inputs(body, values)
    body.irgen_suffix = suffix
    for i in range(body.subgraph.OperatorsLength()):
        op = body.subgraph.Operators(i)
        code = body.get_op_code_str(op)
        here = (f"{node}.{code}_{i}", code)
        body.irgen_state["current"] = here
        ret = body.convert_map[code](op=op)
        if ret is None:
            continue
        ret = body.bb.normalize(_fold(body, op, ret))
        if _empty(ret):
            ty = ret.ty
            ret = relax.const(np.zeros([int(d) for d in ty.shape.values], str(ty.dtype)))
        names = [_name(body.subgraph, t.tensor_idx) for t in body.get_output_tensors(op)]
        _bind_outputs(body, ret, [n + suffix for n in names], here, body.irgen_namer)
        for n in names:
            body.exp_tab.set_expr(n, body.exp_tab.get_expr(n + suffix))
    return _results(body)


def _record_results(conv, values, outs, suffix: str) -> None:
    """The last iteration's results recorded as the WHILE's output tensors."""
    from tvm import relax

    by_var = conv.irgen_provenance.by_var
    for v, t in zip(values, outs):
        src = by_var.get(v.name) if isinstance(v, relax.Var) else None
        if src is not None and src[2] and src[2].endswith(suffix):
            by_var[v.name] = (src[0], src[1], _name(conv.subgraph, t.tensor_idx) + getattr(conv, "irgen_suffix", ""))


def _subgraph(conv, index: int, where: str, what: str):
    from irgen.plugin import IrgenError

    if not 0 < index < conv.model.SubgraphsLength() or index in conv.irgen_state.setdefault("loops", []):
        raise IrgenError(f"{where}: its {what} subgraph {index} is not a subgraph it can run")
    return conv.model.Subgraphs(index)


def convert_while(conv, op):
    """WHILE unrolled: the trip count computed first (:mod:`.trip_count`), then the body's
    operators converted once per iteration, the converted condition checked against that count
    before each; the loop's results."""
    from tflite.WhileOptions import WhileOptions
    from tvm import relax

    from irgen.plugin import MAX_RECURRENT_STEPS, IrgenError
    from irgen_tensorflow import _check_ops
    from irgen_tensorflow.trip_count import trip_count

    state = conv.irgen_state
    node = state["current"][0] if state.get("current") else "WHILE"
    where = f"{conv.irgen_where}: op {node} (WHILE)"
    options = _options(op, WhileOptions)
    cond_sg = _subgraph(conv, int(options.CondSubgraphIndex()), where, "condition")
    body_sg = _subgraph(conv, int(options.BodySubgraphIndex()), where, "body")
    ins, outs = conv.get_input_tensors(op), conv.get_output_tensors(op)
    if len({len(ins), len(outs), cond_sg.InputsLength(), body_sg.InputsLength(), body_sg.OutputsLength()}) != 1 \
            or cond_sg.OutputsLength() != 1:
        raise IrgenError(f"{where}: its condition and body subgraphs do not take and return its {len(ins)} values")
    cond, body = _sub(conv, cond_sg, relax.BlockBuilder()), _sub(conv, body_sg, conv.bb)
    for sub, what in ((cond, "condition"), (body, "body")):
        _check_ops(sub, sub.subgraph, f"{where} {what}")
        sub.check_unsupported_ops()
    values, saved = [conv.get_tensor_expr(t) for t in ins], state.get("current")
    steps = trip_count(conv.model, cond_sg, body_sg, values, where, MAX_RECURRENT_STEPS)
    state["loops"].append(int(options.BodySubgraphIndex()))
    for step in range(steps + 1):  # the converted condition checked against the count
        if _condition(cond, values, node, where) != (step < steps):
            raise IrgenError(f"{where}: its converted condition {'ends' if step < steps else 'continues'} the loop "
                             f"after {step} iterations, where its counters give {steps} iterations; irgen does not "
                             "unroll a loop whose trip count it cannot pin down")
        if step < steps:
            values = _iteration(body, values, f"{node}.t{step}", f"@{node}.t{step}")
    state["loops"].pop()
    state["current"] = saved
    if steps:
        _record_results(conv, values, outs, f"@{node}.t{steps - 1}")
    return relax.Tuple(values)
