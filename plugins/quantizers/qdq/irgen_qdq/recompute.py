"""verify's recompute and consistency check of the ``qdq`` layers, from their ``quant`` records.

:data:`RECOMPUTE` maps each kind the realization records to its numpy recompute (``"*"``: every
kind without its own); the scheme registers it as ``Quantizer.recompute``, and so does a scheme
built on qdq (``pow2``), with its own entries over it. A record of a torch reference graph
(``"reference": "torch"``) is recomputed with torch's arithmetic (:mod:`irgen_qdq.torch_ref`),
any other with ONNX Runtime's (:func:`recompute_ort`). :func:`consistency` is
``Quantizer.consistency``: a conv/dense layer's requant scales follow from the scales beside them.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from irgen.plugin import (accumulate, per_axis, quantize_linear, requant_scale_mismatch, requant_scales,
                          requantize_float, run_layer)

from .blockwise import recompute_weight_only
from .common import MAC_KINDS
from .concat import recompute_concat
from .float8 import recompute_float8, recompute_float_dense
from .float_span import along, recompute_float
from .movement import MOVES, move_after_table
from .ort import avg_pool_in_order, ort_softmax, quantize_value_ort
from .torch_ref import recompute_torch
from .transformer import recompute_matmul


def recompute(layer: dict[str, Any], inputs: list[np.ndarray], params: dict[str, np.ndarray]) -> np.ndarray:
    """Any ``qdq`` layer (the ``"*"`` entry of :data:`RECOMPUTE`): a kind with a recompute of its own
    by that; else the integer constants its record holds become its operands, then torch's
    arithmetic (a torch reference graph's record) or ONNX Runtime's."""
    qr = layer["quant"]
    own = RECOMPUTE.get(qr["kind"])
    if own is not None and own is not recompute:  # a scheme that takes only "*" gets them too
        return own(layer, inputs, params)
    if qr.get("constants"):  # integer constants as operands (QLinearAdd/QLinearMul with an initializer;
        # torch: an add of a quantized constant buffer)
        inputs, it = [], iter(inputs)
        for k in range(len(qr["inputs"])):
            c = qr["constants"].get(str(k))
            inputs.append(next(it) if c is None else np.asarray(c["values"], qr["inputs"][k]["dtype"]).reshape(c["shape"]))
    if qr.get("reference") == "torch":  # torch reference-quantized graphs (the torch-qdq dialect)
        return recompute_torch(layer, inputs, params)
    return recompute_ort(layer, inputs, params)


def recompute_ort(layer: dict[str, Any], inputs: list[np.ndarray], params: dict[str, np.ndarray]) -> np.ndarray:
    """The ``qdq`` layers as ONNX Runtime's CPU kernels compute them, from ``quant`` and parameters
    (``inputs``: the operands, constants included)."""
    qr = layer["quant"]
    kind = qr["kind"]
    out = qr["output"]
    zp_in = [int(np.asarray(i["zero_point"]).reshape(-1)[0]) for i in qr["inputs"]]
    rq = qr.get("requant") or {}
    if kind in MAC_KINDS:
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
    elif kind in ("avg_pool2d", "avg_pool3d"):
        p = qr["pool"]
        deq = (inputs[0].astype(np.int32) - zp_in[0]).astype(np.float32) * np.float32(qr["inputs"][0]["scale"])
        # the window's values summed in float32 in row-major order (TVM's avg_pool2d, ORT's
        # QLinearAveragePool), / count, then ORT's quantize_value (zp added before rounding)
        return quantize_value_ort(avg_pool_in_order(deq, p), out["scale"], int(out["zero_point"]), out["dtype"])
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
    elif kind == "quantize":
        y = quantize_linear(inputs[0], np.float32(out["scale"]), int(out["zero_point"]), out["dtype"])
        return np.clip(y, *qr["clamp"]).astype(y.dtype) if "clamp" in qr else y
    elif kind == "dequantize":
        i, x = qr["inputs"][0], inputs[0]  # per tensor, or per channel along its axis
        return (x.astype(np.int32) - along(i["zero_point"], i, x.ndim, np.int32)).astype(np.float32) \
            * along(i["scale"], i, x.ndim, np.float32)
    raise NotImplementedError(f"qdq quant kind {kind!r}")


def recompute_integer(layer: dict[str, Any], inputs: list[np.ndarray], params: dict[str, np.ndarray]) -> np.ndarray:
    """An ``integer`` layer (max pool, reshape, a slice...: the integers moved as they are, no
    requantization): its ``fused_ops``, whose attributes say all."""
    return run_layer(layer, inputs, params)[0]


#: quant kind -> verify's recompute ``fn(layer, inputs, params)`` of the layers the realization
#: records; ``"*"``: every kind without its own (ONNX Runtime's kernels, or torch's arithmetic)
RECOMPUTE = {
    "*": recompute,
    "integer": recompute_integer,
    "float": recompute_float,
    "matmul": recompute_matmul,
    "concatenate": recompute_concat,
    "weight_only": recompute_weight_only,  # 4-bit block weights, float activations (irgen_qdq.blockwise)
    "float8": recompute_float8,  # float8 quantize -> dequantize (irgen_qdq.float8)
    "float_dense": recompute_float_dense,  # a float8 model's float MatMul in MLAS's order (irgen_qdq.float8)
}


def consistency(layer: dict[str, Any]) -> str | None:
    """Why a conv/dense layer's ``requant.scale`` does not follow from the scales beside it, or None:
    ``s_x * s_w[c] / s_y`` per channel (ONNX Runtime's requantization), ``s_x * s_w[c]`` with
    ``inverse_output_scale`` = ``1 / s_y`` in a torch reference graph's record."""
    qr = layer["quant"]
    if qr.get("reference") != "torch":
        return requant_scale_mismatch(layer)
    inv = (qr.get("requant") or {}).get("inverse_output_scale")
    scales = requant_scales(qr)
    if inv is not None and scales is not None and not np.isclose(inv, 1.0 / scales[2], rtol=1e-6, atol=0):
        return "requant inverse_output_scale does not follow from the output scale (1/s_y)"
    return requant_scale_mismatch(layer, lambda s_x, s_w, s_y: s_x * s_w)
