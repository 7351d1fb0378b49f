"""Data layout of the ``npu-int8`` backend: NHWC activations, OHWI weights, padded channels.

A tensor is stored *physically* as the NPU reads it; its ``ir.json`` record keeps
the *logical* shape, dtype and layout, and its ``storage`` says how to get from
one to the other:

* activations (model inputs and layer outputs) with a 4-D layout (``NCHW`` or
  ``NHWC``) are stored ``NHWC``; 2-D ``NC`` ones stay ``NC``;
* the weight of ``conv2d`` (any ``kernel_layout``: ``OIHW``, ``HWIO``, ...) is
  stored ``OHWI``; the weight of ``depthwise_conv2d`` (``OIHW`` with I = 1, one
  filter per channel) is stored ``OHWI`` with I = 1, i.e. ``[C, KH, KW, 1]``;
  the weight of ``dense`` (``IO``: the graph computes ``x @ W``) is stored ``OI``;
* the bias of ``conv2d``, ``depthwise_conv2d`` and ``dense`` (recorded in its
  broadcast shape such as ``[1, C, 1, 1]``) is stored as one value per output
  channel, layout ``O``;
* the channel axis (``C`` of activations, ``O`` of weights and biases) is padded
  with zeros at its end to a multiple of :attr:`Settings.channel_multiple`;
* any other tensor (a layout no op states, a table, a float model input) is
  stored as it is, unpadded.

``storage`` records: ``layout`` (physical), ``shape`` (physical, padded),
``dtype``, ``byte_order``, ``transpose`` (the ``numpy.transpose`` axes taking the
logical array, flattened first when ``flatten`` is true, to the physical one, or
null), ``flatten``, ``padding`` (physical axis letter -> ``[before, after]``
zeros added) and ``channel_multiple``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

ACTIVATION_LAYOUT = "NHWC"
WEIGHT_LAYOUT = "OHWI"
#: layers whose weight and bias are stored per output channel
CHANNEL_OPS = frozenset({"conv2d", "depthwise_conv2d", "dense"})


@dataclass(frozen=True)
class Plan:
    """How one tensor goes from its logical to its physical form."""

    layout: str | None  # physical layout (None: unknown, stored as it is)
    transpose: tuple[int, ...] | None = None  # numpy.transpose axes, logical -> physical
    flatten: bool = False  # reshaped to 1-D first (a per-channel vector)
    channel: str | None = None  # the physical axis letter padded to the channel multiple


def _axes(src: str, dst: str) -> tuple[int, ...] | None:
    if len(src) != len(dst) or sorted(src) != sorted(dst):
        return None
    return tuple(src.index(c) for c in dst)


def plan(kind: str, shape: tuple[int, ...], layout: str | None, role: str | None = None,
         op: str | None = None) -> Plan:
    """The physical form of a tensor (see the module docstring)."""
    if kind in ("input", "activation"):
        if layout and len(shape) == 4 and (axes := _axes(layout, ACTIVATION_LAYOUT)) is not None:
            return Plan(ACTIVATION_LAYOUT, axes, channel="C")
        if layout == "NC" and len(shape) == 2:
            return Plan("NC", None, channel="C")
        return Plan(layout)
    if op in CHANNEL_OPS and role == "weight":
        if op in ("conv2d", "depthwise_conv2d") and layout and len(shape) == 4 \
                and (axes := _axes(layout, WEIGHT_LAYOUT)) is not None:
            return Plan(WEIGHT_LAYOUT, axes, channel="O")
        if op == "dense" and layout in ("IO", "OI") and len(shape) == 2:
            return Plan("OI", (1, 0) if layout == "IO" else None, channel="O")
    if op in CHANNEL_OPS and role == "bias" and len(shape) >= 1 and sum(d != 1 for d in shape) <= 1:
        return Plan("O", None, flatten=True, channel="O")
    return Plan(layout)


def to_physical(arr: np.ndarray, p: Plan, multiple: int) -> tuple[np.ndarray, dict]:
    """The physical array of ``arr`` and its ``storage`` record (without files and formats)."""
    a = arr.reshape(-1) if p.flatten else arr
    if p.transpose is not None:
        a = a.transpose(p.transpose)
    padding = {}
    if p.channel is not None and p.layout:
        axis = p.layout.index(p.channel)
        after = -a.shape[axis] % multiple
        widths = [(0, 0)] * a.ndim
        widths[axis] = (0, after)
        a = np.pad(a, widths, mode="constant", constant_values=0)
        padding = {p.channel: [0, after]}
    a = np.ascontiguousarray(a)
    storage = {
        "layout": p.layout,
        "shape": [int(d) for d in a.shape],
        "dtype": str(a.dtype),
        "transpose": list(p.transpose) if p.transpose is not None else None,
        "flatten": p.flatten,
        "padding": padding,
        "channel_multiple": multiple,
    }
    return a, storage


def to_logical(phys: np.ndarray, storage: dict, shape: list[int], dtype: str) -> np.ndarray:
    """The logical array (the ``ir.json`` record's ``shape`` and ``dtype``) of a physical one."""
    a = phys
    layout = storage.get("layout") or ""
    for letter, (before, after) in (storage.get("padding") or {}).items():
        axis = layout.index(letter)
        index = [slice(None)] * a.ndim
        index[axis] = slice(int(before), a.shape[axis] - int(after))
        a = a[tuple(index)]
    if storage.get("transpose") is not None:
        a = a.transpose(np.argsort(storage["transpose"]))
    return np.ascontiguousarray(a).reshape([int(d) for d in shape]).astype(np.dtype(dtype), copy=False)
