"""Realization: every DQ -> op -> Q span in ONNX Runtime's integer arithmetic, through
irgen's QDQ engine (:func:`irgen.plugin.realize_qdq`, whose realizers are keyed by op kind)."""

from __future__ import annotations

from irgen.plugin import realize_qdq

SCHEME = "qdq"


def realize(qg) -> None:
    """Every DQ -> op -> Q span of ``qg`` in ONNX Runtime's integer arithmetic."""
    realize_qdq(qg, scheme=SCHEME)
