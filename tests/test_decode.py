"""``irgen run --decode N``: an LLM generation trace (a prefill, then one token at a time
against the KV cache), each step's golden data fed by the step before, checked step by step
against onnxruntime running the same greedy loop on its own.

The model is a small GPT-2 from transformers (2 layers, 2 heads, 32 wide) exported to ONNX
with its cache as inputs and outputs in optimum's naming (``past_key_values.I.key`` in,
``present.I.key`` out); the QDQ twin is onnxruntime's ``quantize_static`` of it."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
pytest.importorskip("transformers")
pytest.importorskip("tvm")
sys.path.insert(0, str(Path(__file__).parent))
import zoo  # noqa: E402

from irgen.cli import main as irgen_main  # noqa: E402

LAYERS, HEADS, WIDTH, VOCAB = 2, 2, 32, 100
HEAD = WIDTH // HEADS
PROMPT = np.array([[5, 17, 42, 8]], dtype=np.int64)


def _names() -> tuple[list[str], list[str]]:
    cache = [f"{i}.{k}" for i in range(LAYERS) for k in ("key", "value")]
    return (["input_ids", "attention_mask", *(f"past_key_values.{c}" for c in cache)],
            ["logits", *(f"present.{c}" for c in cache)])


def _export(path: Path) -> Path:
    zoo.import_torchvision()  # transformers imports torchvision when it is installed
    from transformers import DynamicCache, GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=LAYERS, n_head=HEADS, n_embd=WIDTH, vocab_size=VOCAB, n_positions=64)
    model = GPT2LMHeadModel(cfg).eval()

    class WithCache(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.m = model

        def forward(self, input_ids, attention_mask, *past):
            cache = DynamicCache()
            for i in range(LAYERS):
                cache.update(past[2 * i], past[2 * i + 1], i)
            o = self.m(input_ids=input_ids, attention_mask=attention_mask, past_key_values=cache, use_cache=True)
            return (o.logits, *[t for layer in o.past_key_values.layers for t in (layer.keys, layer.values)])

    ins, outs = _names()
    past = [torch.randn(1, HEADS, 2, HEAD) for _ in range(2 * LAYERS)]
    dyn = {"input_ids": {1: "seq"}, "attention_mask": {1: "total"}, "logits": {1: "seq"},
           **{n: {2: "past"} for n in ins[2:]}, **{n: {2: "total"} for n in outs[1:]}}
    with torch.no_grad():
        torch.onnx.export(WithCache(), (torch.tensor([[1, 2, 3]]), torch.ones(1, 5, dtype=torch.int64), *past),
                          str(path), input_names=ins, output_names=outs, dynamic_axes=dyn, opset_version=17,
                          dynamo=False)
    return path


@pytest.fixture(scope="module")
def gpt2_kv(tmp_path_factory) -> Path:
    return _export(tmp_path_factory.mktemp("decode") / "gpt2_kv.onnx")


@pytest.fixture(scope="module")
def gpt2_kv_qdq(gpt2_kv) -> Path:
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, quantize_static

    ins, _ = _names()
    rng = np.random.default_rng(1)

    class Reader(CalibrationDataReader):
        def __init__(self):
            self.samples = iter([{"input_ids": rng.integers(0, VOCAB, (1, 3)), "attention_mask": np.ones((1, 5), np.int64),
                                  **{n: rng.standard_normal((1, HEADS, 2, HEAD)).astype(np.float32) for n in ins[2:]}}
                                 for _ in range(4)])

        def get_next(self):
            return next(self.samples, None)

    out = gpt2_kv.with_name("gpt2_kv_qdq.onnx")
    # the matmuls, as LLMs are quantized (the attention mask's -inf leaves Where unquantizable)
    quantize_static(str(gpt2_kv), str(out), Reader(), quant_format=QuantFormat.QDQ,
                    op_types_to_quantize=["MatMul", "Gemm"])
    return out


@pytest.fixture(scope="module")
def gpt2_kv_w4(gpt2_kv) -> Path:
    """Its MatMuls as 4-bit block weights (onnxruntime's MatMulNBitsQuantizer, blocks of 32, zero
    points, accuracy level 0: float32 arithmetic)."""
    from onnxruntime.quantization.matmul_nbits_quantizer import DefaultWeightOnlyQuantConfig, MatMulNBitsQuantizer

    q = MatMulNBitsQuantizer(onnx.load(str(gpt2_kv)), algo_config=DefaultWeightOnlyQuantConfig(
        block_size=32, is_symmetric=False, accuracy_level=0))
    q.process()
    out = gpt2_kv.with_name("gpt2_kv_w4.onnx")
    q.model.save_model_to_file(str(out), False)
    assert any(n.op_type == "MatMulNBits" for n in onnx.load(str(out)).graph.node)
    return out


def _ort_trace(model: Path, steps: int, quantized: bool) -> list[dict[str, np.ndarray]]:
    """onnxruntime's own greedy loop from PROMPT: per step, its feeds and outputs (quantized: the
    session options irgen's source check uses, the runtime's integer kernels)."""
    from irgen_onnx.runner import session_options

    sess = ort.InferenceSession(str(model), session_options(quantized), providers=["CPUExecutionProvider"])
    ins, outs = _names()
    tokens, length = PROMPT, 0
    cache = {n: np.zeros((1, HEADS, 0, HEAD), np.float32) for n in ins[2:]}
    trace = []
    for _ in range(steps + 1):
        feeds = {"input_ids": tokens, "attention_mask": np.ones((1, length + tokens.shape[1]), np.int64), **cache}
        values = dict(zip(outs, sess.run(outs, feeds)))
        trace.append({**feeds, **values})
        length += tokens.shape[1]
        cache = {p: values[p.replace("past_key_values", "present")] for p in ins[2:]}
        tokens = np.argmax(values["logits"][:, -1, :], axis=-1)[:, None].astype(np.int64)
    return trace


def _golden_step(folder: Path) -> dict[str, np.ndarray]:
    ir = json.loads((folder / "ir.json").read_text())
    return {t["name"]: np.load(folder / t["file"]) for t in ir["inputs"] + ir["outputs"]}


def _decode(model: Path, out: Path, steps: int) -> dict:
    prompt = out.with_name(out.name + "_prompt.npy")
    np.save(prompt, PROMPT)
    assert irgen_main(["run", str(model), "-o", str(out), "--decode", str(steps), "--input",
                       f"input_ids={prompt}", "--no-progress"]) == 0
    return json.loads((out / "trace.json").read_text())


def _check_against_ort(out: Path, trace: dict, ort_trace: list[dict], exact: bool) -> None:
    assert [s["folder"] for s in trace["steps"]] == [f"step_{k:03d}" for k in range(len(ort_trace))]
    for k, (step, theirs) in enumerate(zip(trace["steps"], ort_trace)):
        mine = _golden_step(out / step["folder"])
        assert set(mine) == set(theirs), k
        for name, want in theirs.items():
            got = mine[name]
            assert got.shape == want.shape, (k, name)
            if exact or name in ("input_ids", "attention_mask"):
                np.testing.assert_array_equal(got, want, err_msg=f"step {k} {name}")
            else:
                np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5, err_msg=f"step {k} {name}")
        assert step["next_token"] == np.argmax(theirs["logits"][:, -1, :], axis=-1).tolist(), k
        assert step["cache_length"] == theirs["attention_mask"].shape[1] - theirs["input_ids"].shape[1]


def _verify_all(capsys, out: Path, steps: int) -> None:
    capsys.readouterr()
    assert irgen_main(["verify", str(out), "--no-progress", "--no-report"]) == 0
    text = capsys.readouterr().out
    assert f"{steps + 1} samples: {steps + 1} passed, 0 failed" in text
    assert text.count("source: onnxruntime") == steps + 1  # every step checked against the runtime


def test_float_decode_trace_follows_onnxruntime(gpt2_kv, tmp_path, capsys):
    out = tmp_path / "trace"
    trace = _decode(gpt2_kv, out, 3)
    assert [s["cache_length"] for s in trace["steps"]] == [0, 4, 5, 6]
    assert trace["cache"][0] == {"input": "past_key_values.0.key", "output": "present.0.key", "axis": 2}
    _check_against_ort(out, trace, _ort_trace(gpt2_kv, 3, quantized=False), exact=False)
    _verify_all(capsys, out, 3)


@pytest.mark.slow  # 30 s; the driver is the float trace's, which the default suite runs
def test_qdq_decode_trace_equals_onnxruntime(gpt2_kv_qdq, tmp_path, capsys):
    out = tmp_path / "trace"
    trace = _decode(gpt2_kv_qdq, out, 2)
    ir = json.loads((out / "step_001" / "ir.json").read_text())
    assert any((layer.get("quant") or {}).get("scheme") == "qdq" for layer in ir["layers"])
    _check_against_ort(out, trace, _ort_trace(gpt2_kv_qdq, 2, quantized=True), exact=True)
    _verify_all(capsys, out, 2)


@pytest.mark.slow  # the float and QDQ traces cover the path in the default suite
def test_4bit_decode_trace_follows_onnxruntime(gpt2_kv_w4, tmp_path, capsys):
    out = tmp_path / "trace"
    trace = _decode(gpt2_kv_w4, out, 2)
    ir = json.loads((out / "step_002" / "ir.json").read_text())
    assert any((layer.get("quant") or {}).get("kind") == "weight_only" for layer in ir["layers"])
    _check_against_ort(out, trace, _ort_trace(gpt2_kv_w4, 2, quantized=True), exact=False)
    _verify_all(capsys, out, 2)


def _refused(capsys, *args) -> str:
    capsys.readouterr()
    assert irgen_main(["run", *map(str, args), "--no-progress"]) == 2
    return capsys.readouterr().err


def test_decode_refusals_say_what_is_missing(gpt2_kv, tmp_path, capsys):
    out = tmp_path / "out"
    err = _refused(capsys, gpt2_kv, "-o", out, "--decode", "2")
    assert "--decode: give the prompt with --input input_ids=FILE" in err
    assert "--input-shape input_ids=B,P" in err
    assert _refused(capsys, gpt2_kv, "-o", out, "--decode", "0", "--input-shape", "input_ids=1,3").count(
        "--decode 0: must be 1..") == 1
    bad = tmp_path / "bad.npy"
    np.save(bad, np.zeros((4,), np.int64))
    assert "the prompt must be integer token ids of shape [batch, length]" in _refused(
        capsys, gpt2_kv, "-o", out, "--decode", "1", "--input", f"input_ids={bad}")
    assert not out.exists()  # nothing half-written


def test_decode_needs_a_cache(tmp_path, capsys):
    from onnx import TensorProto, helper

    g = helper.make_graph([helper.make_node("Identity", ["input_ids"], ["logits"])], "g",
                          [helper.make_tensor_value_info("input_ids", TensorProto.INT64, [1, "seq"])],
                          [helper.make_tensor_value_info("logits", TensorProto.INT64, [1, "seq"])])
    path = tmp_path / "nocache.onnx"
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), path)
    err = _refused(capsys, path, "-o", tmp_path / "out", "--decode", "1", "--input-shape", "input_ids=1,3")
    assert "--decode: the model has no cache inputs" in err and "its inputs: input_ids" in err


def test_generated_prompt_uses_the_seed_and_the_vocabulary(gpt2_kv, tmp_path):
    """Without a prompt file, --input-shape input_ids=B,P draws the ids with --seed below the
    logits' vocabulary size, as generated inputs are."""
    out = tmp_path / "out"
    assert irgen_main(["run", str(gpt2_kv), "-o", str(out), "--decode", "1", "--input-shape", "input_ids=1,6",
                       "--seed", "3", "--no-progress"]) == 0
    trace = json.loads((out / "trace.json").read_text())
    assert trace["steps"][0]["tokens"] == np.random.default_rng(3).integers(0, VOCAB, (1, 6)).tolist()
    assert [s["cache_length"] for s in trace["steps"]] == [0, 6]
