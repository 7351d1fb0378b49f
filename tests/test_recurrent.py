"""Recurrent layers: ONNX ``LSTM``, ``GRU``, ``RNN`` and torch's ``nn.LSTM``, ``nn.GRU``,
``nn.RNN`` in float, one layer per cell step (issue 39).

* ``test_torch_model``: small seeded torch models (LSTM, GRU, RNN with tanh and relu; one and
  two layers; bidirectional; ``batch_first``; with and without initial states), exported as
  ONNX (torchscript exporter, opset 17) and as ``.pt2``: ``irgen run``, then ``irgen verify``
  in all modes (the source runtime in this process), every layer compared with the source
  runtime and passing; the golden model outputs against torch's own within the float
  tolerance of the other float tests; one cell layer (``lstm``, ``gru``, ``rnn``) per layer,
  direction and step, its outputs the step's ``h`` (then ``c``), named
  ``<node>:h[layer, direction, step]`` after the source runtime's per-step states.
* ``test_onnx_attributes``: ONNX nodes as other exporters write them (built with
  ``onnx.helper``): direction ``reverse``, ``clip``, GRU ``linear_before_reset`` 0,
  ``sequence_lens`` of the full length, no bias, activations other than the defaults (an
  RNN's Relu, an LSTM's), only ``Y_h`` or ``Y_c`` as outputs; verified against ONNX Runtime.
* ``test_onnx_layout1``: ``layout=1`` (batch first; ONNX Runtime refuses it): the golden outputs
  against ONNX Runtime's of the same node with ``layout=0``, its inputs and outputs transposed.
* ``test_refused``: what irgen cannot import says why in one line (peepholes, shorter
  ``sequence_lens``, an LSTM with ``proj_size``).
* ``test_qdq_float_lstm``: ONNX Runtime's ``quantize_static`` (QDQ) of a tagger leaves its
  bidirectional LSTM in float between quantized Linear layers: float cell layers in the
  quantized graph, every layer compared with ONNX Runtime, the integer ones to the bit.
* ``test_long_sequence`` (slow): 64 steps through a two-layer bidirectional LSTM, both formats.

Not here, because irgen cannot get the model: torch's dynamically quantized LSTM
(``quantize_dynamic``) fails ``torch.export`` inside torch (its ONNX export is a float LSTM,
which runs). ONNX Runtime's ``quantize_dynamic`` (``DynamicQuantizeLSTM``) is tested in
``tests/test_recurrent_dynamic.py``.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
pytest.importorskip("tvm")
sys.path.insert(0, str(Path(__file__).parent))
from layercheck import assert_close  # noqa: E402
from test_verify import _assert_source_checked, _run  # noqa: E402

from irgen.cli import main as irgen_main  # noqa: E402
from irgen.testing import verify  # noqa: E402
from irgen.verify import MODES  # noqa: E402

STEPS, BATCH, FEATURES, HIDDEN = 4, 2, 3, 5
_CLASSES = {"lstm": "LSTM", "gru": "GRU", "rnn_tanh": "RNN", "rnn_relu": "RNN"}


class Net(torch.nn.Module):
    """One recurrent module; returns its output sequence and final states as a flat tuple."""

    def __init__(self, kind: str, layers: int, bidirectional: bool, batch_first: bool):
        super().__init__()
        extra = {"nonlinearity": kind[4:]} if kind.startswith("rnn") else {}
        self.rnn = getattr(torch.nn, _CLASSES[kind])(FEATURES, HIDDEN, num_layers=layers, bidirectional=bidirectional,
                                                     batch_first=batch_first, **extra)
        self.lstm = kind == "lstm"

    def forward(self, x, h0=None, c0=None):
        if self.lstm:
            y, (h, c) = self.rnn(x, None if h0 is None else (h0, c0))
            return y, h, c
        y, h = self.rnn(x, h0)
        return y, h


def _case(kind: str, layers: int = 1, bidirectional: bool = False, batch_first: bool = False, states: bool = False,
          steps: int = STEPS):
    """(seeded model, example inputs by name)."""
    torch.manual_seed(0)
    model = Net(kind, layers, bidirectional, batch_first).eval()
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(*((BATCH, steps) if batch_first else (steps, BATCH)), FEATURES, generator=gen)
    inputs = {"x": x}
    if states:
        shape = (layers * (2 if bidirectional else 1), BATCH, HIDDEN)
        inputs["h0"] = torch.randn(*shape, generator=gen)
        if kind == "lstm":
            inputs["c0"] = torch.randn(*shape, generator=gen)
    return model, inputs


def _export(model, inputs: dict, d: Path, fmt: str) -> Path:
    args = tuple(inputs.values())
    if fmt == "onnx":
        path = d / "m.onnx"
        torch.onnx.export(model, args, str(path), dynamo=False, opset_version=17, input_names=list(inputs))
    else:
        path = d / "m.pt2"
        torch.export.save(torch.export.export(model, args), str(path))
    return path


def run_verify(path: Path, feeds: dict[str, np.ndarray], d: Path, integer_exact: bool = False) -> tuple[dict, Path]:
    """``irgen run`` then ``irgen verify`` in all modes (the source runtime in this process):
    every layer compared with the source runtime and passing; (ir, OUT)."""
    args = []
    for name, value in feeds.items():
        np.save(d / f"{name}.npy", value)
        args += ["--input", f"{name}={d / f'{name}.npy'}"]
    out = d / "out"
    _run(path, "-o", out, *args)
    ir = json.loads((out / "ir.json").read_text())
    result = verify(out, modes=MODES)
    assert _assert_source_checked(result, ir, integer_exact) == len(ir["layers"])
    return ir, out


def _cells(ir: dict) -> list[dict]:
    return [layer for layer in ir["layers"] if layer["op"] in ("lstm", "gru", "rnn")]


def check_cells(ir: dict, op: str, layers: int, dirs: int, steps: int) -> None:
    """One ``op`` layer per layer, direction and step, named after them, its outputs the step's
    ``h`` (then ``c``, an LSTM's), named after the per-step states they are compared with."""
    import re

    cells = _cells(ir)
    assert {c["op"] for c in cells} == {op} and len(cells) == layers * dirs * steps, [c["name"] for c in cells]
    assert len({c["name"] for c in cells}) == len(cells)
    for cell in cells:
        assert re.search(r"\.(forward|reverse)\.t[0-9]+$", cell["name"]), cell["name"]
        states = ["h", "c"] if op == "lstm" else ["h"]
        # (an LSTM's last step without the state nothing reads: c when only Y is read, h when only Y_c)
        assert [o["name"].split(":")[-1][0] for o in cell["outputs"]] in (states, states[:1], states[1:]), \
            cell["outputs"]
        assert cell["source"]["outputs"] == [o["name"] for o in cell["outputs"]]
        assert cell["attrs"]["hidden_size"] == HIDDEN
        assert "".join(cell["attrs"]["gates"]) == {"lstm": "ifgo", "gru": "rzn", "rnn": "h"}[op]
        ops = {f["op"] for f in cell["fused_ops"]}
        assert "dense" in ops and (op == "rnn" or {"split", "sigmoid"} <= ops), ops


def assert_golden_outputs(out: Path, ir: dict, want, what: str) -> None:
    """The model outputs irgen wrote are the framework's own (within the float tolerance)."""
    assert len(ir["outputs"]) == len(want), (what, len(ir["outputs"]), len(want))
    for rec, w in zip(ir["outputs"], want):
        assert_close(np.load(out / rec["file"]), np.asarray(w), f"{what} output {rec['name']}")


# (kind, layers, bidirectional, batch_first, initial states)
TORCH_CASES = [
    ("lstm", 2, True, True, True),
    ("lstm", 1, False, False, False),
    ("gru", 2, True, False, True),
    ("gru", 1, False, True, False),
    ("rnn_tanh", 2, True, False, False),
    ("rnn_relu", 1, False, True, True),
]


@pytest.mark.parametrize("case,fmt", [
    pytest.param(c, f, id=f"{c[0]}-{c[1]}l{'-bi' if c[2] else ''}{'-bf' if c[3] else ''}{'-h0' if c[4] else ''}-{f}")
    for c in TORCH_CASES for f in ("onnx", "pt2")])
def test_torch_model(case, fmt, tmp_path):
    kind, layers, bidirectional, batch_first, states = case
    model, inputs = _case(kind, layers, bidirectional, batch_first, states)
    path = _export(model, inputs, tmp_path, fmt)
    ir, out = run_verify(path, {k: v.numpy() for k, v in inputs.items()}, tmp_path)
    with torch.no_grad():
        want = [t.numpy() for t in model(*inputs.values())]
    assert_golden_outputs(out, ir, want, f"{kind}.{fmt}")
    op = "rnn" if kind.startswith("rnn") else kind
    check_cells(ir, op, layers, 2 if bidirectional else 1, STEPS)
    if fmt == "pt2":  # the results: the concatenated states, named after the module and compared with torch's
        results = [layer for layer in ir["layers"] if layer not in _cells(ir)]
        assert [r["name"].rsplit(".", 1)[1] for r in results] == ["output", "h_n", "c_n"][:len(want)], results


# ---------------------------------------------------------------- ONNX nodes other exporters write


def onnx_recurrent(op: str = "LSTM", direction: str = "forward", layout: int = 0, steps: int = STEPS,
                   outputs: tuple[str, ...] = ("Y", "Y_h", "Y_c"), bias: bool = True, lengths: bool = False,
                   states: bool = False, peepholes: bool = False, **attrs):
    """A model of one ``op`` node (random weights, seeded) and its inputs."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    gates, dirs = {"LSTM": 4, "GRU": 3, "RNN": 1}[op], 2 if direction == "bidirectional" else 1

    def f(*shape):
        return (rng.standard_normal(shape) * 0.5).astype(np.float32)

    inits = [numpy_helper.from_array(f(dirs, gates * HIDDEN, FEATURES), "W"),
             numpy_helper.from_array(f(dirs, gates * HIDDEN, HIDDEN), "R")]
    if bias:
        inits.append(numpy_helper.from_array(f(dirs, 2 * gates * HIDDEN), "B"))
    x_shape = [BATCH, steps, FEATURES] if layout else [steps, BATCH, FEATURES]
    feeds = {"X": f(*x_shape)}
    if lengths:
        inits.append(numpy_helper.from_array(np.asarray(lengths if lengths is not True else [steps] * BATCH, np.int32),
                                             "L"))
    if peepholes:
        inits.append(numpy_helper.from_array(f(dirs, 3 * HIDDEN), "P"))
    state = [BATCH, dirs, HIDDEN] if layout else [dirs, BATCH, HIDDEN]
    ins = ["X", "W", "R", "B" if bias else "", "L" if lengths else ""]
    for name in (("h0", "c0") if op == "LSTM" else ("h0",)) if states else ():
        feeds[name] = f(*state)
        ins.append(name)
    if peepholes:
        ins += [""] * (7 - len(ins)) + ["P"]
    names = ["Y", "Y_h", "Y_c"][:3 if op == "LSTM" else 2]
    node_outs = [n if n in outputs else "" for n in names]
    while not node_outs[-1]:
        node_outs.pop()
    shapes = {"Y": [BATCH, steps, dirs, HIDDEN] if layout else [steps, dirs, BATCH, HIDDEN], "Y_h": state, "Y_c": state}
    node = helper.make_node(op, ins, node_outs, name="rec", direction=direction, hidden_size=HIDDEN,
                            **({"layout": layout} if layout else {}), **attrs)
    graph = helper.make_graph(
        [node], "g", [helper.make_tensor_value_info(k, TensorProto.FLOAT, v.shape) for k, v in feeds.items()],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, shapes[n]) for n in node_outs if n], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 14)], ir_version=8)
    onnx.checker.check_model(model)
    return model, feeds


ONNX_CASES = {
    "lstm-reverse": dict(direction="reverse", states=True),
    "lstm-y-only": dict(outputs=("Y",), bias=False),
    "lstm-clip": dict(clip=0.3, direction="bidirectional"),
    "lstm-activations": dict(activations=["Sigmoid", "Tanh", "Relu"]),
    "lstm-lengths-no-bias": dict(lengths=True, bias=False, outputs=("Y_c",)),
    "gru-default": dict(op="GRU", outputs=("Y_h",)),  # linear_before_reset 0, ONNX's default
    "gru-reset-after-clip": dict(op="GRU", linear_before_reset=1, clip=0.5, direction="reverse", states=True),
    "gru-bidirectional": dict(op="GRU", direction="bidirectional", states=True, activations=["Sigmoid", "Tanh"] * 2),
    "rnn-relu": dict(op="RNN", activations=["Relu"], states=True),
    "rnn-bidirectional": dict(op="RNN", direction="bidirectional", activations=["Tanh", "Sigmoid"]),
}


@pytest.mark.parametrize("name", ONNX_CASES)
def test_onnx_attributes(name, tmp_path):
    kwargs = ONNX_CASES[name]
    model, feeds = onnx_recurrent(**kwargs)
    onnx.save(model, tmp_path / "m.onnx")
    ir, out = run_verify(tmp_path / "m.onnx", feeds, tmp_path)
    want = ort.InferenceSession(str(tmp_path / "m.onnx")).run(None, feeds)
    assert_golden_outputs(out, ir, want, name)
    op = kwargs.get("op", "LSTM").lower()
    check_cells(ir, op, 1, 2 if kwargs.get("direction") == "bidirectional" else 1, STEPS)
    if "clip" in kwargs:
        assert all(c["attrs"]["clip"] == pytest.approx(kwargs["clip"]) for c in _cells(ir))


@pytest.mark.parametrize("op", ["LSTM", "GRU"])
def test_onnx_layout1(op, tmp_path):
    model, feeds = onnx_recurrent(op, "bidirectional", layout=1, states=True)
    onnx.save(model, tmp_path / "m.onnx")
    out = tmp_path / "out"
    _run(tmp_path / "m.onnx", "-o", out, *[a for k in feeds for a in ("--input", f"{k}={_saved(tmp_path, k, feeds)}")])
    ir = json.loads((out / "ir.json").read_text())
    assert verify(out, modes=("single", "entire"))["passed"]
    twin, twin_feeds = onnx_recurrent(op, "bidirectional", layout=0, states=True)  # the same weights, batch second
    twin_feeds = {k: np.swapaxes(v, 0, 1) for k, v in feeds.items()}
    want = ort.InferenceSession(twin.SerializeToString()).run(None, twin_feeds)
    want = [np.transpose(want[0], (2, 0, 1, 3)), *(np.swapaxes(w, 0, 1) for w in want[1:])]
    assert_golden_outputs(out, ir, want, f"{op} layout 1")
    check_cells(ir, op.lower(), 1, 2, STEPS)


def _saved(d: Path, name: str, feeds: dict) -> Path:
    np.save(d / f"{name}.npy", feeds[name])
    return d / f"{name}.npy"


def test_refused(tmp_path, capsys):
    cases = {
        "peepholes": (onnx_recurrent(peepholes=True), "peephole weights (P) are not supported"),
        "lengths": (onnx_recurrent(lengths=[STEPS, STEPS - 1]), "sequence_lens [4, 3] shorter than the sequence"),
        "long": (onnx_recurrent(steps=5000), "over 5000 time steps: irgen unrolls at most 4096"),
    }
    for name, ((model, feeds), message) in cases.items():
        onnx.save(model, tmp_path / f"{name}.onnx")
        args = [a for k in feeds for a in ("--input", f"{k}={_saved(tmp_path, k, feeds)}")]
        capsys.readouterr()
        assert irgen_main(["run", str(tmp_path / f"{name}.onnx"), "-o", str(tmp_path / name), *args,
                           "--no-progress"]) != 0
        err = capsys.readouterr().err
        assert message in err and ("node 'rec' (LSTM)" in err or name == "long"), err
    torch.manual_seed(0)
    proj = torch.nn.LSTM(FEATURES, HIDDEN, proj_size=2).eval()
    x = torch.randn(STEPS, BATCH, FEATURES)
    torch.export.save(torch.export.export(proj, (x,)), str(tmp_path / "proj.pt2"))
    np.save(tmp_path / "x.npy", x.numpy())
    assert irgen_main(["run", str(tmp_path / "proj.pt2"), "-o", str(tmp_path / "proj"), "--input",
                       str(tmp_path / "x.npy"), "--no-progress"]) != 0
    assert "proj_size is not supported" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["onnx", "pt2"])
def test_long_sequence(fmt, tmp_path):
    steps = 64
    model, inputs = _case("lstm", 2, True, False, False, steps=steps)
    path = _export(model, inputs, tmp_path, fmt)
    t0 = time.perf_counter()
    ir, out = run_verify(path, {k: v.numpy() for k, v in inputs.items()}, tmp_path)
    print(f"{fmt}: {len(ir['layers'])} layers, run and verify {time.perf_counter() - t0:.1f} s")
    with torch.no_grad():
        want = [t.numpy() for t in model(*inputs.values())]
    assert_golden_outputs(out, ir, want, f"lstm {steps} steps {fmt}")
    check_cells(ir, "lstm", 2, 2, steps)


class Tagger(torch.nn.Module):
    """A sequence tagger: Linear + ReLU, a bidirectional LSTM, Linear (quantized around the LSTM)."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Linear(FEATURES, FEATURES)
        self.rnn = torch.nn.LSTM(FEATURES, HIDDEN, bidirectional=True)
        self.head = torch.nn.Linear(2 * HIDDEN, 2)

    def forward(self, x):
        y, _ = self.rnn(torch.relu(self.embed(x)))
        return self.head(y)


def test_qdq_float_lstm(tmp_path):
    """ONNX Runtime's ``quantize_static`` (QDQ) leaves an LSTM in float between its Q/DQ
    neighbours: the steps are float ``lstm`` layers in the quantized graph, every layer
    compared with ONNX Runtime (integer layers to the bit)."""
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, quantize_static

    torch.manual_seed(0)
    model = Tagger().eval()
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(STEPS, BATCH, FEATURES, generator=gen)
    _export(model, {"x": x}, tmp_path, "onnx")

    class Reader(CalibrationDataReader):
        def __init__(self):
            self.batches = iter([{"x": torch.randn(STEPS, BATCH, FEATURES, generator=gen).numpy()} for _ in range(8)])

        def get_next(self):
            return next(self.batches, None)

    quantize_static(str(tmp_path / "m.onnx"), str(tmp_path / "q.onnx"), Reader(), quant_format=QuantFormat.QDQ)
    ir, out = run_verify(tmp_path / "q.onnx", {"x": x.numpy()}, tmp_path, integer_exact=True)
    check_cells(ir, "lstm", 1, 2, STEPS)
    assert all(c["quant"] is None for c in _cells(ir))
    assert {"dense", "quantize", "dequantize"} <= {layer["op"] for layer in ir["layers"]}
    want = ort.InferenceSession(str(tmp_path / "q.onnx")).run(None, {"x": x.numpy()})
    assert_golden_outputs(out, ir, want, "quantized tagger")
