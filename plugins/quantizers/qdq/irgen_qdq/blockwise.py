"""Weight-only layers of block-wise 4-bit weights, as ONNX Runtime computes them.

The ONNX frontend turns ``com.microsoft.MatMulNBits`` and an opset-21 block ``DequantizeLinear``
of an INT4/UINT4 weight into a recognizable dequantize of the blocks (``irgen_onnx.nbits``):

    dequantize(values [rows * blocks, block_size], scale [rows * blocks], zero_point, axis=0)
      -> reshape [rows, blocks * block_size] -> (strided_slice) -> (permute_dims) -> matmul(x, .)

with uint8 values and zero points for UINT4, int8 for INT4. :func:`realize_blockwise` folds such
a chain into one layer, ``kind: "weight_only"``, ``"realization": "float"``, whose parameters are
the weights packed as a backend stores them (``weight``: uint8 ``[rows, blocks, block_size / 2]``,
two 4-bit values per byte, the even element in the low nibble, the odd one in the high nibble,
INT4 as two's complement; MatMulNBits' own ``B`` layout), the per-block ``scale`` (float32
``[rows, blocks]``) and ``zero_point`` (``[rows, blocks]``, the weight's signedness, not packed;
MatMulNBits without zero points: 8). ``rows`` is the weight's axis that is not blocked.

The activation stays float: ONNX Runtime runs such a MatMul in float32 on the dequantized
weights, ``float32(q - zero_point) * scale``. Its order of the sums is part of the record
(``accumulation``): MatMulNBits at accuracy level 0-3 on a float32 input (and a block
DequantizeLinear along K into a MatMul, which ONNX Runtime rewrites into one) dequantizes B and
runs one SGEMM pass over all of K, a chain of fused multiply-adds from zero per output
(``k_block`` = K); on one row (M = 1) it takes MLAS's AVX-512 vector kernel instead (``order:
"lanes16"``: 16 chains, element k in lane k % 16, folded as ``FoldAccumulators`` /
``_mm512_reduce_add_ps``); other layouts run MLAS's SGEMM on the dequantized weights, K sliced as
:func:`irgen_qdq.mlas.k_block` says, or on one row (one column) its one-row kernels (``order: "groups4"``, ``"lanes8"``:
:mod:`irgen_qdq.sgemm_m1`). The TIR kernels compute that order;
:func:`recompute_weight_only` recomputes it in numpy from the record and the parameters
(``irgen.reference.matmul_block_weight``).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import numpy as np

from . import sgemm_m1
from .common import SCHEME, _ops
from .mlas import k_block

_CHAIN = ("relax.permute_dims", "relax.strided_slice", "relax.reshape")
PACKING = ("uint8 [rows, blocks, block_size/2]: byte j of a block holds element 2j in bits 0-3 and element 2j+1 "
           "in bits 4-7 (int4: two's complement); rows: the weight's axis that is not blocked")


def _const(qg, expr):
    Constant = _ops()[3]
    return expr.value.numpy() if isinstance(expr, Constant) else None


def _single_use(qg, b) -> bool:
    return qg.n_users(b.name) == 1


def _blocks(qg, mm) -> dict[str, Any] | None:
    """The chain from a 4-bit block dequantize to the weight ``mm`` reads, described, or None."""
    relax = _ops()[0]
    w = mm.value.args[1]
    names, steps = [], {}
    b = qg.producer(w)
    while b is not None and b.op in _CHAIN and b.op not in steps and _single_use(qg, b):
        steps[b.op] = b
        names.append(b.name)
        b = qg.producer(b.value.args[0])
    if b is None or b.op != "relax.dequantize" or "relax.reshape" not in steps or not _single_use(qg, b):
        return None
    vals, scale, zp = (_const(qg, a) for a in b.value.args[:3])
    if vals is None or scale is None or zp is None or vals.ndim != 2 or int(b.value.attrs.axis) != 0 \
            or vals.dtype not in (np.int8, np.uint8) or scale.dtype != np.float32 or scale.shape != (vals.shape[0],):
        return None
    signed = vals.dtype == np.int8
    lo, hi = (-8, 7) if signed else (0, 15)
    if vals.size and (vals.min() < lo or vals.max() > hi) or vals.shape[1] % 2 or zp.shape not in ((), scale.shape):
        return None
    shape = [int(d) for d in steps["relax.reshape"].value.ty.shape.values]
    perm = steps.get("relax.permute_dims")
    axes = [int(a) for a in perm.value.attrs.axes] if perm is not None else [1, 0]
    if len(shape) != 2 or vals.shape[0] % shape[0] or axes != [1, 0]:
        return None
    x = mm.value.args[0]
    src = qg.producer(x)
    if not isinstance(x, relax.Var) or (src is not None and src.op == "relax.dequantize") \
            or str(x.ty.dtype) != "float32" or x.ty.shape is None:
        return None  # a quantized activation: a span of the DQ -> MatMul -> Q kind (its weight folded)
    rows = shape[0]
    nb, bs = vals.shape[0] // rows, vals.shape[1]
    wshape = [int(d) for d in w.ty.shape.values]
    axis = 0 if perm is not None else 1
    length = wshape[axis]
    return {"names": [b.name, *reversed(names)], "x": x, "signed": signed, "rows": rows, "blocks": nb,
            "block_size": bs, "length": length, "axis": axis, "shape": wshape,
            "values": vals.reshape(rows, nb, bs), "scale": scale.reshape(rows, nb),
            "zero_point": np.broadcast_to(zp, scale.shape).reshape(rows, nb)}


def pack(values: np.ndarray) -> np.ndarray:
    """4-bit ``values`` ``[..., 2j]`` as bytes: element 2j in the low nibble, 2j+1 in the high one."""
    v = np.asarray(values).astype(np.int64) & 15
    return (v[..., 0::2] | (v[..., 1::2] << 4)).astype(np.uint8)


def unpack(packed: np.ndarray, signed: bool) -> np.ndarray:
    """The 4-bit values of :func:`pack`'s bytes (int64), sign-extended for ``signed``."""
    p = np.asarray(packed, np.uint8).astype(np.int64)
    v = np.stack([p & 15, p >> 4], -1).reshape(*p.shape[:-1], -1)
    return np.where(v >= 8, v - 16, v) if signed else v


def dequantized(weight: dict, packed: np.ndarray, scale: np.ndarray, zero_point: np.ndarray) -> np.ndarray:
    """The float32 weight ``[K, N]`` the matmul reads: ``float32(q - zero_point) * scale`` per block."""
    q = unpack(packed, weight["dtype"] == "int4")  # rows x blocks x block_size
    w = ((q - np.asarray(zero_point, np.int64)[..., None]).astype(np.float32)
         * np.asarray(scale, np.float32)[..., None]).astype(np.float32)
    w = w.reshape(w.shape[0], -1)[:, :int(weight["length"])]
    return np.ascontiguousarray(w.T if int(weight["axis"]) == 0 else w)


def _accumulation(m: dict, mrows: int, k: int, n: int) -> dict[str, Any]:
    """The float32 order of the sums, as ONNX Runtime takes it (module text)."""
    nbits = m["axis"] == 0 and m["block_size"] >= 16 and not m["block_size"] & (m["block_size"] - 1)
    if nbits and mrows == 1:
        return {"dtype": "float32", "fma": True, "order": "lanes16", "lanes": 16,
                "rule": "per output: 16 chains of fused multiply-adds from zero, element k into lane k % 16, "
                        "folded in float32: the columns in whole groups of four as ((a0+a1)+a2)+a3 per four lanes, "
                        "(g0+g2)+(g1+g3); the last N % 4 columns as h_i = a_i + a_(i+8), t_i = h_i + h_(i+4), "
                        "(t0+t2)+(t1+t3) (MatMulNBits CompFp32, one row: MLAS's AVX-512 vector kernel)"}
    one = None if nbits else sgemm_m1.accumulation(mrows, n, False, "MLAS SGEMM on the dequantized weights")
    if one is not None:  # MLAS's SGEMM of one row or one column
        return one
    block = k if nbits else k_block(n, k)
    how = ("MatMulNBits (CompFp32): B dequantized, one SGEMM pass over K" if nbits
           else "MLAS SGEMM on the dequantized weights, K in slices")
    return {"dtype": "float32", "fma": True, "order": "k", "k_block": block,
            "rule": f"per output: fused multiply-adds over k from zero in blocks of k_block, the blocks added in "
                    f"order in float32 ({how})"}


def _weight_value(wp, s, z, r, e, bs: int, sg: int):
    """TIR: the dequantized weight at row ``r``, element ``e`` of its blocked axis."""
    from tvm.script import tirx as T

    byte = T.Cast("int32", wp[r, e // bs, (e % bs) // 2])
    nib = T.bitwise_and(T.shift_right(byte, (e % 2) * 4), 15)
    v = nib - T.Cast("int32", nib >= 8) * sg
    return T.Cast("float32", v - T.Cast("int32", z[r, e // bs])) * s[r, e // bs]


def _kernel(mrows: int, k: int, n: int, m: dict, acc: dict):
    """The TIR kernel: ``y[i, j] = sum_k x[i, k] * w[k, j]``, ``w`` unpacked and dequantized on the fly."""
    from tvm.script import tirx as T

    rows, nb, bs = m["rows"], m["blocks"], m["block_size"]
    half, a0, sg = bs // 2, int(m["axis"] == 0), 16 if m["signed"] else 0
    zdt = "int8" if m["signed"] else "uint8"
    block = int(acc["k_block"])
    nblocks = (k + block - 1) // block

    @T.prim_func(private=True, s_tir=True)
    def kernel(x: T.Buffer((T.int64(mrows), T.int64(k)), "float32", layout=None),
               wp: T.Buffer((T.int64(rows), T.int64(nb), T.int64(half)), "uint8", layout=None),
               s: T.Buffer((T.int64(rows), T.int64(nb)), "float32", layout=None),
               z: T.Buffer((T.int64(rows), T.int64(nb)), zdt, layout=None),
               y: T.Buffer((T.int64(mrows), T.int64(n)), "float32", layout=None)):
        with T.sblock("root"):
            part = T.sblock_alloc_buffer((1,), "float32", scope="local")
            for i in T.parallel(mrows):
                for j in range(n):
                    for kb in range(nblocks):
                        part[0] = T.float32(0)
                        for kr in range(T.min(block, k - kb * block)):
                            kk = kb * block + kr
                            # the row: N when blocked along K, else K
                            wv = _weight_value(wp, s, z, j * a0 + kk * (1 - a0), kk * a0 + j * (1 - a0), bs, sg)
                            part[0] = T.call_llvm_pure_intrin("float32", "llvm.fma", x[i, kk], wv, part[0])
                        if kb == 0:
                            y[i, j] = part[0]
                        else:
                            y[i, j] = y[i, j] + part[0]

    return kernel


def _kernel_lanes16(k: int, n: int, m: dict):
    """The TIR kernel of one row in the ``lanes16`` order (:func:`_accumulation`); blocked along K."""
    from tvm.script import tirx as T

    rows, nb, bs = m["rows"], m["blocks"], m["block_size"]
    half, sg = bs // 2, 16 if m["signed"] else 0
    zdt = "int8" if m["signed"] else "uint8"
    full = n - n % 4

    @T.prim_func(private=True, s_tir=True)
    def kernel(x: T.Buffer((T.int64(1), T.int64(k)), "float32", layout=None),
               wp: T.Buffer((T.int64(rows), T.int64(nb), T.int64(half)), "uint8", layout=None),
               s: T.Buffer((T.int64(rows), T.int64(nb)), "float32", layout=None),
               z: T.Buffer((T.int64(rows), T.int64(nb)), zdt, layout=None),
               y: T.Buffer((T.int64(1), T.int64(n)), "float32", layout=None)):
        with T.sblock("root"):
            a = T.sblock_alloc_buffer((16,), "float32", scope="local")
            for j in T.parallel(n):
                for lane in range(16):
                    a[lane] = T.float32(0)
                for kk in range(k):
                    a[kk % 16] = T.call_llvm_pure_intrin("float32", "llvm.fma", x[0, kk],
                                                         _weight_value(wp, s, z, j, kk, bs, sg), a[kk % 16])
                if j < full:
                    y[0, j] = ((((a[0] + a[1]) + a[2]) + a[3]) + (((a[8] + a[9]) + a[10]) + a[11])) \
                        + ((((a[4] + a[5]) + a[6]) + a[7]) + (((a[12] + a[13]) + a[14]) + a[15]))
                else:
                    y[0, j] = (((a[0] + a[8]) + (a[4] + a[12])) + ((a[2] + a[10]) + (a[6] + a[14]))) \
                        + (((a[1] + a[9]) + (a[5] + a[13])) + ((a[3] + a[11]) + (a[7] + a[15])))

    return kernel


def _kernel_groups4(k: int, n: int, m: dict):
    """The TIR kernel of one row in the ``groups4`` order (:mod:`irgen_qdq.sgemm_m1`): the products
    and sums rounded one by one, the weight dequantized on the fly; blocked along either axis."""
    from tvm.script import tirx as T

    rows, nb, bs = m["rows"], m["blocks"], m["block_size"]
    half, a0, sg = bs // 2, int(m["axis"] == 0), 16 if m["signed"] else 0
    zdt = "int8" if m["signed"] else "uint8"
    g4, g2, g1 = sgemm_m1.groups(k)
    t2, t1 = 4 * g4, 4 * g4 + 2 * g2  # the first k of the group of two, of the single row

    def wv(wp, s, z, kk, j):  # the row: N when blocked along K, else K
        return _weight_value(wp, s, z, j * a0 + kk * (1 - a0), kk * a0 + j * (1 - a0), bs, sg)

    @T.prim_func(private=True, s_tir=True)
    def kernel(x: T.Buffer((T.int64(1), T.int64(k)), "float32", layout=None),
               wp: T.Buffer((T.int64(rows), T.int64(nb), T.int64(half)), "uint8", layout=None),
               s: T.Buffer((T.int64(rows), T.int64(nb)), "float32", layout=None),
               z: T.Buffer((T.int64(rows), T.int64(nb)), zdt, layout=None),
               y: T.Buffer((T.int64(1), T.int64(n)), "float32", layout=None)):
        with T.sblock("root"):
            c = T.sblock_alloc_buffer((1,), "float32", scope="local")
            for j in T.parallel(n):
                c[0] = T.float32(0)
                for g in range(g4):
                    c[0] = (((x[0, 4 * g] * wv(wp, s, z, 4 * g, j) + x[0, 4 * g + 1] * wv(wp, s, z, 4 * g + 1, j))
                             + x[0, 4 * g + 2] * wv(wp, s, z, 4 * g + 2, j))
                            + x[0, 4 * g + 3] * wv(wp, s, z, 4 * g + 3, j)) + c[0]
                for _ in range(g2):
                    c[0] = (x[0, t2] * wv(wp, s, z, t2, j) + x[0, t2 + 1] * wv(wp, s, z, t2 + 1, j)) + c[0]
                for _ in range(g1):
                    c[0] = x[0, t1] * wv(wp, s, z, t1, j) + c[0]
                y[0, j] = c[0]

    return kernel


def _kernel_lanes8(mrows: int, k: int, n: int, m: dict):
    """The TIR kernel of one row or one column in the ``lanes8`` order (:mod:`irgen_qdq.sgemm_m1`),
    the weight dequantized on the fly; output ``o``'s place is ``o % n + o // n``."""
    from tvm.script import tirx as T

    rows, nb, bs = m["rows"], m["blocks"], m["block_size"]
    half, a0, sg = bs // 2, int(m["axis"] == 0), 16 if m["signed"] else 0
    zdt = "int8" if m["signed"] else "uint8"
    fold = sgemm_m1.lanes8_fold(max(mrows, n))

    @T.prim_func(private=True, s_tir=True)
    def kernel(x: T.Buffer((T.int64(mrows), T.int64(k)), "float32", layout=None),
               wp: T.Buffer((T.int64(rows), T.int64(nb), T.int64(half)), "uint8", layout=None),
               s: T.Buffer((T.int64(rows), T.int64(nb)), "float32", layout=None),
               z: T.Buffer((T.int64(rows), T.int64(nb)), zdt, layout=None),
               y: T.Buffer((T.int64(mrows), T.int64(n)), "float32", layout=None)):
        with T.sblock("root"):
            a = T.sblock_alloc_buffer((8,), "float32", scope="local")
            for o in T.parallel(mrows * n):
                for lane in range(8):
                    a[lane] = T.float32(0)
                for kk in range(k):
                    a[kk % 8] = a[kk % 8] + x[o // n, kk] * _weight_value(
                        wp, s, z, o % n * a0 + kk * (1 - a0), kk * a0 + o % n * (1 - a0), bs, sg)
                fold(y, a, o // n, o % n, o % n + o // n)

    return kernel


#: ``accumulation["order"]`` -> the TIR kernel ``(mrows, k, n, m, acc)`` computing it
_KERNELS = {
    "k": _kernel,
    "lanes16": lambda mrows, k, n, m, acc: _kernel_lanes16(k, n, m),
    "groups4": lambda mrows, k, n, m, acc: _kernel_groups4(k, n, m),
    "lanes8": lambda mrows, k, n, m, acc: _kernel_lanes8(mrows, k, n, m),
}


def _weight_record(m: dict) -> dict[str, Any]:
    return {"dtype": "int4" if m["signed"] else "uint4", "bits": 4, "block_size": m["block_size"],
            "axis": m["axis"], "rows": m["rows"], "blocks": m["blocks"], "length": m["length"],
            "shape": m["shape"], "packing": PACKING, "data": "param:weight", "scale": "param:scale",
            "zero_point": "param:zero_point", "dequantize": "float32(q - zero_point) * scale"}


def _realize_one(qg, mm, m: dict) -> None:
    """``mm`` and its weight's chain ``m`` replaced by the kernel's call (module text)."""
    relax, op, q, _ = _ops()
    x = m["x"]
    xshape = [int(d) for d in x.ty.shape.values]
    k, n = m["shape"]
    mrows = int(np.prod(xshape[:-1])) if len(xshape) > 1 else 1
    acc = _accumulation(m, mrows, k, n)
    attrs = {"out_dtype": "float32", "weight": _weight_record(m), "accumulation": acc,
             "arg_roles": ["input", "weight", "scale", "zero_point"]}
    digest = hashlib.sha256(json.dumps([mrows, k, n, attrs], sort_keys=True).encode()).hexdigest()[:12]
    func = _KERNELS[acc["order"]](mrows, k, n, m, acc)
    gv = qg.add_kernel(func, f"fma_matmul_4bit_{digest}", "relax.matmul", attrs)
    x2 = x if len(xshape) == 2 else qg.emit(op.reshape(x, [mrows, k]))
    zdt = np.int8 if m["signed"] else np.uint8
    args = [x2, relax.const(pack(m["values"])), relax.const(np.ascontiguousarray(m["scale"], np.float32)),
            relax.const(np.ascontiguousarray(m["zero_point"]).astype(zdt))]
    call = relax.call_tir(gv, relax.Tuple(args), relax.TensorType([mrows, n], "float32"))
    expr = call if len(xshape) == 2 else op.reshape(qg.emit(call), [*xshape[:-1], n])
    rec = {"scheme": SCHEME, "kind": "weight_only", "realization": "float", "op": "dense",
           "inputs": [q.float_record()], "output": q.float_record(), "weight": _weight_record(m),
           "accumulation": acc}
    qg.replace([*m["names"], mm.name], expr, rec)


def realize_blockwise(qg) -> int:
    """Every matmul of a float activation by a 4-bit block weight (module text) realized; how many."""
    done = 0
    for b in list(qg.bindings):
        if b.op != "relax.matmul" or b.name not in qg.by_name:
            continue
        m = _blocks(qg, b)
        if m is not None:
            _realize_one(qg, b, m)
            done += 1
    return done


def recompute_weight_only(layer: dict, inputs: list, params: dict) -> np.ndarray:
    """A ``weight_only`` layer from its record and parameters: the packed weights dequantized per
    block, then the float32 sums in the record's ``accumulation`` order (``irgen.plugin.run_op``
    of the matmul the record describes)."""
    from irgen.plugin import run_op

    qr = layer["quant"]
    args = [inputs[0], params["weight"], params["scale"], params["zero_point"]]
    return run_op("relax.matmul", args, {"weight": qr["weight"], "accumulation": qr["accumulation"]},
                  layer.get("name", "?"))
