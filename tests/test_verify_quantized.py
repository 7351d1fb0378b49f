"""irgen verify on quantized models as users quantize them (issue 10).

* a quantized Concat whose inputs have other scales than its output (SqueezeNet's
  Fire module, GoogLeNet's Inception block; ORT ``quantize_static`` default
  options, and ``per_channel=True``): ``single``, ``entire`` and ``source`` pass;
* the source verdict is per layer (``local``), end-to-end drift is reported beside
  it with the first layer where it appears;
* the TFLite source check falls back to the builtin optimized kernels when the
  reference kernels abort, and says so; a PASS whose source check was skipped says
  so in its verdict line and report.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from irgen.cli import main as irgen_main
from irgen.verify import MODES


def _run(*args) -> None:
    assert irgen_main(["run", *map(str, args), "--no-progress"]) == 0


def _verify_json(capsys, out: Path, *args) -> tuple[int, dict, str]:
    capsys.readouterr()
    code = irgen_main(["verify", str(out), "--no-progress", "--no-report", "--json", *map(str, args)])
    cap = capsys.readouterr()
    return code, json.loads(cap.out), cap.err


# ------------------------------------------------------------------ quantized Concat (ORT QDQ)


def _branches_model(folder: Path, per_channel: bool) -> tuple[Path, Path]:
    """Conv stem, then two blocks whose branches (1x1, 3x3, 5x5 convs + ReLU) are
    concatenated: a Fire module (2 branches) and an Inception-like block (4 branches,
    the widest range in the middle so an input whose scale is the output's comes
    before others that are requantized). Exported to ONNX, quantize_static defaults."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("onnxruntime")
    from torch import nn

    from onnxruntime.quantization import CalibrationDataReader, quantize_static

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.stem = nn.Conv2d(3, 16, 3, stride=2, padding=1)
            self.squeeze = nn.Conv2d(16, 8, 1)
            self.e1, self.e3 = nn.Conv2d(8, 8, 1), nn.Conv2d(8, 8, 3, padding=1)
            self.b = nn.ModuleList([nn.Conv2d(16, 4, 1), nn.Conv2d(16, 4, 3, padding=1),
                                    nn.Conv2d(16, 4, 5, padding=2), nn.Conv2d(16, 4, 1)])
            self.head = nn.Conv2d(16, 10, 1)

        def forward(self, x):
            x = torch.relu(self.stem(x))
            s = torch.relu(self.squeeze(x))
            x = torch.cat([torch.relu(self.e1(s)), torch.relu(self.e3(s))], 1)
            x = torch.cat([torch.relu(c(x)) for c in self.b], 1)
            x = nn.functional.max_pool2d(x, 3, 2, ceil_mode=True)
            return torch.flatten(nn.functional.adaptive_avg_pool2d(self.head(x), 1), 1)

    torch.manual_seed(0)
    net = Net().eval()
    with torch.no_grad():
        for p in net.parameters():
            p.normal_(0, 0.3)
    x = torch.randn(1, 3, 24, 24, generator=torch.Generator().manual_seed(1))
    fp = folder / "branches.onnx"
    torch.onnx.export(net, x, str(fp), input_names=["x"], output_names=["y"], dynamo=False, opset_version=17)

    class Reader(CalibrationDataReader):
        def __init__(self):
            self.it = iter([{"x": np.random.default_rng(k).standard_normal((1, 3, 24, 24)).astype(np.float32)}
                            for k in range(8)])

        def get_next(self):
            return next(self.it, None)

    q = folder / f"branches_{'pc' if per_channel else 'pt'}.onnx"
    quantize_static(str(fp), str(q), Reader(), per_channel=per_channel)
    np.save(folder / "x.npy", x.numpy())
    return q, folder / "x.npy"


@pytest.mark.parametrize("per_channel", [False, True], ids=["default", "per_channel"])
def test_qdq_concat_of_differently_scaled_inputs(tmp_path, capsys, per_channel):
    model, x = _branches_model(tmp_path, per_channel)
    out = tmp_path / "out"
    _run(model, "-o", out, "--input", x)
    ir = json.loads((out / "ir.json").read_text())
    concats = [l for l in ir["layers"] if (l.get("quant") or {}).get("kind") == "concatenate"]
    assert len(concats) == 2
    # some operand is requantized by a table and some later operand is not: the layer's inputs are not in
    # operand order, and the record says which layer input each operand is
    inc = concats[1]
    tables = inc["quant"]["tables"]
    assert any(t is None for t in tables) and tables[-1] is not None
    assert sorted(inc["quant"]["operands"]) == list(range(len(inc["inputs"])))
    assert inc["quant"]["operands"] != list(range(len(inc["inputs"])))
    code, r, err = _verify_json(capsys, out)
    assert code == 0 and r["passed"], r["problems"]
    assert r["modes"] == list(MODES), err
    for row in r["layers"]:
        if row["integer"]:
            for mode in ("single", "entire"):
                assert row["checks"][mode]["exact"], (row["name"], mode, row["checks"][mode])
            assert row["checks"]["source"]["status"] == "pass", row
    for layer in concats:
        row = next(row for row in r["layers"] if row["name"] == layer["name"])
        assert row["checks"]["source"]["exact"], row  # ORT's QLinearConcat, bit for bit
