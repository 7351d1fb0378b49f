"""``irgen compare OUT DUMP``: a device's per-layer dump against OUT's golden data, and what is wrong.

The layers are taken in IR order. Each output the dump holds (:class:`irgen.runners.DumpRunner`:
laid out like OUT, or as a ``--map`` file says) is compared with its golden file
(:func:`irgen.comparators.diff`): integer tensors exactly, float tensors by the float
contract; a tensor the dump lacks is ``missing`` (partial dumps are normal). A layer that
differs is recomputed from the device's own inputs (the dump's values of its inputs, the
golden files where the dump lacks them; :class:`irgen.runners.LayerRunner`): when the
recomputation equals what the device wrote, the layer is right and its error
``inherited``; otherwise it is wrong ``local``-ly, and for such a layer compare says
where (:func:`irgen.comparators.localize`: channels, rows, columns, tiles) and what its
difference looks like (:func:`irgen.diagnose.diagnose`: the hardware-bug signatures).
Values the storage puts in a channel padding must be zeros; a dump that has others
there differs, locally.

The verdict names the first locally wrong layer (``first_local``). OUT and DUMP are
untrusted: every path is confined to its folder and every file sized before it is read
(:mod:`irgen.safeio`); nothing is unpickled.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import numpy as np

from irgen.api import IrgenError, Mismatch
from irgen.comparators import axis_letters, diff, float_close, localize, Thresholds
from irgen.dumpmap import DumpMap, read_map
from irgen.irfile import output_folder, output_folders
from irgen.plugins import PluginHost
from irgen.runners import DumpRunner, Golden, LayerRunner, one_line, Refused, TensorFiles
from irgen.safeio import DEFAULT_MAX_TENSOR_BYTES

__all__ = ["compare_dump", "compare_output", "format_compare", "verdict_line"]

#: a row's status, worst first
STATUSES = ("differs", "missing", "within", "equal")
#: the locally wrong layers diagnosed (the signatures checked), in IR order; later ones are localized only
MAX_DIAGNOSED = 16


def _printable(text: Any) -> str:
    from irgen.verify import printable

    return printable(text)


class _Compare:
    """One output folder against one dump folder: its state, and its steps as methods
    (:meth:`run` calls :meth:`layer` for each layer in IR order)."""

    def __init__(self, out: Path, dump: Path, *, mapping: DumpMap | None, th: Thresholds, max_ulp: int | None,
                 tile: tuple[int, int] | None, host, limit: int | None, siblings: list[Path], progress):
        from irgen.verify import _backend_of, load_ir

        self.t0 = time.perf_counter()
        self.ir = load_ir(out)
        self.out, self.dump = Path(out).resolve(), output_folder(dump).resolve()
        self.th, self.max_ulp, self.host, self.limit, self.progress = th, max_ulp, host, limit, progress
        backend = _backend_of(self.ir, host, (), False)
        self.tile = tile or (tuple(backend.tile) if backend is not None and backend.tile else None)
        self.files = TensorFiles(self.out, self.ir, limit, lambda: backend)
        if self.files.refused:
            owner, why = next(iter(self.files.refused.values()))
            raise IrgenError(f"{self.out}: {why}")
        self.golden = Golden(self.files, self.ir)
        readers = dict(host.dump_readers.items())
        self.device = DumpRunner(self.dump, self.ir, limit=limit, backend=lambda: backend, readers=readers,
                                 mapping=mapping)
        self.runner = LayerRunner(self.files, lambda: host)  # the host's schemes recompute their layers
        self.siblings = siblings
        self.signatures = [s for _, s in host.signatures.items()]
        self.values: dict[str, np.ndarray] = {}  # the device's values (or golden ones) the next layers read
        self.state: dict[str, str] = {}  # tensor -> status of the device's value
        self.notes: list[str] = []
        self.first_local: dict[str, Any] | None = None
        self.diagnosed: set[int] = set()  # the rows whose differences the signatures were checked against
        self.uses = self._uses()

    def _uses(self) -> dict[str, int]:
        uses: dict[str, int] = {}
        for layer in self.ir["layers"]:
            for r in layer.get("inputs") or []:
                uses[r["name"]] = uses.get(r["name"], 0) + 1
        return uses

    # ---------------------------------------------------------------- the steps

    def run(self) -> dict[str, Any]:
        """Every layer in IR order, then the result."""
        self.model_inputs()
        rows = []
        layers = self.ir["layers"]
        say = self.progress.step if self.progress is not None else (lambda text, i, n: None)
        for i, layer in enumerate(layers):
            rows.append(self.layer(i, layer))
            say("layers", i + 1, len(layers))
        return self.result(rows)

    def model_inputs(self) -> None:
        """The model inputs the device was given, where the dump holds them (else OUT's)."""
        for rec in self.ir.get("inputs") or []:
            value = self.read(rec, "", -1, 0)[0]
            if value is None:
                continue
            golden = self.golden.get(rec["name"])
            status = diff(value.array, golden, self.th, self.max_ulp)["status"] if golden is not None else "differs"
            self.state[rec["name"]] = status
            self.values[rec["name"]] = value.array
            if status == "differs":
                self.notes.append(f"the device's model input {rec['name']!r:.80} differs from OUT's; the layers are "
                                  "recomputed from the device's own")

    def read(self, rec: dict, layer: str, index: int, k: int):
        """(the dump's value or None, why it could not be read or None)."""
        try:
            return self.device.get(rec, layer, index, k), None
        except Refused:
            raise
        except IrgenError as err:
            return None, one_line(err)

    def layer(self, i: int, layer: dict) -> dict[str, Any]:
        """The row of one layer: each output against its golden file, then, where one differs,
        local or inherited, and for a local one where and what."""
        outputs, dumped = [], []
        for k, rec in enumerate(layer["outputs"]):
            metric, value = self.output(i, layer, k, rec)
            outputs.append(metric)
            dumped.append(value)
        row = self.row(i, layer, outputs)
        if row["status"] == "differs":
            self.origin(i, layer, row, dumped)
        self.release(layer)
        return row

    def output(self, i: int, layer: dict, k: int, rec: dict) -> tuple[dict[str, Any], Any]:
        """One output's metric (and the dump's value), its value kept for the layers that read it."""
        base = {"tensor": rec["name"], "file": None, "status": "missing", "mismatches": 0, "share": 0.0,
                "max_lsb": None, "message": None}
        golden = self.golden.get(rec["name"])
        value, unreadable = self.read(rec, layer["name"], i, k)
        if golden is not None and self.uses.get(rec["name"]):
            self.values[rec["name"]] = golden  # replaced by the device's value below
        if unreadable:
            return {**base, "status": "differs", "mismatches": int(np.prod(rec["shape"])), "share": 1.0,
                    "message": f"cannot read the dump: {unreadable}"}, None
        if value is None or golden is None:
            why = "not in the dump" if value is None else "OUT has no golden file of it (irgen run --layers)"
            return {**base, "message": why}, None
        m = {"tensor": rec["name"], "file": value.file, **diff(value.array, golden, self.th, self.max_ulp)}
        if value.padding is not None and np.any(value.padding):
            n = int(np.count_nonzero(value.padding))
            m.update(status="differs", padding_nonzero=n,
                     message="; ".join(filter(None, [m["message"], f"{n} values in the channel padding are not zero"])))
        self.state[rec["name"]] = m["status"]
        if self.uses.get(rec["name"]):
            self.values[rec["name"]] = value.array
        return m, value

    def row(self, i: int, layer: dict, outputs: list[dict]) -> dict[str, Any]:
        present = [o for o in outputs if o["status"] != "missing"] or outputs
        worst = min(present, key=lambda o: STATUSES.index(o["status"]))
        lsb = [o["max_lsb"] for o in outputs if o.get("max_lsb") is not None]
        return {"index": i, "name": layer["name"], "op": layer["op"],
                "dtype": (layer["outputs"][0].get("dtype") or ""), "status": worst["status"],
                "mismatches": sum(o["mismatches"] for o in outputs), "share": worst.get("share", 0.0),
                "max_lsb": max(lsb) if lsb else None, "origin": None, "diagnosis": [], "outputs": outputs}

    def release(self, layer: dict) -> None:
        for r in layer.get("inputs") or []:
            self.uses[r["name"]] -= 1
            if self.uses[r["name"]] == 0:
                self.values.pop(r["name"], None)

    # ---------------------------------------------------------------- local or inherited

    def inputs_of(self, layer: dict) -> tuple[list[np.ndarray] | None, bool]:
        """(the layer's inputs as the device had them, or None when one is nowhere; whether all are golden)."""
        inputs, golden = [], True
        for r in layer.get("inputs") or []:
            v = self.values.get(r["name"])
            if v is None:
                v = self.golden.get(r["name"])
            if v is None:
                return None, golden
            golden = golden and self.state.get(r["name"], "equal") == "equal"
            inputs.append(v)
        return inputs, golden

    def origin(self, i: int, layer: dict, row: dict, dumped: list) -> None:
        """Local or inherited: the layer recomputed from the device's own inputs against the device."""
        inputs, all_golden = self.inputs_of(layer)
        if inputs is None:
            self.notes.append(f"layer {layer['name']!r:.80}: not recomputed (an input is neither in the dump nor in OUT)")
            return
        try:
            expected = [self.golden.get(r["name"]) for r in layer["outputs"]] if all_golden else \
                self.runner.run(layer, inputs, check=False)[0]
        except IrgenError:
            raise
        except Exception as err:  # noqa: BLE001  UnsupportedLayer, or what an edited record makes the reference do
            self.notes.append(f"layer {layer['name']!r:.80}: not recomputed from the device's inputs ({one_line(err)[:200]})")
            return
        local = False
        for k, value in enumerate(dumped):
            if value is None or k >= len(expected) or expected[k] is None:
                continue
            m = self.mismatch(layer, k, value, np.asarray(expected[k]), inputs)
            wrong = ~m.same(m.device, m.expected)
            if wrong.any() or (value.padding is not None and np.any(value.padding)):
                local = True
                self.explain(row, m, wrong)
        row["origin"] = "local" if local else "inherited"
        if local and self.first_local is None:
            self.first_local = {"layer": layer, "index": i, "inputs": inputs,
                                "expected": [np.asarray(e) for e in expected], "device": [v and v.array for v in dumped]}

    def mismatch(self, layer: dict, k: int, value, expected: np.ndarray, inputs: list[np.ndarray]) -> Mismatch:
        """What the signatures examine of output ``k`` (:class:`irgen.api.Mismatch`)."""
        rec = layer["outputs"][k]
        params = self.runner.params(layer)
        run, th, max_ulp = self.runner.run, self.th, self.max_ulp
        base = (layer, inputs, params)

        def recompute(layer=None, inputs=None, params=None):
            try:
                return run(layer or base[0], base[1] if inputs is None else inputs,
                           params=base[2] if params is None else params, check=False)[0]
            except IrgenError:
                raise
            except Exception:  # noqa: BLE001  a variant the reference cannot run
                return None

        return Mismatch(layer=layer, output=k, device=value.array, expected=expected,
                        golden=self.golden.get(rec["name"]), inputs=inputs, params=params,
                        layout=axis_letters(rec.get("layout"), value.array.ndim), padding=value.padding,
                        physical_layout=value.physical.layout, to_physical=value.physical.to_physical,
                        to_logical=value.physical.to_logical, recompute=recompute,
                        others=lambda what="output": self.others(layer, k, what),
                        close=lambda a, b: float_close(a, b, th, max_ulp))

    def explain(self, row: dict, m: Mismatch, wrong: np.ndarray) -> None:
        """Where the local difference lies, and the signatures it matches, into the row."""
        from irgen.diagnose import diagnose

        if "where" not in row:
            row["where"] = localize(wrong, m.layout, self.tile)
            d = m.device.astype(np.int64) - m.expected.astype(np.int64) if m.integer else None
            row["local"] = {"tensor": m.layer["outputs"][m.output]["name"], "mismatches": int(np.count_nonzero(wrong)),
                            "max_lsb": int(np.abs(d).max()) if d is not None and d.size else None}
        if row["index"] not in self.diagnosed:
            if len(self.diagnosed) >= MAX_DIAGNOSED:
                row["diagnosis_skipped"] = True
                return
            self.diagnosed.add(row["index"])
        found, notes = diagnose(m, self.signatures)
        self.notes += notes
        row["diagnosis"] += [{"code": f["code"], "detail": f["detail"]} for f in found
                             if all(f["code"] != g["code"] for g in row["diagnosis"])]

    def others(self, layer: dict, k: int, what: str):
        """Golden values elsewhere with this output's (or parameter's) shape and dtype (:class:`Mismatch`)."""
        if what != "output":
            mine = (layer.get("params") or {}).get(what)
            for other in self.ir["layers"]:
                rec = (other.get("params") or {}).get(what)
                if mine and rec and other is not layer and rec["shape"] == mine["shape"] and rec.get("dtype") == mine.get("dtype"):
                    yield f"layer {other['name']!r}'s {what}", self.files.load(rec)
            return
        mine = layer["outputs"][k]
        for other in self.ir["layers"]:
            for rec in other["outputs"]:
                if rec is not mine and rec["shape"] == mine["shape"] and rec.get("dtype") == mine.get("dtype") \
                        and rec.get("file"):
                    yield f"the golden output of layer {other['name']!r}", self.files.load(rec)
        for sibling in self.siblings:
            if mine.get("file") and os.path.lexists(sibling / mine["file"]):
                yield f"this tensor's golden value in sample {sibling.name!r}", \
                    TensorFiles(sibling, self.ir, self.limit).load(mine)

    # ---------------------------------------------------------------- the result

    def result(self, rows: list[dict]) -> dict[str, Any]:
        count = {s: sum(r["status"] == s for r in rows) for s in STATUSES}
        first = next((r for r in rows if r["status"] == "differs"), None)
        local = [r for r in rows if r["origin"] == "local"]
        if len(local) > MAX_DIAGNOSED:
            self.notes.append(f"{len(local)} layers are wrong locally; the first {MAX_DIAGNOSED} are diagnosed, the "
                              "others only localized (fix the first and compare again)")
        th = self.th
        return {
            "irgen_compare": 1, "out": str(self.out), "dump": str(self.dump),
            "producer": self.ir.get("producer"),
            "thresholds": {"atol": th.atol, "rtol": th.rtol, "max_ulp": self.max_ulp},
            "tile": list(self.tile) if self.tile else None,
            "passed": count["differs"] == 0,
            "first_local": local[0]["name"] if local else None,
            "first_differs": first["name"] if first else None,
            "summary": {"layers": len(rows), **count, "local": len(local),
                        "inherited": sum(r["origin"] == "inherited" for r in rows),
                        "seconds": round(time.perf_counter() - self.t0, 3)},
            "notes": self.notes, "layers": rows}


def compare_output(out: str | Path, dump: str | Path, *, mapping: str | Path | DumpMap | None = None,
                   thresholds: Thresholds | None = None, max_ulp: int | None = None,
                   tile: tuple[int, int] | None = None, host=None, plugins: list[str] | tuple = (),
                   strict: bool = False, max_tensor_bytes: int | None = DEFAULT_MAX_TENSOR_BYTES,
                   progress=None, siblings: list[Path] = (), extract: str | Path | None = None) -> dict[str, Any]:
    """One output folder ``out`` against one dump folder ``dump``; the result dict (see
    ``docs/compare.md``). ``mapping``: a ``--map`` file (or a read one); ``host``: the
    plugin host (its backends, dump readers and signatures; default: load the plugins,
    ``plugins`` and ``strict`` as ``--plugin`` and ``--strict-plugins``); ``siblings``:
    the other samples' output folders of an ``irgen run --inputs`` output (their golden
    values are candidates of stale data); ``extract``: write the first locally wrong
    layer's test vector there (:func:`irgen.extract.extract_layer`), with the device's inputs."""
    if host is None:
        host = PluginHost().load(extra=list(plugins), strict=strict)
    if mapping is not None and not isinstance(mapping, DumpMap):
        mapping = read_map(Path(mapping))
    run = _Compare(Path(out), Path(dump), mapping=mapping, th=thresholds or Thresholds(), max_ulp=max_ulp, tile=tile,
                   host=host, limit=max_tensor_bytes, siblings=list(siblings), progress=progress)
    if progress is not None:
        progress.stage(f"compare {len(run.ir['layers'])} layers with the dump {dump}")
    with np.errstate(all="ignore"):  # a device's floats may be anything (NaN, inf, byte-swapped)
        result = run.run()
    if extract is not None:
        result["extracted"] = _extract_failing(run, Path(extract), host)
    return result


def _extract_failing(run: _Compare, dest: Path, host) -> str | None:
    """The first locally wrong layer's test vector in ``dest``, with the device's inputs (None: no such layer)."""
    from irgen.extract import extract_layer

    first = run.first_local
    if first is None:
        return None
    extract_layer(run.out, first["layer"]["name"], dest, host=host, inputs=first["inputs"], outputs=first["expected"],
                  device=first["device"], limit=run.limit)
    return str(dest)


def compare_dump(out: str | Path, dump: str | Path, **kwargs: Any) -> dict[str, Any]:
    """``irgen compare OUT DUMP``: :func:`compare_output`; for an ``irgen run --inputs`` output
    (one folder per sample) each sample against the dump's folder of that name, as
    ``{"passed", "first_local": {"sample", "layer"} or None, "samples": {name: result}}``
    (a sample the dump lacks: every tensor missing, noted). ``kwargs``: see :func:`compare_output`."""
    folders = output_folders(out)
    if len(folders) == 1 and folders[0] == Path(out):
        return compare_output(out, dump, **kwargs)
    dump = output_folder(dump)
    if not any((dump / f.name).is_dir() for f in folders):
        raise IrgenError(f"{dump}: holds none of the sample folders of {out} ({', '.join(f.name for f in folders[:3])}"
                         f"{', ...' if len(folders) > 3 else ''}); compare one sample's folder with its dump instead")
    extract = kwargs.pop("extract", None)
    results, first = {}, None
    for folder in folders:
        siblings = [f for f in folders if f != folder][:16]
        there = dump / folder.name
        if not there.is_dir():
            results[folder.name] = {"passed": True, "first_local": None, "layers": [],
                                    "notes": [f"the dump has no folder {folder.name!r} for this sample"]}
            continue
        results[folder.name] = compare_output(folder, there, siblings=siblings,
                                              extract=extract if first is None else None, **kwargs)
        if first is None and results[folder.name]["first_local"]:
            first = {"sample": folder.name, "layer": results[folder.name]["first_local"]}
    return {"irgen_compare": 1, "passed": all(r["passed"] for r in results.values()), "first_local": first,
            "samples": results}


# ------------------------------------------------------------------ the terminal


def verdict_line(result: dict) -> str:
    """One line: PASS or FAIL, the first locally wrong layer and its diagnosis, the counts."""
    s = result["summary"]
    counts = (f"{s['layers']} layers: {s['equal']} equal, {s['within']} within tolerance, {s['differs']} differ "
              f"({s['local']} local, {s['inherited']} inherited), {s['missing']} missing")
    if result["passed"]:
        return _printable(f"PASS: {counts}")
    name = result["first_local"]
    if name is None:
        return _printable(f"FAIL: no layer is wrong locally (first difference at {result['first_differs']}); {counts}")
    row = next(r for r in result["layers"] if r["name"] == name)
    codes = ", ".join(f"{d['code']}: {d['detail']}" for d in row["diagnosis"]) or "no known signature"
    return _printable(f"FAIL: first locally wrong layer {name} ({codes}); {counts}")


def _where_text(where: dict | None) -> str:
    parts = []
    for key in ("channels", "rows", "cols", "tiles"):
        w = (where or {}).get(key)
        if w and w["count"]:
            shown = ",".join(str(i) for i in w["list"][:8]) + ("..." if w["count"] > 8 else "")
            parts.append(f"{key} {w['count']}/{w['of']} [{shown}]")
    return "; ".join(parts)


def format_compare(result: dict, limit: int | None = None) -> str:
    """The terminal table: the layers that are not equal, in IR order (``limit``: the first N),
    the local ones' diagnosis and place, the notes, then the verdict."""
    head = ("#", "LAYER", "OP", "STATUS", "MISMATCH", "MAX ERR", "COSINE", "SQNR dB", "ORIGIN", "DIAGNOSIS")
    lines, notes = [head], []
    rows = [r for r in result["layers"] if r["status"] != "equal"]
    for r in rows[:limit]:
        o = next((o for o in r["outputs"] if o["status"] == r["status"]), r["outputs"][0])
        err = f"{r['max_lsb']} LSB" if r["max_lsb"] is not None else (f"{o['max_abs']:.3g}" if o.get("max_abs") else "-")
        mism = "-" if r["status"] == "missing" else f"{r['mismatches']} ({100 * r['share']:.1f}%)"
        cos = "-" if o.get("cosine") is None else f"{o['cosine']:.6f}"
        sqnr = "-" if o.get("sqnr_db") is None else f"{o['sqnr_db']:.1f}"
        lines.append(tuple(_printable(c) for c in (r["index"], r["name"], r["op"], r["status"], mism, err, cos, sqnr,
                                                    r["origin"] or "-", ",".join(d["code"] for d in r["diagnosis"]) or "-")))
        if r["origin"] == "local":
            where = _where_text(r.get("where"))
            notes += [_printable(f"  {r['name']}: {d['code']}: {d['detail']}") for d in r["diagnosis"]]
            notes += [_printable(f"  {r['name']}: differs in {where}")] if where else []
        elif r["status"] == "differs" and o.get("message") and r["origin"] is None:
            notes.append(_printable(f"  {r['name']}: {o['message']}"))
    widths = [min(40, max(len(str(row[i])) for row in lines)) for i in range(len(head))]
    text = ["  ".join(str(c)[:w].ljust(w) for c, w in zip(row, widths)).rstrip() for row in lines]
    if limit is not None and len(rows) > limit:
        text.append(f"... {len(rows) - limit} more layers that are not equal")
    text.append(f"{result['summary']['equal']} layers equal (not listed)")
    text += notes + [_printable(f"note: {n}") for n in result.get("notes") or []]
    text.append(verdict_line(result))
    return "\n".join(text)
