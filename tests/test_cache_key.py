"""A cache never changes a result (issue 34): the compile cache's key is everything that
determines the output (:mod:`irgen.runkey`).

* For one model per frontend and scheme (every zoo case under ``-m slow``), a run that
  stores its compile and a run served from it write the same bytes as ``--no-cache``.
* Each kind of input that determines an output is changed, one at a time, between a run
  that stored its compile and the next run; that run must equal a fresh ``--no-cache``
  run of the changed input (and differ from the old output where the change changes
  values): an ONNX model's external data, a ``--model-class`` module and a local module
  it imports, a calibration folder's samples (removed, renamed), and, on the key itself,
  every option, ``IRGEN_*`` variable, library version and source file.
* ``irgen cache`` shows the cache, clears it, and ``irgen cache verify`` finds an entry
  whose stored result differs from a fresh compile.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from irgen.cli import main
from layercheck import output_files

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "examples" / "tiny_cnn.onnx"
sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    folder = tmp_path / "cache"
    monkeypatch.setenv("IRGEN_CACHE_DIR", str(folder))
    monkeypatch.setenv("IRGEN_CACHE_SIZE", "1G")  # the suite may turn it off
    return folder


def _run(capsys, model: Path, out: Path, args: list[str], *extra: str) -> str:
    """``irgen run`` in this process; its stderr."""
    capsys.readouterr()
    assert main(["run", str(model), "-o", str(out), "--force", *args, *extra]) == 0
    return capsys.readouterr().err


def _warm_equals_cold(capsys, tmp_path: Path, model: Path, args: list[str]) -> None:
    _run(capsys, model, tmp_path / "cold", args, "--no-cache")
    assert "from the cache" not in _run(capsys, model, tmp_path / "stored", args)
    assert "compiled model from the cache" in _run(capsys, model, tmp_path / "warm", args)
    cold = output_files(tmp_path / "cold")
    assert output_files(tmp_path / "stored") == cold
    assert output_files(tmp_path / "warm") == cold


# ---------------------------------------------------------------- one model per frontend and scheme


def _onnx_qdq(folder: Path):
    from test_qdq import quantized

    return quantized("small_cnn", False, "u8", folder), []


def _onnx_pow2(folder: Path):
    from test_pow2 import pow2_model
    from test_qdq import quantized

    return pow2_model(quantized("mlp", True, "s8", folder), folder / "pow2.onnx"), []


def _tflite_int8(folder: Path, backend: str = "generic"):
    import tflite_models

    path, x = tflite_models.export("small_cnn", folder, "int8")
    np.save(folder / "x.npy", x)
    return path, ["--input", str(folder / "x.npy"), "--backend", backend]


def _keras_int8(folder: Path):
    path, calibration = _keras_with_calibration(folder)
    return path, ["--calibration", str(calibration)]


def _keras_with_calibration(folder: Path) -> tuple[Path, Path]:
    import tflite_models

    model, shape = tflite_models.build("mlp")
    model.save(folder / "mlp.keras")
    calibration = folder / "calibration"
    calibration.mkdir()
    for k in range(6):  # spread apart, so that each sample moves the calibrated ranges
        sample = np.random.default_rng(40 + k).standard_normal(shape).astype(np.float32) * (1 + k)
        np.save(calibration / f"s{k}.npy", sample)
    return folder / "mlp.keras", calibration


def _pt2(folder: Path, quantized: bool = False):
    import torch

    import models

    cls, shape = models.BUILDERS["small_cnn"]
    torch.manual_seed(0)
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(1))
    if quantized:
        from test_torch_quant import build

        model = build("ref_pc", x)
    else:
        model = cls().eval()
    path = folder / "model.pt2"
    torch.export.save(torch.export.export(model, (x,)), str(path))
    return path, []


CASES = {
    "onnx-float": lambda folder: (TINY, []),
    "onnx-qdq": _onnx_qdq,
    "onnx-pow2": _onnx_pow2,
    "tflite-int8": _tflite_int8,
    "tflite-int8-npu": lambda folder: _tflite_int8(folder, "npu-int8"),
    "keras-int8": _keras_int8,
    "pt2-float": _pt2,
    "pt2-torch-ptq": lambda folder: _pt2(folder, quantized=True),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_warm_run_equals_a_no_cache_run(case, tmp_path, cache, capsys):
    pytest.importorskip("tensorflow" if case.startswith(("tflite", "keras")) else "torch")
    folder = tmp_path / "model"
    folder.mkdir()
    model, args = CASES[case](folder)
    _warm_equals_cold(capsys, tmp_path, model, [*args, "--debug", "all"])


def _zoo_cases():
    import zoo

    return [pytest.param(c, id=c.id, marks=[pytest.mark.slow]) for c in zoo.cases()]


@pytest.mark.parametrize("case", _zoo_cases())
def test_warm_run_equals_a_no_cache_run_on_the_zoo(case, tmp_path, cache, capsys):
    import zoo

    pytest.importorskip("onnxruntime")
    model, args = zoo.build(case, tmp_path / "models")
    _warm_equals_cold(capsys, tmp_path, model, args)


# ---------------------------------------------------------------- each input changed, one at a time


def _changed(capsys, tmp_path: Path, model: Path, args: list[str], change, values_change: bool = True) -> str:
    """Store a compile, ``change()``, then run warm: equal to a fresh ``--no-cache`` run of the
    changed input (and, if ``values_change``, different from before). The warm run's stderr."""
    args = [*args, "--debug", "all"]
    _run(capsys, model, tmp_path / "before", args)
    before = output_files(tmp_path / "before")
    change()
    err = _run(capsys, model, tmp_path / "after", args)
    _run(capsys, model, tmp_path / "fresh", args, "--no-cache")
    assert output_files(tmp_path / "after") == output_files(tmp_path / "fresh")
    if values_change:
        assert output_files(tmp_path / "after") != before
    return err


def _external_data_model(folder: Path) -> tuple[Path, Path]:
    import onnx

    m = onnx.load(str(TINY))
    path = folder / "tiny_ext.onnx"
    onnx.save_model(m, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                    location="tiny_ext.data", size_threshold=0)
    return path, folder / "tiny_ext.data"


def test_changed_external_data_is_never_served_from_the_cache(tmp_path, cache, capsys):
    pytest.importorskip("onnx")
    folder = tmp_path / "model"
    folder.mkdir()
    model, data = _external_data_model(folder)

    def change():
        raw = bytearray(data.read_bytes())
        weights = np.frombuffer(raw, np.float32).copy()
        data.write_bytes((weights * np.float32(1.5)).tobytes())

    err = _changed(capsys, tmp_path, model, [], change)
    assert "stale" in err and "tiny_ext.data changed" in err and "compiled model from the cache" not in err
    entry = json.loads(next(cache.glob("*/key.json")).read_text())
    assert [Path(d["file"]).name for d in entry["depends"]] == ["tiny_ext.data"]
    manifest = json.loads((tmp_path / "after" / "manifest.json").read_text())
    assert manifest["key"]["depends"] == entry["depends"]


@pytest.mark.slow  # test_changed_external_data_is_never_served_from_the_cache runs by default
def test_sweep_resume_reruns_a_job_whose_external_data_changed(tmp_path):
    """The sweep's resume fingerprint is the run's key: a changed data file reruns the job."""
    pytest.importorskip("onnx")
    from irgen.sweep import sweep

    folder = tmp_path / "model"
    folder.mkdir()
    model, data = _external_data_model(folder)
    spec = tmp_path / "spec.yaml"
    spec.write_text(f"models: [{model}]\nseeds: [0]\n")
    out = tmp_path / "out"
    assert sweep(spec, out, workers=1)["counts"] == {"ok": 1, "failed": 0, "reused": 0}
    assert sweep(spec, out, workers=1)["counts"]["reused"] == 1  # nothing changed: kept
    before = output_files(out / "tiny_ext/seed0/O3/auto")
    data.write_bytes((np.frombuffer(data.read_bytes(), np.float32) * np.float32(0.5)).tobytes())
    again = sweep(spec, out, workers=1)
    assert again["counts"] == {"ok": 1, "failed": 0, "reused": 0}
    after = output_files(out / "tiny_ext/seed0/O3/auto")
    assert main(["run", str(model), "-o", str(tmp_path / "fresh"), "--no-cache", "--no-progress"]) == 0
    fresh = output_files(tmp_path / "fresh")
    assert after != before
    assert {k: v for k, v in after.items() if k.startswith(("activations/", "parameters/"))} == \
        {k: v for k, v in fresh.items() if k.startswith(("activations/", "parameters/"))}


NET = """
import torch
from torch import nn
{imports}

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.c = nn.Conv2d(3, 4, 3, padding=1)
        self.fc = nn.Linear(4 * 8 * 8, 5)

    def forward(self, x):
        return self.fc({activation}(self.c(x)).flatten(1))
"""


def _irgen_child(cwd: Path, cache: Path, *argv: str) -> subprocess.CompletedProcess:
    env = {**__import__("os").environ, "IRGEN_CACHE_DIR": str(cache), "IRGEN_CACHE_SIZE": "1G"}
    proc = subprocess.run([sys.executable, "-m", "irgen", *argv], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc


@pytest.mark.parametrize("edited", [
    # four fresh irgen processes each; a module the class imports is the harder case to key
    pytest.param("the class's module", marks=pytest.mark.slow), "a module it imports"])
def test_changed_model_class_code_is_never_served_from_the_cache(edited, tmp_path, cache):
    """``.pth`` + ``--model-class mod:Net``, each run a fresh ``irgen`` process (as users run it)."""
    torch = pytest.importorskip("torch")
    work = tmp_path / "work"
    work.mkdir()
    (work / "acts.py").write_text("import torch\n\ndef act(x):\n    return torch.relu(x)\n")
    (work / "netmod.py").write_text(NET.format(imports="from acts import act", activation="act"))
    sys.path.insert(0, str(work))
    try:
        import netmod

        torch.manual_seed(0)
        torch.save(netmod.Net().state_dict(), work / "net.pth")
    finally:
        sys.path.remove(str(work))
        sys.modules.pop("netmod", None), sys.modules.pop("acts", None)
    argv = ["run", "net.pth", "--model-class", "netmod:Net", "--input-shape", "x=1,3,8,8", "--force",
            "--debug", "all"]
    _irgen_child(work, cache, *argv, "-o", str(tmp_path / "before"))
    before = output_files(tmp_path / "before")
    if edited == "a module it imports":
        (work / "acts.py").write_text("import torch\n\ndef act(x):\n    return torch.sigmoid(x)\n")
    else:
        (work / "netmod.py").write_text(NET.format(imports="from acts import act", activation="torch.tanh"))
    err = _irgen_child(work, cache, *argv, "-o", str(tmp_path / "after")).stderr
    _irgen_child(work, cache, *argv, "-o", str(tmp_path / "fresh"), "--no-cache")
    assert "stale" in err and "compiled model from the cache" not in err
    assert output_files(tmp_path / "after") == output_files(tmp_path / "fresh") != before
    # unchanged code: served from the cache
    err = _irgen_child(work, cache, *argv, "-o", str(tmp_path / "again")).stderr
    assert "compiled model from the cache" in err
    assert output_files(tmp_path / "again") == output_files(tmp_path / "fresh")


@pytest.fixture(scope="module")
def keras_model(tmp_path_factory):
    pytest.importorskip("tensorflow")
    folder = tmp_path_factory.mktemp("keras")
    return _keras_with_calibration(folder)


CALIBRATION_CHANGES = ["a sample deleted", "a sample set aside (renamed to .npy.off)",
                       "samples renamed (another order)", "a sample's content"]


@pytest.mark.parametrize("how", CALIBRATION_CHANGES)
def test_changed_calibration_set_is_never_served_from_the_cache(how, keras_model, tmp_path, cache, capsys):
    """The folder's files by name, order and content (a file set aside keeps the folder's bytes,
    in the same order, but takes a sample out of the set)."""
    import shutil

    model, original = keras_model
    calibration = tmp_path / "calibration"
    shutil.copytree(original, calibration)
    files = sorted(calibration.iterdir())

    def change():
        if how == "a sample deleted":
            files[-1].unlink()
        elif how.startswith("a sample set aside"):
            files[-1].rename(files[-1].with_name(files[-1].name + ".off"))
        elif how.startswith("samples renamed"):
            files[0].rename(calibration / "z_first_now_last.npy")
        else:
            np.save(files[-1], np.load(files[-1]) * 3)

    err = _changed(capsys, tmp_path, model, ["--calibration", str(calibration)], change,
                   values_change=how != "samples renamed (another order)")
    assert "compiled model from the cache" not in err and "options.calibration" in err


# ---------------------------------------------------------------- the key itself


def _key(host, model: Path, options: dict | None = None, **kw):
    from irgen import pipeline

    return pipeline.run_key(host, model, kw.get("opt_level", 3), None, kw.get("backend", "generic"),
                            kw.get("quantizer"), {"cache": True, **(options or {})})


def test_every_keyed_input_changes_the_key_and_nothing_else_does(tmp_path, monkeypatch):
    from irgen import runkey
    from irgen.plugins import PluginHost

    host = PluginHost().load()
    model = tmp_path / "m.onnx"
    model.write_bytes(TINY.read_bytes())
    base = _key(host, model).digest
    assert _key(host, model).digest == base  # deterministic

    def differs(label, key):
        assert key.digest != base, label

    differs("opt level", _key(host, model, opt_level=2))
    differs("backend", _key(host, model, backend="npu-int8"))
    differs("scheme", _key(host, model, quantizer="qdq"))
    differs("a plugin option", _key(host, model, {"npu_channel_multiple": 32}))
    differs("input shapes", _key(host, model, {"input_shapes": {"x": (1, 3, 64, 64)}}))
    differs("the tensor limit", _key(host, model, {"max_tensor_bytes": 1 << 20}))
    for label, options in (("--seed", {"seed": 9}), ("--debug", {"debug": "all"}), ("--force", {"force": True}),
                           ("--no-progress", {"no_progress": True}), ("-o", {"output": "x"})):
        assert _key(host, model, options).digest == base, label
    monkeypatch.setenv("IRGEN_NO_SHARE", "1")
    differs("IRGEN_NO_SHARE", _key(host, model))
    monkeypatch.delenv("IRGEN_NO_SHARE")
    monkeypatch.setenv("IRGEN_ANY_NEW_SWITCH", "1")  # one irgen does not know yet: keyed all the same
    differs("an unknown IRGEN_ variable", _key(host, model))
    monkeypatch.delenv("IRGEN_ANY_NEW_SWITCH")
    monkeypatch.setenv("TF_ENABLE_ONEDNN_OPTS", "0")  # TensorFlow's kernels calibrate a Keras model
    differs("TF_ENABLE_ONEDNN_OPTS", _key(host, model))
    monkeypatch.delenv("TF_ENABLE_ONEDNN_OPTS")
    for name in ("IRGEN_CACHE_DIR", "IRGEN_TRACEBACK", "IRGEN_BUILD_THREADS"):
        monkeypatch.setenv(name, "7")
        assert _key(host, model).digest == base, name
        monkeypatch.delenv(name)
    before = _key(host, model)
    real = runkey.distributions()
    monkeypatch.setattr(runkey, "distributions", lambda: [d if not d.startswith("numpy-") else "numpy-0.0.1"
                                                          for d in real])
    changed = _key(host, model)
    differs("a library version", changed)
    assert "versions.distributions: numpy-0.0.1" in runkey.differences(before.doc, changed.doc)
    monkeypatch.undo()
    monkeypatch.setattr(runkey, "code_digest", lambda host: "edited")
    differs("irgen's or a plugin's source", _key(host, model))
    monkeypatch.undo()
    model.write_bytes(TINY.read_bytes() + b"\0")
    differs("the model's bytes", _key(host, model))


def test_a_folder_is_keyed_on_its_files_names_and_layout(tmp_path):
    from irgen.runkey import digest_path

    folder = tmp_path / "saved"
    (folder / "variables").mkdir(parents=True)
    (folder / "saved_model.pb").write_bytes(b"graph")
    (folder / "variables" / "variables.data").write_bytes(b"a")
    (folder / "variables" / "variables.index").write_bytes(b"b")
    base = digest_path(folder).sha256
    (folder / "variables" / "variables.index").rename(folder / "variables" / "variables.index2")
    assert digest_path(folder).sha256 != base  # the same bytes under another name
    (folder / "variables" / "variables.index2").rename(folder / "variables.index")
    assert digest_path(folder).sha256 != base  # ... or in another folder
    (folder / "variables.index").rename(folder / "variables" / "variables.index")
    assert digest_path(folder).sha256 == base
    (folder / "variables" / "variables.data").write_bytes(b"b")
    (folder / "variables" / "variables.index").write_bytes(b"a")
    assert digest_path(folder).sha256 != base  # two files' contents swapped


def test_a_miss_says_what_the_entry_was_keyed_on_differently(tmp_path, cache, capsys, monkeypatch):
    _run(capsys, TINY, tmp_path / "a", ["--no-progress"])
    monkeypatch.setenv("IRGEN_NO_SCHEDULE", "1")
    capsys.readouterr()
    assert main(["run", str(TINY), "-o", str(tmp_path / "b")]) == 0
    err = capsys.readouterr().err
    assert "compile cache: not stored; the entry for this model was keyed on another" in err
    assert "environment.IRGEN_NO_SCHEDULE" in err


# ---------------------------------------------------------------- irgen cache


def test_irgen_cache_shows_lists_clears_and_verifies(tmp_path, cache, capsys):
    _run(capsys, TINY, tmp_path / "a", ["--no-progress"])
    assert main(["cache", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["folder"] == str(cache) and info["entries"] == 1 and info["bytes"] > 0
    assert main(["cache", "list", "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)
    assert row["model"] == str(TINY) and row["frontend"] == "onnx"
    assert main(["cache", "show", row["name"][:8]]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["key"]["model"]["sha256"] and shown["request"]["model"] == str(TINY)
    assert main(["cache", "verify", "--json", "--no-progress"]) == 0
    assert [r["status"] for r in json.loads(capsys.readouterr().out)] == ["same"]

    # an entry whose stored result no longer equals a fresh compile: verify finds it
    entry = cache / row["name"]
    plan = json.loads((entry / "plan.json").read_text())
    weight = entry / "arrays" / next(r["weight"] for r in plan["params"] if "weight" in r)
    arr = np.load(weight)
    np.save(weight, arr + np.float32(0.25))
    assert main(["cache", "verify", "--json", "--no-progress"]) == 1
    (result,) = json.loads(capsys.readouterr().out)
    assert result["status"] == "differs" and any(f.startswith("activations/") for f in result["files"])

    assert main(["cache", "clear"]) == 0
    assert "removed 1 entries" in capsys.readouterr().out
    assert main(["cache", "list", "--json"]) == 0 and json.loads(capsys.readouterr().out) == []


def test_irgen_cache_refuses_bad_arguments(capsys):
    assert main(["cache", "show"]) == 2
    assert "irgen: error:" in capsys.readouterr().err
    assert main(["cache", "list", "--sample", "3"]) == 2
    assert main(["cache", "show", "nonexistent-entry"]) == 2
