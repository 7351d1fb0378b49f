"""``irgen run --decode N`` on a ``torch.export`` program: a small GPT-2 from transformers
(2 layers, 2 heads, 32 wide) exported with dynamic shapes (``Dim.AUTO``) in the form irgen
decodes: ``forward(input_ids, attention_mask, past_key_values)`` with the cache as a list of
tensors (the inputs ``past_key_values_I``), returning ``{"logits": ..., "present": [...]}``
(the outputs' paths ``logits``, ``present.I``). Each step's golden data are checked against
torch's own greedy loop on the exported program (``ExportedProgram.module()``), whose tokens
and logits are in turn checked against the eager transformers model with a ``DynamicCache``:
torch.export gives the dynamic dimensions the range [2, inf], and the prefill's empty cache
and the one-token steps lie outside it (irgen runs the graph there: docs/cli.md). A Llama
(rotary positions from ``position_ids``, grouped-query attention) runs the same check
(slow). Also: a dynamic ``.pt2`` outside ``--decode`` (its ``--input-shape``, a failing
runtime assertion) and the export forms ``--decode`` refuses."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("tvm")
sys.path.insert(0, str(Path(__file__).parent))
import zoo  # noqa: E402

from irgen.cli import main as irgen_main  # noqa: E402

LAYERS, HEADS, WIDTH, VOCAB = 2, 2, 32, 100
HEAD = WIDTH // HEADS
PROMPT = np.array([[5, 17, 42, 8]], dtype=np.int64)
STEPS = 2


def _gpt2():
    """A GPT-2: learned positions, the cache [1, HEADS, length, HEAD]."""
    zoo.import_torchvision()  # transformers imports torchvision when it is installed
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=LAYERS, n_head=HEADS, n_embd=WIDTH, vocab_size=VOCAB, n_positions=64)
    return GPT2LMHeadModel(cfg).eval()


def _llama():
    """A Llama: rotary positions from position_ids, grouped-query attention (4 query heads, 2
    key/value heads of 8), RMSNorm, SwiGLU."""
    zoo.import_torchvision()
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2, hidden_size=WIDTH,
                      intermediate_size=64, vocab_size=VOCAB, max_position_embeddings=64)
    return LlamaForCausalLM(cfg).eval()


#: kind -> (the model, its cache's [heads, head size], whether it takes position_ids)
MODELS = {"gpt2": (_gpt2, (HEADS, HEAD), False), "llama": (_llama, (2, 8), True)}


class _WithCache(torch.nn.Module):
    """The decoder with its cache as plain tensors in and out (``position_ids`` after the cache
    when ``positions``)."""

    def __init__(self, model, positions: bool):
        super().__init__()
        self.m, self.positions = model, positions

    def forward(self, input_ids, attention_mask, past_key_values, position_ids=None):
        from transformers import DynamicCache

        cache = DynamicCache(config=self.m.config)
        for i in range(LAYERS):
            cache.update(past_key_values[2 * i], past_key_values[2 * i + 1], i)
        o = self.m(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                   past_key_values=cache, use_cache=True)
        return {"logits": o.logits, "present": [t for layer in o.past_key_values.layers for t in (layer.keys,
                                                                                                  layer.values)]}


def _export(kind: str, folder: Path):
    """(the .pt2 path, the eager model) of ``kind``, exported with Dim.AUTO on the sequence,
    the mask and the cache length."""
    make, (heads, head), positions = MODELS[kind]
    model = make()
    auto = torch.export.Dim.AUTO
    past = [torch.randn(1, heads, 3, head) for _ in range(2 * LAYERS)]
    args = (torch.tensor([[1, 2]]), torch.ones(1, 5, dtype=torch.int64), past,
            *((torch.tensor([[3, 4]]),) if positions else ()))
    dims = ({1: auto}, {1: auto}, [{2: auto}] * (2 * LAYERS), *(({1: auto},) if positions else ()))
    with torch.no_grad():
        ep = torch.export.export(_WithCache(model, positions), args, dynamic_shapes=dims, strict=False)
    path = folder / f"{kind}_kv.pt2"
    torch.export.save(ep, str(path))
    return path, model


@pytest.fixture(scope="module")
def gpt2_pt2(tmp_path_factory):
    return _export("gpt2", tmp_path_factory.mktemp("decode_torch"))


def _torch_trace(kind: str, path: Path, steps: int) -> tuple[list[dict[str, np.ndarray]], str]:
    """torch's own greedy loop from PROMPT on the saved program (``module()``; its guards would
    refuse the shapes outside the exported ranges): per step, the feeds and outputs under the
    program's input and output names; and the logits' name."""
    _, (heads, head), positions = MODELS[kind]
    ep = torch.export.load(str(path))
    run = ep.module(check_guards=False)
    outs = list(ep.graph_signature.user_outputs)
    tokens, length = torch.from_numpy(PROMPT), 0
    cache = [torch.zeros(1, heads, 0, head) for _ in range(2 * LAYERS)]
    trace = []
    with torch.no_grad():
        for _ in range(steps + 1):
            feeds = {"input_ids": tokens, "attention_mask": torch.ones(1, length + tokens.shape[1], dtype=torch.int64)}
            if positions:
                feeds["position_ids"] = torch.arange(length, length + tokens.shape[1])[None]
            result = run(feeds["input_ids"], feeds["attention_mask"], cache,
                         *([feeds["position_ids"]] if positions else []))
            values = torch.utils._pytree.tree_leaves(result)
            trace.append({**{n: v.numpy() for n, v in feeds.items()},
                          **{f"past_key_values_{i}": c.numpy() for i, c in enumerate(cache)},
                          **{n: v.numpy() for n, v in zip(outs, values)}})
            length += tokens.shape[1]
            cache = result["present"]
            tokens = result["logits"][:, -1, :].argmax(-1)[:, None]
    return trace, outs[0]


def _eager_logits(model, steps: int) -> list[np.ndarray]:
    """The eager model's greedy loop with a DynamicCache from empty: each step's logits."""
    from transformers import DynamicCache

    cache, tokens, logits = DynamicCache(config=model.config), torch.from_numpy(PROMPT), []
    with torch.no_grad():
        for _ in range(steps + 1):
            o = model(input_ids=tokens, past_key_values=cache, use_cache=True)
            logits.append(o.logits.numpy())
            cache, tokens = o.past_key_values, o.logits[:, -1, :].argmax(-1)[:, None]
    return logits


def _golden_step(folder: Path) -> dict[str, np.ndarray]:
    ir = json.loads((folder / "ir.json").read_text())
    return {t["name"]: np.load(folder / t["file"]) for t in ir["inputs"] + ir["outputs"]}


def test_the_program_declares_its_dynamic_interface(gpt2_pt2):
    from irgen.decode import roles
    from irgen_torch.dynamic import model_interface

    iface = model_interface(gpt2_pt2[0], {})
    assert [t.name for t in iface.inputs] == ["input_ids", "attention_mask",
                                             *(f"past_key_values_{i}" for i in range(2 * LAYERS))]
    ids, cache = iface.inputs[0], iface.inputs[2]
    assert ids.shape[0] == 1 and isinstance(ids.shape[1], str) and ids.dtype == "int64"
    assert cache.shape[:2] == (1, HEADS) and cache.shape[3] == HEAD and isinstance(cache.shape[2], str)
    assert [t.path for t in iface.outputs] == ["logits", *(f"present.{i}" for i in range(2 * LAYERS))]
    assert iface.outputs[0].shape == (1, ids.shape[1], VOCAB)
    r = roles(iface)
    assert r.logits == iface.outputs[0].name and r.vocab == VOCAB
    assert [(p.past, p.present, p.axis) for p in r.pairs] == [
        (f"past_key_values_{i}", iface.outputs[1 + i].name, 2) for i in range(2 * LAYERS)]


def _check_trace(kind: str, path: Path, model, tmp_path: Path, capsys) -> None:
    theirs, logits = _torch_trace(kind, path, STEPS)
    # the exported program at the shapes outside its ranges computes what the eager model does
    for k, (step, eager) in enumerate(zip(theirs, _eager_logits(model, STEPS))):
        np.testing.assert_allclose(step[logits], eager, rtol=1e-5, atol=1e-6, err_msg=f"step {k}")
    prompt = tmp_path / "prompt.npy"
    np.save(prompt, PROMPT)
    out = tmp_path / "trace"
    assert irgen_main(["run", str(path), "-o", str(out), "--decode", str(STEPS), "--input", f"input_ids={prompt}",
                       "--no-progress"]) == 0
    trace = json.loads((out / "trace.json").read_text())
    assert [s["cache_length"] for s in trace["steps"]] == [0, 4, 5]
    assert trace["logits"] == logits
    for k, (step, want) in enumerate(zip(trace["steps"], theirs)):
        mine = _golden_step(out / step["folder"])
        assert set(mine) == set(want), k
        for name, value in want.items():
            assert mine[name].shape == value.shape, (k, name)
            if value.dtype.kind == "i":
                np.testing.assert_array_equal(mine[name], value, err_msg=f"step {k} {name}")
            else:
                np.testing.assert_allclose(mine[name], value, rtol=1e-4, atol=1e-5, err_msg=f"step {k} {name}")
        assert step["next_token"] == np.argmax(want[logits][:, -1, :], axis=-1).tolist(), k
    capsys.readouterr()
    assert irgen_main(["verify", str(out), "--no-progress", "--no-report"]) == 0
    text = capsys.readouterr().out
    assert f"{STEPS + 1} samples: {STEPS + 1} passed, 0 failed" in text
    assert text.count("source: the torch frontend's runtime") == STEPS + 1  # every step checked against torch


def test_pt2_decode_trace_follows_torch(gpt2_pt2, tmp_path, capsys):
    _check_trace("gpt2", *gpt2_pt2, tmp_path, capsys)


@pytest.mark.slow  # 30 s; the GPT-2 trace runs the same path in the default suite
def test_llama_pt2_decode_trace_follows_torch(tmp_path, capsys):
    """Rotary positions fed as position_ids (they continue from the cache length), grouped-query
    attention."""
    _check_trace("llama", *_export("llama", tmp_path), tmp_path, capsys)


class _TupleOut(torch.nn.Module):
    """A decoder-shaped program whose outputs have no names (a plain tuple)."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(10, 4)

    def forward(self, input_ids, past):
        x = self.emb(input_ids)[:, None]  # [1, 1, seq, 4]
        present = torch.cat([past, x], dim=2)
        return present.sum(1) @ self.emb.weight.T, present


def _tuple_pt2(tmp_path: Path) -> Path:
    auto = torch.export.Dim.AUTO
    ep = torch.export.export(_TupleOut().eval(), (torch.tensor([[1, 2]]), torch.zeros(1, 1, 3, 4)),
                             dynamic_shapes=({1: auto}, {2: auto}), strict=False)
    path = tmp_path / "tuple.pt2"
    torch.export.save(ep, str(path))
    return path


def test_pt2_without_output_names_is_refused_with_the_form_needed(tmp_path, capsys):
    path = _tuple_pt2(tmp_path)
    capsys.readouterr()
    assert irgen_main(["run", str(path), "-o", str(tmp_path / "out"), "--decode", "1", "--input-shape",
                       "input_ids=1,3", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "--decode: no output gives the next value of cache input 'past'" in err
    assert "or at such a path in what the model returns, e.g. {'logits': ..., 'present': [tensors]}" in err
    assert not (tmp_path / "out").exists()


def test_dynamic_pt2_runs_at_the_given_shapes(tmp_path, capsys):
    """Outside --decode: a dynamic .pt2 runs at its --input-shape (here the empty cache), and
    says which shape is missing or does not fit."""
    path = _tuple_pt2(tmp_path)
    out = tmp_path / "out"
    ids = np.array([[3, 1, 4, 1, 5]], np.int64)
    np.save(tmp_path / "ids.npy", ids)
    np.save(tmp_path / "past.npy", np.zeros((1, 1, 0, 4), np.float32))
    assert irgen_main(["run", str(path), "-o", str(out), "--input-shape", "input_ids=1,5", "--input-shape",
                       "past=1,1,0,4", "--input", f"input_ids={tmp_path / 'ids.npy'}",
                       "--input", f"past={tmp_path / 'past.npy'}", "--no-progress"]) == 0
    ir = json.loads((out / "ir.json").read_text())
    want = _tuple_reference(path, ids)
    got = {t["name"]: np.load(out / t["file"]) for t in ir["outputs"]}
    for name, value in want.items():
        np.testing.assert_allclose(got[name], value, rtol=1e-5, atol=1e-6)
    capsys.readouterr()
    assert irgen_main(["run", str(path), "-o", str(tmp_path / "o2"), "--input-shape", "input_ids=1,5",
                       "--no-progress"]) == 2
    assert "input 'past' has the dynamic shape [1, 1, 's" in capsys.readouterr().err
    assert irgen_main(["run", str(path), "-o", str(tmp_path / "o3"), "--input-shape", "input_ids=1,5",
                       "--input-shape", "past=1,2,0,4", "--no-progress"]) == 2
    assert "--input-shape past=1,2,0,4: the model's input 'past' has the shape [1, 1, 's" in capsys.readouterr().err


class _Even(torch.nn.Module):
    """A program with a runtime assertion (``torch._check``) on its dynamic dimension."""

    def forward(self, x):
        torch._check(x.shape[1] % 2 == 0)
        return x.reshape(x.shape[0], x.shape[1] // 2, 2) * 2


def test_a_runtime_assertion_that_fails_at_the_shapes_is_an_error(tmp_path, capsys):
    ep = torch.export.export(_Even(), (torch.randn(1, 6),), dynamic_shapes=({1: torch.export.Dim.AUTO},),
                             prefer_deferred_runtime_asserts_over_guards=True)
    assert any("_assert_scalar" in str(n.target) for n in ep.graph.nodes)
    torch.export.save(ep, str(tmp_path / "even.pt2"))
    out = tmp_path / "out"
    assert irgen_main(["run", str(tmp_path / "even.pt2"), "-o", str(out), "--input-shape", "x=1,8",
                       "--no-progress"]) == 0
    ir = json.loads((out / "ir.json").read_text())
    x = np.load(out / ir["inputs"][0]["file"])
    want = (torch.from_numpy(x).reshape(1, 4, 2) * 2).numpy()
    np.testing.assert_array_equal(np.load(out / ir["outputs"][0]["file"]), want)
    capsys.readouterr()
    assert irgen_main(["run", str(tmp_path / "even.pt2"), "-o", str(tmp_path / "o2"), "--input-shape", "x=1,5",
                       "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "the program cannot run at the input shapes {'x': (1, 5)}" in err and "Runtime assertion failed" in err


def _tuple_reference(path: Path, ids: np.ndarray) -> dict[str, np.ndarray]:
    """torch's run of the saved program on ``ids`` and an empty cache, by output name."""
    ep = torch.export.load(str(path))
    with torch.no_grad():
        values = ep.module(check_guards=False)(torch.from_numpy(ids), torch.zeros(1, 1, 0, 4))
    return {n: v.numpy() for n, v in zip(ep.graph_signature.user_outputs, values)}


@pytest.mark.slow  # another export (transformers' DynamoExporter); the message is the loader's plus a hint
def test_pt2_taking_a_cache_object_is_refused_with_the_form_needed(tmp_path, capsys):
    """transformers' DynamoExporter writes the DynamicCache itself into the signature (and pickles
    it in the example inputs): irgen says what form it reads instead."""
    zoo.import_torchvision()
    from transformers import DynamicCache
    from transformers.exporters.configs import DynamoConfig
    from transformers.exporters.exporter_dynamo import DynamoExporter

    model = _gpt2()
    cache = DynamicCache(config=model.config)
    for i in range(LAYERS):
        cache.update(torch.randn(1, HEADS, 3, HEAD), torch.randn(1, HEADS, 3, HEAD), i)
    inputs = {"input_ids": torch.tensor([[1, 2]]), "attention_mask": torch.ones(1, 5, dtype=torch.int64),
              "past_key_values": cache}
    ep, _ = DynamoExporter().export_program(model, inputs, DynamoConfig(dynamic=True))
    torch.export.save(ep, str(tmp_path / "m.pt2"))
    capsys.readouterr()
    assert irgen_main(["run", str(tmp_path / "m.pt2"), "-o", str(tmp_path / "out"), "--decode", "1",
                       "--input-shape", "input_ids=1,3", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "A program that takes a cache object (transformers' DynamicCache" in err
    assert "takes the cache as plain tensors and returns it in a dict" in err
