"""Quantized torch graphs through the torch frontend and the ``qdq`` scheme, against torch itself.

A small CNN (conv+ReLU, max pool, conv, ReLU, global average pool, flatten,
linear) is quantized three ways, exported with ``torch.export`` and saved as
``.pt2``:

* ``ref_pc`` / ``ref_pt``: FX post-training quantization (``prepare_fx``,
  calibration, then the reference conversion). ``convert_to_reference_fx``
  itself leaves ``torch.quantize_per_tensor`` on quantized tensor types, which
  ``torch.export`` refuses ("quantized nyi in meta tensors"), so the exportable
  variant ``_convert_to_reference_decomposed_fx`` is used: it writes the same
  reference graph with ``quantized_decomposed.quantize_per_tensor`` /
  ``dequantize_per_tensor`` / ``quantize_per_channel`` ops. Per-channel and
  per-tensor symmetric int8 weights, full-range uint8 activations.
* ``qat``: ``prepare_qat_fx`` with fused moving-average fake quantization,
  a few training-mode steps, observers disabled, ``eval()``; the graph holds
  ``aten.fused_moving_avg_obs_fake_quant``.

irgen runs each ``.pt2``; every layer's output file is compared with torch's
value of the FX node named in ``source`` (an FX Interpreter over the same
exported program). Integer outputs of fake-quant layers (tensor ``<node>_q``)
are compared after dequantization with the layer's output parameters. The
figures (exact-match share, max difference in LSB) are printed.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("irgen_torch")
pytest.importorskip("irgen_qdq")

from irgen.cli import main as irgen_main  # noqa: E402

nn = torch.nn
FIGURES: dict[str, dict] = {}


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(3, 8, 3, padding=1)
        self.r = nn.ReLU()
        self.p = nn.MaxPool2d(2)
        self.c2 = nn.Conv2d(8, 8, 3, padding=1)
        self.ap = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(8, 4)

    def forward(self, x):
        x = self.p(self.r(self.c1(x)))
        x = torch.relu(self.c2(x))
        return self.fc(self.ap(x).flatten(1))


def _samples(n=8):
    return [torch.randn(1, 3, 16, 16, generator=torch.Generator().manual_seed(10 + k)) for k in range(n)]


def build(kind: str, x):
    import warnings

    from torch.ao.quantization import QConfig, QConfigMapping, disable_observer
    from torch.ao.quantization.fake_quantize import FusedMovingAvgObsFakeQuantize
    from torch.ao.quantization.observer import (MinMaxObserver, MovingAverageMinMaxObserver,
                                                MovingAveragePerChannelMinMaxObserver, PerChannelMinMaxObserver)
    from torch.ao.quantization.quantize_fx import _convert_to_reference_decomposed_fx, prepare_fx, prepare_qat_fx

    warnings.simplefilter("ignore")
    torch.manual_seed(0)
    if kind in ("ref_pc", "ref_pt"):
        act = MinMaxObserver.with_args(dtype=torch.quint8, quant_min=0, quant_max=255)
        w = (PerChannelMinMaxObserver.with_args(dtype=torch.qint8, qscheme=torch.per_channel_symmetric) if kind == "ref_pc"
             else MinMaxObserver.with_args(dtype=torch.qint8, qscheme=torch.per_tensor_symmetric))
        p = prepare_fx(Net().eval(), QConfigMapping().set_global(QConfig(activation=act, weight=w)), (x,))
        with torch.no_grad():
            for s in _samples():
                p(s)
        return _convert_to_reference_decomposed_fx(p)
    act = FusedMovingAvgObsFakeQuantize.with_args(observer=MovingAverageMinMaxObserver, dtype=torch.quint8,
                                                  quant_min=0, quant_max=255)
    w = FusedMovingAvgObsFakeQuantize.with_args(observer=MovingAveragePerChannelMinMaxObserver, dtype=torch.qint8,
                                                quant_min=-128, quant_max=127, qscheme=torch.per_channel_symmetric)
    p = prepare_qat_fx(Net().train(), QConfigMapping().set_global(QConfig(activation=act, weight=w)), (x,))
    opt = torch.optim.SGD(p.parameters(), lr=0.01)
    for s in _samples():
        opt.zero_grad()
        p(s).square().mean().backward()
        opt.step()
    p.apply(disable_observer)
    return p.eval()


def record_nodes(ep, x):
    seen = {}

    class Recorder(torch.fx.Interpreter):
        def run_node(self, n):
            out = super().run_node(n)
            if isinstance(out, torch.Tensor):
                seen[n.name] = out.detach().numpy().copy()
            return out

    state = {**ep.state_dict, **dict(ep.named_buffers()), **ep.constants}
    args = [x if s.kind == torch.export.graph_signature.InputKind.USER_INPUT else state[s.target]
            for s in ep.graph_signature.input_specs]
    with torch.no_grad():
        Recorder(ep.graph_module).run(*args)
    return seen


def _lsb(got: np.ndarray, exp: np.ndarray, layer: dict) -> np.ndarray:
    """|irgen - torch| in units of the tensor's quantization step."""
    qr = layer.get("quant") or {}
    if np.issubdtype(got.dtype, np.integer) and np.issubdtype(exp.dtype, np.integer):
        return np.abs(got.astype(np.int64) - exp.astype(np.int64)).astype(np.float64)
    if np.issubdtype(got.dtype, np.integer):  # fake quant: torch holds dequantize(q)
        s, z = np.float32(qr["output"]["scale"]), int(qr["output"]["zero_point"])
        return np.abs((got.astype(np.int32) - z).astype(np.float32) * s - exp).astype(np.float64) / float(s)
    s = float(qr["inputs"][0]["scale"]) if qr.get("inputs") else float(qr["output"]["scale"])
    return np.abs(got.astype(np.float64) - exp.astype(np.float64)) / s


@pytest.fixture(scope="module", params=[("ref_pc", 3), ("ref_pt", 3), ("qat", 3), ("ref_pc", 0), ("qat", 0)],
                ids=lambda p: f"{p[0]}-O{p[1]}")
def run(request, tmp_path_factory):
    kind, opt = request.param
    d = tmp_path_factory.mktemp(f"{kind}_O{opt}")
    x = torch.randn(1, 3, 16, 16, generator=torch.Generator().manual_seed(1))
    model = build(kind, x)
    ep = torch.export.export(model, (x,))
    path = d / f"{kind}.pt2"
    torch.export.save(ep, str(path))
    np.save(d / "x.npy", x.numpy())
    out = d / "out"
    rc = irgen_main(["run", str(path), "-o", str(out), "--input", str(d / "x.npy"), "--opt-level", str(opt), "--no-progress"])
    assert rc == 0, f"irgen run failed for {kind}"
    loaded = torch.export.load(str(path))
    return {"kind": kind, "opt": opt, "out": out, "ir": json.loads((out / "ir.json").read_text()),
            "ref": record_nodes(loaded, x), "ep": loaded}


def test_layers_match_torch(run):
    ir, ref, out = run["ir"], run["ref"], run["out"]
    assert ir["producer"]["quantizer"] == "qdq"
    kinds = {(layer.get("quant") or {}).get("kind") for layer in ir["layers"]}
    assert {"conv2d", "dense"} <= kinds, kinds
    total = exact = 0
    worst = 0.0
    rows = []
    for layer in ir["layers"]:
        for rec, src in zip(layer["outputs"], layer["source"]["outputs"]):
            node = src if src in ref else layer["source"]["nodes"][0]
            assert node in ref, (layer["name"], src)
            got = np.load(out / rec["file"])
            exp = ref[node]
            assert got.shape == exp.shape, (layer["name"], got.shape, exp.shape)
            d = _lsb(got, exp, layer)
            total += d.size
            exact += int(np.sum(d == 0))
            worst = max(worst, float(d.max()))
            rows.append(f"  {layer['name']:40s} {(layer.get('quant') or {}).get('kind', '-'):16s} "
                        f"exact {np.mean(d == 0):7.2%}  max {d.max():.3g} LSB")
    share = exact / total
    FIGURES[f"{run['kind']}-O{run['opt']}"] = {"exact": share, "max_lsb": worst, "elements": total}
    print(f"\n{run['kind']} -O{run['opt']}: {len(ir['layers'])} layers, {total} values, "
          f"exact {share:.4%}, max {worst:.3g} LSB\n" + "\n".join(rows))
    assert worst <= 1.0 + 1e-6, f"max {worst} LSB"
    assert share >= 0.99, f"exact share {share:.4%}"


def test_model_output_matches_torch(run):
    ir, ref, out = run["ir"], run["ref"], run["out"]
    (o,) = ir["outputs"]
    node = run["ep"].graph_signature.user_outputs[0]
    got, exp = np.load(out / o["file"]), ref[node]
    assert got.dtype == exp.dtype == np.float32
    layer = next(la for la in ir["layers"] if la["outputs"][0]["file"] == o["file"])
    d = _lsb(got, exp, layer)
    print(f"\n{run['kind']} -O{run['opt']}: model output exact {np.mean(d == 0):.2%}, max {d.max():.3g} LSB")
    assert d.max() <= 1.0 + 1e-6


def test_layers_recompute_from_quant_and_fused_ops(run):
    """Each realized layer from its ``quant`` record alone (quant.recompute) and from its fused_ops."""
    from irgen import quant, reference

    out, ir = run["out"], run["ir"]
    for layer in ir["layers"]:
        q = layer["quant"]
        assert q is not None and q["scheme"] == "qdq", layer["name"]
        inputs = reference.load_layer_inputs(out, layer)
        params = reference.load_layer_params(out, layer)
        exp = np.load(out / layer["outputs"][-1]["file"])
        got = quant.recompute(layer, inputs, params)
        assert got.dtype == exp.dtype and np.array_equal(got, exp), ("quant", layer["name"])
        got = reference.run_layer(layer, inputs, params)[-1]
        assert got.dtype == exp.dtype and np.array_equal(got, exp), ("fused_ops", layer["name"])
