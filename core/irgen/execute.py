"""Claim step 2 on Relax: compile at an opt level, run, and see every kernel's output.

The executed module is lowered here pass by pass so irgen knows, before the
run, the sequence of kernel calls the VM will make (``Kernel``); :mod:`irgen.vm`
runs the result, handing over each kernel's output as it is produced.

Where ``main`` is only what irgen's own executor runs (``program``: kernel calls,
reshapes, tuple items, aliases), the model's constants are compiled as parameters of
``main`` rather than embedded in the library, so that :func:`irgen.vm.run_program`
can load each kernel's weights just before its call and drop them after: memory
stays flat in the number of layers. Any other ``main`` keeps its constants embedded
and runs on the Relax VM (the fallback).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Callable, Hashable

import tvm
import tvm_ffi
from tvm import relax

from irgen import parallel_build, schedule, share, spill, target
from irgen.api import IrgenError
from irgen.graph import Constant, fold_constants, main_bindings, rewrite_blocks, tensor_type

#: what each opt level adds, cumulatively (docs/cli.md documents the same table)
OPT_LEVELS = {
    0: "no graph optimization: every op is its own kernel, parameter arithmetic runs at run time",
    1: "constant folding (FoldConstant)",
    2: "dead-code elimination (DeadCodeElimination)",
    3: "one fused kernel per hardware layer (FuseTIR over irgen's layers)",
    4: "as 3; TIR passes that check the level see 4",
}


@dataclass
class Kernel:
    """One call the VM makes that produces tensors."""

    callee: str  # the fused PrimFunc's name (its layer's, for people), or "vm.builtin.reshape"
    outputs: list[str]  # Relax var names of its results
    inputs: list[Any]  # Relax var names (str) or Constants, in argument order
    out_types: list[tuple[tuple[int, ...], str]] = field(default_factory=list)
    storage: list[int] = field(default_factory=list)
    #: (shape, dtype) of each argument of the PrimFunc, outputs last (None: not all static)
    arg_types: list[tuple[tuple[int, ...], str]] | None = None
    #: the PrimFunc that runs: ``callee``, or the function it shares (:mod:`irgen.share`)
    symbol: str = ""

    def __post_init__(self) -> None:
        self.symbol = self.symbol or self.callee


def _gate(opt_level: int, level: int, p: tvm.transform.Pass) -> list[tvm.transform.Pass]:
    return [p] if opt_level >= level else []


_CACHE: dict[tuple[int, int, int], tuple] = {}
_CACHE_SIZE = 4

def lower(mod: tvm.IRModule, opt_level: int, group: Callable[[tvm.IRModule], tvm.IRModule], grouping: Hashable = None):
    """Compile ``mod`` at ``opt_level``: (executable, kernel sequence, where each var comes
    from, the executor's ``program`` or None: see :func:`program`).

    Within one process the result is reused for a structurally equal module grouped
    the same way (``grouping``: what ``group`` does, e.g. the layer of each binding;
    another backend's layers of the same model compile anew). Golden data for many
    inputs of one model compiles once. Every kernel gets irgen's default CPU schedule
    (:mod:`irgen.schedule`: parallel and vector spatial loops, the same values;
    ``IRGEN_NO_SCHEDULE=1`` turns it off).
    """
    if spill.active():  # one compile per run; hashing would read every weight into memory
        result = _lower(mod, opt_level, group)
        return result[0], list(result[1]), dict(result[2]), result[3]
    # var names matter too: the kernel sequence refers to them
    names = tuple(b.name for b in main_bindings(mod)[1])
    key = (tvm_ffi.structural_hash(mod, map_free_vars=True), hash(names), hash(grouping), opt_level, schedule.key(), share.key(),
           target.key())
    hit = _CACHE.get(key)
    if (hit is not None and hit[2] == names and hit[3] == grouping
            and tvm_ffi.structural_equal(hit[0], mod, map_free_vars=True)):
        exe, kernels, where, prog = hit[1]
        return exe, [replace(k) for k in kernels], dict(where), prog
    result = _lower(mod, opt_level, group)
    if len(_CACHE) >= _CACHE_SIZE:
        _CACHE.pop(next(iter(_CACHE)))
    _CACHE[key] = (mod, result, names, grouping)
    return result[0], [replace(k) for k in result[1]], dict(result[2]), result[3]


def forget() -> None:
    """Drop the compiles kept for this process (their modules hold the model's constants):
    once a plan is stored in the compile cache, a second run reads it from there."""
    _CACHE.clear()


def _lower(mod: tvm.IRModule, opt_level: int, group: Callable[[tvm.IRModule], tvm.IRModule]):
    tgt = tvm.target.Target(target.spec())
    with tvm.transform.PassContext(opt_level=opt_level), tgt:
        if opt_level >= 1:
            mod = fold_constants(mod)  # FoldConstant, skipped when nothing is constant
        if opt_level >= 2:
            mod = relax.transform.DeadCodeElimination(["main"])(mod)
        if opt_level >= 3:
            mod = group(mod)
        mod = tvm.transform.Sequential(
            [
                relax.backend.DispatchSampling(),
                relax.backend.DispatchSortScan(),
                relax.transform.LegalizeOps(customize_legalize_map=legalize_casts_once()),
                relax.transform.AnnotateTIROpPattern(),
                *_gate(opt_level, 3, relax.transform.FuseTIR()),
                *_gate(opt_level, 3, relax.transform.DeadCodeElimination(["main"])),
                relax.transform.RewriteDataflowReshape(),
            ]
        )(mod)
        mod, names = share.share_kernels(mod)  # twins in all but constants: one function (IRGEN_NO_SHARE=1: off)
        kernels, where = kernel_sequence(mod, names)
        prog = program(mod)
        mod = schedule.schedule_module(mod)  # spatial loops only: same values (IRGEN_NO_SCHEDULE=1: off)
        if prog is not None:
            mod = _constants_as_params(mod, unique_constants(kernels))
        mod = tvm.transform.Sequential(
            [
                relax.transform.ToNonDataflow(),
                relax.transform.RemovePurityChecking(),
                relax.transform.CallTIRRewrite(),
                relax.transform.StaticPlanBlockMemory(),
                relax.transform.LowerAllocTensor(),
                relax.transform.KillAfterLastUse(),
                relax.transform.LowerRuntimeBuiltin(),
                relax.transform.ComputePrimValue(),
                relax.transform.VMShapeLower(),
                relax.transform.AttachGlobalSymbol(),
            ]
        )(mod)
        _attach_storage(mod, kernels)
        signatures = {gv.name_hint: parallel_build.signature(f) for gv, f in mod.functions.items()
                      if isinstance(f, tvm.tirx.PrimFunc)}
        for k in kernels:
            k.arg_types = signatures.get(k.symbol)
        # irgen's executor checks every kernel argument against its signature (vm.run_program):
        # the kernels need not (the VM of the fallback keeps TVM's checks)
        checked = prog is not None and all(s is not None for s in signatures.values())
        exe = parallel_build.build(mod, tgt, checked_by_caller=checked)  # relax.build, LLVM on every core
    return exe, kernels, where, prog


def legalize_casts_once() -> dict[str, Callable]:
    """LegalizeOps' map entry for ``relax.astype`` that makes TVM's kernel once per (shape,
    dtype, target dtype) and calls that one for every later cast of the kind: TVM's own
    legalization builds it anew each time in Python (TE compute, PrimFunc, then the module
    finds it equal to one it has), about 1.5 ms a cast, and a quantized model casts at every
    step of every requantization (158 casts on a quantized ResNet-18). The call is the one TVM
    makes: ``call_tir`` of the same kernel on the same argument."""
    default = tvm.ir.Op.get("relax.astype").get_attr("FLegalize")
    call_tir = tvm.ir.Op.get("relax.call_tir")
    made: dict[tuple, Any] = {}

    def astype(bb, call):
        arg = call.args[0]
        static = tensor_type(arg) if isinstance(arg, (relax.Var, Constant)) else None
        # a 0-d tensor is left to TVM each time: its cast of a 0-d constant is a constant
        key = None if static is None or not static[0] else (*static, str(call.attrs.dtype), str(arg.ty.vdevice))
        done = made.get(key) if key is not None else None
        if done is not None:
            gvar, out_ty = done
            return relax.call_tir(gvar, relax.Tuple([arg]), out_ty)
        result = default(bb, call)
        if key is not None and isinstance(result, relax.Call) and result.op.same_as(call_tir) \
                and len(result.args) == 2 and len(result.args[1].fields) == 1 and result.args[1].fields[0].same_as(arg):
            made[key] = (result.args[0], result.ty_args[0])
        return result

    return {"relax.astype": astype}


def _n_fields(ty) -> list[tuple[tuple[int, ...], str]]:
    tys = list(ty.fields) if isinstance(ty, relax.TupleType) else [ty]
    out = []
    for t in tys:
        shape = tuple(int(d) for d in t.shape.values)
        out.append((shape, str(t.dtype)))
    return out


def kernel_sequence(mod: tvm.IRModule, names: dict[str, str] | None = None
                    ) -> tuple[list[Kernel], dict[str, tuple[int, int]]]:
    """The kernels ``main`` calls, in order, and where each var's value comes from.
    ``names``: a call's own PrimFunc name by binding var, where it calls a shared one.

    ``where`` maps a Relax var name to (kernel index, output index), following
    tuple-get-items and aliases.
    """
    _, bindings = main_bindings(mod)
    kernels: list[Kernel] = []
    where: dict[str, tuple[int, int]] = {}
    for b in bindings:
        v = b.value
        if isinstance(v, relax.TupleGetItem) and isinstance(v.tuple_value, relax.Var):
            src = where.get(v.tuple_value.name)
            if src is not None:
                where[b.name] = (src[0], v.index)
            continue
        if isinstance(v, relax.Var):
            if v.name in where:
                where[b.name] = where[v.name]
            continue
        if not isinstance(v, relax.Call):
            continue
        op = v.op
        name = op.name if isinstance(op, tvm.ir.Op) else None
        if name == "relax.call_tir":
            symbol = v.args[0].name_hint
            args = list(v.args[1].fields)
            outs = _n_fields(b.var.ty)
            out_names = [b.name] if len(outs) == 1 else [f"{b.name}.{k}" for k in range(len(outs))]
            where[b.name] = (len(kernels), 0)
            kernels.append(Kernel((names or {}).get(b.name, symbol), out_names, [_arg(a) for a in args], outs,
                                  symbol=symbol))
        elif name == "relax.reshape":
            where[b.name] = (len(kernels), 0)
            kernels.append(Kernel("vm.builtin.reshape", [b.name], [_arg(v.args[0])], _n_fields(b.var.ty)))
        elif name is not None and name.startswith("relax.") and name not in ("relax.call_pure_packed",):
            raise IrgenError(f"internal: op {name} was not lowered to a kernel")
    # passes may rename a result that ``main`` returns to the returned var:
    # record the returned vars by position ("@out:K")
    body = mod["main"].body.body
    outs = list(body.fields) if isinstance(body, relax.Tuple) else [body]
    for i, o in enumerate(outs):
        if isinstance(o, relax.Var) and o.name in where:
            where[f"@out:{i}"] = where[o.name]
    return kernels, where


def unique_constants(kernels: list[Kernel]) -> list[Constant]:
    """The constants the kernels read, each once, in order of first use (the debug graph's
    ``p0, p1, ...``, the lifted parameters of ``main``, the program's constant indices)."""
    out: list[Constant] = []
    seen: set[int] = set()
    for k in kernels:
        for a in k.inputs:
            if isinstance(a, Constant) and a.__chandle__() not in seen:
                seen.add(a.__chandle__())
                out.append(a)
    return out


#: the dtypes the executor allocates with numpy (others, e.g. bfloat16, run on the VM)
_EXECUTOR_DTYPES = {"bool", "float16", "float32", "float64", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32",
                    "uint64"}


def program(mod: tvm.IRModule) -> dict[str, Any] | None:
    """What :func:`irgen.vm.run_program` executes instead of the Relax VM: ``main``'s
    bindings as steps, or None when ``main`` holds anything else (then the VM runs it,
    with its constants embedded in the library: the fallback).

    Steps, in ``main``'s order (an argument is a var name, or an int: the index of a
    constant in :func:`unique_constants` order):
    ``["k", kernel index, [args], var]`` a ``call_tir`` (its outputs' types are the
    kernel's), ``["r", kernel index, arg, var]`` a reshape (a view), ``["t", var, src,
    index]`` a tuple item, ``["a", var, src]`` an alias, ``["T", var, [args]]`` a tuple.
    """
    func, bindings = main_bindings(mod)
    consts: dict[int, int] = {}
    steps: list[list] = []
    n_kernels = 0

    def ref(a) -> str | int | None:
        if isinstance(a, relax.Var):
            return a.name
        if isinstance(a, Constant) and str(a.ty.dtype) in _EXECUTOR_DTYPES:
            return consts.setdefault(a.__chandle__(), len(consts))
        return None

    def typed(ty) -> bool:
        tys = list(ty.fields) if isinstance(ty, relax.TupleType) else [ty]
        return all(isinstance(t, relax.TensorType) and str(t.dtype) in _EXECUTOR_DTYPES and t.shape is not None
                   for t in tys)

    for b in bindings:
        v = b.value
        op = v.op if isinstance(v, relax.Call) else None
        name = op.name if isinstance(op, tvm.ir.Op) else None
        if name == "relax.call_tir" and len(v.args) == 2 and isinstance(v.args[1], relax.Tuple) and typed(b.var.ty):
            args = [ref(a) for a in v.args[1].fields]
            if None in args:
                return None
            steps.append(["k", n_kernels, args, b.name])
            n_kernels += 1
        elif name == "relax.reshape" and typed(b.var.ty) and ref(v.args[0]) is not None:
            steps.append(["r", n_kernels, ref(v.args[0]), b.name])
            n_kernels += 1
        elif isinstance(v, relax.TupleGetItem) and isinstance(v.tuple_value, relax.Var):
            steps.append(["t", b.name, v.tuple_value.name, int(v.index)])
        elif isinstance(v, relax.Var):
            steps.append(["a", b.name, v.name])
        elif isinstance(v, relax.Tuple) and all(isinstance(f, relax.Var) for f in v.fields):
            steps.append(["T", b.name, [f.name for f in v.fields]])
        else:
            return None  # anything else (packed calls, constants bound to vars, ...): the VM runs main
    body = func.body.body
    if not isinstance(body, (relax.Var, relax.Tuple)):
        return None
    return {"inputs": [p.name for p in func.params], "steps": steps}


def _constants_as_params(mod: tvm.IRModule, consts: list[Constant]) -> tvm.IRModule:
    """``mod`` whose ``main`` takes ``consts`` as parameters after its inputs (``num_input``
    keeps counting the inputs): the library holds no weights."""
    func = mod["main"]
    params = {c.__chandle__(): relax.Var(f"irgen_c{i}", c.ty) for i, c in enumerate(consts)}

    def sub(e):
        if isinstance(e, Constant):
            return params.get(e.__chandle__(), e)
        if isinstance(e, relax.Tuple):
            return relax.Tuple([sub(f) for f in e.fields])
        if isinstance(e, relax.Call):
            return relax.Call(e.op, [sub(a) for a in e.args], e.attrs, e.ty_args)
        return e

    blocks = rewrite_blocks(func, lambda b: relax.VarBinding(b.var, sub(b.value)))
    new = relax.Function(list(func.params) + list(params.values()), relax.SeqExpr(blocks, sub(func.body.body)),
                         func.ret_ty, func.is_pure, func.attrs)
    if not (func.attrs and "num_input" in func.attrs):
        new = new.with_attr("num_input", len(func.params))
    out = tvm.IRModule({gv: f for gv, f in mod.functions.items() if gv.name_hint != "main"})
    out["main"] = new
    return out


def _arg(a):
    if isinstance(a, relax.Var):
        return a.name
    if isinstance(a, Constant):
        return a
    raise IrgenError(f"internal: unexpected kernel argument {type(a).__name__}")


def _attach_storage(final: tvm.IRModule, kernels: list[Kernel]) -> None:
    """Storage ids of each kernel output, read off the memory-planned ``main``."""
    func = final["main"]
    storage_of: dict[str, int] = {}
    storages: dict[str, int] = {}
    calls = []
    for block in func.body.blocks:
        for b in block.bindings:
            v = b.value
            if not isinstance(v, relax.Call):
                continue
            op = v.op
            opname = op.name if isinstance(op, tvm.ir.Op) else None
            if opname in ("relax.vm.alloc_storage", "relax.memory.alloc_storage"):
                storages[b.var.name] = len(storages)
            elif opname in ("relax.vm.alloc_tensor", "relax.memory.alloc_tensor"):
                s = v.args[0]
                if isinstance(s, relax.Var) and s.name in storages:
                    storage_of[b.var.name] = storages[s.name]
                else:
                    storages[b.var.name] = len(storages)
                    storage_of[b.var.name] = storages[b.var.name]
            elif isinstance(op, tvm.ir.GlobalVar):
                calls.append([a.name if isinstance(a, relax.Var) else None for a in v.args])
            elif isinstance(op, relax.ExternFunc) and op.global_symbol == "vm.builtin.reshape":
                src = v.args[0].name if isinstance(v.args[0], relax.Var) else None
                storage_of[b.var.name] = storage_of.get(src, -1)
                calls.append(None)
    if len(calls) != len(kernels):
        return  # storage ids are informative only
    fresh = len(storages)
    for k, args in zip(kernels, calls):
        if args is None:
            k.storage = [-1]
            continue
        outs = args[len(args) - len(k.outputs):]
        ids = []
        for a in outs:
            if a in storage_of:
                ids.append(storage_of[a])
            else:
                ids.append(fresh)
                fresh += 1
        k.storage = ids
