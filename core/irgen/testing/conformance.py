"""The conformance suite: what every irgen plugin must satisfy, one call per kind.

Each check runs a model through ``irgen run`` (:func:`irgen.testing.run_model`)
with the plugin's object, checks what the kind promises, and returns a small
report (a dict); a broken promise raises AssertionError saying which layer or
tensor and why. The object is looked up by name among the installed plugins and
the ones registered for the test (:func:`irgen.testing.registered`, the
``irgen_plugin`` fixture), so a plugin's test is one line::

    from irgen.testing import conformance

    def test_conformance(irgen_plugin, tmp_path):
        irgen_plugin(irgen_mine)
        conformance.check_backend("mine", tmp=tmp_path)

* :func:`check_frontend`: the layers of a model the frontend imports match the
  frontend's own source runtime (``irgen verify`` in ``source`` mode, its runner in
  this process), and irgen's numpy recompute (``single``, ``entire``).
* :func:`check_scheme`: every layer the scheme realizes equals the scheme's own numpy
  recompute (its ``Quantizer.recompute``) bit for bit; verify ``single``
  and ``entire`` pass.
* :func:`check_backend`: the backend's data files read back (its ``read_tensor``) to
  exactly the values the ``generic`` backend writes as ``.npy`` for the same model and
  input; verify passes reading them; its ``check_layer`` accepts the model.
* :func:`check_serializer`: the serializer's output parses back, with the plugin's own
  ``parse`` function, to ``ir.json``'s layers (names and ops, in order).

The default models are :mod:`irgen.testing.models` (ONNX: the onnx frontend and,
for a scheme, onnxruntime must be installed). A plugin for other models passes
``model=`` (and ``input=``, a ``.npy`` file or ``NAME=file.npy``).
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any, Callable, Iterable

import numpy as np

from irgen.irfile import read_manifest
from irgen.output import folder_mode
from irgen.testing import models, plugin_host, read_tensor, run_model, tensor_records, verify

__all__ = ["check_frontend", "check_scheme", "check_backend", "check_serializer"]


def _folder(tmp: str | Path | None) -> Path:
    """A new folder for one check's runs (in ``tmp``, else the system's), left for a look
    afterwards: its mode as ``mkdir`` would make it, the umask followed."""
    import os

    if tmp is not None:
        Path(tmp).mkdir(parents=True, exist_ok=True)
    folder = Path(tempfile.mkdtemp(prefix="conformance-" if tmp is not None else "irgen-conformance-", dir=tmp))
    os.chmod(folder, folder_mode())
    return folder


def _need(host, kind: str, name: str):
    registry = host.registries[kind]
    assert name in registry, (f"no {kind} named {name!r} is installed or registered for this test "
                              f"(available: {', '.join(registry.names()) or 'none'})")
    return registry.get(name)


def _inputs(input: str | Path | None, d: Path) -> list[str]:
    return [str(input)] if input is not None else [str(models.input_npy(d / "x.npy"))]


def _passed(result: dict[str, Any], what: str) -> None:
    from irgen.verify import format_table

    assert result["passed"], f"{what}: irgen verify failed:\n{format_table(result)}"


def check_frontend(name: str, model: str | Path, *, input: str | Path | None = None, tmp: str | Path | None = None,
                   min_source_layers: int = 1, thresholds: Any = None, args: Iterable[str] = ()) -> dict[str, Any]:
    """Import ``model`` with frontend ``name`` and check every layer against the frontend's
    source runtime (its ``runner``) and against irgen's numpy recompute. At least
    ``min_source_layers`` layers must have a source value to compare. Returns
    ``{"layers": n, "source_checked": n, "runtime": ...}``."""
    host = plugin_host()
    fe = _need(host, "frontend", name)
    assert fe.runner is not None, f"frontend {name!r} gives no runner: its layers cannot be checked against its source"
    d = _folder(tmp)
    out = d / "out"
    kwargs = {} if input is None else {"inputs": [str(input)]}
    ir = run_model(model, out, frontend=name, args=args, **kwargs)
    assert ir["producer"]["frontend"] == name
    result = verify(out, modes=("single", "entire", "source"), host=host, thresholds=thresholds)
    _passed(result, f"frontend {name!r} on {Path(model).name}")
    checked = [layer for layer in result["layers"] if (layer["checks"].get("source") or {}).get("status") == "pass"]
    assert len(checked) >= min_source_layers, (
        f"frontend {name!r}: only {len(checked)} layer(s) compared with the source runtime "
        f"(wanted {min_source_layers}): does the runner return the tensors named in provenance?")
    return {"layers": len(ir["layers"]), "source_checked": len(checked), "runtime": result["source"]["runtime"]}


def check_scheme(name: str, model: str | Path | None = None, *, input: str | Path | None = None,
                 tmp: str | Path | None = None, backend: str | None = None,
                 args: Iterable[str] = ()) -> dict[str, Any]:
    """Realize ``model`` (default: :func:`irgen.testing.models.qdq_onnx`) with scheme ``name``
    and check that every layer it records equals the scheme's own numpy recompute exactly
    (computed here from the layer's golden inputs and parameters), and that verify's
    ``single`` and ``entire`` checks pass. Returns ``{"layers": n, "recomputed": {kind: n}}``."""
    from irgen.quant import scheme_recompute

    host = plugin_host()
    _need(host, "quantizer", name)
    d = _folder(tmp)
    model = model if model is not None else models.qdq_onnx(d / "qdq.onnx")
    out = d / "out"
    ir = run_model(model, out, quantizer=name, backend=backend, inputs=_inputs(input, d), args=args)
    assert ir["producer"]["quantizer"] == name, ir["producer"]
    be = host.backends.get(ir["producer"]["backend"])
    counts: dict[str, int] = {}
    mine = [layer for layer in ir["layers"] if (layer.get("quant") or {}).get("scheme") == name]
    assert mine, f"scheme {name!r} recorded no layer of {Path(model).name}"
    for layer in mine:
        kind = layer["quant"]["kind"]
        fn = scheme_recompute(name, kind, host)
        assert fn is not None, f"scheme {name!r} registers no recompute of kind {kind!r} (layer {layer['name']!r})"
        inputs = [read_tensor(out, t, be) for t in layer.get("inputs") or []]
        params = {role: read_tensor(out, t, be) for role, t in (layer.get("params") or {}).items()}
        got = np.asarray(fn(layer, inputs, params))
        want = read_tensor(out, layer["outputs"][0], be)
        assert got.dtype == want.dtype and got.shape == want.shape, (
            f"scheme {name!r}, layer {layer['name']!r} ({kind}): recompute gives {got.dtype}{list(got.shape)}, "
            f"the realization {want.dtype}{list(want.shape)}")
        diff = int(np.count_nonzero(got != want))
        assert diff == 0, (f"scheme {name!r}, layer {layer['name']!r} ({kind}): {diff} of {want.size} values differ "
                           f"between the realization and the scheme's numpy recompute")
        counts[kind] = counts.get(kind, 0) + 1
    _passed(verify(out, host=host), f"scheme {name!r}")
    return {"layers": len(ir["layers"]), "recomputed": counts}


def check_backend(name: str, model: str | Path | None = None, *, input: str | Path | None = None,
                  quantizer: str | None = None, tmp: str | Path | None = None,
                  args: Iterable[str] = ()) -> dict[str, Any]:
    """Run ``model`` (default: :func:`irgen.testing.models.float_onnx`; a backend for integer
    hardware passes a quantized one, e.g. ``models.qdq_onnx(...)``) with backend ``name`` and
    with ``generic``, and check that every data file the backend wrote reads back (its
    ``read_tensor``) to exactly the generic backend's values for the same tensor, and that
    verify passes on its folder. Returns ``{"layers": n, "files": n, "suffixes": [...]}``."""
    host = plugin_host()
    be = _need(host, "backend", name)
    d = _folder(tmp)
    model = model if model is not None else models.float_onnx(d / "float.onnx")
    common = {"inputs": _inputs(input, d), "quantizer": quantizer, "args": args}
    ir = run_model(model, d / "mine", backend=name, **common)
    ref = run_model(model, d / "generic", backend="generic", **common)
    assert ir["producer"]["backend"] == name
    theirs = {t["name"]: t for t in tensor_records(ref)}
    suffixes: set[str] = set()
    files = 0
    for t in tensor_records(ir):
        got = read_tensor(d / "mine", t, be)
        assert str(got.dtype) == t["dtype"] and list(got.shape) == list(t["shape"]), (
            f"backend {name!r}: {t['file']} reads back as {got.dtype}{list(got.shape)}, "
            f"its record says {t['dtype']}{t['shape']}")
        if t["name"] in theirs:
            g = theirs[t["name"]]
            want = read_tensor(d / "generic", g)
            if list(g["shape"]) == list(t["shape"]):  # a backend with another layout states it in the record
                assert np.array_equal(got, want), f"backend {name!r}: {t['file']} differs from the generic backend's values"
        files += 1
        suffixes.add(Path(t["file"]).suffix)
    assert files, f"backend {name!r} wrote no data file"
    _passed(verify(d / "mine", host=host), f"backend {name!r}")
    return {"layers": len(ir["layers"]), "files": files, "suffixes": sorted(suffixes)}


def check_serializer(name: str, parse: Callable[[Path], Any], model: str | Path | None = None, *,
                     input: str | Path | None = None, tmp: str | Path | None = None,
                     args: Iterable[str] = ()) -> dict[str, Any]:
    """Write ``model`` (default: :func:`irgen.testing.models.float_onnx`) with serializer
    ``name`` and parse its output back with ``parse(out_dir)``, the plugin's own reader: it
    returns the layers (a list of mappings with ``name`` and ``op``, or a dict with such a
    ``layers`` list), which must be ``ir.json``'s, in order; a layer that also gives
    ``outputs`` (mappings with ``shape``) must give ``ir.json``'s output shapes. Returns
    ``{"layers": n, "files": [paths the serializer wrote]}``."""
    host = plugin_host()
    _need(host, "serializer", name)
    d = _folder(tmp)
    model = model if model is not None else models.float_onnx(d / "float.onnx")
    out = d / "out"
    ir = run_model(model, out, serializer=[name], inputs=_inputs(input, d), args=args)
    assert name in ir["producer"]["serializers"], ir["producer"]
    parsed = parse(out)
    layers = parsed["layers"] if isinstance(parsed, dict) else parsed
    assert isinstance(layers, (list, tuple)), f"serializer {name!r}: parse returned {type(parsed).__name__}, not layers"
    got = [(str(layer["name"]), str(layer["op"])) for layer in layers]
    want = [(layer["name"], layer["op"]) for layer in ir["layers"]]
    assert got == want, f"serializer {name!r}: parsed layers {got[:5]}... differ from ir.json's {want[:5]}..."
    for mine, theirs in zip(layers, ir["layers"]):
        if "outputs" in mine:
            assert [list(map(int, t["shape"])) for t in mine["outputs"]] == [t["shape"] for t in theirs["outputs"]], \
                f"serializer {name!r}: layer {theirs['name']!r} output shapes differ"
    manifest = read_manifest(out) or {}
    core = {"ir.json", "manifest.json"}
    written = sorted(f["path"] for f in manifest.get("files") or []
                     if "/" not in f["path"] and f["path"] not in core)
    return {"layers": len(layers), "files": written}
