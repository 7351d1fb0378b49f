"""irgen_acme: an example third-party irgen plugin for the (fictional) acme NPU.

It registers, through ``irgen.plugin`` alone (the only irgen module it imports; its scheme
builds on the ``qdq`` scheme through that plugin's public API, ``irgen_qdq.__all__``, and
declares the ``irgen-qdq`` distribution as a dependency):

* the quantization scheme ``acme-qdq`` (:mod:`irgen_acme.scheme`): symmetric
  int8 ONNX QDQ models, convolutions and dense layers requantized in fixed
  point; its numpy recompute for ``irgen verify`` (:mod:`irgen_acme.recompute`);
* the backend ``acme-npu`` (:mod:`irgen_acme.backend`): its layer fusion, its
  constraints (``check_layer``), raw little-endian ``.bin`` data files written
  and read back;
* the serializer ``acme-header`` (:mod:`irgen_acme.header`): a C header of
  layer descriptors beside ``ir.json``.

Install it next to irgen (``pip install examples/vendor_plugin``), then::

    irgen run model_int8.onnx -o out --quantizer acme-qdq --backend acme-npu --serializer acme-header
    irgen verify out
"""

from __future__ import annotations

import irgen.plugin
from irgen.plugin import Backend, Quantizer, Serializer, hookimpl

from . import backend, header, recompute, scheme

__version__ = "0.1.0"

_major, _minor = map(int, irgen.plugin.API_VERSION.split("."))
if _major != 2:
    raise ImportError(f"irgen_acme is written against irgen.plugin API 2.x, this irgen has {irgen.plugin.API_VERSION}")


@hookimpl
def irgen_register_quantizers(register):
    register(Quantizer(
        name=scheme.SCHEME,
        detect=scheme.detect,
        realize=scheme.realize,
        priority=5,  # after qdq and pow2: chosen automatically only when they are not installed
        description="symmetric int8 ONNX QDQ models, fixed-point requantization (acme NPU)",
        recompute=recompute.RECOMPUTE,  # what irgen verify recomputes each layer kind with
    ))


@hookimpl
def irgen_register_backends(register):
    register(Backend(
        name="acme-npu",
        fusion_rules=backend.FUSION_RULES,
        supported_ops=None,
        layout="NCHW",
        write_tensor=backend.write_tensor,
        read_tensor=backend.read_tensor,
        check_layer=backend.check_layer,
        description="acme NPU: conv/dense + bias + activation layers, NCHW, kernels up to 7x7, raw .bin data",
    ))


@hookimpl
def irgen_register_serializers(register):
    register(Serializer(name="acme-header", write=header.write,
                        description="acme_layers.h: a C header of layer descriptors (name, op, tensor shapes)"))
