"""``irgen inspect``: a summary of an output folder's IR (layers, ops, dtypes,
quantization schemes, parameter and activation files and bytes).

The folder is untrusted: ``ir.json`` is read with :func:`irgen.verify.load_ir`
(validated, then checked against the IR's JSON Schema), and every file it names is confined to OUT with
:func:`irgen.safeio.inside` before it is stat'ed; a path out of OUT, or a file
that is not a regular one (a FIFO, a device), is an error. A file that is not
there counts 0 bytes."""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

from irgen.api import IrgenError
from irgen.irfile import tensor_records
from irgen.safeio import inside
from irgen.schema import ir_version
from irgen.verify import load_ir, printable

__all__ = ["inspect_output", "format_inspect"]


def inspect_output(out_dir: str | Path) -> dict[str, Any]:
    """A summary of an output folder's IR: layers, ops, dtypes, quant schemes, bytes."""
    out = Path(out_dir)
    ir = load_ir(out_dir)
    layers = ir["layers"]
    sizes: dict[str, int] = {}
    for where, _, rec in tensor_records(ir):
        rel = rec.get("file")
        if rel is None or rel in sizes:
            continue
        path = inside(out, rel, f"{out / 'ir.json'}: {where}.file")
        try:
            st = os.stat(path)
        except FileNotFoundError:
            sizes[rel] = 0
            continue
        except OSError as err:
            raise IrgenError(f"{out / 'ir.json'}: {where}.file {path}: cannot read ({err.strerror or err})") from None
        if not stat.S_ISREG(st.st_mode):
            raise IrgenError(f"{out / 'ir.json'}: {where}.file {path}: not a regular file")
        sizes[rel] = st.st_size

    def size(rel: str | None) -> int:
        return sizes.get(rel, 0) if rel else 0

    ops: dict[str, int] = {}
    dtypes: dict[str, int] = {}
    schemes: dict[str, int] = {}
    param_files, act_files = set(), set()
    rows = []
    for layer in layers:
        ops[layer["op"]] = ops.get(layer["op"], 0) + 1
        dtype = (layer.get("outputs") or [{}])[0].get("dtype") or "?"
        dtypes[dtype] = dtypes.get(dtype, 0) + 1
        scheme = (layer.get("quant") or {}).get("scheme")
        if scheme:
            schemes[scheme] = schemes.get(scheme, 0) + 1
        pfiles = [r["file"] for r in (layer.get("params") or {}).values() if r.get("file")]
        ofiles = [r["file"] for r in layer.get("outputs") or [] if r.get("file")]
        param_files.update(pfiles)
        act_files.update(ofiles)
        act_files.update(r["file"] for r in layer.get("inputs") or [] if r.get("file"))
        rows.append({"name": layer["name"], "op": layer["op"], "dtype": dtype, "scheme": scheme,
                     "output_shape": (layer.get("outputs") or [{}])[0].get("shape"),
                     "param_bytes": sum(size(f) for f in pfiles), "activation_bytes": sum(size(f) for f in ofiles)})
    act_files.update(t["file"] for t in ir.get("inputs") or [] if t.get("file"))
    return {
        "irgen_inspect": 2,  # 2: "layers" is the list (as in ir.json), its length "layer_count"
        "out": str(out.resolve()),
        "ir_version": ir_version(ir),  # MAJOR.MINOR.PATCH; the old integer 1 is 1.0.0
        "producer": ir.get("producer"),
        "model": ir.get("model"),
        "inputs": [{k: t.get(k) for k in ("name", "shape", "dtype")} for t in ir.get("inputs") or []],
        "outputs": [{k: t.get(k) for k in ("name", "shape", "dtype")} for t in ir.get("outputs") or []],
        "layer_count": len(layers),
        "ops": dict(sorted(ops.items(), key=lambda kv: (-kv[1], kv[0]))),
        "dtypes": dict(sorted(dtypes.items(), key=lambda kv: (-kv[1], kv[0]))),
        "schemes": schemes,
        "parameter_files": len(param_files),
        "parameter_bytes": sum(size(f) for f in param_files),
        "activation_files": len(act_files),
        "activation_bytes": sum(size(f) for f in act_files),
        "layers": rows,
    }


def _human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def format_inspect(info: dict[str, Any]) -> str:
    p = info["producer"] or {}
    lines = [
        f"{info['out']}: {info['layer_count']} layers from {(info['model'] or {}).get('path')} "
        f"({p.get('frontend')} frontend, quantizer {p.get('quantizer') or 'none'}, backend {p.get('backend')}, "
        f"opt level {p.get('opt_level')}; IR {info.get('ir_version')}, irgen {p.get('irgen')}, tvm {p.get('tvm')})",
        "inputs:  " + ", ".join(f"{t['name']} {t['shape']} {t['dtype']}" for t in info["inputs"]),
        "outputs: " + ", ".join(f"{t['name']} {t['shape']} {t['dtype']}" for t in info["outputs"]),
        "ops:     " + ", ".join(f"{k} x{v}" for k, v in info["ops"].items()),
        "dtypes:  " + ", ".join(f"{k} x{v}" for k, v in info["dtypes"].items()),
        "schemes: " + (", ".join(f"{k} x{v}" for k, v in info["schemes"].items()) or "none (float)"),
        f"parameters:  {info['parameter_files']} files, {info['parameter_bytes']} bytes ({_human(info['parameter_bytes'])})",
        f"activations: {info['activation_files']} files, {info['activation_bytes']} bytes ({_human(info['activation_bytes'])})",
        "",
    ]
    lines = [printable(line) for line in lines]  # names from ir.json: no control characters reach the terminal
    table = [("LAYER", "OP", "DTYPE", "SCHEME", "OUTPUT SHAPE", "PARAM BYTES", "ACT BYTES")]
    for r in info["layers"]:
        table.append(tuple(map(printable, (r["name"], r["op"], r["dtype"], r["scheme"] or "-",
                                           "x".join(map(str, r["output_shape"] or [])) or "-",
                                           r["param_bytes"], r["activation_bytes"]))))
    widths = [min(40, max(len(row[i]) for row in table)) for i in range(len(table[0]))]
    lines += ["  ".join(c[:w].ljust(w) for c, w in zip(row, widths)).rstrip() for row in table]
    return "\n".join(lines)
