"""``import tvm`` without what irgen does not use: torch unless a model needs it, and three
more costs of TVM's import (0.9-1.2 s of it in all).

``tvm_ffi``'s ``__init__``, ``_convert`` and Cython ``core`` import torch if it is installed (a
workaround for a Windows symbol clash), which costs 1-1.5 s of every ``irgen run``
although only ``.pt2`` models use torch. :func:`install` puts an import hook in
place that refuses torch to tvm_ffi's modules only (they fall back to their
"torch is not installed" path); when torch is imported later by anyone else (the
torch frontend), the hook hands it to the tvm_ffi modules that refused it, as if it had been
there from the start, so torch dtypes and tensors convert as usual.

The other costs, cut by the same hook and :func:`install`:

* ``tvm.runtime`` tries to import ``tvm.runtime.disco`` (the distributed runtime), which
  fails at that point whatever irgen does: its object types live in
  ``libtvm_runtime_extra``, loaded later if at all, and TVM catches the error and sets
  ``tvm.runtime.disco = None``. The failing type lookup costs 0.4-0.5 s (tvm_ffi builds a
  C++ error for the unknown type key); the hook refuses that import up front, to
  ``tvm.runtime`` only, with the same result;
* ``tvm_ffi.registry.init_ffi_api`` lists every global function name again for each of
  TVM's 52 ``_ffi_api`` modules (a call into C per name, 0.25-0.4 s in all); while the
  ``tvm`` package executes, the list is kept and made again only when the number of
  functions changed (:func:`_names_kept`);
* TVM loads the Python hooks of its GPU and accelerator backends (CUDA, Metal, ROCm,
  Vulkan, Adreno, ...) at import: irgen compiles for the CPU (LLVM) only, so
  :func:`install` sets ``TVM_DEVICE_BACKEND_AUTOLOAD=0`` (TVM's own switch) unless the
  user set it.

:func:`unpin_threads` is the other environment default irgen gives TVM (thread binding);
the CLI and :mod:`irgen.vm` call it, this module being the one both import cheaply.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
from contextlib import contextmanager

#: modules (and their submodules) that import torch eagerly but only need it for torch tensors
_REFUSED_TO = ("tvm_ffi", "tvm.relax.base_py_module")


def _refused(name: str) -> bool:
    return any(name == m or name.startswith(m + ".") for m in _REFUSED_TO)


def _importer() -> str | None:
    """The module whose code runs the import statement being resolved."""
    f = sys._getframe(2)
    while f is not None:
        name = f.f_globals.get("__name__", "")
        if not name.startswith(("importlib", "_frozen_importlib")) and name != __name__:
            return name
        f = f.f_back
    return None


@contextmanager
def _names_kept():
    """``tvm_ffi.registry.list_global_func_names`` answered from the last list while the number
    of global functions is unchanged (they are only added while TVM imports)."""
    from tvm_ffi import registry

    original = registry.list_global_func_names
    kept: list = [None, []]

    def list_global_func_names() -> list[str]:
        functor = registry.get_global_func("ffi.FunctionListGlobalNamesFunctor")()
        count = functor(-1)
        if count != kept[0]:
            kept[:] = [count, [functor(i) for i in range(count)]]
        return list(kept[1])

    registry.list_global_func_names = list_global_func_names
    try:
        yield
    finally:
        registry.list_global_func_names = original


def _wrap_exec(spec, around) -> None:
    """``spec``'s module executed inside the context manager ``around``."""
    exec_module = spec.loader.exec_module

    def exec_inside(module):
        with around():
            exec_module(module)

    spec.loader.exec_module = exec_inside


class _Hook(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname == "tvm.runtime.disco" and _importer() == "tvm.runtime":
            raise ModuleNotFoundError("tvm.runtime.disco needs libtvm_runtime_extra, not loaded yet", name=fullname)
        if fullname == "tvm":
            spec = importlib.machinery.PathFinder.find_spec(fullname, path)
            if spec is not None and spec.loader is not None:
                _wrap_exec(spec, _names_kept)
            return spec
        if fullname != "torch":
            return None
        if _refused(_importer() or ""):
            raise ModuleNotFoundError("torch is imported by the frontend that needs it", name="torch")
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_and_tell_tvm(module):
            exec_module(module)
            for name, mod in list(sys.modules.items()):
                if _refused(name) and getattr(mod, "torch", False) is None:
                    mod.torch = module

        spec.loader.exec_module = exec_and_tell_tvm
        return spec


def install() -> None:
    """Refuse torch to tvm_ffi's eager imports, keep the function list while TVM imports, and
    load no GPU backend hooks (once per process; a no-op if tvm is loaded)."""
    os.environ.setdefault("TVM_DEVICE_BACKEND_AUTOLOAD", "0")
    if "tvm_ffi" in sys.modules or any(isinstance(f, _Hook) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, _Hook())


def unpin_threads() -> None:
    """Keep TVM from pinning the threads that run kernels to cores (``TVM_BIND_THREADS=0``
    unless the user set it). TVM binds a thread pool's threads when the pool is made, and
    a one-thread pool binds its caller to core 0: the ``-j`` workers of ``irgen run --inputs``
    (one kernel thread each on a 2-core machine) and a sweep's processes then all ran on
    core 0, one at a time. Binding changes no value."""
    os.environ.setdefault("TVM_BIND_THREADS", "0")
