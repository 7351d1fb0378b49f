"""ONNX Runtime's dynamically quantized LSTM (``quantize_dynamic`` -> ``com.microsoft.DynamicQuantizeLSTM``,
issue 39): each step a layer computing ONNX Runtime's arithmetic, bit for bit (irgen_onnx.dynamic_lstm).

* ``test_torch_lstm``: seeded torch LSTMs (forward; bidirectional with initial states) exported
  as ONNX and quantized by ``quantize_dynamic`` per tensor and per channel: ``irgen run``, then
  ``irgen verify`` in all modes, every layer compared with ONNX Runtime and passing with
  every value equal (``exact_share`` 1.0 in the numpy reference, the golden run and the source
  check); the model outputs equal ONNX Runtime's (one intra-op thread) to the bit; each step's
  golden ``h`` equals the step of ONNX Runtime's own ``Y`` to the bit.
* ``test_onnx_attributes``: nodes built with ``onnx.helper``, then quantized (direction
  reverse with ``clip`` and initial states, per channel; bidirectional, per tensor), and the
  same node with uint8 weights and a zero point of 128 (another writer's form): all bit-exact.
* ``test_stepped_states_are_the_node_own``: the source runner's per-step states (the node run one
  step at a time, its input widened by the sequence's minimum and maximum over zero weight
  rows) equal the full node's ``Y`` and ``Y_c``, bit for bit.
* ``test_mlas_activations``: the declared approximations (:data:`irgen_onnx.dynamic_lstm.LOGISTIC`,
  ``TANH``), evaluated by the numpy reference and by the golden run's TIR kernel, equal ONNX
  Runtime's ``Sigmoid`` and ``Tanh`` (MLAS's kernels) on 400k values, bit for bit.
* ``test_gru_stays_float``: ``quantize_dynamic`` leaves a GRU (and an RNN) in float: it still
  imports and verifies.
* ``test_refused``: non-default activations, and int8 weights with a non-zero zero point, say why.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
quantization = pytest.importorskip("onnxruntime.quantization")
pytest.importorskip("tvm")
sys.path.insert(0, str(Path(__file__).parent))
from test_recurrent import (STEPS, _case, _export, _saved, check_cells, onnx_recurrent,  # noqa: E402
                            run_verify)

from irgen.cli import main as irgen_main  # noqa: E402
from irgen.testing import verify  # noqa: E402
from irgen.verify import MODES  # noqa: E402


def _quantize(src: Path, dst: Path, per_channel: bool) -> Path:
    quantization.quantize_dynamic(str(src), str(dst), per_channel=per_channel,
                                  weight_type=quantization.QuantType.QInt8)
    assert [n.op_type for n in onnx.load(str(dst)).graph.node if "LSTM" in n.op_type] == ["DynamicQuantizeLSTM"]
    return dst


def _ort(path: Path, feeds: dict, outputs: list[str] | None = None) -> dict[str, np.ndarray]:
    """ONNX Runtime's values of ``outputs`` (default: the graph outputs), one intra-op thread."""
    model = onnx.load(str(path))
    have = {o.name for o in model.graph.output}
    model.graph.output.extend(onnx.ValueInfoProto(name=n) for n in outputs or [] if n not in have)
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    return dict(zip(names, sess.run(names, feeds)))


def _bits(a) -> np.ndarray:
    return np.ascontiguousarray(a, np.float32).view(np.int32)


def check_exact(path: Path, feeds: dict, d: Path, dirs: int) -> dict:
    """``irgen run`` + ``irgen verify`` (all modes); every value equal to ONNX Runtime's."""
    ir, out = run_verify(path, feeds, d)
    check_cells(ir, "lstm", 1, dirs, STEPS)
    result = verify(out, modes=MODES)
    for row in result["layers"]:
        for mode, m in row["checks"].items():
            assert m["exact_share"] == 1.0, (row["name"], mode, m)
    node = next(n for n in onnx.load(str(path)).graph.node if n.op_type == "DynamicQuantizeLSTM")
    want = _ort(path, feeds, [node.output[0]])
    for rec in ir["outputs"]:
        assert np.array_equal(_bits(np.load(out / rec["file"])), _bits(want[rec["name"]])), rec["name"]
    y = want[node.output[0]]  # [T, D, B, H]: ONNX Runtime's own h of every step
    for cell in ir["layers"]:
        if cell["op"] == "lstm":
            h = next(o for o in cell["outputs"] if o["name"].split(":")[-1].startswith("h"))
            _, d_, t = (int(v) for v in h["name"].split("[")[1].rstrip("]").split(","))
            assert np.array_equal(_bits(np.load(out / h["file"])), _bits(y[t, d_])), h["name"]
    return ir


@pytest.mark.parametrize("bidirectional,per_channel", [(False, False), (True, True)],
                         ids=["forward-per-tensor", "bidirectional-h0-per-channel"])
def test_torch_lstm(bidirectional, per_channel, tmp_path):
    model, inputs = _case("lstm", 1, bidirectional, False, states=bidirectional)
    path = _quantize(_export(model, inputs, tmp_path, "onnx"), tmp_path / "q.onnx", per_channel)
    ir = check_exact(path, {k: v.numpy() for k, v in inputs.items()}, tmp_path, 2 if bidirectional else 1)
    cell = next(layer for layer in ir["layers"] if layer["op"] == "lstm")
    assert cell["params"]["weight"]["dtype"] == "int8" and cell["quant"] is None
    ops = [f["relax_op"] for f in cell["fused_ops"]]
    assert {"relax.min", "relax.max", "relax.round", "relax.matmul", "relax.sigmoid", "relax.tanh"} <= set(ops)
    assert all(f["attrs"]["approximation"]["rule"].startswith("ONNX Runtime's Mlas") for f in cell["fused_ops"]
               if f["relax_op"] in ("relax.sigmoid", "relax.tanh"))


def _uint8_weights(path: Path, dst: Path) -> Path:
    """The node with uint8 weights ``w + 128`` and zero points 128 (the same integers)."""
    from onnx import numpy_helper

    model = onnx.load(str(path))
    node = next(n for n in model.graph.node if n.op_type == "DynamicQuantizeLSTM")
    inits = {i.name: i for i in model.graph.initializer}
    for w, zp in ((node.input[1], node.input[9]), (node.input[2], node.input[11])):
        q = numpy_helper.to_array(inits[w])
        inits[w].CopyFrom(numpy_helper.from_array((q.astype(np.int16) + 128).astype(np.uint8), w))
        inits[zp].CopyFrom(numpy_helper.from_array(np.full(inits[zp].dims, 128, np.uint8), zp))
    onnx.save(model, str(dst))
    return dst


@pytest.mark.parametrize("name", ["reverse-clip-h0-per-channel", "bidirectional-per-tensor", "uint8"])
def test_onnx_attributes(name, tmp_path):
    kwargs = {"direction": "bidirectional"} if name.startswith("bi") else \
        {"direction": "reverse", "clip": 0.5, "states": True}
    model, feeds = onnx_recurrent(**kwargs)
    onnx.save(model, tmp_path / "f.onnx")
    path = _quantize(tmp_path / "f.onnx", tmp_path / "q.onnx", per_channel="per-channel" in name or name == "uint8")
    if name == "uint8":
        path = _uint8_weights(path, tmp_path / "u.onnx")
    ir = check_exact(path, feeds, tmp_path, 2 if name.startswith("bi") else 1)
    cell = next(layer for layer in ir["layers"] if layer["op"] == "lstm")
    assert cell["attrs"]["clip"] == kwargs.get("clip")
    assert cell["params"]["weight"]["dtype"] == ("int16" if name == "uint8" else "int8")


def test_stepped_states_are_the_node_own(tmp_path):
    from irgen_onnx.recurrent import step_states

    model, feeds = onnx_recurrent(direction="bidirectional", states=True)
    onnx.save(model, tmp_path / "f.onnx")
    path = _quantize(tmp_path / "f.onnx", tmp_path / "q.onnx", per_channel=True)
    m = onnx.load(str(path))
    node = m.graph.node[0]
    values = {i.name: onnx.numpy_helper.to_array(i) for i in m.graph.initializer} | feeds
    states = step_states(m, node, values)
    want = _ort(path, feeds, list(node.output))
    y, y_c = want[node.output[0]], want[node.output[2]]
    assert np.array_equal(_bits(np.moveaxis(states["h"][0], 1, 0)), _bits(y))
    assert np.array_equal(_bits(states["c"][0, 0, -1]), _bits(y_c[0]))
    assert np.array_equal(_bits(states["c"][0, 1, 0]), _bits(y_c[1]))


def test_mlas_activations():
    import tvm
    from irgen_onnx.dynamic_lstm import LOGISTIC, TANH, _kernel
    from onnx import TensorProto, helper

    from irgen.reference import rational_fma

    rng = np.random.default_rng(0)
    x = np.concatenate([rng.standard_normal(200_000) * 6, rng.uniform(-25, 25, 200_000),
                        np.linspace(-20, 20, 8_001)]).astype(np.float32)
    for op, spec in (("Sigmoid", LOGISTIC), ("Tanh", TANH)):
        graph = helper.make_graph([helper.make_node(op, ["x"], ["y"])], "g",
                                  [helper.make_tensor_value_info("x", TensorProto.FLOAT, [x.size])],
                                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, [x.size])])
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
        want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
        got = rational_fma(x, spec)
        assert np.array_equal(_bits(got), _bits(want)), (op, int((_bits(got) != _bits(want)).sum()))
        kernel = tvm.compile(_kernel([x.size], spec), target="llvm")  # the golden run's kernel
        y = tvm.runtime.tensor(np.zeros_like(x))
        kernel(tvm.runtime.tensor(x), y)
        assert np.array_equal(_bits(y.numpy()), _bits(want)), op


@pytest.mark.parametrize("op", ["GRU", "RNN"])
def test_gru_stays_float(op, tmp_path):
    model, feeds = onnx_recurrent(op, "bidirectional", states=True)
    onnx.save(model, tmp_path / "f.onnx")
    quantization.quantize_dynamic(str(tmp_path / "f.onnx"), str(tmp_path / "q.onnx"), per_channel=True)
    assert [n.op_type for n in onnx.load(str(tmp_path / "q.onnx")).graph.node] == [op]
    ir, _ = run_verify(tmp_path / "q.onnx", feeds, tmp_path)
    check_cells(ir, op.lower(), 1, 2, STEPS)


def test_refused(tmp_path, capsys):
    from onnx import numpy_helper

    model, feeds = onnx_recurrent(activations=["Sigmoid", "Tanh", "Relu"])
    onnx.save(model, tmp_path / "f.onnx")
    acts = _quantize(tmp_path / "f.onnx", tmp_path / "acts.onnx", per_channel=False)
    onnx.save(onnx_recurrent()[0], tmp_path / "plain.onnx")  # the same inputs
    m = onnx.load(str(_quantize(tmp_path / "plain.onnx", tmp_path / "q.onnx", per_channel=False)))
    zp = next(i for i in m.graph.initializer if i.name == m.graph.node[0].input[9])
    zp.CopyFrom(numpy_helper.from_array(np.full(zp.dims, 3, np.int8), zp.name))
    onnx.save(m, tmp_path / "zp.onnx")
    args = [a for k in feeds for a in ("--input", f"{k}={_saved(tmp_path, k, feeds)}")]
    for path, message in ((acts, "activations ['sigmoid', 'tanh', 'relu'] are not supported"),
                          (tmp_path / "zp.onnx", "int8 W weights with a non-zero zero point")):
        capsys.readouterr()
        assert irgen_main(["run", str(path), "-o", str(tmp_path / path.stem), *args, "--no-progress"]) != 0
        err = capsys.readouterr().err
        assert message in err and "(DynamicQuantizeLSTM)" in err, err
