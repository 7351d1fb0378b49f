"""Recompute and consistency: verify's numpy recompute of the kinds the engine records.

Registered on import, under this scheme's name (schemes built on qdq, such as pow2,
find them there): ONNX Runtime's CPU kernels for any kind (``*``), the requantized
plain int8 ops (``integer``: max pool, reshape...), and irgen's built-in qdq kinds.
"""

from __future__ import annotations

from irgen.plugin import QDQ_RECOMPUTE, recompute_qdq, recompute_requantized, register_recompute

from .realize import SCHEME

#: kind -> recompute function, registered for :data:`~irgen_qdq.realize.SCHEME`, in this order
RECOMPUTE = {
    "*": recompute_qdq,  # ONNX Runtime's CPU kernels
    "integer": recompute_requantized,  # plain int8 ops (max pool, reshape...)
    **QDQ_RECOMPUTE,
}


def register() -> None:
    """Register every function of :data:`RECOMPUTE` for the scheme."""
    for kind, fn in RECOMPUTE.items():
        register_recompute(SCHEME, kind, fn)


register()
