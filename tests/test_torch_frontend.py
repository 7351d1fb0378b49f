"""End to end on torch.export programs: every layer's golden data against torch itself.

Models are built in the test (``tests/models.py``), exported with
``torch.export`` and saved as ``.pt2``. For each model and opt level, irgen
runs with a fixed input; every layer's output activation must match torch's
value of the FX node named in ``layer["source"]["outputs"]`` (an FX
Interpreter records every node's output), and the model output must match.
Then ``.pth`` state dicts with ``--model-class`` and the error cases.
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("irgen_torch")

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
import models  # noqa: E402
import torch_classes  # noqa: E402
from layercheck import assert_close, assert_layers_match  # noqa: E402

from irgen.cli import main as irgen_main  # noqa: E402


CASES = [
    pytest.param(("small_cnn", 0), id="small_cnn-O0"),
    pytest.param(("small_cnn", 3), id="small_cnn-O3"),
    pytest.param(("mlp", 0), id="mlp-O0"),
    pytest.param(("mlp", 3), id="mlp-O3"),
    pytest.param(("resnet18", 0), id="resnet18-O0", marks=pytest.mark.slow),
    pytest.param(("resnet18", 3), id="resnet18-O3", marks=pytest.mark.slow),
]


def build(name: str, seed: int = 0):
    cls, shape = models.BUILDERS[name]
    torch.manual_seed(seed)
    model = cls()
    models._randomize_bn(model)
    model.eval()
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(seed + 1))
    return model, x


def record_nodes(ep, x: torch.Tensor) -> dict[str, np.ndarray]:
    """Every FX node's output when the exported program runs on ``x`` (the
    plugin's FX interpreter, which ``irgen verify`` uses too)."""
    from irgen_torch import record_nodes as record

    return record(ep, [x])


@pytest.fixture(scope="module", params=CASES)
def run(request, tmp_path_factory):
    name, opt = request.param
    d = tmp_path_factory.mktemp(f"{name}_O{opt}")
    model, x = build(name)
    ep = torch.export.export(model, (x,))
    path = d / f"{name}.pt2"
    torch.export.save(ep, str(path))
    np.save(d / "x.npy", x.numpy())
    out = d / "out"
    rc = irgen_main(["run", str(path), "-o", str(out), "--input", str(d / "x.npy"), "--opt-level", str(opt), "--no-progress"])
    assert rc == 0, f"irgen run failed for {name} -O{opt}"
    ir = json.loads((out / "ir.json").read_text())
    loaded = torch.export.load(str(path))
    ref = record_nodes(loaded, x)
    with torch.no_grad():
        y = model(x).numpy()
    return {"name": name, "opt": opt, "out": out, "ir": ir, "ref": ref, "x": x.numpy(), "y": y, "ep": loaded}


def test_layers_match_torch(run):
    out, ir, ref = run["out"], run["ir"], run["ref"]
    assert ir["producer"]["frontend"] == "torch"
    assert ir["producer"]["opt_level"] == run["opt"]
    fx_names = {n.name for n in run["ep"].graph.nodes}

    def check(layer, src):
        assert all(op.startswith("aten.") for op in layer["source"]["op_types"]), layer["source"]
        assert src in fx_names, src

    worst = assert_layers_match(out, ir, ref, f"{run['name']} -O{run['opt']}", check)
    print(f"\n{run['name']} -O{run['opt']}: {len(ir['layers'])} layers, max |irgen - torch| = {worst:.3g}")


def test_model_output_matches_torch(run):
    out, ir = run["out"], run["ir"]
    assert [i["name"] for i in ir["inputs"]] == ["x"]
    np.testing.assert_array_equal(np.load(out / ir["inputs"][0]["file"]), run["x"])
    assert len(ir["outputs"]) == 1
    err = assert_close(np.load(out / ir["outputs"][0]["file"]), run["y"], "model output")
    print(f"\n{run['name']} -O{run['opt']}: max |output - torch| = {err:.3g}")


# ---------------------------------------------------------------- .pth state dicts


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


def _irgen(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "irgen", *args], cwd=cwd, env=_env(), capture_output=True, text=True, timeout=600)


def _net(width: int = 4):
    torch.manual_seed(3)
    return torch_classes.Net(width=width).eval()


def test_pth_state_dict_with_model_class(tmp_path):
    net = _net(width=6)
    torch.save(net.state_dict(), tmp_path / "net.pth")
    x = torch.randn(1, 3, 8, 8, generator=torch.Generator().manual_seed(5))
    np.save(tmp_path / "x.npy", x.numpy())
    r = _irgen(["run", "net.pth", "-o", "out", "--model-class", "torch_classes:Net", "--model-args", '{"width": 6}',
                "--input-shape", "x=1,3,8,8", "--input", "x.npy", "--no-progress"], tmp_path)
    assert r.returncode == 0, r.stderr
    out = tmp_path / "out"
    ir = json.loads((out / "ir.json").read_text())
    ep = torch.export.export(net, (torch.zeros(1, 3, 8, 8),))
    ref = record_nodes(ep, x)
    for layer in ir["layers"]:
        for rec, src in zip(layer["outputs"], layer["source"]["outputs"]):
            assert_close(np.load(out / rec["file"]), ref[src], f"layer {layer['name']} ({src})")
    with torch.no_grad():
        assert_close(np.load(out / ir["outputs"][0]["file"]), net(x).numpy(), "model output")
    assert {layer["op"] for layer in ir["layers"]} >= {"conv2d", "max_pool2d", "dense"}


@pytest.mark.slow  # another torch import path; the default suite keeps one per kind
def test_pth_input_takes_the_name_given(tmp_path):
    """--input-shape NAME=DIMS names the model input NAME, whatever forward() calls its argument."""
    net = _net()
    torch.save(net.state_dict(), tmp_path / "net.pth")
    x = torch.randn(1, 3, 8, 8, generator=torch.Generator().manual_seed(6))
    np.save(tmp_path / "x.npy", x.numpy())
    args = ["run", "net.pth", "--model-class", "torch_classes:Net", "--no-progress"]
    r = _irgen([*args, "-o", "out", "--input-shape", "img=1,3,8,8", "--input", "img=x.npy"], tmp_path)
    assert r.returncode == 0, r.stderr
    out = tmp_path / "out"
    ir = json.loads((out / "ir.json").read_text())
    assert [i["name"] for i in ir["inputs"]] == ["img"]
    first = ir["layers"][0]
    assert [i["name"] for i in first["inputs"]] == ["img"], first["inputs"]
    np.testing.assert_array_equal(np.load(out / first["inputs"][0]["file"]), x.numpy())
    with torch.no_grad():
        assert_close(np.load(out / ir["outputs"][0]["file"]), net(x).numpy(), "model output")
    # a name an FX node of the exported graph already has is refused
    r = _irgen([*args, "-o", "out2", "--input-shape", "conv2d=1,3,8,8"], tmp_path)
    _assert_error(r, tmp_path / "out2", "'conv2d'", "--input-shape")


# ---------------------------------------------------------------- errors


def _assert_error(r: subprocess.CompletedProcess, out: Path, *needles: str) -> str:
    assert r.returncode == 2, (r.returncode, r.stderr)
    # a value argparse refuses (--model-args that is not JSON) is a usage error: "irgen run: error: ..."
    lines = [line for line in r.stderr.splitlines() if line.startswith(("irgen: error:", "irgen run: error:"))]
    assert len(lines) == 1, r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    for n in needles:
        assert n in lines[0], lines[0]
    assert not out.exists()
    assert not list(out.parent.glob(f".{out.name}.irgen-partial-*"))
    return lines[0]


def test_pickled_module_refused(tmp_path):
    torch.save(_net(), tmp_path / "whole.pth")
    r = _irgen(["run", "whole.pth", "-o", "out", "--input-shape", "x=1,3,8,8", "--no-progress"], tmp_path)
    _assert_error(r, tmp_path / "out", "whole.pth", "--allow-pickle")


class _Payload:
    def __init__(self, target: str) -> None:
        self.target = target

    def __reduce__(self):
        return (os.system, (f"touch {self.target}",))


def test_malicious_pickle_does_not_run(tmp_path):
    marker = tmp_path / "PWNED"
    with open(tmp_path / "evil.pth", "wb") as f:
        torch.save({"w": _Payload(str(marker))}, f)
    assert not marker.exists()
    r = _irgen(["run", "evil.pth", "-o", "out", "--model-class", "torch_classes:Net",
                "--input-shape", "x=1,3,8,8", "--no-progress"], tmp_path)
    _assert_error(r, tmp_path / "out", "--allow-pickle")
    assert not marker.exists(), "unpickling ran the payload"
    # a raw pickle file (not a torch zip archive) too
    with open(tmp_path / "raw.pth", "wb") as f:
        pickle.dump(_Payload(str(marker)), f)
    r = _irgen(["run", "raw.pth", "-o", "out", "--model-class", "torch_classes:Net",
                "--input-shape", "x=1,3,8,8", "--no-progress"], tmp_path)
    _assert_error(r, tmp_path / "out")
    assert not marker.exists(), "unpickling ran the payload"


@pytest.mark.slow  # another torch import path; the default suite keeps one per kind
def test_pickled_module_allowed_with_flag(tmp_path):
    torch.save(_net(), tmp_path / "whole.pth")
    r = _irgen(["run", "whole.pth", "-o", "out", "--allow-pickle", "--input-shape", "x=1,3,8,8", "--no-progress"], tmp_path)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "out" / "ir.json").is_file()


def test_dynamically_quantized_lstm_refused_with_the_reason(tmp_path):
    """torch's quantize_dynamic of an LSTM: torch.export cannot export it (its packed weights), and its
    activations are quantized as it runs; the error says both, not torch's CellParamsBase message."""
    import warnings

    warnings.simplefilter("ignore")
    q = torch.ao.quantization.quantize_dynamic(torch_classes.Recurrent().eval(), {torch.nn.LSTM}, dtype=torch.qint8)
    torch.save(q, tmp_path / "qlstm.pth")
    r = _irgen(["run", "qlstm.pth", "-o", "out", "--allow-pickle", "--input-shape", "x=5,1,4", "--no-progress"], tmp_path)
    _assert_error(r, tmp_path / "out", "'lstm'", "dynamically quantized", "quantize_dynamic", "DynamicQuantizeLSTM")


@pytest.mark.parametrize(
    "extra,needles",
    [
        ([], ["--model-class"]),
        (["--model-class", "torch_classes"], ["package.module:Class"]),
        # each case is an irgen process importing torch: the default suite keeps the option missing,
        # malformed, and with bad --model-args; the ones that import the class are slow
        pytest.param(["--model-class", "no_such_module_xyz:Net"], ["no_such_module_xyz", "importable"],
                     marks=pytest.mark.slow),
        pytest.param(["--model-class", "torch_classes:Nope"], ["Nope"], marks=pytest.mark.slow),
        pytest.param(["--model-class", "torch_classes:NotAModule"], ["nn.Module"], marks=pytest.mark.slow),
        (["--model-class", "torch_classes:Net", "--model-args", "{bad"], ["--model-args"]),
        pytest.param(["--model-class", "torch_classes:Net", "--model-args", '{"depth": 3}'], ["depth"],
                     marks=pytest.mark.slow),
    ],
    ids=["missing", "no-colon", "no-module", "no-class", "not-a-module", "bad-json", "bad-kwarg"],
)
def test_model_class_errors(tmp_path, extra, needles):
    torch.save(_net().state_dict(), tmp_path / "net.pth")
    r = _irgen(["run", "net.pth", "-o", "out", "--input-shape", "x=1,3,8,8", "--no-progress", *extra], tmp_path)
    _assert_error(r, tmp_path / "out", *needles)


@pytest.mark.slow  # another torch import path; the default suite keeps one per kind
def test_state_dict_mismatch(tmp_path):
    sd = _net().state_dict()
    sd["extra.weight"] = torch.zeros(2)
    del sd["fc.bias"]
    torch.save(sd, tmp_path / "net.pth")
    r = _irgen(["run", "net.pth", "-o", "out", "--model-class", "torch_classes:Net",
                "--input-shape", "x=1,3,8,8", "--no-progress"], tmp_path)
    line = _assert_error(r, tmp_path / "out", "missing", "fc.bias", "unexpected", "extra.weight")
    # a shape mismatch (width 6 weights into a width 4 net)
    torch.save(_net(width=6).state_dict(), tmp_path / "wide.pth")
    r = _irgen(["run", "wide.pth", "-o", "out", "--model-class", "torch_classes:Net",
                "--input-shape", "x=1,3,8,8", "--no-progress"], tmp_path)
    _assert_error(r, tmp_path / "out", "size mismatch")
    assert line


def test_unsupported_ops_listed_at_once(tmp_path):
    class Odd(torch.nn.Module):
        def forward(self, x):
            return torch.special.bessel_j0(x) + torch.special.erfcx(x)

    ep = torch.export.export(Odd(), (torch.randn(2, 3),))
    torch.export.save(ep, str(tmp_path / "odd.pt2"))
    r = _irgen(["run", "odd.pt2", "-o", "out", "--no-progress"], tmp_path)
    _assert_error(r, tmp_path / "out", "unsupported ops", "aten.special_bessel_j0.default", "aten.special_erfcx.default")


class _Autocast(torch.nn.Module):
    """timm's EfficientViT linear attention keeps its matmuls out of autocast (``torch.autocast(
    "cpu", enabled=False)``); ``enabled`` True would run them in bfloat16."""

    def __init__(self, enabled: bool):
        super().__init__()
        self.enabled = enabled
        self.c = torch.nn.Conv2d(3, 4, 1)

    def forward(self, x):
        q = torch.relu(self.c(x)).flatten(2)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.enabled):
            out = q.float() @ (q.transpose(-1, -2).float() @ q.float())
            out = out[..., :-1] / (out[..., -1:] + 1e-5)
        return out * 2


def _run_exported(ep, x: torch.Tensor, tmp_path: Path) -> tuple[Path, dict]:
    """``irgen run`` of the exported program ``ep`` on ``x``: the output folder and its IR."""
    torch.export.save(ep, str(tmp_path / "m.pt2"))
    np.save(tmp_path / "x.npy", x.numpy())
    out = tmp_path / "out"
    assert irgen_main(["run", str(tmp_path / "m.pt2"), "-o", str(out), "--input", str(tmp_path / "x.npy"),
                       "--no-progress"]) == 0
    return out, json.loads((out / "ir.json").read_text())


def test_autocast_region_disabled_is_inlined(tmp_path, capsys):
    """``torch.export`` keeps the region as one ``wrap_with_autocast`` node, which TVM's importer
    had no converter for (irgen refused timm efficientvit_b0's ``.pt2``); with autocast off it is
    its body, and the layers match torch's run of the program (its body's nodes included)."""
    x = torch.randn(1, 3, 5, 5, generator=torch.Generator().manual_seed(1))
    ep = torch.export.export(_Autocast(False).eval(), (x,))
    assert any("wrap_with_autocast" in str(n.target) for n in ep.graph.nodes)
    out, ir = _run_exported(ep, x, tmp_path)
    ref = record_nodes(torch.export.load(str(tmp_path / "m.pt2")), x)
    assert_layers_match(out, ir, ref, "autocast", lambda layer, src: None)
    with torch.no_grad():
        assert_close(np.load(out / ir["outputs"][0]["file"]), ep.module()(x).numpy(), "model output")
    assert irgen_main(["verify", str(out), "--no-progress", "--no-report"]) == 0


@pytest.mark.slow  # another torch import path; the default suite keeps one per kind
def test_autocast_region_enabled_is_refused(tmp_path):
    x = torch.randn(1, 3, 5, 5)
    ep = torch.export.export(_Autocast(True).eval(), (x,))
    torch.export.save(ep, str(tmp_path / "m.pt2"))
    r = _irgen(["run", "m.pt2", "-o", "out", "--no-progress"], tmp_path)
    _assert_error(r, tmp_path / "out", "torch.autocast('cpu', torch.bfloat16)", "export the model without autocast")


class _CacheAndPooler(torch.nn.Module):
    """What transformers' decoders and encoders leave in a ``.pt2``: a key/value cache that
    starts as an empty 1-D tensor concatenated with the new keys (torch skips it; TVM's
    concat refused the ranks), and a pooler computed and then dropped (its nodes stay in
    the exported graph; irgen formed layers that no kernel computed)."""

    def __init__(self):
        super().__init__()
        self.k = torch.nn.Linear(8, 8)
        self.pool = torch.nn.Linear(8, 8)

    def forward(self, x):
        keys = torch.cat([torch.zeros(0), self.k(x).unsqueeze(1)], dim=-2)  # [1, 1, 4, 8]
        scores = (keys @ keys.transpose(-1, -2)).softmax(-1) @ keys
        _pooled = torch.tanh(self.pool(scores[:, 0, 0]))  # computed, never returned
        return scores.squeeze(1) * 2


@pytest.mark.slow  # another torch import path; the default suite keeps one per kind
def test_empty_cache_concat_and_dropped_results(tmp_path):
    x = torch.randn(1, 4, 8, generator=torch.Generator().manual_seed(2))
    torch.manual_seed(0)
    model = _CacheAndPooler().eval()
    ep = torch.export.export(model, (x,))
    assert any(str(n.target) == "aten.tanh.default" for n in ep.graph.nodes)  # the dropped pooler is in the graph
    out, ir = _run_exported(ep, x, tmp_path)
    assert not any(layer["op"] == "tanh" for layer in ir["layers"])  # nothing of the dropped pooler
    with torch.no_grad():
        assert_close(np.load(out / ir["outputs"][0]["file"]), model(x).numpy(), "model output")
    assert irgen_main(["verify", str(out), "--no-progress", "--no-report"]) == 0


@pytest.mark.slow  # another torch import path; the default suite keeps one per kind
def test_weight_norm_conv(tmp_path):
    """``aten._weight_norm`` (wav2vec2's positional convolution, ``parametrizations.weight_norm``
    over the kernel axis and over the output channels): the weight is ``v * g / ||v||``."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.utils.parametrizations.weight_norm(torch.nn.Conv1d(4, 4, 5, padding=2, groups=2), dim=2),
        torch.nn.GELU(),
        torch.nn.utils.parametrizations.weight_norm(torch.nn.Conv1d(4, 6, 3), dim=0)).eval()
    x = torch.randn(1, 4, 12, generator=torch.Generator().manual_seed(3))
    ep = torch.export.export(model, (x,))
    assert sum(str(n.target) == "aten._weight_norm.default" for n in ep.graph.nodes) == 2
    out, ir = _run_exported(ep, x, tmp_path)
    with torch.no_grad():
        assert_close(np.load(out / ir["outputs"][0]["file"]), model(x).numpy(), "model output")
    assert irgen_main(["verify", str(out), "--no-progress", "--no-report"]) == 0


class _FromTheEnd(torch.nn.Module):
    """Falcon's split of its fused q/k/v: ``qkv[..., [-2], :]`` is a gather of constant negative
    indices, which TVM's kernel (mode fast) read before the tensor: garbage in the golden data."""

    def forward(self, qkv):
        return qkv[:, :, [-2], :] * 2 + qkv[:, :, [-1], :] + qkv[:, :, :-2, :].sum(2, keepdim=True)


@pytest.mark.slow  # another torch import path; the default suite keeps one per kind
def test_gather_of_negative_constant_indices(tmp_path):
    x = torch.randn(1, 3, 6, 4, generator=torch.Generator().manual_seed(4))
    model = _FromTheEnd().eval()
    out, ir = _run_exported(torch.export.export(model, (x,)), x, tmp_path)
    with torch.no_grad():
        assert_close(np.load(out / ir["outputs"][0]["file"]), model(x).numpy(), "model output")
    assert irgen_main(["verify", str(out), "--no-progress", "--no-report"]) == 0


class _FalconLinear(torch.nn.Module):
    """Falcon's linear layers (``x @ self.weight.T``: ``aten.numpy_T``) and its in-place
    scaling of the attention scores (``scores /= sqrt(d)``: ``aten.div_`` stays in the graph)."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(8, 8, generator=torch.Generator().manual_seed(5)))

    def forward(self, x):
        h = x @ self.weight.T
        scores = h @ h.transpose(-1, -2)
        scores /= 4.0
        return scores.softmax(-1) @ h


@pytest.mark.slow  # another torch import path; the default suite keeps one per kind
def test_falcon_transpose_and_inplace_divide(tmp_path):
    x = torch.randn(1, 5, 8, generator=torch.Generator().manual_seed(6))
    model = _FalconLinear().eval()
    ep = torch.export.export(model, (x,))
    targets = {str(n.target) for n in ep.graph.nodes}
    assert {"aten.numpy_T.default", "aten.div_.Tensor"} <= targets, targets
    out, ir = _run_exported(ep, x, tmp_path)
    with torch.no_grad():
        assert_close(np.load(out / ir["outputs"][0]["file"]), model(x).numpy(), "model output")
    assert irgen_main(["verify", str(out), "--no-progress", "--no-report"]) == 0


class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(3, 3, 3, padding=1)
        self.bn = torch.nn.BatchNorm2d(3)

    def forward(self, x):
        return torch.relu(self.bn(self.conv1(x)) + x)


class _Nested(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layer1 = torch.nn.Sequential(_Block(), _Block())
        self.fc = torch.nn.Linear(3, 2)

    def forward(self, x):
        return self.fc(self.layer1(x).mean((2, 3)))


def test_layers_are_named_after_their_module_path(tmp_path):
    """A ``.pt2`` layer is named after the module it runs in, as ONNX exporters name nodes (an FX
    node is named after its op: ``conv2d_1``); a convolution with its batch norm folded in is named
    after the convolution. The source nodes stay the FX names verify's source check asks torch for."""
    torch.manual_seed(0)
    x = torch.randn(1, 3, 8, 8)
    out, ir = _run_exported(torch.export.export(_Nested().eval(), (x,)), x, tmp_path)
    assert [layer["name"] for layer in ir["layers"]] == [
        "layer1.0.conv1.conv2d", "layer1.0.add", "layer1.1.conv1.conv2d", "layer1.1.add", "mean", "fc.linear"]
    assert [layer["source"]["nodes"] for layer in ir["layers"]][:2] == [["conv2d", "batch_norm"], ["add", "relu"]]
    assert (out / "parameters" / "layer1.0.conv1.conv2d.weight.npy").is_file()
