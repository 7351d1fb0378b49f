"""One layer vocabulary whatever the frontend: rewrites of a float graph before layer forming.

Importers write the same computation differently: torch's exporter writes SiLU as
ONNX ``Sigmoid`` then ``Mul`` (``.pt2`` keeps ``silu``), ``chunk`` as one ``Slice``
per piece (``.pt2`` keeps ``split``), a Linear's bias add with the bias first, and
two transposes in a row as one. Each rewrite here turns such a pattern into the
one op the IR names it by, so the same model gives the same layer ops from every
frontend. A rewrite keeps the Relax variable names that hold source tensors (the
source check still finds them) and records what it folded in
``Provenance.merged`` (the layer's ``source`` lists every source node).

Each rewrite is one function ``(bindings, users, provenance) -> changes`` in
:data:`REWRITES`; :func:`canonicalize` applies them in order.
"""

from __future__ import annotations

from typing import Callable

import tvm
from tvm import relax

from irgen.api import Provenance
from irgen.graph import Binding, Constant, main_bindings, rebuild_main, tensor_type, users_of

# (replaced values by binding index, inserted bindings before an index, dropped indices)
Changes = tuple[dict[int, relax.Expr], dict[int, list[Binding]], set[int]]


def _silu(bindings: list[Binding], users: dict[str, list[int]], provenance: Provenance) -> Changes:
    """``x * sigmoid(x)`` (either order), the sigmoid read by nothing else -> ``silu(x)``."""
    by_name = {b.name: i for i, b in enumerate(bindings)}
    replace: dict[int, relax.Expr] = {}
    drop: set[int] = set()
    for i, b in enumerate(bindings):
        if b.op != "relax.multiply" or not all(isinstance(a, relax.Var) for a in b.value.args):
            continue
        for x, s in (b.value.args, reversed(b.value.args)):
            k = by_name.get(s.name)
            if k is None or k in drop or bindings[k].op != "relax.sigmoid" or users.get(s.name) != [i]:
                continue
            arg = bindings[k].value.args[0]
            if not (isinstance(arg, relax.Var) and arg.name == x.name):
                continue
            replace[i] = relax.op.nn.silu(x)
            drop.add(k)
            provenance.merged.setdefault(b.name, []).append(s.name)
            break
    return replace, {}, drop


_COMMUTATIVE = {"relax.add": relax.op.add, "relax.multiply": relax.op.multiply}


def _constant_second(bindings: list[Binding], users: dict[str, list[int]], provenance: Provenance) -> Changes:
    """``add``/``multiply`` of a constant and a tensor take the tensor first (torch's ONNX
    exporter writes a Linear's bias add as ``Add(bias, x)``): the bias joins its dense layer
    and is its ``bias`` parameter, as from ``.pt2``. Exact: both are commutative."""
    replace: dict[int, relax.Expr] = {}
    for i, b in enumerate(bindings):
        build = _COMMUTATIVE.get(b.op or "")
        if build is None or len(b.value.args) != 2:
            continue
        c, x = b.value.args
        if isinstance(c, Constant) and isinstance(x, relax.Var):
            replace[i] = build(x, c)
    return replace, {}, set()


def _is_source_transpose(name: str, provenance: Provenance) -> bool:
    """``name`` holds the result of a source op that is a transpose (not the last step of
    another op that a converter ends with a transpose, such as sdpa)."""
    op_type = provenance.by_var.get(name, (None, "", None))[1].lower()
    return any(t in op_type for t in ("transpose", "permute"))


def _transposes(bindings: list[Binding], users: dict[str, list[int]], provenance: Provenance) -> Changes:
    """A source transpose read only by another source transpose -> one transpose of the two
    permutations composed (torch's ONNX exporter composes ``k.transpose(1, 2).transpose(-1, -2)`` into one
    ``Transpose``; ``.pt2`` keeps both)."""
    by_name = {b.name: i for i, b in enumerate(bindings)}
    replace: dict[int, relax.Expr] = {}
    drop: set[int] = set()
    for i, b in enumerate(bindings):
        if b.op != "relax.permute_dims" or not isinstance(b.value.args[0], relax.Var):
            continue
        k = by_name.get(b.value.args[0].name)
        if k is None or k in drop or bindings[k].op != "relax.permute_dims" or users.get(bindings[k].name) != [i]:
            continue
        if not (_is_source_transpose(b.name, provenance) and _is_source_transpose(bindings[k].name, provenance)):
            continue  # two source transposes; a converter's own step (sdpa's output) stays with its op
        inner, outer = bindings[k].value, b.value
        t = tensor_type(inner.args[0])
        if t is None or inner.attrs.axes is None or outer.attrs.axes is None:
            continue
        p1, p2 = [int(a) for a in inner.attrs.axes], [int(a) for a in outer.attrs.axes]
        src = replace.get(k, inner).args[0]
        replace[i] = relax.op.permute_dims(src, [p1[a] for a in p2])
        drop.add(k)
        provenance.merged.setdefault(b.name, []).extend([*provenance.merged.pop(bindings[k].name, []), bindings[k].name])
    return replace, {}, drop


def _int(v) -> int | None:
    return int(v.value) if isinstance(v, tvm.tirx.IntImm) else None


def _slice_range(b: Binding) -> tuple[str, int, int, int] | None:
    """(input, axis, begin, end) of a unit-stride strided_slice along one axis."""
    if b.op != "relax.strided_slice" or not isinstance(b.value.args[0], relax.Var):
        return None
    axes, begin, end, *rest = b.value.args[1:]
    fields = [getattr(t, "fields", None) for t in (axes, begin, end, *rest[:1])]
    if any(f is None or len(f) != 1 for f in fields):
        return None
    vals = [_int(f[0]) for f in fields]
    if any(v is None for v in vals) or (len(vals) == 4 and vals[3] != 1):
        return None
    t = tensor_type(b.value.args[0])
    if t is None:
        return None
    axis = vals[0] % len(t[0])
    dim = t[0][axis]
    lo, hi = (max(0, min(v + dim if v < 0 else v, dim)) for v in vals[1:3])
    return b.value.args[0].name, axis, lo, hi


def _split(bindings: list[Binding], users: dict[str, list[int]], provenance: Provenance) -> Changes:
    """Slices of one tensor along one axis that tile it exactly -> one ``split`` whose items
    are bound to the slices' names (torch's ``chunk``/``split`` as ONNX ``Slice`` nodes)."""
    groups: dict[tuple[str, int], list[tuple[int, int, int]]] = {}
    for i, b in enumerate(bindings):
        r = _slice_range(b)
        # source slices only: the inner steps of one source op (a roll) stay that op's
        if r is not None and b.name in provenance.by_var:
            groups.setdefault(r[:2], []).append((r[2], r[3], i))
    replace: dict[int, relax.Expr] = {}
    insert: dict[int, list[Binding]] = {}
    for (name, axis), pieces in groups.items():
        pieces.sort()
        x = bindings[pieces[0][2]].value.args[0]
        dim = tensor_type(x)[0][axis]
        if len(pieces) < 2 or pieces[0][0] != 0 or pieces[-1][1] != dim or any(
                a[1] != b[0] or a[0] >= a[1] for a, b in zip(pieces, pieces[1:])):
            continue
        first = min(i for _, _, i in pieces)
        var = relax.Var(f"{bindings[pieces[0][2]].name}_split", relax.TupleType(
            [bindings[i].var.ty for _, _, i in pieces]))
        split = relax.op.split(x, [hi for _, hi, _ in pieces[:-1]], axis)
        insert[first] = [Binding(var.name, var, split)]
        for j, (_, _, i) in enumerate(pieces):
            replace[i] = relax.TupleGetItem(var, j)
    return replace, insert, set()


def _scalar(c: relax.Expr) -> float | None:
    """The value of a constant with one element (a scalar operand), else None."""
    if isinstance(c, Constant):
        v = c.value.numpy()
        if v.size == 1 and v.dtype.kind == "f":
            return float(v.reshape(-1)[0])
    return None


def _scaled_operands(bindings: list[Binding], users: dict[str, list[int]], provenance: Provenance) -> Changes:
    """``matmul(x * a, y * b)`` with scalar constants ``a``, ``b`` -> ``matmul(x, y) * (a*b)``:
    torch's ONNX exporter writes attention's scale as ``sqrt(scale)`` on both q and kᵀ, where
    ``.pt2``'s attention scales the product (as TFLite and most hardware do). The matmul
    result stays under its source name (the same value, up to float rounding); the
    multiplies are folded into it."""
    by_name = {b.name: i for i, b in enumerate(bindings)}
    replace: dict[int, relax.Expr] = {}
    insert: dict[int, list[Binding]] = {}
    drop: set[int] = set()
    for i, b in enumerate(bindings):
        if b.op != "relax.matmul" or b.name not in provenance.by_var:
            continue
        scaled = []
        for arg in b.value.args[:2]:
            k = by_name.get(arg.name) if isinstance(arg, relax.Var) else None
            m = bindings[k] if k is not None else None
            if m is None or k in drop or m.op != "relax.multiply" or users.get(m.name) != [i]:
                break
            x, c = m.value.args
            if not isinstance(x, relax.Var) or _scalar(c) is None:
                break
            scaled.append((k, x, _scalar(c)))
        if len(scaled) != 2:
            continue
        (k1, x, a), (k2, y, c) = scaled
        dtype = str(b.var.ty.dtype)
        inner = relax.Var(f"{b.name}_unscaled", b.var.ty)
        node, op_type, _ = provenance.by_var[b.name]
        provenance.by_var[inner.name] = (node, op_type, None)
        insert[i] = [Binding(inner.name, inner, relax.op.matmul(x, y))]
        import numpy as np

        replace[i] = relax.op.multiply(inner, relax.const(np.float32(a) * np.float32(c), dtype))
        drop.update((k1, k2))
        provenance.merged.setdefault(b.name, []).extend([bindings[k1].name, bindings[k2].name])
    return replace, insert, drop


_BSHD = [0, 2, 1, 3]  # relax.nn.attention's (B, S, H, D) <-> torch's (B, H, S, D)


def _permuted(b: Binding | None) -> relax.Var | None:
    """The tensor ``b`` permutes between (B, S, H, D) and (B, H, S, D), if it does."""
    if b is None or b.op != "relax.permute_dims" or not isinstance(b.value.args[0], relax.Var):
        return None
    axes = b.value.attrs.axes
    return b.value.args[0] if axes is not None and [int(a) for a in axes] == _BSHD else None


def _attention_steps(bindings: list[Binding], users: dict[str, list[int]], provenance: Provenance) -> Changes:
    """``relax.nn.attention`` between the (B, H, S, D) permutes a torch converter puts around
    it (``scaled_dot_product_attention`` from ``.pt2``) -> its steps, as ONNX writes them:
    ``kᵀ``, ``q·kᵀ``, ``× scale``, ``+ mask``, ``softmax``, ``· v``. The last step keeps the
    sdpa output's name; the others get the sdpa node as their source. A backend that runs
    attention as one unit folds them back with :data:`irgen.api.ATTENTION_FUSION`.
    Causal attention (a mask the op builds itself) stays one op."""
    import numpy as np

    by_name = {b.name: i for i, b in enumerate(bindings)}
    replace: dict[int, relax.Expr] = {}
    insert: dict[int, list[Binding]] = {}
    drop: set[int] = set()
    for i, b in enumerate(bindings):
        if b.op not in ("relax.nn.attention", "relax.nn.attention_bias") or b.value.attrs.causal_mask is not None:
            continue
        q, k, v, *rest = b.value.args
        ks = [by_name.get(a.name) if isinstance(a, relax.Var) else None for a in (q, k, v)]
        srcs = [_permuted(bindings[j]) if j is not None and users.get(bindings[j].name) == [i] else None for j in ks]
        out = users.get(b.name, [])
        if None in srcs or len(set(ks)) != 3 or len(out) != 1 or _permuted(bindings[out[0]]) is None:
            continue
        last = bindings[out[0]]
        if last.name not in provenance.by_var:
            continue
        node, op_type, _ = provenance.by_var[last.name]
        qt, kt, vt = srcs
        d = int(tensor_type(qt)[0][-1])
        scale = b.value.attrs.scale
        scale = float(scale.value) if scale is not None else 1.0 / float(np.sqrt(d))
        dtype = str(qt.ty.dtype)
        steps: list[Binding] = []

        def step(tag: str, expr: relax.Expr) -> relax.Var:
            var = relax.Var(f"{last.name}_{tag}", relax.BlockBuilder().normalize(expr).ty)
            provenance.by_var[var.name] = (node, op_type, None)
            steps.append(Binding(var.name, var, expr))
            return var

        # kᵀ: composed with a transpose that feeds only this attention (torch's k.transpose(1, 2)),
        # as torch's ONNX exporter composes the two into one Transpose
        swap, j = [0, 1, 3, 2], by_name.get(kt.name)
        inner = bindings[j] if j is not None else None
        if (inner is not None and inner.op == "relax.permute_dims" and inner.value.attrs.axes is not None
                and users.get(kt.name) == [ks[1]] and isinstance(inner.value.args[0], relax.Var)):
            p1 = [int(a) for a in inner.value.attrs.axes]
            kT = step("kT", relax.op.permute_dims(inner.value.args[0], [p1[a] for a in swap]))
            drop.add(j)
            provenance.merged.setdefault(kT.name, []).extend([*provenance.merged.get(inner.name, []), inner.name])
        else:
            kT = step("kT", relax.op.permute_dims(kt, swap))
        x = step("scores", relax.op.matmul(qt, kT))
        x = step("scaled", relax.op.multiply(x, relax.const(np.float32(scale), dtype)))
        bias = rest[0] if rest else None
        if bias is not None and not (isinstance(bias, Constant) and not bias.value.numpy().any()):
            x = step("masked", relax.op.add(x, bias))  # a mask of zeros adds nothing: dropped, as ONNX folds it
        x = step("weights", relax.op.nn.softmax(x, axis=-1))
        insert[out[0]] = steps
        replace[out[0]] = relax.op.matmul(x, vt)
        drop.update([i, *ks])
    return replace, insert, drop


#: the rewrites, in the order they run
REWRITES: list[Callable[[list[Binding], dict[str, list[int]], Provenance], Changes]] = [
    _constant_second, _silu, _split, _transposes, _scaled_operands, _attention_steps]


def canonicalize(mod: tvm.IRModule, provenance: Provenance) -> tvm.IRModule:
    """``mod`` with every rewrite of :data:`REWRITES` applied to ``main``, after constants are
    folded (a scale the exporter computes, ``sqrt(1 / sqrt(d))``, is then one constant)."""
    mod = relax.transform.FoldConstant()(mod)
    for rewrite in REWRITES:
        _, bindings = main_bindings(mod)
        replace, insert, drop = rewrite(bindings, users_of(bindings), provenance)
        if not (replace or insert or drop):
            continue
        new: list[Binding] = []
        for i, b in enumerate(bindings):
            new.extend(insert.get(i, []))
            if i not in drop:
                new.append(Binding(b.name, b.var, replace.get(i, b.value)))
        mod = rebuild_main(mod, new)
    return mod
