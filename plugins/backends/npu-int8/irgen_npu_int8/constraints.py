"""What the ``npu-int8`` NPU runs: its ops and their constraints, and the check of a layer.

:data:`TABLE` is the table ``irgen backends show npu-int8`` prints; :func:`check_layer`
enforces it on every formed layer before anything is compiled (irgen refuses a
model with any offending layer, naming each with the constraints it breaks).
"""

from __future__ import annotations

MAX_KERNEL = 7  # conv2d kernels up to 7x7
MAX_DEPTHWISE_KERNEL = 5
MAX_STRIDE = 2
MAX_POOL = 8
MAX_CHANNELS = 2048
MAX_FEATURES = 4096  # dense input and output features
ACT_DTYPE = "int8"
WEIGHT_DTYPE = "int8"
BIAS_DTYPE = "int32"

#: layers that run on the NPU's int8 datapath
INT8_OPS = ("conv2d", "depthwise_conv2d", "dense", "max_pool2d", "avg_pool2d", "global_avg_pool2d", "add",
            "relu", "clip", "concatenate", "flatten", "reshape")
#: the conversions at the model's edges (float in, int8 out; int8 in, float out)
EDGE_OPS = ("quantize", "dequantize")
SUPPORTED_OPS = frozenset(INT8_OPS + EDGE_OPS)

#: (op or topic, constraint): what ``irgen backends show npu-int8`` prints
TABLE = [
    ("every layer", f"one of: {', '.join(INT8_OPS + EDGE_OPS)}"),
    ("every layer but quantize/dequantize",
     f"quantized: {ACT_DTYPE} inputs and outputs (a float layer is refused; quantize the model)"),
    ("conv2d", f"kernel 1x1 to {MAX_KERNEL}x{MAX_KERNEL}, stride 1 to {MAX_STRIDE}, dilation 1, groups 1, "
               f"up to {MAX_CHANNELS} input and output channels; {WEIGHT_DTYPE} weight, {BIAS_DTYPE} bias"),
    ("depthwise_conv2d", f"kernel 1x1 to {MAX_DEPTHWISE_KERNEL}x{MAX_DEPTHWISE_KERNEL}, stride 1 to {MAX_STRIDE}, "
                         f"dilation 1, channel multiplier 1, up to {MAX_CHANNELS} channels; {WEIGHT_DTYPE} weight, "
                         f"{BIAS_DTYPE} bias"),
    ("dense", f"up to {MAX_FEATURES} input and output features; {WEIGHT_DTYPE} weight, {BIAS_DTYPE} bias"),
    ("max_pool2d, avg_pool2d", f"window 1x1 to {MAX_POOL}x{MAX_POOL}, dilation 1"),
    ("add", f"two {ACT_DTYPE} activations of the same shape (no broadcasting)"),
    ("quantize", f"float32 input, {ACT_DTYPE} output"),
    ("dequantize", f"{ACT_DTYPE} input, float32 output"),
    ("activations", "4-D ones NCHW or NHWC in the model, stored NHWC; channels padded with zeros "
                    "to the channel multiple (--npu-channel-multiple, default 16)"),
    ("weights", "conv2d OHWI, depthwise_conv2d OHWI with I = 1, dense OI; output channels padded with zeros "
                "to the channel multiple; biases one value per output channel"),
]


def _dims(w: dict, letters: str) -> list[int] | None:
    layout = w.get("layout") or ""
    if len(layout) != len(w.get("shape") or []) or any(c not in layout for c in letters):
        return None
    return [int(w["shape"][layout.index(c)]) for c in letters]


def _conv(layer: dict, why: list[str], max_kernel: int) -> None:
    attrs, params = layer.get("attrs") or {}, layer.get("params") or {}
    w = params.get("weight")
    dims = _dims(w, "OIHW") if w else None
    if dims is None:
        why.append(f"weight layout {w.get('layout') if w else None!r}: the NPU needs O, I, H and W axes")
        return
    o, i, kh, kw = dims
    if not (1 <= kh <= max_kernel and 1 <= kw <= max_kernel):
        why.append(f"kernel {kh}x{kw}: at most {max_kernel}x{max_kernel}")
    strides = [int(s) for s in attrs.get("strides") or [1, 1]]
    if max(strides) > MAX_STRIDE:
        why.append(f"stride {'x'.join(map(str, strides))}: at most {MAX_STRIDE}")
    dilation = [int(d) for d in attrs.get("dilation") or [1, 1]]
    if max(dilation) != 1:
        why.append(f"dilation {'x'.join(map(str, dilation))}: only 1")
    groups = int(attrs.get("groups") or 1)
    if layer["op"] == "conv2d" and groups != 1:
        why.append(f"groups {groups}: only 1 (or a depthwise convolution)")
    if layer["op"] == "depthwise_conv2d" and i != 1:
        why.append(f"{i} input channels per group: only 1")
    if layer["op"] == "depthwise_conv2d" and o != groups:
        why.append(f"channel multiplier {o // max(groups, 1)}: only 1")
    if max(o, i * groups) > MAX_CHANNELS:
        why.append(f"{i * groups} input / {o} output channels: at most {MAX_CHANNELS}")


def _params(layer: dict, why: list[str]) -> None:
    for role, p in (layer.get("params") or {}).items():
        want = {"weight": WEIGHT_DTYPE, "bias": BIAS_DTYPE}.get(role)
        if want and p.get("dtype") != want:
            why.append(f"{role} is {p.get('dtype')}: {want} only")


def check_layer(layer: dict) -> list[str]:
    """The constraints of :data:`TABLE` that ``layer`` breaks (empty when it fits)."""
    op = layer["op"]
    if op not in SUPPORTED_OPS:
        return [f"op {op!r} is not in the npu-int8 table (`irgen backends show npu-int8`)"]
    why: list[str] = []
    ins = [t.get("dtype") for t in layer.get("inputs") or []]
    outs = [t.get("dtype") for t in layer.get("outputs") or []]
    if op == "quantize":
        if any(d != "float32" for d in ins) or any(d != ACT_DTYPE for d in outs):
            why.append(f"quantizes {'/'.join(map(str, ins))} to {'/'.join(map(str, outs))}: float32 to {ACT_DTYPE} only")
        return why
    if op == "dequantize":
        if any(d != ACT_DTYPE for d in ins):
            why.append(f"dequantizes {'/'.join(map(str, ins))}: {ACT_DTYPE} only")
        return why
    bad = sorted({str(d) for d in ins + outs if d != ACT_DTYPE})
    if bad or not layer.get("quant"):
        floating = not layer.get("quant") or any(d.startswith(("float", "bfloat")) for d in bad)
        what = "a float layer" if floating else "a quantized layer"
        why.append(f"{what} ({'/'.join(bad) or 'not quantized'}): {ACT_DTYPE} activations only")
    _params(layer, why)
    if op in ("conv2d", "depthwise_conv2d"):
        _conv(layer, why, MAX_KERNEL if op == "conv2d" else MAX_DEPTHWISE_KERNEL)
    elif op == "dense":
        w = (layer.get("params") or {}).get("weight")
        if w and max(int(d) for d in w.get("shape") or [0]) > MAX_FEATURES:
            why.append(f"weight {w['shape']}: at most {MAX_FEATURES} input and output features")
    elif op in ("max_pool2d", "avg_pool2d"):
        attrs = layer.get("attrs") or {}
        pool = [int(k) for k in attrs.get("pool_size") or [1, 1]]
        if max(pool) > MAX_POOL:
            why.append(f"window {'x'.join(map(str, pool))}: at most {MAX_POOL}x{MAX_POOL}")
        if max(int(d) for d in attrs.get("dilation") or [1]) != 1:
            why.append("dilated pooling: dilation 1 only")
    elif op == "add":
        shapes = [t.get("shape") for t in layer.get("inputs") or []]
        if len(shapes) != 2 or shapes[0] != shapes[1]:
            why.append(f"add of {' and '.join(map(str, shapes))}: two activations of the same shape only")
    return why
