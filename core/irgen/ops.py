"""The layer-op vocabulary: the name each Relax op, source op and quantized layer gets in
``ir.json`` (``docs/layer-ops.md``), one name per computation whatever the frontend or
scheme called it."""

from __future__ import annotations

from typing import Any

from tvm import relax

from irgen.canonical import is_roll
from irgen.graph import Binding, Constant, tensor_type


# Relax op name -> layer op name (claim 3.1's classes and what real CNNs need).
OP_NAMES = {
    "relax.nn.conv2d": "conv2d",
    "relax.nn.conv2d_transpose": "conv2d_transpose",
    "relax.nn.conv1d": "conv1d",
    "relax.nn.conv3d": "conv3d",
    "relax.nn.conv3d_transpose": "conv3d_transpose",
    "relax.matmul": "matmul",
    "relax.add": "add",
    "relax.subtract": "subtract",
    "relax.multiply": "multiply",
    "relax.divide": "divide",
    "relax.nn.relu": "relu",
    "relax.clip": "clip",
    "relax.sigmoid": "sigmoid",
    "relax.tanh": "tanh",
    "relax.nn.max_pool2d": "max_pool2d",
    "relax.nn.avg_pool2d": "avg_pool2d",
    "relax.nn.adaptive_avg_pool2d": "global_avg_pool2d",
    "relax.nn.max_pool3d": "max_pool3d",
    "relax.nn.avg_pool3d": "avg_pool3d",
    "relax.nn.adaptive_avg_pool3d": "global_avg_pool3d",
    "relax.mean": "mean",
    "relax.concat": "concatenate",
    "relax.permute_dims": "transpose",
    "relax.reshape": "reshape",
    "relax.nn.softmax": "softmax",
    "relax.nn.batch_norm": "batch_norm",
    "relax.squeeze": "reshape",
    "relax.expand_dims": "reshape",
    "relax.flatten": "reshape",
}


# Layer-op names of the transformer, resize and pad ops (beside OP_NAMES)
LAYER_OP_NAMES = {
    "relax.nn.layer_norm": "layer_norm",
    "relax.nn.rms_norm": "rms_norm",
    "relax.nn.group_norm": "group_norm",
    "relax.nn.instance_norm": "instance_norm",
    "relax.nn.gelu": "gelu",
    "relax.nn.gelu_tanh": "gelu",
    "relax.nn.silu": "silu",
    "relax.nn.attention": "attention",
    "relax.nn.attention_bias": "attention",
    "relax.take": "gather",
    "relax.gather_elements": "gather",
    "relax.gather_nd": "gather",
    "relax.split": "split",
    "relax.strided_slice": "strided_slice",
    "relax.dynamic_strided_slice": "strided_slice",
    "relax.nn.pad": "pad",
    "relax.image.resize2d": "resize",
    "relax.image.resize3d": "resize",
    "relax.nn.pixel_shuffle": "depth_to_space",
    "relax.nn.log_softmax": "log_softmax",
}


def quantized_roll(quant: dict[str, Any], members: list[Binding]) -> dict[str, Any] | None:
    """The ``quant`` record of a quantized layer that is a roll (rotations merged by
    :func:`irgen.layers.merge_quantized_rolls`, exact data movement): ``kind`` ``integer``,
    ``op`` ``roll``, the scheme's input and output quantization (the same); None for others."""
    if len(members) < 3 or not is_roll(members) or not quant.get("inputs") or "output" not in quant:
        return None
    return {"scheme": quant["scheme"], "kind": "integer", "op": "roll", "inputs": [quant["inputs"][0]],
            "output": quant["output"]}


# Layer-op names of a source op that a converter imported as several Relax ops
# (ONNX op type or aten op without its overload, lower case)
SOURCE_OP_NAMES = {
    "depthtospace": "depth_to_space",
    "pixel_shuffle": "depth_to_space",
    "spacetodepth": "space_to_depth",
    "pixel_unshuffle": "space_to_depth",
    "embedding": "gather",
    "scaled_dot_product_attention": "attention",
    "layernormalization": "layer_norm",
    "layer_norm": "layer_norm",
    "native_layer_norm": "layer_norm",
    "gelu": "gelu",
    "silu": "silu",
    "resize": "resize",
    "upsample": "resize",
    "upsample_nearest2d": "resize",
    "upsample_bilinear2d": "resize",
    "upsample_nearest3d": "resize",
    "upsample_trilinear3d": "resize",
    "pad": "pad",
    "constant_pad_nd": "pad",
    "split": "split",
    "split_with_sizes": "split",
    "chunk": "split",
    "unbind": "split",
    "slice": "strided_slice",
    "reducemean": "mean",
    "softmax": "softmax",
    "_softmax": "softmax",
    "bmm": "matmul",
    "linear": "dense",
    "rnn_tanh": "rnn",
    "rnn_relu": "rnn",
}


#: one name per computation, whatever the scheme or frontend called it (docs/layer-ops.md)
CANONICAL_OPS = {
    "mul": "multiply",
    "sub": "subtract",
    "div": "divide",
    "global_avg_pool": "global_avg_pool2d",
    "hard_swish": "hardswish",
    "hard_sigmoid": "hardsigmoid",
    "concat": "concatenate",
    "permute_dims": "transpose",
    "logistic": "sigmoid",
    "leakyrelu": "leaky_relu",
}


def quant_op(quant: dict[str, Any], members: list[Binding]) -> str:
    """The layer op of a quantized layer: its ``quant.kind``, except for kinds that name the
    arithmetic rather than the op: a table (``lut``) is the function it tabulates
    (``sigmoid``, ``hardswish``, ``gelu``; ``lut`` only for a chain of several), a
    ``mean`` is named as a float one is (a spatial mean is ``global_avg_pool2d``, over three
    spatial axes ``global_avg_pool3d``, as is a ``global_avg_pool`` of a volume), and a
    record that names its op (``quant.op``: a kind that names an algorithm, such as an
    int16 ``softmax16``) is that op."""
    kind = quant["kind"]
    if kind == "lut":
        fn = str(quant.get("function") or quant.get("op") or "")
        return source_op_name(fn.removeprefix("nn.")) if fn and "+" not in fn else "lut"
    if kind in ("global_avg_pool", "global_avg_pool_float"):  # the float one: torch's float32 mean, quantized
        return "global_avg_pool3d" if len(quant.get("axes") or []) == 3 else "global_avg_pool2d"
    if kind == "mean":  # realized as a sum: its axes are in the record
        first = members[0].value
        t = tensor_type(first.args[0]) if isinstance(first, relax.Call) and first.args else None
        rank = len(t[0]) if t else 0
        axes = sorted(int(a) % max(rank, 1) for a in quant.get("axes") or [])
        if rank == 4 and axes in ([2, 3], [1, 2]):
            return "global_avg_pool2d"
        if rank == 5 and axes in ([2, 3, 4], [1, 2, 3]):
            return "global_avg_pool3d"
    return str(quant.get("op") or kind)


#: activations made of several steps: a layer that is one such source op is named after it
COMPOUND_OPS = frozenset({"hardsigmoid", "hardswish", "silu", "gelu", "mish", "softplus"})
#: ops a frontend may write as several steps: a layer that is one such source op is named after it
#: (beside the compound activations, a resize written as gathers and weighted sums)
MULTI_STEP_OPS = COMPOUND_OPS | frozenset({"resize"})


def source_op_name(op_type: str) -> str:
    """Layer-op name of a source op type (``DepthToSpace`` -> ``depth_to_space``,
    ``aten.embedding.default`` -> ``gather``, ``aten.hardswish_.default`` -> ``hardswish``)."""
    t = op_type.lower()
    if t.startswith("aten."):
        t = t.split(".")[1]
        if t.endswith("_") and not t.endswith("__"):
            t = t[:-1]  # the in-place variant computes the same
    t = SOURCE_OP_NAMES.get(t, t)
    return CANONICAL_OPS.get(t, t)


def _global_pool(call: relax.Call, out: relax.Expr) -> bool:
    """An adaptive average pool ``call`` (result ``out``) gives one value per channel."""
    t = tensor_type(out)
    layout = str(call.attrs.out_layout or call.attrs.layout)
    return t is None or all(d == 1 for d, axis in zip(t[0], layout) if axis in "DHW")


def short_op(b: Binding) -> str:
    """Layer-op name of one binding (``conv2d``, ``dense``, ``flatten``...)."""
    name = b.op or b.kind
    v = b.value
    if name == "relax.matmul" and isinstance(v.args[1], Constant) and len(v.args[1].ty.shape.values) == 2:
        return "dense"
    if name == "relax.mean":
        axes = [int(a) for a in v.attrs.axis] if v.attrs.axis is not None else []
        t = tensor_type(v.args[0])
        # the two spatial axes of NCHW (2, 3) or NHWC (1, 2); the three of NCDHW or NDHWC
        if t and len(t[0]) == 4 and sorted(a % 4 for a in axes) in ([2, 3], [1, 2]):
            return "global_avg_pool2d"
        if t and len(t[0]) == 5 and sorted(a % 5 for a in axes) in ([2, 3, 4], [1, 2, 3]):
            return "global_avg_pool3d"
    if name in ("relax.nn.adaptive_avg_pool2d", "relax.nn.adaptive_avg_pool3d") and not _global_pool(v, b.var):
        return name.removeprefix("relax.nn.")  # to more than one value per channel: AlexNet's 6x6, VGG's 7x7
    if name == "relax.reshape":
        tin, tout = tensor_type(v.args[0]), tensor_type(b.var)
        if tin and tout and len(tout[0]) == 2 and len(tin[0]) > 2 and tout[0][0] == tin[0][0]:
            return "flatten"
    if name in LAYER_OP_NAMES:
        return LAYER_OP_NAMES[name]
    if name in OP_NAMES:
        return OP_NAMES[name]
    return name.removeprefix("relax.").removeprefix("nn.").replace(".", "_")
