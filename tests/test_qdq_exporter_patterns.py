"""What exporters and ``quantize_static`` write around transformers' weights and indices.

* A parameter used twice: the TorchScript exporter reads it again through an ``Identity``
  (ALBERT's shared layers, tied embeddings) and ``quantize_static`` quantizes that output
  as an activation: ``DequantizeLinear(w) -> Identity -> QuantizeLinear -> DequantizeLinear
  -> MatMul``. irgen refused: "weights ... is not a dequantized integer constant".
* Position ids computed from the token ids (RoBERTa: ``Equal -> Not -> Cast -> CumSum``) and
  gathers of both: the index arithmetic TVM's importer adds before a gather (negative
  indices wrapped) was grouped with the layer before it, so verify compared that layer's
  first output, the word ids, with the ``Not`` tensor of onnxruntime (120 "LSB").

Each model is quantized by onnxruntime, run and verified against onnxruntime's own run:
every layer equal to it.
"""

from __future__ import annotations

import io
import json
import contextlib
from pathlib import Path

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

from irgen.cli import main  # noqa: E402


def _shared_weight():
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array((rng.standard_normal((8, 8)) * 0.3).astype(np.float32), "W")
    nodes = [helper.make_node("MatMul", ["x", "W"], ["h"], name="mm1"),
             helper.make_node("Relu", ["h"], ["r"], name="relu"),
             helper.make_node("Identity", ["W"], ["W_again"], name="reuse"),
             helper.make_node("MatMul", ["r", "W_again"], ["y"], name="mm2")]
    graph = helper.make_graph(nodes, "shared", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 8])], initializer=[w])
    return graph, "x", lambda k: np.random.default_rng(k).standard_normal((1, 4, 8)).astype(np.float32)


def _position_gathers():
    rng = np.random.default_rng(1)
    inits = [numpy_helper.from_array(rng.standard_normal((16, 8)).astype(np.float32), "W"),
             numpy_helper.from_array(rng.standard_normal((8, 8)).astype(np.float32), "P"),
             numpy_helper.from_array(np.array(1, np.int64), "one")]
    nodes = [helper.make_node("Equal", ["ids", "one"], ["eq"], name="eq"),
             helper.make_node("Not", ["eq"], ["ne"], name="not"),
             helper.make_node("Cast", ["ne"], ["m"], name="cast", to=TensorProto.INT64),
             helper.make_node("CumSum", ["m", "one"], ["pos_ids"], name="cumsum"),
             helper.make_node("Gather", ["W", "ids"], ["we"], name="word"),
             helper.make_node("Gather", ["P", "pos_ids"], ["pe"], name="pos"),
             helper.make_node("Add", ["we", "pe"], ["y"], name="add")]
    graph = helper.make_graph(nodes, "gathers", [helper.make_tensor_value_info("ids", TensorProto.INT64, [1, 6])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 6, 8])], initializer=inits)
    return graph, "ids", lambda k: np.random.default_rng(k).integers(0, 7, (1, 6)).astype(np.int64)


def _quantized(tmp_path: Path, build) -> tuple[Path, Path]:
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, quantize_static

    graph, name, sample = build()
    float_path, path = tmp_path / "float.onnx", tmp_path / "qdq.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(float_path))

    class Reader(CalibrationDataReader):
        def __init__(self):
            self.it = iter([{name: sample(k)} for k in range(4)])

        def get_next(self):
            return next(self.it, None)

    with contextlib.redirect_stdout(io.StringIO()):
        quantize_static(str(float_path), str(path), Reader(), quant_format=QuantFormat.QDQ)
    x = tmp_path / "x.npy"
    np.save(x, sample(99))
    return path, x


def _run_and_verify(tmp_path: Path, path: Path, x: Path, capsys) -> dict:
    out = tmp_path / "out"
    assert main(["run", str(path), "-o", str(out), "--input", str(x), "--no-progress"]) == 0
    capsys.readouterr()
    code = main(["verify", str(out), "--json", "--no-report", "--no-progress"])
    report = json.loads(capsys.readouterr().out)
    assert code == 0, [p for p in report.get("problems", [])]
    return report


def test_a_weight_read_again_through_identity(tmp_path, capsys):
    path, x = _quantized(tmp_path, _shared_weight)
    q = onnx.load(str(path))
    # the pattern: the Identity's output quantized as an activation
    assert any(n.op_type == "QuantizeLinear" and n.input[0] == "W_again" for n in q.graph.node)
    report = _run_and_verify(tmp_path, path, x, capsys)
    ir = json.loads((tmp_path / "out" / "ir.json").read_text())
    dense = [layer for layer in ir["layers"] if layer["quant"] and layer["quant"].get("kind") == "dense"]
    assert len(dense) == 2  # both MatMuls are integer layers with integer weights
    source = [row["checks"]["source"] for row in report["layers"] if "source" in row["checks"]]
    assert source and all(c.get("status") == "pass" and c.get("exact") for c in source), source


def test_index_arithmetic_before_a_gather_stays_with_the_gather(tmp_path, capsys):
    path, x = _quantized(tmp_path, _position_gathers)
    report = _run_and_verify(tmp_path, path, x, capsys)
    ir = json.loads((tmp_path / "out" / "ir.json").read_text())
    by_name = {layer["name"]: layer for layer in ir["layers"]}
    not_layer = next(layer for layer in ir["layers"] if layer["op"] == "logical_not")
    assert [o["dtype"] for o in not_layer["outputs"]] == ["bool"], not_layer["outputs"]  # its own output only
    source = {row["name"]: row["checks"]["source"] for row in report["layers"] if "source" in row["checks"]}
    assert len(source) == len(by_name) and all(c.get("status") == "pass" and c.get("exact") for c in source.values()), source
