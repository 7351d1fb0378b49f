"""irgen.graph.fold_constants: FoldConstant where it may change the module, and nothing
(the same module, no pass run) where it could not: the pass legalizes every call of the
model just to look at it, about 1.7 ms a call."""

from __future__ import annotations

import numpy as np
import pytest
import tvm_ffi
from tvm import relax

from irgen.graph import fold_constants, has_constant_call


def _module(body):
    """main(x: [2, 3] float32) with ``body(bb, x)`` emitted in a dataflow block."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((2, 3), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            out = bb.emit_output(body(bb, x))
        bb.emit_func_output(out)
    return bb.get()


C1 = relax.const(np.arange(6, dtype=np.float32).reshape(2, 3))
C2 = relax.const(np.full((2, 3), 0.5, np.float32))


def test_nothing_constant_skips_the_pass(monkeypatch):
    mod = _module(lambda bb, x: relax.op.multiply(bb.emit(relax.op.add(x, C1)), C2))
    assert not has_constant_call(mod)
    ran = []
    real = relax.transform.FoldConstant
    monkeypatch.setattr(relax.transform, "FoldConstant", lambda: ran.append(1) or real())
    assert fold_constants(mod) is mod and not ran
    assert tvm_ffi.structural_equal(real()(mod), mod)  # the pass would have changed nothing


@pytest.mark.parametrize("case", ["call of constants", "bound constant", "constant tuple"])
def test_anything_foldable_runs_the_pass(case, monkeypatch):
    def body(bb, x):
        if case == "call of constants":
            c = bb.emit(relax.op.add(C1, C2))
        elif case == "bound constant":
            c = bb.emit(C1)
        else:
            c = bb.emit(relax.TupleGetItem(bb.emit(relax.Tuple([C1, C2])), 1))
        return relax.op.add(x, c)

    mod = _module(body)
    assert has_constant_call(mod)
    ran = []
    real = relax.transform.FoldConstant
    monkeypatch.setattr(relax.transform, "FoldConstant", lambda: ran.append(1) or real())
    folded = fold_constants(mod)
    assert ran == [1]
    assert tvm_ffi.structural_equal(folded, real()(mod))
    if case != "constant tuple":  # the pass leaves a tuple of constants as it is: a run for nothing
        assert not tvm_ffi.structural_equal(folded, mod)
        assert not has_constant_call(folded)  # once folded, the next call skips


def test_data_movement_folded_in_numpy_is_what_the_pass_would_give():
    """A reshape and a transpose of constants (an importer's conv bias and dense weight) are
    folded in numpy into the bindings that read them, as FoldConstant propagates a bound
    constant: the module is the one the pass gives for the old form (each result bound to
    its constant), and there is nothing left for the pass (it is skipped)."""
    from irgen.graph import fold_data_movement

    w = relax.const(np.arange(6, dtype=np.float32).reshape(3, 2))

    def body(bb, x):
        bias = bb.emit(relax.op.reshape(C1, (1, 2, 3)))
        wt = bb.emit(relax.op.permute_dims(w))
        return relax.op.add(bb.emit(relax.op.add(x, wt)), bias)

    mod = _module(body)
    folded = fold_data_movement(mod)
    assert not has_constant_call(folded)
    old_form = _module(lambda bb, x: relax.op.add(
        bb.emit(relax.op.add(x, bb.emit(relax.const(np.arange(6, dtype=np.float32).reshape(3, 2).T.copy())))),
        bb.emit(relax.const(np.arange(6, dtype=np.float32).reshape(1, 2, 3)))))
    assert has_constant_call(old_form)
    assert tvm_ffi.structural_equal(folded, relax.transform.FoldConstant()(old_form), map_free_vars=True)
