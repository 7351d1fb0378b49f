"""``irgen inspect OUT``: the IR summary as a table and as JSON, byte counts from the files."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from irgen.cli import main as irgen_main

EXAMPLE = Path(__file__).parents[1] / "examples" / "tiny_cnn.onnx"


@pytest.fixture(scope="module")
def out(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("inspect") / "out"
    assert irgen_main(["run", str(EXAMPLE), "-o", str(out), "--no-progress"]) == 0
    return out


def _bytes(folder: Path) -> tuple[int, int]:
    files = [p for p in folder.rglob("*.npy")]
    return len(files), sum(p.stat().st_size for p in files)


def test_json_counts_match_the_files(out, capsys):
    capsys.readouterr()
    assert irgen_main(["inspect", str(out), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    ir = json.loads((out / "ir.json").read_text())
    assert info["irgen_inspect"] == 2 and info["layer_count"] == len(ir["layers"]) == 10
    assert [r["name"] for r in info["layers"]] == [layer["name"] for layer in ir["layers"]]  # ir.json's names
    assert info["ops"] == dict(Counter(l["op"] for l in ir["layers"]))
    assert info["ops"]["conv2d"] == 4
    assert info["dtypes"] == {"float32": 10} and info["schemes"] == {}
    assert (info["parameter_files"], info["parameter_bytes"]) == _bytes(out / "parameters")
    assert (info["activation_files"], info["activation_bytes"]) == _bytes(out / "activations")
    assert info["parameter_bytes"] == sum(r["param_bytes"] for r in info["layers"])
    assert info["producer"] == ir["producer"] and info["inputs"] == [{"name": "x", "shape": [1, 3, 32, 32], "dtype": "float32"}]
    conv1 = info["layers"][0]
    assert conv1["name"] == "conv1_Conv" and conv1["output_shape"] == [1, 8, 32, 32]
    assert conv1["param_bytes"] == sum((out / r["file"]).stat().st_size for r in ir["layers"][0]["params"].values())
    assert conv1["activation_bytes"] == (out / ir["layers"][0]["outputs"][0]["file"]).stat().st_size


def test_table(out, capsys):
    capsys.readouterr()
    assert irgen_main(["inspect", str(out)]) == 0
    text = capsys.readouterr().out
    _, pbytes = _bytes(out / "parameters")
    assert f"parameters:  10 files, {pbytes} bytes" in text
    assert "ops:     conv2d x4," in text and "schemes: none (float)" in text
    rows = [line.split() for line in text.splitlines() if line.startswith(("conv1_Conv ", "fc_Gemm "))]
    assert rows[0][:5] == ["conv1_Conv", "conv2d", "float32", "-", "1x8x32x32"]
    assert rows[1][:5] == ["fc_Gemm", "dense", "float32", "-", "1x10"]


def test_quantized_schemes_and_errors(tmp_path, capsys):
    tflite_models = pytest.importorskip("tflite_models")
    path, _ = tflite_models.export("mlp", tmp_path, "int8")
    assert irgen_main(["run", str(path), "-o", str(tmp_path / "out"), "--no-progress"]) == 0
    capsys.readouterr()
    assert irgen_main(["inspect", str(tmp_path / "out"), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["schemes"] == {"tflite-int8": 3} and info["dtypes"] == {"int8": 3} and info["ops"] == {"dense": 3}
    assert irgen_main(["inspect", str(tmp_path / "nothing")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("irgen: error:") and "no ir.json" in err


def test_inspect_into_a_closed_pipe_is_quiet(tmp_path):
    """``irgen inspect OUT | head -1``: the reader is gone before irgen writes; irgen
    stops quietly (exit 141, as a process killed by SIGPIPE), no traceback."""
    import os
    import subprocess
    import sys

    import models

    path, _ = models.export("small_cnn", tmp_path)
    out = tmp_path / "out"
    assert irgen_main(["run", str(path), "-o", str(out), "--no-progress"]) == 0
    r, w = os.pipe()
    os.close(r)  # nobody will read: every write fails with EPIPE
    try:
        proc = subprocess.run([sys.executable, "-m", "irgen", "inspect", str(out)], stdout=w, stderr=subprocess.PIPE,
                              text=True)
    finally:
        os.close(w)
    assert proc.returncode == 141, proc.stderr
    assert "Traceback" not in proc.stderr and "BrokenPipe" not in proc.stderr, proc.stderr


def test_an_inputs_output_is_inspected_and_verified_sample_by_sample(tmp_path, capsys):
    """``irgen run --inputs`` writes one folder per sample: inspect summarizes each and verify
    checks each (exit 1 naming a sample whose golden data is wrong)."""
    samples = tmp_path / "samples"
    samples.mkdir()
    for k in range(2):
        np.save(samples / f"s{k}.npy", np.random.default_rng(k).standard_normal((1, 3, 32, 32)).astype(np.float32))
    out = tmp_path / "out"
    assert irgen_main(["run", str(EXAMPLE), "-o", str(out), "--inputs", str(samples), "--no-progress"]) == 0
    capsys.readouterr()
    assert irgen_main(["inspect", str(out), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert sorted(info["samples"]) == ["s0", "s1"]
    assert all(s["layer_count"] == 10 for s in info["samples"].values())
    assert irgen_main(["verify", str(out), "--json", "--mode", "single", "--no-progress", "--no-report"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["passed"] and sorted(result["samples"]) == ["s0", "s1"]
    # one sample's golden output changed: that sample fails, the other passes
    ir = json.loads((out / "s1" / "ir.json").read_text())
    last = out / "s1" / ir["layers"][-1]["outputs"][0]["file"]
    np.save(last, np.load(last) + np.float32(1))
    assert irgen_main(["verify", str(out), "--mode", "single", "--no-progress", "--no-report"]) == 1
    text = capsys.readouterr().out
    assert "2 samples: 1 passed, 1 failed (s1)" in text
