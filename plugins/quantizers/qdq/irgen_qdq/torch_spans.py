"""The realization of a torch reference graph's spans (the ``torch-qdq`` dialect): torch's
``dequantize_per_tensor`` and ``quantize_per_tensor`` as Relax ops, its binary ops (add, mul) in
float32 on the dequantized operands, and the tables of its own unary kernels (silu, gelu,
hardsigmoid, hardswish), whose last bits differ from the float ops TVM's importer writes.
:mod:`irgen_qdq.torch_ref` is the same arithmetic in numpy."""

from __future__ import annotations

import numpy as np

from .common import SCHEME, _clamp_of, _offset, _ops
from .operands import constant_tensor, constants_record


def _rx_torch_quantize(qg, f, out, lo=None, hi=None):
    """Relax: float32 ``f`` quantized the way torch's reference ops do (multiply by the inverse scale)."""
    _, op, q, _ = _ops()
    lo = out.lo if lo is None else lo
    hi = out.hi if hi is None else hi
    inv = np.float32(1.0 / float(np.float32(out.scale[0])))
    # float32 * float32 rounded once: an exact float64 product then a cast
    g = qg.emit(op.multiply(qg.emit(op.astype(f, "float64")), q.rx_const(np.float64(inv), "float64")))
    g = qg.emit(op.astype(g, "float32"))
    return q.rx_round_to_int(qg.emit, g, int(out.zero_point[0]), lo, hi, out.dtype)


#: unary ops a torch reference graph quantizes around, tabulated with torch's own kernel (ONNX Runtime
#: has no integer kernel for them: an ONNX span of one is a float span)
_TORCH_ONLY_UNARY = {"relax.nn.silu": "silu", "relax.nn.gelu": "gelu"}


def _torch_fn(op_name: str):
    """The float function torch runs for a unary op (its own vectorized kernels: numpy's
    ``exp`` differs from torch's sigmoid in the last bit for ~1 value in 6)."""
    import torch

    fn = {**_TORCH_ONLY_UNARY, "relax.sigmoid": torch.sigmoid, "relax.tanh": torch.tanh,
          "relax.nn.relu": torch.relu}[op_name]
    fn = getattr(torch.nn.functional, fn) if isinstance(fn, str) else fn
    return lambda v: fn(torch.from_numpy(np.ascontiguousarray(v, np.float32))).numpy()


def _dequantize_torch(qg, x, qx):
    """torch's dequantize_per_tensor: ``float32(x - zp) * float32(s)``, rounded once to float32."""
    _, op, q, _ = _ops()
    e = qg.emit
    f = e(op.astype(e(op.astype(_offset(qg, x, int(qx.zero_point[0])), "float32")), "float64"))
    return e(op.astype(e(op.multiply(f, q.rx_const(np.float64(np.float32(qx.scale[0])), "float64"))), "float32"))


def _realize_binary_torch(qg, qb, ins, comp, acts, out, kind: str):
    """torch reference: ``quantize_per_tensor(relu?(dequantize(a) <op> dequantize(b)))`` in float32,
    ``kind`` ``add`` or ``mul`` (RegNet's and EfficientNet's squeeze-excitation scaling)."""
    _, op, q, _ = _ops()
    rx_op, sym, word = {"add": (op.add, "+", "add"), "mul": (op.multiply, "*", "multiply")}[kind]
    (x1, q1, d1), (x2, q2, d2) = ins
    e = qg.emit
    a, b = (e(op.astype(_dequantize_torch(qg, x, qx), "float64")) for x, qx in ((x1, q1), (x2, q2)))
    # float64 holds the float32 operands' exact sum or product: one rounding, the cast to float32
    f = e(op.astype(e(rx_op(a, b)), "float32"))
    lo, hi = _clamp_of(acts, out.dtype, out)
    inv = float(np.float32(1.0 / float(np.float32(out.scale[0]))))
    # an operand quantized from a constant (MaxViT's relative position bias, computed by torch at
    # import): TVM folds it into a literal, so the record keeps its integers for the recompute
    consts = [constant_tensor(qg, x) for x in (x1, x2)]
    rec = {"scheme": SCHEME, "kind": kind, "reference": "torch", "inputs": [q1.record(), q2.record()],
           **({"constants": constants_record(consts)} if any(c is not None for c in consts) else {}),
           "output": out.record(), "requant": {"inverse_output_scale": inv, "rounding": "half_to_even",
           "rounding_rule": f"y = clamp(round_half_even(float32(deq(a) {sym} deq(b)) * inverse_output_scale) + zp_y, "
                            f"clamp); deq(x) = float32(x - zp_x) * s_x (torch: dequantize, float {word}"
                            f"{', relu' if kind == 'add' else ''}, quantize_per_tensor)"},
           "clamp": [lo, hi]}
    return [d1, d2, comp.name] + [b.name for b in acts] + [qb.name], _rx_torch_quantize(qg, f, out, lo, hi), rec


def _torch_compound(chain, start: str):
    """``(name, torch function)`` when ``chain`` is how TVM's importer writes torch's hardsigmoid
    (``clip(x + 3, 0, 6) / 6``) or hardswish (``x * that``), else None. The table is then
    torch's own kernel: its hardswish rounds otherwise than those four float ops (16% of
    float32 inputs differ in the last bit)."""
    import torch

    relax, _, _, _ = _ops()

    def scalar(e):  # a constant, a scalar literal or a PrimValue, as a float
        v = getattr(e, "value", None)
        v = v.numpy() if hasattr(v, "numpy") else getattr(v, "value", v)
        try:
            a = np.asarray(v, np.float64)
        except (TypeError, ValueError):
            return None
        return float(a.reshape(-1)[0]) if a.size == 1 else None

    def is_var(e, name: str) -> bool:
        return isinstance(e, relax.Var) and e.name == name

    ops = [b.op for b in chain]
    if ops[:3] != ["relax.add", "relax.clip", "relax.divide"] or len(ops) > 4:
        return None
    add, clip, div = chain[:3]
    if not (is_var(add.value.args[0], start) and scalar(add.value.args[1]) == 3.0
            and is_var(clip.value.args[0], add.name) and scalar(clip.value.args[1]) == 0.0
            and scalar(clip.value.args[2]) == 6.0 and is_var(div.value.args[0], clip.name)
            and scalar(div.value.args[1]) == 6.0):
        return None
    if len(ops) == 3:
        name = "hardsigmoid"
    elif ops[3] == "relax.multiply" and sorted(getattr(a, "name", "") for a in chain[3].value.args) == sorted(
            [start, div.name]):
        name = "hardswish"
    else:
        return None
    f = getattr(torch.nn.functional, name)
    return name, lambda v: f(torch.from_numpy(np.ascontiguousarray(v, np.float32))).numpy()
