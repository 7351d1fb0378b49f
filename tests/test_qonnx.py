"""QONNX ``Quant`` nodes (Brevitas' ``export_qonnx``, FINN) lowered to QuantizeLinear/DequantizeLinear.

Neither TVM nor ONNX Runtime has a kernel for QONNX's ``Quant``; the ONNX frontend lowers each one
to the standard ops that compute what QONNX defines (``irgen_onnx/qonnx.py``), for TVM and for the
source check alike. Checked here: every lowered Quant's output equals QONNX's formula (its
``int_quant``, written out below from the QONNX spec) applied to the value that reaches it in
ONNX Runtime, for per-tensor and per-channel, signed and unsigned, narrow-range, 4-bit and 32-bit
constants and 8-bit activations; ``irgen run`` + ``irgen verify`` then pass with every integer
layer equal to ONNX Runtime; and a Quant with no QuantizeLinear equivalent is refused, naming it
and why. The Brevitas fixture (``tests/data/toolkits/brevitas-qonnx.onnx``) is in
``test_toolkits.py``; against QONNX's own executor (``qonnx.core.onnx_exec``, not a test
dependency) every Quant output of it, of Brevitas' ResNet-18 and of its MobileNetV2 was equal.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

from irgen.cli import main as irgen_main  # noqa: E402
from irgen_onnx.prepare import checked_model  # noqa: E402
from irgen_onnx.runner import inference_session  # noqa: E402
from test_verify import _verify_json  # noqa: E402

DOMAIN = "qonnx.custom_op.general"


def int_quant(x, scale, zeropt, bits, signed, narrow, rounding="ROUND"):
    """QONNX's ``Quant`` in float32: ``(clip(round(x / scale + zeropt), lo, hi) - zeropt) * scale``."""
    lo = -(2 ** (bits - 1)) + narrow if signed else 0
    hi = 2 ** (bits - 1) - 1 if signed else 2 ** bits - 1 - narrow
    v = np.float32(x) / np.float32(scale) + np.float32(zeropt)
    v = {"ROUND": np.round, "FLOOR": np.floor}[rounding](np.clip(v, lo, hi))
    return ((v - np.float32(zeropt)) * np.float32(scale)).astype(np.float32)


class _Graph:
    """A small QONNX graph, each Quant a unit ONNX Runtime fuses: x -> Quant (int8) -> Conv (Quant
    weights per channel, narrow; Quant int32 bias) -> Quant (int8) -> Relu -> Quant (uint8) -> Conv
    (4-bit Quant weights) -> Relu -> Quant (uint8) -> y; and what each Quant reads."""

    def __init__(self, **act):
        rng = np.random.default_rng(5)
        self.nodes, self.inits, self.quants = [], [], []
        self.w1 = rng.standard_normal((6, 3, 3, 3)).astype(np.float32) * 0.3
        self.w2 = rng.standard_normal((4, 6, 1, 1)).astype(np.float32) * 0.3
        self.b1 = rng.standard_normal(6).astype(np.float32) * 0.1
        s_w1 = (np.abs(self.w1).reshape(6, -1).max(1) / 127).astype(np.float32).reshape(6, 1, 1, 1)
        x = self.quant("x", "xq", 0.04, 0, 8, 1, 0, **act)
        w1 = self.quant(self.const("w1", self.w1), "w1q", s_w1, 0, 8, 1, 1)  # per channel, narrow
        b1 = self.quant(self.const("b1", self.b1), "b1q", (0.04 * s_w1).reshape(6), 0, 32, 1, 0)
        self.nodes.append(helper.make_node("Conv", [x, w1, b1], ["c1"], name="conv1", pads=[1, 1, 1, 1]))
        c1 = self.quant("c1", "c1q", 0.05, 0, 8, 1, 0)
        self.nodes.append(helper.make_node("Relu", [c1], ["r1"], name="relu1"))
        r1 = self.quant("r1", "r1q", 0.03, 0, 8, 0, 0)
        w2 = self.quant(self.const("w2", self.w2), "w2q", 0.05, 0, 4, 1, 0)  # 4 bits, in int8
        self.nodes.append(helper.make_node("Conv", [r1, w2], ["c2"], name="conv2"))
        self.nodes.append(helper.make_node("Relu", ["c2"], ["r2"], name="relu2"))
        self.quant("r2", "y", 0.02, 0, 8, 0, 0)

    def const(self, name: str, value) -> str:
        self.inits.append(numpy_helper.from_array(np.asarray(value, np.float32), name))
        return name

    def quant(self, src: str, out: str, scale, zp, bits, signed, narrow, rounding="ROUND") -> str:
        k = len(self.quants)
        ins = [src, self.const(f"scale{k}", scale), self.const(f"zp{k}", zp), self.const(f"bits{k}", bits)]
        self.nodes.append(helper.make_node("Quant", ins, [out], name=f"quant_{out}", domain=DOMAIN, signed=signed,
                                           narrow=narrow, rounding_mode=rounding))
        self.quants.append((src, out, scale, zp, bits, signed, narrow, rounding))
        return out

    def save(self, path: Path) -> Path:
        x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])
        y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 8, 8])
        graph = helper.make_graph(self.nodes, "qonnx", [x], [y], self.inits)
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(DOMAIN, 1)])
        onnx.save(model, str(path))
        return path


@pytest.fixture(scope="module")
def qonnx_model(tmp_path_factory) -> tuple[Path, np.ndarray, _Graph]:
    d = tmp_path_factory.mktemp("qonnx")
    g = _Graph()
    x = np.random.default_rng(1).standard_normal((1, 3, 8, 8)).astype(np.float32)
    np.save(d / "x.npy", x)
    return g.save(d / "model.onnx"), x, g


def test_each_lowered_quant_computes_what_qonnx_defines(qonnx_model):
    path, x, g = qonnx_model
    model = checked_model(path, for_tvm=False)  # the model ONNX Runtime runs for the source check
    assert not [n.op_type for n in model.graph.node if n.domain == DOMAIN]
    assert DOMAIN not in {o.domain for o in model.opset_import}
    consts = {"x": x, "w1": g.w1, "b1": g.b1, "w2": g.w2}
    names = {src for src, *_ in g.quants} - set(consts) | {out for _, out, *_ in g.quants}
    have = {o.name for o in model.graph.output}
    model.graph.output.extend(helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in sorted(names - have))
    sess = inference_session(model.SerializeToString(), quantized=True)
    values = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, {"x": x})))
    for src, out, scale, zp, bits, signed, narrow, rounding in g.quants:
        want = int_quant(consts.get(src, values.get(src)), scale, zp, bits, signed, narrow, rounding)
        np.testing.assert_array_equal(values[out], want, err_msg=out)
    ints = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer if t.name.endswith("_int")}
    assert ints["w1q_int"].dtype == np.int8 and ints["w1q_int"].min() >= -127  # narrow range kept
    assert ints["w2q_int"].dtype == np.int8 and -8 <= ints["w2q_int"].min() and ints["w2q_int"].max() <= 7
    assert ints["b1q_int"].dtype == np.int32


def test_a_qonnx_model_runs_and_verifies_exactly(qonnx_model, tmp_path, capsys):
    path, x, _ = qonnx_model
    out = tmp_path / "out"
    assert irgen_main(["run", str(path), "-o", str(out), "--input", str(path.parent / "x.npy"), "--no-progress",
                       "--no-cache"]) == 0
    ir = json.loads((out / "ir.json").read_text())
    assert ir["producer"]["quantizer"] == "qdq"
    weights = [layer["quant"]["weight"] for layer in ir["layers"] if (layer.get("quant") or {}).get("weight")]
    assert [w.get("range") for w in weights] == [[-127, 127], [-8, 7]]  # narrow and 4-bit weights, in int8
    code, result = _verify_json(capsys, out)
    assert code == 0 and result["source"]["ran"], result["problems"]
    integer = [row for row in result["layers"] if row["integer"]]
    assert [row["op"] for row in integer].count("conv2d") == 2
    for row in integer:
        m = row["checks"]["source"]
        assert m["status"] == "pass" and m["max_lsb"] == 0 and m["exact"], (row["name"], m)
    y = inference_session(checked_model(path, for_tvm=False).SerializeToString(), quantized=True).run(None, {"x": x})
    np.testing.assert_array_equal(np.load(out / ir["outputs"][0]["file"]), y[0])


def _refused(tmp_path, capsys, graph: _Graph, *words) -> None:
    path = graph.save(tmp_path / "refused.onnx")
    assert irgen_main(["run", str(path), "-o", str(tmp_path / "out"), "--no-progress", "--no-cache"]) == 2
    err = capsys.readouterr().err
    assert "QONNX Quant 'quant_xq'" in err and all(w in err for w in words), err


def _graph_with(act: dict) -> _Graph:
    """:class:`_Graph` whose input Quant (``xq``) takes the settings ``act``."""
    original = _Graph.quant

    def quant(self, src, out, scale, zp, bits, signed, narrow, rounding="ROUND"):
        if out == "xq":
            bits, narrow, rounding = act.get("bits", bits), act.get("narrow", narrow), act.get("rounding", rounding)
            zp = act.get("zp", zp)
        return original(self, src, out, scale, zp, bits, signed, narrow, rounding)

    _Graph.quant = quant
    try:
        return _Graph()
    finally:
        _Graph.quant = original


@pytest.mark.parametrize("act, words", [
    ({"rounding": "FLOOR"}, ("FLOOR",)),
    ({"zp": 7}, ("zero point other than 0",)),
], ids=["floor", "zero-point"])
def test_an_activation_quant_with_no_quantizelinear_is_refused(act, words, tmp_path, capsys):
    _refused(tmp_path, capsys, _graph_with(act), *words)


@pytest.mark.parametrize("act, rng", [({"bits": 4}, [-8, 7]), ({"narrow": 1}, [-127, 127]), ({"bits": 3}, [-4, 3])],
                         ids=["4-bit", "narrow", "3-bit"])
def test_a_narrow_activation_quant_keeps_its_range(act, rng, tmp_path, capsys):
    """An activation Quant of fewer than 8 bits (or narrow): QuantizeLinear, an integer Clip to its
    range, DequantizeLinear (Brevitas' QCDQ form). The layer that writes the tensor clamps to the
    range, its record says so, and every value equals QONNX's formula and ONNX Runtime."""
    g = _graph_with(act)
    path = g.save(tmp_path / "narrow.onnx")
    x = np.random.default_rng(1).standard_normal((1, 3, 8, 8)).astype(np.float32) * 8  # beyond every range
    np.save(tmp_path / "x.npy", x)
    out = tmp_path / "out"
    assert irgen_main(["run", str(path), "-o", str(out), "--input", str(tmp_path / "x.npy"), "--no-progress",
                       "--no-cache"]) == 0
    ir = json.loads((out / "ir.json").read_text())
    first = ir["layers"][0]
    assert first["quant"]["kind"] == "quantize" and first["quant"]["output"]["range"] == rng
    assert first["quant"]["clamp"] == rng
    ints = np.load(out / first["outputs"][0]["file"])
    assert ints.min() >= rng[0] and ints.max() <= rng[1] and {ints.min(), ints.max()} == set(rng)  # it clamps
    src, _, scale, zp, bits, signed, narrow, rounding = g.quants[0]
    np.testing.assert_array_equal(ints.astype(np.float32) * np.float32(scale),
                                  int_quant(x, scale, zp, bits, signed, narrow, rounding))
    code, result = _verify_json(capsys, out)
    assert code == 0 and result["source"]["ran"], result["problems"]
    assert all(row["checks"]["source"]["max_lsb"] == 0 for row in result["layers"] if row["integer"])


def test_a_quant_whose_scale_is_computed_is_refused(tmp_path, capsys):
    g = _Graph()
    node = next(n for n in g.nodes if n.name == "quant_xq")
    g.nodes.insert(0, helper.make_node("Abs", [node.input[1]], ["scale_abs"], name="abs"))
    node.input[1] = "scale_abs"
    _refused(tmp_path, capsys, g, "not constants")


def _lowered_values(path: Path, feeds: dict, names: list[str]) -> dict[str, np.ndarray]:
    """ONNX Runtime's values of ``names`` on the lowered model (what the source check runs)."""
    model = checked_model(path, for_tvm=False)
    assert not [n.op_type for n in model.graph.node if n.domain == DOMAIN]
    have = {o.name for o in model.graph.output}
    model.graph.output.extend(helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in names
                              if n not in have)
    sess = inference_session(model.SerializeToString(), quantized=False)
    return dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds)))


def _save(tmp_path: Path, nodes, inits, shape=(1, 4, 6, 6), name="m.onnx") -> Path:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, list(shape))
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    path = tmp_path / name
    onnx.save(helper.make_model(helper.make_graph(nodes, "g", [x], [y], inits),
                                opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(DOMAIN, 1)]), str(path))
    return path


def _trunc_v2(x, scale, zp, out_scale, out_bits, signed, narrow, rounding):
    """QONNX's ``trunc_v2`` in float32."""
    t = np.float32(2) ** np.round(np.log2(np.float32(out_scale) / np.float32(scale)))
    y = np.round(x / np.float32(scale) + np.float32(zp)) / t
    lo = -(2 ** (out_bits - 1)) + narrow if signed else 0
    hi = 2 ** (out_bits - 1) - 1 if signed else 2 ** out_bits - 1 - narrow
    y = {"FLOOR": np.floor, "ROUND": np.round, "CEIL": np.ceil}[rounding](np.clip(y, lo, hi))
    return ((y - np.float32(zp) / t) * np.float32(out_scale)).astype(np.float32)


@pytest.mark.parametrize("rounding", ["FLOOR", "ROUND"])
def test_trunc_after_an_average_computes_what_qonnx_defines(rounding, tmp_path, capsys):
    """Brevitas' TruncAdaptiveAvgPool2d: Quant (uint8) -> GlobalAveragePool -> Trunc (v2) back
    to 8 bits; the lowered float ops equal QONNX's ``trunc_v2`` on every value, and irgen's run
    verifies against ONNX Runtime."""
    s_in, s_acc = np.float32(0.02), np.float32(0.02 / 64)
    c = [numpy_helper.from_array(np.asarray(v, np.float32), n) for n, v in
         [("s", s_in), ("z", 0), ("b8", 8), ("sa", s_acc), ("b14", 14)]]
    nodes = [helper.make_node("Quant", ["x", "s", "z", "b8"], ["q"], domain=DOMAIN, signed=0, narrow=0,
                              rounding_mode="ROUND"),
             helper.make_node("GlobalAveragePool", ["q"], ["avg"]),
             helper.make_node("Trunc", ["avg", "sa", "z", "b14", "s", "b8"], ["y"], name="trunc", domain=DOMAIN,
                              signed=0, narrow=0, rounding_mode=rounding)]
    path = _save(tmp_path, nodes, c)
    x = np.abs(np.random.default_rng(2).standard_normal((1, 4, 6, 6))).astype(np.float32) * 2
    values = _lowered_values(path, {"x": x}, ["avg", "y"])
    np.testing.assert_array_equal(values["y"], _trunc_v2(values["avg"], s_acc, 0, s_in, 8, 0, 0, rounding))
    np.save(tmp_path / "x.npy", x)
    out = tmp_path / "out"
    assert irgen_main(["run", str(path), "-o", str(out), "--input", str(tmp_path / "x.npy"), "--no-progress"]) == 0
    ir = json.loads((out / "ir.json").read_text())
    np.testing.assert_array_equal(np.load(out / ir["outputs"][0]["file"]), values["y"])
    code, result = _verify_json(capsys, out)
    assert code == 0 and result["source"]["ran"], result["problems"]


def test_bipolar_quant_of_weights_and_of_an_activation(tmp_path, capsys):
    """BipolarQuant: weights become int8 -1/+1 read by a DequantizeLinear; an activation's is a
    float where(x >= 0, scale, -scale); both equal QONNX's ``binary_quant``."""
    rng = np.random.default_rng(4)
    w = rng.standard_normal((5, 4, 3, 3)).astype(np.float32)
    inits = [numpy_helper.from_array(w, "w"), numpy_helper.from_array(np.float32(0.25), "sw"),
             numpy_helper.from_array(np.float32(0.5), "sa")]
    nodes = [helper.make_node("BipolarQuant", ["x", "sa"], ["xb"], name="act", domain=DOMAIN),
             helper.make_node("BipolarQuant", ["w", "sw"], ["wb"], name="weights", domain=DOMAIN),
             helper.make_node("Conv", ["xb", "wb"], ["y"], name="conv", pads=[1, 1, 1, 1])]
    path = _save(tmp_path, nodes, inits)
    x = rng.standard_normal((1, 4, 6, 6)).astype(np.float32)
    x[0, 0, 0, :3] = [0.0, -0.0, 1e-30]
    values = _lowered_values(path, {"x": x}, ["xb", "y"])
    np.testing.assert_array_equal(values["xb"], np.where(x >= 0, 1.0, -1.0).astype(np.float32) * np.float32(0.5))
    ints = {t.name: numpy_helper.to_array(t) for t in checked_model(path, for_tvm=False).graph.initializer}
    np.testing.assert_array_equal(ints["wb_int"], np.where(w >= 0, 1, -1).astype(np.int8))
    np.save(tmp_path / "x.npy", x)
    out = tmp_path / "out"
    assert irgen_main(["run", str(path), "-o", str(out), "--input", str(tmp_path / "x.npy"), "--no-progress"]) == 0
    code, result = _verify_json(capsys, out)
    assert code == 0 and result["source"]["ran"], result["problems"]


def test_trunc_with_a_rounding_it_has_no_op_for_is_refused(tmp_path, capsys):
    c = [numpy_helper.from_array(np.asarray(v, np.float32), n) for n, v in [("s", 0.5), ("z", 0), ("b", 8)]]
    nodes = [helper.make_node("Trunc", ["x", "s", "z", "b", "s", "b"], ["y"], name="trunc", domain=DOMAIN,
                              rounding_mode="HALF_UP")]
    path = _save(tmp_path, nodes, c, shape=(1, 4))
    assert irgen_main(["run", str(path), "-o", str(tmp_path / "out"), "--no-progress", "--no-cache"]) == 2
    err = capsys.readouterr().err
    assert "QONNX Trunc 'trunc'" in err and "HALF_UP" in err, err


@pytest.mark.parametrize("name, value, words", [
    ("bits0", np.float32(np.nan), ("bit width",)),
    ("scale1", np.ones((5, 1, 1, 1), np.float32), ("do not broadcast",)),
    ("scale0", np.float32(0), ("finite and positive",)),
    ("zp0", np.float32(0.5), ("not an integer",)),
], ids=["nan-bits", "scale-shape", "zero-scale", "fractional-zero-point"])
def test_a_malformed_quant_is_refused_naming_it(name, value, words, tmp_path, capsys):
    g = _Graph()
    k = next(k for k, t in enumerate(g.inits) if t.name == name)
    g.inits[k] = numpy_helper.from_array(value, name)
    path = g.save(tmp_path / "malformed.onnx")
    assert irgen_main(["run", str(path), "-o", str(tmp_path / "out"), "--no-progress", "--no-cache"]) == 2
    err = capsys.readouterr().err
    assert "QONNX Quant" in err and all(w in err for w in words) and "Traceback" not in err, err
