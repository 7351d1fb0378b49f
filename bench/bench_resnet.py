"""irgen vs ONNX Runtime on a ResNet-18-sized CNN, side by side in one run.

Builds a ResNet-18-shaped network in torch (BasicBlocks [2, 2, 2, 2], 64..512
channels, BatchNorm, input 1x3x224x224, random weights, eval mode), exports it
to ONNX in a temporary folder, then times two subprocesses, alternating:

* irgen:  ``irgen run model.onnx -o OUT --input x.npy --force``
* ort:    ONNX Runtime with every intermediate tensor marked as a graph output,
          each saved as ``.npy`` (the golden-data equivalent of irgen's run)

Each run's wall time and peak RSS come from ``os.wait4`` (the kernel's own
accounting of the finished child; the model is exported in a separate child so
this process stays small, as a child's peak includes its parent's RSS at fork).
Prints min/median per tool and the
irgen/ORT ratio of medians; ``--json PATH`` saves every figure.

    python bench/bench_resnet.py [--repeat 3] [--opt-level 3] [--json results.json]
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

    class ResNet18(nn.Module):
        def __init__(self, num_classes: int = 1000):
            super().__init__()
            self.stem = nn.Sequential(nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64),
                                      nn.ReLU(), nn.MaxPool2d(3, 2, 1))
            blocks, cin = [], 64
            for cout, stride in [(64, 1), (128, 2), (256, 2), (512, 2)]:
                blocks += [BasicBlock(cin, cout, stride), BasicBlock(cout, cout, 1)]
                cin = cout
            self.blocks = nn.Sequential(*blocks)
            self.pool = nn.AdaptiveAvgPool2d(1)
            self.fc = nn.Linear(512, num_classes)

        def forward(self, x):
            return self.fc(torch.flatten(self.pool(self.blocks(self.stem(x))), 1))

    torch.manual_seed(0)
    net = ResNet18().eval()
    with torch.no_grad():  # non-trivial BN statistics
        for m in net.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.uniform_(-0.1, 0.1)
                m.running_var.uniform_(0.5, 1.5)
    x = torch.rand(1, 3, 224, 224)
    model = folder / "resnet18.onnx"
    torch.onnx.export(net, (x,), str(model), input_names=["x"], output_names=["logits"],
                      opset_version=13, dynamo=False)
    x_path = folder / "x.npy"
    np.save(x_path, x.numpy())
    return model, x_path


def timed(argv: list[str], log: Path) -> dict:
    """Run ``argv``; wall seconds, peak RSS (MiB), user+sys CPU from wait4."""
    with open(log, "ab") as f:
        t0 = time.perf_counter()
        proc = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise SystemExit(f"{argv[0]}: exit code {proc.returncode}; see {log}")
    return {"wall_s": wall, "peak_rss_mib": usage.ru_maxrss / 1024, "cpu_s": usage.ru_utime + usage.ru_stime}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3, help="runs of each tool (default 3)")
    ap.add_argument("--opt-level", type=int, default=3, help="irgen --opt-level (default 3)")
    ap.add_argument("--json", type=Path, help="save the results here")
    ap.add_argument("--keep", type=Path, help="work in this folder and keep it (default: a temp folder)")
    ap.add_argument("--make-model", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.make_model:
        import warnings

        warnings.simplefilter("ignore", DeprecationWarning)
        make_model(args.make_model)
        return 0

    with tempfile.TemporaryDirectory(prefix="irgen-bench-") as tmp:
        work = args.keep or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        print(f"exporting ResNet-18-sized model to {work} ...", flush=True)
        # in a child: the kernel counts a child's RSS before exec (our own) in its peak,
        # so this process must stay small: no torch, no numpy here
        subprocess.run([sys.executable, __file__, "--make-model", str(work)], check=True)
        model, x = work / "resnet18.onnx", work / "x.npy"
        ort_script = work / "ort_dump.py"
        ort_script.write_text(ORT_SCRIPT)
        irgen = [sys.executable, "-m", "irgen", "run", str(model), "-o", str(work / "out_irgen"),
                 "--input", str(x), "--force", "--no-progress", "--opt-level", str(args.opt_level)]
        ort = [sys.executable, str(ort_script), str(model), str(x), str(work / "out_ort")]
        runs: dict[str, list[dict]] = {"irgen": [], "ort": []}
        for i in range(args.repeat):
            for name, argv in (("irgen", irgen), ("ort", ort)):
                if name == "ort":
                    subprocess.run(["rm", "-rf", str(work / "out_ort")], check=True)
                r = timed(argv, work / f"{name}.log")
                runs[name].append(r)
                print(f"  run {i + 1}/{args.repeat} {name:5s} {r['wall_s']:7.2f} s  {r['peak_rss_mib']:7.0f} MiB",
                      flush=True)

        def size(p: Path) -> int:
            return sum(f.stat().st_size for f in p.rglob("*") if f.is_file())

        sizes = {"irgen": size(work / "out_irgen"), "ort": size(work / "out_ort")}
        files = {"irgen": sum(1 for f in (work / "out_irgen").rglob("*") if f.is_file()),
                 "ort": sum(1 for f in (work / "out_ort").rglob("*") if f.is_file())}

    summary = {}
    for name, rs in runs.items():
        summary[name] = {
            k: {"min": min(r[k] for r in rs), "median": statistics.median(r[k] for r in rs)}
            for k in ("wall_s", "peak_rss_mib", "cpu_s")
        }
        summary[name]["output_mib"] = sizes[name] / 2**20
        summary[name]["output_files"] = files[name]
    ratio = {k: summary["irgen"][k]["median"] / summary["ort"][k]["median"]
             for k in ("wall_s", "peak_rss_mib", "cpu_s")}

    print()
    print(f"{'':14s}{'irgen':>22s}{'onnxruntime':>22s}{'irgen/ORT':>12s}")
    print(f"{'':14s}{'min':>11s}{'median':>11s}{'min':>11s}{'median':>11s}{'(median)':>12s}")
    for k, label in (("wall_s", "wall [s]"), ("cpu_s", "cpu [s]"), ("peak_rss_mib", "peak RSS [MiB]")):
        i, o = summary["irgen"][k], summary["ort"][k]
        print(f"{label:14s}{i['min']:11.2f}{i['median']:11.2f}{o['min']:11.2f}{o['median']:11.2f}{ratio[k]:12.2f}")
    print(f"{'output':14s}{summary['irgen']['output_mib']:18.1f} MiB{summary['ort']['output_mib']:18.1f} MiB"
          f"   ({files['irgen']} vs {files['ort']} files)")

    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({
            "model": "resnet18-like, 1x3x224x224, float32, opset 13",
            "repeat": args.repeat, "opt_level": args.opt_level,
            "machine": {"python": platform.python_version(), "cpus": os.cpu_count(),
                        "platform": platform.platform()},
            "runs": runs, "summary": summary, "ratio_irgen_over_ort_median": ratio,
        }, indent=2) + "\n")
        print(f"saved {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
