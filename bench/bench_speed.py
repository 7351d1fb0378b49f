"""Issue 14's acceptance figures, side by side in one run: irgen vs the source runtimes.

Parts (``--part``, repeatable; default all), every figure a median of ``--repeat`` runs
(whole processes; wall time and peak RSS from ``os.wait4``, as in ``bench_resnet.py``):

* ``float``: ResNet-18-shaped float ONNX at 1x3x224x224 (``bench_resnet.make_model``):
  ``irgen run`` cold (a fresh, empty ``IRGEN_CACHE_DIR`` for every run) and warm (the
  cache the first cold run filled) vs ONNX Runtime dumping every tensor as ``.npy``
  (``bench_resnet.ORT_SCRIPT``). Targets: cold <= 4x, warm <= 1.5x.
* ``qdq``: the same network quantized by onnxruntime (QDQ). Targets: cold <= 6x, warm <= 2x.
* ``tflite``: the ResNet-18-shaped full-integer TFLite model vs the TFLite interpreter's
  dump (``bench_resnet.TFLITE_SCRIPT``). Target <= 3x, judged for cold and warm each.
* ``tiny``: the bundled ``examples/tiny_cnn.onnx``, cold. Target: under 3 s.
* ``many``: ``--samples`` inputs (default 64; ResNet-18 float, or with ``--quick`` 16 through
  ``tiny_cnn.onnx``) through ``irgen run --inputs DIR`` with ``-j 2`` vs ``-j 1``, both from a
  warm cache (compile excluded equally). Targets: speed-up (j1 wall / j2 wall) >= 1.7x;
  per-sample cost (j2 wall / samples) <= 1.5x ONNX Runtime's per-sample cost (one process
  dumping every tensor of every sample, wall / samples). Checks byte identity of
  ``--identity`` samples (default 3) against single ``irgen run --input`` runs, and of every
  sample between ``-j 1`` and ``-j 2``: every file, manifest.json without its command/cwd.
* ``memory``: peak RSS of ``irgen run`` (cold, and warm: capture only) of a 50- and a
  500-layer chain of conv3x3(64->64)+relu on 1x64x32x32 (built with onnx.helper; weights
  147,712 bytes a layer). Target: the RSS difference is less than the difference of the
  weight bytes, judged for cold and warm each.

Every target is printed PASS or MISS; a failing run prints the tail of its log and the
bench goes on (its figures are missing, its targets MISS). ``--json`` is rewritten after
every part, so a bench stopped midway leaves what it measured.

    python bench/bench_speed.py [--quick] [--repeat 3] [--part many] [--json /tmp/bench_speed.json]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_resnet import ORT_SCRIPT, TFLITE_SCRIPT, timed  # noqa: E402  (no heavy imports at its top)

BENCH_RESNET = Path(__file__).resolve().parent / "bench_resnet.py"
TINY = Path(__file__).resolve().parent.parent / "examples" / "tiny_cnn.onnx"

#: ONNX Runtime dumping every tensor of every sample of a folder (one session, one process):
#: ORT_SCRIPT's loading and output marking (its second argument is the samples folder here)
ORT_MANY_SCRIPT = ORT_SCRIPT[:ORT_SCRIPT.index("opts = ort.SessionOptions()")] + r'''
samples = Path(x_path)
sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
names = [o.name for o in sess.get_outputs()]
safe = ["".join(c if c.isalnum() or c in "._-" else "_" for c in n) for n in names]
files = sorted(samples.glob("*.npy"))
for f in files:
    values = sess.run(names, {sess.get_inputs()[0].name: np.load(f)})
    folder = out / f.stem
    folder.mkdir(parents=True, exist_ok=True)
    for i, (s, value) in enumerate(zip(safe, values)):
        np.save(folder / f"{i:04d}_{s}.npy", value)
print(len(files), "samples,", len(names), "tensors each")
'''

#: (label, measured-key, limit, "<=" or "<" or ">=")
TARGETS = {
    "float": [("cold / onnxruntime", "cold_ratio", 4.0, "<="), ("warm / onnxruntime", "warm_ratio", 1.5, "<=")],
    "qdq": [("cold / onnxruntime", "cold_ratio", 6.0, "<="), ("warm / onnxruntime", "warm_ratio", 2.0, "<=")],
    "tflite": [("cold / tflite interpreter", "cold_ratio", 3.0, "<="),
               ("warm / tflite interpreter", "warm_ratio", 3.0, "<=")],
}


class _AnyCode:
    """Every exit code is accepted by ``timed``: failures are reported here, not fatal."""

    def __contains__(self, code) -> bool:
        return True


_counter = [0]


def measure(argv: list[str], work: Path, label: str, env: dict[str, str] | None = None) -> dict:
    """``timed(argv)`` with ``env`` added to the environment; a failure prints its log's tail."""
    _counter[0] += 1
    log = work / "logs" / f"{_counter[0]:03d}_{label}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    saved = {k: os.environ.get(k) for k in env or {}}
    os.environ.update(env or {})
    try:
        r = timed(argv, log, _AnyCode())
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    r["log"] = str(log)
    r["text"] = log.read_text(errors="replace")
    if r["exit_code"] != 0:
        tail = "\n".join(r["text"].rstrip().splitlines()[-15:])
        print(f"    !! {label}: exit code {r['exit_code']} ({' '.join(argv[:6])} ...); log tail:\n"
              + "\n".join("       | " + line for line in tail.splitlines()), flush=True)
    return r


def show(label: str, r: dict, note: str = "") -> None:
    print(f"    {label:24s} {r['wall_s']:8.2f} s {r['peak_rss_mib']:8.0f} MiB"
          + (f"  exit {r['exit_code']}" if r["exit_code"] else "") + (f"  {note}" if note else ""), flush=True)


def median(runs: list[dict], key: str = "wall_s") -> float | None:
    ok = [r[key] for r in runs if r["exit_code"] == 0]
    return statistics.median(ok) if ok else None


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def judge(label: str, value: float | None, limit: float, op: str, unit: str = "x") -> dict:
    ok = value is not None and {"<=": value <= limit, "<": value < limit, ">=": value >= limit}[op]
    shown = "n/a (failed runs)" if value is None else f"{value:.2f}{unit}"
    print(f"  {'PASS' if ok else 'MISS'}  {label}: {shown}  (target {op} {limit:g}{unit})", flush=True)
    return {"target": label, "value": value, "limit": limit, "op": op, "unit": unit, "pass": ok}


def cache_state(cache: Path) -> dict[str, tuple[int, int]]:
    """entry name -> (inode, mtime_ns) of a compile cache folder's entries."""
    if not cache.is_dir():
        return {}
    return {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in cache.iterdir() if not p.name.startswith(".")}


def cached_run(argv: list[str], work: Path, label: str, cache: Path) -> dict:
    """``measure`` with ``IRGEN_CACHE_DIR=cache``; ``from_cache``: the run read an entry
    (the cache marks a read entry recently used, in place; a store renames a new folder in:
    a new inode), and stored none."""
    before = cache_state(cache)
    r = measure(argv, work, label, {"IRGEN_CACHE_DIR": str(cache)})
    after = cache_state(cache)
    r["from_cache"] = bool(before) and after.keys() == before.keys() and any(
        after[k][0] == before[k][0] and after[k][1] != before[k][1] for k in before)
    return r


def warm_run(argv: list[str], work: Path, label: str, cache: Path, out: Path) -> dict:
    """``cached_run``, once more when it compiled anew: the cache key holds a digest of irgen's
    and the plugins' code, so an edit in this checkout between the runs (other engineers work in
    it) makes a new key; the first run has filled the cache under it. The retry is reported."""
    r = cached_run(argv, work, label, cache)
    if r["exit_code"] == 0 and not r["from_cache"]:
        show(f"{label} (compiled anew)", r, "(!! the cache key changed: the code was edited; once more)")
        rm(out)
        first = r
        r = cached_run(argv, work, label, cache)
        r["after_a_compile"] = {k: first[k] for k in ("wall_s", "peak_rss_mib", "log")}
    return r


def irgen_run(model: Path, out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "irgen", "run", str(model), "-o", str(out), "--force", "--no-progress", *extra]


def rm(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


def strip(runs: list[dict]) -> list[dict]:
    """The runs without their log text (the JSON keeps the log path)."""
    return [{k: v for k, v in r.items() if k != "text"} for r in runs]


def built(work: Path, kind: str, *extra: str) -> list[str]:
    """Build a model (or samples) in a child (so this process stays small: a child's peak RSS
    counts its parent's at fork) and return the lines of the model.txt it writes."""
    work.mkdir(parents=True, exist_ok=True)
    if not (work / "model.txt").exists():
        if kind in ("float", "qdq", "tflite-int8"):
            argv = [sys.executable, str(BENCH_RESNET), "--make-model", str(work), "--case", kind]
        else:
            argv = [sys.executable, __file__, "--make", kind, str(work), *extra]
        log = work / "build.log"
        with open(log, "wb") as f:
            done = subprocess.run(argv, stdout=f, stderr=subprocess.STDOUT, env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"})
        if done.returncode:
            print("    !! building failed; log tail:\n" + "\n".join(
                "       | " + line for line in log.read_text(errors="replace").splitlines()[-15:]), flush=True)
            done.check_returncode()
    return (work / "model.txt").read_text().split("\n")


def cold_warm(work: Path, model: Path, x: Path | None, repeat: int, ref_argv: list[str] | None,
              ref_name: str) -> dict:
    """Per repetition: the reference, ``irgen run`` cold (a fresh, empty cache folder), then warm
    (the cache the first cold run filled)."""
    extra = ["--input", str(x)] if x else []
    out = work / "out_irgen"
    warm_cache = work / "cache_warm"
    rm(warm_cache)
    runs: dict[str, list[dict]] = {ref_name: [], "cold": [], "warm": []} if ref_argv else {"cold": [], "warm": []}
    for i in range(repeat):
        if ref_argv:
            rm(work / "out_ref")
            r = measure(ref_argv, work, ref_name)
            runs[ref_name].append(r)
            show(f"run {i + 1}/{repeat} {ref_name}", r)
            rm(work / "out_ref")
        cold_cache = work / "cache_cold"
        rm(cold_cache)
        rm(out)
        r = cached_run(irgen_run(model, out, *extra), work, "cold", cold_cache)
        runs["cold"].append(r)
        show(f"run {i + 1}/{repeat} irgen cold", r)
        if not warm_cache.exists() and r["exit_code"] == 0:
            cold_cache.rename(warm_cache)  # the first cold run fills the warm runs' cache
        rm(cold_cache)
        rm(out)
        r = warm_run(irgen_run(model, out, *extra), work, "warm", warm_cache, out)
        runs["warm"].append(r)
        show(f"run {i + 1}/{repeat} irgen warm", r, "" if r["from_cache"] or r["exit_code"] else "(!! compiled anew)")
    rm(out)
    rm(warm_cache)
    # a warm run that compiled anew (the code digest in the cache key changed: someone edited
    # irgen or a plugin in this checkout meanwhile) is no warm run: left out of the medians, counted
    anew = [r for r in runs["warm"] if r["exit_code"] == 0 and not r["from_cache"]]
    if anew:
        print(f"  !! {len(anew)} of {repeat} warm runs compiled anew (a changed cache key): left out of the medians")
    timed_runs = {**runs, "warm": [r for r in runs["warm"] if r not in anew]}
    res = {"runs": {k: strip(v) for k, v in runs.items()},
           "median_wall_s": {k: median(v) for k, v in timed_runs.items()},
           "median_peak_rss_mib": {k: median(v, "peak_rss_mib") for k, v in timed_runs.items()},
           "warm_runs_from_cache": sum(r["from_cache"] for r in runs["warm"]), "warm_runs_compiled_anew": len(anew)}
    if ref_argv:
        res["cold_ratio"] = ratio(res["median_wall_s"]["cold"], res["median_wall_s"][ref_name])
        res["warm_ratio"] = ratio(res["median_wall_s"]["warm"], res["median_wall_s"][ref_name])
    return res


def part_compare(part: str, root: Path, repeat: int) -> dict:
    kind = {"float": "float", "qdq": "qdq", "tflite": "tflite-int8"}[part]
    work = root / part
    model, x = (Path(p) for p in built(work, kind)[:2])
    ref_name, script = ("tflite", TFLITE_SCRIPT) if part == "tflite" else ("onnxruntime", ORT_SCRIPT)
    (work / "ref_dump.py").write_text(script)
    ref = [sys.executable, str(work / "ref_dump.py"), str(model), str(x), str(work / "out_ref")]
    res = cold_warm(work, model, x, repeat, ref, ref_name)
    m = res["median_wall_s"]
    print("  medians: " + ", ".join(f"{k} {'n/a' if v is None else f'{v:.2f} s'}" for k, v in m.items())
          + f"  (warm runs from the cache: {res['warm_runs_from_cache']}/{repeat})")
    res["targets"] = [judge(label, res[key], limit, op) for label, key, limit, op in TARGETS[part]]
    return res


def part_tiny(root: Path, repeat: int) -> dict:
    work = root / "tiny"
    work.mkdir(parents=True, exist_ok=True)
    res = cold_warm(work, TINY, None, repeat, None, "")
    m = res["median_wall_s"]
    print("  medians: " + ", ".join(f"{k} {'n/a' if v is None else f'{v:.2f} s'}" for k, v in m.items()))
    res["targets"] = [judge("tiny_cnn.onnx cold", res["median_wall_s"]["cold"], 3.0, "<", " s")]
    return res


def tree_digest(folder: Path) -> dict[str, str]:
    """rel path -> sha256 of every file; manifest.json without its command and cwd."""
    out = {}
    for p in sorted(folder.rglob("*")):
        if not p.is_file():
            continue
        data = p.read_bytes()
        if p.name == "manifest.json":
            doc = json.loads(data)
            doc.pop("command", None)
            doc.pop("cwd", None)
            data = json.dumps(doc, sort_keys=True).encode()
        out[str(p.relative_to(folder))] = hashlib.sha256(data).hexdigest()
    return out


def diff_digests(a: dict[str, str], b: dict[str, str]) -> dict:
    differ = sorted(k for k in a.keys() & b.keys() if a[k] != b[k])
    return {"files": len(a), "only_first": sorted(a.keys() - b.keys())[:10], "only_second": sorted(b.keys() - a.keys())[:10],
            "differ": differ[:10], "n_differ": len(differ),
            "identical": a == b and len(a) > 0}


def part_many(root: Path, repeat: int, quick: bool, n: int, n_identity: int) -> dict:
    work = root / "many"
    if quick:
        model, what = TINY, "examples/tiny_cnn.onnx"
    else:
        model, what = Path(built(root / "float", "float")[0]), "ResNet-18-shaped float ONNX, 1x3x224x224"
    samples = work / f"samples_{model.stem}_{n}" / "npy"
    built(samples.parent, "samples", "--model", str(model), "--n", str(n))
    names = sorted(p.stem for p in samples.glob("*.npy"))
    print(f"  {len(names)} samples through {what}", flush=True)
    cache = work / "cache"
    rm(cache)
    fill = cached_run(irgen_run(model, work / "out_fill"), work, "fill", cache)
    show("fill the cache", fill)
    # one run's output is about one sample's folder times the samples: never fill the disk
    need = len(names) * sum(p.stat().st_size for p in (work / "out_fill").rglob("*") if p.is_file())
    free = shutil.disk_usage(work).free
    rm(work / "out_fill")
    print(f"  disk: {free / 2**30:.1f} GiB free, about {need / 2**30:.1f} GiB needed", flush=True)
    if free < 1.25 * need:
        raise OSError(f"not measured: {len(names)} samples need about {need / 2**30:.1f} GiB of disk and "
                      f"{free / 2**30:.1f} GiB are free (give fewer with --samples)")
    (work / "ort_many.py").write_text(ORT_MANY_SCRIPT)
    ort = [sys.executable, str(work / "ort_many.py"), str(model), str(samples), str(work / "out_ort")]
    picks = sorted({names[k * (len(names) - 1) // max(1, n_identity - 1)] for k in range(n_identity)}) if names else []
    runs: dict[str, list[dict]] = {"j1": [], "j2": [], "onnxruntime": []}
    digests: dict[str, dict[str, str]] = {}
    out_bytes = {}
    for i in range(repeat):
        last = i == repeat - 1
        for j in ("j1", "j2"):
            out = work / f"out_{j}"
            rm(out)
            rm(out)
            r = warm_run(irgen_run(model, out, "--inputs", str(samples), "-j", j[1:]), work, j, cache, out)
            runs[j].append(r)
            show(f"run {i + 1}/{repeat} irgen -j {j[1:]}", r,
                 "" if r["from_cache"] or r["exit_code"] else "(!! compiled anew)")
            if last and r["exit_code"] == 0:
                digests[j] = tree_digest(out)
                out_bytes[j] = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
                if j == "j2":  # keep only the samples compared with single runs (disk space)
                    for p in out.iterdir():
                        if p.name not in picks:
                            rm(p) if p.is_dir() else p.unlink()
            if not (last and j == "j2"):
                rm(out)
        rm(work / "out_ort")
        r = measure(ort, work, "onnxruntime")
        runs["onnxruntime"].append(r)
        show(f"run {i + 1}/{repeat} onnxruntime", r)
        rm(work / "out_ort")
    m = {k: median(v) for k, v in runs.items()}
    res = {"model": what, "samples": len(names), "runs": {k: strip(v) for k, v in runs.items()},
           "fill": strip([fill])[0], "median_wall_s": m, "output_bytes": out_bytes,
           "speedup_j2_over_j1": ratio(m["j1"], m["j2"]),
           "per_sample_s": {k: (v / len(names) if v is not None else None) for k, v in m.items()}}
    res["per_sample_ratio_j2"] = ratio(m["j2"], m["onnxruntime"])
    res["per_sample_ratio_j1"] = ratio(m["j1"], m["onnxruntime"])
    ps = res["per_sample_s"]
    fmt = lambda v: "n/a" if v is None else f"{v * 1000:.0f} ms"  # noqa: E731
    print(f"  per sample: -j 1 {fmt(ps['j1'])}, -j 2 {fmt(ps['j2'])}, onnxruntime {fmt(ps['onnxruntime'])}")

    # byte identity: j1 vs j2 (every sample), and some samples vs single `irgen run --input` runs
    identity = {}
    if "j1" in digests and "j2" in digests:
        identity["j1_vs_j2"] = diff_digests(digests["j1"], digests["j2"])
        print(f"  -j 1 vs -j 2, all {len(names)} samples: {identity['j1_vs_j2']['files']} files, "
              f"{'identical' if identity['j1_vs_j2']['identical'] else 'DIFFERENT: ' + json.dumps(identity['j1_vs_j2'])}")
    out_j2 = work / "out_j2"
    if out_j2.is_dir():
        for name in picks:
            single = work / "single"
            rm(single)
            r = cached_run(irgen_run(model, single, "--input", str(samples / f"{name}.npy")), work, "single", cache)
            if r["exit_code"] == 0:
                d = diff_digests(tree_digest(out_j2 / name), tree_digest(single))
            else:
                d = {"identical": False, "error": f"exit code {r['exit_code']}, see {r['log']}"}
            identity[f"single_{name}"] = d
            print(f"  sample {name} (-j 2) vs a single run --input: "
                  f"{d.get('files', 0)} files, {'identical' if d['identical'] else 'DIFFERENT: ' + json.dumps(d)}",
                  flush=True)
            rm(single)
    rm(out_j2)
    rm(work / "cache")
    res["identity"] = identity
    res["targets"] = [
        judge(f"-j 2 speed-up over -j 1 ({len(names)} samples)", res["speedup_j2_over_j1"], 1.7, ">="),
        judge("per-sample cost, -j 2 / onnxruntime", res["per_sample_ratio_j2"], 1.5, "<="),
    ]
    ok_ident = bool(identity) and all(d.get("identical") for d in identity.values()) \
        and len(identity) == len(picks) + 1
    print(f"  {'PASS' if ok_ident else 'MISS'}  byte identity (-j 1 = -j 2 for every sample; "
          f"{len(picks)} samples = single runs)")
    res["targets"].append({"target": "byte identity", "value": ok_ident, "pass": ok_ident})
    return res


def part_memory(root: Path, repeat: int) -> dict:
    res: dict = {"models": {}}
    for layers in (50, 500):
        work = root / f"chain{layers}"
        model, _, weight_bytes = built(work, "chain", "--layers", str(layers))[:3]
        res["models"][layers] = {"weight_bytes": int(weight_bytes), **cold_warm(work, Path(model), None, repeat, None, "")}
    a, b = res["models"][50], res["models"][500]
    weight_diff = (b["weight_bytes"] - a["weight_bytes"]) / 2**20
    print(f"  weights: 50 layers {a['weight_bytes'] / 2**20:.1f} MiB, 500 layers {b['weight_bytes'] / 2**20:.1f} MiB")
    res["weight_diff_mib"], res["rss_diff_mib"], res["targets"] = weight_diff, {}, []
    for kind in ("cold", "warm"):
        pa, pb = a["median_peak_rss_mib"][kind], b["median_peak_rss_mib"][kind]
        diff = None if None in (pa, pb) else pb - pa
        res["rss_diff_mib"][kind] = diff
        print(f"  peak RSS {kind}: 50 layers {pa} MiB, 500 layers {pb} MiB")
        res["targets"].append(judge(f"peak RSS {kind}, 500 - 50 layers (weights differ by {weight_diff:.1f} MiB)",
                                    diff, weight_diff, "<", " MiB"))
    return res


# ---------------------------------------------------------------- children: models and samples

def make_chain(folder: Path, layers: int) -> None:
    """conv3x3(64->64, pad 1)+relu, ``layers`` times, on 1x64x32x32; float32 weights."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(layers)
    nodes, inits, x = [], [], "x"
    for k in range(layers):
        w = (rng.standard_normal((64, 64, 3, 3)) * np.sqrt(2 / 576)).astype(np.float32)
        b = (rng.standard_normal(64) * 0.01).astype(np.float32)
        inits += [numpy_helper.from_array(w, f"w{k}"), numpy_helper.from_array(b, f"b{k}")]
        nodes += [helper.make_node("Conv", [x, f"w{k}", f"b{k}"], [f"c{k}"], pads=[1, 1, 1, 1]),
                  helper.make_node("Relu", [f"c{k}"], [f"r{k}"])]
        x = f"r{k}"
    graph = helper.make_graph(nodes, f"chain{layers}",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 64, 32, 32])],
                              [helper.make_tensor_value_info(x, TensorProto.FLOAT, [1, 64, 32, 32])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    onnx.checker.check_model(model)
    path = folder / f"chain{layers}.onnx"
    onnx.save(model, str(path))
    weight_bytes = sum(numpy_helper.to_array(t).nbytes for t in inits)
    (folder / "model.txt").write_text(f"{path}\n\n{weight_bytes}\n")


def make_samples(folder: Path, model: Path, n: int) -> None:
    """``n`` random float32 samples of the model's (one) input, npy/s000.npy ..."""
    import numpy as np
    import onnx

    g = onnx.load(str(model)).graph
    inits = {t.name for t in g.initializer}
    inp = [i for i in g.input if i.name not in inits][0]
    shape = [d.dim_value or 1 for d in inp.type.tensor_type.shape.dim]
    rng = np.random.default_rng(14)
    (folder / "npy").mkdir(exist_ok=True)
    for k in range(n):
        np.save(folder / "npy" / f"s{k:03d}.npy", rng.random(shape, dtype=np.float32))
    (folder / "model.txt").write_text(f"{model}\n\n{n}\n")


def snapshot(root: Path) -> str:
    """``git archive HEAD`` of this checkout under ``root/snapshot``; the PYTHONPATH that makes
    irgen and its plugins import from it (before the editable installs, whose finders come
    last), so that edits others make in the shared checkout during the bench change neither
    the code measured nor the compile cache's key. The entry points stay the installed ones."""
    repo = Path(__file__).resolve().parent.parent
    dest = root / "snapshot"
    rm(dest)
    dest.mkdir(parents=True)
    archive = subprocess.run(["git", "archive", "HEAD"], cwd=repo, check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    paths = [dest / "core"] + sorted(p.parent for p in (dest / "plugins").rglob("pyproject.toml"))
    return os.pathsep.join(str(p) for p in paths)


def compile_bytecode(folders: list[Path]) -> None:
    """The ``.pyc`` files of irgen's and the plugins' sources, as ``pip install`` writes them
    for a package it installs (not editable): an editable checkout run with
    PYTHONDONTWRITEBYTECODE=1 (this machine's default) compiles every module it imports
    from source at every start instead (0.3-0.7 s). TVM, numpy and onnx have theirs."""
    subprocess.run([sys.executable, "-m", "compileall", "-q", *map(str, folders)], check=True,
                   stdout=subprocess.DEVNULL)


def warm_up() -> None:
    """Import each tool's libraries once, untimed: the first figure of a bench is not then the
    one that reads TVM's, onnxruntime's and TensorFlow's shared libraries from disk into the
    page cache (the 'tiny' part, first, measured 3.15 s against 2.2 s in the next run)."""
    code = "import numpy, onnx, onnxruntime, tvm, tvm.relax.frontend.onnx\ntry:\n import tensorflow\nexcept ImportError:\n pass"
    subprocess.run([sys.executable, "-c", code], check=False, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                   env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"})
    print("warmed up: the tools' libraries imported once, untimed", flush=True)


def main() -> int:
    parts = ["tiny", "float", "qdq", "many", "memory", "tflite"]  # the slowest last
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", action="append", choices=parts, help="what to measure (repeatable; default: all)")
    ap.add_argument("--repeat", type=int, default=None, help="runs of each command (default 3; 1 with --quick)")
    ap.add_argument("--quick", action="store_true",
                    help="1 repeat; 16 samples through tiny_cnn.onnx for the many-inputs part")
    ap.add_argument("--samples", type=int, default=None, help="samples for the many-inputs part (default 64; 16 quick)")
    ap.add_argument("--identity", type=int, default=3, help="samples compared with single runs (default 3)")
    ap.add_argument("--json", type=Path, help="save the results here (rewritten after every part)")
    ap.add_argument("--keep", type=Path, help="work in this folder and keep the models (default: a temp folder)")
    ap.add_argument("--snapshot", action="store_true",
                    help="measure the committed code (git archive HEAD) instead of the working tree")
    ap.add_argument("--make", nargs=2, metavar=("KIND", "DIR"), help=argparse.SUPPRESS)
    ap.add_argument("--layers", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--model", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--n", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.make:
        kind, folder = args.make[0], Path(args.make[1])
        if kind == "chain":
            make_chain(folder, args.layers)
        else:
            make_samples(folder, args.model, args.n)
        return 0

    repeat = args.repeat or (1 if args.quick else 3)
    n = args.samples or (16 if args.quick else 64)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__file__).parent).stdout.strip()
    doc = {"repeat": repeat, "quick": args.quick, "commit": commit,
           "env": {k: os.environ.get(k) for k in ("IRGEN_NO_SCHEDULE", "TVM_NUM_THREADS", "OMP_NUM_THREADS")},
           "machine": {"python": platform.python_version(), "cpus": os.cpu_count(), "platform": platform.platform(),
                       "loadavg_at_start": os.getloadavg()},
           "parts": {}}
    print(f"bench_speed: repeat {repeat}, commit {commit}, load average {os.getloadavg()[0]:.1f} "
          f"on {os.cpu_count()} cpus", flush=True)
    with tempfile.TemporaryDirectory(prefix="irgen-speed-") as tmp:
        root = args.keep or Path(tmp)
        if args.snapshot:
            os.environ["PYTHONPATH"] = doc["snapshot"] = snapshot(root)
            print(f"measuring the code of commit {commit} (PYTHONPATH={os.environ['PYTHONPATH']})", flush=True)
            compile_bytecode([root / "snapshot"])
        else:
            repo = Path(__file__).resolve().parent.parent
            compile_bytecode([repo / "core", repo / "plugins"])
        print("irgen's modules compiled to bytecode first, as pip install does", flush=True)
        warm_up()
        for part in args.part or parts:
            print(f"\n[{part}]", flush=True)
            try:
                if part in ("float", "qdq", "tflite"):
                    res = part_compare(part, root, repeat)
                elif part == "tiny":
                    res = part_tiny(root, repeat)
                elif part == "many":
                    res = part_many(root, repeat, args.quick, n, args.identity)
                else:
                    res = part_memory(root, repeat)
            except (subprocess.CalledProcessError, OSError, ValueError, KeyError) as err:
                print(f"  !! [{part}] could not be measured: {type(err).__name__}: {err}", flush=True)
                res = {"error": f"{type(err).__name__}: {err}", "targets": [{"target": part, "pass": False}]}
            doc["parts"][part] = res
            if args.json:
                args.json.parent.mkdir(parents=True, exist_ok=True)
                args.json.write_text(json.dumps(doc, indent=2, default=str) + "\n")

    print("\nsummary")
    for part, res in doc["parts"].items():
        for t in res["targets"]:
            v = t.get("value")
            shown = "n/a" if v is None else (f"{v:.2f}{t.get('unit', '')}" if isinstance(v, float) else str(v))
            limit = f"  (target {t['op']} {t['limit']:g}{t.get('unit', '')})" if "limit" in t else ""
            print(f"  {'PASS' if t['pass'] else 'MISS'}  [{part}] {t['target']}: {shown}{limit}")
    if args.json:
        print(f"saved {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
