"""The trip count of a TFLite ``WHILE`` loop, computed in numpy before any operator is converted.

A model file is untrusted: a loop whose condition never turns false would make irgen convert
its body thousands of times (a tenth of a second an iteration) before the unroll limit stops
it. :func:`trip_count` runs the loop's integer bookkeeping instead, straight from the
flatbuffer: the loop-carried integer and boolean values that are constants at loop entry, the
condition subgraph's operators and the body operators that compute those values' next ones
(only the operators the condition depends on, directly or through the counters), each a numpy
function of :data:`KERNELS` with TFLite's integer semantics (the output tensor's dtype, int32
wrapping around, ``DIV`` rounding toward zero, ``FLOOR_DIV`` and ``FLOOR_MOD`` toward minus
infinity). It stops when the condition is false, and refuses the loop when it would run more
than ``MAX_RECURRENT_STEPS`` iterations, or when the condition reads anything else (data, a
float, an operator not in the table): microseconds an iteration, so the refusal comes at once.
Values of more than :data:`MAX_ELEMENTS` elements are not followed, and a loop whose count takes
more than :data:`MAX_EVALUATIONS` operator evaluations is refused, so that the count itself takes
at most about a second.
"""

from __future__ import annotations

import functools

import numpy as np

#: the largest integer value (elements) the evaluator follows; larger ones are not bookkeeping
MAX_ELEMENTS = 1024
#: operator evaluations one loop's trip count may take (all iterations; tens of thousands for
#: Keras' loops at the unroll limit), so that no model makes the evaluator itself slow
MAX_EVALUATIONS = 200_000

_ACTIVATIONS = {0: (None, None), 1: (0, None), 2: (-1, 1), 3: (0, 6)}  # NONE, RELU, RELU_N1_TO_1, RELU6


class Unknown:
    """A value the evaluator cannot compute, and why."""

    def __init__(self, why: str):
        self.why = why


class _Refused(Exception):
    pass


def _numpy_types() -> dict[int, type]:
    from tflite.TensorType import TensorType as T

    return {T.INT32: np.int32, T.INT64: np.int64, T.INT16: np.int16, T.INT8: np.int8, T.UINT8: np.uint8,
            T.UINT16: np.uint16, T.UINT32: np.uint32, T.UINT64: np.uint64, T.BOOL: np.bool_}


@functools.cache
def _op_names() -> dict[int, str]:
    from tflite.BuiltinOperator import BuiltinOperator

    return {v: k for k, v in vars(BuiltinOperator).items() if not k.startswith("_")}


class _Op:
    """One operator, decoded once from the flatbuffer (the evaluator runs it every iteration)."""

    def __init__(self, raw, code: str):
        self.raw, self.code, self.memo = raw, code, {}
        self.ins = [int(t) for t in raw.InputsAsNumpy()] if raw.InputsLength() else []
        self.outs = [int(t) for t in raw.OutputsAsNumpy()] if raw.OutputsLength() else []


def _option(op: _Op, name: str, field: str, default=None):
    """Field ``field`` of the operator's options table ``name`` (``default`` without one)."""
    import importlib

    key = (name, field)
    if key not in op.memo:
        table, value = op.raw.BuiltinOptions(), default
        if table is not None:
            options = getattr(importlib.import_module(f"tflite.{name}"), name)()
            options.Init(table.Bytes, table.Pos)
            value = getattr(options, field)()
        op.memo[key] = value
    return op.memo[key]


def _activate(out, op, name: str):
    act = _option(op, name, "FusedActivationFunction", 0)
    if act not in _ACTIVATIONS:
        raise _Refused(f"a fused activation {act} on integers")
    lo, hi = _ACTIVATIONS[act]
    return out if lo is None else np.clip(out, lo, hi if hi is not None else np.iinfo(out.dtype).max)


def _ints(*xs):
    if any(x.dtype == np.bool_ for x in xs):
        raise _Refused("arithmetic on booleans")
    return xs


def _nonzero(d):
    if np.any(d == 0):
        raise _Refused("a division by zero")
    return d


def _div(a, b):  # C++ integer division: toward zero
    q = np.floor_divide(a, _nonzero(b))
    return q + ((np.remainder(a, b) != 0) & ((a < 0) != (b < 0)))


def _arith(fn, options):
    def run(op, a, b):
        return _activate(fn(*_ints(a, b)), op, options)
    return run


def _elementwise(fn):
    return lambda op, *xs: fn(*xs)


def _logical(fn):
    def run(op, *xs):
        if any(x.dtype != np.bool_ for x in xs):
            raise _Refused("a logical operator on integers")
        return fn(*xs)
    return run


def _reshape(op, x, shape=None):
    if shape is None or shape.size == 0 and x.size != 1:
        has = _option(op, "ReshapeOptions", "NewShapeLength")
        shape = _option(op, "ReshapeOptions", "NewShapeAsNumpy") if has else None
    if shape is None:
        raise _Refused("a RESHAPE without a constant shape")
    return x.reshape([int(d) for d in np.asarray(shape).reshape(-1)])


def _squeeze(op, x):
    has = _option(op, "SqueezeOptions", "SqueezeDimsLength")
    dims = _option(op, "SqueezeOptions", "SqueezeDimsAsNumpy") if has else None
    return np.squeeze(x) if dims is None else np.squeeze(x, axis=tuple(int(d) for d in dims))


def _concat(op, *xs):
    out = np.concatenate(xs, axis=int(_option(op, "ConcatenationOptions", "Axis", 0)))
    return _activate(out, op, "ConcatenationOptions")


def _pack(op, *xs):
    return np.stack(xs, axis=int(_option(op, "PackOptions", "Axis", 0)))


def _select(op, c, a, b):
    if c.ndim == 1 and a.ndim > 1:  # SELECT (v1): a vector condition picks rows
        c = c.reshape((-1,) + (1,) * (a.ndim - 1))
    return np.where(c, a, b)


def _gather(op, x, idx):
    axis = int(_option(op, "GatherOptions", "Axis", 0)) % max(x.ndim, 1)
    batch = int(_option(op, "GatherOptions", "BatchDims", 0))
    if batch or idx.size and (idx.min() < 0 or idx.max() >= x.shape[axis]):
        raise _Refused("a GATHER out of range or with batch_dims")
    return np.take(x, idx, axis=axis)


def _slice(op, x, begin, size):
    ends = [x.shape[i] if s < 0 else b + s for i, (b, s) in enumerate(zip(begin.tolist(), size.tolist()))]
    if len(ends) != x.ndim or any(b < 0 or e > n or b > e for b, e, n in zip(begin.tolist(), ends, x.shape)):
        raise _Refused("a SLICE out of range")
    return x[tuple(slice(b, e) for b, e in zip(begin.tolist(), ends))]


#: TFLite operator -> numpy function (op, *inputs) of its integer or boolean inputs; the result is
#: cast to the output tensor's dtype (C++'s wrap-around)
KERNELS = {
    "ADD": _arith(np.add, "AddOptions"), "SUB": _arith(np.subtract, "SubOptions"),
    "MUL": _arith(np.multiply, "MulOptions"), "DIV": _arith(_div, "DivOptions"),
    "FLOOR_DIV": _elementwise(lambda a, b: np.floor_divide(*_ints(a, _nonzero(b)))),
    "FLOOR_MOD": _elementwise(lambda a, b: np.remainder(*_ints(a, _nonzero(b)))),
    "MAXIMUM": _elementwise(np.maximum), "MINIMUM": _elementwise(np.minimum),
    "NEG": _elementwise(lambda a: np.negative(*_ints(a))), "ABS": _elementwise(lambda a: np.abs(*_ints(a))),
    "LESS": _elementwise(np.less), "LESS_EQUAL": _elementwise(np.less_equal),
    "GREATER": _elementwise(np.greater), "GREATER_EQUAL": _elementwise(np.greater_equal),
    "EQUAL": _elementwise(np.equal), "NOT_EQUAL": _elementwise(np.not_equal),
    "LOGICAL_AND": _logical(np.logical_and), "LOGICAL_OR": _logical(np.logical_or),
    "LOGICAL_NOT": _logical(np.logical_not),
    "CAST": _elementwise(lambda a: a), "RESHAPE": _reshape, "SQUEEZE": _squeeze,
    "EXPAND_DIMS": _elementwise(lambda a, axis: np.expand_dims(a, int(axis.reshape(-1)[0]))),
    "CONCATENATION": _concat, "PACK": _pack, "SELECT": _select, "SELECT_V2": _elementwise(np.where),
    "GATHER": _gather, "SLICE": _slice,
}


class _Graph:
    """One subgraph of the loop: its integer constants, operators, and which op writes a tensor."""

    def __init__(self, model, sg, what: str):
        from tvm.relax.frontend.tflite.tflite_frontend import get_tensor_name

        self.model, self.sg, self.what, self.types = model, sg, what, _numpy_types()
        self.name = functools.partial(get_tensor_name, sg)
        self.ops = [_Op(sg.Operators(i), self._code(sg.Operators(i))) for i in range(sg.OperatorsLength())]
        self.producer = {}
        for i, op in enumerate(self.ops):
            for t in op.outs:
                self.producer.setdefault(t, i)
        self.inputs = [int(sg.Inputs(k)) for k in range(sg.InputsLength())]
        self.outputs = [int(sg.Outputs(k)) for k in range(sg.OutputsLength())]
        self.consts: dict[int, np.ndarray | Unknown] = {}
        self.dtypes: dict[int, np.dtype | Unknown] = {}

    def _code(self, op) -> str:
        index = op.OpcodeIndex()
        if not 0 <= index < self.model.OperatorCodesLength():
            return "UNKNOWN"
        oc = self.model.OperatorCodes(index)
        return _op_names().get(max(oc.BuiltinCode(), oc.DeprecatedBuiltinCode()), "CUSTOM")

    def dtype(self, t: int):
        """The numpy dtype of tensor ``t`` when the evaluator follows it (integer or boolean, not
        quantized); else an :class:`Unknown` saying why not."""
        if t not in self.dtypes:
            self.dtypes[t] = self._dtype(t)
        return self.dtypes[t]

    def _dtype(self, t: int):
        from tflite.TensorType import TensorType

        if not 0 <= t < self.sg.TensorsLength():
            return Unknown(f"tensor {t} of the {self.what}, which does not exist")
        tensor = self.sg.Tensors(t)
        names = {v: k for k, v in vars(TensorType).items() if not k.startswith("_")}
        if tensor.Type() not in self.types:
            return Unknown(f"{self.name(t)!r}, a {names.get(tensor.Type(), tensor.Type())} tensor")
        q = tensor.Quantization()
        if q is not None and q.ScaleLength():
            return Unknown(f"{self.name(t)!r}, a quantized tensor")
        return np.dtype(self.types[tensor.Type()])

    def const(self, t: int):
        """Tensor ``t``'s constant buffer, when it is a followed one; else an :class:`Unknown`."""
        if t not in self.consts:
            dtype, tensor = self.dtype(t), self.sg.Tensors(t) if 0 <= t < self.sg.TensorsLength() else None
            data = self.model.Buffers(tensor.Buffer()).DataAsNumpy() if tensor is not None else 0
            shape = [int(d) for d in tensor.ShapeAsNumpy()] if tensor is not None and tensor.ShapeLength() else []
            if isinstance(dtype, Unknown):
                value = dtype
            elif isinstance(data, int) or not len(data):
                value = Unknown(f"{self.name(t)!r}, which is neither a constant nor a loop value")
            elif any(d < 0 for d in shape) or np.prod(shape, dtype=np.float64) > MAX_ELEMENTS \
                    or int(np.prod(shape)) * dtype.itemsize != len(data):
                value = Unknown(f"{self.name(t)!r}, a constant of {len(data)} bytes irgen does not follow")
            else:
                value = np.frombuffer(data.tobytes(), dtype).reshape(shape)
            self.consts[t] = value
        return self.consts[t]

    def needs(self, tensors) -> tuple[list[int], set[int]]:
        """The operators (in order) that ``tensors`` depend on, and the subgraph inputs (positions) they read."""
        ops, seen, stack, inputs = set(), set(), list(tensors), set()
        while stack:
            t = stack.pop()
            if t in seen:
                continue
            seen.add(t)
            if t in self.inputs:
                inputs.add(self.inputs.index(t))
            elif t in self.producer and self.producer[t] not in ops:
                i = self.producer[t]
                ops.add(i)
                stack.extend(self.ops[i].ins)
        return sorted(ops), inputs

    def run(self, ops: list[int], values: list) -> dict[int, np.ndarray | Unknown]:
        """The tensors of operators ``ops`` with the subgraph inputs bound to ``values``."""
        env = dict(zip(self.inputs, values))
        for i in ops:
            for t, v in zip(self.ops[i].outs, _evaluate(self, i, env)):
                env[t] = v
        return env

    def value(self, env, t: int):
        if t in env:
            return env[t]
        if t in self.producer:  # written by a later operator (or one the evaluator did not run)
            return Unknown(f"{self.name(t)!r}, which is read before an operator writes it")
        return self.const(t)


def _evaluate(g: _Graph, i: int, env) -> list:
    """Operator ``i`` of ``g`` in numpy: its outputs (values or :class:`Unknown`)."""
    op = g.ops[i]
    code, outs = op.code, op.outs
    here = f"the {g.what}'s {code}_{i}"
    args = [g.value(env, t) for t in op.ins if t >= 0]
    unknown = next((a for a in args if isinstance(a, Unknown)), None)
    dtypes = [g.dtype(t) for t in outs]
    bad = next((d for d in dtypes if isinstance(d, Unknown)), None)
    if unknown is not None:
        return [unknown] * len(outs)
    if code not in KERNELS:
        return [Unknown(f"{here}, an operator the trip count evaluator does not run")] * len(outs)
    if bad is not None or len(outs) != 1:
        return [bad or Unknown(f"{here}, which has {len(outs)} outputs")] * len(outs)
    try:
        out = np.asarray(KERNELS[code](op, *args)).astype(dtypes[0])
    except _Refused as err:
        return [Unknown(f"{here}: {err}")]
    except (ValueError, IndexError, TypeError, OverflowError, AttributeError) as err:
        return [Unknown(f"{here}: {type(err).__name__}: {' '.join(str(err).split())[:120]}")]
    if out.size > MAX_ELEMENTS:
        return [Unknown(f"{here}, a result of {out.size} elements irgen does not follow")]
    return [out]


def _loop_dtype(cond: _Graph, body: _Graph, k: int):
    """The dtype of loop value ``k`` when the condition and the body both declare it the same
    followed type; else an :class:`Unknown`."""
    a, b = cond.dtype(cond.inputs[k]), body.dtype(body.inputs[k])
    if isinstance(a, Unknown) or isinstance(b, Unknown) or a == b:
        return a if isinstance(a, Unknown) or a == b else b
    return Unknown(f"{cond.name(cond.inputs[k])!r}, a loop value the condition and the body type differently")


def entry_value(cond: _Graph, body: _Graph, k: int, expr):
    """Loop value ``k`` at entry: the numpy value of ``expr`` (what the parent graph's converter
    holds for it) when it is an integer or boolean constant of the type the loop declares."""
    import tvm

    dtype = _loop_dtype(cond, body, k)
    if isinstance(dtype, Unknown):
        return dtype
    if not isinstance(expr, tvm.ir.Constant) or str(expr.ty.dtype) != dtype.name:
        return Unknown(f"{cond.name(cond.inputs[k])!r}, a loop value that is no {dtype.name} constant at loop entry")
    value = expr.value.numpy()
    return value if value.size <= MAX_ELEMENTS else Unknown(f"{cond.name(cond.inputs[k])!r}, a large loop value")


def unfoldable(where: str, why: str = ""):
    from irgen.plugin import IrgenError

    return IrgenError(f"{where}: its condition does not fold to a constant{why}; irgen unrolls a WHILE loop only "
                      "when its trip count is static (the condition reads counters and constants only)")


def too_many(where: str, limit: int):
    from irgen.plugin import IrgenError

    return IrgenError(f"{where}: more than {limit} iterations; irgen unrolls at most {limit}")


def _slices(cond: _Graph, body: _Graph) -> tuple[list[int], list[int], set[int]]:
    """The condition's operators, the body operators that compute the loop values the condition
    depends on (directly or through other loop values), and those values (positions)."""
    cond_ops, carried = cond.needs(cond.outputs)
    while True:
        body_ops, more = body.needs(body.outputs[k] for k in carried)
        if more <= carried:
            return cond_ops, body_ops, carried
        carried |= more


def trip_count(model, cond_sg, body_sg, values: list, where: str, limit: int) -> int:
    """How many times the loop runs its body, its values at entry ``values`` (the parent
    converter's expressions); refused (IrgenError) past ``limit`` iterations or when the condition
    reads what the evaluator cannot compute."""
    from irgen.plugin import IrgenError

    cond, body = _Graph(model, cond_sg, "condition"), _Graph(model, body_sg, "body")
    cond_ops, body_ops, carried = _slices(cond, body)
    state = [entry_value(cond, body, k, v) if k in carried else Unknown("a value the condition does not read")
             for k, v in enumerate(values)]
    step, evaluations = 0, 0
    with np.errstate(all="ignore"):  # int32 wraps around as in TFLite's kernels
        while True:
            c = cond.value(cond.run(cond_ops, state), cond.outputs[0])
            if isinstance(c, Unknown):
                raise unfoldable(where, f" (it reads {c.why})")
            if c.size != 1:
                raise unfoldable(where, f" (it has {c.size} elements)")
            if not c.reshape(-1)[0]:
                return step
            if step >= limit:
                raise too_many(where, limit)
            evaluations += len(cond_ops) + len(body_ops)
            if evaluations > MAX_EVALUATIONS:
                raise IrgenError(f"{where}: counting its iterations takes more than {MAX_EVALUATIONS} operator "
                                 f"evaluations ({len(cond_ops) + len(body_ops)} an iteration); irgen refuses a loop "
                                 "it cannot count quickly")
            env = body.run(body_ops, state)
            state = [_next(cond, body, env, k) if k in carried else state[k] for k in range(len(state))]
            step += 1


def _next(cond: _Graph, body: _Graph, env, k: int):
    """Loop value ``k`` after an iteration: the body's output ``k``, of the type the loop declares."""
    v, dtype = body.value(env, body.outputs[k]), _loop_dtype(cond, body, k)
    if isinstance(v, Unknown) or isinstance(dtype, Unknown):
        return v if isinstance(v, Unknown) else dtype
    if v.dtype != dtype:
        return Unknown(f"{body.name(body.outputs[k])!r}, a {v.dtype} result the loop declares {dtype}")
    return v
