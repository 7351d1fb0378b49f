"""What third-party quantization toolkits write around an ONNX QDQ model (issue 36).

Each case starts from the same ``quantize_static`` QDQ model (the small CNN of
:mod:`models`, per-channel int8 weights) and rewrites it the way a toolkit writes
its files; ONNX Runtime computes every rewrite to the same values, so irgen must
too: ``irgen run`` then ``irgen verify`` against onnxruntime's exact integer kernels
pass with every integer layer equal (0 LSB), and the golden model output equals
onnxruntime's.

* ``unsorted``: nodes out of topological order (AMD Quark's XINT8/NPU passes append a
  node after its readers; onnxruntime sorts on load, ``onnx.checker`` refuses);
* ``narrow_clip``: each int8 weight goes through ``Clip(-127, 127)`` before its
  DequantizeLinear (Brevitas' ``export_onnx_qcdq``, narrow range);
* ``q_of_float``: each weight is a float initializer quantized by a QuantizeLinear
  whose zero point is an ``Identity`` of an int8 initializer (NNCF after
  ``nncf.strip``); onnxruntime folds the constant subgraph on load.

Rewrites that change which node units onnxruntime fuses (so not always its values); irgen
must reproduce what onnxruntime then computes, its integer kernels bit for bit, and the node
units it runs in float within verify's float-span tolerance:

* ``unquantized_moves``: the Q/DQ pairs after the MaxPool and the Transpose dropped (NNCF,
  Brevitas, INC quantize a MaxPool's input only): onnxruntime propagates the input's pair
  past them (the same values);
* ``move_beside_a_quantize``: a Conv reads a Transpose's float output that a QuantizeLinear
  reads too (Brevitas' MaxPool before a residual): no pair is propagated, the Conv is float;
* ``float_classifier``: the classifier (Flatten, Gemm with per-channel weights, Softmax) left
  in float, the model output unquantized (NNCF's Gemm);
* ``unfolded_batchnorm``: a BatchNormalization and a Relu between a quantized Conv and its
  QuantizeLinear (NNCF's torch backend, Brevitas): a float node unit;
* ``per_channel_activation``: the Transpose's output quantized per channel and the next Conv's
  bias float (NNCF's depthwise inputs): float node units;
* ``mixed_types``: two activations quantized to uint8 (zero point + 128, the same values)
  among int8 ones (NNCF's ReLU outputs): onnxruntime fuses no unit whose types differ.

And a graph with a real cycle is refused with the nodes on it named, and a per-channel
activation that onnxruntime fuses into an integer kernel (whose kernel then fails) is refused.

The toolkits themselves (their own model files) are :mod:`toolkits`' matrix (slow).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")
pytest.importorskip("torch")
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

import models  # noqa: E402
from irgen.cli import main as irgen_main  # noqa: E402
from irgen_onnx.runner import inference_session  # noqa: E402
from test_verify import _verify_json  # noqa: E402


@pytest.fixture(scope="module")
def qdq_model(tmp_path_factory) -> tuple[Path, np.ndarray]:
    """The small CNN quantized by ``quantize_static`` (QDQ, per-channel int8 weights, int8
    activations) and its input."""
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static

    d = tmp_path_factory.mktemp("toolkit_patterns")
    path, x = models.export("small_cnn", d)
    shape = models.BUILDERS["small_cnn"][1]

    class Reader(CalibrationDataReader):
        def __init__(self):
            self.it = iter([{"x": np.random.default_rng(k).standard_normal(shape).astype(np.float32)}
                            for k in range(4)])

        def get_next(self):
            return next(self.it, None)

    out = d / "small_cnn_qdq.onnx"
    quantize_static(str(path), str(out), Reader(), quant_format=QuantFormat.QDQ, per_channel=True,
                    activation_type=QuantType.QInt8, weight_type=QuantType.QInt8)
    return out, x


def _weight_dqs(model) -> list:
    """The DequantizeLinear nodes whose data is an int8 initializer of rank > 1 (the weights)."""
    inits = {t.name: t for t in model.graph.initializer}
    return [n for n in model.graph.node if n.op_type == "DequantizeLinear" and n.input[0] in inits
            and inits[n.input[0]].data_type == TensorProto.INT8 and len(inits[n.input[0]].dims) > 1]


def unsorted(model) -> None:
    """The first Conv moved to the end of the node list, after every node reading it."""
    nodes = list(model.graph.node)
    k = next(i for i, n in enumerate(nodes) if n.op_type == "Conv")
    del model.graph.node[:]
    model.graph.node.extend(nodes[:k] + nodes[k + 1:] + [nodes[k]])


def narrow_clip(model) -> None:
    """Each int8 weight read through ``Clip(w, -127, 127)`` (int8 bounds), as Brevitas exports."""
    model.graph.initializer.extend([numpy_helper.from_array(np.array(-127, np.int8), "clip_lo"),
                                    numpy_helper.from_array(np.array(127, np.int8), "clip_hi")])
    clips = []
    for n in _weight_dqs(model):
        clipped = n.input[0] + "_narrow"
        clips.append(helper.make_node("Clip", [n.input[0], "clip_lo", "clip_hi"], [clipped],
                                      name=n.input[0] + "_clip"))
        n.input[0] = clipped
    nodes = clips + list(model.graph.node)
    del model.graph.node[:]
    model.graph.node.extend(nodes)


def q_of_float(model) -> None:
    """Each int8 weight stored in float and quantized by a QuantizeLinear on load, its zero point an
    ``Identity`` of an int8 initializer (NNCF after ``nncf.strip``)."""
    inits = {t.name: t for t in model.graph.initializer}
    added, dropped = [], set()
    for n in _weight_dqs(model):
        w = numpy_helper.to_array(inits[n.input[0]])
        scale = numpy_helper.to_array(inits[n.input[1]])
        axis = next((a.i for a in n.attribute if a.name == "axis"), 1)
        shape = [1] * w.ndim
        shape[axis] = -1
        wf = (w.astype(np.float32) * scale.reshape(shape)).astype(np.float32)  # exactly on the grid
        name = n.input[0]
        dropped.add(name)
        zp = numpy_helper.from_array(np.zeros(scale.shape, np.int8), name + "_zp_raw")
        model.graph.initializer.extend([numpy_helper.from_array(wf, name + "_float"), zp])
        added += [helper.make_node("Identity", [name + "_zp_raw"], [name + "_zp"], name=name + "_zp_identity"),
                  helper.make_node("QuantizeLinear", [name + "_float", n.input[1], name + "_zp"], [name],
                                   name=name + "_quantize", axis=axis)]
    kept = [t for t in model.graph.initializer if t.name not in dropped]
    del model.graph.initializer[:]
    model.graph.initializer.extend(kept)
    nodes = added + list(model.graph.node)
    del model.graph.node[:]
    model.graph.node.extend(nodes)


def _node(model, name: str):
    return next(n for n in model.graph.node if n.name == name)


def _init(model, name: str):
    return next(t for t in model.graph.initializer if t.name == name)


def _drop_pair(model, q_name: str) -> None:
    """The QuantizeLinear ``q_name`` and the DequantizeLinear after it dropped: the readers of the
    DequantizeLinear read the QuantizeLinear's input (a float tensor)."""
    q = _node(model, q_name)
    dq = next(n for n in model.graph.node if n.op_type == "DequantizeLinear" and n.input[0] == q.output[0])
    for n in model.graph.node:
        for k, x in enumerate(n.input):
            if x == dq.output[0]:
                n.input[k] = q.input[0]
    for o in model.graph.output:
        if o.name == dq.output[0]:  # the producer writes the output itself
            producer = next(n for n in model.graph.node if q.input[0] in n.output)
            producer.output[list(producer.output).index(q.input[0])] = o.name
    model.graph.node.remove(q)
    model.graph.node.remove(dq)


def unquantized_moves(model) -> None:
    """The Q/DQ pairs after the MaxPool and the Transpose dropped (their parameters are their inputs')."""
    _drop_pair(model, "/pool/MaxPool_output_0_QuantizeLinear")
    _drop_pair(model, "/Transpose_output_0_QuantizeLinear")


def move_beside_a_quantize(model) -> None:
    """The fourth Conv reads the Transpose's float output, which a QuantizeLinear reads too (its
    DequantizeLinear a second model output): onnxruntime propagates no pair past such a move
    (Brevitas' residual branch after its MaxPool), so the Conv runs in float."""
    q = _node(model, "/Transpose_output_0_QuantizeLinear")
    dq = next(n for n in model.graph.node if n.op_type == "DequantizeLinear" and n.input[0] == q.output[0])
    _node(model, "/c4/Conv").input[0] = q.input[0]
    model.graph.output.append(helper.make_tensor_value_info(dq.output[0], TensorProto.FLOAT, None))


def float_classifier(model) -> None:
    """Flatten -> Gemm (per-channel int8 weights) -> Softmax in float, the model output float."""
    for name in ("/Flatten_output_0_QuantizeLinear", "/fc/Gemm_output_0_QuantizeLinear", "y_QuantizeLinear"):
        _drop_pair(model, name)


def unfolded_batchnorm(model) -> None:
    """``Conv -> BatchNormalization -> Relu -> QuantizeLinear`` at the third convolution (its Relu
    was fused into the QuantizeLinear): the BatchNormalization left unfolded."""
    conv = _node(model, "/c3/Conv")
    rng = np.random.default_rng(3)
    c = 8
    params = {"bn_x_scale": rng.uniform(0.5, 1.5, c), "bn_x_bias": rng.uniform(-0.2, 0.2, c),
              "bn_x_mean": rng.uniform(-0.1, 0.1, c), "bn_x_var": rng.uniform(0.5, 2.0, c)}
    model.graph.initializer.extend(numpy_helper.from_array(v.astype(np.float32), k) for k, v in params.items())
    out = conv.output[0]
    conv.output[0] = out + "_conv"
    bn = helper.make_node("BatchNormalization", [out + "_conv", *params], [out + "_bn"], name="/c3/bn_x")
    relu = helper.make_node("Relu", [out + "_bn"], [out], name="/c3/relu_x")
    nodes = list(model.graph.node)
    k = nodes.index(conv)
    del model.graph.node[:]
    model.graph.node.extend(nodes[:k + 1] + [bn, relu] + nodes[k + 1:])


def per_channel_activation(model) -> None:
    """The Transpose's output quantized per channel (axis 1), and the next Conv's bias a float
    initializer (NNCF leaves biases float): onnxruntime runs both node units in float."""
    q = _node(model, "/Transpose_output_0_QuantizeLinear")
    dq = next(n for n in model.graph.node if n.op_type == "DequantizeLinear" and n.input[0] == q.output[0])
    s = float(numpy_helper.to_array(_init(model, q.input[1])))
    zp = numpy_helper.to_array(_init(model, q.input[2]))
    scales = (s * np.linspace(0.75, 1.25, 8)).astype(np.float32)
    model.graph.initializer.extend([numpy_helper.from_array(scales, "t_scale_per_channel"),
                                    numpy_helper.from_array(np.full(8, zp, zp.dtype), "t_zp_per_channel")])
    for n in (q, dq):
        n.input[1], n.input[2] = "t_scale_per_channel", "t_zp_per_channel"
        n.attribute.append(helper.make_attribute("axis", 1))
    conv = _node(model, "/c4/Conv")
    bias_dq = next(n for n in model.graph.node if n.output[0] == conv.input[2])
    b = numpy_helper.to_array(_init(model, bias_dq.input[0])).astype(np.float32)
    bs = numpy_helper.to_array(_init(model, bias_dq.input[1])).astype(np.float32)
    model.graph.initializer.append(numpy_helper.from_array((b * bs).astype(np.float32), "c4_float_bias"))
    conv.input[2] = "c4_float_bias"
    model.graph.node.remove(bias_dq)


def mixed_types(model) -> None:
    """Two activations (the first ReLU's output, read by the second Conv and the residual Add; the
    third Conv's output, read by the Transpose and through it the fourth Conv) quantized to uint8
    with the zero point + 128: the same values, but node units whose types differ."""
    for name in ("/Relu_output_0_zero_point", "/Relu_2_output_0_zero_point"):
        t = _init(model, name)
        z = numpy_helper.to_array(t).astype(np.int32) + 128
        t.CopyFrom(numpy_helper.from_array(z.astype(np.uint8), name))


def low_bit_activations(model) -> None:
    """Each activation's QuantizeLinear followed by an integer ``Clip(-8, 7)`` before its
    DequantizeLinears: 4-bit activations in int8, as Brevitas' QCDQ export writes them."""
    model.graph.initializer.extend([numpy_helper.from_array(np.array(-8, np.int8), "act_lo"),
                                    numpy_helper.from_array(np.array(7, np.int8), "act_hi")])
    inits = {t.name for t in model.graph.initializer}
    nodes = []
    for n in model.graph.node:
        nodes.append(n)
        if n.op_type == "QuantizeLinear" and n.input[0] not in inits:
            clipped = n.output[0] + "_4bit"
            for m in model.graph.node:
                m.input[:] = [clipped if i == n.output[0] else i for i in m.input]
            nodes.append(helper.make_node("Clip", [n.output[0], "act_lo", "act_hi"], [clipped],
                                          name=n.output[0] + "_clip"))
    del model.graph.node[:]
    model.graph.node.extend(nodes)


#: name -> (the rewrite, whether onnxruntime computes the rewritten model to the original's values,
#: the convolutions realized as integer kernels)
REWRITES = {
    "unsorted": (unsorted, True, 4), "narrow_clip": (narrow_clip, True, 4), "q_of_float": (q_of_float, True, 4),
    "unquantized_moves": (unquantized_moves, True, 4), "move_beside_a_quantize": (move_beside_a_quantize, False, 3),
    "float_classifier": (float_classifier, False, 4),
    "unfolded_batchnorm": (unfolded_batchnorm, False, 3), "per_channel_activation": (per_channel_activation, False, 3),
    "mixed_types": (mixed_types, False, 1), "low_bit_activations": (low_bit_activations, False, 4),
}


def _assert_layers_checked(result: dict, ir: dict) -> int:
    """Every layer passed the source check; an integer kernel's layer equals onnxruntime to the
    last bit, a float span within one LSB; a layer whose output irgen added (a Q/DQ pair
    propagated as onnxruntime propagates it) has no source tensor and is checked through its readers:
    returns how many such layers."""
    assert result["passed"], result["problems"]
    missing = 0
    for row, layer in zip(result["layers"], ir["layers"], strict=True):
        m = row["checks"]["source"]
        quant = layer.get("quant") or {}
        if m["status"] == "missing":
            assert "no source tensor" in str(m.get("message")), (row["name"], m)
            missing += 1
            continue
        assert m["status"] == "pass", (row["name"], m)
        assert m["elements"] == int(np.prod(layer["outputs"][0]["shape"]))
        if row["integer"] and quant.get("realization") != "float":
            assert m["max_lsb"] == 0 and m["exact"], (row["name"], m)
    return missing


@pytest.mark.parametrize("name", sorted(REWRITES))
def test_toolkit_rewrite_runs_and_equals_onnxruntime(name, qdq_model, tmp_path, capsys):
    src, x = qdq_model
    model = onnx.load(str(src))
    before = inference_session(model.SerializeToString(), quantized=True).run(None, {"x": x})[0]
    rewrite, same, convs = REWRITES[name]
    rewrite(model)
    path = tmp_path / f"{name}.onnx"
    onnx.save(model, str(path))
    y = inference_session(path.read_bytes(), quantized=True).run(None, {"x": x})[0]
    if same:  # the rewrite is one onnxruntime computes to the same values
        np.testing.assert_array_equal(y, before)
    if name == "unsorted":
        with pytest.raises(onnx.checker.ValidationError):
            onnx.checker.check_model(model)

    np.save(tmp_path / "x.npy", x)
    out = tmp_path / "out"
    assert irgen_main(["run", str(path), "-o", str(out), "--input", str(tmp_path / "x.npy"), "--no-progress",
                       "--no-cache"]) == 0
    ir = json.loads((out / "ir.json").read_text())
    assert ir["producer"]["quantizer"] == "qdq"
    assert sum(1 for layer in ir["layers"] if (layer.get("quant") or {}).get("kind") == "conv2d") == convs
    code, result = _verify_json(capsys, out)
    assert code == 0, result["problems"]
    # the layers of the pairs irgen propagated (the MaxPool's and the Transpose's) have no source tensor
    assert _assert_layers_checked(result, ir) == (2 if name == "unquantized_moves" else 0)
    if name == "low_bit_activations":  # a Clip after a convolution or the input folded into it, its range recorded
        kinds = [(layer.get("quant") or {}).get("kind") for layer in ir["layers"]]
        assert kinds.count("conv2d") == 4 and "quantize" in kinds
        for layer in ir["layers"]:
            q = layer.get("quant") or {}
            if q.get("kind") in ("conv2d", "quantize"):
                assert q["output"]["range"] == [-8, 7] and q["clamp"][0] >= -8 and q["clamp"][1] <= 7, layer["name"]
    golden = np.load(out / ir["outputs"][0]["file"])
    if name == "float_classifier":  # a float output: TVM's float ops
        np.testing.assert_allclose(golden, y, rtol=1e-5, atol=1e-6)
    else:  # the last dequantize of onnxruntime's integers
        np.testing.assert_array_equal(golden, y)


def test_a_per_channel_activation_onnxruntime_fuses_is_refused(qdq_model, tmp_path, capsys):
    """A per-channel activation into a Conv whose every input is dequantized (no bias): onnxruntime
    fuses the unit into QLinearConv, which fails on a vector input scale; irgen says so."""
    src, x = qdq_model
    model = onnx.load(str(src))
    per_channel_activation(model)
    del _node(model, "/c4/Conv").input[2]
    path = tmp_path / "fused_per_channel.onnx"
    onnx.save(model, str(path))
    with pytest.raises(Exception, match="QLinearConv"):
        inference_session(path.read_bytes(), quantized=True).run(None, {"x": x})
    assert irgen_main(["run", str(path), "-o", str(tmp_path / "out"), "--no-progress", "--no-cache"]) == 2
    err = capsys.readouterr().err
    assert "quantized per channel" in err and "cannot run the model" in err, err


def test_a_graph_with_a_cycle_is_refused_naming_its_nodes(tmp_path, capsys):
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])
    nodes = [helper.make_node("Add", ["x", "b"], ["a"], name="first"),
             helper.make_node("Relu", ["a"], ["b"], name="second"),
             helper.make_node("Identity", ["b"], ["y"], name="out")]
    path = tmp_path / "cycle.onnx"
    onnx.save(helper.make_model(helper.make_graph(nodes, "g", [x], [y]), opset_imports=[helper.make_opsetid("", 17)]),
              str(path))
    assert irgen_main(["run", str(path), "-o", str(tmp_path / "out"), "--no-progress", "--no-cache"]) == 2
    err = capsys.readouterr().err
    assert "cycle" in err and "'first'" in err and "'second'" in err, err
    assert not (tmp_path / "out").exists()


def test_a_float_span_quantizes_nan_and_infinities_as_onnxruntime(tmp_path, capsys):
    """A float span that divides two activations (no integer kernel: dequantize, Div, quantize):
    0/0 is NaN, which QuantizeLinear makes the type's minimum, and +-x/0 the type's bounds, in the
    golden data and in verify's recompute alike."""
    scales = [numpy_helper.from_array(np.float32(0.05), "s"), numpy_helper.from_array(np.int8(0), "z"),
              numpy_helper.from_array(np.float32(0.1), "s_y"), numpy_helper.from_array(np.int8(3), "z_y")]
    nodes = [helper.make_node("QuantizeLinear", ["a", "s", "z"], ["a_q"]),
             helper.make_node("DequantizeLinear", ["a_q", "s", "z"], ["a_dq"]),
             helper.make_node("QuantizeLinear", ["b", "s", "z"], ["b_q"]),
             helper.make_node("DequantizeLinear", ["b_q", "s", "z"], ["b_dq"]),
             helper.make_node("Div", ["a_dq", "b_dq"], ["d"], name="div"),
             helper.make_node("QuantizeLinear", ["d", "s_y", "z_y"], ["d_q"]),
             helper.make_node("DequantizeLinear", ["d_q", "s_y", "z_y"], ["y"])]
    inputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [1, 8]) for n in ("a", "b")]
    graph = helper.make_graph(nodes, "g", inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8])],
                              scales)
    path = tmp_path / "div.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    a = np.array([[0, 1, 0, 2, -1, 0.01, 0, 3]], np.float32)
    b = np.array([[0, 0, 1, 2, 0, 0.01, 0, -1]], np.float32)
    np.save(tmp_path / "a.npy", a)
    np.save(tmp_path / "b.npy", b)
    out = tmp_path / "out"
    assert irgen_main(["run", str(path), "-o", str(out), "--input", f"a={tmp_path / 'a.npy'}",
                       "--input", f"b={tmp_path / 'b.npy'}", "--no-progress", "--no-cache"]) == 0
    ir = json.loads((out / "ir.json").read_text())
    assert [(layer.get("quant") or {}).get("realization") for layer in ir["layers"] if layer["name"] == "div"] == \
        ["float"]
    code, result = _verify_json(capsys, out)
    assert code == 0, result["problems"]
    y = inference_session(path.read_bytes(), quantized=True).run(None, {"a": a, "b": b})[0]
    np.testing.assert_array_equal(np.load(out / ir["outputs"][0]["file"]), y)
    assert y[0, 0] == np.float32(0.1) * (-128 - 3) and y[0, 1] == np.float32(0.1) * (127 - 3)  # NaN, +inf
