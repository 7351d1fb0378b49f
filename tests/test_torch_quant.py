"""Quantized torch graphs through the torch frontend and the ``qdq`` scheme, against torch itself.

Models, each exported with ``torch.export`` and saved as ``.pt2``:

* a small CNN (conv+ReLU, max pool, conv, ReLU, global average pool, flatten,
  linear), three ways: ``ref_pc`` / ``ref_pt``, FX post-training
  quantization (``prepare_fx``, calibration, then the reference conversion)
  with per-channel / per-tensor symmetric int8 weights; ``qat``,
  ``prepare_qat_fx`` with fused moving-average fake quantization, a few
  training steps, observers disabled, ``eval()`` (the graph holds
  ``aten.fused_moving_avg_obs_fake_quant``). ``convert_to_reference_fx``
  itself leaves ``torch.quantize_per_tensor`` on quantized tensor types, which
  ``torch.export`` refuses ("quantized nyi in meta tensors"), so the
  exportable variant ``_convert_to_reference_decomposed_fx`` is used: the same
  reference graph with ``quantized_decomposed`` quantize/dequantize ops.
* the float models of the torch frontend tests (``tests/models.py``: the
  concat/transpose/pooling CNN with BatchNorm and a residual add, the MLP with
  a sigmoid, the ResNet-18-sized CNN, marked slow), each as ``ptq`` (the
  qnnpack default mapping, so sigmoid has its fixed parameters 1/256, with our
  observers elsewhere: per-channel int8 weights, full-range uint8
  activations) and ``qat`` (fused fake quant everywhere, observers disabled;
  BatchNorm folded into the convolutions first: the conv+BN training
  simulation is refused, ``test_qat_conv_bn_simulation_refused``); the small
  CNN also as ``qatref``, QAT with BatchNorm then the reference conversion.
* ``fq_direct``: a net that calls ``torch.fake_quantize_per_tensor_affine``
  (float and tensor parameters) and ``torch.fake_quantize_per_channel_affine``
  itself.

irgen runs each ``.pt2``; torch's values come from an FX Interpreter over the
same exported program. Two comparisons, both printed (exact-match share, max
difference in LSB):

* chained: every layer's output file (irgen's inputs are irgen's outputs)
  against torch's value of the FX node named in ``source``. Integer outputs of
  fake-quant layers (tensor ``<node>_q``) are compared after dequantization.
* isolated: every quantized layer recomputed from its ``quant`` record
  (``quant.recompute``, which the last test shows equals the files) on torch's
  integer inputs, against torch's output.

torch runs the convolutions and linears of its reference graphs in float32
(oneDNN) on dequantized values; irgen accumulates the integers exactly, so a
float sum within an ulp of a rounding tie can land on the other integer. On
the small models that never happens; on ResNet-18 it does for a handful of
the 5.1 million values (isolated), and chained those ±1 flips spread through
the following layers, so the chained bounds for ResNet-18 are looser.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("irgen_torch")
pytest.importorskip("irgen_qdq")

sys.path.insert(0, str(Path(__file__).parent))
import models  # noqa: E402
from layercheck import assert_close, assert_layer_recomputes  # noqa: E402

from irgen.cli import main as irgen_main  # noqa: E402
from irgen_torch import record_nodes  # noqa: E402

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


def _samples(n=8, shape=(1, 3, 16, 16)):
    return [torch.randn(*shape, generator=torch.Generator().manual_seed(10 + k)) for k in range(n)]


def _qconfigs(qat: bool):
    """uint8 full-range activations, symmetric per-channel int8 weights."""
    from torch.ao.quantization import QConfig
    from torch.ao.quantization.fake_quantize import FusedMovingAvgObsFakeQuantize
    from torch.ao.quantization.observer import (MinMaxObserver, MovingAverageMinMaxObserver,
                                                MovingAveragePerChannelMinMaxObserver, PerChannelMinMaxObserver)

    if not qat:
        return QConfig(activation=MinMaxObserver.with_args(dtype=torch.quint8, quant_min=0, quant_max=255),
                       weight=PerChannelMinMaxObserver.with_args(dtype=torch.qint8, qscheme=torch.per_channel_symmetric))
    return QConfig(
        activation=FusedMovingAvgObsFakeQuantize.with_args(observer=MovingAverageMinMaxObserver, dtype=torch.quint8,
                                                           quant_min=0, quant_max=255),
        weight=FusedMovingAvgObsFakeQuantize.with_args(observer=MovingAveragePerChannelMinMaxObserver, dtype=torch.qint8,
                                                       quant_min=-128, quant_max=127, qscheme=torch.per_channel_symmetric))


def _train_qat(p, samples, lr=0.001):
    """A few training steps (observers and fake quant on), then observers off and eval()."""
    from torch.ao.quantization import disable_observer

    opt = torch.optim.SGD(p.parameters(), lr=lr)
    for s in samples:
        opt.zero_grad()
        p(s).square().mean().backward()
        opt.step()
    p.apply(disable_observer)
    return p.eval()


def build_model(name: str, flow: str, x, fold_bn: bool = True):
    """A float model of tests/models.py quantized with FX PTQ (``ptq``) or QAT fake quant (``qat``)."""
    import warnings

    from torch.ao.quantization import QConfigMapping, get_default_qconfig_mapping
    from torch.ao.quantization.quantize_fx import _convert_to_reference_decomposed_fx, prepare_fx, prepare_qat_fx

    warnings.simplefilter("ignore")
    cls, shape = models.BUILDERS[name]
    torch.manual_seed(0)
    model = cls()
    models._randomize_bn(model)
    samples = _samples(4, shape)
    if flow == "ptq":
        qmap = get_default_qconfig_mapping("qnnpack").set_global(_qconfigs(False))
        p = prepare_fx(model.eval(), qmap, (x,))
        with torch.no_grad():
            for s in samples:
                p(s)
        return _convert_to_reference_decomposed_fx(p)
    if flow == "qatref":  # QAT with the conv+BN simulation, then the reference conversion (BN folded there)
        qmap = QConfigMapping().set_global(_qconfigs(True))
        return _convert_to_reference_decomposed_fx(_train_qat(prepare_qat_fx(model.train(), qmap, (x,)), samples))
    if fold_bn:  # QAT on convolutions with BatchNorm folded in (the conv+BN simulation graph is refused)
        from torch.fx.experimental.optimization import fuse

        model = fuse(model.eval())
    # the fixed-parameter ops' FixedQParamsFakeQuantize does not export (its forward branches on buffer
    # values), so QAT uses the one qconfig everywhere: sigmoid's output gets a moving-average fake quant
    qmap = QConfigMapping().set_global(_qconfigs(True))
    return _train_qat(prepare_qat_fx(model.train(), qmap, (x,)), samples)


def build(kind: str, x):
    """The small CNN: ``ref_pc`` / ``ref_pt`` (FX PTQ, per-channel / per-tensor weights) or ``qat``."""
    import warnings

    from torch.ao.quantization import QConfig, QConfigMapping
    from torch.ao.quantization.observer import MinMaxObserver
    from torch.ao.quantization.quantize_fx import _convert_to_reference_decomposed_fx, prepare_fx, prepare_qat_fx

    warnings.simplefilter("ignore")
    torch.manual_seed(0)
    if kind == "qat":
        return _train_qat(prepare_qat_fx(Net().train(), QConfigMapping().set_global(_qconfigs(True)), (x,)),
                          _samples(), lr=0.01)
    qc = _qconfigs(False)
    if kind == "ref_pt":
        qc = QConfig(activation=qc.activation,
                     weight=MinMaxObserver.with_args(dtype=torch.qint8, qscheme=torch.per_tensor_symmetric))
    p = prepare_fx(Net().eval(), QConfigMapping().set_global(qc), (x,))
    with torch.no_grad():
        for s in _samples():
            p(s)
    return _convert_to_reference_decomposed_fx(p)


class FQNet(nn.Module):
    """Fake quantization written out: ``torch.fake_quantize_per_tensor_affine`` with float and with
    tensor parameters, ``torch.fake_quantize_per_channel_affine`` on the weights; a concatenation
    of tensors with different parameters (which FX never writes: its cat shares one observer)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(4)
        self.c = nn.Conv2d(3, 8, 3, padding=1)
        self.fc = nn.Linear(16 * 8 * 8, 5)
        for mod, name in ((self.c, "c"), (self.fc, "fc")):
            w = mod.weight.detach()
            self.register_buffer(f"{name}_ws", (w.abs().reshape(w.shape[0], -1).amax(1) / 127).float())
            self.register_buffer(f"{name}_wz", torch.zeros(w.shape[0], dtype=torch.int32))
        self.register_buffer("s1", torch.tensor([0.0123]))
        self.register_buffer("z1", torch.tensor([0], dtype=torch.int32))

    def forward(self, x):
        x = torch.fake_quantize_per_tensor_affine(x, 0.0251, 127, 0, 255)
        w = torch.fake_quantize_per_channel_affine(self.c.weight, self.c_ws, self.c_wz, 0, -128, 127)
        y = torch.relu(nn.functional.conv2d(x, w, self.c.bias, padding=1))
        y = torch.fake_quantize_per_tensor_affine(y, self.s1, self.z1, 0, 255)
        # an average pool and a concatenation whose inputs and output all have other parameters
        b = torch.fake_quantize_per_tensor_affine(nn.functional.avg_pool2d(y, 3, 1, 1), 0.0071, 3, 0, 255)
        y = torch.fake_quantize_per_tensor_affine(torch.cat([y, b], 1), 0.0149, 0, 0, 255)
        w = torch.fake_quantize_per_channel_affine(self.fc.weight, self.fc_ws, self.fc_wz, 0, -128, 127)
        y = torch.fake_quantize_per_tensor_affine(y.flatten(1), 0.0149, 0, 0, 255)  # as FX puts it
        y = nn.functional.linear(y, w, self.fc.bias)
        return torch.fake_quantize_per_tensor_affine(y, 0.0077, 131, 0, 255)


def _irgen(model, x, d: Path, opt: int = 3):
    """Export ``model`` on ``x``, save it as .pt2, run irgen; the fixture's dict."""
    ep = torch.export.export(model, (x,))
    path = d / "model.pt2"
    torch.export.save(ep, str(path))
    np.save(d / "x.npy", x.numpy())
    out = d / "out"
    rc = irgen_main(["run", str(path), "-o", str(out), "--input", str(d / "x.npy"), "--opt-level", str(opt), "--no-progress"])
    assert rc == 0, f"irgen run failed for {d.name}"
    loaded = torch.export.load(str(path))
    return {"opt": opt, "out": out, "ir": json.loads((out / "ir.json").read_text()),
            "ref": record_nodes(loaded, [x]), "ep": loaded}


def _lsb(got: np.ndarray, exp: np.ndarray, layer: dict) -> np.ndarray:
    """|irgen - torch| in quantization steps. A float value (a fake-quant node's ``(q - zp) * s``, a
    dequantized output) is taken back to its step ``rint(v / s)``, exact for 8-bit q."""
    qr = layer.get("quant") or {}
    if np.issubdtype(got.dtype, np.integer) and np.issubdtype(exp.dtype, np.integer):
        return np.abs(got.astype(np.int64) - exp.astype(np.int64)).astype(np.float64)
    rec = qr["output"] if np.issubdtype(got.dtype, np.integer) else (qr.get("inputs") or [qr["output"]])[0]
    s, z = float(np.float32(rec["scale"])), int(rec["zero_point"])

    def steps(v):
        return v.astype(np.int64) - z if np.issubdtype(v.dtype, np.integer) else np.rint(v.astype(np.float64) / s)

    d = np.abs(steps(got) - steps(exp)).astype(np.float64)
    if np.issubdtype(got.dtype, np.floating) and np.issubdtype(exp.dtype, np.floating):
        d[(d == 0) & (got != exp)] = 0.5  # the same step written as another float: not exact either
    return d


#: the default suite has each flow once (per-channel PTQ at both opt levels, QAT, the float models'
#: PTQ, fake quant called directly); their variants and the ResNet-18-sized CNN are slow
SLOW = {("ref_pt", 3), ("qat", 0), ("small_cnn-qat", 3), ("small_cnn-qatref", 3), ("mlp-qat", 3)}
CASES = [pytest.param(p, id=f"{p[0]}-O{p[1]}", marks=[pytest.mark.slow] if p in SLOW else [])
         for p in [("ref_pc", 3), ("ref_pt", 3), ("qat", 3), ("ref_pc", 0), ("qat", 0)]]
CASES += [pytest.param((f"{m}-{f}", 3), id=f"{m}-{f}",
                       marks=[pytest.mark.slow] if m == "resnet18" or (f"{m}-{f}", 3) in SLOW else [])
          for m, f in [("small_cnn", "ptq"), ("small_cnn", "qat"), ("small_cnn", "qatref"), ("mlp", "ptq"),
                       ("mlp", "qat"), ("resnet18", "ptq"), ("resnet18", "qat")]]
CASES += [pytest.param(("fq_direct", 3), id="fq_direct")]
#: quant kinds each model's IR must hold
KINDS = {"small_cnn": {"conv2d", "dense", "add", "avg_pool2d", "concatenate", "integer", "lut"},
         "mlp": {"dense", "lut"}, "resnet18": {"conv2d", "dense", "add", "integer", "global_avg_pool_float"},
         "fq_direct": {"quantize", "conv2d", "dense", "avg_pool2d", "concatenate"}}
#: chained comparison (exact share, max LSB): torch's float conv rounding flips spread on ResNet-18.
#: Measured at 70bc226: isolated, 20 of 5.1 million values differ (qat; torch's float ties, 1 LSB);
#: chained, their spread leaves 99.11% (ptq) and 98.71% (qat) exact, max 4 LSB. The isolated test
#: is the exactness check; this bound only catches a spread far beyond those seeds.
CHAINED = {"resnet18": (0.98, 6.0)}
EXACT, MAX_LSB = 0.999, 1.0


@pytest.fixture(scope="module", params=CASES)
def run(request, tmp_path_factory):
    kind, opt = request.param
    d = tmp_path_factory.mktemp(f"{kind}_O{opt}")
    if "-" in kind and kind.split("-")[0] in models.BUILDERS:
        name, flow = kind.split("-")
        x = torch.randn(*models.BUILDERS[name][1], generator=torch.Generator().manual_seed(1))
        model = build_model(name, flow, x)
    elif kind == "fq_direct":
        x = torch.randn(1, 3, 8, 8, generator=torch.Generator().manual_seed(1))
        model = FQNet().eval()
    else:
        x = torch.randn(1, 3, 16, 16, generator=torch.Generator().manual_seed(1))
        model = build(kind, x)
    return {"kind": kind, **_irgen(model, x, d, opt)}


def _float_layer(layer) -> bool:
    """A layer torch leaves in float (softmax after the last dequantize, say): no quant record."""
    return layer.get("quant") is None


def test_layers_match_torch(run):
    ir, ref, out = run["ir"], run["ref"], run["out"]
    assert ir["producer"]["quantizer"] == "qdq"
    kinds = {(layer.get("quant") or {}).get("kind") for layer in ir["layers"]}
    want = KINDS.get(run["kind"].split("-")[0], {"conv2d", "dense"})
    if run["kind"] == "fq_direct":
        ops = {n.target.__name__ for n in run["ep"].graph.nodes if n.op == "call_function"}
        assert {"fake_quantize_per_tensor_affine.default", "fake_quantize_per_tensor_affine.tensor_qparams",
                "fake_quantize_per_channel_affine.default"} <= ops, ops
        (cat,) = [la["quant"] for la in ir["layers"] if (la["quant"] or {}).get("kind") == "concatenate"]
        assert all(t is not None and len(t) == 256 for t in cat["tables"]), "both inputs requantized by a table"
    assert want <= kinds, kinds
    total = exact = 0
    worst = 0.0
    rows = []
    for layer in ir["layers"]:
        for rec, src in zip(layer["outputs"], layer["source"]["outputs"]):
            node = src if src in ref else layer["source"]["nodes"][-1]
            assert node in ref, (layer["name"], src)
            got = np.load(out / rec["file"])
            exp = ref[node]
            assert got.shape == exp.shape, (layer["name"], got.shape, exp.shape)
            if _float_layer(layer):
                err = assert_close(got, exp, f"float layer {layer['name']}")
                rows.append(f"  {layer['name']:40s} {'float':16s} max |irgen - torch| {err:.3g}")
                continue
            d = _lsb(got, exp, layer)
            total += d.size
            exact += int(np.sum(d == 0))
            worst = max(worst, float(d.max()))
            rows.append(f"  {layer['name']:40s} {(layer.get('quant') or {}).get('kind', '-'):16s} "
                        f"exact {np.mean(d == 0):7.2%}  max {d.max():.3g} LSB")
    share = exact / total
    FIGURES[f"{run['kind']}-O{run['opt']} chained"] = {"exact": share, "max_lsb": worst, "elements": total}
    print(f"\n{run['kind']} -O{run['opt']} chained: {len(ir['layers'])} layers, {total} values, "
          f"exact {share:.4%} ({total - exact} differ), max {worst:.3g} LSB\n" + "\n".join(rows))
    want_exact, want_lsb = CHAINED.get(run["kind"].split("-")[0], (EXACT, MAX_LSB))
    assert worst <= want_lsb + 1e-6, f"max {worst} LSB"
    assert share >= want_exact, f"exact share {share:.4%}"


def _torch_input(ref: dict, rec: dict, qrec: dict | None) -> np.ndarray:
    """torch's value of a layer input; a fake-quant integer tensor ``<node>_q`` from ``<node>``'s
    float value ``(q - zp) * s`` (exactly invertible for 8-bit q)."""
    if rec["name"] in ref:
        return ref[rec["name"]]
    base = rec["name"].removesuffix("_q")
    assert rec["name"].endswith("_q") and base in ref and qrec is not None, rec["name"]
    s, z = float(np.float32(qrec["scale"])), int(qrec["zero_point"])
    return (np.rint(ref[base].astype(np.float64) / s) + z).astype(rec["dtype"])


def test_layers_match_torch_isolated(run):
    """Each quantized layer's arithmetic on torch's own inputs against torch's output."""
    from irgen import quant, reference

    ir, ref, out = run["ir"], run["ref"], run["out"]
    total = exact = 0
    worst = 0.0
    rows = []
    for layer in ir["layers"]:
        qr = layer.get("quant")
        if qr is None:
            continue
        qins = qr.get("inputs") or []
        inputs = [_torch_input(ref, rec, qins[k] if k < len(qins) else None) for k, rec in enumerate(layer["inputs"])]
        got = quant.recompute(layer, inputs, reference.load_layer_params(out, layer))
        src = layer["source"]["outputs"][-1]
        d = _lsb(got, ref[src if src in ref else layer["source"]["nodes"][-1]], layer)
        total += d.size
        exact += int(np.sum(d == 0))
        worst = max(worst, float(d.max()))
        if d.max() > 0:
            rows.append(f"  {layer['name']:40s} {qr['kind']:16s} exact {np.mean(d == 0):.5%}  max {d.max():.3g} LSB")
    share = exact / total
    FIGURES[f"{run['kind']}-O{run['opt']} isolated"] = {"exact": share, "max_lsb": worst, "elements": total}
    print(f"\n{run['kind']} -O{run['opt']} isolated: {total} values, exact {share:.5%} ({total - exact} differ), "
          f"max {worst:.3g} LSB\n"
          + "\n".join(rows))
    assert worst <= MAX_LSB + 1e-6, f"max {worst} LSB"
    assert share >= EXACT, f"exact share {share:.4%}"


def test_model_output_matches_torch(run):
    ir, ref, out = run["ir"], run["ref"], run["out"]
    (o,) = ir["outputs"]
    node = run["ep"].graph_signature.user_outputs[0]
    got, exp = np.load(out / o["file"]), ref[node]
    assert got.dtype == exp.dtype == np.float32
    layer = next(la for la in ir["layers"] if la["outputs"][0]["file"] == o["file"])
    if _float_layer(layer):
        err = assert_close(got, exp, "model output (float layer)")
        print(f"\n{run['kind']} -O{run['opt']}: model output (float {layer['op']}) max |irgen - torch| {err:.3g}")
        return
    d = _lsb(got, exp, layer)
    print(f"\n{run['kind']} -O{run['opt']}: model output exact {np.mean(d == 0):.2%}, max {d.max():.3g} LSB")
    assert d.max() <= MAX_LSB + 1e-6
    # ResNet-18's 1000 logits sit after 20 convolutions' worth of spread rounding flips (chained)
    assert np.mean(d == 0) >= (0.8 if run["kind"].startswith("resnet18") else EXACT)


def test_layers_recompute_from_quant_and_fused_ops(run):
    """Each realized layer from its ``quant`` record alone (quant.recompute) and from its fused_ops."""
    out, ir = run["out"], run["ir"]
    for layer in ir["layers"]:
        if _float_layer(layer) and layer["op"] == "softmax":
            continue
        q = layer["quant"]
        assert q is not None and q["scheme"] == "qdq", layer["name"]
        assert q.get("reference") == "torch" or q["kind"] in ("integer", "dequantize"), (layer["name"], q["kind"])
        assert_layer_recomputes(out, layer)


def test_verify_compares_every_fake_quant_layer_with_torch(run, capsys):
    """``irgen verify``'s source check finds torch's value for every layer of a fake-quant
    graph: an integer layer's input and output are ``<fake-quant node>_q``, which torch's run
    answers with the integers behind the fake-quant output (they were ``missing`` and the check
    compared the one float layer)."""
    if not any("fake_quant" in str(n.target) for n in run["ep"].graph.nodes):
        pytest.skip("no fake-quant nodes (a reference-quantized graph)")
    capsys.readouterr()
    rc = irgen_main(["verify", str(run["out"]), "--mode", "source", "--json", "--no-report", "--no-progress"])
    result = json.loads(capsys.readouterr().out)
    assert rc == 0 and result["source"]["ran"], result["problems"]
    statuses = {row["name"]: row["checks"]["source"]["status"] for row in result["layers"]}
    assert set(statuses.values()) == {"pass"}, statuses
    integer = [row for row in result["layers"] if row["integer"]]
    assert integer and all(row["checks"]["source"]["tensor"] for row in integer)
    assert any(row["checks"]["source"].get("source_tensor", "").endswith("_q") for row in integer), integer[0]


# ---------------------------------------------------------------- refusals


class _PerChannelAct(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("s", torch.full((3,), 0.02))
        self.register_buffer("z", torch.zeros(3, dtype=torch.int32))

    def forward(self, x):
        ops = torch.ops.quantized_decomposed
        q = ops.quantize_per_channel.default(x, self.s, self.z, 1, -128, 127, torch.int8)
        return torch.relu(ops.dequantize_per_channel.default(q, self.s, self.z, 1, -128, 127, torch.int8))


def _refused(tmp_path, capsys, model, x, *needles):
    ep = torch.export.export(model, (x,))
    torch.export.save(ep, str(tmp_path / "m.pt2"))
    capsys.readouterr()
    rc = irgen_main(["run", str(tmp_path / "m.pt2"), "-o", str(tmp_path / "out"), "--no-progress"])
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.startswith("irgen: error:")]
    assert rc == 2 and len(lines) == 1 and "Traceback" not in err, err
    for n in needles:
        assert n in lines[0], lines[0]
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("flow", ["ptq", pytest.param("qat", marks=pytest.mark.slow)])
def test_reduce_range_of_the_default_mappings(tmp_path, capsys, flow):
    """torch's default mappings (``get_default_qconfig_mapping()``, x86) quantize activations with
    ``reduce_range``: uint8 values clamped to [0, 127]. irgen refused them ("not the full uint8
    range"); each quantize now clamps there (its records say ``"range": [0, 127]``), and every
    integer layer equals torch's values."""
    from torch.ao.quantization import get_default_qat_qconfig_mapping, get_default_qconfig_mapping
    from torch.ao.quantization.quantize_fx import _convert_to_reference_decomposed_fx, prepare_fx, prepare_qat_fx

    torch.manual_seed(0)
    x = torch.randn(1, 3, 16, 16, generator=torch.Generator().manual_seed(1)) * 3  # beyond the calibration
    if flow == "ptq":
        p = prepare_fx(Net().eval(), get_default_qconfig_mapping(), (x,))
        with torch.no_grad():
            for sample in _samples():
                p(sample)
        model = _convert_to_reference_decomposed_fx(p)
    else:
        model = _train_qat(prepare_qat_fx(Net().train(), get_default_qat_qconfig_mapping(), (x,)), _samples())
    r = _irgen(model, x, tmp_path)
    layers = [la for la in r["ir"]["layers"] if la["outputs"][0]["dtype"] == "uint8"]
    assert layers and all(la["quant"]["output"]["range"] == [0, 127] for la in layers), [la["quant"] for la in layers][:2]
    assert max(int(np.load(r["out"] / la["outputs"][0]["file"]).max()) for la in layers) == 127
    # a global pool is torch's mean, which adds in another order than the row-order float32 sum
    # (1 LSB at a tie; docs/quantization.md, torch graphs): verified, not compared bit for bit
    _equal_to_torch_and_verified(r, [la for la in layers if la["quant"]["kind"] != "global_avg_pool_float"], capsys)


def test_per_channel_activation_refused(tmp_path, capsys):
    _refused(tmp_path, capsys, _PerChannelAct(), torch.randn(1, 3, 4, 4), "quantized per channel", "not supported")


def test_observers_enabled_refused(tmp_path, capsys):
    from torch.ao.quantization import QConfigMapping
    from torch.ao.quantization.quantize_fx import prepare_qat_fx

    x = torch.randn(1, 3, 16, 16)
    p = prepare_qat_fx(Net().train(), QConfigMapping().set_global(_qconfigs(True)), (x,))
    p(x)
    _refused(tmp_path, capsys, p.eval(), x, "observer enabled", "disable_observer")


def test_qat_conv_bn_simulation_refused(tmp_path, capsys):
    """prepare_qat_fx on conv+BatchNorm fake-quantizes ``weight * bn_scale`` computed in the graph."""
    x = torch.randn(*models.BUILDERS["small_cnn"][1], generator=torch.Generator().manual_seed(1))
    model = build_model("small_cnn", "qat", x, fold_bn=False)
    _refused(tmp_path, capsys, model, x, "fake-quantizes a computed tensor per channel", "BatchNorm",
             "_convert_to_reference_decomposed_fx")


def test_dynamic_quantization_refused_by_name(tmp_path, capsys):
    """torch's dynamic quantization (FX ``default_dynamic_qconfig`` on Linear; PT2E's ``is_dynamic``
    writes the same ``choose_qparams``): one error that says so and names the static flows, not
    "unsupported ops: quantized_decomposed.choose_qparams.tensor"."""
    import warnings

    from torch.ao.quantization import QConfigMapping, default_dynamic_qconfig
    from torch.ao.quantization.quantize_fx import _convert_to_reference_decomposed_fx, prepare_fx

    warnings.simplefilter("ignore")
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 8)).eval()
    x = torch.randn(1, 16)
    p = prepare_fx(m, QConfigMapping().set_object_type(nn.Linear, default_dynamic_qconfig), (x,))
    p(x)
    _refused(tmp_path, capsys, _convert_to_reference_decomposed_fx(p), x, "choose_qparams",
             "dynamic quantization", "static quantization parameters")


class _FloatTail(nn.Module):
    """PT2E's X86 quantizer quantizes a Linear's input and weight but leaves its output float when
    nothing quantizable follows (the classifier at a model's end): ``dequantize(x)``,
    ``dequantize_per_channel(w)`` -> linear -> the model output, written here with torch's
    decomposed ops themselves."""

    def __init__(self):
        super().__init__()
        import torch.ao.quantization.fx._decomposed  # noqa: F401  registers quantized_decomposed

        g = torch.Generator().manual_seed(2)
        self.register_buffer("w", torch.randint(-127, 128, (10, 24), generator=g, dtype=torch.int8))
        self.register_buffer("ws", torch.rand(10, generator=g) * 0.01 + 0.001)
        self.register_buffer("wz", torch.zeros(10, dtype=torch.int64))
        self.b = nn.Parameter(torch.randn(10, generator=g))

    def forward(self, x):
        qd = torch.ops.quantized_decomposed
        xq = qd.quantize_per_tensor(x, 0.02, 128, 0, 255, torch.uint8)
        xd = qd.dequantize_per_tensor(xq, 0.02, 128, 0, 255, torch.uint8)
        wd = qd.dequantize_per_channel(self.w, self.ws, self.wz, 0, -127, 127, torch.int8)
        return nn.functional.linear(xd, wd, self.b)


@pytest.mark.slow  # another float span (test_float_spans_as_torch_runs_them runs by default)
def test_a_float_linear_on_a_dequantized_weight_at_the_end(tmp_path, capsys):
    """irgen refused it ("constant ... is dequantized for a float op that is not quantized"): the
    weight is dequantized as torch does, float32(w - zp) * scale, and the Linear is a float layer;
    its output matches torch's and verify passes."""
    x = torch.randn(1, 24, generator=torch.Generator().manual_seed(3))
    r = _irgen(_FloatTail().eval(), x, tmp_path)
    with torch.no_grad():
        want = _FloatTail().eval()(x).numpy()
    out = r["ir"]["outputs"][0]
    np.testing.assert_allclose(np.load(r["out"] / out["file"]), want, rtol=1e-6, atol=1e-6)
    assert r["ir"]["layers"][-1]["op"] == "dense"
    capsys.readouterr()
    assert irgen_main(["verify", str(r["out"]), "--no-progress", "--no-report"]) == 0, capsys.readouterr().out[-2000:]


def _ptq_qnnpack(model_cls, d: Path, qmap=None):
    """``model_cls()`` (built after seeding torch, so its weights do not depend on the tests that
    ran before) quantized by FX PTQ with the qnnpack mapping (our observers elsewhere; or
    ``qmap``), calibrated on four samples, then through irgen (:func:`_irgen`) on a [1, 3, 8, 8] input."""
    import warnings

    from torch.ao.quantization import get_default_qconfig_mapping
    from torch.ao.quantization.quantize_fx import _convert_to_reference_decomposed_fx, prepare_fx

    warnings.simplefilter("ignore")
    torch.manual_seed(0)
    model = model_cls()
    x = torch.randn(1, 3, 8, 8, generator=torch.Generator().manual_seed(1))
    p = prepare_fx(model.eval(), qmap or get_default_qconfig_mapping("qnnpack").set_global(_qconfigs(False)), (x,))
    with torch.no_grad():
        for s in _samples(4, (1, 3, 8, 8)):
            p(s)
    return _irgen(_convert_to_reference_decomposed_fx(p), x, d)


def _ptq_pt2e(model_cls, fmt: str, d: Path):
    """``model_cls()`` (built after seeding torch) quantized by torchao's PT2E flow with the zoo's
    quantizer for ``fmt`` (``zoo.PT2E_QUANTIZERS``), calibrated on four samples, then through
    irgen (:func:`_irgen`) on a [1, 3, 8, 8] input."""
    pytest.importorskip("torchao")
    import importlib
    import warnings

    from zoo import PT2E_QUANTIZERS

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

        where, cls, config = PT2E_QUANTIZERS[fmt]
        mod = importlib.import_module(where)
        torch.manual_seed(0)
        x = torch.randn(1, 3, 8, 8, generator=torch.Generator().manual_seed(1))
        p = prepare_pt2e(torch.export.export(model_cls().eval(), (x,)).module(),
                         getattr(mod, cls)().set_global(getattr(mod, config)()))
        with torch.no_grad():
            for s in _samples(4, (1, 3, 8, 8)):
                p(s)
        return _irgen(convert_pt2e(p), x, d)


def _equal_to_torch_and_verified(r: dict, layers: list[dict], capsys) -> None:
    """Each of ``layers`` (with a source tensor) equals torch's value to the bit; ``irgen verify`` passes."""
    for layer in layers:
        src = (layer["source"]["outputs"] or [None])[0]
        if src in r["ref"]:
            np.testing.assert_array_equal(np.load(r["out"] / layer["outputs"][0]["file"]), r["ref"][src], layer["name"])
    capsys.readouterr()
    assert irgen_main(["verify", str(r["out"]), "--no-progress", "--no-report"]) == 0, capsys.readouterr().out[-2000:]


class _Head(nn.Module):
    """torchvision MobileNetV2's classifier head: ReLU6, global average pool (2x2 here), flatten,
    eval-mode Dropout, Linear. The qnnpack mapping gives the dropout its own output observer, so
    its reference graph holds dequantize -> dropout -> quantize with other parameters, and TVM's
    importer drops the dropout."""

    def __init__(self):
        super().__init__()
        self.c = nn.Conv2d(3, 16, 3, stride=2, padding=1)
        self.drop, self.fc = nn.Dropout(0.2), nn.Linear(16, 4)

    def forward(self, x):
        y = nn.functional.adaptive_avg_pool2d(nn.functional.relu6(self.c(x)), 1).flatten(1)
        return self.fc(self.drop(y))


@pytest.mark.slow  # another float span or table; test_float_spans_as_torch_runs_them and test_hardswish_and_hardsigmoid_tables run by default
def test_requantizing_dropout_and_global_pool(tmp_path, capsys):
    """irgen refused the dequantize -> quantize span ("cannot realize relax.dequantize"): it is now a
    ``requantize`` table with torch's rounding. verify's float64 adaptive-pool mean then disagreed
    with TVM's float32 row-order sum by one LSB after the pool's quantize (MobileNetV2: 3 of 1280
    values); the numpy reference now sums as TVM does. Every layer equals torch's value."""
    r = _ptq_qnnpack(_Head, tmp_path)
    ops = [layer["op"] for layer in r["ir"]["layers"]]
    assert "requantize" in ops and "global_avg_pool2d" in ops, ops
    _equal_to_torch_and_verified(r, [la for la in r["ir"]["layers"] if la["outputs"][0]["dtype"] in ("uint8", "int8")],
                                 capsys)


class _SqueezeExcite(nn.Module):
    """EfficientNet's MBConv tail and RegNetY's squeeze-excitation: SiLU (quantized around it by
    the qnnpack mapping), a global pool, two 1x1 convs, sigmoid, and the channel scaling
    ``x * s``: a multiply of two quantized activations."""

    def __init__(self):
        super().__init__()
        self.c, self.r, self.e = nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 4, 1), nn.Conv2d(4, 8, 1)

    def forward(self, x):
        y = nn.functional.silu(self.c(x))
        s = torch.sigmoid(self.e(nn.functional.silu(self.r(nn.functional.adaptive_avg_pool2d(y, 1)))))
        return y * s


@pytest.mark.slow  # another float span or table; test_float_spans_as_torch_runs_them and test_hardswish_and_hardsigmoid_tables run by default
def test_silu_and_squeeze_excite_multiply(tmp_path, capsys):
    """irgen refused both in torch graphs ("cannot realize relax.nn.silu", "a quantized multiply
    ... in a torch graph is not supported"): torchvision EfficientNet-B0 and RegNetY-400MF PTQ.
    SiLU is now a table of torch's own kernel; the multiply ``quantize(deq(a) * deq(b))`` in
    float32, as torch's reference graph computes it. Those layers equal torch's values."""
    r = _ptq_qnnpack(_SqueezeExcite, tmp_path)
    layers = r["ir"]["layers"]
    mine = [la for la in layers if (la["quant"] or {}).get("kind") == "mul" or (la["quant"] or {}).get("op") == "nn.silu"]
    assert {la["op"] for la in mine} == {"multiply", "silu"}, [la["op"] for la in layers]
    _equal_to_torch_and_verified(r, mine, capsys)


class _HardSwishBlock(nn.Module):
    """MobileNetV3's activations: hardswish, and hardsigmoid gating a squeeze-excitation."""

    def __init__(self):
        super().__init__()
        self.c, self.r, self.e = nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 4, 1), nn.Conv2d(4, 8, 1)

    def forward(self, x):
        y = nn.functional.hardswish(self.c(x))
        return y * nn.functional.hardsigmoid(self.e(torch.relu(self.r(nn.functional.adaptive_avg_pool2d(y, 1)))))


def test_hardswish_and_hardsigmoid_tables(tmp_path, capsys):
    """TVM's importer writes torch's hardswish as ``x * (clip(x + 3, 0, 6) / 6)``, which irgen refused
    in torch graphs ("the float ops before ... in a torch graph are not supported"; torchvision
    MobileNetV3 PTQ). That chain (and hardsigmoid's) is now a table of torch's own kernel: the four
    float ops round otherwise than torch's hardswish for 16% of float32 inputs. Equal to torch."""
    r = _ptq_qnnpack(_HardSwishBlock, tmp_path)
    layers = r["ir"]["layers"]
    mine = [la for la in layers if (la["quant"] or {}).get("op") in ("hardswish", "hardsigmoid")]
    assert sorted(la["op"] for la in mine) == ["hardsigmoid", "hardswish"], [la["op"] for la in layers]
    _equal_to_torch_and_verified(r, mine, capsys)


class _ShuffleUnit(nn.Module):
    """ShuffleNetV2's unit: ``chunk`` (each half quantized with its own parameters under FX PTQ),
    a branch, concat, channel shuffle, and the head's spatial ``mean``."""

    def __init__(self):
        super().__init__()
        self.c, self.b = nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(4, 4, 1)

    def forward(self, x):
        a, b = self.c(x).chunk(2, dim=1)  # a quantized tensor split (ShuffleNetV2 splits the shuffled one)
        y = torch.cat([a, torch.relu(self.b(b))], 1)
        return y.view(1, 2, 4, 8, 8).transpose(1, 2).reshape(1, 8, 8, 8).mean([2, 3])


@pytest.mark.slow  # another float span or table; test_float_spans_as_torch_runs_them and test_hardswish_and_hardsigmoid_tables run by default
def test_chunk_items_with_their_own_parameters(tmp_path, capsys):
    """irgen refused a torch ``chunk`` ("cannot realize tgi"; then "the split changes quantization
    parameters"): each item is now a table then the slice. verify's float64 ``mean`` then disagreed
    with TVM's row-order float32 sum after the quantize; the reference sums as TVM does. torchvision
    ShuffleNetV2 PTQ: 167 layers, all equal to torch."""
    r = _ptq_qnnpack(_ShuffleUnit, tmp_path)
    layers = r["ir"]["layers"]
    items = [la for la in layers if (la["quant"] or {}).get("op") == "strided_slice"]
    assert items and all(la["quant"]["kind"] in ("lut", "integer") for la in items), [la["op"] for la in layers]
    _equal_to_torch_and_verified(r, [la for la in layers if la["outputs"][0]["dtype"] in ("uint8", "int8")], capsys)


def _window_linear(x, w, b):
    """torchvision Swin's ``shifted_window_attention``: a function FX treats as a leaf
    (``torch.fx.wrap``), so its pad and linear on the module's float weight stay in float."""
    return nn.functional.linear(nn.functional.pad(x, (0, 0, 0, 0, 0, 1)), w, b)


torch.fx.wrap("_window_linear")


def _patch_merging(x):
    """torchvision Swin's ``_patch_merging_pad`` (an FX leaf too): a pad, four strided slices,
    concatenated; all in float between a dequantize and a quantize."""
    x = nn.functional.pad(x, (0, 0, 0, x.shape[2] % 2, 0, x.shape[1] % 2))
    return torch.cat([x[..., 0::2, 0::2, :], x[..., 1::2, 0::2, :], x[..., 0::2, 1::2, :], x[..., 1::2, 1::2, :]], -1)


torch.fx.wrap("_patch_merging")


class _FloatSpans(nn.Module):
    """DenseNet's pre-activation after a concatenation (BatchNorm and ReLU between a dequantize and
    a quantize: FX fuses BatchNorm only into a conv before it) and ConvNeXt's channels-last
    LayerNorm and layer scale: ops the qnnpack mapping leaves in float between quantized tensors."""

    def __init__(self):
        super().__init__()
        self.c1, self.c2 = nn.Conv2d(3, 4, 3, padding=1), nn.Conv2d(3, 4, 1)
        self.bn, self.c3 = nn.BatchNorm2d(8), nn.Conv2d(8, 8, 1)
        self.ln, self.fc = nn.LayerNorm(8, eps=1e-6), nn.Linear(8, 8)
        self.gamma = nn.Parameter(torch.linspace(0.5, 1.5, 8))
        self.w, self.b = nn.Parameter(torch.randn(8, 8) * 0.3), nn.Parameter(torch.randn(8) * 0.1)
        self.merge = nn.Linear(32, 8)
        with torch.no_grad():
            self.bn.running_mean.uniform_(-0.5, 0.5), self.bn.running_var.uniform_(0.5, 2.0)
            self.bn.weight.uniform_(0.5, 1.5), self.bn.bias.uniform_(-0.2, 0.2)

    def forward(self, x):
        y = self.c3(torch.relu(self.bn(torch.cat([self.c1(x), self.c2(x)], 1))))
        z = self.fc(self.ln(y.permute(0, 2, 3, 1)))
        y = y + (self.gamma * z).permute(0, 3, 1, 2)
        y = self.merge(_patch_merging(self.fc(_window_linear(y.permute(0, 2, 3, 1), self.w, self.b))))
        # the same outside a leaf: FX quantizes each window, all four read one float pad
        y = nn.functional.pad(y, (0, 0, 0, y.shape[2] % 2, 0, y.shape[1] % 2))
        return torch.cat([y[..., 0::2, 0::2, :], y[..., 1::2, 0::2, :], y[..., 0::2, 1::2, :], y[..., 1::2, 1::2, :]], -1)


def test_float_spans_as_torch_runs_them(tmp_path, capsys):
    """irgen refused these in torch graphs ("the input of ... is not a dequantized integer tensor",
    "cannot realize relax.nn.layer_norm"; torchvision DenseNet-121 and ConvNeXt-Tiny PTQ; Swin-T and
    ViT-B/16: a float linear whose importer writes ``out_dtype="float32"``; Swin's patch merging, a
    concatenation the record's program wrote as a nested list verify's recompute misread). torch
    runs every op between a dequantize and a quantize in float; they are now float layers (the
    float ops in float64, rounded once to float32, then torch's quantize_per_tensor), each equal
    to torch's values here, recomputed from its record, and verified."""
    r = _ptq_qnnpack(_FloatSpans, tmp_path)
    layers = r["ir"]["layers"]
    spans = [la for la in layers if (la["quant"] or {}).get("kind") == "float"]
    ops = " ".join(la["quant"]["op"] for la in spans)
    assert "batch_norm" in ops and "layer_norm" in ops and "pad+" in ops and "matmul" in ops and "concat" in ops, ops
    assert all(la["quant"]["reference"] == "torch" for la in spans)
    # weights, norm parameters: layer parameters that fused_ops and the record's program both name
    # (Swin-T's attention spans wrote their weights inline in both: a 543 MiB ir.json)
    for layer in spans:
        args = [a for o in layer["quant"]["program"] + layer["fused_ops"] for a in o["args"]]
        assert not [a for a in args if isinstance(a, dict) and isinstance(a.get("value"), list)], layer["name"]
        assert {a for a in args if isinstance(a, str) and a.startswith("param:")} == \
            {f"param:{role}" for role in layer["params"]}, layer["name"]
    for layer in spans:
        assert_layer_recomputes(r["out"], layer)
    _equal_to_torch_and_verified(r, spans, capsys)


class _PositionBias(nn.Module):
    """A relative position bias (a parameter gathered by a constant index: torch computes it at
    import) quantized, then added to a quantized activation."""

    def __init__(self, channels: int = 4):
        super().__init__()
        self.c, self.o = nn.Conv2d(3, channels, 1), nn.Conv2d(4, 4, 1)
        self.table = nn.Parameter(torch.randn(15, 4) * 0.5)
        self.register_buffer("index", torch.randint(0, 15, (64,), generator=torch.Generator().manual_seed(3)))

    def forward(self, x):
        return self.o(self.c(x) + self.table[self.index].view(8, 8, 4).permute(2, 0, 1).unsqueeze(0))


class _WindowAttention(_PositionBias):
    """torchvision MaxViT's attention in small: ``chunk`` into q, k, v each reshaped (no quantize
    between the chunk and the reshape), a softmax, a scaled-and-shifted value (an elementwise chain
    that is no hardswish), and ``Tensor.t``."""

    def __init__(self):
        super().__init__(channels=12)

    def forward(self, x):
        q, k, v = self.c(x).chunk(3, dim=1)
        q, k, v = q.reshape(1, 4, 2, 32), k.reshape(1, 4, 2, 32), v.reshape(1, 4, 2, 32)
        a = torch.softmax(q * k + self.table[self.index].t().reshape(1, 4, 2, 32), dim=-1)
        return self.o((a * (v * 0.5 + 1.0)).reshape(1, 4, 8, 8))


@pytest.mark.slow  # another float span or table; test_float_spans_as_torch_runs_them and test_hardswish_and_hardsigmoid_tables run by default
def test_attention_spans_as_torch_runs_them(tmp_path, capsys):
    """irgen refused MaxViT-T PTQ: ``aten.swapaxes`` (and here ``aten.t``) had no converter, a
    quantized softmax and an elementwise chain other than hardswish were refused in torch graphs,
    and a chunk read by three float spans left its tuple outside their layers ("layers whose
    inputs are never bound"). The softmax and the chain are float spans, the chunk's items strided
    slices inside them; every integer layer equals torch's values and verify passes."""
    r = _ptq_qnnpack(_WindowAttention, tmp_path)
    layers = r["ir"]["layers"]
    ops = " ".join((la["quant"] or {}).get("op") or "" for la in layers if (la["quant"] or {}).get("kind") == "float")
    assert "nn.softmax" in ops and "split" in ops, [((la["quant"] or {}).get("kind"), la["op"]) for la in layers]
    _equal_to_torch_and_verified(r, [la for la in layers if (la["quant"] or {}).get("kind") in ("conv2d", "mul")], capsys)


def test_add_of_a_quantized_constant(tmp_path, capsys):
    """The add's second operand is a quantized constant TVM folds into a literal: verify's
    recompute found one input for two ("list index out of range"; MaxViT-T's attention). The
    record keeps the constant's integers (``constants``), as ONNX Runtime's QLinearAdd records do."""
    r = _ptq_qnnpack(_PositionBias, tmp_path)
    (add,) = [la for la in r["ir"]["layers"] if (la["quant"] or {}).get("kind") == "add"]
    assert len(add["inputs"]) == 1 and list(add["quant"]["constants"]) == ["1"]
    _equal_to_torch_and_verified(r, [add], capsys)


class _ClassToken(nn.Module):
    """ViT's class token: a parameter quantized, concatenated before the patch embeddings."""

    def __init__(self):
        super().__init__()
        self.c, self.fc = nn.Conv2d(3, 8, 4, stride=4), nn.Linear(8, 8)
        self.token = nn.Parameter(torch.randn(1, 1, 8))

    def forward(self, x):
        token = self.token.expand(x.shape[0], -1, -1)  # as torchvision writes it (a quantized token)
        return self.fc(torch.cat([token, self.c(x).flatten(2).transpose(1, 2)], dim=1))


@pytest.mark.slow  # test_add_of_a_quantized_constant runs by default
def test_concat_of_a_quantized_constant(tmp_path, capsys):
    """torchvision ViT-B/16 PTQ: the class token, quantized at import and folded by TVM, left the
    concatenation one input for two in verify's recompute; its integers are in the record now."""
    r = _ptq_qnnpack(_ClassToken, tmp_path)
    (cat,) = [la for la in r["ir"]["layers"] if (la["quant"] or {}).get("kind") == "concatenate"]
    assert len(cat["inputs"]) == 1 and list(cat["quant"]["constants"]) == ["0"], cat["quant"]
    _equal_to_torch_and_verified(r, [cat], capsys)


class _PoolsAndBiases(nn.Module):
    """AlexNet's and VGG's adaptive pool to more than one value, Swin V2's position bias (an MLP
    of constant coordinates: quantized integers torch computes at import) read by a float op with
    an activation, and a nearest upsampling to a size that is no multiple of the input's."""

    def __init__(self):
        super().__init__()
        self.c, self.o = nn.Conv2d(3, 4, 1), nn.Conv2d(4, 4, 1)
        self.mlp = nn.Linear(2, 4)
        self.register_buffer("coords", torch.randn(64, 2, generator=torch.Generator().manual_seed(4)))

    def forward(self, x):
        bias = 16 * torch.sigmoid(self.mlp(self.coords).t().reshape(1, 4, 8, 8))
        y = nn.functional.adaptive_avg_pool2d(self.c(x), (3, 3))
        return self.o(torch.softmax(torch.maximum(self.c(x), bias), dim=-1)) + nn.functional.interpolate(y, size=(8, 8))


@pytest.mark.slow  # another float span (test_float_spans_as_torch_runs_them runs by default)
def test_pools_and_biases_as_torch_runs_them(tmp_path, capsys):
    """torchvision AlexNet/VGG PTQ: the 6x6 adaptive pool was taken for a global one (verify:
    "shape [1, 256, 1, 1] != golden [1, 256, 6, 6]"); Swin V2-T PTQ: a float span read a quantized
    constant TVM folds, as a layer input that no longer exists ("unresolvable argument
    'input:1'"), and an importer error stopped it first. They are float spans now, the constant
    one of their parameters; torch's nearest rows are gathered (TVM's resize picks others here)."""
    r = _ptq_qnnpack(_PoolsAndBiases, tmp_path)
    spans = {la["name"]: la for la in r["ir"]["layers"] if (la["quant"] or {}).get("kind") == "float"}
    ops = {la["quant"]["op"] for la in spans.values()}
    assert {"nn.adaptive_avg_pool2d", "maximum+nn.softmax", "take+take"} <= ops, ops
    (mx,) = [la for la in spans.values() if la["quant"]["op"] == "maximum+nn.softmax"]
    assert len(mx["inputs"]) == len(mx["quant"]["inputs"]) == 1 and list(mx["params"]) == ["operand"]
    _equal_to_torch_and_verified(r, [la for la in r["ir"]["layers"] if (la["quant"] or {}).get("kind") == "conv2d"],
                                 capsys)


class _TimmParts(nn.Module):
    """timm's attention: ``qkv.unbind(0)`` (a tuple bound whole) and ``q @ k^T``, a product of two
    quantized activations; ResNet-D's shortcut ``AvgPool2d(2, 2, ceil_mode=True,
    count_include_pad=False)`` on an odd size."""

    def __init__(self):
        super().__init__()
        self.c, self.o = nn.Conv2d(3, 12, 1), nn.Conv2d(4, 4, 1)
        self.pool = nn.AvgPool2d(2, 2, ceil_mode=True, count_include_pad=False)

    def forward(self, x):
        q, k, v = self.c(x).reshape(1, 3, 4, 64).permute(1, 0, 2, 3).unbind(0)
        a = ((q @ k.transpose(-2, -1)) * 0.5).softmax(-1)  # LeViT scales the product
        return self.o(self.pool((a @ v).reshape(1, 4, 8, 8)[..., :7, :7]))


@pytest.mark.slow  # another float span (test_float_spans_as_torch_runs_them runs by default)
def test_timm_parts_as_torch_runs_them(tmp_path, capsys):
    """timm DeiT-Tiny, LeViT-128S and ResNet18-D under FX PTQ: "cannot realize tuple" (the
    unbind), then verify recomputed the last of the three items instead of the span's one;
    LeViT's ``q @ k^T`` was realized as ONNX Runtime's QLinearMatMul (up to 4 LSB off torch);
    the ceil-mode pool was refused. All are float spans now, as torch computes them."""
    from torch.ao.quantization import get_default_qconfig_mapping

    r = _ptq_qnnpack(_TimmParts, tmp_path, get_default_qconfig_mapping())  # x86: it quantizes the matmuls
    ops = [(la["quant"] or {}).get("op") for la in r["ir"]["layers"] if (la["quant"] or {}).get("kind") == "float"]
    assert any(o and "split" in o for o in ops) and any(o and "matmul" in o for o in ops) and "nn.avg_pool2d" in ops, ops
    # the first conv bit for bit; after the float spans, verify's per-layer verdict
    _equal_to_torch_and_verified(r, [la for la in r["ir"]["layers"] if la["name"] == "conv2d"], capsys)


class _PoolBranch(nn.Module):
    """Inception V3's reduction block: a max-pool branch concatenated with a conv branch. FX PTQ
    gives the concat one observer for its inputs and output, so the pool's input (the block's
    input) and output (the concat's) have other parameters: dequantize -> max_pool2d -> quantize."""

    def __init__(self):
        super().__init__()
        self.c, self.b = nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 4, 3, stride=2)

    def forward(self, x):
        y = torch.relu(self.c(x))
        return torch.cat([self.b(y) * 3.0, nn.functional.max_pool2d(y, 3, stride=2)], 1)


@pytest.mark.slow  # another float span or table; test_float_spans_as_torch_runs_them and test_hardswish_and_hardsigmoid_tables run by default
def test_a_max_pool_that_changes_quantization_parameters(tmp_path, capsys):
    """irgen refused it in torch graphs ("nn.max_pool2d ... changes quantization parameters";
    torchvision Inception V3 PTQ with the default x86 mapping). torch's float max of dequantized
    values is the dequantized integer max (dequantize never decreases), so the layer is a table
    of torch's quantize(dequantize(i)) then the integer max pool, as for ONNX Runtime's graphs."""
    from torch.ao.quantization import get_default_qconfig_mapping

    r = _ptq_qnnpack(_PoolBranch, tmp_path, get_default_qconfig_mapping())
    pools = [la for la in r["ir"]["layers"] if (la["quant"] or {}).get("op") == "nn.max_pool2d"]
    assert [la["quant"]["kind"] for la in pools] == ["lut"], [la["op"] for la in r["ir"]["layers"]]
    q = pools[0]["quant"]
    assert (q["inputs"][0]["scale"], q["inputs"][0]["zero_point"]) != (q["output"]["scale"], q["output"]["zero_point"])
    _equal_to_torch_and_verified(r, [la for la in r["ir"]["layers"] if la["outputs"][0]["dtype"] in ("uint8", "int8")],
                                 capsys)


class _Fire(nn.Module):
    """SqueezeNet's Fire module: a squeeze conv, then two expand convs (1x1 and 3x3) of the same
    tensor, each with its ReLU, concatenated; the next Fire's squeeze conv reads the concat."""

    def __init__(self):
        super().__init__()
        self.c, self.s = nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 4, 1)
        self.e1, self.e3 = nn.Conv2d(4, 8, 1), nn.Conv2d(4, 8, 3, padding=1)
        self.n = nn.Conv2d(16, 4, 1)

    def forward(self, x):
        y = torch.relu(self.s(torch.relu(self.c(x))))
        return self.n(torch.cat([torch.relu(self.e1(y)), torch.relu(self.e3(y))], 1))


@pytest.mark.slow  # another float span (test_float_spans_as_torch_runs_them runs by default)
def test_a_float_span_that_reads_one_tensor_through_two_dequantizes(tmp_path, capsys):
    """torchao's PT2E Arm quantizer leaves the Fire module's expand convs unquantized between the
    squeeze's quantize and the concat's, and gives each conv its own dequantize of the squeezed
    tensor: a float span of two convs and the concat. Its program named that one layer input
    twice (``input:0``, ``input:1``), so ``irgen verify`` could not recompute it (torchvision
    SqueezeNet 1.1). One tensor is one input now; every quantized layer equals torch's value."""
    r = _ptq_pt2e(_Fire, "pt2e-arm", tmp_path)
    spans = [la for la in r["ir"]["layers"] if (la["quant"] or {}).get("realization") == "float"]
    assert [(len(la["inputs"]), len(la["quant"]["inputs"])) for la in spans] == [(1, 1)], \
        [la["op"] for la in r["ir"]["layers"]]
    assert spans[0]["op"].count("conv2d") == 2
    _equal_to_torch_and_verified(r, [la for la in r["ir"]["layers"] if la["outputs"][0]["dtype"] in ("uint8", "int8")],
                                 capsys)


class _PoolFormerBlock(nn.Module):
    """PoolFormer's token mixer: GroupNorm(1, C), ``pool(x) - x``, a layer scale, the residual."""

    def __init__(self):
        super().__init__()
        self.c, self.norm = nn.Conv2d(3, 8, 3, padding=1), nn.GroupNorm(1, 8)
        self.pool, self.fc = nn.AvgPool2d(3, 1, 1, count_include_pad=False), nn.Conv2d(8, 4, 1)
        self.scale = nn.Parameter(torch.full((8, 1, 1), 0.5))

    def forward(self, x):
        y = self.c(x)
        n = self.norm(y)
        return self.fc(y + self.scale * (self.pool(n) - n))


@pytest.mark.parametrize("quantizer", ["pt2e", pytest.param("pt2e-arm", marks=pytest.mark.slow)])
def test_group_norm_in_a_float_span(tmp_path, capsys, quantizer):
    """torchao's PT2E quantizers leave PoolFormer's GroupNorm float between quantized tensors, so
    it is part of a float span, which irgen computes in float64; TVM's group_norm has no float64
    kernel, and irgen stopped with TVM's internal error (timm PoolFormer-S12). It is now float64
    elementary ops, as TVM's group_norm computes; the span is within the float-layer contract of
    torch's float32, and every other quantized layer equals torch's value."""
    r = _ptq_pt2e(_PoolFormerBlock, quantizer, tmp_path)
    layers = r["ir"]["layers"]
    spans = [la for la in layers if "group_norm" in la["op"]]
    assert spans and all(la["quant"]["realization"] == "float" for la in spans), [la["op"] for la in layers]
    capsys.readouterr()
    assert irgen_main(["verify", str(r["out"]), "--no-progress", "--no-report"]) == 0, capsys.readouterr().out[-2000:]
    for layer in layers:
        src = (layer["source"]["outputs"] or [None])[0]
        if src in r["ref"] and layer["outputs"][0]["dtype"] in ("uint8", "int8"):
            got, want = np.load(r["out"] / layer["outputs"][0]["file"]), r["ref"][src]
            lsb = np.abs(got.astype(np.int32) - want.astype(np.int32)).max()
            assert lsb <= (1 if layer in spans else 0), (layer["name"], lsb)
