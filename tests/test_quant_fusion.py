"""Backend fusion rules on quantized layers that requantize (issue 12 point 2), and quantized rolls.

A backend registered for the test (``irgen.testing``'s ``irgen_plugin``) has the rules
conv/dense -> add (``tensor_operands``: the residual's other operand) and conv/dense ->
relu/clip/sigmoid, both with ``requantized_followers``. On an ONNX QDQ model (onnxruntime's ``quantize_static``, symmetric
activations so each Relu is a table layer of its own) and on a TFLite int8 model:

- the merged layers appear (op, ``quant.kind: fused``, each step's scheme kind, ``ops``
  and ``args``, the follower's source nodes), a residual whose other operand is computed
  after the anchor runs after it;
- every activation file of the merged run equals the unmerged run's file of the same
  tensor byte for byte (the merged layer's output is the last follower's);
- ``irgen verify`` passes single, entire and source (onnxruntime, the TFLite interpreter),
  and the numpy recompute of each merged layer equals its golden output;
- verify fails when a step's requantization (multiplier, shift, requant scale) or a
  step's zero point is edited in ``ir.json``;
- without ``tensor_operands`` a residual add stays a layer of its own, without
  ``requantized_followers`` a relu table does (the IR is then the default backend's).

Quantized rolls: a ``torch.roll`` exported to ONNX and quantized (QDQ), and a
``tf.roll`` converted to TFLite int8 (SLICE, SLICE, CONCATENATION per axis) are one
``roll`` layer whose ``shifts``/``axes`` are the module's arguments (normalized), and
``np.roll`` of its input file is its output file; verify passes against the runtime.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")
torch = pytest.importorskip("torch")

sys.path.insert(0, str(Path(__file__).parent))

import irgen.testing as it  # noqa: E402
from irgen import quant  # noqa: E402
from irgen.plugin import Backend, FusionRule, hookimpl  # noqa: E402

MAC = frozenset({"relax.nn.conv2d", "relax.matmul"})
ACTS = frozenset({"relax.nn.relu", "relax.clip", "relax.sigmoid"})


class FuseBackend:
    """conv/dense -> residual add (other operand allowed), conv/dense -> activation."""

    name = "fuse-steps"
    operands = True
    requantized = True

    @hookimpl
    def irgen_register_backends(self, register):
        register(Backend(name=self.name, fusion_rules=[
            FusionRule("mac_residual", MAC, (frozenset({"relax.add"}),), required=frozenset({0}),
                       tensor_operands=self.operands, requantized_followers=True),
            FusionRule("mac_act", MAC, (ACTS,), requantized_followers=self.requantized),
        ], description="test: quantized followers that requantize"))


class NoOperandsBackend(FuseBackend):
    """The residual rule without ``tensor_operands``, the activation rule without ``requantized_followers``."""

    name = "fuse-no-operands"
    operands = False
    requantized = False


# ------------------------------------------------------------------ models


def _qdq_model(folder: Path, module, name: str) -> tuple[Path, Path]:
    """``module`` (input ``[1, 3, 8, 8]``) exported to ONNX, quantized by onnxruntime (QDQ,
    per-channel int8 weights, symmetric int8 activations: each Relu stays a node of its own);
    and an input file."""
    from onnxruntime.quantization.shape_inference import quant_pre_process

    from irgen.testing.models import SHAPE, input_npy, quantize_qdq

    folder.mkdir(parents=True, exist_ok=True)
    path, pre, out = folder / f"{name}.onnx", folder / f"{name}_pre.onnx", folder / f"{name}_qdq.onnx"
    torch.onnx.export(module.eval(), (torch.randn(*SHAPE),), str(path), dynamo=False, opset_version=13,
                      input_names=["x"], output_names=["y"], do_constant_folding=False)
    quant_pre_process(str(path), str(pre), skip_symbolic_shape=True)
    quantize_qdq(pre, out, extra_options={"ActivationSymmetric": True})
    return out, input_npy(folder / "x.npy")


class Residual(torch.nn.Module):
    """conv -> relu, conv -> residual add, conv -> relu, mean, dense -> relu, dense -> residual add."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.c1 = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.c2 = torch.nn.Conv2d(8, 8, 3, padding=1)
        self.c3 = torch.nn.Conv2d(8, 8, 1)
        self.fc1, self.fc2 = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

    def forward(self, x):
        a = torch.relu(self.c1(x))
        b = self.c2(a) + a
        c = torch.relu(self.c3(b))
        h = torch.relu(self.fc1(c.mean((2, 3))))
        return self.fc2(h) + h


class Roll(torch.nn.Module):
    SHIFTS, DIMS = (2, -3), (2, 3)

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.c1, self.c2 = torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.Conv2d(8, 4, 1)

    def forward(self, x):
        return self.c2(torch.roll(self.c1(x), shifts=self.SHIFTS, dims=self.DIMS))


TF_ROLL = ([2, -3], [1, 2])


def _tflite_resid(tf):
    """conv -> residual add, conv -> sigmoid, mean, dense -> residual add (its other operand
    a reshape computed after the dense layer)."""
    L = tf.keras.layers
    x = L.Input((8, 8, 3), batch_size=1, name="x")
    c1 = L.Conv2D(8, 3, padding="same", activation="relu", name="conv1")(x)
    r = L.Add(name="res1")([L.Conv2D(8, 3, padding="same", name="conv2")(c1), c1])
    s = L.Activation("sigmoid", name="sig")(L.Conv2D(8, 1, name="conv3")(r))
    h = L.Dense(8, activation="relu", name="fc1")(L.GlobalAveragePooling2D(name="gap")(s))
    y = L.Add(name="res2")([L.Dense(8, name="fc2")(h), h])
    return tf.keras.Model(x, L.Dense(4, name="fc3")(y)), (1, 8, 8, 3)


def _tflite_roll(tf):
    L = tf.keras.layers
    x = L.Input((8, 8, 3), batch_size=1, name="x")
    c = L.Conv2D(8, 3, padding="same", name="conv1")(x)
    r = L.Lambda(lambda t: tf.roll(t, shift=TF_ROLL[0], axis=TF_ROLL[1]), name="roll")(c)
    return tf.keras.Model(x, L.Conv2D(4, 1, name="conv2")(r)), (1, 8, 8, 3)


def _tflite_model(folder: Path, name: str, builder) -> tuple[Path, Path]:
    pytest.importorskip("tensorflow")
    import tflite_models

    tflite_models.BUILDERS.setdefault(name, builder)
    path, x = tflite_models.export(name, folder, "int8")
    np.save(folder / f"{name}_x.npy", x)
    return path, folder / f"{name}_x.npy"


@pytest.fixture(scope="module")
def qdq_residual(tmp_path_factory):
    return _qdq_model(tmp_path_factory.mktemp("qdq_residual"), Residual(), "residual")


@pytest.fixture(scope="module")
def tflite_residual(tmp_path_factory):
    return _tflite_model(tmp_path_factory.mktemp("tflite_residual"), "fusion_resid", _tflite_resid)


# ------------------------------------------------------------------ helpers


def _run_both(model: Path, x: Path, tmp: Path, irgen_plugin, backend: str = FuseBackend.name):
    """(unmerged ir, merged ir): the default backend and the test's backend, same model."""
    irgen_plugin(FuseBackend())
    irgen_plugin(NoOperandsBackend())
    plain = it.run_model(model, tmp / "plain", inputs=[x])
    fused = it.run_model(model, tmp / "fused", backend=backend, inputs=[x])
    return plain, fused


def _outputs_equal_bytes(plain_dir: Path, plain: dict, fused_dir: Path, fused: dict) -> int:
    """Every output file of the merged run is the unmerged run's file of that tensor, byte for byte."""
    files = {o["name"]: o["file"] for layer in plain["layers"] for o in layer["outputs"]}
    n = 0
    for layer in fused["layers"]:
        for o in layer["outputs"]:
            assert (fused_dir / o["file"]).read_bytes() == (plain_dir / files[o["name"]]).read_bytes(), o["name"]
            n += 1
    return n


def _load(out: Path, rec: dict) -> np.ndarray:
    return np.load(out / rec["file"], allow_pickle=False)


def _recomputes(out: Path, layer: dict) -> None:
    """The numpy recompute of the merged layer, step by step from its quant record, is its golden output."""
    params = {role: _load(out, p) for role, p in layer["params"].items()}
    got = quant.recompute(layer, [_load(out, r) for r in layer["inputs"]], params)
    golden = _load(out, layer["outputs"][0])
    assert got.dtype == golden.dtype and np.array_equal(got, golden), layer["name"]


def _verify_all(out: Path) -> dict:
    result = it.verify(out, modes=("single", "entire", "source"))
    assert result["passed"], _table(result)
    assert {c for row in result["layers"] for c in row["checks"]} == {"single", "entire", "source"}
    assert not result["notes"], result["notes"]  # no layer checked with its fused_ops alone
    return result


def _table(result: dict) -> str:
    from irgen.verify import format_table

    return format_table(result)


def _edited(src: Path, dst: Path, edit) -> Path:
    shutil.copytree(src, dst)
    ir = json.loads((dst / "ir.json").read_text())
    edit(ir)
    (dst / "ir.json").write_text(json.dumps(ir))
    return dst


def _fails(out: Path, layer_name: str) -> None:
    result = it.verify(out, modes=("single",))
    assert not result["passed"]
    bad = {row["name"] for row in result["layers"] if row["status"] != "pass"}
    assert layer_name in bad, _table(result)


def _merged_run_is_exact(tmp: Path, plain: dict, fused: dict, merged) -> None:
    """Every output file of the merged run (``tmp/fused``) is the unmerged run's (``tmp/plain``),
    the ``merged`` layers recompute step by step to it, and verify passes every check."""
    assert _outputs_equal_bytes(tmp / "plain", plain, tmp / "fused", fused) == len(fused["layers"])
    for layer in fused["layers"]:
        if layer["name"] in merged:
            _recomputes(tmp / "fused", layer)
    _verify_all(tmp / "fused")


def _each_edit_fails(model: Path, x: Path, tmp: Path, irgen_plugin, edits) -> None:
    """The merged run's ``ir.json`` edited by each ``(edit, layer)``: verify fails that layer."""
    irgen_plugin(FuseBackend())
    out = tmp / "fused"
    it.run_model(model, out, backend=FuseBackend.name, inputs=[x])
    for edit, layer in edits:
        _fails(_edited(out, tmp / edit.__name__, edit), layer)


def _layer(ir: dict, name: str) -> dict:
    return next(layer for layer in ir["layers"] if layer["name"] == name)


# ------------------------------------------------------------------ ONNX QDQ


def test_qdq_residual_and_activation_layers_merge(qdq_residual, tmp_path, irgen_plugin):
    model, x = qdq_residual
    plain, fused = _run_both(model, x, tmp_path, irgen_plugin)
    names = [layer["name"] for layer in plain["layers"]]
    assert {"Relu", "Add", "Relu_1", "Relu_2", "Add_1"} <= set(names)
    assert _layer(plain, "Relu")["quant"]["kind"] == "lut" and _layer(plain, "Add")["quant"]["kind"] == "add"

    layers = {layer["name"]: layer for layer in fused["layers"]}
    assert [l["name"] for l in fused["layers"]] == [
        "x_QuantizeLinear", "c1_Conv", "c2_Conv", "c3_Conv", "ReduceMean", "fc1_Gemm", "fc2_Gemm", "y_DequantizeLinear"]
    expect = {"c1_Conv": ("conv2d", "lut", "Relu"), "c2_Conv": ("conv2d", "add", "Add"),
              "c3_Conv": ("conv2d", "lut", "Relu_1"), "fc1_Gemm": ("dense", "lut", "Relu_2"),
              "fc2_Gemm": ("dense", "add", "Add_1")}
    for name, (op, follower, follower_layer) in expect.items():
        layer = layers[name]
        q = layer["quant"]
        assert layer["op"] == op and q["kind"] == "fused" and q["scheme"] == "qdq"
        assert [s["kind"] for s in q["steps"]] == [op, follower]
        assert sum(s["ops"] for s in q["steps"]) == len(layer["fused_ops"])
        unmerged = _layer(plain, follower_layer)
        assert layer["outputs"][0]["name"] == unmerged["outputs"][0]["name"]
        assert q["output"] == unmerged["quant"]["output"] == q["steps"][1]["output"]
        assert set(unmerged["source"]["nodes"]) <= set(layer["source"]["nodes"])
        # the follower's record is the unmerged layer's own, with where its ops and inputs are
        assert {k: v for k, v in q["steps"][1].items() if k not in ("ops", "args")} == unmerged["quant"]
        assert q["steps"][1]["ops"] == len(unmerged["fused_ops"])
    # the residual's other operand is the conv's own input: input:0 for both steps
    assert layers["c2_Conv"]["quant"]["steps"][1]["args"] == ["step:0", "input:0"]
    assert layers["c1_Conv"]["attrs"]["activation"] == {"op": "relu"}
    assert "activation" not in layers["c2_Conv"]["attrs"]

    _merged_run_is_exact(tmp_path, plain, fused, expect)


def test_qdq_edited_step_fails_verify(qdq_residual, tmp_path, irgen_plugin):
    def conv_scale(ir):
        rq = _layer(ir, "c2_Conv")["quant"]["steps"][0]["requant"]
        rq["scale"] = [s * 1.25 for s in rq["scale"]]

    def add_scale(ir):
        rq = _layer(ir, "c2_Conv")["quant"]["steps"][1]["requant"]
        rq["scale"] = [rq["scale"][0] * 1.25, rq["scale"][1]]

    def dense_zero_point(ir):  # (the add's record derives its constant from the zero points: it reads none)
        _layer(ir, "fc2_Gemm")["quant"]["steps"][0]["output"]["zero_point"] += 3

    def lut_table(ir):
        step = _layer(ir, "c3_Conv")["quant"]["steps"][1]
        step["table"] = [min(v + 1, 127) for v in step["table"]]

    _each_edit_fails(*qdq_residual, tmp_path, irgen_plugin, [
        (conv_scale, "c2_Conv"), (add_scale, "c2_Conv"), (dense_zero_point, "fc2_Gemm"), (lut_table, "c3_Conv")])


def test_without_the_flags_followers_stay(qdq_residual, tmp_path, irgen_plugin):
    """Without ``tensor_operands`` the residual add stays a layer, without
    ``requantized_followers`` the relu table does: the IR is the default backend's."""
    model, x = qdq_residual
    plain, fused = _run_both(model, x, tmp_path, irgen_plugin, backend=NoOperandsBackend.name)
    assert [layer["name"] for layer in fused["layers"]] == [layer["name"] for layer in plain["layers"]]
    assert all(layer["quant"]["kind"] != "fused" for layer in fused["layers"])
    assert _outputs_equal_bytes(tmp_path / "plain", plain, tmp_path / "fused", fused) == len(plain["layers"])


# ------------------------------------------------------------------ TFLite int8


def test_tflite_residual_and_activation_layers_merge(tflite_residual, tmp_path, irgen_plugin):
    model, x = tflite_residual
    plain, fused = _run_both(model, x, tmp_path, irgen_plugin)
    assert [l["name"] for l in plain["layers"]] == [
        "CONV_2D_0", "CONV_2D_1", "ADD_2", "CONV_2D_3", "LOGISTIC_4", "MEAN_5", "FULLY_CONNECTED_6",
        "FULLY_CONNECTED_7", "RESHAPE_8", "ADD_9", "FULLY_CONNECTED_10"]
    # the dense -> add layer reads the reshape computed after the dense layer: it runs after it
    assert [l["name"] for l in fused["layers"]] == [
        "CONV_2D_0", "CONV_2D_1", "CONV_2D_3", "MEAN_5", "FULLY_CONNECTED_6", "RESHAPE_8", "FULLY_CONNECTED_7",
        "FULLY_CONNECTED_10"]
    layers = {layer["name"]: layer for layer in fused["layers"]}
    expect = {"CONV_2D_1": ("conv2d", "add", "ADD_2"), "CONV_2D_3": ("conv2d", "lut", "LOGISTIC_4"),
              "FULLY_CONNECTED_7": ("dense", "add", "ADD_9")}
    for name, (op, follower, follower_layer) in expect.items():
        layer, unmerged = layers[name], _layer(plain, follower_layer)
        q = layer["quant"]
        assert layer["op"] == op and q["kind"] == "fused" and q["scheme"] == "tflite-int8"
        assert [s["kind"] for s in q["steps"]] == [op, follower]
        assert {k: v for k, v in q["steps"][1].items() if k not in ("ops", "args")} == unmerged["quant"]
        assert layer["outputs"][0]["name"] == unmerged["outputs"][0]["name"]
    assert layers["CONV_2D_1"]["quant"]["steps"][1]["args"] == ["step:0", "input:0"]
    dense = layers["FULLY_CONNECTED_7"]
    assert [i["name"] for i in dense["inputs"]] == [
        _layer(plain, "FULLY_CONNECTED_7")["inputs"][0]["name"], _layer(plain, "RESHAPE_8")["outputs"][0]["name"]]
    assert dense["quant"]["steps"][1]["args"] == ["step:0", "input:1"]
    assert dense["inputs"][1]["producer"] == "RESHAPE_8"
    assert layers["CONV_2D_3"]["attrs"]["activation"] == {"op": "sigmoid"} and "table" in layers["CONV_2D_3"]["params"]

    _merged_run_is_exact(tmp_path, plain, fused, expect)


def test_tflite_edited_step_fails_verify(tflite_residual, tmp_path, irgen_plugin):
    def conv_multiplier(ir):
        rq = _layer(ir, "CONV_2D_1")["quant"]["steps"][0]["requant"]
        rq["multiplier"] = [m + 4096 for m in rq["multiplier"]]

    def conv_shift(ir):
        rq = _layer(ir, "CONV_2D_1")["quant"]["steps"][0]["requant"]
        rq["shift"] = [s + 1 for s in rq["shift"]]

    def add_multiplier(ir):
        rq = _layer(ir, "FULLY_CONNECTED_7")["quant"]["steps"][1]["requant"]
        rq["multiplier"] = int(rq["multiplier"]) + (1 << 24)

    def add_zero_point(ir):
        _layer(ir, "CONV_2D_1")["quant"]["steps"][1]["output"]["zero_point"] += 2

    _each_edit_fails(*tflite_residual, tmp_path, irgen_plugin, [
        (conv_multiplier, "CONV_2D_1"), (conv_shift, "CONV_2D_1"), (add_multiplier, "FULLY_CONNECTED_7"),
        (add_zero_point, "CONV_2D_1")])


# ------------------------------------------------------------------ quantized roll


def _check_roll(out: Path, ir: dict, shifts, axes) -> None:
    rolls = [layer for layer in ir["layers"] if layer["op"] == "roll"]
    assert len(rolls) == 1, [l["op"] for l in ir["layers"]]
    layer = rolls[0]
    shape = layer["inputs"][0]["shape"]
    assert layer["attrs"]["axes"] == list(axes)
    assert layer["attrs"]["shifts"] == [s % shape[a] for s, a in zip(shifts, axes)]
    q = layer["quant"]
    assert q["kind"] == "integer" and q["op"] == "roll" and q["inputs"][0] == q["output"]
    x, y = _load(out, layer["inputs"][0]), _load(out, layer["outputs"][0])
    assert x.dtype == np.int8 and np.array_equal(np.roll(x, shifts, axes), y)
    _verify_all(out)


def test_qdq_roll_is_one_roll_layer(tmp_path):
    model, x = _qdq_model(tmp_path / "m", Roll(), "roll")
    ir = it.run_model(model, tmp_path / "out", inputs=[x])
    _check_roll(tmp_path / "out", ir, Roll.SHIFTS, Roll.DIMS)


def test_tflite_roll_is_one_roll_layer(tmp_path):
    model, x = _tflite_model(tmp_path, "fusion_roll", _tflite_roll)
    ir = it.run_model(model, tmp_path / "out", inputs=[x])
    assert [layer["op"] for layer in ir["layers"]] == ["conv2d", "roll", "conv2d"]
    _check_roll(tmp_path / "out", ir, *TF_ROLL)
