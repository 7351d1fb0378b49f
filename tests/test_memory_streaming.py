"""What keeps ``irgen run`` and ``irgen verify`` from holding a model's weights more than once.

* the ONNX source check lets ONNX Runtime map large initializers from the model's own files
  (the ``.onnx`` itself, or its external data): every tensor equals a plain ONNX Runtime
  session's on the whole model;
* the reference matmul widens a large weight to float64 a block of columns at a time: the
  same values as widening it whole;
* the weight file writes a view that is not contiguous (a transposed weight) a block of rows
  at a time: the same values as the array.

Peak memory and time are measured by ``bench/bench_llm.py``, not here.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

from irgen import reference, spill  # noqa: E402
from irgen_onnx import loader  # noqa: E402
from irgen_onnx.runner import source_runner  # noqa: E402


def _mlp(rng) -> onnx.ModelProto:
    """x[4,96] -> MatMul 96x320 (120 KiB, over DEFER_BYTES) + Add -> Relu -> MatMul 320x40."""
    w1 = rng.standard_normal((96, 320)).astype(np.float32)
    w2 = rng.standard_normal((320, 40)).astype(np.float32)
    assert w1.nbytes > loader.DEFER_BYTES
    inits = [numpy_helper.from_array(w1, "w1"), numpy_helper.from_array(w2, "w2"),
             numpy_helper.from_array(rng.standard_normal(320).astype(np.float32), "b1")]
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h"], name="mm1"),
             helper.make_node("Add", ["h", "b1"], ["hb"], name="add"),
             helper.make_node("Relu", ["hb"], ["r"], name="relu"),
             helper.make_node("MatMul", ["r", "w2"], ["y"], name="mm2")]
    graph = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 96])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 40])], initializer=inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])


def _plain_ort(model: onnx.ModelProto, x: np.ndarray) -> dict[str, np.ndarray]:
    m = onnx.ModelProto()
    m.CopyFrom(model)
    m.graph.output.extend(onnx.ValueInfoProto(name=n) for n in ("h", "hb", "r"))
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    return dict(zip(names, sess.run(names, {"x": x})))


@pytest.mark.parametrize("external", [False, True], ids=["in-the-onnx", "external-data"])
def test_onnx_source_check_maps_weights_from_the_model_files(tmp_path: Path, external: bool):
    rng = np.random.default_rng(5)
    model = _mlp(rng)
    x = rng.standard_normal((4, 96)).astype(np.float32)
    want = _plain_ort(model, x)
    path = tmp_path / "mlp.onnx"
    if external:
        onnx.save_model(model, str(path), save_as_external_data=True, location="mlp.data", size_threshold=1024)
        assert (tmp_path / "mlp.data").stat().st_size > loader.DEFER_BYTES
    else:
        onnx.save_model(model, str(path))
    run = source_runner(path, {})
    got = run({"x": x}, ["h", "hb", "r", "y"])
    assert set(got) == {"h", "hb", "r", "y"}
    for name, value in want.items():
        assert got[name].dtype == value.dtype and np.array_equal(got[name], value), name


def test_reference_matmul_widens_a_large_weight_in_blocks_to_the_same_values(monkeypatch):
    rng = np.random.default_rng(2)
    a = rng.standard_normal((3, 64)).astype(np.float32)
    b = rng.standard_normal((64, 1000)).astype(np.float32)
    whole = np.matmul(a.astype(np.float64), b.astype(np.float64)).astype(np.float32)
    monkeypatch.setattr(reference, "_WIDEN_BYTES", 64 * 8 * 96)  # 96 columns at a time: 11 blocks
    got = reference._matmul(a, b, {})
    assert got.dtype == np.float32 and np.array_equal(got, whole)
    batched = rng.standard_normal((2, 64, 1000)).astype(np.float32)
    assert np.array_equal(reference._matmul(a, batched, {}),
                          np.matmul(a.astype(np.float64), batched.astype(np.float64)).astype(np.float32))


def test_weight_file_writes_a_transposed_view_in_blocks(tmp_path: Path, monkeypatch):
    monkeypatch.setattr(spill, "_BLOCK_BYTES", 4096)
    arr = np.random.default_rng(1).standard_normal((300, 200)).astype(np.float32).T  # not contiguous
    wf = spill.WeightFile(tmp_path)
    try:
        out = wf.array(arr)
        assert out.shape == arr.shape and out.flags.c_contiguous and np.array_equal(out, arr)
    finally:
        wf.close()
