"""The same float model as ONNX and as ``.pt2`` gives the same layer ops (issue 12), for the
patterns of GPT-2 and Swin that the exporters write differently (``irgen.canonical``):

- GPT-2 (a small transformers ``GPT2Model``, ONNX from the dynamo exporter, as the zoo's):
  ``.pt2`` keeps a bool-masked ``scaled_dot_product_attention``; ONNX writes kᵀ as a 3-d
  reshape / transpose / reshape, guards the softmax with ``isnan`` / ``where`` and folds the
  reshapes ``.pt2`` keeps after the attention; ``split`` then ``view`` per head is a split
  and three reshapes from both;
- ``torch.roll`` over two axes, a chain of rolls, chunks concatenated in swapped order,
  a crop to the full size and causal
  attention (``is_causal=True``), ONNX from the TorchScript exporter (as the zoo's Swin):
  ``.pt2`` has slices and a concat per axis from one roll node, ONNX Slice/Slice/Concat
  nodes; both give one ``roll`` layer per chain, its attrs torch.roll's ``shifts`` and
  ``axes`` (normalized), and ``np.roll`` of its golden input is its golden output.

Each model runs through ``irgen run`` from both formats; the layer ops are equal, and
``irgen verify`` passes single, entire and the source check (onnxruntime / torch).
"""

from __future__ import annotations

import contextlib
import io
import json
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("onnxruntime")
pytest.importorskip("irgen_torch")
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
from test_verify import _run, _verify_json  # noqa: E402

from irgen.verify import MODES  # noqa: E402


def _gpt2():
    """A 1-layer GPT-2 over token ids (the zoo's model, smaller): its attention is sdpa with a
    bool causal mask; exported to ONNX by the dynamo exporter, as the zoo does."""
    pytest.importorskip("transformers")
    from zoo import import_torchvision

    import_torchvision()  # transformers imports it
    import transformers

    cfg = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=1, n_head=2)
    gpt2 = transformers.GPT2Model(cfg).eval()

    class GPT2(nn.Module):
        def __init__(self):
            super().__init__()
            self.gpt2 = gpt2

        def forward(self, input_ids):
            return self.gpt2(input_ids=input_ids, use_cache=False).last_hidden_state

    return GPT2().eval(), torch.randint(0, 64, (1, 8), generator=torch.Generator().manual_seed(1)), True


class RollCausal(nn.Module):
    """Swin's shifted window moves (roll over two axes with shifts of both signs, a crop to the
    full size), two rolls in a row (a negative axis), ``chunk`` then ``cat`` of the pieces
    swapped (a roll as ``.pt2``'s split and ONNX's slices), causal attention, a roll as the
    output."""

    def __init__(self, c: int = 8) -> None:
        super().__init__()
        self.lin, self.k, self.v = nn.Linear(c, c), nn.Linear(c, c), nn.Linear(c, c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.roll(x, shifts=(2, -3), dims=(1, 2))
        y = self.lin(y)[:, :6, :8, :]
        z = torch.roll(torch.roll(y, 5, -1), 1, 1)
        u, w = self.k(z).chunk(2, dim=-1)  # chunk and cat in swapped order: a roll too
        o = F.scaled_dot_product_attention(z, torch.cat((w, u), dim=-1), self.v(z), is_causal=True)
        return torch.roll(o, -1, 2)


def _roll_causal():
    return RollCausal().eval(), torch.randn(1, 6, 8, 8, generator=torch.Generator().manual_seed(1)), False


MODELS = {"gpt2": _gpt2, "roll_causal": _roll_causal}


def _export(name: str, d: Path) -> tuple[Path, Path, Path]:
    torch.manual_seed(0)
    model, x, dynamo = MODELS[name]()
    np.save(d / "x.npy", x.numpy())
    onnx_path, pt2_path = d / f"{name}.onnx", d / f"{name}.pt2"
    with torch.no_grad():
        torch.export.save(torch.export.export(model, (x,)), str(pt2_path))
        with contextlib.redirect_stdout(io.StringIO()):
            if dynamo:
                torch.onnx.export(model, (x,), str(onnx_path), input_names=["x"], output_names=["y"], dynamo=True,
                                  opset_version=18, external_data=False)
            else:
                torch.onnx.export(model, (x,), str(onnx_path), input_names=["x"], output_names=["y"], dynamo=False,
                                  opset_version=17)
    return onnx_path, pt2_path, d / "x.npy"


def _run_and_verify(model: Path, x: Path, out: Path, capsys) -> dict:
    _run(model, "-o", out, "--input", x)
    ir = json.loads((out / "ir.json").read_text())
    code, result = _verify_json(capsys, out)
    assert code == 0 and result["passed"] and result["modes"] == list(MODES), result["problems"]
    for row, layer in zip(result["layers"], ir["layers"], strict=True):
        for mode in MODES:
            m = row["checks"][mode]
            if mode == "source" and not layer["source"]["outputs"]:
                # a step inside .pt2's attention (the source runtime has only the attention's result),
                # or ONNX's q·kᵀ before the scale its exporter put on q and kᵀ
                assert m["status"] == "missing", (layer["name"], m)
                assert "aten.scaled_dot_product_attention.default" in layer["source"]["op_types"] or (
                    layer["op"], layer["source"]["op_types"]) == ("matmul", ["MatMul"]), layer
                continue
            assert m is not None and m["status"] == "pass", (layer["name"], mode, m)
    return ir


# GPT-2 (transformers, the dynamo exporter; 8-17 s) is slow, as the zoo's gpt2 cases are
@pytest.mark.parametrize("name", [pytest.param(n, marks=[pytest.mark.slow] if n == "gpt2" else []) for n in MODELS])
def test_onnx_and_pt2_give_the_same_layer_ops(name, tmp_path, capsys):
    onnx_path, pt2_path, x = _export(name, tmp_path)
    ir_onnx = _run_and_verify(onnx_path, x, tmp_path / "out_onnx", capsys)
    ir_pt2 = _run_and_verify(pt2_path, x, tmp_path / "out_pt2", capsys)
    ops_onnx, ops_pt2 = ([layer["op"] for layer in ir["layers"]] for ir in (ir_onnx, ir_pt2))
    assert ops_onnx == ops_pt2, "\n".join(f"{a:16} {b}" for a, b in zip(ops_onnx, ops_pt2))
    for ir in (ir_onnx, ir_pt2):
        layers = ir["layers"]
        if name == "gpt2":
            # sdpa's steps with a bool mask (no NaN guard: the mask is finite), kᵀ one transpose
            at = [layer["op"] for layer in layers].index("softmax")
            assert [layer["op"] for layer in layers[at - 4:at + 2]] == [
                "transpose", "matmul", "multiply", "add", "softmax", "matmul"], [layer["op"] for layer in layers]
            assert not {"isnan", "where"} & set(ops_onnx)
            split = next(layer for layer in layers if layer["op"] == "split")
            assert [op["op"] for op in split["fused_ops"]] == ["split"]  # each head's view is a layer of its own
        else:
            rolls = [layer for layer in layers if layer["op"] == "roll"]
            # roll over (1, 2); the two rolls in a row (axes 3 and 1); the keys' chunks swapped; the output's roll
            assert [[op["attrs"].get("axis") for op in layer["fused_ops"] if op["op"] == "concatenate"]
                    for layer in rolls] == [[1, 2], [3, 1], [3], [2]], [layer["name"] for layer in rolls]
            assert "strided_slice" not in ops_onnx and "attention" not in ops_pt2  # the crop computes nothing
            at = ops_pt2.index("softmax")
            assert ops_pt2[at - 1] == "add"  # the causal mask, as the exporter writes is_causal
    if name == "roll_causal":
        _check_roll_attrs(ir_onnx, ir_pt2, tmp_path)
    # ONNX's roll layers name every source node folded in: per axis Slice, Slice, Concat
    if name == "roll_causal":
        first = next(layer for layer in ir_onnx["layers"] if layer["op"] == "roll")
        assert first["source"]["op_types"] == ["Slice", "Slice", "Concat"] * 2, first["source"]


# RollCausal's rolls as torch.roll takes them (shifts, dims) on its 4-d tensors, in the order they
# run, and the size of each rolled axis: roll((2, -3), (1, 2)) of x; roll(roll(y, 5, -1), 1, 1);
# chunk(2, -1) and cat swapped (a roll by half the axis); roll(o, -1, 2)
ROLLS = [([2, -3], [1, 2], [6, 8]), ([5, 1], [-1, 1], [8, 6]), ([4], [-1], [8]), ([-1], [2], [8])]


def _check_roll_attrs(ir_onnx: dict, ir_pt2: dict, tmp_path: Path) -> None:
    """A roll layer's attrs are torch.roll's shifts and axes, normalized (0 <= shift < n, axis
    >= 0), the same from ONNX and .pt2, and np.roll of its golden input is its golden output."""
    expected = [{"shifts": [s % n for s, n in zip(shifts, sizes)], "axes": [a % 4 for a in axes]}
                for shifts, axes, sizes in ROLLS]
    for ir, out in ((ir_onnx, tmp_path / "out_onnx"), (ir_pt2, tmp_path / "out_pt2")):
        rolls = [layer for layer in ir["layers"] if layer["op"] == "roll"]
        assert [layer["attrs"] for layer in rolls] == expected, [layer["attrs"] for layer in rolls]
        for layer in rolls:
            (x,), (y,) = layer["inputs"], layer["outputs"]
            got = np.roll(np.load(out / x["file"]), layer["attrs"]["shifts"], layer["attrs"]["axes"])
            np.testing.assert_array_equal(got, np.load(out / y["file"]), err_msg=layer["name"])
