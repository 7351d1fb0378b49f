"""Compile and export the kernels on every core: what ``relax.build`` and ``export_library`` do,
with LLVM's work split across threads.

LLVM compiles one module on one thread: the optimization passes in ``tirx.build`` and the
machine code in ``write_to_file`` (ResNet-18: about 1 s and 1.8 s of a cold run). TVM's FFI
releases the GIL during both, so the kernels (the PrimFuncs of the lowered module) are cut
into one LLVM module per core (:func:`parts`), built and written in threads, and linked into
one shared library as ``export_library`` links its modules. The VM executable imports every
part, as it imports a BYOC library, and finds each kernel by name among its imports; the
exported library holds them all, so a loaded plan sees one library either way. Each kernel
is compiled alone in any case (no kernel calls another): which part it lands in changes no
instruction of it (``tests/test_schedule.py`` compares the bytes with one part).

TVM compiles into every kernel a check of each argument (type, rank, shape, dtype, strides,
alignment, device), with an error message per check: on a convolution of a quantized ResNet-18,
900 instructions beside the 1,400 that compute, and 44% of LLVM's time. When the caller
checks every argument itself before each call (``checked_by_caller``: irgen's executor,
:func:`irgen.vm.run_program`, against the kernels' signatures, :func:`signature`), the
kernels are built without them (TVM's ``tirx.disable_assert``); the computing code is the
same instructions either way.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any, Callable

from irgen import envflags

#: at most this many LLVM modules (and threads) per compile
MAX_PARTS = 8


def workers() -> int:
    """The threads LLVM gets: the cores this process may run on (``IRGEN_BUILD_THREADS`` caps it)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    cap = envflags.positive_int("IRGEN_BUILD_THREADS")
    if cap is not None:
        cores = min(cores, cap)
    return max(1, min(cores, MAX_PARTS))


def _threads(jobs: list[Callable[[], Any]]) -> list[Any]:
    """Run ``jobs`` on threads, one each; their results in order (the first error is raised)."""
    results: list[Any] = [None] * len(jobs)
    errors: list[BaseException] = []

    def one(i: int) -> None:
        try:
            results[i] = jobs[i]()
        except BaseException as err:  # noqa: BLE001  raised again below, in the caller's thread
            errors.append(err)

    if len(jobs) == 1:
        return [jobs[0]()]
    threads = [threading.Thread(target=one, args=(i,), name=f"irgen-llvm-{i}") for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


def parts(funcs: dict[Any, Any], n: int) -> list[dict[Any, Any]]:
    """``funcs`` (global var -> PrimFunc) dealt into at most ``n`` groups in turn, in the
    module's order (a network's kernels of one kind come in runs: dealing spreads them)."""
    items = list(funcs.items())
    n = max(1, min(n, len(items)))
    return [dict(items[i::n]) for i in range(n) if items[i::n]]


def signature(func: Any) -> list[tuple[tuple[int, ...], str]] | None:
    """(shape, dtype) of each parameter of the PrimFunc ``func``, in order, or None when one is
    not a buffer of a constant shape (a kernel whose arguments cannot be checked up front)."""
    import tvm
    from tvm.tirx.buffer import BufferType

    out = []
    for param in func.params:  # a buffer parameter is a var of a buffer type (shape, dtype)
        if not isinstance(param.ty, BufferType) or not all(isinstance(d, tvm.tirx.IntImm) for d in param.shape):
            return None
        out.append((tuple(int(d) for d in param.shape), str(param.dtype)))
    return out


def build(mod: Any, target: Any, checked_by_caller: bool = False) -> Any:
    """``relax.build(mod, target, relax_pipeline=None)``, the TIR kernels compiled by LLVM as
    :func:`workers` modules at once; ``checked_by_caller``: without TVM's argument checks in
    the kernels (the caller checks every argument against :func:`signature`)."""
    import tvm
    from tvm import relax, tirx
    from tvm.relax import _ffi_api as relax_api
    from tvm.relax.vm_build import VMExecutable

    attrs = dict(mod.attrs) if mod.attrs else {}
    ext_libs = list(attrs.get("external_mods", []))
    params = dict(attrs.get("const_name_to_constant", {}))
    builder = relax.ExecBuilder()
    leftover = relax_api.VMCodeGen(builder, mod)
    funcs = {gv: f for gv, f in leftover.functions.items() if isinstance(f, tirx.PrimFunc)}
    groups = parts(funcs, workers()) if funcs else []
    def build_part(group: dict) -> Any:
        # the PassContext of a thread is its own: the default one, plus the checks switch
        with tvm.transform.PassContext(config={"tirx.disable_assert": checked_by_caller}):
            return tirx.build(tvm.IRModule(group, attrs=leftover.attrs), target=target, pipeline="default")

    libs = _threads([lambda g=g: build_part(g) for g in groups])
    lib = libs[0] if libs else None
    rt = relax_api.VMLink(builder, target, lib, [*libs[1:], *ext_libs], params)
    return VMExecutable(rt)


def export_library(exe: Any, path: Path) -> None:
    """``exe.export_library(path)`` for a CPU executable, every LLVM module's machine code
    written on its own thread; the same shared library (its modules linked in the same way)."""
    import tempfile

    from tvm.runtime import _ffi_api as runtime_api
    from tvm.support import cc

    root = exe.mod
    modules = root._collect_dso_modules()
    if any(m.kind != "llvm" for m in modules):
        exe.export_library(str(path))  # not a plain CPU build: TVM's own export
        return
    with tempfile.TemporaryDirectory(prefix="irgen-export-") as tmp:
        files = [os.path.join(tmp, f"lib{i}.o") for i in range(len(modules))]
        _threads([lambda m=m, f=f: m.write_to_file(f) for m, f in zip(modules, files)])
        if root.imports:
            llvm_target = modules[0].get_function("_get_target_string")() if modules else None
            if llvm_target:
                devc = os.path.join(tmp, "devc.o")
                runtime_api.ModulePackImportsToLLVM(root, False, llvm_target, "").write_to_file(devc)
            else:
                devc = os.path.join(tmp, "devc.c")
                Path(devc).write_text(runtime_api.ModulePackImportsToC(root, False, ""))
            files.append(devc)
        cc.create_shared(str(path), files)
