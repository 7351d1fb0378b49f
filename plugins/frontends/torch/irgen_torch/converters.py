"""irgen's own converters for ATen ops that TVM's ExportedProgram importer
refuses or imports wrongly.

:data:`CONVERTERS` holds one function per op, keyed by the importer's op name
(``batch_norm.default``, ...), ``fn(importer, node) -> relax.Expr``: the
importer (:mod:`irgen_torch.translate`) installs them over TVM's own
converters. ``importer.env`` maps FX nodes to Relax expressions,
``importer.block_builder`` emits bindings, and ``importer.ctx`` (a
:class:`Context`) holds what the translation knows beyond TVM: the tensors
bound to placeholders (weights, quantization parameters), the binding namer
and the provenance.

- ``aten.batch_norm``: TVM 0.27 reads its (training, momentum) as (momentum,
  eps) and always sets training=True;
- ``aten.scaled_dot_product_attention``: TVM 0.27 refuses a bool attn_mask and
  ignores ``scale=``;
- ``aten.pixel_shuffle``: relax.nn.pixel_shuffle has no legalization in TVM
  0.27 (no topi.nn.pixel_shuffle): torch's own definition, reshape / permute /
  reshape; ``aten.diff`` has no converter: slices and a subtract;
  ``aten.swapaxes`` / ``swapdims`` and ``aten.t`` have none either: a permute_dims;
- ``aten.upsample_nearest2d``: TVM 0.27 rounds half-pixel coordinates, torch floors
  ``dst * in / out``; they differ when the size is no multiple of the input's (a gather then);
- ``aten.lstm`` / ``gru`` / ``rnn_tanh`` / ``rnn_relu``: TVM 0.27 refuses more than one
  layer and imports the output sequence alone; irgen's (:mod:`irgen_torch.recurrent`)
  unrolls every layer and direction, one layer per time step;
- torch quantization: ``quantized_decomposed`` Q/DQ ops (FX reference flow)
  and fake quant (QAT) become ``relax.quantize`` / ``relax.dequantize``;
  quantized weights are computed by torch at import time.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from irgen.plugin import IrgenError, Provenance

from .recurrent import KINDS as RECURRENT_OPS, convert_recurrent


@dataclass
class Context:
    """What the converters and the naming importer share during one translation."""

    where: str  # "torch frontend (model.pt2)", the prefix of every error
    bound: dict[str, Any]  # placeholder name -> the buffer/parameter/constant tensor it is bound to
    namer: Callable[[str], str]  # tensor name -> a fresh Relax binding name
    computed: dict[str, Any]  # input-independent nodes torch computed (None: unused)
    provenance: Provenance = field(default_factory=Provenance)
    renames: dict[str, str] = field(default_factory=dict)  # importer's var name -> irgen name
    current: Any = None  # the FX node being converted (named in import errors)
    #: a quantize's integer range narrower than its dtype's (reduce_range), by FX node name (a
    #: quantize_per_tensor node) or by Relax variable name (a fake quant's integer tensor)
    ranges_by_node: dict[str, tuple[int, int]] = field(default_factory=dict)
    ranges_by_var: dict[str, tuple[int, int]] = field(default_factory=dict)


def _arg(node, i: int, key: str, default):
    """Argument ``i`` of ``node``, given positionally or as keyword ``key``."""
    return node.args[i] if len(node.args) > i else node.kwargs.get(key, default)


# ---------------------------------------------------------------- float ops


def convert_batch_norm(imp, node):
    # aten::batch_norm(input, weight, bias, running_mean, running_var, training, momentum, eps, cudnn_enabled)
    import numpy as np
    from tvm import relax

    where = imp.ctx.where
    if _arg(node, 5, "training", False):
        raise IrgenError(f"{where}: node {node.name!r} (aten.batch_norm) runs in training mode; "
                         f"export the model after model.eval()")
    x = imp.env[node.args[0]]
    channel = int(imp.shape_of(x)[1])
    dtype = x.ty.dtype.dtype

    def tensor(i, fill):
        n = node.args[i] if len(node.args) > i else None
        return imp.env[n] if n is not None else relax.const(np.full(channel, fill), dtype=dtype)

    if node.args[3] is None or node.args[4] is None:
        raise IrgenError(f"{where}: node {node.name!r} (aten.batch_norm) has no running statistics")
    bn = imp.block_builder.emit(
        relax.op.nn.batch_norm(
            data=x, gamma=tensor(1, 1.0), beta=tensor(2, 0.0),
            moving_mean=imp.env[node.args[3]], moving_var=imp.env[node.args[4]],
            axis=1, epsilon=float(_arg(node, 7, "eps", 1e-5)),
            scale=node.args[1] is not None, center=node.args[2] is not None,
            momentum=float(_arg(node, 6, "momentum", 0.1)), training=False,
        )
    )
    return imp.block_builder.emit(bn[0])


def _attention_bias(bb, m, dtype: str):
    """An attention mask as relax.nn.attention's additive bias of rank 4: a bool mask
    (True = attend) becomes 0 or the most negative float."""
    import numpy as np
    import tvm
    from tvm import relax

    if str(m.ty.dtype) == "bool":
        import ml_dtypes  # its finfo knows bfloat16 too (numpy's does not)

        lowest = float(ml_dtypes.finfo(dtype).min)
        if isinstance(m, tvm.ir.Constant):
            m = relax.const(np.where(m.value.numpy(), 0.0, lowest).astype(dtype))
        else:
            m = bb.emit(relax.op.where(m, relax.const(0.0, dtype), relax.const(lowest, dtype)))
    while len(m.ty.shape) < 4:
        m = relax.const(np.expand_dims(m.value.numpy(), 0)) if isinstance(m, tvm.ir.Constant) \
            else bb.emit(relax.op.expand_dims(m, 0))
    return m


def convert_sdpa(imp, node):
    # aten::scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, *,
    #                                    scale=None, enable_gqa=False); q (..., L, E), k (..., S, E)
    from tvm import relax

    where = imp.ctx.where
    q, k, v = (imp.env[a] for a in node.args[:3])
    if float(_arg(node, 4, "dropout_p", 0.0)) != 0.0:
        raise IrgenError(f"{where}: node {node.name!r} (scaled_dot_product_attention) has dropout; export in eval mode")
    ndim = len(q.ty.shape)
    if ndim not in (3, 4) or len(k.ty.shape) != ndim or len(v.ty.shape) != ndim:
        raise IrgenError(f"{where}: node {node.name!r} (scaled_dot_product_attention): inputs of rank "
                         f"{ndim}; 3 or 4 supported")
    if [int(d) for d in list(q.ty.shape)[:-2]] != [int(d) for d in list(k.ty.shape)[:-2]]:
        raise IrgenError(f"{where}: node {node.name!r} (scaled_dot_product_attention): query and key heads "
                         f"differ (grouped-query attention); not supported")
    bb = imp.block_builder
    if ndim == 3:
        q, k, v = (bb.emit(relax.op.expand_dims(t, 0)) for t in (q, k, v))
    bsnh = [0, 2, 1, 3]  # torch (B, H, L, E) <-> relax.nn.attention (B, L, H, E)
    q, k, v = (bb.emit(relax.op.permute_dims(t, bsnh)) for t in (q, k, v))
    mask = _arg(node, 3, "attn_mask", None)
    bias = _attention_bias(bb, imp.env[mask], str(q.ty.dtype)) if mask is not None else None
    scale = node.kwargs.get("scale", None)
    causal = "TopLeft" if _arg(node, 5, "is_causal", False) else None
    out = bb.emit(relax.op.nn.attention(q, k, v, bias=bias, scale=None if scale is None else float(scale),
                                        causal_mask=causal))
    out = relax.op.permute_dims(out, bsnh)
    return relax.op.squeeze(bb.emit(out), [0]) if ndim == 3 else out


def convert_pixel_shuffle(imp, node):
    from tvm import relax

    x = imp.env[node.args[0]]
    r = int(node.args[1])
    *lead, c, h, w = (int(d) for d in x.ty.shape)
    bb = imp.block_builder
    k = len(lead)
    y = bb.emit(relax.op.reshape(x, [*lead, c // (r * r), r, r, h, w]))
    y = bb.emit(relax.op.permute_dims(y, [*range(k), k, k + 3, k + 1, k + 4, k + 2]))
    return relax.op.reshape(y, [*lead, c // (r * r), h * r, w * r])


def convert_diff(imp, node):
    # aten::diff(x, n=1, dim=-1, prepend=None, append=None)
    from tvm import relax

    bb = imp.block_builder
    x = imp.env[node.args[0]]
    n, dim = int(_arg(node, 1, "n", 1)), int(_arg(node, 2, "dim", -1))
    rank = len(x.ty.shape)
    dim %= rank
    pre, app = _arg(node, 3, "prepend", None), _arg(node, 4, "append", None)
    parts = ([imp.env[pre]] if pre is not None else []) + [x] + ([imp.env[app]] if app is not None else [])
    if len(parts) > 1:
        x = bb.emit(relax.op.concat(parts, axis=dim))
    for step in range(n):
        size = int(x.ty.shape[dim])
        hi = bb.emit(relax.op.strided_slice(x, [dim], [1], [size]))
        lo = bb.emit(relax.op.strided_slice(x, [dim], [0], [size - 1]))
        d = relax.op.subtract(hi, lo) if str(x.ty.dtype) != "bool" else relax.op.not_equal(hi, lo)
        x = d if step == n - 1 else bb.emit(d)
    return x


def _nearest_index(n_in: int, n_out: int, scale) -> "np.ndarray":
    """torch's nearest source index along one axis (``nearest_idx`` of its upsample kernels):
    ``min(floorf(dst * s), n_in - 1)`` in float32, ``s = 1 / scale`` when a scale factor was given,
    else ``n_in / n_out``."""
    import numpy as np

    if n_out == n_in:
        return np.arange(n_out)
    if n_out == 2 * n_in:
        return np.arange(n_out) >> 1
    s = np.float32(1.0 / float(scale)) if scale else np.float32(n_in) / np.float32(n_out)
    return np.minimum(np.floor(np.arange(n_out, dtype=np.float32) * s).astype(np.int64), n_in - 1)


def _upsample_args(node, spatial: list[int], names: tuple[str, ...]):
    """(output size, scale per axis or None) of an ``upsample_*`` node: ``.vec`` (``output_size``,
    then ``scale_factors``) or ``.default`` (``output_size``, then one ``scales_*`` per axis:
    ``names``), the linear modes with ``align_corners`` before the scales."""
    import numpy as np

    size = _arg(node, 1, "output_size", None)
    k = 2 if "nearest" in str(node.target) else 3
    if str(node.target).endswith(".vec"):
        sf = _arg(node, k, "scale_factors", None)
        scales = [None] * len(spatial) if sf is None else [float(v) for v in sf]
    else:
        scales = [_arg(node, k + i, n, None) for i, n in enumerate(names)]
    out = [int(v) for v in size] if size else [int(np.floor(d * s)) for d, s in zip(spatial, scales)]
    return out, scales


def convert_upsample_nearest(imp, node):
    # aten::upsample_nearest2d/3d.vec(x, output_size?, scale_factors?) / .default(x, output_size, scales_*?).
    # TVM 0.27 imports it as a half-pixel resize that rounds: torch's floor(dst * in / out) picks other
    # rows when the size is no multiple of the input's. Such an axis is a gather of torch's own rows.
    import numpy as np
    from tvm import relax

    x = imp.env[node.args[0]]
    spatial = [int(d) for d in x.ty.shape.values[2:]]
    out, scales = _upsample_args(node, spatial, ("scales_d", "scales_h", "scales_w")[-len(spatial):])
    idx = [_nearest_index(n, o, s) for n, o, s in zip(spatial, out, scales)]
    if all(o % n == 0 and np.array_equal(i, np.arange(o) // (o // n)) for n, o, i in zip(spatial, out, idx)):
        # an integer factor on every axis: TVM's resize picks the same rows (each inside its pixel)
        resize = relax.op.image.resize2d if len(spatial) == 2 else relax.op.image.resize3d
        return resize(x, out, layout="NCHW" if len(spatial) == 2 else "NCDHW", method="nearest_neighbor",
                      coordinate_transformation_mode="asymmetric", rounding_method="floor")
    for axis, i in enumerate(idx[:-1]):
        x = imp.block_builder.emit(relax.op.take(x, relax.const(i), axis=2 + axis))
    return relax.op.take(x, relax.const(idx[-1]), axis=1 + len(spatial))


def convert_upsample_linear(imp, node):
    # aten::upsample_trilinear3d.vec(x, output_size?, align_corners, scale_factors?) /
    # .default(x, output_size, align_corners, scales_d?, scales_h?, scales_w?) (no converter in TVM 0.27),
    # aten::upsample_bilinear2d.vec (TVM's): half-pixel coordinates, or align_corners, as TVM's resize
    # computes them, unless a scale factor is given that is not the output size over the input's
    # (1.5 on 3 rows: 4 rows, sampled at (dst + 0.5) / 1.5 - 0.5, not (dst + 0.5) * 3 / 4 - 0.5): then
    # torch's own coordinates (_torch_linear_resize)
    from tvm import relax

    x = imp.env[node.args[0]]
    spatial = [int(d) for d in x.ty.shape.values[2:]]
    out, scales = _upsample_args(node, spatial, ("scales_d", "scales_h", "scales_w")[-len(spatial):])
    corners = bool(_arg(node, 2, "align_corners", False))
    if not corners and any(s and float(s) != o / n for n, o, s in zip(spatial, out, scales)):
        return _torch_linear_resize(imp, x, spatial, out, scales)
    if len(spatial) == 2:
        return imp._upsample_bilinear2d(node)
    return relax.op.image.resize3d(x, out, layout="NCDHW", method="linear",
                                   coordinate_transformation_mode="align_corners" if corners else "half_pixel")


def _torch_linear_source(n_in: int, n_out: int, scale):
    """torch's two source rows and their weights for each output row along one axis of a linear
    upsampling without align_corners (``area_pixel_compute_source_index``, float32):
    ``max((dst + 0.5) * r - 0.5, 0)``, ``r = float32(1 / scale)`` or ``n_in / n_out``."""
    import numpy as np

    r = np.float32(1.0 / float(scale)) if scale else np.float32(n_in) / np.float32(n_out)
    src = np.maximum((np.arange(n_out, dtype=np.float32) + np.float32(0.5)) * r - np.float32(0.5), np.float32(0))
    i0 = src.astype(np.int64)
    w1 = (src - i0.astype(np.float32)).astype(np.float32)
    return i0, np.minimum(i0 + 1, n_in - 1), (np.float32(1) - w1).astype(np.float32), w1


def _torch_linear_resize(imp, x, spatial: list[int], out: list[int], scales):
    """A linear upsampling as torch's CPU kernel computes it: along W, then H (then D), each output
    row ``w0 * x[i0] + w1 * x[i1]`` (gathers, products by constant weights, a sum), the nesting of
    its ``interpolate`` recursion."""
    from tvm import relax

    bb = imp.block_builder
    rank = 2 + len(spatial)
    y = x
    for a in reversed(range(len(spatial))):
        i0, i1, w0, w1 = _torch_linear_source(spatial[a], out[a], scales[a])
        shape = [out[a] if k == 2 + a else 1 for k in range(rank)]
        lo, hi = (bb.emit(relax.op.multiply(bb.emit(relax.op.take(y, relax.const(i), axis=2 + a)),
                                            relax.const(w.reshape(shape)))) for i, w in ((i0, w0), (i1, w1)))
        y = relax.op.add(lo, hi)
        if a:
            y = bb.emit(y)
    return y


def convert_conv_transpose3d(imp, node):
    # aten::conv_transpose3d.input(x, weight, bias?, stride, padding, output_padding, groups, dilation), and
    # aten::convolution with transposed=True over 5-D data: no converter in TVM 0.27 (its
    # convolution stops on "Unsupported transposed convolution dimensionality: 5")
    from tvm import relax

    args = imp.retrieve_args(node)
    conv = str(node.target).startswith("aten.convolution")
    if conv and (not (args[6] if len(args) > 6 else False) or len(imp.shape_of(args[0])) != 5):
        return imp._convolution(node)  # TVM's own for every other convolution
    x, weight = args[0], args[1]
    bias = args[2] if len(args) > 2 else None
    stride = args[3] if len(args) > 3 else 1
    padding = args[4] if len(args) > 4 else 0
    if conv:  # (stride, padding, dilation, transposed, output_padding, groups)
        dilation, output_padding, groups = args[5], args[7], args[8]
    else:  # (stride, padding, output_padding, groups, dilation)
        output_padding = args[5] if len(args) > 5 else 0
        groups = args[6] if len(args) > 6 else 1
        dilation = args[7] if len(args) > 7 else 1
    y = relax.op.nn.conv3d_transpose(x, weight, strides=stride, padding=padding, output_padding=output_padding,
                                     dilation=dilation, groups=groups, data_layout="NCDHW", kernel_layout="IODHW")
    if bias is None:
        return y
    y = imp.block_builder.emit(y)
    return relax.op.add(y, relax.op.reshape(bias, (1, -1, 1, 1, 1)))


def convert_max_pool_with_indices(imp, node):
    # aten::max_pool{2,3}d_with_indices(x, kernel, stride, padding, dilation, ceil_mode) -> (values, indices)
    # (a pool with return_indices=True; core-ATen decompositions of every max pool): TVM 0.27 pairs the pool
    # with zeros_like(pool) as the indices, a placeholder that reads the pool, which then is no item of the
    # tuple alone and its layer has no source tensor. Here the placeholder reads nothing (dropped unread),
    # and the item read (the values, the layer's output) names the layer as the pool node would be named;
    # indices the graph reads (max_unpool) are refused: irgen computes only the values.
    from tvm import relax

    from .translate import module_path_name

    if any(u.args[1] != 0 and u.users for u in node.users):
        raise IrgenError(f"{imp.ctx.where}: node {node.name!r} ({node.target}): the graph reads the pool's indices "
                         f"(a max_unpool?); irgen computes only the pooled values")
    for item in node.users:
        imp.ctx.provenance.layer_names[item.name] = module_path_name(node)
    pool = imp._max_pool3d if "max_pool3d" in str(node.target) else imp._max_pool2d
    y = pool(node)
    return imp.block_builder.emit(relax.Tuple([y, relax.op.zeros(imp.shape_of(y), "int64")]))


def convert_adaptive_max_pool(imp, node):
    # aten::adaptive_max_pool{2,3}d(x, output_size) -> (values, indices): no converter in TVM 0.27.
    # Each output size a whole factor of the input's (global max pooling: 1) is a max pool with
    # kernel = stride = input / output, as torch's ONNX exporter writes it; the indices as for
    # max_pool_with_indices (unread, or refused)
    from tvm import relax

    from .translate import module_path_name

    x = imp.env[node.args[0]]
    spatial = [int(d) for d in x.ty.shape.values[2:]]
    out = [int(v) for v in node.args[1]]
    out = out * len(spatial) if len(out) == 1 else out
    if any(u.args[1] != 0 and u.users for u in node.users) or any(n % o for n, o in zip(spatial, out)):
        raise IrgenError(f"{imp.ctx.where}: node {node.name!r} ({node.target}): only the values of an adaptive max "
                         f"pool to whole factors of the input's size are supported (input {spatial}, output {out})")
    for item in node.users:
        imp.ctx.provenance.layer_names[item.name] = module_path_name(node)
    k = [n // o for n, o in zip(spatial, out)]
    pool = relax.op.nn.max_pool2d if len(spatial) == 2 else relax.op.nn.max_pool3d
    y = imp.block_builder.emit(pool(x, pool_size=k, strides=k, layout="NCHW" if len(spatial) == 2 else "NCDHW"))
    return imp.block_builder.emit(relax.Tuple([y, relax.op.zeros(imp.shape_of(y), "int64")]))


def convert_where_scalar(imp, node):
    # aten::where.ScalarOther(cond, self, other: Scalar), .ScalarSelf(cond, self: Scalar, other),
    # .Scalar(cond, self: Scalar, other: Scalar): no converters in TVM 0.27 (T5's attention bias).
    # torch's type promotion: a scalar of a higher category (bool < integer < float) than the tensor
    # gives that category's default type (int64, float32), else the tensor's; two scalars: their
    # category's default (bool, int64, float32)
    from tvm import relax

    cond = imp.env[node.args[0]]
    values = [imp.env.get(a, a) if hasattr(a, "op") else a for a in node.args[1:3]]
    tensors = [v for v in values if isinstance(v, relax.Expr)]
    category = max(0 if isinstance(v, bool) else 1 if isinstance(v, int) else 2
                   for v in values if not isinstance(v, relax.Expr))
    dtype = ("bool", "int64", "float32")[category]
    if tensors:
        have = str(tensors[0].ty.dtype)
        if category <= (0 if have == "bool" else 1 if have.startswith(("int", "uint")) else 2):
            dtype = have
        tensors = [t if dtype == have else relax.op.astype(t, dtype) for t in tensors]
    it = iter(tensors)
    ops = [next(it) if isinstance(v, relax.Expr) else relax.const(v, dtype) for v in values]
    return relax.op.where(cond, *ops)


def convert_t(imp, node):
    # aten::t(x): a matrix transposed, a vector or scalar as it is; no converter in TVM 0.27
    from tvm import relax

    x = imp.env[node.args[0]]
    return relax.op.permute_dims(x, [1, 0]) if len(x.ty.shape) == 2 else x


def convert_numpy_t(imp, node):
    # aten::numpy_T(x) (``x.T``): every axis reversed (Falcon's rotary embedding); no converter in TVM 0.27
    from tvm import relax

    x = imp.env[node.args[0]]
    return relax.op.permute_dims(x, list(range(len(x.ty.shape)))[::-1])


def convert_to_device(imp, node):
    # aten::to.device(x, device, dtype, non_blocking, copy, memory_format): transformers' attention
    # mask ``mask.to(device=..., dtype=torch.bool)``; one device here, so the cast (none in TVM 0.27)
    from tvm import relax

    x = imp.env[node.args[0]]
    dtype = _arg(node, 2, "dtype", None)
    if dtype is None:
        return x
    return relax.op.astype(x, imp._convert_data_type(dtype, imp.env))


def convert_div_inplace(imp, node):
    # aten::div_(x, y) left in an exported graph (Falcon's rotary embedding): the result of
    # div, as TVM's own add_/mul_ converters do for theirs
    import operator

    from tvm import relax

    return imp._binary_op(relax.op.divide, operator.truediv)(node)


def convert_swapaxes(imp, node):
    # aten::swapaxes(x, axis0, axis1) / aten::swapdims(x, dim0, dim1): no converter in TVM 0.27
    # (torchvision MaxViT's window partition); torch's transpose of two axes
    from tvm import relax

    x = imp.env[node.args[0]]
    rank = len(x.ty.shape)
    a, b = int(node.args[1]) % rank, int(node.args[2]) % rank
    axes = list(range(rank))
    axes[a], axes[b] = axes[b], axes[a]
    return relax.op.permute_dims(x, axes)


def convert_weight_norm(imp, node):
    """aten._weight_norm(v, g, dim): ``v * g / ||v||``, the norm over every axis but ``dim``
    (all axes for -1), as ``torch.nn.utils.weight_norm`` computes a weight (wav2vec2's
    positional convolution); no converter in TVM 0.27."""
    from tvm import relax

    v, g = imp.env[node.args[0]], imp.env[node.args[1]]
    dim = int(node.args[2]) if len(node.args) > 2 else int(node.kwargs.get("dim", 0))
    rank = len(v.ty.shape)
    axes = [a for a in range(rank) if dim == -1 or a != dim % rank]
    emit = imp.block_builder.emit
    norm = emit(relax.op.sqrt(emit(relax.op.sum(emit(relax.op.multiply(v, v)), axis=axes, keepdims=True))))
    return relax.op.multiply(v, emit(relax.op.divide(g, norm)))


def convert_cat(imp, node):
    """aten.cat as torch runs it: a 1-D tensor of size 0 beside tensors of another rank is
    skipped (torch's legacy rule; transformers' key/value cache starts as one in Llama,
    Qwen2, OPT, BLOOM, Phi and GPT-NeoX), which TVM's concat refuses."""
    from tvm import relax

    args = imp.retrieve_args(node)
    tensors = list(args[0])
    axis = args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)

    def empty_1d(t) -> bool:
        shape = getattr(t.ty, "shape", None)
        try:
            return shape is not None and len(shape) == 1 and int(shape[0]) == 0
        except TypeError:  # a symbolic length
            return False

    kept = [t for t in tensors if not empty_1d(t)]
    if len(kept) == len(tensors) or not kept:
        return imp.block_builder.emit(relax.op.concat(tensors, axis=axis))
    if len(kept) == 1:
        return kept[0]
    return imp.block_builder.emit(relax.op.concat(kept, axis=axis))


# ---------------------------------------------------------------- quantization: relax.quantize / relax.dequantize


def _q_arr(imp, node, a):
    """A quantization parameter's value: a number, a bound tensor or a constant expression."""
    import numpy as np
    import tvm

    bound = imp.ctx.bound
    if isinstance(a, (int, float)):
        return np.asarray(a)
    if hasattr(a, "op") and a.name in bound:
        return bound[a.name].detach().cpu().numpy()
    e = imp.env.get(a) if hasattr(a, "op") else None
    if isinstance(e, tvm.ir.Constant):
        return e.value.numpy()
    raise IrgenError(f"{imp.ctx.where}: node {node.name!r} ({node.target}) has quantization parameters that are not constants")


def _q_dtype(imp, node, qmin, qmax, dtype=None):
    """The integer dtype (int8/uint8) and whether [qmin, qmax] is its full range."""
    import numpy as np

    name = str(dtype).replace("torch.", "") if dtype is not None else None
    if name is None:
        name = "uint8" if int(qmin) >= 0 else "int8"
    if name not in ("int8", "uint8"):
        raise IrgenError(f"{imp.ctx.where}: node {node.name!r} ({node.target}) quantizes to {name}; int8/uint8 only")
    info = np.iinfo(name)
    return name, (int(qmin), int(qmax)) == (int(info.min), int(info.max))


def _q_params(imp, node, scale, zp, dtype, per_channel):
    """Scale and zero point as Relax constants (scalars unless per channel)."""
    import numpy as np
    from tvm import relax

    s = np.asarray(_q_arr(imp, node, scale), np.float32).reshape(-1)
    z = np.asarray(_q_arr(imp, node, zp)).astype(np.int64).reshape(-1)
    s_c = relax.const(s if per_channel and s.size > 1 else s.reshape(()), "float32")
    z_c = relax.const((z if per_channel and z.size > 1 else z.reshape(())).astype(dtype), dtype)
    return s_c, z_c


def _q_const(imp, node, x, values):
    """quantize of a constant (weights): torch computes the integers at import time."""
    import torch
    from tvm import relax

    bound = imp.ctx.bound
    args = [bound[a.name] if hasattr(a, "op") else a for a in node.args]
    with torch.no_grad():
        out = node.target(*args, **node.kwargs)
    return relax.const(out.numpy() if values is None else values(out))


def convert_quantize(imp, node):
    # quantized_decomposed.quantize_per_tensor(x, scale, zp, qmin, qmax, dtype)
    # quantized_decomposed.quantize_per_channel(x, scales, zps, axis, qmin, qmax, dtype)
    from tvm import relax

    pc = "per_channel" in str(node.target)
    a = node.args
    x = imp.env[a[0]]
    qmin, qmax, dt = (a[4], a[5], a[6]) if pc else (a[3], a[4], a[5])
    dtype, full = _q_dtype(imp, node, qmin, qmax, dt)
    if getattr(a[0], "name", None) in imp.ctx.bound:
        return _q_const(imp, node, x, None)
    if not full:  # reduce_range observers (torch's default x86/fbgemm mappings): uint8 in [0, 127]
        if pc:
            raise IrgenError(f"{imp.ctx.where}: node {node.name!r} quantizes an activation per channel to "
                             f"[{qmin}, {qmax}]; not supported")
        imp.ctx.ranges_by_node[node.name] = (int(qmin), int(qmax))
    s, z = _q_params(imp, node, a[1], a[2], dtype, pc)
    return imp.block_builder.emit(relax.op.quantize(x, s, z, axis=int(a[3]) if pc else -1, out_dtype=dtype))


def convert_dequantize(imp, node):
    from tvm import relax

    pc = "per_channel" in str(node.target)
    a = node.args
    x = imp.env[a[0]]
    dtype = str(x.ty.dtype)
    s, z = _q_params(imp, node, a[1], a[2], dtype, pc)
    return imp.block_builder.emit(relax.op.dequantize(x, s, z, axis=int(a[3]) if pc else -1, out_dtype="float32"))


def fake_quant_fields(target: str, args, flag: Callable[[Any], int]):
    """(scale, zero point, axis, qmin, qmax) of a fake-quant call with arguments ``args`` (axis
    -1 per tensor); None when its fake quant is off. ``flag(a)``: the integer a flag argument
    holds (an FX node here, a tensor in the torch runner's recording)."""
    a = args
    if "fused_moving_avg_obs_fake_quant" in target:
        # (x, observer_on, fake_quant_on, running_min, running_max, scale, zp, avg, qmin, qmax, ch_axis, per_row, sym)
        if flag(a[2]) == 0:
            return None
        per_row = bool(a[11]) if len(a) > 11 else False
        return a[5], a[6], int(a[10]) if per_row else -1, a[8], a[9]
    if "per_channel" in target:  # (x, scale, zp, axis, qmin, qmax)
        return a[1], a[2], int(a[3]), a[4], a[5]
    return a[1], a[2], -1, a[3], a[4]  # (x, scale, zp, qmin, qmax)


def _fake_quant_args(imp, node):
    """:func:`fake_quant_fields` of a fake-quant node, refusing one whose observer still runs."""
    a = node.args
    t = str(node.target)

    def flag(v):
        return int(_q_arr(imp, node, v).reshape(-1)[0])

    if "fused_moving_avg_obs_fake_quant" in t and flag(a[1]) != 0:
        raise IrgenError(f"{imp.ctx.where}: node {node.name!r} (fake quant) still has its observer enabled, so torch "
                         f"updates its scale while running; call model.apply(torch.ao.quantization.disable_observer) before export")
    return fake_quant_fields(t, a, flag)


def convert_fake_quant(imp, node):
    """fake quant (QAT) -> quantize + dequantize; weights are quantized at import time by torch."""
    import numpy as np
    import torch
    from tvm import relax

    ctx = imp.ctx
    a = node.args
    args = _fake_quant_args(imp, node)
    if args is None:
        return imp.env[a[0]]
    scale, zp, axis, qmin, qmax = args
    x = imp.env[a[0]]
    dtype, full = _q_dtype(imp, node, qmin, qmax)
    s_np = np.asarray(_q_arr(imp, node, scale), np.float32).reshape(-1)
    z_np = np.asarray(_q_arr(imp, node, zp)).astype(np.int64).reshape(-1)
    if getattr(a[0], "name", None) in ctx.bound:
        w = ctx.bound[a[0].name].detach()
        ax = axis if axis >= 0 else 0
        shp = [-1 if i == ax else 1 for i in range(w.ndim)]
        inv = (1.0 / torch.from_numpy(s_np)).reshape(shp) if s_np.size > 1 else 1.0 / float(s_np[0])
        zz = torch.from_numpy(z_np).reshape(shp) if z_np.size > 1 else int(z_np[0])
        q = torch.clamp(torch.round(w * inv) + zz, int(qmin), int(qmax)).to(getattr(torch, dtype))
        xq = relax.const(q.numpy())
    else:
        if s_np.size > 1:  # QAT conv+BatchNorm modules fake-quantize weight * bn_scale, computed in the graph
            raise IrgenError(f"{ctx.where}: node {node.name!r} fake-quantizes a computed tensor per channel "
                             f"({a[0].name!r}; a QAT conv+BatchNorm module?); fold BatchNorm into the "
                             f"convolutions before prepare_qat_fx, or convert the model with "
                             f"_convert_to_reference_decomposed_fx")
        s, z = _q_params(imp, node, scale, zp, dtype, True)
        # the integer tensor: source node = the fake-quant node (whose float value is dequantize(it)), tensor <node>_q
        qname = ctx.namer(f"{node.name}_q")
        if not full:  # reduce_range (torch's default x86/fbgemm QAT mappings): uint8 in [0, 127]
            ctx.ranges_by_var[qname] = (int(qmin), int(qmax))
        ctx.provenance.by_var[qname] = (node.name, str(node.target), f"{node.name}_q")
        xq = imp.block_builder.emit(relax.op.quantize(x, s, z, axis=axis, out_dtype=dtype), name_hint=qname)
    s, z = _q_params(imp, node, scale, zp, dtype, True)
    return imp.block_builder.emit(relax.op.dequantize(xq, s, z, axis=axis if s_np.size > 1 else -1, out_dtype="float32"))


# ---------------------------------------------------------------- the table


CONVERTERS: dict[str, Callable[[Any, Any], Any]] = {
    "batch_norm.default": convert_batch_norm,
    **dict.fromkeys(RECURRENT_OPS, convert_recurrent),
    "scaled_dot_product_attention.default": convert_sdpa,
    "pixel_shuffle.default": convert_pixel_shuffle,
    "diff.default": convert_diff,
    **dict.fromkeys(("swapaxes.default", "swapdims.default"), convert_swapaxes),
    "t.default": convert_t,
    "numpy_T.default": convert_numpy_t,
    "div_.Tensor": convert_div_inplace,
    "to.device": convert_to_device,
    "cat.default": convert_cat,
    "_weight_norm.default": convert_weight_norm,
    **dict.fromkeys(("upsample_nearest2d.vec", "upsample_nearest2d.default", "upsample_nearest3d.vec",
                     "upsample_nearest3d.default"), convert_upsample_nearest),
    **dict.fromkeys(("upsample_trilinear3d.vec", "upsample_trilinear3d.default", "upsample_bilinear2d.vec"),
                    convert_upsample_linear),
    **dict.fromkeys(("conv_transpose3d.input", "convolution.default"), convert_conv_transpose3d),
    **dict.fromkeys(("where.ScalarOther", "where.ScalarSelf", "where.Scalar"), convert_where_scalar),
    **dict.fromkeys(("max_pool2d_with_indices.default", "max_pool3d_with_indices.default"),
                    convert_max_pool_with_indices),
    **dict.fromkeys(("adaptive_max_pool2d.default", "adaptive_max_pool3d.default"), convert_adaptive_max_pool),
    **dict.fromkeys(("quantize_per_tensor.default", "quantize_per_tensor.tensor", "quantize_per_channel.default"),
                    convert_quantize),
    **dict.fromkeys(("dequantize_per_tensor.default", "dequantize_per_tensor.tensor", "dequantize_per_channel.default"),
                    convert_dequantize),
    **dict.fromkeys(("fused_moving_avg_obs_fake_quant.default", "fake_quantize_per_tensor_affine.default",
                     "fake_quantize_per_tensor_affine.tensor_qparams", "fake_quantize_per_channel_affine.default"),
                    convert_fake_quant),
}
