"""Reading an untrusted ``.onnx`` file and its external data.

The model file must be a regular file (a FIFO would block, ``/dev/zero`` never
ends). Its external data is validated entry by entry before anything is read:
the location must be a plain relative path that resolves inside the model's
folder (``irgen.plugin.inside``), name a regular file, and the offset and
length must be integers that stay inside that file and match the tensor's
declared size, which itself must stay under ``--max-tensor-bytes``. Only then
is the data read, by irgen itself, into the tensor (``onnx``'s own loader is
never pointed at a path taken out of the model). Nothing outside the model's
folder is opened or stat'ed.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any, Iterator

from irgen.plugin import IrgenError, check_tensor_size, human_bytes, inside, open_regular, read_bytes, regular_file

#: protobuf cannot parse a message over 2 GiB; a larger .onnx is not a model
MAX_MODEL_FILE_BYTES = (2 << 30) - 1
#: top-level initializers over this many bytes are read when converted, not with the model
#: (``load_model(defer=True)``: TVM's import never holds every weight twice)
DEFER_BYTES = 1 << 16
#: element types stored packed, several to a byte
_PACKED_BITS = {21: 4, 22: 4, 23: 4, 25: 2, 26: 2}  # UINT4, INT4, FLOAT4E2M1, UINT2, INT2


def q(name: Any, width: int = 80) -> str:
    """A name from the model, quoted on one line and cut to ``width`` characters."""
    text = repr(str(name))
    return text if len(text) <= width else text[: width - 4] + "...'"


def unique_name(used: set[str], base: str) -> str:
    """``base``, or ``base_1``, ``base_2``... the first not in ``used``; added to ``used``."""
    name, k = base, 1
    while name in used:
        name, k = f"{base}_{k}", k + 1
    used.add(name)
    return name


def esc(name: Any, width: int = 80) -> str:
    """A name from the model on one line, unquoted: control characters escaped, cut to ``width``."""
    text = "".join(c if c.isprintable() else repr(c)[1:-1] for c in str(name))
    return text if len(text) <= width else text[: width - 3] + "..."


def one_line(text: Any, width: int = 300) -> str:
    """A message (which may quote the model) on one line: whitespace runs made one space,
    other control characters escaped, cut to ``width``."""
    return esc(" ".join(str(text).split()), width)


# ------------------------------------------------------------------ walking the model


def all_graphs(graph) -> Iterator[Any]:
    """``graph`` and every subgraph in its nodes' attributes (If, Loop, Scan), depth first."""
    yield graph
    for node in graph.node:
        for attr in node.attribute:
            if attr.HasField("g"):
                yield from all_graphs(attr.g)
            for g in attr.graphs:
                yield from all_graphs(g)


def all_nodes(model) -> Iterator[Any]:
    for g in all_graphs(model.graph):
        yield from g.node
    for f in model.functions:
        yield from f.node


def all_tensors(model) -> Iterator[Any]:
    """Every TensorProto in the model: initializers and node attribute tensors, in all graphs."""
    for g in all_graphs(model.graph):
        yield from g.initializer
        for s in g.sparse_initializer:
            yield s.values
            yield s.indices
    for node in all_nodes(model):
        for attr in node.attribute:
            if attr.HasField("t"):
                yield attr.t
            yield from attr.tensors
            if attr.HasField("sparse_tensor"):
                yield attr.sparse_tensor.values
                yield attr.sparse_tensor.indices
            for s in attr.sparse_tensors:
                yield s.values
                yield s.indices


# ------------------------------------------------------------------ tensor sizes


def np_dtype(elem_type: int):
    """The numpy dtype of an ONNX element type, or None when ONNX has no such type."""
    from onnx import helper

    try:
        return helper.tensor_dtype_to_np_dtype(int(elem_type))
    except (KeyError, ValueError, TypeError):
        return None


def type_name(elem_type: int) -> str:
    from onnx import TensorProto

    try:
        return TensorProto.DataType.Name(int(elem_type)).lower()
    except ValueError:
        return f"element type {elem_type}"


def data_bytes(dims, elem_type: int) -> int:
    """Bytes of the raw data of a tensor with these dims and element type."""
    n = math.prod(int(d) for d in dims)
    if int(elem_type) in _PACKED_BITS:
        return (n * _PACKED_BITS[int(elem_type)] + 7) // 8
    dt = np_dtype(elem_type)
    return n * (dt.itemsize if dt is not None and dt.itemsize else 8)


def check_size(what: str, dims, elem_type: int, limit: int | None) -> None:
    """Refuse a tensor of these dims over ``limit`` bytes (or with a negative dim), naming it."""
    dims = [int(d) for d in dims]
    dtype = np_dtype(elem_type)
    name = str(dtype) if dtype is not None and dtype != object else type_name(elem_type)
    check_tensor_size(what, dims, name, None)  # negative dimensions
    if limit is not None and data_bytes(dims, elem_type) > limit:
        check_tensor_size(what, dims, name, limit)
        raise IrgenError(  # check_tensor_size counted a narrower type than ONNX's
            f"{what} would hold {human_bytes(data_bytes(dims, elem_type))} (shape {tuple(dims)}, {name}), "
            f"over the limit of {human_bytes(limit)}; raise it with --max-tensor-bytes if this is meant"
        )


# ------------------------------------------------------------------ the model file


def read_model(path: Path, defer: bool = False):
    """The ModelProto in ``path`` (a regular file), external data not loaded yet.

    ``defer``: the raw data of top-level initializers over :data:`DEFER_BYTES` stays in
    the file (:mod:`.wire`); :func:`load_external_data` marks those tensors deferred and
    :func:`tensor_array` reads each when it is needed."""
    import onnx

    regular_file(path, "model")
    data = None
    with open_regular(path, "model") as f:
        size = os.fstat(f.fileno()).st_size
        if defer and DEFER_BYTES < size <= MAX_MODEL_FILE_BYTES:
            from .wire import stripped_model

            scanned = stripped_model(f.fileno(), size, DEFER_BYTES, data_bytes)
            data = scanned[0] if scanned is not None else None
    if data is None:  # the whole file, parsed by protobuf (its own errors for a malformed one)
        data = read_bytes(path, "model", MAX_MODEL_FILE_BYTES)
    if not data:
        raise IrgenError(f"{path}: not a readable ONNX model (the file is empty)")
    model = onnx.ModelProto()
    try:
        model.ParseFromString(data)
    except RecursionError:
        raise IrgenError(f"{path}: not a readable ONNX model (nested too deeply)") from None
    except Exception as err:  # noqa: BLE001  DecodeError and whatever else protobuf raises
        raise IrgenError(f"{path}: not a readable ONNX model ({type(err).__name__}: {one_line(err, 200)})") from None
    del data
    check_text(model, path)
    if not model.HasField("graph") or not model.graph.node:
        raise IrgenError(f"{path}: not a readable ONNX model (the graph has no nodes)")
    return model


def check_text(msg, path: Path) -> None:
    """Every string field in ``msg`` (names, attributes, doc strings) is valid UTF-8.

    protobuf parses proto2 strings without checking them: upb then hands back
    ``bytes`` where a ``str`` is expected, and copying the field raises
    UnicodeDecodeError later. Numeric and bytes fields (tensor data) are not
    touched."""
    for fd in msg.DESCRIPTOR.fields:
        if fd.type == fd.TYPE_STRING:
            try:  # upb hands back bytes for a string that is not UTF-8; other runtimes raise
                value = getattr(msg, fd.name)
                bad = any(isinstance(v, bytes) for v in value) if fd.is_repeated else isinstance(value, bytes)
            except UnicodeDecodeError:
                bad = True
            if bad:
                raise IrgenError(
                    f"{path}: not a readable ONNX model (a {msg.DESCRIPTOR.name}.{fd.name} is not UTF-8 text)"
                )
        elif fd.type == fd.TYPE_MESSAGE:
            if fd.is_repeated:
                for sub in getattr(msg, fd.name):
                    check_text(sub, path)
            elif msg.HasField(fd.name):
                check_text(getattr(msg, fd.name), path)


def _entries(t, path: Path) -> dict[str, str]:
    info: dict[str, str] = {}
    for e in t.external_data:
        if e.key in info:
            raise IrgenError(f"{path}: tensor {q(t.name)}: external data entry {q(e.key)} given twice")
        info[e.key] = e.value
    return info


def _integer(info: dict[str, str], key: str, t, path: Path, location: str) -> int | None:
    if key not in info:
        return None
    text = info[key]
    if not (text.isascii() and text.isdigit()) or len(text) > 20:
        raise IrgenError(
            f"{path}: tensor {q(t.name)}: external data {q(location)} has {key} {q(text, 40)}, "
            f"not an integer >= 0"
        )
    return int(text)


def deferred(t) -> dict[str, str] | None:
    """The entries of a tensor whose data irgen reads when needed (:func:`tensor_array`), else None."""
    from onnx import TensorProto

    if t.data_location != TensorProto.EXTERNAL:
        return None
    info = {e.key: e.value for e in t.external_data}
    return info if "irgen_file" in info or "irgen_base" in info else None


def _set_entries(t, entries: dict[str, str]) -> None:
    del t.external_data[:]
    for k, v in entries.items():
        e = t.external_data.add()
        e.key, e.value = k, v


def load_external_data(model, path: Path, limit: int | None, defer: bool = False) -> None:
    """Check every external-data entry, then read the data into its tensor (``raw_data``).

    ``defer``: a top-level initializer over :data:`DEFER_BYTES` is not read here but marked
    deferred (its checked source in ``irgen_*`` entries, which a model's own entries may
    not use), and so are the tensors :func:`read_model` left in the model file."""
    from onnx import TensorProto

    from .wire import SELF_KEY

    base = path.resolve().parent
    n_top = len(model.graph.initializer) if defer else 0  # all_tensors yields these first
    for k, t in enumerate(all_tensors(model)):
        if t.data_location != TensorProto.EXTERNAL:
            if t.external_data:
                raise IrgenError(f"{path}: tensor {q(t.name)} has external data entries but is not marked external")
            continue
        info = _entries(t, path)
        if SELF_KEY in info:  # left in the model file by read_model's scan, which checked it
            _set_entries(t, {"irgen_file": str(path), "offset": info["offset"], "length": info["length"]})
            continue
        if any(k.startswith("irgen_") for k in info):
            raise IrgenError(f"{path}: tensor {q(t.name)}: external data entry {q(next(k for k in info if k.startswith('irgen_')))} "
                             f"is reserved")
        location = info.get("location")
        where = f"{path}: tensor {q(t.name)}: external data {q(location if location is not None else '')}"
        if not location:
            raise IrgenError(f"{path}: tensor {q(t.name)} is marked external but names no location")
        if "\x00" in location or "\\" in location or any(ord(c) < 32 for c in location):
            raise IrgenError(f"{where}: not a plain relative path")
        if location.startswith(("/", "~")) or ".." in location.split("/"):
            raise IrgenError(f"{where}: points outside the model's folder")
        target = inside(base, location, f"{path}: tensor {q(t.name)}: external data", "the model's folder")
        offset = _integer(info, "offset", t, path, location) or 0
        length = _integer(info, "length", t, path, location)
        if t.data_type == TensorProto.STRING or np_dtype(t.data_type) is None:
            raise IrgenError(f"{where}: external data of {type_name(t.data_type)} tensors is not supported")
        check_size(f"{path}: tensor {q(t.name)}", t.dims, t.data_type, limit)
        need = data_bytes(t.dims, t.data_type)
        if length is not None and length != need:
            raise IrgenError(
                f"{where}: length {length} does not match the tensor's shape {tuple(t.dims)} "
                f"({type_name(t.data_type)}: {need} bytes)"
            )
        with open_regular(target, f"{path}: tensor {q(t.name)}: external data") as f:
            size = os.fstat(f.fileno()).st_size
            if offset + need > size:
                raise IrgenError(
                    f"{where}: offset {offset} + length {need} runs past the end of the file ({size} bytes)"
                )
            if k < n_top and need > DEFER_BYTES:
                _set_entries(t, {"irgen_base": str(base), "irgen_location": location,
                                 "offset": str(offset), "length": str(need)})
                continue
            f.seek(offset)
            raw = f.read(need)
        if len(raw) != need:  # the file shrank meanwhile
            raise IrgenError(f"{where}: the file ended after {len(raw)} of {need} bytes")
        del t.external_data[:]
        t.data_location = TensorProto.DEFAULT
        t.raw_data = raw


def tensor_array(t):
    """``onnx.numpy_helper.to_array(t)``; a deferred tensor's data is read now, from the
    source :func:`load_external_data` checked (the model file, or a file in its folder,
    resolved inside it again)."""
    import numpy as np
    from onnx import TensorProto, numpy_helper

    info = deferred(t)
    if info is None:
        return numpy_helper.to_array(t)
    offset, length = int(info["offset"]), int(info["length"])
    if "irgen_file" in info:
        source, what = Path(info["irgen_file"]), f"model {info['irgen_file']}: tensor {q(t.name)}"
    else:
        base = Path(info["irgen_base"])
        what = f"tensor {q(t.name)}: external data {q(info['irgen_location'])}"
        source = inside(base, info["irgen_location"], what, "the model's folder")
    dims = tuple(int(d) for d in t.dims)
    dtype = np_dtype(t.data_type)
    plain = t.data_type not in _PACKED_BITS and dtype is not None and dtype.kind in "biuf" \
        and dtype.itemsize * math.prod(dims) == length
    buf = np.empty(dims, dtype.newbyteorder("<")) if plain else bytearray(length)
    with open_regular(source, what) as f:
        if os.fstat(f.fileno()).st_size < offset + length:
            raise IrgenError(f"{what}: the file no longer holds its {length} bytes at offset {offset}")
        view = memoryview(buf.reshape(-1).view(np.uint8) if plain else buf)
        got = 0
        while got < length:
            n = os.preadv(f.fileno(), [view[got:]], offset + got)
            if n <= 0:
                raise IrgenError(f"{what}: the file ended after {got} of {length} bytes")
            got += n
    if plain:
        return buf if buf.dtype.isnative else buf.astype(dtype.newbyteorder("="))
    tmp = TensorProto()  # packed and special element types: onnx's own conversion
    tmp.dims.extend(dims)
    tmp.data_type = t.data_type
    tmp.raw_data = bytes(buf)
    return numpy_helper.to_array(tmp)


def load_model(path: Path, limit: int | None, defer: bool = False):
    """The model in ``path`` with its external data read in, every path checked first
    (``defer``: large top-level initializers are read later, by :func:`tensor_array`)."""
    model = read_model(path, defer)
    load_external_data(model, path, limit, defer)
    return model
