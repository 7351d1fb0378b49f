"""Low-bit and block-wise weights: MatMulNBits, opset-21 block DequantizeLinear of INT4/UINT4
weights, and float8 (E4M3FN, E5M2) QuantizeLinear/DequantizeLinear.

Each model is built here (onnxruntime's ``MatMulNBitsQuantizer`` on a float MLP, or
``onnx.helper``), run through ``irgen run`` (and ``irgen verify`` in ``single`` and ``entire``, by
conftest), and every layer output irgen writes is compared with onnxruntime's own value of that
tensor, bit for bit: the weight-only layers' float32 sums are MLAS's (one SGEMM pass over K, the
16-lane vector kernel for one row, K slices for other layouts, MLAS's one-row SGEMM kernel for
one row of those), the float8 quantize layers ONNX
Runtime's rounding. Before irgen took them, MatMulNBits was refused as an unsupported op, a float8
QuantizeLinear stopped TVM's importer ("zero_point param datatype should be one of ..."), and a
block DequantizeLinear's weights reached the IR only as float32 values, without their blocks.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
ml_dtypes = pytest.importorskip("ml_dtypes")
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

from irgen.cli import main as irgen_main  # noqa: E402
from irgen_onnx.runner import inference_session  # noqa: E402


def _mlp(k: int, h: int, n: int, rows, seed: int = 0, opset: int = 21):
    """x [*rows, k] -> MatMul -> Add -> Relu -> MatMul -> y [*rows, n], float32 (``rows``: an int or a shape)."""
    rows = list(rows) if isinstance(rows, (list, tuple)) else [rows]
    rng = np.random.default_rng(seed)
    inits = [numpy_helper.from_array((rng.standard_normal((k, h)) * 0.2).astype(np.float32), "W1"),
             numpy_helper.from_array((rng.standard_normal(h) * 0.1).astype(np.float32), "B1"),
             numpy_helper.from_array((rng.standard_normal((h, n)) * 0.2).astype(np.float32), "W2")]
    nodes = [helper.make_node("MatMul", ["x", "W1"], ["h"], name="mm1"),
             helper.make_node("Add", ["h", "B1"], ["hb"], name="add1"),
             helper.make_node("Relu", ["hb"], ["r"], name="relu"),
             helper.make_node("MatMul", ["r", "W2"], ["y"], name="mm2")]
    g = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [*rows, k])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [*rows, n])], initializer=inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])


def _nbits(model, block: int, symmetric: bool, level: int = 0):
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    q = MatMulNBitsQuantizer(model, block_size=block, is_symmetric=symmetric, accuracy_level=level)
    q.process()
    return q.model.model


def _run(tmp_path: Path, model, rows, k: int, seed: int = 1) -> tuple[Path, Path, np.ndarray, dict]:
    path, out = tmp_path / "m.onnx", tmp_path / "out"
    onnx.save(model, path)
    rows = list(rows) if isinstance(rows, (list, tuple)) else [rows]
    x = np.random.default_rng(seed).standard_normal((*rows, k)).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    assert irgen_main(["run", str(path), "-o", str(out), "--input", str(tmp_path / "x.npy"), "--no-progress",
                       "--no-cache"]) == 0
    return path, out, x, json.loads((out / "ir.json").read_text())


def _ort_values(path: Path, x: np.ndarray, names: list[str]) -> dict[str, np.ndarray]:
    """onnxruntime's value of every tensor in ``names``, as ``irgen verify`` runs it (one thread)."""
    m = onnx.load(path)
    have = {o.name for o in m.graph.output}
    m.graph.output.extend(onnx.ValueInfoProto(name=t) for t in names if t not in have)
    sess = inference_session(m.SerializeToString(), quantized=True)
    outs = [o.name for o in sess.get_outputs()]
    return dict(zip(outs, sess.run(outs, {"x": x})))


def _assert_layers_equal_onnxruntime(out: Path, ir: dict, path: Path, x: np.ndarray) -> int:
    """Every layer output that names a source tensor equals onnxruntime's, bit for bit; returns
    how many values were compared."""
    pairs = [(rec, src) for layer in ir["layers"]
             for rec, src in zip(layer["outputs"], layer["source"].get("outputs") or []) if src]
    ref = _ort_values(path, x, [src for _, src in pairs])
    compared = 0
    for rec, src in pairs:
        got = np.load(out / rec["file"])
        np.testing.assert_array_equal(got, ref[src], err_msg=f"{rec['name']} vs onnxruntime's {src}")
        compared += got.size
    return compared


def _weight_only(ir: dict) -> list[dict]:
    return [layer for layer in ir["layers"] if (layer.get("quant") or {}).get("kind") == "weight_only"]


# ------------------------------------------------------------------ MatMulNBits


#: (block size, symmetric, rows): every block size the quantizer offers, with and without zero
#: points; K = 144 is no multiple of 32, 64 or 128 (a padded last block), N = 30 leaves two
#: columns after the groups of four of the one-row kernel
def _default_few(cases: list, keep: set[int]) -> list:
    """``cases`` as pytest params, those whose index is not in ``keep`` slow (the default suite
    keeps one of each order and form; ``-m slow`` runs them all)."""
    return [c if i in keep else pytest.param(*c, marks=pytest.mark.slow) for i, c in enumerate(cases)]


NBITS = [(16, True, 6), (16, False, 6), (32, True, 6), (32, False, 6), (64, True, 6), (64, False, 6),
         (128, True, 6), (128, False, 6), (32, False, 1), (128, True, 1)]


@pytest.mark.parametrize("block,symmetric,rows", NBITS, ids=[f"b{b}-{'sym' if s else 'zp'}-m{r}" for b, s, r in NBITS])
def test_matmul_nbits_equals_onnxruntime(block, symmetric, rows, tmp_path):
    model = _nbits(_mlp(144, 40, 30, rows), block, symmetric)
    inits = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    nodes = [n for n in model.graph.node if n.op_type == "MatMulNBits"]
    assert len(nodes) == 2
    path, out, x, ir = _run(tmp_path, model, rows, 144)
    assert ir["producer"]["quantizer"] == "qdq"
    layers = _weight_only(ir)
    assert [layer["name"] for layer in layers] == [n.name for n in nodes]
    for layer, node in zip(layers, nodes):
        qr, params = layer["quant"], layer["params"]
        w = qr["weight"]
        assert (w["dtype"], w["bits"], w["block_size"], w["axis"]) == ("uint4", 4, block, 0)
        assert qr["realization"] == "float" and layer["op"] == "dense"
        assert qr["accumulation"]["order"] == ("lanes16" if rows == 1 else "k")
        # the packed weights as MatMulNBits stores them; the per-block scales and zero points
        np.testing.assert_array_equal(np.load(out / params["weight"]["file"]), inits[node.input[1]])
        scale = np.load(out / params["scale"]["file"])
        np.testing.assert_array_equal(scale, inits[node.input[2]].reshape(scale.shape))
        zp = np.load(out / params["zero_point"]["file"])
        if symmetric:
            assert len(node.input) < 4 and (zp == 8).all()
        else:
            packed = inits[node.input[3]].reshape(zp.shape[0], -1)
            nib = np.stack([packed & 15, packed >> 4], -1).reshape(zp.shape[0], -1)[:, :zp.shape[1]]
            np.testing.assert_array_equal(zp, nib)
    assert _assert_layers_equal_onnxruntime(out, ir, path, x) == rows * (40 * 3 + 30)


def test_matmul_nbits_with_bias_and_3d_input_equals_onnxruntime(tmp_path):
    """MatMulNBits' bias (input 5: added after the sum, a layer of its own) on [2, 3, K] inputs."""
    model = _nbits(_mlp(144, 40, 30, [2, 3]), 32, False)
    node = [n for n in model.graph.node if n.op_type == "MatMulNBits"][1]
    bias = np.random.default_rng(7).standard_normal(30).astype(np.float32)
    model.graph.initializer.append(numpy_helper.from_array(bias, "B2"))
    node.input.extend(["", "B2"])
    path, out, x, ir = _run(tmp_path, model, [2, 3], 144)
    assert [layer["op"] for layer in ir["layers"]][-2:] == ["dense", "add"]
    assert ir["layers"][-1]["source"]["outputs"] == ["y"]
    assert _assert_layers_equal_onnxruntime(out, ir, path, x) == 6 * (40 * 3 + 30)


@pytest.mark.parametrize("level", [2, 3])
def test_matmul_nbits_fp16_bf16_levels_compute_in_float32(level, tmp_path):
    """accuracy_level 2 and 3 (fp16, bf16) on a float32 input: ONNX Runtime computes in float32 on x86."""
    model = _nbits(_mlp(144, 40, 30, 6), 64, True, level)
    path, out, x, ir = _run(tmp_path, model, 6, 144)
    assert len(_weight_only(ir)) == 2
    assert _assert_layers_equal_onnxruntime(out, ir, path, x) == 6 * (40 * 3 + 30)


@pytest.mark.parametrize("level", [4])
def test_matmul_nbits_int8_accuracy_level_is_refused(level, tmp_path, capsys):
    path = tmp_path / "m.onnx"
    onnx.save(_nbits(_mlp(64, 32, 16, 4), 32, False, level), path)
    assert irgen_main(["run", str(path), "-o", str(tmp_path / "out"), "--no-progress", "--no-cache"]) != 0
    err = capsys.readouterr().err
    assert f"accuracy_level={level} is not supported" in err and "'mm1_Q4'" in err and "int8" in err


def test_matmul_nbits_with_act_order_is_refused(tmp_path, capsys):
    model = _nbits(_mlp(64, 32, 16, 4), 32, False)
    node = next(n for n in model.graph.node if n.op_type == "MatMulNBits")
    model.graph.initializer.append(numpy_helper.from_array(np.arange(64, dtype=np.int32) // 32, "g_idx"))
    node.input.extend([""] * (4 - len(node.input)) + ["g_idx"])
    path = tmp_path / "m.onnx"
    onnx.save(model, path)
    assert irgen_main(["run", str(path), "-o", str(tmp_path / "out"), "--no-progress", "--no-cache"]) != 0
    assert "g_idx (act-order) is not supported" in capsys.readouterr().err


def test_matmul_nbits_whose_weights_do_not_fit_its_shape_is_refused(tmp_path, capsys):
    model = _nbits(_mlp(64, 32, 16, 4), 32, False)
    node = next(n for n in model.graph.node if n.op_type == "MatMulNBits")
    next(a for a in node.attribute if a.name == "K").i = 96
    path = tmp_path / "m.onnx"
    onnx.save(model, path)
    assert irgen_main(["run", str(path), "-o", str(tmp_path / "out"), "--no-progress", "--no-cache"]) != 0
    assert "do not fit K=96, N=32, block_size=32" in capsys.readouterr().err


# ------------------------------------------------------------------ opset-21 block DequantizeLinear


def _block_dq(signed: bool, axis: int, zero_point: bool, op: str = "MatMul", k: int = 320, n: int = 48,
              block: int = 32, seed: int = 3, rows: int = 6):
    """x [rows, k] -> MatMul(x, DequantizeLinear(W int4/uint4 [k, n], block_size along ``axis``)) -> Relu."""
    rng = np.random.default_rng(seed)
    kind = TensorProto.INT4 if signed else TensorProto.UINT4
    w = rng.integers(-8 if signed else 0, 8 if signed else 16, (k, n))
    sshape = [k, n]
    sshape[axis] = -(-sshape[axis] // block)
    inits = [helper.make_tensor("Wq", kind, [k, n], w.reshape(-1).tolist()),
             numpy_helper.from_array((rng.random(sshape) * 0.05 + 0.01).astype(np.float32), "Ws")]
    if zero_point:
        z = rng.integers(-2 if signed else 6, 2 if signed else 10, sshape)
        inits.append(helper.make_tensor("Wz", kind, sshape, z.reshape(-1).tolist()))
    nodes = [helper.make_node("DequantizeLinear", ["Wq", "Ws"] + (["Wz"] if zero_point else []), ["W"],
                              name="dq_w", axis=axis, block_size=block),
             helper.make_node(op, ["x", "W"], ["h"], name="mm"),
             helper.make_node("Relu", ["h"], ["y"], name="relu")]
    g = helper.make_graph(nodes, "blk", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [rows, k])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [rows, n])], initializer=inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)])
    onnx.checker.check_model(m, full_check=True)
    return m, w


BLOCK_DQ = [(True, 0, True), (True, 1, False), (False, 0, False), (False, 1, True)]


@pytest.mark.parametrize("signed,axis,zero_point", BLOCK_DQ,
                         ids=[f"{'int4' if s else 'uint4'}-axis{a}-{'zp' if z else 'nozp'}" for s, a, z in BLOCK_DQ])
def test_block_dequantize_linear_equals_onnxruntime(signed, axis, zero_point, tmp_path):
    model, w = _block_dq(signed, axis, zero_point)
    path, out, x, ir = _run(tmp_path, model, 6, 320)
    (layer,) = _weight_only(ir)
    qr = layer["quant"]
    assert (qr["weight"]["dtype"], qr["weight"]["block_size"], qr["weight"]["axis"]) == \
        ("int4" if signed else "uint4", 32, axis)
    # blocked along K: ONNX Runtime runs MatMulNBits, one pass over K; along N: SGEMM's K slices
    assert qr["accumulation"]["k_block"] == (320 if axis == 0 else 256)
    packed = np.load(out / layer["params"]["weight"]["file"])
    assert packed.dtype == np.uint8 and packed.shape == ((48, 10, 16) if axis == 0 else (320, 2, 16))
    q = np.stack([packed & 15, packed >> 4], -1).reshape(packed.shape[0], -1).astype(np.int64)
    q = np.where(q >= 8, q - 16, q) if signed else q
    # low nibble: the even element; a last block past the axis' end is padded with zeros
    np.testing.assert_array_equal(q[:, :w.shape[axis]], w.T if axis == 0 else w)
    scale = np.load(out / layer["params"]["scale"]["file"])
    assert scale.shape == ((48, 10) if axis == 0 else (320, 2))
    assert _assert_layers_equal_onnxruntime(out, ir, path, x) == 2 * 6 * 48


#: one row (M = 1: a decoder's token step, a batch-1 head): (signed, axis, zero point, K, N, block).
#: Blocked along N, and along K in blocks MatMulNBits does not take (8), ONNX Runtime runs MLAS's
#: SGEMM on the dequantized weight, which gives one row its own kernel (``order: "groups4"``);
#: K and N no multiples of 16 (K % 4 = 1, 2, 3), a K below four
ONE_ROW = [(True, 1, True, 320, 48, 32), (False, 1, False, 37, 21, 8), (True, 1, False, 18, 17, 4),
           (False, 1, True, 3, 5, 2), (True, 0, True, 72, 30, 8), (False, 0, False, 41, 19, 8)]


@pytest.mark.parametrize("signed,axis,zero_point,k,n,block", _default_few(ONE_ROW, {0, 3, 4}),
                         ids=[f"{'int4' if s else 'uint4'}-axis{a}-k{k}-n{n}-b{b}" for s, a, _, k, n, b in ONE_ROW])
def test_block_dequantize_linear_one_row_equals_onnxruntime(signed, axis, zero_point, k, n, block, tmp_path):
    model, _ = _block_dq(signed, axis, zero_point, k=k, n=n, block=block, rows=1)
    path, out, x, ir = _run(tmp_path, model, 1, k)
    (layer,) = _weight_only(ir)
    acc = layer["quant"]["accumulation"]
    assert (acc["order"], acc["fma"]) == ("groups4", False)
    assert _assert_layers_equal_onnxruntime(out, ir, path, x) == 2 * n


@pytest.mark.parametrize("rows,k", [(6, 37), (7, 40), (5, 3)])
def test_block_dequantize_linear_one_column_equals_onnxruntime(rows, k, tmp_path):
    """N = 1 (a regression head): MLAS swaps the operands into its one-row kernel of a transposed
    B (``order: "lanes8"``; the fold of an output depends on its row: 4, 2 and 1 rows here)."""
    model, _ = _block_dq(True, 0, True, k=k, n=1, block=8, rows=rows)
    path, out, x, ir = _run(tmp_path, model, rows, k)
    (layer,) = _weight_only(ir)
    assert layer["quant"]["accumulation"]["order"] == "lanes8"
    assert _assert_layers_equal_onnxruntime(out, ir, path, x) == 2 * rows


def test_matmul_nbits_one_row_keeps_its_vector_kernel(tmp_path):
    """A block DequantizeLinear along K in blocks of 16 or more on one row: ONNX Runtime's
    MatMulNBits, whose one-row kernel is another (``lanes16``), not the SGEMM's."""
    model, _ = _block_dq(True, 0, True, k=72, n=30, block=16, rows=1)
    path, out, x, ir = _run(tmp_path, model, 1, 72)
    assert _weight_only(ir)[0]["quant"]["accumulation"]["order"] == "lanes16"
    assert _assert_layers_equal_onnxruntime(out, ir, path, x) == 2 * 30


class _Reader:
    """Calibration samples for ``quantize_static`` (x [6, 144])."""

    def __init__(self):
        self.it = iter([{"x": np.random.default_rng(10 + i).standard_normal((6, 144)).astype(np.float32)}
                        for i in range(4)])

    def get_next(self):
        return next(self.it, None)


def test_quantize_static_block_int4_weights_of_quantized_activations(tmp_path):
    """``quantize_static(weight_type=QInt4, extra_options={"BlockSize": 32})``: uint8 activations and
    block int4 weights (blocks along N). ONNX Runtime runs each MatMul span in float on the
    dequantized weights: float spans, equal to onnxruntime (no weight-only layer: the activation
    is quantized)."""
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static

    reader = type("Reader", (_Reader, CalibrationDataReader), {})()
    src, path = tmp_path / "f.onnx", tmp_path / "q.onnx"
    onnx.save(_mlp(144, 40, 30, 6), src)
    quantize_static(str(src), str(path), reader, quant_format=QuantFormat.QDQ, weight_type=QuantType.QInt4,
                    per_channel=True, extra_options={"BlockSize": 32})
    model = onnx.load(path)
    assert any(a.name == "block_size" for n in model.graph.node for a in n.attribute)
    path, out, x, ir = _run(tmp_path, model, 6, 144)
    assert not _weight_only(ir)
    assert _assert_layers_equal_onnxruntime(out, ir, path, x) > 0


# ------------------------------------------------------------------ float8 QDQ


def _float8(kind: str, h: int = 48, seed: int = 4, saturate: int = 1, zero: float = 0.0, rows: int = 4, k: int = 32):
    """x -> Q/DQ (float8) -> MatMul(DQ(float8 W1)) -> Add -> Relu -> Q/DQ (float8) -> MatMul(DQ(float8 W2))."""
    tp, dt = {"e4m3fn": (TensorProto.FLOAT8E4M3FN, ml_dtypes.float8_e4m3fn),
              "e5m2": (TensorProto.FLOAT8E5M2, ml_dtypes.float8_e5m2)}[kind]
    rng = np.random.default_rng(seed)

    def f8(name, arr):
        return helper.make_tensor(name, tp, list(np.shape(arr)), np.asarray(arr).astype(dt).view(np.uint8).tobytes(),
                                  raw=True)

    def f32(name, arr):
        return numpy_helper.from_array(np.asarray(arr, np.float32), name)

    w1, w2 = rng.standard_normal((k, h)) * 0.3, rng.standard_normal((h, 16)) * 0.3
    inits = [f8("W1q", w1 / 0.004), f32("sw1", 0.004), f8("W2q", w2 / 0.01), f32("sw2", 0.01),
             f32("sx", 0.02), f8("zx", np.float32(zero)), f32("sh", 0.05), f8("zh", np.float32(0)),
             f32("B1", rng.standard_normal(h) * 0.1)]
    nodes = [helper.make_node("QuantizeLinear", ["x", "sx", "zx"], ["xq"], name="q_x", saturate=saturate),
             helper.make_node("DequantizeLinear", ["xq", "sx", "zx"], ["xd"], name="dq_x"),
             helper.make_node("DequantizeLinear", ["W1q", "sw1"], ["W1"], name="dq_w1"),
             helper.make_node("MatMul", ["xd", "W1"], ["h"], name="mm1"),
             helper.make_node("Add", ["h", "B1"], ["hb"], name="add1"),
             helper.make_node("Relu", ["hb"], ["r"], name="relu"),
             helper.make_node("QuantizeLinear", ["r", "sh", "zh"], ["rq"], name="q_r"),
             helper.make_node("DequantizeLinear", ["rq", "sh", "zh"], ["rd"], name="dq_r"),
             helper.make_node("DequantizeLinear", ["W2q", "sw2"], ["W2"], name="dq_w2"),
             helper.make_node("MatMul", ["rd", "W2"], ["y"], name="mm2")]
    g = helper.make_graph(nodes, "fp8", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [rows, k])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [rows, 16])], initializer=inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)])
    onnx.checker.check_model(m, full_check=True)
    return m


@pytest.mark.parametrize("kind", ["e4m3fn", "e5m2"])
def test_float8_qdq_equals_onnxruntime(kind, tmp_path):
    model = _float8(kind)
    path, out = tmp_path / "m.onnx", tmp_path / "out"
    onnx.save(model, path)
    # inputs large enough that x / scale passes float8's largest value (448, 57344) somewhere
    x = (np.random.default_rng(5).standard_normal((4, 32)) * (20.0 if kind == "e4m3fn" else 2000.0)).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    assert irgen_main(["run", str(path), "-o", str(out), "--input", str(tmp_path / "x.npy"), "--no-progress",
                       "--no-cache"]) == 0
    ir = json.loads((out / "ir.json").read_text())
    f8 = [layer for layer in ir["layers"] if (layer.get("quant") or {}).get("kind") == "float8"]
    assert [layer["source"]["outputs"] for layer in f8] == [["xd"], ["rd"]]
    assert all(layer["quant"]["float8"]["dtype"] == f"float8_{kind}" for layer in f8)
    top = {"e4m3fn": 448.0, "e5m2": 57344.0}[kind]
    first = np.load(out / f8[0]["outputs"][0]["file"])
    assert np.abs(first).max() == np.float32(top) * np.float32(0.02)  # saturated, not NaN or infinity
    # the float8 layers and the float MatMuls between them (MLAS's SGEMM order), bit for bit
    assert [layer["quant"]["kind"] for layer in ir["layers"] if layer["op"] == "dense"] == ["float_dense"] * 2
    assert _assert_layers_equal_onnxruntime(out, ir, path, x) == 4 * (32 + 48 * 4 + 16)


def test_float8_model_of_quantize_static_equals_onnxruntime(tmp_path):
    """``quantize_static`` with float8 activations and weights (its Distribution calibration)."""
    from onnxruntime.quantization import (CalibrationDataReader, CalibrationMethod, QuantFormat, QuantType,
                                          quantize_static)

    reader = type("Reader", (_Reader, CalibrationDataReader), {})()
    src, path = tmp_path / "f.onnx", tmp_path / "m.onnx"
    onnx.save(_mlp(144, 40, 30, 6), src)
    quantize_static(str(src), str(path), reader, quant_format=QuantFormat.QDQ,
                    activation_type=QuantType.QFLOAT8E4M3FN, weight_type=QuantType.QFLOAT8E4M3FN,
                    calibrate_method=CalibrationMethod.Distribution)
    model = onnx.load(path)
    assert {t.data_type for t in model.graph.initializer if t.name.endswith("_quantized")} == {TensorProto.FLOAT8E4M3FN}
    path, out, x, ir = _run(tmp_path, model, 6, 144)
    assert sum((layer.get("quant") or {}).get("kind") == "float8" for layer in ir["layers"]) == 4
    assert _assert_layers_equal_onnxruntime(out, ir, path, x) > 0


@pytest.mark.parametrize("what,expected", [("saturate", "saturate=0 is not supported"),
                                           ("zero", "a non-zero float8 zero point is not supported")])
def test_float8_forms_irgen_does_not_realize_are_refused(what, expected, tmp_path, capsys):
    model = _float8("e4m3fn", saturate=0 if what == "saturate" else 1, zero=1.0 if what == "zero" else 0.0)
    path = tmp_path / "m.onnx"
    onnx.save(model, path)
    assert irgen_main(["run", str(path), "-o", str(tmp_path / "out"), "--no-progress", "--no-cache"]) != 0
    err = capsys.readouterr().err
    assert expected in err and "'q_x'" in err


#: (kind, K of the first MatMul, hidden width): K and N no multiples of 16, every K % 4
FLOAT8_ONE_ROW = [("e4m3fn", 32, 48), ("e4m3fn", 19, 37), ("e5m2", 30, 21), ("e5m2", 7, 18)]


@pytest.mark.parametrize("kind,k,h", _default_few(FLOAT8_ONE_ROW, {1, 2}), ids=[f"{a}-k{k}-h{h}" for a, k, h in FLOAT8_ONE_ROW])
def test_float8_qdq_one_row_equals_onnxruntime(kind, k, h, tmp_path):
    """A float8 model on one row: its float MatMuls run MLAS's one-row SGEMM kernel (``groups4``)."""
    model = _float8(kind, h=h, rows=1, k=k)
    path, out, x, ir = _run(tmp_path, model, 1, k, seed=6)
    dense = [layer["quant"] for layer in ir["layers"] if layer["op"] == "dense"]
    assert [(q["kind"], q["accumulation"]["order"]) for q in dense] == [("float_dense", "groups4")] * 2
    assert _assert_layers_equal_onnxruntime(out, ir, path, x) == k + h * 4 + 16


def _float8_gemm(rows: int, k: int, n: int, trans_b: int, bias: bool, seed: int = 4):
    """x [rows, k] -> Q/DQ (float8 E4M3FN) -> Gemm(., DQ(float8 W), B, transB) -> y [rows, n]."""
    rng = np.random.default_rng(seed)
    dt = ml_dtypes.float8_e4m3fn
    w = rng.standard_normal((n, k) if trans_b else (k, n)) * 0.3

    def f8(name, arr):
        return helper.make_tensor(name, TensorProto.FLOAT8E4M3FN, list(np.shape(arr)),
                                  np.asarray(arr).astype(dt).view(np.uint8).tobytes(), raw=True)

    inits = [f8("Wq", w / 0.004), numpy_helper.from_array(np.float32(0.004), "sw"),
             numpy_helper.from_array(np.float32(0.02), "sx"), f8("zx", np.float32(0)),
             numpy_helper.from_array((rng.standard_normal(n) * 0.1).astype(np.float32), "B")]
    nodes = [helper.make_node("QuantizeLinear", ["x", "sx", "zx"], ["xq"], name="q_x"),
             helper.make_node("DequantizeLinear", ["xq", "sx", "zx"], ["xd"], name="dq_x"),
             helper.make_node("DequantizeLinear", ["Wq", "sw"], ["W"], name="dq_w"),
             helper.make_node("Gemm", ["xd", "W"] + (["B"] if bias else []), ["y"], name="gemm", transB=trans_b)]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [rows, k])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [rows, n])],
                          initializer=inits if bias else inits[:-1])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)])
    onnx.checker.check_model(m, full_check=True)
    return m


#: (rows, K, N, transB, bias, order): a batch-1 classifier head (torch's Linear: transB = 1, a
#: bias, which MLAS adds after the fold), its transposed weight on more rows (the blocked SGEMM,
#: as without transB), transB = 0 (whose sums start at the bias), K = 600 in two slices (each
#: added to the bias in turn), and one column (N = 1) with and without a bias
GEMMS = [(1, 37, 21, 1, True, "lanes8"), (1, 64, 7, 1, True, "lanes8"), (1, 5, 6, 1, False, "lanes8"),
         (4, 300, 21, 1, True, "k"), (1, 37, 21, 0, False, "groups4"), (1, 37, 21, 0, True, "groups4"),
         (1, 18, 5, 0, True, "groups4"), (4, 600, 21, 0, True, "k"), (3, 600, 21, 1, True, "k"),
         (6, 37, 1, 0, True, "lanes8"), (7, 22, 1, 0, False, "lanes8")]


@pytest.mark.parametrize("rows,k,n,trans_b,bias,order", _default_few(GEMMS, {0, 5, 7, 9}),
                         ids=[f"m{r}-k{k}-n{n}-tb{t}-{'bias' if b else 'nobias'}" for r, k, n, t, b, _ in GEMMS])
def test_float8_gemm_equals_onnxruntime(rows, k, n, trans_b, bias, order, tmp_path):
    path, out, x, ir = _run(tmp_path, _float8_gemm(rows, k, n, trans_b, bias), rows, k, seed=8)
    (dense,) = [layer["quant"] for layer in ir["layers"] if layer["op"] == "dense"]
    assert (dense["kind"], dense["accumulation"]["order"]) == ("float_dense", order)
    assert dense["accumulation"].get("initial") == ("bias" if bias and order != "lanes8" else None)
    assert _assert_layers_equal_onnxruntime(out, ir, path, x) == rows * (k + n)
