"""The CPU irgen compiles its kernels for (:func:`spec`) and its part of compile-cache keys."""

from __future__ import annotations

import json
from typing import Any

from irgen import envflags

#: environment switch: a true value compiles for LLVM's generic CPU of the architecture
#: (x86-64: SSE2) instead of this machine's CPU
ENV_GENERIC = "IRGEN_GENERIC_CPU"

#: LLVM's optimization level for the kernels (TVM's default is 3). The schedule already
#: vectorizes, tiles and unrolls the loops (:mod:`irgen.schedule`), so LLVM's -O3 adds little
#: to the kernels' speed and half the compile time (ResNet-18: compile and export 6.7 -> 4.2 s,
#: kernels 0.48 -> 0.56 s). No level changes a value: without fast-math flags LLVM keeps IEEE
#: semantics at every level (tests/test_schedule.py compares the bytes with -O3's).
LLVM_OPT_LEVEL = 1

#: LLVM features turned off on this machine's CPU: fused multiply-add (see :func:`spec`)
HOST_MATTR = ["-fma", "-fma4"]


def spec() -> dict[str, Any]:
    """The LLVM target kernels are compiled for: this machine's CPU (its vector units: AVX2,
    AVX-512) with fused multiply-add turned off, so every float kernel rounds each product
    and each sum as the generic target does: the same golden values on every x86 CPU,
    faster (``IRGEN_GENERIC_CPU=1``, or a CPU LLVM cannot name: the generic target).

    TVM lets LLVM contract a multiply and an add into one FMA wherever the target has one,
    which rounds once instead of twice; ``-fma`` (which also turns off AVX-512, built on
    it) keeps that from happening. Other architectures keep the generic target."""
    generic = {"kind": "llvm", "opt-level": LLVM_OPT_LEVEL}
    if _generic():
        return generic
    from tvm.target import codegen

    try:
        cpu = str(codegen.llvm_get_system_cpu())
    except Exception:  # noqa: BLE001  an LLVM without host detection: generic
        return generic
    if not cpu or cpu == "generic":
        return generic
    return {**generic, "mcpu": cpu, "mattr": list(HOST_MATTR)}


def _generic() -> bool:
    import platform

    return (envflags.switch(ENV_GENERIC)
            or platform.machine().lower() not in {"x86_64", "amd64"})


def _cpu_identity() -> str | None:
    """This CPU as /proc/cpuinfo describes it (vendor, family, model, name, feature flags), or
    None where it cannot be read. Two machines that read the same get the same LLVM CPU."""
    from pathlib import Path

    try:
        text = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None
    first = text.split("\n\n", 1)[0]
    fields = {}
    for line in first.splitlines():
        name, _, value = line.partition(":")
        name = name.strip()
        if name in {"vendor_id", "cpu family", "model", "model name", "flags"}:
            fields[name] = " ".join(sorted(value.split())) if name == "flags" else value.strip()
    return json.dumps(fields, sort_keys=True) if fields.get("flags") else None


def key() -> str:
    """The target as text, for compile caches (a library compiled for one CPU is not reused on
    another). It never imports ``tvm``: a run whose plan is cached must not pay for it (the
    CPU is named by /proc/cpuinfo; where that cannot be read, by LLVM through :func:`spec`)."""
    import platform

    if _generic():
        return json.dumps({"kind": "llvm", "arch": platform.machine().lower(), "opt-level": LLVM_OPT_LEVEL},
                          sort_keys=True)
    cpu = _cpu_identity()
    if cpu is None:
        return json.dumps(spec(), sort_keys=True)
    return json.dumps({"kind": "llvm", "arch": platform.machine().lower(), "cpu": cpu, "mattr": HOST_MATTR,
                       "opt-level": LLVM_OPT_LEVEL}, sort_keys=True)
