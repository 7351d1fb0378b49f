"""The ``qdq`` quantization-fusion scheme: ONNX QuantizeLinear/DequantizeLinear, and torch's
reference-quantized graphs.

``onnxruntime.quantization.quantize_static(..., quant_format=QuantFormat.QDQ)``
writes DequantizeLinear -> float op -> QuantizeLinear spans; ONNX Runtime's CPU
provider fuses them into integer kernels (QLinearConv, QGemm, QLinearAdd,
QLinearMul, QLinearSoftmax, lookup tables...). For int8 activations compare
with ORT created with ``session.qdqisint8allowed=1`` (see docs/quantization.md). torch's
reference-quantized ``.pt2`` programs (the ``torch-qdq`` dialect) quantize around float
ops the same way but compute them in float32 and quantize with torch's own rounding;
their records say ``"reference": "torch"``.

This scheme claims the quantized graphs of both dialects and realizes each span in the
source runtime's integer arithmetic, bit for bit; verify recomputes each layer from its
``quant`` record with the same arithmetic in numpy (``Quantizer.recompute``) and checks
a conv/dense layer's requant scales against its scales (``Quantizer.consistency``).

Public API
----------

A scheme built on this one (``pow2``, a vendor's fixed-point scheme) declares the
``irgen-qdq`` distribution as a dependency and imports from this package only these
names (``__all__``); every submodule is private and may change in any release:

* ``realize(qg, scheme="qdq", conv_requant=None)``: realize every DQ -> op -> Q span of
  ``qg`` (an ``irgen.plugin.QGraph``) in place. ``conv_requant(qg, acc, scale, out, lo, hi,
  axis, ndim, tensor) -> (expr, requant)`` replaces ONNX Runtime's float requantization of
  a convolution's or dense layer's int32 accumulator ``acc`` (a Relax variable): ``scale``
  is the float32 ``s_x * s_w[c] / s_y`` per channel on ``axis`` of an ``ndim`` tensor,
  ``out`` the output's ``QTensor``, ``[lo, hi]`` the integer clamp; it returns the output
  expression (built with ``qg.emit``, cast to ``out.dtype``) and the record's ``requant``
  dict. ``scheme`` names the records (``quant.scheme``), so verify finds the calling
  scheme's recompute.
* ``RECOMPUTE``: quant kind -> verify's numpy recompute ``fn(layer, inputs, params)`` of
  every kind ``realize`` records (``"*"``: the kinds without their own entry). A scheme built
  on qdq gives ``Quantizer(recompute={**irgen_qdq.RECOMPUTE, "conv2d": mine, ...})``.
* ``consistency(layer) -> str | None``: the check that a conv/dense record's
  ``requant.scale`` follows from its scales (for ``Quantizer.consistency``; a scheme that
  replaces the requantization checks its own values).
* ``detect(qg)`` and ``DIALECTS``: whether ``qg`` is a quantized graph of a dialect this
  scheme realizes (``"onnx-qdq"``, ``"torch-qdq"``).
* ``SCHEME``: ``"qdq"``.
* ``API_VERSION``: ``"MAJOR.MINOR"`` of this list, versioned as ``irgen.plugin``'s is.

Modules: :mod:`irgen_qdq.detect` (which graphs the scheme claims), :mod:`irgen_qdq.realize`
(the realization, its realizers keyed by op kind: :mod:`~irgen_qdq.conv`,
:mod:`~irgen_qdq.kernels`, :mod:`~irgen_qdq.pooling`, :mod:`~irgen_qdq.concat`,
:mod:`~irgen_qdq.operands`, :mod:`~irgen_qdq.float_span`, :mod:`~irgen_qdq.transformer`,
:mod:`~irgen_qdq.torch_spans`; :mod:`~irgen_qdq.blockwise`: weight-only layers of 4-bit block weights,
:mod:`~irgen_qdq.float8`: float8 quantize -> dequantize pairs), :mod:`irgen_qdq.recompute` (verify's recompute and
consistency check), :mod:`irgen_qdq.ort` and :mod:`irgen_qdq.torch_ref` (each runtime's
arithmetic in numpy); this module registers the scheme.
"""

from __future__ import annotations

from irgen.plugin import Quantizer, hookimpl

from .detect import DIALECTS, detect
from .realize import SCHEME, realize
from .recompute import RECOMPUTE, consistency

__version__ = "0.1.0"
#: the version of the public API listed in this module's docstring (``__all__``)
API_VERSION = "1.0"
__all__ = ["API_VERSION", "DIALECTS", "RECOMPUTE", "SCHEME", "consistency", "detect", "realize"]


@hookimpl
def irgen_register_quantizers(register):
    register(
        Quantizer(
            name=SCHEME,
            detect=detect,
            realize=realize,
            priority=10,
            description="ONNX QuantizeLinear/DequantizeLinear models, bit-exact with ONNX Runtime's CPU kernels",
            recompute=RECOMPUTE,
            consistency=consistency,
            runtime_exact=True,  # its integer kernels are the runtime's, bit for bit
        )
    )
