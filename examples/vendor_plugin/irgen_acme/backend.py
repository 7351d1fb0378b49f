"""The ``acme-npu`` backend: the acme NPU's layers, its constraints, raw ``.bin`` data files.

A layer is a convolution or dense op with its bias add and activation, an
element-wise op with its activation, a pooling op, or any other op alone. The
NPU takes NCHW activations, kernels up to 7x7 with strides up to 4, and integer
parameters only (int8 weights, int32 biases): a float model is refused before
anything is compiled.

Data files are raw little-endian arrays, C order, no header (``<name>.bin``):
the shape and dtype are the tensor's record in ``ir.json``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from irgen.plugin import FusionRule, IrgenError

ACTIVATIONS = frozenset({"relax.nn.relu", "relax.clip", "relax.sigmoid", "relax.tanh"})
MAC = frozenset({"relax.nn.conv2d", "relax.nn.conv1d", "relax.matmul"})
ELEMENTWISE = frozenset({"relax.add", "relax.subtract", "relax.multiply"})

FUSION_RULES = [
    FusionRule("mac_bias_act", MAC, (frozenset({"relax.add"}), ACTIVATIONS)),
    FusionRule("eltwise_act", ELEMENTWISE, (ACTIVATIONS,)),
    FusionRule("pool", frozenset({"relax.nn.max_pool2d", "relax.nn.avg_pool2d"}), ()),
]

MAX_KERNEL = 7
MAX_STRIDE = 4
PARAM_DTYPES = ("int8", "int32")


def write_tensor(path: Path, array) -> Path:
    """``<path>.bin``: the array's bytes, little-endian, C order."""
    a = np.ascontiguousarray(array)
    out = path.with_name(path.name + ".bin")  # path has no suffix yet; its name may hold dots
    a.astype(a.dtype.newbyteorder("<"), copy=False).tofile(out)
    return out


def read_tensor(path: Path, record: dict) -> np.ndarray:
    """A ``.bin`` file back as the array its ``ir.json`` record describes (shape, dtype)."""
    dtype = np.dtype(record["dtype"])
    shape = [int(d) for d in record["shape"]]
    data = np.fromfile(path, dtype=dtype.newbyteorder("<"))
    if data.size != int(np.prod(shape, dtype=np.int64)):
        raise IrgenError(f"{path}: {data.size} {dtype} values, the record's shape {shape} needs "
                         f"{int(np.prod(shape, dtype=np.int64))}")
    return data.reshape(shape).astype(dtype)


def check_layer(layer: dict) -> list[str]:
    """The constraints of the acme NPU that ``layer`` breaks (empty when it fits)."""
    why = []
    for role, p in (layer.get("params") or {}).items():
        if p["dtype"] not in PARAM_DTYPES:
            why.append(f"parameter {role} is {p['dtype']}: the acme NPU takes {' and '.join(PARAM_DTYPES)} "
                       "parameters only (quantize the model)")
    w = (layer.get("params") or {}).get("weight")
    if layer["op"] in ("conv2d", "depthwise_conv2d") and w is not None and len(w["shape"]) == 4:
        layout = w.get("layout") if len(w.get("layout") or "") == 4 else "OIHW"
        kh, kw = w["shape"][layout.index("H")], w["shape"][layout.index("W")]
        if max(kh, kw) > MAX_KERNEL:
            why.append(f"kernel {kh}x{kw} is larger than {MAX_KERNEL}x{MAX_KERNEL}")
        strides = layer["attrs"].get("strides") or [1, 1]
        if max(strides) > MAX_STRIDE:
            why.append(f"stride {strides} is over {MAX_STRIDE}")
    return why
