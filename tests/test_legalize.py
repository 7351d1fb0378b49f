"""irgen.execute.legalize_casts_once: LegalizeOps with each kind of cast made into a kernel
once gives the module TVM's own legalization gives (which makes it anew for every cast and
then finds it equal to the first)."""

from __future__ import annotations

import numpy as np
import tvm_ffi
from tvm import relax

from irgen.execute import legalize_casts_once


def _module():
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((2, 3), "float32"))
    y = relax.Var("y", relax.TensorType((4,), "int8"))
    with bb.function("main", [x, y]):
        with bb.dataflow():
            a = bb.emit(relax.op.astype(x, "int32"))
            b = bb.emit(relax.op.astype(relax.op.add(x, relax.const(1.0)), "int32"))  # the same kind again
            c = bb.emit(relax.op.astype(a, "float32"))
            d = bb.emit(relax.op.astype(y, "int32"))  # another shape and dtype
            e = bb.emit(relax.op.astype(relax.const(np.arange(4, dtype=np.int8)), "int32"))  # of a constant
            f = bb.emit(relax.op.astype(relax.const(np.float32(2.5)), "int32"))  # a scalar: a constant
            out = bb.emit_output(relax.Tuple([b, c, relax.op.add(d, e), f]))
        bb.emit_func_output(out)
    return bb.get()


def test_casts_made_once_give_the_module_tvm_gives(monkeypatch):
    mod = _module()
    made = []
    real = relax.BlockBuilder.call_te
    monkeypatch.setattr(relax.BlockBuilder, "call_te", lambda bb, *a, **k: made.append(1) or real(bb, *a, **k))
    theirs = relax.transform.LegalizeOps()(mod)
    assert len(made) == 7  # TVM makes a kernel for each of the 5 casts of a tensor and the 2 adds
    made.clear()
    ours = relax.transform.LegalizeOps(customize_legalize_map=legalize_casts_once())(mod)
    assert len(made) == 5  # casts once per kind (b and e reuse the kernels of a and d), the adds
    assert tvm_ffi.structural_equal(ours, theirs)
    kernels = [gv.name_hint for gv, f in ours.functions.items() if not isinstance(f, relax.Function)]
    assert sum(n.startswith("cast") for n in kernels) == 3, kernels  # float->int32 [2,3], int32->float, int8->int32
