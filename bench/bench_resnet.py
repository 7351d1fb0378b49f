"""irgen vs the source runtimes on ResNet-18- and ResNet-50-sized models, side by side in one run.

Cases (``--case``, default all), each timing two subprocesses, alternating:

* ``float``: a ResNet-18-shaped torch network (BasicBlocks [2, 2, 2, 2],
  64..512 channels, BatchNorm, 1x3x224x224, random weights; ``--arch resnet50``:
  ResNet-50's Bottlenecks [3, 4, 6, 3]) exported to ONNX;
  irgen vs ONNX Runtime with every intermediate tensor marked as a graph
  output, each saved as ``.npy`` (the golden-data equivalent of irgen's run);
* ``qdq``: the same network quantized by ``onnxruntime.quantization`` (QDQ,
  per-channel int8), irgen vs ONNX Runtime the same way;
* ``tflite-int8``: a ResNet-18-shaped Keras network as a full-integer TFLite
  model, irgen vs the TFLite interpreter (reference kernels, all tensors
  preserved, each saved as ``.npy``).

Each case also times ``irgen verify`` on irgen's output right after each
generation run (all checks: single, entire and the source runtime; no HTML
report) and prints the verify/generation ratio of median wall times: verify
should take no longer than generating did; ``--each-mode`` also times
``--mode single``, ``entire`` and ``source`` one by one, each against the same
generation run (the target: each, and all three together, at most twice the run).

Each run's wall time and peak RSS come from ``os.wait4`` (the kernel's own
accounting of the finished child; the model is exported in a separate child so
this process stays small, as a child's peak includes its parent's RSS at fork).
Prints min/median per tool and the
irgen/reference ratio of medians; ``--json PATH`` saves every figure.

    python bench/bench_resnet.py [--case float|qdq|tflite-int8] [--arch resnet18|resnet50] [--each-mode]
                                 [--no-cache] [--repeat 3] [--opt-level 3] [--json results.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ORT_SCRIPT = r'''
import sys
from pathlib import Path
import numpy as np
import onnx
import onnxruntime as ort

model_path, x_path, out = sys.argv[1], sys.argv[2], Path(sys.argv[3])
model = onnx.load(model_path)
graph = model.graph
known = {o.name for o in graph.output}
for node in graph.node:
    for name in node.output:
        if name and name not in known:
            graph.output.append(onnx.ValueInfoProto(name=name))
            known.add(name)
opts = ort.SessionOptions()
opts.intra_op_num_threads = int(sys.argv[4]) if len(sys.argv) > 4 else 0
sess = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
x = np.load(x_path)
names = [o.name for o in sess.get_outputs()]
values = sess.run(names, {sess.get_inputs()[0].name: x})
out.mkdir(parents=True, exist_ok=True)
for i, (name, value) in enumerate(zip(names, values)):
    safe = "".join(c if c.isalnum() or c in "._-" else "_" for c in name)
    np.save(out / f"{i:04d}_{safe}.npy", value)
print(len(names), "tensors")
'''


TFLITE_SCRIPT = r'''
import os, sys
from pathlib import Path
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import numpy as np
import tensorflow as tf

model_path, x_path, out = sys.argv[1], sys.argv[2], Path(sys.argv[3])
it = tf.lite.Interpreter(model_path=model_path,
                         experimental_op_resolver_type=tf.lite.experimental.OpResolverType.BUILTIN_REF,
                         experimental_preserve_all_tensors=True)
it.allocate_tensors()
it.set_tensor(it.get_input_details()[0]["index"], np.load(x_path))
it.invoke()
out.mkdir(parents=True, exist_ok=True)
n = 0
for d in it.get_tensor_details():
    try:
        value = it.get_tensor(d["index"])
    except ValueError:
        continue
    safe = "".join(c if c.isalnum() or c in "._-" else "_" for c in d["name"])
    np.save(out / f"{n:04d}_{safe}.npy", value)
    n += 1
print(n, "tensors")
'''


def make_tflite_model(folder: Path) -> tuple[Path, Path]:
    """A ResNet-18-shaped Keras CNN at 1x224x224x3, full-integer int8 TFLite."""
    import os

    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import numpy as np
    import tensorflow as tf

    L = tf.keras.layers
    tf.keras.utils.set_random_seed(0)

    def block(x, c, stride):
        y = L.Conv2D(c, 3, stride, padding="same", activation="relu")(x)
        y = L.Conv2D(c, 3, 1, padding="same")(y)
        if stride != 1 or x.shape[-1] != c:
            x = L.Conv2D(c, 1, stride)(x)
        return L.ReLU()(L.Add()([x, y]))

    inp = L.Input((224, 224, 3), batch_size=1)
    x = L.Conv2D(64, 7, 2, padding="same", activation="relu")(inp)
    x = L.MaxPooling2D(3, 2, padding="same")(x)
    for c, s in [(64, 1), (128, 2), (256, 2), (512, 2)]:
        x = block(block(x, c, s), c, 1)
    x = L.GlobalAveragePooling2D()(x)
    net = tf.keras.Model(inp, L.Dense(1000)(x))
    rng = np.random.default_rng(0)
    conv = tf.lite.TFLiteConverter.from_keras_model(net)
    conv.optimizations = [tf.lite.Optimize.DEFAULT]
    conv.representative_dataset = lambda: ([rng.random((1, 224, 224, 3), dtype=np.float32)] for _ in range(4))
    conv.target_spec.supported_ops = [tf.lite.OpsSet.TFLITE_BUILTINS_INT8]
    conv.inference_input_type = tf.int8
    conv.inference_output_type = tf.int8
    model = folder / "resnet18_int8.tflite"
    model.write_bytes(conv.convert())
    x_path = folder / "x_int8.npy"
    np.save(x_path, rng.integers(-128, 128, (1, 224, 224, 3)).astype(np.int8))
    return model, x_path


#: ``--arch`` -> blocks per stage (BasicBlocks for ResNet-18, Bottlenecks for ResNet-50)
ARCHS = {"resnet18": [2, 2, 2, 2], "resnet50": [3, 4, 6, 3]}
ARCH = "resnet18"
NO_CACHE = False


def make_model(folder: Path) -> tuple[Path, Path]:
    import numpy as np
    import torch
    from torch import nn

    class BasicBlock(nn.Module):
        def __init__(self, cin: int, cout: int, stride: int):
            super().__init__()
            self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
            self.bn1 = nn.BatchNorm2d(cout)
            self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
            self.bn2 = nn.BatchNorm2d(cout)
            self.relu = nn.ReLU()
            self.down = None
            if stride != 1 or cin != cout:
                self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

        def forward(self, x):
            y = self.relu(self.bn1(self.conv1(x)))
            y = self.bn2(self.conv2(y))
            return self.relu(y + (x if self.down is None else self.down(x)))

    class Bottleneck(nn.Module):
        def __init__(self, cin: int, width: int, stride: int):
            super().__init__()
            cout = 4 * width
            self.body = nn.Sequential(
                nn.Conv2d(cin, width, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU(),
                nn.Conv2d(width, width, 3, stride, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU(),
                nn.Conv2d(width, cout, 1, bias=False), nn.BatchNorm2d(cout))
            self.relu = nn.ReLU()
            self.down = None
            if stride != 1 or cin != cout:
                self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

        def forward(self, x):
            return self.relu(self.body(x) + (x if self.down is None else self.down(x)))

    class ResNet(nn.Module):
        def __init__(self, num_classes: int = 1000):
            super().__init__()
            self.stem = nn.Sequential(nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64),
                                      nn.ReLU(), nn.MaxPool2d(3, 2, 1))
            blocks, cin = [], 64
            for (width, stride), count in zip([(64, 1), (128, 2), (256, 2), (512, 2)], ARCHS[ARCH]):
                for k in range(count):
                    block = (Bottleneck(cin, width, stride if k == 0 else 1) if ARCH == "resnet50"
                             else BasicBlock(cin, width, stride if k == 0 else 1))
                    blocks.append(block)
                    cin = 4 * width if ARCH == "resnet50" else width
            self.blocks = nn.Sequential(*blocks)
            self.pool = nn.AdaptiveAvgPool2d(1)
            self.fc = nn.Linear(cin, num_classes)

        def forward(self, x):
            return self.fc(torch.flatten(self.pool(self.blocks(self.stem(x))), 1))

    torch.manual_seed(0)
    net = ResNet().eval()
    with torch.no_grad():  # non-trivial BN statistics
        for m in net.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.uniform_(-0.1, 0.1)
                m.running_var.uniform_(0.5, 1.5)
    x = torch.rand(1, 3, 224, 224)
    model = folder / f"{ARCH}.onnx"
    torch.onnx.export(net, (x,), str(model), input_names=["x"], output_names=["logits"],
                      opset_version=13, dynamo=False)
    x_path = folder / "x.npy"
    np.save(x_path, x.numpy())
    return model, x_path


def timed(argv: list[str], log: Path, ok: tuple[int, ...] = (0,)) -> dict:
    """Run ``argv``; wall seconds, peak RSS (MiB), user+sys CPU from wait4, exit code."""
    with open(log, "ab") as f:
        t0 = time.perf_counter()
        proc = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode not in ok:
        raise SystemExit(f"{argv[0]}: exit code {proc.returncode}; see {log}")
    return {"wall_s": wall, "peak_rss_mib": usage.ru_maxrss / 1024, "cpu_s": usage.ru_utime + usage.ru_stime,
            "exit_code": proc.returncode}


def make_qdq_model(folder: Path) -> tuple[Path, Path]:
    """The float ResNet-18 quantized by onnxruntime.quantization (QDQ, per-channel int8)."""
    import numpy as np
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static

    model, x = make_model(folder)

    class Reader(CalibrationDataReader):
        def __init__(self):
            rng = np.random.default_rng(1)
            self.items = iter([{"x": rng.random((1, 3, 224, 224), dtype=np.float32)} for _ in range(4)])

        def get_next(self):
            return next(self.items, None)

    qmodel = folder / f"{ARCH}_qdq.onnx"
    quantize_static(str(model), str(qmodel), Reader(), quant_format=QuantFormat.QDQ, per_channel=True,
                    activation_type=QuantType.QInt8, weight_type=QuantType.QInt8)
    return qmodel, x


#: case -> (what, model maker, reference tool name, reference script)
CASES = {
    "float": ("ResNet-sized float CNN (--arch), ONNX, 1x3x224x224", make_model, "onnxruntime", ORT_SCRIPT),
    "qdq": ("the same CNN quantized by onnxruntime (QDQ, per-channel int8)", make_qdq_model, "onnxruntime", ORT_SCRIPT),
    "tflite-int8": ("ResNet-18-shaped Keras CNN, full-integer TFLite, 1x224x224x3", make_tflite_model,
                    "tflite-ref", TFLITE_SCRIPT),
}


#: the verify modes ``--each-mode`` times one by one
MODES = ("single", "entire", "source")


def bench_case(case: str, work: Path, repeat: int, opt_level: int, each_mode: bool = False) -> dict:
    what, _, ref_name, script = CASES[case]
    print(f"[{case}] {what}: building in {work} ...", flush=True)
    # in a child: the kernel counts a child's RSS before exec (our own) in its peak,
    # so this process must stay small: no torch, tensorflow or numpy here
    subprocess.run([sys.executable, __file__, "--make-model", str(work), "--case", case, "--arch", ARCH], check=True)
    model, x = (Path(p) for p in (work / "model.txt").read_text().split("\n")[:2])
    ref_script = work / "ref_dump.py"
    ref_script.write_text(script)
    irgen = [sys.executable, "-m", "irgen", "run", str(model), "-o", str(work / "out_irgen"),
             "--input", str(x), "--force", "--no-progress", "--opt-level", str(opt_level), *(["--no-cache"] if NO_CACHE else [])]
    ref = [sys.executable, str(ref_script), str(model), str(x), str(work / "out_ref")]
    verify = [sys.executable, "-m", "irgen", "verify", str(work / "out_irgen"), "--no-report", "--no-progress"]
    modes = [(f"verify-{m}", [*verify, "--mode", m], (0, 1)) for m in MODES] if each_mode else []
    runs: dict[str, list[dict]] = {"irgen": [], ref_name: [], "verify": [], **{name: [] for name, _, _ in modes}}
    for i in range(repeat):
        # verify right after the generation it checks; exit code 1 (a failed check) is reported, not fatal
        for name, argv, ok in (("irgen", irgen, (0,)), ("verify", verify, (0, 1)), *modes, (ref_name, ref, (0,))):
            subprocess.run(["rm", "-rf", str(work / "out_ref")], check=True)
            r = timed(argv, work / f"{name}.log", ok)
            runs[name].append(r)
            print(f"  run {i + 1}/{repeat} {name:11s} {r['wall_s']:7.2f} s  {r['peak_rss_mib']:7.0f} MiB"
                  + (f"  exit {r['exit_code']}" if r["exit_code"] else ""), flush=True)
    subprocess.run(argv, check=True, capture_output=True)  # leave the reference output for the sizes

    def size(p: Path) -> tuple[int, int]:
        files = [f for f in p.rglob("*") if f.is_file()]
        return sum(f.stat().st_size for f in files), len(files)

    sizes = {"irgen": size(work / "out_irgen"), ref_name: size(work / "out_ref")}
    summary = {}
    verify_runs = runs.pop("verify")
    per_mode = {name: runs.pop(name) for name, _, _ in modes}
    verify_summary = {k: {"min": min(r[k] for r in verify_runs), "median": statistics.median(r[k] for r in verify_runs)}
                      for k in ("wall_s", "peak_rss_mib", "cpu_s")}
    verify_ratio = {k: verify_summary[k]["median"] / statistics.median(r[k] for r in runs["irgen"])
                    for k in ("wall_s", "cpu_s")}
    for name, rs in runs.items():
        summary[name] = {
            k: {"min": min(r[k] for r in rs), "median": statistics.median(r[k] for r in rs)}
            for k in ("wall_s", "peak_rss_mib", "cpu_s")
        }
        summary[name]["output_mib"] = sizes[name][0] / 2**20
        summary[name]["output_files"] = sizes[name][1]
    ratio = {k: summary["irgen"][k]["median"] / summary[ref_name][k]["median"] for k in ("wall_s", "peak_rss_mib", "cpu_s")}

    print()
    print(f"[{case}] {'':6s}{'irgen':>22s}{ref_name:>22s}{'ratio':>12s}")
    print(f"{'':14s}{'min':>11s}{'median':>11s}{'min':>11s}{'median':>11s}{'(median)':>12s}")
    for k, label in (("wall_s", "wall [s]"), ("cpu_s", "cpu [s]"), ("peak_rss_mib", "peak RSS [MiB]")):
        i, o = summary["irgen"][k], summary[ref_name][k]
        print(f"{label:14s}{i['min']:11.2f}{i['median']:11.2f}{o['min']:11.2f}{o['median']:11.2f}{ratio[k]:12.2f}")
    print(f"{'output':14s}{summary['irgen']['output_mib']:18.1f} MiB{summary[ref_name]['output_mib']:18.1f} MiB"
          f"   ({sizes['irgen'][1]} vs {sizes[ref_name][1]} files)", flush=True)
    vw = verify_summary["wall_s"]
    print(f"{'verify [s]':14s}{vw['min']:11.2f}{vw['median']:11.2f}   verify/generation: wall {verify_ratio['wall_s']:.2f}, "
          f"cpu {verify_ratio['cpu_s']:.2f}; exit codes {[r['exit_code'] for r in verify_runs]}", flush=True)
    mode_ratio = {}
    for name, rs in per_mode.items():
        mode_ratio[name] = statistics.median(r["wall_s"] for r in rs) / statistics.median(r["wall_s"] for r in runs["irgen"])
        print(f"{name + ' [s]':22s}{min(r['wall_s'] for r in rs):7.2f}{statistics.median(r['wall_s'] for r in rs):11.2f}"
              f"   /generation: wall {mode_ratio[name]:.2f}", flush=True)
    print(flush=True)
    return {"model": what, "reference": ref_name, "runs": runs, "summary": summary,
            "ratio_irgen_over_reference_median": ratio,
            "verify": {"runs": verify_runs, "summary": verify_summary, "ratio_verify_over_generation_median": verify_ratio,
                       "modes": per_mode, "ratio_mode_over_generation_median": mode_ratio}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--case", action="append", choices=sorted(CASES),
                    help="what to compare (repeatable; default: all)")
    ap.add_argument("--repeat", type=int, default=3, help="runs of each tool (default 3)")
    ap.add_argument("--opt-level", type=int, default=3, help="irgen --opt-level (default 3)")
    ap.add_argument("--json", type=Path, help="save the results here")
    ap.add_argument("--keep", type=Path, help="work in this folder and keep it (default: a temp folder)")
    ap.add_argument("--arch", choices=sorted(ARCHS), default="resnet18",
                    help="the ONNX cases' network: ResNet-18 (default) or ResNet-50 (Bottlenecks [3, 4, 6, 3])")
    ap.add_argument("--each-mode", action="store_true",
                    help="also time 'irgen verify --mode single', 'entire' and 'source' one by one")
    ap.add_argument("--no-cache", action="store_true",
                    help="time irgen's runs with --no-cache (a first run: import, compile, execute); by default "
                         "the runs after the first reuse the compile cache")
    ap.add_argument("--make-model", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    global ARCH, NO_CACHE
    ARCH, NO_CACHE = args.arch, args.no_cache
    if args.make_model:
        import warnings

        warnings.simplefilter("ignore")
        model, x = CASES[args.case[0]][1](args.make_model)
        (args.make_model / "model.txt").write_text(f"{model}\n{x}\n")
        return 0

    results = {}
    with tempfile.TemporaryDirectory(prefix="irgen-bench-") as tmp:
        for case in args.case or list(CASES):
            work = (args.keep or Path(tmp)) / case
            work.mkdir(parents=True, exist_ok=True)
            results[case] = bench_case(case, work, args.repeat, args.opt_level, args.each_mode)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({
            "repeat": args.repeat, "opt_level": args.opt_level, "arch": args.arch, "no_cache": args.no_cache,
            "machine": {"python": platform.python_version(), "cpus": os.cpu_count(), "platform": platform.platform()},
            "cases": results,
        }, indent=2) + "\n")
        print(f"saved {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
