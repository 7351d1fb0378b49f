"""qdq: golden data equals ONNX Runtime on QuantizeLinear/DequantizeLinear models.

Float torch models (tests/models.py) are exported to ONNX, pre-processed with
``onnxruntime.quantization.quant_pre_process`` (folds BatchNormalization into
Conv, as ORT recommends before quantizing; a BatchNormalization left between
Q/DQ would run in float in ORT too) and quantized with ``quantize_static`` in
QDQ format: per-channel int8 weights + int8 activations, and per-tensor int8
weights + uint8 activations. irgen's activation files are compared with ORT's
value of each layer's source tensor (made an extra graph output).

ORT is run with its integer kernels for int8 activations
(``session.qdqisint8allowed=1``). By default ORT on x86 fuses an int8-activation
Q/DQ node unit only after converting its Q->DQ pairs to uint8, which it does
only for pairs with one consumer; so on ResNet-18 it runs the convs and adds
that touch a residual branch (11 of 20 convs, all 8 adds) in float, and which
ones changes when intermediate tensors become graph outputs. Those float
kernels are no integer datapath's arithmetic. With the option ORT fuses all 20
convs and 8 adds (QLinearConv/QLinearAdd) with or without extra outputs; the
figures against ORT's default are printed too.

Two figures per model:

* end to end: irgen's files against ORT's tensors for the same float input;
* layer local: each layer recomputed (``quant.recompute``) from ORT's own input
  tensors against ORT's output, which isolates the kernel arithmetic from
  rounding differences carried over from earlier layers.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
from onnx import numpy_helper  # noqa: E402
from irgen_onnx.runner import inference_session  # noqa: E402  ORT's exact integer kernels on any x86

import models  # noqa: E402
from layercheck import assert_layer_recomputes  # noqa: E402
from irgen import quant, reference  # noqa: E402
from irgen.cli import main  # noqa: E402
from irgen.pipeline import run  # noqa: E402
from irgen.plugins import PluginHost  # noqa: E402

FIGURES: dict[str, dict] = {}
CASES = [
    ("small_cnn", "pc", "s8"), ("small_cnn", "pt", "u8"), ("mlp", "pc", "s8"), ("mlp", "pt", "u8"),
    ("mobilenet", "pt", "s8"),
    pytest.param(("resnet18", "pc", "s8"), marks=pytest.mark.slow, id="resnet18-pc-s8"),
    pytest.param(("resnet18", "pt", "u8"), marks=pytest.mark.slow, id="resnet18-pt-u8"),
]


def quantized(name: str, per_channel: bool, act: str, folder: Path) -> Path:
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static
    from onnxruntime.quantization.shape_inference import quant_pre_process

    path, _ = models.export(name, folder)
    pre = folder / f"{name}_pre.onnx"
    quant_pre_process(str(path), str(pre), skip_symbolic_shape=True)
    shape = models.BUILDERS[name][1]

    class Reader(CalibrationDataReader):
        def __init__(self):
            self.it = iter([{"x": np.random.default_rng(k).standard_normal(shape).astype(np.float32)} for k in range(8)])

        def get_next(self):
            return next(self.it, None)

    out = folder / f"{name}_{'pc' if per_channel else 'pt'}_{act}.onnx"
    quantize_static(
        str(pre), str(out), Reader(), quant_format=QuantFormat.QDQ, per_channel=per_channel,
        activation_type=QuantType.QInt8 if act == "s8" else QuantType.QUInt8, weight_type=QuantType.QInt8,
        # the MobileNet as quantize_static quantizes by default (every op type it knows:
        # HardSigmoid, Mul, Softmax, ReduceMean... too)
        op_types_to_quantize=None if name == "mobilenet" else [
            "Conv", "Gemm", "MatMul", "Add", "MaxPool", "AveragePool", "GlobalAveragePool",
            "Concat", "Reshape", "Flatten", "Transpose", "Relu", "Clip", "Sigmoid"],
    )
    return out


def ort_tensors(path: Path, x: np.ndarray, names: list[str], int8_kernels: bool = True) -> dict[str, np.ndarray]:
    """ORT's values of ``names`` (made graph outputs) and of the model outputs."""
    m = onnx.load(str(path))
    have = {o.name for o in m.graph.output}
    for n in names:
        if n not in have:
            m.graph.output.append(onnx.ValueInfoProto(name=n))
            have.add(n)
    sess = inference_session(m.SerializeToString(), quantized=True, int8_kernels=int8_kernels)
    return dict(zip([o.name for o in sess.get_outputs()], sess.run(None, {"x": x})))


@pytest.fixture(scope="module")
def host():
    return PluginHost().load()


@pytest.fixture(scope="module", params=CASES, ids=lambda c: "-".join(c) if isinstance(c, tuple) else None)
def case(request, tmp_path_factory, host):
    name, pc, act = request.param
    folder = tmp_path_factory.mktemp(f"qdq_{name}_{pc}_{act}")
    path = quantized(name, pc == "pc", act, folder)
    x = np.random.default_rng(7).standard_normal(models.BUILDERS[name][1]).astype(np.float32)
    np.save(folder / "x.npy", x)
    out = folder / "out"
    ir = run(host, path, out, inputs=[str(folder / "x.npy")], opt_level=3)
    names = [s for layer in ir["layers"] for s in layer["source"]["outputs"]]
    ref = ort_tensors(path, x, names)
    ref["x"] = x
    plain = ort_tensors(path, x, [])
    default = ort_tensors(path, x, names, int8_kernels=False)
    return {"id": f"{name}-{pc}-{act}", "path": path, "x": x, "out": out, "ir": ir, "ref": ref, "plain": plain,
            "default": default, "default_plain": ort_tensors(path, x, [], int8_kernels=False)}


def _count(got: np.ndarray, exp: np.ndarray, acc: list[int]) -> None:
    assert got.shape == exp.shape and got.dtype == exp.dtype, (got.shape, exp.shape, got.dtype, exp.dtype)
    d = np.abs(got.astype(np.int64) - exp.astype(np.int64))
    acc[0] += d.size
    acc[1] += int((d == 0).sum())
    acc[2] = max(acc[2], int(d.max(initial=0)))


def _report(capsys, key: str, what: str, acc: list[int]) -> None:
    share = acc[1] / acc[0]
    FIGURES.setdefault(key, {})[what] = (share, acc[2], acc[0])
    with capsys.disabled():
        print(f"\n[qdq figures] {key} {what}: {acc[1]}/{acc[0]} elements exact ({share:.6%}), max {acc[2]} LSB")


def test_extra_outputs_do_not_change_ort(case, capsys):
    """Making every layer tensor a graph output leaves ORT's model output as is
    (with its integer kernels; with ORT's default the figure is printed)."""
    for name, value in case["plain"].items():
        np.testing.assert_array_equal(case["ref"][name], value, err_msg=name)
        changed = int((case["default"][name] != case["default_plain"][name]).sum())
        with capsys.disabled():
            print(f"\n[qdq figures] {case['id']} ORT default kernels: extra outputs change {name!r} "
                  f"in {changed}/{value.size} elements")


def _end_to_end(case, ref: dict[str, np.ndarray]) -> list[int]:
    ir, out = case["ir"], case["out"]
    acc = [0, 0, 0]
    for layer in ir["layers"]:
        for rec, src in zip(layer["outputs"], layer["source"]["outputs"], strict=True):
            got, exp = np.load(out / rec["file"]), ref[src]
            if layer["quant"] is not None and layer["quant"]["kind"] == "dequantize":
                scale = np.float32(layer["quant"]["inputs"][0]["scale"])  # in LSB of the dequantized integer
                _count(np.rint(got / scale).astype(np.int64), np.rint(exp / scale).astype(np.int64), acc)
                continue
            if got.dtype.kind == "f":  # the float tail after the last dequantize (softmax)
                if acc[2] == 0:
                    np.testing.assert_allclose(got, exp, rtol=1e-5, atol=1e-6, err_msg=layer["name"])
                continue
            _count(got, exp, acc)
    return acc


def test_every_activation_matches_onnxruntime(case, capsys):
    ir, out = case["ir"], case["out"]
    assert ir["producer"]["quantizer"] == "qdq"
    acc = _end_to_end(case, case["ref"])
    _report(capsys, case["id"], "end to end", acc)
    out_rec = ir["outputs"][0]
    got = np.load(out / out_rec["file"])
    for which, ref in (("integer kernels", case["plain"]), ("default kernels", case["default_plain"])):
        fy = np.abs(got.astype(np.float64) - ref[out_rec["name"]])
        with capsys.disabled():
            print(f"\n[qdq figures] {case['id']} model output vs plain ORT, {which}: "
                  f"{int((fy == 0).sum())}/{fy.size} equal, max |diff| {fy.max():.3g}")
    default = _end_to_end(case, case["default"])
    _report(capsys, case["id"], "end to end vs ORT default kernels", default)
    # the model output is among the layer outputs, and ORT's is the same without extra outputs
    assert acc[1] / acc[0] >= 0.999 and acc[2] <= 1


def test_every_layer_matches_onnxruntime_locally(case, capsys):
    """Each layer from ORT's own inputs: the kernel arithmetic alone."""
    ir, out, ref = case["ir"], case["out"], case["ref"]
    src = {rec["name"]: s for layer in ir["layers"] for rec, s in zip(layer["outputs"], layer["source"]["outputs"])}
    src.update({i["name"]: i["name"] for i in ir["inputs"]})
    acc = [0, 0, 0]
    for layer in ir["layers"]:
        if layer["quant"] is None:
            continue
        ins = [ref[src[r["name"]]] for r in layer["inputs"]]
        got = quant.recompute(layer, ins, reference.load_layer_params(out, layer))
        exp = ref[layer["source"]["outputs"][-1]]
        if got.dtype.kind == "f":
            np.testing.assert_array_equal(got, exp, err_msg=layer["name"])
            continue
        _count(got, exp, acc)
    _report(capsys, case["id"], "layer local", acc)
    assert acc[1] / acc[0] >= 0.999 and acc[2] <= 1


def test_layers_recompute_from_quant_and_fused_ops(case):
    out, ir = case["out"], case["ir"]
    kinds = set()
    for layer in ir["layers"]:
        q = layer["quant"]
        if q is None:
            assert layer["op"] == "softmax" and not case["id"].startswith("mobilenet"), layer["name"]  # a float tail
            continue
        assert q["scheme"] == "qdq"
        kinds.add(q["kind"])
        assert_layer_recomputes(out, layer)
    if case["id"].startswith("small_cnn"):
        assert {"quantize", "conv2d", "add", "integer", "avg_pool2d", "concatenate", "dense", "dequantize"} <= kinds
    if case["id"].startswith("mlp"):
        assert {"quantize", "dense", "lut", "dequantize"} <= kinds
    if case["id"].startswith("resnet18"):
        assert {"conv2d", "add", "global_avg_pool", "dense"} <= kinds
    if case["id"].startswith("mobilenet"):  # hardsigmoid as a table, QLinearMul, QLinearSoftmax
        assert {"depthwise_conv2d", "lut", "mul", "add", "global_avg_pool", "softmax"} <= kinds


def test_quant_record_has_what_hardware_needs(case):
    ir, out = case["ir"], case["out"]
    pc = "-pc-" in case["id"]
    convs = [l for l in ir["layers"] if l["quant"] and l["quant"]["kind"] in ("conv2d", "depthwise_conv2d", "dense")]
    assert convs
    for layer in convs:
        q = layer["quant"]
        n = layer["outputs"][-1]["shape"][q["requant"]["axis"]]
        act = "int8" if case["id"].endswith("s8") else "uint8"
        assert q["inputs"][0]["dtype"] == act and q["output"]["dtype"] == act and q["weight"]["dtype"] == "int8"
        assert len(q["requant"]["scale"]) == n and "half" in q["requant"]["rounding_rule"]
        assert isinstance(q["weight"]["scale"], list) == pc
        w = np.load(out / layer["params"]["weight"]["file"])
        assert w.dtype == np.int8
        if pc:
            assert len(q["weight"]["scale"]) == w.shape[q["weight"]["axis"]] == n
        if q["bias"] is not None:
            b = np.load(out / layer["params"]["bias"]["file"])
            assert b.dtype == np.int32 and b.size == n
        lo, hi = q["clamp"]
        info = np.iinfo(act)
        assert info.min <= lo < hi <= info.max


# ---------------------------------------------------------------- bad parameters


@pytest.fixture(scope="module")
def small_qdq(tmp_path_factory) -> Path:
    return quantized("small_cnn", True, "s8", tmp_path_factory.mktemp("qdq_bad"))


def _edit(src: Path, dst: Path, name: str, fn) -> Path:
    m = onnx.load(str(src))
    for k, init in enumerate(m.graph.initializer):
        if init.name == name:
            new = numpy_helper.from_array(fn(numpy_helper.to_array(init)), name)
            m.graph.initializer[k].CopyFrom(new)
            break
    else:
        raise AssertionError(name)
    onnx.save(m, str(dst))
    return dst


BAD = {
    "zero_scale": ("/Relu_output_0_scale", lambda a: np.zeros_like(a), "Relu_output_0", "scale"),
    "nan_scale": ("c3.weight_scale", lambda a: np.full_like(a, np.nan), "c3_weight", "NaN"),
    # quantize_static's scale of an attention mask holding -inf: every value dequantizes to NaN or -inf
    "inf_scale": ("/Relu_output_0_scale", lambda a: np.full_like(a, np.inf), "Relu_output_0", "infinite scale"),
    "zero_point_range": ("c3.weight_zero_point", lambda a: np.full(a.shape, 200, np.uint8), "c3_weight", "zero point outside int8"),
    # TVM's ONNX importer already rejects this one (relax.dequantize checks the scale size)
    "channel_count": ("c3.weight_scale", lambda a: a[:-1].copy(), "c3.weight", "size of scale param is 'T.int64(7)'"),
}


@pytest.mark.parametrize("how", sorted(BAD))
def test_bad_quantization_parameters(small_qdq, tmp_path, capsys, how):
    init, fn, tensor, words = BAD[how]
    bad = _edit(small_qdq, tmp_path / "bad.onnx", init, fn)
    out = tmp_path / "out"
    capsys.readouterr()
    code = main(["run", str(bad), "-o", str(out), "--no-progress"])
    err = capsys.readouterr().err
    lines = [l for l in err.splitlines() if l.strip()]
    assert code == 2, err
    assert len(lines) == 1 and lines[0].startswith("irgen: error: "), err
    assert tensor in lines[0] and words in lines[0], lines[0]
    assert not out.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out.irgen-")]
