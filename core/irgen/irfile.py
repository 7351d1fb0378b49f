"""Reading an output folder's ``ir.json`` and ``manifest.json`` back, validated.

``irgen verify``, ``irgen inspect`` and the report read folders that anyone may
have edited. Both files are read here, once, as untrusted input: only a
regular file inside OUT, at most :data:`irgen.safeio.MAX_JSON_BYTES`, and every
field the tools use is checked for its type before any of them looks at it. A
bad field is one :class:`irgen.api.IrgenError` naming the file and the JSON
path of the field, e.g. ``OUT/ir.json: layers[3].outputs[0].shape: expected a
list of non-negative integers``.

The readers check types only. File paths inside the documents (a tensor
record's ``file``, a manifest entry's ``path``) are strings here; whoever opens
one confines it to OUT with :func:`irgen.safeio.inside` first.

Fields the output contract allows beyond the ones checked are kept as they
are: a valid document comes back unchanged (``read_ir`` returns what
``json.loads`` gave).
"""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path
from typing import Any, Iterator

from irgen.api import IrgenError
from irgen.safeio import inside, read_json

__all__ = ["IR_FILE", "MANIFEST_FILE", "output_folder", "read_ir", "read_manifest", "validate_ir",
           "validate_manifest", "tensor_records"]

IR_FILE = "ir.json"
MANIFEST_FILE = "manifest.json"

_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


def _key(path: str, key: Any) -> str:
    if isinstance(key, int):
        return f"{path}[{key}]"
    if _IDENT.match(key):
        return f"{path}.{key}" if path else key
    return f"{path}[{key!r:.60}]"


def _tname(value: Any) -> str:
    if value is None:
        return "null"
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "a list",
            dict: "an object"}.get(type(value), type(value).__name__)


class _Checker:
    """Type checks of one document; every failure names ``where`` and the JSON path."""

    def __init__(self, where: str):
        self.where = where

    def fail(self, path: str, message: str) -> None:
        raise IrgenError(f"{self.where}: {path}: {message}" if path else f"{self.where}: {message}")

    def obj(self, value: Any, path: str, optional: bool = False) -> dict:
        if value is None and optional:
            return {}
        if not isinstance(value, dict):
            self.fail(path, f"expected an object, got {_tname(value)}")
        return value

    def lst(self, value: Any, path: str, optional: bool = False) -> list:
        if value is None and optional:
            return []
        if not isinstance(value, list):
            self.fail(path, f"expected a list, got {_tname(value)}")
        return value

    def text(self, value: Any, path: str, optional: bool = False, nonempty: bool = False) -> str | None:
        if value is None and optional:
            return None
        if not isinstance(value, str) or (nonempty and not value):
            self.fail(path, f"expected a {'non-empty ' if nonempty else ''}string, got {_tname(value)}")
        return value

    def count(self, value: Any, path: str) -> int:
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            self.fail(path, f"expected a non-negative integer, got {_tname(value)}")
        return value

    def shape(self, value: Any, path: str) -> list:
        if not isinstance(value, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                                                  for d in value):
            self.fail(path, "expected a list of non-negative integers")
        return value

    def strings(self, value: Any, path: str, nullable: bool = False) -> list:
        """A list of strings (or null items with ``nullable``); an absent/null list is empty."""
        items = self.lst(value, path, optional=True)
        for i, s in enumerate(items):
            self.text(s, _key(path, i), optional=nullable)
        return items

    def tensor(self, rec: Any, path: str) -> dict:
        rec = self.obj(rec, path)
        self.text(rec.get("name"), _key(path, "name"))
        if "shape" not in rec:
            self.fail(_key(path, "shape"), "missing")
        self.shape(rec["shape"], _key(path, "shape"))
        for key in ("dtype", "layout", "file", "producer", "source"):
            self.text(rec.get(key), _key(path, key), optional=True)
        self.obj(rec.get("storage"), _key(path, "storage"), optional=True)  # a backend's own (IR 1.1)
        return rec

    def tensors(self, value: Any, path: str) -> list:
        items = self.lst(value, path, optional=True)
        for i, rec in enumerate(items):
            self.tensor(rec, _key(path, i))
        return items


def validate_ir(doc: Any, where: str = IR_FILE) -> dict[str, Any]:
    """``doc`` (parsed ``ir.json``) if every field verify/inspect/report use has its type;
    else an IrgenError naming ``where`` and the field's JSON path."""
    c = _Checker(where)
    if not isinstance(doc, dict):
        c.fail("", f"expected a JSON object at the top level, got {_tname(doc)}")
    producer = c.obj(doc.get("producer"), "producer", optional=True)
    c.text(producer.get("frontend"), "producer.frontend", optional=True)
    model = c.obj(doc.get("model"), "model", optional=True)
    for key in ("path", "sha256"):
        c.text(model.get(key), _key("model", key), optional=True)
    c.tensors(doc.get("inputs"), "inputs")
    c.tensors(doc.get("outputs"), "outputs")
    if "layers" not in doc:
        c.fail("layers", "missing (not an irgen IR)")
    names: dict[str, int] = {}
    for i, layer in enumerate(c.lst(doc["layers"], "layers")):
        at = _key("layers", i)
        layer = c.obj(layer, at)
        name = c.text(layer.get("name"), _key(at, "name"), nonempty=True)
        if name in names:
            c.fail(_key(at, "name"), f"{name!r:.100} is also the name of layers[{names[name]}]")
        names[name] = i
        c.text(layer.get("op"), _key(at, "op"))
        for k, op in enumerate(c.lst(layer.get("fused_ops"), _key(at, "fused_ops"), optional=True)):
            op = c.obj(op, _key(_key(at, "fused_ops"), k))
            c.obj(op.get("attrs"), _key(_key(_key(at, "fused_ops"), k), "attrs"), optional=True)
            c.lst(op.get("args"), _key(_key(_key(at, "fused_ops"), k), "args"), optional=True)
        c.obj(layer.get("attrs"), _key(at, "attrs"), optional=True)
        c.tensors(layer.get("inputs"), _key(at, "inputs"))
        if not c.tensors(layer.get("outputs"), _key(at, "outputs")):
            c.fail(_key(at, "outputs"), "expected at least one output tensor record")
        params = c.obj(layer.get("params"), _key(at, "params"), optional=True)
        for role, rec in params.items():
            c.tensor(rec, _key(_key(at, "params"), role))
        c.strings(layer.get("results"), _key(at, "results"))
        quant = c.obj(layer.get("quant"), _key(at, "quant"), optional=True)
        for key in ("scheme", "kind"):
            c.text(quant.get(key), _key(_key(at, "quant"), key), optional=True)
        source = c.obj(layer.get("source"), _key(at, "source"), optional=True)
        for key in ("nodes", "op_types", "tensors"):
            c.strings(source.get(key), _key(_key(at, "source"), key))
        c.strings(source.get("outputs"), _key(_key(at, "source"), "outputs"), nullable=True)
    return doc


def validate_manifest(doc: Any, where: str = MANIFEST_FILE) -> dict[str, Any]:
    """``doc`` (parsed ``manifest.json``) if its files and frontend options have their types."""
    c = _Checker(where)
    if not isinstance(doc, dict):
        c.fail("", f"expected a JSON object at the top level, got {_tname(doc)}")
    if "files" not in doc:
        c.fail("files", "missing")
    for i, entry in enumerate(c.lst(doc["files"], "files")):
        at = _key("files", i)
        entry = c.obj(entry, at)
        c.text(entry.get("path"), _key(at, "path"))
        c.count(entry.get("size"), _key(at, "size"))
        c.text(entry.get("sha256"), _key(at, "sha256"))
    for key in ("cwd", "command"):
        c.text(doc.get(key), key, optional=True)
    c.obj(doc.get("model"), "model", optional=True)
    opts = c.obj(doc.get("frontend_options"), "frontend_options", optional=True)
    shapes = c.obj(opts.get("input_shapes"), "frontend_options.input_shapes", optional=True)
    for name, dims in shapes.items():
        c.shape(dims, _key("frontend_options.input_shapes", name))
    for key, value in opts.items():  # a plugin's option: its kind is checked where it is used (verify)
        if key not in ("input_shapes", "allow_pickle") and not isinstance(value, (str, int, float, bool, dict)):
            c.fail(_key("frontend_options", key), f"expected a string, number, true/false or object, got {_tname(value)}")
    if opts.get("allow_pickle") is not None and not isinstance(opts["allow_pickle"], bool):
        c.fail("frontend_options.allow_pickle", f"expected true or false, got {_tname(opts['allow_pickle'])}")
    return doc


def output_folder(out: str | os.PathLike) -> Path:
    """``out`` if it is (a link to) a folder; one clear error otherwise (missing, a file,
    a symbolic link loop, ...)."""
    out = Path(out)
    try:
        st = os.stat(out)
    except FileNotFoundError:
        if os.path.islink(out):
            raise IrgenError(f"{out}: a symbolic link to nothing, not an irgen output folder (no ir.json)") from None
        raise IrgenError(f"{out}: no such folder, not an irgen output folder (no ir.json)") from None
    except OSError as err:  # ELOOP, ENAMETOOLONG, EACCES, ENOTDIR
        raise IrgenError(f"{out}: cannot read ({err.strerror or err}), not an irgen output folder") from None
    if not stat.S_ISDIR(st.st_mode):
        raise IrgenError(f"{out}: not a folder, not an irgen output folder (no ir.json)")
    return out


#: the most sample folders an ``irgen run --inputs`` output is searched for
MAX_SAMPLES = 100_000


def output_folders(out: str | os.PathLike) -> list[Path]:
    """The output folders under ``out``: ``[out]`` when it holds ``ir.json``; else, for an
    ``irgen run --inputs`` output, its sample folders (the folders in it that hold ``ir.json``,
    by name; links are not followed); one clear error when it is neither."""
    folder = output_folder(out)
    if os.path.lexists(folder / IR_FILE):
        return [folder]
    samples = []
    with os.scandir(folder) as entries:
        for n, entry in enumerate(entries):
            if n >= MAX_SAMPLES:
                raise IrgenError(f"{out}: more than {MAX_SAMPLES} entries; not an irgen output folder")
            if entry.is_dir(follow_symlinks=False) and os.path.lexists(Path(entry.path) / IR_FILE):
                samples.append(Path(entry.path))
    if not samples:
        raise IrgenError(f"{out}: not an irgen output folder (no ir.json, and no sample folders of "
                         "'irgen run --inputs' holding one)")
    return sorted(samples)


def _read(out: str | os.PathLike, name: str, what: str) -> tuple[Path, Any] | None:
    """(path, parsed JSON) of ``OUT/name``, None when there is no such entry at all."""
    folder = output_folder(out)
    path = folder / name
    if not os.path.lexists(path):
        return None
    real = inside(folder, name, str(path))  # a link out of OUT is refused before it is opened
    return path, read_json(real, what)


def read_ir(out: str | os.PathLike) -> dict[str, Any]:
    """``OUT/ir.json``, validated (:func:`validate_ir`)."""
    got = _read(out, IR_FILE, "IR")
    if got is None:
        raise IrgenError(f"{out}: not an irgen output folder (no ir.json)")
    path, doc = got
    return validate_ir(doc, str(path))


def read_manifest(out: str | os.PathLike) -> dict[str, Any] | None:
    """``OUT/manifest.json``, validated (:func:`validate_manifest`); None when OUT has none."""
    got = _read(out, MANIFEST_FILE, "manifest")
    if got is None:
        return None
    path, doc = got
    return validate_manifest(doc, str(path))


def tensor_records(ir: dict[str, Any]) -> Iterator[tuple[str, str | None, dict[str, Any]]]:
    """Every tensor record of a validated IR: (JSON path, owning layer name or None, record)."""
    for key in ("inputs", "outputs"):
        for i, rec in enumerate(ir.get(key) or []):
            yield _key(key, i), None, rec
    for i, layer in enumerate(ir["layers"]):
        at = _key("layers", i)
        for key in ("inputs", "outputs"):
            for k, rec in enumerate(layer.get(key) or []):
                yield _key(_key(at, key), k), layer["name"], rec
        for role, rec in (layer.get("params") or {}).items():
            yield _key(_key(at, "params"), role), layer["name"], rec
