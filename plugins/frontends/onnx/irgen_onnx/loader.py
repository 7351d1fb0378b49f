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
#: element types stored packed, several to a byte
_PACKED_BITS = {21: 4, 22: 4, 23: 4, 25: 2, 26: 2}  # UINT4, INT4, FLOAT4E2M1, UINT2, INT2


def q(name: Any, width: int = 80) -> str:
    """A name from the model, quoted on one line and cut to ``width`` characters."""
    text = repr(str(name))
    return text if len(text) <= width else text[: width - 4] + "...'"


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


def read_model(path: Path):
    """The ModelProto in ``path`` (a regular file), external data not loaded yet."""
    import onnx

    regular_file(path, "model")
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


def load_external_data(model, path: Path, limit: int | None) -> None:
    """Check every external-data entry, then read the data into its tensor (``raw_data``)."""
    from onnx import TensorProto

    base = path.resolve().parent
    for t in all_tensors(model):
        if t.data_location != TensorProto.EXTERNAL:
            if t.external_data:
                raise IrgenError(f"{path}: tensor {q(t.name)} has external data entries but is not marked external")
            continue
        info = _entries(t, path)
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
            f.seek(offset)
            raw = f.read(need)
        if len(raw) != need:  # the file shrank meanwhile
            raise IrgenError(f"{where}: the file ended after {len(raw)} of {need} bytes")
        del t.external_data[:]
        t.data_location = TensorProto.DEFAULT
        t.raw_data = raw


def load_model(path: Path, limit: int | None):
    """The model in ``path`` with its external data read in, every path checked first."""
    model = read_model(path)
    load_external_data(model, path, limit)
    return model
