"""``irgen verify``'s numpy recompute of the ``acme-qdq`` layers, from ``quant`` and the parameters.

Each function gets ``(layer, inputs, params)`` (the IR layer, its integer input
arrays, its parameter arrays) and returns the integer output the acme NPU
computes; it never reads the layer's ``fused_ops``. Every zero point is 0 (the
scheme refuses other models), so no function subtracts one.
"""

from __future__ import annotations

import numpy as np

import irgen_qdq
from irgen.plugin import multiply_by_quantized_multiplier, per_axis, quantize_linear, requantize_float, run_op


def _clamped(y, qr) -> np.ndarray:
    lo, hi = qr["clamp"]
    return np.clip(y, lo, hi).astype(qr["output"]["dtype"])


def mac(layer, inputs, params) -> np.ndarray:
    """conv2d, depthwise_conv2d, dense: an int64 accumulator (+ bias), then multiplier and shift per channel."""
    qr = layer["quant"]
    rq = qr["requant"]
    x, w = inputs[0].astype(np.int64), params["weight"].astype(np.int64)
    if qr["kind"] == "dense":
        acc = x @ w
    else:
        acc = run_op("relax.nn.conv2d", [x, w], {**layer["attrs"], "out_dtype": "int64"}, layer["name"])
    axis = rq["axis"]
    if "bias" in params:
        acc = acc + per_axis(params["bias"].reshape(-1).astype(np.int64), axis, acc.ndim)
    y = multiply_by_quantized_multiplier(acc, per_axis(rq["multiplier"], axis, acc.ndim),
                                         per_axis(rq["shift"], axis, acc.ndim), rq["rounding"])
    return _clamped(y, qr)


def add(layer, inputs, params) -> np.ndarray:
    """ONNX Runtime's QLinearAdd: ``rint(x_a * r_a + (x_b * r_b + c))``, each product-sum rounded once to float32."""
    qr = layer["quant"]
    ra, rb = (np.float64(np.float32(v)) for v in qr["requant"]["scale"])
    c = np.float64(np.float32(qr["requant"]["constant"]))
    t = (inputs[1].astype(np.float64) * rb + c).astype(np.float32)
    f = (inputs[0].astype(np.float64) * ra + t.astype(np.float64)).astype(np.float32)
    return _clamped(np.rint(f), qr)


def global_avg_pool(layer, inputs, params) -> np.ndarray:
    """The int32 sum over the spatial axes, requantized by one float32 scale (``scale = s_x / (count * s_y)``)."""
    qr = layer["quant"]
    acc = np.sum(inputs[0].astype(np.int64), axis=tuple(qr["axes"]), keepdims=True).astype(np.int32)
    lo, hi = qr["clamp"]
    return requantize_float(acc, np.float32(qr["requant"]["scale"]), 0, lo, hi, qr["output"]["dtype"])


def lut(layer, inputs, params) -> np.ndarray:
    """A 256-entry table indexed by ``x + 128`` (relu, sigmoid... on int8)."""
    qr = layer["quant"]
    return np.asarray(qr["table"], qr["output"]["dtype"])[inputs[0].astype(np.int64) + 128]


def quantize(layer, inputs, params) -> np.ndarray:
    """The model input: ``rint(x / s)``, saturated to int8."""
    out = layer["quant"]["output"]
    return quantize_linear(inputs[0], np.float32(out["scale"]), 0, out["dtype"])


def dequantize(layer, inputs, params) -> np.ndarray:
    """The model output: ``float32(x) * s``."""
    return inputs[0].astype(np.float32) * np.float32(layer["quant"]["inputs"][0]["scale"])


OWN = {"conv2d": mac, "depthwise_conv2d": mac, "dense": mac, "add": add, "global_avg_pool": global_avg_pool,
       "lut": lut, "quantize": quantize, "dequantize": dequantize}

#: kind -> recompute, the scheme's ``Quantizer.recompute``: the qdq realization's kinds
#: (concatenate...), then this plugin's own
RECOMPUTE = {**irgen_qdq.RECOMPUTE, **OWN}
