"""Issue 37's timing target: ``irgen compare`` of a 300-layer model's dump takes no more than
twice ``irgen verify`` on the same OUT.

The model is a chain of ``--layers`` (default 300) conv3x3 + bias + relu layers on
1x``--channels``x``--size``x``--size`` (built with onnx.helper), quantized by onnxruntime
(QDQ, per-channel int8; ``--float`` keeps it float). ``irgen run`` writes OUT once; then,
each a median of ``--repeat`` whole processes (wall time):

* ``irgen verify OUT --no-report`` (every check: single, entire, source);
* ``irgen compare OUT DUMP --no-report`` of a dump the simulated device of the tests
  (``tests/device_sim.py``) writes with a rounding bug (floor) in the middle layer: every
  layer after it differs and is recomputed from the device's inputs (inherited), the
  faulty one is diagnosed; and of an identical dump.

It prints each time and the ratio compare / verify, PASS when it is at most 2.

    python bench/bench_compare.py [--layers 300] [--repeat 3] [--float] [--keep DIR]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))


def make_model(path: Path, layers: int, channels: int, size: int) -> Path:
    """A chain of conv3x3(channels->channels, padding 1) + relu, seeded weights."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    nodes, inits, prev = [], [], "x"
    for i in range(layers):
        w = (rng.standard_normal((channels, channels, 3, 3)) * (1.2 / np.sqrt(9 * channels))).astype(np.float32)
        b = (rng.standard_normal(channels) * 0.05).astype(np.float32)
        inits += [numpy_helper.from_array(w, f"w{i}"), numpy_helper.from_array(b, f"b{i}")]
        nodes.append(helper.make_node("Conv", [prev, f"w{i}", f"b{i}"], [f"c{i}"], name=f"conv{i}", pads=[1, 1, 1, 1]))
        nodes.append(helper.make_node("Relu", [f"c{i}"], [f"r{i}"], name=f"relu{i}"))
        prev = f"r{i}"
    graph = helper.make_graph(nodes, "chain", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, channels, size, size])],
                              [helper.make_tensor_value_info(prev, TensorProto.FLOAT, [1, channels, size, size])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    onnx.save(model, str(path))
    return path


def quantize(src: Path, dst: Path, channels: int, size: int) -> Path:
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static

    class Reader(CalibrationDataReader):
        def __init__(self):
            self.it = iter([{"x": np.random.default_rng(k).standard_normal((1, channels, size, size)).astype(np.float32)}
                            for k in range(4)])

        def get_next(self):
            return next(self.it, None)

    quantize_static(str(src), str(dst), Reader(), quant_format=QuantFormat.QDQ, per_channel=True,
                    activation_type=QuantType.QInt8, weight_type=QuantType.QInt8)
    return dst


def timed(args: list[str], expect: tuple[int, ...]) -> float:
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "irgen", *args], capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    if done.returncode not in expect:
        sys.exit(f"irgen {' '.join(args)} exited {done.returncode}:\n{done.stderr[-2000:]}")
    return seconds


def floor_fault(ctx):
    from device_sim import requantized

    return requantized(ctx, rnd=np.floor) if ctx.layer.get("quant") else [np.floor(ctx.outputs[0] * 64) / 64]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=300)
    ap.add_argument("--channels", type=int, default=8)
    ap.add_argument("--size", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--float", action="store_true", help="keep the model float (no QDQ)")
    ap.add_argument("--keep", type=Path, default=None, help="work in DIR and keep it")
    args = ap.parse_args()
    work = args.keep or Path(tempfile.mkdtemp(prefix="bench_compare_"))
    work.mkdir(parents=True, exist_ok=True)
    model = make_model(work / "chain.onnx", args.layers, args.channels, args.size)
    if not args.float:
        model = quantize(model, work / "chain_qdq.onnx", args.channels, args.size)
    out = work / "out"
    timed(["run", str(model), "-o", str(out), "--force", "--no-progress"], (0,))
    from device_sim import write_dump
    from irgen.verify import load_ir

    layers = load_ir(out)["layers"]
    middle = next(l["name"] for l in layers[len(layers) // 2:] if l["op"] == "conv2d")
    write_dump(out, work / "same")
    write_dump(out, work / "dump", {middle: floor_fault})
    figures = {}
    for what, argv, expect in (
            ("verify", ["verify", str(out), "--no-report", "--no-progress"], (0,)),
            ("compare (fault in the middle)", ["compare", str(out), str(work / "dump"), "--no-report", "--no-progress"], (1,)),
            ("compare (identical dump)", ["compare", str(out), str(work / "same"), "--no-report", "--no-progress"], (0,))):
        runs = [timed(argv, expect) for _ in range(args.repeat)]
        figures[what] = statistics.median(runs)
        print(f"{what:<32} {figures[what]:7.2f} s  (median of {args.repeat}: {', '.join(f'{r:.2f}' for r in runs)})")
    ratio = figures["compare (fault in the middle)"] / figures["verify"]
    print(f"{len(layers)} layers ({'float' if args.float else 'QDQ int8'}), fault at {middle}: "
          f"compare / verify = {ratio:.2f} (target <= 2): {'PASS' if ratio <= 2 else 'MISS'}")
    return 0 if ratio <= 2 else 1


if __name__ == "__main__":
    raise SystemExit(main())
