"""Run a compiled plan with TVM's Relax VM through ``tvm_ffi`` alone.

Importing the whole ``tvm`` package (compiler, Relax, TIR: 1.3-1.5 s) is needed to
compile, not to run: the VM lives in ``libtvm_runtime``, and ``tvm_ffi`` loads the
exported kernel library and calls the VM's functions (what ``relax.VirtualMachine``
does in Python). A run whose plan comes from the compile cache therefore never
imports ``tvm``. The capture is the same either way: :class:`irgen.plan.PlanKernel`
calls in order, each output handed to ``on_output`` before the VM reuses its storage.

Most plans never start the VM: :func:`run_program` calls the compiled kernels of the
library itself, in the order of ``main``'s bindings (:func:`irgen.execute.program`),
loading each constant just before the kernel that reads it and dropping every tensor
after its last use, so memory stays flat in the number of layers. The VM (:func:`run`)
is the fallback for a ``main`` the program cannot express.
"""

from __future__ import annotations

import ctypes
import importlib.util
from pathlib import Path
from typing import Any, Callable

import numpy as np

from irgen import spill
from irgen.api import IrgenError
from irgen.lean_import import unpin_threads

_CPU = 1  # DLPack kDLCPU
_POOLED_ALLOCATOR = 2  # relax.VirtualMachine.POOLED_ALLOCATOR
_runtime_loaded = False


def _load_runtime() -> None:
    """``libtvm_runtime`` (the VM, the thread pool) into the process, without ``import tvm``."""
    global _runtime_loaded
    unpin_threads()
    if _runtime_loaded:
        return
    spec = importlib.util.find_spec("tvm")
    folders = list(spec.submodule_search_locations or []) if spec else []
    for folder in folders:
        for lib in (Path(folder) / "lib" / "libtvm_runtime.so", Path(folder) / "libtvm_runtime.so"):
            if lib.is_file():
                ctypes.CDLL(str(lib), mode=ctypes.RTLD_GLOBAL)
                _runtime_loaded = True
                return
    raise IrgenError("TVM's runtime library libtvm_runtime.so was not found beside the tvm package")


def load_library(path: Path) -> Any:
    """The kernel library ``Plan.save`` exported, loaded as a runtime module."""
    import tvm_ffi

    _load_runtime()
    return tvm_ffi.load_module(str(path))


def to_numpy(tensor: Any) -> np.ndarray:
    """A copy of a VM tensor (its storage is reused after the instrument returns); an
    array of :func:`run_program` as it is (never written again)."""
    if isinstance(tensor, np.ndarray):
        return tensor
    if str(tensor.dtype) == "bfloat16":  # DLPack's bfloat16 is no numpy dtype: its bits, viewed as ml_dtypes'
        bits = np.array(np.from_dlpack(_view(tensor, "uint16")), copy=True)
        return bits.view(np.dtype("bfloat16"))
    return np.array(np.from_dlpack(tensor), copy=True)


def to_ffi(x: np.ndarray) -> Any:
    """A TVM tensor viewing ``x`` (an ml_dtypes bfloat16 array through its bits: DLPack export
    takes no bfloat16 numpy array)."""
    import tvm_ffi

    if x.dtype.name == "bfloat16":
        return _view(tvm_ffi.from_dlpack(x.view(np.uint16)), "bfloat16")
    return tvm_ffi.from_dlpack(x)


def _view(tensor: Any, dtype: str) -> Any:
    """``tensor``'s memory as ``dtype`` of the same width. TVM's runtime Tensor class has the
    view; a tensor made before ``tvm.runtime`` is imported (a stored library run from the compile
    cache imports only the FFI) is of the FFI's base class, which does not: the method is called
    on it all the same."""
    import tvm.runtime

    return tvm.runtime.Tensor._create_view(tensor, tensor.shape, dtype)


ALIGN = 64  # TVM's kernels assume their buffers are 64-byte aligned, as the VM allocates them


def aligned_empty(shape, dtype) -> np.ndarray:
    """An uninitialized C-ordered array whose data is ``ALIGN``-byte aligned."""
    dtype = np.dtype(dtype)
    n = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    buf = np.empty(n + ALIGN, np.uint8)
    off = -buf.ctypes.data % ALIGN
    return buf[off:off + n].view(dtype).reshape(shape)


def aligned(arr: np.ndarray) -> np.ndarray:
    """``arr`` itself when it is C-ordered and aligned, else an aligned copy."""
    if arr.flags.c_contiguous and arr.ctypes.data % ALIGN == 0:
        return arr
    out = aligned_empty(arr.shape, arr.dtype)
    out[...] = arr
    return out


class _Capture:
    """VM instrument: matches calls to the kernel sequence and hands over outputs."""

    def __init__(self, kernels: list, on_output: Callable[[int, int, Any], None]):
        self.kernels = kernels
        self.on_output = on_output
        self.pos = 0

    def __call__(self, func, name, before_run, ret_value, *args):
        if before_run or self.pos >= len(self.kernels):
            return 0
        k = self.kernels[self.pos]
        if name != k.symbol:
            return 0
        outs = [ret_value] if k.callee == "vm.builtin.reshape" else list(args[len(args) - len(k.outputs):])
        for j, t in enumerate(outs):
            self.on_output(self.pos, j, t)
        self.pos += 1
        return 0


def run(lib: Any, inputs: list[np.ndarray], kernels: list, on_output: Callable[[int, int, Any], None]) -> None:
    """Run ``main`` of ``lib`` (a runtime module, or a freshly built executable) on
    ``inputs``, calling ``on_output(kernel index, output index, tensor)`` after each kernel."""
    import tvm_ffi

    if hasattr(lib, "jit"):  # a tvm Executable straight from the compiler
        lib = lib.jit()
    _load_runtime()
    vm = lib["vm_load_executable"]()
    vm["vm_initialization"](_CPU, 0, _POOLED_ALLOCATOR)
    cap = _Capture(kernels, on_output)
    vm["set_instrument"](tvm_ffi.convert(cap))
    # 64-byte aligned: kernels built for AVX load whole vectors with aligned moves
    vm["main"](*[to_ffi(aligned(np.asarray(x))) for x in inputs])
    if cap.pos != len(kernels):
        raise IrgenError(f"internal: saw {cap.pos} of {len(kernels)} kernel calls")


def run_program(lib: Any, program: dict[str, Any], kernels: list, inputs: list[np.ndarray],
                const: Callable[[int], np.ndarray], on_output: Callable[[int, int, Any], None]) -> None:
    """Run ``program`` (:func:`irgen.execute.program`) with the kernels of ``lib`` on
    ``inputs``, calling ``on_output(kernel index, output index, array)`` after each kernel.
    ``const(i)`` gives constant ``i``; it is asked for just before each step that reads it
    and dropped after, as is every tensor after its last use (memory flat in the layers)."""
    import tvm_ffi

    if hasattr(lib, "jit"):  # a tvm Executable straight from the compiler
        lib = lib.jit()
    _load_runtime()
    steps = program["steps"]
    last: dict[str, int] = {}  # var -> the last step that reads it
    for i, step in enumerate(steps):
        for a in _reads(step):
            if isinstance(a, str):
                last[a] = i
    env: dict[str, Any] = {}
    for name, x in zip(program["inputs"], inputs):
        env[name] = aligned(np.asarray(x))
    funcs: dict[str, Any] = {}

    def value(a):
        return env[a] if isinstance(a, str) else aligned(const(a))

    for i, step in enumerate(steps):
        kind = step[0]
        if kind == "k":
            _, ki, args, var = step
            k = kernels[ki]
            f = funcs.get(k.symbol)
            if f is None:
                f = funcs[k.symbol] = lib.get_function(k.symbol, query_imports=True)
            outs = [aligned_empty(shape, dtype) for shape, dtype in k.out_types]
            values = [*(value(a) for a in args), *outs]
            if k.arg_types is not None:
                check_arguments(k.callee, values, k.arg_types)
            f(*[to_ffi(x) for x in values])
            spill.release(*values[:len(args)])  # a weight kept on disk leaves memory again
            del values  # a constant lives no longer than its kernel call
            for j, o in enumerate(outs):
                on_output(ki, j, o)
            env[var] = outs[0] if len(outs) == 1 else outs
        elif kind == "r":
            _, ki, arg, var = step
            shape, _dtype = kernels[ki].out_types[0]
            out = value(arg).reshape(shape)  # a view, as vm.builtin.reshape's
            on_output(ki, 0, out)
            env[var] = out
        elif kind == "t":
            env[step[1]] = env[step[2]][step[3]]
        elif kind == "a":
            env[step[1]] = env[step[2]]
        elif kind == "T":
            env[step[1]] = [env[a] for a in step[2]]
        else:
            raise IrgenError(f"internal: unknown program step {step!r:.80}")
        for a in _reads(step):
            if isinstance(a, str) and last.get(a) == i:
                env.pop(a, None)
        defined = step[3] if kind in ("k", "r") else step[1]
        if defined not in last:  # never read (a model output): captured already
            env.pop(defined, None)


def check_arguments(callee: str, values: list[np.ndarray], types: list[tuple[tuple[int, ...], str]]) -> None:
    """IrgenError unless ``values`` are what kernel ``callee`` was compiled for: as many, each
    of its shape and dtype, C-contiguous and 64-byte aligned. Kernels that irgen runs this way
    are built without TVM's own checks (:func:`irgen.parallel_build.build`): a wrong array
    (a damaged cache file, an input of another shape) must stop here, not read past its end."""
    if len(values) != len(types):
        raise IrgenError(f"internal: kernel {callee} takes {len(types)} arguments, was given {len(values)}")
    for n, (x, (shape, dtype)) in enumerate(zip(values, types)):
        if tuple(x.shape) != tuple(shape) or str(x.dtype) != dtype or not x.flags.c_contiguous \
                or (x.size and x.ctypes.data % ALIGN):  # an empty array reads no memory
            raise IrgenError(f"kernel {callee}, argument {n}: an array of shape {tuple(x.shape)} and dtype {x.dtype}"
                             f"{'' if x.flags.c_contiguous else ', not contiguous'}"
                             f"{', not aligned' if x.size and x.ctypes.data % ALIGN else ''}; the kernel was compiled for "
                             f"shape {tuple(shape)} and dtype {dtype} (a compile cache file changed? run with --no-cache)")


def _reads(step: list) -> list:
    """The vars and constants ``step`` reads."""
    return [step[2]] if step[0] in ("r", "t", "a") else step[2]  # "k", "T": a list


def use_threads(threads: int) -> int:
    """Run this process's kernels on ``threads`` threads: for a worker process, from the thread
    that runs its kernels; returns the size of that thread's TVM thread pool. TVM reads
    ``TVM_NUM_THREADS`` at every parallel kernel (1: the kernel runs on the calling thread
    alone; unset: half the cores on x86, for hyper-threading) and when a thread's pool is made,
    on its first parallel kernel; the pool is the thread's for its life, so a thread that ran
    one before keeps its size (and a pool inherited through ``fork`` has lost its threads)."""
    import os

    import tvm_ffi

    _load_runtime()
    os.environ["TVM_NUM_THREADS"] = str(threads)
    return int(tvm_ffi.get_global_func("runtime.NumThreads")())
