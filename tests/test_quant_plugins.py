"""Choosing a quantization scheme: detection, --quantizer, third-party schemes."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("tensorflow")
sys.path.insert(0, str(Path(__file__).parent))
import tflite_models  # noqa: E402

from irgen.cli import main as irgen_main  # noqa: E402

# A scheme someone else ships: keeps TVM's float emulation of the quantized
# ops and labels every layer that ends in a quantize with its own record.
THIRD_PARTY = '''
from irgen import hookimpl
from irgen.api import Quantizer


def detect(qg):
    return False  # only when forced


def realize(qg):
    for b in qg.bindings:
        if b.op == "relax.quantize":
            scale = float(b.value.args[1].value.numpy().reshape(-1)[0])
            qg.quant[b.name] = {"scheme": "float-emulation", "kind": "emulated", "output_scale": scale}


@hookimpl
def irgen_register_quantizers(register):
    register(Quantizer("float-emulation", detect, realize, description="TVM's float QDQ emulation"))
'''


@pytest.fixture(scope="module")
def int8_model(tmp_path_factory):
    d = tmp_path_factory.mktemp("q")
    path, x = tflite_models.export("mlp", d, "int8")
    np.save(d / "x.npy", x)
    return path, d / "x.npy"


def _run(capsys, *args) -> tuple[int, str]:
    code = irgen_main(["run", *map(str, args), "--no-progress"])
    return code, capsys.readouterr().err


def test_scheme_is_detected(int8_model, tmp_path, capsys):
    path, x = int8_model
    code, err = _run(capsys, path, "-o", tmp_path / "out", "--input", x)
    assert code == 0, err
    ir = json.loads((tmp_path / "out" / "ir.json").read_text())
    assert ir["producer"]["quantizer"] == "tflite-int8"
    assert all(l["quant"]["scheme"] == "tflite-int8" for l in ir["layers"])


def test_third_party_scheme_takes_effect(int8_model, tmp_path, capsys, plugin_file):
    path, x = int8_model
    plugin = plugin_file("float_emulation", THIRD_PARTY)
    out = tmp_path / "out"
    code, err = _run(capsys, path, "-o", out, "--input", x, "--plugin", plugin, "--quantizer", "float-emulation")
    assert code == 0, err
    ir = json.loads((out / "ir.json").read_text())
    assert ir["producer"]["quantizer"] == "float-emulation"
    labelled = [l for l in ir["layers"] if l["quant"]]
    assert labelled and all(l["quant"]["scheme"] == "float-emulation" for l in labelled)
    # TVM's float emulation keeps dequantize/quantize ops in the layers
    ops = {o["relax_op"] for l in ir["layers"] for o in l["fused_ops"]}
    assert {"relax.quantize", "relax.dequantize"} <= ops


def test_unknown_scheme_lists_the_installed_ones(int8_model, tmp_path, capsys):
    path, x = int8_model
    code, err = _run(capsys, path, "-o", tmp_path / "out", "--input", x, "--quantizer", "nope")
    assert code == 2
    assert err.count("\n") == 1 and "nope" in err and "tflite-int8" in err
    assert not (tmp_path / "out").exists()


def test_quantized_model_without_a_scheme_is_an_error(int8_model, tmp_path, capsys):
    path, x = int8_model
    code, err = _run(capsys, path, "-o", tmp_path / "out", "--input", x, "--plugin", "no:tflite-int8")
    assert code == 2, err
    assert err.count("\n") == 1 and "no quantization scheme recognizes it" in err and "--quantizer" in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("scheme", ["qdq", "pow2", "tflite-int8"])
def test_a_forced_scheme_on_a_float_model_is_refused(scheme, tmp_path, capsys):
    """A float model is not quantized: forcing a scheme on it is one clear error, not another fusion."""
    model = Path(__file__).resolve().parent.parent / "examples" / "tiny_cnn.onnx"
    code, err = _run(capsys, model, "-o", tmp_path / "out", "--quantizer", scheme)
    assert code == 2 and err.count("\n") == 1 and err.startswith("irgen: error:"), err
    assert f"--quantizer {scheme}" in err and "not quantized" in err
    assert not (tmp_path / "out").exists()
