"""One layer vocabulary whatever the frontend: rewrites of a float graph before layer forming.

Importers write the same computation differently: torch's exporter writes SiLU as
ONNX ``Sigmoid`` then ``Mul`` (``.pt2`` keeps ``silu``), ``chunk`` as one ``Slice``
per piece (``.pt2`` keeps ``split``), a Linear's bias add with the bias first,
two transposes in a row as one, ``roll`` as Slice/Slice/Concat per axis; ``.pt2``
keeps reshapes, slices and ops computed twice that the exporter folds or shares; a
``scaled_dot_product_attention`` is one op in ``.pt2`` and its steps in ONNX, the
dynamo exporter's with a 3-d kᵀ and a NaN guard on the softmax. Each rewrite here
turns such a pattern into the one form the IR names it by, so the same model gives
the same layer ops from every frontend. A rewrite keeps the Relax variable names that hold source tensors (the
source check still finds them) and records what it folded in
``Provenance.merged`` (the layer's ``source`` lists every source node).

Each rewrite is one function ``(bindings, users, provenance) -> changes`` in
:data:`REWRITES`; :func:`canonicalize` applies them in order.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import tvm
import tvm_ffi
from tvm import relax

from irgen import spill
from irgen.api import Provenance
from irgen.graph import (Binding, Constant, fold_constants, main_bindings, rebuild_main, substitute, tensor_type, users_of,
                         var_names)
from irgen.recurrent import recurrent_kind

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
    """``name`` holds the result of a source op that is a transpose, or of source ops folded
    into one transpose (:func:`_folded_transposes`), not the last step of another op that a
    converter ends with a transpose, such as sdpa."""
    for n in (name, *provenance.merged.get(name, [])):
        op_type = provenance.by_var.get(n, (None, "", None))[1].lower()
        if any(t in op_type for t in ("transpose", "permute")):
            return True
    return False


def _fold(provenance: Provenance, into: str, *names: str) -> None:
    """Record the bindings ``names`` (and what was folded into them) as folded into ``into``."""
    merged = provenance.merged.setdefault(into, [])
    for n in names:
        merged.extend(m for m in [*provenance.merged.pop(n, []), n] if m not in merged)


def _chains(bindings: list[Binding], users: dict[str, list[int]], provenance: Provenance, op: str,
            merge: Callable[[Binding, Binding, relax.Expr], relax.Expr | None]) -> Changes:
    """Each ``op`` binding whose input is another ``op`` binding read by nothing else -> the
    one op ``merge(inner, outer, inner's input)`` returns (None: the pair stays); the inner
    binding is folded into the outer one's name."""
    by_name = {b.name: i for i, b in enumerate(bindings)}
    replace: dict[int, relax.Expr] = {}
    drop: set[int] = set()
    for i, b in enumerate(bindings):
        if b.op != op or not isinstance(b.value.args[0], relax.Var):
            continue
        k = by_name.get(b.value.args[0].name)
        if k is None or k in drop or bindings[k].op != op or users.get(bindings[k].name) != [i]:
            continue
        new = merge(bindings[k], b, replace.get(k, bindings[k].value).args[0])
        if new is None:
            continue
        replace[i] = new
        drop.add(k)
        _fold(provenance, b.name, bindings[k].name)
    return replace, {}, drop


def _transposes(bindings: list[Binding], users: dict[str, list[int]], provenance: Provenance) -> Changes:
    """A source transpose read only by another source transpose -> one transpose of the two
    permutations composed (torch's ONNX exporter composes ``k.transpose(1, 2).transpose(-1, -2)`` into one
    ``Transpose``; ``.pt2`` keeps both)."""

    def compose(inner: Binding, outer: Binding, src: relax.Expr) -> relax.Expr | None:
        if not (_is_source_transpose(outer.name, provenance) and _is_source_transpose(inner.name, provenance)):
            return None  # two source transposes; a converter's own step (sdpa's output) stays with its op
        if tensor_type(inner.value.args[0]) is None or inner.value.attrs.axes is None or outer.value.attrs.axes is None:
            return None
        p1, p2 = [int(a) for a in inner.value.attrs.axes], [int(a) for a in outer.value.attrs.axes]
        return relax.op.permute_dims(src, [p1[a] for a in p2])

    return _chains(bindings, users, provenance, "relax.permute_dims", compose)


def _reshape_chains(bindings: list[Binding], users: dict[str, list[int]], provenance: Provenance) -> Changes:
    """A reshape read only by another reshape -> one reshape to the second's shape (torch's
    ONNX exporter writes ``x.reshape(b, n, d).view(b * n, d)`` as one ``Reshape``)."""
    return _chains(bindings, users, provenance, "relax.reshape",
                   lambda inner, outer, src: relax.op.reshape(src, outer.value.args[1]))


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
    ``.pt2``'s attention scales the product (as most runtimes and hardware do). The matmul
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
        replace[i] = relax.op.multiply(inner, relax.const(np.float32(a) * np.float32(c), dtype))
        drop.update((k1, k2))
        provenance.merged.setdefault(b.name, []).extend([bindings[k1].name, bindings[k2].name])
    return replace, insert, drop


def _causal_mask(q: relax.Expr, k: relax.Expr) -> Constant:
    """relax.nn.attention's ``TopLeft`` causal mask (torch's ``is_causal``) for (B, H, L, E) q
    and (B, H, S, E) k as an additive (L, S) constant: 0 where query i sees key j (j <= i),
    else the dtype's lowest value, as torch's dynamo ONNX exporter writes it. Masked scores
    get weight exp(lowest - max) = 0, as in the op."""
    (*_, n_q, _), dtype = tensor_type(q)
    n_k = tensor_type(k)[0][-2]
    seen = np.arange(n_k)[None, :] <= np.arange(n_q)[:, None]
    return relax.const(np.where(seen, 0.0, np.finfo(dtype).min).astype(dtype))


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
    Causal attention (``is_causal=True``: a mask the op builds itself) adds the mask torch's
    exporter writes, an (L, S) constant of 0 and the dtype's lowest value (:func:`_causal_mask`);
    a bottom-right causal mask, or a causal mask and a mask of its own, stays one op."""
    by_name = {b.name: i for i, b in enumerate(bindings)}
    replace: dict[int, relax.Expr] = {}
    insert: dict[int, list[Binding]] = {}
    drop: set[int] = set()
    for i, b in enumerate(bindings):
        if b.op not in ("relax.nn.attention", "relax.nn.attention_bias"):
            continue
        q, k, v, *rest = b.value.args
        causal = b.value.attrs.causal_mask
        if causal is not None and (rest or str(causal) != "TopLeft"):
            continue
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
        bias = rest[0] if rest else _causal_mask(qt, kt) if causal is not None else None
        if bias is not None and not (isinstance(bias, Constant) and not bias.value.numpy().any()):
            x = step("masked", relax.op.add(x, bias))  # a mask of zeros adds nothing: dropped, as ONNX folds it
        x = step("weights", relax.op.nn.softmax(x, axis=-1))
        insert[out[0]] = steps
        replace[out[0]] = relax.op.matmul(x, vt)
        drop.update([i, *ks])
    return replace, insert, drop


def _common_subexpressions(bindings: list[Binding], users: dict[str, list[int]],
                           provenance: Provenance) -> Changes:
    """An op that computes what an earlier binding computes (the same op of the same inputs
    and attributes) -> an alias of the earlier result, naming the same tensor (torch's ONNX
    exporter writes Swin's ``x[..., 0::2, 0::2, :]`` and ``x[..., 0::2, 1::2, :]`` with one
    shared row slice; ``.pt2`` slices the rows twice). Exact: every op here is pure."""
    replace: dict[int, relax.Expr] = {}
    vmap: dict[str, relax.Expr] = {}  # a duplicate's name -> the earlier result
    seen: dict[int, list[tuple[relax.Expr, relax.Var]]] = {}
    for i, b in enumerate(bindings):
        if b.kind not in ("call", "tgi"):
            continue
        value = substitute(b.value, vmap) if any(n in vmap for n in var_names(b.value)) else b.value
        if b.name in provenance.by_var and recurrent_kind(provenance.by_var[b.name][1]):
            # a step of a recurrent op is one layer: the same input row read by both directions stays in each
            if value is not b.value:
                replace[i] = value
            continue
        key = tvm_ffi.structural_hash(value)
        same = next((var for v, var in seen.get(key, []) if tvm_ffi.structural_equal(v, value)), None)
        spill.release(*(a for a in getattr(value, "args", ()) if isinstance(a, Constant)))  # the hash read them
        if same is not None:
            vmap[b.name] = same
            replace[i] = same
        else:
            seen.setdefault(key, []).append((value, b.var))
            if value is not b.value:
                replace[i] = value
    return replace, {}, set()


def _is_identity(b: Binding) -> bool:
    """A reshape to the same shape, a permutation that keeps every axis, a unit-stride slice
    of the whole tensor: ops that compute their input."""
    if b.op not in ("relax.reshape", "relax.permute_dims", "relax.strided_slice") or not b.value.args \
            or not isinstance(b.value.args[0], relax.Var):
        return False
    t_in, t_out = tensor_type(b.value.args[0]), tensor_type(b.var)
    if t_in is None or t_out is None or t_in != t_out:
        return False
    if b.op == "relax.permute_dims":
        axes = b.value.attrs.axes
        return axes is None and len(t_in[0]) <= 1 or axes is not None and [int(a) for a in axes] == list(
            range(len(t_in[0])))
    if b.op == "relax.strided_slice":
        strides = b.value.args[4].fields if len(b.value.args) > 4 else []
        return all(_int(v) == 1 for v in strides)  # unit strides and the same shape: begin 0, end dim
    return True


def _identities(bindings: list[Binding], users: dict[str, list[int]], provenance: Provenance) -> Changes:
    """An op that computes its input (an exporter's no-op reshape, a crop to the full size
    ``x[:, :H, :W]``) -> an alias of the input: it names the same tensor and forms no layer
    (torch's ONNX exporter folds the reshape ``.pt2`` keeps; ``.pt2`` folds the slice ONNX keeps).

    An input the importer made up (no source tensor of its own: a fully connected op's matmul
    before the reshape back to its output) takes over the identity's source node and
    tensor, so the layer computing it is still named after, and compared with, that tensor."""
    replace = {i: b.value.args[0] for i, b in enumerate(bindings) if _is_identity(b)}
    for i in replace:
        b, a = bindings[i], bindings[i].value.args[0].name
        if a not in provenance.by_var and b.name in provenance.by_var:
            provenance.by_var[a] = provenance.by_var[b.name]
            merged = provenance.merged.setdefault(a, [])
            merged.extend(m for m in [*provenance.merged.get(b.name, []), b.name] if m not in merged)
    return replace, {}, set()


def _folded_transposes(bindings: list[Binding], users: dict[str, list[int]], provenance: Provenance) -> Changes:
    """``reshape(permute(reshape(x)))`` where the first reshape merges x's leading axes into
    one, the permutation keeps that axis first and the last reshape splits it again -> one
    permutation of x (torch's dynamo ONNX exporter writes ``k.transpose(-2, -1)`` of a 4-d
    k so, as 3-d ``Transpose``; ``.pt2`` keeps one transpose). The result keeps the last
    reshape's name; the first two are folded into it."""
    by_name = {b.name: i for i, b in enumerate(bindings)}
    replace: dict[int, relax.Expr] = {}
    drop: set[int] = set()
    for i, b in enumerate(bindings):
        if b.op != "relax.reshape" or not isinstance(b.value.args[0], relax.Var):
            continue
        j = by_name.get(b.value.args[0].name)
        mid = bindings[j] if j is not None else None
        if mid is None or mid.op != "relax.permute_dims" or users.get(mid.name) != [i] or j in drop \
                or mid.value.attrs.axes is None or not isinstance(mid.value.args[0], relax.Var):
            continue
        k = by_name.get(mid.value.args[0].name)
        first = bindings[k] if k is not None else None
        if first is None or first.op != "relax.reshape" or users.get(first.name) != [j] or k in drop \
                or not isinstance(first.value.args[0], relax.Var):
            continue
        x = first.value.args[0]
        tx, t1, t3 = tensor_type(x), tensor_type(first.var), tensor_type(b.var)
        perm = [int(a) for a in mid.value.attrs.axes]
        if None in (tx, t1, t3) or perm[0] != 0:
            continue
        lead = len(tx[0]) - (len(t1[0]) - 1)  # x's axes merged into the first
        if lead < 1 or tuple(tx[0][lead:]) != tuple(t1[0][1:]) or int(np.prod(tx[0][:lead])) != t1[0][0]:
            continue
        axes = list(range(lead)) + [lead - 1 + p for p in perm[1:]]
        if tuple(t3[0]) != tuple(tx[0][a] for a in axes):
            continue
        replace[i] = relax.op.permute_dims(x, axes)
        drop.update((j, k))
        _fold(provenance, b.name, first.name, mid.name)
    return replace, {}, drop


def _finite_mask(expr: relax.Expr, by_name: dict[str, int], bindings: list[Binding]) -> bool:
    """``expr`` is an additive attention mask that holds finite values only: a constant, or
    ``where(cond, a, b)`` of finite constants (a bool mask written with the dtype's lowest
    value, as torch's exporters and irgen's torch frontend write it, not -inf)."""
    if isinstance(expr, Constant):
        return bool(np.isfinite(expr.value.numpy()).all())
    k = by_name.get(expr.name) if isinstance(expr, relax.Var) else None
    if k is None or bindings[k].op != "relax.where":
        return False
    return all(isinstance(a, Constant) and np.isfinite(a.value.numpy()).all() for a in bindings[k].value.args[1:])


def _nan_guards(bindings: list[Binding], users: dict[str, list[int]], provenance: Provenance) -> Changes:
    """``where(isnan(s), 0, s)`` after ``s = softmax(scores + mask)`` with a finite mask ->
    ``s`` (an alias). torch's dynamo ONNX exporter guards a bool-masked attention's softmax
    against rows masked with -inf everywhere (0/0); its mask holds the lowest finite value
    instead, so for finite scores the softmax of every row has a maximum term exp(0) = 1
    and no NaN: the guard selects ``s`` everywhere (``.pt2``'s attention has none)."""
    by_name = {b.name: i for i, b in enumerate(bindings)}
    replace: dict[int, relax.Expr] = {}
    drop: set[int] = set()
    for i, b in enumerate(bindings):
        if b.op != "relax.where":
            continue
        cond, zero, s = b.value.args
        if not (isinstance(cond, relax.Var) and isinstance(s, relax.Var) and _scalar(zero) == 0.0):
            continue
        kn, ks = by_name.get(cond.name), by_name.get(s.name)
        if kn is None or ks is None or users.get(cond.name) != [i] or bindings[kn].op != "relax.isnan":
            continue
        arg = bindings[kn].value.args[0]
        if not (isinstance(arg, relax.Var) and arg.name == s.name) or bindings[ks].op != "relax.nn.softmax":
            continue
        ka = by_name.get(bindings[ks].value.args[0].name) if isinstance(bindings[ks].value.args[0], relax.Var) else None
        add = bindings[ka] if ka is not None else None
        if add is None or add.op != "relax.add" or not _finite_mask(add.value.args[1], by_name, bindings):
            continue
        replace[i] = s
        drop.add(kn)
        _fold(provenance, s.name, bindings[kn].name)
    return replace, {}, drop


def rotation(b: Binding, by_name: dict[str, Binding]) -> tuple[relax.Var, int, int] | None:
    """(x, axis, shift) when ``b`` is ``concat([x[p:], x[:p]], axis)``, that is ``roll(x, n - p,
    axis)``, with the pieces as strided slices (``.pt2``'s roll; ONNX Slice nodes) or items of
    a split of x (ONNX Slices after :func:`_split`)."""
    if b.op != "relax.concat" or len(getattr(b.value.args[0], "fields", [])) != 2:
        return None
    axis = int(b.value.attrs.axis)
    ranges = []
    for piece in b.value.args[0].fields:
        r = None
        if isinstance(piece, relax.Var) and piece.name in by_name:
            p = by_name[piece.name]
            if p.op == "relax.strided_slice":
                r = _slice_range(p)
            elif p.kind == "tgi" and isinstance(p.value.tuple_value, relax.Var):
                r = _split_item_range(by_name.get(p.value.tuple_value.name), int(p.value.index))
        if r is None:
            return None
        ranges.append(r)
    (x0, a0, lo0, hi0), (x1, a1, lo1, hi1) = ranges
    t = tensor_type(b.var)
    if t is None or x0 != x1 or a0 != a1 or a0 != axis % len(t[0]):
        return None
    n = t[0][a0]
    if not (lo1 == 0 and hi1 == lo0 and hi0 == n and 0 < lo0 < n):
        return None
    src = by_name[b.value.args[0].fields[0].name]
    x = src.value.args[0] if src.op == "relax.strided_slice" else by_name[src.value.tuple_value.name].value.args[0]
    return x, a0, n - lo0


def _split_item_range(split: Binding | None, index: int) -> tuple[str, int, int, int] | None:
    """(input, axis, begin, end) of item ``index`` of a split (at indices or in equal sections)."""
    if split is None or split.op != "relax.split" or not isinstance(split.value.args[0], relax.Var):
        return None
    t = tensor_type(split.value.args[0])
    if t is None:
        return None
    axis = int(split.value.attrs.axis) % len(t[0])
    cuts = split.value.attrs.indices_or_sections
    if isinstance(cuts, tvm.tirx.IntImm):  # equal sections (torch's chunk)
        n, k = t[0][axis], int(cuts.value)
        if k < 1 or n % k:
            return None
        cuts = [n // k * j for j in range(1, k)]
    bounds = [0, *(int(c) for c in cuts), t[0][axis]]
    if index + 1 >= len(bounds):
        return None
    return split.value.args[0].name, axis, bounds[index], bounds[index + 1]


def _rolls(bindings: list[Binding], users: dict[str, list[int]], provenance: Provenance) -> Changes:
    """A roll written as slices and a concat -> the steps ``.pt2``'s roll has: per axis,
    ``head = x[:p]``, ``tail = x[p:]``, ``concat([tail, head])``, the slices without a source
    tensor; a rotation read only by the rotation of another axis joins it (torch's ONNX
    exporter writes ``roll(x, (s, t), (1, 2))`` as Slice, Slice, Concat per axis). Layer
    forming then makes one layer of each roll; its op is ``roll`` (:func:`is_roll`)."""
    by = {b.name: b for b in bindings}
    by_name = {b.name: i for i, b in enumerate(bindings)}
    found = {i: r for i, b in enumerate(bindings) if (r := rotation(b, by)) is not None}
    replace: dict[int, relax.Expr] = {}
    insert: dict[int, list[Binding]] = {}
    drop: set[int] = set()
    renamed: dict[int, relax.Var] = {}  # an inner rotation of a chain: its fresh unnamed var
    outer: dict[int, int] = {}
    for i, (x, axis, shift) in found.items():
        k = by_name.get(x.name)
        if k in found and k not in outer and len(users.get(x.name, [])) == 2 and all(
                users.get(p.name) == [i] for p in bindings[i].value.args[0].fields):
            outer[k] = i
    for i in sorted(found):
        x, axis, shift = found[i]
        b = bindings[i]
        pieces = [by[p.name] for p in b.value.args[0].fields]
        if any(users.get(p.name) != [i] for p in pieces):
            continue  # a piece is read elsewhere: it stays a tensor of its own
        last = i
        while last in outer:
            last = outer[last]
        k = by_name.get(x.name)
        src = renamed.get(k, x)
        n = tensor_type(b.var)[0][axis]
        tag = f"{bindings[last].name}_roll{axis}"
        head = relax.Var(f"{tag}_head", pieces[1].var.ty)
        tail = relax.Var(f"{tag}_tail", pieces[0].var.ty)
        steps = [Binding(head.name, head, relax.op.strided_slice(src, [axis], [0], [n - shift], [1])),
                 Binding(tail.name, tail, relax.op.strided_slice(src, [axis], [n - shift], [n], [1]))]
        value = relax.op.concat([tail, head], axis)
        folded = []
        for p in pieces:
            drop.add(by_name[p.name])
            if p.kind == "tgi":  # the split ONNX slices became: dropped with its last item
                t = by_name[p.value.tuple_value.name]
                if all(by_name[q.name] in drop for q in pieces if q.kind == "tgi") and all(
                        u in drop or u == i for u in users.get(bindings[t].name, [])):
                    drop.add(t)
            folded.append(p.name)
        if i in outer:  # inner step of a chain: an unnamed result, its source folded into the last
            var = relax.Var(f"{tag}", b.var.ty)
            renamed[i] = var
            steps.append(Binding(var.name, var, value))
            drop.add(i)
            folded.append(b.name)
        else:
            replace[i] = value
        insert[i] = steps
        _fold(provenance, bindings[last].name, *folded)
    return replace, insert, drop


def is_roll(members: list[Binding]) -> bool:
    """``members`` (a layer's bindings) are rotations along axes and their slices only: the
    layer computes ``roll`` (:func:`_rolls`), whatever the frontend named its steps."""
    by = {b.name: b for b in members}
    concats = [b for b in members if b.op == "relax.concat"]
    if not concats or any(b.op not in ("relax.concat", "relax.strided_slice") for b in members):
        return False
    return all(rotation(b, by) is not None for b in concats) and len(members) == 3 * len(concats)


#: the rewrites, in the order they run
REWRITES: list[Callable[[list[Binding], dict[str, list[int]], Provenance], Changes]] = [
    _constant_second, _common_subexpressions, _silu, _identities, _rolls, _split, _folded_transposes,
    _reshape_chains, _transposes, _scaled_operands, _attention_steps, _nan_guards]


def canonicalize(mod: tvm.IRModule, provenance: Provenance) -> tvm.IRModule:
    """``mod`` with every rewrite of :data:`REWRITES` applied to ``main``, after constants are
    folded (a scale the exporter computes, ``sqrt(1 / sqrt(d))``, is then one constant)."""
    mod = fold_constants(mod)
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
