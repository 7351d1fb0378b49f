"""Checking an untrusted ``.tflite`` flatbuffer before anything reads it.

The ``tflite`` package (and TVM's importer on top of it) reads a flatbuffer
without verifying it: an offset past the end raises a bare ``struct.error``, an
index out of range silently reads whatever bytes are there. :func:`check_model`
walks every table the importer reads (model, operator codes, subgraphs, tensors,
quantization, sparsity, operators and the header of their option tables,
buffers) with bounds checks, then checks what the bytes mean: every tensor,
operator-code, buffer and subgraph index in range, names in UTF-8, no negative
dimension, constant data of the size its shape says, buffer ``offset``/``size``
inside the file, and every tensor's size under ``--max-tensor-bytes``.

A buffer may hold its data after the flatbuffer instead of inside it (``offset`` and
``size``, from the start of the file: the format of models over 2 GB, which Google's
ai-edge-quantizer writes for every model). The TFLite interpreter reads such a buffer
when it has no inline data and its offset is over 1; so does irgen
(:mod:`irgen_tensorflow.external`), once this check has found its bytes inside the file
and their count equal to what the tensor's shape says.

A structural fault raises :class:`Unreadable` (the caller turns it into
``<file>: not a readable TFLite model (...)``); a size over the limit raises
the :class:`irgen.plugin.IrgenError` of :func:`irgen.plugin.check_tensor_size`.
"""

from __future__ import annotations

import math
import struct
from typing import Iterator

from irgen.plugin import check_tensor_size

IDENTIFIER = b"TFL3"

# TFLite TensorType -> numpy dtype name (tflite/TensorType.py)
TYPES = {
    0: "float32", 1: "float16", 2: "int32", 3: "uint8", 4: "int64", 5: "string", 6: "bool",
    7: "int16", 8: "complex64", 9: "int8", 10: "float64", 11: "complex128", 12: "uint64",
    13: "resource", 14: "variant", 15: "uint32", 16: "uint16", 17: "int4",
}
# bytes per element of the types above (int4 packs two in a byte: count it as one;
# string/resource/variant have no fixed size: count one byte per element)
_ITEMSIZE = {
    "float32": 4, "float16": 2, "int32": 4, "uint8": 1, "int64": 8, "bool": 1, "int16": 2,
    "complex64": 8, "int8": 1, "float64": 8, "complex128": 16, "uint64": 8, "uint32": 4, "uint16": 2,
}
_SIZE_DTYPE = {"int4": "int8", "string": "uint8", "resource": "uint8", "variant": "uint8"}


class Unreadable(Exception):
    """The flatbuffer is malformed; the message says where."""


class _Table:
    __slots__ = ("pos", "vt", "vtsize", "objsize")

    def __init__(self, pos: int, vt: int, vtsize: int, objsize: int):
        self.pos, self.vt, self.vtsize, self.objsize = pos, vt, vtsize, objsize


class _Reader:
    """Bounds-checked reads of flatbuffer tables, vectors and strings."""

    def __init__(self, buf: bytes):
        self.buf = buf
        self.n = len(buf)

    def need(self, pos: int, size: int, what: str) -> None:
        if pos < 0 or size < 0 or pos + size > self.n:
            raise Unreadable(f"{what}: bytes {pos}..{pos + size} lie outside the file ({self.n} bytes)")

    def _get(self, fmt: str, pos: int, what: str):
        self.need(pos, struct.calcsize(fmt), what)
        return struct.unpack_from(fmt, self.buf, pos)[0]

    def table(self, pos: int, what: str) -> _Table:
        self.need(pos, 4, what)
        vt = pos - struct.unpack_from("<i", self.buf, pos)[0]
        self.need(vt, 4, f"{what} (vtable)")
        vtsize, objsize = struct.unpack_from("<HH", self.buf, vt)
        if vtsize < 4 or vtsize % 2 or objsize < 4:
            raise Unreadable(f"{what}: malformed vtable (size {vtsize}, table size {objsize})")
        self.need(vt, vtsize, f"{what} (vtable)")
        self.need(pos, objsize, what)
        tab = _Table(pos, vt, vtsize, objsize)
        for voff in range(4, vtsize, 2):  # every field inside the table
            off = struct.unpack_from("<H", self.buf, vt + voff)[0]
            if off and (off < 4 or off >= objsize):
                raise Unreadable(f"{what}: field {(voff - 4) // 2} at offset {off} outside the table ({objsize} bytes)")
        return tab

    def field(self, tab: _Table, slot: int, size: int, what: str) -> int | None:
        voff = 4 + 2 * slot
        if voff >= tab.vtsize:
            return None
        off = struct.unpack_from("<H", self.buf, tab.vt + voff)[0]
        if not off:
            return None
        if off + size > tab.objsize:
            raise Unreadable(f"{what}: field {slot} runs past the end of its table")
        return tab.pos + off

    def scalar(self, tab: _Table, slot: int, fmt: str, default, what: str):
        p = self.field(tab, slot, struct.calcsize(fmt), what)
        return default if p is None else struct.unpack_from(fmt, self.buf, p)[0]

    def ref(self, tab: _Table, slot: int, what: str) -> int | None:
        p = self.field(tab, slot, 4, what)
        if p is None:
            return None
        target = p + struct.unpack_from("<I", self.buf, p)[0]
        self.need(target, 4, what)
        return target

    def vector(self, tab: _Table, slot: int, elem: int, what: str) -> tuple[int, int]:
        """(start, length) of a vector field; (0, 0) when absent."""
        t = self.ref(tab, slot, what)
        if t is None:
            return 0, 0
        length = struct.unpack_from("<I", self.buf, t)[0]
        self.need(t + 4, length * elem, f"{what} ({length} elements)")
        return t + 4, length

    def ints(self, tab: _Table, slot: int, what: str, fmt: str = "<i") -> list[int]:
        start, length = self.vector(tab, slot, struct.calcsize(fmt), what)
        return [v[0] for v in struct.iter_unpack(fmt, self.buf[start:start + length * struct.calcsize(fmt)])]

    def string(self, tab: _Table, slot: int, what: str) -> str | None:
        t = self.ref(tab, slot, what)
        if t is None:
            return None
        length = struct.unpack_from("<I", self.buf, t)[0]
        self.need(t + 4, length, what)
        try:
            return self.buf[t + 4:t + 4 + length].decode("utf-8")
        except UnicodeDecodeError:
            raise Unreadable(f"{what}: not UTF-8 text") from None

    def tables(self, tab: _Table, slot: int, what: str) -> Iterator[_Table]:
        start, length = self.vector(tab, slot, 4, what)
        for i in range(length):
            p = start + 4 * i
            yield self.table(p + struct.unpack_from("<I", self.buf, p)[0], f"{what} {i}")

    def subtable(self, tab: _Table, slot: int, what: str) -> _Table | None:
        t = self.ref(tab, slot, what)
        return None if t is None else self.table(t, what)


def _shape_text(shape) -> str:
    return str(tuple(int(d) for d in shape))


def check_model(buf: bytes, limit: int | None, where: str) -> dict[int, tuple[int, int]]:
    """Check the flatbuffer ``buf`` (see the module doc). ``where`` prefixes size errors.
    Returns the buffers whose data lies after the flatbuffer: index -> (offset, size)."""
    r = _Reader(buf)
    if len(buf) < 8:
        raise Unreadable(f"{len(buf)} bytes, too short for a flatbuffer")
    if buf[4:8] != IDENTIFIER:
        raise Unreadable("no 'TFL3' flatbuffer identifier at bytes 4..8")
    root = r._get("<I", 0, "root offset")
    model = r.table(root, "the model table")

    # operator codes
    n_codes = 0
    for i, oc in enumerate(r.tables(model, 1, "operator code")):
        r.scalar(oc, 0, "<b", 0, f"operator code {i}")
        r.string(oc, 1, f"operator code {i} custom name")
        r.scalar(oc, 2, "<i", 1, f"operator code {i}")
        r.scalar(oc, 3, "<i", 0, f"operator code {i}")
        n_codes += 1

    # buffers: data length by index (inline, or stored after the flatbuffer: external)
    buffers: list[int] = []
    external: dict[int, tuple[int, int]] = {}
    for i, b in enumerate(r.tables(model, 4, "buffer")):
        start, length = r.vector(b, 0, 1, f"buffer {i} data")
        offset = r.scalar(b, 1, "<Q", 0, f"buffer {i}")
        size = r.scalar(b, 2, "<Q", 0, f"buffer {i}")
        if offset > 1 or size:
            if offset + size > len(buf):
                raise Unreadable(f"buffer {i}: offset {offset} + size {size} points past the end of the file "
                                 f"({len(buf)} bytes)")
        if i and not start and offset > 1:  # no inline data: the interpreter reads offset/size (buffer 0: no data)
            external[i] = (offset, size)
            length = size
        buffers.append(length)
    r.string(model, 3, "the model description")

    subgraphs = list(r.tables(model, 2, "subgraph"))
    if not subgraphs:
        raise Unreadable("the model has no subgraph")
    for s, sg in enumerate(subgraphs):
        _check_subgraph(r, s, sg, n_codes, buffers, external, len(subgraphs), limit, where)
    if r.vector(subgraphs[0], 3, 4, "subgraph 0 operators")[1] < 1:
        raise Unreadable("the main subgraph has no operators")
    return external


def _check_subgraph(r: _Reader, s: int, sg: _Table, n_codes: int, buffers: list[int],
                    external: dict[int, tuple[int, int]], n_subgraphs: int, limit: int | None, where: str) -> None:
    """Check subgraph ``s``: its name, each of its tensors (:func:`_check_tensor`), the tensor
    indices of its inputs and outputs, and each of its operators (:func:`_check_operator`)."""
    at = f"subgraph {s}"
    r.string(sg, 4, f"{at} name")
    n = 0
    for t, tensor in enumerate(r.tables(sg, 0, f"{at} tensor")):
        _check_tensor(r, tensor, t, at, buffers, external, limit, where)
        n += 1
    for k in r.ints(sg, 1, f"{at} inputs"):
        _check_index(k, n, at, f"{at} input")
    for k in r.ints(sg, 2, f"{at} outputs"):
        _check_index(k, n, at, f"{at} output")
    for o, op in enumerate(r.tables(sg, 3, f"{at} operator")):
        _check_operator(r, op, f"operator {o} of {at}", n_codes, n, at)


def _check_index(i: int, n: int, at: str, what: str, optional: bool = False) -> None:
    """Tensor index ``i`` (``what``) is one of the ``n`` tensors of subgraph ``at`` (or -1, when
    ``optional``: an operator's omitted input)."""
    if optional and i == -1:
        return
    if not 0 <= i < n:
        raise Unreadable(f"{what}: tensor index {i} out of range ({at} has {n} tensors)")


def _check_tensor(r: _Reader, tensor: _Table, t: int, at: str, buffers: list[int],
                  external: dict[int, tuple[int, int]], limit: int | None, where: str) -> None:
    """Read tensor ``t`` of subgraph ``at`` (shape, type, buffer, name, quantization, sparsity,
    shape signature), then check what it says (:func:`_check_tensor_data`)."""
    tat = f"{at} tensor {t}"
    shape = r.ints(tensor, 0, f"{tat} shape")
    ttype = r.scalar(tensor, 1, "<b", 0, tat)
    buf_idx = r.scalar(tensor, 2, "<I", 0, tat)
    name = r.string(tensor, 3, f"{tat} name") or ""
    quant = r.subtable(tensor, 4, f"{tat} quantization")
    if quant is not None:
        for slot, elem in ((0, 4), (1, 4), (2, 4), (3, 8)):
            r.vector(quant, slot, elem, f"{tat} quantization")
        r.scalar(quant, 4, "<B", 0, f"{tat} quantization")
        r.subtable(quant, 5, f"{tat} quantization details")
        r.scalar(quant, 6, "<i", 0, f"{tat} quantization")
    sparsity = r.subtable(tensor, 6, f"{tat} sparsity")
    if sparsity is not None:
        _read_sparsity(r, sparsity, tat)
    signature = r.ints(tensor, 7, f"{tat} shape signature")
    label = f"tensor {name!r}" if name else f"tensor {t} of {at}"
    _check_tensor_data(label, shape, signature, ttype, buf_idx, sparsity is not None, buffers, external, limit, where)


def _read_sparsity(r: _Reader, sparsity: _Table, tat: str) -> None:
    """Read the sparsity table of tensor ``tat``: its traversal order, block map and dimensions
    (each dimension's array segments and indices, a union of int vectors)."""
    r.ints(sparsity, 0, f"{tat} sparsity")
    r.ints(sparsity, 1, f"{tat} sparsity")
    for k, dim in enumerate(r.tables(sparsity, 2, f"{tat} sparsity dimension")):
        for type_slot in (2, 4):  # array_segments, array_indices: a union of int vectors
            kind = r.scalar(dim, type_slot, "<B", 0, f"{tat} sparsity dimension {k}")
            seg = r.subtable(dim, type_slot + 1, f"{tat} sparsity dimension {k}")
            if seg is not None:
                r.vector(seg, 0, {1: 4, 2: 2, 3: 1}.get(kind, 1), f"{tat} sparsity dimension {k}")


def _check_tensor_data(label: str, shape: list[int], signature: list[int], ttype: int, buf_idx: int, sparse: bool,
                       buffers: list[int], external: dict[int, tuple[int, int]], limit: int | None,
                       where: str) -> None:
    """What a tensor's fields say: no negative dimension (below -1 in the signature), a known
    type, its buffer in range, a size under ``limit``, and constant data of the size its shape
    says (a sparse tensor's aside), inline or after the flatbuffer (``external``)."""
    if any(d < 0 for d in shape):
        raise Unreadable(f"{label}: negative dimension in shape {_shape_text(shape)}")
    if any(d < -1 for d in signature):
        raise Unreadable(f"{label}: dimension below -1 in shape signature {_shape_text(signature)}")
    dtype = TYPES.get(ttype)
    if dtype is None:
        raise Unreadable(f"{label}: unknown tensor type {ttype}")
    if buf_idx >= max(len(buffers), 1):
        raise Unreadable(f"{label}: buffer index {buf_idx} out of range (the model has {len(buffers)} buffers)")
    check_tensor_size(f"{where}: {label}", shape, _SIZE_DTYPE.get(dtype, dtype), limit)
    data = buffers[buf_idx] if buffers else 0
    outside = external.get(buf_idx)
    if (data > 0 or outside is not None) and not sparse and dtype in _ITEMSIZE:
        need = math.prod(shape) * _ITEMSIZE[dtype]
        if data != need:
            where_data = f" (stored outside the flatbuffer, at offset {outside[0]})" if outside is not None else ""
            raise Unreadable(f"{label}: its buffer{where_data} holds {data} bytes, its shape {_shape_text(shape)} "
                             f"{dtype} needs {need}")


def _check_operator(r: _Reader, op: _Table, oat: str, n_codes: int, n: int, at: str) -> None:
    """Read operator ``oat`` of subgraph ``at`` (``n`` tensors): its operator code and tensor
    indices in range, its options' headers, and its large custom options inside the file."""
    code = r.scalar(op, 0, "<I", 0, oat)
    if code >= n_codes:
        raise Unreadable(f"{oat}: operator code index {code} out of range (the model has {n_codes} operator codes)")
    for k in r.ints(op, 1, f"{oat} inputs"):
        _check_index(k, n, at, f"{oat} input", optional=True)
    for k in r.ints(op, 2, f"{oat} outputs"):
        _check_index(k, n, at, f"{oat} output", optional=True)
    r.scalar(op, 3, "<B", 0, oat)
    r.subtable(op, 4, f"{oat} options")
    r.vector(op, 5, 1, f"{oat} custom options")
    r.vector(op, 7, 1, f"{oat} mutating inputs")
    for k in r.ints(op, 8, f"{oat} intermediates"):
        _check_index(k, n, at, f"{oat} intermediate", optional=True)
    big_off = r.scalar(op, 9, "<Q", 0, oat)
    big_size = r.scalar(op, 10, "<Q", 0, oat)
    if (big_off or big_size) and big_off + big_size > r.n:
        raise Unreadable(f"{oat}: custom options at offset {big_off} + size {big_size} point past the end of the file")
    r.scalar(op, 11, "<B", 0, oat)
    r.subtable(op, 12, f"{oat} options")
