"""Integer arithmetic shared by quantization-fusion schemes, and verify's way to a scheme's own.

What every scheme shares lives here, side by side so it cannot drift apart:

* fixed-point and rounding helpers in numpy (:func:`quantize_multiplier`,
  :func:`multiply_by_quantized_multiplier`, :func:`round_half_away`, :func:`quantize_linear`,
  :func:`requantize_float`...), which the numpy reference of the IR uses;
* the same arithmetic as Relax expressions (:func:`rx_multiply_by_quantized_multiplier`...),
  which schemes put into the graph so TVM computes it;
* :class:`QGraph`, the editable view of ``main`` that schemes rewrite.

A scheme's own arithmetic (its kernels, its recompute) lives in its plugin; :func:`recompute`
asks the plugin host for the scheme a layer's ``quant`` record names (``Quantizer.recompute``,
``Quantizer.consistency``) and knows no scheme by name.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from irgen.api import IrgenError
from irgen.plugins import PluginHost


# ------------------------------------------------------------------ numpy


def quantize_multiplier(real: float) -> tuple[int, int]:
    """``QuantizeMultiplier`` of integer kernels (gemmlowp's fixed point): ``real ~= M * 2**(shift - 31)``,
    M in [2**30, 2**31)."""
    if real == 0.0:
        return 0, 0
    if not math.isfinite(real) or real < 0:
        raise ValueError(f"multiplier {real!r} is not a finite non-negative number")
    frac, shift = math.frexp(real)
    q = int(round(frac * (1 << 31)))  # std::round: half away from zero (frac > 0)
    if q == (1 << 31):
        q //= 2
        shift += 1
    if shift < -31:
        return 0, 0
    if shift > 30:
        raise ValueError(f"multiplier {real!r} is too large for int32 fixed point")
    return q, shift


def _as64(x) -> np.ndarray:
    return np.asarray(x, dtype=np.int64)


#: how a kernel rounds in MultiplyByQuantizedMultiplier (reference kernels use both builds)
DOUBLE = "double"  # SaturatingRoundingDoublingHighMul, then RoundingDivideByPOT: ties away from zero
SINGLE = "single"  # (x * M + 2**(30 - shift)) >> (31 - shift): one rounding, ties up
#: the int64 accumulator's variant (16-bit activation kernels): M rounded to 16 bits, one rounding, ties up
WIDE = "wide"
#: no fixed point: the int64 sum times the double real scale, rounded half away from zero (a fully
#: connected kernel on int16 activations); the record holds the real scale per channel, ``scale``
FLOAT64 = "float64"
ROUNDING_RULES = {
    DOUBLE: "SaturatingRoundingDoublingHighMul(x * 2**max(shift,0), M) then RoundingDivideByPOT(-min(shift,0)); "
            "both round half away from zero",
    SINGLE: "(x * M + 2**(30 - shift)) >> (31 - shift) in int64; round half up",
    WIDE: "int64 x: m = (M + 2**15) >> 16 if M < 0x7FFF0000 else 0x7FFF; (x * m + 2**(14 - shift)) >> (15 - shift); "
          "round half up",
    FLOAT64: "y = round_half_away_from_zero(double(acc) * scale), scale = double(s_x) * double(s_w) / double(s_y) "
             "per channel (the record's 'scale'), saturated to int32",
}


def _reduced_multiplier(m) -> np.ndarray:
    """The 16-bit multiplier of an int64 accumulator: ``(M + 2**15) >> 16``, at most 0x7FFF."""
    m = _as64(m)
    return np.where(m < 0x7FFF0000, (m + (1 << 15)) >> 16, 0x7FFF)


def multiply_by_quantized_multiplier(x, multiplier, shift, rounding: str = DOUBLE) -> np.ndarray:
    """``MultiplyByQuantizedMultiplier`` of integer kernels, in each of its rounding builds (``rounding``)."""
    x, m, shift = _as64(x), _as64(multiplier), _as64(shift)
    if rounding == WIDE:
        total = 15 - shift
        return (x * _reduced_multiplier(m) + (np.int64(1) << (total - 1))) >> total
    if rounding == SINGLE:
        total = 31 - shift
        return (x * m + (np.int64(1) << (total - 1))) >> total
    left, right = np.maximum(shift, 0), np.maximum(-shift, 0)
    ab = (x << left) * m
    s = ab + np.where(ab >= 0, 1 << 30, 1 - (1 << 30))
    high = np.where(s < 0, -((-s) >> 31), s >> 31)  # C++ division truncates
    # RoundingDivideByPOT: round half away from zero
    half = (np.int64(1) << right) >> 1
    mag = (np.abs(high) + half) >> right
    return np.where(high < 0, -mag, mag)


def round_half_away(v) -> np.ndarray:
    """C's ``round``/``roundf``: half away from zero, in ``v``'s float
    type and exact (``|v| - floor(|v|)`` is exact; ``floor(|v| + 0.5)`` is not for the largest
    value below one half)."""
    v = np.asarray(v)
    a = np.abs(v)
    r = np.floor(a)
    return np.copysign(r + (a - r >= 0.5).astype(r.dtype), v)


def quantize_half_away(v: float, scale: float, zero_point: int) -> int | None:
    """One float quantized with float32 division and rounding half away from zero (C's ``roundf``,
    as the fused activation bounds of integer kernels are computed: ``zero_point +
    round_half_away(float32(v) / float32(scale))``); None when the rounded quotient is beyond
    int32 (such a model is refused)."""
    t = float(round_half_away(np.float32(v) / np.float32(scale)))
    return None if not -(2.0 ** 31) <= t <= 2.0 ** 31 else int(zero_point) + int(t)


def rescale_float64(acc, scale) -> np.ndarray:
    """``round_half_away(double(acc) * scale)`` saturated to int32 (rounding ``FLOAT64``)."""
    p = np.asarray(acc, np.int64).astype(np.float64) * np.asarray(scale, np.float64)
    return np.clip(round_half_away(p), -(2.0 ** 31), 2.0 ** 31 - 1).astype(np.int64)


def divide_round_half_away(acc, count) -> np.ndarray:
    """``acc > 0 ? (acc + n/2)/n : (acc - n/2)/n`` with C++ truncating division."""
    acc, n = _as64(acc), _as64(count)
    num = np.where(acc > 0, acc + n // 2, acc - n // 2)
    q = np.abs(num) // n
    return np.where(num < 0, -q, q)


def per_axis(values, axis: int, ndim: int) -> np.ndarray:
    """Reshape a per-channel vector so it broadcasts along ``axis`` of an ``ndim`` tensor."""
    v = np.asarray(values)
    if v.ndim == 0 or v.size == 1:
        return v.reshape(())
    shape = [1] * ndim
    shape[axis % ndim] = v.size
    return v.reshape(shape)


def check_qparams(scheme: str, tensor: str, scale, zero_point, dtype: str, axis: int | None = None,
                  channels: int | None = None) -> "QTensor":
    """Validated quantization parameters of ``tensor``: a :class:`QTensor`.

    Raises :class:`irgen.api.IrgenError` naming the tensor for a zero,
    negative or NaN scale, a zero point outside ``dtype``'s range, or (when
    ``channels`` is given) a per-channel scale count that does not match.
    """
    s = np.asarray(scale, dtype=np.float32).reshape(-1)
    z = np.asarray(zero_point).astype(np.int64).reshape(-1)
    if s.size and np.any(np.isposinf(s)):
        raise IrgenError(
            f"{scheme}: tensor {tensor!r} has an infinite scale ({s.tolist()[:4]}): the quantizer calibrated a "
            f"tensor holding an infinite or float32-extreme value (an attention mask's -inf or finfo.min), and "
            f"every value of it dequantizes to NaN or an infinity; quantize the model without that node")
    if s.size == 0 or not np.all(np.isfinite(s)) or np.any(s <= 0):
        raise IrgenError(f"{scheme}: tensor {tensor!r} has a zero, negative or NaN scale ({s.tolist()[:4]})")
    if dtype in ("int8", "uint8", "int16", "uint16", "int32"):
        info = np.iinfo(dtype)
        if np.any(z < info.min) or np.any(z > info.max):
            raise IrgenError(f"{scheme}: tensor {tensor!r} has a zero point outside {dtype} ({z.tolist()[:4]})")
    if z.size not in (1, s.size):
        raise IrgenError(f"{scheme}: tensor {tensor!r} has {s.size} scales but {z.size} zero points")
    if channels is not None and s.size > 1 and s.size != channels:
        raise IrgenError(f"{scheme}: tensor {tensor!r} has {s.size} per-channel scales for {channels} channels")
    return QTensor(s, z, dtype, axis if s.size > 1 else None)


def requantize_float(acc, scale, zero_point: int, lo: int, hi: int, dtype: str) -> np.ndarray:
    """Float requantization (MLAS's): ``float32(acc) * float32 scale``, clamped to
    ``[lo - zp, hi - zp]``, rounded half to even, plus ``zp``."""
    f = np.asarray(acc).astype(np.float32) * np.asarray(scale, np.float32)
    f = np.clip(f, np.float32(lo - zero_point), np.float32(hi - zero_point))
    return (np.rint(f).astype(np.int64) + zero_point).astype(dtype)


def quantize_linear(x, scale, zero_point, dtype: str, bounds: tuple[int, int] | None = None) -> np.ndarray:
    """ONNX QuantizeLinear (MLAS's): ``x / scale`` in float32,
    rounded half to even, plus the zero point, saturated; NaN becomes the type's minimum
    (MLAS clamps with max-then-min, which takes the bound). ``scale`` and ``zero_point``
    (an int, or integers) may be per axis, shaped to broadcast with ``x``. ``bounds``: the
    type's range when numpy has no such type (4-bit: ``(-8, 7)``, ``(0, 15)``; ``dtype`` is
    then the array's storage type)."""
    info = np.iinfo(dtype)
    lo, hi = bounds if bounds is not None else (int(info.min), int(info.max))
    with np.errstate(divide="ignore", invalid="ignore"):
        f = np.asarray(x, np.float32) / np.asarray(scale, np.float32)
    f = np.where(np.isnan(f), np.float32(lo) - zero_point, f)
    f = np.clip(f, np.float32(lo) - zero_point, np.float32(hi) - zero_point)
    return (np.rint(f).astype(np.int64) + zero_point).astype(dtype)


#: the ``quant.kind`` of an integer convolution or dense layer: an accumulator of ``(x - zp_x) * w``
#: (plus bias) and a requantization (:func:`accumulate`, :func:`requant_scales`)
MAC_KINDS = frozenset({"conv2d", "depthwise_conv2d", "conv3d", "depthwise_conv3d", "dense"})


def requant_scales(qr: dict[str, Any]):
    """``(s_x, s_w per channel, s_y)`` of a conv/dense ``quant`` record (float64), or None when the
    record is of another kind or lacks them."""
    if qr.get("kind") not in MAC_KINDS or not qr.get("inputs") or not qr.get("weight"):
        return None
    try:
        s_x = float(np.asarray(qr["inputs"][0]["scale"]).reshape(-1)[0])
        s_w = np.asarray(qr["weight"]["scale"], np.float64).reshape(-1)
        s_y = float(np.asarray(qr["output"]["scale"]).reshape(-1)[0])
    except (KeyError, TypeError, ValueError):
        return None
    return s_x, s_w, s_y


def requant_scale_mismatch(layer: dict[str, Any], expected=None) -> str | None:
    """Why a conv/dense layer's per-channel ``requant.scale`` is not ``expected(s_x, s_w, s_y)``
    (default ``s_x * s_w / s_y``) of the scales beside it in its ``quant`` record, to a relative
    1e-6, or None: also when the record holds no such scale (:func:`requant_scales`)."""
    qr = layer.get("quant") or {}
    rq = qr.get("requant") or {}
    scales = requant_scales(qr)
    if scales is None or "scale" not in rq or np.size(rq["scale"]) != scales[1].size:
        return None
    want = (expected or (lambda s_x, s_w, s_y: s_x * s_w / s_y))(*scales)
    bad = np.flatnonzero(~np.isclose(np.asarray(rq["scale"], np.float64).reshape(-1), want, rtol=1e-6, atol=0))
    if bad.size:
        return f"requant scale of channel(s) {bad[:4].tolist()} does not follow from the input, weight and output scales"
    return None


def accumulate(layer: dict[str, Any], inputs: list[np.ndarray], params: dict[str, np.ndarray]) -> np.ndarray:
    """The int64 accumulator of a quantized conv/dense layer: ``sum((x - zp_x) * w) + bias``."""
    from irgen.reference import conv2d, conv3d

    qr = layer["quant"]
    x = inputs[0].astype(np.int64) - int(np.asarray(qr["inputs"][0]["zero_point"]).reshape(-1)[0])
    w = params["weight"].astype(np.int64)
    conv = conv3d if w.ndim == 5 else conv2d
    acc = x @ w if qr["kind"] == "dense" else conv(x, w, {**layer["attrs"], "out_dtype": "int64"})
    if "bias" in params:
        acc = acc + per_axis(params["bias"].reshape(-1).astype(np.int64), qr["requant"]["axis"], acc.ndim)
    return acc


#: the plugin host :func:`recompute` asks when its caller gives none: the installed plugins,
#: loaded on first use (:func:`default_host`)
_DEFAULT_HOST: Any = None


def default_host():
    """A :class:`irgen.plugins.PluginHost` with the installed plugins, loaded once per process:
    where :func:`recompute` finds a layer's scheme when its caller has no host of its own."""
    global _DEFAULT_HOST
    if _DEFAULT_HOST is None:
        _DEFAULT_HOST = PluginHost().load()
    return _DEFAULT_HOST


def forget_default_host() -> None:
    """Load the plugins again on the next :func:`default_host` (the plugins changed: a test
    registered or removed one)."""
    global _DEFAULT_HOST
    _DEFAULT_HOST = None


def scheme_quantizer(scheme: str, host=None):
    """The registered :class:`irgen.api.Quantizer` named ``scheme`` (in ``host``, by default
    :func:`default_host`), or None when no plugin registers it."""
    host = host if host is not None else default_host()
    return host.quantizers.get(scheme) if scheme in host.quantizers else None


def scheme_recompute(scheme: str, kind: str, host=None):
    """The recompute of ``kind`` that scheme ``scheme`` registers (``Quantizer.recompute``: the
    kind's own, else its ``"*"``), or None."""
    table = getattr(scheme_quantizer(scheme, host), "recompute", None) or {}
    fn = table.get(kind) or table.get("*")
    if fn is None:  # a plugin written for API 1.x (register_recompute)
        fn = RECOMPUTE.get((scheme, kind)) or RECOMPUTE.get((scheme, "*"))
    return fn


def scheme_consistency(scheme: str, host=None):
    """The consistency check scheme ``scheme`` registers (``Quantizer.consistency``), or None."""
    fn = getattr(scheme_quantizer(scheme, host), "consistency", None)
    return fn if fn is not None else CONSISTENCY.get(scheme)


#: deprecated (API 1.x): (scheme, quant kind) -> recompute, from :func:`register_recompute`
RECOMPUTE: dict[tuple[str, str], Any] = {}
#: deprecated (API 1.x): scheme -> consistency check, from :func:`register_consistency`
CONSISTENCY: dict[str, Any] = {}


def register_recompute(scheme: str, kind: str, fn) -> None:
    """Deprecated since API 2.0: give ``Quantizer(recompute={kind: fn})`` instead. Makes ``fn``
    verify's recompute of scheme ``scheme``'s layers of ``kind`` (``"*"``: of every kind); a
    scheme's ``Quantizer.recompute`` comes first. Call it when the plugin module is imported."""
    import warnings

    warnings.warn("irgen.plugin.register_recompute is deprecated: give Quantizer(recompute={kind: fn})",
                  DeprecationWarning, stacklevel=2)
    RECOMPUTE[(scheme, kind)] = fn


def register_consistency(scheme: str, fn) -> None:
    """Deprecated since API 2.0: give ``Quantizer(consistency=fn)`` instead. Makes ``fn(layer)``
    verify's consistency check of scheme ``scheme``'s conv/dense layers."""
    import warnings

    warnings.warn("irgen.plugin.register_consistency is deprecated: give Quantizer(consistency=fn)",
                  DeprecationWarning, stacklevel=2)
    CONSISTENCY[scheme] = fn


def recompute(layer: dict[str, Any], inputs: list[np.ndarray], params: dict[str, np.ndarray],
              host=None) -> np.ndarray:
    """A realized integer layer from its ``quant`` record and parameters alone.

    This is the arithmetic a hardware engineer reproduces; it does not read
    ``fused_ops``. The scheme the record names provides it (``Quantizer.recompute`` of the
    quantizer registered under that name in ``host``, by default :func:`default_host`); irgen
    knows no scheme by name. Raises NotImplementedError when the scheme registers none.
    """
    qr = layer["quant"]
    if qr.get("steps") is not None:  # a backend's fusion rule merged layers that requantize
        return _as_output(_recompute_steps(layer, inputs, params, host), layer)
    kind = qr["kind"]
    fn = scheme_recompute(qr["scheme"], kind, host)
    if fn is None:
        raise NotImplementedError(f"scheme {qr['scheme']!r} registers no recompute of kind {kind!r}")
    after = int(qr.get("fused_after") or 0)
    if not after:
        return _as_output(fn(layer, inputs, params), layer)
    # a backend's fusion rule added exact integer followers (max pool, reshape): the scheme
    # recomputes the anchor's ops, then the followers' own fused_ops run on its result
    from irgen.reference import run_layer

    ops = layer["fused_ops"]
    head = len(ops) - after
    if head < 1:
        raise ValueError(f"quant.fused_after {after} leaves no ops of the anchor ({len(ops)} fused_ops)")
    y = fn({**layer, "fused_ops": ops[:head], "results": [f"op:{head - 1}"]}, inputs, params)
    tail = [{**op, "args": [_rebase(a, head) for a in op["args"]]} for op in ops[head:]]
    return run_layer({**layer, "fused_ops": tail, "results": [f"op:{after - 1}"]}, [y], {})[0]


def _recompute_steps(layer: dict[str, Any], inputs: list[np.ndarray], params: dict[str, np.ndarray],
                     host=None) -> np.ndarray:
    """A layer whose ``quant.steps`` are scheme layers merged by a fusion rule: each step is
    recomputed by its scheme's recompute (:func:`recompute` of the step alone: its record as
    ``quant``, its ``ops`` consecutive ``fused_ops``, its ``args`` as inputs) and feeds the
    steps after it; the last step's result is the layer's."""
    steps = layer["quant"]["steps"]
    ops = layer["fused_ops"]
    counts = [int(s["ops"]) for s in steps]
    if not steps or min(counts) < 1 or sum(counts) != len(ops):
        raise ValueError(f"quant.steps count {counts} ops, the layer has {len(ops)} fused_ops")
    records = layer.get("inputs") or []
    results: list[np.ndarray] = []
    ends: dict[int, int] = {}  # the op index that is step J's result -> J
    start = 0
    for i, (step, n) in enumerate(zip(steps, counts)):
        args = list(step["args"])
        values, recs = [], []
        for a in args:
            what, _, j = str(a).partition(":")
            if what == "input" and j.isdigit() and int(j) < len(inputs):
                values.append(inputs[int(j)])
                recs.append(records[int(j)] if int(j) < len(records) else {})
            elif what == "step" and j.isdigit() and int(j) < i:
                values.append(results[int(j)])
                recs.append({"name": a, "shape": list(results[int(j)].shape), "dtype": str(results[int(j)].dtype)})
            else:
                raise ValueError(f"quant.steps[{i}].args: {a!r} is neither a layer input nor an earlier step")
        last = i == len(steps) - 1
        part = {**layer, "quant": {k: v for k, v in step.items() if k not in ("ops", "args")},
                "fused_ops": [{**op, "args": [_step_arg(x, start, n, args, ends) for x in op["args"]]}
                              for op in ops[start:start + n]],
                "results": [f"op:{n - 1}"], "inputs": recs, "outputs": layer.get("outputs") if last else [],
                "attrs": layer.get("attrs") or {} if i == 0 else {}}
        results.append(np.asarray(recompute(part, values, params, host)))
        ends[start + n - 1] = i
        start += n
    return results[-1]


def _step_arg(arg: Any, start: int, n: int, args: list[str], ends: dict[int, int]) -> Any:
    """An argument of one step's op, rebased onto the step alone: its own ops from ``op:0``,
    its inputs as ``input:P`` in the order of its ``args``."""
    if isinstance(arg, list):
        return [_step_arg(a, start, n, args, ends) for a in arg]
    if isinstance(arg, str) and arg.startswith("op:"):
        j, dot, k = arg[3:].partition(".")
        j = int(j)
        if start <= j < start + n:
            return f"op:{j - start}{dot}{k}"
        if not dot and ends.get(j) is not None and f"step:{ends[j]}" in args:
            return f"input:{args.index(f'step:{ends[j]}')}"
        raise ValueError(f"a step's op reads {arg}, which is not one of its args {args}")
    if isinstance(arg, str) and arg.startswith("input:"):
        if arg not in args:
            raise ValueError(f"a step's op reads {arg}, which is not one of its args {args}")
        return f"input:{args.index(arg)}"
    return arg


def _as_output(y: np.ndarray, layer: dict[str, Any]) -> np.ndarray:
    """``y`` in the shape of the layer's output record when only the shape differs (a fully
    connected kernel that flattens a [1, 1, 1, K] input and writes [1, N])."""
    outs = layer.get("outputs") or []
    shape = outs[0].get("shape") if outs and isinstance(outs[0], dict) else None
    if isinstance(y, np.ndarray) and isinstance(shape, list) and list(y.shape) != shape \
            and all(isinstance(d, int) for d in shape) and int(np.prod(shape)) == y.size:
        return y.reshape(shape)
    return y


def _rebase(arg: Any, head: int) -> Any:
    """An argument of a follower op, with the anchor's result as ``input:0``."""
    if isinstance(arg, str) and arg.startswith("op:"):
        j = int(arg[3:].split(".")[0])
        if j < head - 1:
            raise ValueError(f"a follower op reads {arg}, inside the anchor's ops")
        return "input:0" if j == head - 1 else f"op:{j - head}"
    if isinstance(arg, str) and arg.startswith(("input:", "param:")):
        raise ValueError(f"a follower op reads {arg}: followers read only the anchor's result")
    return arg


# ------------------------------------------------------------------ Relax


def rx_const(value, dtype: str):
    """A Relax constant of ``value`` (a scalar or an array) as ``dtype``."""
    from tvm import relax

    return relax.const(np.asarray(value, dtype=dtype), dtype)


def rx_multiply_by_quantized_multiplier(emit, x, multiplier, shift, axis: int, ndim: int, rounding: str = DOUBLE):
    """:func:`multiply_by_quantized_multiplier` as Relax ops on an int32 tensor (int64 with ``WIDE``).

    ``emit`` binds each intermediate (see :meth:`QGraph.emit`) so values used
    twice are computed once.
    """
    from tvm.relax import op

    def c(v):
        return rx_const(per_axis(np.asarray(v, np.int64), axis, ndim), "int64")

    sh = np.asarray(shift, np.int64)
    x64 = x if str(x.ty.dtype) == "int64" else emit(op.astype(x, "int64"))
    if rounding == WIDE:
        total = 15 - sh
        ab = emit(op.add(emit(op.multiply(x64, c(_reduced_multiplier(multiplier)))), c(np.int64(1) << (total - 1))))
        return emit(op.astype(emit(op.right_shift(ab, c(total))), "int32"))
    if rounding == SINGLE:
        total = 31 - sh
        ab = emit(op.add(emit(op.multiply(x64, c(multiplier))), c(np.int64(1) << (total - 1))))
        return emit(op.astype(emit(op.right_shift(ab, c(total))), "int32"))
    left, right = np.maximum(sh, 0), np.maximum(-sh, 0)
    ab = emit(op.multiply(x64, c(np.asarray(multiplier, np.int64) << left)))
    zero = rx_const(0, "int64")
    nudge = emit(op.where(emit(op.greater_equal(ab, zero)), rx_const(1 << 30, "int64"), rx_const(1 - (1 << 30), "int64")))
    high = emit(op.divide(emit(op.add(ab, nudge)), rx_const(1 << 31, "int64")))  # integer divide truncates
    mag = emit(op.right_shift(emit(op.add(emit(op.abs(high)), c((np.int64(1) << right) >> 1))), c(right)))
    rounded = emit(op.where(emit(op.less(high, zero)), emit(op.negative(mag)), mag))
    return emit(op.astype(rounded, "int32"))


def rx_round_half_away(emit, f):
    """:func:`round_half_away` as Relax ops on a float tensor (float32 or float64); the result
    in that type."""
    from tvm.relax import op

    dtype = str(f.ty.dtype)
    a = emit(op.abs(f))
    r = emit(op.floor(a))
    up = emit(op.astype(emit(op.greater_equal(emit(op.subtract(a, r)), rx_const(0.5, dtype))), dtype))
    return emit(op.multiply(emit(op.sign(f)), emit(op.add(r, up))))


def rx_rescale_float64(emit, acc, scale, axis: int, ndim: int):
    """:func:`rescale_float64` as Relax ops on an int64 tensor; an int32 result."""
    from tvm.relax import op

    p = emit(op.multiply(emit(op.astype(acc, "float64")),
                         rx_const(per_axis(np.asarray(scale, np.float64), axis, ndim), "float64")))
    return emit(op.astype(emit(op.clip(rx_round_half_away(emit, p), -(2.0 ** 31), 2.0 ** 31 - 1)), "int32"))


def rx_divide_round_half_away(emit, acc, count):
    """:func:`divide_round_half_away` on an int32 tensor; ``count`` is a positive
    int or a Relax int32 tensor of positive counts (broadcast)."""
    from tvm.relax import op

    if isinstance(count, (int, np.integer)):
        n, half = rx_const(int(count), "int32"), rx_const(int(count) // 2, "int32")
    else:
        n, half = count, rx_const(np.asarray(count.value.numpy()) // 2, "int32")
    neg = emit(op.less(acc, rx_const(0, "int32")))
    q = emit(op.floor_divide(emit(op.add(emit(op.abs(acc)), half)), n))
    return emit(op.where(neg, emit(op.negative(q)), q))


def rx_requantize_float(emit, acc, scale, zero_point: int, lo: int, hi: int, dtype: str, axis: int = -1, ndim: int = 0):
    """:func:`requantize_float` as Relax ops on an int32 (or float32) tensor."""
    from tvm.relax import op

    f = acc if str(acc.ty.dtype) == "float32" else emit(op.astype(acc, "float32"))
    # float32 * float32 rounded once to float32, written as an exact float64 product then a cast: the
    # IR's fused_ops keeps a per-channel literal without its dtype (numpy reads it back as float64)
    f = emit(op.astype(f, "float64"))
    f = emit(op.multiply(f, rx_const(per_axis(np.asarray(scale, np.float32).astype(np.float64), axis, ndim), "float64")))
    f = emit(op.astype(f, "float32"))
    return rx_round_to_int(emit, f, zero_point, lo, hi, dtype)


def rx_round_to_int(emit, f, zero_point: int, lo: int, hi: int, dtype: str, nan_to_lo: bool = False):
    """float32 ``f`` clamped to ``[lo - zp, hi - zp]``, rounded half to even, ``+ zp``, cast.
    ``nan_to_lo``: a NaN becomes ``lo`` (as ONNX QuantizeLinear saturates it); else what the clip makes of it."""
    from tvm.relax import op

    if nan_to_lo:
        f = emit(op.where(emit(op.isnan(f)), rx_const(float(lo - zero_point), "float32"), f))
    f = emit(op.clip(f, float(lo - zero_point), float(hi - zero_point)))
    r = emit(op.astype(emit(op.round(f)), "int32"))
    return op.astype(emit(op.add(r, rx_const(int(zero_point), "int32"))), dtype)


def rx_clamp_cast(emit, x, lo: int, hi: int, dtype: str):
    """``x`` clipped to ``[lo, hi]`` and cast to ``dtype`` (the clip bound through ``emit``)."""
    from tvm.relax import op

    return op.astype(emit(op.clip(x, lo, hi)), dtype)


# ------------------------------------------------------------------ graph


def follow_constant(qg, expr, qparams, scheme: str, what: str, tensor: str):
    """Follow dequantize/reshape/permute_dims bindings back to an integer constant.

    ``qparams(binding, array)`` reads and checks a dequantize's parameters
    (each scheme its own way). Returns the integer array in the layout its
    consumer sees, its :class:`QTensor` with the per-channel axis mapped into
    that layout, and the chain of bindings followed.
    """
    from irgen.graph import Constant

    chain, e = [], expr
    while not isinstance(e, Constant):
        b = qg.producer(e)
        if b is None or b.op not in ("relax.dequantize", "relax.reshape", "relax.permute_dims"):
            raise IrgenError(f"{scheme}: {what} of {tensor!r} is not a dequantized integer constant")
        chain.append(b)
        e = b.value.args[0]
    arr = e.value.numpy()
    qt, chan = None, None  # chan: each element's channel index, moved like the data
    for b in reversed(chain):
        v = b.value
        if b.op == "relax.dequantize":
            qt = qparams(b, arr)
            if qt.scale.size > 1:
                ax = int(v.attrs.axis) % max(arr.ndim, 1)
                idx = np.arange(arr.shape[ax], dtype=np.int32).reshape([-1 if i == ax else 1 for i in range(arr.ndim)])
                chan = np.broadcast_to(idx, arr.shape)
        elif b.op == "relax.reshape":
            shape = [int(d) for d in v.args[1].values]
            arr = arr.reshape(shape)
            chan = chan.reshape(shape) if chan is not None else None
        else:
            axes = [int(a) for a in v.attrs.axes] if v.attrs.axes is not None else None
            arr = np.transpose(arr, axes)
            chan = np.transpose(chan, axes) if chan is not None else None
    if qt is None:
        raise IrgenError(f"{scheme}: {what} of {tensor!r} is never dequantized")
    if chan is not None:
        # the index cannot change along an axis of length 1 or of stride 0 (a broadcast one:
        # a weight's other axes until a reshape copies it); along the one other axis it must
        varying = [a for a in range(chan.ndim) if chan.strides[a] and chan.shape[a] > 1]
        axes = varying if len(varying) == 1 else [a for a in varying if (chan != chan.take([0], axis=a)).any()]
        if len(axes) != 1:
            raise IrgenError(f"{scheme}: cannot tell the channel axis of the {what} of {tensor!r}")
        qt.axis = axes[0]
    return arr, qt, chain


def float_record(dtype: str = "float32") -> dict[str, Any]:
    """The ``inputs``/``output`` entry of a float tensor in a ``quant`` record (a dequantize's
    result): its dtype, no scale, zero point or axis."""
    return {"dtype": dtype, "scale": None, "zero_point": None, "axis": None}


@dataclass
class QTensor:
    """A quantized tensor's parameters: ``real = scale * (q - zero_point)``; :meth:`record`
    is its entry in a ``quant`` record's ``inputs``/``output``."""

    scale: np.ndarray
    zero_point: np.ndarray
    dtype: str
    axis: int | None = None  # per-channel axis, None when per tensor
    range: tuple[int, int] | None = None  # the integer range when narrower than dtype's (torch's reduce_range)

    @property
    def lo(self) -> int:
        """The smallest integer the tensor holds: ``range[0]``, else the dtype's minimum."""
        return int(self.range[0]) if self.range else int(np.iinfo(self.dtype).min)

    @property
    def hi(self) -> int:
        """The largest integer the tensor holds: ``range[1]``, else the dtype's maximum."""
        return int(self.range[1]) if self.range else int(np.iinfo(self.dtype).max)

    def record(self) -> dict[str, Any]:
        """``{"scale", "zero_point", "dtype", "axis"}``: lists when per channel, else scalars;
        ``"range": [lo, hi]`` too when the range is narrower than the dtype's."""
        per_channel = self.scale.size > 1
        return {
            "scale": [float(s) for s in self.scale.reshape(-1)] if per_channel else float(self.scale.reshape(-1)[0]),
            "zero_point": [int(z) for z in self.zero_point.reshape(-1)] if self.zero_point.size > 1 else int(self.zero_point.reshape(-1)[0]),
            "dtype": self.dtype,
            "axis": self.axis if per_channel else None,
            **({"range": [self.lo, self.hi]} if self.range else {}),
        }


#: a kernel :meth:`QGraph.add_kernel` added (its ``GlobalVar``'s name) -> (the Relax op it
#: computes, its attributes): how ``fused_ops`` records a ``call_tir`` of it
KERNEL_OPS: dict[str, tuple[str, dict[str, Any]]] = {}


def add_kernel(bb, func, name: str, op: str, attrs: dict[str, Any]):
    """Add the TIR ``PrimFunc`` ``func`` through the ``relax.BlockBuilder`` ``bb`` (a frontend's,
    while it imports) and return its ``GlobalVar``, for a ``relax.call_tir``: as
    :meth:`QGraph.add_kernel`, the kernel computes the Relax op ``op`` with ``attrs``, which
    ``fused_ops`` records and the numpy reference must know."""
    gv = bb.add_func(func, name)
    KERNEL_OPS[gv.name_hint] = (op, attrs)
    return gv


def kernel_op(name: str) -> tuple[str, dict[str, Any]] | None:
    """(the Relax op, its attributes) that the kernel :meth:`QGraph.add_kernel` added under the
    ``GlobalVar`` name ``name`` computes, or None."""
    return KERNEL_OPS.get(name)


@dataclass
class QGraph:
    """``main``'s bindings as a scheme edits them: what ``Quantizer.detect(qg)`` reads and
    ``Quantizer.realize(qg)`` rewrites in place.

    A scheme replaces a span of bindings (dequantize -> op -> quantize) with
    one new expression bound to the span's last variable (so names and
    provenance hold) and records the layer's ``quant`` dict under that name.

    Attributes (read them; change them only through the methods):

    * ``mod``: the imported ``tvm.IRModule``; ``main`` is one dataflow block.
    * ``dialect``: what the graph's quantization ops mean, as the frontend declared
      it (a name of :data:`irgen.api.QUANT_DIALECTS`);
      a scheme detects the dialects it realizes, never a frontend by name.
    * ``frontend``: the name of the frontend that imported the model (informative).
    * ``ranges``: a quantized tensor's binding name -> its integer range, when narrower
      than its dtype's (:attr:`irgen.api.ImportedModel.quant_ranges`).
    * ``source_ops``: a binding name -> the op type of the source node whose tensor it
      holds (:attr:`irgen.api.Provenance.by_var`); absent for the bindings a frontend adds
      inside one node (a product before the bias the same node adds): what a runtime
      may compute in one kernel.
    * ``bindings``: ``main``'s bindings in order, each an :class:`irgen.graph.Binding`
      (``name``, ``var``, ``value``; ``op`` is the Relax op name such as
      ``"relax.nn.conv2d"`` for a call, else None).
    * ``by_name``: binding name -> binding; ``users``: binding name -> indices into
      ``bindings`` of the bindings that read it (kept current by :meth:`replace`).
    * ``quant``: binding name -> the layer's ``quant`` record, which becomes the
      ``quant`` of the IR layer whose output is that binding. It must hold
      ``"scheme"`` (the scheme's name: verify finds the scheme's ``Quantizer.recompute``
      by it), ``"kind"``, ``"inputs"`` and ``"output"``
      (each :meth:`QTensor.record`), and whatever the recompute of the kind reads.

    ``realize(qg)`` reads ``bindings``/``by_name``/``users``/``dialect``, builds integer
    arithmetic with :meth:`emit` and the ``rx_*`` builders, and commits each span with
    :meth:`replace`. It must leave no ``relax.quantize``/``relax.dequantize`` that the
    scheme claims, and every binding it keeps must still type-check. irgen then builds the
    realized module with :meth:`module` and forms the layers from it.
    """

    mod: Any
    frontend: str = ""
    dialect: str | None = None
    ranges: dict[str, tuple[int, int]] = field(default_factory=dict)
    source_ops: dict[str, str] = field(default_factory=dict)
    bindings: list = field(default_factory=list)
    quant: dict[str, dict[str, Any]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        from irgen.graph import main_bindings

        _, self.bindings = main_bindings(self.mod)
        self._pending: list = []
        self._count = 0
        self._kernel_builder = None  # a BlockBuilder over ``mod`` once :meth:`add_kernel` added one
        #: binding name -> the names of the bindings :meth:`replace` folded into it (the span's
        #: quantize/dequantize and compute ops): the layer's ``source`` lists their nodes
        self.folded: dict[str, list[str]] = {}
        self._index()

    def emit(self, expr):
        """Bind one op (whose arguments are variables or constants) to a new
        unnamed variable; the binding lands before the next :meth:`replace`."""
        from tvm import relax

        from irgen.graph import Binding

        expr = (self._kernel_builder or relax.BlockBuilder()).normalize(expr)
        var = relax.DataflowVar(f"iq{self._count}", expr.ty)
        self._count += 1
        self._pending.append(Binding(var.name, var, expr))
        return var

    def add_kernel(self, func, name: str, op: str, attrs: dict[str, Any]):
        """Add the TIR ``PrimFunc`` ``func`` to ``mod`` and return its ``GlobalVar``, for a
        ``relax.call_tir`` bound with :meth:`emit`: a scheme's arithmetic that no Relax op has
        (an accumulation order). The kernel computes the Relax op ``op`` with ``attrs`` (which
        say how, e.g. ``accumulation``) on the call's tensor arguments: ``fused_ops`` records it
        so, and the numpy reference must know those attributes. ``name`` names one computation:
        a kernel of another shape or other attributes gets another name (a digest of both)."""
        from tvm import relax

        if self._kernel_builder is None:
            self._kernel_builder = relax.BlockBuilder(self.mod)
        gv = self._kernel_builder.add_func(func, name)
        self.mod = self._kernel_builder.get()
        KERNEL_OPS[gv.name_hint] = (op, attrs)
        return gv

    def _index(self) -> None:
        """Recompute ``by_name`` and ``users`` from ``bindings``."""
        from irgen.graph import users_of

        self.by_name = {b.name: b for b in self.bindings}
        self.users = users_of(self.bindings)

    def producer(self, expr):
        """The binding that computes a variable, or None (inputs, constants)."""
        from tvm import relax

        if isinstance(expr, relax.Var):
            return self.by_name.get(expr.name)
        return None

    def n_users(self, name: str) -> int:
        """How many bindings read ``name``, plus one when ``main`` returns it."""
        out = self.mod["main"].body.body
        from irgen.graph import var_names

        return len(self.users.get(name, [])) + (1 if name in var_names(out) else 0)

    def replace(self, names: list[str], expr, quant: dict[str, Any] | None = None) -> None:
        """Drop bindings ``names`` and bind ``expr`` to the last of them, in its place."""
        from irgen.graph import Binding

        last = names[-1]
        drop = set(names[:-1])
        self.folded.setdefault(last, []).extend(n for n in names[:-1] if n not in self.folded.get(last, []))
        new = []
        for b in self.bindings:
            if b.name in drop:
                continue
            if b.name == last:
                new.extend(self._pending)
                new.append(Binding(b.name, b.var, expr))
            else:
                new.append(b)
        self._pending = []
        self.bindings = new
        self._index()
        if quant is not None:
            self.quant[last] = quant

    def module(self):
        """The ``tvm.IRModule`` with ``main`` rebuilt from ``bindings`` (irgen calls it after ``realize``)."""
        from irgen.graph import rebuild_main

        return rebuild_main(self.mod, self.bindings)
