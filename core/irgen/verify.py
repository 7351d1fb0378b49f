"""``irgen verify``: check an output folder against itself and against the source runtime.

Three checks, each optional (``modes``):

* ``single``: every layer is run by the numpy reference on its golden input
  files and must reproduce its golden output files;
* ``entire``: the layers are chained from the model input file(s), each fed the
  reference's own results of its producers, and every output is compared to its
  golden file;
* ``source``: the original model runs in its own runtime (a frontend's
  :meth:`irgen.api.Frontend.source_runner`) and every layer output whose
  ``source`` names a tensor there is compared to it.

Integer layers (``quant`` record, or an integer output dtype) are recomputed with
:func:`irgen.quant.recompute` from the quant record and the parameter files and
must match exactly in ``single`` and ``entire``; their ``fused_ops`` program is
also run with :func:`irgen.reference.run_layer` in ``single`` and must agree.
Float layers run ``fused_ops`` and must satisfy, elementwise,
``|got - golden| <= atol * s + rtol * |golden|`` where ``s`` is
``max(1, max|golden|)``: a float sum's rounding error scales with the magnitude of
its terms (a value near zero after cancelling large ones is off by eps times
them, even recomputed from the same inputs), and grows along a deep chain, so the
absolute part scales with the tensor's magnitude. Source comparison of integer tensors allows ``max_lsb`` units.
In a quantized model the ``source`` verdict is per layer (``local``): the layer
recomputed from the runtime's own input tensors against the runtime's output;
the chained golden values against the runtime are reported beside it as
end-to-end drift (``end_to_end``; the result's ``source`` names the first layer
where it appears) and do not fail verification by themselves.

Besides, every file listed in ``manifest.json`` must still have its sha256; a
changed file is reported with the layer that owns it.

The output folder is untrusted input. ``ir.json`` and ``manifest.json`` are read
by :mod:`irgen.irfile` (validated; a bad field is an IrgenError naming its JSON
path). Every file path taken out of them is confined to OUT with
:func:`irgen.safeio.inside`: one that leads out (``../``, absolute, a symbolic
link) is a problem that fails verification and is never opened or stat'ed.
Tensor files are read with :func:`irgen.safeio.load_npy` (no pickle, regular
files only, under ``max_tensor_bytes``). Nothing from the folder decides to run
code in the ``source`` check: ``allow_pickle`` comes only from the caller
(``irgen verify --allow-pickle``), a ``model_class`` recorded in the manifest is
imported only with that same consent, and the model at the recorded path runs
only when its sha256 is the one ``ir.json`` records (:func:`resolve_source`).

This module imports only numpy; the source runtimes are imported by the
frontends when ``source`` runs.
"""

from __future__ import annotations

import hashlib
import heapq
import math
import os
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable

import numpy as np

from irgen import declared
from irgen.api import IrgenError
from irgen.comparators import compare, json_num as _json_num, status_metric as _status_metric, Thresholds
from irgen.irfile import read_ir, read_manifest
from irgen.runners import LayerRunner as _Layers, TensorFiles as _Files, quant_consistency  # noqa: F401
from irgen.safeio import DEFAULT_MAX_TENSOR_BYTES, inside, open_regular
from irgen.schema import check_ir
from irgen.source import (isolated_source_runner, load_host as _load_host, model_sha256,  # noqa: F401
                          resolve_source, source_runner_for)  # (resolve_source, source_runner_for: re-exported)

__all__ = ["Thresholds", "verify_output", "compare", "format_table", "MODES"]

MODES = ("single", "entire", "source")
HIST_LAYERS = 6
HIST_BINS = 32


# ------------------------------------------------------------------ metrics


#: the message of a tensor ``irgen run --layers`` did not write
NOT_WRITTEN = "not written (irgen run --layers wrote a subset of the layers)"


def _quantizes_its_input(layer: dict[str, Any]) -> bool:
    """The layer quantizes a float input: a quantize layer, or a float layer with 8-bit integer
    weights (a dynamic-range kernel, which quantizes its input at run time). A float rounding
    of that input can become a step of its quantization."""
    if (layer.get("quant") or {}).get("kind") == "quantize":
        return True
    return layer.get("quant") is None and any(
        str(p.get("dtype")) in ("int8", "uint8") for p in (layer.get("params") or {}).values())


def _unwritten(*records: dict) -> bool:
    return any(r.get("file") is None for r in records)


def _is_int(dtype: np.dtype) -> bool:
    return np.dtype(dtype).kind in "iub"


def _worse(a: dict | None, b: dict) -> dict:
    """The worse of two metrics of one layer and check (fail > unsupported > missing > pass)."""
    if a is None:
        return b
    rank = {"fail": 0, "unsupported": 1, "pass": 2, "missing": 3}
    ka = (rank[a["status"]], a["exact_share"], -a["max_abs"])
    kb = (rank[b["status"]], b["exact_share"], -b["max_abs"])
    return b if kb < ka else a


# ------------------------------------------------------------------ running layers


def _to_float_source(value: np.ndarray, golden: np.ndarray, layer: dict, k: int) -> tuple[np.ndarray, bool]:
    """Bring a source runtime's value into the golden file's domain.

    An integer golden against a float source value (a fake-quantized graph
    holds dequantized floats) is compared after quantizing the source value
    with the layer's output scale and zero point; a dequantize layer's float
    output is compared in units of its input scale. Returns (value, integer)."""
    qr = layer.get("quant") or {}
    if qr.get("kind") == "dequantize" and not _is_int(golden.dtype) and qr.get("inputs"):
        # a dequantized integer: compared in units of its scale (LSB)
        s = float(np.asarray(qr["inputs"][0]["scale"]).reshape(-1)[0])
        return np.rint(value.astype(np.float64) / s).astype(np.int64), True
    if _is_int(golden.dtype) and not _is_int(value.dtype):
        out = (layer.get("quant") or {}).get("output") or {}
        if k == 0 and "scale" in out and np.size(out["scale"]) == 1:
            info = np.iinfo(golden.dtype)
            s = float(np.asarray(out["scale"]).reshape(-1)[0])
            z = int(np.asarray(out["zero_point"]).reshape(-1)[0])
            q = np.rint(value.astype(np.float64) / s) + z
            return np.clip(q, info.min, info.max).astype(golden.dtype), True
        return value, False
    return value, _is_int(golden.dtype) and _is_int(value.dtype)


def _one_line(message: Any) -> str:
    return " ".join(str(message).split())


# ------------------------------------------------------------------ manifest


def _file_owners(ir: dict) -> dict[str, str | None]:
    """Output-folder file -> the layer that owns it (None: a model input or ir.json)."""
    owners: dict[str, str | None] = {}
    for t in ir.get("inputs") or []:
        if t.get("file"):
            owners[t["file"]] = None
    for layer in ir["layers"]:
        for rec in layer.get("outputs") or []:
            if rec.get("file"):
                owners[rec["file"]] = layer["name"]
        for rec in (layer.get("params") or {}).values():
            if rec.get("file"):
                owners[rec["file"]] = layer["name"]
    return owners


def _sha256_open(f) -> str:
    h = hashlib.sha256()
    for chunk in iter(lambda: f.read(1 << 20), b""):
        h.update(chunk)
    return h.hexdigest()


def check_manifest(out: Path, ir: dict, manifest: Any = ...) -> list[dict[str, Any]]:
    """A problem for every manifest file that is missing, changed, not a regular file or
    not inside OUT (a ``../`` path, an absolute one or a link out of OUT: such an entry is
    reported, never opened). ``manifest``: the validated ``manifest.json`` (None when OUT
    has none; default: read it)."""
    if manifest is ...:
        manifest = read_manifest(out)
    if manifest is None:
        return [{"layer": None, "check": "manifest", "message": "manifest.json is missing"}]
    owners = _file_owners(ir)
    problems = []
    for i, f in enumerate(manifest["files"]):
        rel = f["path"]
        layer = owners.get(rel)
        who = f" (layer {layer})" if layer else (" (model input)" if rel in owners else "")
        try:
            p = inside(out, rel, f"manifest.json: files[{i}].path")
        except IrgenError as err:
            problems.append({"layer": None, "check": "manifest", "message": _one_line(err)})
            continue
        if not os.path.lexists(p):
            problems.append({"layer": layer, "check": "manifest", "message": f"{rel}{who} is missing"})
            continue
        try:
            with open_regular(p, f"manifest.json: files[{i}]") as fh:
                changed = os.fstat(fh.fileno()).st_size != f["size"] or _sha256_open(fh) != f["sha256"]
        except IrgenError as err:
            problems.append({"layer": layer, "check": "manifest", "message": f"{_one_line(err)}{who}"})
            continue
        if changed:
            problems.append({"layer": layer, "check": "manifest",
                             "message": f"{rel}{who} changed after generation (sha256 differs from manifest.json)"})
    return problems


# ------------------------------------------------------------------ source runtime


# ------------------------------------------------------------------ verify


def load_ir(out_dir: str | Path) -> dict[str, Any]:
    """``OUT/ir.json``, validated: its fields' types (:func:`irgen.irfile.read_ir`), then the
    whole document against the IR's JSON Schema (:func:`irgen.schema.check_ir`); an
    IrgenError saying why it cannot be read, or listing the violations."""
    return check_ir(read_ir(out_dir), str(Path(out_dir) / "ir.json"))


def _skip_source(source: dict[str, Any], notes: list[str], modes, err: IrgenError) -> list[str]:
    """Record why the (optional) source check is skipped; the modes left to run."""
    source["skipped"] = _one_line(err).removeprefix("source check: ")
    notes.append(f"source check skipped: {source['skipped']}")
    return [m for m in modes if m != "source"]


def _backend_of(ir: dict, host, plugins=(), strict: bool = False):
    """The backend that wrote OUT's data files (``producer.backend``) in ``host`` (None: the
    installed plugins and ``plugins``), or None."""
    name = (ir.get("producer") or {}).get("backend")
    if not isinstance(name, str):
        return None
    if host is None:
        host = _load_host(plugins, strict)
    return host.backends.get(name) if name in host.backends.names() else None


def verify_output(out_dir: str | Path, *, modes=MODES, thresholds: Thresholds | None = None,
                  source_runner: Callable | None = None, model: str | Path | None = None,
                  progress=None, source_optional: bool = False, allow_pickle: bool = False,
                  frontend_options: dict[str, Any] | None = None, given_options: dict[str, Any] | None = None,
                  max_tensor_bytes: int | None = DEFAULT_MAX_TENSOR_BYTES, host=None,
                  plugins: list[str] | tuple = (), strict: bool = False) -> dict[str, Any]:
    """Verify the output folder ``out_dir``; returns the result dict (see docs/verify.md).

    ``source_runner(inputs, tensors)`` runs the source model (default: built from
    the frontend recorded in ``ir.json``, the model at ``model`` or the recorded
    path, run in a child process); ``progress`` is an :class:`irgen.output.Progress`
    or None. With ``source_optional`` a source model or runtime that is missing,
    refused or crashes skips the ``source`` check with a note (``result["notes"]``)
    instead of raising.

    The folder is untrusted input. ``ir.json`` and ``manifest.json`` are validated
    (:mod:`irgen.irfile`; a malformed one raises IrgenError naming the field); every
    file either names is confined to OUT (a path out of it is a problem, never
    opened); tensor files are read with :func:`irgen.safeio.load_npy` under
    ``max_tensor_bytes``. The source check trusts nothing from the folder that runs
    code: ``allow_pickle`` comes only from the caller (``irgen verify --allow-pickle``),
    and so does the consent to import a ``model_class`` recorded in ``manifest.json``;
    ``frontend_options`` given by the caller (``irgen run --verify``: the run's own
    options) are used instead of the recorded ones, and ``given_options`` (plugin options
    given to ``irgen verify``) over them. The model at the recorded path
    runs only when its sha256 is the one ``ir.json`` records; see :func:`resolve_source`.

    The stages, in order, are the methods of :class:`_VerifyRun`.
    """
    run = _VerifyRun(out_dir, modes, thresholds or Thresholds(), progress, model, source_optional)
    run.load_source(source_runner, host, plugins, strict, allow_pickle=allow_pickle, options=frontend_options,
                    given=given_options, max_tensor_bytes=max_tensor_bytes)
    run.check_folder(host, plugins, strict, max_tensor_bytes)
    run.start_source()
    run.single()
    run.entire()
    run.source()
    return run.summarize()


class _VerifyRun:
    """One :func:`verify_output` run: its state, and its stages as methods, called in order:
    :meth:`load_source`, :meth:`check_folder`, :meth:`single`, :meth:`entire`,
    :meth:`source`, :meth:`summarize`.

    What the stages find goes into ``problems`` and ``notes`` (appended, in stage order),
    ``source_info`` (what the source check did: the result's ``source``) and ``checks``
    (layer -> mode -> metric). A metric enters ``checks`` only through :meth:`record`,
    the one merge step (it keeps the worse of the metrics one layer gets in one mode);
    no stage edits a recorded metric, and :meth:`summarize` builds the result from copies."""

    def __init__(self, out_dir: str | Path, modes, th: Thresholds, progress, model: str | Path | None,
                 source_optional: bool):
        """Check the modes asked for and read OUT's ``ir.json`` (validated, :func:`load_ir`)
        and ``manifest.json``; no check has run yet."""
        self.t0 = time.perf_counter()
        self.notes: list[str] = []
        self.th = th
        bad = set(modes) - set(MODES)
        if bad:
            raise IrgenError(f"unknown verify mode(s): {', '.join(sorted(bad))}")
        #: the checks to run, in MODES order; a source check that cannot run is dropped from it
        self.modes = [m for m in MODES if m in modes]
        self.ir = load_ir(out_dir)
        self.out = Path(out_dir).resolve()
        self.manifest = read_manifest(self.out)
        self.layers = self.ir["layers"]
        self.say = progress.stage if progress is not None else (lambda text: None)
        self.step = progress.step if progress is not None else (lambda text, i, n: None)
        self.source_optional = source_optional
        self.model_path = Path(model) if model is not None else None
        self.model_sha_ok: bool | None = None
        self.source_runner: Callable | None = None
        self.source_unseen: list[str] = []  # source tensors the layers name that the runtime did not give
        #: (feeds, wanted tensors, wait) of a source run begun in the background (:meth:`start_source`)
        self._source_started: tuple | None = None
        # what the source check did: run (with which runtime and kernels), or skipped and why
        self.source_info: dict[str, Any] | None = {"ran": False, "skipped": None, "runtime": None, "seconds": None,
                                                   "end_to_end": None} if "source" in self.modes else None
        self.model_info = dict(self.ir.get("model") or {})
        self.problems: list[dict[str, Any]] = []
        self.checks: dict[str, dict[str, dict | None]] = {l["name"]: {m: None for m in MODES} for l in self.layers}
        self.worst: list = []  # heap of (badness, n, layer, check, golden, reference) for histograms
        self.counter = 0

    # ---------------------------------------------------------- stages

    def load_source(self, source_runner: Callable | None, host, plugins, strict: bool, **kwargs) -> None:
        """Stage 1: the source runtime, when the source check is asked for and no
        ``source_runner`` is given: resolved and checked (:func:`resolve_source`), to
        run in a child process (:func:`isolated_source_runner`). A model that is
        missing or refused raises, or with ``source_optional`` skips the source check
        with a note. ``kwargs``: see :func:`resolve_source`."""
        self.source_runner = source_runner
        if "source" not in self.modes or source_runner is not None:
            return
        self.say("load the source model")
        try:
            self.source_runner, src = isolated_source_runner(self.out, self.ir, self.model_path, host, plugins, strict,
                                                             manifest=self.manifest, **kwargs)
        except IrgenError as err:
            if not self.source_optional:
                raise
            self.modes = _skip_source(self.source_info, self.notes, self.modes, err)
        else:
            self.model_path, self.model_sha_ok = src.path, src.sha256_matches
            self.notes += src.notes

    def check_folder(self, host, plugins, strict: bool, max_tensor_bytes: int | None) -> None:
        """Stage 2: the folder itself. Tensor files ``ir.json`` names outside OUT are
        problems (never opened, :class:`_Files`), and so is a file whose sha256 is not
        the one ``manifest.json`` records (:func:`check_manifest`). Sets up the file
        reader and the layer runner the checks use."""
        ir = self.ir
        hosts: dict[str, Any] = {}

        def plugin_host():  # loaded once, when a check first needs a plugin
            if "host" not in hosts:
                hosts["host"] = host if host is not None else _load_host(plugins, strict)
            return hosts["host"]

        self.files = _Files(self.out, ir, max_tensor_bytes, lambda: _backend_of(ir, plugin_host()))
        self.problems += [{"layer": owner, "check": "files", "message": why}
                          for owner, why in self.files.refused.values()]
        self.say("check manifest.json checksums")
        self.problems += check_manifest(self.out, ir, self.manifest)
        self.graph_inputs = ir.get("inputs") or []
        #: why the model inputs cannot be read (entire and source need them), or None
        self.inputs_refused = self.files.why_refused(*self.graph_inputs)
        self.runner = _Layers(self.files, plugin_host)
        self.plugin_host = plugin_host

    def single(self) -> None:
        """Stage 3, ``single``: every layer run on its golden input files against its golden outputs."""
        if "single" not in self.modes:
            return
        layers = self.layers
        self.say(f"single: {len(layers)} layers on their golden inputs")
        for i, layer in enumerate(layers, 1):
            if _unwritten(*(layer.get("inputs") or []), *layer["outputs"]):
                self.record(layer, "single", _status_metric("missing", layer["outputs"][0]["name"], NOT_WRITTEN))
            elif not self.refused(layer, "single"):
                got = self.attempt(layer, "single", lambda: [self.files.load(r) for r in layer.get("inputs") or []])
                if got is not None:
                    passed = self.compare_outputs(layer, "single", *got, scaled=True)
                    if got[1] is None:  # no disagreement of the reference with itself
                        self.runner.remember(layer, got[0], passed)
            self.step("layers", i, len(layers))

    def entire(self) -> None:
        """Stage 4, ``entire``: the layers chained from the model input file(s), each fed
        its producers' reference outputs (a golden file, said in the message, where a
        producer could not run); every output against its golden file. A float tensor a
        quantize layer (or a dynamic-range kernel, :func:`_quantizes_its_input`) reads carries
        on from its golden file once it passed (within the float tolerance: a quantize would
        turn float rounding into LSB)."""
        if "entire" not in self.modes:
            return
        if self.inputs_refused:
            self.notes.append(f"entire check skipped: {self.inputs_refused}")
            return
        layers, files = self.layers, self.files
        self.say(f"entire: {len(layers)} layers chained from the model input")
        values: dict[str, np.ndarray] = {t["name"]: files.load(t) for t in self.graph_inputs}
        graph_outputs = {t["name"] for t in self.ir.get("outputs") or []}
        uses: dict[str, int] = {}
        for layer in layers:
            for r in layer.get("inputs") or []:
                uses[r["name"]] = uses.get(r["name"], 0) + 1
        quantized_floats = {r["name"] for layer in layers if _quantizes_its_input(layer)
                            for r in layer.get("inputs") or [] if not _is_int_name(r.get("dtype"))}
        for i, layer in enumerate(layers, 1):
            if self.refused(layer, "entire"):
                self.step("layers", i, len(layers))
                continue
            inputs, from_golden = [], []
            lacking = [r["name"] for r in layer.get("inputs") or [] if r["name"] not in values and _unwritten(r)]
            if lacking:  # its producer could not run and there is no golden file to carry on from
                self.record(layer, "entire", _status_metric(
                    "missing", layer["outputs"][0]["name"], f"input {lacking[0]!r} {NOT_WRITTEN}"))
                self.step("layers", i, len(layers))
                continue
            for r in layer.get("inputs") or []:
                if r["name"] in values:
                    inputs.append(values[r["name"]])
                else:  # its producer could not run: carry on from the golden file, and say so
                    inputs.append(files.load(r))
                    from_golden.append(r["name"])
                uses[r["name"]] -= 1
                if uses[r["name"]] == 0 and r["name"] not in graph_outputs:
                    values.pop(r["name"], None)
            got = self.attempt(layer, "entire", lambda: inputs, check=False)  # its note is single's
            if got is not None:
                outs = got[0]
                extra = f"inputs {', '.join(from_golden)} from golden files (producer did not run)" \
                    if from_golden else None
                passed = self.compare_outputs(layer, "entire", outs, None, scaled=True, extra=extra)
                for rec, v in zip(layer["outputs"], outs):
                    if uses.get(rec["name"], 0) > 0:
                        g = passed.get(rec["name"])
                        # a float tensor a quantize reads goes on from its golden values once it passed:
                        # float layers agree within the float tolerance, and the quantize would turn
                        # their rounding into LSB (a model quantized in part: LayerNorm -> quantize)
                        values[rec["name"]] = g if g is not None and rec["name"] in quantized_floats else v
            self.step("layers", i, len(layers))

    def source(self) -> None:
        """Stage 5, ``source``: the model run in its own runtime (``source_runner``) on the
        model input file(s), and every layer output that names a tensor there compared
        to it (:meth:`compare_to_source`). A runtime that fails raises, or with
        ``source_optional`` skips the check with a note."""
        if "source" not in self.modes:
            return
        if self.inputs_refused:
            self.source_info["skipped"] = self.inputs_refused
            self.notes.append(f"source check skipped: {self.inputs_refused}")
            return
        feeds, wanted, pending = self._source_started or self._source_request()
        if pending is None:
            self.say("source: run the model in its own runtime")
        try:
            values = pending() if pending is not None else self.source_runner(feeds, wanted)
        except IrgenError as err:
            if not self.source_optional:
                raise
            self.modes = _skip_source(self.source_info, self.notes, self.modes, err)
            return
        if values is None:
            return
        self.source_info["ran"] = True
        self.source_info["runtime"] = getattr(self.source_runner, "runtime", None)
        self.source_info["seconds"] = getattr(self.source_runner, "seconds", None)
        quantized = self.compare_to_source(values, feeds)
        if self.source_unseen:  # the ir names them, the runtime did not give them: say so, not just "missing"
            unseen = self.source_unseen
            self.notes.append(f"source check: {len(unseen)} of {len(wanted)} tensors the layers name are not in the "
                              f"source runtime's results ({', '.join(unseen[:3])}{' ...' if len(unseen) > 3 else ''}); "
                              "those layers are checked by single and entire only")
        # a float model's source verdict is end to end already: drift is a quantized model's notion
        self.source_info["end_to_end"] = _drift(self.layers, self.checks, self.th) if quantized else None

    def summarize(self) -> dict[str, Any]:
        """Stage 6: the result dict, built from the stages' records: a row per layer
        (:meth:`layer_row`), a problem per failed (or, without ``allow_unsupported``,
        unsupported) check after the folder's problems, histograms of the worst layers,
        and the verdict."""
        th = self.th
        rows, problems = [], list(self.problems)
        for layer in self.layers:
            row, failed = self.layer_row(layer)
            rows.append(row)
            problems += failed
        n_pass, n_fail, n_unsup = (sum(r["status"] == s for r in rows) for s in ("pass", "fail", "unsupported"))
        passed = n_fail == 0 and (n_unsup == 0 or th.allow_unsupported) and not any(
            p["check"] in _FOLDER_CHECKS or p["layer"] is None for p in problems)
        notes = list(self.notes)
        fused_only = self.runner.fused_only
        if fused_only:
            names = list(fused_only)
            notes.append(f"{len(names)} integer layer(s) checked with their fused_ops alone, their scheme recomputing "
                         f"nothing for them ({fused_only[names[0]]}): {', '.join(names[:5])}"
                         f"{' ...' if len(names) > 5 else ''}")
        return {
            "irgen_verify": 1,
            "out": str(self.out),
            "model": self.model_info,
            "producer": self.ir.get("producer"),
            "modes": self.modes,
            "thresholds": {k: v for k, v in asdict(th).items() if k != "allow_unsupported"},
            "allow_unsupported": th.allow_unsupported,
            "passed": bool(passed),
            "summary": {"layers": len(self.layers), "passed": n_pass, "failed": n_fail, "unsupported": n_unsup,
                        "seconds": round(time.perf_counter() - self.t0, 3)},
            "problems": problems,
            "notes": notes,
            "source": self.source_info,
            "layers": rows,
            "histograms": _histograms(self.worst),
        }

    def layer_row(self, layer: dict) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """The result's row of one layer (its checks JSON-safe: infinite and NaN numbers are
        None, :func:`_json_metric`), and a problem per check that fails it."""
        c = {mode: None if m is None else _json_metric(m) for mode, m in self.checks[layer["name"]].items()}
        statuses = [m["status"] for m in c.values() if m is not None]
        status = "fail" if "fail" in statuses else ("unsupported" if "unsupported" in statuses else "pass")
        failed = [{"layer": layer["name"], "check": mode, "message": f"{m['tensor']}: {m['message']}"}
                  for mode, m in c.items() if m is not None and (
                      m["status"] == "fail" or (m["status"] == "unsupported" and not self.th.allow_unsupported))]
        dtype = (layer.get("outputs") or [{}])[0].get("dtype") or ""
        row = {
            "name": layer["name"],
            "op": layer["op"],
            "dtype": dtype,
            "integer": _is_int_name(dtype),
            "scheme": (layer.get("quant") or {}).get("scheme"),
            "inputs": [r.get("producer") or "input" for r in layer.get("inputs") or []],
            "checks": c,
            "status": status,
        }
        return row, failed

    # ---------------------------------------------------------- the merge step

    def record(self, layer: dict, mode: str, m: dict, golden: np.ndarray | None = None,
               ref: np.ndarray | None = None) -> None:
        """Merge metric ``m`` into ``checks`` (the layer's ``mode`` keeps the worse of the
        metrics it gets, :func:`_worse`), and offer the compared values to the histograms."""
        name = layer["name"]
        self.checks[name][mode] = _worse(self.checks[name][mode], m)
        if golden is not None and ref is not None and golden.size and m["status"] in ("pass", "fail"):
            bad = (m["status"] == "fail", 1.0 - m["exact_share"], m["max_rel"] if math.isfinite(m["max_rel"]) else 1e300)
            self.counter += 1
            item = (bad, self.counter, name, mode, golden, ref)
            if len(self.worst) < HIST_LAYERS * 3:
                heapq.heappush(self.worst, item)
            elif item[:2] > self.worst[0][:2]:
                heapq.heapreplace(self.worst, item)

    # ---------------------------------------------------------- helpers of the checks

    def refused(self, layer: dict, mode: str) -> bool:
        """Record a failure when one of the layer's files points outside OUT (it is not read)."""
        why = self.files.layer_refused(layer)
        if why is not None:
            self.record(layer, mode, _status_metric("fail", layer["outputs"][0]["name"], f"not checked: {why}"))
        return why is not None

    def attempt(self, layer: dict, mode: str, inputs: Callable[[], list[np.ndarray]], check: bool = True):
        """(outputs, note) of the layer, or None with the reason recorded (``check``: see
        :meth:`irgen.runners.LayerRunner.run`)."""
        from irgen.reference import UnsupportedLayer

        first = layer["outputs"][0]["name"]
        try:
            return self.runner.run(layer, inputs(), check=check)
        except UnsupportedLayer as err:
            self.record(layer, mode, _status_metric("unsupported", first, str(err)))
        except IrgenError:
            raise
        except Exception as err:  # noqa: BLE001  anything an edited ir.json makes the reference do
            self.record(layer, mode, _status_metric("fail", first, f"cannot run: {type(err).__name__}: {err}"))
        return None

    def compare_outputs(self, layer: dict, mode: str, outs: list[np.ndarray], note: str | None, scaled: bool,
                        extra: str | None = None) -> None:
        """Record each of the layer's outputs ``outs`` against its golden file. ``note`` (the
        reference's disagreement with itself) fails the first output; ``extra`` is said in
        every output's message. Returns each output's golden values where it passed (else None)."""
        passed: dict[str, np.ndarray | None] = {}
        for k, rec in enumerate(layer["outputs"]):
            if _unwritten(rec):
                self.record(layer, mode, _status_metric("missing", rec["name"], NOT_WRITTEN))
                continue
            golden = self.files.load(rec)
            compared = None  # the values compared, for the histograms
            if k >= len(outs):
                m = _status_metric("unsupported", rec["name"], f"the reference computes no output {k}")
            else:
                try:
                    m = compare(outs[k], golden, integer=_is_int(golden.dtype), th=self.th, scaled=scaled,
                                tensor=rec["name"], ulp_limit=_declared_limit(layer, golden))
                except Exception as err:  # noqa: BLE001  values computed from an edited record
                    m = _status_metric("fail", rec["name"], f"cannot compare: {type(err).__name__}: {err}")
                else:
                    compared = outs[k]
                    if k == 0 and note:
                        m.update(status="fail", message=f"{m['message']}; {note}" if m["message"] else note)
            if extra:
                m["message"] = f"{m['message']}; {extra}" if m["message"] else extra
            self.record(layer, mode, m, golden, compared)
            passed[rec["name"]] = golden if m.get("status") == "pass" else None
        return passed

    def _source_request(self) -> tuple[dict[str, np.ndarray], list[str], None]:
        """(the model inputs, the source tensors the layers name, None): what the source
        check asks the runtime for; the model file checked first (:meth:`check_model_file`)."""
        self.check_model_file()
        feeds = {t["name"]: self.files.load(t) for t in self.graph_inputs}
        wanted = sorted({s for l in self.layers for s in (l.get("source") or {}).get("outputs") or [] if s is not None})
        return feeds, wanted, None

    def start_source(self) -> None:
        """Begin the source check's run now when its runner can run in the background (the
        child process of :func:`irgen.source.isolated_source_runner`: its ``start``), so the
        runtime works on the model while ``single`` and ``entire`` run; :meth:`source` waits
        for it."""
        start = getattr(self.source_runner, "start", None)
        if "source" not in self.modes or self.inputs_refused or start is None:
            return
        feeds, wanted, _ = self._source_request()
        self.say("source: run the model in its own runtime (in the background)")
        self._source_started = (feeds, wanted, start(feeds, wanted))

    def check_model_file(self) -> None:
        """The model the source check runs: its path goes into the result's ``model``, and
        a model that is not the file OUT was generated from (sha256) is a problem."""
        model_path = self.model_path
        if model_path is None:
            return
        self.model_info["path"] = str(model_path)
        if self.model_sha_ok is None and self.model_info.get("sha256") and os.path.exists(model_path):
            self.model_sha_ok = model_sha256(model_path) == self.model_info["sha256"]
        if self.model_sha_ok is False:
            self.problems.append({"layer": None, "check": "source", "message": f"model {model_path} is not the file "
                                  "OUT was generated from (sha256 differs)"})

    def compare_to_source(self, values: dict[str, Any], feeds: dict[str, np.ndarray]) -> bool:
        """Record every layer output against the source runtime's tensor it names
        (:meth:`source_metric`); whether the model is quantized."""
        layers = self.layers
        src_of = {t["name"]: t["name"] for t in self.graph_inputs}
        lookup = {**values, **feeds}  # the model inputs too: a first layer recomputes from them
        # a model whose layers quantize at run time (dynamic range) is quantized too: a float
        # rounding upstream can become a step of a later layer's quantization
        quantized = any(l.get("quant") is not None or _is_int_name((l.get("outputs") or [{}])[0].get("dtype"))
                        or _quantizes_its_input(l) for l in layers)
        for layer in layers:
            src_of.update(zip((r["name"] for r in layer["outputs"]), (layer.get("source") or {}).get("outputs") or []))
        for i, layer in enumerate(layers, 1):
            if self.refused(layer, "source"):
                self.step("layers", i, len(layers))
                continue
            srcs = (layer.get("source") or {}).get("outputs") or []
            for k, rec in enumerate(layer["outputs"]):
                src = srcs[k] if k < len(srcs) else None
                if _unwritten(rec):
                    self.record(layer, "source", _status_metric("missing", rec["name"], NOT_WRITTEN))
                    continue
                if src is None or src not in values:
                    self.record(layer, "source", _status_metric(
                        "missing", rec["name"],
                        f"source tensor {src!r} is not available in the source runtime" if src else "no source tensor"))
                    if src is not None:
                        self.source_unseen.append(src)
                    continue
                self.source_metric(layer, k, rec, src, values, lookup, src_of, quantized)
            self.step("layers", i, len(layers))
        return quantized

    def source_metric(self, layer: dict, k: int, rec: dict, src: str, values: dict, lookup: dict, src_of: dict,
                      quantized: bool) -> None:
        """Record output ``k`` of the layer (golden file ``rec``) against the runtime's tensor
        ``src``. In a quantized model the verdict is local (:meth:`local`) with the chained
        values' difference beside it as end-to-end drift; else it is end to end."""
        th = self.th
        golden = self.files.load(rec)
        try:
            value, integer = _to_float_source(np.asarray(values[src]), golden, layer, k)
            if integer and not _is_int(golden.dtype):
                golden, _ = _to_float_source(golden, golden, layer, k)
            if not integer and _is_int(value.dtype) != _is_int(golden.dtype):
                value = value.astype(np.float64)
            m = compare(value, golden, integer=integer, th=th, scaled=True, lsb_limit=th.max_lsb, tensor=rec["name"])
        except Exception as err:  # noqa: BLE001  an edited quant record
            self.record(layer, "source", _status_metric("fail", rec["name"],
                                                        f"cannot compare: {type(err).__name__}: {err}"))
            return
        m["source_tensor"] = src
        if _in_storage(layer, golden) is not None:  # the declared arithmetic against the runtime's: local, --max-ulp
            m = compare(_in_storage(layer, value), _in_storage(layer, golden), integer=False, th=th, tensor=rec["name"],
                        ulp_limit=declared.source_ulp_limit(layer, th.max_ulp))
            m["source_tensor"] = src
            lm = self.local(layer, lookup, src_of, np.asarray(value), k, False)
            m = _local_verdict(m, lm, src, False) if lm is not None else {**m, "verdict": "end_to_end"}
        elif quantized:  # the verdict is local; the chained values' difference is drift, reported beside
            lm = self.local(layer, lookup, src_of, np.asarray(value), k, integer)
            if lm is not None:
                m = _local_verdict(m, lm, src, integer)
            else:
                m["verdict"] = "end_to_end"
        self.record(layer, "source", m, golden, value)

    def local_lsb_limit(self, layer: dict, integer: bool) -> int:
        """The LSB a layer may differ from the runtime by when recomputed from its inputs: none
        when the runtime ran the integer kernels the layer's scheme reproduces (the runner says
        ``exact``, the scheme's quantizer is ``runtime_exact``) and the layer is one of those
        kernels (not a float span, whose float sums the runtime adds in its own order); else
        ``max_lsb``, or the runner's own ``max_lsb`` when it declares a larger one (kernels of
        another arithmetic than the scheme's, e.g. OpenVINO's)."""
        from irgen.quant import scheme_quantizer

        quant = layer.get("quant") or {}
        exact = integer and getattr(self.source_runner, "exact", False) and quant.get("realization") != "float" \
            and bool(getattr(scheme_quantizer(str(quant.get("scheme") or ""), self.plugin_host()), "runtime_exact", False))
        own = getattr(self.source_runner, "max_lsb", None)
        return 0 if exact else max(self.th.max_lsb, own if isinstance(own, int) else 0)

    def local(self, layer: dict, values: dict, src_of: dict, value: np.ndarray, k: int, integer: bool) -> dict | None:
        """Output ``k`` of the layer recomputed from the source runtime's own input tensors
        against the runtime's output ``value``: the kernel arithmetic alone, without
        differences carried from earlier layers. A metric (integer: LSB, at most
        ``max_lsb``; float: the scaled tolerance), or None when an input is not
        available there with the layer's dtype or the layer cannot run."""
        th = self.th
        ins = []
        for r in layer.get("inputs") or []:
            v = values.get(src_of.get(r["name"], ""))
            if v is None or str(np.asarray(v).dtype) != r.get("dtype"):
                return None
            ins.append(np.asarray(v))
        try:
            got = self.runner.run(layer, ins, check=False)[0][k]
            if integer and _is_int(value.dtype) and not _is_int(got.dtype):  # a dequantize: in LSB, as ``value`` is
                got = _to_float_source(got, got, layer, k)[0]
            if _in_storage(layer, value) is not None:  # in the storage type's ulp
                return compare(_in_storage(layer, got), _in_storage(layer, value), integer=False, th=th,
                               tensor=layer["outputs"][k]["name"],
                               ulp_limit=declared.source_ulp_limit(layer, th.max_ulp))
            if not integer:
                got = np.asarray(got).astype(np.float64)
            return compare(got, value.astype(np.float64) if not integer else value, integer=integer, th=th,
                           scaled=True, lsb_limit=self.local_lsb_limit(layer, integer),
                           tensor=layer["outputs"][k]["name"])
        except IrgenError:
            raise
        except Exception:  # noqa: BLE001  UnsupportedLayer, or an edited record
            return None


def _declared_limit(layer: dict, golden: np.ndarray) -> int | None:
    """The ulp a float16/bfloat16 layer's tensor may differ from its declared arithmetic (``arith``,
    :mod:`irgen.declared`) by in single and entire: none, or one where the reference computes an op
    otherwise than TVM's float32 kernel (:func:`irgen.declared.inexact_ops`); None for any other
    tensor (the float tolerances)."""
    arith = layer.get("arith")
    if not isinstance(arith, dict) or np.asarray(golden).dtype.name != arith.get("storage"):
        return None
    return 1 if declared.inexact_ops(layer) else 0


def _in_storage(layer: dict, a: np.ndarray) -> np.ndarray | None:
    """A float tensor of a float16/bfloat16 layer (also a float32 one, a cast's) in the layer's
    storage type, as the source check compares it; None for any other layer or tensor."""
    arith = layer.get("arith")
    a = np.asarray(a)
    if not isinstance(arith, dict) or not (a.dtype.kind == "f" or a.dtype.name == "bfloat16"):
        return None
    return a.astype(declared.storage_dtype(str(arith.get("storage"))))


def _local_verdict(m: dict, lm: dict, src: str, integer: bool) -> dict:
    """A quantized layer's source metric: the local one ``lm`` as the verdict, with the
    chained values' comparison ``m`` beside it as ``end_to_end`` (``drift`` where it differs)."""
    e2e = {key: m[key] for key in ("status", "exact", "exact_share", "max_lsb", "max_abs", "cosine", "sqnr_db")}
    if not integer:
        e2e["status"] = "pass" if e2e["status"] == "pass" else "drift"
    elif not m["exact"]:
        e2e["status"] = "drift"
    message = f"recomputed from the runtime's own inputs: {lm['message']}" if lm["status"] == "fail" else lm["message"]
    if "max_ulp" in m:
        e2e.update(max_ulp=m["max_ulp"], max_ulp_of_peak=m["max_ulp_of_peak"])
    local = {"exact_share": lm["exact_share"], "max_lsb": lm["max_lsb"]}
    if "max_ulp" in lm:
        local.update(max_ulp=lm["max_ulp"], max_ulp_of_peak=lm["max_ulp_of_peak"])
    return {**lm, "message": message, "source_tensor": src, "verdict": "local", "end_to_end": e2e, "local": local}


def _histograms(worst: list) -> dict[str, Any]:
    """Histograms of the worst compared values (the heap :meth:`_VerifyRun.record` keeps),
    at most one per layer and ``HIST_LAYERS`` in all."""
    histograms = {}
    for bad, _, name, mode, golden, ref in sorted(worst, reverse=True):
        if name in histograms or len(histograms) >= HIST_LAYERS:
            continue
        histograms[name] = _histogram(golden, ref, mode)
    return histograms


def _json_metric(m: dict) -> dict:
    """A copy of metric ``m`` for the result: its (and its ``end_to_end``'s) infinite or NaN
    numbers as None."""
    keys = ("max_abs", "max_rel", "sqnr_db", "cosine")
    out = {**m, **{key: _json_num(m[key]) for key in keys}}
    if m.get("end_to_end"):
        out["end_to_end"] = {**m["end_to_end"], **{key: _json_num(m["end_to_end"][key]) for key in keys
                                                   if key in m["end_to_end"]}}
    return out


def _drift(layers: list[dict], checks: dict, th: Thresholds) -> dict[str, Any]:
    """End-to-end drift against the source runtime: where the chained (golden) values first
    differ from the runtime's, how far, and the first layer beyond ``max_lsb``. It does not
    fail verification: the source verdict is per layer (``local``)."""
    first = beyond = None
    worst, n = 0, 0
    for index, layer in enumerate(layers):
        m = checks[layer["name"]]["source"]
        if m is None or m["status"] not in ("pass", "fail"):
            continue
        e = m.get("end_to_end") or m
        lsb = e.get("max_lsb")
        if m.get("max_lsb") is not None or lsb is not None:  # compared in LSB
            differs = not e.get("exact")
        else:
            differs = e.get("status") in ("drift", "fail")
        if not differs:
            continue
        n += 1
        first = first or {"layer": layer["name"], "index": index, "tensor": m["tensor"], "max_lsb": lsb,
                          "exact_share": e.get("exact_share")}
        if lsb is not None:
            worst = max(worst, lsb)
            if lsb > th.max_lsb and beyond is None:
                beyond = {"layer": layer["name"], "tensor": m["tensor"], "max_lsb": lsb}
    return {"exact": n == 0, "layers": n, "max_lsb": worst, "first": first, "first_beyond_max_lsb": beyond}


def _drift_line(source: dict | None) -> str | None:
    """One line on the end-to-end drift of a source check that ran (None when there is none)."""
    d = (source or {}).get("end_to_end") or {}
    first = d.get("first")
    if not first:
        return None
    where = f"first at layer {first['layer']}" + (f" ({first['max_lsb']} LSB)" if first.get("max_lsb") is not None else "")
    beyond = d.get("first_beyond_max_lsb")
    more = f"; first beyond --max-lsb at {beyond['layer']} ({beyond['max_lsb']} LSB)" if beyond else ""
    return (f"end-to-end drift vs the source runtime (not a failure; the verdict is per layer, from the runtime's "
            f"own inputs): {d['layers']} layer(s) differ, up to {d['max_lsb']} LSB, {where}{more}")


def verdict_line(result: dict) -> str:
    """``FAIL``, ``PASS``, or ``PASS (source check skipped: REASON)`` when a source check
    that was asked for did not run: a pass without it is a weaker statement."""
    if not result.get("passed"):
        return "FAIL"
    skipped = (result.get("source") or {}).get("skipped")
    return f"PASS (source check skipped: {skipped})" if skipped else "PASS"


#: problems with the folder itself rather than a layer's numbers: any of them fails verification
_FOLDER_CHECKS = ("manifest", "files")


def _is_int_name(dtype: Any) -> bool:
    """Whether a dtype name from ir.json is an integer type (False for an unknown name)."""
    try:
        return bool(dtype) and _is_int(np.dtype(str(dtype)))
    except (TypeError, ValueError):
        return False


def _histogram(golden: np.ndarray, ref: np.ndarray, mode: str) -> dict[str, Any]:
    g = golden.astype(np.float64).ravel()
    r = np.asarray(ref).astype(np.float64).ravel()
    both = np.concatenate([g[np.isfinite(g)], r[np.isfinite(r)]])
    lo, hi = (float(both.min()), float(both.max())) if both.size else (0.0, 1.0)
    if hi <= lo:
        hi = lo + 1.0
    if _is_int(golden.dtype) and hi - lo + 1 <= HIST_BINS * 8:
        edges = np.linspace(lo - 0.5, hi + 0.5, min(HIST_BINS, int(hi - lo) + 1) + 1)
    else:
        edges = np.linspace(lo, hi, HIST_BINS + 1)
    return {"check": mode, "edges": [float(e) for e in edges],
            "golden": [int(c) for c in np.histogram(g, edges)[0]],
            "reference": [int(c) for c in np.histogram(r, edges)[0]]}


# ------------------------------------------------------------------ terminal table


def _fmt(v: Any, kind: str) -> str:
    if v is None:
        return "-"
    if kind == "pct":
        return f"{100 * v:.2f}"
    if kind == "cos":
        return f"{v:.6f}"
    if kind == "db":
        return f"{v:.1f}"
    return f"{v:.3g}"


def _badness(row: dict) -> tuple:
    ms = [m for m in row["checks"].values() if m is not None and m["status"] != "missing"]
    rank = {"fail": 0, "unsupported": 1, "pass": 2}[row["status"]]
    share = min((m["exact_share"] for m in ms), default=1.0)
    err = max(((m["max_lsb"] if m["max_lsb"] is not None else (m["max_rel"] or 0.0)) for m in ms), default=0.0)
    return (rank, share, -err)


def printable(value: Any) -> str:
    """``str(value)`` with control characters escaped (``\\n``, ``\\x1b``): names in ir.json may
    hold anything, and the terminal must not act on them."""
    text = str(value)
    return text if text.isprintable() else "".join(c if c.isprintable() else ascii(c)[1:-1] for c in text)


def format_table(result: dict, limit: int | None = None) -> str:
    """The terminal table: one line per layer and check, worst layers first, then a summary."""
    head = ("LAYER", "OP", "DTYPE", "CHECK", "EXACT%", "MAX ERR", "COSINE", "SQNR dB", "E2E", "STATUS")
    lines = [head]
    rows = sorted(result["layers"], key=_badness)
    shown = rows if limit is None else rows[:limit]
    notes = []
    for row in shown:
        for mode in result["modes"]:
            m = row["checks"].get(mode)
            if m is None:
                continue
            if m["status"] in ("unsupported", "missing"):
                err = "-"
            elif m["max_lsb"] is not None:
                err = f"{m['max_lsb']} LSB"
            elif m.get("max_ulp_of_peak") is not None:  # a float16/bfloat16 layer: in ulp of its peak
                err = f"{m['max_ulp_of_peak']:.3g} ulp"
            else:
                err = _fmt(m["max_abs"], "abs")
            sqnr = "exact" if m.get("exact") else _fmt(m["sqnr_db"], "db")
            share = "-" if m["status"] in ("unsupported", "missing") else _fmt(m["exact_share"], "pct")
            cos = "-" if m["status"] in ("unsupported", "missing") else _fmt(m["cosine"], "cos")
            e2e = m.get("end_to_end")  # source, verdict local: the chained values against the runtime
            if not e2e:
                drift = "-"
            elif e2e.get("exact"):
                drift = "exact"
            else:
                drift = f"{e2e['max_lsb']} LSB" if e2e.get("max_lsb") is not None else (
                    f"{e2e['max_ulp_of_peak']:.3g} ulp" if e2e.get("max_ulp_of_peak") is not None
                    else _fmt(e2e.get("max_abs"), "abs"))
            lines.append(tuple(map(printable, (row["name"], row["op"], row["dtype"], mode, share, err, cos, sqnr,
                                               drift, m["status"].upper()))))
            if m["status"] in ("fail", "unsupported") and m["message"]:
                notes.append(printable(f"  {row['name']} [{mode}]: {m['message']}"))
    widths = [min(40, max(len(r[i]) for r in lines)) for i in range(len(head))]
    text = ["  ".join(c[:w].ljust(w) for c, w in zip(r, widths)).rstrip() for r in lines]
    if limit is not None and len(rows) > limit:
        text.append(f"... {len(rows) - limit} more layers")
    text += notes
    for p in result["problems"]:
        if p["check"] in _FOLDER_CHECKS or p["layer"] is None:
            text.append(printable(f"  {p['check']}: {p['message']}"))
    src = result.get("source") or {}
    if src.get("ran"):
        text.append(printable(f"source: {src.get('runtime') or 'the source runtime'}"))
        if _drift_line(src):
            text.append(printable(_drift_line(src)))
    s = result["summary"]
    verdict = printable(verdict_line(result))
    text.append(f"{verdict}: {s['layers']} layers, {s['passed']} passed, {s['failed']} failed, "
                f"{s['unsupported']} unsupported; checks {', '.join(result['modes']) or 'none'}; "
                f"{len(result['problems'])} problems; {s['seconds']:.2f} s")
    return "\n".join(text)
