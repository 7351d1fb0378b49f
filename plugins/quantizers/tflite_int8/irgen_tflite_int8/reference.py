"""TFLite's reference integer kernels in numpy: verify's recompute of the ``tflite-int8``
layers from their ``quant`` records (:func:`recompute_requantized`: the requantizing kernels,
``MultiplyByQuantizedMultiplier`` in the rounding the record names), and the int8 softmax with
its table (:func:`tflite_softmax_table`, which the realization puts into the graph too)."""

from __future__ import annotations

from typing import Any

import numpy as np

from irgen.plugin import (FLOAT64, accumulate, divide_round_half_away, multiply_by_quantized_multiplier, per_axis,
                          rescale_float64, run_layer, run_op, sum_in_order)


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
    xi = np.asarray(x).astype(np.int64)
    e = np.asarray(table, np.float32)[xi - xi.max(axis=-1, keepdims=True) + 255]
    total = sum_in_order(e, axis=-1, keepdims=True)  # in row order, as the C loop
    inv = np.float32(1.0) / (total * np.float32(out_scale))
    p = e * inv
    r = np.floor(p)
    r = r + (p - r >= np.float32(0.5))
    return np.clip(r.astype(np.int64) + int(out_zero_point), lo, hi).astype(dtype)


def _int32(acc: np.ndarray) -> np.ndarray:
    """``acc`` (int64) as TFLite's 8-bit kernels hold it: an int32 that wraps around. A bias the
    quantizer saturated (ai-edge-quantizer writes ``-2**31`` when a tiny input scale puts it out
    of range) plus the products overflows there, and the interpreter (and the realized graph,
    int32 too) goes on with the wrapped value."""
    return ((acc.astype(np.int64) + (1 << 31)) % (1 << 32) - (1 << 31)).astype(np.int64)


def recompute_requantized(layer: dict[str, Any], inputs: list[np.ndarray], params: dict[str, np.ndarray]) -> np.ndarray:
    """TFLite's integer kernels from a ``quant`` record (the scheme's ``"*"`` recompute): conv2d,
    depthwise_conv2d, dense, add, mean, avg_pool2d, concatenate, softmax (its table is parameter
    ``table``), integer (plain int8 ops: max pool, reshape...)."""
    qr = layer["quant"]
    kind = qr["kind"]
    out = qr["output"]
    lo, hi = qr.get("clamp") or (np.iinfo(out["dtype"]).min, np.iinfo(out["dtype"]).max)
    zp_in = [int(np.asarray(i["zero_point"]).reshape(-1)[0]) for i in qr["inputs"]]
    rq = qr.get("requant") or {}
    if kind in ("conv2d", "depthwise_conv2d", "dense"):
        acc = accumulate(layer, inputs, params)
        if str(qr["inputs"][0]["dtype"]) in ("int8", "uint8"):
            acc = _int32(acc)  # the 8-bit kernels' accumulator, bias added: int32, wrapping as the CPU does
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
        total = run_op("relax.nn.conv2d", [x, ones], attrs, layer.get("name", "?"))
        count = run_op("relax.nn.conv2d", [np.ones_like(x), ones], attrs, layer.get("name", "?"))
        return np.clip(divide_round_half_away(total, count), lo, hi).astype(out["dtype"])
    elif kind == "concatenate":
        return np.concatenate(inputs, axis=qr["axis"])
    elif kind == "softmax":
        return tflite_softmax(inputs[0], params["table"], out["scale"], int(out["zero_point"]), lo, hi, out["dtype"])
    elif kind == "integer":  # max pool, reshape...: plain int8 ops, their attrs say all
        return run_layer(layer, inputs, params)[0]
    else:
        raise NotImplementedError(f"quant kind {kind!r}")
    return np.clip(y + int(out["zero_point"]), lo, hi).astype(out["dtype"])
