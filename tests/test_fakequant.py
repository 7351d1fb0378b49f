"""OpenVINO ``FakeQuantize`` nodes (NNCF's torch backend exported to ONNX) lowered to Q/DQ.

Neither TVM nor ONNX Runtime has a kernel for FakeQuantize; the ONNX frontend lowers each one to
the QuantizeLinear/DequantizeLinear it computes (``irgen_onnx/fakequant.py``), and the source check
runs the original model in OpenVINO (``irgen_onnx/openvino_runner.py``). Checked here, on graphs
built with ``onnx.helper`` the way NNCF writes them (activations ``levels=256`` asymmetric and
signed, weights ``levels=255`` symmetric per channel, a range two quantizers share across a Concat
through Identity nodes):

* every lowered activation FakeQuantize (256 levels, and 255 or 16 through an integer Clip)
  computes OpenVINO's definition (written out below) on the value that reaches it in ONNX
  Runtime, and every lowered weight holds the integers OpenVINO's own FakeQuantize gives the
  constant;
* ``irgen run`` + ``irgen verify`` pass with OpenVINO as the source runtime (every layer within its
  declared bound of 1 LSB), and the golden data equals ONNX Runtime on the lowered Q/DQ graph on
  every value of every layer (its integer kernels are the arithmetic irgen reproduces);
* a FakeQuantize with no QuantizeLinear equivalent is refused naming it and why, and a missing
  OpenVINO names the package to install.

The committed NNCF fixture (``tests/data/toolkits/nncf-torch.onnx``) runs in ``test_toolkits.py``
and here against ONNX Runtime; NNCF's torchvision models are in the slow toolkit matrix.
"""

from __future__ import annotations

import json
import sys
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

sys.path.insert(0, str(Path(__file__).parent))
import toolkits  # noqa: E402

DOMAIN = "org.openvinotoolkit"


def _openvino():
    return pytest.importorskip("openvino", reason="openvino is not installed (pip install openvino==2026.4.1)")


def fake_quantize(x, lo, hi, levels):
    """OpenVINO's FakeQuantize (input range = output range), in float32: the level index 0..levels-1."""
    x, lo, hi = (np.asarray(v, np.float32) for v in (x, lo, hi))
    k = np.round((x - lo) / (hi - lo) * np.float32(levels - 1))
    return np.where(x <= lo, 0, np.where(x > hi, levels - 1, k)).astype(np.int64)


class _Graph:
    """x -> FQ (signed, 256 levels) -> Conv (FQ weights, 255 levels, per channel; float bias) -> FQ
    (signed) -> Relu -> FQ (unsigned) -> two Conv -> Relu -> FQ branches sharing one range (the
    second through Identity nodes) -> Concat -> Conv -> FQ (asymmetric, zero point 100) -> y."""

    def __init__(self, **changes):
        rng = np.random.default_rng(7)
        self.nodes, self.inits, self.fqs, self.weights = [], [], [], {}
        self.changes = changes
        x = self.fq("x", "xq", *self.signed(0.03))
        w1 = self.weight("w1", rng.standard_normal((6, 3, 3, 3)) * 0.3)
        b1 = self.const("b1", rng.standard_normal(6) * 0.1)
        self.nodes.append(helper.make_node("Conv", [x, w1, b1], ["c1"], name="conv1", pads=[1, 1, 1, 1]))
        c1 = self.fq("c1", "c1q", *self.signed(0.06))
        self.nodes.append(helper.make_node("Relu", [c1], ["r1"], name="relu1"))
        r1 = self.fq("r1", "r1q", 0.0, 0.05 * 255)
        lo, hi = self.const("shared_lo", 0.0), self.const("shared_hi", 0.04 * 255)
        self.nodes += [helper.make_node("Identity", [lo], ["shared_lo_b"], name="id_lo"),
                       helper.make_node("Identity", [hi], ["shared_hi_b"], name="id_hi")]
        for branch, names in (("a", (lo, hi)), ("b", ("shared_lo_b", "shared_hi_b"))):
            w = self.weight(f"w2{branch}", rng.standard_normal((4, 6, 1, 1)) * 0.4)
            self.nodes += [helper.make_node("Conv", [r1, w], [f"c2{branch}"], name=f"conv2{branch}"),
                           helper.make_node("Relu", [f"c2{branch}"], [f"r2{branch}"], name=f"relu2{branch}")]
            self.fq(f"r2{branch}", f"r2{branch}q", 0.0, 0.04 * 255, names=names)
        self.nodes.append(helper.make_node("Concat", ["r2aq", "r2bq"], ["cat"], name="concat", axis=1))
        w3 = self.weight("w3", rng.standard_normal((5, 8, 3, 3)) * 0.2)
        self.nodes.append(helper.make_node("Conv", ["cat", w3], ["c3"], name="conv3", pads=[1, 1, 1, 1]))
        self.fq("c3", "y", -100 * 0.05, 155 * 0.05)

    @staticmethod
    def signed(step: float) -> tuple[float, float]:
        """NNCF's signed symmetric activation range: 256 levels, zero point 128."""
        return -128 * step, 127 * step

    def const(self, name: str, value) -> str:
        self.inits.append(numpy_helper.from_array(np.asarray(value, np.float32), name))
        return name

    def weight(self, name: str, w: np.ndarray) -> str:
        """A float weight quantized by a symmetric 255-level FakeQuantize per output channel."""
        w = w.astype(np.float32)
        m = np.abs(w).reshape(len(w), -1).max(1).reshape(-1, 1, 1, 1).astype(np.float32)
        self.weights[name] = (w, -m, m)
        return self.fq(self.const(name, w), name + "q", -m, m, levels=255)

    def fq(self, src: str, out: str, lo, hi, levels: int = 256, names: tuple[str, str] | None = None) -> str:
        """A FakeQuantize of ``src``, its range ``lo..hi`` as constants of its own (``names``: those)."""
        change = self.changes.get(out, {})
        levels = change.get("levels", levels)
        if names is None:
            lo_in, hi_in = self.const(out + "_lo", lo), self.const(out + "_hi", hi)
            lo_out = self.const(out + "_lo_out", change["out_lo"]) if "out_lo" in change else lo_in
            hi_out = hi_in
        else:
            lo_in, hi_in = names
            lo_out, hi_out = names
        self.nodes.append(helper.make_node("FakeQuantize", [src, lo_in, hi_in, lo_out, hi_out], [out],
                                           name=f"fq_{out}", domain=DOMAIN, levels=levels))
        self.fqs.append((src, out, lo, hi, levels))
        return out

    def save(self, path: Path) -> Path:
        x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])
        y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 5, 8, 8])
        graph = helper.make_graph(self.nodes, "fakequant", [x], [y], self.inits)
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(DOMAIN, 1)])
        onnx.save(model, str(path))
        return path


@pytest.fixture(scope="module")
def fq_model(tmp_path_factory) -> tuple[Path, np.ndarray, _Graph]:
    d = tmp_path_factory.mktemp("fakequant")
    g = _Graph()
    x = (np.random.default_rng(1).standard_normal((1, 3, 8, 8)) * 1.5).astype(np.float32)
    np.save(d / "x.npy", x)
    return g.save(d / "model.onnx"), x, g


def _ort_values(model, x: np.ndarray, names) -> dict[str, np.ndarray]:
    """ONNX Runtime (exact integer kernels, as verify runs it) on ``model``, ``names`` made outputs."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    have = {o.name for o in m.graph.output}
    m.graph.output.extend(onnx.ValueInfoProto(name=n) for n in sorted(set(names) - have))
    sess = inference_session(m.SerializeToString(), quantized=True)
    return dict(zip([o.name for o in sess.get_outputs()], sess.run(None, {"x": x})))


#: activations of fewer than 256 levels (r1q after a Relu, r2aq one branch of the Concat):
#: QuantizeLinear -> an integer Clip to the levels -> DequantizeLinear
NARROW = {"r1q": 0, "r2aq": 0}


@pytest.mark.parametrize("levels", [256, 255, 16])
def test_each_lowered_fakequantize_computes_openvinos_definition(levels, tmp_path):
    g = _Graph(**{out: {"levels": levels} for out in NARROW})
    path = g.save(tmp_path / "model.onnx")
    x = (np.random.default_rng(1).standard_normal((1, 3, 8, 8)) * 1.5).astype(np.float32)
    model = checked_model(path, for_tvm=False)  # the lowered model
    assert not [n.op_type for n in model.graph.node if n.domain == DOMAIN]
    assert DOMAIN not in {o.domain for o in model.opset_import}
    assert len([n for n in model.graph.node if n.op_type == "Clip"]) == (0 if levels == 256 else len(NARROW))
    dqs = {n.output[0]: n for n in model.graph.node if n.op_type == "DequantizeLinear"}
    acts = [(src, out, lo, hi, lv) for src, out, lo, hi, lv in g.fqs if out not in {w + "q" for w in g.weights}]
    assert len(acts) == 6  # x, c1, r1, r2a, r2b, c3: every activation FakeQuantize
    values = _ort_values(model, x, [n for src, out, *_ in acts for n in (src, dqs[out].input[0])])
    values["x"] = x
    inits = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    for src, out, lo, hi, lv in acts:
        zero = inits[dqs[out].input[2]]
        level = values[dqs[out].input[0]].astype(np.int64) + (lv // 2 if zero.dtype == np.int8 else 0)
        np.testing.assert_array_equal(level, fake_quantize(values[src], lo, hi, lv), err_msg=out)
    assert inits[dqs["xq"].input[2]].dtype == np.int8 and inits[dqs["r1q"].input[2]].dtype == np.uint8
    assert int(inits[dqs["y"].input[2]]) == 100 and inits[dqs["y"].input[2]].dtype == np.uint8
    for name, (w, lo, hi) in g.weights.items():
        ints = inits[name + "q_int"]
        assert ints.dtype == np.int8 and ints.min() >= -127  # narrow range
        np.testing.assert_array_equal(ints.astype(np.int64) + 127, fake_quantize(w, lo, hi, 255), err_msg=name)


def test_lowered_weights_are_openvinos_integers(fq_model):
    ov = _openvino()
    path, x, g = fq_model
    core = ov.Core()
    m = core.read_model(str(path))
    m.add_outputs([n + "q" for n in g.weights])  # OpenVINO folds each weight's FakeQuantize
    compiled = core.compile_model(m, "CPU", {"INFERENCE_PRECISION_HINT": "f32"})
    result = compiled({"x": x})
    folded = {name: np.array(v) for port, v in result.items() for name in port.get_names()}
    inits = {t.name: numpy_helper.to_array(t) for t in checked_model(path, for_tvm=False).graph.initializer}
    for name, (w, lo, hi) in g.weights.items():
        step = (hi - lo) / np.float32(254)
        np.testing.assert_array_equal(np.round((folded[name + "q"] - lo) / step).astype(np.int64) - 127,
                                      inits[name + "q_int"].astype(np.int64), err_msg=name)


def _run(path: Path, x_file: Path, out: Path) -> dict:
    assert irgen_main(["run", str(path), "-o", str(out), "--input", str(x_file), "--no-progress", "--no-cache"]) == 0
    ir = json.loads((out / "ir.json").read_text())
    assert ir["producer"]["quantizer"] == "qdq"
    return ir


def _golden_equals_onnxruntime(path: Path, x: np.ndarray, out: Path, ir: dict) -> int:
    """Every layer output irgen wrote equals ONNX Runtime on the lowered Q/DQ graph (end to end,
    every value); returns how many integer kernels were compared."""
    names = {s for layer in ir["layers"] for s in (layer.get("source") or {}).get("outputs") or [] if s}
    values = _ort_values(checked_model(path, for_tvm=False), x, names)
    kernels = 0
    for layer in ir["layers"]:
        for rec, src in zip(layer["outputs"], (layer.get("source") or {}).get("outputs") or []):
            if src is None:
                continue
            golden = np.load(out / rec["file"])
            if golden.dtype.kind in "iu":
                np.testing.assert_array_equal(golden, values[src], err_msg=layer["name"])
                kernels += (layer.get("quant") or {}).get("kind") == "conv2d" \
                    and layer["quant"].get("realization") != "float"
            else:
                np.testing.assert_allclose(golden, values[src], rtol=1e-5, atol=1e-6, err_msg=layer["name"])
    return kernels


def test_a_fakequantize_model_equals_onnxruntime_on_its_lowered_graph(fq_model, tmp_path):
    path, x, _ = fq_model
    out = tmp_path / "out"
    ir = _run(path, path.parent / "x.npy", out)
    assert _golden_equals_onnxruntime(path, x, out, ir) == 3  # conv2a, conv2b, conv3 as integer kernels
    y = _ort_values(checked_model(path, for_tvm=False), x, [])["y"]
    np.testing.assert_array_equal(np.load(out / ir["outputs"][0]["file"]), y)


def _assert_within_openvino(result: dict, ir: dict) -> list[int]:
    """verify passed against OpenVINO, each compared layer within 1 LSB of it recomputed from
    OpenVINO's own inputs; returns each integer layer's local LSB."""
    assert result["passed"] and result["source"]["ran"], result["problems"]
    assert result["source"]["runtime"].startswith("openvino "), result["source"]
    lsb = []
    for row in result["layers"]:
        m = row["checks"]["source"]
        if m["status"] == "missing":
            assert "no source tensor" in str(m.get("message")), (row["name"], m)
            continue
        assert m["status"] == "pass", (row["name"], m)
        if row["integer"]:
            lsb.append(m["local"]["max_lsb"] if m.get("local") else m["max_lsb"])
    assert lsb and max(lsb) <= 1, lsb
    return lsb


def test_a_fakequantize_model_verifies_against_openvino(fq_model, tmp_path, capsys):
    _openvino()
    path, _, _ = fq_model
    out = tmp_path / "out"
    ir = _run(path, path.parent / "x.npy", out)
    code, result = _verify_json(capsys, out)
    assert code == 0
    assert len(_assert_within_openvino(result, ir)) >= 6


@pytest.mark.parametrize("levels", [255, 16])
def test_activations_of_fewer_levels_equal_onnxruntime_and_openvino(levels, fq_model, tmp_path, capsys):
    x_file = fq_model[0].parent / "x.npy"
    path = _Graph(**{out: {"levels": levels} for out in NARROW}).save(tmp_path / "narrow.onnx")
    out = tmp_path / "out"
    ir = _run(path, x_file, out)
    assert [layer["op"] for layer in ir["layers"]].count("clip") >= 1  # r1q's, behind the Relu's table
    _golden_equals_onnxruntime(path, np.load(x_file), out, ir)
    _openvino()
    code, result = _verify_json(capsys, out)
    assert code == 0
    _assert_within_openvino(result, ir)


def test_the_nncf_fixture_equals_onnxruntime_and_openvino(tmp_path, capsys):
    path = toolkits.fixture("nncf-torch")
    x = toolkits.fixture_input("nncf-torch")
    np.save(tmp_path / "x.npy", x)
    out = tmp_path / "out"
    ir = _run(path, tmp_path / "x.npy", out)
    _golden_equals_onnxruntime(path, x, out, ir)
    pytest.importorskip("openvino", reason="openvino is not installed (pip install openvino==2026.4.1)")
    code, result = _verify_json(capsys, out)
    assert code == 0
    _assert_within_openvino(result, ir)


def test_without_openvino_the_source_check_names_the_package(fq_model, monkeypatch):
    from irgen.plugin import IrgenError
    from irgen_onnx.runner import source_runner

    monkeypatch.setitem(sys.modules, "openvino", None)  # import openvino fails
    with pytest.raises(IrgenError, match=r"pip install openvino==2026\.4\.1"):
        source_runner(fq_model[0], {})


def _refused(tmp_path, capsys, graph: _Graph, node: str, *words) -> None:
    path = graph.save(tmp_path / "refused.onnx")
    assert irgen_main(["run", str(path), "-o", str(tmp_path / "out"), "--no-progress", "--no-cache"]) == 2
    err = capsys.readouterr().err
    assert f"OpenVINO FakeQuantize '{node}'" in err and all(w in err for w in words) and "Traceback" not in err, err


@pytest.mark.parametrize("changes, node, words", [
    ({"r1q": {"out_lo": 0.5}}, "fq_r1q", ("output range differs from its input range",)),
    ({"xq": {"levels": 255}}, "fq_xq", ("127.498 is not an integer",)),  # a signed 256-level range
    ({"xq": {"levels": 300}}, "fq_xq", ("levels 300",)),
], ids=["requantization", "half-zero-point", "levels"])
def test_a_fakequantize_with_no_quantizelinear_is_refused(changes, node, words, tmp_path, capsys):
    _refused(tmp_path, capsys, _Graph(**changes), node, *words)


def test_a_fractional_zero_point_is_refused(tmp_path, capsys):
    g = _Graph()
    k = next(k for k, t in enumerate(g.inits) if t.name == "y_lo")
    g.inits[k] = numpy_helper.from_array(np.float32(-1.0), "y_lo")  # range -1..7.75: zero point 32.9
    _refused(tmp_path, capsys, g, "fq_y", "is not an integer")


def test_a_computed_range_is_refused(tmp_path, capsys):
    g = _Graph()
    node = next(n for n in g.nodes if n.name == "fq_r1q")
    g.nodes.insert(0, helper.make_node("Abs", [node.input[2]], ["hi_abs"], name="abs"))
    node.input[2] = node.input[4] = "hi_abs"
    _refused(tmp_path, capsys, g, "fq_r1q", "not constants")


#: NNCF's torch backend on torchvision models (the toolkit matrix's cases): whether every integer
#: tensor of the golden data equals ONNX Runtime on the lowered graph end to end (MobileNetV2's float
#: spans, its BatchNormalizations left between Conv and ReLU, round a value the other way and the
#: difference grows along the chain: there each layer is checked locally, by verify)
NNCF_TORCH = {"resnet18": True, "squeezenet1_1": True, "mobilenet_v2": False}


@pytest.mark.slow
@pytest.mark.parametrize("arch", NNCF_TORCH)
def test_nncf_torch_models_equal_onnxruntime_and_openvino(arch, tmp_path_factory, capsys):
    import subprocess

    from test_toolkits import _python_with

    python = _python_with("nncf")
    if python is None:
        pytest.skip("nncf is not importable here nor in IRGEN_TOOLKIT_PYTHON (python tests/toolkits.py --help)")
    folder = tmp_path_factory.mktemp(f"nncf-torch-{arch}")
    p = subprocess.run([python, toolkits.__file__, "--build", f"nncf-torch-{arch}", "--out", str(folder)],
                       capture_output=True, text=True)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    path, feeds = toolkits.build(f"nncf-torch-{arch}", folder)  # found there, not built again
    x = feeds["x"]
    np.save(folder / "x.npy", x)
    out = folder / "out"
    ir = _run(path, folder / "x.npy", out)
    if NNCF_TORCH[arch]:
        _golden_equals_onnxruntime(path, x, out, ir)
    _openvino()
    code, result = _verify_json(capsys, out)
    assert code == 0
    _assert_within_openvino(result, ir)
