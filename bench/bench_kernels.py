"""Compile and kernel-run time of irgen with its default CPU schedule on vs off, side by side.

Cases (``--case``, default all): the ResNet-18-shaped ``float`` ONNX, ``qdq`` ONNX and
``tflite-int8`` models of ``bench_resnet.py``. For each case and each setting (schedule
on, ``IRGEN_NO_SCHEDULE=1``), alternating, a child process runs ``irgen run`` on the
model (``--no-cache``) and reports:

* ``compile_s``: :func:`irgen.execute.lower` (the Relax passes, the schedule and
  ``relax.build``);
* ``capture_s``: :func:`irgen.vm.run_program` (or :func:`irgen.vm.run`, the VM fallback):
  the kernels with irgen's capture, which writes the activation files;
* ``kernels_s``: the same run once more with a capture that keeps nothing (the kernels
  plus the instrument's bookkeeping);
* ``total_s``: the whole ``irgen run`` in the child.

Prints medians per setting and the off/on ratios (speed-ups); also checks that every
activation file is byte-identical between the two settings. ``--json PATH`` saves it all.

    python bench/bench_kernels.py [--case float|qdq|tflite-int8] [--repeat 1] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent

CHILD = r'''
import json, sys, time
from pathlib import Path
import tvm
from irgen import execute, schedule, vm
from irgen.testing import run_model

model, x, out = sys.argv[1], sys.argv[2], sys.argv[3]
t = {}
lower, run, run_program = execute.lower, vm.run, vm.run_program

def timed_lower(*a, **k):
    t0 = time.perf_counter(); r = lower(*a, **k); t["compile_s"] = time.perf_counter() - t0
    return r

def timed(runner):  # vm.run (the Relax VM) or vm.run_program (irgen's executor): on_output is the last argument
    def wrapped(*a):
        t0 = time.perf_counter(); r = runner(*a); t["capture_s"] = time.perf_counter() - t0
        t0 = time.perf_counter(); runner(*a[:-1], lambda *_: None); t["kernels_s"] = time.perf_counter() - t0
        return r
    return wrapped

execute.lower, vm.run, vm.run_program = timed_lower, timed(run), timed(run_program)
t0 = time.perf_counter()
run_model(model, out, inputs=[x], force=True, args=["--no-cache"])
t["total_s"] = time.perf_counter() - t0
st = schedule.last
t["schedule"] = {k: getattr(st, k) for k in ("functions", "scheduled", "small", "failed", "inlined", "parallel", "vectorized")}
print("RESULT " + json.dumps(t))
'''


def make(case: str, work: Path) -> tuple[Path, Path]:
    if not (work / "model.txt").is_file():
        subprocess.run([sys.executable, str(HERE / "bench_resnet.py"), "--make-model", str(work), "--case", case],
                       check=True)
    model, x = (Path(p) for p in (work / "model.txt").read_text().split("\n")[:2])
    return model, x


def child(model: Path, x: Path, out: Path, on: bool) -> dict:
    env = dict(os.environ)
    env.pop("IRGEN_NO_SCHEDULE", None)
    if not on:
        env["IRGEN_NO_SCHEDULE"] = "1"
    proc = subprocess.run([sys.executable, "-c", CHILD, str(model), str(x), str(out)], env=env,
                          capture_output=True, text=True)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode or not lines:
        raise SystemExit(f"child failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def identical(a: Path, b: Path) -> tuple[int, list[str]]:
    files = sorted(p.relative_to(a) for p in (a / "activations").rglob("*") if p.is_file())
    return len(files), [str(f) for f in files if (a / f).read_bytes() != (b / f).read_bytes()]


KEYS = ("compile_s", "capture_s", "kernels_s", "total_s")


def bench(case: str, work: Path, repeat: int) -> dict:
    model, x = make(case, work)
    runs: dict[str, list[dict]] = {"on": [], "off": []}
    for i in range(repeat):
        for setting in ("off", "on"):
            r = child(model, x, work / f"out_{setting}", setting == "on")
            runs[setting].append(r)
            print(f"[{case}] run {i + 1}/{repeat} schedule {setting:3s} "
                  + "  ".join(f"{k} {r[k]:7.2f}" for k in KEYS), flush=True)
    med = {s: {k: statistics.median(r[k] for r in rs) for k in KEYS} for s, rs in runs.items()}
    speedup = {k: med["off"][k] / med["on"][k] for k in KEYS}
    n, differ = identical(work / "out_on", work / "out_off")
    print(f"[{case}] {'median [s]':12s}" + "".join(f"{k:>12s}" for k in KEYS))
    for s in ("off", "on"):
        print(f"[{case}] {'schedule ' + s:12s}" + "".join(f"{med[s][k]:12.2f}" for k in KEYS))
    print(f"[{case}] {'off/on':12s}" + "".join(f"{speedup[k]:12.2f}" for k in KEYS))
    print(f"[{case}] activation files identical: {n - len(differ)} of {n}; schedule: {runs['on'][-1]['schedule']}\n",
          flush=True)
    return {"runs": runs, "median": med, "ratio_off_over_on": speedup, "files": n, "files_differ": differ}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--case", action="append", choices=("float", "qdq", "tflite-int8"),
                    help="repeatable; default: all")
    ap.add_argument("--repeat", type=int, default=1, help="runs per setting (default 1)")
    ap.add_argument("--keep", type=Path, help="work (and keep models) in this folder")
    ap.add_argument("--json", type=Path, help="save the results here")
    args = ap.parse_args()
    results = {}
    with tempfile.TemporaryDirectory(prefix="irgen-kernels-") as tmp:
        for case in args.case or ["float", "qdq", "tflite-int8"]:
            work = (args.keep or Path(tmp)) / case
            work.mkdir(parents=True, exist_ok=True)
            results[case] = bench(case, work, args.repeat)
    if args.json:
        args.json.write_text(json.dumps({"repeat": args.repeat, "cpus": os.cpu_count(), "cases": results}, indent=2))
        print(f"saved {args.json}")
    return 1 if any(r["files_differ"] for r in results.values()) else 0


if __name__ == "__main__":
    raise SystemExit(main())
