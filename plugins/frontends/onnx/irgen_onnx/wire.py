"""Reading a ``.onnx`` file without its large weights: a scan of protobuf's wire format.

protobuf parses a model from one ``bytes`` object into a copy of its own, so a plain
read holds the weights twice while it parses, and the parsed model keeps them for as
long as it lives: through TVM's import, which makes a third copy of each as a constant.
:func:`stripped_model` reads the file with ``pread`` (nothing is mapped) and copies every
field except the ``raw_data`` of large top-level initializers, which stay in the file:
each such tensor comes out marked external, its ``offset`` and ``length`` pointing into
the model file itself, under a key only this process knows (:data:`SELF_KEY`), so the
loader tells the tensors this scan left out from external data a model declares. The
loader reads them one at a time when they are converted (:func:`irgen_onnx.loader.tensor_array`).

Anything the scan does not expect (a group, a malformed varint, a length past the end,
two ``graph`` fields, a tensor that is already external or whose data does not match its
shape) makes it return None: the caller then parses the whole file as protobuf does, with
protobuf's own errors.
"""

from __future__ import annotations

import os
import secrets

#: marks a tensor whose raw data this scan left in the model file (unguessable per process)
SELF_KEY = "irgen_self_" + secrets.token_hex(12)

# field numbers (onnx.proto)
_MODEL_GRAPH = 7
_GRAPH_INITIALIZER = 5
_TENSOR_DIMS, _TENSOR_DATA_TYPE, _TENSOR_SEGMENT, _TENSOR_RAW_DATA = 1, 2, 3, 9
_TENSOR_EXTERNAL_DATA, _TENSOR_DATA_LOCATION = 13, 14
_EXTERNAL = 1  # TensorProto.DataLocation.EXTERNAL
_STRING = 8  # TensorProto.STRING
_VARINT, _FIXED64, _LEN, _FIXED32 = 0, 1, 2, 5


class _Unexpected(Exception):
    """Something the scan does not handle: the caller parses the whole file instead."""


class _File:
    """``pread`` over a descriptor: nothing of the file is mapped into memory."""

    def __init__(self, fd: int, size: int):
        self.fd, self.size = fd, size

    def read(self, offset: int, n: int) -> bytes:
        parts, got = [], 0
        while got < n:
            chunk = os.pread(self.fd, n - got, offset + got)
            if not chunk:
                raise _Unexpected("the file ended early")
            parts.append(chunk)
            got += len(chunk)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def varint(self, offset: int, end: int) -> tuple[int, int]:
        head = os.pread(self.fd, min(10, end - offset), offset)
        value = shift = 0
        for i, byte in enumerate(head):
            value |= (byte & 0x7F) << shift
            if not byte & 0x80:
                return value, offset + i + 1
            shift += 7
        raise _Unexpected("a malformed varint")


def _fields(f: _File, start: int, end: int):
    """(field, wire type, tag offset, payload offset, end offset, varint value) of each field."""
    pos = start
    while pos < end:
        tag, p = f.varint(pos, end)
        field, wt = tag >> 3, tag & 7
        if field == 0:
            raise _Unexpected("field number 0")
        value, payload = None, p
        if wt == _VARINT:
            value, p = f.varint(p, end)
        elif wt == _FIXED64:
            p += 8
        elif wt == _FIXED32:
            p += 4
        elif wt == _LEN:
            n, payload = f.varint(p, end)
            p = payload + n
        else:
            raise _Unexpected(f"wire type {wt}")
        if p > end:
            raise _Unexpected("a field runs past its message")
        yield field, wt, pos, payload, p, value
        pos = p


def _varint_bytes(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _len_field(field: int, payload: bytes) -> bytes:
    return _varint_bytes(field << 3 | _LEN) + _varint_bytes(len(payload)) + payload


def _entry(key: str, value: str) -> bytes:
    """A StringStringEntryProto (key = 1, value = 2) as an ``external_data`` field."""
    return _len_field(_TENSOR_EXTERNAL_DATA, _len_field(1, key.encode()) + _len_field(2, value.encode()))


def _packed(f: _File, start: int, end: int) -> list[int]:
    out, pos = [], start
    while pos < end:
        v, pos = f.varint(pos, end)
        out.append(v)
    return out


def _tensor(f: _File, start: int, end: int, min_bytes: int, data_bytes) -> bytes | None:
    """The TensorProto in [start, end) without its raw data, marked external; None to keep it whole."""
    fields = list(_fields(f, start, end))
    raw = [x for x in fields if x[0] == _TENSOR_RAW_DATA]
    if len(raw) != 1 or raw[0][1] != _LEN or raw[0][4] - raw[0][3] <= min_bytes:
        return None
    if any(x[0] in (_TENSOR_EXTERNAL_DATA, _TENSOR_DATA_LOCATION, _TENSOR_SEGMENT) for x in fields):
        return None
    dims: list[int] = []
    dtype = None
    for field, wt, _, payload, stop, value in fields:
        if field == _TENSOR_DIMS:
            dims += [value] if wt == _VARINT else _packed(f, payload, stop) if wt == _LEN else [None]
        elif field == _TENSOR_DATA_TYPE:
            dtype = value if wt == _VARINT else None
    if dtype is None or dtype == _STRING or any(d is None or d >= 1 << 63 for d in dims):
        return None
    offset, length = raw[0][3], raw[0][4] - raw[0][3]
    try:
        if data_bytes(dims, dtype) != length:
            return None  # the loader's checks name the mismatch
    except Exception:  # noqa: BLE001  an unknown element type: the loader names it
        return None
    kept = b"".join(f.read(tag, stop - tag) for field, _, tag, _, stop, _ in fields if field != _TENSOR_RAW_DATA)
    return (kept + _entry(SELF_KEY, "1") + _entry("offset", str(offset)) + _entry("length", str(length))
            + _varint_bytes(_TENSOR_DATA_LOCATION << 3 | _VARINT) + _varint_bytes(_EXTERNAL))


def _graph(f: _File, start: int, end: int, min_bytes: int, data_bytes) -> tuple[bytes, int]:
    parts, stripped = [], 0
    for field, wt, tag, payload, stop, _ in _fields(f, start, end):
        if field == _GRAPH_INITIALIZER and wt == _LEN:
            t = _tensor(f, payload, stop, min_bytes, data_bytes)
            if t is not None:
                parts.append(_len_field(_GRAPH_INITIALIZER, t))
                stripped += 1
                continue
        parts.append(f.read(tag, stop - tag))
    return b"".join(parts), stripped


def stripped_model(fd: int, size: int, min_bytes: int, data_bytes) -> tuple[bytes, int] | None:
    """The serialized ModelProto of the file open on ``fd`` (``size`` bytes) with the raw data
    of each top-level initializer over ``min_bytes`` left out (see the module doc), and how
    many were left out; None when the scan meets something it does not handle.
    ``data_bytes(dims, elem_type)`` is the size the loader expects of a tensor's raw data."""
    f = _File(fd, size)
    parts, seen_graph, stripped = [], False, 0
    try:
        for field, wt, tag, payload, stop, _ in _fields(f, 0, size):
            if field == _MODEL_GRAPH and wt == _LEN:
                if seen_graph:
                    return None  # protobuf would merge the two
                seen_graph = True
                graph, stripped = _graph(f, payload, stop, min_bytes, data_bytes)
                parts.append(_len_field(_MODEL_GRAPH, graph))
            else:
                parts.append(f.read(tag, stop - tag))
    except (_Unexpected, OSError, RecursionError):
        return None
    return b"".join(parts), stripped
