"""A float SGEMM of one row (M = 1), or of one column (N = 1), as ONNX Runtime's MLAS computes it.

``MlasSgemmOperation`` gives a product of one row (``M == 1``, A not transposed, alpha 1, beta 0
or 1) on x86-64 to the platform's ``KernelM1Routine`` (B not transposed) or
``KernelM1TransposeBRoutine`` (B transposed: a Gemm's ``transB``), not to its blocked SGEMM
kernel (K slices, fused multiply-adds: :mod:`irgen_qdq.mlas`); a product of one column (``N ==
1``, B not transposed) to ``KernelM1TransposeBRoutine`` with A and B swapped. Every x86-64 CPU
with AVX gets the same two routines, ``MlasSgemmKernelM1Avx`` and
``MlasSgemmKernelM1TransposeBAvx`` (``platform.cpp`` sets no FMA3 or AVX-512 variant of them);
both round each product and each sum to float32 (``vmulps``, ``vaddps``: no fused multiply-add):

* ``order: "groups4"`` (``MlasSgemmKernelM1Avx``): per output column, for each group of four
  rows of B (four consecutive k), ``((p0 + p1) + p2) + p3``, added to the output (zero at
  first); the last ``K % 4`` rows as a group of two, then one.
* ``order: "lanes8"`` (``MlasSgemmKernelM1TransposeBAvx``): per output, eight partial sums, the
  product of element k added to lane ``k % 8`` (from zero, in k order), folded by the output's
  place: the outputs run in groups of four (``(((l0 + l1) + l2) + l3) + (((l4 + l5) + l6) +
  l7)``), then the last ``R % 4`` as a pair (``((l0 + l2) + (l4 + l6)) + ((l1 + l3) + (l5 +
  l7))``), then one (``((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7))``); ``R`` is the number
  of outputs (N for one row, M for one column). The fold is then added to the output (zero, or
  a Gemm's bias: the same as adding the bias after).

With one intra-op thread (``irgen verify``) MLAS runs the whole product so; more threads split
one row's columns (the same order) or one column's rows (another fold). A CPU without AVX
(SSE2 only) has neither routine and runs the blocked SGEMM.

:func:`accumulation` is the layer's record (recomputed by ``irgen.reference.matmul_groups4`` /
``matmul_lanes8``); :func:`float_kernel` the TIR kernel of a float32 weight (the kernels of a
4-bit block weight, dequantized on the fly, are in :mod:`irgen_qdq.blockwise`). TVM compiles
kernels without fused multiply-add (``irgen.target``): a multiply then an add rounds twice, as
``vmulps``/``vaddps`` do.
"""

from __future__ import annotations

from typing import Any

def accumulation(mrows: int, n: int, trans_b: bool, how: str) -> dict[str, Any] | None:
    """The ``accumulation`` record MLAS's one-row / one-column kernels give an SGEMM of ``mrows``
    rows of A by a ``[K, n]`` weight (``trans_b``: stored ``[n, K]``, a Gemm's ``transB``), or
    None where its blocked SGEMM runs it (``how``: what runs it, for the rule)."""
    if mrows == 1 and not trans_b:
        return {"dtype": "float32", "fma": False, "order": "groups4", "group": 4,
                "rule": "per output, from zero: the products of each group of four consecutive k (then one group "
                        "of two, then one, for the last K % 4) summed as ((p0 + p1) + p2) + p3, each product and "
                        "each sum rounded to float32, the group's sum added to the output in float32 "
                        f"({how}: MLAS's one-row SGEMM kernel, MlasSgemmKernelM1Avx)"}
    if mrows == 1 or n == 1 and not trans_b:
        return {"dtype": "float32", "fma": False, "order": "lanes8", "lanes": 8,
                "rule": "per output: 8 partial sums from zero, the product of element k added to lane k % 8, each "
                        "product and each sum rounded to float32; the outputs (along N for one row, along M for "
                        "one column) folded in whole groups of four as (((l0+l1)+l2)+l3)+(((l4+l5)+l6)+l7), the "
                        "next two (of the last R % 4) as ((l0+l2)+(l4+l6))+((l1+l3)+(l5+l7)), a last one as "
                        f"((l0+l1)+(l2+l3))+((l4+l5)+(l6+l7)) ({how}: MLAS's MlasSgemmKernelM1TransposeBAvx)"}
    return None


def groups(k: int) -> tuple[int, int, int]:
    """``(groups of four, groups of two, single rows)`` of a depth ``k``: ``k // 4``, then the rest."""
    return k // 4, k % 4 // 2, k % 2


def folds(outputs: int) -> tuple[int, int]:
    """Where the ``lanes8`` folds change: the outputs before the first index are in groups of
    four, those before the second in a pair, a last one alone."""
    four = outputs - outputs % 4
    return four, four + (outputs % 4 & 2)


def lanes8_fold(outputs: int):
    """TIR macro ``fold(y, a, r, c, place)``: ``y[r, c]`` = the 8 lanes ``a`` folded as the
    ``lanes8`` order folds the output at ``place`` among ``outputs`` (:func:`folds`)."""
    from tvm.script import tirx as T

    four, two = folds(outputs)

    @T.macro
    def fold(y, a, r, c, place):
        if place < four:
            y[r, c] = (((a[0] + a[1]) + a[2]) + a[3]) + (((a[4] + a[5]) + a[6]) + a[7])
        elif place < two:
            y[r, c] = ((a[0] + a[2]) + (a[4] + a[6])) + ((a[1] + a[3]) + (a[5] + a[7]))
        else:
            y[r, c] = ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7]))

    return fold


def _groups4_float(mrows: int, k: int, n: int, bias: bool = False):
    """The TIR kernel of ``x [1, k] @ w [k, n]`` in the ``groups4`` order (module text); with
    ``bias`` (a Gemm's: MLAS's output before the sums, beta = 1) a buffer ``c [n]`` the sums
    start from."""
    from tvm.script import tirx as T

    g4, g2, g1 = groups(k)
    t2, t1 = 4 * g4, 4 * g4 + 2 * g2  # the first k of the group of two, of the single row

    @T.macro
    def sums(x, w, acc, j):
        for g in range(g4):
            acc[0] = (((x[0, 4 * g] * w[4 * g, j] + x[0, 4 * g + 1] * w[4 * g + 1, j])
                       + x[0, 4 * g + 2] * w[4 * g + 2, j]) + x[0, 4 * g + 3] * w[4 * g + 3, j]) + acc[0]
        for _ in range(g2):
            acc[0] = (x[0, t2] * w[t2, j] + x[0, t2 + 1] * w[t2 + 1, j]) + acc[0]
        for _ in range(g1):
            acc[0] = x[0, t1] * w[t1, j] + acc[0]

    @T.prim_func(private=True, s_tir=True)
    def plain(x: T.Buffer((T.int64(1), T.int64(k)), "float32", layout=None),
              w: T.Buffer((T.int64(k), T.int64(n)), "float32", layout=None),
              y: T.Buffer((T.int64(1), T.int64(n)), "float32", layout=None)):
        with T.sblock("root"):
            acc = T.sblock_alloc_buffer((1,), "float32", scope="local")
            for j in T.parallel(n):
                acc[0] = T.float32(0)
                sums(x, w, acc, j)
                y[0, j] = acc[0]

    @T.prim_func(private=True, s_tir=True)
    def with_bias(x: T.Buffer((T.int64(1), T.int64(k)), "float32", layout=None),
                  w: T.Buffer((T.int64(k), T.int64(n)), "float32", layout=None),
                  c: T.Buffer((T.int64(n),), "float32", layout=None),
                  y: T.Buffer((T.int64(1), T.int64(n)), "float32", layout=None)):
        with T.sblock("root"):
            acc = T.sblock_alloc_buffer((1,), "float32", scope="local")
            for j in T.parallel(n):
                acc[0] = c[j]
                sums(x, w, acc, j)
                y[0, j] = acc[0]

    return with_bias if bias else plain


def _lanes8_float(mrows: int, k: int, n: int):
    """The TIR kernel of ``x [mrows, k] @ w [k, n]`` (``mrows`` or ``n`` is 1) in the ``lanes8``
    order: output ``o``'s place among the outputs is ``o % n + o // n`` (one of them is 0)."""
    from tvm.script import tirx as T

    fold = lanes8_fold(max(mrows, n))

    @T.prim_func(private=True, s_tir=True)
    def kernel(x: T.Buffer((T.int64(mrows), T.int64(k)), "float32", layout=None),
               w: T.Buffer((T.int64(k), T.int64(n)), "float32", layout=None),
               y: T.Buffer((T.int64(mrows), T.int64(n)), "float32", layout=None)):
        with T.sblock("root"):
            a = T.sblock_alloc_buffer((8,), "float32", scope="local")
            for o in T.parallel(mrows * n):
                for lane in range(8):
                    a[lane] = T.float32(0)
                for kk in range(k):
                    a[kk % 8] = a[kk % 8] + x[o // n, kk] * w[kk, o % n]
                fold(y, a, o // n, o % n, o % n + o // n)

    return kernel


#: ``accumulation["order"]`` -> the TIR kernel ``(mrows, k, n)`` of a float32 weight ``[k, n]``
FLOAT_KERNELS = {"groups4": _groups4_float, "lanes8": _lanes8_float}


def float_kernel(mrows: int, k: int, n: int, acc: dict[str, Any]):
    """The TIR kernel of ``x [mrows, k] @ w [k, n]`` in the order ``acc`` (:func:`accumulation`) records
    (``groups4`` from a bias: ``acc["initial"]``)."""
    if acc.get("initial"):
        return _groups4_float(mrows, k, n, bias=True)
    return FLOAT_KERNELS[acc["order"]](mrows, k, n)
