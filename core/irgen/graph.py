"""The Relax dataflow graph as irgen sees it (claim step 3).

``main`` of an imported module is one dataflow block of bindings. This module
reads it into :class:`Binding` records, folds constants, batch norms (into the
preceding convolution) and static shapes, and builds the module that runs each
layer as one function (so one fused kernel). Layers themselves are formed by
:mod:`irgen.layers`; their op names come from :mod:`irgen.ops`.

Frontends name every binding that holds a source tensor (see
:class:`irgen.api.Provenance`); layers are matched between the analysed and
the executed module by those names.
"""

from __future__ import annotations

import math

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import tvm
from tvm import relax

from irgen import reference
from irgen.api import IrgenError, Provenance
from irgen.safeio import check_tensor_size

Constant = tvm.ir.Constant



def op_name(call: relax.Call) -> str | None:
    """The Relax op name of a call (``relax.nn.conv2d``), or None for other callees."""
    op = call.op
    return op.name if isinstance(op, tvm.ir.Op) else None


def attrs_to_dict(attrs: Any) -> dict[str, Any]:
    """A JSON-able dict of a call's attributes."""
    if attrs is None:
        return {}
    out = {}
    for key in dir(attrs):
        if key.startswith("_") or key in {"get_int", "get_int_tuple", "get_str", "id_", "is_", "same_as"}:
            continue
        try:
            value = getattr(attrs, key)
        except Exception:  # pragma: no cover - attribute that cannot be read
            continue
        if callable(value):
            continue
        out[key] = to_json(value)
    return out


def to_json(value: Any) -> Any:
    # a float JSON cannot hold (a clip without an upper bound, a -inf fill) is written as the
    # string "inf", "-inf" or "nan"; irgen.reference.from_json_number reads it back
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)) or type(value).__name__ == "Array":
        return [to_json(v) for v in value]
    if hasattr(value, "value"):
        return to_json(value.value)
    if type(value).__name__ == "DataType":
        return str(value)
    return str(value)


def tensor_type(expr: relax.Expr) -> tuple[tuple[int, ...], str] | None:
    """Static shape and dtype of a tensor-typed expression, None if not a static tensor."""
    ty = expr.ty
    if not isinstance(ty, relax.TensorType) or ty.shape is None:
        return None
    try:
        shape = tuple(int(d) for d in ty.shape.values)
    except (TypeError, AttributeError):
        try:
            shape = tuple(int(d) for d in ty.shape)
        except Exception:
            return None
    return shape, str(ty.dtype)


@dataclass
class Binding:
    """One ``var = value`` of ``main``'s dataflow block."""

    name: str
    var: relax.Var
    value: relax.Expr

    @property
    def kind(self) -> str:
        v = self.value
        if isinstance(v, relax.Call):
            return "call"
        if isinstance(v, relax.TupleGetItem):
            return "tgi"
        if isinstance(v, relax.Var):
            return "alias"
        if isinstance(v, relax.Tuple):
            return "tuple"
        if isinstance(v, Constant):
            return "const"
        return "other"

    @property
    def op(self) -> str | None:
        return op_name(self.value) if isinstance(self.value, relax.Call) else None


def var_names(expr: relax.Expr) -> list[str]:
    """Names of the variables an expression reads, in order (through tuples)."""
    if isinstance(expr, relax.Var):
        return [expr.name]
    if isinstance(expr, relax.Call):
        return [n for a in expr.args for n in var_names(a)]
    if isinstance(expr, relax.Tuple):
        return [n for f in expr.fields for n in var_names(f)]
    if isinstance(expr, relax.TupleGetItem):
        return var_names(expr.tuple_value)
    return []


def constants(expr: relax.Expr) -> list[Constant]:
    """Tensor constants an expression reads, in order."""
    if isinstance(expr, Constant):
        return [expr] if isinstance(expr.ty, relax.TensorType) else []
    if isinstance(expr, relax.Call):
        return [c for a in expr.args for c in constants(a)]
    if isinstance(expr, relax.Tuple):
        return [c for f in expr.fields for c in constants(f)]
    return []


def module_bindings(mod: tvm.IRModule) -> list:
    """Every binding of ``main``, in order, whatever its kind (no checks)."""
    return [b for block in mod["main"].body.blocks for b in block.bindings]


def check_tensor_sizes(bindings, limit: int | None, provenance: Provenance | None = None, where: str = "") -> None:
    """Refuse the model when a tensor it computes (by the shapes TVM inferred) is over
    ``limit`` bytes, before anything compiles or allocates it.

    ``bindings`` are objects with a ``var`` (Relax bindings or :class:`Binding`). The
    message names the source tensor and node (``provenance``); an unnamed binding
    belongs to the next named one, the source op it was emitted for."""

    if limit is None:
        return

    def tensors(ty):
        if isinstance(ty, relax.TensorType):
            yield ty
        elif isinstance(ty, relax.TupleType):
            for f in ty.fields:
                yield from tensors(f)

    by_var = provenance.by_var if provenance is not None else {}
    bindings = list(bindings)
    owners: list[Any] = [None] * len(bindings)
    owner = None
    for k in range(len(bindings) - 1, -1, -1):
        owner = by_var.get(bindings[k].var.name) or owner
        owners[k] = owner
    prefix = f"{where}: " if where else ""
    for b, src in zip(bindings, owners):
        name = b.var.name
        for info in tensors(b.var.ty):
            dims = getattr(info.shape, "values", None)
            if dims is None or not all(hasattr(d, "value") for d in dims):
                continue  # symbolic: checked once the input shapes are known
            if name in by_var and by_var[name][2]:
                what = f"{prefix}tensor {by_var[name][2]!r} ({by_var[name][1]} node {by_var[name][0]!r})"
            elif src is not None:
                what = f"{prefix}a tensor computed for {src[1]} node {src[0]!r}"
            else:
                what = f"{prefix}tensor {name!r} of the imported graph"
            check_tensor_size(what, [int(d) for d in dims], str(info.dtype), limit)


def main_bindings(mod: tvm.IRModule) -> tuple[relax.Function, list[Binding]]:
    """``main`` and its bindings; irgen handles one dataflow block of static shapes."""
    func = mod["main"]
    body = func.body
    bindings: list[Binding] = []
    for block in body.blocks:
        for b in block.bindings:
            if not isinstance(b, relax.VarBinding):
                raise IrgenError("the model needs dynamic shapes (match_cast); give static input shapes")
            bindings.append(Binding(b.var.name, b.var, b.value))
    return func, bindings


def substitute(expr: relax.Expr, vmap: dict[str, relax.Expr], cmap: dict | None = None) -> relax.Expr:
    """Rebuild ``expr`` with variables replaced by name and constants by identity."""
    if isinstance(expr, relax.Var):
        return vmap.get(expr.name, expr)
    if isinstance(expr, Constant):
        if cmap:
            for c, repl in cmap:
                if c.same_as(expr):
                    return repl
        return expr
    if isinstance(expr, relax.Call):
        return relax.Call(expr.op, [substitute(a, vmap, cmap) for a in expr.args], expr.attrs, expr.ty_args)
    if isinstance(expr, relax.Tuple):
        return relax.Tuple([substitute(f, vmap, cmap) for f in expr.fields])
    if isinstance(expr, relax.TupleGetItem):
        return relax.TupleGetItem(substitute(expr.tuple_value, vmap, cmap), expr.index)
    return expr


def rewrite_blocks(func: relax.Function, rewrite: Callable[[relax.VarBinding], relax.VarBinding]) -> list:
    """``func``'s binding blocks with every binding replaced by ``rewrite(binding)``; a
    dataflow block stays one."""
    blocks = []
    for block in func.body.blocks:
        bindings = [rewrite(b) for b in block.bindings]
        blocks.append(relax.DataflowBlock(bindings) if isinstance(block, relax.DataflowBlock)
                      else relax.BindingBlock(bindings))
    return blocks


def rebuild_main(mod: tvm.IRModule, bindings: list[Binding]) -> tvm.IRModule:
    """``mod`` with ``main``'s dataflow block replaced by ``bindings`` (vars kept)."""
    func = mod["main"]
    out = func.body.body
    # the block's output var(s) are non-dataflow vars; keep the block as dataflow
    block = relax.DataflowBlock([relax.VarBinding(b.var, b.value) for b in bindings])
    new_func = relax.Function(func.params, relax.SeqExpr([block], out), func.ret_ty, func.is_pure, func.attrs)
    new_mod = tvm.IRModule({gv: f for gv, f in mod.functions.items() if gv.name_hint != "main"})
    new_mod["main"] = new_func
    return relax.transform.Normalize()(new_mod)


def drop_dead_bindings(mod: tvm.IRModule) -> tvm.IRModule:
    """``main`` without the bindings its result does not depend on. A ``.pt2`` keeps what
    the model computed and then dropped (a transformers encoder's pooler when only the
    hidden states are returned); a layer of them would have no kernel once TVM removes them.
    Only pure ops are dropped, and only from a ``main`` of one dataflow block."""
    func = mod["main"]
    if len(func.body.blocks) != 1 or not isinstance(func.body.blocks[0], relax.DataflowBlock):
        return mod
    _, bindings = main_bindings(mod)
    live = set(var_names(func.body.body))
    keep: list[Binding] = []
    for b in reversed(bindings):
        op = b.value.op if isinstance(b.value, relax.Call) else None
        pure = not isinstance(op, tvm.ir.Op) or bool(op.get_attr("FPurity"))
        if b.name in live or not pure:
            keep.append(b)
            live.update(var_names(b.value))
    if len(keep) == len(bindings):
        return mod
    return rebuild_main(mod, keep[::-1])


def users_of(bindings: list[Binding]) -> dict[str, list[int]]:
    """Which bindings read each variable (their indices, in order). The names a binding reads
    are kept on it (a binding's value is never reassigned): a quantization scheme re-indexes
    the same bindings after every rewrite, and walking a value costs a call into TVM per node."""
    users: dict[str, list[int]] = {}
    for i, b in enumerate(bindings):
        reads = b.__dict__.get("_reads")
        if reads is None:
            reads = b.__dict__["_reads"] = var_names(b.value)
        for n in reads:
            users.setdefault(n, []).append(i)
    return users


def const_np(c: Constant) -> np.ndarray:
    return c.value.numpy()


def const_view(c: Constant) -> np.ndarray:
    """A read-only view of a constant's data, without a copy (a model's weights are not held
    twice); a copy when numpy cannot view its dtype through DLPack."""
    try:
        a = np.from_dlpack(c.value)
    except (TypeError, BufferError, RuntimeError, ValueError):
        return c.value.numpy()
    a.flags.writeable = False
    return a


# --------------------------------------------------------------------------
# Constant data movement folded in numpy: TVM's FoldConstant compiles a kernel with
# LLVM for every op it folds (about 60 ms each); an importer's reshape of each conv
# bias and transpose of each dense weight are plain data movement, exact in numpy.


def _static_dims(shape) -> tuple[int, ...] | None:
    try:
        return tuple(int(d) for d in shape.values)
    except (AttributeError, TypeError, ValueError):
        return None


def _fold_reshape(call: relax.Call, x: np.ndarray) -> np.ndarray | None:
    shape = _static_dims(call.args[1]) if len(call.args) > 1 and isinstance(call.args[1], relax.ShapeExpr) else None
    return None if shape is None or int(np.prod(shape)) != x.size else x.reshape(shape)


def _fold_permute(call: relax.Call, x: np.ndarray) -> np.ndarray:
    axes = call.attrs.axes
    return np.transpose(x, None if axes is None else [int(a) for a in axes])


def _fold_squeeze(call: relax.Call, x: np.ndarray) -> np.ndarray:
    axis = call.attrs.axis
    return np.squeeze(x, None if axis is None else tuple(int(a) for a in axis))


def _fold_expand_dims(call: relax.Call, x: np.ndarray) -> np.ndarray:
    return np.expand_dims(x, tuple(int(a) for a in call.attrs.axis))


#: Relax op -> numpy data movement of its constant first argument (None: not folded here)
NUMPY_FOLDS: dict[str, Callable[[relax.Call, np.ndarray], np.ndarray | None]] = {
    "relax.reshape": _fold_reshape,
    "relax.permute_dims": _fold_permute,
    "relax.squeeze": _fold_squeeze,
    "relax.expand_dims": _fold_expand_dims,
}


def _reads_a_var(expr: relax.Expr) -> bool:
    if isinstance(expr, relax.Var):
        return True
    if isinstance(expr, relax.Tuple):
        return any(_reads_a_var(f) for f in expr.fields)
    if isinstance(expr, relax.TupleGetItem):
        return _reads_a_var(expr.tuple_value)
    return False


def has_constant_call(mod: tvm.IRModule) -> bool:
    """Whether ``FoldConstant`` may change ``mod``: some binding of a Relax function binds a
    value that reads no variable (a constant, which the pass propagates into its users, or a
    call of constants, shapes and attributes, which it may fold), or a function is not flat
    dataflow (then the pass runs, as always before)."""
    found: list[relax.Call] = []

    def visit(expr: Any) -> None:
        if not found and isinstance(expr, relax.Call) and not any(_reads_a_var(a) for a in expr.args):
            found.append(expr)

    for func in mod.functions.values():
        if not isinstance(func, relax.Function):
            continue
        body = func.body
        if not isinstance(body, relax.SeqExpr):
            return True
        for block in body.blocks:
            for b in block.bindings:
                if not isinstance(b, relax.VarBinding):  # a match_cast: let the pass decide
                    return True
                if not isinstance(b.value, relax.Call) and not _reads_a_var(b.value):  # a bound constant
                    return True
        relax.analysis.post_order_visit(body, visit)
        if found:
            return True
    return False


def fold_constants(mod: tvm.IRModule) -> tvm.IRModule:
    """``relax.transform.FoldConstant()(mod)``, skipped when nothing in ``mod`` reads only
    constants (:func:`has_constant_call`), as on most models once :func:`fold_data_movement` ran: the
    pass legalizes every call just to look at it (Python, about 1.7 ms a call: 0.7 s on a
    quantized ResNet-18, twice a run) and then returns the module unchanged."""
    if not has_constant_call(mod):
        return mod
    return relax.transform.FoldConstant()(mod)


def _moved_const(out: np.ndarray) -> Constant:
    """The constant of a folded value: on the run's weight file when one is open and it is
    large (:func:`irgen.spill.weight_tensor`: a transposed weight is not one more copy in memory)."""
    from irgen import spill

    if spill.active() and out.nbytes >= spill.MIN_BYTES:
        return relax.const(spill.weight_tensor(out), str(out.dtype))
    return relax.const(out, str(out.dtype))


def _release(x: np.ndarray) -> None:
    from irgen import spill

    spill.release(x)


def fold_data_movement(mod: tvm.IRModule) -> tvm.IRModule:
    """Replace every :data:`NUMPY_FOLDS` op on a constant (or on such a result) by its value,
    computed in numpy, in the bindings that read it, as ``FoldConstant`` would propagate it
    (the folded binding goes, unless ``main`` returns it): with nothing left to fold, the
    pass is skipped (:func:`fold_constants`; 0.25 s on a float ResNet-18). Values are moved,
    never computed, so they are the bytes TVM's kernel would give."""
    func, bindings = main_bindings(mod)
    values: dict[str, np.ndarray] = {}
    changed = False
    new: list[Binding] = []
    for b in bindings:
        v = b.value
        fold = NUMPY_FOLDS.get(b.op) if isinstance(v, relax.Call) and v.args else None
        src = v.args[0] if fold else None
        x = const_view(src) if isinstance(src, Constant) else values.get(src.name) if isinstance(src, relax.Var) else None
        out = fold(v, x) if x is not None else None
        if out is not None and tensor_type(b.var) == (tuple(out.shape), str(out.dtype)):
            folded_const = _moved_const(out)
            values[b.name] = const_view(folded_const)  # no copy of a weight is held here
            _release(x)  # the pages of a weight on the run's weight file, read by the move
            new.append(Binding(b.name, b.var, folded_const))
            changed = True
        else:
            new.append(b)
    if not changed:
        return mod
    folded = {b.name: b.value for b in new if b.name in values}
    returned = set(var_names(func.body.body))
    out: list[Binding] = []
    for b in new:
        if b.name in folded:
            if b.name in returned:
                out.append(b)
        elif any(n in folded for n in var_names(b.value)):
            out.append(Binding(b.name, b.var, substitute(b.value, folded)))
        else:
            out.append(b)
    return rebuild_main(mod, out)


# --------------------------------------------------------------------------
# Batch-norm folding: conv2d (+ bias) -> batch_norm -> [0]  ==>  conv2d' + bias'


def guard_gathers(mod: tvm.IRModule, provenance: Provenance) -> tvm.IRModule:
    """Every gather (``relax.take``) memory-safe, before anything runs or folds one.

    TVM's importers emit ``take`` in mode ``fast``, which reads an index out of range out of
    bounds, and a negative one before the tensor: a model file could put another buffer's
    bytes into the golden data, or crash the run. A gather of constant indices is checked
    (:func:`check_gather_indices`); one of computed indices, or of constant ones with a
    negative index, is taken in mode ``wrap``, which gives the same value for every index in
    range, negative ones included, and stays inside the tensor for any other."""
    _, bindings = main_bindings(mod)
    check_gather_indices(bindings, provenance)
    out, changed = [], False
    for b in bindings:
        idx = b.value.args[1] if b.op == "relax.take" else None
        # computed indices, or constant ones counting from the end (Falcon's qkv[..., [-2], :]),
        # which mode fast reads before the tensor
        if b.op == "relax.take" and str(b.value.attrs.mode) == "fast" \
                and (not isinstance(idx, Constant) or (const_np(idx) < 0).any()):
            b = Binding(b.name, b.var, relax.op.take(*b.value.args[:2], axis=b.value.attrs.axis, mode="wrap"))
            changed = True
        out.append(b)
    return rebuild_main(mod, out) if changed else mod


def check_gather_indices(bindings: list[Binding], provenance: Provenance) -> None:
    """A gather of constant indices (at import, or once folding made them constant) reads
    only indices in ``[-n, n)``, as every source runtime requires; else the import stops,
    naming the source node."""
    for b in bindings:
        if b.op != "relax.take" or not isinstance(b.value.args[1], Constant) or str(b.value.attrs.mode) == "clip":
            continue
        data, axis = b.value.args[0], b.value.attrs.axis
        shape = tensor_type(data)
        n = None if shape is None else (int(np.prod(shape[0])) if axis is None else shape[0][int(axis)])
        values = const_np(b.value.args[1]).astype(np.int64).reshape(-1)
        bad = values[(values < -n) | (values >= n)] if n is not None else values
        if bad.size:
            src = provenance.by_var.get(b.name)
            where = f"node {src[0]!r} ({src[1]})" if src else f"tensor {b.name!r}"
            why = (f"index {int(bad[0])} is out of range for an axis of size {n}" if n is not None
                   else "the size of the gathered axis is not known")
            raise IrgenError(f"{where}: gather {why}; the model is malformed")


def _name_after_conv(provenance: Provenance, conv_vars: list[str], norm_vars: list[str]) -> None:
    """A layer anchored at a folded batch norm's source node takes its convolution's name."""
    by_var = provenance.by_var
    conv = next((by_var[n][0] for n in conv_vars if n in by_var), None)
    norm = next((by_var[n][0] for n in norm_vars if n in by_var), None)
    if conv is not None and norm is not None and norm != conv:
        provenance.layer_names[norm] = provenance.layer_names.get(conv, conv)


#: the convolutions a batch norm after them folds into, with their (data, kernel) layouts
_FOLDABLE_CONVS = {"relax.nn.conv2d": ("NCHW", "OIHW"), "relax.nn.conv3d": ("NCDHW", "OIDHW")}


def fold_batch_norm(mod: tvm.IRModule, provenance: Provenance) -> tvm.IRModule:
    """Fold inference batch norms that follow a convolution into its weight and bias.

    The folded layer keeps the batch norm's output name; the convolution's and
    batch norm's source nodes are recorded as merged into it.
    """
    _, bindings = main_bindings(mod)
    users = users_of(bindings)
    by_name = {b.name: i for i, b in enumerate(bindings)}
    drop: set[int] = set()
    replace: dict[int, relax.Expr] = {}
    for i, b in enumerate(bindings):
        if b.op != "relax.nn.batch_norm":
            continue
        data, gamma, beta, mean, var = b.value.args[:5]
        if not all(isinstance(x, Constant) for x in (gamma, beta, mean, var)) or not isinstance(data, relax.Var):
            continue
        u = users.get(b.name, [])
        # the ONNX importer also emits bn[1], bn[2] (running mean/var), unused in inference
        dead = [k for k in u if bindings[k].kind == "tgi" and bindings[k].value.index != 0 and not users.get(bindings[k].name)]
        u = [k for k in u if k not in dead]
        if len(u) != 1 or bindings[u[0]].kind != "tgi" or bindings[u[0]].value.index != 0:
            continue
        out_idx = u[0]
        chain = []  # producer bindings: conv2d, optional bias add
        j = by_name.get(data.name)
        if j is None or len(users.get(data.name, [])) != 1:
            continue
        bias = None
        bias_arg = bindings[j].value.args[1] if bindings[j].op == "relax.add" else None
        bias_src = None  # the importer's R.reshape(const, [1, C, 1, 1]) binding of a conv bias
        if isinstance(bias_arg, relax.Var) and bias_arg.name in by_name and len(users.get(bias_arg.name, [])) == 1:
            k = by_name[bias_arg.name]
            if bindings[k].op == "relax.reshape" and isinstance(bindings[k].value.args[0], Constant):
                bias_src = k
        if bias_arg is not None and (isinstance(bias_arg, Constant) or bias_src is not None):
            bias = const_np(bias_arg if bias_src is None else bindings[bias_src].value.args[0])
            chain.append(j)
            if bias_src is not None:
                chain.append(bias_src)
            inner = bindings[j].value.args[0]
            j = by_name.get(inner.name) if isinstance(inner, relax.Var) else None
            if j is None or len(users.get(inner.name, [])) != 1:
                continue
        conv = bindings[j]
        layouts = _FOLDABLE_CONVS.get(conv.op or "")
        if layouts is None or not isinstance(conv.value.args[1], Constant):
            continue
        cattrs = conv.value.attrs
        if (str(cattrs.data_layout), str(cattrs.kernel_layout)) != layouts or int(b.value.attrs.axis) != 1:
            continue
        eps = float(b.value.attrs.epsilon)
        w = const_np(conv.value.args[1])
        g, bt, m, v = (const_np(x) for x in (gamma, beta, mean, var))
        scale = (g / np.sqrt(v + np.asarray(eps, dtype=v.dtype))).astype(w.dtype)
        spatial = (1,) * (w.ndim - 2)
        new_w = (w * scale.reshape((-1, 1) + spatial)).astype(w.dtype)  # one scale per output channel
        b0 = bias.reshape(-1) if bias is not None else np.zeros_like(m)
        new_b = ((b0 - m) * scale + bt).astype(w.dtype).reshape((1, -1) + spatial)
        replace[j] = relax.Call(conv.value.op, [conv.value.args[0], relax.const(new_w)], conv.value.attrs, conv.value.ty_args)
        replace[out_idx] = relax.op.add(conv.var, relax.const(new_b))
        drop.update(chain)
        drop.update(dead)
        drop.add(i)
        merged = provenance.merged.setdefault(bindings[out_idx].name, [])
        merged.extend([bindings[k].name for k in chain] + [b.name, conv.name])
        _name_after_conv(provenance, [conv.name, *(bindings[k].name for k in chain)], [bindings[out_idx].name, b.name])
    if not replace:
        return mod
    new = [
        Binding(b.name, b.var, replace.get(i, b.value)) for i, b in enumerate(bindings) if i not in drop
    ]
    return rebuild_main(mod, new)


# --------------------------------------------------------------------------
# Static shapes: shape arithmetic an importer left in the graph (ONNX
# Shape -> Gather -> Div -> Slice for torch's ``chunk``) is evaluated, and the
# ops it feeds get static shapes again (dynamic_strided_slice -> strided_slice)


def _static(ty) -> bool:
    if isinstance(ty, relax.TupleType):
        return all(_static(f) for f in ty.fields)
    if isinstance(ty, relax.TensorType):
        dims = getattr(ty.shape, "values", None)
        return dims is not None and all(hasattr(d, "value") for d in dims)
    if isinstance(ty, relax.ShapeType):
        values = getattr(ty, "values", None)
        return values is not None and all(hasattr(d, "value") for d in values)
    return True


def _known(expr: relax.Expr) -> Any:
    """The value of a constant argument: an array, a tuple of ints (a shape), a scalar; else None."""
    if isinstance(expr, Constant) and isinstance(expr.ty, relax.TensorType):
        return const_np(expr)
    if isinstance(expr, relax.ShapeExpr) and all(hasattr(d, "value") for d in expr.values):
        return tuple(int(d.value) for d in expr.values)
    if isinstance(expr, Constant) and isinstance(getattr(expr, "value", None), (int, float)):
        return expr.value  # a PrimValue (IntImm / FloatImm)
    return None


def _shape_of(args, attrs, var_arg):
    ty = var_arg.ty
    return tuple(int(d.value) for d in ty.shape.values) if _static(ty) else None


def _scatter_elements(args, attrs):
    data, idx, upd = (np.asarray(a) for a in args)
    if str(attrs.get("reduction", "update")) != "update" or data.ndim != 1:
        return None
    out = data.copy()
    out[idx.astype(np.int64) % data.shape[0]] = upd
    return out


#: shape ops evaluated on constants: fn(args, attrs) -> value, or None when it cannot
_SHAPE_OPS: dict[str, Any] = {
    "relax.shape_to_tensor": lambda args, attrs: np.asarray(args[0], dtype=np.int64),
    "relax.tensor_to_shape": lambda args, attrs: tuple(int(v) for v in np.asarray(args[0]).reshape(-1)),
    "relax.scatter_elements": _scatter_elements,
}
#: arithmetic on shape values (integer and bool tensors), from the numpy reference
_SHAPE_ARITH = {"relax.take", "relax.add", "relax.subtract", "relax.multiply", "relax.divide", "relax.floor_divide",
                "relax.where", "relax.less", "relax.greater", "relax.equal", "relax.less_equal",
                "relax.greater_equal", "relax.concat", "relax.astype", "relax.reshape", "relax.squeeze",
                "relax.expand_dims", "relax.maximum", "relax.minimum", "relax.strided_slice", "relax.negative"}
_SHAPE_VALUE_LIMIT = 1 << 12
#: ops that start shape arithmetic (no kernel runs them at opt level 0)
_SHAPE_SOURCES = {"relax.shape_of", "relax.shape_to_tensor", "relax.tensor_to_shape", "relax.dynamic_strided_slice"}


def _evaluate(call: relax.Call, args: list[relax.Expr]) -> Any:
    """The value of a shape computation on constants, or None."""

    name = op_name(call)
    if name == "relax.shape_of":
        return _shape_of(None, None, args[0]) if isinstance(args[0], relax.Expr) else None
    flat = []
    for a in args:
        if isinstance(a, relax.Tuple):
            vals = [_known(f) for f in a.fields]
            if any(v is None for v in vals):
                return None
            flat.extend(vals)
        else:
            v = _known(a)
            if v is None:
                return None
            flat.append(v)
    attrs = attrs_to_dict(call.attrs)
    if name in _SHAPE_OPS:
        return _SHAPE_OPS[name](flat, attrs)
    if name in _SHAPE_ARITH:
        ty = call.ty
        if not isinstance(ty, relax.TensorType) or not (str(ty.dtype).startswith(("int", "uint")) or str(ty.dtype) == "bool"):
            return None
        if any(isinstance(v, np.ndarray) and v.size > _SHAPE_VALUE_LIMIT for v in flat):
            return None
        flat = [{"shape": list(v)} if isinstance(v, tuple) else v for v in flat]
        try:
            return np.asarray(reference.OPS[name](flat, attrs)).astype(str(ty.dtype))
        except Exception:
            return None
    return None


def _static_slice(call: relax.Call, args: list[relax.Expr], emit) -> relax.Expr | None:
    """dynamic_strided_slice(x, begin, end, strides) with constant bounds -> strided_slice."""
    x = args[0]
    vals = [_known(a) for a in args[1:4]]
    if any(v is None for v in vals) or not _static(x.ty):
        return None
    dims = [int(d.value) for d in x.ty.shape.values]
    begin, end, strides = (np.asarray(v, dtype=np.int64).reshape(-1).tolist() for v in vals)
    b2, e2, s2 = [], [], []
    for n, b, e, st in zip(dims, begin, end, strides):
        if st == 0:
            return None
        start, stop, step = slice(b, e, st).indices(n)
        if step < 0 and stop < 0:
            return None  # runs to the front: not expressible as a non-negative end
        b2.append(start)
        e2.append(stop)
        s2.append(step)
    # one axis per strided_slice (the IR lists a slice's axes, begins, ends and
    # strides flat; with one axis they read unambiguously); the axes that cut
    cut = [a for a, n in enumerate(dims) if (b2[a], e2[a], s2[a]) != (0, n, 1)] or [0]
    out = x
    for k, a in enumerate(cut):
        if k:
            out = emit(out)
        out = relax.op.strided_slice(out, [a], [b2[a]], [e2[a]], [s2[a]])
    return out


def static_shapes(mod: tvm.IRModule) -> tvm.IRModule:
    """``mod`` with shape arithmetic on known shapes folded into constants and the ops
    that read it rebuilt with static shapes; unchanged when every shape is static."""
    func, bindings = main_bindings(mod)
    if all(_static(b.var.ty) for b in bindings) and not any(b.op in _SHAPE_SOURCES for b in bindings):
        return mod
    vmap: dict[str, relax.Expr] = {}
    bb = relax.BlockBuilder(tvm.IRModule({gv: f for gv, f in mod.functions.items() if gv.name_hint != "main"}))
    with bb.function("main", list(func.params), attrs=dict(func.attrs) if func.attrs else None, pure=True):
        with bb.dataflow():
            for b in bindings:
                value = substitute(b.value, vmap)
                if isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.Op):
                    name = op_name(value)
                    if name == "relax.dynamic_strided_slice":
                        sliced = _static_slice(value, list(value.args), bb.emit)
                        value = value if sliced is None else sliced
                    elif name == "relax.reshape" and not isinstance(value.args[1], relax.ShapeExpr):
                        shape = _known(value.args[1])
                        if isinstance(shape, tuple):
                            value = relax.op.reshape(value.args[0], shape)
                    else:
                        got = _evaluate(bb.normalize(value), list(value.args))
                        if got is not None and not isinstance(b.var, relax.DataflowVar):
                            got = None  # a model output stays a binding
                        if isinstance(got, tuple):
                            vmap[b.name] = relax.ShapeExpr(list(got))
                            continue
                        if isinstance(got, np.ndarray):
                            vmap[b.name] = relax.const(got, str(got.dtype))
                            continue
                if isinstance(b.var, relax.DataflowVar):
                    vmap[b.name] = bb.emit(value, name_hint=b.name)
                else:
                    vmap[b.name] = bb.emit_output(value, name_hint=b.name)
        bb.emit_func_output(substitute(func.body.body, vmap))
    return relax.transform.Normalize()(bb.get())


# --------------------------------------------------------------------------
# Tuple literals: a converter that builds a multi-output op's result from
# several ops (torch ``unbind``: split, then a squeeze per item, then a tuple)


def flatten_tuples(mod: tvm.IRModule, provenance: Provenance) -> tvm.IRModule:
    """Remove tuple-literal bindings that are only read item by item.

    Each item read ``g = t[i]`` becomes the binding of the field itself when that
    field is an unnamed single-use op (so ``g = squeeze(...)``, named after the
    source tensor), else an alias ``g = field``. The tuple's source node is
    recorded as merged into each item."""
    func, bindings = main_bindings(mod)
    users = users_of(bindings)
    out_names = set(var_names(func.body.body))
    by_name = {b.name: i for i, b in enumerate(bindings)}
    rebind: dict[int, relax.Var] = {}  # field binding index -> the item's var
    alias: dict[int, relax.Expr] = {}  # item binding index -> the field
    drop: set[int] = set()
    for i, b in enumerate(bindings):
        if b.kind != "tuple" or b.name in out_names:
            continue
        u = users.get(b.name, [])
        if not u or any(bindings[k].kind != "tgi" for k in u):
            continue
        for k in u:
            g = bindings[k]
            f = b.value.fields[int(g.value.index)]
            j = by_name.get(f.name) if isinstance(f, relax.Var) else None
            if (j is not None and j not in rebind and bindings[j].kind == "call" and f.name not in provenance.by_var
                    and users.get(f.name) == [i] and f.name not in out_names):
                rebind[j] = g.var
                drop.add(k)
            else:
                alias[k] = f
            if b.name in provenance.by_var:
                provenance.merged.setdefault(g.name, []).append(b.name)
        drop.add(i)
    if not drop:
        return mod
    new = []
    for i, b in enumerate(bindings):
        if i in drop:
            continue
        if i in rebind:
            new.append(Binding(rebind[i].name, rebind[i], b.value))
        elif i in alias:
            new.append(Binding(b.name, b.var, alias[i]))
        else:
            new.append(b)
    return rebuild_main(mod, new)


# --------------------------------------------------------------------------
# Passes on main's shape


def tuple_output_outside_dataflow(mod: tvm.IRModule) -> tvm.IRModule:
    """A model with several outputs: importers bind the output tuple inside
    the dataflow block (``gv = (a, b)``), where layer forming would take it for a layer of
    its own with no kernel (FuseTIR then fails at opt level 3). ``main`` returns the tuple
    literal instead, its fields the block's outputs, as a multi-output function is written
    in Relax. The module's other functions are kept."""
    func, bindings = main_bindings(mod)
    ret = func.body.body
    if not bindings or not isinstance(ret, relax.Var) or bindings[-1].name != ret.name \
            or not isinstance(bindings[-1].value, relax.Tuple) \
            or not all(isinstance(f, relax.Var) for f in bindings[-1].value.fields):
        return mod
    fields = {f.name for f in bindings[-1].value.fields}
    vmap: dict[str, Any] = {}
    bb = relax.BlockBuilder(tvm.IRModule({gv: f for gv, f in mod.functions.items() if gv.name_hint != "main"}))
    with bb.function("main", list(func.params), attrs=dict(func.attrs) if func.attrs else None, pure=True):
        with bb.dataflow():
            for b in bindings[:-1]:
                value = substitute(b.value, vmap)
                emit = bb.emit_output if b.name in fields or not isinstance(b.var, relax.DataflowVar) else bb.emit
                vmap[b.name] = emit(value, name_hint=b.name)
        bb.emit_func_output(relax.Tuple([vmap.get(f.name, f) for f in bindings[-1].value.fields]))
    return relax.transform.Normalize()(bb.get())


# --------------------------------------------------------------------------
# The executed module: each layer one function, fused into one kernel


def group_module(mod: tvm.IRModule, assignment: dict[str, int], layer_names: dict[int, str]) -> tvm.IRModule:
    """Move each layer's bindings into a private ``Primitive`` function.

    ``assignment`` maps binding names to layer indices; bindings not named
    there go with the next assigned binding (the parameter arithmetic a
    converter emitted ahead of its op). Tuple-get-items and aliases stay in
    ``main``. FuseTIR later turns each function into one kernel.
    """
    func, bindings = main_bindings(mod)
    groups, seq = _layer_groups(bindings, assignment)
    inputs = {k: _layer_inputs(members) for k, members in groups.items()}
    outs = _layer_outputs(groups, bindings, set(var_names(func.body.body)))
    # the module's other functions (PrimFuncs an importer emitted with emit_te) stay callable
    bb = relax.BlockBuilder(tvm.IRModule({gv: f for gv, f in mod.functions.items() if gv.name_hint != "main"}))
    vmap: dict[str, relax.Expr] = {}
    given = {p.name: p for p in func.params}

    def ready(kind: str, item: Any) -> bool:
        needs = var_names(item.value) if kind == "bind" else inputs[item][0]
        return all(n in vmap or n in given for n in needs)

    with bb.function("main", list(func.params), attrs=dict(func.attrs) if func.attrs else None, pure=True):
        with bb.dataflow():
            for kind, item in _in_ready_order(seq, ready):
                if kind == "bind":
                    vmap[item.name] = bb.emit(substitute(item.value, vmap), name_hint=item.name)
                else:
                    _emit_layer(bb, groups[item], inputs[item], outs[item], layer_names[item], {**given, **vmap}, vmap)
            result = bb.emit_output(substitute(func.body.body, vmap))
        bb.emit_func_output(result)
    return bb.get()


def _layer_groups(bindings: list[Binding], assignment: dict[str, int]
                  ) -> tuple[dict[int, list[Binding]], list[tuple[str, Any]]]:
    """Each layer's bindings (layer index -> its members in main order, a binding not in
    ``assignment`` with the next assigned one), and main's items in order: ``("layer", k)`` where
    layer ``k`` first appears, ``("bind", binding)`` for the tuple-get-items, aliases and constants
    that stay in ``main``."""
    groups: dict[int, list[Binding]] = {}
    pending: list[Binding] = []
    seq: list[tuple[str, Any]] = []  # ("layer", k) or ("bind", binding) in main order
    for b in bindings:
        if b.kind in ("tgi", "alias", "const") and b.name not in assignment:
            seq.append(("bind", b))
            continue
        k = assignment.get(b.name)
        if k is None:
            pending.append(b)
            continue
        if k not in groups:
            groups[k] = []
            seq.append(("layer", k))
        groups[k].extend(pending)
        pending = []
        groups[k].append(b)
    if pending:
        raise IrgenError(f"internal: bindings after the last layer: {[b.name for b in pending]}")
    return groups, seq


def _layer_inputs(members: list[Binding]) -> tuple[list[str], list[Constant]]:
    """What a layer reads from outside: the names of the variables its ``members`` use and do not
    bind, and its distinct constants, each in order of first use."""
    mset = {b.name for b in members}
    ext: list[str] = []
    consts: list[Constant] = []
    for b in members:
        for n in var_names(b.value):
            if n not in mset and n not in ext:
                ext.append(n)
        for c in constants(b.value):
            if not any(c.same_as(x) for x in consts):
                consts.append(c)
    return ext, consts


def _layer_outputs(groups: dict[int, list[Binding]], bindings: list[Binding], out_names: set[str]
                   ) -> dict[int, list[str]]:
    """Each layer's outputs: its members that are model outputs (``out_names``) or read by another
    layer or by ``main``; the last member when there is none."""
    users = users_of(bindings)
    where = {b.name: k for k, bs in groups.items() for b in bs}
    return {k: [
        b.name for b in members
        if b.name in out_names or any(where.get(bindings[u].name) != k for u in users.get(b.name, []))
    ] or [members[-1].name] for k, members in groups.items()}


def _in_ready_order(seq: list[tuple[str, Any]], ready: Callable[[str, Any], bool]):
    """The items of ``seq`` in order, except that an item whose inputs are not bound yet
    (``ready``, asked again after each item the caller emits) waits for them: a fused layer
    (attention) reads a tensor (its values) bound after its first member."""
    waiting: list[tuple[str, Any]] = []
    for entry in seq:
        waiting.append(entry)
        while (j := next((j for j, (kind, item) in enumerate(waiting) if ready(kind, item)), None)) is not None:
            yield waiting.pop(j)
    if waiting:
        raise IrgenError(f"internal: layers whose inputs are never bound: {[w[1] for w in waiting]}")


def _emit_layer(bb: relax.BlockBuilder, members: list[Binding], inputs: tuple[list[str], list[Constant]],
                outs: list[str], name: str, src: dict[str, relax.Expr], vmap: dict[str, relax.Expr]) -> None:
    """Add the layer's private ``Primitive`` function ``name`` to ``bb`` and emit its call in
    ``main`` (arguments: the external inputs, bound in ``src``, then the constants); bind each
    of ``outs`` in ``vmap`` (several: through a tuple ``{name}_out``)."""
    ext, consts = inputs
    gvar = bb.add_func(_layer_function(members, ext, consts, outs, src), name)
    call = relax.Call(gvar, [src[n] for n in ext] + list(consts))
    if len(outs) == 1:
        vmap[outs[0]] = bb.emit(call, name_hint=outs[0])
    else:
        tup = bb.emit(call, name_hint=f"{name}_out")
        for j, o in enumerate(outs):
            vmap[o] = bb.emit(relax.TupleGetItem(tup, j), name_hint=o)


def _layer_function(members: list[Binding], ext: list[str], consts: list[Constant], outs: list[str],
                    src: dict[str, relax.Expr]) -> relax.Function:
    """The private ``Primitive`` function of one layer: parameters ``{n}_in`` for the external
    inputs ``ext`` (typed as bound in ``src``) and ``c{j}`` for the constants, the ``members``'
    bindings, and ``outs`` returned (a tuple when several)."""
    params = [relax.Var(f"{n}_in", src[n].ty) for n in ext]
    cparams = [relax.Var(f"c{j}", c.ty) for j, c in enumerate(consts)]
    fb = relax.BlockBuilder()
    with fb.function("layer", params + cparams, attrs={"Primitive": True}, private=True):
        with fb.dataflow():
            inner = dict(zip(ext, params))
            for b in members:
                inner[b.name] = fb.emit(substitute(b.value, inner, list(zip(consts, cparams))), name_hint=b.name)
            res = inner[outs[0]] if len(outs) == 1 else relax.Tuple([inner[o] for o in outs])
            gv_out = fb.emit_output(res)
        fb.emit_func_output(gv_out)
    return fb.get()["layer"]
