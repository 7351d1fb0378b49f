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
``|got - golden| <= atol * s + rtol * |golden|`` where ``s`` is 1 in ``single``
and ``max(1, max|golden|)`` in ``entire`` and ``source`` (float error grows
along a deep chain, so there the absolute part scales with the tensor's
magnitude). Source comparison of integer tensors allows ``max_lsb`` units.

Besides, every file listed in ``manifest.json`` must still have its sha256; a
changed file is reported with the layer that owns it.

This module imports only numpy; the source runtimes are imported by the
frontends when ``source`` runs.
"""

from __future__ import annotations

import heapq
import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

from irgen.api import IrgenError
from irgen.output import sha256_file

__all__ = ["Thresholds", "verify_output", "compare", "format_table", "MODES"]

MODES = ("single", "entire", "source")
HIST_LAYERS = 6
HIST_BINS = 32


@dataclass
class Thresholds:
    """Pass limits. ``max_lsb`` applies to integer tensors against the source
    runtime (the self-check of integer layers is always exact); ``atol``/``rtol``
    to float tensors (see the module docstring); ``min_cosine``, when set, to
    every float comparison."""

    max_lsb: int = 1
    atol: float = 1e-5
    rtol: float = 1e-4
    min_cosine: float | None = None
    allow_unsupported: bool = False


# ------------------------------------------------------------------ metrics


def _is_int(dtype: np.dtype) -> bool:
    return np.dtype(dtype).kind in "iub"


def compare(got: np.ndarray, golden: np.ndarray, *, integer: bool, th: Thresholds, scaled: bool = False,
            lsb_limit: int = 0, tensor: str = "") -> dict[str, Any]:
    """Metrics ``M`` of ``got`` (reference or source runtime) against ``golden``.

    ``integer``: exact compare in units (LSB), passing when the largest
    difference is ``<= lsb_limit``; otherwise the float criterion of the module
    docstring (``scaled`` selects the magnitude-scaled absolute tolerance).
    """
    got, golden = np.asarray(got), np.asarray(golden)
    m: dict[str, Any] = {"status": "pass", "tensor": tensor, "elements": int(golden.size), "exact_share": 0.0,
                         "max_abs": 0.0, "max_rel": 0.0, "max_lsb": None, "cosine": None, "sqnr_db": None,
                         "exact": False, "message": None}
    if got.shape != golden.shape:
        m.update(status="fail", message=f"shape {list(got.shape)} != golden {list(golden.shape)}")
        return m
    if golden.size == 0:
        m.update(exact_share=1.0, exact=True)
        return m
    a = got.astype(np.float64)
    b = golden.astype(np.float64)
    nan_a, nan_b = np.isnan(a), np.isnan(b)
    same = (a == b) | (nan_a & nan_b)
    m["exact_share"] = float(np.mean(same))
    m["exact"] = bool(same.all())
    diff = np.where(same, 0.0, np.abs(a - b))
    diff = np.where(np.isnan(diff), np.inf, diff)
    peak = float(np.max(np.abs(np.where(nan_b, 0.0, b))))
    m["max_abs"] = float(diff.max())
    m["max_rel"] = float(m["max_abs"] / peak) if peak > 0 else (0.0 if m["max_abs"] == 0 else math.inf)
    fa, fb = np.where(nan_a | nan_b, 0.0, a), np.where(nan_a | nan_b, 0.0, b)
    na, nb = float(np.linalg.norm(fa)), float(np.linalg.norm(fb))
    m["cosine"] = 1.0 if na == 0 and nb == 0 else (float(np.dot(fa.ravel(), fb.ravel()) / (na * nb)) if na and nb else 0.0)
    err = float(np.sum(diff[np.isfinite(diff)] ** 2)) if not m["exact"] else 0.0
    m["sqnr_db"] = None if m["exact"] or err == 0 else (10 * math.log10(float(np.sum(fb ** 2)) / err) if np.sum(fb ** 2) > 0 else -math.inf)
    if integer:
        m["max_lsb"] = int(m["max_abs"]) if math.isfinite(m["max_abs"]) else None
        if not m["exact"] and (m["max_lsb"] is None or m["max_lsb"] > lsb_limit):
            m.update(status="fail", message=f"{(1 - m['exact_share']) * golden.size:.0f} of {golden.size} values differ, "
                                            f"up to {m['max_lsb']} LSB (allowed {lsb_limit})")
        return m
    scale = max(1.0, peak) if scaled else 1.0
    bad = diff > th.atol * scale + th.rtol * np.abs(np.where(nan_b, 0.0, b))
    if bad.any():
        m.update(status="fail", message=f"{int(bad.sum())} of {golden.size} values outside "
                                        f"atol={th.atol:g}{'*' + format(scale, '.3g') if scaled else ''} rtol={th.rtol:g}; "
                                        f"max |err| {m['max_abs']:.3g}")
    elif th.min_cosine is not None and m["cosine"] is not None and m["cosine"] < th.min_cosine:
        m.update(status="fail", message=f"cosine {m['cosine']:.6f} < {th.min_cosine}")
    return m


def _json_num(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


def _status_metric(status: str, tensor: str, message: str) -> dict[str, Any]:
    return {"status": status, "tensor": tensor, "elements": 0, "exact_share": 0.0, "max_abs": 0.0, "max_rel": 0.0,
            "max_lsb": None, "cosine": None, "sqnr_db": None, "exact": False, "message": message}


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


def quant_consistency(layer: dict) -> str | None:
    """Why a conv/dense ``quant`` record's derived requantization disagrees with its
    own scales (None when it agrees, or the record has nothing to cross-check).

    ``recompute`` uses the derived values (multipliers, requant scales); the
    scales beside them must still be the ones they came from, so a scale edited
    in ``ir.json`` is caught even where the arithmetic does not read it."""
    qr = layer.get("quant") or {}
    rq = qr.get("requant") or {}
    if qr.get("kind") not in ("conv2d", "depthwise_conv2d", "dense") or not qr.get("inputs") or not qr.get("weight"):
        return None
    try:
        s_x = float(np.asarray(qr["inputs"][0]["scale"]).reshape(-1)[0])
        s_w = np.asarray(qr["weight"]["scale"], np.float64).reshape(-1)
        s_y = float(np.asarray(qr["output"]["scale"]).reshape(-1)[0])
    except (KeyError, TypeError, ValueError):
        return None
    if qr.get("scheme") == "tflite-int8" and "multiplier" in rq:
        from irgen.quant import quantize_multiplier

        want = [quantize_multiplier(float(r)) for r in s_x * s_w / s_y]
        have = list(zip(np.broadcast_to(np.asarray(rq["multiplier"]), s_w.shape).tolist(),
                        np.broadcast_to(np.asarray(rq["shift"]), s_w.shape).tolist()))
        bad = [c for c, (w, h) in enumerate(zip(want, have)) if tuple(w) != tuple(h)]
        if bad:
            return (f"requant multiplier/shift of channel(s) {bad[:4]} do not follow from the input, weight and "
                    f"output scales (s_x*s_w/s_y)")
        return None
    if "scale" in rq and np.size(rq["scale"]) == s_w.size:
        got = np.asarray(rq["scale"], np.float64).reshape(-1)
        if qr.get("reference") == "torch":
            want = s_x * s_w
            inv = rq.get("inverse_output_scale")
            if inv is not None and not np.isclose(inv, 1.0 / s_y, rtol=1e-6, atol=0):
                return "requant inverse_output_scale does not follow from the output scale (1/s_y)"
        else:
            want = s_x * s_w / s_y
        bad = np.flatnonzero(~np.isclose(got, want, rtol=1e-6, atol=0))
        if bad.size:
            return f"requant scale of channel(s) {bad[:4].tolist()} does not follow from the input, weight and output scales"
    return None


class _Layers:
    """Runs one layer in numpy: ``recompute`` for quantized layers, ``fused_ops`` otherwise."""

    def __init__(self, out: Path):
        self.out = out
        self._params: dict[str, dict[str, np.ndarray]] = {}

    def params(self, layer: dict) -> dict[str, np.ndarray]:
        from irgen.reference import load_layer_params

        name = layer["name"]
        if name not in self._params:
            self._params[name] = load_layer_params(self.out, layer)
        return self._params[name]

    def run(self, layer: dict, inputs: list[np.ndarray]) -> tuple[list[np.ndarray], str | None]:
        """Outputs of ``layer``, and a note when ``fused_ops`` disagrees with ``recompute``.

        Raises :class:`irgen.reference.UnsupportedLayer` when neither can run it."""
        from irgen import quant, reference

        params = self.params(layer)
        if layer.get("quant") is None:
            return [np.asarray(r) for r in reference.run_layer(layer, inputs, params)], None
        try:
            first = np.asarray(quant.recompute(layer, inputs, params))
        except (NotImplementedError, KeyError, TypeError) as err:  # a scheme recompute does not know
            try:
                return [np.asarray(r) for r in reference.run_layer(layer, inputs, params)], None
            except reference.UnsupportedLayer as unsup:
                raise reference.UnsupportedLayer(layer["name"], f"quant {layer['quant'].get('kind')!r}",
                                                 f"recompute: {err}; fused_ops: {unsup}") from None
        outs = [first]
        note = quant_consistency(layer)
        try:
            via_ops = [np.asarray(r) for r in reference.run_layer(layer, inputs, params)]
        except reference.UnsupportedLayer:
            via_ops = None
        if via_ops is not None:
            outs += via_ops[1:]
            if via_ops[0].shape != first.shape or via_ops[0].dtype != first.dtype or not np.array_equal(via_ops[0], first):
                note = "; ".join(filter(None, [note, "fused_ops and the quant record compute different values"]))
        return outs, note


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


def check_manifest(out: Path, ir: dict) -> list[dict[str, Any]]:
    """A problem for every manifest file that is missing or whose sha256 changed."""
    path = out / "manifest.json"
    if not path.is_file():
        return [{"layer": None, "check": "manifest", "message": "manifest.json is missing"}]
    try:
        files = json.loads(path.read_text())["files"]
    except (ValueError, KeyError) as err:
        return [{"layer": None, "check": "manifest", "message": f"manifest.json is unreadable ({err})"}]
    owners = _file_owners(ir)
    problems = []
    for f in files:
        p = out / f["path"]
        layer = owners.get(f["path"])
        who = f" (layer {layer})" if layer else (" (model input)" if f["path"] in owners else "")
        if not p.is_file():
            problems.append({"layer": layer, "check": "manifest", "message": f"{f['path']}{who} is missing"})
        elif p.stat().st_size != f["size"] or sha256_file(p) != f["sha256"]:
            problems.append({"layer": layer, "check": "manifest",
                             "message": f"{f['path']}{who} changed after generation (sha256 differs from manifest.json)"})
    return problems


# ------------------------------------------------------------------ source runtime


def resolve_source(out: Path, ir: dict, model: Path | None = None, host=None):
    """(frontend, model path, frontend options) of the model ``out`` was generated
    from, checked without loading it; raises IrgenError when it is not there."""
    from irgen.plugins import PluginHost

    manifest = {}
    if (out / "manifest.json").is_file():
        manifest = json.loads((out / "manifest.json").read_text())
    path = Path(model) if model is not None else Path(ir["model"]["path"])
    if not path.is_absolute() and not path.exists() and manifest.get("cwd"):
        path = Path(manifest["cwd"]) / path
    if not path.exists():
        raise IrgenError(f"source check: model {path} not found (give its path with --model PATH)")
    host = host or PluginHost().load()
    name = ir["producer"]["frontend"]
    if name not in host.frontends.names():
        raise IrgenError(f"source check: frontend {name!r} is not installed")
    options = dict(manifest.get("frontend_options") or {})
    if options.get("input_shapes"):
        options["input_shapes"] = {k: tuple(v) for k, v in options["input_shapes"].items()}
    if options.get("calibration"):
        options["calibration"] = Path(options["calibration"])
    return host.frontends.get(name), path, options


def source_runner_for(out: Path, ir: dict, model: Path | None = None, host=None) -> tuple[Callable, Path]:
    """The source runtime of the model ``out`` was generated from, in this process;
    raises IrgenError when unavailable."""
    frontend, path, options = resolve_source(out, ir, model, host)
    return frontend.source_runner(path, options), path


def _source_child(conn, out: str, model: str, plugins: list[str], strict: bool, feeds, wanted) -> None:
    """Body of the process :func:`isolated_source_runner` starts."""
    try:
        from irgen.plugins import PluginHost

        host = PluginHost().load(extra=plugins, strict=strict)
        runner, _ = source_runner_for(Path(out), load_ir(out), Path(model), host)
        conn.send(("ok", runner(feeds, wanted)))
    except Exception as err:  # noqa: BLE001  reported by the parent, one line
        conn.send(("error", str(err) if isinstance(err, IrgenError) else f"source check: {type(err).__name__}: {err}"))
    finally:
        conn.close()


def isolated_source_runner(out: Path, ir: dict, model: Path | None = None, host=None,
                           plugins: list[str] | tuple = (), strict: bool = False) -> tuple[Callable, Path]:
    """Like :func:`source_runner_for`, but the runtime runs in a child process, so a
    runtime that aborts or crashes on a model (the TFLite interpreter does on some)
    becomes an IrgenError naming the signal instead of ending ``irgen``."""
    import multiprocessing
    import signal

    frontend, path, _ = resolve_source(out, ir, model, host)

    def run(feeds: dict[str, Any], wanted: list[str]) -> dict[str, Any]:
        ctx = multiprocessing.get_context("spawn")  # no fork: the parent may hold TVM's or torch's threads
        recv, send = ctx.Pipe(duplex=False)
        child = ctx.Process(target=_source_child, daemon=True,
                            args=(send, str(out), str(path), list(plugins), strict, feeds, list(wanted)))
        child.start()
        send.close()
        try:
            status, payload = recv.recv()
        except EOFError:
            child.join()
            code = child.exitcode
            how = f"signal {signal.Signals(-code).name}" if code is not None and code < 0 else f"exit code {code}"
            raise IrgenError(f"source check: the {frontend.name} frontend's runtime crashed ({how}) running "
                             f"{path.name}; the single and entire checks do not depend on it") from None
        finally:
            recv.close()
        child.join()
        if status == "error":
            raise IrgenError(payload)
        return payload

    return run, path


# ------------------------------------------------------------------ verify


def load_ir(out_dir: str | Path) -> dict[str, Any]:
    """``OUT/ir.json``, or an IrgenError saying why it cannot be read."""
    path = Path(out_dir) / "ir.json"
    if not path.is_file():
        raise IrgenError(f"{out_dir}: not an irgen output folder (no ir.json)")
    try:
        ir = json.loads(path.read_text())
        if not isinstance(ir.get("layers"), list):
            raise ValueError("no 'layers' list")
    except (ValueError, AttributeError) as err:
        raise IrgenError(f"{path}: unreadable ({err})") from None
    return ir


def _load(out: Path, rec: dict) -> np.ndarray:
    from irgen.reference import _safe_path

    return np.load(_safe_path(out, rec["file"]), allow_pickle=False)


def verify_output(out_dir: str | Path, *, modes=MODES, thresholds: Thresholds | None = None,
                  source_runner: Callable | None = None, model: str | Path | None = None,
                  progress=None, source_optional: bool = False) -> dict[str, Any]:
    """Verify the output folder ``out_dir``; returns the result dict (see README, ``irgen verify``).

    ``source_runner(inputs, tensors)`` runs the source model (default: built from
    the frontend recorded in ``ir.json``, the model at ``model`` or the recorded
    path, run in a child process); ``progress`` is an :class:`irgen.output.Progress`
    or None. With ``source_optional`` a source runtime that fails or crashes skips
    the ``source`` check with a note (``result["notes"]``) instead of raising.
    """
    t0 = time.perf_counter()
    notes: list[str] = []
    out = Path(out_dir).resolve()
    th = thresholds or Thresholds()
    bad = set(modes) - set(MODES)
    if bad:
        raise IrgenError(f"unknown verify mode(s): {', '.join(sorted(bad))}")
    modes = [m for m in MODES if m in modes]
    ir = load_ir(out_dir)
    layers = ir["layers"]
    say = progress.stage if progress is not None else (lambda text: None)
    step = progress.step if progress is not None else (lambda text, i, n: None)

    model_path = Path(model) if model is not None else None
    if "source" in modes and source_runner is None:
        say("load the source model")
        source_runner, model_path = isolated_source_runner(out, ir, model_path)

    problems: list[dict[str, Any]] = []
    say("check manifest.json checksums")
    problems += check_manifest(out, ir)

    runner = _Layers(out)
    checks: dict[str, dict[str, dict | None]] = {l["name"]: {m: None for m in MODES} for l in layers}
    worst: list = []  # heap of (badness, n, layer, check, golden, reference) for histograms
    counter = [0]

    def record(layer: dict, mode: str, m: dict, golden: np.ndarray | None = None, ref: np.ndarray | None = None):
        name = layer["name"]
        checks[name][mode] = _worse(checks[name][mode], m)
        if golden is not None and ref is not None and golden.size and m["status"] in ("pass", "fail"):
            bad = (m["status"] == "fail", 1.0 - m["exact_share"], m["max_rel"] if math.isfinite(m["max_rel"]) else 1e300)
            counter[0] += 1
            item = (bad, counter[0], name, mode, golden, ref)
            if len(worst) < HIST_LAYERS * 3:
                heapq.heappush(worst, item)
            elif item[:2] > worst[0][:2]:
                heapq.heapreplace(worst, item)

    def compare_outputs(layer: dict, mode: str, outs: list[np.ndarray], note: str | None, scaled: bool) -> None:
        for k, rec in enumerate(layer["outputs"]):
            golden = _load(out, rec)
            if k >= len(outs):
                record(layer, mode, _status_metric("unsupported", rec["name"], f"the reference computes no output {k}"))
                continue
            m = compare(outs[k], golden, integer=_is_int(golden.dtype), th=th, scaled=scaled, tensor=rec["name"])
            if k == 0 and note:
                m.update(status="fail", message=f"{m['message']}; {note}" if m["message"] else note)
            record(layer, mode, m, golden, outs[k])

    from irgen.reference import UnsupportedLayer

    def attempt(layer: dict, mode: str, inputs: Callable[[], list[np.ndarray]]):
        """(outputs, note) of the layer, or None with the reason recorded."""
        first = layer["outputs"][0]["name"]
        try:
            return runner.run(layer, inputs())
        except UnsupportedLayer as err:
            record(layer, mode, _status_metric("unsupported", first, str(err)))
        except (OSError, ValueError, KeyError, IndexError, TypeError) as err:
            record(layer, mode, _status_metric("fail", first, f"cannot run: {type(err).__name__}: {err}"))
        return None

    def _local(layer: dict, values: dict, src_of: dict, value: np.ndarray) -> dict | None:
        """The layer recomputed from the source runtime's own input tensors against its
        output: the kernel arithmetic alone, without differences carried from earlier
        layers (None when an input is not available as an integer tensor there)."""
        ins = []
        for r in layer.get("inputs") or []:
            v = values.get(src_of.get(r["name"], ""))
            if v is None or str(np.asarray(v).dtype) != r.get("dtype"):
                return None
            ins.append(np.asarray(v))
        try:
            got = runner.run(layer, ins)[0][0]
        except (UnsupportedLayer, ValueError, KeyError, IndexError, TypeError):
            return None
        if _is_int(value.dtype) and not _is_int(got.dtype):  # a dequantize: in LSB, as ``value`` is
            got = _to_float_source(got, got, layer, 0)[0]
        lm = compare(value, got, integer=True, th=th, lsb_limit=th.max_lsb)
        return {"exact_share": lm["exact_share"], "max_lsb": lm["max_lsb"]}

    if "single" in modes:
        say(f"single: {len(layers)} layers on their golden inputs")
        for i, layer in enumerate(layers, 1):
            got = attempt(layer, "single", lambda: [_load(out, r) for r in layer.get("inputs") or []])
            if got is not None:
                compare_outputs(layer, "single", *got, scaled=False)
            step("layers", i, len(layers))

    if "entire" in modes:
        say(f"entire: {len(layers)} layers chained from the model input")
        values: dict[str, np.ndarray] = {t["name"]: _load(out, t) for t in ir.get("inputs") or []}
        uses: dict[str, int] = {}
        for layer in layers:
            for r in layer.get("inputs") or []:
                uses[r["name"]] = uses.get(r["name"], 0) + 1
        for i, layer in enumerate(layers, 1):
            inputs, from_golden = [], []
            for r in layer.get("inputs") or []:
                if r["name"] in values:
                    inputs.append(values[r["name"]])
                else:  # its producer could not run: carry on from the golden file, and say so
                    inputs.append(_load(out, r))
                    from_golden.append(r["name"])
                uses[r["name"]] -= 1
                if uses[r["name"]] == 0 and r["name"] not in {t["name"] for t in ir.get("outputs") or []}:
                    values.pop(r["name"], None)
            got = attempt(layer, "entire", lambda: inputs)
            if got is not None:
                outs = got[0]
                compare_outputs(layer, "entire", outs, None, scaled=True)
                for rec, v in zip(layer["outputs"], outs):
                    if uses.get(rec["name"], 0) > 0:
                        values[rec["name"]] = v
                if from_golden:
                    m = checks[layer["name"]]["entire"]
                    extra = f"inputs {', '.join(from_golden)} from golden files (producer did not run)"
                    m["message"] = f"{m['message']}; {extra}" if m["message"] else extra
            step("layers", i, len(layers))

    model_info = dict(ir.get("model") or {})
    if "source" in modes:
        say("source: run the model in its own runtime")
        if model_path is not None:
            model_info["path"] = str(model_path)
            if model_path.exists() and model_info.get("sha256"):
                from irgen.pipeline import sha256_path

                if sha256_path(model_path) != model_info["sha256"]:
                    problems.append({"layer": None, "check": "source",
                                     "message": f"model {model_path} is not the file OUT was generated from (sha256 differs)"})
        feeds = {t["name"]: _load(out, t) for t in ir.get("inputs") or []}
        wanted = sorted({s for l in layers for s in (l.get("source") or {}).get("outputs") or []})
        try:
            values = source_runner(feeds, wanted)
        except IrgenError as err:
            if not source_optional:
                raise
            notes.append(f"source check skipped: {' '.join(str(err).split()).removeprefix('source check: ')}")
            modes = [m for m in modes if m != "source"]
            values = None
        if values is not None:
            src_of = {t["name"]: t["name"] for t in ir.get("inputs") or []}
            for layer in layers:
                src_of.update(zip((r["name"] for r in layer["outputs"]), (layer.get("source") or {}).get("outputs") or []))
            for i, layer in enumerate(layers, 1):
                srcs = (layer.get("source") or {}).get("outputs") or []
                for k, rec in enumerate(layer["outputs"]):
                    src = srcs[k] if k < len(srcs) else None
                    if src is None or src not in values:
                        record(layer, "source", _status_metric("missing", rec["name"],
                                                               f"source tensor {src!r} is not available in the source runtime" if src else "no source tensor"))
                        continue
                    golden = _load(out, rec)
                    value, integer = _to_float_source(np.asarray(values[src]), golden, layer, k)
                    if integer and not _is_int(golden.dtype):
                        golden, _ = _to_float_source(golden, golden, layer, k)
                    if not integer and _is_int(value.dtype) != _is_int(golden.dtype):
                        value = value.astype(np.float64)
                    m = compare(value, golden, integer=integer, th=th, scaled=True, lsb_limit=th.max_lsb, tensor=rec["name"])
                    m["source_tensor"] = src
                    if integer and k == 0 and layer.get("quant") is not None:
                        m["local"] = _local(layer, values, src_of, value)
                        if m["status"] == "fail" and m["local"] is not None:
                            m["message"] += (f"; from the runtime's own inputs the layer is off by at most "
                                             f"{m['local']['max_lsb']} LSB ({100 * m['local']['exact_share']:.3f}% exact)")
                    record(layer, "source", m, golden, value)
                step("layers", i, len(layers))

    # ---------------------------------------------------------- assemble
    rows = []
    n_pass = n_fail = n_unsup = 0
    for layer in layers:
        c = checks[layer["name"]]
        statuses = [m["status"] for m in c.values() if m is not None]
        status = "fail" if "fail" in statuses else ("unsupported" if "unsupported" in statuses else "pass")
        n_pass += status == "pass"
        n_fail += status == "fail"
        n_unsup += status == "unsupported"
        for mode, m in c.items():
            if m is None:
                continue
            for key in ("max_abs", "max_rel", "sqnr_db", "cosine"):
                m[key] = _json_num(m[key])
            if m["status"] == "fail" or (m["status"] == "unsupported" and not th.allow_unsupported):
                problems.append({"layer": layer["name"], "check": mode, "message": f"{m['tensor']}: {m['message']}"})
        dtype = (layer.get("outputs") or [{}])[0].get("dtype") or ""
        rows.append({
            "name": layer["name"],
            "op": layer["op"],
            "dtype": dtype,
            "integer": bool(dtype) and _is_int(np.dtype(dtype)),
            "scheme": (layer.get("quant") or {}).get("scheme"),
            "inputs": [r.get("producer") or "input" for r in layer.get("inputs") or []],
            "checks": c,
            "status": status,
        })
    histograms = {}
    for bad, _, name, mode, golden, ref in sorted(worst, reverse=True):
        if name in histograms or len(histograms) >= HIST_LAYERS:
            continue
        histograms[name] = _histogram(golden, ref, mode)
    passed = n_fail == 0 and (n_unsup == 0 or th.allow_unsupported) and not any(
        p["check"] in ("manifest",) or p["layer"] is None for p in problems)
    return {
        "irgen_verify": 1,
        "out": str(out),
        "model": model_info,
        "producer": ir.get("producer"),
        "modes": modes,
        "thresholds": {k: v for k, v in asdict(th).items() if k != "allow_unsupported"},
        "allow_unsupported": th.allow_unsupported,
        "passed": bool(passed),
        "summary": {"layers": len(layers), "passed": n_pass, "failed": n_fail, "unsupported": n_unsup,
                    "seconds": round(time.perf_counter() - t0, 3)},
        "problems": problems,
        "notes": notes,
        "layers": rows,
        "histograms": histograms,
    }


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


def format_table(result: dict, limit: int | None = None) -> str:
    """The terminal table: one line per layer and check, worst layers first, then a summary."""
    head = ("LAYER", "OP", "DTYPE", "CHECK", "EXACT%", "MAX ERR", "COSINE", "SQNR dB", "STATUS")
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
            else:
                err = _fmt(m["max_abs"], "abs")
            sqnr = "exact" if m.get("exact") else _fmt(m["sqnr_db"], "db")
            share = "-" if m["status"] in ("unsupported", "missing") else _fmt(m["exact_share"], "pct")
            cos = "-" if m["status"] in ("unsupported", "missing") else _fmt(m["cosine"], "cos")
            lines.append((row["name"], row["op"], row["dtype"], mode, share, err, cos, sqnr, m["status"].upper()))
            if m["status"] in ("fail", "unsupported") and m["message"]:
                notes.append(f"  {row['name']} [{mode}]: {m['message']}")
    widths = [min(40, max(len(str(r[i])) for r in lines)) for i in range(len(head))]
    text = ["  ".join(str(c)[:w].ljust(w) for c, w in zip(r, widths)).rstrip() for r in lines]
    if limit is not None and len(rows) > limit:
        text.append(f"... {len(rows) - limit} more layers")
    text += notes
    for p in result["problems"]:
        if p["check"] == "manifest" or p["layer"] is None:
            text.append(f"  {p['check']}: {p['message']}")
    s = result["summary"]
    verdict = "PASS" if result["passed"] else "FAIL"
    text.append(f"{verdict}: {s['layers']} layers, {s['passed']} passed, {s['failed']} failed, "
                f"{s['unsupported']} unsupported; checks {', '.join(result['modes']) or 'none'}; "
                f"{len(result['problems'])} problems; {s['seconds']:.2f} s")
    return "\n".join(text)
