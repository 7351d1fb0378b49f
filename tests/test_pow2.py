"""pow2: power-of-two QDQ models requantized by shifts, exact against ONNX Runtime."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")
from onnx import numpy_helper  # noqa: E402

import models  # noqa: E402
from layercheck import assert_layer_recomputes  # noqa: E402
from irgen.cli import main  # noqa: E402
from test_qdq import ort_tensors, quantized  # noqa: E402


def pow2_model(src: Path, dst: Path, keep_zero_points: bool = False) -> Path:
    """Rewrite an int8 QDQ model: every scale to its nearest power of two, zero
    points to 0 (``keep_zero_points``: the activations' as calibrated, as Quark's XINT8 and
    Vitis AI keep uint8's 128), and int32 biases re-expressed in scale s_x * s_w."""
    m = onnx.load(str(src))
    inits = {t.name: t for t in m.graph.initializer}
    arr = {n: numpy_helper.to_array(t) for n, t in inits.items()}
    producer = {o: n for n in m.graph.node for o in n.output}
    biases = {}  # bias DQ node -> (x scale name, w scale name)
    for n in m.graph.node:
        if n.op_type in ("Conv", "Gemm") and len(n.input) > 2:
            dq = [producer.get(i) for i in n.input[:3]]
            if all(d is not None and d.op_type == "DequantizeLinear" for d in dq):
                biases[dq[2].name] = (dq[0].input[1], dq[1].input[1])
    new = dict(arr)
    for n in m.graph.node:
        if n.op_type in ("QuantizeLinear", "DequantizeLinear") and n.name not in biases:
            s = arr[n.input[1]].astype(np.float64)
            new[n.input[1]] = np.exp2(np.round(np.log2(s))).astype(np.float32)
            weight = n.input[0] in arr
            if len(n.input) > 2 and n.input[2] in arr and (weight or not keep_zero_points):
                new[n.input[2]] = np.zeros_like(arr[n.input[2]])
    for n in m.graph.node:
        if n.name in biases:
            xs, ws = biases[n.name]
            real = arr[n.input[0]].astype(np.float64) * arr[n.input[1]].astype(np.float64)
            bs = (new[xs].astype(np.float64) * new[ws].astype(np.float64)).astype(np.float32)
            new[n.input[1]] = bs
            new[n.input[0]] = np.round(real / bs).astype(np.int32)
    for k, t in enumerate(m.graph.initializer):
        if t.name in new:
            m.graph.initializer[k].CopyFrom(numpy_helper.from_array(new[t.name], t.name))
    onnx.save(m, str(dst))
    return dst


@pytest.fixture(scope="module", params=["small_cnn", "mlp", "small_cnn-zero-points", "mlp-zero-points"])
def case(request, tmp_path_factory):
    arch, _, zp = request.param.partition("-")
    folder = tmp_path_factory.mktemp(f"pow2_{request.param}")
    path = pow2_model(quantized(arch, True, "s8", folder), folder / "pow2.onnx", keep_zero_points=bool(zp))
    x = np.random.default_rng(3).standard_normal(models.BUILDERS[arch][1]).astype(np.float32)
    np.save(folder / "x.npy", x)
    out = folder / "out"
    assert main(["run", str(path), "-o", str(out), "--input", str(folder / "x.npy"), "--no-progress"]) == 0
    ir = json.loads((out / "ir.json").read_text())
    names = [s for layer in ir["layers"] for s in layer["source"]["outputs"]]
    return {"path": path, "x": x, "out": out, "ir": ir, "ref": ort_tensors(path, x, names), "folder": folder,
            "zero_points": bool(zp)}


def test_pow2_is_detected_and_records_shifts(case):
    ir = case["ir"]
    assert ir["producer"]["quantizer"] == "pow2"
    convs = [l for l in ir["layers"] if l["quant"] and l["quant"]["kind"] in ("conv2d", "depthwise_conv2d", "dense")]
    assert convs
    for layer in convs:
        rq = layer["quant"]["requant"]
        assert "scale" not in rq and all(isinstance(s, int) for s in rq["shift"]), rq
    zero_points = {layer["quant"]["output"]["zero_point"] for layer in convs}
    assert zero_points != {0} if case["zero_points"] else zero_points == {0}


def test_every_integer_layer_matches_onnxruntime(case):
    out, ref = case["out"], case["ref"]
    checked = 0
    for layer in case["ir"]["layers"]:
        for rec, src in zip(layer["outputs"], layer["source"]["outputs"]):
            got = np.load(out / rec["file"])
            if got.dtype.kind == "f":
                continue  # a float tail (e.g. softmax on dequantized values) is not this scheme's
            np.testing.assert_array_equal(got, ref[src], err_msg=layer["name"])
            checked += 1
    assert checked >= 3


def test_layers_recompute_from_shifts_and_parameters(case):
    out = case["out"]
    for layer in case["ir"]["layers"]:
        if not layer["quant"] or layer["quant"]["kind"] in ("dequantize",):
            continue
        assert_layer_recomputes(out, layer, 0)


def test_forcing_pow2_on_other_scales_names_the_tensor(tmp_path, capsys):
    path = quantized("mlp", True, "s8", tmp_path)
    code = main(["run", str(path), "-o", str(tmp_path / "out"), "--quantizer", "pow2", "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1
    assert "not a power-of-two model" in err and "is not a power of two" in err
    assert not (tmp_path / "out").exists()
