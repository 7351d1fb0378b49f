"""float8 QuantizeLinear -> DequantizeLinear (E4M3FN, E5M2), as ONNX Runtime computes it.

The ONNX frontend imports a float8 Q/DQ node as a Relax ``quantize``/``dequantize`` with a float8
dtype (``irgen_onnx.float8``). ONNX Runtime has no float8 compute kernel on the CPU: the tensor
between the two nodes is float8, the ops around them run in float. :func:`realize_float8` makes
each ``quantize -> dequantize`` pair one layer (op ``quantize``, ``kind: "float8"``, ``"realization":
"float"``) computing ``float32(float8(x / scale)) * scale``: ``x / scale`` in float32, rounded to
the nearest float8 value, ties to even, clamped to the largest finite value first (ONNX's
``saturate=1``; NaN stays NaN), then dequantized. Its output is the float32 value the next op reads
(ONNX Runtime's DequantizeLinear output); the float8 value is that divided by the scale, exactly.
A TIR kernel computes it on the float32 bits; :func:`recompute_float8` recomputes it with ml_dtypes.
Per-tensor scales only; a float8 tensor the model returns without dequantizing it is refused.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import numpy as np

from irgen.plugin import IrgenError

from .common import SCHEME, _ops

#: float8 dtype -> (mantissa bits, smallest normal exponent, largest finite value)
FORMATS = {"float8_e4m3fn": (3, -6, 448.0), "float8_e5m2": (2, -14, 57344.0)}


def _kernel(size: int, scale: float, dtype: str):
    """The TIR kernel of ``float32(float8(x / scale)) * scale`` on ``size`` values (module text)."""
    from tvm.script import tirx as T

    mbits, emin, top = FORMATS[dtype]

    @T.prim_func(private=True, s_tir=True)
    def kernel(x: T.Buffer((T.int64(size),), "float32", layout=None),
               y: T.Buffer((T.int64(size),), "float32", layout=None)):
        with T.sblock("root"):
            for i in T.parallel(size):
                v = x[i] / T.float32(scale)
                a = T.Select(T.fabs(v) > T.float32(top), T.float32(top), T.fabs(v))  # saturate; NaN stays
                e = T.max(T.Cast("int32", T.shift_right(T.reinterpret("uint32", a), T.uint32(23))) - 127, emin)
                quantum = T.reinterpret("float32", T.Cast("uint32", T.shift_left(e - mbits + 127, 23)))
                r = T.nearbyint(a / quantum) * quantum
                y[i] = T.Select(v < T.float32(0), -r, r) * T.float32(scale)

    return kernel


def _pair(qg, dq) -> tuple[Any, dict[str, Any]] | None:
    """The float8 quantize ``dq`` dequantizes, and its parameters, or None."""
    relax = _ops()[0]
    qb = qg.producer(dq.value.args[0])
    if qb is None or qb.op != "relax.quantize" or str(qb.value.attrs.out_dtype) not in FORMATS:
        return None
    s_q, s_dq = (getattr(b.value.args[1], "value", None) for b in (qb, dq))
    vals = [s.numpy() for s in (s_q, s_dq) if s is not None]
    if len(vals) != 2 or vals[0].size != 1 or vals[1].size != 1 or vals[0].reshape(()) != vals[1].reshape(()):
        raise IrgenError(f"{SCHEME}: float8 quantize at tensor {qb.name!r}: only one constant per-tensor scale, the "
                         f"same in its dequantize, is supported")
    if not isinstance(qb.value.args[0], relax.Var):
        return None
    return qb, {"dtype": str(qb.value.attrs.out_dtype), "scale": float(np.float32(vals[0].reshape(())))}


def realize_float8(qg) -> int:
    """Every float8 ``quantize -> dequantize`` pair as one layer (module text); how many."""
    from .tidy import drop_dead

    relax, op, q, _ = _ops()
    done = 0
    for dq in [b for b in qg.bindings if b.op == "relax.dequantize"]:
        found = _pair(qg, dq)
        if found is None:
            continue
        qb, p = found
        x = qb.value.args[0]
        shape = [int(d) for d in x.ty.shape.values]
        size = int(np.prod(shape))
        mbits, emin, top = FORMATS[p["dtype"]]
        rule = (f"float32(float8(x / scale)) * scale: x / scale in float32, |.| clamped to {top:g} (saturate), "
                f"rounded to the nearest {p['dtype']} value (ties to even; {mbits} mantissa bits, exponent >= {emin})")
        attrs = {"out_dtype": p["dtype"], "scale": p["scale"], "saturate": True, "dequantize": True,
                 "rule": rule}
        digest = hashlib.sha256(json.dumps([size, attrs], sort_keys=True).encode()).hexdigest()[:12]
        gv = qg.add_kernel(_kernel(size, p["scale"], p["dtype"]), f"float8_qdq_{digest}", "relax.quantize", attrs)
        flat = qg.emit(op.reshape(x, [size]))
        y = qg.emit(relax.call_tir(gv, relax.Tuple([flat]), relax.TensorType([size], "float32")))
        rec = {"scheme": SCHEME, "kind": "float8", "realization": "float", "op": "quantize",
               "inputs": [q.float_record()], "output": q.float_record(),
               "float8": {"dtype": p["dtype"], "scale": p["scale"], "zero_point": 0.0, "saturate": True,
                          "rule": rule}}
        qg.replace([dq.name], op.reshape(y, shape), rec)
        done += 1
    if done:
        dead = {b.name for b in qg.bindings if b.op == "relax.quantize" and qg.n_users(b.name) == 0
                and str(b.value.attrs.out_dtype) in FORMATS}
        qg.bindings = [b for b in qg.bindings if b.name not in dead]
        qg._index()
        drop_dead(qg)
        realize_float_matmuls(qg)
    left = [b.name for b in qg.bindings if b.op == "relax.quantize" and str(b.value.attrs.out_dtype) in FORMATS]
    read = [b.name for b in qg.bindings if b.op == "relax.dequantize"
            and str(getattr(b.value.args[0].ty, "dtype", "")) in FORMATS]
    if read:
        raise IrgenError(f"{SCHEME}: dequantize at tensor {read[0]!r} reads a float8 tensor no float8 quantize of the "
                         f"model gives (a float8 model input); not supported")
    if left:
        raise IrgenError(f"{SCHEME}: float8 quantize at tensor {left[0]!r} is not dequantized by the model; "
                         f"a float8 result is not supported")
    return done


def _sgemm_kernel(mrows: int, k: int, n: int, block: int):
    """The TIR kernel of ``x [mrows, k] @ w [k, n]`` in MLAS's SGEMM order: per output, fused
    multiply-adds from zero over each slice of ``block`` values of k, the slices added in order."""
    from tvm.script import tirx as T

    nblocks = (k + block - 1) // block

    @T.prim_func(private=True, s_tir=True)
    def kernel(x: T.Buffer((T.int64(mrows), T.int64(k)), "float32", layout=None),
               w: T.Buffer((T.int64(k), T.int64(n)), "float32", layout=None),
               y: T.Buffer((T.int64(mrows), T.int64(n)), "float32", layout=None)):
        with T.sblock("root"):
            part = T.sblock_alloc_buffer((1,), "float32", scope="local")
            for i in T.parallel(mrows):
                for j in range(n):
                    for kb in range(nblocks):
                        part[0] = T.float32(0)
                        for kr in range(T.min(block, k - kb * block)):
                            part[0] = T.call_llvm_pure_intrin("float32", "llvm.fma", x[i, kb * block + kr],
                                                              w[kb * block + kr, j], part[0])
                        if kb == 0:
                            y[i, j] = part[0]
                        else:
                            y[i, j] = y[i, j] + part[0]

    return kernel


def _sgemm_bias_kernel(mrows: int, k: int, n: int, block: int):
    """:func:`_sgemm_kernel` from a Gemm's bias ``c [n]``: MLAS's output before the sums (beta = 1),
    each slice's sum added to it in order."""
    from tvm.script import tirx as T

    nblocks = (k + block - 1) // block

    @T.prim_func(private=True, s_tir=True)
    def kernel(x: T.Buffer((T.int64(mrows), T.int64(k)), "float32", layout=None),
               w: T.Buffer((T.int64(k), T.int64(n)), "float32", layout=None),
               c: T.Buffer((T.int64(n),), "float32", layout=None),
               y: T.Buffer((T.int64(mrows), T.int64(n)), "float32", layout=None)):
        with T.sblock("root"):
            part = T.sblock_alloc_buffer((1,), "float32", scope="local")
            for i in T.parallel(mrows):
                for j in range(n):
                    y[i, j] = c[j]
                    for kb in range(nblocks):
                        part[0] = T.float32(0)
                        for kr in range(T.min(block, k - kb * block)):
                            part[0] = T.call_llvm_pure_intrin("float32", "llvm.fma", x[i, kb * block + kr],
                                                              w[kb * block + kr, j], part[0])
                        y[i, j] = part[0] + y[i, j]

    return kernel


def _gemm_bias(qg, b, n: int):
    """The bias a Gemm adds to the matmul ``b`` (its product, no tensor of the model), as ``(the add's
    binding, float32 [n])``, or None. ONNX Runtime's Gemm copies the bias into its output and runs
    MLAS's SGEMM with beta = 1: the sums start from the bias (a beta other than 1 is a multiply
    the add reads, not a constant: not taken)."""
    relax, _, _, Constant = _ops()
    users = qg.users.get(b.name, [])
    if len(users) != 1 or qg.n_users(b.name) != 1 or b.name in qg.source_ops:
        return None
    u = qg.bindings[users[0]]
    if u.op != "relax.add" or qg.source_ops.get(u.name) != "Gemm":
        return None
    y, c = u.value.args
    if not isinstance(y, relax.Var) or y.name != b.name or not isinstance(c, Constant):
        return None
    bias = c.value.numpy()
    if bias.dtype != np.float32 or bias.size not in (1, n) or bias.ndim > 2 or bias.ndim == 2 and bias.shape[0] != 1:
        return None
    return u, np.ascontiguousarray(np.broadcast_to(bias.reshape(-1), (n,)))


def _constant_weight(qg, w):
    """A matmul's weight operand as a float32 ``[K, N]`` array: a constant, or the transpose of one
    (a ``permute_dims`` only the matmul reads). Returns ``(array, transposed, the permute's binding
    name or None)``, or None. ``transposed``: MLAS reads B transposed, a Gemm's ``transB`` (a
    permute inside the node); a Transpose node's tensor (``irgen verify`` asks for it, so ONNX
    Runtime cannot fuse it into the MatMul) is B as is."""
    relax, _, _, Constant = _ops()
    if isinstance(w, Constant):
        return w.value.numpy(), False, None
    pb = qg.producer(w) if isinstance(w, relax.Var) else None
    if pb is None or pb.op != "relax.permute_dims" or not isinstance(pb.value.args[0], Constant) \
            or qg.n_users(pb.name) != 1 or pb.value.args[0].value.numpy().ndim != 2 \
            or (pb.value.attrs.axes is not None and [int(a) for a in pb.value.attrs.axes] != [1, 0]):
        return None
    return np.ascontiguousarray(pb.value.args[0].value.numpy().T), pb.name not in qg.source_ops, pb.name


def realize_float_matmuls(qg) -> int:
    """In a float8 model, every float MatMul of a float32 activation by a constant 2-D float32 weight
    (a folded float8 weight; or its transpose, a Gemm's ``transB``) in MLAS's SGEMM order (ONNX
    Runtime runs it so: no float8 kernel), ``kind: "float_dense"``; how many. K slices:
    :func:`irgen_qdq.mlas.k_block`; one row or one column: MLAS's one-row kernels
    (:mod:`irgen_qdq.sgemm_m1`). A Gemm's bias is where the sums start (:func:`_gemm_bias`)."""
    from . import sgemm_m1
    from .mlas import k_block

    relax, op, q, Constant = _ops()
    done = 0
    for b in list(qg.bindings):
        if b.op != "relax.matmul" or not isinstance(b.value.args[0], relax.Var):
            continue
        found = _constant_weight(qg, b.value.args[1])
        x = b.value.args[0]
        if found is None or found[0].dtype != np.float32 or str(x.ty.dtype) != "float32" or x.ty.shape is None:
            continue
        w, trans_b, perm = found
        xshape = [int(d) for d in x.ty.shape.values]
        k, n = w.shape
        mrows = int(np.prod(xshape[:-1])) if len(xshape) > 1 else 1
        acc = sgemm_m1.accumulation(mrows, n, trans_b, "MLAS SGEMM") or \
            {"dtype": "float32", "fma": True, "order": "k", "k_block": k_block(n, k),
             "rule": "per output: fused multiply-adds over k from zero in blocks of k_block, the blocks added "
                     "in order in float32 (MLAS SGEMM)"}
        gemm = _gemm_bias(qg, b, n) if acc["order"] in ("k", "groups4") else None  # lanes8: the bias after
        if gemm is not None:
            acc = {**acc, "initial": "bias", "rule": acc["rule"] + "; the output starts at the bias (a Gemm's C, "
                                                                   "MLAS's beta = 1), not at zero"}
        roles = ["input", "weight", *(["bias"] if gemm else [])]
        attrs = {"out_dtype": "float32", "accumulation": acc, "arg_roles": roles}
        digest = hashlib.sha256(json.dumps([mrows, k, n, attrs], sort_keys=True).encode()).hexdigest()[:12]
        func = (_sgemm_bias_kernel if gemm else _sgemm_kernel)(mrows, k, n, acc["k_block"]) \
            if acc["order"] == "k" else sgemm_m1.float_kernel(mrows, k, n, acc)
        gv = qg.add_kernel(func, f"sgemm_{digest}", "relax.matmul", attrs)
        x2 = x if len(xshape) == 2 else qg.emit(op.reshape(x, [mrows, k]))
        args = [x2, relax.const(w), *([relax.const(gemm[1])] if gemm else [])]
        call = relax.call_tir(gv, relax.Tuple(args), relax.TensorType([mrows, n], "float32"))
        expr = call if len(xshape) == 2 else op.reshape(qg.emit(call), [*xshape[:-1], n])
        rec = {"scheme": SCHEME, "kind": "float_dense", "realization": "float", "op": "dense",
               "inputs": [q.float_record()], "output": q.float_record(), "accumulation": acc}
        qg.replace([*([perm] if perm else []), b.name, *([gemm[0].name] if gemm else [])], expr, rec)
        done += 1
    return done


def recompute_float_dense(layer: dict, inputs: list, params: dict) -> np.ndarray:
    """A ``float_dense`` layer: its ``fused_ops``, the matmul in the record's ``accumulation`` order
    (its kernel's attributes), then what the layer fused after it (a Gemm's bias ``add``)."""
    from irgen.plugin import run_layer

    return run_layer(layer, inputs, params)[0]


def float8_qdq(x: np.ndarray, scale: float, dtype: str) -> np.ndarray:
    """``float32(float8(x / scale)) * scale`` with ml_dtypes' rounding (ties to even), saturating."""
    import ml_dtypes

    top = FORMATS[dtype][2]
    v = np.asarray(x, np.float32) / np.float32(scale)
    v = np.where(np.abs(v) > top, np.copysign(np.float32(top), v), v).astype(np.float32)
    return (v.astype(getattr(ml_dtypes, dtype)).astype(np.float32) * np.float32(scale)).astype(np.float32)


def recompute_float8(layer: dict, inputs: list, params: dict) -> np.ndarray:
    """A ``float8`` layer from its record."""
    f = layer["quant"]["float8"]
    return float8_qdq(inputs[0], f["scale"], f["dtype"])
