"""Models written by third-party quantization toolkits run and verify exactly (issue 36).

The default suite runs one committed fixture per toolkit export that irgen takes
(``tests/data/toolkits``: :data:`toolkits.FIXTURES`, the small CNN
:data:`toolkits.FIXTURE_ARCH` quantized by NNCF's ONNX backend, NNCF's torch backend as exported
(OpenVINO FakeQuantize, verified against OpenVINO within its 1 LSB) and after ``nncf.strip``, AMD
Quark A8W8 and XINT8, Brevitas ``export_onnx_qcdq`` and ``export_qonnx``, Intel Neural
Compressor QDQ, AIMET ``to_onnx_qdq`` and ai-edge-quantizer's int8 recipe; rebuilt by
``python tests/toolkits.py --fixtures``, see ``tests/data/toolkits/README.md``): ``irgen run``
then ``irgen verify --json`` pass against the source runtime (onnxruntime, OpenVINO, the TFLite
interpreter), every layer of an integer kernel equal to it (0 LSB), the node units onnxruntime
runs in float within verify's float-span tolerance, and the golden model output equals the
runtime's. No toolkit needs to be installed.

The full matrix (:func:`toolkits.cases`: every toolkit x setting x architecture, built by the
toolkits themselves) is ``slow``; a case runs when its toolkit imports in this Python or in
one of the interpreters listed in ``IRGEN_TOOLKIT_PYTHON`` (``os.pathsep``-separated: the
toolkits do not share one venv, see :mod:`toolkits`), and is skipped otherwise.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))
import toolkits  # noqa: E402
from irgen.cli import main as irgen_main  # noqa: E402
from test_verify import _verify_json  # noqa: E402

#: fixture -> (the scheme irgen picks, the layers it realizes as integer kernels: convolutions and
#: the dense layer; the others are float node units, as onnxruntime runs them)
EXPECTED = {
    # a depthwise input quantized per channel, uint8 ReLU outputs into int8 convolutions, a float
    # classifier: float units; the MaxPool's pair propagated
    "nncf-onnx": ("qdq", 1),
    # NNCF's torch export as it is: OpenVINO FakeQuantize nodes, lowered to Q/DQ; every
    # BatchNormalization left between its Conv and ReLU: every unit float
    "nncf-torch": ("qdq", 0),
    # the same, and every BatchNormalization left between its Conv and ReLU: every unit float
    "nncf-torch-strip": ("qdq", 0),
    # int8 with zero point 0: ORT keeps a ReLU before a QuantizeLinear (float units)
    "quark-a8w8": ("qdq", 2),
    # uint8 with zero point 128, the same; a GlobalAveragePool's Mul appended after its reader;
    # every scale a power of two: pow2
    "quark-xint8": ("pow2", 0),
    # unquantized biases of BN-folded convolutions; Clip(-127, 127) on the weights
    "brevitas-qcdq": ("qdq", 4),
    # QONNX Quant nodes, lowered to Q/DQ: the same units as brevitas-qcdq
    "brevitas-qonnx": ("qdq", 4),
    # the residual Add and its ReLU in float
    "inc-qdq": ("qdq", 6),
    "aimet-qdq": ("qdq", 6),
    "aeq-a8w8": ("tflite-int8", 6),
}
_INTEGER_KINDS = ("conv2d", "depthwise_conv2d", "dense")


def test_every_fixture_is_committed_small_and_expected():
    assert set(EXPECTED) == set(toolkits.FIXTURES)
    for setting in toolkits.FIXTURES:
        path = toolkits.fixture(setting)
        assert path.is_file(), f"{path}: build it with python tests/toolkits.py --fixtures {setting}"
        assert path.stat().st_size < 200_000, path
    assert not [p.name for p in toolkits.FIXTURE_DIR.iterdir()
                if p.name != "README.md" and p not in {toolkits.fixture(s) for s in toolkits.FIXTURES}]


def _runtime_output(path: Path, x: np.ndarray) -> np.ndarray:
    """The model output of the source runtime as ``irgen verify`` runs it: onnxruntime with exact
    integer kernels on the model as the ONNX frontend gives it to onnxruntime (QONNX Quant nodes
    lowered; OpenVINO FakeQuantize nodes too, whose golden data is that graph's, although verify
    runs them in OpenVINO), or the TFLite interpreter's reference kernels."""
    if path.suffix == ".onnx":
        from irgen_onnx.prepare import checked_model
        from irgen_onnx.runner import inference_session

        sess = inference_session(checked_model(path, for_tvm=False).SerializeToString(), quantized=True)
        return sess.run(None, {sess.get_inputs()[0].name: x})[0]
    tf = pytest.importorskip("tensorflow")
    it = tf.lite.Interpreter(model_path=str(path),
                             experimental_op_resolver_type=tf.lite.experimental.OpResolverType.BUILTIN_REF)
    it.allocate_tensors()
    it.set_tensor(it.get_input_details()[0]["index"], x)
    it.invoke()
    return it.get_tensor(it.get_output_details()[0]["index"])


def _assert_source_checked(result: dict, ir: dict) -> None:
    """Every layer passed the source check, an integer kernel's to the last bit (OpenVINO's, whose
    int8 kernels requantize in float32: within its declared 1 LSB); a layer whose output irgen added
    (a Q/DQ pair propagated as onnxruntime propagates it) has no source tensor."""
    assert result["passed"] and result["source"]["ran"], result["problems"]
    openvino = result["source"]["runtime"].startswith("openvino ")
    for row, layer in zip(result["layers"], ir["layers"], strict=True):
        m = row["checks"]["source"]
        if m["status"] == "missing":
            assert "no source tensor" in str(m.get("message")), (row["name"], m)
            continue
        assert m["status"] == "pass", (row["name"], m)
        if row["integer"] and (layer.get("quant") or {}).get("realization") != "float":
            assert (m["max_lsb"] <= 1 if openvino else m["max_lsb"] == 0 and m["exact"]), (row["name"], m)


@pytest.mark.parametrize("setting", toolkits.FIXTURES)
def test_toolkit_fixture_runs_and_equals_its_runtime(setting, tmp_path, capsys):
    if setting.startswith("aeq-"):
        pytest.importorskip("tensorflow")
    if setting == "nncf-torch":  # its source runtime
        pytest.importorskip("openvino", reason="openvino is not installed (pip install openvino==2026.4.1)")
    path = toolkits.fixture(setting)
    x = toolkits.fixture_input(setting)
    np.save(tmp_path / "x.npy", x)
    out = tmp_path / "out"
    assert irgen_main(["run", str(path), "-o", str(out), "--input", str(tmp_path / "x.npy"), "--no-progress",
                       "--no-cache"]) == 0
    ir = json.loads((out / "ir.json").read_text())
    scheme, integer = EXPECTED[setting]
    assert ir["producer"]["quantizer"] == scheme
    kernels = [layer["name"] for layer in ir["layers"] if (layer.get("quant") or {}).get("kind") in _INTEGER_KINDS
               and layer["quant"].get("realization") != "float"]
    assert len(kernels) == integer, kernels
    code, result = _verify_json(capsys, out)
    assert code == 0, result["problems"]
    _assert_source_checked(result, ir)
    golden = np.load(out / ir["outputs"][0]["file"])
    y = _runtime_output(path, x)
    if ir["layers"][-1].get("quant"):  # the dequantize of the runtime's integers, or the integers
        np.testing.assert_array_equal(golden, y)
    else:  # a float classifier (NNCF leaves the Gemm unquantized): TVM's float ops
        np.testing.assert_allclose(golden, y, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------ the full matrix (slow)

#: the module each toolkit's builders import
MODULES = {"nncf": "nncf", "quark": "quark", "brevitas": "brevitas", "inc": "onnx_neural_compressor",
           "aimet": "aimet_onnx", "aeq": "ai_edge_quantizer"}
#: cases irgen refuses or verify fails today, and why (docs/toolkits.md#what-does-not-work-yet)
KNOWN = {
    "nncf-torch-strip-squeezenet1_1": "OpenVINO, its source runtime (nncf.strip leaves the FakeQuantize of the "
                                      "quantizers a Concat shares), computes those up to 17 LSB off FakeQuantize's "
                                      "definition",
    "brevitas-qonnx-brevitas_small": "QONNX Trunc (Brevitas' TruncAdaptiveAvgPool2d) is not lowered",
    "aeq-a16w8": "tflite-int8 has no int16 kernel for the divide of MobileNetV3's hard swish",
    "aeq-a8w8-MobileNetV2": "random Keras weights: a ReLU6 bound beyond int32 at the output scale (refused by "
                            "TFLite's reference kernels too)",
}


@functools.cache
def _python_with(module: str) -> str | None:
    """The first interpreter, of this one and ``IRGEN_TOOLKIT_PYTHON``'s, that imports ``module``."""
    pythons = [sys.executable, *filter(None, os.environ.get("IRGEN_TOOLKIT_PYTHON", "").split(os.pathsep))]
    for python in pythons:
        probe = f"import importlib.util, sys; sys.exit(importlib.util.find_spec({module!r}) is None)"
        if Path(python).exists() and subprocess.run([python, "-c", probe], capture_output=True).returncode == 0:
            return python
    return None


def _matrix_params():
    for c in toolkits.cases():
        reason = KNOWN.get(c.id) or KNOWN.get(c.fmt)
        marks = [pytest.mark.slow, *([pytest.mark.xfail(reason=reason, strict=True)] if reason else [])]
        yield pytest.param(c, id=c.id, marks=marks)


@pytest.fixture(scope="module")
def matrix_folder(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("toolkit_matrix")


@pytest.mark.parametrize("c", _matrix_params())
def test_toolkit_matrix_case(c, matrix_folder):
    python = _python_with(MODULES[c.toolkit])
    if python is None:
        pytest.skip(f"{MODULES[c.toolkit]} is not importable here nor in IRGEN_TOOLKIT_PYTHON "
                    f"(python tests/toolkits.py --help)")
    p = subprocess.run([python, toolkits.__file__, "--build", c.id, "--out", str(matrix_folder / c.id)],
                       capture_output=True, text=True)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    s = toolkits.run_case(c, matrix_folder)
    assert s["passed"] and s["source_ran"], toolkits.row(s)
