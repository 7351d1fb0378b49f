"""Checks the frontend tests share: irgen's layer files against a reference
runtime's tensors, and the one-line user error of an in-process run."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import numpy as np

RTOL, ATOL = 1e-4, 1e-5


def assert_close(actual: np.ndarray, expected: np.ndarray, what: str, rtol=RTOL, atol=ATOL) -> float:
    """Same shape and within tolerance; returns max |actual - expected|."""
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    err = float(np.max(np.abs(actual.astype(np.float64) - expected.astype(np.float64)))) if actual.size else 0.0
    np.testing.assert_allclose(actual, expected, rtol=rtol, atol=atol, err_msg=what)
    return err


def assert_layers_match(out: Path, ir: dict, ref: dict[str, np.ndarray], what: str,
                        check: Callable[[dict, str], None] | None = None) -> float:
    """Every layer names its source output tensors, and each output file holds
    the shape and dtype its record says and the reference's value of that
    tensor. ``check(layer, src)`` adds a framework's own assertions. Returns
    the largest error."""
    missing = [layer["name"] for layer in ir["layers"] if not layer["source"].get("outputs")]
    assert not missing, f"layers without a source output tensor: {missing}"
    worst = 0.0
    for layer in ir["layers"]:
        srcs = layer["source"]["outputs"]
        assert len(srcs) == len(layer["outputs"]), layer["name"]
        for rec, src in zip(layer["outputs"], srcs):
            if check is not None:
                check(layer, src)
            assert src in ref, f"layer {layer['name']}: no reference value for {src!r}"
            got = np.load(out / rec["file"])
            assert list(got.shape) == rec["shape"] and str(got.dtype) == rec["dtype"], rec
            assert got.dtype == ref[src].dtype, (layer["name"], got.dtype, ref[src].dtype)
            worst = max(worst, assert_close(got, ref[src], f"{what} layer {layer['name']} ({src})"))
    return worst


def run_each(host, model: Path, folder: Path, xs) -> list[tuple[np.ndarray, Path]]:
    """``irgen run`` (in process) of ``model`` on each input of ``xs`` (saved as ``folder/x<k>.npy``)
    into ``folder/out<k>``, at opt levels 3 and 0 in turn: ``[(input, OUT)]``."""
    from irgen.pipeline import run

    runs = []
    for k, x in enumerate(xs):
        np.save(folder / f"x{k}.npy", x)
        out = folder / f"out{k}"
        run(host, model, out, inputs=[str(folder / f"x{k}.npy")], opt_level=3 if k % 2 == 0 else 0)
        runs.append((x, out))
    return runs


def assert_layers_equal(out: Path, ir: dict, ref: dict[str, np.ndarray], what: str, dtype=None) -> int:
    """Every layer's output files and the model's outputs equal the reference's tensors bit for
    bit, dtype included (``dtype``: what each layer output must be, when given). Returns the
    number of layer outputs compared."""
    checked = 0
    for layer in ir["layers"]:
        for rec, src in zip(layer["outputs"], layer["source"]["outputs"], strict=True):
            got = np.load(out / rec["file"])
            assert got.dtype == (ref[src].dtype if dtype is None else dtype), (layer["name"], got.dtype)
            np.testing.assert_array_equal(got, ref[src], err_msg=f"{what} {out.name} {layer['name']}")
            checked += 1
    for o in ir["outputs"]:
        np.testing.assert_array_equal(np.load(out / o["file"]), ref[o["name"]], err_msg=f"{what} output {o['name']}")
    return checked


def assert_layer_recomputes(out: Path, layer: dict, k: int = -1) -> None:
    """The layer's output file ``k`` again from its ``quant`` record and the parameter
    files (``irgen.quant.recompute``; a layer without one, such as an ARG_MAX of integers,
    has nothing to recompute there) and from its ``fused_ops`` program
    (``irgen.reference.run_layer``): each equal to it, dtype included."""
    from irgen import quant, reference

    inputs = reference.load_layer_inputs(out, layer)
    params = reference.load_layer_params(out, layer)
    exp = np.load(out / layer["outputs"][k]["file"])
    ways = [("fused_ops", reference.run_layer(layer, inputs, params)[k])]
    if layer.get("quant") is not None:
        ways.insert(0, ("quant", quant.recompute(layer, inputs, params)))
    for how, got in ways:
        assert got.dtype == exp.dtype and np.array_equal(got, exp), (how, layer["name"])


def assert_user_error(run: Callable[[list[str]], int], capsys, args: list[str], out: Path, *needles: str) -> str:
    """``run(args)`` exits 2 with exactly one ``irgen: error:`` line naming ``needles``; no OUT."""
    rc = run(args)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert rc == 2, err
    assert len(lines) == 1 and lines[0].startswith("irgen: error:"), err
    for n in needles:
        assert n in lines[0], (n, lines[0])
    assert not out.exists()
    return lines[0]


def output_files(folder: Path) -> dict[str, bytes]:
    """Every file's bytes in an output folder by relative path; ``manifest.json`` without the
    fields that name the command and the folder it ran in (to compare two runs' outputs)."""
    out = {}
    for p in sorted(folder.rglob("*")):
        if p.is_file():
            data = p.read_bytes()
            if p.name == "manifest.json":
                doc = json.loads(data)
                doc.pop("command"), doc.pop("cwd")
                data = json.dumps(doc, sort_keys=True).encode()
            out[p.relative_to(folder).as_posix()] = data
    return out
