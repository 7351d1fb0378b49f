"""Integer arithmetic shared by quantization-fusion schemes.

Three things live here, side by side so they cannot drift apart:

* the fixed-point helpers of TFLite's reference kernels in numpy
  (:func:`quantize_multiplier`, :func:`multiply_by_quantized_multiplier`...),
  which the numpy reference of the IR uses;
* the same arithmetic as Relax expressions (:func:`rx_multiply_by_quantized_multiplier`...),
  which schemes put into the graph so TVM computes it;
* :class:`QGraph`, the editable view of ``main`` that schemes rewrite.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np


# ------------------------------------------------------------------ numpy


def quantize_multiplier(real: float) -> tuple[int, int]:
    """TFLite's QuantizeMultiplier: ``real ~= M * 2**(shift - 31)``, M in [2**30, 2**31)."""
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


#: how a kernel rounds in MultiplyByQuantizedMultiplier (TF 2.21's reference kernels use both)
DOUBLE = "double"  # SaturatingRoundingDoublingHighMul, then RoundingDivideByPOT: ties away from zero
SINGLE = "single"  # (x * M + 2**(30 - shift)) >> (31 - shift): one rounding, ties up
#: the int64 accumulator's variant (TFLite's 16x8 kernels): M rounded to 16 bits, one rounding, ties up
WIDE = "wide"
#: no fixed point: the int64 sum times the double real scale, rounded half away from zero (TFLite's
#: FULLY_CONNECTED on int16 activations); the record holds the real scale per channel, ``scale``
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
    """TFLite's 16-bit multiplier of an int64 accumulator: ``(M + 2**15) >> 16``, at most 0x7FFF."""
    m = _as64(m)
    return np.where(m < 0x7FFF0000, (m + (1 << 15)) >> 16, 0x7FFF)


def multiply_by_quantized_multiplier(x, multiplier, shift, rounding: str = DOUBLE) -> np.ndarray:
    """TFLite's MultiplyByQuantizedMultiplier, in either of its rounding builds."""
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
    """C's ``round``/``roundf`` (TFLite's ``TfLiteRound``): half away from zero, in ``v``'s float
    type and exact (``|v| - floor(|v|)`` is exact; ``floor(|v| + 0.5)`` is not for the largest
    value below one half)."""
    v = np.asarray(v)
    a = np.abs(v)
    r = np.floor(a)
    return np.copysign(r + (a - r >= 0.5).astype(r.dtype), v)


def tflite_quantize_value(v: float, scale: float, zero_point: int) -> int | None:
    """TFLite's ``Quantize`` of one float (kernel_util.cc, for a fused activation's bounds):
    ``zero_point + TfLiteRound(float(v) / float(scale))``, a float32 division rounded half away
    from zero; None when the rounded quotient is beyond int32 (TFLite then refuses the model)."""
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
    from irgen.api import IrgenError

    s = np.asarray(scale, dtype=np.float32).reshape(-1)
    z = np.asarray(zero_point).astype(np.int64).reshape(-1)
    if s.size and np.any(np.isposinf(s)):
        raise IrgenError(
            f"{scheme}: tensor {tensor!r} has an infinite scale ({s.tolist()[:4]}): the quantizer calibrated a "
            f"tensor holding an infinite or float32-extreme value (an attention mask's -inf or finfo.min), and "
            f"every value of it dequantizes to NaN or an infinity; quantize the model without that node "
            f"(onnxruntime's quantize_static: nodes_to_exclude, or op_types_to_quantize without it)")
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
    """ONNX Runtime's (MLAS) requantization: ``float32(acc) * float32 scale``,
    clamped to ``[lo - zp, hi - zp]``, rounded half to even, plus ``zp``."""
    f = np.asarray(acc).astype(np.float32) * np.asarray(scale, np.float32)
    f = np.clip(f, np.float32(lo - zero_point), np.float32(hi - zero_point))
    return (np.rint(f).astype(np.int64) + zero_point).astype(dtype)


def quantize_linear(x, scale, zero_point, dtype: str, bounds: tuple[int, int] | None = None) -> np.ndarray:
    """ONNX QuantizeLinear as ONNX Runtime computes it: ``x / scale`` in float32,
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


def quantize_value_ort(y, scale, zero_point: int, dtype: str) -> np.ndarray:
    """ONNX Runtime's ``quantize_value`` of its QLinear pooling kernels: ``y / scale + zp`` in
    float32 (the zero point added before rounding), rounded half to even, saturated."""
    info = np.iinfo(dtype)
    f = np.asarray(y, np.float32) / np.asarray(scale, np.float32) + np.float32(zero_point)
    return np.clip(np.rint(f), info.min, info.max).astype(dtype)


def accumulate(layer: dict[str, Any], inputs: list[np.ndarray], params: dict[str, np.ndarray]) -> np.ndarray:
    """The int64 accumulator of a quantized conv/dense layer: ``sum((x - zp_x) * w) + bias``."""
    from irgen.reference import conv2d

    qr = layer["quant"]
    x = inputs[0].astype(np.int64) - int(np.asarray(qr["inputs"][0]["zero_point"]).reshape(-1)[0])
    w = params["weight"].astype(np.int64)
    acc = x @ w if qr["kind"] == "dense" else conv2d(x, w, {**layer["attrs"], "out_dtype": "int64"})
    if "bias" in params:
        acc = acc + per_axis(params["bias"].reshape(-1).astype(np.int64), qr["requant"]["axis"], acc.ndim)
    return acc


#: (scheme, quant kind) -> ``fn(layer, inputs, params)``: layer kinds a scheme plugin
#: recomputes itself (its realization and recompute side by side); see :func:`register_recompute`
RECOMPUTE: dict[tuple[str, str], Any] = {}
_SCHEMES_LOADED: set[str] = set()


def register_recompute(scheme: str, kind: str, fn) -> None:
    """Make ``fn(layer, inputs, params) -> np.ndarray`` verify's numpy recompute of the layers whose
    ``quant`` record says ``{"scheme": scheme, "kind": kind}``: the integer output the layer must
    produce from its integer inputs and parameters alone. ``kind="*"`` is the scheme's recompute of
    every kind it registers nothing more specific for. Call it when the plugin module is imported
    (``irgen verify`` imports the plugin named after the scheme on first use). A layer whose scheme
    registers no recompute for its kind is checked with its ``fused_ops`` alone, and verify says so.

    The integer arithmetic of the built-in schemes is there to reuse: :func:`recompute_requantized`
    (TFLite's kernels: MultiplyByQuantizedMultiplier requantization), :func:`recompute_qdq`
    (ONNX Runtime's CPU kernels), :func:`recompute_pow2` (power-of-two shifts)."""
    RECOMPUTE[(scheme, kind)] = fn


#: scheme -> ``fn(layer) -> str | None``: why a layer's derived requantization values disagree
#: with its scales (see :func:`register_consistency`)
CONSISTENCY: dict[str, Any] = {}


def register_consistency(scheme: str, fn) -> None:
    """Make ``fn(layer) -> str | None`` verify's check that a conv/dense layer's derived
    requantization values (multipliers, shifts, requant scales) still follow from the scales
    beside them in its ``quant`` record (a scale edited in ``ir.json`` is caught even where the
    arithmetic does not read it); None when they agree. Without one, verify checks a
    ``requant.scale`` against ``s_x * s_w / s_y``."""
    CONSISTENCY[scheme] = fn


def scheme_consistency(scheme: str):
    """The consistency check ``scheme`` registered (its plugin imported on first use), or None."""
    _load_scheme_plugin(scheme)
    return CONSISTENCY.get(scheme)


def _load_scheme_plugin(scheme: str) -> None:
    """Import the scheme's plugin (the ``irgen`` entry point named after the scheme) once, so
    that its registrations exist and ``irgen verify`` needs no plugin host."""
    if scheme in _SCHEMES_LOADED:
        return
    _SCHEMES_LOADED.add(scheme)
    import importlib.metadata

    for ep in importlib.metadata.entry_points(group="irgen", name=scheme):
        try:
            ep.load()
        except Exception:  # noqa: BLE001  a broken plugin: the layer falls back to fused_ops
            pass


def scheme_recompute(scheme: str, kind: str):
    """The plugin recompute of ``kind`` (or the scheme's ``"*"`` one), its plugin imported on first use."""
    if (scheme, kind) not in RECOMPUTE:
        _load_scheme_plugin(scheme)
    return RECOMPUTE.get((scheme, kind)) or RECOMPUTE.get((scheme, "*"))


def recompute(layer: dict[str, Any], inputs: list[np.ndarray], params: dict[str, np.ndarray]) -> np.ndarray:
    """A realized integer layer from its ``quant`` record and parameters alone.

    This is the arithmetic a hardware engineer reproduces; it does not read
    ``fused_ops``. The layer's scheme provides it (:func:`register_recompute`); irgen
    knows no scheme by name. Raises NotImplementedError when the scheme registers none.
    """
    qr = layer["quant"]
    if qr.get("steps") is not None:  # a backend's fusion rule merged layers that requantize
        return _as_output(_recompute_steps(layer, inputs, params), layer)
    kind = qr["kind"]
    fn = scheme_recompute(qr["scheme"], kind)
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


def _recompute_steps(layer: dict[str, Any], inputs: list[np.ndarray], params: dict[str, np.ndarray]) -> np.ndarray:
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
        results.append(np.asarray(recompute(part, values, params)))
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
    """``y`` in the shape of the layer's output record when only the shape differs: TFLite's
    FULLY_CONNECTED flattens a [1, 1, 1, K] input and writes [1, N]."""
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


def recompute_requantized(layer: dict[str, Any], inputs: list[np.ndarray], params: dict[str, np.ndarray]) -> np.ndarray:
    """TFLite's integer kernels from a ``quant`` record: conv2d, depthwise_conv2d, dense, add,
    mean, avg_pool2d, concatenate, softmax (its table is parameter ``table``), integer (plain
    int8 ops: max pool, reshape...)."""
    from irgen.reference import conv2d

    qr = layer["quant"]
    kind = qr["kind"]
    out = qr["output"]
    lo, hi = qr.get("clamp") or (np.iinfo(out["dtype"]).min, np.iinfo(out["dtype"]).max)
    zp_in = [int(np.asarray(i["zero_point"]).reshape(-1)[0]) for i in qr["inputs"]]
    rq = qr.get("requant") or {}
    if kind in ("conv2d", "depthwise_conv2d", "dense"):
        acc = accumulate(layer, inputs, params)
        axis = rq["axis"]
        if rq["rounding"] == FLOAT64:
            y = rescale_float64(acc, per_axis(rq["scale"], axis, acc.ndim))
        else:
            y = multiply_by_quantized_multiplier(
                acc, per_axis(rq["multiplier"], axis, acc.ndim), per_axis(rq["shift"], axis, acc.ndim), rq["rounding"]
            )
    elif kind == "add":
        ls = rq["left_shift"]
        scaled = [
            multiply_by_quantized_multiplier((inp.astype(np.int64) - z) << ls, m, s, rq["rounding"])
            for inp, z, m, s in zip(inputs, zp_in, rq["input_multiplier"], rq["input_shift"])
        ]
        y = multiply_by_quantized_multiplier(scaled[0] + scaled[1], rq["multiplier"], rq["shift"], rq["rounding"])
    elif kind == "mean":
        acc = np.sum(inputs[0].astype(np.int64) - zp_in[0], axis=tuple(qr["axes"]), keepdims=qr["keepdims"])
        y = multiply_by_quantized_multiplier(acc, rq["multiplier"], rq["shift"], rq["rounding"])
    elif kind == "avg_pool2d":
        p = qr["pool"]
        x = inputs[0].astype(np.int64)
        c = x.shape[p["layout"].index("C")]
        kh, kw = p["size"]
        attrs = {"strides": p["strides"], "padding": p["padding"], "groups": c, "data_layout": p["layout"],
                 "kernel_layout": "OIHW", "out_dtype": "int64"}
        ones = np.ones((c, 1, kh, kw), np.int64)
        total = conv2d(x, ones, attrs)
        count = conv2d(np.ones_like(x), ones, attrs)
        return np.clip(divide_round_half_away(total, count), lo, hi).astype(out["dtype"])
    elif kind == "concatenate":
        return np.concatenate(inputs, axis=qr["axis"])
    elif kind == "softmax":
        return tflite_softmax(inputs[0], params["table"], out["scale"], int(out["zero_point"]), lo, hi, out["dtype"])
    elif kind == "integer":  # max pool, reshape...: plain int8 ops, their attrs say all
        from irgen.reference import run_layer

        return run_layer(layer, inputs, params)[0]
    else:
        raise NotImplementedError(f"quant kind {kind!r}")
    return np.clip(y + int(out["zero_point"]), lo, hi).astype(out["dtype"])


def ort_softmax_table(x_scale: float, reduce_len: int, signed: bool) -> np.ndarray:
    """ONNX Runtime's QLinearSoftmax table (``QlinearBuildLookupTableUint32``, float
    entries): ``exp((i - 255 + b) * s_x)`` in double, with the headroom shift
    ``b = max(0, log(FLT_MAX / n) - 5) / s_x``, at index ``i`` (``uint8(i - 128)`` for int8)."""
    xs = float(np.float32(x_scale))
    shift = max(0.0, float(np.log(np.float64(np.float32(np.finfo(np.float32).max) / np.float32(reduce_len)))) - 5.0) / xs
    i = np.arange(256, dtype=np.float64)
    vals = np.exp((i - 255.0 + shift) * xs).astype(np.float32)
    table = np.empty(256, np.float32)
    table[((np.arange(256) - 128) & 255) if signed else np.arange(256)] = vals
    return table


def ort_softmax(x, table, y_scale: float, y_zero_point: int, dtype: str) -> np.ndarray:
    """ONNX Runtime's QLinearSoftmax over the last axis: ``e = table[x - max + 127 (int8)
    or + 255 (uint8)]``, a float32 sum in row order, ``rint(e * floor(1 / s_y) / sum) + zp``
    saturated to the type. ONNX Runtime 1.32 gives the quotient of float64 arithmetic: finite
    where the float32 product ``e * floor(1 / s_y)`` overflows (one element, whose table entry is
    ``FLT_MAX / e^5``; an output scale calibrated below 1/256, as ``quantize_static`` leaves a
    softmax that only a quantized MatMul reads), and results above the type's maximum saturate."""
    from irgen.reference import sum_in_order

    xi = np.asarray(x).astype(np.int64)
    signed = dtype == "int8"
    idx = ((127 if signed else 255) - xi.max(axis=-1, keepdims=True) + xi) & 255
    e = np.asarray(table, np.float32)[idx]
    total = sum_in_order(e, axis=-1, keepdims=True)
    ys = np.float64(np.floor(np.float32(1.0) / np.float32(y_scale)))
    v = np.rint(e.astype(np.float64) * ys / total.astype(np.float64)) + int(y_zero_point)
    lo, hi = (-128, 127) if signed else (0, 255)
    return np.clip(v, lo, hi).astype(np.int8 if signed else np.uint8)


def tflite_softmax_table(input_scale: float, beta: float = 1.0) -> np.ndarray:
    """TFLite's int8 softmax table (``PopulateSoftmaxLookupTable``), float32:
    ``table[255 - v] = expf(float32(-input_scale * beta) * v)`` for v in 0..255."""
    s = np.float32(-np.float32(input_scale) * np.float32(beta))
    arg = s * np.arange(256, dtype=np.float32)
    return np.exp(arg.astype(np.float64)).astype(np.float32)[::-1].copy()


def tflite_softmax(x, table, out_scale: float, out_zero_point: int, lo: int, hi: int, dtype: str) -> np.ndarray:
    """TFLite's int8 softmax over the last axis (``optimized_ops::Softmax`` with
    the table, which the reference resolver runs too): ``e = table[x - max + 255]``,
    a float32 sum in row order, ``p = e * (1 / (sum * out_scale))`` in float32,
    rounded half away from zero, plus the zero point, clamped."""
    from irgen.reference import sum_in_order

    xi = np.asarray(x).astype(np.int64)
    e = np.asarray(table, np.float32)[xi - xi.max(axis=-1, keepdims=True) + 255]
    total = sum_in_order(e, axis=-1, keepdims=True)  # in row order, as the C loop
    inv = np.float32(1.0) / (total * np.float32(out_scale))
    p = e * inv
    r = np.floor(p)
    r = r + (p - r >= np.float32(0.5))
    return np.clip(r.astype(np.int64) + int(out_zero_point), lo, hi).astype(dtype)


def round_shift_half_even(acc, shift) -> np.ndarray:
    """``round_half_even(acc / 2**shift)`` in integers (``shift`` may be negative)."""
    acc, shift = _as64(acc), _as64(shift)
    s = shift + 1
    a = acc << (1 + np.maximum(-shift, 0))
    s = np.maximum(s, 1)
    quo, rem, half = a >> s, a & ((np.int64(1) << s) - 1), np.int64(1) << (s - 1)
    return quo + (rem > half) + (rem == half) * (quo & 1)


def recompute_pow2(layer: dict[str, Any], inputs: list[np.ndarray], params: dict[str, np.ndarray]) -> np.ndarray:
    """A ``pow2`` convolution or dense layer: int32 accumulation, then a rounding shift per channel."""
    qr = layer["quant"]
    rq, out = qr["requant"], qr["output"]
    acc = accumulate(layer, inputs, params)
    y = round_shift_half_even(acc, per_axis(rq["shift"], rq["axis"], acc.ndim)) + int(out["zero_point"])
    lo, hi = qr["clamp"]
    return np.clip(y, lo, hi).astype(out["dtype"])


def recompute_qdq(layer: dict[str, Any], inputs: list[np.ndarray], params: dict[str, np.ndarray]) -> np.ndarray:
    """The ``qdq`` scheme's layers (ONNX Runtime's CPU kernels) from ``quant`` and parameters."""
    from irgen.reference import conv2d

    qr = layer["quant"]
    kind = qr["kind"]
    out = qr["output"]
    zp_in = [int(np.asarray(i["zero_point"]).reshape(-1)[0]) for i in qr["inputs"]]
    rq = qr.get("requant") or {}
    if qr.get("constants"):  # integer constants as operands (QLinearAdd/QLinearMul with an initializer;
        # torch: an add of a quantized constant buffer)
        inputs, it = [], iter(inputs)
        for k in range(len(qr["inputs"])):
            c = qr["constants"].get(str(k))
            inputs.append(next(it) if c is None else np.asarray(c["values"], qr["inputs"][k]["dtype"]).reshape(c["shape"]))
    if qr.get("reference") == "torch":  # torch reference-quantized graphs (the torch frontend)
        return _recompute_torch(layer, inputs, params)
    if kind in ("conv2d", "depthwise_conv2d", "dense"):
        acc = accumulate(layer, inputs, params)
        axis = rq["axis"]
        lo, hi = qr["clamp"]
        return requantize_float(acc.astype(np.int32), per_axis(np.asarray(rq["scale"], np.float32), axis, acc.ndim),
                                int(out["zero_point"]), lo, hi, out["dtype"])
    elif kind == "add":
        ra, rb = (np.float32(v) for v in rq["scale"])
        const = np.float32(rq["constant"])
        # fma(x_a, ra, fma(x_b, rb, const)), each rounded once to float32 (float64 holds them exactly)
        t = (inputs[1].astype(np.float64) * np.float64(rb) + np.float64(const)).astype(np.float32)
        f = (inputs[0].astype(np.float64) * np.float64(ra) + t.astype(np.float64)).astype(np.float32)
        lo, hi = qr["clamp"]
        return np.clip(np.rint(f), lo, hi).astype(out["dtype"])
    elif kind == "global_avg_pool":
        acc = np.sum(inputs[0].astype(np.int64), axis=tuple(qr["axes"]), keepdims=True) - zp_in[0] * rq["count"]
        lo, hi = qr["clamp"]
        return requantize_float(acc.astype(np.int32), np.float32(rq["scale"]), int(out["zero_point"]), lo, hi, out["dtype"])
    elif kind == "avg_pool2d":
        p = qr["pool"]
        deq = (inputs[0].astype(np.int32) - zp_in[0]).astype(np.float32) * np.float32(qr["inputs"][0]["scale"])
        # the window's values summed in float32 in row-major order (TVM's avg_pool2d, ORT's
        # QLinearAveragePool), / count, then ORT's quantize_value (zp added before rounding)
        return quantize_value_ort(_avg_pool_in_order(deq, p), out["scale"], int(out["zero_point"]), out["dtype"])
    elif kind == "softmax":  # QLinearSoftmax; another axis than the last is moved there and back, as ORT does
        axis = int(qr.get("axis", -1))
        x = np.moveaxis(inputs[0], axis, -1)
        y = ort_softmax(x, params["table"], out["scale"], int(out["zero_point"]), out["dtype"])
        return np.moveaxis(y, -1, axis)
    elif kind == "mul":  # MLAS QLinearMul
        prod = (inputs[0].astype(np.int32) - zp_in[0]) * (inputs[1].astype(np.int32) - zp_in[1])
        f = prod.astype(np.float32) * np.float32(rq["scale"]) + np.float32(out["zero_point"])
        lo, hi = qr["clamp"]
        return np.clip(np.rint(f), lo, hi).astype(out["dtype"])
    elif kind == "lut":  # a table (then, for a requantizing Slice, Transpose, MaxPool..., the data movement)
        table = np.asarray(qr["table"], qr["output"]["dtype"])
        lo = np.iinfo(qr["inputs"][0]["dtype"]).min
        t = table[inputs[0].astype(np.int64) - lo]
        return move_after_table(layer, t, inputs, params) if qr.get("op") in MOVES else t
    elif kind == "concatenate":  # operands[k]: the layer input that is operand k (default: input k)
        parts = []
        for k, at in enumerate(qr.get("operands") or range(len(qr["tables"]))):
            inp, t = inputs[at], qr["tables"][k]
            parts.append(inp if t is None else np.asarray(t, out["dtype"])[inp.astype(np.int64) - np.iinfo(inp.dtype).min])
        return np.concatenate(parts, axis=qr["axis"])
    elif kind == "quantize":
        return quantize_linear(inputs[0], np.float32(out["scale"]), int(out["zero_point"]), out["dtype"])
    elif kind == "dequantize":
        i = qr["inputs"][0]
        return (inputs[0].astype(np.int32) - int(i["zero_point"])).astype(np.float32) * np.float32(i["scale"])
    raise NotImplementedError(f"qdq quant kind {kind!r}")


#: the data movements a ``lut`` record may name: the table is applied, then the move (the layer's
#: last op, with its attributes) moves the integers
MOVES = frozenset({"nn.max_pool2d", "reshape", "permute_dims", "flatten", "squeeze", "expand_dims", "take",
                   "strided_slice"})


def move_after_table(layer: dict[str, Any], t: np.ndarray, inputs: list[np.ndarray],
                     params: dict[str, np.ndarray]) -> np.ndarray:
    """The data movement of a ``lut`` layer applied to its table's output ``t``: the layer's last
    op (which must be that move) with ``t`` as its data operand."""
    from irgen.reference import UnsupportedLayer, run_layer

    op = layer["quant"]["op"]
    ops = layer.get("fused_ops") or []
    last = dict(ops[-1]) if ops else {}
    if (last.get("relax_op") or last.get("op")) != f"relax.{op}" or not last.get("args"):
        raise UnsupportedLayer(layer.get("name", "?"), op, "the table's data movement is not the layer's last op")
    last["args"] = ["input:0", *last["args"][1:]]
    return run_layer({"name": layer.get("name", "?"), "fused_ops": [last]}, [t, *inputs[1:]], params)[0]


def pool_windows(hw, p: dict):
    """The windows of a 2-D average pool (``p`` as a layer's ``quant.pool`` records it) over an
    ``hw`` input: kernel, strides, output size, the padding that makes every window whole (in
    ceil mode zeros past the declared padding, as ONNX Runtime and torch size the output: the
    last window starts inside the input or its leading padding) and each output's count, float32
    [oh, ow], as ONNX Runtime's QLinearAveragePool divides: the input's values in the window, or
    the whole kernel when padding counts (past the padding too, where its float AveragePool
    would not count the part past it: measured on ORT 1.32, tests/test_qdq_exporter_patterns.py)."""
    (kh, kw), (sh, sw), (pt, pl, pb, pr) = p["size"], p["strides"], p["padding"]
    (h, w), out = hw, []
    for n, k, s, lead, trail in ((h, kh, sh, pt, pb), (w, kw, sw, pl, pr)):
        span = n + lead + trail - k
        o = (-(-span // s) if p.get("ceil_mode") else span // s) + 1
        if p.get("ceil_mode") and (o - 1) * s >= n + lead:
            o -= 1
        out.append(o)
    (oh, ow) = out
    eh, ew = max(0, (oh - 1) * sh + kh - (h + pt + pb)), max(0, (ow - 1) * sw + kw - (w + pl + pr))
    if p["count_include_pad"]:
        count = np.full((oh, ow), np.float32(kh * kw))
    else:
        one = np.pad(np.ones((h, w), np.float32), ((pt, pb + eh), (pl, pr + ew)))
        count = np.zeros((oh, ow), np.float32)
        for i in range(kh):
            for j in range(kw):
                count = count + one[i:i + sh * (oh - 1) + 1:sh, j:j + sw * (ow - 1) + 1:sw]
    return (kh, kw), (sh, sw), (oh, ow), (pt, pl, pb + eh, pr + ew), count


def _avg_pool_in_order(deq: np.ndarray, p: dict) -> np.ndarray:
    """NCHW average pool in float32: each window's in-bounds values added in row-major order, / count
    (:func:`pool_windows`)."""
    (kh, kw), (sh, sw), (oh, ow), (pt, pl, pb, pr), count = pool_windows(deq.shape[2:], p)
    x = np.pad(deq.astype(np.float32), ((0, 0), (0, 0), (pt, pb), (pl, pr)))
    total = np.zeros((*x.shape[:2], oh, ow), np.float32)
    for i in range(kh):
        for j in range(kw):
            total = total + x[:, :, i:i + sh * (oh - 1) + 1:sh, j:j + sw * (ow - 1) + 1:sw]
    return total / count


def torch_quantize(x, scale, zero_point: int, lo: int, hi: int, dtype: str) -> np.ndarray:
    """torch's quantized_decomposed.quantize_per_tensor: ``round_half_even(x * float32(1/scale)) + zp``, clamped."""
    inv = np.float32(1.0 / float(np.float32(scale)))
    f = np.asarray(x, np.float32) * inv
    return np.clip(np.rint(f).astype(np.int64) + zero_point, lo, hi).astype(dtype)


def _recompute_torch(layer: dict[str, Any], inputs: list[np.ndarray], params: dict[str, np.ndarray]) -> np.ndarray:
    """``qdq`` layers of torch reference graphs: the float op on dequantized values, then torch's quantize."""
    qr = layer["quant"]
    kind, out, rq = qr["kind"], qr["output"], qr.get("requant") or {}
    info = np.iinfo(out["dtype"])
    lo, hi = qr.get("clamp") or out.get("range") or (int(info.min), int(info.max))
    if kind in ("conv2d", "depthwise_conv2d", "dense"):
        acc = accumulate(layer, inputs, params)
        axis = rq["axis"]
        f = acc.astype(np.float32) * per_axis(np.asarray(rq["scale"], np.float32), axis, acc.ndim)
        if rq.get("float_bias") is not None:
            f = f + per_axis(np.asarray(rq["float_bias"], np.float32), axis, acc.ndim)
        return torch_quantize(f, out["scale"], int(out["zero_point"]), lo, hi, out["dtype"])
    deq = [(x.astype(np.int32) - int(i["zero_point"])).astype(np.float32) * np.float32(i["scale"])
           for x, i in zip(inputs, qr["inputs"])]
    if kind == "global_avg_pool_float":  # a float32 sum in row-major order (as TVM's reduction), / count
        from irgen.reference import sum_in_order

        flat = deq[0].reshape(*deq[0].shape[:2], -1)
        m = (sum_in_order(flat, axis=2) / np.float32(flat.shape[2])).reshape(*flat.shape[:2], 1, 1)
        return torch_quantize(m, out["scale"], int(out["zero_point"]), lo, hi, out["dtype"])
    if kind == "add":  # dequantize, float32 add, (relu: the clamp), quantize
        return torch_quantize(deq[0] + deq[1], out["scale"], int(out["zero_point"]), lo, hi, out["dtype"])
    if kind == "mul":  # dequantize, float32 multiply, quantize
        return torch_quantize(deq[0] * deq[1], out["scale"], int(out["zero_point"]), lo, hi, out["dtype"])
    if kind == "avg_pool2d":  # torch's CPU kernel: the window's in-bounds values summed in row-major order, / count
        return torch_quantize(_avg_pool_in_order(deq[0], qr["pool"]), out["scale"], int(out["zero_point"]),
                              lo, hi, out["dtype"])
    if kind == "concatenate":  # tables, as the qdq record (its constants are in ``inputs`` already)
        return recompute_qdq({**layer, "quant": {k: v for k, v in qr.items() if k not in ("reference", "constants")}},
                             inputs, params)
    if kind == "quantize":
        return torch_quantize(inputs[0], out["scale"], int(out["zero_point"]), lo, hi, out["dtype"])
    if kind == "lut":  # a table, then (for reshape/flatten...) the data movement
        lo_in = np.iinfo(qr["inputs"][0]["dtype"]).min
        t = np.asarray(qr["table"], out["dtype"])[inputs[0].astype(np.int64) - lo_in]
        if qr.get("op") in ("reshape", "flatten", "squeeze", "expand_dims"):
            t = t.reshape(layer["outputs"][-1]["shape"])
        elif qr.get("op") in MOVES:
            t = move_after_table(layer, t, inputs, params)
        elif qr.get("op") not in ("nn.relu", "sigmoid", "tanh", "clip", "requantize", "nn.silu", "nn.gelu",
                                   "hardswish", "hardsigmoid"):
            raise NotImplementedError(f"torch-reference table before {qr.get('op')!r}")
        return t
    raise NotImplementedError(f"torch-reference quant kind {kind!r}")


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
    ``nan_to_lo``: a NaN becomes ``lo`` (ONNX Runtime's QuantizeLinear); else what the clip makes of it."""
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
    from irgen.api import IrgenError
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
      it (``"onnx-qdq"``, ``"torch-qdq"``, ``"tflite"``: :data:`irgen.api.QUANT_DIALECTS`);
      a scheme detects the dialects it realizes, never a frontend by name.
    * ``frontend``: the name of the frontend that imported the model (informative).
    * ``ranges``: a quantized tensor's binding name -> its integer range, when narrower
      than its dtype's (:attr:`irgen.api.ImportedModel.quant_ranges`).
    * ``bindings``: ``main``'s bindings in order, each an :class:`irgen.graph.Binding`
      (``name``, ``var``, ``value``; ``op`` is the Relax op name such as
      ``"relax.nn.conv2d"`` for a call, else None).
    * ``by_name``: binding name -> binding; ``users``: binding name -> indices into
      ``bindings`` of the bindings that read it (kept current by :meth:`replace`).
    * ``quant``: binding name -> the layer's ``quant`` record, which becomes the
      ``quant`` of the IR layer whose output is that binding. It must hold
      ``"scheme"`` (the scheme's name: verify finds the recompute registered with
      :func:`register_recompute` by it), ``"kind"``, ``"inputs"`` and ``"output"``
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
    bindings: list = field(default_factory=list)
    quant: dict[str, dict[str, Any]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        from irgen.graph import main_bindings

        _, self.bindings = main_bindings(self.mod)
        self._pending: list = []
        self._count = 0
        #: binding name -> the names of the bindings :meth:`replace` folded into it (the span's
        #: quantize/dequantize and compute ops): the layer's ``source`` lists their nodes
        self.folded: dict[str, list[str]] = {}
        self._index()

    def emit(self, expr):
        """Bind one op (whose arguments are variables or constants) to a new
        unnamed variable; the binding lands before the next :meth:`replace`."""
        from tvm import relax

        from irgen.graph import Binding

        expr = relax.BlockBuilder().normalize(expr)
        var = relax.DataflowVar(f"iq{self._count}", expr.ty)
        self._count += 1
        self._pending.append(Binding(var.name, var, expr))
        return var

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
