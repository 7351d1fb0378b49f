"""The declared arithmetic of reduced-precision float layers, made what TVM computes.

A layer whose tensors are ``float16`` or ``bfloat16`` (its *storage* type) declares in
``ir.json`` how it computes (``arith``, :func:`declared_arith`): by default each op reads
its storage-typed inputs and parameters exactly as ``float32`` values, computes in
``float32`` (a convolution or matrix product accumulates in ``float32``, products added in
the order of the reduction loops), and the layer rounds its outputs to the storage type
once (``"round": "layer"``). Without this pass TVM would compute such an op in the storage
type itself (each partial sum rounded to 11 or 8 bits).

:func:`widen` rewrites ``main`` so: each call of a reduced-precision layer is made on
``float32`` values (its storage-typed arguments cast with ``relax.astype``) and each value
the layer hands on is cast back to the storage type under its own name. The layer's
internal values stay ``float32``. Names and types of every original binding are kept, so
layer grouping and capture work as before.

``--accumulate fp16``/``bf16`` (``accumulate`` = the storage type, ``"round": "op"``): every
op other than a convolution or matrix product computes in float32 and rounds its result. In
float16 the convolutions and matrix products stay TVM's kernels in float16 (every product and
partial sum rounded to it). In bfloat16 TVM's kernels cannot round inside a kernel (its
bfloat16 legalization computes in float32 and drops casts between float32 values), so the
convolutions and matrix products are :mod:`irgen.stepwise`'s kernels (exact products, every
partial sum rounded to bfloat16) and every other op's result is rounded by its kernel too.
"""

from __future__ import annotations

from typing import Any

import tvm
from tvm import relax

from irgen import stepwise as _stepwise
from irgen.api import IrgenError
from irgen.graph import Binding, Constant, main_bindings, rebuild_main, tensor_type, var_names

#: float types whose layers declare their arithmetic
REDUCED = ("float16", "bfloat16")
#: ``--accumulate`` choices and the dtype each names
ACCUMULATE = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}
#: calls of kernels (a scheme's, TVM's packed functions), which compute as they declare
_KERNEL_CALLS = frozenset({"relax.call_tir", "relax.call_tir_inplace", "relax.call_tir_with_grad",
                           "relax.call_dps_packed", "relax.call_pure_packed"})
#: never widened: a cast is the model's own rounding; a kernel call
_KEEP = frozenset({"relax.astype"}) | _KERNEL_CALLS
#: the ops that accumulate products: in a layer that accumulates in its storage type, TVM's own
#: kernel in that type (every partial sum rounded to it); every other op computes in float32
#: and rounds its result
ACCUMULATING = frozenset({"relax.nn.conv1d", "relax.nn.conv2d", "relax.nn.conv3d", "relax.nn.conv2d_transpose",
                          "relax.matmul"})


def _dtypes(expr: relax.Expr) -> list[str]:
    ty = expr.ty
    if isinstance(ty, relax.TensorType):
        return [str(ty.dtype)]
    if isinstance(ty, relax.TupleType):
        return [str(f.dtype) for f in ty.fields if isinstance(f, relax.TensorType)]
    return []


def storage_of(bindings: list[Binding]) -> str | None:
    """The reduced-precision float type a layer's members compute in, or None (also for a layer
    that calls a kernel a scheme added: its kernel declares its own arithmetic). A layer that
    mixes float16 and bfloat16 is an error: no single declared arithmetic covers it."""
    if any(b.op in _KERNEL_CALLS for b in bindings):
        return None
    found = set()
    for b in bindings:
        args = b.value.args if isinstance(b.value, relax.Call) else []
        for e in [b.var, *args]:
            found.update(d for d in _dtypes(e) if d in REDUCED)
    if len(found) > 1:
        raise IrgenError(f"a layer computes in both {' and '.join(sorted(found))} (at {bindings[-1].name!r}); "
                         "one layer has one declared storage type")
    return found.pop() if found else None


def accumulate_dtype(storage: str, choice: str | None = None) -> str:
    """The accumulation type of a ``storage`` layer: float32 by default (what the source
    runtimes do on a CPU), or ``choice`` (``--accumulate``: fp32, fp16, bf16)."""
    return ACCUMULATE[choice] if choice else "float32"


def declared_arith(storage: str, accumulate: str = "float32") -> dict[str, Any]:
    """The ``arith`` record of a reduced-precision layer (docs/output-format.md). Accumulating
    in the storage type, ``products`` says what each product is rounded to before it is added:
    float16 (as TVM's float16 kernels do), or float32 for bfloat16 (exact; irgen's kernels)."""
    if accumulate not in ACCUMULATE.values():
        raise IrgenError(f"unknown accumulation type {accumulate!r}")
    if accumulate not in ("float32", storage):
        raise IrgenError(f"--accumulate: a {storage} layer accumulates in float32 or {storage}, not {accumulate}")
    if accumulate == "float32":
        return {"storage": storage, "accumulate": accumulate, "round": "layer"}
    # a product of two bfloat16 values is exact in float32 (irgen.stepwise adds it so); TVM's
    # float16 kernels round each product to float16
    products = "float32" if accumulate == "bfloat16" else storage
    return {"storage": storage, "accumulate": accumulate, "round": "op", "products": products}


def _widenable(b: Binding, storage: str) -> bool:
    v = b.value
    if not isinstance(v, relax.Call) or not isinstance(v.op, tvm.ir.Op) or v.op.name in _KEEP:
        return False
    t = tensor_type(b.var)
    return t is not None and t[1] == storage


def widen(mod: tvm.IRModule, assignment: dict[str, int], arith: dict[int, dict], keep: set[str]
          ) -> tuple[tvm.IRModule, dict[str, int]]:
    """``mod`` with every layer ``k`` of ``arith`` (layer index -> its ``arith`` record) computing
    as it declares (module docstring), and the assignment of bindings to layers with the new
    bindings. ``keep``: vars that must keep their storage-typed value (layer outputs)."""
    if not arith:
        return mod, assignment
    func, bindings = main_bindings(mod)
    layer_of = _layers_of(bindings, assignment)
    out_names = _names_in(func.body.body)
    per_op = {k for k, a in arith.items() if a.get("round") == "op"}  # every op's result rounded
    # accumulating in bfloat16: irgen's own kernels (irgen.stepwise), every op's result rounded by one
    stepwise = {k for k in per_op if arith[k]["storage"] == "bfloat16"}
    plan = {b.name: arith[layer_of[b.name]]["storage"] for b in bindings
            if layer_of.get(b.name) in arith and _widenable(b, arith[layer_of[b.name]]["storage"])
            and not (layer_of[b.name] in per_op - stepwise and b.op in ACCUMULATING)}
    rounded = {n for n in plan if layer_of[n] in per_op}
    needed = _storage_needed(bindings, plan, layer_of, keep | out_names | rounded)
    bb = relax.BlockBuilder(mod if stepwise else None)
    new: list[Binding] = []
    wide: dict[str, relax.Var] = {}  # name -> its float32 value (a widened binding's, or a cast input's)
    assign = dict(assignment)

    def add(name: str, value: relax.Expr, k: int) -> relax.Var:
        value = bb.normalize(value)
        var = relax.DataflowVar(name, value.ty)
        new.append(Binding(name, var, value))
        assign[name] = k
        return var

    def as_f32(arg: relax.Expr, owner: str, k: int, j: int) -> relax.Expr:
        if isinstance(arg, relax.Tuple):
            return relax.Tuple([as_f32(f, owner, k, j * 16 + i) for i, f in enumerate(arg.fields)])
        t = tensor_type(arg) if isinstance(arg, (relax.Var, Constant)) else None
        if t is None or t[1] not in REDUCED:
            return arg
        if isinstance(arg, relax.Var):
            key = f"{arg.name}__f32_{k}"
            if arg.name in wide and layer_of.get(arg.name) == k and k not in per_op:
                return wide[arg.name]
            if key not in wide:
                wide[key] = add(key, relax.op.astype(arg, "float32"), k)
            return wide[key]
        return add(f"{owner}__c{j}_f32", relax.op.astype(arg, "float32"), k)

    for b in bindings:
        if b.name not in plan:
            new.append(b)
            continue
        k = layer_of[b.name]
        call = b.value
        args = [as_f32(a, b.name, k, j) for j, a in enumerate(call.args)]
        if k in stepwise and b.op in ACCUMULATING:
            w = add(f"{b.name}__f32", _stepwise.accumulating_call(bb, b.op, args, call.attrs, tensor_type(b.var)[0],
                                                                   b.name), k)
        else:
            w = add(f"{b.name}__f32", relax.Call(call.op, args, _float32_out(call.attrs, plan[b.name]),
                                                 call.ty_args), k)
            if tensor_type(w) is None or tensor_type(w)[1] != "float32":
                raise IrgenError(f"internal: {call.op.name} at {b.name!r} gives {w.ty} on float32 inputs")
            if k in stepwise:  # TVM drops a float32 -> bfloat16 -> float32 round trip inside a kernel
                w = add(f"{b.name}__bf16", _stepwise.rounding_call(bb, w, b.name), k)
        wide[b.name] = w
        if b.name in needed:
            new.append(Binding(b.name, b.var, bb.normalize(relax.op.astype(w, plan[b.name]))))
    return rebuild_main(bb.get() if stepwise else mod, new), assign


def _float32_out(attrs, storage: str):
    """``attrs`` with an ``out_dtype`` of the storage type made float32 (a conv or matmul an
    importer gave its operands' type)."""
    if attrs is None or str(getattr(attrs, "out_dtype", "")) != storage:
        return attrs
    info = type(attrs).__tvm_ffi_type_info__
    fields = {f.name: getattr(attrs, f.name) for f in info.fields}
    return tvm.ir.make_node(info.type_key, **{**fields, "out_dtype": "float32"})


def _layers_of(bindings: list[Binding], assignment: dict[str, int]) -> dict[str, int]:
    """Each binding's layer: its own, or (not assigned: parameter arithmetic ahead of an op)
    the next assigned binding's, as grouping places it."""
    out: dict[str, int] = {}
    pending: list[str] = []
    for b in bindings:
        k = assignment.get(b.name)
        if k is None:
            pending.append(b.name)
            continue
        for p in pending:
            out[p] = k
        pending = []
        out[b.name] = k
    return out


def _names_in(expr: relax.Expr) -> set[str]:
    if isinstance(expr, relax.Var):
        return {expr.name}
    if isinstance(expr, relax.Tuple):
        return {n for f in expr.fields for n in _names_in(f)}
    return set()


def _storage_needed(bindings: list[Binding], plan: dict[str, str], layer_of: dict[str, int],
                    keep: set[str]) -> set[str]:
    """The widened bindings whose storage-typed value something reads: a binding that is not a
    widened call of the same layer, or ``keep`` (layer and model outputs)."""
    needed = {n for n in plan if n in keep}
    for b in bindings:
        for n in var_names(b.value):
            if n in plan and not (b.name in plan and layer_of.get(b.name) == layer_of.get(n)):
                needed.add(n)
    return needed
