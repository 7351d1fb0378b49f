"""The data movements a ``lut`` record may name (a requantizing Slice, Transpose, MaxPool...):
verify's recompute applies the table, then the move (the layer's last op) on the integers."""

from __future__ import annotations

from typing import Any

import numpy as np


#: the data movements a ``lut`` record may name: the table is applied, then the move (the layer's
#: last op, with its attributes) moves the integers
MOVES = frozenset({"nn.max_pool2d", "nn.max_pool3d", "reshape", "permute_dims", "flatten", "squeeze", "expand_dims",
                   "take", "strided_slice"})


def move_after_table(layer: dict[str, Any], t: np.ndarray, inputs: list[np.ndarray],
                     params: dict[str, np.ndarray]) -> np.ndarray:
    """The data movement of a ``lut`` layer applied to its table's output ``t``: the layer's last
    op (which must be that move) with ``t`` as its data operand."""
    from irgen.plugin import UnsupportedLayer, run_layer

    op = layer["quant"]["op"]
    ops = layer.get("fused_ops") or []
    last = dict(ops[-1]) if ops else {}
    if (last.get("relax_op") or last.get("op")) != f"relax.{op}" or not last.get("args"):
        raise UnsupportedLayer(layer.get("name", "?"), op, "the table's data movement is not the layer's last op")
    last["args"] = ["input:0", *last["args"][1:]]
    return run_layer({"name": layer.get("name", "?"), "fused_ops": [last]}, [t, *inputs[1:]], params)[0]
