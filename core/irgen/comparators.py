"""Comparators: metrics of one tensor against another, knowing nothing of where either came from.

A comparator takes arrays (a device's dump, a numpy recompute, a source runtime's tensor,
the golden file) and returns plain dicts; the runners (:mod:`irgen.runners`) produce the
arrays. ``irgen verify`` and ``irgen compare`` share them:

* :func:`compare`: verify's metric of a recomputed or source tensor against its golden
  file (exact share, max |err|, LSB, cosine, SQNR; pass or fail by :class:`Thresholds`);
* :func:`diff`: compare's verdict on a device tensor (``equal``, ``within``, ``differs``),
  with the count and share of differing elements, the LSB histogram of an integer
  tensor and the ulp distance of a float one;
* :func:`localize`: where a difference lies: which channels, rows, columns and tiles,
  and per-channel and spatial heat maps.

This module imports only numpy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["Thresholds", "compare", "json_num", "status_metric", "diff", "float_close", "ulp_distance", "ulp_verdict",
           "ulp_of_peak", "localize",
           "axis_letters"]


@dataclass
class Thresholds:
    """Pass limits. ``max_lsb`` applies to integer tensors against the source
    runtime (the self-check of integer layers is always exact); ``atol``/``rtol``
    to float tensors (see the module docstring); ``min_cosine``, when set, to
    every float comparison."""

    max_lsb: int = 1
    #: float16/bfloat16 layers against the source runtime, recomputed from its inputs (docs/verify.md)
    max_ulp: int = 4
    atol: float = 1e-5
    rtol: float = 1e-4
    min_cosine: float | None = None
    allow_unsupported: bool = False


def compare(got: np.ndarray, golden: np.ndarray, *, integer: bool, th: Thresholds, scaled: bool = False,
            lsb_limit: int = 0, tensor: str = "", ulp_limit: int | None = None) -> dict[str, Any]:
    """Metrics ``M`` of ``got`` (reference or source runtime) against ``golden``.

    ``integer``: exact compare in units (LSB), passing when the largest
    difference is ``<= lsb_limit``; otherwise the float criterion of the module
    docstring (``scaled`` selects the magnitude-scaled absolute tolerance), or with
    ``ulp_limit`` (a float16/bfloat16 layer's declared arithmetic) :func:`ulp_verdict`.
    """
    got, golden = np.asarray(got), np.asarray(golden)
    m: dict[str, Any] = {"status": "pass", "tensor": tensor, "elements": int(golden.size), "exact_share": 0.0,
                         "max_abs": 0.0, "max_rel": 0.0, "max_lsb": None, "cosine": None, "sqnr_db": None,
                         "exact": False, "message": None}
    if got.shape != golden.shape:
        m.update(status="fail", message=f"shape {list(got.shape)} != golden {list(golden.shape)}")
        return m
    if golden.size == 0:
        m.update(exact_share=1.0, exact=True)
        return m
    if _equal(got, golden):  # the common case, without a float64 copy of either
        return _exact(m, integer, ulp_limit)
    peak, first = _measure(m, got, golden)
    if integer:
        m["max_lsb"] = int(m["max_abs"]) if math.isfinite(m["max_abs"]) else None
        if not m["exact"]:
            m["first_diff"] = [int(i) for i in np.unravel_index(first, golden.shape)]  # where, to look at it
        if not m["exact"] and (m["max_lsb"] is None or m["max_lsb"] > lsb_limit):
            m.update(status="fail", message=f"{(1 - m['exact_share']) * golden.size:.0f} of {golden.size} values differ, "
                                            f"up to {m['max_lsb']} LSB (allowed {lsb_limit}), the first at "
                                            f"{m['first_diff']}")
        return m
    if ulp_limit is not None:
        return ulp_verdict(m, got, golden, None, ulp_limit)
    scale = max(1.0, peak) if scaled else 1.0
    outside = 0 if m["max_abs"] <= th.atol * scale else _outside(got, golden, th.atol * scale, th.rtol)
    if outside:
        m.update(status="fail", message=f"{outside} of {golden.size} values outside "
                                        f"atol={th.atol:g}{'*' + format(scale, '.3g') if scaled else ''} rtol={th.rtol:g}; "
                                        f"max |err| {m['max_abs']:.3g}")
    elif th.min_cosine is not None and m["cosine"] is not None and m["cosine"] < th.min_cosine:
        m.update(status="fail", message=f"cosine {m['cosine']:.6f} < {th.min_cosine}")
    return m


#: elements per slice of :func:`_measure` and :func:`_outside`: a few float64 buffers of this size,
#: reused, instead of a dozen fresh tensor-sized ones (each of those costs its page faults)
_SLICE = 1 << 16


def _slices(got: np.ndarray, golden: np.ndarray):
    """(start, a, b, same, diff, b_abs, fa, fb) per slice of the flattened tensors, in float64:
    ``same`` elementwise equality (NaN equal to NaN), ``diff`` |a - b| (0 where equal, inf where
    one is NaN), ``b_abs`` |b| (NaN as 0), ``fa``/``fb`` the values with NaNs as 0 (for the sums)."""
    ga, gb = got.reshape(-1), golden.reshape(-1)
    for i in range(0, gb.size, _SLICE):
        a = ga[i:i + _SLICE].astype(np.float64)
        b = gb[i:i + _SLICE].astype(np.float64)
        if np.isfinite(a).all() and np.isfinite(b).all():  # the common case: no masks
            yield i, a == b, np.abs(a - b), np.abs(b), a, b
            continue
        nan_a, nan_b = np.isnan(a), np.isnan(b)
        same = (a == b) | (nan_a & nan_b)
        with np.errstate(invalid="ignore"):
            diff = np.where(same, 0.0, np.abs(a - b))
        diff = np.where(np.isnan(diff), np.inf, diff)
        either = nan_a | nan_b
        yield i, same, diff, np.abs(np.where(nan_b, 0.0, b)), np.where(either, 0.0, a), np.where(either, 0.0, b)


def _measure(m: dict[str, Any], got: np.ndarray, golden: np.ndarray) -> tuple[float, int]:
    """Fill ``m``'s exact share, max |err|, max rel, cosine and SQNR of ``got`` against ``golden``
    (in float64; NaN equal to NaN and left out of the sums, a NaN against a number an infinite
    error); return the largest |golden| and the flat index of the first difference (-1: none)."""
    count, first, max_abs, peak, sa, sb, sab, err = 0, -1, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0
    with np.errstate(over="ignore", invalid="ignore"):
        for i, same, diff, b_abs, fa, fb in _slices(got, golden):
            c = int(np.count_nonzero(same))
            if first < 0 and c < same.size:
                first = i + int(np.argmin(same))
            count += c
            max_abs, peak = max(max_abs, float(diff.max())), max(peak, float(b_abs.max()))
            sa, sb, sab = sa + _dot(fa, fa), sb + _dot(fb, fb), sab + _dot(fa, fb)
            finite = diff if math.isfinite(float(diff.max())) else diff[np.isfinite(diff)]
            err += _dot(finite, finite)
    m["exact_share"] = count / golden.size
    m["exact"] = count == golden.size
    m["max_abs"] = max_abs
    m["max_rel"] = float(max_abs / peak) if peak > 0 else (0.0 if max_abs == 0 else math.inf)
    na, nb = math.sqrt(sa), math.sqrt(sb)
    with np.errstate(invalid="ignore"):
        m["cosine"] = 1.0 if na == 0 and nb == 0 else (float(np.float64(sab) / (na * nb)) if na and nb else 0.0)
    err = err if not m["exact"] else 0.0
    m["sqnr_db"] = None if m["exact"] or err == 0 else (10 * math.log10(sb / err) if sb > 0 else -math.inf)
    return peak, first


def _dot(a: np.ndarray, b: np.ndarray) -> float:
    """The dot product of two float64 vectors, on this thread (BLAS's ``ddot`` starts its own
    threads for it, and on a busy machine waits for them longer than the sum takes)."""
    return float(np.einsum("i,i->", a, b))


def _outside(got: np.ndarray, golden: np.ndarray, atol: float, rtol: float) -> int:
    """How many elements differ by more than ``atol + rtol * |golden|``."""
    return sum(int(np.count_nonzero(diff > atol + rtol * b_abs)) for _, _, diff, b_abs, _, _ in _slices(got, golden))


def _equal(got: np.ndarray, golden: np.ndarray) -> bool:
    """Whether every element of ``got`` equals ``golden``'s (NaN equal to NaN), as :func:`compare`
    decides it element by element."""
    try:
        return bool(np.array_equal(got, golden, equal_nan=True))
    except TypeError:  # a dtype whose NaN numpy cannot test: the element-by-element path decides
        return False


def _exact(m: dict[str, Any], integer: bool, ulp_limit: int | None) -> dict[str, Any]:
    """:func:`compare`'s metrics of two equal tensors."""
    m.update(exact_share=1.0, exact=True, cosine=1.0)
    if integer:
        m["max_lsb"] = 0
    elif ulp_limit is not None:
        m.update(max_ulp=0, max_ulp_of_peak=0.0)
    return m


#: mantissa bits of the float types :func:`ulp_distance` and :func:`ulp_verdict` know
_MANTISSA = {"float16": 10, "bfloat16": 7, "float32": 23, "float64": 52}


def ulp_of_peak(golden: np.ndarray) -> float:
    """One unit in the last place of ``golden``'s dtype at the tensor's largest finite |value|
    (at least the dtype's smallest normal number's ulp)."""
    g = np.asarray(golden, np.float64)
    g = g[np.isfinite(g)]
    peak = float(np.max(np.abs(g))) if g.size else 0.0
    bits = _MANTISSA.get(np.asarray(golden).dtype.name, 52)
    lowest = {"float16": -14, "bfloat16": -126, "float32": -126}.get(np.asarray(golden).dtype.name, -1022)
    return 2.0 ** (max(math.frexp(peak)[1] - 1, lowest) - bits) if peak > 0 else 2.0 ** (lowest - bits)


def ulp_verdict(m: dict[str, Any], got: np.ndarray, golden: np.ndarray, same: np.ndarray | None,
                limit: int) -> dict[str, Any]:
    """``m`` with the verdict of a reduced-precision float tensor: ``max_ulp`` (elementwise units
    in the last place of ``golden``'s dtype, ``got`` rounded to it) and ``max_ulp_of_peak`` (the
    largest difference in units of the ulp at the tensor's largest |value|). ``limit`` 0: every
    element equal (the declared arithmetic); else an element passes within ``limit`` ulp, or
    within ``limit`` ulp of the peak (a sum that cancels has few bits left: its own ulp is no
    measure of its error)."""
    golden = np.asarray(golden)
    if same is None:
        a, b = np.asarray(got, np.float64), np.asarray(golden, np.float64)
        same = (a == b) | (np.isnan(a) & np.isnan(b))
    ulp = ulp_distance(np.asarray(got).astype(golden.dtype), golden)
    if ulp is None:
        ulp = np.where(same, 0, np.iinfo(np.int64).max)
    ulp = np.where(same, 0, ulp)
    unit = ulp_of_peak(golden)
    err = np.abs(np.asarray(got, np.float64) - np.asarray(golden, np.float64))
    err = np.where(same, 0.0, np.where(np.isnan(err), np.inf, err))
    m["max_ulp"] = int(ulp.max()) if ulp.size else 0
    m["max_ulp_of_peak"] = float(err.max() / unit) if err.size else 0.0
    bad = ~same if limit == 0 else ~((ulp <= limit) | (err <= limit * unit))
    if bad.any():
        first = [int(i) for i in np.argwhere(bad)[0]]
        m["first_diff"] = first
        what = "the declared arithmetic is exact" if limit == 0 else f"allowed {limit} ulp"
        m.update(status="fail", message=f"{int(bad.sum())} of {golden.size} values differ, up to {m['max_ulp']} ulp of "
                                        f"{golden.dtype.name} ({m['max_ulp_of_peak']:.3g} ulp of the peak; {what}), "
                                        f"the first at {first}")
    return m


def json_num(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


def status_metric(status: str, tensor: str, message: str) -> dict[str, Any]:
    return {"status": status, "tensor": tensor, "elements": 0, "exact_share": 0.0, "max_abs": 0.0, "max_rel": 0.0,
            "max_lsb": None, "cosine": None, "sqnr_db": None, "exact": False, "message": message}


# ------------------------------------------------------------------ a device tensor against its golden value


#: the most LSB-histogram entries :func:`diff` keeps (the most frequent differences)
HIST_ENTRIES = 16


def ulp_distance(a: np.ndarray, b: np.ndarray) -> np.ndarray | None:
    """Elementwise distance in units in the last place of two float arrays of one dtype
    (float16, bfloat16, float32 or float64; None for any other dtype): how many representable
    values lie between them."""
    a, b = np.asarray(a), np.asarray(b)
    if a.dtype != b.dtype or (a.dtype.kind != "f" and a.dtype.name != "bfloat16") or a.dtype.itemsize not in (2, 4, 8):
        return None
    ints = np.dtype(f"i{a.dtype.itemsize}")
    lowest = np.iinfo(ints).min

    def ordered(x: np.ndarray) -> np.ndarray:
        i = x.view(ints).astype(np.int64)
        return np.where(i < 0, lowest - i, i)  # monotonic in the float value

    return np.abs(ordered(a) - ordered(b))


def float_close(got: np.ndarray, ref: np.ndarray, th: Thresholds, max_ulp: int | None = None) -> np.ndarray:
    """Elementwise: ``got`` is within the float contract of ``ref``: ``|got - ref| <= atol * s +
    rtol * |ref|`` with ``s = max(1, max|ref|)`` (verify's scaled tolerance), or at most
    ``max_ulp`` units in the last place apart; NaN matches NaN."""
    a, b = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    nan_a, nan_b = np.isnan(a), np.isnan(b)
    finite_b = np.where(nan_b, 0.0, b)
    scale = max(1.0, float(np.max(np.abs(finite_b)))) if b.size else 1.0
    with np.errstate(invalid="ignore"):
        ok = (a == b) | (nan_a & nan_b) | (np.abs(a - b) <= th.atol * scale + th.rtol * np.abs(finite_b))
    if max_ulp is not None:
        ulp = ulp_distance(np.asarray(got), np.asarray(ref))
        if ulp is not None:
            ok |= ulp <= max_ulp
    return ok


def diff(device: np.ndarray, golden: np.ndarray, th: Thresholds, max_ulp: int | None = None) -> dict[str, Any]:
    """A device tensor against its golden value: ``status`` ``equal`` (bit-exact), ``within``
    (a float tensor within the float contract, :func:`float_close`) or ``differs``;
    ``mismatches`` (elements not equal for an integer tensor, outside the contract for a
    float one) and their ``share``; ``max_lsb`` and ``lsb_histogram`` (signed difference ->
    count, the :data:`HIST_ENTRIES` most frequent) of an integer tensor; ``max_abs``,
    ``max_ulp``, ``cosine`` and ``sqnr_db`` (verify's :func:`compare` metrics)."""
    device, golden = np.asarray(device), np.asarray(golden)
    integer = golden.dtype.kind in "iub"
    out: dict[str, Any] = {"status": "differs", "elements": int(golden.size), "mismatches": int(golden.size),
                           "share": 1.0, "max_lsb": None, "lsb_histogram": None, "max_abs": None, "max_ulp": None,
                           "cosine": None, "sqnr_db": None, "message": None}
    if device.shape != golden.shape:
        out["message"] = f"shape {list(device.shape)}, golden {list(golden.shape)}"
        return out
    m = compare(device, golden, integer=integer, th=th, scaled=True)
    out.update(max_abs=json_num(m["max_abs"]), cosine=json_num(m["cosine"]), sqnr_db=json_num(m["sqnr_db"]))
    if integer:
        d = device.astype(np.int64) - golden.astype(np.int64)
        wrong = d != 0
        if wrong.any():
            values, counts = np.unique(d[wrong], return_counts=True)
            top = np.argsort(-counts, kind="stable")[:HIST_ENTRIES]
            out["lsb_histogram"] = {str(int(values[i])): int(counts[i]) for i in sorted(top, key=lambda i: values[i])}
        out["max_lsb"] = int(np.abs(d).max()) if d.size else 0
    else:
        wrong = ~float_close(device, golden, th, max_ulp)
        ulp = ulp_distance(device, golden)
        out["max_ulp"] = int(ulp.max()) if ulp is not None and ulp.size else None
    n = int(np.count_nonzero(wrong))
    out.update(mismatches=n, share=n / golden.size if golden.size else 0.0)
    if n:
        out["message"] = f"{n} of {golden.size} values differ" + (f", up to {out['max_lsb']} LSB" if integer else
                                                                  f" beyond the float tolerance, max |err| {m['max_abs']:.3g}")
    else:
        out["status"] = "equal" if m["exact"] else "within"
    return out


# ------------------------------------------------------------------ where a difference lies


#: the most indices :func:`localize` lists per axis, and the largest heat map side
MAX_LISTED = 64
MAX_HEAT = 48


def axis_letters(layout: str | None, ndim: int) -> str | None:
    """The axis letters of a tensor: its layout when it names each axis once, ``NC`` for
    2-D and ``NTC`` (tokens) for 3-D tensors without one; None otherwise."""
    if layout and len(layout) == ndim and len(set(layout)) == ndim:
        return layout
    return {2: "NC", 3: "NTC"}.get(ndim)


def _indices(mask: np.ndarray, axis: int) -> dict[str, Any]:
    hit = np.flatnonzero(mask.any(axis=tuple(a for a in range(mask.ndim) if a != axis)))
    return {"count": int(hit.size), "of": int(mask.shape[axis]), "list": [int(i) for i in hit[:MAX_LISTED]]}


def _heat(plane: np.ndarray) -> list[list[int]]:
    """A 2-D count map, summed into at most :data:`MAX_HEAT` cells a side."""
    h, w = plane.shape
    fy, fx = -(-h // MAX_HEAT), -(-w // MAX_HEAT)
    padded = np.zeros((-(-h // fy) * fy, -(-w // fx) * fx), np.int64)
    padded[:h, :w] = plane
    cells = padded.reshape(padded.shape[0] // fy, fy, padded.shape[1] // fx, fx).sum(axis=(1, 3))
    return cells.tolist()


def localize(wrong: np.ndarray, layout: str | None, tile: tuple[int, int] | None = None) -> dict[str, Any]:
    """Where the ``True`` elements of ``wrong`` lie, by the axes of ``layout``: which
    ``channels`` (``C``), ``rows`` (``H``, or tokens ``T``) and ``cols`` (``W``) hold any
    (count, axis size, the first :data:`MAX_LISTED` indices), ``per_channel`` counts,
    the spatial ``heat`` map (counts over H x W, at most :data:`MAX_HEAT` cells a side)
    and, with ``tile`` (rows, cols), the ``tiles`` of the H x W plane that hold any."""
    wrong = np.asarray(wrong, bool)
    letters = axis_letters(layout, wrong.ndim)
    found: dict[str, Any] = {"axes": letters, "count": int(np.count_nonzero(wrong)), "of": int(wrong.size)}
    if letters is None:
        return found
    names = {"C": "channels", "H": "rows", "T": "rows", "W": "cols"}
    for letter, key in names.items():
        if letter in letters:
            found[key] = _indices(wrong, letters.index(letter))
    if "C" in letters:
        c = letters.index("C")
        per = wrong.sum(axis=tuple(a for a in range(wrong.ndim) if a != c))
        found["per_channel"] = [int(v) for v in per[:1024]]
    if "H" in letters and "W" in letters:
        h, w = letters.index("H"), letters.index("W")
        plane = wrong.sum(axis=tuple(a for a in range(wrong.ndim) if a not in (h, w)))
        plane = plane if h < w else plane.T
        found["heat"] = _heat(plane)
        if tile:
            th, tw = tile
            grid = np.zeros((-(-plane.shape[0] // th), -(-plane.shape[1] // tw)), np.int64)
            ys, xs = np.nonzero(plane)
            np.add.at(grid, (ys // th, xs // tw), plane[ys, xs])
            ty, tx = np.nonzero(grid)
            found["tiles"] = {"size": [th, tw], "count": int(ty.size), "of": int(grid.size),
                              "list": [[int(a), int(b)] for a, b in zip(ty[:MAX_LISTED], tx[:MAX_LISTED])]}
    return found
