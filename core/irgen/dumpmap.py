"""Where a device's dump keeps each tensor, and how: the default layout and ``--map FILE``.

By default a dump is laid out like OUT: every tensor at its record's ``file`` path, in
the format of the backend that wrote OUT (its physical ``storage``: layout, channel
padding). A map (YAML, or JSON by its ``.json`` suffix) describes a dump in a device's
own naming and layout::

    files: "{index:03d}_{layer}.bin"   # optional: the file of every layer output it does not list
    defaults:                          # optional: what every entry says unless it says otherwise
      format: raw                      # raw | npy | a registered dump reader (e.g. npu-int8)
      dtype: int8
      layout: NHWC                     # the physical layout in the file
      byte_order: little
      channel_multiple: 16             # channels padded with (ideally) zeros to a multiple of 16
    tensors:
      conv1: {file: out/conv1.raw}     # a tensor name, or a layer name (its first output)
      fc: {file: out/fc.bin, shape: [1, 16], offset: 64}

An entry's keys: ``file`` (relative to DUMP), ``format``, ``dtype``, ``shape`` (the
physical shape, padding included; default: the record's shape in ``layout``, padded),
``layout`` (physical axis letters; default: the record's own), ``byte_order``
(``little`` or ``big``), ``channel_multiple`` (pad the ``C`` axis to a multiple of it),
``offset`` (bytes of a header to skip, ``raw`` only). The pattern's fields are
``{layer}`` (the layer name, ``/`` written ``_``), ``{index}`` (the layer's place in IR order, from 0),
``{output}`` (the output's index in its layer) and ``{tensor}`` (the file stem OUT uses),
each with an optional format spec (``{index:03d}``). A format ``raw`` file holds the
values and nothing else (after ``offset``); ``npy`` a numpy file. Unlisted tensors without
a pattern are read as by default.

:class:`Physical` takes a logical array to its storage order and back, for the reader
and for the signatures that reason about memory (:mod:`irgen.diagnose`).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from irgen.api import IrgenError
from irgen.safeio import MAX_JSON_BYTES, read_bytes

__all__ = ["Physical", "DumpSpec", "DumpMap", "read_map"]

FORMATS_BUILTIN = ("raw", "npy")
ENTRY_KEYS = ("file", "format", "dtype", "shape", "layout", "byte_order", "channel_multiple", "offset")
MAP_KEYS = ("files", "defaults", "tensors")
_FIELD = re.compile(r"\{(layer|index|output|tensor)(:[0-9<>^=+ #0,._a-zA-Z-]{0,12})?\}")


@dataclass(frozen=True)
class Physical:
    """How a logical array lies in memory: ``layout`` the physical axis letters (None: as
    the logical ``logical`` layout), ``padding`` physical axis letter -> (before, after)
    elements added (zeros, in the golden data)."""

    logical: str | None = None
    layout: str | None = None
    padding: tuple[tuple[str, int, int], ...] = ()

    @classmethod
    def of(cls, record: dict[str, Any], storage: dict[str, Any] | None = None) -> "Physical":
        """The physical form a tensor record (or the ``storage`` given) declares; identity when
        its layouts are unknown or not a reordering of each other."""
        st = record.get("storage") if storage is None else storage
        st = st if isinstance(st, dict) else {}
        logical, layout = record.get("layout"), st.get("layout") or record.get("layout")
        if not (isinstance(logical, str) and isinstance(layout, str) and sorted(logical) == sorted(layout)
                and len(logical) == len(record.get("shape") or ())):
            return cls()
        pads = tuple((str(k), int(v[0]), int(v[1])) for k, v in (st.get("padding") or {}).items()
                     if str(k) in layout and isinstance(v, (list, tuple)) and len(v) == 2)
        return cls(logical, layout, pads)

    @property
    def identity(self) -> bool:
        return (self.layout is None or self.layout == self.logical) and not self.padding

    def _axes(self) -> list[int] | None:
        if self.layout is None or self.layout == self.logical:
            return None
        return [self.logical.index(c) for c in self.layout]

    def shape(self, logical_shape: list[int] | tuple[int, ...]) -> list[int]:
        """The physical shape of a logical one (padding included)."""
        axes = self._axes()
        dims = [int(logical_shape[a]) for a in axes] if axes else [int(d) for d in logical_shape]
        for letter, before, after in self.padding:
            dims[self.layout.index(letter)] += before + after
        return dims

    def to_physical(self, a: np.ndarray) -> np.ndarray:
        """The array as stored: transposed to ``layout``, padded with zeros."""
        a = np.asarray(a)
        axes = self._axes()
        if axes is not None:
            a = a.transpose(axes)
        if self.padding:
            widths = [(0, 0)] * a.ndim
            for letter, before, after in self.padding:
                widths[self.layout.index(letter)] = (before, after)
            a = np.pad(a, widths)
        return np.ascontiguousarray(a)

    def to_logical(self, p: np.ndarray) -> np.ndarray:
        """The logical array of a physical one (padding dropped)."""
        return self.split(p)[0]

    def split(self, p: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        """(the logical array, the values found in the padding or None when there is none)."""
        p = np.asarray(p)
        pad_values = None
        if self.padding:
            keep = np.zeros(p.shape, bool)
            index = [slice(None)] * p.ndim
            for letter, before, after in self.padding:
                axis = self.layout.index(letter)
                index[axis] = slice(before, p.shape[axis] - after)
            keep[tuple(index)] = True
            pad_values = p[~keep]
            p = p[tuple(index)]
        axes = self._axes()
        if axes is not None:
            p = p.transpose(np.argsort(axes))
        return np.ascontiguousarray(p), pad_values


@dataclass
class DumpSpec:
    """Where and how one tensor is in the dump: ``file`` relative to DUMP; ``format``
    (``backend``: as OUT's backend wrote it; ``raw``, ``npy`` or a dump reader's name);
    for ``raw``/``npy``/reader formats the physical ``dtype``, ``shape``, ``byte_order``,
    ``offset`` and :class:`Physical` form."""

    file: str
    format: str = "backend"
    dtype: str | None = None
    shape: list[int] | None = None
    byte_order: str = "little"
    offset: int = 0
    physical: Physical = field(default_factory=Physical)

    def storage(self) -> dict[str, Any]:
        """The ``storage`` record a dump reader is given for this entry."""
        return {"layout": self.physical.layout, "shape": self.shape, "dtype": self.dtype,
                "byte_order": self.byte_order, "padding": {k: [b, a] for k, b, a in self.physical.padding}}


def _check_entry(entry: Any, where: str) -> dict[str, Any]:
    """One map entry, its keys and their types checked."""
    if not isinstance(entry, dict):
        raise IrgenError(f"{where}: expected a mapping of {', '.join(ENTRY_KEYS)}")
    unknown = [str(k)[:40] for k in entry if k not in ENTRY_KEYS]
    if unknown:
        raise IrgenError(f"{where}: unknown key(s) {', '.join(unknown[:5])} (known: {', '.join(ENTRY_KEYS)})")
    text = {"file": str, "format": str, "dtype": str, "layout": str, "byte_order": str}
    for key, typ in text.items():
        if key in entry and not isinstance(entry[key], typ):
            raise IrgenError(f"{where}.{key}: expected a string")
    for key in ("channel_multiple", "offset"):
        v = entry.get(key)
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < (1 if key == "channel_multiple" else 0)):
            raise IrgenError(f"{where}.{key}: expected a {'positive' if key == 'channel_multiple' else 'non-negative'} integer")
    shape = entry.get("shape")
    if shape is not None and not (isinstance(shape, list) and all(isinstance(d, int) and not isinstance(d, bool)
                                                                  and d >= 0 for d in shape) and len(shape) <= 16):
        raise IrgenError(f"{where}.shape: expected a list of non-negative integers")
    if entry.get("byte_order", "little") not in ("little", "big"):
        raise IrgenError(f"{where}.byte_order: 'little' or 'big', got {entry['byte_order']!r:.40}")
    if "dtype" in entry:
        try:
            dt = np.dtype(entry["dtype"])
        except TypeError:
            raise IrgenError(f"{where}.dtype: {entry['dtype']!r:.40} is not a dtype") from None
        if dt.kind not in "biuf":
            raise IrgenError(f"{where}.dtype: {entry['dtype']!r:.40} is not a numeric dtype")
    return entry


class _NoAliases(yaml.SafeLoader):
    """A safe YAML loader that refuses anchors' aliases (a few bytes would expand to millions)."""

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            raise IrgenError("YAML aliases are not allowed in a dump map")
        return super().compose_node(parent, index)


def read_map(path: Path) -> "DumpMap":
    """The ``--map`` file (YAML, or JSON by suffix), checked; one IrgenError naming the file
    and the field otherwise."""
    path = Path(path)
    text = read_bytes(path, "dump map", limit=min(MAX_JSON_BYTES, 4 << 20))
    try:
        doc = json.loads(text) if path.suffix.lower() == ".json" else yaml.load(text, Loader=_NoAliases)  # noqa: S506
    except IrgenError as err:
        raise IrgenError(f"{path}: {err}") from None
    except (ValueError, yaml.YAMLError, RecursionError) as err:
        raise IrgenError(f"{path}: not a valid dump map ({' '.join(str(err).split())[:200]})") from None
    if not isinstance(doc, dict):
        raise IrgenError(f"{path}: a dump map is a mapping of {', '.join(MAP_KEYS)}")
    unknown = [str(k)[:40] for k in doc if k not in MAP_KEYS]
    if unknown:
        raise IrgenError(f"{path}: unknown key(s) {', '.join(unknown[:5])} (known: {', '.join(MAP_KEYS)})")
    defaults = _check_entry(doc.get("defaults") or {}, f"{path}: defaults")
    tensors = doc.get("tensors") or {}
    if not isinstance(tensors, dict):
        raise IrgenError(f"{path}: tensors: expected a mapping of tensor or layer names to entries")
    entries = {str(k): _check_entry(v, f"{path}: tensors[{str(k)[:60]!r}]") for k, v in tensors.items()}
    pattern = doc.get("files")
    if pattern is not None:
        if not isinstance(pattern, str) or "{" in _FIELD.sub("", pattern) or "}" in _FIELD.sub("", pattern):
            raise IrgenError(f"{path}: files: a file name with fields {{layer}}, {{index}}, {{output}}, {{tensor}}")
    return DumpMap(pattern, defaults, entries, str(path))


@dataclass
class DumpMap:
    """A read ``--map`` file (see the module docstring); :meth:`spec` resolves one tensor."""

    pattern: str | None = None
    defaults: dict[str, Any] = field(default_factory=dict)
    entries: dict[str, dict[str, Any]] = field(default_factory=dict)
    source: str = "--map"

    def _file(self, record: dict[str, Any], layer: str, index: int, output: int) -> str | None:
        if self.pattern is None:
            return None
        values = {"layer": re.sub(r"[/\\]", "_", layer), "index": index, "output": output,
                  "tensor": Path(str(record.get("file") or record["name"])).stem}

        def fill(m: re.Match) -> str:
            try:
                return format(values[m.group(1)], (m.group(2) or ":")[1:])
            except ValueError as err:
                raise IrgenError(f"{self.source}: files: {m.group(0)}: {err}") from None

        return _FIELD.sub(fill, self.pattern)

    def spec(self, record: dict[str, Any], layer: str, index: int, output: int) -> DumpSpec | None:
        """Where the map puts this tensor; None when it says nothing of it (read it as by default)."""
        entry = self.entries.get(record["name"]) or (self.entries.get(layer) if output == 0 else None)
        file = (entry or {}).get("file") or self._file(record, layer, index, output)
        if entry is None and file is None:
            return None
        e = {**self.defaults, **(entry or {})}
        fmt = e.get("format") or ("npy" if str(file).endswith(".npy") else "raw")
        logical = record.get("layout")
        layout = e.get("layout") or logical
        pads: tuple = ()
        if layout and "C" in layout and logical and "C" in logical and len(logical) == len(record["shape"]):
            channels = int(record["shape"][logical.index("C")])
            if e.get("channel_multiple"):
                pads = (("C", 0, -channels % int(e["channel_multiple"])),)
            elif e.get("shape") and len(e["shape"]) == len(layout) and e["shape"][layout.index("C")] > channels:
                pads = (("C", 0, e["shape"][layout.index("C")] - channels),)  # padding as the shape says
        physical = Physical(logical, layout, pads) if logical and layout and sorted(logical) == sorted(layout) \
            else Physical()
        if e.get("layout") and physical.layout is None:
            raise IrgenError(f"{self.source}: tensor {record['name']!r:.80}: layout {e['layout']!r:.20} is not a "
                             f"reordering of its logical layout {logical!r:.20}")
        spec = DumpSpec(file=str(file or record.get("file")), format=fmt, dtype=e.get("dtype") or record.get("dtype"),
                        shape=e.get("shape"), byte_order=e.get("byte_order") or "little", offset=int(e.get("offset") or 0),
                        physical=physical)
        return spec if spec.shape is not None else replace(spec, shape=physical.shape(record["shape"]))
