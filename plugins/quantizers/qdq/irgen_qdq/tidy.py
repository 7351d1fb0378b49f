"""Graph housekeeping around the realization: tuple items and bindings nobody reads any more,
``shape_of`` of static shapes made constant, and the shapes after a realized dynamic slice
inferred again."""

from __future__ import annotations


def drop_dead_items(qg) -> None:
    """Remove tuple items nobody reads (batch_norm's mean and variance)."""
    from tvm import relax

    dead = [b.name for b in qg.bindings if isinstance(b.value, relax.TupleGetItem) and qg.n_users(b.name) == 0]
    if dead:
        qg.bindings = [b for b in qg.bindings if b.name not in dead]
        qg._index()


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

    from irgen.plugin import Binding, substitute

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
    from irgen.plugin import main_bindings

    _, qg.bindings = main_bindings(qg.mod)
    qg._index()


def _dynamic(var) -> bool:
    shape = getattr(var.ty, "shape", None)
    return shape is None or not hasattr(shape, "values") or any(not hasattr(d, "value") for d in shape.values)


def tvm_equal(a, b) -> bool:
    return str(a) == str(b)
