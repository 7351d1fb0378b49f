"""A ``torch.export`` program's weights as TVM tensors on the run's weight file.

TVM's importer binds each parameter, buffer and constant of the program through DLPack: the
TVM tensor is the torch tensor's memory, so every weight stays in memory for as long as the
module does, and a folded copy of it (a transposed ``linear`` weight) is one more. Through
:func:`tvm_weight` a large one goes to the run's weight file instead
(``irgen.plugin.weight_tensor``: during ``irgen run``, an unnamed file read back by pages as
needed), and torch's copy leaves memory with the ``ExportedProgram`` once the import is done.
"""

from __future__ import annotations

from typing import Any, Callable

#: tensors smaller than this keep TVM's own conversion (biases, scales, shapes)
MIN_BYTES = 1 << 16


def tvm_weight(tensor: Any, convert: Callable[[Any], Any]):
    """The TVM tensor of the program's ``tensor``: ``irgen.plugin.weight_tensor`` of its values
    when it is large, dense and numpy can view it (its bytes unchanged); else ``convert(tensor)``
    (TVM's own conversion: sparse layouts, bfloat16, quantized torch dtypes)."""
    import torch

    from irgen.plugin import weight_tensor

    t = tensor.detach()
    if t.layout != torch.strided or t.device.type != "cpu" or t.numel() * t.element_size() < MIN_BYTES:
        return convert(tensor)
    try:
        arr = t.numpy()
    except (TypeError, RuntimeError):  # a dtype numpy has not (bfloat16, qint8), a conjugate view
        return convert(tensor)
    return weight_tensor(arr)
