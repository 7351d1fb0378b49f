"""The CPU irgen compiles its kernels for (:func:`spec`) and its part of compile-cache keys."""

from __future__ import annotations

from typing import Any

#: environment switch: a true value compiles for LLVM's generic CPU of the architecture
#: (x86-64: SSE2) instead of this machine's CPU
ENV_GENERIC = "IRGEN_GENERIC_CPU"


def spec() -> dict[str, Any]:
    """The LLVM target kernels are compiled for: this machine's CPU (its vector units: AVX2,
    AVX-512) with fused multiply-add turned off, so every float kernel rounds each product
    and each sum as the generic target does: the same golden values on every x86 CPU,
    faster (``IRGEN_GENERIC_CPU=1``, or a CPU LLVM cannot name: the generic target).

    TVM lets LLVM contract a multiply and an add into one FMA wherever the target has one,
    which rounds once instead of twice; ``-fma`` (which also turns off AVX-512, built on
    it) keeps that from happening. Other architectures keep the generic target."""
    import os
    import platform

    if os.environ.get(ENV_GENERIC, "").strip().lower() in {"1", "true", "yes", "on"}:
        return {"kind": "llvm"}
    if platform.machine().lower() not in {"x86_64", "amd64"}:
        return {"kind": "llvm"}
    from tvm.target import codegen

    try:
        cpu = str(codegen.llvm_get_system_cpu())
    except Exception:  # noqa: BLE001  an LLVM without host detection: generic
        return {"kind": "llvm"}
    if not cpu or cpu == "generic":
        return {"kind": "llvm"}
    return {"kind": "llvm", "mcpu": cpu, "mattr": ["-fma", "-fma4"]}


def key() -> str:
    """The target as text, for compile caches (a library compiled for one CPU is not reused on another)."""
    import json

    return json.dumps(spec(), sort_keys=True)
