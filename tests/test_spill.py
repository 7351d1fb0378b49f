"""Issue 14 (memory flat in the layers): a run's large weights wait in an unnamed file beside
the output (``irgen.spill``), not in memory.

The golden files are the same bytes with the weights on disk and in memory, cached and
not, and equal onnxruntime's; the weight pages are given back once read (checked in
``/proc/self/smaps``); nothing is left beside the output. Peak memory itself is measured by
``bench/bench_speed.py --part memory``, not here.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

from irgen import spill  # noqa: E402
from irgen.cli import main  # noqa: E402
from layercheck import output_files  # noqa: E402

SMAPS = Path("/proc/self/smaps")
pytestmark = pytest.mark.skipif(not SMAPS.exists(), reason="needs Linux's /proc/self/smaps")


def _resident_kib(address: int) -> int:
    """Resident KiB of the mapping holding ``address`` (from /proc/self/smaps)."""
    inside = False
    for line in SMAPS.read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and head == "Rss:":
            return int(line.split()[1])
    raise AssertionError(f"no mapping holds {address:#x}")


def test_a_weight_on_disk_reads_the_same_and_leaves_memory(tmp_path):
    rng = np.random.default_rng(0)
    big = rng.standard_normal((64, 64, 3, 3)).astype(np.float32)
    small = rng.standard_normal(64).astype(np.float32)
    ints = rng.integers(-128, 128, (256, 1024), dtype=np.int8)
    with spill.weights_on_disk(tmp_path) as wf:
        assert wf is not None and spill.active()
        t_big, t_small, t_ints = (spill.weight_tensor(a) for a in (big, small, ints))
        a_big = np.from_dlpack(t_big)
        assert np.array_equal(a_big, big) and np.array_equal(t_small.numpy(), small)
        assert np.array_equal(np.from_dlpack(t_ints), ints)
        assert a_big.ctypes.data % 64 == 0
        assert wf.bytes == big.nbytes + ints.nbytes  # the 256-byte bias stayed in memory
        assert _resident_kib(a_big.ctypes.data) >= big.nbytes // 1024 - 4  # just read: in memory
        from tvm import relax

        spill.release(relax.const(t_big))  # a Relax constant, a tensor or an array: the same pages
        assert _resident_kib(a_big.ctypes.data) == 0
        assert np.array_equal(a_big, big)  # read again from the file
        spill.release_all()
        assert _resident_kib(a_big.ctypes.data) == 0
    assert list(tmp_path.iterdir()) == []  # an unnamed file
    assert not spill.active() and np.array_equal(a_big, big)  # still readable after the run


def test_no_weight_file_without_a_run_or_when_turned_off(tmp_path, monkeypatch):
    big = np.ones((128, 1024), np.float32)
    assert not spill.active()
    assert np.array_equal(spill.weight_tensor(big).numpy(), big)
    monkeypatch.setenv(spill.ENV_OFF, "1")
    with spill.weights_on_disk(tmp_path) as wf:
        assert wf is None and not spill.active()


def _chain(path: Path, n: int = 4, channels: int = 64) -> None:
    """Conv(64x64x3x3, 147 KiB each) + Relu, ``n`` times, then a Gemm whose weight
    constant folding transposes (a weight read during the compile)."""
    rng = np.random.default_rng(11)
    nodes, inits, x = [], [], "x"
    for k in range(n):
        w = (rng.standard_normal((channels, channels, 3, 3)) * 0.06).astype(np.float32)
        inits += [numpy_helper.from_array(w, f"w{k}"),
                  numpy_helper.from_array((rng.standard_normal(channels) * 0.1).astype(np.float32), f"b{k}")]
        nodes += [helper.make_node("Conv", [x, f"w{k}", f"b{k}"], [f"c{k}"], name=f"conv{k}", pads=[1, 1, 1, 1]),
                  helper.make_node("Relu", [f"c{k}"], [f"r{k}"], name=f"relu{k}")]
        x = f"r{k}"
    inits += [numpy_helper.from_array(np.array([1, channels * 64], np.int64), "shape"),
              numpy_helper.from_array((rng.standard_normal((100, channels * 64)) * 0.02).astype(np.float32), "fc_w")]
    nodes += [helper.make_node("Reshape", [x, "shape"], ["flat"], name="flatten"),
              helper.make_node("Gemm", ["flat", "fc_w"], ["y"], name="fc", transB=1)]
    graph = helper.make_graph(nodes, "chain", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, channels, 8, 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 100])], initializer=inits)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]), str(path))


@pytest.mark.parametrize("cached", [False, True], ids=["no-cache", "cache"])
def test_a_run_with_its_weights_on_disk_writes_the_same_bytes(tmp_path, monkeypatch, cached):
    from irgen import execute

    monkeypatch.setattr(execute, "_CACHE", {})
    monkeypatch.setenv("IRGEN_CACHE_DIR", str(tmp_path / "cache"))
    model = tmp_path / "chain.onnx"
    _chain(model)
    x = np.random.default_rng(5).standard_normal((1, 64, 8, 8)).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    opened: list = []
    real = spill.WeightFile

    class Counted(real):
        def __init__(self, folder):
            super().__init__(folder)
            opened.append(self)

    monkeypatch.setattr(spill, "WeightFile", Counted)
    outs = tmp_path / "outs"
    outs.mkdir()
    extra = [] if cached else ["--no-cache"]
    argv = ["run", str(model), "--input", str(tmp_path / "x.npy"), "--no-progress", "--debug", "all", *extra]
    monkeypatch.setenv(spill.ENV_OFF, "1")
    assert main([*argv, "-o", str(outs / "in_memory")]) == 0
    assert not opened
    monkeypatch.delenv(spill.ENV_OFF)
    if cached:  # the first run filled the cache: this one must compile anew
        monkeypatch.setenv("IRGEN_CACHE_DIR", str(tmp_path / "cache2"))
    monkeypatch.setattr(execute, "_CACHE", {})
    assert main([*argv, "-o", str(outs / "on_disk")]) == 0
    assert len(opened) == 1 and opened[0].bytes >= 4 * 147456 + 100 * 4096 * 4  # every conv weight and the FC
    assert sorted(p.name for p in outs.iterdir()) == ["in_memory", "on_disk"]  # nothing left beside them
    a, b = output_files(outs / "in_memory"), output_files(outs / "on_disk")
    assert a.keys() == b.keys() and [k for k in a if a[k] != b[k]] == []
    ir = json.loads((outs / "on_disk" / "ir.json").read_text())
    files = {o["name"]: o["file"] for layer in ir["layers"] for o in layer["outputs"]}
    m = onnx.load(str(model))
    m.graph.output.append(helper.make_tensor_value_info("r0", TensorProto.FLOAT, None))
    sess = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    for name, want in zip(("y", "r0"), sess.run(["y", "r0"], {"x": x})):  # the FC (weight folded) and a conv
        np.testing.assert_allclose(np.load(outs / "on_disk" / files[name]), want, rtol=1e-4, atol=1e-5)
