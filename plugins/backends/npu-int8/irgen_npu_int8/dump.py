"""What ``irgen compare`` needs of the NPU: its dump files read as the NPU holds them, and a
signature of a bug of its padded layout.

* :data:`READER`: the dump reader ``npu-int8`` (``irgen_register_dump_readers``): a
  ``.bin``, ``.hex`` or ``.npy`` file of a dump laid out like an OUT this backend wrote,
  or named by a ``--map`` entry's ``format: npu-int8``, read as its physical array
  (:func:`irgen_npu_int8.store.read_physical`); irgen strips the channel padding itself,
  keeping its values for the ``channel_padding`` signature.
* :data:`SIGNATURE`: ``npu-int8-dense-channels`` (code ``channel_padding``): the device
  wrote each position's channels one after the other without the padding the storage
  gives them (a row stride of C where the layout pads to a multiple of 16).
"""

from __future__ import annotations

import numpy as np

from irgen.plugin import DumpReader, Mismatch, Signature

from . import store


def check_dense_channels(m: Mismatch) -> str | None:
    """The channels written densely (C per position) where the storage pads them."""
    letters = m.physical_layout or ""
    if m.padding is None or "C" not in letters or not m.layout or "C" not in m.layout:
        return None
    phys = m.to_physical(m.expected)
    axis, channels = letters.index("C"), m.expected.shape[m.layout.index("C")]
    if phys.shape[axis] == channels:
        return None
    dense = np.take(phys, np.arange(channels), axis=axis).reshape(-1)
    memory = np.zeros(phys.size, phys.dtype)
    memory[:dense.size] = dense
    if not m.explains(m.to_logical(memory.reshape(phys.shape))):
        return None
    return (f"the device wrote the {channels} channels of each position one after the other, without the padding "
            f"to {phys.shape[axis]} the storage gives them")


READER = DumpReader(name="npu-int8", read=store.read_physical,
                    description="npu-int8 .bin/.hex/.npy dump files, read as the NPU holds them (padding included)")
SIGNATURE = Signature(name="npu-int8-dense-channels", code="channel_padding", check=check_dense_channels,
                      description=check_dense_channels.__doc__)
