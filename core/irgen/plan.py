"""The compiled plan of a model: what ``irgen run`` knows once import, layer forming
and compile are done, and all it needs to capture golden data for any input.

``compile.build_plan`` makes one; ``capture.write_output`` runs it on one input
and writes an output folder. A plan holds no Relax graph: only the executable, the
kernel sequence the VM will call, the layer records (JSON) and their parameter
arrays. ``save``/``load`` put it in a folder (the compile cache, ``irgen.cache``)
as JSON, ``.npy`` files read without pickle, and the exported library.

A loaded plan reads no array up front: its parameters and the kernels' constants are
:class:`Stored` files, each read when a kernel or a parameter file needs it and
dropped after (``array``), so a run from the cache never holds all the weights.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from irgen import parallel_build, spill
from irgen.api import InputSpec, IrgenError

#: the layout of a saved plan; a cache entry of another format is compiled anew
#: (3: kernels have ``arg_types``, and a library built without TVM's argument checks)
PLAN_FORMAT = 4


class Stored:
    """An array kept in a ``.npy`` file of a saved plan (written by ``Plan.save``, C order,
    no objects), read on demand into 64-byte aligned memory (as TVM's kernels want it)."""

    __slots__ = ("path",)

    def __init__(self, path: Path):
        self.path = path

    def load(self) -> np.ndarray:
        from irgen.vm import aligned, aligned_empty

        try:
            with open(self.path, "rb") as f:
                version = np.lib.format.read_magic(f)
                read_header = {(1, 0): np.lib.format.read_array_header_1_0,
                               (2, 0): np.lib.format.read_array_header_2_0}.get(version)
                if read_header is None:
                    raise ValueError(f"npy format version {version}")
                shape, fortran, dtype = read_header(f)
                if fortran or dtype.hasobject:
                    raise ValueError("not a C-ordered array of plain values")
                if dtype.kind == "V" and dtype.itemsize == 2 and dtype.fields is None:
                    dtype = np.dtype("bfloat16")  # np.save writes ml_dtypes' bfloat16 as '<V2'
                arr = aligned_empty(shape, dtype)
                if arr.nbytes:
                    view = memoryview(arr.reshape(-1).view(np.uint8))
                    if f.readinto(view) != arr.nbytes:
                        raise ValueError("the file is truncated")
                return aligned(arr)
        except (OSError, ValueError) as err:
            raise IrgenError(f"{self.path}: a compile cache array could not be read ({err}); the entry was "
                             "removed or damaged while in use: run again (or with --no-cache)") from None


def array(value: Any) -> np.ndarray:
    """A plan's parameter or constant as an array (read now if it is :class:`Stored`)."""
    return value.load() if hasattr(value, "load") else value


def kernel_node_name(callee: str, n_outputs: int, ki: int, j: int | None) -> str:
    """The debug graph's name of kernel ``ki`` (``j`` None) or of its output ``j``."""
    base = f"{callee.replace('vm.builtin.', '')}_{ki}"
    return base if j is None or n_outputs == 1 else f"{base}:{j}"


@dataclass
class PlanKernel:
    """One call the VM makes that produces tensors (``execute.Kernel`` without its arguments)."""

    callee: str
    outputs: list[str]
    out_types: list[tuple[tuple[int, ...], str]] = field(default_factory=list)
    storage: list[int] = field(default_factory=list)
    #: (shape, dtype) of each argument of the kernel, outputs last; None: not checked up front
    #: (``irgen.vm.run_program`` checks each call against it: the kernels may not)
    arg_types: list[tuple[tuple[int, ...], str]] | None = None
    #: the compiled function that runs (``callee``, or the one it shares: :mod:`irgen.share`)
    symbol: str = ""

    def __post_init__(self) -> None:
        self.symbol = self.symbol or self.callee


@dataclass
class Plan:
    """A model compiled for capture."""

    frontend: str
    scheme: str | None
    opt_level: int
    inputs: list[InputSpec]
    output_names: list[str]  # the source model's output names, in order
    model_script: str  # graph/model.relax.txt
    records: list[dict[str, Any]]  # layer records; inputs/outputs are IR tensor names, no files yet
    params: list[dict[str, Any]]  # each layer's parameter arrays by role (arrays or Stored: read with ``array``)
    static_shapes: dict[str, tuple[tuple[int, ...], str]]  # IR tensor name -> (shape, dtype) from the Relax types
    kernels: list[PlanKernel]
    wanted: dict[tuple[int, int], list[str]]  # kernel output (kernel, index) -> the IR tensors it is
    outputs: list[str]  # the model outputs' IR tensor names
    producers: dict[str, str]  # IR tensor name -> the layer computing it
    debug_graph: dict[str, Any]  # _tvmdbg_graph_dump.json
    debug_names: list[str]  # output_tensors.params entries, in order: inputs, constants, kernel outputs
    consts: list[Any]  # the kernels' constants p0, p1, ... (arrays, Stored, or objects with load()); see ``array``
    exe: Any  # the VM executable or the library loaded from the cache
    program: dict[str, Any] | None = None  # irgen.execute.program (None: the Relax VM runs main, weights embedded)
    from_cache: bool = False
    #: what the run was keyed on: ``key`` (:attr:`irgen.runkey.PlanKey.digest`) and ``depends``
    #: (:func:`irgen.runkey.dependencies`); ``manifest.json`` records it
    keyed: dict[str, Any] = field(default_factory=dict)

    def kernel_tensor_name(self, ki: int, j: int) -> str:
        """The ``output_tensors.params`` name of kernel ``ki``'s output ``j``."""
        k = self.kernels[ki]
        return kernel_node_name(k.callee, len(k.outputs), ki, j)

    # -- a folder on disk ----------------------------------------------------------------

    def save(self, folder: Path) -> None:
        """Write the plan into the empty ``folder``: ``plan.json``, ``arrays/*.npy``, ``model.so``.
        One array is held at a time. An array that is the very memory of one written before
        (a kernel's weight constant is its layer's weight parameter) is written once: both
        name that file."""
        arrays = folder / "arrays"
        arrays.mkdir(parents=True)
        # a view of a constant's memory (which the plan keeps alive) by (address, shape,
        # strides, dtype) -> (its file, the view); an array that owns its memory (a copy,
        # freed after writing: its address may come again) is never matched
        written: dict[tuple, tuple[str, np.ndarray]] = {}

        def put(value: Any, name: str) -> str:
            arr = np.asarray(array(value), order="C")  # 0-d stays 0-d
            where = (arr.__array_interface__["data"][0], arr.shape, arr.strides, arr.dtype.str) \
                if arr.base is not None and arr.nbytes else None
            if where in written:
                return written[where][0]
            np.save(arrays / name, arr, allow_pickle=False)
            spill.release(arr)
            if where is not None:
                written[where] = (name, arr)
            return name

        params = [{role: put(value, f"p{i}_{k}.npy") for k, (role, value) in enumerate(roles.items())}
                  for i, roles in enumerate(self.params)]
        consts = [put(value, f"c{i}.npy") for i, value in enumerate(self.consts)]
        self._files = (params, consts)
        with _quiet_stderr():  # TVM logs a warning line per kernel ("Scope Saving") while exporting
            parallel_build.export_library(self.exe, folder / "model.so")
        doc = {
            "format": PLAN_FORMAT,
            "frontend": self.frontend,
            "scheme": self.scheme,
            "opt_level": self.opt_level,
            "inputs": [{"name": s.name, "shape": list(s.shape), "dtype": s.dtype,
                        "quantization": list(s.quantization) if s.quantization else None} for s in self.inputs],
            "output_names": list(self.output_names),
            "records": self.records,
            "params": params,
            "static_shapes": {n: [list(s), d] for n, (s, d) in self.static_shapes.items()},
            "kernels": [{"callee": k.callee, "symbol": k.symbol, "outputs": k.outputs, "out_types": [[list(s), d] for s, d in k.out_types],
                         "storage": list(k.storage),
                         "arg_types": None if k.arg_types is None else [[list(s), d] for s, d in k.arg_types]}
                        for k in self.kernels],
            "wanted": [[ki, j, names] for (ki, j), names in self.wanted.items()],
            "outputs": self.outputs,
            "producers": self.producers,
            "debug_graph": self.debug_graph,
            "debug_names": self.debug_names,
            "consts": consts,
            "program": self.program,
        }
        (folder / "model.relax.txt").write_text(self.model_script)
        (folder / "plan.json").write_text(json.dumps(doc, default=_json_default) + "\n")

    def use_stored(self, folder: Path) -> None:
        """Read the parameters and constants from the files ``save`` wrote into ``folder``
        from now on, so that the arrays of the compile can be freed."""
        params, consts = self._files
        self.params = [{role: Stored(folder / "arrays" / n) for role, n in names.items()} for names in params]
        self.consts = [Stored(folder / "arrays" / n) for n in consts]

    @classmethod
    def load(cls, folder: Path) -> "Plan":
        """The plan ``save`` wrote into ``folder``; IrgenError if it is not one. No array is
        read: parameters and constants are :class:`Stored`."""
        from irgen import vm

        try:
            doc = json.loads((folder / "plan.json").read_text())
            if doc.get("format") != PLAN_FORMAT:
                raise IrgenError(f"{folder}: plan format {doc.get('format')!r}, expected {PLAN_FORMAT}")
            arrays = folder / "arrays"

            def stored(name: str) -> Stored:
                if not isinstance(name, str) or "/" in name or "\\" in name or name.startswith(".") \
                        or not (arrays / name).is_file():
                    raise IrgenError(f"{folder}: bad array name {name!r}")
                return Stored(arrays / name)

            params = [{role: stored(n) for role, n in entry.items()} for entry in doc["params"]]
            consts = [stored(n) for n in doc["consts"]]
            exe = vm.load_library(folder / "model.so")
            return cls(
                frontend=doc["frontend"],
                scheme=doc["scheme"],
                opt_level=doc["opt_level"],
                inputs=[InputSpec(s["name"], tuple(s["shape"]), s["dtype"],
                                  tuple(s["quantization"]) if s["quantization"] else None) for s in doc["inputs"]],
                output_names=doc["output_names"],
                model_script=(folder / "model.relax.txt").read_text(),
                records=doc["records"],
                params=params,
                static_shapes={n: (tuple(s), d) for n, (s, d) in doc["static_shapes"].items()},
                kernels=[PlanKernel(k["callee"], k["outputs"], [(tuple(s), d) for s, d in k["out_types"]], k["storage"],
                                    None if k["arg_types"] is None else [(tuple(s), d) for s, d in k["arg_types"]],
                                    str(k["symbol"]))
                         for k in doc["kernels"]],
                wanted={(ki, j): names for ki, j, names in doc["wanted"]},
                outputs=doc["outputs"],
                producers=doc["producers"],
                debug_graph=doc["debug_graph"],
                debug_names=doc["debug_names"],
                consts=consts,
                exe=exe,
                program=doc["program"],
                from_cache=True,
            )
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise IrgenError(f"{folder}: not a readable plan ({type(err).__name__}: {err})") from None


@contextlib.contextmanager
def _quiet_stderr():
    """File descriptor 2 to /dev/null (TVM's C++ log writes there directly)."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "wb") as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def _json_default(v: Any) -> Any:
    if isinstance(v, np.generic):
        return v.item()
    if isinstance(v, (tuple, set)):
        return list(v)
    raise TypeError(f"not JSON: {type(v).__name__}")
