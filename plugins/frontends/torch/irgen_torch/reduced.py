"""float16 and bfloat16 programs through TVM's ExportedProgram importer.

TVM 0.27's converters of ``aten.conv1d/2d/3d``, ``conv_transpose*``, ``linear``, ``addmm``,
``matmul``, ``mm`` and ``bmm`` ask for a float32 result (``out_dtype="float32"``) whatever the operands' type, so a
bfloat16 or float16 program fails at its bias add (``R.add`` of a float32 and a bfloat16
tensor). torch computes these ops in the operands' type (accumulating in float32 inside, as
irgen's declared arithmetic does: ``irgen.widen``). :class:`ReducedEmit` stands in for the
importer's block builder while a node converts and gives such a call, when its tensor operands
all have one reduced-precision type, that type as its result type.
"""

from __future__ import annotations

from typing import Any

REDUCED = ("float16", "bfloat16")


def _with_out_dtype(call, args, dtype: str):
    """``call`` on ``args`` with its attributes' ``out_dtype`` made ``dtype``."""
    import tvm
    from tvm import relax

    info = type(call.attrs).__tvm_ffi_type_info__
    fields = {f.name: getattr(call.attrs, f.name) for f in info.fields}
    attrs = tvm.ir.make_node(info.type_key, **{**fields, "out_dtype": dtype})
    return relax.Call(call.op, args, attrs, call.ty_args)


def _operand_dtypes(args) -> set[str]:
    import tvm
    from tvm import relax

    out = set()
    for x in args:
        ty = getattr(x, "ty", None) if isinstance(x, (relax.Var, tvm.ir.Constant)) else None
        if isinstance(ty, relax.TensorType):
            out.add(str(ty.dtype))
    return out


#: Relax ops whose type inference (group_norm, prelu: "data must be float") or legalization
#: (layer_norm, instance_norm, power) refuses bfloat16 in TVM 0.27: computed on float32 copies of
#: their bfloat16 operands and cast back, one rounding, as torch's kernels do
FLOAT_ONLY = frozenset({"relax.nn.group_norm", "relax.nn.prelu", "relax.nn.layer_norm", "relax.nn.instance_norm",
                        "relax.power"})


def _via_float32(expr, args):
    from tvm import relax

    wide = [relax.op.astype(a, "float32") if _operand_dtypes([a]) == {"bfloat16"} else a for a in args]
    return relax.op.astype(relax.Call(expr.op, wide, expr.attrs, expr.ty_args), "bfloat16")


def in_operand_type(expr):
    """``expr`` with every call that asks for a float32 result (``out_dtype``) of tensor operands
    that share one reduced type given that type (nested calls too: ``relax.op.linear`` builds
    one), and a :data:`FLOAT_ONLY` op on bfloat16 operands computed in float32."""
    import tvm
    from tvm import relax

    if not isinstance(expr, relax.Call):
        return expr
    args = [in_operand_type(a) for a in expr.args]
    name = expr.op.name if isinstance(expr.op, tvm.ir.Op) else None
    dtypes = _operand_dtypes(args)
    if name in FLOAT_ONLY and dtypes == {"bfloat16"}:
        return _via_float32(expr, args)
    if str(getattr(expr.attrs, "out_dtype", "")) == "float32" and len(dtypes) == 1 and next(iter(dtypes)) in REDUCED:
        return _with_out_dtype(expr, args, next(iter(dtypes)))
    if all(a.same_as(b) for a, b in zip(args, expr.args)):
        return expr
    return relax.Call(expr.op, args, expr.attrs, expr.ty_args)


class ReducedEmit:
    """The importer's block builder, with :func:`in_operand_type` applied to what it emits."""

    def __init__(self, bb) -> None:
        self._bb = bb

    def emit(self, expr, *args, **kwargs):
        return self._bb.emit(in_operand_type(expr), *args, **kwargs)

    def normalize(self, expr):
        return self._bb.normalize(in_operand_type(expr))

    def __getattr__(self, name: str):
        return getattr(self._bb, name)
