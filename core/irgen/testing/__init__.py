"""Testing helpers for irgen plugins: register a plugin for one test, run a model, verify it.

``irgen.testing`` is also a pytest plugin (entry point ``pytest11``, module
:mod:`irgen.testing.pytest_plugin`): installing irgen gives every test suite
the fixtures ``irgen_plugin`` and ``irgen_host``. A plugin's own test::

    import irgen.testing as it
    from irgen.testing import conformance

    import irgen_mine

    def test_my_serializer(irgen_plugin, tmp_path):
        irgen_plugin(irgen_mine)                       # registered for this test only
        model = it.models.float_onnx(tmp_path / "m.onnx")
        ir = it.run_model(model, tmp_path / "out", serializer=["mine"])
        assert it.verify(tmp_path / "out")["passed"]
        conformance.check_serializer("mine", irgen_mine.parse, model=model, tmp=tmp_path)

What is here:

* :func:`registered` (a context manager; the ``irgen_plugin`` fixture uses it):
  the plugins given join every :class:`irgen.plugins.PluginHost` loaded while it
  is active (``irgen run``, ``irgen verify``, ``irgen plugins`` in this process), as
  if installed; on exit they are gone, with what they registered (their quantizers' recomputes
  too, and what the deprecated :func:`irgen.plugin.register_recompute` registered).
* :func:`plugin_host`: a loaded host (installed plugins plus the registered ones).
* :func:`run_model`: ``irgen run MODEL -o OUT ...`` in this process, through the
  same code as the command (:func:`irgen.cli.main`); a failure raises
  :class:`RunError` with irgen's message.
* :func:`verify`: ``irgen verify OUT`` as a result dict (single and entire by
  default; ``source`` runs the frontend's source runtime in this process, so a
  frontend registered for the test can run its model).
* :func:`read_tensor`: a tensor record's data file, read back as the backend that
  wrote it reads it.
* :func:`fresh_venv`: a new virtual environment beside this irgen with plugin projects
  ``pip install``ed into it (to test a plugin as users install it).
* :mod:`irgen.testing.models`: small ONNX models (float and quantized) to run.
* :mod:`irgen.testing.conformance`: the checks any plugin runs against itself.

Nothing here imports TVM, ONNX or a runtime until a function needs it.
"""

from __future__ import annotations

import contextlib
import io
import json
import sys
from pathlib import Path
from typing import Any, Iterable, Iterator, Sequence

from irgen.api import IrgenError
from irgen.cli import main
from irgen.irfile import tensor_records as records
from irgen.plugins import PluginHost
from irgen.safeio import load_npz_member

__all__ = ["RunError", "registered", "plugin_host", "run_model", "verify", "read_tensor", "tensor_records",
           "plugin_name", "fresh_venv", "venv_python"]


class RunError(IrgenError):
    """``irgen run`` (or another command) exited non-zero; ``code`` and ``stderr`` say how."""

    def __init__(self, message: str, code: int, stderr: str):
        super().__init__(message)
        self.code = code
        self.stderr = stderr


# -- plugins registered for a test ---------------------------------------------------------------

#: (name, plugin) registered by the active :func:`registered` blocks, innermost last
_ACTIVE: list[tuple[str, Any]] = []
_ORIGINAL_LOAD: Any = None
_INSTALLED_IMPORTED = False


def plugin_name(plugin: Any) -> str:
    """The name a plugin object is registered under by default: its module's (or class's) name."""
    return str(getattr(plugin, "__name__", None) or type(plugin).__name__)


def _load_with_registered(self, *args: Any, **kwargs: Any):
    """:meth:`PluginHost.load`, then the plugins of the active :func:`registered` blocks."""
    _ORIGINAL_LOAD(self, *args, **kwargs)
    for name, plugin in list(_ACTIVE):
        if not self.pm.is_registered(plugin) and not self.pm.has_plugin(name) and not self.pm.is_blocked(name):
            self.register_plugin(plugin, name)
    return self


@contextlib.contextmanager
def registered(*plugins: Any, names: Sequence[str] | None = None) -> Iterator[Any]:
    """Make ``plugins`` (modules or objects with ``@hookimpl`` functions) part of every plugin
    host loaded inside the block, as if installed; yields a loaded host that has them.

    On exit they are removed, and so is every recompute and consistency check registered
    meanwhile with the deprecated :func:`irgen.plugin.register_recompute`. One of ``plugins`` whose hook fails
    or that registers a name another plugin has is an error here, not a warning (an
    installed plugin that fails to load stays a warning, as in ``irgen``)."""
    global _ORIGINAL_LOAD
    from irgen import quant

    global _INSTALLED_IMPORTED
    names = list(names) if names is not None else [plugin_name(p) for p in plugins]
    if len(names) != len(plugins):
        raise ValueError("give one name per plugin")
    if not _INSTALLED_IMPORTED:  # the installed plugins' import-time registrations (their recomputes)
        PluginHost().load()     # belong to the saved state: a module imported in the block never
        _INSTALLED_IMPORTED = True  # registers again after they are dropped on exit
    saved = (dict(quant.RECOMPUTE), dict(quant.CONSISTENCY))
    if _ORIGINAL_LOAD is None:
        _ORIGINAL_LOAD = PluginHost.load
        PluginHost.load = _load_with_registered
    added = list(zip(names, plugins))
    _ACTIVE.extend(added)
    quant.forget_default_host()  # verify's recompute without a host of its own sees them
    try:
        host = PluginHost().load()
        for name, plugin in added:
            if not host.pm.is_registered(plugin):
                info = {i["name"]: i for i in host.describe()}.get(name) or {}
                why = info.get("error") or ("blocked" if info.get("status") == "blocked" else "a plugin of that name exists")
                raise IrgenError(f"plugin {name!r} could not be registered: {why}")
        yield host
    finally:
        for item in added:
            _ACTIVE.remove(item)
        if not _ACTIVE and _ORIGINAL_LOAD is not None:
            PluginHost.load = _ORIGINAL_LOAD
            _ORIGINAL_LOAD = None
        for live, old in zip((quant.RECOMPUTE, quant.CONSISTENCY), saved):
            live.clear()
            live.update(old)
        quant.forget_default_host()


def plugin_host(*plugins: Any) -> Any:
    """A :class:`irgen.plugins.PluginHost` with the installed plugins, the ones of the active
    :func:`registered` blocks, and ``plugins`` (registered under :func:`plugin_name`)."""
    host = PluginHost().load()
    for plugin in plugins:
        if not host.pm.is_registered(plugin):
            host.register_plugin(plugin, plugin_name(plugin))
    return host


# -- running and verifying ----------------------------------------------------------------------

def _cli(argv: list[str]) -> tuple[int, str, str]:
    """``irgen ARGV`` in this process: (exit code, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    return code, out.getvalue(), err.getvalue()


def run_model(model: str | Path, out: str | Path, *, backend: str | None = None,
              serializer: str | Iterable[str] | None = None, quantizer: str | None = None,
              frontend: str | None = None, inputs: Iterable[str | Path] = (), seed: int | None = None,
              opt_level: int | None = None, force: bool = False, args: Iterable[str] = ()) -> dict[str, Any]:
    """Run ``irgen run MODEL -o OUT`` with these options (``args``: any further command-line
    arguments) through :func:`irgen.cli.main`, the command's own code, and return ``OUT/ir.json``.

    The plugins of the active :func:`registered` blocks (the ``irgen_plugin`` fixture) take
    part as installed ones do. Raises :class:`RunError` with irgen's error line when the
    command fails."""
    argv = ["run", str(model), "-o", str(out), "--no-progress"]
    for flag, value in (("--backend", backend), ("--quantizer", quantizer), ("--frontend", frontend),
                        ("--seed", seed), ("--opt-level", opt_level)):
        if value is not None:
            argv += [flag, str(value)]
    for name in [serializer] if isinstance(serializer, str) else (serializer or []):
        argv += ["--serializer", name]
    for spec in inputs:
        argv += ["--input", str(spec)]
    if force:
        argv.append("--force")
    argv += [str(a) for a in args]
    code, _, err = _cli(argv)
    if code != 0:
        lines = [line for line in err.splitlines() if line.startswith("irgen:")] or err.splitlines() or [""]
        raise RunError(f"irgen {' '.join(argv)} exited {code}: {lines[-1]}", code, err)
    return json.loads((Path(out) / "ir.json").read_text(encoding="utf-8"))


def verify(out: str | Path, *, modes: Sequence[str] = ("single", "entire"), model: str | Path | None = None,
           source_runner: Any = None, host: Any = None, thresholds: Any = None, check: bool = False,
           **kwargs: Any) -> dict[str, Any]:
    """``irgen verify OUT`` as its result dict (``passed``, ``summary``, ``layers``, ``problems``...).

    ``modes``: any of ``single``, ``entire``, ``source``. For ``source`` without a
    ``source_runner`` the recorded frontend's runner runs in this process (``irgen
    verify`` runs it in a child process), so a frontend registered for the test works;
    ``model`` names the source model when it moved. ``thresholds``: an
    :class:`irgen.verify.Thresholds`. With ``check`` a failure raises AssertionError
    showing verify's table. ``kwargs`` go to :func:`irgen.verify.verify_output`."""
    from irgen.verify import format_table, load_ir, source_runner_for, verify_output

    host = host or plugin_host()
    if "source" in modes and source_runner is None:
        source_runner, model = source_runner_for(Path(out), load_ir(out), Path(model) if model else None, host)
    result = verify_output(out, modes=tuple(modes), thresholds=thresholds, source_runner=source_runner,
                           model=model, host=host, **kwargs)
    if check and not result["passed"]:
        raise AssertionError(f"irgen verify {out} failed:\n{format_table(result)}")
    return result


def tensor_records(ir: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every tensor record of ``ir.json`` that names a data file (graph inputs and outputs, each
    layer's inputs, outputs and parameters), each file once."""
    seen: set[str] = set()
    for _, _, t in records(ir):
        if isinstance(t, dict) and t.get("file") and t["file"] not in seen:
            seen.add(t["file"])
            yield t


def read_tensor(out: str | Path, record: dict[str, Any], backend: Any = None) -> Any:
    """The data file of tensor ``record`` (from ``OUT/ir.json``) as a numpy array: read by
    ``backend.read_tensor`` when the backend (an :class:`irgen.plugin.Backend`) has one,
    a member of a ``--compress`` output's ``.npz``, else as ``.npy``."""
    import numpy as np

    path = Path(out) / record["file"]
    if path.suffix == ".npz":  # irgen run --compress

        return load_npz_member(path, record["name"], "tensor")
    if backend is not None and backend.read_tensor is not None and not path.name.endswith(".npy"):
        return np.asarray(backend.read_tensor(path, record))
    return np.load(path, allow_pickle=False)


# -- a fresh environment beside irgen ---------------------------------------------------------

def venv_python(folder: str | Path) -> Path:
    """The python of the virtual environment in ``folder``."""
    import os

    return Path(folder) / ("Scripts/python.exe" if os.name == "nt" else "bin/python")


def fresh_venv(folder: str | Path, *projects: str | Path) -> Path:
    """A new virtual environment in ``folder`` that sees this interpreter's packages (irgen
    included; nothing is downloaded), with ``projects`` (plugin project folders) ``pip
    install``ed into it, as a user installs a plugin beside irgen; returns its python.

    The projects are installed with ``--no-deps --no-build-isolation`` (their build backend,
    setuptools, and their dependencies come from this interpreter)."""
    import site
    import subprocess

    folder = Path(folder)
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(folder)], check=True)
    py = venv_python(folder)
    if sys.prefix != sys.base_prefix:
        # this interpreter is itself a venv (CI's): --system-site-packages reaches the base
        # interpreter's packages only, so the new venv also reads this one's (.pth files included)
        purelib = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                 check=True, capture_output=True, text=True).stdout.strip()
        lines = [f"import site; site.addsitedir({p!r})" for p in site.getsitepackages()]
        Path(purelib, "zz_parent_venv.pth").write_text("\n".join(lines) + "\n", encoding="utf-8")
    if projects:
        pip = subprocess.run([str(py), "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-input",
                              "--disable-pip-version-check", "-q", *map(str, projects)], capture_output=True, text=True)
        if pip.returncode != 0:
            raise RuntimeError(f"pip install {' '.join(map(str, projects))} failed:\n{pip.stdout}{pip.stderr}")
    return py


from irgen.testing import models  # noqa: E402  (light: its functions import onnx when called)
