"""Kernels that differ only in their constants share one compiled function, values unchanged.

FuseTIR makes one PrimFunc per fused layer, and two layers of the same shape differ, if at
all, in the constants written into their code: a quantized convolution's clip bounds and
zero points, a requantization's scale, a float layer's ``eps``. LLVM compiles each of them
again (a 3x3 convolution: about 60 ms of a core at ``-O1``), so a network that repeats one
block (a ResNet stage, a transformer layer) pays for every repetition.

:func:`share_kernels` finds the called PrimFuncs that are the same code once their **value
constants** are set aside, and keeps one of each group: the constants that differ within the
group become 0-d parameters of that one function (placed after its inputs), and every call
site passes its own values as 0-d constants. The constants the members agree on stay in the
code. A function with no twin is not touched.

A value constant is an integer or float immediate in the value stored by a ``BufferStore``,
outside any index (of a load) and outside the condition of an ``if_then_else`` or
``Select``, and only inside the operations listed in :data:`VALUE_CALLS` (math on values):
loop extents, indices, block domains and conditions keep their immediates. A kernel that
reads its constant from a parameter computes the same operations on the same values as one
that has it as an immediate (no fast-math: LLVM folds a constant exactly as the CPU computes
it), so every value is the same (``tests/test_share.py`` compares each activation file with
the unshared build's).

The call sites keep their layer's name for people (:class:`irgen.execute.Kernel`'s
``callee``: debug-graph node names); ``symbol`` names the function that runs.

``IRGEN_NO_SHARE=1`` (or ``ENABLED = False``) turns it off.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from irgen.envflags import turned_off

#: environment switch: a true value (1, true, yes, on) turns sharing off
ENV_OFF = "IRGEN_NO_SHARE"
#: module switch (tests and embedders); the environment variable wins when set
ENABLED = True
#: the dtypes of immediates that may become parameters (the executor's numpy dtypes)
LIFTED_DTYPES = frozenset({"float16", "float32", "float64", "int8", "int16", "int32", "int64",
                           "uint8", "uint16", "uint32", "uint64"})
#: calls whose arguments are all values (their immediates may become parameters); the value
#: branches of ``if_then_else`` are handled apart, any other call keeps its immediates
VALUE_CALLS = frozenset({
    "nearbyint", "round", "floor", "ceil", "trunc", "fabs", "exp", "exp2", "exp10", "log", "log2", "log10",
    "log1p", "tanh", "sigmoid", "sqrt", "rsqrt", "erf", "pow", "fmod", "sin", "cos", "tan", "atan", "atan2",
    "shift_left", "shift_right", "bitwise_and", "bitwise_or", "bitwise_xor", "bitwise_not", "copysign",
    "isnan", "isinf", "isfinite", "clz", "popcount",
})


def enabled() -> bool:
    """Whether :func:`share_kernels` shares (``IRGEN_NO_SHARE`` unset and ``ENABLED``)."""
    return not turned_off(ENV_OFF, ENABLED)


def key() -> tuple:
    """What the sharing's result depends on (for compile caches)."""
    return ("share", 1, enabled())


@dataclass
class Stats:
    """What the last :func:`share_kernels` call did."""

    functions: int = 0  # PrimFuncs called from main
    groups: int = 0  # groups of two or more that now share one function
    removed: int = 0  # PrimFuncs dropped (their calls go to their group's function)
    lifted: int = 0  # constants that became parameters (per shared function, summed)


stats = Stats()


def _op_name(op: Any) -> str:
    name = getattr(op, "name", "") or ""
    return name.rsplit(".", 1)[-1]


class _Lifter:
    """One pass over a PrimFunc: every value constant counted in a fixed order; those whose
    position is in ``lift`` (None: all) replaced by a load of a new 0-d parameter."""

    def __init__(self, lift: set[int] | None):
        self.lift = lift
        self.values: list[tuple[str, Any]] = []  # (dtype, value) of every value constant, in order
        self.params: list[Any] = []  # the new buffer vars, in position order
        self.in_value = False
        self.frames: list[list[Any]] = []  # per enclosing block: the params it now reads

    def imm(self, node, m):
        import tvm

        dtype = str(node.ty)
        if not self.in_value or dtype not in LIFTED_DTYPES:
            return node
        pos = len(self.values)
        self.values.append((dtype, node.value))
        if self.lift is not None and pos not in self.lift:
            return node
        buf = tvm.tirx.decl_buffer((), dtype, name=f"k{len(self.params)}")
        self.params.append(buf)
        if self.frames:
            self.frames[-1].append(buf)
        return tvm.tirx.BufferLoad(buf, [])

    def store(self, node, m):
        import tvm

        was, self.in_value = self.in_value, True
        try:
            value = m.mutate(node.value)
        finally:
            self.in_value = was
        return node if value.same_as(node.value) else tvm.tirx.BufferStore(node.buffer, value, list(node.indices))

    def load(self, node, m):
        return node  # its indices keep their immediates

    def call(self, node, m):
        import tvm

        if not self.in_value:
            return m.default_mutate(node)
        name = _op_name(node.op)
        args = list(node.args)
        if name == "if_then_else":
            new = [args[0], m.mutate(args[1]), m.mutate(args[2])]
        elif name in VALUE_CALLS:
            new = [m.mutate(a) for a in args]
        else:
            return node
        if all(a.same_as(b) for a, b in zip(args, new)):
            return node
        return tvm.ir.Call(node.op, new, node.attrs, list(node.ty_args) if node.ty_args else None,
                           ret_ty=node.ty)

    def select(self, node, m):
        import tvm

        if not self.in_value:
            return m.default_mutate(node)
        t, f = m.mutate(node.true_value), m.mutate(node.false_value)
        if t.same_as(node.true_value) and f.same_as(node.false_value):
            return node
        return tvm.tirx.Select(node.condition, t, f)

    def block(self, node, m):
        from tvm import s_tir

        self.frames.append([])
        try:
            new = m.default_mutate(node)
        finally:
            added = self.frames.pop()
        if not added:
            return new
        reads = list(new.reads) + [_region(b) for b in added]
        return s_tir.SBlock(list(new.iter_vars), reads, list(new.writes), new.name_hint, new.body, new.init,
                            list(new.alloc_buffers), list(new.match_buffers), dict(new.annotations))

    def run(self, func, n_inputs: int):
        """``func`` with the chosen constants as parameters after its first ``n_inputs``."""
        import tvm
        import tvm_ffi
        from tvm import s_tir

        cbs = [
            ((tvm.tirx.FloatImm, tvm.tirx.IntImm), self.imm),
            (tvm.tirx.BufferStore, self.store),
            (tvm.ir.TensorLoad, self.load),
            (tvm.ir.Call, self.call),
            (tvm.tirx.Select, self.select),
            (s_tir.SBlock, self.block),
        ]
        body = tvm_ffi.structural_mutate(func.body, cbs)
        if not self.params:
            return func
        params = list(func.params)
        new = tvm.tirx.PrimFunc(params[:n_inputs] + self.params + params[n_inputs:], body, func.ret_type, func.attrs)
        return new


def _region(buf):
    from tvm.ir import TensorRegion
    from tvm.tirx.stmt import BufferRegionType

    return TensorRegion(buf, [], BufferRegionType())


def _canonical(func) -> Any:
    return func.without_attr("global_symbol") if func.attrs and "global_symbol" in func.attrs else func


def share_kernels(mod) -> tuple[Any, dict[str, str]]:
    """``mod`` with the PrimFuncs ``main`` calls shared as the module docstring says, and
    the original callee name of each rewritten call (binding var name -> PrimFunc name)."""
    global stats
    stats = Stats()
    if not enabled():
        return mod, {}
    n_inputs = _call_arities(mod)
    funcs = _shareable_funcs(mod, n_inputs)
    stats.functions = len(funcs)
    lifted, groups = _group_by_code(funcs, n_inputs)
    target_of, new_funcs = _share_groups(groups, funcs, lifted, n_inputs)
    if not target_of:
        return mod, {}
    return _rewrite_module(mod, funcs, lifted, target_of, new_funcs)


def _call_arities(mod) -> dict[str, int]:
    """The number of tensor arguments each PrimFunc that ``main`` calls with ``call_tir`` gets
    (by name; -1 when its calls pass different numbers: such a function is left alone)."""
    import tvm
    from tvm import relax

    from irgen.graph import main_bindings

    call_tir = tvm.ir.Op.get("relax.call_tir")
    _, bindings = main_bindings(mod)
    n_inputs: dict[str, int] = {}
    for b in bindings:
        v = b.value
        if isinstance(v, relax.Call) and v.op.same_as(call_tir) and len(v.args) == 2 \
                and isinstance(v.args[1], relax.Tuple) and isinstance(v.args[0], tvm.ir.GlobalVar):
            name = v.args[0].name_hint
            n = len(v.args[1].fields)
            if n_inputs.setdefault(name, n) != n:
                n_inputs[name] = -1  # called with different arities: left alone
    return n_inputs


def _shareable_funcs(mod, n_inputs: dict[str, int]) -> dict[str, tuple[Any, Any]]:
    """The PrimFuncs that may be shared, by name -> (GlobalVar, PrimFunc): called from ``main``
    with one arity, and called by no other Relax function (a control-flow body's are left alone)."""
    import tvm
    from tvm import relax

    elsewhere = {g.name_hint for gv, f in mod.functions.items() if gv.name_hint != "main"
                 and isinstance(f, relax.Function) for g in relax.analysis.all_global_vars(f)}
    return {gv.name_hint: (gv, f) for gv, f in mod.functions.items()
            if gv.name_hint in n_inputs and n_inputs[gv.name_hint] >= 0 and gv.name_hint not in elsewhere
            and isinstance(f, tvm.tirx.PrimFunc)}


def _group_by_code(funcs: dict[str, tuple[Any, Any]], n_inputs: dict[str, int]
                   ) -> tuple[dict[str, tuple[Any, list[tuple[str, Any]]]], list[list[str]]]:
    """Group ``funcs`` by their code with every value constant set aside: (name -> (that code,
    its value constants in order), the groups of names (singletons included), hash by hash).
    A function the walk cannot rebuild is in no group."""
    import tvm_ffi

    lifted: dict[str, tuple[Any, list[tuple[str, Any]]]] = {}
    buckets: dict[int, list[list[str]]] = {}
    for name, (gv, f) in funcs.items():
        lifter = _Lifter(None)
        try:
            canon = lifter.run(_canonical(f), n_inputs[name])
        except Exception:  # noqa: BLE001  a function the walk cannot rebuild stays as it is
            continue
        if not lifter.values:
            canon = _canonical(f)
        lifted[name] = (canon, lifter.values)
        h = tvm_ffi.structural_hash(canon, map_free_vars=True)
        for group in buckets.setdefault(h, []):
            if n_inputs[group[0]] == n_inputs[name] and tvm_ffi.structural_equal(lifted[group[0]][0], canon,
                                                                                   map_free_vars=True):
                group.append(name)
                break
        else:
            buckets[h].append([name])
    return lifted, [group for groups in buckets.values() for group in groups]


def _share_groups(groups: list[list[str]], funcs: dict[str, tuple[Any, Any]],
                  lifted: dict[str, tuple[Any, list[tuple[str, Any]]]], n_inputs: dict[str, int]
                  ) -> tuple[dict[str, tuple[Any, list[int]]], dict[Any, Any]]:
    """One function for each group of two or more: (member name -> (the shared function's
    GlobalVar, the positions of the constants lifted to parameters), the first member's
    GlobalVar -> its rebuilt PrimFunc with those parameters, for groups whose constants differ).
    Counts the groups in :data:`stats`."""
    target_of: dict[str, tuple[Any, list[int]]] = {}  # member -> (shared gv, lifted positions)
    new_funcs: dict[Any, Any] = {}
    for group in groups:
        if len(group) < 2:
            continue
        values = [lifted[n][1] for n in group]
        differ = [i for i in range(len(values[0])) if any(_differs(values[0][i], v[i]) for v in values[1:])]
        rep_gv, rep = funcs[group[0]]
        if differ:
            try:
                shared = _Lifter(set(differ)).run(rep, n_inputs[group[0]])
            except Exception:  # noqa: BLE001
                continue
            new_funcs[rep_gv] = shared
        for n in group:
            target_of[n] = (rep_gv, differ)
        stats.groups += 1
        stats.removed += len(group) - 1
        stats.lifted += len(differ)
    return target_of, new_funcs


def _rewrite_module(mod, funcs: dict[str, tuple[Any, Any]], lifted: dict[str, tuple[Any, list[tuple[str, Any]]]],
                    target_of: dict[str, tuple[Any, list[int]]], new_funcs: dict[Any, Any]
                    ) -> tuple[Any, dict[str, str]]:
    """``mod`` without the group members it no longer calls, with the shared functions (under
    new GlobalVars: they take more parameters) and a ``main`` whose calls go to them; and the
    original callee of each rewritten call (binding var name -> PrimFunc name)."""
    import tvm
    from tvm import relax

    from irgen.graph import rewrite_blocks

    removed = {n for n, (gv, _) in target_of.items() if not gv.same_as(funcs[n][0])}
    base = tvm.IRModule({gv: f for gv, f in mod.functions.items()
                         if gv.name_hint not in {"main", *removed, *(g.name_hint for g in new_funcs)}},
                        attrs=mod.attrs)
    # a shared function takes more parameters: a new global var of its new type
    bb = relax.BlockBuilder(base)
    renamed = {old.name_hint: bb.add_func(f, old.name_hint) for old, f in new_funcs.items()}
    target_of = {n: (renamed.get(gv.name_hint, gv), differ) for n, (gv, differ) in target_of.items()}
    display: dict[str, str] = {}
    func = mod["main"]
    blocks = rewrite_blocks(func, _call_rewriter(lifted, target_of, display))
    out = bb.get()
    out["main"] = relax.Function(list(func.params), relax.SeqExpr(blocks, func.body.body), func.ret_ty, func.is_pure,
                                 func.attrs)
    return out, display


def _call_rewriter(lifted: dict[str, tuple[Any, list[tuple[str, Any]]]],
                   target_of: dict[str, tuple[Any, list[int]]], display: dict[str, str]):
    """The binding rewrite for ``main``: a call of a group member becomes a call of its group's
    function, passing the member's own values of the lifted constants as 0-d constants (one
    constant per dtype and value); records the original callee in ``display``."""
    import numpy as np
    import tvm
    from tvm import relax

    call_tir = tvm.ir.Op.get("relax.call_tir")
    consts: dict[tuple[str, Any], Any] = {}

    def const(dtype: str, value: Any):
        k = (dtype, repr(value))
        c = consts.get(k)
        if c is None:
            c = consts[k] = relax.const(np.array(value, dtype=dtype), dtype)
        return c

    def rewrite(b):
        v = b.value
        if not (isinstance(v, relax.Call) and v.op.same_as(call_tir) and isinstance(v.args[0], tvm.ir.GlobalVar)):
            return b
        name = v.args[0].name_hint
        hit = target_of.get(name)
        if hit is None:
            return b
        gv, differ = hit
        vals = lifted[name][1]
        extra = [const(*vals[i]) for i in differ]
        display[b.var.name] = name
        if gv.same_as(v.args[0]) and not extra:
            return b
        args = relax.Tuple(list(v.args[1].fields) + extra)
        return relax.VarBinding(b.var, relax.Call(v.op, [gv, args, *v.args[2:]], v.attrs, v.ty_args))

    return rewrite


def _differs(a: tuple[str, Any], b: tuple[str, Any]) -> bool:
    """Two constants at one position differ (dtype, or value: NaNs equal, 0.0 and -0.0 not)."""
    import math

    if a[0] != b[0]:
        return True
    x, y = a[1], b[1]
    if isinstance(x, float) and isinstance(y, float):
        if math.isnan(x) and math.isnan(y):
            return False
        return x != y or math.copysign(1.0, x) != math.copysign(1.0, y)
    return x != y
