"""irgen_npu_int8: irgen's backend for a typical int8 NPU, and its C-header serializer.

It registers, through ``irgen.plugin`` alone (API 1.1: ``Backend.store_tensor``):

* the backend ``npu-int8``: the layers a conv/dense + bias + activation NPU runs
  (:data:`FUSION_RULES`), its table of ops and constraints checked before anything
  is compiled (:mod:`.constraints`), and its golden data: NHWC activations, OHWI
  weights, channels padded with zeros to a multiple (:mod:`.layout`), each tensor
  as raw little-endian ``.bin``, ``$readmemh`` ``.hex`` and ``.npy``
  (:mod:`.formats`, :mod:`.store`);
* the serializer ``npu-int8-header``: ``npu_int8_layers.h``, a C header of layer
  descriptors (:mod:`.serializer`);
* for ``irgen compare`` (API 1.7): the dump reader ``npu-int8`` and the signature
  ``npu-int8-dense-channels`` (:mod:`.dump`).

Settings (:class:`.settings.Settings`): the channel multiple (default 16) and the
hex word width (default 8 bits); ``irgen run`` takes them as ``--npu-channel-multiple N``
and ``--npu-hex-width BITS`` (``irgen_register_options``, read in ``irgen_configure``).
"""

from __future__ import annotations

import irgen.plugin
from irgen.plugin import Backend, FusionRule, Option, Serializer, hookimpl

from . import constraints, dump, serializer, settings, store

__version__ = "0.1.0"

_major, _minor = map(int, irgen.plugin.API_VERSION.split("."))
if _major != 2:
    raise ImportError(f"irgen_npu_int8 needs irgen.plugin API 2.x, this irgen has "
                      f"{irgen.plugin.API_VERSION}")

ACTIVATIONS = frozenset({"relax.nn.relu", "relax.clip"})
FUSION_RULES = [
    FusionRule("mac_bias_act", frozenset({"relax.nn.conv2d", "relax.matmul"}), (frozenset({"relax.add"}), ACTIVATIONS)),
    FusionRule("eltwise_act", frozenset({"relax.add"}), (ACTIVATIONS,)),
    FusionRule("pool", frozenset({"relax.nn.max_pool2d", "relax.nn.avg_pool2d"}), ()),
]


@hookimpl
def irgen_register_backends(register):
    register(Backend(
        name="npu-int8",
        fusion_rules=FUSION_RULES,
        supported_ops=None,  # every layer outside the table is named by check_layer, with the reason
        layout=None,  # NCHW and NHWC models alike: activations are stored NHWC
        store_tensor=store.store_tensor,
        read_tensor=store.read_tensor,
        check_layer=constraints.check_layer,
        constraints=constraints.TABLE,
        description="int8 NPU: conv/dense + bias + activation layers, NHWC activations, OHWI weights, channels "
                    "padded to a multiple, .bin/.hex/.npy golden data",
    ))


@hookimpl
def irgen_register_dump_readers(register):
    register(dump.READER)


@hookimpl
def irgen_register_signatures(register):
    register(dump.SIGNATURE)


@hookimpl
def irgen_register_serializers(register):
    register(Serializer(name="npu-int8-header", write=serializer.write,
                        description=f"{serializer.FILE}: a C header of npu-int8 layer descriptors (physical shapes, "
                                    "padding, data files)"))


@hookimpl
def irgen_register_options(register):
    register(Option(name="npu_channel_multiple", kind="int", default=settings.Settings.channel_multiple, metavar="N",
                    group="npu-int8 backend",
                    help="pad channels (activations' C, weights' and biases' O) with zeros to a multiple of N "
                         "(1: no padding; default %(default)s)"))
    register(Option(name="npu_hex_width", kind="int", default=settings.Settings.hex_word_bits, metavar="BITS",
                    group="npu-int8 backend",
                    help="width of one word of the .hex files: 8, 16, 32 or 64 (default %(default)s); a wider "
                         "element gets words as wide as it, a narrower one is sign-extended"))


@hookimpl
def irgen_configure(options):
    settings.current = settings.Settings(channel_multiple=options["npu_channel_multiple"],
                                         hex_word_bits=options["npu_hex_width"])
