"""The model zoo (tests/zoo.py): public architectures as users bring them, float and quantized,
each through ``irgen run`` then ``irgen verify`` in every mode, the source check actually run
against the source framework's own runtime (onnxruntime, the TFLite interpreter, torch).

The default suite keeps one model per family; ``-m slow`` runs the whole zoo.
"""

from __future__ import annotations

import pytest

import zoo

pytest.importorskip("onnxruntime")

# one model per family in the default suite; the rest behind the slow mark
DEFAULT = {
    "mobilenet_v3_small-qdq",       # torchvision CNN, ORT QDQ (HardSwish, squeeze-excite, no pre-processing)
    "shufflenet_v2_x0_5-qdq-pc",    # channel split / shuffle, per-channel
    "vit-qdq-pre",                  # int8 attention after quant_pre_process
    "bert-onnx",                    # transformer encoder, float ONNX
    "vit-pt2",                      # transformer, .pt2
    "mobilenet_v3_small-ptq",       # torch FX PTQ, torch's default mapping (reduce_range), .pt2
    "mobilenet_v3_small-pt2e",      # torchao PT2E, x86 quantizer (uint8, per-channel weights), .pt2
    "resnet18-pt2e-arm",            # torchao PT2E, Arm quantizer (int8 activations, per-tensor weights), .pt2
    "MobileNetV3Small-tflite-int8", # keras.applications, TFLite converter full-int8
    "MobileNetV2-keras",            # .keras float
    "hf_llama-pt2",                 # transformers decoder (RMSNorm, rotary positions, GQA, cache concat), .pt2
    "hf_wav2vec2-qdq",              # transformers audio encoder (1-D convolutions), ORT QDQ
    "hf_roberta-qdq-mm",            # quantize_static at the MatMuls only: float embeddings, LayerNorms, residuals
    "vit-qdq-a16",                  # 16-bit activations: every span in float, as ORT runs it
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
