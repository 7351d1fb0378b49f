"""Runners: each yields tensors by name, from wherever they come from.

* :class:`TensorFiles`: the tensor files ``ir.json`` names, read from a folder (OUT's
  golden data, or a device dump laid out like it), confined to that folder;
* :class:`LayerRunner`: one layer recomputed in numpy from given inputs (the scheme's
  ``recompute`` for integer layers, the ``fused_ops`` program otherwise), or the whole
  chain of layers from the model inputs (:meth:`LayerRunner.chain`);
* :class:`Golden`: OUT's golden data by tensor name;
* :class:`DumpRunner`: a device's per-layer dump by tensor record, as OUT lays it out or
  as a ``--map`` file says (:mod:`irgen.dumpmap`).

Comparators (:mod:`irgen.comparators`) know no runner; ``irgen verify`` and ``irgen
compare`` put the two together. This module imports only numpy.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np

from irgen import declared
from irgen.api import IrgenError
from irgen.dumpmap import DumpMap, DumpSpec, Physical
from irgen.irfile import tensor_records
from irgen.safeio import human_bytes, inside, load_npy, load_npz_member, open_regular, read_bytes

__all__ = ["TensorFiles", "LayerRunner", "Golden", "DumpRunner", "DumpValue", "Refused", "quant_consistency", "check_size",
           "plugin_read", "one_line"]


def check_size(path: Path, what: str, limit: int | None) -> int:
    """The size of the regular file ``path``, refused (IrgenError naming ``what``) over ``limit``
    bytes: a file is sized before it is read."""
    with open_regular(path, what) as f:
        size = os.fstat(f.fileno()).st_size
    if limit is not None and size > limit:
        raise IrgenError(f"{what} {path}: {human_bytes(size)}, over the limit of {human_bytes(limit)} "
                         "(--max-tensor-bytes)")
    return size


def plugin_read(read: Callable[[Path, dict], Any], path: Path, rec: dict, what: str, who: str,
                limit: int | None) -> np.ndarray:
    """A plugin's reading of the data file ``path`` (``read(path, record)``), sized first:
    its failure, or anything but a numpy array, is one IrgenError naming the file and ``who``."""
    check_size(path, what, limit)
    try:
        arr = read(path, dict(rec))
    except IrgenError:
        raise
    except Exception as err:  # noqa: BLE001  a plugin's reader: reported as this file's problem
        raise IrgenError(f"{what} {path}: {who} could not read it ({type(err).__name__}: {one_line(err)})") from None
    if not isinstance(arr, np.ndarray):
        raise IrgenError(f"{what} {path}: {who} read back a {type(arr).__name__}, not a numpy array")
    return arr


def one_line(message: Any) -> str:
    """``message`` as one line (its whitespace runs as single spaces)."""
    return " ".join(str(message).split())


def quant_consistency(layer: dict, host=None) -> str | None:
    """Why a conv/dense ``quant`` record's derived requantization disagrees with its
    own scales (None when it agrees, or the record has nothing to cross-check).

    ``recompute`` uses the derived values (multipliers, requant scales); the
    scales beside them must still be the ones they came from, so a scale edited
    in ``ir.json`` is caught even where the arithmetic does not read it. The layer's
    scheme checks its own (``Quantizer.consistency`` of the quantizer in ``host``, by default
    the installed plugins); without one, a ``requant.scale`` must be ``s_x * s_w / s_y``. A
    layer merged from several scheme layers (``quant.steps``) is checked step by step."""
    qr = layer.get("quant") or {}
    if isinstance(qr.get("steps"), list):
        notes = [f"step {i}: {why}" for i, step in enumerate(qr["steps"])
                 if isinstance(step, dict) and (why := quant_consistency({**layer, "quant": step}, host))]
        return "; ".join(notes) or None
    from irgen.quant import requant_scale_mismatch, requant_scales, scheme_consistency

    if requant_scales(qr) is None:  # not a conv/dense record with its scales
        return None
    own = scheme_consistency(str(qr.get("scheme")), host)
    if own is not None:  # the scheme checks its own derived values (Quantizer.consistency)
        return own(layer)
    return requant_scale_mismatch(layer)


class TensorFiles:
    """The tensor files ``ir.json`` names: each confined to OUT (:func:`irgen.safeio.inside`)
    and read with :func:`irgen.safeio.load_npy` (no pickle, a regular file, the size
    under ``limit``). A record whose ``file`` points outside OUT is *refused*: it is
    never opened, and its layer fails verification with the reason."""

    def __init__(self, out: Path, ir: dict, limit: int | None, backend: Callable[[], Any] = lambda: None,
                 folder: str = "the output folder"):
        self.out, self.limit, self.folder = out, limit, folder
        self._backend = backend  # -> the Backend that wrote the files (its read_tensor), if installed
        self._resolved = False
        self.backend_name = (ir.get("producer") or {}).get("backend")
        self.where: dict[int, str] = {}
        self.refused: dict[int, tuple[str | None, str]] = {}  # id(record) -> (owning layer, why)
        for path, owner, rec in tensor_records(ir):
            self.where[id(rec)] = path
            if rec.get("file") is not None:
                try:
                    inside(out, rec["file"], f"ir.json: {path}.file", folder)
                except IrgenError as err:
                    self.refused[id(rec)] = (owner, one_line(err))

    def why_refused(self, *records: dict) -> str | None:
        for rec in records:
            if id(rec) in self.refused:
                return self.refused[id(rec)][1]
        return None

    def layer_refused(self, layer: dict) -> str | None:
        """Why a layer cannot be checked (one of its files points outside OUT), or None."""
        return self.why_refused(*(layer.get("inputs") or []), *layer["outputs"],
                                *(layer.get("params") or {}).values())

    def load(self, rec: dict) -> np.ndarray:
        at = f"ir.json: {self.where.get(id(rec), '?')}"
        if rec.get("file") is None:
            raise IrgenError(f"{self.out / 'ir.json'}: {self.where.get(id(rec), '?')}: tensor {rec['name']!r:.100} "
                             f"has no file")
        path = inside(self.out, rec["file"], f"{at}.file", self.folder)
        what = f"tensor {rec['name']!r:.100} ({at})"
        if path.suffix == ".npy":
            arr = load_npy(path, what, self.limit)
        elif path.suffix == ".npz":  # irgen run --compress: the layer's tensors, each under its name
            arr = load_npz_member(path, rec["name"], what, self.limit)
        else:
            arr = self._backend_read(path, rec, what)
        arr = declared.typed(arr, rec.get("dtype"))  # bfloat16: 2-byte void in the file
        if arr.dtype.kind not in "biuf" and arr.dtype.name != "bfloat16":
            raise IrgenError(f"tensor {rec['name']!r:.100} ({at}) {path}: dtype {arr.dtype} is not a numeric tensor")
        return arr


    def _backend_read(self, path: Path, rec: dict, what: str) -> np.ndarray:
        """A data file in the format of the backend that wrote it, read by that backend."""
        if not self._resolved:  # only a folder with such files needs the plugins
            self.backend, self._resolved = self._backend(), True
        reader = getattr(self.backend, "read_tensor", None)
        if reader is None:
            why = (f"backend {self.backend_name!r} reads no files back (it has no read_tensor)" if self.backend
                   else f"backend {self.backend_name!r}, which wrote it, is not installed (or give it with --plugin)")
            raise IrgenError(f"{what} {path}: not a .npy file, and {why}")
        arr = plugin_read(reader, path, rec, what, f"backend {self.backend_name!r}", self.limit)
        if list(arr.shape) != list(rec.get("shape") or []) or str(arr.dtype) != str(rec.get("dtype")):
            raise IrgenError(f"{what} {path}: backend {self.backend_name!r} read back {arr.dtype}{list(arr.shape)}, "
                             f"the record says {rec.get('dtype')}{rec.get('shape')}")
        return arr


def same_bits(a: Any, b: Any) -> bool:
    """Whether two arrays have one dtype, one shape and the same bytes (so -0.0 is not 0.0, and
    NaNs are equal only with the same payload)."""
    a, b = np.asarray(a), np.asarray(b)
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.dtype.hasobject:
        return False
    return bool(np.array_equal(np.ascontiguousarray(a).reshape(-1).view(np.uint8),
                               np.ascontiguousarray(b).reshape(-1).view(np.uint8)))


class LayerRunner:
    """Runs one layer in numpy: ``recompute`` for quantized layers, ``fused_ops`` otherwise.
    ``host()`` gives the plugin host whose quantizers recompute their layers (None: the
    installed plugins)."""

    def __init__(self, files: TensorFiles, host: Callable[[], Any] = lambda: None):
        self.files = files
        self.host = host
        self._params: dict[str, dict[str, np.ndarray]] = {}
        #: integer layers checked with their fused_ops alone (their scheme recomputes nothing): why
        self.fused_only: dict[str, str] = {}
        #: layers whose checked run on their golden input files gave every golden output bit for bit
        #: (:meth:`remember`): an unchecked run on the same bits gives the golden files again
        self._exact_on_golden: set[str] = set()

    def params(self, layer: dict) -> dict[str, np.ndarray]:
        name = layer["name"]
        if name not in self._params:  # the last layer's only: holding every layer's would hold every weight
            self._params = {name: {role: self.files.load(rec) for role, rec in (layer.get("params") or {}).items()}}
        return self._params[name]

    def run(self, layer: dict, inputs: list[np.ndarray], params: dict[str, np.ndarray] | None = None,
            check: bool = True) -> tuple[list[np.ndarray], str | None]:
        """Outputs of ``layer``, and a note when ``fused_ops`` disagrees with ``recompute``
        (``params``: instead of the layer's parameter files; ``check`` False: an integer layer
        of one output is recomputed alone, its ``fused_ops`` not run beside, and there is no note).

        Raises :class:`irgen.reference.UnsupportedLayer` when neither can run it."""
        from irgen import quant, reference

        if not check and params is None:
            known = self._known(layer, inputs)
            if known is not None:
                return known, None
        params = self.params(layer) if params is None else params
        if layer.get("quant") is None:
            return [np.asarray(r) for r in reference.run_layer(layer, inputs, params)], None
        try:
            first = np.asarray(quant.recompute(layer, inputs, params, self.host()))
        except (NotImplementedError, KeyError, TypeError) as err:  # a scheme recompute does not know
            try:
                outs = [np.asarray(r) for r in reference.run_layer(layer, inputs, params)]
                self.fused_only.setdefault(layer["name"], one_line(err))
                return outs, None
            except reference.UnsupportedLayer as unsup:
                raise reference.UnsupportedLayer(layer["name"], f"quant {layer['quant'].get('kind')!r}",
                                                 f"recompute: {err}; fused_ops: {unsup}") from None
        outs = [first]
        if not check and len(layer["outputs"]) == 1:
            return outs, None
        note = quant_consistency(layer, self.host())
        try:
            via_ops = [np.asarray(r) for r in reference.run_layer(layer, inputs, params)]
        except reference.UnsupportedLayer:
            via_ops = None
        if via_ops is not None:
            outs += via_ops[1:]
            if via_ops[0].shape != first.shape or via_ops[0].dtype != first.dtype or not np.array_equal(via_ops[0], first):
                note = "; ".join(filter(None, [note, "fused_ops and the quant record compute different values"]))
        return outs, note

    def remember(self, layer: dict, outs: list[np.ndarray], goldens: dict[str, Any] | None = None) -> None:
        """Note that ``outs``, the layer's checked outputs on its golden input files, are its
        golden outputs bit for bit, every one: the layer is a pure function of its inputs and
        parameters, so a later unchecked run on inputs of the same bits returns the golden files
        instead of computing them again (verify's ``entire`` and ``source`` checks of an exact
        model recompute nothing twice). ``goldens``: the golden outputs by name, where the caller
        read them already (None for one: not remembered); by default read from their files."""
        recs = layer.get("outputs") or []
        golden = (lambda r: goldens.get(r["name"])) if goldens is not None else self.files.load
        if len(outs) == len(recs) and all(same_bits(o, golden(r)) for o, r in zip(outs, recs)):
            self._exact_on_golden.add(layer["name"])

    def _known(self, layer: dict, inputs: list[np.ndarray]) -> list[np.ndarray] | None:
        """The golden outputs when :meth:`remember` holds for the layer and ``inputs`` are its
        golden input files bit for bit; else None."""
        recs = layer.get("inputs") or []
        if layer["name"] not in self._exact_on_golden or len(recs) != len(inputs):
            return None
        if not all(same_bits(x, self.files.load(r)) for x, r in zip(inputs, recs)):
            return None
        return [self.files.load(r) for r in layer["outputs"]]

    def chain(self, ir: dict, feeds: dict[str, np.ndarray],
              alter: Callable[[dict, list[np.ndarray], list[np.ndarray]], list[np.ndarray]] | None = None
              ) -> Iterator[tuple[dict, list[np.ndarray]]]:
        """Every layer of ``ir`` in order, each run (:meth:`run`, unchecked) on the values its
        producers gave, from ``feeds`` (the model inputs by name): yields (layer, outputs).
        ``alter(layer, outputs, inputs)`` may replace a layer's outputs (a simulated device
        fault); later layers read what it returns. A value is dropped after its last reader."""
        values = dict(feeds)
        uses: dict[str, int] = {}
        for layer in ir["layers"]:
            for r in layer.get("inputs") or []:
                uses[r["name"]] = uses.get(r["name"], 0) + 1
        for layer in ir["layers"]:
            inputs = [values[r["name"]] for r in layer.get("inputs") or []]
            outs = self.run(layer, inputs, check=False)[0]
            if alter is not None:
                outs = alter(layer, outs, inputs)
            for r in layer.get("inputs") or []:
                uses[r["name"]] -= 1
                if uses[r["name"]] == 0:
                    values.pop(r["name"], None)
            values.update((rec["name"], v) for rec, v in zip(layer["outputs"], outs) if uses.get(rec["name"]))
            yield layer, outs


class Golden:
    """OUT's golden data by tensor name (model inputs and layer outputs), read through
    :class:`TensorFiles`; ``get`` is None for a tensor ``irgen run --layers`` did not write."""

    def __init__(self, files: TensorFiles, ir: dict):
        self.files = files
        self.records = {rec["name"]: rec for rec in ir.get("inputs") or []}
        for layer in ir["layers"]:
            self.records.update((rec["name"], rec) for rec in layer["outputs"])

    def get(self, name: str) -> np.ndarray | None:
        rec = self.records.get(name)
        return None if rec is None or rec.get("file") is None else self.files.load(rec)


class Refused(IrgenError):
    """A path that leads out of its folder: refused, never opened."""


@dataclass
class DumpValue:
    """One tensor of a device dump: its logical ``array`` (the record's shape), the values it
    holds in its storage's channel ``padding`` (None: none, or not known), the
    :class:`irgen.dumpmap.Physical` form it was stored in, and its ``file`` in the dump."""

    array: np.ndarray
    padding: np.ndarray | None
    physical: Physical
    file: str


class DumpRunner:
    """A device's per-layer dump: each tensor read from DUMP, laid out like OUT (the record's
    ``file``, read by the dump reader registered under OUT's backend, else as verify reads
    OUT) or where ``mapping`` (:class:`irgen.dumpmap.DumpMap`) says. ``get`` is None for a
    tensor the dump does not hold (a partial dump is normal). Every path is confined to
    DUMP before anything is opened, and every file sized before it is read."""

    def __init__(self, dump: Path, ir: dict, *, limit: int | None, backend: Callable[[], Any] = lambda: None,
                 readers: dict[str, Any] | None = None, mapping: DumpMap | None = None):
        self.dump, self.limit, self.mapping = Path(dump), limit, mapping
        self.readers = readers or {}
        self.backend_name = (ir.get("producer") or {}).get("backend")
        self.files = TensorFiles(self.dump, ir, limit, backend, folder="the dump folder")

    def get(self, rec: dict, layer: str = "", index: int = -1, output: int = 0) -> DumpValue | None:
        """The dump's value of the tensor ``rec`` (output ``output`` of layer ``layer``, the
        ``index``-th in IR order; a model input: ``layer`` empty)."""
        spec = self.mapping.spec(rec, layer or rec["name"], index, output) if self.mapping else None
        file = rec.get("file") if spec is None else spec.file
        if file is None:
            return None
        what = f"dump of tensor {rec['name']!r:.100}"
        try:
            path = inside(self.dump, file, what, "the dump folder")
        except IrgenError as err:
            raise Refused(str(err)) from None
        if not os.path.lexists(path):
            return None
        if spec is None:
            reader = self.readers.get(self.backend_name)
            physical = Physical.of(rec)
            if reader is None or path.suffix == ".npz":
                return DumpValue(self.files.load(rec), None, physical, file)
            phys = self._read(reader, path, rec, what, rec.get("storage") or {})
        else:
            physical = spec.physical
            phys = self._read_spec(spec, path, rec, what)
        array, padding = physical.split(phys)
        if list(array.shape) != list(rec["shape"]):
            raise IrgenError(f"{what} {path}: holds {list(phys.shape)}, which is not the tensor's {rec['shape']} "
                             f"in its storage")
        return DumpValue(_as_dtype(array, rec.get("dtype")), padding, physical, file)

    def _read_spec(self, spec: DumpSpec, path: Path, rec: dict, what: str) -> np.ndarray:
        if spec.format == "raw":
            dtype = np.dtype(spec.dtype).newbyteorder("<" if spec.byte_order == "little" else ">")
            data = read_bytes(path, what, None if self.limit is None else self.limit + spec.offset)
            count = int(np.prod(spec.shape, dtype=np.int64))
            if len(data) != spec.offset + count * dtype.itemsize:
                raise IrgenError(f"{what} {path}: {len(data)} bytes; {spec.offset} + {count} {dtype.name} values "
                                 f"of the shape {spec.shape} are {spec.offset + count * dtype.itemsize}")
            return np.frombuffer(data, dtype, count, spec.offset).reshape(spec.shape).astype(dtype.newbyteorder("="))
        if spec.format == "npy":
            phys = load_npy(path, what, self.limit)
        elif spec.format in self.readers:
            phys = self._read(self.readers[spec.format], path, {**rec, "storage": spec.storage()}, what, spec.storage())
        else:
            known = ", ".join(["raw", "npy", *sorted(self.readers)])
            raise IrgenError(f"{self.mapping.source}: tensor {rec['name']!r:.80}: format {spec.format!r:.40} is not "
                             f"one of {known}")
        if list(phys.shape) != list(spec.shape):
            raise IrgenError(f"{what} {path}: shape {list(phys.shape)}, the map says {spec.shape}")
        return phys

    def _read(self, reader: Any, path: Path, rec: dict, what: str, storage: dict) -> np.ndarray:
        """The physical array a dump reader reads, checked against the storage's shape and dtype."""
        phys = plugin_read(reader.read, path, rec, what, f"dump reader {reader.name!r}", self.limit)
        want = storage.get("shape")
        if want is not None and list(phys.shape) != [int(d) for d in want]:
            raise IrgenError(f"{what} {path}: dump reader {reader.name!r} read {list(phys.shape)}, the storage "
                             f"says {list(want)}")
        return phys


def _as_dtype(array: np.ndarray, dtype: Any) -> np.ndarray:
    """``array`` in the record's dtype where every value survives the cast; else as it is."""
    try:
        want = np.dtype(str(dtype))
    except TypeError:
        return array
    if array.dtype == want:
        return array
    cast = array.astype(want)
    return cast if np.array_equal(cast.astype(array.dtype), array, equal_nan=array.dtype.kind == "f") else array
