"""The model zoo (tests/zoo.py): public architectures as users bring them, float and quantized,
each through ``irgen run`` then ``irgen verify`` in every mode, the source check actually run
against the source framework's own runtime (onnxruntime, the TFLite interpreter, torch).

The default suite runs a few cheap cases (DEFAULT); ``-m slow`` runs the whole zoo.
"""

from __future__ import annotations

import pytest

import zoo

pytest.importorskip("onnxruntime")

# The default suite runs a few cheap cases (2-7 s each), one per frontend and kind of flow: a
# float ONNX transformer, a transformers decoder from .pt2, an ORT QDQ int8 transformer and a PT2E
# quantized one. Every other case is slow: the CNNs take 8-50 s each, and each scheme and format
# has its own default tests on smaller models (test_qdq_spans, test_torch_quant, test_tflite_int8,
# test_keras_frontend, test_float_zoo_patterns, ...).
DEFAULT = {
    "bert-onnx",                    # transformer encoder, float ONNX
    "vit-qdq-pre",                  # ORT QDQ, int8 attention after quant_pre_process
    "vit-pt2e-arm",                 # torchao PT2E, Arm quantizer (int8 activations, per-tensor weights), .pt2
    "hf_llama-pt2",                 # transformers decoder (RMSNorm, rotary positions, GQA, cache concat), .pt2
    "word_lm-dyn",                  # LSTM language model, ORT quantize_dynamic (DynamicQuantizeLSTM)
}


def _param(case: zoo.Case):
    marks = [] if case.id in DEFAULT else [pytest.mark.slow]
    return pytest.param(case, id=case.id, marks=marks)


@pytest.fixture(scope="session")
def zoo_folder(tmp_path_factory):
    return tmp_path_factory.mktemp("zoo")


def _cases():
    """Every case at the default opt level; the float ones also at opt level 0 (no graph
    optimization: every op its own kernel), all of those slow."""
    params = [_param(c) for c in zoo.cases()]
    params += [pytest.param(c, 0, id=f"{c.id}-O0", marks=[pytest.mark.slow]) for c in zoo.cases() if not c.quantized]
    return [p if len(p.values) == 2 else pytest.param(p.values[0], None, id=p.id, marks=p.marks) for p in params]


@pytest.mark.parametrize("case, opt_level", _cases())
def test_zoo_case_runs_and_verifies_against_its_source_runtime(case, opt_level, zoo_folder):
    if case.model in zoo.TORCH_MODELS:
        pytest.importorskip("torch")
    else:
        pytest.importorskip("tensorflow")
    s = zoo.run_case(case, zoo_folder, opt_level=opt_level)
    assert s["run_exit"] == 0, s["error"]
    assert s["passed"], (s.get("problems") or s.get("error"), zoo.table([s]))
    assert s["source_ran"], s.get("skipped")
    r = s["verify"]
    assert r["modes"] == ["single", "entire", "source"]
    assert s["compared"] > 0
    # every layer names a source tensor the runtime gave, or is counted as having none
    for row in r["layers"]:
        m = row["checks"]["source"]
        assert m["status"] == "pass" or (m["status"] == "missing" and m["message"] == "no source tensor"), (row["name"], m)
    if case.quantized:
        assert s["worst_local_lsb"] is not None and s["worst_local_lsb"] <= 1, zoo.table([s])
        integer = [row for row in r["layers"] if row["integer"]]
        assert integer, "a quantized model has integer layers"
        for row in integer:  # irgen's own numpy recompute equals the golden data bit for bit
            assert row["checks"]["single"]["exact"] and row["checks"]["entire"]["exact"], row["name"]
