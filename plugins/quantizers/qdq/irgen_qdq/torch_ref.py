"""torch's reference arithmetic: the ``qdq`` layers of a torch reference-quantized graph (the
``torch-qdq`` dialect), whose records say ``"reference": "torch"``.

torch runs every op between a dequantize and a quantize in float32 on the dequantized values,
then ``quantize_per_tensor``: :func:`torch_quantize` multiplies by the float32 inverse scale
(not a division), rounds half to even and clamps. :func:`recompute_torch` is verify's recompute
of such a layer from its record.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from irgen.plugin import accumulate, per_axis, sum_in_order

from .movement import MOVES, move_after_table
from .ort import avg_pool_in_order


def torch_quantize(x, scale, zero_point: int, lo: int, hi: int, dtype: str) -> np.ndarray:
    """torch's quantized_decomposed.quantize_per_tensor: ``round_half_even(x * float32(1/scale)) + zp``, clamped."""
    inv = np.float32(1.0 / float(np.float32(scale)))
    f = np.asarray(x, np.float32) * inv
    return np.clip(np.rint(f).astype(np.int64) + zero_point, lo, hi).astype(dtype)


def recompute_torch(layer: dict[str, Any], inputs: list[np.ndarray], params: dict[str, np.ndarray]) -> np.ndarray:
    """``qdq`` layers of torch reference graphs: the float op on dequantized values, then torch's quantize
    (a ``concatenate`` layer is :func:`irgen_qdq.concat.recompute_concat`'s, as an ONNX one)."""
    qr = layer["quant"]
    kind, out, rq = qr["kind"], qr["output"], qr.get("requant") or {}
    info = np.iinfo(out["dtype"])
    lo, hi = qr.get("clamp") or out.get("range") or (int(info.min), int(info.max))
    if kind in ("conv2d", "depthwise_conv2d", "conv3d", "depthwise_conv3d", "dense"):
        acc = accumulate(layer, inputs, params)
        axis = rq["axis"]
        f = acc.astype(np.float32) * per_axis(np.asarray(rq["scale"], np.float32), axis, acc.ndim)
        if rq.get("float_bias") is not None:
            f = f + per_axis(np.asarray(rq["float_bias"], np.float32), axis, acc.ndim)
        return torch_quantize(f, out["scale"], int(out["zero_point"]), lo, hi, out["dtype"])
    deq = [(x.astype(np.int32) - int(i["zero_point"])).astype(np.float32) * np.float32(i["scale"])
           for x, i in zip(inputs, qr["inputs"])]
    if kind == "global_avg_pool_float":  # a float32 sum in row-major order (as TVM's reduction), / count
        flat = deq[0].reshape(*deq[0].shape[:2], -1)
        m = (sum_in_order(flat, axis=2) / np.float32(flat.shape[2])).reshape(*flat.shape[:2], *[1] * (deq[0].ndim - 2))
        return torch_quantize(m, out["scale"], int(out["zero_point"]), lo, hi, out["dtype"])
    if kind == "add":  # dequantize, float32 add, (relu: the clamp), quantize
        return torch_quantize(deq[0] + deq[1], out["scale"], int(out["zero_point"]), lo, hi, out["dtype"])
    if kind == "mul":  # dequantize, float32 multiply, quantize
        return torch_quantize(deq[0] * deq[1], out["scale"], int(out["zero_point"]), lo, hi, out["dtype"])
    if kind in ("avg_pool2d", "avg_pool3d"):  # torch's CPU kernel: the window's in-bounds values in row order, / count
        return torch_quantize(avg_pool_in_order(deq[0], qr["pool"]), out["scale"], int(out["zero_point"]),
                              lo, hi, out["dtype"])
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
