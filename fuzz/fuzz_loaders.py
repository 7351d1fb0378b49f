"""Coverage-guided fuzzing (atheris) of irgen's readers of untrusted files.

Each target takes the bytes libFuzzer makes, writes them to a file of the
right kind and hands it to the reader irgen uses on a user's file:

    onnx      the onnx frontend's load (ONNX protobuf -> Relax)
    tflite    the tflite frontend's load (flatbuffer -> Relax)
    pt2       the torch frontend's load of a torch.export archive
    npy       irgen.safeio.load_npy (``--input`` files, golden data read back)
    irjson    irgen verify's ir.json reader
    manifest  irgen verify's manifest.json reader

The only acceptable outcomes are a result or an ``IrgenError`` with a one-line
message; any other exception, a hang (``--timeout``) or a memory blow-up
(``--rss-limit-mb``) is a finding, saved under ``--findings`` as the input
that caused it. Seeds are small valid files made at start.

    pip install atheris==3.0.0
    python fuzz/fuzz_loaders.py --seconds 60              # every target, 60 s each
    python fuzz/fuzz_loaders.py --target onnx --runs 5000

The summary line per target gives the executions run and the findings; the
exit status is 1 when anything was found. Findings become cases of
``tests/test_hostile_*.py`` (made by code there, not kept as files).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

TARGETS = ("onnx", "tflite", "pt2", "npy", "irjson", "manifest")
SUFFIX = {"onnx": ".onnx", "tflite": ".tflite", "pt2": ".pt2", "npy": ".npy", "irjson": ".json", "manifest": ".json"}


# ------------------------------------------------------------------ seeds


def _seed_onnx(folder: Path) -> list[Path]:
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    w = numpy_helper.from_array(np.ones((4, 3, 3, 3), np.float32), "w")
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w"], ["c"], name="conv", pads=[1, 1, 1, 1]),
         helper.make_node("Relu", ["c"], ["r"], name="relu"),
         helper.make_node("MaxPool", ["r"], ["y"], name="pool", kernel_shape=[2, 2], strides=[2, 2])],
        "seed", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 4, 4])], initializer=[w])
    path = folder / "seed.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]), path)
    return [path]


def _seed_tflite(folder: Path) -> list[Path]:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import tensorflow as tf

    inp = tf.keras.Input((8, 8, 3), batch_size=1)
    out = tf.keras.layers.MaxPooling2D()(tf.keras.layers.Conv2D(4, 3, padding="same", activation="relu")(inp))
    model = tf.keras.Model(inp, out)
    path = folder / "seed.tflite"
    path.write_bytes(tf.lite.TFLiteConverter.from_keras_model(model).convert())
    return [path]


def _seed_pt2(folder: Path) -> list[Path]:
    import torch

    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3, padding=1), torch.nn.ReLU()).eval()
    path = folder / "seed.pt2"
    torch.export.save(torch.export.export(model, (torch.zeros(1, 3, 8, 8),)), str(path))
    return [path]


def _seed_npy(folder: Path) -> list[Path]:
    import numpy as np

    paths = []
    for i, arr in enumerate([np.arange(12, dtype=np.float32).reshape(3, 4), np.zeros((2, 2, 2), np.int8),
                             np.array(3.5), np.asfortranarray(np.ones((2, 3), np.float64))]):
        paths.append(folder / f"seed{i}.npy")
        np.save(paths[-1], arr)
    return paths


def _seed_output(folder: Path) -> Path:
    """A real output folder of the onnx seed (for ir.json and manifest.json seeds)."""
    out = folder / "out"
    if not (out / "ir.json").is_file():
        model = _seed_onnx(folder)[0]
        subprocess.run([sys.executable, "-m", "irgen", "run", str(model), "-o", str(out), "--no-progress", "--force"],
                       check=True)
    return out


def make_seeds(target: str, corpus: Path, scratch: Path) -> None:
    corpus.mkdir(parents=True, exist_ok=True)
    if any(corpus.iterdir()):
        return
    if target in ("irjson", "manifest"):
        out = _seed_output(scratch)
        shutil.copy(out / ("ir.json" if target == "irjson" else "manifest.json"), corpus / "seed.json")
        return
    for p in {"onnx": _seed_onnx, "tflite": _seed_tflite, "pt2": _seed_pt2, "npy": _seed_npy}[target](scratch):
        shutil.copy(p, corpus / p.name)


# ------------------------------------------------------------------ targets (run inside the fuzzing process)


def _reader(target: str, scratch: Path):
    """``read(path)`` for ``target``; raises only IrgenError on bad input (else: a finding)."""
    if target == "npy":
        from irgen.safeio import load_npy

        return lambda p: load_npy(p, "array", limit=64 << 20)
    if target in ("irjson", "manifest"):
        from irgen.irfile import read_ir, read_manifest

        out = scratch / "fuzz-out"
        out.mkdir(exist_ok=True)
        name = "ir.json" if target == "irjson" else "manifest.json"
        reader = read_ir if target == "irjson" else read_manifest

        def read(p: Path):
            shutil.copy(p, out / name)
            return reader(out)

        return read
    from irgen.plugins import PluginHost

    host = PluginHost().load(strict=True)
    frontend = host.frontends.get({"onnx": "onnx", "tflite": "tflite", "pt2": "torch"}[target])
    options = {"max_tensor_bytes": 64 << 20, "input_shapes": {}}
    return lambda p: frontend.load(p, dict(options))


def fuzz_one(target: str, args: argparse.Namespace) -> None:
    """Runs in the child: libFuzzer drives ``read`` until --runs or --seconds."""
    import atheris

    with atheris.instrument_imports(include=["irgen", "irgen_onnx", "irgen_tensorflow", "irgen_torch"]):
        from irgen.api import IrgenError

        # the driver's folder, which it removes when this process ends (atheris.Fuzz exits the
        # process itself: nothing after it runs here)
        scratch = Path(args.scratch) if args.scratch else Path(tempfile.mkdtemp(prefix=f"irgen-fuzz-{target}-"))
        read = _reader(target, scratch)
    path = scratch / f"input{SUFFIX[target]}"

    def one_input(data: bytes) -> None:
        path.write_bytes(data)
        try:
            read(path)
        except IrgenError as err:
            if "\n" in str(err):
                raise AssertionError(f"an error message of several lines: {str(err)[:300]!r}") from None

    libfuzzer = [sys.argv[0], str(args.corpus / target), f"-artifact_prefix={args.findings}/{target}-",
                 f"-timeout={args.timeout}", f"-rss_limit_mb={args.rss_limit_mb}", "-print_final_stats=1",
                 f"-max_len={args.max_len}"]
    if args.runs:
        libfuzzer.append(f"-runs={args.runs}")
    if args.seconds:
        libfuzzer.append(f"-max_total_time={args.seconds}")
    atheris.Setup(libfuzzer, one_input)
    atheris.Fuzz()


# ------------------------------------------------------------------ driver


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", choices=(*TARGETS, "all"), default="all")
    parser.add_argument("--runs", type=int, default=0, help="executions per target (0: until --seconds)")
    parser.add_argument("--seconds", type=int, default=60, help="time per target (default 60)")
    parser.add_argument("--timeout", type=int, default=30, help="seconds one input may take before it is a hang")
    parser.add_argument("--rss-limit-mb", type=int, default=4096, help="memory that counts as a blow-up")
    parser.add_argument("--max-len", type=int, default=1 << 20, help="largest input libFuzzer makes")
    parser.add_argument("--corpus", type=Path, default=Path("fuzz/corpus"), help="working corpus (not committed)")
    parser.add_argument("--findings", type=Path, default=Path("fuzz/findings"), help="where crashing inputs go")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--scratch", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.corpus, args.findings = args.corpus.resolve(), args.findings.resolve()
    if args.child:
        fuzz_one(args.child, args)
        return 0
    args.findings.mkdir(parents=True, exist_ok=True)
    targets = TARGETS if args.target == "all" else (args.target,)
    total_runs, total_findings = 0, 0
    for target in targets:
        scratch = Path(tempfile.mkdtemp(prefix=f"irgen-fuzz-seed-{target}-"))
        try:
            make_seeds(target, args.corpus / target, scratch)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        before = set(args.findings.iterdir())
        scratch = Path(tempfile.mkdtemp(prefix=f"irgen-fuzz-{target}-"))
        cmd = [sys.executable, __file__, "--child", target, "--runs", str(args.runs), "--seconds", str(args.seconds),
               "--timeout", str(args.timeout), "--rss-limit-mb", str(args.rss_limit_mb), "--max-len", str(args.max_len),
               "--corpus", str(args.corpus), "--findings", str(args.findings), "--scratch", str(scratch)]
        env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        log = args.findings / f"{target}.log"
        log.write_text(proc.stdout + proc.stderr)
        runs = re.findall(r"stat::number_of_executed_units:\s*(\d+)", proc.stderr)
        done = re.findall(r"Done (\d+) runs", proc.stderr)
        n = int(runs[-1]) if runs else int(done[-1]) if done else 0
        found = sorted(set(args.findings.iterdir()) - before - {log})
        total_runs += n
        total_findings += len(found)
        status = "ok" if not found and proc.returncode == 0 else f"{len(found)} finding(s), exit {proc.returncode}"
        print(f"{target:9s} {n:7d} executions  {status}" + "".join(f"\n    {p}" for p in found), flush=True)
    print(f"total     {total_runs:7d} executions, {total_findings} finding(s)")
    return 1 if total_findings else 0


if __name__ == "__main__":
    sys.exit(main())
