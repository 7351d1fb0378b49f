"""Constant subgraphs of a quantized model's operands folded, as ONNX Runtime folds them.

Quantizers do not always store a quantized weight as an integer initializer read by a
``DequantizeLinear``; they write the constant as a small computation that ONNX Runtime's
constant folding (``ConstantFolding``, on by default) computes when it loads the model:

- Brevitas' narrow range: ``int8 initializer -> Clip(-127, 127) -> DequantizeLinear``;
- NNCF after ``nncf.strip``: ``QuantizeLinear(float initializer, scale, zero point) ->
  DequantizeLinear``, the zero point itself an ``Identity`` of an int8 initializer;
- ``Identity``, ``Cast``, ``Reshape``, ``Transpose``... of initializers on the way to a Q/DQ.

ONNX Runtime folds every node all of whose inputs are constant initializers, except
``DequantizeLinear`` (it keeps the QDQ node unit for its quantized kernels) and a node that
writes a graph output. :func:`fold_quantization_constants` does the same for the nodes whose
value ends in an operand of a ``QuantizeLinear`` or ``DequantizeLinear`` (the weights, scales
and zero points the quantization scheme reads as integer constants), through
:data:`FOLDS`: per op, the shape and type of its result (checked against
``--max-tensor-bytes`` before anything is computed) and its numpy computation, exact to
ONNX Runtime's kernel (an op or an operand it cannot compute exactly is left in the graph).
Each folded node's output becomes an initializer of the same name; an initializer no node
reads any more goes, as ONNX Runtime drops it. Other constant arithmetic stays for TVM's
importer, which folds it itself.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

from irgen.plugin import quantize_linear

from .loader import all_nodes, check_size, q, tensor_array


@dataclass(frozen=True)
class Folded:
    """A node's result before it is computed: its shape and type, and how to compute it."""

    shape: tuple[int, ...]
    dtype: np.dtype
    compute: Callable[[], np.ndarray]


#: an op's fold: (node, its input values (None for an omitted one), its attributes) -> Folded,
#: or None when it cannot be computed exactly here (the node stays)
Fold = Callable[[Any, list, dict], "Folded | None"]


def _plain(x) -> bool:
    return x is not None and x.dtype.kind in "biuf"


def _identity(node, vals: list, attrs: dict) -> Folded | None:
    x = vals[0]
    return Folded(x.shape, x.dtype, lambda: x.copy())


def _clip(node, vals: list, attrs: dict) -> Folded | None:
    """Clip: ``min(max(x, lo), hi)`` in ``x``'s type (opset 11+: operands; 6: float attributes)."""
    x = vals[0]
    if not _plain(x) or x.dtype.kind == "b" or (x.dtype.kind == "f" and np.isnan(x).any()):
        return None  # (NaN: which bound a kernel takes is its own)
    if len(vals) > 1:
        bounds = [v for v in vals[1:3] if v is not None]
        if any(b.size != 1 or b.dtype != x.dtype for b in bounds):
            return None
        lo = vals[1].reshape(()) if len(vals) > 1 and vals[1] is not None else None
        hi = vals[2].reshape(()) if len(vals) > 2 and vals[2] is not None else None
    else:
        if x.dtype.kind != "f":
            return None
        lo, hi = (x.dtype.type(attrs[k]) if k in attrs else None for k in ("min", "max"))

    def compute():  # max then min, as ONNX Runtime's kernel: lo > hi gives hi everywhere
        y = x.copy() if lo is None else np.maximum(x, lo)
        return y if hi is None else np.minimum(y, hi)

    return Folded(x.shape, x.dtype, compute)


def _cast(node, vals: list, attrs: dict) -> Folded | None:
    """Cast between numeric types: a float to an integer only where every value is finite and
    its truncation fits the type (C++'s ``static_cast`` is undefined beyond)."""
    from .loader import np_dtype

    x, to = vals[0], np_dtype(attrs.get("to", 0))
    if not _plain(x) or to is None or to.kind not in "biuf" or to.name == "bfloat16":
        return None
    if x.dtype.kind == "f" and to.kind in "iu":
        info = np.iinfo(to)
        with np.errstate(invalid="ignore"):
            t = np.trunc(x)
        if not np.isfinite(x).all() or (x.size and (t.min() < info.min or t.max() > info.max)):
            return None
    return Folded(x.shape, to, lambda: x.astype(to))


def _quantize(node, vals: list, attrs: dict) -> Folded | None:
    """QuantizeLinear of float32 values, per tensor or per axis: ``saturate(round_half_even(x /
    scale) + zero_point)`` in float32 (:func:`irgen.plugin.quantize_linear`, MLAS's rule)."""
    from .fold import foldable_quantize

    x, s = vals[0], vals[1] if len(vals) > 1 else None
    z = vals[2] if len(vals) > 2 and vals[2] is not None else None
    if attrs.get("block_size") or "precision" in attrs:
        return None
    if z is None:
        if attrs.get("output_dtype", 2) != 2:  # UINT8, the default; other types name a zero point
            return None
        z = np.zeros((), np.uint8)
    fit = foldable_quantize(node, x, s, z)
    if fit is None:
        return None
    s, z = fit
    return Folded(x.shape, z.dtype, lambda: quantize_linear(x, s, z.astype(np.int64), str(z.dtype)))


def _moved(x, shape) -> Folded:
    return Folded(tuple(int(d) for d in shape), x.dtype, lambda: x.reshape(shape).copy())


def _reshape(node, vals: list, attrs: dict) -> Folded | None:
    x, shape = vals[0], vals[1] if len(vals) > 1 else None
    if shape is None or shape.dtype != np.int64 or shape.ndim != 1:
        return None
    dims = [int(d) for d in shape]
    if not attrs.get("allowzero", 0):
        if any(d == 0 and k >= x.ndim for k, d in enumerate(dims)):
            return None
        dims = [x.shape[k] if d == 0 else d for k, d in enumerate(dims)]
    if dims.count(-1) > 1 or any(d < -1 for d in dims):
        return None
    if -1 in dims:
        rest = math.prod(d for d in dims if d != -1)
        if rest == 0 or x.size % rest:
            return None
        dims[dims.index(-1)] = x.size // rest
    return _moved(x, dims) if math.prod(dims) == x.size else None


def _axes(node, vals: list, attrs: dict) -> list[int] | None:
    """The ``axes`` of Squeeze/Unsqueeze: an operand (opset 13+) or an attribute; [] when none."""
    if len(vals) > 1 and vals[1] is not None:
        return [int(a) for a in vals[1].reshape(-1)] if vals[1].dtype == np.int64 else None
    return [int(a) for a in attrs.get("axes", [])]


def _squeeze(node, vals: list, attrs: dict) -> Folded | None:
    x, axes = vals[0], _axes(node, vals, attrs)
    if axes is None or any(not -x.ndim <= a < x.ndim for a in axes):
        return None
    axes = {a % x.ndim for a in axes} if axes else {k for k, d in enumerate(x.shape) if d == 1}
    if any(x.shape[a] != 1 for a in axes):
        return None
    return _moved(x, [d for k, d in enumerate(x.shape) if k not in axes])


def _unsqueeze(node, vals: list, attrs: dict) -> Folded | None:
    x, axes = vals[0], _axes(node, vals, attrs)
    rank = x.ndim + len(axes or [])
    if not axes or any(not -rank <= a < rank for a in axes) or len({a % rank for a in axes}) != len(axes):
        return None
    shape, it = [], iter(x.shape)
    new = {a % rank for a in axes}
    for k in range(rank):
        shape.append(1 if k in new else next(it))
    return _moved(x, shape)


def _flatten(node, vals: list, attrs: dict) -> Folded | None:
    x, axis = vals[0], int(attrs.get("axis", 1))
    if not -x.ndim <= axis <= x.ndim:
        return None
    axis += x.ndim if axis < 0 else 0
    return _moved(x, [math.prod(x.shape[:axis]), math.prod(x.shape[axis:])])


def _transpose(node, vals: list, attrs: dict) -> Folded | None:
    x = vals[0]
    perm = [int(p) for p in attrs.get("perm", range(x.ndim - 1, -1, -1))]
    if sorted(perm) != list(range(x.ndim)):
        return None
    return Folded(tuple(x.shape[p] for p in perm), x.dtype, lambda: np.ascontiguousarray(x.transpose(perm)))


def _concat(node, vals: list, attrs: dict) -> Folded | None:
    if any(v is None for v in vals) or len({v.dtype for v in vals}) != 1 or len({v.ndim for v in vals}) != 1:
        return None
    rank, axis = vals[0].ndim, int(attrs.get("axis", 0))
    if rank == 0 or not -rank <= axis < rank:
        return None
    axis %= rank
    if any(v.shape[:axis] + v.shape[axis + 1:] != vals[0].shape[:axis] + vals[0].shape[axis + 1:] for v in vals):
        return None
    shape = list(vals[0].shape)
    shape[axis] = sum(v.shape[axis] for v in vals)
    return Folded(tuple(shape), vals[0].dtype, lambda: np.concatenate(vals, axis=axis))


#: the ops folded, by op type (default domain); DequantizeLinear is not one, as in ONNX Runtime
FOLDS: dict[str, Fold] = {
    "Identity": _identity, "Clip": _clip, "Cast": _cast, "QuantizeLinear": _quantize,
    "Reshape": _reshape, "Squeeze": _squeeze, "Unsqueeze": _unsqueeze, "Flatten": _flatten,
    "Transpose": _transpose, "Concat": _concat,
}
#: the ops whose operands the folded values are for
_QDQ = frozenset({"QuantizeLinear", "DequantizeLinear"})


def _constant_node_value(node) -> np.ndarray | None:
    from onnx import helper

    for a in node.attribute:
        if a.name == "value" and a.HasField("t"):
            return tensor_array(a.t)
        if a.name in ("value_float", "value_floats"):
            return np.asarray(helper.get_attribute_value(a), np.float32)
        if a.name in ("value_int", "value_ints"):
            return np.asarray(helper.get_attribute_value(a), np.int64)
    return None


def _foldable(graph) -> list:
    """The nodes of ``graph`` (in order) that :data:`FOLDS` computes from constants alone and
    whose value ends, through other such nodes, in an operand of a QuantizeLinear or
    DequantizeLinear."""
    inits = {t.name for t in graph.initializer}
    constant = set(inits) | {n.output[0] for n in graph.node if n.op_type == "Constant" and len(n.output) == 1}
    outputs = {o.name for o in graph.output}
    candidates = []
    for n in graph.node:
        if n.domain not in ("", "ai.onnx") or n.op_type not in FOLDS or len(n.output) != 1 or not n.output[0] \
                or n.output[0] in outputs or any(a.type in (5, 10) for a in n.attribute) \
                or not n.input or not all(x in constant for x in n.input if x):
            continue
        constant.add(n.output[0])
        candidates.append(n)
    readers: dict[str, list] = {}
    for n in graph.node:
        for x in n.input:
            readers.setdefault(x, []).append(n)
    wanted: set[str] = set()
    for n in reversed(candidates):  # a candidate is wanted when a Q/DQ or a wanted candidate reads it
        if any(r.op_type in _QDQ or (r.output and r.output[0] in wanted) for r in readers.get(n.output[0], ())):
            wanted.add(n.output[0])
    return [n for n in candidates if n.output[0] in wanted and (n.op_type != "QuantizeLinear" or _weights(n, readers))]


#: ops whose inputs after the first are weights
_WEIGHTED = frozenset({"Conv", "ConvTranspose", "Gemm", "MatMul"})


def _weights(q_node, readers: dict) -> bool:
    """Whether every reader of ``q_node``'s result is a DequantizeLinear whose float value is only
    a weight operand (an input after the first of a Conv, ConvTranspose, Gemm or MatMul): a
    constant quantized on load for its weights alone (NNCF after ``nncf.strip``). A constant
    table quantized at run time and then moved on its integers is the ``qdq`` scheme's to
    realize as ONNX Runtime runs it, and stays."""
    dqs = readers.get(q_node.output[0], ())
    return bool(dqs) and all(
        d.op_type == "DequantizeLinear" and readers.get(d.output[0]) and all(
            r.op_type in _WEIGHTED and d.output[0] not in r.input[:1] for r in readers[d.output[0]]) for d in dqs)


def fold_quantization_constants(model, path: Path, limit: int | None) -> int:
    """Fold the constant subgraphs that end in a Q/DQ operand (see the module text) in the
    top-level graph; returns how many nodes were folded. Every result is size-checked
    against ``limit`` (``--max-tensor-bytes``) before it is computed."""
    from onnx import helper, numpy_helper

    from .checks import _node
    from .fold import _set_nodes

    g = model.graph
    todo = _foldable(g)
    if not todo:
        return 0
    inits = {t.name: t for t in g.initializer}
    consts = {n.output[0]: n for n in g.node if n.op_type == "Constant" and len(n.output) == 1}
    values: dict[str, np.ndarray] = {}

    def value(name: str):
        if name not in values:
            v = tensor_array(inits[name]) if name in inits else _constant_node_value(consts[name]) \
                if name in consts else None
            values[name] = None if v is None else np.asarray(v)
        return values[name]

    done: set[int] = set()
    for n in todo:
        vals = [value(x) if x else None for x in n.input]
        if vals[0] is None or any(v is None for x, v in zip(n.input, vals) if x):
            continue
        attrs = {a.name: helper.get_attribute_value(a) for a in n.attribute}
        plan = FOLDS[n.op_type](n, vals, attrs)
        if plan is None:
            continue
        check_size(f"{path}: tensor {q(n.output[0])} ({_node(n)}, folded as a constant)", plan.shape,
                   helper.np_dtype_to_tensor_dtype(plan.dtype), limit)
        v = np.asarray(plan.compute())
        assert v.shape == plan.shape and v.dtype == plan.dtype, (n.op_type, v.shape, plan.shape)
        values[n.output[0]] = v
        done.add(id(n))
    if not done:
        return 0
    nodes = list(g.node)  # the wrappers stay alive: their ids name them above
    kept = [n for n in nodes if id(n) not in done]
    folded = [n.output[0] for n in nodes if id(n) in done]
    _set_nodes(g, kept)
    read = {x for n in all_nodes(model) for x in n.input} | {o.name for o in g.output}
    listed = {v.name for v in g.input}
    drop = [t for t in g.initializer if t.name not in read and t.name not in listed]
    for t in drop:  # an initializer read only by folded nodes goes, as ONNX Runtime drops it
        g.initializer.remove(t)
    g.initializer.extend(numpy_helper.from_array(values[name], name) for name in folded if name in read)
    return len(done)
