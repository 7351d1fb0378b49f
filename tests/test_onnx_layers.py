"""End to end on torch-built ONNX models: every layer's golden data against ONNX Runtime.

For each model and opt level: run ``irgen run`` with a fixed input, then check
- every layer's output activation file against ORT's value of the ONNX tensor
  named in ``layer["source"]["outputs"]`` (those tensors become extra graph outputs);
- the model output file against ORT's model output;
- the numpy reference (``irgen.reference``) recomputes every layer from ir.json,
  parameters/ and the layer's input activation files;
- debug/ files (param dict, graph-executor JSON) and manifest.json checksums.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))
import models  # noqa: E402
from layercheck import assert_close, assert_layers_match  # noqa: E402

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")

from irgen import reference  # noqa: E402
from irgen.cli import main as irgen_main  # noqa: E402


CASES = [
    pytest.param(("small_cnn", 0), id="small_cnn-O0"),
    pytest.param(("small_cnn", 3), id="small_cnn-O3"),
    pytest.param(("mlp", 0), id="mlp-O0"),
    pytest.param(("mlp", 3), id="mlp-O3"),
    # the ResNet-18-sized CNN is slow, as in the torch frontend's tests
    pytest.param(("resnet18", 0), id="resnet18-O0", marks=pytest.mark.slow),
    pytest.param(("resnet18", 3), id="resnet18-O3", marks=pytest.mark.slow),
]


def ort_run(model_path: Path, x: np.ndarray, extra: list[str]) -> dict[str, np.ndarray]:
    """Run ORT with ``extra`` intermediate tensors added as graph outputs."""
    m = onnx.load(str(model_path))
    m = onnx.shape_inference.infer_shapes(m)
    have = {o.name for o in m.graph.output}
    vi = {v.name: v for v in m.graph.value_info}
    for name in extra:
        if name in have:
            continue
        m.graph.output.append(vi[name] if name in vi else onnx.ValueInfoProto(name=name))
        have.add(name)
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    return dict(zip(names, sess.run(names, {sess.get_inputs()[0].name: x})))


@pytest.fixture(scope="module", params=CASES)
def run(request, tmp_path_factory):
    name, opt = request.param
    d = tmp_path_factory.mktemp(f"{name}_O{opt}")
    model_path, x = models.export(name, d)
    np.save(d / "x.npy", x)
    out = d / "out"
    rc = irgen_main(["run", str(model_path), "-o", str(out), "--input", str(d / "x.npy"), "--opt-level", str(opt), "--no-progress",
                     "--debug", "all"])
    assert rc == 0, f"irgen run failed for {name} -O{opt}"
    ir = json.loads((out / "ir.json").read_text())
    extra = sorted({t for layer in ir["layers"] for t in layer["source"].get("outputs", [])})
    ref = ort_run(model_path, x, extra)
    return {"name": name, "opt": opt, "out": out, "ir": ir, "ort": ref, "x": x, "model": model_path}


def test_layers_match_onnxruntime(run):
    out, ir, ref = run["out"], run["ir"], run["ort"]
    assert ir["producer"]["opt_level"] == run["opt"]
    worst = assert_layers_match(out, ir, ref, f"{run['name']} -O{run['opt']}")
    print(f"\n{run['name']} -O{run['opt']}: {len(ir['layers'])} layers, max |irgen - ORT| = {worst:.3g}")


def test_model_output_matches_onnxruntime(run):
    out, ir, ref = run["out"], run["ir"], run["ort"]
    m = onnx.load(str(run["model"]))
    assert [o["name"] for o in ir["outputs"]] == [o.name for o in m.graph.output]
    layers = {layer["name"]: layer for layer in ir["layers"]}
    for rec in ir["outputs"]:
        assert_close(np.load(out / rec["file"]), ref[rec["name"]], f"model output {rec['name']}")
        assert rec["name"] in [o["name"] for o in layers[rec["producer"]]["outputs"]], rec
    # the input file is the input we gave
    np.testing.assert_array_equal(np.load(out / ir["inputs"][0]["file"]), run["x"])


def test_reference_recomputes_every_layer(run):
    out, ir = run["out"], run["ir"]
    worst = 0.0
    for layer in ir["layers"]:
        inputs = reference.load_layer_inputs(out, layer)
        params = reference.load_layer_params(out, layer)
        got = reference.run_layer(layer, inputs, params)
        assert len(got) == len(layer["outputs"])
        for a, rec in zip(got, layer["outputs"]):
            exp = np.load(out / rec["file"])
            assert str(a.dtype) == rec["dtype"], (layer["name"], a.dtype)
            worst = max(worst, assert_close(a, exp, f"reference vs irgen, layer {layer['name']}"))
    print(f"\n{run['name']} -O{run['opt']}: max |reference - irgen| = {worst:.3g}")


def test_debug_files(run):
    tvm = pytest.importorskip("tvm")
    out = run["out"]
    params = tvm.runtime.load_param_dict((out / "debug" / "output_tensors.params").read_bytes())
    assert len(params) > 0
    g = json.loads((out / "debug" / "_tvmdbg_graph_dump.json").read_text())
    for key in ("nodes", "arg_nodes", "heads", "node_row_ptr", "attrs"):
        assert key in g, key
    n = len(g["nodes"])
    n_entries = g["node_row_ptr"][-1]
    assert len(g["node_row_ptr"]) == n + 1
    attrs = g["attrs"]
    for key in ("shape", "dltype", "storage_id"):
        assert key in attrs, key
        assert len(attrs[key]) == 2 and len(attrs[key][1]) == n_entries, key
    assert all(0 <= i < n for i in g["arg_nodes"])
    assert all(0 <= h[0] < n for h in g["heads"])
    # every captured tensor in the param dict has the shape the graph says
    shapes = {}
    for i, node in enumerate(g["nodes"]):
        for k in range(g["node_row_ptr"][i], g["node_row_ptr"][i + 1]):
            shapes.setdefault(node["name"], attrs["shape"][1][k])
    for key, arr in params.items():
        if key in shapes:
            assert list(arr.shape) == list(shapes[key]), key


def test_manifest_checksums(run):
    out = run["out"]
    man = json.loads((out / "manifest.json").read_text())
    listed = {f["path"] for f in man["files"]}
    on_disk = {p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file() and p.name != "manifest.json"}
    assert listed == on_disk
    for f in man["files"]:
        data = (out / f["path"]).read_bytes()
        assert len(data) == f["size"], f["path"]
        assert hashlib.sha256(data).hexdigest() == f["sha256"], f["path"]


def test_auto_pad_becomes_explicit_pads(tmp_path):
    """``auto_pad`` SAME_UPPER / SAME_LOWER (an even kernel, stride 2: the odd pad at the end or
    the start) on a Conv and pools: TVM's importer padded with an opaque call_tir kernel, which
    verify's numpy reference could not recompute (timm's ConvMixer failed verify); now each
    is one padded conv or pool, equal to onnxruntime's."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(5)
    w = numpy_helper.from_array(rng.standard_normal((6, 3, 4, 4)).astype(np.float32), "w")
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], auto_pad="SAME_UPPER", strides=[2, 2]),
             helper.make_node("MaxPool", ["c"], ["m"], auto_pad="SAME_LOWER", kernel_shape=[2, 2], strides=[1, 1]),
             helper.make_node("AveragePool", ["m"], ["y"], auto_pad="SAME_UPPER", kernel_shape=[3, 3], strides=[2, 2])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 11, 11])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], [w])
    path = tmp_path / "same.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]), str(path))
    x = rng.standard_normal((1, 3, 11, 11)).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    out = tmp_path / "out"
    assert irgen_main(["run", str(path), "-o", str(out), "--input", str(tmp_path / "x.npy"), "--no-progress"]) == 0
    ir = json.loads((out / "ir.json").read_text())
    assert not [op for la in ir["layers"] for op in la["fused_ops"] if op["relax_op"] == "relax.call_tir"]
    want = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    assert_close(np.load(out / ir["outputs"][0]["file"]), want, "output")
    assert irgen_main(["verify", str(out), "--no-progress", "--no-report"]) == 0


def test_quantized_size_arithmetic_is_folded_but_not_the_data():
    """``quantize_static`` quantizes float size arithmetic too (timm's TF "same" padding:
    ``Shape`` → ... → Q → DQ → ``Cast`` → ``Pad``) and appends its Q/DQ nodes out of order.
    Such pairs fold to constants where their value only ever becomes a size; a weight's
    DequantizeLinear and a quantized constant that meets the activations (``x * DQ(Q(0.5))``)
    stay for the quantization scheme."""
    from onnx import TensorProto, helper, numpy_helper

    from irgen_onnx.checks import input_specs
    from irgen_onnx.fold import fold_shape_computations

    inits = [numpy_helper.from_array(np.array(v, dt), n) for n, v, dt in [
        ("s", 0.05, np.float32), ("z", 0, np.int8), ("idx", 1, np.int64), ("ax0", [0], np.int64),
        ("w", np.arange(6).reshape(1, 6) - 3, np.int8), ("one", [1], np.int64)]]
    data = [helper.make_node("DequantizeLinear", ["w", "s", "z"], ["wf"], name="w_dq"),
            helper.make_node("Constant", [], ["half"], name="half", value=numpy_helper.from_array(np.array(0.5, np.float32))),
            helper.make_node("Mul", ["x", "half_dq"], ["m"], name="mul"),
            helper.make_node("Add", ["m", "wf"], ["a"], name="add"),
            helper.make_node("Reshape", ["a", "shape"], ["y"], name="reshape")]
    sizes = [helper.make_node("Shape", ["x"], ["sh"], name="shape_of_x"),
             helper.make_node("Gather", ["sh", "idx"], ["n"], name="gather"),
             helper.make_node("Cast", ["n"], ["nf"], name="to_float", to=TensorProto.FLOAT),
             helper.make_node("Unsqueeze", ["nf", "ax0"], ["nu"], name="unsqueeze"),
             helper.make_node("Cast", ["nq_dq"], ["ni"], name="to_int", to=TensorProto.INT64),
             helper.make_node("Concat", ["one", "ni"], ["shape"], name="concat", axis=0)]
    # the quantizer's nodes, appended after their users
    qdq = [helper.make_node("QuantizeLinear", ["nu", "s1", "z"], ["nq"], name="size_q"),
           helper.make_node("DequantizeLinear", ["nq", "s1", "z"], ["nq_dq"], name="size_dq"),
           helper.make_node("QuantizeLinear", ["half", "s", "z"], ["half_q"], name="half_q"),
           helper.make_node("DequantizeLinear", ["half_q", "s", "z"], ["half_dq"], name="half_dq")]
    inits.append(numpy_helper.from_array(np.array(6 / 127, np.float32), "s1"))
    graph = helper.make_graph(data + sizes + qdq, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 6])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, {"x": np.ones((1, 6), np.float32)})[0]
    assert want.shape == (1, 6)  # DQ(Q(6)) = 6.0000005 -> 6: the size ORT computes

    fold_shape_computations(model, input_specs(model, {}, 1 << 30, Path("g.onnx")))
    ops = {n.name: n.op_type for n in model.graph.node}
    assert ops["size_q"] == ops["size_dq"] == ops["to_int"] == ops["concat"] == "Constant"
    shape = next(n for n in model.graph.node if n.output[0] == "shape")
    assert numpy_helper.to_array(shape.attribute[0].t).tolist() == [1, 6]
    assert (ops["w_dq"], ops["half_q"], ops["half_dq"], ops["mul"]) == (
        "DequantizeLinear", "QuantizeLinear", "DequantizeLinear", "Mul")
